//! The node's one zenoh session, typed: protobuf messages out, protobuf
//! messages in. A payload that does not decode is dropped, counted and
//! logged; it never reaches an actor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use zenoh::bytes::Encoding;
use zenoh::handlers::FifoChannelHandler;
use zenoh::liveliness::LivelinessToken;
use zenoh::pubsub::Subscriber;
use zenoh::sample::Sample;

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

/// In a secured cluster, every link is TLS: `tcp/HOST:PORT` becomes
/// `tls/HOST:PORT`; another protocol (udp, quic) is refused, since it
/// would carry the cluster's traffic unauthenticated.
pub fn secured_endpoints(endpoints: &[String]) -> Result<Vec<String>, BusError> {
    endpoints
        .iter()
        .map(|endpoint| {
            if endpoint.starts_with("tls/") {
                Ok(endpoint.clone())
            } else if let Some(address) = endpoint.strip_prefix("tcp/") {
                Ok(format!("tls/{address}"))
            } else {
                Err(BusError::Config {
                    key: "endpoints".into(),
                    reason: format!(
                        "{endpoint}: a secured cluster links over tls/ (or tcp/, made tls/) only"
                    ),
                })
            }
        })
        .collect()
}

/// The zenoh configuration of a session: its mode (`peer`, `client`),
/// endpoints and multicast scouting; with `tls`, mutual TLS against the
/// cluster's authority on every link (a peer without a certificate from it
/// cannot open a session at all).
pub fn zenoh_config(
    mode: &str,
    listen: &[String],
    connect: &[String],
    multicast: bool,
    tls: Option<&tessera_trust::Credentials>,
) -> Result<zenoh::Config, BusError> {
    let (listen, connect) = match tls {
        Some(_) => (secured_endpoints(listen)?, secured_endpoints(connect)?),
        None => (listen.to_vec(), connect.to_vec()),
    };
    let (listen, connect) = (listen.as_slice(), connect.as_slice());
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
    if let Some(credentials) = tls {
        let path = |p: &std::path::Path| format!("{:?}", p.display().to_string());
        let tls = "transport/link/tls";
        set(
            &format!("{tls}/root_ca_certificate"),
            path(&credentials.authority),
        )?;
        for side in ["listen", "connect"] {
            set(&format!("{tls}/{side}_private_key"), path(&credentials.key))?;
            set(
                &format!("{tls}/{side}_certificate"),
                path(&credentials.cert),
            )?;
        }
        set(&format!("{tls}/enable_mtls"), "true".into())?;
        // Peers are checked against the authority, not by host name: home
        // machines change addresses, and a certificate names a holder.
        set(&format!("{tls}/verify_name_on_connect"), "false".into())?;
    }
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

    /// Subscribes to `key`: each sample that decodes as `M` goes to
    /// `deliver` with its key, in arrival order; one that does not is
    /// dropped and counted. The one subscription loop of the node: it ends
    /// when the session closes or the task is aborted.
    pub async fn route<M, F>(
        &self,
        key: impl Into<String>,
        mut deliver: F,
    ) -> Result<tokio::task::JoinHandle<()>, BusError>
    where
        M: Message + Default,
        F: FnMut(&str, M) + Send + 'static,
    {
        let subscriber = self.subscribe(key.into()).await?;
        let bus = self.clone();
        Ok(tokio::spawn(async move {
            while let Ok(sample) = subscriber.recv_async().await {
                let key = sample.key_expr().as_str();
                if let Some(message) = bus.decode::<M>(key, &sample.payload().to_bytes()) {
                    deliver(key, message);
                }
            }
        }))
    }

    /// A subscriber whose samples are read in turn (a stream's chunks).
    pub async fn subscribe(
        &self,
        key: String,
    ) -> Result<Subscriber<FifoChannelHandler<Sample>>, BusError> {
        self.session
            .declare_subscriber(key)
            .await
            .map_err(BusError::zenoh)
    }

    /// Liveliness tokens under `key`: their puts and deletes, and with
    /// `history` those already there first.
    pub async fn subscribe_liveliness(
        &self,
        key: String,
        history: bool,
    ) -> Result<Subscriber<FifoChannelHandler<Sample>>, BusError> {
        self.session
            .liveliness()
            .declare_subscriber(key)
            .history(history)
            .await
            .map_err(BusError::zenoh)
    }

    /// Declares a queryable on `key`: each query goes to `answer`, whose
    /// bytes (if any: `None` leaves the query unanswered, as if this node
    /// were not there) are the reply. Queries are answered one at a time,
    /// in arrival order.
    pub async fn answer<F, Fut>(
        &self,
        key: String,
        answer: F,
    ) -> Result<tokio::task::JoinHandle<()>, BusError>
    where
        F: Fn(Asked) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Option<Vec<u8>>> + Send,
    {
        let queryable = self
            .session
            .declare_queryable(key)
            .await
            .map_err(BusError::zenoh)?;
        Ok(tokio::spawn(async move {
            while let Ok(query) = queryable.recv_async().await {
                let asked = Asked {
                    key: query.key_expr().as_str().to_string(),
                    node: query.parameters().get("node").map(str::to_string),
                    payload: query
                        .payload()
                        .map(|p| p.to_bytes().to_vec())
                        .unwrap_or_default(),
                };
                if let Some(bytes) = answer(asked).await {
                    let replied = query
                        .reply(query.key_expr().clone(), bytes)
                        .encoding(Encoding::APPLICATION_PROTOBUF)
                        .await;
                    if let Err(error) = replied {
                        tracing::debug!(%error, "replying to a query");
                    }
                }
            }
        }))
    }

    /// Declares this node's liveliness token on `key`: it is there while
    /// the token is held.
    pub async fn declare_token(&self, key: String) -> Result<LivelinessToken, BusError> {
        self.session
            .liveliness()
            .declare_token(key)
            .await
            .map_err(BusError::zenoh)
    }

    /// Closes the session: every route and queryable ends.
    pub async fn close(&self) {
        if let Err(error) = self.session.close().await {
            tracing::debug!(%error, "closing the zenoh session");
        }
    }
}

/// A route's task, ended when this is dropped (with the actor whose state
/// holds it, however that actor ends).
pub struct RouteGuard(pub tokio::task::JoinHandle<()>);

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A query as its answerer sees it.
pub struct Asked {
    pub key: String,
    /// The one node asked, when the selector names one (`?node=ID`).
    pub node: Option<String>,
    pub payload: Vec<u8>,
}
