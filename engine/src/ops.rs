//! The element-wise and reduction operations of a transformer layer, written
//! to round like llama.cpp (ggml) where that changes results: RMS norm sums
//! squares in f64, RoPE builds its angles by repeated multiplication in f32.

/// `out = x / rms(x) * weight`, row by row (`weight.len()` wide).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out_row) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let sum: f64 = row.iter().map(|v| (*v * *v) as f64).sum();
        let mean = (sum / width as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, v), w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = (v * scale) * w;
        }
    }
}

/// RMS norm in place, one `weight.len()`-wide group at a time (q/k norms).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    for row in x.chunks_exact_mut(width) {
        let sum: f64 = row.iter().map(|v| (*v * *v) as f64).sum();
        let mean = (sum / width as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = (*v * scale) * w;
        }
    }
}

/// Each row's sum of squares (`width` values a row), for an RMS norm whose
/// rows are split across ranks: the ranks add their sums, then
/// [`rms_norm_by_sums`] divides.
pub fn sums_of_squares(x: &[f32], width: usize, out: &mut [f32]) {
    for (row, sum) in x.chunks_exact(width).zip(out.iter_mut()) {
        *sum = row.iter().map(|v| (*v * *v) as f64).sum::<f64>() as f32;
    }
}

/// RMS norm in place of rows whose sums of squares over `total_width`
/// values (this slice and the other ranks') are `sums`.
pub fn rms_norm_by_sums(x: &mut [f32], weight: &[f32], sums: &[f32], total_width: usize, eps: f32) {
    for (row, sum) in x.chunks_exact_mut(weight.len()).zip(sums) {
        let scale = 1.0 / (sum / total_width as f32 + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = (*v * scale) * w;
        }
    }
}

/// `gate = gelu_tanh(gate) * up` (GeGLU, transformers' `gelu_pytorch_tanh`).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// `cap * tanh(x / cap)` in place (Gemma 2's soft caps).
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// `a += b`.
pub fn add_in_place(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// `e^x` as ggml's SIMD kernels compute it (a degree-5 polynomial after
/// range reduction by powers of two, ~1 ulp; the algorithm of ARM's
/// optimized-routines): SwiGLU and softmax use it, and matching its
/// rounding is what keeps our greedy tokens identical to llama.cpp's.
#[inline(always)]
pub fn exp_poly(x: f32) -> f32 {
    let c = |bits: u32| f32::from_bits(bits);
    let shift = c(0x4b40_0000); // 1.5 * 2^23: rounds to an integer
    let z = x.mul_add(c(0x3fb8_aa3b), shift); // x * log2(e) + shift
    let n = z - shift;
    // b = x - n * ln2 (in two parts, for precision)
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits().wrapping_shl(23);
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits())); // 2^n
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    // Outside the normal range: scale in two steps, or saturate.
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `gate = silu(gate) * up` (SwiGLU), in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if f16_simd::available() {
        // SAFETY: features checked at run time.
        unsafe { silu_mul_fma(gate, up) };
        return;
    }
    silu_mul_portable(gate, up)
}

#[inline(always)]
fn silu_mul_portable(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp_poly(-*g)) * u;
    }
}

/// [`silu_mul_portable`] eight values at a time, bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_fma(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len().min(up.len());
    let (sign, one) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(1.0));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: lanes i..i + 8 lie in both slices (i + 8 <= n); the
        // helper needs only the AVX2 and FMA this function has.
        unsafe {
            let p = gate.as_mut_ptr().add(i);
            let g = _mm256_loadu_ps(p);
            let e = exp_poly_x8(_mm256_xor_ps(g, sign));
            let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(p, _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(i))));
        }
        i += 8;
    }
    silu_mul_portable(&mut gate[i..n], &up[i..n])
}

/// The logistic function.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, as torch computes it (linear above 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Scales `x` to unit length: `x / sqrt(sum(x^2) + eps)` (the l2 norm of
/// Gated DeltaNet's q and k).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let scale = 1.0 / (sum + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= scale);
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF Llama files (their q/k rows are
    /// permuted by the converter to suit this).
    Interleaved,
    /// Halves (i, i + d/2): Hugging Face checkpoints, Qwen in any format.
    Halves,
}

/// The rotation angles of every pair for one position.
pub fn rope_angles(
    position: usize,
    rotary_dims: usize,
    theta_base: f32,
    freq_scale: f32,
    freq_factors: Option<&[f32]>,
    cos: &mut [f32],
    sin: &mut [f32],
) {
    let theta_scale = theta_base.powf(-2.0 / rotary_dims as f32);
    let mut theta = position as f32;
    for i in 0..rotary_dims / 2 {
        let factor = freq_factors.map_or(1.0, |f| f[i]);
        let angle = freq_scale * (theta / factor);
        cos[i] = angle.cos();
        sin[i] = angle.sin();
        theta *= theta_scale;
    }
}

/// Rotates each `head_dim`-wide head of `x` in place.
pub fn apply_rope(x: &mut [f32], head_dim: usize, style: RopeStyle, cos: &[f32], sin: &[f32]) {
    let pairs = cos.len();
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::Interleaved => {
                for i in 0..pairs {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
            RopeStyle::Halves => {
                let half = pairs;
                for i in 0..pairs {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// Dot product of two f32 slices, 8 lanes wide so the compiler vectorises it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            lanes[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// `out += scale * x`.
#[inline]
pub fn axpy(out: &mut [f32], scale: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += scale * v;
    }
}

/// Softmax in place, summed as ggml sums it (8-lane f32 partial sums per
/// block of 8, folded pairwise, accumulated in f64): attention weights then
/// round to f16 exactly as llama.cpp's do.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if f16_simd::available() {
        // SAFETY: features checked at run time.
        unsafe { softmax_fma(x) };
        return;
    }
    softmax_portable(x)
}

/// [`softmax_portable`] eight values at a time: [`exp_poly`] lane by lane
/// (every branch computed, the right one kept) and each block's fold in the
/// same order, so the bits are the portable function's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_fma(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max8 = _mm256_set1_ps(max);
    let mut sum = 0.0f64;
    let mut blocks = x.chunks_exact_mut(8);
    for block in &mut blocks {
        let p = block.as_mut_ptr();
        // SAFETY: a block holds exactly 8 values; the helper needs only
        // the AVX2 and FMA this function has.
        let e = unsafe {
            let e = exp_poly_x8(_mm256_sub_ps(_mm256_loadu_ps(p), max8));
            _mm256_storeu_ps(p, e);
            e
        };
        let s = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps::<1>(e));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        sum += _mm_cvtss_f32(s) as f64;
    }
    let tail = blocks.into_remainder();
    if !tail.is_empty() {
        let mut lanes = [0.0f32; 8];
        for (lane, v) in lanes.iter_mut().zip(tail.iter_mut()) {
            *v = exp_poly(*v - max);
            *lane = *v;
        }
        let folded = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
            + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        sum += folded as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// [`exp_poly`] of eight values, bit for bit.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_poly_x8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let shift = c(0x4b40_0000);
    let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), shift);
    let n = _mm256_sub_ps(z, shift);
    let minus_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0));
    let b = _mm256_fmadd_ps(
        minus_n,
        c(0x35bf_be8e),
        _mm256_fmadd_ps(minus_n, c(0x3f31_7200), x),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(
        e,
        _mm256_set1_epi32(1.0f32.to_bits() as i32),
    ));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm256_mul_ps(c(0x3f7f_fff6), b),
    );
    let normal = _mm256_fmadd_ps(j, k, k);
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let in_range = _mm256_cmp_ps::<_CMP_LE_OQ>(abs_n, _mm256_set1_ps(126.0));
    if _mm256_movemask_ps(in_range) == 0xFF {
        return normal;
    }
    // Outside the normal range: scale in two steps, or saturate.
    let non_positive = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps()));
    let g = _mm256_and_si256(non_positive, _mm256_set1_epi32(0x8200_0000u32 as i32));
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let saturated = _mm256_mul_ps(s1, s1);
    let scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
    let beyond = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    let outside = _mm256_blendv_ps(scaled, saturated, beyond);
    _mm256_blendv_ps(outside, normal, in_range)
}

#[inline(always)]
fn softmax_portable(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for chunk in x.chunks_mut(8) {
        let mut lanes = [0.0f32; 8];
        for (lane, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *v = exp_poly(*v - max);
            *lane = *v;
        }
        let folded = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
            + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        sum += folded as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_gives_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_styles_agree_up_to_a_permutation() {
        let head_dim = 8;
        let mut cos = [0.0; 4];
        let mut sin = [0.0; 4];
        rope_angles(7, head_dim, 10000.0, 1.0, None, &mut cos, &mut sin);
        let halves: Vec<f32> = (0..head_dim).map(|i| i as f32 * 0.3 - 1.0).collect();
        // Interleaved layout of the same vector: (h[i], h[i + d/2]) adjacent.
        let mut interleaved: Vec<f32> = (0..head_dim)
            .map(|j| halves[(j / 2) + (j % 2) * head_dim / 2])
            .collect();
        let mut rotated = halves.clone();
        apply_rope(&mut rotated, head_dim, RopeStyle::Halves, &cos, &sin);
        apply_rope(
            &mut interleaved,
            head_dim,
            RopeStyle::Interleaved,
            &cos,
            &sin,
        );
        for j in 0..head_dim {
            let want = rotated[(j / 2) + (j % 2) * head_dim / 2];
            assert!((interleaved[j] - want).abs() < 1e-6);
        }
    }

    #[test]
    fn exp_poly_is_accurate_everywhere() {
        for i in -2000..2000 {
            let x = i as f32 * 0.05;
            let (got, want) = (exp_poly(x), (x as f64).exp());
            if want < f32::MIN_POSITIVE as f64 {
                assert!(got < 1e-37, "{x}: {got}");
            } else if want > f32::MAX as f64 {
                assert!(got.is_infinite(), "{x}: {got}");
            } else {
                assert!(
                    ((got as f64 - want) / want).abs() < 3e-7,
                    "{x}: {got} vs {want}"
                );
            }
        }
        assert_eq!(exp_poly(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn softmax_is_the_portable_bits_on_every_path() {
        for len in [1, 7, 8, 9, 64, 131] {
            let x: Vec<f32> = (0..len)
                .map(|i| match i % 11 {
                    0 => f32::NEG_INFINITY,
                    1 => -150.0 - i as f32,
                    2 => -95.0 + 0.3 * i as f32,
                    _ => (i as f32 * 0.731).sin() * 8.0,
                })
                .collect();
            let (mut fast, mut portable) = (x.clone(), x.clone());
            softmax(&mut fast);
            softmax_portable(&mut portable);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&portable), "{len} values");
        }
    }

    #[test]
    fn swiglu_is_the_portable_bits_on_every_path() {
        for len in [3, 8, 67] {
            let gate: Vec<f32> = (0..len)
                .map(|i| match i % 7 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => -120.0 + i as f32,
                    3 => 95.0,
                    _ => (i as f32 * 0.731).sin() * 6.0,
                })
                .collect();
            let up: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).cos()).collect();
            let (mut fast, mut portable) = (gate.clone(), gate);
            silu_mul(&mut fast, &up);
            silu_mul_portable(&mut portable, &up);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&portable), "{len} values");
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0, -1e30];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }
}

/// Rounds through f16 (llama.cpp keeps the KV cache, and converts queries
/// and attention weights, in f16: rounding the same way keeps our tokens
/// with its tokens).
#[inline]
pub fn round_to_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// `dst[i] = round_to_f16(src[i])`.
pub fn round_to_f16_slice(dst: &mut [f32], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if f16_simd::available() {
        // SAFETY: features checked at run time.
        unsafe { f16_simd::round_slice(dst, src) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = round_to_f16(*s);
    }
}

/// `x[i] = round_to_f16(x[i])`.
pub fn round_to_f16_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if f16_simd::available() {
        // SAFETY: features checked at run time.
        unsafe { f16_simd::round_in_place(x) };
        return;
    }
    for v in x {
        *v = round_to_f16(*v);
    }
}

/// Whether the AVX2 + FMA + F16C kernels of [`f16_simd`] run on this CPU.
#[cfg(target_arch = "x86_64")]
pub fn f16_simd_available() -> bool {
    f16_simd::available()
}

/// `dot(a, b)` with `b` in f16.
#[inline]
pub fn dot_f16(a: &[f32], b: &[half::f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if f16_simd::available() {
        // SAFETY: features checked at run time.
        return unsafe { f16_simd::dot(a, b) };
    }
    a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
}

/// `out += scale * x` with `x` in f16.
#[inline]
pub fn axpy_f16(out: &mut [f32], scale: f32, x: &[half::f16]) {
    #[cfg(target_arch = "x86_64")]
    if f16_simd::available() {
        // SAFETY: features checked at run time.
        unsafe { f16_simd::axpy(out, scale, x) };
        return;
    }
    for (o, v) in out.iter_mut().zip(x) {
        *o += scale * v.to_f32();
    }
}

/// AVX2 kernels over f16 data. The `_many` kernels are `#[inline(always)]`
/// without features of their own: they are for callers compiled with AVX2,
/// FMA and F16C, into which they inline.
#[cfg(target_arch = "x86_64")]
pub(crate) mod f16_simd {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// The sum of the eight lanes, in one fixed order.
    #[inline(always)]
    unsafe fn hsum(acc: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(acc);
        let hi = _mm256_extractf128_ps(acc, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    unsafe fn load_f16x8(p: *const half::f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[inline(always)]
    unsafe fn round8(x: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dot(a: &[f32], b: &[half::f16]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes i..i + 8 lie in both slices (i + 8 <= n).
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    load_f16x8(b.as_ptr().add(i)),
                )
            };
            acc = _mm256_fmadd_ps(x, y, acc);
            i += 8;
        }
        // SAFETY: the helper needs only the features this function has.
        let mut sum = unsafe { hsum(acc) };
        while i < n {
            sum += a[i] * b[i].to_f32();
            i += 1;
        }
        sum
    }

    /// `out[g] = dot(queries[g * n..(g + 1) * n], key)` for `G` rows, with
    /// `n = key.len()`: each [`dot`]'s bits, the key converted once.
    #[inline(always)]
    pub unsafe fn dot_many<const G: usize>(queries: &[f32], key: &[half::f16], out: &mut [f32; G]) {
        let n = key.len();
        assert!(queries.len() >= G * n);
        let q = queries.as_ptr();
        let mut acc = [_mm256_setzero_ps(); G];
        let mut i = 0;
        while i + 8 <= n {
            let y = load_f16x8(key.as_ptr().add(i));
            for (g, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(g * n + i)), y, *acc);
            }
            i += 8;
        }
        for (g, out) in out.iter_mut().enumerate() {
            let mut sum = hsum(acc[g]);
            for j in i..n {
                sum += queries[g * n + j] * key[j].to_f32();
            }
            *out = sum;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn axpy(out: &mut [f32], scale: f32, x: &[half::f16]) {
        let n = out.len().min(x.len());
        let s = _mm256_set1_ps(scale);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes i..i + 8 lie in both slices (i + 8 <= n).
            unsafe {
                let o = _mm256_loadu_ps(out.as_ptr().add(i));
                let v = load_f16x8(x.as_ptr().add(i));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_fmadd_ps(s, v, o));
            }
            i += 8;
        }
        while i < n {
            out[i] += scale * x[i].to_f32();
            i += 1;
        }
    }

    /// `rows[(g * 8 + lane) * n..][..n] += weights[g] * value` for `G`
    /// groups of eight rows, with `n = value.len()`: each [`axpy`]'s bits,
    /// the value converted once.
    #[inline(always)]
    pub unsafe fn axpy_many<const G: usize>(
        rows: &mut [f32],
        lane: usize,
        weights: &[f32; G],
        value: &[half::f16],
    ) {
        let n = value.len();
        assert!(lane < 8 && rows.len() >= G * 8 * n);
        let s: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(weights[g]));
        let base = rows.as_mut_ptr();
        let mut i = 0;
        while i + 8 <= n {
            let v = load_f16x8(value.as_ptr().add(i));
            for (g, s) in s.iter().enumerate() {
                let p = base.add((g * 8 + lane) * n + i);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(*s, v, _mm256_loadu_ps(p)));
            }
            i += 8;
        }
        while i < n {
            for (g, weight) in weights.iter().enumerate() {
                rows[(g * 8 + lane) * n + i] += weight * value[i].to_f32();
            }
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn round_slice(dst: &mut [f32], src: &[f32]) {
        let n = dst.len().min(src.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes i..i + 8 lie in both slices (i + 8 <= n).
            unsafe {
                let x = _mm256_loadu_ps(src.as_ptr().add(i));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), round8(x));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = super::round_to_f16(src[j]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn round_in_place(x: &mut [f32]) {
        let n = x.len();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: lanes i..i + 8 lie in the slice (i + 8 <= n).
            unsafe {
                let p = x.as_mut_ptr().add(i);
                _mm256_storeu_ps(p, round8(_mm256_loadu_ps(p)));
            }
            i += 8;
        }
        for v in &mut x[i..] {
            *v = super::round_to_f16(*v);
        }
    }
}

#[cfg(test)]
mod f16_tests {
    use super::*;

    /// The shared-conversion kernels give each single kernel's bits, at
    /// head sizes with and without a tail past the last 8 lanes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn many_head_kernels_are_each_heads_single_kernel_bit_for_bit() {
        if !f16_simd::available() {
            tessera_testkit::not_run_here(
                "ops::many_head_kernels_are_each_heads_single_kernel_bit_for_bit",
                "the AVX2+FMA+F16C kernels (this CPU lacks them)",
            );
            return;
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn many<const G: usize>(
            q: &[f32],
            k: &[half::f16],
            rows: &mut [f32],
            w: &[f32; G],
        ) -> [f32; G] {
            let mut dots = [0.0; G];
            f16_simd::dot_many::<G>(q, k, &mut dots);
            f16_simd::axpy_many::<G>(rows, 5, w, k);
            dots
        }
        for n in [64, 67, 8, 3] {
            let q: Vec<f32> = (0..3 * n).map(|i| (i as f32 * 0.37).sin()).collect();
            let k: Vec<half::f16> = (0..n)
                .map(|i| half::f16::from_f32((i as f32 * 0.11).cos()))
                .collect();
            let w = [0.25f32, -1.5, 0.7];
            let mut rows: Vec<f32> = (0..3 * 8 * n).map(|i| (i as f32 * 0.05).cos()).collect();
            let mut want = rows.clone();
            // SAFETY: features checked above.
            let dots = unsafe { many::<3>(&q, &k, &mut rows, &w) };
            for g in 0..3 {
                assert_eq!(
                    dots[g].to_bits(),
                    dot_f16(&q[g * n..(g + 1) * n], &k).to_bits()
                );
                let at = (g * 8 + 5) * n;
                axpy_f16(&mut want[at..at + n], w[g], &k);
            }
            assert_eq!(
                rows.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn slice_rounding_is_round_to_f16() {
        let x: Vec<f32> = (0..37)
            .map(|i| (i as f32 * 0.731).sin() * 10f32.powi(i % 9 - 6))
            .collect();
        let mut slice = vec![0.0; x.len()];
        round_to_f16_slice(&mut slice, &x);
        let mut in_place = x.clone();
        round_to_f16_in_place(&mut in_place);
        for ((a, b), v) in slice.iter().zip(&in_place).zip(&x) {
            assert_eq!(a.to_bits(), round_to_f16(*v).to_bits());
            assert_eq!(b.to_bits(), round_to_f16(*v).to_bits());
        }
    }

    #[test]
    fn f16_kernels_match_scalar() {
        let a: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<half::f16> = (0..67)
            .map(|i| half::f16::from_f32((i as f32 * 0.11).cos()))
            .collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y.to_f32()).sum();
        assert!((dot_f16(&a, &b) - want).abs() < 1e-4);
        let mut out = a.clone();
        axpy_f16(&mut out, 0.5, &b);
        for ((o, x), y) in out.iter().zip(&a).zip(&b) {
            assert!((o - (x + 0.5 * y.to_f32())).abs() < 1e-6);
        }
    }
}
