//! The K-quants: super-blocks of 256 values with per-sub-block scales, as
//! llama.cpp stores them (`block_q4_K`, `block_q5_K`, `block_q6_K`), and their
//! products with `Q8_K` activations.
//!
//! Within a super-block every product is an exact integer: the sub-block
//! scales multiply integer dot products, and the minimums (or Q6_K's offset
//! of 32) come from the activation's sums by 16. Only the two f32 products
//! per super-block (`d * sum`, `dmin * mins`) and their running sums are
//! rounded, in the same order in every kernel, so the SIMD kernels give the
//! scalar reference's bits, and four tokens give one token's bits.

use half::f16;

use super::kernels::{read_f16, DotFn, Kernels};
use super::WeightFormat;

/// Values per super-block.
pub const QK_K: usize = 256;

/// One super-block of 256 activations rounded to i8 (llama.cpp's
/// `block_q8_K`): the scale is kept in f32, and `bsums[j]` is the sum of
/// values `16j..16j+16`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(4))]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// llama.cpp's `quantize_row_q8_K_ref`, which its x86 build also uses: the
/// value of largest magnitude maps to -127, the others round half to even.
pub fn quantize_row_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    #[cfg(target_arch = "x86_64")]
    if super::kernels::avx2_available() {
        // SAFETY: AVX2 checked at run time.
        unsafe { quantize_row_q8k_avx2(x, out) };
        return;
    }
    quantize_row_q8k_body(x, out)
}

/// The same arithmetic compiled for AVX2, where rounding half to even is
/// one vector instruction (`vroundps`) rather than a call to `rintf` per
/// value; the results are the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_q8k_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    quantize_row_q8k_body(x, out)
}

/// The portable body, for tests to compare the AVX2 build with.
#[inline(always)]
pub(super) fn quantize_row_q8k_body(x: &[f32], out: &mut [BlockQ8K]) {
    for (values, block) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in values {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *block = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, v) in block.qs.iter_mut().zip(values) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (sum, group) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
            *sum = group.iter().map(|&q| q as i16).sum();
        }
        block.d = 1.0 / iscale;
    }
}

/// The fastest kernels for a K-quant `format` on this CPU.
pub fn select(format: WeightFormat) -> Kernels<BlockQ8K> {
    #[cfg(target_arch = "x86_64")]
    if super::kernels::avx2_available() {
        let (dot, dot4): (DotFn<BlockQ8K>, super::kernels::Dot4Fn<BlockQ8K>) = match format {
            WeightFormat::Q4_K => (avx2::dot_q4_k, avx2::dot4_q4_k),
            WeightFormat::Q5_K => (avx2::dot_q5_k, avx2::dot4_q5_k),
            WeightFormat::Q6_K => (avx2::dot_q6_k, avx2::dot4_q6_k),
            WeightFormat::Q2_K => (avx2::dot_q2_k, avx2::dot4_q2_k),
            WeightFormat::Q3_K => (avx2::dot_q3_k, avx2::dot4_q3_k),
            _ => return scalar_kernels(format),
        };
        let (dot4, dot8) = match avx512_kernels(format) {
            Some((dot4, dot8)) => (dot4, Some(dot8)),
            None => (dot4, None),
        };
        return Kernels {
            dot,
            dot4: Some(dot4),
            dot8,
            rows: None,
        };
    }
    scalar_kernels(format)
}

/// The AVX2 four-token kernel of `format` (selected only where AVX-512
/// is not), for tests to check on every CPU.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) fn avx2_dot4(format: WeightFormat) -> Option<super::kernels::Dot4Fn<BlockQ8K>> {
    if !super::kernels::avx2_available() {
        return None;
    }
    match format {
        WeightFormat::Q4_K => Some(avx2::dot4_q4_k),
        WeightFormat::Q5_K => Some(avx2::dot4_q5_k),
        WeightFormat::Q6_K => Some(avx2::dot4_q6_k),
        WeightFormat::Q2_K => Some(avx2::dot4_q2_k),
        WeightFormat::Q3_K => Some(avx2::dot4_q3_k),
        _ => None,
    }
}

/// The AVX-512 four- and eight-token kernels of `format`, where this CPU
/// has them.
#[cfg(target_arch = "x86_64")]
fn avx512_kernels(
    format: WeightFormat,
) -> Option<(
    super::kernels::Dot4Fn<BlockQ8K>,
    super::kernels::Dot8Fn<BlockQ8K>,
)> {
    if !super::kernels::avx512_available() {
        return None;
    }
    match format {
        WeightFormat::Q4_K => Some((avx512::dot4_q4_k, avx512::dot8_q4_k)),
        WeightFormat::Q5_K => Some((avx512::dot4_q5_k, avx512::dot8_q5_k)),
        WeightFormat::Q6_K => Some((avx512::dot4_q6_k, avx512::dot8_q6_k)),
        _ => None,
    }
}

fn scalar_kernels(format: WeightFormat) -> Kernels<BlockQ8K> {
    let dot: DotFn<BlockQ8K> = match format {
        WeightFormat::Q4_K => scalar::dot_q4_k,
        WeightFormat::Q5_K => scalar::dot_q5_k,
        WeightFormat::Q6_K => scalar::dot_q6_k,
        WeightFormat::Q2_K => scalar::dot_q2_k,
        WeightFormat::Q3_K => scalar::dot_q3_k,
        _ => |_, _| f32::NAN,
    };
    Kernels {
        dot,
        dot4: None,
        dot8: None,
        rows: None,
    }
}

/// The eight 6-bit scales and eight 6-bit minimums of a Q4_K/Q5_K
/// super-block, from their 12 packed bytes (llama.cpp's `get_scale_min_k4`).
#[inline(always)]
fn k4_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for j in 0..4 {
        scales[j] = q[j] & 63;
        mins[j] = q[j + 4] & 63;
        scales[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        mins[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
    (scales, mins)
}

/// The inverse of [`k4_scales`].
fn pack_k4_scales(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
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
fn mins_dot(mins: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| mins[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

/// The 256 values of a Q4_K (`high = None`) or Q5_K super-block, unscaled:
/// sub-block `2c` takes the low nibbles of bytes `32c..32c+32`, `2c+1` the
/// high ones; Q5_K's fifth bits are bit `2c` and `2c+1` of `high[l]`.
fn k4_values(nibbles: &[u8], high: Option<&[u8]>) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let (chunk, half, l) = (i / 64, (i / 32) % 2, i % 32);
        let byte = nibbles[32 * chunk + l];
        let nibble = if half == 0 { byte & 0x0F } else { byte >> 4 };
        let fifth = high.map_or(0, |h| (h[l] >> (2 * chunk + half)) & 1);
        nibble | (fifth << 4)
    })
}

/// The 256 values of a Q6_K super-block, offset by 32 (so -32..32).
fn q6_values(block: &[u8]) -> [i8; QK_K] {
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
fn low_pair(packed: &[u8], i: usize) -> u8 {
    let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
    (packed[32 * h + l] >> (2 * j)) & 3
}

/// The 256 values of a Q2_K super-block (0..4).
fn q2_values(block: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|i| low_pair(&block[16..80], i))
}

/// The 256 values of a Q3_K super-block offset by 4 (0..8): the 2-bit
/// value, plus 4 where its high bit (bit `4h + j` of `hmask[l]`) is set.
fn q3_values(block: &[u8]) -> [u8; QK_K] {
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
fn q3_scales(packed: &[u8]) -> [i8; 16] {
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
fn pack_q3_scales(scales: &[i8; 16]) -> [u8; 12] {
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
fn pack_low_pairs(values: &[u8; QK_K]) -> [u8; 64] {
    let mut packed = [0u8; 64];
    for (i, v) in values.iter().enumerate() {
        let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
        packed[32 * h + l] |= (v & 3) << (2 * j);
    }
    packed
}

/// Dequantizes one row of a K-quant format.
pub fn dequantize_row(format: WeightFormat, row: &[u8], out: &mut [f32]) {
    let width = format.block_bytes();
    for (block, out) in row.chunks_exact(width).zip(out.chunks_exact_mut(QK_K)) {
        match format {
            WeightFormat::Q4_K | WeightFormat::Q5_K => {
                let (d, dmin) = (read_f16(block, 0), read_f16(block, 2));
                let (scales, mins) = k4_scales(&block[4..16]);
                let values = match format {
                    WeightFormat::Q5_K => k4_values(&block[48..176], Some(&block[16..48])),
                    _ => k4_values(&block[16..144], None),
                };
                for (i, (o, q)) in out.iter_mut().zip(values).enumerate() {
                    // llama.cpp's order: scale and minimum per sub-block first.
                    let (unit, min) = (d * scales[i / 32] as f32, dmin * mins[i / 32] as f32);
                    *o = unit * q as f32 - min;
                }
            }
            WeightFormat::Q6_K => {
                let d = read_f16(block, 208);
                for (i, (o, q)) in out.iter_mut().zip(q6_values(block)).enumerate() {
                    *o = d * (block[192 + i / 16] as i8) as f32 * q as f32;
                }
            }
            WeightFormat::Q2_K => {
                let (d, dmin) = (read_f16(block, 80), read_f16(block, 82));
                for (i, (o, q)) in out.iter_mut().zip(q2_values(block)).enumerate() {
                    // llama.cpp's order: scale and minimum per sub-block first.
                    let scale = block[i / 16];
                    let (unit, min) = (d * (scale & 0x0F) as f32, dmin * (scale >> 4) as f32);
                    *o = unit * q as f32 - min;
                }
            }
            WeightFormat::Q3_K => {
                let d = read_f16(block, 108);
                let scales = q3_scales(&block[96..108]);
                for (i, (o, q)) in out.iter_mut().zip(q3_values(block)).enumerate() {
                    *o = d * scales[i / 16] as f32 * (q as i32 - 4) as f32;
                }
            }
            _ => out.fill(f32::NAN),
        }
    }
}

/// A plain (not llama.cpp's error-searching) quantizer into a K-quant
/// format: scales from each sub-block's range. For tests and fixtures.
pub fn quantize_simple(format: WeightFormat, values: &[f32], out: &mut Vec<u8>) {
    for block in values.chunks_exact(QK_K) {
        match format {
            WeightFormat::Q4_K => quantize_k4(block, 15, out),
            WeightFormat::Q5_K => quantize_k4(block, 31, out),
            WeightFormat::Q6_K => quantize_q6(block, out),
            WeightFormat::Q2_K => quantize_q2(block, out),
            WeightFormat::Q3_K => quantize_q3(block, out),
            _ => {}
        }
    }
}

fn quantize_k4(block: &[f32], levels: u8, out: &mut Vec<u8>) {
    let ranges: Vec<(f32, f32)> = block
        .chunks_exact(32)
        .map(|sub| {
            let min = sub.iter().copied().fold(0.0f32, f32::min);
            let max = sub.iter().copied().fold(0.0f32, f32::max);
            ((max - min) / levels as f32, -min)
        })
        .collect();
    let d = ranges.iter().map(|r| r.0).fold(0.0, f32::max) / 63.0;
    let dmin = ranges.iter().map(|r| r.1).fold(0.0, f32::max) / 63.0;
    let (d, dmin) = (super::round_f16(d), super::round_f16(dmin));
    let step = |v: f32, unit: f32| if unit > 0.0 { v / unit } else { 0.0 };
    let scales: [u8; 8] =
        std::array::from_fn(|j| step(ranges[j].0, d).round().clamp(0.0, 63.0) as u8);
    let mins: [u8; 8] =
        std::array::from_fn(|j| step(ranges[j].1, dmin).round().clamp(0.0, 63.0) as u8);
    let q: [u8; QK_K] = std::array::from_fn(|i| {
        let j = i / 32;
        let unit = d * scales[j] as f32;
        step(block[i] + dmin * mins[j] as f32, unit)
            .round()
            .clamp(0.0, levels as f32) as u8
    });
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(dmin).to_le_bytes());
    out.extend(pack_k4_scales(&scales, &mins));
    if levels > 15 {
        // Fifth bits: bit `2c + half` of byte `l` for value `64c + 32half + l`.
        out.extend((0..32).map(|l| (0..8).fold(0u8, |h, s| h | (((q[32 * s + l] >> 4) & 1) << s))));
    }
    for chunk in 0..4 {
        out.extend(
            (0..32).map(|l| (q[64 * chunk + l] & 0x0F) | ((q[64 * chunk + 32 + l] & 0x0F) << 4)),
        );
    }
}

fn quantize_q2(block: &[f32], out: &mut Vec<u8>) {
    let ranges: Vec<(f32, f32)> = block
        .chunks_exact(16)
        .map(|sub| {
            let min = sub.iter().copied().fold(0.0f32, f32::min);
            let max = sub.iter().copied().fold(0.0f32, f32::max);
            ((max - min) / 3.0, -min)
        })
        .collect();
    let d = super::round_f16(ranges.iter().map(|r| r.0).fold(0.0, f32::max) / 15.0);
    let dmin = super::round_f16(ranges.iter().map(|r| r.1).fold(0.0, f32::max) / 15.0);
    let step = |v: f32, unit: f32| if unit > 0.0 { v / unit } else { 0.0 };
    let scales: [u8; 16] =
        std::array::from_fn(|s| step(ranges[s].0, d).round().clamp(0.0, 15.0) as u8);
    let mins: [u8; 16] =
        std::array::from_fn(|s| step(ranges[s].1, dmin).round().clamp(0.0, 15.0) as u8);
    let q: [u8; QK_K] = std::array::from_fn(|i| {
        let s = i / 16;
        let shifted = block[i] + dmin * mins[s] as f32;
        step(shifted, d * scales[s] as f32).round().clamp(0.0, 3.0) as u8
    });
    out.extend((0..16).map(|s| scales[s] | (mins[s] << 4)));
    out.extend(pack_low_pairs(&q));
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(dmin).to_le_bytes());
}

fn quantize_q3(block: &[f32], out: &mut Vec<u8>) {
    // Signed scales: the value of largest magnitude maps to -4, the end
    // of the range with the extra level.
    let group_scales: Vec<f32> = block
        .chunks_exact(16)
        .map(|g| {
            -g.iter()
                .copied()
                .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m })
                / 4.0
        })
        .collect();
    let d = super::round_f16(group_scales.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0);
    let scales: [i8; 16] = std::array::from_fn(|s| {
        let v = if d > 0.0 { group_scales[s] / d } else { 0.0 };
        v.round().clamp(-32.0, 31.0) as i8
    });
    // Values offset by 4 (0..8): two low bits packed, the third in hmask.
    let q: [u8; QK_K] = std::array::from_fn(|i| {
        let unit = d * scales[i / 16] as f32;
        let v = if unit != 0.0 { block[i] / unit } else { 0.0 };
        (v.round().clamp(-4.0, 3.0) as i32 + 4) as u8
    });
    let mut hmask = [0u8; 32];
    for (i, v) in q.iter().enumerate() {
        let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
        hmask[l] |= (v >> 2) << (4 * h + j);
    }
    out.extend(hmask);
    out.extend(pack_low_pairs(&q));
    out.extend(pack_q3_scales(&scales));
    out.extend(f16::from_f32(d).to_le_bytes());
}

fn quantize_q6(block: &[f32], out: &mut Vec<u8>) {
    let group_scales: Vec<f32> = block
        .chunks_exact(16)
        .map(|g| g.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0)
        .collect();
    let d = super::round_f16(group_scales.iter().copied().fold(0.0, f32::max) / 127.0);
    let scales: [i8; 16] = std::array::from_fn(|s| {
        let v = if d > 0.0 { group_scales[s] / d } else { 0.0 };
        v.round().clamp(-128.0, 127.0) as i8
    });
    let q: [u8; QK_K] = std::array::from_fn(|i| {
        let unit = d * scales[i / 16] as f32;
        let v = if unit != 0.0 { block[i] / unit } else { 0.0 };
        (v.round().clamp(-32.0, 31.0) as i32 + 32) as u8
    });
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (i, value) in q.iter().enumerate() {
        let (half, quarter, l) = (i / 128, (i / 32) % 4, i % 32);
        let at = 64 * half + 32 * (quarter % 2) + l;
        let nibble = value & 0x0F;
        ql[at] |= if quarter < 2 { nibble } else { nibble << 4 };
        qh[32 * half + l] |= (value >> 4) << (2 * quarter);
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(scales.iter().map(|s| *s as u8));
    out.extend(f16::from_f32(d).to_le_bytes());
}

/// Portable kernels: the reference the SIMD kernels equal bit for bit.
pub mod scalar {
    use super::*;

    /// One super-block's exact sums, combined with its two scales.
    #[inline(always)]
    fn combine(total: &mut f32, mins: &mut f32, d: f32, sum: i32, dmin: f32, min_sum: i32) {
        *total += d * sum as f32;
        *mins += dmin * min_sum as f32;
    }

    fn dot_k4(row: &[u8], x: &[BlockQ8K], fifth_bits: bool) -> f32 {
        let width = if fifth_bits { 176 } else { 144 };
        let (mut total, mut mins) = (0.0f32, 0.0f32);
        for (w, a) in row.chunks_exact(width).zip(x) {
            let (scales, min_scales) = k4_scales(&w[4..16]);
            let values = if fifth_bits {
                k4_values(&w[48..176], Some(&w[16..48]))
            } else {
                k4_values(&w[16..144], None)
            };
            let sum: i32 = (0..8)
                .map(|j| {
                    let part: i32 = (32 * j..32 * j + 32)
                        .map(|i| values[i] as i32 * a.qs[i] as i32)
                        .sum();
                    scales[j] as i32 * part
                })
                .sum();
            let (d, dmin) = (a.d * read_f16(w, 0), a.d * read_f16(w, 2));
            combine(
                &mut total,
                &mut mins,
                d,
                sum,
                dmin,
                mins_dot(&min_scales, &a.bsums),
            );
        }
        total - mins
    }

    pub fn dot_q4_k(row: &[u8], x: &[BlockQ8K]) -> f32 {
        dot_k4(row, x, false)
    }

    pub fn dot_q5_k(row: &[u8], x: &[BlockQ8K]) -> f32 {
        dot_k4(row, x, true)
    }

    pub fn dot_q2_k(row: &[u8], x: &[BlockQ8K]) -> f32 {
        let (mut total, mut mins) = (0.0f32, 0.0f32);
        for (w, a) in row.chunks_exact(84).zip(x) {
            let values = q2_values(w);
            let sum: i32 = (0..16)
                .map(|s| {
                    let part: i32 = (16 * s..16 * s + 16)
                        .map(|i| values[i] as i32 * a.qs[i] as i32)
                        .sum();
                    (w[s] & 0x0F) as i32 * part
                })
                .sum();
            let min_sum: i32 = (0..16)
                .map(|s| (w[s] >> 4) as i32 * a.bsums[s] as i32)
                .sum();
            let (d, dmin) = (a.d * read_f16(w, 80), a.d * read_f16(w, 82));
            combine(&mut total, &mut mins, d, sum, dmin, min_sum);
        }
        total - mins
    }

    pub fn dot_q3_k(row: &[u8], x: &[BlockQ8K]) -> f32 {
        let mut total = 0.0f32;
        for (w, a) in row.chunks_exact(110).zip(x) {
            let values = q3_values(w);
            let scales = q3_scales(&w[96..108]);
            let sum: i32 = (0..16)
                .map(|s| {
                    let part: i32 = (16 * s..16 * s + 16)
                        .map(|i| (values[i] as i32 - 4) * a.qs[i] as i32)
                        .sum();
                    scales[s] as i32 * part
                })
                .sum();
            total += (a.d * read_f16(w, 108)) * sum as f32;
        }
        total
    }

    pub fn dot_q6_k(row: &[u8], x: &[BlockQ8K]) -> f32 {
        let mut total = 0.0f32;
        for (w, a) in row.chunks_exact(210).zip(x) {
            let values = q6_values(w);
            let sum: i32 = (0..16)
                .map(|s| {
                    let part: i32 = (16 * s..16 * s + 16)
                        .map(|i| values[i] as i32 * a.qs[i] as i32)
                        .sum();
                    (w[192 + s] as i8) as i32 * part
                })
                .sum();
            total += (a.d * read_f16(w, 208)) * sum as f32;
        }
        total
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{k4_scales, mins_dot, BlockQ8K};

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
            let unpacked = super::q3_scales(std::slice::from_raw_parts(w.add(96), 12));
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
            let bit =
                _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(shift as i32)), one);
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
            for k in 0..N {
                let a = x[k].get_unchecked(i);
                total[k] += (a.d * dw) * hsum_i32(sums[k]) as f32;
                mins[k] += (a.d * dminw) * mins_dot(&min_scales, &a.bsums) as f32;
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
    pub(super) unsafe fn q6_quarters(
        bits_a: __m256i,
        bits_b: __m256i,
        qh: __m256i,
    ) -> [__m256i; 4] {
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
}
