//! `tessera runner`: one rank of one instance, started by its node's worker
//! as a child process (a crash or out-of-memory here never takes the node
//! down, and memory returns to the OS when it exits). The Runner actor
//! (`tessera_actors::runner`) does the work over a zenoh client session to
//! its node; this is its command line. It exits when its stdin closes, so a
//! node killed outright leaves no runner behind.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{anyhow, Context};
use clap::Args;
use tessera_actors::cluster::placement::shard_from_proto;
use tessera_actors::runner::engine::{EngineBackend, EngineSetup};
use tessera_actors::runner::zenoh_link::ZenohLink;
use tessera_actors::runner::{RunnerArgs as ActorArgs, RunnerExit, RunnerOutput};
use tessera_engine::dist::ring_security::RingSecurity;
use tessera_protos::v1;

use super::model_args::resolve_model;

#[derive(Debug, Args)]
pub struct RunnerArgs {
    #[arg(long)]
    pub runner_id: String,
    /// The node that started this runner.
    #[arg(long)]
    pub node_id: String,
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// The node's zenoh endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub connect: Vec<String>,
    /// The instance, as proto3 JSON.
    #[arg(long)]
    pub instance_json: String,
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Where the model runs: auto, cpu, gpu or gpu:N.
    #[arg(long, default_value = "cpu")]
    pub device: tessera_engine::gpu::DeviceChoice,
    /// The model's files, as the node's download found them (a GGUF file
    /// or a safetensors folder); without it, the model id is looked up
    /// under `$TESSERA_HOME/models`.
    #[arg(long)]
    pub model_path: Option<PathBuf>,
}

pub fn run(args: RunnerArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let exit = runtime.block_on(serve(&args));
    // Nothing is waited for: a follower's engine thread may still be in
    // its ring, and the process ends it.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match exit? {
        RunnerExit::Shutdown => Ok(()),
        // No log line: stderr went with the node, and a failed write panics.
        RunnerExit::NodeGone => std::process::exit(2),
        RunnerExit::Failed(reason) => Err(anyhow!(reason)),
    }
}

/// Runs the Runner actor over a session to the node until it ends. A
/// runner that cannot even start says why as its failure.
async fn serve(args: &RunnerArgs) -> anyhow::Result<RunnerExit> {
    // The node gave this runner its data dir (TESSERA_HOME): in a secured
    // cluster, the runner links to its node with the node's credentials.
    let credentials =
        tessera_trust::ClusterDir::of(&super::support::default_data_dir()).credentials();
    let link = ZenohLink::open(
        &args.namespace,
        &args.runner_id,
        &args.connect,
        credentials.as_ref(),
    )
    .await?;
    let (setup, world) = match engine_setup(args) {
        Ok(setup) => setup,
        Err(error) => {
            let failed = v1::RunnerStatus {
                state: Some(v1::runner_status::State::Failed(v1::RunnerFailed {
                    reason: format!("{error:#}"),
                    diagnostics: String::new(),
                })),
            };
            link.status(&failed).await;
            link.close().await;
            return Err(error);
        }
    };
    let (exit, ended) = tokio::sync::oneshot::channel();
    let runner = tessera_actors::runner::run(ActorArgs {
        rank: setup.rank,
        world,
        output: link.clone(),
        backend: move || EngineBackend::new(setup),
        exit,
    })
    .await
    .map_err(|e| anyhow!("starting the runner: {e}"))?;
    let _orders = link
        .subscribe_orders(&args.runner_id, runner.actor.clone())
        .await?;
    // Subscribed: orders sent from now on arrive.
    runner.listening();
    runner.end_when_stdin_closes();
    let exit = ended.await.unwrap_or(RunnerExit::Shutdown);
    let _ = runner.handle.await;
    link.close().await;
    Ok(exit)
}

/// The ring's security: the secret the node put in the environment (none:
/// an open ring, as an instance of an older master has).
pub(super) fn ring_security(sealed: bool) -> anyhow::Result<RingSecurity> {
    let hex = std::env::var(tessera_actors::worker::RING_SECRET_ENV).unwrap_or_default();
    if hex.is_empty() {
        return Ok(RingSecurity::open());
    }
    let secret: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
        })
        .collect::<Option<_>>()
        .context("the ring secret is not hex")?;
    RingSecurity::with_secret(&secret, sealed).map_err(anyhow::Error::msg)
}

/// This rank's engine, from the instance the worker passed; and the
/// instance's number of ranks.
fn engine_setup(args: &RunnerArgs) -> anyhow::Result<(EngineSetup, usize)> {
    let instance: v1::Instance =
        serde_json::from_str(&args.instance_json).context("--instance-json")?;
    let me = instance
        .ranks
        .iter()
        .find(|r| r.runner_id == args.runner_id)
        .with_context(|| format!("runner {} is not in the instance", args.runner_id))?;
    let spec = me
        .shard
        .as_ref()
        .and_then(shard_from_proto)
        .context("the rank has no shard")?;
    let card = instance
        .model
        .as_ref()
        .context("the instance has no model")?;
    let model_id = card.model_id.clone();
    let embedding = tessera_actors::catalogue::task::is_embedding(card);
    let path = match &args.model_path {
        Some(path) => path.clone(),
        None => resolve_model(&model_id)?,
    };
    let world = instance.ranks.len();
    // A single rank joins no ring.
    let ring = if world > 1 {
        instance
            .ranks
            .iter()
            .map(|r| r.ring_address.parse::<SocketAddr>())
            .collect::<Result<Vec<_>, _>>()
            .context("ring addresses")?
    } else {
        Vec::new()
    };
    let setup = EngineSetup {
        path,
        spec,
        rank: me.rank as usize,
        ring,
        ring_id: instance.instance_id.clone(),
        ring_security: ring_security(instance.ring_sealed)?,
        threads: args.threads,
        device: args.device,
        max_concurrent: tessera_actors::worker::plan::max_concurrent(&instance),
        embedding,
    };
    Ok((setup, world))
}
