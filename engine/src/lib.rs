//! The inference engine: what part of a model a process owns, loading it,
//! running it, and generating text from it.
//!
//! # Layout
//! - [`shard`]: [`ShardSpec`], the part of a model one rank owns, and the
//!   pure splitting rules that placement and loading share.
//! - [`gguf`], [`hf_dir`], [`hf_source`]: model files (GGUF; Hugging Face
//!   folders of safetensors) as [`model::TensorSource`]s that hand over only
//!   the tensors a shard needs.
//! - [`model`]: the configuration every architecture reduces to, one file per
//!   architecture, and the shared decoder ([`model::Transformer`]).
//! - [`quant`]: weight matrices in native formats and their products with
//!   activations (our own AVX2/NEON/scalar kernels, llama.cpp's rounding).
//! - [`ops`]: norms, RoPE, softmax, SwiGLU.
//! - [`threadpool`]: the compute threads of the forward pass.
//! - [`collectives`]: the [`collectives::Group`] of a distributed model's
//!   ranks: single rank, or a TCP ring with timeouts on every operation.
//! - [`executor`]: one rank's forward steps, alone or driven by rank 0
//!   across a group (tensor or pipeline parallel).
//! - [`tokenizer`], [`chat_template`]: text to tokens, messages to text.
//! - [`generate`]: sessions with a KV cache; the request loop that ties
//!   [`sampler`], [`stop`], [`utf8_stream`] and [`output_parser`] together.
//!
//! # Invariants
//! - **The engine knows nothing of actors, zenoh or HTTP**: no dependency on
//!   ractor, zenoh or axum; callers drive it through plain types.
//! - **Decoding allocates nothing per token** in the forward pass: buffers
//!   live in [`model::Workspace`] and the KV cache reserves its room up front.

pub mod batch;
pub mod chat_template;
pub mod collectives;
pub mod executor;
pub mod generate;
pub mod gguf;
pub mod hf_dir;
#[doc(hidden)]
pub mod hf_export;
pub mod hf_source;
pub mod memory;
pub mod model;
pub mod ops;
pub mod output_parser;
pub mod paged;
pub mod quant;
pub mod ring_security;
pub mod sampler;
pub mod shard;
pub mod speculative;
pub mod stop;
#[doc(hidden)]
pub mod testing;
pub mod threadpool;
pub mod tokenizer;
pub mod utf8_stream;

pub use shard::{pipeline_stages, split_evenly, split_proportionally, ShardError, ShardSpec};
