//! One sequence's keys and values, for callers that run one sequence
//! at a time.

use crate::model::paged::{blocks_for, BlockId, KvPool};

/// One sequence's keys and values, for callers that run one sequence at a
/// time (tests, reference comparisons): a private [`KvPool`] whose blocks
/// are the sequence's table in order.
pub struct KvCache {
    pub(super) pool: KvPool,
    pub(super) table: Vec<BlockId>,
    pub(super) len: usize,
    /// Positions the first forward from empty appended: the prompt.
    pub(super) prompt: usize,
}

impl KvCache {
    /// A cache over `pool` (see [`super::Transformer::new_pool`]).
    pub fn with_pool(pool: KvPool) -> Self {
        Self {
            pool,
            table: Vec::new(),
            len: 0,
            prompt: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops everything (a new conversation).
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Keeps the first `len` positions (a shared prompt prefix). A hybrid
    /// model's recurrent state cannot be rewound: it keeps nothing then,
    /// and the prefix is computed again.
    pub fn truncate(&mut self, len: usize) {
        self.len = if len < self.len && self.pool.state_len() > 0 {
            0
        } else {
            len.min(self.len)
        };
    }

    /// Reserves room for `positions` in total, so decoding never reallocates.
    pub fn reserve(&mut self, positions: usize) {
        let blocks = blocks_for(positions);
        self.pool.ensure_blocks(blocks);
        while self.table.len() < blocks {
            self.table.push(self.table.len() as BlockId);
        }
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.pool.size_bytes()
    }
}
