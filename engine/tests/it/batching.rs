//! Continuous batching on the default model: a request's tokens under any
//! concurrency equal its tokens alone (single machine, tensor and pipeline
//! world 2; also for a mixture of experts), prefix sharing gives cold-run tokens, a small pool evicts and
//! makes requests wait, one cancelled stream leaves the others whole, and a
//! request bigger than the pool is refused.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use tessera_engine::dist::collectives::{CollectiveError, Group, TcpRing};
use tessera_engine::model::paged::BLOCK_TOKENS;
use tessera_engine::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{
    EngineError, FinishReason, GenerateRequest, GenerationOutput, LoadedModel, Prompt,
};
use tessera_engine::text::chat_template::ChatMessage;

use super::distributed::{on_ranks, on_ranks_with, Sharding};

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
];

fn chat(system: Option<&str>, question: &str) -> Prompt {
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(ChatMessage::new("system", system));
    }
    messages.push(ChatMessage::new("user", question));
    Prompt::Chat {
        messages,
        tools: None,
    }
}

/// Eight requests: greedy chats, one seeded sampled chat, one raw prompt.
fn requests(tokens: usize) -> Vec<GenerateRequest> {
    QUESTIONS
        .iter()
        .enumerate()
        .map(|(i, question)| {
            let prompt = if i == 7 {
                Prompt::Raw(format!("Once upon a time, {question}"))
            } else {
                chat(None, question)
            };
            let mut request = GenerateRequest::new(prompt);
            request.max_tokens = tokens;
            request.ignore_eos = true;
            if i == 5 {
                request.sampling.temperature = 0.8;
                request.sampling.seed = Some(7);
            }
            request
        })
        .collect()
}

/// Runs `requests` on `batch`, request `i` submitted before step
/// `arrivals[i]`, until all end; each request's output by index.
fn run_all(
    batch: &mut Batch<'_>,
    requests: &[GenerateRequest],
    arrivals: &[usize],
    mut cancel_after: Option<(SeqId, usize)>,
) -> BTreeMap<SeqId, GenerationOutput> {
    let mut outputs = BTreeMap::new();
    let mut step = 0;
    while outputs.len() < requests.len() {
        for (i, request) in requests.iter().enumerate() {
            if arrivals[i] == step {
                batch.submit(i as SeqId, request.clone()).expect("submits");
            }
        }
        let mut tokens: BTreeMap<SeqId, usize> = BTreeMap::new();
        batch
            .step(&mut |id, event| match event {
                SeqEvent::Finished(output) => {
                    outputs.insert(id, output);
                    ControlFlow::Continue(())
                }
                SeqEvent::Failed(message) => panic!("sequence {id} failed: {message}"),
                SeqEvent::Generation(tessera_engine::serve::GenerationEvent::Token { .. }) => {
                    *tokens.entry(id).or_default() += 1;
                    match cancel_after {
                        Some((target, after)) if target == id && after <= 1 => {
                            ControlFlow::Break(())
                        }
                        _ => ControlFlow::Continue(()),
                    }
                }
                SeqEvent::Generation(_) => ControlFlow::Continue(()),
            })
            .expect("step");
        if let Some((target, after)) = cancel_after.as_mut() {
            if tokens.contains_key(target) {
                *after = after.saturating_sub(1);
            }
        }
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
    }
    outputs
}

/// Each request alone, one after another, on a batch of one.
fn alone(batch: &mut Batch<'_>, requests: &[GenerateRequest]) -> Vec<Vec<u32>> {
    requests
        .iter()
        .map(|request| {
            batch.clear_cache();
            run_all(batch, std::slice::from_ref(request), &[0], None)[&0]
                .tokens
                .clone()
        })
        .collect()
}

fn config(max_sequences: usize, step_tokens: usize, kv_blocks: usize) -> BatchConfig {
    BatchConfig {
        max_sequences,
        step_tokens,
        kv_blocks,
    }
}

/// Alone, then all eight at once with staggered arrivals and a small step
/// budget, so prompt chunks share steps with other sequences' decoding.
pub(crate) fn check_invariance(model: &LoadedModel, executor: Executor<'_>) {
    check_invariance_with(model, executor, 8);
}

/// [`check_invariance`] with at most `max_sequences` running at once (the
/// others wait, and take the blocks and state slots of those that end).
pub(crate) fn check_invariance_with(
    model: &LoadedModel,
    executor: Executor<'_>,
    max_sequences: usize,
) {
    let requests = requests(16);
    let mut batch = Batch::new(model, executor, config(max_sequences, 24, 256));
    let expected = alone(&mut batch, &requests);
    batch.clear_cache();
    let arrivals = [0, 0, 0, 2, 3, 3, 7, 12];
    let together = run_all(&mut batch, &requests, &arrivals, None);
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(
            &together[&(i as SeqId)].tokens,
            want,
            "request {i} in a batch of 8"
        );
    }
    // Alone twice gives the same too (the sampled one included).
    assert_eq!(alone(&mut batch, &requests), expected);
}

#[test]
fn eight_concurrent_requests_each_get_what_they_get_alone() {
    let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    check_invariance(&model, Executor::single(&model.transformer, 2));
}

#[test]
fn batching_is_invariant_through_tensor_and_pipeline_parallelism() {
    let path = tessera_testkit::default_model_path();
    for sharding in [Sharding::Tensor, Sharding::Pipeline] {
        // Dropping the executor (inside the batch) lets the other ranks go.
        on_ranks(&path, sharding, 2, check_invariance);
    }
}

/// A mixture of experts (the random Qwen3-MoE of the transformers
/// references, as llama.cpp converted it): a step's tokens are sorted by
/// expert, and a token's output must still not depend on who else is in it.
#[test]
fn a_mixture_of_experts_is_batch_invariant_alone_and_split() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-reference/qwen3-moe/model.gguf");
    let model = LoadedModel::load(&path, |_, _| {}).expect("the MoE fixture loads");
    assert!(model.transformer.config.moe.is_some());
    check_invariance(&model, Executor::single(&model.transformer, 2));
    for sharding in [Sharding::Tensor, Sharding::Pipeline] {
        on_ranks(&path, sharding, 2, check_invariance);
    }
}

/// A hybrid model (the random Qwen3.5 of the transformers references, as
/// llama.cpp converted it): each sequence's Gated DeltaNet state lives in a
/// slot of its own, reset when the sequence starts and handed to the next
/// one when it ends (three slots for eight requests here).
#[test]
fn a_hybrid_model_keeps_each_sequences_recurrent_state_apart() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-reference/qwen3-5/model.gguf");
    let model = LoadedModel::load(&path, |_, _| {}).expect("the hybrid fixture loads");
    assert!(model.transformer.has_recurrent_state());
    check_invariance(&model, Executor::single(&model.transformer, 2));
    check_invariance_with(&model, Executor::single(&model.transformer, 2), 3);
    for sharding in [Sharding::Tensor, Sharding::Pipeline] {
        on_ranks(&path, sharding, 2, |model, executor| {
            check_invariance_with(model, executor, 3)
        });
    }
    // The same prompt again takes nothing from the cache: the state of a
    // prefix is not kept in blocks.
    let mut batch = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(2, 24, 256),
    );
    let request = requests(8).remove(0);
    let first = run_all(&mut batch, std::slice::from_ref(&request), &[0], None);
    let second = run_all(&mut batch, std::slice::from_ref(&request), &[0], None);
    let stats = &second[&0].stats;
    assert_eq!(
        stats.prefilled_tokens, stats.prompt_tokens,
        "nothing cached"
    );
    assert_eq!(first[&0].tokens, second[&0].tokens);
}

/// About 600 tokens of system prompt.
fn long_system_prompt() -> String {
    system_prompt(20)
}

/// About 30 tokens of system prompt, `times` times.
fn system_prompt(times: usize) -> String {
    let sentence = "You are a careful assistant for a home cluster of computers; answer briefly, name the machine you mean, and never invent a number you were not given. ";
    sentence.repeat(times)
}

/// Two questions under one system prompt of `times` sentences: the second,
/// after the first, takes the prompt's whole blocks from the cache and
/// answers what it answers cold.
pub(crate) fn check_shared_system_prompt(
    model: &LoadedModel,
    executor: Executor<'_>,
    times: usize,
) {
    let mut batch = Batch::new(model, executor, config(8, 128, 512));
    let system = system_prompt(times);
    let request = |question: &str| {
        let mut request = GenerateRequest::new(chat(Some(&system), question));
        request.max_tokens = 8;
        request.ignore_eos = true;
        request
    };
    let (first, second) = (request(QUESTIONS[0]), request(QUESTIONS[1]));
    let cold = run_all(&mut batch, std::slice::from_ref(&second), &[0], None)[&0].clone();
    batch.clear_cache();
    run_all(&mut batch, &[first], &[0], None);
    let hit = &run_all(&mut batch, &[second], &[0], None)[&0];
    let cached = hit.stats.prompt_tokens - hit.stats.prefilled_tokens;
    assert!(
        cached >= BLOCK_TOKENS * (cold.stats.prompt_tokens / BLOCK_TOKENS / 2),
        "{cached} of {} prompt tokens from the cache",
        hit.stats.prompt_tokens
    );
    assert_eq!(hit.tokens, cold.tokens, "cached prefix, cold tokens");
}

#[test]
fn a_shared_system_prompt_is_taken_from_the_cache_and_gives_cold_tokens() {
    let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    let mut batch = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(8, 128, 512),
    );
    let system = long_system_prompt();
    let request = |question: &str| {
        let mut request = GenerateRequest::new(chat(Some(&system), question));
        request.max_tokens = 12;
        request.ignore_eos = true;
        request
    };
    let (first, second) = (request(QUESTIONS[0]), request(QUESTIONS[1]));
    let cold = run_all(&mut batch, std::slice::from_ref(&second), &[0], None)[&0].clone();
    assert!(
        cold.stats.prompt_tokens >= 600,
        "{} prompt tokens",
        cold.stats.prompt_tokens
    );
    batch.clear_cache();
    let first = run_all(&mut batch, &[first], &[0], None)[&0].clone();
    assert_eq!(first.stats.prefilled_tokens, first.stats.prompt_tokens);
    let hit = &run_all(&mut batch, &[second], &[0], None)[&0];
    let cached = hit.stats.prompt_tokens - hit.stats.prefilled_tokens;
    assert!(cached >= 576, "{cached} cached tokens");
    assert_eq!(
        hit.tokens, cold.tokens,
        "tokens from shared blocks equal a cold run"
    );
}

/// Requests that arrive together with one long prompt (the n answers of
/// one request): the second waits for the first's prefill and takes its
/// blocks from the cache, and its tokens are what it gets alone.
#[test]
fn prompts_arriving_together_share_their_prefill() {
    let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    let mut batch = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(8, 128, 512),
    );
    let system = long_system_prompt();
    let mut request = GenerateRequest::new(chat(Some(&system), QUESTIONS[0]));
    request.max_tokens = 8;
    request.ignore_eos = true;
    let mut other = request.clone();
    other.sampling.temperature = 0.9;
    other.sampling.seed = Some(3);
    let alone = run_all(&mut batch, std::slice::from_ref(&other), &[0], None)[&0].clone();
    batch.clear_cache();
    let together = run_all(&mut batch, &[request, other], &[0, 0], None);
    let prompt = together[&0].stats.prompt_tokens;
    assert_eq!(
        together[&0].stats.prefilled_tokens, prompt,
        "the first computes it"
    );
    let second = &together[&1].stats;
    assert!(
        second.prefilled_tokens < BLOCK,
        "the second computed {} of {prompt} prompt tokens",
        second.prefilled_tokens
    );
    assert_eq!(
        together[&1].tokens, alone.tokens,
        "and gets what it gets alone"
    );
}

const BLOCK: usize = tessera_engine::model::paged::BLOCK_TOKENS;

#[test]
fn a_small_pool_evicts_idle_blocks_and_makes_requests_wait() {
    let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    let requests = requests(12);
    let mut reference = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(1, 512, 64),
    );
    let expected = alone(&mut reference, &requests);
    drop(reference);
    // Room for about two requests at a time (each needs 3 or 4 blocks).
    let mut batch = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(8, 64, 8),
    );
    let mut waited = false;
    let mut outputs = BTreeMap::new();
    for (i, request) in requests.iter().enumerate() {
        batch.submit(i as SeqId, request.clone()).expect("submits");
    }
    while outputs.len() < requests.len() {
        batch
            .step(&mut |id, event| {
                if let SeqEvent::Finished(output) = event {
                    outputs.insert(id, output);
                }
                ControlFlow::Continue(())
            })
            .expect("step");
        let (running, waiting) = batch.load();
        waited |= waiting > 0 && running < 8;
    }
    assert!(waited, "requests waited for blocks");
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(
            &outputs[&(i as SeqId)].tokens,
            want,
            "request {i} under eviction"
        );
    }
}

#[test]
fn cancelling_one_of_eight_leaves_the_others_complete_and_identical() {
    let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    let requests = requests(16);
    let mut batch = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(8, 128, 256),
    );
    let expected = alone(&mut batch, &requests);
    batch.clear_cache();
    let outputs = run_all(&mut batch, &requests, &[0; 8], Some((3, 4)));
    for (i, want) in expected.iter().enumerate() {
        let out = &outputs[&(i as SeqId)];
        if i == 3 {
            assert_eq!(out.finish_reason, FinishReason::Cancelled);
            assert!(out.tokens.len() < 16, "{} tokens", out.tokens.len());
            assert_eq!(out.tokens[..], want[..out.tokens.len()]);
        } else {
            assert_eq!(out.finish_reason, FinishReason::Length);
            assert_eq!(&out.tokens, want, "request {i}");
        }
    }
    // Cancelling one that waits ends it at the next step without running.
    let mut small = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(1, 128, 256),
    );
    small.submit(0, requests[0].clone()).expect("submits");
    small.submit(1, requests[1].clone()).expect("submits");
    small.cancel(1);
    let mut ended = Vec::new();
    while !small.is_idle() {
        small
            .step(&mut |id, event| {
                if let SeqEvent::Finished(out) = event {
                    ended.push((id, out.finish_reason, out.tokens.len()));
                }
                ControlFlow::Continue(())
            })
            .expect("step");
    }
    assert_eq!(
        ended,
        vec![
            (1, FinishReason::Cancelled, 0),
            (0, FinishReason::Length, 16)
        ]
    );
}

#[test]
fn a_request_bigger_than_the_pool_is_refused_with_its_token_counts() {
    let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    let mut batch = Batch::new(
        &model,
        Executor::single(&model.transformer, 2),
        config(8, 128, 4),
    );
    let mut request = GenerateRequest::new(chat(None, QUESTIONS[0]));
    request.max_tokens = 4 * BLOCK_TOKENS;
    let error = batch.submit(0, request).expect_err("refused");
    assert!(
        matches!(error, EngineError::BeyondKvCache { capacity: 64, .. }),
        "{error}"
    );
    assert!(error.is_invalid_request());
    assert!(error.to_string().contains("max_tokens 64"), "{error}");
    assert!(batch.is_idle());
}

/// A follower's ring that dies (closes its connections) at its fourth
/// step: a rank process killed in the middle of a batch.
struct DiesMidBatch {
    ring: Option<TcpRing>,
    steps: usize,
}

impl DiesMidBatch {
    fn wrap(ring: TcpRing) -> Box<dyn Group> {
        Box::new(Self {
            ring: Some(ring),
            steps: 0,
        })
    }

    fn ring(&mut self) -> Result<&mut TcpRing, CollectiveError> {
        self.ring
            .as_mut()
            .ok_or_else(|| CollectiveError::Invalid("this rank is dead".into()))
    }
}

impl Group for DiesMidBatch {
    fn rank(&self) -> usize {
        self.ring.as_ref().map_or(1, Group::rank)
    }
    fn size(&self) -> usize {
        self.ring.as_ref().map_or(2, Group::size)
    }
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.ring()?.all_reduce_sum(data)
    }
    fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), CollectiveError> {
        self.ring()?.all_gather(local, counts, out)
    }
    fn send_next(&mut self, data: &[f32]) -> Result<(), CollectiveError> {
        self.ring()?.send_next(data)
    }
    fn recv_prev(&mut self, out: &mut [f32]) -> Result<(), CollectiveError> {
        self.ring()?.recv_prev(out)
    }
    fn broadcast(&mut self, root: usize, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.ring()?.broadcast(root, data)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.ring()?.barrier()
    }
    fn broadcast_bytes(
        &mut self,
        root: usize,
        message: &mut Vec<u8>,
    ) -> Result<(), CollectiveError> {
        // Each step starts with rank 0's broadcast.
        self.steps += 1;
        if self.steps == 4 {
            self.ring = None;
        }
        self.ring()?.broadcast_bytes(root, message)
    }
    fn set_timeout(&mut self, timeout: Option<std::time::Duration>) -> Result<(), CollectiveError> {
        self.ring()?.set_timeout(timeout)
    }
}

#[test]
fn a_rank_that_dies_mid_batch_fails_every_request_of_the_instance_at_once() {
    let path = tessera_testkit::default_model_path();
    for sharding in [Sharding::Tensor, Sharding::Pipeline] {
        let (failed, followers) =
            on_ranks_with(&path, sharding, 2, DiesMidBatch::wrap, |model, executor| {
                let mut batch = Batch::new(model, executor, config(8, 128, 256));
                for (i, request) in requests(64).into_iter().enumerate() {
                    batch.submit(i as SeqId, request).expect("submits");
                }
                let started = std::time::Instant::now();
                let mut failed = BTreeMap::new();
                let mut finished = 0;
                let mut error = None;
                while error.is_none() && !batch.is_idle() {
                    let result = batch.step(&mut |id, event| {
                        match event {
                            SeqEvent::Failed(message) => {
                                failed.insert(id, message.to_string());
                            }
                            SeqEvent::Finished(_) => finished += 1,
                            SeqEvent::Generation(_) => {}
                        }
                        ControlFlow::Continue(())
                    });
                    error = result.err();
                }
                let error = error.expect("the step fails once the rank is gone");
                assert!(started.elapsed() < std::time::Duration::from_secs(20));
                assert_eq!(finished, 0, "nothing finished: 64 tokens each");
                assert!(batch.is_idle(), "nothing is left waiting or running");
                (failed, error.to_string())
            });
        let (failed, error) = failed;
        assert_eq!(
            failed.len(),
            8,
            "{sharding:?}: every request failed ({error})"
        );
        assert!(followers[0].is_err(), "the follower died");
    }
}
