//! What a request's `model` names (an instance or a model), and the wait
//! until an instance of it is ready, placing one first where allowed.

use std::time::{Duration, Instant};

use tessera_protos::v1::{self, download_progress::State as Ds, runner_status::State as Rs};

use super::context::Api;
use super::error::ApiError;
use tessera_actors::bus::keys::AdminMethod;

/// What a request's `model` names.
pub(super) struct Target {
    /// An instance named directly, or empty (any ready instance of the model).
    pub(super) instance_id: String,
    pub(super) model_id: String,
    pub(super) context: u32,
}

impl Api {
    /// The target of `model`, the request's parameters checked against its
    /// card, and a ready instance (placed first where allowed).
    pub(super) async fn prepare(
        &self,
        model: &str,
        to_params: impl FnOnce(u32) -> Result<v1::TextGenerationParams, ApiError>,
    ) -> Result<(Target, v1::TextGenerationParams), ApiError> {
        let target = self.target(model).await?;
        let params = to_params(target.context)?;
        self.ready(&target, self.options.auto_place).await?;
        Ok((target, params))
    }

    /// Whether a request for `target` can go to an instance now.
    pub(super) async fn is_ready(&self, target: &Target) -> Result<bool, ApiError> {
        if !target.instance_id.is_empty() {
            return Ok(true);
        }
        let state = self.state().await?;
        Ok(state.instances.values().any(|i| {
            i.model
                .as_ref()
                .is_some_and(|m| m.model_id == target.model_id)
                && rank0_ready(&state, i)
        }))
    }

    /// One line on how the instances of `model` are getting ready.
    pub(super) async fn progress(&self, model: &str) -> String {
        let Ok(state) = self.state().await else {
            return format!("waiting for {model}");
        };
        let mut parts = Vec::new();
        for instance in state
            .instances
            .values()
            .filter(|i| i.model.as_ref().is_some_and(|m| m.model_id == model))
        {
            for rank in &instance.ranks {
                let download = state
                    .downloads
                    .get(&rank.node_id)
                    .and_then(|d| d.models.get(model))
                    .and_then(|p| p.state.as_ref());
                let status = match state
                    .runners
                    .get(&rank.runner_id)
                    .and_then(|s| s.state.as_ref())
                {
                    None => match download {
                        Some(Ds::Ongoing(o)) => format!(
                            "downloading {:.0}% ({:.1} MB/s)",
                            100.0 * o.downloaded_bytes as f64 / o.total_bytes.max(1) as f64,
                            o.bytes_per_second as f64 / 1e6
                        ),
                        _ => "starting".to_string(),
                    },
                    Some(Rs::Loading(l)) if l.layers_total > 0 => {
                        format!("loading {}/{} layers", l.layers_loaded, l.layers_total)
                    }
                    Some(other) => format!("{other:?}")
                        .split('(')
                        .next()
                        .unwrap_or_default()
                        .to_lowercase(),
                };
                parts.push(format!(
                    "{} rank {}: {status}",
                    instance.instance_id, rank.rank
                ));
            }
        }
        if parts.is_empty() {
            format!("placing {model}")
        } else {
            format!("waiting for {model}: {}", parts.join(", "))
        }
    }

    /// The instance for `model` (an instance id or a model id); places the
    /// model and waits for it when allowed.
    pub(super) async fn resolve_placing(
        &self,
        model: &str,
        place: bool,
    ) -> Result<Target, ApiError> {
        let (target, _) = self.find_target(model).await?;
        self.ready(&target, place).await?;
        Ok(target)
    }

    /// What `model` names (an instance or a model) for a generation,
    /// without waiting: the request is checked against its card before
    /// anything is placed. An embedding model is refused.
    pub(super) async fn target(&self, model: &str) -> Result<Target, ApiError> {
        let (target, card) = self.find_target(model).await?;
        if tessera_actors::catalogue::task::is_embedding(&card) {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "{} is an embedding model: it makes vectors (POST /v1/embeddings or \
                     /api/embed), not text",
                    card.model_id
                ),
            ));
        }
        Ok(target)
    }

    /// What `model` names for an embedding request; a model that makes no
    /// embeddings is refused, naming those that do.
    pub(super) async fn embedding_target(&self, model: &str) -> Result<Target, ApiError> {
        let (target, card) = self.find_target(model).await?;
        if tessera_actors::catalogue::task::embeds(&card) {
            return Ok(target);
        }
        let state = self.state().await?;
        let mut embedders: Vec<String> = tessera_actors::catalogue::all(&state)
            .into_iter()
            .filter(tessera_actors::catalogue::task::embeds)
            .map(|c| c.model_id)
            .collect();
        embedders.sort();
        Err(ApiError::invalid(
            "model",
            format!(
                "{} makes text, not embeddings (embedding models: {})",
                card.model_id,
                embedders.join(", ")
            ),
        ))
    }

    /// The target `model` names and the card it was resolved to.
    async fn find_target(&self, model: &str) -> Result<(Target, v1::ModelCard), ApiError> {
        let state = self.state().await?;
        if let Some(instance) = state.instances.get(model) {
            let card = instance.model.clone().unwrap_or_default();
            let target = Target {
                instance_id: instance.instance_id.clone(),
                model_id: card.model_id.clone(),
                context: card.context_length,
            };
            return Ok((target, card));
        }
        // Cards of placed instances first: an instance keeps the card it
        // was placed with.
        let mut cards: Vec<v1::ModelCard> = state
            .instances
            .values()
            .filter_map(|i| i.model.clone())
            .collect();
        cards.extend(tessera_actors::catalogue::all(&state));
        let card = match tessera_actors::catalogue::resolve(&cards, model) {
            Ok(Some(card)) => card,
            Ok(None) => {
                let mut known: Vec<String> = cards.into_iter().map(|c| c.model_id).collect();
                known.sort();
                known.dedup();
                return Err(ApiError::not_found(
                    "model_not_found",
                    format!(
                        "the model {model:?} does not exist (known: {})",
                        known.join(", ")
                    ),
                ));
            }
            Err(several) => {
                return Err(ApiError::invalid(
                    "model",
                    format!(
                        "{model:?} could mean several models; name one of {}",
                        several.join(", ")
                    ),
                ))
            }
        };
        let target = Target {
            instance_id: String::new(),
            model_id: card.model_id.clone(),
            context: card.context_length,
        };
        Ok((target, card))
    }

    /// Waits until an instance of the target's model is ready, placing one
    /// first if there is none and `place` allows it.
    pub(super) async fn ready(&self, target: &Target, place: bool) -> Result<(), ApiError> {
        if !target.instance_id.is_empty() {
            // A named instance: the master says if it is not ready.
            return Ok(());
        }
        let model = target.model_id.as_str();
        let state = self.state().await?;
        let (any, ready) = of_model(&state, model);
        if ready {
            return Ok(());
        }
        if !any {
            if let Some(reason) = state.given_up.get(model) {
                return Err(given_up(model, reason));
            }
            if !place {
                return Err(ApiError::not_found(
                    "model_not_placed",
                    format!(
                        "no instance of {model:?}: place one with `tessera admin place {model}` or POST /place_instance"
                    ),
                ));
            }
            self.place(model).await?;
        }
        self.wait_until_ready(model, place).await
    }

    /// Places an instance of `model` (once the nodes have reported, just
    /// after start-up).
    async fn place(&self, model: &str) -> Result<(), ApiError> {
        let has_a_worker = |state: &v1::ClusterState| {
            state
                .nodes
                .values()
                .any(|n| n.info.as_ref().is_some_and(|i| !i.no_worker))
        };
        // Just after start-up the nodes may not have reported yet.
        let _ = self
            .state_where(Instant::now() + Duration::from_secs(10), has_a_worker)
            .await;
        tracing::info!(model, "no instance; placing one");
        let reply: v1::PlaceInstanceReply = self
            .ask(
                AdminMethod::Place,
                &v1::PlaceInstanceRequest {
                    model_id: model.to_string(),
                    sharding: v1::Sharding::Pipeline as i32,
                    min_nodes: 1,
                    node_ids: Vec::new(),
                    // Asked again under the same id: placed once.
                    request_id: uuid::Uuid::now_v7().to_string(),
                },
            )
            .await?;
        match reply.error {
            Some(error) => Err(ApiError {
                code: Some("model_does_not_fit"),
                ..ApiError::unavailable(format!("placing {model}: {}", error.message))
            }),
            None => Ok(()),
        }
    }

    /// Waits, on each change of the state, until an instance of `model`
    /// is ready; says at once why not when it never will be.
    async fn wait_until_ready(&self, model: &str, placed_here: bool) -> Result<(), ApiError> {
        let started = Instant::now();
        let deadline = started + self.options.ready_timeout;
        let mut changes = self.state.clone();
        let mut last_report = Instant::now();
        loop {
            let state = changes.borrow_and_update().clone();
            match of_model(&state, model) {
                (_, true) => {
                    tracing::info!(model, waited = ?started.elapsed(), "instance ready");
                    return Ok(());
                }
                (false, _) if state.given_up.contains_key(model) => {
                    let reason = state.given_up.get(model).cloned().unwrap_or_default();
                    return Err(given_up(model, &reason));
                }
                (false, _) if !placed_here => {
                    return Err(ApiError::not_found(
                        "model_not_placed",
                        format!("the instance of {model:?} is gone"),
                    ))
                }
                _ => {}
            }
            // A node that cannot get the files: say why at once (after a
            // moment, so a failure left from an earlier try is retried).
            if started.elapsed() > DOWNLOAD_RETRY_GRACE {
                if let Some(reason) = download_failure(&state, model) {
                    return Err(ApiError::unavailable(reason));
                }
            }
            if last_report.elapsed() > Duration::from_secs(5) {
                last_report = Instant::now();
                tracing::info!(model, waited = ?started.elapsed(), "waiting for the instance");
            }
            // The next change, or a moment later (the download grace ends
            // without a change).
            let wake = deadline.min(Instant::now() + Duration::from_secs(1));
            let changed = tokio::time::timeout_at(wake.into(), changes.changed()).await;
            if let Ok(Err(_)) = changed {
                return Err(ApiError::unavailable(
                    "the node's state is gone (stopping?)",
                ));
            }
            if Instant::now() >= deadline {
                return Err(ApiError::unavailable(format!(
                    "{model} is not ready after {:?}",
                    self.options.ready_timeout
                )));
            }
        }
    }

    /// The state once `wanted` holds of it, or the last one at `deadline`.
    async fn state_where(
        &self,
        deadline: Instant,
        wanted: impl Fn(&v1::ClusterState) -> bool,
    ) -> std::sync::Arc<v1::ClusterState> {
        let mut changes = self.state.clone();
        let found =
            tokio::time::timeout_at(deadline.into(), changes.wait_for(|state| wanted(state))).await;
        if let Ok(Ok(state)) = found {
            return state.clone();
        }
        let last = self.state.borrow().clone();
        last
    }
}

/// Whether `state` has an instance of `model`, and whether one is ready.
fn of_model(state: &v1::ClusterState, model: &str) -> (bool, bool) {
    let mut any = false;
    let mut ready = false;
    for instance in state.instances.values() {
        if instance.model.as_ref().is_some_and(|m| m.model_id == model) {
            any = true;
            ready |= rank0_ready(state, instance);
        }
    }
    (any, ready)
}

/// Whether every rank of `instance` has a runner ready (or running).
pub(crate) fn rank0_ready(state: &v1::ClusterState, instance: &v1::Instance) -> bool {
    let ready = |rank: &v1::InstanceRank| {
        let status = state.runners.get(&rank.runner_id);
        let state = status.and_then(|s| s.state.as_ref());
        matches!(state, Some(Rs::Ready(_) | Rs::Running(_)))
    };
    instance.ranks.iter().all(ready)
}

/// A request for a model whose instance the cluster gave up.
fn given_up(model: &str, reason: &str) -> ApiError {
    ApiError {
        code: Some("model_failed"),
        ..ApiError::unavailable(format!(
            "the instance of {model} was given up: {reason}; fix the cause, then place it \
             again with `tessera admin place {model}` or POST /place_instance"
        ))
    }
}

/// How long a failed download left from an earlier try may stand before a
/// waiting request gives up on it (a new instance makes its nodes try again).
const DOWNLOAD_RETRY_GRACE: Duration = Duration::from_secs(3);

/// Why a node of an instance of `model` cannot get its files, if one cannot.
fn download_failure(state: &v1::ClusterState, model: &str) -> Option<String> {
    state
        .instances
        .values()
        .filter(|i| i.model.as_ref().is_some_and(|m| m.model_id == model))
        .flat_map(|i| &i.ranks)
        .find_map(|rank| {
            let progress = state.downloads.get(&rank.node_id)?.models.get(model)?;
            match &progress.state {
                Some(Ds::Failed(f)) => Some(format!(
                    "node {} cannot get the files of {model}: {}",
                    rank.node_id, f.reason
                )),
                _ => None,
            }
        })
}
