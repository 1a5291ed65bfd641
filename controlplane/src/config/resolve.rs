//! Raw sections → resolved sections: defaults filled in, ranges checked, words parsed.
//!
//! Each function handles one section, records every problem it finds and returns `None` if any
//! was an error. Checks that span sections live in `validate.rs`, the hosts in `hosts.rs`, the
//! control plane and node overrides in `cluster.rs`.

use std::ops::RangeInclusive;
use std::time::Duration;

use super::enums::{LogLevel, Tier, Vocabulary, WebhookEvent, parse_word};
use super::env::Env;
use super::error::Problems;
use super::keys;
use super::net::{self, UrlError};
use super::scalar::{self, Flag, Int, KeepAliveValue, Seconds, Text};
use super::schema::{
    RawAuth, RawCache, RawDashboard, RawKeepAlive, RawKey, RawLogging, RawProxy, RawQueue,
    RawRouting, RawTier, RawWebhooks,
};
use super::types::{
    AuthConfig, CacheBackend, DashboardConfig, EmbeddingCacheConfig, FairShareConfig,
    KeepAliveConfig, LoggingConfig, ProxyConfig, QueueConfig, RateLimitConfig, RoutingConfig,
    TierConfig, WebhooksConfig,
};

/// Runs `check` and returns its value only if it recorded no error.
pub(crate) fn checked<T>(
    problems: &mut Problems,
    check: impl FnOnce(&mut Problems) -> T,
) -> Option<T> {
    let before = problems.error_count();
    let value = check(problems);
    (problems.error_count() == before).then_some(value)
}

/// An integer within `range`, or `default` when absent; `message(n)` describes a violation.
pub(crate) fn ranged<T: TryFrom<i64>>(
    value: Option<Int>,
    default: T,
    range: RangeInclusive<i64>,
    problems: &mut Problems,
    message: impl FnOnce(i64) -> String,
) -> T {
    let Some(Int(value)) = value else {
        return default;
    };
    match T::try_from(value) {
        Ok(converted) if range.contains(&value) => converted,
        _ => {
            problems.error(message(value));
            default
        }
    }
}

/// An integer of at least `min` (and within `T`), or `default` when absent.
pub(crate) fn at_least<T: TryFrom<i64>>(
    value: Option<Int>,
    default: T,
    min: i64,
    path: &str,
    problems: &mut Problems,
) -> T {
    ranged(value, default, min..=i64::MAX, problems, |n| {
        format!("{path} must be >= {min}, got {n}")
    })
}

/// A duration of at least `min`, or `default` when absent.
pub(crate) fn duration_at_least(
    value: Option<Seconds>,
    default: Duration,
    min: Duration,
    path: &str,
    problems: &mut Problems,
) -> Duration {
    let Some(Seconds(value)) = value else {
        return default;
    };
    if value < min {
        let bound = if min == Duration::from_secs(1) {
            ">= 1 second".to_string()
        } else if min <= Duration::from_nanos(1) {
            "> 0".to_string()
        } else {
            format!(">= {}", scalar::show(min))
        };
        problems.error(format!(
            "{path} must be {bound}, got {}",
            scalar::show(value)
        ));
    }
    value
}

/// A config word (`round_robin`, `json`, …), or `default` when absent.
pub(crate) fn word_or<T: Vocabulary>(
    value: Option<&Text>,
    default: T,
    path: &str,
    problems: &mut Problems,
) -> T {
    value
        .and_then(|text| parse_word(&text.0, path, problems))
        .unwrap_or(default)
}

pub(crate) fn flag(value: Option<Flag>, default: bool) -> bool {
    value.map_or(default, |flag| flag.0)
}

/// Trimmed text, or `default` when absent.
pub(crate) fn text(value: Option<Text>, default: &str) -> String {
    value.map_or_else(|| default.to_string(), |text| text.0.trim().to_string())
}

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
            drain_timeout: raw.drain_timeout.map_or(defaults.drain_timeout, |s| s.0),
            max_request_body_mb: at_least(
                raw.max_request_body_mb,
                defaults.max_request_body_mb,
                1,
                "proxy.max_request_body_mb",
                problems,
            ),
        }
    })
}

pub(crate) fn queue(raw: RawQueue, problems: &mut Problems) -> Option<QueueConfig> {
    let defaults = QueueConfig::default();
    checked(problems, |problems| QueueConfig {
        high: tier(raw.high, Tier::High, problems),
        normal: tier(raw.normal, Tier::Normal, problems),
        low: tier(raw.low, Tier::Low, problems),
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
        max_queued_mb: at_least(
            raw.max_queued_mb,
            defaults.max_queued_mb,
            1,
            "queue.max_queued_mb",
            problems,
        ),
        fair_share: FairShareConfig {
            half_life: duration_at_least(
                raw.fair_share.and_then(|f| f.half_life),
                defaults.fair_share.half_life,
                Duration::from_nanos(1),
                "queue.fair_share.half_life",
                problems,
            ),
        },
    })
}

/// A tier block; every key it leaves out takes this tier's own default.
fn tier(raw: Option<RawTier>, tier: Tier, problems: &mut Problems) -> TierConfig {
    let raw = raw.unwrap_or_default();
    let defaults = TierConfig::default_for(tier);
    let path = format!("queue.{tier}");
    let max_wait = duration_at_least(
        raw.max_wait,
        defaults.max_wait,
        Duration::from_nanos(1),
        &format!("{path}.max_wait"),
        problems,
    );
    let promote_after = raw.promote_after.map(|Seconds(after)| {
        if after.is_zero() {
            problems.error(format!("{path}.promote_after must be > 0 (omit it to never promote)"));
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
        AuthConfig {
            enabled,
            keys,
            rate_limit: RateLimitConfig {
                max_failures: at_least(
                    rate_limit.max_failures,
                    defaults.max_failures,
                    1,
                    "auth.rate_limit.max_failures",
                    problems,
                ),
                window_seconds: at_least(
                    rate_limit.window_seconds,
                    defaults.window_seconds,
                    1,
                    "auth.rate_limit.window_seconds",
                    problems,
                ),
            },
        }
    })
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
        model_poll_timeout: duration_at_least(
            raw.model_poll_timeout,
            defaults.model_poll_timeout,
            Duration::from_nanos(1),
            "routing.model_poll_timeout",
            problems,
        ),
        require_host_at_start: flag(raw.require_host_at_start, defaults.require_host_at_start),
        acquire_timeout: raw
            .acquire_timeout
            .map_or(defaults.acquire_timeout, |s| s.0),
    })
}

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
        ttl: duration_at_least(
            raw.ttl,
            defaults.ttl,
            Duration::from_secs(1),
            "embedding_cache.ttl",
            problems,
        ),
        max_entry_bytes: at_least(
            raw.max_entry_bytes,
            defaults.max_entry_bytes,
            1,
            "embedding_cache.max_entry_bytes",
            problems,
        ),
        key_prefix: raw
            .key_prefix
            .map_or(defaults.key_prefix.clone(), |text| text.0),
        connect_timeout: duration_at_least(
            raw.connect_timeout,
            defaults.connect_timeout,
            Duration::from_nanos(1),
            "embedding_cache.connect_timeout",
            problems,
        ),
        max_memory_mb: at_least(
            raw.max_memory_mb,
            defaults.max_memory_mb,
            1,
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
    })
}

pub(crate) fn dashboard(raw: RawDashboard, problems: &mut Problems) -> Option<DashboardConfig> {
    let defaults = DashboardConfig::default();
    checked(problems, |problems| DashboardConfig {
        enabled: flag(raw.enabled, defaults.enabled),
        refresh_seconds: ranged(
            raw.refresh_seconds,
            defaults.refresh_seconds,
            1..=i64::from(u32::MAX),
            problems,
            |n| format!("dashboard.refresh_seconds must be >= 1 second, got {n}"),
        ),
    })
}
