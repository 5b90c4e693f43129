//! Every native format's bytes to f32 and back (llama.cpp's reference
//! rounding): one entry for the 32-value formats and the K-quants alike.

use half::f16;

use super::block::{pack_q5, q5_values, read_f16, WeightFormat, BLOCK};
use super::kquants;

/// Dequantizes one row of any native format.
pub fn dequantize_row(format: WeightFormat, row: &[u8], out: &mut [f32]) {
    match format {
        WeightFormat::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightFormat::Q4_0 => {
            for (block, out) in row.chunks_exact(18).zip(out.chunks_exact_mut(BLOCK)) {
                let d = read_f16(block, 0);
                for j in 0..16 {
                    let q = block[2 + j];
                    out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
                    out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        WeightFormat::Q4_1 => {
            for (block, out) in row.chunks_exact(20).zip(out.chunks_exact_mut(BLOCK)) {
                let d = read_f16(block, 0);
                let m = read_f16(block, 2);
                for j in 0..16 {
                    let q = block[4 + j];
                    out[j] = (q & 0x0F) as f32 * d + m;
                    out[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        WeightFormat::Q5_0 => {
            for (block, out) in row.chunks_exact(22).zip(out.chunks_exact_mut(BLOCK)) {
                let d = read_f16(block, 0);
                for (o, q) in out.iter_mut().zip(q5_values(block, 2)) {
                    *o = (q as i32 - 16) as f32 * d;
                }
            }
        }
        WeightFormat::Q5_1 => {
            for (block, out) in row.chunks_exact(24).zip(out.chunks_exact_mut(BLOCK)) {
                let (d, m) = (read_f16(block, 0), read_f16(block, 2));
                for (o, q) in out.iter_mut().zip(q5_values(block, 4)) {
                    *o = q as f32 * d + m;
                }
            }
        }
        WeightFormat::Q8_0 => {
            for (block, out) in row.chunks_exact(34).zip(out.chunks_exact_mut(BLOCK)) {
                let d = read_f16(block, 0);
                for j in 0..BLOCK {
                    out[j] = block[2 + j] as i8 as f32 * d;
                }
            }
        }
        WeightFormat::Q4_K
        | WeightFormat::Q5_K
        | WeightFormat::Q6_K
        | WeightFormat::Q2_K
        | WeightFormat::Q3_K => kquants::dequantize_row(format, row, out),
    }
}

/// llama.cpp's reference quantizers (`quantize_row_*_ref`).
pub fn quantize_reference(format: WeightFormat, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(format.row_bytes(values.len()));
    match format {
        WeightFormat::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        WeightFormat::F16 => values
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        WeightFormat::Q4_0 => {
            for block in values.chunks_exact(BLOCK) {
                let max = block
                    .iter()
                    .copied()
                    .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let lo = ((block[j] * id + 8.5) as u8).min(15);
                    let hi = ((block[j + 16] * id + 8.5) as u8).min(15);
                    out.push(lo | (hi << 4));
                }
            }
        }
        WeightFormat::Q4_1 => {
            for block in values.chunks_exact(BLOCK) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let lo = (((block[j] - min) * id + 0.5) as u8).min(15);
                    let hi = (((block[j + 16] - min) * id + 0.5) as u8).min(15);
                    out.push(lo | (hi << 4));
                }
            }
        }
        WeightFormat::Q5_0 => {
            for block in values.chunks_exact(BLOCK) {
                let max = block
                    .iter()
                    .copied()
                    .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = std::array::from_fn(|j| ((block[j] * id + 16.5) as i8).min(31) as u8);
                pack_q5(&q, &mut out);
            }
        }
        WeightFormat::Q5_1 => {
            for block in values.chunks_exact(BLOCK) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 31.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = std::array::from_fn(|j| (((block[j] - min) * id + 0.5) as i8) as u8);
                pack_q5(&q, &mut out);
            }
        }
        WeightFormat::Q8_0 => {
            for block in values.chunks_exact(BLOCK) {
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        WeightFormat::Q4_K
        | WeightFormat::Q5_K
        | WeightFormat::Q6_K
        | WeightFormat::Q2_K
        | WeightFormat::Q3_K => kquants::quantize_simple(format, values, &mut out),
    }
    out
}
