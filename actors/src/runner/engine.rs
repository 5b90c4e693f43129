//! The [`Backend`] over tessera's own engine: a ring of TCP connections
//! between ranks, this rank's shard of the weights, and (rank 0) a
//! continuous [`Batch`] whose sequences' events become protobuf chunks: answer text,
//! reasoning (flagged) and tool calls, each sampled token's id and logprob
//! riding on the first chunk it released (an empty one if it released
//! nothing).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tessera_engine::dist::collectives::{Group, SingleRank, TcpRing};
use tessera_engine::dist::shard::ShardSpec;
use tessera_engine::gpu::DeviceChoice;
use tessera_engine::model::paged::blocks_for;
use tessera_engine::model::Transformer;
use tessera_engine::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::speculative::{check_draft_vocabulary, DraftSource, Speculation};
use tessera_engine::serve::{
    load_transformer, EngineError, FinishReason, GenerateRequest, GenerationEvent,
    GenerationOutput, LoadedModel, Prompt,
};
use tessera_engine::text::output_parser::ParsedChunk;
use tessera_engine::text::tokenizer::Tokenizer;
use tessera_protos::v1::{self, generation_chunk};

use super::backend::{Backend, BackendError, EngineEvent};
use super::embedder::EmbedHead;
use super::request::EmbedRequest;
use crate::worker::runner_protocol::DraftOrder;
use tessera_engine::embed::Embedder;

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
    /// What the ranks prove to each other, and whether frames are sealed.
    pub ring_security: tessera_engine::dist::ring_security::RingSecurity,
    pub threads: usize,
    /// Where the shard runs.
    pub device: tessera_engine::gpu::DeviceChoice,
    /// Generations in one batch at once (the instance's `max_concurrent`).
    pub max_concurrent: usize,
    /// The model makes embeddings (a sentence-transformers folder), not
    /// text: one rank, no ring.
    pub embedding: bool,
}

/// KV positions the pool holds per concurrent sequence: a request may use
/// more (up to the whole pool) while others use less.
pub const KV_POSITIONS_PER_SEQUENCE: usize = 2048;

/// What is loaded. A runner process loads one shard once and keeps it
/// until it exits, so the weights are leaked to a `'static` borrow that the
/// batch and executor can hold.
enum Loaded {
    Nothing,
    Head(&'static LoadedModel),
    Follower(&'static Transformer),
    Embedder(&'static Embedder),
}

/// A generation in the batch.
struct Generation {
    task_id: String,
    chunks: ChunkWriter<'static>,
}

/// Rank 0 once warmed up: the batch and its generations.
struct Head {
    batch: Batch<'static>,
    /// The target (for a draft's vocabulary check).
    model: &'static LoadedModel,
    /// The draft model loaded, and its files: kept while the batch drafts
    /// with it (and for a new token count), dropped when the draft goes.
    draft_model: Option<(PathBuf, Arc<LoadedModel>)>,
    tokenizer: &'static Tokenizer,
    generations: HashMap<SeqId, Generation>,
    next_id: SeqId,
}

pub struct EngineBackend {
    setup: EngineSetup,
    group: Option<Box<dyn Group>>,
    loaded: Loaded,
    /// Rank 0, once warmed up.
    head: Option<Head>,
    /// Other ranks, once warmed up.
    follower: Option<Executor<'static>>,
    /// An embedding model, once warmed up.
    embedder: Option<EmbedHead>,
}

/// The KV blocks this shard's memory holds: a shard on a GPU keeps its
/// keys and values there, at most what the adapter holds beside the
/// weights; the CPU's pool is planned by sequences and context alone.
fn kv_blocks_held(transformer: &Transformer) -> usize {
    transformer.gpu_kv_blocks().unwrap_or(usize::MAX)
}

/// Puts a loaded shard on `device`, saying where it went.
fn place(transformer: &mut Transformer, device: DeviceChoice) -> Result<(), BackendError> {
    let placed = transformer
        .use_device(device)
        .map_err(|e| BackendError::Engine(format!("--device {device}: {e}")))?;
    tracing::info!(device = %placed, "the shard is placed");
    Ok(())
}

fn engine_error(error: impl std::fmt::Display) -> BackendError {
    BackendError::Engine(format!("{error:#}"))
}

fn request_error(error: EngineError) -> BackendError {
    if error.is_invalid_request() {
        BackendError::InvalidRequest(error.to_string())
    } else {
        BackendError::Engine(error.to_string())
    }
}

impl EngineBackend {
    pub fn new(setup: EngineSetup) -> Self {
        Self {
            setup,
            group: None,
            loaded: Loaded::Nothing,
            head: None,
            follower: None,
            embedder: None,
        }
    }

    fn take_group(&mut self) -> Box<dyn Group> {
        self.group.take().unwrap_or_else(|| Box::new(SingleRank))
    }

    fn threads(&self) -> usize {
        self.setup.threads.max(1)
    }

    /// The batch's settings; `held`: the KV blocks every rank's memory
    /// holds ([`Executor::least_kv_blocks`]).
    fn batch_config(&self, model: &LoadedModel, held: usize) -> BatchConfig {
        let sequences = self.setup.max_concurrent.max(1);
        let context = model.transformer.config.context_length;
        let planned = sequences * blocks_for(context.min(KV_POSITIONS_PER_SEQUENCE));
        BatchConfig {
            kv_blocks: planned.min(held),
            ..BatchConfig::for_context(sequences, context)
        }
    }
}

impl Backend for EngineBackend {
    fn connect(&mut self) -> Result<(), BackendError> {
        let ring = TcpRing::connect_secured(
            self.setup.rank,
            &self.setup.ring,
            &self.setup.ring_id,
            &self.setup.ring_security,
            CONNECT_WAIT,
            STEP_TIMEOUT,
        )
        .map_err(|e| BackendError::Engine(format!("joining the instance's ring: {e}")))?;
        self.group = Some(Box::new(ring));
        Ok(())
    }

    fn load(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<u64, BackendError> {
        let setup = &self.setup;
        if setup.embedding {
            if setup.rank != 0 || !setup.ring.is_empty() {
                return Err(BackendError::Engine(
                    "an embedding model runs on one rank".into(),
                ));
            }
            progress(0, 1);
            let embedder = Embedder::load(&setup.path).map_err(engine_error)?;
            progress(1, 1);
            let embedder: &'static Embedder = Box::leak(Box::new(embedder));
            self.loaded = Loaded::Embedder(embedder);
            return Ok(embedder.weight_bytes() as u64);
        }
        if setup.rank == 0 {
            let mut model = LoadedModel::load_shard(&setup.path, Some(&setup.spec), progress)
                .map_err(engine_error)?;
            place(&mut model.transformer, setup.device)?;
            let model: &'static LoadedModel = Box::leak(Box::new(model));
            self.loaded = Loaded::Head(model);
            Ok(model.transformer.weight_bytes() as u64)
        } else {
            let mut transformer =
                load_transformer(&setup.path, &setup.spec, progress).map_err(engine_error)?;
            place(&mut transformer, setup.device)?;
            let transformer: &'static Transformer = Box::leak(Box::new(transformer));
            self.loaded = Loaded::Follower(transformer);
            Ok(transformer.weight_bytes() as u64)
        }
    }

    fn warm_up(&mut self) -> Result<(), BackendError> {
        let threads = self.threads();
        match self.loaded {
            Loaded::Nothing => Err(BackendError::Engine("warming up before loading".into())),
            Loaded::Embedder(embedder) => {
                self.embedder = Some(EmbedHead::warm(embedder, threads));
                Ok(())
            }
            Loaded::Follower(transformer) => {
                let group = self.take_group();
                let mut executor = Executor::new(transformer, threads, group);
                executor
                    .least_kv_blocks(kv_blocks_held(transformer))
                    .map_err(|e| {
                        BackendError::Engine(format!("telling rank 0 the KV budget: {e}"))
                    })?;
                self.follower = Some(executor);
                Ok(())
            }
            Loaded::Head(model) => {
                let group = self.take_group();
                let mut executor = Executor::new(&model.transformer, threads, group);
                let least = executor
                    .least_kv_blocks(kv_blocks_held(&model.transformer))
                    .map_err(|e| BackendError::Engine(format!("agreeing on a KV budget: {e}")))?;
                let mut batch = Batch::new(model, executor, self.batch_config(model, least));
                warm(&mut batch).map_err(|e| BackendError::Engine(format!("warming up: {e}")))?;
                self.head = Some(Head {
                    batch,
                    model,
                    draft_model: None,
                    tokenizer: &model.tokenizer,
                    generations: HashMap::new(),
                    next_id: 1,
                });
                Ok(())
            }
        }
    }

    fn submit(
        &mut self,
        task_id: &str,
        command_id: &str,
        request: GenerateRequest,
    ) -> Result<(), BackendError> {
        if self.embedder.is_some() {
            return Err(BackendError::InvalidRequest(
                "this is an embedding model: it makes vectors (/v1/embeddings, /api/embed), \
                 not text"
                    .into(),
            ));
        }
        let head = self
            .head
            .as_mut()
            .ok_or_else(|| BackendError::Engine("generating before warming up".into()))?;
        let id = head.next_id;
        let logprobs = request.logprobs;
        head.batch.submit(id, request).map_err(request_error)?;
        head.next_id += 1;
        head.generations.insert(
            id,
            Generation {
                task_id: task_id.to_string(),
                chunks: ChunkWriter::new(head.tokenizer, command_id, logprobs),
            },
        );
        Ok(())
    }

    fn submit_embedding(
        &mut self,
        task_id: &str,
        request: EmbedRequest,
    ) -> Result<(), BackendError> {
        match self.embedder.as_mut() {
            Some(embedder) => embedder.submit(task_id, request),
            None if self.head.is_some() => Err(BackendError::InvalidRequest(
                "this model makes text, not embeddings".into(),
            )),
            None => Err(BackendError::Engine("embedding before warming up".into())),
        }
    }

    fn cancel(&mut self, task_id: &str) {
        if let Some(embedder) = self.embedder.as_mut() {
            embedder.cancel(task_id);
        }
        if let Some(head) = self.head.as_mut() {
            let found = head
                .generations
                .iter()
                .find(|(_, g)| g.task_id == task_id)
                .map(|(id, _)| *id);
            if let Some(id) = found {
                head.batch.cancel(id);
            }
        }
    }

    fn set_draft(&mut self, draft: Option<&DraftOrder>) -> Result<u64, BackendError> {
        let head = self
            .head
            .as_mut()
            .ok_or_else(|| BackendError::Engine("drafting before warming up".into()))?;
        let Some(order) = draft else {
            head.batch.set_speculation(None);
            head.draft_model = None;
            return Ok(0);
        };
        if head.model.transformer.has_recurrent_state()
            && order.method != v1::DraftMethod::Unspecified
        {
            return Err(BackendError::Engine(
                "speculative decoding is not supported for hybrid (linear-attention) models: \
                 their recurrent state cannot be rolled back past rejected drafts"
                    .into(),
            ));
        }
        let (source, bytes) = match order.method {
            v1::DraftMethod::DraftModel => {
                let model = head.draft_model(order)?;
                if model.transformer.has_recurrent_state() {
                    return Err(BackendError::Engine(
                        "a hybrid (linear-attention) model cannot be a draft model: its \
                         recurrent state cannot be rolled back past rejected drafts"
                            .into(),
                    ));
                }
                let bytes = model.transformer.weight_bytes() as u64;
                (DraftSource::Model(model), bytes)
            }
            v1::DraftMethod::Ngram => {
                head.draft_model = None;
                (DraftSource::Ngram, 0)
            }
            v1::DraftMethod::Unspecified => {
                head.batch.set_speculation(None);
                head.draft_model = None;
                return Ok(0);
            }
        };
        head.batch
            .set_speculation(Some(Speculation::new(source, order.tokens as usize)));
        Ok(bytes)
    }

    fn busy(&self) -> bool {
        self.head.as_ref().is_some_and(|h| !h.batch.is_idle())
            || self.embedder.as_ref().is_some_and(EmbedHead::busy)
    }

    fn step(&mut self, sink: &mut dyn FnMut(EngineEvent)) {
        if let Some(embedder) = self.embedder.as_mut() {
            embedder.step(sink);
            return;
        }
        let Some(head) = self.head.as_mut() else {
            return;
        };
        let generations = &mut head.generations;
        let result = head
            .batch
            .step(&mut |id, event| on_seq_event(generations, id, event, sink));
        if let Err(error) = result {
            tracing::warn!("a batch step failed: {error}");
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
        if let Some(head) = self.head.as_mut() {
            head.batch.executor().shutdown().map_err(engine_error)?;
        }
        self.head = None;
        Ok(())
    }
}

impl Head {
    /// The draft model `order` names: the one loaded if its files are the
    /// same, else loaded now (speculation off meanwhile, the old one
    /// dropped first) and checked against the target's vocabulary. A
    /// refusal leaves speculation off and no draft loaded.
    fn draft_model(&mut self, order: &DraftOrder) -> Result<Arc<LoadedModel>, BackendError> {
        let path = order.path.clone().ok_or_else(|| {
            BackendError::InvalidRequest(format!(
                "the files of draft model {} are not on this node",
                order.model_id
            ))
        })?;
        if let Some((loaded, model)) = &self.draft_model {
            if *loaded == path {
                return Ok(model.clone());
            }
        }
        self.batch.set_speculation(None);
        self.draft_model = None;
        let draft = LoadedModel::load(&path, |_, _| {}).map_err(|e| {
            BackendError::Engine(format!("loading draft model {}: {e}", order.model_id))
        })?;
        check_draft_vocabulary(self.model, &draft).map_err(|e| {
            BackendError::InvalidRequest(format!("draft model {} refused: {e}", order.model_id))
        })?;
        let draft = Arc::new(draft);
        self.draft_model = Some((path, draft.clone()));
        Ok(draft)
    }
}

/// A tiny generation through the batch, so the first request pays no
/// first-touch costs.
fn warm(batch: &mut Batch<'_>) -> Result<(), EngineError> {
    let mut warm = GenerateRequest::new(Prompt::Raw("Hello".into()));
    warm.max_tokens = 2;
    warm.reuse_prefix = false;
    batch.submit(0, warm)?;
    while !batch.is_idle() {
        batch.step(&mut |_, _| ControlFlow::Continue(()))?;
    }
    batch.clear_cache();
    Ok(())
}

/// One sequence's event as the runner's events: chunks, then its end.
fn on_seq_event(
    generations: &mut HashMap<SeqId, Generation>,
    id: SeqId,
    event: SeqEvent<'_>,
    sink: &mut dyn FnMut(EngineEvent),
) -> ControlFlow<()> {
    let Some(generation) = generations.get_mut(&id) else {
        return ControlFlow::Continue(());
    };
    let task_id = generation.task_id.clone();
    let mut chunk = |kind| {
        sink(EngineEvent::Chunk {
            task_id: task_id.clone(),
            kind,
        })
    };
    match event {
        SeqEvent::Generation(event) => generation.chunks.on_event(event, &mut chunk),
        SeqEvent::Finished(output) => {
            generation.chunks.flush(&mut chunk);
            chunk(generation.chunks.finish(&output));
            generations.remove(&id);
            sink(EngineEvent::Generated {
                task_id,
                result: Ok(()),
            });
        }
        SeqEvent::Failed(message) => {
            generation.chunks.flush(&mut chunk);
            generations.remove(&id);
            sink(EngineEvent::Generated {
                task_id,
                result: Err(BackendError::Engine(message.to_string())),
            });
        }
    }
    ControlFlow::Continue(())
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
        // Cut by the limit is "length" even after a whole call (as OpenAI
        // says of a truncated answer); an answer that ended with calls is
        // "tool_calls".
        let reason = match output.finish_reason {
            FinishReason::Length => v1::FinishReason::Length,
            FinishReason::Cancelled => v1::FinishReason::Cancelled,
            _ if self.calls > 0 => v1::FinishReason::ToolCalls,
            FinishReason::Stop | FinishReason::StopString => v1::FinishReason::Stop,
        };
        let s = &output.stats;
        generation_chunk::Kind::Finish(v1::FinishChunk {
            reason: reason as i32,
            usage: Some(v1::Usage {
                prompt_tokens: s.prompt_tokens as u32,
                completion_tokens: s.generated_tokens as u32,
                reasoning_tokens: 0,
                cached_tokens: (s.prompt_tokens - s.prefilled_tokens) as u32,
                draft_tokens: s.draft_tokens as u32,
                accepted_draft_tokens: s.accepted_draft_tokens as u32,
                decode_steps: s.decode_steps as u32,
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
