//! AVX-512 kernels for eight activation rows at once (prefill and batches).
//!
//! Each 512-bit register holds two tokens' eight lanes side by side: the
//! weight block is unpacked once and broadcast to both halves, so one
//! `vpdpbusd`, one conversion and one FMA do what the AVX2 kernels do in
//! two. Every lane holds exactly the integers and takes exactly the
//! roundings of the AVX2 kernels' lane (the same 4 bytes summed, the same
//! `dw * d` scale, the same FMA, the same final fold), so a token's result is
//! [`super::avx2`]'s `dot`, bit for bit, whatever it is batched with.
//!
//! A call's activations are laid out once per call (each pair of tokens'
//! block in one aligned 64-byte line, each block's scales in one line), so
//! the loop over weight blocks spends its instructions on the weights: at
//! four tokens, unpacking a block costs as much as its two pairs' products.

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::avx2::{hsum, q5_0_unsigned};
use crate::quant::block::BlockQ8;

/// Whether AVX-512 (F, BW, VL) with VNNI runs here.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        super::avx2::vnni_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
    })
}

/// Whether these kernels' GFNI variants (one affine byte transform
/// unpacks a block's nibbles) run here: most CPUs with AVX-512 VNNI since
/// Ice Lake and Zen 4; not Cascade Lake.
pub fn gfni_available() -> bool {
    available() && is_x86_feature_detected!("gfni")
}

/// Two tokens' 32 activation bytes of one block, side by side: one
/// aligned load in the kernel (or a memory operand of `vpdpbusd`).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Pair([i8; 64]);

impl Pair {
    #[inline(always)]
    unsafe fn load(&self) -> __m512i {
        _mm512_load_si512(self.0.as_ptr() as *const __m512i)
    }
}

/// A block's 16 bytes of nibbles as its 32 values, low nibbles first, in
/// both halves of a register: `[low | high | low | high]` from one
/// broadcast load, one shift and one mask.
#[inline(always)]
unsafe fn nibbles_x2(p: *const u8) -> __m512i {
    let bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i));
    let shifts = _mm512_set_epi64(
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
    );
    _mm512_and_si512(_mm512_srlv_epi16(bytes, shifts), _mm512_set1_epi8(0x0F))
}

/// [`nibbles_x2`] in one GFNI instruction: in the low and the high 128-bit
/// lanes, bit matrices that keep each byte's low nibble, or move its high
/// nibble down (for bit `i` of the result, byte `7 - i` of the matrix
/// picks the source bit). The caller has GFNI.
#[inline(always)]
unsafe fn nibbles_x2_gfni(p: *const u8) -> __m512i {
    const LOW: i64 = 0x0102_0408_0000_0000;
    const HIGH: i64 = 0x1020_4080_0000_0000u64 as i64;
    let bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i));
    let matrices = _mm512_set_epi64(HIGH, HIGH, LOW, LOW, HIGH, HIGH, LOW, LOW);
    _mm512_gf2p8affine_epi64_epi8::<0>(bytes, matrices)
}

/// Rows `w0` and `w1`'s f16 block scales (at each block's start), each
/// converted into `T` lanes: `[d0; T]` then `[d1; T]`, from one conversion.
#[inline(always)]
unsafe fn two_scales<const T: usize>(w0: *const u8, w1: *const u8) -> __m512 {
    let first = _mm256_set1_epi16(std::ptr::read_unaligned(w0 as *const i16));
    let upper = (((1u32 << T) - 1) << T) as u16;
    let second = std::ptr::read_unaligned(w1 as *const i16);
    _mm512_cvtph_ps(_mm256_mask_set1_epi16(first, upper, second))
}

/// For weight row `j` (of two) and token pair `p`: lane `l` picks lane
/// `j * T + 2p + l / 8` of the two rows' products `dw * d` (laid out as
/// [`two_scales`]), so each token's eight lanes get its scale.
#[inline(always)]
unsafe fn row_pair_picks<const T: usize>() -> [[__m512i; 4]; 2] {
    std::array::from_fn(|j| {
        std::array::from_fn(|p| {
            let k = (j * T + 2 * p) as i32;
            let k1 = k + 1;
            _mm512_set_epi32(k1, k1, k1, k1, k1, k1, k1, k1, k, k, k, k, k, k, k, k)
        })
    })
}

/// Sixteen floats in one aligned line: a block's figure for `T` tokens,
/// token `k` in lanes `k` and `T + k` (one per weight row of a pair).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Lanes([f32; 16]);

impl Lanes {
    #[inline(always)]
    unsafe fn load(&self) -> __m512 {
        _mm512_load_ps(self.0.as_ptr())
    }
}

/// One call's activation rows laid out for the kernels: `pairs[i * T / 2 +
/// p]` holds tokens `2p` and `2p + 1` of block `i`; `figures[i * M + m]`
/// block `i`'s figure `m` (its scale, then its scaled sum where the format
/// has minimums) as [`Lanes`]; `biases` (offset formats only) as `pairs`,
/// `-OFFSET` times each four activation bytes' sum, in sixteen `i32`s.
struct Laid<'a> {
    pairs: &'a [Pair],
    figures: &'a [Lanes],
    biases: &'a [Pair],
}

/// Offset weights against `T` activation rows: `unpack` gives a block's 32
/// values plus `offset` as unsigned bytes in both halves, and each pair's
/// dot products start from its bias (`-offset` times the sum of the four
/// activation bytes each lane takes), so `vpdpbusd` leaves exactly the
/// signed weights' integer sums, the AVX2 kernels' `vpsignb` sums, with no
/// sign fix-up per pair. Weight rows go two at a time: they share the
/// conversion of their scales and the products `dw * d`, and each
/// accumulator's FMAs wait on the one before (four cycles), so a second
/// row's chains fill the wait; each row's sums keep their order.
#[inline(always)]
unsafe fn dot8_signed<const T: usize>(
    rows: &[u8],
    bytes: usize,
    laid: &Laid,
    out: &mut [[f32; T]],
    unpack: impl Fn(*const u8) -> __m512i,
) {
    let stride = laid.figures.len() * bytes;
    two_rows_at_a_time!(rows, stride, out, |w, o, R| {
        signed_rows::<T, R>(w, stride, bytes, laid, o, &unpack)
    });
}

/// Runs `$body` (with `R` a const of 2) over each pair of consecutive
/// weight rows (`w` the first row's bytes, `o` its two rows of `$out`),
/// then (with `R` of 1) over an odd row left. A macro rather than a
/// function taking closures: a closure does not inherit its function's
/// target features, and the kernels' intrinsics then stop inlining (70
/// times slower, measured).
macro_rules! two_rows_at_a_time {
    ($rows:expr, $stride:expr, $out:expr, |$w:ident, $o:ident, $r:ident| $body:expr) => {{
        let done = $out.len() / 2 * 2;
        let mut twos = $out.chunks_exact_mut(2);
        for (k, $o) in (&mut twos).enumerate() {
            let $w = $rows.as_ptr().add(2 * k * $stride);
            const $r: usize = 2;
            $body;
        }
        let $o = twos.into_remainder();
        if !$o.is_empty() {
            let $w = $rows.as_ptr().add(done * $stride);
            const $r: usize = 1;
            $body;
        }
    }};
}
use two_rows_at_a_time;

/// The second row of a pair of weight rows `stride` bytes apart: a lone
/// last row (`R` of 1) pairs with itself, and its copy's sums go unused.
#[inline(always)]
fn second_row<const R: usize>(stride: usize) -> usize {
    if R == 2 {
        stride
    } else {
        0
    }
}

/// [`dot8_signed`] over `R` weight rows `stride` bytes apart from `w`.
#[inline(always)]
unsafe fn signed_rows<const T: usize, const R: usize>(
    w: *const u8,
    stride: usize,
    bytes: usize,
    laid: &Laid,
    out: &mut [[f32; T]],
    unpack: &impl Fn(*const u8) -> __m512i,
) {
    let picks = row_pair_picks::<T>();
    let second = second_row::<R>(stride);
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let blocks = laid.figures.iter().zip(laid.pairs.chunks_exact(T / 2));
    let blocks = blocks.zip(laid.biases.chunks_exact(T / 2));
    for (i, ((scales, pairs), biases)) in blocks.enumerate() {
        let w0 = w.add(i * bytes);
        let w1 = w0.add(second);
        // `dw * d_k` for both rows and every token, each rounded once as
        // the AVX2 kernels' scalar product is.
        let products = _mm512_mul_ps(two_scales::<T>(w0, w1), scales.load());
        for (j, acc) in acc.iter_mut().enumerate() {
            let wb = if j == 0 { w0 } else { w1 };
            _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(PREFETCH_AHEAD) as *const i8);
            let q = unpack(wb);
            for (p, acc) in acc.iter_mut().enumerate().take(T / 2) {
                let y = pairs.get_unchecked(p).load();
                let sums = _mm512_dpbusd_epi32(biases.get_unchecked(p).load(), q, y);
                let scale = _mm512_permutexvar_ps(picks[j][p], products);
                *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), *acc);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(&acc) {
        fold_pairs(acc, o, [0.0; 8]);
    }
}

/// Each pair accumulator's two tokens' sums, plus `extra[k]` for token `k`.
#[inline(always)]
unsafe fn fold_pairs<const T: usize>(acc: &[__m512; 4], out: &mut [f32; T], extra: [f32; 8]) {
    for (p, acc) in acc.iter().enumerate().take(T / 2) {
        out[2 * p] = hsum(_mm512_castps512_ps256(*acc)) + extra[2 * p];
        out[2 * p + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(*acc),
        ))) + extra[2 * p + 1];
    }
}

/// How far ahead of the block being read the kernels ask for weights.
/// Rows read two at a time are two interleaved streams the hardware
/// prefetcher follows poorly (a 49152-row Q8_0 head read at a third of the
/// speed of one row after the other); asking 8 KiB ahead keeps the reads
/// streaming at any row width. A prefetch past the matrix never faults.
const PREFETCH_AHEAD: usize = 8192;

thread_local! {
    /// The rows' scales block by block, gathered once per call.
    static SCALES: RefCell<Vec<[f32; 8]>> = const { RefCell::new(Vec::new()) };
    /// The rows' activation bytes paired block by block, once per call.
    static PAIRS: RefCell<Vec<Pair>> = const { RefCell::new(Vec::new()) };
}

/// `f` with the eight activation rows' `M` per-block figures (`fields` of
/// each block: its scale, and its scaled sum where a kernel needs it) side
/// by side, figure `m` of block `i` at `i * M + m`: one load per block in
/// the kernel rather than eight.
pub(crate) fn with_scales<B, R, const M: usize, const T: usize>(
    x: [&[B]; T],
    n: usize,
    fields: impl Fn(&B) -> [f32; M],
    f: impl FnOnce(&[[f32; 8]]) -> R,
) -> R {
    SCALES.with_borrow_mut(|scales| {
        if scales.len() < n * M {
            scales.resize(n * M, [0.0; 8]);
        }
        let scales = &mut scales[..n * M];
        for (k, row) in x.iter().enumerate() {
            for (to, block) in scales.chunks_exact_mut(M).zip(&row[..n]) {
                for (to, value) in to.iter_mut().zip(fields(block)) {
                    to[k] = value;
                }
            }
        }
        f(scales)
    })
}

/// `f` with the `T` activation rows' first `n` blocks paired: tokens `2p`
/// and `2p + 1` of block `i` at `i * T / 2 + p`.
fn with_pairs<R, const T: usize>(x: [&[BlockQ8]; T], n: usize, f: impl FnOnce(&[Pair]) -> R) -> R {
    PAIRS.with_borrow_mut(|pairs| {
        let count = n * T / 2;
        if pairs.len() < count {
            pairs.resize(count, Pair([0; 64]));
        }
        let pairs = &mut pairs[..count];
        for (i, blocks) in pairs.chunks_exact_mut(T / 2).enumerate() {
            for (p, pair) in blocks.iter_mut().enumerate() {
                pair.0[..32].copy_from_slice(&x[2 * p][i].qs);
                pair.0[32..].copy_from_slice(&x[2 * p + 1][i].qs);
            }
        }
        f(pairs)
    })
}

/// Unsigned weights (`unpack` gives a block's 32 values as unsigned bytes
/// in both halves, and its scale and minimum as they lie in the block,
/// converted: lanes `2k` the scale, `2k + 1` the minimum) against `T`
/// activation rows; `figures[i]` holds block `i`'s activation scales and
/// scaled sums interleaved the same way (lane `2k` token `k`'s scale, `2k +
/// 1` its sum), so one multiplication gives both each token's `dw * d` and
/// its minimum's product `mw * s`, and one addition accumulates the
/// minimums' products (the even lanes' sums are never read). Rows go two
/// at a time and pairs of tokens share registers as in [`dot8_signed`]. The
/// minimums' products are summed apart and added last, as in the AVX2
/// kernels.
#[inline(always)]
unsafe fn dot8_unsigned<const T: usize>(
    rows: &[u8],
    bytes: usize,
    pairs: &[Pair],
    figures: &[Lanes],
    out: &mut [[f32; T]],
    unpack: impl Fn(*const u8) -> (__m512i, __m512),
) {
    let stride = figures.len() * bytes;
    two_rows_at_a_time!(rows, stride, out, |w, o, R| {
        unsigned_rows::<T, R>(w, stride, bytes, pairs, figures, o, &unpack)
    });
}

/// Lane `l` of `products[p]` picks lane `2 * (2p + l / 8)`: two tokens'
/// scales, each in eight lanes, from [`dot8_unsigned`]'s interleaved
/// products.
#[inline(always)]
unsafe fn interleaved_pair_picks() -> [__m512i; 4] {
    std::array::from_fn(|p| {
        let (k, k1) = (4 * p as i32, 4 * p as i32 + 2);
        _mm512_set_epi32(k1, k1, k1, k1, k1, k1, k1, k1, k, k, k, k, k, k, k, k)
    })
}

/// [`dot8_unsigned`] over `R` weight rows `stride` bytes apart from `w`.
#[inline(always)]
unsafe fn unsigned_rows<const T: usize, const R: usize>(
    w: *const u8,
    stride: usize,
    bytes: usize,
    pairs: &[Pair],
    figures: &[Lanes],
    out: &mut [[f32; T]],
    unpack: &impl Fn(*const u8) -> (__m512i, __m512),
) {
    let zero = _mm512_setzero_si512();
    let picks = interleaved_pair_picks();
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut mins = [_mm512_setzero_ps(); R];
    let blocks = figures.iter().zip(pairs.chunks_exact(T / 2));
    for (i, (figures, pairs)) in blocks.enumerate() {
        let figures = figures.load();
        for (j, (acc, mins)) in acc.iter_mut().zip(&mut mins).enumerate() {
            let wb = w.add(j * stride + i * bytes);
            _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(PREFETCH_AHEAD) as *const i8);
            let (q, scales) = unpack(wb);
            // Even lanes `dw * d_k`, odd lanes `mw * s_k`, each rounded
            // once as the AVX2 kernels' scalar products are.
            let products = _mm512_mul_ps(scales, figures);
            *mins = _mm512_add_ps(*mins, products);
            for (p, acc) in acc.iter_mut().enumerate().take(T / 2) {
                let y = pairs.get_unchecked(p).load();
                let prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, y));
                let scale = _mm512_permutexvar_ps(picks[p], products);
                *acc = _mm512_fmadd_ps(scale, prod, *acc);
            }
        }
    }
    for ((o, acc), mins) in out.iter_mut().zip(&acc).zip(&mins) {
        let mut lanes = [0.0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), *mins);
        fold_pairs(acc, o, std::array::from_fn(|k| lanes[2 * k + 1]));
    }
}

/// A `_1` block's scale and minimum (adjacent f16s at `p`), converted into
/// [`dot8_unsigned`]'s interleaved lanes: one load and one conversion.
#[inline(always)]
unsafe fn scale_and_minimum(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)))
}

/// `f` with the `T` activation rows' first `n` blocks' scales and scaled
/// sums interleaved as [`dot8_unsigned`] reads them.
fn with_interleaved_figures<R, const T: usize>(
    x: [&[BlockQ8]; T],
    n: usize,
    f: impl FnOnce(&[Lanes]) -> R,
) -> R {
    FIGURES.with_borrow_mut(|figures| {
        if figures.len() < n {
            figures.resize(n, Lanes([0.0; 16]));
        }
        let figures = &mut figures[..n];
        for (k, row) in x.iter().enumerate() {
            for (to, block) in figures.iter_mut().zip(&row[..n]) {
                to.0[2 * k] = block.d;
                to.0[2 * k + 1] = block.s;
            }
        }
        f(figures)
    })
}

thread_local! {
    /// The rows' figures block by block, laid out once per call.
    static FIGURES: RefCell<Vec<Lanes>> = const { RefCell::new(Vec::new()) };
    /// The pairs' biases, once per call.
    static BIASES: RefCell<Vec<Pair>> = const { RefCell::new(Vec::new()) };
}

/// `f` with the `T` activation rows' first `n` blocks' `M` figures laid
/// out as [`Laid::figures`].
fn with_figures<R, const T: usize, const M: usize>(
    x: [&[BlockQ8]; T],
    n: usize,
    fields: impl Fn(&BlockQ8) -> [f32; M],
    f: impl FnOnce(&[Lanes]) -> R,
) -> R {
    FIGURES.with_borrow_mut(|figures| {
        if figures.len() < n * M {
            figures.resize(n * M, Lanes([0.0; 16]));
        }
        let figures = &mut figures[..n * M];
        for (k, row) in x.iter().enumerate() {
            for (to, block) in figures.chunks_exact_mut(M).zip(&row[..n]) {
                for (to, value) in to.iter_mut().zip(fields(block)) {
                    to.0[k] = value;
                    to.0[T + k] = value;
                }
            }
        }
        f(figures)
    })
}

/// `f` with room for `count` biases (see [`Laid`]).
fn with_bias_room<R>(count: usize, f: impl FnOnce(&mut [Pair]) -> R) -> R {
    BIASES.with_borrow_mut(|biases| {
        if biases.len() < count {
            biases.resize(count, Pair([0; 64]));
        }
        f(&mut biases[..count])
    })
}

/// Each pair's bias for weights offset by `offset` (see [`Laid`]).
#[inline(always)]
unsafe fn fill_biases(pairs: &[Pair], offset: u8, biases: &mut [Pair]) {
    let zero = _mm512_setzero_si512();
    let offsets = _mm512_set1_epi8(offset as i8);
    for (bias, pair) in biases.iter_mut().zip(pairs) {
        let sums = _mm512_dpbusd_epi32(zero, offsets, pair.load());
        let negated = _mm512_sub_epi32(zero, sums);
        _mm512_store_si512(bias.0.as_mut_ptr() as *mut __m512i, negated);
    }
}

/// A format's public eight- and four-token kernels, over `$inner`.
macro_rules! dot8_and_dot4 {
    ($dot8:ident, $dot4:ident, $inner:ident) => {
        /// Consecutive rows against eight activation rows (a
        /// [`super::Dot8Fn`]); each result is the format's `dot`, bit for bit.
        pub fn $dot8(rows: &[u8], x: [&[BlockQ8]; 8], out: &mut [[f32; 8]]) {
            $inner::<8>(rows, x, out)
        }

        /// The same against four activation rows (a [`super::Dot4Fn`]).
        pub fn $dot4(rows: &[u8], x: [&[BlockQ8]; 4], out: &mut [[f32; 4]]) {
            $inner::<4>(rows, x, out)
        }
    };
}

/// Four- and eight-token entry points of a signed format (compiled for
/// `$features`, run where `$available()`): [`dot8_signed`], with `$offset`
/// what `$unpack` adds to each value, over the per-block figures `$fields`
/// (see [`Laid`]).
macro_rules! signed_entry {
    ($dot8:ident, $dot4:ident, $inner:ident, $features:literal, $available:ident, $body:ident, $offset:expr, $fields:expr, $bytes:expr, $unpack:expr) => {
        dot8_and_dot4!($dot8, $dot4, $inner);

        fn $inner<const T: usize>(rows: &[u8], x: [&[BlockQ8]; T], out: &mut [[f32; T]]) {
            #[target_feature(enable = $features)]
            unsafe fn run<const T: usize>(
                rows: &[u8],
                pairs: &[Pair],
                figures: &[Lanes],
                biases: &mut [Pair],
                out: &mut [[f32; T]],
            ) {
                fill_biases(pairs, $offset, biases);
                let laid = Laid {
                    pairs,
                    figures,
                    biases,
                };
                $body(rows, $bytes, &laid, out, $unpack)
            }
            let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
            assert!($available() && rows.len() >= out.len() * n * $bytes);
            // Formats without an offset start their sums from zero.
            let biases = if $offset == 0 { 0 } else { n * T / 2 };
            with_pairs(x, n, |pairs| {
                with_figures(x, n, $fields, |figures| {
                    // SAFETY: features checked just above; bounds by the assert.
                    with_bias_room(biases, |biases| unsafe {
                        run(rows, pairs, figures, biases, out)
                    })
                })
            })
        }
    };
}

signed_entry!(
    dot8_q4_0,
    dot4_q4_0,
    dotn_q4_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    available,
    dot8_signed,
    8,
    |b| [b.d],
    18,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe { nibbles_x2(wb.add(2)) }
);

// Where GFNI runs, its one-instruction unpacking of the nibbles: the same
// values, so the same bits.
signed_entry!(
    dot8_q4_0_gfni,
    dot4_q4_0_gfni,
    dotn_q4_0_gfni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,gfni",
    gfni_available,
    dot8_signed,
    8,
    |b| [b.d],
    18,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe { nibbles_x2_gfni(wb.add(2)) }
);

signed_entry!(
    dot8_q5_0,
    dot4_q5_0,
    dotn_q5_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    available,
    dot8_signed,
    16,
    |b| [b.d],
    22,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe { _mm512_broadcast_i64x4(q5_0_unsigned(wb)) }
);

signed_entry!(
    dot8_q8_0,
    dot4_q8_0,
    dotn_q8_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    available,
    dot8_signed,
    0x80,
    |b| [b.d],
    34,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe {
        let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(wb.add(2) as *const __m256i));
        _mm512_xor_si512(q, _mm512_set1_epi8(0x80u8 as i8))
    }
);

/// Four- and eight-token entry points of a format with minimums (compiled
/// for `$features`, run where `$available()`): [`dot8_unsigned`] over its
/// blocks of `$bytes`, unpacked by `$unpack`.
macro_rules! unsigned_entry {
    ($dot8:ident, $dot4:ident, $inner:ident, $features:literal, $available:ident, $body:ident, $bytes:expr, $unpack:expr) => {
        dot8_and_dot4!($dot8, $dot4, $inner);

        fn $inner<const T: usize>(rows: &[u8], x: [&[BlockQ8]; T], out: &mut [[f32; T]]) {
            #[target_feature(enable = $features)]
            unsafe fn run<const T: usize>(
                rows: &[u8],
                pairs: &[Pair],
                figures: &[Lanes],
                out: &mut [[f32; T]],
            ) {
                $body(rows, $bytes, pairs, figures, out, $unpack)
            }
            let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
            assert!($available() && rows.len() >= out.len() * n * $bytes);
            with_pairs(x, n, |pairs| {
                // SAFETY: features checked just above; bounds by the assert.
                with_interleaved_figures(x, n, |figures| unsafe { run(rows, pairs, figures, out) })
            })
        }
    };
}

unsigned_entry!(
    dot8_q4_1,
    dot4_q4_1,
    dotn_q4_1,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    available,
    dot8_unsigned,
    20,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe { (nibbles_x2(wb.add(4)), scale_and_minimum(wb)) }
);

unsigned_entry!(
    dot8_q4_1_gfni,
    dot4_q4_1_gfni,
    dotn_q4_1_gfni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,gfni",
    gfni_available,
    dot8_unsigned,
    20,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe { (nibbles_x2_gfni(wb.add(4)), scale_and_minimum(wb)) }
);

unsigned_entry!(
    dot8_q5_1,
    dot4_q5_1,
    dotn_q5_1,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    available,
    dot8_unsigned,
    24,
    // SAFETY: called by the entry's kernel, compiled for these features and
    // run only where they are; `wb` starts a whole block inside `rows`.
    |wb: *const u8| unsafe {
        let q = _mm512_broadcast_i64x4(super::avx2::q5_1_values(wb));
        (q, scale_and_minimum(wb))
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `rows` random blocks of `bytes`, each starting with sane f16 scales
    /// (`scales` of them) and random values after.
    fn random_rows(rows: usize, blocks: usize, bytes: usize, scales: usize) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let mut w: Vec<u8> = (0..rows * blocks * bytes).map(|_| rng.gen()).collect();
        for block in w.chunks_exact_mut(bytes) {
            for s in 0..scales {
                let scale = half::f16::from_f32(rng.gen_range(-0.05..0.05)).to_bits();
                block[2 * s..2 * s + 2].copy_from_slice(&scale.to_le_bytes());
            }
        }
        w
    }

    #[test]
    fn gfni_unpacking_gives_the_same_bits() {
        if !gfni_available() {
            tessera_testkit::not_run_here(
                "quant::kernels::avx512::gfni_unpacking_gives_the_same_bits",
                "the AVX-512 GFNI kernels (this CPU lacks AVX-512 VNNI or GFNI)",
            );
            return;
        }
        let (rows, blocks) = (13, 18);
        let acts: Vec<Vec<BlockQ8>> = (0..8)
            .map(|k| {
                let x: Vec<f32> = (0..blocks * 32)
                    .map(|i| ((i * 7 + k * 3) % 23) as f32 - 11.0)
                    .collect();
                let mut out = vec![BlockQ8::default(); blocks];
                // SAFETY: AVX-512 implies the AVX2 this needs.
                unsafe { super::super::avx2::quantize_row_q8(&x, &mut out, true) };
                out
            })
            .collect();
        let x8: [&[BlockQ8]; 8] = std::array::from_fn(|k| &acts[k][..]);
        let x4: [&[BlockQ8]; 4] = std::array::from_fn(|k| &acts[k][..]);
        type Pair = (
            fn(&[u8], [&[BlockQ8]; 8], &mut [[f32; 8]]),
            fn(&[u8], [&[BlockQ8]; 4], &mut [[f32; 4]]),
        );
        let formats: [(usize, usize, Pair, Pair); 2] = [
            (
                18,
                1,
                (dot8_q4_0, dot4_q4_0),
                (dot8_q4_0_gfni, dot4_q4_0_gfni),
            ),
            (
                20,
                2,
                (dot8_q4_1, dot4_q4_1),
                (dot8_q4_1_gfni, dot4_q4_1_gfni),
            ),
        ];
        for (bytes, scales, plain, gfni) in formats {
            let w = random_rows(rows, blocks, bytes, scales);
            let (mut a8, mut b8) = (vec![[0.0; 8]; rows], vec![[1.0; 8]; rows]);
            plain.0(&w, x8, &mut a8);
            gfni.0(&w, x8, &mut b8);
            let (mut a4, mut b4) = (vec![[0.0; 4]; rows], vec![[1.0; 4]; rows]);
            plain.1(&w, x4, &mut a4);
            gfni.1(&w, x4, &mut b4);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(a8.as_flattened()),
                bits(b8.as_flattened()),
                "{bytes}-byte blocks, 8 tokens"
            );
            assert_eq!(
                bits(a4.as_flattened()),
                bits(b4.as_flattened()),
                "{bytes}-byte blocks, 4 tokens"
            );
        }
    }
}
