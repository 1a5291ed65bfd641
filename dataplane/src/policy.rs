//! The compiled policy: what a data plane knows about the world, built once
//! from a wire snapshot and then shared, immutable, by every request.
//!
//! `Policy::try_from(PolicySnapshot)` is the only way in ("parse, don't
//! validate"): a snapshot that does not compile is rejected whole and the data
//! plane keeps serving on its previous one (see [`crate::snapshot`]).

mod cidr;
mod claims;
mod convert;
mod keep_alive;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

// The request path looks clients up by key digest and id, and models in each host's lists,
// on every request: a seeded fast hasher (see the workspace's Cargo.toml).
use foldhash::{HashMap, HashSet};

use crate::scheduler::Tier;

pub use cidr::{Cidr, CidrError, canonical};
pub use claims::{ClaimPolicy, ClaimsToPolicy};
pub use convert::PolicyError;
pub use keep_alive::{DEFAULT_KEEP_ALIVE_MAX, KeepAlive};

/// One immutable policy snapshot, compiled for the request path.
#[derive(Debug)]
pub struct Policy {
    /// The snapshot's version; a newer snapshot has a higher one.
    pub version: u64,
    /// Where the main listener binds.
    pub listen: SocketAddr,
    /// General proxy behaviour.
    pub proxy: ProxySettings,
    /// Authentication settings.
    pub auth: AuthSettings,
    /// Consumers, by the SHA-256 digest of their key.
    pub clients: HashMap<[u8; 32], Arc<Client>>,
    /// Consumers, by client id (for injection listeners and status).
    pub clients_by_id: HashMap<Arc<str>, Arc<Client>>,
    /// Consumers whose credential is each user's token (`auth.keys[].jwt`), in snapshot order.
    pub token_clients: Vec<Arc<Client>>,
    /// Consumers whose credential is a verified client certificate, by its Common Name
    /// (`auth.keys[].tls_subject`).
    pub clients_by_subject: HashMap<Arc<str>, Arc<Client>>,
    /// Queue tiers and admission limits.
    pub queue: QueueSettings,
    /// The upstream hosts this node dispatches to (those it owns, and those no node owns), in
    /// configuration order.
    pub hosts: Vec<Arc<Host>>,
    /// This node's name, as the control plane addressed the snapshot.
    pub node: Arc<str>,
    /// Hosts other nodes own: never dispatched to from here; requests that choose one are
    /// forwarded to its owner.
    pub remote: Vec<Arc<Host>>,
    /// Every node the config lists, with the URL it is reached at when configured.
    pub nodes: Vec<NodeInfo>,
    /// This node's hop keys with each peer, by the peer's name, when the control plane keys
    /// its hops per pair ([`crate::hop::PairKeys`]); empty when the node token keys them.
    pub hop_peers: HashMap<Arc<str>, crate::hop::PairKeys>,
    /// Host selection.
    pub routing: RoutingSettings,
    /// keep_alive defaulting.
    pub keep_alive: KeepAlive,
    /// Embedding cache settings.
    pub embedding_cache: CacheSettings,
    /// Dashboard settings.
    pub dashboard: DashboardSettings,
    /// Extra listeners that inject a client identity.
    pub injection_listeners: Vec<InjectionListener>,
    /// The log level the config asks for (`logging.level`), if it names one.
    pub log_level: Option<LogLevel>,
    /// The request log (`logging.requests`), when it is on.
    pub request_log: Option<Arc<RequestLogSettings>>,
    /// The headers app keys name their users and sessions in (`auth.keys[].users`): removed
    /// from every request on its way upstream, from any key.
    pub delegation_headers: Vec<http::HeaderName>,
}

/// A log level (`logging.level`). The data plane's binary follows it unless
/// `OQP_LOG` fixes its filter; the library installs no subscriber itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Warnings and errors.
    Warn,
    /// The default.
    Info,
    /// Per-request detail.
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    /// The level's name: also a valid `tracing` filter directive.
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }

    /// The `tracing` filter for this level: oqp's own crates at the level,
    /// dependencies (hyper, h2, tonic) no more verbose than `warn`, so that
    /// `debug` shows oqp's per-request lines rather than HTTP/2 frames.
    pub fn filter(self) -> String {
        let dependencies = match self {
            LogLevel::Error => "error",
            _ => "warn",
        };
        let level = self.as_str();
        format!("{dependencies},oqp_dataplane={level},oqp_controlplane={level}")
    }

    /// Parses a level name, ignoring case.
    pub fn parse(text: &str) -> Option<Self> {
        [
            LogLevel::Error,
            LogLevel::Warn,
            LogLevel::Info,
            LogLevel::Debug,
            LogLevel::Trace,
        ]
        .into_iter()
        .find(|level| text.eq_ignore_ascii_case(level.as_str()))
    }
}

/// General proxy behaviour.
#[derive(Debug, Clone)]
pub struct ProxySettings {
    /// Default upstream slots per host.
    pub max_concurrent: u32,
    /// Whether model-management endpoints may be proxied.
    pub allow_model_management: bool,
    /// Largest accepted request body.
    pub max_request_body_bytes: u64,
    /// Upstream connect and time-to-headers timeout.
    pub request_timeout: Duration,
    /// Time to the head of a non-streamed generation, whose head comes with the whole
    /// answer ([`crate::proxy::Outbound::head_timeout`]).
    pub non_streamed_timeout: Duration,
    /// How long shutdown lets in-flight work finish.
    pub drain_timeout: Duration,
    /// Connection caps and timeouts of the listeners.
    pub connections: ConnectionLimits,
    /// Time to receive a whole buffered request body (408 after).
    pub body_read_timeout: Duration,
    /// Longest upstream silence between two response body frames.
    pub upstream_stall_timeout: Duration,
    /// TLS on the main listener; `None` = plain HTTP.
    pub tls: Option<TlsFiles>,
}

/// Where a TLS listener's certificate chain and private key are, on this box.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TlsFiles {
    /// PEM certificate chain.
    pub cert_file: std::path::PathBuf,
    /// PEM private key.
    pub key_file: std::path::PathBuf,
    /// PEM certificates of the CAs whose client certificates are verified; `None` = none
    /// asked for.
    pub client_ca_file: Option<std::path::PathBuf>,
}

/// What a client connection may hold, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections open at once, all listeners together.
    pub max_connections: u32,
    /// Most connections open at once from one address (IPv6: one /64).
    pub max_per_ip: u32,
    /// Accept to the first request's complete head.
    pub first_request_timeout: Duration,
    /// No request in flight for this long closes the connection.
    pub idle_timeout: Duration,
    /// A write to the client that makes no progress for this long closes
    /// the connection.
    pub client_stall_timeout: Duration,
}

/// Authentication settings.
#[derive(Debug, Clone)]
pub struct AuthSettings {
    /// Whether a key is required.
    pub enabled: bool,
    /// Failed attempts allowed per IP inside the window.
    pub max_failures: u32,
    /// The failed-attempt window.
    pub window: Duration,
    /// Proxies whose `X-Forwarded-For` names the client address (throttle and logs only).
    pub trusted_proxies: Vec<Cidr>,
    /// Metadata reads per client (`auth.metadata_rate_limit`).
    pub metadata_rate: MetadataRate,
}

/// Metadata reads per client: a token bucket of `burst` filling at `per_second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetadataRate {
    /// Reads added per second; 0 = no limit.
    pub per_second: u32,
    /// The bucket's size (at least 1).
    pub burst: u32,
}

/// What a key may do; each level includes the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Status, summary, metrics, dashboard.
    Read,
    /// Also proxying to Ollama.
    Inference,
    /// Also queue control.
    Management,
}

impl Scope {
    /// The scope's name as written in config files and error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Inference => "inference",
            Scope::Management => "management",
        }
    }
}

/// One consumer. Holds no key material beyond the digest.
#[derive(Debug, Clone)]
pub struct Client {
    /// The client's name.
    pub id: Arc<str>,
    /// SHA-256 of its key; `None` when each user's token is the credential
    /// (`auth.keys[].jwt`).
    pub key_digest: Option<[u8; 32]>,
    /// What it may do.
    pub scope: Scope,
    /// Highest tier it may use.
    pub max_priority: Tier,
    /// Tier used when it names none (already capped).
    pub default_priority: Tier,
    /// Most requests in flight at once; 0 = unlimited.
    pub max_concurrent: u32,
    /// Fair-share weight.
    pub weight: f64,
    /// Most requests waiting at once; 0 = unlimited.
    pub max_queued: u32,
    /// Description for status.
    pub description: String,
    /// When the key stops working.
    pub expires: Option<SystemTime>,
    /// Its usage budget, if it has one.
    pub budget: Option<UsageBudget>,
    /// The models it may use; `None` = every model.
    pub models: Option<ModelAllowlist>,
    /// Where an app names its end users, if the key speaks for many people.
    pub users: Option<Users>,
    /// The Common Name of the client certificate that is this client, if that is its
    /// credential.
    pub tls_subject: Option<Arc<str>>,
    /// Its per-minute limits (for an app key, the app's as a whole), if it has any.
    pub rate_limit: Option<MinuteLimit>,
    /// Bytes of each request body and answer its request log lines keep (its users' too,
    /// for an app key), if it captures them.
    pub capture: Option<usize>,
}

/// `logging.requests`: where the request log ([`crate::request_log`]) is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLogSettings {
    /// The configured path; each UTC day is written beside it.
    pub file: std::path::PathBuf,
    /// Days of files kept (at least 1).
    pub retention_days: u32,
}

/// Per-minute limits (`rate_limit`): requests and tokens, each a token bucket on this data
/// plane that refills evenly over a minute. [`crate::usage::minute`] enforces them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MinuteLimit {
    /// Requests per minute; 0 = no request limit.
    pub requests_per_minute: u32,
    /// Tokens (prompt + completion) per minute; 0 = no token limit.
    pub tokens_per_minute: u64,
}

impl MinuteLimit {
    /// From the wire; `None` when it limits nothing.
    pub fn from_wire(limit: Option<oqp_proto::policy::v1::RateLimit>) -> Option<Self> {
        let limit = limit?;
        let limit = Self {
            requests_per_minute: limit.requests_per_minute,
            tokens_per_minute: limit.tokens_per_minute,
        };
        (limit != Self::default()).then_some(limit)
    }
}

/// An app key's end users (`auth.keys[].users`): each is the sub-client `<client_id>/<user>`.
#[derive(Debug, Clone)]
pub struct Users {
    /// Where the user's id is read from.
    pub source: UserSource,
    /// Where, as a refusal names it (`X-OpenWebUI-User-Id`, `body field user`).
    pub named: String,
    /// Most requests of one user in flight at once; 0 = unlimited.
    pub max_concurrent: u32,
    /// Most requests of one user waiting at once; 0 = unlimited.
    pub max_queued: u32,
    /// Each user's budget (its `used` comes from report acks only).
    pub budget: Option<UsageBudget>,
    /// The header that names the conversation, if any.
    pub session_header: Option<http::HeaderName>,
    /// Each user's per-minute limits, if there are any.
    pub rate_limit: Option<MinuteLimit>,
    /// A token user's settings chosen by a claim (`jwt.claims_to_policy`), if any.
    pub claims_to_policy: Option<ClaimsToPolicy>,
}

/// Where an app puts its end user's id.
#[derive(Debug, Clone)]
pub enum UserSource {
    /// A request header (Open WebUI's `X-OpenWebUI-User-Id`).
    Header(http::HeaderName),
    /// A JSON body field, as a path of object keys (OpenAI's `user`, Anthropic's
    /// `metadata.user_id`).
    BodyField(Vec<String>),
    /// The subject of a signed token, verified against the issuer's public keys
    /// (`jwt:`, see [`crate::jwt`]).
    Jwt(Arc<crate::jwt::Verifier>),
}

/// A glob (`*`, `?`) over model names as Ollama compares them: any case, and a pattern without
/// wildcards and without a tag means its `:latest`, as a name would.
pub fn model_pattern(pattern: &str) -> wildmatch::WildMatch {
    let pattern = pattern.trim();
    let text = if pattern.contains(['*', '?']) {
        pattern.to_ascii_lowercase()
    } else {
        normalize_model(pattern)
    };
    wildmatch::WildMatch::new(&text)
}

/// The models a key may use (`auth.keys[].models`): globs (`*`, `?`) over model names as
/// Ollama compares them: any case, and a name without a tag is `:latest`.
#[derive(Clone)]
pub struct ModelAllowlist {
    patterns: Vec<wildmatch::WildMatch>,
    /// As configured, for `Debug` and errors.
    written: Vec<String>,
}

impl std::fmt::Debug for ModelAllowlist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.written).finish()
    }
}

impl ModelAllowlist {
    /// The list of `patterns`; a pattern without wildcards and without a tag means its
    /// `:latest`, as a name would.
    pub fn new(patterns: &[String]) -> Self {
        let compiled = patterns
            .iter()
            .map(|pattern| model_pattern(pattern))
            .collect();
        Self {
            patterns: compiled,
            written: patterns.to_vec(),
        }
    }

    /// The patterns as configured.
    pub fn patterns(&self) -> &[String] {
        &self.written
    }

    /// Whether `model` is on the list.
    pub fn allows(&self, model: &str) -> bool {
        let name = normalize_model(model);
        self.patterns.iter().any(|pattern| pattern.matches(&name))
    }
}

/// A client's usage budget (`auth.keys[].budget`): GPU time and/or tokens per window
/// aligned to UTC boundaries. [`crate::usage`] enforces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageBudget {
    /// GPU time per window, nanoseconds; 0 = none.
    pub gpu_ns: u64,
    /// Tokens (prompt + completion) per window; 0 = none.
    pub tokens: u64,
    /// Ollama Cloud spend per window, millionths of a USD; 0 = none.
    pub usd_micros: u64,
    /// The window's length, seconds (at least 1).
    pub window_seconds: u64,
    /// Windows start at this Unix time plus whole multiples of the length.
    pub anchor_unix_s: i64,
    /// The window as configured ("1d"), for the refusal's text.
    pub window: String,
    /// What the client had used over all data planes when the snapshot was built.
    pub used: Used,
}

/// What a client has used of its budget in one window over all data planes, as the control
/// plane last computed it (in a snapshot or a report's ack).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Used {
    /// The window's start, Unix seconds.
    pub window_start_unix_s: i64,
    /// GPU time, nanoseconds.
    pub gpu_ns: u64,
    /// Tokens.
    pub tokens: u64,
    /// Ollama Cloud spend the control plane attributed, millionths of a USD.
    pub usd_micros: u64,
    /// When the control plane computed it, Unix milliseconds: the newest copy wins.
    pub as_of_unix_ms: i64,
}

impl Used {
    /// From the wire.
    pub fn from_wire(used: &oqp_proto::policy::v1::BudgetUsed) -> Self {
        Self {
            window_start_unix_s: used.window_start_unix_s,
            gpu_ns: used.gpu_ns,
            tokens: used.tokens,
            usd_micros: usd_micros(used.usd),
            as_of_unix_ms: used.as_of_unix_ms,
        }
    }
}

/// A USD figure of the wire in millionths of a USD (0 for anything not a positive number).
pub fn usd_micros(usd: f64) -> u64 {
    if usd.is_finite() && usd > 0.0 {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let micros = (usd * 1e6).round().min(u64::MAX as f64) as u64;
        micros
    } else {
        0
    }
}

impl Client {
    /// Whether the key has expired at `now`.
    pub fn is_expired(&self, now: SystemTime) -> bool {
        self.expires.is_some_and(|expires| now >= expires)
    }

    /// The tier a request asking for `requested` gets: the request's wish
    /// (or the client's default), never above the ceiling.
    pub fn tier_for(&self, requested: Option<Tier>) -> Tier {
        // `Tier` orders High < Normal < Low (most urgent first), so the
        // ceiling is the larger of the two.
        requested
            .unwrap_or(self.default_priority)
            .max(self.max_priority)
    }
}

/// Limits of one tier.
#[derive(Debug, Clone)]
pub struct TierSettings {
    /// Most requests waiting.
    pub max_depth: u32,
    /// Longest wait before expiry.
    pub max_wait: Duration,
    /// Watermark threshold, percent of max_depth.
    pub high_watermark_pct: u32,
    /// Promotion to the next tier after this long, if set.
    pub promote_after: Option<Duration>,
    /// Whether the tier refuses new work.
    pub paused: bool,
    /// Flush generation; a higher value drops waiting work.
    pub flush_generation: u64,
}

/// Queue settings.
#[derive(Debug, Clone)]
pub struct QueueSettings {
    /// Per tier, in order high, normal, low.
    pub tiers: [TierSettings; 3],
    /// 503 or 429.
    pub overflow_status: http::StatusCode,
    /// Most body bytes waiting.
    pub max_queued_bytes: u64,
    /// Fair-share usage half-life.
    pub fair_share_half_life: Duration,
    /// Drain generation requested by the control plane.
    pub drain_generation: u64,
    /// Model-swap-aware scheduling (`queue.model_swap`).
    pub model_swap: ModelSwap,
}

/// Model-swap-aware scheduling settings (`queue.model_swap`): see [`crate::swap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSwap {
    /// Hold back requests for a model that would evict another, to batch switches.
    pub enabled: bool,
    /// Per tier (high, normal, low): the longest a request is held back for its model.
    pub max_defer: [Duration; 3],
    /// How long the resident models must have had no work before a switch may happen early.
    pub idle_grace: Duration,
    /// Unload the model switched away from explicitly (`keep_alive: 0`), so that the victim is
    /// the one chosen here and not Ollama's pick.
    pub unload: bool,
}

impl Default for ModelSwap {
    /// On; held back at most 1 s (high), 5 s (normal), 30 s (low); 300 ms grace; explicit unload.
    fn default() -> Self {
        Self {
            enabled: true,
            max_defer: [
                Duration::from_secs(1),
                Duration::from_secs(5),
                Duration::from_secs(30),
            ],
            idle_grace: Duration::from_millis(300),
            unload: true,
        }
    }
}

impl ModelSwap {
    /// The bound of one tier.
    pub fn max_defer(&self, tier: Tier) -> Duration {
        self.max_defer[tier.index()]
    }
}

impl QueueSettings {
    /// The settings of one tier.
    pub fn tier(&self, tier: Tier) -> &TierSettings {
        &self.tiers[tier.index()]
    }

    /// The longest a request can wait in the queue: every tier's `max_wait` together (a
    /// promoted request's clock restarts in its new tier).
    pub fn longest_wait(&self) -> Duration {
        self.tiers.iter().fold(Duration::ZERO, |total, tier| {
            total.saturating_add(tier.max_wait)
        })
    }
}

/// Local Ollama, Ollama Cloud, or an OpenAI-compatible engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKind {
    /// A local or LAN Ollama server.
    Ollama,
    /// Ollama Cloud, reached with a pool of keys.
    Cloud,
    /// An OpenAI-compatible engine (llama-server, llama-swap, vLLM…): sent to
    /// as a local host; its models come from `/v1/models`, its slots from the
    /// engine where it says (`Runners::num_parallel`).
    Openai,
}

impl HostKind {
    /// How status and metrics name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ollama => "ollama",
            Self::Cloud => "cloud",
            Self::Openai => "openai",
        }
    }
}

/// What the control plane learned of the engine behind a host, for status.
#[derive(Debug, Default)]
pub struct Engine {
    /// The kind as configured (`auto` included); empty from an older control plane.
    pub configured_kind: String,
    /// What answered its last successful poll ("ollama", "llama-server", "openai").
    pub detected: Option<String>,
    /// Slots the engine reported (llama-server's `/props`).
    pub learned_slots: Option<u32>,
    /// Each slot's context in tokens.
    pub slot_context: Option<u32>,
    /// What was wrong with what the engine said about itself.
    pub problem: Option<String>,
    /// Why the control plane's last poll failed.
    pub poll_error: Option<String>,
}

/// One upstream host.
#[derive(Debug)]
pub struct Host {
    /// Unique name (X-Failover-Host).
    pub name: Arc<str>,
    /// Base URL without trailing slash.
    pub url: String,
    /// Scheme and authority, parsed once.
    pub scheme: http::uri::Scheme,
    /// Authority, parsed once.
    pub authority: http::uri::Authority,
    /// Round-robin weight.
    pub weight: u32,
    /// Upstream slots.
    pub max_concurrent: u32,
    /// Local or cloud.
    pub kind: HostKind,
    /// Whether the control plane's last poll succeeded.
    pub healthy: bool,
    /// Installed models, normalised (see [`normalize_model`]).
    pub installed: HashSet<String>,
    /// Loaded models, normalised.
    pub loaded: HashSet<String>,
    /// Installed model names as Ollama reports them (for status).
    pub installed_names: Vec<String>,
    /// Loaded model names as Ollama reports them (for status).
    pub loaded_names: Vec<String>,
    /// When the control plane last polled it.
    pub last_checked: Option<SystemTime>,
    /// Cloud key pool.
    pub cloud_keys: Vec<CloudKey>,
    /// Cloud hosts: each account of the pool, with its balance as last read.
    pub cloud_accounts: Vec<crate::balance::Account>,
    /// Cloud fallback models.
    pub fallback_models: Vec<String>,
    /// The node that alone dispatches to it; `None` = every node.
    pub owner: Option<Arc<str>>,
    /// What its VRAM holds and can hold.
    pub vram: Vram,
    /// Its model runners' slots.
    pub runners: Runners,
    /// What the control plane learned of its engine.
    pub engine: Engine,
}

/// How many requests each model runner of a host runs at once: Ollama runs every loaded model
/// as its own runner with `OLLAMA_NUM_PARALLEL` slots, except those it forces to one.
#[derive(Debug, Default)]
pub struct Runners {
    /// `ollama.hosts[].num_parallel`; 0 = no limit of its own (the host's slots alone).
    pub num_parallel: u32,
    /// `ollama.hosts[].models."<glob>".num_parallel`, the first match winning.
    pub overrides: Vec<(wildmatch::WildMatch, u32)>,
    /// Models Ollama runs with one slot, learned from `/api/show`, with the reason.
    pub forced: HashMap<String, Arc<str>>,
}

impl Runners {
    /// The slots of `model`'s runner (a normalised name), and why it has one, if Ollama
    /// forces it.
    pub fn slots(&self, model: &str) -> (u32, Option<&Arc<str>>) {
        if let Some(reason) = self.forced.get(model) {
            return (1, Some(reason));
        }
        let slots = self
            .overrides
            .iter()
            .find(|(pattern, _)| pattern.matches(model))
            .map_or(self.num_parallel, |(_, slots)| *slots);
        (if slots == 0 { u32::MAX } else { slots }, None)
    }
}

/// What a host's VRAM holds and can hold, as the control plane last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vram {
    /// `ollama.hosts[].vram` in bytes; `None` = learned from what is seen resident together.
    pub capacity: Option<u64>,
    /// Models in VRAM at the last poll, loading ones included: normalised name and bytes
    /// (`size_vram`, else `size`).
    pub resident: Vec<(String, u64)>,
    /// Bytes each installed model takes on disk (`/api/tags` `size`), by normalised name: the
    /// estimate of its footprint until it has been seen resident.
    pub sizes: std::collections::HashMap<String, u64>,
}

/// A data-plane node as its peers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's name.
    pub name: Arc<str>,
    /// Where its main listener is reached, when configured (else as it reports it).
    pub base: Option<Base>,
}

/// The scheme and authority of a base URL, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Base {
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    /// Host and port.
    pub authority: http::uri::Authority,
}

impl Base {
    /// Parses `http(s)://host[:port]` (a trailing `/` allowed, nothing else after it).
    pub fn parse(url: &str) -> Result<Self, &'static str> {
        let uri: http::Uri = url
            .trim_end_matches('/')
            .parse()
            .map_err(|_| "invalid url")?;
        let scheme = uri
            .scheme()
            .filter(|s| **s == http::uri::Scheme::HTTP || **s == http::uri::Scheme::HTTPS)
            .cloned()
            .ok_or("url must be http or https")?;
        let authority = uri.authority().cloned().ok_or("url has no host")?;
        if !matches!(uri.path(), "" | "/") {
            return Err("url must not have a path");
        }
        Ok(Self { scheme, authority })
    }
}

/// An upstream cloud key.
#[derive(Clone)]
pub struct CloudKey {
    /// The key presented to Ollama Cloud.
    pub key: Arc<str>,
    /// The account it belongs to ("" = its own account).
    pub account: Arc<str>,
}

impl std::fmt::Debug for CloudKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloudKey")
            .field("key", &crate::redact::redact_key(&self.key))
            .field("account", &self.account)
            .finish()
    }
}

/// How hosts are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Prefer hosts where the model is loaded, then installed.
    ModelAware,
    /// Weighted round-robin, models ignored.
    RoundRobin,
}

/// Host selection settings.
#[derive(Debug, Clone)]
pub struct RoutingSettings {
    /// The strategy.
    pub strategy: Strategy,
    /// Cloud pool: longest wait for a model-bound key.
    pub acquire_timeout: Duration,
    /// Conversation affinity (`routing.affinity`).
    pub affinity: Affinity,
}

/// Conversation affinity (`routing.affinity`, see [`crate::affinity`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Affinity {
    /// Whether the next turn of a conversation is placed where its prompt is cached.
    pub enabled: bool,
    /// A trusted header that names the conversation (besides app keys' `session_header`).
    pub session_header: Option<http::HeaderName>,
    /// The load bound: no host is chosen for affinity above `(1 + ε) ×` the mean load.
    pub epsilon: f64,
    /// Whether one tenant's cached prefix may steer another tenant's request.
    pub share_across_keys: bool,
    /// Conversations a runner keeps beyond its slots (llama-server's RAM prompt cache).
    pub ram_cache_per_runner: u32,
    /// Prefill time per token before a host's own is learned, in seconds.
    pub prefill_per_token: f64,
    /// The most conversations the index holds.
    pub max_conversations: u32,
}

impl Default for Affinity {
    fn default() -> Self {
        Self {
            enabled: true,
            session_header: None,
            epsilon: 0.25,
            share_across_keys: false,
            ram_cache_per_runner: 0,
            prefill_per_token: 0.000_25,
            max_conversations: 100_000,
        }
    }
}

/// Where cached embeddings live.
#[derive(Clone, PartialEq, Eq)]
pub enum CacheBackend {
    /// In this process.
    Memory,
    /// A shared Valkey/Redis at this URL, which may carry a password: never
    /// printed as it is (see the `Debug` impl).
    Redis(String),
}

impl std::fmt::Debug for CacheBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Memory => f.write_str("Memory"),
            Self::Redis(url) => f
                .debug_tuple("Redis")
                .field(&crate::redact::redact_url(url))
                .finish(),
        }
    }
}
/// `embedding_cache.max_inputs` when the snapshot leaves it unset (OpenAI's
/// own limit).
pub const DEFAULT_MAX_EMBED_INPUTS: usize = 2048;

/// The largest `embedding_cache.max_inputs` the data plane accepts (a larger
/// value is clamped to it).
pub const MAX_EMBED_INPUTS: usize = 100_000;

/// Embedding cache settings.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSettings {
    /// Whether embeddings are cached.
    pub enabled: bool,
    /// Where.
    pub backend: CacheBackend,
    /// Entry lifetime.
    pub ttl: Duration,
    /// Largest cached entry.
    pub max_entry_bytes: u64,
    /// Key prefix.
    pub key_prefix: String,
    /// Backend connect timeout.
    pub connect_timeout: Duration,
    /// In-process capacity.
    pub max_memory_bytes: u64,
    /// Entries private to each client.
    pub per_client: bool,
    /// Most inputs one cached embed request may carry (413 above).
    pub max_inputs: usize,
}

/// Dashboard settings.
#[derive(Debug, Clone)]
pub struct DashboardSettings {
    /// Whether /dashboard is served.
    pub enabled: bool,
    /// The page's poll interval.
    pub refresh: Duration,
}

/// A listener that injects a client identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InjectionListener {
    /// Bind address.
    pub addr: SocketAddr,
    /// The injected client id.
    pub inject_as: Arc<str>,
    /// TLS on this listener; `None` = plain HTTP.
    pub tls: Option<TlsFiles>,
    /// Whether an app key's end users named in requests are believed on this port.
    pub trust_users: bool,
}

impl Policy {
    /// The client a presented key belongs to, if the key is known and valid.
    pub fn client_by_key(&self, key: &str) -> Option<&Arc<Client>> {
        use sha2::Digest;
        let digest: [u8; 32] = sha2::Sha256::digest(key.as_bytes()).into();
        self.clients
            .get(&digest)
            .filter(|client| !client.is_expired(SystemTime::now()))
    }

    /// Whether a client identified as `client_id` may still be served at `now`: it is in this
    /// snapshot and its current key has not expired. Waiting requests of a client that no longer
    /// is are refused (revocation and expiry reach the queue, not only new requests).
    pub fn admits(&self, client_id: &str, now: SystemTime) -> bool {
        // A user of an app is admitted while its app is.
        let (app, user) = match client_id.split_once('/') {
            Some((app, _)) => (app, true),
            None => (client_id, false),
        };
        self.clients_by_id
            .get(app)
            .is_some_and(|client| !client.is_expired(now) && (!user || client.users.is_some()))
    }

    /// The app key a sub-client `<client_id>/<user>` belongs to, and the user, when that
    /// key speaks for many people.
    pub fn app_of<'a>(&'a self, client_id: &'a str) -> Option<(&'a Arc<Client>, &'a str)> {
        let (app, user) = client_id.split_once('/')?;
        let client = self.clients_by_id.get(app)?;
        client.users.as_ref()?;
        Some((client, user))
    }

    /// How many bytes of a request body and of its answer the request log keeps for
    /// `client_id` (a user of an app has its app key's setting), when the log is on and the
    /// key captures bodies.
    pub fn capture_of(&self, client_id: &str) -> Option<usize> {
        self.request_log.as_ref()?;
        let key = client_id.split_once('/').map_or(client_id, |(app, _)| app);
        self.clients_by_id.get(key)?.capture
    }

    /// A host by name.
    pub fn host(&self, name: &str) -> Option<&Arc<Host>> {
        self.hosts.iter().find(|host| &*host.name == name)
    }
}

/// The wire form of a tier.
pub fn tier_to_wire(tier: Tier) -> oqp_proto::policy::v1::Tier {
    match tier {
        Tier::High => oqp_proto::policy::v1::Tier::High,
        Tier::Normal => oqp_proto::policy::v1::Tier::Normal,
        Tier::Low => oqp_proto::policy::v1::Tier::Low,
    }
}

pub use oqp_proto::unix_ms;

/// Normalises a model name the way Ollama matches them: case-insensitive, and
/// a missing tag means `:latest`.
pub fn normalize_model(name: &str) -> String {
    normal_model(name).into_owned()
}

/// [`normalize_model`] without an allocation when the name is already normal (trimmed,
/// lowercase, tagged), as a client's name usually is: the router compares a request's model
/// with every host's lists on each dispatch and each completion.
pub fn normal_model(name: &str) -> std::borrow::Cow<'_, str> {
    const LATEST: &str = ":latest";
    let name = name.trim();
    // The tag separator is the last ':' after the last '/', so that a
    // registry host with a port ("host:5000/ns/model") is not mistaken for one.
    // One pass over the bytes: this runs on every dispatch and completion.
    let (mut tagged, mut upper) = (false, false);
    for byte in name.bytes() {
        match byte {
            b'/' => tagged = false,
            b':' => tagged = true,
            b'A'..=b'Z' => upper = true,
            _ => {}
        }
    }
    if tagged && !upper {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut normalized = String::with_capacity(name.len() + if tagged { 0 } else { LATEST.len() });
    normalized.push_str(name);
    normalized.make_ascii_lowercase();
    if !tagged {
        normalized.push_str(LATEST);
    }
    std::borrow::Cow::Owned(normalized)
}

/// The smallest wire snapshot that compiles: one listener on port 0, one
/// host. Tests edit what they need.
#[cfg(test)]
pub(crate) fn minimal_wire() -> oqp_proto::policy::v1::PolicySnapshot {
    use oqp_proto::policy::v1 as wire;
    wire::PolicySnapshot {
        version: 1,
        listener: Some(wire::Listener {
            host: "127.0.0.1".into(),
            port: 0,
        }),
        proxy: Some(wire::ProxySettings {
            max_concurrent: 1,
            ..Default::default()
        }),
        hosts: vec![wire::Host {
            name: "gpu".into(),
            url: "http://127.0.0.1:1".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_compare_like_ollama() {
        assert_eq!(normalize_model("llama3"), "llama3:latest");
        assert_eq!(normalize_model("Llama3:LATEST"), "llama3:latest");
        assert_eq!(normalize_model("qwen3:8b"), "qwen3:8b");
        assert_eq!(
            normalize_model("registry:5000/ns/model"),
            "registry:5000/ns/model:latest"
        );
        assert_eq!(normalize_model("  qwen3:8b \n"), "qwen3:8b");
    }

    #[test]
    fn a_normal_model_name_is_borrowed() {
        use std::borrow::Cow;
        assert!(matches!(
            normal_model("qwen3:8b"),
            Cow::Borrowed("qwen3:8b")
        ));
        assert!(matches!(
            normal_model(" qwen3:8b "),
            Cow::Borrowed("qwen3:8b")
        ));
        assert!(matches!(
            normal_model("registry:5000/ns/model:v1"),
            Cow::Borrowed("registry:5000/ns/model:v1")
        ));
        assert!(matches!(normal_model("Qwen3:8b"), Cow::Owned(name) if name == "qwen3:8b"));
        assert!(matches!(normal_model("llama3"), Cow::Owned(name) if name == "llama3:latest"));
        assert!(matches!(
            normal_model("registry:5000/ns/model"),
            Cow::Owned(name) if name == "registry:5000/ns/model:latest"
        ));
    }

    #[test]
    fn a_redis_password_is_not_debug_printed() {
        let settings = CacheSettings {
            enabled: true,
            backend: CacheBackend::Redis("redis://:hunter2@valkey:6379/0".to_owned()),
            ttl: Duration::from_secs(1),
            max_entry_bytes: 1,
            key_prefix: String::new(),
            connect_timeout: Duration::from_secs(1),
            max_memory_bytes: 1,
            per_client: false,
            max_inputs: 1,
        };
        let printed = format!("{settings:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(
            printed.contains("Redis(\"redis://:***@valkey:6379/0\")"),
            "{printed}"
        );
    }

    #[test]
    fn levels_parse_in_any_case_and_filter_dependencies_to_warn() {
        assert_eq!(LogLevel::parse("DEBUG"), Some(LogLevel::Debug));
        assert_eq!(LogLevel::parse("verbose"), None);
        assert_eq!(
            LogLevel::Debug.filter(),
            "warn,oqp_dataplane=debug,oqp_controlplane=debug"
        );
        assert_eq!(
            LogLevel::Error.filter(),
            "error,oqp_dataplane=error,oqp_controlplane=error"
        );
    }
}
