//! The oqp data plane: an admission-control proxy that runs beside each
//! Ollama GPU box.
//!
//! It dials the control plane, waits for the first policy snapshot, then
//! serves HTTP. Components, in the order a request meets them:
//!
//! - [`server`]: listeners (main port and injection ports), graceful
//!   shutdown; [`connections`]: the connection caps every listener shares;
//!   [`tls`]: TLS on a listener, its certificate reloaded in place;
//! - [`service`]: the request path, phase by phase, and the one place errors
//!   become HTTP ([`error`]);
//! - [`endpoint`]: which paths are metadata, inference or management;
//! - [`queued`]: admission, the wait for a slot, and the send;
//! - [`translate`]: Ollama's own API in front of OpenAI-compatible engines;
//! - [`proxy`], [`forward`] and [`upstream`]: sending to a host, failover
//!   before the first byte, streaming the answer back with its resources
//!   held to the end;
//! - [`scheduler`]: tiers, fair share, caps, expiry (pure, no I/O);
//! - [`snapshot`] and [`policy`]: the one immutable policy behind an `ArcSwap`;
//! - [`control`]: the watch of the policy stream and the status reports;
//! - [`supervise`]: each new snapshot applied part by part, a panic in one
//!   part caught and reported;
//! - [`status`], [`metrics`] and [`dashboard`]: what the data plane shows of
//!   itself (`/queue/status`, `/queue/summary`, `/metrics`, `/dashboard`).
//!
//! The modules import each other top-down (ARCHITECTURE.md, "Module
//! layers"); `tests/module_graph.rs` fails on a cycle.

pub mod affinity;
pub mod app;
pub mod auth;
pub mod balance;
pub mod body;
pub mod budget;
pub mod cache;
pub mod cloud;
pub mod connections;
pub mod control;
pub mod dashboard;
pub mod dispatch;
pub mod embeddings;
pub mod endpoint;
pub mod error;
pub mod form;
pub mod forward;
pub mod headers;
pub mod hop;
pub mod inline;
pub mod jwt;
pub mod listeners;
pub mod metadata_limit;
pub mod metrics;
pub mod node_keys;
pub mod peers;
pub mod placement;
pub mod policy;
pub mod proxy;
pub mod queue_control;
pub mod queued;
pub mod redact;
pub mod relay;
pub mod request_id;
pub mod request_log;
pub mod rewrite;
pub mod router;
pub mod scheduler;
pub mod server;
pub mod service;
pub mod snapshot;
pub mod status;
pub mod supervise;
pub mod swap;
pub mod tls;
pub mod translate;
pub mod upstream;
pub mod usage;
pub mod view;

mod run;

pub use run::{DataPlane, LogLevelHook, Options, StartError, log_colour, stdout_log_colour};
