//! The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral, and Mixtral (the
//! same decoder with a mixture of experts for the MLP, renormalised top-k).
//! Grouped-query attention, SwiGLU MLP, RMS norms, RoPE (plain, or linear, dynamic,
//! Llama 3 or YaRN scaling), embeddings optionally tied to the LM head.

use crate::formats::hf_dir::HfConfig;
use crate::ops::RopeStyle;

use super::config::{Architecture, ConfigError, ModelConfig, RopeScaling, Variant};

/// A model configuration from a Hugging Face `config.json` of this family.
pub fn config_from_hf(hf: &HfConfig) -> Result<ModelConfig, ConfigError> {
    require_silu(hf)?;
    let mut config = base_config(hf, Architecture::Llama)?;
    // Mixtral: softmax over the experts, top-k, weights renormalised.
    config.moe = super::moe::config_from_hf(hf, None, true)?;
    config.validate()?;
    Ok(config)
}

/// Refuses an activation other than silu for a SwiGLU family: another would
/// give other answers.
pub(crate) fn require_silu(hf: &HfConfig) -> Result<(), ConfigError> {
    match hf.hidden_act.as_deref() {
        None | Some("silu" | "swish") => Ok(()),
        Some(act) => Err(ConfigError(format!(
            "hidden_act `{act}` is not supported (this engine's MLP applies silu)"
        ))),
    }
}

/// Which layers attend over the window, from `layer_types`; a kind of
/// attention this engine lacks is refused by name.
fn sliding_layers(hf: &HfConfig, hybrid: bool) -> Result<Option<Vec<bool>>, ConfigError> {
    let Some(types) = &hf.layer_types else {
        return Ok(None);
    };
    if types.len() != hf.num_hidden_layers {
        return Err(ConfigError(format!(
            "layer_types names {} layers of {}",
            types.len(),
            hf.num_hidden_layers
        )));
    }
    types
        .iter()
        .map(|kind| match kind.as_str() {
            "full_attention" => Ok(false),
            "sliding_attention" => Ok(true),
            // The hybrid families read their linear layers themselves.
            "linear_attention" if hybrid => Ok(false),
            other => Err(ConfigError(format!(
                "layer type `{other}` is not supported (full_attention, sliding_attention)"
            ))),
        })
        .collect::<Result<Vec<bool>, _>>()
        .map(Some)
}

/// The dimensions of each head RoPE rotates: `partial_rotary_factor` (in
/// `rope_parameters` for transformers 5, else top level; `default` if
/// neither) of `head_dim`, rounded down to whole pairs as transformers does.
pub(crate) fn partial_rotary_dims(
    hf: &HfConfig,
    head_dim: usize,
    default: f64,
) -> Result<usize, ConfigError> {
    let factor = hf
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(serde_json::Value::as_f64)
        .or(hf.partial_rotary_factor)
        .unwrap_or(default);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(ConfigError(format!(
            "partial_rotary_factor {factor} must be in (0, 1]"
        )));
    }
    Ok(((head_dim as f64 * factor) as usize) & !1)
}

/// The fields every family here shares; each family adds its own on top.
pub(crate) fn base_config(
    hf: &HfConfig,
    architecture: Architecture,
) -> Result<ModelConfig, ConfigError> {
    let heads = hf.num_attention_heads;
    if heads == 0 {
        return Err(ConfigError("num_attention_heads is 0".into()));
    }
    let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / heads);
    let rope = hf.rope();
    let rope_scaling = rope_scaling(rope.scaling, hf.max_position_embeddings)
        .and_then(|scaling| with_original_context(scaling, hf))?;
    let config = ModelConfig {
        architecture,
        layers: hf.num_hidden_layers,
        hidden: hf.hidden_size,
        ffn: hf.intermediate_size,
        heads,
        kv_heads: hf.num_key_value_heads.unwrap_or(heads),
        head_dim,
        vocab: hf.vocab_size,
        context_length: stretched_context(
            hf.max_position_embeddings.unwrap_or(2048),
            &rope_scaling,
        ),
        norm_eps: hf.rms_norm_eps as f32,
        rope_theta: rope.theta.unwrap_or(10_000.0) as f32,
        // Hugging Face checkpoints rotate halves (`rotate_half`).
        rope_style: RopeStyle::Halves,
        rope_scaling,
        rotary_dims: head_dim,
        qkv_bias: hf.attention_bias.unwrap_or(false),
        qk_norm: false,
        tied_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        sliding_window: hf
            .effective_sliding_window()
            .map(|w| usize::try_from(w).unwrap_or(usize::MAX)),
        moe: None,
        variant: Variant {
            sliding_layers: sliding_layers(hf, architecture.is_hybrid())?,
            ..Variant::default()
        },
    };
    config.validate()?;
    Ok(config)
}

/// The context a Hugging Face config's model serves, from its JSON alone
/// (model cards are made before any weights are read): as
/// [`base_config`] sets it.
pub fn served_context(config: &serde_json::Value) -> Option<usize> {
    let max_position = usize::try_from(config.get("max_position_embeddings")?.as_u64()?).ok()?;
    let scaling = config
        .get("rope_parameters")
        .filter(|p| p.is_object())
        .or_else(|| config.get("rope_scaling"));
    let scaling = rope_scaling(scaling, Some(max_position)).unwrap_or(RopeScaling::None);
    Some(stretched_context(max_position, &scaling))
}

/// The context served: dynamic scaling stretches the trained one by its
/// factor (the length it was made for; other scalings give the stretched
/// length as `max_position_embeddings` already).
fn stretched_context(max_position: usize, scaling: &RopeScaling) -> usize {
    match scaling {
        RopeScaling::Dynamic { factor, .. } if *factor > 1.0 => {
            (max_position as f64 * *factor as f64) as usize
        }
        _ => max_position,
    }
}

/// LongRoPE's original context and default attention factor from the
/// config's top level (Phi-3 keeps `original_max_position_embeddings` there,
/// and the factor follows from the two contexts, as transformers computes).
fn with_original_context(scaling: RopeScaling, hf: &HfConfig) -> Result<RopeScaling, ConfigError> {
    let RopeScaling::LongRope {
        long,
        short,
        original_context,
        attention_factor,
    } = scaling
    else {
        return Ok(scaling);
    };
    let original = match original_context {
        0 => hf.original_max_position_embeddings.ok_or_else(|| {
            ConfigError("rope_scaling longrope needs original_max_position_embeddings".into())
        })?,
        known => known,
    };
    let context = hf.max_position_embeddings.unwrap_or(original);
    let attention_factor = if attention_factor > 0.0 {
        attention_factor
    } else {
        let factor = context as f32 / original.max(1) as f32;
        RopeScaling::longrope_default_attention_factor(factor, original)
    };
    Ok(RopeScaling::LongRope {
        long,
        short,
        original_context: original,
        attention_factor,
    })
}

pub(crate) fn rope_scaling(
    value: Option<&serde_json::Value>,
    max_position: Option<usize>,
) -> Result<RopeScaling, ConfigError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    if !value.is_object() {
        return Err(ConfigError(format!(
            "rope_scaling / rope_parameters must be an object, not {value}"
        )));
    }
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
        "dynamic" => Ok(RopeScaling::Dynamic {
            factor: number("factor", 1.0) as f32,
            original_context: max_position.ok_or_else(|| {
                ConfigError("rope_scaling dynamic needs max_position_embeddings".into())
            })?,
        }),
        "yarn" => yarn_scaling(value, max_position),
        "longrope" | "su" => longrope_scaling(value),
        other => Err(ConfigError(format!(
            "rope_scaling type `{other}` is not supported \
             (default, linear, dynamic, llama3, yarn, longrope)"
        ))),
    }
}

/// A number of `value`, or `default`.
fn number(value: &serde_json::Value, key: &str, default: f64) -> f64 {
    value.get(key).and_then(|v| v.as_f64()).unwrap_or(default)
}

/// YaRN's scaling (transformers' defaults where the object leaves them
/// out); DeepSeek's mscale and `truncate: false` are refused.
fn yarn_scaling(
    value: &serde_json::Value,
    max_position: Option<usize>,
) -> Result<RopeScaling, ConfigError> {
    if value.get("mscale").is_some() || value.get("mscale_all_dim").is_some() {
        // DeepSeek's variant of the attention factor.
        return Err(ConfigError(
            "rope_scaling yarn with mscale / mscale_all_dim is not supported".into(),
        ));
    }
    if value.get("truncate").and_then(|v| v.as_bool()) == Some(false) {
        return Err(ConfigError(
            "rope_scaling yarn with truncate false is not supported".into(),
        ));
    }
    let factor = number(value, "factor", 1.0) as f32;
    let original = value
        .get("original_max_position_embeddings")
        .and_then(|v| v.as_u64())
        .or(max_position.map(|m| m as u64))
        .ok_or_else(|| {
            ConfigError("rope_scaling yarn needs original_max_position_embeddings".into())
        })?;
    Ok(RopeScaling::Yarn {
        factor,
        original_context: original as usize,
        // transformers treats 0 (and absence) as the defaults.
        beta_fast: Some(number(value, "beta_fast", 32.0))
            .filter(|b| *b != 0.0)
            .unwrap_or(32.0) as f32,
        beta_slow: Some(number(value, "beta_slow", 1.0))
            .filter(|b| *b != 0.0)
            .unwrap_or(1.0) as f32,
        attention_factor: value
            .get("attention_factor")
            .and_then(|v| v.as_f64())
            .map_or(RopeScaling::yarn_default_attention_factor(factor), |a| {
                a as f32
            }),
    })
}

/// LongRoPE's (and Phi-3's "su") long and short factors.
fn longrope_scaling(value: &serde_json::Value) -> Result<RopeScaling, ConfigError> {
    let factors = |key: &str| -> Result<Vec<f32>, ConfigError> {
        value
            .get(key)
            .and_then(|v| v.as_array())
            .and_then(|a| a.iter().map(|f| f.as_f64().map(|f| f as f32)).collect())
            .ok_or_else(|| ConfigError(format!("rope_scaling longrope needs {key}")))
    };
    Ok(RopeScaling::LongRope {
        long: factors("long_factor")?,
        short: factors("short_factor")?,
        // Filled from the config's top level where the object lacks
        // them (`with_original_context`).
        original_context: value
            .get("original_max_position_embeddings")
            .and_then(|v| v.as_u64())
            .unwrap_or(0) as usize,
        attention_factor: value
            .get("attention_factor")
            .and_then(|v| v.as_f64())
            .map_or(0.0, |a| a as f32),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: serde_json::Value) -> Result<ModelConfig, ConfigError> {
        let mut json = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 4096,
        });
        if let (Some(json), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
            json.extend(extra.clone());
        }
        let hf: HfConfig = serde_json::from_value(json).map_err(|e| ConfigError(e.to_string()))?;
        config_from_hf(&hf)
    }

    /// transformers 5's layout: theta and scaling inside `rope_parameters`.
    #[test]
    fn rope_parameters_give_theta_and_scaling() -> Result<(), ConfigError> {
        let c = config(serde_json::json!({"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }}))?;
        assert_eq!(c.rope_theta, 500_000.0);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 8192,
            }
        );
        let plain = config(serde_json::json!({"rope_parameters": {
            "rope_type": "default", "rope_theta": 1000000.0,
        }}))?;
        assert_eq!(plain.rope_theta, 1_000_000.0);
        assert_eq!(plain.rope_scaling, RopeScaling::None);
        // The older layout still reads as before.
        let old = config(serde_json::json!({"rope_theta": 100000.0}))?;
        assert_eq!(old.rope_theta, 100_000.0);
        Ok(())
    }

    /// YaRN keeps the fastest frequencies, divides the slowest by the
    /// factor, and scales cos and sin by 0.1 ln(factor) + 1.
    #[test]
    fn yarn_blends_frequencies_and_scales_attention() -> Result<(), ConfigError> {
        let c = config(serde_json::json!({"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128,
        }}))?;
        let divisors = c.rope_freq_factors().unwrap_or_default();
        assert_eq!(divisors.len(), c.rotary_dims / 2);
        assert_eq!(divisors[0], 1.0);
        assert!((divisors[divisors.len() - 1] - 4.0).abs() < 1e-6);
        assert!(divisors.windows(2).all(|w| w[0] <= w[1]), "{divisors:?}");
        let expected = 0.1 * 4.0f32.ln() + 1.0;
        assert!((c.rope_attention_factor() - expected).abs() < 1e-6);
        let deepseek = config(serde_json::json!({"rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
        }}));
        assert!(deepseek.is_err());
        Ok(())
    }

    /// A type this engine lacks is a load error naming it, never ignored.
    #[test]
    fn an_unknown_rope_type_is_an_error() {
        let error = config(serde_json::json!({"rope_parameters": {
            "rope_type": "ntk-by-parts", "rope_theta": 10000.0, "factor": 2.0,
        }}));
        let message = error.err().map(|e| e.0).unwrap_or_default();
        assert!(message.contains("`ntk-by-parts`"), "{message}");
    }

    /// Dynamic NTK: the trained base up to max_position_embeddings, then
    /// theta (factor L / max - (factor - 1))^(d / (d - 2)); the context
    /// served is stretched by the factor.
    #[test]
    fn dynamic_rope_grows_the_base_beyond_the_trained_context() -> Result<(), ConfigError> {
        let c = config(serde_json::json!({
            "max_position_embeddings": 32,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        }))?;
        assert_eq!(c.context_length, 128);
        assert!(c.rope_depends_on_length());
        assert_eq!(c.rope_base_at(1), 10_000.0);
        assert_eq!(c.rope_base_at(32), 10_000.0);
        // head_dim 16: exponent 16 / 14; at L = 64, 4 * 2 - 3 = 5.
        let expected = 10_000.0 * 5f64.powf(16.0 / 14.0);
        assert!((c.rope_base_at(64) as f64 / expected - 1.0).abs() < 1e-5);
        assert!(c.rope_base_at(65) > c.rope_base_at(64));
        let json = serde_json::json!({"max_position_embeddings": 32,
            "rope_scaling": {"type": "dynamic", "factor": 4.0}});
        assert_eq!(served_context(&json), Some(128));
        let plain = serde_json::json!({"max_position_embeddings": 32});
        assert_eq!(served_context(&plain), Some(32));
        // A factor below 1 would shrink the base: refused.
        let shrink = config(serde_json::json!({
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 0.5},
        }));
        assert!(shrink.is_err());
        Ok(())
    }

    /// LongRoPE: the long factors for a sequence longer than the original
    /// context, the short ones otherwise; transformers' attention factor,
    /// from the stretch of the context.
    #[test]
    fn longrope_picks_its_factors_by_the_length() -> Result<(), ConfigError> {
        let longrope = |max_position: usize| {
            config(serde_json::json!({
                "max_position_embeddings": max_position,
                "original_max_position_embeddings": 64,
                "rope_parameters": {
                    "rope_type": "longrope", "rope_theta": 10000.0,
                    "long_factor": vec![4.0; 8], "short_factor": vec![1.5; 8],
                }
            }))
        };
        let stretched = longrope(4096)?;
        assert_eq!(stretched.longrope_factors_at(64), Some(&[1.5; 8][..]));
        assert_eq!(stretched.longrope_factors_at(65), Some(&[4.0; 8][..]));
        assert_eq!(stretched.rope_switch(), Some(64));
        assert!(stretched.rope_depends_on_length());
        assert_eq!(stretched.rope_freq_factors(), None);
        let factor = (1.0 + 64f32.ln() / 64f32.ln()).sqrt();
        assert!((stretched.rope_attention_factor() - factor).abs() < 1e-6);
        let original = longrope(64)?;
        assert_eq!(original.longrope_factors_at(64), Some(&[1.5; 8][..]));
        assert_eq!(original.rope_attention_factor(), 1.0);
        // Factors that do not cover the rotary pairs are refused.
        let short = config(serde_json::json!({
            "original_max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                "long_factor": [1.0], "short_factor": [1.0]}
        }));
        assert!(short.is_err());
        Ok(())
    }

    /// The MLP applies silu (transformers' `silu`, alias `swish`); another
    /// activation is refused by name, never run as silu.
    #[test]
    fn an_activation_other_than_silu_is_refused() {
        assert!(config(serde_json::json!({"hidden_act": "silu"})).is_ok());
        assert!(config(serde_json::json!({"hidden_act": "swish"})).is_ok());
        let error = config(serde_json::json!({"hidden_act": "gelu_pytorch_tanh"}));
        let message = error.err().map(|e| e.0).unwrap_or_default();
        assert!(
            message.contains("hidden_act `gelu_pytorch_tanh`"),
            "{message}"
        );
    }

    /// A window shorter than the context limits attention; switched off,
    /// or as long as the context, it is full attention.
    #[test]
    fn a_sliding_window_applies_unless_it_is_full_attention() -> Result<(), ConfigError> {
        let window = |extra| config(extra).map(|c| c.sliding_window);
        assert_eq!(
            window(serde_json::json!({"sliding_window": 1024}))?,
            Some(1024)
        );
        let off = serde_json::json!({"sliding_window": 1024, "use_sliding_window": false});
        assert_eq!(window(off)?, None);
        assert_eq!(window(serde_json::json!({"sliding_window": 4096}))?, None);
        assert_eq!(window(serde_json::json!({"sliding_window": null}))?, None);
        Ok(())
    }
}
