//! A small HTTP client for tests and the benchmark: plain hyper over real
//! sockets, with helpers for JSON and for timing streamed lines.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::TokioExecutor;

/// A pooled HTTP/1.1 client.
#[derive(Debug, Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

/// A whole response.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (panics if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

/// One line of a streamed body and when it arrived.
#[derive(Debug, Clone)]
pub struct TimedLine {
    /// The line, without its newline.
    pub line: String,
    /// Arrival time at the client.
    pub at: Instant,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    /// A new client.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            inner: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(256)
                .build(connector),
        }
    }

    /// Sends a request and reads the whole response.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        let response = self.start(method, url, headers, body).await;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("read response body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// Sends a request and returns the response with its body unread.
    pub async fn start(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> http::Response<hyper::body::Incoming> {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into())).expect("valid request");
        self.inner.request(request).await.expect("send request")
    }

    /// GET.
    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.send(Method::GET, url, headers, Bytes::new()).await
    }

    /// POST a JSON value.
    pub async fn post_json(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
    ) -> Reply {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        self.send(Method::POST, url, &all, body.to_string()).await
    }

    /// POSTs JSON and reads the response line by line, noting when each line
    /// arrived. Returns the status and the lines.
    pub async fn post_lines(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        body: &serde_json::Value,
    ) -> (StatusCode, HeaderMap, Vec<TimedLine>) {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        let response = self.start(Method::POST, url, &all, body.to_string()).await;
        let (parts, mut body) = response.into_parts();
        let mut lines = Vec::new();
        let mut pending = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            let at = Instant::now();
            pending.extend_from_slice(data);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                lines.push(TimedLine {
                    line: String::from_utf8_lossy(&line[..line.len() - 1]).into_owned(),
                    at,
                });
            }
        }
        if !pending.is_empty() {
            lines.push(TimedLine {
                line: String::from_utf8_lossy(&pending).into_owned(),
                at: Instant::now(),
            });
        }
        (parts.status, parts.headers, lines)
    }
}

/// Runs `probe` until it gives `Ok`, probing again every 10 ms, for at most `limit`; at the
/// limit, the last probe's `Err` (what was seen, for the assertion that follows). The one
/// wait of the tests for conditions with no event to wait on (another process's state, a
/// poll's result over HTTP).
pub async fn wait_until<T, E, F>(limit: Duration, mut probe: impl FnMut() -> F) -> Result<T, E>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + limit;
    loop {
        let seen = probe().await;
        if seen.is_ok() || Instant::now() >= deadline {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`wait_until`] for a check with nothing to say: whether `check` returned true within
/// `limit`. The assertion that follows still decides the test.
pub async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    wait_until(limit, || {
        std::future::ready(if check() { Ok(()) } else { Err(()) })
    })
    .await
    .is_ok()
}
