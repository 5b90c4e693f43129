//! Embeddings in two dialects, as pure mappers: OpenAI's `/v1/embeddings`
//! and Ollama's `/api/embed` and legacy `/api/embeddings`. A request
//! becomes the wire's `EmbeddingParams` (riding in a generation's
//! parameters to an embedding model's instance), and the vectors that
//! come back become each dialect's answer.
//!
//! Long inputs follow each dialect's documented rule: OpenAI refuses an
//! input beyond the model's limit; Ollama cuts it there unless `truncate`
//! is false.

pub(crate) mod handlers;

use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tessera_protos::v1::{self, embedding_input::Kind};

use crate::error::ApiError;
use crate::extras::{nothing, Extras, Refused};

/// OpenAI's `POST /v1/embeddings` body.
#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: String,
    /// A string, a list of strings, a list of token ids, or a list of
    /// such lists.
    pub input: Value,
    /// "float" (the default) or "base64".
    #[serde(default)]
    pub encoding_format: Option<String>,
    #[serde(default)]
    pub dimensions: Option<u32>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

const OPENAI_EXTRAS: Extras = Extras {
    not_applicable: &["user"],
    refused: &[],
};

/// How OpenAI vectors are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Float,
    /// Little-endian f32 bytes, in base64.
    Base64,
}

/// The vectors of a request, in input order, and the tokens they took.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Vectors {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: u32,
    /// From the first chunk to the last, in nanoseconds (Ollama's
    /// `total_duration`).
    pub nanoseconds: u64,
}

impl EmbeddingRequest {
    /// The wire's parameters and how to write the vectors.
    pub fn to_params(&self) -> Result<(v1::TextGenerationParams, Encoding), ApiError> {
        OPENAI_EXTRAS.check(&self.other)?;
        let encoding = match self.encoding_format.as_deref() {
            None | Some("float") => Encoding::Float,
            Some("base64") => Encoding::Base64,
            Some(other) => {
                return Err(ApiError::invalid(
                    "encoding_format",
                    format!("encoding_format {other:?}: \"float\" or \"base64\""),
                ))
            }
        };
        let dimensions = match self.dimensions {
            Some(0) => {
                return Err(ApiError::invalid(
                    "dimensions",
                    "dimensions must be at least 1",
                ))
            }
            Some(n) => n,
            None => 0,
        };
        let inputs = openai_inputs(&self.input)?;
        Ok((params(&self.model, inputs, dimensions, true)?, encoding))
    }
}

/// The wire's parameters, checked as the runner checks them.
fn params(
    model: &str,
    inputs: Vec<v1::EmbeddingInput>,
    dimensions: u32,
    refuse_long: bool,
) -> Result<v1::TextGenerationParams, ApiError> {
    let embedding = v1::EmbeddingParams {
        inputs,
        dimensions,
        refuse_long,
    };
    tessera_actors::runner::request::embed_request_from(&embedding)
        .map_err(|e| ApiError::invalid("input", e.to_string()))?;
    Ok(v1::TextGenerationParams {
        model_id: model.to_string(),
        embedding: Some(embedding),
        ..Default::default()
    })
}

fn text(text: &str) -> v1::EmbeddingInput {
    v1::EmbeddingInput {
        kind: Some(Kind::Text(text.to_string())),
    }
}

/// Token ids from a JSON array of numbers, or why not.
fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

fn tokens(ids: Vec<u32>) -> v1::EmbeddingInput {
    v1::EmbeddingInput {
        kind: Some(Kind::Tokens(v1::TokenIds { ids })),
    }
}

/// OpenAI's `input`: a string, strings, token ids, or lists of token ids.
fn openai_inputs(input: &Value) -> Result<Vec<v1::EmbeddingInput>, ApiError> {
    let shape = || {
        ApiError::invalid(
            "input",
            "input must be a string, a list of strings, a list of token ids, or a list of \
             lists of token ids",
        )
    };
    match input {
        Value::String(s) => Ok(vec![text(s)]),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::invalid("input", "input is an empty list"))
        }
        Value::Array(items) => match &items[..] {
            [Value::String(_), ..] => items
                .iter()
                .map(|v| v.as_str().map(text).ok_or_else(shape))
                .collect(),
            [Value::Number(_), ..] => Ok(vec![tokens(token_ids(items).ok_or_else(shape)?)]),
            [Value::Array(_), ..] => items
                .iter()
                .map(|v| {
                    v.as_array()
                        .and_then(|ids| token_ids(ids))
                        .map(tokens)
                        .ok_or_else(shape)
                })
                .collect(),
            _ => Err(shape()),
        },
        _ => Err(shape()),
    }
}

/// OpenAI's answer: a list of `embedding` objects and the usage.
pub fn openai_response(model: &str, vectors: &Vectors, encoding: Encoding) -> Value {
    let data: Vec<Value> = vectors
        .vectors
        .iter()
        .enumerate()
        .map(|(index, vector)| {
            let embedding = match encoding {
                Encoding::Float => json!(vector),
                Encoding::Base64 => json!(base64_of(vector)),
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {
            "prompt_tokens": vectors.prompt_tokens,
            "total_tokens": vectors.prompt_tokens,
        },
    })
}

/// A vector as OpenAI's base64: little-endian f32 bytes.
fn base64_of(vector: &[f32]) -> String {
    let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Ollama's `options` on an embedding request: none applies (the
/// sampling options have nothing to sample), so each one set is refused
/// by name; nulls pass, as clients send every option they know.
fn check_ollama_options(options: Option<&Map<String, Value>>) -> Result<(), ApiError> {
    for (name, value) in options.into_iter().flatten() {
        if !value.is_null() {
            return Err(ApiError::invalid(
                &format!("options.{name}"),
                format!("options.{name} does not apply to embeddings"),
            ));
        }
    }
    Ok(())
}

const OLLAMA_EXTRAS: Extras = Extras {
    not_applicable: &["keep_alive"],
    refused: &[],
};

/// Ollama's `POST /api/embed` body.
#[derive(Debug, Deserialize)]
pub struct OllamaEmbedRequest {
    pub model: String,
    /// A string or a list of strings.
    pub input: Value,
    /// false: an input beyond the model's limit is an error (default: cut).
    #[serde(default)]
    pub truncate: Option<bool>,
    #[serde(default)]
    pub dimensions: Option<u32>,
    #[serde(default)]
    pub options: Option<Map<String, Value>>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl OllamaEmbedRequest {
    pub fn to_params(&self) -> Result<v1::TextGenerationParams, ApiError> {
        OLLAMA_EXTRAS.check(&self.other)?;
        check_ollama_options(self.options.as_ref())?;
        let inputs = match &self.input {
            Value::String(s) => vec![text(s)],
            Value::Array(items) if !items.is_empty() => items
                .iter()
                .map(|v| v.as_str().map(text))
                .collect::<Option<_>>()
                .ok_or_else(|| ApiError::invalid("input", "input must be strings"))?,
            _ => {
                return Err(ApiError::invalid(
                    "input",
                    "input must be a string or a non-empty list of strings",
                ))
            }
        };
        let refuse_long = self.truncate == Some(false);
        params(
            &self.model,
            inputs,
            self.dimensions.unwrap_or(0),
            refuse_long,
        )
    }
}

/// `/api/embed`'s answer.
pub fn ollama_embed_response(model: &str, vectors: &Vectors) -> Value {
    json!({
        "model": model,
        "embeddings": vectors.vectors,
        "total_duration": vectors.nanoseconds,
        "load_duration": 0,
        "prompt_eval_count": vectors.prompt_tokens,
    })
}

/// Ollama's legacy `POST /api/embeddings` body: one prompt.
#[derive(Debug, Deserialize)]
pub struct OllamaEmbeddingsRequest {
    pub model: String,
    pub prompt: String,
    #[serde(default)]
    pub options: Option<Map<String, Value>>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

const OLLAMA_LEGACY_EXTRAS: Extras = Extras {
    not_applicable: &["keep_alive"],
    refused: &[Refused {
        name: "images",
        why: "embeddings are of text only",
        neutral: nothing,
    }],
};

impl OllamaEmbeddingsRequest {
    pub fn to_params(&self) -> Result<v1::TextGenerationParams, ApiError> {
        OLLAMA_LEGACY_EXTRAS.check(&self.other)?;
        check_ollama_options(self.options.as_ref())?;
        params(&self.model, vec![text(&self.prompt)], 0, false)
    }
}

/// `/api/embeddings`' answer: the one vector.
pub fn ollama_embeddings_response(vectors: &Vectors) -> Value {
    let vector = vectors.vectors.first().cloned().unwrap_or_default();
    json!({ "embedding": vector })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn openai(body: Value) -> Result<(v1::TextGenerationParams, Encoding), ApiError> {
        let request: EmbeddingRequest = serde_json::from_value(body).expect("a request");
        request.to_params()
    }

    fn inputs(params: &v1::TextGenerationParams) -> Vec<Kind> {
        let embedding = params.embedding.as_ref().expect("an embedding");
        embedding
            .inputs
            .iter()
            .map(|i| i.kind.clone().expect("a kind"))
            .collect()
    }

    #[test]
    fn every_openai_input_shape_maps_in_order() {
        let (p, encoding) = openai(json!({"model": "m", "input": "hi"})).expect("ok");
        assert_eq!(inputs(&p), vec![Kind::Text("hi".into())]);
        assert_eq!(encoding, Encoding::Float);
        assert!(p.embedding.as_ref().is_some_and(|e| e.refuse_long));
        let (p, _) = openai(json!({"model": "m", "input": ["a", ""]})).expect("ok");
        assert_eq!(
            inputs(&p),
            vec![Kind::Text("a".into()), Kind::Text(String::new())]
        );
        let (p, _) = openai(json!({"model": "m", "input": [1, 2, 3]})).expect("ok");
        assert_eq!(
            inputs(&p),
            vec![Kind::Tokens(v1::TokenIds { ids: vec![1, 2, 3] })]
        );
        let (p, encoding) = openai(
            json!({"model": "m", "input": [[1], [2, 3]], "encoding_format": "base64",
                   "dimensions": 8, "user": "u"}),
        )
        .expect("ok");
        assert_eq!(inputs(&p).len(), 2);
        assert_eq!(encoding, Encoding::Base64);
        assert_eq!(p.embedding.as_ref().map(|e| e.dimensions), Some(8));
    }

    #[test]
    fn bad_openai_requests_name_the_field() {
        for (body, field) in [
            (json!({"model": "m", "input": []}), "input"),
            (json!({"model": "m", "input": ["a", 1]}), "input"),
            (json!({"model": "m", "input": [1, -2]}), "input"),
            (json!({"model": "m", "input": {"a": 1}}), "input"),
            (json!({"model": "m", "input": [[]]}), "input"),
            (
                json!({"model": "m", "input": "a", "encoding_format": "int8"}),
                "encoding_format",
            ),
            (
                json!({"model": "m", "input": "a", "dimensions": 0}),
                "dimensions",
            ),
            (json!({"model": "m", "input": "a", "bogus": 1}), "bogus"),
        ] {
            let error = openai(body.clone()).expect_err("refused");
            assert_eq!(error.param.as_deref(), Some(field), "{body}: {error:?}");
        }
    }

    #[test]
    fn base64_is_little_endian_f32() {
        let vectors = Vectors {
            vectors: vec![vec![1.0, -2.5]],
            prompt_tokens: 3,
            nanoseconds: 0,
        };
        let answer = openai_response("m", &vectors, Encoding::Base64);
        let text = answer["data"][0]["embedding"].as_str().expect("a string");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("base64");
        let back: Vec<f32> = bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(back, vec![1.0, -2.5]);
        assert_eq!(answer["usage"]["prompt_tokens"], 3);
        let float = openai_response("m", &vectors, Encoding::Float);
        assert_eq!(float["data"][0]["embedding"], json!([1.0, -2.5]));
        assert_eq!(float["data"][0]["index"], 0);
    }

    #[test]
    fn ollama_cuts_unless_told_not_to_and_refuses_options_set() {
        let embed = |body: Value| {
            serde_json::from_value::<OllamaEmbedRequest>(body)
                .expect("a request")
                .to_params()
        };
        let p = embed(json!({"model": "m", "input": ["a", "b"], "keep_alive": "5m"})).expect("ok");
        let e = p.embedding.expect("embedding");
        assert_eq!((e.inputs.len(), e.refuse_long), (2, false));
        let p = embed(json!({"model": "m", "input": "a", "truncate": false})).expect("ok");
        assert!(p.embedding.is_some_and(|e| e.refuse_long));
        let p = embed(json!({"model": "m", "input": "a", "options": {"temperature": null}}));
        assert!(p.is_ok());
        let error = embed(json!({"model": "m", "input": "a", "options": {"num_ctx": 64}}))
            .expect_err("refused");
        assert!(error.message.contains("options.num_ctx"), "{error:?}");
        assert!(embed(json!({"model": "m", "input": [1]})).is_err());
        let legacy: OllamaEmbeddingsRequest =
            serde_json::from_value(json!({"model": "m", "prompt": "hi"})).expect("a request");
        let p = legacy.to_params().expect("ok");
        assert_eq!(inputs(&p), vec![Kind::Text("hi".into())]);
    }
}
