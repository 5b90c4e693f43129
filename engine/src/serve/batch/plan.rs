//! Which tokens of which sequences go into the next step: a pure function
//! of where each sequence stands, tested without a model.

/// Where a running sequence stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqState {
    /// Positions with keys and values.
    pub computed: usize,
    /// Its tokens so far (prompt and generated).
    pub tokens: usize,
    /// Its prompt's length.
    pub prompt: usize,
    /// The most prompt tokens it takes in one step.
    pub chunk: usize,
    /// Draft tokens it would check after its next token (speculative
    /// decoding); they count against the step's budget like any token.
    pub draft: usize,
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// The sequence's index in the running list.
    pub index: usize,
    /// Tokens it runs, from its first uncomputed one (a decoding
    /// sequence's next token, then as many of its drafts as fit).
    pub len: usize,
    /// Rows of logits wanted: one when the step ends its prompt, one per
    /// token of a decode step (each checks the draft before it), else 0.
    pub logits: usize,
}

/// Plans a step of at most `budget` tokens: every decoding sequence's next
/// token first (decoding never waits on a prompt), then the drafts of
/// speculating sequences, then prompt chunks in arrival order (the running
/// list's order), each at most its `chunk`, so a long prompt is spread
/// over steps and the others keep decoding.
pub fn plan_step(sequences: &[SeqState], budget: usize, out: &mut Vec<Planned>) {
    out.clear();
    let mut left = budget.max(1);
    for (index, seq) in sequences.iter().enumerate() {
        if seq.computed >= seq.prompt && seq.computed < seq.tokens && left > 0 {
            out.push(Planned {
                index,
                len: 1,
                logits: 1,
            });
            left -= 1;
        }
    }
    for planned in out.iter_mut() {
        let extra = sequences[planned.index].draft.min(left);
        planned.len += extra;
        planned.logits += extra;
        left -= extra;
    }
    for (index, seq) in sequences.iter().enumerate() {
        if left == 0 {
            break;
        }
        if seq.computed < seq.prompt {
            let len = (seq.prompt - seq.computed).min(seq.chunk.max(1)).min(left);
            out.push(Planned {
                index,
                len,
                logits: usize::from(seq.computed + len == seq.prompt),
            });
            left -= len;
        }
    }
    // Span order follows the running list: the step's layout is then the
    // same whatever mix of phases it has.
    out.sort_unstable_by_key(|p| p.index);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoding(tokens: usize) -> SeqState {
        SeqState {
            computed: tokens - 1,
            tokens,
            prompt: 10,
            chunk: 512,
            draft: 0,
        }
    }

    fn prefilling(prompt: usize, computed: usize) -> SeqState {
        SeqState {
            computed,
            tokens: prompt,
            prompt,
            chunk: 512,
            draft: 0,
        }
    }

    #[test]
    fn decoding_sequences_go_first_and_prompts_share_what_is_left() {
        let seqs = [
            prefilling(300, 0),
            decoding(20),
            decoding(30),
            prefilling(50, 0),
        ];
        let mut out = Vec::new();
        plan_step(&seqs, 128, &mut out);
        assert_eq!(
            out,
            vec![
                Planned {
                    index: 0,
                    len: 126,
                    logits: 0
                },
                Planned {
                    index: 1,
                    len: 1,
                    logits: 1
                },
                Planned {
                    index: 2,
                    len: 1,
                    logits: 1
                },
            ]
        );
        // The long prompt's last chunk, then the next prompt in the same step.
        let seqs = [prefilling(300, 290), decoding(20), prefilling(50, 0)];
        plan_step(&seqs, 128, &mut out);
        assert_eq!(
            out,
            vec![
                Planned {
                    index: 0,
                    len: 10,
                    logits: 1
                },
                Planned {
                    index: 1,
                    len: 1,
                    logits: 1
                },
                Planned {
                    index: 2,
                    len: 50,
                    logits: 1
                },
            ]
        );
    }

    #[test]
    fn a_prompt_takes_at_most_its_chunk_and_a_tiny_budget_still_moves() {
        let mut seq = prefilling(100, 0);
        seq.chunk = 16;
        let mut out = Vec::new();
        plan_step(&[seq], 128, &mut out);
        assert_eq!(out[0].len, 16);
        plan_step(&[decoding(5), decoding(6)], 0, &mut out);
        assert_eq!(out.len(), 1, "a budget of 0 is taken as 1");
    }

    #[test]
    fn drafts_come_after_every_next_token_and_before_prompts() {
        let mut speculating = decoding(20);
        speculating.draft = 4;
        let seqs = [prefilling(100, 0), speculating, decoding(12)];
        let mut out = Vec::new();
        plan_step(&seqs, 16, &mut out);
        let planned = |index, len, logits| Planned { index, len, logits };
        assert_eq!(
            out,
            vec![planned(0, 10, 0), planned(1, 5, 5), planned(2, 1, 1)]
        );
        // A tight budget cuts the draft, never another sequence's token.
        plan_step(&seqs, 4, &mut out);
        assert_eq!(out, vec![planned(1, 3, 3), planned(2, 1, 1)]);
    }

    #[test]
    fn a_finished_prompt_with_no_new_token_is_not_planned() {
        // Computed everything it has: it waits for its sampled token.
        let seq = SeqState {
            computed: 10,
            tokens: 10,
            prompt: 10,
            chunk: 512,
            draft: 0,
        };
        let mut out = Vec::new();
        plan_step(&[seq], 128, &mut out);
        assert!(out.is_empty());
    }
}
