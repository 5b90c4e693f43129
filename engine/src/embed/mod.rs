//! Embeddings. An [`Embedder`] is a sentence-transformers folder (its
//! transformer, pooling and normalisation, as `modules.json` lists them)
//! or an embedding GGUF (pooling from its metadata, normalized as llama.cpp
//! normalizes), loaded to turn texts or token ids into vectors, a whole
//! batch at once. The network ([`encoder`]) is a BERT-style encoder
//! ([`bert`]: all-MiniLM, BGE, E5) or a decoder ([`decoder`]:
//! Qwen3-Embedding); [`pooling`] makes one vector of its token states;
//! [`tokens`] turns texts into ids; [`error`] is what can go wrong, at the
//! bottom; `weights` reads a BERT checkpoint.
//!
//! Texts are tokenized as sentence-transformers tokenizes them: with the
//! tokenizer's special tokens (`[CLS] ... [SEP]`, Qwen3-Embedding's final
//! `<|endoftext|>`), truncated to the model's `max_seq_length`.

pub mod bert;
pub mod decoder;
pub mod encoder;
pub mod error;
mod layers;
pub mod nomic;
pub mod pooling;
pub mod tokens;
mod weights;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::formats::gguf::GgufFile;
use crate::threadpool::ThreadPool;
use bert::{Bert, BertConfig};
use decoder::Decoder;
use encoder::Encoder;
pub use error::EmbedError;
use nomic::{NomicBert, NomicConfig};
use pooling::Pooling;
use tokens::TextTokenizer;

/// One thing to embed.
#[derive(Clone, Debug, PartialEq)]
pub enum EmbedInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// One input's vector and the tokens it took.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    pub vector: Vec<f32>,
    pub tokens: usize,
}

/// An embedding model, loaded.
pub struct Embedder {
    encoder: Encoder,
    tokenizer: TextTokenizer,
    pooling: Pooling,
    normalize: bool,
    max_tokens: usize,
    pub path: PathBuf,
}

fn read_json(path: &Path) -> Result<Option<Value>, EmbedError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| EmbedError::Io {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| EmbedError::Format {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
}

/// What `modules.json` says beyond the transformer: the pooling folder,
/// and whether a `Normalize` module follows.
fn modules(dir: &Path) -> Result<(PathBuf, bool), EmbedError> {
    let listed = read_json(&dir.join("modules.json"))?.unwrap_or(Value::Null);
    let entries = listed.as_array().map(Vec::as_slice).unwrap_or_default();
    let kind = |e: &Value| {
        e.get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let pooling = entries
        .iter()
        .find(|e| kind(e).ends_with("Pooling"))
        .and_then(|e| e.get("path").and_then(Value::as_str))
        .unwrap_or("1_Pooling");
    let normalize = entries.iter().any(|e| kind(e).ends_with("Normalize"));
    Ok((dir.join(pooling), normalize))
}

impl Embedder {
    /// Loads a sentence-transformers folder (`config.json`, the weights,
    /// `tokenizer.json`, `modules.json` and the pooling's `config.json`)
    /// or an embedding GGUF file.
    pub fn load(path: &Path) -> Result<Self, EmbedError> {
        if path.is_file() {
            return Self::load_gguf(path);
        }
        let dir = path;
        let config_path = dir.join("config.json");
        let config = read_json(&config_path)?.ok_or_else(|| EmbedError::Format {
            path: dir.display().to_string(),
            reason: "no config.json".into(),
        })?;
        let model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let parse_error = |e: serde_json::Error| EmbedError::Format {
            path: config_path.display().to_string(),
            reason: e.to_string(),
        };
        let tensors = || weights::Tensors::open(&dir.join("model.safetensors"));
        let encoder = match model_type {
            "bert" => {
                let config: BertConfig = serde_json::from_value(config).map_err(parse_error)?;
                Encoder::Bert(Box::new(Bert::load(config, &tensors()?)?))
            }
            "nomic_bert" => {
                let config: NomicConfig = serde_json::from_value(config).map_err(parse_error)?;
                Encoder::Nomic(Box::new(NomicBert::load(config, &tensors()?)?))
            }
            _ => Encoder::Decoder(Box::new(Decoder::load(dir)?)),
        };
        let (pooling_dir, normalize) = modules(dir)?;
        let pooling_config = read_json(&pooling_dir.join("config.json"))?.unwrap_or(Value::Null);
        let pooling = Pooling::from_config(&pooling_config).ok_or_else(|| {
            EmbedError::Unsupported(format!("the pooling of {}", pooling_dir.display()))
        })?;
        let max_tokens = max_tokens(dir, encoder.positions())?;
        let tokenizer = TextTokenizer::Hf(Box::new(tokenizer(dir, max_tokens)?));
        Ok(Self {
            encoder,
            tokenizer,
            pooling,
            normalize,
            max_tokens,
            path: dir.to_path_buf(),
        })
    }

    /// An embedding GGUF (llama.cpp's converter writes one from a
    /// sentence-transformers folder): a decoder whose
    /// `{arch}.pooling_type` says how to pool; vectors normalized, as
    /// llama.cpp normalizes them.
    fn load_gguf(path: &Path) -> Result<Self, EmbedError> {
        let file = GgufFile::open(path).map_err(|e| EmbedError::Model(e.to_string()))?;
        let arch = file
            .get_str("general.architecture")
            .map_err(|e| EmbedError::Model(e.to_string()))?;
        let pooling_key = format!("{arch}.pooling_type");
        let pooling = match file.get_usize(&pooling_key) {
            Ok(Some(1)) => Pooling::Mean,
            Ok(Some(2)) => Pooling::Cls,
            Ok(Some(3)) => Pooling::LastToken,
            Ok(other) => {
                return Err(EmbedError::Unsupported(format!(
                    "{pooling_key} {other:?} (an embedding GGUF names mean 1, CLS 2 or last 3)"
                )))
            }
            Err(e) => return Err(EmbedError::Model(e.to_string())),
        };
        let metadata = file.metadata();
        let text = crate::text::tokenizer::Tokenizer::from_gguf(metadata)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        let add_eos = matches!(
            metadata.get("tokenizer.ggml.add_eos_token"),
            Some(candle_core::quantized::gguf_file::Value::Bool(true))
        );
        let eos = file
            .get_usize("tokenizer.ggml.eos_token_id")
            .ok()
            .flatten()
            .and_then(|id| u32::try_from(id).ok())
            .filter(|_| add_eos);
        let encoder = Encoder::Decoder(Box::new(Decoder::load(path)?));
        Ok(Self {
            max_tokens: encoder.positions(),
            encoder,
            tokenizer: TextTokenizer::Gguf {
                tokenizer: Box::new(text),
                eos,
            },
            pooling,
            normalize: true,
            path: path.to_path_buf(),
        })
    }

    /// The bytes of the weights held.
    pub fn weight_bytes(&self) -> usize {
        self.encoder.weight_bytes()
    }

    /// The length of each vector.
    pub fn dimensions(&self) -> usize {
        self.encoder.hidden()
    }

    /// The most tokens an input takes (texts are cut there, as
    /// sentence-transformers cuts them).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The token ids input `index` is embedded from: a text cut at
    /// [`Self::max_tokens`] (or refused when `refuse_long`), token ids
    /// checked against the vocabulary and the limit.
    pub fn tokenize_input(
        &self,
        index: usize,
        input: &EmbedInput,
        refuse_long: bool,
    ) -> Result<Vec<u32>, EmbedError> {
        let invalid = |reason: String| EmbedError::Input { index, reason };
        match input {
            EmbedInput::Text(text) => {
                let tokenized = self.tokenizer.encode(text, self.max_tokens)?;
                if refuse_long && tokenized.cut {
                    return Err(invalid(format!(
                        "the text is longer than the model's {} tokens",
                        self.max_tokens
                    )));
                }
                Ok(tokenized.ids)
            }
            EmbedInput::Tokens(ids) => {
                let vocab = self.encoder.vocab();
                if ids.is_empty() {
                    return Err(invalid("no tokens".into()));
                }
                if ids.len() > self.max_tokens {
                    return Err(invalid(format!(
                        "{} tokens, beyond the model's {}",
                        ids.len(),
                        self.max_tokens
                    )));
                }
                match ids.iter().find(|&&id| id as usize >= vocab) {
                    Some(id) => Err(invalid(format!(
                        "token id {id} is beyond the vocabulary of {vocab}"
                    ))),
                    None => Ok(ids.clone()),
                }
            }
        }
    }

    /// As [`Self::tokenize_input`], texts cut at the model's limit.
    pub fn tokenize(&self, index: usize, input: &EmbedInput) -> Result<Vec<u32>, EmbedError> {
        self.tokenize_input(index, input, false)
    }

    /// Whether vectors may be cut to fewer dimensions (a model trained
    /// for it, Matryoshka-style: nomic-embed-text v1.5, Qwen3-Embedding).
    /// A BERT sentence encoder is not.
    pub fn cuts_dimensions(&self) -> bool {
        self.encoder.cuts_dimensions()
    }

    /// Checks a request's `dimensions` (0: the whole vector).
    pub fn check_dimensions(&self, dimensions: usize) -> Result<(), EmbedError> {
        let whole = self.dimensions();
        let fits = dimensions == 0
            || dimensions == whole
            || (self.cuts_dimensions() && dimensions < whole);
        if fits {
            return Ok(());
        }
        let reason = if self.cuts_dimensions() {
            format!("dimensions {dimensions}: the model's vectors have {whole}")
        } else {
            format!(
                "dimensions {dimensions}: this model's vectors have {whole} and cannot be cut \
                 (it was not trained for shorter vectors)"
            )
        };
        Err(EmbedError::Input { index: 0, reason })
    }

    /// The vectors of already tokenized sequences, in order, computed as
    /// one batch and normalized as the model's modules say ([`pooling::cut`]
    /// shortens one).
    pub fn embed_tokens(
        &self,
        sequences: &[Vec<u32>],
        pool: &ThreadPool,
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        let states = self.encoder.forward(sequences, pool)?;
        let width = self.dimensions();
        Ok(layers::spans(sequences)
            .into_iter()
            .map(|span| {
                let mut vector = self
                    .pooling
                    .pool(&states[span.start * width..span.end * width], width);
                if self.normalize {
                    pooling::normalize(&mut vector);
                }
                vector
            })
            .collect())
    }

    /// The vectors of `inputs`, in order, computed as one batch.
    pub fn embed(
        &self,
        inputs: &[EmbedInput],
        pool: &ThreadPool,
    ) -> Result<Vec<Embedding>, EmbedError> {
        let sequences = inputs
            .iter()
            .enumerate()
            .map(|(index, input)| self.tokenize(index, input))
            .collect::<Result<Vec<_>, _>>()?;
        let vectors = self.embed_tokens(&sequences, pool)?;
        Ok(vectors
            .into_iter()
            .zip(&sequences)
            .map(|(vector, tokens)| Embedding {
                vector,
                tokens: tokens.len(),
            })
            .collect())
    }
}

/// `max_seq_length` as sentence-transformers takes it: its own config,
/// else the tokenizer's `model_max_length`, within the position table.
fn max_tokens(dir: &Path, positions: usize) -> Result<usize, EmbedError> {
    let own = read_json(&dir.join("sentence_bert_config.json"))?
        .and_then(|c| c.get("max_seq_length").and_then(Value::as_u64));
    let tokenizer = read_json(&dir.join("tokenizer_config.json"))?
        .and_then(|c| c.get("model_max_length").and_then(Value::as_u64));
    let chosen = own
        .or(tokenizer)
        .map_or(positions, |n| usize::try_from(n).unwrap_or(positions));
    Ok(chosen.min(positions))
}

/// The folder's `tokenizer.json`, cutting at `max_tokens` (special tokens
/// included) and padding nothing.
fn tokenizer(dir: &Path, max_tokens: usize) -> Result<tokenizers::Tokenizer, EmbedError> {
    let path = dir.join("tokenizer.json");
    let mut tokenizer =
        tokenizers::Tokenizer::from_file(&path).map_err(|e| EmbedError::Format {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(Some(tokenizers::TruncationParams {
            max_length: max_tokens,
            ..Default::default()
        }))
        .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
    Ok(tokenizer)
}
