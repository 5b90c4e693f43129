//! `tessera devices`: the GPU adapters this machine has, as `--device
//! gpu:N` counts them, and what each can do.

use clap::Args;
use tessera_engine::gpu;

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// One JSON object per adapter, one per line.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    let adapters = gpu::adapters();
    if adapters.is_empty() && !args.json {
        println!("no GPU adapter (the CPU serves); on Linux a Vulkan driver gives one");
    }
    for a in &adapters {
        if args.json {
            let line = serde_json::json!({
                "index": a.index,
                "name": a.name,
                "backend": a.backend,
                "kind": a.kind.name(),
                "driver": a.driver,
                "memory_bytes": a.memory_bytes,
                "unified_memory": a.unified_memory,
                "shader_f16": a.shader_f16,
                "subgroups": a.subgroups,
                "timestamps": a.timestamps,
            });
            println!("{line}");
        } else {
            let can: Vec<&str> = [
                (a.shader_f16, "f16"),
                (a.subgroups, "subgroups"),
                (a.timestamps, "timestamps"),
            ]
            .into_iter()
            .filter_map(|(has, what)| has.then_some(what))
            .collect();
            let memory = match (a.memory_bytes, a.unified_memory) {
                (0, _) => "memory unknown".to_string(),
                (bytes, true) => format!("{:.1} GB shared", bytes as f64 / 1e9),
                (bytes, false) => format!("{:.1} GB", bytes as f64 / 1e9),
            };
            println!(
                "gpu:{}  {}  ({}, {}, {memory}; {})  {}",
                a.index,
                a.name,
                a.backend,
                a.kind.name(),
                a.driver,
                can.join(", ")
            );
        }
    }
    Ok(())
}
