//! What the end-to-end tests share: the binary under test, the default
//! model, free ports.

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::Duration;

use tessera_actors::admin::client::{AdminClient, ConnectOptions};

/// The `tessera` binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// Runs `tessera ARGS` to the end.
pub fn tessera(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("tessera runs")
}

/// The default model's GGUF file, as `scripts/fetch-model` installed it.
pub fn model() -> String {
    tessera_testkit::default_model_path().display().to_string()
}

/// A TCP port free on loopback now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// An admin client of namespace `ns` that reaches one node on loopback only
/// (no multicast).
pub async fn admin_client(ns: &str, port: u16) -> AdminClient {
    let options = ConnectOptions {
        connect: vec![format!("tcp/127.0.0.1:{port}")],
        timeout: Duration::from_secs(5),
        ..ConnectOptions::new(ns)
    };
    AdminClient::connect(options)
        .await
        .expect("a client session")
}

/// A folder of the Python libraries the scripts in `tests/` use (the
/// official API clients, Playwright), installed by `scripts/python-env`.
pub fn python_lib() -> String {
    project_script("python-env")
}

/// Runs `scripts/NAME` (an installer) and returns what it printed.
pub fn project_script(name: &str) -> String {
    let out = Command::new("bash")
        .arg(format!("{}/scripts/{name}", env!("CARGO_MANIFEST_DIR")))
        .output()
        .unwrap_or_else(|e| panic!("scripts/{name} runs: {e}"));
    assert!(
        out.status.success(),
        "scripts/{name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
