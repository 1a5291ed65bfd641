//! Tests of the fake itself, over real sockets with a plain hyper client: one connection per
//! call, so a test can drop a connection to play a client that goes away.

mod capacity;
mod cloud;
mod errors;
mod failures;
mod openai;
mod protocol;
mod streaming;
mod vram;

use std::net::SocketAddr;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// A complete answer.
#[derive(Debug)]
pub(super) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn content_type(&self) -> Option<&str> {
        self.headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok())
    }

    /// The `error` text of an error body.
    pub fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no error in {}", self.text()))
    }
}

/// A response whose body is read as it arrives; owns its connection.
pub(super) struct Open {
    pub status: StatusCode,
    pub headers: HeaderMap,
    body: Incoming,
    buffer: Vec<u8>,
    _connection: AbortOnDrop,
}

/// Aborts the client connection task when the response (or the pending call) is dropped, so
/// dropping either really closes the socket.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Open {
    /// The next `\n`-terminated line (without the newline); `None` at the end; `Err` when the
    /// body broke.
    pub async fn line(&mut self) -> Option<Result<String, hyper::Error>> {
        loop {
            if let Some(at) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=at).collect();
                return Some(Ok(String::from_utf8_lossy(&line[..at]).into_owned()));
            }
            match self.body.frame().await {
                None => return None,
                Some(Err(error)) => return Some(Err(error)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// The next line parsed as JSON; panics at the end or on an error.
    pub async fn json_line(&mut self) -> Value {
        match self.line().await {
            Some(Ok(line)) => {
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
            }
            other => panic!("expected a line, got {other:?}"),
        }
    }

    /// Reads until the end; `Err` when the body broke.
    pub async fn rest(&mut self) -> Result<Vec<String>, hyper::Error> {
        let mut lines = Vec::new();
        while let Some(line) = self.line().await {
            lines.push(line?);
        }
        Ok(lines)
    }
}

/// Sends one request on a new connection and returns its response as it arrives.
pub(super) async fn open(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Result<Open, hyper::Error> {
    let stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let (mut sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    let connection = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let mut request = Request::builder().method(method).uri(path);
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        request = request.header(HOST, addr.to_string());
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap_or_else(|e| panic!("bad request: {e}"));
    let response = sender.send_request(request).await?;
    let (parts, body) = response.into_parts();
    Ok(Open {
        status: parts.status,
        headers: parts.headers,
        body,
        buffer: Vec::new(),
        _connection: connection,
    })
}

/// Sends one request and reads the whole response.
pub(super) async fn call_with(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut open = open(addr, method, path, body, headers)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let body = (&mut open.body)
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{path}: body: {e}"))
        .to_bytes();
    Answer {
        status: open.status,
        headers: open.headers,
        body,
    }
}

/// `call_with` without extra headers.
pub(super) async fn call(addr: SocketAddr, method: Method, path: &str, body: &str) -> Answer {
    call_with(addr, method, path, body, &[]).await
}

/// A POST with a JSON body.
pub(super) async fn post(addr: SocketAddr, path: &str, body: Value) -> Answer {
    call(addr, Method::POST, path, &body.to_string()).await
}
