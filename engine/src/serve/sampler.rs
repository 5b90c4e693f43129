//! Choosing the next token from the model's logits.
//!
//! The chain follows llama.cpp's default order so that the same parameters give
//! the same behaviour users know from it: penalties → (greedy argmax when
//! `temperature == 0`) → top-k → top-p → min-p → temperature → softmax → draw.
//! Truncation (top-k/top-p/min-p) therefore works on the temperature-1
//! distribution, and temperature only reshapes what survives.
//!
//! The sampler runs once per generated token over the whole vocabulary (49,152
//! entries for SmolLM2), so every buffer it needs is held in the struct and
//! reused, and no step sorts the whole vocabulary unless top-p is asked for
//! without top-k and the nucleus turns out to be very wide.

use crate::logits::{collect_best, exp_non_positive, BestToken, TOP_CANDIDATES};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The most alternatives [`SamplingParams::top_logprobs`] may ask for (the
/// OpenAI API's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How the next token is chosen. Every field's neutral value turns it off; the
/// default is greedy decoding with everything off.
///
/// Missing fields deserialize to their defaults, so a request may name only
/// the parameters it sets.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability adds up to
    /// at least `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of recently seen tokens;
    /// 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every recently seen token.
    pub presence_penalty: f32,
    /// Subtracted from a recently seen token's logit once per occurrence.
    pub frequency_penalty: f32,
    /// How many of the most recent tokens the penalties look at; 0 = all.
    pub penalty_window: usize,
    /// `Some` makes sampling reproducible; `None` seeds from OS entropy.
    pub seed: Option<u64>,
    /// How many most likely alternatives to report with each token
    /// (0..=[`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: usize,
    /// `(token, bias)` added to the token's logit before anything else
    /// (OpenAI's `logit_bias`); a bias of [`-MAX_LOGIT_BIAS`] or less bans
    /// the token outright.
    pub logit_bias: Vec<(u32, f32)>,
}

/// Sampling values a model's own files recommend (a Hugging Face
/// `generation_config.json`, a GGUF's `general.sampling.*`), for the fields
/// a request leaves to the model ([`LeftToModel`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// Which sampling fields a request left unset, and its dialect's
/// temperature for when the model recommends none. The default leaves
/// nothing to the model (`tessera generate` and the engine's own callers).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeftToModel {
    pub temperature: bool,
    pub top_p: bool,
    pub top_k: bool,
    pub min_p: bool,
    pub repetition_penalty: bool,
    pub dialect_temperature: Option<f32>,
}

impl SamplingDefaults {
    /// `params` with each field in `left` taken from these defaults where
    /// they have it (the temperature, failing that, from the dialect).
    pub fn fill(&self, mut params: SamplingParams, left: &LeftToModel) -> SamplingParams {
        if left.temperature {
            if let Some(t) = self.temperature.or(left.dialect_temperature) {
                params.temperature = t;
            }
        }
        if left.top_p {
            params.top_p = self.top_p.unwrap_or(params.top_p);
        }
        if left.top_k {
            params.top_k = self.top_k.unwrap_or(params.top_k);
        }
        if left.min_p {
            params.min_p = self.min_p.unwrap_or(params.min_p);
        }
        if left.repetition_penalty {
            params.repetition_penalty =
                self.repetition_penalty.unwrap_or(params.repetition_penalty);
        }
        params
    }
}

/// The largest bias [`SamplingParams::logit_bias`] takes, either way (the
/// OpenAI API's range); at `-MAX_LOGIT_BIAS` a token is never chosen.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: 64,
            seed: None,
            top_logprobs: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// Why sampling parameters (or a sampler) were rejected.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("invalid sampling parameter `{field}` = {value}: must be {requirement}")]
    InvalidParameter {
        field: &'static str,
        value: String,
        requirement: &'static str,
    },
    #[error("vocabulary size must be at least 1")]
    EmptyVocabulary,
    #[error("logit_bias names token {token}, beyond the model's vocabulary of {vocab_size}")]
    BiasBeyondVocabulary { token: u32, vocab_size: usize },
}

fn invalid(field: &'static str, value: impl ToString, requirement: &'static str) -> SamplingError {
    SamplingError::InvalidParameter {
        field,
        value: value.to_string(),
        requirement,
    }
}

impl SamplingParams {
    /// Rejects values that would make sampling meaningless or produce NaN.
    ///
    /// Besides the documented ranges, non-finite temperatures and penalties are
    /// rejected too: an infinite or NaN value would poison every logit.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(invalid(
                "temperature",
                self.temperature,
                "a finite number >= 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", self.top_p, "in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid("min_p", self.min_p, "in [0, 1]"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            let value = self.repetition_penalty;
            return Err(invalid("repetition_penalty", value, "a finite number > 0"));
        }
        if !self.presence_penalty.is_finite() {
            return Err(invalid("presence_penalty", self.presence_penalty, "finite"));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "finite",
            ));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(invalid("top_logprobs", self.top_logprobs, "at most 20"));
        }
        for &(token, bias) in &self.logit_bias {
            if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias) {
                let value = format!("{bias} (token {token})");
                return Err(invalid("logit_bias", value, "in [-100, 100]"));
            }
        }
        Ok(())
    }

    /// Checks what depends on the model: every biased token is in its
    /// vocabulary.
    pub fn validate_for_vocabulary(&self, vocab_size: usize) -> Result<(), SamplingError> {
        match self
            .logit_bias
            .iter()
            .find(|(token, _)| *token as usize >= vocab_size)
        {
            Some(&(token, _)) => Err(SamplingError::BiasBeyondVocabulary { token, vocab_size }),
            None => Ok(()),
        }
    }

    fn penalties_enabled(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// The chosen token and how likely the model thought it was.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Natural-log probability of `token` under the model's distribution after
    /// penalties, at temperature 1 and before top-k/top-p/min-p truncation.
    ///
    /// This follows OpenAI's semantics (the logprob describes the model, not
    /// the sampling settings), so it is comparable across requests with
    /// different temperatures and truncation, and it is never `-inf` for a
    /// token the sampler could pick.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens with their logprobs (same
    /// distribution as `logprob`), best first; ties go to the lower id. Empty
    /// unless requested.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Chooses tokens for one sequence; holds its RNG and reusable scratch space.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Surviving candidates `(token, logit)`; reused between tokens.
    candidates: Vec<(u32, f32)>,
    /// Per-token occurrence counts in the penalty window; all zero between
    /// calls (only the entries in `seen_tokens` are ever non-zero).
    occurrence_counts: Vec<u32>,
    /// Distinct tokens of the penalty window, to apply and reset counts
    /// without touching the whole vocabulary.
    seen_tokens: Vec<u32>,
    /// The best `top_logprobs` tokens so far, best first.
    top_scratch: Vec<(u32, f32)>,
}

/// Orders candidates best first: higher logit, then lower id, so that results
/// never depend on the order a selection algorithm leaves equal logits in.
/// NaN ranks with `-inf` (last), so it never takes a top-k place.
fn best_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    let rank = |logit: f32| {
        if logit.is_nan() {
            f32::NEG_INFINITY
        } else {
            logit
        }
    };
    rank(b.1).total_cmp(&rank(a.1)).then(a.0.cmp(&b.0))
}

/// Up to this `top_k`, the best k are collected in one pass over the logits
/// with a small sorted list (rare insertions), which beats copying the whole
/// vocabulary and selecting in it; above it, `select_nth_unstable` wins.
const STREAMING_TOP_K_LIMIT: usize = 128;

/// Logit distances below the maximum that top-p widens its front by in turn
/// (see [`Sampler::apply_top_p`]). Peaked distributions stop at the first
/// bands after one pass; the last band takes everything that is not NaN.
const TOP_P_BANDS: [f32; 16] = [
    0.25,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    13.0,
    16.0,
    20.0,
    f32::INFINITY,
];

impl Sampler {
    /// A sampler for a model with `vocab_size` tokens. Parameters are validated
    /// here so that [`Sampler::sample`] cannot fail.
    pub fn new(params: SamplingParams, vocab_size: usize) -> Result<Self, SamplingError> {
        params.validate()?;
        if vocab_size == 0 {
            return Err(SamplingError::EmptyVocabulary);
        }
        params.validate_for_vocabulary(vocab_size)?;
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        let candidates_capacity = if params.temperature == 0.0 {
            0
        } else {
            vocab_size
        };
        let counts_len = if params.penalties_enabled() {
            vocab_size
        } else {
            0
        };
        Ok(Self {
            rng,
            candidates: Vec::with_capacity(candidates_capacity),
            occurrence_counts: vec![0; counts_len],
            seen_tokens: Vec::new(),
            top_scratch: Vec::with_capacity(params.top_logprobs + 1),
            params,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether a row's [`BestToken`] is all this sampler needs: greedy,
    /// without penalties (which read the history) or alternatives to list.
    pub fn needs_only_best(&self) -> bool {
        self.params.temperature == 0.0
            && !self.params.penalties_enabled()
            && self.params.top_logprobs == 0
            && self.params.logit_bias.is_empty()
    }

    /// Whether a row's [`BestToken`] and its [`TOP_CANDIDATES`] best
    /// tokens are all this sampler needs: top-k within them (or greedy),
    /// alternatives to list within them, and no penalties or bias (which
    /// change logits outside them).
    pub fn needs_only_candidates(&self) -> bool {
        let params = &self.params;
        let top_k_within = (1..=TOP_CANDIDATES).contains(&params.top_k);
        (params.temperature == 0.0 || top_k_within)
            && params.top_logprobs <= TOP_CANDIDATES
            && !params.penalties_enabled()
            && params.logit_bias.is_empty()
    }

    /// What [`Sampler::sample`] would give for the row that `best` and
    /// `candidates` (its best, as [`collect_best`] orders them, all of them
    /// when fewer than [`TOP_CANDIDATES`]) were taken of, drawing the same
    /// random number, for a sampler that
    /// [`needs_only_candidates`](Sampler::needs_only_candidates).
    pub fn sample_candidates(&mut self, best: BestToken, candidates: &[(u32, f32)]) -> Sampled {
        let (max_logit, mass) = (best.logit, best.mass);
        let log_normaliser = max_logit + mass.ln();
        let token = if self.params.temperature == 0.0 {
            best.token
        } else {
            let top_k = self.params.top_k.min(candidates.len());
            self.draw_sorted(&candidates[..top_k], max_logit)
                .unwrap_or(best.token)
        };
        // The drawn token is a candidate; the greedy one is too unless every
        // logit is NaN, when `sample` reads a NaN logit.
        let logprob = candidates
            .iter()
            .find(|&&(id, _)| id == token)
            .map_or(f32::NAN, |&(_, logit)| logit - log_normaliser);
        let listed = self.params.top_logprobs.min(candidates.len());
        let top_logprobs = candidates[..listed]
            .iter()
            .map(|&(id, logit)| (id, logit - log_normaliser))
            .collect();
        Sampled {
            token,
            logprob,
            top_logprobs,
        }
    }

    /// The token [`Sampler::sample`] would choose from the row `best` was
    /// taken of, with the same logprob, for a sampler that
    /// [`needs_only_best`](Sampler::needs_only_best) (any other gets the
    /// greedy token too).
    pub fn sample_best(&self, best: BestToken) -> Sampled {
        Sampled {
            token: best.token,
            logprob: best.logprob(),
            top_logprobs: Vec::new(),
        }
    }

    /// Chooses the next token.
    ///
    /// `logits` has one entry per vocabulary token and is modified in place by
    /// the logit bias and the penalties (so the caller sees what was sampled
    /// from). `history` is
    /// every token id so far, prompt included; ids outside the vocabulary are
    /// ignored. NaN logits are never chosen. Empty `logits` give token 0 with
    /// logprob `-inf` rather than a panic.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Sampled {
        for &(token, bias) in &self.params.logit_bias {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit = if bias <= -MAX_LOGIT_BIAS {
                    f32::NEG_INFINITY
                } else {
                    *logit + bias
                };
            }
        }
        if self.params.penalties_enabled() {
            self.apply_penalties(logits, history);
        }
        let best = BestToken::of(logits, 0);
        let (max_logit, mass) = (best.logit, best.mass);
        let log_normaliser = max_logit + mass.ln();

        let token = if self.params.temperature == 0.0 {
            best.token
        } else {
            self.draw(logits, max_logit, mass).unwrap_or(best.token)
        };
        let logprob_of = |logit: f32| logit - log_normaliser;
        let logprob = logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| logprob_of(l));
        let top_logprobs = if self.params.top_logprobs > 0 {
            collect_best(logits, self.params.top_logprobs, &mut self.top_scratch);
            self.top_scratch
                .iter()
                .map(|&(id, l)| (id, logprob_of(l)))
                .collect()
        } else {
            Vec::new()
        };
        Sampled {
            token,
            logprob,
            top_logprobs,
        }
    }

    /// Repetition, presence and frequency penalties over the last
    /// `penalty_window` tokens of `history`, as llama.cpp applies them.
    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let window = match self.params.penalty_window {
            0 => history,
            n => &history[history.len().saturating_sub(n)..],
        };
        if self.occurrence_counts.len() < logits.len() {
            self.occurrence_counts.resize(logits.len(), 0);
        }
        self.seen_tokens.clear();
        for &token in window {
            let Some(count) = self.occurrence_counts.get_mut(token as usize) else {
                continue;
            };
            if *count == 0 {
                self.seen_tokens.push(token);
            }
            *count += 1;
        }
        let params = &self.params;
        for &token in &self.seen_tokens {
            let index = token as usize;
            // Taking the count also resets it for the next call.
            let count = self
                .occurrence_counts
                .get_mut(index)
                .map_or(0, std::mem::take);
            let Some(logit) = logits.get_mut(index) else {
                continue;
            };
            if *logit <= 0.0 {
                *logit *= params.repetition_penalty;
            } else {
                *logit /= params.repetition_penalty;
            }
            *logit -= count as f32 * params.frequency_penalty + params.presence_penalty;
        }
    }

    /// Truncates the candidates, applies temperature and draws one. `None`
    /// when there is nothing to draw from (the caller takes the argmax).
    fn draw(&mut self, logits: &[f32], max_logit: f32, mass: f32) -> Option<u32> {
        if !self.can_draw(max_logit) {
            return None;
        }
        let top_k = self.params.top_k;
        if top_k > 0 && top_k <= STREAMING_TOP_K_LIMIT {
            collect_best(logits, top_k, &mut self.candidates);
            return self.draw_from_candidates(max_logit, mass, true);
        }
        // -inf and NaN logits stay in but get weight exactly 0 (see
        // `exp_non_positive`) and rank last, so they are never drawn; not
        // filtering them keeps this copy a straight, memcpy-like loop.
        self.candidates.clear();
        self.candidates.extend((0u32..).zip(logits.iter().copied()));
        // After top-k the candidates are sorted best first.
        let mut sorted = false;
        if top_k > 0 && top_k < self.candidates.len() {
            self.candidates
                .select_nth_unstable_by(top_k - 1, best_first);
            self.candidates.truncate(top_k);
            self.candidates.sort_unstable_by(best_first);
            sorted = true;
        }
        self.draw_from_candidates(max_logit, mass, sorted)
    }

    /// [`Sampler::draw`] from a row's best candidates, already sorted and
    /// cut to top-k.
    fn draw_sorted(&mut self, candidates: &[(u32, f32)], max_logit: f32) -> Option<u32> {
        if !self.can_draw(max_logit) {
            return None;
        }
        self.candidates.clear();
        self.candidates.extend_from_slice(candidates);
        // A sorted set's mass is computed from it: the row's is not read.
        self.draw_from_candidates(max_logit, f32::NAN, true)
    }

    /// Whether there is anything to draw from: an infinite logit, or a
    /// temperature so small that its inverse overflows, leaves nothing but
    /// the argmax.
    fn can_draw(&self, max_logit: f32) -> bool {
        max_logit.is_finite() && (1.0 / self.params.temperature).is_finite()
    }

    /// Top-p, min-p and the temperature over `self.candidates` (the whole
    /// row's, whose mass is `mass`, or a sorted top-k), then one draw.
    fn draw_from_candidates(&mut self, max_logit: f32, mass: f32, sorted: bool) -> Option<u32> {
        if self.params.top_p < 1.0 {
            // Without top-k the candidates are the whole vocabulary, whose
            // mass is already known.
            let candidate_mass = if sorted {
                let kept = self.candidates.iter();
                kept.map(|&(_, logit)| exp_non_positive(logit - max_logit))
                    .sum()
            } else {
                mass
            };
            self.apply_top_p(max_logit, candidate_mass, sorted);
        }
        if self.params.min_p > 0.0 {
            // p >= min_p * p_max  <=>  logit >= max_logit + ln(min_p). The best
            // candidate always survives, so the set never becomes empty.
            let threshold = max_logit + self.params.min_p.ln();
            self.candidates.retain(|&(_, logit)| logit >= threshold);
        }

        // Softmax at the requested temperature, weights stored in place.
        let inverse_temperature = 1.0 / self.params.temperature;
        let total = softmax_weights_in_place(&mut self.candidates, max_logit, inverse_temperature);
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let drawn_mass = self.rng.gen::<f64>() * f64::from(total);
        pick_by_weight(&self.candidates, drawn_mass)
    }

    /// Keeps the smallest best-first prefix whose temperature-1 probability
    /// (normalised over the current candidates, as llama.cpp does after top-k)
    /// reaches `top_p`.
    ///
    /// Unsorted candidates are not sorted whole: the likeliest are moved to
    /// the front in widening bands below the maximum logit until the front
    /// holds the target mass. The nucleus lies inside that front, so the rest
    /// is dropped and only the front is sorted.
    fn apply_top_p(&mut self, max_logit: f32, candidate_mass: f32, sorted: bool) {
        let target = f64::from(self.params.top_p) * f64::from(candidate_mass);
        if !sorted {
            let mut front_len = 0;
            let mut front_mass = 0.0f64;
            for gap in TOP_P_BANDS {
                let threshold = max_logit - gap;
                let rest = &mut self.candidates[front_len..];
                let mut moved = 0;
                for index in 0..rest.len() {
                    let logit = rest[index].1;
                    // False for NaN, which therefore never enters the front.
                    if logit >= threshold {
                        rest.swap(moved, index);
                        moved += 1;
                        front_mass += f64::from(exp_non_positive(logit - max_logit));
                    }
                }
                front_len += moved;
                if front_mass >= target {
                    break;
                }
            }
            self.candidates.truncate(front_len);
            self.candidates.sort_unstable_by(best_first);
        }
        let mut cumulative = 0.0f64;
        for (index, &(_, logit)) in self.candidates.iter().enumerate() {
            cumulative += f64::from(exp_non_positive(logit - max_logit));
            if cumulative >= target {
                self.candidates.truncate(index + 1);
                return;
            }
        }
        // Rounding kept the target out of reach: the whole set is the nucleus.
    }
}

/// Replaces each candidate's logit by its unnormalised softmax weight
/// `exp((logit - max_logit) / temperature)` and returns their sum. Eight
/// independent accumulators let the compiler vectorize the loop.
fn softmax_weights_in_place(
    candidates: &mut [(u32, f32)],
    max_logit: f32,
    inverse_temperature: f32,
) -> f32 {
    const LANES: usize = 8;
    let mut lanes = [0.0f32; LANES];
    let mut chunks = candidates.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (lane, candidate) in lanes.iter_mut().zip(chunk) {
            candidate.1 = exp_non_positive((candidate.1 - max_logit) * inverse_temperature);
            *lane += candidate.1;
        }
    }
    let mut tail_sum = 0.0f32;
    for candidate in chunks.into_remainder() {
        candidate.1 = exp_non_positive((candidate.1 - max_logit) * inverse_temperature);
        tail_sum += candidate.1;
    }
    lanes.iter().sum::<f32>() + tail_sum
}

/// The candidate at cumulative weight `drawn_mass`. Whole chunks are skipped
/// by their sum, which shortens the sequential dependency chain eightfold.
/// A candidate of weight 0 is never returned.
fn pick_by_weight(weighted: &[(u32, f32)], drawn_mass: f64) -> Option<u32> {
    const CHUNK: usize = 8;
    let mut remaining = drawn_mass;
    for chunk in weighted.chunks(CHUNK) {
        let chunk_weight = f64::from(chunk.iter().map(|&(_, weight)| weight).sum::<f32>());
        if remaining >= chunk_weight {
            remaining -= chunk_weight;
            continue;
        }
        for &(id, weight) in chunk {
            remaining -= f64::from(weight);
            if remaining < 0.0 {
                return Some(id);
            }
        }
    }
    // Rounding left a sliver of mass: it belongs to the last candidate that
    // has any (never to one whose weight underflowed to zero).
    weighted
        .iter()
        .rev()
        .find(|&&(_, weight)| weight > 0.0)
        .map(|&(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logits::{argmax, sum_exp_below};

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(7),
            ..SamplingParams::default()
        }
    }

    /// A pseudo-random logit vector (no two equal) without an extra dependency.
    fn logits(n: usize, salt: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(salt);
        (0..n).map(|_| rng.gen_range(-10.0f32..10.0)).collect()
    }

    /// `sample` on whole rows and `sample_candidates` on what a GPU reads
    /// back of them give the same tokens, logprobs and alternatives, draw
    /// after draw (the same random numbers), for every sampler that needs
    /// only candidates.
    #[test]
    fn candidates_sample_as_the_whole_row_does() {
        use crate::logits::BestRows;
        let mut rows: Vec<Vec<f32>> = (0..6).map(|salt| logits(1000, salt)).collect();
        // Ties across the 40th place, NaN and -inf; a vocabulary smaller
        // than the candidates; a row of NaN but one.
        let mut tied = logits(1000, 9);
        let mut order = tied.clone();
        order.sort_by(|a, b| b.total_cmp(a));
        for at in [3, 500, 999, 12, 640] {
            tied[at] = order[39];
        }
        tied[7] = f32::NAN;
        tied[8] = f32::NEG_INFINITY;
        rows.push(tied);
        rows.push(vec![0.5, -1.0, 2.0]);
        rows.push(vec![f32::NAN, f32::NAN, 1.0, f32::NAN]);
        let mut variants = Vec::new();
        for (temperature, top_k, top_p, min_p, top_logprobs) in [
            (0.0, 0, 1.0, 0.0, 5),
            (0.0, 0, 1.0, 0.0, MAX_TOP_LOGPROBS),
            (0.8, 40, 1.0, 0.0, 0),
            (1.0, 1, 1.0, 0.0, 3),
            (1.3, TOP_CANDIDATES, 0.9, 0.0, 2),
            (0.7, 20, 0.95, 0.05, 20),
            (5.0, 64, 0.5, 0.0, 0),
        ] {
            variants.push(SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                top_logprobs,
                seed: Some(3),
                ..SamplingParams::default()
            });
        }
        for p in variants {
            let mut whole = Sampler::new(p.clone(), 1000).unwrap();
            let mut from_candidates = Sampler::new(p.clone(), 1000).unwrap();
            assert!(from_candidates.needs_only_candidates(), "{p:?}");
            for round in 0..20 {
                for row in &rows {
                    let mut best = BestRows::default();
                    best.take_of(row, row.len(), true);
                    let (token, kept) = best.view().row(0);
                    let got = from_candidates.sample_candidates(token, kept);
                    let want = whole.sample(&mut row.clone(), &[]);
                    let what = format!("{p:?}, round {round}, a row of {}", row.len());
                    assert_eq!(got.token, want.token, "{what}");
                    assert_eq!(got.logprob.to_bits(), want.logprob.to_bits(), "{what}");
                    assert_eq!(got.top_logprobs, want.top_logprobs, "{what}");
                }
            }
        }
    }

    #[test]
    fn only_what_reads_or_changes_the_whole_row_needs_it() {
        let needs = |change: &dyn Fn(&mut SamplingParams)| {
            let mut p = params(0.8);
            p.top_k = 40;
            change(&mut p);
            Sampler::new(p, 1000).unwrap().needs_only_candidates()
        };
        assert!(needs(&|_| {}));
        assert!(needs(&|p| p.temperature = 0.0));
        assert!(needs(&|p| {
            p.temperature = 0.0;
            p.top_k = 0;
        }));
        assert!(!needs(&|p| p.top_k = 0));
        assert!(!needs(&|p| p.top_k = TOP_CANDIDATES + 1));
        assert!(!needs(&|p| p.repetition_penalty = 1.1));
        assert!(!needs(&|p| p.presence_penalty = 0.5));
        assert!(!needs(&|p| p.logit_bias = vec![(3, 1.0)]));
    }

    #[test]
    fn unset_fields_take_the_models_defaults_then_the_dialects() {
        let model = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.9),
            ..SamplingDefaults::default()
        };
        let left = LeftToModel {
            temperature: true,
            top_p: true,
            top_k: true,
            dialect_temperature: Some(1.0),
            ..LeftToModel::default()
        };
        let filled = model.fill(SamplingParams::default(), &left);
        assert_eq!(
            (filled.temperature, filled.top_p, filled.top_k),
            (0.6, 0.9, 0)
        );
        // A model that recommends nothing: the dialect's temperature.
        let filled = SamplingDefaults::default().fill(SamplingParams::default(), &left);
        assert_eq!(filled.temperature, 1.0);
        // A field the request set is kept.
        let set = SamplingParams {
            top_p: 0.5,
            ..SamplingParams::default()
        };
        let kept = LeftToModel {
            top_p: false,
            ..left
        };
        assert_eq!(model.fill(set, &kept).top_p, 0.5);
        // Nothing left to the model: nothing changes.
        assert_eq!(
            model.fill(SamplingParams::default(), &LeftToModel::default()),
            SamplingParams::default()
        );
    }

    #[test]
    fn a_bias_of_minus_100_bans_a_token_and_others_shift_it() {
        let row = logits(1000, 3);
        let (best, _) = argmax(&row);
        let best = best as usize;
        let banned = SamplingParams {
            logit_bias: vec![(best as u32, -100.0)],
            ..params(0.0)
        };
        let mut sampler = Sampler::new(banned, row.len()).unwrap();
        assert!(!sampler.needs_only_best());
        for _ in 0..20 {
            assert_ne!(sampler.sample(&mut row.clone(), &[]).token, best as u32);
        }
        // Hot sampling never draws it either.
        let mut hot = Sampler::new(
            SamplingParams {
                logit_bias: vec![(best as u32, -100.0)],
                top_logprobs: 5,
                ..params(5.0)
            },
            row.len(),
        )
        .unwrap();
        for _ in 0..200 {
            let sampled = hot.sample(&mut row.clone(), &[]);
            assert_ne!(sampled.token, best as u32);
            assert!(sampled.top_logprobs.iter().all(|&(t, _)| t != best as u32));
        }
        // +100 makes the least likely token the greedy choice.
        let worst = (0..row.len())
            .min_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap();
        let favoured = SamplingParams {
            logit_bias: vec![(worst as u32, 100.0)],
            ..params(0.0)
        };
        let mut sampler = Sampler::new(favoured, row.len()).unwrap();
        assert_eq!(sampler.sample(&mut row.clone(), &[]).token, worst as u32);
    }

    #[test]
    fn a_bias_out_of_range_or_beyond_the_vocabulary_is_refused() {
        let out_of_range = SamplingParams {
            logit_bias: vec![(3, 150.0)],
            ..params(0.0)
        };
        assert!(matches!(
            out_of_range.validate(),
            Err(SamplingError::InvalidParameter {
                field: "logit_bias",
                ..
            })
        ));
        let beyond = SamplingParams {
            logit_bias: vec![(5000, -1.0)],
            ..params(0.0)
        };
        assert!(beyond.validate().is_ok());
        assert_eq!(
            Sampler::new(beyond, 1000).unwrap_err(),
            SamplingError::BiasBeyondVocabulary {
                token: 5000,
                vocab_size: 1000
            }
        );
    }

    /// A row's best taken in slices (a tensor rank's share of the head
    /// each) and combined is the whole row's: the same token, ties and NaN
    /// included, and the same logprob within rounding.
    #[test]
    fn bests_of_slices_combine_into_the_whole_rows() {
        let mut rows = vec![
            vec![1.0, 3.0, f32::NAN, 3.0, -1.0, 3.0],
            vec![f32::NEG_INFINITY; 6],
            vec![f32::NAN, f32::NEG_INFINITY, 2.0, 2.0, f32::NAN, 0.5],
        ];
        for salt in 0..4 {
            let mut row = logits(1000, salt);
            // A tie between the slices, the later one first in value.
            row[900] = 11.0;
            row[100 + salt as usize * 250] = 11.0;
            rows.push(row);
        }
        let sampler = Sampler::new(SamplingParams::default(), 1000).unwrap();
        assert!(sampler.needs_only_best());
        for row in &rows {
            let whole = BestToken::of(row, 0);
            let sampled = Sampler::new(SamplingParams::default(), row.len())
                .unwrap()
                .sample(&mut row.clone(), &[]);
            let from_best = sampler.sample_best(whole);
            assert_eq!(from_best.token, sampled.token);
            assert_eq!(from_best.logprob.to_bits(), sampled.logprob.to_bits());
            let n = row.len();
            for cuts in [
                vec![0, n],
                vec![0, 2, n],
                vec![0, 1, 3, 4, n],
                vec![0, n / 2, n],
                vec![0, n / 3, 2 * n / 3, n],
            ] {
                let parts = cuts
                    .windows(2)
                    .map(|w| BestToken::of(&row[w[0]..w[1]], w[0] as u32));
                let combined = BestToken::combine(parts).unwrap();
                assert_eq!(combined.token, whole.token, "{row:?} cut at {cuts:?}");
                assert_eq!(combined.logit.to_bits(), whole.logit.to_bits());
                let (a, b) = (combined.logprob(), whole.logprob());
                assert!(
                    a.to_bits() == b.to_bits() || (a - b).abs() < 1e-5,
                    "{a} vs {b}"
                );
                let words = BestToken::from_words(combined.to_words());
                assert_eq!(words.token, combined.token);
            }
        }
        assert_eq!(BestToken::combine(std::iter::empty()), None);
        for params in [
            SamplingParams {
                temperature: 0.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_logprobs: 2,
                ..SamplingParams::default()
            },
        ] {
            assert!(!Sampler::new(params, 10).unwrap().needs_only_best());
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut sampler = Sampler::new(SamplingParams::default(), 49_152).unwrap();
        for salt in 0..5 {
            let mut l = logits(49_152, salt);
            let expected = (0..l.len())
                .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            assert_eq!(sampler.sample(&mut l, &[]).token, expected);
        }
        let mut tied = vec![1.0, 3.0, f32::NAN, 3.0, -1.0];
        assert_eq!(sampler.sample(&mut tied, &[]).token, 1);
        let mut empty: Vec<f32> = Vec::new();
        let sampled = sampler.sample(&mut empty, &[]);
        assert_eq!((sampled.token, sampled.logprob), (0, f32::NEG_INFINITY));
    }

    #[test]
    fn same_seed_reproduces_the_same_tokens() {
        let base = logits(1000, 3);
        let run = |seed| {
            let mut p = params(1.5);
            p.seed = Some(seed);
            p.top_p = 0.95;
            let mut sampler = Sampler::new(p, 1000).unwrap();
            (0..50)
                .map(|_| sampler.sample(&mut base.clone(), &[]).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        for salt in 0..20 {
            let base = logits(5000, salt);
            let greedy = argmax(&base).0;
            for temperature in [0.5, 1.0, 5.0] {
                let mut k1 = params(temperature);
                k1.top_k = 1;
                let mut sampler = Sampler::new(k1, 5000).unwrap();
                assert_eq!(sampler.sample(&mut base.clone(), &[]).token, greedy);
                let mut tiny_p = params(temperature);
                tiny_p.top_p = 1e-6;
                let mut sampler = Sampler::new(tiny_p, 5000).unwrap();
                assert_eq!(sampler.sample(&mut base.clone(), &[]).token, greedy);
            }
        }
    }

    #[test]
    fn top_k_keeps_the_k_best_by_either_method() {
        for top_k in [3, STREAMING_TOP_K_LIMIT + 2] {
            let base = logits(1000, 5);
            let mut best: Vec<(u32, f32)> = (0u32..).zip(base.iter().copied()).collect();
            best.sort_by(best_first);
            let allowed: std::collections::BTreeSet<u32> =
                best[..top_k].iter().map(|&(id, _)| id).collect();
            let mut p = params(20.0);
            p.top_k = top_k;
            let mut sampler = Sampler::new(p, 1000).unwrap();
            let drawn: std::collections::BTreeSet<u32> = (0..3000)
                .map(|_| sampler.sample(&mut base.clone(), &[]).token)
                .collect();
            assert!(drawn.is_subset(&allowed), "top_k {top_k}");
            assert!(drawn.len() > top_k / 2, "top_k {top_k}: {}", drawn.len());
        }
        let mut best = Vec::new();
        collect_best(&[1.0, f32::NAN, 3.0, 3.0, 2.0], 3, &mut best);
        assert_eq!(best, vec![(2, 3.0), (3, 3.0), (4, 2.0)]);
        collect_best(&[1.0], 0, &mut best);
        assert!(best.is_empty());
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities ~ 0.5, 0.25, 0.125, ...: top_p 0.7 keeps tokens 0 and 1.
        let base: Vec<f32> = (0..200)
            .map(|i| -(i as f32) * std::f32::consts::LN_2)
            .collect();
        let mut p = params(1.0);
        p.top_p = 0.7;
        let mut sampler = Sampler::new(p.clone(), 200).unwrap();
        let drawn: std::collections::BTreeSet<u32> = (0..500)
            .map(|_| sampler.sample(&mut base.clone(), &[]).token)
            .collect();
        assert_eq!(drawn.into_iter().collect::<Vec<_>>(), vec![0, 1]);
        // Same with top-k in front, and with a nucleus wider than the first window.
        p.top_k = 50;
        let mut sampler = Sampler::new(p, 200).unwrap();
        assert!((0..200).all(|_| sampler.sample(&mut base.clone(), &[]).token < 2));
        let flat = vec![0.0f32; 1000];
        let mut wide = params(1.0);
        wide.top_p = 0.5;
        let mut sampler = Sampler::new(wide, 1000).unwrap();
        assert!((0..500).all(|_| sampler.sample(&mut flat.clone(), &[]).token < 500));
    }

    #[test]
    fn min_p_filters_unlikely_tokens() {
        // p ∝ 1, 0.5, 0.2, 0.05: min_p 0.3 keeps only tokens 0 and 1.
        let base: Vec<f32> = [1.0f32, 0.5, 0.2, 0.05].iter().map(|p| p.ln()).collect();
        let mut p = params(2.0);
        p.min_p = 0.3;
        let mut sampler = Sampler::new(p, 4).unwrap();
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[sampler.sample(&mut base.clone(), &[]).token as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
    }

    #[test]
    fn penalties_change_the_argmax() {
        let base = vec![5.0f32, 4.0, 3.0, -1.0];
        let mut repetition = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(repetition.clone(), 4).unwrap();
        let mut l = base.clone();
        assert_eq!(sampler.sample(&mut l, &[0, 0, 3]).token, 1);
        assert_eq!(l, vec![2.5, 4.0, 3.0, -2.0]);
        // Tokens outside the window are not penalised.
        repetition.penalty_window = 1;
        let mut sampler = Sampler::new(repetition, 4).unwrap();
        assert_eq!(sampler.sample(&mut base.clone(), &[0, 3]).token, 0);

        let frequency = SamplingParams {
            frequency_penalty: 0.6,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(frequency, 4).unwrap();
        let mut l = base.clone();
        // Token 0 seen twice: 5 - 1.2 = 3.8 < 4.
        assert_eq!(sampler.sample(&mut l, &[0, 2, 0, 99]).token, 1);
        let expected = [3.8f32, 4.0, 2.4, -1.0];
        assert!(
            l.iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-5),
            "{l:?}"
        );

        let presence = SamplingParams {
            presence_penalty: 1.5,
            penalty_window: 0,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(presence, 4).unwrap();
        let history: Vec<u32> = std::iter::repeat_n(0, 500).collect();
        let mut l = base.clone();
        assert_eq!(sampler.sample(&mut l, &history).token, 1);
        assert_eq!(l[0], 3.5);
        // Counts are reset between calls: the same penalty applies again, once.
        let mut l = base.clone();
        sampler.sample(&mut l, &history);
        assert_eq!(l[0], 3.5);
    }

    #[test]
    fn validate_names_field_and_value() {
        let cases: Vec<(SamplingParams, &str, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.5,
                    ..Default::default()
                },
                "temperature",
                "-0.5",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
                "NaN",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
                "0",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
                "1.5",
            ),
            (
                SamplingParams {
                    min_p: -0.1,
                    ..Default::default()
                },
                "min_p",
                "-0.1",
            ),
            (
                SamplingParams {
                    min_p: 2.0,
                    ..Default::default()
                },
                "min_p",
                "2",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
                "0",
            ),
            (
                SamplingParams {
                    top_logprobs: 21,
                    ..Default::default()
                },
                "top_logprobs",
                "21",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::INFINITY,
                    ..Default::default()
                },
                "presence_penalty",
                "inf",
            ),
        ];
        for (p, field, value) in cases {
            let error = p.validate().unwrap_err();
            let message = error.to_string();
            assert!(
                message.contains(field) && message.contains(value),
                "{message}"
            );
            assert!(Sampler::new(p, 10).is_err());
        }
        assert!(SamplingParams::default().validate().is_ok());
        assert_eq!(
            Sampler::new(SamplingParams::default(), 0).err(),
            Some(SamplingError::EmptyVocabulary)
        );
    }

    #[test]
    fn defaults_and_partial_deserialization() {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature":0.7}"#).unwrap();
        assert_eq!(p.temperature, 0.7);
        assert_eq!(p.penalty_window, 64);
        assert_eq!(p.top_p, 1.0);
        let round_trip: SamplingParams =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(round_trip, p);
    }

    #[test]
    fn logprobs_are_log_softmax_of_the_penalised_logits() {
        let base = logits(300, 9);
        let mut p = params(0.8);
        p.top_logprobs = 20;
        p.top_k = 5;
        let mut sampler = Sampler::new(p, 300).unwrap();
        let mut l = base.clone();
        let sampled = sampler.sample(&mut l, &[]);
        let max = argmax(&l).1;
        let lse = max + l.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
        let total: f32 = l.iter().map(|x| (x - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
        assert!((sampled.logprob - (l[sampled.token as usize] - lse)).abs() < 1e-5);
        assert_eq!(sampled.top_logprobs.len(), 20);
        let mut expected: Vec<(u32, f32)> = (0u32..).zip(l.iter().copied()).collect();
        expected.sort_by(best_first);
        for (got, want) in sampled.top_logprobs.iter().zip(&expected) {
            assert_eq!(got.0, want.0);
            assert!((got.1 - (want.1 - lse)).abs() < 1e-5);
        }
        // Ties: best first, lower id first.
        let mut sampler = Sampler::new(
            SamplingParams {
                top_logprobs: 3,
                ..Default::default()
            },
            4,
        )
        .unwrap();
        let s = sampler.sample(&mut [1.0, 2.0, 2.0, 2.0], &[]);
        assert_eq!(
            s.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert!(sampler.sample(&mut [0.0; 4], &[]).top_logprobs.len() == 3);
        let mut off = Sampler::new(params(1.0), 4).unwrap();
        assert!(off.sample(&mut [0.0; 4], &[]).top_logprobs.is_empty());
    }

    #[test]
    fn draws_follow_the_softmax_distribution() {
        let base = [1.0f32, 0.0, -0.5];
        let mut sampler = Sampler::new(params(1.0), 3).unwrap();
        let mut counts = [0usize; 3];
        let draws = 10_000;
        for _ in 0..draws {
            counts[sampler.sample(&mut base.clone(), &[]).token as usize] += 1;
        }
        let normaliser: f32 = base.iter().map(|l| l.exp()).sum();
        for (count, logit) in counts.iter().zip(base) {
            let expected = logit.exp() / normaliser;
            let observed = *count as f32 / draws as f32;
            assert!((observed - expected).abs() < 0.02, "{counts:?}");
        }
        // Temperature reshapes the distribution: at T=2, p ∝ exp(l/2).
        let mut sampler = Sampler::new(params(2.0), 3).unwrap();
        let mut counts = [0usize; 3];
        for _ in 0..draws {
            counts[sampler.sample(&mut base.clone(), &[]).token as usize] += 1;
        }
        let normaliser: f32 = base.iter().map(|l| (l / 2.0).exp()).sum();
        for (count, logit) in counts.iter().zip(base) {
            let expected = (logit / 2.0).exp() / normaliser;
            assert!(
                (*count as f32 / draws as f32 - expected).abs() < 0.02,
                "{counts:?}"
            );
        }
    }

    #[test]
    fn fast_exp_matches_std() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let (fast, exact) = (exp_non_positive(x), x.exp());
            let error = (fast - exact).abs();
            assert!(error <= 1e-5 * exact, "{x}: {fast} vs {exact}");
            x -= 0.00137;
        }
        assert_eq!(exp_non_positive(f32::NAN), 0.0);
        assert_eq!(exp_non_positive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_non_positive(-100.0), 0.0);
        assert_eq!(exp_non_positive(0.0), 1.0);
        let values: Vec<f32> = (0..1001).map(|i| -(i as f32) * 0.01).collect();
        let exact: f32 = values.iter().map(|v| v.exp()).sum();
        assert!((sum_exp_below(&values, 0.0) - exact).abs() < 1e-4 * exact);
    }

    #[test]
    fn pick_by_weight_skips_zero_weights() {
        let weighted: Vec<(u32, f32)> = (0..20)
            .map(|i| (i, if i % 3 == 0 { 1.0 } else { 0.0 }))
            .collect();
        assert_eq!(pick_by_weight(&weighted, 0.0), Some(0));
        assert_eq!(pick_by_weight(&weighted, 1.0), Some(3));
        assert_eq!(pick_by_weight(&weighted, 6.5), Some(18));
        // Mass past the total (rounding) goes to the last weighted candidate.
        assert_eq!(pick_by_weight(&weighted, 7.5), Some(18));
        assert_eq!(pick_by_weight(&[(0, 0.0)], 0.0), None);
    }

    #[test]
    fn non_finite_logits_are_never_drawn() {
        let mut sampler = Sampler::new(params(1.0), 4).unwrap();
        for _ in 0..200 {
            let token = sampler
                .sample(&mut [f32::NEG_INFINITY, 0.0, f32::NAN, 0.0], &[])
                .token;
            assert!(token == 1 || token == 3);
        }
        let all_masked = sampler.sample(&mut [f32::NEG_INFINITY; 3], &[]);
        assert_eq!(all_masked.token, 0);
        let infinite = sampler.sample(&mut [0.0, f32::INFINITY, 1.0], &[]);
        assert_eq!(infinite.token, 1);
        let mut cold = Sampler::new(params(1e-45), 3).unwrap();
        assert_eq!(cold.sample(&mut [0.0, 2.0, 1.0], &[]).token, 1);
    }
}
