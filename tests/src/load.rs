//! The load generator: a small tokio HTTP/1.1 client over kept-alive
//! connections (hyper's connection API, no pool in the way), driven three
//! ways — one request at a time (latency), a fixed number of connections as
//! fast as they go (closed loop: throughput), and a fixed rate (open loop:
//! CPU cost). Everything is bounded by a deadline or a count.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// A request to replay: method, path, headers and body.
#[derive(Debug, Clone)]
pub struct Req {
    method: Method,
    path: String,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

/// A whole answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
}

/// One line of a streamed answer and when it arrived.
#[derive(Debug, Clone)]
pub struct Line {
    /// The line, without its newline.
    pub text: String,
    /// Arrival, on the monotonic clock.
    pub at: Instant,
    /// Arrival, on the wall clock (to compare with the sender's stamps).
    pub wall: SystemTime,
}

/// What a loop achieved.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rate {
    /// Answers with a 2xx status.
    pub ok: u64,
    /// Errors and other statuses.
    pub failed: u64,
    /// How long the loop ran.
    pub elapsed: Duration,
}

/// One kept-alive connection, reopened when the server closes it.
#[derive(Debug)]
pub struct Conn {
    addr: SocketAddr,
    host: HeaderValue,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Req {
    /// A GET of `path`, with a bearer key when given.
    pub fn get(path: &str, key: Option<&str>) -> Req {
        Req::new(Method::GET, path, key, Bytes::new())
    }

    /// A POST of a JSON body.
    pub fn post(path: &str, key: Option<&str>, body: impl Into<Bytes>) -> Req {
        Req::new(Method::POST, path, key, body.into())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
    }

    fn new(method: Method, path: &str, key: Option<&str>, body: Bytes) -> Req {
        let mut request = Req {
            method,
            path: path.to_owned(),
            headers: Vec::new(),
            body,
        };
        if let Some(key) = key
            && let Ok(value) = HeaderValue::from_str(&format!("Bearer {key}"))
        {
            request = request.header(AUTHORIZATION, value);
        }
        request
    }

    /// Adds a header.
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Req {
        self.headers.push((name, value));
        self
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    fn build(&self, host: &HeaderValue) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut request = Request::builder()
            .method(self.method.clone())
            .uri(self.path.as_str())
            .header(HOST, host.clone());
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        Ok(request.body(Full::new(self.body.clone()))?)
    }
}

impl Rate {
    /// Successful answers per second.
    pub fn per_second(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl Conn {
    /// Opens a connection to `addr`.
    pub async fn open(addr: SocketAddr) -> anyhow::Result<Conn> {
        let mut conn = Conn {
            addr,
            host: HeaderValue::from_str(&addr.to_string())?,
            sender: None,
        };
        conn.sender = Some(connect(addr).await?);
        Ok(conn)
    }

    /// Sends `request` and reads the whole answer.
    pub async fn send(&mut self, request: &Req) -> anyhow::Result<Answer> {
        let response = self.start(request).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// Sends `request`, reads the whole answer, and times the exchange.
    pub async fn timed(&mut self, request: &Req) -> anyhow::Result<(Duration, Answer)> {
        let started = Instant::now();
        let answer = self.send(request).await?;
        Ok((started.elapsed(), answer))
    }

    /// Sends `request` and times it to the first byte of the answer's body
    /// (then reads the rest, untimed).
    pub async fn first_byte(&mut self, request: &Req) -> anyhow::Result<(Duration, Answer)> {
        let started = Instant::now();
        let response = self.start(request).await?;
        let (parts, mut body) = response.into_parts();
        let mut took = None;
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Some(data) = frame?.data_ref() {
                took.get_or_insert_with(|| started.elapsed());
                bytes.extend_from_slice(data);
            }
        }
        let answer = Answer {
            status: parts.status,
            headers: parts.headers,
            body: bytes.into(),
        };
        Ok((took.unwrap_or_else(|| started.elapsed()), answer))
    }

    /// Sends `request` and reads the answer line by line, noting when each
    /// line arrived. Returns when the request was sent, and the lines.
    pub async fn lines(&mut self, request: &Req) -> anyhow::Result<(Instant, Vec<Line>)> {
        let started = Instant::now();
        let mut body = self.start(request).await?.into_body();
        let mut lines = Vec::new();
        let mut pending = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            let (at, wall) = (Instant::now(), SystemTime::now());
            pending.extend_from_slice(data);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                lines.push(Line {
                    text: String::from_utf8_lossy(&line[..line.len() - 1]).into_owned(),
                    at,
                    wall,
                });
            }
        }
        Ok((started, lines))
    }

    async fn start(
        &mut self,
        request: &Req,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        let mut sender = match self.sender.take() {
            Some(sender) if !sender.is_closed() => sender,
            _ => connect(self.addr).await?,
        };
        sender.ready().await?;
        let response = sender.send_request(request.build(&self.host)?).await?;
        self.sender = Some(sender);
        Ok(response)
    }
}

async fn connect(addr: SocketAddr) -> anyhow::Result<SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// `connections` connections send `request` back to back until `duration`
/// has passed.
pub async fn closed_loop(
    addr: SocketAddr,
    request: &Req,
    connections: usize,
    duration: Duration,
) -> anyhow::Result<Rate> {
    run_closed(addr, request, connections, Some(duration), u64::MAX).await
}

/// `connections` connections send `request` back to back until `total`
/// requests have been sent.
pub async fn closed_loop_count(
    addr: SocketAddr,
    request: &Req,
    connections: usize,
    total: u64,
) -> anyhow::Result<Rate> {
    run_closed(addr, request, connections, None, total).await
}

async fn run_closed(
    addr: SocketAddr,
    request: &Req,
    connections: usize,
    duration: Option<Duration>,
    total: u64,
) -> anyhow::Result<Rate> {
    let mut conns = Vec::with_capacity(connections);
    for _ in 0..connections {
        conns.push(Conn::open(addr).await?);
    }
    let started = Instant::now();
    let deadline = duration.map(|duration| started + duration);
    let sent = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut conn| {
            let request = request.clone();
            let sent = sent.clone();
            tokio::spawn(async move {
                let mut rate = Rate::default();
                while deadline.is_none_or(|deadline| Instant::now() < deadline)
                    && sent.fetch_add(1, Ordering::Relaxed) < total
                {
                    match conn.send(&request).await {
                        Ok(answer) if answer.status.is_success() => rate.ok += 1,
                        _ => rate.failed += 1,
                    }
                }
                rate
            })
        })
        .collect();
    let mut sum = Rate::default();
    for task in tasks {
        let rate = task.await?;
        sum.ok += rate.ok;
        sum.failed += rate.failed;
    }
    sum.elapsed = started.elapsed();
    Ok(sum)
}

/// Sends `request` at `per_second` for `duration`, on as many connections as
/// that takes (a free one is reused, a new one opened when all are busy).
/// Waits for the answers of the requests it started.
pub async fn open_loop(
    addr: SocketAddr,
    request: &Req,
    per_second: u32,
    duration: Duration,
) -> anyhow::Result<Rate> {
    let (free_sender, mut free) = mpsc::unbounded_channel::<Conn>();
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let period = Duration::from_secs_f64(1.0 / f64::from(per_second.max(1)));
    let total = (duration.as_secs_f64() * f64::from(per_second)).round() as u64;
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..total {
        ticker.tick().await;
        let mut conn = match free.try_recv() {
            Ok(conn) => conn,
            Err(_) => Conn::open(addr).await?,
        };
        let (request, free_sender) = (request.clone(), free_sender.clone());
        let (ok, failed) = (ok.clone(), failed.clone());
        tasks.spawn(async move {
            match conn.send(&request).await {
                Ok(answer) if answer.status.is_success() => ok.fetch_add(1, Ordering::Relaxed),
                _ => failed.fetch_add(1, Ordering::Relaxed),
            };
            let _ = free_sender.send(conn);
        });
        // Reap finished tasks so that the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    Ok(Rate {
        ok: ok.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    })
}

/// Sends `request` `count` times in a row on one connection; the number of
/// answers that were not 2xx.
pub async fn warm_up(addr: SocketAddr, request: &Req, count: usize) -> anyhow::Result<usize> {
    let mut conn = Conn::open(addr).await?;
    let mut failed = 0;
    for _ in 0..count {
        if !conn.send(request).await?.status.is_success() {
            failed += 1;
        }
    }
    Ok(failed)
}
