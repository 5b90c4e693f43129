//! The Ollama endpoints: `/api/version`, `/api/tags`, `/api/chat` and
//! `/api/generate` (one object, or a stream of JSON lines).

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use crate::answer::{next_chunk, pump, Begun};
use crate::body::parse;
use crate::context::{now_unix, Api};
use crate::error::chunk_error;
use crate::error::{ApiError, ErrorShape, Shaped};
use crate::ollama;
use crate::ready::Target;

/// Ollama's error shape.
pub(crate) struct Ollama;

impl ErrorShape for Ollama {
    fn body(error: &ApiError) -> Value {
        ollama::error_body(error)
    }
}

pub(crate) type OllamaError = Shaped<Ollama>;

pub(crate) async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

pub(crate) async fn tags(State(api): State<Api>) -> Result<Json<Value>, OllamaError> {
    let state = api.state().await?;
    let mut cards = tessera_actors::catalogue::all(&state);
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
            chunk = next_chunk(&mut generation).await;
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

pub(crate) async fn chat(
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

pub(crate) async fn generate(
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

#[derive(serde::Deserialize)]
pub(crate) struct ShowRequest {
    #[serde(default)]
    model: Option<String>,
    /// The older name of `model`.
    #[serde(default)]
    name: Option<String>,
    /// Ollama's verbose adds the tokenizer's arrays: nothing to add here.
    #[serde(default, rename = "verbose")]
    _verbose: Option<bool>,
}

/// `/api/show`: a model's card as Ollama describes one.
pub(crate) async fn show(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OllamaError> {
    let request: ShowRequest = parse(body)?;
    let Some(name) = request.model.or(request.name).filter(|n| !n.is_empty()) else {
        return Err(ApiError::invalid("model", "model must not be empty").into());
    };
    let state = api.state().await?;
    let cards = crate::openai::handlers::known_cards(&state);
    match tessera_actors::catalogue::resolve(&cards, &name) {
        Ok(Some(mut card)) => {
            if card.chat_template.is_empty() {
                card.chat_template = local_template(&state, &api.node_id, &card.model_id).await;
            }
            Ok(Json(ollama::show_json(&card)))
        }
        Ok(None) => {
            Err(ApiError::not_found("model_not_found", format!("model {name:?} not found")).into())
        }
        Err(several) => Err(ApiError::invalid(
            "model",
            format!(
                "{name:?} could mean several models; name one of {}",
                several.join(", ")
            ),
        )
        .into()),
    }
}

/// The chat template of `model`'s files on this node, where they are here
/// (a card from the catalogue does not carry it): a GGUF's
/// `tokenizer.chat_template`, a folder's `chat_template.jinja` or
/// `tokenizer_config.json`'s. Empty when neither says.
async fn local_template(state: &v1::ClusterState, node_id: &str, model: &str) -> String {
    use v1::download_progress::State as Ds;
    let path = state
        .downloads
        .get(node_id)
        .and_then(|d| d.models.get(model))
        .and_then(|p| match &p.state {
            Some(Ds::Completed(done)) => Some(std::path::PathBuf::from(&done.path)),
            _ => None,
        });
    let Some(path) = path else {
        return String::new();
    };
    tokio::task::spawn_blocking(move || template_in(&path).unwrap_or_default())
        .await
        .unwrap_or_default()
}

fn template_in(path: &std::path::Path) -> Option<String> {
    if path.is_file() {
        let file = tessera_engine::formats::gguf::GgufFile::open(path).ok()?;
        return file
            .get_str("tokenizer.chat_template")
            .ok()
            .map(str::to_string);
    }
    if let Ok(text) = std::fs::read_to_string(path.join("chat_template.jinja")) {
        return Some(text);
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(path.join("tokenizer_config.json")).ok()?)
            .ok()?;
    match &config["chat_template"] {
        Value::String(text) => Some(text.clone()),
        // A list of named templates: the default one.
        Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// `/api/ps`: the models with a ready instance.
pub(crate) async fn ps(State(api): State<Api>) -> Result<Json<Value>, OllamaError> {
    let state = api.state().await?;
    let mut running: Vec<v1::ModelCard> = Vec::new();
    for instance in state.instances.values() {
        let Some(card) = &instance.model else {
            continue;
        };
        if crate::ready::rank0_ready(&state, instance)
            && !running.iter().any(|c| c.model_id == card.model_id)
        {
            running.push(card.clone());
        }
    }
    let models: Vec<Value> = running.iter().map(ollama::running_json).collect();
    Ok(Json(json!({"models": models})))
}
