//! Model definitions: the configuration every architecture reduces to, the
//! weights of one shard, and the forward pass.
//!
//! Each architecture is one file ([`llama`], [`qwen`]) that reads its
//! configuration and states its quirks (biases, q/k norms, RoPE pairing);
//! they share one decoder ([`transformer`]) built from [`crate::ops`].

pub mod config;
pub mod llama;
pub mod qwen;
pub mod transformer;
pub mod weights;

pub use config::{Architecture, ModelConfig, RopeScaling};
pub use transformer::{ForwardOutput, KvCache, SeqSpan, StageInput, Transformer, Workspace};
pub use weights::{LoadError, Matrix, TensorSource};
