//! A secured cluster: `tessera cluster init` on one node, `invite`, and
//! `tessera node --join TOKEN` on a second; every link is mutual TLS
//! against the cluster's authority. A tensor-parallel instance across both
//! answers as one machine does; a token works once; a zenoh client with no
//! certificate, or with one from another authority, gets nothing.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::cluster::{
    admin, admin_generate, all_ready, master_seen, place_on, wait_until, with_model, Node,
};
use crate::support::{free_port, BIN};

fn cluster_cli(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("cluster")
        .args(args)
        .output()
        .expect("tessera cluster runs")
}

fn invite(ns: &str, dir: &Path, api: &str, zenoh: u16) -> String {
    let out = cluster_cli(&[
        "invite",
        "--namespace",
        ns,
        "--data-dir",
        &dir.display().to_string(),
        "--join-url",
        &format!("http://{api}"),
        "--connect",
        &format!("tcp/127.0.0.1:{zenoh}"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `tessera admin state` with `credentials` (a cluster folder) or none.
fn state_with(ns: &str, via: u16, credentials: Option<&Path>) -> std::process::Output {
    let mut command = Command::new(BIN);
    command
        .args(["admin", "--namespace", ns, "--timeout", "2", "--connect"])
        .arg(format!("tcp/127.0.0.1:{via}"));
    match credentials {
        Some(folder) => command.arg("--cluster-dir").arg(folder),
        // No folder of the test's own machine either.
        None => command.env("TESSERA_HOME", "/nonexistent"),
    };
    command
        .env_remove("TESSERA_CLUSTER_DIR")
        .args(["--json", "state"])
        .output()
        .expect("admin runs")
}

#[test]
fn a_joined_node_serves_a_tensor_instance_and_strangers_see_nothing() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "secured";
    let (a_dir, b_dir) = (root.path().join("a"), root.path().join("b"));
    let out = cluster_cli(&[
        "init",
        "--namespace",
        ns,
        "--data-dir",
        &a_dir.display().to_string(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The test's admin commands (the cluster helpers) use a's credentials.
    std::env::set_var("TESSERA_CLUSTER_DIR", a_dir.join("cluster"));
    let ports = [free_port(), free_port()];
    let a = Node::start(ns, with_model(&a_dir), ports[0], &[]);
    assert!(a.log().contains("secured cluster"), "{}", a.log());
    let token = invite(ns, &a_dir, &a.api, ports[0]);
    // b has no --connect: the token says where a is.
    let b = Node::start_with(ns, with_model(&b_dir), ports[1], &[], &["--join", &token]);
    wait_until(Duration::from_secs(30), || {
        master_seen(ns, ports[0], None).filter(|(_, count)| *count == 2)
    })
    .unwrap_or_else(|| panic!("two nodes\n{}\n{}", a.log(), b.log()));
    assert!(b_dir.join("cluster/cert.pem").is_file());
    assert!(
        !b_dir.join("cluster/authority.key").exists(),
        "the authority's key stays on a"
    );

    let instance = place_on(ns, ports[0], "tensor", 2);
    wait_until(Duration::from_secs(120), || {
        all_ready(ns, ports[0], &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("ready\n{}\n{}", a.log(), b.log()));
    // The ring is sealed; its secret is in the log for members, never on
    // the HTTP API.
    let logged = admin(ns, ports[0], None, "state").expect("state");
    let placed = &logged["state"]["instances"][&instance];
    assert_eq!(placed["ringSealed"], true, "{placed}");
    assert!(placed["ringSecret"].as_str().is_some_and(|s| !s.is_empty()));
    let (_, cluster) = crate::cluster::http(&b.api, "GET", "/cluster", "");
    assert!(cluster.contains("\"secured\":true"), "{cluster}");
    let (status, shown) = crate::cluster::http(&a.api, "GET", "/state", "");
    assert_eq!(status, 200);
    assert!(
        shown.contains("\"ringSealed\":true") && !shown.contains("ringSecret"),
        "{shown}"
    );
    let prompt = "The quick brown fox";
    let single = Command::new(BIN)
        .args(["generate", "--model"])
        .arg(tessera_engine::testing::default_model_path())
        .args(["--prompt", prompt, "--max-tokens", "16", "--json"])
        .output()
        .expect("generate");
    let single: serde_json::Value = serde_json::from_slice(&single.stdout).expect("JSON");
    let answer = admin_generate(ns, ports[1], "smollm2-135m-instruct-q4_1", prompt)
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", a.log(), b.log()));
    assert_eq!(answer, single["text"].as_str().unwrap_or_default());
    let joined = |log: String| {
        let plain = without_colours(&log);
        plain.contains("ring: joined") && plain.contains("sealed=true")
    };
    assert!(
        joined(a.log()) && joined(b.log()),
        "{}\n{}",
        a.log(),
        b.log()
    );

    // The token was used: a third machine cannot join with it.
    let c_dir = root.path().join("c");
    let again = Command::new(BIN)
        .args([
            "node",
            "--namespace",
            ns,
            "--no-multicast",
            "--api-port",
            "0",
        ])
        .arg("--data-dir")
        .arg(&c_dir)
        .args(["--join", &token])
        .output()
        .expect("node runs");
    assert!(!again.status.success());
    let refusal = String::from_utf8_lossy(&again.stderr);
    assert!(refusal.contains("already used"), "{refusal}");
    assert!(!c_dir.join("cluster/cert.pem").exists());

    // No certificate, or one of another authority: no session at all.
    let stranger = root.path().join("stranger");
    let out = cluster_cli(&[
        "init",
        "--namespace",
        ns,
        "--data-dir",
        &stranger.display().to_string(),
    ]);
    assert!(out.status.success());
    for credentials in [None, Some(stranger.join("cluster"))] {
        let out = state_with(ns, ports[0], credentials.as_deref());
        assert!(!out.status.success(), "{credentials:?} read the state");
        assert!(out.stdout.is_empty(), "{credentials:?}");
    }
    let member = state_with(ns, ports[0], Some(&a_dir.join("cluster")));
    assert!(
        member.status.success(),
        "{}",
        String::from_utf8_lossy(&member.stderr)
    );
    assert!(admin(ns, ports[0], None, "state").is_some());
}

/// A log without its terminal colour codes (`ESC [ ... m`).
fn without_colours(log: &str) -> String {
    let mut plain = String::with_capacity(log.len());
    let mut in_code = false;
    for c in log.chars() {
        match (in_code, c) {
            (false, '\u{1b}') => in_code = true,
            (false, c) => plain.push(c),
            (true, 'm') => in_code = false,
            (true, _) => {}
        }
    }
    plain
}
