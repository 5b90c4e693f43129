//! Weight matrices of any supported storage, and the trait every model file
//! format implements so that loading is one piece of code.

use std::ops::Range;

use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};

use crate::quant::{self, Activations, QMatrix};
use crate::threadpool::ThreadPool;

/// Why (part of) a model could not be loaded. Every message names the file,
/// and the tensor where there is one.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a readable model file: {reason}")]
    Format { path: String, reason: String },
    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor { path: String, tensor: String },
    #[error("{path}: tensor `{tensor}` is truncated: it needs {needed} bytes at offset {offset}, the file has {file_len}")]
    Truncated {
        path: String,
        tensor: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },
    #[error("{path}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    Shape {
        path: String,
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("{path}: tensor `{tensor}` is stored as {dtype}, which this engine cannot run")]
    UnsupportedType {
        path: String,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: metadata `{key}` {problem}")]
    Metadata {
        path: String,
        key: String,
        problem: String,
    },
    #[error(
        "{path}: unsupported architecture `{name}` (supported: {})",
        super::config::Architecture::KNOWN
    )]
    UnsupportedArchitecture { path: String, name: String },
    #[error("{path}: {source}")]
    Config {
        path: String,
        #[source]
        source: super::config::ConfigError,
    },
    #[error("{path}: tensor `{tensor}`: {reason}")]
    Tensor {
        path: String,
        tensor: String,
        reason: String,
    },
}

/// A weight matrix: our native formats (fast kernels), or candle's
/// quantized matmul for the formats we have no kernel for.
pub enum Matrix {
    Native(QMatrix),
    Candle {
        inner: QMatMul,
        rows: usize,
        cols: usize,
        dtype: String,
    },
}

impl Matrix {
    pub fn rows(&self) -> usize {
        match self {
            Self::Native(m) => m.rows(),
            Self::Candle { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Self::Native(m) => m.cols(),
            Self::Candle { cols, .. } => *cols,
        }
    }

    /// Bytes of weights held.
    pub fn size_bytes(&self) -> usize {
        match self {
            Self::Native(m) => m.size_bytes(),
            Self::Candle { inner, .. } => match inner {
                QMatMul::QTensor(t) => t.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                    t.elem_count() * t.dtype().size_in_bytes()
                }
            },
        }
    }

    /// Short name of the storage format, for logs and stats.
    pub fn format_name(&self) -> String {
        match self {
            Self::Native(m) => format!("{:?}", m.format()),
            Self::Candle { dtype, .. } => dtype.clone(),
        }
    }

    /// [`Matrix::matmul`] for several matrices over the same input, in one
    /// parallel region when all are native.
    pub fn matmul_many<const N: usize>(
        mats: [&Matrix; N],
        x: &mut Activations,
        rows: usize,
        input: &[f32],
        outs: [&mut [f32]; N],
        pool: &ThreadPool,
    ) -> Result<(), candle_core::Error> {
        let natives = mats.map(|m| match m {
            Matrix::Native(q) => Some(q),
            Matrix::Candle { .. } => None,
        });
        if let (true, Some(first)) = (
            natives.iter().all(Option::is_some),
            natives.iter().flatten().next(),
        ) {
            // All native: `unwrap_or` never falls back here.
            let ws = natives.map(|q| q.unwrap_or(first));
            quant::matmul_many(ws, x, outs, pool);
            return Ok(());
        }
        for (m, out) in mats.into_iter().zip(outs) {
            m.matmul(x, rows, input, out, pool)?;
        }
        Ok(())
    }

    /// [`Matrix::matmul`] for the rows `tokens` of `x` (of `input`, which
    /// it holds), each token's results at `layout` in `out` (see
    /// [`quant::matmul_region`]).
    pub fn matmul_region(
        &self,
        x: &mut Activations,
        input: &[f32],
        tokens: Range<usize>,
        out: &mut [f32],
        layout: quant::OutLayout,
        pool: &ThreadPool,
    ) -> Result<(), candle_core::Error> {
        let rows = self.rows();
        match self {
            Self::Native(m) => {
                quant::matmul_region(m, x, tokens, out, layout, pool);
                Ok(())
            }
            Self::Candle { .. } => {
                let cols = self.cols();
                let mut part = Activations::default();
                let from = &input[tokens.start * cols..tokens.end * cols];
                part.set(from, tokens.len(), cols);
                let mut results = vec![0.0; tokens.len() * rows];
                self.matmul(&mut part, tokens.len(), from, &mut results, pool)?;
                for (t, row) in tokens.zip(results.chunks_exact(rows)) {
                    let at = t * layout.stride + layout.offset;
                    out[at..at + rows].copy_from_slice(row);
                }
                Ok(())
            }
        }
    }

    /// `out = x @ self^T` for every row of `x`.
    pub fn matmul(
        &self,
        x: &mut Activations,
        rows: usize,
        input: &[f32],
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), candle_core::Error> {
        match self {
            Self::Native(m) => {
                quant::matmul(m, x, out, pool);
                Ok(())
            }
            Self::Candle {
                inner,
                rows: out_cols,
                cols,
                ..
            } => {
                let t = Tensor::from_slice(&input[..rows * cols], (rows, *cols), &Device::Cpu)?;
                let y = inner.forward(&t)?.flatten_all()?.to_vec1::<f32>()?;
                out[..rows * out_cols].copy_from_slice(&y);
                Ok(())
            }
        }
    }
}

/// A model file (or folder) that can hand over tensors by their canonical
/// (GGUF) names: `token_embd.weight`, `blk.{i}.attn_q.weight`, ...
pub trait TensorSource {
    /// The file or folder, for error messages.
    fn path(&self) -> &str;
    /// Shape as `[rows, cols]` (or `[len]`), if the tensor exists.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Loads rows `rows` and columns `cols` of a 2-D tensor (`None`: all),
    /// reading no more of the file than the part needs where the format
    /// allows (tensor-parallel ranks own row or column slices).
    fn matrix_part(
        &self,
        name: &str,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
    ) -> Result<Matrix, LoadError>;
    /// Loads a 2-D tensor, or only rows `rows` of it.
    fn matrix(&self, name: &str, rows: Option<Range<usize>>) -> Result<Matrix, LoadError> {
        self.matrix_part(name, rows, None)
    }
    /// Values per quantization block along a row: column slices that start
    /// and end on a multiple keep the stored blocks as they are.
    fn column_block(&self, _name: &str) -> usize {
        1
    }
    /// Loads a 1-D tensor as f32.
    fn vector(&self, name: &str) -> Result<Vec<f32>, LoadError>;

    fn contains(&self, name: &str) -> bool {
        self.shape(name).is_some()
    }

    /// Checks a tensor's shape before loading it.
    fn expect_shape(&self, name: &str, expected: &[usize]) -> Result<(), LoadError> {
        match self.shape(name) {
            None => Err(LoadError::MissingTensor {
                path: self.path().to_string(),
                tensor: name.to_string(),
            }),
            Some(actual) if actual != expected => Err(LoadError::Shape {
                path: self.path().to_string(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                actual,
            }),
            Some(_) => Ok(()),
        }
    }
}
