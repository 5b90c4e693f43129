//! `tessera admin`: typed requests to the cluster over zenoh queries (the
//! admin service of protos/proto/tessera/v1/admin.proto).

use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tessera_actors::bus::Bus;
use tessera_actors::keys::{AdminMethod, Keys};
use tessera_actors::node::zenoh_config;
use tessera_protos::v1::{GetStateReply, GetStateRequest, ListNodesReply, ListNodesRequest};

#[derive(Debug, Args)]
pub struct AdminArgs {
    #[arg(long, env = "TESSERA_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// A node's zenoh endpoint (repeatable); without one, nodes are found
    /// by multicast.
    #[arg(long)]
    pub connect: Vec<String>,
    /// Ask this node only (default: the most up-to-date answer).
    #[arg(long)]
    pub node: Option<String>,
    /// Seconds to wait for answers.
    #[arg(long, default_value_t = 3.0)]
    pub timeout: f64,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    #[command(subcommand)]
    pub what: AdminCommand,
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// The cluster state (with its last index and digest).
    State,
    /// The nodes, and which one is master.
    Nodes,
}

pub fn run(args: AdminArgs) -> anyhow::Result<()> {
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .context("--timeout must be a positive number of seconds")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let keys = Keys::new(&args.namespace)?;
        let config = zenoh_config("client", &[], &args.connect, args.connect.is_empty())?;
        let session = zenoh::open(config)
            .await
            .map_err(|e| anyhow::anyhow!("opening a zenoh session: {e}"))?;
        let bus = Bus::new(session, keys);
        let selector = |method: AdminMethod| match &args.node {
            Some(node) => format!("{}?node={node}", bus.keys.admin(method)),
            None => bus.keys.admin(method),
        };
        let unreachable = || {
            format!(
                "no node of namespace {:?} answered within {timeout:?}{}",
                args.namespace,
                if args.connect.is_empty() {
                    " (is a node running? pass --connect tcp/HOST:PORT where multicast is blocked)"
                } else {
                    ""
                }
            )
        };
        match args.what {
            AdminCommand::State => {
                let replies: Vec<GetStateReply> = bus
                    .query_all(&selector(AdminMethod::State), &GetStateRequest {}, timeout)
                    .await?;
                // The most up-to-date node's view.
                let Some(reply) = replies
                    .into_iter()
                    .max_by_key(|r| r.state.as_ref().map_or(0, |s| s.last_index))
                else {
                    bail!(unreachable());
                };
                let state = reply.state.unwrap_or_default();
                if args.json {
                    let json = serde_json::json!({
                        "last_index": state.last_index,
                        "digest": reply.digest,
                        "state": serde_json::to_value(&state)?,
                    });
                    println!("{}", serde_json::to_string_pretty(&json)?);
                } else {
                    println!("last index {}  digest {}", state.last_index, reply.digest);
                    println!(
                        "{} nodes, {} instances, {} runners, {} tasks",
                        state.nodes.len(),
                        state.instances.len(),
                        state.runners.len(),
                        state.tasks.len()
                    );
                }
            }
            AdminCommand::Nodes => {
                let replies: Vec<ListNodesReply> = bus
                    .query_all(&selector(AdminMethod::Nodes), &ListNodesRequest {}, timeout)
                    .await?;
                // Prefer an answer that knows the master and the most nodes.
                let Some(reply) = replies
                    .into_iter()
                    .max_by_key(|r| (r.error.is_none(), r.nodes.len()))
                else {
                    bail!(unreachable());
                };
                if let Some(error) = &reply.error {
                    bail!("{} ({})", error.message, error.kind);
                }
                if args.json {
                    let nodes: Vec<serde_json::Value> = reply
                        .nodes
                        .iter()
                        .map(|n| {
                            serde_json::json!({
                                "node_id": n.node_id,
                                "is_master": n.is_master,
                                "info": n.info,
                            })
                        })
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&nodes)?);
                } else {
                    println!(
                        "{:<38} {:<7} {:<20} {:>6} {:>12}",
                        "NODE", "ROLE", "HOST", "CORES", "FREE MEM"
                    );
                    for n in &reply.nodes {
                        let info = n.info.clone().unwrap_or_default();
                        println!(
                            "{:<38} {:<7} {:<20} {:>6} {:>9.1} GB",
                            n.node_id,
                            if n.is_master { "master" } else { "" },
                            info.hostname,
                            info.cpu_cores,
                            info.memory_available_bytes as f64 / 1e9
                        );
                    }
                }
            }
        }
        Ok(())
    })
}
