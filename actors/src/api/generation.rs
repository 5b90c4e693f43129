//! One generation as the API node sees it: subscribe to
//! `chunks/{command_id}`, send the TextGeneration command, then read chunks
//! until the finish or an error. Dropping an unfinished generation cancels
//! it (a client that disconnects stops the work on every rank).

use std::time::Duration;

use tessera_protos::v1::{self, command, generation_chunk, Command};
use zenoh::handlers::FifoChannelHandler;
use zenoh::pubsub::Subscriber;
use zenoh::sample::Sample;

use super::error::ApiError;
use crate::bus::Bus;

pub struct Generation {
    bus: Bus,
    node_id: String,
    pub command_id: String,
    chunks: Subscriber<FifoChannelHandler<Sample>>,
    /// How long to wait for the next chunk.
    timeout: Duration,
    done: bool,
}

impl Generation {
    /// Starts generating `params` on `instance_id` (empty: any ready
    /// instance of the model).
    pub async fn start(
        bus: &Bus,
        node_id: &str,
        instance_id: &str,
        params: v1::TextGenerationParams,
        timeout: Duration,
    ) -> Result<Self, ApiError> {
        let command_id = uuid::Uuid::now_v7().to_string();
        let key = bus
            .keys
            .chunks(&command_id)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let chunks = bus
            .session
            .declare_subscriber(key)
            .await
            .map_err(|e| ApiError::internal(format!("subscribing to chunks: {e}")))?;
        let command = Command {
            command_id: command_id.clone(),
            origin_node_id: node_id.to_string(),
            kind: Some(command::Kind::TextGeneration(v1::TextGeneration {
                instance_id: instance_id.to_string(),
                params: Some(params),
            })),
        };
        tracing::debug!(command_id, "generation command sent");
        bus.put(&bus.keys.commands(), &command)
            .await
            .map_err(|e| ApiError::unavailable(format!("sending the request: {e}")))?;
        Ok(Self {
            bus: bus.clone(),
            node_id: node_id.to_string(),
            command_id,
            chunks,
            timeout,
            done: false,
        })
    }

    /// The next chunk; after a finish or an error chunk, `None`.
    pub async fn next(&mut self) -> Option<Result<generation_chunk::Kind, ApiError>> {
        if self.done {
            return None;
        }
        loop {
            let sample = match tokio::time::timeout(self.timeout, self.chunks.recv_async()).await {
                Err(_) => {
                    self.done = true;
                    return Some(Err(ApiError::unavailable(format!(
                        "no answer from the instance within {:?}",
                        self.timeout
                    ))));
                }
                Ok(Err(error)) => {
                    self.done = true;
                    return Some(Err(ApiError::internal(format!(
                        "chunk stream closed: {error}"
                    ))));
                }
                Ok(Ok(sample)) => sample,
            };
            let key = sample.key_expr().as_str().to_string();
            let Some(chunk) = self
                .bus
                .decode::<v1::GenerationChunk>(&key, &sample.payload().to_bytes())
            else {
                continue;
            };
            let Some(kind) = chunk.kind else {
                continue;
            };
            if matches!(
                kind,
                generation_chunk::Kind::Finish(_) | generation_chunk::Kind::Error(_)
            ) {
                self.done = true;
            }
            return Some(Ok(kind));
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The client went away mid-generation: cancel it.
        let bus = self.bus.clone();
        let command = Command {
            command_id: uuid::Uuid::now_v7().to_string(),
            origin_node_id: self.node_id.clone(),
            kind: Some(command::Kind::CancelTask(v1::CancelTask {
                task_id: String::new(),
                command_id: self.command_id.clone(),
            })),
        };
        tracing::info!(command_id = self.command_id, "client gone; cancelling");
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = bus.put(&bus.keys.commands(), &command).await;
            });
        }
    }
}

/// An error chunk as an HTTP error (before any answer was sent).
pub fn chunk_error(error: &v1::ErrorChunk) -> ApiError {
    match error.kind.as_str() {
        "not_found" => ApiError::not_found("model_not_found", error.message.clone()),
        "invalid_request" => ApiError::bad_request(error.message.clone()),
        "cancelled" => ApiError::unavailable(error.message.clone()),
        _ => ApiError::internal(format!("{} ({})", error.message, error.kind)),
    }
}
