//! Split GGUF models on a node (llama.cpp's `NAME-00001-of-0000N.gguf`):
//! which shard holds which tensors (from the shards' headers, kept in a
//! note beside the files so it is read once), and the join of the shards
//! a node holds into the one file the engine opens.
//!
//! A pipeline stage downloads only the shards that hold its tensors (and
//! the first, which holds the metadata); the joined file lists every
//! tensor, those of shards not here past its end (reading one is an error,
//! never zeros).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tessera_hub::gguf::{self, Header, TensorInfo};
use tessera_hub::{HubClient, RepoListing};
use tessera_protos::v1;

/// The tensor index of a model's shards, in its notes folder.
const INDEX_NOTE: &str = "gguf-shards.json";

/// One shard's header, less its metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexedShard {
    pub path: String,
    pub alignment: u64,
    pub data_offset: u64,
    pub tensors: Vec<TensorInfo>,
}

impl IndexedShard {
    fn of(path: &str, header: &Header) -> Self {
        Self {
            path: path.to_string(),
            alignment: header.alignment,
            data_offset: header.data_offset,
            tensors: header.tensors.clone(),
        }
    }

    fn header(&self) -> Header {
        Header {
            version: 3,
            metadata: Vec::new(),
            tensors: self.tensors.clone(),
            alignment: self.alignment,
            data_offset: self.data_offset,
        }
    }
}

/// The card's shards when its GGUF is split (more than one `.gguf` file),
/// in order.
pub fn split_shards(card: &v1::ModelCard) -> Option<Vec<String>> {
    let source = card.source.as_ref()?;
    let shards: Vec<String> = source
        .files
        .iter()
        .filter(|f| f.path.ends_with(".gguf"))
        .map(|f| f.path.clone())
        .collect();
    (shards.len() > 1).then_some(shards)
}

/// The name of the file the shards are joined into:
/// `STEM.joined.gguf` (no repository file can have it).
pub fn joined_name(shards: &[String]) -> String {
    let first = shards.first().map(String::as_str).unwrap_or("model.gguf");
    let stem = gguf::parse_name(first).map_or_else(|| first.to_string(), |n| n.stem);
    format!("{stem}.joined.gguf")
}

/// The index kept in `notes`, else the one the shards in `dir` give when
/// every one is there.
pub fn read_index(dir: &Path, notes: &Path, shards: &[String]) -> Option<Vec<IndexedShard>> {
    let kept: Option<Vec<IndexedShard>> = std::fs::read(notes.join(INDEX_NOTE))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    if let Some(index) = kept.filter(|i| same_shards(i, shards)) {
        return Some(index);
    }
    shards
        .iter()
        .map(|path| {
            let header = gguf::read_header(&dir.join(path)).ok()?;
            Some(IndexedShard::of(path, &header))
        })
        .collect()
}

fn same_shards(index: &[IndexedShard], shards: &[String]) -> bool {
    index.len() == shards.len() && index.iter().zip(shards).all(|(i, s)| i.path == *s)
}

/// The shards (paths) that hold the tensors `stages` load, the first
/// (the metadata) always among them.
pub fn shards_for(
    index: &[IndexedShard],
    stages: &[tessera_hub::weights::Stage],
) -> BTreeSet<String> {
    let map: BTreeMap<String, String> = index
        .iter()
        .flat_map(|s| s.tensors.iter().map(|t| (t.name.clone(), s.path.clone())))
        .collect();
    let mut needed: BTreeSet<String> = stages
        .iter()
        .flat_map(|stage| tessera_hub::weights::files_for_stage(&map, stage))
        .collect();
    if let Some(first) = index.first() {
        needed.insert(first.path.clone());
    }
    needed
}

/// Reads every shard's header (from `dir` where the shard is whole, else
/// with `Range` requests) and keeps the index in `notes`, unless it is
/// there already.
pub async fn index_shards(
    client: &HubClient,
    listing: &RepoListing,
    shards: &[String],
    dir: &Path,
    notes: &Path,
) -> Result<(), String> {
    if read_index(dir, notes, shards).is_some() {
        return Ok(());
    }
    let mut index = Vec::with_capacity(shards.len());
    let mut fetched = 0;
    for path in shards {
        let size = listing.get(path).map_or(0, |f| f.size);
        let local = gguf::read_header(&dir.join(path)).ok();
        let header = match local {
            Some(header) => header,
            None => {
                let (header, bytes) = client
                    .gguf_header(&listing.repo, &listing.commit, path, size)
                    .await
                    .map_err(|e| e.to_string())?;
                fetched += bytes;
                header
            }
        };
        index.push(IndexedShard::of(path, &header));
    }
    tracing::info!(
        shards = shards.len(),
        fetched,
        "indexed a split GGUF's tensors"
    );
    let bytes = serde_json::to_vec(&index).map_err(|e| e.to_string())?;
    std::fs::write(notes.join(INDEX_NOTE), bytes)
        .map_err(|e| format!("{}: {e}", notes.join(INDEX_NOTE).display()))
}

/// What a join made, kept beside it so it is made once.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct JoinNote {
    /// The shards whose data it holds.
    shards: BTreeSet<String>,
    /// Its length.
    len: u64,
}

/// Joins the shards in `dir` into `out`.
pub struct JoinJob {
    pub dir: PathBuf,
    pub out: PathBuf,
    /// Every shard, in order.
    pub shards: Vec<String>,
    /// The shards the node's stages need (all are in `dir`).
    pub needed: BTreeSet<String>,
    /// The index of the shards.
    pub index: Vec<IndexedShard>,
}

impl JoinJob {
    fn note_path(&self) -> PathBuf {
        let mut name = self.out.file_name().unwrap_or_default().to_os_string();
        name.push(".json");
        self.out.with_file_name(name)
    }

    /// An earlier join that holds every needed shard.
    fn reusable(&self) -> bool {
        let note: Option<JoinNote> = std::fs::read(self.note_path())
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok());
        let len = std::fs::metadata(&self.out).map_or(0, |m| m.len());
        note.is_some_and(|n| n.len == len && n.shards.is_superset(&self.needed))
    }

    /// The joined file: an earlier one if it will do, else a new one of
    /// every shard here (blocking: it copies the data).
    pub fn run(self) -> Result<PathBuf, String> {
        if self.reusable() {
            return Ok(self.out);
        }
        let here: BTreeSet<String> = self
            .shards
            .iter()
            .filter(|s| self.dir.join(s).is_file())
            .cloned()
            .collect();
        let first = self.shards.first().ok_or("no shards")?;
        let first_header = gguf::read_header(&self.dir.join(first)).map_err(|e| e.to_string())?;
        let others: Vec<Header> = self
            .index
            .iter()
            .skip(1)
            .map(IndexedShard::header)
            .collect();
        let paths: Vec<PathBuf> = self.shards.iter().map(|s| self.dir.join(s)).collect();
        let headers = std::iter::once(&first_header).chain(&others);
        let parts: Vec<gguf::Shard> = headers
            .zip(&self.shards)
            .zip(&paths)
            .map(|((header, name), path)| gguf::Shard {
                header,
                path: here.contains(name).then_some(path.as_path()),
            })
            .collect();
        if let Some(parent) = self.out.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        let started = std::time::Instant::now();
        let len = gguf::join(&parts, &self.out).map_err(|e| e.to_string())?;
        tracing::info!(
            out = %self.out.display(),
            shards = here.len(),
            bytes = len,
            ms = started.elapsed().as_millis() as u64,
            "joined a split GGUF"
        );
        let note = JoinNote { shards: here, len };
        let bytes = serde_json::to_vec(&note).map_err(|e| e.to_string())?;
        std::fs::write(self.note_path(), bytes).map_err(|e| e.to_string())?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_hub::weights::Stage;

    fn shard(path: &str, tensors: &[&str]) -> IndexedShard {
        IndexedShard {
            path: path.into(),
            alignment: 32,
            data_offset: 0,
            tensors: tensors
                .iter()
                .map(|name| TensorInfo {
                    name: name.to_string(),
                    dims: vec![8],
                    ggml_type: 0,
                    offset: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn a_stage_needs_the_first_shard_and_those_with_its_tensors() {
        let index = [
            shard("m-00001-of-00003.gguf", &["token_embd.weight"]),
            shard("m-00002-of-00003.gguf", &["blk.0.attn_q.weight"]),
            shard(
                "m-00003-of-00003.gguf",
                &["blk.1.attn_q.weight", "output_norm.weight"],
            ),
        ];
        let stage = |start, end| Stage::Layers {
            layers: start..end,
            n_layers: 2,
        };
        let names = |set: BTreeSet<String>| set.into_iter().collect::<Vec<_>>();
        assert_eq!(
            names(shards_for(&index, &[stage(0, 1)])),
            ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf"]
        );
        // The last stage: its layer, the norm, and the first shard (the
        // metadata).
        assert_eq!(
            names(shards_for(&index, &[stage(1, 2)])),
            ["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"]
        );
        assert_eq!(shards_for(&index, &[Stage::Whole]).len(), 3);
        let shards: Vec<String> = index.iter().map(|s| s.path.clone()).collect();
        assert_eq!(joined_name(&shards), "m.joined.gguf");
    }
}
