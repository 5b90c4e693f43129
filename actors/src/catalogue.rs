//! The model cards this build knows (`resources/model_cards/*.toml`,
//! compiled in), as the wire type placement uses.

use serde::Deserialize;
use tessera_protos::v1::{self, ModelCard, ModelSource};

/// Every card shipped in `resources/model_cards/`.
const CARDS: &[&str] = &[include_str!(
    "../../resources/model_cards/smollm2-135m-instruct-q4_1.toml"
)];

#[derive(Deserialize)]
struct CardFile {
    model_id: String,
    family: String,
    quantization: String,
    base_model: String,
    n_layers: u32,
    hidden_size: u32,
    num_attention_heads: u32,
    num_key_value_heads: u32,
    context_length: u32,
    supports_tensor: bool,
    #[serde(default)]
    capabilities: Vec<String>,
    storage_size: StorageSize,
    source: SourceFile,
}

#[derive(Deserialize)]
struct StorageSize {
    in_bytes: u64,
}

#[derive(Deserialize)]
struct SourceFile {
    format: String,
    #[serde(default)]
    hub_repo: String,
    #[serde(default)]
    files: Vec<FileEntry>,
}

#[derive(Deserialize)]
struct FileEntry {
    path: String,
    size_bytes: u64,
    #[serde(default)]
    sha256: String,
}

/// Why a card file cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("model card: {0}")]
pub struct CardError(String);

/// Parses one card.
pub fn parse(text: &str) -> Result<ModelCard, CardError> {
    let file: CardFile = toml::from_str(text).map_err(|e| CardError(e.to_string()))?;
    let format = match file.source.format.as_str() {
        "gguf" => v1::WeightFormat::Gguf,
        "safetensors" => v1::WeightFormat::Safetensors,
        other => return Err(CardError(format!("unknown format {other:?}"))),
    };
    Ok(ModelCard {
        model_id: file.model_id,
        family: file.family,
        quantization: file.quantization,
        base_model: file.base_model,
        n_layers: file.n_layers,
        hidden_size: file.hidden_size,
        num_attention_heads: file.num_attention_heads,
        num_key_value_heads: file.num_key_value_heads,
        context_length: file.context_length,
        supports_tensor: file.supports_tensor,
        tasks: vec![v1::ModelTask::TextGeneration as i32],
        capabilities: file.capabilities,
        storage_size_bytes: file.storage_size.in_bytes,
        source: Some(ModelSource {
            hub_repo: file.source.hub_repo,
            revision: String::new(),
            format: format as i32,
            files: file
                .source
                .files
                .into_iter()
                .map(|f| v1::ModelFile {
                    path: f.path,
                    size_bytes: f.size_bytes,
                    sha256: f.sha256,
                })
                .collect(),
        }),
        sampling_defaults: None,
    })
}

/// Every built-in card (a card that does not parse is a build bug: the
/// test below holds them all to parsing).
pub fn cards() -> Vec<ModelCard> {
    CARDS.iter().filter_map(|text| parse(text).ok()).collect()
}

/// The built-in card for `model_id`.
pub fn card(model_id: &str) -> Option<ModelCard> {
    cards().into_iter().find(|c| c.model_id == model_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_card_parses() {
        for text in CARDS {
            let card = parse(text).expect("card parses");
            assert!(card.n_layers > 0 && card.storage_size_bytes > 0);
        }
        let default = card("smollm2-135m-instruct-q4_1").expect("default card");
        assert_eq!(default.num_key_value_heads, 3);
        assert!(default.supports_tensor);
    }
}
