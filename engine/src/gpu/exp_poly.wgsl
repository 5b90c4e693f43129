// e^x as the CPU engine (ops::exp_poly) and ggml's SIMD kernels compute
// it: a degree-5 polynomial after range reduction by powers of two, with
// the same constants and fused multiply-adds, so softmax and SwiGLU round
// as they do on the CPU rather than as each adapter's own exp does.
fn exp_poly(x: f32) -> f32 {
    // n = x log2(e) rounded half to even, as the CPU's 1.5 * 2^23 shift
    // rounds it (a shader compiler may fold that shift away).
    let n = round(x * bitcast<f32>(0x3fb8aa3bu));
    let b = fma(-n, bitcast<f32>(0x35bfbe8eu), fma(-n, bitcast<f32>(0x3f317200u), x));
    let e = bitcast<u32>(i32(clamp(n, -256.0, 256.0))) << 23u;
    let k = bitcast<f32>(e + bitcast<u32>(1.0));
    let u = b * b;
    let j = fma(
        fma(fma(bitcast<f32>(0x3c072010u), b, bitcast<f32>(0x3d2b9f17u)), u,
            fma(bitcast<f32>(0x3e2aaf33u), b, bitcast<f32>(0x3efffedbu))),
        u,
        bitcast<f32>(0x3f7ffff6u) * b);
    if (abs(n) <= 126.0) {
        return fma(j, k, k);
    }
    // Outside the normal range: scale in two steps, or saturate.
    let g = select(0u, 0x82000000u, n <= 0.0);
    let s1 = bitcast<f32>(g + 0x7f000000u);
    let s2 = bitcast<f32>(e - g);
    if (abs(n) > 192.0) {
        return s1 * s1;
    }
    return fma(s2, j, s2) * s1;
}
