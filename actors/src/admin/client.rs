//! A typed client of the cluster's admin service
//! (protos/proto/tessera/v1/admin.proto) for programs outside the cluster:
//! `tessera admin`, `tessera models`, the benches, the tests.
//!
//! [`AdminClient::connect`] opens a zenoh client session on the namespace;
//! each method asks one queryable and answers the reply, or an
//! [`AdminClientError`]: nobody answered, zenoh failed, or the node answered
//! with its own `AdminError`. Reads are answered by any node (or only the
//! one named in [`ConnectOptions::node`]); place, delete, add-model and
//! download by the master.
//!
//! [`AdminClient::generate`] runs the same [`Generation`] as the API (resend until
//! the task appears, watch the instance, cancel on drop), fed the state by
//! a small actor that asks the admin service for it.

use std::sync::Arc;
use std::time::Duration;

use tessera_protos::v1::{self, generation_chunk};

use crate::bus::keys::{AdminMethod, KeyError, Keys};
use crate::bus::{Bus, BusError};
use crate::cluster::replica::StateView;
use crate::generation::Generation;

/// What the generation watch waits for the state at most.
const STATE_FOR_WATCH: Duration = Duration::from_millis(800);
/// How often the generation watch's state is asked for.
const STATE_EVERY: Duration = Duration::from_millis(200);
/// Time given to the cancel a dropped generation publishes.
const CANCEL_FLUSH: Duration = Duration::from_millis(250);
/// The master reads the hub to build a card: a slow listing is allowed for.
const ADD_MODEL_TIMEOUT_FACTOR: u32 = 10;

/// Where and how to reach the cluster.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub namespace: String,
    /// Nodes' zenoh endpoints (`tcp/HOST:PORT`); none: found by multicast.
    pub connect: Vec<String>,
    /// Ask reads of this node only (default: every node answers).
    pub node: Option<String>,
    /// How long one query waits for answers.
    pub timeout: Duration,
    /// A secured cluster's credentials (its authority, this machine's
    /// certificate and key); none: an open cluster.
    pub credentials: Option<tessera_trust::Credentials>,
}

impl ConnectOptions {
    /// Options for `namespace`, by multicast, with a 3 s query timeout.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            connect: Vec::new(),
            node: None,
            timeout: Duration::from_secs(3),
            credentials: None,
        }
    }

    fn multicast(&self) -> bool {
        self.connect.is_empty()
    }
}

/// Who a query is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// Any node (a read).
    Node,
    /// The master (a change).
    Master,
}

impl std::fmt::Display for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Node => "node",
            Self::Master => "master",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AdminClientError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("zenoh configuration: {0}")]
    Config(String),
    #[error("opening a zenoh session for namespace {namespace:?}: {reason}{}", hint(*.multicast))]
    Open {
        namespace: String,
        reason: String,
        multicast: bool,
    },
    #[error("no {asked} of namespace {namespace:?} answered within {timeout:?}{}", hint(*.multicast))]
    Unreachable {
        asked: Asked,
        namespace: String,
        timeout: Duration,
        multicast: bool,
    },
    #[error("zenoh: {0}")]
    Zenoh(String),
    /// The cluster's own answer: an `AdminError` reply, or an error chunk
    /// of a generation.
    #[error("{message} ({kind})")]
    Refused { kind: String, message: String },
    /// A generation that stopped without the cluster saying why (no chunk
    /// in time, the stream closed).
    #[error("generation: {0}")]
    Generation(String),
}

fn hint(multicast: bool) -> &'static str {
    if multicast {
        " (is a node running? nodes are found by multicast: pass --connect tcp/HOST:PORT where it is blocked)"
    } else {
        " (is a node running and listening on the endpoints given?)"
    }
}

impl From<BusError> for AdminClientError {
    fn from(error: BusError) -> Self {
        Self::Zenoh(error.to_string())
    }
}

impl From<&v1::AdminError> for AdminClientError {
    fn from(error: &v1::AdminError) -> Self {
        // The typed kind, read from an older node's string if need be.
        Self::Refused {
            kind: crate::admin::kind_name(crate::admin::kind_of(error)).to_string(),
            message: error.message.clone(),
        }
    }
}

/// An admin reply, which may carry the node's `AdminError`.
pub trait AdminReply: prost::Message + Default {
    fn admin_error(&self) -> Option<&v1::AdminError>;
}

macro_rules! admin_replies {
    ($($reply:ty),* $(,)?) => {$(
        impl AdminReply for $reply {
            fn admin_error(&self) -> Option<&v1::AdminError> {
                self.error.as_ref()
            }
        }
    )*};
}

admin_replies!(
    v1::GetStateReply,
    v1::ListNodesReply,
    v1::ListInstancesReply,
    v1::PlacementPreviewsReply,
    v1::PlaceInstanceReply,
    v1::DeleteInstanceReply,
    v1::ListModelsReply,
    v1::ListDownloadsReply,
    v1::AddModelReply,
    v1::DownloadReply,
    v1::EventsRangeReply,
    v1::RevokeReply,
    v1::SetDraftReply,
);

/// The reply, or its `AdminError` as an error.
fn accepted<R: AdminReply>(reply: R) -> Result<R, AdminClientError> {
    match reply.admin_error() {
        Some(error) => Err(error.into()),
        None => Ok(reply),
    }
}

/// A zenoh client session on one namespace, asking typed admin queries.
pub struct AdminClient {
    bus: Bus,
    options: ConnectOptions,
}

impl AdminClient {
    /// Opens the session (in client mode: it reaches the nodes, it is not
    /// one of them).
    pub async fn connect(options: ConnectOptions) -> Result<Self, AdminClientError> {
        let keys = Keys::new(&options.namespace)?;
        let config = crate::node::zenoh_config(
            "client",
            &[],
            &options.connect,
            options.multicast(),
            options.credentials.as_ref(),
        )
        .map_err(|e| AdminClientError::Config(e.to_string()))?;
        let session = zenoh::open(config)
            .await
            .map_err(|e| AdminClientError::Open {
                namespace: options.namespace.clone(),
                reason: e.to_string(),
                multicast: options.multicast(),
            })?;
        let signatures = match &options.credentials {
            Some(credentials) => Some(std::sync::Arc::new(
                crate::bus::Signatures::load(credentials)
                    .map_err(|e| AdminClientError::Config(e.to_string()))?,
            )),
            None => None,
        };
        Ok(Self {
            bus: Bus::new(session, keys).with_signatures(signatures),
            options,
        })
    }

    /// The typed session underneath, for traffic beyond the admin service
    /// (commands, events, chunks).
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    pub fn options(&self) -> &ConnectOptions {
        &self.options
    }

    /// Closes the session.
    pub async fn close(self) -> Result<(), AdminClientError> {
        self.bus.close().await;
        Ok(())
    }

    /// The cluster state as the most up-to-date node has it.
    pub async fn state(&self) -> Result<v1::GetStateReply, AdminClientError> {
        let replies: Vec<v1::GetStateReply> = self
            .ask_all(AdminMethod::State, &v1::GetStateRequest {})
            .await?;
        let freshest = replies
            .into_iter()
            .max_by_key(|r| r.state.as_ref().map_or(0, |s| s.last_index));
        accepted(freshest.ok_or_else(|| self.unreachable(Asked::Node, self.options.timeout))?)
    }

    /// The nodes and which is master, from the answer that knows a master
    /// and the most nodes.
    pub async fn nodes(&self) -> Result<v1::ListNodesReply, AdminClientError> {
        let replies: Vec<v1::ListNodesReply> = self
            .ask_all(AdminMethod::Nodes, &v1::ListNodesRequest {})
            .await?;
        let best = replies
            .into_iter()
            .max_by_key(|r| (r.error.is_none(), r.nodes.len()));
        accepted(best.ok_or_else(|| self.unreachable(Asked::Node, self.options.timeout))?)
    }

    pub async fn instances(&self) -> Result<v1::ListInstancesReply, AdminClientError> {
        self.read(AdminMethod::Instances, &v1::ListInstancesRequest {})
            .await
    }

    /// Every feasible placement of `model_id`, and why the others are not.
    pub async fn previews(
        &self,
        model_id: &str,
    ) -> Result<v1::PlacementPreviewsReply, AdminClientError> {
        let request = v1::PlacementPreviewsRequest {
            model_id: model_id.to_string(),
            node_ids: Vec::new(),
        };
        self.read(AdminMethod::Previews, &request).await
    }

    pub async fn models(&self) -> Result<v1::ListModelsReply, AdminClientError> {
        self.read(AdminMethod::Models, &v1::ListModelsRequest {})
            .await
    }

    /// Every node's downloads.
    pub async fn downloads(&self) -> Result<v1::ListDownloadsReply, AdminClientError> {
        self.read(AdminMethod::Downloads, &v1::ListDownloadsRequest::default())
            .await
    }

    /// Indexed events `from..=to` (`to` 0: to the end).
    pub async fn events(
        &self,
        from: u64,
        to: u64,
    ) -> Result<v1::EventsRangeReply, AdminClientError> {
        let request = v1::EventsRangeRequest {
            from_index: from,
            to_index: to,
        };
        self.read(AdminMethod::Events, &request).await
    }

    /// Places an instance (asked again with the same `request_id`, the
    /// master answers the instance already placed).
    pub async fn place(
        &self,
        request: &v1::PlaceInstanceRequest,
    ) -> Result<v1::PlaceInstanceReply, AdminClientError> {
        self.change(AdminMethod::Place, request, self.options.timeout)
            .await
    }

    pub async fn delete(
        &self,
        instance_id: &str,
    ) -> Result<v1::DeleteInstanceReply, AdminClientError> {
        let request = v1::DeleteInstanceRequest {
            instance_id: instance_id.to_string(),
        };
        self.change(AdminMethod::Delete, &request, self.options.timeout)
            .await
    }

    /// Revokes a secured cluster's member by its certificate's name.
    pub async fn revoke(&self, holder: &str) -> Result<v1::RevokeReply, AdminClientError> {
        let request = v1::RevokeRequest {
            holder: holder.to_string(),
        };
        self.change(AdminMethod::Revoke, &request, self.options.timeout)
            .await
    }

    /// Sets (or, with `None`, clears) an instance's speculative decoding;
    /// the reply holds the instance as the log now has it.
    pub async fn set_draft(
        &self,
        instance_id: &str,
        draft: Option<v1::InstanceDraft>,
    ) -> Result<v1::SetDraftReply, AdminClientError> {
        let request = v1::SetDraftRequest {
            instance_id: instance_id.to_string(),
            draft,
        };
        self.change(AdminMethod::Draft, &request, self.options.timeout)
            .await
    }

    /// Builds a card from a hub repository and adds it to the catalogue
    /// (`request.file` or `request.quant` pick a GGUF file).
    pub async fn add_model(
        &self,
        request: v1::AddModelRequest,
    ) -> Result<v1::AddModelReply, AdminClientError> {
        let timeout = self.options.timeout * ADD_MODEL_TIMEOUT_FACTOR;
        self.change(AdminMethod::AddModel, &request, timeout).await
    }

    /// Starts, cancels or deletes `model_id`'s download on `node_id`.
    pub async fn download(
        &self,
        action: v1::DownloadAction,
        node_id: &str,
        model_id: &str,
    ) -> Result<v1::DownloadReply, AdminClientError> {
        let request = v1::DownloadRequest {
            action: action as i32,
            node_id: node_id.to_string(),
            model_id: model_id.to_string(),
        };
        self.change(AdminMethod::Download, &request, self.options.timeout)
            .await
    }

    /// Starts generating on `target`: an instance id, or else a model id
    /// (any ready instance of it). `chunk_timeout` bounds the wait for each
    /// chunk. Dropping the stream before its end cancels the generation on
    /// the cluster.
    pub async fn generate(
        &self,
        target: &str,
        mut params: v1::TextGenerationParams,
        chunk_timeout: Duration,
    ) -> Result<GenerationStream, AdminClientError> {
        // The engine's own checks, here at the edge: refused before it is sent.
        if let Err(error) = crate::runner::request::request_from(&params) {
            return Err(AdminClientError::Refused {
                kind: "invalid_request".into(),
                message: error.to_string(),
            });
        }
        let instances = self.instances().await?;
        let instance_id = match instances.instances.iter().find(|i| i.instance_id == target) {
            Some(instance) => {
                params.model_id = instance
                    .model
                    .as_ref()
                    .map(|m| m.model_id.clone())
                    .unwrap_or_default();
                instance.instance_id.clone()
            }
            None => {
                params.model_id = target.to_string();
                String::new()
            }
        };
        let (state, view) = watch_state(self.bus.clone());
        // A command names its sender: with a node's certificate, that node.
        let origin = self.bus.holder().unwrap_or("admin").to_string();
        let started = Generation::start(
            &self.bus,
            &view,
            &origin,
            &instance_id,
            params,
            chunk_timeout,
        )
        .await;
        match started {
            Ok(generation) => Ok(GenerationStream {
                generation: Some(generation),
                ended: false,
                state,
            }),
            Err(error) => {
                state.abort();
                Err(AdminClientError::Generation(error.to_string()))
            }
        }
    }

    /// One reply of a read, from any node or the one asked for.
    async fn read<Req: prost::Message, Rep: AdminReply>(
        &self,
        method: AdminMethod,
        request: &Req,
    ) -> Result<Rep, AdminClientError> {
        let mut replies = self.ask_all::<Req, Rep>(method, request).await?;
        if replies.is_empty() {
            return Err(self.unreachable(Asked::Node, self.options.timeout));
        }
        accepted(replies.swap_remove(0))
    }

    /// Every node's reply to a read (only the named node's, with `node`).
    async fn ask_all<Req: prost::Message, Rep: AdminReply>(
        &self,
        method: AdminMethod,
        request: &Req,
    ) -> Result<Vec<Rep>, AdminClientError> {
        let key = self.bus.keys.admin(method);
        let selector = match &self.options.node {
            Some(node) => format!("{key}?node={node}"),
            None => key,
        };
        Ok(self
            .bus
            .query_all(&selector, request, self.options.timeout)
            .await?)
    }

    /// The master's reply to a change.
    async fn change<Req: prost::Message, Rep: AdminReply>(
        &self,
        method: AdminMethod,
        request: &Req,
        timeout: Duration,
    ) -> Result<Rep, AdminClientError> {
        let reply = self
            .bus
            .query(&self.bus.keys.admin(method), request, timeout)
            .await
            .map_err(|error| match error {
                BusError::NoReply { .. } => self.unreachable(Asked::Master, timeout),
                other => other.into(),
            })?;
        accepted(reply)
    }

    fn unreachable(&self, asked: Asked, timeout: Duration) -> AdminClientError {
        AdminClientError::Unreachable {
            asked,
            namespace: self.options.namespace.clone(),
            timeout,
            multicast: self.options.multicast(),
        }
    }
}

/// What a generation streams.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerationEvent {
    Token(v1::TokenChunk),
    Finish(v1::FinishChunk),
}

/// A generation under way. Dropped before its finish, it is cancelled on
/// the cluster; [`GenerationStream::cancel`] also waits for the cancel to
/// be sent.
pub struct GenerationStream {
    generation: Option<Generation>,
    /// A finish or an error came: nothing is left to cancel.
    ended: bool,
    /// Answers the generation's state watch; stopped with the stream.
    state: tokio::task::JoinHandle<()>,
}

impl GenerationStream {
    /// The command id the generation runs under.
    pub fn command_id(&self) -> &str {
        self.generation
            .as_ref()
            .map_or("", |g| g.command_id.as_str())
    }

    /// The next token or the finish; an error chunk, or no chunk in time,
    /// as an error; after the finish or an error, `None`.
    pub async fn next(&mut self) -> Option<Result<GenerationEvent, AdminClientError>> {
        let event = self.next_event().await;
        self.ended |= !matches!(event, Some(Ok(GenerationEvent::Token(_))));
        event
    }

    async fn next_event(&mut self) -> Option<Result<GenerationEvent, AdminClientError>> {
        loop {
            let kind = match self.generation.as_mut()?.next().await? {
                Ok(kind) => kind,
                Err(error) => return Some(Err(AdminClientError::Generation(error.to_string()))),
            };
            match kind {
                generation_chunk::Kind::Token(token) => {
                    return Some(Ok(GenerationEvent::Token(token)))
                }
                generation_chunk::Kind::Finish(finish) => {
                    return Some(Ok(GenerationEvent::Finish(finish)))
                }
                generation_chunk::Kind::Error(error) => {
                    return Some(Err(AdminClientError::Refused {
                        kind: error.kind,
                        message: error.message,
                    }))
                }
                // Other chunks (progress) carry nothing for the caller.
                _ => continue,
            }
        }
    }

    /// Stops the generation: an unfinished one is cancelled on the cluster,
    /// and the cancel is given a moment to leave before this returns.
    pub async fn cancel(mut self) {
        self.generation = None;
        if !self.ended {
            tokio::time::sleep(CANCEL_FLUSH).await;
        }
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        self.state.abort();
    }
}

/// The state for [`Generation`]'s watch, as a node's replica would give
/// it: the admin service's freshest answer, asked for every
/// [`STATE_EVERY`] until the task is aborted.
fn watch_state(bus: Bus) -> (tokio::task::JoinHandle<()>, StateView) {
    let (publish, view) = tokio::sync::watch::channel(Arc::new(v1::ClusterState::default()));
    let task = tokio::spawn(async move {
        loop {
            if let Some(state) = freshest_state(&bus).await {
                if publish.send(Arc::new(state)).is_err() {
                    return;
                }
            }
            tokio::time::sleep(STATE_EVERY).await;
        }
    });
    (task, view)
}

async fn freshest_state(bus: &Bus) -> Option<v1::ClusterState> {
    let replies: Vec<v1::GetStateReply> = bus
        .query_all(
            &bus.keys.admin(AdminMethod::State),
            &v1::GetStateRequest {},
            STATE_FOR_WATCH,
        )
        .await
        .map_err(|error| tracing::debug!(%error, "asking the state for a generation"))
        .ok()?;
    replies
        .into_iter()
        .filter_map(|r| r.state)
        .max_by_key(|s| s.last_index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable(multicast: bool) -> String {
        AdminClientError::Unreachable {
            asked: Asked::Master,
            namespace: "lab".into(),
            timeout: Duration::from_secs(3),
            multicast,
        }
        .to_string()
    }

    #[test]
    fn unreachable_names_the_namespace_and_hints_at_multicast() {
        let by_multicast = unreachable(true);
        assert!(by_multicast.starts_with("no master of namespace \"lab\" answered within 3s"));
        assert!(by_multicast.contains("--connect"), "{by_multicast}");
        assert!(!unreachable(false).contains("multicast"));
    }

    #[test]
    fn an_admin_error_reply_is_refused_with_its_kind() {
        let reply = v1::DeleteInstanceReply {
            command_id: String::new(),
            error: Some(crate::admin::AdminFailure::NotFound("no instance x".into()).to_proto()),
        };
        let error = accepted(reply).err().map(|e| e.to_string());
        assert_eq!(error.as_deref(), Some("no instance x (not_found)"));
        assert!(accepted(v1::DeleteInstanceReply::default()).is_ok());
    }

    #[test]
    fn options_without_endpoints_use_multicast() {
        let mut options = ConnectOptions::new("lab");
        assert!(options.multicast());
        options.connect.push("tcp/127.0.0.1:7447".into());
        assert!(!options.multicast());
    }

    #[tokio::test]
    async fn a_bad_namespace_is_refused_before_any_session() {
        let result = AdminClient::connect(ConnectOptions::new("a/b")).await;
        assert!(matches!(result, Err(AdminClientError::Key(_))));
    }
}
