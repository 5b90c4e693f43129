//! Dot-product and (de)quantization kernels, chosen once per process by CPU
//! feature detection.

use half::f16;

use super::{round_f16, BlockQ8, WeightFormat, BLOCK};

#[inline]
pub(super) fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

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
        | WeightFormat::Q3_K => super::kquants::dequantize_row(format, row, out),
    }
}

/// The 32 unsigned 5-bit values of a Q5 block whose high bits start at
/// byte `at` (the nibbles follow them): element `j` takes bit `j`.
fn q5_values(block: &[u8], at: usize) -> [u8; BLOCK] {
    let high = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    let nibbles = &block[at + 4..at + 20];
    std::array::from_fn(|j| {
        let nibble = if j < 16 {
            nibbles[j] & 0x0F
        } else {
            nibbles[j - 16] >> 4
        };
        nibble | ((((high >> j) & 1) as u8) << 4)
    })
}

/// Packs 32 5-bit values into a Q5 block's high bits and nibbles.
fn pack_q5(values: &[u8; BLOCK], out: &mut Vec<u8>) {
    let high = (0..BLOCK).fold(0u32, |h, j| h | (((values[j] >> 4) as u32 & 1) << j));
    out.extend(high.to_le_bytes());
    out.extend((0..16).map(|j| (values[j] & 0x0F) | ((values[j + 16] & 0x0F) << 4)));
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
        | WeightFormat::Q3_K => super::kquants::quantize_simple(format, values, &mut out),
    }
    out
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
            let acc: i32 = super::q5_values(w, 2)
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
            let acc: i32 = super::q5_values(w, 4)
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
mod avx2 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use super::{round_f16, BlockQ8, BLOCK};

    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// Whether AVX-512 VNNI (with VL, for 256-bit `vpdpbusd`) runs here.
    pub fn vnni_available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            available()
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
        })
    }

    /// Every kernel body comes twice: plain AVX2, and with AVX-512 VNNI's
    /// `vpdpbusd` in place of `vpmaddubsw` + `vpmaddwd`. Both give the same
    /// integers in the same lanes (no sum here reaches `vpmaddubsw`'s i16
    /// saturation), so the results are the same bits.
    macro_rules! two_isas {
        ($avx2:ident, $vnni:ident, $body:ident $(<$($g:ident: $gt:ty),*>)?, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $avx2$(<$(const $g: $gt),*>)?($($arg: $ty),*) $(-> $ret)? {
                $body::<false $($(, $g)*)?>($($arg),*)
            }
            #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
            unsafe fn $vnni$(<$(const $g: $gt),*>)?($($arg: $ty),*) $(-> $ret)? {
                $body::<true $($(, $g)*)?>($($arg),*)
            }
        };
    }

    /// A four-token kernel over consecutive rows (a [`super::Dot4Fn`]) from
    /// the one-row body `$body`, for both ISAs.
    macro_rules! dot4_rows {
        ($public:ident, $avx2:ident, $vnni:ident, $body:ident $(<$g:tt>)?, $bytes:expr) => {
            pub fn $public<const V: bool>(rows: &[u8], x: [&[BlockQ8]; 4], out: &mut [[f32; 4]]) {
                let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
                assert!(rows.len() >= out.len() * n * $bytes);
                // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
                unsafe {
                    if V {
                        $vnni(rows, x, n, out)
                    } else {
                        $avx2(rows, x, n, out)
                    }
                }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $avx2(rows: &[u8], x: [&[BlockQ8]; 4], n: usize, out: &mut [[f32; 4]]) {
                for (r, o) in out.iter_mut().enumerate() {
                    $body::<false $(, $g)?>(rows.get_unchecked(r * n * $bytes..), x, n, o);
                }
            }

            #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
            unsafe fn $vnni(rows: &[u8], x: [&[BlockQ8]; 4], n: usize, out: &mut [[f32; 4]]) {
                for (r, o) in out.iter_mut().enumerate() {
                    $body::<true $(, $g)?>(rows.get_unchecked(r * n * $bytes..), x, n, o);
                }
            }
        };
    }

    #[inline(always)]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    pub(super) unsafe fn load_f16(p: *const u8) -> f32 {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// `dw * d` in every lane, `dw` already broadcast: the product of the
    /// two f32 scales, rounded once, as a scalar product would be, but with
    /// `d` broadcast from memory (a load) rather than from a register (a
    /// shuffle) per block and token.
    #[inline(always)]
    unsafe fn scale(dw: __m256, d: &f32) -> __m256 {
        _mm256_mul_ps(dw, _mm256_broadcast_ss(d))
    }

    /// 32 nibbles → 32 bytes: low nibbles first (values 0..16), then high.
    #[inline(always)]
    pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// Sum of products of unsigned `x` and signed `y` bytes, by 4, as 8
    /// floats (`VNNI`: in one instruction).
    #[inline(always)]
    unsafe fn mul_sum_us8<const VNNI: bool>(x: __m256i, y: __m256i) -> __m256 {
        if VNNI {
            return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), x, y));
        }
        let pairs = _mm256_maddubs_epi16(x, y);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// Sum of products of two signed byte vectors as 8 floats.
    #[inline(always)]
    unsafe fn mul_sum_i8<const VNNI: bool>(x: __m256i, y: __m256i) -> __m256 {
        mul_sum_us8::<VNNI>(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
    }

    pub fn dot_q4_1<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        assert!(row.len() >= x.len() * 20);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                dot_q4_1_vnni(row, x)
            } else {
                dot_q4_1_avx2(row, x)
            }
        }
    }

    two_isas!(dot_q4_1_avx2, dot_q4_1_vnni, dot_q4_1_body, (row: &[u8], x: &[BlockQ8]) -> f32);

    #[inline(always)]
    unsafe fn dot_q4_1_body<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0.0f32;
        let w = row.as_ptr();
        for (i, a) in x.iter().enumerate() {
            let wb = w.add(i * 20);
            let d = _mm256_set1_ps(load_f16(wb) * a.d);
            mins += load_f16(wb.add(2)) * a.s;
            let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_us8::<V>(nibbles(wb.add(4)), y), acc);
        }
        hsum(acc) + mins
    }

    // Q4_1 rows against four activation rows (prefill): the weights are
    // unpacked once per block for all four. Same arithmetic, in the same
    // order, as `dot_q4_1`, so batching never changes a result.
    dot4_rows!(
        dot4_q4_1,
        dot4_q4_1_avx2,
        dot4_q4_1_vnni,
        dot4_q4_1_body,
        20
    );

    #[inline(always)]
    unsafe fn dot4_q4_1_body<const V: bool>(
        row: &[u8],
        x: [&[BlockQ8]; 4],
        n: usize,
        out: &mut [f32; 4],
    ) {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins = [0.0f32; 4];
        let w = row.as_ptr();
        for i in 0..n {
            let wb = w.add(i * 20);
            let (dw, mw) = (load_f16(wb), load_f16(wb.add(2)));
            let q = nibbles(wb.add(4));
            for k in 0..4 {
                let a = x[k].get_unchecked(i);
                mins[k] += mw * a.s;
                let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), mul_sum_us8::<V>(q, y), acc[k]);
            }
        }
        for k in 0..4 {
            out[k] = hsum(acc[k]) + mins[k];
        }
    }

    /// Consecutive Q4_1 rows against one activation row (decode), four at
    /// a time: four independent accumulators keep the FMA units busy (the
    /// unpacking makes Q4_1 compute-bound here), and each row's arithmetic
    /// is exactly [`dot_q4_1`]'s.
    pub fn rows_q4_1<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
        assert!(rows.len() >= out.len() * x.len() * 20);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                rows_q4_1_vnni(rows, x, out)
            } else {
                rows_q4_1_avx2(rows, x, out)
            }
        }
    }

    two_isas!(rows_q4_1_avx2, rows_q4_1_vnni, rows_q4_1_body, (rows: &[u8], x: &[BlockQ8], out: &mut [f32]));

    #[inline(always)]
    unsafe fn rows_q4_1_body<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
        let width = x.len() * 20;
        let mut quads = out.chunks_exact_mut(4);
        let mut w = rows.as_ptr();
        for quad in &mut quads {
            let mut four = [0.0f32; 4];
            rows4_q4_1_body::<V>(w, width, x, &mut four);
            quad.copy_from_slice(&four);
            w = w.add(4 * width);
        }
        for o in quads.into_remainder() {
            *o = dot_q4_1_body::<V>(std::slice::from_raw_parts(w, width), x);
            w = w.add(width);
        }
    }

    /// Rows `w`, `w + width`, `w + 2 width`, `w + 3 width`.
    #[inline(always)]
    unsafe fn rows4_q4_1_body<const V: bool>(
        w: *const u8,
        width: usize,
        x: &[BlockQ8],
        out: &mut [f32; 4],
    ) {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins = [0.0f32; 4];
        // The next four rows (the next call's) lie just after these: asking
        // for them block by block keeps the loads ahead of four short
        // streams, which the hardware prefetcher picks up too late. The
        // address may lie past the matrix: a prefetch never faults.
        let ahead = 4 * width;
        for (i, a) in x.iter().enumerate() {
            let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            for k in 0..4 {
                let wb = w.add(k * width + i * 20);
                _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(ahead) as *const i8);
                mins[k] += load_f16(wb.add(2)) * a.s;
                let d = _mm256_set1_ps(load_f16(wb) * a.d);
                acc[k] = _mm256_fmadd_ps(d, mul_sum_us8::<V>(nibbles(wb.add(4)), y), acc[k]);
            }
        }
        for k in 0..4 {
            out[k] = hsum(acc[k]) + mins[k];
        }
    }

    /// Consecutive Q8_0 rows against one activation row (decode), one row
    /// after the other: the weights stream through in file order, one
    /// sequential read the hardware prefetcher follows (four rows side by
    /// side were four short streams, 10-20% slower on a 1024-column MoE
    /// expert), and each result is [`dot_q8_0`]'s bits.
    pub fn rows_q8_0<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
        assert!(rows.len() >= out.len() * x.len() * 34);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                rows_q8_0_vnni(rows, x, out)
            } else {
                rows_q8_0_avx2(rows, x, out)
            }
        }
    }

    two_isas!(rows_q8_0_avx2, rows_q8_0_vnni, rows_q8_0_body, (rows: &[u8], x: &[BlockQ8], out: &mut [f32]));

    #[inline(always)]
    unsafe fn rows_q8_0_body<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
        let width = x.len() * 34;
        for (r, o) in out.iter_mut().enumerate() {
            *o = dot_q8_0_body::<V>(rows.get_unchecked(r * width..(r + 1) * width), x);
        }
    }

    // Q4_0 against four activation rows; see `dot4_q4_1`.
    dot4_rows!(
        dot4_q4_0,
        dot4_q4_0_avx2,
        dot4_q4_0_vnni,
        dot4_q4_0_body,
        18
    );

    #[inline(always)]
    unsafe fn dot4_q4_0_body<const V: bool>(
        row: &[u8],
        x: [&[BlockQ8]; 4],
        n: usize,
        out: &mut [f32; 4],
    ) {
        let mut acc = [_mm256_setzero_ps(); 4];
        let w = row.as_ptr();
        let eight = _mm256_set1_epi8(8);
        for i in 0..n {
            let wb = w.add(i * 18);
            let dw = load_f16(wb);
            let q = _mm256_sub_epi8(nibbles(wb.add(2)), eight);
            let q_abs = _mm256_sign_epi8(q, q);
            for k in 0..4 {
                let a = x[k].get_unchecked(i);
                let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let prod = mul_sum_us8::<V>(q_abs, _mm256_sign_epi8(y, q));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), prod, acc[k]);
            }
        }
        for k in 0..4 {
            out[k] = hsum(acc[k]);
        }
    }

    pub fn dot_q4_0<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        assert!(row.len() >= x.len() * 18);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                dot_q4_0_vnni(row, x)
            } else {
                dot_q4_0_avx2(row, x)
            }
        }
    }

    two_isas!(dot_q4_0_avx2, dot_q4_0_vnni, dot_q4_0_body, (row: &[u8], x: &[BlockQ8]) -> f32);

    #[inline(always)]
    unsafe fn dot_q4_0_body<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let w = row.as_ptr();
        let eight = _mm256_set1_epi8(8);
        for (i, a) in x.iter().enumerate() {
            let wb = w.add(i * 18);
            let d = _mm256_set1_ps(load_f16(wb) * a.d);
            let q = _mm256_sub_epi8(nibbles(wb.add(2)), eight);
            let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_i8::<V>(q, y), acc);
        }
        hsum(acc)
    }

    // Q8_0 against four activation rows (a batch's LM head): each weight
    // block is loaded and its signs taken once for all four. Same
    // arithmetic, in the same order, as `dot_q8_0`.
    dot4_rows!(
        dot4_q8_0,
        dot4_q8_0_avx2,
        dot4_q8_0_vnni,
        dot4_q8_0_body,
        34
    );

    #[inline(always)]
    unsafe fn dot4_q8_0_body<const V: bool>(
        row: &[u8],
        x: [&[BlockQ8]; 4],
        n: usize,
        out: &mut [f32; 4],
    ) {
        let mut acc = [_mm256_setzero_ps(); 4];
        let w = row.as_ptr();
        for i in 0..n {
            let wb = w.add(i * 34);
            let dw = load_f16(wb);
            let q = _mm256_loadu_si256(wb.add(2) as *const __m256i);
            let q_abs = _mm256_sign_epi8(q, q);
            for k in 0..4 {
                let a = x[k].get_unchecked(i);
                let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let prod = mul_sum_us8::<V>(q_abs, _mm256_sign_epi8(y, q));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), prod, acc[k]);
            }
        }
        for k in 0..4 {
            out[k] = hsum(acc[k]);
        }
    }

    pub fn dot_q8_0<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        assert!(row.len() >= x.len() * 34);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                dot_q8_0_vnni(row, x)
            } else {
                dot_q8_0_avx2(row, x)
            }
        }
    }

    /// Byte `j` is 0xFF where bit `j` of the 32 bits at `p` is set.
    #[inline(always)]
    unsafe fn bytes_from_bits(p: *const u8) -> __m256i {
        let bits = std::ptr::read_unaligned(p as *const u32) as i32;
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits),
            _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            ),
        );
        let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1))
    }

    /// A Q5_0 block's 32 values as signed bytes (-16..16).
    #[inline(always)]
    pub(super) unsafe fn q5_0_values(wb: *const u8) -> __m256i {
        let high = _mm256_andnot_si256(bytes_from_bits(wb.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(nibbles(wb.add(6)), high)
    }

    /// A Q5_0 block's 32 values plus 16, as unsigned bytes (0..32).
    #[inline(always)]
    pub(super) unsafe fn q5_0_unsigned(wb: *const u8) -> __m256i {
        let high = _mm256_and_si256(bytes_from_bits(wb.add(2)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles(wb.add(6)), high)
    }

    /// A Q5_1 block's 32 values as unsigned bytes (0..32).
    #[inline(always)]
    pub(super) unsafe fn q5_1_values(wb: *const u8) -> __m256i {
        let high = _mm256_and_si256(bytes_from_bits(wb.add(4)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles(wb.add(8)), high)
    }

    pub fn dot_q5_0<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut out = [0.0];
        dotn_q5_0::<V, 1>(row, [x], &mut out);
        out[0]
    }

    dot4_rows!(
        dot4_q5_0,
        dot4_q5_0_avx2,
        dot4_q5_0_vnni,
        dotn_q5_0_body<4>,
        22
    );

    /// Q5_0 against `N` activation rows; one body for every `N`, so the
    /// four-row kernel gives the one-row kernel's bits.
    fn dotn_q5_0<const V: bool, const N: usize>(
        row: &[u8],
        x: [&[BlockQ8]; N],
        out: &mut [f32; N],
    ) {
        let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
        assert!(row.len() >= n * 22);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                dotn_q5_0_vnni(row, x, n, out)
            } else {
                dotn_q5_0_avx2(row, x, n, out)
            }
        }
    }

    two_isas!(dotn_q5_0_avx2, dotn_q5_0_vnni, dotn_q5_0_body<N: usize>, (row: &[u8], x: [&[BlockQ8]; N], n: usize, out: &mut [f32; N]));

    #[inline(always)]
    unsafe fn dotn_q5_0_body<const V: bool, const N: usize>(
        row: &[u8],
        x: [&[BlockQ8]; N],
        n: usize,
        out: &mut [f32; N],
    ) {
        let mut acc = [_mm256_setzero_ps(); N];
        let w = row.as_ptr();
        for i in 0..n {
            let wb = w.add(i * 22);
            let dw = _mm256_set1_ps(load_f16(wb));
            let q = q5_0_values(wb);
            let q_abs = _mm256_sign_epi8(q, q);
            for k in 0..N {
                let a = x[k].get_unchecked(i);
                let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let prod = mul_sum_us8::<V>(q_abs, _mm256_sign_epi8(y, q));
                acc[k] = _mm256_fmadd_ps(scale(dw, &a.d), prod, acc[k]);
            }
        }
        for k in 0..N {
            out[k] = hsum(acc[k]);
        }
    }

    pub fn dot_q5_1<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut out = [0.0];
        dotn_q5_1::<V, 1>(row, [x], &mut out);
        out[0]
    }

    dot4_rows!(
        dot4_q5_1,
        dot4_q5_1_avx2,
        dot4_q5_1_vnni,
        dotn_q5_1_body<4>,
        24
    );

    /// Q5_1 against `N` activation rows; see [`dotn_q5_0`].
    fn dotn_q5_1<const V: bool, const N: usize>(
        row: &[u8],
        x: [&[BlockQ8]; N],
        out: &mut [f32; N],
    ) {
        let n = x.iter().map(|r| r.len()).min().unwrap_or(0);
        assert!(row.len() >= n * 24);
        // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
        unsafe {
            if V {
                dotn_q5_1_vnni(row, x, n, out)
            } else {
                dotn_q5_1_avx2(row, x, n, out)
            }
        }
    }

    two_isas!(dotn_q5_1_avx2, dotn_q5_1_vnni, dotn_q5_1_body<N: usize>, (row: &[u8], x: [&[BlockQ8]; N], n: usize, out: &mut [f32; N]));

    #[inline(always)]
    unsafe fn dotn_q5_1_body<const V: bool, const N: usize>(
        row: &[u8],
        x: [&[BlockQ8]; N],
        n: usize,
        out: &mut [f32; N],
    ) {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut mins = [0.0f32; N];
        let w = row.as_ptr();
        for i in 0..n {
            let wb = w.add(i * 24);
            let (dw, mw) = (load_f16(wb), load_f16(wb.add(2)));
            let q = q5_1_values(wb);
            for k in 0..N {
                let a = x[k].get_unchecked(i);
                mins[k] += mw * a.s;
                let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), mul_sum_us8::<V>(q, y), acc[k]);
            }
        }
        for k in 0..N {
            out[k] = hsum(acc[k]) + mins[k];
        }
    }

    two_isas!(dot_q8_0_avx2, dot_q8_0_vnni, dot_q8_0_body, (row: &[u8], x: &[BlockQ8]) -> f32);

    #[inline(always)]
    unsafe fn dot_q8_0_body<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let w = row.as_ptr();
        for (i, a) in x.iter().enumerate() {
            let wb = w.add(i * 34);
            let d = _mm256_set1_ps(load_f16(wb) * a.d);
            let q = _mm256_loadu_si256(wb.add(2) as *const __m256i);
            let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            acc = _mm256_fmadd_ps(d, mul_sum_i8::<V>(q, y), acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8], with_sum: bool) {
        let sign_bit = _mm256_set1_ps(-0.0);
        for (values, block) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
            let p = values.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let mut max = _mm256_andnot_ps(sign_bit, v[0]);
            for item in &v[1..] {
                max = _mm256_max_ps(max, _mm256_andnot_ps(sign_bit, *item));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(max, 1), _mm256_castps256_ps128(max));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let mut ints = [_mm256_setzero_si256(); 4];
            for (int, value) in ints.iter_mut().zip(v) {
                let scaled = _mm256_round_ps(
                    _mm256_mul_ps(value, id),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                );
                *int = _mm256_cvtps_epi32(scaled);
            }
            if with_sum {
                let total = _mm256_add_epi32(
                    _mm256_add_epi32(ints[0], ints[1]),
                    _mm256_add_epi32(ints[2], ints[3]),
                );
                let mut lanes = [0i32; 8];
                _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, total);
                block.s = round_f16(d * lanes.iter().sum::<i32>() as f32);
            } else {
                block.s = 0.0;
            }
            // Pack 32 i32 → 32 i8 in order (packs interleave 128-bit lanes).
            let a = _mm256_packs_epi32(ints[0], ints[1]);
            let b = _mm256_packs_epi32(ints[2], ints[3]);
            let bytes = _mm256_packs_epi16(a, b);
            let bytes =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(block.qs.as_mut_ptr() as *mut __m256i, bytes);
            block.d = round_f16(d);
        }
    }
}

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
