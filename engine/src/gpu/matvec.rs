//! The matrix products on the GPU: a weight matrix uploaded once (f32, or
//! Q8_0, Q4_0 or Q4_1 as GGUF stores them), then `y[t] = W x[t]` for each
//! token's vector, 8 rows of one token per workgroup (`matvec.wgsl`). The
//! block formats take x rounded to 8-bit blocks, as the CPU engine and
//! llama.cpp do ([`Step::quantize_q8`]).

use super::device::Gpu;
use super::error::GpuError;
use super::kernels::Kernel;
use super::step::{grid_for_values, grid_of, params, GpuBuffer, Step};

/// Rows of W per workgroup (matvec.wgsl's `ROWS`).
const ROWS_PER_GROUP: usize = 8;
/// Bytes of one 32-value block of 8-bit activations: 8 words of i8, the
/// scale and the scaled sum.
pub const Q8_BLOCK_BYTES: usize = 40;

/// A matrix product's input: f32 rows, or their 8-bit blocks.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    F32(&'a GpuBuffer),
    Q8(&'a GpuBuffer),
}

/// Values per block of every block format here.
const BLOCK: usize = 32;

/// How a matrix's values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Format {
    /// Whether its products take 8-bit activations.
    pub fn takes_q8(self) -> bool {
        self != Self::F32
    }

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
    buffer: GpuBuffer,
    pub rows: usize,
    pub cols: usize,
    pub format: Format,
}

impl GpuMatrix {
    /// Bytes it takes on the GPU.
    pub fn bytes(&self) -> u64 {
        self.buffer.bytes()
    }
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
        self.upload(bytemuck::cast_slice(values), rows, cols, Format::F32)
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
        self.upload(bytes, rows, cols, format)
    }

    fn upload(
        &self,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        format: Format,
    ) -> Result<GpuMatrix, GpuError> {
        let most = self.max_binding_bytes();
        if bytes.len() as u64 > most {
            return Err(GpuError::TooLarge {
                what: format!("a {format:?} matrix of {rows} x {cols}"),
                bytes: bytes.len() as u64,
                most,
            });
        }
        Ok(GpuMatrix {
            buffer: self.buffer_with("weights", bytes),
            rows,
            cols,
            format,
        })
    }

    /// `W x`, one value per row of `W`.
    pub fn matvec(&self, matrix: &GpuMatrix, x: &[f32]) -> Result<Vec<f32>, GpuError> {
        self.matmul(matrix, x, 1)
    }

    /// `W x[t]` for each of `tokens` vectors of `x`, one after another.
    pub fn matmul(
        &self,
        matrix: &GpuMatrix,
        x: &[f32],
        tokens: usize,
    ) -> Result<Vec<f32>, GpuError> {
        if tokens == 0 || x.len() != matrix.cols * tokens {
            return Err(GpuError::Shape(format!(
                "{} values for {tokens} vectors of {} columns",
                x.len(),
                matrix.cols
            )));
        }
        let input = self.buffer_with("x", bytemuck::cast_slice(x));
        let output = self.buffer("y", (matrix.rows * tokens * 4) as u64);
        let blocks = (matrix.cols * tokens).div_ceil(BLOCK);
        let quantized = self.buffer("x in 8 bits", (blocks * Q8_BLOCK_BYTES) as u64);
        let mut step = self.step();
        if matrix.format.takes_q8() {
            step.quantize_q8(&input, &quantized, tokens, matrix.cols)?;
            step.matmul(matrix, Input::Q8(&quantized), &output, tokens)?;
        } else {
            step.matmul(matrix, Input::F32(&input), &output, tokens)?;
        }
        step.read(&output, matrix.rows * tokens)
    }
}

impl Step<'_> {
    /// `tokens` rows of `cols` f32 values of `x` as 8-bit blocks into `xq`.
    pub fn quantize_q8(
        &mut self,
        x: &GpuBuffer,
        xq: &GpuBuffer,
        tokens: usize,
        cols: usize,
    ) -> Result<(), GpuError> {
        let blocks = tokens * cols / BLOCK;
        let fits = cols.is_multiple_of(BLOCK)
            && x.bytes() >= (tokens * cols * 4) as u64
            && xq.bytes() >= (blocks * Q8_BLOCK_BYTES) as u64;
        if !fits {
            return Err(GpuError::Shape(format!(
                "8-bit blocks of {tokens} rows of {cols}: buffers of {} and {} bytes",
                x.bytes(),
                xq.bytes()
            )));
        }
        let shape = params(&[blocks as u32]);
        let buffers = [None, Some(x), None, None, Some(xq)];
        let grid = grid_for_values(blocks);
        self.record(Kernel::QuantizeQ8, shape, &buffers, grid);
        Ok(())
    }

    /// `y[t] = W x[t]` for `tokens` rows of the input into rows of `y`:
    /// f32 rows for an f32 matrix, 8-bit blocks for the block formats.
    pub fn matmul(
        &mut self,
        matrix: &GpuMatrix,
        input: Input<'_>,
        y: &GpuBuffer,
        tokens: usize,
    ) -> Result<(), GpuError> {
        let (x, needed) = match input {
            Input::F32(x) => (x, matrix.cols * tokens * 4),
            Input::Q8(x) => (x, matrix.cols / BLOCK * tokens * Q8_BLOCK_BYTES),
        };
        let q8 = matches!(input, Input::Q8(_));
        let matches = q8 == matrix.format.takes_q8();
        let too_small = x.bytes() < needed as u64 || y.bytes() < (matrix.rows * tokens * 4) as u64;
        if !matches || too_small || tokens > super::step::MAX_GRID as usize {
            return Err(GpuError::Shape(format!(
                "{tokens} tokens of {} input through a {:?} {} x {} matrix into {} bytes",
                if q8 { "8-bit" } else { "f32" },
                matrix.format,
                matrix.rows,
                matrix.cols,
                y.bytes()
            )));
        }
        let kernel = match matrix.format {
            Format::F32 => Kernel::MatvecF32,
            Format::Q8_0 => Kernel::MatvecQ8_0,
            Format::Q4_0 => Kernel::MatvecQ4_0,
            Format::Q4_1 => Kernel::MatvecQ4_1,
        };
        let shape = params(&[matrix.rows as u32, matrix.cols as u32]);
        let buffers = match input {
            Input::F32(x) => [Some(&matrix.buffer), Some(x), Some(y), None],
            Input::Q8(xq) => [Some(&matrix.buffer), None, Some(y), Some(xq)],
        };
        let groups = matrix.rows.div_ceil(ROWS_PER_GROUP);
        self.record(kernel, shape, &buffers, grid_of(groups, tokens as u32));
        Ok(())
    }
}
