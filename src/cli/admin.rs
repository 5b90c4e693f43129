//! `tessera admin`: typed requests to the cluster over zenoh queries (the
//! admin service of protos/proto/tessera/v1/admin.proto, asked through
//! [`AdminClient`]). Reads are answered by any node; place and delete by
//! the master. One function per subcommand; [`run`] dispatches.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;
use tessera_actors::admin::client::{
    AdminClient, ConnectOptions, GenerationEvent, GenerationStream,
};
use tessera_protos::v1;

/// How to reach the cluster; global, so they go before or after the
/// subcommand.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    #[arg(
        long,
        env = "TESSERA_NAMESPACE",
        default_value = "default",
        global = true
    )]
    pub namespace: String,
    /// A node's zenoh endpoint (repeatable); without one, nodes are found
    /// by multicast.
    #[arg(long, global = true)]
    pub connect: Vec<String>,
    /// Seconds to wait for answers.
    #[arg(long, default_value_t = 3.0, global = true)]
    pub timeout: f64,
    /// Machine-readable output.
    #[arg(long, global = true)]
    pub json: bool,
    /// A secured cluster's credentials for this machine (default:
    /// $TESSERA_HOME/cluster, when it holds them).
    #[arg(long, env = "TESSERA_CLUSTER_DIR", global = true)]
    pub cluster_dir: Option<std::path::PathBuf>,
}

impl ClusterArgs {
    /// The client's options; `node`: ask reads of that node only.
    pub fn options(&self, node: Option<String>) -> anyhow::Result<ConnectOptions> {
        let timeout = Duration::try_from_secs_f64(self.timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .context("--timeout must be a positive number of seconds")?;
        let credentials = credentials(self.cluster_dir.as_deref())?;
        Ok(ConnectOptions {
            namespace: self.namespace.clone(),
            connect: self.connect.clone(),
            node,
            timeout,
            credentials,
        })
    }
}

/// This machine's credentials for a secured cluster: from `cluster_dir`
/// (which must hold them), else from `$TESSERA_HOME/cluster` if it does.
pub fn credentials(
    cluster_dir: Option<&std::path::Path>,
) -> anyhow::Result<Option<tessera_trust::Credentials>> {
    let folder = match cluster_dir {
        Some(dir) => tessera_trust::ClusterDir::at(dir),
        None => tessera_trust::ClusterDir::of(&super::support::default_data_dir()),
    };
    let credentials = folder.credentials();
    if cluster_dir.is_some() && credentials.is_none() {
        anyhow::bail!(
            "{} holds no cluster credentials (authority.pem, cert.pem, key.pem)",
            folder.path().display()
        );
    }
    Ok(credentials)
}

#[derive(Debug, Args)]
pub struct AdminArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Ask this node only (default: the most up-to-date answer).
    #[arg(long, global = true)]
    pub node: Option<String>,
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
    /// Set or clear an instance's speculative decoding: a draft model
    /// (`--model M`), prompt lookup (`--ngram`) or none (`--off`); then
    /// wait for its rank 0 to report it.
    Draft(DraftArgs),
    /// Generate text on an instance (or any ready instance of a model),
    /// streaming the tokens.
    Generate(GenerateArgs),
    /// The model catalogue (built-in and custom cards) and which nodes
    /// hold each model's files.
    Models,
    /// Build a model card from a hub repository (OWNER/NAME) and add it
    /// to the cluster's catalogue.
    AddModel(AddModelArgs),
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

/// `admin draft INSTANCE --model M [--tokens K] | --ngram [--tokens K] | --off`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "ngram", "off"])))]
pub struct DraftArgs {
    pub instance: String,
    /// A draft model (its id in the catalogue) with the target's
    /// vocabulary, loaded whole on rank 0.
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt lookup: drafts what followed the text's last tokens earlier
    /// in the prompt or answer (no model).
    #[arg(long)]
    pub ngram: bool,
    /// No speculative decoding.
    #[arg(long, conflicts_with = "tokens")]
    pub off: bool,
    /// The most tokens drafted per step (1 to 16; default 4).
    #[arg(long)]
    pub tokens: Option<u32>,
    /// Seconds to wait for rank 0 to report the draft (0: do not wait).
    #[arg(long, default_value_t = 120.0)]
    pub wait: f64,
}

impl DraftArgs {
    /// The draft asked for; `None`: off.
    fn draft(&self) -> Option<v1::InstanceDraft> {
        let tokens = self.tokens.unwrap_or(0);
        if let Some(model) = &self.model {
            Some(v1::InstanceDraft {
                method: v1::DraftMethod::DraftModel as i32,
                draft_model: model.clone(),
                num_draft_tokens: tokens,
                draft_card: None,
            })
        } else if self.ngram {
            Some(v1::InstanceDraft {
                method: v1::DraftMethod::Ngram as i32,
                num_draft_tokens: tokens,
                ..Default::default()
            })
        } else {
            None
        }
    }
}

/// `add-model` / `models add`: a hub repository, and for a GGUF one which
/// of its files.
#[derive(Debug, Args)]
pub struct AddModelArgs {
    /// OWNER/NAME: a safetensors repository (card from its config.json) or
    /// a GGUF one (card from the chosen file's headers, read with Range
    /// requests; split files `NAME-00001-of-0000N.gguf` too).
    pub repo: String,
    /// Branch, tag or commit (default: main).
    #[arg(long, default_value = "")]
    pub revision: String,
    /// GGUF: the file to add (any shard of a split one).
    #[arg(long, default_value = "", conflicts_with = "quant")]
    pub file: String,
    /// GGUF: the quantization to add (default Q4_K_M, else the closest the
    /// repository has), e.g. Q8_0.
    #[arg(long, default_value = "")]
    pub quant: String,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// An instance id, or a model id.
    target: String,
    prompt: String,
    /// Feed the prompt as raw text (default: one user message, templated).
    #[arg(long)]
    raw: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Sampling temperature (0: greedy; default: the model's).
    #[arg(long)]
    temperature: Option<f32>,
    /// Seed of the sampler, for repeatable samples.
    #[arg(long)]
    seed: Option<u64>,
    /// Nucleus sampling: keep the most likely tokens up to this mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the K most likely tokens.
    #[arg(long)]
    top_k: Option<u32>,
    /// Seconds to wait for the first chunk and between chunks.
    #[arg(long, default_value_t = 60.0)]
    chunk_timeout: f64,
}

impl GenerateArgs {
    fn params(&self) -> v1::TextGenerationParams {
        let message = v1::ChatMessage {
            role: "user".into(),
            content: self.prompt.clone(),
            ..Default::default()
        };
        v1::TextGenerationParams {
            messages: if self.raw { Vec::new() } else { vec![message] },
            raw_prompt: self.raw.then(|| self.prompt.clone()),
            prompt_token_ids: Vec::new(),
            count_only: false,
            sampling: Some(v1::SamplingParams {
                max_tokens: Some(self.max_tokens),
                temperature: self.temperature,
                seed: self.seed,
                top_p: self.top_p,
                top_k: self.top_k,
                ..Default::default()
            }),
            ..Default::default()
        }
    }
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
    let options = args.cluster.options(args.node.clone())?;
    let json = args.cluster.json;
    let runtime = super::support::client_runtime()?;
    runtime.block_on(async move {
        let client = AdminClient::connect(options).await?;
        let result = dispatch(&client, args.what, json).await;
        // Whatever the outcome, the session is closed cleanly.
        let _ = client.close().await;
        result
    })
}

async fn dispatch(client: &AdminClient, what: AdminCommand, json: bool) -> anyhow::Result<()> {
    match what {
        AdminCommand::State => state(client, json).await,
        AdminCommand::Nodes => nodes(client, json).await,
        AdminCommand::Instances => instances(client, json).await,
        AdminCommand::Previews { model } => previews(client, &model, json).await,
        AdminCommand::Place {
            model,
            sharding,
            min_nodes,
        } => place(client, &model, sharding, min_nodes, json).await,
        AdminCommand::Delete { instance } => delete(client, &instance).await,
        AdminCommand::Draft(args) => draft(client, &args, json).await,
        AdminCommand::Generate(args) => generate(client, &args, json).await,
        AdminCommand::Models => models(client, json).await,
        AdminCommand::AddModel(args) => add_model(client, args, json).await,
        AdminCommand::Downloads => downloads(client, json).await,
        AdminCommand::Download { model, on, action } => download(client, &model, on, action).await,
        AdminCommand::Events { from, follow } => events(client, from, follow).await,
    }
}

fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

async fn state(client: &AdminClient, json: bool) -> anyhow::Result<()> {
    let reply = client.state().await?;
    let state = reply.state.unwrap_or_default();
    if json {
        return print_json(&serde_json::json!({
            "last_index": state.last_index,
            "digest": reply.digest,
            "state": serde_json::to_value(&state)?,
        }));
    }
    println!("last index {}  digest {}", state.last_index, reply.digest);
    println!(
        "{} nodes, {} instances, {} runners, {} tasks",
        state.nodes.len(),
        state.instances.len(),
        state.runners.len(),
        state.tasks.len()
    );
    Ok(())
}

async fn nodes(client: &AdminClient, json: bool) -> anyhow::Result<()> {
    let reply = client.nodes().await?;
    if json {
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
        return print_json(&nodes);
    }
    println!(
        "{:<38} {:<7} {:<20} {:>6} {:>12}  {:<6} {:>11}  GPUS",
        "NODE", "ROLE", "HOST", "CORES", "FREE MEM", "DEVICE", "DECODE"
    );
    for n in &reply.nodes {
        let info = n.info.clone().unwrap_or_default();
        let gpus: Vec<String> = info.gpus.iter().map(gpu_summary).collect();
        let speed = match info.decode_bytes_per_second {
            0 => "-".to_string(),
            bytes => format!("{:.1} GB/s", bytes as f64 / 1e9),
        };
        println!(
            "{:<38} {:<7} {:<20} {:>6} {:>9.1} GB  {:<6} {:>11}  {}",
            n.node_id,
            if n.is_master { "master" } else { "" },
            info.hostname,
            info.cpu_cores,
            info.memory_available_bytes as f64 / 1e9,
            info.device,
            speed,
            if gpus.is_empty() {
                "none".into()
            } else {
                gpus.join("; ")
            }
        );
    }
    Ok(())
}

/// One adapter in a line: `gpu:N name (backend, kind, memory)`.
fn gpu_summary(gpu: &v1::GpuAdapter) -> String {
    let memory = match (gpu.memory_bytes, gpu.unified_memory) {
        (0, _) => "memory unknown".to_string(),
        (bytes, true) => format!("{:.1} GB shared", bytes as f64 / 1e9),
        (bytes, false) => format!("{:.1} GB", bytes as f64 / 1e9),
    };
    format!(
        "gpu:{} {} ({}, {}, {memory})",
        gpu.index, gpu.name, gpu.backend, gpu.kind
    )
}

async fn instances(client: &AdminClient, json: bool) -> anyhow::Result<()> {
    let reply = client.instances().await?;
    if json {
        return print_json(&reply.instances);
    }
    println!("{:<44} {:<10} RANKS (node: shard)", "INSTANCE", "SHARDING");
    for instance in &reply.instances {
        let ranks: Vec<String> = instance
            .ranks
            .iter()
            .map(|r| format!("{}: {}", short(&r.node_id), shard_text(r.shard.as_ref())))
            .collect();
        println!(
            "{:<44} {:<10} {}",
            instance.instance_id,
            sharding_name(instance.sharding),
            ranks.join(", ")
        );
    }
    Ok(())
}

async fn previews(client: &AdminClient, model: &str, json: bool) -> anyhow::Result<()> {
    let reply = client.previews(model).await?;
    if json {
        return print_json(&reply.previews);
    }
    for p in &reply.previews {
        let sharding = sharding_name(p.sharding);
        if p.instance.is_none() {
            println!("{sharding:<9} {} node(s): {}", p.node_count, p.error);
            continue;
        }
        let memory: Vec<String> = p
            .memory_bytes_by_node
            .iter()
            .map(|(node, bytes)| format!("{}: {:.0} MB", short(node), *bytes as f64 / 1e6))
            .collect();
        println!(
            "{sharding:<9} {} node(s): fits ({})",
            p.node_count,
            memory.join(", ")
        );
    }
    Ok(())
}

async fn place(
    client: &AdminClient,
    model: &str,
    sharding: ShardingArg,
    min_nodes: u32,
    json: bool,
) -> anyhow::Result<()> {
    let request = v1::PlaceInstanceRequest {
        model_id: model.to_string(),
        sharding: match sharding {
            ShardingArg::Pipeline => v1::Sharding::Pipeline,
            ShardingArg::Tensor => v1::Sharding::Tensor,
        } as i32,
        min_nodes,
        node_ids: Vec::new(),
        request_id: uuid::Uuid::now_v7().to_string(),
    };
    let instance = client.place(&request).await?.instance.unwrap_or_default();
    if json {
        return print_json(&instance);
    }
    println!("placed {}", instance.instance_id);
    for r in &instance.ranks {
        println!(
            "  rank {} on {}: {}",
            r.rank,
            r.node_id,
            shard_text(r.shard.as_ref())
        );
    }
    Ok(())
}

async fn delete(client: &AdminClient, instance: &str) -> anyhow::Result<()> {
    client.delete(instance).await?;
    println!("deleted {instance}");
    Ok(())
}

/// Sets the draft, then follows the state until rank 0's status names it
/// (a refusal, such as a draft of another vocabulary, is an error).
async fn draft(client: &AdminClient, args: &DraftArgs, json: bool) -> anyhow::Result<()> {
    let reply = client.set_draft(&args.instance, args.draft()).await?;
    let asked = reply.instance.and_then(|i| i.draft);
    let described = match &asked {
        None => "no draft".to_string(),
        Some(d) if d.method() == v1::DraftMethod::Ngram => {
            format!("prompt lookup, {} tokens", d.num_draft_tokens)
        }
        Some(d) => format!(
            "draft model {}, {} tokens",
            d.draft_model, d.num_draft_tokens
        ),
    };
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_secs_f64(args.wait.max(0.0));
    let report = loop {
        let state = client.state().await?.state.unwrap_or_default();
        let instance = state
            .instances
            .get(&args.instance)
            .ok_or_else(|| anyhow::anyhow!("instance {} went away", args.instance))?;
        // The node that answers may not hold the update yet.
        let report = (state.last_index >= reply.index)
            .then(|| tessera_actors::worker::plan::rank0_draft(&state, instance))
            .flatten();
        if let Some(report) = report {
            break Some(report);
        }
        if std::time::Instant::now() >= deadline {
            break None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    };
    if json {
        return print_json(&serde_json::json!({
            "instance_id": args.instance,
            "index": reply.index,
            "draft": serde_json::to_value(&asked)?,
            "runner": serde_json::to_value(report.as_ref().and_then(|r| r.as_ref()))?,
            "reported": report.is_some(),
        }));
    }
    match report {
        None => println!(
            "{}: {described} (event {}); rank 0 has not reported it yet",
            args.instance, reply.index
        ),
        Some(Some(r)) if !r.error.is_empty() => anyhow::bail!(
            "{}: rank 0 refused the draft: {} (the instance serves without it; `--off` clears it)",
            args.instance,
            r.error
        ),
        Some(Some(r)) if r.resident_bytes > 0 => println!(
            "{}: {described}, running ({:.0} MB on rank 0)",
            args.instance,
            r.resident_bytes as f64 / 1e6
        ),
        Some(Some(_)) => println!("{}: {described}, running", args.instance),
        Some(None) => println!("{}: {described}", args.instance),
    }
    Ok(())
}

/// Streams a generation to stdout; Ctrl-C cancels it on the cluster.
async fn generate(client: &AdminClient, args: &GenerateArgs, json: bool) -> anyhow::Result<()> {
    let chunk_timeout = Duration::try_from_secs_f64(args.chunk_timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .context("--chunk-timeout must be a positive number of seconds")?;
    let mut stream = client
        .generate(&args.target, args.params(), chunk_timeout)
        .await?;
    let outcome = tokio::select! {
        outcome = print_generation(&mut stream, json) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    if outcome.is_err() && !json {
        println!();
    }
    // Unfinished (interrupted, timed out): cancelled on the cluster.
    stream.cancel().await;
    outcome
}

async fn print_generation(stream: &mut GenerationStream, json: bool) -> anyhow::Result<()> {
    let mut text = String::new();
    let mut out = std::io::stdout();
    while let Some(event) = stream.next().await {
        match event? {
            GenerationEvent::Token(token) => {
                text.push_str(&token.text);
                if !json {
                    // Best effort: a closed stdout must not stop the cancel.
                    let _ = out.write_all(token.text.as_bytes());
                    let _ = out.flush();
                }
            }
            GenerationEvent::Finish(finish) if json => {
                return print_json(&serde_json::json!({
                    "text": text,
                    "finish": serde_json::to_value(finish)?,
                }));
            }
            GenerationEvent::Finish(_) => {
                println!();
                return Ok(());
            }
        }
    }
    anyhow::bail!("the generation ended without a finish")
}

async fn models(client: &AdminClient, json: bool) -> anyhow::Result<()> {
    let reply = client.models().await?;
    if json {
        return print_json(&reply.models);
    }
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
    Ok(())
}

async fn add_model(client: &AdminClient, args: AddModelArgs, json: bool) -> anyhow::Result<()> {
    let reply = client
        .add_model(v1::AddModelRequest {
            hub_repo: args.repo,
            revision: args.revision,
            file: args.file,
            quant: args.quant,
        })
        .await?;
    if json {
        return print_json(&reply);
    }
    let card = reply.card.unwrap_or_default();
    let files = card.source.as_ref().map_or(0, |s| s.files.len());
    println!(
        "added {} ({} layers, {:.2} GB in {files} files, {}); {} bytes fetched to build the card",
        card.model_id,
        card.n_layers,
        card.storage_size_bytes as f64 / 1e9,
        card.quantization,
        reply.bytes_fetched
    );
    Ok(())
}

async fn downloads(client: &AdminClient, json: bool) -> anyhow::Result<()> {
    let reply = client.downloads().await?;
    if json {
        return print_json(&reply.downloads);
    }
    for d in &reply.downloads {
        let p = d.progress.clone().unwrap_or_default();
        println!("{}  {}  {}", d.node_id, p.model_id, download_text(&p));
    }
    Ok(())
}

async fn download(
    client: &AdminClient,
    model: &str,
    on: Option<String>,
    action: DownloadActionArg,
) -> anyhow::Result<()> {
    let nodes = match on {
        Some(node) => vec![node],
        None => nodes_with_workers(client).await?,
    };
    let asked = match action {
        DownloadActionArg::Start => v1::DownloadAction::Start,
        DownloadActionArg::Cancel => v1::DownloadAction::Cancel,
        DownloadActionArg::Delete => v1::DownloadAction::Delete,
    };
    for node in nodes {
        client
            .download(asked, &node, model)
            .await
            .map_err(|e| anyhow::anyhow!("{node}: {e}"))?;
        println!("{node}: {action:?} {model} asked");
    }
    Ok(())
}

/// The nodes that run models (not started with `--no-worker`).
async fn nodes_with_workers(client: &AdminClient) -> anyhow::Result<Vec<String>> {
    let state = client.state().await?.state.unwrap_or_default();
    Ok(state
        .nodes
        .iter()
        .filter(|(_, n)| !n.info.as_ref().is_some_and(|i| i.no_worker))
        .map(|(id, _)| id.clone())
        .collect())
}

/// Prints the indexed events from `from`, one JSON object a line; with
/// `follow`, keeps asking for the next ones.
async fn events(client: &AdminClient, from: u64, follow: bool) -> anyhow::Result<()> {
    let mut next = from.max(1);
    loop {
        let reply = client.events(next, 0).await?;
        for event in &reply.events {
            println!("{}", serde_json::to_string(event)?);
            next = next.max(event.index + 1);
        }
        if reply.events.is_empty() {
            if !follow {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{AdminArgs, AdminCommand};

    /// `tessera admin` as its own command line.
    #[derive(Debug, Parser)]
    struct Admin {
        #[command(flatten)]
        args: AdminArgs,
    }

    fn admin(args: &[&str]) -> Result<AdminArgs, clap::Error> {
        Ok(Admin::try_parse_from(["admin"].iter().chain(args))?.args)
    }

    #[test]
    fn options_go_before_or_after_the_subcommand() -> Result<(), clap::Error> {
        for args in [["nodes", "--json"], ["--json", "nodes"]] {
            let parsed = admin(&args)?;
            assert!(parsed.cluster.json, "{args:?}");
            assert!(matches!(parsed.what, AdminCommand::Nodes), "{args:?}");
        }
        let parsed = admin(&[
            "state",
            "--namespace",
            "lab",
            "--connect",
            "tcp/10.0.0.1:7447",
            "--node",
            "n1",
            "--timeout",
            "0.5",
        ])?;
        assert_eq!(parsed.cluster.namespace, "lab");
        assert_eq!(parsed.cluster.connect, ["tcp/10.0.0.1:7447"]);
        assert_eq!(parsed.node.as_deref(), Some("n1"));
        assert_eq!(parsed.cluster.timeout, 0.5);
        Ok(())
    }

    #[test]
    fn sampling_flags_reach_the_generation_params() -> Result<(), clap::Error> {
        let parsed = admin(&[
            "generate",
            "m",
            "hi",
            "--temperature",
            "0.7",
            "--seed",
            "42",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--max-tokens",
            "8",
        ])?;
        let AdminCommand::Generate(generate) = parsed.what else {
            panic!("not generate: {:?}", parsed.what);
        };
        let sampling = generate.params().sampling.unwrap_or_default();
        assert_eq!(sampling.temperature, Some(0.7));
        assert_eq!(sampling.seed, Some(42));
        assert_eq!(sampling.top_p, Some(0.9));
        assert_eq!(sampling.top_k, Some(40));
        assert_eq!(sampling.max_tokens, Some(8));
        Ok(())
    }

    #[test]
    fn a_draft_is_a_model_prompt_lookup_or_off() -> Result<(), clap::Error> {
        let draft =
            |args: &[&str]| -> Result<Option<tessera_protos::v1::InstanceDraft>, clap::Error> {
                let parsed = admin(&[&["draft", "inst"], args].concat())?;
                let AdminCommand::Draft(draft) = parsed.what else {
                    panic!("not draft: {:?}", parsed.what);
                };
                assert_eq!(draft.instance, "inst");
                Ok(draft.draft())
            };
        let model = draft(&["--model", "small", "--tokens", "6"])?.unwrap_or_default();
        assert_eq!(
            (model.draft_model.as_str(), model.num_draft_tokens),
            ("small", 6)
        );
        let ngram = draft(&["--ngram"])?.unwrap_or_default();
        assert_eq!(ngram.method(), tessera_protos::v1::DraftMethod::Ngram);
        assert_eq!(ngram.num_draft_tokens, 0, "the master's default");
        assert_eq!(draft(&["--off"])?, None);
        for wrong in [
            &[][..],
            &["--ngram", "--off"],
            &["--model", "m", "--ngram"],
            &["--off", "--tokens", "4"],
        ] {
            assert!(draft(wrong).is_err(), "{wrong:?}");
        }
        Ok(())
    }

    #[test]
    fn a_zero_timeout_is_refused() -> Result<(), clap::Error> {
        let parsed = admin(&["--timeout", "0", "nodes"])?;
        assert!(parsed.cluster.options(None).is_err());
        Ok(())
    }
}
