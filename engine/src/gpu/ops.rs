//! The forward pass's other kernels, recorded into a [`Step`]: norms,
//! value-by-value operations, rotary embeddings, and attention over the
//! paged KV cache. Each checks its buffers' sizes against its shape, so a
//! wrong shape is an error here rather than a read past a buffer's end.

use super::error::GpuError;
use super::kernels::Kernel;
use super::step::{grid_for_values, grid_of, params, GpuBuffer, Step};
use crate::logits::TOP_CANDIDATES;

/// A value-by-value kernel over `a`, reading `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elementwise {
    /// a += b.
    Add,
    /// a += b, b one row added to every row of a.
    AddBias,
    /// a = b.
    Copy,
    /// a = silu(a) b.
    SiluMul,
    /// a = gelu_tanh(a) b.
    GeluMul,
    /// a = the first `width` of each `2 width` values of b.
    FirstHalves,
    /// a = the second `width` of each `2 width` values of b.
    SecondHalves,
    /// a = a sigmoid(b).
    SigmoidMul,
}

/// How rotary embeddings rotate `tokens x heads` heads of `head_dim`.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape {
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Rotated pairs per head (rotary dimensions / 2).
    pub pairs: usize,
    /// Pairs (i, i + pairs) rather than (2i, 2i + 1).
    pub halves: bool,
}

/// One layer's attention shape and scoring.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Query heads per KV head, and the first query and KV head of these
    /// (0 but on a tensor rank): query head h reads KV head
    /// `(q_first + h) / group - kv_first`.
    pub group: usize,
    pub q_first: usize,
    pub kv_first: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
    pub scale: f32,
    pub softcap: Option<f32>,
}

/// The largest head dimension the attention kernel holds.
pub const MAX_HEAD_DIM: usize = 256;

pub(super) fn check(what: &str, buffer: &GpuBuffer, values: usize) -> Result<(), GpuError> {
    if buffer.bytes() < (values * 4) as u64 {
        return Err(GpuError::Shape(format!(
            "{what}: {values} values in a buffer of {} bytes",
            buffer.bytes()
        )));
    }
    Ok(())
}

pub(super) fn word(value: usize) -> Result<u32, GpuError> {
    u32::try_from(value).map_err(|_| GpuError::Shape(format!("{value} does not fit a GPU word")))
}

impl Step<'_> {
    /// `out` = each of `rows` rows of `width` in `input`, RMS-normed and
    /// scaled by `weight`.
    pub fn rms_norm(
        &mut self,
        [input, weight, out]: [&GpuBuffer; 3],
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        check("rms_norm input", input, rows * width)?;
        check("rms_norm output", out, rows * width)?;
        check("rms_norm weight", weight, width)?;
        let shape = params(&[word(rows)?, word(width)?, eps.to_bits(), 0]);
        let buffers = [Some(input), Some(weight), Some(out), Some(weight)];
        self.record(Kernel::RmsNorm, shape, &buffers, grid_of(rows, 1));
        Ok(())
    }

    /// Row `r` of `out` = row `picked[r]` of `input`, normed (the rows
    /// that want logits); `rows` rows.
    pub fn rms_norm_rows(
        &mut self,
        [input, weight, out, picked]: [&GpuBuffer; 4],
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        check("rms_norm_rows output", out, rows * width)?;
        check("rms_norm_rows weight", weight, width)?;
        check("rms_norm_rows picked", picked, rows)?;
        let shape = params(&[word(rows)?, word(width)?, eps.to_bits(), 1]);
        let buffers = [Some(input), Some(weight), Some(out), Some(picked)];
        self.record(Kernel::RmsNorm, shape, &buffers, grid_of(rows, 1));
        Ok(())
    }

    /// [`Step::rms_norm`] of `x` into itself.
    pub fn rms_norm_in_place(
        &mut self,
        [x, weight]: [&GpuBuffer; 2],
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        check("rms_norm_in_place", x, rows * width)?;
        check("rms_norm_in_place weight", weight, width)?;
        let shape = params(&[word(rows)?, word(width)?, eps.to_bits(), 2]);
        let buffers = [Some(weight), Some(weight), Some(x), Some(weight)];
        self.record(Kernel::RmsNorm, shape, &buffers, grid_of(rows, 1));
        Ok(())
    }

    /// `op` over the first `count` values of `a`; `width` is b's length
    /// for [`Elementwise::AddBias`].
    pub fn elementwise(
        &mut self,
        op: Elementwise,
        [a, b]: [&GpuBuffer; 2],
        count: usize,
        width: usize,
    ) -> Result<(), GpuError> {
        check("elementwise a", a, count)?;
        let by_rows = matches!(
            op,
            Elementwise::AddBias | Elementwise::FirstHalves | Elementwise::SecondHalves
        );
        if by_rows && (width == 0 || !count.is_multiple_of(width)) {
            return Err(GpuError::Shape(format!(
                "{op:?} by rows of {width} over {count} values"
            )));
        }
        let b_len = match op {
            Elementwise::AddBias => width,
            Elementwise::FirstHalves | Elementwise::SecondHalves => 2 * count,
            _ => count,
        };
        check("elementwise b", b, b_len)?;
        let kernel = match op {
            Elementwise::Add => Kernel::Add,
            Elementwise::AddBias => Kernel::AddBias,
            Elementwise::Copy => Kernel::Copy,
            Elementwise::SiluMul => Kernel::SiluMul,
            Elementwise::GeluMul => Kernel::GeluMul,
            Elementwise::FirstHalves => Kernel::FirstHalves,
            Elementwise::SecondHalves => Kernel::SecondHalves,
            Elementwise::SigmoidMul => Kernel::SigmoidMul,
        };
        let shape = params(&[word(count)?, word(width)?]);
        self.record(kernel, shape, &[Some(a), Some(b)], grid_for_values(count));
        Ok(())
    }

    /// Rotates `x` in place with each token's angles (`tokens x pairs`).
    pub fn rope(
        &mut self,
        [x, cos, sin]: [&GpuBuffer; 3],
        shape: RopeShape,
    ) -> Result<(), GpuError> {
        let RopeShape {
            tokens,
            heads,
            head_dim,
            pairs,
            halves,
        } = shape;
        if pairs == 0 || 2 * pairs > head_dim {
            return Err(GpuError::Shape(format!(
                "{pairs} rotary pairs in heads of {head_dim}"
            )));
        }
        check("rope x", x, tokens * heads * head_dim)?;
        check("rope cos", cos, tokens * pairs)?;
        check("rope sin", sin, tokens * pairs)?;
        let count = tokens * heads * pairs;
        let values = [
            word(count)?,
            word(heads)?,
            word(head_dim)?,
            word(pairs)?,
            u32::from(halves),
        ];
        let buffers = [Some(x), Some(cos), Some(sin)];
        self.record(
            Kernel::Rope,
            params(&values),
            &buffers,
            grid_for_values(count),
        );
        Ok(())
    }

    /// Writes `tokens` rows of `k` and `v` (`kv_dim` each) into the f16
    /// cache `keys` and `values` at the slots `slots` names.
    pub fn store_kv(
        &mut self,
        [k, v, keys, values, slots]: [&GpuBuffer; 5],
        tokens: usize,
        kv_dim: usize,
    ) -> Result<(), GpuError> {
        if !kv_dim.is_multiple_of(2) {
            return Err(GpuError::Shape(format!("an odd KV width {kv_dim}")));
        }
        check("store_kv k", k, tokens * kv_dim)?;
        check("store_kv v", v, tokens * kv_dim)?;
        check("store_kv slots", slots, tokens)?;
        let count = tokens * kv_dim / 2;
        let shape = params(&[word(count)?, word(kv_dim / 2)?]);
        let buffers = [Some(k), Some(v), Some(keys), Some(values), Some(slots)];
        self.record(Kernel::StoreKv, shape, &buffers, grid_for_values(count));
        Ok(())
    }

    /// Attention of `tokens` queries (`q`: `tokens x heads x head_dim`)
    /// over the cache, into `out`. `positions` holds each token's position
    /// and where its block table starts in `tables`.
    pub fn attention(
        &mut self,
        [q, keys, values, positions, tables, out]: [&GpuBuffer; 6],
        shape: AttentionShape,
    ) -> Result<(), GpuError> {
        let AttentionShape {
            tokens,
            heads,
            kv_heads,
            group,
            q_first,
            kv_first,
            head_dim,
            window,
            scale,
            softcap,
        } = shape;
        // Every query head reads one of these KV heads.
        let reads_ours = group > 0
            && heads > 0
            && q_first / group >= kv_first
            && (q_first + heads - 1) / group < kv_first + kv_heads;
        let fits = head_dim <= MAX_HEAD_DIM && head_dim.is_multiple_of(2) && reads_ours;
        if !fits || tokens > super::step::MAX_GRID as usize {
            return Err(GpuError::Shape(format!(
                "attention of {tokens} tokens, {heads} heads over {kv_heads} KV heads of {head_dim} (at most {MAX_HEAD_DIM})"
            )));
        }
        let q_values = tokens * heads * head_dim;
        check("attention q", q, q_values)?;
        check("attention out", out, q_values)?;
        check("attention positions", positions, 2 * tokens)?;
        let shape = params(&[
            word(heads)?,
            word(head_dim)?,
            word(kv_heads * head_dim)?,
            word(group)?,
            word(window.unwrap_or(0))?,
            scale.to_bits(),
            softcap.unwrap_or(0.0).to_bits(),
            word(q_first)?,
            word(kv_first)?,
        ]);
        let buffers = [q, keys, values, positions, tables, out].map(Some);
        let grid = [word(heads)?, word(tokens)?, 1];
        self.record(Kernel::Attention, shape, &buffers, grid);
        Ok(())
    }

    /// Each of `rows` rows of `vocab` logits' best token into `best`, three
    /// words a row (its id's bits, its logit, the softmax mass relative to
    /// it), with the final soft cap applied first where there is one.
    pub fn best_of_rows(
        &mut self,
        buffers: [&GpuBuffer; 2],
        rows: usize,
        vocab: usize,
        softcap: Option<f32>,
    ) -> Result<(), GpuError> {
        self.over_rows(
            Kernel::BestOfRows,
            buffers,
            [rows, vocab, 3 * rows],
            softcap,
        )
    }

    /// Each row's [`TOP_CANDIDATES`] best `(token, logit)` pairs, as the
    /// CPU's [`crate::logits::collect_best`] orders them (padded with an
    /// id of `u32::MAX`), into `best` after [`Step::best_of_rows`]' words:
    /// two words a pair, from word `3 * rows`.
    pub fn top_of_rows(
        &mut self,
        buffers: [&GpuBuffer; 2],
        rows: usize,
        vocab: usize,
        softcap: Option<f32>,
    ) -> Result<(), GpuError> {
        let words = (3 + 2 * TOP_CANDIDATES) * rows;
        self.over_rows(Kernel::TopOfRows, buffers, [rows, vocab, words], softcap)
    }

    /// One of `best.wgsl`'s kernels: a workgroup per row of logits,
    /// writing `words` values into `best`.
    fn over_rows(
        &mut self,
        kernel: Kernel,
        [logits, best]: [&GpuBuffer; 2],
        [rows, vocab, words]: [usize; 3],
        softcap: Option<f32>,
    ) -> Result<(), GpuError> {
        check("the rows' logits", logits, rows * vocab)?;
        check("the rows' best tokens", best, words)?;
        let cap = softcap.unwrap_or(0.0).to_bits();
        let shape = params(&[word(rows)?, word(vocab)?, cap]);
        self.record(kernel, shape, &[Some(logits), Some(best)], grid_of(rows, 1));
        Ok(())
    }
}
