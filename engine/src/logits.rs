//! Reductions over a row of logits, shared by the LM head (which may
//! return only a row's best token) and the sampler: the best token, the
//! softmax's normaliser, and a fast `exp` for both.

/// What greedy sampling needs of a row of logits: its most likely token
/// (the lowest id on ties, never NaN), that token's logit, and the row's
/// probability mass relative to it, `sum(exp(logit - best))` (the
/// temperature-1 softmax's normaliser, for the logprob).
///
/// It can be taken of consecutive slices of a row on different machines
/// and [`combined`](BestToken::combine): a tensor-parallel rank then sends
/// 12 bytes per row rather than its share of the vocabulary, and the token
/// is the one a whole row gives, bit for bit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BestToken {
    pub token: u32,
    pub logit: f32,
    pub mass: f32,
}

impl BestToken {
    /// Values per token on the wire ([`BestToken::to_words`]).
    pub const WORDS: usize = 3;

    /// The best of `logits`, whose first entry is token `first_id`.
    pub fn of(logits: &[f32], first_id: u32) -> Self {
        let (at, logit) = argmax(logits);
        // Probability mass relative to the best token: the normaliser of
        // the temperature-1 softmax, shared by the logprobs and by top-p.
        let mass = if logit.is_finite() {
            sum_exp_below(logits, logit)
        } else {
            1.0
        };
        Self {
            token: first_id + at,
            logit,
            mass,
        }
    }

    /// The best of a row from the bests of its slices, in vocabulary
    /// order: the first slice holding the maximum wins, as the lowest id
    /// does in one pass over the row. `None` without slices.
    pub fn combine<I>(parts: I) -> Option<Self>
    where
        I: Iterator<Item = BestToken> + Clone,
    {
        // `>` is false for NaN and keeps the earlier slice on ties.
        let mut best = parts
            .clone()
            .reduce(|best, part| if part.logit > best.logit { part } else { best })?;
        if best.logit.is_finite() {
            best.mass = parts
                .map(|part| part.mass * (part.logit - best.logit).exp())
                .filter(|m| !m.is_nan())
                .sum();
        }
        Some(best)
    }

    /// Its logprob: what [`crate::serve::sampler::Sampler::sample`] reports for the greedy token.
    pub fn logprob(&self) -> f32 {
        self.logit - (self.logit + self.mass.ln())
    }

    /// Three f32 words, the token's id as its bits, for a collective that
    /// carries f32s (copied, never computed on).
    pub fn to_words(&self) -> [f32; 3] {
        [f32::from_bits(self.token), self.logit, self.mass]
    }

    pub fn from_words(words: [f32; 3]) -> Self {
        Self {
            token: words[0].to_bits(),
            logit: words[1],
            mass: words[2],
        }
    }
}

/// Writes the `n` best `(token, logit)` pairs to `best`, best first (ties:
/// lower id first), skipping NaN. One pass keeping a small sorted list: most
/// logits cost one comparison against the worst kept, so this is linear in
/// the vocabulary with no sort and no allocation once `best` has grown.
pub fn collect_best(logits: &[f32], n: usize, best: &mut Vec<(u32, f32)>) {
    best.clear();
    if n == 0 {
        return;
    }
    let mut worst_kept = f32::NEG_INFINITY;
    for (id, &logit) in (0u32..).zip(logits) {
        if best.len() == n {
            // Only strictly greater enters: on ties the lower id stays.
            if logit.is_nan() || logit <= worst_kept {
                continue;
            }
            best.pop();
        } else if logit.is_nan() {
            continue;
        }
        let position = best.partition_point(|&(_, kept)| kept >= logit);
        best.insert(position, (id, logit));
        if best.len() == n {
            worst_kept = best.last().map_or(f32::NEG_INFINITY, |&(_, l)| l);
        }
    }
}

/// Candidates a row keeps when only its best few come back
/// ([`BestRows`]): enough for the top-k of llama.cpp's and Ollama's
/// defaults (40), and for every `top_logprobs` OpenAI allows (20).
pub const TOP_CANDIDATES: usize = 64;

/// Pads a row's candidates when it has fewer than [`TOP_CANDIDATES`] that
/// are not NaN (a vocabulary that small, or NaN logits).
const NO_CANDIDATE: (u32, f32) = (u32::MAX, f32::NAN);

/// What the sampler needs of some rows of logits when it needs less than
/// the whole rows: each row's [`BestToken`], and, when asked for, its
/// [`TOP_CANDIDATES`] best `(token, logit)` pairs as [`collect_best`]
/// orders them (padded to that many with an id of `u32::MAX`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BestRows {
    pub tokens: Vec<BestToken>,
    pub candidates: Vec<(u32, f32)>,
}

impl BestRows {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.candidates.clear();
    }

    /// Replaces these rows by those of `logits` (rows of `vocab`), with
    /// their candidates when `with_candidates`.
    pub fn take_of(&mut self, logits: &[f32], vocab: usize, with_candidates: bool) {
        self.clear();
        if vocab == 0 {
            return;
        }
        let mut kept = Vec::with_capacity(TOP_CANDIDATES);
        for row in logits.chunks_exact(vocab) {
            self.tokens.push(BestToken::of(row, 0));
            if with_candidates {
                collect_best(row, TOP_CANDIDATES, &mut kept);
                self.push_candidates(&kept);
            }
        }
    }

    /// Appends one row's candidates (at most [`TOP_CANDIDATES`], best
    /// first), padded.
    pub fn push_candidates(&mut self, kept: &[(u32, f32)]) {
        let kept = &kept[..kept.len().min(TOP_CANDIDATES)];
        self.candidates.extend_from_slice(kept);
        let padding = TOP_CANDIDATES - kept.len();
        self.candidates
            .extend(std::iter::repeat_n(NO_CANDIDATE, padding));
    }

    /// Replaces these rows by a copy of `rows`.
    pub fn copy_from(&mut self, rows: BestView<'_>) {
        self.clear();
        self.tokens.extend_from_slice(rows.tokens);
        self.candidates.extend_from_slice(rows.candidates);
    }

    pub fn view(&self) -> BestView<'_> {
        BestView {
            tokens: &self.tokens,
            candidates: &self.candidates,
        }
    }
}

/// Borrowed [`BestRows`], split row by row.
#[derive(Clone, Copy, Debug, Default)]
pub struct BestView<'a> {
    pub tokens: &'a [BestToken],
    /// Empty, or [`TOP_CANDIDATES`] a row.
    candidates: &'a [(u32, f32)],
}

impl<'a> BestView<'a> {
    pub fn of_tokens(tokens: &'a [BestToken]) -> Self {
        Self {
            tokens,
            candidates: &[],
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Whether the rows carry their candidates.
    pub fn has_candidates(&self) -> bool {
        !self.candidates.is_empty()
    }

    /// The first `count` rows (at most all of them), and the rest.
    pub fn split_front(self, count: usize) -> (Self, Self) {
        let count = count.min(self.tokens.len());
        let (tokens, rest_tokens) = self.tokens.split_at(count);
        let per_row = if self.candidates.is_empty() {
            0
        } else {
            TOP_CANDIDATES
        };
        let at = (count * per_row).min(self.candidates.len());
        let (candidates, rest_candidates) = self.candidates.split_at(at);
        (
            Self { tokens, candidates },
            Self {
                tokens: rest_tokens,
                candidates: rest_candidates,
            },
        )
    }

    /// Row `i`'s best token and its candidates, without the padding (empty
    /// when the rows carry none). Panics past the last row, as indexing
    /// does.
    pub fn row(&self, i: usize) -> (BestToken, &'a [(u32, f32)]) {
        let best = self.tokens[i];
        let kept = self
            .candidates
            .get(i * TOP_CANDIDATES..(i + 1) * TOP_CANDIDATES)
            .unwrap_or_default();
        let real = kept.iter().take_while(|c| c.0 != NO_CANDIDATE.0).count();
        (best, &kept[..real])
    }
}

/// Index and value of the largest logit; ties go to the lowest id and NaN is
/// never chosen. `(0, -inf)` when nothing is larger than `-inf`.
///
/// Two straight passes, no sort: the maximum over eight independent lanes
/// (which the compiler vectorizes; a single running index cannot be), then
/// the first position holding it (on average half the vocabulary).
pub(crate) fn argmax(logits: &[f32]) -> (u32, f32) {
    const LANES: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &logit) in lanes.iter_mut().zip(chunk) {
            // `>` is false for NaN, so NaN never becomes the maximum.
            *lane = if logit > *lane { logit } else { *lane };
        }
    }
    let max_logit =
        lanes.iter().chain(tail).fold(
            f32::NEG_INFINITY,
            |best, &logit| if logit > best { logit } else { best },
        );
    if max_logit == f32::NEG_INFINITY {
        return (0, max_logit);
    }
    let position = logits.iter().position(|&logit| logit == max_logit);
    (position.map_or(0, |p| p as u32), max_logit)
}

/// `sum(exp(logit - max_logit))` over the logits, NaN counted as zero.
///
/// Runs every token over the whole vocabulary, so it uses [`exp_non_positive`]
/// and eight independent accumulators, which lets the compiler vectorize the
/// loop (a single float accumulator forces strict sequential order).
pub(crate) fn sum_exp_below(logits: &[f32], max_logit: f32) -> f32 {
    const LANES: usize = 8;
    let mut lanes = [0.0f32; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &logit) in lanes.iter_mut().zip(chunk) {
            *lane += exp_non_positive(logit - max_logit);
        }
    }
    let tail_sum: f32 = tail
        .iter()
        .map(|&logit| exp_non_positive(logit - max_logit))
        .sum();
    lanes.iter().sum::<f32>() + tail_sum
}

/// `exp(x)` for `x <= 0` (larger inputs are treated as 0) with a relative
/// error below 1e-5, several times faster than `f32::exp` and branch-free so
/// that loops over it vectorize. Inputs below about -87.7, `-inf` and NaN
/// give exactly 0, so masked tokens never get weight.
///
/// Computes `2^t`, `t = x·log2(e)`, as `2^round(t)` (built in the exponent
/// bits) times `e^(frac·ln 2)` with `|frac| <= 0.5` (a degree-6 Taylor series,
/// truncation error < 2e-7).
#[inline]
pub(crate) fn exp_non_positive(x: f32) -> f32 {
    // Adding 1.5·2^23 rounds to an integer held in the low mantissa bits.
    const ROUNDING_MAGIC: f32 = 12_582_912.0;
    // `max` maps NaN (and -inf) to the lower bound. At `t = -127` the biased
    // exponent below is 0, so the result is exactly 0 without a branch.
    #[allow(clippy::manual_clamp)] // `clamp` would pass NaN through.
    let t = (x * std::f32::consts::LOG2_E).max(-127.0).min(0.0);
    let shifted = t + ROUNDING_MAGIC;
    let whole = shifted - ROUNDING_MAGIC;
    let r = (t - whole) * std::f32::consts::LN_2;
    let poly = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `whole` in [-127, 0] as a two's complement integer, biased into the
    // exponent field: [0, 127].
    let whole_bits = shifted.to_bits().wrapping_sub(ROUNDING_MAGIC.to_bits());
    let scale = f32::from_bits(whole_bits.wrapping_add(127) << 23);
    poly * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_their_candidates_best_first_and_split_row_by_row() {
        let logits = [
            1.0,
            f32::NAN,
            3.0,
            3.0,
            -2.0,
            // A second row: NaN but one.
            f32::NAN,
            f32::NAN,
            0.5,
            f32::NAN,
            f32::NAN,
        ];
        let mut rows = BestRows::default();
        rows.take_of(&logits, 5, true);
        assert_eq!(rows.candidates.len(), 2 * TOP_CANDIDATES);
        let view = rows.view();
        assert!(view.has_candidates());
        let (best, kept) = view.row(0);
        assert_eq!(best.token, 2);
        assert_eq!(kept, &[(2, 3.0), (3, 3.0), (0, 1.0), (4, -2.0)]);
        let (front, back) = view.split_front(1);
        assert_eq!(front.len(), 1);
        let (best, kept) = back.row(0);
        assert_eq!((best.token, kept), (2, &[(2, 0.5)][..]));

        rows.take_of(&logits, 5, false);
        assert!(!rows.view().has_candidates());
        assert_eq!(rows.view().row(1).1, &[]);
        let mut copy = BestRows::default();
        copy.copy_from(rows.view());
        assert_eq!(copy, rows);
    }
}
