//! Gated DeltaNet, the linear-attention layer of the hybrid models
//! (Qwen3.5, Qwen3-Next). Per token:
//!
//! 1. `q, k, v = conv(in_proj_qkv(x))`: a causal depthwise convolution of
//!    `conv_kernel` taps over the channels of q, k and v, then silu; q and
//!    k are scaled to unit length per head, q also by `1 / sqrt(key_dim)`;
//! 2. `beta = sigmoid(in_proj_b(x))`, `g = a * softplus(in_proj_a(x) + dt)`
//!    per value head, with `a = -exp(A_log)` (as GGUF stores it);
//! 3. per value head, with the state `S` (`key_dim x value_dim`) of its key
//!    head's group: `S *= exp(g)`, `S += k ⊗ (v - Sᵀk) * beta`, `o = Sᵀq`;
//! 4. `out_proj(rms_norm(o) * w * silu(z))` with `z = in_proj_z(x)`, the
//!    norm per value head.
//!
//! The convolution's last inputs and every head's `S` are the sequence's
//! state, kept in the [`KvPool`] in a slot of its own instead of keys and
//! values: a span that starts at position 0 starts from zeros.
//!
//! On a tensor-parallel rank the layer holds whole key heads with their
//! value heads: its q and k channels, the rows of v, z, b and a and the
//! convolution's channels of those heads; of `out_proj`, its share of the
//! output rows over whole inputs, every rank's value heads gathered first
//! (see [`super::gather`]), so that it computes what one machine does.

use std::ops::Range;

use super::config::LinearAttention;
use super::gather::{project, ColumnSplit, GatherBuffers, Ranks, Rows};
use super::transformer::{ForwardError, SeqSpan};
use super::weights::{LoadError, Matrix, TensorSource};
use crate::model::paged::KvPool;
use crate::ops;
use crate::quant::Activations;
use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

/// What one rank runs of one Gated DeltaNet layer.
pub struct GatedDeltaNet {
    shape: LocalShape,
    w_q: Matrix,
    w_k: Matrix,
    /// Rows of v (and of z) for each run of consecutive value heads of the
    /// file this rank holds.
    w_v: Vec<Matrix>,
    w_z: Vec<Matrix>,
    /// `out_proj`: every column; a tensor rank's share of the rows.
    w_out: Matrix,
    beta_alpha: BetaAlpha,
    /// Taps per local channel (`channels x kernel`).
    conv: Vec<f32>,
    /// `-exp(A_log)` and `dt_bias` of each local value head.
    decay: Vec<f32>,
    dt_bias: Vec<f32>,
    /// The gated norm's weight (one value head wide, shared by all).
    norm: Vec<f32>,
    eps: f32,
}

/// b and a: two matrices (Qwen3.5) or one fused per key head (Qwen3-Next),
/// computed whole on every rank (a few rows), with where each local value
/// head's entry sits in the product's row.
enum BetaAlpha {
    Separate { beta: Matrix, alpha: Matrix },
    Fused(Matrix),
}

/// The layer's sizes on this rank.
#[derive(Clone, Debug)]
struct LocalShape {
    key_heads: usize,
    key_dim: usize,
    value_dim: usize,
    kernel: usize,
    /// Each local value head's local key head.
    key_of: Vec<usize>,
    /// Each local value head's index in the whole product of b (and a).
    beta_index: Vec<usize>,
    alpha_index: Vec<usize>,
    /// Width of the b/a products' rows.
    ba_width: usize,
}

impl LocalShape {
    fn value_heads(&self) -> usize {
        self.key_of.len()
    }

    fn qk_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    fn v_width(&self) -> usize {
        self.value_heads() * self.value_dim
    }

    fn channels(&self) -> usize {
        2 * self.qk_width() + self.v_width()
    }

    /// Floats of one sequence's state for this layer: the convolution's
    /// last `kernel - 1` inputs, then every value head's `S`.
    fn state_len(&self) -> usize {
        (self.kernel - 1) * self.channels() + self.value_heads() * self.key_dim * self.value_dim
    }
}

/// A layer's weights and sizes, as the GPU's upload reads them.
pub(crate) struct LinearParts<'a> {
    pub w_q: &'a Matrix,
    pub w_k: &'a Matrix,
    /// One matrix each where the layer holds every head (not a tensor
    /// rank's runs of heads).
    pub w_v: &'a [Matrix],
    pub w_z: &'a [Matrix],
    pub w_out: &'a Matrix,
    /// b's and a's products, or the one fused product (`None` for a).
    pub beta: &'a Matrix,
    pub alpha: Option<&'a Matrix>,
    pub conv: &'a [f32],
    pub decay: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [f32],
    pub eps: f32,
    pub key_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub kernel: usize,
    pub key_of: &'a [usize],
    pub beta_index: &'a [usize],
    pub alpha_index: &'a [usize],
    pub ba_width: usize,
}

/// Which heads a rank holds of a linear-attention layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearSplit {
    pub key_heads: Range<usize>,
    /// The value heads (file indices) in the order the rank keeps them.
    pub value_heads: Vec<usize>,
}

impl LinearSplit {
    /// Every head (one machine, or a pipeline stage).
    pub fn whole(linear: &LinearAttention) -> Self {
        Self::for_key_heads(linear, 0..linear.key_heads)
    }

    /// Key heads `keys` and the value heads that read them, in file order.
    pub fn for_key_heads(linear: &LinearAttention, keys: Range<usize>) -> Self {
        let value_heads = (0..linear.value_heads)
            .filter(|&v| keys.contains(&linear.key_of(v)))
            .collect();
        Self {
            key_heads: keys,
            value_heads,
        }
    }

    /// Runs of consecutive file value heads, in local order.
    pub(super) fn runs(&self) -> Vec<Range<usize>> {
        let mut runs: Vec<Range<usize>> = Vec::new();
        for &v in &self.value_heads {
            match runs.last_mut() {
                Some(run) if run.end == v => run.end += 1,
                _ => runs.push(v..v + 1),
            }
        }
        runs
    }
}

/// Where a linear-attention layer's recurrent state lives: each span's
/// slot in the pool, this layer's `offset` in the slot.
pub struct RecurrentState<'a, 'b> {
    pub spans: &'a [SeqSpan<'b>],
    pub kv: &'a mut KvPool,
    pub offset: usize,
}

impl GatedDeltaNet {
    /// Loads layer `layer`'s linear attention, the heads of `split`.
    pub fn load(
        source: &dyn TensorSource,
        layer: usize,
        linear: &LinearAttention,
        hidden: usize,
        eps: f32,
        split: &LinearSplit,
        hidden_rows: Option<Range<usize>>,
    ) -> Result<Self, LoadError> {
        let name = |part: &str| format!("blk.{layer}.{part}");
        let (nk, dk, nv, dv) = (
            linear.key_heads,
            linear.key_dim,
            linear.value_heads,
            linear.value_dim,
        );
        let (qk, v_all) = (nk * dk, nv * dv);
        let runs = split.runs();
        let keys = &split.key_heads;
        let shifted = |r: Range<usize>, by: usize| r.start + by..r.end + by;
        let key_rows = keys.start * dk..keys.end * dk;
        let part = |name: &str, shape: [usize; 2], rows: Option<Range<usize>>, cols| {
            source.expect_shape(name, &shape)?;
            source.matrix_part(name, rows, cols)
        };
        let qkv = name("attn_qkv.weight");
        let qkv_shape = [2 * qk + v_all, hidden];
        let z = name("attn_gate.weight");
        let out = name("ssm_out.weight");
        let value_rows = |run: &Range<usize>| run.start * dv..run.end * dv;
        let mut w_v = Vec::with_capacity(runs.len());
        let mut w_z = Vec::with_capacity(runs.len());
        for run in &runs {
            w_v.push(part(
                &qkv,
                qkv_shape,
                Some(shifted(value_rows(run), 2 * qk)),
                None,
            )?);
            w_z.push(part(&z, [v_all, hidden], Some(value_rows(run)), None)?);
        }
        let fused_ba = name("ssm_ba.weight");
        let r = linear.values_per_key();
        let (beta_alpha, beta_index, alpha_index, ba_width) = if source.contains(&fused_ba) {
            // Per key head: its r value heads' b, then their a (grouped).
            let beta: Vec<usize> = split
                .value_heads
                .iter()
                .map(|&v| (v / r) * 2 * r + v % r)
                .collect();
            let alpha = beta.iter().map(|b| b + r).collect();
            let fused = part(&fused_ba, [2 * nv, hidden], None, None)?;
            (BetaAlpha::Fused(fused), beta, alpha, 2 * nv)
        } else {
            let beta = part(&name("ssm_beta.weight"), [nv, hidden], None, None)?;
            let alpha = part(&name("ssm_alpha.weight"), [nv, hidden], None, None)?;
            (
                BetaAlpha::Separate { beta, alpha },
                split.value_heads.clone(),
                split.value_heads.clone(),
                nv,
            )
        };
        let per_head = |tensor: &str| -> Result<Vec<f32>, LoadError> {
            let all = whole_vector(source, &name(tensor), nv)?;
            Ok(split.value_heads.iter().map(|&v| all[v]).collect())
        };
        let shape = LocalShape {
            key_heads: keys.len(),
            key_dim: dk,
            value_dim: dv,
            kernel: linear.conv_kernel,
            key_of: split
                .value_heads
                .iter()
                .map(|&v| linear.key_of(v) - keys.start)
                .collect(),
            beta_index,
            alpha_index,
            ba_width,
        };
        let conv = conv_taps(source, &name("ssm_conv1d.weight"), linear, split)?;
        Ok(Self {
            w_q: part(&qkv, qkv_shape, Some(key_rows.clone()), None)?,
            w_k: part(&qkv, qkv_shape, Some(shifted(key_rows, qk)), None)?,
            w_v,
            w_z,
            w_out: part(&out, [hidden, v_all], hidden_rows, None)?,
            beta_alpha,
            conv,
            decay: per_head("ssm_a")?,
            dt_bias: per_head("ssm_dt.bias")?,
            norm: whole_vector(source, &name("ssm_norm.weight"), dv)?,
            eps,
            shape,
        })
    }

    /// Floats of one sequence's state for this layer.
    pub(crate) fn parts(&self) -> LinearParts<'_> {
        let (beta, alpha) = match &self.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => (beta, Some(alpha)),
            BetaAlpha::Fused(m) => (m, None),
        };
        let shape = &self.shape;
        LinearParts {
            w_q: &self.w_q,
            w_k: &self.w_k,
            w_v: &self.w_v,
            w_z: &self.w_z,
            w_out: &self.w_out,
            beta,
            alpha,
            conv: &self.conv,
            decay: &self.decay,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
            eps: self.eps,
            key_heads: shape.key_heads,
            key_dim: shape.key_dim,
            value_dim: shape.value_dim,
            kernel: shape.kernel,
            key_of: &shape.key_of,
            beta_index: &shape.beta_index,
            alpha_index: &shape.alpha_index,
            ba_width: shape.ba_width,
        }
    }

    pub fn state_len(&self) -> usize {
        self.shape.state_len()
    }

    /// Bytes of weights held.
    pub fn size_bytes(&self) -> usize {
        let matrices: usize = [&self.w_q, &self.w_k]
            .into_iter()
            .chain(&self.w_v)
            .chain(&self.w_z)
            .chain([&self.w_out])
            .map(Matrix::size_bytes)
            .sum();
        let ba = match &self.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => beta.size_bytes() + alpha.size_bytes(),
            BetaAlpha::Fused(m) => m.size_bytes(),
        };
        let vectors = self.conv.len() + self.decay.len() + self.dt_bias.len() + self.norm.len();
        matrices + ba + vectors * 4
    }

    /// `proj` (`n x hidden`) = the layer's output for the `n` tokens of
    /// `normed`; `states` are the spans' slots and `offset` this layer's
    /// place in each slot. On a tensor rank, `splits` says how every
    /// rank's value heads and output rows make whole rows.
    pub fn forward(
        &self,
        rows: Rows<'_>,
        hidden: usize,
        state: RecurrentState<'_, '_>,
        ws: &mut LinearWorkspace,
        ranks: &mut Ranks<'_>,
        splits: Option<(&ColumnSplit, &ColumnSplit)>,
    ) -> Result<(), ForwardError> {
        let Rows {
            n,
            input: normed,
            out: proj,
        } = rows;
        let RecurrentState { spans, kv, offset } = state;
        let pool = ranks.pool;
        let shape = &self.shape;
        ws.ensure(shape, n);
        self.project(n, hidden, normed, ws, pool)?;
        let state_len = self.state_len();
        let mut first = 0;
        for span in spans {
            let state =
                kv.state_mut(span.state, offset, state_len)
                    .ok_or(ForwardError::StateSlot {
                        slot: span.state,
                        reason: "not in the pool",
                    })?;
            if span.start == 0 {
                state.fill(0.0);
            }
            let conv_len = (shape.kernel - 1) * shape.channels();
            let (conv_state, _) = state.split_at_mut(conv_len);
            self.convolve(first..first + span.len, conv_state, ws);
            first += span.len;
        }
        normalize_qk(shape, n, ws);
        self.gates(n, ws);
        self.recur(n, spans, kv, offset, ws, pool)?;
        self.gated_norm(n, ws);
        let vw = self.shape.v_width();
        let (local, out) = (&ws.out[..n * vw], &mut proj[..n * hidden]);
        let (acts, gathers) = (&mut ws.acts, &mut ws.gathers);
        let rows = Rows {
            n,
            input: local,
            out,
        };
        project::<ForwardError>(&self.w_out, splits, rows, acts, gathers, ranks)
    }

    /// The input projections: q, k, v and z of this rank's heads, b and a
    /// of all of them.
    fn project(
        &self,
        n: usize,
        hidden: usize,
        normed: &[f32],
        ws: &mut LinearWorkspace,
        pool: &ThreadPool,
    ) -> Result<(), ForwardError> {
        let shape = &self.shape;
        let (qk, vw) = (shape.qk_width(), shape.v_width());
        ws.acts.set(&normed[..n * hidden], n, hidden);
        Matrix::matmul_many(
            [&self.w_q, &self.w_k],
            &mut ws.acts,
            n,
            normed,
            [&mut ws.q[..n * qk], &mut ws.k[..n * qk]],
            pool,
        )?;
        let mut column = 0;
        for (w_v, w_z) in self.w_v.iter().zip(&self.w_z) {
            let width = w_v.rows();
            if self.w_v.len() == 1 {
                Matrix::matmul_many(
                    [w_v, w_z],
                    &mut ws.acts,
                    n,
                    normed,
                    [&mut ws.v[..n * vw], &mut ws.z[..n * vw]],
                    pool,
                )?;
                break;
            }
            // Several runs of heads: each run's rows land in their columns.
            let (tmp_v, tmp_z) = ws.run.split_at_mut(n * width);
            Matrix::matmul_many(
                [w_v, w_z],
                &mut ws.acts,
                n,
                normed,
                [&mut tmp_v[..], &mut tmp_z[..n * width]],
                pool,
            )?;
            for t in 0..n {
                let to = t * vw + column..t * vw + column + width;
                ws.v[to.clone()].copy_from_slice(&tmp_v[t * width..(t + 1) * width]);
                ws.z[to].copy_from_slice(&tmp_z[t * width..(t + 1) * width]);
            }
            column += width;
        }
        let ba = shape.ba_width;
        match &self.beta_alpha {
            BetaAlpha::Separate { beta, alpha } => {
                let (b, a) = ws.ba.split_at_mut(n * ba);
                Matrix::matmul_many(
                    [beta, alpha],
                    &mut ws.acts,
                    n,
                    normed,
                    [b, &mut a[..n * ba]],
                    pool,
                )?;
            }
            BetaAlpha::Fused(m) => {
                m.matmul(&mut ws.acts, n, normed, &mut ws.ba[..n * ba], pool)?;
            }
        }
        Ok(())
    }

    /// The causal convolution and silu over tokens `tokens` of one
    /// sequence, in place on q, k and v, carrying `conv_state` (the last
    /// `kernel - 1` inputs, oldest first) from token to token.
    fn convolve(&self, tokens: Range<usize>, conv_state: &mut [f32], ws: &mut LinearWorkspace) {
        let shape = &self.shape;
        let (qk, vw, kernel) = (shape.qk_width(), shape.v_width(), shape.kernel);
        let channels = shape.channels();
        let history = kernel - 1;
        for t in tokens {
            let sections = [
                (&mut ws.q[t * qk..(t + 1) * qk], 0),
                (&mut ws.k[t * qk..(t + 1) * qk], qk),
                (&mut ws.v[t * vw..(t + 1) * vw], 2 * qk),
            ];
            for (values, base) in sections {
                for (i, value) in values.iter_mut().enumerate() {
                    let c = base + i;
                    let taps = &self.conv[c * kernel..(c + 1) * kernel];
                    let mut sum = 0.0f32;
                    for (j, tap) in taps[..history].iter().enumerate() {
                        sum += tap * conv_state[j * channels + c];
                    }
                    sum += taps[history] * *value;
                    // Shift this channel's history by one: the input joins.
                    for j in 1..history {
                        conv_state[(j - 1) * channels + c] = conv_state[j * channels + c];
                    }
                    if history > 0 {
                        conv_state[(history - 1) * channels + c] = *value;
                    }
                    *value = ops::silu(sum);
                }
            }
        }
    }

    /// beta and the decay `exp(g)` of every local value head, per token.
    fn gates(&self, n: usize, ws: &mut LinearWorkspace) {
        let shape = &self.shape;
        let (heads, ba) = (shape.value_heads(), shape.ba_width);
        let separate = matches!(self.beta_alpha, BetaAlpha::Separate { .. });
        for t in 0..n {
            for j in 0..heads {
                let (b, a) = if separate {
                    (
                        ws.ba[t * ba + shape.beta_index[j]],
                        ws.ba[n * ba + t * ba + shape.alpha_index[j]],
                    )
                } else {
                    (
                        ws.ba[t * ba + shape.beta_index[j]],
                        ws.ba[t * ba + shape.alpha_index[j]],
                    )
                };
                ws.beta[t * heads + j] = ops::sigmoid(b);
                let g = self.decay[j] * ops::softplus(a + self.dt_bias[j]);
                ws.decay[t * heads + j] = g.exp();
            }
        }
    }

    /// The delta rule, every (sequence, value head) pair in parallel, each
    /// over its tokens in order.
    fn recur(
        &self,
        n: usize,
        spans: &[SeqSpan<'_>],
        kv: &mut KvPool,
        offset: usize,
        ws: &mut LinearWorkspace,
        pool: &ThreadPool,
    ) -> Result<(), ForwardError> {
        let shape = &self.shape;
        let (heads, dk, dv) = (shape.value_heads(), shape.key_dim, shape.value_dim);
        let (qk, vw) = (shape.qk_width(), shape.v_width());
        let conv_len = (shape.kernel - 1) * shape.channels();
        let state_len = self.state_len();
        // Each span's heads' states, as disjoint slices of the pool.
        let mut starts = Vec::with_capacity(spans.len());
        let mut first = 0;
        for span in spans {
            starts.push(first);
            first += span.len;
        }
        let states = kv
            .states_of(spans.iter().map(|s| s.state), offset, state_len)
            .ok_or(ForwardError::StateSlot {
                slot: spans.first().map_or(0, |s| s.state),
                reason: "missing, or given to two sequences of one step",
            })?;
        let states: Vec<DisjointSlice<f32>> = states
            .into_iter()
            .map(|s| DisjointSlice::new(&mut s[conv_len..]))
            .collect();
        let out = DisjointSlice::new(&mut ws.out[..n * vw]);
        let (q, k, v) = (&ws.q[..n * qk], &ws.k[..n * qk], &ws.v[..n * vw]);
        let (beta, decay) = (&ws.beta[..n * heads], &ws.decay[..n * heads]);
        let items = spans.len() * heads;
        pool.run(|thread, threads| {
            for item in split_range(items, thread, threads, 1) {
                let (s, j) = (item / heads, item % heads);
                // SAFETY: each (span, head) pair is one thread's alone.
                let state = unsafe { states[s].part(j * dk * dv..(j + 1) * dk * dv) };
                let key = shape.key_of[j];
                for t in starts[s]..starts[s] + spans[s].len {
                    let q = &q[t * qk + key * dk..t * qk + (key + 1) * dk];
                    let k = &k[t * qk + key * dk..t * qk + (key + 1) * dk];
                    let v = &v[t * vw + j * dv..t * vw + (j + 1) * dv];
                    // SAFETY: as above; token t's head j is this item's.
                    let o = unsafe { out.part(t * vw + j * dv..t * vw + (j + 1) * dv) };
                    delta_step(state, q, k, v, beta[t * heads + j], decay[t * heads + j], o);
                }
            }
        });
        Ok(())
    }

    /// `o = rms_norm(o) * w * silu(z)`, value head by value head.
    fn gated_norm(&self, n: usize, ws: &mut LinearWorkspace) {
        let vw = self.shape.v_width();
        let dv = self.shape.value_dim;
        ops::rms_norm_in_place(&mut ws.out[..n * vw], &self.norm, self.eps);
        for (o, z) in ws.out[..n * vw].iter_mut().zip(&ws.z[..n * vw]) {
            *o *= ops::silu(*z);
        }
        debug_assert_eq!(vw % dv, 0);
    }
}

/// One token of one value head: decay the state, write `k -> v` into it
/// by the delta rule, read `q` out of it.
fn delta_step(
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    decay: f32,
    out: &mut [f32],
) {
    let dv = v.len();
    state.iter_mut().for_each(|s| *s *= decay);
    // delta = (v - Sᵀk) * beta, kept in `out` until the read below.
    out.copy_from_slice(v);
    for (row, &ki) in state.chunks_exact(dv).zip(k) {
        for (o, s) in out.iter_mut().zip(row) {
            *o -= s * ki;
        }
    }
    out.iter_mut().for_each(|o| *o *= beta);
    for (row, &ki) in state.chunks_exact_mut(dv).zip(k) {
        ops::axpy(row, ki, out);
    }
    out.fill(0.0);
    for (row, &qi) in state.chunks_exact(dv).zip(q) {
        ops::axpy(out, qi, row);
    }
}

/// q and k to unit length per key head, q then by `1 / sqrt(key_dim)`.
fn normalize_qk(shape: &LocalShape, n: usize, ws: &mut LinearWorkspace) {
    let (qk, dk) = (shape.qk_width(), shape.key_dim);
    let scale = 1.0 / (dk as f32).sqrt();
    for head in ws.q[..n * qk].chunks_exact_mut(dk) {
        ops::l2_normalize(head, 1e-6);
        head.iter_mut().for_each(|v| *v *= scale);
    }
    for head in ws.k[..n * qk].chunks_exact_mut(dk) {
        ops::l2_normalize(head, 1e-6);
    }
}

/// A vector of `len` values, whatever shape the file gives it.
fn whole_vector(source: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
    let values = source.vector(name)?;
    if values.len() != len {
        return Err(LoadError::Shape {
            path: source.path().to_string(),
            tensor: name.to_string(),
            expected: vec![len],
            actual: source.shape(name).unwrap_or_default(),
        });
    }
    Ok(values)
}

/// The convolution's taps of this rank's channels: its q and k channels,
/// then its value heads' in local order.
fn conv_taps(
    source: &dyn TensorSource,
    name: &str,
    linear: &LinearAttention,
    split: &LinearSplit,
) -> Result<Vec<f32>, LoadError> {
    let kernel = linear.conv_kernel;
    let (qk, dv) = (linear.key_heads * linear.key_dim, linear.value_dim);
    let all = whole_vector(source, name, linear.conv_channels() * kernel)?;
    let channel = |c: usize| &all[c * kernel..(c + 1) * kernel];
    let keys = split.key_heads.start * linear.key_dim..split.key_heads.end * linear.key_dim;
    let mut taps = Vec::new();
    for c in keys.clone() {
        taps.extend_from_slice(channel(c));
    }
    for c in keys {
        taps.extend_from_slice(channel(qk + c));
    }
    for &v in &split.value_heads {
        for c in v * dv..(v + 1) * dv {
            taps.extend_from_slice(channel(2 * qk + c));
        }
    }
    Ok(taps)
}

/// Buffers of the linear-attention layers, grown to the largest step.
#[derive(Default)]
pub struct LinearWorkspace {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    z: Vec<f32>,
    /// b's products then a's (or the fused product).
    ba: Vec<f32>,
    beta: Vec<f32>,
    decay: Vec<f32>,
    out: Vec<f32>,
    /// One run of heads' products.
    run: Vec<f32>,
    acts: Activations,
    /// A tensor rank's whole rows and its part of the output rows.
    gathers: GatherBuffers,
}

impl LinearWorkspace {
    fn ensure(&mut self, shape: &LocalShape, n: usize) {
        let grow = |v: &mut Vec<f32>, len: usize| {
            if v.len() < len {
                v.resize(len, 0.0);
            }
        };
        let (qk, vw) = (shape.qk_width(), shape.v_width());
        grow(&mut self.q, n * qk);
        grow(&mut self.k, n * qk);
        grow(&mut self.v, n * vw);
        grow(&mut self.z, n * vw);
        grow(&mut self.ba, 2 * n * shape.ba_width);
        grow(&mut self.beta, n * shape.value_heads());
        grow(&mut self.decay, n * shape.value_heads());
        grow(&mut self.out, n * vw);
        grow(&mut self.run, 2 * n * vw);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ValueHeadOrder;

    fn linear(order: ValueHeadOrder) -> LinearAttention {
        LinearAttention {
            layers: vec![true, false],
            conv_kernel: 4,
            key_heads: 2,
            key_dim: 4,
            value_heads: 6,
            value_dim: 2,
            order,
        }
    }

    #[test]
    fn splits_keep_each_value_head_with_its_key_head() {
        let grouped = linear(ValueHeadOrder::Grouped);
        let rank1 = LinearSplit::for_key_heads(&grouped, 1..2);
        assert_eq!(rank1.value_heads, [3, 4, 5]);
        assert_eq!(rank1.runs(), vec![Range { start: 3, end: 6 }]);
        let tiled = linear(ValueHeadOrder::Tiled);
        let rank1 = LinearSplit::for_key_heads(&tiled, 1..2);
        assert_eq!(rank1.value_heads, [1, 3, 5]);
        assert_eq!(rank1.runs(), [1..2, 3..4, 5..6]);
        assert_eq!(
            LinearSplit::whole(&tiled).runs(),
            vec![Range { start: 0, end: 6 }]
        );
    }

    #[test]
    fn delta_rule_stores_and_recalls_a_key() {
        // From zeros with beta 1 and no decay, S = k ⊗ v: reading with q = k
        // (unit length) gives v back; a second write of the same key with a
        // new value replaces the old one.
        let (dk, dv) = (2, 3);
        let mut state = vec![0.0; dk * dv];
        let k = [1.0, 0.0];
        let mut out = [0.0; 3];
        delta_step(&mut state, &k, &k, &[1.0, 2.0, 3.0], 1.0, 1.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0]);
        delta_step(&mut state, &k, &k, &[4.0, 5.0, 6.0], 1.0, 1.0, &mut out);
        assert_eq!(out, [4.0, 5.0, 6.0]);
        // Halving decay, beta 0: nothing written, the memory fades.
        delta_step(&mut state, &k, &k, &[9.0, 9.0, 9.0], 0.0, 0.5, &mut out);
        assert_eq!(out, [2.0, 2.5, 3.0]);
    }
}
