//! Speculative decoding on a running instance, through the whole path: the
//! draft set over HTTP (and the CLI) becomes an InstanceDraftModelUpdated
//! event, the worker orders rank 0's runner, whose status names the draft;
//! greedy answers are the same with and without it, and the usage tells
//! what was drafted and accepted; cleared, it is gone from the state and
//! the status. The draft model is the target itself (acceptance ~100%).

use std::time::Duration;

use serde_json::{json, Value};

use crate::api::{http, Node, MODEL};
use crate::support::tessera;

/// A prompt whose answer repeats its input: what prompt lookup is for.
const ECHO: &str = "Repeat the following text exactly, word for word:\n\
    The quick brown fox jumps over the lazy dog. The quick brown fox jumps \
    over the lazy dog. Pack my box with five dozen liquor jugs.";

fn json_of(status: u16, body: &str, node: &Node) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {status} {body}\n{}", node.log()))
}

/// A greedy chat completion: its text and its usage.
fn greedy(node: &Node, speculative: Option<bool>) -> (String, Value) {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": ECHO}],
        "max_tokens": 48,
        "temperature": 0,
    });
    if let Some(speculative) = speculative {
        body["tessera"] = json!({"speculative": speculative});
    }
    let (status, text) = http(
        &node.api,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    let answer = json_of(status, &text, node);
    assert_eq!(status, 200, "{answer}");
    let content = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (content, answer["usage"].clone())
}

fn put_draft(node: &Node, id: &str, body: Value) -> (u16, Value) {
    let path = format!("/instance/{id}/draft");
    let (status, text) = http(&node.api, "PUT", &path, body.to_string().as_bytes());
    (status, json_of(status, &text, node))
}

/// The state: the instance's draft and rank 0's status.
fn state_of(node: &Node, id: &str) -> (Value, Value) {
    let (status, text) = http(&node.api, "GET", &format!("/instance/{id}"), b"");
    let shown = json_of(status, &text, node);
    assert_eq!(status, 200, "{shown}");
    let rank0 = shown["instance"]["ranks"][0]["runnerId"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (shown["instance"].clone(), shown["runners"][&rank0].clone())
}

/// The draft rank 0's status names (Ready or Running), or null.
fn runner_draft(runner: &Value) -> Value {
    let state = if runner["ready"].is_object() {
        &runner["ready"]
    } else {
        &runner["running"]
    };
    state["draft"].clone()
}

fn usage_figures(usage: &Value) -> (u64, u64, u64, u64) {
    let t = &usage["tessera"];
    let n = |v: &Value| v.as_u64().unwrap_or(u64::MAX);
    (
        n(&usage["completion_tokens"]),
        n(&t["draft_tokens"]),
        n(&t["accepted_draft_tokens"]),
        n(&t["decode_steps"]),
    )
}

#[test]
fn a_draft_set_on_a_running_instance_drafts_keeps_greedy_answers_and_clears() {
    let root = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&root.path().join("n"), &["--offline"]);
    // The first request places the instance; the answer without drafts.
    let (plain, usage) = greedy(&node, None);
    assert_eq!(usage_figures(&usage).1, 0, "no draft yet: {usage}");
    let (status, text) = http(&node.api, "GET", "/state", b"");
    let state = json_of(status, &text, &node);
    let id = state["state"]["instances"]
        .as_object()
        .and_then(|m| m.keys().next().cloned())
        .unwrap_or_else(|| panic!("an instance: {state}"));

    // Refusals change nothing.
    let (status, refused) = put_draft(&node, "no-such-instance", json!({"ngram": true}));
    assert_eq!(status, 404, "{refused}");
    let (status, refused) = put_draft(&node, &id, json!({"ngram": true, "tokens": 17}));
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("between 1 and 16")));
    let (status, refused) = put_draft(&node, &id, json!({"model": "no-such-model"}));
    assert_eq!(status, 404, "{refused}");
    let (status, refused) = put_draft(&node, &id, json!({"ngram": true, "off": true}));
    assert_eq!(status, 400, "{refused}");
    assert!(state_of(&node, &id).0["draft"].is_null());

    // Prompt lookup: in the state, in rank 0's status, in the usage.
    let (status, set) = put_draft(&node, &id, json!({"ngram": true, "tokens": 4}));
    assert_eq!(status, 200, "{set}");
    assert_eq!(set["runner"]["active"], true, "{set}");
    let (instance, runner) = state_of(&node, &id);
    assert_eq!(
        instance["draft"]["method"], "DRAFT_METHOD_NGRAM",
        "{instance}"
    );
    assert_eq!(instance["draft"]["numDraftTokens"], 4, "{instance}");
    assert_eq!(runner_draft(&runner)["active"], true, "{runner}");
    let (drafted, usage) = greedy(&node, None);
    let (completion, draft_tokens, accepted, steps) = usage_figures(&usage);
    eprintln!("SPECULATIVE ngram: {completion} tokens, {draft_tokens} drafted, {accepted} accepted, {steps} steps");
    assert_eq!(drafted, plain, "greedy answers do not change");
    assert!(draft_tokens > 0, "an echo drafts: {usage}");
    assert!(accepted <= draft_tokens && steps <= completion, "{usage}");
    let (opted_out, usage) = greedy(&node, Some(false));
    assert_eq!(opted_out, plain);
    assert_eq!(usage_figures(&usage).1, 0, "opted out: {usage}");

    // The target as its own draft model: loaded on rank 0, accepted ~all.
    let (status, set) = put_draft(&node, &id, json!({"model": MODEL, "tokens": 4}));
    assert_eq!(status, 200, "{set}");
    assert_eq!(set["runner"]["active"], true, "{set}");
    assert!(
        set["runner"]["residentBytes"]
            .as_str()
            .is_some_and(|b| b != "0"),
        "{set}"
    );
    let (drafted, usage) = greedy(&node, None);
    let (completion, draft_tokens, accepted, steps) = usage_figures(&usage);
    eprintln!("SPECULATIVE self-draft: {completion} tokens, {draft_tokens} drafted, {accepted} accepted, {steps} steps");
    assert_eq!(drafted, plain, "greedy answers do not change");
    // A draft as large as its target never pays: the adaptive length may
    // judge so before it drafts at all (the engine's tests force drafting
    // to check acceptance); what it drafts, a model agrees with.
    assert!(
        accepted * 10 >= draft_tokens * 9,
        "a model agrees with itself: {usage}"
    );

    // The CLI sets and clears it too.
    let zenoh = format!("tcp/127.0.0.1:{}", node.zenoh);
    let cli = |args: &[&str]| {
        let mut all = vec![
            "admin",
            "--namespace",
            "api-test",
            "--connect",
            &zenoh,
            "--json",
            "draft",
            &id,
        ];
        all.extend_from_slice(args);
        let out = tessera(&all);
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            node.log()
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("JSON")
    };
    let shown = cli(&["--ngram", "--tokens", "3"]);
    assert_eq!(shown["runner"]["numDraftTokens"], 3, "{shown}");
    assert_eq!(shown["reported"], true, "{shown}");

    // Cleared: gone from the instance and from rank 0's status.
    let (status, cleared) = put_draft(&node, &id, json!({"off": true}));
    assert_eq!(status, 200, "{cleared}");
    assert!(
        cleared["runner"].is_null() && cleared["draft"].is_null(),
        "{cleared}"
    );
    let (instance, runner) = state_of(&node, &id);
    assert!(instance["draft"].is_null(), "{instance}");
    assert!(runner_draft(&runner).is_null(), "{runner}");
    let (after, usage) = greedy(&node, None);
    assert_eq!(after, plain);
    assert_eq!(usage_figures(&usage).1, 0, "{usage}");
    let shown = cli(&["--off"]);
    assert!(shown["draft"].is_null(), "{shown}");

    // Each change is an event in the log (two HTTP, two CLI, one more
    // HTTP); the refusals are none.
    let out = tessera(&[
        "admin",
        "--namespace",
        "api-test",
        "--connect",
        &zenoh,
        "events",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let updates = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.contains("instanceDraftModelUpdated"))
        .count();
    assert_eq!(updates, 5);
}

#[test]
fn a_pipeline_instances_draft_model_is_fetched_and_loaded_on_rank_0_only() {
    use crate::cluster::{
        admin_generate, all_ready, master_seen, place_on, wait_until, with_model,
    };
    let root = tempfile::tempdir().expect("temp dir");
    let ns = "draft-pipeline-test";
    let ports: Vec<u16> = (0..2).map(|_| crate::support::free_port()).collect();
    let mut nodes = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let dir = with_model(&root.path().join(name)).to_path_buf();
        let connect: Vec<u16> = ports[..i].to_vec();
        nodes.push(crate::cluster::Node::start_with(
            ns,
            &dir,
            ports[i],
            &connect,
            &["--offline"],
        ));
    }
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, count)| *count == 2)
    })
    .expect("two nodes agree on a master");
    let logs = |nodes: &[crate::cluster::Node]| -> String {
        nodes.iter().map(crate::cluster::Node::log).collect()
    };
    let instance = place_on(ns, ports[0], "pipeline", 2);
    let ready = wait_until(Duration::from_secs(60), || {
        all_ready(ns, ports[1], &instance).then_some(())
    });
    assert!(
        ready.is_some(),
        "the instance reaches Ready\n{}",
        logs(&nodes)
    );
    let prompt = "one two three four five one two three four five one two";
    let plain = admin_generate(ns, ports[1], &instance, prompt).expect("a generation");

    // The target as its own draft: rank 0's node widens its download to the
    // whole model and its runner loads it; rank 1 knows nothing of it.
    let via = format!("tcp/127.0.0.1:{}", ports[1]);
    let out = tessera(&[
        "admin",
        "--namespace",
        ns,
        "--connect",
        &via,
        "--json",
        "draft",
        &instance,
        "--model",
        MODEL,
        "--tokens",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs(&nodes)
    );
    let shown: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(shown["runner"]["active"], true, "{shown}");
    assert_eq!(shown["runner"]["numDraftTokens"], 3, "{shown}");
    let out = tessera(&[
        "admin",
        "--namespace",
        ns,
        "--connect",
        &via,
        "--json",
        "state",
    ]);
    let state: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let state = &state["state"];
    let ranks = state["instances"][&instance]["ranks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(ranks.len(), 2, "{state}");
    let runner =
        |rank: usize| state["runners"][ranks[rank]["runnerId"].as_str().unwrap_or("")].clone();
    assert_eq!(runner_draft(&runner(0))["active"], true, "{state}");
    assert!(
        runner_draft(&runner(1)).is_null(),
        "rank 1 follows: {state}"
    );
    let on_rank0 = ranks[0]["nodeId"].as_str().unwrap_or_default();
    let whole = &state["downloads"][on_rank0]["models"][MODEL];
    assert!(whole["completed"].is_object(), "{whole}");
    assert!(
        whole["shards"].is_null(),
        "the whole model on rank 0's node: {whole}"
    );

    // Greedy answers through both ranks do not change.
    let drafted = admin_generate(ns, ports[0], &instance, prompt).expect("a generation");
    assert_eq!(drafted, plain);
    let out = tessera(&[
        "admin",
        "--namespace",
        ns,
        "--connect",
        &via,
        "draft",
        &instance,
        "--off",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
