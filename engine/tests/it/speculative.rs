//! Speculative decoding on the default model: with prompt lookup or a
//! draft model, every request's tokens equal plain decoding's (greedy, and
//! seeded sampling too), alone and eight at once, on one machine and
//! through tensor and pipeline world 2; drafts are really checked (an echo
//! prompt takes fewer target steps than tokens); a draft model with
//! another vocabulary is refused; drafts never straddle LongRoPE's switch
//! to its long factors.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use tessera_engine::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::speculative::{check_draft_vocabulary, DraftSource, Speculation};
use tessera_engine::serve::{
    EngineError, FinishReason, GenerateRequest, GenerationOutput, LoadedModel, Prompt,
};
use tessera_engine::text::chat_template::ChatMessage;

use super::distributed::{on_ranks, Sharding};

const PASSAGE: &str = "The cluster keeps one ordered log of events. Every node folds the log into the same state, and the master alone decides what comes next. When the master goes away, the others elect a new one and carry on from the last event they all agree on.";

fn chat(text: &str) -> Prompt {
    Prompt::Chat {
        messages: vec![ChatMessage::new("user", text)],
        tools: None,
    }
}

fn request(prompt: Prompt, tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = tokens;
    request.ignore_eos = true;
    request
}

/// The golden set's prompts (llama.cpp's references), an echo prompt
/// (where prompt lookup pays), and a seeded sampled one.
fn requests(tokens: usize) -> Vec<GenerateRequest> {
    let path = format!(
        "{}/tests/data/llamacpp-smollm2-135m-q4_1.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let golden: Value = serde_json::from_str(&text).expect("golden file is JSON");
    let mut out = Vec::new();
    for case in golden["chats"].as_array().expect("chats").iter() {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        out.push(request(
            Prompt::Chat {
                messages,
                tools: None,
            },
            tokens,
        ));
    }
    let raw = golden["raw_prompt"]["prompt"].as_str().expect("raw prompt");
    out.push(request(Prompt::Raw(raw.into()), tokens));
    out.push(request(
        chat(&format!("Repeat this text exactly:\n\n{PASSAGE}")),
        tokens,
    ));
    let mut sampled = request(chat(&format!("Summarise: {PASSAGE}")), tokens);
    sampled.sampling.temperature = 0.7;
    sampled.sampling.top_p = 0.9;
    sampled.sampling.seed = Some(42);
    out.push(sampled);
    out
}

/// The index of the "repeat this passage" chat in [`requests`].
const ECHO: usize = 7;

fn config() -> BatchConfig {
    BatchConfig {
        max_sequences: 8,
        step_tokens: 48,
        kv_blocks: 256,
    }
}

fn run_all(
    batch: &mut Batch<'_>,
    requests: &[GenerateRequest],
    arrivals: &[usize],
) -> BTreeMap<SeqId, GenerationOutput> {
    let mut outputs = BTreeMap::new();
    let mut step = 0;
    while outputs.len() < requests.len() {
        for (i, request) in requests.iter().enumerate() {
            if arrivals[i] == step {
                batch.submit(i as SeqId, request.clone()).expect("submits");
            }
        }
        batch
            .step(&mut |id, event| match event {
                SeqEvent::Finished(output) => {
                    outputs.insert(id, output);
                    ControlFlow::Continue(())
                }
                SeqEvent::Failed(message) => panic!("sequence {id} failed: {message}"),
                SeqEvent::Generation(_) => ControlFlow::Continue(()),
            })
            .expect("step");
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
    }
    outputs
}

fn alone(batch: &mut Batch<'_>, requests: &[GenerateRequest]) -> Vec<GenerationOutput> {
    requests
        .iter()
        .map(|request| {
            batch.clear_cache();
            run_all(batch, std::slice::from_ref(request), &[0])
                .remove(&0)
                .expect("an output")
        })
        .collect()
}

fn ngram(tokens: usize) -> Option<Speculation> {
    Some(Speculation::new(DraftSource::Ngram, tokens))
}

/// Plain decoding alone, then with `speculation` alone and eight at once
/// (staggered, so drafts share steps with prompt chunks): the same tokens.
/// Returns the speculative outputs alone.
fn check_identical(
    model: &LoadedModel,
    executor: Executor<'_>,
    speculation: Option<Speculation>,
) -> Vec<GenerationOutput> {
    let requests = requests(40);
    let mut batch = Batch::new(model, executor, config());
    let plain = alone(&mut batch, &requests);
    for out in &plain {
        assert_eq!(out.stats.draft_tokens, 0);
        assert_eq!(out.stats.decode_steps, out.tokens.len() - 1);
    }
    batch.set_speculation(speculation);
    let speculative = alone(&mut batch, &requests);
    for (i, (spec, plain)) in speculative.iter().zip(&plain).enumerate() {
        assert_eq!(spec.tokens, plain.tokens, "request {i} alone, speculating");
    }
    batch.clear_cache();
    let together = run_all(&mut batch, &requests, &[0, 0, 1, 2, 2, 3, 5, 8, 9]);
    for (i, plain) in plain.iter().enumerate() {
        assert_eq!(
            together[&(i as SeqId)].tokens,
            plain.tokens,
            "request {i} among 8, speculating"
        );
    }
    let drafted: usize = speculative.iter().map(|o| o.stats.draft_tokens).sum();
    let accepted: usize = speculative
        .iter()
        .map(|o| o.stats.accepted_draft_tokens)
        .sum();
    eprintln!("drafted {drafted}, accepted {accepted}");

    speculative
}

/// The echo request alone, plainly and then with prompt lookup: the same
/// tokens, and the drafts really taken (the GPU's check; the CPU's runs
/// every request, alone and eight at once, in [`check_identical`]).
pub(crate) fn echo_speculates_identically(model: &LoadedModel, executor: Executor<'_>) {
    let request = requests(40).remove(ECHO);
    let mut batch = Batch::new(model, executor, config());
    let plain = alone(&mut batch, std::slice::from_ref(&request)).remove(0);
    batch.set_speculation(ngram(4));
    let speculative = alone(&mut batch, std::slice::from_ref(&request)).remove(0);
    assert_eq!(speculative.tokens, plain.tokens);
    let stats = &speculative.stats;
    assert!(
        stats.accepted_draft_tokens > 10 && stats.decode_steps < stats.generated_tokens - 10,
        "the repeated passage is drafted and accepted: {stats:?}"
    );
}

fn model() -> LoadedModel {
    LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads")
}

#[test]
fn prompt_lookup_gives_plain_decodings_tokens_alone_and_eight_at_once() {
    let model = model();
    let outputs = check_identical(&model, Executor::single(&model.transformer, 2), ngram(4));
    let echo = &outputs[ECHO].stats;
    assert!(
        echo.accepted_draft_tokens > 10 && echo.decode_steps < echo.generated_tokens - 10,
        "the repeated passage is drafted and accepted: {echo:?}"
    );
    assert!(echo.accepted_draft_tokens <= echo.draft_tokens);
}

#[test]
fn prompt_lookup_is_identical_through_tensor_and_pipeline_parallelism() {
    let path = tessera_testkit::default_model_path();
    for sharding in [Sharding::Tensor, Sharding::Pipeline] {
        on_ranks(&path, sharding, 2, |model, executor| {
            let outputs = check_identical(model, executor, ngram(4));
            assert!(outputs[ECHO].stats.accepted_draft_tokens > 10);
        });
    }
}

#[test]
fn the_target_as_its_own_draft_model_is_always_accepted_and_identical() {
    let model = model();
    let draft = Arc::new(self::model());
    check_draft_vocabulary(&model, &draft).expect("the same vocabulary");
    // Fixed: drafting as large a model never pays, and adaptive lengths
    // would switch it off (see the next test).
    let speculation = Some(Speculation {
        fixed: true,
        ..Speculation::new(DraftSource::Model(draft), 3)
    });
    let outputs = check_identical(&model, Executor::single(&model.transformer, 2), speculation);
    // Greedy drafts of the same model are the target's own greedy tokens.
    for (i, out) in outputs.iter().enumerate().take(ECHO + 1) {
        let stats = &out.stats;
        assert!(stats.draft_tokens > 0, "request {i} drafted");
        assert_eq!(
            stats.accepted_draft_tokens, stats.draft_tokens,
            "request {i}: every draft of the target itself stands"
        );
    }
}

#[test]
fn a_draft_model_that_does_not_pay_is_switched_off() {
    let model = model();
    let draft = Arc::new(self::model());
    let speculation = Some(Speculation::new(DraftSource::Model(draft), 4));
    let outputs = check_identical(&model, Executor::single(&model.transformer, 2), speculation);
    // Each drafted token costs a whole forward of the target: after the
    // first drafts are timed, only rare probes remain.
    let drafted: usize = outputs.iter().map(|o| o.stats.draft_tokens).sum();
    let generated: usize = outputs.iter().map(|o| o.stats.generated_tokens).sum();
    assert!(
        drafted * 10 < generated,
        "{drafted} tokens drafted over {generated} generated"
    );
}

#[test]
fn a_request_that_opts_out_never_drafts() {
    let model = model();
    let mut batch = Batch::new(&model, Executor::single(&model.transformer, 2), config());
    batch.set_speculation(ngram(4));
    let mut echo = requests(24).swap_remove(ECHO);
    echo.speculative = false;
    let out = alone(&mut batch, &[echo]).remove(0);
    assert_eq!(out.stats.draft_tokens, 0);
    assert_eq!(out.stats.decode_steps, out.tokens.len() - 1);
}

#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    let model = model();
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-reference/llama");
    let tiny = LoadedModel::load(&tiny, |_, _| {}).expect("the tiny reference model loads");
    let error = check_draft_vocabulary(&model, &tiny).expect_err("another vocabulary");
    assert!(matches!(error, EngineError::DraftVocabulary { .. }));
    let message = error.to_string();
    assert!(message.contains("tokens against the target's"), "{message}");
}

/// LongRoPE: a sequence that outgrows the original context is computed
/// again with the long factors, and a speculative step stops short of
/// that length, so drafts (here the target's own, every one of which
/// stands) never mix the two: tokens equal plain decoding's, on prompts
/// that cross the original context while they generate.
#[test]
fn drafts_stop_short_of_longropes_switch_and_change_no_token() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-reference/phi3-longrope-crossing");
    let model = LoadedModel::load(&path, |_, _| {}).expect("the LongRoPE case loads");
    assert!(model.transformer.config.rope_switch().is_some());
    let requests: Vec<GenerateRequest> = crate::hf_reference::expected("phi3-longrope-crossing")
        .into_iter()
        .map(|e| request(e.prompt, 24))
        .collect();
    let mut batch = Batch::new(&model, Executor::single(&model.transformer, 2), config());
    let plain = alone(&mut batch, &requests);
    let draft = Arc::new(LoadedModel::load(&path, |_, _| {}).expect("loads"));
    batch.set_speculation(Some(Speculation {
        fixed: true,
        ..Speculation::new(DraftSource::Model(draft), 3)
    }));
    let speculative = alone(&mut batch, &requests);
    for (i, (spec, plain)) in speculative.iter().zip(&plain).enumerate() {
        assert_eq!(spec.tokens, plain.tokens, "prompt {i}, speculating");
        assert!(spec.stats.draft_tokens > 0, "prompt {i} drafted");
    }
}

/// Constrained requests (each its own schema, regex or grammar), alone and
/// eight at once, decode the same tokens with prompt lookup as without:
/// the mask is computed where the token is chosen, so a draft the
/// constraint forbids is refused like any other wrong guess, and one it
/// allows is accepted. Every output holds its constraint.
#[test]
fn constrained_sequences_draft_under_their_own_constraints() {
    use tessera_engine::serve::Constraint;
    let model = model();
    let record =
        r#"{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}"#;
    let schema = serde_json::json!({
        "type": "object", "additionalProperties": false,
        "required": ["name", "born", "fields"],
        "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                       "fields": {"type": "array", "items": {"type": "string"}, "minItems": 1}}
    });
    let constrained = |prompt: Prompt, constraint: Constraint| {
        let mut request = request(prompt, 60);
        request.ignore_eos = false;
        request.constraint = Some(constraint);
        request
    };
    let requests = vec![
        constrained(
            chat(&format!("Repeat this JSON exactly:\n{record}")),
            Constraint::JsonSchema(schema.clone()),
        ),
        // The passage's capitals and punctuation are drafted and refused.
        constrained(
            chat(&format!("Repeat this text exactly:\n\n{PASSAGE}")),
            Constraint::Regex("[a-z ]{1,200}".into()),
        ),
        constrained(chat("Tell me about Paris as JSON."), Constraint::JsonObject),
        constrained(
            chat("Is the sky blue?"),
            Constraint::Lark(r#"start: ("yes" | "no") ", because " /[a-z ]{1,40}/"#.into()),
        ),
        constrained(
            chat("A date, please."),
            Constraint::Regex("20[0-9]{2}-[01][0-9]-[0-3][0-9]".into()),
        ),
        constrained(
            chat(&format!("Summarise as JSON: {record}")),
            Constraint::JsonSchema(schema.clone()),
        ),
        constrained(
            chat("Count to five."),
            Constraint::Regex("([0-9], ){4}[0-9]".into()),
        ),
        constrained(
            chat("Name a colour."),
            Constraint::Lark(r#"start: "red" | "green" | "blue""#.into()),
        ),
    ];
    let mut batch = Batch::new(&model, Executor::single(&model.transformer, 2), config());
    let plain = alone(&mut batch, &requests);
    batch.set_speculation(ngram(4));
    let speculative = alone(&mut batch, &requests);
    batch.clear_cache();
    let together = run_all(&mut batch, &requests, &[0, 0, 1, 2, 2, 3, 5, 8]);
    for (i, plain) in plain.iter().enumerate() {
        assert_eq!(
            speculative[i].tokens, plain.tokens,
            "request {i} alone, speculating"
        );
        assert_eq!(
            together[&(i as SeqId)].tokens,
            plain.tokens,
            "request {i} among 8"
        );
    }
    let echo: Value = serde_json::from_str(&plain[0].text).expect("JSON");
    assert_eq!(echo["born"], 1815, "{}", plain[0].text);
    let stats = &speculative[0].stats;
    assert!(
        stats.accepted_draft_tokens > 5,
        "the record is drafted and accepted: {stats:?}"
    );
    let lower = &plain[1].text;
    assert!(
        !lower.is_empty() && lower.chars().all(|c| c.is_ascii_lowercase() || c == ' '),
        "{lower}"
    );
    assert!(speculative[1].stats.draft_tokens > speculative[1].stats.accepted_draft_tokens);
    // Any JSON object: complete unless max_tokens cut it first.
    let object = &plain[2];
    if object.finish_reason == FinishReason::Stop {
        let parsed = serde_json::from_str::<serde_json::Map<String, Value>>(&object.text);
        assert!(parsed.is_ok(), "{}", object.text);
    } else {
        assert!(object.text.starts_with('{'), "{}", object.text);
    }
    assert!(
        plain[3].text.starts_with("yes, because ") || plain[3].text.starts_with("no, because "),
        "{}",
        plain[3].text
    );
    assert_eq!(plain[4].text.len(), 10, "{}", plain[4].text);
    assert!(
        serde_json::from_str::<Value>(&plain[5].text).is_ok(),
        "{}",
        plain[5].text
    );
    assert_eq!(plain[6].text.len(), 13, "{}", plain[6].text);
    assert!(
        ["red", "green", "blue"].contains(&plain[7].text.as_str()),
        "{}",
        plain[7].text
    );
}
