//! `GET /queue/status` and `GET /queue/summary`: the data plane's own state
//! as JSON, for people, scripts and status widgets.
//!
//! Both are built from one policy load and one
//! [`Dispatcher::stats`](crate::dispatch::Dispatcher::stats) read, at the time
//! of the request; nothing is kept for them on the request path.
//!
//! - `/queue/status` is the reference's nested document (`status`,
//!   `uptime_seconds`, `queue`, `concurrency`, `hosts`, `clients`, `security`)
//!   with oqp's additions (per-tier `cancelled`, `promoted`, `flushed`,
//!   `paused`, `wait`; per-host slots, loaded models and `vram`: resident
//!   models with their bytes, capacity, requests held back for a model
//!   switch; per-client queue
//!   figures, ceiling and scope; `snapshot`). Its `clients` map holds every
//!   configured client plus at most [`MAX_OTHER_CLIENTS`] others (callers that
//!   name themselves with `X-Client-ID` when auth is off), the busiest first:
//!   the reference's map grew without bound.
//!   A key below `management` sees `usage_today` in its own row only (and its
//!   app's users'): what other tenants used is theirs ([`status_response`]).
//! - `/queue/summary` is exactly ten flat scalars and names no client, host or
//!   key: it is the answer most likely to end up on a wall display.
//!
//! "Concurrency" is oqp's: each host has its own slots, so `max` (and the
//! summary's `max_concurrent`) is the sum of the hosts' `max_concurrent`
//! (which defaults to `proxy.max_concurrent` per host), and `active` is the
//! number of those slots in use.

use std::collections::BTreeMap;
use std::time::SystemTime;

use http::Response;
use serde::Serialize;

use crate::body::Body;
use crate::cloud::CloudPools;
use crate::control::ControlLink;
use crate::dispatch::{Dispatcher, QueueReport};
use crate::metrics::{self, Metrics, bounded_clients, is_healthy};
use crate::peers::{PeerStatus, Peers};
use crate::policy::{Client, Host, HostKind, Policy};
use crate::scheduler::{ClientStat, Tier, TierStat};
use crate::snapshot::PolicyStore;
use crate::swap::SwapStat;
use crate::usage::minute::{Level, MinuteLimits};

/// Most unconfigured clients listed in status and metrics.
pub const MAX_OTHER_CLIENTS: usize = metrics::MAX_OTHER_LABELS;

/// What status and summary read of the data plane.
#[derive(Debug, Clone, Copy)]
pub struct Sources<'a> {
    /// Queue, slot and client figures.
    pub dispatcher: &'a Dispatcher,
    /// Wait totals and per-host answers, which only the request path sees.
    pub metrics: &'a Metrics,
    /// Usage today.
    pub usage: &'a crate::usage::Usage,
    /// The Ollama Cloud key pools.
    pub cloud: &'a CloudPools,
    /// The state of the link to the control plane.
    pub control: &'a ControlLink,
    /// The parts of the current snapshot that could not be applied.
    pub store: &'a PolicyStore,
    /// When the data plane started.
    pub started: std::time::Instant,
    /// The other data planes.
    pub peers: &'a Peers,
}

/// The `/queue/status` document.
#[derive(Debug, Serialize)]
pub struct Status {
    status: &'static str,
    uptime_seconds: u64,
    queue: Queue,
    concurrency: Concurrency,
    hosts: Vec<HostStatus>,
    clients: BTreeMap<String, ClientStatus>,
    security: Security,
    snapshot: SnapshotStatus,
    node: NodeStatus,
}

/// This data plane among the others: the hosts it dispatches to (`hosts` above), and every
/// peer with what was forwarded to it.
#[derive(Debug, Serialize)]
struct NodeStatus {
    name: String,
    owns: Vec<String>,
    peers: Vec<PeerStatus>,
}

#[derive(Debug, Serialize)]
struct Queue {
    high: TierStatus,
    normal: TierStatus,
    low: TierStatus,
}

#[derive(Debug, Serialize)]
struct TierStatus {
    depth: u32,
    max_depth: u32,
    processed: u64,
    rejected: u64,
    expired: u64,
    cancelled: u64,
    promoted: u64,
    flushed: u64,
    paused: bool,
    wait: Wait,
}

/// Running totals of the queue wait of dispatched requests: the difference
/// between two polls gives the mean wait in between.
#[derive(Debug, Serialize)]
struct Wait {
    count: u64,
    sum_seconds: f64,
}

#[derive(Debug, Serialize)]
struct Concurrency {
    active: u32,
    max: u32,
}

#[derive(Debug, Serialize)]
struct HostStatus {
    name: String,
    url: String,
    /// How it is sent to: "ollama", "cloud" or "openai" (an `auto` host as detected).
    kind: &'static str,
    /// The kind as configured, when it differs (`auto`).
    #[serde(skip_serializing_if = "Option::is_none")]
    configured_kind: Option<String>,
    /// What answered its last successful poll ("ollama", "llama-server", "openai").
    #[serde(skip_serializing_if = "Option::is_none")]
    engine: Option<String>,
    /// Slots the engine reported (llama-server's `/props`): its runner's slots.
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_slots: Option<u32>,
    /// Each slot's context in tokens, as the engine reported it.
    #[serde(skip_serializing_if = "Option::is_none")]
    slot_context: Option<u32>,
    /// What was wrong with what the engine said about itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_problem: Option<String>,
    /// Why the control plane's last poll of it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    poll_error: Option<String>,
    healthy: bool,
    models: Vec<String>,
    loaded_models: Vec<String>,
    last_checked: Option<String>,
    requests_handled: u64,
    failures: u64,
    /// Requests answered with an error status or an in-band stream error.
    answered_errors: u64,
    slots_in_use: u32,
    max_concurrent: u32,
    /// Cloud hosts: the key pool, redacted (account label or `…` + last 4).
    #[serde(skip_serializing_if = "Option::is_none")]
    cloud_pool: Option<Vec<CloudKeyStatus>>,
    /// Cloud hosts: each account, its balance, reserve, refused models and cooldown.
    #[serde(skip_serializing_if = "Option::is_none")]
    cloud_accounts: Option<Vec<crate::cloud::AccountStatus>>,
    /// Ollama hosts: what the VRAM holds and the requests held back for a model switch.
    #[serde(skip_serializing_if = "Option::is_none")]
    vram: Option<VramStatus>,
}

/// One host's VRAM as status shows it.
#[derive(Debug, Serialize)]
struct VramStatus {
    resident: Vec<ResidentModel>,
    /// Configured, else learned; `null` while unknown.
    capacity_bytes: Option<u64>,
    capacity_learned: bool,
    held: u32,
    /// `null` when nothing is held.
    oldest_held_ms: Option<u64>,
    switching_to: Option<String>,
    switches: u64,
    /// Switches given up: the old model's requests outlasted `max_defer`.
    switches_given_up: u64,
    bypassed: bool,
}

#[derive(Debug, Serialize)]
struct ResidentModel {
    model: String,
    bytes: u64,
}

impl VramStatus {
    /// The dispatcher's view of the host when it has one, else the snapshot's (the control
    /// plane's last poll and the configured capacity), with nothing held.
    fn new(host: &Host, stat: Option<&SwapStat>) -> Self {
        let snapshot;
        let stat = match stat {
            Some(stat) => stat,
            None => {
                snapshot = SwapStat {
                    host: host.name.clone(),
                    resident: host.vram.resident.clone(),
                    capacity: host.vram.capacity,
                    ..SwapStat::default()
                };
                &snapshot
            }
        };
        Self {
            resident: stat
                .resident
                .iter()
                .map(|(model, bytes)| ResidentModel {
                    model: model.clone(),
                    bytes: *bytes,
                })
                .collect(),
            capacity_bytes: stat.capacity,
            capacity_learned: stat.capacity_learned,
            held: stat.held,
            oldest_held_ms: stat
                .oldest_held
                .map(|held| u64::try_from(held.as_millis()).unwrap_or(u64::MAX)),
            switching_to: stat.switching_to.clone(),
            switches: stat.switches,
            switches_given_up: stat.given_up,
            bypassed: stat.bypassed,
        }
    }
}

/// One cloud pool key as status shows it: never the key.
#[derive(Debug, Serialize)]
struct CloudKeyStatus {
    label: String,
    bound_model: Option<String>,
    busy: bool,
    cooldown_until: Option<String>,
    last_error: Option<String>,
}

#[derive(Debug, Serialize)]
struct ClientStatus {
    description: Option<String>,
    processed: u64,
    rejected: u64,
    waiting: u32,
    inflight: u32,
    max_concurrent: u32,
    weight: f64,
    recent_share: f64,
    /// Time the model switches its requests caused stopped other work, charged to it.
    switch_charged_seconds: f64,
    max_priority: Option<&'static str>,
    scope: Option<&'static str>,
    /// Usage today (UTC) over all data planes, as this node knows it; left out for a viewer
    /// that may see only its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage_today: Option<UsageToday>,
    /// Its per-minute limits on this data plane and what their buckets hold; left out for a
    /// client without any.
    #[serde(skip_serializing_if = "Option::is_none")]
    rate_limit: Option<RateLimitStatus>,
    /// Requests refused for a per-minute limit since this node started (an app's: its users'
    /// too); left out while none was.
    #[serde(skip_serializing_if = "is_zero")]
    rate_limited: u64,
    /// The issuer whose tokens name its users, for a `jwt:` key or `users.jwt`.
    #[serde(skip_serializing_if = "Option::is_none")]
    jwt: Option<JwtStatus>,
}

/// A client's token issuer as this node holds it.
#[derive(Debug, Serialize)]
struct JwtStatus {
    issuer: String,
    /// Public keys held to verify tokens.
    keys: usize,
    /// Why every token is refused now (the control plane could not fetch the keys, or they
    /// did not parse); left out while tokens can be verified.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl JwtStatus {
    fn of(client: Option<&Client>) -> Option<Self> {
        let users = client?.users.as_ref()?;
        let crate::policy::UserSource::Jwt(verifier) = &users.source else {
            return None;
        };
        Some(Self {
            issuer: verifier.issuer().to_owned(),
            keys: verifier.key_count(),
            error: verifier.unavailable().map(str::to_owned),
        })
    }
}

fn is_zero(count: &u64) -> bool {
    *count == 0
}

/// A client's per-minute limits (`rate_limit`) on this node.
#[derive(Debug, Serialize)]
struct RateLimitStatus {
    /// 0 = no request limit.
    requests_per_minute: u32,
    /// 0 = no token limit.
    tokens_per_minute: u64,
    /// Whole requests its bucket holds now.
    requests_left: u64,
    /// Whole tokens its bucket holds now.
    tokens_left: u64,
}

impl RateLimitStatus {
    /// `id`'s, from the buckets it has on this node, else its configured limit (full).
    fn of(client: Option<&Client>, id: &str, minute: &MinuteLimits) -> Option<Self> {
        let level = minute.level(id, tokio::time::Instant::now());
        let level = level.or_else(|| {
            let limit = client?.rate_limit?;
            Some(Level {
                limit,
                requests_left: u64::from(limit.requests_per_minute),
                tokens_left: limit.tokens_per_minute,
            })
        })?;
        Some(Self {
            requests_per_minute: level.limit.requests_per_minute,
            tokens_per_minute: level.limit.tokens_per_minute,
            requests_left: level.requests_left,
            tokens_left: level.tokens_left,
        })
    }
}

#[derive(Debug, Serialize)]
struct UsageToday {
    gpu_seconds: f64,
    prompt_tokens: u64,
    completion_tokens: u64,
    requests: u64,
    cached_inputs: u64,
    /// Prompt tokens estimated cached where the requests ran; omitted when none had an
    /// estimate.
    #[serde(skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<u64>,
}

impl UsageToday {
    fn of(totals: crate::usage::Totals) -> Self {
        Self {
            gpu_seconds: (totals.gpu_ns as f64 / 1e6).round() / 1e3,
            prompt_tokens: totals.prompt_tokens,
            completion_tokens: totals.completion_tokens,
            requests: totals.requests,
            cached_inputs: totals.cached_inputs,
            cached_tokens: totals.cached_tokens,
        }
    }
}

#[derive(Debug, Serialize)]
struct Security {
    auth_enabled: bool,
    model_management_allowed: bool,
    active_keys: usize,
}

#[derive(Debug, Serialize)]
struct SnapshotStatus {
    version: u64,
    control_plane_connected: bool,
    last_error: Option<String>,
    /// The version a stale stream last offered (the control plane is behind).
    stale_version: Option<u64>,
    /// Parts of the snapshot not applied, "part: why".
    apply_errors: Vec<String>,
}

/// The `/queue/summary` document: exactly these ten scalars.
#[derive(Debug, Serialize)]
pub struct Summary {
    status: &'static str,
    queued: u32,
    active: u32,
    max_concurrent: u32,
    hosts_healthy: usize,
    hosts_total: usize,
    processed: u64,
    rejected: u64,
    expired: u64,
    uptime_seconds: u64,
}

/// The `/queue/status` response. With `own` (a key below `management`: its client id), only
/// that client's row and its app's users' (`<own>/<user>`) carry `usage_today`.
pub fn status_response(
    sources: Sources<'_>,
    policy: &Policy,
    own: Option<&str>,
    visible: &dyn Fn(&str) -> bool,
) -> Response<Body> {
    let mut status = status(sources, policy);
    status.scope_models(visible);
    if let Some(own) = own {
        for (id, client) in &mut status.clients {
            let mine = id
                .strip_prefix(own)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
            if !mine {
                client.usage_today = None;
            }
        }
    }
    json(&status)
}

impl Status {
    /// Leaves out of the hosts every model `visible` refuses (a key with a model allowlist
    /// sees only the models it may use: installed, loaded, resident, switched to, bound to a
    /// cloud key).
    fn scope_models(&mut self, visible: &dyn Fn(&str) -> bool) {
        for host in &mut self.hosts {
            host.models.retain(|model| visible(model));
            host.loaded_models.retain(|model| visible(model));
            if let Some(vram) = &mut host.vram {
                vram.resident.retain(|resident| visible(&resident.model));
                vram.switching_to = vram.switching_to.take().filter(|model| visible(model));
            }
            for key in host.cloud_pool.iter_mut().flatten() {
                key.bound_model = key.bound_model.take().filter(|model| visible(model));
            }
        }
    }
}

/// The `/queue/summary` response.
pub fn summary_response(sources: Sources<'_>, policy: &Policy) -> Response<Body> {
    json(&summary(sources, policy))
}

/// The status document of this moment.
pub fn status(sources: Sources<'_>, policy: &Policy) -> Status {
    let stats = sources.dispatcher.stats();
    let tier = |tier: Tier| {
        let stat = &stats.tiers[tier.index()];
        let (count, sum_seconds) = sources.metrics.wait_totals(tier);
        TierStatus {
            depth: stat.depth,
            max_depth: policy.queue.tier(tier).max_depth,
            processed: stat.processed,
            rejected: stat.rejected,
            expired: stat.expired,
            cancelled: stat.cancelled,
            promoted: stat.promoted,
            flushed: stat.flushed,
            paused: stat.paused,
            wait: Wait { count, sum_seconds },
        }
    };
    let queue = Queue {
        high: tier(Tier::High),
        normal: tier(Tier::Normal),
        low: tier(Tier::Low),
    };
    let swaps = sources.dispatcher.swap_stats();
    let hosts = policy
        .hosts
        .iter()
        .map(|host| {
            let swap = swaps.iter().find(|stat| stat.host == host.name);
            host_status(sources, host, &stats, swap)
        })
        .collect();
    let now = SystemTime::now();
    let concurrency = Concurrency {
        active: active(&stats),
        max: max_concurrent(policy),
    };
    let health = Health::of(policy, &stats);
    let QueueReport { clients, .. } = stats;
    let clients = bounded_clients(policy, clients)
        .into_iter()
        .map(|(client, stat)| {
            (
                stat.client.to_string(),
                client_status(
                    client.as_deref(),
                    &stat,
                    sources.usage.today(&stat.client, SystemTime::now()),
                    RateLimitStatus::of(client.as_deref(), &stat.client, sources.usage.minute()),
                    sources.usage.minute().refused(&stat.client),
                ),
            )
        })
        .collect();
    Status {
        status: overall(policy, &health),
        uptime_seconds: sources.started.elapsed().as_secs(),
        queue,
        concurrency,
        hosts,
        clients,
        security: Security {
            auth_enabled: policy.auth.enabled,
            model_management_allowed: policy.proxy.allow_model_management,
            active_keys: policy
                .clients
                .values()
                .filter(|client| !client.is_expired(now))
                .count(),
        },
        snapshot: SnapshotStatus {
            version: policy.version,
            control_plane_connected: sources.control.is_connected(),
            last_error: sources.control.last_error(),
            stale_version: Some(sources.control.stale_version()).filter(|v| *v != 0),
            apply_errors: sources.store.failures(),
        },
        node: NodeStatus {
            name: policy.node.to_string(),
            owns: policy
                .hosts
                .iter()
                .map(|host| host.name.to_string())
                .collect(),
            peers: sources.peers.status(policy),
        },
    }
}

/// The summary of this moment.
pub fn summary(sources: Sources<'_>, policy: &Policy) -> Summary {
    let stats = sources.dispatcher.stats();
    let total = |field: fn(&TierStat) -> u64| stats.tiers.iter().map(field).sum::<u64>();
    let health = Health::of(policy, &stats);
    Summary {
        status: overall(policy, &health),
        queued: stats.tiers.iter().map(|t| t.depth).sum(),
        active: active(&stats),
        max_concurrent: max_concurrent(policy),
        hosts_healthy: health.healthy,
        hosts_total: health.total,
        processed: total(|t| t.processed),
        rejected: total(|t| t.rejected),
        expired: total(|t| t.expired),
        uptime_seconds: sources.started.elapsed().as_secs(),
    }
}

/// How many of this node's hosts can take a request now.
#[derive(Debug, Clone, Copy)]
struct Health {
    healthy: usize,
    total: usize,
}

impl Health {
    fn of(policy: &Policy, stats: &QueueReport) -> Self {
        Self {
            healthy: policy
                .hosts
                .iter()
                .filter(|host| is_healthy(host, stats))
                .count(),
            total: policy.hosts.len(),
        }
    }
}

/// The one word of status and summary: `ok` when every host this node dispatches to is
/// up, `degraded` when some are down, `down` when none can take a request. A node that owns
/// no host (an edge that forwards every request) is judged by the other nodes' hosts as
/// the snapshot knows them.
fn overall(policy: &Policy, own: &Health) -> &'static str {
    let (healthy, total) = if own.total > 0 {
        (own.healthy, own.total)
    } else {
        let healthy = policy.remote.iter().filter(|host| host.healthy).count();
        (healthy, policy.remote.len())
    };
    if total == 0 || healthy == 0 {
        "down"
    } else if healthy < total {
        "degraded"
    } else {
        "ok"
    }
}

fn client_status(
    client: Option<&Client>,
    stat: &ClientStat,
    today: crate::usage::Totals,
    rate_limit: Option<RateLimitStatus>,
    rate_limited: u64,
) -> ClientStatus {
    ClientStatus {
        description: client
            .map(|c| c.description.clone())
            .filter(|d| !d.is_empty()),
        processed: stat.processed,
        rejected: stat.rejected,
        waiting: stat.waiting,
        inflight: stat.inflight,
        max_concurrent: client.map_or(0, |c| c.max_concurrent),
        weight: stat.weight,
        recent_share: stat.recent_share,
        switch_charged_seconds: stat.switch_charged.as_secs_f64(),
        max_priority: client.map(|c| c.max_priority.as_str()),
        scope: client.map(|c| c.scope.as_str()),
        usage_today: Some(UsageToday::of(today)),
        rate_limit,
        rate_limited,
        jwt: JwtStatus::of(client),
    }
}

fn host_status(
    sources: Sources<'_>,
    host: &Host,
    stats: &QueueReport,
    swap: Option<&SwapStat>,
) -> HostStatus {
    let (requests_handled, failures) = sources.metrics.host_counts(&host.name);
    HostStatus {
        name: host.name.to_string(),
        url: without_userinfo(&host.url),
        kind: host.kind.as_str(),
        configured_kind: Some(host.engine.configured_kind.clone())
            .filter(|configured| !configured.is_empty() && configured != host.kind.as_str()),
        engine: host.engine.detected.clone(),
        engine_slots: host.engine.learned_slots,
        slot_context: host.engine.slot_context,
        engine_problem: host.engine.problem.clone(),
        poll_error: host.engine.poll_error.clone(),
        healthy: is_healthy(host, stats),
        models: sorted(&host.installed_names),
        loaded_models: sorted(&host.loaded_names),
        // The later of the snapshot's poll and the last one the control plane reported
        // (a poll that changed nothing publishes no snapshot).
        last_checked: host
            .last_checked
            .max(sources.control.polled(&host.name))
            .map(iso8601),
        requests_handled,
        failures,
        answered_errors: sources.metrics.host_errors(&host.name),
        slots_in_use: stats
            .slots
            .get(&host.name)
            .map_or(0, |stat| stat.slots_in_use),
        max_concurrent: host.max_concurrent,
        cloud_pool: sources.cloud.get(&host.name).map(|pool| {
            pool.snapshot()
                .into_iter()
                .map(|key| CloudKeyStatus {
                    label: key.label,
                    bound_model: key.bound_model.map(|m| m.to_string()),
                    busy: key.busy,
                    cooldown_until: key.cooldown_until.map(iso8601),
                    last_error: key.last_error.map(|e| e.to_string()),
                })
                .collect()
        }),
        cloud_accounts: sources
            .cloud
            .get(&host.name)
            .map(|pool| pool.account_status()),
        vram: (host.kind == HostKind::Ollama).then(|| VramStatus::new(host, swap)),
    }
}

fn active(stats: &QueueReport) -> u32 {
    stats.slots.values().map(|stat| stat.slots_in_use).sum()
}

fn max_concurrent(policy: &Policy) -> u32 {
    policy
        .hosts
        .iter()
        .fold(0u32, |sum, host| sum.saturating_add(host.max_concurrent))
}

fn sorted(names: &[String]) -> Vec<String> {
    let mut names = names.to_vec();
    names.sort();
    names
}

/// `2026-04-21T08:00:00+00:00`, the reference's form.
fn iso8601(at: SystemTime) -> String {
    let text = humantime::format_rfc3339_seconds(at).to_string();
    match text.strip_suffix('Z') {
        Some(stem) => format!("{stem}+00:00"),
        None => text,
    }
}

/// A URL without `user:password@`: the control plane refuses credentials in
/// host URLs, and status must not show them even if one got through.
fn without_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

fn json(value: &impl Serialize) -> Response<Body> {
    crate::body::json_response(serde_json::to_value(value).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn urls_lose_their_userinfo() {
        assert_eq!(
            without_userinfo("http://u:p@gpu:11434/x"),
            "http://gpu:11434/x"
        );
        assert_eq!(without_userinfo("http://gpu:11434"), "http://gpu:11434");
        assert_eq!(without_userinfo("http://gpu/a@b"), "http://gpu/a@b");
    }

    #[test]
    fn the_status_word_follows_the_hosts() {
        let policy = policy_with_clients(&[]);
        let word = |healthy, total| overall(&policy, &Health { healthy, total });
        assert_eq!(word(2, 2), "ok");
        assert_eq!(word(1, 2), "degraded");
        assert_eq!(word(0, 2), "down");
        assert_eq!(word(0, 0), "down", "no host anywhere serves nothing");
    }

    #[test]
    fn times_use_the_reference_offset() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(86_400);
        assert_eq!(iso8601(at), "1970-01-02T00:00:00+00:00");
    }

    fn policy_with_clients(ids: &[&str]) -> Policy {
        use oqp_proto::policy::v1 as wire;
        Policy::try_from(wire::PolicySnapshot {
            version: 1,
            listener: Some(wire::Listener {
                host: "127.0.0.1".into(),
                port: 0,
            }),
            proxy: Some(wire::ProxySettings {
                max_concurrent: 1,
                ..Default::default()
            }),
            clients: ids
                .iter()
                .enumerate()
                .map(|(i, id)| wire::Client {
                    client_id: (*id).to_owned(),
                    key_sha256: vec![i as u8; 32],
                    ..Default::default()
                })
                .collect(),
            hosts: vec![wire::Host {
                name: "gpu".into(),
                url: "http://127.0.0.1:1".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .unwrap()
    }

    fn stat(client: &str, waiting: u32, processed: u64) -> ClientStat {
        ClientStat {
            client: Arc::from(client),
            weight: 1.0,
            waiting,
            inflight: 0,
            processed,
            rejected: 0,
            recent_share: 0.0,
            switch_charged: std::time::Duration::ZERO,
        }
    }

    #[test]
    fn unconfigured_clients_are_bounded_busiest_first() {
        let policy = policy_with_clients(&["chat", "batch"]);
        let mut stats: Vec<ClientStat> = (0..MAX_OTHER_CLIENTS + 20)
            .map(|i| stat(&format!("anon-{i:03}"), 0, i as u64))
            .collect();
        stats.push(stat("busy", 3, 0));
        stats.push(stat("chat", 1, 5));
        let clients = bounded_clients(&policy, stats);
        assert_eq!(clients.len(), 2 + MAX_OTHER_CLIENTS);
        let ids: Vec<&str> = clients.iter().map(|(_, s)| &*s.client).collect();
        assert_eq!(&ids[..3], ["batch", "chat", "busy"]);
        assert_eq!(clients[1].1.processed, 5, "configured figures are kept");
        assert!(clients[0].0.is_some() && clients[2].0.is_none());
        assert!(
            !ids.contains(&"anon-000"),
            "the least busy others are dropped"
        );
    }
}
