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
//! K-quants (`Q4_K`, `Q5_K`, `Q6_K`: super-blocks of 256 values) take
//! llama.cpp's `Q8_K` activations (an f32 scale, 256 i8 values and their sums
//! by 16) and are exact integers within a super-block ([`kquants`]), as are
//! `Q2_K` and `Q3_K`. Formats without a native kernel here (the i-quants)
//! go through candle's quantized matmul: correct, not tuned.

mod block;
mod codec;
mod kernels;
mod kquants;

pub use block::{BlockQ8, BlockQ8K, WeightFormat, BLOCK, QK_K};

use block::ActivationKind;

use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

/// A row-major `rows x cols` matrix in one of the native formats. Products
/// compute `out[t][r] = dot(row r, x[t])`, i.e. `x @ W^T` as in PyTorch.
#[derive(Clone)]
pub struct QMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: WeightBytes,
}

/// A matrix's bytes: its own, or a range of a mapped model file (no copy:
/// the weights stay the file's pages, shared with the page cache, as
/// llama.cpp keeps them).
#[derive(Clone)]
pub enum WeightBytes {
    Owned(Vec<u8>),
    Mapped {
        map: std::sync::Arc<memmap2::Mmap>,
        range: std::ops::Range<usize>,
    },
}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(bytes) => bytes,
            Self::Mapped { map, range } => &map[range.clone()],
        }
    }
}

impl From<Vec<u8>> for WeightBytes {
    fn from(bytes: Vec<u8>) -> Self {
        Self::Owned(bytes)
    }
}

impl WeightBytes {
    /// Bytes `range` of these, without copying mapped ones.
    fn part(&self, range: std::ops::Range<usize>) -> Self {
        match self {
            Self::Owned(bytes) => Self::Owned(bytes[range].to_vec()),
            Self::Mapped { map, range: own } => Self::Mapped {
                map: map.clone(),
                range: own.start + range.start..own.start + range.end,
            },
        }
    }
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
    #[error("{format:?} rows need a multiple of {} columns, got {cols}", format.block_values())]
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
        data: impl Into<WeightBytes>,
    ) -> Result<Self, QuantError> {
        let data = data.into();
        if format.is_quantized() && !cols.is_multiple_of(format.block_values()) {
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
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
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

    /// Its bytes, row after row, as the model file stores them.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    fn row(&self, r: usize) -> &[u8] {
        let width = self.format.row_bytes(self.cols);
        &self.data[r * width..(r + 1) * width]
    }

    /// The bytes of rows `range`, one after the other.
    fn rows_bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        let width = self.format.row_bytes(self.cols);
        &self.data[range.start * width..range.end * width]
    }

    /// The rows `range`, as a new matrix of the same format (no requantizing).
    pub fn slice_rows(&self, range: std::ops::Range<usize>) -> Self {
        let width = self.format.row_bytes(self.cols);
        Self {
            format: self.format,
            rows: range.len(),
            cols: self.cols,
            data: self.data.part(range.start * width..range.end * width),
        }
    }

    /// Dequantizes row `r` into `out` (`cols` values): embeddings lookups.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        codec::dequantize_row(self.format, self.row(r), &mut out[..self.cols]);
    }
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
    q8_k: Vec<BlockQ8K>,
    have_q8_0: bool,
    have_q8_1: bool,
    have_q8_k: bool,
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
        self.have_q8_k = false;
    }

    fn prepare(&mut self, kind: ActivationKind, pool: &ThreadPool) {
        let (rows, cols, values) = (self.rows, self.cols, &self.f32[..]);
        match kind {
            ActivationKind::F32 => {}
            ActivationKind::Q8_0 if !self.have_q8_0 => {
                let quantize =
                    |row: &[f32], out: &mut [BlockQ8]| kernels::quantize_row_q8(row, out, false);
                quantize_rows(values, rows, cols, BLOCK, &mut self.q8_0, quantize, pool);
                self.have_q8_0 = true;
            }
            ActivationKind::Q8_1 if !self.have_q8_1 => {
                let quantize =
                    |row: &[f32], out: &mut [BlockQ8]| kernels::quantize_row_q8(row, out, true);
                quantize_rows(values, rows, cols, BLOCK, &mut self.q8_1, quantize, pool);
                self.have_q8_1 = true;
            }
            ActivationKind::Q8K if !self.have_q8_k => {
                let quantize = kquants::quantize_row_q8k;
                quantize_rows(values, rows, cols, QK_K, &mut self.q8_k, quantize, pool);
                self.have_q8_k = true;
            }
            ActivationKind::Q8_0 | ActivationKind::Q8_1 | ActivationKind::Q8K => {}
        }
    }
}

/// Rounds `rows` rows of `cols` values into blocks of `block` values each.
fn quantize_rows<B: Clone + Default + Send>(
    values: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
    blocks: &mut Vec<B>,
    quantize_row: impl Fn(&[f32], &mut [B]) + Sync,
    pool: &ThreadPool,
) {
    let per_row = cols / block;
    blocks.resize(rows * per_row, B::default());
    let quantize = |range: std::ops::Range<usize>, out: &mut [B]| {
        for (row, out) in values[range.start * cols..range.end * cols]
            .chunks_exact(cols)
            .zip(out.chunks_exact_mut(per_row))
        {
            quantize_row(row, out);
        }
    };
    if rows * cols < 32_768 {
        // A few decode rows: cheaper here than waking the threads.
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
        matmul_rows(w, x, kind, range, 0..tokens, &out_view);
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
                matmul_rows(w, x, w.format.activation_kind(), range, 0..tokens, view);
            }
        }
    });
}

/// A grouped product (mixture-of-experts): group `g = (expert, rows)`
/// multiplies, for each output row `t` in `rows`, activation row
/// `x_rows[t]` (or `t` itself without `x_rows`) by the `N` matrices
/// `weights(expert)`, writing `outs[i][t * rows_i + r]`, where every
/// expert's `i`-th matrix has the same `rows_i`. All groups run in one
/// parallel region, each thread taking its share of every matrix's rows,
/// and each output is the plain product's bit for bit.
pub fn matmul_grouped<'w, const N: usize>(
    weights: impl Fn(usize) -> [&'w QMatrix; N] + Sync,
    groups: &[(usize, std::ops::Range<usize>)],
    x: &mut Activations,
    x_rows: Option<&[usize]>,
    outs: [&mut [f32]; N],
    pool: &ThreadPool,
) {
    let Some(&(first, _)) = groups.first() else {
        return;
    };
    let rows = weights(first).map(|w| w.rows);
    let out_rows = groups.iter().map(|(_, t)| t.end).max().unwrap_or(0);
    match x_rows {
        Some(map) => assert!(
            map.len() >= out_rows && map[..out_rows].iter().all(|&r| r < x.rows),
            "every output row maps to an activation row"
        ),
        None => assert!(
            out_rows <= x.rows,
            "a group's rows lie within the activations"
        ),
    }
    for (expert, _) in groups {
        for (w, rows) in weights(*expert).iter().zip(rows) {
            assert_eq!(x.cols, w.cols, "activation width must match the matrix");
            assert_eq!(w.rows, rows, "every expert's matrix has the same rows");
            x.prepare(w.format.activation_kind(), pool);
        }
    }
    let x = &*x;
    let views = outs.map(|out| {
        let len = out.len();
        DisjointSlice::new(&mut out[..len])
    });
    for (view, rows) in views.iter().zip(rows) {
        assert!(view.len() >= out_rows * rows);
    }
    pool.run(|index, count| {
        for (expert, tokens) in groups {
            for (w, view) in weights(*expert).iter().zip(&views) {
                let range = split_range(w.rows, index, count, 4);
                if !range.is_empty() && !tokens.is_empty() {
                    let job = RowJob {
                        w,
                        range,
                        tokens: tokens.clone(),
                        x_rows,
                        out: view,
                        out_stride: w.rows,
                        out_offset: 0,
                    };
                    job.run(x, w.format.activation_kind());
                }
            }
        }
    });
}

/// Rows of the weight tile that stay in L1 while all tokens stream past.
const ROW_TILE: usize = 16;

/// Rows per call of an eight-token kernel.
const EIGHT_TOKEN_ROWS: usize = 64;

/// Rows per call of a tile kernel.
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 32;

/// The fewest tokens that go through a tile kernel (a tile of 4).
#[cfg(target_arch = "x86_64")]
const MIN_TILE_TOKENS: usize = 2;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// This thread's tile of activations, reused from call to call.
    static TILE: std::cell::RefCell<kquants::tiles::TokenTile> =
        std::cell::RefCell::new(kquants::tiles::TokenTile::default());
}

fn matmul_rows(
    w: &QMatrix,
    x: &Activations,
    kind: ActivationKind,
    range: std::ops::Range<usize>,
    tokens: std::ops::Range<usize>,
    out: &DisjointSlice<f32>,
) {
    let job = RowJob {
        w,
        range,
        tokens,
        x_rows: None,
        out,
        out_stride: w.rows,
        out_offset: 0,
    };
    job.run(x, kind);
}

/// Where [`matmul_region`] writes: row `r` of token `t` at `t * stride +
/// offset + r`.
#[derive(Clone, Copy, Debug)]
pub struct OutLayout {
    pub stride: usize,
    pub offset: usize,
}

/// [`matmul`] for the activation rows `tokens` only, each token's results
/// written at `layout` into a wider buffer (its columns of the logits, or
/// of q): no copy into place afterwards. Each result is the plain
/// product's bit for bit.
pub fn matmul_region(
    w: &QMatrix,
    x: &mut Activations,
    tokens: std::ops::Range<usize>,
    out: &mut [f32],
    layout: OutLayout,
    pool: &ThreadPool,
) {
    assert_eq!(x.cols, w.cols, "activation width must match the matrix");
    assert!(tokens.end <= x.rows && layout.offset + w.rows <= layout.stride);
    if tokens.is_empty() {
        return;
    }
    assert!(out.len() >= (tokens.end - 1) * layout.stride + layout.offset + w.rows);
    let kind = w.format.activation_kind();
    x.prepare(kind, pool);
    let x = &*x;
    let out_view = DisjointSlice::new(out);
    pool.run(|index, count| {
        let range = split_range(w.rows, index, count, 4);
        if range.is_empty() {
            return;
        }
        let job = RowJob {
            w,
            range,
            tokens: tokens.clone(),
            x_rows: None,
            out: &out_view,
            out_stride: layout.stride,
            out_offset: layout.offset,
        };
        job.run(x, kind);
    });
}

/// One thread's share of a product: weight rows `range` for the output
/// rows `tokens`, each from its own activation row (`x_rows[t]`, or `t`).
struct RowJob<'a> {
    w: &'a QMatrix,
    range: std::ops::Range<usize>,
    tokens: std::ops::Range<usize>,
    x_rows: Option<&'a [usize]>,
    out: &'a DisjointSlice<f32>,
    /// Token `t`'s row `r` goes to `t * out_stride + out_offset + r`.
    out_stride: usize,
    out_offset: usize,
}

impl RowJob<'_> {
    fn run(&self, x: &Activations, kind: ActivationKind) {
        match kind {
            ActivationKind::F32 => self.float_rows(&x.f32),
            ActivationKind::Q8_0 => self.quantized_rows(&x.q8_0, kernels::select(self.w.format)),
            ActivationKind::Q8_1 => self.quantized_rows(&x.q8_1, kernels::select(self.w.format)),
            ActivationKind::Q8K => {
                // Many tokens go through the tile kernels; the rest (or
                // all, on CPUs without them) a few at a time.
                let rest = RowJob {
                    tokens: self.tiled_rows(&x.q8_k)..self.tokens.end,
                    range: self.range.clone(),
                    ..*self
                };
                rest.quantized_rows(&x.q8_k, kquants::select(self.w.format))
            }
        }
    }

    /// Tokens from the first, 32, 16, 8 or 4 at a time while at least
    /// [`MIN_TILE_TOKENS`] are left, through the format's tile kernel
    /// (the last token repeated to fill a tile); returns the first token
    /// left to the other kernels.
    fn tiled_rows(&self, blocks: &[BlockQ8K]) -> usize {
        let mut t = self.tokens.start;
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = kquants::tiles::select(self.w.format) {
            use kquants::tiles::LANES;
            let (w, end) = (self.w, self.tokens.end);
            let per_row = w.cols / QK_K;
            let row_of = |t: usize| {
                let a = self.x_row(t);
                &blocks[a * per_row..(a + 1) * per_row]
            };
            TILE.with_borrow_mut(|tile| {
                let mut results = [0.0f32; TILE_ROWS * 2 * LANES];
                while end - t >= MIN_TILE_TOKENS {
                    let size = match end - t {
                        left if left >= 3 * LANES / 2 => 2 * LANES,
                        left if left > LANES / 2 => LANES,
                        left if left > LANES / 4 => LANES / 2,
                        _ => LANES / 4,
                    };
                    let n = (end - t).min(size);
                    let rows: [&[BlockQ8K]; 2 * LANES] =
                        std::array::from_fn(|k| row_of(t + k.min(n - 1)));
                    tile.fill(&rows[..size], per_row);
                    let mut start = self.range.start;
                    while start < self.range.end {
                        let span = start..(start + TILE_ROWS).min(self.range.end);
                        let results = &mut results[..span.len() * size];
                        kernel(w.rows_bytes(span.clone()), tile, results);
                        for k in 0..n {
                            let out_row = self.out_row(t + k, span.clone());
                            for (o, lanes) in out_row.iter_mut().zip(results.chunks_exact(size)) {
                                *o = lanes[k];
                            }
                        }
                        start = span.end;
                    }
                    t += n;
                }
            });
        }
        t
    }

    /// The activation row output row `t` reads.
    fn x_row(&self, t: usize) -> usize {
        self.x_rows.map_or(t, |map| map[t])
    }

    /// This thread's columns `tile` of output row `t`. Callers hold one at
    /// a time (the view is shared, like [`DisjointSlice::part`]).
    #[allow(clippy::mut_from_ref)]
    fn out_row(&self, t: usize, tile: std::ops::Range<usize>) -> &mut [f32] {
        let base = t * self.out_stride + self.out_offset;
        // SAFETY: this thread owns columns `range` of every output row, and
        // `tile` lies within them.
        unsafe { self.out.part(base + tile.start..base + tile.end) }
    }

    fn float_rows(&self, x: &[f32]) {
        let (w, cols) = (self.w, self.w.cols);
        for t in self.tokens.clone() {
            let a = self.x_row(t);
            let xs = &x[a * cols..(a + 1) * cols];
            let out_row = self.out_row(t, self.range.clone());
            for (o, r) in out_row.iter_mut().zip(self.range.clone()) {
                *o = kernels::dot_float(w.format, w.row(r), xs);
            }
        }
    }

    fn quantized_rows<B>(&self, blocks: &[B], kernels: kernels::Kernels<B>) {
        let w = self.w;
        let per_row = w.cols / w.format.block_values();
        let row_of = |t: usize| {
            let a = self.x_row(t);
            &blocks[a * per_row..(a + 1) * per_row]
        };
        let end = self.tokens.end;
        let mut first_after_eights = self.tokens.start;
        if let Some(dot8) = kernels.dot8 {
            // Five to eight tokens go eight at a time, the last repeated,
            // over many rows per call: the eight tokens' activations stay in
            // L1 while the weights stream from L2, and each call's set-up
            // (gathering the tokens' scales) is paid once per 64 rows.
            let mut results = [[0.0f32; 8]; EIGHT_TOKEN_ROWS];
            while first_after_eights + 5 <= end {
                let t = first_after_eights;
                let n = (end - t).min(8);
                let xs = std::array::from_fn(|k| row_of(t + k.min(n - 1)));
                let mut start = self.range.start;
                while start < self.range.end {
                    let rows = start..(start + EIGHT_TOKEN_ROWS).min(self.range.end);
                    let results = &mut results[..rows.len()];
                    dot8(w.rows_bytes(rows.clone()), xs, results);
                    for k in 0..n {
                        let out_row = self.out_row(t + k, rows.clone());
                        for (o, lanes) in out_row.iter_mut().zip(results.iter()) {
                            *o = lanes[k];
                        }
                    }
                    start = rows.end;
                }
                first_after_eights += n;
            }
        }
        // With an eight-token kernel, at most four tokens are left: one
        // four-token call per tile, whose set-up (pairing the tokens'
        // blocks) is then paid once per 64 rows. Without one, groups of four
        // stream past a tile small enough to stay in L1.
        let tile_rows = if kernels.dot8.is_some() {
            EIGHT_TOKEN_ROWS
        } else {
            ROW_TILE
        };
        let mut tile_start = self.range.start;
        while tile_start < self.range.end {
            let tile = tile_start..(tile_start + tile_rows).min(self.range.end);
            let mut first_single = first_after_eights;
            if let Some(dot4) = kernels.dot4 {
                // Four tokens at a time share each unpacked weight block. Two
                // or three left over go the same way, the last repeated: one
                // pass costs less than two or three single dots, and each
                // lane's result is the single dot's bit for bit.
                let mut results = [[0.0f32; 4]; EIGHT_TOKEN_ROWS];
                let results = &mut results[..tile.len()];
                while first_single + 2 <= end {
                    let t = first_single;
                    let n = (end - t).min(4);
                    let lane = |k: usize| row_of(t + k.min(n - 1));
                    let xs = [lane(0), lane(1), lane(2), lane(3)];
                    dot4(w.rows_bytes(tile.clone()), xs, results);
                    for k in 0..n {
                        let out_row = self.out_row(t + k, tile.clone());
                        for (o, lanes) in out_row.iter_mut().zip(results.iter()) {
                            *o = lanes[k];
                        }
                    }
                    first_single += n;
                }
            }
            for t in first_single..end {
                let out_row = self.out_row(t, tile.clone());
                match kernels.rows {
                    // Decode: the tile's rows in one kernel call.
                    Some(rows) if end - first_single == 1 => {
                        rows(w.rows_bytes(tile.clone()), row_of(t), out_row)
                    }
                    _ => {
                        for (o, r) in out_row.iter_mut().zip(tile.clone()) {
                            *o = (kernels.dot)(w.row(r), row_of(t));
                        }
                    }
                }
            }
            tile_start = tile.end;
        }
    }
}

/// Quantizes `values` (a multiple of 32) into a format's bytes, with
/// llama.cpp's reference rounding. Used by tests and the safetensors export.
pub fn quantize(format: WeightFormat, values: &[f32]) -> Vec<u8> {
    codec::quantize_reference(format, values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
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

    const ALL: [WeightFormat; 12] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
    ];

    const K_QUANTS: [WeightFormat; 5] = [
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
        WeightFormat::Q2_K,
        WeightFormat::Q3_K,
    ];

    /// The quantized formats of 32-value blocks (`Q8_0`/`Q8_1` activations).
    const BLOCK32_FORMATS: [WeightFormat; 5] = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
    ];

    /// Valid rows of any bit pattern: random bytes with every f16 scale set
    /// to a small random value, so all packed scales and values are covered.
    fn random_blocks(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut data: Vec<u8> = (0..rows * format.row_bytes(cols))
            .map(|_| rng.gen())
            .collect();
        let scale_at: &[usize] = match format {
            WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => &[0],
            WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => {
                &[0, 2]
            }
            WeightFormat::Q6_K => &[208],
            WeightFormat::Q2_K => &[80, 82],
            WeightFormat::Q3_K => &[108],
            WeightFormat::F32 | WeightFormat::F16 => {
                return quantize(format, &random(rows * cols, seed))
            }
        };
        for block in data.chunks_exact_mut(format.block_bytes()) {
            for &at in scale_at {
                let scale = f16::from_f32(rng.gen_range(0.001f32..0.02));
                block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
            }
        }
        data
    }

    fn product(w: &QMatrix, x: &[f32], tokens: usize, pool: &ThreadPool) -> Vec<f32> {
        let mut acts = Activations::default();
        acts.set(x, tokens, w.cols);
        let mut out = vec![0.0; tokens * w.rows];
        matmul(w, &mut acts, &mut out, pool);
        out
    }

    #[test]
    fn quantized_products_track_the_dense_product() {
        let pool = ThreadPool::new(2);
        for format in ALL {
            let (rows, cols, tokens) = (37, 512, 3);
            let values = random(rows * cols, 1);
            let w = QMatrix::from_bytes(format, rows, cols, quantize(format, &values)).unwrap();
            let x = random(tokens * cols, 2);
            let out = product(&w, &x, tokens, &pool);
            let reference = dense_reference(format, &w, &x, tokens);
            for (got, want) in out.iter().zip(&reference) {
                // 8-bit activations: error grows with sqrt(cols) * scale.
                assert!((got - want).abs() < 0.8, "{format:?}: {got} vs {want}");
            }
            // The quantizer itself stays close to the values it was given.
            let mut row = vec![0.0; cols];
            w.dequantize_row(5, &mut row);
            let worst = row
                .iter()
                .zip(&values[5 * cols..6 * cols])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            // Q2_K has four levels per sub-block of 16 (a step of a third of
            // its range, 4 here: up to 0.67 off); Q3_K eight, -4..3 times its
            // scale, so a value of the other sign than the largest one can
            // sit a quarter of that magnitude (up to 0.5) from the nearest.
            let limit = match format {
                WeightFormat::Q2_K => 0.7,
                WeightFormat::Q3_K => 0.55,
                _ => 0.35,
            };
            assert!(worst < limit, "{format:?} round trip off by {worst}");
        }
    }

    #[test]
    fn every_block_layout_decodes_as_its_dot_product_reads_it() {
        // Random bytes reach every scale and value pattern; the dot product
        // with quantized activations must track the dequantized row's.
        let pool = ThreadPool::new(2);
        for format in &ALL[2..] {
            let (rows, cols) = (9, 768);
            let data = random_blocks(*format, rows, cols, 7);
            let w = QMatrix::from_bytes(*format, rows, cols, data).unwrap();
            let x = random(cols, 8);
            let out = product(&w, &x, 1, &pool);
            let reference = dense_reference(*format, &w, &x, 1);
            let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            let mut abs_row = vec![0.0; cols];
            for (r, (got, want)) in out.iter().zip(&reference).enumerate() {
                // Rounding x to 8 bits moves each term by under 1% of |w x|.
                w.dequantize_row(r, &mut abs_row);
                let scale: f32 = abs_row.iter().zip(&abs_x).map(|(a, b)| a.abs() * b).sum();
                assert!(
                    (got - want).abs() < 0.01 * scale,
                    "{format:?}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn simd_kernels_equal_the_scalar_reference() {
        for format in BLOCK32_FORMATS {
            let cols = 512;
            let w = random_blocks(format, 1, cols, 3);
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
            let fast = (kernels::select(format).dot)(&w, &blocks);
            let slow = kernels::scalar::dot(format, &w, &blocks);
            // Same integer sums; only the f32 summation order differs.
            assert!(
                (fast - slow).abs() <= 1e-4 * slow.abs().max(1.0),
                "{format:?}: {fast} vs {slow}"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_kernels_give_the_avx2_kernels_bits() {
        let (avx2, vnni) = kernels::x86_paths();
        eprintln!("this CPU: AVX2 {avx2}, AVX-512 VNNI {vnni}");
        if !vnni {
            // Only the AVX2 path exists here; the other tests cover it.
            tessera_testkit::not_run_here(
                "quant::vnni_kernels_give_the_avx2_kernels_bits",
                "the AVX-512 VNNI kernels (this CPU lacks them)",
            );
            return;
        }
        for format in BLOCK32_FORMATS {
            let cols = 576;
            let rows: Vec<Vec<u8>> = (0..7)
                .map(|k| random_blocks(format, 1, cols, 50 + k))
                .collect();
            let acts: Vec<Vec<BlockQ8>> = (0..8)
                .map(|k| {
                    let mut blocks = vec![BlockQ8::default(); cols / BLOCK];
                    kernels::quantize_row_q8(&random(cols, 60 + k), &mut blocks, true);
                    blocks
                })
                .collect();
            let (plain, fast) = (
                kernels::x86_kernels::<false>(format),
                kernels::x86_kernels::<true>(format),
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                (plain.dot)(&rows[0], &acts[0]).to_bits(),
                (fast.dot)(&rows[0], &acts[0]).to_bits(),
                "{format:?} dot"
            );
            let xs = [&acts[0][..], &acts[1], &acts[2], &acts[3]];
            let (dot4_plain, dot4_fast) = (plain.dot4.unwrap(), fast.dot4.unwrap());
            for n in 1..=rows.len() {
                let ws: Vec<u8> = rows[..n].concat();
                let (mut a, mut b) = (vec![[0.0; 4]; n], vec![[0.0; 4]; n]);
                dot4_plain(&ws, xs, &mut a);
                dot4_fast(&ws, xs, &mut b);
                assert_eq!(
                    bits(a.as_flattened()),
                    bits(b.as_flattened()),
                    "{format:?} dot4, {n} rows"
                );
                for (r, row) in rows[..n].iter().enumerate() {
                    for (k, x) in xs.iter().enumerate() {
                        let alone = (fast.dot)(row, x).to_bits();
                        assert_eq!(
                            b[r][k].to_bits(),
                            alone,
                            "{format:?} dot4 row {r} token {k}"
                        );
                    }
                }
            }
            if let Some(dot8) = fast.dot8 {
                // AVX-512, two tokens per register: each lane still the
                // single product's bits.
                let xs: [&[BlockQ8]; 8] = std::array::from_fn(|k| &acts[k][..]);
                for n in 1..=rows.len() {
                    let ws: Vec<u8> = rows[..n].concat();
                    let mut out = vec![[0.0; 8]; n];
                    dot8(&ws, xs, &mut out);
                    for (r, row) in rows[..n].iter().enumerate() {
                        for (k, x) in xs.iter().enumerate() {
                            let alone = (plain.dot)(row, x).to_bits();
                            assert_eq!(
                                out[r][k].to_bits(),
                                alone,
                                "{format:?} dot8 row {r} token {k}"
                            );
                        }
                    }
                }
            }
            if let (Some(p), Some(f)) = (plain.rows, fast.rows) {
                // 1 to 7 rows: whole groups of four and what is left over.
                for n in 1..=rows.len() {
                    let ws: Vec<u8> = rows[..n].concat();
                    let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
                    p(&ws, &acts[0], &mut a);
                    f(&ws, &acts[0], &mut b);
                    assert_eq!(bits(&a), bits(&b), "{format:?} rows, {n} rows");
                    // Each row's result is the single-row product's, bit for bit.
                    for (k, row) in rows[..n].iter().enumerate() {
                        let alone = (fast.dot)(row, &acts[0]).to_bits();
                        assert_eq!(b[k].to_bits(), alone, "{format:?} rows, row {k} of {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn k_quant_kernels_equal_the_scalar_reference_bit_for_bit() {
        for format in K_QUANTS {
            let cols = 1024;
            for seed in 0..8 {
                let w = random_blocks(format, 1, cols, 30 + seed);
                let mut blocks = vec![BlockQ8K::default(); cols / QK_K];
                kquants::quantize_row_q8k(&random(cols, 40 + seed), &mut blocks);
                let fast = (kquants::select(format).dot)(&w, &blocks);
                let slow = match format {
                    WeightFormat::Q4_K => kquants::scalar::dot_q4_k(&w, &blocks),
                    WeightFormat::Q5_K => kquants::scalar::dot_q5_k(&w, &blocks),
                    WeightFormat::Q2_K => kquants::scalar::dot_q2_k(&w, &blocks),
                    WeightFormat::Q3_K => kquants::scalar::dot_q3_k(&w, &blocks),
                    _ => kquants::scalar::dot_q6_k(&w, &blocks),
                };
                assert_eq!(
                    fast.to_bits(),
                    slow.to_bits(),
                    "{format:?}: {fast} vs {slow}"
                );
            }
        }
    }

    #[test]
    fn k_quant_many_token_kernels_give_each_tokens_bits() {
        for format in K_QUANTS {
            let (rows, cols) = (5, 768);
            let w = random_blocks(format, rows, cols, 70);
            let row_bytes = w.len() / rows;
            let acts: Vec<Vec<BlockQ8K>> = (0..8)
                .map(|k| {
                    let mut blocks = vec![BlockQ8K::default(); cols / QK_K];
                    kquants::quantize_row_q8k(&random(cols, 80 + k), &mut blocks);
                    blocks
                })
                .collect();
            let kernels = kquants::select(format);
            let alone = |r: usize, k: usize| {
                (kernels.dot)(&w[r * row_bytes..(r + 1) * row_bytes], &acts[k]).to_bits()
            };
            #[cfg(target_arch = "x86_64")]
            let avx2 = kquants::avx2_dot4(format);
            #[cfg(not(target_arch = "x86_64"))]
            let avx2 = None;
            for dot4 in [kernels.dot4, avx2].into_iter().flatten() {
                let mut out = vec![[0.0; 4]; rows];
                dot4(&w, std::array::from_fn(|k| &acts[k][..]), &mut out);
                for (r, lanes) in out.iter().enumerate() {
                    for (k, v) in lanes.iter().enumerate() {
                        assert_eq!(
                            v.to_bits(),
                            alone(r, k),
                            "{format:?} dot4 row {r} token {k}"
                        );
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            if !kernels::avx512_available() {
                tessera_testkit::not_run_here(
                    "quant::k_quant_many_token_kernels_give_each_tokens_bits",
                    &format!("the AVX-512 kernels of {format:?}, if any (this CPU lacks AVX-512)"),
                );
            }
            if let Some(dot8) = kernels.dot8 {
                let mut out = vec![[0.0; 8]; rows];
                dot8(&w, std::array::from_fn(|k| &acts[k][..]), &mut out);
                for (r, lanes) in out.iter().enumerate() {
                    for (k, v) in lanes.iter().enumerate() {
                        assert_eq!(
                            v.to_bits(),
                            alone(r, k),
                            "{format:?} dot8 row {r} token {k}"
                        );
                    }
                }
            }
        }
    }

    /// The tile kernels (4, 8, 16 and 32 tokens, with and without VNNI) give
    /// each token the single-token kernel's bits, activations at the
    /// extremes (every byte -127 or 127) included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn k_quant_tile_kernels_give_each_tokens_bits() {
        use kquants::tiles;
        let test = "quant::k_quant_tile_kernels_give_each_tokens_bits";
        if !tiles::available() {
            tessera_testkit::not_run_here(test, "the tile kernels (this CPU lacks AVX-512 BW)");
            return;
        }
        if !tiles::vnni_available() {
            tessera_testkit::not_run_here(
                test,
                "the tile kernels' VNNI variants (no AVX-512 VNNI)",
            );
        }
        let (rows, cols) = (5, 768);
        let acts: Vec<Vec<BlockQ8K>> = (0..32)
            .map(|k| {
                let values = match k {
                    0 => vec![1.0; cols],
                    1 => vec![-1.0; cols],
                    _ => random(cols, 300 + k as u64),
                };
                let mut blocks = vec![BlockQ8K::default(); cols / QK_K];
                kquants::quantize_row_q8k(&values, &mut blocks);
                blocks
            })
            .collect();
        let mut tested = 0;
        for format in K_QUANTS {
            let w = random_blocks(format, rows, cols, 71);
            let row_bytes = w.len() / rows;
            let dot = kquants::select(format).dot;
            for vnni in [false, true] {
                let Some(kernel) = tiles::variant(format, vnni) else {
                    continue;
                };
                if vnni && !tiles::vnni_available() {
                    continue;
                }
                for size in tiles::SIZES {
                    let xs: Vec<&[BlockQ8K]> = acts[..size].iter().map(|a| &a[..]).collect();
                    let mut tile = tiles::TokenTile::default();
                    tile.fill(&xs, cols / QK_K);
                    let mut out = vec![0.0f32; rows * size];
                    kernel(&w, &tile, &mut out);
                    for (r, lanes) in out.chunks_exact(size).enumerate() {
                        let row = &w[r * row_bytes..(r + 1) * row_bytes];
                        for (k, v) in lanes.iter().enumerate() {
                            let alone = dot(row, &acts[k]);
                            assert_eq!(
                                v.to_bits(),
                                alone.to_bits(),
                                "{format:?} vnni {vnni} tile {size} row {r} token {k}: {v} vs {alone}"
                            );
                        }
                    }
                    tested += 1;
                }
            }
        }
        assert!(
            tested >= 8,
            "Q4_K and Q6_K tiles of 4, 8, 16 and 32 were checked"
        );
    }

    /// Our reading of every K-quant layout is candle's (ggml's) to the bit,
    /// on blocks of any bit pattern.
    #[test]
    fn k_quant_layouts_dequantize_as_candle_does() {
        use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
        for format in K_QUANTS {
            let dtype = match format {
                WeightFormat::Q4_K => GgmlDType::Q4K,
                WeightFormat::Q5_K => GgmlDType::Q5K,
                WeightFormat::Q6_K => GgmlDType::Q6K,
                WeightFormat::Q2_K => GgmlDType::Q2K,
                _ => GgmlDType::Q3K,
            };
            let (rows, cols) = (3, 512);
            let bytes = random_blocks(format, rows, cols, 95);
            let theirs =
                qtensor_from_ggml(dtype, &bytes, vec![rows * cols], &candle_core::Device::Cpu)
                    .and_then(|t| t.dequantize(&candle_core::Device::Cpu))
                    .and_then(|t| t.to_vec1::<f32>())
                    .unwrap();
            let w = QMatrix::from_bytes(format, rows, cols, bytes).unwrap();
            let mut ours = vec![0.0; rows * cols];
            for (r, out) in ours.chunks_exact_mut(cols).enumerate() {
                w.dequantize_row(r, out);
            }
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{format:?} value {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q8_k_rounding_is_llama_cpps() {
        // The largest magnitude (-127 here) maps to -127, so the scale is
        // exactly 1 and the rounding shows: half to even.
        let mut x = vec![0.0f32; QK_K];
        x[..5].copy_from_slice(&[-127.0, 0.5, 1.5, 2.5, -3.5]);
        x[20] = 100.0;
        let mut blocks = [BlockQ8K::default()];
        kquants::quantize_row_q8k(&x, &mut blocks);
        let b = &blocks[0];
        assert_eq!(b.d, 1.0);
        assert_eq!(&b.qs[..5], &[-127, 0, 2, 2, -4]);
        assert_eq!((b.bsums[0], b.bsums[1]), (-127 + 2 + 2 - 4, 100));
        assert!(b.bsums[2..].iter().all(|s| *s == 0));
        kquants::quantize_row_q8k(&[0.0; QK_K], &mut blocks);
        assert_eq!((blocks[0].d, blocks[0].qs[0]), (0.0, 0));
    }

    #[test]
    fn q8_k_quantization_is_the_portable_bodys_on_every_path() {
        for seed in 0..8 {
            let x = random(4 * QK_K, 90 + seed);
            let (mut fast, mut portable) =
                (vec![BlockQ8K::default(); 4], vec![BlockQ8K::default(); 4]);
            kquants::quantize_row_q8k(&x, &mut fast);
            kquants::quantize_row_q8k_body(&x, &mut portable);
            for (f, p) in fast.iter().zip(&portable) {
                assert_eq!(f.d.to_bits(), p.d.to_bits());
                assert_eq!(f.qs, p.qs);
                assert_eq!(f.bsums, p.bsums);
            }
        }
    }

    #[test]
    fn grouped_products_are_each_groups_plain_product_bit_for_bit() {
        // Three "experts" over uneven runs of 11 token rows (one of them
        // empty, one a single token): every output row equals the plain
        // product of that token alone with its expert's matrices.
        let pool = ThreadPool::new(2);
        for format in ALL {
            let (rows, cols, tokens) = (13, 512, 11);
            let experts: Vec<[QMatrix; 2]> = (0..3)
                .map(|e| {
                    [0, 1].map(|i| {
                        let data = random_blocks(format, rows, cols, 20 + 2 * e + i);
                        QMatrix::from_bytes(format, rows, cols, data).unwrap()
                    })
                })
                .collect();
            let x = random(tokens * cols, 13);
            let groups = vec![(2, 0..1), (0, 1..1), (1, 1..7), (0, 7..11)];
            let mut acts = Activations::default();
            acts.set(&x, tokens, cols);
            let (mut a, mut b) = (vec![0.0; tokens * rows], vec![0.0; tokens * rows]);
            matmul_grouped(
                |e| [&experts[e][0], &experts[e][1]],
                &groups,
                &mut acts,
                None,
                [&mut a, &mut b],
                &pool,
            );
            let check = |a: &[f32], b: &[f32], x_row: &dyn Fn(usize) -> usize| {
                for (e, range) in &groups {
                    for t in range.clone() {
                        let at = x_row(t);
                        let alone = &x[at * cols..(at + 1) * cols];
                        for (i, out) in [a, b].into_iter().enumerate() {
                            let want = product(&experts[*e][i], alone, 1, &pool);
                            let got = &out[t * rows..(t + 1) * rows];
                            let same = got
                                .iter()
                                .zip(&want)
                                .all(|(g, w)| g.to_bits() == w.to_bits());
                            assert!(same, "{format:?} expert {e} row {t} matrix {i}");
                        }
                    }
                }
            };
            check(&a, &b, &|t| t);
            // Rows read through a map (a token's row shared by its experts).
            let map: Vec<usize> = (0..tokens).map(|t| (t * 7 + 3) % 5).collect();
            matmul_grouped(
                |e| [&experts[e][0], &experts[e][1]],
                &groups,
                &mut acts,
                Some(&map),
                [&mut a, &mut b],
                &pool,
            );
            check(&a, &b, &|t| map[t]);
        }
    }

    #[test]
    fn products_are_the_same_bits_for_any_number_of_tokens() {
        // Batch invariance: a token's outputs never depend on how many
        // others share the product (1 to 9 tokens, or tiles of 16 and 32
        // with tokens left over).
        let pool = ThreadPool::new(2);
        for format in ALL {
            let (rows, cols) = (21, 512);
            let w = QMatrix::from_bytes(format, rows, cols, random_blocks(format, rows, cols, 11))
                .unwrap();
            let x = random(45 * cols, 12);
            let alone: Vec<Vec<f32>> = (0..45)
                .map(|t| product(&w, &x[t * cols..(t + 1) * cols], 1, &pool))
                .collect();
            for tokens in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 23, 45] {
                let together = product(&w, &x[..tokens * cols], tokens, &pool);
                for (t, expected) in alone.iter().take(tokens).enumerate() {
                    let got = &together[t * rows..(t + 1) * rows];
                    let same = got
                        .iter()
                        .zip(expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{format:?}: token {t} of {tokens} differs");
                }
            }
        }
    }

    #[test]
    fn a_region_of_tokens_is_written_in_place_with_the_plain_products_bits() {
        let pool = ThreadPool::new(2);
        for format in ALL {
            let (rows, cols, tokens) = (21, 512, 7);
            let w = QMatrix::from_bytes(format, rows, cols, random_blocks(format, rows, cols, 13))
                .unwrap();
            let x = random(tokens * cols, 14);
            let plain = product(&w, &x, tokens, &pool);
            let layout = OutLayout {
                stride: rows + 5,
                offset: 3,
            };
            let mut out = vec![-1.0; tokens * layout.stride];
            let mut acts = Activations::default();
            acts.set(&x, tokens, cols);
            matmul_region(&w, &mut acts, 2..6, &mut out, layout, &pool);
            for t in 0..tokens {
                let row = &out[t * layout.stride..(t + 1) * layout.stride];
                let (before, rest) = row.split_at(layout.offset);
                let (got, after) = rest.split_at(rows);
                assert!(
                    before.iter().chain(after).all(|&v| v == -1.0),
                    "{format:?}: only the region"
                );
                if (2..6).contains(&t) {
                    let expected = &plain[t * rows..(t + 1) * rows];
                    let same = got
                        .iter()
                        .zip(expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{format:?}: token {t}");
                } else {
                    assert!(
                        got.iter().all(|&v| v == -1.0),
                        "{format:?}: token {t} untouched"
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
