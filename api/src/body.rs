//! A request's body: JSON into the dialect's type, or a 400 naming why.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;

use super::error::ApiError;

pub(super) fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(ApiError::from_rejection)?;
    serde_json::from_slice(&body).map_err(|e| {
        if e.is_data() {
            ApiError::bad_request(format!("the request does not match the API: {e}"))
        } else {
            ApiError::bad_request(format!("the body is not valid JSON: {e}"))
        }
    })
}
