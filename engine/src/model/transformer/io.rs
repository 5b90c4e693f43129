//! What a forward pass takes and gives, and how it fails.

use crate::dist::collectives::CollectiveError;
use crate::logits::BestView;
use crate::model::paged::BlockId;

/// What a stage consumes.
pub enum StageInput<'a> {
    Tokens(&'a [u32]),
    /// Hidden states from the previous stage, `tokens x hidden`.
    Hidden(&'a [f32]),
}

/// What a stage produces (borrowed from the [`super::Workspace`]).
pub enum ForwardOutput<'a> {
    /// Logits of the last token (the last stage).
    Logits(&'a [f32]),
    /// Hidden states of all tokens, for the next stage.
    Hidden(&'a [f32]),
    /// The last stage of a pipeline of several: the rows that want logits,
    /// after the final norm, for the first stage, which holds the head
    /// ([`super::Transformer::head_of_normed`]). A row of hidden states is
    /// vocab/hidden times smaller than its logits (85 times for
    /// SmolLM2-135M), and the first stage has the tied embeddings anyway.
    Normed(&'a [f32]),
    /// Rank 0 of a tensor group asked for [`RowOutput::BestTokens`], or a
    /// GPU head for that or [`RowOutput::TopCandidates`]: one per row that
    /// wants logits, with its candidates for the latter.
    Best(BestView<'a>),
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
    /// Only the row's [`crate::logits::BestToken`], all that greedy sampling needs: a
    /// tensor rank then sends rank 0 12 bytes per row, not its share of
    /// the vocabulary. Where the logits are whole on one rank anyway they
    /// come back whole, and the caller takes their best.
    BestTokens,
    /// The row's [`crate::logits::BestToken`] and its [`crate::logits::TOP_CANDIDATES`]
    /// best tokens, all that top-k sampling needs: a GPU reads back 130
    /// words a row rather than the vocabulary. Where the logits are whole
    /// on the CPU anyway (or gathered there from tensor ranks) they come
    /// back whole, and the caller takes the candidates.
    TopCandidates,
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
    #[error("GPU: {0}")]
    Gpu(#[from] crate::gpu::GpuError),
    #[error("recurrent-state slot {slot}: {reason}")]
    StateSlot { slot: usize, reason: &'static str },
}
