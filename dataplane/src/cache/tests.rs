//! The cache against a scripted upstream: both backends, single flight, and a
//! real `redis-server` that is killed and restarted mid-test.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use serde_json::{Value, json};
use sha2::Digest;

use super::*;

// ---------------------------------------------------------------- helpers

fn settings(backend: CacheBackend) -> CacheSettings {
    CacheSettings {
        enabled: true,
        backend,
        ttl: Duration::from_secs(3600),
        max_entry_bytes: 32_768,
        key_prefix: "oqp:embed:".to_owned(),
        connect_timeout: Duration::from_secs(2),
        max_memory_bytes: 64 << 20,
        per_client: false,
        max_inputs: 2048,
    }
}

async fn memory() -> Cache {
    connect(&settings(CacheBackend::Memory)).await.unwrap()
}

/// A deterministic vector for a text, printed the way Go prints f32s.
fn vector_of(text: &str) -> String {
    let digest = sha2::Sha256::digest(text.as_bytes());
    format!(
        "[{}.5,-{}e-7,0.125,{}]",
        text.len(),
        u16::from_be_bytes([digest[0], digest[1]]),
        digest[2]
    )
}

/// What Ollama answers to an /api/embed or /api/embeddings body.
fn answer(body: &[u8]) -> Bytes {
    let request: Value = serde_json::from_slice(body).unwrap();
    if let Some(prompt) = request.get("prompt") {
        return Bytes::from(format!(
            r#"{{"embedding":{}}}"#,
            vector_of(prompt.as_str().unwrap())
        ));
    }
    let inputs: Vec<String> = match &request["input"] {
        Value::String(text) => vec![text.clone()],
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().unwrap().to_owned())
            .collect(),
        other => panic!("input {other}"),
    };
    let vectors: Vec<String> = inputs.iter().map(|text| vector_of(text)).collect();
    Bytes::from(format!(
        r#"{{"model":{},"embeddings":[{}],"total_duration":1000,"load_duration":10,"prompt_eval_count":{}}}"#,
        request["model"],
        vectors.join(","),
        inputs.len()
    ))
}

/// A scripted upstream that records the bodies it was sent.
#[derive(Clone, Default)]
struct Upstream {
    sent: Arc<Mutex<Vec<Bytes>>>,
}

impl Upstream {
    async fn resolve(
        &self,
        cache: &Cache,
        namespace: Namespace,
        client: &str,
        body: &str,
    ) -> Resolved {
        let body = Bytes::from(body.to_owned());
        let split = plan(namespace, &body).expect("cacheable");
        let sent = Arc::clone(&self.sent);
        cache
            .resolve(
                &split,
                client,
                "/api/embed",
                Tier::Normal,
                |body: Bytes, _| {
                    let sent = Arc::clone(&sent);
                    async move {
                        let reply = answer(&body);
                        sent.lock().unwrap().push(body);
                        Ok::<_, ()>(reply)
                    }
                },
            )
            .await
            .unwrap()
    }

    async fn embed(&self, cache: &Cache, body: &str) -> Resolved {
        self.resolve(cache, Namespace::Embed, "alice", body).await
    }

    fn sent(&self) -> Vec<String> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|b| String::from_utf8(b.to_vec()).unwrap())
            .collect()
    }
}

fn embeddings_of(body: &[u8]) -> Value {
    serde_json::from_slice::<Value>(body).unwrap()["embeddings"].clone()
}

// ------------------------------------------------------- memory backend

#[tokio::test]
async fn miss_then_hit_then_partial() {
    let cache = memory().await;
    let upstream = Upstream::default();
    let body = r#"{"model":"nomic","input":["a","b"],"keep_alive":"5m"}"#;

    let first = upstream.embed(&cache, body).await;
    assert_eq!(first.outcome, Outcome::Miss);
    // A full miss sends the client's body and relays Ollama's answer as is.
    assert_eq!(upstream.sent(), vec![body.to_owned()]);
    assert_eq!(first.body, answer(body.as_bytes()));

    let second = upstream.embed(&cache, body).await;
    assert_eq!(second.outcome, Outcome::Hit);
    assert_eq!(upstream.sent().len(), 1);
    assert_eq!(
        std::str::from_utf8(&second.body).unwrap(),
        format!(
            r#"{{"model":"nomic","embeddings":[{},{}]}}"#,
            vector_of("a"),
            vector_of("b")
        )
    );

    let third = upstream
        .embed(
            &cache,
            r#"{"model":"nomic","input":["c","b","c"],"keep_alive":"5m"}"#,
        )
        .await;
    assert_eq!(third.outcome, Outcome::Partial);
    assert_eq!(
        upstream.sent()[1],
        r#"{"model":"nomic","input":["c"],"keep_alive":"5m"}"#
    );
    assert_eq!(
        embeddings_of(&third.body),
        serde_json::from_str::<Value>(&format!(
            "[{},{},{}]",
            vector_of("c"),
            vector_of("b"),
            vector_of("c")
        ))
        .unwrap()
    );
    let third_json: Value = serde_json::from_slice(&third.body).unwrap();
    assert_eq!(third_json["prompt_eval_count"], 1);
    assert_eq!(third_json["total_duration"], 1000);

    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.partial), (1, 1, 1));
    assert_eq!(
        (stats.items_cached, stats.items_fetched),
        (3, 3),
        "{stats:?}"
    );
    assert_eq!(stats.errors, 0);
    assert!(stats.bytes_stored > 0);
    let labels = cache.label_stats();
    assert_eq!(
        labels,
        vec![(
            (
                "alice".to_owned(),
                "nomic:latest".to_owned(),
                "/api/embed".to_owned()
            ),
            LabelCounts {
                hits: 1,
                misses: 1,
                partial: 1
            }
        )]
    );
}

#[tokio::test]
async fn a_string_input_is_answered_as_a_one_element_list() {
    let cache = memory().await;
    let upstream = Upstream::default();
    upstream
        .embed(&cache, r#"{"model":"m","input":["x"]}"#)
        .await;
    let hit = upstream
        .embed(&cache, r#"{"model":"M:latest","input":"x"}"#)
        .await;
    assert_eq!(hit.outcome, Outcome::Hit);
    assert_eq!(
        std::str::from_utf8(&hit.body).unwrap(),
        format!(
            r#"{{"model":"M:latest","embeddings":[{}]}}"#,
            vector_of("x")
        )
    );
}

#[tokio::test]
async fn entries_expire_after_the_ttl() {
    let mut config = settings(CacheBackend::Memory);
    config.ttl = Duration::from_secs(60);
    let cache = connect(&config).await.unwrap();
    let upstream = Upstream::default();
    let body = r#"{"model":"m","input":"t"}"#;
    upstream.embed(&cache, body).await;
    cache.advance_clock(Duration::from_secs(59));
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Hit);
    cache.advance_clock(Duration::from_secs(2));
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Miss);
}

#[tokio::test]
async fn oversized_vectors_are_not_stored() {
    let mut config = settings(CacheBackend::Memory);
    config.max_entry_bytes = 8;
    let cache = connect(&config).await.unwrap();
    let upstream = Upstream::default();
    let body = r#"{"model":"m","input":"long"}"#;
    upstream.embed(&cache, body).await;
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Miss);
    assert_eq!(cache.stats().oversized, 2);
    assert_eq!(cache.stats().bytes_stored, 0);
}

#[tokio::test]
async fn per_client_entries_are_private() {
    let upstream = Upstream::default();
    let body = r#"{"model":"m","input":"secret"}"#;

    let shared = memory().await;
    upstream
        .resolve(&shared, Namespace::Embed, "alice", body)
        .await;
    let bob = upstream
        .resolve(&shared, Namespace::Embed, "bob", body)
        .await;
    assert_eq!(bob.outcome, Outcome::Hit);

    let mut config = settings(CacheBackend::Memory);
    config.per_client = true;
    let private = connect(&config).await.unwrap();
    upstream
        .resolve(&private, Namespace::Embed, "alice", body)
        .await;
    let bob = upstream
        .resolve(&private, Namespace::Embed, "bob", body)
        .await;
    assert_eq!(bob.outcome, Outcome::Miss);
    let alice = upstream
        .resolve(&private, Namespace::Embed, "alice", body)
        .await;
    assert_eq!(alice.outcome, Outcome::Hit);
}

#[tokio::test]
async fn vector_affecting_fields_do_not_share_entries() {
    let cache = memory().await;
    let upstream = Upstream::default();
    upstream
        .embed(
            &cache,
            r#"{"model":"m","input":"x","options":{"a":1,"b":[2.0]}}"#,
        )
        .await;
    for other in [
        r#"{"model":"m","input":"x"}"#,
        r#"{"model":"m","input":"x","options":{"a":2,"b":[2.0]}}"#,
        r#"{"model":"m","input":"x","options":{"a":1,"b":[2.0]},"dimensions":256}"#,
        r#"{"model":"m","input":"x","options":{"a":1,"b":[2.0]},"truncate":false}"#,
        r#"{"model":"n","input":"x","options":{"a":1,"b":[2.0]}}"#,
    ] {
        assert_eq!(
            upstream.embed(&cache, other).await.outcome,
            Outcome::Miss,
            "{other}"
        );
    }
    // The same request, spelled differently, shares the entry.
    let same = r#"{ "options" : { "b": [2], "a": 1.0 }, "truncate": true, "input": ["x"], "model": "M", "keep_alive": 0 }"#;
    assert_eq!(upstream.embed(&cache, same).await.outcome, Outcome::Hit);
    // The legacy endpoint has its own namespace and shape.
    let legacy = r#"{"model":"m","prompt":"x","options":{"a":1,"b":[2.0]}}"#;
    let miss = upstream
        .resolve(&cache, Namespace::Embeddings, "alice", legacy)
        .await;
    assert_eq!(miss.outcome, Outcome::Miss);
    let hit = upstream
        .resolve(&cache, Namespace::Embeddings, "alice", legacy)
        .await;
    assert_eq!(hit.outcome, Outcome::Hit);
    assert_eq!(
        std::str::from_utf8(&hit.body).unwrap(),
        format!(r#"{{"embedding":{}}}"#, vector_of("x"))
    );
}

#[tokio::test]
async fn upstream_errors_store_nothing_and_are_relayed() {
    let cache = memory().await;
    let body = Bytes::from_static(br#"{"model":"m","input":["a"]}"#);
    let split = plan(Namespace::Embed, &body).unwrap();
    let result = cache
        .resolve(&split, "alice", "/api/embed", Tier::Normal, |_, _| async {
            Err::<Bytes, _>("404 model not found")
        })
        .await;
    assert!(matches!(
        result,
        Err(ResolveError::Upstream("404 model not found"))
    ));
    assert!(cache.lookup(&cache.keys(&split, "alice")).await[0].is_none());
    assert!(cache.label_stats().is_empty());
    assert!(cache.flights().is_empty());

    // A partial answer that does not fit is an error, not a wrong answer.
    let upstream = Upstream::default();
    upstream
        .embed(&cache, r#"{"model":"m","input":["b"]}"#)
        .await;
    let body = Bytes::from_static(br#"{"model":"m","input":["a","b"]}"#);
    let split = plan(Namespace::Embed, &body).unwrap();
    let result = cache
        .resolve(&split, "alice", "/api/embed", Tier::Normal, |_, _| async {
            Ok::<_, ()>(Bytes::from_static(br#"{"embeddings":[[1],[2]]}"#))
        })
        .await;
    assert!(matches!(
        result,
        Err(ResolveError::Plan(PlanError::UnexpectedResponse))
    ));
}

// --------------------------------------------------------- single flight

#[tokio::test]
async fn fifty_concurrent_joins_have_one_leader() {
    let cache = memory().await;
    let key = vec!["k".to_owned()];
    let joins: Vec<Join> = (0..50)
        .flat_map(|_| cache.join(&key, Tier::Normal))
        .collect();
    let leaders = joins.iter().filter(|j| matches!(j, Join::Lead(_))).count();
    assert_eq!(leaders, 1);
    assert_eq!(cache.flights().followers("k"), 49);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_misses_make_one_upstream_request() {
    let cache = memory().await;
    let body = Bytes::from_static(br#"{"model":"m","input":["same"]}"#);
    let key = cache.keys(&plan(Namespace::Embed, &body).unwrap(), "alice")[0].clone();
    let calls = Arc::new(AtomicU64::new(0));
    let (release, released) = tokio::sync::watch::channel(false);

    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let cache = cache.clone();
            let body = body.clone();
            let calls = Arc::clone(&calls);
            let released = released.clone();
            tokio::spawn(async move {
                let split = plan(Namespace::Embed, &body).unwrap();
                cache
                    .resolve(
                        &split,
                        "alice",
                        "/api/embed",
                        Tier::Normal,
                        |sent: Bytes, _| {
                            calls.fetch_add(1, Ordering::SeqCst);
                            let reply = answer(&sent);
                            let released = released.clone();
                            async move {
                                let mut released = released;
                                released.wait_for(|go| *go).await.map_err(|_| ())?;
                                Ok::<_, ()>(reply)
                            }
                        },
                    )
                    .await
                    .map_err(|_| "resolve failed")
            })
        })
        .collect();

    // Wait (on the flight itself, not a timer) until the 49 others follow.
    tokio::time::timeout(Duration::from_secs(10), async {
        while cache.flights().followers(&key) < 49 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("49 followers");
    release.send_replace(true);

    let mut outcomes = Vec::new();
    for task in tasks {
        let resolved = task.await.unwrap().unwrap();
        // The leader relays Ollama's answer; followers get the same vectors
        // (without timing fields: they spent none).
        assert_eq!(embeddings_of(&resolved.body), embeddings_of(&answer(&body)));
        outcomes.push(resolved.outcome);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(outcomes.iter().filter(|o| **o == Outcome::Miss).count(), 1);
    assert_eq!(outcomes.iter().filter(|o| **o == Outcome::Hit).count(), 49);
    assert_eq!(cache.stats().items_coalesced, 49);
    assert!(cache.flights().is_empty());
}

#[tokio::test]
async fn followers_retry_when_the_leader_fails() {
    let cache = memory().await;
    let body = Bytes::from_static(br#"{"model":"m","input":["x"]}"#);
    let split = plan(Namespace::Embed, &body).unwrap();
    let keys = cache.keys(&split, "alice");
    // Someone else leads, and gives up while we wait.
    let Join::Lead(lead) = cache.join(&keys, Tier::Normal).remove(0) else {
        panic!("lead");
    };
    let upstream = Upstream::default();
    let waiting = {
        let cache = cache.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            upstream
                .embed(&cache, r#"{"model":"m","input":["x"]}"#)
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while cache.flights().followers(&keys[0]) < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a follower");
    drop(lead);
    let resolved = waiting.await.unwrap();
    assert_eq!(resolved.outcome, Outcome::Miss);
    assert_eq!(upstream.sent().len(), 1);
}

#[tokio::test]
async fn a_high_tier_request_does_not_wait_on_a_queued_low_tier_leader() {
    let cache = memory().await;
    let body = Bytes::from_static(br#"{"model":"m","input":["x","y"]}"#);
    let split = plan(Namespace::Embed, &body).unwrap();
    // A low-tier request leads both texts and is still queued: its fetch
    // never ends during this test.
    let low = {
        let cache = cache.clone();
        let split = split.clone();
        tokio::spawn(async move {
            cache
                .resolve(&split, "bob", "/api/embed", Tier::Low, |_, _| {
                    std::future::pending::<Result<Bytes, ()>>()
                })
                .await
        })
    };
    let keys = cache.keys(&split, "bob");
    tokio::time::timeout(Duration::from_secs(10), async {
        while cache.flights().len() < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the low request leads");
    // A high-tier request for one of its texts fetches it itself.
    let upstream = Upstream::default();
    let body = Bytes::from_static(br#"{"model":"m","input":"x"}"#);
    let single = plan(Namespace::Embed, &body).unwrap();
    let sent = Arc::clone(&upstream.sent);
    let resolved = tokio::time::timeout(
        Duration::from_secs(10),
        cache.resolve(&single, "alice", "/api/embed", Tier::High, |body, _| {
            let sent = Arc::clone(&sent);
            async move {
                let reply = answer(&body);
                sent.lock().unwrap().push(body);
                Ok::<_, ()>(reply)
            }
        }),
    )
    .await
    .expect("the high request never waits on the low one")
    .unwrap();
    assert_eq!(resolved.outcome, Outcome::Miss);
    assert_eq!(upstream.sent().len(), 1);
    // The low request's flights are untouched.
    assert_eq!(cache.flights().followers(&keys[0]), 0);
    assert_eq!(cache.flights().len(), 2);
    low.abort();
}

#[tokio::test]
async fn once_dispatched_a_low_tier_leader_is_followed_by_any_tier() {
    let cache = memory().await;
    let body = Bytes::from_static(br#"{"model":"m","input":["x"]}"#);
    let split = plan(Namespace::Embed, &body).unwrap();
    let keys = cache.keys(&split, "bob");
    let release = Arc::new(tokio::sync::Notify::new());
    let low = {
        let cache = cache.clone();
        let split = split.clone();
        let release = Arc::clone(&release);
        tokio::spawn(async move {
            cache
                .resolve(&split, "bob", "/api/embed", Tier::Low, |body, dispatch| {
                    dispatch.dispatched();
                    let release = Arc::clone(&release);
                    async move {
                        release.notified().await;
                        Ok::<_, ()>(answer(&body))
                    }
                })
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while cache.flights().is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the low request leads");
    let upstream = Upstream::default();
    let high = {
        let cache = cache.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let body = Bytes::from_static(br#"{"model":"m","input":["x"]}"#);
            let split = plan(Namespace::Embed, &body).unwrap();
            let sent = Arc::clone(&upstream.sent);
            cache
                .resolve(&split, "alice", "/api/embed", Tier::High, |body, _| {
                    let sent = Arc::clone(&sent);
                    async move {
                        sent.lock().unwrap().push(body.clone());
                        Ok::<_, ()>(answer(&body))
                    }
                })
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while cache.flights().followers(&keys[0]) < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the high request follows the dispatched leader");
    release.notify_one();
    assert_eq!(high.await.unwrap().unwrap().outcome, Outcome::Hit);
    assert!(upstream.sent().is_empty());
    low.await.unwrap().unwrap();
}

// ---------------------------------------------------------- key property

fn options() -> impl Strategy<Value = serde_json::Map<String, Value>> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(Value::Bool),
        (-1000i64..1000).prop_map(Value::from),
        (-1000i32..1000).prop_map(|n| Value::from(f64::from(n) / 8.0)),
        "[a-z]{0,6}".prop_map(Value::from),
    ];
    prop::collection::btree_map("[a-z_]{1,8}", leaf, 0..6).prop_map(|map| map.into_iter().collect())
}

/// The same object with keys in another order and integers written as
/// floats.
fn respell(object: &serde_json::Map<String, Value>, reverse: bool) -> String {
    let mut members: Vec<(&String, &Value)> = object.iter().collect();
    if reverse {
        members.reverse();
    }
    let parts: Vec<String> = members
        .into_iter()
        .map(|(key, value)| {
            let value = match value {
                Value::Number(n) if n.is_i64() => format!("{}.0", n),
                other => other.to_string(),
            };
            format!("\n  {} :  {value}", Value::from(key.as_str()))
        })
        .collect();
    format!("{{{}\n}}", parts.join(" ,"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn keys_survive_reformatting(
        options in options(),
        inputs in prop::collection::vec("\\PC{0,8}", 1..4),
        truncate in proptest::option::of(any::<bool>()),
        dimensions in proptest::option::of(1u32..2048),
    ) {
        let mut request = serde_json::Map::new();
        request.insert("model".into(), json!("nomic-embed-text"));
        request.insert("input".into(), json!(inputs));
        request.insert("options".into(), Value::Object(options.clone()));
        if let Some(truncate) = truncate {
            request.insert("truncate".into(), json!(truncate));
        }
        if let Some(dimensions) = dimensions {
            request.insert("dimensions".into(), json!(dimensions));
        }
        let compact = serde_json::to_string(&request).unwrap();
        // Reordered, pretty, numbers respelled, model in another case.
        let mut other = String::from("{\n");
        let mut members: Vec<String> = Vec::new();
        members.push(format!("\"options\": {}", respell(&options, true)));
        if let Some(dimensions) = dimensions {
            members.push(format!("\"dimensions\": {dimensions}.0"));
        }
        members.push(format!("\"input\": {}", serde_json::to_string_pretty(&inputs).unwrap()));
        if let Some(truncate) = truncate {
            members.push(format!("\"truncate\": {truncate}"));
        }
        members.push("\"model\": \"Nomic-Embed-Text:latest\"".to_owned());
        members.push("\"keep_alive\": -1".to_owned());
        other.push_str(&members.join(",\n"));
        other.push_str("\n}");

        let a = plan(Namespace::Embed, &Bytes::from(compact)).unwrap();
        let b = plan(Namespace::Embed, &Bytes::from(other)).unwrap();
        prop_assert_eq!(a.keys("p:", None), b.keys("p:", None));
        prop_assert_eq!(a.keys("p:", Some("c")), b.keys("p:", Some("c")));
    }
}

// ------------------------------------------------------- a real redis

/// A `redis-server` on a fixed loopback port, without persistence.
struct RedisServer {
    port: u16,
    child: Child,
}

impl RedisServer {
    fn free_port() -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }

    /// Starts a server and waits for its "Ready to accept connections" line.
    fn start(port: u16) -> Self {
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "notice"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        let stdout = child.stdout.take().unwrap();
        let (ready, is_ready) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Keep draining so the server never blocks on a full pipe.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.contains("Ready to accept connections") {
                    let _ = ready.send(());
                }
            }
        });
        is_ready
            .recv_timeout(Duration::from_secs(20))
            .expect("redis-server became ready");
        Self { port, child }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    async fn connection(&self) -> ::redis::aio::MultiplexedConnection {
        ::redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn redis_cache(server: &RedisServer) -> Cache {
    let tuning = Tuning {
        probe_interval: Duration::from_millis(20),
    };
    connect_with(&settings(CacheBackend::Redis(server.url())), tuning)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_unreachable_redis_fails_start_up_naming_the_url() {
    let port = RedisServer::free_port();
    let url = format!("redis://:hunter2@127.0.0.1:{port}/0");
    let error = connect(&settings(CacheBackend::Redis(url)))
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, CacheError::Unreachable { .. }), "{message}");
    assert!(
        message.contains(&format!("redis://:***@127.0.0.1:{port}/0")),
        "{message}"
    );
    assert!(!message.contains("hunter2"), "{message}");
    let error = connect(&settings(CacheBackend::Redis("redis://[bad".to_owned())))
        .await
        .unwrap_err();
    assert!(matches!(error, CacheError::InvalidUrl { .. }), "{error}");
}

#[tokio::test]
async fn redis_serves_hits_with_the_ttl_set() {
    let server = RedisServer::start(RedisServer::free_port());
    let cache = redis_cache(&server).await;
    let upstream = Upstream::default();
    let body = r#"{"model":"m","input":["a","b"]}"#;
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Miss);
    let hit = upstream.embed(&cache, body).await;
    assert_eq!(hit.outcome, Outcome::Hit);
    assert_eq!(
        embeddings_of(&hit.body),
        embeddings_of(&answer(body.as_bytes()))
    );

    let keys = cache.keys(
        &plan(Namespace::Embed, &Bytes::from(body)).unwrap(),
        "alice",
    );
    assert!(keys[0].starts_with("oqp:embed:v2:embed:"));
    let mut connection = server.connection().await;
    let ttl: i64 = ::redis::cmd("PTTL")
        .arg(&keys[0])
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(ttl > 3_590_000 && ttl <= 3_600_000, "{ttl}");
    let stored: Vec<u8> = ::redis::cmd("GET")
        .arg(&keys[1])
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(stored, vector_of("b").into_bytes());

    // A value that is not a vector is a miss and an error, never an answer.
    let _: () = ::redis::cmd("SET")
        .arg(&keys[0])
        .arg("garbage")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Partial);
    // Counted at the lookup and again at the leader's second look.
    assert!(cache.stats().errors >= 1);
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Hit);
}

#[tokio::test]
async fn a_redis_outage_degrades_to_misses_and_recovers() {
    let port = RedisServer::free_port();
    let server = RedisServer::start(port);
    let cache = redis_cache(&server).await;
    let upstream = Upstream::default();
    let body = r#"{"model":"m","input":"kept"}"#;
    upstream.embed(&cache, body).await;
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Hit);

    server.kill();
    // Lookups fail, then are skipped: every request is still answered.
    for _ in 0..3 {
        let resolved = upstream.embed(&cache, body).await;
        assert_eq!(resolved.outcome, Outcome::Miss);
        assert_eq!(resolved.body, answer(body.as_bytes()));
    }
    let stats = cache.stats();
    assert!(stats.errors >= 1, "{stats:?}");
    assert!(stats.bypassed >= 1, "{stats:?}");
    assert!(!stats.available);

    // Same port, empty server: the probe notices, stores and hits resume.
    let _server = RedisServer::start(port);
    tokio::time::timeout(Duration::from_secs(20), async {
        while !cache.stats().available {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the backend is available again");
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Miss);
    assert_eq!(upstream.embed(&cache, body).await.outcome, Outcome::Hit);
}

/// Prints the median and p99 of 1000 single-item hits per backend (run with
/// `--nocapture` to see them).
#[tokio::test]
async fn hit_latency_memory_vs_redis() {
    let server = RedisServer::start(RedisServer::free_port());
    let vector = format!(
        "[{}]",
        (0..768)
            .map(|i| format!("{:.8}", (i as f32 * 0.37).sin() / 27.7))
            .collect::<Vec<_>>()
            .join(",")
    );
    for (name, cache) in [
        ("memory", memory().await),
        ("redis", redis_cache(&server).await),
    ] {
        let body = Bytes::from_static(br#"{"model":"nomic-embed-text","input":"timing"}"#);
        let split = plan(Namespace::Embed, &body).unwrap();
        let keys = cache.keys(&split, "alice");
        cache
            .store(vec![(keys[0].clone(), Bytes::from(vector.clone()))])
            .await;
        let mut lookups = Vec::with_capacity(1000);
        let mut resolves = Vec::with_capacity(1000);
        for _ in 0..1000 {
            let start = std::time::Instant::now();
            let found = cache.lookup(&keys).await;
            lookups.push(start.elapsed());
            assert!(found[0].is_some());
            let start = std::time::Instant::now();
            let resolved = cache
                .resolve(&split, "alice", "/api/embed", Tier::Normal, |_, _| async {
                    Err::<Bytes, ()>(())
                })
                .await
                .unwrap();
            resolves.push(start.elapsed());
            assert_eq!(resolved.outcome, Outcome::Hit);
        }
        lookups.sort();
        resolves.sort();
        println!(
            "{name:>6}: lookup median {:?} p99 {:?}; full resolve (key, lookup, assemble) median {:?} p99 {:?} ({} B vector)",
            lookups[500],
            lookups[990],
            resolves[500],
            resolves[990],
            vector.len()
        );
    }
}

/// A 4096-dimension vector as Ollama prints float32s (`0.012345679`,
/// `-1e-7`, …), about 45 kB of text.
fn large_vector() -> Bytes {
    let numbers: Vec<String> = (0..4096u32)
        .map(|i| {
            let x = ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.1
                / (1 + i % 7).pow(3) as f32;
            let mut out = Vec::new();
            super::vector::tests_support::go_format(x, &mut out);
            String::from_utf8(out).unwrap()
        })
        .collect();
    Bytes::from(format!("[{}]", numbers.join(",")))
}

#[tokio::test]
async fn a_4096_dimension_vector_is_cached_compactly_and_comes_back_byte_identical() {
    let server = RedisServer::start(RedisServer::free_port());
    let vector = large_vector();
    assert!(vector.len() > 32_768, "{} bytes of text", vector.len());
    let redis = redis_cache(&server).await;
    for (cache, key) in [
        (memory().await, "oqp:embed:m"),
        (redis.clone(), "oqp:embed:r"),
    ] {
        let key = key.to_owned();
        cache.store(vec![(key.clone(), vector.clone())]).await;
        assert_eq!(cache.stats().oversized, 0, "{}", cache.backend_name());
        let found = cache.lookup(std::slice::from_ref(&key)).await;
        assert_eq!(found[0].as_ref(), Some(&vector), "{}", cache.backend_name());
    }
    // In Redis it takes 4 bytes a number.
    let mut connection = server.connection().await;
    let stored: Vec<u8> = ::redis::cmd("GET")
        .arg("oqp:embed:r")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(stored.len(), 4 + 4096 * 4);
    // An entry written as text (before compact vectors) is still a hit.
    let _: () = ::redis::cmd("SET")
        .arg("oqp:embed:old")
        .arg("[0.5,-1e-7]")
        .query_async(&mut connection)
        .await
        .unwrap();
    let found = redis.lookup(&["oqp:embed:old".to_owned()]).await;
    assert_eq!(found[0].as_deref(), Some(&b"[0.5,-1e-7]"[..]));
}
