//! What goes wrong on the GPU: the bottom of the `gpu` folder.

/// Why the GPU cannot do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter on this machine (on Linux: a Vulkan driver, e.g. Debian's mesa-vulkan-drivers)")]
    NoAdapter,
    #[error("no GPU adapter {index}: this machine has {count}")]
    NoSuchAdapter { index: usize, count: usize },
    #[error("opening a device on {adapter}: {reason}")]
    Device { adapter: String, reason: String },
    #[error("reading back from the GPU: {0}")]
    ReadBack(String),
    #[error("{0}")]
    Shape(String),
    #[error("{what} takes {bytes} bytes, more than the {most} one GPU buffer may hold here")]
    TooLarge { what: String, bytes: u64, most: u64 },
    #[error("the GPU refused a step: {0}")]
    Step(String),
    #[error("the GPU cannot run this model yet: {0}")]
    Unsupported(String),
}
