//! `tessera generate --world N --sharding ...` as a user runs it: real rank
//! processes on a loopback ring. Outputs agree with one machine; a rank
//! killed mid-generation makes the run fail within 5 seconds, naming it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{model, tessera};

const PROMPT: &str = "The quick brown fox";
const TOKENS: &str = "32";

fn generate_json(extra: &[&str]) -> Value {
    let model = model();
    let mut args = vec![
        "generate",
        "--model",
        &model,
        "--prompt",
        PROMPT,
        "--max-tokens",
        TOKENS,
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = tessera(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn ids(json: &Value) -> Vec<u64> {
    json["generated_token_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect()
}

/// One machine's greedy ids and its top-1/top-2 margin at each step.
fn single_machine() -> (Vec<u64>, Vec<f64>) {
    let json = generate_json(&["--threads", "2", "--logprobs", "2"]);
    let margins = json["logprobs"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|step| {
            let top = step["top"].as_array().expect("top");
            top[0][1].as_f64().expect("logprob") - top[1][1].as_f64().expect("logprob")
        })
        .collect();
    (ids(&json), margins)
}

fn check_world_2(sharding: &str) {
    let (reference, margins) = single_machine();
    let json = generate_json(&["--world", "2", "--sharding", sharding]);
    let ours = ids(&json);
    // Pipeline stages and tensor ranks run one machine's arithmetic (see
    // tessera_engine::model::gather): token for token, whatever the margins.
    assert_eq!(
        ours, reference,
        "{sharding} world 2 against one machine (margins {margins:?})"
    );
    let dist = &json["distributed"];
    assert_eq!(dist["world"], 2);
    assert_eq!(dist["sharding"], sharding);
    let ranks = dist["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2);
    for (i, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["rank"], i);
        assert!(rank["peak_rss_bytes"].as_u64().expect("rss") > 10_000_000);
        assert!(rank["weight_bytes"].as_u64().expect("weights") > 10_000_000);
    }
    assert!(
        json["stats"]["decode_tokens_per_second"]
            .as_f64()
            .expect("tok/s")
            > 0.0
    );
}

#[test]
fn tensor_parallel_world_2_generates_what_one_machine_does() {
    check_world_2("tensor");
}

#[test]
fn pipeline_world_2_generates_what_one_machine_does() {
    check_world_2("pipeline");
}

/// Starts a long generation, signals rank 1 once text streams, and returns
/// rank 0's stderr and how long it took to fail after the kill.
fn kill_rank_1_mid_generation(world: &str, sharding: &str, signal: &str) -> (String, Duration) {
    let model = model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "generate",
            "--model",
            &model,
            "--prompt",
            PROMPT,
            "--max-tokens",
            "4000",
            "--ignore-eos",
            "--world",
            world,
            "--sharding",
            sharding,
            "--ring-timeout",
            "2",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let (lines_tx, lines) = mpsc::channel::<String>();
    let stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let mut stderr_text = String::new();
    let pid = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("rank 1 starts");
        stderr_text.push_str(&line);
        stderr_text.push('\n');
        if let Some(rest) = line.strip_prefix("started rank 1 (pid ") {
            break rest.trim_end_matches(')').parse::<u32>().expect("pid");
        }
    };
    // Wait until tokens stream: generation is under way.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut first = [0u8; 8];
    stdout.read_exact(&mut first).expect("text streams");
    let killed = Instant::now();
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let deadline = killed + Duration::from_secs(5);
    let exit = loop {
        if let Some(exit) = child.try_wait().expect("wait") {
            break exit;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("rank 0 still running 5 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = killed.elapsed();
    // Drain stdout so nothing blocks, then collect the rest of stderr.
    let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    reader.join().expect("reader");
    stderr_text.extend(lines.try_iter().map(|l| l + "\n"));
    assert_eq!(exit.code(), Some(1), "{stderr_text}");
    (stderr_text, elapsed)
}

#[test]
fn a_killed_rank_fails_the_run_within_5_seconds() {
    // SIGKILL closes the rank's connections; SIGSTOP leaves them open and
    // silent, so only the step timeout (2 s here) can catch it.
    for (world, sharding, signal) in [
        ("2", "pipeline", "-KILL"),
        ("3", "tensor", "-KILL"),
        ("2", "tensor", "-STOP"),
    ] {
        let (stderr, elapsed) = kill_rank_1_mid_generation(world, sharding, signal);
        eprintln!(
            "{sharding} world {world}, {signal}: failed {elapsed:?} after the signal: {}",
            stderr.lines().last().unwrap_or_default()
        );
        // With three ranks, rank 2 (rank 1's successor) sees it go first
        // and says so; rank 0 then sees rank 2 leave.
        assert!(
            stderr.contains("rank 1 closed the connection")
                || stderr.contains("timed out waiting for rank 1"),
            "the error names the rank: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn impossible_splits_are_clear_errors() {
    let model = model();
    for (args, expect) in [
        (vec!["--world", "4", "--sharding", "tensor"], "KV heads"),
        (vec!["--world", "31", "--sharding", "pipeline"], "30 layers"),
        (
            vec![
                "--world",
                "2",
                "--sharding",
                "pipeline",
                "--layers",
                "10,10",
            ],
            "adds up to 20",
        ),
        (vec!["--world", "2", "--ring-timeout", "0"], "ring-timeout"),
    ] {
        let mut all = vec!["generate", "--model", &model, "--prompt", "hi"];
        all.extend_from_slice(&args);
        let out = tessera(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
