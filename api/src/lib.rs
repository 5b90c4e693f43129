//! The HTTP API every node serves (axum): OpenAI Chat Completions and
//! Responses, Anthropic Messages, Ollama, and the cluster's own endpoints.
//! Any node answers any request: a generation becomes a TextGeneration
//! command for the master, which gives it to a ready instance, and the
//! chunks come back from that instance's rank 0 on `chunks/{command_id}`.
//!
//! # Layout
//! - [`server`]: the router and the accept loop (connection limits).
//! - [`context`]: what every handler holds ([`context::Api`]: the node's
//!   handles, the options) and admission (a bound per model).
//! - [`options`]: [`ApiOptions`], how the API serves.
//! - [`ready`]: what a request's `model` names, and the wait for a ready
//!   instance (placing one where allowed).
//! - [`answer`]: a generation from its first chunk to the client (tried
//!   again when its instance went away).
//! - [`sse`]: server-sent events, and [`body`]: a JSON body or a 400.
//! - [`choices`]: the n answers of one request (`n`), started together and
//!   streamed as numbered choices.
//! - [`constraint`]: structured outputs (`response_format`, `text.format`,
//!   Ollama's `format`, `tessera.regex`/`grammar`) and `logit_bias`, read
//!   into the wire's constraint and bias.
//! - [`extras`]: each dialect's fields beyond those mapped: not
//!   applicable, or refused by name; unknown fields are refused.
//! - [`valid`]: the one check of a generation's parameters, the engine's
//!   own, which every dialect's mapper ends with.
//! - one module per dialect, the pure mapper (`openai`, `completions`,
//!   `anthropic`, `ollama`, `responses`), with its HTTP handlers in
//!   `{dialect}/handlers`; [`embeddings`], OpenAI's and Ollama's
//!   embedding endpoints, the same way.
//! - [`cluster`]: `/models`, `/instance/...`, `/download/...`, `/models/add`,
//!   `/events`: the admin service over HTTP.
//! - [`live`]: `/cluster`, `/state`, `/state/stream` (pushed on each
//!   change) and `/state/at` (time travel): what the dashboard watches.
//! - [`dashboard`]: the dashboard's page and assets (`dashboard/`), at `/`.
//! - [`join`]: `/cluster/join`, where a machine with a join token gets its
//!   certificate from the authority's node.
//! - [`auth`]: API keys (`Authorization: Bearer`, `x-api-key`), a 401 in
//!   each dialect's shape.
//! - [`error`]: [`error::ApiError`] and the one mapping of an error kind to its
//!   HTTP status.
//! - [`extension`]: the `tessera` object of request bodies (per-request
//!   `speculative: false`) and of answers' usage (drafted and accepted
//!   tokens, decode steps).

mod answer;
pub mod anthropic;
mod auth;
mod body;
mod choices;
mod cluster;
pub mod completions;
mod constraint;
mod context;
mod dashboard;
pub mod embeddings;
pub mod error;
pub mod extension;
mod extras;
mod join;
mod live;
pub mod ollama;
pub mod openai;
mod options;
mod ready;
pub mod responses;
mod server;
mod sse;
mod valid;

pub use auth::ApiKeys;
pub use options::ApiOptions;
pub use server::{serve, ApiServer};
