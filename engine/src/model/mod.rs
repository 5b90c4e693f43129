//! Model definitions: the configuration every architecture reduces to, the
//! weights of one shard, and the forward pass.
//!
//! Each architecture is one file ([`llama`], [`qwen`], [`phi3`],
//! [`smollm3`], [`olmo2`], [`gemma`]) that reads its
//! configuration and states its quirks (biases, q/k norms, RoPE pairing,
//! experts); they share one decoder ([`transformer`]) built from
//! [`crate::ops`], with the mixture-of-experts MLP in [`moe`].

mod attention;
pub mod config;
pub mod deltanet;
pub mod gather;
pub mod gemma;
pub mod llama;
pub mod moe;
pub mod olmo2;
pub mod paged;
pub mod phi3;
pub mod qwen;
pub mod qwen35;
pub mod smollm3;
pub mod transformer;
pub mod weights;

pub use config::{
    Activation, Architecture, LayerRope, ModelConfig, MoeConfig, RopeScaling, Variant,
};
pub use transformer::{ForwardOutput, KvCache, SeqSpan, StageInput, Transformer, Workspace};
pub use weights::{LoadError, Matrix, TensorSource};
