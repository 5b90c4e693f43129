//! `tessera bench --concurrency N[,N…]`: continuous batching on the
//! engine, as `llama-batched-bench` measures it. N sequences of
//! `--prompt-tokens` each (different texts, nothing shared from the
//! prefix cache) are prefilled together, then decode `--gen-tokens` each
//! together; reported are the aggregate prefill and decode tokens/s and
//! the decode tokens/s each sequence sees.

use std::ops::ControlFlow;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Serialize;
use tessera_engine::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{GenerateRequest, LoadedModel, Prompt};

use super::stats;

/// What one concurrency level is measured with.
#[derive(Clone, Debug)]
pub struct BatchBench {
    pub concurrency: Vec<usize>,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub runs: usize,
    pub quiet: bool,
}

/// One concurrency level's figures, medians over the runs.
#[derive(Serialize)]
pub struct LevelReport {
    pub sequences: usize,
    pub prefill_tokens_per_second: stats::Spread,
    pub decode_tokens_per_second: stats::Spread,
    pub per_sequence_decode_tokens_per_second: stats::Spread,
    pub kv_cache_mb: f64,
}

/// Seconds of the prefill step(s) and of the decode steps of one run.
struct RunTimes {
    prefill: f64,
    decode: f64,
}

const TEXT: &str = "The history of computing is a story of abstractions layered on top of one another. Early machines were programmed by rewiring panels, later by punched cards, and then by assembly language and compilers. Each layer hid the details of the one below it. ";

/// `n` prompts of `len` tokens that share no leading block.
fn prompts(model: &LoadedModel, n: usize, len: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = TEXT.repeat(len / 40 + 2);
    let base = model.tokenize(&Prompt::Raw(text))?;
    if base.len() < len + n {
        bail!("the prompt text is only {} tokens", base.len());
    }
    // Each sequence starts at its own offset of the text.
    Ok((0..n).map(|i| base[i..i + len].to_vec()).collect())
}

pub fn measure<'m>(
    bench: &BatchBench,
    model: &'m LoadedModel,
    executor: Executor<'m>,
) -> anyhow::Result<(Vec<LevelReport>, Executor<'m>)> {
    let most = bench.concurrency.iter().copied().max().unwrap_or(1);
    let positions = bench.prompt_tokens + bench.gen_tokens;
    let config = BatchConfig {
        max_sequences: most,
        // All prompts in one step, as llama-batched-bench's prefill.
        step_tokens: most * bench.prompt_tokens,
        ..BatchConfig::for_context(most, positions)
    };
    let mut batch = Batch::new(model, executor, config);
    let all = prompts(model, most, bench.prompt_tokens)?;
    // Warm-up, not counted (page faults, the pool's first touch).
    run(&mut batch, &all, bench.gen_tokens.min(8))?;
    let mut reports = Vec::new();
    for &n in &bench.concurrency {
        let (mut prefill, mut decode, mut each) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..bench.runs {
            let times = run(&mut batch, &all[..n], bench.gen_tokens)?;
            let steps = (bench.gen_tokens - 1) as f64;
            prefill.push((n * bench.prompt_tokens) as f64 / times.prefill);
            decode.push(n as f64 * steps / times.decode);
            each.push(steps / times.decode);
            if !bench.quiet {
                eprintln!(
                    "{n} sequences, run {}: prefill {:.1} tok/s, decode {:.1} tok/s in total",
                    r + 1,
                    prefill[r],
                    decode[r]
                );
            }
        }
        reports.push(LevelReport {
            sequences: n,
            prefill_tokens_per_second: stats::Spread::of(&prefill).rounded(2),
            decode_tokens_per_second: stats::Spread::of(&decode).rounded(2),
            per_sequence_decode_tokens_per_second: stats::Spread::of(&each).rounded(2),
            kv_cache_mb: stats::round_to(batch.executor().kv_bytes() as f64 / 1e6, 1),
        });
    }
    Ok((reports, batch.into_executor()))
}

/// Runs every prompt to `gen_tokens` greedy tokens, all at once.
fn run(batch: &mut Batch<'_>, prompts: &[Vec<u32>], gen_tokens: usize) -> anyhow::Result<RunTimes> {
    batch.clear_cache();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut request = GenerateRequest::new(Prompt::Tokens(prompt.clone()));
        request.max_tokens = gen_tokens;
        request.ignore_eos = true;
        request.reuse_prefix = false;
        request.prefill_chunk = prompt.len();
        batch
            .submit(i as SeqId, request)
            .context("queueing a sequence")?;
    }
    let started = Instant::now();
    let mut first_tokens = 0;
    let mut finished = 0;
    let mut prefill = None;
    while finished < prompts.len() {
        let mut failed = None;
        batch.step(&mut |_, event| {
            match event {
                SeqEvent::Generation(tessera_engine::serve::GenerationEvent::Token { .. }) => {
                    first_tokens += 1
                }
                SeqEvent::Finished(_) => finished += 1,
                SeqEvent::Failed(message) => failed = Some(message.to_string()),
                SeqEvent::Generation(_) => {}
            }
            ControlFlow::Continue(())
        })?;
        if let Some(message) = failed {
            bail!("a sequence failed: {message}");
        }
        if prefill.is_none() && first_tokens >= prompts.len() {
            prefill = Some(started.elapsed().as_secs_f64());
        }
    }
    let prefill = prefill.context("no sequence produced a token")?;
    Ok(RunTimes {
        prefill,
        decode: (started.elapsed().as_secs_f64() - prefill).max(f64::EPSILON),
    })
}
