//! `tessera admin`: typed requests to the cluster over zenoh queries (the
//! admin service of protos/proto/tessera/v1/admin.proto). Reads are answered
//! by any node; place and delete by the master.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tessera_actors::bus::Bus;
use tessera_actors::keys::{AdminMethod, Keys};
use tessera_actors::node::zenoh_config;
use tessera_protos::v1::{self, GetStateReply, GetStateRequest, ListNodesReply, ListNodesRequest};

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
    /// The model instances placed.
    Instances,
    /// Every feasible placement of MODEL for 1..N nodes, with each node's
    /// memory, and why the others are not.
    Previews { model: String },
    /// Place MODEL on the cluster.
    Place {
        model: String,
        #[arg(long, value_enum, default_value = "pipeline")]
        sharding: ShardingArg,
        /// Use at least this many nodes.
        #[arg(long, default_value_t = 1)]
        min_nodes: u32,
    },
    /// Delete an instance.
    Delete { instance: String },
    /// Generate text on an instance (or any ready instance of a model),
    /// streaming the tokens.
    Generate {
        /// An instance id, or a model id.
        target: String,
        prompt: String,
        /// Feed the prompt as raw text (default: one user message, templated).
        #[arg(long)]
        raw: bool,
        #[arg(long, default_value_t = 128)]
        max_tokens: u32,
        /// Seconds to wait for the first chunk and between chunks.
        #[arg(long, default_value_t = 60.0)]
        chunk_timeout: f64,
    },
    /// The model catalogue (built-in and custom cards) and which nodes
    /// hold each model's files.
    Models,
    /// Build a model card from a hub repository (OWNER/NAME) and add it
    /// to the cluster's catalogue.
    AddModel {
        repo: String,
        /// Branch, tag or commit (default: main).
        #[arg(long, default_value = "")]
        revision: String,
    },
    /// Every node's downloads: progress, completion, failures.
    Downloads,
    /// Start, cancel or delete a model's download on nodes.
    Download {
        model: String,
        /// The node (default: every node that runs models).
        #[arg(long)]
        on: Option<String>,
        #[arg(long, value_enum, default_value = "start")]
        action: DownloadActionArg,
    },
    /// The indexed events, one JSON object a line.
    Events {
        #[arg(long, default_value_t = 1)]
        from: u64,
        /// Keep printing new events as they come.
        #[arg(long)]
        follow: bool,
    },
}

/// A download's state in one line.
fn download_text(p: &v1::DownloadProgress) -> String {
    use v1::download_progress::State as Ds;
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    match &p.state {
        Some(Ds::Pending(_)) => "pending".into(),
        Some(Ds::Ongoing(o)) => format!(
            "{} of {} ({:.0}%), {:.1} MB/s, ETA {}s",
            gb(o.downloaded_bytes),
            gb(o.total_bytes),
            100.0 * o.downloaded_bytes as f64 / o.total_bytes.max(1) as f64,
            o.bytes_per_second as f64 / 1e6,
            o.eta_ms / 1000
        ),
        Some(Ds::Completed(c)) => format!(
            "complete, {}{} in {}",
            gb(c.total_bytes),
            if c.read_only { " (read-only)" } else { "" },
            c.path
        ),
        Some(Ds::Failed(f)) => format!("failed: {}", f.reason),
        Some(Ds::Cancelled(_)) => "cancelled".into(),
        Some(Ds::Deleted(_)) => "deleted".into(),
        None => "?".into(),
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DownloadActionArg {
    Start,
    Cancel,
    Delete,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ShardingArg {
    Pipeline,
    Tensor,
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
            AdminCommand::Instances => {
                let reply: v1::ListInstancesReply = bus
                    .query(
                        &selector(AdminMethod::Instances),
                        &v1::ListInstancesRequest {},
                        timeout,
                    )
                    .await
                    .map_err(|_| anyhow::anyhow!(unreachable()))?;
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&reply.instances)?);
                } else {
                    println!("{:<44} {:<10} RANKS (node: shard)", "INSTANCE", "SHARDING");
                    for instance in &reply.instances {
                        let ranks: Vec<String> = instance
                            .ranks
                            .iter()
                            .map(|r| {
                                format!("{}: {}", short(&r.node_id), shard_text(r.shard.as_ref()))
                            })
                            .collect();
                        println!(
                            "{:<44} {:<10} {}",
                            instance.instance_id,
                            sharding_name(instance.sharding),
                            ranks.join(", ")
                        );
                    }
                }
            }
            AdminCommand::Previews { model } => {
                let request = v1::PlacementPreviewsRequest {
                    model_id: model,
                    node_ids: Vec::new(),
                };
                let reply: v1::PlacementPreviewsReply = bus
                    .query(&selector(AdminMethod::Previews), &request, timeout)
                    .await
                    .map_err(|_| anyhow::anyhow!(unreachable()))?;
                if let Some(error) = &reply.error {
                    bail!("{} ({})", error.message, error.kind);
                }
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&reply.previews)?);
                } else {
                    for p in &reply.previews {
                        if p.instance.is_some() {
                            let memory: Vec<String> = p
                                .memory_bytes_by_node
                                .iter()
                                .map(|(node, bytes)| {
                                    format!("{}: {:.0} MB", short(node), *bytes as f64 / 1e6)
                                })
                                .collect();
                            println!(
                                "{:<9} {} node(s): fits ({})",
                                sharding_name(p.sharding),
                                p.node_count,
                                memory.join(", ")
                            );
                        } else {
                            println!(
                                "{:<9} {} node(s): {}",
                                sharding_name(p.sharding),
                                p.node_count,
                                p.error
                            );
                        }
                    }
                }
            }
            AdminCommand::Place {
                model,
                sharding,
                min_nodes,
            } => {
                let request = v1::PlaceInstanceRequest {
                    model_id: model,
                    sharding: match sharding {
                        ShardingArg::Pipeline => v1::Sharding::Pipeline,
                        ShardingArg::Tensor => v1::Sharding::Tensor,
                    } as i32,
                    min_nodes,
                    node_ids: Vec::new(),
                    request_id: uuid::Uuid::now_v7().to_string(),
                };
                let reply: v1::PlaceInstanceReply = bus
                    .query(&bus.keys.admin(AdminMethod::Place), &request, timeout)
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!("no master answered within {timeout:?}: is the cluster up?")
                    })?;
                if let Some(error) = &reply.error {
                    bail!("{} ({})", error.message, error.kind);
                }
                let instance = reply.instance.unwrap_or_default();
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&instance)?);
                } else {
                    println!("placed {}", instance.instance_id);
                    for r in &instance.ranks {
                        println!(
                            "  rank {} on {}: {}",
                            r.rank,
                            r.node_id,
                            shard_text(r.shard.as_ref())
                        );
                    }
                }
            }
            AdminCommand::Delete { instance } => {
                let request = v1::DeleteInstanceRequest {
                    instance_id: instance.clone(),
                };
                let reply: v1::DeleteInstanceReply = bus
                    .query(&bus.keys.admin(AdminMethod::Delete), &request, timeout)
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!("no master answered within {timeout:?}: is the cluster up?")
                    })?;
                if let Some(error) = &reply.error {
                    bail!("{} ({})", error.message, error.kind);
                }
                println!("deleted {instance}");
            }
            AdminCommand::Generate {
                target,
                prompt,
                raw,
                max_tokens,
                chunk_timeout,
            } => {
                let chunk_timeout = Duration::try_from_secs_f64(chunk_timeout)
                    .ok()
                    .filter(|t| !t.is_zero())
                    .context("--chunk-timeout must be a positive number of seconds")?;
                let instances: v1::ListInstancesReply = bus
                    .query(
                        &bus.keys.admin(AdminMethod::Instances),
                        &v1::ListInstancesRequest {},
                        timeout,
                    )
                    .await
                    .map_err(|_| anyhow::anyhow!(unreachable()))?;
                let (instance_id, model_id) =
                    match instances.instances.iter().find(|i| i.instance_id == target) {
                        Some(i) => (
                            i.instance_id.clone(),
                            i.model
                                .as_ref()
                                .map(|m| m.model_id.clone())
                                .unwrap_or_default(),
                        ),
                        None => (String::new(), target.clone()),
                    };
                let params = v1::TextGenerationParams {
                    model_id,
                    messages: if raw {
                        Vec::new()
                    } else {
                        vec![v1::ChatMessage {
                            role: "user".into(),
                            content: prompt.clone(),
                            ..Default::default()
                        }]
                    },
                    raw_prompt: raw.then(|| prompt.clone()),
                    sampling: Some(v1::SamplingParams {
                        max_tokens: Some(max_tokens),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let command_id = uuid::Uuid::now_v7().to_string();
                let chunks = bus
                    .session
                    .declare_subscriber(bus.keys.chunks(&command_id)?)
                    .await
                    .map_err(|e| anyhow::anyhow!("subscribing to chunks: {e}"))?;
                let command = v1::Command {
                    command_id: command_id.clone(),
                    origin_node_id: "admin".into(),
                    kind: Some(v1::command::Kind::TextGeneration(v1::TextGeneration {
                        instance_id,
                        params: Some(params),
                    })),
                };
                bus.put(&bus.keys.commands(), &command).await?;
                let mut text = String::new();
                let mut out = std::io::stdout();
                loop {
                    let sample = tokio::time::timeout(chunk_timeout, chunks.recv_async())
                        .await
                        .map_err(|_| anyhow::anyhow!("no answer within {chunk_timeout:?}"))?
                        .map_err(|e| anyhow::anyhow!("chunk subscriber closed: {e}"))?;
                    let Some(chunk) =
                        bus.decode::<v1::GenerationChunk>("chunks", &sample.payload().to_bytes())
                    else {
                        continue;
                    };
                    match chunk.kind {
                        Some(v1::generation_chunk::Kind::Token(token)) => {
                            text.push_str(&token.text);
                            if !args.json {
                                use std::io::Write;
                                let _ = out.write_all(token.text.as_bytes());
                                let _ = out.flush();
                            }
                        }
                        Some(v1::generation_chunk::Kind::Finish(finish)) => {
                            if args.json {
                                let json = serde_json::json!({
                                    "text": text,
                                    "finish": serde_json::to_value(finish)?,
                                });
                                println!("{}", serde_json::to_string_pretty(&json)?);
                            } else {
                                println!();
                            }
                            break;
                        }
                        Some(v1::generation_chunk::Kind::Error(error)) => {
                            if !args.json {
                                println!();
                            }
                            bail!("{} ({})", error.message, error.kind);
                        }
                        _ => {}
                    }
                }
            }
            AdminCommand::Models => {
                let reply: v1::ListModelsReply = bus
                    .query(
                        &selector(AdminMethod::Models),
                        &v1::ListModelsRequest {},
                        timeout,
                    )
                    .await
                    .map_err(|_| anyhow::anyhow!(unreachable()))?;
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&reply.models)?);
                } else {
                    println!(
                        "{:<44} {:>10} {:>7} {:>6}  downloaded on",
                        "model", "size", "layers", "format"
                    );
                    for m in &reply.models {
                        let card = m.card.clone().unwrap_or_default();
                        let format = match card.source.as_ref().map(|s| s.format()) {
                            Some(v1::WeightFormat::Gguf) => "gguf",
                            Some(v1::WeightFormat::Safetensors) => "st",
                            _ => "?",
                        };
                        println!(
                            "{:<44} {:>10} {:>7} {:>6}  {}",
                            card.model_id,
                            format!("{:.2} GB", card.storage_size_bytes as f64 / 1e9),
                            card.n_layers,
                            format,
                            where_held(m)
                        );
                    }
                }
            }
            AdminCommand::AddModel { repo, revision } => {
                let request = v1::AddModelRequest {
                    hub_repo: repo,
                    revision,
                };
                // The master reads the hub: allow for a slow listing.
                let reply: v1::AddModelReply = bus
                    .query(
                        &bus.keys.admin(AdminMethod::AddModel),
                        &request,
                        timeout * 10,
                    )
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "no master answered within {:?}: is the cluster up?",
                            timeout * 10
                        )
                    })?;
                if let Some(error) = &reply.error {
                    bail!("{} ({})", error.message, error.kind);
                }
                let card = reply.card.unwrap_or_default();
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&card)?);
                } else {
                    println!(
                        "added {} ({} layers, {:.2} GB, {})",
                        card.model_id,
                        card.n_layers,
                        card.storage_size_bytes as f64 / 1e9,
                        card.quantization
                    );
                }
            }
            AdminCommand::Downloads => {
                let reply: v1::ListDownloadsReply = bus
                    .query(
                        &selector(AdminMethod::Downloads),
                        &v1::ListDownloadsRequest::default(),
                        timeout,
                    )
                    .await
                    .map_err(|_| anyhow::anyhow!(unreachable()))?;
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&reply.downloads)?);
                } else {
                    for d in &reply.downloads {
                        let p = d.progress.clone().unwrap_or_default();
                        println!("{}  {}  {}", d.node_id, p.model_id, download_text(&p));
                    }
                }
            }
            AdminCommand::Download { model, on, action } => {
                let nodes: Vec<String> = match on {
                    Some(node) => vec![node],
                    None => {
                        let reply: GetStateReply = bus
                            .query(&selector(AdminMethod::State), &GetStateRequest {}, timeout)
                            .await
                            .map_err(|_| anyhow::anyhow!(unreachable()))?;
                        let state = reply.state.unwrap_or_default();
                        state
                            .nodes
                            .iter()
                            .filter(|(_, n)| !n.info.as_ref().is_some_and(|i| i.no_worker))
                            .map(|(id, _)| id.clone())
                            .collect()
                    }
                };
                for node in nodes {
                    let request = v1::DownloadRequest {
                        action: match action {
                            DownloadActionArg::Start => v1::DownloadAction::Start,
                            DownloadActionArg::Cancel => v1::DownloadAction::Cancel,
                            DownloadActionArg::Delete => v1::DownloadAction::Delete,
                        } as i32,
                        node_id: node.clone(),
                        model_id: model.clone(),
                    };
                    let reply: v1::DownloadReply = bus
                        .query(&bus.keys.admin(AdminMethod::Download), &request, timeout)
                        .await
                        .map_err(|_| {
                            anyhow::anyhow!(
                                "no master answered within {timeout:?}: is the cluster up?"
                            )
                        })?;
                    if let Some(error) = &reply.error {
                        bail!("{node}: {} ({})", error.message, error.kind);
                    }
                    println!("{node}: {action:?} {model} asked");
                }
            }
            AdminCommand::Events { from, follow } => {
                let mut next = from.max(1);
                loop {
                    let request = v1::EventsRangeRequest {
                        from_index: next,
                        to_index: 0,
                    };
                    let reply: v1::EventsRangeReply = bus
                        .query(&selector(AdminMethod::Events), &request, timeout)
                        .await
                        .map_err(|_| anyhow::anyhow!(unreachable()))?;
                    for event in &reply.events {
                        println!("{}", serde_json::to_string(event)?);
                        next = next.max(event.index + 1);
                    }
                    if reply.events.is_empty() {
                        if !follow {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        Ok(())
    })
}

/// Where a model's files are: "a, b, c (part)", or "-".
fn where_held(listing: &v1::ModelListing) -> String {
    let whole = listing.downloaded_on.iter().cloned();
    let parts = listing
        .partly_on
        .iter()
        .map(|node| format!("{node} (part)"));
    let held: Vec<String> = whole.chain(parts).collect();
    if held.is_empty() {
        "-".to_string()
    } else {
        held.join(", ")
    }
}

fn short(node: &str) -> &str {
    &node[node.len().saturating_sub(8)..]
}

fn sharding_name(sharding: i32) -> &'static str {
    match v1::Sharding::try_from(sharding) {
        Ok(v1::Sharding::Tensor) => "tensor",
        Ok(v1::Sharding::Pipeline) => "pipeline",
        _ => "?",
    }
}

fn shard_text(shard: Option<&v1::ShardSpec>) -> String {
    use v1::shard_spec::Kind;
    match shard.and_then(|s| s.kind.as_ref()) {
        Some(Kind::Pipeline(p)) => format!("layers {}..{}", p.start_layer, p.end_layer),
        Some(Kind::Tensor(t)) => format!("tensor {}/{}", t.rank, t.world_size),
        None => "?".into(),
    }
}
