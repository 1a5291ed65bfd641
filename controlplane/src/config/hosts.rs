//! The `ollama` section: upstream hosts, their kinds and cloud key pools.

use std::collections::BTreeMap;
use std::time::Duration;

use super::enums::{HostKind, parse_word};
use super::env::Env;
use super::error::Problems;
use super::field::{DAY, checked, duration_within, ranged};
use super::keys;
use super::net::{self, UrlError};
use super::scalar::Bytes;
use super::scalar::Int;
use super::schema::{RawHost, RawOllama};
use super::types::{HostConfig, OllamaConfig};

/// Resolves `ollama`. `hosts` is `None` when an entry failed to parse; `proxy_max` is
/// `proxy.max_concurrent`, the default of each host's `max_concurrent`.
pub(crate) fn ollama(
    raw: RawOllama,
    hosts: Option<&[RawHost]>,
    hosts_given: bool,
    proxy_max: u32,
    env: &Env,
    problems: &mut Problems,
) -> Option<OllamaConfig> {
    if raw.health_check_interval.is_some() {
        problems.warn(
            "config.deprecated key=ollama.health_check_interval — superseded by \
             ollama.hosts[].model_sync_interval; it has no effect and can be removed",
        );
    }
    let request_timeout = duration_within(
        raw.request_timeout,
        OllamaConfig::DEFAULT_REQUEST_TIMEOUT,
        Duration::from_nanos(1),
        DAY,
        "ollama.request_timeout",
        problems,
    );
    // A non-streamed generation's head comes with its whole answer: its own bound.
    let non_streamed_timeout = duration_within(
        raw.non_streamed_timeout,
        request_timeout,
        Duration::from_nanos(1),
        DAY,
        "ollama.non_streamed_timeout",
        problems,
    );
    let hosts = hosts?;
    if !hosts_given || hosts.is_empty() {
        problems.error(
            "ollama.hosts is required: list at least one upstream, e.g. \
             hosts: [{url: \"http://127.0.0.1:11434\", name: local}]",
        );
        return None;
    }
    checked(problems, |problems| {
        let hosts: Vec<HostConfig> = hosts
            .iter()
            .enumerate()
            .filter_map(|(index, raw)| host(index, raw, proxy_max, env, problems))
            .collect();
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        for (index, host) in hosts.iter().enumerate() {
            if let Some(first) = names.insert(&host.name, index) {
                problems.error(format!(
                    "ollama.hosts: duplicate name '{}' (entries {first} and {index}); every host \
                     needs a unique name",
                    host.name
                ));
            }
        }
        OllamaConfig {
            hosts,
            request_timeout,
            non_streamed_timeout,
        }
    })
}

fn host(
    index: usize,
    raw: &RawHost,
    proxy_max: u32,
    env: &Env,
    problems: &mut Problems,
) -> Option<HostConfig> {
    let path = format!("ollama.hosts[{index}]");
    checked(problems, |problems| {
        let name = raw.name.0.trim().to_string();
        if name.is_empty() {
            problems.error(format!("{path}.name must not be empty"));
        }
        let url = match net::parse_http_url(&raw.url.0) {
            Ok(url) => {
                if url.has_query_or_fragment {
                    problems.error(format!(
                        "{path}.url must not contain a query or fragment (request paths are appended to it)"
                    ));
                }
                if url.has_userinfo {
                    problems.error(format!(
                        "{path}.url must not contain credentials (user:password@); for Ollama \
                         Cloud use api_keys"
                    ));
                }
                Some(url)
            }
            Err(error) => {
                let reason = match error {
                    UrlError::Scheme(scheme) if scheme.is_empty() => {
                        "must start with http:// or https://".to_string()
                    }
                    UrlError::Scheme(scheme) => {
                        format!("must start with http:// or https://, got scheme '{scheme}'")
                    }
                    UrlError::NoHost => "has no host name".to_string(),
                    UrlError::Invalid(reason) => format!("is not a valid URL: {reason}"),
                };
                problems.error(format!("{path}.url {reason}"));
                None
            }
        };
        let kind = match raw.kind.as_ref() {
            Some(kind) => {
                parse_word(&kind.0, &format!("{path}.kind"), problems).unwrap_or(HostKind::Ollama)
            }
            None if url.as_ref().is_some_and(|url| is_ollama_cloud(&url.host)) => HostKind::Cloud,
            None => HostKind::Ollama,
        };
        let api_keys = match (kind, raw.api_keys.as_deref()) {
            (HostKind::Ollama | HostKind::Openai | HostKind::Auto, Some([_, ..])) => {
                problems.error(format!(
                    "{path}.api_keys is only allowed on cloud hosts (kind: cloud)"
                ));
                Vec::new()
            }
            (HostKind::Ollama | HostKind::Openai | HostKind::Auto, _) => Vec::new(),
            (HostKind::Cloud, keys) => {
                let pool = keys::resolve_cloud_pool(&name, keys.unwrap_or_default(), env, problems)
                    .unwrap_or_default();
                if pool.is_empty() {
                    problems.warn(format!(
                        "{path} (name '{name}') is a cloud host without API keys: set api_keys, \
                         OLLAMA_API_KEY or OLLAMA_API_KEYS"
                    ));
                }
                pool
            }
        };
        let fallback_models: Vec<String> = raw
            .fallback_models
            .iter()
            .flatten()
            .map(|model| model.0.trim().to_string())
            .collect();
        if fallback_models.iter().any(String::is_empty) {
            problems.error(format!(
                "{path}.fallback_models must not contain empty names"
            ));
        }
        // Checked against `nodes` with the other sections (`cluster::ownership`).
        let node = raw.node.as_ref().map(|node| node.0.trim().to_string());
        let vram = raw
            .vram
            .and_then(|bytes| vram(bytes, kind, &path, problems));
        let slots = |value: Option<Int>, default: u32, at: &str, problems: &mut Problems| {
            ranged(value, default, 1..=i64::from(u32::MAX), problems, |n| {
                format!("{at} must be >= 1, got {n}")
            })
        };
        let max_concurrent = slots(
            raw.max_concurrent,
            proxy_max,
            &format!("{path}.max_concurrent"),
            problems,
        );
        let num_parallel = slots(
            raw.num_parallel,
            max_concurrent,
            &format!("{path}.num_parallel"),
            problems,
        );
        let runner_overrides: Vec<(String, u32)> = raw
            .models
            .iter()
            .flatten()
            .map(|(pattern, model)| {
                let at = format!("{path}.models.\"{pattern}\".num_parallel");
                if pattern.trim().is_empty() {
                    problems.error(format!("{path}.models has an empty model pattern"));
                }
                let n = slots(model.num_parallel, num_parallel, &at, problems);
                (pattern.trim().to_owned(), n)
            })
            .collect();
        HostConfig {
            url: url.map(|url| url.normalized).unwrap_or_default(),
            name,
            weight: ranged(
                raw.weight,
                HostConfig::DEFAULT_WEIGHT,
                1..=i64::from(u32::MAX),
                problems,
                |n| format!("{path}.weight must be a positive integer, got {n}"),
            ),
            model_sync_interval: duration_within(
                raw.model_sync_interval,
                HostConfig::DEFAULT_MODEL_SYNC_INTERVAL,
                Duration::from_secs(1),
                DAY,
                &format!("{path}.model_sync_interval"),
                problems,
            ),
            max_concurrent,
            kind,
            api_keys,
            fallback_models,
            node,
            vram,
            num_parallel,
            runner_overrides,
        }
    })
}

/// The smallest and largest `vram` accepted: 1 MiB and 1 PiB.
const VRAM_RANGE: std::ops::RangeInclusive<u64> = (1 << 20)..=(1 << 50);

/// `ollama.hosts[].vram`, checked; `None` (learned) when out of range or on a cloud host.
fn vram(Bytes(bytes): Bytes, kind: HostKind, path: &str, problems: &mut Problems) -> Option<u64> {
    if bytes == 0 {
        problems.error(format!(
            "{path}.vram must be > 0 (omit it to learn the capacity from what is seen resident)"
        ));
        return None;
    }
    if !VRAM_RANGE.contains(&bytes) {
        problems.error(format!(
            "{path}.vram must be between 1 MiB and 1 PiB, got {bytes} bytes"
        ));
        return None;
    }
    if kind == HostKind::Cloud {
        problems.warn(format!(
            "{path}.vram has no effect on a cloud host (its models are not loaded here)"
        ));
        return None;
    }
    Some(bytes)
}

/// Whether a URL host is Ollama Cloud (`ollama.com` or a subdomain of it).
fn is_ollama_cloud(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "ollama.com" || host.ends_with(".ollama.com")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn cloud_detection() {
        assert!(is_ollama_cloud("ollama.com"));
        assert!(is_ollama_cloud("OLLAMA.COM."));
        assert!(is_ollama_cloud("api.ollama.com"));
        assert!(!is_ollama_cloud("notollama.com"));
        assert!(!is_ollama_cloud("ollama"));
    }
}
