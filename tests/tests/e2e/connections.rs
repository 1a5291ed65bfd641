//! Connections: a socket that never sends a request, or sits idle, is
//! closed after its (small, configured) deadline; connections over the caps
//! (in all, or from one address) are closed at once while the clients
//! already connected go on being served. Every test runs on 127.0.0.1, so a
//! per-address cap counts the test's own connections: caps here are small
//! and every connection is accounted for.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use oqp_tests::bench::load::{Conn, Req};
use oqp_tests::client::eventually;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::Stack;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Long enough to never decide a test by itself, and shorter than every
/// built-in timeout (hyper's own, the defaults).
const PATIENCE: Duration = Duration::from_secs(5);

fn config(url: &str, proxy: &str, extra: &str) -> String {
    format!(
        "proxy:\n  max_concurrent: 2\n{proxy}ollama:\n  hosts:\n    - url: \"{url}\"\n      name: primary\n      max_concurrent: 2\n{extra}"
    )
}

async fn stack(proxy: &str, extra: &str) -> (FakeOllama, Stack) {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let stack = Stack::start(&config(&fake.url(), proxy, extra)).await;
    (fake, stack)
}

/// Reads until the server closes the connection; how long that took, or
/// `None` if it stayed open for [`PATIENCE`].
async fn closed_within(stream: &mut TcpStream, since: Instant) -> Option<Duration> {
    let mut buffer = [0u8; 1024];
    tokio::time::timeout(PATIENCE, async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return since.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

#[tokio::test]
async fn a_silent_socket_is_closed_at_the_first_request_deadline() {
    let (_fake, stack) = stack("  first_request_timeout: 0.3\n", "").await;
    let opened = Instant::now();
    let mut silent = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    let after = closed_within(&mut silent, opened).await;
    let after = after.expect("a socket that sent nothing stayed open");
    assert!(
        after >= Duration::from_millis(300),
        "closed after {after:?}, before the deadline"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_partial_or_streamless_http2_preface_is_closed_at_the_first_request_deadline() {
    let (_fake, stack) = stack("  first_request_timeout: 0.3\n", "").await;
    let addr = stack.proxy_addr();
    // Part of the preface: protocol detection never completes.
    let opened = Instant::now();
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n\r\nS").await.unwrap();
    let after = closed_within(&mut partial, opened).await;
    assert!(
        after.is_some_and(|after| after >= Duration::from_millis(300)),
        "a partial HTTP/2 preface: closed after {after:?}"
    );
    // The whole preface and SETTINGS, then no stream.
    let opened = Instant::now();
    let mut streamless = TcpStream::connect(addr).await.unwrap();
    streamless
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let after = closed_within(&mut streamless, opened).await;
    assert!(
        after.is_some_and(|after| after >= Duration::from_millis(300)),
        "an HTTP/2 connection that opened no stream: closed after {after:?}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn an_http2_connection_with_no_stream_is_closed_at_the_idle_timeout() {
    let (_fake, stack) = stack("  first_request_timeout: 10\n  idle_timeout: 0.3\n", "").await;
    let stream = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    let request = http::Request::get(format!("{}/health", stack.url()))
        .body(Empty::<Bytes>::new())
        .unwrap();
    // The server's idle clock starts when it has sent the answer, which is
    // after the request left here and before the answer is read here: only
    // the send time is a lower bound for the close.
    let sent = Instant::now();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap();
    // The connection task ends when the server closes the connection.
    let closed = tokio::time::timeout(PATIENCE, connection).await;
    assert!(closed.is_ok(), "an idle HTTP/2 connection stayed open");
    assert!(
        sent.elapsed() >= Duration::from_millis(300),
        "closed {:?} after the request, before the idle timeout",
        sent.elapsed()
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn an_idle_http1_keep_alive_is_closed_at_the_idle_timeout() {
    let (_fake, stack) = stack("  first_request_timeout: 10\n  idle_timeout: 0.3\n", "").await;
    let mut stream = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    // The server's idle clock starts once it has answered: after this send,
    // perhaps before the answer is read here.
    let sent = Instant::now();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: oqp\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    while !answer.ends_with(br#"{"status":"ok"}"#) {
        let n = stream.read(&mut buffer).await.unwrap();
        assert!(n > 0, "closed before the answer");
        answer.extend_from_slice(&buffer[..n]);
    }
    let after = closed_within(&mut stream, sent).await;
    assert!(
        after.is_some_and(|after| after >= Duration::from_millis(300)),
        "an idle keep-alive: closed after {after:?}"
    );
    stack.shutdown().await;
}

/// A client with one keep-alive connection, served once.
async fn served_client(addr: SocketAddr) -> Conn {
    let mut client = Conn::open(addr).await.unwrap();
    let answer = client.send(&Req::get("/health", None)).await.unwrap();
    assert_eq!(answer.status, 200);
    client
}

/// With `open` connections already counted (the served client among them),
/// one more connection to `addr` is closed at once, and the served client
/// is still answered on its connection.
async fn assert_over_the_cap(addr: SocketAddr, client: &mut Conn) {
    let opened = Instant::now();
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let after = closed_within(&mut extra, opened).await;
    assert!(
        after.is_some(),
        "a connection over the cap stayed open (the first-request deadline is 30 s)"
    );
    let answer = client.send(&Req::get("/health", None)).await.unwrap();
    assert_eq!(answer.status, 200, "the connected client is still served");
}

#[tokio::test]
async fn one_address_gets_at_most_max_connections_per_ip() {
    let proxy = "  first_request_timeout: 30\n  max_connections_per_ip: 3\n";
    let (_fake, stack) = stack(proxy, "").await;
    let addr = stack.proxy_addr();
    let mut client = served_client(addr).await;
    // Two idle sockets fill the cap; the listener takes connections in
    // order, so they are counted before the next one is accepted.
    let _idle = [
        TcpStream::connect(addr).await.unwrap(),
        TcpStream::connect(addr).await.unwrap(),
    ];
    assert_over_the_cap(addr, &mut client).await;
    drop(_idle);
    let dataplane = stack.control.dataplane().unwrap().app().clone();
    assert!(
        eventually(PATIENCE, || dataplane.connections.open() == 1).await,
        "closed connections never freed their places"
    );
    drop(client);
    stack.shutdown().await;
}

#[tokio::test]
async fn all_listeners_share_max_connections() {
    let port = oqp_tests::harness::loopback()
        .await
        .local_addr()
        .unwrap()
        .port();
    let proxy = "  first_request_timeout: 30\n  max_connections: 3\n";
    let extra = format!(
        "auth:\n  enabled: true\n  keys:\n    - key: \"sk-batch-0123456789\"\n      client_id: batch\nclient_injection:\n  listeners:\n    - listen_port: {port}\n      inject_as: batch\n"
    );
    let (_fake, stack) = stack(proxy, &extra).await;
    let injection = SocketAddr::from(([127, 0, 0, 1], port));
    assert!(
        eventually(PATIENCE, || std::net::TcpStream::connect(injection).is_ok()).await,
        "the injection port opened"
    );
    // The probe above was counted and closed; wait until it is uncounted.
    let addr = stack.proxy_addr();
    let dataplane = stack.control.dataplane().unwrap().app().clone();
    assert!(
        eventually(PATIENCE, || dataplane.connections.open() == 0).await,
        "the probe connection was never uncounted"
    );
    let mut client = served_client(addr).await;
    let _idle = [
        TcpStream::connect(injection).await.unwrap(),
        TcpStream::connect(injection).await.unwrap(),
    ];
    assert!(
        eventually(PATIENCE, || dataplane.connections.open() == 3).await,
        "the injection port's connections are counted"
    );
    assert_over_the_cap(addr, &mut client).await;
    // The injection port refuses too.
    let opened = Instant::now();
    let mut extra = TcpStream::connect(injection).await.unwrap();
    assert!(closed_within(&mut extra, opened).await.is_some());
    stack.shutdown().await;
}
