//! What a shard holds on the GPU: its weights, uploaded once by
//! [`super::Transformer::to_gpu`] (`gpu.rs`), read by every step
//! (`gpu_forward.rs`).

use std::sync::Arc;

use crate::gpu::deltanet::LinearShape;
use crate::gpu::matvec::{GpuExperts, GpuMatrix};
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
    pub(crate) mixer: GpuMixer,
    pub(crate) mlp: GpuFfn,
}

/// What mixes a layer's tokens: attention, or a Gated DeltaNet.
pub(crate) enum GpuMixer {
    Attention(GpuAttention),
    Linear(GpuLinear),
}

/// A Gated DeltaNet layer's weights (every head: one machine, or a
/// pipeline stage).
pub(crate) struct GpuLinear {
    pub(crate) shape: LinearShape,
    pub(crate) q: GpuMatrix,
    pub(crate) k: GpuMatrix,
    pub(crate) v: GpuMatrix,
    pub(crate) z: GpuMatrix,
    pub(crate) out: GpuMatrix,
    /// b's product, and a's where it is its own (else b's holds both).
    pub(crate) beta: GpuMatrix,
    pub(crate) alpha: Option<GpuMatrix>,
    /// Width of b's (and a's) product rows.
    pub(crate) ba_width: usize,
    /// The convolution's taps, `channels x kernel`.
    pub(crate) taps: GpuBuffer,
    /// Per value head: b's and a's places in a row, A and dt.
    pub(crate) head_gates: GpuBuffer,
    /// The gated norm's weight (one value head wide).
    pub(crate) norm: GpuBuffer,
    pub(crate) eps: f32,
    /// Where its state starts in a sequence's slot.
    pub(crate) state_offset: usize,
}

/// A layer's feed-forward block: one MLP, or a mixture of experts. One a
/// layer, built once and never moved: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum GpuFfn {
    Dense(GpuMlp),
    Experts(GpuMoe),
}

/// A router and its experts' matrices (SwiGLU experts, as on the CPU).
pub(crate) struct GpuMoe {
    pub(crate) router: GpuMatrix,
    pub(crate) gate: GpuExperts,
    pub(crate) up: GpuExperts,
    pub(crate) down: GpuExperts,
    pub(crate) per_token: usize,
    /// Whether the chosen experts' weights are renormalised.
    pub(crate) normalize: bool,
    /// The expert every token runs, scaled by `sigmoid(gate . x)`.
    pub(crate) shared: Option<GpuSharedExpert>,
}

pub(crate) struct GpuSharedExpert {
    pub(crate) gate: GpuMatrix,
    pub(crate) up: GpuMatrix,
    pub(crate) down: GpuMatrix,
    pub(crate) gate_vector: GpuBuffer,
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
    /// Whether wq gives each head's q then its output gate (Qwen3.5).
    pub(crate) output_gate: bool,
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
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| l.mixer.bytes() + l.mlp.bytes())
            .sum();
        layers + self.head.as_ref().map_or(0, GpuMatrix::bytes)
    }
}

impl GpuMixer {
    fn bytes(&self) -> u64 {
        match self {
            Self::Attention(a) => [&a.wq, &a.wk, &a.wv, &a.wo].iter().map(|m| m.bytes()).sum(),
            Self::Linear(l) => {
                let alpha = l.alpha.as_ref().map_or(0, GpuMatrix::bytes);
                [&l.q, &l.k, &l.v, &l.z, &l.out, &l.beta]
                    .iter()
                    .map(|m| m.bytes())
                    .sum::<u64>()
                    + alpha
            }
        }
    }
}

impl GpuFfn {
    fn bytes(&self) -> u64 {
        match self {
            Self::Dense(m) => m.gate.bytes() + m.up.bytes() + m.down.bytes(),
            Self::Experts(m) => m.router.bytes() + m.gate.bytes() + m.up.bytes() + m.down.bytes(),
        }
    }
}
