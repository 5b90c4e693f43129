//! The cluster's own endpoints: `/node_id`, `/models`, `/instance/...`
//! (with `PUT /instance/{id}/draft`), `/place_instance`, `/events`,
//! `/models/add`, `/downloads` and `/download/...`. Mutations are the admin service's, asked of the master
//! over zenoh; an admin refusal answers with its kind's status.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::response::sse::Event;
use axum::response::Response;
use axum::Json;
use ractor::call_t;
use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1;

use super::body::parse;
use super::context::{stopped, Api};
use super::error::ApiError;
use super::ready::rank0_ready;
use super::sse::sse_channel;
use tessera_actors::admin::AdminFailure;
use tessera_actors::bus::keys::AdminMethod;
use tessera_actors::cluster::replica::ReplicaMsg;

impl Api {
    /// Asks the admin service; a query no node answers (no master yet, an
    /// election under way) is asked again for up to 10 seconds. No answer
    /// means no master took it, so asking again does not do it twice.
    pub(super) async fn ask<Req: prost::Message, Rep: prost::Message + Default>(
        &self,
        method: AdminMethod,
        request: &Req,
    ) -> Result<Rep, ApiError> {
        let key = self.bus.keys.admin(method);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.bus.query(&key, request, answer_within(method)).await {
                Ok(reply) => return Ok(reply),
                Err(tessera_actors::bus::BusError::NoReply { .. }) if Instant::now() < deadline => {
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
}

/// How long the master may take to answer: adding a model reads a hub
/// (file lists, GGUF headers, retried on errors), which takes longer than
/// a look at the state.
fn answer_within(method: AdminMethod) -> Duration {
    match method {
        AdminMethod::AddModel => Duration::from_secs(60),
        _ => Duration::from_secs(2),
    }
}

pub(super) async fn node_id(State(api): State<Api>) -> Json<Value> {
    Json(json!(api.node_id))
}

/// `GET /models`: the catalogue (built-in and added cards) with the nodes
/// that hold each model's files, as this node's state has it.
pub(super) async fn models(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    serde_json::to_value(tessera_actors::catalogue::listings(&state))
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
}

#[derive(Deserialize)]
pub(super) struct PreviewsQuery {
    model_id: String,
}

pub(super) async fn previews(
    State(api): State<Api>,
    Query(query): Query<PreviewsQuery>,
) -> Result<Json<Value>, ApiError> {
    let request = v1::PlacementPreviewsRequest {
        model_id: query.model_id,
        node_ids: Vec::new(),
    };
    admin_json::<_, v1::PlacementPreviewsReply>(&api, AdminMethod::Previews, &request).await
}

/// An admin reply: its error, set when the request failed.
trait AdminReply: prost::Message + Default + serde::Serialize {
    fn error(&self) -> Option<&v1::AdminError>;
}

macro_rules! admin_replies {
    ($($reply:ty),*) => {$(
        impl AdminReply for $reply {
            fn error(&self) -> Option<&v1::AdminError> {
                self.error.as_ref()
            }
        }
    )*};
}

admin_replies!(
    v1::PlacementPreviewsReply,
    v1::PlaceInstanceReply,
    v1::DeleteInstanceReply,
    v1::AddModelReply,
    v1::DownloadReply,
    v1::SetDraftReply
);

/// Asks the admin service; its reply, or its refusal as the API's error
/// (the kind read from the code, or from the string of an older node).
async fn admin_call<Req: prost::Message, Rep: AdminReply>(
    api: &Api,
    method: AdminMethod,
    request: &Req,
) -> Result<Rep, ApiError> {
    let reply: Rep = api.ask(method, request).await?;
    match reply.error() {
        Some(error) => Err(AdminFailure::from_proto(error).into()),
        None => Ok(reply),
    }
}

/// [`admin_call`], the reply as the JSON answer.
async fn admin_json<Req: prost::Message, Rep: AdminReply>(
    api: &Api,
    method: AdminMethod,
    request: &Req,
) -> Result<Json<Value>, ApiError> {
    let reply: Rep = admin_call(api, method, request).await?;
    serde_json::to_value(&reply)
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
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

pub(super) async fn place_instance(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body: PlaceBody = parse(body)?;
    let request = v1::PlaceInstanceRequest {
        model_id: body.model_id,
        sharding: sharding_of(body.sharding.as_deref())? as i32,
        min_nodes: body.min_nodes.unwrap_or(1),
        node_ids: Vec::new(),
        request_id: uuid::Uuid::now_v7().to_string(),
    };
    admin_json::<_, v1::PlaceInstanceReply>(&api, AdminMethod::Place, &request).await
}

/// A sharding's name (any case; none: pipeline).
fn sharding_of(name: Option<&str>) -> Result<v1::Sharding, ApiError> {
    match name.map(str::to_ascii_lowercase).as_deref() {
        None | Some("pipeline") => Ok(v1::Sharding::Pipeline),
        Some("tensor") => Ok(v1::Sharding::Tensor),
        Some(other) => Err(ApiError::invalid(
            "sharding",
            format!("sharding must be pipeline or tensor, not {other:?}"),
        )),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddModelBody {
    /// A hub repository, `OWNER/NAME`.
    model: String,
    #[serde(default)]
    revision: Option<String>,
    /// A GGUF repository's file to add (any shard of a split one).
    #[serde(default)]
    file: Option<String>,
    /// A GGUF repository's quantization (default Q4_K_M, else the closest).
    #[serde(default)]
    quant: Option<String>,
}

/// `POST /models/add`: a custom card built from a hub repository.
pub(super) async fn add_model(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body: AddModelBody = parse(body)?;
    let request = v1::AddModelRequest {
        hub_repo: body.model,
        revision: body.revision.unwrap_or_default(),
        file: body.file.unwrap_or_default(),
        quant: body.quant.unwrap_or_default(),
    };
    admin_json::<_, v1::AddModelReply>(&api, AdminMethod::AddModel, &request).await
}

/// `GET /downloads`: every node's downloads, as the log has them.
pub(super) async fn downloads(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
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
pub(super) async fn download_action(
    State(api): State<Api>,
    Path(action): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let action = action_of(&action)?;
    let body: DownloadBody = parse(body)?;
    let node_id = body.node_id.unwrap_or_else(|| api.node_id.clone());
    download_request(&api, action, node_id, body.model).await
}

/// `DELETE /download/{node}/{model}` (exo's form of the delete).
pub(super) async fn delete_download(
    State(api): State<Api>,
    Path((node_id, model)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    download_request(&api, v1::DownloadAction::Delete, node_id, model).await
}

/// A download action's name in the path; another is no endpoint (404).
fn action_of(name: &str) -> Result<v1::DownloadAction, ApiError> {
    match name {
        "start" => Ok(v1::DownloadAction::Start),
        "cancel" => Ok(v1::DownloadAction::Cancel),
        "delete" => Ok(v1::DownloadAction::Delete),
        other => Err(ApiError::not_found(
            "not_found",
            format!("no download action {other:?} (start, cancel or delete)"),
        )),
    }
}

async fn download_request(
    api: &Api,
    action: v1::DownloadAction,
    node_id: String,
    model_id: String,
) -> Result<Json<Value>, ApiError> {
    let request = v1::DownloadRequest {
        action: action as i32,
        node_id,
        model_id,
    };
    admin_json::<_, v1::DownloadReply>(api, AdminMethod::Download, &request).await
}

pub(super) async fn get_instance(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    let instance = state
        .instances
        .get(&id)
        .ok_or_else(|| ApiError::not_found("not_found", format!("no instance {id:?}")))?;
    let mut shown = instance.clone();
    super::live::redact(&mut shown);
    let runners: serde_json::Map<String, Value> = instance
        .ranks
        .iter()
        .filter_map(|r| {
            let status = state.runners.get(&r.runner_id)?;
            Some((r.runner_id.clone(), serde_json::to_value(status).ok()?))
        })
        .collect();
    Ok(Json(json!({
        "instance": serde_json::to_value(&shown).map_err(|e| ApiError::internal(e.to_string()))?,
        "runners": runners,
        "ready": rank0_ready(&state, instance),
    })))
}

pub(super) async fn delete_instance(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let request = v1::DeleteInstanceRequest {
        instance_id: id.clone(),
    };
    admin_call::<_, v1::DeleteInstanceReply>(&api, AdminMethod::Delete, &request).await?;
    Ok(Json(json!({"deleted": id})))
}

/// The body of `PUT /instance/{id}/draft`: one of a draft model
/// (`{"model": "M", "tokens": 4}`), prompt lookup (`{"ngram": true,
/// "tokens": 4}`) or none (`{"off": true}`); `tokens` (1 to 16) defaults
/// to 4.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DraftBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    ngram: Option<bool>,
    #[serde(default)]
    off: Option<bool>,
    #[serde(default)]
    tokens: Option<u32>,
}

/// The draft a body asks for (`None`: off), or why the body is wrong. The
/// token count's range and the model are the master's to check.
fn draft_of(body: &DraftBody) -> Result<Option<v1::InstanceDraft>, ApiError> {
    let chosen = [
        body.model.is_some(),
        body.ngram.is_some(),
        body.off.is_some(),
    ];
    if chosen.iter().filter(|c| **c).count() != 1 {
        return Err(ApiError::bad_request(
            "give one of \"model\" (a draft model), \"ngram\": true (prompt lookup) or \"off\": true",
        ));
    }
    let tokens = body.tokens.unwrap_or(0);
    match (&body.model, body.ngram, body.off) {
        (_, _, Some(true)) if body.tokens.is_some() => {
            Err(ApiError::invalid("tokens", "\"off\" takes no tokens"))
        }
        (_, _, Some(true)) => Ok(None),
        (_, _, Some(false)) => Err(ApiError::invalid("off", "\"off\" must be true")),
        (_, Some(false), _) => Err(ApiError::invalid(
            "ngram",
            "\"ngram\" must be true (\"off\": true clears the draft)",
        )),
        (_, Some(true), _) => Ok(Some(v1::InstanceDraft {
            method: v1::DraftMethod::Ngram as i32,
            num_draft_tokens: tokens,
            ..Default::default()
        })),
        (Some(model), _, _) if model.trim().is_empty() => Err(ApiError::invalid(
            "model",
            "\"model\" names the draft model",
        )),
        (Some(model), _, _) => Ok(Some(v1::InstanceDraft {
            method: v1::DraftMethod::DraftModel as i32,
            draft_model: model.trim().to_string(),
            num_draft_tokens: tokens,
            draft_card: None,
        })),
        (None, None, None) => Err(ApiError::bad_request("no draft given")),
    }
}

/// How long `PUT /instance/{id}/draft` waits for rank 0 to take the draft
/// up (a draft model is downloaded and loaded first).
const DRAFT_WAIT: Duration = Duration::from_secs(120);

/// `PUT /instance/{id}/draft`: sets or clears the instance's speculative
/// decoding, then waits (up to [`DRAFT_WAIT`]) for its rank 0 to report
/// it. 200 with the instance and rank 0's report; 400 when rank 0 refused
/// it (a draft whose vocabulary is not the target's: the instance keeps
/// serving without, and `{"off": true}` clears it); 202 when rank 0 has
/// not reported yet (`GET /instance/{id}` shows it later).
pub(super) async fn set_draft(
    State(api): State<Api>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    use axum::response::IntoResponse;
    let body: DraftBody = parse(body)?;
    let request = v1::SetDraftRequest {
        instance_id: id.clone(),
        draft: draft_of(&body)?,
    };
    let reply: v1::SetDraftReply = admin_call(&api, AdminMethod::Draft, &request).await?;
    let started = Instant::now();
    loop {
        let state = api.state().await?;
        let Some(instance) = state.instances.get(&id) else {
            return Err(ApiError::not_found(
                "not_found",
                format!("instance {id:?} went away"),
            ));
        };
        let mut shown = instance.clone();
        super::live::redact(&mut shown);
        let answer = |runner: Value| {
            json!({
                "instance_id": id,
                "index": reply.index,
                "draft": to_json(&shown.draft),
                "runner": runner,
            })
        };
        // This node's state may not hold the update yet.
        let report = (state.last_index >= reply.index)
            .then(|| tessera_actors::worker::plan::rank0_draft(&state, instance))
            .flatten();
        match report {
            Some(Some(report)) if !report.error.is_empty() => {
                return Err(ApiError::invalid(
                    "model",
                    format!(
                        "rank 0 of {id} refused the draft: {}; the instance serves without it (PUT {{\"off\": true}} clears it)",
                        report.error
                    ),
                ));
            }
            Some(report) => {
                return Ok(Json(answer(to_json(&report))).into_response());
            }
            None if started.elapsed() >= DRAFT_WAIT => {
                let pending = answer(Value::Null);
                return Ok((axum::http::StatusCode::ACCEPTED, Json(pending)).into_response());
            }
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A protocol message as JSON (proto3's mapping); null if it cannot be.
fn to_json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

#[derive(Deserialize)]
pub(super) struct EventsQuery {
    #[serde(default)]
    from: Option<u64>,
}

/// The indexed events from `from` on, then each new one as it is applied.
pub(super) async fn events(State(api): State<Api>, Query(query): Query<EventsQuery>) -> Response {
    let (tx, response) = sse_channel();
    let mut next = query.from.unwrap_or(1).max(1);
    let mut stopping = api.stopping.clone();
    tokio::spawn(async move {
        loop {
            let events = call_t!(
                api.replica,
                |reply| ReplicaMsg::GetRange {
                    from: next,
                    to: u64::MAX,
                    reply
                },
                tessera_actors::ACTOR_CALL_MS
            )
            .unwrap_or_default();
            for mut event in events {
                next = event.index + 1;
                super::live::redact_event(&mut event);
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
                _ = stopped(&mut stopping) => return,
            }
        }
    });
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(text: &str) -> Result<Option<v1::InstanceDraft>, String> {
        let body: DraftBody = serde_json::from_str(text).map_err(|e| e.to_string())?;
        draft_of(&body).map_err(|e| e.message)
    }

    #[test]
    fn a_draft_body_names_one_draft() {
        use v1::DraftMethod as M;
        let method =
            |text| body(text).map(|d| d.map(|d| (d.method(), d.draft_model, d.num_draft_tokens)));
        assert_eq!(
            method(r#"{"model": "small", "tokens": 6}"#),
            Ok(Some((M::DraftModel, "small".to_string(), 6)))
        );
        assert_eq!(
            method(r#"{"model": " small "}"#),
            Ok(Some((M::DraftModel, "small".to_string(), 0))),
            "0: the master's default"
        );
        assert_eq!(
            method(r#"{"ngram": true, "tokens": 4}"#),
            Ok(Some((M::Ngram, String::new(), 4)))
        );
        assert_eq!(method(r#"{"off": true}"#), Ok(None));
        for (text, says) in [
            (r#"{}"#, "give one of"),
            (r#"{"model": "m", "ngram": true}"#, "give one of"),
            (r#"{"tokens": 4}"#, "give one of"),
            (r#"{"off": true, "tokens": 4}"#, "takes no tokens"),
            (r#"{"off": false}"#, "must be true"),
            (r#"{"ngram": false}"#, "must be true"),
            (r#"{"model": ""}"#, "names the draft model"),
            (r#"{"model": "m", "k": 4}"#, "unknown field"),
            (r#"{"ngram": true, "tokens": -1}"#, "invalid value"),
        ] {
            let why = body(text).expect_err(text);
            assert!(why.contains(says), "{text}: {why}");
        }
    }

    #[test]
    fn sharding_and_action_names() {
        assert_eq!(sharding_of(None), Ok(v1::Sharding::Pipeline));
        assert_eq!(sharding_of(Some("Tensor")), Ok(v1::Sharding::Tensor));
        let bad = sharding_of(Some("ring")).err();
        assert_eq!(bad.as_ref().map(|e| e.status.as_u16()), Some(400));
        assert_eq!(bad.and_then(|e| e.param), Some("sharding".to_string()));
        assert_eq!(action_of("cancel"), Ok(v1::DownloadAction::Cancel));
        let unknown = action_of("pause").err().map(|e| e.status.as_u16());
        assert_eq!(unknown, Some(404));
    }
}
