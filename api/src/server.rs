//! The server: the router of every endpoint and the accept loop
//! (header-read and idle timeouts, a bound on connections).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, Method};
use axum::routing::{delete, get, post, put};
use axum::Router;
use ractor::ActorRef;
use tokio::sync::watch;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use super::context::{stopped, Api, Queues};
use super::error::ApiError;
use super::options::ApiOptions;
use super::{anthropic, auth, cluster, dashboard, join, live, ollama, openai, responses};
use ractor::call_t;
use tessera_actors::bus::Bus;
use tessera_actors::cluster::election::actor::Leadership;
use tessera_actors::cluster::replica::ReplicaMsg;

/// A serving API: where it listens, and how to stop it.
pub struct ApiServer {
    pub address: SocketAddr,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl ApiServer {
    /// Waits until the server ends without being told to (its accept loop
    /// panicked, say): why.
    pub async fn failed(&mut self) -> String {
        match (&mut self.task).await {
            Ok(()) => "the HTTP API stopped".into(),
            Err(error) if error.is_panic() => format!("the HTTP API panicked: {error}"),
            Err(error) => format!("the HTTP API ended: {error}"),
        }
    }

    /// Stops taking connections, lets the requests in flight finish (each
    /// connection closes after its current answer) for up to `drain`, then
    /// closes what is left.
    pub async fn shutdown(self, drain: Duration) {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(drain, &mut task).await.is_err() {
            tracing::warn!(
                ?drain,
                "API requests still running after the drain; closing them"
            );
            task.abort();
        }
    }
}

/// Serves the API until [`ApiServer::shutdown`].
pub async fn serve(
    options: ApiOptions,
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    leadership: Leadership,
) -> std::io::Result<ApiServer> {
    let listener = tokio::net::TcpListener::bind(options.listen).await?;
    let address = listener.local_addr()?;
    let state = call_t!(replica, ReplicaMsg::Watch, tessera_actors::ACTOR_CALL_MS)
        .map_err(|e| std::io::Error::other(format!("watching the state: {e}")))?;
    let (stop, stopping) = watch::channel(false);
    let api = Api {
        node_id,
        bus,
        replica,
        state,
        leadership,
        secured: options.cluster_dir.as_ref().is_some_and(|dir| {
            tessera_trust::ClusterDir::at(dir.clone())
                .credentials()
                .is_some()
        }),
        queues: Queues::new(options.queue_limit),
        options: Arc::new(options),
        stopping: stopping.clone(),
    };
    let app = router(&api);
    tracing::info!(%address, "HTTP API listening");
    for model in api.options.preload.clone() {
        let api = api.clone();
        tokio::spawn(async move {
            match api.resolve_placing(&model, true).await {
                Ok(_) => tracing::info!(model, "serving"),
                Err(error) => tracing::error!(model, %error, "could not serve the model"),
            }
        });
    }
    let limits = ConnectionLimits {
        idle_timeout: api.options.idle_timeout,
        max_connections: api.options.max_connections.max(1),
    };
    let task = tokio::spawn(accept_loop(listener, app, limits, stopping));
    Ok(ApiServer {
        address,
        stop,
        task,
    })
}

/// Every endpoint, behind the body limit, the key check and CORS.
fn router(api: &Api) -> Router {
    Router::new()
        .route(
            "/v1/chat/completions",
            post(openai::handlers::chat_completions),
        )
        .route(
            "/v1/completions",
            post(crate::completions::handlers::completions),
        )
        .route(
            "/v1/embeddings",
            post(crate::embeddings::handlers::openai_embeddings),
        )
        .route("/v1/models", get(openai::handlers::models))
        .route("/v1/models/{*id}", get(openai::handlers::model))
        .route("/v1/messages", post(anthropic::handlers::messages))
        .route(
            "/v1/messages/count_tokens",
            post(anthropic::handlers::count_tokens),
        )
        .route("/v1/responses", post(responses::handlers::responses))
        .route("/api/version", get(ollama::handlers::version))
        .route("/api/tags", get(ollama::handlers::tags))
        .route("/api/show", post(ollama::handlers::show))
        .route("/api/ps", get(ollama::handlers::ps))
        .route("/api/chat", post(ollama::handlers::chat))
        .route("/api/generate", post(ollama::handlers::generate))
        .route(
            "/api/embed",
            post(crate::embeddings::handlers::ollama_embed),
        )
        .route(
            "/api/embeddings",
            post(crate::embeddings::handlers::ollama_embeddings),
        )
        .route("/", get(dashboard::index))
        .route("/assets/{*path}", get(dashboard::asset))
        .route("/node_id", get(cluster::node_id))
        .route("/cluster", get(live::cluster))
        .route("/state", get(live::state))
        .route("/state/stream", get(live::state_stream))
        .route("/state/at", get(live::state_at))
        .route("/models", get(cluster::models))
        .route("/cluster/join", post(join::join))
        .route("/instance/previews", get(cluster::previews))
        .route("/place_instance", post(cluster::place_instance))
        .route("/instance/{id}", get(cluster::get_instance))
        .route("/instance/{id}", delete(cluster::delete_instance))
        .route("/instance/{id}/draft", put(cluster::set_draft))
        .route("/events", get(cluster::events))
        .route("/models/add", post(cluster::add_model))
        .route("/downloads", get(cluster::downloads))
        .route("/download/{action}", post(cluster::download_action))
        .route(
            "/download/{node}/{*model}",
            delete(cluster::delete_download),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(api.options.max_body_bytes))
        // Inside CORS: a browser's preflight carries no key.
        .layer(axum::middleware::from_fn_with_state(
            api.options.api_keys.clone(),
            auth::require_key,
        ))
        .layer(cors(&api.options))
        .with_state(api.clone())
}

/// Any origin, or the listed ones.
fn cors(options: &ApiOptions) -> CorsLayer {
    if options.cors_origins.is_empty() {
        return CorsLayer::new()
            .allow_origin(Any)
            .allow_methods(Any)
            .allow_headers(Any);
    }
    let origins: Vec<HeaderValue> = options
        .cors_origins
        .iter()
        .filter_map(|o| HeaderValue::from_str(o).ok())
        .collect();
    CorsLayer::new()
        .allow_origin(AllowOrigin::list(origins))
        .allow_methods([Method::GET, Method::POST, Method::DELETE])
        .allow_headers(Any)
}

#[derive(Clone, Copy)]
struct ConnectionLimits {
    idle_timeout: Duration,
    max_connections: usize,
}

/// Accepts connections and serves HTTP/1.1 on each, with a header-read and
/// idle timeout (a slow or silent client does not hold a connection) and a
/// bound on connections (one over it is closed at once, so a flood cannot
/// exhaust the node's file descriptors). When `stopping` turns true it
/// takes no more, and returns once every connection has closed after its
/// current answer.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    mut stopping: watch::Receiver<bool>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut refusals = tessera_actors::throttle::Throttle::new(Duration::from_secs(5));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped(&mut stopping) => break,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors, say: wait a moment, then go on.
                if refusals.allow("accept") {
                    tracing::warn!(%error, "accepting an API connection");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            if refusals.allow("limit") {
                tracing::warn!(
                    %peer,
                    limit = limits.max_connections,
                    "too many API connections; closing a new one"
                );
            }
            drop(tcp);
            continue;
        };
        tokio::spawn(serve_connection(
            tcp,
            peer,
            app.clone(),
            limits,
            stopping.clone(),
            permit,
        ));
    }
    drop(listener);
    tracing::info!("HTTP API stopped taking connections; draining");
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

/// One connection, until it closes or, once the API is stopping, until its
/// current answer is sent.
async fn serve_connection(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: ConnectionLimits,
    mut stopping: watch::Receiver<bool>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    // Small SSE writes must leave at once: with Nagle's algorithm a
    // token waits for the client's delayed ACK (40 ms on Linux).
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::debug!(%error, "TCP_NODELAY on an API connection");
    }
    let service = hyper_util::service::TowerToHyperService::new(app);
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
    tokio::pin!(connection);
    let served = tokio::select! {
        served = connection.as_mut() => served,
        _ = stopped(&mut stopping) => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = served {
        tracing::debug!(%peer, %error, "API connection ended");
    }
    drop(permit);
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such endpoint")
}
