//! The Runner actor, inside a `tessera runner` child process: one rank of
//! one instance. It owns the runner's state machine (Idle → Connecting →
//! Connected → Loading → Loaded → WarmingUp → Ready ⇄ Running →
//! ShuttingDown → Shutdown, Failed from anywhere), takes its node's orders,
//! and drives the engine through the [`Backend`] on the engine's own
//! thread, so its mailbox never waits on a forward pass: generations join
//! the engine's batch as they come, and a cancel or a shutdown is taken in
//! while they run. Its status names every generation in the batch and the
//! ones that ended lately, which is how the node learns each one's end. Statuses and chunks go out
//! through a [`RunnerOutput`] (zenoh in a node, a channel in tests).

pub mod backend;
mod embedder;
pub mod engine;
pub mod request;
pub mod zenoh_link;

use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tessera_protos::v1::{self, generation_chunk, runner_status::State as Rs};
use tokio::sync::oneshot;

use crate::worker::runner_protocol::{DraftOrder, Order};
use backend::{spawn_engine, Backend, BackendError, EngineCommand, EngineEvent, EngineHandle};

/// The last status is put again this often until the node is heard from:
/// a put made before the client session has learnt of the node's
/// subscriber is dropped by zenoh.
const REPEAT_STATUS: Duration = Duration::from_millis(500);

/// Ended generations a status names: enough to outlast any delay between
/// an order and the status that follows it.
const ENDED_REMEMBERED: usize = 32;

/// Where the runner's statuses and chunks go.
pub trait RunnerOutput: Send + Sync + 'static {
    fn status(&self, status: &v1::RunnerStatus) -> impl Future<Output = ()> + Send;
    fn chunk(&self, chunk: &v1::GenerationChunk) -> impl Future<Output = ()> + Send;
}

/// How a runner ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunnerExit {
    /// Shut down as ordered (or rank 0 ended the instance).
    Shutdown,
    /// The node that started it is gone.
    NodeGone,
    Failed(String),
}

pub enum RunnerMsg {
    /// Orders can reach the runner now: it says it is Idle.
    Listening,
    Order(Order),
    Engine(EngineEvent),
    RepeatStatus,
    /// The node's end of the lifeline has closed.
    NodeGone,
}

/// Where the runner stands.
#[derive(Debug)]
enum Phase {
    Idle,
    Connecting,
    Connected,
    Loading,
    Loaded,
    WarmingUp,
    /// Rank 0, taking generations (Running while any are in the batch).
    Ready,
    /// Other ranks, once ready: the engine thread follows rank 0.
    Following,
    ShuttingDown,
}

#[derive(Debug)]
struct Run {
    task_id: String,
    command_id: String,
    /// The next chunk's number.
    seq: u64,
}

pub struct RunnerArgs<O, F> {
    /// This runner's rank in its instance, and the instance's size.
    pub rank: usize,
    pub world: usize,
    pub output: O,
    /// Builds the backend, on the engine thread.
    pub backend: F,
    /// Told how the runner ended.
    pub exit: oneshot::Sender<RunnerExit>,
}

pub struct RunnerState<O> {
    rank: usize,
    world: usize,
    output: O,
    engine: EngineHandle,
    phase: Phase,
    last_status: Option<v1::RunnerStatus>,
    heard_from_node: bool,
    exit: Option<oneshot::Sender<RunnerExit>>,
    /// How it ends, once it does.
    ending: Option<RunnerExit>,
    /// Generations in the batch, oldest first.
    runs: Vec<Run>,
    /// Generations that ended lately, newest last.
    ended: VecDeque<String>,
    /// A shutdown came while generations ran: stop once they have ended.
    then_shut_down: bool,
    /// Rank 0: the draft it was last told, as set (or refused); its status
    /// names it.
    draft: Option<v1::RunnerDraft>,
    /// Drafts sent to the engine thread and not yet set, oldest first (an
    /// order repeated meanwhile is not sent again).
    drafts_asked: VecDeque<Option<DraftOrder>>,
}

/// The actor; its types are the output, the backend and what builds it.
#[allow(clippy::type_complexity)]
pub struct Runner<O, B, F>(PhantomData<fn() -> (O, B, F)>);

impl<O, B, F> Default for Runner<O, B, F> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<O, B, F> Actor for Runner<O, B, F>
where
    O: RunnerOutput,
    B: Backend + 'static,
    F: FnOnce() -> B + Send + 'static,
{
    type Msg = RunnerMsg;
    type State = RunnerState<O>;
    type Arguments = RunnerArgs<O, F>;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let me = myself.clone();
        let engine = spawn_engine(args.backend, move |event| {
            let _ = me.cast(RunnerMsg::Engine(event));
        })?;
        myself.send_interval(REPEAT_STATUS, || RunnerMsg::RepeatStatus);
        Ok(RunnerState {
            rank: args.rank,
            world: args.world,
            output: args.output,
            engine,
            phase: Phase::Idle,
            last_status: None,
            heard_from_node: false,
            exit: Some(args.exit),
            ending: None,
            runs: Vec::new(),
            ended: VecDeque::new(),
            then_shut_down: false,
            draft: None,
            drafts_asked: VecDeque::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: RunnerMsg,
        state: &mut RunnerState<O>,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            RunnerMsg::Listening => state.status(Rs::Idle(v1::RunnerIdle {})).await,
            RunnerMsg::Order(order) => {
                state.heard_from_node = true;
                state.on_order(order).await;
            }
            RunnerMsg::Engine(event) => state.on_engine(event).await,
            RunnerMsg::RepeatStatus => state.repeat_status().await,
            RunnerMsg::NodeGone => state.ending = Some(RunnerExit::NodeGone),
        }
        if state.ending.is_some() {
            myself.stop(None);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<Self::Msg>,
        state: &mut RunnerState<O>,
    ) -> Result<(), ActorProcessingErr> {
        let ending = state.ending.take().unwrap_or(RunnerExit::Shutdown);
        if let Some(exit) = state.exit.take() {
            let _ = exit.send(ending);
        }
        Ok(())
    }
}

impl<O: RunnerOutput> RunnerState<O> {
    async fn status(&mut self, state: Rs) {
        let status = v1::RunnerStatus { state: Some(state) };
        self.output.status(&status).await;
        self.last_status = Some(status);
    }

    async fn repeat_status(&self) {
        if self.heard_from_node {
            return;
        }
        if let Some(status) = &self.last_status {
            self.output.status(status).await;
        }
    }

    /// Tells the engine thread; a thread that is gone fails the runner.
    async fn engine(&mut self, command: EngineCommand) {
        if !self.engine.send(command) {
            self.fail("the engine thread has stopped".into()).await;
        }
    }

    async fn fail(&mut self, reason: String) {
        tracing::warn!(reason, "runner failed");
        self.status(Rs::Failed(v1::RunnerFailed {
            reason: reason.clone(),
            diagnostics: String::new(),
        }))
        .await;
        self.ending = Some(RunnerExit::Failed(reason));
    }

    async fn shut_down(&mut self) {
        self.status(Rs::Shutdown(v1::RunnerShutdown {})).await;
        self.ending = Some(RunnerExit::Shutdown);
    }

    /// An order may come twice (the node repeats one it thinks was lost),
    /// or out of turn: either is ignored.
    async fn on_order(&mut self, order: Order) {
        match (&mut self.phase, order) {
            (_, Order::Shutdown) => self.on_shutdown().await,
            (Phase::Idle, Order::Connect) if self.world > 1 => {
                self.phase = Phase::Connecting;
                self.status(Rs::Connecting(v1::RunnerConnecting {})).await;
                self.engine(EngineCommand::Connect).await;
            }
            (Phase::Connected, Order::Load) => self.load().await,
            (Phase::Idle, Order::Load) if self.world == 1 => self.load().await,
            (Phase::Loaded, Order::WarmUp) => {
                self.phase = Phase::WarmingUp;
                self.status(Rs::WarmingUp(v1::RunnerWarmingUp {})).await;
                self.engine(EngineCommand::WarmUp).await;
            }
            (
                Phase::Ready,
                Order::Generate {
                    task_id,
                    command_id,
                    params,
                },
            ) if !self.then_shut_down => self.start_run(task_id, command_id, &params).await,
            (Phase::Ready, Order::SetDraft(draft)) if !self.then_shut_down => {
                self.set_draft(draft).await;
            }
            (Phase::Ready, Order::Cancel { task_id }) => {
                if self.has_run(&task_id) {
                    self.engine(EngineCommand::Cancel { task_id }).await;
                }
            }
            (phase, order) => tracing::debug!(?phase, ?order, "order out of turn, ignored"),
        }
    }

    async fn load(&mut self) {
        self.phase = Phase::Loading;
        self.status(Rs::Loading(v1::RunnerLoading::default())).await;
        self.engine(EngineCommand::Load).await;
    }

    /// Asks the engine thread for `asked`, unless it is what runs (or is
    /// refused) already, or what is on its way.
    async fn set_draft(&mut self, asked: Option<DraftOrder>) {
        let latest = match self.drafts_asked.back() {
            Some(pending) => pending.as_ref().map(draft_status),
            None => self.draft.clone(),
        };
        if same_draft(latest.as_ref(), asked.as_ref()) {
            return;
        }
        tracing::info!(?asked, "speculative decoding");
        self.drafts_asked.push_back(asked.clone());
        self.engine(EngineCommand::SetDraft(asked)).await;
    }

    /// A draft set, or refused: the status names it, with why if refused.
    async fn on_draft_set(&mut self, asked: Option<DraftOrder>, result: Result<u64, BackendError>) {
        if self.drafts_asked.front() == Some(&asked) {
            self.drafts_asked.pop_front();
        }
        self.draft = asked.as_ref().map(|order| {
            let mut status = draft_status(order);
            match &result {
                Ok(bytes) => {
                    status.active = true;
                    status.resident_bytes = *bytes;
                }
                Err(error) => {
                    tracing::warn!(%error, "the draft was refused");
                    status.error = error.to_string();
                }
            }
            status
        });
        if matches!(self.phase, Phase::Ready) && !self.then_shut_down {
            self.status(self.batch_status()).await;
        }
    }

    fn has_run(&self, task_id: &str) -> bool {
        self.runs.iter().any(|r| r.task_id == task_id)
    }

    async fn on_shutdown(&mut self) {
        match &mut self.phase {
            // The generations end first (as cancelled), then the rest.
            Phase::Ready if !self.runs.is_empty() => {
                self.then_shut_down = true;
                let cancels: Vec<String> = self.runs.iter().map(|r| r.task_id.clone()).collect();
                for task_id in cancels {
                    self.engine(EngineCommand::Cancel { task_id }).await;
                }
            }
            // Rank 0 tells the other ranks to leave the ring.
            Phase::Ready => self.begin_shutdown().await,
            Phase::ShuttingDown => {}
            // Loading, joining or following is not waited for: the process
            // ends, and the engine thread with it.
            _ => self.shut_down().await,
        }
    }

    async fn begin_shutdown(&mut self) {
        self.phase = Phase::ShuttingDown;
        self.status(Rs::ShuttingDown(v1::RunnerShuttingDown {}))
            .await;
        self.engine(EngineCommand::Shutdown).await;
    }

    /// Ready with nothing in the batch, else Running with what is; both
    /// name the generations that ended lately.
    fn batch_status(&self) -> Rs {
        let ended_task_ids: Vec<String> = self.ended.iter().cloned().collect();
        let draft = self.draft.clone();
        match self.runs.first() {
            None => Rs::Ready(v1::RunnerReady {
                ended_task_ids,
                draft,
            }),
            Some(oldest) => Rs::Running(v1::RunnerRunning {
                task_id: oldest.task_id.clone(),
                task_ids: self.runs.iter().map(|r| r.task_id.clone()).collect(),
                ended_task_ids,
                draft,
            }),
        }
    }

    async fn start_run(
        &mut self,
        task_id: String,
        command_id: String,
        params: &v1::TextGenerationParams,
    ) {
        if self.has_run(&task_id) || self.ended.contains(&task_id) {
            return;
        }
        tracing::debug!(command_id, "generation order");
        let mut run = Run {
            task_id: task_id.clone(),
            command_id: command_id.clone(),
            seq: 0,
        };
        match engine_command(&task_id, &command_id, params) {
            Ok(command) => {
                self.runs.push(run);
                self.status(self.batch_status()).await;
                self.engine(command).await;
            }
            Err(error) => {
                let kind = generation_chunk::Kind::Error(v1::ErrorChunk {
                    kind: "invalid_request".into(),
                    message: error.to_string(),
                });
                self.send_chunk(&mut run, kind).await;
                // Its end in the status: the worker takes it from there.
                self.remember_ended(task_id);
                self.status(self.batch_status()).await;
            }
        }
    }

    fn remember_ended(&mut self, task_id: String) {
        if self.ended.len() == ENDED_REMEMBERED {
            self.ended.pop_front();
        }
        self.ended.push_back(task_id);
    }

    async fn send_chunk(&self, run: &mut Run, kind: generation_chunk::Kind) {
        let chunk = v1::GenerationChunk {
            command_id: run.command_id.clone(),
            seq: run.seq,
            kind: Some(kind),
        };
        run.seq += 1;
        self.output.chunk(&chunk).await;
    }

    async fn on_engine(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::Connected => {
                self.phase = Phase::Connected;
                self.status(Rs::Connected(v1::RunnerConnected {})).await;
            }
            EngineEvent::Loading { done, total } => {
                self.status(Rs::Loading(v1::RunnerLoading {
                    layers_loaded: done as u32,
                    layers_total: total as u32,
                    bytes_loaded: 0,
                }))
                .await;
            }
            EngineEvent::Loaded { resident_bytes } => {
                self.phase = Phase::Loaded;
                self.status(Rs::Loaded(v1::RunnerLoaded { resident_bytes }))
                    .await;
            }
            EngineEvent::WarmedUp => self.on_warmed_up().await,
            EngineEvent::DraftSet { asked, result } => self.on_draft_set(asked, result).await,
            EngineEvent::Chunk { task_id, kind } => self.on_chunk(&task_id, kind).await,
            EngineEvent::Generated { task_id, result } => self.on_generated(&task_id, result).await,
            EngineEvent::Followed(Ok(())) | EngineEvent::ShutDown(Ok(())) => self.shut_down().await,
            EngineEvent::Followed(Err(error)) | EngineEvent::ShutDown(Err(error)) => {
                self.fail(error.to_string()).await;
            }
            EngineEvent::Failed(error) => self.fail(error.to_string()).await,
        }
    }

    async fn on_warmed_up(&mut self) {
        self.status(Rs::Ready(v1::RunnerReady::default())).await;
        if self.rank == 0 {
            self.phase = Phase::Ready;
        } else {
            // Follow rank 0 until it shuts down (its runner's end) or fails.
            self.phase = Phase::Following;
            self.engine(EngineCommand::Follow).await;
        }
    }

    async fn on_chunk(&mut self, task_id: &str, kind: generation_chunk::Kind) {
        let Some(index) = self.runs.iter().position(|r| r.task_id == task_id) else {
            return;
        };
        let mut run = self.runs.remove(index);
        self.send_chunk(&mut run, kind).await;
        self.runs.insert(index, run);
    }

    async fn on_generated(&mut self, task_id: &str, result: Result<(), BackendError>) {
        let Some(index) = self.runs.iter().position(|r| r.task_id == task_id) else {
            return;
        };
        let mut run = self.runs.remove(index);
        if let Err(error) = result {
            tracing::warn!(task_id, "generation failed: {error}");
            let kind = generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: error.chunk_kind().into(),
                message: error.to_string(),
            });
            self.send_chunk(&mut run, kind).await;
        }
        self.remember_ended(run.task_id);
        if self.then_shut_down && self.runs.is_empty() {
            self.begin_shutdown().await;
        } else {
            self.status(self.batch_status()).await;
        }
    }
}

/// A draft order as the status names it (not yet active, no error).
fn draft_status(order: &DraftOrder) -> v1::RunnerDraft {
    v1::RunnerDraft {
        method: order.method as i32,
        draft_model: order.model_id.clone(),
        num_draft_tokens: order.tokens,
        active: false,
        error: String::new(),
        resident_bytes: 0,
    }
}

/// Whether a status's draft is the one `order` asks for.
/// The engine's command for a task's parameters: a generation, or the
/// vectors of an embedding request.
fn engine_command(
    task_id: &str,
    command_id: &str,
    params: &v1::TextGenerationParams,
) -> Result<EngineCommand, request::RequestError> {
    let (task_id, command_id) = (task_id.to_string(), command_id.to_string());
    Ok(match &params.embedding {
        Some(embedding) => EngineCommand::Embed {
            task_id,
            request: request::embed_request_from(embedding)?,
        },
        None => EngineCommand::Generate {
            task_id,
            command_id,
            request: Box::new(request::request_from(params)?),
        },
    })
}

fn same_draft(status: Option<&v1::RunnerDraft>, order: Option<&DraftOrder>) -> bool {
    match (status, order) {
        (None, None) => true,
        (Some(s), Some(o)) => {
            s.method() == o.method && s.draft_model == o.model_id && s.num_draft_tokens == o.tokens
        }
        _ => false,
    }
}

/// Runs a runner until it ends: spawns the actor and waits for it.
pub async fn run<O, B, F>(args: RunnerArgs<O, F>) -> Result<RunnerActor, ActorProcessingErr>
where
    O: RunnerOutput,
    B: Backend + 'static,
    F: FnOnce() -> B + Send + 'static,
{
    let (actor, handle) = Actor::spawn(None, Runner::<O, B, F>::default(), args).await?;
    Ok(RunnerActor { actor, handle })
}

/// A started runner: its mailbox, and its end.
pub struct RunnerActor {
    pub actor: ActorRef<RunnerMsg>,
    pub handle: tokio::task::JoinHandle<()>,
}

impl RunnerActor {
    /// Orders can reach the runner now.
    pub fn listening(&self) {
        let _ = self.actor.cast(RunnerMsg::Listening);
    }

    /// The runner ends as [`RunnerExit::NodeGone`] once this process's
    /// stdin closes: the node holds its other end, so end of file means the
    /// node is gone (even killed outright), and so is the reason to run.
    pub fn end_when_stdin_closes(&self) {
        let runner = self.actor.clone();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut sink);
            let _ = runner.cast(RunnerMsg::NodeGone);
        });
    }
}

#[cfg(test)]
mod tests;
