//! The forward pass on the GPU: the same layers as `layer.rs`, recorded
//! kernel after kernel into one submission per step. The CPU embeds the
//! tokens and computes each token's RoPE angles (cheap, and the same code
//! as the CPU pass, so every scaling agrees); the GPU does the rest and
//! sends back only the rows asked for: the logits of the tokens that want
//! them, or a pipeline stage's hidden states.

use crate::gpu::matvec::{GpuMatrix, Input, InputKind};
use crate::gpu::ops::{AttentionShape, Elementwise, RopeShape};
use crate::gpu::{Gpu, GpuBuffer, GpuError, GpuKv, Step};
use crate::model::config::{Activation, LayerRope};
use crate::model::paged::BLOCK_TOKENS;
use crate::ops::RopeStyle;

use super::gpu_scratch::GpuScratch;
use super::gpu_weights::{GpuLayer, GpuModel};
use super::head::cap_logits;
use super::io::{ForwardError, ForwardOutput, RowOutput, SeqSpan, StageInput};
use super::workspace::{Pass, Workspace};
use super::Transformer;
use crate::logits::{BestRows, BestToken, TOP_CANDIDATES};

impl Transformer {
    /// [`Transformer::forward_batch`] on the GPU.
    pub(super) fn forward_gpu<'w>(
        &self,
        model: &GpuModel,
        input: StageInput<'_>,
        spans: &[SeqSpan<'_>],
        output: RowOutput,
        step: Pass<'_, 'w>,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let Pass { kv, ws, .. } = step;
        let cfg = &self.config;
        let tokens = match &input {
            StageInput::Tokens(t) => t.len(),
            StageInput::Hidden(h) => h.len() / cfg.hidden,
        };
        if tokens == 0 {
            return Err(ForwardError::Empty);
        }
        self.check_spans(spans, tokens, kv)?;
        // The CPU's part: the input rows and the angles (no attention
        // scratch).
        ws.ensure(cfg, tokens, 0, 1);
        ws.index_tokens(spans);
        self.embed_input(input, tokens, ws)?;
        self.rope_angles(spans, tokens, ws);
        let blocks = kv.blocks();
        let gpu_kv = kv.gpu_mut().ok_or_else(|| {
            GpuError::Unsupported("a pool on the CPU for a shard on the GPU".into())
        })?;
        gpu_kv.ensure_blocks(blocks)?;
        let wanted: usize = spans.iter().map(|s| s.logits).sum();
        let table_words: usize = spans.iter().map(|s| s.table.len()).sum();
        let gpu = &model.gpu;
        let scratch = GpuScratch::ensure(ws.gpu.take(), gpu, cfg, [tokens, wanted, table_words]);
        self.upload_step(gpu, &scratch, spans, tokens, ws);
        let mut step = gpu.step();
        for layer in &model.layers {
            self.record_layer(&mut step, layer, &scratch, gpu_kv, tokens)?;
        }
        let rows = Rows {
            tokens,
            wanted,
            output,
        };
        let out = self.finish_gpu(model, step, &scratch, rows, ws);
        ws.gpu = Some(scratch);
        out?;
        self.gpu_output(rows, ws)
    }

    /// Writes the step's input, angles and cache addresses to the GPU.
    fn upload_step(
        &self,
        gpu: &Gpu,
        scratch: &GpuScratch,
        spans: &[SeqSpan<'_>],
        tokens: usize,
        ws: &Workspace,
    ) {
        let cfg = &self.config;
        let pairs = cfg.rotary_dims / 2;
        let floats = |b: &GpuBuffer, v: &[f32]| gpu.write(b, bytemuck::cast_slice(v));
        floats(&scratch.x, &ws.x[..tokens * cfg.hidden]);
        floats(&scratch.cos, &ws.cos[..tokens * pairs]);
        floats(&scratch.sin, &ws.sin[..tokens * pairs]);
        if cfg.variant.local_rope_theta.is_some() {
            floats(&scratch.cos_local, &ws.cos_local[..tokens * pairs]);
            floats(&scratch.sin_local, &ws.sin_local[..tokens * pairs]);
        }
        let mut starts = Vec::with_capacity(spans.len());
        let mut tables: Vec<u32> = Vec::new();
        for span in spans {
            starts.push(tables.len() as u32);
            tables.extend_from_slice(span.table);
        }
        let mut positions = Vec::with_capacity(2 * tokens);
        let mut slots = Vec::with_capacity(tokens);
        for t in 0..tokens {
            let span = &spans[ws.token_span[t] as usize];
            let position = ws.positions[t];
            positions.extend([position as u32, starts[ws.token_span[t] as usize]]);
            let block = span.table[position / BLOCK_TOKENS] as usize;
            slots.push((block * BLOCK_TOKENS + position % BLOCK_TOKENS) as u32);
        }
        let mut picked = Vec::new();
        let mut end = 0;
        for span in spans {
            end += span.len;
            picked.extend((end - span.logits..end).map(|t| t as u32));
        }
        let words = |b: &GpuBuffer, v: &[u32]| gpu.write(b, bytemuck::cast_slice(v));
        words(&scratch.positions, &positions);
        words(&scratch.slots, &slots);
        words(&scratch.tables, &tables);
        words(&scratch.picked, &picked);
    }

    /// One layer's kernels: attention, then the MLP, each with its norms
    /// and residual.
    fn record_layer(
        &self,
        step: &mut Step<'_>,
        layer: &GpuLayer,
        s: &GpuScratch,
        kv: &GpuKv,
        n: usize,
    ) -> Result<(), GpuError> {
        let cfg = &self.config;
        let (h, f) = (cfg.hidden, cfg.ffn);
        pre_norm(
            step,
            [&s.x, &s.normed],
            layer.attn_norm.as_ref(),
            n,
            h,
            cfg.norm_eps,
        )?;
        self.record_attention(step, layer, s, kv, n)?;
        let a = &layer.attention;
        block_output(
            step,
            s,
            [a.o_bias.as_ref(), layer.attn_post_norm.as_ref()],
            n,
            h,
            cfg.norm_eps,
        )?;

        pre_norm(
            step,
            [&s.x, &s.normed],
            layer.ffn_norm.as_ref(),
            n,
            h,
            cfg.norm_eps,
        )?;
        let mlp = &layer.mlp;
        project(
            step,
            [&s.normed, &s.xq, &s.xqk],
            h,
            n,
            &[(&mlp.gate, &s.gate), (&mlp.up, &s.up)],
        )?;
        add_bias(step, &s.gate, mlp.gate_bias.as_ref(), n * f, f)?;
        add_bias(step, &s.up, mlp.up_bias.as_ref(), n * f, f)?;
        let act = match mlp.activation {
            Activation::Silu => Elementwise::SiluMul,
            Activation::GeluTanh => Elementwise::GeluMul,
        };
        step.elementwise(act, [&s.gate, &s.up], n * f, 0)?;
        project(
            step,
            [&s.gate, &s.xq, &s.xqk],
            f,
            n,
            &[(&mlp.down, &s.proj)],
        )?;
        block_output(
            step,
            s,
            [mlp.down_bias.as_ref(), layer.ffn_post_norm.as_ref()],
            n,
            h,
            cfg.norm_eps,
        )
    }

    /// q, k and v from `s.normed`, their biases, norms and rotation, the
    /// cache write, attention and o_proj into `s.proj`.
    fn record_attention(
        &self,
        step: &mut Step<'_>,
        layer: &GpuLayer,
        s: &GpuScratch,
        kv: &GpuKv,
        n: usize,
    ) -> Result<(), GpuError> {
        let cfg = &self.config;
        let a = &layer.attention;
        let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let qkv = [(&a.wq, &s.q), (&a.wk, &s.k), (&a.wv, &s.v)];
        project(step, [&s.normed, &s.xq, &s.xqk], cfg.hidden, n, &qkv)?;
        add_bias(step, &s.q, a.q_bias.as_ref(), n * qd, qd)?;
        add_bias(step, &s.k, a.k_bias.as_ref(), n * kvd, kvd)?;
        add_bias(step, &s.v, a.v_bias.as_ref(), n * kvd, kvd)?;
        if let Some([(q_norm, q_width), (k_norm, k_width)]) = &a.qk_norms {
            step.rms_norm_in_place([&s.q, q_norm], n * qd / q_width, *q_width, cfg.norm_eps)?;
            step.rms_norm_in_place([&s.k, k_norm], n * kvd / k_width, *k_width, cfg.norm_eps)?;
        }
        let angles = match a.rope {
            LayerRope::Global => Some((&s.cos, &s.sin)),
            LayerRope::Local => Some((&s.cos_local, &s.sin_local)),
            LayerRope::None => None,
        };
        let pairs = cfg.rotary_dims / 2;
        if let Some((cos, sin)) = angles.filter(|_| pairs > 0) {
            let halves = cfg.rope_style == RopeStyle::Halves;
            for (x, heads) in [(&s.q, cfg.heads), (&s.k, cfg.kv_heads)] {
                let shape = RopeShape {
                    tokens: n,
                    heads,
                    head_dim: hd,
                    pairs,
                    halves,
                };
                step.rope([x, cos, sin], shape)?;
            }
        }
        let (keys, values) = kv
            .layer(a.kv_layer)
            .ok_or_else(|| GpuError::Shape(format!("no KV layer {}", a.kv_layer)))?;
        step.store_kv([&s.k, &s.v, keys, values, &s.slots], n, kvd)?;
        let shape = AttentionShape {
            tokens: n,
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: hd,
            window: a.window,
            scale: cfg
                .variant
                .attention_scale
                .unwrap_or(1.0 / (hd as f32).sqrt()),
            softcap: cfg.variant.attn_softcap,
        };
        step.attention(
            [&s.q, keys, values, &s.positions, &s.tables, &s.attn],
            shape,
        )?;
        project(step, [&s.attn, &s.xq, &s.xqk], qd, n, &[(&a.wo, &s.proj)])
    }

    /// The step's end: the final norm and head where this shard has them,
    /// then the one read back, into the CPU's workspace.
    fn finish_gpu(
        &self,
        model: &GpuModel,
        mut step: Step<'_>,
        s: &GpuScratch,
        Rows {
            tokens,
            wanted,
            output,
        }: Rows,
        ws: &mut Workspace,
    ) -> Result<(), GpuError> {
        let cfg = &self.config;
        let h = cfg.hidden;
        let norm = model
            .final_norm
            .as_ref()
            .filter(|_| self.is_last_stage() && wanted > 0);
        let Some(norm) = norm else {
            let x = step.read(&s.x, tokens * h)?;
            ws.x[..tokens * h].copy_from_slice(&x);
            return Ok(());
        };
        step.rms_norm_rows(
            [&s.x, norm, &s.normed_rows, &s.picked],
            wanted,
            h,
            cfg.norm_eps,
        )?;
        let Some(head) = &model.head else {
            let normed = step.read(&s.normed_rows, wanted * h)?;
            ws.normed[..wanted * h].copy_from_slice(&normed);
            return Ok(());
        };
        project(
            &mut step,
            [&s.normed_rows, &s.xq, &s.xqk],
            h,
            wanted,
            &[(head, &s.logits)],
        )?;
        if output != RowOutput::Logits {
            let candidates = output == RowOutput::TopCandidates;
            let softcap = cfg.variant.final_softcap;
            step.best_of_rows([&s.logits, &s.best], wanted, cfg.vocab, softcap)?;
            if candidates {
                step.top_of_rows([&s.logits, &s.best], wanted, cfg.vocab, softcap)?;
            }
            let per_row = 3 + if candidates { 2 * TOP_CANDIDATES } else { 0 };
            let words = step.read(&s.best, per_row * wanted)?;
            read_best_rows(&words, wanted, &mut ws.best);
            return Ok(());
        }
        let logits = step.read(&s.logits, wanted * cfg.vocab)?;
        if ws.logits.len() < logits.len() {
            ws.logits.resize(logits.len(), 0.0);
        }
        ws.logits[..logits.len()].copy_from_slice(&logits);
        cap_logits(&mut ws.logits[..logits.len()], cfg.variant.final_softcap);
        Ok(())
    }

    /// What [`Transformer::forward_gpu`] returns, from what
    /// [`Transformer::finish_gpu`] read back.
    fn gpu_output<'w>(
        &self,
        Rows {
            tokens,
            wanted,
            output,
        }: Rows,
        ws: &'w mut Workspace,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let (h, vocab) = (self.config.hidden, self.config.vocab);
        if !self.is_last_stage() || wanted == 0 {
            return Ok(ForwardOutput::Hidden(&ws.x[..tokens * h]));
        }
        if self.is_first_stage() && output != RowOutput::Logits {
            return Ok(ForwardOutput::Best(ws.best.view()));
        }
        if self.is_first_stage() {
            return Ok(ForwardOutput::Logits(&ws.logits[..wanted * vocab]));
        }
        Ok(ForwardOutput::Normed(&ws.normed[..wanted * h]))
    }
}

/// Each matrix of `products` times the `n` rows of `cols` in `x`, into its
/// output; `xq` and `xqk` take x's 8-bit blocks (of 32, of 256) once for
/// those that read them.
fn project(
    step: &mut Step<'_>,
    [x, xq, xqk]: [&GpuBuffer; 3],
    cols: usize,
    n: usize,
    products: &[(&GpuMatrix, &GpuBuffer)],
) -> Result<(), GpuError> {
    let takes = |kind| products.iter().any(|(m, _)| m.format.input() == kind);
    if takes(InputKind::Q8) {
        step.quantize_q8(x, xq, n, cols)?;
    }
    if takes(InputKind::Q8K) {
        step.quantize_q8k(x, xqk, n, cols)?;
    }
    for (matrix, y) in products {
        let input = match matrix.format.input() {
            InputKind::F32 => Input::F32(x),
            InputKind::Q8 => Input::Q8(xq),
            InputKind::Q8K => Input::Q8K(xqk),
        };
        step.matmul(matrix, input, y, n)?;
    }
    Ok(())
}

/// `wanted` rows' best tokens as [`Step::best_of_rows`] wrote them, then
/// their candidates if [`Step::top_of_rows`] wrote them after.
fn read_best_rows(words: &[f32], wanted: usize, out: &mut BestRows) {
    out.clear();
    let (tokens, candidates) = words.split_at((3 * wanted).min(words.len()));
    out.tokens.extend(
        tokens
            .chunks_exact(3)
            .map(|w| BestToken::from_words([w[0], w[1], w[2]])),
    );
    out.candidates
        .extend(candidates.chunks_exact(2).map(|w| (w[0].to_bits(), w[1])));
}

/// A step's rows: its tokens, the rows that want logits, and what they
/// want.
#[derive(Clone, Copy)]
struct Rows {
    tokens: usize,
    wanted: usize,
    output: RowOutput,
}

/// `out = norm(x)`, or a copy of `x` for a family without this norm.
fn pre_norm(
    step: &mut Step<'_>,
    [x, out]: [&GpuBuffer; 2],
    norm: Option<&GpuBuffer>,
    n: usize,
    h: usize,
    eps: f32,
) -> Result<(), GpuError> {
    match norm {
        Some(weight) => step.rms_norm([x, weight, out], n, h, eps),
        None => step.elementwise(Elementwise::Copy, [out, x], n * h, 0),
    }
}

fn add_bias(
    step: &mut Step<'_>,
    x: &GpuBuffer,
    bias: Option<&GpuBuffer>,
    count: usize,
    width: usize,
) -> Result<(), GpuError> {
    match bias {
        Some(bias) => step.elementwise(Elementwise::AddBias, [x, bias], count, width),
        None => Ok(()),
    }
}

/// A block's end: its bias and post-norm on `s.proj`, then `x += proj`.
fn block_output(
    step: &mut Step<'_>,
    s: &GpuScratch,
    [bias, post_norm]: [Option<&GpuBuffer>; 2],
    n: usize,
    h: usize,
    eps: f32,
) -> Result<(), GpuError> {
    add_bias(step, &s.proj, bias, n * h, h)?;
    if let Some(norm) = post_norm {
        step.rms_norm_in_place([&s.proj, norm], n, h, eps)?;
    }
    step.elementwise(Elementwise::Add, [&s.x, &s.proj], n * h, 0)
}
