//! The matrix products on the GPU: a weight matrix uploaded once as GGUF
//! stores it (f32, f16, bf16, the 32-value block formats or the K-quants),
//! then `y[t] = W x[t]` for each token's vector, 8 rows of one token per
//! workgroup (`matvec.wgsl`, `matvec_k.wgsl`), or of a tile of 8 tokens
//! where several go through W together ([`super::GpuOptions`]). The
//! block formats take x
//! rounded to 8-bit blocks of 32 ([`Step::quantize_q8`]) and the K-quants
//! to 8-bit blocks of 256 ([`Step::quantize_q8k`]), as the CPU engine and
//! llama.cpp do.

use super::device::Gpu;
use super::error::GpuError;
use super::kernels::{Kernel, TILE_TOKENS};
use super::step::{grid_for_values, grid_of, params, GpuBuffer, Step};

/// Rows of W per workgroup (matvec_common.wgsl's `ROWS`).
const ROWS_PER_GROUP: usize = 8;
/// Bytes of one 32-value block of 8-bit activations: 8 words of i8, the
/// scale and the scaled sum.
pub const Q8_BLOCK_BYTES: usize = 40;
/// Bytes of one 256-value block of 8-bit activations: 64 words of i8, the
/// f32 scale, and the sums of each 16 values as 16 words.
pub const Q8K_BLOCK_BYTES: usize = 81 * 4;
/// Values per block of 8-bit activations for the 32-value formats.
const BLOCK: usize = 32;

/// A matrix product's input: f32 rows, or their 8-bit blocks.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    F32(&'a GpuBuffer),
    /// Blocks of 32 ([`Step::quantize_q8`]).
    Q8(&'a GpuBuffer),
    /// Blocks of 256 ([`Step::quantize_q8k`]).
    Q8K(&'a GpuBuffer),
}

/// The input a format's products take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    F32,
    Q8,
    Q8K,
}

/// How a matrix's values are stored (GGUF's layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
    Q2K,
    Q3K,
}

impl Format {
    /// The input its products take.
    pub fn input(self) -> InputKind {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => InputKind::F32,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 => InputKind::Q8,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q2K | Self::Q3K => InputKind::Q8K,
        }
    }

    /// Values per block: 32, 256 for the K-quants, 2 for the 16-bit
    /// floats (a word), 1 for f32.
    pub fn block_values(self) -> usize {
        match self.input() {
            InputKind::Q8 => 32,
            InputKind::Q8K => 256,
            InputKind::F32 if self == Self::F32 => 1,
            InputKind::F32 => 2,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 4,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q2K => 84,
            Self::Q3K => 110,
        }
    }

    fn kernel(self) -> Kernel {
        match self {
            Self::F32 => Kernel::MatvecF32,
            Self::F16 => Kernel::MatvecF16,
            Self::Bf16 => Kernel::MatvecBf16,
            Self::Q8_0 => Kernel::MatvecQ8_0,
            Self::Q4_0 => Kernel::MatvecQ4_0,
            Self::Q4_1 => Kernel::MatvecQ4_1,
            Self::Q5_0 => Kernel::MatvecQ5_0,
            Self::Q5_1 => Kernel::MatvecQ5_1,
            Self::Q4K => Kernel::MatvecQ4K,
            Self::Q5K => Kernel::MatvecQ5K,
            Self::Q6K => Kernel::MatvecQ6K,
            Self::Q2K => Kernel::MatvecQ2K,
            Self::Q3K => Kernel::MatvecQ3K,
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

/// A mixture of experts' matrices (each `rows` x `cols`, all of one
/// format) one after another in one buffer, for [`Step::matmul_routed`].
pub struct GpuExperts {
    matrix: GpuMatrix,
    pub experts: usize,
    pub rows: usize,
}

impl GpuExperts {
    /// Bytes it takes on the GPU.
    pub fn bytes(&self) -> u64 {
        self.matrix.bytes()
    }

    pub fn format(&self) -> Format {
        self.matrix.format
    }
}

impl Gpu {
    /// Uploads experts' matrices, each `rows` x `cols` in `format` as
    /// GGUF stores it (f32: its values' bytes), one after another.
    pub fn upload_experts(
        &self,
        format: Format,
        experts: &[&[u8]],
        rows: usize,
        cols: usize,
    ) -> Result<GpuExperts, GpuError> {
        let one = experts.first().map_or(0, |e| e.len());
        if one == 0 || experts.iter().any(|e| e.len() != one) {
            return Err(GpuError::Shape(format!(
                "{} experts' {format:?} matrices, empty or of unequal sizes",
                experts.len()
            )));
        }
        let matrix = self.upload_bytes(format, &experts.concat(), rows * experts.len(), cols)?;
        Ok(GpuExperts {
            matrix,
            experts: experts.len(),
            rows,
        })
    }

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

    /// Uploads a matrix as GGUF stores it in `format` (not f32): each row
    /// `cols / format.block_values()` blocks.
    pub fn upload_blocks(
        &self,
        format: Format,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<GpuMatrix, GpuError> {
        if format == Format::F32 {
            return Err(GpuError::Shape(
                "f32 values go through upload_f32, not as blocks".into(),
            ));
        }
        self.upload_bytes(format, bytes, rows, cols)
    }

    /// Uploads a matrix's bytes in `format` (f32: its values' bytes).
    pub fn upload_bytes(
        &self,
        format: Format,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<GpuMatrix, GpuError> {
        let per_block = format.block_values();
        let fits = cols > 0
            && cols.is_multiple_of(per_block)
            && bytes.len() == rows * cols / per_block * format.block_bytes();
        if !fits {
            return Err(GpuError::Shape(format!(
                "{} bytes for a {format:?} {rows} x {cols} matrix (columns a multiple of {per_block})",
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
        let mut step = self.step();
        let quantized;
        let input = match matrix.format.input() {
            InputKind::F32 => Input::F32(&input),
            InputKind::Q8 => {
                let blocks = (matrix.cols * tokens).div_ceil(32);
                quantized = self.buffer("x in 8 bits", (blocks * Q8_BLOCK_BYTES) as u64);
                step.quantize_q8(&input, &quantized, tokens, matrix.cols)?;
                Input::Q8(&quantized)
            }
            InputKind::Q8K => {
                let blocks = (matrix.cols * tokens).div_ceil(256);
                quantized = self.buffer("x in 8 bits", (blocks * Q8K_BLOCK_BYTES) as u64);
                step.quantize_q8k(&input, &quantized, tokens, matrix.cols)?;
                Input::Q8K(&quantized)
            }
        };
        step.matmul(matrix, input, &output, tokens)?;
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

    /// `tokens` rows of `cols` f32 values of `x` as 8-bit blocks of 256
    /// (llama.cpp's Q8_K) into `xq`.
    pub fn quantize_q8k(
        &mut self,
        x: &GpuBuffer,
        xq: &GpuBuffer,
        tokens: usize,
        cols: usize,
    ) -> Result<(), GpuError> {
        let blocks = tokens * cols / 256;
        let fits = cols.is_multiple_of(256)
            && x.bytes() >= (tokens * cols * 4) as u64
            && xq.bytes() >= (blocks * Q8K_BLOCK_BYTES) as u64;
        if !fits {
            return Err(GpuError::Shape(format!(
                "8-bit blocks of 256 of {tokens} rows of {cols}: buffers of {} and {} bytes",
                x.bytes(),
                xq.bytes()
            )));
        }
        let shape = params(&[blocks as u32]);
        let buffers = [None, Some(x), None, None, Some(xq)];
        self.record(Kernel::QuantizeQ8K, shape, &buffers, grid_of(blocks, 1));
        Ok(())
    }

    /// `y[t] = W x[t]` for `tokens` rows of the input into rows of `y`:
    /// f32 rows for the float formats, 8-bit blocks for the others
    /// ([`Format::input`]).
    pub fn matmul(
        &mut self,
        matrix: &GpuMatrix,
        input: Input<'_>,
        y: &GpuBuffer,
        tokens: usize,
    ) -> Result<(), GpuError> {
        let product = Product {
            rows: matrix.rows,
            products: tokens,
            input_rows: tokens,
            x_per: 0,
        };
        let no_routes = GpuBuffer {
            buffer: self.gpu.no_routes.clone(),
        };
        self.product(matrix, product, input, [y, &no_routes])
    }

    /// A mixture of experts' products: row z of `y` = W_e x[z / x_per],
    /// W_e the matrix of expert `routes[2z]` ([`Step::route_experts`]),
    /// for `products` rows. The gate and up products of `t` tokens with
    /// k experts each take x_per = k; the down products (one input row
    /// each) x_per = 1.
    pub fn matmul_routed(
        &mut self,
        experts: &GpuExperts,
        input: Input<'_>,
        [y, routes]: [&GpuBuffer; 2],
        products: usize,
        x_per: usize,
    ) -> Result<(), GpuError> {
        if x_per == 0 || !products.is_multiple_of(x_per) || routes.bytes() < (products * 8) as u64 {
            return Err(GpuError::Shape(format!(
                "{products} routed products of {x_per} a row with {} bytes of routes",
                routes.bytes()
            )));
        }
        let product = Product {
            rows: experts.rows,
            products,
            input_rows: products / x_per,
            x_per,
        };
        self.product(&experts.matrix, product, input, [y, routes])
    }

    /// Records one product after checking every buffer holds its part.
    fn product(
        &mut self,
        matrix: &GpuMatrix,
        product: Product,
        input: Input<'_>,
        [y, routes]: [&GpuBuffer; 2],
    ) -> Result<(), GpuError> {
        let Product {
            rows,
            products,
            input_rows,
            x_per,
        } = product;
        let (x, kind, needed) = match input {
            Input::F32(x) => (x, InputKind::F32, matrix.cols * input_rows * 4),
            Input::Q8(x) => (
                x,
                InputKind::Q8,
                matrix.cols / 32 * input_rows * Q8_BLOCK_BYTES,
            ),
            Input::Q8K(x) => (
                x,
                InputKind::Q8K,
                matrix.cols / 256 * input_rows * Q8K_BLOCK_BYTES,
            ),
        };
        // A routed product's rows read different experts' rows of W, so
        // only a plain product shares each block of W across a tile.
        let tiled = self.gpu.token_tiles && x_per == 0 && products > 1;
        let per_group = if tiled { TILE_TOKENS } else { 1 };
        let matches = kind == matrix.format.input();
        let too_small = x.bytes() < needed as u64 || y.bytes() < (rows * products * 4) as u64;
        let groups_along_z = products.div_ceil(per_group);
        if !matches || too_small || groups_along_z > super::step::MAX_GRID as usize {
            return Err(GpuError::Shape(format!(
                "{products} rows of {kind:?} input through a {:?} {rows} x {} matrix into {} bytes",
                matrix.format,
                matrix.cols,
                y.bytes()
            )));
        }
        let shape = params(&[
            rows as u32,
            matrix.cols as u32,
            x_per as u32,
            products as u32,
        ]);
        let buffers = match input {
            Input::F32(x) => [
                Some(&matrix.buffer),
                Some(x),
                Some(y),
                None,
                None,
                Some(routes),
            ],
            Input::Q8(xq) | Input::Q8K(xq) => [
                Some(&matrix.buffer),
                None,
                Some(y),
                Some(xq),
                None,
                Some(routes),
            ],
        };
        let groups = rows.div_ceil(ROWS_PER_GROUP);
        self.record_dispatch(
            (matrix.format.kernel(), tiled),
            shape,
            &buffers,
            grid_of(groups, groups_along_z as u32),
        );
        Ok(())
    }
}

/// One dispatch of products: `products` rows of `rows` values from
/// `input_rows` rows of input (`x_per` of them a row when routed, else 0).
#[derive(Clone, Copy)]
struct Product {
    rows: usize,
    products: usize,
    input_rows: usize,
    x_per: usize,
}
