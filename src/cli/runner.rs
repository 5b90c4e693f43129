//! `tessera runner`: one rank of one instance, started by its node's worker
//! as a child process (a crash or out-of-memory here never takes the node
//! down, and memory returns to the OS when it exits). It opens a zenoh client
//! session to its node, follows the `Task`s put on `runner/{id}/tasks`, puts
//! its status on `runner/{id}/events` and, as rank 0, its generation chunks
//! on `chunks/{command_id}`. It walks the runner state machine: Idle →
//! Connecting → Connected → Loading → Loaded → WarmingUp → Ready ⇄ Running →
//! ShuttingDown → Shutdown, Failed from anywhere. It exits when its stdin
//! closes, so a node killed outright leaves no runner behind.

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::Args;
use prost::Message;
use tessera_actors::keys::Keys;
use tessera_actors::node::zenoh_config;
use tessera_actors::placement::shard_from_proto;
use tessera_actors::runner_protocol::{order_from_task, Order};
use tessera_engine::chat_template::ChatMessage;
use tessera_engine::collectives::{Group, SingleRank, TcpRing};
use tessera_engine::executor::Executor;
use tessera_engine::generate::{
    load_transformer, FinishReason, GenerateRequest, GenerationEvent, LoadedModel, Prompt, Session,
};
use tessera_engine::output_parser::ParsedChunk;
use tessera_engine::sampler::SamplingParams;
use tessera_engine::tokenizer::Tokenizer;
use tessera_protos::v1::{self, generation_chunk, runner_status::State as Rs};
use zenoh::Wait;

use super::model_args::resolve_model;

const CONNECT_WAIT: Duration = Duration::from_secs(60);
const STEP_TIMEOUT: Duration = Duration::from_secs(30);
/// Loading progress is reported at most this often (it goes into the log).
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, Args)]
pub struct RunnerArgs {
    #[arg(long)]
    pub runner_id: String,
    /// The node that started this runner.
    #[arg(long)]
    pub node_id: String,
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// The node's zenoh endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub connect: Vec<String>,
    /// The instance, as proto3 JSON.
    #[arg(long)]
    pub instance_json: String,
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// The model's files, as the node's download found them (a GGUF file
    /// or a safetensors folder); without it, the model id is looked up
    /// under `$TESSERA_HOME/models`.
    #[arg(long)]
    pub model_path: Option<PathBuf>,
}

/// The runner's zenoh client session and its keys.
struct Link {
    session: zenoh::Session,
    keys: Keys,
    events: String,
    /// The last status sent, sent again until the node's first order shows
    /// that the node hears this runner: a put made before the client
    /// session has learnt of the node's subscriber is dropped by zenoh.
    last: std::sync::Mutex<Option<v1::RunnerStatus>>,
    heard_from_node: AtomicBool,
}

impl Link {
    fn put<M: Message>(&self, key: &str, message: &M) {
        let sent = self
            .session
            .put(key, message.encode_to_vec())
            .congestion_control(zenoh::qos::CongestionControl::Block)
            .wait();
        if let Err(error) = sent {
            tracing::warn!(%error, key, "publishing");
        }
    }

    fn status(&self, state: Rs) {
        let status = v1::RunnerStatus { state: Some(state) };
        self.put(&self.events, &status);
        if let Ok(mut last) = self.last.lock() {
            *last = Some(status);
        }
    }

    /// Sends the last status again, until the node has been heard from.
    fn repeat_status(&self) {
        if self.heard_from_node.load(Ordering::Relaxed) {
            return;
        }
        let last = self.last.lock().ok().and_then(|l| l.clone());
        if let Some(status) = last {
            self.put(&self.events, &status);
        }
    }

    fn fail(&self, reason: &str) {
        self.status(Rs::Failed(v1::RunnerFailed {
            reason: reason.to_string(),
            diagnostics: String::new(),
        }));
    }

    fn chunk(&self, chunk: &v1::GenerationChunk) {
        match self.keys.chunks(&chunk.command_id) {
            Ok(key) => self.put(&key, chunk),
            Err(error) => tracing::warn!(%error, "a chunk with a bad command id"),
        }
    }

    /// Reports loading progress, at most every [`PROGRESS_EVERY`].
    fn progress(&self) -> impl FnMut(usize, usize) + '_ {
        let mut last: Option<Instant> = None;
        move |done, total| {
            if done < total && last.is_some_and(|at| at.elapsed() < PROGRESS_EVERY) {
                return;
            }
            last = Some(Instant::now());
            self.status(Rs::Loading(v1::RunnerLoading {
                layers_loaded: done as u32,
                layers_total: total as u32,
                bytes_loaded: 0,
            }));
        }
    }
}

/// Waits for the next order (None: the link is gone).
fn next(link: &Link, orders: &mpsc::Receiver<Order>) -> Option<Order> {
    loop {
        match orders.recv_timeout(Duration::from_millis(500)) {
            Ok(order) => {
                link.heard_from_node.store(true, Ordering::Relaxed);
                return Some(order);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => link.repeat_status(),
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
        }
    }
}

pub fn run(args: RunnerArgs) -> anyhow::Result<()> {
    let keys = Keys::new(&args.namespace)?;
    let config = zenoh_config("client", &[], &args.connect, false)?;
    let session = zenoh::open(config)
        .wait()
        .map_err(|e| anyhow!("reaching the node at {}: {e}", args.connect.join(",")))?;
    let link = Link {
        events: keys.runner(&args.runner_id, "events")?,
        keys: keys.clone(),
        session: session.clone(),
        last: std::sync::Mutex::new(None),
        heard_from_node: AtomicBool::new(false),
    };
    // Orders are decoded as they arrive, so a generation can notice a cancel.
    // A rank other than 0 that follows rank 0 reads no orders: a shutdown
    // order ends its process at once.
    let (tx, orders) = mpsc::channel();
    let following = Arc::new(AtomicBool::new(false));
    let following_flag = following.clone();
    let _orders = session
        .declare_subscriber(keys.runner(&args.runner_id, "tasks")?)
        .callback(move |sample| {
            let order = v1::Task::decode(sample.payload().to_bytes().as_ref())
                .map_err(|e| e.to_string())
                .and_then(|task| order_from_task(&task).map_err(|e| e.to_string()));
            match order {
                Ok(Order::Shutdown) if following_flag.load(Ordering::Relaxed) => {
                    tracing::info!("shut down while following rank 0");
                    std::process::exit(0);
                }
                Ok(order) => {
                    let _ = tx.send(order);
                }
                Err(error) => tracing::warn!(error, "dropped an order that does not decode"),
            }
        })
        .wait()
        .map_err(|e| anyhow!("subscribing to orders: {e}"))?;
    // The node holds the other end of stdin: end of file means the node is
    // gone (even killed outright), and so is the reason to run.
    // No log line: stderr went with the node, and a failed write panics.
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut sink);
        std::process::exit(2);
    });
    let result = run_inner(&args, &link, &orders, &following);
    if let Err(error) = &result {
        link.fail(&format!("{error:#}"));
    }
    let _ = session.close().wait();
    result
}

fn run_inner(
    args: &RunnerArgs,
    link: &Link,
    orders: &mpsc::Receiver<Order>,
    following: &AtomicBool,
) -> anyhow::Result<()> {
    let instance: v1::Instance =
        serde_json::from_str(&args.instance_json).context("--instance-json")?;
    let me = instance
        .ranks
        .iter()
        .find(|r| r.runner_id == args.runner_id)
        .with_context(|| format!("runner {} is not in the instance", args.runner_id))?
        .clone();
    let rank = me.rank as usize;
    let world = instance.ranks.len();
    let spec = me
        .shard
        .as_ref()
        .and_then(shard_from_proto)
        .context("the rank has no shard")?;
    let model_id = instance
        .model
        .as_ref()
        .map(|m| m.model_id.clone())
        .context("the instance has no model")?;
    let path = match &args.model_path {
        Some(path) => path.clone(),
        None => resolve_model(&model_id)?,
    };
    // Subscribed: orders sent from now on arrive.
    link.status(Rs::Idle(v1::RunnerIdle {}));

    // Connect (several ranks), then load.
    let mut group: Box<dyn Group> = Box::new(SingleRank);
    // An order may come twice (the node repeats one it thinks was lost).
    let mut connected = false;
    loop {
        match next(link, orders) {
            None | Some(Order::Shutdown) => return shut_down(link),
            Some(Order::Connect) if world > 1 && !connected => {
                link.status(Rs::Connecting(v1::RunnerConnecting {}));
                let addrs = instance
                    .ranks
                    .iter()
                    .map(|r| r.ring_address.parse::<SocketAddr>())
                    .collect::<Result<Vec<_>, _>>()
                    .context("ring addresses")?;
                // The instance id names the ring: a rank of another
                // instance that reaches this port is turned away.
                let ring = TcpRing::connect(
                    rank,
                    &addrs,
                    &instance.instance_id,
                    CONNECT_WAIT,
                    STEP_TIMEOUT,
                )
                .context("joining the instance's ring")?;
                group = Box::new(ring);
                connected = true;
                link.status(Rs::Connected(v1::RunnerConnected {}));
            }
            Some(Order::Load) => break,
            Some(other) => tracing::warn!(?other, "order out of turn, ignored"),
        }
    }
    link.status(Rs::Loading(v1::RunnerLoading::default()));
    if rank != 0 {
        let transformer = load_transformer(&path, &spec, link.progress())?;
        link.status(Rs::Loaded(v1::RunnerLoaded {
            resident_bytes: transformer.weight_bytes() as u64,
        }));
        loop {
            match next(link, orders) {
                None | Some(Order::Shutdown) => return shut_down(link),
                Some(Order::WarmUp) => break,
                Some(other) => tracing::warn!(?other, "order out of turn, ignored"),
            }
        }
        link.status(Rs::WarmingUp(v1::RunnerWarmingUp {}));
        let mut executor = Executor::new(&transformer, args.threads.max(1), group);
        following.store(true, Ordering::Relaxed);
        link.status(Rs::Ready(v1::RunnerReady {}));
        // Follow rank 0 until it shuts down (its runner's end) or fails.
        executor.serve(None, STEP_TIMEOUT)?;
        return shut_down(link);
    }
    let model = LoadedModel::load_shard(&path, Some(&spec), link.progress())?;
    link.status(Rs::Loaded(v1::RunnerLoaded {
        resident_bytes: model.transformer.weight_bytes() as u64,
    }));
    loop {
        match next(link, orders) {
            None | Some(Order::Shutdown) => return shut_down(link),
            Some(Order::WarmUp) => break,
            Some(other) => tracing::warn!(?other, "order out of turn, ignored"),
        }
    }
    link.status(Rs::WarmingUp(v1::RunnerWarmingUp {}));
    let mut session = Session::with_executor(
        &model,
        Executor::new(&model.transformer, args.threads.max(1), group),
    );
    let mut warm = GenerateRequest::new(Prompt::Raw("Hello".into()));
    warm.max_tokens = 2;
    warm.reuse_prefix = false;
    session
        .generate(&warm, |_| ControlFlow::Continue(()))
        .context("warming up")?;
    link.status(Rs::Ready(v1::RunnerReady {}));
    loop {
        match next(link, orders) {
            None | Some(Order::Shutdown) => {
                link.status(Rs::ShuttingDown(v1::RunnerShuttingDown {}));
                session.executor().shutdown().ok();
                drop(session);
                return shut_down(link);
            }
            Some(Order::Generate {
                task_id,
                command_id,
                params,
            }) => {
                tracing::debug!(command_id, "generation order");
                link.status(Rs::Running(v1::RunnerRunning {
                    task_id: task_id.clone(),
                }));
                let mut stop = false;
                if let Err(error) = generate(
                    &mut session,
                    &model.tokenizer,
                    link,
                    orders,
                    &task_id,
                    &command_id,
                    &params,
                    &mut stop,
                ) {
                    tracing::warn!(task_id, "generation failed: {error:#}");
                }
                if stop {
                    link.status(Rs::ShuttingDown(v1::RunnerShuttingDown {}));
                    session.executor().shutdown().ok();
                    drop(session);
                    return shut_down(link);
                }
                // Ready again: the worker takes it as the end of the task.
                link.status(Rs::Ready(v1::RunnerReady {}));
            }
            Some(other) => tracing::debug!(?other, "nothing to do"),
        }
    }
}

fn shut_down(link: &Link) -> anyhow::Result<()> {
    link.status(Rs::Shutdown(v1::RunnerShutdown {}));
    Ok(())
}

fn request_from(params: &v1::TextGenerationParams) -> anyhow::Result<GenerateRequest> {
    let prompt = match &params.raw_prompt {
        Some(text) => Prompt::Raw(text.clone()),
        None => {
            if params.messages.is_empty() {
                bail!("the request has neither messages nor a raw prompt");
            }
            let tools = params
                .tools_json
                .iter()
                .map(|t| serde_json::from_str::<serde_json::Value>(t))
                .collect::<Result<Vec<_>, _>>()
                .context("a tool definition is not JSON")?;
            Prompt::Chat {
                messages: params
                    .messages
                    .iter()
                    .map(chat_message)
                    .collect::<anyhow::Result<_>>()?,
                tools: (!tools.is_empty()).then_some(serde_json::Value::Array(tools)),
            }
        }
    };
    let sampling = params.sampling.clone().unwrap_or_default();
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = sampling.max_tokens.unwrap_or(256) as usize;
    request.stop = sampling.stop.clone();
    request.stop_token_ids = sampling.stop_token_ids.clone();
    request.logprobs = sampling.logprobs;
    let defaults = SamplingParams::default();
    request.sampling = SamplingParams {
        temperature: sampling.temperature.unwrap_or(defaults.temperature),
        top_k: sampling.top_k.map_or(defaults.top_k, |k| k as usize),
        top_p: sampling.top_p.unwrap_or(defaults.top_p),
        min_p: sampling.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: sampling
            .repetition_penalty
            .unwrap_or(defaults.repetition_penalty),
        presence_penalty: sampling
            .presence_penalty
            .unwrap_or(defaults.presence_penalty),
        frequency_penalty: sampling
            .frequency_penalty
            .unwrap_or(defaults.frequency_penalty),
        seed: sampling.seed,
        top_logprobs: sampling.top_logprobs as usize,
        ..defaults
    };
    Ok(request)
}

/// A message of the wire protocol as the chat template takes it (earlier
/// tool calls in OpenAI's shape).
fn chat_message(m: &v1::ChatMessage) -> anyhow::Result<ChatMessage> {
    let tool_calls = if m.tool_calls.is_empty() {
        None
    } else {
        let calls = m
            .tool_calls
            .iter()
            .map(|call| {
                let arguments: serde_json::Value = serde_json::from_str(&call.arguments_json)
                    .with_context(|| format!("the arguments of tool call {:?}", call.name))?;
                Ok(serde_json::json!({
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Some(serde_json::Value::Array(calls))
    };
    Ok(ChatMessage {
        role: m.role.clone(),
        content: m.content.clone(),
        tool_calls,
        tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
        name: (!m.name.is_empty()).then(|| m.name.clone()),
    })
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

/// Runs one generation, streaming chunks; a cancel order stops it. Chunks
/// carry parsed output: answer text, reasoning (flagged) and tool calls;
/// each sampled token's id and logprob ride on the first chunk it released
/// (an empty one if it released nothing).
#[allow(clippy::too_many_arguments)]
fn generate(
    session: &mut Session<'_>,
    tokenizer: &Tokenizer,
    link: &Link,
    orders: &mpsc::Receiver<Order>,
    task_id: &str,
    command_id: &str,
    params: &v1::TextGenerationParams,
    stop: &mut bool,
) -> anyhow::Result<()> {
    let mut seq = 0u64;
    let mut send = |kind: generation_chunk::Kind| {
        link.chunk(&v1::GenerationChunk {
            command_id: command_id.to_string(),
            seq,
            kind: Some(kind),
        });
        seq += 1;
    };
    let request = match request_from(params) {
        Ok(r) => r,
        Err(error) => {
            send(generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: "invalid_request".into(),
                message: format!("{error:#}"),
            }));
            return Err(error);
        }
    };
    let text_of = |id: u32| String::from_utf8_lossy(tokenizer.token_bytes(id)).into_owned();
    let mut pending: Option<PendingToken> = None;
    let mut first_token = true;
    let mut calls = 0usize;
    let mut chunks: Vec<generation_chunk::Kind> = Vec::new();
    let result = session.generate(&request, |event| {
        match orders.try_recv() {
            Ok(Order::Cancel { task_id: cancelled }) if cancelled == task_id => {
                return ControlFlow::Break(());
            }
            // Shutting down ends the generation first.
            Ok(Order::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                *stop = true;
                return ControlFlow::Break(());
            }
            Ok(other) => tracing::warn!(?other, "order during a generation, ignored"),
            Err(mpsc::TryRecvError::Empty) => {}
        }
        match event {
            GenerationEvent::Token {
                id,
                logprob,
                top_logprobs,
                ..
            } => {
                if let Some(previous) = pending.take() {
                    chunks.push(token_chunk(Some(previous), String::new(), false));
                }
                if first_token {
                    first_token = false;
                    tracing::debug!(command_id, "first token sampled");
                }
                pending = Some(PendingToken {
                    id,
                    logprob: request.logprobs.then_some(logprob),
                    top: top_logprobs
                        .iter()
                        .map(|&(token_id, logprob)| v1::TopLogprob {
                            token_id,
                            text: text_of(token_id),
                            logprob,
                        })
                        .collect(),
                });
            }
            GenerationEvent::PrefillProgress { done, total } => chunks.push(
                generation_chunk::Kind::PrefillProgress(v1::PrefillProgressChunk {
                    processed_tokens: done as u32,
                    total_tokens: total as u32,
                }),
            ),
            GenerationEvent::Parsed(parsed) => chunks.push(match parsed {
                ParsedChunk::Text(text) => token_chunk(pending.take(), text.clone(), false),
                ParsedChunk::Reasoning(text) => token_chunk(pending.take(), text.clone(), true),
                ParsedChunk::InvalidToolCall { raw, reason } => {
                    tracing::debug!(reason, "a tool call that does not parse, kept as text");
                    token_chunk(pending.take(), raw.clone(), false)
                }
                ParsedChunk::ToolCall(call) => {
                    calls += 1;
                    generation_chunk::Kind::ToolCall(v1::ToolCallChunk {
                        call: Some(v1::ToolCall {
                            id: format!("call_{}_{calls}", &command_id[..command_id.len().min(8)]),
                            name: call.name.clone(),
                            arguments_json: call.arguments.to_string(),
                        }),
                    })
                }
            }),
        }
        for kind in chunks.drain(..) {
            send(kind);
        }
        ControlFlow::Continue(())
    });
    if let Some(last) = pending.take() {
        send(token_chunk(Some(last), String::new(), false));
    }
    match result {
        Ok(output) => {
            let reason = match output.finish_reason {
                _ if calls > 0 => v1::FinishReason::ToolCalls,
                FinishReason::Stop | FinishReason::StopString => v1::FinishReason::Stop,
                FinishReason::Length => v1::FinishReason::Length,
                FinishReason::Cancelled => v1::FinishReason::Cancelled,
            };
            let s = &output.stats;
            send(generation_chunk::Kind::Finish(v1::FinishChunk {
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
            }));
            Ok(())
        }
        Err(error) => {
            // A prompt beyond the context, a template that fails on these
            // messages: the client's 400, not a server error.
            let kind = if error.is_invalid_request() {
                "invalid_request"
            } else {
                "engine"
            };
            send(generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: kind.into(),
                message: error.to_string(),
            }));
            Err(error.into())
        }
    }
}
