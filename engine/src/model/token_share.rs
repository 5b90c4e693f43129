//! Tensor-parallel attention when the ranks do not divide the KV heads:
//! each KV group that straddles two ranks is attended by both, each for its
//! share of the step's tokens, rather than by query heads.
//!
//! Splitting by query heads (5 and 4 of SmolLM2-135M's 9 heads over 2
//! ranks) reads and converts the straddling KV head's cache on both ranks
//! and leaves one rank a head more to attend, so the other waits at every
//! layer's all-reduce. Splitting the straddling group's tokens in the
//! balanced proportion gives every rank the same attention work (4.5
//! heads' worth each), at the cost of computing the group's k and v on both
//! (its cache must be whole on both, whichever rank attends a token) and
//! of sending the group's partial o-projection rows along with the usual
//! partial sums.
//!
//! Every token's output is the same sum in the same order whichever rank
//! attends it: the ranks' whole-group partial sums in rank order, then each
//! shared group's partial in group order. So a sequence's tokens do not
//! depend on which tokens share its step.

use std::ops::Range;

/// A KV group's part on one rank: the group and which of a step's tokens
/// the rank attends for it, `lo..hi` in units of `1 / span` of the tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPart {
    pub group: usize,
    pub lo: usize,
    pub hi: usize,
}

/// One rank's o-projection part: consecutive groups it attends for the
/// same tokens (its whole groups merged into one), with their share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OPart {
    pub groups: Range<usize>,
    pub lo: usize,
    pub hi: usize,
}

/// How the ranks share attention by tokens: see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenShare {
    pub rank: usize,
    /// Query heads per KV group.
    pub group_size: usize,
    /// A group's width in share units: `group_size * world`.
    pub span: usize,
    /// Every rank's o-projection parts, in group order.
    parts: Vec<Vec<OPart>>,
}

impl TokenShare {
    /// The sharing for `rank` of `world` over `heads` query heads in
    /// `kv_heads` groups; `None` when the ranks divide the groups (each
    /// group falls whole on one rank) or there are fewer groups than ranks.
    pub fn new(heads: usize, kv_heads: usize, world: usize, rank: usize) -> Option<Self> {
        if world < 2 || kv_heads < world || kv_heads.is_multiple_of(world) || rank >= world {
            return None;
        }
        if !heads.is_multiple_of(kv_heads) {
            return None;
        }
        let group_size = heads / kv_heads;
        let span = group_size * world;
        // In units of 1 / world head: rank r covers heads * r .. heads * (r + 1);
        // group g covers g * span .. (g + 1) * span.
        let parts = (0..world)
            .map(|r| {
                let (start, end) = (heads * r, heads * (r + 1));
                let groups = (0..kv_heads).filter_map(|g| {
                    let (g0, g1) = (g * span, (g + 1) * span);
                    let (lo, hi) = (start.max(g0), end.min(g1));
                    (lo < hi).then(|| GroupPart {
                        group: g,
                        lo: lo - g0,
                        hi: hi - g0,
                    })
                });
                merge_whole(groups, span)
            })
            .collect();
        Some(Self {
            rank,
            group_size,
            span,
            parts,
        })
    }

    /// This rank's groups, first to last.
    pub fn groups(&self) -> Range<usize> {
        let parts = &self.parts[self.rank];
        match (parts.first(), parts.last()) {
            (Some(first), Some(last)) => first.groups.start..last.groups.end,
            _ => 0..0,
        }
    }

    /// This rank's o-projection parts.
    pub fn parts(&self) -> &[OPart] {
        &self.parts[self.rank]
    }

    /// Tokens of a step of `n` that a part (or a group part) covers.
    pub fn tokens(&self, lo: usize, hi: usize, n: usize) -> Range<usize> {
        n * lo / self.span..n * hi / self.span
    }

    /// The tokens this rank attends for its `group`-th group (its own
    /// numbering), for a step of `n` tokens.
    pub fn group_tokens(&self, local_group: usize, n: usize) -> Range<usize> {
        let group = self.groups().start + local_group;
        self.parts()
            .iter()
            .find(|p| p.groups.contains(&group))
            .map_or(0..0, |p| self.tokens(p.lo, p.hi, n))
    }

    /// Floats rank `r` contributes for a step of `n` tokens of `hidden`:
    /// each of its parts' rows, in order.
    pub fn piece_len(&self, r: usize, n: usize, hidden: usize) -> usize {
        self.parts[r]
            .iter()
            .map(|p| self.tokens(p.lo, p.hi, n).len() * hidden)
            .sum()
    }

    /// `out[t] =` the whole parts' rows (rank order), then the shared
    /// groups' rows (group order, from the rank that attended token `t`),
    /// from the ranks' pieces laid end to end in `pieces`: the same
    /// additions in the same order for every token, on every rank.
    pub fn sum_pieces(&self, pieces: &[f32], n: usize, hidden: usize, out: &mut [f32]) {
        for (t, row) in out[..n * hidden].chunks_exact_mut(hidden).enumerate() {
            let mut first = true;
            // Ranks in order hold their parts in group order, so the shared
            // parts come in group order too.
            for want_whole in [true, false] {
                let mut at = 0;
                for p in self.parts.iter().flatten() {
                    let tokens = self.tokens(p.lo, p.hi, n);
                    let whole = p.lo == 0 && p.hi == self.span;
                    if whole == want_whole && tokens.contains(&t) {
                        let from = at + (t - tokens.start) * hidden;
                        let piece = &pieces[from..from + hidden];
                        if first {
                            row.copy_from_slice(piece);
                            first = false;
                        } else {
                            row.iter_mut().zip(piece).for_each(|(o, p)| *o += p);
                        }
                    }
                    at += tokens.len() * hidden;
                }
            }
        }
    }
}

/// Consecutive groups a rank attends wholly, as one part; each shared
/// group as its own.
fn merge_whole(groups: impl Iterator<Item = GroupPart>, span: usize) -> Vec<OPart> {
    let mut parts: Vec<OPart> = Vec::new();
    for g in groups {
        let whole = g.lo == 0 && g.hi == span;
        match parts.last_mut() {
            Some(last) if whole && last.lo == 0 && last.hi == span => last.groups.end = g.group + 1,
            _ => parts.push(OPart {
                groups: g.group..g.group + 1,
                lo: g.lo,
                hi: g.hi,
            }),
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(groups: Range<usize>, lo: usize, hi: usize) -> OPart {
        OPart { groups, lo, hi }
    }

    #[test]
    fn smollm2_on_two_ranks_halves_the_middle_group_by_tokens() {
        // 9 heads in 3 groups: rank 0 has group 0 and half of group 1's
        // tokens, rank 1 the other half and group 2.
        let a = TokenShare::new(9, 3, 2, 0).expect("shared");
        let b = TokenShare::new(9, 3, 2, 1).expect("shared");
        assert_eq!(a.parts(), [part(0..1, 0, 6), part(1..2, 0, 3)]);
        assert_eq!(b.parts(), [part(1..2, 3, 6), part(2..3, 0, 6)]);
        assert_eq!((a.groups(), b.groups()), (0..2, 1..3));
        assert_eq!((a.group_tokens(1, 8), b.group_tokens(0, 8)), (0..4, 4..8));
        assert_eq!((a.group_tokens(1, 1), b.group_tokens(0, 1)), (0..0, 0..1));
        assert_eq!((a.group_tokens(0, 8), b.group_tokens(1, 8)), (0..8, 0..8));
        assert_eq!((a.piece_len(0, 8, 10), a.piece_len(1, 8, 10)), (120, 120));
    }

    #[test]
    fn divided_groups_share_nothing() {
        assert!(TokenShare::new(9, 3, 3, 0).is_none());
        assert!(TokenShare::new(32, 8, 2, 1).is_none());
        assert!(
            TokenShare::new(8, 1, 2, 0).is_none(),
            "fewer groups than ranks"
        );
    }

    #[test]
    fn every_token_of_every_group_is_attended_exactly_once() {
        for (heads, kv, world) in [(9, 3, 2), (15, 5, 2), (12, 4, 3), (15, 5, 4), (14, 7, 3)] {
            let shares: Vec<_> = (0..world)
                .map(|r| TokenShare::new(heads, kv, world, r).expect("shared"))
                .collect();
            for n in [1, 2, 3, 7, 8, 64] {
                for g in 0..kv {
                    let mut seen = vec![0; n];
                    for s in &shares {
                        let groups = s.groups();
                        if groups.contains(&g) {
                            for t in s.group_tokens(g - groups.start, n) {
                                seen[t] += 1;
                            }
                        }
                    }
                    assert!(
                        seen.iter().all(|&c| c == 1),
                        "{heads}/{kv} on {world}: {seen:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn each_tokens_sum_is_the_same_whichever_rank_attended_it() {
        // Rank 0's whole part, rank 1's whole part, then the shared group
        // from whichever rank had the token: of 3 tokens, rank 0 attends
        // the shared group for token 0 (3 * 3 / 6 = 1), rank 1 for 1 and 2.
        let share = TokenShare::new(9, 3, 2, 0).expect("shared");
        let (n, h) = (3, 2);
        let row = |base: f32, t: usize| [base + t as f32, base + 10.0 * t as f32];
        let mut pieces = Vec::new();
        // Rank 0: group 0 for tokens 0..3, group 1 for token 0.
        (0..3).for_each(|t| pieces.extend(row(1.0, t)));
        pieces.extend(row(100.0, 0));
        // Rank 1: group 1 for tokens 1..3, group 2 for 0..3.
        (1..3).for_each(|t| pieces.extend(row(100.0, t)));
        (0..3).for_each(|t| pieces.extend(row(1000.0, t)));
        assert_eq!(
            pieces.len(),
            share.piece_len(0, n, h) + share.piece_len(1, n, h)
        );
        let mut out = vec![0.0; n * h];
        share.sum_pieces(&pieces, n, h, &mut out);
        for t in 0..n {
            let expected: Vec<f32> = (0..h)
                .map(|i| (row(1.0, t)[i] + row(1000.0, t)[i]) + row(100.0, t)[i])
                .collect();
            assert_eq!(&out[t * h..(t + 1) * h], &expected[..], "token {t}");
        }
    }
}
