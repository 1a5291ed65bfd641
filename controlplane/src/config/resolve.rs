//! Raw sections → resolved sections: defaults filled in, ranges checked, words parsed.
//!
//! Each function handles one section, records every problem it finds and returns `None` if any
//! was an error. Checks that span sections live in `validate.rs`, the hosts in `hosts.rs`, the
//! control plane and node overrides in `cluster.rs`.

use std::path::PathBuf;
use std::time::Duration;

use super::enums::{LogLevel, Tier, Vocabulary, WebhookEvent, parse_word};
use super::env::Env;
use super::error::Problems;
use super::field::{
    DAY, at_least, checked, duration_at_least, duration_within, flag, megabytes, ranged, text,
    word_or,
};
use super::keys;
use super::net::{self, UrlError};
use super::scalar::{self, Float, Int, KeepAliveValue, PerTier, Seconds, Text};
use super::schema::{
    RawAffinity, RawAuth, RawCache, RawDashboard, RawKeepAlive, RawKey, RawListenerTls, RawLogging,
    RawModelSwap, RawProxy, RawQueue, RawRequestLog, RawRouting, RawTier, RawWebhooks,
};
use super::types::{
    AffinityConfig, AuthConfig, CacheBackend, DashboardConfig, EmbeddingCacheConfig,
    FairShareConfig, KeepAliveConfig, ListenerTls, LoggingConfig, MetadataRateLimitConfig,
    ModelSwapConfig, ProxyConfig, QueueConfig, RateLimitConfig, RequestLogConfig, RoutingConfig,
    TierConfig, WebhooksConfig,
};

pub(crate) fn proxy(raw: RawProxy, problems: &mut Problems) -> Option<ProxyConfig> {
    let defaults = ProxyConfig::default();
    checked(problems, |problems| {
        let host = text(raw.host, &defaults.host);
        if !net::is_host(&host) {
            problems.error(format!(
                "proxy.host: '{host}' is not an IP address or host name"
            ));
        }
        ProxyConfig {
            host,
            port: ranged(raw.port, defaults.port, 1..=65535, problems, |n| {
                format!("proxy.port: invalid port {n} (must be 1-65535)")
            }),
            max_concurrent: at_least(
                raw.max_concurrent,
                defaults.max_concurrent,
                1,
                "proxy.max_concurrent",
                problems,
            ),
            allow_model_management: flag(
                raw.allow_model_management,
                defaults.allow_model_management,
            ),
            drain_timeout: duration_within(
                raw.drain_timeout,
                defaults.drain_timeout,
                Duration::ZERO,
                DAY,
                "proxy.drain_timeout",
                problems,
            ),
            max_request_body_mb: megabytes(
                raw.max_request_body_mb,
                defaults.max_request_body_mb,
                "proxy.max_request_body_mb",
                problems,
            ),
            max_connections: at_least(
                raw.max_connections,
                defaults.max_connections,
                1,
                "proxy.max_connections",
                problems,
            ),
            max_connections_per_ip: at_least(
                raw.max_connections_per_ip,
                defaults.max_connections_per_ip,
                1,
                "proxy.max_connections_per_ip",
                problems,
            ),
            first_request_timeout: connection_timeout(
                raw.first_request_timeout,
                defaults.first_request_timeout,
                "proxy.first_request_timeout",
                problems,
            ),
            idle_timeout: connection_timeout(
                raw.idle_timeout,
                defaults.idle_timeout,
                "proxy.idle_timeout",
                problems,
            ),
            body_read_timeout: connection_timeout(
                raw.body_read_timeout,
                defaults.body_read_timeout,
                "proxy.body_read_timeout",
                problems,
            ),
            upstream_stall_timeout: connection_timeout(
                raw.upstream_stall_timeout,
                defaults.upstream_stall_timeout,
                "proxy.upstream_stall_timeout",
                problems,
            ),
            client_stall_timeout: connection_timeout(
                raw.client_stall_timeout,
                defaults.client_stall_timeout,
                "proxy.client_stall_timeout",
                problems,
            ),
            tls: raw.tls.and_then(|raw| tls(raw, "proxy.tls", problems)),
        }
    })
}

/// A listener's `tls` section: both files, each an absolute path (they are read on the data
/// plane's box, whose working directory the control plane does not know).
pub(crate) fn tls(raw: RawListenerTls, path: &str, problems: &mut Problems) -> Option<ListenerTls> {
    let mut file = |value: Option<Text>, key: &str| match value {
        Some(Text(value)) if std::path::Path::new(value.trim()).is_absolute() => {
            Some(PathBuf::from(value.trim()))
        }
        Some(Text(value)) => {
            problems.error(format!(
                "{path}.{key}: '{value}' is not an absolute path (the data plane reads it on its own box)"
            ));
            None
        }
        None => {
            problems.error(format!(
                "{path} needs cert_file and key_file (absolute paths of PEM files)"
            ));
            None
        }
    };
    let cert_file = file(raw.cert_file, "cert_file");
    let key_file = file(raw.key_file, "key_file");
    let client_ca_file = match raw.client_ca_file {
        None => None,
        Some(value) => Some(file(Some(value), "client_ca_file")?),
    };
    Some(ListenerTls {
        cert_file: cert_file?,
        key_file: key_file?,
        client_ca_file,
    })
}

/// A connection or body timeout: above zero and at most a day (a longer one
/// would leave a stuck connection open for good).
fn connection_timeout(
    value: Option<Seconds>,
    default: Duration,
    path: &str,
    problems: &mut Problems,
) -> Duration {
    let duration = duration_at_least(value, default, Duration::from_millis(1), path, problems);
    let most = Duration::from_secs(24 * 60 * 60);
    if duration > most {
        problems.error(format!(
            "{path} must be <= 24h, got {}",
            scalar::show(duration)
        ));
        return default;
    }
    duration
}

pub(crate) fn queue(raw: RawQueue, problems: &mut Problems) -> Option<QueueConfig> {
    let defaults = QueueConfig::default();
    checked(problems, |problems| {
        let high = tier(raw.high, Tier::High, problems);
        let normal = tier(raw.normal, Tier::Normal, problems);
        let low = tier(raw.low, Tier::Low, problems);
        let model_swap = model_swap(
            raw.model_swap.unwrap_or_default(),
            [high.max_wait, normal.max_wait, low.max_wait],
            problems,
        );
        QueueConfig {
            high,
            normal,
            low,
            overflow_status_code: match raw.overflow_status_code {
                None => defaults.overflow_status_code,
                Some(Int(code @ (429 | 503))) => code as u16,
                Some(Int(code)) => {
                    problems.error(format!(
                        "queue.overflow_status_code must be 503 or 429, got {code}"
                    ));
                    defaults.overflow_status_code
                }
            },
            max_queued_mb: megabytes(
                raw.max_queued_mb,
                defaults.max_queued_mb,
                "queue.max_queued_mb",
                problems,
            ),
            fair_share: FairShareConfig {
                half_life: duration_within(
                    raw.fair_share.and_then(|f| f.half_life),
                    defaults.fair_share.half_life,
                    Duration::from_nanos(1),
                    30 * DAY,
                    "queue.fair_share.half_life",
                    problems,
                ),
            },
            model_swap,
        }
    })
}

/// `queue.model_swap`; `max_wait` holds each tier's (high, normal, low), which bounds its
/// `max_defer` from above: a request held that long would expire instead of being served. A
/// tier's default is lowered to half its `max_wait` when it is not below that.
fn model_swap(
    raw: RawModelSwap,
    max_wait: [Duration; 3],
    problems: &mut Problems,
) -> ModelSwapConfig {
    let defaults = ModelSwapConfig::default();
    let given: [Option<Seconds>; 3] = match raw.max_defer {
        None => [None; 3],
        Some(PerTier::All(all)) => [Some(all); 3],
        Some(PerTier::Each { high, normal, low }) => [high, normal, low],
    };
    let single = matches!(raw.max_defer, Some(PerTier::All(_)));
    let mut max_defer = defaults.max_defer;
    for tier in Tier::ALL.iter().copied() {
        let index = ModelSwapConfig::index(tier);
        let Some(Seconds(value)) = given[index] else {
            // A default never outlasts a short max_wait: held that long, a request would
            // expire instead of being served.
            max_defer[index] = max_defer[index].min(max_wait[index] / 2);
            continue;
        };
        let path = if single {
            "queue.model_swap.max_defer".to_string()
        } else {
            format!("queue.model_swap.max_defer.{tier}")
        };
        if value.is_zero() {
            if single && tier != Tier::High {
                continue; // One value, one error.
            }
            problems.error(format!(
                "{path} must be > 0 (set queue.model_swap.enabled: false to never hold requests back)"
            ));
        } else if value >= max_wait[index] {
            problems.error(format!(
                "{path} ({}) must be below queue.{tier}.max_wait ({}): a request held that long \
                 would expire",
                scalar::show(value),
                scalar::show(max_wait[index])
            ));
        } else {
            max_defer[index] = value;
        }
    }
    ModelSwapConfig {
        enabled: flag(raw.enabled, defaults.enabled),
        max_defer,
        idle_grace: duration_within(
            raw.idle_grace,
            defaults.idle_grace,
            Duration::ZERO,
            ModelSwapConfig::MAX_IDLE_GRACE,
            "queue.model_swap.idle_grace",
            problems,
        ),
        unload: flag(raw.unload, defaults.unload),
    }
}

/// A tier block; every key it leaves out takes this tier's own default.
fn tier(raw: Option<RawTier>, tier: Tier, problems: &mut Problems) -> TierConfig {
    let raw = raw.unwrap_or_default();
    let defaults = TierConfig::default_for(tier);
    let path = format!("queue.{tier}");
    let max_wait = duration_within(
        raw.max_wait,
        defaults.max_wait,
        Duration::from_nanos(1),
        DAY,
        &format!("{path}.max_wait"),
        problems,
    );
    let promote_after = raw.promote_after.map(|Seconds(after)| {
        if after.is_zero() {
            problems.error(format!("{path}.promote_after must be > 0 (omit it to never promote)"));
        } else if after > DAY {
            problems.error(format!(
                "{path}.promote_after must be at most {}, got {}",
                scalar::show(DAY),
                scalar::show(after)
            ));
        } else if tier == Tier::High {
            problems.warn(format!("{path}.promote_after has no effect: there is no tier above high"));
        } else if after >= max_wait {
            problems.warn(format!(
                "{path}.promote_after ({}) is not below max_wait ({}): requests expire before they are promoted",
                scalar::show(after),
                scalar::show(max_wait)
            ));
        }
        after
    });
    TierConfig {
        max_depth: ranged(
            raw.max_depth,
            defaults.max_depth,
            0..=i64::from(u32::MAX),
            problems,
            |n| {
                format!(
                    "{path}.max_depth must be a non-negative integer (0 = never queue), got {n}"
                )
            },
        ),
        max_wait,
        high_watermark_pct: ranged(
            raw.high_watermark_pct,
            defaults.high_watermark_pct,
            1..=100,
            problems,
            |n| format!("{path}.high_watermark_pct must be in 1..=100, got {n}"),
        ),
        promote_after,
    }
}

pub(crate) fn webhooks(raw: RawWebhooks, problems: &mut Problems) -> Option<WebhooksConfig> {
    checked(problems, |problems| {
        let url = text(raw.url, "");
        let mut enabled = flag(raw.enabled, false);
        let mut events = Vec::new();
        match raw.events {
            None => events.extend_from_slice(WebhookEvent::DEFAULTS),
            Some(names) => {
                for (index, name) in names.iter().enumerate() {
                    let path = format!("webhooks.events[{index}]");
                    if let Some(event) = parse_word::<WebhookEvent>(&name.0, &path, problems)
                        && !events.contains(&event)
                    {
                        events.push(event);
                    }
                }
            }
        }
        if enabled && url.is_empty() {
            problems.warn(
                "webhooks.enabled is true but webhooks.url is empty: no webhook will be sent",
            );
            enabled = false;
        }
        if enabled {
            match net::parse_http_url(&url) {
                Ok(_) => {}
                Err(UrlError::Scheme(scheme)) => problems.error(format!(
                    "webhooks.url: Webhook URL must use http or https scheme, got: '{scheme}'"
                )),
                Err(UrlError::NoHost) => {
                    problems.error("webhooks.url: Webhook URL has no hostname")
                }
                Err(UrlError::Invalid(reason)) => problems.error(format!("webhooks.url: {reason}")),
            }
        }
        WebhooksConfig {
            enabled,
            url,
            events,
            allowed_hosts: raw
                .allowed_hosts
                .unwrap_or_default()
                .into_iter()
                .map(|host| host.0.trim().to_string())
                .filter(|host| !host.is_empty())
                .collect(),
        }
    })
}

/// `auth`, with its keys resolved. `keys` is `None` when an entry failed to parse.
pub(crate) fn auth(
    raw: RawAuth,
    keys: Option<&[RawKey]>,
    proxy_max: Option<u32>,
    env: &Env,
    problems: &mut Problems,
) -> Option<AuthConfig> {
    let defaults = RateLimitConfig::default();
    let enabled = flag(raw.enabled, false);
    let keys = keys::resolve_auth_keys(keys?, proxy_max, env, problems)?;
    checked(problems, |problems| {
        if enabled && keys.is_empty() {
            problems.error(
                "auth.enabled is true but no API keys are configured. Add at least one key to \
                 auth.keys or set auth.enabled: false.",
            );
        }
        let rate_limit = raw.rate_limit.unwrap_or_default();
        let metadata = raw.metadata_rate_limit.unwrap_or_default();
        let metadata_defaults = MetadataRateLimitConfig::default();
        let metadata_rate_limit = MetadataRateLimitConfig {
            per_second: ranged(
                metadata.per_second,
                metadata_defaults.per_second,
                0..=100_000,
                problems,
                |n| {
                    format!(
                        "auth.metadata_rate_limit.per_second must be between 0 (no limit) and \
                         100000, got {n}"
                    )
                },
            ),
            burst: ranged(
                metadata.burst,
                metadata_defaults.burst,
                1..=1_000_000,
                problems,
                |n| {
                    format!("auth.metadata_rate_limit.burst must be between 1 and 1000000, got {n}")
                },
            ),
        };
        let trusted_proxies = trusted_proxies(raw.trusted_proxies.unwrap_or_default(), problems);
        let default_rate_limit = raw.default_rate_limit.as_ref().and_then(|limit| {
            keys::resolve_minute_limit(limit, "auth.default_rate_limit", problems)
        });
        AuthConfig {
            enabled,
            default_rate_limit,
            keys,
            trusted_proxies,
            metadata_rate_limit,
            rate_limit: RateLimitConfig {
                max_failures: at_least(
                    rate_limit.max_failures,
                    defaults.max_failures,
                    1,
                    "auth.rate_limit.max_failures",
                    problems,
                ),
                window_seconds: ranged(
                    rate_limit.window_seconds,
                    defaults.window_seconds,
                    1..=86_400,
                    problems,
                    |n| {
                        if n < 1 {
                            format!("auth.rate_limit.window_seconds must be >= 1, got {n}")
                        } else {
                            format!(
                                "auth.rate_limit.window_seconds must be at most 86400 (1 day), got {n}"
                            )
                        }
                    },
                ),
            },
        }
    })
}

/// Most entries in `auth.trusted_proxies`.
const MAX_TRUSTED_PROXIES: usize = 64;

/// `auth.trusted_proxies`: each entry an address or `address/prefix`, normalised to the
/// network's first address (`10.1.2.3/8` → `10.0.0.0/8`; a bare address gets /32 or /128).
fn trusted_proxies(raw: Vec<Text>, problems: &mut Problems) -> Vec<String> {
    if raw.len() > MAX_TRUSTED_PROXIES {
        problems.error(format!(
            "auth.trusted_proxies: at most {MAX_TRUSTED_PROXIES} entries (got {})",
            raw.len()
        ));
        return Vec::new();
    }
    let mut out = Vec::new();
    for (index, entry) in raw.iter().enumerate() {
        let text = entry.0.trim();
        match parse_cidr(text) {
            Some(cidr) if !out.contains(&cidr) => out.push(cidr),
            Some(_) => {}
            None => problems.error(format!(
                "auth.trusted_proxies[{index}]: '{text}' is not an IP address or CIDR \
                 (e.g. 10.0.0.0/8, 192.168.1.10, fd00::/8)"
            )),
        }
    }
    out
}

/// `address[/prefix]` → the normalised `network/prefix`, or `None`.
fn parse_cidr(text: &str) -> Option<String> {
    let (address, prefix) = match text.split_once('/') {
        Some((address, prefix)) => (address, Some(prefix)),
        None => (text, None),
    };
    let address: std::net::IpAddr = address.parse().ok()?;
    let bits: u32 = if address.is_ipv4() { 32 } else { 128 };
    let prefix: u32 = match prefix {
        Some(prefix) if !prefix.is_empty() && prefix.bytes().all(|b| b.is_ascii_digit()) => {
            prefix.parse().ok().filter(|p| *p <= bits)?
        }
        Some(_) => return None,
        None => bits,
    };
    let network = match address {
        std::net::IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
            std::net::IpAddr::from((u32::from(v4) & mask).to_be_bytes())
        }
        std::net::IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
            std::net::IpAddr::from((u128::from(v6) & mask).to_be_bytes())
        }
    };
    Some(format!("{network}/{prefix}"))
}

pub(crate) fn logging(raw: RawLogging, problems: &mut Problems) -> Option<LoggingConfig> {
    let defaults = LoggingConfig::default();
    checked(problems, |problems| LoggingConfig {
        level: match raw.level {
            None => defaults.level,
            Some(Text(level)) => LogLevel::parse_lenient(&level).unwrap_or_else(|| {
                problems.error(format!(
                    "logging.level: unknown value '{level}' (expected {})",
                    LogLevel::expected()
                ));
                defaults.level
            }),
        },
        format: word_or(
            raw.format.as_ref(),
            defaults.format,
            "logging.format",
            problems,
        ),
        requests: raw
            .requests
            .as_ref()
            .and_then(|requests| request_log(requests, problems)),
    })
}

/// `logging.requests`: a `file` (required) and `retention_days`.
fn request_log(raw: &RawRequestLog, problems: &mut Problems) -> Option<RequestLogConfig> {
    let file = raw
        .file
        .as_ref()
        .map(|file| file.0.trim().to_owned())
        .unwrap_or_default();
    if file.is_empty() {
        problems.error(
            "logging.requests.file is required (the request log's path, e.g. \
             /var/log/oqp/requests.jsonl); remove logging.requests to turn the log off",
        );
        return None;
    }
    let retention_days = match raw.retention_days.as_ref().map(|days| days.0) {
        None => RequestLogConfig::DEFAULT_RETENTION_DAYS,
        Some(days) => match u32::try_from(days) {
            Ok(days @ 1..=3650) => days,
            _ => {
                problems.error(format!(
                    "logging.requests.retention_days must be between 1 and 3650, got {days}"
                ));
                return None;
            }
        },
    };
    Some(RequestLogConfig {
        file,
        retention_days,
    })
}

pub(crate) fn routing(raw: RawRouting, problems: &mut Problems) -> Option<RoutingConfig> {
    let defaults = RoutingConfig::default();
    checked(problems, |problems| RoutingConfig {
        strategy: word_or(
            raw.strategy.as_ref(),
            defaults.strategy,
            "routing.strategy",
            problems,
        ),
        fallback: word_or(
            raw.fallback.as_ref(),
            defaults.fallback,
            "routing.fallback",
            problems,
        ),
        model_poll_timeout: duration_within(
            raw.model_poll_timeout,
            defaults.model_poll_timeout,
            Duration::from_nanos(1),
            Duration::from_secs(3_600),
            "routing.model_poll_timeout",
            problems,
        ),
        require_host_at_start: flag(raw.require_host_at_start, defaults.require_host_at_start),
        acquire_timeout: duration_within(
            raw.acquire_timeout,
            defaults.acquire_timeout,
            Duration::ZERO,
            DAY,
            "routing.acquire_timeout",
            problems,
        ),
        affinity: affinity(raw.affinity, problems),
    })
}

/// `routing.affinity`.
fn affinity(raw: RawAffinity, problems: &mut Problems) -> AffinityConfig {
    let defaults = AffinityConfig::default();
    let mut number = |value: Option<Float>, default: f64, key: &str, max: f64| match value {
        None => default,
        Some(Float(value)) if value.is_finite() && (0.0..=max).contains(&value) => value,
        Some(Float(value)) => {
            problems.error(format!(
                "routing.affinity.{key} must be a number from 0 to {max}, got {value}"
            ));
            default
        }
    };
    let epsilon = number(raw.epsilon, defaults.epsilon, "epsilon", 100.0);
    let prefill_ms_per_1k = number(
        raw.prefill_ms_per_1k,
        defaults.prefill_ms_per_1k,
        "prefill_ms_per_1k",
        1_000_000.0,
    );
    let session_header = raw.session_header.map(|text| text.0.trim().to_owned());
    if let Some(name) = &session_header
        && http::HeaderName::from_bytes(name.as_bytes()).is_err()
    {
        problems.error(format!(
            "routing.affinity.session_header '{name}' is not a header name"
        ));
    }
    AffinityConfig {
        enabled: flag(raw.enabled, defaults.enabled),
        session_header: session_header.filter(|name| !name.is_empty()),
        epsilon,
        share_across_keys: flag(raw.share_across_keys, defaults.share_across_keys),
        ram_cache_per_runner: ranged(
            raw.ram_cache_per_runner,
            defaults.ram_cache_per_runner,
            0..=1_024,
            problems,
            |value| format!("routing.affinity.ram_cache_per_runner must be 0 to 1024, got {value}"),
        ),
        prefill_ms_per_1k,
        max_conversations: ranged(
            raw.max_conversations,
            defaults.max_conversations,
            1..=10_000_000,
            problems,
            |value| {
                format!("routing.affinity.max_conversations must be 1 to 10000000, got {value}")
            },
        ),
    }
}

/// The largest `embedding_cache.max_entry_bytes` (1 GiB).
const MAX_ENTRY_BYTES: i64 = 1 << 30;

pub(crate) fn embedding_cache(
    raw: RawCache,
    problems: &mut Problems,
) -> Option<EmbeddingCacheConfig> {
    let defaults = EmbeddingCacheConfig::default();
    checked(problems, |problems| EmbeddingCacheConfig {
        enabled: flag(raw.enabled, defaults.enabled),
        backend: match raw.backend.map(|text| text.0.trim().to_string()) {
            None => defaults.backend.clone(),
            Some(backend) => cache_backend(&backend, problems),
        },
        // At most MAX_DURATION (a year), like every key without a tighter bound.
        ttl: duration_at_least(
            raw.ttl,
            defaults.ttl,
            Duration::from_secs(1),
            "embedding_cache.ttl",
            problems,
        ),
        max_entry_bytes: ranged(
            raw.max_entry_bytes,
            defaults.max_entry_bytes,
            1..=MAX_ENTRY_BYTES,
            problems,
            |n| {
                if n < 1 {
                    format!("embedding_cache.max_entry_bytes must be >= 1, got {n}")
                } else {
                    format!(
                        "embedding_cache.max_entry_bytes must be at most {MAX_ENTRY_BYTES} (1 GiB), got {n}"
                    )
                }
            },
        ),
        key_prefix: raw
            .key_prefix
            .map_or(defaults.key_prefix.clone(), |text| text.0),
        connect_timeout: duration_within(
            raw.connect_timeout,
            defaults.connect_timeout,
            Duration::from_nanos(1),
            Duration::from_secs(3_600),
            "embedding_cache.connect_timeout",
            problems,
        ),
        max_memory_mb: megabytes(
            raw.max_memory_mb,
            defaults.max_memory_mb,
            "embedding_cache.max_memory_mb",
            problems,
        ),
        per_client: flag(raw.per_client, defaults.per_client),
        max_inputs: ranged(
            raw.max_inputs,
            defaults.max_inputs,
            1..=MAX_EMBED_INPUTS,
            problems,
            |n| {
                format!(
                    "embedding_cache.max_inputs must be between 1 and {MAX_EMBED_INPUTS}, got {n}"
                )
            },
        ),
    })
}

/// The largest `embedding_cache.max_inputs`: past it one request's plan,
/// keys and flights alone take hundreds of megabytes.
const MAX_EMBED_INPUTS: i64 = 100_000;

fn cache_backend(backend: &str, problems: &mut Problems) -> CacheBackend {
    if backend.eq_ignore_ascii_case("memory") {
        return CacheBackend::Memory;
    }
    let scheme = backend
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("redis" | "rediss") if backend.len() > "rediss://".len() - 1 => {}
        // The value may carry a password: show the scheme only.
        Some(scheme) => problems.error(format!(
            "embedding_cache.backend must be memory or a redis:// or rediss:// URL, got a {scheme}:// URL"
        )),
        None => problems.error(
            "embedding_cache.backend must be memory or a redis:// or rediss:// URL (e.g. redis://localhost:6379/0)",
        ),
    }
    CacheBackend::Redis(backend.to_string())
}

pub(crate) fn keep_alive(raw: RawKeepAlive, problems: &mut Problems) -> Option<KeepAliveConfig> {
    let defaults = KeepAliveConfig::default();
    checked(problems, |problems| KeepAliveConfig {
        default_json: match raw.default {
            None => defaults.default_json.clone(),
            Some(KeepAliveValue::Int(seconds)) => seconds.to_string(),
            Some(KeepAliveValue::Float(seconds)) => serde_json::Number::from_f64(seconds)
                .map_or_else(|| "null".to_string(), |number| number.to_string()),
            Some(KeepAliveValue::Text(text)) => {
                if !scalar::is_go_duration(&text) {
                    problems.error(format!(
                        "keep_alive.default: '{text}' is not a duration Ollama accepts; use a unit \
                         (\"5m\", \"1h\", \"-1s\" = forever, \"0\" = unload at once) or a number of seconds"
                    ));
                }
                serde_json::Value::String(text).to_string()
            }
        },
        override_client: flag(raw.override_client, defaults.override_client),
        // Whole seconds on the wire; at least one, as a shorter keep_alive is an unload.
        max: Duration::from_secs(
            duration_at_least(
                raw.max,
                defaults.max,
                Duration::from_secs(1),
                "keep_alive.max",
                problems,
            )
            .as_secs(),
        ),
    })
}

/// `dashboard`. Unset, `enabled` follows where the proxy listens: on when only this machine
/// can reach it (`loopback`), off otherwise, so that turning the listener outward does not
/// also publish a page nobody asked for.
pub(crate) fn dashboard(
    raw: RawDashboard,
    loopback: bool,
    problems: &mut Problems,
) -> Option<DashboardConfig> {
    let defaults = DashboardConfig::default();
    checked(problems, |problems| DashboardConfig {
        enabled: flag(raw.enabled, loopback),
        refresh_seconds: ranged(
            raw.refresh_seconds,
            defaults.refresh_seconds,
            1..=86_400,
            problems,
            |n| {
                if n < 1 {
                    format!("dashboard.refresh_seconds must be >= 1 second, got {n}")
                } else {
                    format!("dashboard.refresh_seconds must be at most 86400 (1 day), got {n}")
                }
            },
        ),
    })
}

/// Whether a listener bound to `host` is reachable from this machine only.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.is_loopback())
}
