//! One layer's forward pass: attention (or linear attention), then the
//! MLP, each with its norm and residual.

use half::f16;

use crate::dist::collectives::Group;
use crate::model::attention::{self, Buffers, Queries, Scoring};
use crate::model::config::{Activation, LayerRope};
use crate::model::deltanet::RecurrentState;
use crate::model::gather::{grown, project, Ranks, Rows};
use crate::model::moe::ExpertSplits;
use crate::model::paged::KvPool;
use crate::model::weights::Matrix;
use crate::ops;
use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

use super::io::{ForwardError, SeqSpan};
use super::workspace::{Pass, Workspace};
use super::{Attention, Layer, Mixer, Mlp, Transformer, Whole};

impl Transformer {
    pub(super) fn layer_forward(
        &self,
        layer: &Layer,
        tokens: usize,
        spans: &[SeqSpan<'_>],
        step: &mut Pass<'_, '_>,
    ) -> Result<(), ForwardError> {
        let (kv, ws, pool) = (&mut *step.kv, &mut *step.ws, step.pool);
        let group = &mut *step.group;
        let cfg = &self.config;
        let h = cfg.hidden;
        let n = tokens;

        // Attention (or linear attention) block.
        pre_norm(
            &ws.x[..n * h],
            layer.attn_norm.as_deref(),
            cfg.norm_eps,
            &mut ws.normed[..n * h],
        );
        let o_bias = match &layer.mixer {
            Mixer::Attention(attn) => {
                let mut step = Pass {
                    kv: &mut *kv,
                    ws: &mut *ws,
                    pool,
                    group: &mut *group,
                };
                self.attention_block(attn, n, spans, &mut step)?;
                attn.o_bias.as_deref()
            }
            Mixer::Linear { net, state_offset } => {
                let rows = Rows {
                    n,
                    input: &ws.normed[..n * h],
                    out: &mut ws.proj[..n * h],
                };
                let state = RecurrentState {
                    spans,
                    kv: &mut *kv,
                    offset: *state_offset,
                };
                let splits = self
                    .tensor
                    .as_ref()
                    .map(|t| (&t.layout.linear_values, &t.layout.hidden));
                let mut ranks = Ranks {
                    pool,
                    group: &mut *group,
                };
                net.forward(rows, h, state, &mut ws.linear, &mut ranks, splits)?;
                None
            }
        };
        self.add_block_output(n, o_bias, layer.attn_post_norm.as_deref(), ws)?;

        // MLP block.
        pre_norm(
            &ws.x[..n * h],
            layer.ffn_norm.as_deref(),
            cfg.norm_eps,
            &mut ws.normed[..n * h],
        );
        let down_bias = match &layer.mlp {
            Mlp::Dense {
                w_gate,
                w_up,
                w_down,
                gate_bias,
                up_bias,
                down_bias,
            } => {
                let biases = [gate_bias.as_deref(), up_bias.as_deref()];
                self.dense_activations([w_gate, w_up], biases, n, ws, pool)?;
                self.project_whole(w_down, Whole::Mlp, n, ws, pool, group)?;
                down_bias.as_deref()
            }
            Mlp::Experts(experts) => {
                let normed = &ws.normed[..n * h];
                let out = &mut ws.proj[..n * h];
                let splits = self.tensor.as_ref().map(|t| ExpertSplits {
                    experts: &t.layout.experts,
                    shared: &t.layout.shared_expert,
                    hidden: &t.layout.hidden,
                });
                let rows = Rows {
                    n,
                    input: normed,
                    out,
                };
                let mut ranks = Ranks {
                    pool,
                    group: &mut *group,
                };
                experts.forward(rows, h, &mut ws.moe, &mut ranks, splits)?;
                None
            }
        };
        self.add_block_output(n, down_bias, layer.ffn_post_norm.as_deref(), ws)
    }

    /// The dense gated MLP (SwiGLU or GeGLU) over `ws.normed` (`n x h`): the
    /// gated activations, this rank's `f` rows of them, into `ws.gate`.
    fn dense_activations(
        &self,
        [w_gate, w_up]: [&Matrix; 2],
        [gate_bias, up_bias]: [Option<&[f32]>; 2],
        n: usize,
        ws: &mut Workspace,
        pool: &ThreadPool,
    ) -> Result<(), ForwardError> {
        let (f, h) = (self.config.ffn, self.config.hidden);
        ws.acts.set(&ws.normed[..n * h], n, h);
        Matrix::matmul_many(
            [w_gate, w_up],
            &mut ws.acts,
            n,
            &ws.normed,
            [&mut ws.gate[..n * f], &mut ws.up[..n * f]],
            pool,
        )?;
        add_bias(&mut ws.gate[..n * f], gate_bias);
        add_bias(&mut ws.up[..n * f], up_bias);
        let gated = match self.config.variant.activation {
            Activation::Silu => ops::silu_mul,
            Activation::GeluTanh => ops::gelu_tanh_mul,
        };
        if n == 1 {
            gated(&mut ws.gate[..f], &ws.up[..f]);
        } else {
            let gate = DisjointSlice::new(&mut ws.gate[..n * f]);
            let up = &ws.up[..n * f];
            pool.run(|index, count| {
                let range = split_range(n * f, index, count, 64);
                // SAFETY: threads take disjoint ranges.
                gated(unsafe { gate.part(range.clone()) }, &up[range]);
            });
        }
        Ok(())
    }

    /// The end of a block: the bias, the post-norm, then the residual add
    /// of `ws.proj` (whole rows, on a tensor rank too) into `ws.x`.
    pub(super) fn add_block_output(
        &self,
        n: usize,
        bias: Option<&[f32]>,
        post_norm: Option<&[f32]>,
        ws: &mut Workspace,
    ) -> Result<(), ForwardError> {
        let h = self.config.hidden;
        add_bias(&mut ws.proj[..n * h], bias);
        if let Some(norm) = post_norm {
            ops::rms_norm_in_place(&mut ws.proj[..n * h], norm, self.config.norm_eps);
        }
        ops::add_in_place(&mut ws.x[..n * h], &ws.proj[..n * h]);
        Ok(())
    }

    /// Attention over `ws.normed` into `ws.proj`, before o_proj's bias and
    /// the reduction.
    pub(super) fn attention_block(
        &self,
        attn: &Attention,
        n: usize,
        spans: &[SeqSpan<'_>],
        step: &mut Pass<'_, '_>,
    ) -> Result<(), ForwardError> {
        let (kv, ws, pool) = (&mut *step.kv, &mut *step.ws, step.pool);
        let group = &mut *step.group;
        let cfg = &self.config;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        ws.acts.set(&ws.normed[..n * h], n, h);
        let q_out = if attn.output_gate {
            &mut ws.q_gated[..2 * n * qd]
        } else {
            &mut ws.q[..n * qd]
        };
        Matrix::matmul_many(
            [&attn.wq, &attn.wk, &attn.wv],
            &mut ws.acts,
            n,
            &ws.normed,
            [q_out, &mut ws.k[..n * kvd], &mut ws.v[..n * kvd]],
            pool,
        )?;
        if attn.output_gate {
            // Each head's q, then its gate.
            let heads = n * qd / hd;
            for head in 0..heads {
                let from = &ws.q_gated[2 * head * hd..2 * (head + 1) * hd];
                ws.q[head * hd..(head + 1) * hd].copy_from_slice(&from[..hd]);
                ws.attn_gate[head * hd..(head + 1) * hd].copy_from_slice(&from[hd..]);
            }
        }
        add_bias(&mut ws.q[..n * qd], attn.q_bias.as_deref());
        add_bias(&mut ws.k[..n * kvd], attn.k_bias.as_deref());
        add_bias(&mut ws.v[..n * kvd], attn.v_bias.as_deref());
        self.qk_norms(attn, n, ws, group)?;
        let pairs = cfg.rotary_dims / 2;
        let angles = match attn.rope {
            LayerRope::Global => Some((&ws.cos, &ws.sin)),
            LayerRope::Local => Some((&ws.cos_local, &ws.sin_local)),
            LayerRope::None => None,
        };
        if let Some((cos, sin)) = angles {
            for t in 0..n {
                let (cos, sin) = (
                    &cos[t * pairs..(t + 1) * pairs],
                    &sin[t * pairs..(t + 1) * pairs],
                );
                ops::apply_rope(
                    &mut ws.q[t * qd..(t + 1) * qd],
                    hd,
                    cfg.rope_style,
                    cos,
                    sin,
                );
                ops::apply_rope(
                    &mut ws.k[t * kvd..(t + 1) * kvd],
                    hd,
                    cfg.rope_style,
                    cos,
                    sin,
                );
            }
        }
        store_kv(kv, attn.kv_layer, spans, &ws.k[..n * kvd], &ws.v[..n * kvd]);
        let scoring = Scoring {
            window: attn.window,
            scale: cfg
                .variant
                .attention_scale
                .unwrap_or(1.0 / (hd as f32).sqrt()),
            softcap: cfg.variant.attn_softcap,
        };
        let queries = Queries {
            q: &ws.q[..n * qd],
            spans,
            token_span: &ws.token_span[..n],
            positions: &ws.positions[..n],
        };
        let buffers = Buffers {
            out: &mut ws.attn[..n * qd],
            scratch: &mut ws.scores,
            stride: ws.scores_stride,
        };
        let layer_kv = kv.layer(attn.kv_layer);
        attention::attention(cfg, self.heads, scoring, queries, layer_kv, buffers, pool);
        if attn.output_gate {
            for (o, g) in ws.attn[..n * qd].iter_mut().zip(&ws.attn_gate[..n * qd]) {
                *o *= ops::sigmoid(*g);
            }
        }
        self.project_whole(&attn.wo, Whole::Attention, n, ws, pool, group)
    }

    /// `ws.proj` (whole rows) = `w` over this rank's rows of the attention
    /// output or of the MLP's activations (see [`project`]).
    pub(super) fn project_whole(
        &self,
        w: &Matrix,
        input: Whole,
        n: usize,
        ws: &mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let (local, width) = match input {
            Whole::Attention => (&ws.attn, cfg.q_dim()),
            Whole::Mlp => (&ws.gate, cfg.ffn),
        };
        let splits = self.tensor.as_ref().map(|t| {
            let columns = match input {
                Whole::Attention => &t.layout.attention,
                Whole::Mlp => &t.layout.ffn,
            };
            (columns, &t.layout.hidden)
        });
        let rows = Rows {
            n,
            input: &local[..n * width],
            out: &mut ws.proj[..n * cfg.hidden],
        };
        let (acts, gathers) = (&mut ws.acts, &mut ws.gathers);
        let mut ranks = Ranks { pool, group };
        project::<ForwardError>(w, splits, rows, acts, gathers, &mut ranks)
    }

    /// The q and k norms: head by head (Qwen3, Gemma 3), or across all
    /// heads (OLMo 2), where a tensor-parallel rank adds its sums of
    /// squares to the others' first.
    pub(super) fn qk_norms(
        &self,
        attn: &Attention,
        n: usize,
        ws: &mut Workspace,
        group: &mut dyn Group,
    ) -> Result<(), ForwardError> {
        let cfg = &self.config;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let (Some(q_norm), Some(k_norm)) = (&attn.q_norm, &attn.k_norm) else {
            return Ok(());
        };
        let Some((q_width, k_width)) = attn.qk_norm_widths else {
            ops::rms_norm_in_place(&mut ws.q[..n * qd], q_norm, cfg.norm_eps);
            ops::rms_norm_in_place(&mut ws.k[..n * kvd], k_norm, cfg.norm_eps);
            return Ok(());
        };
        let (q_sums, k_sums) = ws.qk_sums[..2 * n].split_at_mut(n);
        let layout = self.tensor.as_ref().map(|t| &t.layout);
        match layout.and_then(|l| Some((&l.attention, l.keys.as_ref()?))) {
            None => {
                ops::sums_of_squares(&ws.q[..n * qd], qd, q_sums);
                ops::sums_of_squares(&ws.k[..n * kvd], kvd, k_sums);
            }
            // A tensor rank sums the whole rows, gathered, as one machine
            // does (adding the ranks' sums would reorder them).
            Some((q_split, k_split)) => {
                let gathers = &mut ws.gathers;
                for (split, local, sums) in [
                    (q_split, &ws.q[..n * qd], q_sums),
                    (k_split, &ws.k[..n * kvd], k_sums),
                ] {
                    let whole = grown(&mut gathers.whole, n * split.width());
                    split.gather(group, n, local, &mut gathers.scratch, whole)?;
                    ops::sums_of_squares(whole, split.width(), sums);
                }
            }
        }
        let (q_sums, k_sums) = ws.qk_sums[..2 * n].split_at(n);
        ops::rms_norm_by_sums(&mut ws.q[..n * qd], q_norm, q_sums, q_width, cfg.norm_eps);
        ops::rms_norm_by_sums(&mut ws.k[..n * kvd], k_norm, k_sums, k_width, cfg.norm_eps);
        Ok(())
    }
}

/// `out = norm(x)`, or `x` itself for a family without this norm.
fn pre_norm(x: &[f32], norm: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    match norm {
        Some(weight) => ops::rms_norm(x, weight, eps, out),
        None => out.copy_from_slice(x),
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for row in x.chunks_exact_mut(bias.len()) {
            ops::add_in_place(row, bias);
        }
    }
}

/// Writes the step's keys and values, in f16, at each token's position in
/// its sequence's blocks.
fn store_kv(kv: &mut KvPool, layer: usize, spans: &[SeqSpan<'_>], k: &[f32], v: &[f32]) {
    let kvd = k.len() / spans.iter().map(|s| s.len).sum::<usize>().max(1);
    let mut t = 0;
    for span in spans {
        for position in span.start..span.start + span.len {
            let at = kv.offset(span.table, position);
            let (keys, values) = kv.layer_mut(layer);
            let row = t * kvd..(t + 1) * kvd;
            for (out, value) in keys[at..at + kvd].iter_mut().zip(&k[row.clone()]) {
                *out = f16::from_f32(*value);
            }
            for (out, value) in values[at..at + kvd].iter_mut().zip(&v[row]) {
                *out = f16::from_f32(*value);
            }
            t += 1;
        }
    }
}
