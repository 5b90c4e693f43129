//! The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral. Grouped-query
//! attention, SwiGLU MLP, RMS norms, RoPE (plain, linear or Llama 3
//! scaling), embeddings optionally tied to the LM head.

use crate::hf_dir::HfConfig;
use crate::ops::RopeStyle;

use super::config::{Architecture, ConfigError, ModelConfig, RopeScaling};

/// A model configuration from a Hugging Face `config.json` of this family.
pub fn config_from_hf(hf: &HfConfig) -> Result<ModelConfig, ConfigError> {
    base_config(hf, Architecture::Llama)
}

/// The fields every family here shares; Qwen adds its flags on top.
pub(crate) fn base_config(
    hf: &HfConfig,
    architecture: Architecture,
) -> Result<ModelConfig, ConfigError> {
    let heads = hf.num_attention_heads;
    if heads == 0 {
        return Err(ConfigError("num_attention_heads is 0".into()));
    }
    let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / heads);
    let config = ModelConfig {
        architecture,
        layers: hf.num_hidden_layers,
        hidden: hf.hidden_size,
        ffn: hf.intermediate_size,
        heads,
        kv_heads: hf.num_key_value_heads.unwrap_or(heads),
        head_dim,
        vocab: hf.vocab_size,
        context_length: hf.max_position_embeddings.unwrap_or(2048),
        norm_eps: hf.rms_norm_eps as f32,
        rope_theta: hf.rope_theta.unwrap_or(10_000.0) as f32,
        // Hugging Face checkpoints rotate halves (`rotate_half`).
        rope_style: RopeStyle::Halves,
        rope_scaling: rope_scaling(hf.rope_scaling.as_ref())?,
        rotary_dims: head_dim,
        qkv_bias: hf.attention_bias.unwrap_or(false),
        qk_norm: false,
        tied_embeddings: hf.tie_word_embeddings.unwrap_or(false),
    };
    config.validate()?;
    Ok(config)
}

fn rope_scaling(value: Option<&serde_json::Value>) -> Result<RopeScaling, ConfigError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let number =
        |key: &str, default: f64| value.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: number("factor", 1.0) as f32,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor", 8.0) as f32,
            low_freq_factor: number("low_freq_factor", 1.0) as f32,
            high_freq_factor: number("high_freq_factor", 4.0) as f32,
            original_context: number("original_max_position_embeddings", 8192.0) as usize,
        }),
        other => Err(ConfigError(format!(
            "rope_scaling type `{other}` is not supported (default, linear, llama3)"
        ))),
    }
}
