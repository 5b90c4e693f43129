//! `tessera bench --speculative ngram|MODEL|first-layers:N`: decode speed
//! with and without speculative decoding in one run, on the same prompts,
//! alternating which goes first, with the tokens checked identical.
//!
//! Workloads: `echo` asks the model to repeat or lightly edit a passage or
//! a code block (what prompt lookup exists for: the answer quotes the
//! prompt); `free` asks open questions (drafts rarely agree, so adaptive
//! draft lengths must keep speculation from costing anything).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use serde::Serialize;
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::speculative::{
    check_draft_vocabulary, DraftSource, Speculation, MAX_DRAFT_TOKENS,
};
use tessera_engine::serve::{GenerateRequest, GenerationOutput, LoadedModel, Prompt, Session};
use tessera_engine::text::chat_template::ChatMessage;

use super::model_args::resolve_model;
use super::stats;

/// What the speculative benchmark asks the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Open questions and stories.
    Free,
    /// Repeat or lightly edit a given passage or code block.
    Echo,
}

pub struct SpecBench {
    pub source: String,
    pub draft_tokens: usize,
    pub workload: Workload,
    pub runs: usize,
    pub gen_tokens: usize,
    /// User messages to ask instead of the workload's own (a JSON list of
    /// strings).
    pub prompts: Option<PathBuf>,
    /// Draft the most every step (no adaptive length).
    pub fixed: bool,
    pub quiet: bool,
}

// Echo passages: text a 135M model copies when asked (it paraphrases some
// others, which are then the free case, not this one).
const LOG_PASSAGE: &str = "The cluster keeps one ordered log of events. Every node folds the log into the same state, and the master alone decides what comes next. When the master goes away, the others elect a new one and carry on from the last event they all agree on.";

const LIGHTHOUSE: &str = "The lighthouse stood at the end of the harbour wall. Every evening the keeper climbed its hundred steps, lit the lamp, and wrote the weather in a small blue book. Ships passed in the night and never knew his name.";

const MISSPELT: &str = "The lighthouse stood at the end of the harbour wal. Every evening the keeper climbed its hundred steps, lit the lamp, and wrote the wether in a small blue book.";

const CODE: &str = "def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"\n    if width < 0 or height < 0:\n        raise ValueError(\"negative size\")\n    return width * height\n";

fn chat(text: String) -> Prompt {
    Prompt::Chat {
        messages: vec![ChatMessage::new("user", &text)],
        tools: None,
    }
}

/// The workload's requests, greedy, `tokens` each at most.
fn requests(workload: Workload, tokens: usize, own: Option<Vec<String>>) -> Vec<GenerateRequest> {
    let prompts = match workload {
        _ if own.is_some() => own.unwrap_or_default(),
        Workload::Echo => vec![
            format!("Repeat this text exactly:\n\n{LOG_PASSAGE}"),
            format!("Repeat this text exactly:\n\n{LIGHTHOUSE}"),
            format!("Repeat this code exactly:\n\n```python\n{CODE}```"),
            format!("Fix the spelling in this text:\n\n{MISSPELT}"),
            format!("Repeat this text exactly:\n\n{LOG_PASSAGE} {LIGHTHOUSE}"),
        ],
        Workload::Free => vec![
            "Write a short story about a lighthouse keeper.".to_string(),
            "Explain how a compiler turns source code into a program.".to_string(),
            "What are the benefits of regular exercise?".to_string(),
        ],
    };
    prompts
        .into_iter()
        .map(|text| {
            let mut request = GenerateRequest::new(chat(text));
            request.max_tokens = tokens;
            request.reuse_prefix = false;
            // Free text runs its full length; an echo ends with its copy.
            request.ignore_eos = workload == Workload::Free;
            request
        })
        .collect()
}

#[derive(Serialize)]
pub struct SpecReport {
    pub draft: String,
    pub draft_tokens: usize,
    /// Drafting the most every step, not adaptively.
    pub draft_fixed: bool,
    pub workload: Workload,
    /// Decode tokens/s over all prompts of a run, per run.
    pub plain_decode_tokens_per_second: stats::Spread,
    pub speculative_decode_tokens_per_second: stats::Spread,
    /// Median speculative over median plain.
    pub speedup: f64,
    /// Drafted tokens the target accepted.
    pub acceptance_rate: f64,
    /// Decode tokens per target forward step (1 without speculation).
    pub tokens_per_target_step: f64,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    /// Tokens generated per run, over all prompts.
    pub generated_tokens: usize,
    pub outputs_identical: bool,
    /// What a target step costs here, as the adaptive draft length measured
    /// it: seconds fixed and per token.
    pub step_seconds_fixed: f64,
    pub step_seconds_per_token: f64,
    /// Each prompt's share, from the last speculative run.
    pub prompts: Vec<PromptReport>,
}

#[derive(Serialize)]
pub struct PromptReport {
    pub generated_tokens: usize,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub target_steps: usize,
    /// The answer's start, to see what the workload made the model do.
    pub text: String,
}

impl PromptReport {
    fn of(out: &GenerationOutput) -> Self {
        let stats = &out.stats;
        Self {
            generated_tokens: stats.generated_tokens,
            drafted_tokens: stats.draft_tokens,
            accepted_tokens: stats.accepted_draft_tokens,
            target_steps: stats.decode_steps,
            text: out.text.chars().take(160).collect(),
        }
    }
}

/// Sums over one run's prompts.
#[derive(Default)]
struct Totals {
    tokens: usize,
    seconds: f64,
    drafted: usize,
    accepted: usize,
    steps: usize,
}

impl Totals {
    fn add(&mut self, out: &GenerationOutput) {
        let stats = &out.stats;
        let decoded = stats.generated_tokens.saturating_sub(1);
        if stats.decode_tokens_per_second > 0.0 {
            self.seconds += decoded as f64 / stats.decode_tokens_per_second;
        }
        self.tokens += decoded;
        self.drafted += stats.draft_tokens;
        self.accepted += stats.accepted_draft_tokens;
        self.steps += stats.decode_steps;
    }

    fn per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// The draft `source` names: prompt lookup, a draft of this model's first
/// layers (written once as a GGUF in the temp folder), or a model.
fn speculation(source: &str, tokens: usize, target: &LoadedModel) -> anyhow::Result<Speculation> {
    let draft_source = if source == "ngram" {
        DraftSource::Ngram
    } else {
        let path = match source.strip_prefix("first-layers:") {
            Some(layers) => {
                let layers: usize = layers
                    .parse()
                    .with_context(|| format!("--speculative {source}: a number of layers"))?;
                first_layers_draft(&target.path, layers)?
            }
            None => resolve_model(source)?,
        };
        let draft = LoadedModel::load(&path, |_, _| {})
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        check_draft_vocabulary(target, &draft)?;
        DraftSource::Model(Arc::new(draft))
    };
    Ok(Speculation::new(draft_source, tokens))
}

/// `model`'s first `layers` layers and head as a GGUF, made once.
fn first_layers_draft(model: &Path, layers: usize) -> anyhow::Result<PathBuf> {
    if model.is_dir() {
        bail!(
            "first-layers drafts are made from GGUF files; {} is a folder",
            model.display()
        );
    }
    let stem = model
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy());
    let path = std::env::temp_dir().join(format!("tessera-draft-{stem}-first-{layers}.gguf"));
    if !path.exists() {
        let partial = path.with_extension("gguf.partial");
        tessera_engine::formats::gguf::write_first_layers(model, &partial, layers)?;
        std::fs::rename(&partial, &path)?;
    }
    Ok(path)
}

/// The prompts of `--prompts` (a JSON list of strings), if given.
fn own_prompts(path: Option<&std::path::Path>) -> anyhow::Result<Option<Vec<String>>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let prompts: Vec<String> = serde_json::from_str(&text)
        .with_context(|| format!("{}: a JSON list of strings", path.display()))?;
    if prompts.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(Some(prompts))
}

pub fn measure<'m>(
    bench: &SpecBench,
    model: &'m LoadedModel,
    executor: Executor<'m>,
) -> anyhow::Result<(SpecReport, Executor<'m>)> {
    if bench.draft_tokens == 0 || bench.draft_tokens > MAX_DRAFT_TOKENS {
        bail!("--draft-tokens must be 1..={MAX_DRAFT_TOKENS}");
    }
    let speculation = Speculation {
        fixed: bench.fixed,
        ..speculation(&bench.source, bench.draft_tokens, model)?
    };
    let draft = format!("{:?}", speculation.source);
    let own = own_prompts(bench.prompts.as_deref())?;
    let requests = requests(bench.workload, bench.gen_tokens, own);
    let mut session = Session::with_executor(model, executor);
    let run =
        |session: &mut Session<'m>, speculate: bool| -> anyhow::Result<Vec<GenerationOutput>> {
            session.set_speculation(speculate.then(|| speculation.clone()));
            requests
                .iter()
                .map(|request| {
                    session.reset();
                    session
                        .generate(request, |_| ControlFlow::Continue(()))
                        .context("benchmark generation")
                })
                .collect()
        };
    // Warm-up, not counted.
    run(&mut session, false)?;
    let mut reference = run(&mut session, true)?;
    let (mut plain, mut speculative) = (Vec::new(), Vec::new());
    let mut last = Totals::default();
    let mut prompts = Vec::new();
    let mut cost = (0.0, 0.0);
    for round in 0..bench.runs {
        // Alternate which goes first, so drift favours neither.
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for speculate in order {
            let outputs = run(&mut session, speculate)?;
            for (out, want) in outputs.iter().zip(&reference) {
                if out.tokens != want.tokens {
                    bail!("speculation changed the output (round {round}): a bug");
                }
            }
            let mut totals = Totals::default();
            outputs.iter().for_each(|out| totals.add(out));
            if speculate {
                cost = session.step_cost().unwrap_or_default();
                speculative.push(totals.per_second());
                last = totals;
                prompts = outputs.iter().map(PromptReport::of).collect();
            } else {
                plain.push(totals.per_second());
            }
        }
        if !bench.quiet {
            eprintln!(
                "run {}: plain {:.1} tok/s, speculative {:.1} tok/s",
                round + 1,
                plain[round],
                speculative[round]
            );
        }
    }
    reference.clear();
    let plain_spread = stats::Spread::of(&plain).rounded(2);
    let spec_spread = stats::Spread::of(&speculative).rounded(2);
    let ratio = |a: usize, b: usize| if b > 0 { a as f64 / b as f64 } else { 0.0 };
    let report = SpecReport {
        draft,
        draft_tokens: bench.draft_tokens,
        draft_fixed: bench.fixed,
        workload: bench.workload,
        speedup: stats::round_to(
            stats::median(&speculative) / stats::median(&plain).max(f64::MIN_POSITIVE),
            3,
        ),
        plain_decode_tokens_per_second: plain_spread,
        speculative_decode_tokens_per_second: spec_spread,
        acceptance_rate: stats::round_to(ratio(last.accepted, last.drafted), 3),
        tokens_per_target_step: stats::round_to(ratio(last.tokens, last.steps), 3),
        drafted_tokens: last.drafted,
        accepted_tokens: last.accepted,
        generated_tokens: last.tokens + requests.len(),
        outputs_identical: true,
        step_seconds_fixed: stats::round_to(cost.0, 5),
        step_seconds_per_token: stats::round_to(cost.1, 5),
        prompts,
    };
    Ok((report, session.into_executor()))
}
