//! Embeddings on a real node: the default embedding model, placed on the
//! first request like any model, answers the official OpenAI client and
//! Ollama's endpoints with sentence-transformers' vectors (cosine ≥ 0.999
//! for every text of a varied set), token ids give their text's vector,
//! eight requests at once give the bits each gives alone, and what the
//! model cannot do is a 400 naming it.

use serde_json::Value;

use crate::api::{client_script, http, Node};

const EMBEDDER: &str = "all-minilm-l6-v2";

#[test]
fn embeddings_through_the_clients_are_sentence_transformers_vectors() {
    let root = tempfile::tempdir().expect("temp dir");
    let dir = root.path().join("n");
    let models = dir.join("models");
    std::fs::create_dir_all(&models).expect("models dir");
    std::os::unix::fs::symlink(
        tessera_testkit::default_embedding_model_path(),
        models.join(EMBEDDER),
    )
    .expect("link the embedding model");
    let node = Node::start(&dir, &[]);
    let reference = format!(
        "{}/engine/tests/data/embedding-reference/all-minilm-l6-v2.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let got = client_script(
        "embeddings_client.py",
        &node,
        &[&node.api, EMBEDDER, &reference],
    );
    let cosines = got["cosines"].as_object().expect("cosines");
    // Every text of the reference, through each way in.
    assert!(cosines.len() >= 2 * 9, "{got}");
    assert_eq!(got["long_cut_equals_its_first_tokens"], true, "{got}");
    let all_true = |key: &str| {
        let flags = got[key].as_array().expect("flags");
        !flags.is_empty() && flags.iter().all(|f| f == true)
    };
    for key in ["base64_equals_float", "ids_equal_texts", "concurrent_equal"] {
        assert!(all_true(key), "{key}: {got}");
    }
    assert_eq!(got["one_id_list"], true);
    assert_eq!(got["usage"]["prompt_tokens"], got["token_total"], "{got}");
    assert_eq!(got["ollama_status"], 200);
    let errors = &got["errors"];
    for refused in [
        "openai_long",
        "ollama_no_truncate",
        "dimensions",
        "empty_list",
        "bad_id",
        "chat_on_embedder",
        "unknown_field",
    ] {
        assert_eq!(errors[refused]["status"], 400, "{refused}: {errors}");
    }
    assert_eq!(errors["whole_dimensions"]["status"], 200, "{errors}");
    let message = errors["chat_on_embedder"]["body"]["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("embedding model"), "{message}");
    // Ollama shows what it is.
    let (status, body) = http(
        &node.api,
        "POST",
        "/api/show",
        format!(r#"{{"model":"{EMBEDDER}"}}"#).as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let shown: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(shown["capabilities"], serde_json::json!(["embedding"]));
}

/// The tiny decoder embedder's fixture (a sentence-transformers folder
/// with the GGUF llama.cpp's converter made of it).
fn tiny_decoder_embedder() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("engine/tests/data/embedding-reference/qwen3-last")
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Copies `from`'s files (and `1_Pooling/`, `2_Normalize/`) into `to`, less
/// the GGUF and the reference.
fn copy_folder(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).expect("fixture") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name").to_owned();
        if path.is_dir() {
            copy_folder(&path, &to.join(&name));
        } else if !matches!(name.to_str(), Some("model.gguf" | "reference.json")) {
            std::fs::create_dir_all(to).expect("folder");
            std::fs::copy(&path, to.join(&name)).expect("copied");
        }
    }
}

/// A decoder embedder added from a hub as a sentence-transformers
/// repository and as a GGUF repository: both cards are embedding models,
/// each is downloaded and placed on the first request, and each answers
/// `/v1/embeddings` with sentence-transformers' vectors.
#[test]
fn a_decoder_embedder_from_the_hub_as_safetensors_and_gguf_answers() {
    use crate::cluster::{models, LocalHub, Node as ClusterNode};

    let tmp = tempfile::tempdir().expect("tempdir");
    let fixture = tiny_decoder_embedder();
    let hub_root = tmp.path().join("hub");
    copy_folder(&fixture, &hub_root.join("acme/tiny-embed"));
    let gguf_repo = hub_root.join("acme/tiny-embed-GGUF");
    std::fs::create_dir_all(&gguf_repo).expect("repo");
    std::fs::copy(
        fixture.join("model.gguf"),
        gguf_repo.join("tiny-embed-F32.gguf"),
    )
    .expect("gguf");
    let hub = LocalHub::start(&hub_root);
    let env = [("HF_ENDPOINT", hub.endpoint.as_str())];
    let port = crate::support::free_port();
    let node = ClusterNode::start_env("embed-hub", &tmp.path().join("n"), port, &[], &[], &env);
    crate::cluster::wait_until(std::time::Duration::from_secs(20), || {
        crate::cluster::master_seen("embed-hub", port, None).filter(|(_, n)| *n == 1)
    })
    .expect("a master");
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture.join("reference.json")).expect("reference"),
    )
    .expect("JSON");
    let texts = reference["texts"].as_array().expect("texts");
    let expected: Vec<Vec<f64>> =
        serde_json::from_value(reference["embeddings"].clone()).expect("vectors");
    for (repo, model_id) in [
        ("acme/tiny-embed", "acme/tiny-embed"),
        ("acme/tiny-embed-GGUF", "acme/tiny-embed-GGUF:F32"),
    ] {
        let out = models("embed-hub", port, &["--json", "add", repo]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let added: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(added["card"]["modelId"], model_id, "{added}");
        assert_eq!(added["card"]["tasks"][0], "MODEL_TASK_EMBEDDING", "{added}");
        // Text 3 is past the reference's 64 tokens, which a GGUF does not
        // know (it takes the model's context, as llama.cpp does).
        let inputs: Vec<&Value> = texts.iter().take(3).collect();
        let body = serde_json::json!({"model": model_id, "input": inputs}).to_string();
        let (status, answer) = crate::cluster::http(&node.api, "POST", "/v1/embeddings", &body);
        assert_eq!(status, 200, "{model_id}: {answer}\n{}", node.log());
        let answer: Value = serde_json::from_str(&answer).expect("JSON");
        for (i, item) in answer["data"].as_array().expect("data").iter().enumerate() {
            let got: Vec<f64> = serde_json::from_value(item["embedding"].clone()).expect("floats");
            let similarity = cosine(&got, &expected[i]);
            assert!(
                similarity >= 0.999,
                "{model_id} text {i}: cosine {similarity}"
            );
        }
    }
}
