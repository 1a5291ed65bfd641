//! The state one running fake shares between its connection tasks and its `FakeHandle`: the
//! configuration that tests may change at run time, the model registry, the slots, the request
//! log, the scripted failures, the VRAM mode when on, and the per-request context (`Ctx`) with its `Tracker`, which
//! stamps `finished_at` and counts requests the client abandoned.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};

use super::cloud::Cloud;
use super::handle::Failure;
use super::models::Models;
use super::record::{Recorder, lock};
use super::slots::Slots;
use super::vram::Vram;

/// Everything a fake's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub version: String,
    pub host_check: bool,
    pub embedding_dimension: usize,
    pub cloud: Option<Cloud>,
    pub timing: Mutex<Timing>,
    pub models: Mutex<Models>,
    pub slots: Arc<Slots>,
    /// The VRAM mode, when on.
    pub vram: Option<Arc<Vram>>,
    /// Per-model runners with their own slots, when on.
    pub runners: Option<Arc<super::runners::Runners>>,
    pub recorder: Recorder,
    pub failures: Mutex<VecDeque<Failure>>,
    pub cancelled: watch::Sender<usize>,
    pub connections: AtomicUsize,
    pub shutting_down: AtomicBool,
    pub blobs: Mutex<HashSet<String>>,
    /// Headers every answer carries besides its own (`FakeHandle::answer_header`): an upstream
    /// that sends what it should not.
    pub answer_headers: Mutex<Vec<(http::HeaderName, http::HeaderValue)>>,
}

/// The knobs a test may turn while the fake runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// Service time of non-streamed inference and embeddings, inside the slot.
    pub latency: Duration,
    /// Streamed: delay before the first line, inside the slot.
    pub first_token_delay: Duration,
    /// Streamed: delay between lines.
    pub token_interval: Duration,
    /// Content chunks per generation.
    pub tokens: usize,
    /// An OpenAI stream's tokens end in `@` and the moment the frame is written (Unix
    /// nanoseconds), so that a client times each token from its sending through any proxy.
    pub stamp_tokens: bool,
}

/// One connection's kill switch: a handler uses it to drop its connection without answering.
#[derive(Debug, Default)]
pub(crate) struct ConnCtl {
    kill: Notify,
    reset: AtomicBool,
}

/// One request's context, owned by the dispatcher for the request's whole life.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub shared: Arc<Shared>,
    pub conn: Arc<ConnCtl>,
    /// Taken by a streamed response, which then finishes the request itself.
    pub tracker: Option<Tracker>,
    pub started: Instant,
    pub client_id: Option<String>,
    pub key: Option<String>,
    /// What the final object reports instead of the measured figures (`x-fake-usage`).
    pub reported: super::stream::Reported,
    /// The prompt its runner reads, for the prompt cache (set by the generating routes).
    pub prompt: Option<super::prompt::Prompt>,
}

/// Stamps `finished_at` when dropped, and counts the request as abandoned by its client when it
/// was an inference request dropped before it was answered.
#[derive(Debug)]
pub(crate) struct Tracker {
    shared: Arc<Shared>,
    id: u64,
    inference: bool,
    settled: bool,
}

impl Shared {
    /// The current timing knobs.
    pub fn timing(&self) -> Timing {
        *lock(&self.timing)
    }

    /// The next scripted failure, if any.
    pub fn next_failure(&self) -> Option<Failure> {
        lock(&self.failures).pop_front()
    }

    /// Whether the fake is being shut down (its connections are being aborted on purpose).
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }
}

impl ConnCtl {
    /// Drops the connection: with a TCP reset when `reset`, else with a plain close.
    pub fn abort(&self, reset: bool) {
        if reset {
            self.reset.store(true, Ordering::SeqCst);
        }
        self.kill.notify_one();
    }

    /// Resolves when a handler asked for the connection to be dropped.
    pub async fn killed(&self) {
        self.kill.notified().await;
    }

    /// Whether the drop should be a reset.
    pub fn wants_reset(&self) -> bool {
        self.reset.load(Ordering::SeqCst)
    }
}

impl Ctx {
    /// Marks this request as an inference request, so that abandoning it counts as a cancel.
    pub fn mark_inference(&mut self) {
        if let Some(tracker) = self.tracker.as_mut() {
            tracker.inference = true;
        }
    }

    /// The fake drops this connection on purpose (a scripted failure): not a client cancel.
    pub fn abort_connection(&mut self, reset: bool) {
        if let Some(tracker) = self.tracker.as_mut() {
            tracker.settled = true;
        }
        self.conn.abort(reset);
    }
}

impl Tracker {
    /// Tracks the recorded request `id`.
    pub fn new(shared: Arc<Shared>, id: u64) -> Self {
        Self {
            shared,
            id,
            inference: false,
            settled: false,
        }
    }

    /// The request was answered in full.
    pub fn complete(mut self) {
        self.settled = true;
    }

    /// The fake aborts the response on purpose: not a client cancel.
    pub fn disarm(&mut self) {
        self.settled = true;
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.shared.recorder.finish(self.id);
        if self.inference && !self.settled && !self.shared.is_shutting_down() {
            self.shared.cancelled.send_modify(|count| *count += 1);
        }
    }
}
