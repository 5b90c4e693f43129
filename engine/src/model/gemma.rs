//! Gemma 2 and Gemma 3 (text). Over the Llama decoder:
//! - embeddings multiplied by the square root of the width;
//! - RMS norms that scale by `1 + w` (Hugging Face stores `w`; llama.cpp's
//!   converter adds the 1, so GGUF files hold `1 + w` and the Hugging Face
//!   reader adds it on load);
//! - norms both before and after attention and the MLP;
//! - GeGLU (tanh-approximated gelu) instead of SwiGLU;
//! - q·k scaled by `query_pre_attn_scalar^-1/2`;
//! - windowed and global layers interleaved (Gemma 2: every other; Gemma 3:
//!   five to one, the windowed ones with a RoPE base of their own, unscaled);
//! - Gemma 2 caps attention scores and logits softly (`cap * tanh(x / cap)`);
//!   Gemma 3 norms q and k per head instead.

use crate::formats::hf_dir::HfConfig;

use super::config::{Activation, Architecture, ConfigError, ModelConfig};
use super::llama::{base_config, rope_scaling};

/// transformers' defaults where a config leaves them out.
const DEFAULT_WINDOW: u64 = 4096;
const DEFAULT_QUERY_SCALAR: f64 = 256.0;
const GEMMA2_ATTN_SOFTCAP: f32 = 50.0;
const GEMMA2_FINAL_SOFTCAP: f32 = 30.0;
const GEMMA3_LOCAL_ROPE_THETA: f64 = 10_000.0;

/// A model configuration from a Gemma 2 or Gemma 3 (text) `config.json`.
pub fn config_from_hf(
    hf: &HfConfig,
    architecture: Architecture,
) -> Result<ModelConfig, ConfigError> {
    let act = hf
        .hidden_activation
        .as_deref()
        .or(hf.hidden_act.as_deref())
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(ConfigError(format!(
            "hidden_activation `{act}` is not supported (Gemma's MLP applies gelu_pytorch_tanh)"
        )));
    }
    let gemma3 = architecture == Architecture::Gemma3;
    let mut config = base_config(hf, architecture)?;
    config.qk_norm = gemma3;
    config.tied_embeddings = hf.tie_word_embeddings.unwrap_or(true);
    let window = hf.sliding_window.unwrap_or(DEFAULT_WINDOW);
    config.sliding_window = (window < config.context_length as u64).then_some(window as usize);
    let variant = &mut config.variant;
    variant.post_norms = true;
    variant.activation = Activation::GeluTanh;
    variant.embedding_scale = Some((config.hidden as f32).sqrt());
    let scalar = hf.query_pre_attn_scalar.unwrap_or(DEFAULT_QUERY_SCALAR);
    variant.attention_scale = Some(scalar.powf(-0.5) as f32);
    let (attn_cap, final_cap) = if gemma3 {
        (None, None)
    } else {
        (Some(GEMMA2_ATTN_SOFTCAP), Some(GEMMA2_FINAL_SOFTCAP))
    };
    variant.attn_softcap = softcap(hf.attn_logit_softcapping.as_ref(), attn_cap)?;
    variant.final_softcap = softcap(hf.final_logit_softcapping.as_ref(), final_cap)?;
    if variant.sliding_layers.is_none() {
        let every = if gemma3 {
            hf.sliding_window_pattern.unwrap_or(6)
        } else {
            2
        };
        variant.sliding_layers = Some(sliding_pattern(config.layers, every));
    }
    if gemma3 {
        gemma3_rope(hf, &mut config)?;
    }
    config.validate()?;
    Ok(config)
}

/// Gemma 3's two RoPEs: transformers 5 nests them in `rope_parameters` by
/// layer type; transformers 4 wrote the global one flat and the local base
/// as `rope_local_base_freq`.
fn gemma3_rope(hf: &HfConfig, config: &mut ModelConfig) -> Result<(), ConfigError> {
    let nested = hf
        .rope_parameters
        .as_ref()
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    let theta = |p: Option<&serde_json::Value>| {
        p.and_then(|p| p.get("rope_theta"))
            .and_then(serde_json::Value::as_f64)
    };
    let local = match nested {
        Some(parameters) => {
            let global = parameters.get("full_attention");
            if let Some(base) = theta(global) {
                config.rope_theta = base as f32;
            }
            config.rope_scaling = rope_scaling(global, hf.max_position_embeddings)?;
            let local = parameters.get("sliding_attention");
            if let Some(kind) = local
                .and_then(|p| p.get("rope_type"))
                .and_then(|v| v.as_str())
                .filter(|kind| *kind != "default")
            {
                return Err(ConfigError(format!(
                    "rope type `{kind}` on Gemma 3's sliding layers is not supported (default)"
                )));
            }
            theta(local)
        }
        None => hf.rope_local_base_freq,
    };
    config.variant.local_rope_theta = Some(local.unwrap_or(GEMMA3_LOCAL_ROPE_THETA) as f32);
    Ok(())
}

/// A soft cap: the config's number, none for null, the default if absent.
fn softcap(
    value: Option<&serde_json::Value>,
    default: Option<f32>,
) -> Result<Option<f32>, ConfigError> {
    match value {
        None => Ok(default),
        Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|cap| Some(cap as f32))
            .ok_or_else(|| ConfigError(format!("a logit soft cap must be a number, not {v}"))),
    }
}

/// Every `every`'th layer global, the others windowed (llama.cpp's
/// `set_swa_pattern`: layer `i` is windowed when `i % every < every - 1`).
pub fn sliding_pattern(layers: usize, every: usize) -> Vec<bool> {
    (0..layers)
        .map(|layer| every == 0 || layer % every < every.saturating_sub(1))
        .collect()
}

/// llama.cpp's q·k scale for a Gemma GGUF, which does not store
/// `query_pre_attn_scalar`: the 27B models (46 layers for Gemma 2, 62 for
/// Gemma 3) scale by the width per head, the others by the head dimension
/// (`None`, the default).
pub fn gguf_attention_scale(
    architecture: Architecture,
    layers: usize,
    hidden: usize,
    heads: usize,
) -> Option<f32> {
    let big = matches!(
        (architecture, layers),
        (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62)
    );
    (big && heads > 0).then(|| 1.0 / ((hidden / heads) as f32).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_transformers_layer_types() {
        // Gemma 2: even layers windowed; Gemma 3: one global in six.
        assert_eq!(sliding_pattern(4, 2), [true, false, true, false]);
        assert_eq!(
            sliding_pattern(7, 6),
            [true, true, true, true, true, false, true]
        );
    }
}
