//! A generation from its first chunk to the client: started (and tried
//! again while its instance went away before it answered), then pumped
//! to the client until the end or until the client leaves.

use std::time::{Duration, Instant};

use tessera_protos::v1::{self, generation_chunk};

use super::context::{Api, QueueSlot};
use super::error::ApiError;
use tessera_actors::generation::{self, Generation};

use super::error::chunk_error;
use super::ready::{rank0_ready, Target};

/// A generation under way: the first chunk is in hand, so errors before
/// any answer are HTTP errors.
pub(super) struct Begun {
    pub(super) generation: Generation,
    pub(super) first: generation_chunk::Kind,
    pub(super) slot: QueueSlot,
}

/// How often a request whose instance went away before it answered is
/// tried again (on the instance placed in its stead).
const MAX_ATTEMPTS: u32 = 10;

impl Api {
    /// Starts a generation and waits for its first chunk. If the instance
    /// goes away before it answers (its node was lost, the master is being
    /// replaced), the request waits for a ready instance and tries again:
    /// the client sees a slower answer, not an error.
    pub(super) async fn begin(
        &self,
        target: &Target,
        mut params: v1::TextGenerationParams,
    ) -> Result<Begun, ApiError> {
        // The model as the catalogue names it, whatever name the request
        // used for it (`NAME:latest`, `NAME:QUANT`).
        params.model_id = target.model_id.clone();
        let slot = self.queues.take(&target.model_id)?;
        let started = Instant::now();
        for attempt in 1.. {
            let mut generation = Generation::start(
                &self.bus,
                &self.state,
                &self.node_id,
                &target.instance_id,
                params.clone(),
                self.options.chunk_timeout,
            )
            .await?;
            let first = next_chunk(&mut generation).await;
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

/// The generation's next chunk, its failure as an HTTP error.
pub(crate) async fn next_chunk(
    generation: &mut Generation,
) -> Option<Result<generation_chunk::Kind, ApiError>> {
    Some(generation.next().await?.map_err(ApiError::from))
}

/// Sends what each chunk of a generation becomes (`render` maps a chunk,
/// or an error, to the items to send) until the answer ends or the client
/// leaves; dropping the generation then cancels it. False if the client
/// left.
/// [`pump`] in OpenAI's stream shape: each chunk as `write` renders it,
/// errors as error events, then `[DONE]` when the generation finished.
pub(super) async fn pump_openai(
    tx: &crate::sse::EventSender,
    begun: Begun,
    mut write: impl FnMut(&generation_chunk::Kind) -> Vec<serde_json::Value>,
) {
    use crate::sse::data;
    let finished = pump(tx, begun, |chunk| match chunk {
        Ok(generation_chunk::Kind::Error(error)) => {
            vec![data(&crate::error::chunk_error(&error).body())]
        }
        Ok(kind) => write(&kind).iter().map(data).collect(),
        Err(error) => vec![data(&error.body())],
    })
    .await;
    if finished {
        let done = axum::response::sse::Event::default().data("[DONE]");
        let _ = tx.send(Ok(done)).await;
    }
}

pub(super) async fn pump<T>(
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
            next = next_chunk(&mut generation) => next,
            _ = tx.closed() => return false,
        };
    }
    true
}

impl Api {
    /// Starts `n` generations of `params` ([`crate::choices::nth`]) together; the first
    /// error is the request's (the others are dropped, which cancels them).
    pub(crate) async fn begin_n(
        &self,
        target: &Target,
        params: &v1::TextGenerationParams,
        n: usize,
    ) -> Result<Vec<Begun>, ApiError> {
        let starts = (0..n).map(|i| self.begin(target, crate::choices::nth(params, i)));
        futures_util::future::join_all(starts)
            .await
            .into_iter()
            .collect()
    }
}

/// Streams the answers of `begun` into one OpenAI-shaped stream, answer
/// `i`'s chunks as `writers[i]` renders them (each numbering its choice);
/// errors as error events. Returns each answer's finish once all ended,
/// or None if the client left.
pub(crate) async fn pump_all<W>(
    tx: &crate::sse::EventSender,
    begun: Vec<Begun>,
    writers: Vec<W>,
) -> Option<Vec<v1::FinishChunk>>
where
    W: FnMut(&generation_chunk::Kind) -> Vec<serde_json::Value>,
{
    let pumps = begun
        .into_iter()
        .zip(writers)
        .map(|(begun, mut write)| async move {
            let mut finish = None;
            let finished = pump(tx, begun, |chunk| match chunk {
                Ok(generation_chunk::Kind::Error(error)) => {
                    vec![crate::sse::data(&crate::error::chunk_error(&error).body())]
                }
                Ok(kind) => {
                    if let generation_chunk::Kind::Finish(f) = &kind {
                        finish = Some(*f);
                    }
                    write(&kind).iter().map(crate::sse::data).collect()
                }
                Err(error) => vec![crate::sse::data(&error.body())],
            })
            .await;
            finished.then(|| finish.unwrap_or_default())
        });
    futures_util::future::join_all(pumps)
        .await
        .into_iter()
        .collect()
}
