//! Serving: requests in, tokens out. A [`batch::Batch`] schedules many
//! sequences' steps on one [`executor::Executor`] (this machine alone, or
//! rank 0 driving a distributed group), with [`sampler`] picking each token
//! and [`speculative`] drafting ahead; a [`Session`] runs one request at a
//! time on a batch of one.
//!
//! A request goes prompt → tokens → chunked prefill (with progress) →
//! decode loop: sample, detokenize without splitting UTF-8, hold back text
//! that may start a stop string, parse thinking and tool calls, stream.
//!
//! Files, bottom up: [`request`] (the vocabulary: requests, events, errors),
//! [`loaded`] (a model with its tokenizer and template), [`sampler`],
//! [`executor`], [`speculative`], [`batch`], [`session`].

pub mod batch;
pub mod executor;
pub mod loaded;
pub mod request;
pub mod sampler;
pub mod session;
pub mod speculative;

pub use loaded::{load_transformer, model_config, LoadedModel};
pub use request::{
    Constraint, EngineError, FinishReason, GenerateRequest, GenerationEvent, GenerationOutput,
    GenerationStats, Prompt, TokenLogprob, ToolChoice, DEFAULT_PREFILL_CHUNK,
};
pub use session::Session;
