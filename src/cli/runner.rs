//! `tessera runner`: one rank of one instance, started by its node's worker
//! as a child process (a crash or out-of-memory here never takes the node
//! down, and memory returns to the OS when it exits). It follows the worker's
//! orders on stdin and reports on stdout (`runner_protocol`), walking the
//! runner state machine: Idle → Connecting → Connected → Loading → Loaded →
//! WarmingUp → Ready ⇄ Running → ShuttingDown → Shutdown, Failed from
//! anywhere.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tessera_actors::placement::shard_from_proto;
use tessera_actors::runner_protocol::{FromRunner, ToRunner};
use tessera_engine::chat_template::ChatMessage;
use tessera_engine::collectives::{Group, SingleRank, TcpRing};
use tessera_engine::executor::Executor;
use tessera_engine::generate::{
    load_transformer, FinishReason, GenerateRequest, GenerationEvent, LoadedModel, Prompt, Session,
};
use tessera_engine::sampler::SamplingParams;
use tessera_protos::v1::{self, generation_chunk, runner_status::State as Rs};

use super::model_args::resolve_model;

const CONNECT_WAIT: Duration = Duration::from_secs(60);
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub struct RunnerArgs {
    #[arg(long)]
    pub runner_id: String,
    /// The instance, as proto3 JSON.
    #[arg(long)]
    pub instance_json: String,
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
}

fn send(message: &FromRunner) {
    if let Ok(line) = serde_json::to_string(message) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

fn status(state: Rs) {
    send(&FromRunner::Status {
        status: v1::RunnerStatus { state: Some(state) },
    });
}

fn fail(reason: &str) {
    status(Rs::Failed(v1::RunnerFailed {
        reason: reason.to_string(),
        diagnostics: String::new(),
    }));
}

/// Waits for the next order (None: the worker is gone).
fn next(orders: &mpsc::Receiver<ToRunner>) -> Option<ToRunner> {
    orders.recv().ok()
}

pub fn run(args: RunnerArgs) -> anyhow::Result<()> {
    let result = run_inner(&args);
    if let Err(error) = &result {
        fail(&format!("{error:#}"));
    }
    result
}

fn run_inner(args: &RunnerArgs) -> anyhow::Result<()> {
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
    let path = resolve_model(&model_id)?;

    // Orders arrive on stdin, read on their own thread so that a
    // generation can notice a cancel.
    let (tx, orders) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            match serde_json::from_str::<ToRunner>(&line) {
                Ok(order) => {
                    if tx.send(order).is_err() {
                        break;
                    }
                }
                Err(error) => tracing::warn!(%error, "ignored an order that does not parse"),
            }
        }
    });
    status(Rs::Idle(v1::RunnerIdle {}));

    // Connect (several ranks), then load.
    let mut group: Box<dyn Group> = Box::new(SingleRank);
    loop {
        match next(&orders) {
            None | Some(ToRunner::Shutdown) => return shut_down(),
            Some(ToRunner::Connect) if world > 1 => {
                status(Rs::Connecting(v1::RunnerConnecting {}));
                let addrs = instance
                    .ranks
                    .iter()
                    .map(|r| r.ring_address.parse::<SocketAddr>())
                    .collect::<Result<Vec<_>, _>>()
                    .context("ring addresses")?;
                let ring = TcpRing::connect(rank, &addrs, CONNECT_WAIT, STEP_TIMEOUT)
                    .context("joining the instance's ring")?;
                group = Box::new(ring);
                status(Rs::Connected(v1::RunnerConnected {}));
            }
            Some(ToRunner::Load) => break,
            Some(other) => tracing::warn!(?other, "order out of turn, ignored"),
        }
    }
    status(Rs::Loading(v1::RunnerLoading::default()));
    if rank != 0 {
        let transformer = load_transformer(&path, &spec, |_, _| {})?;
        status(Rs::Loaded(v1::RunnerLoaded {
            resident_bytes: transformer.weight_bytes() as u64,
        }));
        loop {
            match next(&orders) {
                None | Some(ToRunner::Shutdown) => return shut_down(),
                Some(ToRunner::WarmUp) => break,
                Some(other) => tracing::warn!(?other, "order out of turn, ignored"),
            }
        }
        status(Rs::WarmingUp(v1::RunnerWarmingUp {}));
        let mut executor = Executor::new(&transformer, args.threads.max(1), group);
        status(Rs::Ready(v1::RunnerReady {}));
        // Follow rank 0 until it shuts down (its runner's end) or fails.
        executor.serve(None, STEP_TIMEOUT)?;
        return shut_down();
    }
    let model = LoadedModel::load_shard(&path, Some(&spec), |_, _| {})?;
    status(Rs::Loaded(v1::RunnerLoaded {
        resident_bytes: model.transformer.weight_bytes() as u64,
    }));
    loop {
        match next(&orders) {
            None | Some(ToRunner::Shutdown) => return shut_down(),
            Some(ToRunner::WarmUp) => break,
            Some(other) => tracing::warn!(?other, "order out of turn, ignored"),
        }
    }
    status(Rs::WarmingUp(v1::RunnerWarmingUp {}));
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
    status(Rs::Ready(v1::RunnerReady {}));
    loop {
        match next(&orders) {
            None | Some(ToRunner::Shutdown) => {
                status(Rs::ShuttingDown(v1::RunnerShuttingDown {}));
                session.executor().shutdown().ok();
                drop(session);
                return shut_down();
            }
            Some(ToRunner::Generate {
                task_id,
                command_id,
                params,
            }) => {
                status(Rs::Running(v1::RunnerRunning {
                    task_id: task_id.clone(),
                }));
                let mut stop = false;
                let error = generate(
                    &mut session,
                    &orders,
                    &task_id,
                    &command_id,
                    &params,
                    &mut stop,
                )
                .err()
                .map(|e| format!("{e:#}"));
                send(&FromRunner::Finished { task_id, error });
                if stop {
                    status(Rs::ShuttingDown(v1::RunnerShuttingDown {}));
                    session.executor().shutdown().ok();
                    drop(session);
                    return shut_down();
                }
                status(Rs::Ready(v1::RunnerReady {}));
            }
            Some(other) => tracing::debug!(?other, "nothing to do"),
        }
    }
}

fn shut_down() -> anyhow::Result<()> {
    status(Rs::Shutdown(v1::RunnerShutdown {}));
    Ok(())
}

fn request_from(params: &v1::TextGenerationParams) -> anyhow::Result<GenerateRequest> {
    let prompt = match &params.raw_prompt {
        Some(text) => Prompt::Raw(text.clone()),
        None => {
            if params.messages.is_empty() {
                bail!("the request has neither messages nor a raw prompt");
            }
            Prompt::Chat {
                messages: params
                    .messages
                    .iter()
                    .map(|m| ChatMessage {
                        role: m.role.clone(),
                        content: m.content.clone(),
                        tool_calls: None,
                        tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
                        name: (!m.name.is_empty()).then(|| m.name.clone()),
                    })
                    .collect(),
                tools: None,
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

/// Runs one generation, streaming chunks; a cancel order stops it.
fn generate(
    session: &mut Session<'_>,
    orders: &mpsc::Receiver<ToRunner>,
    task_id: &str,
    command_id: &str,
    params: &v1::TextGenerationParams,
    stop: &mut bool,
) -> anyhow::Result<()> {
    let mut seq = 0u64;
    let mut chunk = |kind: generation_chunk::Kind| {
        send(&FromRunner::Chunk {
            chunk: v1::GenerationChunk {
                command_id: command_id.to_string(),
                seq,
                kind: Some(kind),
            },
        });
        seq += 1;
    };
    let request = match request_from(params) {
        Ok(r) => r,
        Err(error) => {
            chunk(generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: "invalid_request".into(),
                message: format!("{error:#}"),
            }));
            return Err(error);
        }
    };
    let result = session.generate(&request, |event| {
        match orders.try_recv() {
            Ok(ToRunner::Cancel { task_id: cancelled }) if cancelled == task_id => {
                return ControlFlow::Break(());
            }
            // Shutting down ends the generation first.
            Ok(ToRunner::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                *stop = true;
                return ControlFlow::Break(());
            }
            Ok(other) => tracing::warn!(?other, "order during a generation, ignored"),
            Err(mpsc::TryRecvError::Empty) => {}
        }
        match event {
            GenerationEvent::Token {
                id, text, logprob, ..
            } => chunk(generation_chunk::Kind::Token(v1::TokenChunk {
                token_id: id,
                text: text.to_string(),
                reasoning: false,
                logprob: request.logprobs.then_some(logprob),
                top_logprobs: Vec::new(),
            })),
            GenerationEvent::PrefillProgress { done, total } => chunk(
                generation_chunk::Kind::PrefillProgress(v1::PrefillProgressChunk {
                    processed_tokens: done as u32,
                    total_tokens: total as u32,
                }),
            ),
            GenerationEvent::Parsed(_) => {}
        }
        ControlFlow::Continue(())
    });
    match result {
        Ok(output) => {
            let reason = match output.finish_reason {
                FinishReason::Stop | FinishReason::StopString => v1::FinishReason::Stop,
                FinishReason::Length => v1::FinishReason::Length,
                FinishReason::Cancelled => v1::FinishReason::Cancelled,
            };
            let s = &output.stats;
            chunk(generation_chunk::Kind::Finish(v1::FinishChunk {
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
            chunk(generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: "engine".into(),
                message: error.to_string(),
            }));
            Err(error.into())
        }
    }
}
