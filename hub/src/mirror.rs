//! A local hub: serves `ROOT/OWNER/NAME/...` over the hub's protocol.
//!
//! - `GET /api/models/{owner}/{name}/revision/{rev}` lists the files with
//!   sizes and SHA-256 (in the hub's `siblings` / `lfs` shape);
//! - `GET /{owner}/{name}/resolve/{rev}/{path}` serves a file, with `Range`
//!   (206 / 416), `ETag` and `X-Linked-Etag` carrying its SHA-256, and
//!   `X-Repo-Commit`.
//!
//! [`Faults`] make it misbehave on purpose for tests: answer `429` with a
//! `Retry-After`, cut a response off after some bytes, or corrupt one.
//! [`MirrorStats`] count what it served.

use std::collections::{HashMap, HashSet};
use std::io::SeekFrom;
use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::BytesMut;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::client::hash_file;

/// Files from this size on are listed as LFS files.
const LFS_FROM: u64 = 10 << 20;
/// Bytes read from disk per body chunk.
const CHUNK: usize = 1 << 20;

/// Misbehaviour to show the client's resilience. Paths are
/// `OWNER/NAME/PATH` keys.
#[derive(Debug, Default)]
pub struct Faults {
    rate_limited: AtomicU32,
    retry_after_secs: AtomicU64,
    cut: Mutex<HashMap<String, u64>>,
    corrupt: Mutex<HashSet<String>>,
    /// Bytes a second each file response is paced to; 0: as fast as it can.
    bytes_per_second: AtomicU64,
}

impl Faults {
    /// Every file response from now on sends at most `bytes_per_second`
    /// (0: no bound), as a slow link would: a download then takes long
    /// enough to watch its progress.
    pub fn limit_rate(&self, bytes_per_second: u64) {
        self.bytes_per_second
            .store(bytes_per_second, Ordering::SeqCst);
    }

    /// The next `requests` file requests get `429` with `Retry-After: secs`.
    pub fn rate_limit(&self, requests: u32, secs: u64) {
        self.retry_after_secs.store(secs, Ordering::SeqCst);
        self.rate_limited.store(requests, Ordering::SeqCst);
    }

    /// The next response for `key` stops after `bytes` bytes of body (the
    /// connection is dropped mid-transfer).
    pub fn cut_after(&self, key: &str, bytes: u64) {
        if let Ok(mut cut) = self.cut.lock() {
            cut.insert(key.to_string(), bytes);
        }
    }

    /// The next response for `key` has one byte flipped.
    pub fn corrupt_next(&self, key: &str) {
        if let Ok(mut corrupt) = self.corrupt.lock() {
            corrupt.insert(key.to_string());
        }
    }

    fn take_rate_limit(&self) -> Option<u64> {
        self.rate_limited
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .ok()
            .map(|_| self.retry_after_secs.load(Ordering::SeqCst))
    }

    fn take_cut(&self, key: &str) -> Option<u64> {
        self.cut.lock().ok()?.remove(key)
    }

    fn take_corrupt(&self, key: &str) -> bool {
        self.corrupt.lock().is_ok_and(|mut c| c.remove(key))
    }
}

/// What the mirror has served.
#[derive(Debug, Default)]
pub struct MirrorStats {
    served: Mutex<HashMap<String, u64>>,
    file_requests: AtomicU64,
    rate_limited: AtomicU64,
}

impl MirrorStats {
    /// Body bytes sent for `OWNER/NAME/PATH`, over all requests.
    pub fn served(&self, key: &str) -> u64 {
        self.served
            .lock()
            .ok()
            .and_then(|s| s.get(key).copied())
            .unwrap_or(0)
    }

    /// Every key served at least one byte, sorted.
    pub fn served_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .served
            .lock()
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    pub fn file_requests(&self) -> u64 {
        self.file_requests.load(Ordering::SeqCst)
    }

    pub fn rate_limited(&self) -> u64 {
        self.rate_limited.load(Ordering::SeqCst)
    }

    fn add(&self, key: &str, bytes: u64) {
        if let Ok(mut served) = self.served.lock() {
            *served.entry(key.to_string()).or_default() += bytes;
        }
    }
}

struct Inner {
    root: PathBuf,
    faults: Faults,
    stats: MirrorStats,
    /// SHA-256 by path, valid while size and mtime are unchanged.
    hashes: Mutex<HashMap<PathBuf, (u64, SystemTime, String)>>,
}

/// A hub over a folder of repositories.
#[derive(Clone)]
pub struct Mirror {
    inner: Arc<Inner>,
}

impl Mirror {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            inner: Arc::new(Inner {
                root: root.into(),
                faults: Faults::default(),
                stats: MirrorStats::default(),
                hashes: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    pub fn stats(&self) -> &MirrorStats {
        &self.inner.stats
    }

    pub fn router(&self) -> Router {
        Router::new()
            .route(
                "/api/models/{owner}/{name}/revision/{revision}",
                get(listing),
            )
            .route("/{owner}/{name}/resolve/{revision}/{*path}", get(resolve))
            .with_state(self.inner.clone())
    }

    /// Serves on `listener` until the task is dropped or aborted.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(listener, self.router()).await
    }

    /// Binds `addr` (port 0: any free port) and serves in the background.
    pub async fn start(
        self,
        addr: SocketAddr,
    ) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        Ok((bound, tokio::spawn(self.serve(listener))))
    }
}

impl Inner {
    fn repo_dir(&self, owner: &str, name: &str) -> Option<PathBuf> {
        let dir = self
            .root
            .join(safe_relative(owner)?)
            .join(safe_relative(name)?);
        dir.is_dir().then_some(dir)
    }

    fn sha256(&self, path: &Path) -> std::io::Result<String> {
        let meta = std::fs::metadata(path)?;
        let mtime = meta.modified()?;
        if let Some((len, at, sha)) = self.hashes.lock().ok().and_then(|h| h.get(path).cloned()) {
            if len == meta.len() && at == mtime {
                return Ok(sha);
            }
        }
        let sha = hash_file(path).map_err(std::io::Error::other)?;
        if let Ok(mut hashes) = self.hashes.lock() {
            hashes.insert(path.to_path_buf(), (meta.len(), mtime, sha.clone()));
        }
        Ok(sha)
    }

    /// Every file of a repository (relative `/` paths, sorted), without
    /// partial downloads and dot-folders.
    fn files(dir: &Path) -> std::io::Result<Vec<String>> {
        let mut out = Vec::new();
        let mut stack = vec![(dir.to_path_buf(), String::new())];
        while let Some((folder, prefix)) = stack.pop() {
            for entry in std::fs::read_dir(&folder)? {
                let entry = entry?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') || name.ends_with(".partial") {
                    continue;
                }
                let rel = format!("{prefix}{name}");
                if entry.file_type()?.is_dir() {
                    stack.push((entry.path(), format!("{rel}/")));
                } else {
                    out.push(rel);
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// A stable stand-in for a commit id: the hash of the listing.
    fn commit(listing: &[(String, u64, String)]) -> String {
        let mut hasher = Sha256::new();
        for (path, size, sha) in listing {
            hasher.update(format!("{path}\0{size}\0{sha}\n"));
        }
        crate::hex(&hasher.finalize())[..40].to_string()
    }

    fn listing(&self, dir: &Path) -> std::io::Result<Vec<(String, u64, String)>> {
        Self::files(dir)?
            .into_iter()
            .map(|rel| {
                let path = dir.join(&rel);
                let size = std::fs::metadata(&path)?.len();
                Ok((rel, size, self.sha256(&path)?))
            })
            .collect()
    }
}

/// `s` as a relative path of plain components only.
fn safe_relative(s: &str) -> Option<PathBuf> {
    let path = Path::new(s);
    (!s.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_))))
        .then(|| path.to_path_buf())
}

fn error(status: StatusCode, message: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::json!({ "error": message }).to_string(),
    )
        .into_response()
}

async fn listing(
    State(inner): State<Arc<Inner>>,
    UrlPath((owner, name, revision)): UrlPath<(String, String, String)>,
) -> Response {
    let Some(dir) = inner.repo_dir(&owner, &name) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("Repository {owner}/{name} not found"),
        );
    };
    let work = {
        let inner = inner.clone();
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || inner.listing(&dir))
    };
    let listing = match work.await {
        Ok(Ok(listing)) => listing,
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    // A mirror holds one copy of each repository and serves it for any
    // revision asked (a card may pin the hub's commit id); the client's
    // size and hash checks catch a copy that does not match.
    let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = if is_commit {
        revision.clone()
    } else {
        Inner::commit(&listing)
    };
    // As on the hub: weights and big files in LFS (with their SHA-256),
    // small ones in git (with their blob id).
    let siblings: Vec<serde_json::Value> = listing
        .iter()
        .map(|(path, size, sha)| {
            let lfs = *size >= LFS_FROM
                || [".safetensors", ".gguf", ".bin"]
                    .iter()
                    .any(|e| path.ends_with(e));
            if lfs {
                serde_json::json!({
                    "rfilename": path,
                    "size": size,
                    "lfs": { "sha256": sha, "size": size, "pointerSize": 134 },
                })
            } else {
                let blob = crate::client::git_blob_id(&dir.join(path)).unwrap_or_default();
                serde_json::json!({ "rfilename": path, "size": size, "blobId": blob })
            }
        })
        .collect();
    axum::Json(serde_json::json!({
        "id": format!("{owner}/{name}"),
        "sha": commit,
        "siblings": siblings,
    }))
    .into_response()
}

/// `bytes=START-` or `bytes=START-END` (inclusive end), clamped to `len`.
fn parse_range(value: &str, len: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = value.trim().strip_prefix("bytes=")?;
    let (start, end) = spec.split_once('-')?;
    let start: u64 = start.trim().parse().ok()?;
    let end = match end.trim() {
        "" => len.saturating_sub(1),
        end => end.parse::<u64>().ok()?.min(len.saturating_sub(1)),
    };
    Some(if start >= len || end < start {
        Err(())
    } else {
        Ok((start, end))
    })
}

async fn resolve(
    State(inner): State<Arc<Inner>>,
    UrlPath((owner, name, revision, path)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    inner.stats.file_requests.fetch_add(1, Ordering::SeqCst);
    if let Some(secs) = inner.faults.take_rate_limit() {
        inner.stats.rate_limited.fetch_add(1, Ordering::SeqCst);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, secs.to_string())],
            "rate limited",
        )
            .into_response();
    }
    let Some(dir) = inner.repo_dir(&owner, &name) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("Repository {owner}/{name} not found"),
        );
    };
    let Some(rel) = safe_relative(&path) else {
        return error(StatusCode::BAD_REQUEST, format!("bad path {path:?}"));
    };
    let _ = revision; // One copy serves every revision (see `listing`).
    let file_path = dir.join(rel);
    if !file_path.is_file() || path.ends_with(".partial") {
        return error(StatusCode::NOT_FOUND, format!("Entry {path} not found"));
    }
    let sha = {
        let inner = inner.clone();
        let p = file_path.clone();
        match tokio::task::spawn_blocking(move || inner.sha256(&p)).await {
            Ok(Ok(sha)) => sha,
            Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    };
    let len = match tokio::fs::metadata(&file_path).await {
        Ok(meta) => meta.len(),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_range(v, len));
    let (status, start, end) = match range {
        Some(Ok((start, end))) => (StatusCode::PARTIAL_CONTENT, start, end),
        Some(Err(())) => {
            return (
                StatusCode::RANGE_NOT_SATISFIABLE,
                [(header::CONTENT_RANGE, format!("bytes */{len}"))],
            )
                .into_response()
        }
        None => (StatusCode::OK, 0, len.saturating_sub(1)),
    };
    let body_len = if len == 0 { 0 } else { end + 1 - start };
    let key = format!("{owner}/{name}/{path}");
    let cut = inner.faults.take_cut(&key);
    let corrupt = inner.faults.take_corrupt(&key);
    let mut file = match tokio::fs::File::open(&file_path).await {
        Ok(file) => file,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    if let Err(e) = file.seek(SeekFrom::Start(start)).await {
        return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    }
    let rate = inner.faults.bytes_per_second.load(Ordering::SeqCst);
    let state = ServedBody {
        file,
        left: body_len,
        sent: 0,
        cut,
        corrupt,
        inner: inner.clone(),
        key,
        pace: (rate > 0).then(|| (std::time::Instant::now(), rate)),
    };
    let stream = futures_util::stream::unfold(state, ServedBody::next);
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = status;
    set_file_headers(
        response.headers_mut(),
        &sha,
        len,
        body_len,
        (status, start, end),
    );
    response
}

/// A file's body as the mirror serves it, with the faults it was told to
/// inject: a cut connection, a corrupted byte, a paced rate.
struct ServedBody {
    file: tokio::fs::File,
    left: u64,
    sent: u64,
    cut: Option<u64>,
    corrupt: bool,
    inner: Arc<Inner>,
    key: String,
    pace: Option<(std::time::Instant, u64)>,
}

impl ServedBody {
    /// The next piece of the body, and the body after it.
    async fn next(mut self) -> Option<(std::io::Result<bytes::Bytes>, Self)> {
        if self.left == 0 {
            return None;
        }
        if self.cut.is_some_and(|cut| self.sent >= cut) {
            // Drop the connection mid-body, as a flaky network would.
            return Some((
                Err(std::io::Error::other("connection cut by fault injection")),
                Self { left: 0, ..self },
            ));
        }
        let mut want = (self.left as usize).min(CHUNK);
        if let Some(cut) = self.cut {
            want = want.min((cut - self.sent) as usize).max(1);
        }
        if let Some((started, rate)) = self.pace {
            // Small pieces, each sent once the rate allows all of it.
            want = want.min((rate / 10).max(1) as usize);
            let until = (self.sent + want as u64) as f64 / rate as f64;
            let due = started + std::time::Duration::from_secs_f64(until);
            tokio::time::sleep_until(due.into()).await;
        }
        // Filled straight from the file, without zeroing it first.
        let mut buf = BytesMut::with_capacity(want);
        let read = match (&mut self.file).take(want as u64).read_buf(&mut buf).await {
            Ok(0) => {
                return Some((
                    Err(std::io::Error::other("file shrank while served")),
                    Self { left: 0, ..self },
                ))
            }
            Ok(n) => n,
            Err(e) => return Some((Err(e), Self { left: 0, ..self })),
        };
        if self.corrupt {
            buf[0] ^= 0xff;
            self.corrupt = false;
        }
        self.left -= read as u64;
        self.sent += read as u64;
        self.inner.stats.add(&self.key, read as u64);
        Some((Ok(buf.freeze()), self))
    }
}

/// A file's headers: its length, its SHA-256 as the hub's ETags, and the
/// range served.
fn set_file_headers(
    headers: &mut HeaderMap,
    sha: &str,
    len: u64,
    body_len: u64,
    (status, start, end): (StatusCode, u64, u64),
) {
    let quoted = format!("\"{sha}\"");
    let mut set = |name: &str, value: String| {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            headers.insert(name, value);
        }
    };
    set("content-length", body_len.to_string());
    set("accept-ranges", "bytes".into());
    set("etag", quoted.clone());
    set("x-linked-etag", quoted);
    set("x-linked-size", len.to_string());
    set("content-type", "application/octet-stream".into());
    if status == StatusCode::PARTIAL_CONTENT {
        set("content-range", format!("bytes {start}-{end}/{len}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_clamp() {
        assert_eq!(parse_range("bytes=0-", 10), Some(Ok((0, 9))));
        assert_eq!(parse_range("bytes=4-6", 10), Some(Ok((4, 6))));
        assert_eq!(parse_range("bytes=4-100", 10), Some(Ok((4, 9))));
        assert_eq!(parse_range("bytes=10-", 10), Some(Err(())));
        assert_eq!(parse_range("bytes=6-4", 10), Some(Err(())));
        assert_eq!(parse_range("items=0-1", 10), None);
        assert_eq!(parse_range("bytes=x-", 10), None);
    }

    #[test]
    fn paths_stay_inside_the_root() {
        assert!(safe_relative("a/b.json").is_some());
        for bad in ["", "../x", "a/../../x", "/etc/passwd"] {
            assert!(safe_relative(bad).is_none(), "{bad}");
        }
    }
}
