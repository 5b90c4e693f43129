//! `/v1/embeddings`, `/api/embed` and `/api/embeddings`: a request goes to
//! an embedding model's instance (placed first where allowed) and its
//! vectors come back whole.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde_json::Value;
use tessera_protos::v1::{self, generation_chunk};

use super::{
    ollama_embed_response, ollama_embeddings_response, openai_response, EmbeddingRequest,
    OllamaEmbedRequest, OllamaEmbeddingsRequest, Vectors,
};
use crate::answer::next_chunk;
use crate::body::parse;
use crate::context::Api;
use crate::error::{chunk_error, ApiError};
use crate::ollama::handlers::OllamaError;

pub(crate) async fn openai_embeddings(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: EmbeddingRequest = parse(body)?;
    let (params, encoding) = request.to_params()?;
    let vectors = embed(&api, &request.model, params).await?;
    Ok(Json(openai_response(&request.model, &vectors, encoding)))
}

pub(crate) async fn ollama_embed(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OllamaError> {
    let request: OllamaEmbedRequest = parse(body)?;
    let params = request.to_params()?;
    let vectors = embed(&api, &request.model, params).await?;
    Ok(Json(ollama_embed_response(&request.model, &vectors)))
}

pub(crate) async fn ollama_embeddings(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OllamaError> {
    let request: OllamaEmbeddingsRequest = parse(body)?;
    let params = request.to_params()?;
    let vectors = embed(&api, &request.model, params).await?;
    Ok(Json(ollama_embeddings_response(&vectors)))
}

/// The vectors of `params`' inputs from an instance of `model`, in input
/// order.
async fn embed(
    api: &Api,
    model: &str,
    params: v1::TextGenerationParams,
) -> Result<Vectors, ApiError> {
    let started = Instant::now();
    let inputs = params.embedding.as_ref().map_or(0, |e| e.inputs.len());
    let target = api.embedding_target(model).await?;
    api.ready(&target, api.options.auto_place).await?;
    let mut begun = api.begin(&target, params).await?;
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; inputs];
    let mut prompt_tokens = 0;
    let mut chunk = Some(Ok(begun.first));
    while let Some(next) = chunk {
        match next? {
            generation_chunk::Kind::Embedding(e) => {
                if let Some(slot) = vectors.get_mut(e.index as usize) {
                    *slot = Some(e.vector);
                }
            }
            generation_chunk::Kind::Finish(finish) => {
                prompt_tokens = finish.usage.map_or(0, |u| u.prompt_tokens);
            }
            generation_chunk::Kind::Error(error) => return Err(chunk_error(&error)),
            _ => {}
        }
        chunk = next_chunk(&mut begun.generation).await;
    }
    drop(begun.slot);
    let vectors = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            v.ok_or_else(|| ApiError::internal(format!("no vector came back for input {index}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    tracing::info!(
        request = %begun.generation.command_id,
        model = %target.model_id,
        inputs,
        prompt_tokens,
        "embeddings"
    );
    Ok(Vectors {
        vectors,
        prompt_tokens,
        nanoseconds: started.elapsed().as_nanos() as u64,
    })
}
