//! How a model is split across ranks ([`shard`]) and how the ranks talk
//! ([`collectives`], over TCP rings secured by [`ring_security`]).

pub mod collectives;
pub mod ring_security;
pub mod shard;
