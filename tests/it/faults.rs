//! Fault injection on real `tessera node` processes on loopback: the master
//! killed and restarted again and again, a frozen master (SIGSTOP, then
//! SIGCONT), a forged election message. Each scenario prints its figures
//! (`FAULT` lines) and ends with one master and equal logs everywhere.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cluster::{indices_contiguous, master_seen, replay, state_of, wait_until, Node};
use crate::support::free_port;

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
        let survivors: Vec<usize> = (0..3).filter(|i| *i != dead).collect();
        let (successor, _) = wait_until(Duration::from_secs(10), || {
            let seen = survivors
                .iter()
                .map(|&i| master_seen(ns, nodes[i].port, Some(&nodes[i].id)))
                .collect::<Option<Vec<_>>>()?;
            let first = seen.first()?.0.clone();
            (first != master && seen.iter().all(|(m, _)| *m == first)).then_some(first)
        })
        .expect("a new master among the survivors");
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
        let ((index, _), agree) = wait_until(Duration::from_secs(20), || equal_states(ns, &nodes))
            .expect("equal states after the restart");
        let log = nodes[dead].log();
        assert!(
            !log.contains("elected master"),
            "round {round}: the restarted node led\n{log}"
        );
        eprintln!(
            "FAULT master-restart round {round}: new master after {failover:?}; \
             restarted node follows after {rejoin:?}, equal digests at index {index} after {:?}",
            restarted.elapsed().saturating_sub(rejoin) + agree
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
    let others: Vec<usize> = (0..3).filter(|i| *i != frozen).collect();
    let (successor, failover) = wait_until(Duration::from_secs(10), || {
        let seen = others
            .iter()
            .map(|&i| master_seen(ns, nodes[i].port, Some(&nodes[i].id)))
            .collect::<Option<Vec<_>>>()?;
        let first = seen.first()?.0.clone();
        (first != master && seen.iter().all(|(m, _)| *m == first)).then_some(first)
    })
    .expect("a new master while the old one is frozen");
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
    wait_until(Duration::from_secs(10), || {
        let (m, _) = master_seen(ns, nodes[others[0]].port, Some(&nodes[others[0]].id))?;
        (m != master).then_some(())
    })
    .expect("a new master");
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
    assert!(
        log.contains("dropped events the master does not hold"),
        "the fork was repaired by dropping its tail\n{log}"
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
        let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
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
    eprintln!(
        "FAULT http: 9th connection over a bound of 8 closed at once; 8 idle or slow \
         connections closed after {closed_after:?} (timeout 1 s); served again after"
    );
}
