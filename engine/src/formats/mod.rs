//! Model files: GGUF ([`gguf`]) and Hugging Face folders of safetensors
//! ([`hf_dir`] for the folder and its config.json, [`hf_source`] for the
//! tensors), each a [`crate::model::TensorSource`] that hands over only the
//! tensors a shard needs.

pub mod gguf;
pub mod hf_dir;
pub mod hf_source;
