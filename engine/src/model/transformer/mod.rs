//! The decoder every architecture shares: embeddings, then per layer
//! `x += attn(norm(x))`, `x += mlp(norm(x))`, then the final norm and the
//! LM head. A [`Transformer`] holds one shard's layers; a pipeline stage
//! takes hidden states in and hands hidden states on.

mod cache;
mod gpu;
mod gpu_forward;
mod gpu_project;
mod gpu_scratch;
mod gpu_tensor;
mod gpu_weights;
mod head;
mod io;
mod layer;
mod load;
mod split;
mod workspace;

pub use cache::KvCache;
pub use io::{ForwardError, ForwardOutput, RowOutput, SeqSpan, StageInput};
pub(in crate::model) use split::HeadLayout;
pub use split::{TensorLayout, TensorSplit};
pub use workspace::{Pass, Workspace};

use std::ops::Range;

use super::config::{LayerRope, ModelConfig};
use super::deltanet::GatedDeltaNet;
use super::moe::Experts;
use super::weights::Matrix;
use crate::dist::collectives::{Group, SingleRank};
use crate::model::paged::{blocks_for, KvPool};
use crate::ops;
use crate::threadpool::ThreadPool;

/// Weights of one decoder layer.
pub struct Layer {
    /// The norms before attention and the MLP (absent in OLMo 2) and after
    /// them (Gemma, OLMo 2).
    attn_norm: Option<Vec<f32>>,
    attn_post_norm: Option<Vec<f32>>,
    ffn_post_norm: Option<Vec<f32>>,
    ffn_norm: Option<Vec<f32>>,
    mixer: Mixer,
    mlp: Mlp,
}

/// What mixes a layer's tokens: attention over the KV cache, or a Gated
/// DeltaNet over each sequence's recurrent state.
enum Mixer {
    Attention(Attention),
    Linear {
        net: GatedDeltaNet,
        /// Where its state starts in a sequence's slot.
        state_offset: usize,
    },
}

/// Weights of one attention block, and how it places positions.
struct Attention {
    /// Its layer of the KV pool (hybrid models keep none for the others).
    kv_layer: usize,
    /// The window this layer attends over, if any.
    window: Option<usize>,
    rope: LayerRope,
    /// Set when q and k are normed across all heads at once (OLMo 2): the
    /// whole widths of q and k, of which this rank holds a slice.
    qk_norm_widths: Option<(usize, usize)>,
    /// With an output gate, twice as many rows: each head's q, then its
    /// gate (Qwen3.5).
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    /// Llama's `attention_bias` and Qwen3's put a bias on o_proj too; the
    /// whole vector, added once the ranks' rows are gathered.
    o_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    output_gate: bool,
}

impl Layer {
    fn norm_bytes(&self) -> usize {
        [
            &self.attn_norm,
            &self.ffn_norm,
            &self.attn_post_norm,
            &self.ffn_post_norm,
        ]
        .iter()
        .map(|n| n.as_ref().map_or(0, Vec::len) * 4)
        .sum()
    }

    fn size_bytes(&self) -> usize {
        let mixer = match &self.mixer {
            Mixer::Attention(a) => {
                let vectors = [
                    &a.q_bias, &a.k_bias, &a.v_bias, &a.o_bias, &a.q_norm, &a.k_norm,
                ];
                [&a.wq, &a.wk, &a.wv, &a.wo]
                    .iter()
                    .map(|m| m.size_bytes())
                    .sum::<usize>()
                    + vectors
                        .into_iter()
                        .map(|b| b.as_ref().map_or(0, Vec::len) * 4)
                        .sum::<usize>()
            }
            Mixer::Linear { net, .. } => net.size_bytes(),
        };
        mixer + self.mlp.size_bytes() + self.norm_bytes()
    }

    /// Bytes of weights one token reads in this layer: all of them but the
    /// experts it is not routed to.
    fn bytes_per_token(&self) -> usize {
        match &self.mlp {
            Mlp::Dense { .. } => self.size_bytes(),
            Mlp::Experts(experts) => {
                self.size_bytes() - experts.size_bytes() + experts.bytes_per_token()
            }
        }
    }
}

/// A layer's MLP: dense SwiGLU, or a mixture of experts.
enum Mlp {
    Dense {
        w_gate: Matrix,
        w_up: Matrix,
        w_down: Matrix,
        /// Llama's `mlp_bias`: this rank's rows of the gate and up biases,
        /// and the whole down bias (added after the reduction).
        gate_bias: Option<Vec<f32>>,
        up_bias: Option<Vec<f32>>,
        down_bias: Option<Vec<f32>>,
    },
    Experts(Experts),
}

impl Mlp {
    fn size_bytes(&self) -> usize {
        match self {
            Self::Dense {
                w_gate,
                w_up,
                w_down,
                gate_bias,
                up_bias,
                down_bias,
            } => {
                w_gate.size_bytes()
                    + w_up.size_bytes()
                    + w_down.size_bytes()
                    + [gate_bias, up_bias, down_bias]
                        .iter()
                        .map(|b| b.as_ref().map_or(0, Vec::len) * 4)
                        .sum::<usize>()
            }
            Self::Experts(experts) => experts.size_bytes(),
        }
    }
}

/// One shard of a model: layers `layers` of `config.layers`, with the
/// embeddings when it is the first stage and the head when it is the last;
/// or, on a tensor-parallel rank, a slice of every layer. There `config`
/// holds this rank's share of the heads, KV heads and FFN rows.
pub struct Transformer {
    pub config: ModelConfig,
    pub layer_range: Range<usize>,
    embeddings: Option<Matrix>,
    layers: Vec<Layer>,
    final_norm: Option<Vec<f32>>,
    /// `None` with tied embeddings: the head is the embedding matrix.
    output: Option<Matrix>,
    rope_freq_factors: Option<Vec<f32>>,
    /// Set on a tensor-parallel rank.
    tensor: Option<TensorSlice>,
    /// Which query heads this shard has and which KV head each reads.
    heads: HeadLayout,
    /// Layers with keys and values (all but the linear-attention ones).
    kv_layers: usize,
    /// Floats of recurrent state a sequence needs across this shard's
    /// linear-attention layers (0 without any).
    state_len: usize,
    /// Set once the weights are on a GPU ([`Transformer::to_gpu`]): the
    /// forward passes run there.
    gpu: Option<gpu_weights::GpuModel>,
}

/// What a tensor-parallel rank owns beyond its slice of every layer: its
/// rows of the LM head, how the vocabulary is split for the gather, and
/// how every rank's slices make whole rows.
struct TensorSlice {
    /// Rows of the head (vocabulary entries) per rank, in rank order.
    vocab_counts: Vec<usize>,
    head: Matrix,
    layout: TensorLayout,
}

/// The rows an output projection reads: the attention's output or the
/// MLP's activations.
#[derive(Clone, Copy)]
enum Whole {
    Attention,
    Mlp,
}

impl Transformer {
    pub fn is_first_stage(&self) -> bool {
        self.layer_range.start == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.layer_range.end == self.config.layers
    }

    /// Layers this shard holds.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// A KV cache for this shard's layers.
    pub fn new_cache(&self) -> KvCache {
        KvCache::with_pool(self.new_pool())
    }

    /// An empty pool of keys and values for this shard's attention layers,
    /// and of recurrent state for its linear ones.
    pub fn new_pool(&self) -> KvPool {
        if let Some(model) = &self.gpu {
            return self.gpu_pool(model);
        }
        KvPool::new(self.kv_layers, self.config.kv_dim()).with_state(self.state_len)
    }

    /// Whether the model (any shard of it) keeps recurrent state, which
    /// cannot be shared between sequences, cut back or rewound.
    pub fn has_recurrent_state(&self) -> bool {
        self.config.has_recurrent_state()
    }

    /// Bytes of weights this shard holds.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Layer::size_bytes).sum();
        layers
            + self.embeddings.as_ref().map_or(0, Matrix::size_bytes)
            + self.output.as_ref().map_or(0, Matrix::size_bytes)
            + self.tensor.as_ref().map_or(0, |t| t.head.size_bytes())
    }

    /// Bytes of weights a decoded token reads in this shard: every layer's
    /// (only its experts for a mixture), the LM head where this shard has
    /// it, one row of the embeddings; not the KV cache, which at a
    /// benchmark's context is a fraction of a percent of a 1B+ model.
    pub fn decode_bytes_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(Layer::bytes_per_token).sum();
        let embedding_row = self
            .embeddings
            .as_ref()
            .map_or(0, |e| e.size_bytes() / self.config.vocab.max(1));
        let head = match &self.tensor {
            _ if !self.is_last_stage() => 0,
            Some(tensor) => tensor.head.size_bytes(),
            None => self.whole_head().map_or(0, Matrix::size_bytes),
        };
        layers + embedding_row + head
    }

    /// Whether this shard is one rank of a tensor-parallel group.
    pub fn is_tensor_parallel(&self) -> bool {
        self.tensor.is_some()
    }

    /// Runs `input` (tokens at positions `cache.len()..`) through this
    /// shard, appending to `cache`. The last stage returns the logits of the
    /// last token; other stages return hidden states.
    pub fn forward<'w>(
        &self,
        input: StageInput<'_>,
        cache: &mut KvCache,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        self.forward_in(input, cache, ws, pool, &mut SingleRank, true)
    }

    /// [`Transformer::forward`] as one rank of `group`: a tensor-parallel
    /// rank sums its partial attention and MLP outputs with the others, and
    /// rank 0 gathers the logits (the others return
    /// [`ForwardOutput::SentToFirst`]). Without `want_logits` (a prefill
    /// chunk before the last) the head is skipped and the hidden states are
    /// returned.
    pub fn forward_in<'w>(
        &self,
        input: StageInput<'_>,
        cache: &mut KvCache,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
        want_logits: bool,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let tokens = match &input {
            StageInput::Tokens(t) => t.len(),
            StageInput::Hidden(h) => h.len() / self.config.hidden,
        };
        let start = cache.len;
        cache.reserve(start + tokens);
        if start == 0 {
            cache.prompt = tokens;
        }
        let span = SeqSpan {
            start,
            len: tokens,
            table: &cache.table,
            prompt: cache.prompt,
            logits: usize::from(want_logits),
            state: 0,
        };
        let logits = RowOutput::Logits;
        let step = Pass {
            kv: &mut cache.pool,
            ws,
            pool,
            group,
        };
        let out = self.forward_batch(input, &[span], logits, step)?;
        cache.len = start + tokens;
        Ok(out)
    }

    /// One step over a batch of sequences: `input` holds every span's
    /// tokens (or hidden states) one after another. Each token attends to
    /// its own sequence's cache only, and each row of every product is
    /// computed alone, so a sequence's results do not depend on what else
    /// is in the batch. The last stage returns one row of logits per span
    /// that asks for them, in span order (or their best tokens, see
    /// [`RowOutput`]); other stages the hidden states of every token.
    pub fn forward_batch<'w>(
        &self,
        input: StageInput<'_>,
        spans: &[SeqSpan<'_>],
        output: RowOutput,
        step: Pass<'_, 'w>,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        if let Some(model) = &self.gpu {
            return self.forward_gpu(model, input, spans, output, step);
        }
        let Pass {
            kv,
            ws,
            pool,
            group,
        } = step;
        let hidden = self.config.hidden;
        let tokens = self.run_layers(input, spans, kv, ws, pool, group)?;
        let wanted: usize = spans.iter().map(|s| s.logits).sum();
        if !self.is_last_stage() || wanted == 0 {
            return Ok(ForwardOutput::Hidden(&ws.x[..tokens * hidden]));
        }
        self.final_norm_rows(spans, ws);
        // A whole model or a tensor rank (which has every layer) has the head.
        if self.is_first_stage() {
            return self.head(wanted, output, ws, pool, group);
        }
        Ok(ForwardOutput::Normed(&ws.normed[..wanted * hidden]))
    }

    /// The embedding and every layer of this shard over the step's input,
    /// leaving the hidden states in `ws.x`; returns the step's tokens.
    fn run_layers(
        &self,
        input: StageInput<'_>,
        spans: &[SeqSpan<'_>],
        kv: &mut KvPool,
        ws: &mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<usize, ForwardError> {
        let cfg = &self.config;
        let hidden = cfg.hidden;
        let tokens = match &input {
            StageInput::Tokens(t) => t.len(),
            StageInput::Hidden(h) => h.len() / hidden,
        };
        if tokens == 0 {
            return Err(ForwardError::Empty);
        }
        let context = self.check_spans(spans, tokens, kv)?;
        if kv.gpu_mut().is_some() {
            return Err(crate::gpu::GpuError::Unsupported(
                "the CPU's forward pass over a pool on the GPU".into(),
            )
            .into());
        }
        if self.state_len > 0 {
            for span in spans {
                kv.ensure_state_slot(span.state)
                    .map_err(|reason| ForwardError::StateSlot {
                        slot: span.state,
                        reason,
                    })?;
            }
        }
        ws.ensure(cfg, tokens, context, pool.threads());
        ws.index_tokens(spans);
        self.embed_input(input, tokens, ws)?;

        self.rope_angles(spans, tokens, ws);
        for layer in &self.layers {
            let mut step = Pass {
                kv: &mut *kv,
                ws: &mut *ws,
                pool,
                group: &mut *group,
            };
            self.layer_forward(layer, tokens, spans, &mut step)?;
        }
        Ok(tokens)
    }

    /// The final-normed hidden state of every token of `tokens`, computed
    /// from an empty `cache` (a whole model's last hidden state: what an
    /// embedding model pools). No head is applied.
    pub fn normed_states<'w>(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
    ) -> Result<&'w [f32], ForwardError> {
        if !self.is_first_stage() || !self.is_last_stage() || self.is_tensor_parallel() {
            return Err(ForwardError::NotLastStage);
        }
        cache.clear();
        cache.reserve(tokens.len());
        cache.prompt = tokens.len();
        let span = SeqSpan {
            start: 0,
            len: tokens.len(),
            table: &cache.table,
            prompt: tokens.len(),
            logits: tokens.len(),
            state: 0,
        };
        let spans = [span];
        let input = StageInput::Tokens(tokens);
        let count = self.run_layers(input, &spans, &mut cache.pool, ws, pool, &mut SingleRank)?;
        self.final_norm_rows(&spans, ws);
        Ok(&ws.normed[..count * self.config.hidden])
    }

    /// Each token's rotary angles (and the local ones of a family with two
    /// bases), scaled by the attention factor where the scaling has one.
    fn rope_angles(&self, spans: &[SeqSpan<'_>], tokens: usize, ws: &mut Workspace) {
        let cfg = &self.config;
        let pairs = cfg.rotary_dims / 2;
        let by_length = cfg.rope_depends_on_length();
        for t in 0..tokens {
            let position = ws.positions[t];
            // The sequence's length when this token was appended (a prompt
            // token: the whole prompt's).
            let length = if by_length {
                (position + 1).max(spans[ws.token_span[t] as usize].prompt)
            } else {
                position + 1
            };
            let factors = cfg
                .longrope_factors_at(length)
                .or(self.rope_freq_factors.as_deref());
            ops::rope_angles(
                position,
                cfg.rotary_dims,
                cfg.rope_base_at(length),
                cfg.rope_freq_scale(),
                factors,
                &mut ws.cos[t * pairs..(t + 1) * pairs],
                &mut ws.sin[t * pairs..(t + 1) * pairs],
            );
        }
        if let Some(theta) = cfg.variant.local_rope_theta {
            for t in 0..tokens {
                ops::rope_angles(
                    ws.positions[t],
                    cfg.rotary_dims,
                    theta,
                    1.0,
                    None,
                    &mut ws.cos_local[t * pairs..(t + 1) * pairs],
                    &mut ws.sin_local[t * pairs..(t + 1) * pairs],
                );
            }
        }
        let attention_factor = cfg.rope_attention_factor();
        if attention_factor != 1.0 {
            for v in ws.cos[..tokens * pairs]
                .iter_mut()
                .chain(&mut ws.sin[..tokens * pairs])
            {
                *v *= attention_factor;
            }
        }
    }

    /// Checks the spans against the input and the pool; returns the longest
    /// context any of them reaches.
    fn check_spans(
        &self,
        spans: &[SeqSpan<'_>],
        tokens: usize,
        kv: &KvPool,
    ) -> Result<usize, ForwardError> {
        let covered: usize = spans.iter().map(|s| s.len).sum();
        if covered != tokens || spans.iter().any(|s| s.len == 0 || s.logits > s.len) {
            return Err(ForwardError::SpanMismatch {
                tokens,
                spans: covered,
            });
        }
        let mut context = 0;
        for span in spans {
            let end = span.start + span.len;
            if end > self.config.context_length {
                return Err(ForwardError::ContextOverflow {
                    position: end,
                    context: self.config.context_length,
                });
            }
            let blocks = blocks_for(end);
            if span.table.len() < blocks
                || span.table[..blocks]
                    .iter()
                    .any(|&b| b as usize >= kv.blocks())
            {
                return Err(ForwardError::BlockTable {
                    positions: end,
                    blocks: span.table.len(),
                    pool: kv.blocks(),
                });
            }
            context = context.max(end);
        }
        Ok(context)
    }

    /// Fills `ws.x` with the input's embeddings or hidden states.
    fn embed_input(
        &self,
        input: StageInput<'_>,
        tokens: usize,
        ws: &mut Workspace,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let hidden = cfg.hidden;
        let x = &mut ws.x[..tokens * hidden];
        match input {
            StageInput::Tokens(ids) => {
                let embeddings = self
                    .embeddings
                    .as_ref()
                    .filter(|_| self.is_first_stage())
                    .ok_or(ForwardError::NotFirstStage)?;
                for (row, &id) in x.chunks_exact_mut(hidden).zip(ids) {
                    if id as usize >= cfg.vocab {
                        return Err(ForwardError::TokenOutOfRange {
                            token: id,
                            vocab: cfg.vocab,
                        });
                    }
                    embed_row(embeddings, id as usize, row)?;
                }
                if let Some(scale) = cfg.variant.embedding_scale {
                    x.iter_mut().for_each(|v| *v *= scale);
                }
            }
            StageInput::Hidden(h) => {
                if h.len() != tokens * hidden {
                    return Err(ForwardError::HiddenShape {
                        expected: tokens * hidden,
                        actual: h.len(),
                    });
                }
                x.copy_from_slice(h);
            }
        }
        Ok(())
    }
}

fn embed_row(embeddings: &Matrix, id: usize, out: &mut [f32]) -> Result<(), ForwardError> {
    match embeddings {
        Matrix::Native(m) => {
            m.dequantize_row(id, out);
            Ok(())
        }
        Matrix::Candle { inner, .. } => {
            let row = inner
                .dequantize_f16()
                .and_then(|t| t.narrow(0, id, 1))
                .and_then(|t| t.to_dtype(candle_core::DType::F32))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())?;
            out.copy_from_slice(&row);
            Ok(())
        }
    }
}
