//! Weight matrices in the formats the engine runs natively, and their
//! products with activations.
//!
//! Quantized products follow llama.cpp exactly (that is what makes our tokens
//! match it): each activation row is rounded to 8-bit blocks of 32 values
//! (`Q8_1`, a scale and a scaled sum per block, for `Q4_1` weights; `Q8_0`
//! for `Q4_0`/`Q8_0` weights), and the dot product is integer within a block,
//! f32 across blocks. The SIMD kernels (AVX2+FMA+F16C, NEON) are chosen at
//! run time; the scalar kernels are the reference the tests compare them to.
//!
//! Formats without a native kernel here (the K-quants, Q5_*) go through
//! candle's quantized matmul: correct, not tuned.

mod kernels;

use half::f16;

use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

/// Values per quantization block (all formats here).
pub const BLOCK: usize = 32;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    F16,
    /// 18 bytes a block: f16 scale, 32 4-bit values offset by 8.
    Q4_0,
    /// 20 bytes a block: f16 scale, f16 minimum, 32 4-bit values.
    Q4_1,
    /// 34 bytes a block: f16 scale, 32 signed 8-bit values.
    Q8_0,
}

impl WeightFormat {
    /// Bytes one row of `cols` values takes.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Self::F32 => cols * 4,
            Self::F16 => cols * 2,
            Self::Q4_0 => cols / BLOCK * 18,
            Self::Q4_1 => cols / BLOCK * 20,
            Self::Q8_0 => cols / BLOCK * 34,
        }
    }

    fn is_quantized(self) -> bool {
        matches!(self, Self::Q4_0 | Self::Q4_1 | Self::Q8_0)
    }

    /// The activation format this weight format's dot product takes.
    fn activation_kind(self) -> ActivationKind {
        match self {
            Self::Q4_1 => ActivationKind::Q8_1,
            Self::Q4_0 | Self::Q8_0 => ActivationKind::Q8_0,
            Self::F32 | Self::F16 => ActivationKind::F32,
        }
    }
}

/// A row-major `rows x cols` matrix in one of the native formats. Products
/// compute `out[t][r] = dot(row r, x[t])`, i.e. `x @ W^T` as in PyTorch.
#[derive(Clone)]
pub struct QMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

/// Why a matrix cannot be built from the given bytes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("{format:?} matrix of {rows}x{cols} needs {expected} bytes, got {actual}")]
    WrongSize {
        format: WeightFormat,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    #[error("{format:?} rows need a multiple of {BLOCK} columns, got {cols}")]
    RaggedBlocks { format: WeightFormat, cols: usize },
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QMatrix({:?}, {}x{})", self.format, self.rows, self.cols)
    }
}

impl QMatrix {
    /// Wraps raw bytes in the format's layout (as in GGUF files).
    pub fn from_bytes(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, QuantError> {
        if format.is_quantized() && !cols.is_multiple_of(BLOCK) {
            return Err(QuantError::RaggedBlocks { format, cols });
        }
        let expected = rows * format.row_bytes(cols);
        if data.len() != expected {
            return Err(QuantError::WrongSize {
                format,
                rows,
                cols,
                expected,
                actual: data.len(),
            });
        }
        Ok(Self {
            format,
            rows,
            cols,
            data,
        })
    }

    /// An f32 matrix.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self, QuantError> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_bytes(WeightFormat::F32, rows, cols, data)
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    fn row(&self, r: usize) -> &[u8] {
        let width = self.format.row_bytes(self.cols);
        &self.data[r * width..(r + 1) * width]
    }

    /// The rows `range`, as a new matrix of the same format (no requantizing).
    pub fn slice_rows(&self, range: std::ops::Range<usize>) -> Self {
        let width = self.format.row_bytes(self.cols);
        Self {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            data: self.data[range.start * width..range.end * width].to_vec(),
        }
    }

    /// Dequantizes row `r` into `out` (`cols` values): embeddings lookups.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        kernels::dequantize_row(self.format, self.row(r), &mut out[..self.cols]);
    }
}

/// The activation formats that dot products take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ActivationKind {
    F32,
    Q8_0,
    Q8_1,
}

/// One block of 32 activations rounded to i8. `d` is already rounded through
/// f16 as llama.cpp stores it; `s` is `d * sum(qs)` (also f16-rounded), used
/// by Q4_1's minimum term.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(8))]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; BLOCK],
}

/// A batch of activation rows and their quantized copies, made once and
/// shared by every matrix that reads the same input (q, k and v; gate and up).
#[derive(Default)]
pub struct Activations {
    rows: usize,
    cols: usize,
    f32: Vec<f32>,
    q8_0: Vec<BlockQ8>,
    q8_1: Vec<BlockQ8>,
    have_q8_0: bool,
    have_q8_1: bool,
}

impl Activations {
    /// Takes a copy of `x` (`rows x cols`); quantized forms are made on demand.
    pub fn set(&mut self, x: &[f32], rows: usize, cols: usize) {
        debug_assert_eq!(x.len(), rows * cols);
        self.rows = rows;
        self.cols = cols;
        self.f32.clear();
        self.f32.extend_from_slice(x);
        self.have_q8_0 = false;
        self.have_q8_1 = false;
    }

    fn prepare(&mut self, kind: ActivationKind, pool: &ThreadPool) {
        let (blocks, done, with_sum) = match kind {
            ActivationKind::F32 => return,
            ActivationKind::Q8_0 => (&mut self.q8_0, &mut self.have_q8_0, false),
            ActivationKind::Q8_1 => (&mut self.q8_1, &mut self.have_q8_1, true),
        };
        if *done {
            return;
        }
        let per_row = self.cols / BLOCK;
        blocks.resize(self.rows * per_row, BlockQ8::default());
        let (rows, cols, values) = (self.rows, self.cols, &self.f32);
        let quantize = |range: std::ops::Range<usize>, out: &mut [BlockQ8]| {
            for (row, out) in values[range.start * cols..range.end * cols]
                .chunks_exact(cols)
                .zip(out.chunks_exact_mut(per_row))
            {
                kernels::quantize_row_q8(row, out, with_sum);
            }
        };
        if rows < 8 {
            quantize(0..rows, blocks);
        } else {
            // Prefill: a few MB of activations, worth every thread.
            let view = DisjointSlice::new(&mut blocks[..]);
            pool.run(|index, count| {
                let range = split_range(rows, index, count, 1);
                // SAFETY: threads take disjoint row ranges.
                let out = unsafe { view.part(range.start * per_row..range.end * per_row) };
                quantize(range, out);
            });
        }
        *done = true;
    }
}

/// `out[t * w.rows() + r] = dot(w row r, x row t)` for all rows of `x`, on
/// every thread of `pool`. `out` must hold `x.rows * w.rows()` values.
pub fn matmul(w: &QMatrix, x: &mut Activations, out: &mut [f32], pool: &ThreadPool) {
    assert_eq!(x.cols, w.cols, "activation width must match the matrix");
    assert!(out.len() >= x.rows * w.rows);
    let kind = w.format.activation_kind();
    x.prepare(kind, pool);
    let x = &*x;
    let out_view = DisjointSlice::new(&mut out[..x.rows * w.rows]);
    let rows = w.rows;
    let tokens = x.rows;
    pool.run(|index, count| {
        let range = split_range(rows, index, count, 4);
        if range.is_empty() {
            return;
        }
        // Rows are split, so each thread writes a column strip of `out`,
        // which is not contiguous: write through the raw view per token.
        matmul_rows(w, x, kind, range, tokens, &out_view);
    });
}

/// Several matrices over the same activations in one parallel region (q, k
/// and v; gate and up): one barrier instead of several per layer.
pub fn matmul_many<const N: usize>(
    ws: [&QMatrix; N],
    x: &mut Activations,
    outs: [&mut [f32]; N],
    pool: &ThreadPool,
) {
    for w in ws {
        assert_eq!(x.cols, w.cols, "activation width must match the matrix");
        x.prepare(w.format.activation_kind(), pool);
    }
    let x = &*x;
    let tokens = x.rows;
    let views = outs.map(|out| {
        let len = out.len();
        DisjointSlice::new(&mut out[..len])
    });
    for (w, view) in ws.iter().zip(&views) {
        assert!(view.len() >= tokens * w.rows);
    }
    pool.run(|index, count| {
        for (w, view) in ws.iter().zip(&views) {
            let range = split_range(w.rows, index, count, 4);
            if !range.is_empty() {
                matmul_rows(w, x, w.format.activation_kind(), range, tokens, view);
            }
        }
    });
}

/// Rows of the weight tile that stay in L1 while all tokens stream past.
const ROW_TILE: usize = 16;

fn matmul_rows(
    w: &QMatrix,
    x: &Activations,
    kind: ActivationKind,
    range: std::ops::Range<usize>,
    tokens: usize,
    out: &DisjointSlice<f32>,
) {
    let per_row = w.cols / BLOCK;
    let dot = kernels::select_dot(w.format);
    let dot4 = kernels::select_dot4(w.format);
    let blocks = match kind {
        ActivationKind::Q8_0 => &x.q8_0[..],
        ActivationKind::Q8_1 => &x.q8_1[..],
        ActivationKind::F32 => &[][..],
    };
    let mut tile_start = range.start;
    while tile_start < range.end {
        let tile_end = (tile_start + ROW_TILE).min(range.end);
        let mut first_single = 0;
        if let (Some(dot4), false) = (dot4, blocks.is_empty()) {
            // Four tokens at a time share each unpacked weight block.
            let row_of = |t: usize| &blocks[t * per_row..(t + 1) * per_row];
            let mut results = [0.0f32; 4];
            while first_single + 4 <= tokens {
                let t = first_single;
                let xs = [row_of(t), row_of(t + 1), row_of(t + 2), row_of(t + 3)];
                for r in tile_start..tile_end {
                    dot4(w.row(r), xs, &mut results);
                    for (k, value) in results.iter().enumerate() {
                        // SAFETY: this thread owns columns `range` of every output row.
                        unsafe {
                            out.part((t + k) * w.rows + r..(t + k) * w.rows + r + 1)[0] = *value
                        };
                    }
                }
                first_single += 4;
            }
        }
        if let (Some(rows4), 1, false) = (
            kernels::select_rows4(w.format),
            tokens - first_single,
            blocks.is_empty(),
        ) {
            // Decode: four weight rows share each activation block load.
            let t = first_single;
            let xs = &blocks[t * per_row..(t + 1) * per_row];
            // SAFETY: this thread owns columns `range` of every output row.
            let out_row = unsafe { out.part(t * w.rows + tile_start..t * w.rows + tile_end) };
            let mut r = tile_start;
            let mut results = [0.0f32; 4];
            while r + 4 <= tile_end {
                rows4(
                    [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)],
                    xs,
                    &mut results,
                );
                out_row[r - tile_start..r - tile_start + 4].copy_from_slice(&results);
                r += 4;
            }
            for (o, r) in out_row[r - tile_start..].iter_mut().zip(r..tile_end) {
                *o = dot(w.row(r), xs);
            }
            first_single = tokens;
        }
        for t in first_single..tokens {
            // SAFETY: this thread owns columns `range` of every output row.
            let out_row = unsafe { out.part(t * w.rows + tile_start..t * w.rows + tile_end) };
            match kind {
                ActivationKind::F32 => {
                    let xs = &x.f32[t * w.cols..(t + 1) * w.cols];
                    for (o, r) in out_row.iter_mut().zip(tile_start..tile_end) {
                        *o = kernels::dot_float(w.format, w.row(r), xs);
                    }
                }
                ActivationKind::Q8_0 | ActivationKind::Q8_1 => {
                    let xs = &blocks[t * per_row..(t + 1) * per_row];
                    for (o, r) in out_row.iter_mut().zip(tile_start..tile_end) {
                        *o = dot(w.row(r), xs);
                    }
                }
            }
        }
        tile_start = tile_end;
    }
}

/// Rounds an f32 through f16, as llama.cpp does when it stores a scale.
#[inline]
pub(crate) fn round_f16(value: f32) -> f32 {
    f16::from_f32(value).to_f32()
}

/// Quantizes `values` (a multiple of 32) into a format's bytes, with
/// llama.cpp's reference rounding. Used by tests and the safetensors export.
pub fn quantize(format: WeightFormat, values: &[f32]) -> Vec<u8> {
    kernels::quantize_reference(format, values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
    }

    fn dense_reference(format: WeightFormat, w: &QMatrix, x: &[f32], tokens: usize) -> Vec<f32> {
        let mut row = vec![0.0; w.cols];
        let mut out = vec![0.0; tokens * w.rows];
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            for t in 0..tokens {
                let xs = &x[t * w.cols..(t + 1) * w.cols];
                out[t * w.rows + r] = row.iter().zip(xs).map(|(a, b)| a * b).sum();
            }
        }
        let _ = format;
        out
    }

    #[test]
    fn quantized_products_track_the_dense_product() {
        let pool = ThreadPool::new(2);
        for format in [
            WeightFormat::Q4_0,
            WeightFormat::Q4_1,
            WeightFormat::Q8_0,
            WeightFormat::F32,
            WeightFormat::F16,
        ] {
            let (rows, cols, tokens) = (37, 256, 3);
            let values = random(rows * cols, 1);
            let w = QMatrix::from_bytes(format, rows, cols, quantize(format, &values)).unwrap();
            let x = random(tokens * cols, 2);
            let mut acts = Activations::default();
            acts.set(&x, tokens, cols);
            let mut out = vec![0.0; tokens * rows];
            matmul(&w, &mut acts, &mut out, &pool);
            let reference = dense_reference(format, &w, &x, tokens);
            for (got, want) in out.iter().zip(&reference) {
                // 8-bit activations: error grows with sqrt(cols) * scale.
                assert!((got - want).abs() < 0.6, "{format:?}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn simd_kernels_equal_the_scalar_reference() {
        for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let cols = 512;
            let w = quantize(format, &random(cols, 3));
            let x = random(cols, 4);
            let mut blocks = vec![BlockQ8::default(); cols / BLOCK];
            let mut reference_blocks = blocks.clone();
            kernels::quantize_row_q8(&x, &mut blocks, true);
            kernels::scalar::quantize_row_q8(&x, &mut reference_blocks, true);
            for (a, b) in blocks.iter().zip(&reference_blocks) {
                assert_eq!(a.qs, b.qs);
                assert_eq!(a.d.to_bits(), b.d.to_bits());
                assert_eq!(a.s.to_bits(), b.s.to_bits());
            }
            let fast = kernels::select_dot(format)(&w, &blocks);
            let slow = kernels::scalar::dot(format, &w, &blocks);
            // Same integer sums; only the f32 summation order differs.
            assert!(
                (fast - slow).abs() <= 1e-4 * slow.abs().max(1.0),
                "{format:?}: {fast} vs {slow}"
            );
        }
    }

    #[test]
    fn four_row_kernels_equal_single_row_kernels_exactly() {
        for format in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let Some(dot4) = kernels::select_dot4(format) else {
                continue;
            };
            let cols = 576;
            let w = quantize(format, &random(cols, 5));
            let rows: Vec<Vec<BlockQ8>> = (0..4)
                .map(|k| {
                    let mut blocks = vec![BlockQ8::default(); cols / BLOCK];
                    kernels::quantize_row_q8(&random(cols, 10 + k), &mut blocks, true);
                    blocks
                })
                .collect();
            let mut out = [0.0; 4];
            dot4(&w, [&rows[0], &rows[1], &rows[2], &rows[3]], &mut out);
            for k in 0..4 {
                let single = kernels::select_dot(format)(&w, &rows[k]);
                assert_eq!(out[k].to_bits(), single.to_bits(), "{format:?} row {k}");
            }
            if let Some(rows4) = kernels::select_rows4(format) {
                let ws: Vec<Vec<u8>> = (0..4)
                    .map(|k| quantize(format, &random(cols, 20 + k)))
                    .collect();
                rows4([&ws[0], &ws[1], &ws[2], &ws[3]], &rows[0], &mut out);
                for k in 0..4 {
                    let single = kernels::select_dot(format)(&ws[k], &rows[0]);
                    assert_eq!(
                        out[k].to_bits(),
                        single.to_bits(),
                        "{format:?} weight row {k}"
                    );
                }
            }
        }
    }

    #[test]
    fn sizes_are_checked() {
        let err = QMatrix::from_bytes(WeightFormat::Q4_1, 2, 64, vec![0; 10]).unwrap_err();
        assert!(matches!(err, QuantError::WrongSize { expected: 80, .. }));
        let err = QMatrix::from_bytes(WeightFormat::Q8_0, 2, 40, vec![]).unwrap_err();
        assert!(matches!(err, QuantError::RaggedBlocks { .. }));
    }
}
