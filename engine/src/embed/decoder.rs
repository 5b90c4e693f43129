//! A decoder as an embedding model (Qwen3-Embedding and its kind): the
//! engine's own transformer, from a Hugging Face folder or a GGUF file,
//! run over each text alone from an empty cache; its final-normed hidden
//! states are what the pooling reads (the last token's, for these).

use std::path::Path;
use std::sync::Mutex;

use crate::dist::shard::ShardSpec;
use crate::model::{KvCache, Transformer, Workspace};
use crate::threadpool::ThreadPool;

use super::error::EmbedError;

/// The cache and buffers one text is run through, kept between calls.
struct Scratch {
    cache: KvCache,
    ws: Workspace,
}

pub struct Decoder {
    transformer: Transformer,
    scratch: Mutex<Scratch>,
}

fn model_error(error: impl std::fmt::Display) -> EmbedError {
    EmbedError::Model(error.to_string())
}

impl Decoder {
    /// The whole model at `path` (a folder or a GGUF file).
    pub fn load(path: &Path) -> Result<Self, EmbedError> {
        let config = crate::serve::model_config(path).map_err(model_error)?;
        if config.has_recurrent_state() {
            return Err(EmbedError::Unsupported(
                "a hybrid (linear-attention) decoder as an embedding model".into(),
            ));
        }
        let whole = ShardSpec::whole(config.layers as u32);
        let transformer =
            crate::serve::load_transformer(path, &whole, |_, _| {}).map_err(model_error)?;
        let cache = transformer.new_cache();
        Ok(Self {
            transformer,
            scratch: Mutex::new(Scratch {
                cache,
                ws: Workspace::default(),
            }),
        })
    }

    pub fn hidden(&self) -> usize {
        self.transformer.config.hidden
    }

    pub fn vocab(&self) -> usize {
        self.transformer.config.vocab
    }

    /// The positions the model takes.
    pub fn context(&self) -> usize {
        self.transformer.config.context_length
    }

    /// Whether the model is a Qwen3 (Qwen3-Embedding, trained for shorter
    /// vectors).
    pub fn is_qwen3(&self) -> bool {
        self.transformer.config.architecture == crate::model::config::Architecture::Qwen3
    }

    pub fn weight_bytes(&self) -> usize {
        self.transformer.weight_bytes()
    }

    /// The final-normed hidden states of every token of `sequences` (each
    /// checked against the vocabulary and the context by the caller), one
    /// row of `hidden` per token, sequence after sequence. Each sequence
    /// runs alone, so its states do not depend on the others.
    pub fn forward(
        &self,
        sequences: &[Vec<u32>],
        pool: &ThreadPool,
    ) -> Result<Vec<f32>, EmbedError> {
        let mut scratch = self
            .scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Scratch { cache, ws } = &mut *scratch;
        let tokens: usize = sequences.iter().map(Vec::len).sum();
        let mut out = Vec::with_capacity(tokens * self.hidden());
        for sequence in sequences {
            let states = self
                .transformer
                .normed_states(sequence, cache, ws, pool)
                .map_err(model_error)?;
            out.extend_from_slice(states);
        }
        Ok(out)
    }
}
