//! How a K-quant super-block packs its scales, minimums and values:
//! unpacking and packing shared by the scalar and SIMD kernels and the
//! quantizers.

use super::super::block::QK_K;

/// The eight 6-bit scales and eight 6-bit minimums of a Q4_K/Q5_K
/// super-block, from their 12 packed bytes (llama.cpp's `get_scale_min_k4`),
/// four at a time in u32 words: scale j < 4 is the low 6 bits of byte j,
/// minimum j of byte j + 4; scale and minimum j + 4 take the low and high
/// nibble of byte j + 8 and, above them, the top 2 bits of bytes j and
/// j + 4.
#[inline(always)]
pub(super) fn k4_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let mut bytes = [0u8; 12];
    bytes.copy_from_slice(&q[..12]);
    let word = |i: usize| {
        u32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    let (first, second, third) = (word(0), word(1), word(2));
    let scales_high = (third & LOW4) | (((first >> 6) & LOW2) << 4);
    let mins_high = ((third >> 4) & LOW4) | (((second >> 6) & LOW2) << 4);
    let scales = u64::from(first & LOW6) | (u64::from(scales_high) << 32);
    let mins = u64::from(second & LOW6) | (u64::from(mins_high) << 32);
    (scales.to_le_bytes(), mins.to_le_bytes())
}

/// The inverse of [`k4_scales`].
pub(super) fn pack_k4_scales(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = scales[j] | ((scales[j + 4] >> 4) << 6);
        q[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6);
        q[j + 8] = (scales[j + 4] & 0x0F) | ((mins[j + 4] & 0x0F) << 4);
    }
    q
}

/// `sum_j mins[j] * (sum of activations of sub-block j)`: the minimums'
/// share of a Q4_K/Q5_K product, exact.
#[inline(always)]
pub(super) fn mins_dot(mins: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| mins[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

/// The 256 values of a Q4_K (`high = None`) or Q5_K super-block, unscaled:
/// sub-block `2c` takes the low nibbles of bytes `32c..32c+32`, `2c+1` the
/// high ones; Q5_K's fifth bits are bit `2c` and `2c+1` of `high[l]`.
pub(super) fn k4_values(nibbles: &[u8], high: Option<&[u8]>) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let (chunk, half, l) = (i / 64, (i / 32) % 2, i % 32);
        let byte = nibbles[32 * chunk + l];
        let nibble = if half == 0 { byte & 0x0F } else { byte >> 4 };
        let fifth = high.map_or(0, |h| (h[l] >> (2 * chunk + half)) & 1);
        nibble | (fifth << 4)
    })
}

/// The 256 values of a Q6_K super-block, offset by 32 (so -32..32).
pub(super) fn q6_values(block: &[u8]) -> [i8; QK_K] {
    let (ql, qh) = (&block[..128], &block[128..192]);
    std::array::from_fn(|i| {
        let (half, quarter, l) = (i / 128, (i / 32) % 4, i % 32);
        let low = ql[64 * half + 32 * (quarter % 2) + l];
        let nibble = if quarter < 2 { low & 0x0F } else { low >> 4 };
        let high = (qh[32 * half + l] >> (2 * quarter)) & 3;
        ((nibble | (high << 4)) as i32 - 32) as i8
    })
}

/// Value `128h + 32j + l` of a Q2_K/Q3_K super-block: bits `2j..2j+2` of
/// byte `32h + l` of its packed 2-bit values.
#[inline(always)]
pub(super) fn low_pair(packed: &[u8], i: usize) -> u8 {
    let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
    (packed[32 * h + l] >> (2 * j)) & 3
}

/// The 256 values of a Q2_K super-block (0..4).
pub(super) fn q2_values(block: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|i| low_pair(&block[16..80], i))
}

/// The 256 values of a Q3_K super-block offset by 4 (0..8): the 2-bit
/// value, plus 4 where its high bit (bit `4h + j` of `hmask[l]`) is set.
pub(super) fn q3_values(block: &[u8]) -> [u8; QK_K] {
    let (hmask, packed) = (&block[..32], &block[32..96]);
    std::array::from_fn(|i| {
        let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
        low_pair(packed, i) | (((hmask[l] >> (4 * h + j)) & 1) << 2)
    })
}

/// The sixteen 6-bit scales of a Q3_K super-block, less 32, from their 12
/// packed bytes: scale `k`'s low nibble is byte `k` (`k < 8`, low nibble)
/// or `k - 8` (high nibble), its high two bits are bits `2(k / 4)` of byte
/// `8 + k % 4`.
pub(super) fn q3_scales(packed: &[u8]) -> [i8; 16] {
    std::array::from_fn(|k| {
        let low = if k < 8 {
            packed[k] & 0x0F
        } else {
            packed[k - 8] >> 4
        };
        let high = (packed[8 + k % 4] >> (2 * (k / 4))) & 3;
        ((low | (high << 4)) as i32 - 32) as i8
    })
}

/// The inverse of [`q3_scales`] (scales in -32..32).
pub(super) fn pack_q3_scales(scales: &[i8; 16]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for (k, scale) in scales.iter().enumerate() {
        let unsigned = (*scale as i32 + 32) as u8;
        let low = unsigned & 0x0F;
        if k < 8 {
            packed[k] |= low;
        } else {
            packed[k - 8] |= low << 4;
        }
        packed[8 + k % 4] |= (unsigned >> 4) << (2 * (k / 4));
    }
    packed
}

/// Packs 256 values of 2 bits as [`low_pair`] reads them.
pub(super) fn pack_low_pairs(values: &[u8; QK_K]) -> [u8; 64] {
    let mut packed = [0u8; 64];
    for (i, v) in values.iter().enumerate() {
        let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
        packed[32 * h + l] |= (v & 3) << (2 * j);
    }
    packed
}
