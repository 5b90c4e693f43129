//! Arguments shared by the commands that load a model, and how a model name
//! resolves to files.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use tessera_engine::dist::shard::ShardSpec;
use tessera_engine::gpu::DeviceChoice;
use tessera_engine::serve::LoadedModel;

/// The default model (its card is in resources/model_cards/).
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct-q4_1";

#[derive(Debug, Args, Clone)]
pub struct ModelArgs {
    /// A .gguf file, a Hugging Face folder (config.json + safetensors), or a
    /// model id from the catalogue, looked up in $TESSERA_HOME/models/ID.
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Compute threads (default: all cores; with --world, per rank and 1).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the model runs: auto (a hardware GPU that runs it, else the
    /// CPU), cpu, gpu, or gpu:N (an adapter of `tessera devices`).
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
}

impl ModelArgs {
    pub fn threads(&self) -> usize {
        self.threads
            .filter(|t| *t > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Threads per rank of a distributed run (default 1: the ranks share
    /// this machine's cores).
    pub fn rank_threads(&self) -> usize {
        self.threads.filter(|t| *t > 0).unwrap_or(1)
    }

    pub fn load(&self, quiet: bool) -> anyhow::Result<LoadedModel> {
        self.load_shard(None, quiet)
    }

    /// Loads only `spec`'s part of the weights (rank 0 of a distributed run).
    pub fn load_shard(&self, spec: Option<&ShardSpec>, quiet: bool) -> anyhow::Result<LoadedModel> {
        let path = resolve_model(&self.model)?;
        let interactive = !quiet && std::io::stderr().is_terminal();
        let started = std::time::Instant::now();
        let mut model = LoadedModel::load_shard(&path, spec, |done, total| {
            if interactive {
                eprint!("\rloading {}: {done}/{total} parts", path.display());
            }
        })
        .map_err(|error| {
            // The engine's errors name the file already: say it once.
            let shown = path.display().to_string();
            if error.to_string().contains(&shown) {
                anyhow::Error::new(error)
            } else {
                anyhow::Error::new(error).context(format!("loading model {shown}"))
            }
        })?;
        let device = model
            .transformer
            .use_device(self.device)
            .with_context(|| format!("--device {}", self.device))?;
        if !quiet {
            eprintln!(
                "{}loaded {} ({:.0} MB of weights) in {:.2} s, on {device}",
                if interactive { "\r" } else { "" },
                path.display(),
                model.transformer.weight_bytes() as f64 / 1e6,
                started.elapsed().as_secs_f64()
            );
        }
        Ok(model)
    }
}

/// A path as given, or a catalogue id under `$TESSERA_HOME/models` (a
/// hub-style id `OWNER/NAME` in the folder `OWNER--NAME`).
pub fn resolve_model(model: &str) -> anyhow::Result<PathBuf> {
    let as_path = Path::new(model);
    if as_path.exists() {
        return Ok(as_path.to_path_buf());
    }
    let models = super::support::default_data_dir().join("models");
    let hub_style = models.join(tessera_actors::worker::downloads::folder_name(model));
    if model.contains('/') && !hub_style.is_dir() || model.ends_with(".gguf") {
        bail!("model path {model} does not exist");
    }
    let folder = models.join(tessera_actors::worker::downloads::folder_name(model));
    if !folder.is_dir() {
        bail!(
            "model `{model}` not found: it is not a path, and {} does not exist{}",
            folder.display(),
            if model == DEFAULT_MODEL {
                " (run scripts/fetch-model to install the default model)"
            } else {
                ""
            }
        );
    }
    if folder.join("config.json").is_file() {
        return Ok(folder);
    }
    let mut ggufs: Vec<PathBuf> = std::fs::read_dir(&folder)
        .with_context(|| format!("reading {}", folder.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    ggufs.sort();
    match ggufs.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "{} holds neither a .gguf file nor config.json",
            folder.display()
        ),
        many => bail!(
            "{} holds {} .gguf files; name one with --model PATH",
            folder.display(),
            many.len()
        ),
    }
}
