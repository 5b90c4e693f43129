//! Dot-product and (de)quantization kernels, chosen once per process by CPU
//! feature detection.

use half::f16;

use super::block::{read_f16, round_f16, BlockQ8, WeightFormat, BLOCK};

/// `dot(weight row bytes, quantized activation row)`.
pub type DotFn<B = BlockQ8> = fn(&[u8], &[B]) -> f32;

/// `dot` of consecutive weight rows (`out.len()` of them, from the first)
/// with four activation rows at once (prefill and batches): each weight
/// block is unpacked once for all four, and the loop over rows runs inside
/// the kernel, so a row costs no call of its own.
pub type Dot4Fn<B = BlockQ8> = fn(&[u8], [&[B]; 4], &mut [[f32; 4]]);

/// `out.len()` consecutive weight rows (`rows`, from the first) against one
/// activation row (decode), in one call: the loop over rows runs inside the
/// kernel, so each row costs no call and no bounds checks of its own.
pub type RowsFn<B = BlockQ8> = fn(&[u8], &[B], &mut [f32]);

/// [`Dot4Fn`] for eight activation rows (AVX-512: two tokens per register).
pub type Dot8Fn<B = BlockQ8> = fn(&[u8], [&[B]; 8], &mut [[f32; 8]]);

/// The kernels of one weight format on this CPU. Every kernel gives results
/// bit-identical to `dot`'s, so how tokens are grouped never changes one.
pub struct Kernels<B> {
    pub dot: DotFn<B>,
    pub dot4: Option<Dot4Fn<B>>,
    pub dot8: Option<Dot8Fn<B>>,
    pub rows: Option<RowsFn<B>>,
}

impl<B> Clone for Kernels<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Kernels<B> {}

/// Whether the AVX2 (+FMA, F16C) kernels run on this CPU.
#[cfg(target_arch = "x86_64")]
pub fn avx2_available() -> bool {
    avx2::available()
}

/// Whether the AVX-512 (F, BW, VL, VNNI) eight-token kernels run here.
#[cfg(target_arch = "x86_64")]
pub fn avx512_available() -> bool {
    avx512::available()
}

/// The fastest kernels for a 32-value `format` on this CPU.
pub fn select(format: WeightFormat) -> Kernels<BlockQ8> {
    #[cfg(target_arch = "x86_64")]
    if avx2::vnni_available() {
        return x86_kernels::<true>(format);
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        return x86_kernels::<false>(format);
    }
    #[cfg(target_arch = "aarch64")]
    {
        let dot: DotFn = match format {
            WeightFormat::Q4_0 => neon::dot_q4_0,
            WeightFormat::Q4_1 => neon::dot_q4_1,
            WeightFormat::Q8_0 => neon::dot_q8_0,
            _ => return scalar_kernels(format),
        };
        return Kernels {
            dot,
            dot4: None,
            dot8: None,
            rows: None,
        };
    }
    #[allow(unreachable_code)]
    scalar_kernels(format)
}

/// The AVX2 kernels (`VNNI`: with AVX-512 VNNI's byte dot products), for
/// tests to compare every path this CPU has.
#[cfg(target_arch = "x86_64")]
pub(super) fn x86_kernels<const VNNI: bool>(format: WeightFormat) -> Kernels<BlockQ8> {
    let (dot, dot4): (DotFn, Dot4Fn) = match format {
        WeightFormat::Q4_0 => (avx2::dot_q4_0::<VNNI>, avx2::dot4_q4_0::<VNNI>),
        WeightFormat::Q4_1 => (avx2::dot_q4_1::<VNNI>, avx2::dot4_q4_1::<VNNI>),
        WeightFormat::Q5_0 => (avx2::dot_q5_0::<VNNI>, avx2::dot4_q5_0::<VNNI>),
        WeightFormat::Q5_1 => (avx2::dot_q5_1::<VNNI>, avx2::dot4_q5_1::<VNNI>),
        WeightFormat::Q8_0 => (avx2::dot_q8_0::<VNNI>, avx2::dot4_q8_0::<VNNI>),
        _ => return scalar_kernels(format),
    };
    let rows = match format {
        WeightFormat::Q4_0 => Some(avx2::rows_q4_0::<VNNI> as RowsFn),
        WeightFormat::Q4_1 => Some(avx2::rows_q4_1::<VNNI> as RowsFn),
        WeightFormat::Q8_0 => Some(avx2::rows_q8_0::<VNNI> as RowsFn),
        _ => None,
    };
    // The AVX-512 kernels give the same bits as these (and exist only
    // where VNNI does): two tokens per register, for four tokens too.
    let wide = VNNI && avx512::available();
    let gfni = wide && avx512::gfni_available();
    let dot4 = match format {
        WeightFormat::Q4_0 if gfni => avx512::dot4_q4_0_gfni as Dot4Fn,
        WeightFormat::Q4_1 if gfni => avx512::dot4_q4_1_gfni,
        WeightFormat::Q4_0 if wide => avx512::dot4_q4_0,
        WeightFormat::Q5_0 if wide => avx512::dot4_q5_0,
        WeightFormat::Q8_0 if wide => avx512::dot4_q8_0,
        WeightFormat::Q4_1 if wide => avx512::dot4_q4_1,
        WeightFormat::Q5_1 if wide => avx512::dot4_q5_1,
        _ => dot4,
    };
    let dot8 = match format {
        WeightFormat::Q4_0 if gfni => Some(avx512::dot8_q4_0_gfni as Dot8Fn),
        WeightFormat::Q4_1 if gfni => Some(avx512::dot8_q4_1_gfni as Dot8Fn),
        WeightFormat::Q4_0 if VNNI && avx512::available() => Some(avx512::dot8_q4_0 as Dot8Fn),
        WeightFormat::Q5_0 if VNNI && avx512::available() => Some(avx512::dot8_q5_0 as Dot8Fn),
        WeightFormat::Q8_0 if VNNI && avx512::available() => Some(avx512::dot8_q8_0 as Dot8Fn),
        WeightFormat::Q4_1 if VNNI && avx512::available() => Some(avx512::dot8_q4_1 as Dot8Fn),
        WeightFormat::Q5_1 if VNNI && avx512::available() => Some(avx512::dot8_q5_1 as Dot8Fn),
        _ => None,
    };
    Kernels {
        dot,
        dot4: Some(dot4),
        dot8,
        rows,
    }
}

/// Which x86 kernel sets this CPU runs: AVX2, and AVX2 with VNNI.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) fn x86_paths() -> (bool, bool) {
    (avx2::available(), avx2::vnni_available())
}

pub(super) fn scalar_kernels(format: WeightFormat) -> Kernels<BlockQ8> {
    let dot: DotFn = match format {
        WeightFormat::Q4_0 => scalar::dot_q4_0,
        WeightFormat::Q4_1 => scalar::dot_q4_1,
        WeightFormat::Q5_0 => scalar::dot_q5_0,
        WeightFormat::Q5_1 => scalar::dot_q5_1,
        WeightFormat::Q8_0 => scalar::dot_q8_0,
        _ => unreachable_dot,
    };
    Kernels {
        dot,
        dot4: None,
        dot8: None,
        rows: None,
    }
}

/// Float formats and the K-quants take other activations ([`dot_float`],
/// [`super::kquants`]), never this path.
fn unreachable_dot(_: &[u8], _: &[BlockQ8]) -> f32 {
    f32::NAN
}

/// Dot product of an f32/f16 weight row with f32 activations.
pub fn dot_float(format: WeightFormat, row: &[u8], x: &[f32]) -> f32 {
    match format {
        WeightFormat::F32 => {
            dot_lanes::<4>(row, x, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        WeightFormat::F16 => dot_lanes::<2>(row, x, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => f32::NAN,
    }
}

/// Running sums kept side by side in [`FLOAT_LANES`] lanes.
const FLOAT_LANES: usize = 16;

/// `dot(row, x)` over weights of `SIZE` bytes each: sixteen running sums
/// side by side (one sum in a chain waits on each add: a 1024-wide MoE
/// router row took 4x longer), each a multiply then an add, never fused, so
/// every CPU and compiler gets the same bits; then the lanes pairwise and
/// the tail in order.
fn dot_lanes<const SIZE: usize>(row: &[u8], x: &[f32], weight: impl Fn(&[u8]) -> f32) -> f32 {
    let n = x.len().min(row.len() / SIZE);
    let (row, x) = (&row[..n * SIZE], &x[..n]);
    let mut lanes = [0.0f32; FLOAT_LANES];
    let mut w = [0.0f32; FLOAT_LANES];
    let chunks = row
        .chunks_exact(SIZE * FLOAT_LANES)
        .zip(x.chunks_exact(FLOAT_LANES));
    for (bytes, xs) in chunks {
        for (value, b) in w.iter_mut().zip(bytes.chunks_exact(SIZE)) {
            *value = weight(b);
        }
        for ((sum, w), v) in lanes.iter_mut().zip(&w).zip(xs) {
            *sum += w * v;
        }
    }
    let mut width = FLOAT_LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    let done = n / FLOAT_LANES * FLOAT_LANES;
    let tail = row[done * SIZE..].chunks_exact(SIZE).zip(&x[done..]);
    tail.fold(lanes[0], |sum, (b, v)| sum + weight(b) * v)
}

/// Rounds one activation row to 8-bit blocks (llama.cpp's AVX2 rounding:
/// `q = round_half_even(x * 127 / amax)`, scale `amax / 127` stored as f16).
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8], with_sum: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU supports the features the function is built for.
        unsafe { avx2::quantize_row_q8(x, out, with_sum) };
        return;
    }
    scalar::quantize_row_q8(x, out, with_sum)
}

/// Portable kernels: the reference for the SIMD ones, and the fallback.
pub mod scalar {
    use super::*;

    pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8], with_sum: bool) {
        for (values, block) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in block.qs.iter_mut().zip(values) {
                *q = (v * id).round_ties_even() as i8;
                sum += *q as i32;
            }
            block.d = round_f16(d);
            block.s = if with_sum {
                round_f16(d * sum as f32)
            } else {
                0.0
            };
        }
    }

    #[cfg(test)]
    pub fn dot(format: WeightFormat, row: &[u8], x: &[BlockQ8]) -> f32 {
        (super::scalar_kernels(format).dot)(row, x)
    }

    pub fn dot_q5_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut sum = 0.0f32;
        for (w, a) in row.chunks_exact(22).zip(x) {
            let acc: i32 = crate::quant::block::q5_values(w, 2)
                .iter()
                .zip(&a.qs)
                .map(|(q, v)| (*q as i32 - 16) * *v as i32)
                .sum();
            sum += acc as f32 * (read_f16(w, 0) * a.d);
        }
        sum
    }

    pub fn dot_q5_1(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut sum = 0.0f32;
        let mut mins = 0.0f32;
        for (w, a) in row.chunks_exact(24).zip(x) {
            let acc: i32 = crate::quant::block::q5_values(w, 4)
                .iter()
                .zip(&a.qs)
                .map(|(q, v)| *q as i32 * *v as i32)
                .sum();
            sum += acc as f32 * (read_f16(w, 0) * a.d);
            mins += read_f16(w, 2) * a.s;
        }
        sum + mins
    }

    pub fn dot_q4_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut sum = 0.0f32;
        for (w, a) in row.chunks_exact(18).zip(x) {
            let mut acc = 0i32;
            for j in 0..16 {
                let q = w[2 + j];
                acc += ((q & 0x0F) as i32 - 8) * a.qs[j] as i32;
                acc += ((q >> 4) as i32 - 8) * a.qs[j + 16] as i32;
            }
            sum += acc as f32 * (read_f16(w, 0) * a.d);
        }
        sum
    }

    pub fn dot_q4_1(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut sum = 0.0f32;
        let mut mins = 0.0f32;
        for (w, a) in row.chunks_exact(20).zip(x) {
            let mut acc = 0i32;
            for j in 0..16 {
                let q = w[4 + j];
                acc += (q & 0x0F) as i32 * a.qs[j] as i32;
                acc += (q >> 4) as i32 * a.qs[j + 16] as i32;
            }
            sum += acc as f32 * (read_f16(w, 0) * a.d);
            mins += read_f16(w, 2) * a.s;
        }
        sum + mins
    }

    pub fn dot_q8_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut sum = 0.0f32;
        for (w, a) in row.chunks_exact(34).zip(x) {
            let acc: i32 = w[2..]
                .iter()
                .zip(&a.qs)
                .map(|(q, v)| *q as i8 as i32 * *v as i32)
                .sum();
            sum += acc as f32 * (read_f16(w, 0) * a.d);
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "aarch64")]
mod neon {
    //! NEON kernels: `vdotq`-free (plain widening multiplies) so that every
    //! ARMv8 CPU runs them.
    use std::arch::aarch64::*;

    use super::{read_f16, BlockQ8};

    #[inline(always)]
    unsafe fn dot_block(w: int8x16_t, w_hi: int8x16_t, y: &BlockQ8) -> i32 {
        let y0 = vld1q_s8(y.qs.as_ptr());
        let y1 = vld1q_s8(y.qs.as_ptr().add(16));
        let p0 = vmull_s8(vget_low_s8(w), vget_low_s8(y0));
        let p1 = vmull_high_s8(w, y0);
        let p2 = vmull_s8(vget_low_s8(w_hi), vget_low_s8(y1));
        let p3 = vmull_high_s8(w_hi, y1);
        let s = vaddq_s32(
            vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)),
            vaddq_s32(vpaddlq_s16(p2), vpaddlq_s16(p3)),
        );
        vaddvq_s32(s)
    }

    pub fn dot_q4_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        assert!(row.len() >= x.len() * 18);
        let mut sum = 0.0f32;
        for (w, a) in row.chunks_exact(18).zip(x) {
            // SAFETY: NEON is baseline on aarch64; 16 bytes read from an 18-byte block.
            let acc = unsafe {
                let q = vld1q_u8(w.as_ptr().add(2));
                let lo = vsubq_s8(
                    vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))),
                    vdupq_n_s8(8),
                );
                let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), vdupq_n_s8(8));
                dot_block(lo, hi, a)
            };
            sum += acc as f32 * (read_f16(w, 0) * a.d);
        }
        sum
    }

    pub fn dot_q4_1(row: &[u8], x: &[BlockQ8]) -> f32 {
        assert!(row.len() >= x.len() * 20);
        let mut sum = 0.0f32;
        let mut mins = 0.0f32;
        for (w, a) in row.chunks_exact(20).zip(x) {
            // SAFETY: as above; nibbles are 0..15 so fit in i8.
            let acc = unsafe {
                let q = vld1q_u8(w.as_ptr().add(4));
                let lo = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F)));
                let hi = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
                dot_block(lo, hi, a)
            };
            sum += acc as f32 * (read_f16(w, 0) * a.d);
            mins += read_f16(w, 2) * a.s;
        }
        sum + mins
    }

    pub fn dot_q8_0(row: &[u8], x: &[BlockQ8]) -> f32 {
        assert!(row.len() >= x.len() * 34);
        let mut sum = 0.0f32;
        for (w, a) in row.chunks_exact(34).zip(x) {
            // SAFETY: 32 bytes read from a 34-byte block.
            let acc = unsafe {
                let lo = vld1q_s8(w.as_ptr().add(2) as *const i8);
                let hi = vld1q_s8(w.as_ptr().add(18) as *const i8);
                dot_block(lo, hi, a)
            };
            sum += acc as f32 * (read_f16(w, 0) * a.d);
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_dots_match_a_wide_sum_at_every_length() {
        for n in (0..40).chain([576, 1024, 1031]) {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let w: Vec<f32> = (0..n).map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0).collect();
            let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let f32_bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let f16_bytes: Vec<u8> = w
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect();
            let f16_exact: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| f16::from_f32(*a).to_f64() * *b as f64)
                .sum();
            let got = dot_float(WeightFormat::F32, &f32_bytes, &x) as f64;
            assert!(
                (got - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                "f32, n {n}: {got} vs {exact}"
            );
            let got = dot_float(WeightFormat::F16, &f16_bytes, &x) as f64;
            assert!(
                (got - f16_exact).abs() <= 1e-4 * (1.0 + f16_exact.abs()),
                "f16, n {n}: {got} vs {f16_exact}"
            );
        }
    }
}
