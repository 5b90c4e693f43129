//! The Replica actor: this node's copy of the indexed event log. It
//! persists each event before applying it, strictly in index order, buffers
//! what arrives early and fills gaps from the master's event-log queryable.
//! After a change of master it first brings its log into agreement with the
//! new master's ([`crate::cluster::log_sync`]): a tail that a losing master wrote is
//! dropped before anything of the new master's is taken.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tessera_protos::v1::{ClusterState, EventLogReply, EventLogRequest, IndexedEvent, SessionId};
use tessera_state::Journal;
use tokio::sync::watch;

use crate::bus::Bus;
use crate::cluster::log_sync::{LocalLog, LogSync};
use crate::throttle::Throttle;

/// At most this many early events are held while a gap is filled.
const MAX_BUFFERED: usize = 10_000;
/// Catch-up replies are capped at this many events; ask again for more.
pub const MAX_RANGE: u64 = crate::cluster::log_sync::MAX_PROBE;

pub enum ReplicaMsg {
    /// An indexed event published by the master.
    Global(IndexedEvent),
    /// The local master: persist and apply before publishing.
    Commit(IndexedEvent, RpcReplyPort<Result<(), String>>),
    /// The answer to a catch-up query that started at `asked_from`
    /// (`None`: no master answered in time).
    CatchUp {
        asked_from: u64,
        reply: Option<EventLogReply>,
    },
    /// The master to accept events from, and its last index if known.
    SetMaster {
        node_id: String,
        clock: u64,
        last_index: u64,
        /// This node is that master.
        is_me: bool,
    },
    /// The state as folded so far (shared, not copied).
    GetState(RpcReplyPort<Arc<ClusterState>>),
    /// A view of the state that follows it: the replica publishes a new
    /// `Arc` once per message that changed the state, so readers neither
    /// ask nor copy it.
    Watch(RpcReplyPort<StateView>),
    /// Events `from..=to` from the log (for the master's queryable).
    GetRange {
        from: u64,
        to: u64,
        reply: RpcReplyPort<Vec<IndexedEvent>>,
    },
    /// A read-only view of the log as it stands (for time travel: the fold
    /// runs off the actor, which goes on applying).
    View(RpcReplyPort<tessera_state::LogView>),
    Tick,
}

pub struct Replica;

/// The state as the replica last published it.
pub type StateView = watch::Receiver<Arc<ClusterState>>;

pub struct ReplicaArgs {
    pub journal: Journal,
    pub bus: Bus,
    /// Updated after each applied event (the election reads it).
    pub applied: Arc<AtomicU64>,
}

pub struct ReplicaState {
    journal: Journal,
    bus: Bus,
    applied: Arc<AtomicU64>,
    view: watch::Sender<Arc<ClusterState>>,
    /// The state changed since it was last published.
    dirty: bool,
    sync: LogSync,
    /// The master's last index, as its heartbeats say.
    master_last: u64,
    early: BTreeMap<u64, IndexedEvent>,
    catching_up: bool,
    /// Errors repeat while a fork is repaired: say each kind at most once a
    /// few seconds, with the count of those not said.
    errors: Throttle,
}

/// The journal as [`LocalLog`] for the agreement rules.
struct JournalView<'a>(&'a Journal);

impl LocalLog for JournalView<'_> {
    fn last_index(&self) -> u64 {
        self.0.state().last_index()
    }

    fn event(&self, index: u64) -> Option<IndexedEvent> {
        self.0.log().get(index).ok().flatten()
    }
}

impl ReplicaState {
    /// One copy of the state per message that changed it, shared by every
    /// reader.
    fn publish(&mut self) {
        if std::mem::take(&mut self.dirty) {
            self.view
                .send_replace(Arc::new(self.journal.state().as_proto().clone()));
        }
    }

    fn last(&self) -> u64 {
        self.journal.state().last_index()
    }

    fn commit(&mut self, event: &IndexedEvent) -> Result<(), String> {
        if event.index <= self.last() {
            return Ok(());
        }
        if event.index != self.last() + 1 {
            return Err(format!(
                "event {} is not next after {}",
                event.index,
                self.last()
            ));
        }
        self.journal.commit(event).map_err(|e| e.to_string())?;
        self.dirty = true;
        self.applied.store(self.last(), Ordering::Relaxed);
        Ok(())
    }

    /// Applies buffered events that are now next (once the log is known to
    /// agree with the master's).
    fn drain(&mut self) {
        if !self.sync.verified() {
            return;
        }
        while let Some(event) = self.early.remove(&(self.last() + 1)) {
            if let Err(error) = self.commit(&event) {
                if self.errors.allow("buffered") {
                    tracing::error!(%error, "could not apply a buffered event");
                }
                break;
            }
        }
        let last = self.last();
        self.early.retain(|index, _| *index > last);
    }

    fn behind(&self) -> bool {
        !self.sync.verified() || !self.early.is_empty() || self.master_last > self.last()
    }

    /// Takes a catch-up reply: drops a forked tail, then commits.
    fn reconcile(&mut self, asked_from: u64, reply: &EventLogReply) {
        let step = self
            .sync
            .on_reply(asked_from, reply, &JournalView(&self.journal));
        if let Some(keep) = step.truncate_after {
            let before = self.last();
            match self.journal.truncate_after(keep) {
                Ok(dropped) => {
                    tracing::warn!(
                        dropped,
                        from = keep + 1,
                        to = before,
                        master = ?self.sync.master(),
                        "dropped events the master does not hold (written by a master that lost its election)"
                    );
                    self.dirty = true;
                    self.applied.store(self.last(), Ordering::Relaxed);
                }
                Err(error) => {
                    tracing::error!(%error, keep, "could not drop a forked tail");
                    return;
                }
            }
        }
        for event in step.append {
            if let Err(error) = self.commit(&event) {
                if self.errors.allow("catch-up") {
                    tracing::error!(%error, "could not apply a caught-up event");
                }
                break;
            }
        }
        self.drain();
    }
}

impl ReplicaState {
    /// An event the master published: committed if it is the next one,
    /// kept for later (and a catch-up asked for) if it is ahead. False if
    /// it is not from the master this replica follows (dropped).
    fn on_global(&mut self, myself: &ActorRef<ReplicaMsg>, event: IndexedEvent) -> bool {
        if !self.sync.from_master(&event) {
            // Not the master we follow (a stale master, garbage, or
            // a new master we have not heard of yet: its heartbeat
            // will bring us back to it through a catch-up).
            let key = self.bus.keys.global_events();
            self.bus.count_dropped(&key, "not from the current master");
            return false;
        }
        if self.sync.verified() && event.index == self.last() + 1 {
            if let Err(error) = self.commit(&event) {
                if self.errors.allow("live") {
                    tracing::error!(%error, index = event.index, "could not persist an event");
                }
            }
            self.drain();
        } else if event.index > self.last() && self.early.len() < MAX_BUFFERED {
            self.master_last = self.master_last.max(event.index);
            self.early.insert(event.index, event);
            request_catch_up(myself, self);
        }
        true
    }

    /// The master's own commit: only the master this replica follows
    /// writes (a Master that has just stepped down finds its session
    /// gone), and the event is durable before the master publishes it, so
    /// an event anyone has seen survives the master's SIGKILL.
    fn commit_from_master(&mut self, event: &IndexedEvent) -> Result<(), String> {
        let result = if self.sync.from_master(event) {
            self.commit(event)
                .and_then(|()| self.journal.flush().map_err(|error| error.to_string()))
        } else {
            Err(format!(
                "event {} is from {:?}, not from the master followed",
                event.index, event.session
            ))
        };
        self.drain();
        result
    }

    /// Follows `session`'s master, which has written up to `last_index`.
    fn follow(
        &mut self,
        myself: &ActorRef<ReplicaMsg>,
        session: SessionId,
        last_index: u64,
        is_me: bool,
    ) {
        if self.sync.master() != Some(&session) {
            self.early.clear();
            self.master_last = 0;
            tracing::debug!(?session, is_me, "replica follows a new master");
        }
        self.sync.follow(session, is_me);
        self.master_last = self.master_last.max(last_index);
        if self.behind() {
            request_catch_up(myself, self);
        }
    }

    /// The events `from..=to` of the log (at most [`MAX_RANGE`]).
    fn range(&self, from: u64, to: u64) -> Vec<IndexedEvent> {
        let to = to.min(self.last()).min(from.saturating_add(MAX_RANGE - 1));
        if from == 0 || from > to {
            Vec::new()
        } else {
            self.journal
                .log()
                .range(from, to)
                .collect::<Result<Vec<_>, _>>()
                .unwrap_or_else(|error| {
                    tracing::error!(%error, "reading the log for a catch-up");
                    Vec::new()
                })
        }
    }
}

impl Actor for Replica {
    type Msg = ReplicaMsg;
    type State = ReplicaState;
    type Arguments = ReplicaArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: ReplicaArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        args.applied
            .store(args.journal.state().last_index(), Ordering::Relaxed);
        myself.send_interval(Duration::from_millis(500), || ReplicaMsg::Tick);
        let (view, _) = watch::channel(Arc::new(args.journal.state().as_proto().clone()));
        Ok(ReplicaState {
            view,
            dirty: false,
            journal: args.journal,
            bus: args.bus,
            applied: args.applied,
            sync: LogSync::new(),
            master_last: 0,
            early: BTreeMap::new(),
            catching_up: false,
            errors: Throttle::new(Duration::from_secs(5)),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: ReplicaMsg,
        state: &mut ReplicaState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            ReplicaMsg::Global(event) => {
                if !state.on_global(&myself, event) {
                    return Ok(());
                }
            }
            ReplicaMsg::Commit(event, reply) => {
                let result = state.commit_from_master(&event);
                let _ = reply.send(result);
            }
            ReplicaMsg::CatchUp { asked_from, reply } => {
                state.catching_up = false;
                if let Some(reply) = reply {
                    state.reconcile(asked_from, &reply);
                }
                if state.behind() {
                    request_catch_up(&myself, state);
                }
            }
            ReplicaMsg::SetMaster {
                node_id,
                clock,
                last_index,
                is_me,
            } => {
                let session = SessionId {
                    master_node_id: node_id,
                    election_clock: clock,
                };
                state.follow(&myself, session, last_index, is_me);
            }
            ReplicaMsg::GetState(reply) => {
                let _ = reply.send(state.view.borrow().clone());
            }
            ReplicaMsg::Watch(reply) => {
                let _ = reply.send(state.view.subscribe());
            }
            ReplicaMsg::GetRange { from, to, reply } => {
                let _ = reply.send(state.range(from, to));
            }
            ReplicaMsg::View(reply) => {
                let _ = reply.send(state.journal.log().view());
            }
            ReplicaMsg::Tick => {
                if state.behind() {
                    request_catch_up(&myself, state);
                }
                if let Err(error) = state.journal.flush() {
                    tracing::error!(%error, "flushing the event log");
                }
            }
        }
        state.publish();
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<Self::Msg>,
        state: &mut ReplicaState,
    ) -> Result<(), ActorProcessingErr> {
        if let Err(error) = state.journal.flush() {
            tracing::error!(%error, "flushing the event log at shutdown");
        }
        Ok(())
    }
}

/// Asks the master for what is missing (or, while unverified, for what to
/// compare); the answer comes back as CatchUp. Only the followed master's
/// reply is taken.
fn request_catch_up(myself: &ActorRef<ReplicaMsg>, state: &mut ReplicaState) {
    let Some(master) = state.sync.master().cloned() else {
        return;
    };
    if state.catching_up {
        return;
    }
    state.catching_up = true;
    let from = state.sync.ask_from(&JournalView(&state.journal));
    let bus = state.bus.clone();
    let myself = myself.clone();
    tokio::spawn(async move {
        let request = EventLogRequest {
            from_index: from,
            to_index: 0,
        };
        let key = bus.keys.event_log();
        let reply = match bus
            .query_all::<_, EventLogReply>(&key, &request, Duration::from_secs(2))
            .await
        {
            Ok(replies) => replies
                .into_iter()
                .find(|r| r.session.as_ref() == Some(&master)),
            Err(error) => {
                tracing::debug!(%error, "catch-up query");
                None
            }
        };
        let _ = myself.cast(ReplicaMsg::CatchUp {
            asked_from: from,
            reply,
        });
    });
}
