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
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use super::context::{Api, Queues};
use super::error::ApiError;
use super::options::ApiOptions;
use super::{anthropic, auth, cluster, dashboard, join, live, ollama, openai, responses};
use ractor::call_t;
use tessera_actors::bus::Bus;
use tessera_actors::cluster::election::actor::Leadership;
use tessera_actors::cluster::replica::ReplicaMsg;

/// Serves the API until the task is aborted; returns the bound address.
pub async fn serve(
    options: ApiOptions,
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    leadership: Leadership,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let cors = if options.cors_origins.is_empty() {
        CorsLayer::new()
            .allow_origin(Any)
            .allow_methods(Any)
            .allow_headers(Any)
    } else {
        let origins: Vec<HeaderValue> = options
            .cors_origins
            .iter()
            .filter_map(|o| HeaderValue::from_str(o).ok())
            .collect();
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers(Any)
    };
    let max_body = options.max_body_bytes;
    let listener = tokio::net::TcpListener::bind(options.listen).await?;
    let address = listener.local_addr()?;
    let state = call_t!(replica, ReplicaMsg::Watch, tessera_actors::ACTOR_CALL_MS)
        .map_err(|e| std::io::Error::other(format!("watching the state: {e}")))?;
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
    };
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(openai::handlers::chat_completions),
        )
        .route("/v1/models", get(openai::handlers::models))
        .route("/v1/messages", post(anthropic::handlers::messages))
        .route("/v1/responses", post(responses::handlers::responses))
        .route("/api/version", get(ollama::handlers::version))
        .route("/api/tags", get(ollama::handlers::tags))
        .route("/api/chat", post(ollama::handlers::chat))
        .route("/api/generate", post(ollama::handlers::generate))
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
        .layer(DefaultBodyLimit::max(max_body))
        // Inside CORS: a browser's preflight carries no key.
        .layer(axum::middleware::from_fn_with_state(
            api.options.api_keys.clone(),
            auth::require_key,
        ))
        .layer(cors)
        .with_state(api.clone());
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
    let task = tokio::spawn(accept_loop(listener, app, limits));
    Ok((address, task))
}

#[derive(Clone, Copy)]
struct ConnectionLimits {
    idle_timeout: Duration,
    max_connections: usize,
}

/// Accepts connections and serves HTTP/1.1 on each, with a header-read and
/// idle timeout (a slow or silent client does not hold a connection) and a
/// bound on connections (one over it is closed at once, so a flood cannot
/// exhaust the node's file descriptors).
async fn accept_loop(listener: tokio::net::TcpListener, app: Router, limits: ConnectionLimits) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut refusals = tessera_actors::throttle::Throttle::new(Duration::from_secs(5));
    loop {
        let (tcp, peer) = match listener.accept().await {
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
        // Small SSE writes must leave at once: with Nagle's algorithm a
        // token waits for the client's delayed ACK (40 ms on Linux).
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY on an API connection");
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.idle_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                .await;
            if let Err(error) = served {
                tracing::debug!(%peer, %error, "API connection ended");
            }
            drop(permit);
        });
    }
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such endpoint")
}
