//! How each event changes the state: one function per event kind, each
//! checking what the event names before it changes anything. An event that
//! names something unknown, or lacks a field, changes nothing and says why
//! ([`Ignored`]).

use tessera_protos::v1::{self, event::Kind, ClusterState};

/// Why an in-order event changed nothing but the last index.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Ignored {
    #[error("event has no body")]
    EmptyEvent,
    #[error("{event} lacks its {field}")]
    MissingField {
        event: &'static str,
        field: &'static str,
    },
    #[error("{event} names unknown {kind} {id:?}")]
    Unknown {
        event: &'static str,
        kind: &'static str,
        id: String,
    },
    #[error("{event} names {kind} {id:?} which already exists")]
    AlreadyExists {
        event: &'static str,
        kind: &'static str,
        id: String,
    },
}

/// How many task command ids the state remembers for de-duplication.
pub const RECENT_COMMANDS: usize = 1024;

/// Applies one event's body: `Err` leaves the state unchanged.
pub(crate) fn apply_kind(s: &mut ClusterState, kind: &Kind, index: u64) -> Result<(), Ignored> {
    match kind {
        Kind::NodeGatheredInfo(e) => node_gathered_info(s, e, index),
        Kind::NodeTimedOut(e) => node_timed_out(s, e),
        Kind::TopologyEdgeCreated(e) => topology_edge_created(s, e),
        Kind::TopologyEdgeDeleted(e) => topology_edge_deleted(s, e),
        Kind::InstanceCreated(e) => instance_created(s, e),
        Kind::InstanceDeleted(e) => instance_deleted(s, e),
        Kind::InstanceDraftModelUpdated(e) => instance_draft_model_updated(s, e),
        Kind::RunnerStatusUpdated(e) => runner_status_updated(s, e),
        Kind::RunnerDeleted(e) => runner_deleted(s, e),
        Kind::TaskCreated(e) => task_created(s, e),
        Kind::TaskAcknowledged(e) => task_acknowledged(s, e),
        Kind::TaskStatusUpdated(e) => task_status_updated(s, e),
        Kind::TaskDeleted(e) => task_deleted(s, e),
        Kind::NodeDownloadProgress(e) => node_download_progress(s, e),
        Kind::ModelCardAdded(e) => model_card_added(s, e),
        Kind::MemberRevoked(e) => member_revoked(s, e),
    }
}

fn node_gathered_info(
    s: &mut ClusterState,
    e: &v1::NodeGatheredInfo,
    index: u64,
) -> Result<(), Ignored> {
    const EV: &str = "NodeGatheredInfo";
    require(!e.node_id.is_empty(), EV, "node_id")?;
    let info = e.info.clone().ok_or(Ignored::MissingField {
        event: EV,
        field: "info",
    })?;
    s.nodes.insert(
        e.node_id.clone(),
        v1::NodeState {
            info: Some(info),
            updated_at_index: index,
        },
    );
    Ok(())
}

fn node_timed_out(s: &mut ClusterState, e: &v1::NodeTimedOut) -> Result<(), Ignored> {
    known(
        s.nodes.remove(&e.node_id).is_some(),
        "NodeTimedOut",
        "node",
        &e.node_id,
    )?;
    s.topology
        .retain(|edge| edge.source_node_id != e.node_id && edge.sink_node_id != e.node_id);
    s.downloads.remove(&e.node_id);
    Ok(())
}

fn topology_edge_created(s: &mut ClusterState, e: &v1::TopologyEdgeCreated) -> Result<(), Ignored> {
    const EV: &str = "TopologyEdgeCreated";
    let edge = e.edge.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "edge",
    })?;
    known(
        s.nodes.contains_key(&edge.source_node_id),
        EV,
        "node",
        &edge.source_node_id,
    )?;
    known(
        s.nodes.contains_key(&edge.sink_node_id),
        EV,
        "node",
        &edge.sink_node_id,
    )?;
    match s
        .topology
        .binary_search_by(|probe| edge_key(probe).cmp(&edge_key(edge)))
    {
        Ok(at) => s.topology[at] = edge.clone(),
        Err(at) => s.topology.insert(at, edge.clone()),
    }
    Ok(())
}

fn topology_edge_deleted(s: &mut ClusterState, e: &v1::TopologyEdgeDeleted) -> Result<(), Ignored> {
    const EV: &str = "TopologyEdgeDeleted";
    let edge = e.edge.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "edge",
    })?;
    let at = s
        .topology
        .binary_search_by(|probe| edge_key(probe).cmp(&edge_key(edge)))
        .map_err(|_| Ignored::Unknown {
            event: EV,
            kind: "edge",
            id: format!("{}->{}", edge.source_node_id, edge.sink_node_id),
        })?;
    s.topology.remove(at);
    Ok(())
}

fn instance_created(s: &mut ClusterState, e: &v1::InstanceCreated) -> Result<(), Ignored> {
    const EV: &str = "InstanceCreated";
    let instance = e.instance.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "instance",
    })?;
    require(!instance.instance_id.is_empty(), EV, "instance_id")?;
    require(!instance.ranks.is_empty(), EV, "ranks")?;
    fresh(
        !s.instances.contains_key(&instance.instance_id),
        EV,
        "instance",
        &instance.instance_id,
    )?;
    for rank in &instance.ranks {
        known(
            s.nodes.contains_key(&rank.node_id),
            EV,
            "node",
            &rank.node_id,
        )?;
    }
    if let Some(model) = &instance.model {
        s.given_up.remove(&model.model_id);
    }
    s.instances
        .insert(instance.instance_id.clone(), instance.clone());
    Ok(())
}

fn instance_deleted(s: &mut ClusterState, e: &v1::InstanceDeleted) -> Result<(), Ignored> {
    let instance = s.instances.remove(&e.instance_id);
    if let Some(model) = instance.as_ref().and_then(|i| i.model.as_ref()) {
        if !e.reason.is_empty() {
            s.given_up.insert(model.model_id.clone(), e.reason.clone());
        }
    }
    known(
        instance.is_some(),
        "InstanceDeleted",
        "instance",
        &e.instance_id,
    )?;
    // Its runners and tasks go with it: nothing is left to show
    // them as ready or running.
    for rank in instance.iter().flat_map(|i| &i.ranks) {
        s.runners.remove(&rank.runner_id);
    }
    s.tasks.retain(|_, task| task.instance_id != e.instance_id);
    Ok(())
}

fn instance_draft_model_updated(
    s: &mut ClusterState,
    e: &v1::InstanceDraftModelUpdated,
) -> Result<(), Ignored> {
    const EV: &str = "InstanceDraftModelUpdated";
    let draft = match &e.draft {
        // Method unspecified is off, as no draft is.
        Some(d) if d.method() == v1::DraftMethod::Unspecified => None,
        draft => draft.as_ref(),
    };
    if let Some(draft) = draft {
        if draft.method() == v1::DraftMethod::DraftModel {
            require(!draft.draft_model.is_empty(), EV, "draft.draft_model")?;
        }
        require(draft.num_draft_tokens > 0, EV, "draft.num_draft_tokens")?;
    }
    let instance = s.instances.get_mut(&e.instance_id);
    known(instance.is_some(), EV, "instance", &e.instance_id)?;
    if let Some(instance) = instance {
        instance.draft = draft.cloned();
    }
    Ok(())
}

fn runner_status_updated(s: &mut ClusterState, e: &v1::RunnerStatusUpdated) -> Result<(), Ignored> {
    const EV: &str = "RunnerStatusUpdated";
    let status = e.status.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "status",
    })?;
    let is_known = s.runners.contains_key(&e.runner_id)
        || s.instances
            .values()
            .any(|i| i.ranks.iter().any(|r| r.runner_id == e.runner_id));
    known(is_known, EV, "runner", &e.runner_id)?;
    require(status.state.is_some(), EV, "status.state")?;
    // A runner that has shut down is gone: it leaves the state.
    if matches!(status.state, Some(v1::runner_status::State::Shutdown(_))) {
        s.runners.remove(&e.runner_id);
    } else {
        s.runners.insert(e.runner_id.clone(), status.clone());
    }
    Ok(())
}

fn runner_deleted(s: &mut ClusterState, e: &v1::RunnerDeleted) -> Result<(), Ignored> {
    known(
        s.runners.remove(&e.runner_id).is_some(),
        "RunnerDeleted",
        "runner",
        &e.runner_id,
    )?;
    Ok(())
}

fn task_created(s: &mut ClusterState, e: &v1::TaskCreated) -> Result<(), Ignored> {
    const EV: &str = "TaskCreated";
    let task = e.task.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "task",
    })?;
    require(!task.task_id.is_empty(), EV, "task_id")?;
    require(task.kind.is_some(), EV, "kind")?;
    fresh(
        !s.tasks.contains_key(&task.task_id),
        EV,
        "task",
        &task.task_id,
    )?;
    known(
        s.instances.contains_key(&task.instance_id),
        EV,
        "instance",
        &task.instance_id,
    )?;
    if !task.command_id.is_empty() {
        fresh(
            !s.recent_command_ids.contains(&task.command_id),
            EV,
            "command",
            &task.command_id,
        )?;
        if s.recent_command_ids.len() >= RECENT_COMMANDS {
            s.recent_command_ids.remove(0);
        }
        s.recent_command_ids.push(task.command_id.clone());
    }
    s.tasks.insert(task.task_id.clone(), task.clone());
    Ok(())
}

fn task_acknowledged(s: &mut ClusterState, e: &v1::TaskAcknowledged) -> Result<(), Ignored> {
    let task = s.tasks.get_mut(&e.task_id);
    known(task.is_some(), "TaskAcknowledged", "task", &e.task_id)?;
    if let Some(task) = task {
        task.acknowledged = true;
    }
    Ok(())
}

fn task_status_updated(s: &mut ClusterState, e: &v1::TaskStatusUpdated) -> Result<(), Ignored> {
    let task = s.tasks.get_mut(&e.task_id);
    known(task.is_some(), "TaskStatusUpdated", "task", &e.task_id)?;
    if let Some(task) = task {
        task.status = e.status;
        task.error.clone_from(&e.error);
    }
    Ok(())
}

fn task_deleted(s: &mut ClusterState, e: &v1::TaskDeleted) -> Result<(), Ignored> {
    known(
        s.tasks.remove(&e.task_id).is_some(),
        "TaskDeleted",
        "task",
        &e.task_id,
    )?;
    Ok(())
}

fn node_download_progress(
    s: &mut ClusterState,
    e: &v1::NodeDownloadProgress,
) -> Result<(), Ignored> {
    const EV: &str = "NodeDownloadProgress";
    let progress = e.progress.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "progress",
    })?;
    require(!progress.model_id.is_empty(), EV, "progress.model_id")?;
    known(s.nodes.contains_key(&e.node_id), EV, "node", &e.node_id)?;
    s.downloads
        .entry(e.node_id.clone())
        .or_default()
        .models
        .insert(progress.model_id.clone(), progress.clone());
    Ok(())
}

fn model_card_added(s: &mut ClusterState, e: &v1::ModelCardAdded) -> Result<(), Ignored> {
    const EV: &str = "ModelCardAdded";
    let card = e.card.as_ref().ok_or(Ignored::MissingField {
        event: EV,
        field: "card",
    })?;
    require(!card.model_id.is_empty(), EV, "card.model_id")?;
    require(card.n_layers > 0, EV, "card.n_layers")?;
    s.custom_cards.insert(card.model_id.clone(), card.clone());
    Ok(())
}

fn member_revoked(s: &mut ClusterState, e: &v1::MemberRevoked) -> Result<(), Ignored> {
    require(!e.holder.is_empty(), "MemberRevoked", "holder")?;
    if let Err(at) = s.revoked.binary_search(&e.holder) {
        s.revoked.insert(at, e.holder.clone());
    }
    Ok(())
}

/// The order the topology list is kept in, and its identity: one edge per
/// (source, sink, address).
fn edge_key(edge: &v1::TopologyEdge) -> (&str, &str, &str) {
    (&edge.source_node_id, &edge.sink_node_id, &edge.address)
}

fn require(present: bool, event: &'static str, field: &'static str) -> Result<(), Ignored> {
    if present {
        Ok(())
    } else {
        Err(Ignored::MissingField { event, field })
    }
}

fn known(present: bool, event: &'static str, kind: &'static str, id: &str) -> Result<(), Ignored> {
    if present {
        Ok(())
    } else {
        Err(Ignored::Unknown {
            event,
            kind,
            id: id.to_owned(),
        })
    }
}

fn fresh(absent: bool, event: &'static str, kind: &'static str, id: &str) -> Result<(), Ignored> {
    if absent {
        Ok(())
    } else {
        Err(Ignored::AlreadyExists {
            event,
            kind,
            id: id.to_owned(),
        })
    }
}
