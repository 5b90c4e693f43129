//! [`State`]: the cluster state every node folds from the indexed event log.

use std::fmt;
use std::ops::Deref;

use prost::Message;
use tessera_protos::v1::{ClusterState, IndexedEvent, SessionId};

use crate::apply::apply_kind;
pub use crate::apply::Ignored;

/// The cluster state at some index of the event log.
///
/// It wraps the protocol's [`ClusterState`] (readable through `Deref`) so that
/// the only way to change it is [`State::apply`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct State {
    inner: ClusterState,
}

/// What applying a well-ordered event did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The event changed the state.
    Changed,
    /// The event was consumed (the index advanced) but changed nothing else.
    Ignored(Ignored),
}

/// An event that cannot be applied at all: the state is left unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("event index {got} is out of order: the next index is {expected}")]
    OutOfOrder { expected: u64, got: u64 },
    #[error("event {index} is malformed: {reason}")]
    Invalid { index: u64, reason: InvalidEvent },
    #[error(
        "event {index} comes from master {master:?} at election clock {clock}, \
         older than the current clock {current_clock}"
    )]
    StaleSession {
        index: u64,
        master: String,
        clock: u64,
        current_clock: u64,
    },
    #[error(
        "event {index} comes from master {master:?} at election clock {clock}, \
         but that clock belongs to master {current_master:?}"
    )]
    ConflictingSession {
        index: u64,
        master: String,
        current_master: String,
        clock: u64,
    },
}

/// Structural problems that make bytes that decode as an `IndexedEvent`
/// still not an event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidEvent {
    #[error("index 0 is not a valid event index (indices start at 1)")]
    ZeroIndex,
    #[error("it has no session")]
    MissingSession,
    #[error("its session has no master node id")]
    EmptyMaster,
}

/// Checks what every indexed event must have, whatever the state.
pub fn validate_event(event: &IndexedEvent) -> Result<(), InvalidEvent> {
    if event.index == 0 {
        return Err(InvalidEvent::ZeroIndex);
    }
    let session = event.session.as_ref().ok_or(InvalidEvent::MissingSession)?;
    if session.master_node_id.is_empty() {
        return Err(InvalidEvent::EmptyMaster);
    }
    Ok(())
}

impl Deref for State {
    type Target = ClusterState;
    fn deref(&self) -> &ClusterState {
        &self.inner
    }
}

impl State {
    /// The empty state, before any event.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds a state from its protocol form (a snapshot, an admin reply).
    pub fn from_proto(inner: ClusterState) -> Self {
        Self { inner }
    }

    pub fn as_proto(&self) -> &ClusterState {
        &self.inner
    }

    pub fn into_proto(self) -> ClusterState {
        self.inner
    }

    /// The index of the last event folded in; 0 before any.
    pub fn last_index(&self) -> u64 {
        self.inner.last_index
    }

    /// The canonical encoding: the protobuf encoding of [`ClusterState`],
    /// whose maps are ordered and whose topology list is kept sorted.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        self.inner.encode_to_vec()
    }

    /// A hash of the canonical encoding: equal states have equal digests.
    pub fn digest(&self) -> Digest {
        Digest(*blake3::hash(&self.canonical_bytes()).as_bytes())
    }

    /// Whether `event` may be applied next: the right index, a well-formed
    /// event, a session no older than the current one. A node calls this
    /// before persisting an event so that it never logs one it cannot apply.
    pub fn check(&self, event: &IndexedEvent) -> Result<(), ApplyError> {
        let expected = self.inner.last_index + 1;
        if event.index != expected {
            return Err(ApplyError::OutOfOrder {
                expected,
                got: event.index,
            });
        }
        validate_event(event).map_err(|reason| ApplyError::Invalid {
            index: event.index,
            reason,
        })?;
        let (Some(session), Some(current)) = (&event.session, &self.inner.session) else {
            return Ok(());
        };
        if session.election_clock < current.election_clock {
            return Err(ApplyError::StaleSession {
                index: event.index,
                master: session.master_node_id.clone(),
                clock: session.election_clock,
                current_clock: current.election_clock,
            });
        }
        if session.election_clock == current.election_clock
            && session.master_node_id != current.master_node_id
        {
            return Err(ApplyError::ConflictingSession {
                index: event.index,
                master: session.master_node_id.clone(),
                current_master: current.master_node_id.clone(),
                clock: session.election_clock,
            });
        }
        Ok(())
    }

    /// Folds one indexed event into the state.
    ///
    /// Pure, total and deterministic. An event that fails [`State::check`]
    /// is an error and changes nothing. Any other event advances the last
    /// index; one that names something unknown, or lacks a field it needs,
    /// changes nothing else and is reported as [`Applied::Ignored`].
    pub fn apply(&mut self, event: &IndexedEvent) -> Result<Applied, ApplyError> {
        self.check(event)?;
        let outcome = match event.event.as_ref().and_then(|e| e.kind.as_ref()) {
            None => Err(Ignored::EmptyEvent),
            Some(kind) => apply_kind(&mut self.inner, kind, event.index),
        };
        self.inner.last_index = event.index;
        if !event.origin_node_id.is_empty() {
            let seq = self
                .inner
                .local_seqs
                .entry(event.origin_node_id.clone())
                .or_insert(0);
            *seq = (*seq).max(event.origin_seq);
        }
        if self.inner.session != event.session {
            self.inner.session = event.session.clone();
        }
        Ok(match outcome {
            Ok(()) => Applied::Changed,
            Err(ignored) => Applied::Ignored(ignored),
        })
    }

    /// The session of the last applied event, if any.
    pub fn session(&self) -> Option<&SessionId> {
        self.inner.session.as_ref()
    }
}

/// Whether a command with this id already made a task (it is being sent
/// again, or is still running).
pub fn command_applied(state: &ClusterState, command_id: &str) -> bool {
    !command_id.is_empty()
        && (state.recent_command_ids.iter().any(|id| id == command_id)
            || state.tasks.values().any(|t| t.command_id == command_id))
}

/// A 32-byte BLAKE3 digest of a state's canonical encoding; shown as hex.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::RECENT_COMMANDS;
    use tessera_protos::v1;
    use v1::event::Kind as K;

    fn session(master: &str, clock: u64) -> Option<SessionId> {
        Some(SessionId {
            master_node_id: master.into(),
            election_clock: clock,
        })
    }

    fn indexed(index: u64, kind: K) -> IndexedEvent {
        IndexedEvent {
            index,
            session: session("m", 1),
            event: Some(v1::Event { kind: Some(kind) }),
            ..Default::default()
        }
    }

    fn node(id: &str) -> K {
        K::NodeGatheredInfo(v1::NodeGatheredInfo {
            node_id: id.into(),
            info: Some(v1::NodeInfo {
                hostname: id.into(),
                ..Default::default()
            }),
        })
    }

    fn instance(id: &str, nodes: &[&str]) -> K {
        K::InstanceCreated(v1::InstanceCreated {
            instance: Some(v1::Instance {
                max_concurrent: 0,
                ring_secret: Vec::new(),
                ring_sealed: false,
                instance_id: id.into(),
                ranks: nodes
                    .iter()
                    .enumerate()
                    .map(|(rank, n)| v1::InstanceRank {
                        rank: rank as u32,
                        node_id: (*n).into(),
                        runner_id: format!("{id}-r{rank}"),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
        })
    }

    fn runner(id: &str, state: v1::runner_status::State) -> K {
        K::RunnerStatusUpdated(v1::RunnerStatusUpdated {
            runner_id: id.into(),
            status: Some(v1::RunnerStatus { state: Some(state) }),
        })
    }

    fn task(id: &str, instance: &str) -> K {
        K::TaskCreated(v1::TaskCreated {
            task: Some(v1::Task {
                task_id: id.into(),
                instance_id: instance.into(),
                kind: Some(v1::task::Kind::Shutdown(v1::ShutdownTask::default())),
                ..Default::default()
            }),
        })
    }

    /// Applies `kinds` as events 1, 2, ... and checks each outcome, written
    /// as "changed" or the reason it was ignored.
    fn check(kinds: Vec<K>, expected: &[&str]) -> State {
        let mut state = State::new();
        let outcomes: Vec<String> = kinds
            .into_iter()
            .enumerate()
            .map(
                |(i, kind)| match state.apply(&indexed(i as u64 + 1, kind)) {
                    Ok(Applied::Changed) => "changed".to_string(),
                    Ok(Applied::Ignored(why)) => why.to_string(),
                    Err(e) => format!("error: {e}"),
                },
            )
            .collect();
        assert_eq!(outcomes, expected);
        state
    }

    #[test]
    fn revoked_members_are_kept_sorted_once() {
        let revoke = |holder: &str| {
            K::MemberRevoked(v1::MemberRevoked {
                holder: holder.into(),
            })
        };
        let state = check(
            vec![revoke("c"), revoke("a"), revoke("c"), revoke("")],
            &[
                "changed",
                "changed",
                "changed",
                "MemberRevoked lacks its holder",
            ],
        );
        assert_eq!(state.revoked, ["a", "c"]);
    }

    #[test]
    fn nodes_edges_and_timeouts() {
        let edge = |a: &str, b: &str| v1::TopologyEdge {
            source_node_id: a.into(),
            sink_node_id: b.into(),
            address: "x".into(),
            ..Default::default()
        };
        let state = check(
            vec![
                node("a"),
                node("b"),
                K::TopologyEdgeCreated(v1::TopologyEdgeCreated {
                    edge: Some(edge("b", "a")),
                }),
                K::TopologyEdgeCreated(v1::TopologyEdgeCreated {
                    edge: Some(edge("a", "b")),
                }),
                K::TopologyEdgeCreated(v1::TopologyEdgeCreated {
                    edge: Some(edge("a", "zz")),
                }),
                K::NodeTimedOut(v1::NodeTimedOut {
                    node_id: "b".into(),
                }),
                K::NodeTimedOut(v1::NodeTimedOut {
                    node_id: "b".into(),
                }),
                K::TopologyEdgeDeleted(v1::TopologyEdgeDeleted {
                    edge: Some(edge("a", "b")),
                }),
            ],
            &[
                "changed",
                "changed",
                "changed",
                "changed",
                "TopologyEdgeCreated names unknown node \"zz\"",
                "changed",
                "NodeTimedOut names unknown node \"b\"",
                "TopologyEdgeDeleted names unknown edge \"a->b\"",
            ],
        );
        assert_eq!(state.last_index(), 8);
        assert_eq!(state.nodes.keys().collect::<Vec<_>>(), ["a"]);
        assert!(
            state.topology.is_empty(),
            "edges of a timed-out node go with it"
        );
    }

    #[test]
    fn instance_runner_and_task_lifecycle() {
        use v1::runner_status::State as R;
        let state = check(
            vec![
                node("a"),
                instance("i", &["a", "ghost"]),
                instance("i", &["a"]),
                instance("i", &["a"]),
                runner(
                    "i-r0",
                    R::Loading(v1::RunnerLoading {
                        layers_loaded: 3,
                        layers_total: 30,
                        bytes_loaded: 0,
                    }),
                ),
                runner("nobody", R::Ready(v1::RunnerReady::default())),
                task("t", "i"),
                task("t2", "no-such-instance"),
                K::TaskAcknowledged(v1::TaskAcknowledged {
                    task_id: "t".into(),
                }),
                K::TaskStatusUpdated(v1::TaskStatusUpdated {
                    task_id: "t".into(),
                    status: v1::TaskStatus::Failed as i32,
                    error: "boom".into(),
                }),
                runner("i-r0", R::Ready(v1::RunnerReady::default())),
                K::InstanceDeleted(v1::InstanceDeleted {
                    instance_id: "i".into(),
                    ..Default::default()
                }),
                runner("i-r0", R::Shutdown(v1::RunnerShutdown {})),
                K::TaskDeleted(v1::TaskDeleted {
                    task_id: "t".into(),
                }),
            ],
            &[
                "changed",
                "InstanceCreated names unknown node \"ghost\"",
                "changed",
                "InstanceCreated names instance \"i\" which already exists",
                "changed",
                "RunnerStatusUpdated names unknown runner \"nobody\"",
                "changed",
                "TaskCreated names unknown instance \"no-such-instance\"",
                "changed",
                "changed",
                "changed",
                "changed",
                "RunnerStatusUpdated names unknown runner \"i-r0\"",
                "TaskDeleted names unknown task \"t\"",
            ],
        );
        assert!(state.instances.is_empty());
        assert!(
            state.runners.is_empty(),
            "the runners of a deleted instance leave the state with it"
        );
        assert!(state.tasks.is_empty());
    }

    #[test]
    fn a_draft_is_set_changed_and_cleared_on_a_known_instance_only() {
        let draft = |instance: &str, method: v1::DraftMethod, model: &str, tokens: u32| {
            K::InstanceDraftModelUpdated(v1::InstanceDraftModelUpdated {
                instance_id: instance.into(),
                draft: Some(v1::InstanceDraft {
                    method: method as i32,
                    draft_model: model.into(),
                    num_draft_tokens: tokens,
                    draft_card: None,
                }),
            })
        };
        let off = |instance: &str| {
            K::InstanceDraftModelUpdated(v1::InstanceDraftModelUpdated {
                instance_id: instance.into(),
                draft: None,
            })
        };
        use v1::DraftMethod as M;
        let mut state = check(
            vec![
                node("a"),
                instance("i", &["a"]),
                draft("i", M::Ngram, "", 4),
                draft("ghost", M::Ngram, "", 4),
                draft("i", M::DraftModel, "", 4),
                draft("i", M::Ngram, "", 0),
            ],
            &[
                "changed",
                "changed",
                "changed",
                "InstanceDraftModelUpdated names unknown instance \"ghost\"",
                "InstanceDraftModelUpdated lacks its draft.draft_model",
                "InstanceDraftModelUpdated lacks its draft.num_draft_tokens",
            ],
        );
        let draft_of = |state: &State| state.instances["i"].draft.clone();
        assert_eq!(
            draft_of(&state).map(|d| (d.method(), d.num_draft_tokens)),
            Some((M::Ngram, 4)),
            "refused updates change nothing"
        );
        let next = |state: &mut State, kind| {
            let index = state.last_index() + 1;
            state.apply(&indexed(index, kind))
        };
        assert_eq!(
            next(&mut state, draft("i", M::DraftModel, "small", 8)),
            Ok(Applied::Changed)
        );
        assert_eq!(
            draft_of(&state).map(|d| (d.draft_model, d.num_draft_tokens)),
            Some(("small".to_string(), 8))
        );
        assert_eq!(next(&mut state, off("i")), Ok(Applied::Changed));
        assert_eq!(draft_of(&state), None);
        // A method left unspecified is off too.
        assert_eq!(
            next(&mut state, draft("i", M::Ngram, "", 2)),
            Ok(Applied::Changed)
        );
        assert_eq!(
            next(&mut state, draft("i", M::Unspecified, "", 0)),
            Ok(Applied::Changed)
        );
        assert_eq!(draft_of(&state), None);
    }

    #[test]
    fn a_given_up_model_keeps_its_reason_until_it_is_placed_again() {
        let of_model = |id: &str| {
            let K::InstanceCreated(mut created) = instance(id, &["a"]) else {
                unreachable!("instance() makes an InstanceCreated")
            };
            if let Some(instance) = created.instance.as_mut() {
                instance.model = Some(v1::ModelCard {
                    model_id: "m".into(),
                    ..Default::default()
                });
            }
            K::InstanceCreated(created)
        };
        let deleted = |id: &str, reason: &str| {
            K::InstanceDeleted(v1::InstanceDeleted {
                instance_id: id.into(),
                reason: reason.into(),
            })
        };
        let ok = ["changed"; 5];
        let state = check(
            vec![
                node("a"),
                of_model("i1"),
                deleted("i1", ""),
                of_model("i2"),
                deleted("i2", "runners kept failing"),
            ],
            &ok,
        );
        assert_eq!(
            state.as_proto().given_up.get("m").map(String::as_str),
            Some("runners kept failing")
        );
        let mut state = state;
        let index = state.last_index() + 1;
        assert!(state.apply(&indexed(index, of_model("i3"))).is_ok());
        assert!(state.as_proto().given_up.is_empty(), "placed again");
    }

    #[test]
    fn a_command_makes_one_task_however_often_it_is_sent() {
        let with_command = |id: &str, command: &str| {
            let K::TaskCreated(mut created) = task(id, "i") else {
                unreachable!("task() makes a TaskCreated")
            };
            if let Some(task) = created.task.as_mut() {
                task.command_id = command.into();
            }
            K::TaskCreated(created)
        };
        let state = check(
            vec![
                node("a"),
                instance("i", &["a"]),
                with_command("t1", "c1"),
                with_command("t2", "c1"),
                K::TaskDeleted(v1::TaskDeleted {
                    task_id: "t1".into(),
                }),
                with_command("t3", "c1"),
            ],
            &[
                "changed",
                "changed",
                "changed",
                "TaskCreated names command \"c1\" which already exists",
                "changed",
                "TaskCreated names command \"c1\" which already exists",
            ],
        );
        assert!(command_applied(state.as_proto(), "c1"));
        assert!(!command_applied(state.as_proto(), "c2"));
        // The memory is bounded: the oldest ids go first.
        let mut state = state;
        for n in 0..RECENT_COMMANDS as u64 + 5 {
            let index = state.last_index() + 1;
            let event = indexed(index, with_command(&format!("x{n}"), &format!("cmd{n}")));
            assert!(state.apply(&event).is_ok());
        }
        assert_eq!(state.as_proto().recent_command_ids.len(), RECENT_COMMANDS);
        assert!(!state
            .as_proto()
            .recent_command_ids
            .contains(&"c1".to_string()));
    }

    #[test]
    fn task_fields_follow_their_events() {
        let mut state = State::new();
        for (i, kind) in [node("a"), instance("i", &["a"]), task("t", "i")]
            .into_iter()
            .enumerate()
        {
            state.apply(&indexed(i as u64 + 1, kind)).ok();
        }
        let ack = indexed(
            4,
            K::TaskAcknowledged(v1::TaskAcknowledged {
                task_id: "t".into(),
            }),
        );
        assert_eq!(state.apply(&ack), Ok(Applied::Changed));
        let failed = indexed(
            5,
            K::TaskStatusUpdated(v1::TaskStatusUpdated {
                task_id: "t".into(),
                status: v1::TaskStatus::Failed as i32,
                error: "out of memory".into(),
            }),
        );
        assert_eq!(state.apply(&failed), Ok(Applied::Changed));
        let task = &state.tasks["t"];
        assert!(task.acknowledged);
        assert_eq!(task.status(), v1::TaskStatus::Failed);
        assert_eq!(task.error, "out of memory");
    }

    #[test]
    fn downloads_need_a_known_node_and_a_model() {
        let progress = |node: &str, model: &str| {
            K::NodeDownloadProgress(v1::NodeDownloadProgress {
                node_id: node.into(),
                progress: Some(v1::DownloadProgress {
                    model_id: model.into(),
                    state: Some(v1::download_progress::State::Pending(v1::DownloadPending {
                        total_bytes: 1,
                        request_id: String::new(),
                    })),
                    shards: Vec::new(),
                }),
            })
        };
        let state = check(
            vec![
                node("a"),
                progress("a", "m"),
                progress("b", "m"),
                progress("a", ""),
            ],
            &[
                "changed",
                "changed",
                "NodeDownloadProgress names unknown node \"b\"",
                "NodeDownloadProgress lacks its progress.model_id",
            ],
        );
        assert!(state.downloads["a"].models.contains_key("m"));
    }

    #[test]
    fn out_of_order_and_malformed_events_change_nothing() {
        let mut state = State::new();
        assert_eq!(state.apply(&indexed(1, node("a"))), Ok(Applied::Changed));
        let before = state.clone();
        assert_eq!(
            state.apply(&indexed(3, node("b"))),
            Err(ApplyError::OutOfOrder {
                expected: 2,
                got: 3
            })
        );
        assert_eq!(
            state.apply(&indexed(1, node("b"))),
            Err(ApplyError::OutOfOrder {
                expected: 2,
                got: 1
            })
        );
        let no_session = IndexedEvent {
            session: None,
            ..indexed(2, node("b"))
        };
        assert_eq!(
            state.apply(&no_session),
            Err(ApplyError::Invalid {
                index: 2,
                reason: InvalidEvent::MissingSession
            })
        );
        assert_eq!(state, before);
        let empty = IndexedEvent {
            event: None,
            ..indexed(2, node("b"))
        };
        assert_eq!(
            state.apply(&empty),
            Ok(Applied::Ignored(Ignored::EmptyEvent))
        );
        assert_eq!(state.last_index(), 2);
    }

    #[test]
    fn sessions_only_move_forward() {
        let mut state = State::new();
        let at = |index, master: &str, clock| IndexedEvent {
            session: session(master, clock),
            ..indexed(index, node("a"))
        };
        assert!(state.apply(&at(1, "m", 2)).is_ok());
        assert!(matches!(
            state.apply(&at(2, "old", 1)),
            Err(ApplyError::StaleSession { .. })
        ));
        assert!(matches!(
            state.apply(&at(2, "rival", 2)),
            Err(ApplyError::ConflictingSession { .. })
        ));
        // A new master continues the same log at the next index.
        assert!(state.apply(&at(2, "new", 3)).is_ok());
        assert_eq!(
            state.session().map(|s| s.master_node_id.as_str()),
            Some("new")
        );
    }

    #[test]
    fn digest_depends_on_content_not_insertion_order() {
        let mut one = State::new();
        let mut two = State::new();
        for (i, n) in ["a", "b"].iter().enumerate() {
            one.apply(&indexed(i as u64 + 1, node(n))).ok();
        }
        for (i, n) in ["b", "a"].iter().enumerate() {
            two.apply(&indexed(i as u64 + 1, node(n))).ok();
        }
        // Same nodes, but each node's updated_at_index differs.
        assert_ne!(one.digest(), two.digest());
        let mut three = State::new();
        for (i, n) in ["a", "b"].iter().enumerate() {
            three.apply(&indexed(i as u64 + 1, node(n))).ok();
        }
        assert_eq!(one.digest(), three.digest());
        assert_eq!(one.digest().to_string().len(), 64);
    }
}
