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
//! - One master per clock: a node that starts with a log naming other
//!   nodes has been a member; it listens for [`REJOIN_MS`] (longer than a
//!   peer takes to reconnect) so that it follows a master elected while it
//!   was away instead of leading alone at that master's clock. Should two
//!   masters of one clock still meet (a partition heals, a frozen master
//!   wakes), the smaller node id stays and the other steps down: the rule
//!   compares what never changes, so both always reach the same verdict.
//!   The node that steps down drops the events it wrote as master when it
//!   follows ([`crate::cluster::log_sync`]).
//! - Input is checked: messages from nodes without a liveliness token (not
//!   members) are ignored, and a campaign may raise the clock by one only,
//!   as the rules do; a forged or runaway clock cannot force a round.

pub mod actor;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

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
/// How long a node that was a member before (its log names other nodes)
/// listens: a peer's zenoh session retries its connection at least once a
/// second, so the cluster is heard well within this.
pub const REJOIN_MS: u64 = 3_000;

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
    /// Nodes whose liveliness token is present: the only voices heard.
    members: BTreeSet<String>,
    /// How long the first listen lasts.
    listen_ms: u64,
}

impl Election {
    /// A node that starts at `now_ms` with the highest clock it has seen
    /// (from its log's session), listening first: for [`LISTEN_MS`], or
    /// [`REJOIN_MS`] when it `was_member` (its log names other nodes).
    pub fn new(me: impl Into<String>, clock: u64, now_ms: u64, was_member: bool) -> Self {
        Self {
            me: me.into(),
            clock,
            role: Role::Listening { since_ms: now_ms },
            candidates: BTreeMap::new(),
            members: BTreeSet::new(),
            listen_ms: if was_member { REJOIN_MS } else { LISTEN_MS },
        }
    }

    /// `node`'s liveliness token appeared: its messages count from now on.
    pub fn on_node_alive(&mut self, node: &str) {
        self.members.insert(node.to_string());
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
        if message.node_id == self.me || !self.members.contains(&message.node_id) {
            return out;
        }
        let theirs = Credentials::from_message(message);
        match message.kind {
            // A campaign starts a round one above its sender's clock, and
            // every member shares the master's clock: a larger step is
            // not something the rules make.
            Some(election_message::Kind::Campaign(_))
                if message.clock > self.clock.saturating_add(1) => {}
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
                // Two masters of one clock: the smaller node id stays. Not
                // the credentials: both logs grow while they compare, and a
                // verdict on moving figures can differ on the two sides.
                let outranks_me = theirs.node_id < self.me;
                match self.role {
                    Role::Leading { .. } if same && !outranks_me => {
                        // Two masters of one round (a healed partition): the
                        // one that stays says so.
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
            Role::Listening { since_ms } if now_ms >= since_ms + self.listen_ms => {
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
        self.members.remove(node);
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

    /// An election that knows `members` are alive.
    fn election_of(id: &str, now: u64, members: &[&str]) -> Election {
        let mut election = Election::new(id, 0, now, false);
        for member in members {
            election.on_node_alive(member);
        }
        election
    }

    impl Cluster {
        fn new(creds: &[(&str, u64, u64)]) -> Self {
            let ids: Vec<&str> = creds.iter().map(|c| c.0).collect();
            Self {
                nodes: creds
                    .iter()
                    .map(|(id, index, seniority)| {
                        (
                            election_of(id, 0, &ids),
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
        for node in &mut cluster.nodes {
            node.0.on_node_alive("z");
        }
        cluster.nodes.push((
            election_of("z", cluster.now, &["a", "b"]),
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
        let mut e = election_of("a", 0, &["b"]);
        e.clock = 5;
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

    #[test]
    fn strangers_and_runaway_clocks_are_not_heard() {
        let me = Credentials {
            node_id: "a".into(),
            last_applied_index: 1,
            seniority_ms: 1,
        };
        let mut e = election_of("a", 0, &["b"]);
        e.clock = 1;
        e.role = Role::Following {
            master: "b".into(),
            heard_ms: 0,
        };
        let message = |node: &str, clock, kind| ElectionMessage {
            clock,
            node_id: node.into(),
            last_applied_index: 99,
            seniority_ms: 99,
            kind: Some(kind),
        };
        let victory = election_message::Kind::Victory(Victory {});
        let campaign = election_message::Kind::Campaign(Campaign {});
        // A victory from a node with no liveliness token: nothing at all.
        assert!(e
            .on_message(&message("ghost", 1001, victory), &me, 5)
            .is_empty());
        // A member's campaign five rounds ahead: not a step the rules make.
        assert!(e.on_message(&message("b", 6, campaign), &me, 5).is_empty());
        assert_eq!((e.clock(), e.master()), (1, Some("b")));
        // One round ahead is a real round: joined.
        assert!(!e.on_message(&message("b", 2, campaign), &me, 5).is_empty());
        assert_eq!(e.clock(), 2);
        // A member that leaves is not heard either.
        e.on_node_gone("b", &me, 6);
        assert!(e.on_message(&message("b", 3, victory), &me, 7).is_empty());
    }

    #[test]
    fn of_two_masters_of_one_clock_the_smaller_id_stays() {
        let creds = |id: &str, index| Credentials {
            node_id: id.into(),
            last_applied_index: index,
            seniority_ms: 0,
        };
        let victory = |node: &str, index| ElectionMessage {
            clock: 2,
            node_id: node.into(),
            last_applied_index: index,
            seniority_ms: 0,
            kind: Some(election_message::Kind::Victory(Victory {})),
        };
        let leader = |id: &str, other: &str| {
            let mut e = election_of(id, 0, &[other]);
            e.clock = 2;
            e.role = Role::Leading { sent_ms: 0 };
            e
        };
        // Whatever each log holds, both sides reach the same verdict.
        for (a_index, b_index) in [(5, 9), (9, 5), (7, 7)] {
            let mut a = leader("a", "b");
            let mut b = leader("b", "a");
            let out_a = a.on_message(&victory("b", b_index), &creds("a", a_index), 1);
            let out_b = b.on_message(&victory("a", a_index), &creds("b", b_index), 1);
            assert_eq!(a.master(), Some("a"));
            assert!(matches!(out_a.as_slice(), [Output::Send(_)]));
            assert_eq!(b.master(), Some("a"));
            assert!(out_b.contains(&Output::SteppedDown));
        }
    }
}
