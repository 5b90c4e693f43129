//! The runner's zenoh client session to its node: statuses on
//! `runner/{id}/events`, chunks on `chunks/{command_id}`, orders from
//! `runner/{id}/tasks` into the Runner's mailbox.

use std::sync::Arc;

use prost::Message;
use ractor::ActorRef;
use tessera_protos::v1;

use super::{RunnerMsg, RunnerOutput};
use crate::bus::keys::{KeyError, Keys};
use crate::bus::{Author, Bus, Signatures};
use crate::worker::runner_protocol::order_from_task;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("the zenoh configuration: {0}")]
    Config(String),
    #[error("reaching the node at {endpoints}: {message}")]
    Unreachable { endpoints: String, message: String },
    #[error("subscribing to orders: {0}")]
    Subscribe(String),
}

#[derive(Clone)]
pub struct ZenohLink {
    bus: Bus,
    keys: Keys,
    events: String,
}

impl ZenohLink {
    /// Opens a client session to the node's endpoints (with the node's
    /// credentials in a secured cluster).
    pub async fn open(
        namespace: &str,
        runner_id: &str,
        connect: &[String],
        tls: Option<&tessera_trust::Credentials>,
    ) -> Result<Self, LinkError> {
        let keys = Keys::new(namespace)?;
        let config = crate::bus::zenoh_config("client", &[], connect, false, tls)
            .map_err(|e| LinkError::Config(e.to_string()))?;
        // A runner signs with its node's key and takes orders from nodes only.
        let signatures = match tls {
            Some(credentials) => Some(Arc::new(
                Signatures::load(credentials).map_err(|e| LinkError::Config(e.to_string()))?,
            )),
            None => None,
        };
        let session = zenoh::open(config)
            .await
            .map_err(|e| LinkError::Unreachable {
                endpoints: connect.join(","),
                message: e.to_string(),
            })?;
        Ok(Self {
            events: keys.runner(runner_id, "events")?,
            bus: Bus::new(session, keys.clone()).with_signatures(signatures),
            keys,
        })
    }

    /// Hands each order that decodes to the runner; one that does not is
    /// dropped with a warning.
    pub async fn subscribe_orders(
        &self,
        runner_id: &str,
        runner: ActorRef<RunnerMsg>,
    ) -> Result<zenoh::pubsub::Subscriber<()>, LinkError> {
        let bus = self.bus.clone();
        self.bus
            .session
            .declare_subscriber(self.keys.runner(runner_id, "tasks")?)
            .callback(move |sample| {
                let Some(task) = bus.take::<v1::Task>(&sample, |_| Author::AnyNode) else {
                    return;
                };
                match order_from_task(&task).map_err(|e| e.to_string()) {
                    Ok(order) => {
                        let _ = runner.cast(RunnerMsg::Order(order));
                    }
                    Err(error) => tracing::warn!(error, "dropped an order that does not decode"),
                }
            })
            .await
            .map_err(|e| LinkError::Subscribe(e.to_string()))
    }

    pub async fn close(&self) {
        self.bus.close().await;
    }

    async fn put<M: Message>(&self, key: &str, message: &M) {
        if let Err(error) = self.bus.put(key, message).await {
            tracing::warn!(%error, key, "publishing");
        }
    }
}

impl RunnerOutput for ZenohLink {
    async fn status(&self, status: &v1::RunnerStatus) {
        self.put(&self.events, status).await;
    }

    async fn chunk(&self, chunk: &v1::GenerationChunk) {
        match self.keys.chunks(&chunk.command_id) {
            Ok(key) => self.put(&key, chunk).await,
            Err(error) => tracing::warn!(%error, "a chunk with a bad command id"),
        }
    }
}
