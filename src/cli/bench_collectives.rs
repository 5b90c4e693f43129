//! `tessera bench collectives`: latency of the ring's all-reduce between
//! local rank processes on loopback, the operation tensor parallelism runs
//! twice per layer per decoded token.

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use serde::Serialize;
use tessera_engine::collectives::Group;

use super::ranks::LocalRanks;
use super::stats;

#[derive(Debug, Args)]
pub struct CollectivesBenchArgs {
    /// Ranks (local processes).
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Values per all-reduce (576: SmolLM2-135M's hidden size).
    #[arg(long, default_value_t = 576)]
    pub len: usize,
    /// All-reduces timed (after --warmup untimed ones).
    #[arg(long, default_value_t = 20_000)]
    pub iterations: usize,
    /// All-reduces run first and not timed.
    #[arg(long, default_value_t = 2_000)]
    pub warmup: usize,
    /// Print JSON only.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    world: usize,
    len: usize,
    iterations: usize,
    median_us: f64,
    p10_us: f64,
    p90_us: f64,
    p99_us: f64,
    mean_us: f64,
}

pub fn run(args: CollectivesBenchArgs) -> anyhow::Result<()> {
    if args.world < 2 || args.len == 0 || args.iterations == 0 {
        bail!("--world must be at least 2, --len and --iterations at least 1");
    }
    let total = args.iterations + args.warmup;
    let rank_args = vec![
        "--all-reduce-iterations".to_string(),
        total.to_string(),
        "--len".into(),
        args.len.to_string(),
    ];
    let (ranks, mut ring) =
        LocalRanks::start(args.world, &rank_args, Duration::from_secs(10), args.json)?;
    let mut data = vec![1.0f32; args.len];
    let mut times = Vec::with_capacity(args.iterations);
    for i in 0..total {
        let started = Instant::now();
        ring.all_reduce_sum(&mut data)?;
        if i >= args.warmup {
            times.push(started.elapsed().as_secs_f64() * 1e6);
        }
        if data[0] != args.world as f32 {
            bail!("all-reduce gave {} instead of {}", data[0], args.world);
        }
        data.iter_mut().for_each(|v| *v = 1.0);
    }
    ring.barrier()?;
    ranks.finish()?;
    let mean = stats::mean(&times);
    let times = stats::sorted(times);
    let at = |q: f64| stats::round_to(stats::percentile(&times, q), 2);
    let report = Report {
        bench: "collectives",
        world: args.world,
        len: args.len,
        iterations: args.iterations,
        median_us: at(0.5),
        p10_us: at(0.1),
        p90_us: at(0.9),
        p99_us: at(0.99),
        mean_us: stats::round_to(mean, 2),
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
