//! Phi-3 / Phi-3.5 (mini, medium): the Llama decoder with q, k and v in one
//! projection (`qkv_proj`, GGUF `attn_qkv`) and gate and up in another
//! (`gate_up_proj`, GGUF `ffn_up` of twice the rows). The loader splits both
//! section by section, so a tensor-parallel rank takes its rows of each.
//! RoPE may rotate part of each head (`partial_rotary_factor`), and
//! LongRoPE stretches Phi-3.5's context to 128k (`config::RopeScaling`).

use crate::formats::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, ModelConfig};
use super::llama::{base_config, partial_rotary_dims, require_silu};

/// A model configuration from a Phi-3 `config.json`.
pub fn config_from_hf(hf: &HfConfig) -> Result<ModelConfig, ConfigError> {
    require_silu(hf)?;
    let mut config = base_config(hf, Architecture::Phi3)?;
    config.rotary_dims = partial_rotary_dims(hf, config.head_dim, 1.0)?;
    config.validate()?;
    Ok(config)
}
