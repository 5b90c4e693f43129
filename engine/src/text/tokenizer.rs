//! Text ⇄ token ids for the engine, built either from GGUF metadata or from a
//! Hugging Face model folder, reproducing llama.cpp's tokenization.
//!
//! # What is supported
//! - GGUF `tokenizer.ggml.model = "gpt2"`: byte-level BPE (GPT-2, Llama 3,
//!   Qwen 2, SmolLM, StarCoder, …). The pre-tokenizer is chosen by
//!   `tokenizer.ggml.pre` from the same regex lists llama.cpp uses
//!   ([`PRE_TOKENIZER_NAMES`]); each regex splits the pieces left by the
//!   previous one, matches and gaps both kept, then bytes are mapped to the
//!   GPT-2 byte alphabet.
//! - GGUF `tokenizer.ggml.model = "llama"`: SentencePiece BPE (Llama 2,
//!   Mistral v0.1, Gemma, Phi-3), as transformers converts it: merges from
//!   the scores, byte fallback, '▁' for spaces ([`sentencepiece_model`]).
//!   Other GGUF vocabularies (`bert`, `t5`, `rwkv`) are reported as
//!   [`TokenizerError::UnsupportedModel`].
//! - A Hugging Face folder: `tokenizer.json` (any model the `tokenizers`
//!   crate reads), with `tokenizer_config.json`, `chat_template.jinja` and
//!   `generation_config.json` when present.
//!
//! # Token kinds
//! GGUF token types 3 (control) and 2 (unknown), and Hugging Face added
//! tokens marked `special`, are *control* tokens: they are matched whole in
//! the input only when special tokens are parsed, and they decode to nothing
//! unless asked. GGUF type 4 (user-defined) and non-special added tokens are
//! always matched whole and decode to their text as written.
//!
//! # Decoding
//! For byte-level vocabularies every token has a precomputed byte string
//! ([`Tokenizer::token_bytes`]); [`Tokenizer::decode`] concatenates them, so
//! no space is ever inserted after special tokens (candle's own GGUF
//! conversion does that; this one uses a plain `ByteLevel` decoder).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value as GgufValue;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BpeBuilder, Merges, Vocab};
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, Model, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    SplitDelimiterBehavior, Token, TokenizerImpl,
};

/// Errors of building or using a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required GGUF metadata key is absent.
    #[error("GGUF metadata key `{0}` is missing")]
    MissingKey(String),
    /// A GGUF metadata key has the wrong type or value.
    #[error("GGUF metadata key `{key}` is malformed: {reason}")]
    MalformedKey { key: String, reason: String },
    /// The vocabulary type is one this engine does not tokenize.
    #[error("unsupported tokenizer model `{model}`: {reason}")]
    UnsupportedModel { model: String, reason: String },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this engine does not know.
    #[error(
        "unknown pre-tokenizer `{0}` (GGUF key tokenizer.ggml.pre); known names: {known}",
        known = PRE_TOKENIZER_NAMES.join(", ")
    )]
    UnknownPreTokenizer(String),
    /// A required file of a Hugging Face folder does not exist.
    #[error("tokenizer file not found: {}", .0.display())]
    MissingFile(PathBuf),
    /// A file exists but could not be read.
    #[error("failed to read {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file was read but its content is not valid.
    #[error("failed to load {}: {reason}", .path.display())]
    InvalidFile { path: PathBuf, reason: String },
    /// The `tokenizers` crate refused the vocabulary, merges or a regex.
    #[error("failed to build the tokenizer: {0}")]
    Build(String),
    /// Encoding failed inside the `tokenizers` crate.
    #[error("failed to encode text: {0}")]
    Encode(String),
    /// Decoding failed inside the `tokenizers` crate.
    #[error("failed to decode token ids: {0}")]
    Decode(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    InvalidTokenId { id: u32, vocab_size: usize },
}

/// The pre-tokenizer names accepted in GGUF `tokenizer.ggml.pre`, as llama.cpp
/// (src/llama-vocab.cpp) spells them; `default` is also used when the key is absent.
pub const PRE_TOKENIZER_NAMES: &[&str] = &[
    "default",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "dbrx",
    "smaug-bpe",
    "deepseek-llm",
    "deepseek-v3",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva",
    "minerva-7b",
    "gpt2",
    "gpt-2",
    "phi-2",
    "roberta-bpe",
    "jina-es",
    "jina-de",
    "jina-v1-en",
    "jina-v2-es",
    "jina-v2-de",
    "jina-v2-code",
    "gigachat",
    "mpt",
    "olmo",
    "jais",
    "qwen2",
    "deepseek-r1-qwen",
    "megrez",
    "stablelm2",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "chatglm-bpe",
    "viking",
    "tekken",
    "chameleon",
];

/// llama.cpp's pre-tokenizer for a `tokenizer.ggml.pre` name.
struct PreTokenizerSpec {
    /// Applied in order; each splits the pieces of the previous one.
    regexes: &'static [&'static str],
    /// A word that is a whole vocabulary entry is taken as is (Llama 3, Tekken).
    ignore_merges: bool,
    /// llama.cpp's default for `add_bos` before `tokenizer.ggml.add_bos_token`.
    add_bos: bool,
}

fn pre_tokenizer_spec(name: &str) -> Option<PreTokenizerSpec> {
    let spec = |regexes, ignore_merges, add_bos| PreTokenizerSpec {
        regexes,
        ignore_merges,
        add_bos,
    };
    Some(match name {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => spec(RX_LLAMA3, true, true),
        "dbrx" | "smaug-bpe" => spec(RX_DBRX, false, false),
        "deepseek-llm" => spec(RX_DEEPSEEK_LLM, false, false),
        "deepseek-v3" => spec(RX_DEEPSEEK3_LLM, false, false),
        "deepseek-coder" => spec(RX_DEEPSEEK_CODER, false, false),
        "falcon" => spec(RX_FALCON, false, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva"
        | "minerva-7b" => spec(RX_STARCODER, false, false),
        "gpt2" | "gpt-2" | "phi-2" | "roberta-bpe" | "jina-es" | "jina-de" | "jina-v1-en"
        | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" | "gigachat" | "mpt" | "olmo" | "jais" => {
            spec(RX_GPT2, false, false)
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => spec(RX_QWEN2, false, false),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec(RX_PORO, false, false),
        "chatglm-bpe" => spec(RX_CHATGLM4, false, false),
        "viking" => spec(RX_VIKING, false, false),
        "tekken" => spec(RX_TEKKEN, true, false),
        "chameleon" => spec(RX_CHAMELEON, false, true),
        "default" => spec(RX_DEFAULT, false, false),
        _ => return None,
    })
}

// Regex lists copied from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe).
const RX_LLAMA3: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const RX_DBRX: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const RX_DEEPSEEK_LLM: &[&str] = &[
    r##"[\r\n]"##,
    r##"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"##,
    r##"\s?[!-/:-~！-／：-～‘-‟　-。]+"##,
    r##"\s+$"##,
    r##"[一-龥ࠀ-一가-퟿]+"##,
    r##"\p{N}+"##,
];
const RX_DEEPSEEK3_LLM: &[&str] = &[
    r##"\p{N}{1,3}"##,
    r##"[一-龥぀-ゟ゠-ヿ]+"##,
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const RX_DEEPSEEK_CODER: &[&str] = &[
    r##"[\r\n]"##,
    r##"\s?\p{L}+"##,
    r##"\s?\p{P}+"##,
    r##"[一-龥ࠀ-一가-퟿]+"##,
    r##"\p{N}"##,
];
const RX_FALCON: &[&str] = &[
    r##"[\p{P}\$\+<=>\^~\|`]+"##,
    r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##,
    r##"[0-9][0-9][0-9]"##,
];
/// starcoder, refact, command-r, smollm, codeshell, exaone, minerva: every
/// digit on its own, then the GPT-2 regex.
const RX_STARCODER: &[&str] = &[
    r##"\p{N}"##,
    r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##,
];
const RX_GPT2: &[&str] =
    &[r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##];
const RX_QWEN2: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const RX_PORO: &[&str] = &[r##" ?[^(\s|.,!?…。，、।۔،)]+"##];
const RX_CHATGLM4: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const RX_VIKING: &[&str] = &[r##" ?[^(\s|.,!?…。，、।۔،)]+"##, r##"\p{N}"##];
const RX_TEKKEN: &[&str] = &[
    r##"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
const RX_CHAMELEON: &[&str] = &[
    r##"<sentinel:[0-9]+>"##,
    r##"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"##,
    r##"([\t\n]|    |  )"##,
    r##"\p{N}"##,
    r##"[\p{P}!-/:-@\[-`{-~]"##,
    r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##,
];
const RX_DEFAULT: &[&str] = &[
    r##"[\p{P}\$\+<=>\^~\|]+"##,
    r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##,
    r##"\p{N}+"##,
    r##"[0-9][0-9][0-9]"##,
];

/// Token texts that end generation when they exist and are control tokens
/// (besides the declared eos/eot/eom ids); the list follows llama.cpp.
const EOG_TOKEN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
    "</s>",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    /// An ordinary vocabulary entry.
    Normal,
    /// Control or unknown: matched only when parsing specials, decodes to nothing by default.
    Control,
    /// Always matched whole; decodes to its text as written.
    UserDefined,
    /// Unused: decodes to nothing.
    Unused,
    /// A raw byte written `<0xAB>` (GGUF type 6).
    Byte,
}

/// A tokenizer with the metadata generation needs (BOS, end-of-generation ids,
/// chat template) and a per-token byte table for streaming.
pub struct Tokenizer {
    /// Splits control tokens out of the input.
    inner: Pipeline,
    /// Same model, control tokens treated as plain text.
    inner_plain: Pipeline,
    /// Decode by concatenating `token_bytes` (every GGUF vocabulary, and
    /// byte-level `tokenizer.json` ones); otherwise by `inner`'s decoder.
    byte_level: bool,
    kinds: Vec<TokenKind>,
    /// Token text as stored in the vocabulary (byte-level alphabet for normal tokens).
    texts: Vec<String>,
    /// `token_bytes(id)` is `bytes[offsets[id]..offsets[id + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    bos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("byte_level", &self.byte_level)
            .field("bos", &self.bos)
            .field("add_bos", &self.add_bos)
            .field("eog", &self.eog)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

// ---------------------------------------------------------------------------
// GGUF metadata access

type Metadata = HashMap<String, GgufValue>;

fn malformed(key: &str, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::MalformedKey {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn gguf_type_name(v: &GgufValue) -> String {
    format!("{:?}", v.value_type())
}

fn gguf_str<'a>(md: &'a Metadata, key: &str) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(GgufValue::String(s)) => Ok(Some(s.as_str())),
        Some(v) => Err(malformed(
            key,
            format!("expected a string, found {}", gguf_type_name(v)),
        )),
    }
}

fn gguf_int(v: &GgufValue) -> Option<i64> {
    Some(match v {
        GgufValue::U8(x) => *x as i64,
        GgufValue::I8(x) => *x as i64,
        GgufValue::U16(x) => *x as i64,
        GgufValue::I16(x) => *x as i64,
        GgufValue::U32(x) => *x as i64,
        GgufValue::I32(x) => *x as i64,
        GgufValue::U64(x) => i64::try_from(*x).ok()?,
        GgufValue::I64(x) => *x,
        _ => return None,
    })
}

/// A token id key; negative values (llama.cpp's "none") read as absent.
fn gguf_token_id(md: &Metadata, key: &str, n_vocab: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = gguf_int(v).ok_or_else(|| {
        malformed(
            key,
            format!("expected an integer token id, found {}", gguf_type_name(v)),
        )
    })?;
    if id < 0 {
        return Ok(None);
    }
    if id as u64 >= n_vocab as u64 {
        return Err(malformed(
            key,
            format!("token id {id} is outside the vocabulary of {n_vocab} tokens"),
        ));
    }
    Ok(Some(id as u32))
}

fn gguf_bool(md: &Metadata, key: &str) -> Result<Option<bool>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(GgufValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => match gguf_int(v) {
            Some(i) => Ok(Some(i != 0)),
            None => Err(malformed(
                key,
                format!("expected a bool, found {}", gguf_type_name(v)),
            )),
        },
    }
}

fn gguf_array<'a>(md: &'a Metadata, key: &str) -> Result<Option<&'a [GgufValue]>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(GgufValue::Array(a)) => Ok(Some(a.as_slice())),
        Some(v) => Err(malformed(
            key,
            format!("expected an array, found {}", gguf_type_name(v)),
        )),
    }
}

fn gguf_str_array<'a>(md: &'a Metadata, key: &str) -> Result<Option<Vec<&'a str>>, TokenizerError> {
    let Some(items) = gguf_array(md, key)? else {
        return Ok(None);
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            GgufValue::String(s) => Ok(s.as_str()),
            v => Err(malformed(
                key,
                format!("element {i} is {}, expected a string", gguf_type_name(v)),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

// ---------------------------------------------------------------------------
// Byte-level alphabet (GPT-2's bytes_to_unicode)

/// `table[b]` is the character GPT-2's byte-level BPE uses for byte `b`.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            // 256 + n stays below 512 (n counts at most 256 bytes), far
            // from the surrogates: always a character.
            let c = char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER);
            n += 1;
            c
        };
    }
    table
}

fn char_to_byte_map() -> HashMap<char, u8> {
    byte_to_char_table()
        .iter()
        .enumerate()
        .map(|(b, c)| (*c, b as u8))
        .collect()
}

/// Bytes of a byte-level token text; characters outside the alphabet keep their UTF-8.
fn byte_level_decode(text: &str, map: &HashMap<char, u8>, out: &mut Vec<u8>) {
    for c in text.chars() {
        match map.get(&c) {
            Some(b) => out.push(*b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

/// `<0xAB>` → 0xAB.
fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

// ---------------------------------------------------------------------------
// Construction helpers

fn build_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Build(e.to_string())
}

/// One model (vocabulary, merges and their cache) behind both of a
/// [`Tokenizer`]'s pipelines. A clone of the model would double the largest
/// part of a tokenizer's memory: 5.4 MB for a 49k vocabulary, four times
/// that for Llama 3's.
#[derive(Clone)]
struct SharedModel(Arc<ModelWrapper>);

impl Model for SharedModel {
    type Trainer = <ModelWrapper as Model>::Trainer;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        self.0.tokenize(sequence)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.0.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.0.id_to_token(id)
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        self.0.get_vocab()
    }

    fn get_vocab_size(&self) -> usize {
        self.0.get_vocab_size()
    }

    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        self.0.save(folder, prefix)
    }

    fn get_trainer(&self) -> Self::Trainer {
        self.0.get_trainer()
    }
}

impl serde::Serialize for SharedModel {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// A `tokenizers` pipeline over a [`SharedModel`].
type Pipeline = TokenizerImpl<
    SharedModel,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

impl SharedModel {
    fn new(model: impl Into<ModelWrapper>) -> Self {
        Self(Arc::new(model.into()))
    }
}

impl<'de> serde::Deserialize<'de> for SharedModel {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        ModelWrapper::deserialize(deserializer).map(|model| Self(Arc::new(model)))
    }
}

fn bpe_pre_tokenizer(regexes: &[&str]) -> Result<Sequence, TokenizerError> {
    let mut steps = Vec::with_capacity(regexes.len() + 1);
    for rx in regexes {
        let split = Split::new(
            SplitPattern::Regex((*rx).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex `{rx}`: {e}")))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, true, false,
    )));
    Ok(Sequence::new(steps))
}

/// Adds a post-processor that prepends BOS, so that the exported
/// `tokenizer.json` behaves like the model for Hugging Face consumers.
/// [`Tokenizer`] itself adds BOS by hand and never runs it.
fn set_bos_post_processor(tok: &mut Pipeline, bos: &str, bos_id: u32) {
    let processor = TemplateProcessing::builder()
        .try_single(vec![bos.to_string(), "$A".to_string()])
        .and_then(|b| {
            b.try_pair(vec![
                bos.to_string(),
                "$A".to_string(),
                bos.to_string(),
                "$B:1".to_string(),
            ])
        })
        .ok()
        .and_then(|b| b.special_tokens(vec![(bos, bos_id)]).build().ok());
    if let Some(p) = processor {
        tok.with_post_processor(Some(p));
    }
}

/// Sorted, deduplicated end-of-generation ids.
fn collect_eog(
    declared: impl IntoIterator<Item = u32>,
    kinds: &[TokenKind],
    lookup: impl Fn(&str) -> Option<u32>,
) -> Vec<u32> {
    let mut set: HashSet<u32> = declared.into_iter().collect();
    for text in EOG_TOKEN_TEXTS {
        if let Some(id) = lookup(text) {
            if kinds.get(id as usize) == Some(&TokenKind::Control) {
                set.insert(id);
            }
        }
    }
    let mut eog: Vec<u32> = set.into_iter().collect();
    eog.sort_unstable();
    eog
}

fn flatten_bytes(per_token: Vec<Vec<u8>>) -> (Vec<u8>, Vec<u32>) {
    let total: usize = per_token.iter().map(Vec::len).sum();
    let mut bytes = Vec::with_capacity(total);
    let mut offsets = Vec::with_capacity(per_token.len() + 1);
    offsets.push(0);
    for b in per_token {
        bytes.extend_from_slice(&b);
        offsets.push(bytes.len() as u32);
    }
    (bytes, offsets)
}

fn read_file(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json_opt(path: &Path) -> Result<Option<serde_json::Value>, TokenizerError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = read_file(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::InvalidFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// `"<s>"` or `{"content": "<s>", ...}` (an AddedToken as transformers saves it).
fn token_content(v: &serde_json::Value) -> Option<&str> {
    match v {
        serde_json::Value::String(s) => Some(s.as_str()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` (take `default`, else the first).
fn chat_template_from_config(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => {
            let named = |name: &str| {
                items.iter().find_map(|it| {
                    (it.get("name")?.as_str()? == name)
                        .then(|| it.get("template")?.as_str().map(str::to_string))
                        .flatten()
                })
            };
            named("default").or_else(|| {
                items
                    .iter()
                    .find_map(|it| it.get("template")?.as_str().map(str::to_string))
            })
        }
        _ => None,
    }
}

fn decoder_is_byte_level(decoder: Option<&serde_json::Value>) -> bool {
    let Some(d) = decoder else { return false };
    match d.get("type").and_then(|t| t.as_str()) {
        Some("ByteLevel") => true,
        Some("Sequence") => d
            .get("decoders")
            .and_then(|ds| ds.as_array())
            .is_some_and(|ds| ds.iter().any(|d| decoder_is_byte_level(Some(d)))),
        _ => false,
    }
}

/// A byte-level BPE from `tokenizer.ggml.merges`, with the pre-tokenizer
/// `tokenizer.ggml.pre` names; and whether llama.cpp adds BOS by default.
fn byte_level_model(
    metadata: &Metadata,
    tokens: &[&str],
) -> Result<(Pipeline, bool), TokenizerError> {
    const PRE: &str = "tokenizer.ggml.pre";
    let pre_name = gguf_str(metadata, PRE)?.unwrap_or("default");
    let spec = pre_tokenizer_spec(pre_name)
        .ok_or_else(|| TokenizerError::UnknownPreTokenizer(pre_name.to_string()))?;
    const MERGES: &str = "tokenizer.ggml.merges";
    let merge_strs = gguf_str_array(metadata, MERGES)?
        .ok_or_else(|| TokenizerError::MissingKey(MERGES.to_string()))?;
    let mut merges: Merges = Vec::with_capacity(merge_strs.len());
    for (i, m) in merge_strs.iter().enumerate() {
        // Like llama.cpp: the separator is the first space after the first character.
        let split_at = m
            .char_indices()
            .skip(1)
            .find(|(_, c)| *c == ' ')
            .map(|(p, _)| p)
            .ok_or_else(|| malformed(MERGES, format!("entry {i} `{m}` has no space")))?;
        merges.push((m[..split_at].to_string(), m[split_at + 1..].to_string()));
    }
    let bpe = BpeBuilder::new()
        .vocab_and_merges(first_ids(tokens), merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(build_err)?;
    let mut inner = Pipeline::new(SharedModel::new(bpe));
    inner.with_pre_tokenizer(Some(bpe_pre_tokenizer(spec.regexes)?));
    inner.with_decoder(Some(ByteLevel::default()));
    Ok((inner, spec.add_bos))
}

/// Each token text's id; with duplicate texts the first id wins.
fn first_ids(tokens: &[&str]) -> Vocab {
    let mut vocab = Vocab::default();
    for (id, t) in tokens.iter().enumerate() {
        vocab.entry((*t).to_string()).or_insert(id as u32);
    }
    vocab
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = "llama"`: Llama
/// 2, Mistral v0.1, Gemma, Phi-3) as the `tokenizers` crate's BPE, the way
/// transformers converts one: spaces become '▁' (and one is put first when
/// `tokenizer.ggml.add_space_prefix`, llama.cpp's default), merges are every
/// split of a token into two tokens, ranked by the merged token's score
/// (SentencePiece merges the best-scoring adjacent pair first), and
/// characters outside the vocabulary fall back to byte tokens `<0xXX>`.
fn sentencepiece_model(metadata: &Metadata, tokens: &[&str]) -> Result<Pipeline, TokenizerError> {
    const SCORES: &str = "tokenizer.ggml.scores";
    let scores = gguf_array(metadata, SCORES)?
        .ok_or_else(|| TokenizerError::MissingKey(SCORES.to_string()))?;
    if scores.len() != tokens.len() {
        return Err(malformed(
            SCORES,
            format!("{} scores for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let scores: Vec<f32> = scores
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            GgufValue::F32(f) => Ok(*f),
            GgufValue::F64(f) => Ok(*f as f32),
            _ => Err(malformed(SCORES, format!("element {i} is not a float"))),
        })
        .collect::<Result<_, _>>()?;
    let vocab = first_ids(tokens);
    let bpe = BpeBuilder::new()
        .vocab_and_merges(vocab.clone(), sentencepiece_merges(tokens, &scores, &vocab))
        .byte_fallback(true)
        .build()
        .map_err(build_err)?;
    let mut inner = Pipeline::new(SharedModel::new(bpe));
    let space =
        tokenizers::normalizers::replace::Replace::new(" ", "\u{2581}").map_err(build_err)?;
    let add_space_prefix = gguf_bool(metadata, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    if add_space_prefix {
        let prefix = tokenizers::normalizers::prepend::Prepend::new("\u{2581}".to_string());
        inner
            .with_normalizer(Some(tokenizers::normalizers::Sequence::new(vec![
                prefix.into(),
                space.into(),
            ])))
            .map_err(build_err)?;
    } else {
        inner.with_normalizer(Some(space)).map_err(build_err)?;
    }
    Ok(inner)
}

/// transformers' merges for a SentencePiece vocabulary: for each token, in
/// order of its score (best first, ties in id order), each split into two
/// tokens, the splits ordered by their parts' ids.
fn sentencepiece_merges(tokens: &[&str], scores: &[f32], vocab: &Vocab) -> Merges {
    let mut by_score: Vec<usize> = (0..tokens.len()).collect();
    by_score.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let mut merges = Merges::new();
    for id in by_score {
        let text = tokens[id];
        let mut splits: Vec<(u32, u32, usize)> = text
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = text.split_at(at);
                Some((*vocab.get(left)?, *vocab.get(right)?, at))
            })
            .collect();
        splits.sort_unstable();
        merges.extend(splits.into_iter().map(|(_, _, at)| {
            let (left, right) = text.split_at(at);
            (left.to_string(), right.to_string())
        }));
    }
    merges
}

/// Whether a GGUF vocabulary is SentencePiece BPE (`llama`) rather than
/// byte-level BPE (`gpt2`); others are refused, saying why.
fn gguf_is_sentencepiece(metadata: &HashMap<String, GgufValue>) -> Result<bool, TokenizerError> {
    const MODEL: &str = "tokenizer.ggml.model";
    let model =
        gguf_str(metadata, MODEL)?.ok_or_else(|| TokenizerError::MissingKey(MODEL.to_string()))?;
    match model {
        "gpt2" => Ok(false),
        "llama" => Ok(true),
        "bert" | "t5" | "rwkv" => {
            Err(TokenizerError::UnsupportedModel {
                model: model.to_string(),
                reason: "only byte-level BPE (`gpt2`) and SentencePiece BPE (`llama`) GGUF vocabularies are supported"
                    .to_string(),
            })
        }
        "none" | "no_vocab" => {
            Err(TokenizerError::UnsupportedModel {
                model: model.to_string(),
                reason: "the model file carries no vocabulary".to_string(),
            })
        }
        other => {
            Err(TokenizerError::UnsupportedModel {
                model: other.to_string(),
                reason: "unknown GGUF tokenizer model; only byte-level BPE (`gpt2`) and SentencePiece BPE (`llama`) are supported".to_string(),
            })
        }
    }
}

/// Each token's kind from `tokenizer.ggml.token_type` (all normal without it).
fn gguf_token_kinds(
    metadata: &HashMap<String, GgufValue>,
    n_vocab: usize,
) -> Result<Vec<TokenKind>, TokenizerError> {
    const TYPES: &str = "tokenizer.ggml.token_type";
    Ok(match gguf_array(metadata, TYPES)? {
        None => vec![TokenKind::Normal; n_vocab],
        Some(types) => {
            if types.len() != n_vocab {
                return Err(malformed(
                    TYPES,
                    format!("{} entries for {n_vocab} tokens", types.len()),
                ));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let t = gguf_int(v).ok_or_else(|| {
                        malformed(TYPES, format!("element {i} is not an integer"))
                    })?;
                    Ok(match t {
                        2 | 3 => TokenKind::Control,
                        4 => TokenKind::UserDefined,
                        5 => TokenKind::Unused,
                        6 => TokenKind::Byte,
                        // 1 normal, and unknown values: ordinary entries.
                        _ => TokenKind::Normal,
                    })
                })
                .collect::<Result<_, TokenizerError>>()?
        }
    })
}

/// Each token's bytes, as llama.cpp's `token_to_piece(special = false)`
/// gives them.
fn gguf_token_bytes(tokens: &[&str], kinds: &[TokenKind], sentencepiece: bool) -> Vec<Vec<u8>> {
    let map = char_to_byte_map();
    tokens
        .iter()
        .zip(kinds)
        .map(|(t, k)| match k {
            TokenKind::Control | TokenKind::Unused => Vec::new(),
            TokenKind::UserDefined => t.as_bytes().to_vec(),
            TokenKind::Byte => byte_token(t).map_or_else(|| t.as_bytes().to_vec(), |b| vec![b]),
            // SentencePiece: '▁' stands for a space.
            TokenKind::Normal if sentencepiece => t.replace('\u{2581}', " ").into_bytes(),
            TokenKind::Normal => {
                let mut out = Vec::with_capacity(t.len());
                byte_level_decode(t, &map, &mut out);
                out
            }
        })
        .collect()
}

/// Each token's text and kind in a Hugging Face tokenizer (added tokens:
/// control when special, else user-defined).
fn hf_vocabulary(inner: &Pipeline) -> (Vec<String>, Vec<TokenKind>) {
    let vocab = inner.get_vocab(true);
    let n_vocab = vocab
        .values()
        .max()
        .map(|m| *m as usize + 1)
        .unwrap_or(0)
        .max(inner.get_vocab_size(true));
    let mut texts = vec![String::new(); n_vocab];
    for (t, id) in &vocab {
        texts[*id as usize] = t.clone();
    }
    let mut kinds = vec![TokenKind::Normal; n_vocab];
    for (id, added) in inner.get_added_tokens_decoder() {
        if let Some(k) = kinds.get_mut(id as usize) {
            *k = if added.special {
                TokenKind::Control
            } else {
                TokenKind::UserDefined
            };
        }
        if let Some(t) = texts.get_mut(id as usize) {
            *t = added.content.clone();
        }
    }
    (texts, kinds)
}

/// Each token's bytes: byte-level decoded, or SentencePiece's (byte
/// fallback, '▁' for a space).
fn hf_token_bytes(texts: &[String], kinds: &[TokenKind], byte_level: bool) -> Vec<Vec<u8>> {
    let map = char_to_byte_map();
    texts
        .iter()
        .zip(kinds)
        .map(|(t, k)| match k {
            TokenKind::Control | TokenKind::Unused => Vec::new(),
            TokenKind::UserDefined => t.as_bytes().to_vec(),
            TokenKind::Byte | TokenKind::Normal => {
                if byte_level {
                    let mut out = Vec::with_capacity(t.len());
                    byte_level_decode(t, &map, &mut out);
                    out
                } else if let Some(b) = byte_token(t) {
                    // SentencePiece byte fallback.
                    vec![b]
                } else {
                    // SentencePiece-style: '▁' stands for a space.
                    t.replace('\u{2581}', " ").into_bytes()
                }
            }
        })
        .collect()
}

/// The chat template from `tokenizer_config.json`, else from
/// `chat_template.jinja` beside it.
fn hf_chat_template(
    configured: Option<&serde_json::Value>,
    dir: &Path,
) -> Result<Option<String>, TokenizerError> {
    Ok(match configured.and_then(chat_template_from_config) {
        Some(t) => Some(t),
        None => {
            let p = dir.join("chat_template.jinja");
            if p.is_file() {
                Some(read_file(&p)?)
            } else {
                None
            }
        }
    })
}

/// A copy of `inner` that reads control tokens written in text as plain
/// text (a clone shares the model; only the added tokens' matchers copy).
fn plain_copy(inner: &Pipeline) -> Pipeline {
    let mut plain = inner.clone();
    plain.set_encode_special_tokens(true);
    plain
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata (the map from
    /// `candle_core::quantized::gguf_file::Content::metadata`).
    ///
    /// Reads `tokenizer.ggml.{model, pre, tokens, token_type, merges,
    /// scores, add_space_prefix, bos_token_id, eos_token_id, eot_token_id,
    /// eom_token_id, add_bos_token}` and `tokenizer.chat_template`.
    /// Byte-level BPE (`model = "gpt2"`) and SentencePiece BPE (`"llama"`)
    /// are supported.
    pub fn from_gguf(metadata: &HashMap<String, GgufValue>) -> Result<Self, TokenizerError> {
        let sentencepiece = gguf_is_sentencepiece(metadata)?;

        const TOKENS: &str = "tokenizer.ggml.tokens";
        let tokens = gguf_str_array(metadata, TOKENS)?
            .ok_or_else(|| TokenizerError::MissingKey(TOKENS.to_string()))?;
        if tokens.is_empty() {
            return Err(malformed(TOKENS, "the token list is empty"));
        }
        let n_vocab = tokens.len();

        let kinds = gguf_token_kinds(metadata, n_vocab)?;

        let bos = gguf_token_id(metadata, "tokenizer.ggml.bos_token_id", n_vocab)?;
        let eos = gguf_token_id(metadata, "tokenizer.ggml.eos_token_id", n_vocab)?;
        let eot = gguf_token_id(metadata, "tokenizer.ggml.eot_token_id", n_vocab)?;
        let eom = gguf_token_id(metadata, "tokenizer.ggml.eom_token_id", n_vocab)?;
        let chat_template = gguf_str(metadata, "tokenizer.chat_template")?.map(str::to_string);
        let (mut inner, default_add_bos) = if sentencepiece {
            // llama.cpp adds BOS to SentencePiece vocabularies by default.
            (sentencepiece_model(metadata, &tokens)?, true)
        } else {
            byte_level_model(metadata, &tokens)?
        };
        let add_bos =
            gguf_bool(metadata, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&kinds)
            .filter_map(|(t, k)| match k {
                TokenKind::Control => Some(AddedToken::from(*t, true)),
                TokenKind::UserDefined => Some(AddedToken::from(*t, false).normalized(false)),
                _ => None,
            })
            .collect();
        inner.add_tokens(added).map_err(build_err)?;
        if add_bos {
            if let Some(b) = bos {
                set_bos_post_processor(&mut inner, tokens[b as usize], b);
            }
        }

        let per_token = gguf_token_bytes(&tokens, &kinds, sentencepiece);
        let (bytes, offsets) = flatten_bytes(per_token);

        let texts: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        let first_id: HashMap<&str, u32> = {
            let mut m = HashMap::with_capacity(n_vocab);
            for (id, t) in tokens.iter().enumerate() {
                m.entry(*t).or_insert(id as u32);
            }
            m
        };
        let eog = collect_eog([eos, eot, eom].into_iter().flatten(), &kinds, |t| {
            first_id.get(t).copied()
        });

        Ok(Self {
            inner_plain: plain_copy(&inner),
            inner,
            // Every token's bytes are known: decode by concatenating them.
            byte_level: true,
            kinds,
            texts,
            bytes,
            offsets,
            bos,
            add_bos,
            eog,
            chat_template,
        })
    }

    /// Builds the tokenizer from a Hugging Face model folder.
    ///
    /// Needs `tokenizer.json`. Uses, when present: `tokenizer_config.json`
    /// (`bos_token`, `eos_token`, `add_bos_token`, `chat_template`),
    /// `chat_template.jinja` (when the config has no template) and
    /// `generation_config.json` (`eos_token_id` as an int or a list,
    /// `bos_token_id`). Without `add_bos_token`, BOS is added when the
    /// tokenizer's post-processor adds it.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(TokenizerError::MissingFile(tok_path));
        }
        let tok_text = read_file(&tok_path)?;
        let invalid = |reason: String| TokenizerError::InvalidFile {
            path: tok_path.clone(),
            reason,
        };
        let tok_json: serde_json::Value =
            serde_json::from_str(&tok_text).map_err(|e| invalid(e.to_string()))?;
        let inner: Pipeline =
            serde_json::from_str(&tok_text).map_err(|e| invalid(e.to_string()))?;
        let byte_level = decoder_is_byte_level(tok_json.get("decoder"));

        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_opt(&config_path)?;
        let gen_config = read_json_opt(&dir.join("generation_config.json"))?;

        let (texts, kinds) = hf_vocabulary(&inner);
        let n_vocab = texts.len();
        let per_token = hf_token_bytes(&texts, &kinds, byte_level);
        let (bytes, offsets) = flatten_bytes(per_token);

        // Special ids.
        let cfg_get = |key: &str| config.as_ref().and_then(|c| c.get(key));
        let gen_get = |key: &str| gen_config.as_ref().and_then(|c| c.get(key));
        let id_of = |v: &serde_json::Value| token_content(v).and_then(|t| inner.token_to_id(t));
        let bos = match cfg_get("bos_token") {
            Some(v) if !v.is_null() => id_of(v),
            Some(_) => None,
            None => gen_get("bos_token_id")
                .and_then(|v| v.as_u64())
                .map(|v| v as u32),
        };
        let mut declared_eos: Vec<u32> = Vec::new();
        if let Some(id) = cfg_get("eos_token").and_then(id_of) {
            declared_eos.push(id);
        }
        match gen_get("eos_token_id") {
            Some(serde_json::Value::Array(ids)) => {
                declared_eos.extend(ids.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
            }
            Some(v) => declared_eos.extend(v.as_u64().map(|v| v as u32)),
            None => {}
        }
        declared_eos.retain(|id| (*id as usize) < n_vocab);
        let eog = collect_eog(declared_eos, &kinds, |t| inner.token_to_id(t));

        let add_bos = match cfg_get("add_bos_token").and_then(|v| v.as_bool()) {
            Some(b) => b,
            None => match bos {
                Some(b) => inner
                    .encode_fast("a", true)
                    .map(|e| e.get_ids().first() == Some(&b))
                    .unwrap_or(false),
                None => false,
            },
        };

        let chat_template = hf_chat_template(cfg_get("chat_template"), dir)?;

        Ok(Self {
            inner_plain: plain_copy(&inner),
            inner,
            byte_level,
            kinds,
            texts,
            bytes,
            offsets,
            bos,
            add_bos,
            eog,
            chat_template,
        })
    }

    /// Tokenizes `text`, adding BOS first only when the model asks for it
    /// ([`Tokenizer::add_bos`]); same as `tokenize(text, true, parse_special)`.
    ///
    /// With `parse_special`, control tokens written in the text (e.g.
    /// `<|im_start|>`) become their ids; without it they are tokenized as
    /// plain text. User-defined tokens are always matched whole.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tokenize(text, true, parse_special)
    }

    /// A rendered chat template's tokens (control tokens parsed). A
    /// template that writes `bos_token` (Llama 3, Mistral, Gemma) has put
    /// BOS there already, so BOS is added only where the model wants one
    /// and the text lacks it: one BOS, as llama.cpp and transformers'
    /// `apply_chat_template` give, never two.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_parts(&[(rendered, true)])
    }

    /// [`Tokenizer::encode_chat`] of a rendered template in parts, each
    /// with its own `parse_special`: the parts a message wrote that spell
    /// control tokens stay text.
    pub fn encode_chat_parts(&self, parts: &[(&str, bool)]) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        for &(text, parse_special) in parts {
            ids.extend(self.tokenize(text, false, parse_special)?);
        }
        if let Some(bos) = self.bos.filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Where `text` spells control tokens (those [`Tokenizer::encode`]
    /// with `parse_special` would make of it): each one's byte range, in
    /// order.
    pub fn control_spans(&self, text: &str) -> Result<Vec<std::ops::Range<usize>>, TokenizerError> {
        let ids = self.tokenize(text, false, true)?;
        let mut spelled: Vec<&str> = ids
            .iter()
            .filter(|&&id| self.is_control(id))
            .filter_map(|&id| self.token_text(id))
            .filter(|t| !t.is_empty())
            .collect();
        spelled.sort_unstable();
        spelled.dedup();
        let mut spans = Vec::new();
        let mut at = 0;
        while let Some(rest) = text.get(at..) {
            // The leftmost, then longest, of the spelled tokens.
            let next = spelled
                .iter()
                .filter_map(|t| rest.find(t).map(|i| (at + i, t.len())))
                .min_by_key(|&(start, len)| (start, std::cmp::Reverse(len)));
            let Some((start, len)) = next else { break };
            spans.push(start..start + len);
            at = start + len;
        }
        Ok(spans)
    }

    /// llama.cpp's `llama_tokenize(text, add_special, parse_special)`:
    /// `add_special` adds BOS when the model's `add_bos` says so (pass
    /// `false` for text that already starts with it, e.g. a rendered chat
    /// template that writes `bos_token`).
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let tok = if parse_special {
            &self.inner
        } else {
            &self.inner_plain
        };
        let enc = tok
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`. Control tokens are left out when `skip_special`,
    /// otherwise written as their text. Invalid UTF-8 (a sequence cut inside
    /// a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        for &id in ids {
            self.check_id(id)?;
        }
        if !self.byte_level {
            return self
                .inner
                .decode(ids, skip_special)
                .map_err(|e| TokenizerError::Decode(e.to_string()));
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if self.is_control(id) {
                if !skip_special {
                    out.extend_from_slice(self.texts[id as usize].as_bytes());
                }
            } else {
                out.extend_from_slice(self.token_bytes(id));
            }
        }
        Ok(match String::from_utf8(out) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    fn check_id(&self, id: u32) -> Result<(), TokenizerError> {
        if (id as usize) < self.kinds.len() {
            Ok(())
        } else {
            Err(TokenizerError::InvalidTokenId {
                id,
                vocab_size: self.kinds.len(),
            })
        }
    }

    /// Raw bytes of one token for streaming: byte-level decoded, possibly a
    /// partial UTF-8 character; empty for control and unused tokens and for
    /// ids outside the vocabulary. Precomputed: O(1), no allocation.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Whether `id` is a control (special) token.
    pub fn is_control(&self, id: u32) -> bool {
        self.kinds.get(id as usize) == Some(&TokenKind::Control)
    }

    /// Number of token ids (the largest id plus one).
    pub fn vocab_size(&self) -> usize {
        self.kinds.len()
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether [`Tokenizer::encode`] prepends BOS (GGUF
    /// `tokenizer.ggml.add_bos_token`, else llama.cpp's default for the
    /// pre-tokenizer; HF `add_bos_token`, else the post-processor).
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// End-of-generation ids, sorted: the declared eos id (GGUF
    /// `tokenizer.ggml.eos_token_id`; HF `eos_token` and every
    /// `generation_config.json` `eos_token_id`), GGUF `eot_token_id` and
    /// `eom_token_id`, and the tokens named `<|im_end|>`, `<|eot_id|>`,
    /// `<|eom_id|>`, `<|end_of_text|>`, `<|endoftext|>`, `<|end|>`,
    /// `<end_of_turn>`, `<EOT>`, `</s>` when they exist and are control tokens.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether `id` ends generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The id of a vocabulary entry or added token, by its exact text
    /// (byte-level alphabet for normal tokens, e.g. `"Ġthe"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of a token as the vocabulary stores it (e.g. `"<|im_start|>"`, `"Ġthe"`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The model's Jinja chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// An equivalent `tokenizer.json` (so a GGUF vocabulary can be written
    /// out as a Hugging Face folder). The BOS rule and chat template are not
    /// part of it: they belong in `tokenizer_config.json`.
    pub fn to_tokenizer_json(&self) -> Result<String, TokenizerError> {
        self.inner.to_string(false).map_err(build_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    const GOLDEN: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/llamacpp-smollm2-135m-q4_1.json"
    );

    fn model_path() -> PathBuf {
        tessera_testkit::default_model_path()
    }

    fn metadata() -> &'static Metadata {
        static MD: OnceLock<Metadata> = OnceLock::new();
        MD.get_or_init(|| {
            let path = model_path();
            let mut file = std::fs::File::open(&path).unwrap_or_else(|e| {
                panic!(
                    "test model {} is missing ({e}); run scripts/fetch-model (or set TESSERA_TEST_MODEL)",
                    path.display()
                )
            });
            candle_core::quantized::gguf_file::Content::read(&mut file)
                .unwrap_or_else(|e| panic!("cannot read GGUF {}: {e}", path.display()))
                .metadata
        })
    }

    fn tok() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| Tokenizer::from_gguf(metadata()).expect("tokenizer from GGUF"))
    }

    fn golden() -> &'static serde_json::Value {
        static G: OnceLock<serde_json::Value> = OnceLock::new();
        G.get_or_init(|| {
            let text = std::fs::read_to_string(GOLDEN)
                .unwrap_or_else(|e| panic!("golden file {GOLDEN}: {e}"));
            serde_json::from_str(&text).expect("golden JSON")
        })
    }

    fn ids(v: &serde_json::Value) -> Vec<u32> {
        v.as_array()
            .expect("id array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    }

    fn chats() -> &'static [serde_json::Value] {
        golden()["chats"].as_array().expect("chats")
    }

    #[test]
    fn golden_prompts_encode_exactly() {
        assert_eq!(chats().len(), 6);
        for chat in chats() {
            let prompt = chat["prompt"].as_str().unwrap();
            assert_eq!(
                tok().encode(prompt, true).unwrap(),
                ids(&chat["prompt_token_ids"]),
                "prompt {prompt:?}"
            );
        }
    }

    #[test]
    fn raw_prompt_ids_without_bos() {
        let raw = &golden()["raw_prompt"];
        let prompt = raw["prompt"].as_str().unwrap();
        assert_eq!(prompt, "The quick brown fox");
        let got = tok().encode(prompt, true).unwrap();
        assert_eq!(got, ids(&raw["prompt_token_ids"]));
        assert_eq!(got, vec![504, 2365, 6354, 16438]);
        assert!(!tok().add_bos());
        assert_eq!(tok().tokenize(prompt, true, false).unwrap(), got);
    }

    #[test]
    fn generated_ids_decode_to_generated_text() {
        for chat in chats() {
            let gen = ids(&chat["generated_token_ids"]);
            let text = chat["generated_text"].as_str().unwrap();
            assert_eq!(tok().decode(&gen, true).unwrap(), text);
            // token_bytes over the same ids, control tokens dropped, gives the same text.
            let bytes: Vec<u8> = gen
                .iter()
                .flat_map(|&id| tok().token_bytes(id))
                .copied()
                .collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), text);
        }
    }

    #[test]
    fn metadata_ids_and_kinds() {
        let t = tok();
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.bos_id(), Some(1));
        assert!(!t.add_bos());
        assert_eq!(t.eog_ids(), &[0, 2]);
        assert!(t.is_eog(2) && t.is_eog(0) && !t.is_eog(1));
        assert_eq!(t.token_id("<|im_start|>"), Some(1));
        assert_eq!(t.token_id("<|im_end|>"), Some(2));
        assert_eq!(t.token_text(1), Some("<|im_start|>"));
        assert!(t.is_control(1) && t.is_control(16) && !t.is_control(17));
        assert!(t.token_bytes(1).is_empty());
        assert_eq!(t.token_bytes(t.token_id("Ġthe").unwrap()), b" the");
        assert!(t.token_bytes(u32::MAX).is_empty());
        assert!(t.chat_template().unwrap().contains("<|im_start|>"));
        assert_eq!(
            t.chat_template().unwrap(),
            golden()["chat_template"].as_str().unwrap()
        );
    }

    #[test]
    fn special_tokens_parsed_only_when_asked() {
        let t = tok();
        assert_eq!(t.encode("<|im_start|>user", true).unwrap(), vec![1, 4093]);
        let plain = t.encode("<|im_start|>user", false).unwrap();
        assert!(!plain.contains(&1), "{plain:?}");
        assert!(plain.len() > 2);
        assert_eq!(t.decode(&plain, true).unwrap(), "<|im_start|>user");
    }

    #[test]
    fn decode_special_tokens_without_extra_spaces() {
        let t = tok();
        let ids = t.encode("<|im_start|>user\nHi<|im_end|>\n", true).unwrap();
        assert_eq!(
            t.decode(&ids, false).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
        assert_eq!(t.decode(&ids, true).unwrap(), "user\nHi\n");
        assert!(matches!(
            t.decode(&[49152], true),
            Err(TokenizerError::InvalidTokenId { id: 49152, .. })
        ));
    }

    const SAMPLES: &[&str] = &[
        "Привет, 世界! 🎉 café",
        "The quick brown fox",
        "  leading spaces and trailing  ",
        "tabs\tand\nnewlines\r\n\n",
        "naïve façade — “quotes” ‘single’ … 😀👍🏽",
        "x = [1, 22, 333]; y = 4.5e-6",
        "I'm sure you'll see they've done it",
        "",
    ];

    #[test]
    fn non_ascii_round_trips() {
        for s in SAMPLES {
            let ids = tok().encode(s, true).unwrap();
            assert_eq!(&tok().decode(&ids, true).unwrap(), s);
            assert_eq!(&tok().decode(&ids, false).unwrap(), s);
        }
    }

    #[test]
    fn token_bytes_concatenate_to_utf8() {
        for s in SAMPLES {
            let ids = tok().encode(s, false).unwrap();
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| tok().token_bytes(id))
                .copied()
                .collect();
            assert_eq!(bytes, s.as_bytes(), "{s:?}");
        }
        // An emoji is split across tokens whose bytes are partial UTF-8.
        let ids = tok().encode("🎉", false).unwrap();
        assert!(ids.len() > 1);
        assert!(std::str::from_utf8(tok().token_bytes(ids[0])).is_err());
    }

    #[test]
    fn digits_are_split_individually() {
        let t = tok();
        let ids = t.encode("12345", true).unwrap();
        assert_eq!(ids.len(), 5);
        for (id, d) in ids.iter().zip(["1", "2", "3", "4", "5"]) {
            assert_eq!(t.token_bytes(*id), d.as_bytes());
        }
        // " 12" → a space token, then one token per digit (golden: 216, 33, 34).
        assert_eq!(t.encode(" 12", true).unwrap(), vec![216, 33, 34]);
    }

    #[test]
    fn hf_folder_round_trip_gives_identical_ids() {
        let t = tok();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            t.to_tokenizer_json().unwrap(),
        )
        .unwrap();
        let config = serde_json::json!({
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "add_bos_token": false,
            "chat_template": t.chat_template().unwrap(),
        });
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            serde_json::to_string_pretty(&config).unwrap(),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"bos_token_id": 1, "eos_token_id": [2]}"#,
        )
        .unwrap();
        let hf = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(hf.vocab_size(), t.vocab_size());
        assert_eq!(hf.bos_id(), Some(1));
        assert!(!hf.add_bos());
        assert_eq!(hf.eog_ids(), t.eog_ids());
        assert_eq!(hf.chat_template(), t.chat_template());
        let raw = golden()["raw_prompt"]["prompt"].as_str().unwrap();
        let mut prompts: Vec<&str> = chats()
            .iter()
            .map(|c| c["prompt"].as_str().unwrap())
            .collect();
        prompts.push(raw);
        prompts.extend_from_slice(SAMPLES);
        for p in prompts {
            let ids = t.encode(p, true).unwrap();
            assert_eq!(hf.encode(p, true).unwrap(), ids, "{p:?}");
            assert_eq!(hf.encode(p, false).unwrap(), t.encode(p, false).unwrap());
            assert_eq!(
                hf.decode(&ids, false).unwrap(),
                t.decode(&ids, false).unwrap()
            );
        }
        for id in 0..t.vocab_size() as u32 {
            assert_eq!(hf.token_bytes(id), t.token_bytes(id), "token {id}");
            assert_eq!(hf.is_control(id), t.is_control(id), "token {id}");
        }
    }

    #[test]
    fn hf_folder_without_add_bos_uses_the_post_processor() {
        // A model whose GGUF asks for BOS: the exported tokenizer.json carries it.
        let mut md = metadata().clone();
        md.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true));
        let t = Tokenizer::from_gguf(&md).unwrap();
        assert!(t.add_bos());
        assert_eq!(t.encode("The quick", true).unwrap()[0], 1);
        assert_eq!(
            t.tokenize("The quick", false, true).unwrap(),
            vec![504, 2365]
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            t.to_tokenizer_json().unwrap(),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ messages }}").unwrap();
        let hf = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert!(hf.add_bos());
        assert_eq!(hf.encode("The quick", true).unwrap(), vec![1, 504, 2365]);
        assert_eq!(hf.chat_template(), Some("{{ messages }}"));
    }

    #[test]
    fn missing_or_malformed_metadata_is_named() {
        for key in [
            "tokenizer.ggml.model",
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
        ] {
            let mut md = metadata().clone();
            md.remove(key);
            let err = Tokenizer::from_gguf(&md).unwrap_err();
            assert!(
                matches!(&err, TokenizerError::MissingKey(k) if k == key),
                "{err}"
            );
            assert!(err.to_string().contains(key), "{err}");
        }
        let mut md = metadata().clone();
        md.insert("tokenizer.ggml.tokens".into(), GgufValue::U32(3));
        let err = Tokenizer::from_gguf(&md).unwrap_err();
        assert!(
            matches!(err, TokenizerError::MalformedKey { ref key, .. } if key == "tokenizer.ggml.tokens"),
            "{err}"
        );
        let mut md = metadata().clone();
        md.insert(
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(vec![GgufValue::I32(1)]),
        );
        let err = Tokenizer::from_gguf(&md).unwrap_err();
        assert!(
            err.to_string().contains("tokenizer.ggml.token_type"),
            "{err}"
        );
        let mut md = metadata().clone();
        md.insert(
            "tokenizer.ggml.eos_token_id".into(),
            GgufValue::U32(1_000_000),
        );
        let err = Tokenizer::from_gguf(&md).unwrap_err();
        assert!(
            err.to_string().contains("tokenizer.ggml.eos_token_id"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_model_and_unknown_pre_tokenizer() {
        let mut md = metadata().clone();
        md.insert(
            "tokenizer.ggml.model".into(),
            GgufValue::String("bert".into()),
        );
        let err = Tokenizer::from_gguf(&md).unwrap_err();
        assert!(matches!(err, TokenizerError::UnsupportedModel { .. }));
        let msg = err.to_string();
        assert!(msg.contains("bert") && msg.contains("gpt2"), "{msg}");
        // A SentencePiece vocabulary needs its scores.
        md.insert(
            "tokenizer.ggml.model".into(),
            GgufValue::String("llama".into()),
        );
        let err = Tokenizer::from_gguf(&md).unwrap_err();
        assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");

        let mut md = metadata().clone();
        md.insert(
            "tokenizer.ggml.pre".into(),
            GgufValue::String("klingon".into()),
        );
        let err = Tokenizer::from_gguf(&md).unwrap_err();
        assert!(matches!(&err, TokenizerError::UnknownPreTokenizer(n) if n == "klingon"));
        assert!(err.to_string().contains("klingon"));
    }

    #[test]
    fn every_known_pre_tokenizer_compiles() {
        for name in PRE_TOKENIZER_NAMES {
            let spec = pre_tokenizer_spec(name).unwrap_or_else(|| panic!("no spec for {name}"));
            bpe_pre_tokenizer(spec.regexes).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        // Without tokenizer.ggml.add_bos_token, llama.cpp's default for the name applies.
        let mut md = metadata().clone();
        md.remove("tokenizer.ggml.add_bos_token");
        md.insert(
            "tokenizer.ggml.pre".into(),
            GgufValue::String("llama-bpe".into()),
        );
        assert!(Tokenizer::from_gguf(&md).unwrap().add_bos());
        md.insert(
            "tokenizer.ggml.pre".into(),
            GgufValue::String("smollm".into()),
        );
        assert!(!Tokenizer::from_gguf(&md).unwrap().add_bos());
        // A missing pre-tokenizer name means llama.cpp's "default".
        md.remove("tokenizer.ggml.pre");
        let t = Tokenizer::from_gguf(&md).unwrap();
        assert_eq!(
            t.encode("The quick brown fox", true).unwrap(),
            vec![504, 2365, 6354, 16438]
        );
    }

    #[test]
    fn empty_hf_dir_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::MissingFile(_)));
        let msg = err.to_string();
        assert!(msg.contains("tokenizer.json"), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");

        std::fs::write(dir.path().join("tokenizer.json"), "{ not json").unwrap();
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::InvalidFile { .. }));
        assert!(err.to_string().contains("tokenizer.json"));
    }
}
