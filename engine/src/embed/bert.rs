//! A BERT encoder (all-MiniLM, BGE, E5 and the other BERT-style sentence
//! models): word, position and token-type embeddings, then post-norm layers
//! of bidirectional attention and a GELU MLP, in f32 as transformers'
//! `BertModel` computes them. A batch of sequences runs as one set of
//! matrix products over all their tokens, attention within each sequence.

use std::ops::Range;

use crate::threadpool::ThreadPool;

use super::error::EmbedError;
use super::layers::{attention, f32_bytes, spans, LayerNorm, Linear};
use super::weights::Tensors;

/// The parts of a BERT `config.json` the encoder needs.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    #[serde(default = "bert_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "gelu")]
    pub hidden_act: String,
    #[serde(default = "absolute")]
    pub position_embedding_type: String,
}

fn two() -> usize {
    2
}
fn bert_eps() -> f64 {
    1e-12
}
fn gelu() -> String {
    "gelu".into()
}
fn absolute() -> String {
    "absolute".into()
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_out: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

/// The encoder's weights.
pub struct Bert {
    pub config: BertConfig,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    embedding_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl Bert {
    pub fn load(config: BertConfig, t: &Tensors) -> Result<Self, EmbedError> {
        if config.position_embedding_type != "absolute" {
            return Err(EmbedError::Unsupported(format!(
                "position_embedding_type {:?} (absolute only)",
                config.position_embedding_type
            )));
        }
        if !matches!(
            config.hidden_act.as_str(),
            "gelu" | "gelu_new" | "gelu_pytorch_tanh"
        ) {
            return Err(EmbedError::Unsupported(format!(
                "hidden_act {:?}",
                config.hidden_act
            )));
        }
        let h = config.hidden_size;
        if config.num_attention_heads == 0 || !h.is_multiple_of(config.num_attention_heads) {
            return Err(EmbedError::Unsupported(format!(
                "{} heads for a hidden size of {h}",
                config.num_attention_heads
            )));
        }
        let eps = config.layer_norm_eps;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = format!("encoder.layer.{i}");
                Ok(Layer {
                    query: Linear::load(t, &format!("{p}.attention.self.query"), h, h)?,
                    key: Linear::load(t, &format!("{p}.attention.self.key"), h, h)?,
                    value: Linear::load(t, &format!("{p}.attention.self.value"), h, h)?,
                    attention_out: Linear::load(t, &format!("{p}.attention.output.dense"), h, h)?,
                    attention_norm: LayerNorm::load(
                        t,
                        &format!("{p}.attention.output.LayerNorm"),
                        h,
                        eps,
                    )?,
                    intermediate: Linear::load(
                        t,
                        &format!("{p}.intermediate.dense"),
                        config.intermediate_size,
                        h,
                    )?,
                    output: Linear::load(
                        t,
                        &format!("{p}.output.dense"),
                        h,
                        config.intermediate_size,
                    )?,
                    output_norm: LayerNorm::load(t, &format!("{p}.output.LayerNorm"), h, eps)?,
                })
            })
            .collect::<Result<_, EmbedError>>()?;
        Ok(Self {
            word: t.f32("embeddings.word_embeddings.weight", &[config.vocab_size, h])?,
            position: t.f32(
                "embeddings.position_embeddings.weight",
                &[config.max_position_embeddings, h],
            )?,
            token_type: t.f32(
                "embeddings.token_type_embeddings.weight",
                &[config.type_vocab_size, h],
            )?,
            embedding_norm: LayerNorm::load(t, "embeddings.LayerNorm", h, eps)?,
            layers,
            config,
        })
    }

    /// The bytes of the weights held (f32).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let linears = [
                    &l.query,
                    &l.key,
                    &l.value,
                    &l.attention_out,
                    &l.intermediate,
                    &l.output,
                ];
                f32_bytes(&linears, &[&l.attention_norm, &l.output_norm], &[])
            })
            .sum();
        let tables = [&self.word[..], &self.position, &self.token_type];
        layers + f32_bytes(&[], &[&self.embedding_norm], &tables)
    }

    /// The last hidden states of every token of `sequences` (each within
    /// the vocabulary and the position table, checked by the caller), one
    /// row of `hidden_size` per token, sequence after sequence.
    pub fn forward(&self, sequences: &[Vec<u32>], pool: &ThreadPool) -> Vec<f32> {
        let h = self.config.hidden_size;
        let spans = spans(sequences);
        let tokens = spans.last().map_or(0, |s| s.end);
        let mut x = vec![0.0f32; tokens * h];
        for (sequence, span) in sequences.iter().zip(&spans) {
            for (position, (&id, row)) in sequence
                .iter()
                .zip(x[span.start * h..span.end * h].chunks_mut(h))
                .enumerate()
            {
                let word = &self.word[id as usize * h..(id as usize + 1) * h];
                let place = &self.position[position * h..(position + 1) * h];
                // Token type 0: one segment.
                let kind = &self.token_type[..h];
                for (((v, w), p), k) in row.iter_mut().zip(word).zip(place).zip(kind) {
                    *v = w + p + k;
                }
            }
        }
        self.embedding_norm.apply(&mut x);
        for layer in &self.layers {
            x = self.layer(layer, x, &spans, pool);
        }
        x
    }

    fn layer(
        &self,
        layer: &Layer,
        x: Vec<f32>,
        spans: &[Range<usize>],
        pool: &ThreadPool,
    ) -> Vec<f32> {
        let tokens = spans.last().map_or(0, |s| s.end);
        let q = layer.query.forward(&x, tokens, pool);
        let k = layer.key.forward(&x, tokens, pool);
        let v = layer.value.forward(&x, tokens, pool);
        let context = attention(&q, &k, &v, spans, self.config.num_attention_heads);
        let mut attended = layer.attention_out.forward(&context, tokens, pool);
        for (a, input) in attended.iter_mut().zip(&x) {
            *a += input;
        }
        layer.attention_norm.apply(&mut attended);
        let mut inner = layer.intermediate.forward(&attended, tokens, pool);
        let exact = self.config.hidden_act == "gelu";
        for value in &mut inner {
            *value = if exact {
                gelu_erf(*value)
            } else {
                gelu_tanh(*value)
            };
        }
        let mut out = layer.output.forward(&inner, tokens, pool);
        for (o, input) in out.iter_mut().zip(&attended) {
            *o += input;
        }
        layer.output_norm.apply(&mut out);
        out
    }
}

/// GELU as BERT's `gelu`: `x Φ(x)`, with the exact error function.
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x / std::f32::consts::SQRT_2))
}

/// GELU's tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}
