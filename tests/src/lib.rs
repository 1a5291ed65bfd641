//! Test support for oqp: the fake Ollama ([`fake`], the one test double: it
//! stands for a GPU server), the harness that boots the real control plane
//! and data planes on loopback ([`harness`]), several data planes as
//! separate processes following one control plane ([`cluster`]), a small
//! HTTP client ([`client`]), a real llama.cpp `llama-server`
//! ([`engine`]) where a test needs a real engine, and headless Chromium driven
//! over the DevTools protocol ([`browser`]). The end-to-end tests live
//! in `tests/tests/`, the benchmark in [`mod@bench`] (run by
//! `src/bin/oqp-bench.rs`).

// Test support: a failed set-up step is a failed test, so panicking helpers
// are the point here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod bench;
pub mod browser;
pub mod client;
pub mod cluster;
pub mod engine;
pub mod fake;
pub mod harness;
pub mod jwt;
pub mod load;
pub mod procs;
pub mod tls;
