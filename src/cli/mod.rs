//! Command-line parsing and dispatch.

mod bench_log;
mod replay;
mod synth;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tessera",
    version,
    about = "Serve large language models across the machines you already own"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Fold a node's persisted event log offline and print the cluster state
    /// at any index, or the events themselves.
    Replay(replay::ReplayArgs),
    /// Measure performance; prints JSON with --json.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write the event log of a simulated cluster into a data dir, for demos
    /// and for trying `tessera replay`.
    SynthLog(synth::SynthArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Event log: append with batched flushes and replay, against raw sled
    /// inserts of the same bytes in the same run.
    Log(bench_log::LogBenchArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Replay(args) => replay::run(args),
        Command::Bench(BenchCommand::Log(args)) => bench_log::run(args),
        Command::SynthLog(args) => synth::run(args),
    }
}

/// The node's data directory: `--data-dir`, else `TESSERA_HOME`, else
/// `~/.tessera`.
pub fn default_data_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("TESSERA_HOME") {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".tessera")
}

/// Where a data dir keeps its event log (DESIGN.md, "Files on disk").
pub fn events_dir(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("events")
}
