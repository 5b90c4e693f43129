//! Model files on a node: the folders they live in, and the download job
//! that brings in exactly the files a shard needs.
//!
//! A job first looks for a complete copy in any model folder (a model
//! already there, pre-staged read-only or downloaded before, is never
//! fetched again). Otherwise, unless the node is offline, it lists the
//! repository (the listing is kept beside the files, so offline mode knows
//! what a model needs), fetches the config, tokenizer and template files,
//! reads the safetensors index (or a split GGUF's shard headers) to pick
//! the weight files that hold the shard's tensors, checks the disk has
//! room, and downloads what is missing, a few files at a time, reporting
//! progress at most once a second; a split GGUF's shards are then joined
//! into the one file a runner loads.

pub mod actor;
pub mod gguf_split;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tessera_hub::weights::{self, Stage, INDEX_FILE, SINGLE_FILE, SUPPORT_FILES};
use tessera_hub::{CancellationToken, FileProgress, HubClient, RepoFile, RepoListing};
use tessera_protos::v1::{self, download_progress::State as Ds};

use crate::worker::downloads::gguf_split::{
    index_shards, joined_name, read_index, shards_for, split_shards, IndexedShard, JoinJob,
};

/// How often progress is reported while bytes flow.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Where a model folder keeps tessera's own notes (the repository listing).
const NOTES_DIR: &str = ".tessera";
const LISTING_FILE: &str = "listing.json";

/// A folder that holds model folders (`FOLDER/MODEL_ID/...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFolder {
    pub path: PathBuf,
    /// Downloads go only to writable folders; files in read-only
    /// (pre-staged) ones are used as they are and never deleted.
    pub writable: bool,
}

/// The model folders of a node, in search order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelStore {
    folders: Vec<ModelFolder>,
}

impl ModelStore {
    /// `default` (under `TESSERA_HOME`), then `extra` writable folders, then
    /// read-only `staged` folders.
    pub fn new(default: PathBuf, extra: Vec<PathBuf>, staged: Vec<PathBuf>) -> Self {
        let writable = std::iter::once(default)
            .chain(extra)
            .map(|path| ModelFolder {
                path,
                writable: true,
            });
        let read_only = staged.into_iter().map(|path| ModelFolder {
            path,
            writable: false,
        });
        Self {
            folders: writable.chain(read_only).collect(),
        }
    }

    pub fn folders(&self) -> &[ModelFolder] {
        &self.folders
    }

    /// Where downloads of `model_id` go: the writable folder that already
    /// has some of it, else the first writable folder.
    pub fn target(&self, model_id: &str) -> PathBuf {
        let name = folder_name(model_id);
        let writable = || self.folders.iter().filter(|f| f.writable);
        writable()
            .map(|f| f.path.join(&name))
            .find(|dir| dir.is_dir())
            .or_else(|| writable().next().map(|f| f.path.join(&name)))
            .unwrap_or_else(|| PathBuf::from(&name))
    }

    /// Every existing copy of `model_id`'s folder, in search order.
    fn copies(&self, model_id: &str) -> Vec<(PathBuf, bool)> {
        let name = folder_name(model_id);
        self.folders
            .iter()
            .map(|f| (f.path.join(&name), f.writable))
            .filter(|(dir, _)| dir.is_dir())
            .collect()
    }

    /// Deletes `model_id`'s files from every writable folder.
    pub fn delete(&self, model_id: &str) -> std::io::Result<usize> {
        let mut deleted = 0;
        for (dir, writable) in self.copies(model_id) {
            if writable {
                std::fs::remove_dir_all(&dir)?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

/// The folder name of a model: its id, with `/` (hub-style ids) as `--`
/// and anything unsafe in a file name replaced.
pub fn folder_name(model_id: &str) -> String {
    let name: String = model_id
        .replace('/', "--")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() || name.starts_with('.') {
        format!("_{name}")
    } else {
        name
    }
}

/// How a download ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `path` is what a runner loads: the GGUF file or the model folder.
    Completed {
        path: PathBuf,
        total_bytes: u64,
        read_only: bool,
    },
    Failed(String),
    Cancelled,
}

impl Outcome {
    pub fn state(&self) -> Ds {
        match self {
            Self::Completed {
                path,
                total_bytes,
                read_only,
            } => Ds::Completed(v1::DownloadCompleted {
                total_bytes: *total_bytes,
                read_only: *read_only,
                path: path.display().to_string(),
            }),
            Self::Failed(reason) => Ds::Failed(v1::DownloadFailed {
                reason: reason.clone(),
            }),
            Self::Cancelled => Ds::Cancelled(v1::DownloadCancelled::default()),
        }
    }
}

/// Fetches models into a node's store.
pub struct Downloader {
    pub store: ModelStore,
    /// `None`: offline, local files only.
    pub client: Option<Arc<HubClient>>,
    /// Files downloaded at once.
    pub parallel: usize,
}

/// The files a shard needs, and what a runner loads.
struct Needed {
    files: Vec<RepoFile>,
    /// Relative to the model folder; empty: the folder itself.
    load: String,
    /// A split GGUF: every shard in order and their tensors (`load` is
    /// then the file they are joined into, since the engine opens one).
    split: Option<(Vec<String>, Vec<IndexedShard>)>,
}

fn stage_of(shard: &v1::ShardSpec) -> Stage {
    match &shard.kind {
        Some(v1::shard_spec::Kind::Pipeline(p)) => Stage::Layers {
            layers: p.start_layer..p.end_layer,
            n_layers: p.n_layers,
        },
        _ => Stage::Whole,
    }
}

fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

/// Whether `dir/file` is there, whole.
fn present(dir: &Path, file: &RepoFile) -> bool {
    std::fs::metadata(dir.join(&file.path))
        .is_ok_and(|m| m.is_file() && (file.size == 0 || m.len() == file.size))
}

/// Free space on the file system that holds `path` (or its nearest
/// existing ancestor).
pub fn free_space(path: &Path) -> Option<u64> {
    let mut existing = path.to_path_buf();
    while !existing.exists() {
        existing = existing.parent()?.to_path_buf();
    }
    let existing = existing.canonicalize().ok()?;
    let disks = sysinfo::Disks::new_with_refreshed_list().ok()?;
    disks
        .iter()
        .filter(|d| existing.starts_with(d.mount_point()))
        .max_by_key(|d| d.mount_point().as_os_str().len())
        .map(|d| d.available_space())
}

impl Downloader {
    /// Brings in the files `shards` of `card` need; `report` hears
    /// progress (never more than once a second while bytes flow).
    pub async fn run(
        &self,
        card: &v1::ModelCard,
        shards: &[v1::ShardSpec],
        report: &(dyn Fn(Ds) + Send + Sync),
        cancel: &CancellationToken,
    ) -> Outcome {
        match self.fetch(card, shards, report, cancel).await {
            Ok(outcome) => outcome,
            Err(_) if cancel.is_cancelled() => Outcome::Cancelled,
            Err(reason) => Outcome::Failed(reason),
        }
    }

    async fn fetch(
        &self,
        card: &v1::ModelCard,
        shards: &[v1::ShardSpec],
        report: &(dyn Fn(Ds) + Send + Sync),
        cancel: &CancellationToken,
    ) -> Result<Outcome, String> {
        let model_id = &card.model_id;
        let stages: Vec<Stage> = if shards.is_empty() {
            vec![Stage::Whole]
        } else {
            shards.iter().map(stage_of).collect()
        };
        // 1. A complete copy already on this node.
        for (dir, writable) in self.store.copies(model_id) {
            let listing = read_listing(&dir);
            if let Ok(needed) = needed_files(card, &stages, &dir, listing.as_ref()) {
                if needed.files.iter().all(|f| present(&dir, f)) {
                    return self.completed(model_id, &dir, writable, &needed).await;
                }
            }
        }
        let target = self.store.target(model_id);
        // 2. Offline: say exactly what is missing.
        let Some(client) = &self.client else {
            return Err(self.offline_error(card, &stages, &target));
        };
        let source = card
            .source
            .as_ref()
            .filter(|s| !s.hub_repo.is_empty())
            .ok_or_else(|| format!("{model_id} has no hub repository to download from"))?;
        let revision = if source.revision.is_empty() {
            "main"
        } else {
            &source.revision
        };
        let listing = client
            .list(&source.hub_repo, revision)
            .await
            .map_err(|e| e.to_string())?;
        std::fs::create_dir_all(target.join(NOTES_DIR))
            .map_err(|e| format!("{}: {e}", target.display()))?;
        write_listing(&target, &listing);
        if let Some(shards) = split_shards(card) {
            // Which shard holds which tensors: from the shards' headers.
            let notes = target.join(NOTES_DIR);
            index_shards(client, &listing, &shards, &target, &notes).await?;
        }
        // 3. The config, tokenizer and template files first: the index
        //    among them says which weight files the shard needs.
        let support: Vec<RepoFile> = if source.format == v1::WeightFormat::Safetensors as i32 {
            listing
                .files
                .iter()
                .filter(|f| SUPPORT_FILES.contains(&f.path.as_str()) && !present(&target, f))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        // Small: no progress of their own (the weights' progress counts them).
        let from = Origin {
            repo: &source.hub_repo,
            revision: &listing.commit,
            dir: &target,
        };
        self.download_all(&from, &support, 0, &|_| {}, cancel)
            .await?;
        let needed = needed_files(card, &stages, &target, Some(&listing))?;
        // 4. Room for what is missing, then the files.
        let missing: Vec<RepoFile> = needed
            .files
            .iter()
            .filter(|f| !present(&target, f))
            .cloned()
            .collect();
        let already = check_room(model_id, &target, &needed, &missing)?;
        self.download_all(&from, &missing, already, report, cancel)
            .await?;
        self.completed(model_id, &target, true, &needed).await
    }

    /// Why an offline node cannot have `card`: where it looked, and which
    /// files are missing.
    fn offline_error(&self, card: &v1::ModelCard, stages: &[Stage], target: &Path) -> String {
        let folders: Vec<String> = self
            .store
            .folders()
            .iter()
            .map(|f| f.path.display().to_string())
            .collect();
        let listing = read_listing(target);
        let missing = match needed_files(card, stages, target, listing.as_ref()) {
            Ok(needed) => needed
                .files
                .iter()
                .filter(|f| !present(target, f))
                .map(|f| f.path.clone())
                .collect::<Vec<_>>()
                .join(", "),
            Err(why) => why,
        };
        format!(
            "offline: {} is not complete in the model folders ({}); missing: {missing}",
            card.model_id,
            folders.join(", ")
        )
    }

    /// The outcome once `needed`'s files are in `dir`: a split GGUF's
    /// shards joined first (into `dir`, or the writable target when `dir`
    /// is read-only), unless a join of them is there already.
    async fn completed(
        &self,
        model_id: &str,
        dir: &Path,
        writable: bool,
        needed: &Needed,
    ) -> Result<Outcome, String> {
        let total_bytes = needed.files.iter().map(|f| f.size).sum();
        let Some((shards, index)) = &needed.split else {
            return Ok(Outcome::Completed {
                path: dir.join(&needed.load),
                total_bytes,
                read_only: !writable,
            });
        };
        let out_dir = if writable {
            dir.to_path_buf()
        } else {
            self.store.target(model_id)
        };
        let job = JoinJob {
            dir: dir.to_path_buf(),
            out: out_dir.join(&needed.load),
            shards: shards.clone(),
            needed: needed.files.iter().map(|f| f.path.clone()).collect(),
            index: index.clone(),
        };
        let path = tokio::task::spawn_blocking(move || job.run())
            .await
            .map_err(|e| format!("joining the shards: {e}"))??;
        Ok(Outcome::Completed {
            path,
            total_bytes,
            read_only: false,
        })
    }

    /// Downloads `files` into `dir`, `self.parallel` at a time; the first
    /// failure cancels the rest.
    async fn download_all(
        &self,
        from: &Origin<'_>,
        files: &[RepoFile],
        already: u64,
        report: &(dyn Fn(Ds) + Send + Sync),
        cancel: &CancellationToken,
    ) -> Result<(), String> {
        let Some(client) = &self.client else {
            return Err("offline".into());
        };
        if files.is_empty() {
            return Ok(());
        }
        let progress: Vec<Arc<FileProgress>> = files
            .iter()
            .map(|_| Arc::new(FileProgress::default()))
            .collect();
        let failed = cancel.child_token();
        report(snapshot(files, &progress, already, 0.0));
        // Owned inputs: the futures must not borrow from the iterator.
        let jobs: Vec<_> = files
            .iter()
            .cloned()
            .zip(progress.iter().cloned())
            .map(|(file, p)| download_one(client.clone(), from, file, p, failed.clone()))
            .collect();
        let mut results = futures_util::stream::iter(jobs).buffer_unordered(self.parallel.max(1));
        let mut ticker = tokio::time::interval(PROGRESS_EVERY);
        ticker.tick().await;
        let mut last = (Instant::now(), already);
        let mut speed = 0.0_f64;
        let mut first_error = None;
        loop {
            tokio::select! {
                next = results.next() => match next {
                    Some(Ok(())) => {}
                    Some(Err(error)) => {
                        first_error.get_or_insert(error);
                    }
                    None => break,
                },
                _ = ticker.tick() => {
                    let now_bytes = already
                        + progress.iter().map(|p| p.on_disk.load(Ordering::Relaxed)).sum::<u64>();
                    let dt = last.0.elapsed().as_secs_f64();
                    if dt > 0.0 {
                        let rate = now_bytes.saturating_sub(last.1) as f64 / dt;
                        speed = if speed == 0.0 { rate } else { 0.5 * speed + 0.5 * rate };
                    }
                    last = (Instant::now(), now_bytes);
                    report(snapshot(files, &progress, already, speed));
                }
            }
        }
        if cancel.is_cancelled() {
            return Err("cancelled".into());
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// Where files come from and go: a repository at a revision, a folder.
struct Origin<'a> {
    repo: &'a str,
    revision: &'a str,
    dir: &'a Path,
}

/// One file's download (which cancels the others when it fails).
fn download_one(
    client: Arc<HubClient>,
    from: &Origin<'_>,
    file: RepoFile,
    progress: Arc<FileProgress>,
    failed: CancellationToken,
) -> impl std::future::Future<Output = Result<(), String>> {
    let dest = from.dir.join(&file.path);
    let (repo, revision) = (from.repo.to_string(), from.revision.to_string());
    async move {
        let result = client
            .download(&repo, &revision, &file, &dest, &progress, &failed)
            .await;
        match result {
            Ok(stats) => {
                tracing::info!(
                    file = file.path,
                    bytes = file.size,
                    fetched = stats.bytes_fetched,
                    attempts = stats.attempts,
                    "downloaded"
                );
                Ok(())
            }
            Err(error) => {
                failed.cancel();
                Err(format!("{}: {error}", file.path))
            }
        }
    }
}

/// A download's progress: each file's bytes on disk (plus `already`, the
/// files that were complete), the speed and what is left at that speed.
fn snapshot(files: &[RepoFile], progress: &[Arc<FileProgress>], already: u64, speed: f64) -> Ds {
    let total = already + files.iter().map(|f| f.size).sum::<u64>();
    let mut downloaded = already;
    let per_file: Vec<v1::FileProgress> = files
        .iter()
        .zip(progress)
        .map(|(f, p)| {
            let on_disk = p.on_disk.load(Ordering::Relaxed);
            downloaded += on_disk;
            v1::FileProgress {
                path: f.path.clone(),
                downloaded_bytes: on_disk,
                total_bytes: f.size,
            }
        })
        .collect();
    let left = total.saturating_sub(downloaded);
    Ds::Ongoing(v1::DownloadOngoing {
        downloaded_bytes: downloaded,
        total_bytes: total,
        bytes_per_second: speed as u64,
        eta_ms: if speed > 0.0 {
            (left as f64 / speed * 1000.0) as u64
        } else {
            0
        },
        files: per_file,
    })
}

/// The repository listing saved beside a model's files, if any.
fn read_listing(dir: &Path) -> Option<RepoListing> {
    let text = std::fs::read(dir.join(NOTES_DIR).join(LISTING_FILE)).ok()?;
    serde_json::from_slice(&text).ok()
}

fn write_listing(dir: &Path, listing: &RepoListing) {
    let path = dir.join(NOTES_DIR).join(LISTING_FILE);
    match serde_json::to_vec_pretty(listing) {
        Ok(bytes) => {
            if let Err(error) = std::fs::write(&path, bytes) {
                tracing::warn!(%error, path = %path.display(), "saving the repository listing");
            }
        }
        Err(error) => tracing::warn!(%error, "encoding the repository listing"),
    }
}
/// Whether `target`'s disk has room for the `missing` files of `needed`
/// (and for joining a split GGUF); the bytes of `needed` already there.
fn check_room(
    model_id: &str,
    target: &Path,
    needed: &Needed,
    missing: &[RepoFile],
) -> Result<u64, String> {
    let total: u64 = needed.files.iter().map(|f| f.size).sum();
    let to_fetch: u64 = missing
        .iter()
        .map(|f| {
            let partial = tessera_hub::partial_path(&target.join(&f.path));
            f.size
                .saturating_sub(std::fs::metadata(partial).map_or(0, |m| m.len()))
        })
        .sum();
    // A split GGUF is joined into one more file of the same size.
    let joining: u64 = if needed.split.is_some() { total } else { 0 };
    if let Some(free) = free_space(target) {
        if to_fetch + joining > free {
            return Err(format!(
                "not enough disk space for {model_id} in {}: {} to download{}, {} free",
                target.display(),
                gb(to_fetch),
                if joining > 0 {
                    format!(" and {} to join its shards", gb(joining))
                } else {
                    String::new()
                },
                gb(free)
            ));
        }
    }
    Ok(total - missing.iter().map(|f| f.size).sum::<u64>())
}

/// The files `stages` of `card` need, from the listing (when known) and the
/// support files already in `dir` (the safetensors index among them).
fn needed_files(
    card: &v1::ModelCard,
    stages: &[Stage],
    dir: &Path,
    listing: Option<&RepoListing>,
) -> Result<Needed, String> {
    let source = card
        .source
        .as_ref()
        .ok_or_else(|| format!("{} has no source files", card.model_id))?;
    let listed = |path: &str| repo_file(source, listing, path);
    if source.format == v1::WeightFormat::Gguf as i32 {
        return needed_gguf(card, source, stages, dir, &listed);
    }
    // Safetensors: the support files the repository has (or, without a
    // listing, those present), then the weights the stages need.
    let mut files: Vec<RepoFile> = match listing {
        Some(l) => l
            .files
            .iter()
            .filter(|f| SUPPORT_FILES.contains(&f.path.as_str()))
            .map(|f| listed(&f.path))
            .collect(),
        None => SUPPORT_FILES
            .iter()
            .filter(|name| dir.join(name).is_file())
            .map(|name| listed(name))
            .collect(),
    };
    if !files.iter().any(|f| f.path == "config.json") {
        return Err("config.json (the model's file list is unknown)".into());
    }
    // A config that does not parse fails here, before any weights come.
    std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
        .ok_or_else(|| "config.json".to_string())?;
    let has_index = files.iter().any(|f| f.path == INDEX_FILE);
    let weights: BTreeSet<String> = if has_index {
        let index = std::fs::read(dir.join(INDEX_FILE)).map_err(|_| INDEX_FILE.to_string())?;
        let map = weights::parse_index(&index).map_err(|e| e.to_string())?;
        stages
            .iter()
            .flat_map(|stage| weights::files_for_stage(&map, stage))
            .collect()
    } else {
        BTreeSet::from([SINGLE_FILE.to_string()])
    };
    files.extend(weights.iter().map(|w| listed(w)));
    Ok(Needed {
        files,
        load: String::new(),
        split: None,
    })
}

/// The GGUF files the stages need: the shards holding their tensors (a
/// split GGUF, joined into one file to load), or the one file.
fn needed_gguf(
    card: &v1::ModelCard,
    source: &v1::ModelSource,
    stages: &[Stage],
    dir: &Path,
    listed: &dyn Fn(&str) -> RepoFile,
) -> Result<Needed, String> {
    if let Some(shards) = split_shards(card) {
        let index = read_index(dir, &dir.join(NOTES_DIR), &shards)
            .ok_or("the split GGUF's tensor index (read from its shards' headers)")?;
        let needed = shards_for(&index, stages);
        return Ok(Needed {
            files: shards
                .iter()
                .filter(|s| needed.contains(*s))
                .map(|s| listed(s))
                .collect(),
            load: joined_name(&shards),
            split: Some((shards, index)),
        });
    }
    let gguf = source
        .files
        .iter()
        .find(|f| f.path.ends_with(".gguf"))
        .ok_or_else(|| format!("the card of {} names no .gguf file", card.model_id))?;
    Ok(Needed {
        files: vec![listed(&gguf.path)],
        load: gguf.path.clone(),
        split: None,
    })
}

/// What is known of file `path`: the card pins what it knows (size,
/// digest), the repository's listing fills the gaps.
fn repo_file(source: &v1::ModelSource, listing: Option<&RepoListing>, path: &str) -> RepoFile {
    let from_card = source
        .files
        .iter()
        .find(|f| f.path == path)
        .map(|f| RepoFile {
            path: f.path.clone(),
            size: f.size_bytes,
            sha256: (!f.sha256.is_empty()).then(|| f.sha256.clone()),
            git_oid: None,
        });
    let from_listing = listing.and_then(|l| l.get(path)).cloned();
    match (from_card, from_listing) {
        (Some(card), Some(listed)) => RepoFile {
            size: if card.size > 0 {
                card.size
            } else {
                listed.size
            },
            sha256: card.sha256.or(listed.sha256),
            git_oid: listed.git_oid,
            path: card.path,
        },
        (Some(file), None) | (None, Some(file)) => file,
        (None, None) => RepoFile {
            path: path.to_string(),
            size: 0,
            sha256: None,
            git_oid: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folder_names_are_safe() {
        assert_eq!(
            folder_name("smollm2-135m-instruct-q4_1"),
            "smollm2-135m-instruct-q4_1"
        );
        assert_eq!(folder_name("Qwen/Qwen3-0.6B"), "Qwen--Qwen3-0.6B");
        assert_eq!(folder_name("../etc"), "_..--etc");
        assert_eq!(folder_name("a b"), "a_b");
    }

    #[test]
    fn downloads_go_to_a_writable_folder_that_has_the_model() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b, staged) = (
            tmp.path().join("a"),
            tmp.path().join("b"),
            tmp.path().join("staged"),
        );
        let store = ModelStore::new(a.clone(), vec![b.clone()], vec![staged.clone()]);
        assert_eq!(store.target("m"), a.join("m"));
        std::fs::create_dir_all(b.join("m")).unwrap();
        std::fs::create_dir_all(staged.join("m")).unwrap();
        assert_eq!(store.target("m"), b.join("m"));
        assert_eq!(store.delete("m").unwrap(), 1);
        assert!(staged.join("m").is_dir(), "read-only copies stay");
    }

    fn gguf_card(size: u64) -> v1::ModelCard {
        v1::ModelCard {
            model_id: "tiny".into(),
            n_layers: 2,
            source: Some(v1::ModelSource {
                hub_repo: "acme/tiny".into(),
                revision: String::new(),
                format: v1::WeightFormat::Gguf as i32,
                files: vec![v1::ModelFile {
                    path: "tiny.gguf".into(),
                    size_bytes: size,
                    sha256: String::new(),
                }],
            }),
            ..Default::default()
        }
    }

    fn downloader(store: ModelStore, client: Option<Arc<HubClient>>) -> Downloader {
        Downloader {
            store,
            client,
            parallel: 2,
        }
    }

    #[tokio::test]
    async fn a_model_staged_read_only_is_used_as_it_is() {
        let tmp = tempfile::tempdir().unwrap();
        let staged = tmp.path().join("staged");
        std::fs::create_dir_all(staged.join("tiny")).unwrap();
        std::fs::write(staged.join("tiny/tiny.gguf"), [7u8; 100]).unwrap();
        let store = ModelStore::new(tmp.path().join("models"), vec![], vec![staged.clone()]);
        // Offline: nothing may be fetched, and nothing needs to be.
        let outcome = downloader(store, None)
            .run(&gguf_card(100), &[], &|_| {}, &CancellationToken::new())
            .await;
        assert_eq!(
            outcome,
            Outcome::Completed {
                path: staged.join("tiny/tiny.gguf"),
                total_bytes: 100,
                read_only: true
            }
        );
    }

    #[tokio::test]
    async fn offline_names_the_missing_files() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ModelStore::new(tmp.path().join("models"), vec![], vec![]);
        // A copy of the wrong size does not count.
        std::fs::create_dir_all(tmp.path().join("models/tiny")).unwrap();
        std::fs::write(tmp.path().join("models/tiny/tiny.gguf"), [1u8; 10]).unwrap();
        let outcome = downloader(store, None)
            .run(&gguf_card(100), &[], &|_| {}, &CancellationToken::new())
            .await;
        let Outcome::Failed(reason) = outcome else {
            panic!("{outcome:?}");
        };
        assert!(reason.starts_with("offline: tiny"), "{reason}");
        assert!(reason.ends_with("missing: tiny.gguf"), "{reason}");
    }

    #[tokio::test]
    async fn a_download_larger_than_the_free_space_is_refused_before_it_starts() {
        let tmp = tempfile::tempdir().unwrap();
        let hub = tmp.path().join("hub/acme/tiny");
        std::fs::create_dir_all(&hub).unwrap();
        std::fs::write(hub.join("tiny.gguf"), [7u8; 100]).unwrap();
        let mirror = tessera_hub::mirror::Mirror::new(tmp.path().join("hub"));
        let (addr, _task) = mirror
            .clone()
            .start(([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        let client = Arc::new(HubClient::new(&format!("http://{addr}"), None).unwrap());
        let store = ModelStore::new(tmp.path().join("models"), vec![], vec![]);
        // The card claims a petabyte.
        let outcome = downloader(store.clone(), Some(client.clone()))
            .run(&gguf_card(1 << 50), &[], &|_| {}, &CancellationToken::new())
            .await;
        let Outcome::Failed(reason) = outcome else {
            panic!("{outcome:?}");
        };
        assert!(reason.contains("not enough disk space"), "{reason}");
        assert_eq!(mirror.stats().served("acme/tiny/tiny.gguf"), 0);
        // The true size downloads, with progress that ends complete.
        let reports = std::sync::Mutex::new(Vec::new());
        let outcome = downloader(store, Some(client))
            .run(
                &gguf_card(100),
                &[],
                &|state| reports.lock().unwrap().push(state),
                &CancellationToken::new(),
            )
            .await;
        assert!(
            matches!(
                outcome,
                Outcome::Completed {
                    total_bytes: 100,
                    read_only: false,
                    ..
                }
            ),
            "{outcome:?}"
        );
        assert_eq!(mirror.stats().served("acme/tiny/tiny.gguf"), 100);
        let reports = reports.into_inner().unwrap();
        assert!(
            matches!(reports.first(), Some(Ds::Ongoing(o)) if o.total_bytes == 100),
            "{reports:?}"
        );
    }
}
