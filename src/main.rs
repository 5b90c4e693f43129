//! `tessera`: the one binary. Subcommands only; the work lives in the crates.

mod cli;

use std::process::ExitCode;

use clap::Parser;

// sled and the engine allocate many small, short-lived buffers across
// threads; mimalloc handles that pattern markedly better than glibc's malloc
// (measured with `tessera bench log`, see the README's benchmark section).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    tessera_hub::install_tls_provider();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
