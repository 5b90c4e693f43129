//! The forward pass's scratch buffers.

use crate::logits::BestRows;
use crate::model::attention::{self};
use crate::model::config::ModelConfig;
use crate::model::deltanet::LinearWorkspace;
use crate::model::gather::GatherBuffers;
use crate::model::moe::MoeWorkspace;
use crate::quant::Activations;

use super::io::SeqSpan;

/// Scratch buffers of the forward pass, sized once for the largest batch so
/// that decoding allocates nothing.
#[derive(Default)]
pub struct Workspace {
    pub(super) capacity: usize,
    pub(super) x: Vec<f32>,
    pub(super) normed: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    /// Gated attention: each head's q and gate as q_proj gives them, and
    /// the gates.
    pub(super) q_gated: Vec<f32>,
    pub(super) attn_gate: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) proj: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    pub(super) logits: Vec<f32>,
    pub(super) local_logits: Vec<f32>,
    pub(super) scores: Vec<f32>,
    pub(super) scores_stride: usize,
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
    /// The windowed layers' angles where they have a RoPE base of their own.
    pub(super) cos_local: Vec<f32>,
    pub(super) sin_local: Vec<f32>,
    /// Each token's sums of squares of q and of k (norms across heads).
    pub(super) qk_sums: Vec<f32>,
    /// Each token's position in its sequence, and its span's index.
    pub(super) positions: Vec<usize>,
    pub(super) token_span: Vec<u32>,
    /// A tensor rank's gathered logits, before they are put in order (or
    /// its ranks' best tokens, as words).
    pub(super) gathered: Vec<f32>,
    /// A tensor rank's best tokens, as words, to send; and rank 0's
    /// combined ones.
    pub(super) local_best: Vec<f32>,
    pub(super) best: BestRows,
    pub(super) acts: Activations,
    /// The mixture-of-experts block's buffers (empty for dense models).
    pub(super) moe: MoeWorkspace,
    /// The linear-attention layers' buffers (hybrid models).
    pub(super) linear: LinearWorkspace,
    /// A tensor rank's whole rows and its part of the output rows.
    pub(super) gathers: GatherBuffers,
    /// The GPU's buffers, for a shard on a GPU.
    pub(super) gpu: Option<super::gpu_scratch::GpuScratch>,
}

impl Workspace {
    pub(super) fn ensure(
        &mut self,
        config: &ModelConfig,
        tokens: usize,
        context: usize,
        threads: usize,
    ) {
        if tokens > self.capacity {
            let resize = |v: &mut Vec<f32>, n: usize| v.resize(n, 0.0);
            resize(&mut self.x, tokens * config.hidden);
            resize(&mut self.normed, tokens * config.hidden);
            resize(&mut self.q, tokens * config.q_dim());
            resize(&mut self.k, tokens * config.kv_dim());
            resize(&mut self.v, tokens * config.kv_dim());
            resize(&mut self.attn, tokens * config.q_dim());
            if config.variant.attn_output_gate {
                resize(&mut self.q_gated, 2 * tokens * config.q_dim());
                resize(&mut self.attn_gate, tokens * config.q_dim());
            }
            resize(&mut self.proj, tokens * config.hidden);
            resize(&mut self.gate, tokens * config.ffn);
            resize(&mut self.up, tokens * config.ffn);
            resize(&mut self.cos, tokens * config.rotary_dims / 2);
            resize(&mut self.sin, tokens * config.rotary_dims / 2);
            if config.variant.local_rope_theta.is_some() {
                resize(&mut self.cos_local, tokens * config.rotary_dims / 2);
                resize(&mut self.sin_local, tokens * config.rotary_dims / 2);
            }
            resize(&mut self.qk_sums, 2 * tokens);
            self.positions.resize(tokens, 0);
            self.token_span.resize(tokens, 0);
            self.capacity = tokens;
        }
        if self.logits.len() < config.vocab {
            self.logits.resize(config.vocab, 0.0);
        }
        let stride = attention::scratch_per_thread(context);
        if stride > self.scores_stride || self.scores.len() < stride * threads {
            self.scores_stride = stride.max(self.scores_stride);
            self.scores.resize(self.scores_stride * threads, 0.0);
        }
    }
}

impl Workspace {
    /// Trades the last forward pass's logits buffer (whole: its first rows
    /// are the logits) for `other`, which the next pass writes into: rank 0
    /// keeps a step's logits without copying them.
    pub fn swap_logits(&mut self, other: &mut Vec<f32>) {
        std::mem::swap(&mut self.logits, other);
    }

    pub(super) fn index_tokens(&mut self, spans: &[SeqSpan<'_>]) {
        let mut t = 0;
        for (index, span) in spans.iter().enumerate() {
            for position in span.start..span.start + span.len {
                self.positions[t] = position;
                self.token_span[t] = index as u32;
                t += 1;
            }
        }
    }
}

/// What one forward pass works with besides the model: the KV pool, the
/// scratch buffers, the threads and the rank's group (a tensor or pipeline
/// split's peers; `SingleRank` alone).
/// (`'w`: how long the answer, which borrows the workspace, may live.)
pub struct Pass<'a, 'w> {
    pub kv: &'a mut crate::model::paged::KvPool,
    pub ws: &'w mut Workspace,
    pub pool: &'a crate::threadpool::ThreadPool,
    pub group: &'a mut dyn crate::dist::collectives::Group,
}
