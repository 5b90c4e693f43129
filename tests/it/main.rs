//! The node's end-to-end tests, in one binary (one link of the whole stack
//! instead of five): the HTTP API with official clients, the cluster of real
//! nodes on loopback, the dashboard in a real browser, and the CLI's
//! generate, replay and distributed modes.

// Test code: an unwrap or expect that fails is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api;
mod cluster;
mod dashboard;
mod distributed_cli;
mod embeddings;
mod faults;
mod generate_cli;
mod gguf_repo;
mod gpu;
mod replay_cli;
mod secure;
mod speculative;
mod structured;
mod support;
