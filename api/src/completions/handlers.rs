//! `/v1/completions`: each prompt's generation, whole (several prompts run
//! side by side, one choice each) or streamed (one prompt).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_protos::v1::generation_chunk;

use super::{completion, Choice, CompletionChunks, CompletionRequest, OnePrompt};
use crate::answer::{next_chunk, pump_openai};
use crate::body::parse;
use crate::context::{now_unix, Api};
use crate::error::{chunk_error, ApiError};
use crate::ready::Target;
use crate::sse::{data, sse_channel};

pub(crate) async fn completions(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(body)?;
    let target = api.target(&request.model).await?;
    let prompts = request.to_prompts(target.context)?;
    api.ready(&target, api.options.auto_place).await?;
    let (stream, options) = request.streaming();
    let created = now_unix();
    let model = request.model.clone();
    let echo = request.echo();
    if stream {
        let Some(prompt) = prompts.into_iter().next() else {
            return Err(ApiError::invalid("prompt", "no prompt"));
        };
        return stream_one(api, target, prompt, (model, created, options, echo)).await;
    }
    let answers = futures_util::future::join_all(
        prompts
            .into_iter()
            .map(|prompt| answer_one(&api, &target, prompt, echo)),
    )
    .await;
    let mut choices = Vec::with_capacity(answers.len());
    let mut id = None;
    for answer in answers {
        let (command_id, choice) = answer?;
        id.get_or_insert(command_id);
        choices.push(choice);
    }
    let id = format!("cmpl-{}", id.unwrap_or_default());
    tracing::info!(request = %id, model = %model, prompts = choices.len(), "completion");
    let logprobs = request.logprobs.is_some();
    Ok(Json(completion(&id, &model, created, &choices, logprobs)).into_response())
}

/// One prompt's whole answer, and its command id.
async fn answer_one(
    api: &Api,
    target: &Target,
    prompt: OnePrompt,
    echo: bool,
) -> Result<(String, Choice), ApiError> {
    let mut begun = api.begin(target, prompt.params).await?;
    let mut choice = match (&prompt.text, echo) {
        (Some(text), true) => Choice::echoing(text),
        _ => Choice::default(),
    };
    let mut chunk = Some(Ok(begun.first));
    while let Some(next) = chunk {
        match next? {
            generation_chunk::Kind::Error(error) => return Err(chunk_error(&error)),
            kind => choice.push(&kind),
        }
        chunk = next_chunk(&mut begun.generation).await;
    }
    drop(begun.slot);
    Ok((begun.generation.command_id.clone(), choice))
}

/// One prompt, streamed as `text_completion` chunks, then `[DONE]`.
async fn stream_one(
    api: Api,
    target: Target,
    prompt: OnePrompt,
    (model, created, options, echo): (String, u64, super::StreamOptions, bool),
) -> Result<Response, ApiError> {
    let begun = api.begin(&target, prompt.params).await?;
    let id = format!("cmpl-{}", begun.generation.command_id);
    tracing::info!(request = %id, model = %model, stream = true, "completion");
    let (tx, response) = sse_channel();
    tokio::spawn(async move {
        let mut writer = CompletionChunks::new(id, model, created, options);
        if let (Some(text), true) = (&prompt.text, echo) {
            if tx.send(data(&writer.echo(text))).await.is_err() {
                return;
            }
        }
        pump_openai(&tx, begun, |chunk| writer.write(chunk)).await;
    });
    Ok(response)
}
