//! The Election actor: runs [`crate::cluster::election::Election`] over zenoh. When
//! this node wins it starts a Master; when another node leads it points the
//! Replica at that master (and stops a Master of its own, if any).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tessera_protos::v1::{election_message, ElectionMessage};

use crate::bus::Bus;
use crate::cluster::election::{Credentials, Election, Output};
use crate::cluster::master::{Master, MasterArgs, MasterMsg};
use crate::cluster::replica::ReplicaMsg;

/// Which node leads, shared with the router tasks and the admin service.
#[derive(Clone, Default)]
pub struct Leadership {
    inner: Arc<Mutex<LeadershipInner>>,
}

#[derive(Default)]
struct LeadershipInner {
    master: Option<(String, u64)>,
    local_master: Option<ActorRef<MasterMsg>>,
}

impl Leadership {
    /// The current master's node id and clock.
    pub fn master(&self) -> Option<(String, u64)> {
        self.lock().master.clone()
    }

    /// This node's Master actor, when this node leads.
    pub fn local_master(&self) -> Option<ActorRef<MasterMsg>> {
        self.lock().local_master.clone()
    }

    /// No master known: where a new Election starts (one that failed may
    /// have left its own Master here).
    fn clear(&self) {
        *self.lock() = LeadershipInner::default();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LeadershipInner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

pub enum ElectionMsg {
    Message(ElectionMessage),
    NodeAlive(String),
    NodeGone(String),
    Tick,
}

pub struct ElectionActor;

#[derive(Clone)]
pub struct ElectionArgs {
    pub node_id: String,
    pub bus: Bus,
    pub replica: ActorRef<ReplicaMsg>,
    pub applied: Arc<AtomicU64>,
    /// The highest election clock this node has seen (from its log).
    pub clock: u64,
    /// The log names other nodes: this node rejoins a cluster.
    pub was_member: bool,
    pub leadership: Leadership,
    /// The default the master writes into the instances it places.
    pub max_concurrent: u32,
    /// This node is in a secured cluster: its master seals instance rings.
    pub secured: bool,
}

pub struct ElectionState {
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    applied: Arc<AtomicU64>,
    election: Election,
    started: Instant,
    leadership: Leadership,
    alive: BTreeSet<String>,
    /// Won round `clock`; the Master starts at `at_ms` if still leading.
    settling: Option<(u64, u64)>,
    max_concurrent: u32,
    secured: bool,
}

/// How long a winner waits before its Master writes anything. Two nodes can
/// both win a round when a campaign crosses the end of the other's round
/// (a loaded machine); their victories settle it within one exchange, and
/// only the node still leading afterwards starts indexing, so the log never
/// gets two events at one index.
const SETTLE_MS: u64 = crate::cluster::election::HEARTBEAT_MS;

impl ElectionState {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn credentials(&self) -> Credentials {
        Credentials {
            node_id: self.node_id.clone(),
            last_applied_index: self.applied.load(Ordering::Relaxed),
            seniority_ms: self.now_ms(),
        }
    }
}

impl Actor for ElectionActor {
    type Msg = ElectionMsg;
    type State = ElectionState;
    type Arguments = ElectionArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: ElectionArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        myself.send_interval(Duration::from_millis(25), || ElectionMsg::Tick);
        args.leadership.clear();
        Ok(ElectionState {
            election: Election::new(args.node_id.clone(), args.clock, 0, args.was_member),
            node_id: args.node_id,
            bus: args.bus,
            replica: args.replica,
            applied: args.applied,
            started: Instant::now(),
            leadership: args.leadership,
            alive: BTreeSet::new(),
            settling: None,
            max_concurrent: args.max_concurrent,
            secured: args.secured,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: ElectionMsg,
        state: &mut ElectionState,
    ) -> Result<(), ActorProcessingErr> {
        let me = state.credentials();
        let now = state.now_ms();
        let outputs = match message {
            ElectionMsg::Message(message) => {
                // A heartbeat tells followers how far the master's log goes.
                if matches!(message.kind, Some(election_message::Kind::Victory(_)))
                    && state.election.master() == Some(message.node_id.as_str())
                    && message.clock == state.election.clock()
                {
                    let _ = state.replica.cast(ReplicaMsg::SetMaster {
                        node_id: message.node_id.clone(),
                        clock: message.clock,
                        last_index: message.last_applied_index,
                        is_me: false,
                    });
                }
                state.election.on_message(&message, &me, now)
            }
            ElectionMsg::Tick => {
                if let Some((clock, at)) = state.settling {
                    let leading = state.election.master() == Some(state.node_id.as_str())
                        && state.election.clock() == clock;
                    if !leading {
                        tracing::info!(clock, "lost the round while settling");
                        state.settling = None;
                    } else if now >= at {
                        state.settling = None;
                        start_master(state, clock, &myself).await;
                    }
                }
                state.election.on_tick(&me, now)
            }
            ElectionMsg::NodeAlive(node) => {
                state.election.on_node_alive(&node);
                state.alive.insert(node.clone());
                if let Some(master) = state.leadership.local_master() {
                    let _ = master.cast(MasterMsg::NodeAlive(node));
                }
                Vec::new()
            }
            ElectionMsg::NodeGone(node) => {
                state.alive.remove(&node);
                if let Some(master) = state.leadership.local_master() {
                    let _ = master.cast(MasterMsg::NodeGone(node.clone()));
                }
                state.election.on_node_gone(&node, &me, now)
            }
        };
        for output in outputs {
            match output {
                Output::Send(message) => {
                    let key = state.bus.keys.election();
                    if let Err(error) = state.bus.put(&key, &message).await {
                        tracing::warn!(%error, "publishing an election message");
                    }
                }
                Output::BecameMaster { clock } => {
                    // Won: settle first (see SETTLE_MS); a tick starts the
                    // Master if this node still leads then.
                    tracing::info!(clock, "won the election; settling");
                    state.settling = Some((clock, now + SETTLE_MS));
                }
                Output::Follow { master, clock } => {
                    tracing::info!(%master, clock, "following");
                    stop_local_master(state);
                    state.leadership.lock().master = Some((master.clone(), clock));
                    let _ = state.replica.cast(ReplicaMsg::SetMaster {
                        node_id: master,
                        clock,
                        last_index: 0,
                        is_me: false,
                    });
                }
                Output::SteppedDown => {
                    tracing::info!("stepped down");
                    stop_local_master(state);
                    state.leadership.lock().master = None;
                }
            }
        }
        Ok(())
    }

    /// A Master that stops (stepped down) or fails is this node's business
    /// alone: the election carries on (the default would stop it too).
    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut ElectionState,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(_, error) = event {
            tracing::error!(%error, "the master failed; leadership is given up");
            state.leadership.lock().local_master = None;
            let me = state.credentials();
            let now = state.now_ms();
            // Let another node (or a new round) take over.
            for output in state
                .election
                .on_node_gone(&state.node_id.clone(), &me, now)
            {
                if let Output::Send(message) = output {
                    let key = state.bus.keys.election();
                    let _ = state.bus.put(&key, &message).await;
                }
            }
        }
        Ok(())
    }
}

/// Starts this node's Master for round `clock`.
async fn start_master(state: &mut ElectionState, clock: u64, myself: &ActorRef<ElectionMsg>) {
    tracing::info!(clock, "elected master");
    stop_local_master(state);
    let args = MasterArgs {
        node_id: state.node_id.clone(),
        clock,
        bus: state.bus.clone(),
        replica: state.replica.clone(),
        alive: state.alive.clone(),
        max_concurrent: state.max_concurrent,
        secured: state.secured,
    };
    let _ = state.replica.cast(ReplicaMsg::SetMaster {
        node_id: state.node_id.clone(),
        clock,
        last_index: 0,
        is_me: true,
    });
    match Actor::spawn_linked(None, Master, args, myself.get_cell()).await {
        Ok((master, _)) => {
            let mut inner = state.leadership.lock();
            inner.master = Some((state.node_id.clone(), clock));
            inner.local_master = Some(master);
        }
        Err(error) => tracing::error!(%error, "could not start the master"),
    }
}

fn stop_local_master(state: &mut ElectionState) {
    if let Some(master) = state.leadership.lock().local_master.take() {
        master.stop(Some("leadership changed".into()));
    }
}
