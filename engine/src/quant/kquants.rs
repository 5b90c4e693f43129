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

use super::block::{read_f16, round_f16, BlockQ8K, WeightFormat, QK_K};
use super::kernels::{DotFn, Kernels};
use layout::*;

mod layout;

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
fn quantize_row_q8k_avx2(x: &[f32], out: &mut [BlockQ8K]) {
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
    let (d, dmin) = (round_f16(d), round_f16(dmin));
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
    let d = round_f16(ranges.iter().map(|r| r.0).fold(0.0, f32::max) / 15.0);
    let dmin = round_f16(ranges.iter().map(|r| r.1).fold(0.0, f32::max) / 15.0);
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
    let d = round_f16(group_scales.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0);
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
    let d = round_f16(group_scales.iter().copied().fold(0.0, f32::max) / 127.0);
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
pub(super) mod tiles;

#[cfg(target_arch = "x86_64")]
mod avx2;
