//! Structured outputs and logit bias on a real node: twenty JSON schemas
//! answered by the default model through the official OpenAI client, each
//! checked by `jsonschema` (also eight at once in one batch, and through
//! `beta.chat.completions.parse` with a Pydantic model); forced tool calls
//! through the OpenAI and Anthropic clients; a -100 bias makes
//! a token impossible; a constrained generation on tensor and pipeline
//! world 2 is one machine's; an unset temperature is the dialect's; the
//! legacy Completions endpoint answers the official client.

use serde_json::Value;

use crate::api::{client_script, http, Node, MODEL};
use crate::support::{model, tessera};

#[test]
fn twenty_schemas_are_answered_with_json_that_validates() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let api = format!("http://{}/v1", node.api);
    // The script exits non-zero on the first answer that does not validate.
    let got = client_script("structured_outputs.py", &node, &[&api, MODEL]);
    let one = got["one_at_a_time"].as_array().expect("answers");
    assert_eq!(one.len(), 20);
    let batch = got["eight_at_once"].as_array().expect("answers");
    assert_eq!(batch.len(), 8);
    for answer in one.iter().chain(batch) {
        // Ended because the JSON was complete, not cut by max_tokens.
        assert_eq!(answer["finish_reason"], "stop", "{answer}");
    }
    assert_eq!(got["parsed_type"], "MathAnswer", "{got}");
    let steps = got["parsed"]["steps"].as_array().expect("steps");
    assert!((1..=3).contains(&steps.len()), "{got}");
    assert_eq!(
        got["forced_calls"],
        serde_json::json!(["get_weather"]),
        "{got}"
    );
    assert_eq!(got["forced_finish_reason"], "tool_calls");
    assert_eq!(
        got["anthropic_calls"],
        serde_json::json!(["get_weather"]),
        "{got}"
    );
    assert_eq!(got["anthropic_stop_reason"], "tool_use");
    let errors = &got["errors"];
    for refused in ["bogus_tool_choice", "unknown_function"] {
        assert_eq!(errors[refused]["status"], 400, "{errors}");
        assert_eq!(errors[refused]["param"], "tool_choice", "{errors}");
    }
    assert_eq!(errors["unknown_type"]["status"], 400, "{errors}");
    assert_eq!(errors["unknown_type"]["param"], "response_format.type");
    assert_eq!(errors["bad_schema"]["status"], 400, "{errors}");
    assert_eq!(errors["bad_schema"]["param"], "response_format");
}

/// The ids `tessera generate` picks greedily for `chat`.
fn greedy_ids(chat: &str, tokens: &str) -> Vec<u64> {
    let out = tessera(&[
        "generate",
        "--model",
        &model(),
        "--chat",
        chat,
        "--max-tokens",
        tokens,
        "--json",
    ]);
    assert!(out.status.success());
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    json["generated_token_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|id| id.as_u64().expect("an id"))
        .collect()
}

fn chat(node: &Node, body: Value) -> (u16, Value) {
    let (status, text) = http(
        &node.api,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

#[test]
fn a_bias_of_minus_100_makes_a_token_impossible() {
    let prompt = "Say hello.";
    let greedy = greedy_ids(prompt, "8");
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let request = |bias: Value| {
        serde_json::json!({
            "model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8, "temperature": 0, "logit_bias": bias,
            "logprobs": true, "top_logprobs": 5,
        })
    };
    let (status, plain) = chat(&node, request(serde_json::json!({})));
    assert_eq!(status, 200, "{plain}");
    let first = &plain["choices"][0]["logprobs"]["content"][0]["token"];
    // Every token of the greedy answer banned: none of them comes, not even
    // among the alternatives the logprobs list.
    let banned: serde_json::Map<String, Value> = greedy
        .iter()
        .map(|id| (id.to_string(), Value::from(-100)))
        .collect();
    let (status, biased) = chat(&node, request(Value::Object(banned)));
    assert_eq!(status, 200, "{biased}");
    let steps = biased["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs");
    assert!(!steps.is_empty());
    assert_ne!(&steps[0]["token"], first, "{biased}");
    for alternative in steps[0]["top_logprobs"].as_array().expect("top") {
        assert_ne!(&alternative["token"], first, "{biased}");
    }
    // Out of range, not a token id, or beyond the vocabulary: 400s.
    for bias in [
        serde_json::json!({"5": -101}),
        serde_json::json!({"hello": 1}),
        serde_json::json!({"4000000": 1}),
    ] {
        let (status, error) = chat(&node, request(bias.clone()));
        assert_eq!(status, 400, "{bias}: {error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .expect("message")
                .contains("logit_bias"),
            "{error}"
        );
    }
}

#[test]
fn a_constrained_generation_on_tensor_and_pipeline_world_2_is_one_machines() {
    let schema = r#"{"type": "object", "additionalProperties": false,
        "required": ["city", "tags", "rating"],
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "tags": {"type": "array", "items": {"enum": ["old", "big", "green"]}, "minItems": 2, "maxItems": 3},
                       "rating": {"type": "integer", "minimum": 1, "maximum": 5}}}"#;
    let run = |extra: &[&str]| {
        let model = model();
        let mut args = vec![
            "generate",
            "--model",
            &model,
            "--chat",
            "Describe a city.",
            "--max-tokens",
            "80",
            "--json-schema",
            schema,
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = tessera(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        json["text"].as_str().expect("text").to_string()
    };
    let one = run(&[]);
    let value: Value = serde_json::from_str(&one).unwrap_or_else(|e| panic!("{e}: {one}"));
    let tags = value["tags"].as_array().expect("tags");
    assert!((2..=3).contains(&tags.len()), "{one}");
    assert!(
        (1..=5).contains(&value["rating"].as_i64().expect("rating")),
        "{one}"
    );
    for sharding in ["tensor", "pipeline"] {
        assert_eq!(
            run(&["--world", "2", "--sharding", sharding]),
            one,
            "{sharding}"
        );
    }
}

/// A request that sets no temperature samples at its dialect's documented
/// default (OpenAI 1.0, Ollama 0.8; the default model's files recommend
/// none): seeded, it is the same as asking for that temperature, and not
/// greedy.
#[test]
fn an_unset_temperature_is_the_dialects_default() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let prompt = "Write a sentence about the sea.";
    let openai = |temperature: Option<f64>| {
        let mut body = serde_json::json!({
            "model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "seed": 11,
        });
        if let Some(t) = temperature {
            body["temperature"] = t.into();
        }
        let (status, answer) = chat(&node, body);
        assert_eq!(status, 200, "{answer}");
        answer["choices"][0]["message"]["content"]
            .as_str()
            .expect("text")
            .to_string()
    };
    let unset = openai(None);
    assert_eq!(unset, openai(Some(1.0)));
    assert_ne!(unset, openai(Some(0.0)));
    let ollama = |temperature: Option<f64>| {
        let mut options = serde_json::json!({"num_predict": 24, "seed": 11});
        if let Some(t) = temperature {
            options["temperature"] = t.into();
        }
        let body = serde_json::json!({
            "model": MODEL, "stream": false, "options": options,
            "messages": [{"role": "user", "content": prompt}],
        });
        let (status, text) = http(&node.api, "POST", "/api/chat", body.to_string().as_bytes());
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).expect("JSON");
        answer["message"]["content"]
            .as_str()
            .expect("text")
            .to_string()
    };
    let unset = ollama(None);
    assert_eq!(unset, ollama(Some(0.8)));
    assert_ne!(unset, ollama(Some(0.0)));
}

/// `/v1/completions` through the legacy `client.completions.create`: a raw
/// prompt continued as `tessera generate --prompt` continues it, streamed
/// the same, several prompts, token ids, echo, legacy logprobs.
#[test]
fn the_legacy_completions_endpoint_with_the_official_client() {
    let prompt = "The quick brown fox";
    let out = tessera(&[
        "generate",
        "--model",
        &model(),
        "--prompt",
        prompt,
        "--max-tokens",
        "8",
        "--json",
    ]);
    assert!(out.status.success());
    let expected: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let api = format!("http://{}/v1", node.api);
    let got = client_script("completions_client.py", &node, &[&api, MODEL, prompt]);
    assert_eq!(got["object"], "text_completion");
    assert_eq!(got["text"], expected["text"], "{got}");
    assert_eq!(got["stream_text"], expected["text"]);
    assert_eq!(got["finish_reason"], "length");
    assert_eq!(got["logprob_tokens"], 8);
    assert!(
        got["top_per_token"]
            .as_array()
            .expect("tops")
            .iter()
            .all(|n| n == 2),
        "{got}"
    );
    assert_eq!(got["usage"]["completion_tokens"], 8);
    let many = got["many"].as_array().expect("choices");
    assert_eq!(many.len(), 2);
    assert_eq!(many[1][0], 1);
    let echo = got["echo"].as_str().expect("echo");
    assert!(
        echo.starts_with(prompt) && echo.len() > prompt.len(),
        "{echo}"
    );
    assert_eq!(got["ids_usage"], 3);
    for refused in ["n", "suffix", "best_of"] {
        assert_eq!(got["errors"][refused], 400, "{got}");
    }
}

/// The endpoints clients call besides generation: one model by any name
/// people type, Ollama's `/api/show` and `/api/ps`, Anthropic's token
/// count (which equals the prompt tokens a generation reports).
#[test]
fn the_endpoints_clients_call_answer() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let get = |path: &str| {
        let (status, text) = http(&node.api, "GET", path, b"");
        (
            status,
            serde_json::from_str::<Value>(&text).unwrap_or(Value::Null),
        )
    };
    let post = |path: &str, body: Value| {
        let (status, text) = http(&node.api, "POST", path, body.to_string().as_bytes());
        (
            status,
            serde_json::from_str::<Value>(&text).unwrap_or(Value::Null),
        )
    };
    let (status, one) = get(&format!("/v1/models/{MODEL}:latest"));
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["id"], MODEL);
    assert_eq!(get("/v1/models/no-such-model").0, 404);
    let (status, shown) = post(
        "/api/show",
        serde_json::json!({"model": format!("{MODEL}:latest")}),
    );
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown["model_info"]["llama.context_length"], 8192, "{shown}");
    assert_eq!(
        shown["capabilities"],
        serde_json::json!(["completion", "tools"])
    );
    assert_eq!(
        post("/api/show", serde_json::json!({"model": "nope"})).0,
        404
    );
    // A generation by a tagged name places the model; /api/ps lists it.
    let messages = serde_json::json!([{"role": "user", "content": "Count the tokens of this."}]);
    let (status, answer) = post(
        "/v1/messages",
        serde_json::json!({"model": "smollm2-135m-instruct:Q4_1", "max_tokens": 1, "messages": messages}),
    );
    assert_eq!(status, 200, "{answer}");
    let (status, running) = get("/api/ps");
    assert_eq!(status, 200);
    assert_eq!(running["models"][0]["name"], MODEL, "{running}");
    let (status, counted) = post(
        "/v1/messages/count_tokens",
        serde_json::json!({"model": MODEL, "messages": messages}),
    );
    assert_eq!(status, 200, "{counted}");
    assert_eq!(
        counted["input_tokens"], answer["usage"]["input_tokens"],
        "{counted} {answer}"
    );
    // Its files are on this node now: /api/show gives their template.
    let (_, shown) = post("/api/show", serde_json::json!({"model": MODEL}));
    let template = shown["template"].as_str().unwrap_or_default();
    assert!(template.contains("<|im_start|>"), "{shown}");
}

/// `n` answers of one request through the official client: choices
/// numbered 0..n, the first the answer of the same request with n = 1
/// (each answer's seed is the request's plus its number), streamed the
/// same as whole, the prompt counted once in the usage; Completions' n per
/// prompt, prompt after prompt.
#[test]
fn n_answers_through_the_official_client() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let api = format!("http://{}/v1", node.api);
    let got = client_script("n_choices.py", &node, &[&api, MODEL]);
    let three = got["chat_three"].as_array().expect("choices");
    assert_eq!(three.len(), 3, "{got}");
    for (i, choice) in three.iter().enumerate() {
        assert_eq!(choice[0], i, "{got}");
    }
    assert_eq!(three[0][1], got["chat_one"], "answer 0 is the n = 1 answer");
    let distinct: std::collections::BTreeSet<String> =
        three.iter().map(|c| c[1].to_string()).collect();
    assert!(distinct.len() > 1, "each answer has its own seed: {got}");
    assert_eq!(
        got["chat_stream"],
        serde_json::json!(three),
        "streamed as whole"
    );
    let (one, all) = (&got["chat_one_usage"], &got["chat_three_usage"]);
    assert_eq!(
        all["prompt_tokens"], one["prompt_tokens"],
        "the prompt once"
    );
    // Three answers of at most 12 tokens each, the first one's included.
    let completion = all["completion_tokens"].as_u64().expect("tokens");
    assert!(
        completion > one["completion_tokens"].as_u64().expect("tokens") && completion <= 36,
        "{got}"
    );
    assert_eq!(
        got["chat_stream_usage"]["prompt_tokens"],
        one["prompt_tokens"]
    );
    let both = got["completions_both"].as_array().expect("choices");
    let alone = got["completions_alone"].as_array().expect("answers");
    assert_eq!(both.len(), 4, "{got}");
    assert_eq!(both[0][1], alone[0], "prompt 0's first answer");
    assert_eq!(both[2][1], alone[1], "prompt 1's first answer");
    let streamed = got["completions_stream"].as_array().expect("choices");
    assert_eq!(streamed.len(), 2);
    assert_eq!(streamed[0][1], both[0][1]);
    assert_eq!(streamed[1][1], both[1][1]);
}
