//! Reading one shard's weights.

use std::ops::Range;

use crate::dist::shard::{ShardError, ShardSpec};
use crate::model::config::ModelConfig;
use crate::model::deltanet::{GatedDeltaNet, LinearSplit};
use crate::model::moe::Experts;
use crate::model::weights::{LoadError, Matrix, TensorSource};

use super::split::{HeadLayout, TensorLayout, TensorSplit};
use super::{Attention, Layer, Mixer, Mlp, TensorSlice, Transformer};

impl Transformer {
    /// Loads layers `layers` (and embeddings/head as the stage needs).
    pub fn load(
        source: &dyn TensorSource,
        config: ModelConfig,
        layers: Range<usize>,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let spec = ShardSpec::Pipeline {
            start_layer: layers.start as u32,
            end_layer: layers.end as u32,
            n_layers: config.layers as u32,
        };
        Self::load_shard(source, config, &spec, progress)
    }

    /// Loads the part of the model `spec` names, reading only its tensors
    /// (and, for tensor parallelism, only its rows or columns of them).
    pub fn load_shard(
        source: &dyn TensorSource,
        config: ModelConfig,
        spec: &ShardSpec,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let shard_error = |e: ShardError| LoadError::Tensor {
            path: source.path().to_string(),
            tensor: "(shard)".into(),
            reason: e.to_string(),
        };
        spec.validate(config.layers as u32).map_err(shard_error)?;
        let range = spec.layers(config.layers as u32);
        let layers = range.start as usize..range.end as usize;
        let first = layers.start == 0;
        let total = layers.len() + 2;
        let (split, layout) = tensor_split(source, &config, spec).map_err(shard_error)?;
        let rows = ShardRows::of(&config, split.as_ref());
        // A pipeline's first stage runs the head too: tied, it is the
        // embeddings (see `ForwardOutput::Normed`).
        let embeddings = if first {
            let shape = [config.vocab, config.hidden];
            Some(load_part(source, "token_embd.weight", shape, None, None)?)
        } else {
            None
        };
        progress(1, total);
        let mut loaded = Vec::with_capacity(layers.len());
        let mut counts = MixerCounts::default();
        for i in layers.clone() {
            loaded.push(load_layer(
                source,
                &config,
                i,
                split.as_ref(),
                &rows,
                &mut counts,
            )?);
            progress(2 + i - layers.start, total);
        }
        let tensor_parts = split.as_ref().zip(layout);
        let (final_norm, output, tensor) = load_ends(source, &config, &layers, tensor_parts)?;
        progress(total, total);
        let rope_freq_factors = match source.shape("rope_freqs.weight") {
            Some(_) => Some(source.vector("rope_freqs.weight")?),
            None => config.rope_freq_factors(),
        };
        let (config, heads) = narrowed(config, split.as_ref());
        Ok(Self {
            config,
            layer_range: layers,
            embeddings,
            kv_layers: counts.kv_layers,
            state_len: counts.state_len,
            gpu: None,
            layers: loaded,
            final_norm,
            output,
            rope_freq_factors,
            tensor,
            heads,
        })
    }
}

/// A tensor-parallel rank's split of the model and every rank's layout;
/// none for a pipeline stage.
fn tensor_split(
    source: &dyn TensorSource,
    config: &ModelConfig,
    spec: &ShardSpec,
) -> Result<(Option<TensorSplit>, Option<TensorLayout>), ShardError> {
    let ShardSpec::Tensor { rank, world_size } = *spec else {
        return Ok((None, None));
    };
    let down = source.column_block("blk.0.ffn_down.weight");
    let expert_down = source.column_block("blk.0.ffn_down.0.weight");
    let split = TensorSplit::new(config, rank, world_size, down, expert_down)?;
    let layout = TensorLayout::new(config, world_size, down, expert_down)?;
    Ok((Some(split), Some(layout)))
}

/// How many layers so far keep keys and values, and how much recurrent
/// state the linear-attention layers so far take.
#[derive(Default)]
struct MixerCounts {
    kv_layers: usize,
    state_len: usize,
}

/// Layer `i`: its mixer (attention, or a linear-attention net), its MLP
/// and its norms.
fn load_layer(
    source: &dyn TensorSource,
    config: &ModelConfig,
    i: usize,
    split: Option<&TensorSplit>,
    rows: &ShardRows,
    counts: &mut MixerCounts,
) -> Result<Layer, LoadError> {
    let h = config.hidden;
    let n = |part: &str| format!("blk.{i}.{part}");
    let mixer = match config.variant.linear.as_ref().filter(|l| l.is_linear(i)) {
        Some(linear) => {
            let heads = match split {
                Some(s) => LinearSplit::for_key_heads(linear, s.linear_keys.clone()),
                None => LinearSplit::whole(linear),
            };
            let eps = config.norm_eps;
            let hidden_rows = rows.hidden.clone();
            let net = GatedDeltaNet::load(source, i, linear, h, eps, &heads, hidden_rows)?;
            let state_offset = counts.state_len;
            counts.state_len += net.state_len();
            Mixer::Linear { net, state_offset }
        }
        None => {
            counts.kv_layers += 1;
            Mixer::Attention(load_attention(
                source,
                config,
                i,
                counts.kv_layers - 1,
                rows,
            )?)
        }
    };
    let (pre, post) = (!config.variant.no_pre_norms, config.variant.post_norms);
    // The hybrid families' GGUFs name the norm before the MLP as Hugging
    // Face does.
    let ffn_norm = if config.variant.linear.is_some() {
        "post_attention_norm.weight"
    } else {
        "ffn_norm.weight"
    };
    Ok(Layer {
        attn_norm: optional(source, &n("attn_norm.weight"), h, pre)?,
        attn_post_norm: optional(source, &n("post_attention_norm.weight"), h, post)?,
        ffn_post_norm: optional(source, &n("post_ffw_norm.weight"), h, post)?,
        ffn_norm: optional(source, &n(ffn_norm), h, pre)?,
        mixer,
        mlp: load_mlp(source, config, i, rows)?,
    })
}

/// What follows the layers: the final norm, the output matrix, a tensor
/// rank's slice of the head.
type Ends = (Option<Vec<f32>>, Option<Matrix>, Option<TensorSlice>);

/// The final norm, the output matrix and, on a tensor rank, its slice of
/// the head: what the last stage (and a tensor rank, which has every
/// layer) needs after the layers.
fn load_ends(
    source: &dyn TensorSource,
    config: &ModelConfig,
    layers: &Range<usize>,
    tensor: Option<(&TensorSplit, TensorLayout)>,
) -> Result<Ends, LoadError> {
    let h = config.hidden;
    let (first, last) = (layers.start == 0, layers.end == config.layers);
    if let Some((split, layout)) = tensor {
        let head_name = if config.tied_embeddings {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let rows = Some(split.vocab_rows.clone());
        let slice = TensorSlice {
            layout,
            vocab_counts: split.vocab_counts.clone(),
            head: load_part(source, head_name, [config.vocab, h], rows, None)?,
        };
        return Ok((
            Some(load_vector(source, "output_norm.weight", h)?),
            None,
            Some(slice),
        ));
    }
    let norm = if last {
        Some(load_vector(source, "output_norm.weight", h)?)
    } else {
        None
    };
    let output = if first && !config.tied_embeddings {
        Some(load_part(
            source,
            "output.weight",
            [config.vocab, h],
            None,
            None,
        )?)
    } else {
        None
    };
    Ok((norm, output, None))
}

/// The configuration as a tensor rank sees it (its heads and rows only),
/// and where its heads sit among the whole model's.
fn narrowed(mut config: ModelConfig, split: Option<&TensorSplit>) -> (ModelConfig, HeadLayout) {
    let heads = HeadLayout {
        group: config.heads / config.kv_heads.max(1),
        q_first: split.map_or(0, |s| s.q_rows.start / config.head_dim),
        kv_first: split.map_or(0, |s| s.kv_rows.start / config.head_dim),
    };
    if let Some(split) = split {
        config.heads = split.q_rows.len() / config.head_dim;
        config.kv_heads = split.kv_rows.len() / config.head_dim;
        config.ffn = split.ffn_rows.len();
        if let Some(moe) = &mut config.moe {
            moe.expert_ffn = split.expert_rows.len();
            moe.shared_ffn = moe.shared_ffn.map(|_| split.shared_rows.len());
        }
    }
    (config, heads)
}

impl ShardRows {
    /// The rows of `split` (all of them without one).
    fn of(config: &ModelConfig, split: Option<&TensorSplit>) -> Self {
        let (q, kv, f) = (config.q_dim(), config.kv_dim(), config.ffn);
        ShardRows {
            q: split.map_or(0..q, |s| s.q_rows.clone()),
            kv: split.map_or(0..kv, |s| s.kv_rows.clone()),
            ffn: split.map_or(0..f, |s| s.ffn_rows.clone()),
            expert: match (split, &config.moe) {
                (Some(s), _) => s.expert_rows.clone(),
                (None, Some(moe)) => 0..moe.expert_ffn,
                (None, None) => 0..0,
            },
            shared: match (split, config.moe.as_ref().and_then(|m| m.shared_ffn)) {
                (Some(s), _) => s.shared_rows.clone(),
                (None, Some(rows)) => 0..rows,
                (None, None) => 0..0,
            },
            hidden: split.map(|s| s.hidden_rows.clone()),
        }
    }
}

/// The rows a shard owns of each split dimension (all of them unless
/// `sliced`, a tensor-parallel rank).
struct ShardRows {
    q: Range<usize>,
    kv: Range<usize>,
    ffn: Range<usize>,
    expert: Range<usize>,
    shared: Range<usize>,
    /// A tensor rank's rows of the output projections (whole columns).
    hidden: Option<Range<usize>>,
}

fn load_part(
    source: &dyn TensorSource,
    name: &str,
    shape: [usize; 2],
    rows: Option<Range<usize>>,
    cols: Option<Range<usize>>,
) -> Result<Matrix, LoadError> {
    source.expect_shape(name, &shape)?;
    source.matrix_part(name, rows, cols)
}

fn load_vector(source: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    source.expect_shape(name, &[len])?;
    source.vector(name)
}

/// `rows` of a vector, if the family has it.
fn sliced_vector(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
    rows: &Range<usize>,
    wanted: bool,
) -> Result<Option<Vec<f32>>, LoadError> {
    if wanted {
        load_vector(source, name, len).map(|v| Some(v[rows.clone()].to_vec()))
    } else {
        Ok(None)
    }
}

fn optional(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
    wanted: bool,
) -> Result<Option<Vec<f32>>, LoadError> {
    if wanted {
        load_vector(source, name, len).map(Some)
    } else {
        Ok(None)
    }
}

/// Biases llama.cpp also loads when the file has them (o_proj and the
/// MLP's): present means used, never silently dropped.
fn if_present(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
    rows: Range<usize>,
) -> Result<Option<Vec<f32>>, LoadError> {
    if source.contains(name) {
        load_vector(source, name, len).map(|v| Some(v[rows].to_vec()))
    } else {
        Ok(None)
    }
}

fn shifted(r: &Range<usize>, by: usize) -> Range<usize> {
    r.start + by..r.end + by
}

/// Layer `i`'s attention, this shard's heads of it.
fn load_attention(
    source: &dyn TensorSource,
    config: &ModelConfig,
    i: usize,
    kv_layer: usize,
    rows: &ShardRows,
) -> Result<Attention, LoadError> {
    let n = |part: &str| format!("blk.{i}.{part}");
    let (h, q, kv) = (config.hidden, config.q_dim(), config.kv_dim());
    let (q_rows, kv_rows) = (&rows.q, &rows.kv);
    let part = |name: &str, shape, rows, cols| load_part(source, name, shape, rows, cols);
    let output_gate = config.variant.attn_output_gate;
    // Fused projections (one tensor for q, k and v) are split section by
    // section.
    let (wq, wk, wv) =
        if !source.contains(&n("attn_q.weight")) && source.contains(&n("attn_qkv.weight")) {
            let fused = n("attn_qkv.weight");
            let shape = [q + 2 * kv, h];
            (
                part(&fused, shape, Some(q_rows.clone()), None)?,
                part(&fused, shape, Some(shifted(kv_rows, q)), None)?,
                part(&fused, shape, Some(shifted(kv_rows, q + kv)), None)?,
            )
        } else {
            // A gated head's rows are its q's then its gate's.
            let (q_shape, q_part) = if output_gate {
                ([2 * q, h], 2 * q_rows.start..2 * q_rows.end)
            } else {
                ([q, h], q_rows.clone())
            };
            (
                part(&n("attn_q.weight"), q_shape, Some(q_part), None)?,
                part(&n("attn_k.weight"), [kv, h], Some(kv_rows.clone()), None)?,
                part(&n("attn_v.weight"), [kv, h], Some(kv_rows.clone()), None)?,
            )
        };
    let whole = config.variant.qk_norm_whole;
    let (q_norm, k_norm) = if whole {
        (
            sliced_vector(source, &n("attn_q_norm.weight"), q, q_rows, config.qk_norm)?,
            sliced_vector(
                source,
                &n("attn_k_norm.weight"),
                kv,
                kv_rows,
                config.qk_norm,
            )?,
        )
    } else {
        let hd = config.head_dim;
        (
            optional(source, &n("attn_q_norm.weight"), hd, config.qk_norm)?,
            optional(source, &n("attn_k_norm.weight"), hd, config.qk_norm)?,
        )
    };
    Ok(Attention {
        kv_layer,
        window: config.layer_window(i),
        rope: config.layer_rope(i),
        qk_norm_widths: (whole && config.qk_norm).then_some((q, kv)),
        wq,
        wk,
        wv,
        wo: part(&n("attn_output.weight"), [h, q], rows.hidden.clone(), None)?,
        q_bias: sliced_vector(source, &n("attn_q.bias"), q, q_rows, config.qkv_bias)?,
        k_bias: sliced_vector(source, &n("attn_k.bias"), kv, kv_rows, config.qkv_bias)?,
        v_bias: sliced_vector(source, &n("attn_v.bias"), kv, kv_rows, config.qkv_bias)?,
        o_bias: if_present(source, &n("attn_output.bias"), h, 0..h)?,
        q_norm,
        k_norm,
        output_gate,
    })
}

/// Layer `i`'s MLP: experts where the file has a router, else dense (gate
/// and up fused in one tensor for Phi-3).
fn load_mlp(
    source: &dyn TensorSource,
    config: &ModelConfig,
    i: usize,
    rows: &ShardRows,
) -> Result<Mlp, LoadError> {
    let n = |part: &str| format!("blk.{i}.{part}");
    let (h, f) = (config.hidden, config.ffn);
    let part = |name: &str, shape, rows, cols| load_part(source, name, shape, rows, cols);
    if let Some(moe) = config
        .moe
        .as_ref()
        .filter(|_| source.contains(&n("ffn_gate_inp.weight")))
    {
        let expert_rows = [&rows.expert, &rows.shared];
        let experts = Experts::load(source, i, moe, h, expert_rows, rows.hidden.clone())?;
        return Ok(Mlp::Experts(experts));
    }
    let ffn_rows = &rows.ffn;
    let fused_gate_up = !source.contains(&n("ffn_gate.weight"))
        && source.shape(&n("ffn_up.weight")) == Some(vec![2 * f, h]);
    let (w_gate, w_up, gate_bias, up_bias) = if fused_gate_up {
        let fused = n("ffn_up.weight");
        let shape = [2 * f, h];
        let bias = n("ffn_up.bias");
        (
            part(&fused, shape, Some(ffn_rows.clone()), None)?,
            part(&fused, shape, Some(shifted(ffn_rows, f)), None)?,
            if_present(source, &bias, 2 * f, ffn_rows.clone())?,
            if_present(source, &bias, 2 * f, shifted(ffn_rows, f))?,
        )
    } else {
        (
            part(&n("ffn_gate.weight"), [f, h], Some(ffn_rows.clone()), None)?,
            part(&n("ffn_up.weight"), [f, h], Some(ffn_rows.clone()), None)?,
            if_present(source, &n("ffn_gate.bias"), f, ffn_rows.clone())?,
            if_present(source, &n("ffn_up.bias"), f, ffn_rows.clone())?,
        )
    };
    Ok(Mlp::Dense {
        w_gate,
        w_up,
        w_down: part(&n("ffn_down.weight"), [h, f], rows.hidden.clone(), None)?,
        gate_bias,
        up_bias,
        down_bias: if_present(source, &n("ffn_down.bias"), h, 0..h)?,
    })
}
