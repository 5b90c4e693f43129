//! What every handler holds: the node's handles (bus, replica, the
//! state it publishes, the leadership), the options, and admission (a
//! bound on the requests per model a node holds at once).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use ractor::ActorRef;
use tessera_protos::v1;

use super::error::ApiError;
use super::options::ApiOptions;
use tessera_actors::bus::Bus;
use tessera_actors::cluster::election::actor::Leadership;
use tessera_actors::cluster::replica::{ReplicaMsg, StateView};

#[derive(Clone)]
pub(super) struct Api {
    pub(super) node_id: String,
    pub(super) bus: Bus,
    pub(super) replica: ActorRef<ReplicaMsg>,
    /// The state, as the replica last published it.
    pub(super) state: StateView,
    /// The master this node follows (none while electing).
    pub(super) leadership: Leadership,
    /// This node's links are mutual TLS (it holds cluster credentials,
    /// which only appear at a start).
    pub(super) secured: bool,
    pub(super) options: Arc<ApiOptions>,
    /// Turns true when the API stops: endless streams (the state, the
    /// events) end then, so that the drain does not wait on them.
    pub(super) stopping: tokio::sync::watch::Receiver<bool>,
    /// Requests in hand per model.
    pub(super) queues: Queues,
}

impl Api {
    pub(super) async fn state(&self) -> Result<Arc<v1::ClusterState>, ApiError> {
        Ok(self.state.borrow().clone())
    }
}

/// Once the API is told to stop (or its server is gone).
pub(super) async fn stopped(stopping: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(super) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Requests in hand per model, each bounded by the queue limit: one more
/// is answered 429 at once instead of waiting without end.
#[derive(Clone)]
pub(super) struct Queues {
    counts: Arc<Mutex<HashMap<String, usize>>>,
    limit: usize,
}

impl Queues {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            counts: Arc::new(Mutex::new(HashMap::new())),
            limit,
        }
    }

    /// A slot for a request for `model`, or 429 if its queue is full.
    pub(super) fn take(&self, model: &str) -> Result<QueueSlot, ApiError> {
        let mut counts = self
            .counts
            .lock()
            .map_err(|_| ApiError::internal("queue bookkeeping"))?;
        let n = counts.entry(model.to_string()).or_insert(0);
        if *n >= self.limit {
            return Err(ApiError::too_many(format!(
                "{} requests for {model} are already waiting or running on this node; retry shortly",
                self.limit
            )));
        }
        *n += 1;
        Ok(QueueSlot {
            counts: self.counts.clone(),
            model: model.to_string(),
        })
    }
}

/// Counts a request against its model's bound until dropped.
pub(super) struct QueueSlot {
    counts: Arc<Mutex<HashMap<String, usize>>>,
    model: String,
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        if let Ok(mut counts) = self.counts.lock() {
            if let Some(n) = counts.get_mut(&self.model) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_answers_429_until_a_slot_is_let_go() -> Result<(), ApiError> {
        let queues = Queues::new(2);
        let first = queues.take("m")?;
        let _second = queues.take("m")?;
        let refused = queues.take("m").err().map(|e| e.status.as_u16());
        assert_eq!(refused, Some(429));
        // Another model has a queue of its own.
        let _other = queues.take("n")?;
        drop(first);
        queues.take("m")?;
        Ok(())
    }
}
