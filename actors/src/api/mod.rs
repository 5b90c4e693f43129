//! The HTTP API every node serves (axum): OpenAI Chat Completions and
//! models, and the cluster's own endpoints. Any node answers any request:
//! a generation becomes a TextGeneration command for the master, which
//! gives it to a ready instance, and the chunks come back from that
//! instance's rank 0 on `chunks/{command_id}`.

pub mod anthropic;
pub mod error;
mod generation;
pub mod ollama;
pub mod openai;
pub mod responses;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderValue, Method};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use ractor::{call_t, ActorRef};
use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1::{
    self, download_progress::State as Ds, generation_chunk, runner_status::State as Rs,
};
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use crate::bus::Bus;
use crate::keys::AdminMethod;
use crate::replica::ReplicaMsg;
use error::ApiError;
use generation::{chunk_error, Generation};
use openai::{Answer, ChatRequest, ChunkWriter};

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
        }
    }
}

#[derive(Clone)]
struct Api {
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
    options: Arc<ApiOptions>,
    /// Requests in hand per model.
    queues: Arc<Mutex<HashMap<String, usize>>>,
}

/// Counts a request against its model's bound until dropped.
struct QueueSlot {
    queues: Arc<Mutex<HashMap<String, usize>>>,
    model: String,
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        if let Ok(mut queues) = self.queues.lock() {
            if let Some(n) = queues.get_mut(&self.model) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn rank0_ready(state: &v1::ClusterState, instance: &v1::Instance) -> bool {
    instance.ranks.iter().all(|rank| {
        matches!(
            state
                .runners
                .get(&rank.runner_id)
                .and_then(|s| s.state.as_ref()),
            Some(Rs::Ready(_)) | Some(Rs::Running(_))
        )
    })
}

/// What a request's `model` names.
struct Target {
    /// An instance named directly, or empty (any ready instance of the model).
    instance_id: String,
    model_id: String,
    context: u32,
}

impl Api {
    async fn state(&self) -> Result<v1::ClusterState, ApiError> {
        call_t!(self.replica, ReplicaMsg::GetState, crate::ACTOR_CALL_MS)
            .map_err(|e| ApiError::internal(format!("reading the state: {e}")))
    }

    /// Asks the admin service; a query no node answers (no master yet, an
    /// election under way) is asked again for up to 10 seconds. No answer
    /// means no master took it, so asking again does not do it twice.
    async fn ask<Req: prost::Message, Rep: prost::Message + Default>(
        &self,
        method: AdminMethod,
        request: &Req,
    ) -> Result<Rep, ApiError> {
        let key = self.bus.keys.admin(method);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.bus.query(&key, request, Duration::from_secs(2)).await {
                Ok(reply) => return Ok(reply),
                Err(crate::bus::BusError::NoReply { .. }) if Instant::now() < deadline => {
                    tracing::debug!(key, "no answer yet; asking again");
                }
                Err(error) => {
                    return Err(ApiError::unavailable(format!(
                        "the cluster did not answer ({error}); is a master elected?"
                    )))
                }
            }
        }
    }

    /// The target of `model`, the request's parameters checked against its
    /// card, and a ready instance (placed first where allowed).
    async fn prepare(
        &self,
        model: &str,
        to_params: impl FnOnce(u32) -> Result<v1::TextGenerationParams, ApiError>,
    ) -> Result<(Target, v1::TextGenerationParams), ApiError> {
        let target = self.target(model).await?;
        let params = to_params(target.context)?;
        self.ready(&target, self.options.auto_place).await?;
        Ok((target, params))
    }

    /// Whether a request for `target` can go to an instance now.
    async fn is_ready(&self, target: &Target) -> Result<bool, ApiError> {
        if !target.instance_id.is_empty() {
            return Ok(true);
        }
        let state = self.state().await?;
        Ok(state.instances.values().any(|i| {
            i.model
                .as_ref()
                .is_some_and(|m| m.model_id == target.model_id)
                && rank0_ready(&state, i)
        }))
    }

    /// One line on how the instances of `model` are getting ready.
    async fn progress(&self, model: &str) -> String {
        let Ok(state) = self.state().await else {
            return format!("waiting for {model}");
        };
        let mut parts = Vec::new();
        for instance in state
            .instances
            .values()
            .filter(|i| i.model.as_ref().is_some_and(|m| m.model_id == model))
        {
            for rank in &instance.ranks {
                let download = state
                    .downloads
                    .get(&rank.node_id)
                    .and_then(|d| d.models.get(model))
                    .and_then(|p| p.state.as_ref());
                let status = match state
                    .runners
                    .get(&rank.runner_id)
                    .and_then(|s| s.state.as_ref())
                {
                    None => match download {
                        Some(Ds::Ongoing(o)) => format!(
                            "downloading {:.0}% ({:.1} MB/s)",
                            100.0 * o.downloaded_bytes as f64 / o.total_bytes.max(1) as f64,
                            o.bytes_per_second as f64 / 1e6
                        ),
                        _ => "starting".to_string(),
                    },
                    Some(Rs::Loading(l)) if l.layers_total > 0 => {
                        format!("loading {}/{} layers", l.layers_loaded, l.layers_total)
                    }
                    Some(other) => format!("{other:?}")
                        .split('(')
                        .next()
                        .unwrap_or_default()
                        .to_lowercase(),
                };
                parts.push(format!(
                    "{} rank {}: {status}",
                    instance.instance_id, rank.rank
                ));
            }
        }
        if parts.is_empty() {
            format!("placing {model}")
        } else {
            format!("waiting for {model}: {}", parts.join(", "))
        }
    }

    fn take_slot(&self, model: &str) -> Result<QueueSlot, ApiError> {
        let mut queues = self
            .queues
            .lock()
            .map_err(|_| ApiError::internal("queue bookkeeping"))?;
        let n = queues.entry(model.to_string()).or_insert(0);
        if *n >= self.options.queue_limit {
            return Err(ApiError::too_many(format!(
                "{} requests for {model} are already waiting or running on this node; retry shortly",
                self.options.queue_limit
            )));
        }
        *n += 1;
        Ok(QueueSlot {
            queues: self.queues.clone(),
            model: model.to_string(),
        })
    }

    /// The instance for `model` (an instance id or a model id); places the
    /// model and waits for it when allowed.
    async fn resolve_placing(&self, model: &str, place: bool) -> Result<Target, ApiError> {
        let target = self.target(model).await?;
        self.ready(&target, place).await?;
        Ok(target)
    }

    /// What `model` names (an instance or a model), without waiting: the
    /// request is checked against its card before anything is placed.
    async fn target(&self, model: &str) -> Result<Target, ApiError> {
        let state = self.state().await?;
        if let Some(instance) = state.instances.get(model) {
            let card = instance.model.clone().unwrap_or_default();
            return Ok(Target {
                instance_id: instance.instance_id.clone(),
                model_id: card.model_id,
                context: card.context_length,
            });
        }
        let card = state
            .instances
            .values()
            .filter_map(|i| i.model.as_ref())
            .find(|m| m.model_id == model)
            .cloned()
            .or_else(|| crate::catalogue::find(&state, model));
        let Some(card) = card else {
            let known: Vec<String> = crate::catalogue::all(&state)
                .into_iter()
                .map(|c| c.model_id)
                .collect();
            return Err(ApiError::not_found(
                "model_not_found",
                format!(
                    "the model {model:?} does not exist (known: {})",
                    known.join(", ")
                ),
            ));
        };
        Ok(Target {
            instance_id: String::new(),
            model_id: card.model_id.clone(),
            context: card.context_length,
        })
    }

    /// Waits until an instance of the target's model is ready, placing one
    /// first if there is none and `place` allows it.
    async fn ready(&self, target: &Target, place: bool) -> Result<(), ApiError> {
        if !target.instance_id.is_empty() {
            // A named instance: the master says if it is not ready.
            return Ok(());
        }
        let model = target.model_id.as_str();
        let state = self.state().await?;
        let of_model = |state: &v1::ClusterState| -> (bool, bool) {
            let mut any = false;
            let mut ready = false;
            for instance in state.instances.values() {
                if instance.model.as_ref().is_some_and(|m| m.model_id == model) {
                    any = true;
                    ready |= rank0_ready(state, instance);
                }
            }
            (any, ready)
        };
        let (any, ready) = of_model(&state);
        if ready {
            return Ok(());
        }
        if !any {
            if let Some(reason) = state.given_up.get(model) {
                return Err(given_up(model, reason));
            }
            if !place {
                return Err(ApiError::not_found(
                    "model_not_placed",
                    format!(
                        "no instance of {model:?}: place one with `tessera admin place {model}` or POST /place_instance"
                    ),
                ));
            }
            // Just after start-up the nodes may not have reported yet.
            let waiting = Instant::now();
            let mut state = state;
            while !state
                .nodes
                .values()
                .any(|n| n.info.as_ref().is_some_and(|i| !i.no_worker))
                && waiting.elapsed() < Duration::from_secs(10)
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
                state = self.state().await?;
            }
            tracing::info!(model, "no instance; placing one");
            let reply: v1::PlaceInstanceReply = self
                .ask(
                    AdminMethod::Place,
                    &v1::PlaceInstanceRequest {
                        model_id: model.to_string(),
                        sharding: v1::Sharding::Pipeline as i32,
                        min_nodes: 1,
                        node_ids: Vec::new(),
                        // Asked again under the same id: placed once.
                        request_id: uuid::Uuid::now_v7().to_string(),
                    },
                )
                .await?;
            if let Some(error) = reply.error {
                return Err(ApiError {
                    code: Some("model_does_not_fit"),
                    ..ApiError::unavailable(format!("placing {model}: {}", error.message))
                });
            }
        }
        // Placed (now or before): wait for it to be ready.
        let started = Instant::now();
        let mut last_report = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let state = self.state().await?;
            match of_model(&state) {
                (_, true) => {
                    tracing::info!(model, waited = ?started.elapsed(), "instance ready");
                    return Ok(());
                }
                (false, _) if state.given_up.contains_key(model) => {
                    let reason = state.given_up.get(model).cloned().unwrap_or_default();
                    return Err(given_up(model, &reason));
                }
                (false, _) if !place => {
                    return Err(ApiError::not_found(
                        "model_not_placed",
                        format!("the instance of {model:?} is gone"),
                    ))
                }
                _ => {}
            }
            // A node that cannot get the files: say why at once (after a
            // moment, so a failure left from an earlier try is retried).
            if started.elapsed() > DOWNLOAD_RETRY_GRACE {
                if let Some(reason) = download_failure(&state, model) {
                    return Err(ApiError::unavailable(reason));
                }
            }
            if started.elapsed() > self.options.ready_timeout {
                return Err(ApiError::unavailable(format!(
                    "{model} is not ready after {:?}",
                    self.options.ready_timeout
                )));
            }
            if last_report.elapsed() > Duration::from_secs(5) {
                last_report = Instant::now();
                tracing::info!(model, waited = ?started.elapsed(), "waiting for the instance");
            }
        }
    }
}

/// Serves the API until the task is aborted; returns the bound address.
pub async fn serve(
    options: ApiOptions,
    node_id: String,
    bus: Bus,
    replica: ActorRef<ReplicaMsg>,
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
    let api = Api {
        node_id,
        bus,
        replica,
        options: Arc::new(options),
        queues: Arc::new(Mutex::new(HashMap::new())),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses_handler))
        .route("/api/version", get(ollama_version))
        .route("/api/tags", get(ollama_tags))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/node_id", get(node_id_handler))
        .route("/state", get(state_handler))
        .route("/instance/previews", get(previews))
        .route("/place_instance", post(place_instance))
        .route("/instance/{id}", get(get_instance))
        .route("/instance/{id}", delete(delete_instance))
        .route("/events", get(events))
        .route("/models/add", post(add_model))
        .route("/downloads", get(downloads))
        .route("/download/{action}", post(download_action))
        .route("/download/{node}/{*model}", delete(delete_download))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
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
    let mut refusals = crate::throttle::Throttle::new(Duration::from_secs(5));
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

/// A request for a model whose instance the cluster gave up.
fn given_up(model: &str, reason: &str) -> ApiError {
    ApiError {
        code: Some("model_failed"),
        ..ApiError::unavailable(format!(
            "the instance of {model} was given up: {reason}; fix the cause, then place it \
             again with `tessera admin place {model}` or POST /place_instance"
        ))
    }
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such endpoint")
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

/// A generation under way: the first chunk is in hand, so errors before
/// any answer are HTTP errors.
struct Begun {
    generation: Generation,
    first: generation_chunk::Kind,
    slot: QueueSlot,
}

/// How often a request whose instance went away before it answered is
/// tried again (on the instance placed in its stead).
const MAX_ATTEMPTS: u32 = 10;

impl Api {
    /// Starts a generation and waits for its first chunk. If the instance
    /// goes away before it answers (its node was lost, the master is being
    /// replaced), the request waits for a ready instance and tries again:
    /// the client sees a slower answer, not an error.
    async fn begin(
        &self,
        target: &Target,
        params: v1::TextGenerationParams,
    ) -> Result<Begun, ApiError> {
        let slot = self.take_slot(&target.model_id)?;
        let started = Instant::now();
        for attempt in 1.. {
            let mut generation = Generation::start(
                &self.bus,
                &self.replica,
                &self.node_id,
                &target.instance_id,
                params.clone(),
                self.options.chunk_timeout,
            )
            .await?;
            let first = generation.next().await;
            tracing::debug!(command_id = generation.command_id, attempt, "first chunk");
            let first = match first {
                Some(Ok(generation_chunk::Kind::Error(error))) => {
                    if self
                        .may_try_again(target, &generation, &error, attempt, started)
                        .await
                    {
                        tracing::info!(
                            model = target.model_id,
                            attempt,
                            reason = error.message,
                            "the instance went away before it answered; trying again"
                        );
                        tokio::time::sleep(Duration::from_millis(250)).await;
                        self.ready(target, self.options.auto_place).await?;
                        continue;
                    }
                    return Err(chunk_error(&error));
                }
                Some(Ok(chunk)) => chunk,
                Some(Err(error)) => return Err(error),
                None => return Err(ApiError::internal("the answer ended before it began")),
            };
            return Ok(Begun {
                generation,
                first,
                slot,
            });
        }
        Err(ApiError::internal("no attempt was made"))
    }

    /// Whether an error before the first token came from the instance going
    /// away (rather than from the request), so that another instance of
    /// the model may answer it.
    async fn may_try_again(
        &self,
        target: &Target,
        generation: &Generation,
        error: &v1::ErrorChunk,
        attempt: u32,
        started: Instant,
    ) -> bool {
        if !target.instance_id.is_empty()
            || attempt >= MAX_ATTEMPTS
            || started.elapsed() > self.options.ready_timeout
            || error.kind == "invalid_request"
        {
            return false;
        }
        if error.kind == generation::INSTANCE_LOST || error.kind == "not_found" {
            return true;
        }
        // An engine error (a ring peer gone): only if its instance is no
        // longer ready, which the state shows within a moment.
        let Some(instance_id) = generation.instance_id() else {
            return false;
        };
        for _ in 0..10 {
            let Ok(state) = self.state().await else {
                return false;
            };
            let ready = state
                .instances
                .get(instance_id)
                .is_some_and(|i| rank0_ready(&state, i));
            if !ready {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }
}

/// Sends what each chunk of a generation becomes (`render` maps a chunk,
/// or an error, to the items to send) until the answer ends or the client
/// leaves; dropping the generation then cancels it. False if the client
/// left.
async fn pump<T>(
    tx: &tokio::sync::mpsc::Sender<T>,
    begun: Begun,
    mut render: impl FnMut(Result<generation_chunk::Kind, ApiError>) -> Vec<T>,
) -> bool {
    let Begun {
        mut generation,
        first,
        slot: _slot,
    } = begun;
    let mut chunk = Some(Ok(first));
    while let Some(next) = chunk {
        for item in render(next) {
            if tx.send(item).await.is_err() {
                return false;
            }
        }
        chunk = tokio::select! {
            next = generation.next() => next,
            _ = tx.closed() => return false,
        };
    }
    true
}

type EventSender = tokio::sync::mpsc::Sender<Result<Event, Infallible>>;

/// A channel whose events become an SSE response (with keep-alive
/// comments during long prefills).
fn sse_channel() -> (EventSender, Response) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(256);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|event| (event, rx))
    });
    let response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response();
    (tx, response)
}

/// A named SSE event with a JSON body.
fn named((name, value): (&str, Value)) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(value.to_string()))
}

/// An unnamed SSE event with a JSON body.
fn data(value: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(value.to_string()))
}

/// An error in Anthropic's shape.
struct AnthropicError(ApiError);

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status, Json(anthropic::error_body(&self.0))).into_response()
    }
}

impl From<ApiError> for AnthropicError {
    fn from(error: ApiError) -> Self {
        Self(error)
    }
}

async fn messages(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AnthropicError> {
    let request: anthropic::MessagesRequest = parse(body)?;
    let (target, params) = api
        .prepare(&request.model, |context| request.to_params(context))
        .await?;
    let begun = api.begin(&target, params).await?;
    let id = format!("msg_{}", begun.generation.command_id.replace('-', ""));
    tracing::info!(request = %id, model = %request.model, stream = request.streaming(), "messages");
    if !request.streaming() {
        let Begun {
            mut generation,
            first,
            slot,
        } = begun;
        let mut chunks = vec![first];
        while let Some(next) = generation.next().await {
            match next? {
                generation_chunk::Kind::Error(error) => return Err(chunk_error(&error).into()),
                kind => chunks.push(kind),
            }
        }
        drop(slot);
        return Ok(Json(anthropic::message(&id, &request.model, &chunks)).into_response());
    }
    let mut writer = anthropic::EventWriter::new(id, request.model.clone());
    let (tx, response) = sse_channel();
    tokio::spawn(async move {
        if tx.send(named(writer.start())).await.is_err() {
            return;
        }
        pump(&tx, begun, |chunk| match chunk {
            Ok(generation_chunk::Kind::Error(error)) => vec![named((
                "error",
                anthropic::error_body(&chunk_error(&error)),
            ))],
            Ok(kind) => writer.write(&kind).into_iter().map(named).collect(),
            Err(error) => vec![named(("error", anthropic::error_body(&error)))],
        })
        .await;
    });
    Ok(response)
}

/// An error in Ollama's shape.
struct OllamaError(ApiError);

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        (self.0.status, Json(ollama::error_body(&self.0))).into_response()
    }
}

impl From<ApiError> for OllamaError {
    fn from(error: ApiError) -> Self {
        Self(error)
    }
}

async fn ollama_version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

async fn ollama_tags(State(api): State<Api>) -> Result<Json<Value>, OllamaError> {
    let state = api.state().await?;
    let mut cards = crate::catalogue::all(&state);
    for card in state.instances.values().filter_map(|i| i.model.as_ref()) {
        if !cards.iter().any(|c| c.model_id == card.model_id) {
            cards.push(card.clone());
        }
    }
    let models: Vec<Value> = cards
        .iter()
        .map(|c| {
            json!({
                "name": c.model_id,
                "model": c.model_id,
                "modified_at": "1970-01-01T00:00:00Z",
                "size": c.storage_size_bytes,
                "digest": "",
                "details": {
                    "format": "gguf",
                    "family": c.family,
                    "families": [c.family],
                    "parameter_size": "",
                    "quantization_level": c.quantization,
                },
            })
        })
        .collect();
    Ok(Json(json!({"models": models})))
}

fn rfc3339_now() -> String {
    let seconds = now_unix();
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let days = (seconds / 86_400) as i64;
    let rest = seconds % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// Answers an Ollama request: one object, or a stream of lines.
async fn ollama_answer(
    api: Api,
    model: String,
    stream: bool,
    shape: ollama::Shape,
    params: v1::TextGenerationParams,
    target: Target,
) -> Result<Response, OllamaError> {
    let Begun {
        mut generation,
        first,
        slot,
    } = api.begin(&target, params).await?;
    tracing::info!(request = %generation.command_id, model = %model, stream, "ollama");
    let mut writer = ollama::LineWriter::new(shape, model, rfc3339_now());
    if !stream {
        let mut chunk = Some(Ok(first));
        while let Some(next) = chunk {
            match next? {
                generation_chunk::Kind::Error(error) => return Err(chunk_error(&error).into()),
                kind => {
                    if let Some(done) = writer.gather(&kind) {
                        drop(slot);
                        return Ok(Json(done).into_response());
                    }
                }
            }
            chunk = generation.next().await;
        }
        return Err(ApiError::internal("the answer ended without a finish").into());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(256);
    let line = |value: Value| Ok(Bytes::from(format!("{value}\n")));
    let begun = Begun {
        generation,
        first,
        slot,
    };
    tokio::spawn(async move {
        pump(&tx, begun, |chunk| {
            let value = match chunk {
                Ok(generation_chunk::Kind::Error(error)) => {
                    Some(ollama::error_body(&chunk_error(&error)))
                }
                Ok(kind) => writer.stream(&kind),
                Err(error) => Some(ollama::error_body(&error)),
            };
            value.into_iter().map(line).collect()
        })
        .await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|line| (line, rx))
    });
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(stream),
    )
        .into_response())
}

async fn ollama_chat(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OllamaError> {
    let request: ollama::ChatRequest = parse(body)?;
    let (target, params) = api
        .prepare(&request.model, |context| request.to_params(context))
        .await?;
    let (model, stream) = (request.model.clone(), request.streaming());
    ollama_answer(api, model, stream, ollama::Shape::Chat, params, target).await
}

async fn ollama_generate(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OllamaError> {
    let request: ollama::GenerateRequest = parse(body)?;
    let (target, params) = api
        .prepare(&request.model, |context| request.to_params(context))
        .await?;
    let (model, stream) = (request.model.clone(), request.streaming());
    ollama_answer(api, model, stream, ollama::Shape::Generate, params, target).await
}

async fn responses_handler(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: responses::ResponsesRequest = parse(body)?;
    let (target, params) = api
        .prepare(&request.model, |context| request.to_params(context))
        .await?;
    let Begun {
        mut generation,
        first,
        slot,
    } = api.begin(&target, params).await?;
    let id = format!("resp_{}", generation.command_id.replace('-', ""));
    tracing::info!(request = %id, model = %request.model, stream = request.streaming(), "responses");
    let mut writer = responses::ResponseWriter::new(id, request.model.clone(), now_unix());
    if !request.streaming() {
        let mut chunk = Some(Ok(first));
        while let Some(next) = chunk {
            match next? {
                generation_chunk::Kind::Error(error) => return Err(chunk_error(&error)),
                generation_chunk::Kind::Finish(finish) => {
                    writer.write(&generation_chunk::Kind::Finish(finish));
                    drop(slot);
                    return Ok(Json(writer.response(Some(&finish))).into_response());
                }
                kind => {
                    writer.write(&kind);
                }
            }
            chunk = generation.next().await;
        }
        return Err(ApiError::internal("the answer ended without a finish"));
    }
    let (tx, response) = sse_channel();
    let begun = Begun {
        generation,
        first,
        slot,
    };
    tokio::spawn(async move {
        for e in writer.start() {
            if tx.send(named(e)).await.is_err() {
                return;
            }
        }
        pump(&tx, begun, |chunk| match chunk {
            Ok(generation_chunk::Kind::Error(error)) => {
                vec![named(("error", chunk_error(&error).body()))]
            }
            Ok(kind) => writer.write(&kind).into_iter().map(named).collect(),
            Err(error) => vec![named(("error", error.body()))],
        })
        .await;
    });
    Ok(response)
}

async fn chat_completions(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body)?;
    let target = api.target(&request.model).await?;
    let params = request.to_params(target.context)?;
    let (stream, include_usage) = request.streaming();
    let created = now_unix();
    let model = request.model.clone();
    if !stream {
        api.ready(&target, api.options.auto_place).await?;
        let Begun {
            mut generation,
            first,
            slot,
        } = api.begin(&target, params).await?;
        let id = format!("chatcmpl-{}", generation.command_id);
        tracing::info!(request = %id, model = %model, stream, "chat completion");
        let mut answer = Answer::default();
        let mut chunk = Some(Ok(first));
        while let Some(next) = chunk {
            match next? {
                generation_chunk::Kind::Error(error) => return Err(chunk_error(&error)),
                kind => answer.push(&kind),
            }
            chunk = generation.next().await;
        }
        drop(slot);
        let logprobs = request.logprobs.unwrap_or(false);
        return Ok(Json(answer.completion(&id, &model, created, logprobs)).into_response());
    }
    // A model that must be placed or loaded first: the stream starts at
    // once and tells how the wait goes in SSE comments; otherwise an error
    // before the answer is still an HTTP error.
    let begun = if api.is_ready(&target).await? {
        Some(api.begin(&target, params.clone()).await?)
    } else {
        None
    };
    let (tx, response) = sse_channel();
    tokio::spawn(async move {
        let begun = match begun {
            Some(begun) => begun,
            None => match wait_with_progress(&api, &target, &tx).await {
                Some(Ok(())) => match api.begin(&target, params).await {
                    Ok(begun) => begun,
                    Err(error) => {
                        let _ = tx.send(data(&error.body())).await;
                        return;
                    }
                },
                Some(Err(error)) => {
                    let _ = tx.send(data(&error.body())).await;
                    return;
                }
                None => return,
            },
        };
        let id = format!("chatcmpl-{}", begun.generation.command_id);
        tracing::info!(request = %id, model = %model, stream, "chat completion");
        let mut writer = ChunkWriter::new(id, model, created, include_usage);
        if tx.send(data(&writer.start())).await.is_err() {
            return;
        }
        let finished = pump(&tx, begun, |chunk| match chunk {
            Ok(generation_chunk::Kind::Error(error)) => vec![data(&chunk_error(&error).body())],
            Ok(kind) => writer.write(&kind).iter().map(data).collect(),
            Err(error) => vec![data(&error.body())],
        })
        .await;
        if finished {
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        }
    });
    Ok(response)
}

/// Waits for the target's instance, telling the client how it goes in SSE
/// comments each second; None if the client left.
async fn wait_with_progress(
    api: &Api,
    target: &Target,
    tx: &EventSender,
) -> Option<Result<(), ApiError>> {
    let wait = api.ready(target, api.options.auto_place);
    tokio::pin!(wait);
    let mut report = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            result = &mut wait => return Some(result),
            _ = report.tick() => {
                let line = api.progress(&target.model_id).await;
                if tx.send(Ok(Event::default().comment(line))).await.is_err() {
                    return None;
                }
            }
        }
    }
}

async fn models(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    let mut cards: Vec<v1::ModelCard> = crate::catalogue::all(&state);
    for instance in state.instances.values() {
        if let Some(card) = &instance.model {
            if !cards.iter().any(|c| c.model_id == card.model_id) {
                cards.push(card.clone());
            }
        }
    }
    let data: Vec<Value> = cards
        .iter()
        .map(|card| {
            let instances: Vec<&v1::Instance> = state
                .instances
                .values()
                .filter(|i| {
                    i.model
                        .as_ref()
                        .is_some_and(|m| m.model_id == card.model_id)
                })
                .collect();
            let ready = instances.iter().any(|i| rank0_ready(&state, i));
            json!({
                "id": card.model_id,
                "object": "model",
                "created": 0,
                "owned_by": "tessera",
                "context_length": card.context_length,
                "instances": instances.len(),
                "ready": ready,
                "downloaded_on": crate::placement::downloaded_on(&state, &card.model_id),
                "partly_downloaded_on": crate::placement::partly_on(&state, &card.model_id),
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn node_id_handler(State(api): State<Api>) -> Json<Value> {
    Json(json!(api.node_id))
}

async fn state_handler(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    let digest = tessera_state::State::from_proto(state.clone()).digest();
    let last_index = state.last_index;
    let state = serde_json::to_value(&state).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(json!({
        "last_index": last_index,
        "digest": digest.to_string(),
        "state": state,
    })))
}

#[derive(Deserialize)]
struct PreviewsQuery {
    model_id: String,
}

async fn previews(
    State(api): State<Api>,
    Query(query): Query<PreviewsQuery>,
) -> Result<Json<Value>, ApiError> {
    let reply: v1::PlacementPreviewsReply = api
        .ask(
            AdminMethod::Previews,
            &v1::PlacementPreviewsRequest {
                model_id: query.model_id,
                node_ids: Vec::new(),
            },
        )
        .await?;
    admin_json(&reply, reply.error.as_ref())
}

/// An admin reply's error as the API's (its kind read from the code, or
/// from the string of an older node).
fn admin_error(error: &v1::AdminError) -> ApiError {
    ApiError::from(crate::admin::AdminFailure::from_proto(error))
}

#[derive(Deserialize)]
struct PlaceBody {
    #[serde(alias = "model")]
    model_id: String,
    #[serde(default)]
    sharding: Option<String>,
    #[serde(default)]
    min_nodes: Option<u32>,
}

async fn place_instance(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body: PlaceBody = parse(body)?;
    let sharding = match body
        .sharding
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("pipeline") => v1::Sharding::Pipeline,
        Some("tensor") => v1::Sharding::Tensor,
        Some(other) => {
            return Err(ApiError::invalid(
                "sharding",
                format!("sharding must be pipeline or tensor, not {other:?}"),
            ))
        }
    };
    let reply: v1::PlaceInstanceReply = api
        .ask(
            AdminMethod::Place,
            &v1::PlaceInstanceRequest {
                model_id: body.model_id,
                sharding: sharding as i32,
                min_nodes: body.min_nodes.unwrap_or(1),
                node_ids: Vec::new(),
                request_id: uuid::Uuid::now_v7().to_string(),
            },
        )
        .await?;
    admin_json(&reply, reply.error.as_ref())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddModelBody {
    /// A hub repository, `OWNER/NAME`.
    model: String,
    #[serde(default)]
    revision: Option<String>,
}

/// `POST /models/add`: a custom card built from a hub repository.
async fn add_model(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body: AddModelBody = parse(body)?;
    let reply: v1::AddModelReply = api
        .ask(
            AdminMethod::AddModel,
            &v1::AddModelRequest {
                hub_repo: body.model,
                revision: body.revision.unwrap_or_default(),
            },
        )
        .await?;
    admin_json(&reply, reply.error.as_ref())
}

/// `GET /downloads`: every node's downloads, as the log has them.
async fn downloads(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    serde_json::to_value(&state.downloads)
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DownloadBody {
    model: String,
    /// The node; empty: this one.
    #[serde(default)]
    node_id: Option<String>,
}

/// `POST /download/{start|cancel|delete}`.
async fn download_action(
    State(api): State<Api>,
    Path(action): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let action = match action.as_str() {
        "start" => v1::DownloadAction::Start,
        "cancel" => v1::DownloadAction::Cancel,
        "delete" => v1::DownloadAction::Delete,
        other => {
            return Err(ApiError::not_found(
                "not_found",
                format!("no download action {other:?} (start, cancel or delete)"),
            ))
        }
    };
    let body: DownloadBody = parse(body)?;
    let node_id = body.node_id.unwrap_or_else(|| api.node_id.clone());
    download_request(&api, action, node_id, body.model).await
}

/// `DELETE /download/{node}/{model}` (exo's form of the delete).
async fn delete_download(
    State(api): State<Api>,
    Path((node_id, model)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    download_request(&api, v1::DownloadAction::Delete, node_id, model).await
}

async fn download_request(
    api: &Api,
    action: v1::DownloadAction,
    node_id: String,
    model_id: String,
) -> Result<Json<Value>, ApiError> {
    let reply: v1::DownloadReply = api
        .ask(
            AdminMethod::Download,
            &v1::DownloadRequest {
                action: action as i32,
                node_id,
                model_id,
            },
        )
        .await?;
    admin_json(&reply, reply.error.as_ref())
}

/// How long a failed download left from an earlier try may stand before a
/// waiting request gives up on it (a new instance makes its nodes try again).
const DOWNLOAD_RETRY_GRACE: Duration = Duration::from_secs(3);

/// Why a node of an instance of `model` cannot get its files, if one cannot.
fn download_failure(state: &v1::ClusterState, model: &str) -> Option<String> {
    state
        .instances
        .values()
        .filter(|i| i.model.as_ref().is_some_and(|m| m.model_id == model))
        .flat_map(|i| &i.ranks)
        .find_map(|rank| {
            let progress = state.downloads.get(&rank.node_id)?.models.get(model)?;
            match &progress.state {
                Some(Ds::Failed(f)) => Some(format!(
                    "node {} cannot get the files of {model}: {}",
                    rank.node_id, f.reason
                )),
                _ => None,
            }
        })
}

/// An admin reply as the JSON answer, or its error as the API's.
fn admin_json<T: serde::Serialize>(
    reply: &T,
    error: Option<&v1::AdminError>,
) -> Result<Json<Value>, ApiError> {
    if let Some(error) = error {
        return Err(admin_error(error));
    }
    serde_json::to_value(reply)
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
}

async fn get_instance(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    let instance = state
        .instances
        .get(&id)
        .ok_or_else(|| ApiError::not_found("not_found", format!("no instance {id:?}")))?;
    let runners: serde_json::Map<String, Value> = instance
        .ranks
        .iter()
        .filter_map(|r| {
            let status = state.runners.get(&r.runner_id)?;
            Some((r.runner_id.clone(), serde_json::to_value(status).ok()?))
        })
        .collect();
    Ok(Json(json!({
        "instance": serde_json::to_value(instance).map_err(|e| ApiError::internal(e.to_string()))?,
        "runners": runners,
        "ready": rank0_ready(&state, instance),
    })))
}

async fn delete_instance(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let reply: v1::DeleteInstanceReply = api
        .ask(
            AdminMethod::Delete,
            &v1::DeleteInstanceRequest {
                instance_id: id.clone(),
            },
        )
        .await?;
    if let Some(error) = &reply.error {
        return Err(admin_error(error));
    }
    Ok(Json(json!({"deleted": id})))
}

#[derive(Deserialize)]
struct EventsQuery {
    #[serde(default)]
    from: Option<u64>,
}

/// The indexed events from `from` on, then each new one as it is applied.
async fn events(State(api): State<Api>, Query(query): Query<EventsQuery>) -> Response {
    let (tx, response) = sse_channel();
    let mut next = query.from.unwrap_or(1).max(1);
    tokio::spawn(async move {
        loop {
            let events = call_t!(
                api.replica,
                |reply| ReplicaMsg::GetRange {
                    from: next,
                    to: u64::MAX,
                    reply
                },
                crate::ACTOR_CALL_MS
            )
            .unwrap_or_default();
            for event in events {
                next = event.index + 1;
                let Ok(text) = serde_json::to_string(&event) else {
                    continue;
                };
                if tx.send(Ok(Event::default().data(text))).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = tx.closed() => return,
            }
        }
    });
    response
}
