use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use super::*;
use crate::config::Tier;

fn config(url: &str, events: &[WebhookEvent]) -> WebhooksConfig {
    WebhooksConfig {
        enabled: true,
        url: url.to_owned(),
        events: events.to_vec(),
        allowed_hosts: Vec::new(),
    }
}

/// A receiver on 127.0.0.1:0 that answers 204 and hands over what it got.
async fn sink() -> (SocketAddr, mpsc::UnboundedReceiver<(HeaderMap, Value)>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let tx = tx.clone();
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await.unwrap().to_bytes();
                        let json: Value = serde_json::from_slice(&body).unwrap();
                        let _ = tx.send((parts.headers, json));
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(204)
                                .body(Full::new(Bytes::new()))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, rx)
}

fn take_queue(webhooks: &Webhooks) -> mpsc::Receiver<Delivery> {
    lock(&webhooks.inner.pending).take().unwrap()
}

#[test]
fn only_subscribed_events_are_queued() {
    let webhooks = Webhooks::new(&config(
        "http://hooks.example.com/h",
        &[WebhookEvent::QueueFull, WebhookEvent::HostUnhealthy],
    ));
    let mut queue = take_queue(&webhooks);
    assert!(!webhooks.notify(Notice::new(WebhookEvent::QueueDrained)));
    assert!(webhooks.notify(Notice::new(WebhookEvent::QueueFull).tier(Some(Tier::Low))));
    let mut fields = Map::new();
    fields.insert("name".to_owned(), "primary".into());
    webhooks.send(WebhookEvent::HostUnhealthy, fields);

    let first = queue.try_recv().unwrap();
    assert_eq!(first.event, WebhookEvent::QueueFull);
    assert_eq!(first.url, "http://hooks.example.com/h");
    let body: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(body["tier"], "low");
    let second = queue.try_recv().unwrap();
    let body: Value = serde_json::from_slice(&second.body).unwrap();
    assert_eq!(body["event"], "host.unhealthy");
    assert_eq!(body["name"], "primary");
    assert!(queue.try_recv().is_err());
    assert_eq!(webhooks.stats().queued, 2);
}

#[test]
fn disabled_webhooks_queue_nothing_and_reload_applies() {
    let mut settings = config("http://a.example.com/h", WebhookEvent::ALL);
    settings.enabled = false;
    let webhooks = Webhooks::new(&settings);
    let mut queue = take_queue(&webhooks);
    assert!(!webhooks.notify(Notice::new(WebhookEvent::HostRecovered)));

    webhooks.configure(&config("http://b.example.com/h", WebhookEvent::ALL));
    assert!(webhooks.notify(Notice::new(WebhookEvent::HostRecovered)));
    assert_eq!(queue.try_recv().unwrap().url, "http://b.example.com/h");
}

#[test]
fn a_full_queue_drops_and_counts_without_waiting() {
    let webhooks = Webhooks::new(&config("http://hooks.example.com/h", WebhookEvent::ALL));
    for _ in 0..QUEUE_CAPACITY {
        assert!(webhooks.notify(Notice::new(WebhookEvent::QueueDrained)));
    }
    assert!(!webhooks.notify(Notice::new(WebhookEvent::QueueDrained)));
    let stats = webhooks.stats();
    assert_eq!(stats.queued, QUEUE_CAPACITY as u64);
    assert_eq!(stats.dropped, 1);
}

#[tokio::test]
async fn the_sender_posts_json_to_the_url() {
    let (addr, mut received) = sink().await;
    let webhooks = Webhooks::new(&config(&format!("http://{addr}/hook"), WebhookEvent::ALL));
    // Queued before the sender starts: delivered once it does.
    webhooks.notify(
        Notice::new(WebhookEvent::QueueFull)
            .tier(Some(Tier::High))
            .field("client_id", "alice")
            .field("node", "local"),
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(webhooks.sender(Outbound::new(), shutdown.clone()).unwrap());
    assert!(webhooks.sender(Outbound::new(), shutdown.clone()).is_none());

    let (headers, body) = tokio::time::timeout(Duration::from_secs(10), received.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(
        headers["user-agent"],
        concat!("oqp/", env!("CARGO_PKG_VERSION"))
    );
    assert!(headers.get("authorization").is_none());
    let timestamp = body["timestamp"].as_str().unwrap().to_owned();
    assert_eq!(
        body,
        json!({
            "event": "queue.full",
            "timestamp": timestamp,
            "tier": "high",
            "client_id": "alice",
            "node": "local",
        })
    );
    assert!(
        timestamp.ends_with('Z') && timestamp.len() == 27,
        "{timestamp}"
    );

    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn a_silent_receiver_fails_at_the_deadline_without_retry() {
    assert_eq!(TIMEOUT, Duration::from_secs(5));
    // Accepts connections (the kernel does) but never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let delivery = Delivery {
        event: WebhookEvent::HostUnhealthy,
        url: format!("http://{addr}/hook"),
        body: Bytes::from_static(b"{}"),
        public_only: false,
    };
    let deadline = Duration::from_millis(200);
    let started = std::time::Instant::now();
    assert!(!delivery::deliver(&Outbound::new(), &delivery, deadline).await);
    let elapsed = started.elapsed();
    assert!(
        elapsed >= deadline && elapsed < deadline * 10,
        "{elapsed:?}"
    );
    // One attempt, one connection: nothing was retried.
    let (_first, _) = listener.accept().await.unwrap();
    let retried = tokio::time::timeout(Duration::ZERO, listener.accept()).await;
    assert!(retried.is_err(), "a second connection was made");
}

#[tokio::test]
async fn a_refused_connection_fails_fast() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let delivery = Delivery {
        event: WebhookEvent::HostRecovered,
        url: format!("http://{addr}/hook"),
        body: Bytes::from_static(b"{}"),
        public_only: false,
    };
    assert!(!delivery::deliver(&Outbound::new(), &delivery, TIMEOUT).await);
}

#[tokio::test]
async fn a_name_that_resolves_to_a_private_address_at_delivery_is_not_posted_to() {
    // `localhost` passes for a name that resolved to a public address at start-up and was
    // rebound to a loopback one since.
    let (addr, mut received) = sink().await;
    let url = format!("http://localhost:{}/hook", addr.port());
    let webhooks = Webhooks::new(&config(&url, WebhookEvent::ALL));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(webhooks.sender(Outbound::new(), shutdown.clone()).unwrap());
    webhooks.notify(Notice::new(WebhookEvent::QueueDrained).field("node", "local"));
    let counters = webhooks.inner.counters.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while counters.failed.load(Ordering::Relaxed) == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(counters.failed.load(Ordering::Relaxed), 1);
    assert!(received.try_recv().is_err(), "nothing reached the receiver");
    // Listed in allowed_hosts: delivered.
    let mut allowed = config(&url, WebhookEvent::ALL);
    allowed.allowed_hosts = vec!["localhost".to_owned()];
    webhooks.configure(&allowed);
    webhooks.notify(Notice::new(WebhookEvent::QueueDrained).field("node", "local"));
    let (_, body) = tokio::time::timeout(Duration::from_secs(10), received.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(body["event"], "queue.drained");
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn the_public_only_client_refuses_private_addresses_and_the_other_does_not() {
    let (addr, _received) = sink().await;
    let delivery = Delivery {
        event: WebhookEvent::QueueDrained,
        url: format!("http://localhost:{}/hook", addr.port()),
        body: Bytes::from_static(b"{}"),
        public_only: true,
    };
    assert!(!delivery::deliver(&Outbound::public_only(), &delivery, TIMEOUT).await);
    assert!(delivery::deliver(&Outbound::new(), &delivery, TIMEOUT).await);
}
