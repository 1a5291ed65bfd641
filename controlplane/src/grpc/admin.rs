//! `AdminService`: what oqpctl (and the data planes' HTTP management
//! endpoints) call. Every RPC checks the caller's oqp key, from the config
//! file or the key store: `read` scope for the Get/List calls, `management`
//! for everything that changes state.
//!
//! With `auth.enabled: false` there are no keys to check: the Get/List calls
//! are open, a call that changes state is accepted only from a loopback peer
//! or with the node token (what a data plane on another box presents), and
//! no key is minted (a key made now would wait in the store, unnoticed, for
//! the day auth is enabled).
//!
//! The key RPCs are thin: the [`KeyStore`] validates, persists and
//! publishes; this module converts wire types and maps [`KeyError`]s to gRPC
//! codes (ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION for config keys,
//! INVALID_ARGUMENT, INTERNAL when the store cannot be written).
//!
//! `GetStatus` and `ListHosts` also say who owns what when there are several
//! GPU boxes (`nodes`).

mod cloud;
mod credentials;
mod nodes;
mod swap;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::Stream;
use oqp_dataplane::node_keys;
use oqp_dataplane::policy::ModelAllowlist;
use oqp_proto::admin::v1::{self as api, admin_service_server::AdminService};
use oqp_proto::policy::v1 as wire;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::audit::{self, Audit, Outcome};
use crate::compile::{self, scope_to_wire, tier_from_wire, tier_index, tier_to_wire, unix_ms};
use crate::config::{Scope, Tier};
use crate::hub::Hub;
use crate::keystore::{self, KeyError, KeyStore, NewKey, Record};
use crate::node_credentials::NodeCredentials;
use crate::usage::UsageStore;

/// Re-reads the config file; returns the new version and the warnings.
pub type Reloader = Arc<dyn Fn() -> Result<(u64, Vec<String>), String> + Send + Sync>;

/// Serves the admin API.
#[derive(Clone)]
pub struct AdminApi {
    hub: Arc<Hub>,
    keys: Arc<KeyStore>,
    credentials: Arc<NodeCredentials>,
    usage: Arc<UsageStore>,
    reload: Reloader,
    shutdown: CancellationToken,
    audit: Arc<Audit>,
}

impl std::fmt::Debug for AdminApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminApi").finish_non_exhaustive()
    }
}

/// The actor of a refused call whose credential named no key.
const UNKNOWN_ACTOR: &str = "unknown";

/// How long a node may stay silent and still count as reporting.
const REPORT_FRESH: Duration = Duration::from_secs(5);

impl AdminApi {
    /// An API over `hub`, the key store `keys` and the nodes' own tokens
    /// `credentials`, reloading with `reload`; drain streams end when `shutdown` is
    /// cancelled.
    pub fn new(
        hub: Arc<Hub>,
        keys: Arc<KeyStore>,
        credentials: Arc<NodeCredentials>,
        usage: Arc<UsageStore>,
        reload: Reloader,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            hub,
            keys,
            credentials,
            usage,
            reload,
            shutdown,
            audit: Audit::in_memory(),
        }
    }

    /// Records management actions and refused calls in `audit` (by
    /// default, a trail in memory).
    pub fn with_audit(mut self, audit: Arc<Audit>) -> Self {
        self.audit = audit;
        self
    }

    /// Records `action` on `target` by `actor` with the outcome of `result`.
    fn record<T>(
        &self,
        actor: &str,
        source: Option<SocketAddr>,
        action: &str,
        target: &str,
        result: &Result<T, Status>,
    ) {
        let (outcome, reason) = match result {
            Ok(_) => (Outcome::Ok, ""),
            Err(status) => (outcome_of(status), status.message()),
        };
        self.audit
            .record(actor, source, action, target, outcome, reason);
    }

    /// Checks the caller's key (a config key, or a stored key that is
    /// current or in its grace period, and not expired) against `needed`.
    /// With `auth.enabled: false` reads are open, as on the HTTP side, and
    /// changes need a loopback peer or the node token
    /// ([`open_change_allowed`]).
    /// A refused call is recorded in the audit trail as `action`.
    fn authorize<T>(
        &self,
        request: &Request<T>,
        needed: Scope,
        action: &str,
    ) -> Result<Seen, Status> {
        self.authorize_as(request, needed, action)
            .map(|(seen, _)| seen)
    }

    /// [`authorize`](Self::authorize), with the actor the audit trail
    /// names: the key's `client_id`, `node` for the node token and
    /// `local` for an open call with auth off.
    fn authorize_as<T>(
        &self,
        request: &Request<T>,
        needed: Scope,
        action: &str,
    ) -> Result<(Seen, String), Status> {
        let checked = self.check(request, needed);
        if let Err((status, actor)) = &checked {
            self.audit.record(
                actor,
                request.remote_addr(),
                action,
                "",
                Outcome::Refused,
                status.message(),
            );
        }
        checked.map_err(|(status, _)| status)
    }

    /// The check itself; a refusal carries the actor as far as it is known
    /// (`unknown` for a missing or wrong credential).
    fn check<T>(
        &self,
        request: &Request<T>,
        needed: Scope,
    ) -> Result<(Seen, String), (Status, String)> {
        let unknown = |status: Status| (status, UNKNOWN_ACTOR.to_owned());
        let config = self.hub.config();
        if !config.auth.enabled {
            let presented = request
                .metadata()
                .get(oqp_proto::NODE_TOKEN_METADATA)
                .and_then(|value| value.to_str().ok());
            // The shared node token, or a node's own (its admin credential).
            let token = presented.is_some_and(|presented| {
                config
                    .control_plane
                    .node_token
                    .as_ref()
                    .is_some_and(|expected| {
                        let expected = node_keys::admin_credential(expected.expose());
                        super::secrets_match(presented, &expected)
                    })
                    || self.credentials.admin_holder(presented).is_some()
            });
            if needed == Scope::Read
                || open_change_allowed(request.remote_addr(), request.local_addr(), token)
            {
                let actor = if token { "node" } else { audit::LOCAL };
                return Ok((Seen::All, actor.to_owned()));
            }
            return Err(unknown(Status::permission_denied(
                "auth is disabled (auth.enabled: false): calls that change state are accepted \
                 only from loopback or with the node token; enable auth and use a management key",
            )));
        }
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, key) = value.split_once(' ')?;
                let key = key.trim();
                (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
            })
            .ok_or_else(|| {
                unknown(Status::unauthenticated(
                    "missing or invalid authorization header: this control plane needs an oqp \
                     key (oqpctl: --key-file PATH or env OQPCTL_KEY)",
                ))
            })?;
        let (scope, client, _) = self
            .key_of(&config, presented)
            .ok_or_else(|| unknown(Status::unauthenticated("invalid api key")))?;
        if scope >= needed {
            Ok(if scope >= Scope::Management {
                (Seen::All, client)
            } else {
                (Seen::Own(client.clone()), client)
            })
        } else {
            Err((
                Status::permission_denied(format!("{} permission required", needed.as_str())),
                client,
            ))
        }
    }

    /// The scope, client and models (empty = every model) of the key `presented`: a
    /// config key, or a stored key that is current or in its grace period, not expired.
    fn key_of(
        &self,
        config: &crate::config::Config,
        presented: &str,
    ) -> Option<(Scope, String, Vec<String>)> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let now = SystemTime::now();
        config
            .auth
            .keys
            .iter()
            .find(|key| {
                key.key
                    .as_ref()
                    .is_some_and(|secret| keystore::digests_match(&secret.sha256(), &digest))
                    && key.expires.is_none_or(|at| at > now)
            })
            .map(|key| (key.scope, key.client_id.clone(), key.models.clone()))
            .or_else(|| self.keys.holder_with_models(&digest, unix_ms(now)))
    }

    /// The models the caller's key may use, when it has a model allowlist
    /// (`auth.keys[].models`): what it is shown of the hosts is limited to them, as
    /// `/queue/status` limits it. `None` (every model) with auth off or no allowlist.
    fn caller_models<T>(&self, request: &Request<T>) -> Option<ModelAllowlist> {
        let config = self.hub.config();
        if !config.auth.enabled {
            return None;
        }
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, key) = value.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
            })?;
        let (_, _, models) = self.key_of(&config, presented)?;
        (!models.is_empty()).then(|| ModelAllowlist::new(&models))
    }

    /// Refuses to mint a key while auth is off.
    fn refuse_minting_with_auth_off(&self) -> Result<(), Status> {
        if self.hub.config().auth.enabled {
            return Ok(());
        }
        Err(Status::failed_precondition(
            "auth is disabled (auth.enabled: false): no key is minted, since the proxy asks \
             for none and a key made now would wait in the key store for the day auth is \
             enabled; set auth.enabled: true and reload first",
        ))
    }

    /// Pause, resume and flush: authorizes the caller, applies `change` to
    /// the asked tier (or every tier) and publishes one snapshot.
    fn tier_change(
        &self,
        request: &Request<api::TierRequest>,
        status: &str,
        action: &str,
        change: impl Fn(&mut compile::Runtime, usize),
    ) -> Result<Response<api::TierResponse>, Status> {
        let (_, actor) = self.authorize_as(request, Scope::Management, action)?;
        let tier = tier_from_wire(request.get_ref().tier);
        self.audit.record(
            &actor,
            request.remote_addr(),
            action,
            tier.map_or("all", Tier::as_str),
            Outcome::Ok,
            "",
        );
        let tiers = tier.map_or(Tier::ALL.to_vec(), |tier| vec![tier]);
        let version = self.hub.update_runtime(|runtime| {
            for tier in &tiers {
                change(runtime, tier_index(*tier));
            }
        });
        Ok(Response::new(api::TierResponse {
            status: status.to_owned(),
            tier: tier.map_or("all", Tier::as_str).to_owned(),
            snapshot_version: version,
        }))
    }
}

type DrainStream = Pin<Box<dyn Stream<Item = Result<api::DrainProgress, Status>> + Send>>;

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn get_status(
        &self,
        request: Request<api::GetStatusRequest>,
    ) -> Result<Response<api::GetStatusResponse>, Status> {
        self.authorize(&request, Scope::Read, "status.get")?;
        let config = self.hub.config();
        let inventory = self.hub.inventory();
        let runtime = self.hub.runtime();
        // Every node's peer URL, as the data planes are told it (no node is
        // named "", so none is left out).
        let urls = self
            .hub
            .loads_for("")
            .into_iter()
            .map(|load| (load.node, load.url))
            .collect();
        let nodes = nodes::statuses(&config, self.hub.nodes(), &urls);
        let hosts_healthy = config
            .ollama
            .hosts
            .iter()
            .filter(|host| inventory.get(&host.name).is_none_or(|i| i.healthy))
            .count();
        let mut warnings = Vec::new();
        if !inventory.is_empty() && hosts_healthy == 0 {
            warnings.push("no upstream host answered the last poll".to_owned());
        }
        warnings.extend(self.keys.warnings(&config));
        warnings.extend(node_warnings(&self.hub));
        warnings.extend(nodes::warnings(&config, &nodes));
        Ok(Response::new(api::GetStatusResponse {
            software_version: env!("CARGO_PKG_VERSION").to_owned(),
            uptime_seconds: self.hub.started().elapsed().as_secs(),
            snapshot_version: self.hub.current().version,
            nodes,
            hosts_total: u32::try_from(config.ollama.hosts.len()).unwrap_or(u32::MAX),
            hosts_healthy: u32::try_from(hosts_healthy).unwrap_or(u32::MAX),
            warnings,
            paused_tiers: Tier::ALL
                .iter()
                .filter(|tier| runtime.paused[tier_index(**tier)])
                .map(|tier| tier.as_str().to_owned())
                .collect(),
        }))
    }

    async fn list_keys(
        &self,
        request: Request<api::ListKeysRequest>,
    ) -> Result<Response<api::ListKeysResponse>, Status> {
        let seen = self.authorize(&request, Scope::Read, "keys.list")?;
        // From the sources rather than the snapshot: expired stored keys
        // are listed (as expired) although no snapshot carries them, and a
        // key in its grace period is one row, not two.
        let config = self.hub.config();
        let last_used = last_used_by_client(&self.hub);
        let used = |client_id: &str| last_used.get(client_id).copied().unwrap_or(0);
        let mut keys: Vec<api::KeyInfo> = config
            .auth
            .keys
            .iter()
            .map(|key| api::KeyInfo {
                client_id: key.client_id.clone(),
                source: "config".to_owned(),
                scope: scope_to_wire(key.scope) as i32,
                max_priority: tier_to_wire(key.max_priority) as i32,
                max_concurrent: key.max_concurrent,
                weight: key.weight,
                description: key.description.clone().unwrap_or_default(),
                created_unix_ms: 0,
                expires_unix_ms: key.expires.map_or(0, unix_ms),
                last_used_unix_ms: used(&key.client_id),
                default_priority: tier_to_wire(key.default_priority) as i32,
                max_queued: key.max_queued,
                budget: key
                    .budget
                    .as_ref()
                    .map(|budget| key_budget(budget, &key.client_id, Some(&self.usage))),
                models: key.models.clone(),
                users: key
                    .users
                    .as_ref()
                    .map_or_else(String::new, |users| match &users.source {
                        crate::config::UserSource::Header(name) => format!("header {name}"),
                        crate::config::UserSource::BodyField(path) => format!("body field {path}"),
                        crate::config::UserSource::Jwt(jwt) => {
                            let keys = match self.hub.jwks(&jwt.jwks) {
                                None => " (issuer keys not fetched yet)".to_owned(),
                                Some(keys) if keys.json.is_empty() => {
                                    format!(" (no issuer keys: {})", keys.error)
                                }
                                Some(_) => String::new(),
                            };
                            format!("token in {} from {}{keys}", jwt.header, jwt.issuer)
                        }
                    }),
            })
            .collect();
        keys.extend(self.keys.records().iter().map(|record| {
            let mut info = key_info(record, used(&record.client_id));
            info.budget = record
                .budget
                .as_ref()
                .map(|budget| key_budget(budget, &record.client_id, Some(&self.usage)));
            info
        }));
        keys.retain(|key| seen.shows(&key.client_id));
        Ok(Response::new(api::ListKeysResponse { keys }))
    }

    async fn add_key(
        &self,
        request: Request<api::AddKeyRequest>,
    ) -> Result<Response<api::AddKeyResponse>, Status> {
        let (_, actor) = self.authorize_as(&request, Scope::Management, "keys.add")?;
        let source = request.remote_addr();
        let client_id = request.get_ref().client_id.clone();
        let issued = async {
            self.refuse_minting_with_auth_off()?;
            let new = new_key(request.into_inner())?;
            let keys = self.keys.clone();
            blocking(move || keys.add(new, SystemTime::now())).await
        }
        .await;
        self.record(&actor, source, "keys.add", &client_id, &issued);
        let issued = issued?;
        tracing::info!(
            client_id = %issued.record.client_id,
            version = issued.snapshot_version,
            "key added"
        );
        Ok(Response::new(api::AddKeyResponse {
            info: Some(key_info(&issued.record, 0)),
            key: issued.key.expose().to_owned(),
            snapshot_version: issued.snapshot_version,
        }))
    }

    async fn rotate_key(
        &self,
        request: Request<api::RotateKeyRequest>,
    ) -> Result<Response<api::RotateKeyResponse>, Status> {
        let (_, actor) = self.authorize_as(&request, Scope::Management, "keys.rotate")?;
        let source = request.remote_addr();
        let request = request.into_inner();
        let client_id = request.client_id.clone();
        let issued = async {
            self.refuse_minting_with_auth_off()?;
            let grace = Duration::from_secs(request.grace_seconds);
            let keys = self.keys.clone();
            blocking(move || keys.rotate(&request.client_id, grace, SystemTime::now())).await
        }
        .await;
        self.record(&actor, source, "keys.rotate", &client_id, &issued);
        let issued = issued?;
        tracing::info!(
            client_id = %issued.record.client_id,
            version = issued.snapshot_version,
            old_key_until_unix_ms = issued.old_key_until_unix_ms,
            "key rotated"
        );
        let last_used = last_used_by_client(&self.hub)
            .get(&issued.record.client_id)
            .copied()
            .unwrap_or(0);
        Ok(Response::new(api::RotateKeyResponse {
            info: Some(key_info(&issued.record, last_used)),
            key: issued.key.expose().to_owned(),
            old_key_expires_unix_ms: issued.old_key_until_unix_ms,
            snapshot_version: issued.snapshot_version,
        }))
    }

    async fn revoke_key(
        &self,
        request: Request<api::RevokeKeyRequest>,
    ) -> Result<Response<api::RevokeKeyResponse>, Status> {
        let (_, actor) = self.authorize_as(&request, Scope::Management, "keys.revoke")?;
        let source = request.remote_addr();
        let client_id = request.into_inner().client_id;
        let keys = self.keys.clone();
        let revoked = client_id.clone();
        let result = blocking(move || keys.revoke(&revoked, SystemTime::now())).await;
        self.record(&actor, source, "keys.revoke", &client_id, &result);
        let snapshot_version = result?;
        tracing::info!(%client_id, version = snapshot_version, "key revoked");
        Ok(Response::new(api::RevokeKeyResponse { snapshot_version }))
    }

    async fn pause_tier(
        &self,
        request: Request<api::TierRequest>,
    ) -> Result<Response<api::TierResponse>, Status> {
        self.tier_change(&request, "paused", "queue.pause", |runtime, index| {
            runtime.paused[index] = true;
        })
    }

    async fn resume_tier(
        &self,
        request: Request<api::TierRequest>,
    ) -> Result<Response<api::TierResponse>, Status> {
        self.tier_change(&request, "resumed", "queue.resume", |runtime, index| {
            runtime.paused[index] = false;
        })
    }

    async fn flush_tier(
        &self,
        request: Request<api::TierRequest>,
    ) -> Result<Response<api::TierResponse>, Status> {
        self.tier_change(&request, "flushed", "queue.flush", |runtime, index| {
            runtime.flush_generation[index] += 1;
        })
    }

    type DrainStream = DrainStream;

    async fn drain(
        &self,
        request: Request<api::DrainRequest>,
    ) -> Result<Response<Self::DrainStream>, Status> {
        let (_, actor) = self.authorize_as(&request, Scope::Management, "queue.drain")?;
        self.audit.record(
            &actor,
            request.remote_addr(),
            "queue.drain",
            "all",
            Outcome::Ok,
            "",
        );
        let timeout = match request.into_inner().timeout_ms {
            0 => Duration::from_secs(300),
            // The caller's choice, bounded: `Instant + u64::MAX ms` would panic.
            ms => Duration::from_millis(ms).min(Duration::from_secs(86_400)),
        };
        let mut generation = 0;
        self.hub.update_runtime(|runtime| {
            runtime.drain_generation += 1;
            generation = runtime.drain_generation;
        });
        let hub = self.hub.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        let stream = futures_util::stream::unfold(Some(false), move |state| {
            let hub = hub.clone();
            async move {
                // `None` = the last message was sent.
                let first = !state?;
                if !first {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let (progress, done) = drain_progress(&hub, generation);
                let timed_out = !done && tokio::time::Instant::now() >= deadline;
                let message = api::DrainProgress {
                    nodes: progress,
                    drained: done,
                    timed_out,
                };
                let next = if done || timed_out { None } else { Some(true) };
                Some((Ok(message), next))
            }
        });
        let stream =
            futures_util::StreamExt::take_until(stream, self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_hosts(
        &self,
        request: Request<api::ListHostsRequest>,
    ) -> Result<Response<api::ListHostsResponse>, Status> {
        self.authorize(&request, Scope::Read, "hosts.list")?;
        let models = self.caller_models(&request);
        let snapshot = self.hub.current();
        let config = self.hub.config();
        let nodes = self.hub.nodes();
        // The last poll, which the snapshot does not carry when the poll changed nothing.
        let inventory = self.hub.inventory();
        let hosts = snapshot
            .hosts
            .iter()
            .map(|host| {
                let reports = nodes
                    .values()
                    .flat_map(|node| node.report.hosts.iter())
                    .filter(|report| report.name == host.name);
                let (slots, requests, failures) = reports.fold((0, 0, 0), |acc, r| {
                    (
                        acc.0 + r.slots_in_use,
                        acc.1 + r.requests,
                        acc.2 + r.failures,
                    )
                });
                let owner = nodes::owner_of(&config, &host.name);
                let mut info = api::HostInfo {
                    name: host.name.clone(),
                    url: host.url.clone(),
                    kind: host.kind,
                    healthy: host.healthy,
                    max_concurrent: host.max_concurrent,
                    slots_in_use: slots,
                    installed_models: host.installed_models.clone(),
                    loaded_models: host.loaded_models.clone(),
                    weight: host.weight,
                    last_checked_unix_ms: inventory
                        .get(&host.name)
                        .and_then(|seen| seen.last_checked)
                        .map_or(host.last_checked_unix_ms, unix_ms),
                    cloud_keys: cloud_pool(host, &nodes),
                    requests,
                    failures,
                    ..api::HostInfo::default()
                };
                info.cloud_accounts = cloud::accounts(host, &config, &nodes);
                swap::fill(&mut info, host, &owner, &nodes);
                info.runners = runners_of(&host.name, &nodes);
                info.node = owner;
                if let Some(models) = &models {
                    scope_models(&mut info, &|model| models.allows(model));
                }
                info
            })
            .collect();
        Ok(Response::new(api::ListHostsResponse { hosts }))
    }

    async fn list_clients(
        &self,
        request: Request<api::ListClientsRequest>,
    ) -> Result<Response<api::ListClientsResponse>, Status> {
        let seen = self.authorize(&request, Scope::Read, "clients.list")?;
        let snapshot = self.hub.current();
        let nodes = self.hub.nodes();
        let today: std::collections::HashMap<String, u64> = self
            .usage
            .today(std::time::SystemTime::now())
            .into_iter()
            .map(|row| (row.client_id, row.gpu_ns))
            .collect();
        // A key in its rotation grace is a second entry of the same client: one row each.
        let mut listed = std::collections::HashSet::new();
        let mut rows: Vec<api::ClientInfo> = snapshot
            .clients
            .iter()
            .filter(|client| seen.shows(&client.client_id))
            .filter(|client| listed.insert(client.client_id.clone()))
            .map(|client| api::ClientInfo {
                client_id: client.client_id.clone(),
                max_priority: client.max_priority,
                scope: client.scope,
                max_concurrent: client.max_concurrent,
                weight: client.weight,
                rate_limit: client.rate_limit,
                ..api::ClientInfo::default()
            })
            .collect();
        // With auth off, callers name themselves (`X-Client-ID`): list those the data
        // planes report, as their status and dashboard do.
        if !self.hub.config().auth.enabled {
            let mut named: Vec<&str> = nodes
                .values()
                .flat_map(|node| node.report.clients.iter())
                .map(|report| report.client_id.as_str())
                .filter(|id| seen.shows(id) && !listed.contains(*id))
                .collect();
            named.sort_unstable();
            named.dedup();
            rows.extend(named.into_iter().map(|id| api::ClientInfo {
                client_id: id.to_owned(),
                weight: 1.0,
                ..api::ClientInfo::default()
            }));
        }
        let clients = rows
            .into_iter()
            .map(|mut info| {
                info.gpu_ns_today = today.get(&info.client_id).copied().unwrap_or(0);
                let mut shares = Vec::new();
                for report in nodes
                    .values()
                    .flat_map(|node| node.report.clients.iter())
                    .filter(|report| report.client_id == info.client_id)
                {
                    info.waiting += report.waiting;
                    info.inflight += report.inflight;
                    info.processed += report.processed;
                    info.rejected += report.rejected;
                    info.rate_limited += report.rate_limited;
                    shares.push(report.recent_share);
                }
                if !shares.is_empty() {
                    info.recent_share = shares.iter().sum::<f64>() / shares.len() as f64;
                }
                info
            })
            .collect();
        Ok(Response::new(api::ListClientsResponse { clients }))
    }

    async fn reload(
        &self,
        request: Request<api::ReloadRequest>,
    ) -> Result<Response<api::ReloadResponse>, Status> {
        let (_, actor) = self.authorize_as(&request, Scope::Management, "config.reload")?;
        let source = request.remote_addr();
        // Reading, parsing and (for a changed webhook URL) resolving the
        // file are blocking work: off the async workers.
        let reload = self.reload.clone();
        let reloaded = tokio::task::spawn_blocking(move || reload())
            .await
            .map_err(|error| Status::internal(format!("reload task failed: {error}")));
        let reloaded = match reloaded {
            Ok(Ok(done)) => Ok(done),
            Ok(Err(error)) => Err(Status::failed_precondition(error)),
            Err(status) => Err(status),
        };
        let target = match &reloaded {
            Ok((version, _)) => format!("version {version}"),
            Err(_) => String::new(),
        };
        self.record(&actor, source, "config.reload", &target, &reloaded);
        match reloaded {
            Ok((snapshot_version, warnings)) => {
                for warning in &warnings {
                    tracing::warn!("config: {warning}");
                }
                tracing::info!(version = snapshot_version, "config reloaded");
                Ok(Response::new(api::ReloadResponse {
                    snapshot_version,
                    warnings,
                }))
            }
            Err(status) => Err(status),
        }
    }

    async fn add_node(
        &self,
        request: Request<api::AddNodeRequest>,
    ) -> Result<Response<api::AddNodeResponse>, Status> {
        credentials::add(self, request).await
    }

    async fn revoke_node(
        &self,
        request: Request<api::RevokeNodeRequest>,
    ) -> Result<Response<api::RevokeNodeResponse>, Status> {
        credentials::revoke(self, request).await
    }

    async fn list_nodes(
        &self,
        request: Request<api::ListNodesRequest>,
    ) -> Result<Response<api::ListNodesResponse>, Status> {
        credentials::list(self, &request)
    }

    async fn list_audit(
        &self,
        request: Request<api::ListAuditRequest>,
    ) -> Result<Response<api::ListAuditResponse>, Status> {
        self.authorize(&request, Scope::Management, "audit.list")?;
        let request = request.into_inner();
        let query = audit::Query {
            since: (request.since_unix_ms > 0).then(|| {
                SystemTime::UNIX_EPOCH
                    + Duration::from_millis(u64::try_from(request.since_unix_ms).unwrap_or(0))
            }),
            action: (!request.action.is_empty()).then_some(request.action),
            limit: match request.limit {
                0 => 1000,
                limit => usize::try_from(limit).unwrap_or(usize::MAX).min(10_000),
            },
        };
        // The rotated files are read from disk: off the async workers.
        let trail = self.audit.clone();
        let entries = tokio::task::spawn_blocking(move || trail.read(&query))
            .await
            .map_err(|error| Status::internal(format!("audit task failed: {error}")))?;
        Ok(Response::new(api::ListAuditResponse {
            entries: entries
                .into_iter()
                .map(|entry| api::AuditEntry {
                    time: entry.time,
                    actor: entry.actor,
                    source: entry.source,
                    action: entry.action,
                    target: entry.target,
                    outcome: entry.outcome.as_str().to_owned(),
                    reason: entry.reason,
                })
                .collect(),
        }))
    }

    async fn get_usage(
        &self,
        request: Request<api::GetUsageRequest>,
    ) -> Result<Response<api::GetUsageResponse>, Status> {
        let seen = self.authorize(&request, Scope::Read, "usage.get")?;
        let query = request.into_inner();
        Ok(Response::new(self.usage.query_for(
            &query,
            seen.only(),
            std::time::SystemTime::now(),
        )))
    }
}

/// Whose keys and usage a caller may see: a `management` key (or anyone with auth off)
/// every tenant's; a `read` or `inference` key only its own client's (and, for an app's key,
/// its users', `<client_id>/<user>`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    All,
    Own(String),
}

impl Seen {
    /// Whether rows of `client` are shown.
    fn shows(&self, client: &str) -> bool {
        match self {
            Seen::All => true,
            Seen::Own(own) => {
                client == own
                    || client
                        .strip_prefix(own.as_str())
                        .is_some_and(|rest| rest.starts_with('/'))
            }
        }
    }

    /// The client a usage query is limited to; `None` for every client.
    fn only(&self) -> Option<&str> {
        match self {
            Seen::All => None,
            Seen::Own(own) => Some(own),
        }
    }
}

/// Leaves out of `host` every model `visible` refuses: installed, loaded, resident,
/// switched to, bound to a cloud key, and the runners' (a key with a model allowlist sees
/// only the models it may use).
fn scope_models(host: &mut api::HostInfo, visible: &dyn Fn(&str) -> bool) {
    host.installed_models.retain(|model| visible(model));
    host.loaded_models.retain(|model| visible(model));
    host.resident.retain(|resident| visible(&resident.name));
    if !host.switching_to.is_empty() && !visible(&host.switching_to) {
        host.switching_to.clear();
    }
    for key in &mut host.cloud_keys {
        if !key.bound_model.is_empty() && !visible(&key.bound_model) {
            key.bound_model.clear();
        }
    }
    host.runners.retain(|runner| visible(&runner.model));
}

/// How a refused call is recorded: the caller's mistake (credential, scope, a bad
/// argument, a state that does not allow it) is `refused`, the rest `failed`.
fn outcome_of(status: &Status) -> Outcome {
    use tonic::Code;
    match status.code() {
        Code::Unauthenticated
        | Code::PermissionDenied
        | Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::FailedPrecondition => Outcome::Refused,
        _ => Outcome::Failed,
    }
}

/// With auth off, whether a call that changes state is accepted: from this
/// machine (a loopback peer, or one whose address is the address it reached:
/// oqpctl on the box, the single-box data plane when `control_plane.listen`
/// names a LAN address), or with the node token. A peer oqp cannot see
/// (`None`) is not trusted.
fn open_change_allowed(
    peer: Option<SocketAddr>,
    local: Option<SocketAddr>,
    node_token: bool,
) -> bool {
    let Some(peer) = peer.map(|peer| peer.ip().to_canonical()) else {
        return node_token;
    };
    node_token || peer.is_loopback() || local.is_some_and(|local| local.ip().to_canonical() == peer)
}

/// What the data planes report not applying: a rejected snapshot, a part
/// of the current one that failed (it said why), a stale stream.
fn node_warnings(hub: &Hub) -> Vec<String> {
    let mut warnings = Vec::new();
    for (name, node) in hub.nodes() {
        let report = &node.report;
        if report.rejected_version != 0 {
            warnings.push(format!(
                "node {name} rejected snapshot {}: {}",
                report.rejected_version, report.rejected_reason
            ));
        }
        for error in &report.apply_errors {
            warnings.push(format!(
                "node {name} did not apply part of snapshot {}: {error}",
                report.applied_version
            ));
        }
        if report.stale_version != 0 {
            warnings.push(format!(
                "node {name} ignores this control plane's snapshots: it holds version {}, above \
                 the {} it was sent",
                report.applied_version, report.stale_version
            ));
        }
    }
    warnings
}

/// Waiting requests per node, and whether every reporting node has seen
/// `generation` with empty queues.
fn drain_progress(hub: &Hub, generation: u64) -> (Vec<api::NodeDepth>, bool) {
    let mut all_done = true;
    let mut depths = Vec::new();
    for node in hub.nodes().into_values() {
        let fresh = node
            .reported_at
            .is_some_and(|at| at.elapsed() < REPORT_FRESH);
        if !fresh {
            // A node that stopped reporting cannot hold the drain forever.
            continue;
        }
        let report = &node.report;
        all_done &= report.drained_generation >= generation;
        depths.push(api::NodeDepth {
            node: report.node.clone(),
            depths: report.tiers.iter().map(|tier| tier.depth).collect(),
        });
    }
    (depths, all_done)
}

fn last_used_by_client(hub: &Hub) -> std::collections::HashMap<String, i64> {
    let mut last_used = std::collections::HashMap::new();
    for node in hub.nodes().into_values() {
        for client in node.report.clients {
            let entry = last_used.entry(client.client_id).or_insert(0);
            *entry = (*entry).max(client.last_used_unix_ms);
        }
    }
    last_used
}

/// A host's model runners from the data planes' reports (only its owner dispatches to an
/// owned host, so the sum is the owner's): requests in flight summed, slots as reported.
fn runners_of(
    host: &str,
    nodes: &std::collections::BTreeMap<String, crate::hub::Node>,
) -> Vec<wire::RunnerReport> {
    let mut runners: Vec<wire::RunnerReport> = Vec::new();
    let reported = nodes
        .values()
        .flat_map(|node| node.report.hosts.iter())
        .filter(|report| report.name == host)
        .flat_map(|report| report.runners.iter());
    for runner in reported {
        match runners.iter_mut().find(|seen| seen.model == runner.model) {
            Some(seen) => {
                seen.in_flight += runner.in_flight;
                seen.warm += runner.warm;
                seen.slots = seen.slots.max(runner.slots);
            }
            None => runners.push(runner.clone()),
        }
    }
    runners.sort_by(|a, b| a.model.cmp(&b.model));
    runners
}

/// `AddKey`'s request in config terms; unset fields take the config file's
/// defaults (scope inference, ceiling normal, weight 1).
fn new_key(request: api::AddKeyRequest) -> Result<NewKey, Status> {
    let scope = match wire::Scope::try_from(request.scope) {
        Ok(wire::Scope::Read) => Scope::Read,
        Ok(wire::Scope::Inference | wire::Scope::Unspecified) => Scope::Inference,
        Ok(wire::Scope::Management) => Scope::Management,
        Err(_) => return Err(Status::invalid_argument("unknown scope")),
    };
    let tier = |value: i32, field: &str| match wire::Tier::try_from(value) {
        Ok(_) => Ok(tier_from_wire(value)),
        Err(_) => Err(Status::invalid_argument(format!("unknown {field}"))),
    };
    let max_priority = tier(request.max_priority, "max_priority")?.unwrap_or(Tier::Normal);
    let default_priority = tier(request.default_priority, "default_priority")?;
    let budget = match request.budget {
        None => None,
        Some(budget) if budget.gpu_ns == 0 && budget.tokens == 0 => None,
        Some(budget) => {
            let window = crate::config::BudgetWindow::parse(&budget.window).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "budget window must be one of 1h, 1d, 7d, 30d, got '{}'",
                    budget.window
                ))
            })?;
            // A USD budget is set in the config only.
            Some(crate::config::Budget {
                gpu_ns: budget.gpu_ns,
                tokens: budget.tokens,
                usd_micros: 0,
                window,
            })
        }
    };
    Ok(NewKey {
        client_id: request.client_id,
        scope,
        max_priority,
        default_priority,
        max_concurrent: request.max_concurrent,
        weight: if request.weight == 0.0 {
            1.0
        } else {
            request.weight
        },
        max_queued: request.max_queued,
        description: request.description,
        lifetime: (request.expires_in_seconds > 0)
            .then(|| Duration::from_secs(request.expires_in_seconds)),
        budget,
        models: request.models,
    })
}

/// A stored key's metadata on the wire.
fn key_info(record: &Record, last_used_unix_ms: i64) -> api::KeyInfo {
    api::KeyInfo {
        client_id: record.client_id.clone(),
        source: "store".to_owned(),
        scope: scope_to_wire(record.scope) as i32,
        max_priority: tier_to_wire(record.max_priority) as i32,
        max_concurrent: record.max_concurrent,
        weight: record.weight,
        description: record.description.clone(),
        created_unix_ms: record.created_unix_ms,
        expires_unix_ms: record.expires_unix_ms,
        last_used_unix_ms,
        default_priority: tier_to_wire(record.default_priority) as i32,
        max_queued: record.max_queued,
        budget: record
            .budget
            .as_ref()
            .map(|budget| key_budget(budget, &record.client_id, None)),
        models: record.models.clone(),
        users: String::new(),
    }
}

/// A budget on the admin wire, with what `client` used of it in the current window when
/// `usage` is given.
fn key_budget(
    budget: &crate::config::Budget,
    client: &str,
    usage: Option<&UsageStore>,
) -> api::KeyBudget {
    let now = std::time::SystemTime::now();
    let wire_budget = compile::budget_to_wire(budget);
    let used = usage.map(|usage| usage.used(client, &wire_budget, now));
    let start = wire_budget.window_start(crate::usage::unix_s(now));
    api::KeyBudget {
        gpu_ns: budget.gpu_ns,
        tokens: budget.tokens,
        window: budget.window.as_str().to_owned(),
        used_gpu_ns: used.as_ref().map_or(0, |used| used.gpu_ns),
        used_tokens: used.as_ref().map_or(0, |used| used.tokens),
        resets_unix_s: start
            .saturating_add(i64::try_from(budget.window.seconds()).unwrap_or(i64::MAX)),
    }
}

/// Runs a key-store change (file writes and fsyncs) off the async workers.
async fn blocking<T: Send + 'static>(
    change: impl FnOnce() -> Result<T, KeyError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(change)
        .await
        .map_err(|error| Status::internal(format!("key store task failed: {error}")))?
        .map_err(key_status)
}

/// The gRPC status of a refused key operation.
fn key_status(error: KeyError) -> Status {
    let message = error.to_string();
    match error {
        KeyError::DefinedInConfig(_) | KeyError::AlreadyStored(_) => {
            Status::already_exists(message)
        }
        KeyError::NotFound(_) => Status::not_found(message),
        KeyError::ReadOnly(_) | KeyError::Expired(_) => Status::failed_precondition(message),
        KeyError::Invalid(_) => Status::invalid_argument(message),
        KeyError::Unwritable { .. } | KeyError::Entropy(_) => {
            tracing::error!("{message}");
            Status::internal(message)
        }
    }
}

/// A cloud host's key pool as the data planes report it, merged by key
/// (busy anywhere, the longest cooldown); before any report, the labels of
/// the configured keys.
fn cloud_pool(
    host: &oqp_proto::policy::v1::Host,
    nodes: &std::collections::BTreeMap<String, crate::hub::Node>,
) -> Vec<api::CloudKeyInfo> {
    let mut merged: Vec<api::CloudKeyInfo> = Vec::new();
    for key in nodes
        .values()
        .flat_map(|node| node.report.hosts.iter())
        .filter(|report| report.name == host.name)
        .flat_map(|report| report.cloud_keys.iter())
    {
        match merged.iter_mut().find(|seen| seen.label == key.label) {
            Some(seen) => {
                seen.busy |= key.busy;
                seen.cooldown_until_unix_ms =
                    seen.cooldown_until_unix_ms.max(key.cooldown_until_unix_ms);
                if seen.bound_model.is_empty() {
                    seen.bound_model = key.bound_model.clone();
                }
                if seen.last_error.is_empty() {
                    seen.last_error = key.last_error.clone();
                }
            }
            None => merged.push(api::CloudKeyInfo {
                label: key.label.clone(),
                bound_model: key.bound_model.clone(),
                busy: key.busy,
                cooldown_until_unix_ms: key.cooldown_until_unix_ms,
                last_error: key.last_error.clone(),
            }),
        }
    }
    if merged.is_empty() {
        merged = host
            .cloud_keys
            .iter()
            .map(|key| api::CloudKeyInfo {
                label: if key.account.is_empty() {
                    redact(&key.key)
                } else {
                    format!("{} {}", key.account, redact(&key.key))
                },
                ..api::CloudKeyInfo::default()
            })
            .collect();
    }
    merged
}

fn redact(key: &str) -> String {
    let count = key.chars().count();
    if count < 12 {
        return "…".to_owned();
    }
    format!("…{}", key.chars().skip(count - 4).collect::<String>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Env, load_str};

    /// An admin API with auth off, and the thread its reloader ran on.
    type Seen = Arc<std::sync::Mutex<Option<std::thread::ThreadId>>>;

    fn api_with_auth_off(dir: &std::path::Path, token: &str) -> (AdminApi, Seen) {
        let yaml = format!(
            "ollama:\n  hosts:\n    - {{url: 'http://127.0.0.1:9', name: a}}\n\
             control_plane:\n  node_token: {token}\n"
        );
        let hub = Hub::new(load_str(&yaml, &Env::empty()).unwrap().config);
        let keys = KeyStore::load(dir, hub.clone()).unwrap();
        let usage = UsageStore::load(dir, std::time::SystemTime::now()).unwrap();
        let seen = Seen::default();
        let reload: Reloader = {
            let seen = seen.clone();
            Arc::new(move || {
                *seen.lock().unwrap() = Some(std::thread::current().id());
                Ok((7, Vec::new()))
            })
        };
        (
            AdminApi::new(
                hub,
                keys,
                Arc::new(NodeCredentials::load(dir).unwrap()),
                usage,
                reload,
                CancellationToken::new(),
            ),
            seen,
        )
    }

    #[test]
    fn add_key_budgets_are_checked() {
        let request = |window: &str, gpu_ns: u64, tokens: u64| api::AddKeyRequest {
            client_id: "nightly".to_owned(),
            budget: Some(api::KeyBudget {
                gpu_ns,
                tokens,
                window: window.to_owned(),
                ..api::KeyBudget::default()
            }),
            ..api::AddKeyRequest::default()
        };
        let budget = new_key(request("7d", 5, 0)).unwrap().budget.unwrap();
        assert_eq!(
            (budget.gpu_ns, budget.window),
            (5, crate::config::BudgetWindow::Week)
        );
        let refused = new_key(request("2d", 5, 0)).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            refused.message(),
            "budget window must be one of 1h, 1d, 7d, 30d, got '2d'"
        );
        assert_eq!(
            new_key(request("1d", 0, 0)).unwrap().budget,
            None,
            "no limit, no budget"
        );
    }

    /// A request as tonic's TCP server hands it over: with the peer address.
    fn from_peer<T>(peer: &str, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request
            .extensions_mut()
            .insert(tonic::transport::server::TcpConnectInfo {
                local_addr: Some("192.168.1.5:50051".parse().unwrap()),
                remote_addr: Some(peer.parse().unwrap()),
            });
        request
    }

    #[tokio::test]
    async fn with_auth_off_a_remote_peer_changes_nothing_without_the_node_token() {
        let dir = tempfile::tempdir().unwrap();
        let (api, _) = api_with_auth_off(dir.path(), "sk-node-0123456789");
        let pause = || api::TierRequest {
            tier: wire::Tier::Low as i32,
        };
        let refused = api
            .pause_tier(from_peer("192.168.1.20:5000", pause()))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("auth is disabled"));
        let revoke = api
            .revoke_key(from_peer(
                "192.168.1.20:5000",
                api::RevokeKeyRequest {
                    client_id: "x".into(),
                },
            ))
            .await
            .unwrap_err();
        assert_eq!(revoke.code(), tonic::Code::PermissionDenied);
        assert_eq!(api.hub.runtime().paused, [false; 3]);
        // Reads stay open.
        api.get_status(from_peer("192.168.1.20:5000", api::GetStatusRequest {}))
            .await
            .unwrap();

        // The node token itself, or the key derived from it for the policy service, opens
        // nothing here: only the admin credential derived from it does.
        for presented in [
            "sk-node-0123456789".to_owned(),
            node_keys::grpc_credential("sk-node-0123456789"),
        ] {
            let mut other = from_peer("192.168.1.20:5000", pause());
            other
                .metadata_mut()
                .insert(oqp_proto::NODE_TOKEN_METADATA, presented.parse().unwrap());
            assert!(api.pause_tier(other).await.is_err(), "{presented}");
        }
        let mut with_token = from_peer("192.168.1.20:5000", pause());
        with_token.metadata_mut().insert(
            oqp_proto::NODE_TOKEN_METADATA,
            node_keys::admin_credential("sk-node-0123456789")
                .parse()
                .unwrap(),
        );
        api.pause_tier(with_token).await.unwrap();
        api.resume_tier(from_peer("127.0.0.1:5000", pause()))
            .await
            .unwrap();
        let mut wrong_token = from_peer("192.168.1.20:5000", pause());
        wrong_token
            .metadata_mut()
            .insert(oqp_proto::NODE_TOKEN_METADATA, "guess".parse().unwrap());
        assert!(api.pause_tier(wrong_token).await.is_err());
    }

    #[tokio::test]
    async fn reload_reads_the_file_off_the_async_workers() {
        let dir = tempfile::tempdir().unwrap();
        let (api, seen) = api_with_auth_off(dir.path(), "sk-node-0123456789");
        let response = api
            .reload(from_peer("127.0.0.1:5000", api::ReloadRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.snapshot_version, 7);
        // A current-thread test runtime: a reload on the async worker would
        // have run on this very thread.
        let ran_on = seen.lock().unwrap().expect("the reloader ran");
        assert_ne!(ran_on, std::thread::current().id());
    }

    #[test]
    fn with_auth_off_only_loopback_or_the_node_token_may_change_state() {
        let peer = |text: &str| Some(text.parse::<SocketAddr>().unwrap());
        let here = peer("192.168.1.5:50051");
        // This machine, through its LAN address.
        assert!(open_change_allowed(peer("192.168.1.5:40000"), here, false));
        assert!(open_change_allowed(
            peer("[::ffff:192.168.1.5]:1"),
            here,
            false
        ));
        for loopback in [
            "127.0.0.1:5000",
            "127.9.9.9:1",
            "[::1]:5000",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert!(
                open_change_allowed(peer(loopback), here, false),
                "{loopback}"
            );
        }
        for remote in [
            "192.168.1.20:5000",
            "10.0.0.1:1",
            "0.0.0.0:1",
            "[::]:1",
            "[fe80::1]:1",
            "[::ffff:192.168.1.2]:1",
        ] {
            assert!(!open_change_allowed(peer(remote), here, false), "{remote}");
            assert!(!open_change_allowed(peer(remote), None, false), "{remote}");
            assert!(
                open_change_allowed(peer(remote), here, true),
                "{remote} with token"
            );
        }
        assert!(!open_change_allowed(None, here, false));
        assert!(open_change_allowed(None, None, true));
    }
}
