//! What a node's worker and its `tessera runner` child processes say to each
//! other over zenoh (`tessera/{ns}/runner/{runner_id}/…`, see
//! `protos/README.md`): the worker puts a `Task` on `tasks`, the runner puts
//! its `RunnerStatus` on `events`; rank 0 puts generation chunks straight on
//! `chunks/{command_id}`. The worker learns of a child's death from the
//! process itself, not from a missing message, so it needs no timeout.

use std::path::PathBuf;

use tessera_protos::v1::{self, task::Kind};

use crate::worker::plan::Step;

/// Rank 0's speculative decoding, as the runner is told it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftOrder {
    pub method: v1::DraftMethod,
    /// The draft model's id (empty for prompt lookup).
    pub model_id: String,
    /// The most tokens drafted per step for one sequence.
    pub tokens: u32,
    /// A draft model's files on the node.
    pub path: Option<PathBuf>,
}

/// An order, as the runner reads it.
#[derive(Clone, Debug, PartialEq)]
pub enum Order {
    /// Join the instance's ring (multi-rank instances).
    Connect,
    /// Load this rank's shard.
    Load,
    /// Warm up; ranks other than 0 then follow rank 0's steps.
    WarmUp,
    /// Rank 0: run a generation, streaming chunks.
    Generate {
        task_id: String,
        command_id: String,
        params: Box<v1::TextGenerationParams>,
    },
    /// Rank 0: stop the generation of `task_id`.
    Cancel { task_id: String },
    /// Rank 0: draft this way from now on (`None`: no speculation).
    SetDraft(Option<DraftOrder>),
    /// Stop and exit.
    Shutdown,
}

/// The task a worker sends its runner for a step of the plan; `generation`
/// is the task being forwarded, for [`Step::Forward`]. None for steps the
/// worker takes itself (creating the runner).
pub fn task_for_step(step: &Step, generation: Option<&v1::Task>) -> Option<v1::Task> {
    let bare = |kind: Kind| v1::Task {
        kind: Some(kind),
        ..Default::default()
    };
    Some(match step {
        Step::CreateRunner { .. }
        | Step::Download { .. }
        | Step::CancelDownload { .. }
        | Step::DeleteDownload { .. } => return None,
        Step::Connect { runner_id } => bare(Kind::ConnectToGroup(v1::ConnectToGroupTask {
            runner_id: runner_id.clone(),
        })),
        Step::Load { runner_id } => bare(Kind::LoadModel(v1::LoadModelTask {
            runner_id: runner_id.clone(),
        })),
        Step::WarmUp { runner_id } => bare(Kind::StartWarmup(v1::StartWarmupTask {
            runner_id: runner_id.clone(),
        })),
        Step::Forward { task_id, .. } => {
            let task = generation?;
            if task.task_id != *task_id {
                return None;
            }
            task.clone()
        }
        Step::Cancel { task_id, .. } => bare(Kind::CancelTask(v1::CancelTaskTask {
            target_task_id: task_id.clone(),
        })),
        Step::Shutdown { runner_id } => bare(Kind::Shutdown(v1::ShutdownTask {
            runner_id: runner_id.clone(),
        })),
        // The worker adds the draft model's path, which it knows.
        Step::SetDraft { runner_id, draft } => bare(Kind::SetDraft(v1::SetDraftTask {
            runner_id: runner_id.clone(),
            draft: draft.as_ref().map(crate::worker::plan::Draft::to_proto),
            draft_path: String::new(),
        })),
    })
}

/// Why a task is not an order a runner can follow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OrderError {
    #[error("the task has no kind")]
    Empty,
    #[error("a {0} task is not for a runner")]
    NotForARunner(&'static str),
    #[error("the generation task has no parameters")]
    NoParams,
    #[error("a draft_model draft names no model")]
    NoDraftModel,
    #[error("a draft of {0} tokens (1 to 16)")]
    DraftTokens(u32),
}

/// The order a task stands for.
pub fn order_from_task(task: &v1::Task) -> Result<Order, OrderError> {
    match &task.kind {
        None => Err(OrderError::Empty),
        Some(Kind::ConnectToGroup(_)) => Ok(Order::Connect),
        Some(Kind::LoadModel(_)) => Ok(Order::Load),
        Some(Kind::StartWarmup(_)) => Ok(Order::WarmUp),
        Some(Kind::TextGeneration(generation)) => Ok(Order::Generate {
            task_id: task.task_id.clone(),
            command_id: task.command_id.clone(),
            params: Box::new(generation.params.clone().ok_or(OrderError::NoParams)?),
        }),
        Some(Kind::CancelTask(cancel)) => Ok(Order::Cancel {
            task_id: cancel.target_task_id.clone(),
        }),
        Some(Kind::Shutdown(_)) => Ok(Order::Shutdown),
        Some(Kind::SetDraft(set)) => draft_order(set).map(Order::SetDraft),
        Some(Kind::CreateRunner(_)) => Err(OrderError::NotForARunner("create-runner")),
        Some(Kind::DownloadModel(_)) => Err(OrderError::NotForARunner("download")),
    }
}

/// The draft a SetDraft task names (none, or method unspecified: none).
fn draft_order(task: &v1::SetDraftTask) -> Result<Option<DraftOrder>, OrderError> {
    let Some(draft) = task
        .draft
        .as_ref()
        .filter(|d| d.method() != v1::DraftMethod::Unspecified)
    else {
        return Ok(None);
    };
    let most = tessera_engine::serve::speculative::MAX_DRAFT_TOKENS as u32;
    if !(1..=most).contains(&draft.num_draft_tokens) {
        return Err(OrderError::DraftTokens(draft.num_draft_tokens));
    }
    let model = draft.method() == v1::DraftMethod::DraftModel;
    if model && draft.draft_model.is_empty() {
        return Err(OrderError::NoDraftModel);
    }
    Ok(Some(DraftOrder {
        method: draft.method(),
        model_id: if model {
            draft.draft_model.clone()
        } else {
            String::new()
        },
        tokens: draft.num_draft_tokens,
        path: (model && !task.draft_path.is_empty()).then(|| PathBuf::from(&task.draft_path)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_runner_step_becomes_a_task_and_back_the_same_order() {
        let r = || "r1".to_string();
        let generation = v1::Task {
            task_id: "t".into(),
            command_id: "c".into(),
            kind: Some(Kind::TextGeneration(v1::TextGenerationTask {
                params: Some(v1::TextGenerationParams {
                    model_id: "m".into(),
                    raw_prompt: Some("hi".into()),
                    ..Default::default()
                }),
                reply_node_id: "n".into(),
            })),
            ..Default::default()
        };
        let cases = [
            (Step::Connect { runner_id: r() }, Order::Connect),
            (Step::Load { runner_id: r() }, Order::Load),
            (Step::WarmUp { runner_id: r() }, Order::WarmUp),
            (
                Step::Cancel {
                    runner_id: r(),
                    task_id: "t".into(),
                },
                Order::Cancel {
                    task_id: "t".into(),
                },
            ),
            (Step::Shutdown { runner_id: r() }, Order::Shutdown),
        ];
        for (step, order) in cases {
            let task = task_for_step(&step, None);
            assert_eq!(
                task.as_ref().map(order_from_task),
                Some(Ok(order)),
                "{step:?}"
            );
        }
        let forward = Step::Forward {
            runner_id: r(),
            task_id: "t".into(),
        };
        let task = task_for_step(&forward, Some(&generation));
        assert!(matches!(
            task.as_ref().map(order_from_task),
            Some(Ok(Order::Generate { ref task_id, ref command_id, .. }))
                if task_id == "t" && command_id == "c"
        ));
        // The wrong task, or none, is not forwarded.
        assert_eq!(task_for_step(&forward, None), None);
        let other = v1::Task {
            task_id: "u".into(),
            ..generation.clone()
        };
        assert_eq!(task_for_step(&forward, Some(&other)), None);
        let create = Step::CreateRunner {
            instance_id: "i".into(),
            runner_id: r(),
            rank: 0,
        };
        assert_eq!(task_for_step(&create, None), None);
    }

    #[test]
    fn a_draft_step_becomes_a_set_draft_order_with_the_path_the_worker_adds() {
        let step = Step::SetDraft {
            runner_id: "r".into(),
            draft: Some(crate::worker::plan::Draft {
                method: v1::DraftMethod::DraftModel,
                model_id: "small".into(),
                tokens: 5,
            }),
        };
        let mut task = task_for_step(&step, None).expect("a task");
        if let Some(Kind::SetDraft(set)) = task.kind.as_mut() {
            set.draft_path = "/models/small.gguf".into();
        }
        assert_eq!(
            order_from_task(&task),
            Ok(Order::SetDraft(Some(DraftOrder {
                method: v1::DraftMethod::DraftModel,
                model_id: "small".into(),
                tokens: 5,
                path: Some(PathBuf::from("/models/small.gguf")),
            })))
        );
        let off = Step::SetDraft {
            runner_id: "r".into(),
            draft: None,
        };
        let task = task_for_step(&off, None).expect("a task");
        assert_eq!(order_from_task(&task), Ok(Order::SetDraft(None)));
        let bad = |draft: v1::InstanceDraft| {
            order_from_task(&v1::Task {
                kind: Some(Kind::SetDraft(v1::SetDraftTask {
                    draft: Some(draft),
                    ..Default::default()
                })),
                ..Default::default()
            })
        };
        let ngram = v1::InstanceDraft {
            method: v1::DraftMethod::Ngram as i32,
            num_draft_tokens: 17,
            ..Default::default()
        };
        assert_eq!(bad(ngram), Err(OrderError::DraftTokens(17)));
        let nameless = v1::InstanceDraft {
            method: v1::DraftMethod::DraftModel as i32,
            num_draft_tokens: 4,
            ..Default::default()
        };
        assert_eq!(bad(nameless), Err(OrderError::NoDraftModel));
    }

    #[test]
    fn tasks_a_runner_cannot_follow_are_refused() {
        assert_eq!(
            order_from_task(&v1::Task::default()),
            Err(OrderError::Empty)
        );
        let download = v1::Task {
            kind: Some(Kind::DownloadModel(v1::DownloadModelTask::default())),
            ..Default::default()
        };
        assert!(matches!(
            order_from_task(&download),
            Err(OrderError::NotForARunner(_))
        ));
        let no_params = v1::Task {
            kind: Some(Kind::TextGeneration(v1::TextGenerationTask::default())),
            ..Default::default()
        };
        assert_eq!(order_from_task(&no_params), Err(OrderError::NoParams));
    }
}
