//! Text generation: a loaded model, and sessions that run one request at a
//! time on a [`crate::batch::Batch`] (a shared prompt prefix is not
//! recomputed).
//!
//! A request goes prompt → tokens → chunked prefill (with progress) →
//! decode loop: sample, detokenize without splitting UTF-8, hold back text
//! that may start a stop string, parse thinking and tool calls, stream.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use crate::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use crate::chat_template::{ChatMessage, ChatTemplate, CHATML_TEMPLATE};
use crate::executor::{ExecError, Executor};
use crate::gguf::GgufFile;
use crate::hf_source::HfSource;
use crate::model::transformer::ForwardError;
use crate::model::{LoadError, Transformer};
use crate::output_parser::{OutputFormat, ParsedChunk};
use crate::sampler::{SamplingError, SamplingParams};
use crate::shard::ShardSpec;
use crate::tokenizer::{Tokenizer, TokenizerError};

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
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Distributed(ExecError),
    #[error("the draft model {draft} does not share the target's vocabulary: {detail}")]
    DraftVocabulary { draft: String, detail: String },
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
                | Self::Sampling(_)
        )
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
    /// speculates ([`crate::speculative`]); false decodes one at a time.
    pub speculative: bool,
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
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            reuse_prefix: true,
            logprobs: false,
            speculative: true,
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

/// A model loaded for single-machine generation.
pub struct LoadedModel {
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub output_format: OutputFormat,
    pub path: PathBuf,
}

impl LoadedModel {
    /// Loads a GGUF file or a Hugging Face folder, reporting `(done, total)`.
    pub fn load(path: &Path, progress: impl FnMut(usize, usize)) -> Result<Self, EngineError> {
        Self::load_shard(path, None, progress)
    }

    /// Loads the tokenizer and template, and only the part of the weights
    /// `spec` names (`None`: all of them).
    pub fn load_shard(
        path: &Path,
        spec: Option<&ShardSpec>,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        if !path.exists() {
            return Err(EngineError::ModelNotFound(path.to_path_buf()));
        }
        let display = path.display().to_string();
        let tokenizer_error = |source| EngineError::Tokenizer {
            path: display.clone(),
            source,
        };
        let (transformer, tokenizer) = if path.is_dir() {
            let source = HfSource::open(path)?;
            let config = source.config()?;
            let spec = spec
                .cloned()
                .unwrap_or(ShardSpec::whole(config.layers as u32));
            let transformer = Transformer::load_shard(&source, config, &spec, progress)?;
            (
                transformer,
                Tokenizer::from_hf_dir(path).map_err(tokenizer_error)?,
            )
        } else {
            let file = GgufFile::open(path)?;
            let config = file.config()?;
            let spec = spec
                .cloned()
                .unwrap_or(ShardSpec::whole(config.layers as u32));
            let tokenizer = Tokenizer::from_gguf(file.metadata()).map_err(tokenizer_error)?;
            (
                Transformer::load_shard(&file, config, &spec, progress)?,
                tokenizer,
            )
        };
        let bos = tokenizer
            .bos_id()
            .and_then(|id| tokenizer.token_text(id).map(str::to_string))
            .unwrap_or_default();
        let eos = tokenizer
            .eog_ids()
            .first()
            .and_then(|id| tokenizer.token_text(*id).map(str::to_string))
            .unwrap_or_default();
        let source = tokenizer.chat_template().unwrap_or(CHATML_TEMPLATE);
        let template = ChatTemplate::new(source, &bos, &eos)
            .map_err(|e| EngineError::Template(e.to_string()))?;
        let output_format = output_format_for(&tokenizer);
        Ok(Self {
            transformer,
            tokenizer,
            template,
            output_format,
            path: path.to_path_buf(),
        })
    }

    /// Renders and tokenizes a prompt.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        let tokens = match prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Raw(text) => {
                if text.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                self.encode(text, false)?
            }
            Prompt::Chat { messages, tools } => {
                if messages.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                let text = self
                    .template
                    .render(messages, tools.as_ref(), true, None)
                    .map_err(|e| EngineError::Template(e.to_string()))?;
                self.encode_rendered(&text)?
            }
        };
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(tokens)
    }

    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, EngineError> {
        self.tokenizer
            .encode(text, parse_special)
            .map_err(|source| self.tokenizer_error(source))
    }

    fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer
            .encode_chat(text)
            .map_err(|source| self.tokenizer_error(source))
    }

    fn tokenizer_error(&self, source: crate::tokenizer::TokenizerError) -> EngineError {
        EngineError::Tokenizer {
            path: self.path.display().to_string(),
            source,
        }
    }
}

/// Tool-call and thinking syntax, from the tokens the vocabulary has.
fn output_format_for(tokenizer: &Tokenizer) -> OutputFormat {
    if tokenizer.token_id("<|python_tag|>").is_some() || tokenizer.token_id("<|eom_id|>").is_some()
    {
        OutputFormat::llama3()
    } else if tokenizer.token_id("[TOOL_CALLS]").is_some() {
        OutputFormat::mistral()
    } else {
        // ChatML families (Qwen, SmolLM2, Hermes) use <tool_call> and <think>.
        OutputFormat::hermes()
    }
}

/// A conversation context on one model: one request at a time on a
/// [`Batch`] of one, on this machine or driving the ranks of a distributed
/// instance (rank 0). Prompt prefixes of earlier requests are taken from
/// the KV cache in whole blocks.
pub struct Session<'m> {
    batch: Batch<'m>,
}

/// The one sequence of a session.
const SESSION_SEQ: SeqId = 0;

impl<'m> Session<'m> {
    pub fn new(model: &'m LoadedModel, threads: usize) -> Self {
        Self::with_executor(model, Executor::single(&model.transformer, threads))
    }

    /// Rank 0 of a distributed instance: `model` holds rank 0's shard and
    /// `executor` its group.
    pub fn with_executor(model: &'m LoadedModel, executor: Executor<'m>) -> Self {
        let context = model.transformer.config.context_length;
        let config = BatchConfig {
            // The request's own prefill chunk decides, as before batching.
            step_tokens: context,
            ..BatchConfig::for_context(1, context)
        };
        Self {
            batch: Batch::new(model, executor, config),
        }
    }

    /// The executor (for shutting a distributed instance down).
    pub fn executor(&mut self) -> &mut Executor<'m> {
        self.batch.executor()
    }

    /// What a step costs, as speculation measured it ([`Batch::step_cost`]).
    pub fn step_cost(&self) -> Option<(f64, f64)> {
        self.batch.step_cost()
    }

    /// The executor back, once the session is done with.
    pub fn into_executor(self) -> Executor<'m> {
        self.batch.into_executor()
    }

    /// Speculative decoding for the next requests ([`Batch::set_speculation`]).
    pub fn set_speculation(&mut self, speculation: Option<crate::speculative::Speculation>) {
        self.batch.set_speculation(speculation);
    }

    /// Forgets the conversation (the next request starts cold).
    pub fn reset(&mut self) {
        self.batch.clear_cache();
    }

    /// Runs `tokens` from an empty cache and returns the logits after the
    /// last one (for comparisons against reference engines).
    pub fn logits_for(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.batch.logits_for(tokens)
    }

    /// Runs one request. `on_event` may return `Break` to cancel.
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        mut on_event: impl FnMut(GenerationEvent<'_>) -> ControlFlow<()>,
    ) -> Result<GenerationOutput, EngineError> {
        self.batch.submit(SESSION_SEQ, request.clone())?;
        let mut output = None;
        while output.is_none() && !self.batch.is_idle() {
            self.batch.step(&mut |_, event| match event {
                SeqEvent::Generation(event) => on_event(event),
                SeqEvent::Finished(done) => {
                    output = Some(done);
                    ControlFlow::Continue(())
                }
                SeqEvent::Failed(_) => ControlFlow::Continue(()),
            })?;
        }
        output.ok_or(EngineError::Forward(ForwardError::Empty))
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

/// Loads only the weights of one shard (ranks other than 0 need no
/// tokenizer): layers for a pipeline stage, slices for a tensor rank.
pub fn load_transformer(
    path: &Path,
    spec: &ShardSpec,
    progress: impl FnMut(usize, usize),
) -> Result<Transformer, EngineError> {
    if !path.exists() {
        return Err(EngineError::ModelNotFound(path.to_path_buf()));
    }
    if path.is_dir() {
        let source = HfSource::open(path)?;
        let config = source.config()?;
        Ok(Transformer::load_shard(&source, config, spec, progress)?)
    } else {
        let file = GgufFile::open(path)?;
        let config = file.config()?;
        Ok(Transformer::load_shard(&file, config, spec, progress)?)
    }
}

/// The number of layers and KV heads of a model, read from its metadata
/// without loading weights (to plan shards).
pub fn model_config(path: &Path) -> Result<crate::model::ModelConfig, EngineError> {
    if !path.exists() {
        return Err(EngineError::ModelNotFound(path.to_path_buf()));
    }
    if path.is_dir() {
        Ok(HfSource::open(path)?.config()?)
    } else {
        Ok(GgufFile::open(path)?.config()?)
    }
}
