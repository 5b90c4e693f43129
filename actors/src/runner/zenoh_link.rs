//! The runner's zenoh client session to its node: statuses on
//! `runner/{id}/events`, chunks on `chunks/{command_id}`, orders from
//! `runner/{id}/tasks` into the Runner's mailbox.

use prost::Message;
use ractor::ActorRef;
use tessera_protos::v1;

use super::{RunnerMsg, RunnerOutput};
use crate::keys::{KeyError, Keys};
use crate::runner_protocol::order_from_task;

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
    session: zenoh::Session,
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
        let session = zenoh::open(config)
            .await
            .map_err(|e| LinkError::Unreachable {
                endpoints: connect.join(","),
                message: e.to_string(),
            })?;
        Ok(Self {
            events: keys.runner(runner_id, "events")?,
            keys,
            session,
        })
    }

    /// Hands each order that decodes to the runner; one that does not is
    /// dropped with a warning.
    pub async fn subscribe_orders(
        &self,
        runner_id: &str,
        runner: ActorRef<RunnerMsg>,
    ) -> Result<zenoh::pubsub::Subscriber<()>, LinkError> {
        self.session
            .declare_subscriber(self.keys.runner(runner_id, "tasks")?)
            .callback(move |sample| {
                let order = v1::Task::decode(sample.payload().to_bytes().as_ref())
                    .map_err(|e| e.to_string())
                    .and_then(|task| order_from_task(&task).map_err(|e| e.to_string()));
                match order {
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
        let _ = self.session.close().await;
    }

    async fn put<M: Message>(&self, key: &str, message: &M) {
        let sent = self
            .session
            .put(key, message.encode_to_vec())
            .encoding(zenoh::bytes::Encoding::APPLICATION_PROTOBUF)
            .congestion_control(zenoh::qos::CongestionControl::Block)
            .await;
        if let Err(error) = sent {
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
