//! The worker's next step: a pure function of the cluster state, this node
//! and the runners it has started, unit-tested without actors.
//!
//! One step at a time, first match wins:
//! 1. shut down a local runner whose instance is gone (or that failed: the
//!    supervisor restarts it with backoff once it is gone);
//! 2. create a runner for each rank of an instance placed on this node;
//! 3. bring each runner along its state machine: connect once every rank of
//!    its instance has a runner (ranks connect together), load once
//!    connected (or at once with a single rank), warm up once every rank
//!    has loaded (warm-up runs all ranks together);
//! 4. hand a pending generation to the rank-0 runner once it is ready
//!    (other ranks follow rank 0 through the ring, they need no task);
//! 5. cancel a generation whose task was cancelled while it runs.
//!
//! Runner statuses are read from the state (each change is an event), so
//! every node plans from the same facts.

use std::collections::BTreeMap;

use tessera_protos::v1::{runner_status::State as Rs, task, ClusterState, TaskStatus};

/// A step for the worker to take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    CreateRunner {
        instance_id: String,
        runner_id: String,
        rank: u32,
    },
    Connect {
        runner_id: String,
    },
    Load {
        runner_id: String,
    },
    WarmUp {
        runner_id: String,
    },
    Forward {
        runner_id: String,
        task_id: String,
    },
    Cancel {
        runner_id: String,
        task_id: String,
    },
    Shutdown {
        runner_id: String,
    },
}

/// What the worker knows of a runner it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRunner {
    pub instance_id: String,
    pub rank: u32,
    /// The step last handed to it and not yet reflected in its status, so
    /// the same step is not given twice.
    pub pending: Option<Step>,
    /// The generation it is working on, if any.
    pub task_id: Option<String>,
}

/// The runner's state, `None` before its first status event.
fn status<'a>(state: &'a ClusterState, runner_id: &str) -> Option<&'a Rs> {
    state.runners.get(runner_id).and_then(|s| s.state.as_ref())
}

fn is_ready(state: &ClusterState, runner_id: &str) -> bool {
    matches!(status(state, runner_id), Some(Rs::Ready(_)))
}

/// Where a runner stands on the way to Ready, as a number (Failed and the
/// shutdown states are not on the way).
fn progress(state: Option<&Rs>) -> Option<u8> {
    Some(match state {
        None | Some(Rs::Idle(_)) => 0,
        Some(Rs::Connecting(_)) => 1,
        Some(Rs::Connected(_)) => 2,
        Some(Rs::Loading(_)) => 3,
        Some(Rs::Loaded(_)) => 4,
        Some(Rs::WarmingUp(_)) => 5,
        Some(Rs::Ready(_)) | Some(Rs::Running(_)) => 6,
        Some(Rs::ShuttingDown(_)) | Some(Rs::Shutdown(_)) | Some(Rs::Failed(_)) => return None,
    })
}

/// The next step for `node_id`, if any.
pub fn plan(
    state: &ClusterState,
    node_id: &str,
    runners: &BTreeMap<String, LocalRunner>,
) -> Option<Step> {
    // 1. Runners without an instance, or failed ones.
    for (runner_id, runner) in runners {
        let orphaned = !state.instances.contains_key(&runner.instance_id);
        let failed = matches!(status(state, runner_id), Some(Rs::Failed(_)));
        let stopping = matches!(
            status(state, runner_id),
            Some(Rs::ShuttingDown(_)) | Some(Rs::Shutdown(_))
        );
        let asked = matches!(runner.pending, Some(Step::Shutdown { .. }));
        if (orphaned || failed) && !stopping && !asked {
            return Some(Step::Shutdown {
                runner_id: runner_id.clone(),
            });
        }
    }
    // 2. Ranks placed here without a runner.
    for instance in state.instances.values() {
        for rank in instance.ranks.iter().filter(|r| r.node_id == node_id) {
            if !runners.contains_key(&rank.runner_id) {
                return Some(Step::CreateRunner {
                    instance_id: instance.instance_id.clone(),
                    runner_id: rank.runner_id.clone(),
                    rank: rank.rank,
                });
            }
        }
    }
    // 3. Along the state machine.
    for (runner_id, runner) in runners {
        let Some(instance) = state.instances.get(&runner.instance_id) else {
            continue;
        };
        let rank_progress: Vec<Option<u8>> = instance
            .ranks
            .iter()
            .map(|r| {
                if runners.contains_key(&r.runner_id) || state.runners.contains_key(&r.runner_id) {
                    progress(status(state, &r.runner_id))
                } else {
                    // Not started yet on its node.
                    None
                }
            })
            .collect();
        let all_at_least = |level: u8| rank_progress.iter().all(|p| p.is_some_and(|p| p >= level));
        let single = instance.ranks.len() == 1;
        let wanted = match status(state, runner_id) {
            None | Some(Rs::Idle(_)) if single => Some(Step::Load {
                runner_id: runner_id.clone(),
            }),
            None | Some(Rs::Idle(_)) if all_at_least(0) => Some(Step::Connect {
                runner_id: runner_id.clone(),
            }),
            Some(Rs::Connected(_)) => Some(Step::Load {
                runner_id: runner_id.clone(),
            }),
            Some(Rs::Loaded(_)) if all_at_least(4) => Some(Step::WarmUp {
                runner_id: runner_id.clone(),
            }),
            _ => None,
        };
        if let Some(step) = wanted {
            if runner.pending.as_ref() != Some(&step) {
                return Some(step);
            }
        }
    }
    // 4 and 5. Generations, on rank 0 only.
    for (runner_id, runner) in runners.iter().filter(|(_, r)| r.rank == 0) {
        if let Some(task_id) = &runner.task_id {
            let cancelled = state
                .tasks
                .get(task_id)
                .is_none_or(|t| t.status == TaskStatus::Cancelled as i32);
            let step = Step::Cancel {
                runner_id: runner_id.clone(),
                task_id: task_id.clone(),
            };
            if cancelled && runner.pending.as_ref() != Some(&step) {
                return Some(step);
            }
            continue;
        }
        if !is_ready(state, runner_id) {
            continue;
        }
        // Oldest first: the master issues time-ordered task ids (UUIDv7)
        // and the state's map is sorted by id.
        let next = state.tasks.values().find(|t| {
            t.instance_id == runner.instance_id
                && t.status == TaskStatus::Pending as i32
                && !t.acknowledged
                && matches!(t.kind, Some(task::Kind::TextGeneration(_)))
        });
        if let Some(task) = next {
            return Some(Step::Forward {
                runner_id: runner_id.clone(),
                task_id: task.task_id.clone(),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_status(state: &mut ClusterState, runner_id: &str, s: Rs) {
        state
            .runners
            .insert(runner_id.to_string(), v1::RunnerStatus { state: Some(s) });
    }
    use tessera_protos::v1::{
        self, Instance, InstanceRank, RunnerConnected, RunnerFailed, RunnerIdle, RunnerLoaded,
        RunnerReady, Task, TextGenerationTask,
    };

    fn instance(id: &str, nodes: &[&str]) -> Instance {
        Instance {
            instance_id: id.into(),
            ranks: nodes
                .iter()
                .enumerate()
                .map(|(rank, node)| InstanceRank {
                    rank: rank as u32,
                    node_id: node.to_string(),
                    runner_id: format!("{id}-r{rank}"),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn state(instances: &[Instance]) -> ClusterState {
        ClusterState {
            instances: instances
                .iter()
                .map(|i| (i.instance_id.clone(), i.clone()))
                .collect(),
            ..Default::default()
        }
    }

    fn local(instance: &str, rank: u32) -> LocalRunner {
        LocalRunner {
            instance_id: instance.into(),
            rank,
            pending: None,
            task_id: None,
        }
    }

    fn runners(list: &[(&str, LocalRunner)]) -> BTreeMap<String, LocalRunner> {
        list.iter()
            .map(|(id, r)| (id.to_string(), r.clone()))
            .collect()
    }

    #[test]
    fn a_placed_rank_gets_a_runner_and_a_single_rank_loads_at_once() {
        let s = state(&[instance("i", &["n1"])]);
        assert_eq!(
            plan(&s, "n1", &BTreeMap::new()),
            Some(Step::CreateRunner {
                instance_id: "i".into(),
                runner_id: "i-r0".into(),
                rank: 0
            })
        );
        assert_eq!(plan(&s, "n2", &BTreeMap::new()), None, "not placed on n2");
        let mine = runners(&[("i-r0", local("i", 0))]);
        assert_eq!(
            plan(&s, "n1", &mine),
            Some(Step::Load {
                runner_id: "i-r0".into()
            })
        );
    }

    #[test]
    fn ranks_connect_together_then_load_then_warm_up_together() {
        let mut s = state(&[instance("i", &["n1", "n2"])]);
        let mine = runners(&[("i-r0", local("i", 0))]);
        // The other rank has no runner yet: wait.
        assert_eq!(plan(&s, "n1", &mine), None);
        with_status(&mut s, "i-r1", Rs::Idle(RunnerIdle {}));
        assert_eq!(
            plan(&s, "n1", &mine),
            Some(Step::Connect {
                runner_id: "i-r0".into()
            })
        );
        with_status(&mut s, "i-r0", Rs::Connected(RunnerConnected {}));
        assert_eq!(
            plan(&s, "n1", &mine),
            Some(Step::Load {
                runner_id: "i-r0".into()
            })
        );
        with_status(&mut s, "i-r0", Rs::Loaded(RunnerLoaded::default()));
        with_status(&mut s, "i-r1", Rs::Connected(RunnerConnected {}));
        assert_eq!(plan(&s, "n1", &mine), None, "rank 1 still loading");
        with_status(&mut s, "i-r1", Rs::Loaded(RunnerLoaded::default()));
        assert_eq!(
            plan(&s, "n1", &mine),
            Some(Step::WarmUp {
                runner_id: "i-r0".into()
            })
        );
        // Already asked: not again.
        let mut asked = mine.clone();
        if let Some(r) = asked.get_mut("i-r0") {
            r.pending = Some(Step::WarmUp {
                runner_id: "i-r0".into(),
            });
        }
        assert_eq!(plan(&s, "n1", &asked), None);
    }

    #[test]
    fn generations_go_to_a_ready_rank_0_and_cancellations_follow() {
        let mut s = state(&[instance("i", &["n1", "n2"])]);
        with_status(&mut s, "i-r0", Rs::Ready(RunnerReady {}));
        with_status(&mut s, "i-r1", Rs::Ready(RunnerReady {}));
        s.tasks.insert(
            "t1".into(),
            Task {
                task_id: "t1".into(),
                instance_id: "i".into(),
                status: TaskStatus::Pending as i32,
                kind: Some(task::Kind::TextGeneration(TextGenerationTask::default())),
                ..Default::default()
            },
        );
        let rank0 = runners(&[("i-r0", local("i", 0))]);
        let rank1 = runners(&[("i-r1", local("i", 1))]);
        assert_eq!(
            plan(&s, "n1", &rank0),
            Some(Step::Forward {
                runner_id: "i-r0".into(),
                task_id: "t1".into()
            })
        );
        assert_eq!(plan(&s, "n2", &rank1), None, "rank 1 follows rank 0");
        let mut busy = rank0.clone();
        if let Some(r) = busy.get_mut("i-r0") {
            r.task_id = Some("t1".into());
        }
        assert_eq!(plan(&s, "n1", &busy), None);
        if let Some(t) = s.tasks.get_mut("t1") {
            t.status = TaskStatus::Cancelled as i32;
        }
        assert_eq!(
            plan(&s, "n1", &busy),
            Some(Step::Cancel {
                runner_id: "i-r0".into(),
                task_id: "t1".into()
            })
        );
    }

    #[test]
    fn orphaned_and_failed_runners_are_shut_down_once() {
        let mut s = state(&[instance("i", &["n1"])]);
        let mine = runners(&[("gone-r0", local("gone", 0)), ("i-r0", local("i", 0))]);
        assert_eq!(
            plan(&s, "n1", &mine),
            Some(Step::Shutdown {
                runner_id: "gone-r0".into()
            })
        );
        let only = runners(&[("i-r0", local("i", 0))]);
        with_status(
            &mut s,
            "i-r0",
            Rs::Failed(RunnerFailed {
                reason: "out of memory".into(),
                diagnostics: String::new(),
            }),
        );
        assert_eq!(
            plan(&s, "n1", &only),
            Some(Step::Shutdown {
                runner_id: "i-r0".into()
            })
        );
        let mut asked = only.clone();
        if let Some(r) = asked.get_mut("i-r0") {
            r.pending = Some(Step::Shutdown {
                runner_id: "i-r0".into(),
            });
        }
        assert_eq!(plan(&s, "n1", &asked), None);
    }
}
