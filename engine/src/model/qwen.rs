//! Qwen2/Qwen2.5 (biases on q, k and v) and Qwen3 (RMS norms on each head of
//! q and k, explicit `head_dim`). Otherwise the Llama decoder; RoPE rotates
//! halves in both Hugging Face and GGUF files.

use crate::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, ModelConfig};
use super::llama::base_config;

/// A model configuration from a Qwen2 or Qwen3 `config.json`.
pub fn config_from_hf(
    hf: &HfConfig,
    architecture: Architecture,
) -> Result<ModelConfig, ConfigError> {
    let mut config = base_config(hf, architecture)?;
    match architecture {
        Architecture::Qwen2 => config.qkv_bias = true,
        Architecture::Qwen3 => {
            config.qk_norm = true;
            config.qkv_bias = hf.attention_bias.unwrap_or(false);
        }
        Architecture::Llama => {}
    }
    config.validate()?;
    Ok(config)
}
