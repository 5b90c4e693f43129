//! The inference engine: what part of a model a process owns, and (with the
//! engine issues) loading, architectures, collectives and generation.
//!
//! # Layout
//! - [`shard`]: [`ShardSpec`], the part of a model one rank owns, and the
//!   pure splitting rules (pipeline layers in proportion to memory, tensor
//!   KV-head groups, uneven splits allowed) that placement and loading share.
//!
//! # Invariants
//! - **The engine knows nothing of actors, zenoh or HTTP**: no dependency on
//!   ractor, zenoh or axum; callers drive it through plain types.

pub mod shard;

pub use shard::{split_evenly, split_proportionally, ShardError, ShardSpec};
