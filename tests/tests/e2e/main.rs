//! The end-to-end suites: the real control plane and data plane, on
//! `127.0.0.1:0`, in front of the fake Ollama (and a real `redis-server`
//! where a suite needs one). One test binary holds them all, so the
//! workspace links the heavy dependency graph once instead of once a suite.
//!
//! The secrets-leak suite (`tests/leaks.rs`) stays a binary of its own: it
//! installs a process-wide log subscriber at trace level.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod affinity;
mod agents;
mod apps;
mod bench_smoke;
mod bodies;
mod cloud;
mod connections;
mod dashboard;
mod embeddings;
mod engines;
mod foundation;
pub mod hosts;
mod jwt;
mod keys;
mod node_tokens;
mod nodes;
mod observability;
mod ownership;
mod paths;
mod reliability;
mod routing;
mod runners;
mod scheduling;
mod snapshots;
mod stalls;
mod support;
mod swap;
mod tenancy;
mod tls;
mod translate;
pub mod usage;
