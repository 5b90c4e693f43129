//! The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router scores every
//! expert for each token, the best `experts_per_token` run, and their
//! outputs are summed weighted by the router's softmax.
//!
//! A step's tokens are sorted by expert so that each expert's matrices are
//! read once for all the tokens routed to it, and every expert of a layer
//! runs in one parallel region ([`quant::matmul_grouped`]). Each token's
//! result depends on its own row only (the kernels compute each row alone
//! and the weighted sum runs in the token's own top-k order), so batching
//! does not change it.
//!
//! On a tensor-parallel rank every expert holds the same slice of its
//! intermediate rows and the same share of its down projection's output
//! rows (whole columns): the intermediate rows are gathered whole first,
//! as for the dense MLP (see [`super::gather`]).

use std::ops::Range;

use super::config::{ConfigError, MoeConfig};
use super::gather::{grown, ColumnSplit, GatherBuffers, Ranks, Rows};
use super::transformer::ForwardError;
use super::weights::{LoadError, Matrix, TensorSource};
use crate::formats::hf_dir::HfConfig;
use crate::ops;
use crate::quant::{self, Activations, QMatrix};
use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

/// The experts of a config, if it has them. `expert_ffn` is each expert's
/// rows (Mixtral: `intermediate_size`; Qwen3-MoE: `moe_intermediate_size`).
pub(crate) fn config_from_hf(
    hf: &HfConfig,
    expert_ffn: Option<usize>,
    normalize_top_k: bool,
) -> Result<Option<MoeConfig>, ConfigError> {
    let Some(experts) = hf.expert_count() else {
        return Ok(None);
    };
    let per_token = hf.num_experts_per_tok.ok_or_else(|| {
        ConfigError(format!(
            "{experts} experts but no num_experts_per_tok (how many run per token)"
        ))
    })?;
    Ok(Some(MoeConfig {
        experts,
        experts_per_token: per_token,
        expert_ffn: expert_ffn.unwrap_or(hf.intermediate_size),
        normalize_top_k,
        shared_ffn: hf.shared_expert_intermediate_size.filter(|&s| s > 0),
    }))
}

/// One token's choice: an expert and the weight of its output.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Route {
    pub expert: u32,
    pub weight: f32,
}

/// Softmax over one token's router logits (in place), then the `out.len()`
/// best experts, best first (ties to the lower index), with their
/// probabilities as weights, renormalised to sum to one if `normalize`.
pub fn route(logits: &mut [f32], normalize: bool, out: &mut [Route]) {
    ops::softmax(logits);
    for slot in 0..out.len() {
        let mut best: Option<(usize, f32)> = None;
        for (expert, &p) in logits.iter().enumerate() {
            let taken = out[..slot].iter().any(|r| r.expert as usize == expert);
            if !taken && best.is_none_or(|(_, b)| p > b) {
                best = Some((expert, p));
            }
        }
        let (expert, weight) = best.unwrap_or((0, 0.0));
        out[slot] = Route {
            expert: expert as u32,
            weight,
        };
    }
    if normalize {
        let sum: f32 = out.iter().map(|r| r.weight).sum();
        if sum > 0.0 {
            for r in out.iter_mut() {
                r.weight /= sum;
            }
        }
    }
}

/// A layer's router and experts (on a tensor-parallel rank, its rows of
/// every expert).
pub struct Experts {
    /// With this rank's rows of each expert.
    moe: MoeConfig,
    router: Matrix,
    weights: ExpertWeights,
    shared: Option<SharedExpert>,
}

/// The expert every token runs (this rank's rows of it), its output scaled
/// by `sigmoid(gate · x)` and added to the routed experts' sum.
struct SharedExpert {
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
    gate: Vec<f32>,
}

/// One of an expert's matrices, as the layer holds it.
#[derive(Clone, Copy)]
pub(crate) enum ExpertMatrix<'a> {
    Native(&'a QMatrix),
    Other(&'a Matrix),
}

/// Each expert's gate, up and down.
enum ExpertWeights {
    /// All in our native formats: the grouped kernels.
    Native(Vec<[QMatrix; 3]>),
    /// Some format only candle runs: one expert at a time.
    Other(Vec<[Matrix; 3]>),
}

impl ExpertWeights {
    /// Adds the next expert; the first one not native turns the list into
    /// [`ExpertWeights::Other`].
    fn push(&mut self, mats: [Matrix; 3]) {
        match self {
            Self::Native(list) => match mats {
                [Matrix::Native(g), Matrix::Native(u), Matrix::Native(d)] => list.push([g, u, d]),
                other => {
                    let mut all: Vec<[Matrix; 3]> = std::mem::take(list)
                        .into_iter()
                        .map(|m| m.map(Matrix::Native))
                        .collect();
                    all.push(other);
                    *self = Self::Other(all);
                }
            },
            Self::Other(list) => list.push(mats),
        }
    }
}

/// Buffers of the MoE block, grown to the largest step seen and reused.
#[derive(Default)]
pub struct MoeWorkspace {
    logits: Vec<f32>,
    routes: Vec<Route>,
    /// For each (token, slot): its row among the rows sorted by expert.
    sorted_row: Vec<usize>,
    /// For each expert: its rows among the sorted rows (as `(expert, rows)`
    /// groups of the experts that have any).
    groups: Vec<(usize, Range<usize>)>,
    counts: Vec<usize>,
    /// For each sorted row: the token (row of the input) it reads.
    token_of_row: Vec<usize>,
    /// One expert's input rows (the candle fallback only).
    gathered: Vec<f32>,
    /// The shared expert's intermediate rows and output.
    shared_gate: Vec<f32>,
    shared_up: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    acts: Activations,
    /// A tensor rank's whole intermediate rows and its output columns.
    gathers: GatherBuffers,
}

impl Experts {
    /// Loads layer `layer`'s router (whole) and, of each expert, the rows
    /// `rows` of gate and up and the rows `hidden_rows` of down (all of
    /// them on one machine; a tensor rank's, whole columns, see
    /// [`super::gather`]); of the shared expert, if any, `shared_rows`.
    pub fn load(
        source: &dyn TensorSource,
        layer: usize,
        moe: &MoeConfig,
        hidden: usize,
        [rows, shared_rows]: [&Range<usize>; 2],
        hidden_rows: Option<Range<usize>>,
    ) -> Result<Self, LoadError> {
        let name = |part: &str| format!("blk.{layer}.{part}");
        let f = moe.expert_ffn;
        let part = |name: &str,
                    shape: [usize; 2],
                    rows: Option<Range<usize>>,
                    cols: Option<Range<usize>>| {
            source.expect_shape(name, &shape)?;
            source.matrix_part(name, rows, cols)
        };
        let router = part(
            &name("ffn_gate_inp.weight"),
            [moe.experts, hidden],
            None,
            None,
        )?;
        let mut weights = ExpertWeights::Native(Vec::with_capacity(moe.experts));
        for e in 0..moe.experts {
            let rows = Some(rows.clone());
            weights.push([
                part(
                    &name(&format!("ffn_gate.{e}.weight")),
                    [f, hidden],
                    rows.clone(),
                    None,
                )?,
                part(
                    &name(&format!("ffn_up.{e}.weight")),
                    [f, hidden],
                    rows,
                    None,
                )?,
                part(
                    &name(&format!("ffn_down.{e}.weight")),
                    [hidden, f],
                    hidden_rows.clone(),
                    None,
                )?,
            ]);
        }
        let shared = match moe.shared_ffn {
            Some(f) => {
                let gate_name = name("ffn_gate_inp_shexp.weight");
                let gate = source.vector(&gate_name)?;
                if gate.len() != hidden {
                    return Err(LoadError::Shape {
                        path: source.path().to_string(),
                        tensor: gate_name,
                        expected: vec![1, hidden],
                        actual: source
                            .shape(&name("ffn_gate_inp_shexp.weight"))
                            .unwrap_or_default(),
                    });
                }
                let rows = Some(shared_rows.clone());
                Some(SharedExpert {
                    w_gate: part(
                        &name("ffn_gate_shexp.weight"),
                        [f, hidden],
                        rows.clone(),
                        None,
                    )?,
                    w_up: part(&name("ffn_up_shexp.weight"), [f, hidden], rows, None)?,
                    w_down: part(
                        &name("ffn_down_shexp.weight"),
                        [hidden, f],
                        hidden_rows,
                        None,
                    )?,
                    gate,
                })
            }
            None => None,
        };
        let moe = MoeConfig {
            expert_ffn: rows.len(),
            shared_ffn: moe.shared_ffn.map(|_| shared_rows.len()),
            ..moe.clone()
        };
        Ok(Self {
            moe,
            router,
            weights,
            shared,
        })
    }

    /// Its routing and each expert's rows (for the GPU's upload).
    pub(crate) fn config(&self) -> &MoeConfig {
        &self.moe
    }

    pub(crate) fn router(&self) -> &Matrix {
        &self.router
    }

    /// The shared expert's gate, up and down, and its gate vector.
    pub(crate) fn shared_expert(&self) -> Option<([&Matrix; 3], &[f32])> {
        self.shared
            .as_ref()
            .map(|s| ([&s.w_gate, &s.w_up, &s.w_down], s.gate.as_slice()))
    }

    /// Each expert's gate, up and down.
    pub(crate) fn expert_matrices(&self) -> Vec<[ExpertMatrix<'_>; 3]> {
        match &self.weights {
            ExpertWeights::Native(all) => all
                .iter()
                .map(|m| m.each_ref().map(ExpertMatrix::Native))
                .collect(),
            ExpertWeights::Other(all) => all
                .iter()
                .map(|m| m.each_ref().map(ExpertMatrix::Other))
                .collect(),
        }
    }

    /// Bytes of weights held.
    pub fn size_bytes(&self) -> usize {
        let experts: usize = match &self.weights {
            ExpertWeights::Native(w) => w.iter().flatten().map(QMatrix::size_bytes).sum(),
            ExpertWeights::Other(w) => w.iter().flatten().map(Matrix::size_bytes).sum(),
        };
        let shared = self.shared.as_ref().map_or(0, |s| {
            s.w_gate.size_bytes() + s.w_up.size_bytes() + s.w_down.size_bytes() + s.gate.len() * 4
        });
        self.router.size_bytes() + experts + shared
    }

    /// Bytes one token reads: the router, its `experts_per_token` experts'
    /// share of all experts, and the shared expert.
    pub fn bytes_per_token(&self) -> usize {
        let experts: usize = match &self.weights {
            ExpertWeights::Native(w) => w.iter().flatten().map(QMatrix::size_bytes).sum(),
            ExpertWeights::Other(w) => w.iter().flatten().map(Matrix::size_bytes).sum(),
        };
        let routed = experts * self.moe.experts_per_token / self.moe.experts.max(1);
        self.size_bytes() - experts + routed
    }

    /// Each token's experts and weights, the rows sorted by expert, and
    /// which token each sorted row reads; returns the number of rows.
    fn route_tokens(
        &self,
        normed: &[f32],
        n: usize,
        hidden: usize,
        ws: &mut MoeWorkspace,
        pool: &ThreadPool,
    ) -> Result<usize, ForwardError> {
        let moe = &self.moe;
        let (experts, k) = (moe.experts, moe.experts_per_token);
        ws.acts.set(&normed[..n * hidden], n, hidden);
        ws.logits.resize(n * experts, 0.0);
        self.router
            .matmul(&mut ws.acts, n, normed, &mut ws.logits, pool)?;
        ws.routes.resize(n * k, Route::default());
        for (logits, routes) in ws
            .logits
            .chunks_exact_mut(experts)
            .zip(ws.routes.chunks_exact_mut(k))
        {
            route(logits, moe.normalize_top_k, routes);
        }
        sort_by_expert(ws, n, k, experts);
        let rows = n * k;
        // Each sorted row reads its token's row of the input, quantized once.
        ws.token_of_row.resize(rows, 0);
        for (slot, &row) in ws.sorted_row.iter().enumerate() {
            ws.token_of_row[row] = slot / k;
        }
        Ok(rows)
    }

    /// `out` (`n x hidden`) = the weighted sum of each token's experts over
    /// `normed` (`n x hidden`). On a tensor rank (`splits`) each expert's
    /// intermediate rows are gathered whole and this rank computes its
    /// rows of every down projection, then gathers the others' (see
    /// [`super::gather`]): what one machine computes, bit for bit.
    pub fn forward(
        &self,
        rows: Rows<'_>,
        hidden: usize,
        ws: &mut MoeWorkspace,
        ranks: &mut Ranks<'_>,
        splits: Option<ExpertSplits<'_>>,
    ) -> Result<(), ForwardError> {
        let Rows {
            n,
            input: normed,
            out,
        } = rows;
        let (pool, group) = (ranks.pool, &mut *ranks.group);
        let moe = &self.moe;
        let k = moe.experts_per_token;
        let rows = self.route_tokens(normed, n, hidden, ws, pool)?;
        let f = moe.expert_ffn;
        ws.gate.resize(rows * f, 0.0);
        ws.up.resize(rows * f, 0.0);
        match &self.weights {
            ExpertWeights::Native(native) => experts_gated(native, ws, rows, f, pool),
            ExpertWeights::Other(other) => {
                experts_gated_one_by_one(other, ws, normed, hidden, f, pool)?
            }
        }
        // This rank's columns of the output: all of them on one machine.
        let width = splits.map_or(hidden, |s| s.hidden.own(group.rank()));
        let whole_f = match splits {
            Some(s) => {
                let whole = grown(&mut ws.gathers.whole, rows * s.experts.width());
                let local = &ws.gate[..rows * f];
                s.experts
                    .gather(group, rows, local, &mut ws.gathers.scratch, whole)?;
                s.experts.width()
            }
            None => f,
        };
        ws.down.resize(rows * width, 0.0);
        match &self.weights {
            ExpertWeights::Native(native) => {
                experts_down(native, ws, rows, whole_f, width, splits.is_some(), pool)
            }
            ExpertWeights::Other(other) => {
                experts_down_one_by_one(other, ws, whole_f, width, splits.is_some(), pool)?
            }
        }
        let sum = match splits {
            Some(_) => grown(&mut ws.gathers.part, n * width),
            None => &mut out[..n * hidden],
        };
        // Each token's experts, summed in its own top-k order.
        for (t, out_row) in sum.chunks_exact_mut(width).enumerate() {
            for j in 0..k {
                let slot = t * k + j;
                let row = ws.sorted_row[slot];
                let weight = ws.routes[slot].weight;
                let expert_out = &ws.down[row * width..(row + 1) * width];
                if j == 0 {
                    for (o, v) in out_row.iter_mut().zip(expert_out) {
                        *o = v * weight;
                    }
                } else {
                    for (o, v) in out_row.iter_mut().zip(expert_out) {
                        *o += v * weight;
                    }
                }
            }
        }
        if let Some(shared) = &self.shared {
            let rows = Rows {
                n,
                input: normed,
                out: &mut *out,
            };
            let mut ranks = Ranks {
                pool,
                group: &mut *group,
            };
            shared.add_to(rows, [hidden, width], ws, &mut ranks, splits)?;
        }
        if let Some(s) = splits {
            let part = &ws.gathers.part[..n * width];
            s.hidden.gather(
                group,
                n,
                part,
                &mut ws.gathers.scratch,
                &mut out[..n * hidden],
            )?;
        }
        Ok(())
    }
}

/// How a tensor rank's expert rows and output rows fit into whole rows.
#[derive(Clone, Copy)]
pub struct ExpertSplits<'a> {
    /// Every rank's intermediate rows of each expert.
    pub experts: &'a ColumnSplit,
    /// Every rank's intermediate rows of the shared expert.
    pub shared: &'a ColumnSplit,
    /// Every rank's rows of the down projections' output.
    pub hidden: &'a ColumnSplit,
}

impl SharedExpert {
    /// Adds `sigmoid(gate · x) * mlp(x)` for each of the `n` tokens: into
    /// `out` (`n x hidden`) on one machine; on a tensor rank into its
    /// `width` columns in `ws.gathers.part`, its intermediate rows gathered
    /// whole first.
    fn add_to(
        &self,
        rows: Rows<'_>,
        [hidden, width]: [usize; 2],
        ws: &mut MoeWorkspace,
        ranks: &mut Ranks<'_>,
        splits: Option<ExpertSplits<'_>>,
    ) -> Result<(), ForwardError> {
        let Rows {
            n,
            input: normed,
            out,
        } = rows;
        let (pool, group) = (ranks.pool, &mut *ranks.group);
        let f = self.w_gate.rows();
        ws.shared_gate.resize(n * f, 0.0);
        ws.shared_up.resize(n * f, 0.0);
        ws.down.resize(n * width, 0.0);
        ws.acts.set(&normed[..n * hidden], n, hidden);
        Matrix::matmul_many(
            [&self.w_gate, &self.w_up],
            &mut ws.acts,
            n,
            normed,
            [&mut ws.shared_gate[..n * f], &mut ws.shared_up[..n * f]],
            pool,
        )?;
        silu_mul_parallel(&mut ws.shared_gate[..n * f], &ws.shared_up[..n * f], pool);
        let (input, whole_f) = match splits {
            Some(s) => {
                let whole = grown(&mut ws.gathers.whole, n * s.shared.width());
                let local = &ws.shared_gate[..n * f];
                s.shared
                    .gather(group, n, local, &mut ws.gathers.scratch, whole)?;
                (&ws.gathers.whole[..n * s.shared.width()], s.shared.width())
            }
            None => (&ws.shared_gate[..n * f], f),
        };
        ws.acts.set(input, n, whole_f);
        self.w_down
            .matmul(&mut ws.acts, n, input, &mut ws.down[..n * width], pool)?;
        let sum = match splits {
            Some(_) => &mut ws.gathers.part[..n * width],
            None => &mut out[..n * hidden],
        };
        for t in 0..n {
            let x = &normed[t * hidden..(t + 1) * hidden];
            let scale = ops::sigmoid(ops::dot(x, &self.gate));
            let row = t * width..(t + 1) * width;
            for (o, v) in sum[row.clone()].iter_mut().zip(&ws.down[row]) {
                *o += scale * v;
            }
        }
        Ok(())
    }
}

/// Every expert's gate and up in one parallel region, then SwiGLU, into
/// `ws.gate`. `ws.acts` holds the block's input (one row per token).
fn experts_gated(
    native: &[[QMatrix; 3]],
    ws: &mut MoeWorkspace,
    rows: usize,
    f: usize,
    pool: &ThreadPool,
) {
    quant::matmul_grouped(
        |e| [&native[e][0], &native[e][1]],
        &ws.groups,
        &mut ws.acts,
        Some(&ws.token_of_row),
        [&mut ws.gate[..rows * f], &mut ws.up[..rows * f]],
        pool,
    );
    silu_mul_parallel(&mut ws.gate[..rows * f], &ws.up[..rows * f], pool);
}

/// Every expert's down in one parallel region, over the sorted rows of
/// `ws.gate` (or, `gathered`, the whole rows in `ws.gathers.whole`), `f`
/// wide, into `width` columns of `ws.down`.
fn experts_down(
    native: &[[QMatrix; 3]],
    ws: &mut MoeWorkspace,
    rows: usize,
    f: usize,
    width: usize,
    gathered: bool,
    pool: &ThreadPool,
) {
    let input = if gathered {
        &ws.gathers.whole
    } else {
        &ws.gate
    };
    ws.acts.set(&input[..rows * f], rows, f);
    quant::matmul_grouped(
        |e| [&native[e][2]],
        &ws.groups,
        &mut ws.acts,
        None,
        [&mut ws.down[..rows * width]],
        pool,
    );
}

/// Formats without a native kernel: each expert's gate and up through
/// candle, then SwiGLU, into `ws.gate`.
fn experts_gated_one_by_one(
    other: &[[Matrix; 3]],
    ws: &mut MoeWorkspace,
    normed: &[f32],
    hidden: usize,
    f: usize,
    pool: &ThreadPool,
) -> Result<(), candle_core::Error> {
    for (e, rows) in ws.groups.clone() {
        let [w_gate, w_up, _] = &other[e];
        let m = rows.len();
        ws.gathered.clear();
        for &token in &ws.token_of_row[rows.clone()] {
            let row = &normed[token * hidden..(token + 1) * hidden];
            ws.gathered.extend_from_slice(row);
        }
        let input = &ws.gathered[..];
        ws.acts.set(input, m, hidden);
        let gate = &mut ws.gate[rows.start * f..rows.end * f];
        w_gate.matmul(&mut ws.acts, m, input, gate, pool)?;
        let up = &mut ws.up[rows.start * f..rows.end * f];
        w_up.matmul(&mut ws.acts, m, input, up, pool)?;
        ops::silu_mul(gate, up);
    }
    Ok(())
}

/// [`experts_down`] through candle, one expert at a time.
fn experts_down_one_by_one(
    other: &[[Matrix; 3]],
    ws: &mut MoeWorkspace,
    f: usize,
    width: usize,
    gathered: bool,
    pool: &ThreadPool,
) -> Result<(), candle_core::Error> {
    for (e, rows) in ws.groups.clone() {
        let w_down = &other[e][2];
        let input = if gathered {
            &ws.gathers.whole
        } else {
            &ws.gate
        };
        let input = &input[rows.start * f..rows.end * f];
        ws.acts.set(input, rows.len(), f);
        let down = &mut ws.down[rows.start * width..rows.end * width];
        w_down.matmul(&mut ws.acts, rows.len(), input, down, pool)?;
    }
    Ok(())
}

/// Orders the step's (token, slot) pairs by expert (tokens ascending within
/// one): fills `sorted_row` and the groups of the experts that have rows.
fn sort_by_expert(ws: &mut MoeWorkspace, n: usize, k: usize, experts: usize) {
    ws.counts.clear();
    ws.counts.resize(experts + 1, 0);
    for r in &ws.routes[..n * k] {
        ws.counts[r.expert as usize + 1] += 1;
    }
    for e in 0..experts {
        ws.counts[e + 1] += ws.counts[e];
    }
    ws.groups.clear();
    for e in 0..experts {
        let rows = ws.counts[e]..ws.counts[e + 1];
        if !rows.is_empty() {
            ws.groups.push((e, rows));
        }
    }
    ws.sorted_row.resize(n * k, 0);
    for (slot, r) in ws.routes[..n * k].iter().enumerate() {
        let next = &mut ws.counts[r.expert as usize];
        ws.sorted_row[slot] = *next;
        *next += 1;
    }
}

fn silu_mul_parallel(gate: &mut [f32], up: &[f32], pool: &ThreadPool) {
    if gate.len() <= 4096 {
        ops::silu_mul(gate, up);
        return;
    }
    let len = gate.len();
    let view = DisjointSlice::new(gate);
    pool.run(|index, count| {
        let range = split_range(len, index, count, 64);
        // SAFETY: threads take disjoint ranges.
        ops::silu_mul(unsafe { view.part(range.clone()) }, &up[range]);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(logits: &[f32], k: usize, normalize: bool) -> Vec<Route> {
        let mut logits = logits.to_vec();
        let mut out = vec![Route::default(); k];
        route(&mut logits, normalize, &mut out);
        out
    }

    #[test]
    fn the_best_experts_come_first_with_their_probabilities() {
        let r = routes(&[0.0, 2.0, 1.0, 2.0f32.ln()], 2, false);
        assert_eq!(
            r.iter().map(|r| r.expert).collect::<Vec<_>>(),
            vec![1, 2],
            "{r:?}"
        );
        let total: f32 = [0.0f32, 2.0, 1.0, 2.0f32.ln()]
            .iter()
            .map(|v| v.exp())
            .sum();
        assert!((r[0].weight - 2.0f32.exp() / total).abs() < 1e-6);
        assert!((r[1].weight - 1.0f32.exp() / total).abs() < 1e-6);
    }

    #[test]
    fn renormalised_weights_sum_to_one_in_the_same_ratio() {
        let plain = routes(&[0.5, -1.0, 3.0, 0.0], 2, false);
        let normal = routes(&[0.5, -1.0, 3.0, 0.0], 2, true);
        assert_eq!(plain[0].expert, normal[0].expert);
        assert!((normal.iter().map(|r| r.weight).sum::<f32>() - 1.0).abs() < 1e-6);
        let ratio = |r: &[Route]| r[0].weight / r[1].weight;
        assert!((ratio(&plain) - ratio(&normal)).abs() < 1e-4);
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_none_is_chosen_twice() {
        let r = routes(&[1.0, 1.0, 1.0, 1.0], 4, true);
        assert_eq!(
            r.iter().map(|r| r.expert).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        assert!(r.iter().all(|r| (r.weight - 0.25).abs() < 1e-6));
    }

    #[test]
    fn rows_are_sorted_by_expert_with_tokens_in_order() {
        let mut ws = MoeWorkspace::default();
        let e = |expert| Route {
            expert,
            weight: 0.5,
        };
        // Token 0 picks experts 2, 0; token 1 picks 0, 3; token 2 picks 2, 3.
        ws.routes = vec![e(2), e(0), e(0), e(3), e(2), e(3)];
        sort_by_expert(&mut ws, 3, 2, 4);
        assert_eq!(ws.groups, vec![(0, 0..2), (2, 2..4), (3, 4..6)]);
        assert_eq!(ws.sorted_row, vec![2, 0, 1, 4, 3, 5]);
    }
}
