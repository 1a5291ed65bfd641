//! The validated, resolved configuration that the rest of oqp codes against.
//!
//! Every value here has passed its checks: durations are `Duration`s, key sources are resolved
//! [`Secret`]s, enums are enums, and cross-field rules (caps within `proxy.max_concurrent`,
//! injection listeners naming known clients, …) hold. The `Default` impls are the single source
//! of the documented defaults; the loader falls back to them for every key a file leaves out.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::enums::{
    HostKind, LogFormat, LogLevel, RoutingFallback, RoutingStrategy, Scope, Tier, WebhookEvent,
};
use super::secret::Secret;

/// The whole configuration, one field per top-level section of the file.
#[derive(Debug, Clone)]
pub struct Config {
    pub proxy: ProxyConfig,
    pub ollama: OllamaConfig,
    pub queue: QueueConfig,
    pub webhooks: WebhooksConfig,
    pub auth: AuthConfig,
    pub logging: LoggingConfig,
    pub client_injection: ClientInjectionConfig,
    pub routing: RoutingConfig,
    pub embedding_cache: EmbeddingCacheConfig,
    pub keep_alive: KeepAliveConfig,
    pub dashboard: DashboardConfig,
    pub control_plane: ControlPlaneConfig,
    /// Per-node listener overrides, keyed by node name.
    pub nodes: BTreeMap<String, NodeOverride>,
    /// Ollama Cloud balance reads and per-account settings.
    pub cloud: super::CloudConfig,
}

/// `proxy`: the main listener and global limits.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    /// Bind address of the main listener (an IP address or a host name).
    pub host: String,
    pub port: u16,
    /// Global upstream concurrency; at least 1.
    pub max_concurrent: u32,
    /// When false, `/api/pull|push|delete|create|copy` are refused with 403.
    pub allow_model_management: bool,
    /// How long shutdown waits for queued requests to be taken.
    pub drain_timeout: Duration,
    /// Request body limit in MiB.
    pub max_request_body_mb: u64,
    /// Most client connections open at once, all listeners together.
    pub max_connections: u32,
    /// Most client connections open at once from one address (IPv6: one /64).
    pub max_connections_per_ip: u32,
    /// Accept to the first request's complete head.
    pub first_request_timeout: Duration,
    /// A connection with no request in flight is closed after this long.
    pub idle_timeout: Duration,
    /// Time to receive a whole buffered request body (408 after).
    pub body_read_timeout: Duration,
    /// Longest upstream silence between two response body frames.
    pub upstream_stall_timeout: Duration,
    /// Longest time a client may accept no response byte.
    pub client_stall_timeout: Duration,
    /// TLS on the main listener; `None` = plain HTTP.
    pub tls: Option<ListenerTls>,
}

/// TLS on a client listener: absolute paths on the data plane's box, read there (the key
/// never crosses the policy stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    /// PEM certificate chain, the server's certificate first.
    pub cert_file: PathBuf,
    /// PEM private key.
    pub key_file: PathBuf,
    /// PEM CA certificates whose client certificates are verified (optional client auth).
    pub client_ca_file: Option<PathBuf>,
}

/// `ollama`: the upstream hosts.
#[derive(Debug, Clone)]
pub struct OllamaConfig {
    /// At least one host; names are unique.
    pub hosts: Vec<HostConfig>,
    /// Upstream request timeout.
    pub request_timeout: Duration,
    /// Time to the head of a non-streamed generation (default `request_timeout`).
    pub non_streamed_timeout: Duration,
}

/// One upstream in `ollama.hosts[]`.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// `http(s)://host[:port][/path]` without a trailing slash.
    pub url: String,
    /// Unique identity of the host (headers, metrics, status).
    pub name: String,
    /// Weighted round-robin weight, at least 1.
    pub weight: u32,
    /// Interval of the `/api/tags` poll, at least 1 s.
    pub model_sync_interval: Duration,
    /// Concurrent requests this host accepts; defaults to `proxy.max_concurrent`.
    pub max_concurrent: u32,
    pub kind: HostKind,
    /// Cloud hosts only: the key pool (config first, then `OLLAMA_API_KEY`, `OLLAMA_API_KEYS`),
    /// deduplicated. Empty for `HostKind::Ollama`.
    pub api_keys: Vec<CloudKey>,
    /// Models to try, in order, when the requested one fails unrecoverably on this host.
    pub fallback_models: Vec<String>,
    /// The node whose data plane alone dispatches to this host; `None` = every data plane.
    pub node: Option<String>,
    /// VRAM capacity in bytes (`vram`); `None` = learned from what is seen resident together.
    pub vram: Option<u64>,
    /// Slots of each model runner on the box (its `OLLAMA_NUM_PARALLEL`); defaults to
    /// `max_concurrent`.
    pub num_parallel: u32,
    /// Per-model runner slots (`models."<glob>".num_parallel`), in the order written.
    pub runner_overrides: Vec<(String, u32)>,
}

/// A key of a cloud host's pool.
#[derive(Debug, Clone, PartialEq)]
pub struct CloudKey {
    pub key: Secret,
    /// Account label shown instead of the key; `""` if none was given.
    pub account: String,
}

/// `queue`: tiers and admission limits.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    pub high: TierConfig,
    pub normal: TierConfig,
    pub low: TierConfig,
    /// Status of a depth or byte-cap rejection: 503 or 429.
    pub overflow_status_code: u16,
    /// MiB of request bodies allowed to wait across all tiers.
    pub max_queued_mb: u64,
    pub fair_share: FairShareConfig,
    pub model_swap: ModelSwapConfig,
}

/// `queue.model_swap`: hold back requests for a model that is not in VRAM, to batch switches.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSwapConfig {
    pub enabled: bool,
    /// Per tier (high, normal, low): the longest a request is held back for its model; each
    /// is below its tier's `max_wait`.
    pub max_defer: [Duration; 3],
    /// How long the resident models must have had no work before a switch may happen early;
    /// at most 10 s.
    pub idle_grace: Duration,
    /// Unload the model switched away from explicitly (`keep_alive: 0`).
    pub unload: bool,
}

/// One tier of the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct TierConfig {
    /// Requests allowed to wait in this tier. `0` means the tier never queues: a request is
    /// admitted only if it can be dispatched at once, else it is rejected as "queue full".
    pub max_depth: u32,
    /// Longest a request may wait before it expires with 503.
    pub max_wait: Duration,
    /// Depth percentage (1..=100) at which `queue.high_watermark` fires.
    pub high_watermark_pct: u32,
    /// Promote a request waiting this long to the next higher tier; `None` = never.
    pub promote_after: Option<Duration>,
}

/// Fair sharing between clients inside a tier.
#[derive(Debug, Clone, PartialEq)]
pub struct FairShareConfig {
    /// Half-life of the decay applied to each client's recent usage.
    pub half_life: Duration,
}

/// `webhooks`: outgoing event notifications.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhooksConfig {
    /// True only if enabled in the file *and* a URL is set.
    pub enabled: bool,
    /// Target URL (`""` if unset). Only its scheme and host name are checked here.
    pub url: String,
    /// Subscribed events, without duplicates.
    pub events: Vec<WebhookEvent>,
    /// Host names exempt from the start-up SSRF check.
    pub allowed_hosts: Vec<String>,
}

/// `auth`: inbound API keys.
#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    pub enabled: bool,
    /// Unique client ids and unique keys. May be non-empty with auth off (injection listeners).
    pub keys: Vec<KeyConfig>,
    pub rate_limit: RateLimitConfig,
    /// `auth.trusted_proxies`: CIDRs (normalised, e.g. `10.0.0.0/8`) whose `X-Forwarded-For`
    /// names the client address for the throttle and logs. Empty: the header is ignored.
    pub trusted_proxies: Vec<String>,
    pub metadata_rate_limit: MetadataRateLimitConfig,
    /// `auth.default_rate_limit`: the per-minute limits of every key that sets none.
    pub default_rate_limit: Option<MinuteLimit>,
}

/// `rate_limit` (on a key, its `users`, or `auth.default_rate_limit`): requests and tokens
/// per minute, each a token bucket per data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinuteLimit {
    /// Requests per minute; 0 = no request limit.
    pub requests_per_minute: u32,
    /// Prompt + completion tokens per minute; 0 = no token limit.
    pub tokens_per_minute: u64,
}

/// `auth.metadata_rate_limit`: metadata reads per client (a token bucket).
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataRateLimitConfig {
    /// Reads added to a client's bucket per second; 0 = no limit.
    pub per_second: u32,
    /// The bucket's size; at least 1.
    pub burst: u32,
}

impl Default for MetadataRateLimitConfig {
    fn default() -> Self {
        Self {
            per_second: 20,
            burst: 100,
        }
    }
}

/// `auth.rate_limit`: the failed-authentication throttle (per client IP).
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimitConfig {
    /// Failures within the window before 429; at least 1.
    pub max_failures: u32,
    /// Rolling window, also the `Retry-After` value; at least 1.
    pub window_seconds: u64,
}

/// One entry of `auth.keys[]`.
#[derive(Debug, Clone)]
pub struct KeyConfig {
    pub client_id: String,
    /// The resolved credential (from `key`, `key_env` or `key_file`); `None` when each
    /// user's token is the credential (`jwt`, and then `users` reads it).
    pub key: Option<Secret>,
    pub description: Option<String>,
    /// `management: true` (deprecated) has been folded in here.
    pub scope: Scope,
    /// Ceiling applied to the requested tier.
    pub max_priority: Tier,
    /// Tier used when a request names none; never above `max_priority`.
    pub default_priority: Tier,
    /// In-flight cap, 0 = unlimited; never above `proxy.max_concurrent`.
    pub max_concurrent: u32,
    /// Fair-share weight, > 0.
    pub weight: f64,
    /// Requests this client may have waiting, 0 = unlimited.
    pub max_queued: u32,
    /// After this instant the key no longer authenticates.
    pub expires: Option<SystemTime>,
    /// Its usage budget, if it has one.
    pub budget: Option<Budget>,
    /// The models it may use, as globs; empty = every model.
    pub models: Vec<String>,
    /// Where the app this key belongs to names its end users, if it speaks for many people.
    pub users: Option<UsersConfig>,
    /// Instead of a key: the Common Name of the verified client certificate that is this
    /// client (`proxy.tls.client_ca_file`).
    pub tls_subject: Option<String>,
    /// Its own per-minute limits (for an app key, the app as a whole), if it sets any.
    pub rate_limit: Option<MinuteLimit>,
    /// `capture.max_bytes`: how much of each request body and answer the request log keeps
    /// (its users' too); `None` = no capture.
    pub capture: Option<u32>,
}

/// `auth.keys[].users`: a trusted app's end users, each the sub-client `<client_id>/<user>`.
#[derive(Debug, Clone, PartialEq)]
pub struct UsersConfig {
    /// Where the user's id is read.
    pub source: UserSource,
    /// Per user, per data plane; 0 = unlimited.
    pub max_concurrent: u32,
    /// Per user; 0 = unlimited.
    pub max_queued: u32,
    /// Each user's budget.
    pub budget: Option<Budget>,
    /// The header naming the conversation, if any.
    pub session_header: Option<String>,
    /// Each user's per-minute limits.
    pub rate_limit: Option<MinuteLimit>,
}

/// Where an app names its end user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserSource {
    /// `users.header`.
    Header(String),
    /// `users.body_field`: a dotted path of JSON object keys.
    BodyField(String),
    /// `users.jwt` (or the key's own `jwt`): the subject of a verified token.
    Jwt(JwtConfig),
}

/// `jwt:`: how a user's signed token is verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtConfig {
    /// The `iss` a token must carry.
    pub issuer: String,
    /// The `aud` values accepted (at least one).
    pub audiences: Vec<String>,
    /// Where the issuer's public keys are.
    pub jwks: JwksSource,
    /// The claim that names the user (`sub` by default).
    pub user_claim: String,
    /// The header the token comes in; `Authorization` means `Authorization: Bearer`.
    pub header: String,
    /// The accepted signature algorithms.
    pub algorithms: Vec<String>,
    /// Hosts of `jwks_url` exempt from the SSRF check (an identity provider on the LAN).
    pub allowed_hosts: Vec<String>,
    /// Shortest time between two fetches of the keys asked for by a token (an unknown key
    /// id) or after a failure.
    pub refresh_min_interval: std::time::Duration,
    /// The user's settings chosen by a claim of the token, if any (boxed: rarely set, and
    /// large beside the other ways of naming a user).
    pub claims_to_policy: Option<Box<ClaimsToPolicy>>,
}

/// `jwt.claims_to_policy`: a claim of the token chooses the user's ceiling and models.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimsToPolicy {
    /// The claim read (a string or an array of strings in the token).
    pub claim: String,
    /// The first whose value the claim holds applies.
    pub policies: Vec<ClaimPolicy>,
}

/// The settings of the users whose claim holds `value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPolicy {
    /// The claim's value that selects them.
    pub value: String,
    /// The user's ceiling, in place of the entry's.
    pub max_priority: Option<Tier>,
    /// The user's model globs, in place of the entry's; empty = the entry's.
    pub models: Vec<String>,
    /// The user's budget in place of `users.budget` (over the same window).
    pub budget: Option<Budget>,
}

/// Where an issuer's public keys (a JWK Set) are read.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum JwksSource {
    /// `jwks_url`: fetched over HTTP(S), under the webhook SSRF rules.
    Url(String),
    /// `jwks_file`: read from this box's disk.
    File(std::path::PathBuf),
}

/// `auth.keys[].budget` (or a store key's): GPU time, tokens and/or Ollama Cloud spend per
/// window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// GPU time per window, nanoseconds; 0 = no GPU-time budget.
    pub gpu_ns: u64,
    /// Prompt + completion tokens per window; 0 = no token budget.
    pub tokens: u64,
    /// Ollama Cloud spend per window, in millionths of a USD (`usd`); 0 = no USD budget.
    pub usd_micros: u64,
    /// The window.
    pub window: BudgetWindow,
}

/// A budget's window, aligned to UTC boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetWindow {
    /// Each hour, on the hour.
    Hour,
    /// Each UTC day, from midnight.
    Day,
    /// Each week, from Monday 00:00 UTC.
    Week,
    /// Consecutive 30-day periods counted from 1970-01-01.
    Days30,
}

impl BudgetWindow {
    /// Every window, as written.
    pub const ALL: [BudgetWindow; 4] = [Self::Hour, Self::Day, Self::Week, Self::Days30];

    /// As written in the config: `1h`, `1d`, `7d`, `30d`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hour => "1h",
            Self::Day => "1d",
            Self::Week => "7d",
            Self::Days30 => "30d",
        }
    }

    /// The window written as `text`, if it is one.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|window| window.as_str().eq_ignore_ascii_case(text.trim()))
    }

    /// Its length in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Self::Hour => 3600,
            Self::Day => 86_400,
            Self::Week => 7 * 86_400,
            Self::Days30 => 30 * 86_400,
        }
    }

    /// Windows start here plus whole multiples of the length: the epoch, or for weeks
    /// 1970-01-05, a Monday.
    pub fn anchor_unix_s(self) -> i64 {
        match self {
            Self::Week => 4 * 86_400,
            _ => 0,
        }
    }
}

/// `logging`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggingConfig {
    pub level: LogLevel,
    pub format: LogFormat,
    /// `logging.requests`: the request log, off unless set.
    pub requests: Option<RequestLogConfig>,
}

/// `logging.requests`: one JSON line per proxied request, in daily files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLogConfig {
    /// The path; each UTC day is written beside it, the date before the extension.
    pub file: String,
    /// Days of files kept, 1..=3650 (default 30).
    pub retention_days: u32,
}

impl RequestLogConfig {
    /// Days of files kept when the config says nothing.
    pub const DEFAULT_RETENTION_DAYS: u32 = 30;
}

/// `client_injection`: ports that inject a fixed identity.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClientInjectionConfig {
    pub listeners: Vec<InjectionListener>,
    /// Required to bind a listener to a non-loopback address.
    pub allow_public_injection: bool,
}

/// One injection listener.
#[derive(Debug, Clone, PartialEq)]
pub struct InjectionListener {
    /// 1024..=65535, distinct from `proxy.port` and other listeners.
    pub listen_port: u16,
    /// A configured `auth.keys[].client_id`.
    pub inject_as: String,
    /// Bind address; loopback unless `allow_public_injection`.
    pub bind: String,
    /// TLS on this listener; `None` = plain HTTP.
    pub tls: Option<ListenerTls>,
    /// Whether an app key's end users named in requests are believed (default false: the
    /// port has no credential, so anyone reaching it could name any user).
    pub trust_users: bool,
}

/// `routing`: host selection.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    pub strategy: RoutingStrategy,
    pub fallback: RoutingFallback,
    /// Timeout of one `/api/tags` poll.
    pub model_poll_timeout: Duration,
    /// Fail start-up when no host answers the first poll.
    pub require_host_at_start: bool,
    /// How long a cloud request waits for a pool key bound to its model before using any key.
    pub acquire_timeout: Duration,
    /// `routing.affinity`.
    pub affinity: AffinityConfig,
}

/// `routing.affinity`: conversation affinity (the data plane's `policy::Affinity`).
#[derive(Debug, Clone, PartialEq)]
pub struct AffinityConfig {
    pub enabled: bool,
    pub session_header: Option<String>,
    pub epsilon: f64,
    pub share_across_keys: bool,
    pub ram_cache_per_runner: u32,
    pub prefill_ms_per_1k: f64,
    pub max_conversations: u32,
}

impl Default for AffinityConfig {
    /// The data plane's defaults: one source for both.
    fn default() -> Self {
        let defaults = oqp_dataplane::policy::Affinity::default();
        Self {
            enabled: defaults.enabled,
            session_header: None,
            epsilon: defaults.epsilon,
            share_across_keys: defaults.share_across_keys,
            ram_cache_per_runner: defaults.ram_cache_per_runner,
            prefill_ms_per_1k: defaults.prefill_per_token * 1_000_000.0,
            max_conversations: defaults.max_conversations,
        }
    }
}

/// `embedding_cache`.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingCacheConfig {
    pub enabled: bool,
    pub backend: CacheBackend,
    pub ttl: Duration,
    /// Responses larger than this are not cached.
    pub max_entry_bytes: u64,
    pub key_prefix: String,
    /// Connect timeout for a Redis backend.
    pub connect_timeout: Duration,
    /// Size bound of the in-process backend.
    pub max_memory_mb: u64,
    /// Partition the cache by client id instead of sharing it across tenants.
    pub per_client: bool,
    /// Most inputs one cached embed request may carry (413 above).
    pub max_inputs: u64,
}

/// Where cached embeddings live.
#[derive(Clone, PartialEq)]
pub enum CacheBackend {
    /// In-process, bounded by `max_memory_mb`.
    Memory,
    /// A RESP server at this `redis://` or `rediss://` URL.
    Redis(String),
}

/// `keep_alive`: the value inserted into generate/chat/embed bodies.
#[derive(Debug, Clone, PartialEq)]
pub struct KeepAliveConfig {
    /// The JSON literal to insert: `"\"5m\""` for a duration string, `-1` or `300` for numbers.
    pub default_json: String,
    /// Replace a client-supplied `keep_alive` too (the file key is `override`).
    pub override_client: bool,
    /// While model-swap holding is on, the longest keep_alive a key below `management` may set.
    pub max: Duration,
}

/// `dashboard`.
#[derive(Debug, Clone, PartialEq)]
pub struct DashboardConfig {
    pub enabled: bool,
    /// Poll interval of the page, at least 1.
    pub refresh_seconds: u32,
}

/// `control_plane`: where data planes connect.
#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    /// gRPC listen address, `host:port`.
    pub listen: String,
    /// Token data planes present; `None` = no token required.
    pub node_token: Option<Secret>,
    /// Directory of the key store and other durable state.
    pub state_dir: PathBuf,
    pub tls: Option<TlsConfig>,
    /// `control_plane.audit`: the audit trail's rotation.
    pub audit: AuditConfig,
}

/// `control_plane.audit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditConfig {
    /// `audit.jsonl` is rotated past this size (MiB, 1..=1024; default 10).
    pub max_file_mb: u64,
    /// Rotated files kept (0..=100; default 5).
    pub keep_files: u32,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            max_file_mb: 10,
            keep_files: 5,
        }
    }
}

/// Certificate and private key (PEM paths) for the gRPC listener.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// `nodes.<name>`: one data-plane node: its listener overrides and how its peers reach it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeOverride {
    pub host: Option<String>,
    pub port: Option<u16>,
    /// `nodes.<name>.url`: the base URL peers forward to (normalised, no trailing slash).
    pub url: Option<String>,
}

impl ProxyConfig {
    /// `max_request_body_mb` in bytes.
    pub fn max_request_body_bytes(&self) -> u64 {
        self.max_request_body_mb.saturating_mul(1024 * 1024)
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_string(),
            port: 11435,
            max_concurrent: 2,
            allow_model_management: false,
            drain_timeout: Duration::from_secs(30),
            max_request_body_mb: 50,
            max_connections: 4096,
            max_connections_per_ip: 1024,
            first_request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(30),
            upstream_stall_timeout: Duration::from_secs(60),
            client_stall_timeout: Duration::from_secs(60),
            tls: None,
        }
    }
}

impl OllamaConfig {
    /// Default `request_timeout`.
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
}

impl HostConfig {
    pub const DEFAULT_WEIGHT: u32 = 1;
    pub const DEFAULT_MODEL_SYNC_INTERVAL: Duration = Duration::from_secs(30);
}

impl QueueConfig {
    /// The block of one tier.
    pub fn tier(&self, tier: Tier) -> &TierConfig {
        match tier {
            Tier::High => &self.high,
            Tier::Normal => &self.normal,
            Tier::Low => &self.low,
        }
    }

    /// `max_queued_mb` in bytes.
    pub fn max_queued_bytes(&self) -> u64 {
        self.max_queued_mb.saturating_mul(1024 * 1024)
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            high: TierConfig::default_for(Tier::High),
            normal: TierConfig::default_for(Tier::Normal),
            low: TierConfig::default_for(Tier::Low),
            overflow_status_code: 503,
            max_queued_mb: 512,
            fair_share: FairShareConfig::default(),
            model_swap: ModelSwapConfig::default(),
        }
    }
}

impl ModelSwapConfig {
    /// The longest `idle_grace`.
    pub const MAX_IDLE_GRACE: Duration = Duration::from_secs(10);

    /// The bound of one tier.
    pub fn max_defer(&self, tier: Tier) -> Duration {
        self.max_defer[Self::index(tier)]
    }

    /// The position of a tier in `max_defer`.
    pub fn index(tier: Tier) -> usize {
        match tier {
            Tier::High => 0,
            Tier::Normal => 1,
            Tier::Low => 2,
        }
    }
}

impl Default for ModelSwapConfig {
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

impl TierConfig {
    /// The defaults of one tier: high 50/120 s, normal 100/300 s, low 200/600 s, watermark 80 %.
    pub fn default_for(tier: Tier) -> Self {
        let (max_depth, max_wait) = match tier {
            Tier::High => (50, 120),
            Tier::Normal => (100, 300),
            Tier::Low => (200, 600),
        };
        Self {
            max_depth,
            max_wait: Duration::from_secs(max_wait),
            high_watermark_pct: 80,
            promote_after: None,
        }
    }
}

impl Default for FairShareConfig {
    fn default() -> Self {
        Self {
            half_life: Duration::from_secs(60),
        }
    }
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            url: String::new(),
            events: WebhookEvent::DEFAULTS.to_vec(),
            allowed_hosts: Vec::new(),
        }
    }
}

impl WebhooksConfig {
    /// Whether `event` should be delivered.
    pub fn wants(&self, event: WebhookEvent) -> bool {
        self.enabled && self.events.contains(&event)
    }
}

impl AuthConfig {
    /// The key of a client id.
    pub fn key(&self, client_id: &str) -> Option<&KeyConfig> {
        self.keys.iter().find(|key| key.client_id == client_id)
    }
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        Self {
            max_failures: 10,
            window_seconds: 60,
        }
    }
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self {
            level: LogLevel::Info,
            format: LogFormat::Text,
            requests: None,
        }
    }
}

impl InjectionListener {
    pub const DEFAULT_BIND: &'static str = "127.0.0.1";
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            strategy: RoutingStrategy::RoundRobin,
            fallback: RoutingFallback::AnyHealthy,
            model_poll_timeout: Duration::from_secs(3),
            require_host_at_start: false,
            acquire_timeout: Duration::from_secs(5),
            affinity: AffinityConfig::default(),
        }
    }
}

impl Default for EmbeddingCacheConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            backend: CacheBackend::Memory,
            ttl: Duration::from_secs(86_400),
            max_entry_bytes: 32_768,
            key_prefix: "oqp:embed:".to_string(),
            connect_timeout: Duration::from_secs(2),
            max_memory_mb: 256,
            per_client: false,
            max_inputs: 2048,
        }
    }
}

impl std::fmt::Debug for CacheBackend {
    // A Redis URL may carry a password (`redis://:pw@host`); print it without the user info.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheBackend::Memory => f.write_str("Memory"),
            CacheBackend::Redis(url) => {
                f.debug_tuple("Redis").field(&redact_userinfo(url)).finish()
            }
        }
    }
}

impl Default for KeepAliveConfig {
    fn default() -> Self {
        Self {
            default_json: "\"5m\"".to_string(),
            override_client: false,
            max: Duration::from_secs(30 * 60),
        }
    }
}

impl Default for DashboardConfig {
    /// The default of the default listener (`127.0.0.1`): on. Off by default when the proxy
    /// listens beyond loopback (`resolve::dashboard`).
    fn default() -> Self {
        Self {
            enabled: true,
            refresh_seconds: 5,
        }
    }
}

impl Default for ControlPlaneConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50051".to_string(),
            node_token: None,
            state_dir: PathBuf::from("./oqp-state"),
            tls: None,
            audit: AuditConfig::default(),
        }
    }
}

/// `scheme://user:pw@host/…` → `scheme://…@host/…`.
fn redact_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://…{}", &rest[at..]),
        None => url.to_string(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn tier_defaults_are_per_tier() {
        let queue = QueueConfig::default();
        assert_eq!(queue.tier(Tier::High).max_depth, 50);
        assert_eq!(queue.tier(Tier::Normal).max_wait, Duration::from_secs(300));
        assert_eq!(queue.tier(Tier::Low).max_depth, 200);
        assert_eq!(queue.max_queued_bytes(), 512 * 1024 * 1024);
    }

    #[test]
    fn redis_password_is_not_debug_printed() {
        let backend = CacheBackend::Redis("redis://:hunter2@valkey:6379/0".to_string());
        let printed = format!("{backend:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
        assert_eq!(printed, "Redis(\"redis://…@valkey:6379/0\")");
        let plain = CacheBackend::Redis("redis://valkey:6379/0".to_string());
        assert_eq!(format!("{plain:?}"), "Redis(\"redis://valkey:6379/0\")");
    }
}
