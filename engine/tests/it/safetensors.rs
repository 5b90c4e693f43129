//! The Hugging Face path with real weights: the default model's GGUF,
//! dequantized into a safetensors folder (HF layout, q/k rows un-permuted,
//! sharded with an index), loads through the safetensors loader and
//! generates the same first greedy tokens as the GGUF.

use std::ops::ControlFlow;

use serde_json::{json, Value};
use tessera_engine::serve::{GenerateRequest, LoadedModel, Prompt, Session};
use tessera_engine::text::chat_template::ChatMessage;
use tessera_testkit::hf_export::{export_llama_gguf, ExportDType};

/// Steps compared: up to the first where llama.cpp's top-1/top-2 margin is
/// below this. The folder holds the same weights in f32 and the GGUF path
/// rounds activations to 8 bits; that moves logits by up to ~1.4.
const CLEAR_MARGIN: f64 = 1.5;

fn greedy(session: &mut Session<'_>, prompt: Prompt, n: usize) -> Vec<u32> {
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = n;
    request.ignore_eos = true;
    session
        .generate(&request, |_| ControlFlow::Continue(()))
        .expect("generation")
        .tokens
}

fn read_json(file: &str) -> Value {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
        .expect("json")
}

#[test]
fn safetensors_folder_generates_what_the_gguf_generates() {
    let gguf = tessera_testkit::default_model_path();
    let dir = tempfile::tempdir().expect("temp dir");
    export_llama_gguf(&gguf, dir.path(), ExportDType::F32, 3).expect("export");
    // Tokenizer files, as a Hugging Face repo has them.
    let quantized = LoadedModel::load(&gguf, |_, _| {}).expect("gguf loads");
    let tokenizer_json = quantized
        .tokenizer
        .to_tokenizer_json()
        .expect("tokenizer.json");
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer_json).expect("write");
    let config = json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": quantized.tokenizer.chat_template().expect("template"),
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
    assert!(dir.path().join("model.safetensors.index.json").is_file());

    let dense = LoadedModel::load(dir.path(), |_, _| {}).expect("safetensors folder loads");
    assert_eq!(dense.transformer.config.layers, 30);
    assert_eq!(
        dense
            .tokenize(&Prompt::Raw("Ünïcödé 12345".into()))
            .expect("tokenize"),
        quantized
            .tokenize(&Prompt::Raw("Ünïcödé 12345".into()))
            .expect("tokenize")
    );
    assert!(dense.transformer.config.tied_embeddings);

    let mut cases: Vec<(String, Prompt, Vec<f64>)> = Vec::new();
    let margins_of = |steps: &Value| -> Vec<f64> {
        steps
            .as_array()
            .expect("steps")
            .iter()
            .map(|s| s.as_f64().or_else(|| s["margin"].as_f64()).expect("margin"))
            .collect()
    };
    let golden = read_json("llamacpp-smollm2-135m-q4_1.json");
    for case in golden["chats"].as_array().expect("chats") {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        let prompt = Prompt::Chat {
            messages,
            tools: None,
        };
        cases.push((
            case["user_message"].to_string(),
            prompt,
            margins_of(&case["per_step_forced_48"]),
        ));
    }
    let raw = &golden["raw_prompt"];
    let text = raw["prompt"].as_str().expect("text").to_string();
    cases.push((
        text.clone(),
        Prompt::Raw(text),
        margins_of(&raw["per_step_greedy_48"]),
    ));
    for case in read_json("llamacpp-extra-cases.json")["cases"]
        .as_array()
        .expect("cases")
    {
        let prompt = match case["case"]["raw"].as_str() {
            Some(text) => Prompt::Raw(text.to_string()),
            None => Prompt::Chat {
                messages: serde_json::from_value(case["case"]["messages"].clone())
                    .expect("messages"),
                tools: None,
            },
        };
        cases.push((
            case["case"].to_string(),
            prompt,
            margins_of(&case["forced_margins"]),
        ));
    }

    let mut q_session = Session::new(&quantized, 2);
    let mut d_session = Session::new(&dense, 2);
    let mut compared = 0;
    for (name, prompt, margins) in cases {
        let steps = margins
            .iter()
            .take_while(|m| **m >= CLEAR_MARGIN)
            .count()
            .min(16);
        if steps == 0 {
            continue;
        }
        let from_gguf = greedy(&mut q_session, prompt.clone(), steps);
        let from_folder = greedy(&mut d_session, prompt, steps);
        eprintln!("{name}: {steps} steps: gguf {from_gguf:?}, safetensors {from_folder:?}");
        assert_eq!(from_gguf, from_folder, "{name}");
        compared += steps;
    }
    assert!(compared >= 20, "only {compared} steps had a clear margin");
}

/// A chat template that writes `{{ bos_token }}` for a model that adds BOS
/// gives one BOS, as transformers' `apply_chat_template` and llama.cpp do
/// (the rendered text's own BOS was once doubled by the tokenizer's).
#[test]
fn a_template_that_writes_bos_gets_one_bos() {
    use tessera_engine::text::chat_template::ChatTemplate;
    use tessera_engine::text::tokenizer::Tokenizer;
    let gguf = tessera_testkit::default_model_path();
    let model = LoadedModel::load(&gguf, |_, _| {}).expect("gguf loads");
    let dir = tempfile::tempdir().expect("temp dir");
    let json = model.tokenizer.to_tokenizer_json().expect("tokenizer.json");
    std::fs::write(dir.path().join("tokenizer.json"), json).expect("write");
    let template = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n\
                    {{ m.content }}<|im_end|>\n{% endfor %}\
                    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let config = json!({
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": true,
        "chat_template": template,
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
    let tokenizer = Tokenizer::from_hf_dir(dir.path()).expect("tokenizer");
    let bos = tokenizer.token_id("<|endoftext|>").expect("bos");
    assert!(tokenizer.add_bos());
    let rendered = ChatTemplate::new(template, "<|endoftext|>", "<|im_end|>")
        .expect("template")
        .render(&[ChatMessage::new("user", "Hi")], None, true, None)
        .expect("render");
    // The text encoding chat prompts once went through adds a second one.
    let doubled = tokenizer.encode(&rendered, true).expect("encode");
    assert_eq!(doubled.iter().take_while(|&&id| id == bos).count(), 2);
    let ids = tokenizer.encode_chat(&rendered).expect("encode");
    assert_eq!(
        ids.iter().take_while(|&&id| id == bos).count(),
        1,
        "{ids:?}"
    );
    // Raw text still gets the model's BOS.
    let raw = tokenizer.encode("Hi", false).expect("encode");
    assert_eq!(raw.first(), Some(&bos));
    // A template without BOS gets it once from the model's add_bos.
    let plain = tokenizer
        .encode_chat("<|im_start|>user\nHi")
        .expect("encode");
    assert_eq!(plain.iter().take_while(|&&id| id == bos).count(), 1);
}
