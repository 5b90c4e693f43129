//! How the API serves: its address, limits, timeouts and keys.

use std::net::SocketAddr;
use std::time::Duration;

use super::auth::ApiKeys;

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
