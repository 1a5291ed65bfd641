//! End to end: conversation affinity. Against fakes that model llama-server's per-slot prompt
//! cache (a slot keeps its last prompt and answer; a request takes the idle slot sharing the
//! longest prefix with it, above 10 % of its length, else the least recently used one;
//! 250 ms per 1,000 uncached tokens before the first token), oqp sends each follow-up where its
//! history is cached, spills to an idle box when waiting costs more than re-reading, and never
//! lets one tenant's cache steer another's request.
//!
//! Times to first token are the fake's own figures (its queue wait as oqp reports it, plus the
//! prefill the fake charged, `prompt_eval_duration`), not wall-clock measurements.

use std::time::{Duration, Instant};

use http::Method;
use oqp_tests::bench::scenarios::affinity::filler;
use oqp_tests::client::{HttpClient, Reply};
use oqp_tests::fake::{FakeHandle, FakeOllama};
use oqp_tests::harness::{ConfigYaml, Host, Key, Stack};
use serde_json::{Value, json};

const KEY: &str = "sk-agent-0123456789";
const OTHER: &str = "sk-other-0123456789";
const BATCH: &str = "sk-batch-0123456789";

/// Prefill time per 1,000 uncached tokens.
const PREFILL_MS_PER_1K: f64 = 250.0;

fn config(hosts: &[(&str, &str)], extra: &str) -> String {
    hosts
        .iter()
        .fold(ConfigYaml::new().max_concurrent(8), |yaml, (url, name)| {
            let host = Host::ollama(name, url).set("max_concurrent", 2);
            yaml.host(host.set("num_parallel", 2))
        })
        .strategy("model_aware")
        .under("routing", extra)
        .under("queue", "  model_swap:\n    enabled: false\n")
        .under("embedding_cache", "  enabled: false\n")
        .key(Key::new(KEY, "agent"))
        .key(Key::new(OTHER, "other"))
        .key(batch_key(BATCH))
        .yaml()
}

/// A client of the low tier only.
fn batch_key(key: &str) -> Key {
    Key::new(key, "batch")
        .set("max_priority", "low")
        .set("default_priority", "low")
}

async fn gpu() -> FakeOllama {
    FakeOllama::builder()
        .model("llama3")
        .loaded("llama3")
        .model("batch")
        .runners(2)
        .slots(2)
        .tokens(8)
        .prompt_cache(PREFILL_MS_PER_1K)
        .spawn()
        .await
}

/// One conversation's history.
#[derive(Clone)]
struct Conversation {
    messages: Vec<Value>,
}

/// One turn's answer as the client saw it.
struct Turn {
    reply: Reply,
    /// Queue wait (oqp's header) plus the fake's prefill: its time to first token.
    ttft: Duration,
}

impl Turn {
    fn affinity(&self) -> String {
        self.reply.header("x-oqp-affinity").unwrap_or_default()
    }

    fn host(&self) -> String {
        self.reply.header("x-failover-host").unwrap_or_default()
    }
}

impl Conversation {
    fn new() -> Self {
        Self {
            messages: vec![json!({"role": "system", "content": "You are a coding agent."})],
        }
    }

    /// Sends the history plus `text` and appends the answer.
    async fn turn(&mut self, http: &HttpClient, base: &str, key: &str, text: String) -> Turn {
        self.messages.push(json!({"role": "user", "content": text}));
        let body = json!({"model": "llama3", "stream": false, "messages": self.messages});
        let reply = http
            .send(
                Method::POST,
                &format!("{base}/api/chat"),
                &[
                    ("authorization", &format!("Bearer {key}")),
                    ("content-type", "application/json"),
                ],
                body.to_string(),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let answer = reply.json();
        let content = answer["message"]["content"].as_str().unwrap().to_owned();
        self.messages
            .push(json!({"role": "assistant", "content": content}));
        let waited: u64 = reply
            .header("x-queue-wait-time")
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(0);
        let prefill = answer["prompt_eval_duration"].as_u64().unwrap();
        Turn {
            ttft: Duration::from_millis(waited) + Duration::from_nanos(prefill),
            reply,
        }
    }
}

/// Whether the fake's log shows a request that found at least half its prompt cached.
fn hits(handles: &[FakeHandle]) -> (usize, usize) {
    let mut follow_ups = 0;
    let mut hits = 0;
    for handle in handles {
        for entry in handle.runner_log() {
            let Some(cache) = entry.cache else { continue };
            // Follow-ups carry the first turn's 4,000 tokens and more.
            if cache.prompt_tokens > 4_500 {
                follow_ups += 1;
                if cache.cached_tokens * 2 >= cache.prompt_tokens {
                    hits += 1;
                }
            }
        }
    }
    (hits, follow_ups)
}

#[tokio::test]
async fn an_agent_load_on_two_boxes_finds_its_history_nine_times_in_ten() {
    let (a, b) = (gpu().await, gpu().await);
    let stack = Stack::start(&config(&[(&a.url(), "a"), (&b.url(), "b")], "")).await;
    let base = stack.url();
    let http = HttpClient::new();
    // Four conversations at once, six turns each: 4,000 tokens to start, 1,000 more a turn.
    let tasks: Vec<_> = (0..4)
        .map(|c| {
            let (http, base) = (http.clone(), base.clone());
            tokio::spawn(async move {
                let mut conversation = Conversation::new();
                let mut turns = Vec::new();
                for t in 0..6 {
                    let bytes = if t == 0 { 16_000 } else { 4_000 };
                    turns.push(
                        conversation
                            .turn(&http, &base, KEY, filler(c, t, bytes))
                            .await,
                    );
                }
                turns
            })
        })
        .collect();
    let mut first = Vec::new();
    let mut follow_ups = Vec::new();
    for task in tasks {
        let mut turns = task.await.unwrap();
        follow_ups.extend(turns.split_off(1));
        first.extend(turns);
    }
    assert!(first.iter().all(|turn| turn.affinity() == "new"));
    let (hit, seen) = hits(&[a.handle(), b.handle()]);
    assert_eq!(seen, 20, "every follow-up reached a runner");
    assert!(hit >= 18, "{hit} of 20 follow-ups found their history");
    let said_hit = follow_ups
        .iter()
        .filter(|turn| turn.affinity() == "hit")
        .count();
    assert!(
        said_hit >= 18,
        "{said_hit} of 20 answered X-OQP-Affinity: hit"
    );
    // A hit re-reads only the new turn: the follow-ups' mean stays near it.
    let mut hit_ttfts: Vec<Duration> = follow_ups
        .iter()
        .filter(|turn| turn.affinity() == "hit")
        .map(|turn| turn.ttft)
        .collect();
    hit_ttfts.sort();
    let a_hit = hit_ttfts[hit_ttfts.len() / 2];
    let mean = follow_ups.iter().map(|turn| turn.ttft).sum::<Duration>() / 20;
    assert!(
        mean.as_secs_f64() <= 1.6 * a_hit.as_secs_f64(),
        "mean follow-up TTFT {mean:?} against a hit's {a_hit:?}"
    );
    // Both boxes work: affinity does not pile the conversations on one.
    for (name, fake) in [("a", &a), ("b", &b)] {
        let served = fake.handle().requests_to("/api/chat").len();
        assert!(served >= 6, "box {name} served {served} of 24 turns");
    }
    // The metric counts what the headers said.
    let auth = format!("Bearer {KEY}");
    let metrics = http
        .get(&format!("{base}/metrics"), &[("authorization", &auth)])
        .await
        .text();
    let counted = |result: &str| {
        metrics
            .lines()
            .find(|line| line.starts_with(&format!("oqp_affinity_total{{result=\"{result}\"}}")))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(counted("new"), 4);
    assert_eq!(counted("hit"), said_hit as u64);
    // Usage carries the estimate of cached prompt tokens: most of the follow-ups' prompts.
    let status = http
        .get(&format!("{base}/queue/status"), &[("authorization", &auth)])
        .await
        .json();
    let usage = &status["clients"]["agent"]["usage_today"];
    let cached = usage["cached_tokens"].as_u64().expect("cached_tokens");
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(cached * 2 > prompt, "{usage}");
    stack.shutdown().await;
}

#[tokio::test]
async fn a_conversation_whose_home_is_full_spills_to_the_idle_box() {
    let (a, b) = (gpu().await, gpu().await);
    // Only box a has the batch model: its low-tier work fills box a alone.
    b.handle().remove_model("batch");
    let stack = Stack::start(&config(&[(&a.url(), "a"), (&b.url(), "b")], "")).await;
    let base = stack.url();
    let http = HttpClient::new();
    let mut conversation = Conversation::new();
    let first = conversation
        .turn(&http, &base, KEY, filler(0, 0, 16_000))
        .await;
    assert_eq!(first.host(), "a", "the first turn takes the first host");
    // Box a fills with long low-tier work (held until the end of the test).
    a.handle().hold();
    let batch: Vec<_> = (0..2)
        .map(|_| {
            let (http, url) = (http.clone(), format!("{base}/api/generate"));
            tokio::spawn(async move {
                http.send(
                    Method::POST,
                    &url,
                    &[("authorization", &format!("Bearer {BATCH}"))],
                    r#"{"model":"batch","prompt":"summarise the archive","stream":false}"#,
                )
                .await
            })
        })
        .collect();
    a.handle().wait_in_flight(2).await;
    let sent = Instant::now();
    let next = conversation
        .turn(&http, &base, KEY, filler(0, 1, 4_000))
        .await;
    let served_in = sent.elapsed();
    assert_eq!(next.host(), "b", "served on the idle box");
    assert_eq!(next.affinity(), "spill");
    assert!(
        served_in < Duration::from_secs(4),
        "served after {served_in:?}, its home busy for as long as it is held"
    );
    // Its history is warm on b now: the next turn stays there.
    let third = conversation
        .turn(&http, &base, KEY, filler(0, 2, 4_000))
        .await;
    assert_eq!(third.host(), "b");
    assert_eq!(third.affinity(), "hit");
    a.handle().release_all();
    for task in batch {
        assert_eq!(task.await.unwrap().status, 200);
    }
    stack.shutdown().await;
}

#[tokio::test]
async fn one_tenants_cached_prefix_never_steers_anothers_request() {
    for shared in [false, true] {
        let (a, b) = (gpu().await, gpu().await);
        let extra = if shared {
            "  affinity:\n    share_across_keys: true\n"
        } else {
            ""
        };
        let stack = Stack::start(&config(&[(&a.url(), "a"), (&b.url(), "b")], extra)).await;
        let base = stack.url();
        let http = HttpClient::new();
        let mut mine = Conversation::new();
        mine.turn(&http, &base, KEY, filler(0, 0, 8_000)).await;
        // Another key sends the same history as a follow-up of its own.
        let mut theirs = mine.clone();
        let turn = theirs.turn(&http, &base, OTHER, filler(0, 1, 400)).await;
        let expected = if shared { "hit" } else { "miss" };
        assert_eq!(turn.affinity(), expected, "share_across_keys: {shared}");
        // The key's own follow-up still finds its history.
        let own = mine.turn(&http, &base, KEY, filler(0, 1, 400)).await;
        assert_eq!(own.affinity(), "hit");
        stack.shutdown().await;
    }
}

#[tokio::test]
async fn with_affinity_off_follow_ups_go_round_robin_and_say_nothing() {
    let (a, b) = (gpu().await, gpu().await);
    let extra = "  affinity:\n    enabled: false\n";
    let stack = Stack::start(&config(&[(&a.url(), "a"), (&b.url(), "b")], extra)).await;
    let base = stack.url();
    let http = HttpClient::new();
    let mut conversation = Conversation::new();
    let mut hosts = Vec::new();
    for t in 0..4 {
        let turn = conversation
            .turn(&http, &base, KEY, filler(0, t, 2_000))
            .await;
        assert!(turn.reply.header("x-oqp-affinity").is_none());
        hosts.push(turn.host());
    }
    assert_eq!(hosts, ["a", "b", "a", "b"]);
    stack.shutdown().await;
}

/// Two data planes (separate processes), each owning one box.
fn two_planes(a: &str, b: &str) -> String {
    format!(
        r#"proxy:
  host: "127.0.0.1"
  max_concurrent: 4
ollama:
  hosts:
    - url: "{a}"
      name: box1
      max_concurrent: 2
      num_parallel: 2
      node: a
    - url: "{b}"
      name: box2
      max_concurrent: 2
      num_parallel: 2
      node: b
nodes:
  a: {{port: 0}}
  b: {{port: 0}}
control_plane:
  node_token: "{TOKEN}"
routing:
  strategy: model_aware
queue:
  model_swap:
    enabled: false
embedding_cache:
  enabled: false
auth:
  enabled: true
  keys:
    - key: "{ADMIN}"
      client_id: admin
      scope: management
    - key: "{KEY}"
      client_id: agent
"#
    )
}

const TOKEN: &str = "node-token-0123456789";
const ADMIN: &str = "sk-admin-0123456789";

#[tokio::test]
async fn a_follow_up_entering_at_another_data_plane_lands_on_its_box_and_a_restart_costs_only_warmth()
 {
    let _exclusive = crate::support::exclusive().await;
    let (one, two) = (gpu().await, gpu().await);
    let mut cluster = oqp_tests::cluster::Cluster::builder(
        env!("CARGO_BIN_EXE_oqp-bench"),
        &two_planes(&one.url(), &two.url()),
    )
    .node("a")
    .node("b")
    .node_token(TOKEN)
    .admin_key(ADMIN)
    .start()
    .await;
    cluster.wait_peer("a", "b").await;
    cluster.wait_peer("b", "a").await;
    let http = HttpClient::new();
    let mut conversations = Vec::new();
    // Several conversations, each entering by turns at a and at b.
    for c in 0..4 {
        let mut conversation = Conversation::new();
        let first = conversation
            .turn(&http, &cluster.url("a"), KEY, filler(c, 0, 8_000))
            .await;
        assert_eq!(first.affinity(), "new");
        let home = first.host();
        for (t, node) in [(1, "b"), (2, "a"), (3, "b")] {
            let turn = conversation
                .turn(&http, &cluster.url(node), KEY, filler(c, t, 800))
                .await;
            assert_eq!(
                turn.host(),
                home,
                "conversation {c}, turn {t} entered at {node}"
            );
            assert_eq!(turn.affinity(), "hit", "conversation {c}, turn {t}");
        }
        conversations.push((conversation, home));
    }
    // Restart the owner of the first conversation's box: its index is gone, nothing else.
    let owner = if conversations[0].1 == "box1" {
        "a"
    } else {
        "b"
    };
    cluster.restart(owner).await;
    let other = if owner == "a" { "b" } else { "a" };
    cluster.wait_peer(other, owner).await;
    cluster.wait_peer(owner, other).await;
    let (conversation, _) = &mut conversations[0];
    let after = conversation
        .turn(&http, &cluster.url(owner), KEY, filler(0, 4, 800))
        .await;
    assert_eq!(after.reply.status, 200);
    assert_eq!(after.affinity(), "miss", "the index went with the process");
    let again = conversation
        .turn(&http, &cluster.url(other), KEY, filler(0, 5, 800))
        .await;
    assert_eq!(again.host(), after.host());
    assert_eq!(again.affinity(), "hit", "warm again after one turn");
    cluster.shutdown().await;
}
