//! What a command stands for: the events the master logs for it, decided
//! from the state alone. The master's actor does the round trips (the
//! state from the replica, the refusal to a waiting client) and makes what
//! only it can (fresh ids, ring secrets), and hands them in: so each
//! decision here is a plain function, tested without actors.

use tessera_protos::v1::{self, command, event, ClusterState, Command, Event};

use crate::admin::AdminFailure;
use crate::cluster::placement::{self, NodeCapacity, PlacementRequest};

/// What the master's settings and its randomness give a decision.
#[derive(Clone, Debug)]
pub struct Fresh {
    /// An id for a new task, or for an instance placed by a command
    /// without an id.
    pub id: String,
    /// A ring secret for a new instance.
    pub ring_secret: Vec<u8>,
    /// Whether the cluster's links are mutual TLS (a new instance's ring
    /// is sealed then).
    pub secured: bool,
    /// A placed instance's concurrency when its command names none.
    pub max_concurrent: u32,
}

/// What the master does for a command.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// The events to log, in order.
    pub events: Vec<Event>,
    /// A generation that has nowhere to run: the model its client asked
    /// for (the client is told at once, not left to time out).
    pub unplaceable_generation: Option<String>,
}

impl From<Vec<Event>> for Decision {
    fn from(events: Vec<Event>) -> Self {
        Self {
            events,
            unplaceable_generation: None,
        }
    }
}

/// The events `command` stands for in `state`. A refused command stands
/// for none; why is logged.
pub fn decide(state: &ClusterState, command: &Command, fresh: Fresh) -> Decision {
    let id = &command.command_id;
    match &command.kind {
        Some(command::Kind::PlaceInstance(place)) => place_instance(state, place, id, fresh).into(),
        Some(command::Kind::CreateInstance(create)) => {
            vec![event(event::Kind::InstanceCreated(v1::InstanceCreated {
                instance: create.instance.clone(),
            }))]
            .into()
        }
        Some(command::Kind::DeleteInstance(delete)) => {
            vec![event(event::Kind::InstanceDeleted(v1::InstanceDeleted {
                instance_id: delete.instance_id.clone(),
                ..Default::default()
            }))]
            .into()
        }
        Some(command::Kind::TextGeneration(_)) if tessera_state::command_applied(state, id) => {
            // Sent again by an API node that has not seen its task yet.
            tracing::debug!(command_id = id, "already applied");
            Decision::default()
        }
        Some(command::Kind::TextGeneration(generation)) => {
            text_generation(state, command, generation, fresh.id)
        }
        Some(command::Kind::TaskFinished(finished)) => task_finished(state, finished).into(),
        Some(command::Kind::CancelTask(cancel)) => cancel_task(state, cancel).into(),
        Some(command::Kind::StartDownload(c)) => start_download(state, c, id).into(),
        Some(command::Kind::CancelDownload(c)) => {
            let request = download_request(v1::DownloadAction::Cancel, &c.node_id, &c.model_id);
            logged(download_event(state, &request, id), "cancel refused").into()
        }
        Some(command::Kind::DeleteDownload(c)) => {
            let request = download_request(v1::DownloadAction::Delete, &c.node_id, &c.model_id);
            logged(download_event(state, &request, id), "delete refused").into()
        }
        Some(command::Kind::SetInstanceDraftModel(set)) => logged(
            draft_update(state, &set.instance_id, set.draft.as_ref()).map(|(event, _)| event),
            "draft refused",
        )
        .into(),
        Some(command::Kind::AddModelCard(add)) => add_model_card(add).into(),
        _ => {
            tracing::debug!("command not handled");
            Decision::default()
        }
    }
}

fn event(kind: event::Kind) -> Event {
    Event { kind: Some(kind) }
}

/// The event, or none with the refusal logged.
fn logged(event: Result<Event, AdminFailure>, what: &str) -> Vec<Event> {
    match event {
        Ok(event) => vec![event],
        Err(reason) => {
            tracing::warn!(%reason, "{what}");
            Vec::new()
        }
    }
}

/// A new instance of the model, where the placement puts it.
fn place_instance(
    state: &ClusterState,
    place: &v1::PlaceInstance,
    command_id: &str,
    fresh: Fresh,
) -> Vec<Event> {
    let Some(card) = find_card(state, &place.model_id) else {
        tracing::warn!(model = %place.model_id, "place: unknown model");
        return Vec::new();
    };
    let nodes = NodeCapacity::from_state(state);
    let request = PlacementRequest {
        model: &card,
        sharding: v1::Sharding::try_from(place.sharding).unwrap_or(v1::Sharding::Unspecified),
        min_nodes: place.min_nodes as usize,
        node_ids: &place.node_ids,
        max_concurrent: if place.max_concurrent > 0 {
            place.max_concurrent
        } else {
            fresh.max_concurrent
        },
        draft: None,
    };
    let instance_id = if command_id.is_empty() {
        fresh.id
    } else {
        format!("instance-{command_id}")
    };
    let used = placement::used_ring_addresses(state);
    match placement::place(&request, &nodes, &instance_id, &used, |rank| {
        format!("{instance_id}-rank{rank}")
    }) {
        Ok(placed) => {
            let mut instance = placed.instance;
            instance.ring_secret = fresh.ring_secret;
            instance.ring_sealed = fresh.secured;
            vec![event(event::Kind::InstanceCreated(v1::InstanceCreated {
                instance: Some(instance),
            }))]
        }
        Err(error) => {
            tracing::warn!(%error, "place refused");
            Vec::new()
        }
    }
}

/// A task on the named instance, or on any instance of the model whose
/// rank 0 is ready; none ready: the generation has nowhere to run.
fn text_generation(
    state: &ClusterState,
    command: &Command,
    generation: &v1::TextGeneration,
    task_id: String,
) -> Decision {
    let model_id = generation
        .params
        .as_ref()
        .map(|p| p.model_id.clone())
        .unwrap_or_default();
    let ready = |i: &&v1::Instance| {
        i.ranks.first().is_some_and(|r| {
            matches!(
                state
                    .runners
                    .get(&r.runner_id)
                    .and_then(|s| s.state.as_ref()),
                Some(v1::runner_status::State::Ready(_))
                    | Some(v1::runner_status::State::Running(_))
            )
        })
    };
    let instance = state.instances.values().filter(ready).find(|i| {
        if generation.instance_id.is_empty() {
            i.model.as_ref().is_some_and(|m| m.model_id == model_id)
        } else {
            i.instance_id == generation.instance_id
        }
    });
    let Some(instance) = instance else {
        tracing::warn!(model_id, "generation: no ready instance");
        return Decision {
            events: Vec::new(),
            unplaceable_generation: Some(model_id),
        };
    };
    vec![event(event::Kind::TaskCreated(v1::TaskCreated {
        task: Some(v1::Task {
            task_id,
            instance_id: instance.instance_id.clone(),
            command_id: command.command_id.clone(),
            status: v1::TaskStatus::Pending as i32,
            acknowledged: false,
            error: String::new(),
            kind: Some(v1::task::Kind::TextGeneration(v1::TextGenerationTask {
                params: generation.params.clone(),
                reply_node_id: command.origin_node_id.clone(),
            })),
        }),
    }))]
    .into()
}

/// A finished task leaves the state.
fn task_finished(state: &ClusterState, finished: &v1::TaskFinished) -> Vec<Event> {
    if !state.tasks.contains_key(&finished.task_id) {
        return Vec::new();
    }
    vec![event(event::Kind::TaskDeleted(v1::TaskDeleted {
        task_id: finished.task_id.clone(),
    }))]
}

/// The task named by id or by its command's id, marked cancelled.
fn cancel_task(state: &ClusterState, cancel: &v1::CancelTask) -> Vec<Event> {
    let task = state.tasks.values().find(|t| {
        (!cancel.task_id.is_empty() && t.task_id == cancel.task_id)
            || (!cancel.command_id.is_empty() && t.command_id == cancel.command_id)
    });
    task.map(|task| {
        event(event::Kind::TaskStatusUpdated(v1::TaskStatusUpdated {
            task_id: task.task_id.clone(),
            status: v1::TaskStatus::Cancelled as i32,
            error: "cancelled".into(),
        }))
    })
    .into_iter()
    .collect()
}

/// A download's start, with the shard it brings in if one is named.
fn start_download(state: &ClusterState, c: &v1::StartDownload, command_id: &str) -> Vec<Event> {
    let request = download_request(v1::DownloadAction::Start, &c.node_id, &c.model_id);
    let mut started = download_event(state, &request, command_id);
    if let (
        Ok(Event {
            kind: Some(event::Kind::NodeDownloadProgress(p)),
        }),
        Some(shard),
    ) = (started.as_mut(), &c.shard)
    {
        if let Some(progress) = p.progress.as_mut() {
            progress.shards.push(*shard);
        }
    }
    logged(started, "download refused")
}

/// A card the built-in catalogue does not already hold.
fn add_model_card(add: &v1::AddModelCard) -> Vec<Event> {
    match &add.card {
        Some(card) if crate::catalogue::card(&card.model_id).is_none() => {
            vec![event(event::Kind::ModelCardAdded(v1::ModelCardAdded {
                card: Some(card.clone()),
            }))]
        }
        _ => Vec::new(),
    }
}

pub(super) fn download_request(
    action: v1::DownloadAction,
    node_id: &str,
    model_id: &str,
) -> v1::DownloadRequest {
    v1::DownloadRequest {
        action: action as i32,
        node_id: node_id.to_string(),
        model_id: model_id.to_string(),
    }
}

/// The event a download request stands for, or why it is refused.
pub(super) fn download_event(
    state: &ClusterState,
    request: &v1::DownloadRequest,
    request_id: &str,
) -> Result<Event, AdminFailure> {
    use v1::download_progress::State as Ds;
    let node = state
        .nodes
        .get(&request.node_id)
        .ok_or_else(|| AdminFailure::NotFound(format!("no node {:?}", request.node_id)))?;
    if node.info.as_ref().is_some_and(|i| i.no_worker) {
        return Err(AdminFailure::InvalidArgument(format!(
            "node {} runs no models (--no-worker)",
            request.node_id
        )));
    }
    let card = find_card(state, &request.model_id)
        .ok_or_else(|| AdminFailure::NotFound(format!("unknown model {:?}", request.model_id)))?;
    let current = state
        .downloads
        .get(&request.node_id)
        .and_then(|d| d.models.get(&request.model_id))
        .and_then(|p| p.state.as_ref());
    let request_id = request_id.to_string();
    let new_state = match v1::DownloadAction::try_from(request.action) {
        Ok(v1::DownloadAction::Start) => Ds::Pending(v1::DownloadPending {
            total_bytes: card.storage_size_bytes,
            request_id,
        }),
        Ok(v1::DownloadAction::Cancel) => {
            if !matches!(current, Some(Ds::Pending(_) | Ds::Ongoing(_))) {
                return Err(AdminFailure::NotFound(format!(
                    "no download of {} in progress on {}",
                    request.model_id, request.node_id
                )));
            }
            Ds::Cancelled(v1::DownloadCancelled { request_id })
        }
        Ok(v1::DownloadAction::Delete) => {
            let user = state.instances.values().find(|i| {
                i.model
                    .as_ref()
                    .is_some_and(|m| m.model_id == request.model_id)
                    && i.ranks.iter().any(|r| r.node_id == request.node_id)
            });
            if let Some(user) = user {
                return Err(AdminFailure::Conflict(format!(
                    "instance {} uses {} on {}: delete the instance first",
                    user.instance_id, request.model_id, request.node_id
                )));
            }
            if matches!(current, Some(Ds::Completed(c)) if c.read_only) {
                return Err(AdminFailure::Conflict(format!(
                    "{} on {} is in a read-only model folder and is never deleted",
                    request.model_id, request.node_id
                )));
            }
            Ds::Deleted(v1::DownloadDeleted { request_id })
        }
        _ => {
            return Err(AdminFailure::InvalidArgument(
                "the action must be start, cancel or delete".into(),
            ))
        }
    };
    Ok(Event {
        kind: Some(event::Kind::NodeDownloadProgress(
            v1::NodeDownloadProgress {
                node_id: request.node_id.clone(),
                progress: Some(v1::DownloadProgress {
                    model_id: request.model_id.clone(),
                    state: Some(new_state),
                    shards: Vec::new(),
                }),
            },
        )),
    })
}

/// The InstanceDraftModelUpdated event that sets `draft` on an instance
/// (none, or method unspecified: off), with the instance as it will be;
/// or why not, with nothing changed: an unknown instance or draft model, a
/// token count out of 1..=16 (0 is the default, 4), a prompt lookup that
/// names a model, a draft model that does not fit beside the instance on
/// rank 0's node.
pub(super) fn draft_update(
    state: &ClusterState,
    instance_id: &str,
    draft: Option<&v1::InstanceDraft>,
) -> Result<(Event, v1::Instance), AdminFailure> {
    use tessera_engine::serve::speculative::{DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS};
    let instance = state
        .instances
        .get(instance_id)
        .ok_or_else(|| AdminFailure::NotFound(format!("no instance {instance_id:?}")))?;
    let asked = draft.filter(|d| d.method() != v1::DraftMethod::Unspecified);
    let draft = match asked {
        None => None,
        Some(asked) => {
            let tokens = match asked.num_draft_tokens {
                0 => DEFAULT_DRAFT_TOKENS as u32,
                n if n as usize > MAX_DRAFT_TOKENS => {
                    return Err(AdminFailure::InvalidArgument(format!(
                        "num_draft_tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {n}"
                    )))
                }
                n => n,
            };
            let mut draft = v1::InstanceDraft {
                method: asked.method,
                draft_model: String::new(),
                num_draft_tokens: tokens,
                draft_card: None,
            };
            if asked.method() == v1::DraftMethod::DraftModel {
                if asked.draft_model.is_empty() {
                    return Err(AdminFailure::InvalidArgument(
                        "a draft_model draft names its model (draft_model)".into(),
                    ));
                }
                let card = find_card(state, &asked.draft_model).ok_or_else(|| {
                    AdminFailure::NotFound(format!("unknown draft model {:?}", asked.draft_model))
                })?;
                draft.draft_model = card.model_id.clone();
                draft.draft_card = Some(card);
                let nodes = NodeCapacity::from_state(state);
                placement::draft_fits(&nodes, instance, &draft)
                    .map_err(|e| AdminFailure::DoesNotFit(e.to_string()))?;
            } else if !asked.draft_model.is_empty() {
                return Err(AdminFailure::InvalidArgument(format!(
                    "prompt lookup (ngram) needs no model, but draft_model is {:?}",
                    asked.draft_model
                )));
            }
            Some(draft)
        }
    };
    let updated = v1::Instance {
        draft: draft.clone(),
        ..instance.clone()
    };
    let event = Event {
        kind: Some(event::Kind::InstanceDraftModelUpdated(
            v1::InstanceDraftModelUpdated {
                instance_id: instance_id.to_string(),
                draft,
            },
        )),
    };
    Ok((event, updated))
}

/// A model card from the state's instances or the built-in catalogue.
pub(super) fn find_card(state: &ClusterState, model_id: &str) -> Option<v1::ModelCard> {
    state
        .instances
        .values()
        .filter_map(|i| i.model.as_ref())
        .find(|m| m.model_id == model_id)
        .cloned()
        .or_else(|| crate::catalogue::find(state, model_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> Fresh {
        Fresh {
            id: "fresh-id".into(),
            ring_secret: vec![7; 32],
            secured: true,
            max_concurrent: 8,
        }
    }

    /// Node "a" with room to spare, and instance "i" of the default model
    /// on it, its rank 0 in `runner`'s state.
    fn cluster(runner: Option<v1::runner_status::State>) -> ClusterState {
        let mut state = ClusterState::default();
        state.nodes.insert(
            "a".into(),
            v1::NodeState {
                info: Some(v1::NodeInfo {
                    memory_available_bytes: 64 << 30,
                    memory_total_bytes: 64 << 30,
                    ..Default::default()
                }),
                updated_at_index: 1,
            },
        );
        let model = crate::catalogue::cards().into_iter().next();
        state.instances.insert(
            "i".into(),
            v1::Instance {
                instance_id: "i".into(),
                model,
                ranks: vec![v1::InstanceRank {
                    node_id: "a".into(),
                    runner_id: "i-r0".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        if let Some(runner) = runner {
            state.runners.insert(
                "i-r0".into(),
                v1::RunnerStatus {
                    state: Some(runner),
                },
            );
        }
        state
    }

    fn generation(command_id: &str) -> Command {
        let model_id = crate::catalogue::cards()
            .into_iter()
            .next()
            .map(|c| c.model_id)
            .unwrap_or_default();
        Command {
            command_id: command_id.into(),
            origin_node_id: "api".into(),
            kind: Some(command::Kind::TextGeneration(v1::TextGeneration {
                instance_id: String::new(),
                params: Some(v1::TextGenerationParams {
                    model_id,
                    ..Default::default()
                }),
            })),
        }
    }

    #[test]
    fn a_generation_goes_to_a_ready_instance_once() {
        let ready = Some(v1::runner_status::State::Ready(Default::default()));
        let mut state = cluster(ready);
        let decision = decide(&state, &generation("c1"), fresh());
        let [Event {
            kind: Some(event::Kind::TaskCreated(created)),
        }] = decision.events.as_slice()
        else {
            panic!("not one TaskCreated: {decision:?}");
        };
        let task = created.task.clone().unwrap_or_default();
        assert_eq!(
            (task.task_id.as_str(), task.instance_id.as_str()),
            ("fresh-id", "i")
        );
        // Sent again before its task is done: nothing more.
        state.tasks.insert(task.task_id.clone(), task);
        assert_eq!(
            decide(&state, &generation("c1"), fresh()),
            Decision::default()
        );
    }

    #[test]
    fn a_generation_with_no_ready_instance_is_refused_to_its_client() {
        let loading = Some(v1::runner_status::State::Loading(Default::default()));
        for state in [cluster(None), cluster(loading)] {
            let decision = decide(&state, &generation("c1"), fresh());
            assert!(decision.events.is_empty(), "{decision:?}");
            assert!(decision.unplaceable_generation.is_some(), "{decision:?}");
        }
    }

    #[test]
    fn a_placed_instance_takes_the_fresh_secret_and_the_command_id() {
        let mut state = cluster(None);
        state.instances.clear();
        let model_id = crate::catalogue::cards()
            .into_iter()
            .next()
            .map(|c| c.model_id)
            .unwrap_or_default();
        let place = |command_id: &str| Command {
            command_id: command_id.into(),
            kind: Some(command::Kind::PlaceInstance(v1::PlaceInstance {
                model_id: model_id.clone(),
                sharding: v1::Sharding::Pipeline as i32,
                min_nodes: 1,
                ..Default::default()
            })),
            ..Default::default()
        };
        for (command_id, instance_id) in [("p1", "instance-p1"), ("", "fresh-id")] {
            let decision = decide(&state, &place(command_id), fresh());
            let [Event {
                kind: Some(event::Kind::InstanceCreated(created)),
            }] = decision.events.as_slice()
            else {
                panic!("not one InstanceCreated: {decision:?}");
            };
            let instance = created.instance.clone().unwrap_or_default();
            assert_eq!(instance.instance_id, instance_id);
            assert_eq!(instance.ring_secret, vec![7; 32]);
            assert!(instance.ring_sealed);
            assert_eq!(instance.max_concurrent, 8);
        }
        let unknown = Command {
            kind: Some(command::Kind::PlaceInstance(v1::PlaceInstance {
                model_id: "no-such-model".into(),
                ..Default::default()
            })),
            ..Default::default()
        };
        assert_eq!(decide(&state, &unknown, fresh()), Decision::default());
    }

    #[test]
    fn a_task_is_cancelled_by_its_id_or_its_commands() {
        let mut state = cluster(None);
        state.tasks.insert(
            "t".into(),
            v1::Task {
                task_id: "t".into(),
                command_id: "c".into(),
                instance_id: "i".into(),
                ..Default::default()
            },
        );
        let cancel = |task_id: &str, command_id: &str| Command {
            kind: Some(command::Kind::CancelTask(v1::CancelTask {
                task_id: task_id.into(),
                command_id: command_id.into(),
            })),
            ..Default::default()
        };
        for (task_id, command_id, found) in [("t", "", true), ("", "c", true), ("", "x", false)] {
            let decision = decide(&state, &cancel(task_id, command_id), fresh());
            assert_eq!(decision.events.len(), usize::from(found), "{decision:?}");
        }
    }
}
