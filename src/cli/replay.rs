//! `tessera replay`: fold a persisted event log offline.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use tessera_protos::{event_type_name, v1};
use tessera_state::{replay, EventLog, ReplayOptions, State};

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The node's data directory (the log is in its `events/` folder).
    #[arg(long, env = "TESSERA_HOME")]
    data_dir: Option<PathBuf>,
    /// Fold events up to and including this index (default: the end).
    #[arg(long)]
    until: Option<u64>,
    /// Print JSON: {"last_index", "digest", "state"}.
    #[arg(long)]
    json: bool,
    /// Print the events instead of the state, one JSON object a line.
    #[arg(long)]
    events: bool,
    /// With --events: the first index to print.
    #[arg(long, requires = "events", default_value_t = 1)]
    from: u64,
    /// With --events: the last index to print (default: the end).
    #[arg(long, requires = "events")]
    to: Option<u64>,
    /// Fold from the first event, ignoring snapshots (slower; a cross-check).
    #[arg(long, conflicts_with = "events")]
    no_snapshots: bool,
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(super::support::default_data_dir);
    let dir = super::support::events_dir(&data_dir);
    if !dir.is_dir() {
        bail!(
            "no event log in {}: expected the folder {}",
            data_dir.display(),
            dir.display()
        );
    }
    let log = EventLog::open_existing(&dir)
        .with_context(|| format!("opening the event log in {}", dir.display()))?;
    if args.events {
        print_events(&log, &args)
    } else {
        print_state(&log, &args)
    }
}

fn print_events(log: &EventLog, args: &ReplayArgs) -> anyhow::Result<()> {
    let to = args.to.unwrap_or(log.last_index());
    if args.from > to {
        bail!("--from {} is after --to {to}", args.from);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for event in log.range(args.from, to) {
        let event = event?;
        let line = event_json(&event)?;
        if writeln!(out, "{line}").is_err() {
            // The reader went away (e.g. `| head`): stop quietly.
            return Ok(());
        }
    }
    out.flush().ok();
    Ok(())
}

/// `{"index", "type", "session", "event"}` where `event` is the variant's body.
fn event_json(event: &v1::IndexedEvent) -> anyhow::Result<serde_json::Value> {
    let kind = event.event.as_ref().map(event_type_name).unwrap_or("Empty");
    let body = match &event.event {
        Some(inner) => match serde_json::to_value(inner)? {
            serde_json::Value::Object(map) => {
                map.into_iter().next().map(|(_, v)| v).unwrap_or_default()
            }
            other => other,
        },
        None => serde_json::Value::Null,
    };
    Ok(serde_json::json!({
        "index": event.index,
        "type": kind,
        "session": event.session,
        "event": body,
    }))
}

fn print_state(log: &EventLog, args: &ReplayArgs) -> anyhow::Result<()> {
    let replayed = replay(
        log,
        ReplayOptions {
            until: args.until,
            use_snapshots: !args.no_snapshots,
        },
    )?;
    for skipped in &replayed.skipped_snapshots {
        eprintln!("warning: {skipped}; used an older snapshot");
    }
    let state = &replayed.state;
    if args.json {
        let out = serde_json::json!({
            "last_index": state.last_index(),
            "digest": state.digest().to_string(),
            "state": state.as_proto(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let from = match replayed.from_snapshot {
        Some(index) => format!("snapshot {index}"),
        None => "the first event".to_string(),
    };
    println!("last index: {}", state.last_index());
    println!("digest:     {}", state.digest());
    println!(
        "folded:     {} events from {from} ({} changed nothing)",
        replayed.events_applied, replayed.events_ignored
    );
    print_summary(state);
    Ok(())
}

fn print_summary(state: &State) {
    if let Some(session) = state.session() {
        println!(
            "session:    master {} (election clock {})",
            session.master_node_id, session.election_clock
        );
    }
    println!("nodes ({}):", state.nodes.len());
    for (id, node) in &state.nodes {
        let info = node.info.clone().unwrap_or_default();
        println!(
            "  {id}  {}  {} cores  {:.1}/{:.1} GiB free",
            info.hostname,
            info.cpu_cores,
            gib(info.memory_available_bytes),
            gib(info.memory_total_bytes)
        );
    }
    println!("topology edges: {}", state.topology.len());
    println!("instances ({}):", state.instances.len());
    for (id, instance) in &state.instances {
        let model = instance
            .model
            .as_ref()
            .map(|m| m.model_id.as_str())
            .unwrap_or("?");
        let nodes: Vec<&str> = instance.ranks.iter().map(|r| r.node_id.as_str()).collect();
        println!(
            "  {id}  {model}  {:?}  on {}",
            instance.sharding(),
            nodes.join(", ")
        );
    }
    println!("runners ({}):", state.runners.len());
    for (id, status) in &state.runners {
        println!("  {id}  {}", runner_state_name(status));
    }
    println!("tasks ({}):", state.tasks.len());
    for (id, task) in &state.tasks {
        println!("  {id}  {:?}  instance {}", task.status(), task.instance_id);
    }
    let downloads: usize = state.downloads.values().map(|d| d.models.len()).sum();
    println!("downloads: {downloads}");
}

fn runner_state_name(status: &v1::RunnerStatus) -> String {
    use v1::runner_status::State as R;
    match &status.state {
        None => "unknown".into(),
        Some(R::Idle(_)) => "Idle".into(),
        Some(R::Connecting(_)) => "Connecting".into(),
        Some(R::Connected(_)) => "Connected".into(),
        Some(R::Loading(l)) => format!("Loading {}/{} layers", l.layers_loaded, l.layers_total),
        Some(R::Loaded(_)) => "Loaded".into(),
        Some(R::WarmingUp(_)) => "WarmingUp".into(),
        Some(R::Ready(_)) => "Ready".into(),
        Some(R::Running(r)) => format!("Running {}", r.task_id),
        Some(R::ShuttingDown(_)) => "ShuttingDown".into(),
        Some(R::Shutdown(_)) => "Shutdown".into(),
        Some(R::Failed(f)) => format!("Failed: {}", f.reason),
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
