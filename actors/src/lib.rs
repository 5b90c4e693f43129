//! The node's actors and their pure decision logic.
//!
//! # Layout
//! - [`keys`]: every zenoh key expression of DESIGN.md section 4, built in
//!   this one module.
//!
//! The actors themselves (Router, Election, Master, Worker, RunnerSupervisor,
//! Runner, Downloads, Api) arrive with the cluster issue.

pub mod keys;

pub use keys::{AdminMethod, KeyError, Keys};
