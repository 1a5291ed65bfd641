//! `PolicyService`: data planes watch snapshots and report status.
//!
//! A report's `events` (queue.full, queue.high_watermark, queue.drained,
//! queue.over_capacity) become webhooks here, converted from wire types into
//! [`Notice`]s: each report carries the events since the node's last
//! successful report, so each is forwarded once, as it arrives.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::{Stream, StreamExt};
use oqp_proto::policy::v1::{
    Event, HostPolled, NodeHello, NodeReport, PolicySnapshot, ReportAck,
    policy_service_server::PolicyService,
};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::audit::{Audit, Outcome};
use crate::compile::{self, tier_from_wire};
use crate::config::{Secret, WebhookEvent};
use crate::hop_keys::HopKeys;
use crate::hub::Hub;
use crate::node_credentials::{NodeCredentials, Verdict};
use crate::node_token;
use crate::usage::{Reporter, UsageStore, bound};
use crate::webhooks::Notice;

/// Serves the policy stream.
#[derive(Debug, Clone)]
pub struct PolicyApi {
    hub: Arc<Hub>,
    usage: Arc<UsageStore>,
    /// The token presented when `control_plane.node_token` is not set ([`node_token`]).
    local: Secret,
    /// The nodes issued their own token ([`crate::node_credentials`]).
    credentials: Arc<NodeCredentials>,
    /// The hop keys of each pair of nodes ([`crate::hop_keys`]).
    hop_keys: Arc<HopKeys>,
    shutdown: CancellationToken,
    audit: Arc<Audit>,
}

impl PolicyApi {
    /// An API over `hub`, accepting a node's own token from `credentials` under its
    /// name, else the configured node token, else `local`; each node's snapshots carry its
    /// pairs' keys from `hop_keys`. Watch streams end when `shutdown` is cancelled, so that
    /// the server's graceful shutdown is not held open by them, and when the name's
    /// credential changes.
    pub fn new(
        hub: Arc<Hub>,
        usage: Arc<UsageStore>,
        local: Secret,
        (credentials, hop_keys): (Arc<NodeCredentials>, Arc<HopKeys>),
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            hub,
            usage,
            local,
            credentials,
            hop_keys,
            shutdown,
            audit: Audit::in_memory(),
        }
    }

    /// Records data planes joining and leaving in `audit`.
    pub fn with_audit(mut self, audit: Arc<Audit>) -> Self {
        self.audit = audit;
        self
    }

    /// Every call is authenticated, for the node name it is made under: by that name's
    /// own token if it was issued one (and by nothing else, once issued or revoked), else
    /// by `control_plane.node_token`, else by the control plane's own token, so that no
    /// report (usage, events) is taken from a peer that merely reaches the port. For a
    /// watch, returns the signal that fires when the name's credential changes.
    fn check_token<T>(
        &self,
        request: &Request<T>,
        node: &str,
        watching: bool,
    ) -> Result<Option<CancellationToken>, Status> {
        let presented = request
            .metadata()
            .get(oqp_proto::NODE_TOKEN_METADATA)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default();
        // A watch takes the signal of the name's next change; a report needs none (and
        // leaves nothing behind for a name it invents).
        let (verdict, changed) = if watching {
            let (verdict, changed) = self.credentials.admit(node, presented);
            (verdict, Some(changed))
        } else {
            (self.credentials.check(node, presented), None)
        };
        match verdict {
            Verdict::Own => return Ok(changed),
            Verdict::Wrong => {
                return Err(Status::unauthenticated(format!(
                    "invalid node token for node '{node}', which has its own: only that token \
                     admits this name"
                )));
            }
            Verdict::Revoked => {
                return Err(Status::permission_denied(format!(
                    "node '{node}' was revoked; `oqpctl nodes add {node}` issues it a new token"
                )));
            }
            Verdict::Unclaimed => {}
        }
        let config = self.hub.config();
        let expected = config
            .control_plane
            .node_token
            .as_ref()
            .unwrap_or(&self.local);
        let expected = oqp_dataplane::node_keys::grpc_credential(expected.expose());
        if super::secrets_match(presented, &expected) {
            Ok(changed)
        } else if config.control_plane.node_token.is_some() {
            Err(Status::unauthenticated("invalid node token"))
        } else {
            Err(Status::unauthenticated(format!(
                "missing or invalid node token: with control_plane.node_token unset, present \
                 the control plane's own token (state_dir/{}, --node-token-file)",
                node_token::FILE
            )))
        }
    }
}

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<PolicySnapshot, Status>> + Send>>;

/// Marks a node's watch closed when its stream is dropped.
struct WatchGuard {
    hub: Arc<Hub>,
    node: String,
    epoch: u64,
    audit: Arc<Audit>,
    source: Option<std::net::SocketAddr>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.hub.close_watch(&self.node, self.epoch);
        tracing::info!(node = %self.node, "data plane stopped watching");
        self.audit.record(
            "node",
            self.source,
            "dataplane.leave",
            &self.node,
            Outcome::Ok,
            "",
        );
    }
}

#[tonic::async_trait]
impl PolicyService for PolicyApi {
    type WatchPolicyStream = SnapshotStream;

    async fn watch_policy(
        &self,
        request: Request<NodeHello>,
    ) -> Result<Response<Self::WatchPolicyStream>, Status> {
        let source = request.remote_addr();
        let node = node_name(&request.get_ref().node);
        let changed = match self.check_token(&request, &node, true) {
            Ok(changed) => changed.unwrap_or_default(),
            Err(status) => {
                self.audit.record(
                    "unknown",
                    source,
                    "dataplane.join",
                    &node,
                    Outcome::Refused,
                    status.message(),
                );
                return Err(status);
            }
        };
        let hello = request.into_inner();
        tracing::info!(%node, version = %hello.software_version, held = hello.applied_version, "data plane watching");
        // Before subscribing, so that the stream's first snapshot is already
        // above what the node holds.
        if !self.hub.open_watch(&node, hello.usage_epoch) {
            tracing::warn!(%node, "refused a second data plane watching as a node that owns hosts");
            let status = Status::already_exists(format!(
                "a data plane is already connected as node '{node}', which owns hosts: two would \
                 both send to them; start this one with another --node"
            ));
            self.audit.record(
                "node",
                source,
                "dataplane.join",
                &node,
                Outcome::Refused,
                status.message(),
            );
            return Err(status);
        }
        self.audit
            .record("node", source, "dataplane.join", &node, Outcome::Ok, "");
        self.hub.adopt_version(&node, hello.applied_version);
        let guard = WatchGuard {
            hub: self.hub.clone(),
            node: node.clone(),
            epoch: hello.usage_epoch,
            audit: self.audit.clone(),
            source,
        };
        let hub = self.hub.clone();
        let usage = self.usage.clone();
        let (credentials, hop_keys) = (self.credentials.clone(), self.hop_keys.clone());
        let stream = WatchStream::new(self.hub.subscribe())
            .map(move |snapshot| {
                let _guard = &guard;
                let config = hub.config();
                let mut snapshot = compile::for_node(&snapshot, &config, &node);
                hop_keys.fill(&mut snapshot, &config, &credentials, &node);
                usage.fill(&mut snapshot, SystemTime::now());
                Ok(snapshot)
            })
            .take_until(ended(self.shutdown.clone(), changed));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_status(
        &self,
        request: Request<NodeReport>,
    ) -> Result<Response<ReportAck>, Status> {
        let node = node_name(&request.get_ref().node);
        self.check_token(&request, &node, false)?;
        let mut report = request.into_inner();
        report.node = node;
        for event in std::mem::take(&mut report.events) {
            match notice(&report.node, &event) {
                Some(notice) => {
                    self.hub.webhooks().notify(notice);
                }
                None => tracing::debug!(
                    node = %report.node,
                    event = %event.name,
                    "report event ignored: not one a data plane raises"
                ),
            }
        }
        if report.rejected_version != 0 {
            tracing::warn!(
                node = %report.node,
                version = report.rejected_version,
                reason = %report.rejected_reason,
                "data plane rejected a snapshot"
            );
        }
        let node = report.node.clone();
        let batch = report.usage.take();
        let cloud_rows = std::mem::take(&mut report.usage_cloud);
        self.hub.record_report(report);
        // Applied (and its day written) before the ack, which lets the node forget it.
        let usage = self.usage.clone();
        let from = node.clone();
        let snapshot = self.hub.current();
        let clients = snapshot.clone();
        let config = self.hub.config();
        let reporter = Reporter {
            allowance: bound::allowance(&config, &node),
            slots: bound::slots(&config.ollama.hosts, &node),
            holder: self.hub.holder(&node),
            node: from,
        };
        let (receipt, notices) = tokio::task::spawn_blocking(move || {
            let now = SystemTime::now();
            let receipt = usage.apply_report(&reporter, batch.as_ref(), &cloud_rows, now);
            (receipt, usage.exceeded(&clients.clients, now))
        })
        .await
        .map_err(|error| Status::internal(format!("usage task failed: {error}")))?;
        for notice in notices {
            self.hub.webhooks().notify(notice);
        }
        let now = SystemTime::now();
        Ok(Response::new(ReportAck {
            current_version: snapshot.version,
            nodes: self.hub.loads_for(&node),
            usage_seq: receipt.seq,
            budgets: self.usage.budgets(&snapshot.clients, now),
            today: self.usage.today(now),
            usage_refused: receipt.refused.unwrap_or_default(),
            polled: self.polled(),
        }))
    }
}

impl PolicyApi {
    /// When each host was last polled, from the inventory (which a poll that changed
    /// nothing still updates).
    fn polled(&self) -> Vec<HostPolled> {
        let mut polled: Vec<HostPolled> = self
            .hub
            .inventory()
            .into_iter()
            .filter_map(|(name, inventory)| {
                inventory.last_checked.map(|at| HostPolled {
                    name,
                    last_checked_unix_ms: compile::unix_ms(at),
                })
            })
            .collect();
        polled.sort_by(|a, b| a.name.cmp(&b.name));
        polled
    }
}

/// The name a call is made under: a data plane that names none is `default`.
fn node_name(node: &str) -> String {
    if node.is_empty() {
        "default".to_owned()
    } else {
        node.to_owned()
    }
}

/// Resolves when the control plane stops or the node's credential changes.
async fn ended(shutdown: CancellationToken, changed: CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled_owned() => {}
        () = changed.cancelled_owned() => {}
    }
}

/// A data plane's event as a webhook notice; `None` for names a data plane
/// does not raise (host health and key events come from the control plane
/// itself, so a data plane's copy would be a duplicate).
fn notice(node: &str, event: &Event) -> Option<Notice> {
    let kind: WebhookEvent = event.name.parse().ok()?;
    let notice = Notice::new(kind).tier(tier_from_wire(event.tier));
    let notice = match u64::try_from(event.unix_ms) {
        Ok(ms) if ms > 0 => notice.at(UNIX_EPOCH + Duration::from_millis(ms)),
        _ => notice.at(SystemTime::now()),
    };
    Some(match kind {
        WebhookEvent::QueueFull | WebhookEvent::QueueOverCapacity => notice
            .field("client_id", event.client_id.as_str())
            .field("node", node),
        WebhookEvent::QueueHighWatermark => notice
            .field("queue_depth", event.queue_depth)
            .field("node", node),
        WebhookEvent::QueueDrained => notice.tier(None).field("node", node),
        WebhookEvent::HostUnhealthy
        | WebhookEvent::HostRecovered
        | WebhookEvent::KeyRevoked
        | WebhookEvent::KeyRotated
        | WebhookEvent::ClientBudgetExceeded
        | WebhookEvent::Audit
        | WebhookEvent::CloudUnderReserve
        | WebhookEvent::CloudRefused => return None,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use oqp_proto::policy::v1::Tier;
    use serde_json::json;

    use super::*;

    fn event(name: &str) -> Event {
        Event {
            name: name.to_owned(),
            tier: Tier::High as i32,
            client_id: "alice".to_owned(),
            queue_depth: 40,
            unix_ms: 1_776_758_400_123,
            host: String::new(),
        }
    }

    #[test]
    fn queue_events_carry_their_fields_and_the_node() {
        let full = notice("gpu-1", &event("queue.full")).unwrap().to_json();
        assert_eq!(
            full,
            json!({
                "event": "queue.full",
                "timestamp": "2026-04-21T08:00:00.123000Z",
                "tier": "high",
                "client_id": "alice",
                "node": "gpu-1",
            })
        );
        let over = notice("gpu-1", &event("queue.over_capacity"))
            .unwrap()
            .to_json();
        assert_eq!(over["client_id"], "alice");
        assert_eq!(over["tier"], "high");
        let watermark = notice("gpu-1", &event("queue.high_watermark"))
            .unwrap()
            .to_json();
        assert_eq!(watermark["queue_depth"], 40);
        assert!(watermark.get("client_id").is_none());
        let drained = notice("gpu-1", &event("queue.drained")).unwrap().to_json();
        let keys: Vec<&str> = drained
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys, ["event", "timestamp", "node"]);
    }

    #[test]
    fn an_unspecified_tier_is_left_out() {
        let mut untiered = event("queue.full");
        untiered.tier = Tier::Unspecified as i32;
        untiered.unix_ms = 0;
        let body = notice("n", &untiered).unwrap().to_json();
        assert!(body.get("tier").is_none(), "{body}");
        assert!(body["timestamp"].as_str().unwrap().ends_with('Z'));
    }

    #[test]
    fn control_plane_events_and_unknown_names_are_not_forwarded() {
        for name in [
            "host.unhealthy",
            "host.recovered",
            "key.revoked",
            "queue.exploded",
            "",
        ] {
            assert!(notice("n", &event(name)).is_none(), "{name}");
        }
    }
}
