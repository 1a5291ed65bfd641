//! Wire snapshot → [`Policy`]. The only place where `oqp_proto` policy types
//! meet the data plane's own; everything after this works on compiled types.

use std::collections::HashSet;
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

/// Most `auth.trusted_proxies` entries (the control plane allows as many).
const MAX_TRUSTED_PROXIES: usize = 64;

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
        let request_timeout = millis(
            proxy.request_timeout_ms,
            Duration::from_secs(300),
            "proxy.request_timeout_ms",
        )?;
        let proxy = ProxySettings {
            tls: tls_files(proxy.tls.clone(), "proxy.tls")?,
            max_concurrent: proxy.max_concurrent,
            allow_model_management: proxy.allow_model_management,
            max_request_body_bytes: bytes(
                proxy.max_request_body_bytes,
                "proxy.max_request_body_bytes",
            )?,
            request_timeout,
            non_streamed_timeout: millis(
                proxy.non_streamed_timeout_ms,
                request_timeout,
                "proxy.non_streamed_timeout_ms",
            )?,
            drain_timeout: millis(
                proxy.drain_timeout_ms,
                Duration::from_secs(30),
                "proxy.drain_timeout_ms",
            )?,
            connections: ConnectionLimits {
                max_connections: count(proxy.max_connections, 4096),
                max_per_ip: count(proxy.max_connections_per_ip, 1024),
                first_request_timeout: millis(
                    proxy.first_request_timeout_ms,
                    Duration::from_secs(10),
                    "proxy.first_request_timeout_ms",
                )?,
                idle_timeout: millis(
                    proxy.idle_timeout_ms,
                    Duration::from_secs(60),
                    "proxy.idle_timeout_ms",
                )?,
                client_stall_timeout: millis(
                    proxy.client_stall_timeout_ms,
                    Duration::from_secs(60),
                    "proxy.client_stall_timeout_ms",
                )?,
            },
            body_read_timeout: millis(
                proxy.body_read_timeout_ms,
                Duration::from_secs(30),
                "proxy.body_read_timeout_ms",
            )?,
            upstream_stall_timeout: millis(
                proxy.upstream_stall_timeout_ms,
                Duration::from_secs(60),
                "proxy.upstream_stall_timeout_ms",
            )?,
        };

        let auth = snapshot.auth.unwrap_or_default();
        let auth = AuthSettings {
            enabled: auth.enabled,
            max_failures: auth.rate_limit_max_failures,
            window: seconds(
                u64::from(auth.rate_limit_window_seconds.max(1)),
                "auth.rate_limit_window_seconds",
            )?,
            trusted_proxies: if auth.trusted_proxies.len() > MAX_TRUSTED_PROXIES {
                return Err(PolicyError::new(format!(
                    "auth.trusted_proxies: at most {MAX_TRUSTED_PROXIES} entries"
                )));
            } else {
                auth.trusted_proxies
                    .iter()
                    .map(|text| text.parse())
                    .collect::<Result<_, _>>()
                    .map_err(|e| PolicyError::new(format!("auth.trusted_proxies: {e}")))?
            },
            metadata_rate: if auth.metadata_per_second > 100_000 || auth.metadata_burst > 1_000_000
            {
                return Err(PolicyError::new(
                    "auth.metadata_rate_limit: at most 100000 per second and a burst of 1000000",
                ));
            } else {
                MetadataRate {
                    per_second: auth.metadata_per_second,
                    burst: auth.metadata_burst.max(1),
                }
            },
        };

        let mut clients = foldhash::HashMap::default();
        let mut clients_by_id: foldhash::HashMap<Arc<str>, Arc<Client>> = Default::default();
        let mut token_clients = Vec::new();
        let mut clients_by_subject: foldhash::HashMap<Arc<str>, Arc<Client>> = Default::default();
        for client in snapshot.clients {
            let client = Arc::new(convert_client(client)?);
            // Several digests may map to one id (a rotated key in its grace
            // period); the id index keeps the first, which is the current key.
            clients_by_id
                .entry(client.id.clone())
                .or_insert_with(|| client.clone());
            let Some(digest) = client.key_digest else {
                match &client.tls_subject {
                    Some(subject) => {
                        if clients_by_subject
                            .insert(subject.clone(), client.clone())
                            .is_some()
                        {
                            return Err(PolicyError::new(format!(
                                "client '{}' shares its tls_subject with another client",
                                client.id
                            )));
                        }
                    }
                    None => token_clients.push(client),
                }
                continue;
            };
            if clients.insert(digest, client.clone()).is_some() {
                return Err(PolicyError::new(format!(
                    "client '{}' shares its key with another client",
                    client.id
                )));
            }
        }

        let queue = convert_queue(snapshot.queue.unwrap_or_default())?;

        let node: Arc<str> = Arc::from(snapshot.node);
        let mut nodes = Vec::with_capacity(snapshot.nodes.len());
        for info in snapshot.nodes {
            let base =
                match info.url.as_str() {
                    "" => None,
                    url => Some(Base::parse(url).map_err(|why| {
                        PolicyError::new(format!("nodes.{}.url: {why}", info.name))
                    })?),
                };
            nodes.push(NodeInfo {
                name: Arc::from(info.name),
                base,
            });
        }
        let mut hosts = Vec::with_capacity(snapshot.hosts.len());
        let mut remote = Vec::new();
        let mut names = HashSet::new();
        for host in snapshot.hosts {
            let host = convert_host(host, proxy.max_concurrent)?;
            if !names.insert(host.name.clone()) {
                return Err(PolicyError::new(format!("duplicate host '{}'", host.name)));
            }
            match &host.owner {
                Some(owner) if *owner != node => remote.push(Arc::new(host)),
                _ => hosts.push(Arc::new(host)),
            }
        }
        if hosts.is_empty() && remote.is_empty() {
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
            acquire_timeout: millis(
                routing.acquire_timeout_ms,
                Duration::from_secs(5),
                "routing.acquire_timeout_ms",
            )?,
            affinity: affinity(routing.affinity)?,
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
            max: match keep_alive.max_seconds {
                0 => DEFAULT_KEEP_ALIVE_MAX,
                seconds => Duration::from_secs(seconds),
            },
            bounded: false,
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
            ttl: seconds(cache.ttl_seconds.max(1), "embedding_cache.ttl_seconds")?,
            max_entry_bytes: bytes(cache.max_entry_bytes, "embedding_cache.max_entry_bytes")?,
            key_prefix: cache.key_prefix,
            connect_timeout: millis(
                cache.connect_timeout_ms,
                Duration::from_secs(2),
                "embedding_cache.connect_timeout_ms",
            )?,
            max_memory_bytes: bytes(cache.max_memory_bytes, "embedding_cache.max_memory_bytes")?,
            per_client: cache.per_client,
            max_inputs: match cache.max_inputs {
                0 => DEFAULT_MAX_EMBED_INPUTS,
                n => usize::try_from(n).map_or(MAX_EMBED_INPUTS, |n| n.min(MAX_EMBED_INPUTS)),
            },
        };

        let dashboard = snapshot.dashboard.unwrap_or_default();
        let dashboard = DashboardSettings {
            enabled: dashboard.enabled,
            refresh: seconds(
                u64::from(dashboard.refresh_seconds.max(1)),
                "dashboard.refresh_seconds",
            )?,
        };

        let delegation_headers = delegation_headers(clients_by_id.values());
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
            let tls = tls_files(listener.tls, "injection listener tls")?;
            injection_listeners.push(InjectionListener {
                addr,
                inject_as,
                tls,
                trust_users: listener.trust_users,
            });
        }

        let request_log = snapshot
            .logging
            .as_ref()
            .and_then(|logging| logging.requests.as_ref())
            .filter(|requests| !requests.file.is_empty())
            .map(|requests| {
                Arc::new(RequestLogSettings {
                    file: requests.file.clone().into(),
                    retention_days: requests.retention_days.max(1),
                })
            });
        let mut hop_peers = foldhash::HashMap::with_capacity_and_hasher(
            snapshot.hop_peers.len(),
            Default::default(),
        );
        for peer in &snapshot.hop_peers {
            let key = |bytes: &[u8]| {
                crate::hop::HopKey::from_bytes(bytes).ok_or_else(|| {
                    PolicyError::new(format!("hop keys of node '{}': not 32 bytes", peer.node))
                })
            };
            let pair = crate::hop::PairKeys {
                sign: key(&peer.sign)?,
                verify: key(&peer.verify)?,
            };
            hop_peers.insert(Arc::from(peer.node.as_str()), pair);
        }
        let log_level = match snapshot.logging.map(|logging| logging.level) {
            None => None,
            Some(level) if level.is_empty() => None,
            Some(level) => Some(LogLevel::parse(&level).ok_or_else(|| {
                PolicyError::new(format!("logging.level '{level}' is not a log level"))
            })?),
        };

        Ok(Policy {
            request_log,
            version: snapshot.version,
            listen,
            proxy,
            auth,
            clients,
            clients_by_id,
            token_clients,
            clients_by_subject,
            queue,
            hosts,
            node,
            remote,
            nodes,
            hop_peers,
            routing,
            keep_alive,
            embedding_cache,
            dashboard,
            injection_listeners,
            log_level,
            delegation_headers,
        })
    }
}

/// Every header an app key names its users or sessions in: none of them reaches an upstream,
/// whichever key sent it.
fn delegation_headers<'a>(clients: impl Iterator<Item = &'a Arc<Client>>) -> Vec<http::HeaderName> {
    let mut names: Vec<http::HeaderName> = Vec::new();
    for users in clients.filter_map(|client| client.users.as_ref()) {
        let user = match &users.source {
            UserSource::Header(name) => Some(name),
            UserSource::Jwt(verifier) => Some(verifier.header()),
            UserSource::BodyField(_) => None,
        };
        for name in user.into_iter().chain(&users.session_header) {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    names
}

fn convert_client(client: wire::Client) -> Result<Client, PolicyError> {
    let id = client.client_id;
    if id.is_empty() {
        return Err(PolicyError::new("a client has an empty client_id"));
    }
    // No digest: each user's token is the credential, which needs users with a `jwt`.
    let token_keyed = client
        .users
        .as_ref()
        .is_some_and(|users| users.jwt.is_some());
    // No digest either: a verified client certificate is the credential.
    let tls_subject =
        (!client.tls_subject.is_empty()).then(|| Arc::from(client.tls_subject.as_str()));
    let key_digest: Option<[u8; 32]> =
        match client.key_sha256.as_slice() {
            [] if token_keyed || tls_subject.is_some() => None,
            digest => Some(digest.try_into().map_err(|_| {
                PolicyError::new(format!("client '{id}': key digest is not 32 bytes"))
            })?),
        };
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
    let budget = convert_budget(&id, client.budget)?;
    let models = (!client.models.is_empty()).then(|| ModelAllowlist::new(&client.models));
    let users = client
        .users
        .map(|users| convert_users(&id, users))
        .transpose()?;
    let rate_limit = MinuteLimit::from_wire(client.rate_limit);
    let capture = (client.capture_max_bytes > 0)
        .then(|| usize::try_from(client.capture_max_bytes).unwrap_or(usize::MAX));
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
        budget,
        models,
        users,
        tls_subject,
        rate_limit,
        capture,
    })
}

fn convert_budget(
    id: &str,
    budget: Option<wire::Budget>,
) -> Result<Option<UsageBudget>, PolicyError> {
    Ok(match budget {
        None => None,
        Some(budget) if budget.gpu_ns == 0 && budget.tokens == 0 && usd_micros(budget.usd) == 0 => {
            None
        }
        Some(budget) if budget.window_seconds == 0 => {
            return Err(PolicyError::new(format!(
                "client '{id}': budget window must be at least one second"
            )));
        }
        Some(budget) => Some(UsageBudget {
            gpu_ns: budget.gpu_ns,
            tokens: budget.tokens,
            usd_micros: usd_micros(budget.usd),
            window_seconds: budget.window_seconds,
            anchor_unix_s: budget.window_anchor_unix_s,
            window: budget.window,
            used: budget
                .used
                .map(|used| Used::from_wire(&used))
                .unwrap_or_default(),
        }),
    })
}

fn convert_users(id: &str, users: wire::Users) -> Result<Users, PolicyError> {
    if id.contains('/') {
        return Err(PolicyError::new(format!(
            "client '{id}': a client_id with users must not contain '/'"
        )));
    }
    let header = |name: &str, what: &str| {
        http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            PolicyError::new(format!("client '{id}': users.{what} is not a header name"))
        })
    };
    let named = match &users.jwt {
        Some(jwt) if jwt.header.is_empty() => "authorization token".to_owned(),
        Some(jwt) => format!("{} token", jwt.header),
        None if users.header.is_empty() => format!("body field {}", users.body_field),
        None => users.header.clone(),
    };
    let (source, claims_to_policy) = match (users.header.is_empty(), users.body_field.is_empty()) {
        (true, true) if users.jwt.is_some() => {
            let jwt = users.jwt.unwrap_or_default();
            let settings = crate::jwt::Settings {
                issuer: &jwt.issuer,
                audiences: &jwt.audiences,
                user_claim: &jwt.user_claim,
                header: &jwt.header,
                algorithms: &jwt.algorithms,
                jwks_json: &jwt.jwks_json,
                jwks_error: &jwt.jwks_error,
            };
            let claims_to_policy = jwt
                .claims_to_policy
                .as_ref()
                .map(|claims| {
                    super::ClaimsToPolicy::try_new(claims, |policy| {
                        convert_budget(id, policy.budget.clone()).map_err(|error| error.0)
                    })
                })
                .transpose()
                .map_err(|why| PolicyError::new(format!("client '{id}': users.jwt.{why}")))?;
            let verifier = crate::jwt::Verifier::try_new(&settings)
                .map_err(|why| PolicyError::new(format!("client '{id}': users.{why}")))?
                .with_choosing_claim(
                    claims_to_policy
                        .as_ref()
                        .map(|claims| claims.claim().to_owned()),
                );
            (UserSource::Jwt(Arc::new(verifier)), claims_to_policy)
        }
        _ if users.jwt.is_some() => {
            return Err(PolicyError::new(format!(
                "client '{id}': users needs exactly one of header, body_field and jwt"
            )));
        }
        (false, true) => (UserSource::Header(header(&users.header, "header")?), None),
        (true, false) => {
            let path: Vec<String> = users.body_field.split('.').map(str::to_owned).collect();
            if path.iter().any(String::is_empty) {
                return Err(PolicyError::new(format!(
                    "client '{id}': users.body_field is not a path of keys"
                )));
            }
            (UserSource::BodyField(path), None)
        }
        _ => {
            return Err(PolicyError::new(format!(
                "client '{id}': users needs exactly one of header, body_field and jwt"
            )));
        }
    };
    let session_header = (!users.session_header.is_empty())
        .then(|| header(&users.session_header, "session_header"))
        .transpose()?;
    Ok(Users {
        source,
        named,
        max_concurrent: users.max_concurrent,
        max_queued: users.max_queued,
        budget: convert_budget(id, users.budget)?,
        session_header,
        rate_limit: MinuteLimit::from_wire(users.rate_limit),
        claims_to_policy,
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
            max_wait: bounded(
                Duration::from_millis(settings.max_wait_ms),
                &format!("queue.{name}.max_wait_ms"),
            )?,
            high_watermark_pct: settings.high_watermark_pct,
            promote_after: match settings.promote_after_ms {
                0 => None,
                ms => Some(bounded(
                    Duration::from_millis(ms),
                    &format!("queue.{name}.promote_after_ms"),
                )?),
            },
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
        max_queued_bytes: bytes(queue.max_queued_bytes, "queue.max_queued_bytes")?,
        fair_share_half_life: millis(
            queue.fair_share_half_life_ms,
            Duration::from_secs(60),
            "queue.fair_share_half_life_ms",
        )?,
        drain_generation: queue.drain_generation,
        model_swap: convert_model_swap(queue.model_swap)?,
    })
}

/// `queue.model_swap`: unset (an older control plane) = the defaults; a bound of 0 = its
/// default too (the control plane never sends one).
fn convert_model_swap(
    settings: Option<wire::ModelSwapSettings>,
) -> Result<crate::policy::ModelSwap, PolicyError> {
    let defaults = crate::policy::ModelSwap::default();
    let Some(settings) = settings else {
        return Ok(defaults);
    };
    let [high, normal, low] = defaults.max_defer;
    Ok(crate::policy::ModelSwap {
        enabled: settings.enabled,
        max_defer: [
            millis(
                settings.max_defer_high_ms,
                high,
                "queue.model_swap.max_defer_high_ms",
            )?,
            millis(
                settings.max_defer_normal_ms,
                normal,
                "queue.model_swap.max_defer_normal_ms",
            )?,
            millis(
                settings.max_defer_low_ms,
                low,
                "queue.model_swap.max_defer_low_ms",
            )?,
        ],
        idle_grace: bounded(
            Duration::from_millis(settings.idle_grace_ms),
            "queue.model_swap.idle_grace_ms",
        )?,
        unload: settings.unload,
    })
}

fn convert_host(host: wire::Host, default_slots: u32) -> Result<Host, PolicyError> {
    let name = host.name;
    if name.is_empty() {
        return Err(PolicyError::new("a host has an empty name"));
    }
    let url = host.url.trim_end_matches('/').to_owned();
    let Base { scheme, authority } =
        Base::parse(&url).map_err(|why| PolicyError::new(format!("host '{name}': {why}")))?;
    let kind = match wire::HostKind::try_from(host.kind) {
        Ok(wire::HostKind::Cloud) => HostKind::Cloud,
        Ok(wire::HostKind::Openai) => HostKind::Openai,
        Ok(wire::HostKind::Ollama | wire::HostKind::Unspecified) => HostKind::Ollama,
        Err(_) => return Err(PolicyError::new(format!("host '{name}': unknown kind"))),
    };
    let last_checked = u64::try_from(host.last_checked_unix_ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    let max_concurrent = if host.max_concurrent == 0 {
        default_slots
    } else {
        host.max_concurrent
    };
    Ok(Host {
        name: Arc::from(name),
        scheme,
        authority,
        url,
        weight: host.weight.max(1),
        max_concurrent,
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
        cloud_accounts: host
            .cloud_accounts
            .into_iter()
            .map(cloud_account_from_wire)
            .collect(),
        fallback_models: host.fallback_models,
        owner: (!host.node.is_empty()).then(|| Arc::from(host.node)),
        vram: crate::policy::Vram {
            capacity: (host.vram_bytes > 0).then_some(host.vram_bytes),
            resident: host
                .resident
                .iter()
                .map(|m| (normalize_model(&m.name), m.bytes))
                .collect(),
            sizes: host
                .sizes
                .iter()
                .map(|m| (normalize_model(&m.name), m.bytes))
                .collect(),
        },
        runners: Runners {
            num_parallel: match host.num_parallel {
                0 => max_concurrent,
                n => n,
            },
            overrides: host
                .runner_slots
                .iter()
                .map(|slots| (model_pattern(&slots.pattern), slots.num_parallel.max(1)))
                .collect(),
            forced: host
                .forced_runners
                .iter()
                .map(|forced| {
                    (
                        normalize_model(&forced.model),
                        Arc::from(forced.reason.as_str()),
                    )
                })
                .collect(),
        },
        engine: Engine {
            configured_kind: host.configured_kind,
            detected: (!host.engine.is_empty()).then_some(host.engine),
            learned_slots: (host.learned_slots > 0).then_some(host.learned_slots),
            slot_context: (host.slot_context > 0).then_some(host.slot_context),
            problem: (!host.engine_problem.is_empty()).then_some(host.engine_problem),
            poll_error: (!host.poll_error.is_empty()).then_some(host.poll_error),
        },
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

/// The longest duration a snapshot may carry. The control plane's bounds
/// are tighter; this one keeps every `Instant + duration` and every timer
/// the data plane derives from a snapshot far from overflow, whoever sent it.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 86_400);

/// The largest byte count a snapshot may carry (1 TiB).
pub const MAX_BYTES: u64 = 1 << 40;

/// `value` milliseconds, `default` when 0.
fn millis(value: u64, default: Duration, path: &str) -> Result<Duration, PolicyError> {
    if value == 0 {
        Ok(default)
    } else {
        bounded(Duration::from_millis(value), path)
    }
}

fn seconds(value: u64, path: &str) -> Result<Duration, PolicyError> {
    bounded(Duration::from_secs(value), path)
}

fn bounded(duration: Duration, path: &str) -> Result<Duration, PolicyError> {
    if duration > MAX_DURATION {
        return Err(PolicyError::new(format!(
            "{path}: {} s is above the limit of {} s (366 days)",
            duration.as_secs(),
            MAX_DURATION.as_secs()
        )));
    }
    Ok(duration)
}

/// A byte count that fits both the limit and this machine's `usize`.
fn bytes(value: u64, path: &str) -> Result<u64, PolicyError> {
    if value > MAX_BYTES || usize::try_from(value).is_err() {
        return Err(PolicyError::new(format!(
            "{path}: {value} is above the limit of {MAX_BYTES} bytes (1 TiB)"
        )));
    }
    Ok(value)
}

/// A connection cap: the default when unset (an older control plane).
fn count(value: u32, default: u32) -> u32 {
    if value == 0 { default } else { value }
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

/// `routing.affinity`: absent, the defaults.
fn affinity(wire: Option<wire::AffinitySettings>) -> Result<super::Affinity, PolicyError> {
    let Some(wire) = wire else {
        return Ok(super::Affinity::default());
    };
    let session_header = if wire.session_header.is_empty() {
        None
    } else {
        Some(
            http::HeaderName::from_bytes(wire.session_header.as_bytes()).map_err(|_| {
                PolicyError::new("routing.affinity.session_header is not a header name")
            })?,
        )
    };
    if !(wire.epsilon.is_finite() && wire.epsilon >= 0.0) {
        return Err(PolicyError::new(
            "routing.affinity.epsilon must be 0 or more",
        ));
    }
    if !(wire.prefill_ms_per_1k.is_finite() && wire.prefill_ms_per_1k >= 0.0) {
        return Err(PolicyError::new(
            "routing.affinity.prefill_ms_per_1k must be 0 or more",
        ));
    }
    Ok(super::Affinity {
        enabled: wire.enabled,
        session_header,
        epsilon: wire.epsilon,
        share_across_keys: wire.share_across_keys,
        ram_cache_per_runner: wire.ram_cache_per_runner,
        prefill_per_token: wire.prefill_ms_per_1k / 1_000_000.0,
        max_conversations: wire.max_conversations.max(1),
    })
}

/// A listener's TLS files: both paths, or none at all.
fn tls_files(files: Option<wire::TlsFiles>, what: &str) -> Result<Option<TlsFiles>, PolicyError> {
    let Some(files) = files else {
        return Ok(None);
    };
    if files.cert_file.is_empty() || files.key_file.is_empty() {
        return Err(PolicyError::new(format!(
            "{what} needs both cert_file and key_file"
        )));
    }
    Ok(Some(TlsFiles {
        cert_file: files.cert_file.into(),
        key_file: files.key_file.into(),
        client_ca_file: (!files.client_ca_file.is_empty()).then(|| files.client_ca_file.into()),
    }))
}

/// A cloud account and its balance as the control plane read it; a plan oqp does not know
/// (or none read yet) is an account without a balance.
fn cloud_account_from_wire(account: wire::CloudAccount) -> crate::balance::Account {
    use oqp_proto::balance::{Balance, time_of};
    let finite = |value: f64| if value.is_finite() { value } else { 0.0 };
    let balance = Balance::from_wire(&account);
    crate::balance::Account {
        read_at: balance.as_ref().and(time_of(account.read_at_unix_ms)),
        balance,
        account: Arc::from(account.account),
        team: Arc::from(account.team),
        reserve_usd: finite(account.reserve_usd).max(0.0),
        reserve_percent: finite(account.reserve_percent).clamp(0.0, 100.0),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn budgets_convert_with_their_used_figure_and_refuse_an_empty_window() {
        let client = |budget: wire::Budget| wire::Client {
            client_id: "batch".into(),
            key_sha256: vec![7; 32],
            budget: Some(budget),
            ..wire::Client::default()
        };
        let daily = wire::Budget {
            gpu_ns: 7,
            window_seconds: 86_400,
            window: "1d".into(),
            used: Some(wire::BudgetUsed {
                gpu_ns: 3,
                window_start_unix_s: 86_400,
                ..wire::BudgetUsed::default()
            }),
            ..wire::Budget::default()
        };
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.clients = vec![client(daily.clone())];
        let policy = Policy::try_from(snapshot).unwrap();
        let budget = policy.clients_by_id["batch"].budget.clone().unwrap();
        assert_eq!((budget.gpu_ns, budget.window.as_str()), (7, "1d"));
        assert_eq!(budget.used.gpu_ns, 3);
        assert_eq!(budget.used.window_start_unix_s, 86_400);
        // Neither limit: no budget at all.
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.clients = vec![client(wire::Budget {
            gpu_ns: 0,
            ..daily.clone()
        })];
        assert_eq!(
            Policy::try_from(snapshot).unwrap().clients_by_id["batch"].budget,
            None
        );
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.clients = vec![client(wire::Budget {
            window_seconds: 0,
            ..daily
        })];
        let error = Policy::try_from(snapshot).unwrap_err().to_string();
        assert!(
            error.contains("client 'batch': budget window must be at least one second"),
            "{error}"
        );
    }

    type Edit = fn(&mut wire::PolicySnapshot, u64);

    /// Every duration and size field, with the path its rejection names.
    const FIELDS: &[(&str, Edit)] = &[
        ("proxy.request_timeout_ms", |s, v| {
            s.proxy.as_mut().unwrap().request_timeout_ms = v;
        }),
        ("proxy.non_streamed_timeout_ms", |s, v| {
            s.proxy.as_mut().unwrap().non_streamed_timeout_ms = v;
        }),
        ("proxy.drain_timeout_ms", |s, v| {
            s.proxy.as_mut().unwrap().drain_timeout_ms = v;
        }),
        ("proxy.max_request_body_bytes", |s, v| {
            s.proxy.as_mut().unwrap().max_request_body_bytes = v;
        }),
        ("auth.rate_limit_window_seconds", |s, v| {
            s.auth.get_or_insert_default().rate_limit_window_seconds =
                u32::try_from(v).unwrap_or(u32::MAX);
        }),
        ("queue.high.max_wait_ms", |s, v| {
            s.queue
                .get_or_insert_default()
                .high
                .get_or_insert_default()
                .max_wait_ms = v;
        }),
        ("queue.low.promote_after_ms", |s, v| {
            let low = s.queue.get_or_insert_default().low.get_or_insert_default();
            low.promote_after_ms = v;
        }),
        ("queue.max_queued_bytes", |s, v| {
            s.queue.get_or_insert_default().max_queued_bytes = v;
        }),
        ("queue.fair_share_half_life_ms", |s, v| {
            s.queue.get_or_insert_default().fair_share_half_life_ms = v;
        }),
        ("queue.model_swap.max_defer_high_ms", |s, v| {
            let swap = s
                .queue
                .get_or_insert_default()
                .model_swap
                .get_or_insert_default();
            swap.max_defer_high_ms = v;
        }),
        ("queue.model_swap.max_defer_low_ms", |s, v| {
            let swap = s
                .queue
                .get_or_insert_default()
                .model_swap
                .get_or_insert_default();
            swap.max_defer_low_ms = v;
        }),
        ("queue.model_swap.idle_grace_ms", |s, v| {
            let swap = s
                .queue
                .get_or_insert_default()
                .model_swap
                .get_or_insert_default();
            swap.idle_grace_ms = v;
        }),
        ("routing.acquire_timeout_ms", |s, v| {
            s.routing.get_or_insert_default().acquire_timeout_ms = v;
        }),
        ("embedding_cache.ttl_seconds", |s, v| {
            s.embedding_cache.get_or_insert_default().ttl_seconds = v;
        }),
        ("embedding_cache.connect_timeout_ms", |s, v| {
            s.embedding_cache.get_or_insert_default().connect_timeout_ms = v;
        }),
        ("embedding_cache.max_entry_bytes", |s, v| {
            s.embedding_cache.get_or_insert_default().max_entry_bytes = v;
        }),
        ("embedding_cache.max_memory_bytes", |s, v| {
            s.embedding_cache.get_or_insert_default().max_memory_bytes = v;
        }),
        ("dashboard.refresh_seconds", |s, v| {
            s.dashboard.get_or_insert_default().refresh_seconds =
                u32::try_from(v).unwrap_or(u32::MAX);
        }),
    ];

    #[test]
    fn out_of_range_durations_and_sizes_are_rejected_by_name() {
        for (path, edit) in FIELDS {
            let mut snapshot = crate::policy::minimal_wire();
            edit(&mut snapshot, u64::MAX);
            let error = Policy::try_from(snapshot).expect_err(path).to_string();
            assert!(error.contains(path), "{path}: {error}");
            assert!(error.contains("above the limit"), "{path}: {error}");
        }
        // The value that once panicked the data plane's cache.
        let mut snapshot = crate::policy::minimal_wire();
        snapshot.embedding_cache = Some(wire::EmbeddingCacheSettings {
            enabled: true,
            ttl_seconds: 40_000_000_000,
            ..Default::default()
        });
        assert!(Policy::try_from(snapshot).is_err());
    }

    #[tokio::test]
    async fn the_largest_accepted_values_build_every_part_without_panicking() {
        let mut snapshot = crate::policy::minimal_wire();
        for (_, edit) in FIELDS {
            edit(&mut snapshot, 1);
        }
        let cache = snapshot.embedding_cache.get_or_insert_default();
        cache.enabled = true;
        cache.ttl_seconds = MAX_DURATION.as_secs();
        cache.max_memory_bytes = MAX_BYTES;
        cache.max_entry_bytes = MAX_BYTES;
        let proxy = snapshot.proxy.get_or_insert_default();
        proxy.request_timeout_ms = u64::try_from(MAX_DURATION.as_millis()).unwrap();
        let policy = Policy::try_from(snapshot).unwrap();
        let cache = crate::cache::connect(&policy.embedding_cache)
            .await
            .unwrap();
        let keys = vec!["k".to_owned()];
        cache
            .store(vec![(keys[0].clone(), bytes::Bytes::from_static(b"[1]"))])
            .await;
        assert!(cache.lookup(&keys).await[0].is_some());
    }

    #[test]
    fn model_swap_settings_and_host_vram_convert() {
        use crate::policy::{ModelSwap, Vram};
        // An older control plane sends no settings: the defaults.
        let policy = Policy::try_from(crate::policy::minimal_wire()).unwrap();
        assert_eq!(policy.queue.model_swap, ModelSwap::default());

        let mut snapshot = crate::policy::minimal_wire();
        snapshot.queue.get_or_insert_default().model_swap = Some(wire::ModelSwapSettings {
            enabled: false,
            max_defer_high_ms: 500,
            max_defer_normal_ms: 0,
            max_defer_low_ms: 60_000,
            idle_grace_ms: 0,
            unload: false,
        });
        let host = &mut snapshot.hosts[0];
        host.vram_bytes = 24 << 30;
        host.resident = vec![wire::ModelSize {
            name: "Llama3".into(),
            bytes: 5_000,
        }];
        host.sizes = vec![
            wire::ModelSize {
                name: "llama3:latest".into(),
                bytes: 4_700,
            },
            wire::ModelSize {
                name: "registry.ollama.ai/library/qwen3:8b".into(),
                bytes: 5_200,
            },
        ];
        let policy = Policy::try_from(snapshot).unwrap();
        assert_eq!(
            policy.queue.model_swap,
            ModelSwap {
                enabled: false,
                max_defer: [
                    Duration::from_millis(500),
                    Duration::from_secs(5),
                    Duration::from_secs(60)
                ],
                idle_grace: Duration::ZERO,
                unload: false,
            }
        );
        let host = policy.hosts.first().map(|h| h.vram.clone());
        let expected = Vram {
            capacity: Some(24 << 30),
            resident: vec![(normalize_model("Llama3"), 5_000)],
            sizes: [
                (normalize_model("llama3:latest"), 4_700),
                (
                    normalize_model("registry.ollama.ai/library/qwen3:8b"),
                    5_200,
                ),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(host, Some(expected));
        assert_eq!(normalize_model("Llama3"), normalize_model("llama3:latest"));

        // Unset VRAM fields: capacity learned, nothing known resident.
        let policy = Policy::try_from(crate::policy::minimal_wire()).unwrap();
        let host = policy.hosts.first().map(|h| h.vram.clone());
        assert_eq!(host, Some(Vram::default()));
    }
}
