//! A Hugging Face model folder (`config.json` + safetensors weights), read
//! lazily so that a rank touches only the bytes of the tensors it owns.
//!
//! # Why it looks like this
//! - **Headers only at open**: a 70B checkpoint is 140 GB; opening must cost
//!   the size of the JSON headers, not of the weights. Each weight file is
//!   memory-mapped (mapping reads nothing) and tensors are decoded on demand,
//!   so a pipeline stage owning layers 40..80 never pages in layers 0..40.
//! - **Truncation is checked explicitly at open**: a half-downloaded shard is
//!   the most common broken folder. Touching a mapped page past the end of a
//!   file kills the process with SIGBUS instead of returning an error, so every
//!   file's header-declared data end is compared with its length before any
//!   tensor can be read.
//! - **Everything becomes f32**: the engine computes in f32 on CPU; f16/bf16
//!   are widened exactly. Other dtypes (int8, fp8, ...) are refused by name
//!   rather than guessed at.
//! - **Row/column slices** serve tensor parallelism: a column-parallel shard
//!   takes rows `[start, end)` of `q_proj` (contiguous bytes), a row-parallel
//!   shard takes columns of `o_proj`, without materialising the full matrix.
//! - **Every error names the file** (and the tensor) so a user can tell which
//!   download to repeat.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::Metadata;
use safetensors::Dtype;

/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

/// Largest safetensors JSON header accepted. The reference implementation
/// uses the same bound; a larger length prefix means a corrupt (or non-
/// safetensors) file, and refusing it avoids a huge allocation.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// `config.json` of a Llama/Mistral/Qwen2/Qwen3 model: the fields these
/// architectures need. Unknown fields are ignored so newer `transformers`
/// releases, which keep adding keys, still parse.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct HfConfig {
    /// e.g. `["LlamaForCausalLM"]`; empty when the file omits it.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// e.g. `"llama"`, `"mistral"`, `"qwen2"`, `"qwen3"`.
    pub model_type: String,
    pub hidden_size: usize,
    /// Absent where every layer runs experts (Qwen3.5-MoE).
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Absent means multi-head attention (as many KV heads as query heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Absent means `hidden_size / num_attention_heads` (Qwen3 sets it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Kept as raw JSON: its shape differs per scaling type (llama3, yarn, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers 5 writes RoPE here instead of `rope_theta` and
    /// `rope_scaling`: `{"rope_type", "rope_theta", factors...}` (raw JSON,
    /// read by [`HfConfig::rope`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    /// Attention over the last this-many positions only (Mistral v0.1,
    /// Qwen2 when `use_sliding_window`); null or absent: full attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// Qwen2 and Qwen3 write `sliding_window` with this set to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<usize>,
    /// The context a model was trained at before it was stretched (Phi-3's
    /// LongRoPE).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
    pub vocab_size: usize,
    /// Absent means `false` for Llama (the `transformers` default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_word_embeddings: Option<bool>,
    /// Qwen2 has q/k/v biases without saying so here; Llama may set this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// The MLP's activation; absent means `silu` (SwiGLU), the only one
    /// these families use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Mixture of experts: Qwen3-MoE writes `num_experts`, Mixtral (and
    /// transformers 5 for both) `num_local_experts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// Qwen3-MoE: rows of each expert (`intermediate_size` is the dense MLP's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    /// Qwen3-MoE: renormalise the chosen experts' weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    /// Qwen3-MoE: every this-many layers is sparse (1: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<usize>,
    /// Qwen3-MoE: layers that keep a dense MLP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Qwen2-MoE / Qwen3-Next: an always-on expert beside the routed ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Each layer's attention: `full_attention`, `sliding_attention` (and
    /// kinds this engine lacks, such as `linear_attention`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// Gemma's name for `hidden_act`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_activation: Option<String>,
    /// Gemma: q·k is scaled by this to the power -1/2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 2: soft caps on attention scores and on the logits (null: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<serde_json::Value>,
    /// Gemma 3 as transformers 4 wrote it: the windowed layers' RoPE base,
    /// and one global layer in this many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
    /// SmolLM3: 1 for a layer that rotates q and k, 0 for one that does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_rope_layers: Option<Vec<u8>>,
    /// Phi-3 and others: the share of each head RoPE rotates (transformers
    /// 5 may put it in `rope_parameters` instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    /// Gated DeltaNet (Qwen3.5, Qwen3-Next): the convolution's taps and
    /// the key and value heads of the linear-attention layers, which
    /// `layer_types` names (or one full-attention layer in every
    /// `full_attention_interval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_conv_kernel_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_key_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_key_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_value_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention_interval: Option<usize>,
    /// A number, or a list of numbers in some models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<serde_json::Value>,
    /// A number, or a list of numbers (Llama 3 instruct lists several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<serde_json::Value>,
}

/// The RoPE settings of a config in either layout: the base frequency and
/// the scaling object (`None`: no scaling).
#[derive(Debug, PartialEq)]
pub struct RopeSettings<'a> {
    pub theta: Option<f64>,
    pub scaling: Option<&'a serde_json::Value>,
}

impl HfConfig {
    /// RoPE from `rope_parameters` (transformers 5) when present, else from
    /// the older top-level `rope_theta` and `rope_scaling`.
    pub fn rope(&self) -> RopeSettings<'_> {
        match self.rope_parameters.as_ref().filter(|p| p.is_object()) {
            Some(parameters) => RopeSettings {
                theta: parameters
                    .get("rope_theta")
                    .and_then(serde_json::Value::as_f64)
                    .or(self.rope_theta),
                scaling: Some(parameters),
            },
            None => RopeSettings {
                theta: self.rope_theta,
                scaling: self.rope_scaling.as_ref().filter(|v| !v.is_null()),
            },
        }
    }

    /// The sliding window a config asks for, if it limits attention at all
    /// (a window at least the context long, or switched off, does not).
    pub fn effective_sliding_window(&self) -> Option<u64> {
        let window = self.sliding_window?;
        let context = self.max_position_embeddings.map_or(u64::MAX, |c| c as u64);
        (self.use_sliding_window != Some(false) && window < context).then_some(window)
    }

    /// The expert count, under either name.
    pub fn expert_count(&self) -> Option<usize> {
        self.num_experts
            .or(self.num_local_experts)
            .filter(|&n| n > 0)
    }

    /// Whether layer `layer` is a mixture of experts (Qwen3-MoE's
    /// `decoder_sparse_step` and `mlp_only_layers`; every layer otherwise).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        self.expert_count().is_some()
            && !self
                .mlp_only_layers
                .as_ref()
                .is_some_and(|l| l.contains(&layer))
            && (layer + 1).is_multiple_of(step)
    }

    /// Number of KV heads, defaulting to the query-head count as
    /// `transformers` does when the key is absent.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head dimension, defaulting to `hidden_size / num_attention_heads`
    /// as `transformers` does when the key is absent (0 heads gives 0).
    pub fn head_dim_or_default(&self) -> usize {
        self.head_dim.unwrap_or_else(|| {
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0)
        })
    }
}

/// Why a model folder or one of its tensors could not be read. Every message
/// names the file (and the tensor where one is involved).
#[derive(Debug, thiserror::Error)]
pub enum HfDirError {
    #[error("missing config.json: {} does not exist", path.display())]
    MissingConfig { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unparsable config {}: {message}", path.display())]
    BadConfig { path: PathBuf, message: String },
    #[error("no weights in {}: neither {SINGLE_FILE} nor {INDEX_FILE} exists", dir.display())]
    NoWeights { dir: PathBuf },
    #[error("bad safetensors index {}: {message}", path.display())]
    BadIndex { path: PathBuf, message: String },
    #[error(
        "safetensors index {} maps tensor {tensor} to {}, which does not exist (incomplete download?)",
        index.display(),
        file.display()
    )]
    MissingWeightFile {
        index: PathBuf,
        file: PathBuf,
        tensor: String,
    },
    #[error(
        "safetensors index {} maps tensor {tensor} to {}, but that file does not contain it",
        index.display(),
        file.display()
    )]
    TensorNotInFile {
        index: PathBuf,
        file: PathBuf,
        tensor: String,
    },
    #[error("unreadable safetensors header in {}: {message}", path.display())]
    BadHeader { path: PathBuf, message: String },
    #[error(
        "safetensors file {} is truncated: its header needs {needed} bytes but the file has {actual} (incomplete download?)",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        needed: u64,
        actual: u64,
    },
    #[error("tensor {name} not found in {}", dir.display())]
    TensorNotFound { name: String, dir: PathBuf },
    #[error(
        "tensor {name} in {} has unsupported dtype {dtype} (only F32, F16 and BF16 are supported)",
        path.display()
    )]
    UnsupportedDtype {
        name: String,
        path: PathBuf,
        dtype: String,
    },
    #[error("tensor {name} in {} has shape {actual:?}, expected {expected:?}", path.display())]
    ShapeMismatch {
        name: String,
        path: PathBuf,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("cannot decode tensor {name} in {}: {message}", path.display())]
    Decode {
        name: String,
        path: PathBuf,
        message: String,
    },
    #[error("tensor {name} in {} (shape {shape:?}): {message}", path.display())]
    BadSlice {
        name: String,
        path: PathBuf,
        shape: Vec<usize>,
        message: String,
    },
}

/// One memory-mapped weight file.
#[derive(Debug)]
struct WeightFile {
    /// Path relative to the model folder, as named in the index.
    rel: PathBuf,
    /// Absolute (or caller-relative) path, for messages.
    path: PathBuf,
    map: memmap2::Mmap,
    /// Byte offset of the data section (after the length prefix and header).
    data_start: usize,
}

/// Where one tensor lives.
#[derive(Debug)]
struct TensorEntry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file (header already skipped).
    start: usize,
    end: usize,
}

/// An opened Hugging Face model folder. Cheap to open (headers only); tensors
/// are decoded on demand from memory maps. `Send + Sync`, so ranks loading in
/// parallel threads can share one.
#[derive(Debug)]
pub struct HfModelDir {
    dir: PathBuf,
    config: HfConfig,
    files: Vec<WeightFile>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Tensors the index names in files that are not here (a node holding
    /// one pipeline stage downloads only its files): reading one fails with
    /// [`HfDirError::MissingWeightFile`].
    missing: BTreeMap<String, HfDirError>,
}

/// The part of `model.safetensors.index.json` that matters; `metadata`
/// (total size) is informational and ignored.
#[derive(serde::Deserialize)]
struct IndexJson {
    weight_map: BTreeMap<String, String>,
}

impl HfModelDir {
    /// Opens `dir`: parses `config.json`, then either `model.safetensors` or
    /// the index and every file it names (the single file wins when both
    /// exist, as in `transformers`). Reads only the headers; fails if any file
    /// is missing, its header is corrupt, or its data is shorter than the
    /// header declares. Weight files the index names but that are absent
    /// are allowed (a pipeline stage has only its own): their tensors fail
    /// when read.
    pub fn open(dir: &Path) -> Result<Self, HfDirError> {
        let (config, multimodal) = read_config(dir)?;
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        let mut missing = BTreeMap::new();
        if single.is_file() {
            let (file, metadata) = open_weight_file(dir, PathBuf::from(SINGLE_FILE))?;
            for (name, info) in metadata.tensors() {
                tensors.insert(name, entry(0, &file, info)?);
            }
            files.push(file);
        } else if index.is_file() {
            let text = read_to_string(&index)?;
            let parsed: IndexJson =
                serde_json::from_str(&text).map_err(|e| HfDirError::BadIndex {
                    path: index.clone(),
                    message: e.to_string(),
                })?;
            // Each distinct file is opened once; `headers[i]` belongs to `files[i]`.
            let mut by_name: BTreeMap<String, usize> = BTreeMap::new();
            let mut headers: Vec<Metadata> = Vec::new();
            for (tensor, file_name) in parsed.weight_map {
                let file_idx = match by_name.get(&file_name) {
                    Some(&i) => i,
                    None => {
                        let rel = checked_relative(&index, &file_name)?;
                        if !dir.join(&rel).is_file() {
                            let error = HfDirError::MissingWeightFile {
                                index: index.clone(),
                                file: dir.join(&rel),
                                tensor: tensor.clone(),
                            };
                            missing.insert(tensor, error);
                            continue;
                        }
                        let (file, metadata) = open_weight_file(dir, rel)?;
                        files.push(file);
                        headers.push(metadata);
                        by_name.insert(file_name, files.len() - 1);
                        files.len() - 1
                    }
                };
                let file = &files[file_idx];
                let Some(info) = headers[file_idx].info(&tensor) else {
                    return Err(HfDirError::TensorNotInFile {
                        index: index.clone(),
                        file: file.path.clone(),
                        tensor,
                    });
                };
                let e = entry(file_idx, file, info)?;
                tensors.insert(tensor, e);
            }
        } else {
            return Err(HfDirError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        if multimodal {
            tensors = rename_keys(tensors);
            missing = rename_keys(missing);
        }
        if is_base_model(&tensors) {
            tensors = prefix_keys(tensors);
            missing = prefix_keys(missing);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            files,
            tensors,
            missing,
        })
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &HfConfig {
        &self.config
    }

    /// The folder this was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the checkpoint has a tensor of this name (e.g. to tell tied
    /// embeddings from an explicit `lm_head.weight`).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.missing.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape of a tensor (any dtype), from the header alone.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, HfDirError> {
        Ok(self.entry(name)?.shape.clone())
    }

    /// Fails with [`HfDirError::ShapeMismatch`] unless the tensor has exactly
    /// `expected` shape: the check a loader makes against the config before
    /// trusting a tensor's layout.
    pub fn expect_shape(&self, name: &str, expected: &[usize]) -> Result<(), HfDirError> {
        let e = self.entry(name)?;
        if e.shape != expected {
            return Err(HfDirError::ShapeMismatch {
                name: name.to_string(),
                path: self.files[e.file].path.clone(),
                expected: expected.to_vec(),
                actual: e.shape.clone(),
            });
        }
        Ok(())
    }

    /// Reads one tensor converted to f32 (f16/bf16 widened exactly),
    /// row-major. Only this tensor's bytes are touched.
    pub fn load_f32(&self, name: &str) -> Result<Vec<f32>, HfDirError> {
        let e = self.entry(name)?;
        let bytes = &self.files[e.file].map[e.start..e.end];
        self.widen(name, e, bytes)?
            .to_vec1::<f32>()
            .map_err(|err| self.decode_error(name, e, err))
    }

    /// Reads rows `[start, end)` (first dimension) of a tensor of rank >= 1 as
    /// f32 — the contiguous slice a column-parallel shard owns (for a 1-D
    /// tensor such as a bias, rows are elements).
    pub fn load_f32_rows(
        &self,
        name: &str,
        start: usize,
        end: usize,
    ) -> Result<Vec<f32>, HfDirError> {
        let e = self.entry(name)?;
        let width = self.float_dtype(name, e)?.size_in_bytes();
        let Some((&rows, rest)) = e.shape.split_first() else {
            return Err(self.bad_slice(name, e, "a 0-D tensor has no rows".into()));
        };
        check_range(start, end, rows).map_err(|m| self.bad_slice(name, e, format!("rows {m}")))?;
        let row_bytes = rest.iter().product::<usize>() * width;
        let bytes = &self.files[e.file].map[e.start + start * row_bytes..e.start + end * row_bytes];
        self.widen(name, e, bytes)?
            .to_vec1::<f32>()
            .map_err(|err| self.decode_error(name, e, err))
    }

    /// Reads columns `[start, end)` of a 2-D tensor as f32, row-major with
    /// `end - start` columns — the slice a row-parallel shard (`o_proj`,
    /// `down_proj`) owns.
    pub fn load_f32_cols(
        &self,
        name: &str,
        start: usize,
        end: usize,
    ) -> Result<Vec<f32>, HfDirError> {
        let e = self.entry(name)?;
        let &[rows, cols] = e.shape.as_slice() else {
            return Err(self.bad_slice(name, e, "column slices need a 2-D tensor".into()));
        };
        check_range(start, end, cols)
            .map_err(|m| self.bad_slice(name, e, format!("columns {m}")))?;
        let bytes = &self.files[e.file].map[e.start..e.end];
        self.widen(name, e, bytes)?
            .reshape((rows, cols))
            .and_then(|t| t.narrow(1, start, end - start))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|err| self.decode_error(name, e, err))
    }

    /// Reads rows `rows` and columns `cols` of a tensor of rank >= 2 seen
    /// as a matrix as wide as its last dimension (a `[experts, rows, cols]`
    /// tensor has `experts * rows` rows): one expert's part of a layer's
    /// fused experts, touching only those rows' bytes.
    pub fn load_f32_window(
        &self,
        name: &str,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Vec<f32>, HfDirError> {
        let e = self.entry(name)?;
        let width = self.float_dtype(name, e)?.size_in_bytes();
        let (row_len, total_rows) = match e.shape.split_last() {
            Some((&len, leading)) if !leading.is_empty() && len > 0 => {
                (len, leading.iter().product::<usize>())
            }
            _ => {
                return Err(self.bad_slice(name, e, "a window needs a 2-D or wider tensor".into()))
            }
        };
        check_range(rows.start, rows.end, total_rows)
            .map_err(|m| self.bad_slice(name, e, format!("rows {m}")))?;
        check_range(cols.start, cols.end, row_len)
            .map_err(|m| self.bad_slice(name, e, format!("columns {m}")))?;
        let row_bytes = row_len * width;
        let bytes = &self.files[e.file].map
            [e.start + rows.start * row_bytes..e.start + rows.end * row_bytes];
        let values = self
            .widen(name, e, bytes)?
            .to_vec1::<f32>()
            .map_err(|err| self.decode_error(name, e, err))?;
        if cols == (0..row_len) {
            return Ok(values);
        }
        Ok(values
            .chunks_exact(row_len)
            .flat_map(|row| &row[cols.clone()])
            .copied()
            .collect())
    }

    /// The weight files holding the given tensors, as paths relative to
    /// [`dir`](Self::dir) (exactly the names in the index, hence also the
    /// names to request from the Hub when downloading only some shards).
    pub fn files_for<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<BTreeSet<PathBuf>, HfDirError> {
        names
            .into_iter()
            .map(|n| Ok(self.files[self.entry(n)?.file].rel.clone()))
            .collect()
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, HfDirError> {
        if let Some(HfDirError::MissingWeightFile {
            index,
            file,
            tensor,
        }) = self.missing.get(name)
        {
            return Err(HfDirError::MissingWeightFile {
                index: index.clone(),
                file: file.clone(),
                tensor: tensor.clone(),
            });
        }
        self.tensors
            .get(name)
            .ok_or_else(|| HfDirError::TensorNotFound {
                name: name.to_string(),
                dir: self.dir.clone(),
            })
    }

    /// The tensor's dtype if it is one this loader widens to f32.
    fn float_dtype(&self, name: &str, e: &TensorEntry) -> Result<DType, HfDirError> {
        match e.dtype {
            Dtype::F32 => Ok(DType::F32),
            Dtype::F16 => Ok(DType::F16),
            Dtype::BF16 => Ok(DType::BF16),
            other => Err(HfDirError::UnsupportedDtype {
                name: name.to_string(),
                path: self.files[e.file].path.clone(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// `bytes` (little-endian elements of the tensor's dtype) as a flat f32
    /// tensor. The conversion runs in candle, compiled optimised even in dev
    /// builds (the same plain loops here are ~10x slower in unoptimised test
    /// builds); candle copies unaligned input, so any offset is fine.
    fn widen(&self, name: &str, e: &TensorEntry, bytes: &[u8]) -> Result<Tensor, HfDirError> {
        let dtype = self.float_dtype(name, e)?;
        let n = bytes.len() / dtype.size_in_bytes();
        Tensor::from_raw_buffer(bytes, dtype, &[n], &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|err| self.decode_error(name, e, err))
    }

    fn decode_error(&self, name: &str, e: &TensorEntry, err: candle_core::Error) -> HfDirError {
        HfDirError::Decode {
            name: name.to_string(),
            path: self.files[e.file].path.clone(),
            message: err.to_string(),
        }
    }

    fn bad_slice(&self, name: &str, e: &TensorEntry, message: String) -> HfDirError {
        HfDirError::BadSlice {
            name: name.to_string(),
            path: self.files[e.file].path.clone(),
            shape: e.shape.clone(),
            message,
        }
    }
}

fn check_range(start: usize, end: usize, len: usize) -> Result<(), String> {
    if start > end || end > len {
        return Err(format!("[{start}, {end}) out of range 0..{len}"));
    }
    Ok(())
}

fn read_to_string(path: &Path) -> Result<String, HfDirError> {
    std::fs::read_to_string(path).map_err(|source| HfDirError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Where image-text checkpoints keep their language model's tensors, and
/// the names a text-only checkpoint gives them: transformers 5 writes
/// `model.language_model.*` (Qwen3.5, Gemma 3), transformers 4
/// `language_model.model.*` (Gemma 3, LLaVA).
const LANGUAGE_MODEL_PREFIXES: [(&str, &str); 4] = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.lm_head.", "lm_head."),
];

/// Fields of a multimodal config that sit beside `text_config` and that the
/// language model needs when `text_config` does not repeat them.
const SHARED_TOP_LEVEL_FIELDS: [&str; 4] = [
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
];

/// The parsed `config.json`, and whether it was an image-text checkpoint's
/// (whose language model's config is its `text_config`: the tensors of such
/// a folder are renamed as a text-only checkpoint names them, and the vision
/// tower's are left unread).
fn read_config(dir: &Path) -> Result<(HfConfig, bool), HfDirError> {
    let path = dir.join(CONFIG_FILE);
    if !path.is_file() {
        return Err(HfDirError::MissingConfig { path });
    }
    let text = read_to_string(&path)?;
    let bad = |message: String| HfDirError::BadConfig {
        path: path.clone(),
        message,
    };
    let mut value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let multimodal = value.get("text_config").is_some() && value.get("hidden_size").is_none();
    if multimodal {
        value = language_model_config(&value).map_err(bad)?;
    }
    let config = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    Ok((config, multimodal))
}

/// A multimodal config's `text_config`, with the fields it shares with the
/// outer config filled in from there.
fn language_model_config(outer: &serde_json::Value) -> Result<serde_json::Value, String> {
    let Some(mut text) = outer
        .get("text_config")
        .and_then(|t| t.as_object())
        .cloned()
    else {
        return Err("text_config is not an object".into());
    };
    for field in SHARED_TOP_LEVEL_FIELDS {
        if let Some(v) = outer.get(field).filter(|_| !text.contains_key(field)) {
            text.insert(field.to_string(), v.clone());
        }
    }
    if !text.contains_key("model_type") {
        return Err(format!(
            "text_config has no model_type (the outer model_type is {})",
            outer.get("model_type").unwrap_or(&serde_json::Value::Null)
        ));
    }
    Ok(serde_json::Value::Object(text))
}

/// The text-only name of a multimodal checkpoint's language-model tensor;
/// other names (the vision tower's, multi-token prediction's) unchanged.
fn language_model_name(name: String) -> String {
    for (prefix, plain) in LANGUAGE_MODEL_PREFIXES {
        if let Some(rest) = name.strip_prefix(prefix) {
            return format!("{plain}{rest}");
        }
    }
    name
}

/// Whether the tensors are a base model's, saved without its head's
/// wrapper (`Qwen3Model`, as embedding models are saved): `embed_tokens`
/// and `layers.N` at the top, nothing under `model.`.
fn is_base_model<V>(tensors: &BTreeMap<String, V>) -> bool {
    tensors.contains_key("embed_tokens.weight") && !tensors.keys().any(|k| k.starts_with("model."))
}

/// A base model's tensor names as the model with a head names them
/// (`model.` before each).
fn prefix_keys<V>(map: BTreeMap<String, V>) -> BTreeMap<String, V> {
    map.into_iter()
        .map(|(name, v)| (format!("model.{name}"), v))
        .collect()
}

fn rename_keys<V>(map: BTreeMap<String, V>) -> BTreeMap<String, V> {
    map.into_iter()
        .map(|(name, v)| (language_model_name(name), v))
        .collect()
}

/// Refuses index entries that would escape the model folder (`../x`,
/// absolute paths): the names come from a downloaded file and will later
/// also name downloads.
fn checked_relative(index: &Path, name: &str) -> Result<PathBuf, HfDirError> {
    let rel = PathBuf::from(name);
    let plain = !name.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(HfDirError::BadIndex {
            path: index.to_path_buf(),
            message: format!("weight file name {name:?} is not a plain relative path"),
        });
    }
    Ok(rel)
}

/// Reads and validates one file's header, checks its length against it, and
/// maps it.
fn open_weight_file(dir: &Path, rel: PathBuf) -> Result<(WeightFile, Metadata), HfDirError> {
    let path = dir.join(&rel);
    let io = |source| HfDirError::Io {
        path: path.clone(),
        source,
    };
    let mut file = File::open(&path).map_err(io)?;
    let actual = file.metadata().map_err(io)?.len();
    let bad = |message: String| HfDirError::BadHeader {
        path: path.clone(),
        message,
    };
    if actual < 8 {
        return Err(HfDirError::Truncated {
            path: path.clone(),
            needed: 8,
            actual,
        });
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(io)?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "header length {header_len} exceeds {MAX_HEADER_BYTES} (not a safetensors file?)"
        )));
    }
    if 8 + header_len > actual {
        return Err(HfDirError::Truncated {
            path: path.clone(),
            needed: 8 + header_len,
            actual,
        });
    }
    // Bounded by MAX_HEADER_BYTES above, so the cast cannot truncate.
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    // `Metadata`'s deserializer also validates that the data offsets are
    // contiguous from 0 and that each range matches dtype x shape.
    let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
    let needed = 8 + header_len + metadata.data_len() as u64;
    if needed > actual {
        return Err(HfDirError::Truncated {
            path: path.clone(),
            needed,
            actual,
        });
    }
    // SAFETY: the map is read-only and the file's length was checked to cover
    // every tensor. Another process truncating or rewriting the file while
    // it is mapped would fault the process (SIGBUS) or change the values we
    // read; model folders are treated as immutable once opened, as every
    // safetensors loader (candle, transformers) does.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let data_start = 8 + header_len as usize;
    Ok((
        WeightFile {
            rel,
            path,
            map,
            data_start,
        },
        metadata,
    ))
}

/// Locates a tensor's bytes from its header entry, re-checking the range
/// against the mapped length so no later read can fault.
fn entry(
    file_idx: usize,
    file: &WeightFile,
    info: &safetensors::tensor::TensorInfo,
) -> Result<TensorEntry, HfDirError> {
    let (s, e) = info.data_offsets;
    let (start, end) = (file.data_start + s, file.data_start + e);
    if end > file.map.len() {
        return Err(HfDirError::Truncated {
            path: file.path.clone(),
            needed: end as u64,
            actual: file.map.len() as u64,
        });
    }
    Ok(TensorEntry {
        file: file_idx,
        dtype: info.dtype,
        shape: info.shape.clone(),
        start,
        end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    /// A tensor for writing test files with the reference serializer.
    struct T {
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    }

    impl safetensors::View for &T {
        fn dtype(&self) -> Dtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.data)
        }
        fn data_len(&self) -> usize {
            self.data.len()
        }
    }

    fn f32_tensor(shape: &[usize], values: &[f32]) -> T {
        T {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    fn f16_tensor(shape: &[usize], values: &[f32]) -> T {
        T {
            dtype: Dtype::F16,
            shape: shape.to_vec(),
            data: values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }

    fn bf16_tensor(shape: &[usize], values: &[f32]) -> T {
        T {
            dtype: Dtype::BF16,
            shape: shape.to_vec(),
            data: values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }

    fn write_st(path: &Path, tensors: &[(&str, &T)]) {
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (*n, *t)), None, path).unwrap();
    }

    fn write_config(dir: &Path) {
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": 3,
            "some_future_key": {"nested": true}
        });
        std::fs::write(dir.join(CONFIG_FILE), config.to_string()).unwrap();
    }

    /// 0..n as f32, values exactly representable in f16 and bf16.
    fn iota(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32).collect()
    }

    fn single_file_dir() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        write_config(tmp.path());
        write_st(
            &tmp.path().join(SINGLE_FILE),
            &[
                ("a32", &f32_tensor(&[3, 4], &iota(12))),
                ("a16", &f16_tensor(&[3, 4], &iota(12))),
                ("abf", &bf16_tensor(&[3, 4], &iota(12))),
                ("bias", &f32_tensor(&[5], &iota(5))),
                (
                    "ints",
                    &T {
                        dtype: Dtype::I32,
                        shape: vec![2],
                        data: vec![0; 8],
                    },
                ),
            ],
        );
        tmp
    }

    fn err_text<T: std::fmt::Debug>(r: Result<T, HfDirError>) -> (HfDirError, String) {
        let e = r.unwrap_err();
        let s = e.to_string();
        (e, s)
    }

    #[test]
    fn config_defaults_and_unknown_keys() {
        let tmp = single_file_dir();
        let m = HfModelDir::open(tmp.path()).unwrap();
        let c = m.config();
        assert_eq!(c.model_type, "llama");
        assert_eq!(c.architectures, vec!["LlamaForCausalLM".to_string()]);
        assert_eq!(c.num_key_value_heads, None);
        assert_eq!(c.kv_heads(), 2);
        assert_eq!(c.head_dim_or_default(), 2);
        assert_eq!(c.rope_theta, None);
        assert_eq!(m.dir(), tmp.path());
        fn shareable<T: Send + Sync>(_: &T) {}
        shareable(&m);
    }

    #[test]
    fn widens_every_float_dtype_exactly() {
        let tmp = single_file_dir();
        let m = HfModelDir::open(tmp.path()).unwrap();
        for name in ["a32", "a16", "abf"] {
            assert!(m.contains(name));
            assert_eq!(m.shape(name).unwrap(), vec![3, 4]);
            assert_eq!(m.load_f32(name).unwrap(), iota(12), "{name}");
            assert_eq!(m.load_f32_rows(name, 1, 3).unwrap(), iota(12)[4..].to_vec());
            assert_eq!(
                m.load_f32_cols(name, 1, 3).unwrap(),
                vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0],
                "{name}"
            );
            assert!(m.load_f32_rows(name, 2, 2).unwrap().is_empty());
        }
        assert_eq!(m.load_f32_rows("bias", 1, 4).unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(
            m.tensor_names().collect::<Vec<_>>(),
            vec!["a16", "a32", "abf", "bias", "ints"]
        );
    }

    /// An image-text checkpoint opens as its language model: the config is
    /// `text_config` (with the fields it shares from the outer config), the
    /// tensors take a text-only checkpoint's names, the vision tower's and
    /// multi-token prediction's keep theirs (nothing asks for them).
    /// A base model saved without its head (`Qwen3Model`, as embedding
    /// models are) opens under the names the model with a head has.
    #[test]
    fn a_base_models_tensors_take_the_prefixed_names() {
        let tmp = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "architectures": ["Qwen3Model"], "model_type": "qwen3", "hidden_size": 4,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-6,
            "vocab_size": 3
        });
        std::fs::write(tmp.path().join(CONFIG_FILE), config.to_string()).unwrap();
        let t = f32_tensor(&[3, 4], &iota(12));
        write_st(
            &tmp.path().join(SINGLE_FILE),
            &[
                ("embed_tokens.weight", &t),
                ("layers.0.mlp.down_proj.weight", &t),
                ("norm.weight", &t),
            ],
        );
        let m = HfModelDir::open(tmp.path()).unwrap();
        assert_eq!(
            m.tensor_names().collect::<Vec<_>>(),
            [
                "model.embed_tokens.weight",
                "model.layers.0.mlp.down_proj.weight",
                "model.norm.weight"
            ]
        );
        assert_eq!(m.load_f32("model.norm.weight").unwrap(), iota(12));
    }

    #[test]
    fn a_multimodal_checkpoint_opens_as_its_language_model() {
        let tmp = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": true,
            "eos_token_id": 7,
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 4, "num_hidden_layers": 1,
                "num_attention_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 3,
                "eos_token_id": 5
            },
            "vision_config": {"model_type": "qwen3_5_moe_vision"}
        });
        std::fs::write(tmp.path().join(CONFIG_FILE), config.to_string()).unwrap();
        let t = f32_tensor(&[3, 4], &iota(12));
        write_st(
            &tmp.path().join(SINGLE_FILE),
            &[
                ("model.language_model.embed_tokens.weight", &t),
                ("model.language_model.layers.0.mlp.experts.down_proj", &t),
                ("model.lm_head.weight", &t),
                ("model.visual.patch_embed.proj.weight", &t),
                ("mtp.fc.weight", &t),
            ],
        );
        let m = HfModelDir::open(tmp.path()).unwrap();
        let c = m.config();
        assert_eq!(
            (c.model_type.as_str(), c.hidden_size),
            ("qwen3_5_moe_text", 4)
        );
        assert_eq!(c.tie_word_embeddings, Some(true), "from the outer config");
        assert_eq!(
            c.eos_token_id,
            Some(serde_json::json!(5)),
            "text_config's own wins"
        );
        assert_eq!(
            m.tensor_names().collect::<Vec<_>>(),
            [
                "lm_head.weight",
                "model.embed_tokens.weight",
                "model.layers.0.mlp.experts.down_proj",
                "model.visual.patch_embed.proj.weight",
                "mtp.fc.weight"
            ]
        );
        assert_eq!(m.load_f32("lm_head.weight").unwrap(), iota(12));
        assert_eq!(
            language_model_name("language_model.model.layers.0.x".into()),
            "model.layers.0.x"
        );
        assert_eq!(
            language_model_name("language_model.lm_head.weight".into()),
            "lm_head.weight"
        );
    }

    /// A text-only checkpoint's names are never rewritten, even where they
    /// look like a multimodal one's.
    #[test]
    fn a_text_only_checkpoint_keeps_its_names() {
        let tmp = single_file_dir();
        let t = f32_tensor(&[2], &iota(2));
        write_st(
            &tmp.path().join(SINGLE_FILE),
            &[("model.lm_head.weight", &t)],
        );
        let m = HfModelDir::open(tmp.path()).unwrap();
        assert_eq!(
            m.tensor_names().collect::<Vec<_>>(),
            ["model.lm_head.weight"]
        );
    }

    #[test]
    fn a_malformed_text_config_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        for (config, needle) in [
            (
                serde_json::json!({"model_type": "gemma3", "text_config": 3}),
                "not an object",
            ),
            (
                serde_json::json!({"model_type": "gemma3", "text_config": {"hidden_size": 8}}),
                "no model_type",
            ),
            (
                serde_json::json!({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}),
                "hidden_size",
            ),
        ] {
            std::fs::write(tmp.path().join(CONFIG_FILE), config.to_string()).unwrap();
            let message = read_config(tmp.path()).unwrap_err().to_string();
            assert!(message.contains(needle), "{message}");
        }
    }

    /// A `[2, 3, 4]` tensor as 6 rows of 4: any rows, any columns, only
    /// those.
    #[test]
    fn windows_of_a_three_dimensional_tensor() {
        let tmp = tempfile::tempdir().unwrap();
        write_config(tmp.path());
        write_st(
            &tmp.path().join(SINGLE_FILE),
            &[
                ("experts", &bf16_tensor(&[2, 3, 4], &iota(24))),
                ("vector", &f32_tensor(&[4], &iota(4))),
            ],
        );
        let m = HfModelDir::open(tmp.path()).unwrap();
        assert_eq!(m.load_f32_window("experts", 0..6, 0..4).unwrap(), iota(24));
        assert_eq!(
            m.load_f32_window("experts", 3..5, 1..3).unwrap(),
            [13.0, 14.0, 17.0, 18.0]
        );
        assert!(m.load_f32_window("experts", 5..7, 0..4).is_err());
        assert!(m.load_f32_window("experts", 0..1, 2..5).is_err());
        let (_, message) = err_text(m.load_f32_window("vector", 0..1, 0..1));
        assert!(message.contains("2-D"), "{message}");
    }

    #[test]
    fn refuses_other_dtypes_naming_tensor_and_file() {
        let tmp = single_file_dir();
        let m = HfModelDir::open(tmp.path()).unwrap();
        assert_eq!(m.shape("ints").unwrap(), vec![2]);
        let (e, s) = err_text(m.load_f32("ints"));
        assert!(matches!(e, HfDirError::UnsupportedDtype { .. }), "{e:?}");
        assert!(
            s.contains("ints") && s.contains(SINGLE_FILE) && s.contains("I32"),
            "{s}"
        );
    }

    #[test]
    fn bad_slices_and_shapes() {
        let tmp = single_file_dir();
        let m = HfModelDir::open(tmp.path()).unwrap();
        let (e, s) = err_text(m.load_f32_rows("a32", 2, 4));
        assert!(matches!(e, HfDirError::BadSlice { .. }), "{e:?}");
        assert!(s.contains("a32") && s.contains(SINGLE_FILE), "{s}");
        let (e, _) = err_text(m.load_f32_rows("a32", 2, 1));
        assert!(matches!(e, HfDirError::BadSlice { .. }), "{e:?}");
        let (e, _) = err_text(m.load_f32_cols("a32", 0, 5));
        assert!(matches!(e, HfDirError::BadSlice { .. }), "{e:?}");
        let (e, _) = err_text(m.load_f32_cols("bias", 0, 1));
        assert!(matches!(e, HfDirError::BadSlice { .. }), "{e:?}");

        m.expect_shape("a32", &[3, 4]).unwrap();
        let (e, s) = err_text(m.expect_shape("a32", &[4, 3]));
        assert!(matches!(e, HfDirError::ShapeMismatch { .. }), "{e:?}");
        assert!(
            s.contains("a32") && s.contains(SINGLE_FILE) && s.contains("[4, 3]"),
            "{s}"
        );
    }

    #[test]
    fn unknown_tensor() {
        let tmp = single_file_dir();
        let m = HfModelDir::open(tmp.path()).unwrap();
        assert!(!m.contains("nope"));
        for r in [m.load_f32("nope").map(drop), m.shape("nope").map(drop)] {
            let (e, s) = err_text(r);
            assert!(matches!(e, HfDirError::TensorNotFound { .. }), "{e:?}");
            assert!(s.contains("nope"), "{s}");
        }
        let (e, _) = err_text(m.files_for(["a32", "nope"]));
        assert!(matches!(e, HfDirError::TensorNotFound { .. }), "{e:?}");
    }

    #[test]
    fn missing_and_bad_config() {
        let tmp = single_file_dir();
        std::fs::remove_file(tmp.path().join(CONFIG_FILE)).unwrap();
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::MissingConfig { .. }), "{e:?}");
        assert!(s.contains(CONFIG_FILE), "{s}");

        std::fs::write(tmp.path().join(CONFIG_FILE), r#"{"model_type": "llama"}"#).unwrap();
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::BadConfig { .. }), "{e:?}");
        assert!(s.contains(CONFIG_FILE) && s.contains("hidden_size"), "{s}");
    }

    #[test]
    fn no_weights() {
        let tmp = tempfile::tempdir().unwrap();
        write_config(tmp.path());
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::NoWeights { .. }), "{e:?}");
        assert!(s.contains(SINGLE_FILE) && s.contains(INDEX_FILE), "{s}");
    }

    #[test]
    fn truncated_and_garbage_files_name_the_file() {
        let tmp = single_file_dir();
        let path = tmp.path().join(SINGLE_FILE);
        let len = std::fs::metadata(&path).unwrap().len();
        // Cut just the last byte: header intact, data short.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 1).unwrap();
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::Truncated { .. }), "{e:?}");
        assert!(s.contains(SINGLE_FILE), "{s}");
        // Cut inside the header.
        f.set_len(20).unwrap();
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::Truncated { .. }), "{e:?}");
        assert!(s.contains(SINGLE_FILE), "{s}");
        // Shorter than the length prefix.
        f.set_len(3).unwrap();
        let (e, _) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::Truncated { .. }), "{e:?}");
        // Not a safetensors file at all.
        std::fs::write(&path, b"\x05\x00\x00\x00\x00\x00\x00\x00hello").unwrap();
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::BadHeader { .. }), "{e:?}");
        assert!(s.contains(SINGLE_FILE), "{s}");
        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        let (e, _) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::BadHeader { .. }), "{e:?}");
    }

    fn write_index(dir: &Path, map: &[(&str, &str)]) {
        let weight_map: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(t, f)| (t.to_string(), serde_json::Value::from(*f)))
            .collect();
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
    }

    fn sharded_dir() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        write_config(tmp.path());
        write_st(
            &tmp.path().join("part-1.safetensors"),
            &[
                ("x", &f32_tensor(&[2], &[1.0, 2.0])),
                ("y", &f32_tensor(&[1], &[3.0])),
            ],
        );
        write_st(
            &tmp.path().join("part-2.safetensors"),
            &[("z", &bf16_tensor(&[2, 2], &[4.0, 5.0, 6.0, 7.0]))],
        );
        write_index(
            tmp.path(),
            &[
                ("x", "part-1.safetensors"),
                ("y", "part-1.safetensors"),
                ("z", "part-2.safetensors"),
            ],
        );
        tmp
    }

    #[test]
    fn sharded_index_and_files_for() {
        let tmp = sharded_dir();
        let m = HfModelDir::open(tmp.path()).unwrap();
        assert_eq!(m.load_f32("y").unwrap(), vec![3.0]);
        assert_eq!(m.load_f32("z").unwrap(), vec![4.0, 5.0, 6.0, 7.0]);
        let files = m.files_for(["x", "y"]).unwrap();
        assert_eq!(files, BTreeSet::from([PathBuf::from("part-1.safetensors")]));
        let files = m.files_for(["z", "x"]).unwrap();
        assert_eq!(files.len(), 2);
        assert!(m.files_for([]).unwrap().is_empty());
    }

    #[test]
    fn index_errors() {
        let tmp = sharded_dir();
        write_index(
            tmp.path(),
            &[("x", "part-1.safetensors"), ("w", "part-3.safetensors")],
        );
        // Opens (a stage may hold only its files); reading "w" fails.
        let opened = HfModelDir::open(tmp.path()).expect("opens without part-3");
        assert!(opened.contains("w"));
        let (e, s) = err_text(opened.shape("w"));
        assert!(matches!(e, HfDirError::MissingWeightFile { .. }), "{e:?}");
        assert!(
            s.contains("part-3.safetensors") && s.contains(INDEX_FILE),
            "{s}"
        );

        write_index(tmp.path(), &[("w", "part-1.safetensors")]);
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::TensorNotInFile { .. }), "{e:?}");
        assert!(s.contains("part-1.safetensors") && s.contains(" w "), "{s}");

        for evil in ["../part-1.safetensors", "/etc/passwd", ""] {
            write_index(tmp.path(), &[("x", evil)]);
            let (e, _) = err_text(HfModelDir::open(tmp.path()));
            assert!(matches!(e, HfDirError::BadIndex { .. }), "{evil}: {e:?}");
        }

        std::fs::write(tmp.path().join(INDEX_FILE), "{not json").unwrap();
        let (e, s) = err_text(HfModelDir::open(tmp.path()));
        assert!(matches!(e, HfDirError::BadIndex { .. }), "{e:?}");
        assert!(s.contains(INDEX_FILE), "{s}");
    }
}
