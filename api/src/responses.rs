//! OpenAI Responses (`POST /v1/responses`): the request's `input` and
//! `instructions` turned into `TextGenerationParams`; the `response`
//! object and its stream of typed events. Stateless: `previous_response_id`
//! and `store` are refused or ignored. Pure functions, tested without a
//! server.

pub mod handlers;

use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::error::ApiError;
use super::extras::{nothing, Extras, Refused};

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    /// tessera's own options (`speculative: false`), see
    /// [`extension`](super::extension).
    #[serde(default)]
    pub tessera: Option<super::extension::RequestExtension>,
    pub input: Input,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {...}}`: structured output.
    #[serde(default)]
    pub text: Option<Value>,
    /// Every other field: not applicable, or refused ([`EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Responses fields beyond those mapped.
const EXTRAS: Extras = Extras {
    not_applicable: &[
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
    ],
    refused: &[
        Refused {
            name: "background",
            why: "responses are answered in the foreground",
            neutral: nothing,
        },
        Refused {
            name: "conversation",
            why: "responses are not stored; send the whole conversation in input",
            neutral: nothing,
        },
        Refused {
            name: "prompt",
            why: "stored prompts are not kept",
            neutral: nothing,
        },
        Refused {
            name: "reasoning",
            why: "reasoning settings are not mapped to the models' thinking switches",
            neutral: nothing,
        },
        Refused {
            name: "include",
            why: "there is nothing extra to include",
            neutral: nothing,
        },
        Refused {
            name: "max_tool_calls",
            why: "not implemented",
            neutral: nothing,
        },
        Refused {
            name: "top_logprobs",
            why: "logprobs are on Chat Completions",
            neutral: nothing,
        },
        Refused {
            name: "truncation",
            why: "a conversation beyond the context is refused, never cut",
            neutral: disabled,
        },
    ],
};

/// `"disabled"`, or nothing.
fn disabled(value: &Value) -> bool {
    nothing(value) || value == "disabled"
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// A content part's fields beyond `type` and `text`: an earlier answer's
/// annotations and logprobs change nothing the model reads.
const PART_EXTRAS: Extras = Extras {
    not_applicable: &["annotations", "logprobs"],
    refused: &[],
};

/// An input item's fields beyond those mapped: an earlier output's `id`
/// and `status` change nothing the model reads.
const ITEM_EXTRAS: Extras = Extras {
    not_applicable: &["id", "status"],
    refused: &[],
};

/// `object`'s fields other than `mapped`.
fn unmapped(object: &Value, mapped: &[&str]) -> serde_json::Map<String, Value> {
    object
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(key, _)| !mapped.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}

fn text_content(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (at, part) in parts.iter().enumerate() {
                match part["type"].as_str() {
                    Some("input_text" | "output_text" | "text") => {
                        PART_EXTRAS.check_in(
                            &unmapped(part, &["type", "text"]),
                            &format!("{param}[{at}]"),
                        )?;
                        text.push_str(part["text"].as_str().unwrap_or_default())
                    }
                    Some(other) => {
                        return Err(ApiError::invalid(
                            param,
                            format!(
                                "content parts of type {other:?} are not supported (text only)"
                            ),
                        ))
                    }
                    None => return Err(ApiError::invalid(param, "a content part needs a type")),
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::invalid(
            param,
            "content must be text or a list of parts",
        )),
    }
}

impl ResponsesRequest {
    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn to_params(&self, context: u32) -> Result<v1::TextGenerationParams, ApiError> {
        self.check_fields(context)?;
        let mut messages = Vec::new();
        if let Some(instructions) = self.instructions.as_ref().filter(|i| !i.is_empty()) {
            messages.push(v1::ChatMessage {
                role: "system".into(),
                content: instructions.clone(),
                ..Default::default()
            });
        }
        match &self.input {
            Input::Text(text) => {
                if text.is_empty() {
                    return Err(ApiError::invalid("input", "input must not be empty"));
                }
                messages.push(v1::ChatMessage {
                    role: "user".into(),
                    content: text.clone(),
                    ..Default::default()
                });
            }
            Input::Items(items) => {
                if items.is_empty() {
                    return Err(ApiError::invalid("input", "input must not be empty"));
                }
                for (index, item) in items.iter().enumerate() {
                    messages.push(input_item(index, item)?);
                }
            }
        }
        let tools_json = self.tools_json();
        let constraint = crate::constraint::with_extension(
            crate::constraint::text_format(self.text.as_ref())?,
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
                sampling: Some(v1::SamplingParams {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    max_tokens: self.max_output_tokens,
                    default_temperature: Some(super::openai::OPENAI_TEMPERATURE),
                    ..Default::default()
                }),
                enable_thinking: None,
                speculative: super::extension::speculative(self.tessera.as_ref()),
                tool_choice: crate::constraint::one_call(
                    crate::constraint::responses_tool_choice(self.tool_choice.as_ref())?,
                    self.parallel_tool_calls == Some(false),
                ),
                constraint,
            },
            "",
            crate::constraint::param(self.tessera.as_ref(), "text.format"),
        )
    }
}

impl ResponsesRequest {
    /// No stored conversation, a token limit within the context (0:
    /// unknown), and the documented temperature range.
    fn check_fields(&self, context: u32) -> Result<(), ApiError> {
        EXTRAS.check(&self.other)?;
        if self.previous_response_id.is_some() {
            return Err(ApiError::invalid(
                "previous_response_id",
                "responses are not stored; send the whole conversation in input",
            ));
        }
        crate::valid::token_limit("max_output_tokens", self.max_output_tokens, context)?;
        if let Some(t) = self.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be between 0 and 2, got {t}"),
            ));
        }
        Ok(())
    }

    /// The function tools in Chat Completions' nested shape (which the
    /// templates want), unless `tool_choice` is `"none"`.
    fn tools_json(&self) -> Vec<String> {
        let tools_wanted = !matches!(&self.tool_choice, Some(Value::String(s)) if s == "none");
        if !tools_wanted {
            return Vec::new();
        }
        self.tools
            .iter()
            .flatten()
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t.get("description").cloned().unwrap_or(json!("")),
                        "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"})),
                    }
                })
                .to_string()
            })
            .collect()
    }
}

/// Input item `index` as a wire message: a message, a function call (its
/// arguments checked as JSON) or a function call's output.
fn input_item(index: usize, item: &Value) -> Result<v1::ChatMessage, ApiError> {
    let param = format!("input[{index}]");
    let kind = item["type"].as_str().unwrap_or("message");
    let mapped: &[&str] = match kind {
        "message" => &["type", "role", "content"],
        "function_call" => &["type", "call_id", "name", "arguments"],
        "function_call_output" => &["type", "call_id", "output"],
        _ => &["type"],
    };
    ITEM_EXTRAS.check_in(&unmapped(item, mapped), &param)?;
    match kind {
        "message" => {
            let role = match item["role"].as_str() {
                Some("system" | "developer") => "system",
                Some("user") => "user",
                Some("assistant") => "assistant",
                other => {
                    return Err(ApiError::invalid(
                        &format!("{param}.role"),
                        format!("unknown role {other:?}"),
                    ))
                }
            };
            Ok(v1::ChatMessage {
                role: role.into(),
                content: text_content(&item["content"], &format!("{param}.content"))?,
                ..Default::default()
            })
        }
        "function_call" => {
            let call = v1::ToolCall {
                id: item["call_id"].as_str().unwrap_or_default().to_string(),
                name: item["name"].as_str().unwrap_or_default().to_string(),
                arguments_json: item["arguments"].as_str().unwrap_or("{}").to_string(),
            };
            serde_json::from_str::<Value>(&call.arguments_json).map_err(|e| {
                ApiError::invalid(
                    &format!("{param}.arguments"),
                    format!("arguments are not JSON: {e}"),
                )
            })?;
            Ok(v1::ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![call],
                ..Default::default()
            })
        }
        "function_call_output" => Ok(v1::ChatMessage {
            role: "tool".into(),
            content: match &item["output"] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            },
            tool_call_id: item["call_id"].as_str().unwrap_or_default().to_string(),
            ..Default::default()
        }),
        other => Err(ApiError::invalid(
            &format!("{param}.type"),
            format!("input items of type {other:?} are not supported"),
        )),
    }
}

fn usage_json(usage: Option<&v1::Usage>) -> Value {
    let u = usage.cloned().unwrap_or_default();
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "tessera": super::extension::usage_extension(&u),
    })
}

/// Builds a response and its stream events.
pub struct ResponseWriter {
    id: String,
    model: String,
    created_at: u64,
    sequence: u64,
    text: String,
    calls: Vec<v1::ToolCall>,
    /// The message item is open (its events were sent).
    message_open: bool,
}

impl ResponseWriter {
    pub fn new(id: String, model: String, created_at: u64) -> Self {
        Self {
            id,
            model,
            created_at,
            sequence: 0,
            text: String::new(),
            calls: Vec::new(),
            message_open: false,
        }
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.id.trim_start_matches("resp_"))
    }

    fn message_item(&self, status: &str) -> Value {
        json!({
            "type": "message",
            "id": self.message_id(),
            "status": status,
            "role": "assistant",
            "content": if status == "completed" {
                json!([{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}])
            } else {
                json!([])
            },
        })
    }

    fn call_item(&self, index: usize, call: &v1::ToolCall) -> Value {
        json!({
            "type": "function_call",
            "id": format!("fc_{}_{index}", self.id.trim_start_matches("resp_")),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments_json,
            "status": "completed",
        })
    }

    /// The `response` object, in progress or finished by `finish`.
    pub fn response(&self, finish: Option<&v1::FinishChunk>) -> Value {
        let mut output = Vec::new();
        if finish.is_some() {
            if !self.text.is_empty() || self.calls.is_empty() {
                output.push(self.message_item("completed"));
            }
            for (i, call) in self.calls.iter().enumerate() {
                output.push(self.call_item(i, call));
            }
        }
        let length = finish.is_some_and(|f| f.reason == v1::FinishReason::Length as i32);
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": match finish {
                None => "in_progress",
                Some(_) if length => "incomplete",
                Some(_) => "completed",
            },
            "incomplete_details": if length { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "model": self.model,
            "output": output,
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "tools": [],
            "error": null,
            "usage": if finish.is_some() { usage_json(finish.and_then(|f| f.usage.as_ref())) } else { Value::Null },
        })
    }

    fn event(&mut self, kind: &'static str, mut body: Value) -> (&'static str, Value) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        (kind, body)
    }

    pub fn start(&mut self) -> Vec<(&'static str, Value)> {
        let response = self.response(None);
        vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
        ]
    }

    fn open_message(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if self.message_open {
            return;
        }
        self.message_open = true;
        let item = self.message_item("in_progress");
        let id = self.message_id();
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        ));
        out.push(self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        ));
    }

    fn close_message(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if !self.message_open {
            return;
        }
        self.message_open = false;
        let id = self.message_id();
        let text = self.text.clone();
        out.push(self.event(
            "response.output_text.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
        ));
        out.push(self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}),
        ));
        let item = self.message_item("completed");
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        ));
    }

    /// Gathers a chunk; the stream events it becomes.
    pub fn write(&mut self, chunk: &generation_chunk::Kind) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        match chunk {
            generation_chunk::Kind::Token(t) if !t.reasoning && !t.text.is_empty() => {
                self.open_message(&mut out);
                self.text.push_str(&t.text);
                let id = self.message_id();
                out.push(self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": 0, "content_index": 0,
                           "delta": t.text, "logprobs": []}),
                ));
            }
            generation_chunk::Kind::ToolCall(c) => {
                if let Some(call) = &c.call {
                    let index = self.calls.len();
                    self.calls.push(call.clone());
                    let item = self.call_item(index, call);
                    let output_index = index + 1;
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": output_index, "item": item}),
                    ));
                    out.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": output_index, "item": item}),
                    ));
                }
            }
            generation_chunk::Kind::Finish(f) => {
                if self.calls.is_empty() {
                    self.open_message(&mut out);
                }
                self.close_message(&mut out);
                let response = self.response(Some(f));
                let kind = if response["status"] == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                out.push(self.event(kind, json!({"response": response})));
            }
            _ => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_inside_input_items_are_never_dropped() -> Result<(), Box<dyn std::error::Error>> {
        let param = |item: Value| -> Result<Option<String>, Box<dyn std::error::Error>> {
            let r: ResponsesRequest =
                serde_json::from_value(json!({"model": "m", "input": [item]}))?;
            Ok(r.to_params(0).err().and_then(|e| e.param))
        };
        let earlier = json!({"type": "message", "id": "msg_1", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": []}]});
        assert_eq!(param(earlier)?, None);
        let odd = json!({"role": "user", "content": "x", "colour": 1});
        assert_eq!(param(odd)?.as_deref(), Some("input[0].colour"));
        let part =
            json!({"role": "user", "content": [{"type": "input_text", "text": "x", "x": 1}]});
        assert_eq!(param(part)?.as_deref(), Some("input[0].content[0].x"));
        Ok(())
    }

    #[test]
    fn input_items_become_messages() -> Result<(), Box<dyn std::error::Error>> {
        let r: ResponsesRequest = serde_json::from_value(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
            ],
            "max_output_tokens": 9,
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}]
        }))?;
        let p = r.to_params(8192)?;
        let roles: Vec<&str> = p.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, vec!["system", "user", "assistant", "tool"]);
        assert_eq!(p.messages[3].tool_call_id, "c1");
        assert!(p.tools_json[0].contains("\"function\""));
        assert_eq!(p.sampling.and_then(|s| s.max_tokens), Some(9));
        let stored: ResponsesRequest = serde_json::from_value(json!({
            "model": "m", "input": "hi", "previous_response_id": "resp_1"
        }))?;
        assert!(stored.to_params(0).is_err());
        Ok(())
    }

    #[test]
    fn the_stream_opens_fills_and_completes_one_message() {
        let mut w = ResponseWriter::new("resp_1".into(), "m".into(), 5);
        let mut events = w.start();
        for text in ["Hel", "lo"] {
            events.extend(w.write(&generation_chunk::Kind::Token(v1::TokenChunk {
                text: text.into(),
                ..Default::default()
            })));
        }
        events.extend(w.write(&generation_chunk::Kind::Finish(v1::FinishChunk {
            reason: v1::FinishReason::Stop as i32,
            usage: Some(v1::Usage {
                prompt_tokens: 2,
                completion_tokens: 2,
                ..Default::default()
            }),
            stats: None,
        })));
        let names: Vec<&str> = events.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let (_, done) = &events[events.len() - 1];
        assert_eq!(done["response"]["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["response"]["status"], "completed");
        assert_eq!(done["response"]["usage"]["total_tokens"], 4);
        let sequence: Vec<u64> = events
            .iter()
            .filter_map(|(_, e)| e["sequence_number"].as_u64())
            .collect();
        assert_eq!(sequence, (0..10).collect::<Vec<_>>());
    }
}
