//! The config loader: reads the YAML file of the Python ollama-queue-proxy (an existing
//! `config.yml` loads unchanged), applies `OQP_*` environment overrides, and produces a
//! validated [`Config`] or a [`ConfigError`] listing every problem at once.
//!
//! The pipeline, one module per step:
//! 1. YAML text → value tree (syntax errors carry line and column); merge keys applied.
//! 2. `env`: `OQP_SECTION__KEY=value` overrides set on the tree, list indices included.
//! 3. `schema`: the tree → raw serde structs, section by section and list item by list item;
//!    errors carry key paths, unknown keys become warnings.
//! 4. `resolve`, `hosts`, `keys`, `cloud`, `cluster`: defaults, ranges, words, key sources → the
//!    public types, each field read by `field`.
//! 5. `validate`: checks that span sections, and security warnings.
//!
//! Raw structs are private; the public types ([`Config`] and its sections) hold only values
//! that passed every check. Secrets are [`Secret`]s and never print.

mod cloud;
mod cluster;
mod enums;
mod env;
mod error;
mod field;
mod hosts;
mod keys;
mod net;
mod resolve;
mod scalar;
mod schema;
mod secret;
mod types;
mod validate;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

use std::path::{Path, PathBuf};

use serde_yaml::Value;

pub use cloud::{CloudAccountConfig, CloudConfig, DEFAULT_BALANCE_INTERVAL};
pub use enums::{
    HostKind, LogFormat, LogLevel, RoutingFallback, RoutingStrategy, Scope, Tier, WebhookEvent,
};
pub use env::{CONFIG_VAR, Env};
pub use error::ConfigError;
pub use keys::check_model_pattern;
pub use secret::Secret;
pub use types::{
    AffinityConfig, AuditConfig, AuthConfig, Budget, BudgetWindow, CacheBackend,
    ClientInjectionConfig, CloudKey, Config, ControlPlaneConfig, DashboardConfig,
    EmbeddingCacheConfig, FairShareConfig, HostConfig, InjectionListener, JwksSource, JwtConfig,
    KeepAliveConfig, KeyConfig, ListenerTls, LoggingConfig, MinuteLimit, ModelSwapConfig,
    NodeOverride, OllamaConfig, ProxyConfig, QueueConfig, RateLimitConfig, RequestLogConfig,
    RoutingConfig, TierConfig, TlsConfig, UserSource, UsersConfig, WebhooksConfig,
};

use error::Problems;

/// The file used when `OQP_CONFIG` is not set.
pub const DEFAULT_PATH: &str = "config.yml";

/// A loaded configuration and the warnings to log at start-up (unknown keys, deprecated keys,
/// security notes).
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<String>,
}

/// The config file path: `OQP_CONFIG`, else `./config.yml`.
pub fn default_path(env: &Env) -> PathBuf {
    PathBuf::from(env.get(CONFIG_VAR).unwrap_or(DEFAULT_PATH))
}

/// Loads a config file and applies the overrides in `env`. A missing file is an error; for an
/// environment-only setup use `load_str("", env)`.
pub fn load_file(path: &Path, env: &Env) -> Result<Loaded, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ConfigError::NotFound {
            path: path.to_path_buf(),
        },
        _ => ConfigError::Unreadable {
            path: path.to_path_buf(),
            source,
        },
    })?;
    load_str(&text, env)
}

/// Loads a config from YAML text (empty text is `{}`) and applies the overrides in `env`.
pub fn load_str(yaml: &str, env: &Env) -> Result<Loaded, ConfigError> {
    let mut problems = Problems::default();
    let Some(mut root) = parse_yaml(yaml, &mut problems) else {
        // Nothing below could say anything useful about a file that did not parse.
        return problems
            .finish(None)
            .map(|(config, warnings)| Loaded { config, warnings });
    };
    env::apply_overrides(&mut root, env, schema::SECTIONS, &mut problems);
    let raw = schema::parse_sections(root, &mut problems);
    let config = build(raw, env, &mut problems);
    if let Some(config) = &config {
        validate::security_warnings(config, &mut problems);
    }
    let (config, warnings) = problems.finish(config)?;
    Ok(Loaded { config, warnings })
}

/// YAML text → value tree (empty text is an empty mapping); `None` after a syntax error.
fn parse_yaml(yaml: &str, problems: &mut Problems) -> Option<Value> {
    let empty = || Value::Mapping(serde_yaml::Mapping::new());
    if yaml.trim().is_empty() {
        return Some(empty());
    }
    match serde_yaml::from_str::<Value>(yaml) {
        Ok(Value::Null) => Some(empty()),
        Ok(mut value) => match value.apply_merge() {
            Ok(()) => Some(value),
            Err(error) => {
                problems.error(format!("YAML error: {error}"));
                None
            }
        },
        Err(error) => {
            problems.error(match error.location() {
                Some(at) => format!(
                    "YAML syntax error at line {}, column {}: {error}",
                    at.line(),
                    at.column()
                ),
                None => format!("YAML syntax error: {error}"),
            });
            None
        }
    }
}

/// Raw sections → [`Config`]; `None` if anything failed (every failure is recorded).
fn build(raw: schema::RawConfig, env: &Env, problems: &mut Problems) -> Option<Config> {
    let proxy = raw.proxy.and_then(|proxy| resolve::proxy(proxy, problems));
    let proxy_max = proxy.as_ref().map(|proxy| proxy.max_concurrent);
    let ollama = raw.ollama.and_then(|ollama| {
        let max = proxy_max.unwrap_or(ProxyConfig::default().max_concurrent);
        hosts::ollama(
            ollama,
            raw.hosts.as_deref(),
            raw.hosts_given,
            max,
            env,
            problems,
        )
    });
    let queue = raw.queue.and_then(|queue| resolve::queue(queue, problems));
    let webhooks = raw
        .webhooks
        .and_then(|webhooks| resolve::webhooks(webhooks, problems));
    let auth = raw
        .auth
        .and_then(|auth| resolve::auth(auth, raw.keys.as_deref(), proxy_max, env, problems));
    let logging = raw
        .logging
        .and_then(|logging| resolve::logging(logging, problems));
    if let (Some(auth), Some(logging)) = (&auth, &logging)
        && logging.requests.is_none()
    {
        for key in auth.keys.iter().filter(|key| key.capture.is_some()) {
            problems.warn(format!(
                "auth.keys[client_id={}].capture is set, but logging.requests is off: nothing is captured",
                key.client_id
            ));
        }
    }
    let client_injection = raw.client_injection.and_then(|injection| {
        let port = proxy.as_ref().map(|proxy| proxy.port);
        validate::client_injection(
            injection,
            raw.listeners.as_deref(),
            port,
            auth.as_ref(),
            problems,
        )
    });
    let routing = raw
        .routing
        .and_then(|routing| resolve::routing(routing, problems));
    let embedding_cache = raw
        .embedding_cache
        .and_then(|cache| resolve::embedding_cache(cache, problems));
    let keep_alive = raw
        .keep_alive
        .and_then(|keep_alive| resolve::keep_alive(keep_alive, problems));
    let control_plane = raw
        .control_plane
        .and_then(|control_plane| cluster::control_plane(control_plane, env, problems));
    let nodes = raw.nodes.and_then(|nodes| cluster::nodes(nodes, problems));
    let cloud = raw.cloud.and_then(|section| {
        let hosts = ollama.as_ref().map(|ollama| ollama.hosts.as_slice());
        cloud::cloud(section, hosts, problems)
    });
    // Every node's proxy listener (the default host, or a node's own) on loopback.
    let loopback = proxy
        .as_ref()
        .is_some_and(|proxy| resolve::is_loopback_host(&proxy.host))
        && nodes.as_ref().is_none_or(|nodes| {
            nodes
                .values()
                .filter_map(|node| node.host.as_deref())
                .all(resolve::is_loopback_host)
        });
    let dashboard = raw
        .dashboard
        .and_then(|dashboard| resolve::dashboard(dashboard, loopback, problems));
    if let (Some(ollama), Some(nodes), Some(proxy), Some(control_plane)) =
        (&ollama, &nodes, &proxy, &control_plane)
    {
        cluster::ownership(&ollama.hosts, nodes, proxy, control_plane, problems);
    }
    Some(Config {
        proxy: proxy?,
        ollama: ollama?,
        queue: queue?,
        webhooks: webhooks?,
        auth: auth?,
        logging: logging?,
        client_injection: client_injection?,
        routing: routing?,
        embedding_cache: embedding_cache?,
        keep_alive: keep_alive?,
        dashboard: dashboard?,
        control_plane: control_plane?,
        nodes: nodes?,
        cloud: cloud?,
    })
}
