//! An embedding model's `model.safetensors`, mapped, its tensors read as
//! f32 by name (F32, F16 and BF16 stored), with or without the `bert.`
//! prefix some checkpoints carry.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::error::EmbedError;

pub struct Tensors {
    path: PathBuf,
    map: memmap2::Mmap,
    /// The prefix the checkpoint's names carry (`""` or `"bert."`).
    prefix: String,
}

impl Tensors {
    pub fn open(path: &Path) -> Result<Self, EmbedError> {
        let file = std::fs::File::open(path).map_err(|source| EmbedError::Io {
            path: path.display().to_string(),
            source,
        })?;
        // SAFETY: the file is opened read-only and model files are not
        // changed while a node serves them (downloads write elsewhere and
        // rename into place).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| EmbedError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let tensors = Self {
            path: path.to_path_buf(),
            map,
            prefix: String::new(),
        };
        let prefixed = tensors
            .read()?
            .names()
            .into_iter()
            .any(|n| n.starts_with("bert.embeddings."));
        let prefix = if prefixed { "bert." } else { "" };
        Ok(Self {
            prefix: prefix.into(),
            ..tensors
        })
    }

    fn read(&self) -> Result<SafeTensors<'_>, EmbedError> {
        SafeTensors::deserialize(&self.map).map_err(|e| EmbedError::Format {
            path: self.path.display().to_string(),
            reason: e.to_string(),
        })
    }

    /// Tensor `name`, which must have `shape`, as f32.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EmbedError> {
        let full = format!("{}{name}", self.prefix);
        let tensors = self.read()?;
        let view = tensors.tensor(&full).map_err(|_| EmbedError::Format {
            path: self.path.display().to_string(),
            reason: format!("tensor `{full}` is missing"),
        })?;
        if view.shape() != shape {
            return Err(EmbedError::Format {
                path: self.path.display().to_string(),
                reason: format!(
                    "tensor `{full}` has shape {:?}, expected {shape:?}",
                    view.shape()
                ),
            });
        }
        let data = view.data();
        Ok(match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(EmbedError::Format {
                    path: self.path.display().to_string(),
                    reason: format!("tensor `{full}` is stored as {other:?}"),
                })
            }
        })
    }
}
