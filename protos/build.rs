//! Compiles `proto/tessera/v1/*.proto` with protox (pure Rust, so no system
//! `protoc` is needed), generates prost types with ordered maps (so encodings
//! are canonical) and pbjson serde impls (proto3 JSON mapping).

use std::error::Error;
use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn Error>> {
    let include = PathBuf::from("proto");
    let mut files: Vec<PathBuf> = std::fs::read_dir(include.join("tessera/v1"))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "proto"))
        .collect();
    files.sort();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    println!("cargo:rerun-if-changed=proto");

    let descriptors = protox::compile(&files, [&include])?;
    let descriptor_bytes = descriptors.encode_to_vec();
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("tessera_descriptor.bin"), &descriptor_bytes)?;

    prost_build::Config::new()
        .btree_map(["."])
        .compile_fds(descriptors)?;
    pbjson_build::Builder::new()
        .register_descriptors(&descriptor_bytes)?
        .btree_map(["."])
        .build(&[".tessera"])?;
    Ok(())
}
