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
