//! The forward pass on the GPU: the same layers as `layer.rs`, recorded
//! kernel after kernel into one submission per step. The CPU embeds the
//! tokens and computes each token's RoPE angles (cheap, and the same code
//! as the CPU pass, so every scaling agrees); the GPU does the rest and
//! sends back only the rows asked for: the logits of the tokens that want
//! them, or a pipeline stage's hidden states.

use crate::gpu::deltanet::{Section, StateAt};
use crate::gpu::matvec::{GpuExperts, Input, InputKind};
use crate::gpu::moe::Routing;
use crate::gpu::ops::{AttentionShape, Elementwise, RopeShape};
use crate::gpu::{Gpu, GpuBuffer, GpuError, GpuKv, Step};
use crate::model::config::{Activation, LayerRope};
use crate::model::paged::{BLOCK_TOKENS, MAX_STATE_SLOTS};
use crate::ops::RopeStyle;

use super::gpu_project::project;
use super::gpu_scratch::GpuScratch;
use super::gpu_tensor::{Projected, TensorRanks};
use super::gpu_weights::{
    GpuAttention, GpuFfn, GpuLayer, GpuLinear, GpuMixer, GpuMlp, GpuModel, GpuMoe,
};
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
        let Pass {
            kv,
            ws,
            pool,
            group,
        } = step;
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
        if self.state_len > 0 {
            let slots = spans.iter().map(|s| s.state + 1).max().unwrap_or(0);
            if slots > MAX_STATE_SLOTS {
                return Err(ForwardError::StateSlot {
                    slot: slots - 1,
                    reason: "beyond the most slots a pool holds",
                });
            }
            gpu_kv.ensure_state_slots(slots)?;
        }
        let wanted: usize = spans.iter().map(|s| s.logits).sum();
        let table_words: usize = spans.iter().map(|s| s.table.len()).sum();
        let gpu = &model.gpu;
        let whole = self
            .tensor
            .as_ref()
            .map_or(0, |t| t.layout.attention.width().max(t.layout.ffn.width()));
        let sizes = [tokens, wanted, table_words, whole];
        let scratch = GpuScratch::ensure(ws.gpu.take(), gpu, cfg, sizes);
        self.upload_step(gpu, &scratch, spans, tokens, ws);
        let mut step = gpu.step();
        let n = [tokens, spans.len()];
        let mut tensor = self.tensor.as_ref().map(|t| TensorRanks {
            layout: &t.layout,
            group: &mut *group,
            gathers: &mut ws.gathers,
        });
        let recorded = model.layers.iter().try_for_each(|layer| {
            self.record_layer(&mut step, layer, &scratch, (gpu_kv, tensor.as_mut()), n)
        });
        if let Err(error) = recorded {
            ws.gpu = Some(scratch);
            return Err(error);
        }
        let rows = Rows {
            tokens,
            wanted,
            output,
        };
        let out = self.finish_gpu(model, step, &scratch, rows, ws);
        ws.gpu = Some(scratch);
        out?;
        // A tensor rank's head is its rows of the vocabulary, on the CPU,
        // over the normed rows read back (see `Transformer::head`).
        if self.tensor.is_some() && self.is_last_stage() && wanted > 0 {
            return self.head(wanted, output, ws, pool, group);
        }
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
        if self.state_len > 0 {
            let mut first = 0;
            let mut seq = Vec::with_capacity(4 * spans.len());
            for span in spans {
                let fresh = span.start == 0;
                seq.extend([
                    first as u32,
                    span.len as u32,
                    span.state as u32,
                    fresh.into(),
                ]);
                first += span.len;
            }
            words(&scratch.linear.spans, &seq);
        }
    }

    /// One layer's kernels: attention, then the MLP, each with its norms
    /// and residual (on a tensor rank, with its gathers).
    fn record_layer(
        &self,
        step: &mut Step<'_>,
        layer: &GpuLayer,
        s: &GpuScratch,
        (kv, mut tensor): (&GpuKv, Option<&mut TensorRanks<'_>>),
        [n, span_count]: [usize; 2],
    ) -> Result<(), ForwardError> {
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
        let o_bias = match &layer.mixer {
            GpuMixer::Attention(a) => {
                self.record_attention(step, a, s, kv, n)?;
                match tensor.as_deref_mut() {
                    Some(t) => t.project(step, (&a.wo, &s.attn, Projected::Attention), s, n)?,
                    None => project(
                        step,
                        [&s.attn, &s.xq, &s.xqk],
                        cfg.q_dim(),
                        n,
                        &[(&a.wo, &s.proj)],
                    )?,
                }
                a.o_bias.as_ref()
            }
            GpuMixer::Linear(linear) => {
                let states = (kv.states(), kv.state_floats());
                record_linear(step, linear, s, states, [n, span_count, h])?;
                None
            }
        };
        block_output(
            step,
            s,
            [o_bias, layer.attn_post_norm.as_ref()],
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
        let down_bias = match &layer.mlp {
            GpuFfn::Dense(mlp) => {
                record_mlp(step, mlp, s, [n, h, f])?;
                match tensor {
                    Some(t) => t.project(step, (&mlp.down, &s.gate, Projected::Mlp), s, n)?,
                    None => project(
                        step,
                        [&s.gate, &s.xq, &s.xqk],
                        f,
                        n,
                        &[(&mlp.down, &s.proj)],
                    )?,
                }
                mlp.down_bias.as_ref()
            }
            GpuFfn::Experts(moe) => {
                record_experts(step, moe, s, [n, h])?;
                None
            }
        };
        block_output(
            step,
            s,
            [down_bias, layer.ffn_post_norm.as_ref()],
            n,
            h,
            cfg.norm_eps,
        )?;
        Ok(())
    }

    /// q, k and v from `s.normed`, their biases, norms and rotation, the
    /// cache write and attention into `s.attn` (o_proj is the caller's).
    fn record_attention(
        &self,
        step: &mut Step<'_>,
        a: &GpuAttention,
        s: &GpuScratch,
        kv: &GpuKv,
        n: usize,
    ) -> Result<(), GpuError> {
        let cfg = &self.config;
        let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let q_out = if a.output_gate { &s.q_gated } else { &s.q };
        let qkv = [(&a.wq, q_out), (&a.wk, &s.k), (&a.wv, &s.v)];
        project(step, [&s.normed, &s.xq, &s.xqk], cfg.hidden, n, &qkv)?;
        if a.output_gate {
            // Each head's q, then its gate.
            step.elementwise(Elementwise::FirstHalves, [&s.q, &s.q_gated], n * qd, hd)?;
            step.elementwise(
                Elementwise::SecondHalves,
                [&s.attn_gate, &s.q_gated],
                n * qd,
                hd,
            )?;
        }
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
            group: self.heads.group,
            q_first: self.heads.q_first,
            kv_first: self.heads.kv_first,
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
        if a.output_gate {
            step.elementwise(Elementwise::SigmoidMul, [&s.attn, &s.attn_gate], n * qd, 0)?;
        }
        Ok(())
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

/// The dense MLP's activations over `s.normed` (`n x h`, `f` intermediate
/// rows) into `s.gate` (the down projection is the caller's).
fn record_mlp(
    step: &mut Step<'_>,
    mlp: &GpuMlp,
    s: &GpuScratch,
    [n, h, f]: [usize; 3],
) -> Result<(), GpuError> {
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
    step.elementwise(act, [&s.gate, &s.up], n * f, 0)
}

/// A mixture of experts over `s.normed` (`n x h`) into `s.proj`: the
/// router's logits, each token's experts (`s.routes`), their SwiGLU
/// products one row per (token, expert), and the weighted sum.
fn record_experts(
    step: &mut Step<'_>,
    moe: &GpuMoe,
    s: &GpuScratch,
    [n, h]: [usize; 2],
) -> Result<(), GpuError> {
    let routing = Routing {
        tokens: n,
        experts: moe.gate.experts,
        per_token: moe.per_token,
        normalize: moe.normalize,
    };
    let (k, f) = (moe.per_token, moe.gate.rows);
    project(
        step,
        [&s.normed, &s.xq, &s.xqk],
        h,
        n,
        &[(&moe.router, &s.router)],
    )?;
    step.route_experts([&s.router, &s.routes], routing)?;
    let products = [(&moe.gate, &s.expert_gate), (&moe.up, &s.expert_up)];
    let input = RoutedInput {
        x: [&s.normed, &s.xq, &s.xqk],
        cols: h,
        rows: n,
        x_per: k,
    };
    project_routed(step, input, &products, &s.routes)?;
    step.elementwise(
        Elementwise::SiluMul,
        [&s.expert_gate, &s.expert_up],
        n * k * f,
        0,
    )?;
    let input = RoutedInput {
        x: [&s.expert_gate, &s.xq, &s.xqk],
        cols: f,
        rows: n * k,
        x_per: 1,
    };
    project_routed(step, input, &[(&moe.down, &s.expert_out)], &s.routes)?;
    step.sum_experts([&s.expert_out, &s.routes, &s.proj], [n, k, h])?;
    let Some(shared) = &moe.shared else {
        return Ok(());
    };
    let f = shared.gate.rows;
    project(
        step,
        [&s.normed, &s.xq, &s.xqk],
        h,
        n,
        &[(&shared.gate, &s.shared_gate), (&shared.up, &s.shared_up)],
    )?;
    step.elementwise(
        Elementwise::SiluMul,
        [&s.shared_gate, &s.shared_up],
        n * f,
        0,
    )?;
    project(
        step,
        [&s.shared_gate, &s.xq, &s.xqk],
        f,
        n,
        &[(&shared.down, &s.shared_out)],
    )?;
    step.add_shared_expert(
        [&s.shared_out, &s.normed, &shared.gate_vector, &s.proj],
        n,
        h,
    )
}

/// A Gated DeltaNet layer over `s.normed` (`n x h`) into `s.proj`, each
/// of the step's `span_count` sequences from its state in `states` (its
/// slots of `slot_floats`).
fn record_linear(
    step: &mut Step<'_>,
    linear: &GpuLinear,
    s: &GpuScratch,
    (states, slot_floats): (&GpuBuffer, usize),
    [n, span_count, h]: [usize; 3],
) -> Result<(), GpuError> {
    let l = &s.linear;
    let shape = linear.shape;
    let (qk, vw) = (shape.qk_width(), shape.v_width());
    let mut products = vec![
        (&linear.q, &l.q),
        (&linear.k, &l.k),
        (&linear.v, &l.v),
        (&linear.z, &l.z),
        (&linear.beta, &l.beta),
    ];
    if let Some(alpha) = &linear.alpha {
        products.push((alpha, &l.alpha));
    }
    project(step, [&s.normed, &s.xq, &s.xqk], h, n, &products)?;
    let conv_at = StateAt {
        slot_floats,
        offset: linear.state_offset,
    };
    let sections = [(&l.q, qk, 0), (&l.k, qk, qk), (&l.v, vw, 2 * qk)];
    for (values, width, first_channel) in sections {
        let section = Section {
            values,
            width,
            first_channel,
        };
        let buffers = [&linear.taps, states, &l.spans];
        step.linear_conv(section, buffers, [span_count, n], (shape, conv_at))?;
    }
    let dk = shape.key_dim;
    let heads = n * shape.key_heads;
    step.l2_heads(&l.q, [heads, dk], 1e-6, 1.0 / (dk as f32).sqrt())?;
    step.l2_heads(&l.k, [heads, dk], 1e-6, 1.0)?;
    let alpha = if linear.alpha.is_some() {
        &l.alpha
    } else {
        &l.beta
    };
    step.linear_gates(
        [&l.beta, alpha, &linear.head_gates, &l.gates],
        [n, shape.value_heads, linear.ba_width],
    )?;
    let s_at = StateAt {
        slot_floats,
        offset: linear.state_offset + shape.conv_floats(),
    };
    step.delta_rule(
        [&l.q, &l.k, &l.v, &l.gates, states, &l.spans, &l.out],
        [span_count, n],
        (shape, s_at),
    )?;
    let dv = shape.value_dim;
    step.rms_norm_in_place(
        [&l.out, &linear.norm],
        n * shape.value_heads,
        dv,
        linear.eps,
    )?;
    // o = rms_norm(o) w silu(z), as z = silu(z) o.
    step.elementwise(Elementwise::SiluMul, [&l.z, &l.out], n * vw, 0)?;
    project(
        step,
        [&l.z, &s.xq, &s.xqk],
        vw,
        n,
        &[(&linear.out, &s.proj)],
    )
}

/// The input of routed products: `rows` rows of `cols` in `x` (with its
/// 8-bit buffers), each read by `x_per` product rows.
struct RoutedInput<'a> {
    x: [&'a GpuBuffer; 3],
    cols: usize,
    rows: usize,
    x_per: usize,
}

/// [`project`] for experts: each product row through its routed expert.
fn project_routed(
    step: &mut Step<'_>,
    input: RoutedInput<'_>,
    products: &[(&GpuExperts, &GpuBuffer)],
    routes: &GpuBuffer,
) -> Result<(), GpuError> {
    let RoutedInput {
        x: [x, xq, xqk],
        cols,
        rows,
        x_per,
    } = input;
    let takes = |kind| products.iter().any(|(m, _)| m.format().input() == kind);
    if takes(InputKind::Q8) {
        step.quantize_q8(x, xq, rows, cols)?;
    }
    if takes(InputKind::Q8K) {
        step.quantize_q8k(x, xqk, rows, cols)?;
    }
    for (experts, y) in products {
        let input = match experts.format().input() {
            InputKind::F32 => Input::F32(x),
            InputKind::Q8 => Input::Q8(xq),
            InputKind::Q8K => Input::Q8K(xqk),
        };
        step.matmul_routed(experts, input, [y, routes], rows * x_per, x_per)?;
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
