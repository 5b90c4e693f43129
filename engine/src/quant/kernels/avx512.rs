//! AVX-512 kernels for eight activation rows at once (prefill and batches).
//!
//! Each 512-bit register holds two tokens' eight lanes side by side: the
//! weight block is unpacked once (256 bits) and broadcast to both halves,
//! so one `vpdpbusd`, one conversion and one FMA do what the AVX2 kernels do
//! in two. Every lane holds exactly the integers and takes exactly the
//! roundings of the AVX2 kernels' lane (the same 4 bytes summed, the same
//! `dw * d` scale, the same FMA, the same final fold), so a token's result is
//! [`super::avx2`]'s `dot`, bit for bit, whatever it is batched with.

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::avx2::{hsum, load_f16, q5_0_values};
use crate::quant::BlockQ8;

/// Whether AVX-512 (F, BW, VL) with VNNI runs here.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        super::avx2::vnni_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
    })
}

/// Lane `l` of `products[p]` picks lane `2p + l / 8`: two tokens' scales,
/// each in eight lanes.
#[inline(always)]
unsafe fn pair_picks() -> [__m512i; 4] {
    std::array::from_fn(|p| {
        let (k, k1) = (2 * p as i32, 2 * p as i32 + 1);
        _mm512_set_epi32(k1, k1, k1, k1, k1, k1, k1, k1, k, k, k, k, k, k, k, k)
    })
}

/// The two tokens' 32 activation bytes of one block, side by side.
#[inline(always)]
unsafe fn pair_activations(a: &BlockQ8, b: &BlockQ8) -> __m512i {
    let low = _mm512_castsi256_si512(_mm256_load_si256(a.qs.as_ptr() as *const __m256i));
    _mm512_inserti64x4(low, _mm256_load_si256(b.qs.as_ptr() as *const __m256i), 1)
}

/// Signed weights (`unpack` gives a block's 32 values as signed bytes and
/// its scale) against eight activation rows, row after row: `|w|` times
/// `y` with `w`'s sign, as the AVX2 kernels' `vpsignb` pair computes it.
/// `scales[i]` holds the eight rows' activation scales of block `i`.
#[inline(always)]
unsafe fn dot8_signed<const T: usize>(
    rows: &[u8],
    bytes: usize,
    x: [&[BlockQ8]; T],
    scales: &[[f32; 8]],
    out: &mut [[f32; T]],
    unpack: impl Fn(*const u8) -> (__m256i, f32),
) {
    let n = scales.len();
    let zero = _mm512_setzero_si512();
    let picks = pair_picks();
    for (r, o) in out.iter_mut().enumerate() {
        let w = rows.as_ptr().add(r * n * bytes);
        let mut acc = [_mm512_setzero_ps(); 4];
        for (i, scales) in scales.iter().enumerate() {
            let (q, dw) = unpack(w.add(i * bytes));
            let q = _mm512_broadcast_i64x4(q);
            let magnitude = _mm512_abs_epi8(q);
            let negative = _mm512_movepi8_mask(q);
            // `dw * d_k` for the eight tokens, each rounded once as the
            // AVX2 kernels' scalar product is.
            let products = _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_loadu_ps(scales.as_ptr()));
            let products = _mm512_castps256_ps512(products);
            for (p, acc) in acc.iter_mut().enumerate().take(T / 2) {
                let (a, b) = (x[2 * p].get_unchecked(i), x[2 * p + 1].get_unchecked(i));
                let y = pair_activations(a, b);
                // `vpsignb` zeroes where w is 0; negating instead changes
                // nothing there, as |w| is 0 too.
                let y = _mm512_mask_sub_epi8(y, negative, zero, y);
                let prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, magnitude, y));
                let scale = _mm512_permutexvar_ps(picks[p], products);
                *acc = _mm512_fmadd_ps(scale, prod, *acc);
            }
        }
        for (p, acc) in acc.iter().enumerate().take(T / 2) {
            o[2 * p] = hsum(_mm512_castps512_ps256(*acc));
            o[2 * p + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(*acc),
            )));
        }
    }
}

thread_local! {
    /// The eight rows' scales block by block, gathered once per call.
    static SCALES: RefCell<Vec<[f32; 8]>> = const { RefCell::new(Vec::new()) };
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

/// Unsigned weights (`unpack` gives a block's 32 values as unsigned bytes,
/// its scale and its minimum) against eight activation rows, row after
/// row; `figures` holds each block's eight scales, then their scaled sums.
/// The minimums' products are summed apart and added last, as in the AVX2
/// kernels.
#[inline(always)]
unsafe fn dot8_unsigned<const T: usize>(
    rows: &[u8],
    bytes: usize,
    x: [&[BlockQ8]; T],
    figures: &[[f32; 8]],
    out: &mut [[f32; T]],
    unpack: impl Fn(*const u8) -> (__m256i, f32, f32),
) {
    let n = figures.len() / 2;
    let zero = _mm512_setzero_si512();
    let picks = pair_picks();
    for (r, o) in out.iter_mut().enumerate() {
        let w = rows.as_ptr().add(r * n * bytes);
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut mins = _mm256_setzero_ps();
        for (i, figures) in figures.chunks_exact(2).enumerate() {
            let (q, dw, mw) = unpack(w.add(i * bytes));
            let q = _mm512_broadcast_i64x4(q);
            let products = _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_loadu_ps(figures[0].as_ptr()));
            let products = _mm512_castps256_ps512(products);
            let sums = _mm256_loadu_ps(figures[1].as_ptr());
            mins = _mm256_add_ps(mins, _mm256_mul_ps(_mm256_set1_ps(mw), sums));
            for (p, acc) in acc.iter_mut().enumerate().take(T / 2) {
                let (a, b) = (x[2 * p].get_unchecked(i), x[2 * p + 1].get_unchecked(i));
                let y = pair_activations(a, b);
                let prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, y));
                let scale = _mm512_permutexvar_ps(picks[p], products);
                *acc = _mm512_fmadd_ps(scale, prod, *acc);
            }
        }
        let mut min_lanes = [0.0f32; 8];
        _mm256_storeu_ps(min_lanes.as_mut_ptr(), mins);
        for (p, acc) in acc.iter().enumerate().take(T / 2) {
            o[2 * p] = hsum(_mm512_castps512_ps256(*acc)) + min_lanes[2 * p];
            o[2 * p + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(*acc),
            ))) + min_lanes[2 * p + 1];
        }
    }
}

/// Four- and eight-token entry points of one format: `$body` is
/// [`dot8_signed`] or [`dot8_unsigned`], `$fields` the per-block figures
/// it reads (see [`with_scales`]).
macro_rules! dot8_entry {
    ($dot8:ident, $dot4:ident, $inner:ident, $body:ident, $fields:expr, $bytes:expr, $unpack:expr) => {
        /// Consecutive rows against eight activation rows (a
        /// [`super::Dot8Fn`]); each result is the format's `dot`, bit for bit.
        pub fn $dot8(rows: &[u8], x: [&[BlockQ8]; 8], out: &mut [[f32; 8]]) {
            $inner::<8>(rows, x, out)
        }

        /// The same against four activation rows (a [`super::Dot4Fn`]).
        pub fn $dot4(rows: &[u8], x: [&[BlockQ8]; 4], out: &mut [[f32; 4]]) {
            $inner::<4>(rows, x, out)
        }

        fn $inner<const T: usize>(rows: &[u8], x: [&[BlockQ8]; T], out: &mut [[f32; T]]) {
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn run<const T: usize>(
                rows: &[u8],
                x: [&[BlockQ8]; T],
                figures: &[[f32; 8]],
                out: &mut [[f32; T]],
            ) {
                $body(rows, $bytes, x, figures, out, $unpack)
            }
            let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
            assert!(available() && rows.len() >= out.len() * n * $bytes);
            // SAFETY: features checked just above; bounds by the assert.
            with_scales(x, n, $fields, |figures| unsafe {
                run(rows, x, figures, out)
            })
        }
    };
}

dot8_entry!(
    dot8_q4_0,
    dot4_q4_0,
    dotn_q4_0,
    dot8_signed,
    |b| [b.d],
    18,
    |wb: *const u8| unsafe {
        let q = _mm256_sub_epi8(super::avx2::nibbles(wb.add(2)), _mm256_set1_epi8(8));
        (q, load_f16(wb))
    }
);

dot8_entry!(
    dot8_q5_0,
    dot4_q5_0,
    dotn_q5_0,
    dot8_signed,
    |b| [b.d],
    22,
    |wb: *const u8| unsafe { (q5_0_values(wb), load_f16(wb)) }
);

dot8_entry!(
    dot8_q8_0,
    dot4_q8_0,
    dotn_q8_0,
    dot8_signed,
    |b| [b.d],
    34,
    |wb: *const u8| unsafe {
        (
            _mm256_loadu_si256(wb.add(2) as *const __m256i),
            load_f16(wb),
        )
    }
);

dot8_entry!(
    dot8_q4_1,
    dot4_q4_1,
    dotn_q4_1,
    dot8_unsigned,
    |b| [b.d, b.s],
    20,
    |wb: *const u8| unsafe {
        (
            super::avx2::nibbles(wb.add(4)),
            load_f16(wb),
            load_f16(wb.add(2)),
        )
    }
);

dot8_entry!(
    dot8_q5_1,
    dot4_q5_1,
    dotn_q5_1,
    dot8_unsigned,
    |b| [b.d, b.s],
    24,
    |wb: *const u8| unsafe {
        (
            super::avx2::q5_1_values(wb),
            load_f16(wb),
            load_f16(wb.add(2)),
        )
    }
);
