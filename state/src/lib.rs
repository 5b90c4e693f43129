//! The cluster's event-sourced state and its persistent, indexed event log.
//!
//! # Layout
//! - [`state`]: [`State`], the fold of the indexed event log, with the pure
//!   [`State::apply`] and the canonical [`State::digest`]; `apply` holds
//!   how each kind of event changes it, one function per kind.
//! - [`log`]: [`EventLog`], the sled-backed log of `IndexedEvent`s
//!   (`crc32 ‖ protobuf` under a big-endian u64 key) and its State snapshots.
//! - [`replay`]: folding a log back into a [`State`], from the nearest
//!   snapshot, and [`Journal`], the persist-then-apply write path a node uses.
//! - [`synthetic`]: deterministic, realistic event streams for benchmarks and
//!   property tests.
//!
//! # Invariants
//! - **`apply` is pure and total**: no IO, no clock, no randomness, no panic.
//!   An event out of order is an error value and changes nothing; an event
//!   naming something unknown is a no-op reported as [`Applied::Ignored`].
//! - **Persist before apply**: [`Journal::commit`] checks an event against the
//!   State, writes it to the log, then applies it.
//! - **Only [`log`] touches sled.**
//! - Equal states have equal encodings (all maps are ordered), hence equal
//!   digests, on every node and in `tessera replay`.

mod apply;
pub mod log;
pub mod replay;
pub mod state;
pub mod synthetic;

pub use log::{EventLog, LogError, LogView};
pub use replay::{replay, Journal, JournalError, ReplayError, ReplayOptions, Replayed};
pub use state::{
    command_applied, validate_event, Applied, ApplyError, Ignored, InvalidEvent, State,
};
pub use tessera_protos::v1;
