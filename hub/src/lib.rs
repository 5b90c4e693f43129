//! The Hugging Face hub, as tessera uses it.
//!
//! - [`HubClient`] lists a repository's files and downloads single files:
//!   into a `.partial` file, resumed with a `Range` request after an
//!   interruption, checked against the listed size and SHA-256, then renamed
//!   into place; retried with backoff that honours `429 Retry-After`.
//! - [`mirror`] serves a folder of repositories over the same protocol: the
//!   tests' stand-in for the hub (with fault injection), and `tessera hub
//!   serve`, which lets machines without internet fetch from one that has
//!   the files.
//! - [`weights`] decides which weight files of a sharded safetensors
//!   checkpoint (or of a split GGUF) a pipeline stage needs.
//! - [`gguf`] reads GGUF headers from a prefix of the file (the client's
//!   [`HubClient::gguf_header`] fetches it with `Range` requests), names the
//!   quantizations and split shards of a repository's files, and joins a
//!   split model's shards into the one file the engine opens.
//!
//! # Why not the `hf-hub` crate
//! `hf-hub` 0.4 writes only into its own cache layout (blobs and snapshot
//! links under `~/.cache/huggingface`), does not verify hashes, has no
//! cancellation and no `429`/`Retry-After` handling, and would bring a second
//! major version of `reqwest`. What remains once those are written is the
//! two URL shapes and one JSON listing, so the client is written here on the
//! `reqwest` the node already uses.

mod client;
pub mod gguf;
pub mod mirror;
pub mod weights;

pub use client::{
    DownloadStats, FileProgress, HubClient, HubError, RepoFile, RepoListing, RetryPolicy,
    DEFAULT_ENDPOINT,
};
pub use tokio_util::sync::CancellationToken;

/// Makes rustls (on ring) the process's TLS provider, once; every
/// `reqwest` client needs one (`https://huggingface.co` is TLS).
pub fn install_tls_provider() {
    // An error only means a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The name a file has while it is being downloaded.
pub fn partial_path(dest: &std::path::Path) -> std::path::PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dest.with_file_name(name)
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
