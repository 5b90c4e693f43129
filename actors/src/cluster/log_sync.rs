//! How a follower's log is brought into agreement with its master's: the
//! Replica's acceptance rules as plain functions over data.
//!
//! Two masters can write at one index: a partition heals, a frozen master
//! wakes up, a restarted node led alone before it could hear the cluster.
//! The election then keeps one of them, and every node that holds events
//! the kept master does not must drop them. The rule is Raft's: one master
//! session writes each index once, so two logs that hold the same event at
//! index `k` agree on everything up to `k`.
//!
//! - After a change of master, a follower's log is *unverified*. It accepts
//!   nothing from the new master until it has compared events with it: it
//!   asks for the master's events from a little below its own last index,
//!   keeps the longest prefix on which both agree, drops the rest, and
//!   appends what follows. Each probe that finds no agreement drops what it
//!   compared and looks twice as far back.
//! - Once verified, the follower takes the master's events in index order
//!   (live or from a catch-up), as before.
//! - Replies from any other master than the one followed are ignored.

use tessera_protos::v1::{EventLogReply, IndexedEvent, SessionId};

/// A probe never reaches further back than one catch-up reply holds, so
/// the events it compares always arrive in one answer.
pub const MAX_PROBE: u64 = 5_000;

/// What the rules need to see of the local log.
pub trait LocalLog {
    fn last_index(&self) -> u64;
    fn event(&self, index: u64) -> Option<IndexedEvent>;
}

/// A follower's agreement with the master it follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSync {
    master: Option<SessionId>,
    verified: bool,
    /// How many events below the last one the next probe starts.
    probe: u64,
}

/// What to do with a catch-up reply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reconcile {
    /// Drop every local event after this index first.
    pub truncate_after: Option<u64>,
    /// Then commit these, in order.
    pub append: Vec<IndexedEvent>,
}

impl Default for LogSync {
    fn default() -> Self {
        Self::new()
    }
}

impl LogSync {
    pub fn new() -> Self {
        Self {
            master: None,
            verified: false,
            probe: 1,
        }
    }

    pub fn master(&self) -> Option<&SessionId> {
        self.master.as_ref()
    }

    /// Whether the local log is known to be a prefix of the master's.
    pub fn verified(&self) -> bool {
        self.verified
    }

    /// Follows `master`; `is_me` when this node is that master (its own log
    /// is the reference). The same master again changes nothing.
    pub fn follow(&mut self, master: SessionId, is_me: bool) {
        if self.master.as_ref() == Some(&master) {
            return;
        }
        self.master = Some(master);
        self.verified = is_me;
        self.probe = 1;
    }

    /// Whether `event` is the followed master's.
    pub fn from_master(&self, event: &IndexedEvent) -> bool {
        self.master.is_some() && event.session == self.master
    }

    /// Where the next catch-up query starts.
    pub fn ask_from(&mut self, log: &impl LocalLog) -> u64 {
        let last = log.last_index();
        if last == 0 {
            self.verified = true;
        }
        if self.verified {
            last + 1
        } else {
            last.saturating_sub(self.probe - 1).max(1)
        }
    }

    /// Decides what a reply to a query from `asked_from` means.
    pub fn on_reply(
        &mut self,
        asked_from: u64,
        reply: &EventLogReply,
        log: &impl LocalLog,
    ) -> Reconcile {
        if self.master.is_none() || reply.session != self.master {
            return Reconcile::default();
        }
        let last = log.last_index();
        if self.verified {
            return Reconcile {
                truncate_after: None,
                append: events_after(reply, last),
            };
        }
        // The master's log ends below the probe: all beyond its end goes.
        if reply.last_index < asked_from {
            let keep = reply.last_index.min(last);
            self.next_probe();
            return Reconcile {
                truncate_after: (keep < last).then_some(keep),
                append: Vec::new(),
            };
        }
        let mut agreed = asked_from - 1;
        for theirs in &reply.events {
            if theirs.index != agreed + 1 || theirs.index > last {
                break;
            }
            if log.event(theirs.index).as_ref() != Some(theirs) {
                break;
            }
            agreed = theirs.index;
        }
        if agreed >= asked_from || asked_from == 1 {
            // Agreement at `agreed` (or nothing to agree on): everything
            // after it is the master's.
            self.verified = true;
            return Reconcile {
                truncate_after: (agreed < last).then_some(agreed),
                append: events_after(reply, agreed),
            };
        }
        // The first event compared already differs: the fork lies lower.
        // What was compared goes, and the next probe looks further back.
        self.next_probe();
        Reconcile {
            truncate_after: Some(agreed),
            append: Vec::new(),
        }
    }

    fn next_probe(&mut self) {
        self.probe = (self.probe * 2).min(MAX_PROBE);
    }
}

/// The reply's events that continue a log ending at `last`, in order and
/// without a gap.
fn events_after(reply: &EventLogReply, last: u64) -> Vec<IndexedEvent> {
    let mut next = last + 1;
    let mut out = Vec::new();
    for event in &reply.events {
        if event.index < next {
            continue;
        }
        if event.index > next {
            break;
        }
        out.push(event.clone());
        next += 1;
    }
    out
}

/// What a master holding `log` answers to a query from `from` (as the
/// node's event-log queryable does): for the tests' simulated masters.
#[cfg(test)]
pub(crate) fn reply_from(log: &[IndexedEvent], from: u64, session: SessionId) -> EventLogReply {
    EventLogReply {
        events: log
            .iter()
            .filter(|e| e.index >= from)
            .take(MAX_PROBE as usize)
            .cloned()
            .collect(),
        last_index: log.len() as u64,
        session: Some(session),
    }
}

impl LocalLog for Vec<IndexedEvent> {
    fn last_index(&self) -> u64 {
        self.len() as u64
    }

    fn event(&self, index: u64) -> Option<IndexedEvent> {
        let position = usize::try_from(index.checked_sub(1)?).ok()?;
        self.get(position).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_protos::v1::{event, Event, NodeTimedOut};

    fn session(master: &str, clock: u64) -> SessionId {
        SessionId {
            master_node_id: master.into(),
            election_clock: clock,
        }
    }

    fn event_of(index: u64, master: &str, clock: u64) -> IndexedEvent {
        IndexedEvent {
            index,
            session: Some(session(master, clock)),
            event: Some(Event {
                kind: Some(event::Kind::NodeTimedOut(NodeTimedOut {
                    node_id: format!("{master}{index}"),
                })),
            }),
            ..Default::default()
        }
    }

    /// A log of `runs` (master, clock, count), in order.
    fn log_of(runs: &[(&str, u64, u64)]) -> Vec<IndexedEvent> {
        let mut log = Vec::new();
        for (master, clock, count) in runs {
            for _ in 0..*count {
                let index = log.len() as u64 + 1;
                log.push(event_of(index, master, *clock));
            }
        }
        log
    }

    /// Runs queries against `master_log` until the follower is verified.
    fn reconcile(local: &mut Vec<IndexedEvent>, master_log: &[IndexedEvent], master: SessionId) {
        let mut sync = LogSync::new();
        sync.follow(master.clone(), false);
        for _ in 0..64 {
            let from = sync.ask_from(local);
            let reply = reply_from(master_log, from, master.clone());
            let step = sync.on_reply(from, &reply, local);
            if let Some(keep) = step.truncate_after {
                local.truncate(keep as usize);
            }
            local.extend(step.append);
            if sync.verified() && local.len() == master_log.len() {
                return;
            }
        }
        panic!("no agreement after 64 queries");
    }

    #[test]
    fn a_forked_tail_is_replaced_by_the_masters() {
        let master_log = log_of(&[("a", 1, 20), ("b", 2, 10)]);
        for local_runs in [
            vec![("a", 1, 20), ("a", 2, 7)], // a restarted and led alone
            vec![("a", 1, 25)],              // a wrote more before it froze
            vec![("a", 1, 12)],              // simply behind
            vec![("a", 1, 20), ("b", 2, 10), ("c", 3, 4)], // ahead, forked
            vec![("c", 1, 30)],              // nothing in common
            vec![],
        ] {
            let mut local = log_of(&local_runs);
            reconcile(&mut local, &master_log, session("b", 2));
            assert_eq!(local, master_log, "{local_runs:?}");
        }
    }

    #[test]
    fn a_deep_fork_is_found_in_few_queries() {
        let master_log = log_of(&[("a", 1, 3), ("b", 2, 9_000)]);
        let mut local = log_of(&[("a", 1, 3), ("c", 2, 12_000)]);
        reconcile(&mut local, &master_log, session("b", 2));
        assert_eq!(local, master_log);
    }

    #[test]
    fn replies_of_another_master_and_unverified_live_events_are_not_taken() {
        let local = log_of(&[("a", 1, 5)]);
        let mut sync = LogSync::new();
        sync.follow(session("b", 2), false);
        let from = sync.ask_from(&local);
        assert_eq!(from, 5, "an unverified follower asks from its last event");
        let reply = EventLogReply {
            events: log_of(&[("a", 1, 8)])[4..].to_vec(),
            last_index: 8,
            session: Some(session("c", 2)),
        };
        assert_eq!(sync.on_reply(from, &reply, &local), Reconcile::default());
        assert!(!sync.verified());
        // The same master again keeps what was verified.
        let reply = EventLogReply {
            session: Some(session("b", 2)),
            ..reply
        };
        let step = sync.on_reply(from, &reply, &local);
        assert_eq!(step.truncate_after, None);
        assert_eq!(step.append.len(), 3);
        sync.follow(session("b", 2), false);
        assert!(sync.verified());
        sync.follow(session("c", 3), false);
        assert!(!sync.verified());
    }
}
