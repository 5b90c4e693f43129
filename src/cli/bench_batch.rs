//! `tessera bench --concurrency N[,N…]`: continuous batching on the
//! engine, as `llama-batched-bench` measures it. N sequences of
//! `--prompt-tokens` each (different texts, nothing shared from the
//! prefix cache) are prefilled together, then decode `--gen-tokens` each
//! together; reported are the aggregate prefill and decode tokens/s and
//! the decode tokens/s each sequence sees. With a JSON Schema, each level
//! also decodes under it, in runs alternating with free decoding, and the
//! ratio of the medians says what the constraint's masks cost.

use std::ops::ControlFlow;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Serialize;
use tessera_engine::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{Constraint, GenerateRequest, LoadedModel, Prompt};

use super::stats;

/// What one concurrency level is measured with.
#[derive(Clone, Debug)]
pub struct BatchBench {
    pub concurrency: Vec<usize>,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub runs: usize,
    pub quiet: bool,
    /// Also decode under this constraint, alternating with free runs.
    pub constraint: Option<Constraint>,
}

/// `--json-schema`'s value: `bench` (the built-in schema), inline JSON,
/// or a file.
pub fn schema_constraint(value: &str) -> anyhow::Result<Constraint> {
    let text = if value == "bench" {
        BENCH_SCHEMA.to_string()
    } else if value.trim_start().starts_with('{') {
        value.to_string()
    } else {
        std::fs::read_to_string(value).with_context(|| format!("reading {value}"))?
    };
    let schema = serde_json::from_str(&text).context("the JSON schema is not JSON")?;
    let constraint = Constraint::JsonSchema(schema);
    tessera_grammar::check(&constraint)?;
    Ok(constraint)
}

/// Records as a structured-output request asks for them: free strings,
/// enums, bounded numbers, nested arrays. At least 100 of them, so that the
/// JSON never completes within a benchmark's tokens.
const BENCH_SCHEMA: &str = r#"{"type": "array", "minItems": 100, "items": {
  "type": "object", "additionalProperties": false,
  "required": ["name", "age", "city", "tags", "score"],
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Tokyo", "Lagos", "Lima"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}
  }}}"#;

/// One concurrency level's figures, medians over the runs.
#[derive(Serialize)]
pub struct LevelReport {
    pub sequences: usize,
    pub prefill_tokens_per_second: stats::Spread,
    pub decode_tokens_per_second: stats::Spread,
    pub per_sequence_decode_tokens_per_second: stats::Spread,
    pub kv_cache_mb: f64,
    /// The same level decoding under the JSON Schema, when one was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub constrained: Option<ConstrainedReport>,
}

/// Decoding under a constraint, against the free runs of the same level.
#[derive(Serialize)]
pub struct ConstrainedReport {
    pub decode_tokens_per_second: stats::Spread,
    pub per_sequence_decode_tokens_per_second: stats::Spread,
    /// Median constrained decode tokens/s over median free.
    pub ratio_to_free: f64,
    /// Tokens each sequence decoded, on median (fewer than `gen_tokens`
    /// when the JSON completed first).
    pub tokens_per_sequence: f64,
}

/// Seconds of the prefill step(s) and of the decode steps of one run, and
/// the tokens decoded after each sequence's first.
struct RunTimes {
    prefill: f64,
    decode: f64,
    decoded: usize,
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
    // Warm-up, not counted (page faults, the pool's first touch, the
    // grammar's vocabulary).
    run(
        &mut batch,
        &all,
        bench.gen_tokens.min(8),
        bench.constraint.as_ref(),
    )?;
    let mut reports = Vec::new();
    for &n in &bench.concurrency {
        let mut free = Figures::default();
        let mut constrained = Figures::default();
        for r in 0..bench.runs {
            let times = run(&mut batch, &all[..n], bench.gen_tokens, None)?;
            free.add(n * bench.prompt_tokens, n, &times);
            if !bench.quiet {
                eprintln!(
                    "{n} sequences, run {}: prefill {:.1} tok/s, decode {:.1} tok/s in total",
                    r + 1,
                    free.prefill[r],
                    free.decode[r]
                );
            }
            if let Some(constraint) = &bench.constraint {
                let times = run(&mut batch, &all[..n], bench.gen_tokens, Some(constraint))?;
                constrained.add(n * bench.prompt_tokens, n, &times);
                if !bench.quiet {
                    eprintln!(
                        "{n} sequences, run {}, under the schema: decode {:.1} tok/s in total",
                        r + 1,
                        constrained.decode[r]
                    );
                }
            }
        }
        let decode = stats::Spread::of(&free.decode).rounded(2);
        let constrained = bench.constraint.as_ref().map(|_| {
            let spread = stats::Spread::of(&constrained.decode).rounded(2);
            ConstrainedReport {
                ratio_to_free: stats::round_to(spread.median / decode.median, 3),
                decode_tokens_per_second: spread,
                per_sequence_decode_tokens_per_second: stats::Spread::of(&constrained.each)
                    .rounded(2),
                tokens_per_sequence: stats::Spread::of(&constrained.tokens).median,
            }
        });
        reports.push(LevelReport {
            sequences: n,
            prefill_tokens_per_second: stats::Spread::of(&free.prefill).rounded(2),
            decode_tokens_per_second: decode,
            per_sequence_decode_tokens_per_second: stats::Spread::of(&free.each).rounded(2),
            kv_cache_mb: stats::round_to(batch.executor().kv_bytes() as f64 / 1e6, 1),
            constrained,
        });
    }
    Ok((reports, batch.into_executor()))
}

/// One level's runs: aggregate prefill and decode tokens/s, decode
/// tokens/s of each sequence, tokens each decoded.
#[derive(Default)]
struct Figures {
    prefill: Vec<f64>,
    decode: Vec<f64>,
    each: Vec<f64>,
    tokens: Vec<f64>,
}

impl Figures {
    fn add(&mut self, prompt_tokens: usize, sequences: usize, times: &RunTimes) {
        self.prefill.push(prompt_tokens as f64 / times.prefill);
        self.decode.push(times.decoded as f64 / times.decode);
        let per_sequence = times.decoded as f64 / sequences as f64;
        self.each.push(per_sequence / times.decode);
        self.tokens.push(per_sequence);
    }
}

/// Runs every prompt to `gen_tokens` greedy tokens (or until `constraint`
/// is complete), all at once.
fn run(
    batch: &mut Batch<'_>,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
    constraint: Option<&Constraint>,
) -> anyhow::Result<RunTimes> {
    batch.clear_cache();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut request = GenerateRequest::new(Prompt::Tokens(prompt.clone()));
        request.max_tokens = gen_tokens;
        request.ignore_eos = true;
        request.reuse_prefix = false;
        request.prefill_chunk = prompt.len();
        request.constraint = constraint.cloned();
        batch
            .submit(i as SeqId, request)
            .context("queueing a sequence")?;
    }
    let started = Instant::now();
    let mut first_tokens = 0;
    let mut decoded = 0;
    let mut finished = 0;
    let mut prefill = None;
    while finished < prompts.len() {
        let mut failed = None;
        batch.step(&mut |_, event| {
            match event {
                SeqEvent::Generation(tessera_engine::serve::GenerationEvent::Token { .. }) => {
                    first_tokens += 1
                }
                SeqEvent::Finished(output) => {
                    finished += 1;
                    decoded += output.tokens.len().saturating_sub(1);
                }
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
        decoded,
    })
}
