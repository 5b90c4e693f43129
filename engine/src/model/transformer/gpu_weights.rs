//! What a shard holds on the GPU: its weights, uploaded once by
//! [`super::Transformer::to_gpu`] (`gpu.rs`), read by every step
//! (`gpu_forward.rs`).

use std::sync::Arc;

use crate::gpu::matvec::GpuMatrix;
use crate::gpu::{Gpu, GpuBuffer};
use crate::model::config::{Activation, LayerRope};

/// A shard's weights in the GPU's memory.
pub(crate) struct GpuModel {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) layers: Vec<GpuLayer>,
    pub(crate) final_norm: Option<GpuBuffer>,
    /// The LM head, where this shard computes logits.
    pub(crate) head: Option<GpuMatrix>,
    pub(crate) bytes: u64,
}

pub(crate) struct GpuLayer {
    pub(crate) attn_norm: Option<GpuBuffer>,
    pub(crate) attn_post_norm: Option<GpuBuffer>,
    pub(crate) ffn_norm: Option<GpuBuffer>,
    pub(crate) ffn_post_norm: Option<GpuBuffer>,
    pub(crate) attention: GpuAttention,
    pub(crate) mlp: GpuMlp,
}

pub(crate) struct GpuAttention {
    pub(crate) kv_layer: usize,
    pub(crate) window: Option<usize>,
    pub(crate) rope: LayerRope,
    pub(crate) wq: GpuMatrix,
    pub(crate) wk: GpuMatrix,
    pub(crate) wv: GpuMatrix,
    pub(crate) wo: GpuMatrix,
    pub(crate) q_bias: Option<GpuBuffer>,
    pub(crate) k_bias: Option<GpuBuffer>,
    pub(crate) v_bias: Option<GpuBuffer>,
    pub(crate) o_bias: Option<GpuBuffer>,
    /// The q and k norms and their widths (a head, or all heads).
    pub(crate) qk_norms: Option<[(GpuBuffer, usize); 2]>,
}

pub(crate) struct GpuMlp {
    pub(crate) gate: GpuMatrix,
    pub(crate) up: GpuMatrix,
    pub(crate) down: GpuMatrix,
    pub(crate) gate_bias: Option<GpuBuffer>,
    pub(crate) up_bias: Option<GpuBuffer>,
    pub(crate) down_bias: Option<GpuBuffer>,
    pub(crate) activation: Activation,
}

impl GpuModel {
    pub(crate) fn weight_bytes(&self) -> u64 {
        let matrices: u64 = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.attention;
                [
                    &a.wq,
                    &a.wk,
                    &a.wv,
                    &a.wo,
                    &l.mlp.gate,
                    &l.mlp.up,
                    &l.mlp.down,
                ]
                .iter()
                .map(|m| m.bytes())
                .sum::<u64>()
            })
            .sum();
        matrices + self.head.as_ref().map_or(0, GpuMatrix::bytes)
    }
}
