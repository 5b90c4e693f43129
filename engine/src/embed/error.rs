//! What goes wrong in loading an embedding model or embedding an input: the
//! bottom of the `embed` folder, which every file of it uses.

/// Why a model cannot embed, or an input cannot be embedded.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Format { path: String, reason: String },
    #[error("this embedding model is not supported: {0}")]
    Unsupported(String),
    #[error("the model: {0}")]
    Model(String),
    #[error("the tokenizer: {0}")]
    Tokenizer(String),
    /// The request's fault (a 400).
    #[error("input {index}: {reason}")]
    Input { index: usize, reason: String },
}

impl EmbedError {
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, Self::Input { .. })
    }
}
