//! The dashboard in a real headless Chromium against a real node:
//! `tests/dashboard/dashboard_test.py` (Playwright) places the default
//! model from the Models page, chats and compares with the API's greedy
//! answer, stops a long answer, watches a download from a slow local hub,
//! and travels back in the event log; no console error allowed. Its
//! screenshots are kept in `target/dashboard-screenshots/`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::{master_seen, wait_until, with_model, LocalHub, Node};
use crate::support::{free_port, project_script, python_lib};

/// A GGUF repository on the local hub: a copy of the default model.
const HUB_REPO: &str = "tessera-test/SmolLM2-Slow-GGUF";
/// The local hub's pace: the 98 MB copy takes about 12 s, time enough to
/// watch its progress bar move and to cancel it.
const HUB_BYTES_PER_SECOND: u64 = 8 << 20;
/// The whole browser run's bound (it prints each step as it goes).
const RUN_LIMIT: Duration = Duration::from_secs(600);

fn screenshots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/dashboard-screenshots");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the screenshot folder");
    dir
}

#[test]
fn the_dashboard_places_chats_stops_downloads_and_travels_in_time() {
    let chromium = project_script("chromium");
    let pylib = python_lib();
    let tmp = tempfile::tempdir().expect("tempdir");
    let hub = LocalHub::with_default_model(&tmp.path().join("hub"), HUB_REPO);
    hub.mirror.faults().limit_rate(HUB_BYTES_PER_SECOND);
    let ns = "dashboard";
    let port = free_port();
    let dir = tmp.path().join("a");
    let node = Node::start_env(
        ns,
        with_model(&dir),
        port,
        &[],
        &[],
        &[("HF_ENDPOINT", &hub.endpoint)],
    );
    wait_until(Duration::from_secs(20), || master_seen(ns, port, None)).expect("a master");
    let shots = screenshots();
    let mut run = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/dashboard/dashboard_test.py"
        ))
        .env("PYTHONPATH", pylib)
        .env("TESSERA_API", format!("http://{}", node.api))
        .env("TESSERA_MODEL", "smollm2-135m-instruct-q4_1")
        .env("TESSERA_HUB_REPO", HUB_REPO)
        .env("TESSERA_SCREENSHOTS", &shots)
        .env("CHROMIUM", &chromium)
        .stdin(Stdio::null())
        .spawn()
        .expect("python runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().expect("the browser run") {
            break status;
        }
        if started.elapsed() > RUN_LIMIT {
            let _ = run.kill();
            panic!("the browser run took over {RUN_LIMIT:?}\n{}", node.log());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "the browser run failed ({status}); screenshots in {}\nnode log:\n{}",
        shots.display(),
        node.log()
    );
    let taken = std::fs::read_dir(&shots).map_or(0, |d| d.count());
    assert!(
        taken >= 4,
        "only {taken} screenshots in {}",
        shots.display()
    );
    eprintln!("screenshots in {}", shots.display());
}
