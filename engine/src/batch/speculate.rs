//! The batch's side of speculative decoding ([`crate::speculative`]): the
//! drafts of each step's decoding sequences, by prompt lookup or by a
//! draft model run on rank 0 beside the target, with its own KV pool.

use std::sync::Arc;
use std::time::Instant;

use crate::executor::{ExecError, Executor};
use crate::generate::LoadedModel;
use crate::model::{SeqSpan, Workspace};
use crate::paged::{BlockHash, BlockId, BlockManager, KvPool};
use crate::speculative::{lookup_ngram, DraftLength, DraftSource, Speculation, StepCost};

/// A sequence's speculative state.
#[derive(Default)]
pub(super) struct SeqDraft {
    /// Tokens proposed for the step in flight (or being planned).
    pub tokens: Vec<u32>,
    pub length: DraftLength,
    /// A prompt-lookup proposal made but not drafted (its length chose 0):
    /// checked against the next token for free, so the estimate recovers
    /// when the text starts to repeat.
    pub shadow: Option<u32>,
    /// Decode steps since the draft model last drafted for it.
    pub idle_steps: usize,
    /// Its place in the draft model's pool.
    pub model: Option<DraftSlot>,
}

/// A sequence's blocks in the draft model's pool.
pub(super) struct DraftSlot {
    pub table: Vec<BlockId>,
    pub chain: Vec<BlockHash>,
    /// Leading positions with the draft's keys and values of real tokens.
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
}

/// A draft model that stops drafting for a sequence tries one token again
/// after this many decode steps, to notice when it starts to pay.
const PROBE_STEPS: usize = 16;

impl SpecState {
    pub fn new(config: Speculation, kv_blocks: usize) -> Self {
        let draft = match &config.source {
            DraftSource::Ngram => None,
            DraftSource::Model(model) => Some(DraftModel {
                kv: KvPool::new(
                    model.transformer.layer_count(),
                    model.transformer.config.kv_dim(),
                ),
                workspace: Workspace::default(),
                blocks: BlockManager::new(kv_blocks),
                round_seconds: None,
                model: model.clone(),
            }),
        };
        Self {
            config,
            draft,
            cost: StepCost::default(),
        }
    }

    /// What a step with `extra` draft tokens costs against one without,
    /// counting the draft model's rounds.
    fn cost_of(&self, base: usize, extra: usize) -> f64 {
        let step = self.cost.ratio(base, extra);
        let Some(draft) = &self.draft else {
            return step;
        };
        // A round's share of a plain step; until measured, a guess.
        let round = match (draft.round_seconds, self.cost.seconds(base)) {
            (Some(round), Some(step)) if step > 0.0 => round / step,
            _ => 0.25,
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
        let mut lengths = Vec::with_capacity(wants.len());
        for want in wants.iter_mut() {
            let want_draft = &mut *want.draft;
            want_draft.tokens.clear();
            want_draft.shadow = None;
            let mut k = want_draft
                .length
                .choose(most.min(want.room), |k| self.cost_of(base, k));
            if self.draft.is_some() && k == 0 && want.room > 0 {
                want_draft.idle_steps += 1;
                if want_draft.idle_steps >= PROBE_STEPS {
                    k = 1;
                }
            }
            if k > 0 {
                want_draft.idle_steps = 0;
            }
            lengths.push(k);
        }
        if self.draft.is_none() {
            for (want, &k) in wants.iter_mut().zip(&lengths) {
                let draft = &mut *want.draft;
                let count = if k == 0 { 1 } else { k };
                lookup_ngram(want.tokens, count.min(want.room.max(1)), &mut draft.tokens);
                if k == 0 {
                    draft.shadow = draft.tokens.first().copied();
                    draft.tokens.clear();
                }
            }
            return Ok(());
        }
        self.run_draft_model(executor, wants, &lengths)
    }

    /// The draft model's greedy continuation of each sequence, `lengths`
    /// tokens each, in rounds over all of them: the first catches each up
    /// on its real tokens, each next one feeds the last drafted token.
    fn run_draft_model(
        &mut self,
        executor: &Executor<'_>,
        wants: &mut [DraftWant<'_>],
        lengths: &[usize],
    ) -> Result<(), ExecError> {
        let Some(draft) = self.draft.as_mut() else {
            return Ok(());
        };
        let context = draft.model.transformer.config.context_length;
        let mut active: Vec<usize> = Vec::new();
        for (i, want) in wants.iter_mut().enumerate() {
            let k = lengths[i];
            if k == 0 || want.tokens.len() + k > context || !draft.admit(want) {
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
                    tokens.extend_from_slice(&want.tokens[start..]);
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
                    Some(SeqSpan {
                        start,
                        len,
                        table: &wants[i].draft.model.as_ref()?.table,
                        logits: 1,
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
    /// Gives a sequence its blocks in the draft's pool, once; false when
    /// the pool has no room now (it decodes without drafts meanwhile).
    fn admit(&mut self, want: &mut DraftWant<'_>) -> bool {
        if want.draft.model.is_some() {
            return true;
        }
        let prompt = &want.tokens[..want.prompt_len];
        let reuse = if want.reuse_prefix {
            want.prompt_len.saturating_sub(1)
        } else {
            0
        };
        match self.blocks.admit(prompt, want.reserve_positions, reuse) {
            Ok(admitted) => {
                want.draft.model = Some(DraftSlot {
                    table: admitted.table,
                    chain: admitted.chain,
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
            slot.computed = slot.computed.min(computed);
            self.blocks
                .register(&slot.table, &tokens[..slot.computed], &mut slot.chain);
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
