//! `tessera bench cluster`: command-to-applied-event latency of a running
//! cluster. A client publishes commands on `commands` one at a time
//! (creating an instance on a node that runs no models, then deleting it)
//! and times each until the master's indexed event for it arrives on
//! `events/global`: command in, indexed, persisted, published, applied.
//! The instances name a `--no-worker` node so that no runner starts and the
//! figure is the log's alone.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use tessera_actors::admin::client::{AdminClient, ConnectOptions};
use tessera_protos::v1::{self, command, event, Command, IndexedEvent};

use super::stats;

#[derive(Debug, Args)]
pub struct ClusterBenchArgs {
    #[arg(long, env = "TESSERA_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// A node's zenoh endpoint (repeatable).
    #[arg(long)]
    pub connect: Vec<String>,
    /// Commands timed (half places, half deletes).
    #[arg(long, default_value_t = 1000)]
    pub commands: usize,
    /// The model the instances name.
    #[arg(long, default_value = "smollm2-135m-instruct-q4_1")]
    pub model: String,
    /// A secured cluster's credentials for this machine (default:
    /// $TESSERA_HOME/cluster, when it holds them).
    #[arg(long, env = "TESSERA_CLUSTER_DIR")]
    pub cluster_dir: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    commands: usize,
    median_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

pub fn run(args: ClusterBenchArgs) -> anyhow::Result<()> {
    if args.commands < 2 {
        bail!("--commands must be at least 2");
    }
    let runtime = super::support::client_runtime()?;
    runtime.block_on(async move {
        let client = AdminClient::connect(ConnectOptions {
            connect: args.connect.clone(),
            timeout: Duration::from_secs(5),
            credentials: super::admin::credentials(args.cluster_dir.as_deref())?,
            ..ConnectOptions::new(&args.namespace)
        })
        .await?;
        let bus = client.bus();
        let events = bus
            .session
            .declare_subscriber(bus.keys.global_events())
            .await
            .map_err(|e| anyhow::anyhow!("subscribing: {e}"))?;
        // A node that runs no models, to name in the instances.
        let nodes = client.nodes().await?;
        let Some(host) = nodes
            .nodes
            .iter()
            .find(|n| n.info.as_ref().is_some_and(|i| i.no_worker))
            .map(|n| n.node_id.clone())
        else {
            bail!("no node started with --no-worker: the bench creates instances on one so that no runner starts");
        };
        let card = tessera_actors::catalogue::card(&args.model)
            .with_context(|| format!("unknown model {:?}", args.model))?;
        let mut times = Vec::with_capacity(args.commands);
        let mut placed: Vec<String> = Vec::new();
        for i in 0..args.commands {
            let command_id = format!("bench-{}-{i}", std::process::id());
            let place = i % 2 == 0;
            let (kind, expect_instance) = if place {
                create_on(&host, &card, &command_id)
            } else {
                let Some(instance) = placed.pop() else {
                    bail!("nothing placed to delete");
                };
                let delete = v1::DeleteInstance {
                    instance_id: instance.clone(),
                };
                (command::Kind::DeleteInstance(delete), instance)
            };
            let command = Command {
                command_id: command_id.clone(),
                origin_node_id: bus.holder().unwrap_or("bench").to_string(),
                kind: Some(kind),
            };
            let started = Instant::now();
            bus.put(&bus.keys.commands(), &command).await?;
            wait_for_event(bus, &events, i, place, &expect_instance).await?;
            times.push(started.elapsed().as_secs_f64() * 1e3);
            if place {
                placed.push(expect_instance);
            }
        }
        let times = stats::sorted(times);
        let at = |q: f64| stats::round_to(stats::percentile(&times, q), 3);
        let report = Report {
            bench: "cluster",
            commands: args.commands,
            median_ms: at(0.5),
            p90_ms: at(0.9),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(())
    })
}

/// A command that creates an instance of `card` with one rank on `host`,
/// and the instance's id.
fn create_on(host: &str, card: &v1::ModelCard, command_id: &str) -> (command::Kind, String) {
    let instance_id = format!("instance-{command_id}");
    let kind = command::Kind::CreateInstance(v1::CreateInstance {
        instance: Some(v1::Instance {
            max_concurrent: 0,
            ring_secret: Vec::new(),
            ring_sealed: false,
            draft: None,
            instance_id: instance_id.clone(),
            model: Some(card.clone()),
            sharding: v1::Sharding::Pipeline as i32,
            ranks: vec![v1::InstanceRank {
                rank: 0,
                node_id: host.to_string(),
                runner_id: format!("{instance_id}-rank0"),
                shard: None,
                ring_address: String::new(),
            }],
        }),
    });
    (kind, instance_id)
}

/// Waits for the indexed event of command `i`: the creation (`place`) or
/// the deletion of `expect_instance`.
async fn wait_for_event(
    bus: &tessera_actors::bus::Bus,
    events: &zenoh::pubsub::Subscriber<zenoh::handlers::FifoChannelHandler<zenoh::sample::Sample>>,
    i: usize,
    place: bool,
    expect_instance: &str,
) -> anyhow::Result<()> {
    loop {
        let sample = tokio::time::timeout(Duration::from_secs(5), events.recv_async())
            .await
            .map_err(|_| {
                anyhow::anyhow!("no indexed event for command {i} within 5 s (is a master up?)")
            })?
            .map_err(|e| anyhow::anyhow!("subscriber closed: {e}"))?;
        let Some(indexed) =
            bus.decode::<IndexedEvent>("events/global", &sample.payload().to_bytes())
        else {
            continue;
        };
        let matches = match indexed.event.and_then(|e| e.kind) {
            Some(event::Kind::InstanceCreated(created)) => {
                place
                    && created
                        .instance
                        .is_some_and(|inst| inst.instance_id == expect_instance)
            }
            Some(event::Kind::InstanceDeleted(deleted)) => {
                !place && deleted.instance_id == expect_instance
            }
            _ => false,
        };
        if matches {
            return Ok(());
        }
    }
}
