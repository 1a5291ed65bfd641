//! `FakeHandle`: a test's remote control over a running fake. It reads what the fake recorded
//! (requests, concurrency peaks, cancels), waits for events without polling, scripts failures,
//! freezes and releases admitted requests, edits the model registry and the cloud scripts, and
//! reads the VRAM mode's resident set, queue and load counters.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::cloud::{BalanceRead, Cloud, CloudPlan, CloudReply, CloudUsageShape};
use super::models::{Kind, canonical};
use super::record::{RecordedRequest, lock};
use super::state::Shared;
use super::vram::Snapshot;

/// A cheap, cloneable handle on a running fake.
#[derive(Debug, Clone)]
pub struct FakeHandle {
    pub(crate) shared: Arc<Shared>,
}

/// A scripted failure, consumed in FIFO order by the next inference requests (those that would
/// take a slot: generate, chat, embed, embeddings and the `/v1` inference endpoints; load and
/// unload calls and rejected requests do not consume one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Close the connection without answering.
    Refuse,
    /// Answer this status with this JSON body, before any byte of a stream.
    Status(u16, String),
    /// Stream `after_lines` lines (NDJSON lines or SSE frames), then close the connection
    /// abruptly: no error line, no terminating chunk. A non-streamed request is dropped without
    /// an answer after its service time.
    DieMidStream {
        /// Lines sent before the connection dies.
        after_lines: usize,
    },
    /// Stream `after_lines` lines, then send nothing more while keeping the connection open
    /// (an upstream that hangs mid-generation). A non-streamed request is never answered. The
    /// request counts as cancelled when the client goes away.
    StallMidStream {
        /// Lines sent before the stream goes silent.
        after_lines: usize,
    },
    /// Reset the connection (TCP RST) right after reading the request.
    Reset,
    /// Stream `after_lines` lines, then the in-band `{"error": message}` line in place of the
    /// rest, and end the response cleanly, as Ollama does when the runner fails mid-generation.
    /// A non-streamed request gets a 500 with the message; an OpenAI stream just ends without
    /// `[DONE]` (Ollama's `/v1` quirk).
    ErrorMidStream {
        /// Lines sent before the error.
        after_lines: usize,
        /// The error text.
        message: String,
    },
}

impl FakeHandle {
    /// Every request received, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.recorder.all()
    }

    /// The requests received on `path` (query excluded).
    pub fn requests_to(&self, path: &str) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(|request| request.path == path)
            .collect()
    }

    /// The requests that presented `Authorization: Bearer <key>`.
    pub fn requests_with_key(&self, key: &str) -> Vec<RecordedRequest> {
        let key = Some(key.to_owned());
        self.requests()
            .into_iter()
            .filter(|request| request.bearer() == key)
            .collect()
    }

    /// Forgets every recorded request.
    pub fn clear_requests(&self) {
        self.shared.recorder.clear();
    }

    /// The most inference requests that held a slot at once.
    pub fn peak_concurrency(&self) -> usize {
        self.shared.slots.peak()
    }

    /// The same, counting only requests with this `x-client-id` header.
    pub fn peak_concurrency_of(&self, client_id: &str) -> usize {
        self.shared.slots.peak_of_client(client_id)
    }

    /// The same, counting only requests that presented this cloud key.
    pub fn peak_concurrency_of_key(&self, key: &str) -> usize {
        self.shared.slots.peak_of_key(key)
    }

    /// Inference requests holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.shared.slots.in_flight()
    }

    /// Inference requests waiting for a slot now.
    pub fn queued(&self) -> usize {
        self.shared.slots.queued()
    }

    /// Inference requests abandoned by their client before they were answered in full (while
    /// queued, held, or mid-stream). Failures the fake caused itself are not counted.
    pub fn cancelled(&self) -> usize {
        *self.shared.cancelled.borrow()
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Resolves once at least `n` requests have been received (and recorded) since the last
    /// `clear_requests`.
    pub async fn wait_for_requests(&self, n: usize) {
        self.shared.recorder.wait_for(n).await;
    }

    /// Resolves once at least `n` inference requests hold a slot.
    pub async fn wait_in_flight(&self, n: usize) {
        self.shared
            .slots
            .wait_in_flight(|in_flight| *in_flight >= n)
            .await;
    }

    /// Resolves once at least `n` inference requests wait for a slot.
    pub async fn wait_queued(&self, n: usize) {
        self.shared.slots.wait_queued(|queued| *queued >= n).await;
    }

    /// Resolves once no inference request holds a slot.
    pub async fn wait_idle(&self) {
        self.shared
            .slots
            .wait_in_flight(|in_flight| *in_flight == 0)
            .await;
    }

    /// Resolves once at least `n` requests have been abandoned by their clients.
    pub async fn wait_cancelled(&self, n: usize) {
        let _ = self
            .shared
            .cancelled
            .subscribe()
            .wait_for(|count| *count >= n)
            .await;
    }

    /// With runners on: every request's time at its model's runner (its wait inside Ollama),
    /// in the order their slots started; empty otherwise.
    pub fn runner_log(&self) -> Vec<super::RunnerEntry> {
        self.shared
            .runners
            .as_ref()
            .map(|runners| runners.log())
            .unwrap_or_default()
    }

    /// With runners on: the most requests `model`'s runner ran at once.
    pub fn runner_peak(&self, model: &str) -> usize {
        self.shared
            .runners
            .as_ref()
            .map_or(0, |runners| runners.peak(&super::models::canonical(model)))
    }

    /// With runners on: the most requests that waited inside `model`'s runner at once.
    pub fn runner_peak_waiting(&self, model: &str) -> usize {
        self.shared.runners.as_ref().map_or(0, |runners| {
            runners.peak_waiting(&super::models::canonical(model))
        })
    }

    /// With runners on: requests running on `model`'s runner now.
    pub fn runner_in_flight(&self, model: &str) -> usize {
        self.shared.runners.as_ref().map_or(0, |runners| {
            runners.in_flight(&super::models::canonical(model))
        })
    }

    /// Scripts the next inference request (FIFO) to fail this way.
    pub fn fail_next(&self, failure: Failure) {
        lock(&self.shared.failures).push_back(failure);
    }

    /// From now on, every answer also carries header `name: value` (an upstream, or something
    /// posing as one, sending headers that are not Ollama's).
    pub fn answer_header(&self, name: &str, value: &str) {
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) else {
            panic!("not a header: {name}: {value}");
        };
        lock(&self.shared.answer_headers).push((name, value));
    }

    /// From now on, admitted inference requests wait, holding their slot, until released.
    pub fn hold(&self) {
        self.shared.slots.hold();
    }

    /// Lets `n` held requests proceed (tickets not used yet carry over to later requests).
    pub fn release(&self, n: usize) {
        self.shared.slots.release(n);
    }

    /// Stops holding and releases everybody.
    pub fn release_all(&self) {
        self.shared.slots.release_all();
    }

    /// Installs a chat-capable model.
    pub fn add_model(&self, name: &str) {
        lock(&self.shared.models).install(name, Kind::Chat);
    }

    /// Installs an embedding-only model.
    pub fn add_embedding_model(&self, name: &str) {
        lock(&self.shared.models).install(name, Kind::Embedding);
    }

    /// Uninstalls a model.
    pub fn remove_model(&self, name: &str) {
        lock(&self.shared.models).remove(name);
    }

    /// Lists a model in `/api/ps` (for the default five minutes), installing it as a chat model
    /// if it is not installed. In VRAM mode `/api/ps` shows the VRAM instead: load a model there
    /// with a request (the load idiom is an empty prompt) or start it with `FakeBuilder::loaded`.
    pub fn load_model(&self, name: &str) {
        let mut models = lock(&self.shared.models);
        if models.find(name).is_none() {
            models.install(name, Kind::Chat);
        }
        models.touch(name, None);
    }

    /// Removes a model from `/api/ps`; in VRAM mode, unloads it once its requests finish (as
    /// the `keep_alive: 0` idiom does).
    pub fn unload_model(&self, name: &str) {
        lock(&self.shared.models).touch(name, Some(super::gojson::KeepAlive::Unload));
        if let Some(vram) = &self.shared.vram {
            vram.unload(name);
        }
    }

    /// VRAM mode: the models loaded now (ready, or marked for eviction but still running), by
    /// canonical name (`llama3.2:latest`), sorted; empty outside VRAM mode.
    pub fn resident(&self) -> Vec<String> {
        self.vram_snapshot().resident
    }

    /// VRAM mode: the models being loaded now, by canonical name, sorted.
    pub fn loading(&self) -> Vec<String> {
        self.vram_snapshot().loading
    }

    /// VRAM mode: loads of `model` started so far.
    pub fn loads(&self, model: &str) -> usize {
        count(&self.vram_snapshot().loads, model)
    }

    /// VRAM mode: unloads of `model` finished so far.
    pub fn unloads(&self, model: &str) -> usize {
        count(&self.vram_snapshot().unloads, model)
    }

    /// VRAM mode: the time spent in finished loads, all models together.
    pub fn load_time(&self) -> Duration {
        self.vram_snapshot().load_time
    }

    /// VRAM mode: cold requests waiting in the pending queue now.
    pub fn pending(&self) -> usize {
        self.vram_snapshot().pending
    }

    /// VRAM mode: resolves once at least `n` cold requests wait in the pending queue (at once
    /// outside VRAM mode).
    pub async fn wait_pending(&self, n: usize) {
        self.wait_vram(|snapshot| snapshot.pending >= n).await;
    }

    /// VRAM mode: resolves once at least `n` loads of `model` have started.
    pub async fn wait_loads(&self, model: &str, n: usize) {
        self.wait_vram(|snapshot| count(&snapshot.loads, model) >= n)
            .await;
    }

    /// VRAM mode: resolves once at least `n` unloads of `model` have finished.
    pub async fn wait_unloads(&self, model: &str, n: usize) {
        self.wait_vram(|snapshot| count(&snapshot.unloads, model) >= n)
            .await;
    }

    /// VRAM mode: resolves once `model` is loaded (ready).
    pub async fn wait_resident(&self, model: &str) {
        let model = canonical(model);
        self.wait_vram(|snapshot| snapshot.resident.contains(&model))
            .await;
    }

    /// Changes the service time of non-streamed inference and embeddings.
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.shared.timing).latency = latency;
    }

    /// Changes the delay between streamed lines.
    pub fn set_token_interval(&self, interval: Duration) {
        lock(&self.shared.timing).token_interval = interval;
    }

    /// Changes the delay before the first streamed line.
    pub fn set_first_token_delay(&self, delay: Duration) {
        lock(&self.shared.timing).first_token_delay = delay;
    }

    /// Changes the number of content chunks per generation.
    pub fn set_tokens(&self, tokens: usize) {
        lock(&self.shared.timing).tokens = tokens;
    }

    /// Cloud mode: the next inference request presenting `key` gets `reply` (FIFO per key).
    /// Does nothing outside cloud mode.
    pub fn script_cloud(&self, key: &str, reply: CloudReply) {
        if let Some(cloud) = self.cloud() {
            cloud.script(key, reply);
        }
    }

    /// Cloud mode: every inference request presenting `key` gets `reply` when no one-shot reply
    /// is queued (`CloudReply::Ok` restores normal service).
    pub fn set_cloud_default(&self, key: &str, reply: CloudReply) {
        if let Some(cloud) = self.cloud() {
            cloud.set_default(key, reply);
        }
    }

    /// Cloud mode: the session and weekly usage fractions `GET /api/usage` reports for `key`.
    pub fn set_cloud_usage(&self, key: &str, session: f64, weekly: f64) {
        if let Some(cloud) = self.cloud() {
            cloud.set_usage(key, session, weekly);
        }
    }

    /// Cloud mode: `model` needs a subscription that only the `subscribed` keys have; other
    /// keys get a 403 for it (and only for it).
    pub fn require_cloud_subscription(&self, model: &str, subscribed: &[&str]) {
        if let Some(cloud) = self.cloud() {
            cloud.require_subscription(model, subscribed);
        }
    }

    /// Cloud mode: `key` gets a 403 on every authenticated route, `/api/usage` included.
    pub fn suspend_cloud_key(&self, key: &str) {
        if let Some(cloud) = self.cloud() {
            cloud.suspend(key);
        }
    }

    /// Cloud mode: `keys` belong to `account` (they share its plan, balances and read limit).
    pub fn set_cloud_account(&self, account: &str, keys: &[&str]) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_account(account, keys);
        }
    }

    /// Cloud mode: `account`'s plan, and so what `GET /api/balance` reports for it.
    pub fn set_cloud_plan(&self, account: &str, plan: CloudPlan) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_plan(account, plan);
        }
    }

    /// Cloud mode: `account`'s purchased extra-usage balance in USD (0 by default).
    pub fn set_cloud_extra(&self, account: &str, usd: f64) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_extra(account, usd);
        }
    }

    /// Cloud mode: `model` uses extra usage only (402 on an account without extra usage).
    pub fn cloud_extra_usage_only(&self, model: &str) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).extra_usage_only(model);
        }
    }

    /// Cloud mode: each served request costs its output tokens at this price (USD per token).
    pub fn set_cloud_price(&self, usd_per_output_token: f64) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_price(usd_per_output_token);
        }
    }

    /// Cloud mode: `/api/balance` reads allowed per account and rolling minute (default
    /// [`READS_PER_MINUTE`](super::READS_PER_MINUTE)).
    pub fn set_cloud_read_limit(&self, reads: usize) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_read_limit(reads);
        }
    }

    /// Cloud mode: every `/api/balance` answers this body instead of the plan's shape.
    pub fn set_cloud_balance_body(&self, body: serde_json::Value) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_balance_body(body);
        }
    }

    /// Cloud mode: the shape of `account`'s `GET /api/usage` (dollars at the top by default).
    pub fn set_cloud_usage_shape(&self, account: &str, shape: CloudUsageShape) {
        if let Some(cloud) = self.cloud() {
            lock(&cloud.billing).set_usage_shape(account, shape);
        }
    }

    /// Cloud mode: what `account` spent so far, in USD (what its `/api/usage` reports).
    pub fn cloud_spent(&self, account: &str) -> f64 {
        self.cloud()
            .map_or(0.0, |cloud| lock(&cloud.billing).spent(account))
    }

    /// Cloud mode: the `/api/balance` and `/api/usage` reads `account` made, in order (they
    /// share the read limit).
    pub fn cloud_balance_reads(&self, account: &str) -> Vec<BalanceRead> {
        self.cloud()
            .map(|cloud| lock(&cloud.billing).balance_reads(account))
            .unwrap_or_default()
    }

    fn cloud(&self) -> Option<&Cloud> {
        self.shared.cloud.as_ref()
    }

    fn vram_snapshot(&self) -> Snapshot {
        self.shared
            .vram
            .as_ref()
            .map(|vram| vram.snapshot())
            .unwrap_or_default()
    }

    async fn wait_vram(&self, done: impl FnMut(&Snapshot) -> bool) {
        if let Some(vram) = &self.shared.vram {
            vram.wait_for(done).await;
        }
    }
}

fn count(counts: &std::collections::BTreeMap<String, usize>, model: &str) -> usize {
    counts.get(&canonical(model)).copied().unwrap_or(0)
}
