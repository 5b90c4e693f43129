//! The node's actors and their pure decision logic.
//!
//! # Layout
//! - [`node`]: a running node: identity, zenoh session, router tasks,
//!   the admin service's queryables; it starts the actors below.
//! - [`cluster`]: the ordered log and who writes it: election, master,
//!   placement, the replica and log sync, this node's local events.
//! - [`worker`]: the Worker actor, which takes the pure [`worker::plan`]'s
//!   steps: runner processes it supervises
//!   ([`worker::runner_supervisor`], [`worker::runner_protocol`]), and
//!   downloads it hands to its child ([`worker::downloads`]).
//! - [`runner`]: the Runner actor inside a `tessera runner` child, over
//!   the engine.
//! - [`bus`]: the typed zenoh session; [`bus::keys`]: every key
//!   expression of DESIGN.md section 4, built in this one module.
//! - [`catalogue`]: model cards ([`catalogue::gguf_card`]: a GGUF
//!   repository's card from its files' headers).
//! - [`admin`]: the admin service's error model, typed and on the wire;
//!   [`admin::client`]: a typed client of it for programs outside the
//!   cluster.
//! - [`generation`]: one generation followed from its command to its last
//!   chunk, for the HTTP API (crate `tessera-api`) and the admin client.
//! - [`throttle`]: rate-limited logging.

/// The longest one actor waits for another's answer: a stuck actor becomes
/// an error where it is asked, never a hang.
pub const ACTOR_CALL_MS: u64 = 10_000;

pub mod admin;
pub mod bus;
pub mod catalogue;
pub mod cluster;
pub mod generation;
pub mod node;
pub mod runner;
pub mod throttle;
pub mod worker;

pub use bus::keys::{AdminMethod, KeyError, Keys};
