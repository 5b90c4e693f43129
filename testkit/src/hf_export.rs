//! Turns a Llama-architecture GGUF into a Hugging Face safetensors folder.
//!
//! # Why
//! The engine's tests need a real Hugging Face checkpoint but may only
//! download the small GGUF they already use; dequantizing it gives a genuine
//! HF-layout folder (names, shapes, q/k row order, config) whose values are
//! known exactly, so loaders can be checked against the GGUF path.
//!
//! # Layout subtleties
//! - llama.cpp's converter permutes the rows of `q_proj`/`k_proj` so that
//!   RoPE rotates adjacent pairs; HF rotates the two halves of each head. The
//!   export applies the inverse ([`llama_unpermute_rows`]) so the folder has
//!   the row order `transformers` checkpoints have.
//! - A GGUF without `output.weight` has tied embeddings: no `lm_head.weight`
//!   is written and `tie_word_embeddings` is true.
//! - Tokenizer files are not written; the caller supplies them.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};

use tessera_engine::formats::hf_dir::{HfConfig, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};

/// The dtype the exported safetensors files hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDType {
    F32,
    F16,
    BF16,
}

impl ExportDType {
    fn candle(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
        }
    }

    fn bytes(self) -> usize {
        self.candle().size_in_bytes()
    }

    /// The `torch_dtype` string `transformers` writes for this dtype.
    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
        }
    }
}

/// Why an export failed; every message names the file involved.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot access {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read GGUF {}: {message}", path.display())]
    Gguf { path: PathBuf, message: String },
    #[error("GGUF {}: metadata {key}: {message}", path.display())]
    Metadata {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("GGUF {}: tensor {name}: {message}", path.display())]
    Tensor {
        path: PathBuf,
        name: String,
        message: String,
    },
    #[error("cannot write {}: {message}", path.display())]
    Write { path: PathBuf, message: String },
    #[error("cannot split {tensors} tensors into {shards} shards (need 1..={tensors})")]
    BadShardCount { shards: usize, tensors: usize },
}

/// How a GGUF tensor must be re-ordered on its way to HF layout.
#[derive(Clone, Copy, Debug)]
enum Fix {
    None,
    /// Undo llama.cpp's RoPE row permutation with this many heads.
    Unpermute(usize),
}

/// One tensor to write.
struct Planned {
    gguf: String,
    hf: String,
    shape: Vec<usize>,
    fix: Fix,
}

/// llama.cpp's `permute(w, n_head)` on the rows of a row-major
/// `[rows, cols]` matrix: HF row `head*hd + half*(hd/2) + i` moves to row
/// `head*hd + 2*i + half`. A plain reference implementation, exposed so
/// tests (here and in the engine) can re-permute an export and compare it
/// with the GGUF.
pub fn llama_permute_rows(
    w: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Result<Vec<f32>, String> {
    reorder_rows(w, rows, cols, n_head, true)
}

/// The inverse of [`llama_permute_rows`]: GGUF row `head*hd + 2*i + half`
/// moves to HF row `head*hd + half*(hd/2) + i`.
pub fn llama_unpermute_rows(
    w: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Result<Vec<f32>, String> {
    reorder_rows(w, rows, cols, n_head, false)
}

fn reorder_rows(
    w: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
    to_gguf: bool,
) -> Result<Vec<f32>, String> {
    if w.len() != rows * cols {
        return Err(format!("{} values for a {rows}x{cols} matrix", w.len()));
    }
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(format!(
            "{rows} rows do not split into {n_head} heads of even size"
        ));
    }
    let hd = rows / n_head;
    let half_hd = hd / 2;
    let mut out = vec![0.0f32; w.len()];
    for head in 0..n_head {
        for i in 0..half_hd {
            for half in 0..2 {
                let gguf = head * hd + 2 * i + half;
                let hf = head * hd + half * half_hd + i;
                let (src, dst) = if to_gguf { (hf, gguf) } else { (gguf, hf) };
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// Maps a GGUF tensor name to its HF name, its order key in the HF
/// checkpoint (embeddings, layers in numeric order, final norm, head), and,
/// for q/k, which head count llama.cpp permuted its rows with.
fn hf_name(gguf: &str) -> Option<(String, (u8, usize), Option<Heads>)> {
    match gguf {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), (0, 0), None)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), (2, 0), None)),
        "output.weight" => return Some(("lm_head.weight".into(), (3, 0), None)),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (suffix, heads) = match part {
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(Heads::Query)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(Heads::KeyValue)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{suffix}"), (1, layer), heads))
}

/// Which head count a permuted projection was permuted with.
#[derive(Clone, Copy, Debug)]
enum Heads {
    Query,
    KeyValue,
}

/// Dequantizes a Llama-architecture GGUF into a Hugging Face folder:
/// `config.json`, `generation_config.json` (bos/eos), and the weights in
/// `shards` safetensors files (`model-0000i-of-0000N.safetensors` plus
/// `model.safetensors.index.json` when `shards > 1`, else
/// `model.safetensors`). Shards are contiguous in checkpoint order and
/// balanced by bytes; only one shard's tensors are held in memory at a time.
/// Tokenizer files are not written. A weight file of the other layout left
/// in `out_dir` by an earlier export (`model.safetensors` vs. the index) is
/// removed, since a loader would otherwise pick the stale one. Returns the
/// config written.
pub fn export_llama_gguf(
    gguf: &Path,
    out_dir: &Path,
    dtype: ExportDType,
    shards: usize,
) -> Result<HfConfig, ExportError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ExportError::Io { path, source }
    };
    let gguf_err = |message: String| ExportError::Gguf {
        path: gguf.to_path_buf(),
        message,
    };
    let mut reader = BufReader::new(File::open(gguf).map_err(io(gguf))?);
    let content = Content::read(&mut reader).map_err(|e| gguf_err(e.to_string()))?;
    let meta = Meta {
        path: gguf,
        md: &content.metadata,
    };

    let arch = meta.string("general.architecture")?;
    if arch != "llama" {
        return Err(meta.error(
            "general.architecture",
            format!("architecture {arch:?} is not llama"),
        ));
    }
    if meta.opt_usize("llama.expert_count")?.unwrap_or(0) > 0 {
        // The export writes a dense Llama; experts would be dropped.
        return Err(meta.error(
            "llama.expert_count",
            "is set: a mixture of experts (Mixtral) is not exported".into(),
        ));
    }
    let heads = meta.usize("llama.attention.head_count")?;
    let kv_heads = meta
        .opt_usize("llama.attention.head_count_kv")?
        .unwrap_or(heads);
    let hidden = meta.usize("llama.embedding_length")?;
    let head_dim = match meta.opt_usize("llama.attention.key_length")? {
        Some(d) => d,
        None => match meta.opt_usize("llama.rope.dimension_count")? {
            Some(d) => d,
            None => hidden.checked_div(heads).unwrap_or(0),
        },
    };

    // Plan every tensor first (names, shapes, order) from the header alone.
    let mut plan = Vec::new();
    for (name, info) in &content.tensor_infos {
        let Some((hf, key, heads_kind)) = hf_name(name) else {
            return Err(ExportError::Tensor {
                path: gguf.to_path_buf(),
                name: name.clone(),
                message: "no Hugging Face Llama equivalent (unsupported GGUF tensor)".into(),
            });
        };
        let fix = match heads_kind {
            Some(Heads::Query) => Fix::Unpermute(heads),
            Some(Heads::KeyValue) => Fix::Unpermute(kv_heads),
            None => Fix::None,
        };
        plan.push((
            key,
            Planned {
                gguf: name.clone(),
                hf,
                shape: info.shape.dims().to_vec(),
                fix,
            },
        ));
    }
    plan.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.hf.cmp(&b.1.hf)));
    let plan: Vec<Planned> = plan.into_iter().map(|(_, p)| p).collect();

    let tied = !plan.iter().any(|p| p.hf == "lm_head.weight");
    let embd_rows = plan
        .iter()
        .find(|p| p.hf == "model.embed_tokens.weight")
        .and_then(|p| p.shape.first().copied());
    let vocab_size = match meta.opt_usize("llama.vocab_size")? {
        Some(v) => v,
        None => match content.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(tokens)) => tokens.len(),
            _ => embd_rows.ok_or_else(|| {
                meta.error(
                    "llama.vocab_size",
                    "absent, and no tokens nor embeddings".into(),
                )
            })?,
        },
    };

    let config = HfConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        hidden_size: hidden,
        intermediate_size: meta.usize("llama.feed_forward_length")?,
        num_hidden_layers: meta.usize("llama.block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: Some(head_dim),
        rms_norm_eps: meta.f64("llama.attention.layer_norm_rms_epsilon")?,
        rope_theta: Some(meta.opt_f64("llama.rope.freq_base")?.unwrap_or(10_000.0)),
        rope_scaling: None,
        rope_parameters: None,
        sliding_window: None,
        use_sliding_window: None,
        hidden_act: Some("silu".into()),
        max_position_embeddings: meta.opt_usize("llama.context_length")?,
        vocab_size,
        tie_word_embeddings: Some(tied),
        attention_bias: Some(false),
        torch_dtype: Some(dtype.torch_name().into()),
        num_experts: None,
        num_local_experts: None,
        num_experts_per_tok: None,
        moe_intermediate_size: None,
        norm_topk_prob: None,
        decoder_sparse_step: None,
        mlp_only_layers: None,
        shared_expert_intermediate_size: None,
        bos_token_id: meta
            .opt_usize("tokenizer.ggml.bos_token_id")?
            .map(serde_json::Value::from),
        eos_token_id: meta
            .opt_usize("tokenizer.ggml.eos_token_id")?
            .map(serde_json::Value::from),
        ..HfConfig::default()
    };

    let groups = split_shards(&plan, shards, dtype.bytes())?;
    std::fs::create_dir_all(out_dir).map_err(io(out_dir))?;
    let stale = out_dir.join(if shards == 1 { INDEX_FILE } else { SINGLE_FILE });
    if stale.is_file() {
        std::fs::remove_file(&stale).map_err(io(&stale))?;
    }
    let file_names: Vec<String> = if shards == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=shards)
            .map(|i| format!("model-{i:05}-of-{shards:05}.safetensors"))
            .collect()
    };

    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0usize;
    for (group, file_name) in groups.iter().zip(&file_names) {
        let mut tensors: Vec<(String, Tensor)> = Vec::with_capacity(group.len());
        for p in group {
            let tensor = dequantize(&content, &mut reader, gguf, p, dtype)?;
            total_size += p.shape.iter().product::<usize>() * dtype.bytes();
            weight_map.insert(p.hf.clone(), serde_json::Value::from(file_name.clone()));
            tensors.push((p.hf.clone(), tensor));
        }
        let path = out_dir.join(file_name);
        let format = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(tensors, Some(format), &path).map_err(|e| {
            ExportError::Write {
                path: path.clone(),
                message: e.to_string(),
            }
        })?;
    }
    if shards > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        write_json(&out_dir.join(INDEX_FILE), &index)?;
    }
    let config_json = serde_json::to_value(&config).map_err(|e| ExportError::Write {
        path: out_dir.join(CONFIG_FILE),
        message: e.to_string(),
    })?;
    write_json(&out_dir.join(CONFIG_FILE), &config_json)?;
    let mut generation = serde_json::Map::new();
    if let Some(b) = &config.bos_token_id {
        generation.insert("bos_token_id".into(), b.clone());
    }
    if let Some(e) = &config.eos_token_id {
        generation.insert("eos_token_id".into(), e.clone());
    }
    write_json(
        &out_dir.join("generation_config.json"),
        &serde_json::Value::Object(generation),
    )?;
    Ok(config)
}

/// Splits the planned tensors (in order) into `shards` contiguous, non-empty
/// groups of roughly equal byte size.
fn split_shards(
    plan: &[Planned],
    shards: usize,
    elem_bytes: usize,
) -> Result<Vec<Vec<&Planned>>, ExportError> {
    if shards == 0 || shards > plan.len() {
        return Err(ExportError::BadShardCount {
            shards,
            tensors: plan.len(),
        });
    }
    let size = |p: &Planned| p.shape.iter().product::<usize>() * elem_bytes;
    let total: usize = plan.iter().map(size).sum();
    let mut groups: Vec<Vec<&Planned>> = vec![Vec::new(); shards];
    let mut current = 0;
    let mut acc = 0usize;
    for (i, p) in plan.iter().enumerate() {
        let left = plan.len() - i;
        let shards_after = shards - 1 - current;
        // Move on once this shard has its share, or when every remaining
        // shard needs one of the remaining tensors to be non-empty.
        let full = acc * shards >= total * (current + 1);
        if shards_after > 0 && !groups[current].is_empty() && (full || left == shards_after) {
            current += 1;
        }
        groups[current].push(p);
        acc += size(p);
    }
    Ok(groups)
}

/// Dequantizes one GGUF tensor into HF row order and the export dtype.
/// Everything stays in candle tensor ops, which are compiled optimised even
/// in dev builds: the same work in plain loops here takes ~10x longer in
/// unoptimised test builds. Serializing relies on candle's
/// `safetensors::View` for `Tensor`, whose byte conversion cannot fail for a
/// CPU tensor of a float dtype.
fn dequantize(
    content: &Content,
    reader: &mut BufReader<File>,
    gguf: &Path,
    p: &Planned,
    dtype: ExportDType,
) -> Result<Tensor, ExportError> {
    let err = |message: String| ExportError::Tensor {
        path: gguf.to_path_buf(),
        name: p.gguf.clone(),
        message,
    };
    let tensor = content
        .tensor(reader, &p.gguf, &Device::Cpu)
        .and_then(|q| q.dequantize(&Device::Cpu))
        .map_err(|e| err(e.to_string()))?;
    let tensor = match p.fix {
        Fix::None => tensor,
        Fix::Unpermute(n_head) => unpermute_tensor(&tensor, n_head).map_err(err)?,
    };
    tensor
        .to_dtype(dtype.candle())
        .and_then(|t| t.contiguous())
        .map_err(|e| err(e.to_string()))
}

/// [`llama_unpermute_rows`] as tensor ops: GGUF rows viewed as
/// `[n_head, hd/2, 2, cols]` are transposed to `[n_head, 2, hd/2, cols]`.
fn unpermute_tensor(t: &Tensor, n_head: usize) -> Result<Tensor, String> {
    let &[rows, cols] = t.dims() else {
        return Err(format!("expected a matrix, got shape {:?}", t.dims()));
    };
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(format!(
            "{rows} rows do not split into {n_head} heads of even size"
        ));
    }
    let half_hd = rows / n_head / 2;
    t.reshape((n_head, half_hd, 2, cols))
        .and_then(|t| t.transpose(1, 2))
        .and_then(|t| t.contiguous())
        .and_then(|t| t.reshape((rows, cols)))
        .map_err(|e| e.to_string())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), ExportError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ExportError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|source| ExportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Typed access to GGUF metadata with errors naming the file and key.
struct Meta<'a> {
    path: &'a Path,
    md: &'a HashMap<String, Value>,
}

impl Meta<'_> {
    fn error(&self, key: &str, message: String) -> ExportError {
        ExportError::Metadata {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            message,
        }
    }

    fn string(&self, key: &str) -> Result<&str, ExportError> {
        match self.md.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(self.error(key, format!("expected a string, got {other:?}"))),
            None => Err(self.error(key, "missing".into())),
        }
    }

    /// Any non-negative integer type (writers differ: u32, u64, i32).
    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ExportError> {
        let Some(v) = self.md.get(key) else {
            return Ok(None);
        };
        let n: Option<u64> = match v {
            Value::U8(x) => Some(u64::from(*x)),
            Value::U16(x) => Some(u64::from(*x)),
            Value::U32(x) => Some(u64::from(*x)),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.error(key, format!("expected a non-negative integer, got {v:?}")))
    }

    fn usize(&self, key: &str) -> Result<usize, ExportError> {
        self.opt_usize(key)?
            .ok_or_else(|| self.error(key, "missing".into()))
    }

    /// GGUF stores these as f32; widening 1e-5f32 directly gives
    /// 1.0000000116860974e-5, so go through the shortest decimal form to
    /// get the value the original config.json had.
    fn opt_f64(&self, key: &str) -> Result<Option<f64>, ExportError> {
        match self.md.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(x.to_string().parse().unwrap_or(f64::from(*x)))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(other) => Err(self.error(key, format!("expected a float, got {other:?}"))),
        }
    }

    fn f64(&self, key: &str) -> Result<f64, ExportError> {
        self.opt_f64(key)?
            .ok_or_else(|| self.error(key, "missing".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use tessera_engine::formats::hf_dir::{HfDirError, HfModelDir};

    /// The test GGUF: `TESSERA_TEST_MODEL`, else under `$TESSERA_HOME`, else
    /// under `$HOME/.tessera`. Missing is a failure, never a skip, so CI
    /// cannot silently pass without exercising the loader.
    fn test_model() -> PathBuf {
        crate::default_model_path()
    }

    /// One GGUF tensor dequantized to f32 (GGUF row order) and its shape.
    fn gguf_tensor(path: &Path, name: &str) -> (Vec<f32>, Vec<usize>) {
        let mut reader = BufReader::new(File::open(path).unwrap());
        let content = Content::read(&mut reader).unwrap();
        let t = content
            .tensor(&mut reader, name, &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        let shape = t.dims().to_vec();
        (t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), shape)
    }

    /// Every HF tensor SmolLM2-135M must have, with its shape.
    fn expected_tensors() -> Vec<(String, Vec<usize>)> {
        let mut v = vec![
            ("model.embed_tokens.weight".to_string(), vec![49152, 576]),
            ("model.norm.weight".to_string(), vec![576]),
        ];
        for l in 0..30 {
            let p = format!("model.layers.{l}");
            v.push((format!("{p}.self_attn.q_proj.weight"), vec![576, 576]));
            v.push((format!("{p}.self_attn.k_proj.weight"), vec![192, 576]));
            v.push((format!("{p}.self_attn.v_proj.weight"), vec![192, 576]));
            v.push((format!("{p}.self_attn.o_proj.weight"), vec![576, 576]));
            v.push((format!("{p}.mlp.gate_proj.weight"), vec![1536, 576]));
            v.push((format!("{p}.mlp.up_proj.weight"), vec![1536, 576]));
            v.push((format!("{p}.mlp.down_proj.weight"), vec![576, 1536]));
            v.push((format!("{p}.input_layernorm.weight"), vec![576]));
            v.push((format!("{p}.post_attention_layernorm.weight"), vec![576]));
        }
        v
    }

    /// `got` within `rel` relative error (plus `abs` for tiny values) of `want`.
    fn assert_close(got: &[f32], want: &[f32], rel: f32, abs: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= w.abs() * rel + abs,
                "{what}[{i}]: got {g}, want {w}"
            );
        }
    }

    const BF16_REL: f32 = 1.0 / 256.0;

    #[test]
    fn permute_and_unpermute_are_inverse_and_match_the_formula() {
        // 2 heads of dim 4, 3 columns; row r holds value r in every column.
        let rows = 8;
        let cols = 3;
        let hf: Vec<f32> = (0..rows * cols).map(|i| (i / cols) as f32).collect();
        let gguf = llama_permute_rows(&hf, rows, cols, 2).unwrap();
        // GGUF row head*hd + 2*i + half == HF row head*hd + half*hd/2 + i.
        let gguf_rows: Vec<f32> = (0..rows).map(|r| gguf[r * cols]).collect();
        assert_eq!(gguf_rows, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(llama_unpermute_rows(&gguf, rows, cols, 2).unwrap(), hf);
        let t = Tensor::from_slice(&gguf, (rows, cols), &Device::Cpu).unwrap();
        let via_candle = unpermute_tensor(&t, 2).unwrap();
        assert_eq!(
            via_candle.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            hf
        );
        assert!(unpermute_tensor(&t, 3).is_err());
        assert!(llama_unpermute_rows(&gguf, rows, cols, 3).is_err());
        assert!(llama_unpermute_rows(&gguf, rows, cols, 0).is_err());
        assert!(llama_unpermute_rows(&gguf[1..], rows, cols, 2).is_err());
    }

    #[test]
    fn shard_split_is_contiguous_balanced_and_non_empty() {
        let plan: Vec<Planned> = [10usize, 1, 1, 1, 10, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| Planned {
                gguf: format!("t{i}"),
                hf: format!("t{i}"),
                shape: vec![n],
                fix: Fix::None,
            })
            .collect();
        for shards in 1..=plan.len() {
            let groups = split_shards(&plan, shards, 2).unwrap();
            assert_eq!(groups.len(), shards);
            assert!(groups.iter().all(|g| !g.is_empty()), "{shards}");
            let order: Vec<&str> = groups.iter().flatten().map(|p| p.hf.as_str()).collect();
            assert_eq!(order, vec!["t0", "t1", "t2", "t3", "t4", "t5"]);
        }
        let groups = split_shards(&plan, 2, 2).unwrap();
        assert_eq!(
            groups[0].len(),
            3,
            "first shard stops once it holds half the bytes"
        );
        assert!(matches!(
            split_shards(&plan, 0, 2),
            Err(ExportError::BadShardCount { .. })
        ));
        assert!(matches!(
            split_shards(&plan, 7, 2),
            Err(ExportError::BadShardCount { .. })
        ));
    }

    #[test]
    fn export_refuses_zero_shards_and_a_missing_gguf() {
        let model = test_model();
        let tmp = tempfile::tempdir().unwrap();
        let e = export_llama_gguf(&model, tmp.path(), ExportDType::BF16, 0).unwrap_err();
        assert!(matches!(e, ExportError::BadShardCount { .. }), "{e:?}");
        let missing = tmp.path().join("nope.gguf");
        let e = export_llama_gguf(&missing, tmp.path(), ExportDType::BF16, 1).unwrap_err();
        assert!(e.to_string().contains("nope.gguf"), "{e}");
    }

    /// The main check: a 3-shard bf16 export opens as a genuine HF folder.
    #[test]
    fn bf16_three_shard_export_round_trips() {
        let model = test_model();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("hf");
        let written = export_llama_gguf(&model, &dir, ExportDType::BF16, 3).unwrap();

        // Files: three shards + index + configs, no single file.
        for f in [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            INDEX_FILE,
            CONFIG_FILE,
            "generation_config.json",
        ] {
            assert!(dir.join(f).is_file(), "{f}");
        }
        assert!(!dir.join(SINGLE_FILE).exists());

        let m = HfModelDir::open(&dir).unwrap();
        let c = m.config();
        assert_eq!(c, &written);
        assert_eq!(c.architectures, vec!["LlamaForCausalLM".to_string()]);
        assert_eq!(c.model_type, "llama");
        assert_eq!(c.hidden_size, 576);
        assert_eq!(c.intermediate_size, 1536);
        assert_eq!(c.num_hidden_layers, 30);
        assert_eq!(c.num_attention_heads, 9);
        assert_eq!(c.num_key_value_heads, Some(3));
        assert_eq!(c.head_dim, Some(64));
        assert_eq!(c.vocab_size, 49152);
        assert_eq!(c.tie_word_embeddings, Some(true));
        assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert!(c.rope_theta.is_some_and(|t| t > 0.0));
        assert!(c.max_position_embeddings.is_some_and(|n| n >= 2048));
        assert!(c.bos_token_id.is_some() && c.eos_token_id.is_some());
        let generation: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("generation_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            generation["eos_token_id"],
            *c.eos_token_id.as_ref().unwrap()
        );

        // Every tensor, with its shape, and nothing else (tied: no lm_head).
        let expected = expected_tensors();
        for (name, shape) in &expected {
            assert_eq!(&m.shape(name).unwrap(), shape, "{name}");
        }
        assert_eq!(m.tensor_names().count(), expected.len());
        assert!(!m.contains("lm_head.weight"));

        // q/k: re-permuting the HF rows gives back the GGUF rows, and the
        // export really did reorder them.
        for (layer, proj, gguf_name, heads) in [
            (0, "q_proj", "attn_q", 9),
            (29, "q_proj", "attn_q", 9),
            (0, "k_proj", "attn_k", 3),
        ] {
            let hf_name = format!("model.layers.{layer}.self_attn.{proj}.weight");
            let hf = m.load_f32(&hf_name).unwrap();
            let (gguf, shape) = gguf_tensor(&model, &format!("blk.{layer}.{gguf_name}.weight"));
            assert_eq!(m.shape(&hf_name).unwrap(), shape);
            let repermuted = llama_permute_rows(&hf, shape[0], shape[1], heads).unwrap();
            assert_close(&repermuted, &gguf, BF16_REL, 1e-30, &hf_name);
            let differs = hf
                .iter()
                .zip(&gguf)
                .any(|(a, b)| (a - b).abs() > b.abs() * BF16_REL + 1e-6);
            assert!(differs, "{hf_name} was not un-permuted");
        }
        // A tensor that is not permuted matches directly.
        let (gguf, _) = gguf_tensor(&model, "blk.3.ffn_down.weight");
        let hf = m.load_f32("model.layers.3.mlp.down_proj.weight").unwrap();
        assert_close(&hf, &gguf, BF16_REL, 1e-30, "down_proj");

        // Row and column slices equal slices of the full tensor.
        let name = "model.layers.5.self_attn.o_proj.weight";
        let full = m.load_f32(name).unwrap();
        assert_eq!(
            m.load_f32_rows(name, 64, 192).unwrap(),
            full[64 * 576..192 * 576]
        );
        let cols = m.load_f32_cols(name, 128, 256).unwrap();
        let want: Vec<f32> = full
            .chunks_exact(576)
            .flat_map(|row| row[128..256].iter().copied())
            .collect();
        assert_eq!(cols, want);
        let norm = m.load_f32("model.layers.5.input_layernorm.weight").unwrap();
        assert_eq!(
            m.load_f32_rows("model.layers.5.input_layernorm.weight", 10, 20)
                .unwrap(),
            norm[10..20]
        );

        // files_for: the embeddings open the first shard, the final norm is
        // in the last, and everything spans all three.
        let first = m.files_for(["model.embed_tokens.weight"]).unwrap();
        assert_eq!(
            first,
            BTreeSet::from([PathBuf::from("model-00001-of-00003.safetensors")])
        );
        let last = m.files_for(["model.norm.weight"]).unwrap();
        assert_eq!(
            last,
            BTreeSet::from([PathBuf::from("model-00003-of-00003.safetensors")])
        );
        let all = m
            .files_for(expected.iter().map(|(n, _)| n.as_str()))
            .unwrap();
        assert_eq!(all.len(), 3);
        let one_layer: Vec<String> = expected
            .iter()
            .filter(|(n, _)| n.starts_with("model.layers.12."))
            .map(|(n, _)| n.clone())
            .collect();
        let files = m.files_for(one_layer.iter().map(String::as_str)).unwrap();
        assert!(!files.is_empty() && files.len() <= 2);
        for f in &files {
            assert!(dir.join(f).is_file());
        }

        // Unknown tensor.
        let e = m
            .load_f32("model.layers.30.mlp.up_proj.weight")
            .unwrap_err();
        assert!(matches!(e, HfDirError::TensorNotFound { .. }), "{e:?}");
        assert!(e.to_string().contains("model.layers.30.mlp.up_proj.weight"));

        // An index naming shards that are not there (a partial download).
        let partial = tmp.path().join("partial");
        std::fs::create_dir(&partial).unwrap();
        std::fs::copy(dir.join(INDEX_FILE), partial.join(INDEX_FILE)).unwrap();
        let e = HfModelDir::open(&partial).unwrap_err();
        assert!(matches!(e, HfDirError::MissingConfig { .. }), "{e:?}");
        assert!(e.to_string().contains("config.json"), "{e}");
        std::fs::copy(dir.join(CONFIG_FILE), partial.join(CONFIG_FILE)).unwrap();
        let opened = HfModelDir::open(&partial).expect("opens: files are read on demand");
        let e = opened.shape("model.embed_tokens.weight").unwrap_err();
        assert!(matches!(e, HfDirError::MissingWeightFile { .. }), "{e:?}");
        assert!(e.to_string().contains("-of-00003.safetensors"), "{e}");
    }

    #[test]
    fn f16_single_file_export_then_truncation_is_reported() {
        let model = test_model();
        let tmp = tempfile::tempdir().unwrap();
        let c = export_llama_gguf(&model, tmp.path(), ExportDType::F16, 1).unwrap();
        assert_eq!(c.torch_dtype.as_deref(), Some("float16"));
        assert!(tmp.path().join(SINGLE_FILE).is_file());
        assert!(!tmp.path().join(INDEX_FILE).exists());

        let m = HfModelDir::open(tmp.path()).unwrap();
        assert_eq!(m.tensor_names().count(), expected_tensors().len());
        let (gguf, _) = gguf_tensor(&model, "blk.7.ffn_gate.weight");
        let hf = m.load_f32("model.layers.7.mlp.gate_proj.weight").unwrap();
        assert_close(&hf, &gguf, 1.0 / 1024.0, 6e-8, "gate_proj");
        let (gguf, _) = gguf_tensor(&model, "blk.7.attn_k.weight");
        let hf = m
            .load_f32("model.layers.7.self_attn.k_proj.weight")
            .unwrap();
        let repermuted = llama_permute_rows(&hf, 192, 576, 3).unwrap();
        assert_close(&repermuted, &gguf, 1.0 / 1024.0, 6e-8, "k_proj");
        assert_eq!(
            m.files_for(["model.norm.weight", "model.embed_tokens.weight"])
                .unwrap(),
            BTreeSet::from([PathBuf::from(SINGLE_FILE)])
        );
        drop(m);

        // Cut the file in half, as an interrupted download would.
        let path = tmp.path().join(SINGLE_FILE);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let e = HfModelDir::open(tmp.path()).unwrap_err();
        assert!(matches!(e, HfDirError::Truncated { .. }), "{e:?}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    }

    #[test]
    fn f32_single_file_export_is_exact() {
        let model = test_model();
        let tmp = tempfile::tempdir().unwrap();
        let c = export_llama_gguf(&model, tmp.path(), ExportDType::F32, 1).unwrap();
        assert_eq!(c.torch_dtype.as_deref(), Some("float32"));
        let m = HfModelDir::open(tmp.path()).unwrap();
        for (gguf_name, hf_name) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            (
                "blk.2.attn_v.weight",
                "model.layers.2.self_attn.v_proj.weight",
            ),
            (
                "blk.2.ffn_norm.weight",
                "model.layers.2.post_attention_layernorm.weight",
            ),
        ] {
            let (gguf, _) = gguf_tensor(&model, gguf_name);
            assert_eq!(m.load_f32(hf_name).unwrap(), gguf, "{hf_name}");
        }
        let (gguf, _) = gguf_tensor(&model, "blk.2.attn_q.weight");
        let hf = m
            .load_f32("model.layers.2.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(llama_permute_rows(&hf, 576, 576, 9).unwrap(), gguf);
    }
}
