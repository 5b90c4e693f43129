use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::quant::block::{round_f16, BlockQ8, BLOCK};

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

/// Consecutive Q4_0 rows against one activation row (decode), four at a
/// time as [`rows_q4_1`] does; each row's arithmetic is exactly
/// [`dot_q4_0`]'s.
pub fn rows_q4_0<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
    assert!(rows.len() >= out.len() * x.len() * 18);
    // SAFETY: `select` hands out `V` only where the CPU has it; bounds by the assert.
    unsafe {
        if V {
            rows_q4_0_vnni(rows, x, out)
        } else {
            rows_q4_0_avx2(rows, x, out)
        }
    }
}

two_isas!(rows_q4_0_avx2, rows_q4_0_vnni, rows_q4_0_body, (rows: &[u8], x: &[BlockQ8], out: &mut [f32]));

#[inline(always)]
unsafe fn rows_q4_0_body<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
    rows_signed_body::<V, false>(rows, x, out)
}

/// Q4_0 (or Q8_0 with `EIGHT_BITS`) rows four at a time: four independent
/// accumulator chains, one activation load for four rows, and the next
/// four rows prefetched block by block (the address may lie past the
/// matrix: a prefetch never faults). Each row's arithmetic is exactly its
/// `dot`'s.
#[inline(always)]
unsafe fn rows_signed_body<const V: bool, const EIGHT_BITS: bool>(
    rows: &[u8],
    x: &[BlockQ8],
    out: &mut [f32],
) {
    let block = if EIGHT_BITS { 34 } else { 18 };
    let width = x.len() * block;
    let mut quads = out.chunks_exact_mut(4);
    let mut w = rows.as_ptr();
    let eight = _mm256_set1_epi8(8);
    for quad in &mut quads {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, a) in x.iter().enumerate() {
            let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            for (k, acc) in acc.iter_mut().enumerate() {
                let wb = w.add(k * width + i * block);
                _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(4 * width) as *const i8);
                let d = _mm256_set1_ps(load_f16(wb) * a.d);
                let q = if EIGHT_BITS {
                    _mm256_loadu_si256(wb.add(2) as *const __m256i)
                } else {
                    _mm256_sub_epi8(nibbles(wb.add(2)), eight)
                };
                *acc = _mm256_fmadd_ps(d, mul_sum_i8::<V>(q, y), *acc);
            }
        }
        for (o, acc) in quad.iter_mut().zip(acc) {
            *o = hsum(acc);
        }
        w = w.add(4 * width);
    }
    for o in quads.into_remainder() {
        let row = std::slice::from_raw_parts(w, width);
        *o = if EIGHT_BITS {
            dot_q8_0_body::<V>(row, x)
        } else {
            dot_q4_0_body::<V>(row, x)
        };
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

/// Four rows at a time, as [`rows_q4_0_body`].
#[inline(always)]
unsafe fn rows_q8_0_body<const V: bool>(rows: &[u8], x: &[BlockQ8], out: &mut [f32]) {
    rows_signed_body::<V, true>(rows, x, out)
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

/// Bytes ahead of the block being read that [`prefetch_ahead`] asks for.
const PREFETCH_DISTANCE: usize = 3072;

/// The line `PREFETCH_DISTANCE` bytes after `block`: a decode step streams
/// each row once, block by block (and the next row lies just after), and
/// the hardware prefetchers alone keep too few loads in flight. A
/// prefetch never faults, past the end of the weights too.
#[inline(always)]
unsafe fn prefetch_ahead(block: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(PREFETCH_DISTANCE) as *const i8);
}

#[inline(always)]
unsafe fn dot_q4_0_body<const V: bool>(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let w = row.as_ptr();
    let eight = _mm256_set1_epi8(8);
    for (i, a) in x.iter().enumerate() {
        let wb = w.add(i * 18);
        prefetch_ahead(wb);
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
fn dotn_q5_0<const V: bool, const N: usize>(row: &[u8], x: [&[BlockQ8]; N], out: &mut [f32; N]) {
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
fn dotn_q5_1<const V: bool, const N: usize>(row: &[u8], x: [&[BlockQ8]; N], out: &mut [f32; N]) {
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
        prefetch_ahead(wb);
        let d = _mm256_set1_ps(load_f16(wb) * a.d);
        let q = _mm256_loadu_si256(wb.add(2) as *const __m256i);
        let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
        acc = _mm256_fmadd_ps(d, mul_sum_i8::<V>(q, y), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8], with_sum: bool) {
    let sign_bit = _mm256_set1_ps(-0.0);
    for (values, block) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let p = values.as_ptr();
        // SAFETY: a chunk holds BLOCK = 32 values: four loads of eight.
        let v = unsafe {
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
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
            // SAFETY: eight i32 lanes into eight i32s.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, total) };
            block.s = round_f16(d * lanes.iter().sum::<i32>() as f32);
        } else {
            block.s = 0.0;
        }
        // Pack 32 i32 → 32 i8 in order (packs interleave 128-bit lanes).
        let a = _mm256_packs_epi32(ints[0], ints[1]);
        let b = _mm256_packs_epi32(ints[2], ints[3]);
        let bytes = _mm256_packs_epi16(a, b);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: a block's 32 quants take the 32 bytes.
        unsafe { _mm256_storeu_si256(block.qs.as_mut_ptr() as *mut __m256i, bytes) };
        block.d = round_f16(d);
    }
}
