//! The network under an embedding model: a BERT-style encoder or a decoder,
//! giving each token's last hidden state.

use crate::threadpool::ThreadPool;

use super::bert::Bert;
use super::decoder::Decoder;
use super::error::EmbedError;

/// Both boxed: one is held per model, and their sizes differ widely.
pub enum Encoder {
    Bert(Box<Bert>),
    Decoder(Box<Decoder>),
}

impl Encoder {
    pub fn hidden(&self) -> usize {
        match self {
            Self::Bert(b) => b.config.hidden_size,
            Self::Decoder(d) => d.hidden(),
        }
    }

    pub fn vocab(&self) -> usize {
        match self {
            Self::Bert(b) => b.config.vocab_size,
            Self::Decoder(d) => d.vocab(),
        }
    }

    /// The most positions a text can take.
    pub fn positions(&self) -> usize {
        match self {
            Self::Bert(b) => b.config.max_position_embeddings,
            Self::Decoder(d) => d.context(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Bert(b) => b.weight_bytes(),
            Self::Decoder(d) => d.weight_bytes(),
        }
    }

    /// Every token's last hidden state, one row of [`Self::hidden`] per
    /// token, sequence after sequence.
    pub fn forward(
        &self,
        sequences: &[Vec<u32>],
        pool: &ThreadPool,
    ) -> Result<Vec<f32>, EmbedError> {
        match self {
            Self::Bert(b) => Ok(b.forward(sequences, pool)),
            Self::Decoder(d) => d.forward(sequences, pool),
        }
    }
}
