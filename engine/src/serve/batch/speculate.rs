//! The batch's side of speculative decoding ([`crate::serve::speculative`]): the
//! drafts of each step's decoding sequences, by prompt lookup or by a
//! draft model run on rank 0 beside the target, with its own KV pool.

use std::sync::Arc;
use std::time::Instant;

use crate::model::paged::{BlockHash, BlockId, BlockManager, KvPool};
use crate::model::{SeqSpan, Workspace};
use crate::serve::executor::{ExecError, Executor};
use crate::serve::speculative::{
    lookup_ngram, DraftLength, DraftSource, Speculation, StepCost, NGRAM_MAX,
};
use crate::serve::LoadedModel;

/// A sequence's speculative state.
#[derive(Default)]
pub(super) struct SeqDraft {
    /// Tokens proposed for the step in flight (or being planned).
    pub tokens: Vec<u32>,
    /// Acceptance and draft length: one for a draft model; for prompt
    /// lookup one per matched n-gram length (a 4-gram match inside a
    /// quoted passage predicts far better than a common 1-gram).
    pub lengths: [DraftLength; NGRAM_MAX],
    /// Which of `lengths` the current proposal answers to.
    pub bucket: usize,
    /// A prompt-lookup proposal made but not drafted (its length chose 0):
    /// checked against the next token for free, so the estimate recovers
    /// when the text starts to repeat.
    pub shadow: Option<u32>,
    /// Its place in the draft model's pool; given back while drafts do not
    /// pay, so that nothing is spent keeping the draft's cache current.
    pub model: Option<DraftSlot>,
}

/// A sequence's blocks in the draft model's pool.
pub(super) struct DraftSlot {
    pub table: Vec<BlockId>,
    pub chain: Vec<BlockHash>,
    /// The draft sees the sequence from this token on (0, or a probe's
    /// short window of recent tokens): its position 0 is this one.
    pub offset: usize,
    /// Leading positions of its view with the draft's keys and values of
    /// real tokens.
    pub computed: usize,
}

/// A draft model on rank 0, with its own pool.
pub(super) struct DraftModel {
    pub model: Arc<LoadedModel>,
    kv: KvPool,
    workspace: Workspace,
    pub blocks: BlockManager,
    /// Seconds of one drafting round over the batch, smoothed.
    round_seconds: Option<f64>,
}

/// An instance's speculation: where drafts come from, and what a step
/// with more tokens costs.
pub(super) struct SpecState {
    pub config: Speculation,
    pub draft: Option<DraftModel>,
    pub cost: StepCost,
    /// A draft model's acceptance, over every sequence of the instance (a
    /// property of the pair of models more than of one text).
    model_length: DraftLength,
    probe: Probe,
}

/// While a draft model does not pay, it is tried again now and then on one
/// sequence, over a short window of its latest tokens (cheap to compute),
/// less and less often while it keeps failing.
#[derive(Clone, Copy, Debug)]
struct Probe {
    interval: usize,
    left: usize,
}

const PROBE_FIRST: usize = 32;
const PROBE_MOST: usize = 1024;
/// Tokens of recent history a probe's draft sees.
const PROBE_WINDOW: usize = 32;
/// A draft model's round against a target step until one is timed.
const UNMEASURED_ROUND: f64 = 0.1;

/// Drafts a probe checks.
const PROBE_TOKENS: usize = 2;
/// A probe's cost, in steps, times this is the least interval after it
/// (probes cost under 2% of decoding).
const PROBE_SHARE_INVERSE: f64 = 50.0;

impl Default for Probe {
    fn default() -> Self {
        Self {
            interval: PROBE_FIRST,
            left: PROBE_FIRST,
        }
    }
}

impl Probe {
    /// A step without drafts; true when it is time to probe.
    fn tick(&mut self) -> bool {
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return false;
        }
        self.interval = (self.interval * 2).min(PROBE_MOST);
        self.left = self.interval;
        true
    }

    /// The next probe no sooner than `steps` steps from now.
    fn at_least(&mut self, steps: f64) {
        let steps = (steps.ceil() as usize).min(PROBE_MOST);
        self.interval = self.interval.max(steps);
        self.left = self.left.max(steps);
    }
}

impl SpecState {
    pub fn new(config: Speculation, kv_blocks: usize, cost: StepCost) -> Self {
        let draft = match &config.source {
            DraftSource::Ngram => None,
            DraftSource::Model(model) => Some(DraftModel {
                kv: model.transformer.new_pool(),
                workspace: Workspace::default(),
                blocks: BlockManager::new(kv_blocks),
                round_seconds: None,
                model: model.clone(),
            }),
        };
        Self {
            config,
            draft,
            cost,
            model_length: DraftLength::default(),
            probe: Probe::default(),
        }
    }

    /// Replaces `previous`: what a step costs is the target's and this
    /// machine's, and a draft model's acceptance is the pair's, so both are
    /// kept (the latter for the same draft model).
    pub fn after(previous: Option<SpecState>, config: Speculation, kv_blocks: usize) -> Self {
        let Some(previous) = previous else {
            return Self::new(config, kv_blocks, StepCost::default());
        };
        let same_model = match (&previous.config.source, &config.source) {
            (DraftSource::Model(a), DraftSource::Model(b)) => a.path == b.path,
            _ => false,
        };
        let mut next = Self::new(config, kv_blocks, previous.cost);
        if same_model {
            next.model_length = previous.model_length;
            next.probe = previous.probe;
            if let (Some(draft), Some(old)) = (next.draft.as_mut(), previous.draft) {
                draft.round_seconds = old.round_seconds;
            }
        }
        next
    }

    /// Kept while speculation is off: its measurements, not its pool.
    pub fn dormant(mut self) -> Self {
        if let Some(draft) = self.draft.as_mut() {
            draft.kv = KvPool::new(0, 0);
            draft.workspace = Workspace::default();
        }
        self
    }

    /// A draft of `drafted` tokens had its first `accepted` confirmed.
    pub fn observe(&mut self, draft: &mut SeqDraft, drafted: usize, accepted: usize) {
        if self.draft.is_some() {
            self.model_length.observe(drafted, accepted);
        } else {
            draft.lengths[draft.bucket].observe(drafted, accepted);
        }
    }

    /// What a step with `extra` draft tokens costs against one without,
    /// counting the draft model's rounds.
    fn cost_of(&self, base: usize, extra: usize) -> f64 {
        let step = self.cost.ratio(base, extra);
        let Some(draft) = &self.draft else {
            return step;
        };
        // A round's share of a plain step. Until measured, the hope that
        // it is a small draft, so that a new draft model is tried (and
        // timed) rather than never given a chance.
        let round = match (draft.round_seconds, self.cost.seconds(base)) {
            (Some(round), Some(step)) if step > 0.0 => round / step,
            _ => UNMEASURED_ROUND,
        };
        step + round * extra as f64
    }
}

/// One decoding sequence about to be drafted for.
pub(super) struct DraftWant<'a> {
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    /// The most drafts its request still has room for.
    pub room: usize,
    pub reserve_positions: usize,
    pub reuse_prefix: bool,
    pub draft: &'a mut SeqDraft,
}

impl SpecState {
    /// Proposes drafts for `wants` (decoding sequences not in flight) in a
    /// step of `base` tokens without drafts: each gets the length its
    /// acceptance pays for, filled by prompt lookup or by the draft model.
    pub fn propose(
        &mut self,
        executor: &Executor<'_>,
        base: usize,
        wants: &mut [DraftWant<'_>],
    ) -> Result<(), ExecError> {
        let most = self.config.max_draft_tokens;
        let others = base.saturating_sub(1);
        if self.draft.is_none() {
            for want in wants.iter_mut() {
                let room = most.min(want.room);
                let draft = &mut *want.draft;
                draft.shadow = None;
                let matched = lookup_ngram(want.tokens, room.max(1), &mut draft.tokens);
                if matched == 0 {
                    continue;
                }
                draft.bucket = matched - 1;
                let most = draft.tokens.len().min(room);
                let k = if self.config.fixed {
                    most
                } else {
                    draft.lengths[draft.bucket].choose(most, others, |k| self.cost_of(base, k))
                };
                if k == 0 {
                    draft.shadow = draft.tokens.first().copied();
                }
                draft.tokens.truncate(k);
            }
            return Ok(());
        }
        // One length for all: the pair of models decides, not the text.
        let k_all = if self.config.fixed {
            most
        } else {
            self.model_length
                .choose(most, others, |k| self.cost_of(base, k))
        };
        let probe = if k_all == 0 {
            self.probe.tick()
        } else {
            self.probe = Probe::default();
            false
        };
        let mut lengths = Vec::with_capacity(wants.len());
        for want in wants.iter_mut() {
            let draft = &mut *want.draft;
            draft.tokens.clear();
            draft.shadow = None;
            draft.bucket = 0;
            let k = k_all.min(want.room);
            if k == 0 {
                if let Some(model) = self.draft.as_mut() {
                    model.release(draft);
                }
            }
            lengths.push(k);
        }
        if probe {
            if let Some(i) = wants.iter().position(|w| w.room > 0) {
                lengths[i] = PROBE_TOKENS.min(wants[i].room);
            }
        }
        let started = Instant::now();
        let result = self.run_draft_model(executor, wants, &lengths, k_all == 0);
        if probe {
            // A probe may cost at most a small share of the steps between
            // probes: a large draft is tried again more rarely.
            let step = self.cost.seconds(1).unwrap_or(0.01).max(1e-4);
            let steps = started.elapsed().as_secs_f64() / step;
            self.probe.at_least(steps * PROBE_SHARE_INVERSE);
        }
        result
    }

    /// The draft model's greedy continuation of each sequence, `lengths`
    /// tokens each, in rounds over all of them: the first catches each up
    /// on its real tokens, each next one feeds the last drafted token.
    fn run_draft_model(
        &mut self,
        executor: &Executor<'_>,
        wants: &mut [DraftWant<'_>],
        lengths: &[usize],
        probing: bool,
    ) -> Result<(), ExecError> {
        let Some(draft) = self.draft.as_mut() else {
            return Ok(());
        };
        let context = draft.model.transformer.config.context_length;
        let mut active: Vec<usize> = Vec::new();
        for (i, want) in wants.iter_mut().enumerate() {
            let k = lengths[i];
            if k == 0 || !draft.admit(want, context, k, probing) {
                continue;
            }
            active.push(i);
        }
        let longest = active.iter().map(|&i| lengths[i]).max().unwrap_or(0);
        let started = Instant::now();
        let mut tokens = Vec::new();
        for round in 0..longest {
            let members: Vec<usize> = active
                .iter()
                .copied()
                .filter(|&i| lengths[i] > round)
                .collect();
            // (member, start, len) of each span; every active one has a slot.
            tokens.clear();
            let mut parts = Vec::with_capacity(members.len());
            for &i in &members {
                let want = &wants[i];
                let Some(slot) = want.draft.model.as_ref() else {
                    continue;
                };
                let start = slot.computed;
                if round == 0 {
                    tokens.extend_from_slice(&want.tokens[slot.offset + start..]);
                } else if let Some(&last) = want.draft.tokens.last() {
                    tokens.push(last);
                }
                parts.push((i, start, tokens.len()));
            }
            let mut end = 0;
            let spans: Vec<SeqSpan<'_>> = parts
                .iter()
                .filter_map(|&(i, start, until)| {
                    let len = until - end;
                    end = until;
                    let slot = wants[i].draft.model.as_ref()?;
                    Some(SeqSpan {
                        start,
                        len,
                        table: &slot.table,
                        prompt: wants[i].prompt_len.saturating_sub(slot.offset),
                        logits: 1,
                        // Draft models are never hybrid (refused on load).
                        state: 0,
                    })
                })
                .collect();
            let lens: Vec<(usize, usize)> = parts
                .iter()
                .zip(&spans)
                .map(|(&(i, _, _), span)| (i, span.len))
                .collect();
            let vocab = draft.model.transformer.config.vocab;
            let logits = executor.run_beside(
                &draft.model.transformer,
                &mut draft.kv,
                &mut draft.workspace,
                &spans,
                &tokens,
            )?;
            for (&(i, len), row) in lens.iter().zip(logits.chunks_exact(vocab)) {
                let want = &mut wants[i];
                want.draft.tokens.push(argmax(row));
                if let Some(slot) = want.draft.model.as_mut() {
                    slot.computed += len;
                }
            }
        }
        if longest > 0 {
            let seconds = started.elapsed().as_secs_f64() / longest as f64;
            draft.round_seconds = Some(match draft.round_seconds {
                Some(old) => 0.8 * old + 0.2 * seconds,
                None => seconds,
            });
        }
        Ok(())
    }
}

impl DraftModel {
    /// Gives a sequence its blocks in the draft's pool for `k` drafts
    /// (a view of its whole history, or of the probe's window when it has
    /// none yet and drafting is off); false when the pool has no room now
    /// or the view would pass the draft's context (it decodes without
    /// drafts meanwhile).
    fn admit(&mut self, want: &mut DraftWant<'_>, context: usize, k: usize, probing: bool) -> bool {
        let len = want.tokens.len();
        if let Some(slot) = &want.draft.model {
            return len - slot.offset + k <= context;
        }
        let offset = if probing {
            len.saturating_sub(PROBE_WINDOW)
        } else {
            0
        };
        if len - offset + k > context {
            return false;
        }
        let start = &want.tokens[offset..want.prompt_len.max(offset)];
        let reuse = if want.reuse_prefix
            && offset == 0
            && !self.model.transformer.config.rope_depends_on_length()
        {
            want.prompt_len.saturating_sub(1)
        } else {
            0
        };
        match self
            .blocks
            .admit(start, want.reserve_positions - offset, reuse)
        {
            Ok(admitted) => {
                want.draft.model = Some(DraftSlot {
                    table: admitted.table,
                    chain: admitted.chain,
                    offset,
                    computed: admitted.cached_positions,
                });
                true
            }
            Err(_) => false,
        }
    }

    /// After verification: the draft's cache keeps only real tokens.
    pub fn settle(&mut self, draft: &mut SeqDraft, tokens: &[u32], computed: usize) {
        if let Some(slot) = draft.model.as_mut() {
            slot.computed = slot.computed.min(computed.saturating_sub(slot.offset));
            if slot.offset == 0 {
                self.blocks
                    .register(&slot.table, &tokens[..slot.computed], &mut slot.chain);
            }
        }
    }

    pub fn release(&mut self, draft: &mut SeqDraft) {
        if let Some(slot) = draft.model.take() {
            self.blocks.release(&slot.table);
        }
    }
}

/// The most likely token, the lower id on ties (the draft is greedy).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &logit) in row.iter().enumerate() {
        if logit > row[best] {
            best = i;
        }
    }
    best as u32
}
