//! Fault injection on real `tessera node` processes on loopback: the master
//! killed and restarted again and again, a frozen master (SIGSTOP, then
//! SIGCONT), a node that led alone rejoining, rank 0's node killed under a
//! stream, requests sent while the master dies, idle and slow HTTP
//! connections. Each scenario prints its figures (`FAULT` lines).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cluster::{
    admin, all_ready, http, indices_contiguous, master_seen, place_on, replay, state_of,
    wait_until, with_model, Node,
};
use crate::support::{free_port, BIN};

const MODEL: &str = "smollm2-135m-instruct-q4_1";

/// The master every node in `nodes` reports, if they all report the same
/// one and see all of them.
fn agreed_master(ns: &str, nodes: &[Node]) -> Option<String> {
    let mut seen = Vec::new();
    for node in nodes {
        let (master, count) = master_seen(ns, node.port, Some(&node.id))?;
        if count != nodes.len() {
            return None;
        }
        seen.push(master);
    }
    let first = seen.first()?.clone();
    seen.iter().all(|m| *m == first).then_some(first)
}

/// The master that every node but `gone` agrees on, once it is not `old`
/// (within 10 s).
fn new_master(ns: &str, nodes: &[Node], gone: usize, old: &str) -> Option<String> {
    let others: Vec<&Node> = (0..nodes.len())
        .filter(|i| *i != gone)
        .map(|i| &nodes[i])
        .collect();
    let (successor, _) = wait_until(Duration::from_secs(10), || {
        let seen = others
            .iter()
            .map(|n| master_seen(ns, n.port, Some(&n.id)))
            .collect::<Option<Vec<_>>>()?;
        let first = seen.first()?.0.clone();
        (first != old && seen.iter().all(|(m, _)| *m == first)).then_some(first)
    })?;
    Some(successor)
}

/// Node "a", without a worker, once it leads alone (it serves the API and
/// keeps the log; the models run elsewhere).
fn leader(ns: &str, root: &Path, port: u16) -> Node {
    let a = Node::start_with(ns, &root.join("a"), port, &[], &["--no-worker"]);
    wait_until(Duration::from_secs(20), || master_seen(ns, port, None)).expect("a leads");
    a
}

/// Every node at the same index with the same digest.
fn equal_states(ns: &str, nodes: &[Node]) -> Option<(u64, String)> {
    let states = nodes
        .iter()
        .map(|n| state_of(ns, n.port, &n.id))
        .collect::<Option<Vec<_>>>()?;
    let first = states.first()?.clone();
    states.iter().all(|s| *s == first).then_some(first)
}

/// Stops every node; each log is contiguous, and all replay to one digest
/// at the index they all reach.
fn logs_agree(nodes: &mut [Node]) {
    for node in nodes.iter_mut() {
        node.stop();
    }
    let ends: Vec<u64> = nodes.iter().map(|n| indices_contiguous(&n.dir)).collect();
    let common = ends.iter().copied().min().unwrap_or(0);
    let digests: Vec<(u64, String)> = nodes.iter().map(|n| replay(&n.dir, Some(common))).collect();
    assert!(
        digests.iter().all(|d| *d == digests[0]),
        "equal digests at index {common}: {digests:?}"
    );
}

fn signal(node: &Node, name: &str) {
    let status = Command::new("kill")
        .args([name, &node.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {name}");
}

fn three_nodes(ns: &str, root: &Path) -> (Vec<Node>, Vec<Vec<u16>>) {
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    // b and c dial a; a dials no one, so when a comes back it is b's and
    // c's zenoh sessions that must find it again (the slow direction).
    let connects = vec![vec![], vec![ports[0]], vec![ports[0], ports[1]]];
    let mut nodes = Vec::new();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        nodes.push(Node::start_with(
            ns,
            &root.join(name),
            ports[i],
            &connects[i],
            &["--no-worker"],
        ));
        if i == 0 {
            wait_until(Duration::from_secs(20), || master_seen(ns, ports[0], None))
                .expect("a leads alone");
        }
    }
    wait_until(Duration::from_secs(20), || agreed_master(ns, &nodes)).expect("one master");
    (nodes, connects)
}

#[test]
fn the_master_killed_and_restarted_five_times_leaves_one_master_and_one_log() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-restart";
    let (mut nodes, connects) = three_nodes(ns, root.path());
    for round in 1..=5 {
        let master = agreed_master(ns, &nodes).expect("one master before the kill");
        let dead = nodes.iter().position(|n| n.id == master).expect("master");
        nodes[dead].kill();
        let killed = Instant::now();
        let successor =
            new_master(ns, &nodes, dead, &master).expect("a new master among the survivors");
        let failover = killed.elapsed();

        let dir = nodes[dead].dir.clone();
        let restarted = Instant::now();
        nodes[dead] = Node::start_with(
            ns,
            &dir,
            nodes[dead].port,
            &connects[dead],
            &["--no-worker"],
        );
        let (_, rejoin) = wait_until(Duration::from_secs(20), || {
            (agreed_master(ns, &nodes)? == successor).then_some(())
        })
        .unwrap_or_else(|| {
            let logs: String = nodes.iter().map(Node::log).collect();
            panic!("round {round}: the restarted node follows {successor}\n{logs}")
        });
        let ((index, _), _) = wait_until(Duration::from_secs(20), || equal_states(ns, &nodes))
            .expect("equal states after the restart");
        let agreed = restarted.elapsed();
        let log = nodes[dead].log();
        assert!(
            !log.contains("elected master"),
            "round {round}: the restarted node led\n{log}"
        );
        eprintln!(
            "FAULT master-restart round {round}: new master after {failover:?}; the \
             restarted node follows {rejoin:?} after its start; equal digests on all three \
             at index {index} {agreed:?} after its start"
        );
    }
    let errors: usize = nodes
        .iter()
        .map(|n| n.log().matches(" ERROR ").count())
        .sum();
    assert!(errors < 50, "bounded error logging: {errors} ERROR lines");
    logs_agree(&mut nodes);
}

#[test]
fn a_frozen_master_steps_down_when_it_wakes() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-freeze";
    let (mut nodes, _) = three_nodes(ns, root.path());
    let master = agreed_master(ns, &nodes).expect("one master");
    let frozen = nodes.iter().position(|n| n.id == master).expect("master");
    signal(&nodes[frozen], "-STOP");
    let stopped = Instant::now();
    let successor =
        new_master(ns, &nodes, frozen, &master).expect("a new master while the old one is frozen");
    let failover = stopped.elapsed();
    std::thread::sleep(Duration::from_secs(5).saturating_sub(stopped.elapsed()));
    signal(&nodes[frozen], "-CONT");
    let (_, rejoin) = wait_until(Duration::from_secs(20), || {
        (agreed_master(ns, &nodes)? == successor).then_some(())
    })
    .unwrap_or_else(|| {
        let logs: String = nodes.iter().map(Node::log).collect();
        panic!("the woken master follows {successor}\n{logs}")
    });
    let ((index, _), agree) =
        wait_until(Duration::from_secs(20), || equal_states(ns, &nodes)).expect("equal states");
    eprintln!(
        "FAULT master-sigstop-5s: new master after {failover:?}; woken master follows \
         {rejoin:?} after SIGCONT; equal digests at index {index} {agree:?} later"
    );
    logs_agree(&mut nodes);
}

#[test]
fn a_node_that_led_alone_drops_its_forked_events_when_it_rejoins() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-fork";
    let (mut nodes, connects) = three_nodes(ns, root.path());
    let master = agreed_master(ns, &nodes).expect("one master");
    let lone = nodes.iter().position(|n| n.id == master).expect("master");
    nodes[lone].kill();
    let others: Vec<usize> = (0..3).filter(|i| *i != lone).collect();
    new_master(ns, &nodes, lone, &master).expect("a new master");
    let (before, _) = state_of(ns, nodes[others[0]].port, &nodes[others[0]].id).expect("state");

    // Back on a port nobody dials and dialling no one: after its rejoin
    // listen it leads alone at the clock the others' master already holds,
    // and writes its own events (the others time out, on its side).
    let dir = nodes[lone].dir.clone();
    let original = nodes[lone].port;
    let alone_port = free_port();
    nodes[lone] = Node::start_with(ns, &dir, alone_port, &[], &["--no-worker"]);
    let ((forked, _), _) = wait_until(Duration::from_secs(20), || {
        let (index, digest) = state_of(ns, alone_port, &nodes[lone].id)?;
        (index > before).then_some((index, digest))
    })
    .unwrap_or_else(|| panic!("the lone node writes as master\n{}", nodes[lone].log()));
    // A clean stop, so that what it wrote alone is on its disk.
    nodes[lone].stop();

    // Back on its own port: it follows the cluster's master, drops what it
    // wrote alone and takes the master's log.
    nodes[lone] = Node::start_with(ns, &dir, original, &connects[lone], &["--no-worker"]);
    let ((index, _), took) = wait_until(Duration::from_secs(20), || {
        agreed_master(ns, &nodes)?;
        equal_states(ns, &nodes)
    })
    .unwrap_or_else(|| {
        let logs: String = nodes.iter().map(Node::log).collect();
        panic!("the forked node rejoins\n{logs}")
    });
    let log = nodes[lone].log();
    let logs: String = nodes.iter().map(Node::log).collect();
    assert!(
        !log.contains("elected master"),
        "the node that led alone follows the cluster's master when it rejoins\n{logs}"
    );
    assert!(
        log.contains("dropped events the master does not hold"),
        "the fork was repaired by dropping its tail\n{logs}"
    );
    eprintln!(
        "FAULT fork-repair: a lone master wrote up to index {forked}; on rejoining it \
         dropped its tail and reached the cluster's digest at index {index} in {took:?}"
    );
    logs_agree(&mut nodes);
}

/// Reads until the server closes the connection or `limit` passes; true
/// when it closed.
fn closed_within(stream: &mut std::net::TcpStream, limit: Duration) -> bool {
    use std::io::Read;
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 1024];
    while Instant::now() < deadline {
        let _ = stream.set_read_timeout(Some(limit.min(Duration::from_millis(100))));
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn idle_and_slow_api_connections_are_closed_and_bounded() {
    use std::io::Write;
    use std::net::TcpStream;
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-http";
    let node = Node::start_with(
        ns,
        &root.path().join("a"),
        free_port(),
        &[],
        &[
            "--no-worker",
            "--api-idle-timeout",
            "1",
            "--api-max-connections",
            "8",
        ],
    );
    let address = node
        .api
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let get = |path: &str| {
        let mut stream = TcpStream::connect(&address).expect("connect");
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .expect("write");
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(&mut stream, &mut answer);
        answer
    };
    assert!(get("/node_id").starts_with("HTTP/1.1 200"));
    // The server lets that connection's slot go a moment after the client
    // has read the answer.
    std::thread::sleep(Duration::from_millis(300));

    // Eight silent connections fill the bound; a ninth is closed at once.
    let started = Instant::now();
    let mut idle: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(&address).expect("connect"))
        .collect();
    // A slow client: half a header, then nothing.
    idle[0]
        .write_all(b"GET /node_id HTTP/1.1\r\nHo")
        .expect("write");
    std::thread::sleep(Duration::from_millis(200));
    let mut ninth = TcpStream::connect(&address).expect("connect");
    let refused = closed_within(&mut ninth, Duration::from_millis(500));
    assert!(refused, "the connection over the bound is closed at once");
    // Each silent or slow one is closed after the idle timeout.
    for (i, stream) in idle.iter_mut().enumerate() {
        assert!(
            closed_within(stream, Duration::from_secs(5)),
            "idle connection {i} is closed"
        );
    }
    let closed_after = started.elapsed();
    assert!(closed_after < Duration::from_secs(4), "{closed_after:?}");
    // With the bound free again, requests are served.
    assert!(get("/node_id").starts_with("HTTP/1.1 200"));
    // 300 idle connections at once: 8 are held (then closed by the idle
    // timeout), the rest closed at once; the node serves throughout.
    let mut burst: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&address).expect("connect"))
        .collect();
    // Before the idle timeout (1 s) could close any, all but 8 are closed.
    let opened = Instant::now();
    let mut closed = vec![false; burst.len()];
    while closed.iter().filter(|c| **c).count() < 292
        && opened.elapsed() < Duration::from_millis(800)
    {
        for (stream, closed) in burst.iter_mut().zip(closed.iter_mut()) {
            if !*closed {
                *closed = closed_within(stream, Duration::from_millis(1));
            }
        }
    }
    let at_once = closed.iter().filter(|c| **c).count();
    assert!(at_once >= 292, "{at_once} of 300 closed at once");
    let all_closed = burst
        .iter_mut()
        .all(|s| closed_within(s, Duration::from_secs(5)));
    assert!(all_closed, "every idle connection is closed");
    assert!(get("/node_id").starts_with("HTTP/1.1 200"));
    eprintln!(
        "FAULT http: 9th connection over a bound of 8 closed at once; 8 idle or slow \
         connections closed after {closed_after:?} (timeout 1 s); of 300 idle connections \
         {at_once} closed at once and the rest by the timeout; served throughout"
    );
}

/// A chat request body for the default model.
fn chat(max_tokens: u32, stream: bool) -> String {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
}

/// What a streaming client saw, line by line, with the time of each.
enum Seen {
    Data,
    Error(Instant, String),
    End(Instant),
}

/// Streams a chat on its own thread; each SSE data line is reported.
fn stream_chat(api: &str, max_tokens: u32) -> std::sync::mpsc::Receiver<Seen> {
    use std::io::{BufRead, BufReader, Write};
    let (tx, rx) = std::sync::mpsc::channel();
    let api = api.to_string();
    std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(&api).expect("connect");
        let body = chat(max_tokens, true);
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).expect("write");
        stream.write_all(body.as_bytes()).expect("write");
        let _ = stream.set_read_timeout(Some(Duration::from_secs(150)));
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if let Some(data) = line.strip_prefix("data: ") {
                let now = Instant::now();
                if data.trim() == "[DONE]" {
                    break;
                }
                let seen = if data.contains("\"error\"") {
                    Seen::Error(now, data.trim().to_string())
                } else {
                    Seen::Data
                };
                if tx.send(seen).is_err() {
                    return;
                }
            }
        }
        let _ = tx.send(Seen::End(Instant::now()));
    });
    rx
}

/// The node running rank 0 of `instance`.
fn rank0_node(ns: &str, via: u16, instance: &str) -> String {
    let state = admin(ns, via, None, "state").expect("state");
    state["state"]["instances"][instance]["ranks"][0]["nodeId"]
        .as_str()
        .expect("rank 0")
        .to_string()
}

#[test]
fn losing_rank_0s_node_mid_stream_ends_the_stream_at_once_and_the_model_serves_again() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-rank0";
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    // a leads and serves the API but runs no model; b and c hold it.
    let a = leader(ns, root.path(), ports[0]);
    let mut workers: Vec<Node> = ["b", "c"]
        .iter()
        .map(|name| {
            Node::start(
                ns,
                with_model(&root.path().join(name)),
                free_port(),
                &[ports[0]],
            )
        })
        .collect();
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, n)| *n == 3)
    })
    .expect("three nodes");
    let instance = place_on(ns, ports[0], "tensor", 2);
    let (_, to_ready) = wait_until(Duration::from_secs(90), || {
        all_ready(ns, ports[0], &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("ready\n{}{}", workers[0].log(), workers[1].log()));
    // Two nodes on one machine, each with its own slot of ring ports.
    let collisions: usize = workers
        .iter()
        .map(|w| w.log().matches("Address already in use").count())
        .sum();
    assert_eq!(collisions, 0, "no ring port collided");
    eprintln!(
        "FAULT two nodes on one machine: a tensor instance over both ready {to_ready:?} \
         after placement, no ring port collision"
    );

    // Eight clients in one batch, each with text flowing, when rank 0's
    // node dies: every stream ends with an error, none silently. (Each
    // reserves its prompt and max_tokens in the KV cache, 2,048 positions
    // a sequence: 1,000 tokens lets all eight in at once.)
    let streams: Vec<_> = (0..8).map(|_| stream_chat(&a.api, 1000)).collect();
    for seen in &streams {
        let mut tokens = 0;
        while tokens < 3 {
            match seen.recv_timeout(Duration::from_secs(60)).expect("tokens") {
                Seen::Data => tokens += 1,
                Seen::Error(_, e) => panic!("error before the kill: {e}"),
                Seen::End(_) => panic!("a stream ended before the kill"),
            }
        }
    }
    let victim = rank0_node(ns, ports[0], &instance);
    let dead = workers
        .iter()
        .position(|w| w.id == victim)
        .expect("rank 0 on a worker");
    workers[dead].kill();
    let killed = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut error = String::new();
    for seen in &streams {
        let ended = loop {
            match seen
                .recv_timeout(Duration::from_secs(150))
                .expect("the stream ends")
            {
                Seen::Data => {}
                Seen::Error(at, error) => break (at, Some(error)),
                Seen::End(at) => break (at, None),
            }
        };
        let to_error = ended.0.saturating_duration_since(killed);
        error = ended
            .1
            .expect("the stream ends with an error, not silently");
        assert!(
            to_error <= Duration::from_secs(2),
            "error after {to_error:?}: {error}"
        );
        slowest = slowest.max(to_error);
    }
    // A new request, without any retry by the client, waits for the model
    // to be placed again on the node left and is answered.
    let asked = Instant::now();
    let (status, body) = http(&a.api, "POST", "/v1/chat/completions", &chat(8, false));
    assert_eq!(status, 200, "{body}\n{}", a.log());
    let served_after = asked.elapsed();
    // No ghosts: the deleted instance's runners left the state.
    let state = admin(ns, ports[0], None, "state").expect("state");
    let ghosts: Vec<&String> = state["state"]["runners"]
        .as_object()
        .map(|r| r.keys().filter(|k| k.starts_with(&instance)).collect())
        .unwrap_or_default();
    assert!(
        ghosts.is_empty(),
        "runners of the deleted instance: {ghosts:?}"
    );
    eprintln!(
        "FAULT rank0-node-sigkill under a batch of 8 streams: every stream got an error \
         within {slowest:?} of the kill ({}); a new request was answered {served_after:?} \
         after it was sent, on the instance placed again",
        error.chars().take(160).collect::<String>()
    );
}

#[test]
fn twenty_requests_sent_while_the_master_dies_all_succeed_once() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-requests";
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut a = leader(ns, root.path(), ports[0]);
    let mut b = Node::start(
        ns,
        with_model(&root.path().join("b")),
        ports[1],
        &[ports[0]],
    );
    let mut c = Node::start_with(
        ns,
        &root.path().join("c"),
        ports[2],
        &[ports[0], ports[1]],
        &["--no-worker"],
    );
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, n)| *n == 3)
    })
    .expect("three nodes");
    let instance = place_on(ns, ports[0], "pipeline", 1);
    wait_until(Duration::from_secs(90), || {
        all_ready(ns, ports[1], &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("ready\n{}", b.log()));
    let (status, body) = http(&b.api, "POST", "/v1/chat/completions", &chat(4, false));
    assert_eq!(status, 200, "{body}");

    // Eight streams on b while the master (a) dies.
    let streams: Vec<_> = (0..8).map(|_| stream_chat(&b.api, 24)).collect();
    match streams[0]
        .recv_timeout(Duration::from_secs(60))
        .expect("a first token")
    {
        Seen::Data => {}
        Seen::Error(_, e) => panic!("error before the kill: {e}"),
        Seen::End(_) => panic!("ended before the kill"),
    }
    a.kill();
    let killed = Instant::now();
    let requests: Vec<_> = (0..20)
        .map(|i| {
            let api = b.api.clone();
            std::thread::sleep(Duration::from_millis(150));
            std::thread::spawn(move || {
                let sent = killed.elapsed();
                let started = Instant::now();
                let (status, body) = http(&api, "POST", "/v1/chat/completions", &chat(4, false));
                (i, sent, started.elapsed(), status, body)
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for request in requests {
        let (i, sent, took, status, body) = request.join().expect("request thread");
        assert_eq!(
            status,
            200,
            "request {i} sent {sent:?} after the kill: {body}\n{}",
            b.log()
        );
        slowest = slowest.max(took);
    }
    for stream in &streams {
        loop {
            match stream
                .recv_timeout(Duration::from_secs(120))
                .expect("the stream ends")
            {
                Seen::Data => {}
                Seen::Error(_, error) => panic!("a stream failed with the master: {error}"),
                Seen::End(_) => break,
            }
        }
    }
    let resends = b.log().matches("sending it again").count();
    b.stop();
    c.stop();
    // Every command made one task.
    let out = Command::new(BIN)
        .args(["replay", "--events", "--data-dir"])
        .arg(&b.dir)
        .output()
        .expect("replay runs");
    let mut tasks_per_command = std::collections::BTreeMap::<String, usize>::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let event: serde_json::Value = serde_json::from_str(line).expect("JSON");
        if event["type"] != "TaskCreated" {
            continue;
        }
        if let Some(command) = event
            .pointer("/event/task/commandId")
            .and_then(|c| c.as_str())
        {
            *tasks_per_command.entry(command.to_string()).or_default() += 1;
        }
    }
    assert!(
        tasks_per_command.len() >= 21,
        "tasks in the log: {tasks_per_command:?}"
    );
    let twice: Vec<_> = tasks_per_command.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "commands applied twice: {twice:?}");
    eprintln!(
        "FAULT master-sigkill under 8 streams, with 20 requests in the 3 s after: the 8 \
         streams completed, the 20 requests answered 200 (slowest {slowest:?}), {resends} \
         commands sent again, none applied twice"
    );
}

#[test]
fn forged_election_messages_change_nothing() {
    use prost::Message;
    use tessera_protos::v1::{election_message, Campaign, ElectionMessage, Victory};
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-forged";
    let ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
    let a = leader(ns, root.path(), ports[0]);
    let b = Node::start_with(
        ns,
        &root.path().join("b"),
        ports[1],
        &[ports[0]],
        &["--no-worker"],
    );
    let nodes = [a, b];
    let master = wait_until(Duration::from_secs(20), || agreed_master(ns, &nodes))
        .expect("one master")
        .0;
    let follower = nodes.iter().find(|n| n.id != master).expect("a follower");
    let before: Vec<usize> = nodes
        .iter()
        .map(|n| n.log().matches("following").count())
        .collect();

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let client = crate::support::admin_client(ns, ports[0]).await;
        let session = &client.bus().session;
        let forged = [
            // A victory from a node that does not exist, far ahead.
            ElectionMessage {
                clock: 1001,
                node_id: "ghost".into(),
                last_applied_index: u64::MAX,
                seniority_ms: u64::MAX,
                kind: Some(election_message::Kind::Victory(Victory {})),
            },
            // A campaign in a member's name, a thousand rounds ahead.
            ElectionMessage {
                clock: 1001,
                node_id: follower.id.clone(),
                last_applied_index: u64::MAX,
                seniority_ms: u64::MAX,
                kind: Some(election_message::Kind::Campaign(Campaign {})),
            },
        ];
        for message in &forged {
            for _ in 0..5 {
                session
                    .put(format!("tessera/{ns}/election"), message.encode_to_vec())
                    .await
                    .expect("put");
            }
        }
        client.close().await.expect("close");
    });
    // Heartbeats go on meanwhile; nothing may change.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(agreed_master(ns, &nodes).as_deref(), Some(master.as_str()));
    let after: Vec<usize> = nodes
        .iter()
        .map(|n| n.log().matches("following").count())
        .collect();
    let logs: String = nodes.iter().map(Node::log).collect();
    assert_eq!(before, after, "no node followed anyone new\n{logs}");
    assert!(
        !logs.contains("won the election; settling clock=2"),
        "{logs}"
    );
    eprintln!(
        "FAULT forged election messages (victory of a node that does not exist at clock \
         1001, a member's campaign 1000 rounds ahead): master and clock unchanged"
    );
}

#[test]
fn an_instance_whose_runners_keep_failing_is_given_up_and_its_requests_fail_fast() {
    use std::io::{Seek, SeekFrom, Write};
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-given-up";
    // The model's file, whole in size but with a broken header: every
    // runner fails to load it.
    let dir = root.path().join("a");
    let models = dir.join("models").join(tessera_testkit::DEFAULT_MODEL_DIR);
    std::fs::create_dir_all(&models).expect("models dir");
    let broken = models.join(tessera_testkit::DEFAULT_MODEL_FILE);
    std::fs::copy(tessera_testkit::default_model_path(), &broken).expect("copy");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(&broken)
        .expect("open");
    file.seek(SeekFrom::Start(0)).expect("seek");
    file.write_all(b"NOPE").expect("break the magic");
    drop(file);
    let node = Node::start_with(ns, &dir, free_port(), &[], &["--offline"]);
    let asked = Instant::now();
    let (status, body) = http(&node.api, "POST", "/v1/chat/completions", &chat(4, false));
    let first = asked.elapsed();
    assert_eq!(status, 503, "{body}\n{}", node.log());
    assert!(body.contains("given up"), "{body}");
    assert!(body.contains("failed 5 times"), "{body}");
    // From now on at once, with the reason.
    let asked = Instant::now();
    let (status, again) = http(&node.api, "POST", "/v1/chat/completions", &chat(4, false));
    let second = asked.elapsed();
    assert_eq!(status, 503, "{again}");
    assert!(again.contains("given up"), "{again}");
    assert!(second < Duration::from_secs(1), "{second:?}");
    eprintln!(
        "FAULT runners that keep failing (a broken model file): the instance was given up \
         after 5 failures; the waiting request got 503 with the reason after {first:?}, \
         the next one after {second:?}"
    );
}

#[test]
fn a_worker_frozen_for_five_seconds_under_eight_streams_loses_none() {
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-worker-stop";
    let ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
    let a = leader(ns, root.path(), ports[0]);
    let b = Node::start(
        ns,
        with_model(&root.path().join("b")),
        ports[1],
        &[ports[0]],
    );
    let nodes = [a, b];
    wait_until(Duration::from_secs(20), || agreed_master(ns, &nodes)).expect("two nodes");
    let instance = place_on(ns, ports[0], "pipeline", 1);
    wait_until(Duration::from_secs(90), || {
        all_ready(ns, ports[0], &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("ready\n{}", nodes[1].log()));

    let streams: Vec<_> = (0..8).map(|_| stream_chat(&nodes[0].api, 24)).collect();
    match streams[0]
        .recv_timeout(Duration::from_secs(60))
        .expect("a first token")
    {
        Seen::Data => {}
        Seen::Error(_, e) => panic!("error before the freeze: {e}"),
        Seen::End(_) => panic!("ended before the freeze"),
    }
    signal(&nodes[1], "-STOP");
    let stopped = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    signal(&nodes[1], "-CONT");
    let (mut completed, mut errors, mut last_end) = (0, Vec::new(), Duration::ZERO);
    for stream in &streams {
        loop {
            match stream
                .recv_timeout(Duration::from_secs(120))
                .expect("the stream ends")
            {
                Seen::Data => {}
                Seen::Error(_, error) => errors.push(error),
                Seen::End(at) => {
                    last_end = last_end.max(at.saturating_duration_since(stopped));
                    completed += 1;
                    break;
                }
            }
        }
    }
    assert!(errors.is_empty(), "streams failed: {errors:?}");
    assert_eq!(completed, 8);
    let (status, body) = http(
        &nodes[0].api,
        "POST",
        "/v1/chat/completions",
        &chat(4, false),
    );
    assert_eq!(status, 200, "{body}");
    let ((index, _), _) =
        wait_until(Duration::from_secs(20), || equal_states(ns, &nodes)).expect("equal states");
    eprintln!(
        "FAULT worker-sigstop-5s under 8 streams: all 8 completed, none failed (the last \
         {last_end:?} after the SIGSTOP); a new request answered; equal digests at index {index}"
    );
}

#[test]
fn a_place_asked_again_under_its_id_places_once() {
    use tessera_protos::v1;
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "faults-place-twice";
    let port = free_port();
    let node = Node::start(ns, with_model(&root.path().join("a")), port, &[]);
    wait_until(Duration::from_secs(20), || {
        let state = admin(ns, port, None, "state")?;
        (!state["state"]["nodes"].as_object()?.is_empty()).then_some(())
    })
    .expect("the node reports itself");
    let request = v1::PlaceInstanceRequest {
        model_id: MODEL.into(),
        sharding: v1::Sharding::Pipeline as i32,
        min_nodes: 1,
        node_ids: Vec::new(),
        request_id: "asked-again/with *odd* characters".into(),
    };
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let ids: Vec<String> = runtime.block_on(async {
        let client = crate::support::admin_client(ns, port).await;
        let mut ids = Vec::new();
        for _ in 0..3 {
            let placed = client.place(&request).await.expect("placed");
            ids.push(placed.instance.expect("an instance").instance_id);
        }
        client.close().await.expect("close");
        ids
    });
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    let state = admin(ns, port, None, "state").expect("state");
    let instances = state["state"]["instances"]
        .as_object()
        .map_or(0, |i| i.len());
    assert_eq!(instances, 1, "placed once\n{}", node.log());
}
