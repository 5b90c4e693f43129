//! The model cards this build knows (`resources/model_cards/*.toml`,
//! compiled in), as the wire type placement uses.

pub mod gguf_card;
pub mod task;

use serde::Deserialize;
use tessera_engine::model::llama::served_context;
use tessera_engine::model::Architecture;
use tessera_protos::v1::{self, AdminErrorKind, ModelCard, ModelSource};

use crate::admin::AdminFailure;

/// Every card shipped in `resources/model_cards/`.
const CARDS: &[&str] = &[
    include_str!("../../../resources/model_cards/smollm2-135m-instruct-q4_1.toml"),
    include_str!("../../../resources/model_cards/smollm2-1.7b-instruct.toml"),
    include_str!("../../../resources/model_cards/qwen2.5-0.5b-instruct.toml"),
    include_str!("../../../resources/model_cards/qwen3-0.6b.toml"),
    include_str!("../../../resources/model_cards/llama-3.1-8b-instruct.toml"),
    include_str!("../../../resources/model_cards/qwen2.5-7b-instruct.toml"),
    include_str!("../../../resources/model_cards/qwen3-8b.toml"),
    include_str!("../../../resources/model_cards/mistral-7b-instruct-v0.3.toml"),
    include_str!("../../../resources/model_cards/phi-3.5-mini-instruct-q4_k_m.toml"),
    include_str!("../../../resources/model_cards/gemma-3-12b-it-q4_k_m.toml"),
    include_str!("../../../resources/model_cards/qwen3-30b-a3b-q4_k_m.toml"),
    include_str!("../../../resources/model_cards/qwen3-30b-a3b-q8_0.toml"),
    include_str!("../../../resources/model_cards/mixtral-8x7b-instruct-v0.1-q8_0.toml"),
    include_str!("../../../resources/model_cards/qwen3.5-35b-a3b.toml"),
    include_str!("../../../resources/model_cards/all-minilm-l6-v2.toml"),
];

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
    /// "text_generation" (the default) or "embedding".
    #[serde(default = "text_generation")]
    tasks: Vec<String>,
    #[serde(default)]
    capabilities: Vec<String>,
    storage_size: StorageSize,
    source: SourceFile,
}

fn text_generation() -> Vec<String> {
    vec!["text_generation".into()]
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
    revision: String,
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

/// Why a card cannot be read or built.
#[derive(Debug, thiserror::Error)]
pub enum CardError {
    /// The card file, or the repository's config, makes no card.
    #[error("model card: {0}")]
    Invalid(String),
    /// The hub did not give the listing or the config.
    #[error("model card: {0}")]
    Hub(#[from] tessera_hub::HubError),
}

impl From<crate::catalogue::gguf_card::GgufCardError> for CardError {
    fn from(error: crate::catalogue::gguf_card::GgufCardError) -> Self {
        match error {
            crate::catalogue::gguf_card::GgufCardError::Invalid(message) => Self::Invalid(message),
            crate::catalogue::gguf_card::GgufCardError::Hub(error) => Self::Hub(error),
        }
    }
}

impl CardError {
    /// The admin kind a refused `add_model` answers with.
    pub fn kind(&self) -> AdminErrorKind {
        match self {
            Self::Invalid(_) => AdminErrorKind::InvalidArgument,
            Self::Hub(error) => hub_kind(error),
        }
    }
}

fn hub_kind(error: &tessera_hub::HubError) -> AdminErrorKind {
    use tessera_hub::HubError as H;
    match error {
        H::NotFound { .. } => AdminErrorKind::NotFound,
        H::GaveUp { last, .. } => hub_kind(last),
        // The repository is not one a card can be built from.
        H::BadRepo(_)
        | H::Unauthorized { .. }
        | H::BadListing { .. }
        | H::TooLarge { .. }
        | H::BadGguf { .. } => AdminErrorKind::InvalidArgument,
        // The hub busy or unreachable: trying again later may succeed.
        _ => AdminErrorKind::Unavailable,
    }
}

impl From<CardError> for AdminFailure {
    fn from(error: CardError) -> Self {
        Self::new(error.kind(), error.to_string())
    }
}

/// Parses one card.
pub fn parse(text: &str) -> Result<ModelCard, CardError> {
    let file: CardFile = toml::from_str(text).map_err(|e| CardError::Invalid(e.to_string()))?;
    let format = match file.source.format.as_str() {
        "gguf" => v1::WeightFormat::Gguf,
        "safetensors" => v1::WeightFormat::Safetensors,
        other => return Err(CardError::Invalid(format!("unknown format {other:?}"))),
    };
    let tasks = file
        .tasks
        .iter()
        .map(|task| match task.as_str() {
            "text_generation" => Ok(v1::ModelTask::TextGeneration as i32),
            "embedding" => Ok(v1::ModelTask::Embedding as i32),
            other => Err(CardError::Invalid(format!("unknown task {other:?}"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
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
        tasks,
        capabilities: file.capabilities,
        storage_size_bytes: file.storage_size.in_bytes,
        source: Some(ModelSource {
            hub_repo: file.source.hub_repo,
            revision: file.source.revision,
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
        chat_template: String::new(),
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

/// The card for `model_id`: a custom one the cluster learnt, else a
/// built-in one.
pub fn find(state: &v1::ClusterState, model_id: &str) -> Option<ModelCard> {
    state
        .custom_cards
        .get(model_id)
        .cloned()
        .or_else(|| card(model_id))
}

/// The card an instance of `model_id` was placed with, else the one the
/// cluster knows ([`find`]).
pub fn placed_or_known(state: &v1::ClusterState, model_id: &str) -> Option<ModelCard> {
    let mut placed = state.instances.values().filter_map(|i| i.model.as_ref());
    placed
        .find(|m| m.model_id == model_id)
        .cloned()
        .or_else(|| find(state, model_id))
}

/// The card a request's model name means, as people type names: the exact
/// id; the id without Ollama's `:latest`; `NAME` for the only (or the
/// default, [`gguf_card::DEFAULT_QUANT`]) quantization of `NAME:QUANT`;
/// and `NAME:TAG` for `NAME-TAG` (a tag naming the quantization of a
/// catalogue id). Case does not matter past the exact id. `Err` lists the
/// candidates when a name could mean several.
pub fn resolve(cards: &[ModelCard], name: &str) -> Result<Option<ModelCard>, Vec<String>> {
    if let Some(card) = cards.iter().find(|c| c.model_id == name) {
        return Ok(Some(card.clone()));
    }
    let lower = name.to_lowercase();
    let base = lower.strip_suffix(":latest").unwrap_or(&lower);
    let same = |id: &str| id.to_lowercase() == base;
    if let Some(card) = cards.iter().find(|c| same(&c.model_id)) {
        return Ok(Some(card.clone()));
    }
    if let Some((stem, tag)) = base.rsplit_once(':') {
        let dashed = format!("{stem}-{tag}");
        return Ok(cards
            .iter()
            .find(|c| c.model_id.to_lowercase() == dashed)
            .cloned());
    }
    let prefix = format!("{base}:");
    let tagged: Vec<&ModelCard> = cards
        .iter()
        .filter(|c| c.model_id.to_lowercase().starts_with(&prefix))
        .collect();
    let default_tag = format!("{prefix}{}", gguf_card::DEFAULT_QUANT.to_lowercase());
    match tagged.as_slice() {
        [] => Ok(None),
        [only] => Ok(Some((*only).clone())),
        several => match several
            .iter()
            .find(|c| c.model_id.to_lowercase() == default_tag)
        {
            Some(default) => Ok(Some((*default).clone())),
            None => Err(several.iter().map(|c| c.model_id.clone()).collect()),
        },
    }
}

/// Every card the cluster knows: built-in ones, then custom ones.
pub fn all(state: &v1::ClusterState) -> Vec<ModelCard> {
    let mut cards = cards();
    cards.retain(|c| !state.custom_cards.contains_key(&c.model_id));
    cards.extend(state.custom_cards.values().cloned());
    cards
}

/// Every card with the nodes that hold its files, whole or in part: the
/// admin service's model list and the dashboard's catalogue.
pub fn listings(state: &v1::ClusterState) -> v1::ListModelsReply {
    let models = all(state)
        .into_iter()
        .map(|card| v1::ModelListing {
            downloaded_on: crate::cluster::placement::downloaded_on(state, &card.model_id),
            partly_on: crate::cluster::placement::partly_on(state, &card.model_id),
            card: Some(card),
        })
        .collect();
    v1::ListModelsReply {
        models,
        error: None,
    }
}

/// Builds a card from a hub repository. A safetensors one: from its
/// `config.json` and file listing, the model id its name (`OWNER/NAME`).
/// A GGUF one (or any, when `choice` names a file or a quantization): from
/// the headers of the chosen file ([`crate::catalogue::gguf_card`]), the model id
/// `OWNER/NAME:QUANT`.
pub async fn card_from_hub(
    client: &tessera_hub::HubClient,
    repo: &str,
    revision: &str,
    choice: &crate::catalogue::gguf_card::Choice,
) -> Result<crate::catalogue::gguf_card::BuiltCard, CardError> {
    let revision = if revision.is_empty() {
        "main"
    } else {
        revision
    };
    let listing = client.list(repo, revision).await?;
    let safetensors = listing
        .files
        .iter()
        .any(|f| f.path.ends_with(".safetensors") && !f.path.contains('/'));
    let gguf = listing.files.iter().any(|f| f.path.ends_with(".gguf"));
    let chosen = !choice.file.is_empty() || !choice.quant.is_empty();
    if gguf && (chosen || !safetensors) {
        return Ok(crate::catalogue::gguf_card::card_from_hub(client, &listing, choice).await?);
    }
    if chosen {
        return Err(CardError::Invalid(format!(
            "{repo} has no GGUF files to choose from (a file or a quantization was given)"
        )));
    }
    if !safetensors {
        return Err(CardError::Invalid(format!(
            "{repo} has no safetensors or GGUF weights"
        )));
    }
    if listing.get("config.json").is_none() {
        return Err(CardError::Invalid(format!("{repo} has no config.json")));
    }
    let config = client
        .fetch_small(repo, &listing.commit, "config.json")
        .await?;
    Ok(crate::catalogue::gguf_card::BuiltCard {
        card: card_from_config(repo, &listing, &config)?,
        bytes_fetched: config.len() as u64,
    })
}

/// A safetensors config's weight type as a quantization label.
fn quantization_of(config: &serde_json::Value) -> &str {
    let dtype = config
        .get("torch_dtype")
        .or_else(|| config.get("dtype"))
        .and_then(|v| v.as_str())
        .unwrap_or("unknown");
    match dtype {
        "bfloat16" => "bf16",
        "float16" => "f16",
        "float32" => "f32",
        other => other,
    }
}

/// The files of a safetensors repository a model needs (its weights and
/// support files), and the weights' bytes.
fn safetensors_files(listing: &tessera_hub::RepoListing) -> (Vec<v1::ModelFile>, u64) {
    let wanted = |path: &str| {
        (path.ends_with(".safetensors") && !path.contains('/'))
            || tessera_hub::weights::SUPPORT_FILES.contains(&path)
    };
    let files: Vec<v1::ModelFile> = listing
        .files
        .iter()
        .filter(|f| wanted(&f.path))
        .map(|f| v1::ModelFile {
            path: f.path.clone(),
            size_bytes: f.size,
            sha256: f.sha256.clone().unwrap_or_default(),
        })
        .collect();
    let storage = files
        .iter()
        .filter(|f| f.path.ends_with(".safetensors"))
        .map(|f| f.size_bytes)
        .sum();
    (files, storage)
}

/// The pure half of [`card_from_hub`].
pub fn card_from_config(
    repo: &str,
    listing: &tessera_hub::RepoListing,
    config_json: &[u8],
) -> Result<ModelCard, CardError> {
    let config: serde_json::Value = serde_json::from_slice(config_json)
        .map_err(|e| CardError::Invalid(format!("{repo}/config.json: {e}")))?;
    // Multimodal configs keep the language model's values in text_config.
    let text = config.get("text_config").unwrap_or(&config);
    // GPT-2's names where a config uses them (nomic-bert's).
    fn alias(key: &str) -> &str {
        match key {
            "num_hidden_layers" => "n_layer",
            "hidden_size" => "n_embd",
            "num_attention_heads" => "n_head",
            "max_position_embeddings" => "n_positions",
            other => other,
        }
    }
    let number = |key: &str| -> Option<u64> {
        text.get(key)
            .or_else(|| text.get(alias(key)))
            .and_then(|v| v.as_u64())
    };
    let need = |key: &str| {
        number(key).ok_or_else(|| CardError::Invalid(format!("{repo}/config.json lacks {key}")))
    };
    let model_type = text
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    // A sentence-transformers repository: an embedding model.
    let embedding = listing.get("modules.json").is_some();
    let encoder = match model_type {
        "bert" | "nomic_bert" if embedding => Some(model_type),
        _ => None,
    };
    let family = Architecture::from_name(model_type)
        .map(Architecture::name)
        .or(encoder)
        .ok_or_else(|| {
            CardError::Invalid(format!(
                "{repo}: model type {model_type:?} is not one this engine runs ({})",
                Architecture::KNOWN
            ))
        })?;
    let heads = need("num_attention_heads")?;
    let kv_heads = number("num_key_value_heads").unwrap_or(heads);
    let quantization = quantization_of(text);
    let (files, storage) = safetensors_files(listing);
    let as_u32 = |v: u64| {
        u32::try_from(v).map_err(|_| CardError::Invalid(format!("{repo}: {v} is too large")))
    };
    Ok(ModelCard {
        model_id: repo.to_string(),
        family: family.to_string(),
        quantization: quantization.to_string(),
        base_model: repo.to_string(),
        n_layers: as_u32(need("num_hidden_layers")?)?,
        hidden_size: as_u32(need("hidden_size")?)?,
        num_attention_heads: as_u32(heads)?,
        num_key_value_heads: as_u32(kv_heads)?,
        context_length: as_u32(
            served_context(text)
                .map(|c| c as u64)
                .or_else(|| number("max_position_embeddings"))
                .unwrap_or(4096),
        )?,
        supports_tensor: kv_heads >= 2 && !embedding,
        tasks: vec![crate::catalogue::gguf_card::task_of(embedding) as i32],
        capabilities: if embedding {
            vec!["embedding".into()]
        } else {
            Vec::new()
        },
        storage_size_bytes: storage,
        source: Some(ModelSource {
            hub_repo: repo.to_string(),
            revision: listing.commit.clone(),
            format: v1::WeightFormat::Safetensors as i32,
            files,
        }),
        sampling_defaults: None,
        chat_template: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_as_people_type_them() {
        let card = |id: &str| ModelCard {
            model_id: id.into(),
            ..ModelCard::default()
        };
        let cards = vec![
            card("smollm2-135m-instruct-q4_1"),
            card("owner/one:Q8_0"),
            card("owner/many:Q4_K_M"),
            card("owner/many:Q8_0"),
            card("owner/other:Q5_0"),
            card("owner/other:Q8_0"),
        ];
        let id = |name: &str| resolve(&cards, name).map(|c| c.map(|c| c.model_id));
        assert_eq!(
            id("smollm2-135m-instruct-q4_1"),
            Ok(Some("smollm2-135m-instruct-q4_1".into()))
        );
        assert_eq!(
            id("smollm2-135m-instruct-q4_1:latest"),
            Ok(Some("smollm2-135m-instruct-q4_1".into()))
        );
        assert_eq!(
            id("smollm2-135m-instruct:q4_1"),
            Ok(Some("smollm2-135m-instruct-q4_1".into()))
        );
        assert_eq!(
            id("SmolLM2-135M-Instruct:Q4_1"),
            Ok(Some("smollm2-135m-instruct-q4_1".into()))
        );
        assert_eq!(id("owner/one"), Ok(Some("owner/one:Q8_0".into())));
        assert_eq!(id("owner/one:latest"), Ok(Some("owner/one:Q8_0".into())));
        assert_eq!(id("owner/one:q8_0"), Ok(Some("owner/one:Q8_0".into())));
        assert_eq!(id("owner/many"), Ok(Some("owner/many:Q4_K_M".into())));
        assert_eq!(
            id("owner/other"),
            Err(vec![
                "owner/other:Q5_0".to_string(),
                "owner/other:Q8_0".to_string()
            ])
        );
        assert_eq!(id("owner/one:Q4_0"), Ok(None));
        assert_eq!(id("nothing"), Ok(None));
    }

    #[test]
    fn a_card_is_built_from_a_config_and_a_listing() {
        let listing = tessera_hub::RepoListing {
            repo: "acme/m".into(),
            commit: "abc".into(),
            files: vec![
                tessera_hub::RepoFile {
                    path: "config.json".into(),
                    size: 10,
                    sha256: None,
                    git_oid: None,
                },
                tessera_hub::RepoFile {
                    path: "model-00001-of-00002.safetensors".into(),
                    size: 100,
                    sha256: Some("aa".into()),
                    git_oid: None,
                },
                tessera_hub::RepoFile {
                    path: "model-00002-of-00002.safetensors".into(),
                    size: 50,
                    sha256: None,
                    git_oid: None,
                },
                tessera_hub::RepoFile {
                    path: "README.md".into(),
                    size: 5,
                    sha256: None,
                    git_oid: None,
                },
            ],
        };
        let config = br#"{"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
            "num_attention_heads": 14, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}"#;
        let card = card_from_config("acme/m", &listing, config).expect("card");
        assert_eq!(card.model_id, "acme/m");
        assert_eq!((card.n_layers, card.num_key_value_heads), (24, 2));
        assert_eq!(card.storage_size_bytes, 150);
        assert_eq!(card.quantization, "bf16");
        assert_eq!(card.context_length, 32768);
        let source = card.source.expect("source");
        assert_eq!(source.revision, "abc");
        assert_eq!(source.files.len(), 3, "README is not a model file");
        let unsupported = br#"{"model_type": "gpt2", "num_hidden_layers": 1, "hidden_size": 1,
            "num_attention_heads": 1}"#;
        let error = card_from_config("acme/m", &listing, unsupported).expect_err("gpt2");
        assert!(
            error.to_string().contains("not one this engine runs"),
            "{error}"
        );
        // Dynamic RoPE serves its factor times the trained context.
        let dynamic = br#"{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "dynamic", "factor": 2.0}}"#;
        let card = card_from_config("acme/m", &listing, dynamic).expect("card");
        assert_eq!(card.context_length, 8192);
        let missing = br#"{"model_type": "llama"}"#;
        assert!(card_from_config("acme/m", &listing, missing).is_err());
        // A sentence-transformers repository is an embedding model, BERT
        // included.
        let mut embedder = listing.clone();
        embedder.files.push(tessera_hub::RepoFile {
            path: "modules.json".into(),
            size: 3,
            sha256: None,
            git_oid: None,
        });
        let bert = br#"{"model_type": "bert", "num_hidden_layers": 6, "hidden_size": 384,
            "num_attention_heads": 12, "max_position_embeddings": 512}"#;
        let card = card_from_config("acme/e", &embedder, bert).expect("card");
        assert_eq!(card.family, "bert");
        assert_eq!(card.tasks, vec![v1::ModelTask::Embedding as i32]);
        assert!(!card.supports_tensor);
        assert!(card
            .source
            .expect("source")
            .files
            .iter()
            .any(|f| f.path == "modules.json"));
        assert!(
            card_from_config("acme/e", &listing, bert).is_err(),
            "a BERT that embeds nothing"
        );
    }

    #[test]
    fn a_hub_failure_has_the_kind_of_its_cause() {
        use tessera_hub::HubError as H;
        let kind = |error: H| CardError::Hub(error).kind();
        let what = String::from("x");
        assert_eq!(
            kind(H::NotFound { what: what.clone() }),
            AdminErrorKind::NotFound
        );
        assert_eq!(
            kind(H::BadRepo(what.clone())),
            AdminErrorKind::InvalidArgument
        );
        let network = H::Network {
            what,
            message: "refused".into(),
        };
        let gave_up = H::GaveUp {
            attempts: 3,
            last: Box::new(network),
        };
        assert_eq!(kind(gave_up), AdminErrorKind::Unavailable);
        assert_eq!(
            CardError::Invalid("no config".into()).kind(),
            AdminErrorKind::InvalidArgument
        );
    }

    #[test]
    fn every_shipped_card_parses() {
        let mut ids = std::collections::BTreeSet::new();
        for text in CARDS {
            let card = parse(text).expect("card parses");
            assert!(card.n_layers > 0 && card.storage_size_bytes > 0);
            assert!(ids.insert(card.model_id.clone()), "{} twice", card.model_id);
            assert!(
                card.num_attention_heads
                    .is_multiple_of(card.num_key_value_heads),
                "{}: query heads in whole KV groups",
                card.model_id
            );
            let source = card.source.as_ref().expect("source");
            let weights: Vec<&v1::ModelFile> = source
                .files
                .iter()
                .filter(|f| f.path.ends_with(".gguf") || f.path.ends_with(".safetensors"))
                .collect();
            // The stated size is the sum of the weight files listed; a card
            // whose shards' sizes are not known lists none (its header
            // says so) and takes its total from the hub's figures.
            if !weights.is_empty() {
                let total: u64 = weights.iter().map(|f| f.size_bytes).sum();
                assert_eq!(total, card.storage_size_bytes, "{}", card.model_id);
            }
            for file in &source.files {
                let hash = &file.sha256;
                assert!(
                    hash.is_empty()
                        || (hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit())),
                    "{}: {} has a malformed SHA-256",
                    card.model_id,
                    file.path
                );
            }
            assert!(
                source.revision.is_empty() || source.revision.len() == 40,
                "{}: a revision is a full commit",
                card.model_id
            );
        }
        // The MoE cards, as their families' engines will read them.
        let qwen = card("qwen3-30b-a3b-q4_k_m").expect("qwen3-30b-a3b");
        assert_eq!(qwen.family, "qwen3moe");
        assert_eq!(
            (qwen.n_layers, qwen.hidden_size, qwen.num_key_value_heads),
            (48, 2048, 4)
        );
        assert_eq!(
            qwen.source.as_ref().expect("source").format,
            v1::WeightFormat::Gguf as i32
        );
        let mixtral = card("mixtral-8x7b-instruct-v0.1-q8_0").expect("mixtral");
        assert_eq!(mixtral.family, "mixtral");
        assert_eq!((mixtral.n_layers, mixtral.num_key_value_heads), (32, 8));
        for id in ["qwen3-30b-a3b-q8_0", "mixtral-8x7b-instruct-v0.1-q8_0"] {
            assert_eq!(card(id).expect(id).quantization, "q8_0");
        }
        let next = card("qwen3.5-35b-a3b").expect("qwen3.5");
        assert_eq!(
            (next.family.as_str(), next.num_key_value_heads),
            ("qwen3_5_moe", 2)
        );
        assert_eq!(
            card("gemma-3-12b-it-q4_k_m").expect("gemma").family,
            "gemma3"
        );
        assert_eq!(
            card("phi-3.5-mini-instruct-q4_k_m").expect("phi").family,
            "phi3"
        );
        let default = card("smollm2-135m-instruct-q4_1").expect("default card");
        assert_eq!(default.num_key_value_heads, 3);
        assert!(default.supports_tensor);
    }
}
