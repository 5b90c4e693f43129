//! The Anthropic endpoint `/v1/messages`, with errors in Anthropic's shape.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_protos::v1::generation_chunk;

use crate::answer::{next_chunk, pump, Begun};
use crate::anthropic;
use crate::body::parse;
use crate::context::Api;
use crate::error::chunk_error;
use crate::error::{ApiError, ErrorShape, Shaped};
use crate::sse::{named, sse_channel};

/// Anthropic's error shape.
pub(crate) struct Anthropic;

impl ErrorShape for Anthropic {
    fn body(error: &ApiError) -> serde_json::Value {
        anthropic::error_body(error)
    }
}

type AnthropicError = Shaped<Anthropic>;

pub(crate) async fn messages(
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
        while let Some(next) = next_chunk(&mut generation).await {
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

/// `/v1/messages/count_tokens`: the request's prompt (system, messages,
/// tools) counted by its model's tokenizer on the instance, nothing
/// generated.
pub(crate) async fn count_tokens(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, AnthropicError> {
    let mut body: serde_json::Value = parse(body)?;
    // A count needs no token limit; the request type wants one.
    if let Some(object) = body.as_object_mut() {
        object.entry("max_tokens").or_insert(serde_json::json!(1));
    }
    let request: anthropic::MessagesRequest = serde_json::from_value(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let (target, mut params) = api
        .prepare(&request.model, |context| request.to_params(context))
        .await?;
    params.count_only = true;
    let Begun {
        mut generation,
        first,
        slot,
    } = api.begin(&target, params).await?;
    let mut chunk = Some(Ok(first));
    let mut input_tokens = None;
    while let Some(next) = chunk {
        match next? {
            generation_chunk::Kind::Error(error) => return Err(chunk_error(&error).into()),
            generation_chunk::Kind::Finish(finish) => {
                input_tokens = finish.usage.map(|u| u.prompt_tokens);
            }
            _ => {}
        }
        chunk = next_chunk(&mut generation).await;
    }
    drop(slot);
    let input_tokens =
        input_tokens.ok_or_else(|| ApiError::bad_request("the count did not finish"))?;
    Ok(Json(serde_json::json!({"input_tokens": input_tokens})))
}
