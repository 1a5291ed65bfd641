//! `AdminService`: what oqpctl (and the data planes' HTTP management
//! endpoints) call. Every RPC checks the caller's oqp key: `read` scope for
//! the Get/List calls, `management` for everything that changes state.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use oqp_proto::admin::v1::{self as api, admin_service_server::AdminService};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::compile::{self, tier_from_wire, tier_index};
use crate::config::{Scope, Tier};
use crate::hub::Hub;

/// Re-reads the config file; returns the new version and the warnings.
pub type Reloader = Arc<dyn Fn() -> Result<(u64, Vec<String>), String> + Send + Sync>;

/// Serves the admin API.
#[derive(Clone)]
pub struct AdminApi {
    hub: Arc<Hub>,
    reload: Reloader,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for AdminApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminApi").finish_non_exhaustive()
    }
}

/// How long a node may stay silent and still count as reporting.
const REPORT_FRESH: Duration = Duration::from_secs(5);

impl AdminApi {
    /// An API over `hub`, reloading with `reload`; drain streams end when
    /// `shutdown` is cancelled.
    pub fn new(hub: Arc<Hub>, reload: Reloader, shutdown: CancellationToken) -> Self {
        Self {
            hub,
            reload,
            shutdown,
        }
    }

    /// Checks the caller's key against `needed`. With `auth.enabled: false`
    /// nothing is enforced, as on the HTTP side.
    fn authorize<T>(&self, request: &Request<T>, needed: Scope) -> Result<(), Status> {
        let config = self.hub.config();
        if !config.auth.enabled {
            return Ok(());
        }
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, key) = value.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key)
            })
            .ok_or_else(|| Status::unauthenticated("missing or invalid authorization header"))?;
        let scope = config
            .auth
            .keys
            .iter()
            .find(|key| super::secrets_match(presented, key.key.expose()))
            .map(|key| key.scope)
            .ok_or_else(|| Status::unauthenticated("invalid api key"))?;
        if scope >= needed {
            Ok(())
        } else {
            Err(Status::permission_denied(format!(
                "{} permission required",
                needed.as_str()
            )))
        }
    }

    fn tier_change(
        &self,
        tier: i32,
        status: &str,
        change: impl Fn(&mut compile::Runtime, usize),
    ) -> api::TierResponse {
        let tiers: Vec<Tier> = match tier_from_wire(tier) {
            Some(tier) => vec![tier],
            None => Tier::ALL.to_vec(),
        };
        let version = self.hub.update_runtime(|runtime| {
            for tier in &tiers {
                change(runtime, tier_index(*tier));
            }
        });
        api::TierResponse {
            status: status.to_owned(),
            tier: tier_from_wire(tier).map_or("all", Tier::as_str).to_owned(),
            snapshot_version: version,
        }
    }
}

type DrainStream = Pin<Box<dyn Stream<Item = Result<api::DrainProgress, Status>> + Send>>;

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn get_status(
        &self,
        request: Request<api::GetStatusRequest>,
    ) -> Result<Response<api::GetStatusResponse>, Status> {
        self.authorize(&request, Scope::Read)?;
        let config = self.hub.config();
        let inventory = self.hub.inventory();
        let runtime = self.hub.runtime();
        let nodes = self
            .hub
            .nodes()
            .into_values()
            .map(|node| api::NodeStatus {
                node: node.report.node.clone(),
                listen_address: node.report.listen_address.clone(),
                applied_version: node.report.applied_version,
                last_report_age_ms: node.reported_at.map_or(u64::MAX, |at| {
                    u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX)
                }),
                connected: node.watches > 0,
                report: Some(node.report),
            })
            .collect();
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
        self.authorize(&request, Scope::Read)?;
        let snapshot = self.hub.current();
        let last_used = last_used_by_client(&self.hub);
        let keys = snapshot
            .clients
            .iter()
            .map(|client| api::KeyInfo {
                client_id: client.client_id.clone(),
                source: client.source.clone(),
                scope: client.scope,
                max_priority: client.max_priority,
                max_concurrent: client.max_concurrent,
                weight: client.weight,
                description: client.description.clone(),
                created_unix_ms: 0,
                expires_unix_ms: client.expires_unix_ms,
                last_used_unix_ms: last_used.get(&client.client_id).copied().unwrap_or(0),
                default_priority: client.default_priority,
                max_queued: client.max_queued,
            })
            .collect();
        Ok(Response::new(api::ListKeysResponse { keys }))
    }

    async fn add_key(
        &self,
        request: Request<api::AddKeyRequest>,
    ) -> Result<Response<api::AddKeyResponse>, Status> {
        self.authorize(&request, Scope::Management)?;
        Err(Status::unimplemented(
            "the key store is not available in this build",
        ))
    }

    async fn rotate_key(
        &self,
        request: Request<api::RotateKeyRequest>,
    ) -> Result<Response<api::RotateKeyResponse>, Status> {
        self.authorize(&request, Scope::Management)?;
        Err(Status::unimplemented(
            "the key store is not available in this build",
        ))
    }

    async fn revoke_key(
        &self,
        request: Request<api::RevokeKeyRequest>,
    ) -> Result<Response<api::RevokeKeyResponse>, Status> {
        self.authorize(&request, Scope::Management)?;
        Err(Status::unimplemented(
            "the key store is not available in this build",
        ))
    }

    async fn pause_tier(
        &self,
        request: Request<api::TierRequest>,
    ) -> Result<Response<api::TierResponse>, Status> {
        self.authorize(&request, Scope::Management)?;
        let tier = request.into_inner().tier;
        Ok(Response::new(self.tier_change(
            tier,
            "paused",
            |runtime, index| {
                runtime.paused[index] = true;
            },
        )))
    }

    async fn resume_tier(
        &self,
        request: Request<api::TierRequest>,
    ) -> Result<Response<api::TierResponse>, Status> {
        self.authorize(&request, Scope::Management)?;
        let tier = request.into_inner().tier;
        Ok(Response::new(self.tier_change(
            tier,
            "resumed",
            |runtime, index| {
                runtime.paused[index] = false;
            },
        )))
    }

    async fn flush_tier(
        &self,
        request: Request<api::TierRequest>,
    ) -> Result<Response<api::TierResponse>, Status> {
        self.authorize(&request, Scope::Management)?;
        let tier = request.into_inner().tier;
        Ok(Response::new(self.tier_change(
            tier,
            "flushed",
            |runtime, index| {
                runtime.flush_generation[index] += 1;
            },
        )))
    }

    type DrainStream = DrainStream;

    async fn drain(
        &self,
        request: Request<api::DrainRequest>,
    ) -> Result<Response<Self::DrainStream>, Status> {
        self.authorize(&request, Scope::Management)?;
        let timeout = match request.into_inner().timeout_ms {
            0 => Duration::from_secs(300),
            ms => Duration::from_millis(ms),
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
        self.authorize(&request, Scope::Read)?;
        let snapshot = self.hub.current();
        let nodes = self.hub.nodes();
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
                api::HostInfo {
                    name: host.name.clone(),
                    url: host.url.clone(),
                    kind: host.kind,
                    healthy: host.healthy,
                    max_concurrent: host.max_concurrent,
                    slots_in_use: slots,
                    installed_models: host.installed_models.clone(),
                    loaded_models: host.loaded_models.clone(),
                    weight: host.weight,
                    last_checked_unix_ms: host.last_checked_unix_ms,
                    cloud_keys: host
                        .cloud_keys
                        .iter()
                        .map(|key| api::CloudKeyInfo {
                            label: if key.account.is_empty() {
                                redact(&key.key)
                            } else {
                                key.account.clone()
                            },
                            ..api::CloudKeyInfo::default()
                        })
                        .collect(),
                    requests,
                    failures,
                }
            })
            .collect();
        Ok(Response::new(api::ListHostsResponse { hosts }))
    }

    async fn list_clients(
        &self,
        request: Request<api::ListClientsRequest>,
    ) -> Result<Response<api::ListClientsResponse>, Status> {
        self.authorize(&request, Scope::Read)?;
        let snapshot = self.hub.current();
        let nodes = self.hub.nodes();
        let clients = snapshot
            .clients
            .iter()
            .map(|client| {
                let mut info = api::ClientInfo {
                    client_id: client.client_id.clone(),
                    max_priority: client.max_priority,
                    scope: client.scope,
                    max_concurrent: client.max_concurrent,
                    weight: client.weight,
                    ..api::ClientInfo::default()
                };
                let mut shares = Vec::new();
                for report in nodes
                    .values()
                    .flat_map(|node| node.report.clients.iter())
                    .filter(|report| report.client_id == client.client_id)
                {
                    info.waiting += report.waiting;
                    info.inflight += report.inflight;
                    info.processed += report.processed;
                    info.rejected += report.rejected;
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
        self.authorize(&request, Scope::Management)?;
        match (self.reload)() {
            Ok((snapshot_version, warnings)) => Ok(Response::new(api::ReloadResponse {
                snapshot_version,
                warnings,
            })),
            Err(error) => Err(Status::failed_precondition(error)),
        }
    }
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

fn redact(key: &str) -> String {
    let count = key.chars().count();
    if count < 12 {
        return "…".to_owned();
    }
    format!("…{}", key.chars().skip(count - 4).collect::<String>())
}
