//! AVX-512 K-quant kernels for eight activation rows at once: each 512-bit
//! register holds two tokens' integer partial sums side by side, the weight
//! values unpacked once (256 bits) and broadcast to both halves.
//!
//! The sums within a super-block are exact integers, so adding them in
//! other lanes changes nothing; the f32 products and running sums per
//! super-block are computed as in [`super::avx2`], in the same order, so
//! every result is the single-token kernel's bits.

use std::arch::x86_64::*;

use super::avx2::{k4_chunk, load, load_f16, q6_quarters, SCALE_PAIRS};
use super::layout::k4_scales;
use crate::quant::block::BlockQ8K;
use crate::quant::kernels::avx512::with_scales;

/// The two tokens' sixteen activation sums by 16, side by side.
#[inline(always)]
unsafe fn pair_bsums(a: &BlockQ8K, b: &BlockQ8K) -> __m512i {
    let low = _mm512_castsi256_si512(load(a.bsums.as_ptr() as *const u8));
    _mm512_inserti64x4(low, load(b.bsums.as_ptr() as *const u8), 1)
}

/// The two tokens' 32 activation bytes at `offset` of a super-block.
#[inline(always)]
unsafe fn pair_load(a: &BlockQ8K, b: &BlockQ8K, offset: usize) -> __m512i {
    let low = _mm512_castsi256_si512(load((a.qs.as_ptr() as *const u8).add(offset)));
    _mm512_inserti64x4(low, load((b.qs.as_ptr() as *const u8).add(offset)), 1)
}

/// `scale * (u8 x i8 products summed by 4)`, as 16 i32 lanes.
#[inline(always)]
unsafe fn scaled_dot(values: __m512i, activations: __m512i, scale: __m512i) -> __m512i {
    _mm512_madd_epi16(scale, _mm512_maddubs_epi16(values, activations))
}

macro_rules! entry_points {
    ($dot8:ident, $dot4:ident, $inner:ident, $body:path, $width:expr) => {
        /// Consecutive rows against eight activation rows (a
        /// [`crate::quant::kernels::Dot8Fn`]); each result is the format's
        /// `dot`, bit for bit.
        pub fn $dot8(rows: &[u8], x: [&[BlockQ8K]; 8], out: &mut [[f32; 8]]) {
            $inner::<8>(rows, x, out)
        }

        /// The same against four activation rows.
        pub fn $dot4(rows: &[u8], x: [&[BlockQ8K]; 4], out: &mut [[f32; 4]]) {
            $inner::<4>(rows, x, out)
        }

        fn $inner<const T: usize>(rows: &[u8], x: [&[BlockQ8K]; T], out: &mut [[f32; T]]) {
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
            unsafe fn run<const T: usize>(
                row: *const u8,
                x: [&[BlockQ8K]; T],
                scales: &[[f32; 8]],
                out: &mut [f32; T],
            ) {
                $body(row, x, scales, out)
            }
            let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
            assert!(
                crate::quant::kernels::avx512_available() && rows.len() >= out.len() * n * $width
            );
            with_scales(
                x,
                n,
                |b| [b.d],
                |scales| {
                    for (r, o) in out.iter_mut().enumerate() {
                        // SAFETY: features checked just above; bounds by the assert.
                        unsafe { run(rows.as_ptr().add(r * n * $width), x, scales, o) }
                    }
                },
            )
        }
    };
}

entry_points!(dot8_q4_k, dot4_q4_k, dotn_q4_k, dot8_k4::<false, T>, 144);
entry_points!(dot8_q5_k, dot4_q5_k, dotn_q5_k, dot8_k4::<true, T>, 176);
entry_points!(dot8_q6_k, dot4_q6_k, dotn_q6_k, dot8_q6_k_body::<T>, 210);

/// The exact sum of each token's eight lanes, in token order, from four
/// registers of two tokens each (token `2p` in the low half of `v[p]`).
#[inline(always)]
unsafe fn token_sums(v: &[__m512i; 4]) -> __m256i {
    let a = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let b = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // Each 128-bit lane: four values of tokens (2p for p in 0..4) summed.
    let c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let (lo, hi) = (_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64::<1>(c));
    let even = _mm_add_epi32(
        _mm256_castsi256_si128(lo),
        _mm256_extracti128_si256::<1>(lo),
    );
    let odd = _mm_add_epi32(
        _mm256_castsi256_si128(hi),
        _mm256_extracti128_si256::<1>(hi),
    );
    _mm256_set_m128i(_mm_unpackhi_epi32(even, odd), _mm_unpacklo_epi32(even, odd))
}

/// The first `T` lanes of `v` into `out`.
#[inline(always)]
unsafe fn store_first<const T: usize>(out: &mut [f32; T], v: __m256) {
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    out.copy_from_slice(&lanes[..T]);
}

/// `total += (d * dw) * sums`, lane by lane: the f32 products and sums of
/// the single-token kernel, rounded in the same order.
#[inline(always)]
unsafe fn accumulate(total: __m256, d: __m256, dw: f32, sums: __m256i) -> __m256 {
    let scale = _mm256_mul_ps(d, _mm256_set1_ps(dw));
    _mm256_add_ps(total, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(sums)))
}

/// Q4_K (or Q5_K with `FIFTH`), one row against eight tokens.
#[inline(always)]
unsafe fn dot8_k4<const FIFTH: bool, const T: usize>(
    row: *const u8,
    x: [&[BlockQ8K]; T],
    scales8: &[[f32; 8]],
    out: &mut [f32; T],
) {
    let width = if FIFTH { 176 } else { 144 };
    let one = _mm256_set1_epi8(1);
    let mut total = _mm256_setzero_ps();
    let mut mins = _mm256_setzero_ps();
    for (i, d) in scales8.iter().enumerate() {
        let w = row.add(i * width);
        let (scales, min_scales) = k4_scales(std::slice::from_raw_parts(w.add(4), 12));
        let nibbles = w.add(if FIFTH { 48 } else { 16 });
        let high = if FIFTH { load(w.add(16)) } else { one };
        let mut sums = [_mm512_setzero_si512(); 4];
        for chunk in 0..4 {
            let (low, upper) = k4_chunk::<FIFTH>(nibbles, high, chunk);
            let (low, upper) = (_mm512_broadcast_i64x4(low), _mm512_broadcast_i64x4(upper));
            let scale_low = _mm512_set1_epi16(scales[2 * chunk] as i16);
            let scale_high = _mm512_set1_epi16(scales[2 * chunk + 1] as i16);
            for (p, sum) in sums.iter_mut().enumerate().take(T / 2) {
                let (a, b) = (x[2 * p].get_unchecked(i), x[2 * p + 1].get_unchecked(i));
                let lo = scaled_dot(low, pair_load(a, b, 64 * chunk), scale_low);
                let hi = scaled_dot(upper, pair_load(a, b, 64 * chunk + 32), scale_high);
                *sum = _mm512_add_epi32(*sum, _mm512_add_epi32(lo, hi));
            }
        }
        // mins_dot: sum_j min_j * (bsum_2j + bsum_2j+1), exact in i32.
        let m = _mm_cvtepu8_epi16(_mm_loadl_epi64(min_scales.as_ptr() as *const __m128i));
        let m = _mm512_broadcast_i64x4(_mm256_set_m128i(
            _mm_unpackhi_epi16(m, m),
            _mm_unpacklo_epi16(m, m),
        ));
        let min_sums: [__m512i; 4] = std::array::from_fn(|p| {
            if p >= T / 2 {
                return _mm512_setzero_si512();
            }
            let (a, b) = (x[2 * p].get_unchecked(i), x[2 * p + 1].get_unchecked(i));
            let bsums = pair_bsums(a, b);
            _mm512_madd_epi16(bsums, m)
        });
        let d = _mm256_loadu_ps(d.as_ptr());
        total = accumulate(total, d, load_f16(w), token_sums(&sums));
        mins = accumulate(mins, d, load_f16(w.add(2)), token_sums(&min_sums));
    }
    store_first(out, _mm256_sub_ps(total, mins));
}

/// Q6_K, one row against eight tokens: the unsigned 6-bit values times the
/// activations, less 32 times the scaled activation sums.
#[inline(always)]
unsafe fn dot8_q6_k_body<const T: usize>(
    row: *const u8,
    x: [&[BlockQ8K]; T],
    scales8: &[[f32; 8]],
    out: &mut [f32; T],
) {
    let mut total = _mm256_setzero_ps();
    for (i, d) in scales8.iter().enumerate() {
        let w = row.add(i * 210);
        let scales = _mm_loadu_si128(w.add(192) as *const __m128i);
        let scales16 = _mm512_broadcast_i64x4(_mm256_cvtepi8_epi16(scales));
        let mut sums: [__m512i; 4] = std::array::from_fn(|p| {
            if p >= T / 2 {
                return _mm512_setzero_si512();
            }
            let (a, b) = (x[2 * p].get_unchecked(i), x[2 * p + 1].get_unchecked(i));
            let bsums = pair_bsums(a, b);
            // The offset of 32: sum_s scale_s * bsum_s * 32, exact.
            _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_slli_epi32(_mm512_madd_epi16(bsums, scales16), 5),
            )
        });
        for half in 0..2 {
            let ql = w.add(64 * half);
            let qh = load(w.add(128 + 32 * half));
            let bits_a = load(ql);
            let bits_b = load(ql.add(32));
            let values = q6_quarters(bits_a, bits_b, qh);
            for (quarter, v) in values.iter().enumerate() {
                let pair = &SCALE_PAIRS[4 * half + quarter];
                let shuffle = _mm_loadu_si128(pair.as_ptr() as *const __m128i);
                let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuffle));
                let (v, scale) = (_mm512_broadcast_i64x4(*v), _mm512_broadcast_i64x4(scale));
                for (p, sum) in sums.iter_mut().enumerate().take(T / 2) {
                    let (a, b) = (x[2 * p].get_unchecked(i), x[2 * p + 1].get_unchecked(i));
                    let y = pair_load(a, b, 128 * half + 32 * quarter);
                    *sum = _mm512_add_epi32(*sum, scaled_dot(v, y, scale));
                }
            }
        }
        let d = _mm256_loadu_ps(d.as_ptr());
        total = accumulate(total, d, load_f16(w.add(208)), token_sums(&sums));
    }
    store_first(out, total);
}
