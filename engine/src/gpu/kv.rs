//! A KV cache's keys and values in the GPU's memory: per layer, one buffer
//! of keys and one of values, f16 two to a word, block after block as the
//! CPU's pool lays them out (so a block id means the same on both).

use std::sync::Arc;

use super::device::Gpu;
use super::error::GpuError;
use super::step::GpuBuffer;

/// Keys and values of a shard's attention layers on the GPU.
pub struct GpuKv {
    gpu: Arc<Gpu>,
    keys: Vec<GpuBuffer>,
    values: Vec<GpuBuffer>,
    /// Bytes of one block in one layer's keys (or values).
    block_bytes: u64,
    blocks: usize,
    /// Each sequence's recurrent state (hybrid models), `state_floats` a
    /// slot, `slots` slots.
    states: GpuBuffer,
    state_floats: usize,
    slots: usize,
}

impl GpuKv {
    /// An empty cache of `layers` layers whose blocks take `block_bytes`
    /// each in a layer's keys.
    pub fn new(gpu: Arc<Gpu>, layers: usize, block_bytes: u64) -> Self {
        let empty = |label| (0..layers).map(|_| gpu.buffer(label, 4)).collect();
        Self {
            keys: empty("keys"),
            values: empty("values"),
            states: gpu.buffer("states", 4),
            gpu,
            block_bytes,
            blocks: 0,
            state_floats: 0,
            slots: 0,
        }
    }

    /// The same cache with `floats` of recurrent state per sequence.
    pub fn with_state(mut self, floats: usize) -> Self {
        self.state_floats = floats;
        self
    }

    /// Floats of recurrent state per sequence.
    pub fn state_floats(&self) -> usize {
        self.state_floats
    }

    /// Grows the states to hold `slots` slots, keeping what they hold.
    pub fn ensure_state_slots(&mut self, slots: usize) -> Result<(), GpuError> {
        if slots <= self.slots || self.state_floats == 0 {
            return Ok(());
        }
        let slot_bytes = self.state_floats as u64 * 4;
        let most = self.gpu.max_binding_bytes();
        let fit = (most / slot_bytes) as usize;
        if slots > fit {
            return Err(GpuError::TooLarge {
                what: format!("the recurrent states of {slots} sequences"),
                bytes: slots as u64 * slot_bytes,
                most,
            });
        }
        let slots = slots.max(self.slots + self.slots / 2).min(fit);
        let grown = self.gpu.buffer("states", slots as u64 * slot_bytes);
        if self.slots > 0 {
            self.gpu
                .copy(&self.states, &grown, self.slots as u64 * slot_bytes);
        }
        self.states = grown;
        self.slots = slots;
        Ok(())
    }

    /// Every sequence's recurrent state, slot after slot.
    pub fn states(&self) -> &GpuBuffer {
        &self.states
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Grows every layer to `blocks` blocks, keeping what they hold.
    pub fn ensure_blocks(&mut self, blocks: usize) -> Result<(), GpuError> {
        if blocks <= self.blocks {
            return Ok(());
        }
        let most = self.gpu.max_binding_bytes();
        let fit = (most / self.block_bytes.max(1)) as usize;
        if blocks > fit {
            return Err(GpuError::TooLarge {
                what: format!("a layer's KV cache of {blocks} blocks"),
                bytes: blocks as u64 * self.block_bytes,
                most,
            });
        }
        // Grown by half again at least (as far as a buffer may go), so a
        // sequence growing block by block copies the cache rarely.
        let blocks = blocks.max(self.blocks + self.blocks / 2).min(fit);
        let bytes = blocks as u64 * self.block_bytes;
        let held = self.blocks as u64 * self.block_bytes;
        for buffers in [&mut self.keys, &mut self.values] {
            for buffer in buffers.iter_mut() {
                let grown = self.gpu.buffer("kv", bytes);
                if held > 0 {
                    self.gpu.copy(buffer, &grown, held);
                }
                *buffer = grown;
            }
        }
        self.blocks = blocks;
        Ok(())
    }

    /// Layer `layer`'s keys and values.
    pub fn layer(&self, layer: usize) -> Option<(&GpuBuffer, &GpuBuffer)> {
        Some((self.keys.get(layer)?, self.values.get(layer)?))
    }

    /// Bytes held on the GPU.
    pub fn size_bytes(&self) -> u64 {
        2 * self.keys.len() as u64 * self.blocks as u64 * self.block_bytes
            + (self.slots * self.state_floats * 4) as u64
    }
}
