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
    /// A mixture of experts' router logits, routes (two words per token
    /// and expert), and per (token, expert) row its gate, up and output.
    pub(super) router: GpuBuffer,
    pub(super) routes: GpuBuffer,
    pub(super) expert_gate: GpuBuffer,
    pub(super) expert_up: GpuBuffer,
    pub(super) expert_out: GpuBuffer,
    /// A shared expert's gate and up rows, and its output.
    pub(super) shared_gate: GpuBuffer,
    pub(super) shared_up: GpuBuffer,
    pub(super) shared_out: GpuBuffer,
    /// Gated attention: each head's q then its gate, and the gates.
    pub(super) q_gated: GpuBuffer,
    pub(super) attn_gate: GpuBuffer,
    /// Gated DeltaNet: q, k, v, z, b's and a's products, each (token,
    /// value head)'s beta and decay, the recurrence's output, and the
    /// step's spans (four words each).
    pub(super) linear: LinearScratch,
    /// A tensor rank's gathered whole rows (the attention's output or the
    /// MLP's activations) and its own rows of a projection's output.
    pub(super) tensor_whole: GpuBuffer,
    pub(super) tensor_part: GpuBuffer,
}

pub(crate) struct LinearScratch {
    pub(super) q: GpuBuffer,
    pub(super) k: GpuBuffer,
    pub(super) v: GpuBuffer,
    pub(super) z: GpuBuffer,
    pub(super) beta: GpuBuffer,
    pub(super) alpha: GpuBuffer,
    pub(super) gates: GpuBuffer,
    pub(super) out: GpuBuffer,
    pub(super) spans: GpuBuffer,
}

impl LinearScratch {
    fn new(gpu: &Gpu, cfg: &ModelConfig, tokens: usize) -> Self {
        let floats = |label, n: usize| gpu.buffer(label, (n * 4) as u64);
        let (qk, vw, heads) = cfg.variant.linear.as_ref().map_or((0, 0, 0), |l| {
            (
                l.key_heads * l.key_dim,
                l.value_heads * l.value_dim,
                l.value_heads,
            )
        });
        // b's and a's product rows are at most two words a value head
        // (Qwen3-Next's fused product).
        let ba = 2 * heads;
        Self {
            q: floats("linear q", tokens * qk),
            k: floats("linear k", tokens * qk),
            v: floats("linear v", tokens * vw),
            z: floats("linear z", tokens * vw),
            beta: floats("linear b", tokens * ba),
            alpha: floats("linear a", tokens * ba),
            gates: floats("linear gates", 2 * tokens * heads),
            out: floats("linear out", tokens * vw),
            spans: floats("spans", 4 * tokens),
        }
    }
}

impl GpuScratch {
    /// Buffers for `tokens` tokens, `rows` rows of logits, `table_words`
    /// block-table entries, and (a tensor rank) gathered rows `whole`
    /// wide.
    fn new(gpu: &Gpu, cfg: &ModelConfig, [tokens, rows, table_words, whole]: [usize; 4]) -> Self {
        let floats = |label, n: usize| gpu.buffer(label, (n * 4) as u64);
        let pairs = cfg.rotary_dims / 2;
        let shared_ffn = cfg.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(0);
        let linear_width = cfg
            .variant
            .linear
            .as_ref()
            .map_or(0, |l| l.value_heads * l.value_dim);
        let widest = cfg
            .hidden
            .max(cfg.q_dim())
            .max(cfg.ffn)
            .max(shared_ffn)
            .max(linear_width)
            .max(whole);
        let gated = if cfg.variant.attn_output_gate { 1 } else { 0 };
        // (token, expert) rows, and each one's intermediate width.
        let (experts, routed, expert_ffn) = cfg.moe.as_ref().map_or((0, 0, 0), |m| {
            (m.experts, tokens * m.experts_per_token, m.expert_ffn)
        });
        // A product's input in 8-bit blocks: the widest of a step's rows,
        // or every (token, expert) row of the experts' down products.
        let blocks_of = |block: usize| {
            (tokens * widest.div_ceil(block)).max(routed * expert_ffn.div_ceil(block))
        };
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
            xq: gpu.buffer("x in 8 bits", (blocks_of(32) * Q8_BLOCK_BYTES) as u64),
            xqk: gpu.buffer(
                "x in 8-bit blocks of 256",
                (blocks_of(256) * Q8K_BLOCK_BYTES) as u64,
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
            router: floats("router", tokens * experts),
            routes: floats("routes", 2 * routed),
            expert_gate: floats("expert gate", routed * expert_ffn),
            expert_up: floats("expert up", routed * expert_ffn),
            expert_out: floats("expert out", routed * cfg.hidden),
            shared_gate: floats("shared gate", tokens * shared_ffn),
            shared_up: floats("shared up", tokens * shared_ffn),
            shared_out: floats(
                "shared out",
                if shared_ffn > 0 {
                    tokens * cfg.hidden
                } else {
                    0
                },
            ),
            q_gated: floats("q and gates", gated * 2 * tokens * cfg.q_dim()),
            attn_gate: floats("attention gates", gated * tokens * cfg.q_dim()),
            linear: LinearScratch::new(gpu, cfg, tokens),
            tensor_whole: floats("whole rows", tokens * whole),
            tensor_part: floats("own rows", if whole > 0 { tokens * cfg.hidden } else { 0 }),
        }
    }

    /// `held`, or new buffers when a step needs more than it holds.
    pub(super) fn ensure(
        held: Option<Self>,
        gpu: &Gpu,
        cfg: &ModelConfig,
        [tokens, rows, table_words, whole]: [usize; 4],
    ) -> Self {
        match held {
            Some(s) if s.tokens >= tokens && s.rows >= rows && s.table_words >= table_words => s,
            held => {
                let most =
                    |f: fn(&Self) -> usize, n: usize| held.as_ref().map_or(n, |s| f(s).max(n));
                let sizes = [
                    most(|s| s.tokens, tokens),
                    most(|s| s.rows, rows.max(1)),
                    most(|s| s.table_words, table_words.max(1)),
                    whole,
                ];
                Self::new(gpu, cfg, sizes)
            }
        }
    }
}
