//! The download client: repository listings and verified, resumable files.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use reqwest::header::{self, HeaderMap};
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::{hex, partial_path};

/// Where the hub is when `HF_ENDPOINT` does not say.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The most a small file ([`HubClient::fetch_small`]) may weigh.
const SMALL_FILE_LIMIT: u64 = 64 << 20;
/// Batches in flight between the network and the writer and hasher.
const WRITE_QUEUE: usize = 16;
/// Bytes of network chunks handed on together.
const BATCH_BYTES: usize = 256 << 10;

/// Network chunks handed on together (shared by the writer and hasher).
type Batch = Arc<Vec<Bytes>>;
/// The writer's buffer: few large writes rather than one per network chunk.
const WRITE_BUFFER: usize = 1 << 20;
/// Disk writeback is started after this many new bytes, so the final sync
/// before the rename has little left to do.
const WRITEBACK_EVERY: u64 = 8 << 20;

/// Asks the kernel to start writing `len` bytes from `offset` to disk now,
/// without waiting (Linux); elsewhere the final sync does it all.
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor and plain integers; the call only
        // schedules writeback and reports errors through its return value,
        // which is ignored (the final sync reports any real failure).
        unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

/// One file of a repository, as its listing gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepoFile {
    /// Path inside the repository (`/`-separated).
    pub path: String,
    /// Size in bytes; 0 when the listing does not say.
    pub size: u64,
    /// Lower-case hex SHA-256 (the hub gives it for LFS files).
    pub sha256: Option<String>,
    /// The git blob id (SHA-1 of `blob LEN\0` and the content): what the
    /// hub gives for a small file kept in git rather than LFS.
    #[serde(default)]
    pub git_oid: Option<String>,
}

/// A repository's files at one commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepoListing {
    pub repo: String,
    /// The commit the listing describes (files are fetched at this commit,
    /// so one download never mixes two revisions).
    pub commit: String,
    pub files: Vec<RepoFile>,
}

impl RepoListing {
    pub fn get(&self, path: &str) -> Option<&RepoFile> {
        self.files.iter().find(|f| f.path == path)
    }
}

/// Why a hub request failed.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("bad repository name {0:?} (expected OWNER/NAME)")]
    BadRepo(String),
    #[error("{what}: not found on the hub (HTTP 404)")]
    NotFound { what: String },
    #[error("{what}: access refused (HTTP {status}); a gated or private repository needs a token in HF_TOKEN")]
    Unauthorized { what: String, status: u16 },
    #[error("{what}: rate limited (HTTP 429), asked to wait {}s", retry_after.as_secs())]
    RateLimited { what: String, retry_after: Duration },
    #[error("{what}: HTTP {status}")]
    Status { what: String, status: u16 },
    #[error("{what}: {message}")]
    Network { what: String, message: String },
    #[error("{what}: the listing cannot be read: {message}")]
    BadListing { what: String, message: String },
    #[error("{what} is larger than the {} MB a small file may be", SMALL_FILE_LIMIT >> 20)]
    TooLarge { what: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {got} bytes where the listing says {expected}")]
    SizeMismatch {
        path: String,
        expected: u64,
        got: u64,
    },
    #[error(
        "{path}: SHA-256 {got} where the hub says {expected} (corrupted in transit; fetched again)"
    )]
    HashMismatch {
        path: String,
        expected: String,
        got: String,
    },
    #[error("{path}: {source}")]
    BadGguf {
        path: String,
        #[source]
        source: crate::gguf::GgufError,
    },
    #[error("cancelled")]
    Cancelled,
    #[error("gave up after {attempts} attempts: {last}")]
    GaveUp { attempts: u32, last: Box<HubError> },
}

impl HubError {
    /// Whether trying again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::RateLimited { .. }
            | Self::Network { .. }
            | Self::SizeMismatch { .. }
            | Self::HashMismatch { .. } => true,
            Self::Status { status, .. } => *status >= 500 || *status == 408 || *status == 416,
            _ => false,
        }
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// How often and how patiently to try again.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts: u32,
    /// The wait after the first failure; doubled after each further one.
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// The longest `Retry-After` honoured as given (longer ones are cut).
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 8,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    fn wait(&self, error: &HubError, failures: u32) -> Duration {
        if let HubError::RateLimited { retry_after, .. } = error {
            return (*retry_after).min(self.max_retry_after);
        }
        let doubled = self
            .first_backoff
            .saturating_mul(1u32 << failures.saturating_sub(1).min(16));
        doubled.min(self.max_backoff)
    }
}

/// A file's progress, read by whoever reports it while it downloads.
#[derive(Debug, Default)]
pub struct FileProgress {
    /// Bytes of the file on disk (the resumed part included).
    pub on_disk: AtomicU64,
    /// Bytes received from the network by this download.
    pub fetched: AtomicU64,
}

/// What one file's download took.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DownloadStats {
    /// Bytes received from the network, over every attempt.
    pub bytes_fetched: u64,
    pub attempts: u32,
    /// Bytes already on disk (a `.partial` from before) when it began.
    pub resumed_from: u64,
}

/// A client of one hub endpoint.
pub struct HubClient {
    endpoint: Url,
    token: Option<String>,
    http: reqwest::Client,
    retry: RetryPolicy,
    listings: Mutex<HashMap<(String, String), Arc<RepoListing>>>,
}

#[derive(Deserialize)]
struct ApiInfo {
    #[serde(default)]
    sha: String,
    #[serde(default)]
    siblings: Vec<ApiSibling>,
}

#[derive(Deserialize)]
struct ApiSibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "blobId")]
    blob_id: Option<String>,
    #[serde(default)]
    lfs: Option<ApiLfs>,
}

#[derive(Deserialize)]
struct ApiLfs {
    sha256: String,
    size: u64,
}

impl HubClient {
    /// A client of `endpoint` (e.g. `https://huggingface.co`), sending
    /// `token` as a bearer token when given.
    pub fn new(endpoint: &str, token: Option<String>) -> Result<Self, HubError> {
        let endpoint =
            Url::parse(endpoint.trim_end_matches('/')).map_err(|e| HubError::Network {
                what: format!("hub endpoint {endpoint:?}"),
                message: e.to_string(),
            })?;
        crate::install_tls_provider();
        let mut builder = reqwest::Client::builder();
        // HTTPS_PROXY / HTTP_PROXY / ALL_PROXY (either case), NO_PROXY.
        let var = |name: &str| {
            std::env::var(name)
                .or_else(|_| std::env::var(name.to_ascii_lowercase()))
                .ok()
                .filter(|v| !v.is_empty())
        };
        for (name, scheme) in [
            ("HTTPS_PROXY", "https"),
            ("HTTP_PROXY", "http"),
            ("ALL_PROXY", "all"),
        ] {
            if let Some(url) = var(name) {
                let proxy = match scheme {
                    "https" => reqwest::Proxy::https(url.as_str()),
                    "http" => reqwest::Proxy::http(url.as_str()),
                    _ => reqwest::Proxy::all(url.as_str()),
                };
                let proxy = proxy.map_err(|e| HubError::Network {
                    what: format!("proxy {url:?}"),
                    message: e.to_string(),
                })?;
                builder = builder.proxy(proxy.no_proxy(reqwest::NoProxy::from_env()));
            }
        }
        let http = builder
            .user_agent(concat!("tessera/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(10))
            // A stalled transfer fails (and resumes) rather than hanging.
            .read_timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| HubError::Network {
                what: "building the HTTP client".into(),
                message: e.to_string(),
            })?;
        Ok(Self {
            endpoint,
            token: token.filter(|t| !t.is_empty()),
            http,
            retry: RetryPolicy::default(),
            listings: Mutex::new(HashMap::new()),
        })
    }

    /// The endpoint from `HF_ENDPOINT` (else the public hub) and the token
    /// from `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`).
    pub fn from_env() -> Result<Self, HubError> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let token = std::env::var("HF_TOKEN")
            .or_else(|_| std::env::var("HUGGING_FACE_HUB_TOKEN"))
            .ok();
        Self::new(&endpoint, token)
    }

    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    pub fn endpoint(&self) -> &str {
        self.endpoint.as_str().trim_end_matches('/')
    }

    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.endpoint.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty();
            for segment in segments {
                path.extend(segment.split('/'));
            }
        }
        url
    }

    fn get(&self, url: Url) -> reqwest::RequestBuilder {
        let request = self.http.get(url);
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// The files of `repo` at `revision` (a branch, tag or commit), with
    /// sizes and LFS hashes. Asked once per client and revision.
    pub async fn list(&self, repo: &str, revision: &str) -> Result<Arc<RepoListing>, HubError> {
        check_repo(repo)?;
        let key = (repo.to_string(), revision.to_string());
        if let Some(listing) = self.listings.lock().ok().and_then(|l| l.get(&key).cloned()) {
            return Ok(listing);
        }
        let mut url = self.url(&["api/models", repo, "revision", revision]);
        url.query_pairs_mut().append_pair("blobs", "true");
        let what = format!("the file list of {repo}@{revision}");
        let body = self
            .retrying(&CancellationToken::new(), || {
                self.fetch_bytes(url.clone(), &what)
            })
            .await?;
        let info: ApiInfo = serde_json::from_slice(&body).map_err(|e| HubError::BadListing {
            what: what.clone(),
            message: e.to_string(),
        })?;
        let files = info
            .siblings
            .into_iter()
            .map(|s| match s.lfs {
                Some(lfs) => RepoFile {
                    path: s.rfilename,
                    size: lfs.size,
                    sha256: Some(lfs.sha256.to_ascii_lowercase()),
                    git_oid: None,
                },
                None => RepoFile {
                    path: s.rfilename,
                    size: s.size.unwrap_or(0),
                    sha256: None,
                    git_oid: s
                        .blob_id
                        .filter(|id| id.len() == 40)
                        .map(|id| id.to_ascii_lowercase()),
                },
            })
            .collect();
        let commit = if info.sha.is_empty() {
            revision.to_string()
        } else {
            info.sha
        };
        let listing = Arc::new(RepoListing {
            repo: repo.to_string(),
            commit,
            files,
        });
        if let Ok(mut listings) = self.listings.lock() {
            listings.insert(key, listing.clone());
        }
        Ok(listing)
    }

    /// A small file (a config, an index) read into memory.
    pub async fn fetch_small(
        &self,
        repo: &str,
        revision: &str,
        path: &str,
    ) -> Result<Vec<u8>, HubError> {
        check_repo(repo)?;
        let url = self.url(&[repo, "resolve", revision, path]);
        let what = format!("{repo}/{path}");
        let bytes = self
            .retrying(&CancellationToken::new(), || {
                self.fetch_bytes(url.clone(), &what)
            })
            .await?;
        Ok(bytes.to_vec())
    }

    /// Bytes `range` of a file, with a `Range` request (a server that
    /// ignores the range is read only as far as the range's end).
    pub async fn fetch_range(
        &self,
        repo: &str,
        revision: &str,
        path: &str,
        range: std::ops::Range<u64>,
    ) -> Result<Vec<u8>, HubError> {
        check_repo(repo)?;
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let url = self.url(&[repo, "resolve", revision, path]);
        let what = format!("{repo}/{path}");
        self.retrying(&CancellationToken::new(), || {
            self.fetch_part(url.clone(), &what, range.clone())
        })
        .await
    }

    async fn fetch_part(
        &self,
        url: Url,
        what: &str,
        range: std::ops::Range<u64>,
    ) -> Result<Vec<u8>, HubError> {
        let asked = format!("bytes={}-{}", range.start, range.end - 1);
        let request = self.get(url).header(header::RANGE, asked);
        let mut response = request.send().await.map_err(|e| network(what, &e))?;
        let status = response.status();
        let skip = match status {
            StatusCode::PARTIAL_CONTENT => match content_range_start(response.headers()) {
                Some(start) if start == range.start => 0,
                _ => {
                    return Err(HubError::Network {
                        what: what.into(),
                        message: "the server answered a different range".into(),
                    })
                }
            },
            StatusCode::OK => range.start,
            _ => return Err(status_error(what, status, response.headers())),
        };
        let want = range.end - range.start;
        let mut bytes = Vec::with_capacity(want.min(SMALL_FILE_LIMIT) as usize);
        let mut skipped = 0u64;
        while (bytes.len() as u64) < want {
            let Some(chunk) = response.chunk().await.map_err(|e| network(what, &e))? else {
                break;
            };
            let drop = (skip - skipped).min(chunk.len() as u64) as usize;
            skipped += drop as u64;
            let room = (want - bytes.len() as u64) as usize;
            let rest = &chunk[drop..];
            bytes.extend_from_slice(&rest[..rest.len().min(room)]);
        }
        Ok(bytes)
    }

    /// The header of a GGUF file of `size` bytes, read with `Range`
    /// requests that grow until it parses; and the bytes fetched for it.
    pub async fn gguf_header(
        &self,
        repo: &str,
        revision: &str,
        path: &str,
        size: u64,
    ) -> Result<(crate::gguf::Header, u64), HubError> {
        use crate::gguf::{self, GgufError};
        let bad = |source| HubError::BadGguf {
            path: format!("{repo}/{path}"),
            source,
        };
        let mut bytes = Vec::new();
        let mut want = gguf::FIRST_READ.min(size);
        loop {
            let have = bytes.len() as u64;
            let part = self.fetch_range(repo, revision, path, have..want).await?;
            if part.is_empty() {
                return Err(bad(GgufError::Invalid(format!(
                    "the file ends after {have} bytes"
                ))));
            }
            bytes.extend(part);
            match gguf::parse(&bytes) {
                Ok(header) => return Ok((header, bytes.len() as u64)),
                Err(GgufError::NeedMore { at_least, .. }) => {
                    want = gguf::next_read(bytes.len() as u64, at_least, size).map_err(bad)?;
                }
                Err(error) => return Err(bad(error)),
            }
        }
    }

    async fn fetch_bytes(&self, url: Url, what: &str) -> Result<Bytes, HubError> {
        let response = self.get(url).send().await.map_err(|e| network(what, &e))?;
        let status = response.status();
        if !status.is_success() {
            return Err(status_error(what, status, response.headers()));
        }
        if response
            .content_length()
            .is_some_and(|n| n > SMALL_FILE_LIMIT)
        {
            return Err(HubError::TooLarge { what: what.into() });
        }
        response.bytes().await.map_err(|e| network(what, &e))
    }

    /// Runs `attempt` until it succeeds, fails for good, or runs out of
    /// attempts, waiting between tries as the policy (or the server) says.
    async fn retrying<T, F, Fut>(
        &self,
        cancel: &CancellationToken,
        mut attempt: F,
    ) -> Result<T, HubError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, HubError>>,
    {
        let mut failures = 0;
        loop {
            if cancel.is_cancelled() {
                return Err(HubError::Cancelled);
            }
            let error = match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            failures += 1;
            if !error.is_retryable() {
                return Err(error);
            }
            if failures >= self.retry.attempts {
                return Err(HubError::GaveUp {
                    attempts: failures,
                    last: Box::new(error),
                });
            }
            let wait = self.retry.wait(&error, failures);
            tracing::warn!(%error, wait_ms = wait.as_millis() as u64, "hub request failed; trying again");
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cancel.cancelled() => return Err(HubError::Cancelled),
            }
        }
    }

    /// Downloads `file` of `repo` at `revision` to `dest`: into
    /// `dest.partial` (continuing one left by an earlier try), verified
    /// against the size and SHA-256 the listing or the server gives, then
    /// renamed to `dest`. A cancelled download keeps its `.partial`.
    pub async fn download(
        &self,
        repo: &str,
        revision: &str,
        file: &RepoFile,
        dest: &Path,
        progress: &FileProgress,
        cancel: &CancellationToken,
    ) -> Result<DownloadStats, HubError> {
        check_repo(repo)?;
        let partial = partial_path(dest);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(HubError::io(parent))?;
        }
        let url = self.url(&[repo, "resolve", revision, &file.path]);
        let mut stats = DownloadStats {
            resumed_from: file_len(&partial),
            ..Default::default()
        };
        let stats_cell = Mutex::new(&mut stats);
        self.retrying(cancel, || async {
            let mut fetched = 0;
            let result = self
                .attempt(url.clone(), file, &partial, progress, cancel, &mut fetched)
                .await;
            if let Ok(mut stats) = stats_cell.lock() {
                stats.attempts += 1;
                stats.bytes_fetched += fetched;
            }
            result
        })
        .await?;
        std::fs::rename(&partial, dest).map_err(HubError::io(dest))?;
        Ok(stats)
    }

    /// One try: fetch what `partial` lacks, then verify it.
    async fn attempt(
        &self,
        url: Url,
        file: &RepoFile,
        partial: &Path,
        progress: &FileProgress,
        cancel: &CancellationToken,
        fetched: &mut u64,
    ) -> Result<(), HubError> {
        let what = file.path.as_str();
        let mut have = file_len(partial);
        if file.size > 0 && have > file.size {
            remove(partial)?;
            have = 0;
        }
        progress.on_disk.store(have, Ordering::Relaxed);
        if file.size > 0 && have == file.size {
            // Complete from an earlier try that did not get to verify.
            let path = partial.to_path_buf();
            let digest = tokio::task::spawn_blocking(move || hash_file(&path))
                .await
                .map_err(|e| network(what, &e))??;
            return verify(file, None, partial, have, digest);
        }
        let mut request = self.get(url);
        if have > 0 {
            request = request.header(header::RANGE, format!("bytes={have}-"));
        }
        let mut response = tokio::select! {
            response = request.send() => response.map_err(|e| network(what, &e))?,
            _ = cancel.cancelled() => return Err(HubError::Cancelled),
        };
        let start = resume_start(&response, have, partial, what)?;
        let total = if file.size > 0 {
            file.size
        } else {
            start + response.content_length().unwrap_or(0)
        };
        let server_sha = header_sha256(response.headers());

        // The network, the disk and the hash work side by side: each chunk
        // (shared, not copied) goes to a blocking writer and to a blocking
        // hasher, which first hashes the part already on disk. Hashing is
        // the costliest step (about 1.3 GB/s), so it must not hold up the
        // writes.
        let (tx, rx) = tokio::sync::mpsc::channel::<Batch>(WRITE_QUEUE);
        let (hash_tx, hash_rx) = tokio::sync::mpsc::channel::<Batch>(WRITE_QUEUE);
        let hasher = spawn_hasher(partial.to_path_buf(), start, hash_rx);
        let on_disk = Arc::new(AtomicU64::new(start));
        let writer = spawn_writer(partial.to_path_buf(), start, rx, on_disk.clone());
        let sinks = Sinks {
            disk: tx,
            hash: hash_tx,
        };
        let counts = Counts {
            progress,
            on_disk: &on_disk,
            fetched,
        };
        // The channels close when `receive` returns (it owns the senders).
        let failure = receive(&mut response, cancel, what, sinks, counts).await;
        // What arrived is kept on disk, so the next try resumes after it.
        let len = writer.await.map_err(|e| network(what, &e))??;
        let digest = hasher.await.map_err(|e| network(what, &e))??;
        progress.on_disk.store(len, Ordering::Relaxed);
        if let Some(failure) = failure {
            return Err(failure);
        }
        if len < total {
            return Err(HubError::Network {
                what: what.into(),
                message: format!("the connection ended after {len} of {total} bytes"),
            });
        }
        let sized = RepoFile {
            size: total,
            ..file.clone()
        };
        verify(&sized, server_sha, partial, len, digest)
    }
}

/// Where each batch of the body goes: the writer and the hasher.
struct Sinks {
    disk: tokio::sync::mpsc::Sender<Batch>,
    hash: tokio::sync::mpsc::Sender<Batch>,
}

impl Sinks {
    /// Sends `batch` (emptied) to both; false if either has stopped.
    async fn send(&self, batch: &mut Vec<Bytes>) -> bool {
        let ready = Arc::new(std::mem::take(batch));
        let hashed = self.hash.send(ready.clone()).await;
        self.disk.send(ready).await.is_ok() && hashed.is_ok()
    }
}

/// What a download reports as its body arrives.
struct Counts<'a> {
    progress: &'a FileProgress,
    /// The writer's length on disk.
    on_disk: &'a AtomicU64,
    /// Bytes fetched by this try.
    fetched: &'a mut u64,
}

/// Reads the body into `sinks` in batches (one wake-up of each thread per
/// batch) until its end, a cancel or a network error: the error, if any.
async fn receive(
    response: &mut reqwest::Response,
    cancel: &CancellationToken,
    what: &str,
    sinks: Sinks,
    counts: Counts<'_>,
) -> Option<HubError> {
    let mut failure = None;
    let mut batch: Vec<Bytes> = Vec::new();
    let mut batch_bytes = 0;
    loop {
        let chunk = tokio::select! {
            chunk = response.chunk() => chunk,
            _ = cancel.cancelled() => {
                failure = Some(HubError::Cancelled);
                break;
            }
        };
        match chunk {
            Ok(Some(chunk)) => {
                *counts.fetched += chunk.len() as u64;
                let progress = counts.progress;
                progress
                    .fetched
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                progress
                    .on_disk
                    .store(counts.on_disk.load(Ordering::Relaxed), Ordering::Relaxed);
                batch_bytes += chunk.len();
                batch.push(chunk);
                if batch_bytes >= BATCH_BYTES {
                    batch_bytes = 0;
                    if !sinks.send(&mut batch).await {
                        break; // The writer or hasher failed; its error follows.
                    }
                }
            }
            Ok(None) => break,
            Err(error) => {
                failure = Some(network(what, &error));
                break;
            }
        }
    }
    if !batch.is_empty() {
        sinks.send(&mut batch).await;
    }
    failure
}

/// Where the body of `response` starts in the file: at `have` for the
/// range asked for, at 0 for a server that sends the whole file. A
/// different range, or one past the end, starts the file over.
fn resume_start(
    response: &reqwest::Response,
    have: u64,
    partial: &Path,
    what: &str,
) -> Result<u64, HubError> {
    let status = response.status();
    match status {
        StatusCode::PARTIAL_CONTENT => match content_range_start(response.headers()) {
            Some(start) if start == have => Ok(have),
            _ => {
                // Not the part asked for: start over.
                remove(partial)?;
                Err(HubError::Network {
                    what: what.into(),
                    message: "the server answered a different range".into(),
                })
            }
        },
        // The server ignored the range: the whole file follows.
        StatusCode::OK => Ok(0),
        StatusCode::RANGE_NOT_SATISFIABLE => {
            remove(partial)?;
            Err(status_error(what, status, response.headers()))
        }
        _ => Err(status_error(what, status, response.headers())),
    }
}

/// The SHA-256 of the file as it grows: the `start` bytes already on disk,
/// then each batch as it arrives (hex, once the channel closes). Hashing is
/// the costliest step, so it runs beside the writes, not before them.
fn spawn_hasher(
    partial: PathBuf,
    start: u64,
    mut batches: tokio::sync::mpsc::Receiver<Batch>,
) -> tokio::task::JoinHandle<Result<String, HubError>> {
    tokio::task::spawn_blocking(move || {
        let mut hasher = Sha256::new();
        if start > 0 {
            hash_prefix(&partial, start, &mut hasher)?;
        }
        while let Some(batch) = batches.blocking_recv() {
            for chunk in batch.iter() {
                hasher.update(chunk);
            }
        }
        Ok(hex(&hasher.finalize()))
    })
}

/// Appends each batch to the file after its first `start` bytes (with
/// writeback started as it goes), publishing the length on disk; synced
/// once the channel closes. Returns the file's length.
fn spawn_writer(
    path: PathBuf,
    start: u64,
    mut batches: tokio::sync::mpsc::Receiver<Batch>,
    on_disk: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<Result<u64, HubError>> {
    tokio::task::spawn_blocking(move || {
        let mut file = if start > 0 {
            std::fs::OpenOptions::new().append(true).open(&path)
        } else {
            std::fs::File::create(&path)
        }
        .map_err(HubError::io(&path))?;
        let mut len = start;
        let mut written_back = start;
        while let Some(batch) = batches.blocking_recv() {
            write_batch(&mut file, &batch).map_err(HubError::io(&path))?;
            len += batch.iter().map(|chunk| chunk.len() as u64).sum::<u64>();
            on_disk.store(len, Ordering::Relaxed);
            if len - written_back >= WRITEBACK_EVERY {
                start_writeback(&file, written_back, len - written_back);
                written_back = len;
            }
        }
        // On disk before it is renamed into place and called complete
        // (most of it is already: writeback started as it arrived).
        file.sync_data().map_err(HubError::io(&path))?;
        Ok(len)
    })
}

/// Writes a batch of chunks with `writev`, straight from the network's
/// buffers: a buffered writer would copy every byte once more.
fn write_batch(file: &mut std::fs::File, batch: &[Bytes]) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = batch
        .iter()
        .map(|chunk| std::io::IoSlice::new(chunk))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match file.write_vectored(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => std::io::IoSlice::advance_slices(&mut rest, written),
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Checks a finished `.partial`; a wrong one is removed so the next try
/// starts afresh.
fn verify(
    file: &RepoFile,
    server_sha: Option<String>,
    partial: &Path,
    len: u64,
    digest: String,
) -> Result<(), HubError> {
    if file.size > 0 && len != file.size {
        remove(partial)?;
        return Err(HubError::SizeMismatch {
            path: file.path.clone(),
            expected: file.size,
            got: len,
        });
    }
    if let Some(expected) = file.sha256.clone().or(server_sha) {
        if expected != digest {
            remove(partial)?;
            return Err(HubError::HashMismatch {
                path: file.path.clone(),
                expected,
                got: digest,
            });
        }
    } else if let Some(expected) = &file.git_oid {
        // A small file kept in git: check its blob id (read back: such
        // files are config-sized).
        let got = git_blob_id(partial)?;
        if *expected != got {
            remove(partial)?;
            return Err(HubError::HashMismatch {
                path: file.path.clone(),
                expected: expected.clone(),
                got,
            });
        }
    }
    Ok(())
}

/// The git blob id of a file: SHA-1 of `blob LEN\0` followed by it.
pub(crate) fn git_blob_id(path: &Path) -> Result<String, HubError> {
    use sha1::Digest as _;
    let bytes = std::fs::read(path).map_err(HubError::io(path))?;
    let mut hasher = sha1::Sha1::new();
    hasher.update(format!("blob {}\0", bytes.len()));
    hasher.update(&bytes);
    Ok(hex(&hasher.finalize()))
}

fn check_repo(repo: &str) -> Result<(), HubError> {
    let valid_part = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match repo.split_once('/') {
        Some((owner, name)) if valid_part(owner) && valid_part(name) => Ok(()),
        _ => Err(HubError::BadRepo(repo.to_string())),
    }
}

/// A transport failure, with its causes (reqwest's own message alone says
/// only "error sending request").
fn network(what: &str, error: &dyn std::error::Error) -> HubError {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let text = inner.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        cause = inner.source();
    }
    HubError::Network {
        what: what.to_string(),
        message,
    }
}

fn status_error(what: &str, status: StatusCode, headers: &HeaderMap) -> HubError {
    let what = what.to_string();
    match status.as_u16() {
        401 | 403 => HubError::Unauthorized {
            what,
            status: status.as_u16(),
        },
        404 => HubError::NotFound { what },
        429 => HubError::RateLimited {
            what,
            retry_after: retry_after(headers).unwrap_or(Duration::from_secs(1)),
        },
        code => HubError::Status { what, status: code },
    }
}

/// `Retry-After` as seconds or as an HTTP date; else the reset time of a
/// `RateLimit` header (the IETF draft the hub sends: `...;t=SECONDS`, or
/// the older `reset=SECONDS`).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let Some(value) = headers.get(header::RETRY_AFTER) else {
        let limit = headers.get("ratelimit")?.to_str().ok()?;
        return limit
            .split([';', ','])
            .filter_map(|part| part.trim().split_once('='))
            .find(|(key, _)| matches!(key.trim(), "t" | "reset"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .map(Duration::from_secs);
    };
    let value = value.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

/// The start of `Content-Range: bytes START-END/TOTAL`.
fn content_range_start(headers: &HeaderMap) -> Option<u64> {
    let value = headers.get(header::CONTENT_RANGE)?.to_str().ok()?;
    let range = value.strip_prefix("bytes ")?;
    range.split('-').next()?.trim().parse().ok()
}

/// The SHA-256 the hub puts in `X-Linked-Etag` (LFS files) or `ETag`.
fn header_sha256(headers: &HeaderMap) -> Option<String> {
    ["x-linked-etag", "etag"].iter().find_map(|name| {
        let value = headers.get(*name)?.to_str().ok()?;
        let value = value.trim_start_matches("W/").trim_matches('"');
        (value.len() == 64 && value.chars().all(|c| c.is_ascii_hexdigit()))
            .then(|| value.to_ascii_lowercase())
    })
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

fn remove(path: &Path) -> Result<(), HubError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(HubError::io(path)(e)),
        _ => Ok(()),
    }
}

fn hash_prefix(path: &Path, len: u64, hasher: &mut Sha256) -> Result<(), HubError> {
    let file = std::fs::File::open(path).map_err(HubError::io(path))?;
    let mut reader = std::io::BufReader::with_capacity(WRITE_BUFFER, file.take(len));
    std::io::copy(&mut reader, &mut HashWriter(hasher)).map_err(HubError::io(path))?;
    Ok(())
}

/// The lower-case hex SHA-256 of a file.
pub(crate) fn hash_file(path: &Path) -> Result<String, HubError> {
    let mut hasher = Sha256::new();
    hash_prefix(path, u64::MAX, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The public hub is HTTPS: the client speaks TLS (here a handshake
    /// with a server that is not TLS fails as a network error, where a
    /// client without TLS would refuse the scheme).
    #[tokio::test]
    async fn https_endpoints_are_supported() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Ok((mut socket, _)) = listener.accept().await {
                let _ = socket.write_all(b"not tls\r\n\r\n").await;
            }
        });
        let client = HubClient::new(&format!("https://{addr}"), None)
            .unwrap()
            .with_retry(RetryPolicy {
                attempts: 1,
                ..Default::default()
            });
        let error = client.list("acme/m", "main").await.unwrap_err();
        let text = format!("{error} {:?}", error);
        // A TLS handshake happened and failed ("corrupt message").
        assert!(text.contains("corrupt message"), "{text}");
        assert!(!text.contains("scheme"), "{text}");
    }

    #[test]
    fn repo_names_are_checked() {
        assert!(check_repo("HuggingFaceTB/SmolLM2-135M-Instruct").is_ok());
        for bad in ["", "noslash", "a/b/c", "../x", "a/..", "a b/c", "/x"] {
            assert!(check_repo(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, "7".parse().unwrap());
        // (Blob ids: `git hash-object` of "hello\n".)
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("f"), "hello\n").unwrap();
        assert_eq!(
            git_blob_id(&tmp.path().join("f")).unwrap(),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
        let later = SystemTime::now() + Duration::from_secs(30);
        headers.insert(
            header::RETRY_AFTER,
            httpdate::fmt_http_date(later).parse().unwrap(),
        );
        let wait = retry_after(&headers).unwrap();
        assert!(wait > Duration::from_secs(25) && wait <= Duration::from_secs(30));
        let mut draft = HeaderMap::new();
        draft.insert("ratelimit", "\"api\";r=0;t=42".parse().unwrap());
        assert_eq!(retry_after(&draft), Some(Duration::from_secs(42)));
        draft.insert(
            "ratelimit",
            "limit=100, remaining=0, reset=9".parse().unwrap(),
        );
        assert_eq!(retry_after(&draft), Some(Duration::from_secs(9)));
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_429_waits_as_told() {
        let policy = RetryPolicy::default();
        let network = HubError::Network {
            what: "x".into(),
            message: "reset".into(),
        };
        assert_eq!(policy.wait(&network, 1), Duration::from_millis(500));
        assert_eq!(policy.wait(&network, 3), Duration::from_secs(2));
        assert_eq!(policy.wait(&network, 30), Duration::from_secs(30));
        let limited = HubError::RateLimited {
            what: "x".into(),
            retry_after: Duration::from_secs(3),
        };
        assert_eq!(policy.wait(&limited, 1), Duration::from_secs(3));
    }

    #[test]
    fn etags_that_are_sha256_are_used() {
        let sha = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
        let mut headers = HeaderMap::new();
        headers.insert("etag", format!("\"{sha}\"").parse().unwrap());
        assert_eq!(header_sha256(&headers).as_deref(), Some(sha));
        // A git blob id (40 hex digits) is not a SHA-256.
        headers.insert(
            "etag",
            "\"0123456789abcdef0123456789abcdef01234567\""
                .parse()
                .unwrap(),
        );
        assert_eq!(header_sha256(&headers), None);
    }
}
