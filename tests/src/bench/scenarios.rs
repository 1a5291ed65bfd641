//! The scenarios, one module each, and what they share: the three targets
//! (direct to the fake, the minimal proxy, oqp), the oqp config they run on,
//! and the requests they send.

pub mod affinity;
pub mod cache;
pub mod cpu;
pub mod engines;
pub mod fairness;
pub mod forwarded;
pub mod latency;
pub mod memory;
pub mod runners;
pub mod scheduling;
pub mod streaming;
pub mod swap;
pub mod throughput;
pub mod translate;
pub mod usage;

use std::net::SocketAddr;
use std::time::Duration;

use super::Bench;
use super::load::Req;
use super::procs::{self, FakeSpec, Proc};

/// The key every oqp scenario sends unless it needs another (normal tier).
pub const USER_KEY: &str = "sk-bench-user-0123456789";
/// A batch client: low tier ceiling.
pub const BATCH_KEY: &str = "sk-bench-batch-0123456789";
/// An interactive client: may ask for the high tier.
pub const CHAT_KEY: &str = "sk-bench-chat-0123456789";
/// Management scope, for the admin API.
pub const ADMIN_KEY: &str = "sk-bench-admin-0123456789";

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Straight to the fake.
    Direct,
    /// Through the minimal proxy.
    Minimal,
    /// Through oqp.
    Oqp,
}

/// The three targets in front of one fake.
#[derive(Debug)]
pub struct Trio {
    /// The upstream: the fake Ollama, or the fast upstream.
    pub fake: Proc,
    /// The minimal proxy.
    pub minimal: Proc,
    /// oqp.
    pub oqp: Proc,
}

/// The oqp config of a scenario.
#[derive(Debug, Clone)]
pub struct OqpConfig {
    /// The fake's URL.
    pub upstream: String,
    /// The host's slots (`max_concurrent`).
    pub slots: u32,
    /// `embedding_cache.backend`, when the cache is on.
    pub cache: Option<String>,
    /// The host's `vram` (`10GiB`), when set.
    pub vram: Option<String>,
    /// `queue.model_swap`, when set (else its defaults).
    pub model_swap: Option<ModelSwap>,
    /// The host's `num_parallel` (each runner's slots), when set (else `max_concurrent`).
    pub num_parallel: Option<u32>,
    /// The host's `kind` (`openai`: the fake's OpenAI-compatible layer as an engine), when set.
    pub kind: Option<&'static str>,
}

/// `queue.model_swap` of a scenario.
#[derive(Debug, Clone, Copy)]
pub struct ModelSwap {
    /// `enabled`.
    pub enabled: bool,
    /// `max_defer` of the normal tier (the others keep their defaults).
    pub max_defer: Duration,
    /// `idle_grace`.
    pub idle_grace: Duration,
}

impl Target {
    /// All three, in report order.
    pub const ALL: [Target; 3] = [Target::Direct, Target::Minimal, Target::Oqp];

    /// The three, rotated by `by`: the order of round `by`, so that no
    /// target always goes first.
    pub fn rotated(by: usize) -> [Target; 3] {
        let mut order = Self::ALL;
        order.rotate_left(by % 3);
        order
    }

    /// Its index in [`Target::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Trio {
    /// Starts a fake with `spec`, and the minimal proxy and oqp in front of
    /// it (oqp with `slots` upstream slots).
    pub async fn start(bench: &Bench, spec: FakeSpec, slots: u32) -> anyhow::Result<Trio> {
        let fake = procs::spawn_fake(&bench.binaries, spec).await?;
        let minimal = procs::spawn_minimal(&bench.binaries, &fake.url()).await?;
        let config = OqpConfig::new(&fake.url(), slots);
        let oqp = procs::spawn_oqp(&bench.binaries, &config.render()).await?;
        Ok(Trio { fake, minimal, oqp })
    }

    /// The fast upstream (`bench::upstream`, canned answers at once), and the minimal proxy
    /// and oqp in front of it (oqp with `slots` upstream slots).
    pub async fn start_fast(bench: &Bench, slots: u32) -> anyhow::Result<Trio> {
        let fake = procs::spawn_fast_upstream(&bench.binaries).await?;
        let minimal = procs::spawn_minimal(&bench.binaries, &fake.url()).await?;
        let config = OqpConfig::new(&fake.url(), slots);
        let oqp = procs::spawn_oqp(&bench.binaries, &config.render()).await?;
        Ok(Trio { fake, minimal, oqp })
    }

    /// Where `target` listens.
    pub fn addr(&self, target: Target) -> SocketAddr {
        match target {
            Target::Direct => self.fake.addr(),
            Target::Minimal => self.minimal.addr(),
            Target::Oqp => self.oqp.addr(),
        }
    }

    /// Stops all three.
    pub async fn stop(self) {
        self.oqp.stop().await;
        self.minimal.stop().await;
        self.fake.stop().await;
    }
}

impl OqpConfig {
    /// A config for one host, auth on, deep queues, quiet logs.
    pub fn new(upstream: &str, slots: u32) -> OqpConfig {
        OqpConfig {
            upstream: upstream.to_owned(),
            slots,
            cache: None,
            vram: None,
            model_swap: None,
            num_parallel: None,
            kind: None,
        }
    }

    /// The YAML, with the placeholders [`procs::spawn_oqp`] fills.
    pub fn render(&self) -> String {
        let cache = match &self.cache {
            Some(backend) => format!(
                "embedding_cache:\n  enabled: true\n  backend: \"{backend}\"\n  connect_timeout: 1\n"
            ),
            None => String::new(),
        };
        let vram = match &self.vram {
            Some(vram) => format!("      vram: {vram}\n"),
            None => String::new(),
        };
        let vram = match self.num_parallel {
            Some(num_parallel) => format!("{vram}      num_parallel: {num_parallel}\n"),
            None => vram,
        };
        let vram = match self.kind {
            Some(kind) => format!("{vram}      kind: {kind}\n      model_sync_interval: 1\n"),
            None => vram,
        };
        let model_swap = match &self.model_swap {
            Some(swap) => format!(
                "  model_swap:\n    enabled: {}\n    max_defer: {{normal: {}}}\n    idle_grace: {}\n",
                swap.enabled,
                swap.max_defer.as_secs_f64(),
                swap.idle_grace.as_secs_f64()
            ),
            None => String::new(),
        };
        let fair: String = (0..4)
            .map(|i| format!("    - key: \"{}\"\n      client_id: fair{i}\n", fair_key(i)))
            .collect();
        format!(
            r#"proxy:
  host: "127.0.0.1"
  port: {{PROXY_PORT}}
  max_concurrent: {slots}
  max_request_body_mb: 64
  # The memory scenarios hold 10,000 connections from this one address, for
  # longer than a connection may wait for its first request by default.
  max_connections: 30000
  max_connections_per_ip: 30000
  first_request_timeout: 900
  idle_timeout: 900
ollama:
  hosts:
    - url: "{upstream}"
      name: fake
      max_concurrent: {slots}
{vram}queue:
  high:
    max_depth: 20000
    max_wait: 900
  normal:
    max_depth: 20000
    max_wait: 900
  low:
    max_depth: 20000
    max_wait: 900
  max_queued_mb: 1024
{model_swap}auth:
  enabled: true
  rate_limit:
    max_failures: 1000000
  metadata_rate_limit:
    per_second: 100000
    burst: 1000000
  keys:
    - key: "{USER_KEY}"
      client_id: user
    - key: "{BATCH_KEY}"
      client_id: batch
      max_priority: low
      default_priority: low
    - key: "{CHAT_KEY}"
      client_id: chat
      max_priority: high
      default_priority: high
    - key: "{ADMIN_KEY}"
      client_id: admin
      scope: management
{fair}{cache}logging:
  level: warn
control_plane:
  listen: "{{CONTROL}}"
  state_dir: "{{STATE}}"
"#,
            slots = self.slots,
            upstream = self.upstream,
        )
    }
}

/// The key of fairness client `i` (0..4).
pub fn fair_key(i: usize) -> String {
    format!("sk-bench-fair{i}-0123456789")
}

/// `GET /api/tags`: the metadata fast path.
pub fn tags(key: &str) -> Req {
    Req::get("/api/tags", Some(key))
}

/// A non-streamed `/api/generate`.
pub fn generate(key: &str) -> Req {
    Req::post(
        "/api/generate",
        Some(key),
        r#"{"model":"llama3","prompt":"Why is the sky blue?","stream":false}"#,
    )
}

/// An `/api/embed` of one short input.
pub fn embed(key: &str, input: &str) -> Req {
    Req::post(
        "/api/embed",
        Some(key),
        serde_json::json!({"model": "all-minilm", "input": input}).to_string(),
    )
}

/// A scenario's sizes: the full run's, or the quick run's.
pub fn size<T>(bench: &Bench, full: T, quick: T) -> T {
    if bench.quick { quick } else { full }
}

/// A duration scaled for the quick run.
pub fn seconds(bench: &Bench, full: f64, quick: f64) -> Duration {
    Duration::from_secs_f64(size(bench, full, quick))
}
