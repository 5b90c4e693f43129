//! Phi-3 / Phi-3.5 (mini, medium): the Llama decoder with q, k and v in one
//! projection (`qkv_proj`, GGUF `attn_qkv`) and gate and up in another
//! (`gate_up_proj`, GGUF `ffn_up` of twice the rows). The loader splits both
//! section by section, so a tensor-parallel rank takes its rows of each.
//! RoPE may rotate part of each head (`partial_rotary_factor`), and
//! LongRoPE stretches Phi-3.5's context to 128k (`config::RopeScaling`).

use crate::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, ModelConfig};
use super::llama::{base_config, require_silu};

/// A model configuration from a Phi-3 `config.json`.
pub fn config_from_hf(hf: &HfConfig) -> Result<ModelConfig, ConfigError> {
    require_silu(hf)?;
    let mut config = base_config(hf, Architecture::Phi3)?;
    let factor = hf
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(serde_json::Value::as_f64)
        .or(hf.partial_rotary_factor)
        .unwrap_or(1.0);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(ConfigError(format!(
            "partial_rotary_factor {factor} must be in (0, 1]"
        )));
    }
    // transformers: int(head_dim * factor), rounded down to whole pairs.
    config.rotary_dims = ((config.head_dim as f64 * factor) as usize) & !1;
    config.validate()?;
    Ok(config)
}
