//! Which files of a Hugging Face checkpoint (or a split GGUF) a node needs.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// The index of a sharded safetensors checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The weights of an unsharded one.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Files every node needs besides the weights: the config, the tokenizer,
/// the chat template and (embedding models) the sentence-transformers
/// modules, in whichever of their forms the repository has.
pub const SUPPORT_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    INDEX_FILE,
    // A sentence-transformers model's modules (an embedding model).
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
];

/// The part of the model a node holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Every layer (a whole model, or a tensor-parallel rank, which holds a
    /// slice of every tensor).
    Whole,
    /// Layers `layers` of `n_layers`.
    Layers { layers: Range<u32>, n_layers: u32 },
}

/// Why an index cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{INDEX_FILE}: {0}")]
pub struct IndexError(String);

/// The tensor → file map of `model.safetensors.index.json`.
pub fn parse_index(json: &[u8]) -> Result<BTreeMap<String, String>, IndexError> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let index: Index = serde_json::from_slice(json).map_err(|e| IndexError(e.to_string()))?;
    if index.weight_map.is_empty() {
        return Err(IndexError("the weight map is empty".into()));
    }
    Ok(index.weight_map)
}

/// The layer a tensor belongs to (`model.layers.7.mlp.up_proj.weight`, or
/// GGUF's `blk.7.ffn_up.weight` → 7).
fn layer_of(tensor: &str) -> Option<u32> {
    let rest = match tensor.strip_prefix("blk.") {
        Some(rest) => rest,
        None => tensor.split_once(".layers.")?.1,
    };
    rest.split('.').next()?.parse().ok()
}

/// Tensors the engine never reads, so no stage downloads them: an
/// image-text checkpoint's vision tower and projector (Qwen3.5, Gemma 3,
/// LLaVA) and a multi-token-prediction head (Qwen3.5, Qwen3-Next).
const UNREAD_PREFIXES: [&str; 7] = [
    "mtp.",
    "model.visual.",
    "visual.",
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
];

/// Whether `stage` loads the (non-layer) tensor `tensor`: the embedding and
/// the LM head on the first stage (which samples; a tied head is the
/// embedding), the final norm on the last; unknown non-layer tensors always.
fn stage_needs(tensor: &str, stage: &Stage) -> bool {
    if UNREAD_PREFIXES.iter().any(|p| tensor.starts_with(p)) {
        return false;
    }
    let (first, last) = match stage {
        Stage::Whole => return true,
        Stage::Layers { layers, n_layers } => (layers.start == 0, layers.end >= *n_layers),
    };
    if let Some(layer) = layer_of(tensor) {
        return matches!(stage, Stage::Layers { layers, .. } if layers.contains(&layer));
    }
    // Safetensors names, and GGUF's (`token_embd`, `output`, `output_norm`).
    if tensor.contains("embed_tokens")
        || tensor.starts_with("token_embd.")
        || tensor.starts_with("lm_head")
        || tensor.starts_with("output.")
    {
        first
    } else if tensor.ends_with(".norm.weight") || tensor.starts_with("output_norm") {
        last
    } else {
        true
    }
}

/// The weight files (as named in the index) that hold the tensors `stage`
/// loads.
pub fn files_for_stage(weight_map: &BTreeMap<String, String>, stage: &Stage) -> BTreeSet<String> {
    weight_map
        .iter()
        .filter(|(tensor, _)| stage_needs(tensor, stage))
        .map(|(_, file)| file.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four layers over three files: embedding + layer 0 in the first,
    /// layers 1-2 in the second, layer 3 + norm (+ head) in the third.
    fn map(with_head: bool) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        let mut put = |t: &str, f: &str| {
            m.insert(t.to_string(), f.to_string());
        };
        put("model.embed_tokens.weight", "a");
        put("model.layers.0.mlp.up_proj.weight", "a");
        put("model.layers.1.mlp.up_proj.weight", "b");
        put("model.layers.2.self_attn.q_proj.weight", "b");
        put("model.layers.3.input_layernorm.weight", "c");
        put("model.norm.weight", "c");
        if with_head {
            put("lm_head.weight", "c");
        }
        m
    }

    fn names(set: BTreeSet<String>) -> Vec<String> {
        set.into_iter().collect()
    }

    #[test]
    fn pipeline_stages_take_only_their_files() {
        let m = map(true);
        let stage = |start, end| Stage::Layers {
            layers: start..end,
            n_layers: 4,
        };
        // The first stage also holds the head, here in the last file.
        assert_eq!(names(files_for_stage(&m, &stage(0, 1))), ["a", "c"]);
        assert_eq!(names(files_for_stage(&m, &stage(1, 3))), ["b"]);
        assert_eq!(names(files_for_stage(&m, &stage(3, 4))), ["c"]);
        assert_eq!(names(files_for_stage(&m, &stage(0, 2))), ["a", "b", "c"]);
        assert_eq!(names(files_for_stage(&m, &Stage::Whole)), ["a", "b", "c"]);
    }

    #[test]
    fn a_tied_head_leaves_the_last_stage_only_its_layers_and_the_norm() {
        let m = map(false);
        let stage = |start, end| Stage::Layers {
            layers: start..end,
            n_layers: 4,
        };
        assert_eq!(names(files_for_stage(&m, &stage(0, 1))), ["a"]);
        assert_eq!(names(files_for_stage(&m, &stage(3, 4))), ["c"]);
    }

    #[test]
    fn gguf_tensor_names_are_placed_too() {
        let mut m = BTreeMap::new();
        for (t, f) in [
            ("token_embd.weight", "s1"),
            ("blk.0.attn_q.weight", "s1"),
            ("blk.1.attn_q.weight", "s2"),
            ("output_norm.weight", "s3"),
            ("rope_freqs.weight", "s1"),
        ] {
            m.insert(t.to_string(), f.to_string());
        }
        let stage = |start, end| Stage::Layers {
            layers: start..end,
            n_layers: 2,
        };
        assert_eq!(names(files_for_stage(&m, &stage(0, 1))), ["s1"]);
        // The last stage: its layer, the norm, and rope_freqs (a tensor of
        // no layer) wherever it is.
        assert_eq!(names(files_for_stage(&m, &stage(1, 2))), ["s1", "s2", "s3"]);
        m.remove("rope_freqs.weight");
        assert_eq!(names(files_for_stage(&m, &stage(1, 2))), ["s2", "s3"]);
    }

    /// A multimodal release (Qwen3.5's layout): the language model under
    /// `model.language_model.`, a vision tower and a multi-token-prediction
    /// head in files of their own that no stage downloads; the stages
    /// split the language model's layers as usual.
    #[test]
    fn vision_and_prediction_heads_are_never_downloaded() {
        let mut m = BTreeMap::new();
        for (t, f) in [
            ("model.language_model.embed_tokens.weight", "a"),
            (
                "model.language_model.layers.0.mlp.experts.gate_up_proj",
                "a",
            ),
            ("model.language_model.layers.1.mlp.experts.down_proj", "b"),
            ("model.language_model.norm.weight", "b"),
            ("lm_head.weight", "b"),
            ("model.visual.blocks.0.attn.qkv.weight", "v"),
            ("mtp.layers.0.mlp.experts.down_proj", "v"),
            ("mtp.fc.weight", "v"),
        ] {
            m.insert(t.to_string(), f.to_string());
        }
        let stage = |start, end| Stage::Layers {
            layers: start..end,
            n_layers: 2,
        };
        assert_eq!(names(files_for_stage(&m, &Stage::Whole)), ["a", "b"]);
        // The first stage: the embedding, layer 0 and the head.
        assert_eq!(names(files_for_stage(&m, &stage(0, 1))), ["a", "b"]);
        assert_eq!(names(files_for_stage(&m, &stage(1, 2))), ["b"]);
    }

    #[test]
    fn the_index_must_have_a_weight_map() {
        assert!(parse_index(br#"{"weight_map": {"x": "a"}}"#).is_ok());
        assert!(parse_index(br#"{"weight_map": {}}"#).is_err());
        assert!(parse_index(b"not json").is_err());
    }
}
