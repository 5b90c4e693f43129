//! Ollama's API: `/api/chat` and `/api/generate` requests (with their
//! `options`) turned into `TextGenerationParams`, and the newline-delimited
//! JSON objects Ollama answers with. Pure functions, tested without a
//! server.

pub mod handlers;

use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::error::ApiError;
use super::extras::{nothing, Extras, Refused};

#[derive(Debug, Default, Deserialize)]
pub struct Options {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u32>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub num_predict: Option<i64>,
    #[serde(default)]
    pub stop: Option<Vec<String>>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub repeat_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub repeat_last_n: Option<i64>,
    /// Every other option, each mapped, refused or named not applicable by
    /// [`check_other_options`].
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Ollama's default temperature, for a request that sets none on a model
/// that recommends none.
pub const OLLAMA_TEMPERATURE: f32 = 0.8;

/// Options about how Ollama runs a model on one machine (threads, GPU
/// layers, memory mapping, its context window and prompt batch), which a
/// cluster decides for itself: accepted, and without effect (the README's
/// endpoint table says so). tessera pages the KV cache and takes the
/// model's whole context; a prompt beyond it is refused, never shifted.
const NOT_APPLICABLE: [&str; 12] = [
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "numa",
    "use_mmap",
    "use_mlock",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "num_keep",
];

/// Sampling options tessera does not implement, with the value at which
/// each is off (which is accepted).
const REFUSED_UNLESS_OFF: [(&str, f64); 5] = [
    ("typical_p", 1.0),
    ("tfs_z", 1.0),
    ("mirostat", 0.0),
    ("mirostat_tau", f64::NAN),
    ("mirostat_eta", f64::NAN),
];

/// The options not in [`Options`]' fields: those that change nothing here
/// pass, samplers tessera lacks are refused unless off, and unknown names
/// are refused.
fn check_other_options(other: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let mirostat_on = other
        .get("mirostat")
        .and_then(Value::as_f64)
        .is_some_and(|m| m != 0.0);
    for (name, value) in other {
        let param = format!("options.{name}");
        if NOT_APPLICABLE.contains(&name.as_str()) || value.is_null() {
            continue;
        }
        if name == "penalize_newline" {
            if value.as_bool() == Some(true) {
                return Err(ApiError::invalid(
                    &param,
                    "penalize_newline is not supported (set it false or leave it out)",
                ));
            }
            continue;
        }
        let Some(&(_, off)) = REFUSED_UNLESS_OFF.iter().find(|(n, _)| n == name) else {
            return Err(ApiError::invalid(
                &param,
                format!("unknown option {name:?}"),
            ));
        };
        // Mirostat's tau and eta only matter while it is on.
        let is_off = if off.is_nan() {
            !mirostat_on
        } else {
            value.as_f64() == Some(off)
        };
        if !is_off {
            return Err(ApiError::invalid(
                &param,
                format!("{name} is not supported; leave it out (or at its neutral value)"),
            ));
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    /// tessera's own options (`speculative: false`), see
    /// [`extension`](super::extension).
    #[serde(default)]
    pub tessera: Option<super::extension::RequestExtension>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub options: Option<Options>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub format: Option<Value>,
    /// Every other field: not applicable, or refused ([`CHAT_EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// `/api/chat` fields beyond those mapped.
const CHAT_EXTRAS: Extras = Extras {
    not_applicable: &["keep_alive"],
    refused: &[THINK],
};

/// `/api/generate` fields beyond those mapped.
const GENERATE_EXTRAS: Extras = Extras {
    not_applicable: &["keep_alive"],
    refused: &[
        THINK,
        Refused {
            name: "suffix",
            why: "fill-in-the-middle is not implemented",
            neutral: nothing,
        },
        Refused {
            name: "images",
            why: "images are not supported",
            neutral: nothing,
        },
        Refused {
            name: "template",
            why: "the model's own chat template is used (or `raw`)",
            neutral: nothing,
        },
        Refused {
            name: "context",
            why: "send the conversation to /api/chat instead",
            neutral: nothing,
        },
    ],
};

const THINK: Refused = Refused {
    name: "think",
    why: "the thinking switch is not mapped",
    neutral: nothing,
};

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// An earlier answer's thinking, as its reasoning.
    #[serde(default)]
    pub thinking: Option<String>,
    /// A tool message's tool.
    #[serde(default)]
    pub tool_name: Option<String>,
    /// Every other field: refused ([`MESSAGE_EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// A message's fields beyond those mapped.
const MESSAGE_EXTRAS: Extras = Extras {
    not_applicable: &[],
    refused: &[Refused {
        name: "images",
        why: "images are not supported (text only)",
        neutral: nothing,
    }],
};

#[derive(Debug, Deserialize)]
pub struct GenerateRequest {
    pub model: String,
    /// tessera's own options (`speculative: false`), see
    /// [`extension`](super::extension).
    #[serde(default)]
    pub tessera: Option<super::extension::RequestExtension>,
    #[serde(default)]
    pub prompt: String,
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default)]
    pub raw: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub options: Option<Options>,
    #[serde(default)]
    pub format: Option<Value>,
    /// Every other field: not applicable, or refused ([`GENERATE_EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

fn sampling(options: Option<&Options>, context: u32) -> Result<v1::SamplingParams, ApiError> {
    let default = Options::default();
    let o = options.unwrap_or(&default);
    check_other_options(&o.other)?;
    // Ollama: -1 makes the penalty window the whole context; 0 looks at no
    // token, which turns the penalties off.
    let penalties_off = o.repeat_last_n == Some(0);
    let penalty_window = match o.repeat_last_n {
        None => None,
        Some(-1) => Some(0),
        Some(n) if n < 0 => {
            return Err(ApiError::invalid(
                "options.repeat_last_n",
                format!("repeat_last_n must be -1 or at least 0, got {n}"),
            ))
        }
        Some(0) => None,
        Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
    };
    let penalty = |value: Option<f32>, off: f32| if penalties_off { Some(off) } else { value };
    // Ollama: -1 is "until the end", -2 "fill the context".
    let max_tokens = match o.num_predict {
        None => None,
        Some(n) if n < 0 => Some(context.max(1)),
        Some(n) => {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            crate::valid::token_limit("options.num_predict", Some(n), context)?;
            Some(n)
        }
    };
    if let Some(t) = o.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
        return Err(ApiError::invalid(
            "options.temperature",
            format!("temperature must be between 0 and 2, got {t}"),
        ));
    }
    Ok(v1::SamplingParams {
        temperature: o.temperature,
        top_p: o.top_p,
        top_k: o.top_k,
        min_p: o.min_p,
        repetition_penalty: penalty(o.repeat_penalty, 1.0),
        presence_penalty: penalty(o.presence_penalty, 0.0),
        frequency_penalty: penalty(o.frequency_penalty, 0.0),
        seed: o.seed,
        max_tokens,
        stop: o.stop.clone().unwrap_or_default(),
        default_temperature: Some(OLLAMA_TEMPERATURE),
        penalty_window,
        ..Default::default()
    })
}

impl ChatRequest {
    /// Ollama streams unless told not to.
    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(true)
    }

    pub fn to_params(&self, context: u32) -> Result<v1::TextGenerationParams, ApiError> {
        CHAT_EXTRAS.check(&self.other)?;
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (index, m) in self.messages.iter().enumerate() {
            if !["system", "user", "assistant", "tool"].contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    &format!("messages[{index}].role"),
                    format!("unknown role {:?}", m.role),
                ));
            }
            let tool_calls = m
                .tool_calls
                .iter()
                .flatten()
                .map(|call| v1::ToolCall {
                    id: String::new(),
                    name: call["function"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    arguments_json: call["function"]["arguments"].to_string(),
                })
                .collect();
            MESSAGE_EXTRAS.check_in(&m.other, &format!("messages[{index}]"))?;
            messages.push(v1::ChatMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                tool_calls,
                reasoning_content: m.thinking.clone().unwrap_or_default(),
                name: m.tool_name.clone().unwrap_or_default(),
                ..Default::default()
            });
        }
        crate::valid::checked(
            v1::TextGenerationParams {
                model_id: self.model.clone(),
                messages,
                raw_prompt: None,
                prompt_token_ids: Vec::new(),
                count_only: false,
                embedding: None,
                tools_json: self.tools.iter().flatten().map(Value::to_string).collect(),
                sampling: Some(sampling(self.options.as_ref(), context)?),
                enable_thinking: None,
                speculative: super::extension::speculative(self.tessera.as_ref()),
                tool_choice: None,
                constraint: crate::constraint::with_extension(
                    crate::constraint::ollama_format(self.format.as_ref())?,
                    self.tessera.as_ref(),
                )?,
            },
            "options.",
            crate::constraint::param(self.tessera.as_ref(), "format"),
        )
    }
}

impl GenerateRequest {
    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(true)
    }

    pub fn to_params(&self, context: u32) -> Result<v1::TextGenerationParams, ApiError> {
        GENERATE_EXTRAS.check(&self.other)?;
        if self.prompt.is_empty() {
            return Err(ApiError::invalid("prompt", "prompt must not be empty"));
        }
        let raw = self.raw.unwrap_or(false);
        let mut messages = Vec::new();
        if !raw {
            if let Some(system) = self.system.as_ref().filter(|s| !s.is_empty()) {
                messages.push(v1::ChatMessage {
                    role: "system".into(),
                    content: system.clone(),
                    ..Default::default()
                });
            }
            messages.push(v1::ChatMessage {
                role: "user".into(),
                content: self.prompt.clone(),
                ..Default::default()
            });
        }
        crate::valid::checked(
            v1::TextGenerationParams {
                model_id: self.model.clone(),
                messages,
                raw_prompt: raw.then(|| self.prompt.clone()),
                prompt_token_ids: Vec::new(),
                count_only: false,
                embedding: None,
                tools_json: Vec::new(),
                sampling: Some(sampling(self.options.as_ref(), context)?),
                enable_thinking: None,
                speculative: super::extension::speculative(self.tessera.as_ref()),
                tool_choice: None,
                constraint: crate::constraint::with_extension(
                    crate::constraint::ollama_format(self.format.as_ref())?,
                    self.tessera.as_ref(),
                )?,
            },
            "options.",
            crate::constraint::param(self.tessera.as_ref(), "format"),
        )
    }
}

/// Which endpoint's objects to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Chat,
    Generate,
}

/// Writes Ollama's objects for one answer.
pub struct LineWriter {
    shape: Shape,
    model: String,
    created_at: String,
    started: std::time::Instant,
    text: String,
    thinking: String,
    calls: Vec<Value>,
}

impl LineWriter {
    pub fn new(shape: Shape, model: String, created_at: String) -> Self {
        Self {
            shape,
            model,
            created_at,
            started: std::time::Instant::now(),
            text: String::new(),
            thinking: String::new(),
            calls: Vec::new(),
        }
    }

    fn object(&self, content: &str, thinking: &str, calls: &[Value], done: bool) -> Value {
        let mut object = json!({"model": self.model, "created_at": self.created_at, "done": done});
        match self.shape {
            Shape::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if !thinking.is_empty() {
                    message["thinking"] = json!(thinking);
                }
                if !calls.is_empty() {
                    message["tool_calls"] = json!(calls);
                }
                object["message"] = message;
            }
            Shape::Generate => {
                object["response"] = json!(content);
                if !thinking.is_empty() {
                    object["thinking"] = json!(thinking);
                }
            }
        }
        object
    }

    fn call_json(call: &v1::ToolCall) -> Value {
        let arguments: Value =
            serde_json::from_str(&call.arguments_json).unwrap_or_else(|_| json!({}));
        json!({"function": {"name": call.name, "arguments": arguments}})
    }

    /// A streamed object for one chunk (None for chunks that show nothing).
    pub fn stream(&mut self, chunk: &generation_chunk::Kind) -> Option<Value> {
        match chunk {
            generation_chunk::Kind::Token(t) if !t.text.is_empty() => Some(if t.reasoning {
                self.object("", &t.text, &[], false)
            } else {
                self.object(&t.text, "", &[], false)
            }),
            generation_chunk::Kind::ToolCall(c) => {
                let call = c.call.as_ref()?;
                Some(self.object("", "", &[Self::call_json(call)], false))
            }
            generation_chunk::Kind::Finish(f) => Some(self.done(f, "", "", &[])),
            _ => None,
        }
    }

    /// Gathers a chunk of a whole (not streamed) answer.
    pub fn gather(&mut self, chunk: &generation_chunk::Kind) -> Option<Value> {
        match chunk {
            generation_chunk::Kind::Token(t) if t.reasoning => self.thinking.push_str(&t.text),
            generation_chunk::Kind::Token(t) => self.text.push_str(&t.text),
            generation_chunk::Kind::ToolCall(c) => {
                if let Some(call) = &c.call {
                    self.calls.push(Self::call_json(call));
                }
            }
            generation_chunk::Kind::Finish(f) => {
                let (text, thinking, calls) =
                    (self.text.clone(), self.thinking.clone(), self.calls.clone());
                return Some(self.done(f, &text, &thinking, &calls));
            }
            _ => {}
        }
        None
    }

    fn done(&self, f: &v1::FinishChunk, text: &str, thinking: &str, calls: &[Value]) -> Value {
        let mut object = self.object(text, thinking, calls, true);
        let usage = f.usage.unwrap_or_default();
        let stats = f.stats.unwrap_or_default();
        let nanos = |seconds: f64| (seconds * 1e9) as u64;
        object["done_reason"] = json!(match v1::FinishReason::try_from(f.reason) {
            Ok(v1::FinishReason::Length) => "length",
            _ => "stop",
        });
        object["total_duration"] = json!(self.started.elapsed().as_nanos() as u64);
        object["prompt_eval_count"] = json!(usage.prompt_tokens);
        object["eval_count"] = json!(usage.completion_tokens);
        // Ollama has no usage object: tessera's figures at the top.
        object["tessera"] = json!({"usage": super::extension::usage_extension(&usage)});
        if stats.prefill_tokens_per_second > 0.0 {
            object["prompt_eval_duration"] = json!(nanos(
                f64::from(usage.prompt_tokens - usage.cached_tokens)
                    / stats.prefill_tokens_per_second
            ));
        }
        if stats.decode_tokens_per_second > 0.0 {
            object["eval_duration"] = json!(nanos(
                f64::from(usage.completion_tokens) / stats.decode_tokens_per_second
            ));
        }
        object
    }
}

/// An error as Ollama writes it.
pub fn error_body(error: &ApiError) -> Value {
    json!({"error": error.message})
}

/// A card's `details`, as `/api/tags`, `/api/show` and `/api/ps` give them.
pub fn details_json(card: &v1::ModelCard) -> Value {
    let format = match card.source.as_ref().map(|s| s.format) {
        Some(f) if f == v1::WeightFormat::Safetensors as i32 => "safetensors",
        _ => "gguf",
    };
    json!({
        "parent_model": card.base_model,
        "format": format,
        "family": card.family,
        "families": [card.family],
        "parameter_size": "",
        "quantization_level": card.quantization,
    })
}

/// What a model can be asked: tools for every text model (through its
/// template, or an instruction where the template has none), the card's
/// own tags (thinking, vision), embeddings for an embedding model.
pub fn capabilities(card: &v1::ModelCard) -> Vec<String> {
    let embeds = card.tasks.contains(&(v1::ModelTask::Embedding as i32));
    let mut out: Vec<String> = if embeds {
        vec!["embedding".into()]
    } else {
        vec!["completion".into(), "tools".into()]
    };
    for tag in &card.capabilities {
        if !out.contains(tag) {
            out.push(tag.clone());
        }
    }
    out
}

/// `/api/show`'s answer for `card`.
pub fn show_json(card: &v1::ModelCard) -> Value {
    let arch = card.family.as_str();
    let mut parameters = Vec::new();
    if let Some(d) = &card.sampling_defaults {
        parameters.extend(d.temperature.map(|t| format!("temperature {t}")));
        parameters.extend(d.top_p.map(|p| format!("top_p {p}")));
        parameters.extend(d.top_k.map(|k| format!("top_k {k}")));
        parameters.extend(d.min_p.map(|p| format!("min_p {p}")));
    }
    json!({
        "modelfile": format!("# served by tessera from its catalogue\nFROM {}\n", card.model_id),
        "parameters": parameters.join("\n"),
        "template": card.chat_template,
        "details": details_json(card),
        "model_info": {
            "general.architecture": arch,
            "general.basename": card.base_model,
            format!("{arch}.context_length"): card.context_length,
            format!("{arch}.block_count"): card.n_layers,
            format!("{arch}.embedding_length"): card.hidden_size,
            format!("{arch}.attention.head_count"): card.num_attention_heads,
            format!("{arch}.attention.head_count_kv"): card.num_key_value_heads,
        },
        "capabilities": capabilities(card),
        "modified_at": "1970-01-01T00:00:00Z",
    })
}

/// One `/api/ps` entry: a model with a ready instance (kept until it is
/// deleted, so no expiry).
pub fn running_json(card: &v1::ModelCard) -> Value {
    json!({
        "name": card.model_id,
        "model": card.model_id,
        "size": card.storage_size_bytes,
        "digest": "",
        "details": details_json(card),
        "expires_at": "9999-12-31T23:59:59Z",
        "size_vram": 0,
        "context_length": card.context_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message's images are refused, its thinking and tool name mapped.
    #[test]
    fn fields_inside_messages_are_never_dropped() -> Result<(), Box<dyn std::error::Error>> {
        let chat = |message: Value| -> Result<ChatRequest, serde_json::Error> {
            serde_json::from_value(serde_json::json!({"model": "m", "messages": [message]}))
        };
        let image = chat(serde_json::json!({"role": "user", "content": "x", "images": ["aGk="]}))?;
        let error = image.to_params(0).expect_err("refused");
        assert_eq!(error.param.as_deref(), Some("messages[0].images"));
        assert!(
            chat(serde_json::json!({"role": "user", "content": "x", "images": []}))?
                .to_params(0)
                .is_ok()
        );
        let mapped = chat(serde_json::json!(
            {"role": "tool", "content": "42", "tool_name": "f", "thinking": "hm"}
        ))?
        .to_params(0)?;
        assert_eq!(mapped.messages[0].name, "f");
        assert_eq!(mapped.messages[0].reasoning_content, "hm");
        let odd = chat(serde_json::json!({"role": "user", "content": "x", "colour": 1}))?;
        assert_eq!(
            odd.to_params(0).err().and_then(|e| e.param).as_deref(),
            Some("messages[0].colour")
        );
        Ok(())
    }

    #[test]
    fn chat_and_generate_requests_with_options() -> Result<(), Box<dyn std::error::Error>> {
        let chat: ChatRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0, "num_predict": 8, "stop": ["x"], "repeat_penalty": 1.1}
        }))?;
        assert!(chat.streaming(), "Ollama streams by default");
        let p = chat.to_params(8192)?;
        let s = p.sampling.ok_or("sampling")?;
        assert_eq!(s.max_tokens, Some(8));
        assert_eq!(s.repetition_penalty, Some(1.1));
        assert_eq!(s.stop, vec!["x".to_string()]);
        let generate: GenerateRequest = serde_json::from_value(json!({
            "model": "m", "prompt": "Once", "raw": true, "stream": false,
            "options": {"num_predict": -1}
        }))?;
        assert!(!generate.streaming());
        let p = generate.to_params(100)?;
        assert_eq!(p.raw_prompt.as_deref(), Some("Once"));
        assert_eq!(p.sampling.and_then(|s| s.max_tokens), Some(100));
        let empty: GenerateRequest = serde_json::from_value(json!({"model": "m"}))?;
        assert!(empty.to_params(0).is_err());
        assert_eq!(p.speculative, None, "no tessera object: unaffected");
        let opted_out: GenerateRequest = serde_json::from_value(json!({
            "model": "m", "prompt": "Once", "tessera": {"speculative": false}
        }))?;
        assert_eq!(opted_out.to_params(100)?.speculative, Some(false));
        let chat: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tessera": {"speculative": true}
        }))?;
        assert_eq!(chat.to_params(100)?.speculative, Some(true));
        Ok(())
    }

    fn options(options: Value) -> Result<v1::SamplingParams, ApiError> {
        let chat: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "options": options
        }))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
        chat.to_params(1000)?
            .sampling
            .ok_or_else(|| ApiError::bad_request("no sampling"))
    }

    #[test]
    fn every_option_is_mapped_refused_or_not_applicable_by_name() {
        let mapped = options(
            json!({"seed": 3, "top_k": 5, "min_p": 0.1, "repeat_last_n": 32,
                                    "presence_penalty": 0.5, "frequency_penalty": 0.2}),
        )
        .expect("accepted");
        assert_eq!(
            (mapped.seed, mapped.top_k, mapped.penalty_window),
            (Some(3), Some(5), Some(32))
        );
        assert_eq!(mapped.default_temperature, Some(OLLAMA_TEMPERATURE));
        assert_eq!(
            options(json!({"repeat_last_n": -1}))
                .expect("accepted")
                .penalty_window,
            Some(0)
        );
        let off = options(json!({"repeat_last_n": 0, "repeat_penalty": 1.3})).expect("accepted");
        assert_eq!(
            off.repetition_penalty,
            Some(1.0),
            "a window of no tokens penalises none"
        );
        // What a cluster decides for itself changes nothing, and passes.
        let machine = json!({"num_ctx": 4096, "num_gpu": 99, "num_thread": 8, "use_mmap": true,
                             "num_batch": 512, "main_gpu": 0, "num_keep": 4});
        assert!(options(machine).is_ok());
        // Samplers tessera lacks: refused unless off.
        assert!(options(
            json!({"mirostat": 0, "mirostat_tau": 5.0, "typical_p": 1.0, "tfs_z": 1.0})
        )
        .is_ok());
        for (refused, param) in [
            (json!({"mirostat": 2}), "options.mirostat"),
            (
                json!({"mirostat": 1, "mirostat_eta": 0.1}),
                "options.mirostat",
            ),
            (json!({"typical_p": 0.9}), "options.typical_p"),
            (
                json!({"penalize_newline": true}),
                "options.penalize_newline",
            ),
            (json!({"num_predcit": 5}), "options.num_predcit"),
            (json!({"repeat_last_n": -5}), "options.repeat_last_n"),
        ] {
            let error = options(refused.clone()).expect_err("refused");
            assert!(
                error
                    .param
                    .as_deref()
                    .is_some_and(|p| p.starts_with("options.")),
                "{refused}"
            );
            if refused.as_object().is_some_and(|o| o.len() == 1) {
                assert_eq!(error.param.as_deref(), Some(param), "{refused}");
            }
        }
    }

    #[test]
    fn show_describes_a_card_as_ollama_does() {
        let card = v1::ModelCard {
            model_id: "owner/m:Q4_K_M".into(),
            family: "llama".into(),
            quantization: "q4_k_m".into(),
            context_length: 8192,
            n_layers: 16,
            capabilities: vec!["thinking".into()],
            chat_template: "{{ messages }}".into(),
            sampling_defaults: Some(v1::SamplingDefaults {
                temperature: Some(0.6),
                ..Default::default()
            }),
            ..Default::default()
        };
        let shown = show_json(&card);
        assert_eq!(shown["model_info"]["llama.context_length"], 8192);
        assert_eq!(shown["template"], "{{ messages }}");
        assert_eq!(shown["parameters"], "temperature 0.6");
        assert_eq!(
            shown["capabilities"],
            json!(["completion", "tools", "thinking"])
        );
        assert_eq!(shown["details"]["quantization_level"], "q4_k_m");
        let embedder = v1::ModelCard {
            tasks: vec![v1::ModelTask::Embedding as i32],
            ..Default::default()
        };
        assert_eq!(capabilities(&embedder), vec!["embedding".to_string()]);
    }

    #[test]
    fn lines_take_ollamas_shape() {
        let token = generation_chunk::Kind::Token(v1::TokenChunk {
            text: "Hi".into(),
            ..Default::default()
        });
        let finish = generation_chunk::Kind::Finish(v1::FinishChunk {
            reason: v1::FinishReason::Length as i32,
            usage: Some(v1::Usage {
                prompt_tokens: 4,
                completion_tokens: 1,
                ..Default::default()
            }),
            stats: None,
        });
        let mut chat = LineWriter::new(Shape::Chat, "m".into(), "t".into());
        let line = chat.stream(&token);
        assert_eq!(
            line.map(|l| l["message"]["content"].clone()),
            Some(json!("Hi"))
        );
        let last = chat.stream(&finish).unwrap_or_default();
        assert_eq!(last["done"], true);
        assert_eq!(last["done_reason"], "length");
        assert_eq!(last["eval_count"], 1);
        let mut whole = LineWriter::new(Shape::Generate, "m".into(), "t".into());
        assert_eq!(whole.gather(&token), None);
        let answer = whole.gather(&finish).unwrap_or_default();
        assert_eq!(answer["response"], "Hi");
        assert_eq!(answer["prompt_eval_count"], 4);
    }
}
