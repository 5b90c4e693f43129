//! A generation request and what comes back: its events, its output, its
//! errors. The vocabulary every serving file shares.

use std::path::PathBuf;

use crate::model::transformer::ForwardError;
use crate::model::LoadError;
use crate::serve::executor::ExecError;
use crate::serve::sampler::{LeftToModel, SamplingError, SamplingParams};
use crate::text::chat_template::ChatMessage;
use crate::text::output_parser::ParsedChunk;
use crate::text::tokenizer::TokenizerError;
pub use crate::text::tools::ToolChoice;
pub use tessera_grammar::Constraint;

/// Everything that can go wrong in loading or generating.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model not found: {0} (give a .gguf file or a Hugging Face folder with config.json)")]
    ModelNotFound(PathBuf),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{path}: {source}")]
    Tokenizer {
        path: String,
        #[source]
        source: TokenizerError,
    },
    #[error("chat template: {0}")]
    Template(String),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; with max_tokens {max_tokens} it needs {needed}, beyond the context length of {context}")]
    PromptTooLong {
        prompt: usize,
        max_tokens: usize,
        needed: usize,
        context: usize,
    },
    #[error("the prompt has {prompt} tokens; with max_tokens {max_tokens} it needs more than the {capacity} positions this instance's KV cache holds")]
    BeyondKvCache {
        prompt: usize,
        max_tokens: usize,
        capacity: usize,
    },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("the prompt has token id {id}, beyond the model's vocabulary of {vocab}")]
    TokenBeyondVocabulary { id: u32, vocab: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Distributed(ExecError),
    #[error("the draft model {draft} does not share the target's vocabulary: {detail}")]
    DraftVocabulary { draft: String, detail: String },
    #[error(transparent)]
    Grammar(#[from] tessera_grammar::GrammarError),
    #[error(transparent)]
    Tools(#[from] crate::text::tools::ToolError),
    #[error("tools under tool_choice {0} cannot be combined with a grammar constraint; use a JSON schema or a regex, or tool_choice none")]
    ToolsWithGrammar(&'static str),
}

impl EngineError {
    /// The request itself is at fault (a client sees a 400), not the
    /// engine or the model.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            Self::Template(_)
                | Self::EmptyPrompt
                | Self::PromptTooLong { .. }
                | Self::BeyondKvCache { .. }
                | Self::ZeroMaxTokens
                | Self::TokenBeyondVocabulary { .. }
                | Self::Sampling(_)
                | Self::Grammar(tessera_grammar::GrammarError::Compile { .. })
                | Self::Tools(_)
                | Self::ToolsWithGrammar(_)
        )
    }
}

impl From<ExecError> for EngineError {
    fn from(error: ExecError) -> Self {
        match error {
            ExecError::Forward(e) => EngineError::Forward(e),
            other => EngineError::Distributed(other),
        }
    }
}

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text fed as is (no template).
    Raw(String),
    /// Messages rendered with the model's chat template.
    Chat {
        messages: Vec<ChatMessage>,
        tools: Option<serde_json::Value>,
    },
    /// Already tokenized.
    Tokens(Vec<u32>),
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Which of `sampling`'s fields the request left unset: those take the
    /// model's recommended values on submit.
    pub left_to_model: LeftToModel,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Prompt tokens per forward pass during prefill.
    pub prefill_chunk: usize,
    /// Take the prompt's leading whole KV blocks from the prefix cache when
    /// an earlier request computed them.
    pub reuse_prefix: bool,
    /// Record each generated token's logprob (and `sampling.top_logprobs`
    /// alternatives) in [`GenerationOutput::logprobs`].
    pub logprobs: bool,
    /// Draft and verify several tokens per step when the instance
    /// speculates ([`crate::serve::speculative`]); false decodes one at a time.
    pub speculative: bool,
    /// What the output must be (a JSON Schema, a regex, a grammar): each
    /// step's tokens are masked to those that keep it so, and the sequence
    /// ends when the constraint is complete.
    pub constraint: Option<Constraint>,
    /// With tools in the prompt: whether the model must call one
    /// (enforced by a grammar, see [`crate::text::tools`]).
    pub tool_choice: ToolChoice,
    /// Several tool calls in one answer (else at most one).
    pub parallel_tool_calls: bool,
    /// Only count the prompt's tokens: the request finishes at the next
    /// step with its prompt counted and nothing generated.
    pub count_only: bool,
}

/// Prompt tokens per forward pass unless a request says otherwise. The
/// forward pass's scratch grows with it (about 25 KB a token for the default
/// model, beside the KV cache); past a couple of hundred tokens prefill is
/// no faster, since each chunk streams the weights once and its quantized
/// activations stay in the L2 cache.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            max_tokens: 256,
            sampling: SamplingParams::default(),
            left_to_model: LeftToModel::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            reuse_prefix: true,
            logprobs: false,
            speculative: true,
            constraint: None,
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            count_only: false,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop token id.
    Stop,
    /// A stop string.
    StopString,
    /// `max_tokens` reached.
    Length,
    /// The caller asked to stop.
    Cancelled,
}

/// Timing and usage of one request.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually computed (the rest came from the cache).
    pub prefilled_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub prefill_tokens_per_second: f64,
    pub decode_seconds: f64,
    /// Over the tokens after the first (the first costs the prefill).
    pub decode_tokens_per_second: f64,
    pub time_to_first_token_seconds: f64,
    pub peak_rss_bytes: Option<u64>,
    /// Speculative decoding: tokens drafted and checked by the target.
    pub draft_tokens: usize,
    /// Of those, tokens the target accepted.
    pub accepted_draft_tokens: usize,
    /// Target forward steps that produced the generated tokens (one per
    /// token without speculation).
    pub decode_steps: usize,
}

/// Streamed while generating.
#[derive(Debug)]
pub enum GenerationEvent<'a> {
    PrefillProgress {
        done: usize,
        total: usize,
    },
    /// One sampled token and the text it released (possibly empty: held for
    /// a stop string or an unfinished UTF-8 character).
    Token {
        id: u32,
        text: &'a str,
        logprob: f32,
        top_logprobs: &'a [(u32, f32)],
    },
    /// Structured output (text, reasoning, tool calls) as it is recognised.
    Parsed(&'a ParsedChunk),
}

/// A generated token's log-probability and its best alternatives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// The outcome of one request.
#[derive(Clone, Debug)]
pub struct GenerationOutput {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    /// One entry per generated token when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprob>,
    pub text: String,
    pub chunks: Vec<ParsedChunk>,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

impl GenerationOutput {
    /// A request that only counted its prompt.
    pub fn counted(prompt_tokens: usize) -> Self {
        Self {
            finish_reason: FinishReason::Stop,
            stats: GenerationStats {
                prompt_tokens,
                ..GenerationStats::default()
            },
            ..Self::cancelled_before_start()
        }
    }

    /// A request cancelled while it waited: nothing ran.
    pub fn cancelled_before_start() -> Self {
        Self {
            prompt_tokens: Vec::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
            chunks: Vec::new(),
            finish_reason: FinishReason::Cancelled,
            stats: GenerationStats::default(),
        }
    }
}
