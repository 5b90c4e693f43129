//! The state crate's integration tests, in one binary: the sled event log
//! and the properties of applying events.

mod event_log;
mod properties;
