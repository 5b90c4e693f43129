//! The dashboard's files (`dashboard/` at the repository's root): the page
//! at `/`, its scripts and styles under `/assets/`. A release build embeds
//! them, so a node serves its dashboard offline with nothing beside the
//! binary; a debug build reads the folder at run time (edit, reload).

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

#[derive(rust_embed::Embed)]
#[folder = "../dashboard/"]
struct Files;

/// The page may load only what its own node serves: no script, style,
/// font or connection elsewhere (the cluster runs on a LAN, often offline).
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; img-src 'self' data:; \
     style-src 'self'; script-src 'self'; connect-src 'self'; \
     object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

/// `GET /`.
pub(super) async fn index(headers: HeaderMap) -> Response {
    serve("index.html", &headers)
}

/// `GET /assets/{*path}`.
pub(super) async fn asset(Path(path): Path<String>, headers: HeaderMap) -> Response {
    serve(&format!("assets/{path}"), &headers)
}

/// One file, with its type, a strong ETag (its SHA-256) so a reload costs
/// a 304, and the page's security headers.
fn serve(path: &str, request: &HeaderMap) -> Response {
    let Some(file) = Files::get(path) else {
        return ApiError::not_found("not_found", format!("no dashboard file {path:?}"))
            .into_response();
    };
    let etag = format!("\"{}\"", hex(&file.metadata.sha256_hash()));
    let mut response = if request
        .get(header::IF_NONE_MATCH)
        .is_some_and(|tag| tag.as_bytes() == etag.as_bytes())
    {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        file.data.into_owned().into_response()
    };
    let headers = response.headers_mut();
    if let Ok(kind) = HeaderValue::from_str(file.metadata.mimetype()) {
        headers.insert(header::CONTENT_TYPE, kind);
    }
    if let Ok(etag) = HeaderValue::from_str(&etag) {
        headers.insert(header::ETAG, etag);
    }
    // Revalidate every time: a node upgraded in place serves new files.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_and_its_assets_are_served_with_their_types() {
        let page = serve("index.html", &HeaderMap::new());
        assert_eq!(page.status(), StatusCode::OK);
        let kind = page.headers().get(header::CONTENT_TYPE).cloned();
        assert_eq!(kind, Some(HeaderValue::from_static("text/html")));
        assert!(page.headers().contains_key(header::CONTENT_SECURITY_POLICY));
        let script = Files::iter().find(|p| p.ends_with(".js"));
        let script = script.map(|p| serve(&p, &HeaderMap::new()));
        let kind = script.and_then(|s| s.headers().get(header::CONTENT_TYPE).cloned());
        assert_eq!(kind, Some(HeaderValue::from_static("text/javascript")));
    }

    #[test]
    fn a_known_etag_is_a_304_and_a_missing_file_a_404() {
        let first = serve("index.html", &HeaderMap::new());
        let Some(etag) = first.headers().get(header::ETAG).cloned() else {
            panic!("no ETag");
        };
        let mut again = HeaderMap::new();
        again.insert(header::IF_NONE_MATCH, etag);
        assert_eq!(
            serve("index.html", &again).status(),
            StatusCode::NOT_MODIFIED
        );
        let missing = serve("assets/../../Cargo.toml", &HeaderMap::new());
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    }

    /// The bound: the whole dashboard under 500 KB.
    #[test]
    fn the_dashboard_is_small() {
        let total: usize = Files::iter()
            .filter_map(|path| Files::get(&path))
            .map(|file| file.data.len())
            .sum();
        assert!(total > 1000, "the dashboard is missing: {total} bytes");
        assert!(total < 500_000, "the dashboard is {total} bytes");
    }
}
