//! The fake Ollama: the one test double of the project. It speaks Ollama's wire protocol as
//! `shared/reference/ollama-protocol.md` describes it (Part A, and §B.7 which is its spec):
//! native and OpenAI-compatible routes with Ollama's content types, error texts and streaming
//! framing; parallel slots that block like `OLLAMA_NUM_PARALLEL`; scripted failures before and
//! during a stream; an ollama.com mode with Bearer keys and scripted rate limits. It records every
//! request and its peak concurrency so end-to-end tests can assert on what the proxy did.
//!
//! ```no_run
//! # async fn demo() {
//! use oqp_tests::fake::{FakeOllama, Failure};
//! let fake = FakeOllama::builder().model("llama3.2").slots(2).spawn().await;
//! let handle = fake.handle();
//! handle.fail_next(Failure::DieMidStream { after_lines: 2 });
//! // ... point the proxy at fake.url() ...
//! assert!(handle.peak_concurrency() <= 2);
//! fake.shutdown().await;
//! # }
//! ```
//!
//! Layout: `builder` (configuration), `handle` (the test's remote control), `server` (accept
//! loop and connections), `routes` (dispatch), `native`, `embed`, `admin`, `openai`, `audio` (endpoints),
//! `stream` (admission and the line engine), `slots`, `models`, `cloud`, `record`, `state`,
//! `gojson` (Go-like decoding errors), `vram` (the faithful VRAM mode: residency, the cold
//! queue, eviction, load and unload times) and `wire` (response helpers).

// Handlers return early with a ready `Response` as their `Err`; boxing it would only add noise
// to a test double.
#![allow(clippy::result_large_err)]

mod admin;
mod agents;
mod audio;
mod builder;
mod cloud;
mod embed;
mod gojson;
mod handle;
mod models;
mod native;
mod openai;
mod prompt;
mod record;
mod routes;
mod runners;
mod server;
mod slots;
mod state;
mod stream;
mod vram;
mod wire;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

pub use builder::FakeBuilder;
pub use cloud::{BalanceRead, CloudPlan, CloudReply, CloudUsageShape, READS_PER_MINUTE};
pub use handle::{Failure, FakeHandle};
pub use record::RecordedRequest;
pub use runners::{CacheUse, RunnerEntry};
pub use stream::USAGE_HEADER;

use server::Server;

/// A running fake Ollama. Dropping it stops it (without waiting); `shutdown` stops it and waits.
#[derive(Debug)]
pub struct FakeOllama {
    addr: SocketAddr,
    handle: FakeHandle,
    server: Server,
}

impl FakeOllama {
    /// A builder with Ollama's defaults: no models, one slot, no delays, five tokens.
    pub fn builder() -> FakeBuilder {
        FakeBuilder::default()
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle to control the fake and read what it recorded; stays usable after shutdown.
    pub fn handle(&self) -> FakeHandle {
        self.handle.clone()
    }

    /// Stops listening and aborts every open connection at once, as if the host died. When this
    /// returns, the port is free and every socket is closed. Requests cut this way are not
    /// counted as cancelled.
    pub async fn shutdown(mut self) {
        self.handle
            .shared
            .shutting_down
            .store(true, Ordering::SeqCst);
        self.server.shutdown().await;
    }
}

impl Drop for FakeOllama {
    fn drop(&mut self) {
        self.handle
            .shared
            .shutting_down
            .store(true, Ordering::SeqCst);
        self.server.abort();
    }
}
