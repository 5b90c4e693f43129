//! The architecture-independent description of a decoder-only model.

use crate::ops::RopeStyle;

/// The architectures the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2, Mistral (same tensors, GQA, RoPE variants).
    Llama,
    /// Qwen2/Qwen2.5: biases on q, k and v.
    Qwen2,
    /// Qwen3: RMS norms on each head of q and k, no biases.
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention, a mixture of experts for the MLP.
    Qwen3Moe,
    /// Phi-3 / Phi-3.5: q, k and v in one projection, gate and up in another.
    Phi3,
    /// SmolLM3: every fourth layer without RoPE.
    SmolLm3,
    /// OLMo 2: norms after attention and MLP, q and k normed across heads.
    Olmo2,
    /// Gemma 2: scaled embeddings, (1 + w) norms before and after each
    /// block, GeGLU, soft-capped scores and logits, alternating windows.
    Gemma2,
    /// Gemma 3: Gemma 2 with q/k norms, five windowed layers to one global,
    /// a RoPE base of their own for the windowed layers, no score cap.
    Gemma3,
    /// Qwen3.5 (dense): Gated DeltaNet linear-attention layers between
    /// gated full-attention layers with partial RoPE.
    Qwen35,
    /// Qwen3.5-MoE: Qwen3.5 with experts and a gated shared expert.
    Qwen35Moe,
    /// Qwen3-Next: as Qwen3.5-MoE, q/k/v/z and b/a fused per key head in
    /// its Hugging Face files.
    Qwen3Next,
}

impl Architecture {
    /// The names [`Architecture::from_name`] takes, for messages.
    pub const KNOWN: &'static str = "llama, mistral, mixtral, smollm, smollm2, smollm3, qwen2, \
         qwen3, qwen3moe (qwen3_moe), phi3, olmo2, gemma2, gemma3 (gemma3_text), \
         qwen35 (qwen3_5, qwen3_5_text), qwen35moe (qwen3_5_moe, qwen3_5_moe_text), \
         qwen3next (qwen3_next)";

    /// From GGUF's `general.architecture` or config.json's `model_type`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            // Mixtral is Llama's decoder with experts (GGUF calls it llama).
            "llama" | "mistral" | "mixtral" | "smollm" | "smollm2" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "qwen3moe" | "qwen3_moe" => Some(Self::Qwen3Moe),
            "phi3" => Some(Self::Phi3),
            "smollm3" => Some(Self::SmolLm3),
            "olmo2" => Some(Self::Olmo2),
            "gemma2" => Some(Self::Gemma2),
            // Gemma 3's text model; the multimodal `gemma3` folder nests it.
            "gemma3" | "gemma3_text" => Some(Self::Gemma3),
            "qwen35" | "qwen3_5" | "qwen3_5_text" => Some(Self::Qwen35),
            "qwen35moe" | "qwen3_5_moe" | "qwen3_5_moe_text" => Some(Self::Qwen35Moe),
            "qwen3next" | "qwen3_next" => Some(Self::Qwen3Next),
            _ => None,
        }
    }

    /// Whether its layers mix linear attention with full attention.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Self::Qwen35 | Self::Qwen35Moe | Self::Qwen3Next)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
            Self::Phi3 => "phi3",
            Self::SmolLm3 => "smollm3",
            Self::Olmo2 => "olmo2",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3",
            Self::Qwen35 => "qwen35",
            Self::Qwen35Moe => "qwen35moe",
            Self::Qwen3Next => "qwen3next",
        }
    }
}

/// How positions beyond the trained context are stretched.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's per-frequency factors (also stored in GGUF as `rope_freqs`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: usize,
    },
    /// YaRN: each frequency blended between interpolated (divided by
    /// `factor`) and kept, by a ramp over the pairs whose wavelengths lie
    /// between `beta_fast` and `beta_slow` rotations of the original
    /// context; cos and sin scaled by `attention_factor`.
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
    },
    /// Dynamic NTK scaling: once a sequence of length L outgrows
    /// `original_context`, the base becomes
    /// theta (factor L / original - (factor - 1))^(d / (d - 2)) for the d
    /// rotated dimensions. Each token keeps the base of the length its
    /// sequence had when it was appended (a prompt token: the whole
    /// prompt's), as transformers' `generate` with its KV cache does.
    Dynamic {
        factor: f32,
        original_context: usize,
    },
    /// LongRoPE (Phi-3.5, Phi-4-mini): per-pair divisors, `long` for a
    /// sequence longer than `original_context` and `short` otherwise, as
    /// transformers chooses them: by the sequence's length when its token
    /// was computed (a prompt token: the whole prompt's), and once a
    /// generation outgrows the original context every earlier position is
    /// computed again with the long factors (Phi-3's `generate` drops its
    /// cache there; `Batch` refills the sequence). cos and sin are scaled
    /// by `attention_factor` either way.
    LongRope {
        long: Vec<f32>,
        short: Vec<f32>,
        original_context: usize,
        attention_factor: f32,
    },
}

impl RopeScaling {
    /// LongRoPE's attention factor when the file gives none, for a context
    /// stretched `factor` times: sqrt(1 + ln(factor) / ln(original)).
    pub fn longrope_default_attention_factor(factor: f32, original_context: usize) -> f32 {
        if factor <= 1.0 || original_context < 2 {
            1.0
        } else {
            (1.0 + factor.ln() / (original_context as f32).ln()).sqrt()
        }
    }

    /// YaRN's attention factor when the file gives none: 0.1 ln(factor) + 1.
    pub fn yarn_default_attention_factor(factor: f32) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * factor.ln() + 1.0
        }
    }
}

/// A mixture-of-experts MLP: a router picks `experts_per_token` of
/// `experts` SwiGLU experts for each token and sums their outputs weighted
/// by the router's softmax (Mixtral, Qwen3-MoE).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub experts_per_token: usize,
    /// Intermediate rows of each expert (on a tensor-parallel rank, its
    /// share of them).
    pub expert_ffn: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one
    /// (Mixtral always; Qwen3-MoE's `norm_topk_prob`).
    pub normalize_top_k: bool,
    /// Rows of a shared expert every token runs beside the routed ones,
    /// its output scaled by a sigmoid gate (Qwen3.5-MoE, Qwen3-Next); on a
    /// tensor-parallel rank, its share of them.
    pub shared_ffn: Option<usize>,
}

/// How the value heads of a Gated DeltaNet layer are ordered in the file:
/// which key head value head `j` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueHeadOrder {
    /// By key head: value heads `k * r .. (k + 1) * r` read key head `k`
    /// (Hugging Face, Qwen3-Next GGUF).
    Grouped,
    /// Tiled: value head `j` reads key head `j % key_heads` (llama.cpp's
    /// converter reorders Qwen3.5's so that ggml can broadcast).
    Tiled,
}

/// The Gated DeltaNet (linear attention) layers of a hybrid model: a causal
/// depthwise convolution over q, k and v, then a recurrent state per value
/// head instead of a KV cache (Qwen3.5, Qwen3-Next).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearAttention {
    /// Which layers are linear; the others are full attention.
    pub layers: Vec<bool>,
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub key_dim: usize,
    pub value_heads: usize,
    pub value_dim: usize,
    pub order: ValueHeadOrder,
}

impl LinearAttention {
    /// Value heads per key head.
    pub fn values_per_key(&self) -> usize {
        self.value_heads / self.key_heads.max(1)
    }

    /// The key head value head `value` (a file index) reads.
    pub fn key_of(&self, value: usize) -> usize {
        match self.order {
            ValueHeadOrder::Grouped => value / self.values_per_key().max(1),
            ValueHeadOrder::Tiled => value % self.key_heads.max(1),
        }
    }

    /// Channels of the convolution: q, k and v.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    pub fn is_linear(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama and most others).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of gelu (Gemma).
    GeluTanh,
}

/// How a layer's attention places positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerRope {
    /// The model's RoPE (base, scaling).
    Global,
    /// The windowed layers' own base, unscaled (Gemma 3).
    Local,
    /// No rotation at all (SmolLM3's NoPE layers).
    None,
}

/// Where a family's decoder block departs from Llama's; the default
/// departs nowhere.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Variant {
    /// No norms before attention and MLP (OLMo 2 norms their outputs).
    pub no_pre_norms: bool,
    /// Norms on the attention's and the MLP's outputs before each residual
    /// add (Gemma 2/3, OLMo 2).
    pub post_norms: bool,
    /// q and k normed across all heads at once (OLMo 2), not head by head.
    pub qk_norm_whole: bool,
    pub activation: Activation,
    /// Embeddings multiplied by this (Gemma: the square root of the width).
    pub embedding_scale: Option<f32>,
    /// Scores capped as `cap * tanh(score / cap)` before the softmax
    /// (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits capped the same way (Gemma 2).
    pub final_softcap: Option<f32>,
    /// The scale of q·k when not 1/sqrt(head_dim) (Gemma's
    /// `query_pre_attn_scalar`).
    pub attention_scale: Option<f32>,
    /// Which layers attend over the sliding window; `None`: all of them
    /// (when the model has a window).
    pub sliding_layers: Option<Vec<bool>>,
    /// Which layers rotate q and k; `None`: all of them.
    pub rope_layers: Option<Vec<bool>>,
    /// RoPE base of the windowed layers, unscaled (Gemma 3's local layers).
    pub local_rope_theta: Option<f32>,
    /// Attention's q projection is twice as wide: each head's q then a gate,
    /// the attention output multiplied by the gate's sigmoid (Qwen3.5).
    pub attn_output_gate: bool,
    /// Gated DeltaNet layers between the attention layers (hybrid models).
    pub linear: Option<LinearAttention>,
}

/// Everything the forward pass needs to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub norm_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rope_scaling: RopeScaling,
    /// Dimensions of each head that RoPE rotates (usually all).
    pub rotary_dims: usize,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied_embeddings: bool,
    /// Attention over the last this-many positions only (every layer).
    pub sliding_window: Option<usize>,
    /// Set for mixture-of-experts models; a layer whose file holds a router
    /// runs experts, one without runs the dense MLP of `ffn` rows.
    pub moe: Option<MoeConfig>,
    /// The family's departures from the Llama block.
    pub variant: Variant,
}

/// Checks a hybrid model's linear-attention shapes.
fn validate_linear(linear: &LinearAttention, layers: usize) -> Result<(), ConfigError> {
    let fail = |m: String| Err(ConfigError(m));
    if linear.layers.len() != layers {
        return fail(format!(
            "{} linear-attention layer flags given for {layers} layers",
            linear.layers.len()
        ));
    }
    let dims = [
        linear.conv_kernel,
        linear.key_heads,
        linear.key_dim,
        linear.value_heads,
        linear.value_dim,
    ];
    if dims.contains(&0)
        || dims.iter().any(|&d| d > 1 << 16)
        || !linear.value_heads.is_multiple_of(linear.key_heads)
    {
        return fail(format!(
            "linear attention with conv kernel {}, {} key heads of {} and {} value heads of {}: \
             need positive sizes and whole value heads per key head",
            linear.conv_kernel,
            linear.key_heads,
            linear.key_dim,
            linear.value_heads,
            linear.value_dim
        ));
    }
    Ok(())
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid model configuration: {0}")]
pub struct ConfigError(pub String);

impl ModelConfig {
    /// Checks the shapes fit together, so the forward pass can trust them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError(m));
        if self.layers == 0 || self.hidden == 0 || self.heads == 0 || self.vocab == 0 {
            return fail(format!(
                "layers ({}), hidden size ({}), heads ({}) and vocabulary ({}) must be positive",
                self.layers, self.hidden, self.heads, self.vocab
            ));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return fail(format!(
                "{} attention heads cannot be shared by {} KV heads",
                self.heads, self.kv_heads
            ));
        }
        if self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || self.head_dim > 512
            || self.rotary_dims > self.head_dim
        {
            return fail(format!(
                "head dimension {} (rotary {}) must be even, at most 512, and cover the rotary part",
                self.head_dim, self.rotary_dims
            ));
        }
        if !self.rotary_dims.is_multiple_of(2) {
            return fail(format!(
                "rotary dimensions {} must be even",
                self.rotary_dims
            ));
        }
        if self.sliding_window == Some(0) {
            return fail("a sliding window of 0 positions sees nothing".into());
        }
        for (name, flags) in [
            ("sliding-window layers", &self.variant.sliding_layers),
            ("RoPE layers", &self.variant.rope_layers),
        ] {
            if let Some(flags) = flags.as_ref().filter(|f| f.len() != self.layers) {
                return fail(format!(
                    "{} {name} given for {} layers",
                    flags.len(),
                    self.layers
                ));
            }
        }
        let positive = |v: Option<f32>| v.is_none_or(|v| v.is_finite() && v > 0.0);
        if !positive(self.variant.attn_softcap)
            || !positive(self.variant.final_softcap)
            || !positive(self.variant.attention_scale)
            || !positive(self.variant.embedding_scale)
            || !positive(self.variant.local_rope_theta)
        {
            return fail(format!(
                "soft caps, scales and RoPE bases must be positive: {:?}",
                self.variant
            ));
        }
        self.validate_rope_scaling()?;
        if let Some(linear) = &self.variant.linear {
            validate_linear(linear, self.layers)?;
        }
        if let Some(moe) = &self.moe {
            if moe.experts == 0
                || moe.experts_per_token == 0
                || moe.experts_per_token > moe.experts
                || moe.experts > 1024
                || moe.expert_ffn == 0
            {
                return fail(format!(
                    "{} experts with {} per token and {} rows each: need 1 <= per token <= experts <= 1024 and rows > 0",
                    moe.experts, moe.experts_per_token, moe.expert_ffn
                ));
            }
        }
        Ok(())
    }

    /// A dynamic scaling's factor and original context; LongRoPE's factors,
    /// one positive pair per rotary pair.
    fn validate_rope_scaling(&self) -> Result<(), ConfigError> {
        if let RopeScaling::Dynamic {
            factor,
            original_context,
        } = self.rope_scaling
        {
            if !(factor.is_finite() && factor >= 1.0) || original_context == 0 {
                return Err(ConfigError(format!(
                    "dynamic RoPE needs a factor of at least 1 and max_position_embeddings, \
                     found {factor} and {original_context}"
                )));
            }
        }
        if let RopeScaling::LongRope { long, short, .. } = &self.rope_scaling {
            let pairs = self.rotary_dims / 2;
            if long.len() != pairs
                || short.len() != pairs
                || long
                    .iter()
                    .chain(short)
                    .any(|f| !(f.is_finite() && *f > 0.0))
            {
                return Err(ConfigError(format!(
                    "LongRoPE needs {pairs} positive long and short factors, found {} and {}",
                    long.len(),
                    short.len()
                )));
            }
        }
        Ok(())
    }

    /// Whether any layer keeps recurrent state (a hybrid model): its
    /// sequences' caches cannot be shared, cut back or rolled back.
    pub fn has_recurrent_state(&self) -> bool {
        self.variant
            .linear
            .as_ref()
            .is_some_and(|l| l.layers.contains(&true))
    }

    /// Whether layer `layer` is a Gated DeltaNet (linear-attention) layer.
    pub fn is_linear_layer(&self, layer: usize) -> bool {
        self.variant
            .linear
            .as_ref()
            .is_some_and(|l| l.is_linear(layer))
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let sliding = self
            .variant
            .sliding_layers
            .as_ref()
            .is_none_or(|s| s.get(layer).copied().unwrap_or(false));
        self.sliding_window.filter(|_| sliding)
    }

    /// How layer `layer` rotates q and k.
    pub fn layer_rope(&self, layer: usize) -> LayerRope {
        let rotates = self
            .variant
            .rope_layers
            .as_ref()
            .is_none_or(|r| r.get(layer).copied().unwrap_or(true));
        if !rotates {
            LayerRope::None
        } else if self.variant.local_rope_theta.is_some() && self.layer_window(layer).is_some() {
            LayerRope::Local
        } else {
            LayerRope::Global
        }
    }

    /// Weights one token multiplies through in a layer's matrices: the
    /// attention projections and the MLP (the experts a token runs).
    pub fn layer_weights(&self) -> usize {
        let h = self.hidden;
        let attention = 2 * h * (self.q_dim() + self.kv_dim());
        let mlp_rows = match &self.moe {
            Some(moe) => moe.expert_ffn * moe.experts_per_token + moe.shared_ffn.unwrap_or(0),
            None => self.ffn,
        };
        attention + 3 * h * mlp_rows
    }

    /// What the output head and sampling cost a pipeline's first stage, in
    /// layers. Per weight the head takes about 7/8 of a layer's time
    /// (SmolLM2-135M Q4_1 with its Q8_0 head, 4-token micro-batches, timed
    /// per stage: the head 1.9-2.3 ms, a layer 0.27-0.31 ms, so 7 layers'
    /// time for 8 layers' weights; a layer also has attention and norms),
    /// and the first stage spends about a layer's time per micro-batch
    /// sampling and scheduling.
    pub fn head_cost_in_layers(&self) -> f64 {
        let layer = self.layer_weights().max(1) as f64;
        0.875 * (self.vocab * self.hidden) as f64 / layer + 1.0
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Per-frequency divisors for Llama 3 scaling (llama.cpp's
    /// `rope_freqs`) and YaRN.
    pub fn rope_freq_factors(&self) -> Option<Vec<f32>> {
        if let RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast,
            beta_slow,
            ..
        } = self.rope_scaling
        {
            return Some(self.yarn_divisors(factor, original_context, beta_fast, beta_slow));
        }
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_context,
        } = self.rope_scaling
        else {
            return None;
        };
        let low_wavelen = original_context as f32 / low_freq_factor;
        let high_wavelen = original_context as f32 / high_freq_factor;
        Some(
            (0..self.rotary_dims / 2)
                .map(|i| {
                    let freq = self
                        .rope_theta
                        .powf(-((2 * i) as f32) / self.rotary_dims as f32);
                    let wavelen = 2.0 * std::f32::consts::PI / freq;
                    if wavelen < high_wavelen {
                        1.0
                    } else if wavelen > low_wavelen {
                        factor
                    } else {
                        let smooth = (original_context as f32 / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        1.0 / ((1.0 - smooth) / factor + smooth)
                    }
                })
                .collect(),
        )
    }

    /// YaRN's divisor of each pair's frequency: 1 (kept) below the ramp,
    /// `factor` (interpolated) above it, blended linearly between, the
    /// ramp's ends at the pairs that turn `beta_fast` and `beta_slow` times
    /// over the original context (floored and ceiled, as transformers'
    /// default `truncate` and llama.cpp do).
    fn yarn_divisors(
        &self,
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
    ) -> Vec<f32> {
        let dims = self.rotary_dims as f64;
        let base = self.rope_theta as f64;
        let pair_of = |rotations: f64| {
            dims * (original_context as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let low = pair_of(beta_fast as f64).floor().max(0.0);
        let high = pair_of(beta_slow as f64).ceil().min(dims - 1.0);
        let span = if high == low { 0.001 } else { high - low };
        (0..self.rotary_dims / 2)
            .map(|i| {
                let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0) as f32;
                1.0 / (ramp / factor + (1.0 - ramp))
            })
            .collect()
    }

    /// What cos and sin are multiplied by (YaRN's attention factor).
    pub fn rope_attention_factor(&self) -> f32 {
        match self.rope_scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::LongRope {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }

    /// The RoPE base for a token appended when its sequence was `length`
    /// long (only dynamic scaling makes it depend on the length).
    pub fn rope_base_at(&self, length: usize) -> f32 {
        let RopeScaling::Dynamic {
            factor,
            original_context,
        } = self.rope_scaling
        else {
            return self.rope_theta;
        };
        if length <= original_context || self.rotary_dims <= 2 {
            return self.rope_theta;
        }
        // In f32, as transformers computes it.
        let d = self.rotary_dims as f32;
        let stretch = factor * length as f32 / original_context as f32 - (factor - 1.0);
        self.rope_theta * stretch.powf(d / (d - 2.0))
    }

    /// Whether a token's rotation depends on its sequence's prompt length
    /// (dynamic scaling, LongRoPE with two sets of factors), so that cached
    /// blocks of one prompt cannot serve another.
    pub fn rope_depends_on_length(&self) -> bool {
        matches!(self.rope_scaling, RopeScaling::Dynamic { .. }) || self.rope_switch().is_some()
    }

    /// LongRoPE's per-pair divisors for a token computed when its sequence
    /// was `length` long: the long ones beyond the original context
    /// (`None` for the other scalings).
    pub fn longrope_factors_at(&self, length: usize) -> Option<&[f32]> {
        match &self.rope_scaling {
            RopeScaling::LongRope {
                long,
                short,
                original_context,
                ..
            } => Some(if length > *original_context {
                long
            } else {
                short
            }),
            _ => None,
        }
    }

    /// The length past which a sequence's earlier positions must be
    /// computed again (LongRoPE whose long and short factors differ): a
    /// sequence that was at most this long when they were computed used
    /// the short factors.
    pub fn rope_switch(&self) -> Option<usize> {
        match &self.rope_scaling {
            RopeScaling::LongRope {
                long,
                short,
                original_context,
                ..
            } if long != short => Some(*original_context),
            _ => None,
        }
    }

    /// The multiplier on every angle (linear scaling).
    pub fn rope_freq_scale(&self) -> f32 {
        match self.rope_scaling {
            RopeScaling::Linear { factor } if factor > 0.0 => 1.0 / factor,
            _ => 1.0,
        }
    }
}
