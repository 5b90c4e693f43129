//! The [`Backend`] over tessera's own engine: a ring of TCP connections
//! between ranks, this rank's shard of the weights, and (rank 0) a
//! generation `Session` whose events become protobuf chunks: answer text,
//! reasoning (flagged) and tool calls, each sampled token's id and logprob
//! riding on the first chunk it released (an empty one if it released
//! nothing).

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tessera_engine::collectives::{Group, SingleRank, TcpRing};
use tessera_engine::executor::Executor;
use tessera_engine::generate::{
    load_transformer, FinishReason, GenerateRequest, GenerationEvent, GenerationOutput,
    LoadedModel, Prompt, Session,
};
use tessera_engine::model::Transformer;
use tessera_engine::output_parser::ParsedChunk;
use tessera_engine::shard::ShardSpec;
use tessera_engine::tokenizer::Tokenizer;
use tessera_protos::v1::{self, generation_chunk};

use super::backend::{Backend, BackendError};

/// How long the ranks of an instance may take to all reach the ring.
const CONNECT_WAIT: Duration = Duration::from_secs(60);
/// The longest one step between ranks may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Where this rank's engine comes from.
#[derive(Clone, Debug)]
pub struct EngineSetup {
    /// The model's files: a GGUF file or a safetensors folder.
    pub path: PathBuf,
    pub spec: ShardSpec,
    pub rank: usize,
    /// Every rank's ring address, in rank order.
    pub ring: Vec<SocketAddr>,
    /// Names the ring: a rank of another instance is turned away.
    pub ring_id: String,
    pub threads: usize,
}

/// What is loaded. A runner process loads one shard once and keeps it
/// until it exits, so the weights are leaked to a `'static` borrow that the
/// session and executor can hold.
enum Loaded {
    Nothing,
    Head(&'static LoadedModel),
    Follower(&'static Transformer),
}

pub struct EngineBackend {
    setup: EngineSetup,
    group: Option<Box<dyn Group>>,
    loaded: Loaded,
    /// Rank 0, once warmed up.
    session: Option<Session<'static>>,
    /// Other ranks, once warmed up.
    follower: Option<Executor<'static>>,
}

fn engine_error(error: impl std::fmt::Display) -> BackendError {
    BackendError::Engine(format!("{error:#}"))
}

impl EngineBackend {
    pub fn new(setup: EngineSetup) -> Self {
        Self {
            setup,
            group: None,
            loaded: Loaded::Nothing,
            session: None,
            follower: None,
        }
    }

    fn take_group(&mut self) -> Box<dyn Group> {
        self.group.take().unwrap_or_else(|| Box::new(SingleRank))
    }

    fn threads(&self) -> usize {
        self.setup.threads.max(1)
    }
}

impl Backend for EngineBackend {
    fn connect(&mut self) -> Result<(), BackendError> {
        let ring = TcpRing::connect(
            self.setup.rank,
            &self.setup.ring,
            &self.setup.ring_id,
            CONNECT_WAIT,
            STEP_TIMEOUT,
        )
        .map_err(|e| BackendError::Engine(format!("joining the instance's ring: {e}")))?;
        self.group = Some(Box::new(ring));
        Ok(())
    }

    fn load(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<u64, BackendError> {
        let setup = &self.setup;
        if setup.rank == 0 {
            let model = LoadedModel::load_shard(&setup.path, Some(&setup.spec), progress)
                .map_err(engine_error)?;
            let model: &'static LoadedModel = Box::leak(Box::new(model));
            self.loaded = Loaded::Head(model);
            Ok(model.transformer.weight_bytes() as u64)
        } else {
            let transformer =
                load_transformer(&setup.path, &setup.spec, progress).map_err(engine_error)?;
            let transformer: &'static Transformer = Box::leak(Box::new(transformer));
            self.loaded = Loaded::Follower(transformer);
            Ok(transformer.weight_bytes() as u64)
        }
    }

    fn warm_up(&mut self) -> Result<(), BackendError> {
        let threads = self.threads();
        match self.loaded {
            Loaded::Nothing => Err(BackendError::Engine("warming up before loading".into())),
            Loaded::Follower(transformer) => {
                let group = self.take_group();
                self.follower = Some(Executor::new(transformer, threads, group));
                Ok(())
            }
            Loaded::Head(model) => {
                let group = self.take_group();
                let executor = Executor::new(&model.transformer, threads, group);
                let mut session = Session::with_executor(model, executor);
                let mut warm = GenerateRequest::new(Prompt::Raw("Hello".into()));
                warm.max_tokens = 2;
                warm.reuse_prefix = false;
                session
                    .generate(&warm, |_| ControlFlow::Continue(()))
                    .map_err(|e| BackendError::Engine(format!("warming up: {e}")))?;
                self.session = Some(session);
                Ok(())
            }
        }
    }

    fn generate(
        &mut self,
        request: &GenerateRequest,
        command_id: &str,
        cancel: &AtomicBool,
        sink: &mut dyn FnMut(generation_chunk::Kind),
    ) -> Result<(), BackendError> {
        let (Some(session), Loaded::Head(model)) = (self.session.as_mut(), &self.loaded) else {
            return Err(BackendError::Engine("generating before warming up".into()));
        };
        let mut chunks = ChunkWriter::new(&model.tokenizer, command_id, request.logprobs);
        let result = session.generate(request, |event| {
            if cancel.load(Ordering::Relaxed) {
                return ControlFlow::Break(());
            }
            chunks.on_event(event, sink);
            ControlFlow::Continue(())
        });
        chunks.flush(sink);
        match result {
            Ok(output) => {
                sink(chunks.finish(&output));
                Ok(())
            }
            Err(error) if error.is_invalid_request() => {
                Err(BackendError::InvalidRequest(error.to_string()))
            }
            Err(error) => Err(BackendError::Engine(error.to_string())),
        }
    }

    fn follow(&mut self) -> Result<(), BackendError> {
        let executor = self
            .follower
            .as_mut()
            .ok_or_else(|| BackendError::Engine("following before warming up".into()))?;
        executor.serve(None, STEP_TIMEOUT).map_err(engine_error)
    }

    fn shutdown(&mut self) -> Result<(), BackendError> {
        if let Some(session) = self.session.as_mut() {
            session.executor().shutdown().map_err(engine_error)?;
        }
        self.session = None;
        Ok(())
    }
}

/// The token whose chunk is not sent yet: its parsed text, if any, comes
/// right after it.
struct PendingToken {
    id: u32,
    logprob: Option<f32>,
    top: Vec<v1::TopLogprob>,
}

fn token_chunk(
    pending: Option<PendingToken>,
    text: String,
    reasoning: bool,
) -> generation_chunk::Kind {
    let (token_id, logprob, top_logprobs) =
        pending.map_or((0, None, Vec::new()), |p| (p.id, p.logprob, p.top));
    generation_chunk::Kind::Token(v1::TokenChunk {
        token_id,
        text,
        reasoning,
        logprob,
        top_logprobs,
    })
}

/// Turns one generation's events into chunks.
struct ChunkWriter<'a> {
    tokenizer: &'a Tokenizer,
    /// The first characters of the command id, for tool-call ids.
    call_prefix: String,
    logprobs: bool,
    pending: Option<PendingToken>,
    calls: usize,
}

impl<'a> ChunkWriter<'a> {
    fn new(tokenizer: &'a Tokenizer, command_id: &str, logprobs: bool) -> Self {
        Self {
            tokenizer,
            call_prefix: command_id.chars().take(8).collect(),
            logprobs,
            pending: None,
            calls: 0,
        }
    }

    fn text_of(&self, id: u32) -> String {
        String::from_utf8_lossy(self.tokenizer.token_bytes(id)).into_owned()
    }

    fn on_event(
        &mut self,
        event: GenerationEvent<'_>,
        sink: &mut dyn FnMut(generation_chunk::Kind),
    ) {
        match event {
            GenerationEvent::Token {
                id,
                logprob,
                top_logprobs,
                ..
            } => {
                if let Some(previous) = self.pending.take() {
                    sink(token_chunk(Some(previous), String::new(), false));
                }
                let top = top_logprobs
                    .iter()
                    .map(|&(token_id, logprob)| v1::TopLogprob {
                        token_id,
                        text: self.text_of(token_id),
                        logprob,
                    })
                    .collect();
                self.pending = Some(PendingToken {
                    id,
                    logprob: self.logprobs.then_some(logprob),
                    top,
                });
            }
            GenerationEvent::PrefillProgress { done, total } => sink(
                generation_chunk::Kind::PrefillProgress(v1::PrefillProgressChunk {
                    processed_tokens: done as u32,
                    total_tokens: total as u32,
                }),
            ),
            GenerationEvent::Parsed(parsed) => sink(self.parsed(parsed)),
        }
    }

    fn parsed(&mut self, parsed: &ParsedChunk) -> generation_chunk::Kind {
        match parsed {
            ParsedChunk::Text(text) => token_chunk(self.pending.take(), text.clone(), false),
            ParsedChunk::Reasoning(text) => token_chunk(self.pending.take(), text.clone(), true),
            ParsedChunk::InvalidToolCall { raw, reason } => {
                tracing::debug!(reason, "a tool call that does not parse, kept as text");
                token_chunk(self.pending.take(), raw.clone(), false)
            }
            ParsedChunk::ToolCall(call) => {
                self.calls += 1;
                generation_chunk::Kind::ToolCall(v1::ToolCallChunk {
                    call: Some(v1::ToolCall {
                        id: format!("call_{}_{}", self.call_prefix, self.calls),
                        name: call.name.clone(),
                        arguments_json: call.arguments.to_string(),
                    }),
                })
            }
        }
    }

    /// The last sampled token, if its chunk has not gone yet.
    fn flush(&mut self, sink: &mut dyn FnMut(generation_chunk::Kind)) {
        if let Some(last) = self.pending.take() {
            sink(token_chunk(Some(last), String::new(), false));
        }
    }

    fn finish(&self, output: &GenerationOutput) -> generation_chunk::Kind {
        let reason = match output.finish_reason {
            _ if self.calls > 0 => v1::FinishReason::ToolCalls,
            FinishReason::Stop | FinishReason::StopString => v1::FinishReason::Stop,
            FinishReason::Length => v1::FinishReason::Length,
            FinishReason::Cancelled => v1::FinishReason::Cancelled,
        };
        let s = &output.stats;
        generation_chunk::Kind::Finish(v1::FinishChunk {
            reason: reason as i32,
            usage: Some(v1::Usage {
                prompt_tokens: s.prompt_tokens as u32,
                completion_tokens: s.generated_tokens as u32,
                reasoning_tokens: 0,
                cached_tokens: (s.prompt_tokens - s.prefilled_tokens) as u32,
            }),
            stats: Some(v1::GenerationStats {
                prefill_tokens_per_second: s.prefill_tokens_per_second,
                decode_tokens_per_second: s.decode_tokens_per_second,
                time_to_first_token_ms: s.time_to_first_token_seconds * 1000.0,
                peak_memory_bytes: s.peak_rss_bytes.unwrap_or(0),
            }),
        })
    }
}
