//! How tensor parallelism splits a model: each rank's rows of every
//! matrix, and which query heads read which KV heads.

use std::ops::Range;

use crate::dist::shard::{split_evenly, ShardError, ShardSpec};
use crate::model::config::ModelConfig;
use crate::model::deltanet::LinearSplit;
use crate::model::gather::ColumnSplit;

/// Every rank's columns of the rows the ranks gather whole (see
/// [`crate::model::gather`]): the attention's output (query heads), the MLP's
/// intermediate rows, the hidden rows each rank computes of the output
/// projections; and q and k where they are normed across all heads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub attention: ColumnSplit,
    pub ffn: ColumnSplit,
    pub hidden: ColumnSplit,
    pub experts: ColumnSplit,
    pub shared_expert: ColumnSplit,
    /// Each rank's value heads of the linear-attention layers (in the
    /// file's order of value heads, one value head wide each).
    pub linear_values: ColumnSplit,
    /// q and k normed across all heads (OLMo 2): every rank's KV heads,
    /// whole groups (no KV head on two ranks).
    pub keys: Option<ColumnSplit>,
}

impl TensorLayout {
    /// The layout of `world` ranks, each rank's [`TensorSplit`] put
    /// together.
    pub fn new(
        config: &ModelConfig,
        world: u32,
        ffn_unit: usize,
        expert_unit: usize,
    ) -> Result<Self, ShardError> {
        let splits = (0..world)
            .map(|rank| TensorSplit::new(config, rank, world, ffn_unit, expert_unit))
            .collect::<Result<Vec<_>, _>>()?;
        let of = |part: fn(&TensorSplit) -> Range<usize>| {
            let parts: Vec<Range<usize>> = splits.iter().map(part).collect();
            ColumnSplit::contiguous(&parts, 1)
        };
        let linear_values = match &config.variant.linear {
            Some(linear) => ColumnSplit::from_runs(
                splits
                    .iter()
                    .map(|s| {
                        LinearSplit::for_key_heads(linear, s.linear_keys.clone())
                            .runs()
                            .into_iter()
                            .map(|r| r.start * linear.value_dim..r.end * linear.value_dim)
                            .collect()
                    })
                    .collect(),
            ),
            None => of(|_| 0..0),
        };
        Ok(Self {
            attention: of(|s| s.q_rows.clone()),
            ffn: of(|s| s.ffn_rows.clone()),
            hidden: of(|s| s.hidden_rows.clone()),
            experts: of(|s| s.expert_rows.clone()),
            shared_expert: of(|s| s.shared_rows.clone()),
            linear_values,
            keys: (config.variant.qk_norm_whole && config.qk_norm)
                .then(|| of(|s| s.kv_rows.clone())),
        })
    }
}

/// The rows a tensor-parallel rank owns of each split dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSplit {
    pub q_rows: Range<usize>,
    pub kv_rows: Range<usize>,
    pub ffn_rows: Range<usize>,
    /// Rows of every expert (mixture-of-experts models; else empty).
    pub expert_rows: Range<usize>,
    /// Rows of the shared expert (else empty).
    pub shared_rows: Range<usize>,
    /// Key heads of the linear-attention layers, each with its value heads
    /// (hybrid models; else empty).
    pub linear_keys: Range<usize>,
    pub vocab_rows: Range<usize>,
    pub vocab_counts: Vec<usize>,
    /// Rows of the output projections (attention's, the MLP's down, the
    /// experts' downs) this rank computes, over whole input rows.
    pub hidden_rows: Range<usize>,
}

/// This rank's intermediate rows of an MLP of `ffn` rows: in units of
/// `unit` (the down projection's quantization block, so that its column
/// slices keep their blocks) where there are enough of them, else of the
/// 32-value block, else single rows.
fn ffn_share(ffn: usize, unit: usize, rank: u32, world: u32) -> Result<Range<usize>, ShardError> {
    let unit = if unit > 1 && ffn.is_multiple_of(unit) && ffn / unit >= world as usize {
        unit
    } else if ffn.is_multiple_of(crate::quant::BLOCK) {
        crate::quant::BLOCK
    } else {
        1
    };
    // Even, not balancing the attention's uneven KV groups: each block
    // ends in gathers, a barrier, so the MLP's own split must be
    // even for its phase to be (balancing the totals made each rank wait
    // for the other in turn).
    let parts = split_evenly((ffn / unit) as u32, world as usize, "FFN blocks")?;
    let part = &parts[rank as usize];
    Ok(part.start as usize * unit..part.end as usize * unit)
}

impl TensorSplit {
    /// Attention by query heads, as evenly as they go, each rank with the
    /// KV heads its query heads read (see [`attention_share`]); the MLP
    /// (and every expert) by intermediate rows (see [`ffn_share`]), the
    /// head by vocabulary rows. Uneven splits are allowed.
    pub fn new(
        config: &ModelConfig,
        rank: u32,
        world: u32,
        ffn_unit: usize,
        expert_unit: usize,
    ) -> Result<Self, ShardError> {
        let spec = ShardSpec::Tensor {
            rank,
            world_size: world,
        };
        let (q_heads, kv_heads) = attention_share(config, &spec, rank, world)?;
        let hd = config.head_dim;
        let expert_rows = match &config.moe {
            Some(moe) => ffn_share(moe.expert_ffn, expert_unit, rank, world)?,
            None => 0..0,
        };
        let shared_rows = match config.moe.as_ref().and_then(|m| m.shared_ffn) {
            Some(rows) => ffn_share(rows, expert_unit, rank, world)?,
            None => 0..0,
        };
        let linear_keys = match &config.variant.linear {
            Some(linear) => {
                let parts = split_evenly(
                    linear.key_heads as u32,
                    world as usize,
                    "linear-attention key heads",
                )?;
                let part = &parts[rank as usize];
                part.start as usize..part.end as usize
            }
            None => 0..0,
        };
        let vocab_parts = split_evenly(config.vocab as u32, world as usize, "vocabulary rows")?;
        let vocab = &vocab_parts[rank as usize];
        let hidden_parts = split_evenly(config.hidden as u32, world as usize, "hidden rows")?;
        let hidden = &hidden_parts[rank as usize];
        Ok(Self {
            q_rows: q_heads.start * hd..q_heads.end * hd,
            kv_rows: kv_heads.start * hd..kv_heads.end * hd,
            // No dense layers at all (every layer runs experts): nothing to split.
            ffn_rows: match config.ffn {
                0 => 0..0,
                ffn => ffn_share(ffn, ffn_unit, rank, world)?,
            },
            expert_rows,
            shared_rows,
            linear_keys,
            vocab_rows: vocab.start as usize..vocab.end as usize,
            vocab_counts: vocab_parts.iter().map(|r| r.len()).collect(),
            hidden_rows: hidden.start as usize..hidden.end as usize,
        })
    }
}

/// A tensor rank's query heads and KV heads. Whole KV-head groups when
/// the ranks divide them evenly (or the q and k norms span all heads,
/// whose sums must count each KV head once); else query heads as evenly
/// as they go, a KV head whose group straddles two ranks computed and
/// cached on both. Attention is then balanced: with 3 KV heads of 3 query
/// heads on 2 ranks, 5 and 4 query heads rather than 6 and 3 (the whole
/// groups' split made one rank's attention twice the other's, and the
/// other wait at every layer's gathers).
fn attention_share(
    config: &ModelConfig,
    spec: &ShardSpec,
    rank: u32,
    world: u32,
) -> Result<(Range<usize>, Range<usize>), ShardError> {
    // Also the check that there are enough KV heads for the world.
    let groups = spec.kv_head_groups(config.kv_heads as u32)?;
    let per_group = config.heads / config.kv_heads;
    let (g0, g1) = (groups.start as usize, groups.end as usize);
    if config.kv_heads.is_multiple_of(world as usize) || config.variant.qk_norm_whole {
        return Ok((g0 * per_group..g1 * per_group, g0..g1));
    }
    let parts = split_evenly(config.heads as u32, world as usize, "query heads")?;
    let part = &parts[rank as usize];
    let q = part.start as usize..part.end as usize;
    let kv = q.start / per_group..q.end.div_ceil(per_group);
    Ok((q, kv))
}

/// Which query heads a shard has, and so which of its KV heads each one
/// reads: query head `q_first + h` (global numbering) reads global KV head
/// `(q_first + h) / group`, the shard's `- kv_first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::model) struct HeadLayout {
    pub group: usize,
    pub q_first: usize,
    pub kv_first: usize,
}

impl HeadLayout {
    /// The shard's query heads (its own numbering) that read its KV head
    /// `kv`.
    pub fn heads_of(&self, kv: usize, heads: usize) -> Range<usize> {
        let global = (self.kv_first + kv) * self.group..(self.kv_first + kv + 1) * self.group;
        let start = global.start.max(self.q_first).min(self.q_first + heads);
        let end = global.end.clamp(start, self.q_first + heads);
        start - self.q_first..end - self.q_first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Architecture, RopeScaling};
    use crate::ops::RopeStyle;

    fn smollm2() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            layers: 30,
            hidden: 576,
            ffn: 1536,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            context_length: 8192,
            norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_style: RopeStyle::Interleaved,
            rope_scaling: RopeScaling::None,
            rotary_dims: 64,
            qkv_bias: false,
            qk_norm: false,
            tied_embeddings: true,
            sliding_window: None,
            moe: None,
            variant: Default::default(),
        }
    }

    #[test]
    fn a_shared_kv_head_serves_only_the_shards_own_query_heads() {
        // Global heads 5..9 of groups of 3: KV heads 1 and 2.
        let layout = HeadLayout {
            group: 3,
            q_first: 5,
            kv_first: 1,
        };
        assert_eq!(layout.heads_of(0, 4), 0..1);
        assert_eq!(layout.heads_of(1, 4), 1..4);
        let whole = HeadLayout {
            group: 3,
            q_first: 0,
            kv_first: 0,
        };
        assert_eq!(whole.heads_of(2, 9), 6..9);
    }

    #[test]
    fn tensor_splits_cover_every_dimension() -> Result<(), ShardError> {
        let config = smollm2();
        for world in 1..=3u32 {
            let splits: Vec<TensorSplit> = (0..world)
                .map(|rank| TensorSplit::new(&config, rank, world, 32, 32))
                .collect::<Result<_, _>>()?;
            let mut next = (0, 0, 0);
            for split in &splits {
                // Contiguous, in rank order, whole heads, whole blocks.
                assert_eq!(split.q_rows.start, next.0);
                assert_eq!(split.ffn_rows.start, next.1);
                assert_eq!(split.vocab_rows.start, next.2);
                assert_eq!(split.q_rows.len() % 64, 0, "whole heads");
                assert_eq!(split.ffn_rows.len() % 32, 0, "whole Q4_1 blocks");
                // Exactly the KV heads its query heads read (3 per group).
                let (q0, q1) = (split.q_rows.start / 64, split.q_rows.end / 64);
                assert_eq!(split.kv_rows, q0 / 3 * 64..q1.div_ceil(3) * 64);
                next = (split.q_rows.end, split.ffn_rows.end, split.vocab_rows.end);
            }
            assert_eq!(next, (576, 1536, 49152), "world {world} covers all");
        }
        // World 2: 5 and 4 query heads, the middle KV head on both; the MLP
        // splits evenly (its phase ends in gathers, so it is balanced
        // on its own).
        let (a, b) = (
            TensorSplit::new(&config, 0, 2, 32, 32)?,
            TensorSplit::new(&config, 1, 2, 32, 32)?,
        );
        assert_eq!((a.q_rows.len(), b.q_rows.len()), (320, 256));
        assert_eq!((a.kv_rows.clone(), b.kv_rows.clone()), (0..128, 64..192));
        assert_eq!((a.ffn_rows.len(), b.ffn_rows.len()), (768, 768));
        // World 3 divides the KV heads: whole groups, nothing shared.
        let c = TensorSplit::new(&config, 1, 3, 32, 32)?;
        assert_eq!((c.q_rows, c.kv_rows), (192..384, 64..128));
        // Norms over all heads at once keep whole groups (their sums
        // would count a shared KV head twice).
        let mut whole = config.clone();
        whole.variant.qk_norm_whole = true;
        let d = TensorSplit::new(&whole, 0, 2, 32, 32)?;
        assert_eq!((d.q_rows, d.kv_rows), (0..384, 0..128));
        assert!(TensorSplit::new(&config, 0, 4, 32, 32).is_err());
        Ok(())
    }
}
