//! `tessera node`: run this machine's node until SIGINT or SIGTERM.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tessera_actors::node::{self, NodeOptions};
use tessera_api::{ApiKeys, ApiOptions};

#[derive(Debug, Args)]
pub struct NodeArgs {
    /// Nodes of different namespaces never see each other.
    #[arg(long, env = "TESSERA_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Zenoh endpoint to listen on (repeatable), e.g. tcp/0.0.0.0:5447.
    /// Default: a free port on every interface.
    #[arg(long)]
    pub listen: Vec<String>,
    /// Zenoh endpoint of another node (repeatable), for networks that
    /// block multicast discovery.
    #[arg(long)]
    pub connect: Vec<String>,
    /// Turn multicast discovery off (use --connect).
    #[arg(long)]
    pub no_multicast: bool,
    /// Where the node keeps its identity, event log and models (default:
    /// $TESSERA_HOME, else ~/.tessera).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Keep the log and take part in elections, but run no models.
    #[arg(long)]
    pub no_worker: bool,
    /// Compute threads of each runner (default: all cores).
    #[arg(long)]
    pub runner_threads: Option<usize>,
    /// Where this node runs its models: auto (a hardware GPU that runs the
    /// model, else the CPU), cpu, gpu, or gpu:N (see `tessera devices`).
    #[arg(long, default_value = "auto")]
    pub device: tessera_engine::gpu::DeviceChoice,
    /// Where this node's slot of 64 ring ports starts (it holds the first
    /// port, its ranks take the next free ones). Default: the first free
    /// slot in 20000-31999 from a place picked by the node id, so that
    /// several nodes on one machine never share ports.
    #[arg(long, env = "TESSERA_RING_PORT_BASE")]
    pub ring_port_base: Option<u16>,
    /// Port of the HTTP API (0: any free port; the JSON line on stdout
    /// says which).
    #[arg(long, env = "TESSERA_API_PORT", default_value_t = 52415)]
    pub api_port: u16,
    /// Address the HTTP API binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub api_host: std::net::IpAddr,
    /// Serve no HTTP API.
    #[arg(long)]
    pub no_api: bool,
    /// Seconds an API connection may take to send its headers, or stay
    /// idle between requests, before it is closed.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub api_idle_timeout: u64,
    /// API connections served at once (one more is closed at once).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub api_max_connections: u64,
    /// Answer 404 for a model with no instance instead of placing one.
    #[arg(long)]
    pub no_auto_place: bool,
    /// Join a secured cluster with a token from `tessera cluster invite`
    /// (once: the certificate is kept in DATA_DIR/cluster).
    #[arg(long, env = "TESSERA_JOIN_TOKEN", hide_env_values = true)]
    pub join: Option<String>,
    /// Origin allowed by CORS (repeatable; default: any).
    #[arg(long)]
    pub cors_origin: Vec<String>,
    /// A key API requests must carry, as `Authorization: Bearer KEY` or
    /// `x-api-key: KEY` (repeatable; TESSERA_API_KEYS takes a comma-separated
    /// list). Keys in DATA_DIR/api_keys (one a line) count too. None: the
    /// API is open to whoever reaches it.
    #[arg(
        long = "api-key",
        env = "TESSERA_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// Place MODEL when the node starts, unless an instance of it exists
    /// (repeatable), e.g. smollm2-135m-instruct-q4_1.
    #[arg(long = "model")]
    pub models: Vec<String>,
    /// A further writable model folder (repeatable); downloads go to the
    /// first folder that already holds part of a model, else to
    /// DATA_DIR/models.
    #[arg(
        long = "models-dir",
        env = "TESSERA_MODELS_DIRS",
        value_delimiter = ':'
    )]
    pub models_dirs: Vec<PathBuf>,
    /// A read-only folder of pre-staged models (repeatable): a model found
    /// there complete is used as it is and never downloaded or deleted.
    #[arg(
        long = "staged-models-dir",
        env = "TESSERA_MODELS_READ_ONLY_DIRS",
        value_delimiter = ':'
    )]
    pub staged_models_dirs: Vec<PathBuf>,
    /// Never reach the hub: use local model files only, and say which are
    /// missing (also set by HF_HUB_OFFLINE=1).
    #[arg(long, env = "HF_HUB_OFFLINE")]
    pub offline: bool,
    /// Requests per model this node lets wait or run at once (then 429).
    #[arg(long, default_value_t = 64)]
    pub queue_limit: usize,
    /// Generations an instance runs at once in one batch (written into
    /// each instance this node places as master, so the cluster agrees).
    #[arg(long, default_value_t = tessera_actors::worker::plan::DEFAULT_MAX_CONCURRENT,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_concurrent: u32,
}

/// The API keys file in the data dir: one key a line, `#` comments.
const API_KEYS_FILE: &str = "api_keys";

/// The keys of `--api-key` / TESSERA_API_KEYS and of DATA_DIR/api_keys.
fn api_keys(given: Vec<String>, data_dir: &std::path::Path) -> anyhow::Result<ApiKeys> {
    let path = data_dir.join(API_KEYS_FILE);
    let mut keys = given;
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|line| !line.is_empty() && !line.starts_with('#'))
                    .map(String::from),
            );
            warn_if_others_can_read(&path);
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            return Err(error)
                .with_context(|| format!("reading the API keys in {}", path.display()))
        }
    }
    Ok(ApiKeys::new(keys))
}

fn warn_if_others_can_read(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                "the API keys file can be read by other users; chmod 600 it"
            );
        }
    }
}

pub fn run(mut args: NodeArgs) -> anyhow::Result<()> {
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(super::support::default_data_dir);
    if let Some(token) = args.join.take() {
        join_with(&token, &data_dir, &mut args)?;
    }
    let keys = api_keys(std::mem::take(&mut args.api_keys), &data_dir)?;
    let open_to_the_network = !args.no_api && keys.is_empty() && !args.api_host.is_loopback();
    let api = (!args.no_api).then(|| api_options(&args, keys, &data_dir));
    let options = NodeOptions {
        namespace: args.namespace,
        listen: args.listen,
        connect: args.connect,
        multicast: !args.no_multicast,
        models: tessera_actors::worker::downloads::ModelStore::new(
            data_dir.join("models"),
            args.models_dirs,
            args.staged_models_dirs,
        ),
        offline: args.offline,
        data_dir,
        worker: !args.no_worker,
        ring_port_base: args.ring_port_base,
        max_concurrent: args.max_concurrent,
        runner_device: args.device,
        runner_threads: args
            .runner_threads
            .filter(|t| *t > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_node(options, api, open_to_the_network))
}

/// The HTTP API's options from the node's flags.
fn api_options(args: &NodeArgs, keys: ApiKeys, data_dir: &std::path::Path) -> ApiOptions {
    let mut api = ApiOptions::new(std::net::SocketAddr::new(args.api_host, args.api_port));
    api.auto_place = !args.no_auto_place;
    api.cors_origins = args.cors_origin.clone();
    api.queue_limit = args.queue_limit.max(1);
    api.preload = args.models.clone();
    api.idle_timeout = std::time::Duration::from_secs(args.api_idle_timeout);
    api.max_connections = usize::try_from(args.api_max_connections).unwrap_or(usize::MAX);
    api.api_keys = keys;
    api.cluster_dir = Some(tessera_trust::ClusterDir::of(data_dir).path().to_path_buf());
    api
}

/// Runs the node (and its API) until a signal, or until it cannot go on.
async fn run_node(
    options: NodeOptions,
    api: Option<ApiOptions>,
    open_to_the_network: bool,
) -> anyhow::Result<()> {
    let running = node::start(options.clone())
        .await
        .with_context(|| format!("starting the node in {}", options.data_dir.display()))?;
    let api_server = match &api {
        Some(api) => match serve_api(api.clone(), &running).await {
            Ok(server) => Some(server),
            Err(error) => {
                running.shutdown().await;
                return Err(error);
            }
        },
        None => None,
    };
    let api_address = api_server.as_ref().map(|server| server.address);
    // One line for scripts and tests: who this node is.
    println!(
        "{}",
        serde_json::json!({
            "node_id": running.node_id,
            "api": api_address.map(|a| a.to_string()),
            "namespace": options.namespace,
            "data_dir": options.data_dir,
        })
    );
    eprintln!(
        "node {} running in namespace {:?} (data in {}); Ctrl-C to stop",
        running.node_id,
        options.namespace,
        options.data_dir.display()
    );
    if let Some(address) = api_address {
        eprintln!("HTTP API on http://{address} (OpenAI-compatible: /v1/chat/completions)");
        eprintln!("dashboard on http://{address}/");
    }
    if open_to_the_network {
        tracing::warn!(
            "the HTTP API has no key and listens beyond this machine: anyone who \
             reaches it can use the models and change the cluster; set --api-key \
             (or bind --api-host 127.0.0.1)"
        );
    }
    let (api_server, fatal) = serve_until_stopped(&running, api, api_server).await?;
    eprintln!("stopping: flushing the event log");
    if let Some(server) = api_server {
        // Answers under way get a moment to finish; new requests are refused.
        server.shutdown(API_DRAIN).await;
    }
    running.shutdown().await;
    match fatal {
        Some(reason) => anyhow::bail!("the node stopped: {reason}"),
        None => Ok(()),
    }
}

/// Waits for a signal, or for the node to be unable to go on; meanwhile
/// serves the API again (after the supervisor's backoff) if it fails.
/// Returns the API as it is then, and why the node cannot go on, if so.
async fn serve_until_stopped(
    running: &node::RunningNode,
    options: Option<ApiOptions>,
    mut server: Option<tessera_api::ApiServer>,
) -> anyhow::Result<(Option<tessera_api::ApiServer>, Option<String>)> {
    let mut health = running.health();
    let signal = wait_for_signal();
    tokio::pin!(signal);
    let mut restarting = None;
    loop {
        let api_failed = async {
            match server.as_mut() {
                Some(server) => server.failed().await,
                None => std::future::pending().await,
            }
        };
        let restarted = async {
            match restarting.as_mut() {
                Some(restart) => std::pin::Pin::as_mut(restart).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            signal = &mut signal => {
                signal?;
                return Ok((server, None));
            }
            fatal = health.wait_for(|h| h.fatal.is_some()) => {
                let fatal = fatal.ok().and_then(|h| h.fatal.clone());
                return Ok((server, fatal));
            }
            why = api_failed => {
                server = None;
                if let Some(options) = options.clone() {
                    restarting = Some(Box::pin(restart_api(running, options, why)));
                }
            }
            again = restarted => {
                restarting = None;
                server = again;
            }
        }
    }
}

/// Serves the API again after each failure's backoff, until it serves or
/// is given up (none: the node's health then says why it cannot go on).
async fn restart_api(
    running: &node::RunningNode,
    options: ApiOptions,
    mut why: String,
) -> Option<tessera_api::ApiServer> {
    loop {
        let wait = running.api_failed(why).await?;
        tokio::time::sleep(wait).await;
        match serve_api(options.clone(), running).await {
            Ok(server) => {
                running.api_restarted();
                return Some(server);
            }
            Err(error) => why = format!("{error:#}"),
        }
    }
}

/// How long answers under way may take to finish when the node stops.
const API_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the HTTP API on a started node.
async fn serve_api(
    api: ApiOptions,
    running: &node::RunningNode,
) -> anyhow::Result<tessera_api::ApiServer> {
    let listen = api.listen;
    tessera_api::serve(
        api,
        running.node_id.clone(),
        running.bus().clone(),
        running.replica().clone(),
        running.leadership().clone(),
    )
    .await
    .with_context(|| format!("serving the HTTP API on {listen}"))
}

/// `--join TOKEN`: obtains this node's certificate (unless it has one),
/// and reaches the inviting node at the token's endpoints.
fn join_with(text: &str, data_dir: &std::path::Path, args: &mut NodeArgs) -> anyhow::Result<()> {
    let token = tessera_trust::JoinToken::decode(text)?;
    if token.cluster != args.namespace {
        anyhow::bail!(
            "the token is for cluster {:?}, this node runs in namespace {:?}: add --namespace {}",
            token.cluster,
            args.namespace,
            token.cluster
        );
    }
    if token.role != tessera_trust::Role::Node {
        anyhow::bail!("this is an admin's token: use it with `tessera cluster join TOKEN`");
    }
    if tessera_trust::ClusterDir::of(data_dir)
        .credentials()
        .is_none()
    {
        let node_id = tessera_actors::node::node_identity(data_dir)?;
        super::support::client_runtime()?
            .block_on(super::cluster::join(&token, data_dir, &node_id))?;
        eprintln!(
            "joined cluster {:?}: certificate kept in {}",
            token.cluster,
            data_dir.join("cluster").display()
        );
    }
    for endpoint in token.connect {
        if !args.connect.contains(&endpoint) {
            args.connect.push(endpoint);
        }
    }
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result.context("SIGINT handler")?,
        _ = terminate.recv() => {}
    }
    Ok(())
}
