//! Text generation on one machine: a loaded model, and sessions that keep a
//! KV cache between requests (a shared prompt prefix is not recomputed).
//!
//! A request goes prompt → tokens → chunked prefill (with progress) →
//! decode loop: sample, detokenize without splitting UTF-8, hold back text
//! that may start a stop string, parse thinking and tool calls, stream.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::chat_template::{ChatMessage, ChatTemplate, CHATML_TEMPLATE};
use crate::executor::{ExecError, Executor};
use crate::gguf::GgufFile;
use crate::hf_source::HfSource;
use crate::memory;
use crate::model::transformer::ForwardError;
use crate::model::{LoadError, Transformer};
use crate::output_parser::{OutputFormat, OutputParser, ParsedChunk};
use crate::sampler::{Sampler, SamplingError, SamplingParams};
use crate::shard::ShardSpec;
use crate::stop::StopMatcher;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::utf8_stream::Utf8Stream;

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
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Distributed(ExecError),
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
    /// Reuse the KV cache for a prompt prefix shared with the last request.
    pub reuse_prefix: bool,
    /// Record each generated token's logprob (and `sampling.top_logprobs`
    /// alternatives) in [`GenerationOutput::logprobs`].
    pub logprobs: bool,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prefill_chunk: 512,
            reuse_prefix: true,
            logprobs: false,
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
                self.encode(&text, true)?
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
            .map_err(|source| EngineError::Tokenizer {
                path: self.path.display().to_string(),
                source,
            })
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

/// A conversation context on one model: KV cache, scratch and threads, on
/// this machine or driving the ranks of a distributed instance (rank 0).
pub struct Session<'m> {
    model: &'m LoadedModel,
    executor: Executor<'m>,
    cached_tokens: Vec<u32>,
    logits: Vec<f32>,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m LoadedModel, threads: usize) -> Self {
        Self::with_executor(model, Executor::single(&model.transformer, threads))
    }

    /// Rank 0 of a distributed instance: `model` holds rank 0's shard and
    /// `executor` its group.
    pub fn with_executor(model: &'m LoadedModel, executor: Executor<'m>) -> Self {
        Self {
            model,
            executor,
            cached_tokens: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// The executor (for shutting a distributed instance down).
    pub fn executor(&mut self) -> &mut Executor<'m> {
        &mut self.executor
    }

    /// Forgets the conversation.
    pub fn reset(&mut self) {
        self.cached_tokens.clear();
    }

    /// Runs `tokens` after the first `keep` cached ones on every rank.
    fn run(
        &mut self,
        keep: usize,
        reserve: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<(), EngineError> {
        let result = self.executor.step(keep, reserve, tokens, want_logits);
        match result {
            Ok(logits) => {
                if let Some(logits) = logits {
                    self.logits.clear();
                    self.logits.extend_from_slice(logits);
                }
                self.cached_tokens.truncate(keep);
                self.cached_tokens.extend_from_slice(tokens);
                Ok(())
            }
            Err(error) => {
                // Nothing cached can be trusted after a failed step.
                self.cached_tokens.clear();
                Err(error.into())
            }
        }
    }

    /// Runs `tokens` from an empty cache and returns the logits after the
    /// last one (for comparisons against reference engines).
    pub fn logits_for(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.run(0, tokens.len(), tokens, true)?;
        Ok(&self.logits)
    }

    /// Runs one request. `on_event` may return `Break` to cancel.
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        mut on_event: impl FnMut(GenerationEvent<'_>) -> ControlFlow<()>,
    ) -> Result<GenerationOutput, EngineError> {
        let started = Instant::now();
        let model = self.model;
        if request.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        request.sampling.validate()?;
        let prompt = model.tokenize(&request.prompt)?;
        let context = model.transformer.config.context_length;
        let needed = prompt.len() + request.max_tokens;
        if prompt.len() >= context || needed > context {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                max_tokens: request.max_tokens,
                needed,
                context,
            });
        }
        let vocab = model.transformer.config.vocab;
        let mut sampler = Sampler::new(request.sampling.clone(), vocab)?;

        // Keep the cached prefix, but always recompute at least one token.
        let mut reuse = 0;
        if request.reuse_prefix {
            reuse = common_prefix(&self.cached_tokens, &prompt).min(prompt.len() - 1);
        }
        self.cached_tokens.truncate(reuse);

        let chunk = request.prefill_chunk.max(1);
        let pending = &prompt[reuse..];
        let pieces = pending.len().div_ceil(chunk);
        let mut done = 0;
        let mut cancelled = false;
        for (index, piece) in pending.chunks(chunk).enumerate() {
            let keep = self.cached_tokens.len();
            self.run(keep, needed, piece, index + 1 == pieces)?;
            done += piece.len();
            if on_event(GenerationEvent::PrefillProgress {
                done,
                total: pending.len(),
            })
            .is_break()
            {
                cancelled = true;
                break;
            }
        }
        let prefill_seconds = started.elapsed().as_secs_f64();

        let mut history = prompt.clone();
        let mut tokens = Vec::with_capacity(request.max_tokens);
        let mut logprobs = Vec::new();
        let mut text = String::new();
        let mut chunks = Vec::new();
        let mut utf8 = Utf8Stream::new();
        let mut stops = StopMatcher::new(request.stop.clone());
        let mut parser = OutputParser::new(model.output_format.clone());
        let mut piece = String::new();
        let mut first_token_at = None;
        let mut finish = if cancelled {
            FinishReason::Cancelled
        } else {
            FinishReason::Length
        };
        let decode_started = Instant::now();
        while !cancelled && tokens.len() < request.max_tokens {
            let sampled = sampler.sample(&mut self.logits, &history);
            let id = sampled.token;
            first_token_at.get_or_insert_with(|| started.elapsed().as_secs_f64());
            tokens.push(id);
            history.push(id);
            if request.logprobs {
                logprobs.push(TokenLogprob {
                    token: id,
                    logprob: sampled.logprob,
                    top: sampled.top_logprobs.clone(),
                });
            }
            let end_of_generation = !request.ignore_eos && model.tokenizer.eog_ids().contains(&id);
            if end_of_generation || request.stop_token_ids.contains(&id) {
                finish = FinishReason::Stop;
                break;
            }
            piece.clear();
            if !model.tokenizer.is_control(id) {
                utf8.push_into(model.tokenizer.token_bytes(id), &mut piece);
            }
            let outcome = stops.push(&piece);
            let flow = emit(
                &mut on_event,
                id,
                &outcome.emit,
                &sampled,
                &mut parser,
                &mut text,
                &mut chunks,
            );
            if outcome.stopped.is_some() {
                finish = FinishReason::StopString;
                break;
            }
            if flow.is_break() {
                finish = FinishReason::Cancelled;
                break;
            }
            if tokens.len() == request.max_tokens {
                break;
            }
            // Feed the token back for the next step.
            let keep = self.cached_tokens.len();
            self.run(keep, needed, &[id], true)?;
        }
        // Release what was held back (unless a stop string cut it).
        if finish != FinishReason::StopString {
            let mut tail = utf8.finish();
            tail = format!("{}{}", stops.push(&tail).emit, stops.finish());
            if !tail.is_empty() {
                for chunk in parser.push(&tail) {
                    let _ = on_event(GenerationEvent::Parsed(&chunk));
                    chunks.push(chunk);
                }
                text.push_str(&tail);
            }
        }
        for chunk in parser.finish() {
            let _ = on_event(GenerationEvent::Parsed(&chunk));
            chunks.push(chunk);
        }
        let decode_seconds = decode_started.elapsed().as_secs_f64();
        let ttft = first_token_at.unwrap_or(prefill_seconds);
        let stats = GenerationStats {
            prompt_tokens: prompt.len(),
            prefilled_tokens: pending.len(),
            generated_tokens: tokens.len(),
            prefill_seconds,
            prefill_tokens_per_second: per_second(pending.len(), prefill_seconds),
            decode_seconds,
            decode_tokens_per_second: per_second(
                tokens.len().saturating_sub(1),
                (started.elapsed().as_secs_f64() - ttft).max(0.0),
            ),
            time_to_first_token_seconds: ttft,
            peak_rss_bytes: memory::peak_rss_bytes(),
        };
        Ok(GenerationOutput {
            prompt_tokens: prompt,
            tokens,
            logprobs,
            text,
            chunks,
            finish_reason: finish,
            stats,
        })
    }
}

fn emit(
    on_event: &mut impl FnMut(GenerationEvent<'_>) -> ControlFlow<()>,
    id: u32,
    released: &str,
    sampled: &crate::sampler::Sampled,
    parser: &mut OutputParser,
    text: &mut String,
    chunks: &mut Vec<ParsedChunk>,
) -> ControlFlow<()> {
    text.push_str(released);
    let mut flow = on_event(GenerationEvent::Token {
        id,
        text: released,
        logprob: sampled.logprob,
        top_logprobs: &sampled.top_logprobs,
    });
    if !released.is_empty() {
        for chunk in parser.push(released) {
            if on_event(GenerationEvent::Parsed(&chunk)).is_break() {
                flow = ControlFlow::Break(());
            }
            chunks.push(chunk);
        }
    }
    flow
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn per_second(count: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
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
