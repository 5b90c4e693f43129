//! nomic-bert (nomic-embed-text): a BERT-style encoder with rotary
//! positions instead of a position table, a fused QKV projection, a SwiGLU
//! MLP and no biases, post-norm, in f32 as its reference implementation
//! (`modeling_hf_nomic_bert.py`, which sentence-transformers loads with
//! `trust_remote_code`) computes it.

use crate::threadpool::ThreadPool;

use super::error::EmbedError;
use super::layers::{attention, f32_bytes, spans, LayerNorm, Linear};
use super::weights::Tensors;

/// The parts of a nomic-bert `config.json` the encoder needs (GPT-2's
/// names, as its config class derives from GPT-2's).
#[derive(Clone, Debug, serde::Deserialize)]
pub struct NomicConfig {
    pub vocab_size: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_layer: usize,
    pub n_inner: Option<usize>,
    #[serde(default = "positions")]
    pub n_positions: usize,
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    #[serde(default = "eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "base")]
    pub rotary_emb_base: f32,
    #[serde(default)]
    pub rotary_emb_fraction: f32,
    #[serde(default)]
    pub rotary_emb_interleaved: bool,
    pub rotary_scaling_factor: Option<f64>,
    #[serde(default = "yes")]
    pub qkv_proj_bias: bool,
    #[serde(default = "yes")]
    pub mlp_fc1_bias: bool,
    #[serde(default = "yes")]
    pub mlp_fc2_bias: bool,
    #[serde(default)]
    pub prenorm: bool,
    #[serde(default = "swiglu")]
    pub activation_function: String,
    #[serde(default = "one")]
    pub pad_vocab_size_multiple: usize,
}

fn positions() -> usize {
    2048
}
fn two() -> usize {
    2
}
fn one() -> usize {
    1
}
fn eps() -> f64 {
    1e-5
}
fn base() -> f32 {
    10_000.0
}
fn yes() -> bool {
    true
}
fn swiglu() -> String {
    "swiglu".into()
}

impl NomicConfig {
    /// The vocabulary as the checkpoint stores it (padded to a multiple).
    fn stored_vocab(&self) -> usize {
        self.vocab_size
            .next_multiple_of(self.pad_vocab_size_multiple.max(1))
    }

    /// The MLP's width: `n_inner` (else 8/3 of the hidden size) rounded up
    /// to a multiple of 256, as the gated MLP rounds it.
    fn mlp_width(&self) -> usize {
        let wanted = self.n_inner.unwrap_or(8 * self.n_embd / 3);
        wanted.next_multiple_of(256)
    }

    /// What this encoder computes; anything else is refused by name.
    fn check(&self) -> Result<(), EmbedError> {
        let refuse = |what: String| Err(EmbedError::Unsupported(format!("nomic-bert with {what}")));
        if self.prenorm {
            return refuse("prenorm".into());
        }
        if self.activation_function != "swiglu" {
            return refuse(format!("activation {:?}", self.activation_function));
        }
        if self.rotary_emb_fraction != 1.0 || self.rotary_emb_interleaved {
            return refuse(format!(
                "rotary fraction {} (interleaved {})",
                self.rotary_emb_fraction, self.rotary_emb_interleaved
            ));
        }
        if let Some(factor) = self.rotary_scaling_factor {
            return refuse(format!("rotary scaling factor {factor} (dynamic NTK)"));
        }
        if self.n_head == 0
            || !self.n_embd.is_multiple_of(self.n_head)
            || !(self.n_embd / self.n_head).is_multiple_of(2)
        {
            return refuse(format!(
                "{} heads for a hidden size of {}",
                self.n_head, self.n_embd
            ));
        }
        Ok(())
    }
}

struct Layer {
    qkv: Linear,
    out: Linear,
    norm1: LayerNorm,
    up: Linear,
    gate: Linear,
    down: Linear,
    norm2: LayerNorm,
}

pub struct NomicBert {
    pub config: NomicConfig,
    word: Vec<f32>,
    token_type: Vec<f32>,
    embedding_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl NomicBert {
    pub fn load(config: NomicConfig, t: &Tensors) -> Result<Self, EmbedError> {
        config.check()?;
        let h = config.n_embd;
        let eps = config.layer_norm_epsilon;
        let width = config.mlp_width();
        let layers = (0..config.n_layer)
            .map(|i| {
                let p = format!("encoder.layers.{i}");
                let (fc1, fc2) = (config.mlp_fc1_bias, config.mlp_fc2_bias);
                Ok(Layer {
                    qkv: Linear::load_with(
                        t,
                        &format!("{p}.attn.Wqkv"),
                        3 * h,
                        h,
                        config.qkv_proj_bias,
                    )?,
                    out: Linear::load_with(
                        t,
                        &format!("{p}.attn.out_proj"),
                        h,
                        h,
                        config.qkv_proj_bias,
                    )?,
                    norm1: LayerNorm::load(t, &format!("{p}.norm1"), h, eps)?,
                    up: Linear::load_with(t, &format!("{p}.mlp.fc11"), width, h, fc1)?,
                    gate: Linear::load_with(t, &format!("{p}.mlp.fc12"), width, h, fc1)?,
                    down: Linear::load_with(t, &format!("{p}.mlp.fc2"), h, width, fc2)?,
                    norm2: LayerNorm::load(t, &format!("{p}.norm2"), h, eps)?,
                })
            })
            .collect::<Result<_, EmbedError>>()?;
        Ok(Self {
            word: t.f32(
                "embeddings.word_embeddings.weight",
                &[config.stored_vocab(), h],
            )?,
            token_type: t.f32(
                "embeddings.token_type_embeddings.weight",
                &[config.type_vocab_size, h],
            )?,
            embedding_norm: LayerNorm::load(t, "emb_ln", h, eps)?,
            layers,
            config,
        })
    }

    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let linears = [&l.qkv, &l.out, &l.up, &l.gate, &l.down];
                f32_bytes(&linears, &[&l.norm1, &l.norm2], &[])
            })
            .sum();
        let tables = [&self.word[..], &self.token_type];
        layers + f32_bytes(&[], &[&self.embedding_norm], &tables)
    }

    /// The last hidden states of every token of `sequences` (each within
    /// the vocabulary, checked by the caller), one row of `n_embd` per
    /// token, sequence after sequence.
    pub fn forward(&self, sequences: &[Vec<u32>], pool: &ThreadPool) -> Vec<f32> {
        let h = self.config.n_embd;
        let spans = spans(sequences);
        let tokens = spans.last().map_or(0, |s| s.end);
        let mut x = Vec::with_capacity(tokens * h);
        // Token type 0: one segment.
        let kind = &self.token_type[..h];
        for &id in sequences.iter().flatten() {
            let word = &self.word[id as usize * h..(id as usize + 1) * h];
            x.extend(word.iter().zip(kind).map(|(w, k)| w + k));
        }
        self.embedding_norm.apply(&mut x);
        let positions: Vec<usize> = sequences.iter().flat_map(|s| 0..s.len()).collect();
        let (cos, sin) = self.rotary_tables(positions.iter().max().map_or(0, |p| p + 1));
        for layer in &self.layers {
            x = self.layer(layer, x, (&spans, &positions), (&cos, &sin), pool);
        }
        x
    }

    /// Each position's cos and sin per rotary pair, as the reference
    /// computes them in f32: angle `p / base^(2i/d)`.
    fn rotary_tables(&self, positions: usize) -> (Vec<f32>, Vec<f32>) {
        let d = self.config.n_embd / self.config.n_head;
        let pairs = d / 2;
        let inverse: Vec<f32> = (0..pairs)
            .map(|i| 1.0 / self.config.rotary_emb_base.powf((2 * i) as f32 / d as f32))
            .collect();
        let mut cos = Vec::with_capacity(positions * pairs);
        let mut sin = Vec::with_capacity(positions * pairs);
        for p in 0..positions {
            for f in &inverse {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// Rotates every head of each row of `x` (rows of `heads` heads) by
    /// its token's position, the first half of a head against the second.
    fn rotate(&self, x: &mut [f32], positions: &[usize], (cos, sin): (&[f32], &[f32])) {
        let h = self.config.n_embd;
        let d = h / self.config.n_head;
        let pairs = d / 2;
        for (row, &p) in x.chunks_mut(h).zip(positions) {
            let (c, s) = (
                &cos[p * pairs..(p + 1) * pairs],
                &sin[p * pairs..(p + 1) * pairs],
            );
            for head in row.chunks_mut(d) {
                let (first, second) = head.split_at_mut(pairs);
                for i in 0..pairs {
                    let (a, b) = (first[i], second[i]);
                    first[i] = a * c[i] - b * s[i];
                    second[i] = b * c[i] + a * s[i];
                }
            }
        }
    }

    fn layer(
        &self,
        layer: &Layer,
        x: Vec<f32>,
        (spans, positions): (&[std::ops::Range<usize>], &[usize]),
        tables: (&[f32], &[f32]),
        pool: &ThreadPool,
    ) -> Vec<f32> {
        let h = self.config.n_embd;
        let tokens = positions.len();
        let qkv = layer.qkv.forward(&x, tokens, pool);
        let mut q = Vec::with_capacity(tokens * h);
        let mut k = Vec::with_capacity(tokens * h);
        let mut v = Vec::with_capacity(tokens * h);
        for row in qkv.chunks(3 * h) {
            q.extend_from_slice(&row[..h]);
            k.extend_from_slice(&row[h..2 * h]);
            v.extend_from_slice(&row[2 * h..]);
        }
        self.rotate(&mut q, positions, tables);
        self.rotate(&mut k, positions, tables);
        let context = attention(&q, &k, &v, spans, self.config.n_head);
        let mut attended = layer.out.forward(&context, tokens, pool);
        for (a, input) in attended.iter_mut().zip(&x) {
            *a += input;
        }
        layer.norm1.apply(&mut attended);
        let mut up = layer.up.forward(&attended, tokens, pool);
        let gate = layer.gate.forward(&attended, tokens, pool);
        for (u, g) in up.iter_mut().zip(&gate) {
            *u *= g / (1.0 + (-g).exp());
        }
        let mut out = layer.down.forward(&up, tokens, pool);
        for (o, input) in out.iter_mut().zip(&attended) {
            *o += input;
        }
        layer.norm2.apply(&mut out);
        out
    }
}
