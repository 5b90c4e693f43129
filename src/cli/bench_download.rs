//! `tessera bench download`: the hub client's throughput from a local hub
//! (the same mirror the tests use, started in this process), against `curl`
//! fetching the same file from the same server in the same run.
//!
//! Each repeat runs both, alternating which goes first, into fresh files on
//! the same file system. The client does all its real work: it lists the
//! repository, streams into a `.partial` file, hashes (SHA-256) as it
//! writes, verifies, syncs the file to disk and renames it. `curl` only
//! writes (no hash, no sync), so the ratio is, if anything, unfair to the
//! client.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use tessera_hub::mirror::Mirror;
use tessera_hub::{CancellationToken, FileProgress, HubClient};

use super::stats;

const REPO: &str = "bench/files";

#[derive(Debug, Args)]
pub struct DownloadBenchArgs {
    /// The file to serve (default: the default model's GGUF).
    #[arg(long)]
    pub file: Option<PathBuf>,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Where the downloads are written (default: a temporary folder under
    /// $TESSERA_HOME, i.e. the file system models are downloaded to).
    #[arg(long)]
    pub scratch: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    file_bytes: u64,
    repeats: usize,
    client_mb_per_s_median: f64,
    curl_mb_per_s_median: f64,
    /// client / curl, medians of the same run.
    ratio: f64,
    client_mb_per_s: Vec<f64>,
    curl_mb_per_s: Vec<f64>,
}

pub fn run(args: DownloadBenchArgs) -> anyhow::Result<()> {
    let file = match args.file {
        Some(file) => file,
        None => super::model_args::resolve_model(super::model_args::DEFAULT_MODEL)?,
    };
    let size = std::fs::metadata(&file)
        .with_context(|| format!("reading {}", file.display()))?
        .len();
    let home = super::support::default_data_dir();
    std::fs::create_dir_all(&home)?;
    let scratch = match args.scratch {
        Some(dir) => tempfile::tempdir_in(dir)?,
        None => tempfile::tempdir_in(&home)?,
    };
    let root = scratch.path().join("hub");
    let repo = root.join(REPO);
    std::fs::create_dir_all(&repo)?;
    let name = file
        .file_name()
        .context("the file has no name")?
        .to_string_lossy()
        .into_owned();
    std::os::unix::fs::symlink(file.canonicalize()?, repo.join(&name))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let (addr, _server) = Mirror::new(&root)
            .start(([127, 0, 0, 1], 0).into())
            .await
            .context("starting the local hub")?;
        let endpoint = format!("http://{addr}");
        let url = format!("{endpoint}/{REPO}/resolve/main/{name}");
        let out = scratch.path().join("out");
        std::fs::create_dir_all(&out)?;
        // Warm the server's hash cache and the page cache of the source.
        HubClient::new(&endpoint, None)?.list(REPO, "main").await?;
        let mut client_rates = Vec::new();
        let mut curl_rates = Vec::new();
        for repeat in 0..args.repeats.max(1) {
            let curl_first = repeat % 2 == 1;
            for which in [curl_first, !curl_first] {
                let dest = out.join(format!(
                    "{repeat}-{}",
                    if which { "curl" } else { "client" }
                ));
                let seconds = if which {
                    curl(&url, &dest).await?
                } else {
                    client(&endpoint, &name, &dest).await?
                };
                let got = std::fs::metadata(&dest)?.len();
                if got != size {
                    bail!("{}: {got} bytes, expected {size}", dest.display());
                }
                std::fs::remove_file(&dest)?;
                let rate = size as f64 / 1e6 / seconds;
                if which {
                    curl_rates.push(rate);
                } else {
                    client_rates.push(rate);
                }
            }
        }
        let (c, k) = (stats::median(&client_rates), stats::median(&curl_rates));
        let report = Report {
            bench: "download",
            file_bytes: size,
            repeats: client_rates.len(),
            client_mb_per_s_median: c,
            curl_mb_per_s_median: k,
            ratio: c / k,
            client_mb_per_s: client_rates,
            curl_mb_per_s: curl_rates,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(())
    })
}

/// Seconds the hub client takes: listing, download, hash, sync, rename.
async fn client(endpoint: &str, name: &str, dest: &Path) -> anyhow::Result<f64> {
    let started = Instant::now();
    // A fresh client each time: the listing is asked for, not cached.
    let client = HubClient::new(endpoint, None)?;
    let listing = client.list(REPO, "main").await?;
    let file = listing.get(name).context("the file is not listed")?.clone();
    client
        .download(
            REPO,
            &listing.commit,
            &file,
            dest,
            &FileProgress::default(),
            &CancellationToken::new(),
        )
        .await?;
    Ok(started.elapsed().as_secs_f64())
}

async fn curl(url: &str, dest: &Path) -> anyhow::Result<f64> {
    let started = Instant::now();
    let status = tokio::process::Command::new("curl")
        .args(["-sS", "--fail", "-o"])
        .arg(dest)
        .arg(url)
        .status()
        .await
        .context("running curl (is it installed?)")?;
    if !status.success() {
        bail!("curl failed: {status}");
    }
    Ok(started.elapsed().as_secs_f64())
}
