//! Speculative decoding: propose a few tokens cheaply, check them all in
//! one forward pass of the target, keep the longest prefix it agrees with
//! and one token more.
//!
//! Drafts come from prompt lookup ([`lookup_ngram`]: the longest suffix
//! n-gram of the sequence found earlier in it, proposing what followed) or
//! from a small draft model with the target's vocabulary, run greedily on
//! rank 0 ([`crate::serve::batch`] drives both).
//!
//! Both proposals are deterministic (a point mass `q` on the drafted
//! token), so speculative rejection sampling reduces to this: sample the
//! target's own distribution at each drafted position, in order, and accept
//! the draft while the sample equals it. The first sample that differs is
//! the corrected token, and after a fully accepted draft the next sample is
//! the bonus token. Each output token is one sample of the target's
//! distribution given the real history (acceptance probability `p(x)`,
//! the residual `p` without `x` renormalised), so the outputs are not only
//! distributed as the target's: with a seed they are the very tokens plain
//! decoding gives, since every position sees the same logits and the same
//! random draw. [`accepts_statistically`]'s test checks the rule against
//! the target's distribution all the same.
//!
//! How many tokens to draft ([`DraftLength`]) follows the measured
//! acceptance and what an extra token costs the step ([`StepCost`]),
//! down to none when drafts do not pay.

use std::sync::Arc;

use crate::serve::{EngineError, LoadedModel};

/// Where drafts come from.
#[derive(Clone)]
pub enum DraftSource {
    /// Prompt lookup: no model.
    Ngram,
    /// A draft model with the target's vocabulary, whole on rank 0.
    Model(Arc<LoadedModel>),
}

impl std::fmt::Debug for DraftSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ngram => write!(f, "ngram"),
            Self::Model(model) => write!(f, "model {}", model.path.display()),
        }
    }
}

/// An instance's speculative decoding.
#[derive(Clone, Debug)]
pub struct Speculation {
    pub source: DraftSource,
    /// The most tokens drafted per step for one sequence.
    pub max_draft_tokens: usize,
    /// Always draft `max_draft_tokens` (as many as prompt lookup finds),
    /// whatever the measured acceptance and cost: for tests and
    /// measurements of the machinery; adaptive otherwise.
    pub fixed: bool,
}

impl Speculation {
    /// Adaptive speculation from `source`, up to `max_draft_tokens` a step.
    pub fn new(source: DraftSource, max_draft_tokens: usize) -> Self {
        Self {
            source,
            max_draft_tokens,
            fixed: false,
        }
    }
}

/// The most draft tokens per step anyone may ask for: beyond this a step's
/// cost grows faster than any acceptance can repay.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// The default drafts per step (exo's and llama.cpp's choice too).
pub const DEFAULT_DRAFT_TOKENS: usize = 4;

/// Longest and shortest suffix n-grams prompt lookup tries.
pub const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 1;

/// Prompt lookup: finds the longest suffix of `history` (at most
/// [`NGRAM_MAX`] tokens, at least [`NGRAM_MIN`]) that occurred earlier, the
/// latest such occurrence, and writes up to `count` tokens that followed it
/// into `out`. Returns the suffix's length (a longer match predicts
/// better); 0 and nothing written when no suffix recurs.
pub fn lookup_ngram(history: &[u32], count: usize, out: &mut Vec<u32>) -> usize {
    out.clear();
    if count == 0 || history.len() < 2 {
        return 0;
    }
    let len = history.len();
    for n in (NGRAM_MIN..=NGRAM_MAX.min(len - 1)).rev() {
        let suffix = &history[len - n..];
        // Latest first: recent text predicts the next tokens best. The
        // match must end before the suffix itself starts over.
        let found = (0..len - n)
            .rev()
            .find(|&at| &history[at..at + n] == suffix);
        if let Some(at) = found {
            let from = at + n;
            let take = count.min(len - from);
            out.extend_from_slice(&history[from..from + take]);
            return n;
        }
    }
    0
}

/// A draft's vocabulary must be the target's token for token: the ids it
/// proposes are checked by the target as its own.
pub fn check_draft_vocabulary(
    target: &LoadedModel,
    draft: &LoadedModel,
) -> Result<(), EngineError> {
    let (ours, theirs) = (&target.tokenizer, &draft.tokenizer);
    let mismatch = |detail: String| EngineError::DraftVocabulary {
        draft: draft.path.display().to_string(),
        detail,
    };
    if ours.vocab_size() != theirs.vocab_size()
        || target.transformer.config.vocab != draft.transformer.config.vocab
    {
        return Err(mismatch(format!(
            "{} tokens against the target's {}",
            theirs.vocab_size(),
            ours.vocab_size()
        )));
    }
    let differing =
        (0..ours.vocab_size() as u32).find(|&id| ours.token_bytes(id) != theirs.token_bytes(id));
    if let Some(id) = differing {
        return Err(mismatch(format!(
            "token {id} is {:?} there and {:?} in the target",
            String::from_utf8_lossy(theirs.token_bytes(id)),
            String::from_utf8_lossy(ours.token_bytes(id)),
        )));
    }
    Ok(())
}

/// What a step of `tokens` costs, so that a draft's extra tokens are
/// weighed by what they really add here: each size's own smoothed time
/// where steps of that size were measured, else a line fitted to all the
/// steps measured (seconds = fixed + per_token x tokens). The kernels make
/// the true curve a staircase (a tile of 4 or 8 tokens costs the same
/// however many of its lanes are used), which only the sizes' own times
/// show. Until steps are measured it assumes an extra token costs a fifth
/// of a one-token step.
#[derive(Clone, Debug)]
pub struct StepCost {
    /// Smoothed seconds of steps of 1 to `MEASURED_SIZES` tokens.
    by_size: [Option<f64>; MEASURED_SIZES],
    // Exponentially weighted sums for a least-squares line.
    weight: f64,
    sum_x: f64,
    sum_y: f64,
    sum_xx: f64,
    sum_xy: f64,
}

/// Share of each new measurement in the fit.
const COST_DECAY: f64 = 0.98;
/// Step sizes whose times are kept one by one.
const MEASURED_SIZES: usize = 64;
/// Weight of the past in a size's smoothed time.
const SIZE_DECAY: f64 = 0.8;
/// The prior line, in units of a one-token step.
const PRIOR_FIXED: f64 = 0.8;
const PRIOR_PER_TOKEN: f64 = 0.2;

impl Default for StepCost {
    fn default() -> Self {
        Self {
            by_size: [None; MEASURED_SIZES],
            weight: 0.0,
            sum_x: 0.0,
            sum_y: 0.0,
            sum_xx: 0.0,
            sum_xy: 0.0,
        }
    }
}

impl StepCost {
    /// A step of `tokens` took `seconds`.
    pub fn observe(&mut self, tokens: usize, seconds: f64) {
        if let Some(size) = tokens.checked_sub(1).and_then(|i| self.by_size.get_mut(i)) {
            *size = Some(size.map_or(seconds, |old| {
                old * SIZE_DECAY + seconds * (1.0 - SIZE_DECAY)
            }));
        }
        let x = tokens as f64;
        self.weight = self.weight * COST_DECAY + 1.0;
        self.sum_x = self.sum_x * COST_DECAY + x;
        self.sum_y = self.sum_y * COST_DECAY + seconds;
        self.sum_xx = self.sum_xx * COST_DECAY + x * x;
        self.sum_xy = self.sum_xy * COST_DECAY + x * seconds;
    }

    /// (fixed, per token) of the fitted line; the prior until the steps
    /// measured span more than one size.
    fn line(&self) -> (f64, f64) {
        self.fitted().unwrap_or((PRIOR_FIXED, PRIOR_PER_TOKEN))
    }

    /// (seconds fixed, seconds per token) of the steps measured, once
    /// they span more than one size.
    pub fn fitted(&self) -> Option<(f64, f64)> {
        let n = self.weight;
        let variance = n * self.sum_xx - self.sum_x * self.sum_x;
        if n < 4.0 || variance <= 1e-9 * n * n {
            return None;
        }
        let slope = (n * self.sum_xy - self.sum_x * self.sum_y) / variance;
        let intercept = (self.sum_y - slope * self.sum_x) / n;
        // Noise: a step never gets cheaper with more tokens.
        (slope > 0.0 && intercept > 0.0).then_some((intercept, slope))
    }

    /// Seconds of a step of `tokens`, once steps of more than one size
    /// were measured.
    pub fn seconds(&self, tokens: usize) -> Option<f64> {
        let (fixed, per_token) = self.fitted()?;
        Some(fixed + per_token * tokens as f64)
    }

    /// What a step of `base + extra` tokens costs against one of `base`:
    /// both sizes' measured times where both were measured, else the line.
    pub fn ratio(&self, base: usize, extra: usize) -> f64 {
        let measured = |tokens: usize| self.by_size.get(tokens.checked_sub(1)?).copied()?;
        let (base, total) = (base.max(1), base.max(1) + extra);
        if let (Some(step), Some(with)) = (measured(base), measured(total)) {
            if step > 0.0 {
                return with / step;
            }
        }
        let (fixed, per_token) = self.line();
        let cost = |tokens: usize| fixed + per_token * tokens as f64;
        cost(total) / cost(base)
    }
}

/// One sequence's draft acceptance, and how long its drafts should be.
#[derive(Clone, Debug)]
pub struct DraftLength {
    /// Exponentially weighted drafted positions accepted, and checked.
    accepted: f64,
    checked: f64,
}

/// Weight of the past in the acceptance estimate.
const ACCEPTANCE_DECAY: f64 = 0.9;

impl Default for DraftLength {
    fn default() -> Self {
        // An even prior: drafts are tried until they prove otherwise.
        Self {
            accepted: 1.0,
            checked: 2.0,
        }
    }
}

impl DraftLength {
    /// The chance that the target agrees with a drafted token, given it
    /// agreed with the ones before.
    pub fn acceptance(&self) -> f64 {
        (self.accepted / self.checked).clamp(0.0, 1.0)
    }

    /// A draft of `drafted` tokens had its first `accepted` confirmed.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        // Positions checked: the accepted ones and the first refused one.
        let checked = (accepted + usize::from(accepted < drafted)) as f64;
        self.accepted = self.accepted * ACCEPTANCE_DECAY + accepted as f64;
        self.checked = self.checked * ACCEPTANCE_DECAY + checked;
    }

    /// The draft length, at most `most`, with the most tokens expected per
    /// unit of cost: `cost(k)` is a step with `k` drafts against one with
    /// none, in which `others` tokens of other work (other sequences'
    /// tokens, prompt chunks) come along anyway. 0 when no draft pays.
    pub fn choose(&self, most: usize, others: usize, cost: impl Fn(usize) -> f64) -> usize {
        let rate = self.acceptance();
        let others = others as f64;
        let mut best = (0, 1.0 + others);
        let mut expected = 1.0;
        let mut term = 1.0;
        for k in 1..=most {
            term *= rate;
            expected += term;
            let value = (others + expected) / cost(k);
            if value > best.1 {
                best = (k, value);
            }
        }
        best.0
    }
}

/// Checks `draft` against the target: `next(i)` samples the target at the
/// `i`-th checked position (after the real tokens and the first `i` drafts),
/// `None` when the sequence ends there. Stops at the first sample that
/// differs from its draft, which is then the corrected token; after a fully
/// accepted draft, the last sample is a bonus token. Returns the drafts
/// accepted: `next` was called that many times and once more, unless the
/// sequence ended first.
pub fn verify(draft: &[u32], mut next: impl FnMut(usize) -> Option<u32>) -> usize {
    for (i, &drafted) in draft.iter().enumerate() {
        match next(i) {
            Some(token) if token == drafted => {}
            _ => return i,
        }
    }
    let _ = next(draft.len());
    draft.len()
}

/// Counts one speculative sequence's drafts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DraftCounts {
    /// Tokens proposed and checked by the target.
    pub drafted: usize,
    /// Of those, tokens the target agreed with.
    pub accepted: usize,
    /// Target steps that produced this sequence's generated tokens.
    pub steps: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(history: &[u32], count: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = lookup_ngram(history, count, &mut out);
        assert_eq!(n == 0, out.is_empty());
        out
    }

    #[test]
    fn prompt_lookup_proposes_what_followed_the_longest_recurring_suffix() {
        // "1 2 3 4 5 ... 1 2 3": the 3-gram recurs, 4 5 6 followed it.
        assert_eq!(lookup(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3), vec![4, 5, 6]);
        // The longest suffix wins over a later, shorter match.
        assert_eq!(
            lookup(&[7, 8, 1, 2, 3, 5, 3, 6, 7, 8, 9, 2, 3], 2),
            vec![5, 3]
        );
        // The latest occurrence of the longest n-gram.
        assert_eq!(lookup(&[1, 2, 10, 1, 2, 11, 1, 2], 1), vec![11]);
        let mut out = Vec::new();
        assert_eq!(lookup_ngram(&[1, 2, 10, 1, 2, 11, 1, 2], 1, &mut out), 2);
        // What follows is cut at the end of the history.
        assert_eq!(lookup(&[4, 5, 4], 5), vec![5, 4]);
        assert!(lookup(&[1, 2, 3, 4], 4).is_empty());
        assert!(lookup(&[1], 4).is_empty());
        assert!(lookup(&[1, 1], 0).is_empty());
    }

    #[test]
    fn draft_length_follows_acceptance_down_to_none() {
        let cheap = |k: usize| 1.0 + 0.1 * k as f64;
        let mut length = DraftLength::default();
        for _ in 0..30 {
            length.observe(4, 4);
        }
        assert!(length.acceptance() > 0.95);
        assert_eq!(
            length.choose(8, 0, cheap),
            8,
            "everything accepted: draft all"
        );
        // A full acceptance weighs four positions, a refusal one: the
        // estimate takes more refused steps to fall than accepted to rise.
        for _ in 0..60 {
            length.observe(4, 0);
        }
        assert!(length.acceptance() < 0.05);
        assert_eq!(length.choose(8, 0, cheap), 0, "nothing accepted: no drafts");
        // At an even chance, a costly token is not worth drafting.
        let even = DraftLength::default();
        assert_eq!(even.choose(8, 0, |k| 1.0 + 0.6 * k as f64), 0);
        assert!(even.choose(8, 0, cheap) >= 1);
        // A step costing 0.65 + 0.35 per token: alone, an even draft pays;
        // beside 8 other tokens it slows them all more than it adds.
        assert!(even.choose(8, 0, |k| 1.0 + 0.35 * k as f64) >= 1);
        let beside_eight = |k: usize| (0.65 + 0.35 * (9 + k) as f64) / (0.65 + 0.35 * 9.0);
        assert_eq!(even.choose(8, 8, beside_eight), 0);
    }

    #[test]
    fn step_cost_fits_the_measured_line() {
        let mut cost = StepCost::default();
        assert!((cost.ratio(1, 1) - 1.2).abs() < 1e-9, "the prior");
        for _ in 0..20 {
            for tokens in [1, 3, 5] {
                cost.observe(tokens, 0.010 + 0.002 * tokens as f64);
            }
        }
        // 1 token: 12 ms; 5 tokens: 20 ms.
        assert!((cost.ratio(1, 4) - 20.0 / 12.0).abs() < 1e-6);
        assert!((cost.ratio(8, 0) - 1.0).abs() < 1e-12);
        // Unmeasured sizes on the line: 2 tokens, 14 ms.
        assert!((cost.ratio(1, 1) - 14.0 / 12.0).abs() < 1e-6);
    }

    /// Where the kernels make a staircase (4 tokens cost as 2, 5 as 8), the
    /// sizes' own times win over the line, and drafts stop where a step
    /// would climb a stair.
    #[test]
    fn step_cost_follows_each_measured_size() {
        let mut cost = StepCost::default();
        let staircase = |tokens: usize| match tokens {
            1 => 0.100,
            2..=4 => 0.150,
            _ => 0.280,
        };
        for _ in 0..20 {
            for tokens in 1..=5 {
                cost.observe(tokens, staircase(tokens));
            }
        }
        assert!((cost.ratio(1, 3) - 1.5).abs() < 1e-9);
        assert!((cost.ratio(1, 4) - 2.8).abs() < 1e-9);
        // At 0.9 acceptance, three drafts (3.4 tokens for 1.5 steps) beat
        // four (4.1 tokens for 2.8 steps).
        let mut length = DraftLength::default();
        for _ in 0..50 {
            length.observe(10, 9);
        }
        assert_eq!(length.choose(4, 0, |k| cost.ratio(1, k)), 3);
    }

    /// The acceptance rule with the engine's own sampler, checked against
    /// the distribution it must give: whatever the draft, each output token
    /// is distributed as the target's softmax, and a drafted token stands
    /// with its target probability (chi-square over 20 000 runs per draft).
    #[test]
    fn accepts_statistically() {
        use crate::serve::sampler::{Sampler, SamplingParams};
        let logits = [2.0f32, 1.0, 0.7, 0.3, -0.5];
        let total: f32 = logits.iter().map(|l| l.exp()).sum();
        let p: Vec<f64> = logits.iter().map(|l| f64::from(l.exp() / total)).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params, logits.len()).unwrap();
        let runs = 20_000;
        for draft in [[0u32, 0], [3, 1], [4, 4]] {
            let mut first = [0usize; 5];
            let mut second = [0usize; 5];
            let mut accepted_first = 0;
            for _ in 0..runs {
                let mut out = Vec::new();
                let accepted = verify(&draft, |_| {
                    let token = sampler.sample(&mut logits.clone(), &[]).token;
                    out.push(token);
                    Some(token)
                });
                assert_eq!(
                    out.len(),
                    accepted + 1,
                    "one sample per accepted draft, and one"
                );
                first[out[0] as usize] += 1;
                if accepted >= 1 {
                    accepted_first += 1;
                    second[out[1] as usize] += 1;
                }
            }
            let chi2 = |counts: &[usize; 5]| -> f64 {
                let n: usize = counts.iter().sum();
                counts
                    .iter()
                    .zip(&p)
                    .map(|(&c, q)| (c as f64 - q * n as f64).powi(2) / (q * n as f64))
                    .sum()
            };
            // 4 degrees of freedom: 18.47 is the 0.999 quantile.
            assert!(chi2(&first) < 18.47, "{draft:?}: first {first:?}");
            assert!(chi2(&second) < 18.47, "{draft:?}: second {second:?}");
            let rate = accepted_first as f64 / runs as f64;
            let expected = p[draft[0] as usize];
            assert!(
                (rate - expected).abs() < 0.015,
                "accepted {rate}, p {expected}"
            );
        }
    }

    #[test]
    fn verification_stops_at_the_first_disagreement_or_the_end() {
        fn sampled(count: &mut usize) -> impl FnMut(usize) -> Option<u32> + '_ {
            move |i: usize| {
                *count += 1;
                Some([5u32, 6, 9, 1][i])
            }
        }
        let mut count = 0;
        assert_eq!(verify(&[5, 6, 7], sampled(&mut count)), 2);
        assert_eq!(count, 3, "the third sample corrects the draft");
        count = 0;
        assert_eq!(verify(&[5, 6, 9], sampled(&mut count)), 3);
        assert_eq!(count, 4, "all accepted: a bonus token");
        count = 0;
        assert_eq!(verify(&[], sampled(&mut count)), 0);
        assert_eq!(count, 1);
        // The sequence ends at the first sample: nothing more is asked.
        let mut asked = 0;
        assert_eq!(
            verify(&[5, 6], |_| {
                asked += 1;
                None
            }),
            0
        );
        assert_eq!(asked, 1);
    }
}
