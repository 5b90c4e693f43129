//! `tessera`: the one binary. Subcommands only; the work lives in the crates.

mod cli;

use std::process::ExitCode;

use clap::Parser;

// sled and the engine allocate many small, short-lived buffers across
// threads; mimalloc handles that pattern markedly better than glibc's malloc
// (measured with `tessera bench log`, see docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc asks for transparent huge pages for its arenas, and a 2 MB page
/// is resident as soon as one byte of it is touched: scratch buffers and the
/// KV cache cost a sixth more memory than they use (185 MB against 169 MB
/// peak for the default model's bench), for no speed we could measure. The
/// weights are the mapped model file's own pages either way.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and only sets a flag
    // of this process; a kernel without it returns an error we can ignore.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
            // Zenoh warns on every TLS link that names go unchecked: by design
            // here (peers are checked against the cluster's authority).
            .add_directive("zenoh_link_tls::utils=error".parse().unwrap_or_else(|_| {
                tracing_subscriber::filter::Directive::from(tracing::Level::WARN)
            }));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    // Ring's rustls, refusing revoked members at a secured cluster's
    // handshakes (the same provider otherwise); the hub's if it cannot be.
    if tessera_trust::handshake::install().is_err() {
        tessera_hub::install_tls_provider();
    }
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
