//! Config + runtime state → the wire policy snapshot that data planes apply.
//!
//! This is the only place config types meet `oqp_proto` policy types. Keys
//! leave here as SHA-256 digests; cloud keys (which data planes must present
//! upstream) are the one secret the snapshot carries.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use oqp_proto::policy::v1 as wire;

pub use crate::inventory::Inventory;
pub use oqp_proto::unix_ms;

use crate::config::{CacheBackend, Config, HostKind, RoutingStrategy, Scope, Tier};

/// Operator state that is not in the config file: pauses, flushes, drains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runtime {
    /// Paused flag per tier, in order high, normal, low.
    pub paused: [bool; 3],
    /// Flush generation per tier.
    pub flush_generation: [u64; 3],
    /// Drain generation.
    pub drain_generation: u64,
}

/// The wire kind of a host: as configured, or for `auto` as detected (Ollama
/// until something else answered).
fn wire_kind(kind: HostKind, seen: Option<&Inventory>) -> wire::HostKind {
    match kind {
        HostKind::Ollama => wire::HostKind::Ollama,
        HostKind::Cloud => wire::HostKind::Cloud,
        HostKind::Openai => wire::HostKind::Openai,
        HostKind::Auto => match seen.and_then(|s| s.learned.detected) {
            Some(detected) if detected.is_openai() => wire::HostKind::Openai,
            _ => wire::HostKind::Ollama,
        },
    }
}

/// Builds the snapshot for `version`.
pub fn snapshot(
    config: &Config,
    runtime: &Runtime,
    inventory: &HashMap<String, Inventory>,
    extra_clients: &[wire::Client],
    version: u64,
) -> wire::PolicySnapshot {
    let tier_settings = |tier: Tier| {
        let settings = config.queue.tier(tier);
        let index = tier_index(tier);
        wire::TierSettings {
            max_depth: settings.max_depth,
            max_wait_ms: millis(settings.max_wait),
            high_watermark_pct: settings.high_watermark_pct,
            promote_after_ms: settings.promote_after.map_or(0, millis),
            paused: runtime.paused[index],
            flush_generation: runtime.flush_generation[index],
        }
    };
    let mut clients: Vec<wire::Client> = config
        .auth
        .keys
        .iter()
        .map(|key| wire::Client {
            client_id: key.client_id.clone(),
            key_sha256: key
                .key
                .as_ref()
                .map(|key| key.sha256().to_vec())
                .unwrap_or_default(),
            scope: scope_to_wire(key.scope) as i32,
            max_priority: tier_to_wire(key.max_priority) as i32,
            default_priority: tier_to_wire(key.default_priority) as i32,
            max_concurrent: key.max_concurrent,
            weight: key.weight,
            max_queued: key.max_queued,
            description: key.description.clone().unwrap_or_default(),
            expires_unix_ms: key.expires.map_or(0, unix_ms),
            source: "config".to_owned(),
            budget: key.budget.as_ref().map(budget_to_wire),
            models: key.models.clone(),
            users: key.users.as_ref().map(users_to_wire),
            tls_subject: key.tls_subject.clone().unwrap_or_default(),
            rate_limit: key.rate_limit.map(minute_limit_to_wire),
            capture_max_bytes: key.capture.unwrap_or(0),
        })
        .collect();
    clients.extend(extra_clients.iter().cloned());
    // A key that sets no per-minute limits of its own (in the file or the store) has the
    // default's.
    if let Some(default) = config.auth.default_rate_limit {
        for client in clients
            .iter_mut()
            .filter(|client| client.rate_limit.is_none())
        {
            client.rate_limit = Some(minute_limit_to_wire(default));
        }
    }

    let hosts = config
        .ollama
        .hosts
        .iter()
        .map(|host| {
            let seen = inventory.get(&host.name);
            wire::Host {
                name: host.name.clone(),
                url: host.url.clone(),
                weight: host.weight,
                max_concurrent: host.max_concurrent,
                kind: wire_kind(host.kind, seen) as i32,
                // Before the first poll a host is presumed healthy: health is
                // a cached observation, and a missing one must not black-hole
                // the proxy.
                healthy: seen.is_none_or(|s| s.healthy),
                installed_models: seen.map(|s| s.installed.clone()).unwrap_or_default(),
                loaded_models: seen.map(|s| s.loaded.clone()).unwrap_or_default(),
                last_checked_unix_ms: seen.and_then(|s| s.last_checked).map_or(0, unix_ms),
                cloud_keys: host
                    .api_keys
                    .iter()
                    .map(|k| wire::CloudKey {
                        key: k.key.expose().to_owned(),
                        account: k.account.clone(),
                    })
                    .collect(),
                fallback_models: host.fallback_models.clone(),
                model_sync_interval_seconds: u32::try_from(host.model_sync_interval.as_secs())
                    .unwrap_or(u32::MAX),
                node: host.node.clone().unwrap_or_default(),
                vram_bytes: host.vram.unwrap_or(0),
                resident: seen.map(|s| model_sizes(&s.resident)).unwrap_or_default(),
                sizes: seen.map(|s| model_sizes(&s.sizes)).unwrap_or_default(),
                // An engine's own slot count wins over the configured one.
                num_parallel: seen
                    .and_then(|s| s.learned.slots)
                    .unwrap_or(host.num_parallel),
                runner_slots: host
                    .runner_overrides
                    .iter()
                    .map(|(pattern, num_parallel)| wire::RunnerSlots {
                        pattern: pattern.clone(),
                        num_parallel: *num_parallel,
                    })
                    .collect(),
                forced_runners: seen
                    .map(|s| {
                        s.forced
                            .iter()
                            .map(|(model, reason)| wire::ForcedRunner {
                                model: model.clone(),
                                reason: reason.clone(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                configured_kind: host.kind.as_str().to_owned(),
                engine: seen
                    .and_then(|s| s.learned.detected)
                    .map(|d| d.as_str().to_owned())
                    .unwrap_or_default(),
                learned_slots: seen.and_then(|s| s.learned.slots).unwrap_or(0),
                slot_context: seen.and_then(|s| s.learned.slot_context).unwrap_or(0),
                engine_problem: seen
                    .and_then(|s| s.learned.problem.clone())
                    .unwrap_or_default(),
                poll_error: seen.and_then(|s| s.error.clone()).unwrap_or_default(),
                // Balances are added by the hub from its reads (`balances::attach`).
                cloud_accounts: crate::balances::accounts_of(config, host),
            }
        })
        .collect();

    wire::PolicySnapshot {
        version,
        listener: Some(wire::Listener {
            host: config.proxy.host.clone(),
            port: u32::from(config.proxy.port),
        }),
        proxy: Some(wire::ProxySettings {
            max_concurrent: config.proxy.max_concurrent,
            allow_model_management: config.proxy.allow_model_management,
            max_request_body_bytes: config.proxy.max_request_body_bytes(),
            request_timeout_ms: millis(config.ollama.request_timeout),
            non_streamed_timeout_ms: millis(config.ollama.non_streamed_timeout),
            drain_timeout_ms: millis(config.proxy.drain_timeout),
            max_connections: config.proxy.max_connections,
            max_connections_per_ip: config.proxy.max_connections_per_ip,
            first_request_timeout_ms: millis(config.proxy.first_request_timeout),
            idle_timeout_ms: millis(config.proxy.idle_timeout),
            body_read_timeout_ms: millis(config.proxy.body_read_timeout),
            upstream_stall_timeout_ms: millis(config.proxy.upstream_stall_timeout),
            client_stall_timeout_ms: millis(config.proxy.client_stall_timeout),
            tls: config.proxy.tls.as_ref().map(tls_files),
        }),
        auth: Some(wire::AuthSettings {
            enabled: config.auth.enabled,
            rate_limit_max_failures: config.auth.rate_limit.max_failures,
            rate_limit_window_seconds: u32::try_from(config.auth.rate_limit.window_seconds)
                .unwrap_or(u32::MAX),
            trusted_proxies: config.auth.trusted_proxies.clone(),
            metadata_per_second: config.auth.metadata_rate_limit.per_second,
            metadata_burst: config.auth.metadata_rate_limit.burst,
        }),
        clients,
        queue: Some(wire::QueueSettings {
            high: Some(tier_settings(Tier::High)),
            normal: Some(tier_settings(Tier::Normal)),
            low: Some(tier_settings(Tier::Low)),
            overflow_status_code: u32::from(config.queue.overflow_status_code),
            max_queued_bytes: config.queue.max_queued_bytes(),
            fair_share_half_life_ms: millis(config.queue.fair_share.half_life),
            drain_generation: runtime.drain_generation,
            model_swap: Some(wire::ModelSwapSettings {
                enabled: config.queue.model_swap.enabled,
                max_defer_high_ms: millis(config.queue.model_swap.max_defer(Tier::High)),
                max_defer_normal_ms: millis(config.queue.model_swap.max_defer(Tier::Normal)),
                max_defer_low_ms: millis(config.queue.model_swap.max_defer(Tier::Low)),
                idle_grace_ms: millis(config.queue.model_swap.idle_grace),
                unload: config.queue.model_swap.unload,
            }),
        }),
        hosts,
        routing: Some(wire::RoutingSettings {
            strategy: match config.routing.strategy {
                RoutingStrategy::ModelAware => "model_aware",
                RoutingStrategy::RoundRobin => "round_robin",
            }
            .to_owned(),
            fallback: "any_healthy".to_owned(),
            acquire_timeout_ms: millis(config.routing.acquire_timeout),
            affinity: Some(wire::AffinitySettings {
                enabled: config.routing.affinity.enabled,
                session_header: config
                    .routing
                    .affinity
                    .session_header
                    .clone()
                    .unwrap_or_default(),
                epsilon: config.routing.affinity.epsilon,
                share_across_keys: config.routing.affinity.share_across_keys,
                ram_cache_per_runner: config.routing.affinity.ram_cache_per_runner,
                prefill_ms_per_1k: config.routing.affinity.prefill_ms_per_1k,
                max_conversations: config.routing.affinity.max_conversations,
            }),
        }),
        keep_alive: Some(wire::KeepAliveSettings {
            default_json: config.keep_alive.default_json.clone(),
            r#override: config.keep_alive.override_client,
            max_seconds: config.keep_alive.max.as_secs(),
        }),
        embedding_cache: Some(wire::EmbeddingCacheSettings {
            enabled: config.embedding_cache.enabled,
            backend: match &config.embedding_cache.backend {
                CacheBackend::Memory => "memory".to_owned(),
                CacheBackend::Redis(url) => url.clone(),
            },
            ttl_seconds: config.embedding_cache.ttl.as_secs(),
            max_entry_bytes: config.embedding_cache.max_entry_bytes,
            key_prefix: config.embedding_cache.key_prefix.clone(),
            connect_timeout_ms: millis(config.embedding_cache.connect_timeout),
            max_memory_bytes: config
                .embedding_cache
                .max_memory_mb
                .saturating_mul(1024 * 1024),
            per_client: config.embedding_cache.per_client,
            max_inputs: config.embedding_cache.max_inputs,
        }),
        dashboard: Some(wire::DashboardSettings {
            enabled: config.dashboard.enabled,
            refresh_seconds: config.dashboard.refresh_seconds,
        }),
        injection_listeners: config
            .client_injection
            .listeners
            .iter()
            .map(|listener| wire::InjectionListener {
                bind: listener.bind.clone(),
                port: u32::from(listener.listen_port),
                inject_as: listener.inject_as.clone(),
                tls: listener.tls.as_ref().map(tls_files),
                trust_users: listener.trust_users,
            })
            .collect(),
        logging: Some(wire::LoggingSettings {
            level: config.logging.level.as_str().to_owned(),
            format: config.logging.format.as_str().to_owned(),
            requests: config
                .logging
                .requests
                .as_ref()
                .map(|requests| wire::RequestLog {
                    file: requests.file.clone(),
                    retention_days: requests.retention_days,
                }),
        }),
        created_unix_ms: unix_ms(SystemTime::now()),
        node: String::new(),
        nodes: config
            .nodes
            .keys()
            .map(|name| wire::NodeInfo {
                name: name.clone(),
                url: configured_url(config, name).unwrap_or_default(),
            })
            .collect(),
        // Per node, on its own stream ([`crate::hop_keys`]).
        hop_peers: Vec::new(),
    }
}

/// Models with their bytes, as the snapshot carries them.
fn model_sizes(models: &[(String, u64)]) -> Vec<wire::ModelSize> {
    models
        .iter()
        .map(|(name, bytes)| wire::ModelSize {
            name: name.clone(),
            bytes: *bytes,
        })
        .collect()
}

/// How peers reach `node` by configuration: `nodes.NAME.url`, else `http://HOST:PORT` of its
/// listener; `None` when it binds any free port (port 0: what it reports is used instead).
pub fn configured_url(config: &Config, node: &str) -> Option<String> {
    let node_override = config.nodes.get(node);
    if let Some(url) = node_override.and_then(|n| n.url.clone()) {
        return Some(url);
    }
    let host = node_override
        .and_then(|n| n.host.as_deref())
        .unwrap_or(&config.proxy.host);
    let port = node_override
        .and_then(|n| n.port)
        .unwrap_or(config.proxy.port);
    if port == 0 {
        return None;
    }
    Some(match host.parse::<std::net::Ipv6Addr>() {
        Ok(ip) => format!("http://[{ip}]:{port}"),
        Err(_) => format!("http://{host}:{port}"),
    })
}

/// The snapshot as one node sees it: its name, its listener override applied, and the keys of
/// cloud hosts only where it owns them (a key is a secret a node that never sends to the host
/// has no use for).
pub fn for_node(
    snapshot: &wire::PolicySnapshot,
    config: &Config,
    node: &str,
) -> wire::PolicySnapshot {
    let mut snapshot = snapshot.clone();
    snapshot.node = node.to_owned();
    for host in &mut snapshot.hosts {
        if !host.node.is_empty() && host.node != node {
            host.cloud_keys.clear();
        }
    }
    if let (Some(node_override), Some(listener)) =
        (config.nodes.get(node), snapshot.listener.as_mut())
    {
        if let Some(host) = &node_override.host {
            listener.host = host.clone();
        }
        if let Some(port) = node_override.port {
            listener.port = u32::from(port);
        }
    }
    snapshot
}

/// The wire form of a tier.
pub fn tier_to_wire(tier: Tier) -> wire::Tier {
    match tier {
        Tier::High => wire::Tier::High,
        Tier::Normal => wire::Tier::Normal,
        Tier::Low => wire::Tier::Low,
    }
}

/// The config form of a wire tier; `None` for unspecified.
pub fn tier_from_wire(tier: i32) -> Option<Tier> {
    match wire::Tier::try_from(tier).ok()? {
        wire::Tier::High => Some(Tier::High),
        wire::Tier::Normal => Some(Tier::Normal),
        wire::Tier::Low => Some(Tier::Low),
        wire::Tier::Unspecified => None,
    }
}

/// The wire form of a scope.
pub fn scope_to_wire(scope: Scope) -> wire::Scope {
    match scope {
        Scope::Read => wire::Scope::Read,
        Scope::Inference => wire::Scope::Inference,
        Scope::Management => wire::Scope::Management,
    }
}

/// Index of a tier in per-tier arrays (high, normal, low).
pub fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::High => 0,
        Tier::Normal => 1,
        Tier::Low => 2,
    }
}

/// A listener's TLS files on the wire: the paths only.
fn tls_files(tls: &crate::config::ListenerTls) -> wire::TlsFiles {
    wire::TlsFiles {
        cert_file: tls.cert_file.display().to_string(),
        key_file: tls.key_file.display().to_string(),
        client_ca_file: tls
            .client_ca_file
            .as_ref()
            .map(|path| path.display().to_string())
            .unwrap_or_default(),
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// An app key's users on the wire.
fn users_to_wire(users: &crate::config::UsersConfig) -> wire::Users {
    let (header, body_field, jwt) = match &users.source {
        crate::config::UserSource::Header(name) => (name.clone(), String::new(), None),
        crate::config::UserSource::BodyField(path) => (String::new(), path.clone(), None),
        crate::config::UserSource::Jwt(jwt) => {
            (String::new(), String::new(), Some(jwt_to_wire(jwt)))
        }
    };
    wire::Users {
        header,
        body_field,
        jwt,
        max_concurrent: users.max_concurrent,
        max_queued: users.max_queued,
        budget: users.budget.as_ref().map(budget_to_wire),
        session_header: users.session_header.clone().unwrap_or_default(),
        rate_limit: users.rate_limit.map(minute_limit_to_wire),
    }
}

/// Per-minute limits on the wire.
pub fn minute_limit_to_wire(limit: crate::config::MinuteLimit) -> wire::RateLimit {
    wire::RateLimit {
        requests_per_minute: limit.requests_per_minute,
        tokens_per_minute: limit.tokens_per_minute,
    }
}

/// A `jwt:` block on the wire, without its keys: the hub adds the key set it last fetched
/// ([`crate::jwks::attach`]).
fn jwt_to_wire(jwt: &crate::config::JwtConfig) -> wire::Jwt {
    wire::Jwt {
        issuer: jwt.issuer.clone(),
        audiences: jwt.audiences.clone(),
        user_claim: jwt.user_claim.clone(),
        header: jwt.header.clone(),
        algorithms: jwt.algorithms.clone(),
        jwks_json: String::new(),
        jwks_error: String::new(),
        claims_to_policy: jwt
            .claims_to_policy
            .as_ref()
            .map(|claims| wire::ClaimsToPolicy {
                claim: claims.claim.clone(),
                policies: claims
                    .policies
                    .iter()
                    .map(|policy| wire::ClaimPolicy {
                        value: policy.value.clone(),
                        max_priority: policy
                            .max_priority
                            .map_or(wire::Tier::Unspecified, tier_to_wire)
                            as i32,
                        models: policy.models.clone(),
                        budget: policy.budget.as_ref().map(budget_to_wire),
                    })
                    .collect(),
            }),
    }
}

/// A budget on the wire, without the figure of what was used (the policy stream adds it
/// as it sends each snapshot, see [`crate::usage`]).
pub fn budget_to_wire(budget: &crate::config::Budget) -> wire::Budget {
    wire::Budget {
        gpu_ns: budget.gpu_ns,
        tokens: budget.tokens,
        window_seconds: budget.window.seconds(),
        window_anchor_unix_s: budget.window.anchor_unix_s(),
        window: budget.window.as_str().to_owned(),
        used: None,
        #[allow(clippy::cast_precision_loss)]
        usd: budget.usd_micros as f64 / 1e6,
    }
}
