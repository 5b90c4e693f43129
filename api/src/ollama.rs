//! Ollama's API: `/api/chat` and `/api/generate` requests (with their
//! `options`) turned into `TextGenerationParams`, and the newline-delimited
//! JSON objects Ollama answers with. Pure functions, tested without a
//! server.

pub mod handlers;

use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::error::ApiError;

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
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
}

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
}

fn sampling(options: Option<&Options>, context: u32) -> Result<v1::SamplingParams, ApiError> {
    let default = Options::default();
    let o = options.unwrap_or(&default);
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
        repetition_penalty: o.repeat_penalty,
        presence_penalty: o.presence_penalty,
        frequency_penalty: o.frequency_penalty,
        seed: o.seed,
        max_tokens,
        stop: o.stop.clone().unwrap_or_default(),
        ..Default::default()
    })
}

impl ChatRequest {
    /// Ollama streams unless told not to.
    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(true)
    }

    pub fn to_params(&self, context: u32) -> Result<v1::TextGenerationParams, ApiError> {
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
            messages.push(v1::ChatMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                tool_calls,
                ..Default::default()
            });
        }
        crate::valid::checked(
            v1::TextGenerationParams {
                model_id: self.model.clone(),
                messages,
                raw_prompt: None,
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

#[cfg(test)]
mod tests {
    use super::*;

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
