//! The node's one zenoh session, typed: protobuf messages out, protobuf
//! messages in. A payload that does not decode is dropped, counted and
//! logged; it never reaches an actor.

pub mod keys;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use tessera_trust::{Role, Sender, SignatureError, Signer, Verifier};
use zenoh::bytes::{Encoding, ZBytes};
use zenoh::handlers::FifoChannelHandler;
use zenoh::liveliness::LivelinessToken;
use zenoh::pubsub::Subscriber;
use zenoh::sample::Sample;

use crate::bus::keys::Keys;

/// Why a publication or a query failed.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("zenoh: {0}")]
    Zenoh(String),
    #[error("no reply on {key} within {timeout:?}")]
    NoReply { key: String, timeout: Duration },
    #[error("zenoh configuration {key}: {reason}")]
    Config { key: String, reason: String },
    #[error("signing: {0}")]
    Sign(String),
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

/// A secured cluster's signatures: this member's signer, and the verifier
/// of every other member's messages (with the log's revocations).
pub struct Signatures {
    pub signer: Signer,
    pub verifier: Verifier,
}

impl Signatures {
    pub fn load(credentials: &tessera_trust::Credentials) -> Result<Self, BusError> {
        let error = |e: tessera_trust::TrustError| BusError::Sign(e.to_string());
        Ok(Self {
            signer: Signer::load(credentials).map_err(error)?,
            verifier: Verifier::load(credentials).map_err(error)?,
        })
    }
}

/// Who may have written a message: in a secured cluster its signature must
/// name such a member (an open cluster takes every message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Author<'a> {
    /// This node only (a node speaks for itself).
    Node(&'a str),
    /// Any node (an admin machine runs nothing, so it answers nothing).
    AnyNode,
    /// This node, or an admin machine (which speaks for no node).
    NodeOrAdmin(&'a str),
    /// Any member of the cluster.
    Member,
    /// No one (a message that names no author where it must).
    Nobody,
}

impl Author<'_> {
    /// Whether a message signed by `sender` may be this author's.
    pub fn permits(self, sender: &Sender) -> bool {
        match (self, sender.role) {
            (Author::Member, _) => true,
            (Author::Nobody, _) => false,
            (Author::AnyNode, role) => role == Role::Node,
            (Author::Node(node), role) => role == Role::Node && sender.holder == node,
            (Author::NodeOrAdmin(_), Role::Admin) => true,
            (Author::NodeOrAdmin(node), Role::Node) => sender.holder == node,
        }
    }
}

/// What a message says of who wrote it.
pub trait Authored {
    fn author(&self) -> Author<'_>;
}

/// Zenoh's access control, set when a session opens: every message to or
/// from a link whose certificate names a revoked member is denied. (A
/// running session keeps the rules it opened with: zenoh 1.10 neither
/// checks revocation lists nor changes access rules while it runs, so
/// there the members' signatures refuse the revoked, see [`Bus::admits`].)
pub fn deny_revoked(config: &mut zenoh::Config, revoked: &[String]) -> Result<(), BusError> {
    if revoked.is_empty() {
        return Ok(());
    }
    let every_message = [
        "put",
        "delete",
        "declare_subscriber",
        "query",
        "declare_queryable",
        "reply",
        "liveliness_token",
        "declare_liveliness_subscriber",
        "liveliness_query",
    ];
    let rules = serde_json::json!({
        "enabled": true,
        "default_permission": "allow",
        "rules": [{
            "id": "revoked",
            "key_exprs": ["**"],
            "messages": every_message,
            "flows": ["ingress", "egress"],
            "permission": "deny",
        }],
        "subjects": [{ "id": "revoked", "cert_common_names": revoked }],
        "policies": [{ "rules": ["revoked"], "subjects": ["revoked"] }],
    });
    config
        .insert_json5("access_control", &rules.to_string())
        .map_err(|e| BusError::Config {
            key: "access_control".into(),
            reason: e.to_string(),
        })
}

/// A zenoh session with the namespace's keys and a counter of dropped
/// messages; in a secured cluster, what it sends is signed and what it
/// takes must be. Cheap to clone.
#[derive(Clone)]
pub struct Bus {
    pub session: zenoh::Session,
    pub keys: Keys,
    dropped: Arc<AtomicU64>,
    signatures: Option<Arc<Signatures>>,
    /// The revoked members whose messages were dropped already.
    revoked_seen: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

impl Bus {
    pub fn new(session: zenoh::Session, keys: Keys) -> Self {
        Self {
            session,
            keys,
            dropped: Arc::new(AtomicU64::new(0)),
            signatures: None,
            revoked_seen: Arc::default(),
        }
    }

    /// This bus, signing what it sends and checking what it takes.
    pub fn with_signatures(mut self, signatures: Option<Arc<Signatures>>) -> Self {
        self.signatures = signatures;
        self
    }

    /// The signatures of a secured cluster's bus.
    pub fn signatures(&self) -> Option<&Arc<Signatures>> {
        self.signatures.as_ref()
    }

    /// The member this bus signs as, in a secured cluster.
    pub fn holder(&self) -> Option<&str> {
        self.signatures.as_ref().map(|s| s.signer.holder())
    }

    /// The attachment that signs `payload` on `key` (none when open).
    fn sign(&self, key: &str, payload: &[u8]) -> Result<Option<Vec<u8>>, BusError> {
        match &self.signatures {
            Some(signatures) => signatures
                .signer
                .sign(key, payload)
                .map(Some)
                .map_err(|e| BusError::Sign(e.to_string())),
            None => Ok(None),
        }
    }

    /// Whether a message may be taken: open, or signed by a member whom
    /// `author` permits. A refused one is dropped and counted.
    pub fn admits(
        &self,
        key: &str,
        payload: &[u8],
        attachment: Option<&ZBytes>,
        author: Author<'_>,
    ) -> bool {
        let Some(signatures) = &self.signatures else {
            return true;
        };
        let attachment = attachment.map(ZBytes::to_bytes);
        match signatures
            .verifier
            .verify(key, payload, attachment.as_deref())
        {
            Ok(sender) if author.permits(&sender) => true,
            Ok(sender) => {
                let why = format!("{} may not send this ({author:?})", sender.holder);
                self.count_dropped(key, &why);
                false
            }
            // A revoked member goes on sending until it is stopped: said
            // once per member, then counted quietly.
            Err(SignatureError::Revoked(holder)) => {
                let total = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                let first = self
                    .revoked_seen
                    .lock()
                    .is_ok_and(|mut seen| seen.insert(holder.clone()));
                if first {
                    tracing::warn!(
                        key,
                        holder,
                        total,
                        "dropped a message: {holder}'s certificate was revoked"
                    );
                } else {
                    tracing::debug!(key, holder, total, "dropped a revoked member's message");
                }
                false
            }
            Err(error) => {
                self.count_dropped(key, &error.to_string());
                false
            }
        }
    }

    /// A sample's message, if it decodes and `author` may have sent it.
    pub fn take<M: Message + Default>(
        &self,
        sample: &Sample,
        author: impl FnOnce(&M) -> Author<'_>,
    ) -> Option<M> {
        let key = sample.key_expr().as_str();
        let payload = sample.payload().to_bytes();
        let message = self.decode::<M>(key, &payload)?;
        self.admits(key, &payload, sample.attachment(), author(&message))
            .then_some(message)
    }

    /// Publishes `message` on `key`.
    pub async fn put<M: Message>(&self, key: &str, message: &M) -> Result<(), BusError> {
        let payload = message.encode_to_vec();
        let attachment = self.sign(key, &payload)?;
        // Block rather than drop under congestion: a dropped event costs a
        // catch-up, a dropped chunk a hole in someone's answer.
        self.session
            .put(key, payload)
            .encoding(Encoding::APPLICATION_PROTOBUF)
            .congestion_control(zenoh::qos::CongestionControl::Block)
            .attachment(attachment)
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
        let payload = request.encode_to_vec();
        let key = selector.split('?').next().unwrap_or(selector);
        let attachment = self.sign(key, &payload)?;
        let replies = self
            .session
            .get(selector)
            .payload(payload)
            .encoding(Encoding::APPLICATION_PROTOBUF)
            .attachment(attachment)
            .timeout(timeout)
            .await
            .map_err(BusError::zenoh)?;
        let mut out = Vec::new();
        while let Ok(reply) = replies.recv_async().await {
            match reply.result() {
                // Only nodes answer queries.
                Ok(sample) => {
                    if let Some(message) = self.take(sample, |_: &Rep| Author::AnyNode) {
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
        deliver: F,
    ) -> Result<tokio::task::JoinHandle<()>, BusError>
    where
        M: Message + Default + Authored,
        F: FnMut(&str, M) + Send + 'static,
    {
        self.route_when(key, || true, deliver).await
    }

    /// [`route`](Self::route) of what other sessions put only (the log's
    /// events: the master's own are committed before they are put).
    pub async fn route_from_others<M, F>(
        &self,
        key: impl Into<String>,
        deliver: F,
    ) -> Result<tokio::task::JoinHandle<()>, BusError>
    where
        M: Message + Default + Authored,
        F: FnMut(&str, M) + Send + 'static,
    {
        let subscriber = self
            .session
            .declare_subscriber(key.into())
            .allowed_origin(zenoh::sample::Locality::Remote)
            .await
            .map_err(BusError::zenoh)?;
        Ok(self.deliver(subscriber, || true, deliver))
    }

    /// [`route`](Self::route), taking only the samples that arrive while
    /// `wanted` holds: the others are not decoded, nor their signatures
    /// checked (a follower skips the master's traffic).
    pub async fn route_when<M, W, F>(
        &self,
        key: impl Into<String>,
        wanted: W,
        deliver: F,
    ) -> Result<tokio::task::JoinHandle<()>, BusError>
    where
        M: Message + Default + Authored,
        W: Fn() -> bool + Send + 'static,
        F: FnMut(&str, M) + Send + 'static,
    {
        let subscriber = self.subscribe(key.into()).await?;
        Ok(self.deliver(subscriber, wanted, deliver))
    }

    /// The one subscription loop: each wanted sample that decodes, from an
    /// author its message permits, goes to `deliver`.
    fn deliver<M, W, F>(
        &self,
        subscriber: Subscriber<FifoChannelHandler<Sample>>,
        wanted: W,
        mut deliver: F,
    ) -> tokio::task::JoinHandle<()>
    where
        M: Message + Default + Authored,
        W: Fn() -> bool + Send + 'static,
        F: FnMut(&str, M) + Send + 'static,
    {
        let bus = self.clone();
        tokio::spawn(async move {
            while let Ok(sample) = subscriber.recv_async().await {
                if !wanted() {
                    continue;
                }
                if let Some(message) = bus.take::<M>(&sample, M::author) {
                    deliver(sample.key_expr().as_str(), message);
                }
            }
        })
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
        let bus = self.clone();
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
                // A query not signed by a member is left unanswered.
                if !bus.admits(
                    &asked.key,
                    &asked.payload,
                    query.attachment(),
                    Author::Member,
                ) {
                    continue;
                }
                let key = asked.key.clone();
                if let Some(bytes) = answer(asked).await {
                    let attachment = match bus.sign(&key, &bytes) {
                        Ok(attachment) => attachment,
                        Err(error) => {
                            tracing::warn!(%error, key, "signing a reply");
                            continue;
                        }
                    };
                    let replied = query
                        .reply(query.key_expr().clone(), bytes)
                        .encoding(Encoding::APPLICATION_PROTOBUF)
                        .attachment(attachment)
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

/// Who may write each message routed on the bus. The rules of a secured
/// cluster: the log is the master's (its session names it), a node
/// reports, campaigns and sends generation commands only for itself, an
/// admin machine may send commands but never speaks for a node, and only
/// nodes (their runners) report runner status.
mod authorship {
    use super::{Author, Authored};
    use tessera_protos::v1;

    impl Authored for v1::IndexedEvent {
        fn author(&self) -> Author<'_> {
            match &self.session {
                Some(session) => Author::Node(&session.master_node_id),
                None => Author::Nobody,
            }
        }
    }

    impl Authored for v1::LocalEvent {
        fn author(&self) -> Author<'_> {
            Author::Node(&self.origin_node_id)
        }
    }

    impl Authored for v1::ElectionMessage {
        fn author(&self) -> Author<'_> {
            Author::Node(&self.node_id)
        }
    }

    impl Authored for v1::Command {
        fn author(&self) -> Author<'_> {
            Author::NodeOrAdmin(&self.origin_node_id)
        }
    }

    impl Authored for v1::RunnerStatus {
        fn author(&self) -> Author<'_> {
            Author::AnyNode
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sender(holder: &str, role: Role) -> Sender {
        Sender {
            holder: holder.into(),
            role,
        }
    }

    /// An authority in `root/a` (holder "a") and certificates for `others`.
    fn members(root: &std::path::Path, others: &[&str]) -> Vec<tessera_trust::Credentials> {
        use tessera_trust::ClusterDir;
        let authority = ClusterDir::of(&root.join("a"));
        let mut all = vec![authority.init("acl", "a").expect("init")];
        for name in others {
            let invite = authority.invite(Role::Node, u64::MAX).expect("invite");
            let pem = authority.authority_pem().expect("pem");
            let token = invite
                .token("acl", &pem, "http://x", vec![])
                .expect("token");
            let folder = ClusterDir::of(&root.join(name));
            let (key, request) = folder.request(&token, name).expect("request");
            let reply = authority.admit(&request, 0).expect("admitted");
            all.push(folder.store(&token, &key, &reply).expect("stored"));
        }
        all
    }

    /// How many replies `credentials` get to a query of the node at `port`.
    async fn replies_to(credentials: &tessera_trust::Credentials, port: u16) -> usize {
        let connect = [format!("tcp/127.0.0.1:{port}")];
        let config =
            zenoh_config("client", &[], &connect, false, Some(credentials)).expect("config");
        let session = zenoh::open(config).await.expect("a TLS session opens");
        let replies = session
            .get("tessera/acl/probe")
            .timeout(Duration::from_secs(2))
            .await
            .expect("query");
        let mut answered = 0;
        while let Ok(reply) = replies.recv_async().await {
            answered += usize::from(reply.result().is_ok());
        }
        let _ = session.close().await;
        answered
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_opened_after_a_revocation_denies_the_revoked_all_traffic() {
        let root = tempfile::tempdir().expect("temp dir");
        let credentials = members(root.path(), &["b", "c"]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let listen = [format!("tcp/127.0.0.1:{port}")];
        let mut config =
            zenoh_config("peer", &listen, &[], false, Some(&credentials[0])).expect("config");
        deny_revoked(&mut config, &["b".to_string()]).expect("access control");
        let node = zenoh::open(config).await.expect("node");
        let _queryable = node
            .declare_queryable("tessera/acl/probe")
            .callback(|query| {
                use zenoh::Wait;
                let _ = query.reply(query.key_expr().clone(), "here").wait();
            })
            .await
            .expect("queryable");
        assert_eq!(replies_to(&credentials[2], port).await, 1, "c is answered");
        assert_eq!(replies_to(&credentials[1], port).await, 0, "b is revoked");
        let _ = node.close().await;
    }

    // Installs the process's TLS provider: nextest runs each test in a
    // process of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoked_member_is_refused_at_the_handshake_by_a_running_node() {
        tessera_trust::handshake::install().expect("this process's first TLS provider");
        let root = tempfile::tempdir().expect("temp dir");
        let credentials = members(root.path(), &["b", "c"]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let listen = [format!("tcp/127.0.0.1:{port}")];
        let config =
            zenoh_config("peer", &listen, &[], false, Some(&credentials[0])).expect("config");
        let node = zenoh::open(config).await.expect("node");
        let _queryable = node
            .declare_queryable("tessera/acl/probe")
            .callback(|query| {
                use zenoh::Wait;
                let _ = query.reply(query.key_expr().clone(), "here").wait();
            })
            .await
            .expect("queryable");
        assert_eq!(replies_to(&credentials[1], port).await, 1, "b before");
        // Revoked while the node runs: its next handshake fails.
        tessera_trust::handshake::set_revoked(["b".to_string()]);
        let connect = [format!("tcp/127.0.0.1:{port}")];
        let config =
            zenoh_config("client", &[], &connect, false, Some(&credentials[1])).expect("config");
        assert!(
            zenoh::open(config).await.is_err(),
            "b's handshake is refused"
        );
        assert_eq!(replies_to(&credentials[2], port).await, 1, "c still joins");
        let _ = node.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_bus_takes_what_members_sign_until_the_signer_is_revoked() {
        let root = tempfile::tempdir().expect("temp dir");
        let credentials = members(root.path(), &["b"]);
        let config = zenoh_config("peer", &[], &[], false, None).expect("config");
        let session = zenoh::open(config).await.expect("session");
        let keys = Keys::new("signed").expect("keys");
        let signatures = Arc::new(Signatures::load(&credentials[0]).expect("a's"));
        let bus = Bus::new(session, keys).with_signatures(Some(signatures.clone()));
        let b = Signer::load(&credentials[1]).expect("b's");
        let key = "tessera/signed/events/local";
        let signed = ZBytes::from(b.sign(key, b"report").expect("signed"));
        assert!(bus.admits(key, b"report", Some(&signed), Author::Node("b")));
        assert!(!bus.admits(key, b"report", Some(&signed), Author::Node("a")));
        assert!(!bus.admits(key, b"report", None, Author::Member));
        signatures.verifier.set_revoked(["b".to_string()]);
        assert!(!bus.admits(key, b"report", Some(&signed), Author::Node("b")));
        assert_eq!(bus.dropped(), 3);
        bus.close().await;
    }

    #[test]
    fn no_revocation_leaves_access_control_off() {
        let mut config = zenoh::Config::default();
        deny_revoked(&mut config, &[]).expect("nothing to deny");
        assert!(config
            .get_json("access_control/enabled")
            .is_ok_and(|v| v == "false"));
    }

    #[test]
    fn each_author_admits_only_its_senders() {
        let node_a = sender("a", Role::Node);
        let node_b = sender("b", Role::Node);
        let admin = sender("laptop", Role::Admin);
        let admin_named_a = sender("a", Role::Admin);
        assert!(Author::Node("a").permits(&node_a));
        assert!(!Author::Node("a").permits(&node_b));
        assert!(!Author::Node("a").permits(&admin_named_a));
        assert!(Author::AnyNode.permits(&node_b));
        assert!(!Author::AnyNode.permits(&admin));
        assert!(Author::NodeOrAdmin("a").permits(&node_a));
        assert!(Author::NodeOrAdmin("a").permits(&admin));
        assert!(!Author::NodeOrAdmin("a").permits(&node_b));
        assert!(Author::Member.permits(&admin));
    }

    #[test]
    fn the_log_is_the_masters_and_reports_are_their_nodes() {
        let event = tessera_protos::v1::IndexedEvent {
            session: Some(tessera_protos::v1::SessionId {
                master_node_id: "m".into(),
                election_clock: 3,
            }),
            ..Default::default()
        };
        assert_eq!(event.author(), Author::Node("m"));
        // No session names no master: no node may have written it.
        let orphan = tessera_protos::v1::IndexedEvent::default();
        assert_eq!(orphan.author(), Author::Nobody);
        assert!(!Author::Nobody.permits(&sender("", Role::Node)));
        let local = tessera_protos::v1::LocalEvent {
            origin_node_id: "w".into(),
            ..Default::default()
        };
        assert_eq!(local.author(), Author::Node("w"));
    }
}
