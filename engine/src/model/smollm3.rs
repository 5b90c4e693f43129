//! SmolLM3: the Llama decoder where some layers do not rotate q and k
//! (NoPE): `no_rope_layers` lists 1 for a layer with RoPE and 0 for one
//! without (every fourth by default). llama.cpp's `smollm3` fixes the
//! interval at 4, which is what its GGUF files mean.

use crate::formats::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, ModelConfig};
use super::llama::{base_config, require_silu};

/// llama.cpp's fixed NoPE interval for `smollm3` GGUF files.
pub const GGUF_NO_ROPE_INTERVAL: usize = 4;

/// A model configuration from a SmolLM3 `config.json`.
pub fn config_from_hf(hf: &HfConfig) -> Result<ModelConfig, ConfigError> {
    require_silu(hf)?;
    let mut config = base_config(hf, Architecture::SmolLm3)?;
    config.variant.rope_layers = Some(match &hf.no_rope_layers {
        Some(flags) => flags.iter().map(|&f| f != 0).collect(),
        None => every_fourth_without_rope(config.layers),
    });
    config.validate()?;
    Ok(config)
}

/// Layers 3, 7, 11, ... without RoPE, the others with it.
pub fn every_fourth_without_rope(layers: usize) -> Vec<bool> {
    (0..layers)
        .map(|layer| !(layer + 1).is_multiple_of(GGUF_NO_ROPE_INTERVAL))
        .collect()
}
