//! Buffers in the GPU's memory, and a [`Step`]: the kernels of one forward
//! pass recorded into one command submission, each with its own shape
//! parameters (one slice of a uniform buffer per dispatch, written once).

use std::num::NonZeroU64;

use wgpu::util::DeviceExt;

use super::device::Gpu;
use super::error::GpuError;
use super::kernels::Kernel;

/// Bytes of one dispatch's parameters: 16 words.
const PARAMS_BYTES: u64 = 64;
/// Workgroups along x before a grid wraps to y (the WebGPU limit).
pub(super) const MAX_GRID: u32 = 65_535;
/// Threads per workgroup of every kernel.
const THREADS: usize = 64;

/// A buffer in the GPU's memory (f32 values, u32 words or f16 pairs).
#[derive(Clone, Debug)]
pub struct GpuBuffer {
    pub(super) buffer: wgpu::Buffer,
}

impl GpuBuffer {
    pub fn bytes(&self) -> u64 {
        self.buffer.size()
    }
}

impl Gpu {
    /// A zeroed buffer of `bytes` (at least one word).
    pub fn buffer(&self, label: &str, bytes: u64) -> GpuBuffer {
        GpuBuffer {
            buffer: self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(4).next_multiple_of(4),
                usage: usage(),
                mapped_at_creation: false,
            }),
        }
    }

    /// A buffer holding `contents` (padded to whole words).
    pub fn buffer_with(&self, label: &str, contents: &[u8]) -> GpuBuffer {
        let mut padded = contents.to_vec();
        padded.resize(contents.len().max(4).next_multiple_of(4), 0);
        GpuBuffer {
            buffer: self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: &padded,
                    usage: usage(),
                }),
        }
    }

    /// Writes `bytes` (whole words) at the start of `buffer`, before the
    /// next submission runs.
    pub fn write(&self, buffer: &GpuBuffer, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.queue.write_buffer(&buffer.buffer, 0, bytes);
        }
    }

    /// Copies the first `bytes` of `from` into `to` (growing a buffer).
    pub fn copy(&self, from: &GpuBuffer, to: &GpuBuffer, bytes: u64) {
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(&from.buffer, 0, &to.buffer, 0, bytes);
        self.queue.submit(Some(encoder.finish()));
    }

    /// The largest buffer a kernel can bind on this device.
    pub fn max_binding_bytes(&self) -> u64 {
        let limits = self.device.limits();
        limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size)
    }

    /// A step to record kernels into.
    pub fn step(&self) -> Step<'_> {
        Step {
            gpu: self,
            params: Vec::new(),
            dispatches: Vec::new(),
        }
    }
}

fn usage() -> wgpu::BufferUsages {
    wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST
}

/// Kernels recorded for one submission.
pub struct Step<'g> {
    pub(super) gpu: &'g Gpu,
    params: Vec<u8>,
    dispatches: Vec<Dispatch>,
}

struct Dispatch {
    kernel: Kernel,
    /// A matrix product over tiles of token rows.
    tiled: bool,
    /// Binding 0 is the parameters; these are bindings 1, 2, ... (a
    /// `None` is a binding the kernel does not use).
    buffers: Vec<Option<wgpu::Buffer>>,
    params_at: u64,
    grid: [u32; 3],
}

/// A dispatch's parameters: 16 words, floats as their bits.
pub(super) type Params = [u32; 16];

/// `values` as the first words of a dispatch's parameters.
pub(super) fn params(values: &[u32]) -> Params {
    let mut all = [0u32; 16];
    for (out, value) in all.iter_mut().zip(values) {
        *out = *value;
    }
    all
}

/// A grid of `groups` workgroups, wrapped to y past [`MAX_GRID`] along x.
pub(super) fn grid_of(groups: usize, z: u32) -> [u32; 3] {
    let groups = groups.max(1) as u32;
    let x = groups.min(MAX_GRID);
    [x, groups.div_ceil(x), z]
}

/// The grid of one thread per value of `count`.
pub(super) fn grid_for_values(count: usize) -> [u32; 3] {
    grid_of(count.div_ceil(THREADS), 1)
}

impl<'g> Step<'g> {
    /// The device it records for.
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Records `kernel` over `grid` with `params` and `buffers` (bindings
    /// 1, 2, ... in order; `None` for one the kernel does not read).
    pub(super) fn record(
        &mut self,
        kernel: Kernel,
        params: Params,
        buffers: &[Option<&GpuBuffer>],
        grid: [u32; 3],
    ) {
        self.record_dispatch((kernel, false), params, buffers, grid);
    }

    /// [`Step::record`], of a matrix product over token tiles if `tiled`.
    pub(super) fn record_dispatch(
        &mut self,
        (kernel, tiled): (Kernel, bool),
        params: Params,
        buffers: &[Option<&GpuBuffer>],
        grid: [u32; 3],
    ) {
        let align = u64::from(self.gpu.device.limits().min_uniform_buffer_offset_alignment);
        let params_at = (self.params.len() as u64).next_multiple_of(align.max(PARAMS_BYTES));
        self.params.resize(params_at as usize, 0);
        self.params.extend_from_slice(bytemuck::cast_slice(&params));
        self.dispatches.push(Dispatch {
            kernel,
            tiled,
            buffers: buffers
                .iter()
                .map(|b| b.map(|b| b.buffer.clone()))
                .collect(),
            params_at,
            grid,
        });
    }

    /// Records the step's kernels into one command buffer, then a copy of
    /// `read`'s first `count` f32 values to where the CPU can map them.
    fn encode(
        &self,
        read: Option<(&GpuBuffer, usize)>,
    ) -> (wgpu::CommandBuffer, Option<wgpu::Buffer>) {
        let device = &self.gpu.device;
        let params = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: if self.params.is_empty() {
                &[0u8; PARAMS_BYTES as usize]
            } else {
                &self.params
            },
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let groups: Vec<wgpu::BindGroup> = self
            .dispatches
            .iter()
            .map(|d| self.bind_group(d, &params))
            .collect();
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("step"),
        });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("step"),
                timestamp_writes: None,
            });
            for (dispatch, group) in self.dispatches.iter().zip(&groups) {
                pass.set_pipeline(self.gpu.kernels.get(dispatch.kernel, dispatch.tiled));
                pass.set_bind_group(0, group, &[]);
                let [x, y, z] = dispatch.grid;
                pass.dispatch_workgroups(x, y, z);
            }
        }
        let staging = read.map(|(from, count)| {
            let bytes = (count * 4) as u64;
            let staging = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("read back"),
                size: bytes.max(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            encoder.copy_buffer_to_buffer(&from.buffer, 0, &staging, 0, bytes);
            staging
        });
        (encoder.finish(), staging)
    }

    fn bind_group(&self, dispatch: &Dispatch, params: &wgpu::Buffer) -> wgpu::BindGroup {
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: params,
                offset: dispatch.params_at,
                size: NonZeroU64::new(PARAMS_BYTES),
            }),
        }];
        for (index, buffer) in dispatch.buffers.iter().enumerate() {
            if let Some(buffer) = buffer {
                entries.push(wgpu::BindGroupEntry {
                    binding: index as u32 + 1,
                    resource: buffer.as_entire_binding(),
                });
            }
        }
        let pipeline = self.gpu.kernels.get(dispatch.kernel, dispatch.tiled);
        self.gpu
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            })
    }

    /// Runs the step; nothing comes back.
    pub fn submit(self) -> Result<(), GpuError> {
        let scope = self
            .gpu
            .device
            .push_error_scope(wgpu::ErrorFilter::Validation);
        let (commands, _) = self.encode(None);
        self.gpu.queue.submit(Some(commands));
        match pollster::block_on(scope.pop()) {
            Some(error) => Err(GpuError::Step(error.to_string())),
            None => Ok(()),
        }
    }

    /// Runs the step and reads the first `count` f32 values of `from`
    /// once it is done.
    pub fn read(self, from: &GpuBuffer, count: usize) -> Result<Vec<f32>, GpuError> {
        if (count * 4) as u64 > from.bytes() {
            return Err(GpuError::Shape(format!(
                "reading {count} values from a buffer of {} bytes",
                from.bytes()
            )));
        }
        let scope = self
            .gpu
            .device
            .push_error_scope(wgpu::ErrorFilter::Validation);
        let (commands, staging) = self.encode(Some((from, count)));
        let submitted = self.gpu.queue.submit(Some(commands));
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Step(error.to_string()));
        }
        match staging {
            Some(staging) => self.gpu.read_back(&staging, submitted),
            None => Ok(Vec::new()),
        }
    }
}

impl Gpu {
    /// The f32 values of a mapped-for-reading buffer once `submitted` ran.
    fn read_back(
        &self,
        staging: &wgpu::Buffer,
        submitted: wgpu::SubmissionIndex,
    ) -> Result<Vec<f32>, GpuError> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .slice(..)
            .map_async(wgpu::MapMode::Read, move |result| {
                let _ = tx.send(result);
            });
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(submitted),
                timeout: None,
            })
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        rx.recv()
            .map_err(|e| GpuError::ReadBack(e.to_string()))?
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let values = {
            let view = staging
                .slice(..)
                .get_mapped_range()
                .map_err(|e| GpuError::ReadBack(e.to_string()))?;
            bytemuck::cast_slice::<u8, f32>(&view).to_vec()
        };
        staging.unmap();
        Ok(values)
    }
}
