//! The hybrid-attention Qwens: Qwen3.5 (dense), Qwen3.5-MoE and
//! Qwen3-Next. Three Gated DeltaNet layers ([`super::deltanet`]) to one
//! full-attention layer by default (`layer_types`, or one full layer in
//! every `full_attention_interval`). Over Qwen3:
//! - the full-attention layers rotate a quarter of each head
//!   (`partial_rotary_factor`) and gate their output: q_proj is twice as
//!   wide, each head's q followed by its gate, and the attention output is
//!   multiplied by the gate's sigmoid before o_proj;
//! - every RMS norm scales by `1 + w` (Hugging Face stores `w`; llama.cpp's
//!   converter adds the 1), except the linear layers' gated norm;
//! - the MoE families add a shared expert scaled by a sigmoid gate, and
//!   always renormalise the chosen experts' weights (Qwen3-Next when
//!   `norm_topk_prob`).
//!
//! Qwen3.5 GGUFs order the linear layers' value heads tiled (llama.cpp's
//! converter reorders them when there are more value than key heads);
//! Qwen3-Next's keep Hugging Face's grouped order. Qwen3.5 writes MRoPE
//! sections too; for text every section has the same position, which is
//! plain RoPE.

use crate::formats::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, LinearAttention, ModelConfig, ValueHeadOrder};
use super::llama::{base_config, partial_rotary_dims, require_silu};
use super::moe;

/// transformers' default: one full-attention layer in four.
const DEFAULT_FULL_ATTENTION_INTERVAL: usize = 4;

/// A model configuration from a Qwen3.5, Qwen3.5-MoE or Qwen3-Next
/// `config.json` (the text model).
pub fn config_from_hf(
    hf: &HfConfig,
    architecture: Architecture,
) -> Result<ModelConfig, ConfigError> {
    require_silu(hf)?;
    let mut config = base_config(hf, architecture)?;
    config.qk_norm = true;
    config.qkv_bias = hf.attention_bias.unwrap_or(false);
    config.rotary_dims = partial_rotary_dims(hf, config.head_dim, 0.25)?;
    config.variant.attn_output_gate = true;
    config.variant.sliding_layers = None;
    config.variant.linear = Some(linear_from_hf(hf)?);
    if architecture != Architecture::Qwen35 {
        let normalize = architecture == Architecture::Qwen35Moe || hf.norm_topk_prob == Some(true);
        config.moe = moe::config_from_hf(hf, hf.moe_intermediate_size, normalize)?;
        if config.moe.is_none() {
            return Err(ConfigError(format!(
                "{} without num_experts",
                hf.model_type
            )));
        }
    }
    config.validate()?;
    Ok(config)
}

fn linear_from_hf(hf: &HfConfig) -> Result<LinearAttention, ConfigError> {
    let need = |value: Option<usize>, key: &str| {
        value.ok_or_else(|| ConfigError(format!("{} without {key}", hf.model_type)))
    };
    let layers = match &hf.layer_types {
        Some(types) => types
            .iter()
            .map(|kind| match kind.as_str() {
                "linear_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(ConfigError(format!(
                    "layer type `{other}` is not supported (linear_attention, full_attention)"
                ))),
            })
            .collect::<Result<Vec<bool>, _>>()?,
        None => every_nth_full(
            hf.num_hidden_layers,
            hf.full_attention_interval
                .unwrap_or(DEFAULT_FULL_ATTENTION_INTERVAL),
        ),
    };
    Ok(LinearAttention {
        layers,
        conv_kernel: need(hf.linear_conv_kernel_dim, "linear_conv_kernel_dim")?,
        key_heads: need(hf.linear_num_key_heads, "linear_num_key_heads")?,
        key_dim: need(hf.linear_key_head_dim, "linear_key_head_dim")?,
        value_heads: need(hf.linear_num_value_heads, "linear_num_value_heads")?,
        value_dim: need(hf.linear_value_head_dim, "linear_value_head_dim")?,
        order: ValueHeadOrder::Grouped,
    })
}

/// Layer `i` is full attention when `(i + 1) % interval == 0` (transformers'
/// and llama.cpp's default pattern).
pub fn every_nth_full(layers: usize, interval: usize) -> Vec<bool> {
    (0..layers)
        .map(|i| !(i + 1).is_multiple_of(interval.max(1)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_linear_layers_to_one_full() {
        assert_eq!(
            every_nth_full(8, 4),
            [true, true, true, false, true, true, true, false]
        );
    }
}
