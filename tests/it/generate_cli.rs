//! `tessera generate` and `tessera bench` as a user runs them: real model,
//! real process, JSON out; bad input gives a clear error and exit code 1.

use crate::support::{model, tessera};

fn failure(args: &[&str]) -> String {
    let out = tessera(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected a clean failure, got: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn generate_json_reproduces_llama_cpp_and_reports_stats() {
    let model = model();
    let out = tessera(&[
        "generate",
        "--model",
        &model,
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--json",
        "--threads",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // llama.cpp's greedy ids for this prompt (shared golden set).
    let want = [60, 23, 39614, 1141, 552, 28, 2618, 2828];
    let got: Vec<u64> = json["generated_token_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect();
    assert_eq!(got, want);
    assert_eq!(json["prompt_token_ids"].as_array().expect("ids").len(), 37);
    assert!(json["text"].as_str().expect("text").starts_with("L'"));
    for key in [
        "prefill_tokens_per_second",
        "decode_tokens_per_second",
        "time_to_first_token_seconds",
        "peak_rss_bytes",
    ] {
        assert!(
            json["stats"][key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {}",
            json["stats"]
        );
    }
}

#[test]
fn stop_strings_cut_the_text_and_are_not_emitted() {
    let model = model();
    let out = tessera(&[
        "generate",
        "--model",
        &model,
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "20",
        "--json",
        "--stop",
        "Marseillaise",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["finish_reason"], "stop_string");
    let text = json["text"].as_str().expect("text");
    assert!(
        text.starts_with("L'") && !text.contains("Marseill"),
        "{text}"
    );
}

#[test]
fn bench_prints_json_with_spreads() {
    let model = model();
    let out = tessera(&[
        "bench",
        "--model",
        &model,
        "--runs",
        "1",
        "--n-gen",
        "8",
        "--n-prefill",
        "32",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    for key in [
        "decode_tokens_per_second",
        "prefill_tokens_per_second",
        "time_to_first_token_ms",
    ] {
        let spread = &json[key];
        assert!(
            spread["median"].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {spread}"
        );
        assert!(spread["min"].as_f64() <= spread["max"].as_f64());
    }
    assert!(json["peak_rss_mb"].as_f64().is_some_and(|v| v > 50.0));
    assert_eq!(json["decode_tokens"].as_array().expect("tokens").len(), 8);
}

#[test]
fn bad_input_gives_clear_errors() {
    let model = model();
    let m = model.as_str();
    assert!(failure(&["generate", "--model", m, "--prompt", ""]).contains("prompt is empty"));
    assert!(failure(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "hi",
        "--max-tokens",
        "0"
    ])
    .contains("max_tokens must be at least 1"));
    assert!(failure(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "hi",
        "--temperature",
        "-1"
    ])
    .contains("temperature"));
    assert!(
        failure(&["generate", "--model", m, "--prompt", "hi", "--top-p", "0"]).contains("top_p")
    );
    let missing = failure(&[
        "generate",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
    ]);
    assert!(
        missing.contains("/nonexistent/model.gguf") && missing.contains("does not exist"),
        "{missing}"
    );
    assert!(
        failure(&["generate", "--model", "no-such-model", "--prompt", "hi"]).contains("not found")
    );
    let long = "word ".repeat(9000);
    let too_long = failure(&["generate", "--model", m, "--prompt", &long]);
    assert!(too_long.contains("context length of 8192"), "{too_long}");
    // A file that is not a model.
    let dir = tempfile::tempdir().expect("temp dir");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not gguf").expect("write");
    let junk = junk.display().to_string();
    assert!(failure(&["generate", "--model", &junk, "--prompt", "hi"]).contains("junk.gguf"));
    // A truncated model: the error names the file and the tensor.
    let truncated = dir.path().join("truncated.gguf");
    let bytes = std::fs::read(&model).expect("model");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("write");
    let message = failure(&[
        "generate",
        "--model",
        &truncated.display().to_string(),
        "--prompt",
        "hi",
    ]);
    assert!(
        message.contains("truncated.gguf")
            && message.contains("truncated")
            && message.contains("blk."),
        "{message}"
    );
}

#[test]
fn logprobs_come_with_their_alternatives() {
    let model = model();
    let out = tessera(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "1, 2, 3, 4, 5,",
        "--max-tokens",
        "3",
        "--json",
        "--logprobs",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let logprobs = json["logprobs"].as_array().expect("logprobs");
    assert_eq!(logprobs.len(), 3);
    for entry in logprobs {
        let logprob = entry["logprob"].as_f64().expect("logprob");
        let top = entry["top"].as_array().expect("top");
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0][0], entry["token"]);
        assert!((top[0][1].as_f64().expect("lp") - logprob).abs() < 1e-4);
        assert!(logprob <= 0.0 && top[1][1].as_f64() <= top[0][1].as_f64());
    }
    assert!(failure(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "hi",
        "--logprobs",
        "21"
    ])
    .contains("top_logprobs"));
}

/// A folder of an architecture the engine lacks fails at once, naming the
/// architecture and the folder once (not "loading model DIR: DIR: ...").
#[test]
fn an_unsupported_architecture_is_named_with_its_folder_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = serde_json::json!({
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "rms_norm_eps": 1e-6, "vocab_size": 100,
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("config");
    // One tiny tensor, so the folder is a readable safetensors checkpoint.
    let header = br#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0; 4]);
    std::fs::write(dir.path().join("model.safetensors"), file).expect("weights");
    let folder = dir.path().display().to_string();
    let out = tessera(&["generate", "--model", &folder, "--prompt", "hi"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unsupported architecture `gpt_oss`"),
        "{stderr}"
    );
    assert_eq!(stderr.matches(&folder).count(), 1, "{stderr}");
}
