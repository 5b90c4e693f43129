//! The one mapping from a wire `TextGenerationParams` to the engine's
//! `GenerateRequest` (the runner's, and `tessera generate`'s, which builds
//! the same parameters from its flags).

use tessera_engine::embed::EmbedInput;
use tessera_engine::serve::sampler::{LeftToModel, SamplingParams};
use tessera_engine::serve::{Constraint, GenerateRequest, Prompt, ToolChoice};
use tessera_engine::text::chat_template::ChatMessage;
use tessera_engine::text::tools::{self, ToolError};
use tessera_protos::v1;

/// Tokens generated when a request names no limit.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// Why parameters are not a request the engine can run: the client's error.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the request has neither messages nor a raw prompt")]
    NoPrompt,
    #[error("a tool definition is not JSON: {0}")]
    ToolNotJson(serde_json::Error),
    #[error("the arguments of tool call {name:?} are not JSON: {source}")]
    ToolCallArguments {
        name: String,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Sampling(#[from] tessera_engine::serve::sampler::SamplingError),
    #[error("the JSON schema is not JSON: {0}")]
    SchemaNotJson(serde_json::Error),
    #[error(transparent)]
    Constraint(#[from] tessera_grammar::GrammarError),
    #[error(transparent)]
    Tools(#[from] ToolError),
    #[error("an embedding request needs at least one input")]
    NoInputs,
    #[error("{count} inputs; one request embeds at most {MAX_EMBED_INPUTS}")]
    TooManyInputs { count: usize },
    #[error("input {index} has neither text nor tokens")]
    EmptyInput { index: usize },
}

/// Inputs one embedding request may carry (OpenAI's limit).
pub const MAX_EMBED_INPUTS: usize = 2048;

/// An embedding request as the runner's embedder takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbedRequest {
    pub inputs: Vec<EmbedInput>,
    /// 0: whole vectors.
    pub dimensions: usize,
    pub refuse_long: bool,
}

/// The one mapping from the wire's embedding parameters (the API's check
/// and the runner's).
pub fn embed_request_from(params: &v1::EmbeddingParams) -> Result<EmbedRequest, RequestError> {
    use v1::embedding_input::Kind;
    if params.inputs.is_empty() {
        return Err(RequestError::NoInputs);
    }
    if params.inputs.len() > MAX_EMBED_INPUTS {
        return Err(RequestError::TooManyInputs {
            count: params.inputs.len(),
        });
    }
    let inputs = params
        .inputs
        .iter()
        .enumerate()
        .map(|(index, input)| match &input.kind {
            Some(Kind::Text(text)) => Ok(EmbedInput::Text(text.clone())),
            Some(Kind::Tokens(tokens)) if !tokens.ids.is_empty() => {
                Ok(EmbedInput::Tokens(tokens.ids.clone()))
            }
            _ => Err(RequestError::EmptyInput { index }),
        })
        .collect::<Result<_, _>>()?;
    Ok(EmbedRequest {
        inputs,
        dimensions: params.dimensions as usize,
        refuse_long: params.refuse_long,
    })
}

pub fn request_from(params: &v1::TextGenerationParams) -> Result<GenerateRequest, RequestError> {
    let sampling = params.sampling.clone().unwrap_or_default();
    let mut request = request_for(prompt_from(params)?, &sampling)?;
    // A request drafts unless it opted out (`tessera.speculative: false`).
    request.speculative = params.speculative.unwrap_or(true);
    request.constraint = constraint_from(params.constraint.as_ref())?;
    request.tool_choice = tool_choice_from(params.tool_choice.as_ref(), &request.prompt)?;
    request.parallel_tool_calls = !params.tool_choice.as_ref().is_some_and(|c| c.one_call);
    request.count_only = params.count_only;
    Ok(request)
}

/// The wire's tool choice, checked against the tools: a forced call needs
/// tools, and a named function must be one of them.
fn tool_choice_from(
    choice: Option<&v1::ToolChoice>,
    prompt: &Prompt,
) -> Result<ToolChoice, RequestError> {
    use v1::tool_choice::Kind;
    let choice = match choice.and_then(|c| c.kind.as_ref()) {
        None | Some(Kind::Required(false)) => return Ok(ToolChoice::Auto),
        Some(Kind::Required(true)) => ToolChoice::Required,
        Some(Kind::Function(name)) => ToolChoice::Function(name.clone()),
    };
    let tools = match prompt {
        Prompt::Chat {
            tools: Some(tools), ..
        } => tools,
        _ => return Err(ToolError::NoTools { choice: "required" }.into()),
    };
    let functions = tools::functions(tools)?;
    if let ToolChoice::Function(name) = &choice {
        if !functions.iter().any(|f| &f.name == name) {
            let known: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
            return Err(ToolError::UnknownFunction {
                name: name.clone(),
                known: known.join(", "),
            }
            .into());
        }
    }
    Ok(choice)
}

/// The wire's constraint, checked to compile (against a byte-level
/// vocabulary: the model's own compiles what that one does).
pub fn constraint_from(
    constraint: Option<&v1::OutputConstraint>,
) -> Result<Option<Constraint>, RequestError> {
    use v1::output_constraint::Kind;
    let Some(kind) = constraint.and_then(|c| c.kind.as_ref()) else {
        return Ok(None);
    };
    let constraint = match kind {
        Kind::JsonSchema(text) => {
            Constraint::JsonSchema(serde_json::from_str(text).map_err(RequestError::SchemaNotJson)?)
        }
        Kind::JsonObject(_) => Constraint::JsonObject,
        Kind::Regex(regex) => Constraint::Regex(regex.clone()),
        Kind::Lark(grammar) => Constraint::Lark(grammar.clone()),
    };
    tessera_grammar::check(&constraint)?;
    Ok(Some(constraint))
}

/// A request for `prompt` under the wire's sampling parameters.
pub fn request_for(
    prompt: Prompt,
    sampling: &v1::SamplingParams,
) -> Result<GenerateRequest, RequestError> {
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = sampling.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS) as usize;
    request.stop = sampling.stop.clone();
    request.stop_token_ids = sampling.stop_token_ids.clone();
    request.logprobs = sampling.logprobs;
    request.sampling = sampling_from(sampling);
    request.left_to_model = LeftToModel {
        temperature: sampling.temperature.is_none(),
        top_p: sampling.top_p.is_none(),
        top_k: sampling.top_k.is_none(),
        min_p: sampling.min_p.is_none(),
        repetition_penalty: sampling.repetition_penalty.is_none(),
        dialect_temperature: sampling.default_temperature,
    };
    request.sampling.validate()?;
    Ok(request)
}

fn prompt_from(params: &v1::TextGenerationParams) -> Result<Prompt, RequestError> {
    if let Some(text) = &params.raw_prompt {
        return Ok(Prompt::Raw(text.clone()));
    }
    if params.messages.is_empty() && !params.prompt_token_ids.is_empty() {
        return Ok(Prompt::Tokens(params.prompt_token_ids.clone()));
    }
    if params.messages.is_empty() {
        return Err(RequestError::NoPrompt);
    }
    let tools = params
        .tools_json
        .iter()
        .map(|t| serde_json::from_str::<serde_json::Value>(t))
        .collect::<Result<Vec<_>, _>>()
        .map_err(RequestError::ToolNotJson)?;
    Ok(Prompt::Chat {
        messages: params
            .messages
            .iter()
            .map(chat_message)
            .collect::<Result<_, _>>()?,
        tools: (!tools.is_empty()).then_some(serde_json::Value::Array(tools)),
    })
}

/// The wire's sampling parameters; each one unset takes the engine's
/// default.
fn sampling_from(sampling: &v1::SamplingParams) -> SamplingParams {
    let defaults = SamplingParams::default();
    SamplingParams {
        temperature: sampling.temperature.unwrap_or(defaults.temperature),
        top_k: sampling.top_k.map_or(defaults.top_k, |k| k as usize),
        top_p: sampling.top_p.unwrap_or(defaults.top_p),
        min_p: sampling.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: sampling
            .repetition_penalty
            .unwrap_or(defaults.repetition_penalty),
        presence_penalty: sampling
            .presence_penalty
            .unwrap_or(defaults.presence_penalty),
        frequency_penalty: sampling
            .frequency_penalty
            .unwrap_or(defaults.frequency_penalty),
        seed: sampling.seed,
        top_logprobs: sampling.top_logprobs as usize,
        penalty_window: sampling
            .penalty_window
            .map_or(defaults.penalty_window, |n| n as usize),
        // The wire's map is ordered by token.
        logit_bias: sampling.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
    }
}

/// A message of the wire protocol as the chat template takes it (earlier
/// tool calls in OpenAI's shape).
fn chat_message(m: &v1::ChatMessage) -> Result<ChatMessage, RequestError> {
    let tool_calls = if m.tool_calls.is_empty() {
        None
    } else {
        let calls = m
            .tool_calls
            .iter()
            .map(|call| {
                let arguments: serde_json::Value = serde_json::from_str(&call.arguments_json)
                    .map_err(|source| RequestError::ToolCallArguments {
                        name: call.name.clone(),
                        source,
                    })?;
                Ok(serde_json::json!({
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }))
            })
            .collect::<Result<Vec<_>, RequestError>>()?;
        Some(serde_json::Value::Array(calls))
    };
    Ok(ChatMessage {
        role: m.role.clone(),
        content: m.content.clone(),
        tool_calls,
        tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
        name: (!m.name.is_empty()).then(|| m.name.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(content: &str) -> v1::TextGenerationParams {
        v1::TextGenerationParams {
            model_id: "m".into(),
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: content.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn unset_sampling_takes_the_engine_defaults_and_set_ones_are_kept() {
        let request = request_from(&chat("hi")).expect("a request");
        assert_eq!(request.max_tokens, DEFAULT_MAX_TOKENS as usize);
        assert_eq!(request.sampling, SamplingParams::default());
        let mut params = chat("hi");
        params.sampling = Some(v1::SamplingParams {
            temperature: Some(0.0),
            top_k: Some(5),
            seed: Some(7),
            max_tokens: Some(3),
            ..Default::default()
        });
        let request = request_from(&params).expect("a request");
        assert_eq!(request.max_tokens, 3);
        assert_eq!(request.sampling.temperature, 0.0);
        assert_eq!(request.sampling.top_k, 5);
        assert_eq!(request.sampling.seed, Some(7));
    }

    #[test]
    fn a_request_drafts_unless_it_opted_out() {
        let request = request_from(&chat("hi")).expect("a request");
        assert!(request.speculative);
        let mut params = chat("hi");
        params.speculative = Some(false);
        assert!(!request_from(&params).expect("a request").speculative);
        params.speculative = Some(true);
        assert!(request_from(&params).expect("a request").speculative);
    }

    #[test]
    fn embedding_inputs_map_in_order_and_bad_ones_are_refused() {
        let text = |t: &str| v1::EmbeddingInput {
            kind: Some(v1::embedding_input::Kind::Text(t.into())),
        };
        let tokens = v1::EmbeddingInput {
            kind: Some(v1::embedding_input::Kind::Tokens(v1::TokenIds {
                ids: vec![1, 2],
            })),
        };
        let params = v1::EmbeddingParams {
            inputs: vec![text("a"), tokens],
            dimensions: 8,
            refuse_long: true,
        };
        let request = embed_request_from(&params).expect("a request");
        assert_eq!(
            request.inputs,
            vec![EmbedInput::Text("a".into()), EmbedInput::Tokens(vec![1, 2])]
        );
        assert_eq!((request.dimensions, request.refuse_long), (8, true));
        let none = v1::EmbeddingParams::default();
        assert!(matches!(
            embed_request_from(&none),
            Err(RequestError::NoInputs)
        ));
        let empty = v1::EmbeddingParams {
            inputs: vec![text("a"), v1::EmbeddingInput { kind: None }],
            ..Default::default()
        };
        assert!(matches!(
            embed_request_from(&empty),
            Err(RequestError::EmptyInput { index: 1 })
        ));
        let many = v1::EmbeddingParams {
            inputs: vec![text("a"); MAX_EMBED_INPUTS + 1],
            ..Default::default()
        };
        assert!(matches!(
            embed_request_from(&many),
            Err(RequestError::TooManyInputs { .. })
        ));
    }

    #[test]
    fn bad_parameters_are_the_clients_error() {
        let empty = v1::TextGenerationParams::default();
        assert!(matches!(request_from(&empty), Err(RequestError::NoPrompt)));
        let mut tools = chat("hi");
        tools.tools_json = vec!["{not json".into()];
        assert!(matches!(
            request_from(&tools),
            Err(RequestError::ToolNotJson(_))
        ));
        let mut sampling = chat("hi");
        sampling.sampling = Some(v1::SamplingParams {
            temperature: Some(-1.0),
            ..Default::default()
        });
        assert!(matches!(
            request_from(&sampling),
            Err(RequestError::Sampling(_))
        ));
    }
}
