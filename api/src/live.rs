//! What the dashboard watches: `/cluster` (this node and the master it
//! follows), `/state`, `/state/stream` (the state pushed on each change) and
//! `/state/at` (the state folded from the log up to an index: time travel,
//! the same fold as `tessera replay --until N`).

use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::Response;
use axum::Json;
use ractor::call_t;
use serde::Deserialize;
use serde_json::{json, Value};
use tessera_state::{ReplayError, ReplayOptions};

use tessera_protos::v1;

use super::context::{stopped, Api};
use super::error::ApiError;
use super::sse::{data, sse_channel};
use tessera_actors::cluster::replica::ReplicaMsg;

/// The most state messages a stream sends a second: a burst of events
/// (a download's progress, a batch of tasks) becomes one message.
const STREAM_INTERVAL: Duration = Duration::from_millis(250);
/// How often a stream looks at the leadership, which changes without an
/// event (an election under way).
const LEADERSHIP_POLL: Duration = Duration::from_millis(500);

impl Api {
    /// This node, the master it follows (none while electing), and
    /// whether its links are mutual TLS (`tessera cluster init` / `--join`).
    fn cluster_json(&self) -> Value {
        let master = self.leadership.master();
        json!({
            "node_id": self.node_id,
            "master": master.as_ref().map(|(id, _)| id),
            "election_clock": master.as_ref().map_or(0, |(_, clock)| *clock),
            "electing": master.is_none(),
            "secured": self.secured,
        })
    }
}

/// `GET /cluster`.
pub(super) async fn cluster(State(api): State<Api>) -> Json<Value> {
    Json(api.cluster_json())
}

/// A state as JSON, with its index and digest (the shape of `/state`),
/// its rings' secrets left out.
fn state_json(state: &tessera_state::State) -> Result<Value, ApiError> {
    let mut proto = state.as_proto().clone();
    for instance in proto.instances.values_mut() {
        redact(instance);
    }
    Ok(json!({
        "last_index": proto.last_index,
        "digest": state.digest().to_string(),
        "state": serde_json::to_value(&proto).map_err(|e| ApiError::internal(e.to_string()))?,
    }))
}

/// An instance as the HTTP API shows it: without its ring's secret, which
/// only the cluster's members may know (a key to use the models is not a
/// key to join an instance's ring).
pub(super) fn redact(instance: &mut v1::Instance) {
    instance.ring_secret.clear();
}

/// An event as the HTTP API shows it (see [`redact`]).
pub(super) fn redact_event(event: &mut v1::IndexedEvent) {
    if let Some(v1::event::Kind::InstanceCreated(created)) =
        event.event.as_mut().and_then(|e| e.kind.as_mut())
    {
        if let Some(instance) = created.instance.as_mut() {
            redact(instance);
        }
    }
}

/// `GET /state`: the state as this node has folded it.
pub(super) async fn state(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
    let state = tessera_state::State::from_proto((*api.state().await?).clone());
    state_json(&state).map(Json)
}

/// `GET /state/stream`: the state at once, then again on each change (at
/// most one message per [`STREAM_INTERVAL`]), each with the leadership.
pub(super) async fn state_stream(State(api): State<Api>) -> Response {
    let (tx, response) = sse_channel();
    tokio::spawn(async move {
        let mut view = api.state.clone();
        let mut stopping = api.stopping.clone();
        loop {
            let state = tessera_state::State::from_proto((**view.borrow_and_update()).clone());
            let cluster = api.cluster_json();
            let Ok(mut message) = state_json(&state) else {
                return;
            };
            message["cluster"] = cluster.clone();
            if tx.send(data(&message)).await.is_err() {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(STREAM_INTERVAL) => {}
                _ = tx.closed() => return,
                _ = stopped(&mut stopping) => return,
            }
            // Wait for a new state, or a new leadership, or the client to go.
            loop {
                tokio::select! {
                    changed = view.changed() => match changed {
                        Ok(()) => break,
                        Err(_) => return,
                    },
                    _ = tokio::time::sleep(LEADERSHIP_POLL) => {
                        if api.cluster_json() != cluster {
                            break;
                        }
                    }
                    _ = tx.closed() => return,
                    _ = stopped(&mut stopping) => return,
                }
            }
        }
    });
    response
}

#[derive(Deserialize)]
pub(super) struct AtQuery {
    index: u64,
}

/// `GET /state/at?index=N`: the state folded from this node's log up to
/// and including event N (from the nearest snapshot), off the replica.
pub(super) async fn state_at(
    State(api): State<Api>,
    Query(query): Query<AtQuery>,
) -> Result<Json<Value>, ApiError> {
    let view = call_t!(api.replica, ReplicaMsg::View, tessera_actors::ACTOR_CALL_MS)
        .map_err(|e| ApiError::unavailable(format!("the node's log did not answer: {e}")))?;
    let index = query.index;
    let replayed = tokio::task::spawn_blocking(move || {
        view.replay(ReplayOptions {
            until: Some(index),
            use_snapshots: true,
        })
    })
    .await
    .map_err(|e| ApiError::internal(format!("folding the log: {e}")))?;
    let state = match replayed {
        Ok(replayed) => replayed.state,
        Err(error @ ReplayError::PastEnd { .. }) => {
            return Err(ApiError::invalid("index", error.to_string()))
        }
        Err(error) => return Err(ApiError::internal(error.to_string())),
    };
    let mut answer = state_json(&state)?;
    answer["index"] = json!(index);
    Ok(Json(answer))
}
