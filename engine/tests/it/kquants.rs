//! GGUF types without a native kernel (here Q4_K, the usual type of
//! `ffn_down` in Q4_K_M files) run through candle's quantized matmul: the
//! default model with its ffn_down requantized to Q4_K still counts.

use std::ops::ControlFlow;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;
use tessera_engine::generate::{GenerateRequest, LoadedModel, Prompt, Session};

#[test]
fn a_model_with_k_quant_tensors_generates() {
    let source = tessera_engine::testing::default_model_path();
    let mut file = std::fs::File::open(&source).expect("model");
    let content = gguf_file::Content::read(&mut file).expect("gguf");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, info) in &content.tensor_infos {
        let tensor = info
            .read(&mut file, content.tensor_data_offset, &Device::Cpu)
            .expect("tensor");
        let tensor = if name.contains("ffn_down") {
            let dense = tensor.dequantize(&Device::Cpu).expect("dequantize");
            QTensor::quantize(&dense, GgmlDType::Q4K).expect("Q4_K")
        } else {
            tensor
        };
        tensors.push((name.clone(), tensor));
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mixed-q4k.gguf");
    let mut out = std::fs::File::create(&path).expect("create");
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &metadata, &tensor_refs).expect("write gguf");
    drop(out);

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
