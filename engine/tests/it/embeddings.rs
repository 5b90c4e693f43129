//! Embeddings against sentence-transformers: tiny random BERT checkpoints
//! (mean pooling with normalisation, CLS pooling without), a tiny
//! nomic-bert (rotary, SwiGLU, nomic's own code as the reference), a tiny decoder
//! embedder as Qwen3-Embedding is one (last-token pooling; its
//! safetensors folder and the GGUF llama.cpp's converter made of it) and the real
//! all-MiniLM-L6-v2 (the offline default, as `scripts/fetch-model`
//! installs it), on texts that are empty, long (cut at the model's
//! length), non-Latin, emoji: the same token ids, and a cosine of at least
//! 0.999 for every text. A batch gives each input what it gets alone.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_engine::embed::{EmbedInput, Embedder};
use tessera_engine::threadpool::ThreadPool;

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/embedding-reference")
}

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * y).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y.powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Checks `model` against `reference` (texts, token ids, embeddings).
fn check(model: &Path, reference: &Path) {
    check_texts(model, reference, &[]);
}

/// [`check`], leaving out the texts numbered in `skip`.
fn check_texts(model: &Path, reference: &Path, skip: &[usize]) {
    let embedder = Embedder::load(model).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    let text = std::fs::read_to_string(reference).expect("the reference");
    let expected: Value = serde_json::from_str(&text).expect("JSON");
    let texts: Vec<String> = serde_json::from_value(expected["texts"].clone()).expect("texts");
    let ids: Vec<Vec<u32>> = serde_json::from_value(expected["token_ids"].clone()).expect("ids");
    let vectors: Vec<Vec<f64>> =
        serde_json::from_value(expected["embeddings"].clone()).expect("embeddings");
    let kept = |i: &usize| !skip.contains(i);
    let (texts, ids, vectors): (Vec<String>, Vec<Vec<u32>>, Vec<Vec<f64>>) = (
        texts
            .into_iter()
            .enumerate()
            .filter(|(i, _)| kept(i))
            .map(|(_, t)| t)
            .collect(),
        ids.into_iter()
            .enumerate()
            .filter(|(i, _)| kept(i))
            .map(|(_, t)| t)
            .collect(),
        vectors
            .into_iter()
            .enumerate()
            .filter(|(i, _)| kept(i))
            .map(|(_, t)| t)
            .collect(),
    );
    let inputs: Vec<EmbedInput> = texts.iter().cloned().map(EmbedInput::Text).collect();
    for (i, input) in inputs.iter().enumerate() {
        assert_eq!(
            embedder.tokenize(i, input).expect("tokenizes"),
            ids[i],
            "text {i}: {:?}",
            texts[i]
        );
    }
    let pool = ThreadPool::new(2);
    let batch = embedder.embed(&inputs, &pool).expect("embeds");
    let lowest = batch
        .iter()
        .zip(&vectors)
        .map(|(got, want)| cosine(&got.vector, want))
        .fold(f64::INFINITY, f64::min);
    eprintln!("{}: lowest cosine {lowest:.7}", model.display());
    for (i, (got, want)) in batch.iter().zip(&vectors).enumerate() {
        assert_eq!(got.vector.len(), want.len());
        let similarity = cosine(&got.vector, want);
        assert!(
            similarity >= 0.999,
            "text {i} {:?}: cosine {similarity}",
            texts[i]
        );
        assert_eq!(got.tokens, ids[i].len());
        // Alone, the same bits.
        let alone = embedder
            .embed(std::slice::from_ref(&inputs[i]), &pool)
            .expect("embeds");
        assert_eq!(alone[0], *got, "text {i} alone and in a batch");
    }
    // Token ids in give what the text gives.
    let by_ids = embedder
        .embed(&[EmbedInput::Tokens(ids[1].clone())], &pool)
        .expect("embeds");
    assert_eq!(by_ids[0], batch[1]);
}

#[test]
fn tiny_bert_checkpoints_match_sentence_transformers() {
    for case in ["bert-mean", "bert-cls", "nomic-bert"] {
        let dir = reference_dir().join(case);
        check(&dir, &dir.join("reference.json"));
    }
}

#[test]
fn a_decoder_embedder_matches_sentence_transformers_from_safetensors_and_gguf() {
    let dir = reference_dir().join("qwen3-last");
    let reference = dir.join("reference.json");
    check(&dir, &reference);
    // A GGUF does not carry sentence-transformers' max_seq_length (64
    // here): it takes the model's context, as llama.cpp does, so text 3,
    // which the reference cut at 64 tokens, is left out.
    check_texts(&dir.join("model.gguf"), &reference, &[3]);
}

#[test]
fn all_minilm_l6_v2_matches_sentence_transformers() {
    let model = tessera_testkit::default_embedding_model_path();
    check(&model, &reference_dir().join("all-minilm-l6-v2.json"));
}

#[test]
fn bad_token_inputs_are_the_callers_error() {
    let embedder = Embedder::load(&reference_dir().join("bert-mean")).expect("loads");
    for tokens in [vec![], vec![1, 100_000], vec![1; 1000]] {
        let error = embedder
            .tokenize(0, &EmbedInput::Tokens(tokens))
            .expect_err("refused");
        assert!(error.is_invalid_input(), "{error}");
    }
}

#[test]
fn only_models_trained_for_shorter_vectors_cut_them() {
    let nomic = Embedder::load(&reference_dir().join("nomic-bert")).expect("loads");
    let decoder = Embedder::load(&reference_dir().join("qwen3-last")).expect("loads");
    let bert = Embedder::load(&reference_dir().join("bert-mean")).expect("loads");
    for cuts in [&nomic, &decoder] {
        assert!(cuts.check_dimensions(16).is_ok());
        assert!(cuts.check_dimensions(cuts.dimensions() + 1).is_err());
    }
    assert!(bert.check_dimensions(16).is_err());
    assert!(bert.check_dimensions(bert.dimensions()).is_ok());
    assert!(bert.check_dimensions(0).is_ok());
}
