//! The cluster's one ordered log and who writes it.
//!
//! # Layout
//! - [`election`]: master election, a pure state machine, and
//!   [`election::actor`], which runs it over zenoh and starts the
//!   [`master`] on the winner.
//! - [`master`]: the Master actor, the log's one writer: commands and
//!   local events in, indexed events out; [`commands`]: what a command
//!   stands for, decided from the state alone (pure).
//! - [`placement`]: which nodes run a model and how it is split (pure).
//! - [`replica`]: every node's copy of the log, persisted in order, with
//!   catch-up; [`log_sync`]: how a follower's log comes to agree with its
//!   master's (a forked tail is dropped), pure.
//! - [`local_events`]: this node's reports to the master, in one ordered
//!   sequence that survives a master change.

pub mod commands;
pub mod election;
#[cfg(test)]
mod failover_sim;
pub mod local_events;
pub mod log_sync;
pub mod master;
pub mod placement;
pub mod replica;
