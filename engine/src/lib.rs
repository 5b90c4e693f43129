//! The inference engine: what part of a model a process owns, loading it,
//! running it, and generating text from it.
//!
//! # Layout
//! Bottom up; a module uses only those above it in this list (and a
//! folder's files only their own earlier siblings).
//! - [`memory`], [`threadpool`], [`ops`], [`logits`]: peak memory, the
//!   compute threads, norms/RoPE/softmax, reductions over a row of logits.
//! - [`quant`]: weight matrices in native formats and their products with
//!   activations (our own AVX2/AVX-512/NEON/scalar kernels, llama.cpp's
//!   rounding).
//! - [`dist`]: [`dist::shard::ShardSpec`] (the part of a model one rank
//!   owns, and the splitting rules placement and loading share), the
//!   [`dist::collectives::Group`] of a distributed model's ranks, and the
//!   secured TCP ring between them.
//! - [`formats`]: model files (GGUF; Hugging Face folders of safetensors)
//!   as [`model::TensorSource`]s that hand over only the tensors a shard
//!   needs.
//! - [`model`]: the configuration every architecture reduces to, one file
//!   per architecture, the paged KV pool, and the shared decoder
//!   ([`model::Transformer`], a folder: load, split, layer, head).
//! - [`text`]: tokenizer, chat templates, and what turns tokens back into
//!   text (UTF-8 streaming, stop strings, thinking and tool-call parsing).
//! - [`serve`]: requests in, tokens out: the executor of one rank's steps,
//!   the sampler, speculative decoding, continuous batching, and a
//!   one-request [`serve::Session`].
//! - [`embed`]: texts in, vectors out: sentence-transformers models (a
//!   BERT-style encoder, pooling, normalisation).
//! - [`gpu`]: the GPU through wgpu: adapters, a device, WGSL kernels (the
//!   decode step's matrix-vector product so far).
//!
//! # Invariants
//! - **The engine knows nothing of actors, zenoh or HTTP**: no dependency on
//!   ractor, zenoh or axum; callers drive it through plain types.
//! - **Decoding allocates nothing per token** in the forward pass: buffers
//!   live in [`model::Workspace`] and the KV cache reserves its room up front.

pub mod dist;
pub mod embed;
pub mod formats;
pub mod gpu;
pub mod logits;
pub mod memory;
pub mod model;
pub mod ops;
pub mod quant;
pub mod serve;
pub mod speed;
pub mod text;
pub mod threadpool;
