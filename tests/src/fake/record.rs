//! What the fake saw: every request, recorded in arrival order with its headers and body, so that
//! tests can assert on what the proxy forwarded (reference §B.7 item 10), plus the watch channel
//! that lets a test wait for the n-th request without polling.

use std::collections::VecDeque;
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
/// `clear` (or after it was dropped by the limit) cannot mark somebody else's entry.
#[derive(Debug)]
pub(crate) struct Recorder {
    entries: Mutex<Entries>,
    /// Requests received since the last `clear`, including any the limit dropped.
    received: watch::Sender<usize>,
    limit: Option<usize>,
}

#[derive(Debug, Default)]
struct Entries {
    next_id: u64,
    // Ids are consecutive from front to back.
    list: VecDeque<(u64, RecordedRequest)>,
}

impl Recorder {
    /// A log keeping every request, or only the latest `limit`.
    pub fn new(limit: Option<usize>) -> Self {
        Self {
            entries: Mutex::default(),
            received: watch::Sender::new(0),
            limit,
        }
    }

    /// Appends a request; returns its id for `finish`.
    pub fn push(&self, request: RecordedRequest) -> u64 {
        let mut entries = lock(&self.entries);
        let id = entries.next_id;
        entries.next_id += 1;
        entries.list.push_back((id, request));
        if self.limit.is_some_and(|limit| entries.list.len() > limit) {
            entries.list.pop_front();
        }
        self.received.send_modify(|received| *received += 1);
        id
    }

    /// Stamps `finished_at` on a request, once.
    pub fn finish(&self, id: u64) {
        let mut entries = lock(&self.entries);
        let Some(first) = entries.list.front().map(|(first, _)| *first) else {
            return;
        };
        let index = id
            .checked_sub(first)
            .and_then(|offset| usize::try_from(offset).ok());
        if let Some((entry_id, request)) = index.and_then(|index| entries.list.get_mut(index))
            && *entry_id == id
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
        self.received.send_replace(0);
    }

    /// Resolves once at least `n` requests have been received since the last `clear`.
    pub async fn wait_for(&self, n: usize) {
        let mut receiver = self.received.subscribe();
        // The sender lives as long as `self`, so this cannot fail while we borrow it.
        let _ = receiver.wait_for(|received| *received >= n).await;
    }
}

/// Locks a mutex, ignoring poisoning: the fake's state stays usable after a panicking test.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: &str) -> RecordedRequest {
        RecordedRequest {
            method: Method::GET,
            path: path.to_owned(),
            query: None,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            received_at: Instant::now(),
            finished_at: None,
        }
    }

    #[tokio::test]
    async fn the_limit_keeps_the_latest_and_finish_finds_its_entry() {
        let recorder = Recorder::new(Some(2));
        let ids: Vec<u64> = ["/a", "/b", "/c"]
            .into_iter()
            .map(|path| recorder.push(request(path)))
            .collect();
        recorder.wait_for(3).await;
        for id in ids {
            recorder.finish(id);
        }
        let paths: Vec<String> = recorder.all().into_iter().map(|r| r.path).collect();
        assert_eq!(paths, ["/b", "/c"]);
        assert!(recorder.all().iter().all(|r| r.finished_at.is_some()));
        recorder.clear();
        let late = recorder.push(request("/d"));
        recorder.finish(late - 1);
        assert!(
            recorder.all()[0].finished_at.is_none(),
            "a stale id marks nothing"
        );
        recorder.wait_for(1).await;
    }
}
