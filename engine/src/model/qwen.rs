//! Qwen2/Qwen2.5 (biases on q, k and v), Qwen3 (RMS norms on each head of
//! q and k, explicit `head_dim`) and Qwen3-MoE (Qwen3's attention with a
//! mixture of experts, `moe_intermediate_size` rows each, top-k weights
//! renormalised when `norm_topk_prob`; `mlp_only_layers` and
//! `decoder_sparse_step` keep some layers dense). Otherwise the Llama
//! decoder; RoPE rotates halves in both Hugging Face and GGUF files.

use crate::formats::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, ModelConfig};
use super::llama::base_config;
use super::moe;

/// A model configuration from a Qwen2 or Qwen3 `config.json`.
pub fn config_from_hf(
    hf: &HfConfig,
    architecture: Architecture,
) -> Result<ModelConfig, ConfigError> {
    super::llama::require_silu(hf)?;
    let mut config = base_config(hf, architecture)?;
    match architecture {
        Architecture::Qwen2 => config.qkv_bias = true,
        Architecture::Qwen3 => {
            config.qk_norm = true;
            config.qkv_bias = hf.attention_bias.unwrap_or(false);
        }
        Architecture::Qwen3Moe => {
            config.qk_norm = true;
            config.qkv_bias = hf.attention_bias.unwrap_or(false);
            let normalize = hf.norm_topk_prob.unwrap_or(false);
            config.moe = moe::config_from_hf(hf, hf.moe_intermediate_size, normalize)?;
            if config.moe.is_none() {
                return Err(ConfigError(
                    "qwen3_moe without num_experts (or num_local_experts)".into(),
                ));
            }
        }
        _ => {}
    }
    config.validate()?;
    Ok(config)
}
