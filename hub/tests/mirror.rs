//! The client against the local mirror: resume, verification, 429,
//! cancellation and errors, over real HTTP on loopback.

// Test code: an unwrap or expect that fails is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tessera_hub::mirror::Mirror;
use tessera_hub::{CancellationToken, FileProgress, HubClient, HubError, RetryPolicy};

const REPO: &str = "acme/tiny";
const SIZE: usize = 8 << 20;

fn contents() -> Vec<u8> {
    // Not all zeros, so a flipped or misplaced byte changes the hash.
    (0..SIZE).map(|i| (i * 31 % 251) as u8).collect()
}

async fn setup() -> (tempfile::TempDir, Mirror, HubClient) {
    let dir = tempfile::tempdir().expect("tempdir");
    let repo = dir.path().join("hub").join(REPO);
    std::fs::create_dir_all(repo.join("sub")).expect("mkdir");
    std::fs::write(repo.join("weights.bin"), contents()).expect("write");
    std::fs::write(repo.join("config.json"), br#"{"a": 1}"#).expect("write");
    std::fs::write(repo.join("sub/nested.txt"), b"nested").expect("write");
    let mirror = Mirror::new(dir.path().join("hub"));
    let (addr, _task) = mirror
        .clone()
        .start(([127, 0, 0, 1], 0).into())
        .await
        .expect("mirror starts");
    let client = HubClient::new(&format!("http://{addr}"), None)
        .expect("client")
        .with_retry(RetryPolicy {
            attempts: 5,
            first_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
            max_retry_after: Duration::from_secs(5),
        });
    (dir, mirror, client)
}

fn key(path: &str) -> String {
    format!("{REPO}/{path}")
}

async fn fetch(
    client: &HubClient,
    dest: &Path,
    cancel: &CancellationToken,
) -> Result<tessera_hub::DownloadStats, HubError> {
    let listing = client.list(REPO, "main").await?;
    let file = listing.get("weights.bin").expect("listed").clone();
    client
        .download(
            REPO,
            &listing.commit,
            &file,
            dest,
            &FileProgress::default(),
            cancel,
        )
        .await
}

#[tokio::test]
async fn the_listing_has_sizes_and_hashes() {
    let (_dir, _mirror, client) = setup().await;
    let listing = client.list(REPO, "main").await.expect("listing");
    let paths: Vec<&str> = listing.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["config.json", "sub/nested.txt", "weights.bin"]);
    let weights = listing.get("weights.bin").expect("weights");
    assert_eq!(weights.size, SIZE as u64);
    assert_eq!(weights.sha256.as_ref().map(String::len), Some(64));
    let small = client
        .fetch_small(REPO, &listing.commit, "sub/nested.txt")
        .await
        .expect("small file");
    assert_eq!(small, b"nested");
}

#[tokio::test]
async fn an_interrupted_download_resumes_where_it_stopped() {
    let (dir, mirror, client) = setup().await;
    mirror.faults().cut_after(&key("weights.bin"), 3 << 20);
    let dest = dir.path().join("out/weights.bin");
    let stats = fetch(&client, &dest, &CancellationToken::new())
        .await
        .expect("download");
    assert_eq!(std::fs::read(&dest).expect("read"), contents());
    assert_eq!(stats.attempts, 2);
    let served = mirror.stats().served(&key("weights.bin"));
    eprintln!(
        "resumed: {served} bytes served for a {SIZE}-byte file ({:.3}x)",
        served as f64 / SIZE as f64
    );
    assert!(
        served as f64 <= 1.1 * SIZE as f64,
        "served {served} bytes for a {SIZE}-byte file"
    );
    assert!(!tessera_hub::partial_path(&dest).exists());
}

#[tokio::test]
async fn a_partial_file_from_an_earlier_run_is_continued() {
    let (dir, mirror, client) = setup().await;
    let dest = dir.path().join("out/weights.bin");
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::write(tessera_hub::partial_path(&dest), &contents()[..5 << 20]).unwrap();
    let stats = fetch(&client, &dest, &CancellationToken::new())
        .await
        .expect("download");
    assert_eq!(stats.resumed_from, 5 << 20);
    assert_eq!(stats.bytes_fetched, (SIZE - (5 << 20)) as u64);
    assert_eq!(
        mirror.stats().served(&key("weights.bin")),
        stats.bytes_fetched
    );
    assert_eq!(std::fs::read(&dest).unwrap(), contents());
}

#[tokio::test]
async fn a_corrupted_file_is_refused_and_fetched_again() {
    let (dir, mirror, client) = setup().await;
    mirror.faults().corrupt_next(&key("weights.bin"));
    let dest = dir.path().join("out/weights.bin");
    let stats = fetch(&client, &dest, &CancellationToken::new())
        .await
        .expect("download");
    assert_eq!(stats.attempts, 2, "the corrupt copy is refused once");
    assert_eq!(std::fs::read(&dest).unwrap(), contents());
}

#[tokio::test]
async fn a_429_is_honoured() {
    let (dir, mirror, client) = setup().await;
    mirror.faults().rate_limit(1, 1);
    let dest = dir.path().join("out/weights.bin");
    let started = Instant::now();
    let stats = fetch(&client, &dest, &CancellationToken::new())
        .await
        .expect("download");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited as Retry-After said"
    );
    assert_eq!(stats.attempts, 2);
    assert_eq!(mirror.stats().rate_limited(), 1);
}

#[tokio::test]
async fn a_cancelled_download_stops_and_keeps_its_partial_file() {
    let (dir, mirror, client) = setup().await;
    // The server asks for a 5 s pause; cancelling ends the wait.
    mirror.faults().rate_limit(1, 5);
    let dest = dir.path().join("out/weights.bin");
    let cancel = CancellationToken::new();
    let canceller = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        canceller.cancel();
    });
    let started = Instant::now();
    let error = fetch(&client, &dest, &cancel).await.expect_err("cancelled");
    assert!(matches!(error, HubError::Cancelled), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "cancel cut the wait short"
    );
    assert!(!dest.exists());
}

#[tokio::test]
async fn missing_files_and_repos_fail_at_once_with_clear_errors() {
    let (dir, _mirror, client) = setup().await;
    let error = client.list("acme/none", "main").await.expect_err("no repo");
    assert!(matches!(error, HubError::NotFound { .. }), "{error}");
    let missing = tessera_hub::RepoFile {
        path: "nope.bin".into(),
        size: 10,
        sha256: None,
        git_oid: None,
    };
    let progress = FileProgress::default();
    let error = client
        .download(
            REPO,
            "main",
            &missing,
            &dir.path().join("x"),
            &progress,
            &CancellationToken::new(),
        )
        .await
        .expect_err("missing file");
    assert!(error.to_string().contains("nope.bin: not found"), "{error}");
    assert_eq!(progress.fetched.load(Ordering::Relaxed), 0);
    let error = client
        .list("not a repo", "main")
        .await
        .expect_err("bad name");
    assert!(matches!(error, HubError::BadRepo(_)), "{error}");
}

/// A paced mirror sends no faster than its rate, and the bytes arrive whole.
#[tokio::test]
async fn a_rate_limited_mirror_paces_its_responses() {
    let (dir, mirror, client) = setup().await;
    mirror.faults().limit_rate(32 << 20);
    let started = Instant::now();
    let stats = fetch(&client, &dir.path().join("out"), &CancellationToken::new())
        .await
        .expect("download");
    let took = started.elapsed();
    assert_eq!(stats.bytes_fetched, SIZE as u64);
    assert_eq!(
        std::fs::read(dir.path().join("out")).expect("file"),
        contents()
    );
    // 8 MiB at 32 MiB/s: at least a quarter of a second.
    assert!(took >= Duration::from_millis(240), "{took:?}");
}
