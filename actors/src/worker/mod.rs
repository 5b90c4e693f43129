//! The Worker actor: asks the pure [`plan`](mod@plan) for its next step and takes it.
//! Each runner is a `tessera runner` child process owned by its
//! [`RunnerSupervisor`], a linked child of this actor: the worker hands it
//! the orders (`Task`s for `runner/{id}/tasks`) and the statuses that arrive
//! on `runner/{id}/events`; the supervisor relays them, and reports the end
//! of a task and the end of its child. A runner that failed is started
//! again, once its failure is in the log, after a [`Backoff`].
//!
//! [`RunnerSupervisor`]: crate::worker::runner_supervisor::RunnerSupervisor

pub mod downloads;
pub mod plan;
pub mod runner_protocol;
pub mod runner_supervisor;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{call_t, Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tessera_protos::v1::{self, event, runner_status::State as Rs};

use crate::bus::{Bus, RouteGuard};
use crate::cluster::local_events::LocalEvents;
use crate::cluster::replica::{ReplicaMsg, StateView};
use crate::worker::downloads::actor::{DownloadEnded, DownloadsActor, DownloadsArgs, DownloadsMsg};
use crate::worker::downloads::{Downloader, Outcome};
use crate::worker::plan::{plan, Downloads, LocalDownload, LocalRunner, Part, Phase, Step};
use crate::worker::runner_protocol::task_for_step;
use crate::worker::runner_supervisor::{
    Backoff, RunnerCommand, RunnerReport, RunnerSupervisor, SupervisorArgs, SupervisorMsg,
    SHUTDOWN_GRACE,
};

pub enum WorkerMsg {
    Tick,
    /// A runner's status, from `runner/{id}/events`.
    Status(String, v1::RunnerStatus),
    /// From a runner's supervisor.
    Runner(RunnerReport),
    /// A download job of the Downloads actor has ended (and has been
    /// reported).
    DownloadEnded(DownloadEnded),
}

impl From<RunnerReport> for WorkerMsg {
    fn from(report: RunnerReport) -> Self {
        Self::Runner(report)
    }
}

impl TryFrom<WorkerMsg> for RunnerReport {
    type Error = ();
    fn try_from(message: WorkerMsg) -> Result<Self, ()> {
        match message {
            WorkerMsg::Runner(report) => Ok(report),
            _ => Err(()),
        }
    }
}

impl From<DownloadEnded> for WorkerMsg {
    fn from(ended: DownloadEnded) -> Self {
        Self::DownloadEnded(ended)
    }
}

impl TryFrom<WorkerMsg> for DownloadEnded {
    type Error = ();
    fn try_from(message: WorkerMsg) -> Result<Self, ()> {
        match message {
            WorkerMsg::DownloadEnded(ended) => Ok(ended),
            _ => Err(()),
        }
    }
}

/// The variable a runner finds its ring's secret in (hex).
pub const RING_SECRET_ENV: &str = "TESSERA_RING_SECRET";

/// Bytes as lower-case hex (how a ring secret travels in the environment).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub struct Worker;

#[derive(Clone)]
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
    /// Where each runner puts its model.
    pub device: tessera_engine::gpu::DeviceChoice,
    /// The loopback endpoint of this node's session, for its runners.
    pub runner_endpoint: String,
    /// Brings model files in.
    pub downloader: Arc<Downloader>,
}

/// A runner of this node, as the plan sees it, and its supervisor.
struct Supervised {
    local: LocalRunner,
    supervisor: ActorRef<SupervisorMsg>,
    /// When the pending step's order was sent.
    ordered_at: Option<Instant>,
}

/// How long an order may go unanswered (the runner's status in the log
/// unchanged) before it is sent again: a put can be lost while a fresh
/// runner's zenoh session is still learning the routes.
const ORDER_RETRY: Duration = Duration::from_secs(2);

pub struct WorkerState {
    args: WorkerArgs,
    /// The state, as the replica last published it.
    cluster: StateView,
    runners: BTreeMap<String, Supervised>,
    /// Tasks handed to a runner (so a task is never handed twice).
    handed: BTreeSet<String>,
    /// When a runner that failed may start again.
    backoff: Backoff,
    /// Downloads, as the plan sees them.
    downloads: Downloads,
    /// Runs them (a child of this actor).
    downloader: ActorRef<DownloadsMsg>,
    /// What runners load, by model, once its files are complete.
    model_paths: BTreeMap<String, PathBuf>,
    /// Routes the runners' statuses here.
    _statuses: RouteGuard,
}

impl WorkerState {
    async fn local_event(&self, event: event::Kind) {
        self.args.events.publish_or_log(event).await;
    }

    async fn download_event(&self, model_id: &str, state: v1::download_progress::State) {
        // No shards: the whole model (as the download itself reports it).
        let shards = self
            .downloads
            .models
            .get(model_id)
            .filter(|d| !d.parts.contains(&Part::Whole))
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
        // An instance's model or draft model carries its card; else the
        // catalogue has it.
        let card = cluster
            .instances
            .values()
            .flat_map(|i| {
                let draft = i.draft.as_ref().and_then(|d| d.draft_card.as_ref());
                i.model.iter().chain(draft)
            })
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

    /// Hands `task` to the runner's supervisor, which puts it on the
    /// runner's `tasks` key.
    async fn order(&self, runner_id: &str, task: &v1::Task) -> bool {
        let Some(runner) = self.runners.get(runner_id) else {
            return false;
        };
        let sent = call_t!(
            runner.supervisor,
            SupervisorMsg::Order,
            crate::ACTOR_CALL_MS,
            Box::new(task.clone())
        );
        sent.unwrap_or_else(|error| {
            tracing::warn!(%error, runner_id, "ordering a runner");
            false
        })
    }

    /// The command line of a runner of `instance`.
    fn runner_command(&self, instance: &v1::Instance, runner_id: &str) -> RunnerCommand {
        let mut args: Vec<std::ffi::OsString> = vec!["runner".into()];
        let model_path = instance
            .model
            .as_ref()
            .and_then(|m| self.model_paths.get(&m.model_id));
        if let Some(path) = model_path {
            args.extend(["--model-path".into(), path.into()]);
        }
        // The ring's secret goes by the environment, which only the runner's
        // user can read, not by the command line, which every user can.
        let secret = hex(&instance.ring_secret);
        let public = v1::Instance {
            ring_secret: Vec::new(),
            ..instance.clone()
        };
        let instance_json = serde_json::to_string(&public).unwrap_or_default();
        for (flag, value) in [
            ("--runner-id", runner_id),
            ("--node-id", &self.args.node_id),
            ("--namespace", self.args.bus.keys.namespace()),
            ("--connect", &self.args.runner_endpoint),
            ("--instance-json", &instance_json),
            ("--threads", &self.args.threads.to_string()),
            ("--device", &self.args.device.to_string()),
        ] {
            args.extend([flag.into(), value.into()]);
        }
        RunnerCommand {
            program: self.args.exe.clone(),
            args,
            envs: vec![
                ("TESSERA_HOME".into(), self.args.data_dir.clone().into()),
                (RING_SECRET_ENV.into(), secret.into()),
            ],
        }
    }

    async fn start_runner(
        &mut self,
        myself: &ActorRef<WorkerMsg>,
        instance_id: &str,
        runner_id: &str,
        rank: u32,
    ) -> Result<(), ActorProcessingErr> {
        if !self.backoff.may_start(runner_id, Instant::now()) {
            return Ok(());
        }
        let state = self.cluster.borrow().clone();
        let Some(instance) = state.instances.get(instance_id) else {
            return Ok(());
        };
        let args = SupervisorArgs {
            runner_id: runner_id.to_string(),
            command: self.runner_command(instance, runner_id),
            bus: self.args.bus.clone(),
            events: self.args.events.clone(),
            reports: myself.get_derived(),
        };
        let spawned = Actor::spawn_linked(None, RunnerSupervisor, args, myself.get_cell()).await;
        let supervisor = match spawned {
            Ok((supervisor, _)) => supervisor,
            Err(error) => {
                // Could not even start the process: a failure like a crash.
                let reason = format!("starting the runner: {error}");
                self.fail_runner(runner_id, reason).await;
                return Ok(());
            }
        };
        tracing::info!(runner_id, rank, "supervising a runner");
        self.runners.insert(
            runner_id.to_string(),
            Supervised {
                local: LocalRunner {
                    instance_id: instance_id.to_string(),
                    rank,
                    pending: None,
                    tasks: Default::default(),
                    cancelling: Default::default(),
                },
                supervisor,
                ordered_at: None,
            },
        );
        Ok(())
    }

    /// A runner that could not be supervised: failed in the log, and
    /// started again after its backoff.
    async fn fail_runner(&mut self, runner_id: &str, reason: String) {
        tracing::warn!(runner_id, reason, "runner failed");
        self.status(
            runner_id,
            Rs::Failed(v1::RunnerFailed {
                reason,
                diagnostics: String::new(),
            }),
        )
        .await;
        self.status(runner_id, Rs::Shutdown(v1::RunnerShutdown {}))
            .await;
        self.backoff.failed(runner_id, Instant::now());
    }

    /// Takes the plan's next step, if there is one.
    async fn tick(&mut self, myself: &ActorRef<WorkerMsg>) -> Result<(), ActorProcessingErr> {
        let cluster = self.cluster.borrow().clone();
        self.forget_unanswered_orders();
        let locals: BTreeMap<String, LocalRunner> = self
            .runners
            .iter()
            .map(|(id, r)| (id.clone(), r.local.clone()))
            .collect();
        self.handed.retain(|id| cluster.tasks.contains_key(id));
        let marked = self.mark_handed(&cluster);
        let view = marked.as_ref().unwrap_or(&cluster);
        let Some(step) = plan(view, &self.args.node_id, &locals, &self.downloads) else {
            return Ok(());
        };
        tracing::debug!(?step, "next step");
        match step {
            Step::Download {
                model_id,
                parts,
                instance_id,
                request_id,
            } => {
                self.start_download(&cluster, model_id, parts, instance_id, request_id)
                    .await;
            }
            Step::CancelDownload {
                model_id,
                request_id,
            } => self.cancel_download(&model_id, request_id).await,
            Step::DeleteDownload {
                model_id,
                request_id,
            } => self.delete_download(&model_id, request_id),
            Step::CreateRunner {
                instance_id,
                runner_id,
                rank,
            } => {
                self.start_runner(myself, &instance_id, &runner_id, rank)
                    .await?;
            }
            step @ (Step::Forward { .. } | Step::Cancel { .. }) => {
                self.order_runner(&cluster, step).await;
                // The next generation of a burst joins the batch now, not
                // at the next tick.
                let _ = myself.cast(WorkerMsg::Tick);
            }
            step => self.order_runner(&cluster, step).await,
        }
        Ok(())
    }

    /// Tasks already handed out are not offered again, even before the log
    /// has their acknowledgement: a copy of the state that says so, made
    /// only while there are such tasks.
    fn mark_handed(&self, cluster: &v1::ClusterState) -> Option<v1::ClusterState> {
        let unmarked =
            |(id, task): (&String, &v1::Task)| self.handed.contains(id) && !task.acknowledged;
        if !cluster.tasks.iter().any(unmarked) {
            return None;
        }
        let mut view = cluster.clone();
        for (id, task) in view.tasks.iter_mut() {
            if self.handed.contains(id) {
                task.acknowledged = true;
            }
        }
        Some(view)
    }

    /// Orders that may be lost are offered again (the runner ignores one it
    /// has already followed): the plan sees them as not yet given.
    fn forget_unanswered_orders(&mut self) {
        for runner in self.runners.values_mut() {
            // (A runner ignores a draft it has, or is loading, already.)
            let resendable = matches!(
                runner.local.pending,
                Some(
                    Step::Connect { .. }
                        | Step::Load { .. }
                        | Step::WarmUp { .. }
                        | Step::SetDraft { .. }
                )
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
    }

    /// A step a runner takes: its order goes through its supervisor.
    async fn order_runner(&mut self, cluster: &v1::ClusterState, step: Step) {
        let (Step::Connect { runner_id }
        | Step::Load { runner_id }
        | Step::WarmUp { runner_id }
        | Step::Forward { runner_id, .. }
        | Step::Cancel { runner_id, .. }
        | Step::SetDraft { runner_id, .. }
        | Step::Shutdown { runner_id }) = &step
        else {
            return;
        };
        let runner_id = runner_id.clone();
        let generation = match &step {
            Step::Forward { task_id, .. } => cluster.tasks.get(task_id),
            _ => None,
        };
        let Some(mut task) = task_for_step(&step, generation) else {
            return;
        };
        self.add_draft_path(&mut task);
        let sent = match &step {
            // The supervisor orders it, and kills a runner that does not
            // stop in time.
            Step::Shutdown { .. } => self
                .runners
                .get(&runner_id)
                .is_some_and(|r| r.supervisor.cast(SupervisorMsg::Shutdown).is_ok()),
            _ => self.order(&runner_id, &task).await,
        };
        match &step {
            Step::Forward { task_id, .. } => {
                self.forwarded(&runner_id, task_id, &task.command_id, sent)
                    .await;
            }
            Step::Cancel { task_id, .. } if sent => {
                if let Some(r) = self.runners.get_mut(&runner_id) {
                    r.local.cancelling.insert(task_id.clone());
                }
            }
            _ => {}
        }
        if let Some(r) = self.runners.get_mut(&runner_id) {
            r.local.pending = Some(step);
            r.ordered_at = Some(Instant::now());
        }
    }

    /// A draft model's files, as this node's download found them, go with
    /// the order to use it.
    fn add_draft_path(&self, task: &mut v1::Task) {
        let Some(v1::task::Kind::SetDraft(set)) = task.kind.as_mut() else {
            return;
        };
        let model = set.draft.as_ref().map(|d| d.draft_model.as_str());
        if let Some(path) = model.and_then(|m| self.model_paths.get(m)) {
            set.draft_path = path.to_string_lossy().into_owned();
        }
    }

    /// A generation handed to a runner is acknowledged in the log.
    async fn forwarded(&mut self, runner_id: &str, task_id: &str, command_id: &str, sent: bool) {
        tracing::debug!(task_id, command_id, sent, "forwarded to the runner");
        self.handed.insert(task_id.to_string());
        if let Some(r) = self.runners.get_mut(runner_id) {
            if sent {
                r.local.tasks.insert(task_id.to_string());
            }
        }
        self.local_event(event::Kind::TaskAcknowledged(v1::TaskAcknowledged {
            task_id: task_id.to_string(),
        }))
        .await;
    }

    /// Hands a runner's status to its supervisor, which relays it.
    fn on_status(&self, runner_id: &str, status: v1::RunnerStatus) {
        // Another node's runner, or one already gone: not ours to relay.
        if let Some(runner) = self.runners.get(runner_id) {
            let _ = runner.supervisor.cast(SupervisorMsg::Status(status));
        }
    }

    fn on_report(&mut self, report: RunnerReport) {
        match report {
            RunnerReport::TaskEnded { runner_id, task_id } => {
                if let Some(runner) = self.runners.get_mut(&runner_id) {
                    runner.local.tasks.remove(&task_id);
                    runner.local.cancelling.remove(&task_id);
                }
            }
            RunnerReport::Ended { runner_id, failed } => {
                self.runners.remove(&runner_id);
                if failed {
                    self.backoff.failed(&runner_id, Instant::now());
                } else {
                    self.backoff.forget(&runner_id);
                }
            }
        }
    }

    /// The runner whose supervisor is the actor `id`.
    fn runner_supervised_by(&self, id: ractor::ActorId) -> Option<String> {
        self.runners
            .iter()
            .find(|(_, r)| r.supervisor.get_id() == id)
            .map(|(runner_id, _)| runner_id.clone())
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
            ended: worker.get_derived(),
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
            .route(
                args.bus.keys.runner_any("events")?,
                move |key, status: v1::RunnerStatus| match bus.keys.runner_of_key(key, "events") {
                    Some(runner_id) => {
                        let _ = me.cast(WorkerMsg::Status(runner_id.to_string(), status));
                    }
                    None => bus.count_dropped(key, "not a runner events key"),
                },
            )
            .await?;
        let downloader = spawn_downloads(&myself, &args).await?;
        let cluster = call_t!(args.replica, ReplicaMsg::Watch, crate::ACTOR_CALL_MS)?;
        myself.send_interval(Duration::from_millis(100), || WorkerMsg::Tick);
        // A new state is planned on at once rather than at the next tick
        // (a forwarded generation waits for this).
        let mut changes = cluster.clone();
        let me = myself.clone();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                if me.cast(WorkerMsg::Tick).is_err() {
                    break;
                }
            }
        });
        Ok(WorkerState {
            args,
            cluster,
            runners: BTreeMap::new(),
            handed: BTreeSet::new(),
            backoff: Backoff::default(),
            downloads: Downloads::default(),
            downloader,
            model_paths: BTreeMap::new(),
            _statuses: RouteGuard(statuses),
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
            WorkerMsg::Status(runner_id, status) => state.on_status(&runner_id, status),
            WorkerMsg::Runner(report) => {
                state.on_report(report);
                state.tick(&myself).await?;
            }
            WorkerMsg::DownloadEnded(DownloadEnded { model_id, outcome }) => {
                state.on_download_ended(&model_id, outcome);
                state.tick(&myself).await?;
            }
        }
        Ok(())
    }

    /// A runner's supervisor that panicked is a failed runner (its child
    /// was killed with its state). The Downloads actor only ends with this
    /// one, unless it panicked: then its running downloads are failed (and
    /// tried again for the next instance that needs them) and a new one
    /// takes over.
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
        if let Some(runner_id) = state.runner_supervised_by(who.get_id()) {
            // A supervisor that ends normally has reported its end first.
            if matches!(event, SupervisionEvent::ActorFailed(..)) {
                state.runners.remove(&runner_id);
                let reason = format!("the runner's supervisor failed: {event}");
                state.fail_runner(&runner_id, reason).await;
            }
            return Ok(());
        }
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

    /// Every runner is told to shut down, and waited for: its supervisor
    /// kills it after the grace.
    async fn post_stop(
        &self,
        _: ActorRef<Self::Msg>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        state.downloader.stop(None);
        for runner in state.runners.values() {
            let _ = runner.supervisor.cast(SupervisorMsg::Shutdown);
        }
        let waits = state.runners.values().map(|runner| {
            runner
                .supervisor
                .wait(Some(SHUTDOWN_GRACE + Duration::from_secs(2)))
        });
        for (id, waited) in state
            .runners
            .keys()
            .zip(futures_util::future::join_all(waits).await)
        {
            if waited.is_err() {
                tracing::warn!(runner = %id, "runner supervisor did not stop; killing it");
            }
        }
        for runner in state.runners.values() {
            // Its state goes, and the child with it.
            runner.supervisor.kill();
        }
        Ok(())
    }
}
