//! What part of a model one rank owns, and how a model is split.
//!
//! Splits may be uneven: SmolLM2-135M has 3 KV heads, so two tensor ranks own
//! 2 and 1 KV-head groups; any world size up to the number of groups works.

use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error("layer range {start}..{end} is empty or outside the model's {n_layers} layers")]
    BadLayerRange { start: u32, end: u32, n_layers: u32 },
    #[error("rank {rank} is not below the world size {world_size}")]
    BadRank { rank: u32, world_size: u32 },
    #[error("cannot split {items} {what} over {parts} parts: every part needs at least one")]
    TooManyParts {
        items: u32,
        parts: usize,
        what: &'static str,
    },
    #[error("cannot split over zero parts")]
    NoParts,
}

/// The part of a model a rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardSpec {
    /// Layers `start_layer..end_layer` of `n_layers`: the rank with layer 0
    /// embeds, the rank with the last layer applies the final norm and head.
    Pipeline {
        start_layer: u32,
        end_layer: u32,
        n_layers: u32,
    },
    /// A slice of every layer: rank `rank` of `world_size`.
    Tensor { rank: u32, world_size: u32 },
}

impl ShardSpec {
    /// The whole model on one rank.
    pub fn whole(n_layers: u32) -> Self {
        Self::Pipeline {
            start_layer: 0,
            end_layer: n_layers,
            n_layers,
        }
    }

    /// Checks the spec against a model with `n_layers` layers.
    pub fn validate(&self, n_layers: u32) -> Result<(), ShardError> {
        match *self {
            Self::Pipeline {
                start_layer,
                end_layer,
                n_layers: spec_layers,
            } => {
                if start_layer >= end_layer || end_layer > n_layers || spec_layers != n_layers {
                    return Err(ShardError::BadLayerRange {
                        start: start_layer,
                        end: end_layer,
                        n_layers,
                    });
                }
            }
            Self::Tensor { rank, world_size } => {
                if rank >= world_size {
                    return Err(ShardError::BadRank { rank, world_size });
                }
            }
        }
        Ok(())
    }

    /// The layers this rank runs.
    pub fn layers(&self, n_layers: u32) -> Range<u32> {
        match *self {
            Self::Pipeline {
                start_layer,
                end_layer,
                ..
            } => start_layer..end_layer,
            Self::Tensor { .. } => 0..n_layers,
        }
    }

    /// Whether this rank owns the token embedding (runs first).
    pub fn embeds(&self) -> bool {
        match *self {
            Self::Pipeline { start_layer, .. } => start_layer == 0,
            Self::Tensor { .. } => true,
        }
    }

    /// Whether this rank owns the LM head: a pipeline's first stage, which
    /// also embeds (tied, they are one matrix) and samples; the last stage
    /// applies the final norm and sends it the rows that want logits.
    pub fn has_head(&self) -> bool {
        self.embeds()
    }

    /// For tensor parallelism: the KV-head groups this rank owns, out of
    /// `n_kv_heads` (each group brings its query heads along).
    pub fn kv_head_groups(&self, n_kv_heads: u32) -> Result<Range<u32>, ShardError> {
        match *self {
            Self::Pipeline { .. } => Ok(0..n_kv_heads),
            Self::Tensor { rank, world_size } => {
                let parts = split_evenly(n_kv_heads, world_size as usize, "KV heads")?;
                parts
                    .get(rank as usize)
                    .cloned()
                    .ok_or(ShardError::BadRank { rank, world_size })
            }
        }
    }
}

/// Splits `items` into `parts` contiguous ranges whose sizes differ by at most
/// one, larger ones first: 3 over 2 gives `[0..2, 2..3]`.
pub fn split_evenly(
    items: u32,
    parts: usize,
    what: &'static str,
) -> Result<Vec<Range<u32>>, ShardError> {
    if parts == 0 {
        return Err(ShardError::NoParts);
    }
    split_proportionally(items, &vec![1; parts], what)
}

/// Consecutive layer ranges for `world` pipeline stages that balance work
/// rather than layer counts: the first stage also runs the output head and
/// samples, worth `head_layers` layers, so it takes that many fewer (at
/// least one); the other stages split the rest evenly.
pub fn pipeline_stages(
    n_layers: u32,
    world: usize,
    head_layers: f64,
) -> Result<Vec<Range<u32>>, ShardError> {
    if world < 2 || !head_layers.is_finite() || head_layers <= 0.0 {
        return split_evenly(n_layers, world, "layers");
    }
    if (n_layers as usize) < world {
        return Err(ShardError::TooManyParts {
            items: n_layers,
            parts: world,
            what: "layers",
        });
    }
    let per_stage = (f64::from(n_layers) + head_layers) / world as f64;
    let most = n_layers - (world as u32 - 1);
    // Rounded and clamped in f64: `head_layers` may exceed the stage.
    let first = (per_stage - head_layers)
        .round()
        .clamp(1.0, f64::from(most)) as u32;
    let rest = split_evenly(n_layers - first, world - 1, "layers")?;
    Ok(std::iter::once(0..first)
        .chain(rest.into_iter().map(|r| r.start + first..r.end + first))
        .collect())
}

/// Splits `items` into contiguous ranges in proportion to `weights` (free
/// memory, for pipeline layers), each at least one item. Largest remainders
/// get the leftover items, ties to the earlier part, so the split is
/// deterministic.
pub fn split_proportionally(
    items: u32,
    weights: &[u64],
    what: &'static str,
) -> Result<Vec<Range<u32>>, ShardError> {
    let parts = weights.len();
    if parts == 0 {
        return Err(ShardError::NoParts);
    }
    if (items as usize) < parts {
        return Err(ShardError::TooManyParts { items, parts, what });
    }
    // Each part gets one item first; the rest is shared by weight.
    let spare = u128::from(items) - parts as u128;
    let total: u128 = weights.iter().map(|&w| u128::from(w.max(1))).sum();
    let mut sizes: Vec<u128> = Vec::with_capacity(parts);
    let mut remainders: Vec<(u128, usize)> = Vec::with_capacity(parts);
    for (i, &w) in weights.iter().enumerate() {
        let share = spare * u128::from(w.max(1));
        sizes.push(1 + share / total);
        remainders.push((share % total, i));
    }
    let assigned: u128 = sizes.iter().sum();
    let mut leftover = u128::from(items) - assigned;
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in &remainders {
        if leftover == 0 {
            break;
        }
        sizes[i] += 1;
        leftover -= 1;
    }
    let mut start = 0u32;
    Ok(sizes
        .into_iter()
        .map(|size| {
            // size <= items, which fits in u32.
            let end = start + size as u32;
            let range = start..end;
            start = end;
            range
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_stages_give_the_first_stage_fewer_layers_for_the_head() -> Result<(), ShardError> {
        // SmolLM2-135M: 30 layers, the head and sampling worth 8.
        assert_eq!(pipeline_stages(30, 2, 8.0)?, vec![0..11, 11..30]);
        assert_eq!(pipeline_stages(30, 3, 8.0)?, vec![0..5, 5..18, 18..30]);
        assert_eq!(pipeline_stages(30, 2, 4.0)?, vec![0..13, 13..30]);
        // A head worth more than a stage still leaves the first one a layer.
        assert_eq!(pipeline_stages(4, 2, 50.0)?, vec![0..1, 1..4]);
        // No head to weigh, or one stage: as even as possible.
        assert_eq!(pipeline_stages(30, 2, 0.0)?, vec![0..15, 15..30]);
        assert_eq!(pipeline_stages(30, 1, 4.0)?, vec![0..30]);
        assert!(pipeline_stages(2, 3, 1.0).is_err());
        for world in 2..=8 {
            let stages = pipeline_stages(61, world, 2.7)?;
            assert_eq!(stages.len(), world);
            assert_eq!(stages[0].start, 0);
            assert_eq!(stages[world - 1].end, 61);
            assert!(stages.windows(2).all(|w| w[0].end == w[1].start));
            assert!(stages.iter().all(|s| !s.is_empty()));
        }
        Ok(())
    }

    #[test]
    fn kv_groups_split_unevenly_for_any_world_up_to_the_group_count() -> Result<(), ShardError> {
        let groups = |world: u32| -> Result<Vec<Range<u32>>, ShardError> {
            (0..world)
                .map(|rank| {
                    ShardSpec::Tensor {
                        rank,
                        world_size: world,
                    }
                    .kv_head_groups(3)
                })
                .collect()
        };
        assert_eq!(groups(1)?, vec![0..3]);
        assert_eq!(groups(2)?, vec![0..2, 2..3]);
        assert_eq!(groups(3)?, vec![0..1, 1..2, 2..3]);
        assert_eq!(
            ShardSpec::Tensor {
                rank: 0,
                world_size: 4
            }
            .kv_head_groups(3),
            Err(ShardError::TooManyParts {
                items: 3,
                parts: 4,
                what: "KV heads"
            })
        );
        Ok(())
    }

    #[test]
    fn pipeline_layers_follow_memory_and_cover_the_model() -> Result<(), ShardError> {
        assert_eq!(
            split_proportionally(30, &[8, 8], "layers")?,
            vec![0..15, 15..30]
        );
        assert_eq!(
            split_proportionally(30, &[16, 8], "layers")?,
            vec![0..20, 20..30]
        );
        assert_eq!(
            split_proportionally(30, &[1, 1, 1, 1], "layers")?,
            vec![0..8, 8..16, 16..23, 23..30]
        );
        // A node with almost no memory still gets one layer.
        assert_eq!(
            split_proportionally(4, &[u64::MAX, 0], "layers")?,
            vec![0..3, 3..4]
        );
        assert!(split_proportionally(2, &[1, 1, 1], "layers").is_err());
        assert_eq!(
            split_proportionally(5, &[], "layers"),
            Err(ShardError::NoParts)
        );
        Ok(())
    }

    #[test]
    fn the_first_stage_owns_the_embedding_and_the_head() {
        let first = ShardSpec::Pipeline {
            start_layer: 0,
            end_layer: 10,
            n_layers: 30,
        };
        let last = ShardSpec::Pipeline {
            start_layer: 10,
            end_layer: 30,
            n_layers: 30,
        };
        assert!(first.embeds() && first.has_head());
        assert!(!last.embeds() && !last.has_head());
        assert_eq!(last.layers(30), 10..30);
        assert!(ShardSpec::whole(30).embeds() && ShardSpec::whole(30).has_head());
        assert!(last.validate(30).is_ok());
        assert!(last.validate(20).is_err());
        assert!(ShardSpec::Pipeline {
            start_layer: 5,
            end_layer: 5,
            n_layers: 30
        }
        .validate(30)
        .is_err());
        assert!(ShardSpec::Tensor {
            rank: 2,
            world_size: 2
        }
        .validate(30)
        .is_err());
    }
}
