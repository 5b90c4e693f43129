//! A step's buffers on the GPU (`gpu_forward.rs` fills and reads them).

use crate::gpu::matvec::{Q8K_BLOCK_BYTES, Q8_BLOCK_BYTES};
use crate::gpu::{Gpu, GpuBuffer};
use crate::logits::TOP_CANDIDATES;
use crate::model::config::ModelConfig;

/// A step's buffers on the GPU, sized for the largest step so far.
pub(crate) struct GpuScratch {
    /// Tokens, rows of logits and block-table entries they hold.
    pub(super) tokens: usize,
    pub(super) rows: usize,
    pub(super) table_words: usize,
    pub(super) x: GpuBuffer,
    pub(super) normed: GpuBuffer,
    pub(super) q: GpuBuffer,
    pub(super) k: GpuBuffer,
    pub(super) v: GpuBuffer,
    pub(super) attn: GpuBuffer,
    pub(super) proj: GpuBuffer,
    pub(super) gate: GpuBuffer,
    pub(super) up: GpuBuffer,
    /// A matrix product's input in 8-bit blocks (the widest input).
    pub(super) xq: GpuBuffer,
    pub(super) xqk: GpuBuffer,
    pub(super) cos: GpuBuffer,
    pub(super) sin: GpuBuffer,
    pub(super) cos_local: GpuBuffer,
    pub(super) sin_local: GpuBuffer,
    /// Per token: its position and where its block table starts.
    pub(super) positions: GpuBuffer,
    /// Per token: its slot in the cache.
    pub(super) slots: GpuBuffer,
    pub(super) tables: GpuBuffer,
    /// The tokens that want logits, and their normed rows and logits.
    pub(super) picked: GpuBuffer,
    pub(super) normed_rows: GpuBuffer,
    pub(super) logits: GpuBuffer,
    /// Each row's best token, three words, then (for top-k rows) its
    /// candidates, two words each.
    pub(super) best: GpuBuffer,
}

impl GpuScratch {
    fn new(gpu: &Gpu, cfg: &ModelConfig, tokens: usize, rows: usize, table_words: usize) -> Self {
        let floats = |label, n: usize| gpu.buffer(label, (n * 4) as u64);
        let pairs = cfg.rotary_dims / 2;
        let widest = cfg.hidden.max(cfg.q_dim()).max(cfg.ffn);
        Self {
            tokens,
            rows,
            table_words,
            x: floats("x", tokens * cfg.hidden),
            normed: floats("normed", tokens * cfg.hidden),
            q: floats("q", tokens * cfg.q_dim()),
            k: floats("k", tokens * cfg.kv_dim()),
            v: floats("v", tokens * cfg.kv_dim()),
            attn: floats("attn", tokens * cfg.q_dim()),
            proj: floats("proj", tokens * cfg.hidden),
            gate: floats("gate", tokens * cfg.ffn),
            up: floats("up", tokens * cfg.ffn),
            xq: gpu.buffer(
                "x in 8 bits",
                (tokens * widest.div_ceil(32) * Q8_BLOCK_BYTES) as u64,
            ),
            xqk: gpu.buffer(
                "x in 8-bit blocks of 256",
                (tokens * widest.div_ceil(256) * Q8K_BLOCK_BYTES) as u64,
            ),
            cos: floats("cos", tokens * pairs),
            sin: floats("sin", tokens * pairs),
            cos_local: floats("cos local", tokens * pairs),
            sin_local: floats("sin local", tokens * pairs),
            positions: floats("positions", 2 * tokens),
            slots: floats("slots", tokens),
            tables: floats("tables", table_words),
            picked: floats("picked", rows),
            normed_rows: floats("normed rows", rows * cfg.hidden),
            logits: floats("logits", rows * cfg.vocab),
            best: floats("best", (3 + 2 * TOP_CANDIDATES) * rows),
        }
    }

    /// `held`, or new buffers when a step needs more than it holds.
    pub(super) fn ensure(
        held: Option<Self>,
        gpu: &Gpu,
        cfg: &ModelConfig,
        [tokens, rows, table_words]: [usize; 3],
    ) -> Self {
        match held {
            Some(s) if s.tokens >= tokens && s.rows >= rows && s.table_words >= table_words => s,
            held => {
                let most =
                    |f: fn(&Self) -> usize, n: usize| held.as_ref().map_or(n, |s| f(s).max(n));
                Self::new(
                    gpu,
                    cfg,
                    most(|s| s.tokens, tokens),
                    most(|s| s.rows, rows.max(1)),
                    most(|s| s.table_words, table_words.max(1)),
                )
            }
        }
    }
}
