//! The network under an embedding model: a BERT-style encoder or a decoder,
//! giving each token's last hidden state.

use crate::threadpool::ThreadPool;

use super::bert::Bert;
use super::decoder::Decoder;
use super::error::EmbedError;
use super::nomic::NomicBert;

/// Boxed: one is held per model, and their sizes differ widely.
pub enum Encoder {
    Bert(Box<Bert>),
    Nomic(Box<NomicBert>),
    Decoder(Box<Decoder>),
}

impl Encoder {
    pub fn hidden(&self) -> usize {
        match self {
            Self::Bert(b) => b.config.hidden_size,
            Self::Nomic(n) => n.config.n_embd,
            Self::Decoder(d) => d.hidden(),
        }
    }

    pub fn vocab(&self) -> usize {
        match self {
            Self::Bert(b) => b.config.vocab_size,
            Self::Nomic(n) => n.config.vocab_size,
            Self::Decoder(d) => d.vocab(),
        }
    }

    /// The most positions a text can take.
    pub fn positions(&self) -> usize {
        match self {
            Self::Bert(b) => b.config.max_position_embeddings,
            Self::Nomic(n) => n.config.n_positions,
            Self::Decoder(d) => d.context(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Bert(b) => b.weight_bytes(),
            Self::Nomic(n) => n.weight_bytes(),
            Self::Decoder(d) => d.weight_bytes(),
        }
    }

    /// Whether vectors may be cut to fewer dimensions: families trained
    /// for it (Matryoshka-style: nomic-embed-text v1.5, Qwen3-Embedding).
    pub fn cuts_dimensions(&self) -> bool {
        match self {
            Self::Bert(_) => false,
            Self::Nomic(_) => true,
            Self::Decoder(d) => d.is_qwen3(),
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
            Self::Nomic(n) => Ok(n.forward(sequences, pool)),
            Self::Decoder(d) => d.forward(sequences, pool),
        }
    }
}
