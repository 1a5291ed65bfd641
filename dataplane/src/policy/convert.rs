//! Wire snapshot → [`Policy`]. The only place where `oqp_proto` policy types
//! meet the data plane's own; everything after this works on compiled types.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use oqp_proto::policy::v1 as wire;

use super::*;

/// Why a snapshot was rejected. The message names the offending item, never a
/// secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("snapshot rejected: {0}")]
pub struct PolicyError(String);

impl PolicyError {
    fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl TryFrom<wire::PolicySnapshot> for Policy {
    type Error = PolicyError;

    fn try_from(snapshot: wire::PolicySnapshot) -> Result<Self, Self::Error> {
        let listener = snapshot
            .listener
            .ok_or_else(|| PolicyError::new("no listener"))?;
        let listen = socket_addr(&listener.host, listener.port)
            .map_err(|e| PolicyError::new(format!("listener: {e}")))?;

        let proxy = snapshot.proxy.unwrap_or_default();
        if proxy.max_concurrent == 0 {
            return Err(PolicyError::new("proxy.max_concurrent must be at least 1"));
        }
        let proxy = ProxySettings {
            max_concurrent: proxy.max_concurrent,
            allow_model_management: proxy.allow_model_management,
            max_request_body_bytes: proxy.max_request_body_bytes,
            request_timeout: millis(proxy.request_timeout_ms, Duration::from_secs(300)),
            drain_timeout: millis(proxy.drain_timeout_ms, Duration::from_secs(30)),
        };

        let auth = snapshot.auth.unwrap_or_default();
        let auth = AuthSettings {
            enabled: auth.enabled,
            max_failures: auth.rate_limit_max_failures,
            window: Duration::from_secs(u64::from(auth.rate_limit_window_seconds.max(1))),
        };

        let mut clients = HashMap::new();
        let mut clients_by_id: HashMap<Arc<str>, Arc<Client>> = HashMap::new();
        for client in snapshot.clients {
            let client = Arc::new(convert_client(client)?);
            // Several digests may map to one id (a rotated key in its grace
            // period); the id index keeps the first, which is the current key.
            clients_by_id
                .entry(client.id.clone())
                .or_insert_with(|| client.clone());
            if clients.insert(client.key_digest, client.clone()).is_some() {
                return Err(PolicyError::new(format!(
                    "client '{}' shares its key with another client",
                    client.id
                )));
            }
        }

        let queue = convert_queue(snapshot.queue.unwrap_or_default())?;

        let mut hosts = Vec::with_capacity(snapshot.hosts.len());
        let mut names = HashSet::new();
        for host in snapshot.hosts {
            let host = convert_host(host, proxy.max_concurrent)?;
            if !names.insert(host.name.clone()) {
                return Err(PolicyError::new(format!("duplicate host '{}'", host.name)));
            }
            hosts.push(Arc::new(host));
        }
        if hosts.is_empty() {
            return Err(PolicyError::new("no upstream hosts"));
        }

        let routing = snapshot.routing.unwrap_or_default();
        let routing = RoutingSettings {
            strategy: match routing.strategy.as_str() {
                "model_aware" => Strategy::ModelAware,
                "round_robin" | "" => Strategy::RoundRobin,
                other => {
                    return Err(PolicyError::new(format!(
                        "unknown routing strategy '{other}'"
                    )));
                }
            },
            acquire_timeout: millis(routing.acquire_timeout_ms, Duration::from_secs(5)),
        };

        let keep_alive = snapshot.keep_alive.unwrap_or_default();
        let keep_alive = KeepAlive {
            default_json: if keep_alive.default_json.is_empty() {
                None
            } else {
                serde_json::from_str::<serde_json::Value>(&keep_alive.default_json)
                    .map_err(|_| PolicyError::new("keep_alive.default is not a JSON literal"))?;
                Some(Arc::from(keep_alive.default_json))
            },
            override_client: keep_alive.r#override,
        };

        let cache = snapshot.embedding_cache.unwrap_or_default();
        let backend = match cache.backend.as_str() {
            "" | "memory" => CacheBackend::Memory,
            url if url.starts_with("redis://") || url.starts_with("rediss://") => {
                CacheBackend::Redis(url.to_owned())
            }
            _ => {
                return Err(PolicyError::new(
                    "embedding_cache.backend is neither memory nor a redis URL",
                ));
            }
        };
        let embedding_cache = CacheSettings {
            enabled: cache.enabled,
            backend,
            ttl: Duration::from_secs(cache.ttl_seconds.max(1)),
            max_entry_bytes: cache.max_entry_bytes,
            key_prefix: cache.key_prefix,
            connect_timeout: millis(cache.connect_timeout_ms, Duration::from_secs(2)),
            max_memory_bytes: cache.max_memory_bytes,
            per_client: cache.per_client,
            max_inputs: match cache.max_inputs {
                0 => DEFAULT_MAX_EMBED_INPUTS,
                n => usize::try_from(n).map_or(MAX_EMBED_INPUTS, |n| n.min(MAX_EMBED_INPUTS)),
            },
        };

        let dashboard = snapshot.dashboard.unwrap_or_default();
        let dashboard = DashboardSettings {
            enabled: dashboard.enabled,
            refresh: Duration::from_secs(u64::from(dashboard.refresh_seconds.max(1))),
        };

        let mut injection_listeners = Vec::new();
        for listener in snapshot.injection_listeners {
            let addr = socket_addr(&listener.bind, listener.port)
                .map_err(|e| PolicyError::new(format!("injection listener: {e}")))?;
            let inject_as: Arc<str> = Arc::from(listener.inject_as);
            if !clients_by_id.contains_key(&inject_as) {
                return Err(PolicyError::new(format!(
                    "injection listener {addr} names unknown client '{inject_as}'"
                )));
            }
            injection_listeners.push(InjectionListener { addr, inject_as });
        }

        let log_level = match snapshot.logging.map(|logging| logging.level) {
            None => None,
            Some(level) if level.is_empty() => None,
            Some(level) => Some(LogLevel::parse(&level).ok_or_else(|| {
                PolicyError::new(format!("logging.level '{level}' is not a log level"))
            })?),
        };

        Ok(Policy {
            version: snapshot.version,
            listen,
            proxy,
            auth,
            clients,
            clients_by_id,
            queue,
            hosts,
            routing,
            keep_alive,
            embedding_cache,
            dashboard,
            injection_listeners,
            log_level,
        })
    }
}

fn convert_client(client: wire::Client) -> Result<Client, PolicyError> {
    let id = client.client_id;
    if id.is_empty() {
        return Err(PolicyError::new("a client has an empty client_id"));
    }
    let key_digest: [u8; 32] = client
        .key_sha256
        .as_slice()
        .try_into()
        .map_err(|_| PolicyError::new(format!("client '{id}': key digest is not 32 bytes")))?;
    let scope = match wire::Scope::try_from(client.scope) {
        Ok(wire::Scope::Read) => Scope::Read,
        Ok(wire::Scope::Inference | wire::Scope::Unspecified) => Scope::Inference,
        Ok(wire::Scope::Management) => Scope::Management,
        Err(_) => return Err(PolicyError::new(format!("client '{id}': unknown scope"))),
    };
    let max_priority = tier(client.max_priority, Tier::Normal)
        .ok_or_else(|| PolicyError::new(format!("client '{id}': unknown max_priority")))?;
    let default_priority = tier(client.default_priority, max_priority.max(Tier::Normal))
        .ok_or_else(|| PolicyError::new(format!("client '{id}': unknown default_priority")))?
        .max(max_priority);
    let weight = if client.weight == 0.0 {
        1.0
    } else {
        client.weight
    };
    if !(weight.is_finite() && weight > 0.0) {
        return Err(PolicyError::new(format!(
            "client '{id}': weight must be positive"
        )));
    }
    let expires = u64::try_from(client.expires_unix_ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    Ok(Client {
        id: Arc::from(id),
        key_digest,
        scope,
        max_priority,
        default_priority,
        max_concurrent: client.max_concurrent,
        weight,
        max_queued: client.max_queued,
        description: client.description,
        expires,
    })
}

fn convert_queue(queue: wire::QueueSettings) -> Result<QueueSettings, PolicyError> {
    let tier_settings = |settings: Option<wire::TierSettings>, name: &str| {
        let settings = settings.unwrap_or_default();
        if settings.high_watermark_pct > 100 {
            return Err(PolicyError::new(format!(
                "queue.{name}.high_watermark_pct must be at most 100"
            )));
        }
        Ok(TierSettings {
            max_depth: settings.max_depth,
            max_wait: Duration::from_millis(settings.max_wait_ms),
            high_watermark_pct: settings.high_watermark_pct,
            promote_after: (settings.promote_after_ms > 0)
                .then(|| Duration::from_millis(settings.promote_after_ms)),
            paused: settings.paused,
            flush_generation: settings.flush_generation,
        })
    };
    let overflow_status = match queue.overflow_status_code {
        0 | 503 => http::StatusCode::SERVICE_UNAVAILABLE,
        429 => http::StatusCode::TOO_MANY_REQUESTS,
        other => {
            return Err(PolicyError::new(format!(
                "queue.overflow_status_code must be 503 or 429, got {other}"
            )));
        }
    };
    Ok(QueueSettings {
        tiers: [
            tier_settings(queue.high, "high")?,
            tier_settings(queue.normal, "normal")?,
            tier_settings(queue.low, "low")?,
        ],
        overflow_status,
        max_queued_bytes: queue.max_queued_bytes,
        fair_share_half_life: millis(queue.fair_share_half_life_ms, Duration::from_secs(60)),
        drain_generation: queue.drain_generation,
    })
}

fn convert_host(host: wire::Host, default_slots: u32) -> Result<Host, PolicyError> {
    let name = host.name;
    if name.is_empty() {
        return Err(PolicyError::new("a host has an empty name"));
    }
    let url = host.url.trim_end_matches('/').to_owned();
    let uri: http::Uri = url
        .parse()
        .map_err(|_| PolicyError::new(format!("host '{name}': invalid url")))?;
    let scheme = uri
        .scheme()
        .filter(|s| **s == http::uri::Scheme::HTTP || **s == http::uri::Scheme::HTTPS)
        .cloned()
        .ok_or_else(|| PolicyError::new(format!("host '{name}': url must be http or https")))?;
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| PolicyError::new(format!("host '{name}': url has no host")))?;
    if !matches!(uri.path(), "" | "/") {
        return Err(PolicyError::new(format!(
            "host '{name}': url must not have a path"
        )));
    }
    let kind = match wire::HostKind::try_from(host.kind) {
        Ok(wire::HostKind::Cloud) => HostKind::Cloud,
        Ok(_) => HostKind::Ollama,
        Err(_) => return Err(PolicyError::new(format!("host '{name}': unknown kind"))),
    };
    let last_checked = u64::try_from(host.last_checked_unix_ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    Ok(Host {
        name: Arc::from(name),
        scheme,
        authority,
        url,
        weight: host.weight.max(1),
        max_concurrent: if host.max_concurrent == 0 {
            default_slots
        } else {
            host.max_concurrent
        },
        kind,
        healthy: host.healthy,
        installed: host
            .installed_models
            .iter()
            .map(|m| normalize_model(m))
            .collect(),
        loaded: host
            .loaded_models
            .iter()
            .map(|m| normalize_model(m))
            .collect(),
        installed_names: host.installed_models,
        loaded_names: host.loaded_models,
        last_checked,
        cloud_keys: host
            .cloud_keys
            .into_iter()
            .map(|k| CloudKey {
                key: Arc::from(k.key),
                account: Arc::from(k.account),
            })
            .collect(),
        fallback_models: host.fallback_models,
    })
}

fn tier(value: i32, unspecified: Tier) -> Option<Tier> {
    match wire::Tier::try_from(value).ok()? {
        wire::Tier::Unspecified => Some(unspecified),
        wire::Tier::High => Some(Tier::High),
        wire::Tier::Normal => Some(Tier::Normal),
        wire::Tier::Low => Some(Tier::Low),
    }
}

fn millis(value: u64, default: Duration) -> Duration {
    if value == 0 {
        default
    } else {
        Duration::from_millis(value)
    }
}

fn socket_addr(host: &str, port: u32) -> Result<SocketAddr, String> {
    let port = u16::try_from(port).map_err(|_| format!("port {port} out of range"))?;
    let ip: IpAddr = match host {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        other => other
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("'{other}' is not an IP address"))?,
    };
    Ok(SocketAddr::new(ip, port))
}
