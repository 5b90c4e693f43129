//! The HTTP API every node serves (axum): OpenAI Chat Completions and
//! Responses, Anthropic Messages, Ollama, and the cluster's own endpoints.
//! Any node answers any request: a generation becomes a TextGeneration
//! command for the master, which gives it to a ready instance, and the
//! chunks come back from that instance's rank 0 on `chunks/{command_id}`.
//!
//! # Layout
//! - [`server`]: the router, the accept loop (connection limits) and the
//!   admission of requests (a bound per model).
//! - [`ready`]: what a request's `model` names, and the wait for a ready
//!   instance (placing one where allowed).
//! - [`answer`]: a generation from its first chunk to the client (tried
//!   again when its instance went away), SSE helpers.
//! - one module per dialect, the pure mapper (`openai`, `anthropic`,
//!   `ollama`, `responses`), with its HTTP handlers in `{dialect}/handlers`.
//! - [`cluster`]: `/models`, `/instance/...`, `/download/...`, `/models/add`,
//!   `/events`: the admin service over HTTP.
//! - [`live`]: `/cluster`, `/state`, `/state/stream` (pushed on each
//!   change) and `/state/at` (time travel): what the dashboard watches.
//! - [`dashboard`]: the dashboard's page and assets (`dashboard/`), at `/`.
//! - [`join`]: `/cluster/join`, where a machine with a join token gets its
//!   certificate from the authority's node.
//! - [`auth`]: API keys (`Authorization: Bearer`, `x-api-key`), a 401 in
//!   each dialect's shape.
//! - [`error`]: [`ApiError`] and the one mapping of an error kind to its
//!   HTTP status.
//! - [`extension`]: the `tessera` object of request bodies (per-request
//!   `speculative: false`) and of answers' usage (drafted and accepted
//!   tokens, decode steps).

mod answer;
pub mod anthropic;
mod auth;
mod cluster;
mod dashboard;
pub mod error;
pub mod extension;
pub(crate) mod generation;
mod join;
mod live;
pub mod ollama;
pub mod openai;
mod ready;
pub mod responses;
mod server;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use ractor::ActorRef;
use tessera_protos::v1;

use crate::bus::Bus;
use crate::election_actor::Leadership;
use crate::replica::{ReplicaMsg, StateView};
pub use auth::ApiKeys;
use error::ApiError;
pub use server::serve;

/// How the API serves.
#[derive(Clone, Debug)]
pub struct ApiOptions {
    pub listen: SocketAddr,
    /// Origins allowed by CORS; empty: any.
    pub cors_origins: Vec<String>,
    /// Place a model that has no instance when a request asks for it.
    pub auto_place: bool,
    /// Requests per model this node lets wait or run at once; beyond it, 429.
    pub queue_limit: usize,
    pub max_body_bytes: usize,
    /// The longest wait for a model to be placed and ready.
    pub ready_timeout: Duration,
    /// The longest wait for the next chunk of an answer.
    pub chunk_timeout: Duration,
    /// Models placed (if no instance of them exists) when the node starts.
    pub preload: Vec<String>,
    /// How long a connection may take to send a request's headers, and how
    /// long it may sit idle between requests, before it is closed.
    pub idle_timeout: Duration,
    /// Connections served at once; one more is closed at once.
    pub max_connections: usize,
    /// The keys requests must carry; none: the API is open.
    pub api_keys: ApiKeys,
    /// The node's cluster folder, where `/cluster/join` finds the
    /// authority and its open invites (set by the node from its data dir).
    pub cluster_dir: Option<std::path::PathBuf>,
}

impl ApiOptions {
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            cors_origins: Vec::new(),
            auto_place: true,
            queue_limit: 64,
            max_body_bytes: 4 << 20,
            ready_timeout: Duration::from_secs(300),
            chunk_timeout: Duration::from_secs(120),
            preload: Vec::new(),
            idle_timeout: Duration::from_secs(30),
            max_connections: 1024,
            api_keys: ApiKeys::default(),
            cluster_dir: None,
        }
    }
}

#[derive(Clone)]
struct Api {
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    /// The state, as the replica last published it.
    state: StateView,
    /// The master this node follows (none while electing).
    leadership: Leadership,
    /// This node's links are mutual TLS (it holds cluster credentials,
    /// which only appear at a start).
    secured: bool,
    options: Arc<ApiOptions>,
    /// Requests in hand per model.
    queues: server::Queues,
}

impl Api {
    async fn state(&self) -> Result<Arc<v1::ClusterState>, ApiError> {
        Ok(self.state.borrow().clone())
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(ApiError::from_rejection)?;
    serde_json::from_slice(&body).map_err(|e| {
        if e.is_data() {
            ApiError::bad_request(format!("the request does not match the API: {e}"))
        } else {
            ApiError::bad_request(format!("the body is not valid JSON: {e}"))
        }
    })
}
