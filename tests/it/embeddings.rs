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
