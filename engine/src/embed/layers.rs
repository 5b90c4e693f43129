//! The pieces the embedding encoders are made of, in f32: dense layers
//! (with or without a bias), layer norms, bidirectional attention within
//! each sequence of a batch, and where each sequence's rows lie.

use std::ops::Range;

use crate::ops::dot;
use crate::threadpool::{split_range, DisjointSlice, ThreadPool};

use super::error::EmbedError;
use super::weights::Tensors;

/// A dense layer: `out = W x + b`, `W` as `[out][in]`; no `b` where the
/// checkpoint has none.
pub struct Linear {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    inputs: usize,
    outputs: usize,
}

impl Linear {
    /// `{name}.weight` and `{name}.bias`.
    pub fn load(
        t: &Tensors,
        name: &str,
        outputs: usize,
        inputs: usize,
    ) -> Result<Self, EmbedError> {
        Self::load_with(t, name, outputs, inputs, true)
    }

    /// `{name}.weight`, and `{name}.bias` when `bias`.
    pub fn load_with(
        t: &Tensors,
        name: &str,
        outputs: usize,
        inputs: usize,
        bias: bool,
    ) -> Result<Self, EmbedError> {
        Ok(Self {
            weight: t.f32(&format!("{name}.weight"), &[outputs, inputs])?,
            bias: if bias {
                Some(t.f32(&format!("{name}.bias"), &[outputs])?)
            } else {
                None
            },
            inputs,
            outputs,
        })
    }

    pub fn values(&self) -> usize {
        self.weight.len() + self.bias.as_ref().map_or(0, Vec::len)
    }

    /// `x`: `tokens` rows of `inputs`; returns `tokens` rows of `outputs`.
    pub fn forward(&self, x: &[f32], tokens: usize, pool: &ThreadPool) -> Vec<f32> {
        let mut out = vec![0.0f32; tokens * self.outputs];
        let shared = DisjointSlice::new(&mut out);
        pool.run(|index, count| {
            let rows = split_range(tokens, index, count, 1);
            // SAFETY: each thread writes only the output rows of its own
            // token range, and `out` is not touched until `run` returns.
            let part = unsafe { shared.part(rows.start * self.outputs..rows.end * self.outputs) };
            for (row, t) in part.chunks_mut(self.outputs).zip(rows) {
                let input = &x[t * self.inputs..(t + 1) * self.inputs];
                for (o, value) in row.iter_mut().enumerate() {
                    let w = &self.weight[o * self.inputs..(o + 1) * self.inputs];
                    let bias = self.bias.as_ref().map_or(0.0, |b| b[o]);
                    *value = dot(w, input) + bias;
                }
            }
        });
        out
    }
}

pub struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    pub fn load(t: &Tensors, name: &str, width: usize, eps: f64) -> Result<Self, EmbedError> {
        Ok(Self {
            weight: t.f32(&format!("{name}.weight"), &[width])?,
            bias: t.f32(&format!("{name}.bias"), &[width])?,
            eps: eps as f32,
        })
    }

    pub fn values(&self) -> usize {
        self.weight.len() + self.bias.len()
    }

    pub fn apply(&self, x: &mut [f32]) {
        for row in x.chunks_mut(self.weight.len()) {
            let n = row.len() as f32;
            let mean = row.iter().sum::<f32>() / n;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + self.eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = (*v - mean) * inv * w + b;
            }
        }
    }
}

/// The bytes of f32 weights in `linears`, `norms` and `tables`.
pub fn f32_bytes(linears: &[&Linear], norms: &[&LayerNorm], tables: &[&[f32]]) -> usize {
    let values = linears.iter().map(|l| l.values()).sum::<usize>()
        + norms.iter().map(|n| n.values()).sum::<usize>()
        + tables.iter().map(|t| t.len()).sum::<usize>();
    values * std::mem::size_of::<f32>()
}

/// Softmax attention of every token over its own sequence, per head:
/// `q`, `k`, `v` are rows of `heads` heads, one per token.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &[Range<usize>],
    heads: usize,
) -> Vec<f32> {
    let tokens = spans.last().map_or(0, |s| s.end);
    let h = q.len() / tokens.max(1);
    let d = h / heads.max(1);
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0.0f32; q.len()];
    let mut scores = Vec::new();
    for span in spans {
        for head in 0..heads {
            let cols = head * d..(head + 1) * d;
            for i in span.clone() {
                let query = &q[i * h..][cols.clone()];
                scores.clear();
                scores.extend(
                    span.clone()
                        .map(|j| dot(query, &k[j * h..][cols.clone()]) * scale),
                );
                crate::ops::softmax(&mut scores);
                let row = &mut out[i * h..][cols.clone()];
                for (j, &weight) in span.clone().zip(&scores) {
                    crate::ops::axpy(row, weight, &v[j * h..][cols.clone()]);
                }
            }
        }
    }
    out
}

/// Each sequence's rows in the concatenated batch.
pub fn spans(sequences: &[Vec<u32>]) -> Vec<Range<usize>> {
    let mut start = 0;
    sequences
        .iter()
        .map(|s| {
            let span = start..start + s.len();
            start = span.end;
            span
        })
        .collect()
}
