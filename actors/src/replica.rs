//! The Replica actor: this node's copy of the indexed event log. It
//! persists each event before applying it, strictly in index order, buffers
//! what arrives early and fills gaps from the master's event-log queryable.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tessera_protos::v1::{ClusterState, EventLogReply, EventLogRequest, IndexedEvent};
use tessera_state::Journal;

use crate::bus::Bus;

/// At most this many early events are held while a gap is filled.
const MAX_BUFFERED: usize = 10_000;
/// Catch-up replies are capped at this many events; ask again for more.
pub const MAX_RANGE: u64 = 5_000;

pub enum ReplicaMsg {
    /// An indexed event published by the master.
    Global(IndexedEvent),
    /// The local master: persist and apply before publishing.
    Commit(IndexedEvent, RpcReplyPort<Result<(), String>>),
    /// Events from a catch-up query.
    CatchUp(Vec<IndexedEvent>),
    /// The master to accept events from, and its last index if known.
    SetMaster {
        node_id: String,
        clock: u64,
        last_index: u64,
    },
    /// The state as folded so far.
    GetState(RpcReplyPort<ClusterState>),
    /// Events `from..=to` from the log (for the master's queryable).
    GetRange {
        from: u64,
        to: u64,
        reply: RpcReplyPort<Vec<IndexedEvent>>,
    },
    Tick,
}

pub struct Replica;

pub struct ReplicaArgs {
    pub journal: Journal,
    pub bus: Bus,
    /// Updated after each applied event (the election reads it).
    pub applied: Arc<AtomicU64>,
    /// Notified after each applied event (the worker plans at once).
    pub changed: Arc<tokio::sync::Notify>,
}

pub struct ReplicaState {
    journal: Journal,
    bus: Bus,
    applied: Arc<AtomicU64>,
    changed: Arc<tokio::sync::Notify>,
    master: Option<(String, u64)>,
    /// The master's last index, as its heartbeats say.
    master_last: u64,
    early: BTreeMap<u64, IndexedEvent>,
    catching_up: bool,
}

impl ReplicaState {
    fn last(&self) -> u64 {
        self.journal.state().last_index()
    }

    fn is_from_master(&self, event: &IndexedEvent) -> bool {
        match (&self.master, &event.session) {
            (Some((node, clock)), Some(session)) => {
                &session.master_node_id == node && session.election_clock == *clock
            }
            _ => false,
        }
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
        self.applied.store(self.last(), Ordering::Relaxed);
        self.changed.notify_one();
        Ok(())
    }

    /// Applies buffered events that are now next.
    fn drain(&mut self) {
        while let Some(event) = self.early.remove(&(self.last() + 1)) {
            if let Err(error) = self.commit(&event) {
                tracing::error!(%error, "could not apply a buffered event");
                break;
            }
        }
        let last = self.last();
        self.early.retain(|index, _| *index > last);
    }

    fn behind(&self) -> bool {
        !self.early.is_empty() || self.master_last > self.last()
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
        Ok(ReplicaState {
            journal: args.journal,
            bus: args.bus,
            applied: args.applied,
            changed: args.changed,
            master: None,
            master_last: 0,
            early: BTreeMap::new(),
            catching_up: false,
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
                if !state.is_from_master(&event) {
                    // Not the master we follow (a stale master, garbage, or
                    // a new master we have not heard of yet: its heartbeat
                    // will bring us back to it through a catch-up).
                    let key = state.bus.keys.global_events();
                    state.bus.count_dropped(&key, "not from the current master");
                    return Ok(());
                }
                if event.index == state.last() + 1 {
                    if let Err(error) = state.commit(&event) {
                        tracing::error!(%error, index = event.index, "could not persist an event");
                    }
                    state.drain();
                } else if event.index > state.last() + 1 && state.early.len() < MAX_BUFFERED {
                    state.master_last = state.master_last.max(event.index);
                    state.early.insert(event.index, event);
                    request_catch_up(&myself, state);
                }
            }
            ReplicaMsg::Commit(event, reply) => {
                let result = state.commit(&event);
                state.drain();
                let _ = reply.send(result);
            }
            ReplicaMsg::CatchUp(events) => {
                state.catching_up = false;
                for event in events {
                    if event.index == state.last() + 1 {
                        if let Err(error) = state.commit(&event) {
                            tracing::error!(%error, "could not apply a caught-up event");
                            break;
                        }
                    }
                }
                state.drain();
                if state.behind() {
                    request_catch_up(&myself, state);
                }
            }
            ReplicaMsg::SetMaster {
                node_id,
                clock,
                last_index,
            } => {
                if state.master.as_ref() != Some(&(node_id.clone(), clock)) {
                    state.early.clear();
                    state.master_last = 0;
                }
                state.master = Some((node_id, clock));
                state.master_last = state.master_last.max(last_index);
                if state.behind() {
                    request_catch_up(&myself, state);
                }
            }
            ReplicaMsg::GetState(reply) => {
                let _ = reply.send(state.journal.state().as_proto().clone());
            }
            ReplicaMsg::GetRange { from, to, reply } => {
                let to = to.min(state.last()).min(from.saturating_add(MAX_RANGE - 1));
                let events = if from == 0 || from > to {
                    Vec::new()
                } else {
                    state
                        .journal
                        .log()
                        .range(from, to)
                        .collect::<Result<Vec<_>, _>>()
                        .unwrap_or_else(|error| {
                            tracing::error!(%error, "reading the log for a catch-up");
                            Vec::new()
                        })
                };
                let _ = reply.send(events);
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

/// Asks the master for what is missing; the answer comes back as CatchUp.
fn request_catch_up(myself: &ActorRef<ReplicaMsg>, state: &mut ReplicaState) {
    if state.catching_up || state.master.is_none() {
        return;
    }
    state.catching_up = true;
    let from = state.last() + 1;
    let bus = state.bus.clone();
    let myself = myself.clone();
    tokio::spawn(async move {
        let request = EventLogRequest {
            from_index: from,
            to_index: 0,
        };
        let key = bus.keys.event_log();
        let events = match bus
            .query::<_, EventLogReply>(&key, &request, Duration::from_secs(2))
            .await
        {
            Ok(reply) => reply.events,
            Err(error) => {
                tracing::debug!(%error, "catch-up query");
                Vec::new()
            }
        };
        let _ = myself.cast(ReplicaMsg::CatchUp(events));
    });
}
