//! `tessera bench` (model): decode and prefill speed, time to first token
//! and peak memory of the engine on this machine, as llama.cpp's reference
//! benchmark measures them (../shared/refbench/bench_llamacpp.py): 128
//! greedy tokens after "The quick brown fox" with end-of-sequence ignored,
//! and one 512-token prompt in a single batch.

use std::ops::ControlFlow;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{GenerateRequest, LoadedModel, Prompt, Session};

use super::bench_batch;
use super::bench_speculative;
use super::generate::Distributed;
use super::model_args::ModelArgs;
use super::ranks::{DistributedArgs, RankZero};
use super::stats;

#[derive(Debug, Args)]
pub struct ModelBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub dist: DistributedArgs,
    /// Timed repetitions of each measurement (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Tokens generated in the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub n_gen: usize,
    /// Prompt tokens in the prefill measurement (prefilled in the engine's
    /// default chunks, as a request is).
    #[arg(long, default_value_t = 512)]
    pub n_prefill: usize,
    /// Print JSON only.
    #[arg(long)]
    pub json: bool,
    /// Continuous batching instead: N sequences at once, prefilled then
    /// decoded together (several levels: `1,2,4,8,16`), as
    /// llama-batched-bench measures them.
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Prompt tokens of each sequence, with --concurrency.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens each sequence generates, with --concurrency (and the most
    /// each prompt generates, with --speculative).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Speculative decoding against plain decoding in one run: `ngram`
    /// (prompt lookup), a draft model (a .gguf, a folder or a catalogue
    /// id), or `first-layers:N` (a draft of this model's first N layers,
    /// written once as a GGUF in the temp folder).
    #[arg(long)]
    pub speculative: Option<String>,
    /// With --concurrency: each level also decodes under a JSON Schema, in
    /// runs alternating with free decoding, and reports the ratio. `bench`
    /// is the built-in schema (an array of at least 100 records with
    /// strings, enums, numbers and nested arrays: it never completes within
    /// the tokens, so both sides decode as many); else inline JSON or a
    /// file.
    #[arg(long)]
    pub json_schema: Option<String>,
    /// Tokens drafted per step at most, with --speculative.
    #[arg(long, default_value_t = tessera_engine::serve::speculative::DEFAULT_DRAFT_TOKENS)]
    pub draft_tokens: usize,
    /// What the --speculative run asks the model.
    #[arg(long, value_enum, default_value = "free")]
    pub workload: bench_speculative::Workload,
    /// With --speculative: always draft --draft-tokens (as many as prompt
    /// lookup finds), to measure a draft's acceptance and cost without the
    /// adaptive length switching it off.
    #[arg(long)]
    pub draft_fixed: bool,
    /// With --speculative: the user messages to ask instead of the
    /// workload's own, as a JSON list of strings.
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
}

/// A measurement's runs and their spread, to two decimals.
#[derive(Serialize)]
struct Spread {
    #[serde(flatten)]
    spread: stats::Spread,
    runs: Vec<f64>,
}

fn spread(runs: Vec<f64>) -> Spread {
    Spread {
        spread: stats::Spread::of(&runs).rounded(2),
        runs: runs.into_iter().map(|v| stats::round_to(v, 2)).collect(),
    }
}

#[derive(Serialize)]
struct Report {
    bench: &'static str,
    model: String,
    /// Where it ran: cpu, or the GPU adapter.
    device: String,
    threads: usize,
    runs: usize,
    n_gen: usize,
    n_prefill: usize,
    decode_tokens_per_second: Spread,
    prefill_tokens_per_second: Spread,
    time_to_first_token_ms: Spread,
    peak_rss_mb: f64,
    weights_mb: f64,
    /// The decode figure next to its physical limit, where the CPU runs
    /// the whole model.
    #[serde(skip_serializing_if = "Option::is_none")]
    bandwidth: Option<Bandwidth>,
    decode_tokens: Vec<u32>,
    decode_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    distributed: Option<Distributed>,
}

/// What a decoded token reads, and how fast memory gives it.
#[derive(Serialize)]
struct Bandwidth {
    /// Bytes of weights a decoded token reads
    /// (`Transformer::decode_bytes_per_token`).
    decode_bytes_per_token: u64,
    /// Those bytes at the median decode speed.
    decode_gb_per_second: f64,
    /// The memory read bandwidth of as many threads
    /// (`memory::read_bandwidth`).
    read_gb_per_second: f64,
    /// The decode speed that bandwidth allows.
    limit_tokens_per_second: f64,
    /// The median decode speed's share of that limit (above 1 where the
    /// weights fit in the CPU's caches).
    share_of_limit: f64,
}

impl Bandwidth {
    /// Measures the read bandwidth of `threads` threads; call it after the
    /// peak RSS is read (it allocates 512 MiB).
    fn measure(bytes_per_token: usize, decode_tokens_per_second: f64, threads: usize) -> Self {
        let pool = tessera_engine::threadpool::ThreadPool::new(threads);
        let read = tessera_engine::memory::read_bandwidth(&pool);
        let bytes = bytes_per_token as f64;
        let limit = read / bytes.max(1.0);
        Self {
            decode_bytes_per_token: bytes_per_token as u64,
            decode_gb_per_second: stats::round_to(bytes * decode_tokens_per_second / 1e9, 2),
            read_gb_per_second: stats::round_to(read / 1e9, 2),
            limit_tokens_per_second: stats::round_to(limit, 2),
            share_of_limit: stats::round_to(decode_tokens_per_second / limit, 3),
        }
    }
}

#[derive(Serialize)]
struct BatchReport {
    bench: &'static str,
    model: String,
    /// Where it ran: cpu, or the GPU adapter.
    device: String,
    threads: usize,
    runs: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    levels: Vec<bench_batch::LevelReport>,
    peak_rss_mb: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    distributed: Option<Distributed>,
}

#[derive(Serialize)]
struct SpecBenchReport {
    bench: &'static str,
    model: String,
    /// Where it ran: cpu, or the GPU adapter.
    device: String,
    threads: usize,
    runs: usize,
    gen_tokens: usize,
    #[serde(flatten)]
    speculative: bench_speculative::SpecReport,
    peak_rss_mb: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    distributed: Option<Distributed>,
}

const SHORT_PROMPT: &str = "The quick brown fox";
/// The reference benchmark's prompt text, repeated and cut to `n_prefill` tokens.
const PREFILL_TEXT: &str = "The history of computing is a story of abstractions layered on top of one another. Early machines were programmed by rewiring panels, later by punched cards, and then by assembly language and compilers. Each layer hid the details of the one below it. ";

pub fn run(args: ModelBenchArgs) -> anyhow::Result<()> {
    if args.runs == 0 || args.n_gen < 2 || args.n_prefill == 0 {
        bail!("--runs and --n-prefill must be at least 1, --n-gen at least 2");
    }
    if args.concurrency.contains(&0) || (!args.concurrency.is_empty() && args.gen_tokens < 2) {
        bail!("--concurrency levels must be at least 1, --gen-tokens at least 2");
    }
    if args.json_schema.is_some() && args.concurrency.is_empty() {
        bail!("--json-schema is measured with --concurrency (e.g. --concurrency 1,8)");
    }
    if !args.dist.is_distributed() {
        let model = args.model.load(args.json)?;
        let threads = args.model.threads();
        let executor = Executor::single(&model.transformer, threads);
        return dispatch(&args, &model, executor, threads, |_| Ok(None));
    }
    let threads = args.model.rank_threads();
    let RankZero {
        ranks,
        ring,
        spec,
        ring_timeout,
    } = RankZero::start(&args.dist, &args.model.model, threads, args.json)?;
    let model = args.model.load_shard(Some(&spec), args.json)?;
    let mut executor = Executor::new(&model.transformer, threads, Box::new(ring));
    RankZero::ready(&mut executor, ring_timeout)?;
    let weights = model.transformer.weight_bytes();
    let dist = args.dist.clone();
    let mut ranks = Some(ranks);
    dispatch(&args, &model, executor, threads, move |executor| {
        executor.shutdown()?;
        let reports = ranks.take().context("ranks")?.finish()?;
        Ok(Some(Distributed::new(&dist, threads, weights, reports)))
    })
}

/// The single-sequence benchmark, or the batched one with --concurrency.
fn dispatch<'m>(
    args: &ModelBenchArgs,
    model: &'m LoadedModel,
    executor: Executor<'m>,
    threads: usize,
    finish: impl FnOnce(&mut Executor<'m>) -> anyhow::Result<Option<Distributed>>,
) -> anyhow::Result<()> {
    if let Some(source) = &args.speculative {
        let bench = bench_speculative::SpecBench {
            source: source.clone(),
            draft_tokens: args.draft_tokens,
            workload: args.workload,
            runs: args.runs,
            gen_tokens: args.gen_tokens,
            prompts: args.prompts.clone(),
            fixed: args.draft_fixed,
            quiet: args.json,
        };
        let (speculative, mut executor) = bench_speculative::measure(&bench, model, executor)?;
        let distributed = finish(&mut executor)?;
        let report = SpecBenchReport {
            bench: "speculative",
            model: model.path.display().to_string(),
            device: model.transformer.device_name(),
            threads,
            runs: args.runs,
            gen_tokens: args.gen_tokens,
            speculative,
            peak_rss_mb: tessera_engine::memory::peak_rss_bytes().unwrap_or(0) as f64 / 1e6,
            distributed,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if args.concurrency.is_empty() {
        let session = Session::with_executor(model, executor);
        return measure(args, model, session, threads, |session| {
            finish(session.executor())
        });
    }
    let bench = bench_batch::BatchBench {
        concurrency: args.concurrency.clone(),
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        runs: args.runs,
        quiet: args.json,
        constraint: args
            .json_schema
            .as_deref()
            .map(bench_batch::schema_constraint)
            .transpose()?,
    };
    let (levels, mut executor) = bench_batch::measure(&bench, model, executor)?;
    let distributed = finish(&mut executor)?;
    let report = BatchReport {
        bench: "batch",
        model: model.path.display().to_string(),
        device: model.transformer.device_name(),
        threads,
        runs: args.runs,
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        levels,
        peak_rss_mb: tessera_engine::memory::peak_rss_bytes().unwrap_or(0) as f64 / 1e6,
        distributed,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Runs the measurements; `finish` ends a distributed run and reports its
/// ranks before the report is printed.
fn measure<'m>(
    args: &ModelBenchArgs,
    model: &LoadedModel,
    mut session: Session<'m>,
    threads: usize,
    finish: impl FnOnce(&mut Session<'m>) -> anyhow::Result<Option<Distributed>>,
) -> anyhow::Result<()> {
    let mut decode = GenerateRequest::new(Prompt::Raw(SHORT_PROMPT.into()));
    decode.max_tokens = args.n_gen;
    decode.ignore_eos = true;
    decode.reuse_prefix = false;

    let text = PREFILL_TEXT.repeat(args.n_prefill / 40 + 2);
    let mut prefill_tokens = model.tokenize(&Prompt::Raw(text))?;
    if prefill_tokens.len() < args.n_prefill {
        bail!("the prefill text is only {} tokens", prefill_tokens.len());
    }
    prefill_tokens.truncate(args.n_prefill);
    let mut prefill = GenerateRequest::new(Prompt::Tokens(prefill_tokens));
    prefill.max_tokens = 1;
    prefill.reuse_prefix = false;

    let quiet = args.json;
    let mut measure = |request: &GenerateRequest| {
        session.reset();
        session
            .generate(request, |_| ControlFlow::Continue(()))
            .context("benchmark generation")
    };
    // Warm-up, not counted (page faults, caches).
    let mut short = decode.clone();
    short.max_tokens = 16;
    measure(&short)?;
    measure(&prefill)?;

    let (mut decode_tps, mut ttft, mut prefill_tps) = (Vec::new(), Vec::new(), Vec::new());
    let mut tokens = Vec::new();
    let mut decode_text = String::new();
    for run in 0..args.runs {
        let out = measure(&decode)?;
        decode_tps.push(out.stats.decode_tokens_per_second);
        ttft.push(out.stats.time_to_first_token_seconds * 1000.0);
        if run == 0 {
            tokens = out.tokens.clone();
            decode_text = out.text.clone();
        } else if out.tokens != tokens {
            bail!("greedy decoding gave different tokens in run {run}: nondeterminism");
        }
        let out = measure(&prefill)?;
        prefill_tps.push(out.stats.prefill_tokens_per_second);
        if !quiet {
            eprintln!(
                "run {}: decode {:.1} tok/s, prefill {:.1} tok/s",
                run + 1,
                decode_tps[run],
                prefill_tps[run]
            );
        }
    }
    let distributed = finish(&mut session)?;
    let peak_rss = tessera_engine::memory::peak_rss_bytes().unwrap_or(0);
    let decode_tokens_per_second = spread(decode_tps);
    let whole_on_cpu = distributed.is_none() && model.transformer.gpu().is_none();
    let bandwidth = whole_on_cpu.then(|| {
        Bandwidth::measure(
            model.transformer.decode_bytes_per_token(),
            decode_tokens_per_second.spread.median,
            threads,
        )
    });
    let report = Report {
        bench: "model",
        model: model.path.display().to_string(),
        device: model.transformer.device_name(),
        threads,
        runs: args.runs,
        n_gen: args.n_gen,
        n_prefill: args.n_prefill,
        decode_tokens_per_second,
        prefill_tokens_per_second: spread(prefill_tps),
        time_to_first_token_ms: spread(ttft),
        peak_rss_mb: peak_rss as f64 / 1e6,
        weights_mb: model.transformer.weight_bytes() as f64 / 1e6,
        bandwidth,
        decode_tokens: tokens,
        decode_text,
        distributed,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
