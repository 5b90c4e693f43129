//! Constrained decoding: a request's [`Constraint`] (a JSON Schema, any
//! JSON object, a regex or a Lark grammar) becomes a [`TokenMask`] that
//! allows, at each step, only the tokens that keep the output inside the
//! constraint. The grammar engine is llguidance (the one llama.cpp, vLLM
//! and mistral.rs use); this crate adapts it to a model's vocabulary and to
//! the engine's sampling (logits set to `-inf`, one token accepted at a
//! time).
//!
//! Layout:
//! - [`Constraint`]: what a request asks for, as the API received it.
//! - [`Vocabulary`]: a model's tokens as bytes and its
//!   end tokens, which [`Grammars`] turns into llguidance's token trie once
//!   per model.
//! - [`Grammars::compile`]: a constraint for one sequence ([`TokenMask`]).
//! - [`check`]: compiles a constraint against a byte-level vocabulary, so
//!   the API refuses a schema or grammar that cannot compile before anything
//!   is placed.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// JSON that validates against this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `json_object`, Ollama's `"json"`).
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Text of this grammar, in llguidance's Lark syntax (which also
    /// embeds JSON schemas with `%json { ... }`).
    Lark(String),
}

impl Constraint {
    /// A short name for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
        }
    }

    /// llguidance's grammar for it. JSON comes compact but for a space after
    /// `,` and `:`, unless the schema says otherwise in `x-guidance`:
    /// free whitespace lets a small model write newlines forever.
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema)),
            Self::JsonObject => TopLevelGrammar::from_json_schema(with_layout(
                &serde_json::json!({"type": "object"}),
            )),
            Self::Regex(regex) => TopLevelGrammar::from_regex(regex),
            Self::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        }
    }
}

/// `schema` with llguidance's layout options (compact JSON, a space after
/// `,` and `:`) unless it sets its own `x-guidance`; for schemas embedded
/// in a Lark grammar with `%json`.
pub fn with_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// Why a constraint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("the {kind} constraint does not compile: {reason}")]
    Compile { kind: &'static str, reason: String },
    #[error("the model's vocabulary cannot carry a grammar: {0}")]
    Vocabulary(String),
    #[error("the constraint failed while generating: {0}")]
    Matching(String),
}

/// A model's vocabulary as the grammar sees it.
pub struct Vocabulary {
    /// Each token's bytes, by id; a control token's bytes are its text
    /// (e.g. `<|im_end|>`), and an unused id's are empty (never allowed).
    pub tokens: Vec<Vec<u8>>,
    /// Which ids are control tokens: a grammar names them, text never
    /// spells them.
    pub control: Vec<bool>,
    /// The tokens that end generation; allowed wherever the constraint may
    /// end. At least one.
    pub end: Vec<u32>,
}

/// The llguidance view of a vocabulary. Only the trie is used: the engine
/// never asks llguidance to force tokens or to heal a prompt, the two uses
/// of a canonical tokenization, so text is tokenized by the trie's longest
/// matches and said not to be canonical.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(bytes)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// A model's grammar compiler: the token trie and llguidance's parser
/// factory, built once per model (a fraction of a second for a 150k
/// vocabulary) and shared by every sequence.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    pub fn new(vocabulary: Vocabulary) -> Result<Self, GrammarError> {
        let Vocabulary {
            tokens,
            control,
            end,
        } = vocabulary;
        let vocab_size = tokens.len();
        let Some(&first_end) = end.first() else {
            return Err(GrammarError::Vocabulary(
                "no end-of-generation token".into(),
            ));
        };
        if end.iter().any(|&id| id as usize >= vocab_size) || control.len() != vocab_size {
            return Err(GrammarError::Vocabulary(
                "end tokens or control flags do not match the vocabulary".into(),
            ));
        }
        let words: Vec<Vec<u8>> = tokens
            .into_iter()
            .zip(control)
            .map(|(bytes, is_control)| trie_word(bytes, is_control))
            .collect();
        let size = u32::try_from(vocab_size)
            .map_err(|_| GrammarError::Vocabulary("more than 2^32 tokens".into()))?;
        let trie = TokTrie::from(&TokRxInfo::new(size, first_end), &words).with_eos_tokens(&end);
        let env: toktrie::TokEnv = Arc::new(Env { trie });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // Errors go to the caller, not to stderr.
        factory.quiet();
        Ok(Self {
            factory,
            vocab_size,
        })
    }

    /// The mask of one sequence under `constraint`.
    pub fn compile(&self, constraint: &Constraint) -> Result<TokenMask, GrammarError> {
        let compile_error = |reason: String| GrammarError::Compile {
            kind: constraint.kind(),
            reason,
        };
        let parser = self
            .factory
            .create_parser(constraint.grammar())
            .map_err(|e| compile_error(first_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(compile_error(first_line(&error)));
        }
        Ok(TokenMask {
            matcher,
            mask: SimpleVob::alloc(self.vocab_size),
        })
    }
}

/// An llguidance error on one line, cut to a length a client can read
/// (its errors may go on with the parser's state and the whole grammar).
fn first_line(text: &str) -> String {
    const MOST: usize = 300;
    let mut line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > MOST {
        let cut = (0..=MOST)
            .rev()
            .find(|&i| line.is_char_boundary(i))
            .unwrap_or(0);
        line.truncate(cut);
        line.push('…');
    }
    line
}

/// The trie's bytes for a token: a control token's text behind the
/// special-token marker, so text never matches it.
fn trie_word(bytes: Vec<u8>, is_control: bool) -> Vec<u8> {
    if is_control && !bytes.is_empty() {
        let mut word = Vec::with_capacity(bytes.len() + 1);
        word.push(TokTrie::SPECIAL_TOKEN_MARKER);
        word.extend_from_slice(&bytes);
        word
    } else {
        bytes
    }
}

/// One sequence's constraint as it stands: which tokens may come next.
pub struct TokenMask {
    matcher: Matcher,
    mask: SimpleVob,
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenMask")
            .field("finished", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl TokenMask {
    /// Sets the logit of every token the constraint does not allow next to
    /// `-inf`. Once the constraint is complete only the end tokens remain.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        self.mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matching(first_line(&e.to_string())))?;
        mask_logits(&self.mask, logits);
        Ok(())
    }

    /// Whether `token` was allowed by the last [`TokenMask::apply`].
    pub fn allowed(&self, token: u32) -> bool {
        (token as usize) < self.mask.len() && self.mask.is_allowed(token)
    }

    /// Moves the constraint past `token` (one the mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matching(first_line(&e.to_string())))
    }

    /// Whether the constraint is complete: nothing but an end token may
    /// follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// `-inf` for every logit whose token `mask` does not allow (and for ids
/// past the mask: a model's padded vocabulary).
fn mask_logits(mask: &SimpleVob, logits: &mut [f32]) {
    const BITS: usize = 32;
    let words = mask.as_slice();
    for (chunk_index, chunk) in logits.chunks_mut(BITS).enumerate() {
        let word = words.get(chunk_index).copied().unwrap_or(0);
        if word == u32::MAX && chunk.len() == BITS {
            continue;
        }
        for (bit, logit) in chunk.iter_mut().enumerate() {
            if word & (1 << bit) == 0 {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

/// Compiles `constraint` against a byte-level vocabulary: what the API
/// checks before it places a request (the model's own vocabulary compiles
/// what this one does).
pub fn check(constraint: &Constraint) -> Result<(), GrammarError> {
    static BYTES: OnceLock<Result<Grammars, String>> = OnceLock::new();
    let grammars = BYTES.get_or_init(|| {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.push(b"<end>".to_vec());
        let mut control = vec![false; 256];
        control.push(true);
        Grammars::new(Vocabulary {
            tokens,
            control,
            end: vec![256],
        })
        .map_err(|e| e.to_string())
    });
    match grammars {
        Ok(grammars) => grammars.compile(constraint).map(|_| ()),
        Err(reason) => Err(GrammarError::Vocabulary(reason.clone())),
    }
}

#[cfg(test)]
mod tests;
