//! Tensor parallelism computes what one machine computes: for the default
//! model and every family of the reference set (from safetensors and from
//! GGUF), at every world size from 2 up to the model's KV heads (uneven
//! splits, where a KV group straddles two ranks, included), the first
//! steps' logprobs must be within f32 ordering noise (1e-3) of one
//! machine's, and greedy tokens identical.
//!
//! The tolerance is not a margin rule: the 8-bit (or f16) rounding of the
//! activations before each matrix turns a last-bit difference anywhere
//! into tenths of a logprob a few layers later (a one-ulp change of the
//! embeddings moves the default model's first logprob by 0.1), so only
//! the same arithmetic passes. The checks also cover the paths that could
//! hide such a fault: prompts prefilled in small chunks on the ranks
//! against whole on one machine, the logits gathered to rank 0 (logprobs),
//! and greedy steps that carry only each rank's best token (combined
//! across vocabulary slices).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use tessera_engine::serve::{model_config, GenerateRequest, LoadedModel, Prompt, Session};
use tessera_engine::text::chat_template::ChatMessage;

use crate::distributed::{on_ranks, Sharding};

/// f32 summation-order noise, in logprob.
const TOLERANCE: f32 = 1e-3;
/// Steps whose logprobs are compared.
const STEPS: usize = 3;
/// Top logprobs compared at each step.
const TOP: usize = 5;
/// Greedy steps compared through the best-token path.
const GREEDY_STEPS: usize = 16;

/// One prompt's first steps: each step's chosen token and top logprobs.
#[derive(Debug)]
struct Steps {
    tokens: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
}

fn request(prompt: &Prompt, steps: usize, logprobs: bool, chunk: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt.clone());
    request.max_tokens = steps;
    request.ignore_eos = true;
    request.logprobs = logprobs;
    request.sampling.top_logprobs = if logprobs { TOP } else { 0 };
    request.prefill_chunk = chunk;
    request
}

/// The first [`STEPS`] with logprobs (the logits path), then
/// [`GREEDY_STEPS`] greedy tokens without (the best-token path).
fn run(session: &mut Session<'_>, prompt: &Prompt, chunk: usize) -> (Steps, Vec<u32>) {
    let out = session
        .generate(&request(prompt, STEPS, true, chunk), |_| {
            ControlFlow::Continue(())
        })
        .expect("generation succeeds");
    let steps = Steps {
        tokens: out.tokens,
        top: out.logprobs.into_iter().map(|l| l.top).collect(),
    };
    let greedy = session
        .generate(&request(prompt, GREEDY_STEPS, false, chunk), |_| {
            ControlFlow::Continue(())
        })
        .expect("generation succeeds")
        .tokens;
    (steps, greedy)
}

/// The largest logprob difference between two steps' top lists, over the
/// ids either has (an id only one has counts as a failure).
fn step_difference(ours: &[(u32, f32)], reference: &[(u32, f32)]) -> Result<f32, String> {
    let mut worst = 0f32;
    for (id, logprob) in reference {
        match ours.iter().find(|(other, _)| other == id) {
            Some((_, got)) => worst = worst.max((got - logprob).abs()),
            // Just outside our top list: only a tie at the boundary allows it.
            None if reference.last().is_some_and(|(last, _)| last == id) => {}
            None => return Err(format!("token {id} ({logprob:.4}) missing from {ours:?}")),
        }
    }
    Ok(worst)
}

/// Compares every prompt's answers; returns the worst logprob difference,
/// panicking (with every failure) where one is beyond [`TOLERANCE`].
fn compare(
    what: &str,
    labels: &[String],
    ours: &[(Steps, Vec<u32>)],
    reference: &[(Steps, Vec<u32>)],
) {
    let mut failures = Vec::new();
    let mut worst = 0f32;
    for (label, ((steps, greedy), (ref_steps, ref_greedy))) in
        labels.iter().zip(ours.iter().zip(reference))
    {
        if steps.tokens != ref_steps.tokens {
            failures.push(format!(
                "{label}: tokens {:?}, one machine {:?}",
                steps.tokens, ref_steps.tokens
            ));
        }
        for (step, (top, ref_top)) in steps.top.iter().zip(&ref_steps.top).enumerate() {
            match step_difference(top, ref_top) {
                Ok(diff) => {
                    worst = worst.max(diff);
                    if diff > TOLERANCE {
                        failures.push(format!(
                            "{label}: step {step} logprobs differ by {diff:.4}: {top:?}, one machine {ref_top:?}"
                        ));
                    }
                }
                Err(e) => failures.push(format!("{label}: step {step}: {e}")),
            }
        }
        if greedy != ref_greedy {
            failures.push(format!(
                "{label}: greedy (best-token path) {greedy:?}, one machine {ref_greedy:?}"
            ));
        }
    }
    eprintln!(
        "{what}: {} prompts, worst logprob difference {worst:.2e} over the first {STEPS} steps",
        labels.len()
    );
    assert!(failures.is_empty(), "{what}:\n{}", failures.join("\n"));
}

/// One machine (2 threads, whole prompts) against tensor ranks at every
/// world size from 2 to the model's KV heads (prompts in chunks of 5).
fn check(path: &Path, prompts: &[(String, Prompt)]) {
    let model =
        LoadedModel::load(path, |_, _| {}).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut single = Session::new(&model, 2);
    let reference: Vec<_> = prompts
        .iter()
        .map(|(_, prompt)| run(&mut single, prompt, 512))
        .collect();
    let labels: Vec<String> = prompts.iter().map(|(label, _)| label.clone()).collect();
    let kv_heads = model_config(path).expect("config").kv_heads;
    assert!(
        kv_heads >= 2,
        "{}: too few KV heads to split",
        path.display()
    );
    for world in 2..=kv_heads {
        let answers = on_ranks(path, Sharding::Tensor, world, |model, executor| {
            let mut session = Session::with_executor(model, executor);
            let answers: Vec<_> = prompts
                .iter()
                .map(|(_, prompt)| run(&mut session, prompt, 5))
                .collect();
            session.executor().shutdown().expect("shutdown");
            answers
        });
        let what = format!("{} tensor world {world}", path.display());
        compare(&what, &labels, &answers, &reference);
    }
}

fn chat(text: &str) -> Prompt {
    Prompt::Chat {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: text.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }],
        tools: None,
    }
}

/// The prompt of the issue that found the fault, the golden chat cases and
/// the raw prompt.
fn default_prompts() -> Vec<(String, Prompt)> {
    let translate = (
        "translate".to_string(),
        chat("Translate 你好 into English. 🙂"),
    );
    let golden = crate::distributed::cases().into_iter();
    std::iter::once(translate)
        .chain(golden.map(|(label, prompt, _)| (label, prompt)))
        .collect()
}

/// The default model (Q4_1, its head Q8_0).
#[test]
fn default_model_tensor_ranks_compute_what_one_machine_does() {
    check(&tessera_testkit::default_model_path(), &default_prompts());
}

/// The default model in Q4_K_M's mix of K-quants (super-blocks of 256,
/// Q8_K activations) and legacy formats.
#[test]
fn k_quant_tensor_ranks_compute_what_one_machine_does() {
    check(&crate::kquants::q4_k_m_mix(), &default_prompts()[..3]);
}

/// A type without a native kernel (Q3_K downs): candle's quantized matmul
/// over a tensor rank's output rows.
#[test]
fn candle_fallback_tensor_ranks_compute_what_one_machine_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mixed-q3k.gguf");
    crate::kquants::requantized(&path, |name, _| {
        name.contains("ffn_down")
            .then_some(candle_core::quantized::GgmlDType::Q3K)
    });
    check(&path, &default_prompts()[..3]);
}

fn case_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-reference")
        .join(name)
}

/// A reference case's prompts (those transformers answered).
fn case_prompts(name: &str) -> Vec<(String, Prompt)> {
    let expected = crate::hf_reference::expected(name).into_iter();
    expected.map(|e| (e.label, e.prompt)).collect()
}

/// A family from safetensors and, where the case has one, from GGUF.
fn family(name: &str) {
    let prompts = case_prompts(name);
    check(&case_dir(name), &prompts);
    let gguf = case_dir(name).join("model.gguf");
    if gguf.is_file() {
        check(&gguf, &prompts);
    } else {
        eprintln!("{name}: no GGUF conversion (llama.cpp's converter cannot carry it)");
    }
}

macro_rules! families {
    ($($test:ident => $name:literal;)*) => {
        $(
            #[test]
            fn $test() {
                family($name);
            }
        )*

        /// Every case folder has its test here.
        #[test]
        fn every_reference_family_is_checked() {
            let names: &[&str] = &[$($name,)*];
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-reference");
            for entry in std::fs::read_dir(&dir).expect("reference folder") {
                let entry = entry.expect("entry");
                if entry.path().is_dir() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    assert!(names.contains(&name.as_str()), "{name} has no tensor-parallel check");
                }
            }
        }
    };
}

families! {
    llama_tensor_exact => "llama";
    llama_bias_tensor_exact => "llama-bias";
    llama_rope_dynamic_tensor_exact => "llama-rope-dynamic";
    llama_rope_linear_tensor_exact => "llama-rope-linear";
    llama_rope_llama3_tensor_exact => "llama-rope-llama3";
    llama_rope_llama3_old_config_tensor_exact => "llama-rope-llama3-old-config";
    llama_rope_yarn_tensor_exact => "llama-rope-yarn";
    mistral_tensor_exact => "mistral";
    mistral_sliding_window_tensor_exact => "mistral-sliding-window";
    mixtral_tensor_exact => "mixtral";
    olmo2_tensor_exact => "olmo2";
    phi3_tensor_exact => "phi3";
    phi3_longrope_tensor_exact => "phi3-longrope";
    phi3_longrope_short_tensor_exact => "phi3-longrope-short";
    phi3_longrope_crossing_tensor_exact => "phi3-longrope-crossing";
    qwen2_tensor_exact => "qwen2";
    qwen3_tensor_exact => "qwen3";
    qwen3_moe_tensor_exact => "qwen3-moe";
    qwen3_moe_dense_layer_tensor_exact => "qwen3-moe-dense-layer";
    qwen3_5_tensor_exact => "qwen3-5";
    qwen3_5_moe_tensor_exact => "qwen3-5-moe";
    qwen3_next_tensor_exact => "qwen3-next";
    smollm3_tensor_exact => "smollm3";
    gemma2_tensor_exact => "gemma2";
    gemma3_tensor_exact => "gemma3";
}
