//! Model definitions: the configuration every architecture reduces to, the
//! weights of one shard, and the forward pass.
//!
//! Each architecture is one file ([`llama`], [`qwen`]) that reads its
//! configuration and states its quirks (biases, q/k norms, RoPE pairing,
//! experts); they share one decoder ([`transformer`]) built from
//! [`crate::ops`], with the mixture-of-experts MLP in [`moe`].

pub mod config;
pub mod llama;
pub mod moe;
pub mod qwen;
pub mod transformer;
pub mod weights;

pub use config::{Architecture, ModelConfig, MoeConfig, RopeScaling};
pub use transformer::{ForwardOutput, KvCache, SeqSpan, StageInput, Transformer, Workspace};
pub use weights::{LoadError, Matrix, TensorSource};
