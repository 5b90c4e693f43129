//! The HTTP API of a real `tessera node`, driven by the official OpenAI
//! Python client (installed by `scripts/python-env`) and by plain HTTP:
//! greedy answers equal `tessera generate`'s, streams end as OpenAI's do,
//! errors come in OpenAI's format, and a client that goes away cancels its
//! generation.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{free_port, BIN};

pub(crate) const MODEL: &str = "smollm2-135m-instruct-q4_1";

pub(crate) struct Node {
    child: Child,
    pub(crate) api: String,
    /// The port its zenoh listens on (loopback).
    pub(crate) zenoh: u16,
    log: std::path::PathBuf,
}

impl Node {
    pub(crate) fn start(dir: &Path, extra: &[&str]) -> Node {
        let models = dir.join("models").join(tessera_testkit::DEFAULT_MODEL_DIR);
        std::fs::create_dir_all(&models).expect("models dir");
        std::os::unix::fs::symlink(
            tessera_testkit::default_model_path(),
            models.join(tessera_testkit::DEFAULT_MODEL_FILE),
        )
        .expect("link the model");
        let log = dir.with_extension("log");
        let zenoh = free_port();
        let mut child = Command::new(BIN)
            .args(["node", "--namespace", "api-test", "--no-multicast"])
            .args(["--listen", &format!("tcp/127.0.0.1:{zenoh}")])
            .args(["--runner-threads", "1", "--api-host", "127.0.0.1"])
            .args(["--api-port", "0"])
            .args(extra)
            .arg("--data-dir")
            .arg(dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("node starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("node prints its line");
        let json: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        Node {
            child,
            api: json["api"].as_str().expect("api address").to_string(),
            zenoh,
            log,
        }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request; the status and the body (connection closed).
pub(crate) fn http(address: &str, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let (status, _, body) = http_with(address, method, path, "", body);
    (status, body)
}

/// [`http`] with `headers` (each line ending in CRLF) added; the status,
/// the answer's head and its body.
fn http_with(
    address: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String, String) {
    let mut stream = TcpStream::connect(address).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}Connection: close\r\n\r\n",
        body.len()
    );
    // The server may answer (413) and close before the body is all sent.
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body));
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).to_string();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, head.to_string(), body.to_string())
}

fn greedy(prompt: &str, max_tokens: u32) -> String {
    let out = Command::new(BIN)
        .args(["generate", "--chat", prompt, "--json"])
        .args(["--max-tokens", &max_tokens.to_string()])
        .arg("--model")
        .arg(tessera_testkit::default_model_path())
        .output()
        .expect("generate runs");
    assert!(out.status.success());
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    json["text"].as_str().expect("text").to_string()
}

/// Runs one of the official-client scripts in `tests/api/` against `node`
/// and returns the JSON it prints.
pub(crate) fn client_script(script: &str, node: &Node, args: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg(format!("{}/tests/api/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .env("PYTHONPATH", crate::support::python_lib())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.log()
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn the_openai_client_gets_greedy_answers_streams_and_errors() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let prompt = "What is the capital of France?";
    let expected = greedy(prompt, 24);
    let api = format!("http://{}/v1", node.api);
    let got = client_script("openai_client.py", &node, &[&api, MODEL, prompt, "24"]);
    // The model is placed on the first request; greedy answers match.
    assert_eq!(got["object"], "chat.completion");
    assert_eq!(got["text"], expected.as_str(), "non-streaming");
    assert_eq!(got["stream_text"], expected.as_str(), "streaming");
    assert_eq!(got["finish_reason"], "length");
    assert_eq!(got["stream_finish_reason"], "length");
    assert_eq!(got["usage"]["completion_tokens"], 24);
    assert_eq!(got["stream_usage"]["completion_tokens"], 24);
    assert_eq!(got["stream_roles"], serde_json::json!(["assistant"]));
    let logprobs = got["logprobs"].as_array().expect("logprobs");
    assert_eq!(logprobs.len(), 4);
    assert!(logprobs
        .iter()
        .all(|l| l["top"] == 2 && l["logprob"].as_f64().is_some_and(|p| p <= 0.0)));
    // A tool call, whole and streamed.
    assert_eq!(got["tool_finish_reason"], "tool_calls", "{got}");
    let call = serde_json::json!({"name": "get_weather", "arguments": {"city": "Paris"}});
    assert_eq!(got["tool_calls"][0]["name"], call["name"]);
    assert_eq!(got["tool_calls"][0]["arguments"], call["arguments"]);
    assert_eq!(got["stream_tool_calls"], serde_json::json!([call]));
    // The Responses API gives the same text, whole and streamed.
    assert_eq!(got["responses_text"], expected.as_str(), "responses");
    assert_eq!(got["responses_stream_text"], expected.as_str());
    assert_eq!(
        got["responses_status"], "incomplete",
        "cut by max_output_tokens"
    );
    let kinds = got["responses_events"].as_array().expect("events");
    for kind in [
        "response.created",
        "response.output_item.added",
        "response.output_text.delta",
        "response.output_item.done",
        "response.incomplete",
    ] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} in {kinds:?}");
    }
    let errors = &got["errors"];
    assert_eq!(errors["unknown_model"]["status"], 404, "{errors}");
    assert_eq!(errors["empty_messages"]["status"], 400, "{errors}");
    assert_eq!(
        errors["max_tokens_beyond_context"]["status"], 400,
        "{errors}"
    );
    assert_eq!(errors["bad_temperature"]["status"], 400, "{errors}");
    assert!(got["models"]
        .as_array()
        .is_some_and(|m| m.iter().any(|id| id == MODEL)));
}

#[test]
fn the_anthropic_client_gets_the_same_greedy_answer() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let prompt = "Name three colours.";
    let expected = greedy(prompt, 16);
    let api = format!("http://{}", node.api);
    let got = client_script("anthropic_client.py", &node, &[&api, MODEL, prompt, "16"]);
    assert_eq!(got["type"], "message");
    assert_eq!(got["text"], expected.as_str(), "non-streaming");
    assert_eq!(got["stream_text"], expected.as_str(), "streaming");
    assert_eq!(got["stop_reason"], "max_tokens");
    assert_eq!(got["stream_stop_reason"], "max_tokens");
    assert_eq!(got["output_tokens"], 16);
    for event in [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ] {
        assert!(
            got["stream_events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|x| x == event)),
            "{event} in {}",
            got["stream_events"]
        );
    }
    assert_eq!(got["errors"]["unknown_model"]["status"], 404);
    assert_eq!(got["errors"]["unknown_model"]["type"], "not_found_error");
    assert_eq!(got["errors"]["empty_messages"]["status"], 400);
    assert_eq!(
        got["errors"]["empty_messages"]["type"],
        "invalid_request_error"
    );
}

#[test]
fn bad_bodies_get_clear_errors_and_a_gone_client_cancels_its_generation() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(
        &root.path().join("n"),
        // One generation at a time: a KV cache of 2,048 positions.
        &[
            "--no-auto-place",
            "--queue-limit",
            "2",
            "--max-concurrent",
            "1",
        ],
    );
    let api = node.api.as_str();
    // Malformed JSON, wrong types, an unknown endpoint, an oversized body.
    let (status, body) = http(api, "POST", "/v1/chat/completions", b"{not json");
    assert_eq!(status, 400, "{body}");
    let error: Value = serde_json::from_str(&body).expect("an error object");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let (status, _) = http(
        api,
        "POST",
        "/v1/chat/completions",
        br#"{"model": 5, "messages": "hi"}"#,
    );
    assert_eq!(status, 400);
    let (status, _) = http(api, "GET", "/v1/nothing", b"");
    assert_eq!(status, 404);
    let huge = vec![b' '; 5 << 20];
    let (status, _) = http(api, "POST", "/v1/chat/completions", &huge);
    assert_eq!(status, 413);
    // Without auto-place, a model with no instance is a 404 that says how.
    let chat = |max_tokens: u32, stream: bool| {
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        })
        .to_string()
    };
    let (status, body) = http(
        api,
        "POST",
        "/v1/chat/completions",
        chat(4, false).as_bytes(),
    );
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("place_instance"), "{body}");

    // Once the node is in the state, place the model through the API and
    // wait for it.
    let started = Instant::now();
    loop {
        let (_, body) = http(api, "GET", "/state", b"");
        let state: Value = serde_json::from_str(&body).unwrap_or_default();
        if state["state"]["nodes"]
            .as_object()
            .is_some_and(|n| !n.is_empty())
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the node reports itself"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, body) = http(
        api,
        "POST",
        "/place_instance",
        format!(r#"{{"model_id": "{MODEL}"}}"#).as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let placed: Value = serde_json::from_str(&body).expect("JSON");
    let instance = placed["instance"]["instanceId"]
        .as_str()
        .expect("instance id")
        .to_string();
    let started = Instant::now();
    loop {
        let (_, body) = http(api, "GET", &format!("/instance/{instance}"), b"");
        let json: Value = serde_json::from_str(&body).unwrap_or_default();
        if json["ready"] == true {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "ready\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // A conversation far beyond the context: each dialect's 400.
    let messages: Vec<Value> = (0..10_000)
        .map(|i| serde_json::json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"}))
        .collect();
    for (path, extra) in [
        ("/v1/chat/completions", serde_json::json!({"max_tokens": 4})),
        ("/v1/messages", serde_json::json!({"max_tokens": 4})),
        ("/api/chat", serde_json::json!({"stream": false})),
    ] {
        let mut body = serde_json::json!({"model": MODEL, "messages": messages});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        let (status, answer) = http(api, "POST", path, body.to_string().as_bytes());
        assert_eq!(status, 400, "{path}: {}", &answer[..answer.len().min(300)]);
        assert!(answer.contains("context"), "{path}: {answer}");
    }

    // Within the context but beyond the instance's KV cache: a 400 that
    // names the token counts.
    let (status, answer) = http(
        api,
        "POST",
        "/v1/chat/completions",
        chat(3000, false).as_bytes(),
    );
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer.contains("KV cache") && answer.contains("max_tokens 3000"),
        "{answer}"
    );

    // The same long system prompt twice: the second request's prompt comes
    // from the prefix cache, and usage says how much.
    let system = "You are a careful assistant for a home cluster of computers; answer briefly, name the machine you mean, and never invent a number you were not given. ".repeat(20);
    let mut cached = Vec::new();
    for question in ["What is a node?", "What is a rank?"] {
        let body = serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4,
            "temperature": 0,
        });
        let (status, answer) = http(
            api,
            "POST",
            "/v1/chat/completions",
            body.to_string().as_bytes(),
        );
        assert_eq!(status, 200, "{answer}");
        let answer: Value = serde_json::from_str(&answer).expect("JSON");
        assert!(
            answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0) >= 600,
            "{answer}"
        );
        cached.push(answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
    }
    assert_eq!(cached[0], Some(0), "a cold prompt");
    assert!(
        cached[1].is_some_and(|n| n >= 576),
        "cached tokens {cached:?}"
    );

    // A streaming client that leaves after a few chunks: its generation
    // is cancelled (the task goes, the runner is Ready again) long before
    // 2,000 tokens.
    let mut stream = TcpStream::connect(api).expect("connect");
    let body = chat(2000, true);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {api}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("write");
    stream.write_all(body.as_bytes()).expect("write");
    let mut reader = BufReader::new(stream);
    let mut data_lines = 0;
    let mut line = String::new();
    while data_lines < 5 {
        line.clear();
        assert!(
            reader.read_line(&mut line).expect("read") > 0,
            "stream ended"
        );
        if line.starts_with("data: ") {
            data_lines += 1;
        }
    }
    drop(reader);
    let left = Instant::now();
    loop {
        let (_, body) = http(api, "GET", "/state", b"");
        let state: Value = serde_json::from_str(&body).expect("state");
        let tasks = state["state"]["tasks"]
            .as_object()
            .map_or(0, serde_json::Map::len);
        let runner = format!("{instance}-rank0");
        let ready = state["state"]["runners"][&runner].get("ready").is_some();
        if tasks == 0 && ready {
            break;
        }
        assert!(
            left.elapsed() < Duration::from_secs(20),
            "the generation is cancelled\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("client gone: cancelled within {:?}", left.elapsed());
    assert!(node.log().contains("client gone; cancelling"));

    // The cluster endpoints.
    let (status, body) = http(api, "GET", "/node_id", b"");
    assert_eq!(status, 200);
    assert!(body.starts_with('"'));
    let (status, body) = http(
        api,
        "GET",
        &format!("/instance/previews?model_id={MODEL}"),
        b"",
    );
    assert_eq!(status, 200, "{body}");
    let (status, _) = http(api, "GET", "/instance/no-such-instance", b"");
    assert_eq!(status, 404);
    let (status, body) = http(api, "DELETE", &format!("/instance/{instance}"), b"");
    assert_eq!(status, 200, "{body}");
    let (status, _) = http(api, "DELETE", &format!("/instance/{instance}"), b"");
    assert_eq!(status, 404);
}

#[test]
fn ollama_endpoints_answer_in_ollamas_format() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let api = node.api.as_str();
    let (status, body) = http(api, "GET", "/api/version", b"");
    assert_eq!(status, 200);
    assert!(body.contains("\"version\""), "{body}");
    let (status, body) = http(api, "GET", "/api/tags", b"");
    assert_eq!(status, 200);
    let tags: Value = serde_json::from_str(&body).expect("JSON");
    assert!(tags["models"]
        .as_array()
        .is_some_and(|m| m.iter().any(|t| t["name"] == MODEL)));

    let prompt = "Name a fruit.";
    let expected = greedy(prompt, 12);
    let chat = |stream: bool| {
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "stream": stream,
            "options": {"temperature": 0, "num_predict": 12},
        })
        .to_string()
    };
    // Whole (the model is placed on this first request).
    let (status, body) = http(api, "POST", "/api/chat", chat(false).as_bytes());
    assert_eq!(status, 200, "{body}\n{}", node.log());
    let whole: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(whole["message"]["content"], expected.as_str());
    assert_eq!(whole["done"], true);
    let count = whole["eval_count"].as_u64().unwrap_or(0);
    let reason = if count == 12 { "length" } else { "stop" };
    assert!((1..=12).contains(&count), "{whole}");
    assert_eq!(whole["done_reason"], reason);
    // Streamed: newline-delimited JSON, the last line done.
    let (status, body) = http(api, "POST", "/api/chat", chat(true).as_bytes());
    assert_eq!(status, 200);
    // The body is chunked on the wire: keep only the JSON lines.
    let lines: Vec<Value> = body
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.is_object())
        .collect();
    let text: String = lines
        .iter()
        .filter_map(|l| l["message"]["content"].as_str())
        .collect();
    assert_eq!(text, expected);
    assert_eq!(
        lines.last().map(|l| l["done"].clone()),
        Some(Value::Bool(true))
    );
    // Generate, raw prompt, not streamed.
    let (status, body) = http(
        api,
        "POST",
        "/api/generate",
        format!(
            r#"{{"model": "{MODEL}", "prompt": "The sky is", "raw": true, "stream": false, "options": {{"num_predict": 4}}}}"#
        )
        .as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let generated: Value = serde_json::from_str(&body).expect("JSON");
    assert!(generated["response"]
        .as_str()
        .is_some_and(|r| !r.is_empty()));
    // Errors in Ollama's shape.
    let (status, body) = http(
        api,
        "POST",
        "/api/chat",
        br#"{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}"#,
    );
    assert_eq!(status, 404);
    let error: Value = serde_json::from_str(&body).expect("JSON");
    assert!(error["error"]
        .as_str()
        .is_some_and(|e| e.contains("no-such-model")));
}

/// A deterministic mutation of a valid body: byte edits or a field given
/// a value of another type.
fn mutate(base: &Value, rng: &mut rand::rngs::StdRng) -> Vec<u8> {
    use rand::Rng;
    let mut value = base.clone();
    if rng.gen_bool(0.5) {
        // Structural: one field (top level or in the first message) gets
        // another type or an odd value.
        let odd = [
            Value::Null,
            serde_json::json!(-1),
            serde_json::json!(1e300),
            serde_json::json!(""),
            serde_json::json!("x".repeat(300)),
            serde_json::json!([]),
            serde_json::json!({}),
            serde_json::json!(true),
            serde_json::json!(4_294_967_296u64),
        ];
        let pick = odd[rng.gen_range(0..odd.len())].clone();
        let target = if rng.gen_bool(0.3) {
            value
                .get_mut("messages")
                .and_then(|m| m.get_mut(0))
                .and_then(Value::as_object_mut)
        } else {
            value.as_object_mut()
        };
        if let Some(object) = target {
            let keys: Vec<String> = object.keys().cloned().collect();
            if !keys.is_empty() {
                let key = keys[rng.gen_range(0..keys.len())].clone();
                if rng.gen_bool(0.2) {
                    object.remove(&key);
                } else {
                    object.insert(key, pick);
                }
            }
        }
        return value.to_string().into_bytes();
    }
    let mut bytes = value.to_string().into_bytes();
    for _ in 0..rng.gen_range(1..4) {
        if bytes.is_empty() {
            break;
        }
        let at = rng.gen_range(0..bytes.len());
        match rng.gen_range(0..4) {
            0 => bytes[at] = rng.gen(),
            1 => {
                let end = (at + rng.gen_range(1..8)).min(bytes.len());
                bytes.drain(at..end);
            }
            2 => {
                let end = (at + rng.gen_range(1..16)).min(bytes.len());
                let copy = bytes[at..end].to_vec();
                bytes.splice(at..at, copy);
            }
            _ => bytes.insert(at, b"{}[]\",:0-e\\"[rng.gen_range(0..11)]),
        }
    }
    bytes
}

/// Sends `count` mutated bodies from 4 threads; the answers that are not
/// a valid answer (JSON, or a stream) or a 4xx with an error object.
fn fuzz(
    api: &str,
    bases: &[(&str, Value)],
    count: usize,
    seed: u64,
) -> (usize, usize, Vec<String>) {
    use rand::SeedableRng;
    let threads = 4;
    let outcomes: Vec<(usize, usize, Vec<String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 100 + t as u64);
                    let (mut answered, mut refused, mut bad) = (0, 0, Vec::new());
                    for i in 0..count / threads {
                        let (path, base) = &bases[(i + t) % bases.len()];
                        let body = mutate(base, &mut rng);
                        let (status, reply) = http(api, "POST", path, &body);
                        let json: Option<Value> = serde_json::from_str(&reply).ok();
                        let streamed = reply.contains("\"done\":true") || reply.contains("data: ");
                        match status {
                            200 if json.is_some() || streamed => answered += 1,
                            400..=499
                                if json.as_ref().is_some_and(|j| j.get("error").is_some()) =>
                            {
                                refused += 1
                            }
                            _ => bad.push(format!(
                                "{path} {status}: {} <- {}",
                                reply.chars().take(300).collect::<String>(),
                                String::from_utf8_lossy(&body)
                            )),
                        }
                    }
                    (answered, refused, bad)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a fuzzing thread"))
            .collect()
    });
    let answered = outcomes.iter().map(|o| o.0).sum();
    let refused = outcomes.iter().map(|o| o.1).sum();
    let bad = outcomes.into_iter().flat_map(|o| o.2).collect();
    (answered, refused, bad)
}

#[test]
fn ten_thousand_mutated_bodies_get_an_answer_or_a_4xx_and_never_a_panic() {
    let root = tempfile::tempdir().expect("temp dir");
    let mut node = Node::start(&root.path().join("n"), &["--no-auto-place"]);
    let api = node.api.clone();
    let message = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let bases = [
        (
            "/v1/chat/completions",
            serde_json::json!({"model": MODEL, "messages": message, "max_tokens": 1, "temperature": 0.5, "stop": ["x"]}),
        ),
        (
            "/v1/messages",
            serde_json::json!({"model": MODEL, "messages": message, "max_tokens": 1, "system": "Be brief."}),
        ),
        (
            "/v1/responses",
            serde_json::json!({"model": MODEL, "input": "Hi", "max_output_tokens": 1}),
        ),
        (
            "/api/chat",
            serde_json::json!({"model": MODEL, "messages": message, "stream": false, "options": {"num_predict": 1}}),
        ),
        (
            "/api/generate",
            serde_json::json!({"model": MODEL, "prompt": "Hi", "stream": false, "options": {"num_predict": 1}}),
        ),
    ];
    // 10,000 with no instance: every body is parsed and checked in full
    // (checks come before placement), and a valid one is a 404 that says
    // how to place the model.
    let (answered, refused, bad) = fuzz(&api, &bases, 10_000, 1);
    eprintln!(
        "fuzz, no instance: {answered} answered, {refused} refused, {} other",
        bad.len()
    );
    assert!(
        bad.is_empty(),
        "{} bad answers, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    assert_eq!(refused, 10_000);
    // Then 400 more against a ready instance: odd but valid requests are
    // answered by the engine.
    let (status, body) = http(
        &api,
        "POST",
        "/place_instance",
        format!(r#"{{"model_id": "{MODEL}"}}"#).as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let started = Instant::now();
    let model_ready = || {
        let models: serde_json::Value =
            serde_json::from_str(&http(&api, "GET", "/v1/models", b"").1).unwrap_or_default();
        models["data"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["id"] == MODEL && m["ready"] == true)
    };
    while !model_ready() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (answered, refused, bad) = fuzz(&api, &bases, 400, 2);
    eprintln!(
        "fuzz, ready: {answered} answered, {refused} refused, {} other",
        bad.len()
    );
    assert!(
        bad.is_empty(),
        "{} bad answers, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    assert!(answered > 20, "valid requests are answered: {answered}");
    assert!(
        node.child.try_wait().ok().flatten().is_none(),
        "the node is still running"
    );
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

#[test]
fn the_load_bench_checks_every_answer_and_turns_excess_into_429s() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &["--queue-limit", "4"]);
    let out = Command::new(BIN)
        .args(["bench", "api", "--url", &format!("http://{}", node.api)])
        .args(["--clients", "8", "--seconds", "6", "--max-tokens", "6"])
        .args(["--prompts", "4", "--overhead-samples", "5"])
        .output()
        .expect("bench runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.log()
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    eprintln!("{report}");
    assert!(
        report["requests"].as_u64().is_some_and(|n| n > 0),
        "{report}"
    );
    assert_eq!(report["mismatched"], 0, "no answer lost or mixed up");
    assert_eq!(report["errors"], 0, "{report}");
    assert!(
        report["rejected_429"].as_u64().is_some_and(|n| n > 0),
        "8 clients over a bound of 4 get 429s: {report}"
    );
    assert_eq!(report["overhead"]["samples"], 5);
}

#[test]
fn a_stream_for_a_model_not_yet_placed_reports_progress_then_answers() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &[]);
    let api = node.api.as_str();
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": true,
    })
    .to_string();
    let (status, reply) = http(api, "POST", "/v1/chat/completions", body.as_bytes());
    assert_eq!(status, 200, "{reply}\n{}", node.log());
    let comments: Vec<&str> = reply.lines().filter(|l| l.starts_with(": ")).collect();
    assert!(
        comments
            .iter()
            .any(|c| c.contains("placing") || c.contains("waiting for")),
        "progress comments while the model is placed: {reply}"
    );
    assert!(reply.contains("\"content\""), "{reply}");
    assert!(reply.contains("data: [DONE]"), "{reply}");
}

/// The error object of an OpenAI-shaped answer, or a panic naming it.
fn openai_error(status: u16, body: &str, node: &Node) -> Value {
    let json: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let error = json["error"].clone();
    assert!(
        error["message"].is_string() && error["type"].is_string(),
        "{status} {body}\n{}",
        node.log()
    );
    error
}

#[test]
fn admin_refusals_answer_with_their_status_in_openais_shape() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &["--offline"]);
    let (status, body) = http(&node.api, "GET", "/node_id", b"");
    assert_eq!(status, 200, "{body}");
    let node_id: String = serde_json::from_str(&body).expect("node id");
    // Placing before the node reported its memory does not fit (400).
    let place = serde_json::json!({"model": MODEL}).to_string();
    let started = Instant::now();
    loop {
        let (status, body) = http(&node.api, "POST", "/place_instance", place.as_bytes());
        if status == 200 {
            break;
        }
        assert_eq!(openai_error(status, &body, &node)["code"], "does_not_fit");
        assert!(started.elapsed() < Duration::from_secs(20), "{body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The files of a model an instance uses are not deleted: 409, both ways.
    let path = format!("/download/{node_id}/{MODEL}");
    let (status, body) = http(&node.api, "DELETE", &path, b"");
    let error = openai_error(status, &body, &node);
    assert_eq!(status, 409, "{body}");
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["code"], "conflict");
    assert!(error["message"]
        .as_str()
        .is_some_and(|m| m.contains("delete the instance first")));
    let delete = serde_json::json!({"model": MODEL}).to_string();
    let (status, body) = http(&node.api, "POST", "/download/delete", delete.as_bytes());
    assert_eq!(status, 409, "{body}");
    // An unknown node or model is 404; an offline master cannot read the hub: 503.
    let (status, body) = http(
        &node.api,
        "DELETE",
        &format!("/download/nobody/{MODEL}"),
        b"",
    );
    assert_eq!(
        (status, openai_error(status, &body, &node)["code"].clone()),
        (404, "not_found".into())
    );
    let add = serde_json::json!({"model": "acme/m"}).to_string();
    let (status, body) = http(&node.api, "POST", "/models/add", add.as_bytes());
    assert_eq!(status, 503, "{body}");
    assert_eq!(openai_error(status, &body, &node)["code"], "unavailable");
}

#[test]
fn a_malformed_admin_request_is_refused_not_ignored() {
    use prost::Message;
    use tessera_protos::v1;
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &["--offline"]);
    // A mutation is answered by the master only: the API waits for one.
    let (status, body) = http(&node.api, "DELETE", "/instance/none", b"");
    assert_eq!(status, 404, "{body}\n{}", node.log());
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let errors: Vec<(String, Option<v1::AdminError>)> = runtime.block_on(async {
        let client = crate::support::admin_client("api-test", node.zenoh).await;
        let session = &client.bus().session;
        let mut errors = Vec::new();
        for method in ["downloads", "state", "previews", "download", "place"] {
            let replies = session
                .get(format!("tessera/api-test/admin/{method}"))
                .payload(vec![0xffu8; 64])
                .timeout(Duration::from_secs(10))
                .await
                .expect("get");
            let reply = replies.recv_async().await.expect("a reply, not silence");
            let sample = reply.result().expect("a sample");
            let bytes = sample.payload().to_bytes();
            let decoded = v1::ListDownloadsReply::decode(bytes.as_ref()).expect("a reply");
            errors.push((method.to_string(), decoded.error));
        }
        errors
    });
    for (method, error) in errors {
        let error = error.unwrap_or_else(|| panic!("{method}: no error"));
        assert_eq!(error.kind, "invalid_argument", "{method}: {error:?}");
        assert_eq!(
            error.kind_code,
            v1::AdminErrorKind::InvalidArgument as i32,
            "{method}"
        );
        assert!(
            error.message.contains("is not a"),
            "{method}: {}",
            error.message
        );
    }
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

/// With API keys (a flag and the data dir's file), every endpoint but the
/// dashboard's page asks for one: the official clients raise their own
/// authentication errors for a wrong or missing key and answer with a
/// right one; plain HTTP sees 401s in each dialect's shape.
#[test]
fn api_keys_guard_every_dialect() {
    let root = tempfile::tempdir().expect("temp dir");
    let dir = root.path().join("n");
    std::fs::create_dir_all(&dir).expect("data dir");
    std::fs::write(dir.join("api_keys"), "# keys of the house\nsk-from-file\n").expect("keys");
    let node = Node::start(&dir, &["--api-key", "sk-from-flag", "--model", MODEL]);
    let got = client_script(
        "auth_clients.py",
        &node,
        &[&format!("http://{}", node.api), MODEL, "sk-from-flag"],
    );
    for dialect in ["openai", "anthropic"] {
        for case in ["wrong", "missing"] {
            let refusal = &got[format!("{dialect}_{case}")];
            assert_eq!(refusal["status"], 401, "{dialect} {case}: {got}");
        }
        let answer = got[format!("{dialect}_right")].as_str().unwrap_or_default();
        assert!(!answer.is_empty(), "{dialect}: {got}");
    }
    let (status, answer) = http(&node.api, "GET", "/state", b"");
    assert_eq!(status, 401);
    assert!(answer.contains("API key"), "{answer}");
    let (status, _, answer) = http_with(&node.api, "GET", "/api/tags", "x-api-key: nope\r\n", b"");
    assert_eq!(status, 401);
    assert!(
        answer.contains("{\"error\":\"the API key is not valid\"}"),
        "{answer}"
    );
    let (status, head, _) = http_with(
        &node.api,
        "GET",
        "/v1/models",
        "Authorization: Bearer nope\r\n",
        b"",
    );
    assert_eq!(status, 401);
    assert!(
        head.to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{head}"
    );
    let (status, _, _) = http_with(
        &node.api,
        "GET",
        "/state",
        "x-api-key: sk-from-file\r\n",
        b"",
    );
    assert_eq!(status, 200, "the key file's key");
    // The dashboard's page loads without a key (it then asks for one).
    let (status, page) = http(&node.api, "GET", "/", b"");
    assert_eq!(status, 200);
    assert!(page.contains("<html"), "{page}");
}
