//! The GPU, through wgpu: Vulkan on Linux and Windows, Metal on macOS,
//! DX12 on Windows, one WGSL source for every card. What is here: the
//! adapters a machine has ([`adapters`]), a device opened on one ([`Gpu`]),
//! and the decode step's matrix-vector product for f32, Q8_0, Q4_0 and Q4_1
//! weights ([`matvec`]), checked against an exact reference on any adapter,
//! Mesa's lavapipe included. The forward pass over these operations comes
//! next (issue 47).

pub mod adapter;
pub mod device;
pub mod error;
mod kernels;
pub mod matvec;

pub use adapter::{adapters, AdapterKind, AdapterReport};
pub use device::Gpu;
pub use error::GpuError;
