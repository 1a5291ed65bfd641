//! `PolicyService`: data planes watch snapshots and report status.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use oqp_proto::policy::v1::{
    NodeHello, NodeReport, PolicySnapshot, ReportAck, policy_service_server::PolicyService,
};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::compile;
use crate::hub::Hub;

/// Serves the policy stream.
#[derive(Debug, Clone)]
pub struct PolicyApi {
    hub: Arc<Hub>,
    shutdown: CancellationToken,
}

impl PolicyApi {
    /// An API over `hub`. Watch streams end when `shutdown` is cancelled,
    /// so that the server's graceful shutdown is not held open by them.
    pub fn new(hub: Arc<Hub>, shutdown: CancellationToken) -> Self {
        Self { hub, shutdown }
    }

    fn check_token<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let config = self.hub.config();
        let Some(expected) = &config.control_plane.node_token else {
            return Ok(());
        };
        let presented = request
            .metadata()
            .get(oqp_proto::NODE_TOKEN_METADATA)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default();
        if super::secrets_match(presented, expected.expose()) {
            Ok(())
        } else {
            Err(Status::unauthenticated("invalid node token"))
        }
    }
}

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<PolicySnapshot, Status>> + Send>>;

/// Marks a node's watch closed when its stream is dropped.
struct WatchGuard {
    hub: Arc<Hub>,
    node: String,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.hub.watch_changed(&self.node, false);
        tracing::info!(node = %self.node, "data plane stopped watching");
    }
}

#[tonic::async_trait]
impl PolicyService for PolicyApi {
    type WatchPolicyStream = SnapshotStream;

    async fn watch_policy(
        &self,
        request: Request<NodeHello>,
    ) -> Result<Response<Self::WatchPolicyStream>, Status> {
        self.check_token(&request)?;
        let hello = request.into_inner();
        let node = if hello.node.is_empty() {
            "default".to_owned()
        } else {
            hello.node
        };
        tracing::info!(%node, version = %hello.software_version, "data plane watching");
        self.hub.watch_changed(&node, true);
        let guard = WatchGuard {
            hub: self.hub.clone(),
            node: node.clone(),
        };
        let hub = self.hub.clone();
        let stream = WatchStream::new(self.hub.subscribe())
            .map(move |snapshot| {
                let _guard = &guard;
                Ok(compile::for_node(&snapshot, &hub.config(), &node))
            })
            .take_until(self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_status(
        &self,
        request: Request<NodeReport>,
    ) -> Result<Response<ReportAck>, Status> {
        self.check_token(&request)?;
        let report = request.into_inner();
        if report.rejected_version != 0 {
            tracing::warn!(
                node = %report.node,
                version = report.rejected_version,
                reason = %report.rejected_reason,
                "data plane rejected a snapshot"
            );
        }
        self.hub.record_report(report);
        Ok(Response::new(ReportAck {
            current_version: self.hub.current().version,
        }))
    }
}
