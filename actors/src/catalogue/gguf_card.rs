//! A model card for a GGUF repository, built from the headers of the
//! chosen file (every shard of a split one), read with `Range` requests:
//! the card costs a few megabytes of headers, never the weights.
//!
//! The repository's `.gguf` files are grouped into candidates (a whole
//! file, or a split's shards in order); the user picks one by file name
//! or by quantization (default [`DEFAULT_QUANT`], else the closest in bits
//! per weight).

use tessera_engine::model::Architecture;
use tessera_hub::gguf::{self, Header};
use tessera_hub::{HubClient, HubError, RepoFile, RepoListing};
use tessera_protos::v1::{self, ModelCard, ModelSource};

/// The quantization picked when the user names none: what llama.cpp,
/// Ollama and LM Studio users download most.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// Which file of a repository to add (both empty: the default quantization).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Choice {
    /// A `.gguf` file of the repository (any shard of a split one).
    pub file: String,
    /// A quantization label, e.g. `Q4_K_M`.
    pub quant: String,
}

/// Why no card is made.
#[derive(Debug, thiserror::Error)]
pub enum GgufCardError {
    /// The repository or the choice makes no card.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Hub(#[from] HubError),
}

fn invalid(message: String) -> GgufCardError {
    GgufCardError::Invalid(message)
}

/// One model file of a repository: a whole `.gguf`, or a split's shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The name without `.gguf` and the split suffix.
    pub stem: String,
    /// The quantization label of the file name, if it has one.
    pub quant: Option<&'static str>,
    /// The shards in order (one file when not split); a missing shard is
    /// absent, and [`Candidate::check_complete`] says so.
    pub files: Vec<RepoFile>,
    /// The shard count the names give (1: not split).
    pub count: u32,
}

impl Candidate {
    fn names(&self) -> String {
        match self.files.as_slice() {
            [one] => one.path.clone(),
            _ => format!("{}-*-of-{:05}.gguf", self.stem, self.count),
        }
    }

    /// Every shard of a split is listed.
    pub fn check_complete(&self) -> Result<(), GgufCardError> {
        if self.files.len() == self.count as usize {
            return Ok(());
        }
        let missing: Vec<String> = (1..=self.count)
            .map(|no| gguf::shard_name(&self.stem, no, self.count))
            .filter(|name| !self.files.iter().any(|f| f.path == *name))
            .collect();
        Err(invalid(format!(
            "{} is missing shards: {}",
            self.names(),
            missing.join(", ")
        )))
    }
}

/// Whether the engine runs a quantization (its i-quants and the ARM
/// repacks it does not).
fn runnable(label: &str) -> bool {
    !label.starts_with("IQ") && !label.starts_with("Q4_0_")
}

/// The repository's `.gguf` model files (vision projectors left out),
/// grouped and ordered by name.
pub fn candidates(listing: &RepoListing) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    for file in &listing.files {
        let Some(name) = gguf::parse_name(&file.path) else {
            continue;
        };
        if file.path.to_ascii_lowercase().contains("mmproj") {
            continue;
        }
        let count = name.shard.map_or(1, |(_, count)| count);
        let at = out
            .iter()
            .position(|c| c.stem == name.stem && c.count == count && count > 1);
        match at {
            Some(at) => out[at].files.push(file.clone()),
            None => out.push(Candidate {
                quant: gguf::quant_of_name(&file.path),
                stem: name.stem,
                files: vec![file.clone()],
                count,
            }),
        }
    }
    for candidate in &mut out {
        candidate.files.sort_by(|a, b| a.path.cmp(&b.path));
    }
    out.sort_by(|a, b| a.stem.cmp(&b.stem));
    out
}

fn list_of(candidates: &[Candidate]) -> String {
    candidates
        .iter()
        .map(Candidate::names)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The candidate the user asked for: by file, else by quantization (the
/// same label, else the closest runnable one).
pub fn pick<'a>(
    repo: &str,
    candidates: &'a [Candidate],
    choice: &Choice,
) -> Result<&'a Candidate, GgufCardError> {
    if candidates.is_empty() {
        return Err(invalid(format!("{repo} has no .gguf model files")));
    }
    let picked = if !choice.file.is_empty() {
        if !choice.quant.is_empty() {
            return Err(invalid("give a file or a quantization, not both".into()));
        }
        by_file(repo, candidates, &choice.file)?
    } else {
        by_quant(repo, candidates, &choice.quant)?
    };
    picked.check_complete()?;
    Ok(picked)
}

fn by_file<'a>(
    repo: &str,
    candidates: &'a [Candidate],
    file: &str,
) -> Result<&'a Candidate, GgufCardError> {
    let named = |f: &RepoFile| f.path == file || f.path.rsplit('/').next() == Some(file);
    candidates
        .iter()
        .find(|c| c.files.iter().any(named))
        .ok_or_else(|| {
            invalid(format!(
                "{repo} has no GGUF file {file}; it has {}",
                list_of(candidates)
            ))
        })
}

fn by_quant<'a>(
    repo: &str,
    candidates: &'a [Candidate],
    quant: &str,
) -> Result<&'a Candidate, GgufCardError> {
    let wanted = if quant.is_empty() {
        DEFAULT_QUANT
    } else {
        quant
    };
    if gguf::bits_of(wanted).is_none() {
        return Err(invalid(format!(
            "unknown quantization {wanted:?} (e.g. Q4_K_M, Q8_0, F16)"
        )));
    }
    let labels: Vec<&str> = candidates
        .iter()
        .filter_map(|c| c.quant)
        .filter(|l| runnable(l) || l.eq_ignore_ascii_case(wanted))
        .collect();
    if let Some(label) = gguf::closest(wanted, &labels) {
        // A whole file before a split one of the same label.
        let mut same = candidates.iter().filter(|c| c.quant == Some(label));
        let first = same.next();
        return same
            .find(|c| c.count == 1)
            .or(first)
            .ok_or_else(|| invalid(format!("{repo}: no file of {label}")));
    }
    match candidates {
        [only] => Ok(only),
        _ => Err(invalid(format!(
            "{repo}: no file names a quantization; name one with --file: {}",
            list_of(candidates)
        ))),
    }
}

/// The engine's family of a GGUF architecture.
fn family_of(repo: &str, architecture: &str) -> Result<&'static str, GgufCardError> {
    Architecture::from_name(architecture)
        .map(Architecture::name)
        .ok_or_else(|| {
            invalid(format!(
                "{repo}: architecture {architecture:?} is not one this engine runs ({})",
                Architecture::KNOWN
            ))
        })
}

/// The shards' headers agree with one another and with their files.
fn check_shards(candidate: &Candidate, headers: &[Header]) -> Result<(), GgufCardError> {
    let count = headers.len() as u64;
    let mut tensors = 0u64;
    for (no, (file, header)) in candidate.files.iter().zip(headers).enumerate() {
        if count > 1 && header.split() != Some((no as u64, count)) {
            return Err(invalid(format!(
                "{}: its split keys say {:?}, its name shard {no} of {count}",
                file.path,
                header.split()
            )));
        }
        if let Some(end) = header.data_len() {
            if file.size > 0 && header.data_offset + end > file.size {
                return Err(invalid(format!(
                    "{}: its tensors need {} bytes, the file has {}",
                    file.path,
                    header.data_offset + end,
                    file.size
                )));
            }
        }
        tensors += header.tensors.len() as u64;
    }
    let said = headers[0].get_int(gguf::SPLIT_TENSORS_COUNT);
    match said {
        Some(said) if count > 1 && said != tensors as i128 => Err(invalid(format!(
            "{}: split.tensors.count is {said}, the shards hold {tensors}",
            candidate.names()
        ))),
        _ => Ok(()),
    }
}

/// Every tensor is of a type the engine runs.
fn check_types(candidate: &Candidate, headers: &[Header]) -> Result<(), GgufCardError> {
    for (file, header) in candidate.files.iter().zip(headers) {
        if let Some(t) = header
            .tensors
            .iter()
            .find(|t| gguf::engine_type_name(t.ggml_type).is_none())
        {
            return Err(invalid(format!(
                "{}: tensor {} is of ggml type {}, which this engine does not run",
                file.path, t.name, t.ggml_type
            )));
        }
    }
    Ok(())
}

/// What a model is asked to do: vectors (an embedding model) or text.
pub fn task_of(embedding: bool) -> v1::ModelTask {
    if embedding {
        v1::ModelTask::Embedding
    } else {
        v1::ModelTask::TextGeneration
    }
}

/// The card of `candidate` from its shards' headers (pure).
pub fn card_from_headers(
    repo: &str,
    commit: &str,
    candidate: &Candidate,
    headers: &[Header],
) -> Result<ModelCard, GgufCardError> {
    let meta = headers
        .first()
        .filter(|_| headers.len() == candidate.files.len())
        .ok_or_else(|| invalid(format!("{}: headers missing", candidate.names())))?;
    check_shards(candidate, headers)?;
    check_types(candidate, headers)?;
    let architecture = meta
        .get_str("general.architecture")
        .ok_or_else(|| invalid(format!("{}: no general.architecture", candidate.names())))?;
    let family = family_of(repo, architecture)?;
    let number = |suffix: &str| meta.get_int(&format!("{architecture}.{suffix}"));
    let need = |suffix: &str| {
        let value = number(suffix)
            .ok_or_else(|| invalid(format!("{}: no {architecture}.{suffix}", candidate.names())))?;
        u32::try_from(value).map_err(|_| invalid(format!("{architecture}.{suffix} is {value}")))
    };
    let heads = need("attention.head_count")?;
    let kv_heads = match number("attention.head_count_kv") {
        Some(_) => need("attention.head_count_kv")?,
        None => heads,
    };
    let context = match number("context_length") {
        Some(_) => need("context_length")?,
        None => 2048,
    };
    // An embedding GGUF (llama.cpp's converter writes the pooling of a
    // sentence-transformers model): vectors, not text, on one node.
    let embedding = number("pooling_type").is_some_and(|p| p > 0);
    let label = candidate.quant.or_else(|| {
        meta.get_int("general.file_type")
            .and_then(gguf::quant_of_file_type)
    });
    let files: Vec<v1::ModelFile> = candidate
        .files
        .iter()
        .map(|f| v1::ModelFile {
            path: f.path.clone(),
            size_bytes: f.size,
            sha256: f.sha256.clone().unwrap_or_default(),
        })
        .collect();
    Ok(ModelCard {
        model_id: format!("{repo}:{}", label.unwrap_or(&candidate.stem)),
        family: family.to_string(),
        quantization: label.unwrap_or("unknown").to_ascii_lowercase(),
        base_model: repo.to_string(),
        n_layers: need("block_count")?,
        hidden_size: need("embedding_length")?,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        context_length: context,
        supports_tensor: kv_heads >= 2 && !embedding,
        tasks: vec![task_of(embedding) as i32],
        capabilities: if embedding {
            vec!["embedding".into()]
        } else {
            Vec::new()
        },
        storage_size_bytes: files.iter().map(|f| f.size_bytes).sum(),
        source: Some(ModelSource {
            hub_repo: repo.to_string(),
            revision: commit.to_string(),
            format: v1::WeightFormat::Gguf as i32,
            files,
        }),
        sampling_defaults: sampling_defaults(meta),
        chat_template: meta
            .get_str("tokenizer.chat_template")
            .unwrap_or_default()
            .to_string(),
    })
}

/// The header's `general.sampling.*`, if it has any.
fn sampling_defaults(meta: &Header) -> Option<v1::SamplingDefaults> {
    let float = |key: &str| match meta.get(key)? {
        gguf::MetaValue::Float(v) => Some(*v as f32),
        _ => None,
    };
    let defaults = v1::SamplingDefaults {
        temperature: float("general.sampling.temp"),
        top_p: float("general.sampling.top_p"),
        top_k: meta
            .get_int("general.sampling.top_k")
            .and_then(|k| u32::try_from(k).ok()),
        min_p: float("general.sampling.min_p"),
    };
    let any = defaults.temperature.is_some()
        || defaults.top_p.is_some()
        || defaults.top_k.is_some()
        || defaults.min_p.is_some();
    any.then_some(defaults)
}

/// A card and what it cost.
#[derive(Clone, Debug, PartialEq)]
pub struct BuiltCard {
    pub card: ModelCard,
    /// Bytes fetched to read the headers (the weights are not fetched).
    pub bytes_fetched: u64,
}

/// Picks a file of a GGUF repository and builds its card from the headers
/// of its shards, read with `Range` requests.
pub async fn card_from_hub(
    client: &HubClient,
    listing: &RepoListing,
    choice: &Choice,
) -> Result<BuiltCard, GgufCardError> {
    let candidates = candidates(listing);
    let picked = pick(&listing.repo, &candidates, choice)?;
    let mut headers = Vec::with_capacity(picked.files.len());
    let mut bytes_fetched = 0;
    for file in &picked.files {
        let (header, fetched) = client
            .gguf_header(&listing.repo, &listing.commit, &file.path, file.size)
            .await?;
        bytes_fetched += fetched;
        headers.push(header);
    }
    let card = card_from_headers(&listing.repo, &listing.commit, picked, &headers)?;
    tracing::info!(
        model = card.model_id,
        files = picked.files.len(),
        bytes_fetched,
        weights = card.storage_size_bytes,
        "a card from GGUF headers"
    );
    Ok(BuiltCard {
        card,
        bytes_fetched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(paths: &[&str]) -> RepoListing {
        RepoListing {
            repo: "acme/m-GGUF".into(),
            commit: "c0ffee".into(),
            files: paths
                .iter()
                .map(|p| RepoFile {
                    path: p.to_string(),
                    size: 100,
                    sha256: None,
                    git_oid: None,
                })
                .collect(),
        }
    }

    fn choice(file: &str, quant: &str) -> Choice {
        Choice {
            file: file.into(),
            quant: quant.into(),
        }
    }

    #[test]
    fn files_group_into_candidates_and_the_default_is_q4_k_m_else_the_closest() {
        let l = listing(&[
            "README.md",
            "m.Q8_0.gguf",
            "m.Q4_K_M-00002-of-00002.gguf",
            "m.Q4_K_M-00001-of-00002.gguf",
            "m.IQ4_XS.gguf",
            "mmproj-m-f16.gguf",
        ]);
        let c = candidates(&l);
        assert_eq!(c.len(), 3, "{c:?}");
        let split = pick("r", &c, &Choice::default()).expect("default");
        assert_eq!(split.quant, Some("Q4_K_M"));
        assert_eq!(split.files[0].path, "m.Q4_K_M-00001-of-00002.gguf");
        let by_name = pick("r", &c, &choice("m.Q4_K_M-00002-of-00002.gguf", "")).expect("file");
        assert_eq!(by_name, split, "any shard names the whole split");
        assert_eq!(
            pick("r", &c, &choice("", "q8_0")).expect("q8").quant,
            Some("Q8_0")
        );
        // Without Q4_K_M: the closest runnable one (not the i-quant).
        let c = candidates(&listing(&["m.Q8_0.gguf", "m.Q6_K.gguf", "m.IQ4_XS.gguf"]));
        assert_eq!(
            pick("r", &c, &Choice::default()).expect("closest").quant,
            Some("Q6_K")
        );
    }

    /// A header of `tensors` F32 tensors of 8 values, with the model keys
    /// on the first shard only (as `gguf-split` writes them).
    fn header(split: Option<(u16, u16)>, tensors: &[&str]) -> Header {
        use tessera_hub::gguf::{MetaEntry, TensorInfo};
        let mut metadata = Vec::new();
        if split.is_none_or(|(no, _)| no == 0) {
            metadata.push(MetaEntry::string("general.architecture", "qwen2"));
            for (key, value) in [
                ("qwen2.block_count", 2),
                ("qwen2.embedding_length", 64),
                ("qwen2.attention.head_count", 4),
                ("qwen2.attention.head_count_kv", 2),
                ("qwen2.context_length", 4096),
                ("general.file_type", 7),
            ] {
                metadata.push(MetaEntry::u32(key, value));
            }
        }
        if let Some((no, count)) = split {
            metadata.push(MetaEntry::u16(gguf::SPLIT_NO, no));
            metadata.push(MetaEntry::u16(gguf::SPLIT_COUNT, count));
            metadata.push(MetaEntry::i32(gguf::SPLIT_TENSORS_COUNT, 3));
        }
        Header {
            version: 3,
            metadata,
            tensors: tensors
                .iter()
                .enumerate()
                .map(|(i, name)| TensorInfo {
                    name: name.to_string(),
                    dims: vec![8],
                    ggml_type: 0,
                    offset: 32 * i as u64,
                })
                .collect(),
            alignment: 32,
            data_offset: 32,
        }
    }

    #[test]
    fn a_split_files_card_comes_from_its_headers() {
        let l = listing(&["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]);
        let c = candidates(&l);
        let headers = [
            header(Some((0, 2)), &["token_embd.weight", "blk.0.attn_q.weight"]),
            header(Some((1, 2)), &["blk.1.attn_q.weight"]),
        ];
        let card = card_from_headers("acme/m-GGUF", "c0ffee", &c[0], &headers).expect("card");
        // No label in the names: the file type's.
        assert_eq!(card.model_id, "acme/m-GGUF:Q8_0");
        assert_eq!(card.quantization, "q8_0");
        assert_eq!((card.family.as_str(), card.n_layers), ("qwen2", 2));
        assert_eq!((card.num_attention_heads, card.num_key_value_heads), (4, 2));
        assert_eq!(card.context_length, 4096);
        assert_eq!(card.storage_size_bytes, 200);
        let source = card.source.expect("source");
        assert_eq!(source.files.len(), 2);
        assert_eq!(source.revision, "c0ffee");
        assert_eq!(card.tasks, vec![v1::ModelTask::TextGeneration as i32]);
        // A pooling type (an embedding GGUF): vectors, on one node.
        let mut pooled = headers.clone();
        pooled[0]
            .metadata
            .push(tessera_hub::gguf::MetaEntry::u32("qwen2.pooling_type", 3));
        let card = card_from_headers("acme/e-GGUF", "c", &c[0], &pooled).expect("card");
        assert_eq!(card.tasks, vec![v1::ModelTask::Embedding as i32]);
        assert!(!card.supports_tensor);
        // Shards out of order, a count that does not add up, a tensor
        // that does not fit its file: refused.
        let swapped = [headers[1].clone(), headers[0].clone()];
        assert!(card_from_headers("r", "c", &c[0], &swapped).is_err());
        let short = [headers[0].clone(), header(Some((1, 2)), &[])];
        let error = card_from_headers("r", "c", &c[0], &short).expect_err("count");
        assert!(error.to_string().contains("split.tensors.count"), "{error}");
        let mut big = headers.clone();
        big[1].tensors[0].dims = vec![1 << 20];
        let error = card_from_headers("r", "c", &c[0], &big).expect_err("too big");
        assert!(error.to_string().contains("the file has 100"), "{error}");
        let mut iq = headers.clone();
        iq[1].tensors[0].ggml_type = 16;
        let error = card_from_headers("r", "c", &c[0], &iq).expect_err("iq2");
        assert!(error.to_string().contains("does not run"), "{error}");
    }

    #[test]
    fn bad_choices_say_what_the_repository_has() {
        let c = candidates(&listing(&["m.Q8_0.gguf", "m.Q4_1-00001-of-00003.gguf"]));
        let error = pick("r", &c, &choice("x.gguf", "")).expect_err("no such file");
        assert!(error.to_string().contains("m.Q8_0.gguf"), "{error}");
        let error = pick("r", &c, &choice("", "Q4_1")).expect_err("incomplete split");
        assert!(
            error.to_string().contains("m.Q4_1-00002-of-00003.gguf"),
            "{error}"
        );
        assert!(
            pick("r", &c, &choice("m.Q8_0.gguf", "Q8_0")).is_err(),
            "both"
        );
        assert!(pick("r", &c, &choice("", "Q9_X")).is_err(), "unknown label");
        assert!(pick("r", &[], &Choice::default()).is_err());
        let unlabelled = candidates(&listing(&["a.gguf", "b.gguf"]));
        let error = pick("r", &unlabelled, &Choice::default()).expect_err("ambiguous");
        assert!(error.to_string().contains("--file"), "{error}");
    }
}
