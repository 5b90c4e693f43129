//! The decode step's matrix-vector product on the GPU: a weight matrix
//! uploaded once (f32, or Q8_0, Q4_0 or Q4_1 as GGUF stores them), then
//! `y = W x` for each vector, one workgroup per row (`matvec.wgsl`).

use wgpu::util::DeviceExt;

use super::device::Gpu;
use super::error::GpuError;

/// Values per block of every block format here.
const BLOCK: usize = 32;
/// Workgroups along x before the grid wraps to y (the WebGPU limit).
const MAX_GRID_X: u32 = 65_535;

/// How a matrix's values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Format {
    /// Bytes of one block of 32 values (f32: of 32 values too).
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4 * BLOCK,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
        }
    }
}

/// A weight matrix in the GPU's memory.
pub struct GpuMatrix {
    buffer: wgpu::Buffer,
    pub rows: usize,
    pub cols: usize,
    pub format: Format,
}

impl Gpu {
    /// Uploads `rows` x `cols` f32 values, row after row.
    pub fn upload_f32(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<GpuMatrix, GpuError> {
        if values.len() != rows * cols || values.is_empty() {
            return Err(GpuError::Shape(format!(
                "{} values for a {rows} x {cols} matrix",
                values.len()
            )));
        }
        Ok(self.upload(bytemuck::cast_slice(values), rows, cols, Format::F32))
    }

    /// Uploads a matrix of 32-value blocks as GGUF stores it (`format`
    /// Q8_0, Q4_0 or Q4_1): each row `cols / 32` blocks.
    pub fn upload_blocks(
        &self,
        format: Format,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<GpuMatrix, GpuError> {
        let fits = format != Format::F32
            && cols > 0
            && cols.is_multiple_of(BLOCK)
            && bytes.len() == rows * cols / BLOCK * format.block_bytes();
        if !fits {
            return Err(GpuError::Shape(format!(
                "{} bytes for a {format:?} {rows} x {cols} matrix (columns a multiple of {BLOCK})",
                bytes.len()
            )));
        }
        // The kernel reads u32 words: the last one is padded.
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().next_multiple_of(4), 0);
        Ok(self.upload(&padded, rows, cols, format))
    }

    fn upload(&self, bytes: &[u8], rows: usize, cols: usize, format: Format) -> GpuMatrix {
        let buffer = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("weights"),
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE,
            });
        GpuMatrix {
            buffer,
            rows,
            cols,
            format,
        }
    }

    /// `W x`, one value per row of `W`.
    pub fn matvec(&self, matrix: &GpuMatrix, x: &[f32]) -> Result<Vec<f32>, GpuError> {
        if x.len() != matrix.cols {
            return Err(GpuError::Shape(format!(
                "a vector of {} for a matrix of {} columns",
                x.len(),
                matrix.cols
            )));
        }
        let rows =
            u32::try_from(matrix.rows).map_err(|_| GpuError::Shape("too many rows".into()))?;
        let cols =
            u32::try_from(matrix.cols).map_err(|_| GpuError::Shape("too many columns".into()))?;
        let grid_x = rows.min(MAX_GRID_X);
        let grid_y = rows.div_ceil(grid_x);
        let input = self.storage("x", bytemuck::cast_slice(x), wgpu::BufferUsages::empty());
        let out_bytes = (matrix.rows * 4) as wgpu::BufferAddress;
        let output = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("y"),
            size: out_bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let shape = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("shape"),
                contents: bytemuck::cast_slice(&[rows, cols, grid_x, 0u32]),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let pipeline = match matrix.format {
            Format::F32 => &self.kernels.matvec_f32,
            Format::Q8_0 => &self.kernels.matvec_q8_0,
            Format::Q4_0 => &self.kernels.matvec_q4_0,
            Format::Q4_1 => &self.kernels.matvec_q4_1,
        };
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("matvec"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                entry(0, &matrix.buffer),
                entry(1, &input),
                entry(2, &output),
                entry(3, &shape),
            ],
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("matvec"),
            });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("matvec"),
                timestamp_writes: None,
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(grid_x, grid_y, 1);
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read back"),
            size: out_bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        encoder.copy_buffer_to_buffer(&output, 0, &staging, 0, out_bytes);
        let submitted = self.queue.submit(Some(encoder.finish()));
        self.read_back(&staging, submitted)
    }

    fn storage(&self, label: &str, bytes: &[u8], extra: wgpu::BufferUsages) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE | extra,
            })
    }

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

fn entry(binding: u32, buffer: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buffer.as_entire_binding(),
    }
}
