//! What TLS on the proxy port costs: the handshake per new connection, and the p50 added to a
//! request on a kept-alive connection, each against the same oqp serving plain HTTP.
//!
//! Two single-box stacks (one plain, one with `proxy.tls` from a throwaway CA) in front of one
//! fake Ollama, in this process; the samples alternate between them so that both see the same
//! machine. The request is `GET /api/version`, proxied to the fake (no queue, no model), with
//! the metadata rate limit off.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::stats::{micros, percentile};
use crate::fake::FakeOllama;
use crate::harness::Stack;
use crate::tls::{TestCa, client_config, connect, proxy_tls_yaml};

/// The measured figures, p50 and p99 in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct TlsFigures {
    /// TCP connect alone, to the plain port.
    pub tcp_connect: [f64; 2],
    /// TCP connect and the full TLS handshake (TLS 1.3, ECDSA P-256), to the TLS port.
    pub tls_connect: [f64; 2],
    /// One request on a kept-alive HTTP/1.1 connection, plain.
    pub plain_request: [f64; 2],
    /// One request on a kept-alive HTTP/1.1 connection, over TLS.
    pub tls_request: [f64; 2],
}

impl TlsFigures {
    /// The handshake's cost per new connection, p50.
    pub fn handshake_p50(&self) -> f64 {
        self.tls_connect[0] - self.tcp_connect[0]
    }

    /// What TLS adds to a request's p50 on a kept-alive connection.
    pub fn added_p50(&self) -> f64 {
        self.tls_request[0] - self.plain_request[0]
    }

    /// The report's rows (Markdown).
    pub fn rows(&self) -> String {
        let row = |name: &str, [p50, p99]: [f64; 2]| format!("| {name} | {p50:.0} | {p99:.0} |\n");
        format!(
            "| tls | p50 µs | p99 µs |\n| --- | --- | --- |\n{}{}{}{}| handshake per new connection (p50) | {:.0} | |\n| added per kept-alive request (p50) | {:.0} | |\n",
            row("TCP connect, plain port", self.tcp_connect),
            row("TCP connect + TLS handshake", self.tls_connect),
            row("request, kept-alive, plain", self.plain_request),
            row("request, kept-alive, TLS", self.tls_request),
            self.handshake_p50(),
            self.added_p50(),
        )
    }
}

/// Measures `connections` new connections and `requests` kept-alive requests on each port.
pub async fn measure(connections: usize, requests: usize) -> anyhow::Result<TlsFigures> {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir()?;
    let ca = TestCa::new();
    let (cert, key) = ca.issue().write(dir.path(), "server");
    let config = |proxy: &str| {
        format!(
            "proxy:\n  max_concurrent: 4\n{proxy}ollama:\n  hosts:\n    - url: \"{}\"\n      name: primary\n      max_concurrent: 4\nauth:\n  metadata_rate_limit:\n    per_second: 0\n",
            fake.url()
        )
    };
    let plain = Stack::start(&config("")).await;
    let tls = Stack::start(&config(&proxy_tls_yaml(&cert, &key))).await;
    let client = client_config(&ca.pem(), &[b"http/1.1"]);

    let (mut tcp_connect, mut tls_connect) = (Vec::new(), Vec::new());
    for _ in 0..connections {
        let started = Instant::now();
        let stream = TcpStream::connect(plain.proxy_addr()).await?;
        tcp_connect.push(micros(started.elapsed()));
        drop(stream);
        let started = Instant::now();
        let stream = connect(tls.proxy_addr(), client.clone()).await?;
        tls_connect.push(micros(started.elapsed()));
        drop(stream);
    }

    let mut plain_sender = http1(TcpStream::connect(plain.proxy_addr()).await?).await?;
    let mut tls_sender = http1(connect(tls.proxy_addr(), client.clone()).await?).await?;
    let (mut plain_request, mut tls_request) = (Vec::new(), Vec::new());
    // Warm both connections (and the stacks' first-request paths) before timing.
    for _ in 0..requests.min(50) {
        timed(&mut plain_sender).await?;
        timed(&mut tls_sender).await?;
    }
    for _ in 0..requests {
        plain_request.push(micros(timed(&mut plain_sender).await?));
        tls_request.push(micros(timed(&mut tls_sender).await?));
    }
    plain.shutdown().await;
    tls.shutdown().await;
    let p = |samples: &[f64]| -> anyhow::Result<[f64; 2]> {
        Ok([
            percentile(samples, 50.0).ok_or_else(|| anyhow::anyhow!("no samples"))?,
            percentile(samples, 99.0).ok_or_else(|| anyhow::anyhow!("no samples"))?,
        ])
    };
    Ok(TlsFigures {
        tcp_connect: p(&tcp_connect)?,
        tls_connect: p(&tls_connect)?,
        plain_request: p(&plain_request)?,
        tls_request: p(&tls_request)?,
    })
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn http1<S>(io: S) -> anyhow::Result<Sender>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

async fn timed(sender: &mut Sender) -> anyhow::Result<Duration> {
    let request = http::Request::get("/api/version")
        .header("host", "127.0.0.1")
        .body(Empty::<Bytes>::new())?;
    sender.ready().await?;
    let started = Instant::now();
    let response = sender.send_request(request).await?;
    anyhow::ensure!(response.status() == 200, "status {}", response.status());
    response.into_body().collect().await?;
    Ok(started.elapsed())
}
