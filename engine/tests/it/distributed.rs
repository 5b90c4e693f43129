//! Tensor and pipeline parallelism over a loopback TCP ring (ranks are
//! threads here; `tests/it/distributed_cli.rs` at the root runs processes):
//! greedy outputs on every golden case are the single-machine engine's, token
//! for token (both split the arithmetic without reordering any sum; see
//! `tessera_engine::model::gather`), and a divergence is printed with its
//! step and margin (`--nocapture`).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tessera_engine::dist::collectives::{Group, TcpRing};
use tessera_engine::dist::shard::{split_evenly, ShardSpec};
use tessera_engine::model::Transformer;
use tessera_engine::serve::executor::{ExecError, Executor};
use tessera_engine::serve::{
    load_transformer, model_config, GenerateRequest, LoadedModel, Prompt, Session,
};
use tessera_engine::text::chat_template::ChatMessage;

const TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug)]
pub(crate) enum Sharding {
    Tensor,
    Pipeline,
}

pub(crate) fn spec(sharding: Sharding, rank: usize, world: usize, layers: usize) -> ShardSpec {
    match sharding {
        Sharding::Tensor => ShardSpec::Tensor {
            rank: rank as u32,
            world_size: world as u32,
        },
        Sharding::Pipeline => {
            let ranges = split_evenly(layers as u32, world, "layers").expect("split");
            ShardSpec::Pipeline {
                start_layer: ranges[rank].start,
                end_layer: ranges[rank].end,
                n_layers: layers as u32,
            }
        }
    }
}

/// The golden cases: chat prompts and the raw prompt, with their lengths.
pub(crate) fn cases() -> Vec<(String, Prompt, usize)> {
    let path = format!(
        "{}/tests/data/llamacpp-smollm2-135m-q4_1.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let golden: Value = serde_json::from_str(&text).expect("JSON");
    let mut cases = Vec::new();
    for (i, case) in golden["chats"]
        .as_array()
        .expect("chats")
        .iter()
        .enumerate()
    {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        let n = case["generated_token_ids_forced_48_ignore_eog"]
            .as_array()
            .expect("ids")
            .len();
        cases.push((
            format!("chat {i}"),
            Prompt::Chat {
                messages,
                tools: None,
            },
            n,
        ));
    }
    let raw = &golden["raw_prompt"];
    cases.push((
        "raw prompt".into(),
        Prompt::Raw(raw["prompt"].as_str().expect("prompt").into()),
        raw["greedy_48_token_ids"].as_array().expect("ids").len(),
    ));
    cases
}

/// Greedy ids, and at each step the top-1/top-2 logit margin (the
/// difference of their logprobs).
pub(crate) fn greedy_with_margins(
    session: &mut Session<'_>,
    prompt: &Prompt,
    n: usize,
) -> (Vec<u32>, Vec<f32>) {
    let mut request = GenerateRequest::new(prompt.clone());
    request.max_tokens = n;
    request.ignore_eos = true;
    request.logprobs = true;
    request.sampling.top_logprobs = 2;
    // Small chunks, so prefill runs several pipelined steps.
    request.prefill_chunk = 16;
    let out = session
        .generate(&request, |_| ControlFlow::Continue(()))
        .expect("generation succeeds");
    let margins = out
        .logprobs
        .iter()
        .map(|l| match l.top[..] {
            [(_, first), (_, second), ..] => first - second,
            _ => f32::INFINITY,
        })
        .collect();
    (out.tokens, margins)
}

fn greedy(session: &mut Session<'_>, prompt: &Prompt, n: usize) -> Vec<u32> {
    greedy_with_margins(session, prompt, n).0
}

/// Runs `body` on rank 0 of `world` ranks (the others are threads on a
/// loopback ring); dropping its executor lets the other ranks go.
pub(crate) fn on_ranks<T>(
    path: &Path,
    sharding: Sharding,
    world: usize,
    body: impl FnOnce(&LoadedModel, Executor<'_>) -> T,
) -> T {
    let (out, followers) = on_ranks_with(path, sharding, world, |ring| Box::new(ring), body);
    for follower in followers {
        follower.expect("a follower rank serves until rank 0 is done");
    }
    out
}

/// [`on_ranks`], each follower's ring wrapped by `group` (to inject
/// faults); returns how each follower's `serve` ended too.
pub(crate) fn on_ranks_with<T>(
    path: &Path,
    sharding: Sharding,
    world: usize,
    group: fn(TcpRing) -> Box<dyn Group>,
    body: impl FnOnce(&LoadedModel, Executor<'_>) -> T,
) -> (T, Vec<Result<(), ExecError>>) {
    on_prepared_ranks(path, sharding, world, group, |_, _| {}, body)
}

/// [`on_ranks_with`], each rank's shard passed to `prepare` (with its
/// rank) once loaded: to put it on a GPU, say.
pub(crate) fn on_prepared_ranks<T>(
    path: &Path,
    sharding: Sharding,
    world: usize,
    group: fn(TcpRing) -> Box<dyn Group>,
    prepare: fn(usize, &mut Transformer),
    body: impl FnOnce(&LoadedModel, Executor<'_>) -> T,
) -> (T, Vec<Result<(), ExecError>>) {
    let layers = model_config(path).expect("config").layers;
    let (listeners, addrs) = tessera_testkit::loopback_listeners(world);
    let mut listeners = listeners.into_iter();
    let own = listeners.next().expect("rank 0 listener");
    let workers: Vec<_> = listeners
        .enumerate()
        .map(|(i, listener)| {
            let rank = i + 1;
            let (addrs, path) = (addrs.clone(), path.to_path_buf());
            std::thread::spawn(move || {
                let shard = spec(sharding, rank, world, layers);
                let mut transformer = load_transformer(&path, &shard, |_, _| {}).expect("loads");
                prepare(rank, &mut transformer);
                let ring = TcpRing::from_listener(rank, listener, &addrs, "test", TIMEOUT, TIMEOUT)
                    .expect("ring");
                let mut executor = Executor::new(&transformer, 1, group(ring));
                executor.serve(None, TIMEOUT)
            })
        })
        .collect();
    let shard = spec(sharding, 0, world, layers);
    let mut model = LoadedModel::load_shard(path, Some(&shard), |_, _| {}).expect("loads");
    prepare(0, &mut model.transformer);
    let ring = TcpRing::from_listener(0, own, &addrs, "test", TIMEOUT, TIMEOUT).expect("ring");
    let out = body(&model, Executor::new(&model.transformer, 1, Box::new(ring)));
    let followers = workers
        .into_iter()
        .map(|worker| worker.join().expect("worker rank"))
        .collect();
    (out, followers)
}

/// Runs every case greedily on `world` ranks (threads on a loopback ring).
fn distributed_outputs(
    path: &Path,
    sharding: Sharding,
    world: usize,
    cases: &[(String, Prompt, usize)],
) -> Vec<Vec<u32>> {
    on_ranks(path, sharding, world, |model, executor| {
        let mut session = Session::with_executor(model, executor);
        let outputs = cases
            .iter()
            .map(|(_, prompt, n)| greedy(&mut session, prompt, *n))
            .collect();
        session.executor().shutdown().expect("shutdown");
        outputs
    })
}

fn check(sharding: Sharding, world: usize) {
    let path: PathBuf = tessera_testkit::default_model_path();
    let cases = cases();
    let model = LoadedModel::load(&path, |_, _| {}).expect("loads");
    let mut single = Session::new(&model, 2);
    let reference: Vec<(Vec<u32>, Vec<f32>)> = cases
        .iter()
        .map(|(_, prompt, n)| greedy_with_margins(&mut single, prompt, *n))
        .collect();
    let outputs = distributed_outputs(&path, sharding, world, &cases);
    let mut failures = Vec::new();
    for ((name, _, _), (ours, (reference, margins))) in
        cases.iter().zip(outputs.iter().zip(&reference))
    {
        let Some(step) = ours.iter().zip(reference).position(|(a, b)| a != b) else {
            eprintln!(
                "{sharding:?} world {world}, {name}: all {} steps identical",
                ours.len()
            );
            continue;
        };
        // Stages and tensor ranks run one machine's arithmetic: any
        // divergence, even at a close margin, is a fault.
        failures.push(format!(
            "{name}: step {step} (ours {}, single {}), single-machine margin there {:.4}",
            ours[step], reference[step], margins[step]
        ));
    }
    assert!(
        failures.is_empty(),
        "{sharding:?} world {world} diverged from one machine: {failures:?}"
    );
}

#[test]
fn tensor_parallel_world_2_agrees_with_one_machine() {
    check(Sharding::Tensor, 2);
}

#[test]
fn tensor_parallel_world_3_agrees_with_one_machine() {
    check(Sharding::Tensor, 3);
}

#[test]
fn pipeline_world_2_agrees_with_one_machine() {
    check(Sharding::Pipeline, 2);
}

#[test]
fn pipeline_world_3_agrees_with_one_machine() {
    check(Sharding::Pipeline, 3);
}

/// Each rank tells rank 0 how many KV blocks its memory holds, and rank 0
/// learns the least (a pipeline's smallest GPU caps the instance's pool).
#[test]
fn rank_0_learns_the_least_kv_budget_of_its_ranks() {
    let path = tessera_testkit::default_model_path();
    let world = 3;
    let layers = model_config(&path).expect("config").layers;
    let (listeners, addrs) = tessera_testkit::loopback_listeners(world);
    let mut listeners = listeners.into_iter();
    let own = listeners.next().expect("rank 0 listener");
    let held = [50, 7, usize::MAX];
    let workers: Vec<_> = listeners
        .enumerate()
        .map(|(i, listener)| {
            let rank = i + 1;
            let (addrs, path) = (addrs.clone(), path.clone());
            std::thread::spawn(move || {
                let shard = spec(Sharding::Pipeline, rank, world, layers);
                let transformer = load_transformer(&path, &shard, |_, _| {}).expect("loads");
                let ring = TcpRing::from_listener(rank, listener, &addrs, "test", TIMEOUT, TIMEOUT)
                    .expect("ring");
                let mut executor = Executor::new(&transformer, 1, Box::new(ring));
                let own = executor.least_kv_blocks(held[rank]).expect("sent");
                assert_eq!(own, held[rank].min(1 << 20), "rank {rank} keeps its own");
                executor.serve(None, TIMEOUT)
            })
        })
        .collect();
    let shard = spec(Sharding::Pipeline, 0, world, layers);
    let model = LoadedModel::load_shard(&path, Some(&shard), |_, _| {}).expect("loads");
    let ring = TcpRing::from_listener(0, own, &addrs, "test", TIMEOUT, TIMEOUT).expect("ring");
    let mut executor = Executor::new(&model.transformer, 1, Box::new(ring));
    assert_eq!(executor.least_kv_blocks(held[0]).expect("gathered"), 7);
    drop(executor);
    for worker in workers {
        worker
            .join()
            .expect("worker rank")
            .expect("serves until rank 0 is done");
    }
}
