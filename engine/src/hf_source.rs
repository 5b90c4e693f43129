//! A Hugging Face folder as a [`TensorSource`]: canonical (GGUF) tensor names
//! mapped to the checkpoint's names, f32/f16/bf16 loaded as f32 matrices.

use std::ops::Range;
use std::path::Path;

use crate::hf_dir::{HfDirError, HfModelDir};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::weights::{LoadError, Matrix, TensorSource};
use crate::model::{llama, qwen};
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
            Architecture::Qwen2 | Architecture::Qwen3 => qwen::config_from_hf(hf, architecture),
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

/// The checkpoint's name for a canonical tensor name.
pub fn hf_name(canonical: &str) -> Option<String> {
    let fixed = match canonical {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_string());
    }
    let rest = canonical.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let part = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
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
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        "ffn_gate.bias" => "mlp.gate_proj.bias",
        "ffn_up.bias" => "mlp.up_proj.bias",
        "ffn_down.bias" => "mlp.down_proj.bias",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{part}"))
}

impl TensorSource for HfSource {
    fn path(&self) -> &str {
        &self.display
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let hf = hf_name(name)?;
        self.dir.shape(&hf).ok()
    }

    fn matrix_part(
        &self,
        name: &str,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError> {
        let hf = hf_name(name).ok_or_else(|| LoadError::MissingTensor {
            path: self.display.clone(),
            tensor: name.to_string(),
        })?;
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
        let hf = hf_name(name).ok_or_else(|| LoadError::MissingTensor {
            path: self.display.clone(),
            tensor: name.to_string(),
        })?;
        self.dir.load_f32(&hf).map_err(|e| self.error(&hf, e))
    }
}
