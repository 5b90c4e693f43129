//! The one validation of a generation's parameters, at the edge: every
//! dialect's parameters go through the engine's own mapping and checks
//! (`tessera_actors::runner::request::request_from`, which the runner runs
//! too) before anything is placed or sent, so a runner never meets a
//! request it would refuse, and no dialect's limits drift from the engine's.

use tessera_actors::runner::request::{request_from, RequestError};
use tessera_engine::serve::sampler::SamplingError;
use tessera_protos::v1;

use crate::error::ApiError;

/// `params` if the engine would run them; else a 400 naming the field,
/// written as the dialect names it (`prefix`: Ollama's `options.`;
/// `constraint_param`: the field of the output constraint, e.g.
/// `response_format`).
pub(crate) fn checked(
    params: v1::TextGenerationParams,
    prefix: &str,
    constraint_param: &str,
) -> Result<v1::TextGenerationParams, ApiError> {
    match request_from(&params) {
        Ok(_) => Ok(params),
        Err(RequestError::Sampling(SamplingError::InvalidParameter {
            field,
            value,
            requirement,
        })) => Err(ApiError::invalid(
            &format!("{prefix}{field}"),
            format!("{field} must be {requirement}, got {value}"),
        )),
        Err(error @ (RequestError::Constraint(_) | RequestError::SchemaNotJson(_))) => {
            Err(ApiError::invalid(constraint_param, error.to_string()))
        }
        Err(error @ RequestError::Tools(_)) => {
            Err(ApiError::invalid("tool_choice", error.to_string()))
        }
        Err(error) => Err(ApiError::bad_request(error.to_string())),
    }
}

/// A limit on the tokens to generate, named `param` in the dialect: at
/// least one, and no more than the model's context (0: unknown).
pub(crate) fn token_limit(param: &str, limit: Option<u32>, context: u32) -> Result<(), ApiError> {
    let name = param.rsplit('.').next().unwrap_or(param);
    match limit {
        Some(0) => Err(ApiError::invalid(
            param,
            format!("{name} must be at least 1"),
        )),
        Some(n) if context > 0 && n > context => Err(ApiError::invalid(
            param,
            format!("{name} {n} is beyond the model's context of {context} tokens"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(sampling: v1::SamplingParams) -> v1::TextGenerationParams {
        v1::TextGenerationParams {
            model_id: "m".into(),
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            sampling: Some(sampling),
            ..Default::default()
        }
    }

    #[test]
    fn the_engines_limits_are_the_edges() {
        let refused = |sampling: v1::SamplingParams, prefix: &str| {
            checked(params(sampling), prefix, "")
                .err()
                .and_then(|e| e.param)
        };
        let top_p_zero = v1::SamplingParams {
            top_p: Some(0.0),
            ..Default::default()
        };
        assert_eq!(refused(top_p_zero.clone(), ""), Some("top_p".into()));
        assert_eq!(
            refused(top_p_zero, "options."),
            Some("options.top_p".into())
        );
        let too_many = v1::SamplingParams {
            top_logprobs: 21,
            ..Default::default()
        };
        assert_eq!(refused(too_many, ""), Some("top_logprobs".into()));
        let nan = v1::SamplingParams {
            repetition_penalty: Some(f32::NAN),
            ..Default::default()
        };
        assert_eq!(refused(nan, ""), Some("repetition_penalty".into()));
        let fine = v1::SamplingParams {
            temperature: Some(0.7),
            top_p: Some(0.9),
            top_logprobs: 20,
            ..Default::default()
        };
        assert!(checked(params(fine), "", "").is_ok());
    }

    #[test]
    fn a_token_limit_is_at_least_one_and_within_the_context() {
        let param = |limit, context| token_limit("options.num_predict", limit, context).err();
        assert!(param(Some(0), 0).is_some_and(|e| e.message == "num_predict must be at least 1"));
        assert!(
            param(Some(9), 8).is_some_and(|e| e.param.as_deref() == Some("options.num_predict"))
        );
        assert!(
            param(Some(9), 0).is_none(),
            "an unknown context bounds nothing"
        );
        assert!(param(None, 8).is_none());
    }

    #[test]
    fn a_request_with_no_prompt_is_refused() {
        let empty = v1::TextGenerationParams {
            model_id: "m".into(),
            ..Default::default()
        };
        assert!(checked(empty, "", "").is_err());
    }
}
