//! GGUF files: metadata through candle's parser, tensors read one at a time
//! (only those a shard needs), native formats kept as raw blocks for our
//! kernels, other quantizations handed to candle's quantized matmul.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::Device;

use crate::model::config::{
    Activation, Architecture, LinearAttention, ModelConfig, MoeConfig, RopeScaling, ValueHeadOrder,
    Variant,
};
use crate::model::weights::{LoadError, Matrix, TensorSource};
use crate::model::{gemma, olmo2, qwen35, smollm3};
use crate::ops::RopeStyle;
use crate::quant::{QMatrix, WeightBytes, WeightFormat};

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    display: String,
    content: Content,
    file: Mutex<File>,
    file_len: u64,
    /// The whole file, mapped: native matrices of whole rows borrow their
    /// bytes from it instead of copying them.
    map: Option<std::sync::Arc<memmap2::Mmap>>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let display = path.display().to_string();
        let io = |source| LoadError::Io {
            path: display.clone(),
            source,
        };
        let mut file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let content = Content::read(&mut file).map_err(|e| LoadError::Format {
            path: display.clone(),
            reason: e.to_string(),
        })?;
        // SAFETY: the map is read-only and every read of it is checked
        // against the file's length. Another process truncating or rewriting
        // the file while it is mapped would fault the process (SIGBUS) or
        // change the values read; model files are treated as immutable once
        // opened, as llama.cpp (which maps them too) does. Where mapping
        // fails (some network file systems), tensors are read and copied.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .ok()
            .map(std::sync::Arc::new);
        Ok(Self {
            path: path.to_path_buf(),
            display,
            content,
            file: Mutex::new(file),
            file_len,
            map,
        })
    }

    pub fn file_path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    fn meta_error(&self, key: &str, problem: &str) -> LoadError {
        LoadError::Metadata {
            path: self.display.clone(),
            key: key.to_string(),
            problem: problem.to_string(),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, LoadError> {
        let value = self
            .metadata()
            .get(key)
            .ok_or_else(|| self.meta_error(key, "is missing"))?;
        value
            .to_string()
            .map(String::as_str)
            .map_err(|_| self.meta_error(key, "is not a string"))
    }

    /// An integer of any width, if present.
    pub fn get_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        let Some(value) = self.metadata().get(key) else {
            return Ok(None);
        };
        let number = match value {
            Value::U8(v) => *v as i128,
            Value::I8(v) => *v as i128,
            Value::U16(v) => *v as i128,
            Value::I16(v) => *v as i128,
            Value::U32(v) => *v as i128,
            Value::I32(v) => *v as i128,
            Value::U64(v) => *v as i128,
            Value::I64(v) => *v as i128,
            _ => return Err(self.meta_error(key, "is not an integer")),
        };
        usize::try_from(number)
            .map(Some)
            .map_err(|_| self.meta_error(key, "is negative or too large"))
    }

    pub fn require_usize(&self, key: &str) -> Result<usize, LoadError> {
        self.get_usize(key)?
            .ok_or_else(|| self.meta_error(key, "is missing"))
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        match self.metadata().get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v)),
            Some(Value::F64(v)) => Ok(Some(*v as f32)),
            Some(_) => Err(self.meta_error(key, "is not a float")),
        }
    }

    /// The model configuration from `general.architecture` and its keys.
    pub fn config(&self) -> Result<ModelConfig, LoadError> {
        let name = self.get_str("general.architecture")?;
        let architecture =
            Architecture::from_name(name).ok_or_else(|| LoadError::UnsupportedArchitecture {
                path: self.display.clone(),
                name: name.to_string(),
            })?;
        let key = |suffix: &str| format!("{name}.{suffix}");
        let hidden = self.require_usize(&key("embedding_length"))?;
        let heads = self.require_usize(&key("attention.head_count"))?;
        let kv_heads = self
            .get_usize(&key("attention.head_count_kv"))?
            .unwrap_or(heads);
        let head_dim = self
            .get_usize(&key("attention.key_length"))?
            .unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let vocab = match self.get_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => self
                .metadata()
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(Vec::len)
                .or_else(|| self.shape("token_embd.weight").map(|s| s[0]))
                .ok_or_else(|| self.meta_error(&key("vocab_size"), "is missing"))?,
        };
        let rope_scaling = self.rope_scaling(name)?;
        let moe = self.moe_config(name)?;
        // Every layer may run experts, with no dense width to give.
        let ffn = match (self.get_usize(&key("feed_forward_length"))?, &moe) {
            (Some(ffn), _) => ffn,
            (None, Some(moe)) => moe.expert_ffn,
            (None, None) => self.require_usize(&key("feed_forward_length"))?,
        };
        let any_layer = |part: &str| {
            (0..self
                .get_usize(&key("block_count"))
                .ok()
                .flatten()
                .unwrap_or(0))
                .any(|i| self.contains(&format!("blk.{i}.{part}")))
        };
        let config = ModelConfig {
            architecture,
            layers: self.require_usize(&key("block_count"))?,
            hidden,
            ffn,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context_length: self.get_usize(&key("context_length"))?.unwrap_or(2048),
            norm_eps: self
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope_theta: self.get_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            // GGUF Llama q/k rows are permuted for adjacent pairs; Qwen's are not.
            // llama.cpp's converter permutes Llama-style q/k rows for
            // adjacent pairs; the other families keep halves.
            rope_style: match architecture {
                Architecture::Llama | Architecture::SmolLm3 => RopeStyle::Interleaved,
                _ => RopeStyle::Halves,
            },
            rope_scaling,
            rotary_dims: self
                .get_usize(&key("rope.dimension_count"))?
                .unwrap_or(head_dim),
            // Any layer: a hybrid model's first layers have no attention.
            qkv_bias: any_layer("attn_q.bias"),
            qk_norm: any_layer("attn_q_norm.weight"),
            tied_embeddings: !self.contains("output.weight"),
            sliding_window: self
                .get_usize(&key("attention.sliding_window"))?
                .filter(|&w| w > 0),
            moe,
            variant: Variant::default(),
        };
        let mut config = config;
        self.apply_family(name, &mut config)?;
        config.validate().map_err(|source| LoadError::Config {
            path: self.display.clone(),
            source,
        })?;
        Ok(config)
    }

    /// The family's departures from the Llama block, as llama.cpp reads
    /// them from this architecture's keys (and its fixed choices where the
    /// file has none).
    fn apply_family(&self, arch: &str, config: &mut ModelConfig) -> Result<(), LoadError> {
        let key = |suffix: &str| format!("{arch}.{suffix}");
        if self.contains("rope_factors_long.weight") {
            config.rope_scaling = self.longrope(arch, config.context_length)?;
        }
        if let Some(pattern) = self.sliding_pattern(arch, config.layers)? {
            config.variant.sliding_layers = Some(pattern);
        }
        match config.architecture {
            Architecture::SmolLm3 => {
                config.variant.rope_layers =
                    Some(smollm3::every_fourth_without_rope(config.layers));
            }
            Architecture::Olmo2 => olmo2::apply(config),
            Architecture::Qwen35 | Architecture::Qwen35Moe | Architecture::Qwen3Next => {
                config.variant.attn_output_gate = true;
                config.variant.linear = Some(self.linear_attention(arch, config)?);
            }
            Architecture::Gemma2 | Architecture::Gemma3 => {
                let gemma3 = config.architecture == Architecture::Gemma3;
                if config.sliding_window.is_none() && !gemma3 {
                    // Gemma 2's window when the file omits it.
                    config.sliding_window = Some(4096);
                }
                let variant = &mut config.variant;
                variant.post_norms = true;
                variant.activation = Activation::GeluTanh;
                variant.embedding_scale = Some((config.hidden as f32).sqrt());
                variant.attention_scale = gemma::gguf_attention_scale(
                    config.architecture,
                    config.layers,
                    config.hidden,
                    config.heads,
                );
                variant.attn_softcap = self
                    .get_f32(&key("attn_logit_softcapping"))?
                    .filter(|c| *c > 0.0 && !gemma3);
                variant.final_softcap = self
                    .get_f32(&key("final_logit_softcapping"))?
                    .filter(|c| *c > 0.0);
                if variant.sliding_layers.is_none() {
                    let every = if gemma3 { 6 } else { 2 };
                    variant.sliding_layers = Some(gemma::sliding_pattern(config.layers, every));
                }
                if gemma3 {
                    variant.local_rope_theta = Some(
                        self.get_f32(&key("rope.freq_base_swa"))?
                            .unwrap_or(10_000.0),
                    );
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The Gated DeltaNet layers of a hybrid model from `{arch}.ssm.*` and
    /// `attention.recurrent_layers` (or `full_attention_interval`).
    fn linear_attention(
        &self,
        arch: &str,
        config: &ModelConfig,
    ) -> Result<LinearAttention, LoadError> {
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let layers = match self.metadata().get(&key("attention.recurrent_layers")) {
            Some(Value::Array(flags)) => flags
                .iter()
                .map(|flag| match flag {
                    Value::Bool(b) => Ok(*b),
                    _ => Err(self.meta_error(
                        &key("attention.recurrent_layers"),
                        "is not a list of booleans",
                    )),
                })
                .collect::<Result<Vec<bool>, _>>()?,
            _ => qwen35::every_nth_full(
                config.layers,
                self.get_usize(&key("full_attention_interval"))?
                    .unwrap_or(4),
            ),
        };
        let key_heads = self.require_usize(&key("ssm.group_count"))?;
        let value_heads = self.require_usize(&key("ssm.time_step_rank"))?;
        let inner = self.require_usize(&key("ssm.inner_size"))?;
        // llama.cpp's converter tiles Qwen3.5's value heads (not
        // Qwen3-Next's) when there are more of them than key heads.
        let order = if config.architecture == Architecture::Qwen3Next {
            ValueHeadOrder::Grouped
        } else {
            ValueHeadOrder::Tiled
        };
        Ok(LinearAttention {
            layers,
            conv_kernel: self.require_usize(&key("ssm.conv_kernel"))?,
            key_heads,
            key_dim: self.require_usize(&key("ssm.state_size"))?,
            value_heads,
            value_dim: inner.checked_div(value_heads).unwrap_or(0),
            order,
        })
    }

    /// LongRoPE from the `rope_factors_long` / `rope_factors_short` tensors,
    /// `rope.scaling.original_context_length` and `rope.scaling.attn_factor`
    /// (llama.cpp's converter writes the attention factor; without it, the
    /// default for the two contexts).
    fn longrope(&self, arch: &str, context: usize) -> Result<RopeScaling, LoadError> {
        let key = |suffix: &str| format!("{arch}.rope.scaling.{suffix}");
        let original = self.require_usize(&key("original_context_length"))?;
        let attention_factor = match self.get_f32(&key("attn_factor"))? {
            Some(factor) => factor,
            None => RopeScaling::longrope_default_attention_factor(
                context as f32 / original.max(1) as f32,
                original,
            ),
        };
        Ok(RopeScaling::LongRope {
            long: self.vector("rope_factors_long.weight")?,
            short: self.vector("rope_factors_short.weight")?,
            original_context: original,
            attention_factor,
        })
    }

    /// `{arch}.attention.sliding_window_pattern`: a flag per layer, or one
    /// global layer in every this-many.
    fn sliding_pattern(&self, arch: &str, layers: usize) -> Result<Option<Vec<bool>>, LoadError> {
        let key = format!("{arch}.attention.sliding_window_pattern");
        match self.metadata().get(&key) {
            None => Ok(None),
            Some(Value::Array(flags)) => flags
                .iter()
                .map(|flag| match flag {
                    Value::Bool(b) => Ok(*b),
                    _ => Err(self.meta_error(&key, "is not a list of booleans")),
                })
                .collect::<Result<Vec<bool>, _>>()
                .map(Some),
            Some(_) => Ok(self
                .get_usize(&key)?
                .map(|every| gemma::sliding_pattern(layers, every))),
        }
    }

    /// `{arch}.rope.scaling.*`: linear or YaRN (Llama 3's comes as the
    /// `rope_freqs` tensor).
    fn rope_scaling(&self, arch: &str) -> Result<RopeScaling, LoadError> {
        let key = |suffix: &str| format!("{arch}.rope.scaling.{suffix}");
        let factor =
            || -> Result<f32, LoadError> { Ok(self.get_f32(&key("factor"))?.unwrap_or(1.0)) };
        let kind = match self.metadata().get(&key("type")) {
            Some(Value::String(kind)) => kind.as_str(),
            _ => return Ok(RopeScaling::None),
        };
        match kind {
            "none" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
            "yarn" => {
                for unsupported in ["yarn_log_multiplier", "yarn_ext_factor"] {
                    if self.metadata().contains_key(&key(unsupported)) {
                        return Err(self.meta_error(&key(unsupported), "is not supported"));
                    }
                }
                let factor = factor()?;
                Ok(RopeScaling::Yarn {
                    factor,
                    original_context: self.require_usize(&key("original_context_length"))?,
                    beta_fast: self.get_f32(&key("yarn_beta_fast"))?.unwrap_or(32.0),
                    beta_slow: self.get_f32(&key("yarn_beta_slow"))?.unwrap_or(1.0),
                    attention_factor: match self.get_f32(&key("yarn_attn_factor"))? {
                        Some(a) => a,
                        None => RopeScaling::yarn_default_attention_factor(factor),
                    },
                })
            }
            other => Err(self.meta_error(
                &key("type"),
                &format!(
                    "is `{other}`, which is not supported (linear, yarn, or llama3 via rope_freqs)"
                ),
            )),
        }
    }

    /// The experts of `{arch}.expert_count` and its kin, if any. llama.cpp
    /// renormalises the chosen experts' weights for these families unless
    /// `expert_weights_norm` says otherwise.
    fn moe_config(&self, arch: &str) -> Result<Option<MoeConfig>, LoadError> {
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let experts = self.get_usize(&key("expert_count"))?.unwrap_or(0);
        if experts == 0 {
            return Ok(None);
        }
        // One gated shared expert (Qwen3.5-MoE, Qwen3-Next); several, or
        // one without its gate (DeepSeek), would be summed differently.
        let shared_count = self.get_usize(&key("expert_shared_count"))?.unwrap_or(0);
        let shared_gate = (0..self.require_usize(&key("block_count"))?)
            .any(|i| self.contains(&format!("blk.{i}.ffn_gate_inp_shexp.weight")));
        let has_shared = (0..self.require_usize(&key("block_count"))?)
            .any(|i| self.contains(&format!("blk.{i}.ffn_gate_shexp.weight")));
        if shared_count > 1 || (has_shared && !shared_gate) {
            return Err(self.meta_error(
                &key("expert_shared_count"),
                "names shared experts without a sigmoid gate each (only one gated shared expert is supported)",
            ));
        }
        let shared_ffn = if has_shared {
            Some(self.require_usize(&key("expert_shared_feed_forward_length"))?)
        } else {
            None
        };
        let normalize_top_k = match self.metadata().get(&key("expert_weights_norm")) {
            None => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(self.meta_error(&key("expert_weights_norm"), "is not a boolean")),
        };
        let expert_ffn = match self.get_usize(&key("expert_feed_forward_length"))? {
            Some(rows) => rows,
            None => self.require_usize(&key("feed_forward_length"))?,
        };
        Ok(Some(MoeConfig {
            experts,
            experts_per_token: self.require_usize(&key("expert_used_count"))?,
            expert_ffn,
            normalize_top_k,
            shared_ffn,
        }))
    }

    /// A 2-D matrix by name: a tensor of the file, or one expert's slab of
    /// a stacked `ffn_{gate,up,down}_exps` tensor (`[experts, rows, cols]`),
    /// named `blk.{i}.ffn_{gate,up,down}.{e}.weight` as older files store
    /// them one by one.
    fn matrix_view(&self, name: &str) -> Result<MatrixView, LoadError> {
        let bad = |reason: String| LoadError::Tensor {
            path: self.display.clone(),
            tensor: name.to_string(),
            reason,
        };
        let infos = &self.content.tensor_infos;
        let found = match infos.get(name) {
            Some(info) => Some((info, None)),
            None => stacked_expert(name)
                .and_then(|(stacked, e)| infos.get(&stacked).map(|info| (info, Some(e)))),
        };
        let Some((info, expert)) = found else {
            return Err(LoadError::MissingTensor {
                path: self.display.clone(),
                tensor: name.to_string(),
            });
        };
        let dims = info.shape.dims();
        let (rows, cols, first_row) = match (dims, expert) {
            (&[rows, cols], None) => (rows, cols, 0),
            (&[experts, rows, cols], Some(e)) if e < experts => (rows, cols, e * rows),
            (_, Some(e)) => return Err(bad(format!("expert {e} of a tensor of shape {dims:?}"))),
            (_, None) => return Err(bad(format!("expected a matrix, found shape {dims:?}"))),
        };
        let dtype = info.ggml_dtype;
        let block = dtype.block_size();
        if !cols.is_multiple_of(block) {
            return Err(bad(format!(
                "{cols} columns do not fill {dtype:?} blocks of {block}"
            )));
        }
        let row_bytes = (cols / block * dtype.type_size()) as u64;
        Ok(MatrixView {
            offset: info.offset + first_row as u64 * row_bytes,
            dtype,
            rows,
            cols,
            row_bytes,
        })
    }

    fn info(
        &self,
        name: &str,
    ) -> Result<&candle_core::quantized::gguf_file::TensorInfo, LoadError> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor {
                path: self.display.clone(),
                tensor: name.to_string(),
            })
    }

    /// Reads `len` bytes at `offset` within the tensor data, bounds-checked.
    fn read_bytes(&self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, LoadError> {
        let start = self.content.tensor_data_offset.saturating_add(offset);
        if start.saturating_add(len) > self.file_len {
            return Err(LoadError::Truncated {
                path: self.display.clone(),
                tensor: name.to_string(),
                offset: start,
                needed: len,
                file_len: self.file_len,
            });
        }
        let len = usize::try_from(len).map_err(|_| LoadError::Tensor {
            path: self.display.clone(),
            tensor: name.to_string(),
            reason: "too large for this machine".into(),
        })?;
        let mut buffer = vec![0u8; len];
        let mut file = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(&mut buffer))
            .map_err(|source| LoadError::Io {
                path: self.display.clone(),
                source,
            })?;
        Ok(buffer)
    }

    /// `len` bytes at `offset` of the tensor data: a range of the mapped
    /// file where there is one, else a copy read from it.
    fn mapped_or_read(&self, name: &str, offset: u64, len: u64) -> Result<WeightBytes, LoadError> {
        let start = self.content.tensor_data_offset.saturating_add(offset);
        match &self.map {
            Some(map) if start.saturating_add(len) <= map.len() as u64 => {
                let start = start as usize;
                Ok(WeightBytes::Mapped {
                    map: map.clone(),
                    range: start..start + len as usize,
                })
            }
            _ => self.read_bytes(name, offset, len).map(WeightBytes::Owned),
        }
    }

    /// Reads `len` bytes at byte `first` of each row in `rows`.
    fn read_row_parts(
        &self,
        name: &str,
        tensor_offset: u64,
        row_bytes: u64,
        rows: Range<usize>,
        first: u64,
        len: u64,
    ) -> Result<Vec<u8>, LoadError> {
        let last_end =
            self.content.tensor_data_offset + tensor_offset + rows.end as u64 * row_bytes;
        if last_end > self.file_len {
            return Err(LoadError::Truncated {
                path: self.display.clone(),
                tensor: name.to_string(),
                offset: self.content.tensor_data_offset + tensor_offset,
                needed: rows.end as u64 * row_bytes,
                file_len: self.file_len,
            });
        }
        let mut data = vec![0u8; rows.len() * len as usize];
        let mut file = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (row, out) in rows.zip(data.chunks_exact_mut(len as usize)) {
            let at =
                self.content.tensor_data_offset + tensor_offset + row as u64 * row_bytes + first;
            file.seek(SeekFrom::Start(at))
                .and_then(|_| file.read_exact(out))
                .map_err(|source| LoadError::Io {
                    path: self.display.clone(),
                    source,
                })?;
        }
        Ok(data)
    }

    /// Wraps raw blocks: our own kernels where we have them, candle's
    /// quantized matmul for the rest.
    fn wrap_blocks(
        &self,
        name: &str,
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        data: impl Into<WeightBytes>,
    ) -> Result<Matrix, LoadError> {
        let data = data.into();
        if let Some(format) = native_format(dtype) {
            let matrix =
                QMatrix::from_bytes(format, rows, cols, data).map_err(|e| LoadError::Tensor {
                    path: self.display.clone(),
                    tensor: name.to_string(),
                    reason: e.to_string(),
                })?;
            return Ok(Matrix::Native(matrix));
        }
        let qtensor = qtensor_from_ggml(dtype, &data, vec![rows, cols], &Device::Cpu)
            .map_err(|e| self.candle_error(name, e))?;
        let inner = QMatMul::from_qtensor(qtensor).map_err(|e| self.candle_error(name, e))?;
        Ok(Matrix::Candle {
            inner,
            rows,
            cols,
            dtype: format!("{dtype:?}"),
        })
    }

    fn candle_error(&self, name: &str, error: candle_core::Error) -> LoadError {
        LoadError::Tensor {
            path: self.display.clone(),
            tensor: name.to_string(),
            reason: error.to_string(),
        }
    }
}

/// Where a matrix's rows lie in the tensor data.
struct MatrixView {
    offset: u64,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    row_bytes: u64,
}

/// `blk.{i}.ffn_gate.{e}.weight` -> (`blk.{i}.ffn_gate_exps.weight`, e).
fn stacked_expert(name: &str) -> Option<(String, usize)> {
    let rest = name.strip_prefix("blk.")?.strip_suffix(".weight")?;
    let (layer, rest) = rest.split_once('.')?;
    let (kind, expert) = rest.split_once('.')?;
    if !matches!(kind, "ffn_gate" | "ffn_up" | "ffn_down") {
        return None;
    }
    let expert = expert.parse().ok()?;
    Some((format!("blk.{layer}.{kind}_exps.weight"), expert))
}

fn native_format(dtype: GgmlDType) -> Option<WeightFormat> {
    match dtype {
        GgmlDType::F32 => Some(WeightFormat::F32),
        GgmlDType::F16 => Some(WeightFormat::F16),
        GgmlDType::Q4_0 => Some(WeightFormat::Q4_0),
        GgmlDType::Q4_1 => Some(WeightFormat::Q4_1),
        GgmlDType::Q5_0 => Some(WeightFormat::Q5_0),
        GgmlDType::Q5_1 => Some(WeightFormat::Q5_1),
        GgmlDType::Q8_0 => Some(WeightFormat::Q8_0),
        GgmlDType::Q4K => Some(WeightFormat::Q4_K),
        GgmlDType::Q5K => Some(WeightFormat::Q5_K),
        GgmlDType::Q6K => Some(WeightFormat::Q6_K),
        GgmlDType::Q2K => Some(WeightFormat::Q2_K),
        GgmlDType::Q3K => Some(WeightFormat::Q3_K),
        _ => None,
    }
}

impl TensorSource for GgufFile {
    fn path(&self) -> &str {
        &self.display
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.content.tensor_infos.get(name) {
            Some(info) => Some(info.shape.dims().to_vec()),
            None => self.matrix_view(name).ok().map(|v| vec![v.rows, v.cols]),
        }
    }

    fn matrix_part(
        &self,
        name: &str,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError> {
        let view = self.matrix_view(name)?;
        let (total_rows, total_cols) = (view.rows, view.cols);
        let rows = rows.unwrap_or(0..total_rows);
        let cols = cols.unwrap_or(0..total_cols);
        for (what, range, total) in [("rows", &rows, total_rows), ("columns", &cols, total_cols)] {
            if range.end > total || range.start >= range.end {
                return Err(LoadError::Tensor {
                    path: self.display.clone(),
                    tensor: name.to_string(),
                    reason: format!("{what} {range:?} out of 0..{total}"),
                });
            }
        }
        let dtype = view.dtype;
        let (block, block_bytes) = (dtype.block_size(), dtype.type_size());
        let row_bytes = view.row_bytes;
        let whole_rows = || {
            self.read_bytes(
                name,
                view.offset + rows.start as u64 * row_bytes,
                rows.len() as u64 * row_bytes,
            )
        };
        if cols.len() == total_cols && native_format(dtype).is_some() {
            let data = self.mapped_or_read(
                name,
                view.offset + rows.start as u64 * row_bytes,
                rows.len() as u64 * row_bytes,
            )?;
            return self.wrap_blocks(name, dtype, rows.len(), cols.len(), data);
        }
        if cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block) {
            // Whole blocks: copy them as they are, no requantizing.
            let data = if cols.len() == total_cols {
                whole_rows()?
            } else {
                let first = (cols.start / block * block_bytes) as u64;
                let len = (cols.len() / block * block_bytes) as u64;
                self.read_row_parts(name, view.offset, row_bytes, rows.clone(), first, len)?
            };
            return self.wrap_blocks(name, dtype, rows.len(), cols.len(), data);
        }
        // The column range cuts through quantization blocks (a K-quant's 256
        // values against a 64-wide head): dequantize the rows, keep the
        // columns, and store them as Q8_0 (F16 where even 32 does not fit).
        let raw = whole_rows()?;
        let values = qtensor_from_ggml(dtype, &raw, vec![rows.len(), total_cols], &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.narrow(1, cols.start, cols.len()))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| self.candle_error(name, e))?;
        let format = if cols.len().is_multiple_of(crate::quant::BLOCK) {
            WeightFormat::Q8_0
        } else {
            WeightFormat::F16
        };
        // Placement aligns tensor-parallel splits to the FFN's blocks (256
        // values for K-quants) where the FFN has enough of them; what is
        // left here is a split no aligned choice allows, so say so.
        tracing::warn!(
            tensor = name,
            ?dtype,
            columns = ?cols,
            block = block,
            ?format,
            "this shard's columns cut {dtype:?} blocks of {block}: requantized to {format:?}"
        );
        let data = crate::quant::quantize(format, &values);
        QMatrix::from_bytes(format, rows.len(), cols.len(), data)
            .map(Matrix::Native)
            .map_err(|e| LoadError::Tensor {
                path: self.display.clone(),
                tensor: name.to_string(),
                reason: e.to_string(),
            })
    }

    fn column_block(&self, name: &str) -> usize {
        self.matrix_view(name)
            .map_or(1, |view| view.dtype.block_size())
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let info = self.info(name)?;
        let len = info.shape.elem_count();
        match info.ggml_dtype {
            GgmlDType::F32 => {
                let bytes = self.read_bytes(name, info.offset, len as u64 * 4)?;
                Ok(bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect())
            }
            GgmlDType::F16 => {
                let bytes = self.read_bytes(name, info.offset, len as u64 * 2)?;
                Ok(bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect())
            }
            other => Err(LoadError::UnsupportedType {
                path: self.display.clone(),
                tensor: name.to_string(),
                dtype: format!("{other:?} (norms and biases must be F32 or F16)"),
            }),
        }
    }
}

/// Writes a GGUF of `source`'s first `layers` layers with its embeddings,
/// final norm and head, every tensor as stored (no requantizing): a draft
/// model for speculative decoding with the target's own vocabulary, where
/// no smaller sibling of the model is at hand.
pub fn write_first_layers(source: &Path, dest: &Path, layers: usize) -> Result<(), LoadError> {
    use candle_core::quantized::gguf_file;

    let display = source.display().to_string();
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| LoadError::Io {
            path: path.clone(),
            source,
        }
    };
    let format = |reason: String| LoadError::Format {
        path: display.clone(),
        reason,
    };
    let mut file = File::open(source).map_err(io(source))?;
    let content = Content::read(&mut file).map_err(|e| format(e.to_string()))?;
    let arch = match content.metadata.get("general.architecture") {
        Some(Value::String(arch)) => arch.clone(),
        _ => return Err(format("no general.architecture".into())),
    };
    let count_key = format!("{arch}.block_count");
    let total = content
        .metadata
        .get(&count_key)
        .and_then(|v| v.to_u32().ok())
        .ok_or_else(|| format(format!("no {count_key}")))? as usize;
    if layers == 0 || layers > total {
        return Err(format(format!(
            "asked for its first {layers} layers; it has {total}"
        )));
    }
    let kept = |name: &str| match name.strip_prefix("blk.") {
        Some(rest) => rest
            .split('.')
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| n < layers),
        None => true,
    };
    let mut names: Vec<&String> = content
        .tensor_infos
        .keys()
        .filter(|name| kept(name))
        .collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let info = &content.tensor_infos[name];
        let tensor = info
            .read(&mut file, content.tensor_data_offset, &Device::Cpu)
            .map_err(|e| format(format!("tensor {name}: {e}")))?;
        tensors.push((name.as_str(), tensor));
    }
    let block_count = Value::U32(layers as u32);
    let mut metadata: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(key, value)| {
            let value = if *key == count_key {
                &block_count
            } else {
                value
            };
            (key.as_str(), value)
        })
        .collect();
    metadata.sort_by_key(|(key, _)| *key);
    let refs: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(name, t)| (*name, t)).collect();
    let mut out = std::io::BufWriter::new(File::create(dest).map_err(io(dest))?);
    gguf_file::write(&mut out, &metadata, &refs).map_err(|e| LoadError::Format {
        path: dest.display().to_string(),
        reason: e.to_string(),
    })?;
    std::io::Write::flush(&mut out).map_err(io(dest))
}
