//! Every architecture's decoder on small random checkpoints (Hugging Face
//! layout): it loads, and a prompt run in one batch gives the same logits
//! as the same prompt fed token by token through the KV cache. That checks
//! the cache, RoPE positions, causal masking, GQA head sharing, q/k/v
//! biases (Qwen2) and q/k norms (Qwen3) against each other.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use serde_json::json;
use tessera_engine::formats::hf_source::HfSource;
use tessera_engine::model::{Architecture, ForwardOutput, StageInput, Transformer, Workspace};
use tessera_engine::threadpool::ThreadPool;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 32;
const FFN: usize = 96;
const VOCAB: usize = 300;
const LAYERS: usize = 2;

fn write_checkpoint(dir: &Path, model_type: &str, bias: bool, qk_norm: bool, tied: bool) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut tensors = HashMap::new();
    let mut add = |name: String, shape: &[usize], scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| offset + scale * rng.gen_range(-1.0f32..1.0))
            .collect();
        tensors.insert(
            name,
            Tensor::from_vec(values, shape, &Device::Cpu).expect("tensor"),
        );
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    add(
        "model.embed_tokens.weight".into(),
        &[VOCAB, HIDDEN],
        1.0,
        0.0,
    );
    add("model.norm.weight".into(), &[HIDDEN], 0.1, 1.0);
    if !tied {
        add("lm_head.weight".into(), &[VOCAB, HIDDEN], 0.2, 0.0);
    }
    for i in 0..LAYERS {
        let p = |part: &str| format!("model.layers.{i}.{part}");
        add(p("input_layernorm.weight"), &[HIDDEN], 0.1, 1.0);
        add(p("post_attention_layernorm.weight"), &[HIDDEN], 0.1, 1.0);
        add(p("self_attn.q_proj.weight"), &[q, HIDDEN], 0.3, 0.0);
        add(p("self_attn.k_proj.weight"), &[kv, HIDDEN], 0.3, 0.0);
        add(p("self_attn.v_proj.weight"), &[kv, HIDDEN], 0.3, 0.0);
        add(p("self_attn.o_proj.weight"), &[HIDDEN, q], 0.2, 0.0);
        add(p("mlp.gate_proj.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(p("mlp.up_proj.weight"), &[FFN, HIDDEN], 0.3, 0.0);
        add(p("mlp.down_proj.weight"), &[HIDDEN, FFN], 0.2, 0.0);
        if bias {
            add(p("self_attn.q_proj.bias"), &[q], 0.5, 0.0);
            add(p("self_attn.k_proj.bias"), &[kv], 0.5, 0.0);
            add(p("self_attn.v_proj.bias"), &[kv], 0.5, 0.0);
        }
        if qk_norm {
            add(p("self_attn.q_norm.weight"), &[HEAD_DIM], 0.2, 1.0);
            add(p("self_attn.k_norm.weight"), &[HEAD_DIM], 0.2, 1.0);
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    let config = json!({
        "architectures": ["X"], "model_type": model_type, "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "vocab_size": VOCAB,
        "tie_word_embeddings": tied,
        "rope_scaling": if model_type == "llama" {
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        } else { serde_json::Value::Null },
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
}

fn batch_equals_incremental(model_type: &str, bias: bool, qk_norm: bool, tied: bool) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_checkpoint(dir.path(), model_type, bias, qk_norm, tied);
    let source = HfSource::open(dir.path()).expect("opens");
    let config = source.config().expect("config");
    assert_eq!(
        config.architecture,
        Architecture::from_name(model_type).expect("known")
    );
    assert_eq!(
        (config.qkv_bias, config.qk_norm, config.tied_embeddings),
        (bias, qk_norm, tied)
    );
    let model = Transformer::load(&source, config, 0..LAYERS, |_, _| {}).expect("loads");
    let pool = ThreadPool::new(2);
    let tokens: Vec<u32> = (0..23).map(|i| (i * 37 % VOCAB) as u32).collect();

    let mut cache = model.new_cache();
    let mut ws = Workspace::default();
    let batched = match model.forward(StageInput::Tokens(&tokens), &mut cache, &mut ws, &pool) {
        Ok(ForwardOutput::Logits(l)) => l.to_vec(),
        _ => panic!("a whole model returns logits"),
    };
    let mut cache = model.new_cache();
    let mut incremental = Vec::new();
    for token in &tokens {
        match model.forward(StageInput::Tokens(&[*token]), &mut cache, &mut ws, &pool) {
            Ok(ForwardOutput::Logits(l)) => incremental = l.to_vec(),
            _ => panic!("a whole model returns logits"),
        }
    }
    assert_eq!(cache.len(), tokens.len());
    assert!(batched.iter().all(|v| v.is_finite()));
    let spread = batched.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(spread > 0.1, "logits should not be flat");
    for (a, b) in batched.iter().zip(&incremental) {
        assert!(
            (a - b).abs() <= 1e-4 * spread,
            "{model_type}: batch {a} vs incremental {b}"
        );
    }
}

#[test]
fn llama_with_llama3_rope_scaling() {
    batch_equals_incremental("llama", false, false, false);
}

#[test]
fn mistral_with_tied_embeddings() {
    batch_equals_incremental("mistral", false, false, true);
}

#[test]
fn qwen2_with_qkv_bias() {
    batch_equals_incremental("qwen2", true, false, true);
}

#[test]
fn qwen3_with_qk_norm() {
    batch_equals_incremental("qwen3", false, true, true);
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_checkpoint(dir.path(), "qwen3", false, false, true);
    // The config says qwen3 (q/k norms) but the checkpoint has none.
    let source = HfSource::open(dir.path()).expect("opens");
    let config = source.config().expect("config");
    let error = Transformer::load(&source, config, 0..LAYERS, |_, _| {})
        .err()
        .expect("load fails")
        .to_string();
    assert!(
        error.contains("attn_q_norm") || error.contains("q_norm"),
        "{error}"
    );
}
