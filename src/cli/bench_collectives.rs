//! `tessera bench collectives`: latency of the ring's all-reduce between
//! local rank processes on loopback, the operation tensor parallelism runs
//! twice per layer per decoded token.

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use serde::Serialize;
use tessera_engine::dist::collectives::{Group, TcpRing};

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
    /// Also time a sealed ring (a secured cluster's: proved, AES-256-GCM
    /// frames) in the same run, rounds of the two in turn, and report the
    /// ratio of their medians.
    #[arg(long)]
    pub compare_sealed: bool,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    sealed: Option<Timing>,
    /// Sealed median over open median.
    #[serde(skip_serializing_if = "Option::is_none")]
    sealed_over_open: Option<f64>,
}

#[derive(Serialize)]
struct Timing {
    median_us: f64,
    p10_us: f64,
    p90_us: f64,
    p99_us: f64,
    mean_us: f64,
}

impl Timing {
    fn of(times: Vec<f64>) -> Timing {
        let mean = stats::mean(&times);
        let times = stats::sorted(times);
        let at = |q: f64| stats::round_to(stats::percentile(&times, q), 2);
        Timing {
            median_us: at(0.5),
            p10_us: at(0.1),
            p90_us: at(0.9),
            p99_us: at(0.99),
            mean_us: stats::round_to(mean, 2),
        }
    }
}

/// Rounds the timed iterations are split into when two rings are compared:
/// each round times one ring then the other, so noise falls on both.
const ROUNDS: usize = 10;

/// A ring of local ranks that takes part in `total` all-reduces.
fn start(
    args: &CollectivesBenchArgs,
    total: usize,
    sealed: bool,
) -> anyhow::Result<(LocalRanks, TcpRing)> {
    let rank_args = vec![
        "--all-reduce-iterations".to_string(),
        total.to_string(),
        "--len".into(),
        args.len.to_string(),
    ];
    LocalRanks::start(
        args.world,
        &rank_args,
        Duration::from_secs(10),
        args.json,
        sealed,
    )
}

/// Runs `count` all-reduces on `ring`, their times added to `times` (a
/// warm-up keeps none).
fn time(
    ring: &mut TcpRing,
    args: &CollectivesBenchArgs,
    count: usize,
    times: Option<&mut Vec<f64>>,
) -> anyhow::Result<()> {
    let mut data = vec![1.0f32; args.len];
    let mut kept = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        ring.all_reduce_sum(&mut data)?;
        kept.push(started.elapsed().as_secs_f64() * 1e6);
        if data[0] != args.world as f32 {
            bail!("all-reduce gave {} instead of {}", data[0], args.world);
        }
        data.iter_mut().for_each(|v| *v = 1.0);
    }
    if let Some(times) = times {
        times.extend(kept);
    }
    Ok(())
}

pub fn run(args: CollectivesBenchArgs) -> anyhow::Result<()> {
    if args.world < 2 || args.len == 0 || args.iterations == 0 {
        bail!("--world must be at least 2, --len and --iterations at least 1");
    }
    let total = args.iterations + args.warmup;
    let (ranks, mut ring) = start(&args, total, false)?;
    let mut sealed = if args.compare_sealed {
        Some(start(&args, total, true)?)
    } else {
        None
    };
    let (mut open_times, mut sealed_times) = (Vec::new(), Vec::new());
    time(&mut ring, &args, args.warmup, None)?;
    if let Some((_, sealed_ring)) = sealed.as_mut() {
        time(sealed_ring, &args, args.warmup, None)?;
    }
    let rounds = if sealed.is_some() { ROUNDS } else { 1 };
    for round in 0..rounds {
        let count = args.iterations / rounds + usize::from(round < args.iterations % rounds);
        time(&mut ring, &args, count, Some(&mut open_times))?;
        if let Some((_, sealed_ring)) = sealed.as_mut() {
            time(sealed_ring, &args, count, Some(&mut sealed_times))?;
        }
    }
    ring.barrier()?;
    ranks.finish()?;
    if let Some((sealed_ranks, mut sealed_ring)) = sealed {
        sealed_ring.barrier()?;
        sealed_ranks.finish()?;
    }
    let open = Timing::of(open_times);
    let sealed = args.compare_sealed.then(|| Timing::of(sealed_times));
    let ratio = sealed
        .as_ref()
        .map(|s| stats::round_to(s.median_us / open.median_us.max(f64::MIN_POSITIVE), 3));
    let report = Report {
        bench: "collectives",
        world: args.world,
        len: args.len,
        iterations: args.iterations,
        median_us: open.median_us,
        p10_us: open.p10_us,
        p90_us: open.p90_us,
        p99_us: open.p99_us,
        mean_us: open.mean_us,
        sealed,
        sealed_over_open: ratio,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
