//! Structured outputs in each dialect's words: OpenAI's `response_format`
//! (and the Responses API's `text.format`), Ollama's `format`, and
//! tessera's own `tessera.regex` / `tessera.grammar`, each read into the
//! one wire constraint the engine enforces token by token. Whether a
//! schema or grammar compiles is checked once, by the engine's own
//! validation (`valid::checked`).

use serde_json::Value;
use tessera_protos::v1::{self, output_constraint::Kind};

use crate::error::ApiError;
use crate::extension::RequestExtension;

fn constraint(kind: Kind) -> Option<v1::OutputConstraint> {
    Some(v1::OutputConstraint { kind: Some(kind) })
}

/// OpenAI's `response_format` (`param` names it in errors): `text`,
/// `json_object`, or `json_schema` with its `json_schema.schema`.
pub(crate) fn response_format(
    format: Option<&Value>,
    param: &str,
) -> Result<Option<v1::OutputConstraint>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let kind = format.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(constraint(Kind::JsonObject(true))),
        Some("json_schema") => {
            let Some(spec) = format.get("json_schema") else {
                return Err(ApiError::invalid(
                    &format!("{param}.json_schema"),
                    "a json_schema response format needs `json_schema` with its `schema`",
                ));
            };
            schema_constraint(spec.get("schema"), &format!("{param}.json_schema.schema"))
        }
        _ => Err(unknown_type(
            format,
            param,
            "text, json_object or json_schema",
        )),
    }
}

/// The Responses API's `text.format`: as `response_format`, with the
/// schema's fields beside `type`.
pub(crate) fn text_format(text: Option<&Value>) -> Result<Option<v1::OutputConstraint>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(constraint(Kind::JsonObject(true))),
        Some("json_schema") => schema_constraint(format.get("schema"), "text.format.schema"),
        _ => Err(unknown_type(
            format,
            "text.format",
            "text, json_object or json_schema",
        )),
    }
}

/// Ollama's `format`: `"json"`, or a JSON Schema object.
pub(crate) fn ollama_format(
    format: Option<&Value>,
) -> Result<Option<v1::OutputConstraint>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(constraint(Kind::JsonObject(true))),
        Some(schema @ Value::Object(_)) => schema_constraint(Some(schema), "format"),
        Some(other) => Err(ApiError::invalid(
            "format",
            format!("format must be \"json\" or a JSON Schema object, got {other}"),
        )),
    }
}

/// The constraint of a request: its dialect's (`dialect`, already read)
/// or tessera's `regex` / `grammar`, never two at once.
pub(crate) fn with_extension(
    dialect: Option<v1::OutputConstraint>,
    extension: Option<&RequestExtension>,
) -> Result<Option<v1::OutputConstraint>, ApiError> {
    let regex = extension.and_then(|e| e.regex.clone());
    let grammar = extension.and_then(|e| e.grammar.clone());
    let own = match (regex, grammar) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "tessera",
                "give tessera.regex or tessera.grammar, not both",
            ))
        }
        (Some(regex), None) => constraint(Kind::Regex(regex)),
        (None, Some(grammar)) => constraint(Kind::Lark(grammar)),
        (None, None) => None,
    };
    match (dialect, own) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "tessera",
            "a request takes one output constraint: a response format or tessera.regex/grammar",
        )),
        (dialect, own) => Ok(dialect.or(own)),
    }
}

/// The field a constraint's error names: tessera's own when the request
/// used it, else the dialect's (`dialect_param`).
pub(crate) fn param<'a>(extension: Option<&RequestExtension>, dialect_param: &'a str) -> &'a str {
    match extension {
        Some(e) if e.regex.is_some() => "tessera.regex",
        Some(e) if e.grammar.is_some() => "tessera.grammar",
        _ => dialect_param,
    }
}

fn schema_constraint(
    schema: Option<&Value>,
    param: &str,
) -> Result<Option<v1::OutputConstraint>, ApiError> {
    match schema {
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
            Ok(constraint(Kind::JsonSchema(schema.to_string())))
        }
        // OpenAI's schema is optional: without one, any JSON object.
        None => Ok(constraint(Kind::JsonObject(true))),
        Some(other) => Err(ApiError::invalid(
            param,
            format!("the schema must be a JSON object, got {other}"),
        )),
    }
}

fn unknown_type(format: &Value, param: &str, known: &str) -> ApiError {
    let given = format
        .get("type")
        .map_or("none".to_string(), Value::to_string);
    ApiError::invalid(
        &format!("{param}.type"),
        format!("{param}.type must be one of {known}; got {given}"),
    )
}

/// Which calls the answer must be, from a dialect's `tool_choice`: the
/// mode's name and the function it names, if any. `words` are the
/// dialect's names for "at least one call" and "this function" (OpenAI's
/// `required` and `function`, Anthropic's `any` and `tool`).
fn tool_choice(
    mode: &str,
    function: Option<&str>,
    words: (&str, &str),
    modes: &str,
) -> Result<Option<v1::ToolChoice>, ApiError> {
    use v1::tool_choice::Kind;
    let (required, named) = words;
    let kind = if mode == "auto" || mode == "none" {
        return Ok(None);
    } else if mode == required {
        Kind::Required(true)
    } else if mode == named {
        match function.filter(|name| !name.is_empty()) {
            Some(name) => Kind::Function(name.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice names no function",
                ))
            }
        }
    } else {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice must be {modes}; got {mode:?}"),
        ));
    };
    Ok(Some(v1::ToolChoice {
        kind: Some(kind),
        one_call: false,
    }))
}

/// OpenAI's words for a required call and a named function.
const OPENAI_WORDS: (&str, &str) = ("required", "function");

/// OpenAI Chat Completions' `tool_choice`: `"auto"`, `"none"`,
/// `"required"`, or `{"type": "function", "function": {"name": ...}}`.
pub(crate) fn openai_tool_choice(
    choice: Option<&Value>,
) -> Result<Option<v1::ToolChoice>, ApiError> {
    const MODES: &str = "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(mode)) if mode != "function" => {
            tool_choice(mode, None, OPENAI_WORDS, MODES)
        }
        Some(object @ Value::Object(_)) => {
            let mode = object
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let name = object.pointer("/function/name").and_then(Value::as_str);
            tool_choice(
                if mode.is_empty() { "?" } else { mode },
                name,
                OPENAI_WORDS,
                MODES,
            )
        }
        Some(other) => Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice must be {MODES}; got {other}"),
        )),
    }
}

/// The Responses API's `tool_choice`: as Chat Completions', with the
/// function's name beside `type`.
pub(crate) fn responses_tool_choice(
    choice: Option<&Value>,
) -> Result<Option<v1::ToolChoice>, ApiError> {
    const MODES: &str =
        "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}";
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(mode)) if mode != "function" => {
            tool_choice(mode, None, OPENAI_WORDS, MODES)
        }
        Some(object @ Value::Object(_)) => {
            let mode = object.get("type").and_then(Value::as_str).unwrap_or("?");
            tool_choice(
                mode,
                object.get("name").and_then(Value::as_str),
                OPENAI_WORDS,
                MODES,
            )
        }
        Some(other) => Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice must be {MODES}; got {other}"),
        )),
    }
}

/// Anthropic's `tool_choice`: `{"type": "auto" | "any" | "none"}` or
/// `{"type": "tool", "name": ...}`.
pub(crate) fn anthropic_tool_choice(
    choice: Option<&Value>,
) -> Result<Option<v1::ToolChoice>, ApiError> {
    const MODES: &str = "{\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or {\"type\": \"tool\", \"name\": ...}";
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(object @ Value::Object(_)) => {
            let mode = object.get("type").and_then(Value::as_str).unwrap_or("?");
            tool_choice(
                mode,
                object.get("name").and_then(Value::as_str),
                ("any", "tool"),
                MODES,
            )
        }
        Some(other) => Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice must be {MODES}; got {other}"),
        )),
    }
}

/// A dialect's tool choice with its limit of one call per answer.
pub(crate) fn one_call(choice: Option<v1::ToolChoice>, one_call: bool) -> Option<v1::ToolChoice> {
    match (choice, one_call) {
        (choice, false) => choice,
        (Some(choice), true) => Some(v1::ToolChoice {
            one_call: true,
            ..choice
        }),
        (None, true) => Some(v1::ToolChoice {
            kind: None,
            one_call: true,
        }),
    }
}

/// OpenAI's `logit_bias`: token ids (as JSON object keys) to a bias in
/// [-100, 100] (the range is the engine's check).
pub(crate) fn logit_bias(
    bias: Option<&serde_json::Map<String, Value>>,
) -> Result<std::collections::BTreeMap<u32, f32>, ApiError> {
    const MAX_ENTRIES: usize = 1024;
    let Some(bias) = bias else {
        return Ok(Default::default());
    };
    if bias.len() > MAX_ENTRIES {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("logit_bias takes at most {MAX_ENTRIES} tokens"),
        ));
    }
    bias.iter()
        .map(|(token, value)| {
            let id = token.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias keys are token ids; {token:?} is not one"),
                )
            })?;
            let value = value.as_f64().ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("the bias of token {id} must be a number, got {value}"),
                )
            })?;
            Ok((id, value as f32))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kind(c: Result<Option<v1::OutputConstraint>, ApiError>) -> Option<Kind> {
        c.expect("accepted").and_then(|c| c.kind)
    }

    #[test]
    fn openai_formats_become_constraints_and_unknown_types_are_refused() {
        assert_eq!(kind(response_format(None, "response_format")), None);
        let text = json!({"type": "text"});
        assert_eq!(kind(response_format(Some(&text), "response_format")), None);
        let object = json!({"type": "json_object"});
        assert_eq!(
            kind(response_format(Some(&object), "response_format")),
            Some(Kind::JsonObject(true))
        );
        let schema = json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true,
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}});
        let Some(Kind::JsonSchema(text)) = kind(response_format(Some(&schema), "response_format"))
        else {
            panic!("a schema")
        };
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap()["properties"]["a"]["type"],
            "integer"
        );
        for bad in [json!({"type": "nonsense"}), json!({}), json!("json")] {
            let error = response_format(Some(&bad), "response_format").expect_err("refused");
            assert_eq!(error.param.as_deref(), Some("response_format.type"));
        }
        let no_spec = json!({"type": "json_schema"});
        assert!(response_format(Some(&no_spec), "response_format").is_err());
        let not_object =
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}});
        assert!(response_format(Some(&not_object), "response_format").is_err());
    }

    #[test]
    fn responses_and_ollama_formats_read_the_same_way() {
        let text =
            json!({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}});
        assert!(matches!(
            kind(text_format(Some(&text))),
            Some(Kind::JsonSchema(_))
        ));
        assert!(text_format(Some(&json!({"format": {"type": "yaml"}}))).is_err());
        assert_eq!(
            kind(ollama_format(Some(&json!("json")))),
            Some(Kind::JsonObject(true))
        );
        assert!(matches!(
            kind(ollama_format(Some(&json!({"type": "object"})))),
            Some(Kind::JsonSchema(_))
        ));
        assert_eq!(kind(ollama_format(Some(&json!("")))), None);
        assert!(ollama_format(Some(&json!("xml"))).is_err());
        assert!(ollama_format(Some(&json!(3))).is_err());
    }

    #[test]
    fn tesseras_regex_and_grammar_are_one_constraint_at_most() {
        let regex = RequestExtension {
            regex: Some("[a-z]+".into()),
            ..Default::default()
        };
        assert_eq!(
            kind(with_extension(None, Some(&regex))),
            Some(Kind::Regex("[a-z]+".into()))
        );
        let both = RequestExtension {
            regex: Some("a".into()),
            grammar: Some("start: \"a\"".into()),
            ..Default::default()
        };
        assert!(with_extension(None, Some(&both)).is_err());
        let json = constraint(Kind::JsonObject(true));
        assert!(with_extension(json.clone(), Some(&regex)).is_err());
        assert_eq!(
            kind(with_extension(json, None)),
            Some(Kind::JsonObject(true))
        );
    }

    #[test]
    fn tool_choices_of_each_dialect_are_read_and_bogus_ones_refused() {
        use v1::tool_choice::Kind;
        let kind =
            |c: Result<Option<v1::ToolChoice>, ApiError>| c.expect("accepted").and_then(|c| c.kind);
        assert_eq!(kind(openai_tool_choice(Some(&json!("auto")))), None);
        assert_eq!(kind(openai_tool_choice(Some(&json!("none")))), None);
        assert_eq!(
            kind(openai_tool_choice(Some(&json!("required")))),
            Some(Kind::Required(true))
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            kind(openai_tool_choice(Some(&named))),
            Some(Kind::Function("get_weather".into()))
        );
        for bogus in [
            json!("bogus"),
            json!("function"),
            json!({"type": "function"}),
            json!(3),
            json!({"type": "any"}),
        ] {
            let error = openai_tool_choice(Some(&bogus)).expect_err("refused");
            assert_eq!(error.param.as_deref(), Some("tool_choice"), "{bogus}");
        }
        let named = json!({"type": "function", "name": "f"});
        assert_eq!(
            kind(responses_tool_choice(Some(&named))),
            Some(Kind::Function("f".into()))
        );
        assert_eq!(
            kind(anthropic_tool_choice(Some(&json!({"type": "any"})))),
            Some(Kind::Required(true))
        );
        let tool = json!({"type": "tool", "name": "f"});
        assert_eq!(
            kind(anthropic_tool_choice(Some(&tool))),
            Some(Kind::Function("f".into()))
        );
        assert_eq!(
            kind(anthropic_tool_choice(Some(&json!({"type": "auto"})))),
            None
        );
        assert!(anthropic_tool_choice(Some(&json!("any"))).is_err());
        assert!(anthropic_tool_choice(Some(&json!({"type": "bogus"}))).is_err());
    }

    #[test]
    fn logit_bias_keys_are_token_ids() {
        let bias = json!({"504": -100, "7": 2.5});
        let map = logit_bias(bias.as_object()).expect("accepted");
        assert_eq!(map.get(&504), Some(&-100.0));
        assert_eq!(map.get(&7), Some(&2.5));
        assert!(logit_bias(json!({"hello": 1}).as_object()).is_err());
        assert!(logit_bias(json!({"5": "x"}).as_object()).is_err());
        assert!(logit_bias(None).expect("none").is_empty());
    }
}
