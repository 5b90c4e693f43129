//! Continuous batching: many requests on one model, one forward pass per
//! step over all of them (Orca's iteration-level scheduling, vLLM's paged
//! KV cache).
//!
//! [`Batch`] holds the waiting and running sequences of one instance. Each
//! [`Batch::step`] admits what fits (at most `max_sequences`, FIFO, blocks
//! for the whole request reserved up front so a running sequence never runs
//! out), plans the step ([`plan_step`]: one token per decoding sequence,
//! then prefill chunks in arrival order up to the step's token budget),
//! runs it on every rank through the [`Executor`], and hands each sequence
//! its logits: sampling, stop strings, UTF-8, parsers and logprobs are per
//! sequence ([`Decoder`]). A sequence's tokens do not depend on the others
//! (the forward pass is batch invariant), so any concurrency gives each
//! request what it gets alone.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::time::Instant;

use crate::logits::{BestRows, BestView};
use crate::model::paged::{blocks_for, BlockId, BlockManager, PoolError, BLOCK_TOKENS};
use crate::model::transformer::RowOutput;
use crate::model::SeqSpan;
use crate::serve::executor::Executor;
use crate::serve::sampler::Sampler;
use crate::serve::speculative::{verify, DraftCounts, Speculation};
use crate::serve::{
    EngineError, GenerateRequest, GenerationEvent, GenerationOutput, GenerationStats, LoadedModel,
};
use tessera_grammar::TokenMask;

mod decoder;
mod plan;
mod speculate;

use decoder::Row;
use speculate::{DraftWant, SeqDraft, SpecState};

pub use decoder::Decoder;
pub use plan::{plan_step, Planned, SeqState};

/// A request's handle in a batch, chosen by the caller.
pub type SeqId = u64;

/// How much one instance takes on at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// Sequences running at once; the rest wait.
    pub max_sequences: usize,
    /// Tokens per forward pass: decoding sequences first, then prefill
    /// chunks (llama.cpp's `n_batch`, vLLM's `max_num_batched_tokens`).
    pub step_tokens: usize,
    /// Blocks of [`BLOCK_TOKENS`] positions in the KV pool.
    pub kv_blocks: usize,
}

impl BatchConfig {
    /// `max_sequences` at once, each with room for `context` positions.
    pub fn for_context(max_sequences: usize, context: usize) -> Self {
        let max_sequences = max_sequences.max(1);
        Self {
            max_sequences,
            step_tokens: DEFAULT_STEP_TOKENS.max(max_sequences),
            kv_blocks: max_sequences * blocks_for(context),
        }
    }
}

/// The default step budget: long enough for prefill to run near its full
/// speed, short enough that a new prompt holds the others' next tokens up
/// by a fraction of a second.
pub const DEFAULT_STEP_TOKENS: usize = 128;

/// What a step tells the caller about one sequence.
#[derive(Debug)]
pub enum SeqEvent<'a> {
    /// Progress, tokens and parsed output, as [`crate::serve::Session::generate`] streams
    /// them ([`crate::serve::Session`]).
    Generation(GenerationEvent<'a>),
    /// The sequence is done (finished, stopped or cancelled).
    Finished(GenerationOutput),
    /// The step failed (a rank died, a kernel failed): every running and
    /// waiting sequence gets this, and the step returns the error.
    Failed(&'a str),
}

struct Waiting {
    id: SeqId,
    request: GenerateRequest,
    prompt: Vec<u32>,
    /// The request's constraint, compiled on submit.
    constraint: Option<TokenMask>,
    submitted: Instant,
}

struct Running {
    id: SeqId,
    request: GenerateRequest,
    /// Prompt and generated tokens; positions `0..computed` have keys and
    /// values.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Where its prefill ends: the prompt's end, or later once its earlier
    /// positions are computed again (see [`Running::refill_if_switching`]);
    /// also the length RoPE takes its prompt tokens to have.
    prefill_end: usize,
    /// LongRoPE's original context, while its positions so far used the
    /// short factors (see `ModelConfig::rope_switch`).
    rope_switch: Option<usize>,
    computed: usize,
    /// Positions that came from the prefix cache.
    cached: usize,
    table: Vec<BlockId>,
    chain: Vec<[u8; 32]>,
    /// Its slot of recurrent state (hybrid models).
    state: usize,
    decoder: Decoder,
    submitted: Instant,
    prefill_done: Option<Instant>,
    cancelled: bool,
    /// In a launched step not collected yet.
    in_flight: bool,
    /// The launch it was last in (0: none yet).
    launched_at: u64,
    /// Speculative decoding: its drafts and their acceptance.
    draft: SeqDraft,
    counts: DraftCounts,
}

/// One sequence's share of a launched step.
#[derive(Clone, Copy, Debug)]
struct Part {
    id: SeqId,
    len: usize,
    /// Rows of logits it gets back.
    logits: usize,
    /// Its next token and `len - 1` drafts (else a prompt chunk).
    decode: bool,
}

/// A step launched on the executor, waiting to be collected.
struct Launch {
    parts: Vec<Part>,
    wants_logits: bool,
    /// Rows of logits it wants: on a pipeline, the last stage sends rank 0
    /// their final-normed hidden states.
    logits_rows: usize,
    output: RowOutput,
    tokens: usize,
    started: Instant,
}

/// The most tokens a step may have to be launched while another that
/// wants logits is in flight: its hidden states (a few KB a token) then fit
/// in the ring's socket buffers, so rank 0 never blocks sending them while
/// the last stage blocks sending it its rows.
const OVERLAP_TOKENS: usize = 32;

/// The most bytes of rows a step in flight may send rank 0 back for a
/// step of any size to be launched behind it: they then fit in the ring's
/// socket buffers (a Linux connection starts with a 16 KiB send buffer and
/// a 64 KiB receive window), so the last stage never blocks sending them,
/// whatever rank 0 is blocked on, and every send of the ring completes.
/// A prompt's last chunk wants one row (2.3 KB for SmolLM2-135M, 16 KiB
/// at a hidden size of 4096): long prompts then fill both stages.
const OVERLAP_RETURN_BYTES: usize = 16 * 1024;

impl Running {
    fn state(&self) -> SeqState {
        SeqState {
            computed: self.computed,
            tokens: self.tokens.len(),
            prompt: self.prefill_end,
            chunk: self.request.prefill_chunk.max(1),
            draft: self.draft.tokens.len(),
        }
    }

    fn is_decoding(&self) -> bool {
        self.computed >= self.prefill_end && self.computed < self.tokens.len()
    }

    /// The most drafts it may check now: each accepted one is a token of
    /// its request, and its blocks hold every position up to the last; a
    /// step stops short of LongRoPE's switch to the long factors.
    fn draft_room(&self) -> usize {
        let generated = self.tokens.len() - self.prompt_len;
        let room = self.request.max_tokens.saturating_sub(generated + 1);
        match self.rope_switch {
            Some(switch) => room.min(switch.saturating_sub(self.computed + 1)),
            None => room,
        }
    }

    /// LongRoPE: a decoding sequence about to outgrow the original context
    /// has its positions so far computed again with the long factors,
    /// the token it decodes with them (as transformers' Phi-3 `generate`
    /// does, dropping its cache at that length): its prefill is then every
    /// token so far, and RoPE takes them all to be that long.
    fn refill_if_switching(&mut self) {
        let Some(switch) = self.rope_switch else {
            return;
        };
        if self.is_decoding() && self.computed >= switch {
            self.prefill_end = self.computed + 1;
            self.computed = 0;
            self.rope_switch = None;
        }
    }
}

/// The sequences of one instance and the engine they run on (rank 0).
pub struct Batch<'m> {
    model: &'m LoadedModel,
    executor: Executor<'m>,
    config: BatchConfig,
    blocks: BlockManager,
    /// Recurrent-state slots no running sequence holds; slot
    /// `max_sequences` is [`Batch::logits_for`]'s.
    free_states: Vec<usize>,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    cancelled_waiting: Vec<SeqId>,
    /// Requests that only count their prompt: their counts, to finish at
    /// the next step.
    counted: Vec<(SeqId, usize)>,
    /// Requests admission could not take after all, told at the next step.
    refused: Vec<(SeqId, String)>,
    // Reused every step.
    planned: Vec<Planned>,
    step_tokens: Vec<u32>,
    logits: Vec<f32>,
    best: BestRows,
    launches: VecDeque<Launch>,
    launch_clock: u64,
    speculation: Option<SpecState>,
    /// The last speculation's measurements while it is off.
    dormant: Option<SpecState>,
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m LoadedModel, executor: Executor<'m>, config: BatchConfig) -> Self {
        let config = BatchConfig {
            max_sequences: config.max_sequences.max(1),
            step_tokens: config.step_tokens.max(config.max_sequences).max(1),
            kv_blocks: config.kv_blocks.max(1),
        };
        Self {
            model,
            executor,
            blocks: BlockManager::new(config.kv_blocks),
            free_states: (0..config.max_sequences).rev().collect(),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cancelled_waiting: Vec::new(),
            counted: Vec::new(),
            refused: Vec::new(),
            planned: Vec::new(),
            step_tokens: Vec::new(),
            logits: Vec::new(),
            best: BestRows::default(),
            launches: VecDeque::new(),
            launch_clock: 0,
            speculation: None,
            dormant: None,
        }
    }

    /// Turns speculative decoding on (with its drafts' source) or off, for
    /// the next steps; a step in flight finishes as it was planned.
    /// `max_draft_tokens` 0 is off.
    /// A hybrid model never speculates: its recurrent state cannot be
    /// rolled back past rejected drafts.
    pub fn set_speculation(&mut self, speculation: Option<Speculation>) {
        let speculation = speculation.filter(|_| !self.model.transformer.has_recurrent_state());
        if let Some(old) = self.speculation.as_mut().and_then(|s| s.draft.as_mut()) {
            for seq in &mut self.running {
                old.release(&mut seq.draft);
            }
        }
        for seq in &mut self.running {
            seq.draft.lengths = Default::default();
            seq.draft.shadow = None;
        }
        // Turned off, what it learned waits for it to come back on.
        let previous = self.speculation.take().or(self.dormant.take());
        match speculation.filter(|s| s.max_draft_tokens > 0) {
            Some(next) => {
                self.speculation = Some(SpecState::after(previous, next, self.config.kv_blocks))
            }
            None => self.dormant = previous.map(SpecState::dormant),
        }
    }

    /// What a step costs here as speculation measured it: (seconds fixed,
    /// seconds per token).
    pub fn step_cost(&self) -> Option<(f64, f64)> {
        self.speculation.as_ref().and_then(|s| s.cost.fitted())
    }

    /// The speculative decoding in force.
    pub fn speculation(&self) -> Option<&Speculation> {
        self.speculation.as_ref().map(|s| &s.config)
    }

    pub fn config(&self) -> BatchConfig {
        self.config
    }

    /// The executor (for shutting a distributed instance down).
    pub fn executor(&mut self) -> &mut Executor<'m> {
        &mut self.executor
    }

    /// The executor back, once the batch is done with.
    pub fn into_executor(self) -> Executor<'m> {
        self.executor
    }

    /// Nothing waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.cancelled_waiting.is_empty()
            && self.counted.is_empty()
            && self.refused.is_empty()
            && self.launches.is_empty()
    }

    /// Sequences running now, and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// Forgets every cached prefix (the next requests start cold).
    pub fn clear_cache(&mut self) {
        if self.running.is_empty() {
            self.blocks = BlockManager::new(self.config.kv_blocks);
            if let Some(draft) = self.speculation.as_mut().and_then(|s| s.draft.as_mut()) {
                draft.blocks = BlockManager::new(self.config.kv_blocks);
            }
        }
    }

    /// Queues a request. Whatever makes it impossible (an empty prompt, a
    /// template error, more tokens than the context or the whole KV pool)
    /// is its error now; the other sequences are not touched.
    pub fn submit(&mut self, id: SeqId, mut request: GenerateRequest) -> Result<(), EngineError> {
        if request.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        let sampling = std::mem::take(&mut request.sampling);
        request.sampling = self
            .model
            .sampling_defaults
            .fill(sampling, &request.left_to_model);
        request.sampling.validate()?;
        let vocab = self.model.transformer.config.vocab;
        request.sampling.validate_for_vocabulary(vocab)?;
        let prompt = self.model.tokenize(&request.prompt)?;
        if request.count_only {
            self.counted.push((id, prompt.len()));
            return Ok(());
        }
        let context = self.model.transformer.config.context_length;
        let needed = prompt.len() + request.max_tokens;
        if prompt.len() >= context || needed > context {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                max_tokens: request.max_tokens,
                needed,
                context,
            });
        }
        let capacity = self.blocks.capacity() * BLOCK_TOKENS;
        if blocks_for(positions(prompt.len(), request.max_tokens)) > self.blocks.capacity() {
            return Err(EngineError::BeyondKvCache {
                prompt: prompt.len(),
                max_tokens: request.max_tokens,
                capacity,
            });
        }
        let constraint = match self.model.request_constraint(&request)? {
            Some(constraint) => Some(self.model.constrain(&constraint)?),
            None => None,
        };
        self.waiting.push_back(Waiting {
            id,
            request,
            prompt,
            constraint,
            submitted: Instant::now(),
        });
        Ok(())
    }

    /// Ends a sequence at the next step, as cancelled.
    pub fn cancel(&mut self, id: SeqId) {
        if let Some(index) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(index);
            self.cancelled_waiting.push(id);
        }
        if let Some(running) = self.running.iter_mut().find(|r| r.id == id) {
            running.cancelled = true;
        }
    }

    /// Admits what fits, runs one forward pass over the batch and hands
    /// each sequence its events. `sink` may return `Break` to cancel that
    /// sequence. An error of the step fails every running and waiting
    /// sequence (each hears it as [`SeqEvent::Failed`]) and is returned.
    ///
    /// On a pipeline ([`Executor::overlaps_steps`]) the batch runs as two
    /// micro-batches, one in flight while the other is launched: a call
    /// launches one and collects the older, so every stage has work.
    pub fn step(
        &mut self,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) -> Result<(), EngineError> {
        self.finish_cancelled(sink);
        self.admit();
        let depth = if self.executor.overlaps_steps() { 2 } else { 1 };
        // Overlapped, the oldest is collected before the next launch: the
        // last stage (the slower one, with the head) then finds rank 0
        // reading when it sends, and never waits to send.
        if self.launches.len() >= depth {
            self.collect_oldest(sink)?;
        }
        let launched = match self.launch_next() {
            Ok(launched) => launched,
            Err(error) => return Err(self.fail(error, sink)),
        };
        if (depth == 1 && launched) || (!launched && !self.launches.is_empty()) {
            self.collect_oldest(sink)?;
        }
        Ok(())
    }

    /// Plans and launches a step over the sequences not in flight; false
    /// when there is nothing to launch (or it must wait for the one in
    /// flight).
    fn launch_next(&mut self) -> Result<bool, crate::serve::executor::ExecError> {
        let mut idle: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].in_flight)
            .collect();
        // Longest since its last step first, so micro-batches take turns.
        idle.sort_by_key(|&i| self.running[i].launched_at);
        // Two micro-batches when steps overlap: each takes half the batch.
        let cap = if self.executor.overlaps_steps() {
            self.running.len().div_ceil(2)
        } else {
            idle.len()
        };
        let candidates = &idle[..cap.min(idle.len())];
        for &i in candidates {
            self.running[i].draft.tokens.clear();
            self.running[i].refill_if_switching();
        }
        let mut states: Vec<SeqState> = candidates
            .iter()
            .map(|&i| self.running[i].state())
            .collect();
        plan_step(&states, self.config.step_tokens, &mut self.planned);
        if self.speculation.is_some() {
            self.propose_drafts(candidates)?;
            for (state, &i) in states.iter_mut().zip(candidates) {
                state.draft = self.running[i].draft.tokens.len();
            }
            plan_step(&states, self.config.step_tokens, &mut self.planned);
        }
        let tokens: usize = self.planned.iter().map(|p| p.len).sum();
        let logits_rows: usize = self.planned.iter().map(|p| p.logits).sum();
        let wants_logits = logits_rows > 0;
        if tokens == 0 || !self.may_overlap(tokens) {
            return Ok(false);
        }
        self.step_tokens.clear();
        let mut parts = Vec::with_capacity(self.planned.len());
        for planned in &self.planned {
            let seq = &self.running[candidates[planned.index]];
            let decode = seq.is_decoding();
            if decode {
                self.step_tokens.push(seq.tokens[seq.computed]);
                self.step_tokens
                    .extend_from_slice(&seq.draft.tokens[..planned.len - 1]);
            } else {
                self.step_tokens
                    .extend_from_slice(&seq.tokens[seq.computed..seq.computed + planned.len]);
            }
            parts.push(Part {
                id: seq.id,
                len: planned.len,
                logits: planned.logits,
                decode,
            });
        }
        let spans: Vec<SeqSpan<'_>> = self
            .planned
            .iter()
            .map(|p| {
                let seq = &self.running[candidates[p.index]];
                SeqSpan {
                    start: seq.computed,
                    len: p.len,
                    table: &seq.table,
                    prompt: seq.prefill_end,
                    logits: p.logits,
                    state: seq.state,
                }
            })
            .collect();
        let output = self.row_output(candidates);
        let started = Instant::now();
        self.executor.launch(&spans, &self.step_tokens, output)?;
        self.launch_clock += 1;
        for planned in &self.planned {
            let seq = &mut self.running[candidates[planned.index]];
            seq.in_flight = true;
            seq.launched_at = self.launch_clock;
        }
        self.launches.push_back(Launch {
            parts,
            wants_logits,
            logits_rows,
            output,
            tokens,
            started,
        });
        Ok(true)
    }

    /// What the planned step wants of its rows: only their best tokens
    /// when every row's sampling needs no more (a tensor rank then sends
    /// that rather than its share of the vocabulary), their top candidates
    /// when that is all every row's needs (a GPU then reads back those
    /// rather than the vocabulary), else the logits.
    fn row_output(&self, candidates: &[usize]) -> RowOutput {
        let decoders = || {
            self.planned
                .iter()
                .filter(|p| p.logits > 0)
                .map(|p| &self.running[candidates[p.index]].decoder)
        };
        if decoders().all(Decoder::needs_only_best) {
            RowOutput::BestTokens
        } else if decoders().all(Decoder::needs_only_candidates) {
            RowOutput::TopCandidates
        } else {
            RowOutput::Logits
        }
    }

    /// Drafts for the decoding sequences among `candidates` that speculate,
    /// in a step that has `self.planned`'s tokens without them.
    fn propose_drafts(
        &mut self,
        candidates: &[usize],
    ) -> Result<(), crate::serve::executor::ExecError> {
        let Some(spec) = self.speculation.as_mut() else {
            return Ok(());
        };
        let base: usize = self.planned.iter().map(|p| p.len).sum();
        let mut wants: Vec<DraftWant<'_>> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, seq)| {
                candidates.contains(i) && seq.request.speculative && seq.is_decoding()
            })
            .map(|(_, seq)| DraftWant {
                room: seq.draft_room(),
                reserve_positions: positions(seq.prompt_len, seq.request.max_tokens),
                reuse_prefix: seq.request.reuse_prefix,
                prompt_len: seq.prompt_len,
                tokens: &seq.tokens,
                draft: &mut seq.draft,
            })
            .collect();
        spec.propose(&self.executor, base, &mut wants)
    }

    /// A second step may go out before the first is collected only when
    /// the sends cannot all block on each other: the first asks for no
    /// logits (nothing comes back to rank 0) or for rows that fit in the
    /// socket buffers, or the second is small enough for them.
    fn may_overlap(&self, tokens: usize) -> bool {
        let row_bytes = self.model.transformer.config.hidden * std::mem::size_of::<f32>();
        self.launches
            .iter()
            .all(|l| l.logits_rows * row_bytes <= OVERLAP_RETURN_BYTES || tokens <= OVERLAP_TOKENS)
    }

    /// Collects the oldest launched step and advances its sequences.
    fn collect_oldest(
        &mut self,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) -> Result<(), EngineError> {
        let Some(launch) = self.launches.pop_front() else {
            return Ok(());
        };
        let mut logits = std::mem::take(&mut self.logits);
        let mut best = std::mem::take(&mut self.best);
        let rows = match self.executor.collect_into(&mut logits, &mut best) {
            Ok(rows) => rows.unwrap_or(0),
            Err(error) => {
                self.logits = logits;
                self.best = best;
                return Err(self.fail(error, sink));
            }
        };
        if let Some(spec) = self.speculation.as_mut() {
            // Overlapped steps wait on each other: their times say little.
            if !self.executor.overlaps_steps() && launch.wants_logits {
                spec.cost
                    .observe(launch.tokens, launch.started.elapsed().as_secs_f64());
            }
        }
        let vocab = self.model.transformer.config.vocab;
        let step_rows = match launch.output {
            RowOutput::Logits => StepRows::Logits {
                values: &mut logits[..rows * vocab],
                vocab,
            },
            RowOutput::BestTokens | RowOutput::TopCandidates => {
                StepRows::Best(best.view().split_front(rows).0)
            }
        };
        self.after_step(&launch.parts, step_rows, sink);
        self.logits = logits;
        self.best = best;
        Ok(())
    }

    /// Fails everything after a failed step; the error to return.
    fn fail(
        &mut self,
        error: crate::serve::executor::ExecError,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) -> EngineError {
        let error = EngineError::from(error);
        self.launches.clear();
        self.fail_all(&error.to_string(), sink);
        error
    }

    /// Whether a running sequence is still computing the prompt blocks that
    /// `reusable` (the part of a waiting prompt it may take from the cache)
    /// begins with. The waiting one then waits for that prefill and takes
    /// those blocks from the prefix cache instead of computing them again:
    /// the n answers of one request, requests with one system prompt.
    fn prefilling_shares(&self, reusable: &[u32]) -> bool {
        self.running.iter().any(|r| {
            let prompt = &r.tokens[..r.prompt_len.min(r.tokens.len())];
            let common = prompt
                .iter()
                .zip(reusable)
                .take_while(|(a, b)| a == b)
                .count();
            let shared = common - common % BLOCK_TOKENS;
            !r.cancelled && shared > 0 && r.computed < shared
        })
    }

    /// Moves waiting requests in, oldest first, while there is room.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_sequences {
            let Some(next) = self.waiting.front() else {
                return;
            };
            // A hybrid model's recurrent state is not in blocks to share;
            // with dynamic RoPE a block's keys depend on its prompt's length.
            let model = &self.model.transformer;
            let shareable = !model.has_recurrent_state() && !model.config.rope_depends_on_length();
            let reuse_limit = if next.request.reuse_prefix && shareable {
                next.prompt.len() - 1
            } else {
                0
            };
            if self.prefilling_shares(&next.prompt[..reuse_limit]) {
                // Its shared blocks are on their way to the prefix cache.
                return;
            }
            let total = positions(next.prompt.len(), next.request.max_tokens);
            let admitted = match self.blocks.admit(&next.prompt, total, reuse_limit) {
                Ok(admitted) => admitted,
                // The oldest waits for blocks; the younger wait behind it.
                Err(PoolError::Busy { .. }) => return,
                Err(error @ PoolError::TooLarge { .. }) => {
                    // Checked on submit against the same capacity; never
                    // dropped without a word all the same.
                    if let Some(waiting) = self.waiting.pop_front() {
                        self.refused.push((waiting.id, error.to_string()));
                    }
                    continue;
                }
            };
            let Some(state) = self.free_states.pop() else {
                self.blocks.release(&admitted.table);
                return;
            };
            let Some(mut waiting) = self.waiting.pop_front() else {
                self.free_states.push(state);
                self.blocks.release(&admitted.table);
                return;
            };
            let vocab = self.model.transformer.config.vocab;
            let sampler = match Sampler::new(waiting.request.sampling.clone(), vocab) {
                Ok(sampler) => sampler,
                // Validated on submit.
                Err(error) => {
                    self.blocks.release(&admitted.table);
                    self.free_states.push(state);
                    self.refused.push((waiting.id, error.to_string()));
                    continue;
                }
            };
            let decoding = (sampler, waiting.constraint.take());
            let decoder = Decoder::new(self.model, &waiting.request, decoding, &waiting.prompt);
            let switch = self.model.transformer.config.rope_switch();
            self.running.push(Running {
                id: waiting.id,
                prompt_len: waiting.prompt.len(),
                prefill_end: waiting.prompt.len(),
                rope_switch: switch.filter(|&s| waiting.prompt.len() <= s),
                tokens: waiting.prompt,
                computed: admitted.cached_positions,
                cached: admitted.cached_positions,
                table: admitted.table,
                chain: admitted.chain,
                state,
                decoder,
                submitted: waiting.submitted,
                prefill_done: None,
                cancelled: false,
                in_flight: false,
                launched_at: 0,
                request: waiting.request,
                draft: SeqDraft::default(),
                counts: DraftCounts::default(),
            });
        }
    }

    /// Advances every sequence of the step: progress, sampling, endings.
    fn after_step(
        &mut self,
        parts: &[Part],
        mut step_rows: StepRows<'_>,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) {
        let mut ended = Vec::new();
        for part in parts {
            let rows = step_rows.take_front(part.logits);
            let Some(index) = self.running.iter().position(|r| r.id == part.id) else {
                continue;
            };
            let seq = &mut self.running[index];
            seq.in_flight = false;
            let mut done = if part.decode {
                self.advance_decode(index, part, rows, sink)
            } else {
                self.advance_prefill(index, part, rows, sink)
            };
            let seq = &mut self.running[index];
            if done || seq.cancelled {
                seq.decoder.cancel();
                done = true;
            }
            if done {
                ended.push(index);
            }
        }
        ended.sort_unstable();
        ended.dedup();
        for index in ended.into_iter().rev() {
            let mut seq = self.running.remove(index);
            self.release(&mut seq);
            finish(seq, sink);
        }
    }

    /// A prompt chunk: its progress, and the first token once the prompt
    /// is in. True when the sequence has ended.
    fn advance_prefill(
        &mut self,
        index: usize,
        part: &Part,
        mut rows: StepRows<'_>,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) -> bool {
        let model = self.model;
        let seq = &mut self.running[index];
        seq.computed += part.len;
        self.blocks
            .register(&seq.table, &seq.tokens[..seq.computed], &mut seq.chain);
        let id = seq.id;
        // A refill (LongRoPE's switch) is no prompt progress to report.
        if seq.prefill_done.is_none() {
            let event = GenerationEvent::PrefillProgress {
                done: seq.computed - seq.cached,
                total: seq.prompt_len - seq.cached,
            };
            if sink(id, SeqEvent::Generation(event)).is_break() {
                return true;
            }
        }
        if seq.computed == seq.prompt_len && seq.prefill_done.is_none() {
            seq.prefill_done = Some(Instant::now());
        }
        if part.logits == 0 {
            return false;
        }
        let next = seq
            .decoder
            .next(model, rows.row(0), &seq.tokens, &mut |event| {
                sink(id, SeqEvent::Generation(event))
            });
        match next {
            Some(token) => {
                seq.tokens.push(token);
                false
            }
            None => true,
        }
    }

    /// A decode step: its next token's logits, and those after each of its
    /// drafts, checked in order ([`verify`]); the cache keeps the positions
    /// of the tokens accepted. True when the sequence has ended.
    fn advance_decode(
        &mut self,
        index: usize,
        part: &Part,
        mut rows: StepRows<'_>,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) -> bool {
        let model = self.model;
        let seq = &mut self.running[index];
        let id = seq.id;
        let drafts = part.len - 1;
        let before = seq.tokens.len();
        let mut ended = false;
        let draft = seq.draft.tokens.get(..drafts).unwrap_or_default();
        let accepted = verify(draft, |i| {
            let next = seq
                .decoder
                .next(model, rows.row(i), &seq.tokens, &mut |event| {
                    sink(id, SeqEvent::Generation(event))
                });
            match next {
                Some(token) => seq.tokens.push(token),
                None => ended = true,
            }
            next
        });
        seq.counts.steps += 1;
        seq.counts.drafted += drafts;
        seq.counts.accepted += accepted;
        if let Some(spec) = self.speculation.as_mut() {
            if drafts > 0 {
                spec.observe(&mut seq.draft, drafts, accepted);
            } else if let (Some(shadow), Some(&token)) =
                (seq.draft.shadow.take(), seq.tokens.get(before))
            {
                spec.observe(&mut seq.draft, 1, usize::from(shadow == token));
            }
        }
        if ended {
            return true;
        }
        seq.computed += 1 + accepted;
        self.blocks
            .register(&seq.table, &seq.tokens[..seq.computed], &mut seq.chain);
        if let Some(draft) = self.speculation.as_mut().and_then(|s| s.draft.as_mut()) {
            draft.settle(&mut seq.draft, &seq.tokens, seq.computed);
        }
        false
    }

    /// Gives a sequence's blocks back, the draft model's too.
    fn release(&mut self, seq: &mut Running) {
        self.blocks.release(&seq.table);
        self.free_states.push(seq.state);
        if let Some(draft) = self.speculation.as_mut().and_then(|s| s.draft.as_mut()) {
            draft.release(&mut seq.draft);
        }
    }

    fn finish_cancelled(&mut self, sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>) {
        for (id, reason) in std::mem::take(&mut self.refused) {
            let _ = sink(id, SeqEvent::Failed(&reason));
        }
        for id in self.cancelled_waiting.drain(..) {
            let _ = sink(
                id,
                SeqEvent::Finished(GenerationOutput::cancelled_before_start()),
            );
        }
        for (id, prompt_tokens) in std::mem::take(&mut self.counted) {
            let _ = sink(
                id,
                SeqEvent::Finished(GenerationOutput::counted(prompt_tokens)),
            );
        }
        let mut index = 0;
        while index < self.running.len() {
            // One in flight ends when its step is collected.
            if self.running[index].cancelled && !self.running[index].in_flight {
                let mut seq = self.running.remove(index);
                seq.decoder.cancel();
                self.release(&mut seq);
                finish(seq, sink);
            } else {
                index += 1;
            }
        }
    }

    fn fail_all(
        &mut self,
        message: &str,
        sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>,
    ) {
        for mut seq in std::mem::take(&mut self.running) {
            self.release(&mut seq);
            let _ = sink(seq.id, SeqEvent::Failed(message));
        }
        // What waits would meet the same broken engine.
        for waiting in self.waiting.drain(..) {
            let _ = sink(waiting.id, SeqEvent::Failed(message));
        }
    }

    /// Runs `tokens` from an empty cache, nothing shared or kept, and
    /// returns the logits after the last one (for comparisons against
    /// reference engines).
    pub fn logits_for(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        let admitted =
            self.blocks
                .admit(tokens, tokens.len(), 0)
                .map_err(|_| EngineError::BeyondKvCache {
                    prompt: tokens.len(),
                    max_tokens: 0,
                    capacity: self.blocks.capacity() * BLOCK_TOKENS,
                })?;
        let span = SeqSpan {
            start: 0,
            len: tokens.len(),
            table: &admitted.table,
            prompt: tokens.len(),
            logits: 1,
            state: self.config.max_sequences,
        };
        let result = self.executor.step(&[span], tokens);
        self.blocks.release(&admitted.table);
        match result {
            Ok(Some(logits)) => Ok(logits),
            Ok(None) => Err(EngineError::Forward(
                crate::model::transformer::ForwardError::NotLastStage,
            )),
            Err(error) => Err(error.into()),
        }
    }
}

/// A collected step's rows, part after part: logits, or their best tokens
/// and maybe their candidates ([`RowOutput`]).
enum StepRows<'a> {
    Logits { values: &'a mut [f32], vocab: usize },
    Best(BestView<'a>),
}

impl<'a> StepRows<'a> {
    /// Splits off the first `count` rows (one part's).
    fn take_front(&mut self, count: usize) -> StepRows<'a> {
        match self {
            StepRows::Logits { values, vocab } => {
                let all = std::mem::take(values);
                let (front, back) = all.split_at_mut(count * *vocab);
                *values = back;
                StepRows::Logits {
                    values: front,
                    vocab: *vocab,
                }
            }
            StepRows::Best(best) => {
                let (front, back) = best.split_front(count);
                *best = back;
                StepRows::Best(front)
            }
        }
    }

    /// Row `i`, for its sequence's decoder.
    fn row(&mut self, i: usize) -> Row<'_> {
        match self {
            StepRows::Logits { values, vocab } => {
                Row::Logits(&mut values[i * *vocab..(i + 1) * *vocab])
            }
            StepRows::Best(best) => {
                let (token, candidates) = best.row(i);
                Row::Best(token, candidates)
            }
        }
    }
}

/// Positions a request can fill: its prompt and every generated token but
/// the last, which is never fed back.
fn positions(prompt: usize, max_tokens: usize) -> usize {
    prompt + max_tokens.saturating_sub(1)
}

/// Streams a finished sequence's last chunks, then its output and stats.
fn finish(seq: Running, sink: &mut dyn FnMut(SeqId, SeqEvent<'_>) -> ControlFlow<()>) {
    let id = seq.id;
    let decoded = seq
        .decoder
        .finish(&mut |event| sink(id, SeqEvent::Generation(event)));
    let now = Instant::now();
    let prompt_len = seq.prompt_len;
    let since_submit = |at: Instant| at.duration_since(seq.submitted).as_secs_f64();
    let prefill_seconds = since_submit(seq.prefill_done.unwrap_or(now));
    let prefilled = prompt_len - seq.cached;
    let ttft = decoded.first_token_at.map_or(prefill_seconds, since_submit);
    let generated = decoded.tokens.len();
    let total = since_submit(now);
    let stats = GenerationStats {
        prompt_tokens: prompt_len,
        prefilled_tokens: prefilled,
        generated_tokens: generated,
        prefill_seconds,
        prefill_tokens_per_second: per_second(prefilled, prefill_seconds),
        decode_seconds: (total - prefill_seconds).max(0.0),
        decode_tokens_per_second: per_second(generated.saturating_sub(1), (total - ttft).max(0.0)),
        time_to_first_token_seconds: ttft,
        peak_rss_bytes: crate::memory::peak_rss_bytes(),
        draft_tokens: seq.counts.drafted,
        accepted_draft_tokens: seq.counts.accepted,
        decode_steps: seq.counts.steps,
    };
    let mut prompt_tokens = seq.tokens;
    prompt_tokens.truncate(prompt_len);
    let output = GenerationOutput {
        prompt_tokens,
        tokens: decoded.tokens,
        logprobs: decoded.logprobs,
        text: decoded.text,
        chunks: decoded.chunks,
        finish_reason: decoded.reason,
        stats,
    };
    let _ = sink(id, SeqEvent::Finished(output));
}

fn per_second(count: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}
