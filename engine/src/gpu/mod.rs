//! The GPU, through wgpu: Vulkan on Linux and Windows, Metal on macOS,
//! DX12 on Windows, one WGSL source for every card. What is here: the
//! adapters a machine has ([`adapters`]), a device opened on one ([`Gpu`]),
//! buffers and a [`Step`] that records one forward pass's kernels into one
//! submission, and the kernels themselves: matrix products for every GGUF
//! format the CPU runs ([`matvec`]), RMS norms, rotary embeddings,
//! gated activations and paged attention ([`ops`]), a mixture of
//! experts' routing ([`moe`]) and Gated DeltaNet's recurrence
//! ([`deltanet`]). The model's forward pass over them is
//! `model::transformer::gpu`.

pub mod adapter;
pub mod deltanet;
pub mod device;
pub mod error;
mod kernels;
pub mod kv;
pub mod matvec;
pub mod moe;
pub mod ops;
pub mod step;

pub use adapter::{adapters, AdapterKind, AdapterReport};
pub use device::{adapter_for, DeviceChoice, Gpu, GpuOptions};
pub use error::GpuError;
pub use kv::GpuKv;
pub use step::{GpuBuffer, Step};
