//! The engine's integration tests, in one binary: each test file used to be
//! its own binary, and linking the engine and candle into each one cost CI
//! minutes and gigabytes of disk.

// Test code: an unwrap or expect that fails is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod architectures;
mod batching;
mod distributed;
mod embeddings;
mod golden;
mod gpu;
mod hf_reference;
mod kquants;
mod safetensors;
mod sentencepiece;
mod speculative;
mod structured;
mod tensor_exact;
mod tensor_parallel;
mod tools;
