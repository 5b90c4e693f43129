//! OLMo 2: the Llama decoder with its norms moved after the blocks
//! (`x += norm(attn(x))`, `x += norm(mlp(x))`, none before) and q and k
//! each normed across all their heads at once (a tensor-parallel rank sums
//! its heads' squares with the others' before it divides).

use crate::formats::hf_dir::HfConfig;

use super::config::{Architecture, ConfigError, ModelConfig};
use super::llama::{base_config, require_silu};

/// A model configuration from an OLMo 2 `config.json`.
pub fn config_from_hf(hf: &HfConfig) -> Result<ModelConfig, ConfigError> {
    require_silu(hf)?;
    let mut config = base_config(hf, Architecture::Olmo2)?;
    apply(&mut config);
    config.validate()?;
    Ok(config)
}

/// OLMo 2's departures, the same from either file format.
pub fn apply(config: &mut ModelConfig) {
    config.qk_norm = true;
    config.variant.no_pre_norms = true;
    config.variant.post_norms = true;
    config.variant.qk_norm_whole = true;
}
