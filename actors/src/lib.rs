//! The node's actors and their pure decision logic.
//!
//! # Layout
//! - [`keys`]: every zenoh key expression of DESIGN.md section 4, built in
//!   this one module.
//! - [`placement`]: which nodes run a model and how it is split (pure).
//! - [`election`]: master election as a pure state machine.
//! - [`plan`]: a worker's next step from the cluster state (pure).
//!
//! The actors themselves (Router, Election, Master, Worker, RunnerSupervisor,
//! Runner, Downloads, Api) build on these with the rest of the cluster issue.

pub mod election;
pub mod keys;
pub mod placement;
pub mod plan;

pub use keys::{AdminMethod, KeyError, Keys};
