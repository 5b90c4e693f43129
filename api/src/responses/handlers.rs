//! The OpenAI Responses endpoint `/v1/responses`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_protos::v1::generation_chunk;

use crate::answer::{next_chunk, pump, Begun};
use crate::body::parse;
use crate::context::{now_unix, Api};
use crate::error::chunk_error;
use crate::error::ApiError;
use crate::responses;
use crate::sse::{named, sse_channel};

pub(crate) async fn responses(
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
            chunk = next_chunk(&mut generation).await;
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
