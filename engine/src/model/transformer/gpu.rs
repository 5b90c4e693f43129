//! A shard's weights on the GPU: [`Transformer::to_gpu`] uploads them
//! once, after which [`Transformer::forward_batch`] runs on the GPU
//! (`gpu_forward.rs`) with the same spans, block tables and results.
//!
//! What runs there: dense attention layers (grouped-query, biases, q/k
//! norms per head or across heads, post-norms, sliding windows, soft caps,
//! every RoPE the CPU computes, since the angles come from it) with SwiGLU
//! or GeGLU MLPs. A shard with experts, linear-attention layers, gated
//! attention or a tensor split stays on the CPU, and says so.

use std::sync::Arc;

use crate::gpu::matvec::{Format, GpuMatrix};
use crate::gpu::ops::MAX_HEAD_DIM;
use crate::gpu::{DeviceChoice, Gpu, GpuBuffer, GpuError, GpuKv};
use crate::model::config::Activation;
use crate::model::paged::{KvPool, BLOCK_TOKENS};
use crate::model::weights::Matrix;
use crate::quant::WeightFormat;

use super::gpu_weights::{GpuAttention, GpuLayer, GpuMlp, GpuModel};
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
        let head = if self.is_first_stage() && self.is_last_stage() {
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
        let kv = GpuKv::new(model.gpu.clone(), self.kv_layers, block_bytes);
        KvPool::new(self.kv_layers, kv_dim).on_gpu(kv)
    }

    fn check_gpu_support(&self) -> Result<(), GpuError> {
        let cfg = &self.config;
        let refuse = |what: &str| Err(GpuError::Unsupported(what.to_string()));
        if self.tensor.is_some() {
            return refuse("a tensor-parallel rank (its collectives run on the CPU)");
        }
        if cfg.head_dim > MAX_HEAD_DIM || !cfg.head_dim.is_multiple_of(2) {
            return refuse(&format!(
                "a head dimension of {} (at most {MAX_HEAD_DIM}, even)",
                cfg.head_dim
            ));
        }
        if cfg.variant.attn_output_gate {
            return refuse("gated attention (Qwen3.5)");
        }
        for layer in &self.layers {
            match (&layer.mixer, &layer.mlp) {
                (Mixer::Linear { .. }, _) => {
                    return refuse("linear-attention (Gated DeltaNet) layers")
                }
                (_, Mlp::Experts(_)) => return refuse("mixture-of-experts layers"),
                _ => {}
            }
        }
        if self.is_last_stage() && self.final_norm.is_none() {
            return refuse("a last stage without a final norm");
        }
        Ok(())
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
        let (
            Mixer::Attention(attn),
            Mlp::Dense {
                w_gate,
                w_up,
                w_down,
                gate_bias,
                up_bias,
                down_bias,
            },
        ) = (&layer.mixer, &layer.mlp)
        else {
            return Err(GpuError::Unsupported(
                "a layer other than attention and a dense MLP".into(),
            ));
        };
        Ok(GpuLayer {
            attn_norm: self.vector(layer.attn_norm.as_deref()),
            attn_post_norm: self.vector(layer.attn_post_norm.as_deref()),
            ffn_norm: self.vector(layer.ffn_norm.as_deref()),
            ffn_post_norm: self.vector(layer.ffn_post_norm.as_deref()),
            attention: self.attention(attn)?,
            mlp: GpuMlp {
                gate: self.matrix(w_gate)?,
                up: self.matrix(w_up)?,
                down: self.matrix(w_down)?,
                gate_bias: self.vector(gate_bias.as_deref()),
                up_bias: self.vector(up_bias.as_deref()),
                down_bias: self.vector(down_bias.as_deref()),
                activation,
            },
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
        })
    }

    /// A matrix as the file stores it (every native format has a GPU
    /// kernel); candle's other formats as bf16 where they are bf16, else
    /// dequantized to f32 (correct, but 4 bytes a value).
    fn matrix(&self, matrix: &Matrix) -> Result<GpuMatrix, GpuError> {
        let (rows, cols) = (matrix.rows(), matrix.cols());
        match matrix {
            Matrix::Native(m) => {
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
                    return self.gpu.upload_blocks(format, m.bytes(), rows, cols);
                }
                // f32 (its bytes need not be aligned to f32), or an f16
                // matrix of odd width (its kernel reads pairs).
                let mut values = vec![0.0f32; rows * cols];
                for (r, row) in values.chunks_exact_mut(cols).enumerate() {
                    m.dequantize_row(r, row);
                }
                self.gpu.upload_f32(&values, rows, cols)
            }
            Matrix::Candle { inner, .. } => self.candle_matrix(inner, rows, cols),
        }
    }

    /// A matrix candle holds: bf16 as it is (when the columns are even),
    /// anything else as f32.
    fn candle_matrix(
        &self,
        inner: &candle_core::quantized::QMatMul,
        rows: usize,
        cols: usize,
    ) -> Result<GpuMatrix, GpuError> {
        use candle_core::quantized::QMatMul;
        use candle_core::DType;
        let failed =
            |e: candle_core::Error| GpuError::Unsupported(format!("reading a matrix: {e}"));
        if let QMatMul::Tensor(t) = inner {
            if t.dtype() == DType::BF16 && cols.is_multiple_of(2) {
                let values = t
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<half::bf16>())
                    .map_err(failed)?;
                let bytes: &[u8] = bytemuck::cast_slice(&values);
                return self.gpu.upload_blocks(Format::Bf16, bytes, rows, cols);
            }
        }
        let values = inner
            .dequantize_f16()
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(failed)?;
        self.gpu.upload_f32(&values, rows, cols)
    }
}
