//! The worker's next step: a pure function of the cluster state, this node
//! and the runners it has started, unit-tested without actors.
//!
//! One step at a time, first match wins:
//! 1. shut down a local runner whose instance is gone (or that failed: the
//!    supervisor restarts it with backoff once it is gone);
//! 2. downloads: act on each delete, cancel and start request in the log
//!    once; download the files each rank placed here needs (and rank 0's
//!    draft model, whole); cancel a
//!    download no instance here needs any more (unless it was asked for);
//! 3. create a runner for each rank of an instance placed on this node once
//!    its files are here (so a runner exists only where the files are, and
//!    ranks connect, hence load, only once every node has its files);
//! 4. bring each runner along its state machine: connect once every rank of
//!    its instance has a runner (ranks connect together), load once
//!    connected (or at once with a single rank), warm up once every rank
//!    has loaded (warm-up runs all ranks together);
//!    then tell a ready rank-0 runner the instance's draft when its status
//!    names another (a draft model once its files are here);
//! 5. hand a pending generation to the rank-0 runner once it is ready
//!    (other ranks follow rank 0 through the ring, they need no task);
//! 6. cancel a generation whose task was cancelled while it runs.
//!
//! Runner statuses are read from the state (each change is an event), so
//! every node plans from the same facts.

use std::collections::{BTreeMap, BTreeSet};

use tessera_protos::v1::{
    self, download_progress::State as Ds, runner_status::State as Rs, task, ClusterState,
    TaskStatus,
};

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
    /// Rank 0: use this draft from now on (`None`: none).
    SetDraft {
        runner_id: String,
        draft: Option<Draft>,
    },
    /// Bring in the files of `parts` of a model.
    Download {
        model_id: String,
        parts: BTreeSet<Part>,
        /// The instance that needs it, if one does.
        instance_id: Option<String>,
        /// The StartDownload request it answers, if one asked.
        request_id: Option<String>,
    },
    /// Stop a download (or record that a stale one is not running).
    CancelDownload {
        model_id: String,
        request_id: Option<String>,
    },
    /// Delete a model's files from the writable folders.
    DeleteDownload {
        model_id: String,
        request_id: String,
    },
}

/// An instance's speculative decoding as the plan compares it: what the
/// instance asks for against what rank 0's status says it was told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Draft {
    pub method: v1::DraftMethod,
    /// The draft model's id (empty for prompt lookup).
    pub model_id: String,
    pub tokens: u32,
}

impl Draft {
    /// The draft an instance asks for (method unspecified: none).
    pub fn of_instance(instance: &v1::Instance) -> Option<Self> {
        let d = instance.draft.as_ref()?;
        (d.method() != v1::DraftMethod::Unspecified).then(|| Self {
            method: d.method(),
            model_id: d.draft_model.clone(),
            tokens: d.num_draft_tokens,
        })
    }

    /// The draft rank 0's status names, whether it runs or was refused.
    pub fn of_status(status: Option<&Rs>) -> Option<Self> {
        let d = match status {
            Some(Rs::Ready(r)) => r.draft.as_ref(),
            Some(Rs::Running(r)) => r.draft.as_ref(),
            _ => None,
        }?;
        Some(Self {
            method: d.method(),
            model_id: d.draft_model.clone(),
            tokens: d.num_draft_tokens,
        })
    }

    /// The draft model to download, if it is one.
    pub fn model(&self) -> Option<&str> {
        (self.method == v1::DraftMethod::DraftModel).then_some(self.model_id.as_str())
    }

    pub fn to_proto(&self) -> v1::InstanceDraft {
        v1::InstanceDraft {
            method: self.method as i32,
            draft_model: self.model_id.clone(),
            num_draft_tokens: self.tokens,
            draft_card: None,
        }
    }
}

/// What rank 0's status says of `instance`'s draft, once it names the one
/// the instance asks for: `Some(None)` for none, `Some(Some(d))` for a
/// draft set or refused; `None` while it does not yet.
pub fn rank0_draft(
    state: &v1::ClusterState,
    instance: &v1::Instance,
) -> Option<Option<v1::RunnerDraft>> {
    let status = instance
        .ranks
        .first()
        .and_then(|r| state.runners.get(&r.runner_id))
        .and_then(|s| s.state.as_ref());
    if Draft::of_status(status) != Draft::of_instance(instance) {
        return None;
    }
    Some(match status {
        Some(v1::runner_status::State::Ready(r)) => r.draft.clone(),
        Some(v1::runner_status::State::Running(r)) => r.draft.clone(),
        _ => None,
    })
}

/// The part of a model whose files a node needs.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    /// Every layer (the whole model, or a tensor-parallel slice of all).
    Whole,
    Layers {
        start: u32,
        end: u32,
        n_layers: u32,
    },
}

impl Part {
    pub fn of(shard: Option<&v1::ShardSpec>) -> Self {
        match shard.and_then(|s| s.kind.as_ref()) {
            // A stage of every layer (a one-node instance) needs everything.
            Some(v1::shard_spec::Kind::Pipeline(p))
                if p.start_layer == 0 && p.end_layer >= p.n_layers =>
            {
                Self::Whole
            }
            Some(v1::shard_spec::Kind::Pipeline(p)) => Self::Layers {
                start: p.start_layer,
                end: p.end_layer,
                n_layers: p.n_layers,
            },
            _ => Self::Whole,
        }
    }

    pub fn to_proto(&self) -> Option<v1::ShardSpec> {
        match self {
            Self::Whole => None,
            Self::Layers {
                start,
                end,
                n_layers,
            } => Some(v1::ShardSpec {
                kind: Some(v1::shard_spec::Kind::Pipeline(v1::PipelineShard {
                    start_layer: *start,
                    end_layer: *end,
                    n_layers: *n_layers,
                })),
            }),
        }
    }

    /// Whether this part's files include `other`'s.
    pub fn covers(&self, other: &Part) -> bool {
        match (self, other) {
            (Self::Whole, _) => true,
            (Self::Layers { .. }, Self::Whole) => false,
            (
                Self::Layers { start, end, .. },
                Self::Layers {
                    start: s, end: e, ..
                },
            ) => start <= s && e <= end,
        }
    }
}

/// Where a local download stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Running,
    Done,
    Failed,
    Cancelled,
}

/// What the worker knows of a model's download on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalDownload {
    pub parts: BTreeSet<Part>,
    pub phase: Phase,
    /// Asked for with StartDownload: kept even when no instance needs it.
    pub explicit: bool,
    /// Instances it was started for (a failed download is tried again for
    /// a new instance, not again and again for the same one).
    pub tried_for: BTreeSet<String>,
}

impl LocalDownload {
    pub fn has(&self, part: &Part) -> bool {
        self.parts.iter().any(|p| p.covers(part))
    }
}

/// The worker's own download bookkeeping, an input of [`plan`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Downloads {
    pub models: BTreeMap<String, LocalDownload>,
    /// Download requests (command ids) already acted on.
    pub handled: BTreeSet<String>,
}

/// What the worker knows of a runner it started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRunner {
    pub instance_id: String,
    pub rank: u32,
    /// The step last handed to it and not yet reflected in its status, so
    /// the same step is not given twice.
    pub pending: Option<Step>,
    /// The generations it is working on (rank 0), oldest first by id.
    pub tasks: BTreeSet<String>,
    /// Those of them it was told to cancel.
    pub cancelling: BTreeSet<String>,
}

/// Generations an instance runs at once when it names no number.
pub const DEFAULT_MAX_CONCURRENT: u32 = 8;

/// Generations `instance` runs at once.
pub fn max_concurrent(instance: &v1::Instance) -> usize {
    match instance.max_concurrent {
        0 => DEFAULT_MAX_CONCURRENT as usize,
        n => n as usize,
    }
}

/// The runner's state, `None` before its first status event.
fn status<'a>(state: &'a ClusterState, runner_id: &str) -> Option<&'a Rs> {
    state.runners.get(runner_id).and_then(|s| s.state.as_ref())
}

/// Ready for generations: idle, or running a batch with room.
fn takes_generations(state: &ClusterState, runner_id: &str) -> bool {
    matches!(
        status(state, runner_id),
        Some(Rs::Ready(_)) | Some(Rs::Running(_))
    )
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

/// The next step for `node_id`, if any: in this order, the runners to
/// stop, the downloads, the runners to create, each runner's next state,
/// rank 0's draft, and the generations.
pub fn plan(
    state: &ClusterState,
    node_id: &str,
    runners: &BTreeMap<String, LocalRunner>,
    downloads: &Downloads,
) -> Option<Step> {
    stop_orphans(state, runners)
        .or_else(|| plan_downloads(state, node_id, downloads))
        .or_else(|| create_runners(state, node_id, runners, downloads))
        .or_else(|| advance_runners(state, runners))
        .or_else(|| set_drafts(state, runners, downloads))
        .or_else(|| generations(state, runners))
}

/// Step 1: runners without an instance, or failed ones.
fn stop_orphans(state: &ClusterState, runners: &BTreeMap<String, LocalRunner>) -> Option<Step> {
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
    None
}

/// Step 3: ranks placed here without a runner, once their files are here.
fn create_runners(
    state: &ClusterState,
    node_id: &str,
    runners: &BTreeMap<String, LocalRunner>,
    downloads: &Downloads,
) -> Option<Step> {
    for instance in state.instances.values() {
        for rank in instance.ranks.iter().filter(|r| r.node_id == node_id) {
            let files_here = instance.model.as_ref().is_none_or(|m| {
                downloads.models.get(&m.model_id).is_some_and(|d| {
                    d.phase == Phase::Done && d.has(&Part::of(rank.shard.as_ref()))
                })
            });
            if files_here && !runners.contains_key(&rank.runner_id) {
                return Some(Step::CreateRunner {
                    instance_id: instance.instance_id.clone(),
                    runner_id: rank.runner_id.clone(),
                    rank: rank.rank,
                });
            }
        }
    }
    None
}

/// Step 4: each runner along the state machine (connect when every rank
/// has a runner, load, warm up when every rank has loaded).
fn advance_runners(state: &ClusterState, runners: &BTreeMap<String, LocalRunner>) -> Option<Step> {
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
    None
}

/// Step 4, for rank 0: the instance's draft, once it takes generations
/// and the draft model's files are here.
fn set_drafts(
    state: &ClusterState,
    runners: &BTreeMap<String, LocalRunner>,
    downloads: &Downloads,
) -> Option<Step> {
    for (runner_id, runner) in runners.iter().filter(|(_, r)| r.rank == 0) {
        let Some(instance) = state.instances.get(&runner.instance_id) else {
            continue;
        };
        if !takes_generations(state, runner_id) {
            continue;
        }
        let wanted = Draft::of_instance(instance);
        if wanted == Draft::of_status(status(state, runner_id)) {
            continue;
        }
        let files_here = wanted.as_ref().and_then(Draft::model).is_none_or(|model| {
            downloads
                .models
                .get(model)
                .is_some_and(|d| d.phase == Phase::Done && d.has(&Part::Whole))
        });
        let step = Step::SetDraft {
            runner_id: runner_id.clone(),
            draft: wanted,
        };
        if files_here && runner.pending.as_ref() != Some(&step) {
            return Some(step);
        }
    }
    None
}

/// Steps 5 and 6, on rank 0 only: cancellations of what it runs, then the
/// oldest pending tasks while its batch has room.
fn generations(state: &ClusterState, runners: &BTreeMap<String, LocalRunner>) -> Option<Step> {
    for (runner_id, runner) in runners.iter().filter(|(_, r)| r.rank == 0) {
        for task_id in runner.tasks.difference(&runner.cancelling) {
            let cancelled = state
                .tasks
                .get(task_id)
                .is_none_or(|t| t.status == TaskStatus::Cancelled as i32);
            if cancelled {
                return Some(Step::Cancel {
                    runner_id: runner_id.clone(),
                    task_id: task_id.clone(),
                });
            }
        }
        let Some(instance) = state.instances.get(&runner.instance_id) else {
            continue;
        };
        if runner.tasks.len() >= max_concurrent(instance) || !takes_generations(state, runner_id) {
            continue;
        }
        // Oldest first: the master issues time-ordered task ids (UUIDv7)
        // and the state's map is sorted by id.
        let next = state.tasks.values().find(|t| {
            t.instance_id == runner.instance_id
                && t.status == TaskStatus::Pending as i32
                && !t.acknowledged
                && !runner.tasks.contains(&t.task_id)
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

/// Step 2: requests from the log first (each once), then what the
/// instances placed here need, then what nothing needs any more.
fn plan_downloads(state: &ClusterState, node_id: &str, downloads: &Downloads) -> Option<Step> {
    let entries = state.downloads.get(node_id).map(|d| &d.models);
    for (model_id, progress) in entries.into_iter().flatten() {
        let request = |id: &str| !id.is_empty() && !downloads.handled.contains(id);
        match &progress.state {
            Some(Ds::Deleted(d)) if request(&d.request_id) => {
                return Some(Step::DeleteDownload {
                    model_id: model_id.clone(),
                    request_id: d.request_id.clone(),
                })
            }
            Some(Ds::Cancelled(c)) if request(&c.request_id) => {
                return Some(Step::CancelDownload {
                    model_id: model_id.clone(),
                    request_id: Some(c.request_id.clone()),
                })
            }
            Some(Ds::Pending(p)) if request(&p.request_id) => {
                let mut parts: BTreeSet<Part> =
                    progress.shards.iter().map(|s| Part::of(Some(s))).collect();
                if parts.is_empty() {
                    parts.insert(Part::Whole);
                }
                return Some(Step::Download {
                    model_id: model_id.clone(),
                    parts,
                    instance_id: None,
                    request_id: Some(p.request_id.clone()),
                });
            }
            _ => {}
        }
    }
    // What the instances placed here need.
    let mut needed: BTreeSet<&str> = BTreeSet::new();
    for instance in state.instances.values() {
        let Some(model) = &instance.model else {
            continue;
        };
        let draft = instance
            .draft
            .as_ref()
            .filter(|d| d.method() == v1::DraftMethod::DraftModel && !d.draft_model.is_empty());
        for rank in instance.ranks.iter().filter(|r| r.node_id == node_id) {
            needed.insert(&model.model_id);
            // Rank 0's draft model, whole, besides its shard.
            let mut wants = vec![(model.model_id.as_str(), Part::of(rank.shard.as_ref()))];
            if let Some(draft) = draft.filter(|_| rank.rank == 0) {
                needed.insert(&draft.draft_model);
                wants.push((draft.draft_model.as_str(), Part::Whole));
            }
            for (model_id, part) in wants {
                if let Some(step) = wanted_download(downloads, instance, model_id, part) {
                    return Some(step);
                }
            }
        }
    }
    stale_downloads(state, node_id, downloads, &needed)
}

/// The download that brings `part` of `model_id` here for `instance`, if
/// one must start (none runs, the files lack it, or one failed for
/// another instance).
fn wanted_download(
    downloads: &Downloads,
    instance: &v1::Instance,
    model_id: &str,
    part: Part,
) -> Option<Step> {
    let local = downloads.models.get(model_id);
    let retry = |d: &LocalDownload| {
        matches!(d.phase, Phase::Failed | Phase::Cancelled)
            && !d.tried_for.contains(&instance.instance_id)
    };
    let parts = match local {
        None => BTreeSet::from([part]),
        Some(d) if d.phase == Phase::Running => return None,
        Some(d) if !d.has(&part) || retry(d) => {
            let mut parts = d.parts.clone();
            parts.insert(part);
            parts
        }
        Some(_) => return None,
    };
    Some(Step::Download {
        model_id: model_id.to_string(),
        parts,
        instance_id: Some(instance.instance_id.clone()),
        request_id: None,
    })
}

/// Downloads nothing needs any more, and stale ones from before a restart
/// that this node is not running.
fn stale_downloads(
    state: &ClusterState,
    node_id: &str,
    downloads: &Downloads,
    needed: &BTreeSet<&str>,
) -> Option<Step> {
    let entries = state.downloads.get(node_id).map(|d| &d.models);
    for (model_id, local) in &downloads.models {
        if local.phase == Phase::Running && !local.explicit && !needed.contains(model_id.as_str()) {
            return Some(Step::CancelDownload {
                model_id: model_id.clone(),
                request_id: None,
            });
        }
    }
    for (model_id, progress) in entries.into_iter().flatten() {
        if matches!(progress.state, Some(Ds::Ongoing(_)))
            && !downloads.models.contains_key(model_id)
        {
            return Some(Step::CancelDownload {
                model_id: model_id.clone(),
                request_id: None,
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
            max_concurrent: 0,
            ring_secret: Vec::new(),
            ring_sealed: false,
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
            tasks: BTreeSet::new(),
            cancelling: BTreeSet::new(),
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
            plan(&s, "n1", &BTreeMap::new(), &Downloads::default()),
            Some(Step::CreateRunner {
                instance_id: "i".into(),
                runner_id: "i-r0".into(),
                rank: 0
            })
        );
        assert_eq!(
            plan(&s, "n2", &BTreeMap::new(), &Downloads::default()),
            None,
            "not placed on n2"
        );
        let mine = runners(&[("i-r0", local("i", 0))]);
        assert_eq!(
            plan(&s, "n1", &mine, &Downloads::default()),
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
        assert_eq!(plan(&s, "n1", &mine, &Downloads::default()), None);
        with_status(&mut s, "i-r1", Rs::Idle(RunnerIdle {}));
        assert_eq!(
            plan(&s, "n1", &mine, &Downloads::default()),
            Some(Step::Connect {
                runner_id: "i-r0".into()
            })
        );
        with_status(&mut s, "i-r0", Rs::Connected(RunnerConnected {}));
        assert_eq!(
            plan(&s, "n1", &mine, &Downloads::default()),
            Some(Step::Load {
                runner_id: "i-r0".into()
            })
        );
        with_status(&mut s, "i-r0", Rs::Loaded(RunnerLoaded::default()));
        with_status(&mut s, "i-r1", Rs::Connected(RunnerConnected {}));
        assert_eq!(
            plan(&s, "n1", &mine, &Downloads::default()),
            None,
            "rank 1 still loading"
        );
        with_status(&mut s, "i-r1", Rs::Loaded(RunnerLoaded::default()));
        assert_eq!(
            plan(&s, "n1", &mine, &Downloads::default()),
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
        assert_eq!(plan(&s, "n1", &asked, &Downloads::default()), None);
    }

    #[test]
    fn generations_go_to_a_ready_rank_0_and_cancellations_follow() {
        let mut s = state(&[instance("i", &["n1", "n2"])]);
        with_status(&mut s, "i-r0", Rs::Ready(RunnerReady::default()));
        with_status(&mut s, "i-r1", Rs::Ready(RunnerReady::default()));
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
            plan(&s, "n1", &rank0, &Downloads::default()),
            Some(Step::Forward {
                runner_id: "i-r0".into(),
                task_id: "t1".into()
            })
        );
        assert_eq!(
            plan(&s, "n2", &rank1, &Downloads::default()),
            None,
            "rank 1 follows rank 0"
        );
        let mut busy = rank0.clone();
        if let Some(r) = busy.get_mut("i-r0") {
            r.tasks.insert("t1".into());
        }
        assert_eq!(plan(&s, "n1", &busy, &Downloads::default()), None);
        // A second task joins the batch while the first runs.
        with_status(
            &mut s,
            "i-r0",
            Rs::Running(v1::RunnerRunning {
                task_id: "t1".into(),
                task_ids: vec!["t1".into()],
                ..Default::default()
            }),
        );
        s.tasks.insert(
            "t2".into(),
            Task {
                task_id: "t2".into(),
                instance_id: "i".into(),
                status: TaskStatus::Pending as i32,
                kind: Some(task::Kind::TextGeneration(TextGenerationTask::default())),
                ..Default::default()
            },
        );
        assert_eq!(
            plan(&s, "n1", &busy, &Downloads::default()),
            Some(Step::Forward {
                runner_id: "i-r0".into(),
                task_id: "t2".into()
            })
        );
        // A full batch takes no more.
        if let Some(i) = s.instances.get_mut("i") {
            i.max_concurrent = 1;
        }
        assert_eq!(plan(&s, "n1", &busy, &Downloads::default()), None);
        if let Some(t) = s.tasks.get_mut("t1") {
            t.status = TaskStatus::Cancelled as i32;
        }
        assert_eq!(
            plan(&s, "n1", &busy, &Downloads::default()),
            Some(Step::Cancel {
                runner_id: "i-r0".into(),
                task_id: "t1".into()
            })
        );
        // Told once: not again.
        if let Some(r) = busy.get_mut("i-r0") {
            r.cancelling.insert("t1".into());
        }
        assert_eq!(plan(&s, "n1", &busy, &Downloads::default()), None);
    }

    #[test]
    fn orphaned_and_failed_runners_are_shut_down_once() {
        let mut s = state(&[instance("i", &["n1"])]);
        let mine = runners(&[("gone-r0", local("gone", 0)), ("i-r0", local("i", 0))]);
        assert_eq!(
            plan(&s, "n1", &mine, &Downloads::default()),
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
            plan(&s, "n1", &only, &Downloads::default()),
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
        assert_eq!(plan(&s, "n1", &asked, &Downloads::default()), None);
    }

    fn with_model(mut i: Instance, model: &str) -> Instance {
        i.model = Some(v1::ModelCard {
            model_id: model.into(),
            n_layers: 4,
            ..Default::default()
        });
        for (rank, r) in i.ranks.iter_mut().enumerate() {
            r.shard = Part::Layers {
                start: rank as u32 * 2,
                end: rank as u32 * 2 + 2,
                n_layers: 4,
            }
            .to_proto();
        }
        i
    }

    fn local_download(parts: &[Part], phase: Phase, explicit: bool) -> LocalDownload {
        LocalDownload {
            parts: parts.iter().cloned().collect(),
            phase,
            explicit,
            tried_for: BTreeSet::from(["i".to_string()]),
        }
    }

    fn downloads(model: &str, d: LocalDownload) -> Downloads {
        Downloads {
            models: BTreeMap::from([(model.to_string(), d)]),
            handled: BTreeSet::new(),
        }
    }

    fn entry(s: &mut ClusterState, node: &str, model: &str, state: Ds) {
        s.downloads.entry(node.into()).or_default().models.insert(
            model.into(),
            v1::DownloadProgress {
                model_id: model.into(),
                state: Some(state),
                shards: Vec::new(),
            },
        );
    }

    #[test]
    fn a_rank_downloads_its_part_before_it_gets_a_runner() {
        let s = state(&[with_model(instance("i", &["n1", "n2"]), "m")]);
        let second_half = Part::Layers {
            start: 2,
            end: 4,
            n_layers: 4,
        };
        assert_eq!(
            plan(&s, "n2", &BTreeMap::new(), &Downloads::default()),
            Some(Step::Download {
                model_id: "m".into(),
                parts: BTreeSet::from([second_half.clone()]),
                instance_id: Some("i".into()),
                request_id: None,
            })
        );
        let running = downloads(
            "m",
            local_download(std::slice::from_ref(&second_half), Phase::Running, false),
        );
        assert_eq!(
            plan(&s, "n2", &BTreeMap::new(), &running),
            None,
            "no runner while files come"
        );
        let done = downloads("m", local_download(&[Part::Whole], Phase::Done, false));
        assert_eq!(
            plan(&s, "n2", &BTreeMap::new(), &done),
            Some(Step::CreateRunner {
                instance_id: "i".into(),
                runner_id: "i-r1".into(),
                rank: 1
            }),
            "the whole model covers any part"
        );
        // Files of another part do not count: the union is fetched.
        let other = downloads(
            "m",
            local_download(
                &[Part::Layers {
                    start: 0,
                    end: 2,
                    n_layers: 4,
                }],
                Phase::Done,
                false,
            ),
        );
        assert!(matches!(
            plan(&s, "n2", &BTreeMap::new(), &other),
            Some(Step::Download { parts, .. }) if parts.len() == 2
        ));
    }

    #[test]
    fn rank_0_downloads_its_draft_model_then_is_told_the_draft_until_its_status_names_it() {
        let mut placed = with_model(instance("i", &["n1", "n2"]), "m");
        placed.draft = Some(v1::InstanceDraft {
            method: v1::DraftMethod::DraftModel as i32,
            draft_model: "small".into(),
            num_draft_tokens: 4,
            draft_card: None,
        });
        let mut s = state(&[placed]);
        with_status(&mut s, "i-r0", Rs::Ready(RunnerReady::default()));
        with_status(&mut s, "i-r1", Rs::Ready(RunnerReady::default()));
        let first_half = Part::Layers {
            start: 0,
            end: 2,
            n_layers: 4,
        };
        let rank0 = runners(&[("i-r0", local("i", 0))]);
        let rank1 = runners(&[("i-r1", local("i", 1))]);
        let mut held = downloads("m", local_download(&[first_half], Phase::Done, false));
        // Rank 0's node fetches the draft, whole; rank 1's does not.
        assert_eq!(
            plan(&s, "n1", &rank0, &held),
            Some(Step::Download {
                model_id: "small".into(),
                parts: BTreeSet::from([Part::Whole]),
                instance_id: Some("i".into()),
                request_id: None,
            })
        );
        let second_half = downloads(
            "m",
            local_download(
                &[Part::Layers {
                    start: 2,
                    end: 4,
                    n_layers: 4,
                }],
                Phase::Done,
                false,
            ),
        );
        assert_eq!(plan(&s, "n2", &rank1, &second_half), None);
        // While it comes, nothing is told (and it is not cancelled).
        held.models.insert(
            "small".into(),
            local_download(&[Part::Whole], Phase::Running, false),
        );
        assert_eq!(plan(&s, "n1", &rank0, &held), None);
        held.models.insert(
            "small".into(),
            local_download(&[Part::Whole], Phase::Done, false),
        );
        let wanted = Draft {
            method: v1::DraftMethod::DraftModel,
            model_id: "small".into(),
            tokens: 4,
        };
        let step = Step::SetDraft {
            runner_id: "i-r0".into(),
            draft: Some(wanted.clone()),
        };
        assert_eq!(plan(&s, "n1", &rank0, &held), Some(step.clone()));
        // Told once.
        let mut told = rank0.clone();
        if let Some(r) = told.get_mut("i-r0") {
            r.pending = Some(step);
        }
        assert_eq!(plan(&s, "n1", &told, &held), None);
        // Its status names it (even as refused): nothing more to tell.
        let reported = v1::RunnerDraft {
            method: v1::DraftMethod::DraftModel as i32,
            draft_model: "small".into(),
            num_draft_tokens: 4,
            active: false,
            error: "another vocabulary".into(),
            resident_bytes: 0,
        };
        with_status(
            &mut s,
            "i-r0",
            Rs::Ready(RunnerReady {
                draft: Some(reported),
                ..Default::default()
            }),
        );
        assert_eq!(
            Draft::of_status(s.runners["i-r0"].state.as_ref()),
            Some(wanted)
        );
        assert_eq!(plan(&s, "n1", &rank0, &held), None);
        // Cleared on the instance: rank 0 is told none.
        if let Some(i) = s.instances.get_mut("i") {
            i.draft = None;
        }
        assert_eq!(
            plan(&s, "n1", &rank0, &held),
            Some(Step::SetDraft {
                runner_id: "i-r0".into(),
                draft: None,
            })
        );
        // Prompt lookup needs no files.
        if let Some(i) = s.instances.get_mut("i") {
            i.draft = Some(v1::InstanceDraft {
                method: v1::DraftMethod::Ngram as i32,
                num_draft_tokens: 6,
                ..Default::default()
            });
        }
        let only_target = downloads(
            "m",
            local_download(
                &[Part::Layers {
                    start: 0,
                    end: 2,
                    n_layers: 4,
                }],
                Phase::Done,
                false,
            ),
        );
        assert!(matches!(
            plan(&s, "n1", &rank0, &only_target),
            Some(Step::SetDraft {
                draft: Some(Draft {
                    method: v1::DraftMethod::Ngram,
                    tokens: 6,
                    ..
                }),
                ..
            })
        ));
    }

    #[test]
    fn rank_0s_report_counts_once_it_names_the_instances_draft() {
        let draft = v1::InstanceDraft {
            method: v1::DraftMethod::Ngram as i32,
            num_draft_tokens: 4,
            ..Default::default()
        };
        let instance = v1::Instance {
            instance_id: "i".into(),
            ranks: vec![v1::InstanceRank {
                runner_id: "r0".into(),
                ..Default::default()
            }],
            draft: Some(draft),
            ..Default::default()
        };
        let mut state = ClusterState::default();
        let ready = |draft: Option<v1::RunnerDraft>| v1::RunnerStatus {
            state: Some(v1::runner_status::State::Ready(v1::RunnerReady {
                ended_task_ids: Vec::new(),
                draft,
            })),
        };
        state.runners.insert("r0".into(), ready(None));
        assert_eq!(rank0_draft(&state, &instance), None, "not yet");
        let report = v1::RunnerDraft {
            method: v1::DraftMethod::Ngram as i32,
            num_draft_tokens: 4,
            active: true,
            ..Default::default()
        };
        state
            .runners
            .insert("r0".into(), ready(Some(report.clone())));
        assert_eq!(rank0_draft(&state, &instance), Some(Some(report)));
        let off = v1::Instance {
            draft: None,
            ..instance
        };
        assert_eq!(rank0_draft(&state, &off), None, "still drafting");
        state.runners.insert("r0".into(), ready(None));
        assert_eq!(rank0_draft(&state, &off), Some(None));
    }

    #[test]
    fn requests_in_the_log_are_acted_on_once() {
        let mut s = state(&[]);
        entry(
            &mut s,
            "n1",
            "m",
            Ds::Pending(v1::DownloadPending {
                total_bytes: 1,
                request_id: "c1".into(),
            }),
        );
        let step = plan(&s, "n1", &BTreeMap::new(), &Downloads::default());
        assert_eq!(
            step,
            Some(Step::Download {
                model_id: "m".into(),
                parts: BTreeSet::from([Part::Whole]),
                instance_id: None,
                request_id: Some("c1".into()),
            })
        );
        let mut handled = downloads("m", local_download(&[Part::Whole], Phase::Running, true));
        handled.handled.insert("c1".into());
        assert_eq!(
            plan(&s, "n1", &BTreeMap::new(), &handled),
            None,
            "explicit: kept"
        );
        entry(
            &mut s,
            "n1",
            "m",
            Ds::Cancelled(v1::DownloadCancelled {
                request_id: "c2".into(),
            }),
        );
        assert_eq!(
            plan(&s, "n1", &BTreeMap::new(), &handled),
            Some(Step::CancelDownload {
                model_id: "m".into(),
                request_id: Some("c2".into())
            })
        );
        entry(
            &mut s,
            "n1",
            "m",
            Ds::Deleted(v1::DownloadDeleted {
                request_id: "c3".into(),
            }),
        );
        assert_eq!(
            plan(&s, "n1", &BTreeMap::new(), &handled),
            Some(Step::DeleteDownload {
                model_id: "m".into(),
                request_id: "c3".into()
            })
        );
    }

    #[test]
    fn downloads_nothing_needs_are_cancelled_and_failures_retried_for_new_instances() {
        let s = state(&[]);
        let orphan = downloads("m", local_download(&[Part::Whole], Phase::Running, false));
        assert_eq!(
            plan(&s, "n1", &BTreeMap::new(), &orphan),
            Some(Step::CancelDownload {
                model_id: "m".into(),
                request_id: None
            })
        );
        let mut stale = state(&[]);
        entry(
            &mut stale,
            "n1",
            "m",
            Ds::Ongoing(v1::DownloadOngoing::default()),
        );
        assert_eq!(
            plan(&stale, "n1", &BTreeMap::new(), &Downloads::default()),
            Some(Step::CancelDownload {
                model_id: "m".into(),
                request_id: None
            }),
            "a download from before a restart that nothing runs"
        );
        // Failed for instance "i": not again for it, but for a new one.
        let failed = downloads("m", local_download(&[Part::Whole], Phase::Failed, false));
        let same = state(&[with_model(instance("i", &["n1"]), "m")]);
        assert_eq!(plan(&same, "n1", &BTreeMap::new(), &failed), None);
        let fresh = state(&[with_model(instance("j", &["n1"]), "m")]);
        assert!(matches!(
            plan(&fresh, "n1", &BTreeMap::new(), &failed),
            Some(Step::Download { instance_id: Some(id), .. }) if id == "j"
        ));
    }
}
