//! The raw file schema: what serde reads, before any resolution.
//!
//! Every field is optional here; defaults come from the public types' `Default` impls during
//! resolution, so a partially written block falls back to its *own* defaults. Sections are
//! deserialized one at a time and list items one by one, so one mistake does not hide the next:
//! each failure is recorded with its full key path, unknown keys become warnings with theirs.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_yaml::Value;

use super::error::Problems;
use super::scalar::{Bytes, Flag, Float, Int, KeepAliveValue, PerTier, Seconds, Text};

/// The top-level sections, in file order.
pub(crate) const SECTIONS: &[&str] = &[
    "proxy",
    "ollama",
    "queue",
    "webhooks",
    "auth",
    "logging",
    "client_injection",
    "routing",
    "embedding_cache",
    "keep_alive",
    "dashboard",
    "control_plane",
    "nodes",
    "cloud",
];

/// The file after schema parsing. `None` means the section failed (its errors are recorded);
/// a section absent from the file is `Some(default)`.
#[derive(Debug, Default)]
pub(crate) struct RawConfig {
    pub proxy: Option<RawProxy>,
    pub ollama: Option<RawOllama>,
    /// `ollama.hosts`: `None` if absent or if any item failed.
    pub hosts: Option<Vec<RawHost>>,
    /// Whether `ollama.hosts` was given at all.
    pub hosts_given: bool,
    pub queue: Option<RawQueue>,
    pub webhooks: Option<RawWebhooks>,
    pub auth: Option<RawAuth>,
    /// `auth.keys`: `None` if any item failed.
    pub keys: Option<Vec<RawKey>>,
    pub logging: Option<RawLogging>,
    pub client_injection: Option<RawInjection>,
    /// `client_injection.listeners`: `None` if any item failed.
    pub listeners: Option<Vec<RawListener>>,
    pub routing: Option<RawRouting>,
    pub embedding_cache: Option<RawCache>,
    pub keep_alive: Option<RawKeepAlive>,
    pub dashboard: Option<RawDashboard>,
    pub control_plane: Option<RawControlPlane>,
    pub nodes: Option<BTreeMap<String, RawNode>>,
    pub cloud: Option<super::cloud::RawCloud>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawProxy {
    pub host: Option<Text>,
    pub port: Option<Int>,
    pub max_concurrent: Option<Int>,
    pub allow_model_management: Option<Flag>,
    pub drain_timeout: Option<Seconds>,
    pub max_request_body_mb: Option<Int>,
    pub max_connections: Option<Int>,
    pub max_connections_per_ip: Option<Int>,
    pub first_request_timeout: Option<Seconds>,
    pub idle_timeout: Option<Seconds>,
    pub body_read_timeout: Option<Seconds>,
    pub upstream_stall_timeout: Option<Seconds>,
    pub client_stall_timeout: Option<Seconds>,
    pub tls: Option<RawListenerTls>,
}

/// `proxy.tls` and `client_injection.listeners[].tls`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawListenerTls {
    pub cert_file: Option<Text>,
    pub key_file: Option<Text>,
    pub client_ca_file: Option<Text>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawOllama {
    /// Items are parsed one by one into [`RawConfig::hosts`].
    pub hosts: Option<Value>,
    /// Deprecated and unused; any value is accepted and reported.
    pub health_check_interval: Option<Value>,
    pub request_timeout: Option<Seconds>,
    pub non_streamed_timeout: Option<Seconds>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "an entry of key: value pairs")]
pub(crate) struct RawHost {
    pub url: Text,
    pub name: Text,
    #[serde(default)]
    pub weight: Option<Int>,
    #[serde(default)]
    pub model_sync_interval: Option<Seconds>,
    #[serde(default)]
    pub max_concurrent: Option<Int>,
    #[serde(default)]
    pub kind: Option<Text>,
    #[serde(default)]
    pub api_keys: Option<Vec<RawCloudKey>>,
    #[serde(default)]
    pub fallback_models: Option<Vec<Text>>,
    #[serde(default)]
    pub node: Option<Text>,
    #[serde(default)]
    pub vram: Option<Bytes>,
    #[serde(default)]
    pub num_parallel: Option<Int>,
    /// `"<glob>": {num_parallel: N}`, read entry by entry.
    #[serde(default)]
    pub models: Option<std::collections::BTreeMap<String, RawHostModel>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawHostModel {
    pub num_parallel: Option<Int>,
}

/// A key given three possible ways; exactly one must be set.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawCloudKey {
    pub key: Option<Text>,
    pub key_env: Option<Text>,
    pub key_file: Option<Text>,
    pub account: Option<Text>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawQueue {
    pub high: Option<RawTier>,
    pub normal: Option<RawTier>,
    pub low: Option<RawTier>,
    pub overflow_status_code: Option<Int>,
    pub max_queued_mb: Option<Int>,
    pub fair_share: Option<RawFairShare>,
    pub model_swap: Option<RawModelSwap>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawModelSwap {
    pub enabled: Option<Flag>,
    pub max_defer: Option<PerTier>,
    pub idle_grace: Option<Seconds>,
    pub unload: Option<Flag>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawTier {
    pub max_depth: Option<Int>,
    pub max_wait: Option<Seconds>,
    pub high_watermark_pct: Option<Int>,
    pub promote_after: Option<Seconds>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawFairShare {
    pub half_life: Option<Seconds>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawWebhooks {
    pub enabled: Option<Flag>,
    pub url: Option<Text>,
    pub events: Option<Vec<Text>>,
    pub allowed_hosts: Option<Vec<Text>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawAuth {
    pub enabled: Option<Flag>,
    /// Items are parsed one by one into [`RawConfig::keys`].
    pub keys: Option<Value>,
    pub rate_limit: Option<RawRateLimit>,
    pub default_rate_limit: Option<RawMinuteLimit>,
    pub trusted_proxies: Option<Vec<Text>>,
    pub metadata_rate_limit: Option<RawMetadataRateLimit>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawMetadataRateLimit {
    pub per_second: Option<Int>,
    pub burst: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawRateLimit {
    pub max_failures: Option<Int>,
    pub window_seconds: Option<Int>,
}

/// `rate_limit` on a key or its `users`, and `auth.default_rate_limit`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawMinuteLimit {
    pub requests_per_minute: Option<Int>,
    pub tokens_per_minute: Option<Int>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "an entry of key: value pairs")]
pub(crate) struct RawKey {
    pub client_id: Text,
    #[serde(default)]
    pub key: Option<Text>,
    #[serde(default)]
    pub key_env: Option<Text>,
    #[serde(default)]
    pub key_file: Option<Text>,
    #[serde(default)]
    pub description: Option<Text>,
    #[serde(default)]
    pub scope: Option<Text>,
    #[serde(default)]
    pub management: Option<Flag>,
    #[serde(default)]
    pub max_priority: Option<Text>,
    #[serde(default)]
    pub default_priority: Option<Text>,
    #[serde(default)]
    pub max_concurrent: Option<Int>,
    #[serde(default)]
    pub weight: Option<Float>,
    #[serde(default)]
    pub max_queued: Option<Int>,
    #[serde(default)]
    pub expires: Option<Text>,
    #[serde(default)]
    pub budget: Option<RawBudget>,
    #[serde(default)]
    pub models: Option<Vec<Text>>,
    #[serde(default)]
    pub users: Option<RawUsers>,
    #[serde(default)]
    pub jwt: Option<RawJwt>,
    #[serde(default)]
    pub tls_subject: Option<Text>,
    #[serde(default)]
    pub rate_limit: Option<RawMinuteLimit>,
    #[serde(default)]
    pub capture: Option<RawCapture>,
}

/// `auth.keys[].capture`: request and answer bodies in the request log.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawCapture {
    pub max_bytes: Option<Int>,
}

/// `auth.keys[].jwt` and `auth.keys[].users.jwt`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawJwt {
    pub issuer: Option<Text>,
    pub audiences: Option<Vec<Text>>,
    pub jwks_url: Option<Text>,
    pub jwks_file: Option<Text>,
    pub user_claim: Option<Text>,
    pub header: Option<Text>,
    pub algorithms: Option<Vec<Text>>,
    pub allowed_hosts: Option<Vec<Text>>,
    pub refresh_min_interval: Option<Seconds>,
    pub claims_to_policy: Option<RawClaimsToPolicy>,
}

/// `jwt.claims_to_policy`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawClaimsToPolicy {
    pub claim: Option<Text>,
    pub policies: Option<Vec<RawClaimPolicy>>,
}

/// One of `jwt.claims_to_policy.policies`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "an entry of key: value pairs")]
pub(crate) struct RawClaimPolicy {
    pub value: Option<Text>,
    pub max_priority: Option<Text>,
    pub models: Option<Vec<Text>>,
    pub budget: Option<RawBudget>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawUsers {
    pub header: Option<Text>,
    pub body_field: Option<Text>,
    pub max_concurrent: Option<Int>,
    pub max_queued: Option<Int>,
    pub budget: Option<RawBudget>,
    pub session_header: Option<Text>,
    pub jwt: Option<RawJwt>,
    pub rate_limit: Option<RawMinuteLimit>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawBudget {
    pub gpu_seconds: Option<Seconds>,
    pub tokens: Option<Int>,
    pub usd: Option<Float>,
    pub window: Option<Text>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawLogging {
    pub level: Option<Text>,
    pub format: Option<Text>,
    pub requests: Option<RawRequestLog>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawRequestLog {
    pub file: Option<Text>,
    pub retention_days: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawInjection {
    /// Items are parsed one by one into [`RawConfig::listeners`].
    pub listeners: Option<Value>,
    pub allow_public_injection: Option<Flag>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "an entry of key: value pairs")]
pub(crate) struct RawListener {
    pub listen_port: Int,
    pub inject_as: Text,
    #[serde(default)]
    pub bind: Option<Text>,
    #[serde(default)]
    pub tls: Option<RawListenerTls>,
    #[serde(default)]
    pub trust_users: Option<Flag>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawRouting {
    pub strategy: Option<Text>,
    pub fallback: Option<Text>,
    pub model_poll_timeout: Option<Seconds>,
    pub require_host_at_start: Option<Flag>,
    pub acquire_timeout: Option<Seconds>,
    pub affinity: RawAffinity,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawAffinity {
    pub enabled: Option<Flag>,
    pub session_header: Option<Text>,
    pub epsilon: Option<Float>,
    pub share_across_keys: Option<Flag>,
    pub ram_cache_per_runner: Option<Int>,
    pub prefill_ms_per_1k: Option<Float>,
    pub max_conversations: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawCache {
    pub enabled: Option<Flag>,
    pub backend: Option<Text>,
    pub ttl: Option<Seconds>,
    pub max_entry_bytes: Option<Int>,
    pub key_prefix: Option<Text>,
    pub connect_timeout: Option<Seconds>,
    pub max_memory_mb: Option<Int>,
    pub per_client: Option<Flag>,
    pub max_inputs: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawKeepAlive {
    pub default: Option<KeepAliveValue>,
    #[serde(rename = "override")]
    pub override_client: Option<Flag>,
    pub max: Option<Seconds>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawDashboard {
    pub enabled: Option<Flag>,
    pub refresh_seconds: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawControlPlane {
    pub listen: Option<Text>,
    pub node_token: Option<Text>,
    pub node_token_env: Option<Text>,
    pub node_token_file: Option<Text>,
    pub state_dir: Option<Text>,
    pub tls: Option<RawTls>,
    pub audit: Option<RawAudit>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawAudit {
    pub max_file_mb: Option<Int>,
    pub keep_files: Option<Int>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "an entry of key: value pairs")]
pub(crate) struct RawTls {
    pub cert: Text,
    pub key: Text,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, expecting = "a section of key: value pairs")]
pub(crate) struct RawNode {
    pub host: Option<Text>,
    pub port: Option<Int>,
    pub url: Option<Text>,
}

/// Parses the document root (a mapping) section by section.
pub(crate) fn parse_sections(root: Value, problems: &mut Problems) -> RawConfig {
    let Value::Mapping(mut root) = root else {
        problems.error("the config file must be a mapping of sections (proxy:, ollama:, …)");
        return RawConfig::default();
    };
    for key in root.keys() {
        match key.as_str() {
            Some(name) if SECTIONS.contains(&name) => {}
            Some(name) => problems.warn(format!("unknown key '{name}' (ignored)")),
            None => problems.warn("unknown non-string top-level key (ignored)".to_string()),
        }
    }
    let mut take = |name: &str| root.remove(name).unwrap_or(Value::Null);

    let ollama_value = take("ollama");
    let auth_value = take("auth");
    let injection_value = take("client_injection");
    let mut raw = RawConfig {
        proxy: section(take("proxy"), "proxy", problems),
        queue: section(take("queue"), "queue", problems),
        webhooks: section(take("webhooks"), "webhooks", problems),
        logging: section(take("logging"), "logging", problems),
        routing: section(take("routing"), "routing", problems),
        embedding_cache: section(take("embedding_cache"), "embedding_cache", problems),
        keep_alive: section(take("keep_alive"), "keep_alive", problems),
        dashboard: section(take("dashboard"), "dashboard", problems),
        control_plane: section(take("control_plane"), "control_plane", problems),
        nodes: section(take("nodes"), "nodes", problems),
        cloud: section(take("cloud"), "cloud", problems),
        ..RawConfig::default()
    };

    raw.ollama = section::<RawOllama>(ollama_value, "ollama", problems);
    if let Some(ollama) = raw.ollama.as_mut() {
        raw.hosts_given = ollama.hosts.as_ref().is_some_and(|hosts| !hosts.is_null());
        raw.hosts = list(ollama.hosts.take(), "ollama.hosts", problems);
    }
    raw.auth = section::<RawAuth>(auth_value, "auth", problems);
    if let Some(auth) = raw.auth.as_mut() {
        raw.keys = list(auth.keys.take(), "auth.keys", problems);
    }
    raw.client_injection = section::<RawInjection>(injection_value, "client_injection", problems);
    if let Some(injection) = raw.client_injection.as_mut() {
        raw.listeners = list(
            injection.listeners.take(),
            "client_injection.listeners",
            problems,
        );
    }
    raw
}

/// Deserializes one section; a missing or empty (`null`) section is its default.
fn section<T: DeserializeOwned + Default>(
    value: Value,
    path: &str,
    problems: &mut Problems,
) -> Option<T> {
    if value.is_null() {
        return Some(T::default());
    }
    typed(value, path, problems)
}

/// Deserializes a list item by item. `None` if any item failed (each failure is recorded);
/// an absent list is empty.
fn list<T: DeserializeOwned>(
    value: Option<Value>,
    path: &str,
    problems: &mut Problems,
) -> Option<Vec<T>> {
    let items = match value {
        None | Some(Value::Null) => return Some(Vec::new()),
        Some(Value::Sequence(items)) => items,
        Some(_) => {
            problems.error(format!(
                "{path}: expected a list of entries (each starting with '- ')"
            ));
            return None;
        }
    };
    let before = problems.error_count();
    let parsed: Vec<T> = items
        .into_iter()
        .enumerate()
        .filter_map(|(index, item)| typed(item, &format!("{path}[{index}]"), problems))
        .collect();
    (problems.error_count() == before).then_some(parsed)
}

/// Deserializes `value` as `T`, prefixing error and unknown-key paths with `path`.
fn typed<T: DeserializeOwned>(value: Value, path: &str, problems: &mut Problems) -> Option<T> {
    let mut unknown = Vec::new();
    let mut record = |ignored: serde_ignored::Path<'_>| unknown.push(render(&ignored));
    let result =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(value, &mut record));
    for key in unknown {
        problems.warn(format!("unknown key '{path}{key}' (ignored)"));
    }
    match result {
        Ok(value) => Some(value),
        Err(error) => {
            let inner = error.path().to_string();
            let at = if inner == "." {
                path.to_string()
            } else if inner.starts_with('[') {
                format!("{path}{inner}")
            } else {
                format!("{path}.{inner}")
            };
            problems.error(format!("{at}: {}", error.inner()));
            None
        }
    }
}

/// Renders a `serde_ignored` path as `.a.b[0].c` (relative, with a leading separator).
fn render(path: &serde_ignored::Path<'_>) -> String {
    match path {
        serde_ignored::Path::Root => String::new(),
        serde_ignored::Path::Seq { parent, index } => format!("{}[{index}]", render(parent)),
        serde_ignored::Path::Map { parent, key } => format!("{}.{key}", render(parent)),
        serde_ignored::Path::Some { parent }
        | serde_ignored::Path::NewtypeStruct { parent }
        | serde_ignored::Path::NewtypeVariant { parent } => render(parent),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> (RawConfig, Problems) {
        let mut problems = Problems::default();
        let raw = parse_sections(serde_yaml::from_str(yaml).unwrap(), &mut problems);
        (raw, problems)
    }

    #[test]
    fn unknown_keys_are_warnings_with_full_paths() {
        let (raw, problems) = parse(
            "proxy: {prot: 1}\nfoo: 2\nqueue: {high: {max_dept: 3}}\n\
             ollama: {hosts: [{url: u, name: n, api_keys: [{key: k, acount: a}]}]}",
        );
        assert!(problems.errors().is_empty(), "{problems:?}");
        assert!(raw.proxy.is_some() && raw.hosts.is_some());
        let warnings = problems.warnings();
        assert!(
            warnings.contains(&"unknown key 'proxy.prot' (ignored)".to_string()),
            "{warnings:?}"
        );
        assert!(warnings.contains(&"unknown key 'foo' (ignored)".to_string()));
        assert!(warnings.contains(&"unknown key 'queue.high.max_dept' (ignored)".to_string()));
        assert!(
            warnings.contains(
                &"unknown key 'ollama.hosts[0].api_keys[0].acount' (ignored)".to_string()
            ),
            "{warnings:?}"
        );
    }

    #[test]
    fn errors_carry_paths_and_do_not_stop_other_sections() {
        let (raw, problems) = parse(
            "proxy: {port: [1]}\nqueue: {low: {max_wait: soon}}\n\
             ollama: {hosts: [{url: u}, {url: u, name: n, weight: heavy}]}\nauth: {keys: 3}",
        );
        let errors = problems.errors();
        assert_eq!(errors.len(), 5, "{errors:?}");
        assert!(
            errors[0].starts_with("proxy.port: invalid type: sequence"),
            "{errors:?}"
        );
        assert!(errors[1].starts_with("queue.low.max_wait: "), "{errors:?}");
        assert!(
            errors[2].starts_with("ollama.hosts[0]: missing field `name`"),
            "{errors:?}"
        );
        assert!(
            errors[3].starts_with("ollama.hosts[1].weight: "),
            "{errors:?}"
        );
        assert!(
            errors[4].starts_with("auth.keys: expected a list"),
            "{errors:?}"
        );
        assert!(raw.proxy.is_none() && raw.hosts.is_none() && raw.keys.is_none());
        assert!(raw.routing.is_some());
    }

    #[test]
    fn empty_sections_are_defaults() {
        let (raw, problems) = parse("proxy:\nqueue: {high: }\n");
        assert!(problems.is_empty());
        assert!(raw.proxy.is_some_and(|p| p.port.is_none()));
        assert!(raw.queue.is_some_and(|q| q.high.is_none()));
        assert!(!raw.hosts_given);
    }
}
