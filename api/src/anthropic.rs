//! Anthropic Messages: requests as Anthropic's clients send them, turned
//! into `TextGenerationParams`; answers, stream events and errors in
//! Anthropic's shapes. Pure functions, tested without a server.

pub mod handlers;

use serde::Deserialize;
use serde_json::{json, Map, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::error::ApiError;
use super::extras::{nothing, Extras, Refused};

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    /// tessera's own options (`speculative: false`), see
    /// [`extension`](super::extension).
    #[serde(default)]
    pub tessera: Option<super::extension::RequestExtension>,
    pub max_tokens: u32,
    pub messages: Vec<InMessage>,
    #[serde(default)]
    pub system: Option<System>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Every other field: not applicable, or refused ([`EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Messages fields beyond those mapped.
const EXTRAS: Extras = Extras {
    not_applicable: &["metadata", "service_tier"],
    refused: &[
        Refused {
            name: "thinking",
            why: "extended thinking is not mapped to the models' thinking switches",
            neutral: thinking_off,
        },
        Refused {
            name: "container",
            why: "there are no containers",
            neutral: nothing,
        },
        Refused {
            name: "mcp_servers",
            why: "MCP servers are not connected",
            neutral: nothing,
        },
        Refused {
            name: "context_management",
            why: "a conversation beyond the context is refused, never edited",
            neutral: nothing,
        },
    ],
};

/// `{"type": "disabled"}`, or nothing.
fn thinking_off(value: &Value) -> bool {
    nothing(value) || value.get("type").and_then(Value::as_str) == Some("disabled")
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum System {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
pub struct InMessage {
    pub role: String,
    pub content: Content,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Block {
    Text {
        text: String,
        #[serde(flatten)]
        other: Map<String, Value>,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
        #[serde(flatten)]
        other: Map<String, Value>,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<Content>,
        /// The tool failed: its content is the error.
        #[serde(default)]
        is_error: Option<bool>,
        #[serde(flatten)]
        other: Map<String, Value>,
    },
    Image {
        #[serde(flatten)]
        other: Map<String, Value>,
    },
    Thinking {
        #[serde(default)]
        thinking: String,
        #[serde(flatten)]
        other: Map<String, Value>,
    },
}

/// A block's fields beyond those mapped: `cache_control` (the prefix
/// cache is automatic) and a thinking block's `signature` (its proof for
/// Anthropic's servers) change nothing here; citations are refused.
const BLOCK_EXTRAS: Extras = Extras {
    not_applicable: &["cache_control", "signature"],
    refused: &[Refused {
        name: "citations",
        why: "citations are not supported",
        neutral: nothing,
    }],
};

impl Block {
    /// Its fields beyond those mapped, checked; `at` names it in a 400.
    fn check(&self, at: &str) -> Result<(), ApiError> {
        let other = match self {
            Self::Text { other, .. }
            | Self::ToolUse { other, .. }
            | Self::ToolResult { other, .. }
            | Self::Image { other }
            | Self::Thinking { other, .. } => other,
        };
        BLOCK_EXTRAS.check_in(other, at)
    }
}

#[derive(Debug, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub input_schema: Option<Value>,
    /// "custom" (a client tool, the default); Anthropic's server tools
    /// (web search, code execution...) are refused.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A tool definition's fields beyond those mapped.
const TOOL_EXTRAS: Extras = Extras {
    not_applicable: &["cache_control"],
    refused: &[],
};

impl Tool {
    fn check(&self, at: &str) -> Result<(), ApiError> {
        if let Some(kind) = self.kind.as_deref().filter(|k| *k != "custom") {
            return Err(ApiError::invalid(
                &format!("{at}.type"),
                format!("tools of type {kind:?} (Anthropic's server tools) are not supported"),
            ));
        }
        TOOL_EXTRAS.check_in(&self.other, at)
    }
}

/// The text of `content` (a tool result): text blocks only.
fn text_of(content: &Content, param: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(text) => Ok(text.clone()),
        Content::Blocks(blocks) => text_of_blocks(blocks, param),
    }
}

impl MessagesRequest {
    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn to_params(&self, context: u32) -> Result<v1::TextGenerationParams, ApiError> {
        self.check_fields(context)?;
        let mut messages = self.system_message()?.into_iter().collect::<Vec<_>>();
        for (index, m) in self.messages.iter().enumerate() {
            push_messages(index, m, &mut messages)?;
        }
        let tools_json = self.tools_json();
        let stop = self.stop_sequences.clone().unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop_sequences",
                "stop sequences must not be empty",
            ));
        }
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
                    top_k: self.top_k,
                    max_tokens: Some(self.max_tokens),
                    stop,
                    // Anthropic documents 1.0, as OpenAI does.
                    default_temperature: Some(super::openai::OPENAI_TEMPERATURE),
                    ..Default::default()
                }),
                enable_thinking: None,
                speculative: super::extension::speculative(self.tessera.as_ref()),
                tool_choice: crate::constraint::one_call(
                    crate::constraint::anthropic_tool_choice(self.tool_choice.as_ref())?,
                    self.tool_choice
                        .as_ref()
                        .and_then(|c| c.get("disable_parallel_tool_use"))
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                ),
                constraint: crate::constraint::with_extension(None, self.tessera.as_ref())?,
            },
            "",
            crate::constraint::param(self.tessera.as_ref(), "tessera"),
        )
    }
}

impl MessagesRequest {
    /// Messages, a token limit within the context (0: unknown), and
    /// Anthropic's ranges (the engine's own limits are checked at the end).
    fn check_fields(&self, context: u32) -> Result<(), ApiError> {
        EXTRAS.check(&self.other)?;
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        for (index, tool) in self.tools.iter().flatten().enumerate() {
            tool.check(&format!("tools[{index}]"))?;
        }
        crate::valid::token_limit("max_tokens", Some(self.max_tokens), context)?;
        if let Some(t) = self.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be between 0 and 1, got {t}"),
            ));
        }
        if let Some(p) = self.top_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be between 0 and 1, got {p}"),
            ));
        }
        Ok(())
    }

    /// The `system` field as a system message, unless it is empty.
    fn system_message(&self) -> Result<Option<v1::ChatMessage>, ApiError> {
        let text = match &self.system {
            Some(System::Text(text)) => text.clone(),
            Some(System::Blocks(blocks)) => text_of_blocks(blocks, "system")?,
            None => String::new(),
        };
        Ok((!text.is_empty()).then(|| v1::ChatMessage {
            role: "system".into(),
            content: text,
            ..Default::default()
        }))
    }

    /// The tools in OpenAI's function shape, unless `tool_choice` is none.
    fn tools_json(&self) -> Vec<String> {
        let tools_wanted = !matches!(&self.tool_choice, Some(c) if c.get("type").and_then(Value::as_str) == Some("none"));
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
                        "name": t.name,
                        "description": t.description.clone().unwrap_or_default(),
                        "parameters": t.input_schema.clone().unwrap_or(json!({"type": "object"})),
                    }
                })
                .to_string()
            })
            .collect()
    }
}

/// The text of blocks where only text may be (a system prompt, a tool
/// result).
fn text_of_blocks(blocks: &[Block], param: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (at, block) in blocks.iter().enumerate() {
        let at = format!("{param}[{at}]");
        block.check(&at)?;
        match block {
            Block::Text { text: t, .. } => text.push_str(t),
            Block::Image { .. } => return Err(ApiError::invalid(&at, "images are not supported")),
            _ => return Err(ApiError::invalid(&at, "only text blocks can be here")),
        }
    }
    Ok(text)
}

/// A tool result as the tool message's text; a failed tool's result says
/// so first (`is_error`), since chat templates have no field for it.
fn tool_result_text(
    content: Option<&Content>,
    is_error: Option<bool>,
    at: &str,
) -> Result<String, ApiError> {
    let text = match content {
        Some(c) => text_of(c, &format!("{at}.content"))?,
        None => String::new(),
    };
    Ok(if is_error == Some(true) {
        format!("Error: {text}")
    } else {
        text
    })
}

/// Message `index` as wire messages: its text, thinking and tool uses in
/// one, and each tool result as a message of its own.
fn push_messages(
    index: usize,
    m: &InMessage,
    messages: &mut Vec<v1::ChatMessage>,
) -> Result<(), ApiError> {
    let param = format!("messages[{index}]");
    crate::extras::NONE.check_in(&m.other, &param)?;
    if m.role != "user" && m.role != "assistant" {
        return Err(ApiError::invalid(
            &format!("{param}.role"),
            format!("role must be user or assistant, not {:?}", m.role),
        ));
    }
    let blocks = match &m.content {
        Content::Text(text) => {
            messages.push(v1::ChatMessage {
                role: m.role.clone(),
                content: text.clone(),
                ..Default::default()
            });
            return Ok(());
        }
        Content::Blocks(blocks) => blocks,
    };
    let mut message = v1::ChatMessage {
        role: m.role.clone(),
        ..Default::default()
    };
    for (at, block) in blocks.iter().enumerate() {
        let at = format!("{param}.content[{at}]");
        block.check(&at)?;
        match block {
            Block::Text { text, .. } => message.content.push_str(text),
            Block::Thinking { thinking, .. } => message.reasoning_content.push_str(thinking),
            Block::ToolUse {
                id, name, input, ..
            } => message.tool_calls.push(v1::ToolCall {
                id: id.clone(),
                name: name.clone(),
                arguments_json: input.to_string(),
            }),
            Block::ToolResult {
                tool_use_id,
                content,
                is_error,
                ..
            } => messages.push(v1::ChatMessage {
                role: "tool".into(),
                content: tool_result_text(content.as_ref(), *is_error, &at)?,
                tool_call_id: tool_use_id.clone(),
                ..Default::default()
            }),
            Block::Image { .. } => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    "images are not supported",
                ))
            }
        }
    }
    if !message.content.is_empty() || !message.tool_calls.is_empty() {
        messages.push(message);
    }
    Ok(())
}

pub fn stop_reason(reason: i32) -> &'static str {
    match v1::FinishReason::try_from(reason) {
        Ok(v1::FinishReason::Length) => "max_tokens",
        Ok(v1::FinishReason::ToolCalls) => "tool_use",
        _ => "end_turn",
    }
}

fn tool_input(call: &v1::ToolCall) -> Value {
    serde_json::from_str(&call.arguments_json).unwrap_or_else(|_| json!({}))
}

/// The `message` object of a whole answer.
pub fn message(id: &str, model: &str, chunks: &[generation_chunk::Kind]) -> Value {
    let mut content: Vec<Value> = Vec::new();
    let mut text = String::new();
    let mut thinking = String::new();
    let mut finish = None;
    for chunk in chunks {
        match chunk {
            generation_chunk::Kind::Token(t) if t.reasoning => thinking.push_str(&t.text),
            generation_chunk::Kind::Token(t) => text.push_str(&t.text),
            generation_chunk::Kind::ToolCall(c) => {
                if let Some(call) = &c.call {
                    // The newlines around calls are no text block.
                    let before = std::mem::take(&mut text);
                    if !before.trim().is_empty() {
                        content.push(json!({"type": "text", "text": before}));
                    }
                    content.push(json!({
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": tool_input(call),
                    }));
                }
            }
            generation_chunk::Kind::Finish(f) => finish = Some(*f),
            _ => {}
        }
    }
    if !text.trim().is_empty() || content.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    if !thinking.is_empty() {
        content.insert(
            0,
            json!({"type": "thinking", "thinking": thinking, "signature": ""}),
        );
    }
    let usage = finish.and_then(|f| f.usage).unwrap_or_default();
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish.map_or(0, |f| f.reason)),
        "stop_sequence": null,
        "usage": usage_json(&usage),
    })
}

/// Anthropic's usage: `input_tokens` are the prompt tokens computed, those
/// taken from the prefix cache are `cache_read_input_tokens`.
fn usage_json(usage: &v1::Usage) -> serde_json::Value {
    json!({
        "input_tokens": usage.prompt_tokens.saturating_sub(usage.cached_tokens),
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens,
        "tessera": super::extension::usage_extension(usage),
    })
}

/// Turns chunks into Anthropic's stream events: `(event name, data)`.
pub struct EventWriter {
    id: String,
    model: String,
    /// The open content block: its index and kind ("text", "thinking").
    open: Option<(usize, &'static str)>,
    next_index: usize,
}

impl EventWriter {
    pub fn new(id: String, model: String) -> Self {
        Self {
            id,
            model,
            open: None,
            next_index: 0,
        }
    }

    pub fn start(&self) -> (&'static str, Value) {
        (
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }}),
        )
    }

    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if let Some((index, _)) = self.open.take() {
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn open(
        &mut self,
        kind: &'static str,
        block: Value,
        out: &mut Vec<(&'static str, Value)>,
    ) -> usize {
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        self.open = Some((index, kind));
        index
    }

    pub fn write(&mut self, chunk: &generation_chunk::Kind) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        match chunk {
            generation_chunk::Kind::Token(t) if !t.text.is_empty() => {
                let (kind, block, delta) = if t.reasoning {
                    (
                        "thinking",
                        json!({"type": "thinking", "thinking": ""}),
                        json!({"type": "thinking_delta", "thinking": t.text}),
                    )
                } else {
                    (
                        "text",
                        json!({"type": "text", "text": ""}),
                        json!({"type": "text_delta", "text": t.text}),
                    )
                };
                let index = match self.open {
                    Some((index, open)) if open == kind => index,
                    _ => self.open(kind, block, &mut out),
                };
                out.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ));
            }
            generation_chunk::Kind::ToolCall(c) => {
                if let Some(call) = &c.call {
                    let index = self.open(
                        "tool_use",
                        json!({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}),
                        &mut out,
                    );
                    out.push((
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": {
                            "type": "input_json_delta",
                            "partial_json": tool_input(call).to_string(),
                        }}),
                    ));
                    self.close(&mut out);
                }
            }
            generation_chunk::Kind::Finish(f) => {
                if self.next_index == 0 {
                    // An empty answer still has its one text block.
                    self.open("text", json!({"type": "text", "text": ""}), &mut out);
                }
                self.close(&mut out);
                let usage = f.usage.unwrap_or_default();
                out.push((
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(f.reason), "stop_sequence": null},
                        "usage": usage_json(&usage)}),
                ));
                out.push(("message_stop", json!({"type": "message_stop"})));
            }
            _ => {}
        }
        out
    }
}

/// An error in Anthropic's shape.
pub fn error_body(error: &ApiError) -> Value {
    let kind = match error.status.as_u16() {
        400 | 409 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": error.message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested fields are mapped, not applicable, or refused by their path.
    #[test]
    fn fields_inside_blocks_and_tools_are_never_dropped() -> Result<(), Box<dyn std::error::Error>>
    {
        let param = |body: Value| -> Result<Option<String>, Box<dyn std::error::Error>> {
            let r: MessagesRequest = serde_json::from_value(body)?;
            Ok(r.to_params(0).err().and_then(|e| e.param))
        };
        let with = |block: Value| {
            json!({"model": "m", "max_tokens": 8,
                   "messages": [{"role": "user", "content": [block]}]})
        };
        let cached =
            with(json!({"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}));
        assert_eq!(param(cached)?, None, "cache_control is not applicable");
        let cited = with(json!({"type": "text", "text": "x", "citations": [{"a": 1}]}));
        assert_eq!(
            param(cited)?.as_deref(),
            Some("messages[0].content[0].citations")
        );
        let odd = with(json!({"type": "text", "text": "x", "colour": "red"}));
        assert_eq!(
            param(odd)?.as_deref(),
            Some("messages[0].content[0].colour")
        );
        let failed: MessagesRequest = serde_json::from_value(with(json!(
            {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": true}
        )))?;
        assert_eq!(failed.to_params(0)?.messages[0].content, "Error: boom");
        let server_tool = json!({"model": "m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
        assert_eq!(param(server_tool)?.as_deref(), Some("tools[0].type"));
        let system_tool_use = json!({"model": "m", "max_tokens": 8,
            "system": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            "messages": [{"role": "user", "content": "x"}]});
        assert_eq!(param(system_tool_use)?.as_deref(), Some("system[0]"));
        let message_field = json!({"model": "m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "x", "name": "bob"}]});
        assert_eq!(param(message_field)?.as_deref(), Some("messages[0].name"));
        Ok(())
    }

    #[test]
    fn a_messages_request_becomes_generation_params() -> Result<(), Box<dyn std::error::Error>> {
        let r: MessagesRequest = serde_json::from_value(json!({
            "model": "m",
            "max_tokens": 16,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
                ]}
            ],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "stop_sequences": ["END"],
            "temperature": 0
        }))?;
        let p = r.to_params(8192)?;
        let roles: Vec<&str> = p.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, vec!["system", "user", "assistant", "tool"]);
        assert_eq!(
            p.messages[2].tool_calls[0].arguments_json,
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(p.messages[3].tool_call_id, "t1");
        assert_eq!(p.messages[3].content, "sunny");
        assert!(p.tools_json[0].contains("\"parameters\""));
        let s = p.sampling.ok_or("sampling")?;
        assert_eq!(s.max_tokens, Some(16));
        assert_eq!(s.stop, vec!["END".to_string()]);
        // Refusals name the field.
        let bad: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 16, "messages": [{"role": "system", "content": "x"}]
        }))?;
        assert_eq!(
            bad.to_params(0).err().and_then(|e| e.param),
            Some("messages[0].role".to_string())
        );
        assert_eq!(p.speculative, None, "no tessera object: unaffected");
        let opted_out: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}],
            "tessera": {"speculative": false}
        }))?;
        assert_eq!(opted_out.to_params(0)?.speculative, Some(false));
        let usage = usage_json(&v1::Usage {
            draft_tokens: 3,
            ..Default::default()
        });
        assert_eq!(usage["tessera"]["draft_tokens"], 3);
        Ok(())
    }

    #[test]
    fn answers_and_streams_take_anthropics_shapes() {
        let chunks = vec![
            generation_chunk::Kind::Token(v1::TokenChunk {
                text: "Hi".into(),
                ..Default::default()
            }),
            generation_chunk::Kind::ToolCall(v1::ToolCallChunk {
                call: Some(v1::ToolCall {
                    id: "t1".into(),
                    name: "f".into(),
                    arguments_json: "{\"a\":1}".into(),
                }),
            }),
            generation_chunk::Kind::Finish(v1::FinishChunk {
                reason: v1::FinishReason::ToolCalls as i32,
                usage: Some(v1::Usage {
                    prompt_tokens: 40,
                    completion_tokens: 2,
                    cached_tokens: 32,
                    ..Default::default()
                }),
                stats: None,
            }),
        ];
        let whole = message("msg_1", "m", &chunks);
        assert_eq!(whole["usage"]["input_tokens"], 8);
        assert_eq!(whole["usage"]["cache_read_input_tokens"], 32);
        assert_eq!(whole["content"][0], json!({"type": "text", "text": "Hi"}));
        assert_eq!(whole["content"][1]["input"], json!({"a": 1}));
        assert_eq!(whole["stop_reason"], "tool_use");
        assert_eq!(whole["usage"]["output_tokens"], 2);

        let mut writer = EventWriter::new("msg_1".into(), "m".into());
        let names: Vec<&str> = std::iter::once(writer.start())
            .chain(chunks.iter().flat_map(|c| writer.write(c)))
            .map(|(name, _)| name)
            .collect();
        assert_eq!(
            names,
            vec![
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
    }
}
