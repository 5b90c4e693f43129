use std::arch::x86_64::*;

use super::layout::k4_scales;
use crate::quant::block::BlockQ8K;

#[inline(always)]
pub(super) unsafe fn load_f16(p: *const u8) -> f32 {
    let bits = std::ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The exact sum of eight i32 lanes.
#[inline(always)]
pub(super) unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01));
    _mm_cvtsi128_si32(s)
}

#[inline(always)]
pub(super) unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// `scale * (u8 x i8 products summed by 4)`, as 8 i32 lanes.
#[inline(always)]
unsafe fn scaled_dot(values: __m256i, activations: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(scale, _mm256_maddubs_epi16(values, activations))
}

macro_rules! entry_points {
    ($dot:ident, $dot4:ident, $dotn:ident, $impl:ident, $width:expr) => {
        pub fn $dot(row: &[u8], x: &[BlockQ8K]) -> f32 {
            let mut out = [0.0];
            $dotn(row, [x], &mut out);
            out[0]
        }

        pub fn $dot4(rows: &[u8], x: [&[BlockQ8K]; 4], out: &mut [[f32; 4]]) {
            let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
            for (r, o) in out.iter_mut().enumerate() {
                $dotn(&rows[r * n * $width..], x, o);
            }
        }

        /// One body for every token count, so four tokens give one
        /// token's bits.
        fn $dotn<const N: usize>(row: &[u8], x: [&[BlockQ8K]; N], out: &mut [f32; N]) {
            let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
            assert!(row.len() >= n * $width);
            // SAFETY: AVX2 checked by `select`; bounds by the assert.
            unsafe { $impl(row, x, n, out) }
        }
    };
}

entry_points!(dot_q4_k, dot4_q4_k, dotn_q4_k, dotn_k4_impl_q4, 144);
entry_points!(dot_q5_k, dot4_q5_k, dotn_q5_k, dotn_k4_impl_q5, 176);
entry_points!(dot_q6_k, dot4_q6_k, dotn_q6_k, dotn_q6_k_impl, 210);
entry_points!(dot_q2_k, dot4_q2_k, dotn_q2_k, dotn_q2_k_impl, 84);
entry_points!(dot_q3_k, dot4_q3_k, dotn_q3_k, dotn_q3_k_impl, 110);

/// Quarter `quarter` of the 2-bit values packed in `bits` (32 bytes).
#[inline(always)]
unsafe fn low_pairs(bits: __m256i, quarter: usize) -> __m256i {
    let shifted = _mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * quarter as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

/// The i16 scales of the two sub-blocks of 16 that 32 values starting
/// at `32 * pair` span, spread over eight lanes each.
#[inline(always)]
unsafe fn scale_pair(scales: __m128i, pair: usize) -> __m256i {
    let shuffle = _mm_loadu_si128(SCALE_PAIRS[pair].as_ptr() as *const __m128i);
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuffle))
}

/// Q2_K against `N` activation rows: 2-bit values times the activations
/// by sub-block scale, the minimums from the activations' sums by 16.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_q2_k_impl<const N: usize>(
    row: &[u8],
    x: [&[BlockQ8K]; N],
    n: usize,
    out: &mut [f32; N],
) {
    let nibble = _mm_set1_epi8(0x0F);
    let mut total = [0.0f32; N];
    let mut mins = [0.0f32; N];
    for i in 0..n {
        let w = row.as_ptr().add(i * 84);
        prefetch_ahead(w, 84);
        let packed = _mm_loadu_si128(w as *const __m128i);
        let scales = _mm_and_si128(packed, nibble);
        let min_scales = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
        let mut sums = [_mm256_setzero_si256(); N];
        for half in 0..2 {
            let bits = load(w.add(16 + 32 * half));
            for quarter in 0..4 {
                let v = low_pairs(bits, quarter);
                let scale = scale_pair(scales, 4 * half + quarter);
                for k in 0..N {
                    let q8 = x[k].get_unchecked(i).qs.as_ptr() as *const u8;
                    let y = load(q8.add(128 * half + 32 * quarter));
                    sums[k] = _mm256_add_epi32(sums[k], scaled_dot(v, y, scale));
                }
            }
        }
        let (dw, dminw) = (load_f16(w.add(80)), load_f16(w.add(82)));
        for k in 0..N {
            let a = x[k].get_unchecked(i);
            let bsums = load(a.bsums.as_ptr() as *const u8);
            let min_sum = hsum_i32(_mm256_madd_epi16(bsums, min_scales));
            total[k] += (a.d * dw) * hsum_i32(sums[k]) as f32;
            mins[k] += (a.d * dminw) * min_sum as f32;
        }
    }
    for k in 0..N {
        out[k] = total[k] - mins[k];
    }
}

/// Q3_K against `N` activation rows: the values offset by 4 (0..8)
/// times the activations, less 4 times the scaled activation sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_q3_k_impl<const N: usize>(
    row: &[u8],
    x: [&[BlockQ8K]; N],
    n: usize,
    out: &mut [f32; N],
) {
    let one = _mm256_set1_epi8(1);
    let mut total = [0.0f32; N];
    for i in 0..n {
        let w = row.as_ptr().add(i * 110);
        prefetch_ahead(w, 110);
        let unpacked = super::layout::q3_scales(std::slice::from_raw_parts(w.add(96), 12));
        let scales = _mm_loadu_si128(unpacked.as_ptr() as *const __m128i);
        let scales16 = _mm256_cvtepi8_epi16(scales);
        let mut sums = [_mm256_setzero_si256(); N];
        for k in 0..N {
            // The offset of 4: sum_s scale_s * bsum_s * 4, exact.
            let bsums = load(x[k].get_unchecked(i).bsums.as_ptr() as *const u8);
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 2);
            sums[k] = _mm256_sub_epi32(sums[k], offset);
        }
        let hmask = load(w);
        for half in 0..2 {
            let bits = load(w.add(32 + 32 * half));
            for quarter in 0..4 {
                let shift = _mm_cvtsi32_si128((4 * half + quarter) as i32);
                let high = _mm256_and_si256(_mm256_srl_epi16(hmask, shift), one);
                let v = _mm256_or_si256(low_pairs(bits, quarter), _mm256_slli_epi16(high, 2));
                let scale = scale_pair(scales, 4 * half + quarter);
                for k in 0..N {
                    let q8 = x[k].get_unchecked(i).qs.as_ptr() as *const u8;
                    let y = load(q8.add(128 * half + 32 * quarter));
                    sums[k] = _mm256_add_epi32(sums[k], scaled_dot(v, y, scale));
                }
            }
        }
        let dw = load_f16(w.add(108));
        for k in 0..N {
            total[k] += (x[k].get_unchecked(i).d * dw) * hsum_i32(sums[k]) as f32;
        }
    }
    out.copy_from_slice(&total);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_k4_impl_q4<const N: usize>(
    row: &[u8],
    x: [&[BlockQ8K]; N],
    n: usize,
    out: &mut [f32; N],
) {
    dotn_k4::<N, false>(row, x, n, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_k4_impl_q5<const N: usize>(
    row: &[u8],
    x: [&[BlockQ8K]; N],
    n: usize,
    out: &mut [f32; N],
) {
    dotn_k4::<N, true>(row, x, n, out)
}

/// Bytes ahead of the block being read that [`prefetch_ahead`] asks for.
const PREFETCH_DISTANCE: usize = 3072;

/// Asks for the cache lines `PREFETCH_DISTANCE` bytes past a block of
/// `width` bytes at `block`: a decode step streams each row's blocks once,
/// and computing a block leaves too few loads in flight for the hardware
/// prefetchers alone. A prefetch never faults, past the end of the
/// weights too.
#[inline(always)]
pub(super) unsafe fn prefetch_ahead(block: *const u8, width: usize) {
    let ahead = block.wrapping_add(PREFETCH_DISTANCE);
    let mut line = 0;
    while line < width {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
        line += 64;
    }
}

/// `sum_j mins[j] * (bsums[2j] + bsums[2j + 1])`, exact (the minimums'
/// share of a Q4_K/Q5_K product, `layout::mins_dot`): the eight i16
/// minimums against the activations' sums by 32.
#[inline(always)]
unsafe fn mins_sum(mins: __m128i, bsums: &[i16; 16]) -> i32 {
    let sums = load(bsums.as_ptr() as *const u8);
    // Sums by 32 are at most 32 * 127 in magnitude: no i16 wraps.
    let by_32 = _mm_hadd_epi16(
        _mm256_castsi256_si128(sums),
        _mm256_extracti128_si256(sums, 1),
    );
    let products = _mm_madd_epi16(mins, by_32);
    let s = _mm_add_epi32(products, _mm_unpackhi_epi64(products, products));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01));
    _mm_cvtsi128_si32(s)
}

/// Chunk `chunk` of a Q4_K (Q5_K with `FIFTH`) super-block: 32 values
/// from the low nibbles of its 32 bytes, 32 from the high ones, with
/// their fifth bits (bits `2 chunk` and `2 chunk + 1` of `high`).
#[inline(always)]
pub(super) unsafe fn k4_chunk<const FIFTH: bool>(
    nibbles: *const u8,
    high: __m256i,
    chunk: usize,
) -> (__m256i, __m256i) {
    let (nibble_mask, one) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
    let bits = load(nibbles.add(32 * chunk));
    let low = _mm256_and_si256(bits, nibble_mask);
    let upper = _mm256_and_si256(_mm256_srli_epi16(bits, 4), nibble_mask);
    if !FIFTH {
        return (low, upper);
    }
    let fifth = |shift: usize| {
        let bit = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(shift as i32)), one);
        _mm256_slli_epi16(bit, 4)
    };
    (
        _mm256_or_si256(low, fifth(2 * chunk)),
        _mm256_or_si256(upper, fifth(2 * chunk + 1)),
    )
}

/// Q4_K (or Q5_K with `FIFTH`) against `N` activation rows.
#[inline(always)]
unsafe fn dotn_k4<const N: usize, const FIFTH: bool>(
    row: &[u8],
    x: [&[BlockQ8K]; N],
    n: usize,
    out: &mut [f32; N],
) {
    let width = if FIFTH { 176 } else { 144 };
    let one = _mm256_set1_epi8(1);
    let mut total = [0.0f32; N];
    let mut mins = [0.0f32; N];
    for i in 0..n {
        let w = row.get_unchecked(i * width..(i + 1) * width);
        prefetch_ahead(w.as_ptr(), width);
        let (scales, min_scales) = k4_scales(&w[4..16]);
        let nibbles = w.as_ptr().add(if FIFTH { 48 } else { 16 });
        let high = if FIFTH { load(w.as_ptr().add(16)) } else { one };
        let mut sums = [_mm256_setzero_si256(); N];
        for chunk in 0..4 {
            let (low, upper) = k4_chunk::<FIFTH>(nibbles, high, chunk);
            let scale_low = _mm256_set1_epi16(scales[2 * chunk] as i16);
            let scale_high = _mm256_set1_epi16(scales[2 * chunk + 1] as i16);
            for k in 0..N {
                let q8 = x[k].get_unchecked(i).qs.as_ptr() as *const u8;
                let a = scaled_dot(low, load(q8.add(64 * chunk)), scale_low);
                let b = scaled_dot(upper, load(q8.add(64 * chunk + 32)), scale_high);
                sums[k] = _mm256_add_epi32(sums[k], _mm256_add_epi32(a, b));
            }
        }
        let (dw, dminw) = (load_f16(w.as_ptr()), load_f16(w.as_ptr().add(2)));
        let min_scales = _mm_cvtepu8_epi16(_mm_loadl_epi64(min_scales.as_ptr() as *const __m128i));
        for k in 0..N {
            let a = x[k].get_unchecked(i);
            total[k] += (a.d * dw) * hsum_i32(sums[k]) as f32;
            mins[k] += (a.d * dminw) * mins_sum(min_scales, &a.bsums) as f32;
        }
    }
    for k in 0..N {
        out[k] = total[k] - mins[k];
    }
}

/// Byte-shuffles that spread i8 scale `2s` over lanes 0..8 and `2s + 1`
/// over lanes 8..16 (one 128-bit half of a 32-value product).
pub(super) static SCALE_PAIRS: [[u8; 16]; 8] = {
    let mut table = [[0u8; 16]; 8];
    let mut s = 0;
    while s < 8 {
        let mut b = 0;
        while b < 16 {
            table[s][b] = (2 * s + b / 8) as u8;
            b += 1;
        }
        s += 1;
    }
    table
};

/// One half of a Q6_K super-block as four quarters of 32 unsigned 6-bit
/// values: the low nibbles of `bits_a` and `bits_b` (then their high
/// nibbles), with two high bits each from `qh`.
#[inline(always)]
pub(super) unsafe fn q6_quarters(bits_a: __m256i, bits_b: __m256i, qh: __m256i) -> [__m256i; 4] {
    let low_mask = _mm256_set1_epi8(0x0F);
    [
        _mm256_or_si256(
            _mm256_and_si256(bits_a, low_mask),
            _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(3)), 4),
        ),
        _mm256_or_si256(
            _mm256_and_si256(bits_b, low_mask),
            _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(12)), 2),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(bits_a, 4), low_mask),
            _mm256_and_si256(qh, _mm256_set1_epi8(48)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(bits_b, 4), low_mask),
            _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(-64)), 2),
        ),
    ]
}

/// Q6_K against `N` activation rows: the unsigned 6-bit values times the
/// activations, less 32 times the scaled activation sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_q6_k_impl<const N: usize>(
    row: &[u8],
    x: [&[BlockQ8K]; N],
    n: usize,
    out: &mut [f32; N],
) {
    let mut total = [0.0f32; N];
    for i in 0..n {
        let w = row.as_ptr().add(i * 210);
        prefetch_ahead(w, 210);
        let scales = _mm_loadu_si128(w.add(192) as *const __m128i);
        let scales16 = _mm256_cvtepi8_epi16(scales);
        let mut sums = [_mm256_setzero_si256(); N];
        for k in 0..N {
            // The offset of 32: sum_s scale_s * bsum_s * 32, exact.
            let bsums = load(x[k].get_unchecked(i).bsums.as_ptr() as *const u8);
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
            sums[k] = _mm256_sub_epi32(sums[k], offset);
        }
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
                for k in 0..N {
                    let q8 = x[k].get_unchecked(i).qs.as_ptr() as *const u8;
                    let y = load(q8.add(128 * half + 32 * quarter));
                    sums[k] = _mm256_add_epi32(sums[k], scaled_dot(*v, y, scale));
                }
            }
        }
        let dw = load_f16(w.add(208));
        for k in 0..N {
            total[k] += (x[k].get_unchecked(i).d * dw) * hsum_i32(sums[k]) as f32;
        }
    }
    out.copy_from_slice(&total);
}
