//! The RunnerSupervisor actor: one per runner, spawned linked by the Worker.
//! It owns the `tessera runner` child process (its lifeline stdin, the tail
//! of its stderr, the waiter on its exit), puts the worker's `Task`s on
//! `runner/{id}/tasks`, relays the runner's statuses to the master as local
//! events, and turns a child that dies out of turn into `RunnerFailed`: an
//! error chunk to the request in flight, the task finished, and a report to
//! the worker, which starts the runner again after a [`Backoff`].
//!
//! The child is killed when this actor's state is dropped, however the
//! actor ends (the waiter holds the process and watches a channel whose
//! sender lives in the state).

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, DerivedActorRef, RpcReplyPort};
use tessera_protos::v1::{self, event, generation_chunk, runner_status::State as Rs, task};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;

use crate::bus::Bus;
use crate::cluster::local_events::LocalEvents;

/// Lines of a runner's stderr kept for the diagnostics of its failure.
const STDERR_TAIL: usize = 20;
/// How long a runner told to shut down may take before it is killed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The child process to start: `tessera runner …` in a node, anything in
/// tests.
#[derive(Clone, Debug)]
pub struct RunnerCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub envs: Vec<(OsString, OsString)>,
}

/// What a supervisor tells the worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunnerReport {
    /// The generation task `task_id` has ended (its runner said so, or died).
    TaskEnded { runner_id: String, task_id: String },
    /// The child has exited and the supervisor stops: `failed` when it was
    /// not asked to.
    Ended { runner_id: String, failed: bool },
}

pub enum SupervisorMsg {
    /// Put this task on the runner's `tasks` key; answers whether the put
    /// went out.
    Order(Box<v1::Task>, RpcReplyPort<bool>),
    /// A status the runner put on `runner/{id}/events`.
    Status(v1::RunnerStatus),
    /// Order a shutdown; the child is killed if it has not exited within
    /// [`SHUTDOWN_GRACE`].
    Shutdown,
    /// The grace after a shutdown order has run out.
    Kill,
    /// The child process has ended.
    Exited { exit: String, stderr: String },
}

pub struct SupervisorArgs {
    pub runner_id: String,
    pub command: RunnerCommand,
    pub bus: Bus,
    /// Statuses and finished tasks go to the master through these.
    pub events: Arc<LocalEvents>,
    pub reports: DerivedActorRef<RunnerReport>,
}

pub struct SupervisorState {
    args: SupervisorArgs,
    /// Sending (or dropping) it kills the child.
    kill: Option<oneshot::Sender<()>>,
    /// The child's stdin, held open while the supervisor lives: the child
    /// exits when it closes, so a node killed outright leaves no runner.
    _lifeline: Option<tokio::process::ChildStdin>,
    /// Generations handed to the runner and not yet ended: task id to
    /// command id.
    in_flight: BTreeMap<String, String>,
    stopping: bool,
    /// The last status relayed (a runner repeats its status until it hears
    /// from the node; repeats are not relayed again).
    last_status: Option<Rs>,
}

pub struct RunnerSupervisor;

impl Actor for RunnerSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (kill, lifeline) = spawn_child(&args, myself)?;
        Ok(SupervisorState {
            args,
            kill: Some(kill),
            _lifeline: lifeline,
            in_flight: BTreeMap::new(),
            stopping: false,
            last_status: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMsg::Order(task, reply) => {
                let sent = state.order(&task).await;
                let _ = reply.send(sent);
            }
            SupervisorMsg::Status(status) => state.on_status(status).await,
            SupervisorMsg::Shutdown => state.shutdown(&myself).await,
            SupervisorMsg::Kill => {
                if let Some(kill) = state.kill.take() {
                    tracing::warn!(
                        runner_id = state.args.runner_id,
                        "runner did not stop; killing it"
                    );
                    let _ = kill.send(());
                }
            }
            SupervisorMsg::Exited { exit, stderr } => {
                state.on_exit(exit, stderr).await;
                myself.stop(None);
            }
        }
        Ok(())
    }
}

/// Starts the child with its stderr tailed and its exit awaited; returns
/// the kill switch and the lifeline.
fn spawn_child(
    args: &SupervisorArgs,
    myself: ActorRef<SupervisorMsg>,
) -> Result<(oneshot::Sender<()>, Option<tokio::process::ChildStdin>), ActorProcessingErr> {
    let mut child = tokio::process::Command::new(&args.command.program)
        .args(&args.command.args)
        .envs(args.command.envs.iter().map(|(k, v)| (k, v)))
        // Never written: the child exits when it closes.
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", args.command.program.display()))?;
    tracing::info!(
        runner_id = args.runner_id,
        pid = child.id(),
        "started a runner"
    );
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
    tokio::spawn(async move {
        let status = tokio::select! {
            status = child.wait() => status,
            // Sent, or dropped with the supervisor's state.
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
        let _ = myself.cast(SupervisorMsg::Exited { exit, stderr });
    });
    Ok((kill, lifeline))
}

impl SupervisorState {
    fn runner_id(&self) -> &str {
        &self.args.runner_id
    }

    fn report(&self, report: RunnerReport) {
        if self.args.reports.send_message(report).is_err() {
            tracing::debug!(runner_id = self.runner_id(), "the worker is gone");
        }
    }

    async fn order(&mut self, task: &v1::Task) -> bool {
        let Ok(key) = self.args.bus.keys.runner(self.runner_id(), "tasks") else {
            return false;
        };
        if let Err(error) = self.args.bus.put(&key, task).await {
            tracing::warn!(%error, runner_id = self.runner_id(), "ordering a runner");
            return false;
        }
        if let Some(task::Kind::TextGeneration(_)) = &task.kind {
            self.in_flight
                .insert(task.task_id.clone(), task.command_id.clone());
        }
        true
    }

    async fn shutdown(&mut self, myself: &ActorRef<SupervisorMsg>) {
        let order = v1::Task {
            kind: Some(task::Kind::Shutdown(v1::ShutdownTask {
                runner_id: self.runner_id().to_string(),
            })),
            ..Default::default()
        };
        self.order(&order).await;
        if !self.stopping {
            self.stopping = true;
            myself.send_after(SHUTDOWN_GRACE, || SupervisorMsg::Kill);
        }
    }

    async fn status(&self, state: Rs) {
        let event = event::Kind::RunnerStatusUpdated(v1::RunnerStatusUpdated {
            runner_id: self.runner_id().to_string(),
            status: Some(v1::RunnerStatus { state: Some(state) }),
        });
        self.args.events.publish_or_log(event).await;
    }

    /// The task leaves the state (as a report, so that it is delivered
    /// across a change of master), and the worker hears of it.
    async fn task_ended(&self, task_id: String) {
        let event = event::Kind::TaskDeleted(v1::TaskDeleted {
            task_id: task_id.clone(),
        });
        self.args.events.publish_or_log(event).await;
        self.report(RunnerReport::TaskEnded {
            runner_id: self.runner_id().to_string(),
            task_id,
        });
    }

    /// Relays a status; the end of a run finishes its task.
    async fn on_status(&mut self, status: v1::RunnerStatus) {
        let Some(state) = status.state else {
            let runner_id = self.runner_id().to_string();
            self.args
                .bus
                .count_dropped(&runner_id, "a runner status without a state");
            return;
        };
        if self.last_status.as_ref() == Some(&state) {
            return;
        }
        self.last_status = Some(state.clone());
        // A task ends when the runner says so; one that stops or fails
        // ends them all.
        let finished: Vec<String> = match &state {
            Rs::Ready(ready) => self.take_ended(&ready.ended_task_ids),
            Rs::Running(running) => self.take_ended(&running.ended_task_ids),
            _ => std::mem::take(&mut self.in_flight).into_keys().collect(),
        };
        self.status(state).await;
        for task_id in finished {
            self.task_ended(task_id).await;
        }
    }

    fn take_ended(&mut self, ended: &[String]) -> Vec<String> {
        ended
            .iter()
            .filter(|id| self.in_flight.remove(id.as_str()).is_some())
            .cloned()
            .collect()
    }

    async fn on_exit(&mut self, exit: String, stderr: String) {
        let runner_id = self.runner_id().to_string();
        if self.stopping {
            self.status(Rs::Shutdown(v1::RunnerShutdown {})).await;
            self.report(RunnerReport::Ended {
                runner_id,
                failed: false,
            });
            return;
        }
        let reason = format!("the runner process exited ({exit})");
        tracing::warn!(runner_id, reason, "runner failed");
        for (task_id, command_id) in std::mem::take(&mut self.in_flight) {
            error_chunk(&self.args.bus, &command_id, &reason).await;
            self.task_ended(task_id).await;
        }
        self.status(Rs::Failed(v1::RunnerFailed {
            reason,
            diagnostics: stderr,
        }))
        .await;
        // Gone from this node; the worker starts it again after a backoff
        // once the failure is in the log.
        self.status(Rs::Shutdown(v1::RunnerShutdown {})).await;
        self.report(RunnerReport::Ended {
            runner_id,
            failed: true,
        });
    }
}

/// Tells the client waiting on `command_id` that its generation failed.
pub async fn error_chunk(bus: &Bus, command_id: &str, message: &str) {
    let chunk = v1::GenerationChunk {
        command_id: command_id.to_string(),
        seq: u64::MAX,
        kind: Some(generation_chunk::Kind::Error(v1::ErrorChunk {
            kind: "runner_failed".into(),
            message: message.to_string(),
        })),
    };
    if let Ok(key) = bus.keys.chunks(command_id) {
        let _ = bus.put(&key, &chunk).await;
    }
}

/// When each failed runner may start again: 0.5 s after its first failure,
/// doubling up to 30 s while it keeps failing; forgotten once it stops
/// cleanly.
#[derive(Debug, Default)]
pub struct Backoff {
    waits: BTreeMap<String, (Instant, Duration)>,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(30);

    /// Records a failure at `now`; returns the wait before a restart.
    pub fn failed(&mut self, runner_id: &str, now: Instant) -> Duration {
        let wait = self
            .waits
            .get(runner_id)
            .map_or(Self::FIRST, |(_, d)| (*d * 2).min(Self::MAX));
        self.waits.insert(runner_id.to_string(), (now + wait, wait));
        wait
    }

    pub fn may_start(&self, runner_id: &str, now: Instant) -> bool {
        self.waits.get(runner_id).is_none_or(|(at, _)| now >= *at)
    }

    pub fn forget(&mut self, runner_id: &str) {
        self.waits.remove(runner_id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prost::Message;
    use ractor::{Actor, ActorProcessingErr, ActorRef};
    use tokio::sync::mpsc;

    use super::*;
    use crate::bus::keys::Keys;

    #[test]
    fn the_backoff_doubles_to_a_ceiling_and_is_forgotten_after_a_clean_stop() {
        let mut backoff = Backoff::default();
        let t0 = Instant::now();
        assert!(backoff.may_start("r", t0));
        assert_eq!(backoff.failed("r", t0), Duration::from_millis(500));
        assert!(!backoff.may_start("r", t0 + Duration::from_millis(499)));
        assert!(backoff.may_start("r", t0 + Duration::from_millis(500)));
        assert!(backoff.may_start("other", t0));
        let waits: Vec<u64> = (0..8)
            .map(|_| backoff.failed("r", t0).as_millis() as u64)
            .collect();
        assert_eq!(waits, [1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]);
        backoff.forget("r");
        assert_eq!(backoff.failed("r", t0), Duration::from_millis(500));
    }

    /// Collects a supervisor's reports, as the worker would receive them.
    struct Reports;

    impl Actor for Reports {
        type Msg = RunnerReport;
        type State = mpsc::UnboundedSender<RunnerReport>;
        type Arguments = mpsc::UnboundedSender<RunnerReport>;

        async fn pre_start(
            &self,
            _: ActorRef<Self::Msg>,
            sink: Self::Arguments,
        ) -> Result<Self::State, ActorProcessingErr> {
            Ok(sink)
        }

        async fn handle(
            &self,
            _: ActorRef<Self::Msg>,
            report: RunnerReport,
            sink: &mut Self::State,
        ) -> Result<(), ActorProcessingErr> {
            let _ = sink.send(report);
            Ok(())
        }
    }

    /// A session that reaches no one and hears its own puts.
    async fn lonely_bus(namespace: &str) -> Bus {
        let mut config = crate::bus::zenoh_config("peer", &[], &[], false, None).expect("config");
        config
            .insert_json5("listen/endpoints", "[]")
            .expect("no listening");
        let session = zenoh::open(config).await.expect("a zenoh session");
        Bus::new(session, Keys::new(namespace).expect("keys"))
    }

    fn shell(script: &str) -> RunnerCommand {
        RunnerCommand {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            envs: Vec::new(),
        }
    }

    struct Harness {
        bus: Bus,
        reports: mpsc::UnboundedReceiver<RunnerReport>,
        statuses: mpsc::UnboundedReceiver<Rs>,
        reports_actor: ActorRef<RunnerReport>,
        _subscriber: zenoh::pubsub::Subscriber<()>,
    }

    impl Harness {
        async fn new(namespace: &str) -> Self {
            let bus = lonely_bus(namespace).await;
            let (report_tx, reports) = mpsc::unbounded_channel();
            let (reports_actor, _) = Actor::spawn(None, Reports, report_tx)
                .await
                .expect("reports");
            let (status_tx, statuses) = mpsc::unbounded_channel();
            let subscriber = bus
                .session
                .declare_subscriber(bus.keys.local_events())
                .callback(move |sample| {
                    let Ok(local) = v1::LocalEvent::decode(sample.payload().to_bytes().as_ref())
                    else {
                        return;
                    };
                    if let Some(event::Kind::RunnerStatusUpdated(update)) =
                        local.event.and_then(|e| e.kind)
                    {
                        if let Some(state) = update.status.and_then(|s| s.state) {
                            let _ = status_tx.send(state);
                        }
                    }
                })
                .await
                .expect("subscriber");
            Self {
                bus,
                reports,
                statuses,
                reports_actor,
                _subscriber: subscriber,
            }
        }

        async fn supervise(&self, command: RunnerCommand) -> ActorRef<SupervisorMsg> {
            let args = SupervisorArgs {
                runner_id: "r1".into(),
                command,
                bus: self.bus.clone(),
                events: Arc::new(LocalEvents::new(self.bus.clone(), "n1".into())),
                reports: self.reports_actor.get_derived(),
            };
            let (supervisor, _) = Actor::spawn(None, RunnerSupervisor, args)
                .await
                .expect("supervisor");
            supervisor
        }

        async fn next_report(&mut self) -> RunnerReport {
            tokio::time::timeout(Duration::from_secs(10), self.reports.recv())
                .await
                .expect("a report in time")
                .expect("a report")
        }

        async fn next_status(&mut self) -> Rs {
            tokio::time::timeout(Duration::from_secs(10), self.statuses.recv())
                .await
                .expect("a status in time")
                .expect("a status")
        }
    }

    /// Hands the supervisor generation `t1` (command `c1`).
    async fn order_generation(supervisor: &ActorRef<SupervisorMsg>) {
        let task = v1::Task {
            task_id: "t1".into(),
            command_id: "c1".into(),
            kind: Some(task::Kind::TextGeneration(v1::TextGenerationTask::default())),
            ..Default::default()
        };
        let sent = ractor::call_t!(supervisor, SupervisorMsg::Order, 5000, Box::new(task));
        assert!(sent.expect("an answer"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_that_dies_becomes_runner_failed_and_is_restarted_after_the_backoff() {
        let mut harness = Harness::new("supervisor-test-fail").await;
        let mut backoff = Backoff::default();
        let mut starts = Vec::new();
        for _ in 0..2 {
            // The worker's plan asks again and again; the backoff says when.
            while !backoff.may_start("r1", Instant::now()) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            starts.push(Instant::now());
            let supervisor = harness
                .supervise(shell("echo 'out of memory' >&2; exit 3"))
                .await;
            let Rs::Failed(failed) = harness.next_status().await else {
                panic!("the first status is not Failed");
            };
            assert!(
                failed.reason.contains("exit status: 3"),
                "{}",
                failed.reason
            );
            assert_eq!(failed.diagnostics, "out of memory");
            assert!(matches!(harness.next_status().await, Rs::Shutdown(_)));
            assert_eq!(
                harness.next_report().await,
                RunnerReport::Ended {
                    runner_id: "r1".into(),
                    failed: true
                }
            );
            supervisor.wait(Some(Duration::from_secs(5))).await.ok();
            backoff.failed("r1", Instant::now());
        }
        assert!(starts[1] - starts[0] >= Duration::from_millis(500));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_generation_in_flight_gets_an_error_chunk_and_its_task_ends_when_the_child_dies() {
        let mut harness = Harness::new("supervisor-test-inflight").await;
        let (chunk_tx, mut chunks) = mpsc::unbounded_channel();
        let _chunks = harness
            .bus
            .session
            .declare_subscriber(harness.bus.keys.chunks("c1").expect("key"))
            .callback(move |sample| {
                if let Ok(chunk) = v1::GenerationChunk::decode(sample.payload().to_bytes().as_ref())
                {
                    let _ = chunk_tx.send(chunk);
                }
            })
            .await
            .expect("subscriber");
        // A child that dies once it has been ordered (its stdin is the
        // lifeline, so it waits on a file instead).
        let flag = tempfile::NamedTempFile::new().expect("temp file");
        let path = flag.path().display().to_string();
        let supervisor = harness
            .supervise(shell(&format!(
                "while [ ! -s {path} ]; do sleep 0.02; done; exit 9"
            )))
            .await;
        order_generation(&supervisor).await;
        std::fs::write(&path, "go").expect("written");
        let chunk = tokio::time::timeout(Duration::from_secs(10), chunks.recv())
            .await
            .expect("a chunk in time")
            .expect("a chunk");
        let Some(generation_chunk::Kind::Error(error)) = chunk.kind else {
            panic!("not an error chunk: {chunk:?}");
        };
        assert_eq!(error.kind, "runner_failed");
        assert_eq!(
            harness.next_report().await,
            RunnerReport::TaskEnded {
                runner_id: "r1".into(),
                task_id: "t1".into()
            }
        );
        assert!(matches!(harness.next_status().await, Rs::Failed(_)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_that_ignores_a_shutdown_is_killed_after_the_grace_and_ends_cleanly() {
        let mut harness = Harness::new("supervisor-test-stop").await;
        let supervisor = harness.supervise(shell("sleep 600")).await;
        let asked = Instant::now();
        supervisor
            .cast(SupervisorMsg::Shutdown)
            .expect("supervisor alive");
        assert_eq!(
            harness.next_report().await,
            RunnerReport::Ended {
                runner_id: "r1".into(),
                failed: false
            }
        );
        assert!(asked.elapsed() >= SHUTDOWN_GRACE);
        assert!(matches!(harness.next_status().await, Rs::Shutdown(_)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn statuses_are_relayed_once_and_the_end_of_a_run_ends_its_task() {
        let mut harness = Harness::new("supervisor-test-relay").await;
        let supervisor = harness.supervise(shell("sleep 600")).await;
        order_generation(&supervisor).await;
        let ready = || v1::RunnerStatus {
            state: Some(Rs::Ready(v1::RunnerReady {
                ended_task_ids: vec!["t0".into(), "t1".into()],
                draft: None,
            })),
        };
        let running = v1::RunnerStatus {
            state: Some(Rs::Running(v1::RunnerRunning {
                task_id: "t1".into(),
                task_ids: vec!["t1".into()],
                ended_task_ids: vec!["t0".into()],
                draft: None,
            })),
        };
        for status in [running.clone(), running, ready(), ready()] {
            supervisor
                .cast(SupervisorMsg::Status(status))
                .expect("supervisor alive");
        }
        assert!(matches!(harness.next_status().await, Rs::Running(_)));
        assert!(matches!(harness.next_status().await, Rs::Ready(_)));
        assert_eq!(
            harness.next_report().await,
            RunnerReport::TaskEnded {
                runner_id: "r1".into(),
                task_id: "t1".into()
            }
        );
        supervisor.kill();
        // No third status: the repeats were not relayed.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), harness.statuses.recv())
                .await
                .is_err()
        );
    }
}
