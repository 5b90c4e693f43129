//! Attention over the paged KV cache: every query head of a batch against
//! its own sequence's cached keys and values.
//!
//! The arithmetic of one (query, position) pair is fixed, whatever else is
//! computed beside it, so a token's output never depends on its batch:
//! the query rounded to f16 (as llama.cpp converts it for K), an 8-lane
//! dot with the f16 key, softmax, weights rounded to f16, and `softmax(QK) V`
//! summed in eight partial sums by position mod 8, folded pairwise (the
//! order of llama.cpp's 8-lane SIMD dot over positions).
//!
//! What batching changes is only how much is shared: the query heads of one
//! KV head (grouped-query attention) are attended together, up to
//! [`HEADS_AT_ONCE`], so each key and value is converted from f16 once for
//! all of them rather than once per head.

use std::ops::Range;

use half::f16;

use super::config::ModelConfig;
use super::transformer::{HeadLayout, SeqSpan};
use crate::model::paged::{BlockId, BLOCK_TOKENS};
use crate::ops;
use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

/// The largest head dimension the scratch has room for.
pub(super) const MAX_HEAD_DIM: usize = 512;

/// Query heads of one KV head attended together at most: enough to cover
/// the usual groups (3 to 8 heads per KV head, in chunks) while their
/// accumulators still fit in registers.
const HEADS_AT_ONCE: usize = 4;

/// Each thread's attention scratch for sequences of up to `context`
/// positions: per head attended at once, its query, eight lanes of
/// partial sums and a row of scores.
pub(super) fn scratch_per_thread(context: usize) -> usize {
    HEADS_AT_ONCE * (9 * MAX_HEAD_DIM + context.next_multiple_of(64))
}

/// How a layer scores positions: its window, the scale of q·k, and the
/// soft cap on the scores.
#[derive(Clone, Copy)]
pub(super) struct Scoring {
    pub window: Option<usize>,
    pub scale: f32,
    pub softcap: Option<f32>,
}

/// A step's queries: each token's query heads, and where it sits (its
/// sequence, `spans[token_span[t]]`, and its position).
pub(super) struct Queries<'a> {
    pub q: &'a [f32],
    pub spans: &'a [SeqSpan<'a>],
    pub token_span: &'a [u32],
    pub positions: &'a [usize],
}

/// Where attention writes: its output, and each thread's `stride` floats
/// of scratch.
pub(super) struct Buffers<'a> {
    pub out: &'a mut [f32],
    pub scratch: &'a mut [f32],
    pub stride: usize,
}

/// One layer's attention: `out[t, head] = softmax(q[t, head] · K) V` over
/// the positions token `t`'s sequence has seen, for every token of
/// `queries`, each head against its KV head in `layout`; `layer` is the
/// layer's keys and values in the pool.
pub(super) fn attention(
    cfg: &ModelConfig,
    layout: HeadLayout,
    scoring: Scoring,
    queries: Queries<'_>,
    (keys, values): (&[f16], &[f16]),
    buffers: Buffers<'_>,
    pool: &ThreadPool,
) {
    let Queries {
        q,
        spans,
        token_span,
        positions,
    } = queries;
    let Buffers {
        out,
        scratch,
        stride,
    } = buffers;
    let group = layout.group;
    // Sharing conversions across heads leaves fewer, larger work items:
    // worth it once there are enough of them to keep every thread busy.
    let at_once = if positions.len() * cfg.kv_heads >= 4 * pool.threads() {
        group.clamp(1, HEADS_AT_ONCE)
    } else {
        1
    };
    let chunks = group.div_ceil(at_once);
    let job = Job {
        heads: cfg.heads,
        hd: cfg.head_dim,
        kvd: cfg.kv_dim(),
        scoring,
        q,
        keys,
        values,
    };
    let out_view = DisjointSlice::new(out);
    let scratch_view = DisjointSlice::new(scratch);
    let items = positions.len() * cfg.kv_heads * chunks;
    pool.run(|thread, threads| {
        // SAFETY: each thread owns its own stride of the scratch buffer.
        let scratch = unsafe { scratch_view.part(thread * stride..(thread + 1) * stride) };
        for item in split_range(items, thread, threads, 1) {
            let t = item / (cfg.kv_heads * chunks);
            let kv_head = item / chunks % cfg.kv_heads;
            // A tensor rank may have only some of a KV head's query heads:
            // then some chunks are empty.
            let all = layout.heads_of(kv_head, cfg.heads);
            let first = all.start + item % chunks * at_once;
            let heads = first.min(all.end)..(first + at_once).min(all.end);
            if heads.is_empty() {
                continue;
            }
            let row = t * job.heads * job.hd;
            // SAFETY: (t, head) pairs are disjoint across threads.
            let o = unsafe { out_view.part(row + heads.start * job.hd..row + heads.end * job.hd) };
            let item = Item {
                t,
                kv_head,
                heads,
                table: spans[token_span[t] as usize].table,
                seen: positions[t] + 1,
            };
            job.attend(&item, o, scratch);
        }
    });
}

/// What every work item of one layer's attention reads.
struct Job<'a> {
    heads: usize,
    hd: usize,
    kvd: usize,
    scoring: Scoring,
    q: &'a [f32],
    keys: &'a [f16],
    values: &'a [f16],
}

impl Job<'_> {
    /// One work item's query heads into `out`.
    fn attend(&self, item: &Item<'_>, out: &mut [f32], scratch: &mut [f32]) {
        match item.heads.len() {
            1 => self.attend_heads::<1>(item, out, scratch),
            2 => self.attend_heads::<2>(item, out, scratch),
            3 => self.attend_heads::<3>(item, out, scratch),
            _ => self.attend_heads::<4>(item, out, scratch),
        }
    }

    fn attend_heads<const G: usize>(&self, item: &Item, out: &mut [f32], scratch: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if ops::f16_simd_available() {
            // SAFETY: the features are checked at run time.
            unsafe { self.attend_heads_avx2::<G>(item, out, scratch) };
            return;
        }
        self.attend_heads_body::<G, false>(item, out, scratch)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn attend_heads_avx2<const G: usize>(&self, item: &Item, out: &mut [f32], scratch: &mut [f32]) {
        self.attend_heads_body::<G, true>(item, out, scratch)
    }

    /// The `G` heads of `item`; `SIMD`: inlined AVX2 kernels (the caller
    /// has the features), else the portable ones.
    #[inline(always)]
    fn attend_heads_body<const G: usize, const SIMD: bool>(
        &self,
        item: &Item,
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let hd = self.hd;
        let (queries, rest) = scratch.split_at_mut(G * MAX_HEAD_DIM);
        let (lanes, scores) = rest.split_at_mut(G * 8 * MAX_HEAD_DIM);
        let row_len = scores.len() / G;
        let seen = item.seen;
        // A sliding window sees its last `window` positions; skipping the
        // rest adds the exact zeros a mask would, so the sums are alike.
        let first = self.scoring.window.map_or(0, |w| seen.saturating_sub(w));
        let queries = &mut queries[..G * hd];
        let from = (item.t * self.heads + item.heads.start) * hd;
        ops::round_to_f16_slice(queries, &self.q[from..from + G * hd]);
        let head_offset = item.kv_head * hd;
        let mut dots = [0.0f32; G];
        let rows = |data| Rows {
            kv_dim: self.kvd,
            head_offset,
            hd,
            data,
        };
        for_each_position(item.table, first..seen, rows(self.keys), |p, at| {
            dot_heads::<G, SIMD>(queries, &self.keys[at..at + hd], &mut dots);
            for (g, dot) in dots.iter().enumerate() {
                scores[g * row_len + p] = dot * self.scoring.scale;
            }
        });
        for g in 0..G {
            let row = &mut scores[g * row_len + first..g * row_len + seen];
            if let Some(cap) = self.scoring.softcap {
                ops::softcap(row, cap);
            }
            ops::softmax(row);
            // Attention weights meet V in f16 too.
            ops::round_to_f16_in_place(row);
        }
        let lanes = &mut lanes[..G * 8 * hd];
        lanes.fill(0.0);
        for_each_position(item.table, first..seen, rows(self.values), |p, at| {
            let weights = std::array::from_fn(|g| scores[g * row_len + p]);
            axpy_heads::<G, SIMD>(lanes, p % 8, &weights, &self.values[at..at + hd]);
        });
        for g in 0..G {
            let lanes = &lanes[g * 8 * hd..(g + 1) * 8 * hd];
            for (d, out) in out[g * hd..(g + 1) * hd].iter_mut().enumerate() {
                let l = |i: usize| lanes[i * hd + d];
                *out = ((l(0) + l(4)) + (l(2) + l(6))) + ((l(1) + l(5)) + (l(3) + l(7)));
            }
        }
    }
}

/// One work item: some query heads of one token.
struct Item<'a> {
    t: usize,
    kv_head: usize,
    heads: Range<usize>,
    table: &'a [BlockId],
    seen: usize,
}

/// `dots[g] = queries[g] · key`, each exactly [`ops::dot_f16`]'s bits; the
/// key is converted once for all `G`.
#[inline(always)]
fn dot_heads<const G: usize, const SIMD: bool>(queries: &[f32], key: &[f16], dots: &mut [f32; G]) {
    let hd = key.len();
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        // SAFETY: `SIMD` only where the caller has AVX2, FMA and F16C;
        // `queries` holds `G` rows of `hd`.
        unsafe { ops::f16_simd::dot_many::<G>(queries, key, dots) };
        return;
    }
    for (g, dot) in dots.iter_mut().enumerate() {
        *dot = ops::dot_f16(&queries[g * hd..(g + 1) * hd], key);
    }
}

/// `lanes[g][lane] += weights[g] * value` for each head `g`, each exactly
/// [`ops::axpy_f16`]'s bits; the value is converted once for all `G`.
#[inline(always)]
fn axpy_heads<const G: usize, const SIMD: bool>(
    lanes: &mut [f32],
    lane: usize,
    weights: &[f32; G],
    value: &[f16],
) {
    let hd = value.len();
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        // SAFETY: `SIMD` only where the caller has AVX2, FMA and F16C;
        // `lanes` holds `G` groups of eight rows of `hd`.
        unsafe { ops::f16_simd::axpy_many::<G>(lanes, lane, weights, value) };
        return;
    }
    for (g, weight) in weights.iter().enumerate() {
        let at = (g * 8 + lane) * hd;
        ops::axpy_f16(&mut lanes[at..at + hd], *weight, value);
    }
}

/// One head's rows in a layer's keys or values: `hd` values at
/// `head_offset` in every position's `kv_dim`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    kv_dim: usize,
    head_offset: usize,
    hd: usize,
    data: &'a [f16],
}

impl Rows<'_> {
    /// Asks the CPU to fetch block `block`'s rows of this head. A
    /// sequence's blocks lie anywhere in the pool, so the hardware
    /// prefetchers lose the stream at each block; without this, every
    /// block start waits on memory.
    #[inline(always)]
    fn prefetch_block(&self, block: BlockId) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let base = block as usize * BLOCK_TOKENS * self.kv_dim + self.head_offset;
            let row_bytes = self.hd * std::mem::size_of::<f16>();
            for slot in 0..BLOCK_TOKENS {
                let start = base + slot * self.kv_dim;
                let Some(row) = self.data.get(start..start + self.hd) else {
                    return;
                };
                let first = row.as_ptr() as *const i8;
                for line in (0..row_bytes).step_by(64) {
                    // SAFETY: a prefetch never faults; the address is within `row`.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(first.add(line)) };
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = block;
    }
}

/// Calls `f(position, offset)` for positions `positions` of a sequence, in
/// order, with the offset of its head's row in `rows.data`: block by block,
/// with no division per position, fetching each next block ahead.
#[inline(always)]
fn for_each_position(
    table: &[BlockId],
    positions: Range<usize>,
    rows: Rows<'_>,
    mut f: impl FnMut(usize, usize),
) {
    let mut position = positions.start;
    let first = positions.start / BLOCK_TOKENS;
    let last = positions.end.div_ceil(BLOCK_TOKENS).min(table.len());
    if let Some(&block) = table.get(first) {
        rows.prefetch_block(block);
    }
    for index in first..last {
        if position >= positions.end {
            break;
        }
        if index + 1 < last {
            rows.prefetch_block(table[index + 1]);
        }
        let base = table[index] as usize * BLOCK_TOKENS * rows.kv_dim + rows.head_offset;
        let end = ((position / BLOCK_TOKENS + 1) * BLOCK_TOKENS).min(positions.end);
        for p in position..end {
            f(p, base + (p % BLOCK_TOKENS) * rows.kv_dim);
        }
        position = end;
    }
}
