//! The Runner's state machine, driven with a fake backend (no model).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_engine::serve::GenerateRequest;
use tessera_protos::v1::{self, generation_chunk, runner_status::State as Rs};
use tokio::sync::{mpsc, oneshot};

use super::backend::{Backend, BackendError, EngineEvent};
use super::*;

/// Statuses and chunks, as they went out.
#[derive(Debug)]
enum Out {
    Status(Rs),
    Chunk(v1::GenerationChunk),
}

struct ChannelOutput(mpsc::UnboundedSender<Out>);

impl RunnerOutput for ChannelOutput {
    async fn status(&self, status: &v1::RunnerStatus) {
        if let Some(state) = status.state.clone() {
            let _ = self.0.send(Out::Status(state));
        }
    }

    async fn chunk(&self, chunk: &v1::GenerationChunk) {
        let _ = self.0.send(Out::Chunk(chunk.clone()));
    }
}

/// A generation of the fake batch.
struct FakeGeneration {
    task_id: String,
    sent: usize,
    max: usize,
    cancelled: bool,
}

/// A backend whose batch sends one token per generation a step until a
/// generation is cancelled or its `tokens` are out; `gate` holds each step
/// until the test lets it go.
struct FakeBackend {
    calls: Arc<Mutex<Vec<&'static str>>>,
    fail_load: bool,
    tokens: usize,
    gate: Option<std::sync::mpsc::Receiver<()>>,
    batch: Vec<FakeGeneration>,
    /// The first step waits until this many generations are in the batch.
    first_step_waits_for: usize,
}

impl Backend for FakeBackend {
    fn connect(&mut self) -> Result<(), BackendError> {
        self.calls.lock().expect("calls").push("connect");
        Ok(())
    }

    fn load(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<u64, BackendError> {
        self.calls.lock().expect("calls").push("load");
        if self.fail_load {
            return Err(BackendError::Engine("no such file".into()));
        }
        progress(2, 2);
        Ok(1234)
    }

    fn warm_up(&mut self) -> Result<(), BackendError> {
        self.calls.lock().expect("calls").push("warm_up");
        Ok(())
    }

    fn submit(
        &mut self,
        task_id: &str,
        _command_id: &str,
        request: GenerateRequest,
    ) -> Result<(), BackendError> {
        self.calls.lock().expect("calls").push("submit");
        self.batch.push(FakeGeneration {
            task_id: task_id.into(),
            sent: 0,
            max: self.tokens.min(request.max_tokens),
            cancelled: false,
        });
        Ok(())
    }

    fn cancel(&mut self, task_id: &str) {
        for generation in self.batch.iter_mut().filter(|g| g.task_id == task_id) {
            generation.cancelled = true;
        }
    }

    fn set_draft(
        &mut self,
        draft: Option<&crate::worker::runner_protocol::DraftOrder>,
    ) -> Result<u64, BackendError> {
        self.calls.lock().expect("calls").push("set_draft");
        match draft {
            Some(d) if d.model_id == "other-vocabulary" => Err(BackendError::InvalidRequest(
                "draft model other-vocabulary refused: another vocabulary".into(),
            )),
            Some(d) if d.method == v1::DraftMethod::DraftModel => Ok(4321),
            _ => Ok(0),
        }
    }

    fn busy(&self) -> bool {
        !self.batch.is_empty() && self.batch.len() >= self.first_step_waits_for
    }

    fn step(&mut self, sink: &mut dyn FnMut(EngineEvent)) {
        if let Some(gate) = &self.gate {
            let _ = gate.recv_timeout(Duration::from_secs(10));
        }
        self.first_step_waits_for = 0;
        for generation in &mut self.batch {
            let chunk = |kind| EngineEvent::Chunk {
                task_id: generation.task_id.clone(),
                kind,
            };
            if generation.cancelled || generation.sent == generation.max {
                let reason = if generation.cancelled {
                    v1::FinishReason::Cancelled
                } else {
                    v1::FinishReason::Length
                };
                sink(chunk(generation_chunk::Kind::Finish(v1::FinishChunk {
                    reason: reason as i32,
                    ..Default::default()
                })));
                sink(EngineEvent::Generated {
                    task_id: generation.task_id.clone(),
                    result: Ok(()),
                });
                generation.max = usize::MAX;
                continue;
            }
            let i = generation.sent;
            sink(chunk(generation_chunk::Kind::Token(v1::TokenChunk {
                token_id: i as u32,
                text: format!("t{i}"),
                ..Default::default()
            })));
            generation.sent += 1;
        }
        self.batch.retain(|g| g.max != usize::MAX);
    }

    fn follow(&mut self) -> Result<(), BackendError> {
        self.calls.lock().expect("calls").push("follow");
        Ok(())
    }

    fn shutdown(&mut self) -> Result<(), BackendError> {
        self.calls.lock().expect("calls").push("shutdown");
        Ok(())
    }
}

struct Harness {
    runner: ActorRef<RunnerMsg>,
    out: mpsc::UnboundedReceiver<Out>,
    exit: oneshot::Receiver<RunnerExit>,
    calls: Arc<Mutex<Vec<&'static str>>>,
    last: Option<Rs>,
}

async fn start(rank: usize, world: usize, backend: FakeBackend) -> Harness {
    let (tx, out) = mpsc::unbounded_channel();
    let (exit_tx, exit) = oneshot::channel();
    let calls = backend.calls.clone();
    let started = run(RunnerArgs {
        rank,
        world,
        output: ChannelOutput(tx),
        backend: move || backend,
        exit: exit_tx,
    })
    .await
    .expect("a runner");
    started
        .actor
        .cast(RunnerMsg::Listening)
        .expect("runner alive");
    Harness {
        runner: started.actor,
        out,
        exit,
        calls,
        last: None,
    }
}

fn fake(tokens: usize) -> FakeBackend {
    FakeBackend {
        calls: Arc::default(),
        fail_load: false,
        tokens,
        gate: None,
        batch: Vec::new(),
        first_step_waits_for: 0,
    }
}

impl Harness {
    fn order(&self, order: Order) {
        self.runner
            .cast(RunnerMsg::Order(order))
            .expect("runner alive");
    }

    async fn next(&mut self) -> Out {
        tokio::time::timeout(Duration::from_secs(10), self.out.recv())
            .await
            .expect("output in time")
            .expect("output")
    }

    /// The next status, skipping repeats of the last one (the runner
    /// repeats a status until it hears from the node).
    async fn status(&mut self) -> Rs {
        loop {
            match self.next().await {
                Out::Status(state) if self.last.as_ref() == Some(&state) => {}
                Out::Status(state) => {
                    self.last = Some(state.clone());
                    return state;
                }
                Out::Chunk(chunk) => panic!("a chunk where a status was due: {chunk:?}"),
            }
        }
    }

    async fn chunk(&mut self) -> v1::GenerationChunk {
        match self.next().await {
            Out::Chunk(chunk) => chunk,
            Out::Status(state) => panic!("a status where a chunk was due: {state:?}"),
        }
    }

    async fn exit(self) -> RunnerExit {
        tokio::time::timeout(Duration::from_secs(10), self.exit)
            .await
            .expect("ended in time")
            .expect("an exit")
    }

    /// Idle, then Load and WarmUp orders to Ready.
    async fn walk_to_ready(&mut self) {
        assert!(matches!(self.status().await, Rs::Idle(_)));
        self.order(Order::Load);
        assert!(matches!(self.status().await, Rs::Loading(_)));
        let Rs::Loading(progress) = self.status().await else {
            panic!("no loading progress");
        };
        assert_eq!((progress.layers_loaded, progress.layers_total), (2, 2));
        let Rs::Loaded(loaded) = self.status().await else {
            panic!("not loaded");
        };
        assert_eq!(loaded.resident_bytes, 1234);
        self.order(Order::WarmUp);
        assert!(matches!(self.status().await, Rs::WarmingUp(_)));
        assert!(matches!(self.status().await, Rs::Ready(_)));
    }
}

fn generate(task_id: &str, max_tokens: u32) -> Order {
    Order::Generate {
        task_id: task_id.into(),
        command_id: format!("cmd-{task_id}"),
        params: Box::new(v1::TextGenerationParams {
            raw_prompt: Some("hi".into()),
            sampling: Some(v1::SamplingParams {
                max_tokens: Some(max_tokens),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

fn kind(chunk: &v1::GenerationChunk) -> &generation_chunk::Kind {
    chunk.kind.as_ref().expect("a chunk kind")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_walks_walk_to_ready_runs_generations_in_turn_and_shuts_down() {
    let mut h = start(0, 1, fake(3)).await;
    h.walk_to_ready().await;
    // An order repeated by the node is ignored.
    h.order(Order::WarmUp);
    for task in ["t1", "t2"] {
        h.order(generate(task, 16));
        assert!(matches!(h.status().await, Rs::Running(r) if r.task_id == task));
        for seq in 0..3 {
            let chunk = h.chunk().await;
            assert_eq!(
                (chunk.seq, chunk.command_id.as_str()),
                (seq, &*format!("cmd-{task}"))
            );
            assert!(matches!(kind(&chunk), generation_chunk::Kind::Token(_)));
        }
        let finish = h.chunk().await;
        assert!(matches!(kind(&finish), generation_chunk::Kind::Finish(_)));
        assert!(
            matches!(h.status().await, Rs::Ready(r) if r.ended_task_ids.last().is_some_and(|t| t == task))
        );
    }
    h.order(Order::Shutdown);
    assert!(matches!(h.status().await, Rs::ShuttingDown(_)));
    assert!(matches!(h.status().await, Rs::Shutdown(_)));
    let calls = h.calls.clone();
    assert_eq!(h.exit().await, RunnerExit::Shutdown);
    assert_eq!(
        *calls.lock().expect("calls"),
        ["load", "warm_up", "submit", "submit", "shutdown"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_that_arrive_together_run_in_one_batch_and_end_each_on_its_own() {
    let mut backend = fake(2);
    backend.first_step_waits_for = 2;
    let mut h = start(0, 1, backend).await;
    h.walk_to_ready().await;
    h.order(generate("t1", 16));
    assert!(matches!(h.status().await, Rs::Running(r) if r.task_ids == ["t1"]));
    h.order(generate("t2", 1));
    assert!(matches!(h.status().await, Rs::Running(r) if r.task_ids == ["t1", "t2"]));
    // Step 1: a token of each; step 2: t1's second, t2's end (it asked for
    // one token); step 3: t1's end.
    let mut order = Vec::new();
    for _ in 0..4 {
        let chunk = h.chunk().await;
        let finished = matches!(kind(&chunk), generation_chunk::Kind::Finish(_));
        order.push((chunk.command_id, chunk.seq, finished));
    }
    let expect = |id: &str, seq, finished| (format!("cmd-{id}"), seq, finished);
    assert_eq!(
        order,
        [
            expect("t1", 0, false),
            expect("t2", 0, false),
            expect("t1", 1, false),
            expect("t2", 1, true)
        ]
    );
    let Rs::Running(running) = h.status().await else {
        panic!("t1 still runs");
    };
    assert_eq!(running.task_ids, ["t1"]);
    assert_eq!(running.ended_task_ids, ["t2"]);
    assert!(matches!(
        kind(&h.chunk().await),
        generation_chunk::Kind::Finish(_)
    ));
    let Rs::Ready(ready) = h.status().await else {
        panic!("not ready");
    };
    assert_eq!(ready.ended_task_ids, ["t2", "t1"]);
}

/// A ready runner running generation `t1`, whose every token waits for a
/// send on the gate.
async fn running_held_generation() -> (Harness, std::sync::mpsc::Sender<()>) {
    let (gate_tx, gate) = std::sync::mpsc::channel();
    let mut backend = fake(1000);
    backend.gate = Some(gate);
    let mut h = start(0, 1, backend).await;
    h.walk_to_ready().await;
    h.order(generate("t1", 1000));
    assert!(matches!(h.status().await, Rs::Running(_)));
    (h, gate_tx)
}

/// Lets steps go until the held generation's finish chunk comes (a cancel
/// is taken in between two steps, whichever one is under way).
async fn finish_after_steps(
    h: &mut Harness,
    gate: &std::sync::mpsc::Sender<()>,
) -> v1::FinishChunk {
    for _ in 0..5 {
        gate.send(()).expect("gate");
        let chunk = h.chunk().await;
        if let generation_chunk::Kind::Finish(finish) = kind(&chunk) {
            return *finish;
        }
    }
    panic!("no finish after five steps");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_is_taken_in_while_the_engine_generates() {
    let (mut h, gate_tx) = running_held_generation().await;
    gate_tx.send(()).expect("gate");
    assert!(matches!(
        kind(&h.chunk().await),
        generation_chunk::Kind::Token(_)
    ));
    // The engine thread is inside the generation; the mailbox is free.
    h.order(Order::Cancel {
        task_id: "other".into(),
    });
    h.order(Order::Cancel {
        task_id: "t1".into(),
    });
    let finish = finish_after_steps(&mut h, &gate_tx).await;
    assert_eq!(finish.reason, v1::FinishReason::Cancelled as i32);
    assert!(matches!(h.status().await, Rs::Ready(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_during_a_generation_ends_it_first() {
    let (mut h, gate_tx) = running_held_generation().await;
    h.order(Order::Shutdown);
    let finish = finish_after_steps(&mut h, &gate_tx).await;
    assert_eq!(finish.reason, v1::FinishReason::Cancelled as i32);
    assert!(matches!(h.status().await, Rs::ShuttingDown(_)));
    assert!(matches!(h.status().await, Rs::Shutdown(_)));
    assert_eq!(h.exit().await, RunnerExit::Shutdown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_gets_an_invalid_request_chunk_and_the_runner_stays_ready() {
    let mut h = start(0, 1, fake(3)).await;
    h.walk_to_ready().await;
    h.order(Order::Generate {
        task_id: "t1".into(),
        command_id: "c1".into(),
        params: Box::default(),
    });
    let chunk = h.chunk().await;
    let generation_chunk::Kind::Error(error) = kind(&chunk) else {
        panic!("not an error: {chunk:?}");
    };
    assert_eq!(error.kind, "invalid_request");
    assert!(matches!(h.status().await, Rs::Ready(r) if r.ended_task_ids == ["t1"]));
    assert!(!h.calls.lock().expect("calls").contains(&"submit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_is_runner_failed_and_ends_the_runner() {
    let mut backend = fake(3);
    backend.fail_load = true;
    let mut h = start(0, 1, backend).await;
    assert!(matches!(h.status().await, Rs::Idle(_)));
    h.order(Order::Load);
    assert!(matches!(h.status().await, Rs::Loading(_)));
    let Rs::Failed(failed) = h.status().await else {
        panic!("not failed");
    };
    assert_eq!(failed.reason, "no such file");
    assert_eq!(h.exit().await, RunnerExit::Failed("no such file".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_joins_the_ring_loads_follows_and_ends_with_rank_0() {
    let mut h = start(1, 2, fake(0)).await;
    assert!(matches!(h.status().await, Rs::Idle(_)));
    // Loading before joining the ring is out of turn for several ranks.
    h.order(Order::Load);
    h.order(Order::Connect);
    assert!(matches!(h.status().await, Rs::Connecting(_)));
    assert!(matches!(h.status().await, Rs::Connected(_)));
    h.order(Order::Connect);
    h.order(Order::Load);
    assert!(matches!(h.status().await, Rs::Loading(_)));
    assert!(matches!(h.status().await, Rs::Loading(_)));
    assert!(matches!(h.status().await, Rs::Loaded(_)));
    h.order(Order::WarmUp);
    assert!(matches!(h.status().await, Rs::WarmingUp(_)));
    assert!(matches!(h.status().await, Rs::Ready(_)));
    // The fake's follow returns at once, as when rank 0 shuts down.
    assert!(matches!(h.status().await, Rs::Shutdown(_)));
    let calls = h.calls.clone();
    assert_eq!(h.exit().await, RunnerExit::Shutdown);
    assert_eq!(
        *calls.lock().expect("calls"),
        ["connect", "load", "warm_up", "follow"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_is_repeated_until_the_node_is_heard_from_and_a_lost_node_ends_it() {
    let mut h = start(0, 1, fake(3)).await;
    for _ in 0..2 {
        assert!(matches!(h.next().await, Out::Status(Rs::Idle(_))));
    }
    h.order(Order::Load);
    assert!(matches!(h.status().await, Rs::Loading(_)));
    h.runner.cast(RunnerMsg::NodeGone).expect("runner alive");
    assert_eq!(h.exit().await, RunnerExit::NodeGone);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_0_sets_a_draft_once_reports_it_and_a_refused_one_with_why() {
    use crate::worker::runner_protocol::DraftOrder;
    let mut h = start(0, 1, fake(3)).await;
    h.walk_to_ready().await;
    let order = |method: v1::DraftMethod, model: &str, tokens: u32| DraftOrder {
        method,
        model_id: model.into(),
        tokens,
        path: Some("/models/draft.gguf".into()),
    };
    let draft_of = |state: Rs| match state {
        Rs::Ready(r) => r.draft,
        other => panic!("not ready: {other:?}"),
    };
    h.order(Order::SetDraft(Some(order(v1::DraftMethod::Ngram, "", 4))));
    // Repeated by the node before it is set: not sent again.
    h.order(Order::SetDraft(Some(order(v1::DraftMethod::Ngram, "", 4))));
    let draft = draft_of(h.status().await).expect("a draft");
    assert_eq!(
        (draft.method(), draft.num_draft_tokens),
        (v1::DraftMethod::Ngram, 4)
    );
    assert!(draft.active && draft.error.is_empty());
    h.order(Order::SetDraft(Some(order(
        v1::DraftMethod::DraftModel,
        "small",
        2,
    ))));
    let draft = draft_of(h.status().await).expect("a draft");
    assert_eq!(
        (draft.draft_model.as_str(), draft.resident_bytes),
        ("small", 4321)
    );
    // Refused: named, inactive, with the reason.
    h.order(Order::SetDraft(Some(order(
        v1::DraftMethod::DraftModel,
        "other-vocabulary",
        4,
    ))));
    let draft = draft_of(h.status().await).expect("a draft");
    assert!(!draft.active);
    assert!(
        draft.error.contains("another vocabulary"),
        "{}",
        draft.error
    );
    // The same refused draft again is not tried again.
    h.order(Order::SetDraft(Some(order(
        v1::DraftMethod::DraftModel,
        "other-vocabulary",
        4,
    ))));
    h.order(Order::SetDraft(None));
    assert_eq!(draft_of(h.status().await), None);
    let sets = h
        .calls
        .lock()
        .expect("calls")
        .iter()
        .filter(|c| **c == "set_draft")
        .count();
    assert_eq!(sets, 4, "each draft set once");
    // Generations run with it as before.
    h.order(generate("t1", 16));
    assert!(matches!(h.status().await, Rs::Running(_)));
}
