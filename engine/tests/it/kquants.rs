//! K-quant files: the default model requantized with llama.cpp's Q4_K_M
//! recipe (Q4_K and Q6_K where rows are whole super-blocks, Q5_0 and Q8_0
//! where they are not, as `llama-quantize` falls back for 576 columns) runs
//! on the native kernels and matches llama.cpp on the same file, on one
//! machine and over tensor world 2. Types without a native kernel (Q3_K
//! here) still run through candle's quantized matmul.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;
use serde_json::Value;
use tessera_engine::serve::{GenerateRequest, LoadedModel, Prompt, Session};
use tessera_engine::text::chat_template::ChatMessage;

use crate::distributed::{on_ranks, Sharding};

/// Same threshold as the Q4_1 golden test (`golden.rs`).
const MARGIN: f64 = 0.25;

/// The fixture: llama.cpp's greedy outputs on the file [`q4_k_m_mix`]
/// builds (tests/data/README.md says how it was made).
const FIXTURE: &str = "llamacpp-smollm2-135m-q4_k_m-mix.json";

/// llama.cpp's `use_more_bits`: the layers Q4_K_M gives Q6_K.
fn more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// The type llama-quantize's Q4_K_M gives a tensor of `cols` columns.
fn q4_k_m_type(name: &str, cols: usize, layers: usize) -> Option<GgmlDType> {
    let mut parts = name.split('.');
    let (Some("blk"), Some(layer), Some(kind)) = (parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    let layer: usize = layer.parse().ok()?;
    let wants = match kind {
        "attn_v" | "ffn_down" if more_bits(layer, layers) => GgmlDType::Q6K,
        _ if name.ends_with("norm.weight") => return None,
        _ => GgmlDType::Q4K,
    };
    // Rows that are not whole super-blocks fall back as llama.cpp does.
    Some(match (wants, cols % 256) {
        (GgmlDType::Q6K, 0) | (GgmlDType::Q4K, 0) => wants,
        (GgmlDType::Q6K, _) => GgmlDType::Q8_0,
        _ => GgmlDType::Q5_0,
    })
}

/// Writes the default model with each tensor requantized by `retype` (a
/// name and its column count to a type; `None` keeps the tensor).
pub(crate) fn requantized(dest: &Path, retype: impl Fn(&str, usize) -> Option<GgmlDType>) {
    let source = tessera_testkit::default_model_path();
    let mut file = std::fs::File::open(&source).expect("model");
    let content = gguf_file::Content::read(&mut file).expect("gguf");
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in names {
        let info = &content.tensor_infos[name];
        let tensor = info
            .read(&mut file, content.tensor_data_offset, &Device::Cpu)
            .expect("tensor");
        // Shapes are row-major here: the last dimension is the row length.
        let cols = *info.shape.dims().last().unwrap_or(&0);
        let tensor = match retype(name, cols) {
            Some(dtype) if dtype != tensor.dtype() => {
                let dense = tensor.dequantize(&Device::Cpu).expect("dequantize");
                QTensor::quantize(&dense, dtype).expect("quantize")
            }
            _ => tensor,
        };
        tensors.push((name.clone(), tensor));
    }
    let mut metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dest).expect("create");
    gguf_file::write(&mut out, &metadata, &tensor_refs).expect("write gguf");
}

/// The default model in Q4_K_M's type mix, built once per test run under
/// cargo's target tmp folder (where `golden_cases.py` can read it too), and
/// checked against the hash the fixture was made from.
pub(crate) fn q4_k_m_mix() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("smollm2-q4_k_m-mix.gguf");
            // Tests run as parallel processes: each builds its own copy and
            // renames it into place (readers keep whichever copy they opened).
            let own = path.with_extension(format!("{}.part", std::process::id()));
            let layers = 30;
            requantized(&own, |name, cols| q4_k_m_type(name, cols, layers));
            let bytes = std::fs::read(&own).expect("built file");
            let hash = blake3::hash(&bytes).to_hex().to_string();
            let expected = fixture()["file_blake3"].as_str().unwrap_or("").to_string();
            assert_eq!(
                hash,
                expected,
                "{} is not the file {FIXTURE} was made from: the requantization changed; \
                 remake the fixture (tests/data/README.md)",
                own.display()
            );
            std::fs::rename(&own, &path).expect("rename into place");
            path
        })
        .clone()
}

fn fixture() -> Value {
    let path = format!("{}/tests/data/{FIXTURE}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn ids(value: &Value) -> Vec<u32> {
    let list = value.as_array().expect("a list of ids");
    list.iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

/// Every fixture case through `session`, against llama.cpp by the golden
/// rule; returns the divergences at clear margins.
fn golden_failures(session: &mut Session<'_>) -> Vec<String> {
    let mut failures = Vec::new();
    for case in fixture()["cases"].as_array().expect("cases") {
        let name = case["case"].to_string();
        let prompt = match case["case"]["raw"].as_str() {
            Some(text) => Prompt::Raw(text.to_string()),
            None => {
                let messages: Vec<ChatMessage> =
                    serde_json::from_value(case["case"]["messages"].clone()).expect("messages");
                Prompt::Chat {
                    messages,
                    tools: None,
                }
            }
        };
        let reference = ids(&case["forced_token_ids"]);
        let mut request = GenerateRequest::new(prompt);
        request.max_tokens = reference.len();
        request.ignore_eos = true;
        let out = session
            .generate(&request, |_| ControlFlow::Continue(()))
            .expect("generates");
        assert_eq!(out.prompt_tokens, ids(&case["prompt_token_ids"]), "{name}");
        let margins = case["forced_margins"].as_array().expect("margins");
        for (step, (ours, theirs)) in out.tokens.iter().zip(&reference).enumerate() {
            let margin = margins[step].as_f64().expect("margin");
            if margin < MARGIN {
                eprintln!("{name}: identical for {step} steps, then margin {margin:.3}");
                break;
            }
            if ours != theirs {
                failures.push(format!(
                    "{name}: step {step}: ours {ours}, llama.cpp {theirs} (margin {margin:.3})"
                ));
                break;
            }
        }
    }
    failures
}

#[test]
fn a_q4_k_m_file_matches_llama_cpp() {
    let path = q4_k_m_mix();
    let model = LoadedModel::load(&path, |_, _| {}).expect("loads");
    let mut session = Session::new(&model, 2);
    let failures = golden_failures(&mut session);
    assert!(failures.is_empty(), "divergences:\n{}", failures.join("\n"));
}

#[test]
fn a_q4_k_m_file_over_tensor_world_2_matches_llama_cpp() {
    let path = q4_k_m_mix();
    let failures = on_ranks(&path, Sharding::Tensor, 2, |model, executor| {
        let mut session = Session::with_executor(model, executor);
        let failures = golden_failures(&mut session);
        session.executor().shutdown().expect("shutdown");
        failures
    });
    assert!(failures.is_empty(), "divergences:\n{}", failures.join("\n"));
}

#[test]
fn a_model_with_a_type_without_native_kernels_generates() {
    // bf16 has no CPU kernel of ours (the GPU reads it as stored): candle's
    // quantized matmul runs it.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mixed-bf16.gguf");
    requantized(&path, |name, _| {
        name.contains("ffn_down").then_some(GgmlDType::BF16)
    });
    let model = LoadedModel::load(&path, |_, _| {}).expect("mixed model loads");
    let mut session = Session::new(&model, 2);
    let mut request = GenerateRequest::new(Prompt::Raw("1, 2, 3, 4, 5,".into()));
    request.max_tokens = 6;
    let out = session
        .generate(&request, |_| ControlFlow::Continue(()))
        .expect("generates");
    // llama.cpp continues " 6, 7, 8" with margins above 1.8 on every step.
    assert!(out.text.starts_with(" 6, 7"), "{:?}", out.text);
}

#[test]
fn q4_k_m_logits_match_llama_cpp_at_the_first_generated_position() {
    let model = LoadedModel::load(&q4_k_m_mix(), |_, _| {}).expect("loads");
    q4_k_m_logits_match_llama_cpp(&model);
}

/// `model` (the Q4_K_M mix, on any device) against llama.cpp's logits
/// after "The quick brown fox".
pub(crate) fn q4_k_m_logits_match_llama_cpp(model: &LoadedModel) {
    let mut session = Session::new(model, 2);
    let prompt = [504, 2365, 6354, 16438]; // "The quick brown fox"
    let ours = session.logits_for(&prompt).expect("forward pass");
    let file = format!(
        "{}/tests/data/quick_brown_fox_last_logits_q4_k_m_mix.f32le",
        env!("CARGO_MANIFEST_DIR")
    );
    let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
    let reference: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(ours.len(), reference.len());
    let diffs: Vec<f32> = ours
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .collect();
    let max = diffs.iter().copied().fold(0.0, f32::max);
    let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
    eprintln!("Q4_K_M logits vs llama.cpp: max |diff| {max:.4}, mean {mean:.5}");
    // The bounds of the Q4_1 test (golden.rs): rounding noise, not errors.
    assert!(max < 1.5 && mean < 0.35, "max {max}, mean {mean}");
    let top = |l: &[f32]| (0..l.len()).fold(0, |best, i| if l[i] > l[best] { i } else { best });
    assert_eq!(top(ours), top(&reference), "top-1 token");
}
