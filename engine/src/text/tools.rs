//! Tools for every model. A model whose chat template renders tools gets
//! them through its template; one whose template does not gets the same
//! tools described in a system instruction ([`instruction`]), in the tool
//! syntax its output is parsed with, as llama.cpp's generic chat format
//! does, instead of losing them.
//!
//! [`grammar`] writes the constraint that makes `tool_choice` true: a call
//! (`required`), a call of one function (a name), or, for `auto`, free text
//! or calls, where a call the model starts is finished under its
//! function's JSON schema. Each is a Lark grammar for the request's
//! constraint ([`crate::serve::Constraint::Lark`]).

use serde_json::{json, Value};

use crate::text::output_parser::{ToolCallSyntax, MISTRAL_TOOL_CALLS_TAG};

/// Which calls a request with tools wants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model chooses between text and calls.
    #[default]
    Auto,
    /// At least one call.
    Required,
    /// Calls of this function only, at least one.
    Function(String),
}

/// Why tools cannot be used as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    #[error("tool {index} has no function name")]
    NoName { index: usize },
    #[error("tool_choice names the function {name:?}, which is not among the tools ({known})")]
    UnknownFunction { name: String, known: String },
    #[error("tool_choice {choice} needs tools")]
    NoTools { choice: &'static str },
}

/// One function: its name and its parameters' JSON schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    pub name: String,
    pub parameters: Value,
}

/// The functions of an OpenAI-style tool list (`{"type": "function",
/// "function": {...}}`, or the function object itself). A function without
/// parameters takes any object.
pub fn functions(tools: &Value) -> Result<Vec<Function>, ToolError> {
    let list = tools.as_array().map(Vec::as_slice).unwrap_or_default();
    list.iter()
        .enumerate()
        .map(|(index, tool)| {
            let function = tool.get("function").unwrap_or(tool);
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or(ToolError::NoName { index })?;
            let parameters = match function.get("parameters") {
                Some(p @ Value::Object(_)) => p.clone(),
                _ => json!({"type": "object"}),
            };
            Ok(Function {
                name: name.to_string(),
                parameters,
            })
        })
        .collect()
}

/// The system instruction that gives tools to a model whose template has
/// no place for them: the tools as JSON, and how to call one in the syntax
/// its output is parsed with.
pub fn instruction(tools: &Value, syntax: &ToolCallSyntax) -> String {
    let listed = serde_json::to_string_pretty(tools).unwrap_or_else(|_| tools.to_string());
    let how = match syntax {
        ToolCallSyntax::BareJson => {
            "answer with only a JSON object: {\"name\": <function name>, \"parameters\": <arguments object>}"
                .to_string()
        }
        ToolCallSyntax::MistralToolCalls => {
            "answer with only [TOOL_CALLS] followed by a JSON list of {\"name\": <function name>, \"arguments\": <arguments object>}"
                .to_string()
        }
        ToolCallSyntax::TaggedJson { open, close } => format!(
            "answer with only\n{open}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n{close}\n(one such block per call)"
        ),
        ToolCallSyntax::None => format!(
            "answer with only\n<tool_call>\n{}\n</tool_call>",
            "{\"name\": <function name>, \"arguments\": <arguments object>}"
        ),
    };
    format!(
        "You can call these functions:\n{listed}\n\nTo call a function, {how}. \
         Otherwise, answer the user directly."
    )
}

/// How a grammar writes a tag: a control token by its id (text can never
/// spell it), anything else as a literal.
pub trait TagTokens {
    fn control_id(&self, tag: &str) -> Option<u32>;
}

/// What the answer is held to besides tool calls, under `auto`.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Any text (that is not a call).
    Free,
    /// JSON under this schema (a response format).
    Json(Value),
    /// Text matching this regex.
    Regex(String),
}

/// Which calls, and how many.
#[derive(Clone, Copy, Debug)]
pub struct Calls<'a> {
    pub choice: &'a ToolChoice,
    /// Several calls in one answer; else one at most.
    pub parallel: bool,
}

/// The Lark grammar that holds a generation to `calls` over `functions`
/// in `syntax`, with `answer` as the alternative to calls under `auto`.
pub fn grammar(
    functions: &[Function],
    calls: &Calls<'_>,
    syntax: &ToolCallSyntax,
    answer: &Answer,
    tags: &dyn TagTokens,
) -> Result<String, ToolError> {
    let choice = calls.choice;
    let chosen: Vec<&Function> = match choice {
        ToolChoice::Function(name) => {
            let found: Vec<&Function> = functions.iter().filter(|f| &f.name == name).collect();
            if found.is_empty() {
                let known: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
                return Err(ToolError::UnknownFunction {
                    name: name.clone(),
                    known: known.join(", "),
                });
            }
            found
        }
        _ => functions.iter().collect(),
    };
    if chosen.is_empty() {
        let choice = if *choice == ToolChoice::Auto {
            "auto"
        } else {
            "required"
        };
        return Err(ToolError::NoTools { choice });
    }
    let forced = *choice != ToolChoice::Auto;
    Ok(match syntax {
        ToolCallSyntax::BareJson => {
            let schema = tessera_grammar::with_layout(&call_schema(&chosen, "parameters"));
            let call = format!("%json {schema}");
            alternatives(forced, &call, answer, "{", tags)
        }
        ToolCallSyntax::MistralToolCalls => {
            let mut array = json!({"type": "array", "minItems": 1,
                                   "items": call_schema(&chosen, "arguments")});
            if !calls.parallel {
                array["maxItems"] = json!(1);
            }
            let schema = tessera_grammar::with_layout(&array);
            let call = format!("{} %json {schema}", tag(tags, MISTRAL_TOOL_CALLS_TAG));
            alternatives(forced, &call, answer, MISTRAL_TOOL_CALLS_TAG, tags)
        }
        ToolCallSyntax::TaggedJson { open, close } => {
            let block = Block {
                open,
                close,
                parallel: calls.parallel,
            };
            tagged(&chosen, &block, forced, answer, tags)
        }
        ToolCallSyntax::None => {
            let block = Block {
                open: "<tool_call>",
                close: "</tool_call>",
                parallel: calls.parallel,
            };
            tagged(&chosen, &block, forced, answer, tags)
        }
    })
}

/// The JSON schema of one call: `{"name": <one of chosen>, <key>: its
/// parameters}`.
fn call_schema(chosen: &[&Function], arguments_key: &str) -> Value {
    let one = |f: &Function| {
        json!({"type": "object", "additionalProperties": false,
               "required": ["name", arguments_key],
               "properties": {"name": {"const": f.name}, arguments_key: f.parameters}})
    };
    match chosen {
        [single] => one(single),
        many => json!({"anyOf": many.iter().map(|f| one(f)).collect::<Vec<_>>()}),
    }
}

/// A tagged call's markers, and whether several blocks may follow.
struct Block<'a> {
    open: &'a str,
    close: &'a str,
    parallel: bool,
}

/// `<tool_call>\n{...}\n</tool_call>` blocks (a newline between, one
/// unless `parallel`), or under `auto` the answer without the open tag, or
/// text up to the open tag and then calls.
fn tagged(
    chosen: &[&Function],
    block: &Block<'_>,
    forced: bool,
    answer: &Answer,
    tags: &dyn TagTokens,
) -> String {
    let Block { open, close, .. } = *block;
    let more = if block.parallel {
        " (\"\\n\" call)*"
    } else {
        ""
    };
    let schema = tessera_grammar::with_layout(&call_schema(chosen, "arguments"));
    let body = format!(
        "call_body: \"\\n\" %json {schema} \"\\n\" {}\n",
        tag(tags, close)
    );
    let call = format!("call: {} call_body\n", tag(tags, open));
    if forced {
        return format!("start: call{more}\n{call}{body}");
    }
    let answer_rule = answer_rule(answer, open, tags);
    if tags.control_id(open).is_some() {
        // Text cannot spell a control token: calls may follow any text.
        return format!(
            "start: answer | TEXT? call{more}\n{answer_rule}TEXT: /(?s:.+)/\n{call}{body}"
        );
    }
    let open_regex = regex_escape(open);
    format!(
        "start: answer | before_call call_body{more}\n{answer_rule}\
         before_call[lazy]: /(?s:.*){open_regex}/\n{call}{body}"
    )
}

/// The answer that is not a call, as a rule; free text may not contain the
/// call's opening `marker`.
fn answer_rule(answer: &Answer, marker: &str, tags: &dyn TagTokens) -> String {
    match answer {
        Answer::Json(schema) => format!("answer: %json {}\n", tessera_grammar::with_layout(schema)),
        Answer::Regex(regex) => format!("answer: /{}/\n", regex.replace('/', "\\/")),
        Answer::Free if tags.control_id(marker).is_some() => "answer: /(?s:.*)/\n".to_string(),
        Answer::Free => format!(
            "answer: FREE\nFREE: /(?s:.*)/ & ~/(?s:.*{}.*)/\n",
            regex_escape(marker)
        ),
    }
}

/// A single call (BareJson, Mistral) or, under `auto`, the answer; free
/// text may not start with the call's `marker`.
fn alternatives(
    forced: bool,
    call: &str,
    answer: &Answer,
    marker: &str,
    tags: &dyn TagTokens,
) -> String {
    if forced {
        return format!("start: {call}\n");
    }
    let answer = match answer {
        Answer::Free if tags.control_id(marker).is_none() => format!(
            "answer: FREE\nFREE: /(?s:.*)/ & ~/{}(?s:.*)/\n",
            regex_escape(marker)
        ),
        other => answer_rule(other, marker, tags),
    };
    format!("start: answer | {call}\n{answer}")
}

fn tag(tags: &dyn TagTokens, text: &str) -> String {
    match tags.control_id(text) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(text).unwrap_or_else(|_| format!("{text:?}")),
    }
}

/// `text` as a regex that matches it literally, inside Lark's `/.../`.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&~-/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoControl;
    impl TagTokens for NoControl {
        fn control_id(&self, _: &str) -> Option<u32> {
            None
        }
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
               {"type": "function", "function": {"name": "get_time"}}])
    }

    #[test]
    fn functions_are_read_from_either_shape_and_need_names() {
        let fs = functions(&weather()).unwrap();
        assert_eq!(fs[0].name, "get_weather");
        assert_eq!(fs[1].parameters, json!({"type": "object"}));
        let bare = functions(&json!([{"name": "f", "parameters": {"type": "object"}}])).unwrap();
        assert_eq!(bare[0].name, "f");
        assert_eq!(
            functions(&json!([{"type": "function", "function": {}}])),
            Err(ToolError::NoName { index: 0 })
        );
    }

    #[test]
    fn every_syntax_and_choice_compiles() {
        let fs = functions(&weather()).unwrap();
        let syntaxes = [
            ToolCallSyntax::TaggedJson {
                open: "<tool_call>".into(),
                close: "</tool_call>".into(),
            },
            ToolCallSyntax::BareJson,
            ToolCallSyntax::MistralToolCalls,
            ToolCallSyntax::None,
        ];
        let choices = [
            ToolChoice::Auto,
            ToolChoice::Required,
            ToolChoice::Function("get_time".into()),
        ];
        let answers = [
            Answer::Free,
            Answer::Json(json!({"type": "object"})),
            Answer::Regex("[a-z]+".into()),
        ];
        for syntax in &syntaxes {
            for choice in &choices {
                for answer in &answers {
                    for parallel in [true, false] {
                        let calls = Calls { choice, parallel };
                        let lark = grammar(&fs, &calls, syntax, answer, &NoControl).unwrap();
                        let checked = tessera_grammar::check(&tessera_grammar::Constraint::Lark(
                            lark.clone(),
                        ));
                        assert!(
                            checked.is_ok(),
                            "{syntax:?} {choice:?} {answer:?}: {checked:?}\n{lark}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_unknown_function_or_no_tools_is_refused() {
        let fs = functions(&weather()).unwrap();
        let syntax = ToolCallSyntax::BareJson;
        let nope = ToolChoice::Function("nope".into());
        let calls = |choice| Calls {
            choice,
            parallel: true,
        };
        let unknown = grammar(&fs, &calls(&nope), &syntax, &Answer::Free, &NoControl);
        assert!(
            matches!(unknown, Err(ToolError::UnknownFunction { .. })),
            "{unknown:?}"
        );
        let none = grammar(
            &[],
            &calls(&ToolChoice::Required),
            &syntax,
            &Answer::Free,
            &NoControl,
        );
        assert_eq!(none, Err(ToolError::NoTools { choice: "required" }));
    }

    #[test]
    fn the_instruction_lists_the_tools_and_the_syntax() {
        let text = instruction(
            &weather(),
            &ToolCallSyntax::TaggedJson {
                open: "<tool_call>".into(),
                close: "</tool_call>".into(),
            },
        );
        assert!(
            text.contains("get_weather") && text.contains("<tool_call>\n{\"name\""),
            "{text}"
        );
    }
}
