//! AVX-512 K-quant kernels over token tiles, for prefills and large
//! batches. A 512-bit register holds four activation bytes of each of 16
//! tokens; each four weight bytes are unpacked once, broadcast to all 16
//! lanes and multiplied with them, and every lane keeps one token's sum,
//! so no sum crosses lanes and no register is shuffled. A tile is 16 or 32
//! tokens (one or two registers per group of four values), or 8 or 4
//! tokens with eight or sixteen values each per register (each eight or
//! sixteen weight bytes broadcast, each token's two or four lanes added at
//! the end of a super-block), laid out once per call ([`TokenTile`]); the
//! weights stay in the file's layout. Tiles of 4 and 8 serve decode steps
//! of a few sequences and speculative verify steps, which read the weights
//! once for all their tokens.
//!
//! Within a super-block every sum is an exact integer, whichever
//! instructions form it (`vpdpbusd`, or `vpmaddubsw` with no sum near its
//! i16 saturation); the f32 products and running sums per super-block are
//! the single-token kernel's, in the same order, so each token's result is
//! the format's `dot` bit for bit.

// Loops over rows and registers index several arrays of registers at once.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx2::{load_f16, prefetch_ahead};
use super::layout::k4_scales;
use crate::quant::block::{BlockQ8K, WeightFormat};

/// Tokens in one register of a tile.
pub const LANES: usize = 16;
/// The tile sizes, in tokens.
pub const SIZES: [usize; 4] = [LANES / 4, LANES / 2, LANES, 2 * LANES];
/// Groups of four values in a super-block.
const GROUPS: usize = 64;

/// One register's worth of lanes, aligned for whole-line loads.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Lanes([u32; LANES]);

impl Lanes {
    #[inline(always)]
    unsafe fn load(&self) -> __m512i {
        _mm512_load_si512(self.0.as_ptr() as *const __m512i)
    }

    #[inline(always)]
    unsafe fn load_ps(&self) -> __m512 {
        _mm512_load_ps(self.0.as_ptr() as *const f32)
    }
}

/// 4, 8, 16 or 32 tokens' Q8_K activations, laid out for the tile
/// kernels. Each super-block's items (its 64 groups of four values; its
/// four pairs of sums by 32 and eight pairs of sums by 16, as i16 pairs;
/// its scale) sit at [`TokenTile::slot`]: with 16 or 32 tokens, one lane
/// per token in `tokens / 16` registers per item; with 8 or 4, `G = 16 /
/// tokens` consecutive items per register, token `t` in lanes `G t` to
/// `G t + G - 1`.
#[derive(Default)]
pub struct TokenTile {
    tokens: usize,
    blocks: usize,
    /// Four values of a group per lane.
    qs: Vec<Lanes>,
    /// Sub-blocks `2p` and `2p + 1` of 32 values summed, for pair `p`.
    sums_by_32: Vec<Lanes>,
    /// Sums by 16 `2p` and `2p + 1`, for pair `p`.
    sums_by_16: Vec<Lanes>,
    /// The scales as f32 bits, one register per super-block and 16 tokens.
    d: Vec<Lanes>,
}

/// Two i16 in one lane, `low` in its low half.
fn pair(low: i16, high: i16) -> u32 {
    u32::from(low as u16) | (u32::from(high as u16) << 16)
}

impl TokenTile {
    /// The tokens this tile holds: 4, 8, 16 or 32.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Where item `item` (of `items` per super-block) of super-block `i`
    /// of token `t` goes: (register, lane).
    fn slot(&self, items: usize, i: usize, item: usize, t: usize) -> (usize, usize) {
        if self.tokens < LANES {
            let g = LANES / self.tokens;
            (i * items / g + item / g, g * t + item % g)
        } else {
            let registers = self.tokens / LANES;
            ((i * items + item) * registers + t / LANES, t % LANES)
        }
    }

    /// Lays out the first `blocks` super-blocks of `rows`, 4, 8, 16 or 32
    /// tokens.
    pub fn fill(&mut self, rows: &[&[BlockQ8K]], blocks: usize) {
        assert!(SIZES.contains(&rows.len()));
        assert!(rows.iter().all(|row| row.len() >= blocks));
        self.tokens = rows.len();
        self.blocks = blocks;
        // Registers per item of a super-block: tokens / 16 (a fraction
        // below 16).
        let per_items = |items: usize| blocks * items * self.tokens / LANES;
        self.qs.resize(per_items(GROUPS), Lanes::default());
        self.sums_by_32.resize(per_items(4), Lanes::default());
        self.sums_by_16.resize(per_items(8), Lanes::default());
        let registers = self.tokens.div_ceil(LANES);
        self.d.resize(blocks * registers, Lanes::default());
        for (t, row) in rows.iter().enumerate() {
            for (i, block) in row[..blocks].iter().enumerate() {
                for (g, four) in block.qs.chunks_exact(4).enumerate() {
                    let bytes = [four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8];
                    let (at, lane) = self.slot(GROUPS, i, g, t);
                    self.qs[at].0[lane] = u32::from_le_bytes(bytes);
                }
                let sums = &block.bsums;
                for p in 0..4 {
                    let low = sums[4 * p].wrapping_add(sums[4 * p + 1]);
                    let high = sums[4 * p + 2].wrapping_add(sums[4 * p + 3]);
                    let (at, lane) = self.slot(4, i, p, t);
                    self.sums_by_32[at].0[lane] = pair(low, high);
                }
                for p in 0..8 {
                    let (at, lane) = self.slot(8, i, p, t);
                    self.sums_by_16[at].0[lane] = pair(sums[2 * p], sums[2 * p + 1]);
                }
                self.d[i * registers + t / LANES].0[t % LANES] = block.d.to_bits();
            }
        }
    }
}

/// Consecutive weight rows (as many as `out` has room for) against a
/// tile: `out[r * tile.tokens() + t]`, each the format's `dot` bit for bit.
pub type TileFn = fn(&[u8], &TokenTile, &mut [f32]);

/// Whether the tile kernels run here (AVX-512 F and BW).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        crate::quant::kernels::avx2_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
    })
}

/// Whether their `vpdpbusd` variants run here (AVX-512 VNNI).
pub fn vnni_available() -> bool {
    available() && is_x86_feature_detected!("avx512vnni")
}

/// The fastest tile kernel of `format` on this CPU, if it has one.
pub fn select(format: WeightFormat) -> Option<TileFn> {
    if !available() {
        return None;
    }
    variant(format, vnni_available())
}

/// The tile kernel of `format` with (`vnni`) or without `vpdpbusd`: for
/// tests to check both where the CPU has both.
pub fn variant(format: WeightFormat, vnni: bool) -> Option<TileFn> {
    match (format, vnni) {
        (WeightFormat::Q4_K, false) => Some(q4_k::<false>),
        (WeightFormat::Q4_K, true) => Some(q4_k::<true>),
        (WeightFormat::Q6_K, false) => Some(q6_k::<false>),
        (WeightFormat::Q6_K, true) => Some(q6_k::<true>),
        _ => None,
    }
}

/// The rows `out` has room for, after checking that `rows` holds them.
fn row_count(rows: &[u8], tile: &TokenTile, out: &[f32], width: usize) -> usize {
    let tokens = tile.tokens();
    assert!(tokens > 0 && out.len().is_multiple_of(tokens));
    let count = out.len() / tokens;
    assert!(rows.len() >= count * tile.blocks * width);
    count
}

/// One entry point per format and ISA: checks the CPU and the sizes, then
/// runs `$body::<VNNI, Z, G, R>` over the rows under the ISA's features:
/// `Z` registers per item, `G` groups of four values per token and
/// register (2 for 8 tokens, 4 for 4), rows two at a time (`R`).
macro_rules! tile_kernel {
    ($public:ident, $plain:ident, $vnni:ident, $rows:ident, $body:ident, $width:expr) => {
        fn $public<const VNNI: bool>(rows: &[u8], tile: &TokenTile, out: &mut [f32]) {
            assert!(available() && (!VNNI || vnni_available()));
            let count = row_count(rows, tile, out, $width);
            let (rows, out) = (rows.as_ptr(), out.as_mut_ptr());
            // SAFETY: features checked just above; bounds by `row_count`.
            unsafe {
                match (VNNI, tile.tokens) {
                    (false, 4) => $plain::<1, 4>(rows, tile, count, out),
                    (false, 8) => $plain::<1, 2>(rows, tile, count, out),
                    (false, 16) => $plain::<1, 1>(rows, tile, count, out),
                    (false, _) => $plain::<2, 1>(rows, tile, count, out),
                    (true, 4) => $vnni::<1, 4>(rows, tile, count, out),
                    (true, 8) => $vnni::<1, 2>(rows, tile, count, out),
                    (true, 16) => $vnni::<1, 1>(rows, tile, count, out),
                    (true, _) => $vnni::<2, 1>(rows, tile, count, out),
                }
            }
        }

        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
        unsafe fn $plain<const Z: usize, const G: usize>(
            rows: *const u8,
            tile: &TokenTile,
            n: usize,
            out: *mut f32,
        ) {
            $rows::<false, Z, G>(rows, tile, n, out)
        }

        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
        unsafe fn $vnni<const Z: usize, const G: usize>(
            rows: *const u8,
            tile: &TokenTile,
            n: usize,
            out: *mut f32,
        ) {
            $rows::<true, Z, G>(rows, tile, n, out)
        }

        /// `n` rows, two at a time, the last alone if `n` is odd.
        #[inline(always)]
        unsafe fn $rows<const VNNI: bool, const Z: usize, const G: usize>(
            rows: *const u8,
            tile: &TokenTile,
            n: usize,
            out: *mut f32,
        ) {
            let at = |r: usize| (rows.add(r * tile.blocks * $width), out.add(r * tile.tokens));
            let mut r = 0;
            while r + 2 <= n {
                let ((row_a, out_a), (row_b, out_b)) = (at(r), at(r + 1));
                $body::<VNNI, Z, G, 2>([row_a, row_b], tile, [out_a, out_b]);
                r += 2;
            }
            if r < n {
                let (row, out) = at(r);
                $body::<VNNI, Z, G, 1>([row], tile, [out]);
            }
        }
    };
}

tile_kernel!(q4_k, q4_k_plain, q4_k_vnni, q4_k_rows, q4_k_row, 144);
tile_kernel!(q6_k, q6_k_plain, q6_k_vnni, q6_k_rows, q6_k_row, 210);

/// `acc +` the products of unsigned `weights` and signed `activations`,
/// by four: i32 lanes with VNNI, i16 lanes (pairs) without.
#[inline(always)]
unsafe fn dot_step<const VNNI: bool>(
    acc: __m512i,
    weights: __m512i,
    activations: __m512i,
) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(acc, weights, activations)
    } else {
        _mm512_add_epi16(acc, _mm512_maddubs_epi16(weights, activations))
    }
}

/// `scale *` the sums of [`dot_step`], as i32 lanes.
#[inline(always)]
unsafe fn scaled<const VNNI: bool>(sums: __m512i, scale: i16) -> __m512i {
    if VNNI {
        _mm512_mullo_epi32(sums, _mm512_set1_epi32(i32::from(scale)))
    } else {
        _mm512_madd_epi16(sums, _mm512_set1_epi16(scale))
    }
}

/// `total + (d * dw) * sums`, lane by lane: the single-token kernel's f32
/// product and sum, rounded in its order.
#[inline(always)]
unsafe fn accumulate(total: __m512, d: __m512, dw: f32, sums: __m512i) -> __m512 {
    let scale = _mm512_mul_ps(d, _mm512_set1_ps(dw));
    _mm512_add_ps(total, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sums)))
}

/// `4G` weight bytes at `p`, in every lane (`G` = 1) or every `G` lanes.
#[inline(always)]
unsafe fn broadcast<const G: usize>(p: *const u8) -> __m512i {
    if G == 4 {
        _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i))
    } else if G == 2 {
        _mm512_set1_epi64(std::ptr::read_unaligned(p as *const i64))
    } else {
        _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
    }
}

/// The i16 pairs `pairs(k)` (the `k`-th pair of a super-block's items)
/// for the register that holds pair `at` of each token: the same pair in
/// every lane (`G` = 1), or pairs `G at` to `G at + G - 1` in turn.
#[inline(always)]
unsafe fn pair_factors<const G: usize>(pairs: impl Fn(usize) -> u32, at: usize) -> __m512i {
    if G == 4 {
        let four = |k: usize| pairs(4 * at + k) as i32;
        _mm512_broadcast_i32x4(_mm_setr_epi32(four(0), four(1), four(2), four(3)))
    } else if G == 2 {
        let both = u64::from(pairs(2 * at)) | (u64::from(pairs(2 * at + 1)) << 32);
        _mm512_set1_epi64(both as i64)
    } else {
        _mm512_set1_epi32(pairs(at) as i32)
    }
}

/// Each token's sum (with `G` = 2 or 4, its `G` lanes added, into lanes
/// 0..16 / G).
#[inline(always)]
unsafe fn token_sums<const G: usize>(sums: __m512i) -> __m512i {
    if G == 4 {
        let pairs = _mm512_add_epi32(sums, _mm512_srli_epi64(sums, 32));
        let fours = _mm512_add_epi32(pairs, _mm512_bsrli_epi128(pairs, 8));
        let firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_permutexvar_epi32(firsts, fours)
    } else if G == 2 {
        let both = _mm512_add_epi32(sums, _mm512_srli_epi64(sums, 32));
        _mm512_castsi256_si512(_mm512_cvtepi64_epi32(both))
    } else {
        sums
    }
}

/// Stores a register's token results (16 / G of them).
#[inline(always)]
unsafe fn store<const G: usize>(out: *mut f32, v: __m512) {
    if G == 4 {
        _mm_storeu_ps(out, _mm512_castps512_ps128(v));
    } else if G == 2 {
        _mm256_storeu_ps(out, _mm512_castps512_ps256(v));
    } else {
        _mm512_storeu_ps(out, v);
    }
}

/// With 4 or 8 tokens (a decode step's few sequences, a verify step) a
/// super-block's arithmetic is short enough for memory to bound the
/// kernel, as a single token's is: the rows' blocks ahead are asked for.
#[inline(always)]
unsafe fn prefetch_small_tile<const G: usize, const R: usize>(
    blocks: [*const u8; R],
    width: usize,
) {
    if G >= 2 {
        for block in blocks {
            prefetch_ahead(block, width);
        }
    }
}

/// `R` Q4_K rows against the tile: each chunk's 32 bytes hold sub-block
/// `2c` in their low nibbles and `2c + 1` in their high ones. Without
/// VNNI, eight i16 pair sums of at most 2 * 15 * 127 stay below 2^15.
#[inline(always)]
unsafe fn q4_k_row<const VNNI: bool, const Z: usize, const G: usize, const R: usize>(
    rows: [*const u8; R],
    tile: &TokenTile,
    outs: [*mut f32; R],
) {
    let mask = _mm512_set1_epi8(0x0F);
    let mut total = [[_mm512_setzero_ps(); Z]; R];
    let mut mins = [[_mm512_setzero_ps(); Z]; R];
    for i in 0..tile.blocks {
        let w = rows.map(|row| row.add(i * 144));
        prefetch_small_tile::<G, R>(w, 144);
        let scales = w.map(|w| k4_scales(std::slice::from_raw_parts(w.add(4), 12)));
        let qs = tile.qs.as_ptr().add(i * GROUPS / G * Z);
        let mut sums = [[_mm512_setzero_si512(); Z]; R];
        for chunk in 0..4 {
            let mut low = [[_mm512_setzero_si512(); Z]; R];
            let mut high = [[_mm512_setzero_si512(); Z]; R];
            for j in 0..8 / G {
                let mut bytes = [_mm512_setzero_si512(); R];
                for r in 0..R {
                    bytes[r] = broadcast::<G>(w[r].add(16 + 32 * chunk + 4 * G * j));
                }
                for z in 0..Z {
                    let a = (*qs.add((16 * chunk / G + j) * Z + z)).load();
                    let b = (*qs.add(((16 * chunk + 8) / G + j) * Z + z)).load();
                    for r in 0..R {
                        let low_values = _mm512_and_si512(bytes[r], mask);
                        // With VNNI's i32 sums, the high nibbles in place
                        // (16 times their value), divided out per sub-block.
                        let high_values = if VNNI {
                            _mm512_andnot_si512(mask, bytes[r])
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16(bytes[r], 4), mask)
                        };
                        low[r][z] = dot_step::<VNNI>(low[r][z], low_values, a);
                        high[r][z] = dot_step::<VNNI>(high[r][z], high_values, b);
                    }
                }
            }
            for r in 0..R {
                let (scale_low, scale_high) = (scales[r].0[2 * chunk], scales[r].0[2 * chunk + 1]);
                for z in 0..Z {
                    // Exact: with VNNI the high sums are multiples of 16.
                    let high = if VNNI {
                        _mm512_srai_epi32(high[r][z], 4)
                    } else {
                        high[r][z]
                    };
                    let both = _mm512_add_epi32(
                        q4_k_scaled::<VNNI, G>(low[r][z], scale_low as i16),
                        q4_k_scaled::<VNNI, G>(high, scale_high as i16),
                    );
                    sums[r][z] = _mm512_add_epi32(sums[r][z], both);
                }
            }
        }
        for r in 0..R {
            let min_sums = q4_k_min_sums::<Z, G>(&scales[r].1, tile, i);
            let (dw, dmin) = (load_f16(w[r]), load_f16(w[r].add(2)));
            for z in 0..Z {
                let d = tile.d.get_unchecked(i * Z + z).load_ps();
                let sums = token_sums::<G>(sums[r][z]);
                total[r][z] = accumulate(total[r][z], d, dw, sums);
                mins[r][z] = accumulate(mins[r][z], d, dmin, min_sums[z]);
            }
        }
    }
    for r in 0..R {
        for z in 0..Z {
            let result = _mm512_sub_ps(total[r][z], mins[r][z]);
            store::<G>(outs[r].add(z * LANES), result);
        }
    }
}

/// [`scaled`] for a Q4_K sub-block's sums. With VNNI and 8 or 4 tokens, a
/// lane's sum (16 or 8 values, at most 16 * 15 * 127 in magnitude) fits in
/// its low i16, so one `vpmaddwd` by `(scale, 0)` multiplies it exactly.
#[inline(always)]
unsafe fn q4_k_scaled<const VNNI: bool, const G: usize>(sums: __m512i, scale: i16) -> __m512i {
    if VNNI && G >= 2 {
        _mm512_madd_epi16(sums, _mm512_set1_epi32(i32::from(scale)))
    } else {
        scaled::<VNNI>(sums, scale)
    }
}

/// `sum_j min_j * (sum of sub-block j)` of super-block `i`, exact in i32,
/// per token.
#[inline(always)]
unsafe fn q4_k_min_sums<const Z: usize, const G: usize>(
    min_scales: &[u8; 8],
    tile: &TokenTile,
    i: usize,
) -> [__m512i; Z] {
    let mins = |p: usize| pair(min_scales[2 * p] as i16, min_scales[2 * p + 1] as i16);
    let mut min_sums = [_mm512_setzero_si512(); Z];
    for at in 0..4 / G {
        let m = pair_factors::<G>(mins, at);
        for (z, min_sum) in min_sums.iter_mut().enumerate() {
            let by_32 = tile
                .sums_by_32
                .get_unchecked((i * 4 / G + at) * Z + z)
                .load();
            *min_sum = _mm512_add_epi32(*min_sum, _mm512_madd_epi16(by_32, m));
        }
    }
    for min_sum in min_sums.iter_mut() {
        *min_sum = token_sums::<G>(*min_sum);
    }
    min_sums
}

/// The four quarters' unsigned 6-bit values of bytes `4j..4j+4` of one
/// Q6_K half: low nibbles of `a` (then `b`), high nibbles of `a` (then
/// `b`), each with two high bits from `h`.
#[inline(always)]
unsafe fn q6_values(a: __m512i, b: __m512i, h: __m512i) -> [__m512i; 4] {
    let (nibble, top) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    [
        with_top(a, _mm512_slli_epi16(h, 4), nibble, top),
        with_top(b, _mm512_slli_epi16(h, 2), nibble, top),
        with_top(_mm512_srli_epi16(a, 4), h, nibble, top),
        with_top(
            _mm512_srli_epi16(b, 4),
            _mm512_srli_epi16(h, 2),
            nibble,
            top,
        ),
    ]
}

/// `(low & nibble) | (high & top)`.
#[inline(always)]
unsafe fn with_top(low: __m512i, high: __m512i, nibble: __m512i, top: __m512i) -> __m512i {
    _mm512_or_si512(_mm512_and_si512(low, nibble), _mm512_and_si512(high, top))
}

/// `R` Q6_K rows against the tile: the unsigned 6-bit values times the
/// activations, less 32 times the scaled activation sums. Value `32m + l`
/// of half `h` lies in sub-block (of 16) `8h + 2m + l / 16`. Without VNNI,
/// two i16 pair sums of at most 2 * 63 * 127 stay below 2^15, so each two
/// steps (each one, with 4 tokens: one step is a sub-block) are scaled.
#[inline(always)]
unsafe fn q6_k_row<const VNNI: bool, const Z: usize, const G: usize, const R: usize>(
    rows: [*const u8; R],
    tile: &TokenTile,
    outs: [*mut f32; R],
) {
    let mut total = [[_mm512_setzero_ps(); Z]; R];
    // Steps (of 4G values) per sub-block of 16, and per scaling.
    let steps = 4 / G;
    let per_scaling = if VNNI { steps } else { steps.min(2) };
    for i in 0..tile.blocks {
        let w = rows.map(|row| row.add(i * 210));
        prefetch_small_tile::<G, R>(w, 210);
        let scale = |r: usize, s: usize| *w[r].add(192 + s) as i8 as i16;
        let qs = tile.qs.as_ptr().add(i * GROUPS / G * Z);
        let mut sums = [[_mm512_setzero_si512(); Z]; R];
        for r in 0..R {
            sums[r] = q6_k_offsets::<Z, G>(w[r], tile, i);
        }
        for half in 0..2 {
            // Per row, quarter and register: the running products of the
            // current sub-block (without VNNI, of its current two steps).
            let mut acc = [[[_mm512_setzero_si512(); Z]; 4]; R];
            for j in 0..8 / G {
                let mut values = [[_mm512_setzero_si512(); 4]; R];
                for r in 0..R {
                    let (ql, qh) = (w[r].add(64 * half), w[r].add(128 + 32 * half));
                    values[r] = q6_values(
                        broadcast::<G>(ql.add(4 * G * j)),
                        broadcast::<G>(ql.add(32 + 4 * G * j)),
                        broadcast::<G>(qh.add(4 * G * j)),
                    );
                }
                for m in 0..4 {
                    for z in 0..Z {
                        let a = (*qs.add(((32 * half + 8 * m) / G + j) * Z + z)).load();
                        for r in 0..R {
                            acc[r][m][z] = dot_step::<VNNI>(acc[r][m][z], values[r][m], a);
                        }
                    }
                    if j % per_scaling == per_scaling - 1 {
                        for r in 0..R {
                            let s = scale(r, 8 * half + 2 * m + j / steps);
                            for z in 0..Z {
                                let product = scaled::<VNNI>(acc[r][m][z], s);
                                sums[r][z] = _mm512_add_epi32(sums[r][z], product);
                                acc[r][m][z] = _mm512_setzero_si512();
                            }
                        }
                    }
                }
            }
        }
        for r in 0..R {
            let dw = load_f16(w[r].add(208));
            for z in 0..Z {
                let d = tile.d.get_unchecked(i * Z + z).load_ps();
                total[r][z] = accumulate(total[r][z], d, dw, token_sums::<G>(sums[r][z]));
            }
        }
    }
    for r in 0..R {
        for z in 0..Z {
            store::<G>(outs[r].add(z * LANES), total[r][z]);
        }
    }
}

/// The offset of 32 of Q6_K block `w` (super-block `i`) as the start of
/// its sums: `-32 * sum_s scale_s * bsum_s`, exact (per lane: with `G` =
/// 2, each token's two lanes add up to it).
#[inline(always)]
unsafe fn q6_k_offsets<const Z: usize, const G: usize>(
    w: *const u8,
    tile: &TokenTile,
    i: usize,
) -> [__m512i; Z] {
    let scale = |s: usize| *w.add(192 + s) as i8 as i16;
    let scales = |p: usize| pair(scale(2 * p), scale(2 * p + 1));
    let mut offset = [_mm512_setzero_si512(); Z];
    for at in 0..8 / G {
        let s = pair_factors::<G>(scales, at);
        for (z, offset) in offset.iter_mut().enumerate() {
            let by_16 = tile
                .sums_by_16
                .get_unchecked((i * 8 / G + at) * Z + z)
                .load();
            *offset = _mm512_add_epi32(*offset, _mm512_madd_epi16(by_16, s));
        }
    }
    for o in offset.iter_mut() {
        *o = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(*o, 5));
    }
    offset
}
