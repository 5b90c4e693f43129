//! What the commands share: the data dir's paths and a client's async runtime.

use std::path::PathBuf;

/// The async runtime of a command that talks to a cluster or a server:
/// two worker threads, as its work is mostly waiting on the network.
pub fn client_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The node's data directory: `--data-dir`, else `TESSERA_HOME`, else
/// `~/.tessera`.
pub fn default_data_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("TESSERA_HOME") {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".tessera")
}

/// Where a data dir keeps its event log (DESIGN.md, "Files on disk").
pub fn events_dir(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("events")
}
