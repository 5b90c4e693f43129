//! The OpenAI endpoints: `/v1/chat/completions` (whole, or streamed with
//! progress comments while the model is placed) and `/v1/models`.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::{Answer, ChatRequest, ChunkWriter};
use crate::answer::{next_chunk, pump_openai, Begun};
use crate::body::parse;
use crate::context::{now_unix, Api};
use crate::error::chunk_error;
use crate::error::ApiError;
use crate::ready::{rank0_ready, Target};
use crate::sse::{data, sse_channel, EventSender};

pub(crate) async fn chat_completions(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body)?;
    let target = api.target(&request.model).await?;
    let params = request.to_params(target.context)?;
    let (stream, stream_options) = request.streaming();
    let created = now_unix();
    let model = request.model.clone();
    let n = crate::choices::count(request.n)?;
    if !stream {
        api.ready(&target, api.options.auto_place).await?;
        let begun = api.begin_n(&target, &params, n).await?;
        let id = format!("chatcmpl-{}", begun[0].generation.command_id);
        tracing::info!(request = %id, model = %model, n, "chat completion");
        let answers = futures_util::future::join_all(begun.into_iter().map(whole_answer)).await;
        let answers = answers.into_iter().collect::<Result<Vec<_>, _>>()?;
        let logprobs = request.logprobs.unwrap_or(false);
        let body = super::completion_of(&answers, &id, &model, created, logprobs);
        return Ok(Json(body).into_response());
    }
    // A model that must be placed or loaded first: the stream starts at
    // once and tells how the wait goes in SSE comments; otherwise an error
    // before the answer is still an HTTP error.
    let begun = if api.is_ready(&target).await? {
        Some(api.begin_n(&target, &params, n).await?)
    } else {
        None
    };
    let (tx, response) = sse_channel();
    tokio::spawn(async move {
        let begun = match begun {
            Some(begun) => begun,
            None => match wait_with_progress(&api, &target, &tx).await {
                Some(Ok(())) => match api.begin_n(&target, &params, n).await {
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
        let id = format!("chatcmpl-{}", begun[0].generation.command_id);
        tracing::info!(request = %id, model = %model, n, stream, "chat completion");
        let writer = ChunkWriter::new(id, model, created, stream_options);
        stream_answers(&tx, begun, writer).await;
    });
    Ok(response)
}

/// One generation's whole answer.
async fn whole_answer(begun: Begun) -> Result<Answer, ApiError> {
    let Begun {
        mut generation,
        first,
        slot,
    } = begun;
    let mut answer = Answer::default();
    let mut chunk = Some(Ok(first));
    while let Some(next) = chunk {
        match next? {
            generation_chunk::Kind::Error(error) => return Err(chunk_error(&error)),
            kind => answer.push(&kind),
        }
        chunk = next_chunk(&mut generation).await;
    }
    drop(slot);
    Ok(answer)
}

/// The answers streamed as `chat.completion.chunk`s: one answer as before;
/// several as numbered choices, their usage in one chunk after all.
async fn stream_answers(tx: &EventSender, mut begun: Vec<Begun>, writer: ChunkWriter) {
    if begun.len() == 1 {
        let Some(one) = begun.pop() else {
            return;
        };
        let mut writer = writer;
        if tx.send(data(&writer.start())).await.is_err() {
            return;
        }
        pump_openai(tx, one, |chunk| writer.write(chunk)).await;
        return;
    }
    let mut writers: Vec<ChunkWriter> = (0..begun.len())
        .map(|i| {
            ChunkWriter::new(
                writer.id.clone(),
                writer.model.clone(),
                writer.created,
                writer.options,
            )
            .of_choice(i)
        })
        .collect();
    for w in &writers {
        if tx.send(data(&w.start())).await.is_err() {
            return;
        }
    }
    let renders = writers
        .iter_mut()
        .map(|w| move |chunk: &generation_chunk::Kind| w.write(chunk))
        .collect();
    let Some(finishes) = crate::answer::pump_all(tx, begun, renders).await else {
        return;
    };
    if let Some(usage) = writer.usage(&finishes) {
        if tx.send(data(&usage)).await.is_err() {
            return;
        }
    }
    let _ = tx
        .send(Ok(axum::response::sse::Event::default().data("[DONE]")))
        .await;
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

pub(crate) async fn models(State(api): State<Api>) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    let data: Vec<Value> = known_cards(&state)
        .iter()
        .map(|card| model_json(&state, card))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `/v1/models/{id}`: one model, by any name [`resolve`] takes.
///
/// [`resolve`]: tessera_actors::catalogue::resolve
pub(crate) async fn model(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let state = api.state().await?;
    match tessera_actors::catalogue::resolve(&known_cards(&state), &id) {
        Ok(Some(card)) => Ok(Json(model_json(&state, &card))),
        Ok(None) => Err(ApiError::not_found(
            "model_not_found",
            format!("the model {id:?} does not exist"),
        )),
        Err(several) => Err(ApiError::invalid(
            "model",
            format!(
                "{id:?} could mean several models; name one of {}",
                several.join(", ")
            ),
        )),
    }
}

/// Every card the cluster knows, and those of placed instances it does
/// not (an instance keeps the card it was placed with).
pub(crate) fn known_cards(state: &v1::ClusterState) -> Vec<v1::ModelCard> {
    let mut cards: Vec<v1::ModelCard> = tessera_actors::catalogue::all(state);
    for instance in state.instances.values() {
        if let Some(card) = &instance.model {
            if !cards.iter().any(|c| c.model_id == card.model_id) {
                cards.push(card.clone());
            }
        }
    }
    cards
}

/// A model as OpenAI lists it, with tessera's placement facts.
fn model_json(state: &v1::ClusterState, card: &v1::ModelCard) -> Value {
    let instances: Vec<&v1::Instance> = state
        .instances
        .values()
        .filter(|i| {
            i.model
                .as_ref()
                .is_some_and(|m| m.model_id == card.model_id)
        })
        .collect();
    let ready = instances.iter().any(|i| rank0_ready(state, i));
    json!({
        "id": card.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "tessera",
        "context_length": card.context_length,
        "instances": instances.len(),
        "ready": ready,
        "downloaded_on": tessera_actors::cluster::placement::downloaded_on(state, &card.model_id),
        "partly_downloaded_on": tessera_actors::cluster::placement::partly_on(state, &card.model_id),
    })
}
