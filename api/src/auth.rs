//! API keys: with any configured, every endpoint but the dashboard's
//! static files asks for one, as OpenAI and Ollama clients send it
//! (`Authorization: Bearer KEY`) or as Anthropic clients do (`x-api-key`).
//! A refusal is a 401 in the dialect's own error shape, with
//! `WWW-Authenticate`, so each official client raises its authentication
//! error.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::{anthropic, ollama};

/// The keys a node accepts, kept as BLAKE3 hashes: every comparison is of
/// two 32-byte digests in constant time (`blake3::Hash`'s equality), so
/// neither a key's bytes nor its length show in the time a refusal takes.
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<Vec<blake3::Hash>>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// The non-blank keys of `keys`, trimmed.
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        let hashes = keys
            .into_iter()
            .map(|key| key.trim().to_string())
            .filter(|key| !key.is_empty())
            .map(|key| blake3::hash(key.as_bytes()))
            .collect();
        Self(Arc::new(hashes))
    }

    /// No key configured: the API is open.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether `key` is one of them (every stored key is compared).
    fn accepts(&self, key: &str) -> bool {
        let asked = blake3::hash(key.as_bytes());
        self.0
            .iter()
            .fold(false, |found, known| found | (*known == asked))
    }
}

/// The key a request carries, from either header.
fn presented(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then_some(token.trim())
        });
    bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// The dashboard's page and scripts hold no data: they load without a key
/// and then ask the person for one. A joining machine has no key either:
/// its join token's HMAC is what `/cluster/join` checks.
fn is_public(path: &str) -> bool {
    path == "/" || path.starts_with("/assets/") || path == "/cluster/join"
}

/// The middleware: passes a request with a good key (or any, when no key
/// is configured) and answers 401 to the rest.
pub(super) async fn require_key(
    State(keys): State<ApiKeys>,
    request: Request,
    next: Next,
) -> Response {
    if keys.is_empty() || is_public(request.uri().path()) {
        return next.run(request).await;
    }
    match presented(request.headers()) {
        Some(key) if keys.accepts(key) => next.run(request).await,
        Some(_) => refusal(request.uri().path(), "the API key is not valid"),
        None => refusal(
            request.uri().path(),
            "this node needs an API key: send it as `Authorization: Bearer KEY` \
             (or `x-api-key: KEY`)",
        ),
    }
}

/// A 401 in the shape of the dialect `path` belongs to.
fn refusal(path: &str, message: &str) -> Response {
    let error = ApiError {
        code: Some("invalid_api_key"),
        ..ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
    };
    let body = if path.starts_with("/v1/messages") {
        anthropic::error_body(&error)
    } else if path.starts_with("/api/") {
        ollama::error_body(&error)
    } else {
        error.body()
    };
    let mut response = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"tessera\""),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            if let Ok(value) = HeaderValue::from_str(value) {
                map.insert(*name, value);
            }
        }
        map
    }

    #[test]
    fn keys_are_matched_whole_from_either_header() {
        let keys = ApiKeys::new(["  sk-one ".to_string(), String::new(), "sk-two".into()]);
        assert_eq!(keys.len(), 2);
        assert!(keys.accepts("sk-one") && keys.accepts("sk-two"));
        assert!(!keys.accepts("sk-on") && !keys.accepts("sk-one ") && !keys.accepts(""));
        let bearer = headers(&[("authorization", "Bearer sk-two")]);
        assert_eq!(presented(&bearer), Some("sk-two"));
        let lower = headers(&[("authorization", "bearer  sk-two ")]);
        assert_eq!(presented(&lower), Some("sk-two"));
        let anthropic = headers(&[("x-api-key", "sk-one")]);
        assert_eq!(presented(&anthropic), Some("sk-one"));
        let basic = headers(&[("authorization", "Basic c2s=")]);
        assert_eq!(presented(&basic), None);
        assert!(ApiKeys::new(Vec::new()).is_empty());
    }

    #[test]
    fn a_refusal_is_a_401_in_the_dialect_of_its_path() {
        let openai = refusal("/v1/chat/completions", "no");
        assert_eq!(openai.status(), StatusCode::UNAUTHORIZED);
        assert!(openai.headers().contains_key(header::WWW_AUTHENTICATE));
        let anthropic = refusal("/v1/messages", "no");
        assert_eq!(anthropic.status(), StatusCode::UNAUTHORIZED);
        assert!(is_public("/") && is_public("/assets/app.js"));
        assert!(!is_public("/state") && !is_public("/v1/models"));
    }
}
