//! Property tests: any sequence of well-formed events folds without panic, and
//! every way of rebuilding the state (in memory, full replay from sled,
//! snapshot + tail) gives the same digest.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use tessera_state::log::decode_entry;
use tessera_state::v1::{self, event::Kind, runner_status::State as R};
use tessera_state::{replay, Journal, ReplayOptions, State};

fn id(prefix: &'static str, pool: u8) -> impl Strategy<Value = String> {
    (0..pool).prop_map(move |n| format!("{prefix}{n}"))
}

fn runner_state() -> impl Strategy<Value = R> {
    prop_oneof![
        Just(R::Idle(v1::RunnerIdle {})),
        Just(R::Connecting(v1::RunnerConnecting {})),
        (0u32..40, 1u32..40).prop_map(|(l, t)| R::Loading(v1::RunnerLoading {
            layers_loaded: l,
            layers_total: t,
            bytes_loaded: 0
        })),
        Just(R::Ready(v1::RunnerReady::default())),
        id("t", 4).prop_map(|task_id| R::Running(v1::RunnerRunning {
            task_id,
            ..Default::default()
        })),
        Just(R::Shutdown(v1::RunnerShutdown {})),
        ".{0,8}".prop_map(|reason| R::Failed(v1::RunnerFailed {
            reason,
            diagnostics: String::new()
        })),
    ]
}

/// Any event kind over small pools of ids, so that events often name things
/// that exist and sometimes things that do not.
fn event_kind() -> impl Strategy<Value = Kind> {
    let edge = || {
        (id("n", 4), id("n", 4), 0u8..2).prop_map(|(source_node_id, sink_node_id, a)| {
            v1::TopologyEdge {
                source_node_id,
                sink_node_id,
                address: format!("10.0.0.{a}"),
                ..Default::default()
            }
        })
    };
    prop_oneof![
        (id("n", 4), any::<u64>()).prop_map(|(node_id, mem)| Kind::NodeGatheredInfo(
            v1::NodeGatheredInfo {
                node_id,
                info: Some(v1::NodeInfo {
                    memory_available_bytes: mem,
                    ..Default::default()
                }),
            }
        )),
        id("n", 5).prop_map(|node_id| Kind::NodeTimedOut(v1::NodeTimedOut { node_id })),
        edge().prop_map(|e| Kind::TopologyEdgeCreated(v1::TopologyEdgeCreated { edge: Some(e) })),
        edge().prop_map(|e| Kind::TopologyEdgeDeleted(v1::TopologyEdgeDeleted { edge: Some(e) })),
        (id("i", 3), prop::collection::vec(id("n", 4), 0..3)).prop_map(|(instance_id, nodes)| {
            Kind::InstanceCreated(v1::InstanceCreated {
                instance: Some(v1::Instance {
                    ranks: nodes
                        .into_iter()
                        .enumerate()
                        .map(|(rank, node_id)| v1::InstanceRank {
                            rank: rank as u32,
                            runner_id: format!("r{}{rank}", &instance_id[1..]),
                            node_id,
                            ..Default::default()
                        })
                        .collect(),
                    instance_id,
                    ..Default::default()
                }),
            })
        }),
        id("i", 4).prop_map(|instance_id| Kind::InstanceDeleted(v1::InstanceDeleted {
            instance_id,
            ..Default::default()
        })),
        (id("r", 30), runner_state()).prop_map(|(runner_id, state)| Kind::RunnerStatusUpdated(
            v1::RunnerStatusUpdated {
                runner_id,
                status: Some(v1::RunnerStatus { state: Some(state) })
            }
        )),
        id("r", 30).prop_map(|runner_id| Kind::RunnerDeleted(v1::RunnerDeleted { runner_id })),
        (id("t", 4), id("i", 4)).prop_map(|(task_id, instance_id)| Kind::TaskCreated(
            v1::TaskCreated {
                task: Some(v1::Task {
                    task_id,
                    instance_id,
                    kind: Some(v1::task::Kind::StartWarmup(v1::StartWarmupTask::default())),
                    ..Default::default()
                }),
            }
        )),
        id("t", 5).prop_map(|task_id| Kind::TaskAcknowledged(v1::TaskAcknowledged { task_id })),
        (id("t", 5), 0i32..7).prop_map(|(task_id, status)| Kind::TaskStatusUpdated(
            v1::TaskStatusUpdated {
                task_id,
                status,
                error: String::new(),
            }
        )),
        id("t", 5).prop_map(|task_id| Kind::TaskDeleted(v1::TaskDeleted { task_id })),
        id("n", 6).prop_map(|holder| Kind::MemberRevoked(v1::MemberRevoked { holder })),
        (id("i", 4), 0i32..4, id("m", 2), 0u32..20).prop_map(
            |(instance_id, method, draft_model, num_draft_tokens)| {
                Kind::InstanceDraftModelUpdated(v1::InstanceDraftModelUpdated {
                    instance_id,
                    draft: (method < 3).then_some(v1::InstanceDraft {
                        method,
                        draft_model,
                        num_draft_tokens,
                        draft_card: None,
                    }),
                })
            }
        ),
        (id("n", 5), id("m", 2), any::<u64>()).prop_map(|(node_id, model_id, total_bytes)| {
            Kind::NodeDownloadProgress(v1::NodeDownloadProgress {
                node_id,
                progress: Some(v1::DownloadProgress {
                    model_id,
                    state: Some(v1::download_progress::State::Pending(v1::DownloadPending {
                        total_bytes,
                        request_id: String::new(),
                    })),
                    shards: Vec::new(),
                }),
            })
        }),
    ]
}

/// Sequences of events with contiguous indices; the election clock now and
/// then moves to a new master, as after a failover.
fn event_sequence(max: usize) -> impl Strategy<Value = Vec<v1::IndexedEvent>> {
    prop::collection::vec((event_kind(), prop::bool::weighted(0.02)), 1..max).prop_map(|kinds| {
        let mut clock = 1;
        kinds
            .into_iter()
            .enumerate()
            .map(|(i, (kind, new_term))| {
                clock += u64::from(new_term);
                v1::IndexedEvent {
                    index: i as u64 + 1,
                    session: Some(v1::SessionId {
                        master_node_id: format!("master{clock}"),
                        election_clock: clock,
                    }),
                    event: Some(v1::Event { kind: Some(kind) }),
                    ..Default::default()
                }
            })
            .collect()
    })
}

fn config(cases: u32) -> Config {
    // A fixed seed keeps the suite deterministic; failures still shrink.
    Config {
        cases,
        rng_seed: RngSeed::Fixed(0x7e55_e7a0),
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn any_event_sequence_folds_without_panic(events in event_sequence(200)) {
        let mut state = State::new();
        for event in &events {
            prop_assert!(state.apply(event).is_ok());
        }
        prop_assert_eq!(state.last_index(), events.len() as u64);
        // Every fold of the same events gives the same digest.
        let mut again = State::new();
        for event in &events {
            again.apply(event).ok();
        }
        prop_assert_eq!(state.digest(), again.digest());
    }

    #[test]
    fn garbage_bytes_are_rejected_as_log_entries(bytes in prop::collection::vec(any::<u8>(), 0..256), index in 1u64..1000) {
        prop_assert!(decode_entry(index, &bytes).is_err());
    }

    #[test]
    fn garbage_bytes_never_panic_the_fold(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        use prost::Message;
        // Whatever prost makes of random bytes, apply answers without panic.
        if let Ok(event) = v1::IndexedEvent::decode(bytes.as_slice()) {
            let _ = State::new().apply(&event);
        }
    }
}

proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn memory_full_replay_and_snapshot_replay_agree(events in event_sequence(300), every in 1u64..40, cut in 0.0f64..1.0) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut journal = Journal::open(dir.path(), every).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut in_memory = State::new();
        let mut prefix_digest = None;
        let until = ((events.len() as f64 * cut) as u64).max(1);
        for event in &events {
            in_memory.apply(event).map_err(|e| TestCaseError::fail(e.to_string()))?;
            journal.commit(event).map_err(|e| TestCaseError::fail(e.to_string()))?;
            if event.index == until {
                prefix_digest = Some(in_memory.digest());
            }
        }
        let log = journal.log();
        let full = replay(log, ReplayOptions { until: None, use_snapshots: false })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let snap = replay(log, ReplayOptions::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(full.state.digest(), in_memory.digest());
        prop_assert_eq!(snap.state.digest(), in_memory.digest());
        prop_assert_eq!(&snap.state, &in_memory);
        let partial = replay(log, ReplayOptions { until: Some(until), use_snapshots: true })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(Some(partial.state.digest()), prefix_digest);
    }
}

/// Decodes `bytes` as every message of the wire protocol, then encodes
/// what decoded and decodes it again: no panic, and a round trip gives the
/// same bytes (bytes, not values: a float field may decode to NaN).
macro_rules! decode_as_every_message {
    ($bytes:expr; $($message:ty,)*) => {{
        use prost::Message;
        let mut decoded = 0;
        $(
            if let Ok(message) = <$message>::decode($bytes) {
                decoded += 1;
                let bytes = message.encode_to_vec();
                let again = <$message>::decode(bytes.as_slice()).map(|m| m.encode_to_vec());
                assert_eq!(again.as_ref(), Ok(&bytes));
            }
        )*
        decoded
    }};
}

fn decode_everything(bytes: &[u8]) -> usize {
    decode_as_every_message!(bytes;
        v1::AdminError,
        v1::GetStateRequest,
        v1::GetStateReply,
        v1::ListNodesRequest,
        v1::NodeSummary,
        v1::ListNodesReply,
        v1::ListInstancesRequest,
        v1::ListInstancesReply,
        v1::PlacementPreviewsRequest,
        v1::PlacementPreview,
        v1::PlacementPreviewsReply,
        v1::PlaceInstanceRequest,
        v1::PlaceInstanceReply,
        v1::DeleteInstanceRequest,
        v1::DeleteInstanceReply,
        v1::ListModelsRequest,
        v1::ModelListing,
        v1::ListModelsReply,
        v1::ListDownloadsRequest,
        v1::NodeDownloadEntry,
        v1::ListDownloadsReply,
        v1::AddModelRequest,
        v1::AddModelReply,
        v1::DownloadRequest,
        v1::DownloadReply,
        v1::RevokeRequest,
        v1::RevokeReply,
        v1::EventsRangeRequest,
        v1::EventsRangeReply,
        v1::GenerationChunk,
        v1::TokenChunk,
        v1::TopLogprob,
        v1::ToolCallChunk,
        v1::PrefillProgressChunk,
        v1::FinishChunk,
        v1::Usage,
        v1::GenerationStats,
        v1::ErrorChunk,
        v1::Command,
        v1::PlaceInstance,
        v1::CreateInstance,
        v1::DeleteInstance,
        v1::TextGeneration,
        v1::CancelTask,
        v1::TaskFinished,
        v1::RequestEventLog,
        v1::AddModelCard,
        v1::StartDownload,
        v1::DeleteDownload,
        v1::CancelDownload,
        v1::SessionId,
        v1::DownloadProgress,
        v1::DownloadPending,
        v1::DownloadOngoing,
        v1::FileProgress,
        v1::DownloadCompleted,
        v1::DownloadFailed,
        v1::DownloadCancelled,
        v1::DownloadDeleted,
        v1::ElectionMessage,
        v1::Campaign,
        v1::Victory,
        v1::Event,
        v1::IndexedEvent,
        v1::LocalEvent,
        v1::NodeGatheredInfo,
        v1::NodeTimedOut,
        v1::TopologyEdgeCreated,
        v1::TopologyEdgeDeleted,
        v1::InstanceCreated,
        v1::InstanceDeleted,
        v1::RunnerStatusUpdated,
        v1::RunnerDeleted,
        v1::TaskCreated,
        v1::TaskAcknowledged,
        v1::TaskStatusUpdated,
        v1::TaskDeleted,
        v1::ModelCardAdded,
        v1::MemberRevoked,
        v1::NodeDownloadProgress,
        v1::EventLogRequest,
        v1::EventLogReply,
        v1::ShardSpec,
        v1::PipelineShard,
        v1::TensorShard,
        v1::InstanceRank,
        v1::Instance,
        v1::ModelCard,
        v1::ModelSource,
        v1::ModelFile,
        v1::SamplingDefaults,
        v1::NodeInfo,
        v1::NetworkAddress,
        v1::TopologyEdge,
        v1::RunnerStatus,
        v1::RunnerIdle,
        v1::RunnerConnecting,
        v1::RunnerConnected,
        v1::RunnerLoading,
        v1::RunnerLoaded,
        v1::RunnerWarmingUp,
        v1::RunnerReady,
        v1::RunnerRunning,
        v1::RunnerShuttingDown,
        v1::RunnerShutdown,
        v1::RunnerFailed,
        v1::ClusterState,
        v1::NodeState,
        v1::NodeDownloads,
        v1::Task,
        v1::CreateRunnerTask,
        v1::DownloadModelTask,
        v1::ConnectToGroupTask,
        v1::LoadModelTask,
        v1::StartWarmupTask,
        v1::TextGenerationTask,
        v1::CancelTaskTask,
        v1::ShutdownTask,
        v1::TextGenerationParams,
        v1::ChatMessage,
        v1::ToolCall,
        v1::SamplingParams,
    )
}

proptest! {
    #![proptest_config(config(2_000))]

    #[test]
    fn every_protocol_message_decodes_random_bytes_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_everything(&bytes);
    }

    #[test]
    fn every_protocol_message_decodes_mutated_events_without_panic(
        events in event_sequence(4),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        use prost::Message;
        for event in &events {
            // A valid encoding with a few bytes changed reaches deep into
            // nested messages, where random bytes rarely go.
            let mut bytes = event.encode_to_vec();
            if bytes.is_empty() {
                continue;
            }
            for (at, value) in &flips {
                let i = at.index(bytes.len());
                bytes[i] ^= value;
            }
            decode_everything(&bytes);
            if let Ok(mutated) = v1::IndexedEvent::decode(bytes.as_slice()) {
                let _ = State::new().apply(&mutated);
            }
        }
    }
}
