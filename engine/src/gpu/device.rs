//! A device opened on one adapter, with the kernels compiled for it.

use super::adapter::{enumerate, report, AdapterReport};
use super::error::GpuError;
use super::kernels::Kernels;

/// A device opened on one adapter, with the kernels compiled for it.
pub struct Gpu {
    pub report: AdapterReport,
    /// Whether the matrix products add a row's lanes across a subgroup.
    pub subgroups: bool,
    /// Whether products of several token rows run over token tiles.
    pub token_tiles: bool,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) kernels: Kernels,
    /// What a plain matrix product binds where a routed one reads its
    /// routes (`matvec_common.wgsl`).
    pub(super) no_routes: wgpu::Buffer,
}

impl Gpu {
    /// Opens adapter `index` (`None`: the first that is not a software
    /// one, else the first), using subgroups where it has them.
    pub fn open(index: Option<usize>) -> Result<Self, GpuError> {
        Self::open_with(index, GpuOptions::default())
    }

    /// [`Gpu::open`] with `options` (the tests run each way).
    pub fn open_with(index: Option<usize>, options: GpuOptions) -> Result<Self, GpuError> {
        let all = enumerate();
        let chosen = match index {
            Some(index) => index,
            None => all
                .iter()
                .position(|a| a.get_info().device_type != wgpu::DeviceType::Cpu)
                .unwrap_or(0),
        };
        let Some(adapter) = all.get(chosen) else {
            return Err(if all.is_empty() {
                GpuError::NoAdapter
            } else {
                GpuError::NoSuchAdapter {
                    index: chosen,
                    count: all.len(),
                }
            });
        };
        let report = report(chosen, adapter);
        let subgroups = options.subgroups
            && adapter.features().contains(wgpu::Features::SUBGROUP)
            && adapter.get_info().subgroup_min_size >= 8;
        let descriptor = wgpu::DeviceDescriptor {
            label: Some("tessera"),
            required_features: if subgroups {
                wgpu::Features::SUBGROUP
            } else {
                wgpu::Features::empty()
            },
            required_limits: adapter.limits(),
            ..Default::default()
        };
        let (device, queue) =
            pollster::block_on(adapter.request_device(&descriptor)).map_err(|e| {
                GpuError::Device {
                    adapter: report.name.clone(),
                    reason: e.to_string(),
                }
            })?;
        // A device error is logged, never a panic of the node.
        device.on_uncaptured_error(std::sync::Arc::new(|error: wgpu::Error| {
            tracing::error!(%error, "GPU error");
        }));
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let kernels = Kernels::new(&device, subgroups, options.token_tiles);
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device {
                adapter: report.name.clone(),
                reason: format!("compiling the kernels: {error}"),
            });
        }
        let no_routes = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("no routes"),
            size: 8,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        Ok(Self {
            report,
            subgroups,
            token_tiles: kernels.has_tiles(),
            device,
            queue,
            kernels,
            no_routes,
        })
    }
}

/// How a device's kernels are compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuOptions {
    /// The matrix products add a row's lanes across a subgroup where the
    /// adapter has subgroups of 8 lanes or more (else in workgroup
    /// memory; both give the same bits).
    pub subgroups: bool,
    /// Products of several token rows (a prompt, a batch) read each block
    /// of W once per tile of 8 rows (else once per row; both give the same
    /// bits).
    pub token_tiles: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self {
            subgroups: true,
            token_tiles: true,
        }
    }
}

/// Where a model runs: `auto` (a hardware GPU if this machine has one the
/// model fits and runs on, else the CPU), `cpu`, `gpu` (the first hardware
/// adapter, else the first) or `gpu:N` (adapter N of `tessera devices`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    #[default]
    Auto,
    Cpu,
    Gpu(Option<usize>),
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "gpu" => Ok(Self::Gpu(None)),
            _ => text
                .strip_prefix("gpu:")
                .and_then(|n| n.parse().ok())
                .map(|n| Self::Gpu(Some(n)))
                .ok_or_else(|| {
                    format!(
                        "`{text}` is not a device: auto, cpu, gpu or gpu:N (see `tessera devices`)"
                    )
                }),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Gpu(None) => f.write_str("gpu"),
            Self::Gpu(Some(n)) => write!(f, "gpu:{n}"),
        }
    }
}

/// The adapter `auto` takes for `bytes` of weights: the first hardware one
/// (never a software rasterizer, which runs on the same CPU cores, slower
/// than the CPU engine) whose memory holds them, where its memory is known.
pub fn adapter_for(bytes: u64) -> Option<usize> {
    super::adapter::adapters()
        .into_iter()
        .find(|a| {
            a.kind != super::AdapterKind::Cpu && (a.memory_bytes == 0 || a.memory_bytes >= bytes)
        })
        .map(|a| a.index)
}
