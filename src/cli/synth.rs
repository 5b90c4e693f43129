//! `tessera synth-log`: write a simulated cluster's event log.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use tessera_state::synthetic::SyntheticEvents;
use tessera_state::Journal;

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Data directory to write into (its `events/` folder must not exist yet).
    #[arg(long)]
    data_dir: PathBuf,
    /// How many events to write.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Nodes in the simulated cluster.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Seed of the simulation.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let dir = super::support::events_dir(&args.data_dir);
    if dir.exists() {
        bail!(
            "{} already exists: synth-log only writes new logs",
            dir.display()
        );
    }
    let mut journal = Journal::open(&dir, Journal::DEFAULT_SNAPSHOT_EVERY)
        .with_context(|| format!("creating an event log in {}", dir.display()))?;
    let mut events = SyntheticEvents::new(args.seed, args.nodes);
    for _ in 0..args.events {
        journal.commit(&events.next_event())?;
    }
    journal.flush()?;
    eprintln!(
        "wrote {} events ({} snapshots) to {}",
        args.events,
        journal.log().snapshot_indices()?.len(),
        dir.display()
    );
    Ok(())
}
