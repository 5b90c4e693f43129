//! `tessera models`: the model catalogue and downloads (a friendlier face
//! on the matching `tessera admin` requests), and `tessera hub serve`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use super::admin::{AddModelArgs, AdminArgs, AdminCommand, ClusterArgs, DownloadActionArg};

#[derive(Debug, Args)]
pub struct ModelsArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(subcommand)]
    pub what: ModelsCommand,
}

#[derive(Debug, Subcommand)]
pub enum ModelsCommand {
    /// The catalogue, with the nodes that hold each model's files.
    List,
    /// Add a model from a hub repository (OWNER/NAME): a safetensors one's
    /// card from its config and file list, a GGUF one's from the chosen
    /// file's headers (--file or --quant; default Q4_K_M, else the closest).
    Add(AddModelArgs),
    /// Download a model's files on a node (default: every node).
    Download {
        model: String,
        #[arg(long)]
        on: Option<String>,
    },
    /// Cancel a model's download on a node (default: every node).
    Cancel {
        model: String,
        #[arg(long)]
        on: Option<String>,
    },
    /// Delete a model's downloaded files on a node (default: every node).
    Delete {
        model: String,
        #[arg(long)]
        on: Option<String>,
    },
    /// Every node's downloads and their progress.
    Downloads,
}

pub fn run(args: ModelsArgs) -> anyhow::Result<()> {
    let what = match args.what {
        ModelsCommand::List => AdminCommand::Models,
        ModelsCommand::Add(args) => AdminCommand::AddModel(args),
        ModelsCommand::Download { model, on } => AdminCommand::Download {
            model,
            on,
            action: DownloadActionArg::Start,
        },
        ModelsCommand::Cancel { model, on } => AdminCommand::Download {
            model,
            on,
            action: DownloadActionArg::Cancel,
        },
        ModelsCommand::Delete { model, on } => AdminCommand::Download {
            model,
            on,
            action: DownloadActionArg::Delete,
        },
        ModelsCommand::Downloads => AdminCommand::Downloads,
    };
    super::admin::run(AdminArgs {
        cluster: args.cluster,
        node: None,
        what,
    })
}

#[derive(Debug, Args)]
pub struct HubArgs {
    #[command(subcommand)]
    pub what: HubCommand,
}

#[derive(Debug, Subcommand)]
pub enum HubCommand {
    /// Serve a folder of repositories (ROOT/OWNER/NAME/...) over the hub's
    /// protocol, so machines without internet can download from this one
    /// with HF_ENDPOINT=http://THIS-HOST:PORT.
    Serve {
        #[arg(long)]
        root: PathBuf,
        #[arg(long, default_value = "0.0.0.0:8808")]
        listen: SocketAddr,
    },
}

pub fn run_hub(args: HubArgs) -> anyhow::Result<()> {
    let HubCommand::Serve { root, listen } = args.what;
    anyhow::ensure!(root.is_dir(), "{} is not a folder", root.display());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        let bound = listener.local_addr()?;
        println!(
            "{}",
            serde_json::json!({ "endpoint": format!("http://{bound}") })
        );
        eprintln!(
            "serving the repositories under {} on http://{bound} (HF_ENDPOINT=http://{bound})",
            root.display()
        );
        tessera_hub::mirror::Mirror::new(root)
            .serve(listener)
            .await
            .context("serving")
    })
}
