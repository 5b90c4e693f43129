//! The node's actors and their pure decision logic.
//!
//! # Layout
//! - [`keys`]: every zenoh key expression of DESIGN.md section 4, built in
//!   this one module.
//! - [`placement`]: which nodes run a model and how it is split (pure).
//! - [`election`]: master election as a pure state machine;
//!   [`log_sync`]: how a follower's log comes to agree with its master's
//!   (a forked tail is dropped), also pure.
//! - [`plan`]: a worker's next step from the cluster state (pure).
//! - [`node`]: a running node: identity, zenoh session, router tasks;
//!   [`replica`] (the persisted log, in order, with catch-up),
//!   [`election_actor`] (which starts the [`master`] on the winner),
//!   [`bus`] (typed zenoh), [`local_events`] (this node's reports to the
//!   master, in one ordered sequence), [`catalogue`] (model cards;
//!   [`gguf_card`]: a GGUF repository's card from its files' headers),
//!   [`throttle`] (rate-limited logging).
//! - [`worker`]: the Worker actor, which takes the plan's steps: runner
//!   processes it supervises, and downloads it hands to its child, the
//!   Downloads actor ([`downloads_actor`]), which runs [`downloads`] jobs
//!   ([`gguf_split`]: a split GGUF's shards per stage, joined into one file).
//! - [`admin`]: the admin service's error model, typed and on the wire.
//! - [`generation`]: one generation followed from its command to its last
//!   chunk, for the HTTP API (crate `tessera-api`) and [`admin_client`].

/// The longest one actor waits for another's answer: a stuck actor becomes
/// an error where it is asked, never a hang.
pub const ACTOR_CALL_MS: u64 = 10_000;

pub mod admin;
pub mod admin_client;
pub mod bus;
pub mod catalogue;
pub mod downloads;
pub mod downloads_actor;
pub mod election;
pub mod election_actor;
#[cfg(test)]
mod failover_sim;
pub mod generation;
pub mod gguf_card;
pub mod gguf_split;
pub mod keys;
pub mod local_events;
pub mod log_sync;
pub mod master;
pub mod node;
pub mod placement;
pub mod plan;
pub mod replica;
pub mod runner;
pub mod runner_protocol;
pub mod runner_supervisor;
pub mod throttle;
pub mod worker;

pub use keys::{AdminMethod, KeyError, Keys};
