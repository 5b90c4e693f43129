//! OpenAI's legacy Completions (`/v1/completions`): a raw prompt (a string,
//! a list of strings, token ids, or a list of token-id lists) continued as
//! text, whole or streamed, with `echo`, `logprobs` (the legacy shape),
//! `stop` and the sampling parameters of Chat Completions. A raw prompt's
//! control tokens are control tokens. Pure functions, tested without a
//! server; the handler is in `completions/handlers`.

pub mod handlers;

use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1::{self, generation_chunk};

use super::error::ApiError;
use super::extras::{nothing, Extras, Refused};
pub use super::openai::StreamOptions;
use super::openai::{finish_reason, stats_json, usage_json, Sampling, Stop};

/// Tokens a request without `max_tokens` generates (OpenAI's default).
const DEFAULT_MAX_TOKENS: u32 = 16;
/// Prompts one request may list.
const MAX_PROMPTS: usize = 16;
/// Alternatives per token the legacy `logprobs` may ask for (OpenAI's).
const MAX_LOGPROBS: u32 = 5;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    #[serde(default)]
    pub tessera: Option<super::extension::RequestExtension>,
    pub prompt: PromptInput,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// The sampling fields, as Chat Completions takes them.
    #[serde(flatten)]
    pub sampling: Sampling,
    #[serde(default)]
    pub stop: Option<Stop>,
    /// The legacy shape: how many alternatives per token (0 lists the
    /// chosen token's logprob alone).
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub best_of: Option<u32>,
    /// Every other field: not applicable, or refused ([`EXTRAS`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

const EXTRAS: Extras = Extras {
    not_applicable: &["user"],
    refused: &[Refused {
        name: "suffix",
        why: "fill-in-the-middle is not implemented",
        neutral: nothing,
    }],
};

/// One prompt of a request: its text (for `echo`) and its wire form.
pub struct OnePrompt {
    pub text: Option<String>,
    pub params: v1::TextGenerationParams,
}

impl CompletionRequest {
    pub fn streaming(&self) -> (bool, StreamOptions) {
        (
            self.stream.unwrap_or(false),
            self.stream_options.unwrap_or_default(),
        )
    }

    pub fn echo(&self) -> bool {
        self.echo.unwrap_or(false)
    }

    /// The generations the request asks for, one per prompt, in order.
    pub fn to_prompts(&self, context: u32) -> Result<Vec<OnePrompt>, ApiError> {
        self.check_fields(context)?;
        let prompts: Vec<(Option<String>, Vec<u32>)> = match &self.prompt {
            PromptInput::Text(text) => vec![(Some(text.clone()), Vec::new())],
            PromptInput::Texts(texts) => texts
                .iter()
                .map(|t| (Some(t.clone()), Vec::new()))
                .collect(),
            PromptInput::Tokens(ids) => vec![(None, ids.clone())],
            PromptInput::TokenLists(lists) => lists.iter().map(|ids| (None, ids.clone())).collect(),
        };
        if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
            return Err(ApiError::invalid(
                "prompt",
                format!("prompt must list 1 to {MAX_PROMPTS} prompts"),
            ));
        }
        if prompts
            .iter()
            .any(|(text, ids)| text.as_ref().map_or(ids.is_empty(), String::is_empty))
        {
            return Err(ApiError::invalid("prompt", "a prompt must not be empty"));
        }
        if self.echo() && prompts.iter().any(|(text, _)| text.is_none()) {
            return Err(ApiError::invalid(
                "echo",
                "echo needs text prompts, not token ids",
            ));
        }
        if self.stream.unwrap_or(false) && prompts.len() > 1 {
            return Err(ApiError::invalid(
                "prompt",
                "a streamed completion takes one prompt; send the others on their own",
            ));
        }
        prompts
            .into_iter()
            .map(|(text, ids)| {
                let params = self.params(text.clone(), ids)?;
                Ok(OnePrompt { text, params })
            })
            .collect()
    }

    fn params(
        &self,
        text: Option<String>,
        ids: Vec<u32>,
    ) -> Result<v1::TextGenerationParams, ApiError> {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(list)) => list.clone(),
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        let constraint = crate::constraint::with_extension(None, self.tessera.as_ref())?;
        crate::valid::checked(
            v1::TextGenerationParams {
                model_id: self.model.clone(),
                messages: Vec::new(),
                raw_prompt: text,
                prompt_token_ids: ids,
                count_only: false,
                embedding: None,
                tools_json: Vec::new(),
                sampling: Some(self.sampling.wire(
                    Some(self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
                    stop,
                    (self.logprobs.is_some(), self.logprobs.unwrap_or(0)),
                )?),
                enable_thinking: None,
                speculative: super::extension::speculative(self.tessera.as_ref()),
                constraint,
                tool_choice: None,
            },
            "",
            crate::constraint::param(self.tessera.as_ref(), "tessera"),
        )
    }

    fn check_fields(&self, context: u32) -> Result<(), ApiError> {
        EXTRAS.check(&self.other)?;
        self.sampling.check()?;
        if self.model.trim().is_empty() {
            return Err(ApiError::invalid("model", "model must not be empty"));
        }
        crate::choices::count(self.n)?;
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
        if self.logprobs.is_some_and(|n| n > MAX_LOGPROBS) {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be at most {MAX_LOGPROBS}"),
            ));
        }
        if self.echo() && self.logprobs.is_some() {
            return Err(ApiError::invalid(
                "echo",
                "echo with logprobs needs the prompt's logprobs, which are not computed; ask for one or the other",
            ));
        }
        crate::valid::token_limit("max_tokens", self.max_tokens, context)
    }
}

/// The legacy `logprobs` object of some tokens: their texts, logprobs, best
/// alternatives and offsets into the choice's text (which starts at
/// `offset`).
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    fn push(&mut self, token: &v1::TokenChunk, offset: usize) {
        let Some(logprob) = token.logprob else {
            return;
        };
        self.tokens.push(token.text.clone());
        self.token_logprobs.push(logprob);
        let top: serde_json::Map<String, Value> = token
            .top_logprobs
            .iter()
            .map(|t| (t.text.clone(), json!(t.logprob)))
            .collect();
        self.top_logprobs.push(Value::Object(top));
        self.text_offset.push(offset);
    }

    fn json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// One prompt's answer, gathered from its chunks.
#[derive(Default)]
pub struct Choice {
    text: String,
    logprobs: LegacyLogprobs,
    finish: Option<v1::FinishChunk>,
}

impl Choice {
    /// A choice whose text starts with the prompt (`echo`).
    pub fn echoing(prompt: &str) -> Self {
        Self {
            text: prompt.to_string(),
            ..Self::default()
        }
    }

    pub fn push(&mut self, chunk: &generation_chunk::Kind) {
        match chunk {
            generation_chunk::Kind::Token(token) => {
                self.logprobs.push(token, self.text.len());
                self.text.push_str(&token.text);
            }
            generation_chunk::Kind::Finish(finish) => self.finish = Some(*finish),
            _ => {}
        }
    }

    fn json(&self, index: usize, logprobs: bool) -> Value {
        json!({
            "text": self.text,
            "index": index,
            "logprobs": if logprobs { self.logprobs.json() } else { Value::Null },
            "finish_reason": finish_reason(self.finish.as_ref().map_or(0, |f| f.reason)),
        })
    }
}

/// The whole answer: `n` choices per prompt (prompt after prompt), usage
/// summed over the prompts, each prompt counted once.
pub fn completion(
    id: &str,
    model: &str,
    created: u64,
    choices: &[Choice],
    (n, logprobs): (usize, bool),
) -> Value {
    let mut usage = v1::Usage::default();
    for answers in choices.chunks(n.max(1)) {
        let one = crate::choices::usage_of(answers.iter().map(|c| c.finish.as_ref()));
        usage.prompt_tokens += one.prompt_tokens;
        usage.completion_tokens += one.completion_tokens;
        usage.cached_tokens += one.cached_tokens;
    }
    json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices.iter().enumerate().map(|(i, c)| c.json(i, logprobs)).collect::<Vec<_>>(),
        "usage": usage_json(Some(&usage)),
    })
}

/// Builds the `text_completion` chunks of a stream (one prompt).
pub struct CompletionChunks {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub options: StreamOptions,
    /// Bytes of text sent so far (the legacy logprobs' offsets).
    sent: usize,
    /// The choice this writer's chunks belong to.
    index: usize,
    /// One of several choices: the usage comes after all of them.
    several: bool,
}

impl CompletionChunks {
    pub fn new(id: String, model: String, created: u64, options: StreamOptions) -> Self {
        Self {
            id,
            model,
            created,
            options,
            sent: 0,
            index: 0,
            several: false,
        }
    }

    /// The writer of choice `index` among several ([`CompletionChunks::usage`]
    /// after all of them).
    pub fn of_choice(mut self, index: usize) -> Self {
        self.index = index;
        self.several = true;
        self
    }

    /// The usage chunk after several choices, when the client asked for it.
    pub fn usage(&self, finishes: &[v1::FinishChunk]) -> Option<Value> {
        if !self.options.include_usage {
            return None;
        }
        let usage = crate::choices::usage_of(finishes.iter().map(Some));
        Some(json!({
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model, "choices": [],
            "usage": usage_json(Some(&usage)),
            "tessera": stats_json(finishes.first().and_then(|f| f.stats.as_ref())),
        }))
    }

    fn chunk(&self, text: &str, logprobs: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"text": text, "index": self.index, "logprobs": logprobs, "finish_reason": finish}],
        })
    }

    /// The echoed prompt, first.
    pub fn echo(&mut self, prompt: &str) -> Value {
        self.sent += prompt.len();
        self.chunk(prompt, Value::Null, None)
    }

    pub fn write(&mut self, chunk: &generation_chunk::Kind) -> Vec<Value> {
        match chunk {
            generation_chunk::Kind::Token(token) => {
                let mut logprobs = LegacyLogprobs::default();
                logprobs.push(token, self.sent);
                if token.text.is_empty() && logprobs.tokens.is_empty() {
                    return Vec::new();
                }
                self.sent += token.text.len();
                let logprobs = if logprobs.tokens.is_empty() {
                    Value::Null
                } else {
                    logprobs.json()
                };
                vec![self.chunk(&token.text, logprobs, None)]
            }
            generation_chunk::Kind::Finish(finish) => {
                let mut out = vec![self.chunk("", Value::Null, Some(finish_reason(finish.reason)))];
                if self.options.include_usage && !self.several {
                    out.push(json!({
                        "id": self.id, "object": "text_completion", "created": self.created,
                        "model": self.model, "choices": [],
                        "usage": usage_json(finish.usage.as_ref()),
                        "tessera": stats_json(finish.stats.as_ref()),
                    }));
                }
                out
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> CompletionRequest {
        serde_json::from_value(body).expect("a request")
    }

    #[test]
    fn prompts_of_every_shape_become_generations() {
        let one = request(json!({"model": "m", "prompt": "Once upon"}));
        let prompts = one.to_prompts(100).expect("accepted");
        assert_eq!(prompts.len(), 1);
        assert_eq!(prompts[0].params.raw_prompt.as_deref(), Some("Once upon"));
        let sampling = prompts[0].params.sampling.clone().expect("sampling");
        assert_eq!(sampling.max_tokens, Some(DEFAULT_MAX_TOKENS));
        let many = request(json!({"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 3}));
        assert_eq!(many.to_prompts(100).expect("accepted").len(), 3);
        let ids = request(json!({"model": "m", "prompt": [1, 2, 3]}));
        let prompts = ids.to_prompts(100).expect("accepted");
        assert_eq!(prompts[0].params.prompt_token_ids, vec![1, 2, 3]);
        assert!(prompts[0].params.raw_prompt.is_none());
        let lists = request(json!({"model": "m", "prompt": [[1, 2], [3]]}));
        assert_eq!(lists.to_prompts(100).expect("accepted").len(), 2);
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        for (body, param) in [
            (json!({"model": "m", "prompt": ""}), "prompt"),
            (json!({"model": "m", "prompt": []}), "prompt"),
            (json!({"model": "m", "prompt": "x", "n": 0}), "n"),
            (
                json!({"model": "m", "prompt": "x", "best_of": 3}),
                "best_of",
            ),
            (
                json!({"model": "m", "prompt": "x", "logprobs": 6}),
                "logprobs",
            ),
            (
                json!({"model": "m", "prompt": "x", "echo": true, "logprobs": 1}),
                "echo",
            ),
            (
                json!({"model": "m", "prompt": [1, 2], "echo": true}),
                "echo",
            ),
            (
                json!({"model": "m", "prompt": ["a", "b"], "stream": true}),
                "prompt",
            ),
            (
                json!({"model": "m", "prompt": "x", "suffix": "y"}),
                "suffix",
            ),
            (
                json!({"model": "m", "prompt": "x", "max_tokens": 0}),
                "max_tokens",
            ),
        ] {
            let error = request(body.clone())
                .to_prompts(100)
                .err()
                .expect("refused");
            assert_eq!(error.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn answers_take_the_legacy_shape() {
        let token = |text: &str, logprob: f32| {
            generation_chunk::Kind::Token(v1::TokenChunk {
                text: text.into(),
                logprob: Some(logprob),
                top_logprobs: vec![v1::TopLogprob {
                    token_id: 1,
                    text: text.into(),
                    logprob,
                }],
                ..Default::default()
            })
        };
        let finish = generation_chunk::Kind::Finish(v1::FinishChunk {
            reason: v1::FinishReason::Length as i32,
            usage: Some(v1::Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                ..Default::default()
            }),
            stats: None,
        });
        let mut choice = Choice::echoing("Hi");
        for chunk in [token(" there", -0.5), token("!", -1.0), finish.clone()] {
            choice.push(&chunk);
        }
        let answer = completion("cmpl-1", "m", 7, &[choice], (1, true));
        assert_eq!(answer["object"], "text_completion");
        assert_eq!(answer["choices"][0]["text"], "Hi there!");
        assert_eq!(answer["choices"][0]["finish_reason"], "length");
        let logprobs = &answer["choices"][0]["logprobs"];
        assert_eq!(logprobs["tokens"], json!([" there", "!"]));
        assert_eq!(logprobs["text_offset"], json!([2, 8]));
        assert_eq!(logprobs["top_logprobs"][1]["!"], -1.0);
        assert_eq!(answer["usage"]["total_tokens"], 5);
        let mut chunks =
            CompletionChunks::new("cmpl-1".into(), "m".into(), 7, StreamOptions::default());
        let first = chunks.write(&token("Hey", -0.1));
        assert_eq!(first[0]["choices"][0]["text"], "Hey");
        let last = chunks.write(&finish);
        assert_eq!(last[0]["choices"][0]["finish_reason"], "length");
    }
}
