//! The decoder every architecture shares: embeddings, then per layer
//! `x += attn(norm(x))`, `x += mlp(norm(x))`, then the final norm and the
//! LM head. A [`Transformer`] holds one shard's layers; a pipeline stage
//! takes hidden states in and hands hidden states on.

use std::ops::Range;

use half::f16;

use super::attention::{self, Scoring};
use super::config::{Activation, LayerRope, ModelConfig};
use super::deltanet::{GatedDeltaNet, LinearSplit, LinearWorkspace};
use super::gather::{grown, project, ColumnSplit, GatherBuffers};
use super::moe::{ExpertSplits, Experts, MoeWorkspace};
use super::weights::{LoadError, Matrix, TensorSource};
use crate::collectives::{CollectiveError, Group, SingleRank};
use crate::ops;
use crate::paged::{blocks_for, BlockId, KvPool};
use crate::quant::{Activations, OutLayout};
use crate::sampler::BestToken;
use crate::shard::{split_evenly, ShardError, ShardSpec};
use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

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
}

/// What a stage consumes.
pub enum StageInput<'a> {
    Tokens(&'a [u32]),
    /// Hidden states from the previous stage, `tokens x hidden`.
    Hidden(&'a [f32]),
}

/// What a stage produces (borrowed from the [`Workspace`]).
pub enum ForwardOutput<'a> {
    /// Logits of the last token (the last stage).
    Logits(&'a [f32]),
    /// Hidden states of all tokens, for the next stage.
    Hidden(&'a [f32]),
    /// The last stage of a pipeline of several: the rows that want logits,
    /// after the final norm, for the first stage, which holds the head
    /// ([`Transformer::head_of_normed`]). A row of hidden states is
    /// vocab/hidden times smaller than its logits (85 times for
    /// SmolLM2-135M), and the first stage has the tied embeddings anyway.
    Normed(&'a [f32]),
    /// Rank 0 of a tensor group asked for [`RowOutput::BestTokens`]: one
    /// per row that wants logits.
    Best(&'a [BestToken]),
    /// A tensor rank other than 0: its share of the logits (or of the best
    /// tokens) went to rank 0, the only rank that samples.
    SentToFirst,
}

/// What the head gives for each row that wants logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowOutput {
    /// The whole vocabulary's logits.
    #[default]
    Logits,
    /// Only the row's [`BestToken`], all that greedy sampling needs: a
    /// tensor rank then sends rank 0 12 bytes per row, not its share of
    /// the vocabulary. Where the logits are whole on one rank anyway they
    /// come back whole, and the caller takes their best.
    BestTokens,
}

/// One sequence's keys and values, for callers that run one sequence at a
/// time (tests, reference comparisons): a private [`KvPool`] whose blocks
/// are the sequence's table in order.
pub struct KvCache {
    pool: KvPool,
    table: Vec<BlockId>,
    len: usize,
    /// Positions the first forward from empty appended: the prompt.
    prompt: usize,
}

impl KvCache {
    /// A cache over `pool` (see [`Transformer::new_pool`]).
    pub fn with_pool(pool: KvPool) -> Self {
        Self {
            pool,
            table: Vec::new(),
            len: 0,
            prompt: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops everything (a new conversation).
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `len` positions (a shared prompt prefix). A hybrid
    /// model's recurrent state cannot be rewound: it keeps nothing then,
    /// and the prefix is computed again.
    pub fn truncate(&mut self, len: usize) {
        self.len = if len < self.len && self.pool.state_len() > 0 {
            0
        } else {
            len.min(self.len)
        };
    }

    /// Reserves room for `positions` in total, so decoding never reallocates.
    pub fn reserve(&mut self, positions: usize) {
        let blocks = blocks_for(positions);
        self.pool.ensure_blocks(blocks);
        while self.table.len() < blocks {
            self.table.push(self.table.len() as BlockId);
        }
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.pool.size_bytes()
    }
}

/// One sequence's share of a batched step: its tokens are the next `len`
/// of the step's input, at positions `start..start + len`, their keys and
/// values go to (and attention reads) the blocks of `table`.
#[derive(Clone, Copy, Debug)]
pub struct SeqSpan<'a> {
    pub start: usize,
    pub len: usize,
    pub table: &'a [BlockId],
    /// Tokens in the sequence's prompt: dynamic RoPE rotates each prompt
    /// token with the base for the whole prompt's length.
    pub prompt: usize,
    /// Rows of logits the step returns for the span's last tokens: 0, 1
    /// (the next token), or more (a speculative step checks each draft).
    pub logits: usize,
    /// The sequence's slot of recurrent state (hybrid models; a span that
    /// starts at position 0 resets it). Distinct for the spans of a step.
    pub state: usize,
}

/// Scratch buffers of the forward pass, sized once for the largest batch so
/// that decoding allocates nothing.
#[derive(Default)]
pub struct Workspace {
    capacity: usize,
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Gated attention: each head's q and gate as q_proj gives them, and
    /// the gates.
    q_gated: Vec<f32>,
    attn_gate: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    logits: Vec<f32>,
    local_logits: Vec<f32>,
    scores: Vec<f32>,
    scores_stride: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The windowed layers' angles where they have a RoPE base of their own.
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
    /// Each token's sums of squares of q and of k (norms across heads).
    qk_sums: Vec<f32>,
    /// Each token's position in its sequence, and its span's index.
    positions: Vec<usize>,
    token_span: Vec<u32>,
    /// A tensor rank's gathered logits, before they are put in order (or
    /// its ranks' best tokens, as words).
    gathered: Vec<f32>,
    /// A tensor rank's best tokens, as words, to send; and rank 0's
    /// combined ones.
    local_best: Vec<f32>,
    best: Vec<BestToken>,
    acts: Activations,
    /// The mixture-of-experts block's buffers (empty for dense models).
    moe: MoeWorkspace,
    /// The linear-attention layers' buffers (hybrid models).
    linear: LinearWorkspace,
    /// A tensor rank's whole rows and its part of the output rows.
    gathers: GatherBuffers,
}

impl Workspace {
    fn ensure(&mut self, config: &ModelConfig, tokens: usize, context: usize, threads: usize) {
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

    fn index_tokens(&mut self, spans: &[SeqSpan<'_>]) {
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

/// An error in the forward pass (bad input, or a candle fallback failing).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("expected {expected} hidden values, got {actual}")]
    HiddenShape { expected: usize, actual: usize },
    #[error("this stage has no embeddings: it takes hidden states")]
    NotFirstStage,
    #[error("this stage has no LM head: it hands hidden states on")]
    NotLastStage,
    #[error("expected rows of {hidden} normed values, got {values} values")]
    NormedShape { hidden: usize, values: usize },
    #[error("position {position} is beyond the context length {context}")]
    ContextOverflow { position: usize, context: usize },
    #[error("empty input")]
    Empty,
    #[error("the batch's spans cover {spans} tokens, the input has {tokens} (or a span is empty)")]
    SpanMismatch { tokens: usize, spans: usize },
    #[error("a block table of {blocks} blocks cannot hold {positions} positions in a pool of {pool} blocks")]
    BlockTable {
        positions: usize,
        blocks: usize,
        pool: usize,
    },
    #[error("quantized matmul: {0}")]
    Kernel(#[from] candle_core::Error),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("this shard was split for {expected} ranks but runs in a group of {actual}")]
    GroupSize { expected: usize, actual: usize },
    #[error("recurrent-state slot {slot}: {reason}")]
    StateSlot { slot: usize, reason: &'static str },
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

/// Every rank's columns of the rows the ranks gather whole (see
/// [`super::gather`]): the attention's output (query heads), the MLP's
/// intermediate rows, the hidden rows each rank computes of the output
/// projections; and q and k where they are normed across all heads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub attention: ColumnSplit,
    pub ffn: ColumnSplit,
    pub hidden: ColumnSplit,
    pub experts: ColumnSplit,
    pub shared_expert: ColumnSplit,
    /// Each rank's value heads of the linear-attention layers (in the
    /// file's order of value heads, one value head wide each).
    pub linear_values: ColumnSplit,
    /// q and k normed across all heads (OLMo 2): every rank's KV heads,
    /// whole groups (no KV head on two ranks).
    pub keys: Option<ColumnSplit>,
}

impl TensorLayout {
    /// The layout of `world` ranks, each rank's [`TensorSplit`] put
    /// together.
    pub fn new(
        config: &ModelConfig,
        world: u32,
        ffn_unit: usize,
        expert_unit: usize,
    ) -> Result<Self, ShardError> {
        let splits = (0..world)
            .map(|rank| TensorSplit::new(config, rank, world, ffn_unit, expert_unit))
            .collect::<Result<Vec<_>, _>>()?;
        let of = |part: fn(&TensorSplit) -> Range<usize>| {
            let parts: Vec<Range<usize>> = splits.iter().map(part).collect();
            ColumnSplit::contiguous(&parts, 1)
        };
        let linear_values = match &config.variant.linear {
            Some(linear) => ColumnSplit::from_runs(
                splits
                    .iter()
                    .map(|s| {
                        LinearSplit::for_key_heads(linear, s.linear_keys.clone())
                            .runs()
                            .into_iter()
                            .map(|r| r.start * linear.value_dim..r.end * linear.value_dim)
                            .collect()
                    })
                    .collect(),
            ),
            None => of(|_| 0..0),
        };
        Ok(Self {
            attention: of(|s| s.q_rows.clone()),
            ffn: of(|s| s.ffn_rows.clone()),
            hidden: of(|s| s.hidden_rows.clone()),
            experts: of(|s| s.expert_rows.clone()),
            shared_expert: of(|s| s.shared_rows.clone()),
            linear_values,
            keys: (config.variant.qk_norm_whole && config.qk_norm)
                .then(|| of(|s| s.kv_rows.clone())),
        })
    }
}

/// The rows a tensor-parallel rank owns of each split dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSplit {
    pub q_rows: Range<usize>,
    pub kv_rows: Range<usize>,
    pub ffn_rows: Range<usize>,
    /// Rows of every expert (mixture-of-experts models; else empty).
    pub expert_rows: Range<usize>,
    /// Rows of the shared expert (else empty).
    pub shared_rows: Range<usize>,
    /// Key heads of the linear-attention layers, each with its value heads
    /// (hybrid models; else empty).
    pub linear_keys: Range<usize>,
    pub vocab_rows: Range<usize>,
    pub vocab_counts: Vec<usize>,
    /// Rows of the output projections (attention's, the MLP's down, the
    /// experts' downs) this rank computes, over whole input rows.
    pub hidden_rows: Range<usize>,
}

/// This rank's intermediate rows of an MLP of `ffn` rows: in units of
/// `unit` (the down projection's quantization block, so that its column
/// slices keep their blocks) where there are enough of them, else of the
/// 32-value block, else single rows.
fn ffn_share(ffn: usize, unit: usize, rank: u32, world: u32) -> Result<Range<usize>, ShardError> {
    let unit = if unit > 1 && ffn.is_multiple_of(unit) && ffn / unit >= world as usize {
        unit
    } else if ffn.is_multiple_of(crate::quant::BLOCK) {
        crate::quant::BLOCK
    } else {
        1
    };
    // Even, not balancing the attention's uneven KV groups: each block
    // ends in gathers, a barrier, so the MLP's own split must be
    // even for its phase to be (balancing the totals made each rank wait
    // for the other in turn).
    let parts = split_evenly((ffn / unit) as u32, world as usize, "FFN blocks")?;
    let part = &parts[rank as usize];
    Ok(part.start as usize * unit..part.end as usize * unit)
}

impl TensorSplit {
    /// Attention by query heads, as evenly as they go, each rank with the
    /// KV heads its query heads read (see [`attention_share`]); the MLP
    /// (and every expert) by intermediate rows (see [`ffn_share`]), the
    /// head by vocabulary rows. Uneven splits are allowed.
    pub fn new(
        config: &ModelConfig,
        rank: u32,
        world: u32,
        ffn_unit: usize,
        expert_unit: usize,
    ) -> Result<Self, ShardError> {
        let spec = ShardSpec::Tensor {
            rank,
            world_size: world,
        };
        let (q_heads, kv_heads) = attention_share(config, &spec, rank, world)?;
        let hd = config.head_dim;
        let expert_rows = match &config.moe {
            Some(moe) => ffn_share(moe.expert_ffn, expert_unit, rank, world)?,
            None => 0..0,
        };
        let shared_rows = match config.moe.as_ref().and_then(|m| m.shared_ffn) {
            Some(rows) => ffn_share(rows, expert_unit, rank, world)?,
            None => 0..0,
        };
        let linear_keys = match &config.variant.linear {
            Some(linear) => {
                let parts = split_evenly(
                    linear.key_heads as u32,
                    world as usize,
                    "linear-attention key heads",
                )?;
                let part = &parts[rank as usize];
                part.start as usize..part.end as usize
            }
            None => 0..0,
        };
        let vocab_parts = split_evenly(config.vocab as u32, world as usize, "vocabulary rows")?;
        let vocab = &vocab_parts[rank as usize];
        let hidden_parts = split_evenly(config.hidden as u32, world as usize, "hidden rows")?;
        let hidden = &hidden_parts[rank as usize];
        Ok(Self {
            q_rows: q_heads.start * hd..q_heads.end * hd,
            kv_rows: kv_heads.start * hd..kv_heads.end * hd,
            // No dense layers at all (every layer runs experts): nothing to split.
            ffn_rows: match config.ffn {
                0 => 0..0,
                ffn => ffn_share(ffn, ffn_unit, rank, world)?,
            },
            expert_rows,
            shared_rows,
            linear_keys,
            vocab_rows: vocab.start as usize..vocab.end as usize,
            vocab_counts: vocab_parts.iter().map(|r| r.len()).collect(),
            hidden_rows: hidden.start as usize..hidden.end as usize,
        })
    }
}

/// A tensor rank's query heads and KV heads. Whole KV-head groups when
/// the ranks divide them evenly (or the q and k norms span all heads,
/// whose sums must count each KV head once); else query heads as evenly
/// as they go, a KV head whose group straddles two ranks computed and
/// cached on both. Attention is then balanced: with 3 KV heads of 3 query
/// heads on 2 ranks, 5 and 4 query heads rather than 6 and 3 (the whole
/// groups' split made one rank's attention twice the other's, and the
/// other wait at every layer's gathers).
fn attention_share(
    config: &ModelConfig,
    spec: &ShardSpec,
    rank: u32,
    world: u32,
) -> Result<(Range<usize>, Range<usize>), ShardError> {
    // Also the check that there are enough KV heads for the world.
    let groups = spec.kv_head_groups(config.kv_heads as u32)?;
    let per_group = config.heads / config.kv_heads;
    let (g0, g1) = (groups.start as usize, groups.end as usize);
    if config.kv_heads.is_multiple_of(world as usize) || config.variant.qk_norm_whole {
        return Ok((g0 * per_group..g1 * per_group, g0..g1));
    }
    let parts = split_evenly(config.heads as u32, world as usize, "query heads")?;
    let part = &parts[rank as usize];
    let q = part.start as usize..part.end as usize;
    let kv = q.start / per_group..q.end.div_ceil(per_group);
    Ok((q, kv))
}

/// Which query heads a shard has, and so which of its KV heads each one
/// reads: query head `q_first + h` (global numbering) reads global KV head
/// `(q_first + h) / group`, the shard's `- kv_first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HeadLayout {
    pub group: usize,
    pub q_first: usize,
    pub kv_first: usize,
}

impl HeadLayout {
    /// The shard's query heads (its own numbering) that read its KV head
    /// `kv`.
    pub fn heads_of(&self, kv: usize, heads: usize) -> Range<usize> {
        let global = (self.kv_first + kv) * self.group..(self.kv_first + kv + 1) * self.group;
        let start = global.start.max(self.q_first).min(self.q_first + heads);
        let end = global.end.clamp(start, self.q_first + heads);
        start - self.q_first..end - self.q_first
    }
}

impl Transformer {
    /// Loads layers `layers` (and embeddings/head as the stage needs).
    pub fn load(
        source: &dyn TensorSource,
        config: ModelConfig,
        layers: Range<usize>,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let spec = ShardSpec::Pipeline {
            start_layer: layers.start as u32,
            end_layer: layers.end as u32,
            n_layers: config.layers as u32,
        };
        Self::load_shard(source, config, &spec, progress)
    }

    /// Loads the part of the model `spec` names, reading only its tensors
    /// (and, for tensor parallelism, only its rows or columns of them).
    pub fn load_shard(
        source: &dyn TensorSource,
        config: ModelConfig,
        spec: &ShardSpec,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let shard_error = |e: ShardError| LoadError::Tensor {
            path: source.path().to_string(),
            tensor: "(shard)".into(),
            reason: e.to_string(),
        };
        spec.validate(config.layers as u32).map_err(shard_error)?;
        let range = spec.layers(config.layers as u32);
        let layers = range.start as usize..range.end as usize;
        let first = layers.start == 0;
        let last = layers.end == config.layers;
        let total = layers.len() + 2;
        let (h, q, kv, f) = (config.hidden, config.q_dim(), config.kv_dim(), config.ffn);
        let split = match *spec {
            ShardSpec::Tensor { rank, world_size } => Some(
                TensorSplit::new(
                    &config,
                    rank,
                    world_size,
                    source.column_block("blk.0.ffn_down.weight"),
                    source.column_block("blk.0.ffn_down.0.weight"),
                )
                .map_err(shard_error)?,
            ),
            ShardSpec::Pipeline { .. } => None,
        };
        let layout = match *spec {
            ShardSpec::Tensor { world_size, .. } => Some(
                TensorLayout::new(
                    &config,
                    world_size,
                    source.column_block("blk.0.ffn_down.weight"),
                    source.column_block("blk.0.ffn_down.0.weight"),
                )
                .map_err(shard_error)?,
            ),
            ShardSpec::Pipeline { .. } => None,
        };
        let rows = ShardRows {
            q: split.as_ref().map_or(0..q, |s| s.q_rows.clone()),
            kv: split.as_ref().map_or(0..kv, |s| s.kv_rows.clone()),
            ffn: split.as_ref().map_or(0..f, |s| s.ffn_rows.clone()),
            expert: match (&split, &config.moe) {
                (Some(s), _) => s.expert_rows.clone(),
                (None, Some(moe)) => 0..moe.expert_ffn,
                (None, None) => 0..0,
            },
            shared: match (&split, config.moe.as_ref().and_then(|m| m.shared_ffn)) {
                (Some(s), _) => s.shared_rows.clone(),
                (None, Some(rows)) => 0..rows,
                (None, None) => 0..0,
            },
            hidden: split.as_ref().map(|s| s.hidden_rows.clone()),
        };
        let part = |name: &str,
                    shape: [usize; 2],
                    rows: Option<Range<usize>>,
                    cols: Option<Range<usize>>|
         -> Result<Matrix, LoadError> {
            load_part(source, name, shape, rows, cols)
        };
        let vector = |name: &str, len: usize| load_vector(source, name, len);
        // A pipeline's first stage runs the head too: tied, it is the
        // embeddings (see `ForwardOutput::Normed`).
        let embeddings = if first {
            Some(part("token_embd.weight", [config.vocab, h], None, None)?)
        } else {
            None
        };
        progress(1, total);
        let mut loaded = Vec::with_capacity(layers.len());
        let mut kv_layers = 0;
        let mut state_len = 0;
        for i in layers.clone() {
            let n = |part: &str| format!("blk.{i}.{part}");
            let mixer = match config.variant.linear.as_ref().filter(|l| l.is_linear(i)) {
                Some(linear) => {
                    let heads = match &split {
                        Some(s) => LinearSplit::for_key_heads(linear, s.linear_keys.clone()),
                        None => LinearSplit::whole(linear),
                    };
                    let eps = config.norm_eps;
                    let hidden_rows = rows.hidden.clone();
                    let net = GatedDeltaNet::load(source, i, linear, h, eps, &heads, hidden_rows)?;
                    let state_offset = state_len;
                    state_len += net.state_len();
                    Mixer::Linear { net, state_offset }
                }
                None => {
                    kv_layers += 1;
                    Mixer::Attention(load_attention(source, &config, i, kv_layers - 1, &rows)?)
                }
            };
            let (pre, post) = (!config.variant.no_pre_norms, config.variant.post_norms);
            // The hybrid families' GGUFs name the norm before the MLP as
            // Hugging Face does.
            let ffn_norm = if config.variant.linear.is_some() {
                "post_attention_norm.weight"
            } else {
                "ffn_norm.weight"
            };
            loaded.push(Layer {
                attn_norm: optional(source, &n("attn_norm.weight"), h, pre)?,
                attn_post_norm: optional(source, &n("post_attention_norm.weight"), h, post)?,
                ffn_post_norm: optional(source, &n("post_ffw_norm.weight"), h, post)?,
                ffn_norm: optional(source, &n(ffn_norm), h, pre)?,
                mixer,
                mlp: load_mlp(source, &config, i, &rows)?,
            });
            progress(2 + i - layers.start, total);
        }
        let head_name = if config.tied_embeddings {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let (final_norm, output, tensor) = match (split.as_ref().zip(layout), last) {
            (Some((split, layout)), _) => (
                Some(vector("output_norm.weight", h)?),
                None,
                Some(TensorSlice {
                    layout,
                    vocab_counts: split.vocab_counts.clone(),
                    head: part(
                        head_name,
                        [config.vocab, h],
                        Some(split.vocab_rows.clone()),
                        None,
                    )?,
                }),
            ),
            (None, _) => {
                let norm = if last {
                    Some(vector("output_norm.weight", h)?)
                } else {
                    None
                };
                let output = if first && !config.tied_embeddings {
                    Some(part("output.weight", [config.vocab, h], None, None)?)
                } else {
                    None
                };
                (norm, output, None)
            }
        };
        progress(total, total);
        let rope_freq_factors = match source.shape("rope_freqs.weight") {
            Some(_) => Some(source.vector("rope_freqs.weight")?),
            None => config.rope_freq_factors(),
        };
        let mut config = config;
        let heads = HeadLayout {
            group: config.heads / config.kv_heads.max(1),
            q_first: split
                .as_ref()
                .map_or(0, |s| s.q_rows.start / config.head_dim),
            kv_first: split
                .as_ref()
                .map_or(0, |s| s.kv_rows.start / config.head_dim),
        };
        if let Some(split) = &split {
            config.heads = split.q_rows.len() / config.head_dim;
            config.kv_heads = split.kv_rows.len() / config.head_dim;
            config.ffn = split.ffn_rows.len();
            if let Some(moe) = &mut config.moe {
                moe.expert_ffn = split.expert_rows.len();
                moe.shared_ffn = moe.shared_ffn.map(|_| split.shared_rows.len());
            }
        }
        Ok(Self {
            config,
            layer_range: layers,
            embeddings,
            kv_layers,
            state_len,
            layers: loaded,
            final_norm,
            output,
            rope_freq_factors,
            tensor,
            heads,
        })
    }

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
        let out = self.forward_batch(input, &[span], logits, &mut cache.pool, ws, pool, group)?;
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
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch<'w>(
        &self,
        input: StageInput<'_>,
        spans: &[SeqSpan<'_>],
        output: RowOutput,
        kv: &mut KvPool,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
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
        for layer in &self.layers {
            self.layer_forward(layer, tokens, spans, kv, ws, pool, group)?;
        }
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

    /// The first stage of a pipeline of several: the logits of rows the
    /// last stage sent ([`ForwardOutput::Normed`]), one row of `vocab` per
    /// row of `normed`.
    pub fn head_of_normed<'w>(
        &self,
        normed: &[f32],
        ws: &'w mut Workspace,
        pool: &ThreadPool,
    ) -> Result<&'w [f32], ForwardError> {
        let (hidden, vocab) = (self.config.hidden, self.config.vocab);
        if normed.is_empty() || !normed.len().is_multiple_of(hidden) {
            return Err(ForwardError::NormedShape {
                hidden,
                values: normed.len(),
            });
        }
        let wanted = normed.len() / hidden;
        let head = self.whole_head()?;
        ws.acts.set(normed, wanted, hidden);
        if ws.logits.len() < wanted * vocab {
            ws.logits.resize(wanted * vocab, 0.0);
        }
        head.matmul(&mut ws.acts, wanted, normed, &mut ws.logits, pool)?;
        cap_logits(
            &mut ws.logits[..wanted * vocab],
            self.config.variant.final_softcap,
        );
        Ok(&ws.logits[..wanted * vocab])
    }

    /// The untied output matrix, or the embeddings it is tied to (a whole
    /// model or a pipeline's first stage).
    fn whole_head(&self) -> Result<&Matrix, ForwardError> {
        self.output
            .as_ref()
            .or(self.embeddings.as_ref())
            .ok_or(ForwardError::NotLastStage)
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

    /// The final norm over the last `logits` tokens of each span, into
    /// the first rows of `ws.normed`.
    fn final_norm_rows(&self, spans: &[SeqSpan<'_>], ws: &mut Workspace) {
        let cfg = &self.config;
        let hidden = cfg.hidden;
        let norm = self.final_norm.as_deref().unwrap_or(&[]);
        let mut row = 0;
        let mut end = 0;
        for span in spans {
            end += span.len;
            for at in end - span.logits..end {
                let x = &ws.x[at * hidden..(at + 1) * hidden];
                let out = &mut ws.normed[row * hidden..(row + 1) * hidden];
                ops::rms_norm(x, norm, cfg.norm_eps, out);
                row += 1;
            }
        }
    }

    /// The LM head over the `wanted` rows [`Transformer::final_norm_rows`]
    /// left: `wanted` rows of `vocab`.
    fn head<'w>(
        &self,
        wanted: usize,
        output: RowOutput,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let cfg = &self.config;
        let (hidden, vocab) = (cfg.hidden, cfg.vocab);
        let normed = &ws.normed[..wanted * hidden];
        ws.acts.set(normed, wanted, hidden);
        if ws.logits.len() < wanted * vocab {
            ws.logits.resize(wanted * vocab, 0.0);
        }
        let Some(slice) = &self.tensor else {
            let head = self.whole_head()?;
            head.matmul(&mut ws.acts, wanted, normed, &mut ws.logits, pool)?;
            cap_logits(&mut ws.logits[..wanted * vocab], cfg.variant.final_softcap);
            return Ok(ForwardOutput::Logits(&ws.logits[..wanted * vocab]));
        };
        // Each rank computes its rows of the vocabulary; rank 0 gathers.
        if slice.vocab_counts.len() != group.size() {
            return Err(ForwardError::GroupSize {
                expected: slice.vocab_counts.len(),
                actual: group.size(),
            });
        }
        if output == RowOutput::BestTokens {
            return Self::tensor_best_tokens(slice, cfg, wanted, ws, pool, group);
        }
        // Rank 0's rows of the vocabulary come first: it writes its logits
        // straight into place, the others theirs into one block each.
        let local = slice.head.rows();
        if group.rank() == 0 {
            let layout = OutLayout {
                stride: vocab,
                offset: 0,
            };
            let logits = &mut ws.logits[..wanted * vocab];
            slice
                .head
                .matmul_region(&mut ws.acts, normed, 0..wanted, logits, layout, pool)?;
            ws.local_logits.clear();
        } else {
            ws.local_logits.resize(wanted * local, 0.0);
            slice
                .head
                .matmul(&mut ws.acts, wanted, normed, &mut ws.local_logits, pool)?;
        }
        // One gather for all rows: rank r's block is its rows of every
        // sequence, which are then put in vocabulary order per sequence.
        let mut counts: Vec<usize> = slice.vocab_counts.iter().map(|c| c * wanted).collect();
        counts[0] = 0;
        ws.gathered.resize(counts.iter().sum(), 0.0);
        group.gather_to_first(&ws.local_logits, &counts, &mut ws.gathered)?;
        if group.rank() != 0 {
            return Ok(ForwardOutput::SentToFirst);
        }
        let mut at = 0;
        let mut column = slice.vocab_counts[0];
        for &count in &slice.vocab_counts[1..] {
            for r in 0..wanted {
                let from = &ws.gathered[at + r * count..at + (r + 1) * count];
                ws.logits[r * vocab + column..r * vocab + column + count].copy_from_slice(from);
            }
            at += count * wanted;
            column += count;
        }
        cap_logits(&mut ws.logits[..wanted * vocab], cfg.variant.final_softcap);
        Ok(ForwardOutput::Logits(&ws.logits[..wanted * vocab]))
    }

    /// A tensor rank's head for [`RowOutput::BestTokens`]: each rank takes
    /// the best of its rows of the vocabulary for every row, and rank 0
    /// combines them (the softcap, elementwise, is applied first on each
    /// rank as it would be on the whole row).
    fn tensor_best_tokens<'w>(
        slice: &TensorSlice,
        cfg: &ModelConfig,
        wanted: usize,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let (rank, size) = (group.rank(), group.size());
        let local = slice.head.rows();
        let normed = &ws.normed[..wanted * cfg.hidden];
        ws.local_logits.resize(wanted * local, 0.0);
        slice
            .head
            .matmul(&mut ws.acts, wanted, normed, &mut ws.local_logits, pool)?;
        cap_logits(&mut ws.local_logits, cfg.variant.final_softcap);
        let first_id: usize = slice.vocab_counts[..rank].iter().sum();
        let words = BestToken::WORDS;
        let block = wanted * words;
        ws.local_best.resize(block, 0.0);
        let rows = ws.local_logits.chunks_exact(local);
        for (row, out) in rows.zip(ws.local_best.chunks_exact_mut(words)) {
            out.copy_from_slice(&BestToken::of(row, first_id as u32).to_words());
        }
        // Rank 0 keeps its own; the others' come in rank order.
        let mut counts = vec![block; size];
        counts[0] = 0;
        let sent = if rank == 0 {
            &[][..]
        } else {
            &ws.local_best[..]
        };
        ws.gathered.resize((size - 1) * block, 0.0);
        group.gather_to_first(sent, &counts, &mut ws.gathered)?;
        if rank != 0 {
            return Ok(ForwardOutput::SentToFirst);
        }
        ws.best.clear();
        for row in 0..wanted {
            let at = row * words;
            let of_rank = |r: usize| {
                let words = match r {
                    0 => &ws.local_best[at..at + words],
                    r => &ws.gathered[(r - 1) * block + at..][..words],
                };
                BestToken::from_words([words[0], words[1], words[2]])
            };
            ws.best.extend(BestToken::combine((0..size).map(of_rank)));
        }
        if let Some(bad) = ws.best.iter().find(|b| b.token as usize >= cfg.vocab) {
            let message = format!(
                "a best token {} of a vocabulary of {}",
                bad.token, cfg.vocab
            );
            return Err(CollectiveError::Invalid(message).into());
        }
        Ok(ForwardOutput::Best(&ws.best))
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        layer: &Layer,
        tokens: usize,
        spans: &[SeqSpan<'_>],
        kv: &mut KvPool,
        ws: &mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let h = cfg.hidden;
        let n = tokens;

        // Attention (or linear attention) block.
        pre_norm(
            &ws.x[..n * h],
            layer.attn_norm.as_deref(),
            cfg.norm_eps,
            &mut ws.normed[..n * h],
        );
        let o_bias = match &layer.mixer {
            Mixer::Attention(attn) => {
                self.attention_block(attn, n, spans, kv, ws, pool, group)?;
                attn.o_bias.as_deref()
            }
            Mixer::Linear { net, state_offset } => {
                net.forward(
                    n,
                    h,
                    spans,
                    kv,
                    *state_offset,
                    &ws.normed[..n * h],
                    &mut ws.proj[..n * h],
                    &mut ws.linear,
                    pool,
                    self.tensor
                        .as_ref()
                        .map(|t| (&t.layout.linear_values, &t.layout.hidden)),
                    group,
                )?;
                None
            }
        };
        self.add_block_output(n, o_bias, layer.attn_post_norm.as_deref(), ws)?;

        // MLP block.
        pre_norm(
            &ws.x[..n * h],
            layer.ffn_norm.as_deref(),
            cfg.norm_eps,
            &mut ws.normed[..n * h],
        );
        let down_bias = match &layer.mlp {
            Mlp::Dense {
                w_gate,
                w_up,
                w_down,
                gate_bias,
                up_bias,
                down_bias,
            } => {
                let biases = [gate_bias.as_deref(), up_bias.as_deref()];
                let activation = cfg.variant.activation;
                let f = cfg.ffn;
                dense_activations([w_gate, w_up], biases, activation, f, n, h, ws, pool)?;
                self.project_whole(w_down, Whole::Mlp, n, ws, pool, group)?;
                down_bias.as_deref()
            }
            Mlp::Experts(experts) => {
                let normed = &ws.normed[..n * h];
                let out = &mut ws.proj[..n * h];
                let splits = self.tensor.as_ref().map(|t| ExpertSplits {
                    experts: &t.layout.experts,
                    shared: &t.layout.shared_expert,
                    hidden: &t.layout.hidden,
                });
                experts.forward(n, h, normed, out, &mut ws.moe, pool, splits, group)?;
                None
            }
        };
        self.add_block_output(n, down_bias, layer.ffn_post_norm.as_deref(), ws)
    }

    /// The end of a block: the bias, the post-norm, then the residual add
    /// of `ws.proj` (whole rows, on a tensor rank too) into `ws.x`.
    fn add_block_output(
        &self,
        n: usize,
        bias: Option<&[f32]>,
        post_norm: Option<&[f32]>,
        ws: &mut Workspace,
    ) -> Result<(), ForwardError> {
        let h = self.config.hidden;
        add_bias(&mut ws.proj[..n * h], bias);
        if let Some(norm) = post_norm {
            ops::rms_norm_in_place(&mut ws.proj[..n * h], norm, self.config.norm_eps);
        }
        ops::add_in_place(&mut ws.x[..n * h], &ws.proj[..n * h]);
        Ok(())
    }

    /// Attention over `ws.normed` into `ws.proj`, before o_proj's bias and
    /// the reduction.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        attn: &Attention,
        n: usize,
        spans: &[SeqSpan<'_>],
        kv: &mut KvPool,
        ws: &mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        ws.acts.set(&ws.normed[..n * h], n, h);
        let q_out = if attn.output_gate {
            &mut ws.q_gated[..2 * n * qd]
        } else {
            &mut ws.q[..n * qd]
        };
        Matrix::matmul_many(
            [&attn.wq, &attn.wk, &attn.wv],
            &mut ws.acts,
            n,
            &ws.normed,
            [q_out, &mut ws.k[..n * kvd], &mut ws.v[..n * kvd]],
            pool,
        )?;
        if attn.output_gate {
            // Each head's q, then its gate.
            let heads = n * qd / hd;
            for head in 0..heads {
                let from = &ws.q_gated[2 * head * hd..2 * (head + 1) * hd];
                ws.q[head * hd..(head + 1) * hd].copy_from_slice(&from[..hd]);
                ws.attn_gate[head * hd..(head + 1) * hd].copy_from_slice(&from[hd..]);
            }
        }
        add_bias(&mut ws.q[..n * qd], attn.q_bias.as_deref());
        add_bias(&mut ws.k[..n * kvd], attn.k_bias.as_deref());
        add_bias(&mut ws.v[..n * kvd], attn.v_bias.as_deref());
        self.qk_norms(attn, n, ws, group)?;
        let pairs = cfg.rotary_dims / 2;
        let angles = match attn.rope {
            LayerRope::Global => Some((&ws.cos, &ws.sin)),
            LayerRope::Local => Some((&ws.cos_local, &ws.sin_local)),
            LayerRope::None => None,
        };
        if let Some((cos, sin)) = angles {
            for t in 0..n {
                let (cos, sin) = (
                    &cos[t * pairs..(t + 1) * pairs],
                    &sin[t * pairs..(t + 1) * pairs],
                );
                ops::apply_rope(
                    &mut ws.q[t * qd..(t + 1) * qd],
                    hd,
                    cfg.rope_style,
                    cos,
                    sin,
                );
                ops::apply_rope(
                    &mut ws.k[t * kvd..(t + 1) * kvd],
                    hd,
                    cfg.rope_style,
                    cos,
                    sin,
                );
            }
        }
        store_kv(kv, attn.kv_layer, spans, &ws.k[..n * kvd], &ws.v[..n * kvd]);
        let scoring = Scoring {
            window: attn.window,
            scale: cfg
                .variant
                .attention_scale
                .unwrap_or(1.0 / (hd as f32).sqrt()),
            softcap: cfg.variant.attn_softcap,
        };
        attention::attention(
            cfg,
            self.heads,
            scoring,
            &ws.q[..n * qd],
            kv,
            attn.kv_layer,
            spans,
            &ws.token_span[..n],
            &ws.positions[..n],
            &mut ws.attn[..n * qd],
            &mut ws.scores,
            ws.scores_stride,
            pool,
        );
        if attn.output_gate {
            for (o, g) in ws.attn[..n * qd].iter_mut().zip(&ws.attn_gate[..n * qd]) {
                *o *= ops::sigmoid(*g);
            }
        }
        self.project_whole(&attn.wo, Whole::Attention, n, ws, pool, group)
    }

    /// `ws.proj` (whole rows) = `w` over this rank's rows of the attention
    /// output or of the MLP's activations (see [`project`]).
    fn project_whole(
        &self,
        w: &Matrix,
        input: Whole,
        n: usize,
        ws: &mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let (local, width) = match input {
            Whole::Attention => (&ws.attn, cfg.q_dim()),
            Whole::Mlp => (&ws.gate, cfg.ffn),
        };
        let splits = self.tensor.as_ref().map(|t| {
            let columns = match input {
                Whole::Attention => &t.layout.attention,
                Whole::Mlp => &t.layout.ffn,
            };
            (columns, &t.layout.hidden)
        });
        let out = &mut ws.proj[..n * cfg.hidden];
        let (acts, gathers) = (&mut ws.acts, &mut ws.gathers);
        project::<ForwardError>(
            w,
            splits,
            n,
            &local[..n * width],
            out,
            acts,
            gathers,
            pool,
            group,
        )
    }

    /// The q and k norms: head by head (Qwen3, Gemma 3), or across all
    /// heads (OLMo 2), where a tensor-parallel rank adds its sums of
    /// squares to the others' first.
    fn qk_norms(
        &self,
        attn: &Attention,
        n: usize,
        ws: &mut Workspace,
        group: &mut dyn Group,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let (Some(q_norm), Some(k_norm)) = (&attn.q_norm, &attn.k_norm) else {
            return Ok(());
        };
        let Some((q_width, k_width)) = attn.qk_norm_widths else {
            ops::rms_norm_in_place(&mut ws.q[..n * qd], q_norm, cfg.norm_eps);
            ops::rms_norm_in_place(&mut ws.k[..n * kvd], k_norm, cfg.norm_eps);
            return Ok(());
        };
        let (q_sums, k_sums) = ws.qk_sums[..2 * n].split_at_mut(n);
        let layout = self.tensor.as_ref().map(|t| &t.layout);
        match layout.and_then(|l| Some((&l.attention, l.keys.as_ref()?))) {
            None => {
                ops::sums_of_squares(&ws.q[..n * qd], qd, q_sums);
                ops::sums_of_squares(&ws.k[..n * kvd], kvd, k_sums);
            }
            // A tensor rank sums the whole rows, gathered, as one machine
            // does (adding the ranks' sums would reorder them).
            Some((q_split, k_split)) => {
                let gathers = &mut ws.gathers;
                for (split, local, sums) in [
                    (q_split, &ws.q[..n * qd], q_sums),
                    (k_split, &ws.k[..n * kvd], k_sums),
                ] {
                    let whole = grown(&mut gathers.whole, n * split.width());
                    split.gather(group, n, local, &mut gathers.scratch, whole)?;
                    ops::sums_of_squares(whole, split.width(), sums);
                }
            }
        }
        let (q_sums, k_sums) = ws.qk_sums[..2 * n].split_at(n);
        ops::rms_norm_by_sums(&mut ws.q[..n * qd], q_norm, q_sums, q_width, cfg.norm_eps);
        ops::rms_norm_by_sums(&mut ws.k[..n * kvd], k_norm, k_sums, k_width, cfg.norm_eps);
        Ok(())
    }
}

/// The rows a shard owns of each split dimension (all of them unless
/// `sliced`, a tensor-parallel rank).
struct ShardRows {
    q: Range<usize>,
    kv: Range<usize>,
    ffn: Range<usize>,
    expert: Range<usize>,
    shared: Range<usize>,
    /// A tensor rank's rows of the output projections (whole columns).
    hidden: Option<Range<usize>>,
}

fn load_part(
    source: &dyn TensorSource,
    name: &str,
    shape: [usize; 2],
    rows: Option<Range<usize>>,
    cols: Option<Range<usize>>,
) -> Result<Matrix, LoadError> {
    source.expect_shape(name, &shape)?;
    source.matrix_part(name, rows, cols)
}

fn load_vector(source: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    source.expect_shape(name, &[len])?;
    source.vector(name)
}

/// `rows` of a vector, if the family has it.
fn sliced_vector(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
    rows: &Range<usize>,
    wanted: bool,
) -> Result<Option<Vec<f32>>, LoadError> {
    if wanted {
        load_vector(source, name, len).map(|v| Some(v[rows.clone()].to_vec()))
    } else {
        Ok(None)
    }
}

fn optional(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
    wanted: bool,
) -> Result<Option<Vec<f32>>, LoadError> {
    if wanted {
        load_vector(source, name, len).map(Some)
    } else {
        Ok(None)
    }
}

/// Biases llama.cpp also loads when the file has them (o_proj and the
/// MLP's): present means used, never silently dropped.
fn if_present(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
    rows: Range<usize>,
) -> Result<Option<Vec<f32>>, LoadError> {
    if source.contains(name) {
        load_vector(source, name, len).map(|v| Some(v[rows].to_vec()))
    } else {
        Ok(None)
    }
}

fn shifted(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

/// Layer `i`'s attention, this shard's heads of it.
fn load_attention(
    source: &dyn TensorSource,
    config: &ModelConfig,
    i: usize,
    kv_layer: usize,
    rows: &ShardRows,
) -> Result<Attention, LoadError> {
    let n = |part: &str| format!("blk.{i}.{part}");
    let (h, q, kv) = (config.hidden, config.q_dim(), config.kv_dim());
    let (q_rows, kv_rows) = (&rows.q, &rows.kv);
    let part = |name: &str, shape, rows, cols| load_part(source, name, shape, rows, cols);
    let output_gate = config.variant.attn_output_gate;
    // Fused projections (one tensor for q, k and v) are split section by
    // section.
    let (wq, wk, wv) =
        if !source.contains(&n("attn_q.weight")) && source.contains(&n("attn_qkv.weight")) {
            let fused = n("attn_qkv.weight");
            let shape = [q + 2 * kv, h];
            (
                part(&fused, shape, Some(q_rows.clone()), None)?,
                part(&fused, shape, Some(shifted(kv_rows, q)), None)?,
                part(&fused, shape, Some(shifted(kv_rows, q + kv)), None)?,
            )
        } else {
            // A gated head's rows are its q's then its gate's.
            let (q_shape, q_part) = if output_gate {
                ([2 * q, h], 2 * q_rows.start..2 * q_rows.end)
            } else {
                ([q, h], q_rows.clone())
            };
            (
                part(&n("attn_q.weight"), q_shape, Some(q_part), None)?,
                part(&n("attn_k.weight"), [kv, h], Some(kv_rows.clone()), None)?,
                part(&n("attn_v.weight"), [kv, h], Some(kv_rows.clone()), None)?,
            )
        };
    let whole = config.variant.qk_norm_whole;
    let (q_norm, k_norm) = if whole {
        (
            sliced_vector(source, &n("attn_q_norm.weight"), q, q_rows, config.qk_norm)?,
            sliced_vector(
                source,
                &n("attn_k_norm.weight"),
                kv,
                kv_rows,
                config.qk_norm,
            )?,
        )
    } else {
        let hd = config.head_dim;
        (
            optional(source, &n("attn_q_norm.weight"), hd, config.qk_norm)?,
            optional(source, &n("attn_k_norm.weight"), hd, config.qk_norm)?,
        )
    };
    Ok(Attention {
        kv_layer,
        window: config.layer_window(i),
        rope: config.layer_rope(i),
        qk_norm_widths: (whole && config.qk_norm).then_some((q, kv)),
        wq,
        wk,
        wv,
        wo: part(&n("attn_output.weight"), [h, q], rows.hidden.clone(), None)?,
        q_bias: sliced_vector(source, &n("attn_q.bias"), q, q_rows, config.qkv_bias)?,
        k_bias: sliced_vector(source, &n("attn_k.bias"), kv, kv_rows, config.qkv_bias)?,
        v_bias: sliced_vector(source, &n("attn_v.bias"), kv, kv_rows, config.qkv_bias)?,
        o_bias: if_present(source, &n("attn_output.bias"), h, 0..h)?,
        q_norm,
        k_norm,
        output_gate,
    })
}

/// Layer `i`'s MLP: experts where the file has a router, else dense (gate
/// and up fused in one tensor for Phi-3).
fn load_mlp(
    source: &dyn TensorSource,
    config: &ModelConfig,
    i: usize,
    rows: &ShardRows,
) -> Result<Mlp, LoadError> {
    let n = |part: &str| format!("blk.{i}.{part}");
    let (h, f) = (config.hidden, config.ffn);
    let part = |name: &str, shape, rows, cols| load_part(source, name, shape, rows, cols);
    if let Some(moe) = config
        .moe
        .as_ref()
        .filter(|_| source.contains(&n("ffn_gate_inp.weight")))
    {
        let expert_rows = [&rows.expert, &rows.shared];
        let experts = Experts::load(source, i, moe, h, expert_rows, rows.hidden.clone())?;
        return Ok(Mlp::Experts(experts));
    }
    let ffn_rows = &rows.ffn;
    let fused_gate_up = !source.contains(&n("ffn_gate.weight"))
        && source.shape(&n("ffn_up.weight")) == Some(vec![2 * f, h]);
    let (w_gate, w_up, gate_bias, up_bias) = if fused_gate_up {
        let fused = n("ffn_up.weight");
        let shape = [2 * f, h];
        let bias = n("ffn_up.bias");
        (
            part(&fused, shape, Some(ffn_rows.clone()), None)?,
            part(&fused, shape, Some(shifted(ffn_rows, f)), None)?,
            if_present(source, &bias, 2 * f, ffn_rows.clone())?,
            if_present(source, &bias, 2 * f, shifted(ffn_rows, f))?,
        )
    } else {
        (
            part(&n("ffn_gate.weight"), [f, h], Some(ffn_rows.clone()), None)?,
            part(&n("ffn_up.weight"), [f, h], Some(ffn_rows.clone()), None)?,
            if_present(source, &n("ffn_gate.bias"), f, ffn_rows.clone())?,
            if_present(source, &n("ffn_up.bias"), f, ffn_rows.clone())?,
        )
    };
    Ok(Mlp::Dense {
        w_gate,
        w_up,
        w_down: part(&n("ffn_down.weight"), [h, f], rows.hidden.clone(), None)?,
        gate_bias,
        up_bias,
        down_bias: if_present(source, &n("ffn_down.bias"), h, 0..h)?,
    })
}

/// `out = norm(x)`, or `x` itself for a family without this norm.
fn pre_norm(x: &[f32], norm: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    match norm {
        Some(weight) => ops::rms_norm(x, weight, eps, out),
        None => out.copy_from_slice(x),
    }
}

/// The dense gated MLP (SwiGLU or GeGLU) over `ws.normed` (`n x h`): the
/// gated activations, this rank's `f` rows of them, into `ws.gate`.
#[allow(clippy::too_many_arguments)]
fn dense_activations(
    [w_gate, w_up]: [&Matrix; 2],
    [gate_bias, up_bias]: [Option<&[f32]>; 2],
    activation: Activation,
    f: usize,
    n: usize,
    h: usize,
    ws: &mut Workspace,
    pool: &ThreadPool,
) -> Result<(), ForwardError> {
    ws.acts.set(&ws.normed[..n * h], n, h);
    Matrix::matmul_many(
        [w_gate, w_up],
        &mut ws.acts,
        n,
        &ws.normed,
        [&mut ws.gate[..n * f], &mut ws.up[..n * f]],
        pool,
    )?;
    add_bias(&mut ws.gate[..n * f], gate_bias);
    add_bias(&mut ws.up[..n * f], up_bias);
    let gated = match activation {
        Activation::Silu => ops::silu_mul,
        Activation::GeluTanh => ops::gelu_tanh_mul,
    };
    if n == 1 {
        gated(&mut ws.gate[..f], &ws.up[..f]);
    } else {
        let gate = DisjointSlice::new(&mut ws.gate[..n * f]);
        let up = &ws.up[..n * f];
        pool.run(|index, count| {
            let range = split_range(n * f, index, count, 64);
            // SAFETY: threads take disjoint ranges.
            gated(unsafe { gate.part(range.clone()) }, &up[range]);
        });
    }
    Ok(())
}

fn cap_logits(logits: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        ops::softcap(logits, cap);
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for row in x.chunks_exact_mut(bias.len()) {
            ops::add_in_place(row, bias);
        }
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

/// Writes the step's keys and values, in f16, at each token's position in
/// its sequence's blocks.
fn store_kv(kv: &mut KvPool, layer: usize, spans: &[SeqSpan<'_>], k: &[f32], v: &[f32]) {
    let kvd = k.len() / spans.iter().map(|s| s.len).sum::<usize>().max(1);
    let mut t = 0;
    for span in spans {
        for position in span.start..span.start + span.len {
            let at = kv.offset(span.table, position);
            let (keys, values) = kv.layer_mut(layer);
            let row = t * kvd..(t + 1) * kvd;
            for (out, value) in keys[at..at + kvd].iter_mut().zip(&k[row.clone()]) {
                *out = f16::from_f32(*value);
            }
            for (out, value) in values[at..at + kvd].iter_mut().zip(&v[row]) {
                *out = f16::from_f32(*value);
            }
            t += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Architecture, RopeScaling};
    use crate::ops::RopeStyle;

    fn smollm2() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            layers: 30,
            hidden: 576,
            ffn: 1536,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            context_length: 8192,
            norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_style: RopeStyle::Interleaved,
            rope_scaling: RopeScaling::None,
            rotary_dims: 64,
            qkv_bias: false,
            qk_norm: false,
            tied_embeddings: true,
            sliding_window: None,
            moe: None,
            variant: Default::default(),
        }
    }

    #[test]
    fn a_shared_kv_head_serves_only_the_shards_own_query_heads() {
        // Global heads 5..9 of groups of 3: KV heads 1 and 2.
        let layout = HeadLayout {
            group: 3,
            q_first: 5,
            kv_first: 1,
        };
        assert_eq!(layout.heads_of(0, 4), 0..1);
        assert_eq!(layout.heads_of(1, 4), 1..4);
        let whole = HeadLayout {
            group: 3,
            q_first: 0,
            kv_first: 0,
        };
        assert_eq!(whole.heads_of(2, 9), 6..9);
    }

    #[test]
    fn tensor_splits_cover_every_dimension() -> Result<(), ShardError> {
        let config = smollm2();
        for world in 1..=3u32 {
            let splits: Vec<TensorSplit> = (0..world)
                .map(|rank| TensorSplit::new(&config, rank, world, 32, 32))
                .collect::<Result<_, _>>()?;
            let mut next = (0, 0, 0);
            for split in &splits {
                // Contiguous, in rank order, whole heads, whole blocks.
                assert_eq!(split.q_rows.start, next.0);
                assert_eq!(split.ffn_rows.start, next.1);
                assert_eq!(split.vocab_rows.start, next.2);
                assert_eq!(split.q_rows.len() % 64, 0, "whole heads");
                assert_eq!(split.ffn_rows.len() % 32, 0, "whole Q4_1 blocks");
                // Exactly the KV heads its query heads read (3 per group).
                let (q0, q1) = (split.q_rows.start / 64, split.q_rows.end / 64);
                assert_eq!(split.kv_rows, q0 / 3 * 64..q1.div_ceil(3) * 64);
                next = (split.q_rows.end, split.ffn_rows.end, split.vocab_rows.end);
            }
            assert_eq!(next, (576, 1536, 49152), "world {world} covers all");
        }
        // World 2: 5 and 4 query heads, the middle KV head on both; the MLP
        // splits evenly (its phase ends in gathers, so it is balanced
        // on its own).
        let (a, b) = (
            TensorSplit::new(&config, 0, 2, 32, 32)?,
            TensorSplit::new(&config, 1, 2, 32, 32)?,
        );
        assert_eq!((a.q_rows.len(), b.q_rows.len()), (320, 256));
        assert_eq!((a.kv_rows.clone(), b.kv_rows.clone()), (0..128, 64..192));
        assert_eq!((a.ffn_rows.len(), b.ffn_rows.len()), (768, 768));
        // World 3 divides the KV heads: whole groups, nothing shared.
        let c = TensorSplit::new(&config, 1, 3, 32, 32)?;
        assert_eq!((c.q_rows, c.kv_rows), (192..384, 64..128));
        // Norms over all heads at once keep whole groups (their sums
        // would count a shared KV head twice).
        let mut whole = config.clone();
        whole.variant.qk_norm_whole = true;
        let d = TensorSplit::new(&whole, 0, 2, 32, 32)?;
        assert_eq!((d.q_rows, d.kv_rows), (0..384, 0..128));
        assert!(TensorSplit::new(&config, 0, 4, 32, 32).is_err());
        Ok(())
    }
}
