//! `tessera models add` on a GGUF repository served by the local hub: the
//! card comes from the headers of a split GGUF's shards (read with `Range`
//! requests, never the weights), and a two-node pipeline instance fetches
//! only the shards each stage needs, joins them, reaches Ready and answers
//! as one machine does.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tessera_hub::gguf::{self, Header, MetaEntry, TensorInfo};

use crate::cluster::{
    admin_generate, all_ready, http, master_seen, models, wait_until, LocalHub, Node,
};
use crate::support::{free_port, BIN};

/// Writes `source` split in three as llama.cpp's `gguf-split` does (shard
/// 1 has every metadata entry, each shard the split keys): shard 1 the
/// tensors of no layer, 2 layers before `cut`, 3 the rest and the output
/// tensors. Returns the shards' paths.
fn split_gguf(source: &Path, dir: &Path, stem: &str, cut: u64) -> Vec<PathBuf> {
    let whole = gguf::read_header(source).expect("the model's header");
    let bytes = std::fs::read(source).expect("the model");
    let mut groups: Vec<Vec<&TensorInfo>> = vec![Vec::new(); 3];
    for tensor in &whole.tensors {
        let layer = tensor
            .name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next()?.parse::<u64>().ok());
        let group = match layer {
            Some(layer) if layer < cut => 1,
            Some(_) => 2,
            None if tensor.name.starts_with("output") => 2,
            None => 0,
        };
        groups[group].push(tensor);
    }
    let count = groups.len() as u16;
    let total = whole.tensors.len() as i32;
    groups
        .iter()
        .enumerate()
        .map(|(no, tensors)| {
            let mut metadata = if no == 0 {
                whole.metadata.clone()
            } else {
                Vec::new()
            };
            metadata.push(MetaEntry::u16(gguf::SPLIT_NO, no as u16));
            metadata.push(MetaEntry::u16(gguf::SPLIT_COUNT, count));
            metadata.push(MetaEntry::i32(gguf::SPLIT_TENSORS_COUNT, total));
            let mut data = Vec::new();
            let mut infos = Vec::new();
            for tensor in tensors {
                let size = tensor.size_bytes().expect("a known type") as usize;
                let at = (whole.data_offset + tensor.offset) as usize;
                infos.push(TensorInfo {
                    offset: data.len() as u64,
                    ..(*tensor).clone()
                });
                data.extend_from_slice(&bytes[at..at + size]);
                data.resize(data.len().div_ceil(32) * 32, 0);
            }
            let header = Header {
                version: 3,
                metadata,
                tensors: infos,
                alignment: 32,
                data_offset: 0,
            };
            let path = dir.join(gguf::shard_name(stem, no as u32 + 1, count as u32));
            let mut out = header.to_bytes();
            out.extend(data);
            std::fs::write(&path, out).expect("a shard");
            path
        })
        .collect()
}

/// The first layer of the second stage when the default model is placed
/// over two nodes by layers (from the placement preview).
fn pipeline_cut(ns: &str, via: u16) -> u64 {
    let preview = || -> Option<u64> {
        let out = Command::new(BIN)
            .args(["admin", "--namespace", ns, "--connect"])
            .arg(format!("tcp/127.0.0.1:{via}"))
            .args(["--json", "previews", "smollm2-135m-instruct-q4_1"])
            .output()
            .ok()?;
        let previews: Value = serde_json::from_slice(&out.stdout).ok()?;
        let two = previews.as_array()?.iter().find(|p| {
            p["nodeCount"] == 2
                && p["sharding"]
                    .as_str()
                    .is_some_and(|s| s.contains("PIPELINE"))
                && p.get("instance").is_some()
        })?;
        two["instance"]["ranks"][1]["shard"]["pipeline"]["startLayer"].as_u64()
    };
    wait_until(Duration::from_secs(20), preview)
        .expect("a pipeline preview of the default model over two nodes")
        .0
}

/// `models add` through the admin service, as JSON.
fn add(ns: &str, via: u16, args: &[&str]) -> Value {
    let mut all = vec!["--json", "add"];
    all.extend(args);
    let out = models(ns, via, &all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("reply JSON")
}

fn place(ns: &str, via: u16, model: &str) -> Value {
    let out = Command::new(BIN)
        .args(["admin", "--namespace", ns, "--connect"])
        .arg(format!("tcp/127.0.0.1:{via}"))
        .args(["--json", "place", model, "--min-nodes", "2"])
        .output()
        .expect("place runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The shards a pipeline rank must hold: those with its layers' tensors,
/// the first (the metadata), and on the first stage the head (tied: the
/// embedding).
fn shards_of_rank(rank: &Value, shards: &[(String, Header)]) -> BTreeSet<String> {
    let map = gguf::weight_map(shards.iter().map(|(name, h)| (name.as_str(), h)));
    let shard = &rank["shard"]["pipeline"];
    let stage = tessera_hub::weights::Stage::Layers {
        layers: shard["startLayer"].as_u64().unwrap_or(0) as u32
            ..shard["endLayer"].as_u64().expect("end") as u32,
        n_layers: 30,
    };
    let mut needed = tessera_hub::weights::files_for_stage(&map, &stage);
    needed.insert(shards[0].0.clone());
    needed
}

#[test]
fn a_split_gguf_repository_is_added_from_its_headers_and_placed_over_two_nodes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let repo_name = "acme/SmolLM2-135M-Instruct-GGUF";
    let repo = tmp.path().join("hub").join(repo_name);
    std::fs::create_dir_all(&repo).expect("repo");
    let model = tessera_testkit::default_model_path();
    let hub = LocalHub::start(&tmp.path().join("hub"));
    let ns = "gguf-split";
    let ports = [free_port(), free_port()];
    let env = [("HF_ENDPOINT", hub.endpoint.as_str())];
    let first = Node::start_env(ns, &tmp.path().join("a"), ports[0], &[], &[], &env);
    let second = Node::start_env(ns, &tmp.path().join("b"), ports[1], &[ports[0]], &[], &env);
    wait_until(Duration::from_secs(20), || {
        master_seen(ns, ports[0], None).filter(|(_, n)| *n == 2)
    })
    .expect("a master of two");

    // Shard 1: the metadata and the embedding; 2: the first stage's layers
    // (where placement would cut the same model); 3: the rest.
    let cut = pipeline_cut(ns, ports[0]);
    let stem = "SmolLM2-135M-Instruct.Q4_1";
    let paths = split_gguf(&model, &repo, stem, cut);
    assert_eq!(paths.len(), 3);
    std::fs::write(repo.join("README.md"), "a GGUF repository").expect("readme");
    let shards: Vec<(String, Header)> = paths
        .iter()
        .map(|p| {
            let name = p.file_name().expect("name").to_string_lossy().into_owned();
            (name, gguf::read_header(p).expect("shard header"))
        })
        .collect();
    let weights: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).expect("shard").len())
        .sum();
    let headers: u64 = shards.iter().map(|(_, h)| h.data_offset).sum();

    // No Q4_K_M in the repository: the closest, Q4_1, the split file.
    let added = add(ns, ports[0], &[repo_name]);
    let card = &added["card"];
    let model_id = format!("{repo_name}:Q4_1");
    assert_eq!(card["modelId"], model_id.as_str(), "{added}");
    assert_eq!(card["nLayers"], 30);
    assert_eq!(card["numKeyValueHeads"], 3);
    assert_eq!(card["contextLength"], 8192);
    assert_eq!(card["quantization"], "q4_1");
    assert_eq!(card["storageSizeBytes"], weights.to_string().as_str());
    assert_eq!(card["source"]["files"].as_array().map(Vec::len), Some(3));
    // The card cost the headers only: what the mirror served, all of it.
    let fetched: u64 = added["bytesFetched"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("bytes fetched");
    let served: u64 = shards
        .iter()
        .map(|(name, _)| hub.mirror.stats().served(&format!("{repo_name}/{name}")))
        .sum();
    eprintln!(
        "GGUF card: {fetched} bytes fetched ({headers} bytes of headers in 3 shards; weights {weights} bytes, {:.2}%)",
        100.0 * fetched as f64 / weights as f64
    );
    assert_eq!(fetched, served, "every byte the mirror served is counted");
    // Reads double until a header parses: at most twice the first's, and
    // one first read for each of the later (kilobyte-sized) ones.
    assert!(
        fetched >= headers && fetched <= 2 * headers + 2 * gguf::FIRST_READ,
        "headers only"
    );
    // The API takes a quantization too (Q8_0: the closest is Q4_1 again).
    let body = serde_json::json!({"model": repo_name, "quant": "Q8_0"}).to_string();
    let (status, reply) = http(&first.api, "POST", "/models/add", &body);
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains(&model_id), "{reply}");
    let missing = serde_json::json!({"model": repo_name, "file": "nope.gguf"}).to_string();
    let (status, reply) = http(&first.api, "POST", "/models/add", &missing);
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply.contains(&format!("{stem}-*-of-00003.gguf")),
        "names what there is: {reply}"
    );

    let placed = place(ns, ports[0], &model_id);
    let instance = placed["instanceId"].as_str().expect("id").to_string();
    wait_until(Duration::from_secs(120), || {
        all_ready(ns, ports[0], &instance).then_some(())
    })
    .unwrap_or_else(|| panic!("not ready:\n{}\n{}", first.log(), second.log()));

    // Each node holds the shards its stage needs, joined into one file.
    let folder = tessera_actors::worker::downloads::folder_name(&model_id);
    let mut held = Vec::new();
    for rank in placed["ranks"].as_array().expect("ranks") {
        let node = [&first, &second]
            .into_iter()
            .find(|n| rank["nodeId"] == n.id.as_str())
            .expect("a node of ours");
        let dir = node.dir.join("models").join(&folder);
        let present: BTreeSet<String> = std::fs::read_dir(&dir)
            .expect("model folder")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains("-of-"))
            .collect();
        assert_eq!(
            present,
            shards_of_rank(rank, &shards),
            "rank {}",
            rank["rank"]
        );
        assert!(dir.join(format!("{stem}.joined.gguf")).is_file());
        held.push(present.len());
    }
    assert!(
        held.iter().all(|n| *n < 3),
        "no node needs every shard: {held:?} (cut at {cut}; {placed})"
    );

    let prompt = "The quick brown fox";
    let single = Command::new(BIN)
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--prompt", prompt, "--max-tokens", "16", "--json"])
        .output()
        .expect("generate runs");
    assert!(single.status.success());
    let single: Value = serde_json::from_slice(&single.stdout).expect("JSON");
    let text = admin_generate(ns, ports[1], &instance, prompt).expect("a completion");
    assert_eq!(
        text,
        single["text"].as_str().expect("text"),
        "two nodes over a split GGUF answer as one machine over the whole file"
    );
}
