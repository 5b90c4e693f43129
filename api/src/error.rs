//! Errors as each API writes them: OpenAI's `{"error": {message, type,
//! param, code}}` with the matching status code. The domain's error kind
//! (`AdminErrorKind`: admin refusals, error chunks) has one HTTP status,
//! given here ([`status_of`]); each dialect writes an [`ApiError`] in its
//! own shape from that status.

use std::marker::PhantomData;

use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tessera_actors::admin::{self, AdminFailure};
use tessera_actors::generation::{GenerationError, INSTANCE_LOST};
use tessera_protos::v1::{self, AdminErrorKind};

/// The one mapping from the domain's error kind to the HTTP status.
pub fn status_of(kind: AdminErrorKind) -> StatusCode {
    match kind {
        AdminErrorKind::InvalidArgument | AdminErrorKind::DoesNotFit => StatusCode::BAD_REQUEST,
        AdminErrorKind::NotFound => StatusCode::NOT_FOUND,
        AdminErrorKind::Conflict => StatusCode::CONFLICT,
        AdminErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        AdminErrorKind::Internal | AdminErrorKind::Unspecified => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// OpenAI's error type for a status.
fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// An error answered to an HTTP client.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's error type, e.g. "invalid_request_error".
    pub kind: &'static str,
    /// A stable code, e.g. "model_not_found".
    pub code: Option<&'static str>,
    /// The request field at fault.
    pub param: Option<String>,
    /// Seconds after which a retry may succeed (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code: None,
            param: None,
            retry_after: None,
        }
    }

    /// An error of the domain's `kind`, with its status (a 503 may be
    /// retried after a second).
    pub fn of(kind: AdminErrorKind, message: impl Into<String>) -> Self {
        let status = status_of(kind);
        Self {
            retry_after: (status == StatusCode::SERVICE_UNAVAILABLE).then_some(1),
            ..Self::new(status, openai_type(status), message)
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::of(AdminErrorKind::InvalidArgument, message)
    }

    /// A bad value in field `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::bad_request(message)
        }
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code: Some(code),
            ..Self::of(AdminErrorKind::NotFound, message)
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::of(AdminErrorKind::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::of(AdminErrorKind::Internal, message)
    }

    pub fn too_many(message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            code: Some("queue_full"),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    /// A body that could not be read: too large (413) or broken (400).
    pub fn from_rejection(rejection: BytesRejection) -> Self {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            Self::new(
                status,
                "invalid_request_error",
                "the request body is too large",
            )
        } else {
            Self::new(status, "invalid_request_error", rejection.body_text())
        }
    }

    /// The OpenAI error object.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// An admin refusal; its kind is the error's code.
impl From<AdminFailure> for ApiError {
    fn from(failure: AdminFailure) -> Self {
        let kind = failure.kind();
        Self {
            code: Some(admin::kind_name(kind)),
            ..Self::of(kind, failure.message())
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        respond(&self, self.body())
    }
}

/// How a dialect writes an error's body (the status is the error's).
pub trait ErrorShape {
    fn body(error: &ApiError) -> serde_json::Value;
}

/// An error answered in the shape of dialect `S`.
pub struct Shaped<S>(ApiError, PhantomData<S>);

impl<S> From<ApiError> for Shaped<S> {
    fn from(error: ApiError) -> Self {
        Self(error, PhantomData)
    }
}

impl<S: ErrorShape> IntoResponse for Shaped<S> {
    fn into_response(self) -> Response {
        respond(&self.0, S::body(&self.0))
    }
}

/// The error's status and `body`, with Retry-After where it says when.
fn respond(error: &ApiError, body: serde_json::Value) -> Response {
    let mut response = (error.status, axum::Json(body)).into_response();
    if let Some(seconds) = error.retry_after {
        if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
    }
    response
}

/// An error chunk as an HTTP error (before any answer was sent).
pub fn chunk_error(error: &v1::ErrorChunk) -> ApiError {
    match error.kind.as_str() {
        "not_found" => ApiError::not_found("model_not_found", error.message.clone()),
        "invalid_request" => ApiError::bad_request(error.message.clone()),
        "cancelled" | INSTANCE_LOST => ApiError::unavailable(error.message.clone()),
        _ => ApiError::internal(format!("{} ({})", error.message, error.kind)),
    }
}

impl From<GenerationError> for ApiError {
    fn from(error: GenerationError) -> Self {
        match error {
            GenerationError::Unavailable(message) => ApiError::unavailable(message),
            GenerationError::Internal(message) => ApiError::internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_one_status() {
        let cases = [
            (
                AdminErrorKind::InvalidArgument,
                400,
                "invalid_request_error",
            ),
            (AdminErrorKind::DoesNotFit, 400, "invalid_request_error"),
            (AdminErrorKind::NotFound, 404, "invalid_request_error"),
            (AdminErrorKind::Conflict, 409, "invalid_request_error"),
            (AdminErrorKind::Unavailable, 503, "server_error"),
            (AdminErrorKind::Internal, 500, "server_error"),
            (AdminErrorKind::Unspecified, 500, "server_error"),
        ];
        for (kind, status, openai) in cases {
            let error = ApiError::of(kind, "m");
            assert_eq!(error.status.as_u16(), status, "{kind:?}");
            assert_eq!(error.kind, openai, "{kind:?}");
            assert_eq!(error.retry_after.is_some(), status == 503, "{kind:?}");
        }
    }

    #[test]
    fn an_admin_refusal_keeps_its_kind_as_the_code() {
        // The master's strings, as an old master writes them.
        for (kind, status) in [
            ("invalid_argument", 400),
            ("not_found", 404),
            ("conflict", 409),
            ("does_not_fit", 400),
            ("unavailable", 503),
            ("internal", 500),
        ] {
            let wire = tessera_protos::v1::AdminError {
                kind: kind.into(),
                message: "why".into(),
                kind_code: 0,
            };
            let error = ApiError::from(AdminFailure::from_proto(&wire));
            assert_eq!(error.status.as_u16(), status, "{kind}");
            assert_eq!(error.code, Some(kind));
            assert_eq!(error.message, "why");
        }
        let refused = ApiError::from(AdminFailure::Conflict("in use".into()));
        assert_eq!(
            refused.body(),
            json!({"error": {
                "message": "in use",
                "type": "invalid_request_error",
                "param": null,
                "code": "conflict",
            }})
        );
    }

    #[test]
    fn errors_take_openais_shape_and_status() {
        let error = ApiError::invalid("messages", "messages must not be empty");
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            error.body(),
            json!({"error": {
                "message": "messages must not be empty",
                "type": "invalid_request_error",
                "param": "messages",
                "code": null,
            }})
        );
        let busy = ApiError::too_many("queue full").into_response();
        assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            busy.headers().get(header::RETRY_AFTER),
            Some(&HeaderValue::from_static("1"))
        );
    }
}
