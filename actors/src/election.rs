//! Master election as a pure state machine: messages and clock ticks in,
//! messages to send and role changes out. The Election actor feeds it from
//! zenoh; the tests feed it from a simulated network.
//!
//! - Credentials compare most up-to-date log first (highest applied index,
//!   so the new master holds every event any survivor applied and the log
//!   continues without a gap), then seniority (longest up), then the
//!   smallest node id.
//! - The clock only grows. A round starts by bumping it and campaigning;
//!   every node that hears a campaign of a higher clock joins that round.
//!   After [`ROUND_MS`] the best candidate heard declares victory.
//! - The master repeats its victory every [`HEARTBEAT_MS`]; a follower
//!   that hears none for [`MASTER_TIMEOUT_MS`], or is told the master's
//!   liveliness token is gone, starts a new round.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use tessera_protos::v1::{election_message, Campaign, ElectionMessage, Victory};

/// How long a round collects campaigns before its best candidate wins.
pub const ROUND_MS: u64 = 300;
/// How often the master repeats its victory.
pub const HEARTBEAT_MS: u64 = 200;
/// Silence after which followers stop trusting the master.
pub const MASTER_TIMEOUT_MS: u64 = 1_500;
/// How long a starting node listens for a sitting master before it
/// campaigns.
pub const LISTEN_MS: u64 = 400;

/// What a node stands on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub node_id: String,
    pub last_applied_index: u64,
    pub seniority_ms: u64,
}

impl Credentials {
    /// `Greater` when `self` is the better master.
    pub fn compare(&self, other: &Self) -> Ordering {
        self.last_applied_index
            .cmp(&other.last_applied_index)
            .then(self.seniority_ms.cmp(&other.seniority_ms))
            .then_with(|| other.node_id.cmp(&self.node_id))
    }

    fn from_message(message: &ElectionMessage) -> Self {
        Self {
            node_id: message.node_id.clone(),
            last_applied_index: message.last_applied_index,
            seniority_ms: message.seniority_ms,
        }
    }
}

/// This node's part in the election.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Waiting to hear a sitting master (just started).
    Listening { since_ms: u64 },
    /// In round `clock`, collecting campaigns until `ends_ms`.
    Campaigning { ends_ms: u64 },
    /// Following `master`; last heard at `heard_ms`.
    Following { master: String, heard_ms: u64 },
    /// The master of `clock`; last heartbeat sent at `sent_ms`.
    Leading { sent_ms: u64 },
}

/// What the caller must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Publish on the election key.
    Send(ElectionMessage),
    /// This node became master of round `clock`: start the Master.
    BecameMaster { clock: u64 },
    /// `master` leads round `clock` (another node).
    Follow { master: String, clock: u64 },
    /// This node stopped being master (a better or newer one exists).
    SteppedDown,
}

/// One node's election state.
#[derive(Clone, Debug)]
pub struct Election {
    me: String,
    clock: u64,
    role: Role,
    /// Candidates heard in the current round (this node included).
    candidates: BTreeMap<String, Credentials>,
}

impl Election {
    /// A node that starts at `now_ms` with the highest clock it has seen
    /// (from its log's session), listening first.
    pub fn new(me: impl Into<String>, clock: u64, now_ms: u64) -> Self {
        Self {
            me: me.into(),
            clock,
            role: Role::Listening { since_ms: now_ms },
            candidates: BTreeMap::new(),
        }
    }

    pub fn clock(&self) -> u64 {
        self.clock
    }

    pub fn role(&self) -> &Role {
        &self.role
    }

    /// The current master, if one is known.
    pub fn master(&self) -> Option<&str> {
        match &self.role {
            Role::Leading { .. } => Some(&self.me),
            Role::Following { master, .. } => Some(master),
            _ => None,
        }
    }

    fn message(&self, me: &Credentials, kind: election_message::Kind) -> ElectionMessage {
        ElectionMessage {
            clock: self.clock,
            node_id: self.me.clone(),
            last_applied_index: me.last_applied_index,
            seniority_ms: me.seniority_ms,
            kind: Some(kind),
        }
    }

    /// Starts round `clock + 1` (or joins round `at_least`).
    fn campaign(&mut self, me: &Credentials, at_least: u64, now_ms: u64, out: &mut Vec<Output>) {
        let was_leading = matches!(self.role, Role::Leading { .. });
        self.clock = (self.clock + 1).max(at_least);
        self.candidates.clear();
        self.candidates.insert(self.me.clone(), me.clone());
        self.role = Role::Campaigning {
            ends_ms: now_ms + ROUND_MS,
        };
        if was_leading {
            out.push(Output::SteppedDown);
        }
        out.push(Output::Send(
            self.message(me, election_message::Kind::Campaign(Campaign {})),
        ));
    }

    fn follow(&mut self, master: &str, clock: u64, now_ms: u64, out: &mut Vec<Output>) {
        let changed = self.master() != Some(master) || self.clock != clock;
        if matches!(self.role, Role::Leading { .. }) {
            out.push(Output::SteppedDown);
        }
        self.clock = clock;
        self.role = Role::Following {
            master: master.to_string(),
            heard_ms: now_ms,
        };
        if changed {
            out.push(Output::Follow {
                master: master.to_string(),
                clock,
            });
        }
    }

    /// A message from another node (own messages are ignored).
    pub fn on_message(
        &mut self,
        message: &ElectionMessage,
        me: &Credentials,
        now_ms: u64,
    ) -> Vec<Output> {
        let mut out = Vec::new();
        if message.node_id == self.me || message.node_id.is_empty() {
            return out;
        }
        let theirs = Credentials::from_message(message);
        match message.kind {
            Some(election_message::Kind::Campaign(_)) => {
                if message.clock > self.clock {
                    // A newer round: join it.
                    self.campaign(me, message.clock, now_ms, &mut out);
                    self.candidates.insert(theirs.node_id.clone(), theirs);
                } else if message.clock == self.clock {
                    match self.role {
                        Role::Campaigning { .. } => {
                            self.candidates.insert(theirs.node_id.clone(), theirs);
                        }
                        // A sitting master answers a late campaign of its own
                        // round with its victory, so the newcomer follows.
                        Role::Leading { .. } => out.push(Output::Send(
                            self.message(me, election_message::Kind::Victory(Victory {})),
                        )),
                        _ => {}
                    }
                } else if let Role::Leading { .. } = self.role {
                    // A stale campaign (a node just started): tell it who leads.
                    out.push(Output::Send(
                        self.message(me, election_message::Kind::Victory(Victory {})),
                    ));
                }
            }
            Some(election_message::Kind::Victory(_)) => {
                let newer = message.clock > self.clock;
                let same = message.clock == self.clock;
                let better = theirs.compare(me) == Ordering::Greater;
                match self.role {
                    Role::Leading { .. } if same && !better => {
                        // Two masters of one round (a healed partition): the
                        // better one stays and says so.
                        out.push(Output::Send(
                            self.message(me, election_message::Kind::Victory(Victory {})),
                        ));
                    }
                    _ if newer || same => {
                        self.follow(&message.node_id, message.clock, now_ms, &mut out)
                    }
                    _ => {}
                }
            }
            None => {}
        }
        out
    }

    /// Time passes: ends rounds, sends heartbeats, notices a silent master.
    pub fn on_tick(&mut self, me: &Credentials, now_ms: u64) -> Vec<Output> {
        let mut out = Vec::new();
        match self.role.clone() {
            Role::Listening { since_ms } if now_ms >= since_ms + LISTEN_MS => {
                self.campaign(me, 0, now_ms, &mut out);
            }
            Role::Campaigning { ends_ms } if now_ms >= ends_ms => {
                self.candidates.insert(self.me.clone(), me.clone());
                let best = self
                    .candidates
                    .values()
                    .max_by(|a, b| a.compare(b))
                    .map(|c| c.node_id.clone());
                if best.as_deref() == Some(self.me.as_str()) {
                    self.role = Role::Leading { sent_ms: now_ms };
                    out.push(Output::Send(
                        self.message(me, election_message::Kind::Victory(Victory {})),
                    ));
                    out.push(Output::BecameMaster { clock: self.clock });
                } else {
                    // Wait for the winner's victory; if it never comes, the
                    // round is retried.
                    self.role = Role::Campaigning {
                        ends_ms: now_ms + MASTER_TIMEOUT_MS,
                    };
                    self.candidates.clear();
                }
            }
            Role::Following { heard_ms, .. } if now_ms >= heard_ms + MASTER_TIMEOUT_MS => {
                self.campaign(me, 0, now_ms, &mut out);
            }
            Role::Leading { sent_ms } if now_ms >= sent_ms + HEARTBEAT_MS => {
                self.role = Role::Leading { sent_ms: now_ms };
                out.push(Output::Send(
                    self.message(me, election_message::Kind::Victory(Victory {})),
                ));
            }
            _ => {}
        }
        out
    }

    /// `node`'s liveliness token is gone. If it was the master, a new round
    /// starts at once.
    pub fn on_node_gone(&mut self, node: &str, me: &Credentials, now_ms: u64) -> Vec<Output> {
        let mut out = Vec::new();
        self.candidates.remove(node);
        if self.master() == Some(node) {
            self.campaign(me, 0, now_ms, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated network: every message reaches every other node.
    struct Cluster {
        nodes: Vec<(Election, Credentials, bool)>,
        now: u64,
    }

    impl Cluster {
        fn new(creds: &[(&str, u64, u64)]) -> Self {
            Self {
                nodes: creds
                    .iter()
                    .map(|(id, index, seniority)| {
                        (
                            Election::new(*id, 0, 0),
                            Credentials {
                                node_id: id.to_string(),
                                last_applied_index: *index,
                                seniority_ms: *seniority,
                            },
                            true,
                        )
                    })
                    .collect(),
                now: 0,
            }
        }

        fn deliver(&mut self, from: usize, outputs: Vec<Output>) {
            let mut queue: Vec<(usize, ElectionMessage)> = outputs
                .into_iter()
                .filter_map(|o| match o {
                    Output::Send(m) => Some((from, m)),
                    _ => None,
                })
                .collect();
            while let Some((sender, message)) = queue.pop() {
                for i in 0..self.nodes.len() {
                    if i == sender || !self.nodes[i].2 {
                        continue;
                    }
                    let (election, creds, _) = &mut self.nodes[i];
                    let replies = election.on_message(&message, creds, self.now);
                    for reply in replies {
                        if let Output::Send(m) = reply {
                            queue.push((i, m));
                        }
                    }
                }
            }
        }

        fn run_for(&mut self, ms: u64) {
            for _ in 0..ms / 10 {
                self.now += 10;
                for i in 0..self.nodes.len() {
                    if !self.nodes[i].2 {
                        continue;
                    }
                    let (election, creds, _) = &mut self.nodes[i];
                    let outputs = election.on_tick(creds, self.now);
                    self.deliver(i, outputs);
                }
            }
        }

        fn masters(&self) -> Vec<Option<String>> {
            self.nodes
                .iter()
                .filter(|n| n.2)
                .map(|n| n.0.master().map(str::to_string))
                .collect()
        }

        fn kill(&mut self, id: &str) {
            let now = self.now;
            for i in 0..self.nodes.len() {
                if self.nodes[i].0.me == id {
                    self.nodes[i].2 = false;
                }
            }
            for i in 0..self.nodes.len() {
                if !self.nodes[i].2 {
                    continue;
                }
                let (election, creds, _) = &mut self.nodes[i];
                let outputs = election.on_node_gone(id, creds, now);
                self.deliver(i, outputs);
            }
        }
    }

    #[test]
    fn credentials_order_log_then_seniority_then_id() {
        let c = |id: &str, index, seniority| Credentials {
            node_id: id.into(),
            last_applied_index: index,
            seniority_ms: seniority,
        };
        assert_eq!(c("b", 10, 0).compare(&c("a", 9, 999)), Ordering::Greater);
        assert_eq!(c("b", 10, 5).compare(&c("a", 10, 4)), Ordering::Greater);
        assert_eq!(c("a", 10, 5).compare(&c("b", 10, 5)), Ordering::Greater);
    }

    #[test]
    fn three_nodes_agree_on_the_most_up_to_date_one() {
        let mut cluster = Cluster::new(&[("a", 5, 100), ("b", 9, 10), ("c", 9, 50)]);
        cluster.run_for(2_000);
        let masters = cluster.masters();
        assert_eq!(masters, vec![Some("c".to_string()); 3], "{masters:?}");
        let clocks: Vec<u64> = cluster.nodes.iter().map(|n| n.0.clock()).collect();
        assert!(
            clocks.iter().all(|c| *c == clocks[0] && *c >= 1),
            "{clocks:?}"
        );
    }

    #[test]
    fn a_dead_master_is_replaced_quickly_with_a_higher_clock() {
        let mut cluster = Cluster::new(&[("a", 5, 100), ("b", 9, 10), ("c", 9, 50)]);
        cluster.run_for(2_000);
        let before = cluster.nodes[0].0.clock();
        cluster.kill("c");
        // Liveliness says so at once: a new master within one round.
        cluster.run_for(ROUND_MS + 100);
        assert_eq!(cluster.masters(), vec![Some("b".to_string()); 2]);
        assert!(cluster.nodes[0].0.clock() > before);
    }

    #[test]
    fn a_silent_master_is_replaced_after_the_timeout() {
        let mut cluster = Cluster::new(&[("a", 1, 1), ("b", 2, 1)]);
        cluster.run_for(1_500);
        assert_eq!(cluster.masters(), vec![Some("b".to_string()); 2]);
        // b stops sending without its token going away (a hang).
        cluster.nodes[1].2 = false;
        cluster.run_for(MASTER_TIMEOUT_MS + ROUND_MS + 200);
        assert_eq!(cluster.nodes[0].0.master(), Some("a"));
    }

    #[test]
    fn a_late_node_follows_the_sitting_master() {
        let mut cluster = Cluster::new(&[("a", 3, 100), ("b", 3, 50)]);
        cluster.run_for(1_500);
        assert_eq!(cluster.masters(), vec![Some("a".to_string()); 2]);
        // A newcomer with a better log still follows the sitting master: it
        // hears the heartbeat before it campaigns.
        cluster.nodes.push((
            Election::new("z", 0, cluster.now),
            Credentials {
                node_id: "z".into(),
                last_applied_index: 0,
                seniority_ms: 0,
            },
            true,
        ));
        cluster.run_for(1_000);
        assert_eq!(cluster.masters(), vec![Some("a".to_string()); 3]);
    }

    #[test]
    fn stale_and_own_messages_change_nothing() {
        let me = Credentials {
            node_id: "a".into(),
            last_applied_index: 1,
            seniority_ms: 1,
        };
        let mut e = Election::new("a", 5, 0);
        let own = ElectionMessage {
            clock: 9,
            node_id: "a".into(),
            kind: Some(election_message::Kind::Victory(Victory {})),
            ..Default::default()
        };
        assert!(e.on_message(&own, &me, 1).is_empty());
        let stale = ElectionMessage {
            clock: 4,
            node_id: "b".into(),
            kind: Some(election_message::Kind::Victory(Victory {})),
            ..Default::default()
        };
        assert!(e.on_message(&stale, &me, 1).is_empty());
        assert_eq!(e.master(), None);
        let empty = ElectionMessage::default();
        assert!(e.on_message(&empty, &me, 1).is_empty());
    }
}
