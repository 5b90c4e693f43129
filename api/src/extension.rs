//! tessera's own fields in the dialects' bodies: the `tessera` object a
//! request may carry (`speculative`, and the output constraints `regex` and
//! `grammar`; clients that do not send it are unaffected), and the
//! `tessera` object of an answer's usage (extra keys the official clients
//! keep or ignore).

use serde::Deserialize;
use serde_json::{json, Value};
use tessera_protos::v1;

/// The `tessera` object of a request body, in every dialect.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RequestExtension {
    /// false: this request never drafts, even on an instance with
    /// speculative decoding (to compare, or where a draft slows it down);
    /// unset or true: it drafts when its instance does.
    #[serde(default)]
    pub speculative: Option<bool>,
    /// The output matches this regular expression (Rust regex syntax),
    /// whole.
    #[serde(default)]
    pub regex: Option<String>,
    /// The output is text of this grammar (llguidance's Lark syntax).
    #[serde(default)]
    pub grammar: Option<String>,
}

/// What `TextGenerationParams.speculative` gets from a request's object.
pub fn speculative(extension: Option<&RequestExtension>) -> Option<bool> {
    extension.and_then(|e| e.speculative)
}

/// The `tessera` object of an answer's usage: speculative decoding's
/// figures (all 0 when the instance has no draft or the request opted out).
pub fn usage_extension(usage: &v1::Usage) -> Value {
    json!({
        "draft_tokens": usage.draft_tokens,
        "accepted_draft_tokens": usage.accepted_draft_tokens,
        "decode_steps": usage.decode_steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Body {
        #[serde(default)]
        tessera: Option<RequestExtension>,
    }

    fn parsed(text: &str) -> Result<Option<bool>, String> {
        serde_json::from_str::<Body>(text)
            .map(|b| speculative(b.tessera.as_ref()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_opt_out_is_read_and_its_absence_changes_nothing() {
        assert_eq!(parsed("{}"), Ok(None));
        assert_eq!(parsed(r#"{"tessera": {}}"#), Ok(None));
        assert_eq!(parsed(r#"{"tessera": null}"#), Ok(None));
        assert_eq!(
            parsed(r#"{"tessera": {"speculative": false}}"#),
            Ok(Some(false))
        );
        assert_eq!(
            parsed(r#"{"tessera": {"speculative": true}}"#),
            Ok(Some(true))
        );
        let typo = parsed(r#"{"tessera": {"speculate": false}}"#).expect_err("unknown");
        assert!(typo.contains("speculate"), "{typo}");
        assert!(parsed(r#"{"tessera": {"speculative": "no"}}"#).is_err());
    }

    #[test]
    fn usage_figures_are_named() {
        let usage = v1::Usage {
            draft_tokens: 12,
            accepted_draft_tokens: 9,
            decode_steps: 5,
            ..Default::default()
        };
        assert_eq!(
            usage_extension(&usage),
            json!({"draft_tokens": 12, "accepted_draft_tokens": 9, "decode_steps": 5})
        );
    }
}
