//! The n answers of one request (`n` in Chat Completions and
//! Completions), as plain functions: how many, each one's parameters
//! (their seeds apart) and their usage. `answer.rs` starts them together
//! (the engine lets the later ones take the prompt's blocks from the first
//! one's prefill) and streams them as numbered choices.

use tessera_protos::v1;

use crate::error::ApiError;

/// The most answers one request asks for.
pub const MAX_N: u32 = 16;

/// `n` checked: 1 when unset, at most [`MAX_N`].
pub fn count(n: Option<u32>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        0 => Err(ApiError::invalid("n", "n must be at least 1")),
        n if n > MAX_N => Err(ApiError::invalid(
            "n",
            format!("n must be at most {MAX_N}, got {n}"),
        )),
        n => Ok(n as usize),
    }
}

/// Answer `i`'s parameters: a set seed moves by `i`, so that each answer
/// is its own and each is reproducible.
pub fn nth(params: &v1::TextGenerationParams, i: usize) -> v1::TextGenerationParams {
    let mut params = params.clone();
    if let Some(seed) = params.sampling.as_mut().and_then(|s| s.seed.as_mut()) {
        *seed = seed.wrapping_add(i as u64);
    }
    params
}

/// The usage of one prompt's answers: the prompt counted once (the
/// first's), the completions summed.
pub fn usage(usages: &[v1::Usage]) -> v1::Usage {
    let mut total = usages.first().copied().unwrap_or_default();
    total.completion_tokens = usages.iter().map(|u| u.completion_tokens).sum();
    total.reasoning_tokens = usages.iter().map(|u| u.reasoning_tokens).sum();
    total.draft_tokens = usages.iter().map(|u| u.draft_tokens).sum();
    total.accepted_draft_tokens = usages.iter().map(|u| u.accepted_draft_tokens).sum();
    total.decode_steps = usages.iter().map(|u| u.decode_steps).sum();
    total
}

/// The usage of one prompt's finished answers ([`usage`]).
pub fn usage_of<'a>(finishes: impl IntoIterator<Item = Option<&'a v1::FinishChunk>>) -> v1::Usage {
    let usages: Vec<v1::Usage> = finishes
        .into_iter()
        .map(|f| f.and_then(|f| f.usage).unwrap_or_default())
        .collect();
    usage(&usages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_is_checked_and_each_answer_has_its_own_seed() {
        assert_eq!(count(None).ok(), Some(1));
        assert_eq!(count(Some(3)).ok(), Some(3));
        for bad in [0, MAX_N + 1] {
            assert_eq!(
                count(Some(bad)).err().and_then(|e| e.param).as_deref(),
                Some("n")
            );
        }
        let seeded = v1::TextGenerationParams {
            sampling: Some(v1::SamplingParams {
                seed: Some(7),
                ..Default::default()
            }),
            ..Default::default()
        };
        let seeds: Vec<_> = (0..3)
            .map(|i| nth(&seeded, i).sampling.and_then(|s| s.seed))
            .collect();
        assert_eq!(seeds, vec![Some(7), Some(8), Some(9)]);
        let unseeded = v1::TextGenerationParams::default();
        assert_eq!(nth(&unseeded, 2), unseeded);
    }

    #[test]
    fn a_prompt_counts_once_and_completions_add_up() {
        let one = |completion| v1::Usage {
            prompt_tokens: 10,
            completion_tokens: completion,
            ..Default::default()
        };
        let total = usage(&[one(3), one(4)]);
        assert_eq!((total.prompt_tokens, total.completion_tokens), (10, 7));
    }
}
