//! A model loaded from a GGUF file or a Hugging Face folder: weights,
//! tokenizer, chat template, tool-call syntax.

use super::request::{Constraint, EngineError, GenerateRequest, Prompt, ToolChoice};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tessera_grammar::{GrammarError, Grammars, TokenMask, Vocabulary};

use crate::dist::shard::ShardSpec;
use crate::formats::gguf::GgufFile;
use crate::formats::hf_source::HfSource;
use crate::model::Transformer;
use crate::serve::sampler::SamplingDefaults;
use crate::text::chat_template::{ChatMessage, ChatTemplate, CHATML_TEMPLATE};
use crate::text::output_parser::OutputFormat;
use crate::text::tokenizer::Tokenizer;
use crate::text::tools;

/// A model loaded for single-machine generation.
pub struct LoadedModel {
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub output_format: OutputFormat,
    pub path: PathBuf,
    /// Sampling values the model's files recommend, for the fields a
    /// request leaves to the model.
    pub sampling_defaults: SamplingDefaults,
    /// Whether the chat template writes the tools it is given; when not,
    /// they go in a system instruction ([`crate::text::tools::instruction`]).
    pub renders_tools: bool,
    /// The grammar compiler over this vocabulary, built on the first
    /// constrained request.
    grammars: OnceLock<Result<Arc<Grammars>, String>>,
}

impl LoadedModel {
    /// Loads a GGUF file or a Hugging Face folder, reporting `(done, total)`.
    pub fn load(path: &Path, progress: impl FnMut(usize, usize)) -> Result<Self, EngineError> {
        Self::load_shard(path, None, progress)
    }

    /// Loads the tokenizer and template, and only the part of the weights
    /// `spec` names (`None`: all of them).
    pub fn load_shard(
        path: &Path,
        spec: Option<&ShardSpec>,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        if !path.exists() {
            return Err(EngineError::ModelNotFound(path.to_path_buf()));
        }
        let display = path.display().to_string();
        let tokenizer_error = |source| EngineError::Tokenizer {
            path: display.clone(),
            source,
        };
        let (transformer, tokenizer, sampling_defaults) = if path.is_dir() {
            let source = HfSource::open(path)?;
            let config = source.config()?;
            let spec = spec
                .cloned()
                .unwrap_or(ShardSpec::whole(config.layers as u32));
            let transformer = Transformer::load_shard(&source, config, &spec, progress)?;
            (
                transformer,
                Tokenizer::from_hf_dir(path).map_err(tokenizer_error)?,
                hf_sampling_defaults(path),
            )
        } else {
            let file = GgufFile::open(path)?;
            let config = file.config()?;
            let spec = spec
                .cloned()
                .unwrap_or(ShardSpec::whole(config.layers as u32));
            let tokenizer = Tokenizer::from_gguf(file.metadata()).map_err(tokenizer_error)?;
            let defaults = gguf_sampling_defaults(file.metadata());
            (
                Transformer::load_shard(&file, config, &spec, progress)?,
                tokenizer,
                defaults,
            )
        };
        let bos = tokenizer
            .bos_id()
            .and_then(|id| tokenizer.token_text(id).map(str::to_string))
            .unwrap_or_default();
        let eos = tokenizer
            .eog_ids()
            .first()
            .and_then(|id| tokenizer.token_text(*id).map(str::to_string))
            .unwrap_or_default();
        let source = tokenizer.chat_template().unwrap_or(CHATML_TEMPLATE);
        let template = ChatTemplate::new(source, &bos, &eos)
            .map_err(|e| EngineError::Template(e.to_string()))?;
        let output_format = output_format_for(&tokenizer);
        let renders_tools = template_renders_tools(&template);
        Ok(Self {
            transformer,
            tokenizer,
            template,
            output_format,
            path: path.to_path_buf(),
            sampling_defaults,
            renders_tools,
            grammars: OnceLock::new(),
        })
    }

    /// What constrains `request`'s output: its own constraint, or the
    /// grammar of its tools' `tool_choice` (with its constraint as the
    /// answer that is not a call, under `auto`).
    pub fn request_constraint(
        &self,
        request: &GenerateRequest,
    ) -> Result<Option<Constraint>, EngineError> {
        let tools = match &request.prompt {
            Prompt::Chat {
                tools: Some(tools), ..
            } => tools,
            _ => return Ok(request.constraint.clone()),
        };
        let functions = tools::functions(tools)?;
        let choice = &request.tool_choice;
        let answer = match &request.constraint {
            None => tools::Answer::Free,
            Some(Constraint::JsonSchema(schema)) => tools::Answer::Json(schema.clone()),
            Some(Constraint::JsonObject) => {
                tools::Answer::Json(serde_json::json!({"type": "object"}))
            }
            Some(Constraint::Regex(regex)) => tools::Answer::Regex(regex.clone()),
            Some(Constraint::Lark(_)) => {
                return Err(EngineError::ToolsWithGrammar(match choice {
                    ToolChoice::Auto => "auto",
                    _ => "required",
                }))
            }
        };
        let syntax = &self.output_format.tool_call;
        let calls = tools::Calls {
            choice,
            parallel: request.parallel_tool_calls,
        };
        let lark = tools::grammar(&functions, &calls, syntax, &answer, &self.tokenizer)?;
        Ok(Some(Constraint::Lark(lark)))
    }

    /// `constraint` compiled for one sequence of this model.
    pub fn constrain(
        &self,
        constraint: &crate::serve::Constraint,
    ) -> Result<TokenMask, GrammarError> {
        let grammars = self
            .grammars
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let built = Grammars::new(grammar_vocabulary(&self.tokenizer))
                    .map(Arc::new)
                    .map_err(|e| e.to_string());
                tracing::debug!(
                    seconds = started.elapsed().as_secs_f64(),
                    "grammar vocabulary built"
                );
                built
            })
            .as_ref()
            .map_err(|reason| GrammarError::Vocabulary(reason.clone()))?;
        grammars.compile(constraint)
    }

    /// Renders and tokenizes a prompt.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        let tokens = match prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Raw(text) => {
                if text.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                // A raw prompt is the model's own text: control tokens
                // written in it are control tokens (as llama.cpp and
                // transformers tokenize it).
                self.encode(text, true)?
            }
            Prompt::Chat { messages, tools } => {
                if messages.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                self.tokenize_chat(messages, tools.as_ref())?
            }
        };
        let vocab = self.tokenizer.vocab_size();
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::TokenBeyondVocabulary { id, vocab });
        }
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(tokens)
    }

    /// Messages rendered with the template, and tokenized so that what a
    /// message writes stays text: control tokens it spells are swapped for
    /// markers before the template renders, and tokenized as plain text
    /// where the markers land. A user cannot forge a turn.
    fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, EngineError> {
        let mut spelled: Vec<String> = Vec::new();
        let mut safe = messages.to_vec();
        for message in &mut safe {
            let spans = self
                .tokenizer
                .control_spans(&message.content)
                .map_err(|source| self.tokenizer_error(source))?;
            if !spans.is_empty() {
                message.content = with_markers(&message.content, &spans, &mut spelled);
            }
        }
        let text = match tools {
            Some(tools) if !self.renders_tools => {
                let instruction = tools::instruction(tools, &self.output_format.tool_call);
                self.template
                    .render(&with_instruction(&safe, &instruction), None, true, None)
            }
            _ => self.template.render(&safe, tools, true, None),
        }
        .map_err(|e| EngineError::Template(e.to_string()))?;
        if spelled.is_empty() {
            return self.encode_rendered(&text);
        }
        let parts = marked_parts(&text, &spelled);
        self.tokenizer
            .encode_chat_parts(&parts)
            .map_err(|source| self.tokenizer_error(source))
    }

    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, EngineError> {
        self.tokenizer
            .encode(text, parse_special)
            .map_err(|source| self.tokenizer_error(source))
    }

    fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer
            .encode_chat(text)
            .map_err(|source| self.tokenizer_error(source))
    }

    fn tokenizer_error(&self, source: crate::text::tokenizer::TokenizerError) -> EngineError {
        EngineError::Tokenizer {
            path: self.path.display().to_string(),
            source,
        }
    }
}

/// A Hugging Face folder's `generation_config.json`: its sampling values
/// when it samples (`do_sample: true`), greedy when it says
/// `do_sample: false`, nothing when it says neither (or is absent).
fn hf_sampling_defaults(dir: &Path) -> SamplingDefaults {
    let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else {
        return SamplingDefaults::default();
    };
    let Ok(config) = serde_json::from_str::<serde_json::Value>(&text) else {
        tracing::warn!(dir = %dir.display(), "generation_config.json is not JSON; its sampling values are not used");
        return SamplingDefaults::default();
    };
    let float = |key: &str| {
        config
            .get(key)
            .and_then(serde_json::Value::as_f64)
            .map(|v| v as f32)
    };
    match config.get("do_sample").and_then(serde_json::Value::as_bool) {
        Some(true) => SamplingDefaults {
            temperature: float("temperature"),
            top_p: float("top_p"),
            top_k: config
                .get("top_k")
                .and_then(serde_json::Value::as_u64)
                .and_then(|k| usize::try_from(k).ok()),
            min_p: float("min_p"),
            repetition_penalty: float("repetition_penalty"),
        },
        Some(false) => SamplingDefaults {
            temperature: Some(0.0),
            ..SamplingDefaults::default()
        },
        None => SamplingDefaults::default(),
    }
}

/// A GGUF's `general.sampling.*` (what llama.cpp's converter writes from
/// the model's generation config).
fn gguf_sampling_defaults(
    metadata: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
) -> SamplingDefaults {
    let float = |key: &str| metadata.get(key).and_then(|v| v.to_f32().ok());
    SamplingDefaults {
        temperature: float("general.sampling.temp"),
        top_p: float("general.sampling.top_p"),
        top_k: metadata
            .get("general.sampling.top_k")
            .and_then(|v| v.to_i32().ok())
            .and_then(|k| usize::try_from(k).ok()),
        min_p: float("general.sampling.min_p"),
        repetition_penalty: float("general.sampling.penalty_repeat"),
    }
}

/// Marks a spelled control token in message content: private-use
/// characters no template touches, around the token's index in `spelled`.
const MARK_OPEN: char = '\u{F8F0}';
const MARK_CLOSE: char = '\u{F8F1}';

/// `content` with each span replaced by a marker; the spans' texts are
/// pushed to `spelled`.
fn with_markers(
    content: &str,
    spans: &[std::ops::Range<usize>],
    spelled: &mut Vec<String>,
) -> String {
    let mut out = String::with_capacity(content.len());
    let mut at = 0;
    for span in spans {
        out.push_str(content.get(at..span.start).unwrap_or_default());
        out.push(MARK_OPEN);
        out.push_str(&spelled.len().to_string());
        out.push(MARK_CLOSE);
        spelled.push(content.get(span.clone()).unwrap_or_default().to_string());
        at = span.end;
    }
    out.push_str(content.get(at..).unwrap_or_default());
    out
}

/// The rendered `text` in parts: the template's own (control tokens
/// parsed) and, where a marker stands, the spelled text (as plain text).
fn marked_parts<'a>(text: &'a str, spelled: &'a [String]) -> Vec<(&'a str, bool)> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(MARK_OPEN) {
        let after = rest.get(open + MARK_OPEN.len_utf8()..).unwrap_or_default();
        let marked = after.find(MARK_CLOSE).and_then(|close| {
            let index = after.get(..close)?.parse::<usize>().ok()?;
            Some((close, spelled.get(index)?))
        });
        let Some((close, original)) = marked else {
            // Not one of ours: the text as it is.
            parts.push((
                rest.get(..open + MARK_OPEN.len_utf8()).unwrap_or_default(),
                true,
            ));
            rest = after;
            continue;
        };
        parts.push((rest.get(..open).unwrap_or_default(), true));
        parts.push((original.as_str(), false));
        rest = after
            .get(close + MARK_CLOSE.len_utf8()..)
            .unwrap_or_default();
    }
    parts.push((rest, true));
    parts
}

/// `messages` with `instruction` at the end of the system message (one is
/// put first when there is none).
fn with_instruction(messages: &[ChatMessage], instruction: &str) -> Vec<ChatMessage> {
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{instruction}", first.content);
        }
        _ => out.insert(0, ChatMessage::new("system", instruction)),
    }
    out
}

/// Whether `template` writes a tool it is given (rendered once, at load,
/// with a probe tool).
fn template_renders_tools(template: &ChatTemplate) -> bool {
    const PROBE: &str = "tessera_probe_function";
    let tools = serde_json::json!([{"type": "function", "function": {
        "name": PROBE, "description": "probe", "parameters": {"type": "object", "properties": {}}}}]);
    let messages = [ChatMessage::new("user", "hi")];
    template
        .render(&messages, Some(&tools), true, None)
        .is_ok_and(|text| text.contains(PROBE))
}

impl tools::TagTokens for Tokenizer {
    fn control_id(&self, tag: &str) -> Option<u32> {
        self.token_id(tag).filter(|&id| self.is_control(id))
    }
}

/// The vocabulary as the grammar sees it: each token's bytes, control
/// tokens by their text, and the end-of-generation tokens.
fn grammar_vocabulary(tokenizer: &Tokenizer) -> Vocabulary {
    let size = tokenizer.vocab_size();
    let ids = (0..size).map(|i| u32::try_from(i).unwrap_or(u32::MAX));
    let control: Vec<bool> = ids.clone().map(|id| tokenizer.is_control(id)).collect();
    let tokens = ids
        .map(|id| {
            if tokenizer.is_control(id) {
                tokenizer
                    .token_text(id)
                    .unwrap_or_default()
                    .as_bytes()
                    .to_vec()
            } else {
                tokenizer.token_bytes(id).to_vec()
            }
        })
        .collect();
    Vocabulary {
        tokens,
        control,
        end: tokenizer.eog_ids().to_vec(),
    }
}

/// Tool-call and thinking syntax, from the tokens the vocabulary has.
fn output_format_for(tokenizer: &Tokenizer) -> OutputFormat {
    if tokenizer.token_id("<|python_tag|>").is_some() || tokenizer.token_id("<|eom_id|>").is_some()
    {
        OutputFormat::llama3()
    } else if tokenizer.token_id("[TOOL_CALLS]").is_some() {
        OutputFormat::mistral()
    } else {
        // ChatML families (Qwen, SmolLM2, Hermes) use <tool_call> and <think>.
        OutputFormat::hermes()
    }
}

/// Loads only the weights of one shard (ranks other than 0 need no
/// tokenizer): layers for a pipeline stage, slices for a tensor rank.
pub fn load_transformer(
    path: &Path,
    spec: &ShardSpec,
    progress: impl FnMut(usize, usize),
) -> Result<Transformer, EngineError> {
    if !path.exists() {
        return Err(EngineError::ModelNotFound(path.to_path_buf()));
    }
    if path.is_dir() {
        let source = HfSource::open(path)?;
        let config = source.config()?;
        Ok(Transformer::load_shard(&source, config, spec, progress)?)
    } else {
        let file = GgufFile::open(path)?;
        let config = file.config()?;
        Ok(Transformer::load_shard(&file, config, spec, progress)?)
    }
}

/// The number of layers and KV heads of a model, read from its metadata
/// without loading weights (to plan shards).
pub fn model_config(path: &Path) -> Result<crate::model::ModelConfig, EngineError> {
    if !path.exists() {
        return Err(EngineError::ModelNotFound(path.to_path_buf()));
    }
    if path.is_dir() {
        Ok(HfSource::open(path)?.config()?)
    } else {
        Ok(GgufFile::open(path)?.config()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_sampling_values_are_read_when_the_model_samples() {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |text: &str| {
            std::fs::write(dir.path().join("generation_config.json"), text).expect("written")
        };
        assert_eq!(
            hf_sampling_defaults(dir.path()),
            SamplingDefaults::default()
        );
        write(
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [1, 2]}"#,
        );
        let sampled = hf_sampling_defaults(dir.path());
        assert_eq!(sampled.temperature, Some(0.6));
        assert_eq!(sampled.top_p, Some(0.9));
        assert_eq!(sampled.top_k, Some(20));
        assert_eq!(sampled.repetition_penalty, None);
        write(r#"{"do_sample": false, "temperature": 0.6}"#);
        assert_eq!(hf_sampling_defaults(dir.path()).temperature, Some(0.0));
        write(r#"{"temperature": 0.6}"#);
        assert_eq!(
            hf_sampling_defaults(dir.path()),
            SamplingDefaults::default()
        );
        write("not json");
        assert_eq!(
            hf_sampling_defaults(dir.path()),
            SamplingDefaults::default()
        );
    }
}
