//! TLS on the proxy port: HTTP/1.1 and HTTP/2 by ALPN with rcgen-made certificates, a
//! certificate swapped on disk served to new connections while open ones go on, a clear
//! start-up error for a pair that cannot be used, a clear answer to plaintext on a TLS port,
//! and the connection caps and first-request deadline holding over a handshake.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use oqp_tests::client::wait_until;
use oqp_tests::fake::FakeOllama;
use oqp_tests::harness::{ConfigYaml, Host, Stack};
use oqp_tests::tls::{TestCa, client_config, connect, proxy_tls_yaml};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Long enough to never decide a test by itself.
const PATIENCE: Duration = Duration::from_secs(5);

fn config(url: &str, proxy: &str) -> String {
    ConfigYaml::new()
        .max_concurrent(2)
        .under("proxy", proxy)
        .host(Host::ollama("primary", url).set("max_concurrent", 2))
        .yaml()
}

/// A stack whose proxy port speaks TLS with a certificate from `ca`, plus `proxy` settings.
async fn tls_stack(ca: &TestCa, proxy: &str) -> (FakeOllama, Stack, tempfile::TempDir) {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.issue().write(dir.path(), "server");
    let proxy = format!("{}{proxy}", proxy_tls_yaml(&cert, &key));
    let stack = Stack::start(&config(&fake.url(), &proxy)).await;
    (fake, stack, dir)
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// An HTTP/1.1 connection over TLS to the proxy port, trusting `ca_pem`.
async fn http1(stack: &Stack, ca_pem: &str) -> std::io::Result<Sender> {
    http1_to(stack.proxy_addr(), ca_pem).await
}

/// An HTTP/1.1 connection over TLS to `addr`, trusting `ca_pem`.
async fn http1_to(addr: std::net::SocketAddr, ca_pem: &str) -> std::io::Result<Sender> {
    let tls = connect(addr, client_config(ca_pem, &[b"http/1.1"])).await?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(connection);
    Ok(sender)
}

/// Retries [`http1`] until a handshake trusting `ca_pem` succeeds (within [`PATIENCE`]).
async fn until_connected(stack: &Stack, ca_pem: &str) -> Sender {
    until_connected_to(stack.proxy_addr(), ca_pem).await
}

/// Retries [`http1_to`] until a handshake trusting `ca_pem` succeeds (within [`PATIENCE`]).
async fn until_connected_to(addr: std::net::SocketAddr, ca_pem: &str) -> Sender {
    wait_until(PATIENCE, || http1_to(addr, ca_pem))
        .await
        .unwrap_or_else(|error| panic!("no handshake: {error}"))
}

async fn get(sender: &mut Sender, path: &str) -> (http::StatusCode, String) {
    let request = http::Request::get(path)
        .header("host", "127.0.0.1")
        .body(Empty::<Bytes>::new())
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn the_proxy_port_serves_http1_and_http2_over_tls_by_alpn() {
    let ca = TestCa::new();
    let (_fake, stack, _dir) = tls_stack(&ca, "").await;

    // HTTP/1.1, chosen by ALPN.
    let tls = connect(stack.proxy_addr(), client_config(&ca.pem(), &[b"http/1.1"]))
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let mut sender = http1(&stack, &ca.pem()).await.unwrap();
    let (status, body) = get(&mut sender, "/api/tags").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("llama3"), "{body}");

    // HTTP/2, chosen by ALPN, on the same port.
    let tls = connect(
        stack.proxy_addr(),
        client_config(&ca.pem(), &[b"h2", b"http/1.1"]),
    )
    .await
    .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(connection);
    let request = http::Request::get(format!("https://{}/api/tags", stack.proxy_addr()))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), http::Version::HTTP_2);

    // TLS 1.2 is accepted; a client trusting another CA is refused.
    let tls12 = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS12])
    .unwrap()
    .with_root_certificates(root_store(&ca.pem()))
    .with_no_client_auth();
    let tls = connect(stack.proxy_addr(), std::sync::Arc::new(tls12))
        .await
        .unwrap();
    assert_eq!(
        tls.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_2)
    );
    let stranger = TestCa::new();
    assert!(
        connect(stack.proxy_addr(), client_config(&stranger.pem(), &[]))
            .await
            .is_err()
    );
    stack.shutdown().await;
}

fn root_store(ca_pem: &str) -> rustls::RootCertStore {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    roots
}

#[tokio::test]
async fn a_plaintext_request_on_a_tls_port_is_told_to_use_https() {
    let ca = TestCa::new();
    let (_fake, stack, _dir) = tls_stack(&ca, "").await;
    let mut plain = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    plain
        .write_all(b"GET /api/tags HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, plain.read_to_end(&mut answer))
        .await
        .expect("the plaintext connection was answered and closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(answer.contains("this port speaks TLS"), "{answer}");
    assert!(answer.contains("https://"), "{answer}");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_half_handshake_is_an_idle_socket_under_the_caps_and_the_first_request_deadline() {
    let ca = TestCa::new();
    let (_fake, stack, _dir) = tls_stack(
        &ca,
        "  first_request_timeout: 0.5\n  max_connections_per_ip: 1\n",
    )
    .await;
    // The start of a ClientHello record, then nothing.
    let opened = Instant::now();
    let mut half = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    half.write_all(&[0x16, 0x03, 0x01, 0x00, 0xc8, 0x01])
        .await
        .unwrap();
    // Its slot is held meanwhile: a second connection from this address is closed at once,
    // before the first one's deadline.
    let mut second = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(PATIENCE, second.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "a connection over the per-address cap was served: {read:?}"
    );
    // The half handshake is closed at the deadline, counted from the accept.
    let read = tokio::time::timeout(PATIENCE, half.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "a half handshake stayed open: {read:?}"
    );
    assert!(
        opened.elapsed() >= Duration::from_millis(500),
        "closed after {:?}, before the deadline",
        opened.elapsed()
    );
    // Its slot is free again: a full handshake and a request go through.
    let mut sender = until_connected(&stack, &ca.pem()).await;
    assert_eq!(get(&mut sender, "/api/tags").await.0, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_certificate_replaced_on_disk_is_served_to_new_connections_and_open_ones_go_on() {
    let ca = TestCa::new();
    let (_fake, stack, dir) = tls_stack(&ca, "").await;
    let mut before = http1(&stack, &ca.pem()).await.unwrap();
    assert_eq!(get(&mut before, "/api/tags").await.0, 200);

    // A certificate from another CA replaces the pair on disk (as certbot renews it).
    let next_ca = TestCa::new();
    next_ca.issue().write(dir.path(), "server");
    let mut after = until_connected(&stack, &next_ca.pem()).await;
    assert_eq!(get(&mut after, "/api/tags").await.0, 200);
    // New handshakes no longer present the old certificate.
    assert!(http1(&stack, &ca.pem()).await.is_err());
    // The connection made before the swap was not dropped.
    assert_eq!(get(&mut before, "/api/tags").await.0, 200);

    // A broken replacement keeps the last good certificate.
    std::fs::write(dir.path().join("server.key"), "not a key").unwrap();
    let mut still = http1(&stack, &next_ca.pem()).await.unwrap();
    assert_eq!(get(&mut still, "/api/tags").await.0, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_unusable_pair_is_a_clear_start_up_error_that_never_shows_the_key() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new();
    let one = ca.issue();
    let other = ca.issue();
    let (cert, _) = one.write(dir.path(), "one");
    let (_, other_key) = other.write(dir.path(), "other");
    let start = |cert: std::path::PathBuf, key: std::path::PathBuf| {
        let yaml = config(&fake.url(), &proxy_tls_yaml(&cert, &key));
        async move {
            Stack::try_start(&yaml, oqp_controlplane::config::Env::empty())
                .await
                .map(|_| ())
                .expect_err("the data plane refuses to start")
                .to_string()
        }
    };
    let key_body: String = other
        .key_pem
        .lines()
        .filter(|line| !line.starts_with("-----"))
        .collect();

    let mut messages = Vec::new();
    // A key that is not the certificate's.
    let message = start(cert.clone(), other_key.clone()).await;
    assert!(
        message.contains("does not match the certificate"),
        "{message}"
    );
    assert!(
        message.contains(&other_key.display().to_string()),
        "{message}"
    );
    messages.push(message);
    // A file that is not there.
    let missing = dir.path().join("missing.crt");
    let message = start(missing.clone(), other_key.clone()).await;
    assert!(
        message.contains(&format!(
            "cannot read TLS certificate file {}",
            missing.display()
        )),
        "{message}"
    );
    messages.push(message);
    // A certificate file given as the key: no key in it.
    let message = start(cert.clone(), cert.clone()).await;
    assert!(
        message.contains("holds no usable PEM private key"),
        "{message}"
    );
    messages.push(message);
    // The key given as the certificate: the message names the file, not its contents.
    let message = start(other_key.clone(), other_key.clone()).await;
    assert!(message.contains("holds no PEM certificate"), "{message}");
    messages.push(message);
    // No message shows a byte of the key.
    for message in messages {
        assert!(!message.contains("PRIVATE KEY"), "{message}");
        assert!(!message.contains(&key_body[..40]), "{message}");
    }
}

#[tokio::test]
async fn the_tls_benchmark_row_measures_both_ports() {
    let figures = oqp_tests::bench::tls::measure(5, 20).await.unwrap();
    let rows = figures.rows();
    for name in [
        "TCP connect + TLS handshake",
        "request, kept-alive, TLS",
        "added per kept-alive request (p50)",
    ] {
        assert!(rows.contains(name), "{rows}");
    }
    assert!(figures.tls_connect[0] > 0.0 && figures.tls_request[0] > 0.0);
}

#[tokio::test]
async fn an_expired_or_future_certificate_is_a_clear_start_up_error() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new();
    let cases = [
        (
            "expired",
            ca.issue_valid(Some((2019, 1, 1)), Some((2020, 1, 1))),
            "expired on 2020-01-01",
        ),
        (
            "future",
            ca.issue_valid(Some((2090, 1, 1)), Some((2091, 1, 1))),
            "is not valid before 2090-01-01",
        ),
    ];
    for (stem, issued, expected) in cases {
        let (cert, key) = issued.write(dir.path(), stem);
        let yaml = config(&fake.url(), &proxy_tls_yaml(&cert, &key));
        let message = Stack::try_start(&yaml, oqp_controlplane::config::Env::empty())
            .await
            .map(|_| ())
            .expect_err("the data plane refuses to start")
            .to_string();
        assert!(message.contains(expected), "{message}");
        assert!(message.contains(&cert.display().to_string()), "{message}");
    }
}

#[tokio::test]
async fn an_expired_replacement_keeps_the_certificate_being_served() {
    let ca = TestCa::new();
    let (_fake, stack, dir) = tls_stack(&ca, "").await;
    let expired_ca = TestCa::new();
    expired_ca
        .issue_valid(Some((2019, 1, 1)), Some((2020, 1, 1)))
        .write(dir.path(), "server");
    // A forced reload (what SIGHUP does) refuses it and says why.
    let errors = stack.control.dataplane().unwrap().app().tls.reload(true);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].to_string().contains("expired on 2020-01-01"));
    let mut sender = http1(&stack, &ca.pem()).await.unwrap();
    assert_eq!(get(&mut sender, "/api/tags").await.0, 200);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_injection_listener_serves_tls_with_its_own_certificate() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new();
    let (cert, key) = ca.issue().write(dir.path(), "injection");
    let port = oqp_tests::harness::loopback()
        .await
        .local_addr()
        .unwrap()
        .port();
    let extra = format!(
        "auth:\n  enabled: true\n  keys:\n    - key: \"sk-batch-0123456789\"\n      client_id: batch\n\
         client_injection:\n  listeners:\n    - listen_port: {port}\n      inject_as: batch\n      \
         tls:\n        cert_file: \"{}\"\n        key_file: \"{}\"\n",
        cert.display(),
        key.display()
    );
    let stack = Stack::start(&format!("{}{extra}", config(&fake.url(), ""))).await;
    let injection = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    // No key sent: the port's TLS and its injected identity are all the request needs.
    let mut sender = until_connected_to(injection, &ca.pem()).await;
    let (status, body) = get(&mut sender, "/api/tags").await;
    assert_eq!(status, 200, "{body}");
    // The main port stays plain HTTP.
    let mut plain = TcpStream::connect(stack.proxy_addr()).await.unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, plain.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_throttled_address_gets_no_handshake() {
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new();
    let (cert, key) = ca.issue().write(dir.path(), "server");
    let extra = "auth:\n  enabled: true\n  rate_limit: {max_failures: 2, window_seconds: 60}\n  \
                 keys:\n    - {key: sk-batch-0123456789, client_id: batch}\n";
    let yaml = format!(
        "{}{extra}",
        config(&fake.url(), &proxy_tls_yaml(&cert, &key))
    );
    let stack = Stack::start(&yaml).await;
    // Two requests with a wrong key, over TLS: the throttle's count is full.
    let mut sender = http1(&stack, &ca.pem()).await.unwrap();
    for _ in 0..2 {
        sender.ready().await.unwrap();
        let request = http::Request::get("/api/tags")
            .header("host", "127.0.0.1")
            .header("authorization", "Bearer sk-guess-0123456789")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 401);
        response.into_body().collect().await.unwrap();
    }
    // The open connection is answered by the throttle (429, with its Retry-After)...
    let (status, _) = get(&mut sender, "/api/tags").await;
    assert_eq!(status, 429);
    // ...and a new one from this address is closed before its handshake.
    assert!(http1(&stack, &ca.pem()).await.is_err());
    stack.shutdown().await;
}

/// A POST of a chat over `sender`, with `headers`; the status.
async fn chat_over(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>,
    headers: &[(&str, &str)],
) -> http::StatusCode {
    let body = r#"{"model":"llama3","stream":false,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut request = http::Request::post("/api/chat")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(http_body_util::Full::new(Bytes::from_static(
            body.as_bytes(),
        )))
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let _ = response.into_body().collect().await;
    status
}

/// An HTTP/1.1 connection over TLS presenting `config`'s client certificate, if any.
async fn http1_with(
    stack: &Stack,
    config: std::sync::Arc<rustls::ClientConfig>,
) -> std::io::Result<hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>> {
    let tls = connect(stack.proxy_addr(), config).await?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(connection);
    Ok(sender)
}

#[tokio::test]
async fn a_verified_client_certificate_names_its_client_by_subject() {
    use oqp_tests::tls::client_config_with_cert;
    let server_ca = TestCa::new();
    let clients_ca = TestCa::new();
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = server_ca.issue().write(dir.path(), "server");
    let client_ca = dir.path().join("clients-ca.pem");
    std::fs::write(&client_ca, clients_ca.pem()).unwrap();
    let proxy = format!(
        "{}    client_ca_file: \"{}\"\n",
        proxy_tls_yaml(&cert, &key),
        client_ca.display()
    );
    let yaml = format!(
        "{}auth:\n  enabled: true\n  keys:\n    - client_id: backup\n      tls_subject: svc-backup\n    - client_id: web\n      key: sk-web-0123456789\n",
        config(&fake.url(), &proxy)
    );
    let stack = Stack::start(&yaml).await;
    let backup = clients_ca.issue_client("svc-backup");

    // The certificate is the credential: no key needed.
    let mut sender = {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match http1_with(&stack, client_config_with_cert(&server_ca.pem(), &backup)).await {
                Ok(sender) => break sender,
                Err(error) if Instant::now() >= deadline => panic!("no handshake: {error}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    assert_eq!(chat_over(&mut sender, &[]).await, 200);
    // A key sent on the same connection is the key's client.
    assert_eq!(
        chat_over(
            &mut sender,
            &[("authorization", "Bearer sk-web-0123456789")]
        )
        .await,
        200
    );
    let seen: Vec<String> = fake
        .handle()
        .requests_to("/api/chat")
        .iter()
        .filter_map(|request| request.header("x-client-id"))
        .collect();
    assert_eq!(seen, ["backup", "web"]);

    // Without a certificate the port still takes keys, and refuses a request with neither.
    let plain = client_config(&server_ca.pem(), &[b"http/1.1"]);
    let mut sender = http1_with(&stack, plain).await.unwrap();
    assert_eq!(chat_over(&mut sender, &[]).await, 401);
    assert_eq!(
        chat_over(
            &mut sender,
            &[("authorization", "Bearer sk-web-0123456789")]
        )
        .await,
        200
    );

    // A verified certificate whose subject names no client is no credential.
    let stranger = clients_ca.issue_client("svc-unknown");
    let mut sender = http1_with(&stack, client_config_with_cert(&server_ca.pem(), &stranger))
        .await
        .unwrap();
    assert_eq!(chat_over(&mut sender, &[]).await, 401);

    // A certificate from a CA the port does not trust fails the handshake (TLS 1.3 reports it
    // on the client's first read): no request of it is answered.
    let forged = TestCa::new().issue_client("svc-backup");
    let answered =
        match http1_with(&stack, client_config_with_cert(&server_ca.pem(), &forged)).await {
            Err(_) => false,
            Ok(mut sender) => {
                let request = http::Request::get("/api/tags")
                    .header("host", "127.0.0.1")
                    .body(http_body_util::Full::new(Bytes::new()))
                    .unwrap();
                match sender.ready().await {
                    Err(_) => false,
                    Ok(()) => sender.send_request(request).await.is_ok(),
                }
            }
        };
    assert!(!answered, "a certificate of an untrusted CA was served");
    assert_eq!(fake.handle().requests_to("/api/chat").len(), 3);
    stack.shutdown().await;
}

#[tokio::test]
async fn a_dashboard_session_cookie_is_secure_on_a_tls_port() {
    let ca = TestCa::new();
    let fake = FakeOllama::builder().model("llama3").spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.issue().write(dir.path(), "server");
    let yaml = format!(
        "{}auth:\n  enabled: true\n  keys:\n    - {{key: sk-read-0123456789, client_id: widget, scope: read}}\n",
        config(&fake.url(), &proxy_tls_yaml(&cert, &key))
    );
    let stack = Stack::start(&yaml).await;
    until_connected(&stack, &ca.pem()).await;
    let tls = connect(stack.proxy_addr(), client_config(&ca.pem(), &[b"http/1.1"]))
        .await
        .unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = http::Request::post("/dashboard/login")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from_static(
            br#"{"key":"sk-read-0123456789"}"#,
        )))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let cookie = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.starts_with("oqp_session=")
            && cookie.ends_with("; HttpOnly; SameSite=Strict; Secure"),
        "{cookie}"
    );
    stack.shutdown().await;
}
