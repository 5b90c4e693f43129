//! Tensor parallelism on a small random model held in memory (f32 weights,
//! so results are comparable to 1e-4 without quantization noise): uneven
//! KV-group splits, biases sliced with their rows, fused q/k/v and gate/up
//! tensors split section by section, a KV cache across two steps; and a
//! pipeline's head on its first stage, fed the last stage's normed rows.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tessera_engine::dist::collectives::{Group, SingleRank, TcpRing};
use tessera_engine::dist::shard::ShardSpec;
use tessera_engine::model::{
    Architecture, ForwardOutput, LoadError, Matrix, ModelConfig, RopeScaling, StageInput,
    TensorSource, Transformer, Workspace,
};
use tessera_engine::ops::RopeStyle;
use tessera_engine::quant::QMatrix;
use tessera_engine::threadpool::ThreadPool;

fn config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen2,
        layers: 2,
        hidden: 64,
        ffn: 96,
        heads: 6,
        kv_heads: 3,
        head_dim: 16,
        vocab: 40,
        context_length: 64,
        norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Halves,
        rope_scaling: RopeScaling::None,
        rotary_dims: 16,
        qkv_bias: true,
        qk_norm: false,
        tied_embeddings: false,
        sliding_window: None,
        moe: None,
        variant: Default::default(),
    }
}

/// Tensors by canonical name: shape and f32 values.
struct MemorySource(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl MemorySource {
    fn random(config: &ModelConfig, fused: bool) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut random = |n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
        };
        let (h, q, kv, f, v) = (
            config.hidden,
            config.q_dim(),
            config.kv_dim(),
            config.ffn,
            config.vocab,
        );
        let mut t = HashMap::new();
        t.insert("token_embd.weight".into(), (vec![v, h], random(v * h, 1.0)));
        t.insert("output.weight".into(), (vec![v, h], random(v * h, 0.3)));
        t.insert("output_norm.weight".into(), (vec![h], random(h, 1.0)));
        for i in 0..config.layers {
            let n = |p: &str| format!("blk.{i}.{p}");
            let (wq, wk, wv) = (random(q * h, 0.2), random(kv * h, 0.2), random(kv * h, 0.2));
            let (gate, up) = (random(f * h, 0.2), random(f * h, 0.2));
            if fused {
                let qkv = [wq, wk, wv].concat();
                t.insert(n("attn_qkv.weight"), (vec![q + 2 * kv, h], qkv));
                t.insert(n("ffn_up.weight"), (vec![2 * f, h], [gate, up].concat()));
            } else {
                t.insert(n("attn_q.weight"), (vec![q, h], wq));
                t.insert(n("attn_k.weight"), (vec![kv, h], wk));
                t.insert(n("attn_v.weight"), (vec![kv, h], wv));
                t.insert(n("ffn_gate.weight"), (vec![f, h], gate));
                t.insert(n("ffn_up.weight"), (vec![f, h], up));
            }
            t.insert(n("attn_q.bias"), (vec![q], random(q, 0.5)));
            t.insert(n("attn_k.bias"), (vec![kv], random(kv, 0.5)));
            t.insert(n("attn_v.bias"), (vec![kv], random(kv, 0.5)));
            t.insert(n("attn_output.weight"), (vec![h, q], random(h * q, 0.2)));
            t.insert(n("ffn_down.weight"), (vec![h, f], random(h * f, 0.2)));
            t.insert(n("attn_norm.weight"), (vec![h], random(h, 1.0)));
            t.insert(n("ffn_norm.weight"), (vec![h], random(h, 1.0)));
        }
        Self(t)
    }

    fn missing(&self, name: &str) -> LoadError {
        LoadError::MissingTensor {
            path: "memory".into(),
            tensor: name.into(),
        }
    }
}

impl TensorSource for MemorySource {
    fn path(&self) -> &str {
        "memory"
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.get(name).map(|(shape, _)| shape.clone())
    }

    fn matrix_part(
        &self,
        name: &str,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError> {
        let (shape, values) = self.0.get(name).ok_or_else(|| self.missing(name))?;
        let rows = rows.unwrap_or(0..shape[0]);
        let cols = cols.unwrap_or(0..shape[1]);
        let mut part = Vec::with_capacity(rows.len() * cols.len());
        for r in rows.clone() {
            part.extend_from_slice(&values[r * shape[1]..][cols.clone()]);
        }
        Ok(Matrix::Native(
            QMatrix::from_f32(rows.len(), cols.len(), &part).expect("f32 matrix"),
        ))
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        Ok(self
            .0
            .get(name)
            .ok_or_else(|| self.missing(name))?
            .1
            .clone())
    }
}

const PROMPT: [u32; 5] = [3, 17, 29, 1, 38];
const NEXT: u32 = 11;

/// Logits after the prompt and after one more token, on one rank (`None`
/// where the rank sent its share to rank 0).
fn run(model: &Transformer, group: &mut dyn Group) -> Vec<Option<Vec<f32>>> {
    let mut cache = model.new_cache();
    let mut ws = Workspace::default();
    let pool = ThreadPool::new(1);
    let mut out = Vec::new();
    for tokens in [&PROMPT[..], &[NEXT]] {
        let logits = model
            .forward_in(
                StageInput::Tokens(tokens),
                &mut cache,
                &mut ws,
                &pool,
                group,
                true,
            )
            .expect("forward");
        match logits {
            ForwardOutput::Logits(l) => out.push(Some(l.to_vec())),
            ForwardOutput::SentToFirst => out.push(None),
            ForwardOutput::Hidden(_) | ForwardOutput::Normed(_) | ForwardOutput::Best(_) => {
                panic!("a tensor rank returns logits")
            }
        }
    }
    out
}

fn single(fused: bool) -> Vec<Vec<f32>> {
    let source = MemorySource::random(&config(), fused);
    let model = Transformer::load(&source, config(), 0..2, |_, _| {}).expect("loads");
    run(&model, &mut SingleRank)
        .into_iter()
        .map(|logits| logits.expect("a single rank keeps its logits"))
        .collect()
}

/// Every rank's logits, ranks as threads on a loopback ring.
fn tensor_parallel(world: usize, fused: bool) -> Vec<Vec<Option<Vec<f32>>>> {
    let (listeners, addrs) = tessera_testkit::loopback_listeners(world);
    let ranks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, listener)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let source = MemorySource::random(&config(), fused);
                let spec = ShardSpec::Tensor {
                    rank: rank as u32,
                    world_size: world as u32,
                };
                let model =
                    Transformer::load_shard(&source, config(), &spec, |_, _| {}).expect("loads");
                let timeout = Duration::from_secs(10);
                let mut group: Box<dyn Group> = if world == 1 {
                    Box::new(SingleRank)
                } else {
                    Box::new(
                        TcpRing::from_listener(rank, listener, &addrs, "test", timeout, timeout)
                            .expect("ring"),
                    )
                };
                run(&model, group.as_mut())
            })
        })
        .collect();
    ranks.into_iter().map(|r| r.join().expect("rank")).collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn fused_projections_give_the_same_model() {
    assert_eq!(single(true), single(false), "bit for bit");
}

#[test]
fn every_world_size_up_to_the_kv_heads_matches_one_rank() {
    let reference = single(false);
    let scale = reference
        .iter()
        .flatten()
        .fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.1, "a meaningful model: max |logit| {scale}");
    for world in 1..=3 {
        for fused in [false, true] {
            let ranks = tensor_parallel(world, fused);
            let logits: Vec<Vec<f32>> = ranks[0]
                .iter()
                .map(|l| l.clone().expect("rank 0 gathers the logits"))
                .collect();
            let diff = max_diff(&logits, &reference);
            assert!(
                diff < 1e-4 * scale,
                "world {world} fused {fused}: max |diff| {diff}"
            );
            // The other ranks hand their share to rank 0, the one that samples.
            for (rank, steps) in ranks.iter().enumerate().skip(1) {
                assert!(
                    steps.iter().all(Option::is_none),
                    "world {world} rank {rank} keeps no logits"
                );
            }
        }
    }
}

/// A pipeline's last stage hands on its final-normed rows and the first
/// stage, which holds the head, turns them into the whole model's logits,
/// bit for bit.
#[test]
fn the_first_pipeline_stage_heads_the_rows_the_last_stage_normed() {
    let source = MemorySource::random(&config(), false);
    let whole = single(false);
    let first = Transformer::load(&source, config(), 0..1, |_, _| {}).expect("first stage");
    let last = Transformer::load(&source, config(), 1..2, |_, _| {}).expect("last stage");
    let pool = ThreadPool::new(1);
    let (mut first_cache, mut last_cache) = (first.new_cache(), last.new_cache());
    let (mut first_ws, mut last_ws) = (Workspace::default(), Workspace::default());
    for (tokens, expected) in [(&PROMPT[..], &whole[0]), (&[NEXT][..], &whole[1])] {
        let input = StageInput::Tokens(tokens);
        let out = first.forward_in(
            input,
            &mut first_cache,
            &mut first_ws,
            &pool,
            &mut SingleRank,
            true,
        );
        let hidden = match out.expect("first stage") {
            ForwardOutput::Hidden(h) => h.to_vec(),
            _ => panic!("the first stage hands on hidden states"),
        };
        let input = StageInput::Hidden(&hidden);
        let out = last.forward_in(
            input,
            &mut last_cache,
            &mut last_ws,
            &pool,
            &mut SingleRank,
            true,
        );
        let normed = match out.expect("last stage") {
            ForwardOutput::Normed(rows) => rows.to_vec(),
            _ => panic!("the last stage hands on normed rows"),
        };
        assert_eq!(normed.len(), config().hidden, "one row: the last token's");
        let logits = first
            .head_of_normed(&normed, &mut first_ws, &pool)
            .expect("head");
        assert_eq!(logits, &expected[..]);
    }
    // Rows of the wrong width, or a stage without the head: errors.
    assert!(first
        .head_of_normed(&[0.0; 3], &mut first_ws, &pool)
        .is_err());
    let row = vec![0.0; config().hidden];
    assert!(last.head_of_normed(&row, &mut last_ws, &pool).is_err());
}
