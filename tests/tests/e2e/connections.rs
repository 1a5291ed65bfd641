//! Connections: a socket that never sends a request, or sits idle, is
//! closed after its (small, configured) deadline; connections over the caps
//! (in all, or from one address) are closed at once while the clients
//! already connected go on being served; the control plane's gRPC port holds the same
//! caps and deadlines, and pings. Every test runs on 127.0.0.1, so a
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
use oqp_tests::harness::{ConfigYaml, Host, Stack};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Long enough to never decide a test by itself, and shorter than every
/// built-in timeout (hyper's own, the defaults).
const PATIENCE: Duration = Duration::from_secs(5);

fn config(url: &str, proxy: &str, extra: &str) -> String {
    ConfigYaml::new()
        .max_concurrent(2)
        .under("proxy", proxy)
        .host(Host::ollama("primary", url).set("max_concurrent", 2))
        .raw(extra)
        .yaml()
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

#[tokio::test]
async fn a_request_running_past_the_idle_timeout_is_not_cut_and_its_connection_idles_after_it() {
    let (fake, stack) = stack("  first_request_timeout: 10\n  idle_timeout: 0.3\n", "").await;
    let upstream = fake.handle();
    upstream.hold();
    let mut busy = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    let body = r#"{"model":"llama3","prompt":"hi","stream":false}"#;
    busy.write_all(
        format!(
            "POST /api/generate HTTP/1.1\r\nHost: oqp\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    assert!(
        eventually(PATIENCE, || upstream.in_flight() == 1).await,
        "the request never reached the fake"
    );
    // Two idle connections, one after the other, each closed at its idle timeout: the held
    // request has run through two of its own connection's idle periods when they are gone.
    for _ in 0..2 {
        let mut idle = TcpStream::connect(stack.proxy_addr()).await.unwrap();
        idle.write_all(b"GET /health HTTP/1.1\r\nHost: oqp\r\n\r\n")
            .await
            .unwrap();
        let answered = Instant::now();
        let after = closed_within(&mut idle, answered).await;
        assert!(
            after.is_some_and(|after| after >= Duration::from_millis(300)),
            "an idle keep-alive: closed after {after:?}"
        );
    }
    // The connection's idle clock starts when the answer has gone out: after this.
    let released = Instant::now();
    upstream.release_all();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    while !answer.windows(6).any(|window| window == b"\"done\"") {
        let n = tokio::time::timeout(PATIENCE, busy.read(&mut buffer))
            .await
            .expect("no answer")
            .unwrap();
        assert!(n > 0, "the connection of a running request was closed");
        answer.extend_from_slice(&buffer[..n]);
    }
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    // Once it has ended, its connection is idle and closed at the idle timeout.
    let after = closed_within(&mut busy, released).await;
    assert!(
        after.is_some_and(|after| after >= Duration::from_millis(300)),
        "after its request: closed after {after:?}"
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

/// A gRPC call to the control plane at `url` (a fresh connection): whether it was answered.
async fn grpc_answers(url: &str) -> bool {
    use oqp_proto::admin::v1::{GetStatusRequest, admin_service_client::AdminServiceClient};
    let Ok(mut admin) = AdminServiceClient::connect(url.to_owned()).await else {
        return false;
    };
    tokio::time::timeout(PATIENCE, admin.get_status(GetStatusRequest::default()))
        .await
        .is_ok_and(|answer| answer.is_ok())
}

#[tokio::test]
async fn the_grpc_port_closes_connections_over_its_cap_and_serves_again_below_it() {
    // The data plane's caps hold on the control plane's port too; the in-process data
    // plane's link is one of the three from this address.
    let proxy = "  first_request_timeout: 30\n  max_connections_per_ip: 3\n";
    let (_fake, stack) = stack(proxy, "").await;
    let grpc = stack.control.local_addr();
    let idle = [
        TcpStream::connect(grpc).await.unwrap(),
        TcpStream::connect(grpc).await.unwrap(),
    ];
    let opened = Instant::now();
    let mut extra = TcpStream::connect(grpc).await.unwrap();
    assert!(
        closed_within(&mut extra, opened).await.is_some(),
        "a gRPC connection over the cap stayed open"
    );
    assert!(!grpc_answers(&stack.control_url()).await, "over the cap");
    drop(idle);
    // The server sees the two close, then frees their places.
    let mut answered = false;
    let deadline = Instant::now() + PATIENCE;
    while !answered && Instant::now() < deadline {
        answered = grpc_answers(&stack.control_url()).await;
    }
    assert!(answered, "closed connections never freed their places");
    let link = stack.control.dataplane().unwrap().app().control.clone();
    assert!(link.is_connected(), "the data plane's own link was kept");
    stack.shutdown().await;
}

/// Reads HTTP/2 frames from `stream` until one of type `kind` (without the ACK flag)
/// arrives; `false` if the connection closed first.
async fn frame_arrives(stream: &mut TcpStream, kind: u8) -> bool {
    let mut header = [0u8; 9];
    loop {
        if stream.read_exact(&mut header).await.is_err() {
            return false;
        }
        let length =
            usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
        let mut payload = vec![0u8; length];
        if stream.read_exact(&mut payload).await.is_err() {
            return false;
        }
        if header[3] == kind && header[4] & 1 == 0 {
            return true;
        }
    }
}

#[tokio::test]
async fn a_half_open_http2_peer_on_the_grpc_port_is_closed_at_the_data_planes_deadline() {
    // The default timeouts: the data plane closes an HTTP/2 connection that opens no stream
    // at `first_request_timeout` (10 s); the gRPC port pings a silent peer after 5 s and
    // closes it when the ping goes 5 s unanswered (it took 40 s: 20 s and 20 s).
    let (_fake, stack) = stack("", "").await;
    let mut mute = TcpStream::connect(stack.control.local_addr())
        .await
        .unwrap();
    // The preface, SETTINGS and the ACK of the server's SETTINGS: a completed handshake.
    mute.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0\0\0\0\x04\x01\0\0\0\0")
        .await
        .unwrap();
    // Well above 10 s, well below 40 s.
    let bound = Duration::from_secs(25);
    let closed = tokio::time::timeout(bound, async {
        let pinged = frame_arrives(&mut mute, 6).await;
        let mut rest = Vec::new();
        let _ = mute.read_to_end(&mut rest).await;
        pinged
    })
    .await;
    assert_eq!(
        closed.ok(),
        Some(true),
        "a peer answering no ping was not closed within {bound:?} (or was never pinged)"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn the_grpc_port_pings_and_closes_a_silent_peer_while_its_data_plane_stays() {
    let proxy = "  first_request_timeout: 0.3\n  idle_timeout: 0.6\n";
    let (fake, stack) = stack(proxy, "").await;
    let grpc = stack.control.local_addr();
    // A policy stream whose client sends nothing of its own (no keep-alive pings).
    let mut watcher = oqp_proto::policy::v1::policy_service_client::PolicyServiceClient::connect(
        stack.control_url(),
    )
    .await
    .unwrap();
    let mut hello = tonic::Request::new(oqp_proto::policy::v1::NodeHello {
        node: "watcher".to_owned(),
        ..Default::default()
    });
    hello.metadata_mut().insert(
        oqp_proto::NODE_TOKEN_METADATA,
        oqp_dataplane::node_keys::grpc_credential(stack.control.node_token())
            .parse()
            .unwrap(),
    );
    let mut snapshots = watcher.watch_policy(hello).await.unwrap().into_inner();
    assert!(snapshots.message().await.unwrap().is_some());
    // Nothing sent: closed at the first-request deadline.
    let opened = Instant::now();
    let mut silent = TcpStream::connect(grpc).await.unwrap();
    let after = closed_within(&mut silent, opened)
        .await
        .expect("a silent socket on the gRPC port stayed open");
    assert!(
        after >= Duration::from_millis(300),
        "closed after {after:?}"
    );
    // An HTTP/2 peer that stops after its preface is pinged, and closed when it does not
    // answer.
    let mut mute = TcpStream::connect(grpc).await.unwrap();
    mute.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let pinged = tokio::time::timeout(PATIENCE, frame_arrives(&mut mute, 6)).await;
    assert_eq!(pinged.ok(), Some(true), "no HTTP/2 ping on the gRPC port");
    assert!(
        closed_within(&mut mute, Instant::now()).await.is_some(),
        "a peer answering nothing stayed connected"
    );
    // The watcher's connection answered the pings all along: never cut, however short the
    // idle timeout. Its stream, open since before the mute peer came and went, still
    // carries the next snapshot.
    let version = stack
        .rewrite_and_reload(&config(
            &fake.url(),
            &format!("{proxy}  max_connections: 4000\n"),
            "",
        ))
        .unwrap();
    let next = tokio::time::timeout(PATIENCE, snapshots.message())
        .await
        .expect("no snapshot on the watcher's stream")
        .expect("the watcher's stream was cut")
        .expect("the watcher's stream ended");
    assert!(next.version >= version);
    let link = stack.control.dataplane().unwrap().app().control.clone();
    assert!(link.is_connected());
    assert!(grpc_answers(&stack.control_url()).await);
    stack.shutdown().await;
}
