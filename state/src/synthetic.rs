//! Deterministic, realistic streams of indexed events, for benchmarks and
//! tests: a few nodes report their info, connect, download a model, run an
//! instance through the runner lifecycle and serve generation tasks, with the
//! instance now and then deleted and placed again.

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_protos::v1::{self, event::Kind, runner_status::State as RunnerState};

/// A generator of contiguous indexed events starting at index 1.
pub struct SyntheticEvents {
    rng: StdRng,
    next_index: u64,
    nodes: Vec<String>,
    pending: VecDeque<Kind>,
    instance_serial: u64,
    task_serial: u64,
    session: v1::SessionId,
}

impl SyntheticEvents {
    /// A stream over `node_count` nodes (at least 2), reproducible from `seed`.
    pub fn new(seed: u64, node_count: usize) -> Self {
        let nodes = (0..node_count.max(2))
            .map(|n| format!("node-{n:02}"))
            .collect();
        let session = v1::SessionId {
            master_node_id: "node-00".into(),
            election_clock: 1,
        };
        Self {
            rng: StdRng::seed_from_u64(seed),
            next_index: 1,
            nodes,
            pending: VecDeque::new(),
            instance_serial: 0,
            task_serial: 0,
            session,
        }
    }

    /// The next `count` events.
    pub fn take_events(&mut self, count: usize) -> Vec<v1::IndexedEvent> {
        (0..count).map(|_| self.next_event()).collect()
    }

    pub fn next_event(&mut self) -> v1::IndexedEvent {
        if self.pending.is_empty() {
            self.plan_next_phase();
        }
        let kind = self.pending.pop_front();
        let index = self.next_index;
        self.next_index += 1;
        v1::IndexedEvent {
            index,
            session: Some(self.session.clone()),
            event: Some(v1::Event { kind }),
            ..Default::default()
        }
    }

    fn plan_next_phase(&mut self) {
        if self.next_index == 1 {
            self.plan_cluster_start();
        }
        self.plan_instance_lifetime();
    }

    fn plan_cluster_start(&mut self) {
        for node in self.nodes.clone() {
            let info = self.node_info(&node);
            self.pending
                .push_back(Kind::NodeGatheredInfo(v1::NodeGatheredInfo {
                    node_id: node,
                    info: Some(info),
                }));
        }
        for (i, source) in self.nodes.iter().enumerate() {
            for (j, sink) in self.nodes.iter().enumerate() {
                if i != j {
                    self.pending
                        .push_back(Kind::TopologyEdgeCreated(v1::TopologyEdgeCreated {
                            edge: Some(v1::TopologyEdge {
                                source_node_id: source.clone(),
                                sink_node_id: sink.clone(),
                                address: format!("10.0.0.{}:52416", j + 1),
                                kind: v1::LinkKind::Ethernet as i32,
                                latency_us: 200,
                            }),
                        }));
                }
            }
        }
    }

    /// One instance from placement to deletion, with its generations.
    fn plan_instance_lifetime(&mut self) {
        self.instance_serial += 1;
        let instance_id = format!("instance-{:06}", self.instance_serial);
        let model_id = "smollm2-135m-instruct-q4_1".to_string();
        let ranks = self.ranks_of(&instance_id);
        self.push_downloads(&ranks, &model_id);
        self.push_instance_created(&instance_id, &model_id, &ranks);
        self.push_lifecycle(&ranks);
        let generations = self.rng.gen_range(20..200);
        for _ in 0..generations {
            self.plan_generation(&instance_id, &model_id, &ranks);
            if self.rng.gen_ratio(1, 10) {
                let node = self.nodes[self.rng.gen_range(0..self.nodes.len())].clone();
                let info = self.node_info(&node);
                self.pending
                    .push_back(Kind::NodeGatheredInfo(v1::NodeGatheredInfo {
                        node_id: node,
                        info: Some(info),
                    }));
            }
        }
        for rank in &ranks {
            self.push_runner(
                &rank.runner_id,
                RunnerState::ShuttingDown(v1::RunnerShuttingDown {}),
            );
        }
        self.pending
            .push_back(Kind::InstanceDeleted(v1::InstanceDeleted {
                instance_id,
                ..Default::default()
            }));
        for rank in &ranks {
            self.push_runner(
                &rank.runner_id,
                RunnerState::Shutdown(v1::RunnerShutdown {}),
            );
        }
    }

    /// Two pipeline ranks on the first two nodes.
    fn ranks_of(&self, instance_id: &str) -> Vec<v1::InstanceRank> {
        self.nodes
            .iter()
            .take(2)
            .enumerate()
            .map(|(rank, node)| v1::InstanceRank {
                rank: rank as u32,
                node_id: node.clone(),
                runner_id: format!("{instance_id}-runner-{rank}"),
                shard: Some(v1::ShardSpec {
                    kind: Some(v1::shard_spec::Kind::Pipeline(v1::PipelineShard {
                        start_layer: 15 * rank as u32,
                        end_layer: 15 * (rank as u32 + 1),
                        n_layers: 30,
                    })),
                }),
                ring_address: format!("10.0.0.{}:{}", rank + 1, 53000 + rank),
            })
            .collect()
    }

    /// Each rank's node downloads the model: 0%, 50%, done.
    fn push_downloads(&mut self, ranks: &[v1::InstanceRank], model_id: &str) {
        for rank in ranks {
            for percent in [0u64, 50, 100] {
                let total = 98_000_000;
                let state = if percent == 100 {
                    v1::download_progress::State::Completed(v1::DownloadCompleted {
                        total_bytes: total,
                        read_only: false,
                        path: String::new(),
                    })
                } else {
                    v1::download_progress::State::Ongoing(v1::DownloadOngoing {
                        downloaded_bytes: total * percent / 100,
                        total_bytes: total,
                        bytes_per_second: 50_000_000,
                        eta_ms: 1000,
                        files: vec![],
                    })
                };
                self.pending
                    .push_back(Kind::NodeDownloadProgress(v1::NodeDownloadProgress {
                        node_id: rank.node_id.clone(),
                        progress: Some(v1::DownloadProgress {
                            model_id: model_id.to_string(),
                            state: Some(state),
                            shards: Vec::new(),
                        }),
                    }));
            }
        }
    }

    fn push_instance_created(
        &mut self,
        instance_id: &str,
        model_id: &str,
        ranks: &[v1::InstanceRank],
    ) {
        self.pending
            .push_back(Kind::InstanceCreated(v1::InstanceCreated {
                instance: Some(v1::Instance {
                    max_concurrent: 0,
                    ring_secret: Vec::new(),
                    ring_sealed: false,
                    draft: None,
                    instance_id: instance_id.to_string(),
                    model: Some(v1::ModelCard {
                        model_id: model_id.to_string(),
                        n_layers: 30,
                        ..Default::default()
                    }),
                    sharding: v1::Sharding::Pipeline as i32,
                    ranks: ranks.to_vec(),
                }),
            }));
    }

    /// Every rank's runner from connecting to ready, rank by rank at each
    /// state.
    fn push_lifecycle(&mut self, ranks: &[v1::InstanceRank]) {
        let lifecycle = [
            RunnerState::Connecting(v1::RunnerConnecting {}),
            RunnerState::Connected(v1::RunnerConnected {}),
            RunnerState::Loading(v1::RunnerLoading {
                layers_loaded: 0,
                layers_total: 15,
                bytes_loaded: 0,
            }),
            RunnerState::Loading(v1::RunnerLoading {
                layers_loaded: 15,
                layers_total: 15,
                bytes_loaded: 49_000_000,
            }),
            RunnerState::Loaded(v1::RunnerLoaded {
                resident_bytes: 60_000_000,
            }),
            RunnerState::WarmingUp(v1::RunnerWarmingUp {}),
            RunnerState::Ready(v1::RunnerReady::default()),
        ];
        for state in lifecycle {
            for rank in ranks {
                self.push_runner(&rank.runner_id, state.clone());
            }
        }
    }

    fn plan_generation(&mut self, instance_id: &str, model_id: &str, ranks: &[v1::InstanceRank]) {
        self.task_serial += 1;
        let task_id = format!("task-{:08}", self.task_serial);
        let prompt_words = self.rng.gen_range(3..40);
        let content = vec!["word"; prompt_words].join(" ");
        self.pending.push_back(Kind::TaskCreated(v1::TaskCreated {
            task: Some(v1::Task {
                task_id: task_id.clone(),
                instance_id: instance_id.to_owned(),
                command_id: format!("command-{:08}", self.task_serial),
                status: v1::TaskStatus::Pending as i32,
                acknowledged: false,
                error: String::new(),
                kind: Some(v1::task::Kind::TextGeneration(v1::TextGenerationTask {
                    params: Some(v1::TextGenerationParams {
                        model_id: model_id.to_owned(),
                        messages: vec![v1::ChatMessage {
                            role: "user".into(),
                            content,
                            ..Default::default()
                        }],
                        sampling: Some(v1::SamplingParams {
                            temperature: Some(0.7),
                            max_tokens: Some(256),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    reply_node_id: self.nodes[0].clone(),
                })),
            }),
        }));
        self.pending
            .push_back(Kind::TaskAcknowledged(v1::TaskAcknowledged {
                task_id: task_id.clone(),
            }));
        self.push_task_status(&task_id, v1::TaskStatus::Running);
        for rank in ranks {
            self.push_runner(
                &rank.runner_id,
                RunnerState::Running(v1::RunnerRunning {
                    task_id: task_id.clone(),
                    task_ids: vec![task_id.clone()],
                    ..Default::default()
                }),
            );
        }
        for rank in ranks {
            self.push_runner(
                &rank.runner_id,
                RunnerState::Ready(v1::RunnerReady::default()),
            );
        }
        let outcome = if self.rng.gen_ratio(1, 50) {
            v1::TaskStatus::Cancelled
        } else {
            v1::TaskStatus::Complete
        };
        self.push_task_status(&task_id, outcome);
        self.pending
            .push_back(Kind::TaskDeleted(v1::TaskDeleted { task_id }));
    }

    fn push_runner(&mut self, runner_id: &str, state: RunnerState) {
        self.pending
            .push_back(Kind::RunnerStatusUpdated(v1::RunnerStatusUpdated {
                runner_id: runner_id.to_owned(),
                status: Some(v1::RunnerStatus { state: Some(state) }),
            }));
    }

    fn push_task_status(&mut self, task_id: &str, status: v1::TaskStatus) {
        self.pending
            .push_back(Kind::TaskStatusUpdated(v1::TaskStatusUpdated {
                task_id: task_id.to_owned(),
                status: status as i32,
                error: String::new(),
            }));
    }

    fn node_info(&mut self, node: &str) -> v1::NodeInfo {
        let total: u64 = 16 << 30;
        v1::NodeInfo {
            hostname: node.to_owned(),
            os: "Linux".into(),
            os_version: "6.8".into(),
            cpu_model: "AMD EPYC".into(),
            cpu_cores: 8,
            memory_total_bytes: total,
            memory_available_bytes: total - self.rng.gen_range(0..(4u64 << 30)),
            disk_available_bytes: 200 << 30,
            addresses: vec![v1::NetworkAddress {
                interface: "eth0".into(),
                ip: "10.0.0.1".into(),
                kind: v1::LinkKind::Ethernet as i32,
            }],
            engine_backends: vec![v1::EngineBackend::Cpu as i32],
            tessera_version: env!("CARGO_PKG_VERSION").into(),
            gathered_at_unix_ms: 1_764_000_000_000 + self.next_index * 10,
            no_worker: false,
            ring_port_base: 0,
            actor_restarts: 0,
            last_actor_failure: String::new(),
            gpus: Vec::new(),
            device: String::new(),
            decode_bytes_per_second: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Applied, State};

    #[test]
    fn the_stream_applies_and_mostly_changes_state() -> Result<(), crate::ApplyError> {
        let mut state = State::new();
        let mut ignored = 0;
        for event in SyntheticEvents::new(7, 3).take_events(5_000) {
            if let Applied::Ignored(_) = state.apply(&event)? {
                ignored += 1;
            }
        }
        assert_eq!(state.last_index(), 5_000);
        // Only the shutdown status of a runner whose instance was deleted is
        // a no-op by design; everything else in the stream changes state.
        assert!(ignored < 100, "{ignored} events were ignored");
        assert!(state.tasks.len() <= 1, "tasks are deleted as they finish");
        Ok(())
    }

    #[test]
    fn the_stream_is_reproducible() {
        let a = SyntheticEvents::new(1, 3).take_events(1_000);
        let b = SyntheticEvents::new(1, 3).take_events(1_000);
        assert_eq!(a, b);
    }
}
