//! The paged KV cache: one pool of fixed-size blocks per shard, shared by
//! every sequence of an instance, and the bookkeeping that hands them out
//! (as vLLM's block manager does).
//!
//! - [`KvPool`] holds the keys and values, in f16: block `b` holds
//!   positions `b * BLOCK_TOKENS ..` of whichever sequence owns it, in every
//!   layer of the shard. A sequence is a block table, `positions / 16`
//!   block ids; its attention reads its own blocks only.
//! - [`BlockManager`] decides which blocks a sequence gets. It is plain data
//!   (no keys or values), so rank 0 decides for every rank of an instance.
//!   **Prefix sharing**: a full block is known by a hash of its parent's hash
//!   and its tokens, so a later request with the same prefix (a system
//!   prompt, a multi-turn chat sent again) takes the computed blocks instead
//!   of recomputing them. Blocks are reference-counted; a cached block no
//!   sequence holds stays until the pool needs it, least recently used
//!   first.
//!
//! A block's keys and values depend only on the tokens up to its end (the
//! forward pass is batch invariant), so a shared block is bit-identical to
//! one computed cold.

use std::collections::{BTreeMap, HashMap};

use half::f16;

/// Positions per block.
pub const BLOCK_TOKENS: usize = 16;

/// A block's index in the pool.
pub type BlockId = u32;

/// Blocks needed for `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK_TOKENS)
}

/// Keys and values of a shard's layers, block by block; and, for hybrid
/// models, each sequence's recurrent state in a slot of its own.
pub struct KvPool {
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
    kv_dim: usize,
    blocks: usize,
    /// `state_len` floats per slot, slot after slot.
    states: Vec<f32>,
    state_len: usize,
    /// Set for a shard on a GPU: the keys and values are there, and the
    /// host holds none.
    gpu: Option<crate::gpu::GpuKv>,
}

/// The most recurrent-state slots a pool holds: far more sequences than an
/// instance runs at once, and a bound on what a peer's step can make a rank
/// allocate.
pub const MAX_STATE_SLOTS: usize = 1024;

impl KvPool {
    /// An empty pool for `layers` layers of `kv_dim` keys (and values) per
    /// position; it grows with [`KvPool::ensure_blocks`].
    pub fn new(layers: usize, kv_dim: usize) -> Self {
        Self {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            kv_dim,
            blocks: 0,
            states: Vec::new(),
            state_len: 0,
            gpu: None,
        }
    }

    /// The same pool with its keys and values on a GPU.
    pub fn on_gpu(mut self, kv: crate::gpu::GpuKv) -> Self {
        self.gpu = Some(kv);
        self
    }

    /// The keys and values on the GPU, for a pool there.
    pub fn gpu_mut(&mut self) -> Option<&mut crate::gpu::GpuKv> {
        self.gpu.as_mut()
    }

    /// The same pool with `state_len` floats of recurrent state per
    /// sequence (the shard's linear-attention layers).
    pub fn with_state(mut self, state_len: usize) -> Self {
        self.state_len = state_len;
        self
    }

    /// Floats of recurrent state per sequence (0: the model has none).
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// Grows the state slots to hold slot `slot` (never shrinks).
    pub fn ensure_state_slot(&mut self, slot: usize) -> Result<(), &'static str> {
        if slot >= MAX_STATE_SLOTS {
            return Err("beyond the most slots a pool holds");
        }
        let len = (slot + 1) * self.state_len;
        if self.states.len() < len {
            self.states.resize(len, 0.0);
        }
        Ok(())
    }

    /// `len` floats at `offset` of slot `slot`'s state.
    pub fn state_mut(&mut self, slot: usize, offset: usize, len: usize) -> Option<&mut [f32]> {
        if offset + len > self.state_len {
            return None;
        }
        let start = slot.checked_mul(self.state_len)? + offset;
        self.states.get_mut(start..start + len)
    }

    /// [`KvPool::state_mut`] of several distinct slots at once; `None` if a
    /// slot is missing or named twice.
    pub fn states_of(
        &mut self,
        slots: impl Iterator<Item = usize>,
        offset: usize,
        len: usize,
    ) -> Option<Vec<&mut [f32]>> {
        if offset + len > self.state_len || self.state_len == 0 {
            return None;
        }
        let mut all: Vec<Option<&mut [f32]>> = self
            .states
            .chunks_exact_mut(self.state_len)
            .map(Some)
            .collect();
        slots
            .map(|slot| {
                all.get_mut(slot)
                    .and_then(Option::take)
                    .map(|state| &mut state[offset..offset + len])
            })
            .collect()
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Grows the pool to at least `blocks` blocks (never shrinks), so that
    /// the steps after warming up allocate nothing.
    pub fn ensure_blocks(&mut self, blocks: usize) {
        if blocks <= self.blocks {
            return;
        }
        if self.gpu.is_some() {
            // The GPU's buffers grow at the next step, which can fail.
            self.blocks = blocks;
            return;
        }
        let len = blocks * BLOCK_TOKENS * self.kv_dim;
        for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
            cache.resize(len, f16::ZERO);
        }
        self.blocks = blocks;
    }

    /// Bytes one position takes across the shard's layers.
    pub fn bytes_per_position(layers: usize, kv_dim: usize) -> usize {
        layers * kv_dim * 2 * std::mem::size_of::<f16>()
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|c| c.len() * 2)
            .sum::<usize>()
            + self.states.len() * 4
            + self.gpu.as_ref().map_or(0, |g| g.size_bytes() as usize)
    }

    /// Where position `position` of a sequence with `table` starts in a
    /// layer's keys or values.
    #[inline]
    pub fn offset(&self, table: &[BlockId], position: usize) -> usize {
        let block = table[position / BLOCK_TOKENS] as usize;
        (block * BLOCK_TOKENS + position % BLOCK_TOKENS) * self.kv_dim
    }

    /// Layer `layer`'s keys and values, for writing one step's positions.
    pub fn layer_mut(&mut self, layer: usize) -> (&mut [f16], &mut [f16]) {
        (&mut self.keys[layer], &mut self.values[layer])
    }

    /// Layer `layer`'s keys and values.
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.keys[layer], &self.values[layer])
    }
}

/// A prefix block's identity: the hash of its parent's and its tokens.
pub type BlockHash = [u8; 32];

/// The hash of a full block that follows a block hashed `parent`.
fn block_hash(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut hasher = blake3::Hasher::new();
    hasher.update(parent.map_or(&[0u8; 32][..], |p| &p[..]));
    for token in tokens {
        hasher.update(&token.to_le_bytes());
    }
    *hasher.finalize().as_bytes()
}

/// Why a sequence cannot have the blocks it asks for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not now: other sequences hold the blocks; it can wait.
    #[error("the KV cache has {available} free blocks, the sequence needs {needed}")]
    Busy { needed: usize, available: usize },
    /// Never: the whole pool is smaller than the sequence.
    #[error("{positions} positions need {needed} KV blocks of {BLOCK_TOKENS}, but the pool holds {capacity} ({capacity_positions} positions)")]
    TooLarge {
        positions: usize,
        needed: usize,
        capacity: usize,
        capacity_positions: usize,
    },
}

/// A sequence's blocks, as [`BlockManager::admit`] gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// Block ids in position order, room for every position reserved.
    pub table: Vec<BlockId>,
    /// Leading positions whose keys and values are already computed (whole
    /// shared blocks).
    pub cached_positions: usize,
    /// Hashes of the shared blocks, the start of the sequence's chain.
    pub chain: Vec<BlockHash>,
}

#[derive(Debug, Default, Clone)]
struct BlockInfo {
    refs: u32,
    /// Set while the block is in the prefix cache.
    hash: Option<BlockHash>,
    /// Its place in the eviction order while nothing holds it.
    idle_since: Option<u64>,
}

/// Which blocks are free, held or cached; see the module docs.
#[derive(Debug)]
pub struct BlockManager {
    info: Vec<BlockInfo>,
    /// Blocks that hold nothing worth keeping.
    free: Vec<BlockId>,
    /// Cached blocks nothing holds, by when they were last released.
    idle: BTreeMap<u64, BlockId>,
    by_hash: HashMap<BlockHash, BlockId>,
    clock: u64,
}

impl BlockManager {
    pub fn new(blocks: usize) -> Self {
        Self {
            info: vec![BlockInfo::default(); blocks],
            // Popped from the end: block 0 first.
            free: (0..blocks as BlockId).rev().collect(),
            idle: BTreeMap::new(),
            by_hash: HashMap::new(),
            clock: 0,
        }
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.info.len()
    }

    /// Blocks a new sequence could take now (free, or cached and idle).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks in the prefix cache (held or idle).
    pub fn cached(&self) -> usize {
        self.by_hash.len()
    }

    /// The cached full blocks that start `tokens`, at most `limit` tokens'
    /// worth, with their hashes.
    fn longest_prefix(&self, tokens: &[u32], limit: usize) -> Vec<(BlockId, BlockHash)> {
        let mut found = Vec::new();
        let mut parent: Option<BlockHash> = None;
        for block in tokens[..limit.min(tokens.len())].chunks_exact(BLOCK_TOKENS) {
            let hash = block_hash(parent.as_ref(), block);
            let Some(&id) = self.by_hash.get(&hash) else {
                break;
            };
            found.push((id, hash));
            parent = Some(hash);
        }
        found
    }

    /// Gives a sequence of `tokens` (its prompt) room for `positions`
    /// positions in all: the cached blocks that start it, shared, and fresh
    /// blocks for the rest. `reuse_limit` caps the shared positions (the last
    /// prompt token is always computed, for its logits). All or nothing.
    pub fn admit(
        &mut self,
        tokens: &[u32],
        positions: usize,
        reuse_limit: usize,
    ) -> Result<Admitted, PoolError> {
        let needed_total = blocks_for(positions);
        if needed_total > self.capacity() {
            return Err(PoolError::TooLarge {
                positions,
                needed: needed_total,
                capacity: self.capacity(),
                capacity_positions: self.capacity() * BLOCK_TOKENS,
            });
        }
        let shared = self.longest_prefix(tokens, reuse_limit.min(positions));
        let idle_shared = shared
            .iter()
            .filter(|(id, _)| self.info[*id as usize].refs == 0)
            .count();
        let fresh = needed_total - shared.len();
        let available = self.available() - idle_shared;
        if fresh > available {
            return Err(PoolError::Busy {
                needed: fresh,
                available,
            });
        }
        let mut table = Vec::with_capacity(needed_total);
        let mut chain = Vec::with_capacity(shared.len());
        for (id, hash) in shared {
            self.hold(id);
            table.push(id);
            chain.push(hash);
        }
        for _ in 0..fresh {
            // Checked above: there is a free or idle block.
            if let Some(id) = self.take_fresh() {
                self.hold(id);
                table.push(id);
            }
        }
        Ok(Admitted {
            cached_positions: chain.len() * BLOCK_TOKENS,
            table,
            chain,
        })
    }

    fn hold(&mut self, id: BlockId) {
        let info = &mut self.info[id as usize];
        if let Some(since) = info.idle_since.take() {
            self.idle.remove(&since);
        }
        info.refs += 1;
    }

    /// A free block, or the least recently used idle one (leaving the cache).
    fn take_fresh(&mut self) -> Option<BlockId> {
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        let (_, id) = self.idle.pop_first()?;
        let info = &mut self.info[id as usize];
        info.idle_since = None;
        if let Some(hash) = info.hash.take() {
            self.by_hash.remove(&hash);
        }
        Some(id)
    }

    /// Puts the sequence's full blocks whose positions are all computed into
    /// the prefix cache: `tokens` are the tokens at positions `0..` that
    /// have keys and values, `chain` the hashes registered so far (extended
    /// here). A block whose content is already cached under another id
    /// stays private to the sequence.
    pub fn register(&mut self, table: &[BlockId], tokens: &[u32], chain: &mut Vec<BlockHash>) {
        let full = tokens.len() / BLOCK_TOKENS;
        while chain.len() < full.min(table.len()) {
            let index = chain.len();
            let block = &tokens[index * BLOCK_TOKENS..(index + 1) * BLOCK_TOKENS];
            let hash = block_hash(chain.last(), block);
            let id = table[index];
            if !self.by_hash.contains_key(&hash) && self.info[id as usize].hash.is_none() {
                self.by_hash.insert(hash, id);
                self.info[id as usize].hash = Some(hash);
            }
            chain.push(hash);
        }
    }

    /// Gives a sequence's blocks back. Cached ones stay until needed, the
    /// deepest first (a prefix outlives what follows it).
    pub fn release(&mut self, table: &[BlockId]) {
        for &id in table.iter().rev() {
            let info = &mut self.info[id as usize];
            info.refs = info.refs.saturating_sub(1);
            if info.refs > 0 {
                continue;
            }
            if info.hash.is_some() {
                self.clock += 1;
                info.idle_since = Some(self.clock);
                self.idle.insert(self.clock, id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// References held on `id` (tests and diagnostics).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.info.get(id as usize).map_or(0, |i| i.refs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32).map(|i| i * 7 + seed).collect()
    }

    #[test]
    fn a_second_sequence_with_the_same_prefix_shares_its_full_blocks() {
        let mut blocks = BlockManager::new(64);
        let system = prompt(40, 1);
        let first = blocks.admit(&system, 60, 39).unwrap();
        assert_eq!(first.cached_positions, 0);
        assert_eq!(first.table.len(), 4);
        let mut chain = first.chain.clone();
        blocks.register(&first.table, &system, &mut chain);
        assert_eq!(chain.len(), 2, "two full blocks of 16 in 40 tokens");

        let mut longer = system.clone();
        longer.extend(prompt(30, 99));
        let second = blocks.admit(&longer, 90, longer.len() - 1).unwrap();
        assert_eq!(second.cached_positions, 32);
        assert_eq!(second.table[..2], first.table[..2]);
        assert_ne!(second.table[2], first.table[2]);
        assert_eq!(blocks.refs(first.table[0]), 2);

        // Another prompt shares nothing.
        let other = blocks.admit(&prompt(40, 5), 40, 39).unwrap();
        assert_eq!(other.cached_positions, 0);
    }

    #[test]
    fn the_last_prompt_token_is_never_taken_from_the_cache() {
        let mut blocks = BlockManager::new(8);
        let tokens = prompt(32, 3);
        let first = blocks.admit(&tokens, 33, 31).unwrap();
        let mut chain = Vec::new();
        blocks.register(&first.table, &tokens, &mut chain);
        blocks.release(&first.table);
        // The same 32 tokens again: only the first block may be reused.
        let again = blocks.admit(&tokens, 33, 31).unwrap();
        assert_eq!(again.cached_positions, 16);
    }

    #[test]
    fn idle_cached_blocks_are_evicted_least_recently_used_first() {
        let mut blocks = BlockManager::new(4);
        let (a, b) = (prompt(33, 1), prompt(33, 2));
        for tokens in [&a, &b] {
            let admitted = blocks.admit(tokens, 32, 32).unwrap();
            let mut chain = Vec::new();
            blocks.register(&admitted.table, &tokens[..32], &mut chain);
            blocks.release(&admitted.table);
        }
        assert_eq!((blocks.cached(), blocks.available()), (4, 4));
        // A new sequence of two blocks evicts `a`'s (the older) only.
        let c = blocks.admit(&prompt(32, 3), 32, 31).unwrap();
        assert_eq!(c.cached_positions, 0);
        assert_eq!(blocks.cached(), 2);
        blocks.release(&c.table);
        assert_eq!(blocks.admit(&b, 33, 32).unwrap().cached_positions, 32);
    }

    #[test]
    fn a_full_pool_makes_a_sequence_wait_and_a_huge_one_is_refused() {
        let mut blocks = BlockManager::new(4);
        let held = blocks.admit(&prompt(10, 1), 48, 9).unwrap();
        assert_eq!(
            blocks.admit(&prompt(10, 2), 32, 9),
            Err(PoolError::Busy {
                needed: 2,
                available: 1
            })
        );
        assert!(matches!(
            blocks.admit(&prompt(10, 2), 65, 9),
            Err(PoolError::TooLarge {
                needed: 5,
                capacity: 4,
                ..
            })
        ));
        blocks.release(&held.table);
        assert!(blocks.admit(&prompt(10, 2), 32, 9).is_ok());
    }

    #[test]
    fn a_shared_idle_block_is_not_counted_twice() {
        let mut blocks = BlockManager::new(3);
        let tokens = prompt(33, 4);
        let first = blocks.admit(&tokens, 32, 32).unwrap();
        let mut chain = Vec::new();
        blocks.register(&first.table, &tokens[..32], &mut chain);
        blocks.release(&first.table);
        // 3 blocks: two cached (idle) and shared again, one fresh.
        let again = blocks.admit(&tokens, 48, 32).unwrap();
        assert_eq!(again.cached_positions, 32);
        assert_eq!(blocks.available(), 0);
        assert_eq!(
            blocks.admit(&prompt(5, 9), 16, 4),
            Err(PoolError::Busy {
                needed: 1,
                available: 0
            })
        );
    }

    #[test]
    fn the_pool_grows_and_addresses_positions_by_block() {
        let mut pool = KvPool::new(2, 4);
        pool.ensure_blocks(3);
        assert_eq!(pool.size_bytes(), 2 * 2 * 3 * BLOCK_TOKENS * 4 * 2);
        let table = [2, 0];
        assert_eq!(pool.offset(&table, 0), 2 * BLOCK_TOKENS * 4);
        assert_eq!(pool.offset(&table, 17), 4);
        pool.ensure_blocks(1);
        assert_eq!(pool.blocks(), 3);
    }
}
