//! What the fake saw: every request, recorded in arrival order with its headers and body, so that
//! tests can assert on what the proxy forwarded (reference §B.7 item 10), plus the watch channel
//! that lets a test wait for the n-th request without polling.

use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Method};
use serde_json::Value;
use tokio::sync::watch;

/// One request the fake received.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// The request method.
    pub method: Method,
    /// The path, without the query.
    pub path: String,
    /// The query string, if any.
    pub query: Option<String>,
    /// Every header as received (Host, Authorization and x-client-id included).
    pub headers: HeaderMap,
    /// The whole request body.
    pub body: Bytes,
    /// When the request's head arrived.
    pub received_at: Instant,
    /// When the fake finished answering it (last line sent, or the client went away); `None`
    /// while it is still being answered. Approximate: set when the body was produced, not when
    /// the bytes left the socket.
    pub finished_at: Option<Instant>,
}

impl RecordedRequest {
    /// The body parsed as JSON, or `Value::Null` when it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The first value of a header, as text (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    }

    /// The key of an `Authorization: Bearer <key>` header, if the request presented one.
    pub fn bearer(&self) -> Option<String> {
        bearer(&self.headers)
    }
}

/// The key of an `Authorization: Bearer <key>` header.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim().to_owned())
}

/// The request log. Entries carry a sequence number so that a request finishing after
/// `clear` cannot mark somebody else's entry.
#[derive(Debug)]
pub(crate) struct Recorder {
    entries: Mutex<Entries>,
    count: watch::Sender<usize>,
}

#[derive(Debug, Default)]
struct Entries {
    next_id: u64,
    list: Vec<(u64, RecordedRequest)>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            entries: Mutex::default(),
            count: watch::Sender::new(0),
        }
    }
}

impl Recorder {
    /// Appends a request; returns its id for `finish`.
    pub fn push(&self, request: RecordedRequest) -> u64 {
        let mut entries = lock(&self.entries);
        let id = entries.next_id;
        entries.next_id += 1;
        entries.list.push((id, request));
        self.count.send_replace(entries.list.len());
        id
    }

    /// Stamps `finished_at` on a request, once.
    pub fn finish(&self, id: u64) {
        let mut entries = lock(&self.entries);
        if let Some((_, request)) = entries
            .list
            .iter_mut()
            .rev()
            .find(|(entry_id, _)| *entry_id == id)
            && request.finished_at.is_none()
        {
            request.finished_at = Some(Instant::now());
        }
    }

    /// A copy of every recorded request, in arrival order.
    pub fn all(&self) -> Vec<RecordedRequest> {
        lock(&self.entries)
            .list
            .iter()
            .map(|(_, request)| request.clone())
            .collect()
    }

    /// Forgets every recorded request.
    pub fn clear(&self) {
        let mut entries = lock(&self.entries);
        entries.list.clear();
        self.count.send_replace(0);
    }

    /// Resolves once at least `n` requests are recorded.
    pub async fn wait_for(&self, n: usize) {
        let mut receiver = self.count.subscribe();
        // The sender lives as long as `self`, so this cannot fail while we borrow it.
        let _ = receiver.wait_for(|count| *count >= n).await;
    }
}

/// Locks a mutex, ignoring poisoning: the fake's state stays usable after a panicking test.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
