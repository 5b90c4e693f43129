//! A Hugging Face folder as a [`TensorSource`]: canonical (GGUF) tensor names
//! mapped to the checkpoint's names, f32/f16/bf16 loaded as f32 matrices.

use std::ops::Range;
use std::path::Path;

use crate::formats::hf_dir::{HfDirError, HfModelDir};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::weights::{LoadError, Matrix, TensorSource};
use crate::model::{gemma, llama, olmo2, phi3, qwen, qwen35, smollm3};
use crate::quant::QMatrix;

pub struct HfSource {
    dir: HfModelDir,
    display: String,
}

impl HfSource {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let display = path.display().to_string();
        let dir = HfModelDir::open(path).map_err(|e| LoadError::Format {
            path: display.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self { dir, display })
    }

    pub fn dir(&self) -> &HfModelDir {
        &self.dir
    }

    pub fn config(&self) -> Result<ModelConfig, LoadError> {
        let hf = self.dir.config();
        let architecture = Architecture::from_name(&hf.model_type).ok_or_else(|| {
            LoadError::UnsupportedArchitecture {
                path: self.display.clone(),
                name: hf.model_type.clone(),
            }
        })?;
        let config = match architecture {
            Architecture::Llama => llama::config_from_hf(hf),
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                qwen::config_from_hf(hf, architecture)
            }
            Architecture::Phi3 => phi3::config_from_hf(hf),
            Architecture::SmolLm3 => smollm3::config_from_hf(hf),
            Architecture::Olmo2 => olmo2::config_from_hf(hf),
            Architecture::Gemma2 | Architecture::Gemma3 => gemma::config_from_hf(hf, architecture),
            Architecture::Qwen35 | Architecture::Qwen35Moe | Architecture::Qwen3Next => {
                qwen35::config_from_hf(hf, architecture)
            }
        };
        config.map_err(|source| LoadError::Config {
            path: self.display.clone(),
            source,
        })
    }

    fn error(&self, name: &str, error: HfDirError) -> LoadError {
        LoadError::Tensor {
            path: self.display.clone(),
            tensor: name.to_string(),
            reason: error.to_string(),
        }
    }
}

/// The checkpoint's names for a canonical tensor name, most likely first
/// (families name the same tensor differently: Mixtral's experts are
/// `block_sparse_moe.experts.{e}.w1`, Qwen3-MoE's `mlp.experts.{e}.gate_proj`).
pub fn hf_names(canonical: &str) -> Vec<String> {
    let fixed = match canonical {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return vec![name.to_string()];
    }
    let Some((layer, part)) = canonical
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
    else {
        return Vec::new();
    };
    let in_layer = |parts: &[&str]| -> Vec<String> {
        parts
            .iter()
            .map(|p| format!("model.layers.{layer}.{p}"))
            .collect()
    };
    if let Some(names) = expert_names(part) {
        return Vec::from(names.map(|p| format!("model.layers.{layer}.{p}")));
    }
    let part = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        // Gemma norms before the MLP and after attention; Llama has only
        // the first, under the second's name.
        "ffn_norm.weight" => {
            return in_layer(&[
                "pre_feedforward_layernorm.weight",
                "post_attention_layernorm.weight",
            ])
        }
        "post_attention_norm.weight" => "post_attention_layernorm.weight",
        "post_ffw_norm.weight" => "post_feedforward_layernorm.weight",
        // Phi-3's fused attention, or a Gated DeltaNet's q, k and v.
        "attn_qkv.weight" => {
            return in_layer(&[
                "self_attn.qkv_proj.weight",
                "linear_attn.in_proj_qkv.weight",
            ])
        }
        "attn_gate.weight" => "linear_attn.in_proj_z.weight",
        "ssm_beta.weight" => "linear_attn.in_proj_b.weight",
        "ssm_alpha.weight" => "linear_attn.in_proj_a.weight",
        "ssm_ba.weight" => "linear_attn.in_proj_ba.weight",
        // GGUF's `-exp(A_log)`: HfSource::vector converts.
        "ssm_a" => "linear_attn.A_log",
        "ssm_dt.bias" => "linear_attn.dt_bias",
        "ssm_conv1d.weight" => "linear_attn.conv1d.weight",
        "ssm_norm.weight" => "linear_attn.norm.weight",
        "ssm_out.weight" => "linear_attn.out_proj.weight",
        "ffn_gate_shexp.weight" => "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight" => "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight" => "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight" => "mlp.shared_expert_gate.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_output.bias" => "self_attn.o_proj.bias",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        // Phi-3's gate and up in one (the loader tells them by the shape).
        "ffn_up.weight" => return in_layer(&["mlp.up_proj.weight", "mlp.gate_up_proj.weight"]),
        "ffn_down.weight" => "mlp.down_proj.weight",
        "ffn_gate.bias" => "mlp.gate_proj.bias",
        "ffn_up.bias" => "mlp.up_proj.bias",
        "ffn_down.bias" => "mlp.down_proj.bias",
        "ffn_gate_inp.weight" => {
            return in_layer(&["mlp.gate.weight", "block_sparse_moe.gate.weight"])
        }
        _ => return Vec::new(),
    };
    in_layer(&[part])
}

/// `ffn_gate.{e}.weight` and its kin: expert `e`'s projections, as
/// Qwen3-MoE and Mixtral name them (layer-relative).
fn expert_names(part: &str) -> Option<[String; 2]> {
    let (kind, rest) = part.split_once('.')?;
    let expert: usize = rest.strip_suffix(".weight")?.parse().ok()?;
    let (qwen, mixtral) = match kind {
        "ffn_gate" => ("gate_proj", "w1"),
        "ffn_up" => ("up_proj", "w3"),
        "ffn_down" => ("down_proj", "w2"),
        _ => return None,
    };
    Some([
        format!("mlp.experts.{expert}.{qwen}.weight"),
        format!("block_sparse_moe.experts.{expert}.{mixtral}.weight"),
    ])
}

impl HfSource {
    /// Whether the checkpoint stores its RMS norms' weights as offsets from
    /// 1 (Gemma, the hybrid Qwens but for their gated norm).
    fn norms_are_offsets(&self) -> bool {
        matches!(
            Architecture::from_name(&self.dir.config().model_type),
            Some(
                Architecture::Gemma2
                    | Architecture::Gemma3
                    | Architecture::Qwen35
                    | Architecture::Qwen35Moe
                    | Architecture::Qwen3Next
            )
        )
    }

    /// Qwen3-Next's q, k, v and z in one tensor, interleaved per key head
    /// (`[q, k, v, z]` of each): the tensor and the rows of it that make up
    /// GGUF's `attn_qkv` (all q, all k, all v) or `attn_gate` (all z).
    fn fused_qkvz(&self, canonical: &str) -> Option<(String, Vec<usize>)> {
        let (layer, part) = canonical.strip_prefix("blk.")?.split_once('.')?;
        let gate = match part {
            "attn_qkv.weight" => false,
            "attn_gate.weight" => true,
            _ => return None,
        };
        let name = format!("model.layers.{layer}.linear_attn.in_proj_qkvz.weight");
        if !self.dir.contains(&name) {
            return None;
        }
        let hf = self.dir.config();
        let (nk, dk) = (hf.linear_num_key_heads?, hf.linear_key_head_dim?);
        let (nv, dv) = (hf.linear_num_value_heads?, hf.linear_value_head_dim?);
        let group = nv.checked_div(nk)? * dv;
        let block = 2 * dk + 2 * group;
        let section = |offset: usize, width: usize| {
            (0..nk).flat_map(move |k| k * block + offset..k * block + offset + width)
        };
        let rows: Vec<usize> = if gate {
            section(2 * dk + group, group).collect()
        } else {
            section(0, dk)
                .chain(section(dk, dk))
                .chain(section(2 * dk, group))
                .collect()
        };
        Some((name, rows))
    }

    /// transformers 5's fused experts (the Qwen3.5-MoE releases): a layer's
    /// `mlp.experts.gate_up_proj` `[experts, 2 * ffn, hidden]` (each
    /// expert's gate rows, then its up rows) and `mlp.experts.down_proj`
    /// `[experts, hidden, ffn]`. For expert `e`'s canonical gate, up or
    /// down: the tensor, the rows of it (seen as a matrix as wide as its
    /// last dimension) that make up that matrix, and its width.
    fn fused_expert(&self, canonical: &str) -> Option<(String, Range<usize>, usize)> {
        let (layer, part) = canonical.strip_prefix("blk.")?.split_once('.')?;
        let (kind, rest) = part.split_once('.')?;
        let expert: usize = rest.strip_suffix(".weight")?.parse().ok()?;
        let fused = match kind {
            "ffn_gate" | "ffn_up" => "gate_up_proj",
            "ffn_down" => "down_proj",
            _ => return None,
        };
        let name = format!("model.layers.{layer}.mlp.experts.{fused}");
        let shape = self.dir.shape(&name).ok()?;
        let &[experts, rows, cols] = shape.as_slice() else {
            return None;
        };
        if expert >= experts {
            return None;
        }
        let first = expert * rows;
        let window = match kind {
            "ffn_gate" => first..first + rows / 2,
            "ffn_up" => first + rows / 2..first + rows / 2 * 2,
            _ => first..first + rows,
        };
        Some((name, window, cols))
    }

    /// Rows `rows` and columns `cols` (`None`: all) of the matrix that rows
    /// `window` of `hf` make up (a [`HfSource::fused_expert`]).
    fn windowed(
        &self,
        hf: &str,
        window: Range<usize>,
        width: usize,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError> {
        let rows = rows.unwrap_or(0..window.len());
        let cols = cols.unwrap_or(0..width);
        if rows.end > window.len() || rows.is_empty() || cols.is_empty() {
            return Err(self.bad(
                hf,
                format!("rows {rows:?} or columns {cols:?} out of range"),
            ));
        }
        let values = self
            .dir
            .load_f32_window(
                hf,
                window.start + rows.start..window.start + rows.end,
                cols.clone(),
            )
            .map_err(|e| self.error(hf, e))?;
        QMatrix::from_f32(rows.len(), cols.len(), &values)
            .map(Matrix::Native)
            .map_err(|e| self.bad(hf, e.to_string()))
    }

    /// Rows `rows` of a [`HfSource::fused_qkvz`] tensor (all of them for
    /// `None`), columns `cols`.
    fn gathered_rows(
        &self,
        hf: &str,
        order: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError> {
        let shape = self.dir.shape(hf).map_err(|e| self.error(hf, e))?;
        let [total, width] = shape[..] else {
            return Err(self.bad(hf, format!("expected a matrix, found shape {shape:?}")));
        };
        let wanted = rows.unwrap_or(0..order.len());
        let cols = cols.unwrap_or(0..width);
        if wanted.end > order.len() || cols.end > width || cols.is_empty() {
            return Err(self.bad(
                hf,
                format!("rows {wanted:?} or columns {cols:?} out of range"),
            ));
        }
        let all = self
            .dir
            .load_f32_rows(hf, 0, total)
            .map_err(|e| self.error(hf, e))?;
        let mut values = Vec::with_capacity(wanted.len() * cols.len());
        for &row in &order[wanted.clone()] {
            values.extend_from_slice(&all[row * width + cols.start..row * width + cols.end]);
        }
        QMatrix::from_f32(wanted.len(), cols.len(), &values)
            .map(Matrix::Native)
            .map_err(|e| self.bad(hf, e.to_string()))
    }

    fn bad(&self, tensor: &str, reason: String) -> LoadError {
        LoadError::Tensor {
            path: self.display.clone(),
            tensor: tensor.to_string(),
            reason,
        }
    }

    /// The checkpoint's name for `canonical`: the first candidate it holds.
    fn resolve(&self, canonical: &str) -> Result<String, LoadError> {
        let names = hf_names(canonical);
        names
            .iter()
            .find(|name| self.dir.contains(name))
            .or(names.first())
            .cloned()
            .ok_or_else(|| LoadError::MissingTensor {
                path: self.display.clone(),
                tensor: canonical.to_string(),
            })
    }
}

impl TensorSource for HfSource {
    fn path(&self) -> &str {
        &self.display
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if let Some((_, window, width)) = self.fused_expert(name) {
            return Some(vec![window.len(), width]);
        }
        if let Some((hf, rows)) = self.fused_qkvz(name) {
            let width = self.dir.shape(&hf).ok()?.get(1).copied()?;
            return Some(vec![rows.len(), width]);
        }
        let hf = self.resolve(name).ok()?;
        self.dir.shape(&hf).ok()
    }

    fn matrix_part(
        &self,
        name: &str,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError> {
        if let Some((hf, order)) = self.fused_qkvz(name) {
            return self.gathered_rows(&hf, &order, rows, cols);
        }
        if let Some((hf, window, width)) = self.fused_expert(name) {
            return self.windowed(&hf, window, width, rows, cols);
        }
        let hf = self.resolve(name)?;
        let shape = self.dir.shape(&hf).map_err(|e| self.error(&hf, e))?;
        let [total, total_cols] = shape[..] else {
            return Err(LoadError::Tensor {
                path: self.display.clone(),
                tensor: hf,
                reason: format!("expected a matrix, found shape {shape:?}"),
            });
        };
        let range = rows.unwrap_or(0..total);
        let (values, width) = match cols {
            None => (
                self.dir
                    .load_f32_rows(&hf, range.start, range.end)
                    .map_err(|e| self.error(&hf, e))?,
                total_cols,
            ),
            Some(cols) => {
                let all = self
                    .dir
                    .load_f32_cols(&hf, cols.start, cols.end)
                    .map_err(|e| self.error(&hf, e))?;
                if range.end > total || range.start >= range.end {
                    return Err(LoadError::Tensor {
                        path: self.display.clone(),
                        tensor: hf,
                        reason: format!("rows {range:?} out of 0..{total}"),
                    });
                }
                let width = cols.len();
                (all[range.start * width..range.end * width].to_vec(), width)
            }
        };
        QMatrix::from_f32(range.len(), width, &values)
            .map(Matrix::Native)
            .map_err(|e| LoadError::Tensor {
                path: self.display.clone(),
                tensor: hf,
                reason: e.to_string(),
            })
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let hf = self.resolve(name)?;
        let mut values = self.dir.load_f32(&hf).map_err(|e| self.error(&hf, e))?;
        if name.ends_with(".ssm_a") {
            // GGUF (and the forward pass) hold the decay rate, -exp(A_log).
            for value in &mut values {
                *value = -value.exp();
            }
        }
        let gated_norm = name.ends_with("ssm_norm.weight");
        if name.ends_with("norm.weight") && !gated_norm && self.norms_are_offsets() {
            // Gemma scales by 1 + w; GGUF files (and the forward pass) hold
            // the sum.
            for value in &mut values {
                *value += 1.0;
            }
        }
        Ok(values)
    }
}
