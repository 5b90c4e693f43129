//! `tessera replay` and `tessera synth-log` as a user runs them: real child
//! processes over a real sled log.

use std::path::Path;
use std::process::{Command, Output};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn tessera(args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .env_remove("TESSERA_HOME")
        .output()
}

fn synth(dir: &Path, events: u64) -> TestResult {
    let out = tessera(&[
        "synth-log",
        "--data-dir",
        path(dir),
        "--events",
        &events.to_string(),
    ])?;
    assert!(
        out.status.success(),
        "synth-log failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

fn json(out: &Output) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[test]
fn replay_prints_state_digest_and_index_as_json() -> TestResult {
    let dir = tempfile::tempdir()?;
    synth(dir.path(), 25_000)?;
    let end = json(&tessera(&[
        "replay",
        "--data-dir",
        path(dir.path()),
        "--json",
    ])?)?;
    assert_eq!(end["last_index"], 25_000);
    let digest = end["digest"].as_str().ok_or("no digest")?;
    assert_eq!(digest.len(), 64);
    assert_eq!(
        end["state"]["lastIndex"], "25000",
        "proto3 JSON writes u64 as a string"
    );
    assert_eq!(end["state"]["nodes"].as_object().map(|n| n.len()), Some(3));

    // From the snapshot at 20,000 or from the first event: the same state.
    let full = json(&tessera(&[
        "replay",
        "--data-dir",
        path(dir.path()),
        "--json",
        "--no-snapshots",
    ])?)?;
    assert_eq!(full["digest"], end["digest"]);

    let early = json(&tessera(&[
        "replay",
        "--data-dir",
        path(dir.path()),
        "--json",
        "--until",
        "12345",
    ])?)?;
    assert_eq!(early["last_index"], 12_345);
    assert_ne!(early["digest"], end["digest"]);
    let early_full = json(&tessera(&[
        "replay",
        "--data-dir",
        path(dir.path()),
        "--json",
        "--until",
        "12345",
        "--no-snapshots",
    ])?)?;
    assert_eq!(early_full["digest"], early["digest"]);

    let text = tessera(&["replay", "--data-dir", path(dir.path())])?;
    let text = String::from_utf8(text.stdout)?;
    assert!(text.contains(&format!("digest:     {digest}")), "{text}");
    assert!(text.contains("from snapshot 20000"), "{text}");
    Ok(())
}

#[test]
fn replay_events_prints_one_json_object_a_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    synth(dir.path(), 100)?;
    let out = tessera(&[
        "replay",
        "--data-dir",
        path(dir.path()),
        "--events",
        "--from",
        "3",
        "--to",
        "5",
    ])?;
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["index"], 3);
    assert_eq!(lines[0]["type"], "NodeGatheredInfo");
    assert_eq!(lines[0]["event"]["nodeId"], "node-02");
    assert_eq!(lines[2]["type"], "TopologyEdgeCreated");
    let all = tessera(&["replay", "--data-dir", path(dir.path()), "--events"])?;
    assert_eq!(String::from_utf8(all.stdout)?.lines().count(), 100);
    Ok(())
}

#[test]
fn a_missing_log_is_a_clear_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = tessera(&["replay", "--data-dir", path(&dir.path().join("nowhere"))])?;
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.starts_with("error: no event log in"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(())
}

#[test]
fn a_corrupted_entry_is_named_by_its_index() -> TestResult {
    let dir = tempfile::tempdir()?;
    synth(dir.path(), 300)?;
    {
        let db = sled::open(dir.path().join("events"))?;
        let events = db.open_tree("events")?;
        let key = 123u64.to_be_bytes();
        let mut bytes = events.get(key)?.ok_or("entry missing")?.to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        events.insert(key, bytes)?;
        db.flush()?;
    }
    for args in [vec!["--json"], vec!["--events"]] {
        let mut full = vec!["replay", "--data-dir", path(dir.path())];
        full.extend(args);
        let out = tessera(&full)?;
        assert!(!out.status.success());
        let stderr = String::from_utf8(out.stderr)?;
        assert!(
            stderr.contains("event 123 is corrupted: checksum mismatch"),
            "{stderr}"
        );
    }
    Ok(())
}

#[test]
fn replay_past_the_end_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    synth(dir.path(), 10)?;
    let out = tessera(&["replay", "--data-dir", path(dir.path()), "--until", "11"])?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8(out.stderr)?.contains("the log ends at index 10; cannot replay until 11")
    );
    Ok(())
}

#[test]
fn a_log_in_use_by_another_process_is_a_clear_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    synth(dir.path(), 10)?;
    // Hold the log open in this process, as a running node would.
    let _held = sled::open(dir.path().join("events"))?;
    let out = tessera(&["replay", "--data-dir", path(dir.path())])?;
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.contains("is in use by another process"), "{stderr}");
    Ok(())
}
