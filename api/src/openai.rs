//! OpenAI Chat Completions: the request as clients send it, checked and
//! turned into `TextGenerationParams`; answers and stream chunks in
//! OpenAI's exact shapes. Pure functions, tested without a server.

pub mod handlers;

use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::error::ApiError;
use super::extras::{nothing, Extras, Refused};

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    /// tessera's own options (`speculative: false`), see
    /// [`extension`](super::extension).
    #[serde(default)]
    pub tessera: Option<super::extension::RequestExtension>,
    pub messages: Vec<InMessage>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// The sampling fields, shared with the legacy Completions.
    #[serde(flatten)]
    pub sampling: Sampling,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Every other field: not applicable, or refused ([`EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// The sampling fields OpenAI's Chat Completions and Completions share
/// (with the `top_k`, `min_p` and `repetition_penalty` other servers take).
#[derive(Debug, Default, Deserialize)]
pub struct Sampling {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u32>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

impl Sampling {
    /// OpenAI's documented ranges (the engine's own limits are checked at
    /// the end, by `valid::checked`).
    pub fn check(&self) -> Result<(), ApiError> {
        range("temperature", self.temperature, 0.0, 2.0)?;
        range("top_p", self.top_p, 0.0, 1.0)?;
        range("min_p", self.min_p, 0.0, 1.0)?;
        range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        range("repetition_penalty", self.repetition_penalty, 0.01, 10.0)
    }

    /// The wire's sampling parameters: these, with the request's limit,
    /// stops and logprobs (`top_logprobs` counts only with `logprobs`).
    pub fn wire(
        &self,
        max_tokens: Option<u32>,
        stop: Vec<String>,
        (logprobs, top_logprobs): (bool, u32),
    ) -> Result<v1::SamplingParams, ApiError> {
        Ok(v1::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_tokens,
            stop,
            stop_token_ids: Vec::new(),
            logprobs,
            top_logprobs: if logprobs { top_logprobs } else { 0 },
            logit_bias: crate::constraint::logit_bias(self.logit_bias.as_ref())?,
            default_temperature: Some(OPENAI_TEMPERATURE),
            penalty_window: None,
        })
    }
}

/// Chat Completions fields beyond those mapped.
const EXTRAS: Extras = Extras {
    not_applicable: &[
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    ],
    refused: &[
        Refused {
            name: "modalities",
            why: "text is the only output",
            neutral: text_only,
        },
        Refused {
            name: "audio",
            why: "text is the only output",
            neutral: nothing,
        },
        Refused {
            name: "prediction",
            why: "predicted outputs are not implemented (tessera.speculative drafts on its own)",
            neutral: nothing,
        },
        Refused {
            name: "web_search_options",
            why: "there is no web search",
            neutral: nothing,
        },
        Refused {
            name: "reasoning_effort",
            why: "reasoning effort is not mapped to the models' thinking switches",
            neutral: nothing,
        },
        Refused {
            name: "verbosity",
            why: "verbosity is not mapped",
            neutral: nothing,
        },
        Refused {
            name: "functions",
            why: "use `tools`",
            neutral: nothing,
        },
        Refused {
            name: "function_call",
            why: "use `tool_choice`",
            neutral: nothing,
        },
    ],
};

/// `["text"]`, or nothing.
fn text_only(value: &Value) -> bool {
    nothing(value) || value == &serde_json::json!(["text"])
}

#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// tessera's own: chunks telling how far the prompt is processed (no
    /// choices, a `tessera.prefill_progress` object), for a long prompt's
    /// wait. A client that does not ask never sees them.
    #[serde(default)]
    pub include_progress: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct InMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<InToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub reasoning_content: Option<String>,
    /// An earlier assistant turn's refusal: its text, as the content.
    #[serde(default)]
    pub refusal: Option<String>,
    /// Every other field: not applicable, or refused ([`MESSAGE_EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// A message's fields beyond those mapped.
const MESSAGE_EXTRAS: Extras = Extras {
    // An earlier answer's citations: they change nothing the model reads.
    not_applicable: &["annotations"],
    refused: &[
        Refused {
            name: "audio",
            why: "audio is not supported (text only)",
            neutral: nothing,
        },
        Refused {
            name: "function_call",
            why: "the deprecated function call; send `tool_calls`",
            neutral: nothing,
        },
    ],
};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    /// Every other field of a part (a text part has none).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct InToolCall {
    #[serde(default)]
    pub id: Option<String>,
    pub function: InFunction,
}

#[derive(Debug, Deserialize)]
pub struct InFunction {
    pub name: String,
    /// JSON text, as OpenAI sends it (an object is accepted too).
    pub arguments: Value,
}

/// OpenAI's documented temperature, for a request that sets none on a
/// model that recommends none (Anthropic's is the same).
pub const OPENAI_TEMPERATURE: f32 = 1.0;

/// Stop strings a request may give.
const MAX_STOPS: usize = 16;

fn range(param: &str, value: Option<f32>, low: f32, high: f32) -> Result<(), ApiError> {
    match value {
        Some(v) if !(low..=high).contains(&v) => Err(ApiError::invalid(
            param,
            format!("{param} must be between {low} and {high}, got {v}"),
        )),
        _ => Ok(()),
    }
}

fn content_text(content: Option<&Content>, index: usize) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(text)) => Ok(text.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (at, part) in parts.iter().enumerate() {
                if part.kind == "text" {
                    let path = format!("messages[{index}].content[{at}]");
                    crate::extras::NONE.check_in(&part.other, &path)?;
                }
                match (part.kind.as_str(), &part.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid(
                            &format!("messages[{index}].content"),
                            "a text part needs `text`",
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::invalid(
                            &format!("messages[{index}].content"),
                            format!(
                                "content parts of type {other:?} are not supported (text only)"
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

impl ChatRequest {
    /// Whether the answer streams, and what the stream carries besides.
    pub fn streaming(&self) -> (bool, StreamOptions) {
        let stream = self.stream.unwrap_or(false);
        (stream, self.stream_options.unwrap_or_default())
    }

    /// The generation this request asks for; `context` is the model's
    /// context length (0: unknown).
    pub fn to_params(&self, context: u32) -> Result<v1::TextGenerationParams, ApiError> {
        self.check_fields()?;
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        crate::valid::token_limit("max_tokens", max_tokens, context)?;
        let stop = self.stops()?;
        let messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(index, m)| chat_message(index, m))
            .collect::<Result<Vec<_>, _>>()?;
        let tools_json = self.tools_json()?;
        let logprobs = self.logprobs.unwrap_or(false);
        let constraint = crate::constraint::with_extension(
            crate::constraint::response_format(self.response_format.as_ref(), "response_format")?,
            self.tessera.as_ref(),
        )?;
        crate::valid::checked(
            v1::TextGenerationParams {
                model_id: self.model.clone(),
                messages,
                raw_prompt: None,
                prompt_token_ids: Vec::new(),
                count_only: false,
                embedding: None,
                tools_json,
                sampling: Some(self.sampling.wire(
                    max_tokens,
                    stop,
                    (logprobs, self.top_logprobs.unwrap_or(0)),
                )?),
                enable_thinking: None,
                speculative: super::extension::speculative(self.tessera.as_ref()),
                tool_choice: crate::constraint::one_call(
                    crate::constraint::openai_tool_choice(self.tool_choice.as_ref())?,
                    self.parallel_tool_calls == Some(false),
                ),
                constraint,
            },
            "",
            crate::constraint::param(self.tessera.as_ref(), "response_format"),
        )
    }
}

impl ChatRequest {
    /// The fields OpenAI bounds: a model, messages, one choice, and its
    /// documented ranges (the engine's own limits are checked at the end).
    fn check_fields(&self) -> Result<(), ApiError> {
        EXTRAS.check(&self.other)?;
        if self.model.trim().is_empty() {
            return Err(ApiError::invalid("model", "model must not be empty"));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        crate::choices::count(self.n)?;
        self.sampling.check()
    }

    /// The stop strings: at most [`MAX_STOPS`], none empty.
    fn stops(&self) -> Result<Vec<String>, ApiError> {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(list)) => list.clone(),
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOPS} stop strings"),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        Ok(stop)
    }

    /// The tools as JSON, unless `tool_choice` is `"none"`.
    fn tools_json(&self) -> Result<Vec<String>, ApiError> {
        let tools_wanted = !matches!(&self.tool_choice, Some(Value::String(s)) if s == "none");
        if !tools_wanted {
            return Ok(Vec::new());
        }
        self.tools
            .iter()
            .flatten()
            .map(|t| {
                if t.get("function").is_none() && t.get("name").is_none() {
                    Err(ApiError::invalid("tools", "each tool needs a function"))
                } else {
                    Ok(t.to_string())
                }
            })
            .collect()
    }
}

/// Message `index` on the wire: its role mapped, its tool calls' arguments
/// checked as JSON.
fn chat_message(index: usize, m: &InMessage) -> Result<v1::ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            return Err(ApiError::invalid(
                &format!("messages[{index}].role"),
                format!("unknown role {other:?} (system, user, assistant or tool)"),
            ))
        }
    };
    let mut tool_calls = Vec::new();
    for call in m.tool_calls.iter().flatten() {
        let arguments_json = match &call.function.arguments {
            Value::String(text) => {
                serde_json::from_str::<Value>(text).map_err(|e| {
                    ApiError::invalid(
                        &format!("messages[{index}].tool_calls"),
                        format!("arguments are not JSON: {e}"),
                    )
                })?;
                text.clone()
            }
            other => other.to_string(),
        };
        tool_calls.push(v1::ToolCall {
            id: call.id.clone().unwrap_or_default(),
            name: call.function.name.clone(),
            arguments_json,
        });
    }
    MESSAGE_EXTRAS.check_in(&m.other, &format!("messages[{index}]"))?;
    let mut content = content_text(m.content.as_ref(), index)?;
    if let Some(refusal) = m.refusal.as_ref().filter(|_| content.is_empty()) {
        content = refusal.clone();
    }
    Ok(v1::ChatMessage {
        role: role.to_string(),
        content,
        reasoning_content: m.reasoning_content.clone().unwrap_or_default(),
        tool_calls,
        tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
        name: m.name.clone().unwrap_or_default(),
    })
}

pub fn finish_reason(reason: i32) -> &'static str {
    match v1::FinishReason::try_from(reason) {
        Ok(v1::FinishReason::Length) => "length",
        Ok(v1::FinishReason::ToolCalls) => "tool_calls",
        _ => "stop",
    }
}

pub fn usage_json(usage: Option<&v1::Usage>) -> Value {
    let usage = usage.cloned().unwrap_or_default();
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "tessera": super::extension::usage_extension(&usage),
    })
}

/// The engine's own figures for an answer, under a `tessera` key that
/// OpenAI clients ignore (benchmarks subtract the engine's time to first
/// token from the one seen through HTTP).
pub fn stats_json(stats: Option<&v1::GenerationStats>) -> Value {
    let s = stats.cloned().unwrap_or_default();
    json!({
        "time_to_first_token_ms": s.time_to_first_token_ms,
        "prefill_tokens_per_second": s.prefill_tokens_per_second,
        "decode_tokens_per_second": s.decode_tokens_per_second,
    })
}

fn logprob_json(token: &v1::TokenChunk) -> Option<Value> {
    let logprob = token.logprob?;
    Some(json!({
        "token": token.text,
        "logprob": logprob,
        "bytes": token.text.as_bytes(),
        "top_logprobs": token.top_logprobs.iter().map(|t| json!({
            "token": t.text,
            "logprob": t.logprob,
            "bytes": t.text.as_bytes(),
        })).collect::<Vec<_>>(),
    }))
}

fn tool_call_json(call: &v1::ToolCall) -> Value {
    json!({
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    })
}

/// Gathers the chunks of a whole answer.
#[derive(Debug, Default)]
pub struct Answer {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<v1::ToolCall>,
    pub logprobs: Vec<Value>,
    pub finish: Option<v1::FinishChunk>,
}

impl Answer {
    pub fn push(&mut self, chunk: &generation_chunk::Kind) {
        match chunk {
            generation_chunk::Kind::Token(token) => {
                if token.reasoning {
                    self.reasoning.push_str(&token.text);
                } else {
                    self.content.push_str(&token.text);
                }
                self.logprobs.extend(logprob_json(token));
            }
            generation_chunk::Kind::ToolCall(call) => {
                self.tool_calls.extend(call.call.clone());
            }
            generation_chunk::Kind::Finish(finish) => self.finish = Some(*finish),
            _ => {}
        }
    }

    /// The `chat.completion` object.
    pub fn completion(&self, id: &str, model: &str, created: u64, logprobs: bool) -> Value {
        completion_of(std::slice::from_ref(self), id, model, created, logprobs)
    }

    /// This answer as choice `index`.
    fn choice_json(&self, index: usize, logprobs: bool) -> Value {
        let mut message = json!({"role": "assistant", "content": self.content});
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = json!(self.reasoning);
        }
        if !self.tool_calls.is_empty() {
            message["tool_calls"] = self.tool_calls.iter().map(tool_call_json).collect();
            // The newlines between calls are no answer.
            if self.content.trim().is_empty() {
                message["content"] = Value::Null;
            }
        }
        json!({
            "index": index,
            "message": message,
            "logprobs": if logprobs { json!({"content": self.logprobs}) } else { Value::Null },
            "finish_reason": finish_reason(self.finish.as_ref().map_or(0, |f| f.reason)),
        })
    }
}

/// The `chat.completion` object of one request's answers (`n` of them):
/// a choice each, the prompt counted once in the usage.
pub fn completion_of(
    answers: &[Answer],
    id: &str,
    model: &str,
    created: u64,
    logprobs: bool,
) -> Value {
    let usage = crate::choices::usage_of(answers.iter().map(|a| a.finish.as_ref()));
    let first = answers.first().and_then(|a| a.finish.as_ref());
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": answers
            .iter()
            .enumerate()
            .map(|(i, a)| a.choice_json(i, logprobs))
            .collect::<Vec<_>>(),
        "usage": usage_json(Some(&usage)),
        "tessera": stats_json(first.and_then(|f| f.stats.as_ref())),
    })
}

/// Builds the `chat.completion.chunk` objects of a stream.
pub struct ChunkWriter {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub options: StreamOptions,
    tool_calls: usize,
    /// The choice this writer's chunks belong to.
    index: usize,
    /// One of several choices: the usage comes after all of them.
    several: bool,
}

impl ChunkWriter {
    pub fn new(id: String, model: String, created: u64, options: StreamOptions) -> Self {
        Self {
            id,
            model,
            created,
            options,
            tool_calls: 0,
            index: 0,
            several: false,
        }
    }

    /// The writer of choice `index` among several, whose usage goes in
    /// one chunk after all of them ([`ChunkWriter::usage`]).
    pub fn of_choice(mut self, index: usize) -> Self {
        self.index = index;
        self.several = true;
        self
    }

    /// The last chunk of a stream of several choices, when the client
    /// asked for usage: all of theirs.
    pub fn usage(&self, finishes: &[v1::FinishChunk]) -> Option<Value> {
        if !self.options.include_usage {
            return None;
        }
        let mut last = self.choiceless(json!({
            "tessera": stats_json(finishes.first().and_then(|f| f.stats.as_ref())),
        }));
        last["usage"] = usage_json(Some(&crate::choices::usage_of(finishes.iter().map(Some))));
        Some(last)
    }

    fn chunk(&self, delta: Value, finish: Option<&str>, logprobs: Option<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": self.index,
                "delta": delta,
                "logprobs": logprobs.map(|l| json!({"content": [l]})),
                "finish_reason": finish,
            }],
        });
        if self.options.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// A chunk without choices (usage, progress), with `extra`'s keys.
    fn choiceless(&self, extra: Value) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
        });
        if let (Some(chunk), Value::Object(extra)) = (chunk.as_object_mut(), extra) {
            chunk.extend(extra);
        }
        chunk
    }

    /// The first chunk: the role.
    pub fn start(&self) -> Value {
        self.chunk(json!({"role": "assistant", "content": ""}), None, None)
    }

    /// The chunks one generation chunk becomes (none for progress).
    pub fn write(&mut self, chunk: &generation_chunk::Kind) -> Vec<Value> {
        match chunk {
            generation_chunk::Kind::Token(token) => {
                let logprobs = logprob_json(token);
                if token.text.is_empty() && logprobs.is_none() {
                    return Vec::new();
                }
                let delta = if token.reasoning {
                    json!({"reasoning_content": token.text})
                } else {
                    json!({"content": token.text})
                };
                vec![self.chunk(delta, None, logprobs)]
            }
            generation_chunk::Kind::ToolCall(call) => {
                let Some(call) = &call.call else {
                    return Vec::new();
                };
                let index = self.tool_calls;
                self.tool_calls += 1;
                let mut value = tool_call_json(call);
                value["index"] = json!(index);
                vec![self.chunk(json!({"tool_calls": [value]}), None, None)]
            }
            generation_chunk::Kind::Finish(finish) => {
                let mut out = vec![self.chunk(json!({}), Some(finish_reason(finish.reason)), None)];
                if self.options.include_usage && !self.several {
                    let mut last = self.choiceless(json!({
                        "tessera": stats_json(finish.stats.as_ref()),
                    }));
                    last["usage"] = usage_json(finish.usage.as_ref());
                    out.push(last);
                }
                out
            }
            generation_chunk::Kind::PrefillProgress(progress) if self.options.include_progress => {
                vec![self.choiceless(json!({
                    "tessera": {"prefill_progress": {
                        "processed_tokens": progress.processed_tokens,
                        "total_tokens": progress.total_tokens,
                    }},
                }))]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> Result<ChatRequest, serde_json::Error> {
        serde_json::from_value(body)
    }

    /// Several choices: each chunk names its choice, the usage comes once
    /// after all, the prompt counted once.
    #[test]
    fn several_choices_are_numbered_and_their_usage_is_one() {
        let options = StreamOptions {
            include_usage: true,
            ..Default::default()
        };
        let finish = |completion| v1::FinishChunk {
            usage: Some(v1::Usage {
                prompt_tokens: 5,
                completion_tokens: completion,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut second = ChunkWriter::new("c".into(), "m".into(), 1, options).of_choice(1);
        let chunks = second.write(&generation_chunk::Kind::Finish(finish(3)));
        assert_eq!(chunks.len(), 1, "no usage chunk of its own");
        assert_eq!(chunks[0]["choices"][0]["index"], 1);
        let last = second
            .usage(&[finish(2), finish(3)])
            .expect("usage asked for");
        assert_eq!(last["usage"]["prompt_tokens"], 5);
        assert_eq!(last["usage"]["completion_tokens"], 5);
        let answers = [
            Answer {
                finish: Some(finish(2)),
                ..Default::default()
            },
            Answer {
                finish: Some(finish(4)),
                ..Default::default()
            },
        ];
        let whole = completion_of(&answers, "c", "m", 1, false);
        assert_eq!(whole["choices"][1]["index"], 1);
        assert_eq!(whole["usage"]["prompt_tokens"], 5);
        assert_eq!(whole["usage"]["completion_tokens"], 6);
    }

    /// Fields of messages and parts are mapped, not applicable, or refused
    /// by their path.
    #[test]
    fn fields_inside_messages_are_never_dropped() -> Result<(), Box<dyn std::error::Error>> {
        let param = |message: Value| -> Result<Option<String>, Box<dyn std::error::Error>> {
            let r = request(json!({"model": "m", "messages": [message]}))?;
            Ok(r.to_params(0).err().and_then(|e| e.param))
        };
        let audio = json!({"role": "user", "content": "x", "audio": {"id": "a"}});
        assert_eq!(param(audio)?.as_deref(), Some("messages[0].audio"));
        let cited = json!({"role": "assistant", "content": "x", "annotations": [], "audio": null});
        assert_eq!(param(cited)?, None);
        let part = json!({"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]});
        assert_eq!(
            param(part)?.as_deref(),
            Some("messages[0].content[0].cache_control")
        );
        let refusal = request(json!({"model": "m", "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "refusal": "I can't."}
        ]}))?;
        assert_eq!(refusal.to_params(0)?.messages[1].content, "I can't.");
        Ok(())
    }

    #[test]
    fn a_request_becomes_generation_params() -> Result<(), Box<dyn std::error::Error>> {
        let r = request(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}
                ]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "stop": "END",
            "logprobs": true,
            "top_logprobs": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "stream": true,
            "stream_options": {"include_usage": true},
            "user": "not applicable: accepted"
        }))?;
        let (stream, options) = r.streaming();
        assert!(stream && options.include_usage && !options.include_progress);
        let p = r.to_params(8192)?;
        let unknown = request(
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                     "unknown_field": 1}),
        )?;
        let refused = unknown
            .to_params(8192)
            .expect_err("an unknown field is refused");
        assert_eq!(refused.param.as_deref(), Some("unknown_field"));
        assert_eq!(p.messages.len(), 4);
        assert_eq!(p.messages[0].role, "system");
        assert_eq!(p.messages[1].content, "Hi there");
        assert_eq!(p.messages[2].tool_calls[0].arguments_json, "{\"a\":1}");
        assert_eq!(p.messages[3].tool_call_id, "c1");
        let s = p.sampling.ok_or("sampling")?;
        assert_eq!(s.max_tokens, Some(7));
        assert_eq!(s.temperature, Some(0.0));
        assert_eq!(s.stop, vec!["END".to_string()]);
        assert!(s.logprobs);
        assert_eq!(s.top_logprobs, 2);
        assert_eq!(p.tools_json.len(), 1);
        Ok(())
    }

    #[test]
    fn the_tessera_object_opts_out_of_drafting_and_usage_carries_its_figures(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let plain: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "x"}]
        }))?;
        assert_eq!(plain.to_params(8192)?.speculative, None);
        let opted_out: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "tessera": {"speculative": false}
        }))?;
        assert_eq!(opted_out.to_params(8192)?.speculative, Some(false));
        let usage = usage_json(Some(&v1::Usage {
            completion_tokens: 10,
            draft_tokens: 8,
            accepted_draft_tokens: 6,
            decode_steps: 4,
            ..Default::default()
        }));
        assert_eq!(usage["completion_tokens"], 10);
        assert_eq!(usage["tessera"]["accepted_draft_tokens"], 6);
        assert_eq!(usage["tessera"]["decode_steps"], 4);
        Ok(())
    }

    #[test]
    fn bad_requests_are_refused_with_the_field_at_fault() {
        let cases = [
            (json!({"model": "m", "messages": []}), "messages"),
            (
                json!({"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}),
                "temperature",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17}),
                "n",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [""]}),
                "stop",
            ),
        ];
        for (body, param) in cases {
            let parsed = request(body.clone()).map_err(|e| e.to_string());
            let error = parsed
                .map(|r| r.to_params(8192))
                .map(|p| p.err().and_then(|e| e.param));
            assert_eq!(error, Ok(Some(param.to_string())), "{body}");
        }
        // Wrong types fail to parse at all (a 400 from the handler).
        assert!(request(json!({"model": "m", "messages": "hi"})).is_err());
        assert!(request(json!({"model": "m", "messages": [], "max_tokens": -1})).is_err());
        // tool_choice "none" drops the tools.
        let none = request(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none"
        }))
        .ok()
        .and_then(|r| r.to_params(0).ok());
        assert_eq!(none.map(|p| p.tools_json.len()), Some(0));
    }

    fn token(text: &str, reasoning: bool) -> generation_chunk::Kind {
        generation_chunk::Kind::Token(v1::TokenChunk {
            text: text.into(),
            reasoning,
            ..Default::default()
        })
    }

    fn finish(reason: v1::FinishReason) -> generation_chunk::Kind {
        generation_chunk::Kind::Finish(v1::FinishChunk {
            reason: reason as i32,
            usage: Some(v1::Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                ..Default::default()
            }),
            stats: None,
        })
    }

    #[test]
    fn answers_and_streams_take_openais_shapes() {
        let call = generation_chunk::Kind::ToolCall(v1::ToolCallChunk {
            call: Some(v1::ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments_json: "{\"city\":\"Paris\"}".into(),
            }),
        });
        let chunks = [
            token("Let me think.", true),
            token("Hello", false),
            token("", false),
            call.clone(),
            finish(v1::FinishReason::ToolCalls),
        ];
        let mut answer = Answer::default();
        for c in &chunks {
            answer.push(c);
        }
        let done = answer.completion("chatcmpl-1", "m", 7, false);
        assert_eq!(done["object"], "chat.completion");
        let message = &done["choices"][0]["message"];
        assert_eq!(message["content"], "Hello");
        assert_eq!(message["reasoning_content"], "Let me think.");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(done["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(done["usage"]["total_tokens"], 8);

        let mut writer = ChunkWriter::new(
            "chatcmpl-1".into(),
            "m".into(),
            7,
            StreamOptions {
                include_usage: true,
                include_progress: false,
            },
        );
        assert_eq!(writer.start()["choices"][0]["delta"]["role"], "assistant");
        let streamed: Vec<Value> = chunks.iter().flat_map(|c| writer.write(c)).collect();
        // The empty token writes nothing; the finish writes two chunks.
        assert_eq!(streamed.len(), 5);
        assert_eq!(
            streamed[0]["choices"][0]["delta"]["reasoning_content"],
            "Let me think."
        );
        assert_eq!(streamed[1]["choices"][0]["delta"]["content"], "Hello");
        assert_eq!(
            streamed[2]["choices"][0]["delta"]["tool_calls"][0]["index"],
            0
        );
        assert_eq!(streamed[3]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(streamed[4]["choices"], json!([]));
        assert_eq!(streamed[4]["usage"]["completion_tokens"], 3);
    }

    /// Prompt progress is written only for a client that asked for it.
    #[test]
    fn prefill_progress_is_opt_in() {
        let progress = generation_chunk::Kind::PrefillProgress(v1::PrefillProgressChunk {
            processed_tokens: 128,
            total_tokens: 900,
        });
        let writer = |include_progress| {
            let options = StreamOptions {
                include_usage: false,
                include_progress,
            };
            ChunkWriter::new("chatcmpl-1".into(), "m".into(), 7, options)
        };
        assert!(writer(false).write(&progress).is_empty());
        let written = writer(true).write(&progress);
        assert_eq!(written.len(), 1);
        assert_eq!(written[0]["choices"], json!([]));
        assert_eq!(written[0]["object"], "chat.completion.chunk");
        let shown = &written[0]["tessera"]["prefill_progress"];
        assert_eq!(shown["processed_tokens"], 128);
        assert_eq!(shown["total_tokens"], 900);
        assert!(written[0].get("usage").is_none());
    }
}
