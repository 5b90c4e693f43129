//! The node's one zenoh session, typed: protobuf messages out, protobuf
//! messages in. A payload that does not decode is dropped, counted and
//! logged; it never reaches an actor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use zenoh::bytes::Encoding;

use crate::keys::Keys;

/// Why a publication or a query failed.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("zenoh: {0}")]
    Zenoh(String),
    #[error("no reply on {key} within {timeout:?}")]
    NoReply { key: String, timeout: Duration },
    #[error("zenoh configuration {key}: {reason}")]
    Config { key: String, reason: String },
}

impl BusError {
    pub fn zenoh(error: impl std::fmt::Display) -> Self {
        Self::Zenoh(error.to_string())
    }
}

/// The zenoh configuration of a session: its mode (`peer`, `client`),
/// endpoints and multicast scouting.
pub fn zenoh_config(
    mode: &str,
    listen: &[String],
    connect: &[String],
    multicast: bool,
) -> Result<zenoh::Config, BusError> {
    let mut config = zenoh::Config::default();
    let mut set = |key: &str, value: String| {
        config
            .insert_json5(key, &value)
            .map_err(|e| BusError::Config {
                key: key.to_string(),
                reason: e.to_string(),
            })
    };
    set("mode", format!("{mode:?}"))?;
    let list = |items: &[String]| format!("{items:?}");
    if !listen.is_empty() {
        set("listen/endpoints", list(listen))?;
    }
    if !connect.is_empty() {
        set("connect/endpoints", list(connect))?;
    }
    set("scouting/multicast/enabled", multicast.to_string())?;
    // A peer that went away (a node restarting) is dialled again within a
    // second, well inside the election's rejoin listen.
    set(
        "connect/retry",
        "{ period_init_ms: 250, period_max_ms: 1000, period_increase_factor: 2 }".into(),
    )?;
    Ok(config)
}

/// A zenoh session with the namespace's keys and a counter of dropped
/// messages. Cheap to clone.
#[derive(Clone)]
pub struct Bus {
    pub session: zenoh::Session,
    pub keys: Keys,
    dropped: Arc<AtomicU64>,
}

impl Bus {
    pub fn new(session: zenoh::Session, keys: Keys) -> Self {
        Self {
            session,
            keys,
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Publishes `message` on `key`.
    pub async fn put<M: Message>(&self, key: &str, message: &M) -> Result<(), BusError> {
        // Block rather than drop under congestion: a dropped event costs a
        // catch-up, a dropped chunk a hole in someone's answer.
        self.session
            .put(key, message.encode_to_vec())
            .encoding(Encoding::APPLICATION_PROTOBUF)
            .congestion_control(zenoh::qos::CongestionControl::Block)
            .await
            .map_err(BusError::zenoh)
    }

    /// Decodes a payload, or drops and counts it.
    pub fn decode<M: Message + Default>(&self, key: &str, bytes: &[u8]) -> Option<M> {
        match M::decode(bytes) {
            Ok(message) => Some(message),
            Err(error) => {
                self.count_dropped(key, &error.to_string());
                None
            }
        }
    }

    /// Counts a message dropped for any reason (malformed, or well-formed
    /// but invalid).
    pub fn count_dropped(&self, key: &str, why: &str) {
        let total = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(key, why, total, "dropped a message");
    }

    /// Messages dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Sends `request` to the queryables on `selector` and returns the
    /// first reply that decodes.
    pub async fn query<Req: Message, Rep: Message + Default>(
        &self,
        selector: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Rep, BusError> {
        let mut replies = self
            .query_all::<Req, Rep>(selector, request, timeout)
            .await?;
        if replies.is_empty() {
            return Err(BusError::NoReply {
                key: selector.to_string(),
                timeout,
            });
        }
        Ok(replies.swap_remove(0))
    }

    /// Whether `node`'s liveliness token is there now (asked of zenoh, at
    /// most `timeout`); a failed query counts as gone.
    pub async fn is_alive(&self, node: &str, timeout: Duration) -> bool {
        let Ok(key) = self.keys.alive(node) else {
            return false;
        };
        match self.session.liveliness().get(&key).timeout(timeout).await {
            Ok(replies) => {
                let mut alive = false;
                while let Ok(reply) = replies.recv_async().await {
                    alive |= reply.result().is_ok();
                }
                alive
            }
            Err(error) => {
                tracing::warn!(%error, node, "liveliness query");
                false
            }
        }
    }

    /// Every reply that decodes, in arrival order.
    pub async fn query_all<Req: Message, Rep: Message + Default>(
        &self,
        selector: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Vec<Rep>, BusError> {
        let replies = self
            .session
            .get(selector)
            .payload(request.encode_to_vec())
            .encoding(Encoding::APPLICATION_PROTOBUF)
            .timeout(timeout)
            .await
            .map_err(BusError::zenoh)?;
        let mut out = Vec::new();
        while let Ok(reply) = replies.recv_async().await {
            match reply.result() {
                Ok(sample) => {
                    if let Some(message) = self.decode(selector, &sample.payload().to_bytes()) {
                        out.push(message);
                    }
                }
                Err(error) => {
                    tracing::debug!(selector, error = ?error, "error reply");
                }
            }
        }
        Ok(out)
    }
}
