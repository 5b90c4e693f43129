//! `tessera generate`: one prompt through the engine, on this machine or
//! split over local rank processes (`--world N --sharding ...`).

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use tessera_actors::runner::request::{constraint_from, request_for};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{
    GenerateRequest, GenerationEvent, GenerationOutput, GenerationStats, Prompt, Session,
};
use tessera_engine::text::chat_template::ChatMessage;
use tessera_engine::text::output_parser::ParsedChunk;
use tessera_protos::v1;

use super::model_args::ModelArgs;
use super::ranks::{DistributedArgs, RankReport, RankZero, Sharding};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub dist: DistributedArgs,
    /// Raw text, fed without a chat template.
    #[arg(long, group = "input")]
    pub prompt: Option<String>,
    /// One user message, rendered with the model's chat template.
    #[arg(long, group = "input")]
    pub chat: Option<String>,
    /// A JSON file with a list of {"role", "content"} messages (templated).
    #[arg(long, group = "input")]
    pub messages: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 is off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// A stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// With --json: each token's logprob and its N best alternatives (0-20).
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// The output is JSON valid under this JSON Schema (inline JSON, or a
    /// file holding it).
    #[arg(long, group = "constraint")]
    pub json_schema: Option<String>,
    /// The output matches this regular expression, whole.
    #[arg(long, group = "constraint")]
    pub regex: Option<String>,
    /// The output is text of the grammar in this file (llguidance's Lark
    /// syntax).
    #[arg(long, group = "constraint")]
    pub grammar: Option<PathBuf>,
    /// Print one JSON object: prompt and generated token ids, text, stats.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct JsonOutput<'a> {
    model: String,
    /// Where it ran: cpu, or the GPU adapter.
    device: String,
    prompt_token_ids: &'a [u32],
    generated_token_ids: &'a [u32],
    text: &'a str,
    reasoning: String,
    tool_calls: Vec<serde_json::Value>,
    finish_reason: tessera_engine::serve::FinishReason,
    #[serde(skip_serializing_if = "no_logprobs")]
    logprobs: &'a [tessera_engine::serve::TokenLogprob],
    stats: &'a GenerationStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    distributed: Option<Distributed>,
}

/// How a distributed run was split, and each rank's memory.
#[derive(Serialize)]
pub struct Distributed {
    pub world: usize,
    pub sharding: Sharding,
    pub threads_per_rank: usize,
    pub ranks: Vec<RankReport>,
}

impl Distributed {
    /// Rank 0's own report first, then the children's.
    pub fn new(
        dist: &DistributedArgs,
        threads_per_rank: usize,
        rank0_weights: usize,
        children: Vec<RankReport>,
    ) -> Self {
        let mut ranks = vec![RankReport {
            rank: 0,
            peak_rss_bytes: tessera_engine::memory::peak_rss_bytes().unwrap_or(0),
            weight_bytes: rank0_weights as u64,
        }];
        ranks.extend(children);
        Self {
            world: dist.world,
            sharding: dist.sharding,
            threads_per_rank,
            ranks,
        }
    }
}

fn no_logprobs(logprobs: &&[tessera_engine::serve::TokenLogprob]) -> bool {
    logprobs.is_empty()
}

pub fn request_from(args: &GenerateArgs) -> anyhow::Result<GenerateRequest> {
    let prompt = match (&args.prompt, &args.chat, &args.messages) {
        (Some(text), _, _) => Prompt::Raw(text.clone()),
        (_, Some(text), _) => Prompt::Chat {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: text.clone(),
                tool_calls: None,
                tool_call_id: None,
                name: None,
            }],
            tools: None,
        },
        (_, _, Some(path)) => {
            let raw = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let messages: Vec<ChatMessage> = serde_json::from_str(&raw).with_context(|| {
                format!(
                    "{}: expected a JSON list of {{\"role\", \"content\"}} objects",
                    path.display()
                )
            })?;
            Prompt::Chat {
                messages,
                tools: None,
            }
        }
        _ => bail!("give the input with --prompt TEXT, --chat TEXT or --messages FILE"),
    };
    let sampling = v1::SamplingParams {
        temperature: Some(args.temperature),
        top_p: Some(args.top_p),
        top_k: Some(u32::try_from(args.top_k).context("--top-k is too large")?),
        min_p: Some(args.min_p),
        repetition_penalty: Some(args.repetition_penalty),
        seed: args.seed,
        max_tokens: Some(u32::try_from(args.max_tokens).context("--max-tokens is too large")?),
        stop: args.stop.clone(),
        logprobs: args.logprobs.is_some(),
        top_logprobs: u32::try_from(args.logprobs.unwrap_or(0))
            .context("--logprobs is too large")?,
        ..Default::default()
    };
    let mut request = request_for(prompt, &sampling)?;
    request.ignore_eos = args.ignore_eos;
    request.constraint = constraint_from(constraint_of(args)?.as_ref())?;
    Ok(request)
}

/// The wire's constraint for `--json-schema`, `--regex` or `--grammar`.
fn constraint_of(args: &GenerateArgs) -> anyhow::Result<Option<v1::OutputConstraint>> {
    use v1::output_constraint::Kind;
    let kind = if let Some(schema) = &args.json_schema {
        let text = if schema.trim_start().starts_with('{') {
            schema.clone()
        } else {
            std::fs::read_to_string(schema).with_context(|| format!("reading {schema}"))?
        };
        Kind::JsonSchema(text)
    } else if let Some(regex) = &args.regex {
        Kind::Regex(regex.clone())
    } else if let Some(path) = &args.grammar {
        Kind::Lark(
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        )
    } else {
        return Ok(None);
    };
    Ok(Some(v1::OutputConstraint { kind: Some(kind) }))
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let request = request_from(&args)?;
    if !args.dist.is_distributed() {
        let model = args.model.load(args.json)?;
        let session = Session::new(&model, args.model.threads());
        let output = generate(session, &request, args.json)?;
        return print(&args, &model, &output, None);
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
    let mut session = Session::with_executor(&model, executor);
    let output = generate_with(&mut session, &request, args.json)?;
    session.executor().shutdown()?;
    drop(session);
    let reports = ranks.finish()?;
    let distributed = Distributed::new(
        &args.dist,
        threads,
        model.transformer.weight_bytes(),
        reports,
    );
    print(&args, &model, &output, Some(distributed))
}

fn generate(
    mut session: Session<'_>,
    request: &GenerateRequest,
    json: bool,
) -> anyhow::Result<GenerationOutput> {
    generate_with(&mut session, request, json)
}

/// Runs the request, streaming the text to stdout unless `json`.
fn generate_with(
    session: &mut Session<'_>,
    request: &GenerateRequest,
    json: bool,
) -> anyhow::Result<GenerationOutput> {
    let mut stdout = std::io::stdout().lock();
    let output = session.generate(request, |event| {
        if !json {
            if let GenerationEvent::Token { text, .. } = event {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
        }
        ControlFlow::Continue(())
    })?;
    Ok(output)
}

fn print(
    args: &GenerateArgs,
    model: &tessera_engine::serve::LoadedModel,
    output: &GenerationOutput,
    distributed: Option<Distributed>,
) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let mut reasoning = String::new();
        let mut tool_calls = Vec::new();
        for chunk in &output.chunks {
            match chunk {
                ParsedChunk::Reasoning(r) => reasoning.push_str(r),
                ParsedChunk::ToolCall(call) => tool_calls.push(serde_json::to_value(call)?),
                _ => {}
            }
        }
        let json = JsonOutput {
            model: model.path.display().to_string(),
            device: model.transformer.device_name(),
            prompt_token_ids: &output.prompt_tokens,
            generated_token_ids: &output.tokens,
            text: &output.text,
            reasoning,
            tool_calls,
            finish_reason: output.finish_reason,
            logprobs: &output.logprobs,
            stats: &output.stats,
            distributed,
        };
        serde_json::to_writer_pretty(&mut stdout, &json)?;
        writeln!(stdout)?;
    } else {
        writeln!(stdout)?;
        let s = &output.stats;
        eprintln!(
            "[{} prompt tokens, {} generated ({:?}); prefill {:.1} tok/s, decode {:.1} tok/s, first token {:.0} ms]",
            s.prompt_tokens,
            s.generated_tokens,
            output.finish_reason,
            s.prefill_tokens_per_second,
            s.decode_tokens_per_second,
            s.time_to_first_token_seconds * 1000.0
        );
        if let Some(d) = distributed {
            let rss: Vec<String> = d
                .ranks
                .iter()
                .map(|r| format!("rank {}: {:.0} MB", r.rank, r.peak_rss_bytes as f64 / 1e6))
                .collect();
            eprintln!(
                "[{:?} parallel over {} ranks; peak memory {}]",
                d.sharding,
                d.world,
                rss.join(", ")
            );
        }
    }
    Ok(())
}
