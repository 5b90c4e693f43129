//! The Master actor (one per cluster, on the elected node): turns commands
//! and workers' local events into indexed events. Each event is persisted
//! and applied on this node (through the Replica) before it is published,
//! so an event anyone has seen is on the master's disk. Indices continue
//! the log: a new master starts after the last index it holds, and the
//! election picks the node holding the most.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ractor::{call_t, Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tessera_protos::v1::{
    self, command, event, ClusterState, Command, Event, IndexedEvent, LocalEvent, SessionId,
};

use crate::admin::AdminFailure;
use crate::bus::Bus;
use crate::cluster::commands::{self, download_event, draft_update, find_card, Fresh};
use crate::cluster::placement::{self, NodeCapacity, PlacementRequest};
use crate::cluster::replica::ReplicaMsg;

pub enum MasterMsg {
    Command(Command),
    /// The admin service's place: the instance created, or why not.
    Place(
        v1::PlaceInstanceRequest,
        RpcReplyPort<v1::PlaceInstanceReply>,
    ),
    /// The admin service's delete.
    Delete(
        v1::DeleteInstanceRequest,
        RpcReplyPort<v1::DeleteInstanceReply>,
    ),
    /// The admin service's download start, cancel and delete.
    Download(v1::DownloadRequest, RpcReplyPort<v1::DownloadReply>),
    /// A custom card built from a hub repository by the asking node.
    AddCard(v1::ModelCard, RpcReplyPort<v1::AddModelReply>),
    /// The admin service's draft: an instance's speculative decoding set
    /// or cleared.
    SetDraft(v1::SetDraftRequest, RpcReplyPort<v1::SetDraftReply>),
    /// The admin service's revoke: a member of a secured cluster refused
    /// from now on (its instances go, as if it had timed out).
    Revoke(v1::RevokeRequest, RpcReplyPort<v1::RevokeReply>),
    Local(LocalEvent),
    NodeAlive(String),
    /// A liveliness token went away; the node is checked again before it
    /// times out.
    NodeGone(String),
    /// Still gone after [`GONE_GRACE`]: the node times out.
    NodeStillGone(String),
}

/// How long a node whose liveliness token vanished has to show it again.
/// A peer's token can vanish for a moment when the link it was learnt
/// through dies (the old master's, in a failover) while the node is fine.
const GONE_GRACE: Duration = Duration::from_millis(300);

/// Asks zenoh, after [`GONE_GRACE`], whether `node` is really gone, and if
/// so tells the master.
fn confirm_gone(master: ActorRef<MasterMsg>, bus: Bus, node: String) {
    tokio::spawn(async move {
        tokio::time::sleep(GONE_GRACE).await;
        let alive = bus.is_alive(&node, Duration::from_millis(500)).await;
        if alive {
            tracing::info!(node, "a liveliness token came back; the node stays");
            let _ = master.cast(MasterMsg::NodeAlive(node));
        } else {
            let _ = master.cast(MasterMsg::NodeStillGone(node));
        }
    });
}

pub struct Master;

pub struct MasterArgs {
    pub node_id: String,
    pub clock: u64,
    pub bus: Bus,
    pub replica: ActorRef<ReplicaMsg>,
    pub alive: BTreeSet<String>,
    /// Generations an instance runs at once unless its placement says.
    pub max_concurrent: u32,
    /// A secured cluster: instance rings are sealed.
    pub secured: bool,
}

pub struct MasterState {
    session: SessionId,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    next_index: u64,
    /// The last local event sequence number indexed, by origin node.
    seen: BTreeMap<String, u64>,
    /// Runner failures in a row, by instance.
    runner_failures: BTreeMap<String, u32>,
    alive: BTreeSet<String>,
    max_concurrent: u32,
    secured: bool,
}

impl MasterState {
    async fn state(&self) -> Result<Arc<ClusterState>, ActorProcessingErr> {
        Ok(call_t!(
            self.replica,
            ReplicaMsg::GetState,
            crate::ACTOR_CALL_MS
        )?)
    }

    /// Indexes, persists, applies and publishes one event. A refused event
    /// (it names something unknown) is neither stored nor published.
    async fn index(&mut self, event: Event) -> Result<bool, ActorProcessingErr> {
        self.index_from(event, String::new(), 0).await
    }

    /// [`index`](Self::index) for a node's report, numbered `origin_seq`.
    async fn index_from(
        &mut self,
        event: Event,
        origin_node_id: String,
        origin_seq: u64,
    ) -> Result<bool, ActorProcessingErr> {
        let indexed = IndexedEvent {
            index: self.next_index,
            session: Some(self.session.clone()),
            event: Some(event),
            origin_node_id,
            origin_seq,
        };
        let committed = call_t!(
            self.replica,
            ReplicaMsg::Commit,
            crate::ACTOR_CALL_MS,
            indexed.clone()
        )?;
        if let Err(reason) = committed {
            tracing::warn!(%reason, index = indexed.index, "event refused");
            return Ok(false);
        }
        self.next_index += 1;
        let key = self.bus.keys.global_events();
        if let Err(error) = self.bus.put(&key, &indexed).await {
            // Persisted here: followers get it by catching up.
            tracing::warn!(%error, "publishing an indexed event");
        }
        Ok(true)
    }

    /// The events a command stands for ([`commands::decide`]); a
    /// generation with nowhere to run is refused to its client here.
    async fn events_for(&self, command: &Command) -> Result<Vec<Event>, ActorProcessingErr> {
        let state = self.state().await?;
        let placing = matches!(command.kind, Some(command::Kind::PlaceInstance(_)));
        let ring_secret = if placing {
            tessera_engine::dist::ring_security::new_secret()
                .map_err(ActorProcessingErr::from)?
                .to_vec()
        } else {
            Vec::new()
        };
        let fresh = Fresh {
            id: uuid::Uuid::now_v7().to_string(),
            ring_secret,
            secured: self.secured,
            max_concurrent: self.max_concurrent,
        };
        let decision = commands::decide(&state, command, fresh);
        if let Some(model_id) = &decision.unplaceable_generation {
            self.refuse_generation(&command.command_id, model_id).await;
        }
        Ok(decision.events)
    }

    /// Tells a waiting client that its generation has nowhere to run.
    async fn refuse_generation(&self, command_id: &str, model_id: &str) {
        let chunk = v1::GenerationChunk {
            command_id: command_id.to_string(),
            seq: 0,
            kind: Some(v1::generation_chunk::Kind::Error(v1::ErrorChunk {
                kind: "not_found".into(),
                message: format!(
                    "no ready instance of {model_id:?}: place one with `tessera admin place {model_id}`"
                ),
            })),
        };
        if let Ok(key) = self.bus.keys.chunks(command_id) {
            let _ = self.bus.put(&key, &chunk).await;
        }
    }

    /// Places a model: the instance is in the log when this returns.
    async fn place(
        &mut self,
        request: &v1::PlaceInstanceRequest,
    ) -> Result<v1::PlaceInstanceReply, ActorProcessingErr> {
        let state = self.state().await?;
        let refuse = |failure: AdminFailure| v1::PlaceInstanceReply {
            error: Some(failure.to_proto()),
            ..Default::default()
        };
        let Some(card) = find_card(&state, &request.model_id) else {
            let known: Vec<String> = crate::catalogue::cards()
                .into_iter()
                .map(|c| c.model_id)
                .collect();
            return Ok(refuse(AdminFailure::NotFound(format!(
                "unknown model {:?} (known: {})",
                request.model_id,
                known.join(", ")
            ))));
        };
        let sharding = match v1::Sharding::try_from(request.sharding) {
            Ok(v1::Sharding::Unspecified) | Err(_) => v1::Sharding::Pipeline,
            Ok(s) => s,
        };
        if !request.request_id.is_empty() {
            let id = instance_id_for(&card.model_id, &request.request_id);
            if let Some(placed) = state.instances.get(&id) {
                // Asked again (the answer was lost): the same instance.
                return Ok(v1::PlaceInstanceReply {
                    command_id: request.request_id.clone(),
                    instance: Some(placed.clone()),
                    error: None,
                });
            }
        }
        let placement_request = PlacementRequest {
            model: &card,
            sharding,
            min_nodes: request.min_nodes as usize,
            node_ids: &request.node_ids,
            max_concurrent: self.max_concurrent,
            draft: None,
        };
        match self
            .place_card(&state, &placement_request, &request.request_id)
            .await?
        {
            Ok((command_id, instance)) => Ok(v1::PlaceInstanceReply {
                command_id,
                instance: Some(instance),
                error: None,
            }),
            Err(error) => Ok(refuse(AdminFailure::DoesNotFit(error))),
        }
    }

    /// What a placement asked for, else this master's default.
    /// `instance` with a fresh secret for its ring, sealed in a secured
    /// cluster.
    fn with_ring_secret(
        &self,
        mut instance: v1::Instance,
    ) -> Result<v1::Instance, ActorProcessingErr> {
        instance.ring_secret = tessera_engine::dist::ring_security::new_secret()
            .map_err(ActorProcessingErr::from)?
            .to_vec();
        instance.ring_sealed = self.secured;
        Ok(instance)
    }

    /// Places `card` on the nodes of `state` and logs the instance; the
    /// inner error says why it does not fit.
    async fn place_card(
        &mut self,
        state: &ClusterState,
        placement_request: &PlacementRequest<'_>,
        request_id: &str,
    ) -> Result<Result<(String, v1::Instance), String>, ActorProcessingErr> {
        let nodes = NodeCapacity::from_state(state);
        let card = placement_request.model;
        let command_id = if request_id.is_empty() {
            uuid::Uuid::now_v7().to_string()
        } else {
            request_id.to_string()
        };
        let instance_id = instance_id_for(&card.model_id, &command_id);
        let used = placement::used_ring_addresses(state);
        let placed =
            match placement::place(placement_request, &nodes, &instance_id, &used, |rank| {
                format!("{instance_id}-rank{rank}")
            }) {
                Ok(placed) => placed,
                Err(error) => return Ok(Err(error.to_string())),
            };
        let instance = self.with_ring_secret(placed.instance)?;
        let stored = self
            .index(Event {
                kind: Some(event::Kind::InstanceCreated(v1::InstanceCreated {
                    instance: Some(instance.clone()),
                })),
            })
            .await?;
        if !stored {
            return Ok(Err("the instance was refused by the log".into()));
        }
        Ok(Ok((command_id, instance)))
    }

    /// A node whose liveliness token is gone: it times out, and so do the
    /// instances that used it; their models are placed again where they fit.
    async fn node_gone(&mut self, node: &str) -> Result<(), ActorProcessingErr> {
        let state = self.state().await?;
        if !state.nodes.contains_key(node) {
            return Ok(());
        }
        let lost: Vec<v1::Instance> = state
            .instances
            .values()
            .filter(|i| i.ranks.iter().any(|r| r.node_id == node))
            .cloned()
            .collect();
        for instance in &lost {
            self.index(Event {
                kind: Some(event::Kind::InstanceDeleted(v1::InstanceDeleted {
                    instance_id: instance.instance_id.clone(),
                    ..Default::default()
                })),
            })
            .await?;
        }
        self.index(Event {
            kind: Some(event::Kind::NodeTimedOut(v1::NodeTimedOut {
                node_id: node.to_string(),
            })),
        })
        .await?;
        // Each lost model is placed again on the nodes left, if it fits.
        for lost in lost {
            let Some(card) = lost.model.as_ref() else {
                continue;
            };
            let sharding = v1::Sharding::try_from(lost.sharding).unwrap_or(v1::Sharding::Pipeline);
            let state = self.state().await?;
            // Its draft goes with it (counted on the new rank 0's node).
            let request = PlacementRequest {
                model: card,
                sharding,
                min_nodes: 1,
                node_ids: &[],
                max_concurrent: self.max_concurrent,
                draft: lost.draft.as_ref(),
            };
            match self.place_card(&state, &request, "").await? {
                Ok((_, instance)) => tracing::info!(
                    lost = lost.instance_id,
                    instance = instance.instance_id,
                    ranks = instance.ranks.len(),
                    "placed a lost instance again"
                ),
                Err(reason) => tracing::warn!(
                    lost = lost.instance_id,
                    reason,
                    "a lost instance does not fit on the nodes left"
                ),
            }
        }
        Ok(())
    }
}

/// Why `holder` cannot be revoked now, if it cannot.
fn revocation_refusal(
    state: &ClusterState,
    master: &str,
    secured: bool,
    holder: &str,
) -> Option<AdminFailure> {
    if !secured {
        return Some(AdminFailure::Conflict(
            "an open cluster has no members to revoke: secure it with `tessera cluster init`"
                .into(),
        ));
    }
    if holder.is_empty() {
        return Some(AdminFailure::InvalidArgument(
            "name the member to revoke".into(),
        ));
    }
    if holder == master {
        return Some(AdminFailure::Conflict(format!(
            "{holder} is the master: stop it (another node takes over), then revoke it"
        )));
    }
    if state.revoked.iter().any(|h| h == holder) {
        return Some(AdminFailure::Conflict(format!(
            "{holder} is already revoked"
        )));
    }
    None
}

impl MasterState {
    /// Sets or clears an instance's draft: the event is in the log when
    /// this returns (rank 0's runner follows; its status tells whether the
    /// draft runs).
    async fn set_draft(
        &mut self,
        request: &v1::SetDraftRequest,
    ) -> Result<v1::SetDraftReply, ActorProcessingErr> {
        let state = self.state().await?;
        let refuse = |failure: AdminFailure| v1::SetDraftReply {
            error: Some(failure.to_proto()),
            ..Default::default()
        };
        let (event, instance) =
            match draft_update(&state, &request.instance_id, request.draft.as_ref()) {
                Ok(update) => update,
                Err(failure) => return Ok(refuse(failure)),
            };
        let index = self.next_index;
        if !self.index(event).await? {
            return Ok(refuse(AdminFailure::Internal(
                "the log refused the draft".into(),
            )));
        }
        let mut shown = instance;
        shown.ring_secret = Vec::new();
        Ok(v1::SetDraftReply {
            instance: Some(shown),
            index,
            error: None,
        })
    }

    /// Revokes `holder`: its instances and its node go first (placed again
    /// elsewhere, as for a node that timed out), then the revocation.
    async fn revoke(&mut self, holder: &str) -> Result<v1::RevokeReply, ActorProcessingErr> {
        let state = self.state().await?;
        let refusal =
            revocation_refusal(&state, &self.session.master_node_id, self.secured, holder);
        if let Some(failure) = refusal {
            return Ok(v1::RevokeReply {
                index: 0,
                error: Some(failure.to_proto()),
            });
        }
        self.alive.remove(holder);
        self.node_gone(holder).await?;
        let index = self.next_index;
        let stored = self
            .index(Event {
                kind: Some(event::Kind::MemberRevoked(v1::MemberRevoked {
                    holder: holder.to_string(),
                })),
            })
            .await?;
        tracing::warn!(holder, index, "revoked a member of the cluster");
        Ok(v1::RevokeReply {
            index: if stored { index } else { 0 },
            error: (!stored).then(|| {
                AdminFailure::Internal("the log refused the revocation".into()).to_proto()
            }),
        })
    }
}

/// The id of the instance that `command_id` places: the model's folder
/// name (ids become zenoh key chunks: hub-style model ids lose their '/')
/// and 8 hex digits of a hash of the command id, whatever characters a
/// client put in it.
fn instance_id_for(model_id: &str, command_id: &str) -> String {
    let hash = placement::fnv1a(command_id.as_bytes());
    format!(
        "{}-{:08x}",
        crate::worker::downloads::folder_name(model_id),
        hash as u32
    )
}

/// Instances whose runners fail this many times in a row are given up.
pub const MAX_RUNNER_FAILURES: u32 = 5;

/// A runner's report in `event`: its id, and why it failed if it did
/// (`None`: it is ready, so its instance's failures are forgiven). Other
/// events and statuses: `None`.
fn runner_report(event: &Event) -> Option<(String, Option<String>)> {
    let Some(event::Kind::RunnerStatusUpdated(update)) = &event.kind else {
        return None;
    };
    match update.status.as_ref()?.state.as_ref()? {
        v1::runner_status::State::Failed(failed) => {
            Some((update.runner_id.clone(), Some(failed.reason.clone())))
        }
        v1::runner_status::State::Ready(_) => Some((update.runner_id.clone(), None)),
        _ => None,
    }
}

impl MasterState {
    /// Counts a runner's failure against its instance; at
    /// [`MAX_RUNNER_FAILURES`] in a row the instance is deleted with the
    /// reason, which the state keeps for the model's requests.
    async fn on_runner_report(
        &mut self,
        runner_id: &str,
        failed: Option<String>,
    ) -> Result<(), ActorProcessingErr> {
        let state = self.state().await?;
        let Some(instance) = state
            .instances
            .values()
            .find(|i| i.ranks.iter().any(|r| r.runner_id == runner_id))
        else {
            return Ok(());
        };
        let instance_id = instance.instance_id.clone();
        let Some(reason) = failed else {
            self.runner_failures.remove(&instance_id);
            return Ok(());
        };
        let count = self.runner_failures.entry(instance_id.clone()).or_insert(0);
        *count += 1;
        if *count < MAX_RUNNER_FAILURES {
            return Ok(());
        }
        self.runner_failures.remove(&instance_id);
        let reason = format!(
            "its runners failed {MAX_RUNNER_FAILURES} times in a row; the last time: {reason}"
        );
        tracing::warn!(instance_id, reason, "giving the instance up");
        self.index(Event {
            kind: Some(event::Kind::InstanceDeleted(v1::InstanceDeleted {
                instance_id,
                reason,
            })),
        })
        .await?;
        Ok(())
    }
}

impl MasterState {
    /// Deletes an instance at an admin's request.
    async fn delete(
        &mut self,
        request: &v1::DeleteInstanceRequest,
    ) -> Result<v1::DeleteInstanceReply, ActorProcessingErr> {
        let known = self
            .state()
            .await?
            .instances
            .contains_key(&request.instance_id);
        let answer = if !known {
            v1::DeleteInstanceReply {
                command_id: String::new(),
                error: Some(
                    AdminFailure::NotFound(format!("no instance {:?}", request.instance_id))
                        .to_proto(),
                ),
            }
        } else {
            self.index(Event {
                kind: Some(event::Kind::InstanceDeleted(v1::InstanceDeleted {
                    instance_id: request.instance_id.clone(),
                    ..Default::default()
                })),
            })
            .await?;
            v1::DeleteInstanceReply::default()
        };
        Ok(answer)
    }

    /// Starts, cancels or deletes a download at an admin's request.
    async fn download(
        &mut self,
        request: &v1::DownloadRequest,
    ) -> Result<v1::DownloadReply, ActorProcessingErr> {
        let command_id = uuid::Uuid::now_v7().to_string();
        let cluster = self.state().await?;
        let answer = match download_event(&cluster, request, &command_id) {
            Ok(event) => {
                if self.index(event).await? {
                    v1::DownloadReply {
                        command_id,
                        error: None,
                    }
                } else {
                    v1::DownloadReply {
                        command_id: String::new(),
                        error: Some(AdminFailure::Internal("the log refused it".into()).to_proto()),
                    }
                }
            }
            Err(failure) => v1::DownloadReply {
                command_id: String::new(),
                error: Some(failure.to_proto()),
            },
        };
        Ok(answer)
    }

    /// Adds a model card at an admin's request (not over a built-in one).
    async fn add_card(
        &mut self,
        card: v1::ModelCard,
    ) -> Result<v1::AddModelReply, ActorProcessingErr> {
        let answer = if crate::catalogue::card(&card.model_id).is_some() {
            v1::AddModelReply {
                error: Some(
                    AdminFailure::Conflict(format!("{} is a built-in model", card.model_id))
                        .to_proto(),
                ),
                ..Default::default()
            }
        } else {
            let stored = self
                .index(Event {
                    kind: Some(event::Kind::ModelCardAdded(v1::ModelCardAdded {
                        card: Some(card.clone()),
                    })),
                })
                .await?;
            if stored {
                v1::AddModelReply {
                    card: Some(card),
                    command_id: uuid::Uuid::now_v7().to_string(),
                    // The node that built the card says what it fetched.
                    bytes_fetched: 0,
                    error: None,
                }
            } else {
                v1::AddModelReply {
                    error: Some(
                        AdminFailure::InvalidArgument("the card was refused by the log".into())
                            .to_proto(),
                    ),
                    ..Default::default()
                }
            }
        };
        Ok(answer)
    }

    /// Logs a worker's report, once and in its sender's order; a runner's
    /// report also counts its failures.
    async fn local(&mut self, local: LocalEvent) -> Result<(), ActorProcessingErr> {
        let last = self.seen.get(&local.origin_node_id).copied().unwrap_or(0);
        if local.origin_seq <= last {
            return Ok(()); // a re-send
        }
        if local.previous_seq > last {
            // One before it was lost (sent to the master before this
            // one): its sender sends both again, in order.
            tracing::debug!(
                origin = local.origin_node_id,
                seq = local.origin_seq,
                missing = local.previous_seq,
                "a report arrived before the one it follows"
            );
            return Ok(());
        }
        let Some(event) = local.event else {
            return Ok(());
        };
        // Workers speak only for themselves.
        let speaker = match &event.kind {
            Some(event::Kind::NodeGatheredInfo(info)) => Some(&info.node_id),
            Some(event::Kind::NodeDownloadProgress(p)) => Some(&p.node_id),
            _ => None,
        };
        if let Some(speaker) = speaker {
            if *speaker != local.origin_node_id {
                let key = self.bus.keys.local_events();
                self.bus.count_dropped(&key, "node info for another node");
                return Ok(());
            }
        }
        self.seen
            .insert(local.origin_node_id.clone(), local.origin_seq);
        let runner = runner_report(&event);
        self.index_from(event, local.origin_node_id, local.origin_seq)
            .await?;
        if let Some((runner_id, failed)) = runner {
            self.on_runner_report(&runner_id, failed).await?;
        }
        Ok(())
    }
}

impl Actor for Master {
    type Msg = MasterMsg;
    type State = MasterState;
    type Arguments = MasterArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: MasterArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let state = call_t!(args.replica, ReplicaMsg::GetState, crate::ACTOR_CALL_MS)?;
        tracing::info!(next = state.last_index + 1, "master continues the log");
        let master = MasterState {
            session: SessionId {
                master_node_id: args.node_id,
                election_clock: args.clock,
            },
            bus: args.bus,
            replica: args.replica,
            next_index: state.last_index + 1,
            // Where each node's reports stand in the log: a report the old
            // master indexed is not indexed again when it is sent again.
            seen: state.local_seqs.clone(),
            runner_failures: BTreeMap::new(),
            alive: args.alive,
            max_concurrent: args.max_concurrent,
            secured: args.secured,
        };
        // Nodes the log knows that are gone now (the old master among them).
        let known: Vec<String> = state.nodes.keys().cloned().collect();
        for node in known {
            if node != master.session.master_node_id && !master.alive.contains(&node) {
                confirm_gone(myself.clone(), master.bus.clone(), node);
            }
        }
        Ok(master)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: MasterMsg,
        state: &mut MasterState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            MasterMsg::Command(command) => {
                tracing::debug!(command_id = command.command_id, "command");
                for event in state.events_for(&command).await? {
                    state.index(event).await?;
                }
            }
            MasterMsg::Place(request, reply) => {
                let answer = state.place(&request).await?;
                let _ = reply.send(answer);
            }
            MasterMsg::Delete(request, reply) => {
                let answer = state.delete(&request).await?;
                let _ = reply.send(answer);
            }
            MasterMsg::Download(request, reply) => {
                let answer = state.download(&request).await?;
                let _ = reply.send(answer);
            }
            MasterMsg::AddCard(card, reply) => {
                let answer = state.add_card(card).await?;
                let _ = reply.send(answer);
            }
            MasterMsg::Local(local) => state.local(local).await?,
            MasterMsg::SetDraft(request, reply) => {
                let answer = state.set_draft(&request).await?;
                let _ = reply.send(answer);
            }
            MasterMsg::Revoke(request, reply) => {
                let answer = state.revoke(&request.holder).await?;
                let _ = reply.send(answer);
            }
            MasterMsg::NodeAlive(node) => {
                state.alive.insert(node);
            }
            MasterMsg::NodeGone(node) => {
                state.alive.remove(&node);
                confirm_gone(myself, state.bus.clone(), node);
            }
            MasterMsg::NodeStillGone(node) => {
                if !state.alive.contains(&node) {
                    state.node_gone(&node).await?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state with node "a" (`available` bytes free) running instance "i"
    /// of the default model.
    fn running(available: u64) -> ClusterState {
        let mut state = ClusterState::default();
        state.nodes.insert(
            "a".into(),
            v1::NodeState {
                info: Some(v1::NodeInfo {
                    memory_available_bytes: available,
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
        state
    }

    fn asked(method: v1::DraftMethod, model: &str, tokens: u32) -> v1::InstanceDraft {
        v1::InstanceDraft {
            method: method as i32,
            draft_model: model.into(),
            num_draft_tokens: tokens,
            draft_card: None,
        }
    }

    fn refusal(state: &ClusterState, id: &str, draft: Option<v1::InstanceDraft>) -> String {
        match draft_update(state, id, draft.as_ref()) {
            Ok(_) => "accepted".into(),
            Err(failure) => format!("{:?}: {failure}", failure.kind()),
        }
    }

    #[test]
    fn a_draft_is_checked_before_it_becomes_an_event() {
        use v1::DraftMethod as M;
        const GB: u64 = 1_000_000_000;
        let state = running(8 * GB);
        let target = state.instances["i"]
            .model
            .as_ref()
            .map(|m| m.model_id.clone())
            .unwrap_or_default();
        let cases = [
            (
                "ghost",
                Some(asked(M::Ngram, "", 4)),
                "NotFound: no instance \"ghost\"",
            ),
            (
                "i",
                Some(asked(M::Ngram, "", 17)),
                "InvalidArgument: num_draft_tokens must be between 1 and 16, got 17",
            ),
            (
                "i",
                Some(asked(M::Ngram, "m", 4)),
                "InvalidArgument: prompt lookup (ngram) needs no model, but draft_model is \"m\"",
            ),
            (
                "i",
                Some(asked(M::DraftModel, "", 4)),
                "InvalidArgument: a draft_model draft names its model (draft_model)",
            ),
            (
                "i",
                Some(asked(M::DraftModel, "no-such-model", 4)),
                "NotFound: unknown draft model \"no-such-model\"",
            ),
            ("i", Some(asked(M::Ngram, "", 16)), "accepted"),
            ("i", Some(asked(M::DraftModel, &target, 1)), "accepted"),
            ("i", None, "accepted"),
            ("i", Some(asked(M::Unspecified, "", 99)), "accepted"),
        ];
        for (id, draft, expected) in cases {
            assert_eq!(
                refusal(&state, id, draft.clone()),
                expected,
                "{id} {draft:?}"
            );
        }
        // Defaults filled in, the card attached.
        let (event, instance) =
            draft_update(&state, "i", Some(&asked(M::DraftModel, &target, 0))).expect("valid");
        let draft = instance.draft.expect("a draft");
        assert_eq!(draft.num_draft_tokens, 4);
        assert_eq!(draft.draft_card.map(|c| c.model_id), Some(target.clone()));
        assert!(matches!(
            event.kind,
            Some(event::Kind::InstanceDraftModelUpdated(ref u)) if u.instance_id == "i"
        ));
        // Off, either way, is an update without a draft.
        let (_, off) = draft_update(&state, "i", Some(&asked(M::Unspecified, "", 0))).expect("off");
        assert_eq!(off.draft, None);
        // A draft model that does not fit beside the instance.
        let full = running(300_000_000);
        let why = refusal(&full, "i", Some(asked(M::DraftModel, &target, 4)));
        assert!(
            why.starts_with("DoesNotFit: ") && why.contains("rank 0's node a"),
            "{why}"
        );
        assert_eq!(
            refusal(&full, "i", Some(asked(M::Ngram, "", 4))),
            "accepted"
        );
    }

    #[test]
    fn only_a_secured_clusters_other_members_are_revoked_once() {
        let mut state = ClusterState::default();
        let refused = |state: &ClusterState, secured, holder| {
            revocation_refusal(state, "m", secured, holder).map(|f| f.to_string())
        };
        assert!(refused(&state, false, "b").is_some_and(|why| why.contains("open cluster")));
        assert!(refused(&state, true, "").is_some());
        assert!(refused(&state, true, "m").is_some_and(|why| why.contains("is the master")));
        assert_eq!(refused(&state, true, "b"), None);
        state.revoked.push("b".into());
        assert!(refused(&state, true, "b").is_some_and(|why| why.contains("already")));
        assert_eq!(refused(&state, true, "laptop"), None);
    }
}
