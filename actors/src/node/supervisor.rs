//! The node's root supervisor: the parent of the Replica, the Election and
//! the Worker, and the keeper of the API's failures (the binary serves and
//! restarts the API, asking here how long to wait). A child that fails is reported (the log, and [`Health`]) and
//! started again after a backoff; the policy is [`plan`], a plain function.
//!
//! The Election and the Worker are restarted in place: what holds them
//! holds a [`Current`] handle, which the restart points at the new actor.
//! The Replica is not: it owns the event log, and every task of the node
//! (the router, the API, the reporters) holds it, so its failure stops the
//! node with the reason, for the service manager to start the process
//! again from the log on disk; that is the one restart that is certain to
//! leave nothing holding the old one.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::watch;

use crate::cluster::election::actor::{ElectionActor, ElectionArgs, ElectionMsg};
use crate::cluster::replica::{Replica, ReplicaArgs, ReplicaMsg};
use crate::worker::{Worker, WorkerArgs, WorkerMsg};

/// An actor handle that a supervisor may point at a restarted actor.
pub struct Current<M: ractor::Message>(Arc<RwLock<ActorRef<M>>>);

impl<M: ractor::Message> Clone for Current<M> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<M: ractor::Message> Current<M> {
    pub fn new(actor: ActorRef<M>) -> Self {
        Self(Arc::new(RwLock::new(actor)))
    }

    /// The actor as it is now.
    pub fn get(&self) -> ActorRef<M> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, actor: ActorRef<M>) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = actor;
    }
}

/// The supervised children.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Child {
    Replica,
    Election,
    Worker,
    /// The HTTP API, which the binary serves beside the node and restarts
    /// itself (the actors cannot depend on the API crate); its failures
    /// count here like the others'.
    Api,
}

/// How the node's actors are doing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// Restarts so far, per child (counted once the new actor runs).
    pub restarts: BTreeMap<String, u32>,
    /// The last failure, if any: which child, and why.
    pub last_failure: Option<String>,
    /// Set when the node cannot go on: why. The node then stops.
    pub fatal: Option<String>,
}

/// What to do about a child that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Start it again after this wait.
    Restart(Duration),
    /// Stop the node, for this reason.
    GiveUp(String),
}

/// Failures within this window count against [`MAX_FAILURES`].
pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// More failures than this within the window: the child is given up.
pub const MAX_FAILURES: usize = 5;
const FIRST_WAIT: Duration = Duration::from_millis(500);
const MAX_WAIT: Duration = Duration::from_secs(30);

/// The failures of each child, most recent last.
#[derive(Clone, Debug, Default)]
pub struct Failures(BTreeMap<Child, Vec<Instant>>);

/// What to do when `child` fails at `now`, given the failures before it
/// (recorded here). The wait doubles with each failure in the window.
pub fn plan(child: Child, failures: &mut Failures, now: Instant) -> Plan {
    if child == Child::Replica {
        return Plan::GiveUp(
            "the event log's actor (Replica) failed; the node stops so that it starts \
             again from its log on disk"
                .into(),
        );
    }
    let recent = failures.0.entry(child).or_default();
    recent.retain(|at| now.saturating_duration_since(*at) < FAILURE_WINDOW);
    recent.push(now);
    if recent.len() > MAX_FAILURES {
        return Plan::GiveUp(format!(
            "the {child:?} actor failed {} times within {FAILURE_WINDOW:?}",
            recent.len()
        ));
    }
    let doublings = u32::try_from(recent.len() - 1).unwrap_or(u32::MAX).min(16);
    Plan::Restart(FIRST_WAIT.saturating_mul(1 << doublings).min(MAX_WAIT))
}

/// The supervisor's children and how to start each again.
pub struct SupervisorArgs {
    pub replica: ReplicaArgs,
    pub election: ElectionSettings,
    /// None: this node runs no models.
    pub worker: Option<WorkerSettings>,
    pub health: watch::Sender<Health>,
}

/// The Election's arguments but the replica (known once it runs).
#[derive(Clone)]
pub struct ElectionSettings {
    pub node_id: String,
    pub bus: crate::bus::Bus,
    pub applied: Arc<std::sync::atomic::AtomicU64>,
    /// The highest election clock the log had at the start.
    pub clock: u64,
    pub was_member: bool,
    pub leadership: crate::cluster::election::actor::Leadership,
    pub max_concurrent: u32,
    pub secured: bool,
}

impl ElectionSettings {
    fn args(&self, replica: ActorRef<ReplicaMsg>) -> ElectionArgs {
        ElectionArgs {
            node_id: self.node_id.clone(),
            bus: self.bus.clone(),
            replica,
            applied: self.applied.clone(),
            clock: self.clock,
            was_member: self.was_member,
            leadership: self.leadership.clone(),
            max_concurrent: self.max_concurrent,
            secured: self.secured,
        }
    }
}

/// The Worker's arguments but the replica.
#[derive(Clone)]
pub struct WorkerSettings {
    pub node_id: String,
    pub bus: crate::bus::Bus,
    pub events: Arc<crate::cluster::local_events::LocalEvents>,
    pub exe: std::path::PathBuf,
    pub data_dir: std::path::PathBuf,
    pub threads: usize,
    /// Where each runner puts its model (`--device`).
    pub device: tessera_engine::gpu::DeviceChoice,
    pub runner_endpoint: String,
    pub downloader: Arc<crate::worker::downloads::Downloader>,
}

impl WorkerSettings {
    fn args(&self, replica: ActorRef<ReplicaMsg>) -> WorkerArgs {
        WorkerArgs {
            node_id: self.node_id.clone(),
            bus: self.bus.clone(),
            replica,
            events: self.events.clone(),
            exe: self.exe.clone(),
            data_dir: self.data_dir.clone(),
            threads: self.threads,
            device: self.device,
            runner_endpoint: self.runner_endpoint.clone(),
            downloader: self.downloader.clone(),
        }
    }
}

/// The handles of the children, kept current across restarts.
#[derive(Clone)]
pub struct Children {
    pub replica: ActorRef<ReplicaMsg>,
    pub election: Current<ElectionMsg>,
    pub worker: Option<Current<WorkerMsg>>,
}

pub enum SupervisorMsg {
    /// Start a failed child again (after its backoff).
    Restart(Child),
    /// The node is stopping: children that end now are not restarted.
    Stopping(ractor::RpcReplyPort<()>),
    /// The children's handles.
    Children(ractor::RpcReplyPort<Children>),
    /// A child served outside the actors (the API) failed: the wait before
    /// it may start again, or none when it is given up (then the node
    /// stops, as `Health::fatal` says).
    Failed(Child, String, ractor::RpcReplyPort<Option<Duration>>),
    /// That child runs again.
    Restarted(Child),
}

pub struct NodeSupervisor;

pub struct SupervisorState {
    election: ElectionSettings,
    worker: Option<WorkerSettings>,
    children: Children,
    failures: Failures,
    health: watch::Sender<Health>,
    stopping: bool,
}

impl SupervisorState {
    fn child_of(&self, cell: &ActorCell) -> Option<Child> {
        let id = cell.get_id();
        if self.children.replica.get_id() == id {
            Some(Child::Replica)
        } else if self.children.election.get().get_id() == id {
            Some(Child::Election)
        } else if self
            .children
            .worker
            .as_ref()
            .is_some_and(|w| w.get().get_id() == id)
        {
            Some(Child::Worker)
        } else {
            None
        }
    }

    /// Starts `child` again, linked, and points its handle at it.
    async fn restart(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        child: Child,
    ) -> Result<(), ActorProcessingErr> {
        match child {
            Child::Election => {
                let mut args = self.election.args(self.children.replica.clone());
                // The clock the log has reached since the first start.
                let state = ractor::call_t!(
                    self.children.replica,
                    ReplicaMsg::GetState,
                    crate::ACTOR_CALL_MS
                )?;
                args.clock = state.session.as_ref().map_or(0, |s| s.election_clock);
                args.was_member = true;
                let (election, _) =
                    Actor::spawn_linked(None, ElectionActor, args, myself.get_cell()).await?;
                self.children.election.set(election);
            }
            Child::Worker => {
                let (Some(settings), Some(current)) = (&self.worker, &self.children.worker) else {
                    return Ok(());
                };
                let args = settings.args(self.children.replica.clone());
                let (worker, _) =
                    Actor::spawn_linked(None, Worker, args, myself.get_cell()).await?;
                current.set(worker);
            }
            Child::Replica | Child::Api => return Ok(()),
        }
        tracing::warn!(?child, "restarted");
        self.count_restart(child);
        Ok(())
    }

    fn failed(&mut self, myself: &ActorRef<SupervisorMsg>, child: Child, why: String) {
        if let Some(wait) = self.record_failure(child, why) {
            tracing::warn!(?child, ?wait, "restarting after a backoff");
            myself.send_after(wait, move || SupervisorMsg::Restart(child));
        }
    }

    /// Logs and reports `child`'s failure; the wait before it starts
    /// again, or none when it is given up (and the node cannot go on).
    fn record_failure(&mut self, child: Child, why: String) -> Option<Duration> {
        tracing::error!(?child, reason = why, "a part of the node failed");
        let plan = plan(child, &mut self.failures, Instant::now());
        self.health.send_modify(|health| {
            health.last_failure = Some(format!("{child:?}: {why}"));
        });
        match plan {
            Plan::Restart(wait) => Some(wait),
            Plan::GiveUp(reason) => {
                tracing::error!(reason, "the node cannot go on");
                self.health
                    .send_modify(|health| health.fatal = Some(reason.clone()));
                None
            }
        }
    }

    fn count_restart(&self, child: Child) {
        self.health.send_modify(|health| {
            *health.restarts.entry(format!("{child:?}")).or_default() += 1;
        });
    }
}

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let cell = myself.get_cell();
        let (replica, _) = Actor::spawn_linked(None, Replica, args.replica, cell.clone()).await?;
        let (election, _) = Actor::spawn_linked(
            None,
            ElectionActor,
            args.election.args(replica.clone()),
            cell.clone(),
        )
        .await?;
        let worker = match &args.worker {
            Some(settings) => {
                let worker_args = settings.args(replica.clone());
                let (worker, _) =
                    Actor::spawn_linked(None, Worker, worker_args, cell.clone()).await?;
                Some(Current::new(worker))
            }
            None => None,
        };
        Ok(SupervisorState {
            election: args.election,
            worker: args.worker,
            children: Children {
                replica,
                election: Current::new(election),
                worker,
            },
            failures: Failures::default(),
            health: args.health,
            stopping: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMsg::Restart(_) if state.stopping => {}
            SupervisorMsg::Restart(child) => {
                if let Err(error) = state.restart(&myself, child).await {
                    state.failed(&myself, child, format!("restarting: {error}"));
                }
            }
            SupervisorMsg::Stopping(reply) => {
                state.stopping = true;
                let _ = reply.send(());
            }
            SupervisorMsg::Children(reply) => {
                let _ = reply.send(state.children.clone());
            }
            SupervisorMsg::Failed(child, why, reply) => {
                let wait = if state.stopping {
                    None
                } else {
                    state.record_failure(child, why)
                };
                let _ = reply.send(wait);
            }
            SupervisorMsg::Restarted(child) => state.count_restart(child),
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match event {
            SupervisionEvent::ActorFailed(cell, error) => (cell, error.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell,
                reason.unwrap_or_else(|| "it stopped out of turn".into()),
            ),
            _ => return Ok(()),
        };
        if state.stopping {
            return Ok(());
        }
        if let Some(child) = state.child_of(&cell) {
            state.failed(&myself, child, why);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_child_waits_twice_as_long_each_time_then_is_given_up() {
        let mut failures = Failures::default();
        let start = Instant::now();
        let waits: Vec<Plan> = (0..MAX_FAILURES as u64)
            .map(|i| plan(Child::Worker, &mut failures, start + Duration::from_secs(i)))
            .collect();
        let expected: Vec<Plan> = [500, 1000, 2000, 4000, 8000]
            .iter()
            .map(|ms| Plan::Restart(Duration::from_millis(*ms)))
            .collect();
        assert_eq!(waits, expected);
        let given_up = plan(Child::Worker, &mut failures, start + Duration::from_secs(6));
        assert!(matches!(given_up, Plan::GiveUp(_)), "{given_up:?}");
        // Each child has its own count.
        assert_eq!(
            plan(Child::Election, &mut failures, start),
            Plan::Restart(FIRST_WAIT)
        );
    }

    #[test]
    fn failures_out_of_the_window_are_forgiven() {
        let mut failures = Failures::default();
        let start = Instant::now();
        for i in 0..MAX_FAILURES as u64 {
            plan(
                Child::Election,
                &mut failures,
                start + Duration::from_secs(i),
            );
        }
        let later = start + FAILURE_WINDOW + Duration::from_secs(10);
        assert_eq!(
            plan(Child::Election, &mut failures, later),
            Plan::Restart(FIRST_WAIT)
        );
    }

    #[test]
    fn the_apis_failures_count_like_an_actors() {
        let mut failures = Failures::default();
        let start = Instant::now();
        assert_eq!(
            plan(Child::Api, &mut failures, start),
            Plan::Restart(FIRST_WAIT)
        );
        assert_eq!(
            plan(Child::Api, &mut failures, start),
            Plan::Restart(FIRST_WAIT * 2)
        );
        // The Worker's count is its own.
        assert_eq!(
            plan(Child::Worker, &mut failures, start),
            Plan::Restart(FIRST_WAIT)
        );
    }

    #[test]
    fn a_failed_replica_stops_the_node() {
        let plan = plan(Child::Replica, &mut Failures::default(), Instant::now());
        assert!(matches!(plan, Plan::GiveUp(_)), "{plan:?}");
    }
}
