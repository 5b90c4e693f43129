//! What the workspace's tests share: where the default model is, the
//! listeners of a loopback ring, and [`hf_export`] (a GGUF as a Hugging
//! Face folder). A dev-dependency only: none of it ships.

// Test support: a failure here (no free port) is the test's failure.
#![allow(clippy::expect_used)]

pub mod hf_export;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;

/// The default model's file name inside its models folder.
pub const DEFAULT_MODEL_DIR: &str = "smollm2-135m-instruct-q4_1";
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model's GGUF: `TESSERA_TEST_MODEL`, else under
/// `$TESSERA_HOME/models`, else `~/.tessera/models`. Panics with the fix when
/// it is missing: tests that need the model must fail, not skip.
pub fn default_model_path() -> PathBuf {
    if let Some(path) = std::env::var_os("TESSERA_TEST_MODEL") {
        return PathBuf::from(path);
    }
    let home = std::env::var_os("TESSERA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".tessera")))
        .unwrap_or_else(|| PathBuf::from(".tessera"));
    let path = home
        .join("models")
        .join(DEFAULT_MODEL_DIR)
        .join(DEFAULT_MODEL_FILE);
    assert!(
        path.is_file(),
        "the default model is missing at {}: run scripts/fetch-model (or set TESSERA_TEST_MODEL)",
        path.display()
    );
    path
}

/// The default embedding model's folder inside the models folder.
pub const DEFAULT_EMBEDDING_MODEL_DIR: &str = "all-minilm-l6-v2";

/// The default embedding model (all-MiniLM-L6-v2, a sentence-transformers
/// folder), as `scripts/fetch-model` installs it: `TESSERA_TEST_EMBEDDING_MODEL`,
/// else under the models folder. Panics with the fix when it is missing.
pub fn default_embedding_model_path() -> PathBuf {
    if let Some(path) = std::env::var_os("TESSERA_TEST_EMBEDDING_MODEL") {
        return PathBuf::from(path);
    }
    let home = std::env::var_os("TESSERA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".tessera")))
        .unwrap_or_else(|| PathBuf::from(".tessera"));
    let path = home.join("models").join(DEFAULT_EMBEDDING_MODEL_DIR);
    assert!(
        path.join("model.safetensors").is_file(),
        "the default embedding model is missing at {}: run scripts/fetch-model (or set TESSERA_TEST_EMBEDDING_MODEL)",
        path.display()
    );
    path
}

/// `n` listeners on free loopback ports and their addresses: one per rank of
/// a ring run in one test.
pub fn loopback_listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a loopback port"))
        .collect();
    let addrs = listeners
        .iter()
        .map(|l| l.local_addr().expect("a bound address"))
        .collect();
    (listeners, addrs)
}

/// Says that `test` could not run its `path` on this machine (a CPU
/// feature it lacks, say), so that no test passes silently in its place:
/// on stderr, and as a line of the file `TESSERA_NOT_RUN_HERE` names, which
/// `scripts/test` prints as a summary at its end.
pub fn not_run_here(test: &str, path: &str) {
    use std::io::Write;
    let line = format!("not run here: {test}: {path}");
    eprintln!("{line}");
    let Some(file) = std::env::var_os("TESSERA_NOT_RUN_HERE") else {
        return;
    };
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&file)
        .and_then(|mut f| writeln!(f, "{line}"));
    if let Err(error) = appended {
        eprintln!("could not record it in {}: {error}", file.to_string_lossy());
    }
}
