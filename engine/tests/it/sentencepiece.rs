//! A SentencePiece vocabulary that puts a space first (Llama 2, Mistral
//! v0.1) read from GGUF, against llama.cpp's own tokenizer: the ids its
//! `llama-server` `/tokenize` gave for the same texts, with special tokens
//! parsed and not (`tests/data/sentencepiece-llama/`, made by
//! `scripts/make-reference-models --sentencepiece`). The Gemma reference
//! cases cover the kind without the space, against transformers.

use std::path::Path;

use serde_json::Value;
use tessera_engine::text::tokenizer::Tokenizer;

#[test]
fn a_sentencepiece_gguf_vocabulary_tokenizes_as_llama_cpp_does() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sentencepiece-llama");
    let mut file = std::fs::File::open(dir.join("model.gguf")).expect("fixture GGUF");
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).expect("GGUF");
    let tokenizer = Tokenizer::from_gguf(&content.metadata).expect("SentencePiece tokenizer");
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("llama_cpp_tokens.json")).expect("reference ids"),
    )
    .expect("JSON");
    let cases = cases.as_array().expect("a list");
    assert!(cases.len() >= 10, "{} cases", cases.len());
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let special = case["parse_special"].as_bool().expect("flag");
        let want: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("an id") as u32)
            .collect();
        let got = tokenizer.tokenize(text, true, special).expect("tokenized");
        assert_eq!(got, want, "{text:?} (special tokens parsed: {special})");
        // And back: the text (after BOS and the space put first).
        if !special {
            let decoded = tokenizer.decode(&got[1..], true).expect("decoded");
            assert_eq!(
                decoded.trim_start_matches(' '),
                text.trim_start_matches(' ')
            );
        }
    }
}
