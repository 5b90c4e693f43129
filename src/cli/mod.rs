//! Command-line parsing and dispatch.

mod admin;
mod bench_api;
mod bench_batch;
mod bench_cluster;
mod bench_collectives;
mod bench_download;
mod bench_log;
mod bench_model;
mod bench_speculative;
mod cluster;
mod devices;
mod generate;
mod model_args;
mod models;
mod node;
mod ranks;
mod replay;
mod runner;
mod stats;
mod support;
mod synth;

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
    /// Run this machine's node: find the others, elect a master, keep the
    /// cluster's event log.
    Node(node::NodeArgs),
    /// Ask the cluster: state, nodes (typed requests over zenoh).
    Admin(admin::AdminArgs),
    /// Secure the cluster: an authority, single-use join tokens, mutual
    /// TLS on every link (init, invite, join).
    Cluster(cluster::ClusterArgs),
    /// The model catalogue and downloads: list, add, download, cancel,
    /// delete.
    Models(models::ModelsArgs),
    /// A local hub: serve model repositories to machines without internet.
    Hub(models::HubArgs),
    /// Fold a node's persisted event log offline and print the cluster state
    /// at any index, or the events themselves.
    Replay(replay::ReplayArgs),
    /// Generate text from a prompt with a model on this machine.
    Generate(generate::GenerateArgs),
    /// The GPU adapters this machine has, and what each can do.
    Devices(devices::DevicesArgs),
    /// Measure performance as JSON: the model engine by default (decode and
    /// prefill tokens/s, time to first token, peak memory), or `bench log`.
    Bench(BenchArgs),
    /// One rank of one instance, started by a node's worker (not by hand).
    Runner(runner::RunnerArgs),
    /// One rank of a distributed model, driven by rank 0 over a TCP ring
    /// (started by `--world N` runs, and by the cluster on each node).
    Rank(ranks::RankArgs),
    /// Write the event log of a simulated cluster into a data dir, for demos
    /// and for trying `tessera replay`.
    SynthLog(synth::SynthArgs),
}

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchCommand>,
    #[command(flatten)]
    model: bench_model::ModelBenchArgs,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The model engine (the default): same as `tessera bench` with options.
    Model(bench_model::ModelBenchArgs),
    /// Event log: append with batched flushes and replay, against raw sled
    /// inserts of the same bytes in the same run.
    Log(bench_log::LogBenchArgs),
    /// All-reduce latency between local rank processes on loopback.
    Collectives(bench_collectives::CollectivesBenchArgs),
    /// Command-to-applied-event latency of a running cluster.
    Cluster(bench_cluster::ClusterBenchArgs),
    /// Load on a node's HTTP API: concurrent streaming clients, time to
    /// first token, requests/s, and the API's own added latency.
    Api(bench_api::ApiBenchArgs),
    /// Download throughput from a local hub, against curl fetching the
    /// same file from it in the same run.
    Download(bench_download::DownloadBenchArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Node(args) => node::run(args),
        Command::Admin(args) => admin::run(args),
        Command::Cluster(args) => cluster::run(args),
        Command::Models(args) => models::run(args),
        Command::Hub(args) => models::run_hub(args),
        Command::Replay(args) => replay::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Devices(args) => devices::run(args),
        Command::Bench(BenchArgs { what, model }) => match what {
            Some(BenchCommand::Log(args)) => bench_log::run(args),
            Some(BenchCommand::Collectives(args)) => bench_collectives::run(args),
            Some(BenchCommand::Cluster(args)) => bench_cluster::run(args),
            Some(BenchCommand::Api(args)) => bench_api::run(args),
            Some(BenchCommand::Download(args)) => bench_download::run(args),
            Some(BenchCommand::Model(args)) => bench_model::run(args),
            None => bench_model::run(model),
        },
        Command::SynthLog(args) => synth::run(args),
        Command::Rank(args) => ranks::run_rank(args),
        Command::Runner(args) => runner::run(args),
    }
}
