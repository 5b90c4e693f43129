//! A shard's weights on the GPU: [`Transformer::to_gpu`] uploads them
//! once, after which [`Transformer::forward_batch`] runs on the GPU
//! (`gpu_forward.rs`) with the same spans, block tables and results.
//!
//! What runs there: dense attention layers (grouped-query, biases, q/k
//! norms per head or across heads, post-norms, sliding windows, soft caps,
//! every RoPE the CPU computes, since the angles come from it) with SwiGLU
//! or GeGLU MLPs or a mixture of SwiGLU experts (with a shared expert or
//! not), gated attention, and the Gated DeltaNet layers of the hybrid
//! Qwens. A tensor-parallel rank runs its dense attention and MLP layers
//! there (`gpu_tensor.rs`); experts, linear attention and q/k norms across
//! heads on such a rank are refused, and stay on the CPU.

use std::borrow::Cow;
use std::sync::Arc;

use crate::gpu::deltanet::{LinearShape, MOST_TAPS};
use crate::gpu::matvec::{Format, GpuExperts, GpuMatrix};
use crate::gpu::ops::MAX_HEAD_DIM;
use crate::gpu::{DeviceChoice, Gpu, GpuBuffer, GpuError, GpuKv};
use crate::model::config::Activation;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::moe::{ExpertMatrix, Experts};
use crate::model::paged::{KvPool, BLOCK_TOKENS};
use crate::model::weights::Matrix;
use crate::quant::{QMatrix, WeightFormat};

use super::gpu_weights::{
    GpuAttention, GpuFfn, GpuLayer, GpuLinear, GpuMixer, GpuMlp, GpuModel, GpuMoe, GpuSharedExpert,
};
use super::{Attention, Layer, Mixer, Mlp, Transformer};

impl Transformer {
    /// Uploads this shard's weights to `gpu`; from then on its forward
    /// passes run there, over pools from [`Transformer::new_pool`]. A shard
    /// the GPU cannot run yet is refused with the reason, and stays as it
    /// was.
    pub fn to_gpu(&mut self, gpu: Arc<Gpu>) -> Result<(), GpuError> {
        self.check_gpu_support()?;
        let upload = Upload { gpu: &gpu };
        let layers = self
            .layers
            .iter()
            .map(|layer| upload.layer(layer, self.config.variant.activation))
            .collect::<Result<Vec<_>, _>>()?;
        // A tensor rank's head (its rows of the vocabulary) stays on the
        // CPU, where the ranks' rows are put together.
        let whole_model = self.is_first_stage() && self.is_last_stage();
        let head = if whole_model && self.tensor.is_none() {
            Some(
                upload.matrix(
                    self.whole_head()
                        .map_err(|e| GpuError::Unsupported(e.to_string()))?,
                )?,
            )
        } else {
            None
        };
        let final_norm = upload.vector(self.final_norm.as_deref());
        let mut model = GpuModel {
            gpu,
            layers,
            final_norm,
            head,
            bytes: 0,
        };
        model.bytes = model.weight_bytes();
        self.gpu = Some(model);
        Ok(())
    }

    /// Puts this shard where `choice` says, and says where it runs: on a
    /// GPU (its adapter's name and backend) or on the CPU. `auto` takes a
    /// hardware GPU whose memory holds the weights (where it is known) when
    /// the shard runs there, else stays on the CPU (and logs why); `gpu`
    /// and `gpu:N` fail instead.
    pub fn use_device(&mut self, choice: DeviceChoice) -> Result<String, GpuError> {
        let index = match choice {
            DeviceChoice::Cpu => return Ok("cpu".into()),
            DeviceChoice::Gpu(index) => index,
            DeviceChoice::Auto => match crate::gpu::adapter_for(self.weight_bytes() as u64) {
                Some(index) => Some(index),
                None => return Ok("cpu".into()),
            },
        };
        let placed = Gpu::open(index).and_then(|gpu| self.to_gpu(Arc::new(gpu)));
        match placed {
            Err(error) if choice == DeviceChoice::Auto => {
                tracing::warn!(%error, "the GPU cannot take this model: it runs on the CPU");
                Ok("cpu".into())
            }
            placed => placed.map(|()| self.device_name()),
        }
    }

    /// Where this shard runs: `cpu`, or `gpu:N`, the adapter's name and
    /// its backend.
    pub fn device_name(&self) -> String {
        match self.gpu() {
            Some(gpu) => format!(
                "gpu:{} {} ({})",
                gpu.report.index, gpu.report.name, gpu.report.backend
            ),
            None => "cpu".into(),
        }
    }

    /// The adapter this shard runs on, if it runs on a GPU.
    pub fn gpu(&self) -> Option<&Arc<Gpu>> {
        self.gpu.as_ref().map(|m| &m.gpu)
    }

    /// The most KV blocks this shard's GPU holds: what one layer's buffer
    /// may take, and, where the adapter's own memory is known, what is
    /// left of nine tenths of it beside the weights. `None` on the CPU.
    pub fn gpu_kv_blocks(&self) -> Option<usize> {
        let model = self.gpu.as_ref()?;
        let kv_dim = self.config.kv_dim();
        let layer_block = (BLOCK_TOKENS * kv_dim * 2) as u64;
        let mut blocks = model.gpu.max_binding_bytes() / layer_block.max(1);
        let report = &model.gpu.report;
        if report.memory_bytes > 0 && !report.unified_memory {
            let free = (report.memory_bytes / 10 * 9).saturating_sub(model.bytes);
            let all_layers = 2 * layer_block * self.kv_layers.max(1) as u64;
            blocks = blocks.min(free / all_layers);
        }
        Some(blocks as usize)
    }

    /// Bytes of weights on the GPU (0 on the CPU).
    pub fn gpu_weight_bytes(&self) -> u64 {
        self.gpu.as_ref().map_or(0, |m| m.bytes)
    }

    /// A pool whose keys and values live on this shard's GPU.
    pub(super) fn gpu_pool(&self, model: &GpuModel) -> KvPool {
        let kv_dim = self.config.kv_dim();
        let block_bytes = (BLOCK_TOKENS * kv_dim * 2) as u64;
        let kv =
            GpuKv::new(model.gpu.clone(), self.kv_layers, block_bytes).with_state(self.state_len);
        KvPool::new(self.kv_layers, kv_dim)
            .with_state(self.state_len)
            .on_gpu(kv)
    }

    fn check_gpu_support(&self) -> Result<(), GpuError> {
        let cfg = &self.config;
        let refuse = |what: &str| Err(GpuError::Unsupported(what.to_string()));
        if self.tensor.is_some() {
            if let Some(what) = self.layers.iter().find_map(tensor_rank_lacks) {
                return refuse(&format!("{what} on a tensor-parallel rank"));
            }
        }
        if cfg.head_dim > MAX_HEAD_DIM || !cfg.head_dim.is_multiple_of(2) {
            return refuse(&format!(
                "a head dimension of {} (at most {MAX_HEAD_DIM}, even)",
                cfg.head_dim
            ));
        }
        for layer in &self.layers {
            if let Mixer::Linear { net, .. } = &layer.mixer {
                let kernel = net.parts().kernel;
                if kernel == 0 || kernel > MOST_TAPS {
                    return refuse(&format!(
                        "a convolution of {kernel} taps (at most {MOST_TAPS})"
                    ));
                }
            }
        }
        if self.is_last_stage() && self.final_norm.is_none() {
            return refuse("a last stage without a final norm");
        }
        Ok(())
    }
}

/// What of `layer` a tensor rank on the GPU cannot run yet: its gathers
/// are those of the dense attention and MLP only.
fn tensor_rank_lacks(layer: &Layer) -> Option<&'static str> {
    match (&layer.mixer, &layer.mlp) {
        (Mixer::Linear { .. }, _) => Some("linear attention"),
        (_, Mlp::Experts(_)) => Some("a mixture of experts"),
        (Mixer::Attention(a), _) if a.qk_norm_widths.is_some() => {
            Some("q and k normed across heads (OLMo 2)")
        }
        _ => None,
    }
}

struct Upload<'g> {
    gpu: &'g Gpu,
}

impl Upload<'_> {
    fn vector(&self, values: Option<&[f32]>) -> Option<GpuBuffer> {
        values.map(|v| self.gpu.buffer_with("vector", bytemuck::cast_slice(v)))
    }

    fn layer(&self, layer: &Layer, activation: Activation) -> Result<GpuLayer, GpuError> {
        let mixer = match &layer.mixer {
            Mixer::Attention(attn) => GpuMixer::Attention(self.attention(attn)?),
            Mixer::Linear { net, state_offset } => {
                GpuMixer::Linear(self.linear(net, *state_offset)?)
            }
        };
        let mlp = match &layer.mlp {
            Mlp::Dense {
                w_gate,
                w_up,
                w_down,
                gate_bias,
                up_bias,
                down_bias,
            } => GpuFfn::Dense(GpuMlp {
                gate: self.matrix(w_gate)?,
                up: self.matrix(w_up)?,
                down: self.matrix(w_down)?,
                gate_bias: self.vector(gate_bias.as_deref()),
                up_bias: self.vector(up_bias.as_deref()),
                down_bias: self.vector(down_bias.as_deref()),
                activation,
            }),
            Mlp::Experts(experts) => GpuFfn::Experts(self.experts(experts)?),
        };
        Ok(GpuLayer {
            attn_norm: self.vector(layer.attn_norm.as_deref()),
            attn_post_norm: self.vector(layer.attn_post_norm.as_deref()),
            ffn_norm: self.vector(layer.ffn_norm.as_deref()),
            ffn_post_norm: self.vector(layer.ffn_post_norm.as_deref()),
            mixer,
            mlp,
        })
    }

    /// A layer's router, and each of its gate, up and down matrices as one
    /// buffer of every expert's.
    fn experts(&self, experts: &Experts) -> Result<GpuMoe, GpuError> {
        let moe = experts.config();
        let matrices = experts.expert_matrices();
        let stack = |which: usize| -> Result<GpuExperts, GpuError> {
            let parts = matrices
                .iter()
                .map(|m| expert_bytes(m[which]))
                .collect::<Result<Vec<_>, _>>()?;
            let Some((format, rows, cols)) = parts.first().map(|p| (p.0, p.1, p.2)) else {
                return Err(GpuError::Unsupported("a layer of no experts".into()));
            };
            if parts.iter().any(|p| p.0 != format) {
                return Err(GpuError::Unsupported(
                    "experts whose matrices differ in format".into(),
                ));
            }
            let bytes: Vec<&[u8]> = parts.iter().map(|p| p.3.as_ref()).collect();
            self.gpu.upload_experts(format, &bytes, rows, cols)
        };
        let shared = match experts.shared_expert() {
            Some(([gate, up, down], gate_vector)) => Some(GpuSharedExpert {
                gate: self.matrix(gate)?,
                up: self.matrix(up)?,
                down: self.matrix(down)?,
                gate_vector: self
                    .gpu
                    .buffer_with("shared gate", bytemuck::cast_slice(gate_vector)),
            }),
            None => None,
        };
        Ok(GpuMoe {
            shared,
            router: self.matrix(experts.router())?,
            gate: stack(0)?,
            up: stack(1)?,
            down: stack(2)?,
            per_token: moe.experts_per_token,
            normalize: moe.normalize_top_k,
        })
    }

    fn attention(&self, attn: &Attention) -> Result<GpuAttention, GpuError> {
        let qk_norms = match (&attn.q_norm, &attn.k_norm) {
            (Some(q), Some(k)) => Some([
                (
                    self.gpu.buffer_with("q norm", bytemuck::cast_slice(q)),
                    q.len(),
                ),
                (
                    self.gpu.buffer_with("k norm", bytemuck::cast_slice(k)),
                    k.len(),
                ),
            ]),
            _ => None,
        };
        Ok(GpuAttention {
            kv_layer: attn.kv_layer,
            window: attn.window,
            rope: attn.rope,
            wq: self.matrix(&attn.wq)?,
            wk: self.matrix(&attn.wk)?,
            wv: self.matrix(&attn.wv)?,
            wo: self.matrix(&attn.wo)?,
            q_bias: self.vector(attn.q_bias.as_deref()),
            k_bias: self.vector(attn.k_bias.as_deref()),
            v_bias: self.vector(attn.v_bias.as_deref()),
            o_bias: self.vector(attn.o_bias.as_deref()),
            qk_norms,
            output_gate: attn.output_gate,
        })
    }

    /// A Gated DeltaNet layer holding every head.
    fn linear(&self, net: &GatedDeltaNet, state_offset: usize) -> Result<GpuLinear, GpuError> {
        let parts = net.parts();
        let ([w_v], [w_z]) = (parts.w_v, parts.w_z) else {
            return Err(GpuError::Unsupported(
                "a linear-attention layer split into runs of heads".into(),
            ));
        };
        let value_heads = parts.key_of.len();
        let key_heads = parts.key_heads.max(1);
        let per_key = (value_heads / key_heads).max(1);
        let grouped = (0..value_heads).all(|j| parts.key_of[j] == j / per_key);
        let tiled = (0..value_heads).all(|j| parts.key_of[j] == j % key_heads);
        let grouped = match (grouped, tiled) {
            (true, _) => Some(per_key),
            (false, true) => None,
            _ => {
                return Err(GpuError::Unsupported(
                    "value heads in an order neither grouped nor tiled".into(),
                ))
            }
        };
        let mut head_gates = Vec::with_capacity(4 * value_heads);
        for j in 0..value_heads {
            head_gates.extend([
                parts.beta_index[j] as u32,
                parts.alpha_index[j] as u32,
                parts.decay[j].to_bits(),
                parts.dt_bias[j].to_bits(),
            ]);
        }
        let words = |label, v: &[u32]| self.gpu.buffer_with(label, bytemuck::cast_slice(v));
        let floats = |label, v: &[f32]| self.gpu.buffer_with(label, bytemuck::cast_slice(v));
        Ok(GpuLinear {
            shape: LinearShape {
                key_heads: parts.key_heads,
                key_dim: parts.key_dim,
                value_heads,
                value_dim: parts.value_dim,
                kernel: parts.kernel,
                grouped,
            },
            q: self.matrix(parts.w_q)?,
            k: self.matrix(parts.w_k)?,
            v: self.matrix(w_v)?,
            z: self.matrix(w_z)?,
            out: self.matrix(parts.w_out)?,
            beta: self.matrix(parts.beta)?,
            alpha: parts.alpha.map(|a| self.matrix(a)).transpose()?,
            ba_width: parts.ba_width,
            taps: floats("conv taps", parts.conv),
            head_gates: words("head gates", &head_gates),
            norm: floats("gated norm", parts.norm),
            eps: parts.eps,
            state_offset,
        })
    }

    /// A matrix as the file stores it (every native format has a GPU
    /// kernel); candle's other formats as bf16 where they are bf16, else
    /// dequantized to f32 (correct, but 4 bytes a value).
    fn matrix(&self, matrix: &Matrix) -> Result<GpuMatrix, GpuError> {
        let (format, rows, cols, bytes) = matrix_bytes(matrix)?;
        self.gpu.upload_bytes(format, &bytes, rows, cols)
    }
}

/// A matrix's format, shape and bytes as the GPU reads them.
type GpuBytes<'m> = (Format, usize, usize, Cow<'m, [u8]>);

fn expert_bytes(matrix: ExpertMatrix<'_>) -> Result<GpuBytes<'_>, GpuError> {
    match matrix {
        ExpertMatrix::Native(m) => Ok(native_bytes(m)),
        ExpertMatrix::Other(m) => matrix_bytes(m),
    }
}

fn matrix_bytes(matrix: &Matrix) -> Result<GpuBytes<'_>, GpuError> {
    match matrix {
        Matrix::Native(m) => Ok(native_bytes(m)),
        Matrix::Candle { inner, .. } => candle_bytes(inner, matrix.rows(), matrix.cols()),
    }
}

/// Our formats as stored, but f32 (its bytes need not be aligned to f32)
/// and f16 of odd width (its kernel reads pairs) as f32 values.
fn native_bytes(m: &QMatrix) -> GpuBytes<'_> {
    let (rows, cols) = (m.rows(), m.cols());
    let format = match m.format() {
        WeightFormat::F32 => Format::F32,
        WeightFormat::F16 => Format::F16,
        WeightFormat::Q8_0 => Format::Q8_0,
        WeightFormat::Q4_0 => Format::Q4_0,
        WeightFormat::Q4_1 => Format::Q4_1,
        WeightFormat::Q5_0 => Format::Q5_0,
        WeightFormat::Q5_1 => Format::Q5_1,
        WeightFormat::Q4_K => Format::Q4K,
        WeightFormat::Q5_K => Format::Q5K,
        WeightFormat::Q6_K => Format::Q6K,
        WeightFormat::Q2_K => Format::Q2K,
        WeightFormat::Q3_K => Format::Q3K,
    };
    if format != Format::F32 && cols.is_multiple_of(format.block_values()) {
        return (format, rows, cols, Cow::Borrowed(m.bytes()));
    }
    let mut values = vec![0.0f32; rows * cols];
    for (r, row) in values.chunks_exact_mut(cols).enumerate() {
        m.dequantize_row(r, row);
    }
    let bytes = bytemuck::cast_slice(&values).to_vec();
    (Format::F32, rows, cols, Cow::Owned(bytes))
}

/// A matrix candle holds: bf16 as it is (when the columns are even),
/// anything else as f32.
fn candle_bytes(
    inner: &candle_core::quantized::QMatMul,
    rows: usize,
    cols: usize,
) -> Result<GpuBytes<'static>, GpuError> {
    use candle_core::quantized::QMatMul;
    use candle_core::DType;
    let failed = |e: candle_core::Error| GpuError::Unsupported(format!("reading a matrix: {e}"));
    if let QMatMul::Tensor(t) = inner {
        if t.dtype() == DType::BF16 && cols.is_multiple_of(2) {
            let values = t
                .flatten_all()
                .and_then(|t| t.to_vec1::<half::bf16>())
                .map_err(failed)?;
            let bytes = bytemuck::cast_slice(&values).to_vec();
            return Ok((Format::Bf16, rows, cols, Cow::Owned(bytes)));
        }
    }
    let values = inner
        .dequantize_f16()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(failed)?;
    let bytes = bytemuck::cast_slice(&values).to_vec();
    Ok((Format::F32, rows, cols, Cow::Owned(bytes)))
}
