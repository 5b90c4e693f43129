//! `/v1/completions`: each prompt's `n` generations, whole (several
//! prompts run side by side, `n` choices each) or streamed (one prompt).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tessera_protos::v1::generation_chunk;

use super::{completion, Choice, CompletionChunks, CompletionRequest, OnePrompt};
use crate::answer::{next_chunk, pump_openai, Begun};
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
    let n = crate::choices::count(request.n)?;
    if stream {
        let Some(prompt) = prompts.into_iter().next() else {
            return Err(ApiError::invalid("prompt", "no prompt"));
        };
        return stream_one(api, target, prompt, (model, created, options, echo, n)).await;
    }
    let answers = futures_util::future::join_all(
        prompts
            .iter()
            .map(|prompt| answer_one(&api, &target, prompt, echo, n)),
    )
    .await;
    let mut choices = Vec::with_capacity(answers.len() * n);
    let mut id = None;
    for answer in answers {
        let (command_id, answers) = answer?;
        id.get_or_insert(command_id);
        choices.extend(answers);
    }
    let id = format!("cmpl-{}", id.unwrap_or_default());
    tracing::info!(request = %id, model = %model, choices = choices.len(), "completion");
    let logprobs = request.logprobs.is_some();
    Ok(Json(completion(&id, &model, created, &choices, (n, logprobs))).into_response())
}

/// One prompt's `n` whole answers, and the first one's command id.
async fn answer_one(
    api: &Api,
    target: &Target,
    prompt: &OnePrompt,
    echo: bool,
    n: usize,
) -> Result<(String, Vec<Choice>), ApiError> {
    let begun = api.begin_n(target, &prompt.params, n).await?;
    let command_id = begun[0].generation.command_id.clone();
    let answers = begun
        .into_iter()
        .map(|begun| whole_choice(begun, prompt, echo));
    let choices = futures_util::future::join_all(answers)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok((command_id, choices))
}

/// One generation's whole answer, after the prompt when echoed.
async fn whole_choice(begun: Begun, prompt: &OnePrompt, echo: bool) -> Result<Choice, ApiError> {
    let Begun {
        mut generation,
        first,
        slot,
    } = begun;
    let mut choice = match (&prompt.text, echo) {
        (Some(text), true) => Choice::echoing(text),
        _ => Choice::default(),
    };
    let mut chunk = Some(Ok(first));
    while let Some(next) = chunk {
        match next? {
            generation_chunk::Kind::Error(error) => return Err(chunk_error(&error)),
            kind => choice.push(&kind),
        }
        chunk = next_chunk(&mut generation).await;
    }
    drop(slot);
    Ok(choice)
}

/// One prompt's answers, streamed as `text_completion` chunks (numbered
/// choices when several), then `[DONE]`.
async fn stream_one(
    api: Api,
    target: Target,
    prompt: OnePrompt,
    (model, created, options, echo, n): (String, u64, super::StreamOptions, bool, usize),
) -> Result<Response, ApiError> {
    let mut begun = api.begin_n(&target, &prompt.params, n).await?;
    let id = format!("cmpl-{}", begun[0].generation.command_id);
    tracing::info!(request = %id, model = %model, n, stream = true, "completion");
    let (tx, response) = sse_channel();
    tokio::spawn(async move {
        let echoed = prompt.text.as_deref().filter(|_| echo);
        if begun.len() == 1 {
            let Some(one) = begun.pop() else {
                return;
            };
            let mut writer = CompletionChunks::new(id, model, created, options);
            if let Some(text) = echoed {
                if tx.send(data(&writer.echo(text))).await.is_err() {
                    return;
                }
            }
            pump_openai(&tx, one, |chunk| writer.write(chunk)).await;
            return;
        }
        let mut writers: Vec<CompletionChunks> = (0..begun.len())
            .map(|i| {
                CompletionChunks::new(id.clone(), model.clone(), created, options).of_choice(i)
            })
            .collect();
        for w in writers.iter_mut() {
            if let Some(text) = echoed {
                if tx.send(data(&w.echo(text))).await.is_err() {
                    return;
                }
            }
        }
        let last = CompletionChunks::new(id, model, created, options);
        let renders = writers
            .iter_mut()
            .map(|w| move |chunk: &generation_chunk::Kind| w.write(chunk))
            .collect();
        let Some(finishes) = crate::answer::pump_all(&tx, begun, renders).await else {
            return;
        };
        if let Some(usage) = last.usage(&finishes) {
            if tx.send(data(&usage)).await.is_err() {
                return;
            }
        }
        let _ = tx
            .send(Ok(axum::response::sse::Event::default().data("[DONE]")))
            .await;
    });
    Ok(response)
}
