//! The request fields a dialect defines that tessera does not map: each is
//! either not applicable (it changes nothing a cluster does: `user`,
//! `metadata`, `keep_alive`…; accepted, and named so in the README), or
//! refused with a 400 naming it unless it asks for nothing (`n: 1`,
//! `modalities: ["text"]`, `thinking: {"type": "disabled"}`). A field no
//! dialect defines is a 400 too, as OpenAI answers one: nothing a client
//! sends is accepted and then ignored.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// A field tessera refuses, unless its value asks for nothing.
pub(crate) struct Refused {
    pub name: &'static str,
    /// What to say (after "`name` is not supported").
    pub why: &'static str,
    /// Whether a value asks for nothing, and so passes.
    pub neutral: fn(&Value) -> bool,
}

/// A dialect's fields beyond those it maps.
pub(crate) struct Extras {
    pub not_applicable: &'static [&'static str],
    pub refused: &'static [Refused],
}

/// Null, false, empty, or zero: a value that asks for nothing.
pub(crate) fn nothing(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
    }
}

impl Extras {
    /// `fields` (what the request had besides the mapped fields) if each is
    /// not applicable or neutral; else a 400 naming the first that is not.
    pub(crate) fn check(&self, fields: &Map<String, Value>) -> Result<(), ApiError> {
        self.check_in(fields, "")
    }

    /// [`Extras::check`] for the fields of a nested object at `at` (e.g.
    /// `messages[2]`), which the 400 names as `at.field`.
    pub(crate) fn check_in(&self, fields: &Map<String, Value>, at: &str) -> Result<(), ApiError> {
        for (name, value) in fields {
            if self.not_applicable.contains(&name.as_str()) {
                continue;
            }
            let path = if at.is_empty() {
                name.clone()
            } else {
                format!("{at}.{name}")
            };
            match self.refused.iter().find(|r| r.name == name) {
                Some(refused) if (refused.neutral)(value) => {}
                Some(refused) => {
                    return Err(ApiError::invalid(
                        &path,
                        format!("`{path}` is not supported: {}", refused.why),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        &path,
                        format!("unrecognized request field `{path}`"),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Fields of an object inside a request (a message, a content part, a
/// tool) that tessera does not map: none, unless a dialect lists some.
pub(crate) const NONE: Extras = Extras {
    not_applicable: &[],
    refused: &[],
};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const EXTRAS: Extras = Extras {
        not_applicable: &["user"],
        refused: &[Refused {
            name: "audio",
            why: "text only",
            neutral: nothing,
        }],
    };

    fn fields(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn not_applicable_and_neutral_fields_pass_and_the_rest_are_named() {
        assert!(EXTRAS
            .check(&fields(json!({"user": "u1", "audio": null})))
            .is_ok());
        let refused = EXTRAS
            .check(&fields(json!({"audio": {"voice": "x"}})))
            .expect_err("refused");
        assert_eq!(refused.param.as_deref(), Some("audio"));
        assert!(refused.message.contains("text only"), "{}", refused.message);
        let unknown = EXTRAS
            .check(&fields(json!({"temprature": 1})))
            .expect_err("refused");
        assert_eq!(unknown.param.as_deref(), Some("temprature"));
    }

    #[test]
    fn a_nested_objects_fields_are_named_by_their_path() {
        let refused = EXTRAS
            .check_in(&fields(json!({"audio": "x"})), "messages[2]")
            .expect_err("refused");
        assert_eq!(refused.param.as_deref(), Some("messages[2].audio"));
        assert!(refused.message.contains("messages[2].audio"));
        let unknown = NONE
            .check_in(
                &fields(json!({"cache_control": {}})),
                "messages[0].content[1]",
            )
            .expect_err("refused");
        assert_eq!(
            unknown.param.as_deref(),
            Some("messages[0].content[1].cache_control")
        );
        assert!(NONE.check_in(&Map::new(), "x").is_ok());
    }
}
