//! Texts into token ids as each kind of embedding model expects them: a
//! `tokenizer.json` (its post-processor adds the special tokens, its
//! truncation cuts), or a GGUF's vocabulary (BOS and EOS as its metadata
//! says, cut before the EOS as sentence-transformers cuts).

use crate::text::tokenizer::Tokenizer;

use super::error::EmbedError;

pub enum TextTokenizer {
    Hf(Box<tokenizers::Tokenizer>),
    Gguf {
        tokenizer: Box<Tokenizer>,
        /// Appended to every text (`tokenizer.ggml.add_eos_token`).
        eos: Option<u32>,
    },
}

/// A text's ids, and whether it was cut to fit `max_tokens`.
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub cut: bool,
}

impl TextTokenizer {
    /// `text` as the model's tokens, at most `max_tokens` of them.
    pub fn encode(&self, text: &str, max_tokens: usize) -> Result<Tokenized, EmbedError> {
        match self {
            Self::Hf(tokenizer) => {
                let encoding = tokenizer
                    .encode(text, true)
                    .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
                Ok(Tokenized {
                    cut: !encoding.get_overflowing().is_empty(),
                    ids: encoding.get_ids().to_vec(),
                })
            }
            Self::Gguf { tokenizer, eos } => {
                let mut ids = tokenizer
                    .encode(text, true)
                    .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
                let room = max_tokens.saturating_sub(usize::from(eos.is_some()));
                let cut = ids.len() > room;
                ids.truncate(room);
                ids.extend(*eos);
                Ok(Tokenized { ids, cut })
            }
        }
    }
}
