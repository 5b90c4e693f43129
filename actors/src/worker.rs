//! The Worker actor: asks the pure [`plan`] for its next step and takes it.
//! Each runner is a `tessera runner` child process supervised here: its
//! orders go to its stdin, its reports come from its stdout and become
//! local events (statuses, sent to the master for indexing) or generation
//! chunks (published on `chunks/{command_id}`). A child that exits out of
//! turn becomes `RunnerFailed`, its request gets an error chunk, and the
//! runner is started again after a backoff.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{call, Actor, ActorProcessingErr, ActorRef};
use tessera_protos::v1::{
    self, command, event, generation_chunk, runner_status::State as Rs, Command, Event, LocalEvent,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin};

use crate::bus::Bus;
use crate::plan::{plan, LocalRunner, Step};
use crate::replica::ReplicaMsg;
use crate::runner_protocol::{FromRunner, ToRunner};

pub enum WorkerMsg {
    Tick,
    /// A report from a runner's stdout.
    Report(String, FromRunner),
    /// A runner's process ended.
    Exited(String, String),
}

pub struct Worker;

pub struct WorkerArgs {
    pub node_id: String,
    pub bus: Bus,
    pub replica: ActorRef<ReplicaMsg>,
    /// Sequence numbers of this node's local events (shared with node info).
    pub seq: Arc<AtomicU64>,
    /// The `tessera` binary to start runners with.
    pub exe: PathBuf,
    pub data_dir: PathBuf,
    /// Compute threads per runner.
    pub threads: usize,
}

struct RunnerProcess {
    local: LocalRunner,
    stdin: ChildStdin,
    child: Child,
    command_id: Option<String>,
    stopping: bool,
}

pub struct WorkerState {
    args: WorkerArgs,
    runners: BTreeMap<String, RunnerProcess>,
    /// Tasks handed to a runner (so a task is never handed twice).
    handed: BTreeSet<String>,
    /// When a runner that failed may start again, and its backoff.
    backoff: BTreeMap<String, (Instant, Duration)>,
}

impl WorkerState {
    async fn local_event(&self, event: event::Kind) {
        let local = LocalEvent {
            origin_node_id: self.args.node_id.clone(),
            origin_seq: self.args.seq.fetch_add(1, Ordering::Relaxed) + 1,
            event: Some(Event { kind: Some(event) }),
        };
        let key = self.args.bus.keys.local_events();
        if let Err(error) = self.args.bus.put(&key, &local).await {
            tracing::warn!(%error, "publishing a local event");
        }
    }

    async fn status(&self, runner_id: &str, state: Rs) {
        self.local_event(event::Kind::RunnerStatusUpdated(v1::RunnerStatusUpdated {
            runner_id: runner_id.to_string(),
            status: Some(v1::RunnerStatus { state: Some(state) }),
        }))
        .await;
    }

    async fn command(&self, kind: command::Kind) {
        let command = Command {
            command_id: uuid::Uuid::now_v7().to_string(),
            origin_node_id: self.args.node_id.clone(),
            kind: Some(kind),
        };
        let key = self.args.bus.keys.commands();
        if let Err(error) = self.args.bus.put(&key, &command).await {
            tracing::warn!(%error, "sending a command");
        }
    }

    async fn order(&mut self, runner_id: &str, order: &ToRunner) -> bool {
        let Some(runner) = self.runners.get_mut(runner_id) else {
            return false;
        };
        let Ok(mut line) = serde_json::to_string(order) else {
            return false;
        };
        line.push('\n');
        runner.stdin.write_all(line.as_bytes()).await.is_ok()
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
        let state: v1::ClusterState = call!(self.args.replica, ReplicaMsg::GetState)?;
        let Some(instance) = state.instances.get(instance_id) else {
            return Ok(());
        };
        let mut child = tokio::process::Command::new(&self.args.exe)
            .arg("runner")
            .args(["--runner-id", runner_id])
            .args(["--instance-json", &serde_json::to_string(instance)?])
            .args(["--threads", &self.args.threads.to_string()])
            .env("TESSERA_HOME", &self.args.data_dir)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("runner pipes".into());
        };
        tracing::info!(runner_id, rank, "started a runner");
        let reporter = myself.clone();
        let id = runner_id.to_string();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<FromRunner>(&line) {
                    Ok(report) => {
                        let _ = reporter.cast(WorkerMsg::Report(id.clone(), report));
                    }
                    Err(error) => tracing::warn!(%error, line, "runner said something odd"),
                }
            }
            let _ = reporter.cast(WorkerMsg::Exited(id, String::new()));
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
                stdin,
                child,
                command_id: None,
                stopping: false,
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
        myself.send_interval(Duration::from_millis(100), || WorkerMsg::Tick);
        Ok(WorkerState {
            args,
            runners: BTreeMap::new(),
            handed: BTreeSet::new(),
            backoff: BTreeMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            WorkerMsg::Tick => {
                let cluster: v1::ClusterState = call!(state.args.replica, ReplicaMsg::GetState)?;
                let locals: BTreeMap<String, LocalRunner> = state
                    .runners
                    .iter()
                    .map(|(id, r)| (id.clone(), r.local.clone()))
                    .collect();
                let mut view = cluster.clone();
                // Tasks already handed out are not offered again, even before
                // the log has their acknowledgement.
                for (id, task) in view.tasks.iter_mut() {
                    if state.handed.contains(id) {
                        task.acknowledged = true;
                    }
                }
                state.handed.retain(|id| cluster.tasks.contains_key(id));
                let Some(step) = plan(&view, &state.args.node_id, &locals) else {
                    return Ok(());
                };
                tracing::debug!(?step, "next step");
                match &step {
                    Step::CreateRunner {
                        instance_id,
                        runner_id,
                        rank,
                    } => {
                        state
                            .start_runner(&myself, instance_id, runner_id, *rank)
                            .await?;
                        return Ok(());
                    }
                    Step::Connect { runner_id } => {
                        state.order(runner_id, &ToRunner::Connect).await;
                    }
                    Step::Load { runner_id } => {
                        state.order(runner_id, &ToRunner::Load).await;
                    }
                    Step::WarmUp { runner_id } => {
                        state.order(runner_id, &ToRunner::WarmUp).await;
                    }
                    Step::Forward { runner_id, task_id } => {
                        let Some(task) = cluster.tasks.get(task_id) else {
                            return Ok(());
                        };
                        let Some(v1::task::Kind::TextGeneration(generation)) = &task.kind else {
                            return Ok(());
                        };
                        let order = ToRunner::Generate {
                            task_id: task_id.clone(),
                            command_id: task.command_id.clone(),
                            params: Box::new(generation.params.clone().unwrap_or_default()),
                        };
                        state.handed.insert(task_id.clone());
                        if state.order(runner_id, &order).await {
                            if let Some(r) = state.runners.get_mut(runner_id) {
                                r.local.task_id = Some(task_id.clone());
                                r.command_id = Some(task.command_id.clone());
                            }
                        }
                        state
                            .local_event(event::Kind::TaskAcknowledged(v1::TaskAcknowledged {
                                task_id: task_id.clone(),
                            }))
                            .await;
                    }
                    Step::Cancel { runner_id, task_id } => {
                        state
                            .order(
                                runner_id,
                                &ToRunner::Cancel {
                                    task_id: task_id.clone(),
                                },
                            )
                            .await;
                    }
                    Step::Shutdown { runner_id } => {
                        if let Some(r) = state.runners.get_mut(runner_id) {
                            r.stopping = true;
                        }
                        if !state.order(runner_id, &ToRunner::Shutdown).await {
                            if let Some(mut r) = state.runners.remove(runner_id) {
                                let _ = r.child.kill().await;
                            }
                            state
                                .status(runner_id, Rs::Shutdown(v1::RunnerShutdown {}))
                                .await;
                        }
                    }
                }
                let runner_id = match &step {
                    Step::Connect { runner_id }
                    | Step::Load { runner_id }
                    | Step::WarmUp { runner_id }
                    | Step::Forward { runner_id, .. }
                    | Step::Cancel { runner_id, .. }
                    | Step::Shutdown { runner_id } => runner_id.clone(),
                    Step::CreateRunner { runner_id, .. } => runner_id.clone(),
                };
                if let Some(r) = state.runners.get_mut(&runner_id) {
                    r.local.pending = Some(step);
                }
            }
            WorkerMsg::Report(runner_id, report) => match report {
                FromRunner::Status { status } => {
                    if let Some(s) = status.state.clone() {
                        state.status(&runner_id, s).await;
                    }
                }
                FromRunner::Chunk { chunk } => {
                    if let Ok(key) = state.args.bus.keys.chunks(&chunk.command_id) {
                        if let Err(error) = state.args.bus.put(&key, &chunk).await {
                            tracing::warn!(%error, "publishing a chunk");
                        }
                    }
                }
                FromRunner::Finished { task_id, error } => {
                    if let Some(error) = error {
                        tracing::warn!(task_id, error, "generation failed");
                    }
                    if let Some(r) = state.runners.get_mut(&runner_id) {
                        r.local.task_id = None;
                        r.command_id = None;
                    }
                    state
                        .command(command::Kind::TaskFinished(v1::TaskFinished { task_id }))
                        .await;
                }
            },
            WorkerMsg::Exited(runner_id, _) => {
                let Some(mut runner) = state.runners.remove(&runner_id) else {
                    return Ok(());
                };
                let exit = runner.child.wait().await.ok();
                if runner.stopping {
                    state
                        .status(&runner_id, Rs::Shutdown(v1::RunnerShutdown {}))
                        .await;
                    state.backoff.remove(&runner_id);
                    return Ok(());
                }
                let reason = format!(
                    "the runner process exited ({})",
                    exit.map_or("unknown status".to_string(), |s| s.to_string())
                );
                tracing::warn!(runner_id, reason, "runner failed");
                if let Some(command_id) = &runner.command_id {
                    state.error_chunk(command_id, &reason).await;
                }
                if let Some(task_id) = runner.local.task_id.take() {
                    state
                        .command(command::Kind::TaskFinished(v1::TaskFinished { task_id }))
                        .await;
                }
                state
                    .status(
                        &runner_id,
                        Rs::Failed(v1::RunnerFailed {
                            reason: reason.clone(),
                            diagnostics: String::new(),
                        }),
                    )
                    .await;
                // Gone from this node; started again after a backoff once
                // the failure is in the log (plan creates it anew).
                state
                    .status(&runner_id, Rs::Shutdown(v1::RunnerShutdown {}))
                    .await;
                let wait = state
                    .backoff
                    .get(&runner_id)
                    .map_or(Duration::from_millis(500), |(_, d)| {
                        (*d * 2).min(Duration::from_secs(30))
                    });
                state
                    .backoff
                    .insert(runner_id, (Instant::now() + wait, wait));
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<Self::Msg>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        for (id, runner) in state.runners.iter_mut() {
            runner.stopping = true;
            let line = "{\"op\":\"shutdown\"}\n";
            let _ = runner.stdin.write_all(line.as_bytes()).await;
            let stopped = tokio::time::timeout(Duration::from_secs(5), runner.child.wait()).await;
            if stopped.is_err() {
                tracing::warn!(runner = %id, "runner did not stop; killing it");
                let _ = runner.child.kill().await;
            }
        }
        Ok(())
    }
}
