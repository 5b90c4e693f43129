//! Distributed runs on this machine: `--world N --sharding tensor|pipeline`
//! starts N - 1 `tessera rank` processes and joins them as rank 0 over a
//! loopback TCP ring; `tessera rank` is one such process (the cluster starts
//! ranks the same way, one per node, with the ring's addresses given).
//!
//! Start-up: each child binds a free loopback port and prints it; rank 0
//! sends every child the full address list on stdin; all join the ring,
//! then load their shard, then meet at a barrier. A child that dies closes
//! its connections, so the others fail fast instead of waiting.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};
use tessera_engine::dist::ring_security::{new_secret, RingSecurity};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use serde::Serialize;
use tessera_engine::dist::collectives::{Group, TcpRing};
use tessera_engine::dist::shard::{pipeline_stages, ShardError, ShardSpec};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{load_transformer, model_config};

use super::model_args::resolve_model;

/// How long ranks may take to load before the barrier gives up on them.
const LOAD_WAIT: Duration = Duration::from_secs(600);
/// How long joining the ring may take once every rank has its addresses.
const CONNECT_WAIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    /// Every layer split across ranks (attention by KV heads, MLP by rows).
    Tensor,
    /// Each rank runs a range of layers.
    Pipeline,
}

#[derive(Debug, Args, Clone)]
pub struct DistributedArgs {
    /// Ranks to split the model over, as local processes on loopback (1:
    /// this process alone). With more than one, --threads is per rank and
    /// defaults to 1.
    #[arg(long, default_value_t = 1)]
    pub world: usize,
    /// How to split the model across the ranks.
    #[arg(long, value_enum, default_value = "tensor")]
    pub sharding: Sharding,
    /// Pipeline only: layers per rank, e.g. `20,10` (default: balanced by
    /// work, the last rank taking fewer for the output head it also runs).
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<u32>,
    /// Seconds one step may wait on a peer before the run fails.
    #[arg(long, default_value_t = 30.0)]
    pub ring_timeout: f64,
    /// Prove and seal the ring as a secured cluster's instances do (a
    /// fresh secret, AES-256-GCM frames): to measure what security costs.
    #[arg(long)]
    pub sealed_ring: bool,
}

impl DistributedArgs {
    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }

    fn ring_timeout(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.ring_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .with_context(|| {
                format!(
                    "--ring-timeout {} is not a positive number of seconds",
                    self.ring_timeout
                )
            })
    }
}

/// The part of the model `rank` owns, split by the engine's rules
/// ([`tessera_engine::dist::shard`]) unless `--layers` gives the pipeline's split.
pub fn shard_spec(
    sharding: Sharding,
    rank: usize,
    world: usize,
    layer_counts: &[u32],
    model: &Path,
) -> anyhow::Result<ShardSpec> {
    let config = model_config(model)?;
    let n_layers = config.layers as u32;
    if world == 0 || rank >= world {
        bail!("rank {rank} of a world of {world}");
    }
    let spec = match sharding {
        Sharding::Tensor => tensor_spec(rank, world, layer_counts, config.kv_heads)?,
        Sharding::Pipeline => {
            let head = config.head_cost_in_layers();
            pipeline_spec(rank, world, layer_counts, n_layers, head)?
        }
    };
    spec.validate(n_layers)?;
    Ok(spec)
}

fn tensor_spec(
    rank: usize,
    world: usize,
    layer_counts: &[u32],
    kv_heads: usize,
) -> anyhow::Result<ShardSpec> {
    if !layer_counts.is_empty() {
        bail!("--layers is for pipeline sharding");
    }
    let spec = ShardSpec::Tensor {
        rank: rank as u32,
        world_size: world as u32,
    };
    // The engine gives each rank its KV-head groups: asked here, a world
    // too large is an error before any process starts.
    match spec.kv_head_groups(kv_heads as u32) {
        Ok(_) => Ok(spec),
        Err(ShardError::TooManyParts { .. }) => bail!(
            "tensor parallelism splits attention by KV heads: this model has {kv_heads}, so at most {kv_heads} ranks (asked for {world}); use --sharding pipeline for more"
        ),
        Err(error) => Err(error.into()),
    }
}

/// Rank `rank`'s layers: `layer_counts` if given, else balanced with the
/// first stage's head and sampling worth `head_layers` layers.
fn pipeline_spec(
    rank: usize,
    world: usize,
    layer_counts: &[u32],
    n_layers: u32,
    head_layers: f64,
) -> anyhow::Result<ShardSpec> {
    let ranges = if layer_counts.is_empty() {
        pipeline_stages(n_layers, world, head_layers)?
    } else {
        counted_ranges(layer_counts, world, n_layers)?
    };
    let range = ranges
        .get(rank)
        .with_context(|| format!("rank {rank} of a world of {world}"))?;
    Ok(ShardSpec::Pipeline {
        start_layer: range.start,
        end_layer: range.end,
        n_layers,
    })
}

/// The consecutive layer ranges `--layers` asks for, one per rank.
fn counted_ranges(
    layer_counts: &[u32],
    world: usize,
    n_layers: u32,
) -> anyhow::Result<Vec<Range<u32>>> {
    if layer_counts.len() != world || layer_counts.contains(&0) {
        bail!("--layers needs {world} positive counts, one per rank");
    }
    // Summed wide: counts come from the command line.
    let total: u64 = layer_counts.iter().map(|&c| u64::from(c)).sum();
    if total != u64::from(n_layers) {
        bail!("--layers adds up to {total}, but the model has {n_layers} layers");
    }
    let mut start = 0;
    Ok(layer_counts
        .iter()
        .map(|&count| {
            let range = start..start + count;
            start += count;
            range
        })
        .collect())
}

/// What a child rank reports when it is done.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RankReport {
    pub rank: usize,
    pub peak_rss_bytes: u64,
    pub weight_bytes: u64,
}

/// The child rank processes of a local distributed run. Dropping it kills
/// any still running.
pub struct LocalRanks {
    children: Vec<(usize, Child, BufReader<ChildStdout>)>,
}

impl LocalRanks {
    /// Starts ranks 1..world and joins them as rank 0. `rank_args` are the
    /// arguments every child gets after `rank --rank R --world N`. With
    /// `sealed`, the ring is proved and sealed under a fresh secret, handed
    /// to the children by environment.
    pub fn start(
        world: usize,
        rank_args: &[String],
        ring_timeout: Duration,
        quiet: bool,
        sealed: bool,
    ) -> anyhow::Result<(Self, TcpRing)> {
        let (security, secret) = if sealed {
            let secret = new_secret().map_err(anyhow::Error::msg)?;
            let security = RingSecurity::with_secret(&secret, true).map_err(anyhow::Error::msg)?;
            (security, tessera_actors::worker::hex(&secret))
        } else {
            (RingSecurity::open(), String::new())
        };
        let exe = std::env::current_exe().context("finding the tessera binary")?;
        let own = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
        let mut ranks = LocalRanks {
            children: Vec::new(),
        };
        let mut addrs = vec![own.local_addr()?];
        // One id for this run's ring: ranks of another run on the same
        // machine cannot join it.
        let ring_id = format!("local-{}", std::process::id());
        for rank in 1..world {
            let mut child = Command::new(&exe)
                .arg("rank")
                .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
                .args(["--ring-id", &ring_id])
                .arg("--ring-from-stdin")
                .args(sealed.then_some("--ring-sealed"))
                .args(rank_args)
                .env(tessera_actors::worker::RING_SECRET_ENV, &secret)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("starting rank {rank} ({})", exe.display()))?;
            if !quiet {
                eprintln!("started rank {rank} (pid {})", child.id());
            }
            let stdout = child.stdout.take().context("child stdout")?;
            ranks.children.push((rank, child, BufReader::new(stdout)));
            let (_, _, reader) = ranks.children.last_mut().context("child")?;
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let addr = line
                .strip_prefix("listening ")
                .and_then(|a| a.trim().parse::<SocketAddr>().ok())
                .with_context(|| format!("rank {rank} did not start (it said {line:?})"))?;
            addrs.push(addr);
        }
        let list = addrs
            .iter()
            .map(SocketAddr::to_string)
            .collect::<Vec<_>>()
            .join(",");
        for (rank, child, _) in &mut ranks.children {
            let mut stdin = child.stdin.take().context("child stdin")?;
            writeln!(stdin, "{list}").with_context(|| format!("rank {rank} exited early"))?;
        }
        let ring = TcpRing::join(
            0,
            own,
            &addrs,
            &ring_id,
            &security,
            CONNECT_WAIT,
            ring_timeout,
        )
        .context("joining the ring")?;
        Ok((ranks, ring))
    }

    /// Waits for every child to exit after a shutdown and collects their
    /// reports.
    pub fn finish(mut self) -> anyhow::Result<Vec<RankReport>> {
        let mut reports = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        for (rank, child, reader) in &mut self.children {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            loop {
                if let Some(status) = child.try_wait()? {
                    if !status.success() {
                        bail!("rank {rank} failed ({status})");
                    }
                    break;
                }
                if Instant::now() > deadline {
                    bail!("rank {rank} did not exit after the shutdown");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let report: RankReport = serde_json::from_str(line.trim())
                .with_context(|| format!("rank {rank} sent no report (it said {line:?})"))?;
            reports.push(report);
        }
        self.children.clear();
        Ok(reports)
    }
}

impl Drop for LocalRanks {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Rank 0's side of a local distributed model run: the children, the
/// ring, and rank 0's shard spec.
pub struct RankZero {
    pub ranks: LocalRanks,
    pub ring: TcpRing,
    pub spec: ShardSpec,
    pub ring_timeout: Duration,
}

impl RankZero {
    /// Starts the other ranks of a `dist` run of `model`, each with
    /// `threads` compute threads.
    pub fn start(
        dist: &DistributedArgs,
        model: &str,
        threads: usize,
        quiet: bool,
    ) -> anyhow::Result<Self> {
        let path = resolve_model(model)?;
        let spec = shard_spec(dist.sharding, 0, dist.world, &dist.layers, &path)?;
        // Check every rank's part before starting anything.
        for rank in 1..dist.world {
            shard_spec(dist.sharding, rank, dist.world, &dist.layers, &path)?;
        }
        let ring_timeout = dist.ring_timeout()?;
        let mut rank_args = vec![
            "--model".to_string(),
            path.display().to_string(),
            "--sharding".into(),
            format!("{:?}", dist.sharding).to_lowercase(),
            "--threads".into(),
            threads.to_string(),
            "--ring-timeout".into(),
            dist.ring_timeout.to_string(),
        ];
        if !dist.layers.is_empty() {
            rank_args.push("--layers".into());
            rank_args.push(
                dist.layers
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        let (ranks, ring) = LocalRanks::start(
            dist.world,
            &rank_args,
            ring_timeout,
            quiet,
            dist.sealed_ring,
        )?;
        Ok(Self {
            ranks,
            ring,
            spec,
            ring_timeout,
        })
    }

    /// After rank 0 has loaded: wait for every rank to load, then bound
    /// every step by the ring timeout.
    pub fn ready(executor: &mut Executor<'_>, ring_timeout: Duration) -> anyhow::Result<()> {
        executor.set_timeout(Some(LOAD_WAIT))?;
        executor
            .barrier()
            .context("waiting for the other ranks to load")?;
        executor.set_timeout(Some(ring_timeout))?;
        Ok(())
    }
}

#[derive(Debug, Args)]
pub struct RankArgs {
    /// This process's rank (0 drives; it is the process that started the run).
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub world: usize,
    /// The ring's addresses, one per rank in rank order (host:port,...).
    #[arg(long, value_delimiter = ',', conflicts_with = "ring_from_stdin")]
    pub ring: Vec<SocketAddr>,
    /// Bind a free loopback port, print `listening ADDR`, then read the
    /// ring's addresses as one comma-separated line on stdin.
    #[arg(long)]
    pub ring_from_stdin: bool,
    /// The ring's name: every rank of one run gives the same (a rank of
    /// another ring is turned away).
    #[arg(long, default_value = "tessera")]
    pub ring_id: String,
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value = "tensor")]
    pub sharding: Sharding,
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<u32>,
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value_t = 30.0)]
    pub ring_timeout: f64,
    /// Instead of a model: take part in N all-reduces of --len values
    /// (`tessera bench collectives`).
    #[arg(long)]
    pub all_reduce_iterations: Option<usize>,
    #[arg(long, default_value_t = 576)]
    pub len: usize,
    /// Prove the ring with the secret in TESSERA_RING_SECRET and seal it.
    #[arg(long)]
    pub ring_sealed: bool,
}

/// `tessera rank`: one rank of a distributed model, driven by rank 0.
pub fn run_rank(args: RankArgs) -> anyhow::Result<()> {
    if args.rank == 0 || args.rank >= args.world {
        bail!(
            "--rank must be between 1 and {} (rank 0 is the process that drives)",
            args.world.saturating_sub(1)
        );
    }
    let ring_timeout = Duration::try_from_secs_f64(args.ring_timeout)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--ring-timeout must be a positive number of seconds")?;
    let (listener, addrs) = if args.ring_from_stdin {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
        println!("listening {}", listener.local_addr()?);
        std::io::stdout().flush()?;
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        let addrs = line
            .trim()
            .split(',')
            .map(str::parse)
            .collect::<Result<Vec<SocketAddr>, _>>()
            .with_context(|| format!("bad ring addresses on stdin: {line:?}"))?;
        (listener, addrs)
    } else {
        let own = args
            .ring
            .get(args.rank)
            .with_context(|| format!("--ring needs {} addresses", args.world))?;
        (
            TcpListener::bind(own).with_context(|| format!("binding {own}"))?,
            args.ring.clone(),
        )
    };
    if addrs.len() != args.world {
        bail!(
            "{} ring addresses for a world of {}",
            addrs.len(),
            args.world
        );
    }
    let security = super::runner::ring_security(args.ring_sealed)?;
    if args.ring_sealed && !security.is_sealed() {
        bail!("--ring-sealed needs the ring's secret in TESSERA_RING_SECRET");
    }
    let ring = TcpRing::join(
        args.rank,
        listener,
        &addrs,
        &args.ring_id,
        &security,
        CONNECT_WAIT,
        ring_timeout,
    )
    .context("joining the ring")?;
    if let Some(iterations) = args.all_reduce_iterations {
        let mut ring = ring;
        let mut data = vec![1.0f32; args.len];
        for _ in 0..iterations {
            ring.all_reduce_sum(&mut data)?;
            data.iter_mut().for_each(|v| *v = 1.0);
        }
        ring.barrier()?;
        return report(args.rank, 0);
    }
    let model = args
        .model
        .as_deref()
        .context("--model is needed unless benchmarking collectives")?;
    let path: PathBuf = resolve_model(model)?;
    let spec = shard_spec(args.sharding, args.rank, args.world, &args.layers, &path)?;
    let transformer = load_transformer(&path, &spec, |_, _| {})
        .with_context(|| format!("rank {}: loading {}", args.rank, path.display()))?;
    let mut executor = Executor::new(&transformer, args.threads.max(1), Box::new(ring));
    RankZero::ready(&mut executor, ring_timeout)?;
    if let Err(error) = executor.serve(None, ring_timeout) {
        // Say why while this rank's connections are still open: rank 0
        // stops every rank as soon as it sees one close, so a message
        // printed after the ring drops (on the way out through `?`) could
        // be cut off, and it is the one naming the rank that failed first.
        eprintln!("error: rank {}: {error}", args.rank);
        std::process::exit(1);
    }
    drop(executor);
    report(args.rank, transformer.weight_bytes() as u64)
}

fn report(rank: usize, weight_bytes: u64) -> anyhow::Result<()> {
    let report = RankReport {
        rank,
        peak_rss_bytes: tessera_engine::memory::peak_rss_bytes().unwrap_or(0),
        weight_bytes,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(spec: &ShardSpec) -> Range<u32> {
        spec.layers(0)
    }

    #[test]
    fn pipeline_splits_by_work_unless_counts_are_given() -> anyhow::Result<()> {
        let even: Vec<Range<u32>> = (0..4)
            .map(|rank| pipeline_spec(rank, 4, &[], 30, 0.0).map(|s| layers(&s)))
            .collect::<Result<_, _>>()?;
        assert_eq!(even, vec![0..8, 8..16, 16..23, 23..30]);
        // SmolLM2-135M's head and sampling are worth 8 layers.
        let weighed = pipeline_spec(1, 2, &[], 30, 8.0)?;
        assert_eq!(layers(&weighed), 11..30);
        let counted = pipeline_spec(1, 2, &[10, 20], 30, 4.0)?;
        assert_eq!(layers(&counted), 10..30);
        Ok(())
    }

    #[test]
    fn impossible_splits_say_why() {
        let error = |r: anyhow::Result<ShardSpec>| r.map_err(|e| e.to_string()).err();
        assert!(error(pipeline_spec(0, 31, &[], 30, 4.0)).is_some_and(|e| e.contains("30 layers")));
        assert!(error(pipeline_spec(0, 2, &[10, 10], 30, 4.0))
            .is_some_and(|e| e.contains("adds up to 20")));
        assert!(
            error(pipeline_spec(0, 2, &[30, 0], 30, 4.0)).is_some_and(|e| e.contains("positive"))
        );
        assert!(error(pipeline_spec(0, 2, &[u32::MAX, 2], 30, 4.0))
            .is_some_and(|e| e.contains("adds up")));
        assert!(error(tensor_spec(0, 4, &[], 3)).is_some_and(|e| e.contains("at most 3 ranks")));
        assert!(error(tensor_spec(0, 2, &[1, 1], 3)).is_some_and(|e| e.contains("--layers")));
    }

    #[test]
    fn tensor_ranks_up_to_the_kv_heads() -> anyhow::Result<()> {
        let spec = tensor_spec(2, 3, &[], 3)?;
        assert_eq!(
            spec,
            ShardSpec::Tensor {
                rank: 2,
                world_size: 3
            }
        );
        Ok(())
    }
}
