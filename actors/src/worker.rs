//! The Worker actor: asks the pure [`plan`] for its next step and takes it.
//! Each runner is a `tessera runner` child process supervised here. Its
//! orders are `Task`s put on `runner/{id}/tasks`; its statuses arrive on
//! `runner/{id}/events` and are relayed to the master as local events; rank 0
//! puts its generation chunks straight on `chunks/{command_id}`. The child's
//! exit is awaited on the process itself: one that exits out of turn becomes
//! `RunnerFailed` (with the tail of its stderr), its request gets an error
//! chunk, and the runner is started again after a backoff.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{call_t, Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tessera_protos::v1::{self, event, generation_chunk, runner_status::State as Rs};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;

use crate::bus::Bus;
use crate::downloads::{Downloader, Outcome};
use crate::downloads_actor::{DownloadsActor, DownloadsArgs, DownloadsMsg};
use crate::local_events::LocalEvents;
use crate::plan::{plan, Downloads, LocalDownload, LocalRunner, Part, Phase, Step};
use crate::replica::ReplicaMsg;
use crate::runner_protocol::task_for_step;

/// Lines of a runner's stderr kept for the diagnostics of its failure.
const STDERR_TAIL: usize = 20;
/// How long a runner told to shut down may take before it is killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

pub enum WorkerMsg {
    Tick,
    /// A runner's status, from `runner/{id}/events`.
    Status(String, v1::RunnerStatus),
    /// A runner's process ended: its exit status and the tail of its stderr.
    Exited {
        runner_id: String,
        exit: String,
        stderr: String,
    },
    /// A download job of the Downloads actor has ended (and has been
    /// reported).
    DownloadEnded {
        model_id: String,
        outcome: Outcome,
    },
}

pub struct Worker;

pub struct WorkerArgs {
    pub node_id: String,
    pub bus: Bus,
    pub replica: ActorRef<ReplicaMsg>,
    /// This node's local events, in one ordered sequence.
    pub events: Arc<LocalEvents>,
    /// The `tessera` binary to start runners with.
    pub exe: PathBuf,
    pub data_dir: PathBuf,
    /// Compute threads per runner.
    pub threads: usize,
    /// The loopback endpoint of this node's session, for its runners.
    pub runner_endpoint: String,
    /// Notified when the replica applies an event: plan at once rather
    /// than at the next tick (a forwarded generation waits for this).
    pub changed: Arc<tokio::sync::Notify>,
    /// Brings model files in.
    pub downloader: Arc<Downloader>,
}

struct RunnerProcess {
    local: LocalRunner,
    /// Kills the child (its waiter holds the process).
    kill: Option<oneshot::Sender<()>>,
    /// Fires when the child has exited.
    exited: Option<oneshot::Receiver<()>>,
    /// The child's stdin, held open while this node lives.
    _lifeline: Option<tokio::process::ChildStdin>,
    command_id: Option<String>,
    stopping: bool,
    /// The last status relayed (a runner repeats its status until it hears
    /// from this node; repeats are not relayed again).
    last_status: Option<Rs>,
    /// When the pending step's order was sent.
    ordered_at: Option<Instant>,
}

/// How long an order may go unanswered (the runner's status in the log
/// unchanged) before it is sent again: a put can be lost while a fresh
/// runner's zenoh session is still learning the routes.
const ORDER_RETRY: Duration = Duration::from_secs(2);

pub struct WorkerState {
    args: WorkerArgs,
    runners: BTreeMap<String, RunnerProcess>,
    /// Tasks handed to a runner (so a task is never handed twice).
    handed: BTreeSet<String>,
    /// When a runner that failed may start again, and its backoff.
    backoff: BTreeMap<String, (Instant, Duration)>,
    /// Downloads, as the plan sees them.
    downloads: Downloads,
    /// Runs them (a child of this actor).
    downloader: ActorRef<DownloadsMsg>,
    /// What runners load, by model, once its files are complete.
    model_paths: BTreeMap<String, PathBuf>,
    _statuses: zenoh::pubsub::Subscriber<()>,
}

impl WorkerState {
    async fn local_event(&self, event: event::Kind) {
        self.args.events.publish_or_log(event).await;
    }

    async fn download_event(&self, model_id: &str, state: v1::download_progress::State) {
        let shards = self
            .downloads
            .models
            .get(model_id)
            .map(|d| d.parts.iter().filter_map(Part::to_proto).collect())
            .unwrap_or_default();
        self.local_event(event::Kind::NodeDownloadProgress(
            v1::NodeDownloadProgress {
                node_id: self.args.node_id.clone(),
                progress: Some(v1::DownloadProgress {
                    model_id: model_id.to_string(),
                    state: Some(state),
                    shards,
                }),
            },
        ))
        .await;
    }

    /// Starts (or widens, or marks as asked for) a model's download.
    async fn start_download(
        &mut self,
        cluster: &v1::ClusterState,
        model_id: String,
        parts: std::collections::BTreeSet<Part>,
        instance_id: Option<String>,
        request_id: Option<String>,
    ) {
        if let Some(request) = &request_id {
            self.downloads.handled.insert(request.clone());
        }
        let explicit = request_id.is_some();
        if let Some(local) = self.downloads.models.get_mut(&model_id) {
            local.explicit |= explicit;
            if let Some(instance) = &instance_id {
                local.tried_for.insert(instance.clone());
            }
            if local.phase == Phase::Running {
                // Widened (if need be) once this run ends.
                return;
            }
        }
        let card = cluster
            .instances
            .values()
            .filter_map(|i| i.model.as_ref())
            .find(|m| m.model_id == model_id)
            .cloned()
            .or_else(|| crate::catalogue::find(cluster, &model_id));
        let local = self
            .downloads
            .models
            .entry(model_id.clone())
            .or_insert_with(|| LocalDownload {
                parts: Default::default(),
                phase: Phase::Running,
                explicit,
                tried_for: Default::default(),
            });
        local.parts.extend(parts);
        local.phase = Phase::Running;
        if let Some(instance) = instance_id {
            local.tried_for.insert(instance);
        }
        let Some(card) = card else {
            let reason = format!("unknown model {model_id:?}: no card in the catalogue");
            self.download_failed(&model_id, reason).await;
            return;
        };
        let shards: Vec<v1::ShardSpec> = local.parts.iter().filter_map(Part::to_proto).collect();
        let shards = if local.parts.contains(&Part::Whole) {
            Vec::new()
        } else {
            shards
        };
        self.model_paths.remove(&model_id);
        let start = DownloadsMsg::Start {
            card: Box::new(card),
            shards,
        };
        if let Err(error) = self.downloader.cast(start) {
            self.download_failed(&model_id, format!("the downloads actor is gone: {error}"))
                .await;
        }
    }

    /// Marks a download failed here and in the log (when its job could not
    /// run at all).
    async fn download_failed(&mut self, model_id: &str, reason: String) {
        if let Some(local) = self.downloads.models.get_mut(model_id) {
            local.phase = Phase::Failed;
        }
        self.download_event(
            model_id,
            v1::download_progress::State::Failed(v1::DownloadFailed { reason }),
        )
        .await;
    }

    /// Takes in a job's end, which the Downloads actor has reported.
    fn on_download_ended(&mut self, model_id: &str, outcome: Outcome) {
        let phase = match outcome {
            Outcome::Completed { path, .. } => {
                self.model_paths.insert(model_id.to_string(), path);
                Phase::Done
            }
            Outcome::Failed(_) => Phase::Failed,
            Outcome::Cancelled => Phase::Cancelled,
        };
        if let Some(local) = self.downloads.models.get_mut(model_id) {
            local.phase = phase;
        }
    }

    async fn cancel_download(&mut self, model_id: &str, request_id: Option<String>) {
        let by_request = request_id.is_some();
        if let Some(request) = request_id {
            self.downloads.handled.insert(request);
        }
        let running = self
            .downloads
            .models
            .get(model_id)
            .is_some_and(|d| d.phase == Phase::Running);
        if running {
            // The job ends with Cancelled, which is then reported.
            let cancel = DownloadsMsg::Cancel {
                model_id: model_id.to_string(),
            };
            if self.downloader.cast(cancel).is_ok() {
                return;
            }
        }
        // Nothing runs: record it so the plan does not ask again, and
        // correct the log's stale entry.
        self.downloads
            .models
            .entry(model_id.to_string())
            .or_insert_with(|| LocalDownload {
                parts: Default::default(),
                phase: Phase::Cancelled,
                explicit: false,
                tried_for: Default::default(),
            });
        if !by_request {
            self.download_event(
                model_id,
                v1::download_progress::State::Cancelled(v1::DownloadCancelled::default()),
            )
            .await;
        }
    }

    fn delete_download(&mut self, model_id: &str, request_id: String) {
        self.downloads.handled.insert(request_id);
        self.downloads.models.remove(model_id);
        self.model_paths.remove(model_id);
        let delete = DownloadsMsg::Delete {
            model_id: model_id.to_string(),
        };
        if let Err(error) = self.downloader.cast(delete) {
            tracing::warn!(model_id, %error, "deleting the model's files");
        }
    }

    async fn status(&self, runner_id: &str, state: Rs) {
        self.local_event(event::Kind::RunnerStatusUpdated(v1::RunnerStatusUpdated {
            runner_id: runner_id.to_string(),
            status: Some(v1::RunnerStatus { state: Some(state) }),
        }))
        .await;
    }

    /// A task its runner is done with leaves the state: as a report, so
    /// that it is delivered across a change of master.
    async fn task_done(&self, task_id: String) {
        let event = event::Kind::TaskDeleted(v1::TaskDeleted { task_id });
        self.args.events.publish_or_log(event).await;
    }

    /// Puts `task` on the runner's `tasks` key.
    async fn order(&self, runner_id: &str, task: &v1::Task) -> bool {
        let Ok(key) = self.args.bus.keys.runner(runner_id, "tasks") else {
            return false;
        };
        match self.args.bus.put(&key, task).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, runner_id, "ordering a runner");
                false
            }
        }
    }

    async fn start_runner(
        &mut self,
        myself: &ActorRef<WorkerMsg>,
        instance_id: &str,
        runner_id: &str,
        rank: u32,
    ) -> Result<(), ActorProcessingErr> {
        if let Some((at, _)) = self.backoff.get(runner_id) {
            if Instant::now() < *at {
                return Ok(());
            }
        }
        let state: v1::ClusterState = call_t!(
            self.args.replica,
            ReplicaMsg::GetState,
            crate::ACTOR_CALL_MS
        )?;
        let Some(instance) = state.instances.get(instance_id) else {
            return Ok(());
        };
        let model_path = instance
            .model
            .as_ref()
            .and_then(|m| self.model_paths.get(&m.model_id))
            .cloned();
        let mut command = tokio::process::Command::new(&self.args.exe);
        command.arg("runner");
        if let Some(path) = model_path {
            command.arg("--model-path").arg(path);
        }
        let mut child = command
            .args(["--runner-id", runner_id])
            .args(["--node-id", &self.args.node_id])
            .args(["--namespace", self.args.bus.keys.namespace()])
            .args(["--connect", &self.args.runner_endpoint])
            .args(["--instance-json", &serde_json::to_string(instance)?])
            .args(["--threads", &self.args.threads.to_string()])
            .env("TESSERA_HOME", &self.args.data_dir)
            // Never written: the child exits when it closes, i.e. when
            // this node is gone.
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        tracing::info!(runner_id, rank, pid = child.id(), "started a runner");
        let lifeline = child.stdin.take();
        // The child's log goes on to the node's stderr; its tail is kept.
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
        let stderr = child.stderr.take().map(|stderr| {
            let tail = tail.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    eprintln!("{line}");
                    if let Ok(mut tail) = tail.lock() {
                        if tail.len() == STDERR_TAIL {
                            tail.pop_front();
                        }
                        tail.push_back(line);
                    }
                }
            })
        });
        let (kill, killed) = oneshot::channel::<()>();
        let (exited_tx, exited) = oneshot::channel::<()>();
        let reporter = myself.clone();
        let id = runner_id.to_string();
        tokio::spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                _ = killed => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            if let Some(reader) = stderr {
                let _ = tokio::time::timeout(Duration::from_secs(1), reader).await;
            }
            let stderr = tail
                .lock()
                .map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n"))
                .unwrap_or_default();
            let exit = status.map_or_else(|e| e.to_string(), |s| s.to_string());
            let _ = exited_tx.send(());
            let _ = reporter.cast(WorkerMsg::Exited {
                runner_id: id,
                exit,
                stderr,
            });
        });
        self.runners.insert(
            runner_id.to_string(),
            RunnerProcess {
                local: LocalRunner {
                    instance_id: instance_id.to_string(),
                    rank,
                    pending: None,
                    task_id: None,
                },
                kill: Some(kill),
                exited: Some(exited),
                _lifeline: lifeline,
                command_id: None,
                stopping: false,
                last_status: None,
                ordered_at: None,
            },
        );
        Ok(())
    }

    async fn error_chunk(&self, command_id: &str, message: &str) {
        let chunk = v1::GenerationChunk {
            command_id: command_id.to_string(),
            seq: u64::MAX,
            kind: Some(generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: "runner_failed".into(),
                message: message.to_string(),
            })),
        };
        if let Ok(key) = self.args.bus.keys.chunks(command_id) {
            let _ = self.args.bus.put(&key, &chunk).await;
        }
    }

    /// Takes the plan's next step, if there is one.
    async fn tick(&mut self, myself: &ActorRef<WorkerMsg>) -> Result<(), ActorProcessingErr> {
        let cluster: v1::ClusterState = call_t!(
            self.args.replica,
            ReplicaMsg::GetState,
            crate::ACTOR_CALL_MS
        )?;
        // Orders that may be lost are offered again (the runner ignores
        // one it has already followed).
        for runner in self.runners.values_mut() {
            let resendable = matches!(
                runner.local.pending,
                Some(Step::Connect { .. } | Step::Load { .. } | Step::WarmUp { .. })
            );
            if resendable
                && runner
                    .ordered_at
                    .is_some_and(|at| at.elapsed() > ORDER_RETRY)
            {
                runner.local.pending = None;
                runner.ordered_at = None;
            }
        }
        let locals: BTreeMap<String, LocalRunner> = self
            .runners
            .iter()
            .map(|(id, r)| (id.clone(), r.local.clone()))
            .collect();
        let mut view = cluster.clone();
        // Tasks already handed out are not offered again, even before the
        // log has their acknowledgement.
        for (id, task) in view.tasks.iter_mut() {
            if self.handed.contains(id) {
                task.acknowledged = true;
            }
        }
        self.handed.retain(|id| cluster.tasks.contains_key(id));
        let Some(step) = plan(&view, &self.args.node_id, &locals, &self.downloads) else {
            return Ok(());
        };
        tracing::debug!(?step, "next step");
        let runner_id = match &step {
            Step::Download {
                model_id,
                parts,
                instance_id,
                request_id,
            } => {
                self.start_download(
                    &cluster,
                    model_id.clone(),
                    parts.clone(),
                    instance_id.clone(),
                    request_id.clone(),
                )
                .await;
                return Ok(());
            }
            Step::CancelDownload {
                model_id,
                request_id,
            } => {
                self.cancel_download(model_id, request_id.clone()).await;
                return Ok(());
            }
            Step::DeleteDownload {
                model_id,
                request_id,
            } => {
                self.delete_download(model_id, request_id.clone());
                return Ok(());
            }
            Step::CreateRunner {
                instance_id,
                runner_id,
                rank,
            } => {
                return self
                    .start_runner(myself, instance_id, runner_id, *rank)
                    .await;
            }
            Step::Connect { runner_id }
            | Step::Load { runner_id }
            | Step::WarmUp { runner_id }
            | Step::Forward { runner_id, .. }
            | Step::Cancel { runner_id, .. }
            | Step::Shutdown { runner_id } => runner_id.clone(),
        };
        let generation = match &step {
            Step::Forward { task_id, .. } => cluster.tasks.get(task_id),
            _ => None,
        };
        let Some(task) = task_for_step(&step, generation) else {
            return Ok(());
        };
        let sent = self.order(&runner_id, &task).await;
        match &step {
            Step::Forward { task_id, .. } => {
                tracing::debug!(
                    task_id,
                    command_id = task.command_id,
                    "forwarded to the runner"
                );
                self.handed.insert(task_id.clone());
                if let Some(r) = self.runners.get_mut(&runner_id) {
                    if sent {
                        r.local.task_id = Some(task_id.clone());
                        r.command_id = Some(task.command_id.clone());
                    }
                }
                self.local_event(event::Kind::TaskAcknowledged(v1::TaskAcknowledged {
                    task_id: task_id.clone(),
                }))
                .await;
            }
            Step::Shutdown { .. } => {
                if let Some(r) = self.runners.get_mut(&runner_id) {
                    r.stopping = true;
                    // A runner that does not stop in time is killed.
                    if let Some(kill) = r.kill.take() {
                        tokio::spawn(async move {
                            tokio::time::sleep(SHUTDOWN_GRACE).await;
                            let _ = kill.send(());
                        });
                    }
                }
            }
            _ => {}
        }
        if let Some(r) = self.runners.get_mut(&runner_id) {
            r.local.pending = Some(step);
            r.ordered_at = Some(Instant::now());
        }
        Ok(())
    }

    /// Relays a runner's status; the end of a run finishes its task.
    async fn on_status(&mut self, runner_id: &str, status: v1::RunnerStatus) {
        let Some(runner) = self.runners.get_mut(runner_id) else {
            // Another node's runner, or one already gone.
            return;
        };
        let Some(state) = status.state else {
            self.args
                .bus
                .count_dropped(runner_id, "a runner status without a state");
            return;
        };
        if runner.last_status.as_ref() == Some(&state) {
            return;
        }
        runner.last_status = Some(state.clone());
        let finished = match (&runner.local.task_id, &state) {
            (Some(task), Rs::Running(running)) if running.task_id == *task => None,
            (Some(_), _) => {
                runner.command_id = None;
                runner.local.task_id.take()
            }
            (None, _) => None,
        };
        self.status(runner_id, state).await;
        if let Some(task_id) = finished {
            self.task_done(task_id).await;
        }
    }

    async fn on_exit(&mut self, runner_id: String, exit: String, stderr: String) {
        let Some(mut runner) = self.runners.remove(&runner_id) else {
            return;
        };
        if runner.stopping {
            self.status(&runner_id, Rs::Shutdown(v1::RunnerShutdown {}))
                .await;
            self.backoff.remove(&runner_id);
            return;
        }
        let reason = format!("the runner process exited ({exit})");
        tracing::warn!(runner_id, reason, "runner failed");
        if let Some(command_id) = &runner.command_id {
            self.error_chunk(command_id, &reason).await;
        }
        if let Some(task_id) = runner.local.task_id.take() {
            self.task_done(task_id).await;
        }
        self.status(
            &runner_id,
            Rs::Failed(v1::RunnerFailed {
                reason: reason.clone(),
                diagnostics: stderr,
            }),
        )
        .await;
        // Gone from this node; started again after a backoff once the
        // failure is in the log (plan creates it anew).
        self.status(&runner_id, Rs::Shutdown(v1::RunnerShutdown {}))
            .await;
        let wait = self
            .backoff
            .get(&runner_id)
            .map_or(Duration::from_millis(500), |(_, d)| {
                (*d * 2).min(Duration::from_secs(30))
            });
        self.backoff
            .insert(runner_id, (Instant::now() + wait, wait));
    }
}

/// Starts the Downloads actor as a child of the worker.
async fn spawn_downloads(
    worker: &ActorRef<WorkerMsg>,
    args: &WorkerArgs,
) -> Result<ActorRef<DownloadsMsg>, ActorProcessingErr> {
    let (downloads, _) = Actor::spawn_linked(
        None,
        DownloadsActor,
        DownloadsArgs {
            downloader: args.downloader.clone(),
            events: args.events.clone(),
            worker: worker.clone(),
        },
        worker.get_cell(),
    )
    .await?;
    Ok(downloads)
}

impl Actor for Worker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: WorkerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let bus = args.bus.clone();
        let me = myself.clone();
        let statuses = args
            .bus
            .session
            .declare_subscriber(args.bus.keys.runner_any("events")?)
            .callback(move |sample| {
                let key = sample.key_expr().as_str();
                let Some(runner_id) = bus.keys.runner_of_key(key, "events") else {
                    bus.count_dropped(key, "not a runner events key");
                    return;
                };
                if let Some(status) =
                    bus.decode::<v1::RunnerStatus>(key, &sample.payload().to_bytes())
                {
                    let _ = me.cast(WorkerMsg::Status(runner_id.to_string(), status));
                }
            })
            .await
            .map_err(|e| format!("subscribing to runner events: {e}"))?;
        let downloader = spawn_downloads(&myself, &args).await?;
        myself.send_interval(Duration::from_millis(100), || WorkerMsg::Tick);
        let changed = args.changed.clone();
        let me = myself.clone();
        tokio::spawn(async move {
            loop {
                changed.notified().await;
                if me.cast(WorkerMsg::Tick).is_err() {
                    break;
                }
            }
        });
        Ok(WorkerState {
            args,
            runners: BTreeMap::new(),
            handed: BTreeSet::new(),
            backoff: BTreeMap::new(),
            downloads: Downloads::default(),
            downloader,
            model_paths: BTreeMap::new(),
            _statuses: statuses,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            WorkerMsg::Tick => state.tick(&myself).await?,
            WorkerMsg::Status(runner_id, status) => state.on_status(&runner_id, status).await,
            WorkerMsg::Exited {
                runner_id,
                exit,
                stderr,
            } => state.on_exit(runner_id, exit, stderr).await,
            WorkerMsg::DownloadEnded { model_id, outcome } => {
                state.on_download_ended(&model_id, outcome);
                state.tick(&myself).await?;
            }
        }
        Ok(())
    }

    /// The Downloads actor only ends with this one, unless it panicked:
    /// then its running downloads are failed (and tried again for the next
    /// instance that needs them) and a new one takes over.
    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let (SupervisionEvent::ActorFailed(who, _) | SupervisionEvent::ActorTerminated(who, _, _)) =
            &event
        else {
            return Ok(());
        };
        if who.get_id() != state.downloader.get_id() {
            return Ok(());
        }
        tracing::error!(%event, "the downloads actor stopped; starting a new one");
        state.downloader = spawn_downloads(&myself, &state.args).await?;
        let running: Vec<String> = state
            .downloads
            .models
            .iter()
            .filter(|(_, d)| d.phase == Phase::Running)
            .map(|(id, _)| id.clone())
            .collect();
        for model_id in running {
            let reason = format!("the downloads actor stopped: {event}");
            state.download_failed(&model_id, reason).await;
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<Self::Msg>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        state.downloader.stop(None);
        let ids: Vec<String> = state.runners.keys().cloned().collect();
        for id in &ids {
            let shutdown = task_for_step(
                &Step::Shutdown {
                    runner_id: id.clone(),
                },
                None,
            );
            if let Some(task) = shutdown {
                state.order(id, &task).await;
            }
        }
        for (id, runner) in state.runners.iter_mut() {
            runner.stopping = true;
            if let Some(exited) = runner.exited.take() {
                if tokio::time::timeout(SHUTDOWN_GRACE, exited).await.is_err() {
                    tracing::warn!(runner = %id, "runner did not stop; killing it");
                    if let Some(kill) = runner.kill.take() {
                        let _ = kill.send(());
                    }
                }
            }
        }
        Ok(())
    }
}
