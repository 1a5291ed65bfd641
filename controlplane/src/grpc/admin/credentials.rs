//! `AddNode`, `RevokeNode` and `ListNodes`: the nodes' own tokens
//! ([`crate::node_credentials`]). Only converts and records; the store validates and
//! persists. A token is returned once, by `AddNode`, and appears in no log, audit entry
//! or listing.

use std::time::SystemTime;

use oqp_proto::admin::v1 as api;
use tonic::{Request, Response, Status};

use super::AdminApi;
use crate::compile::unix_ms;
use crate::config::Scope;
use crate::node_credentials::{CredentialError, Listed};

/// Issues a node its own token.
pub(super) async fn add(
    admin: &AdminApi,
    request: Request<api::AddNodeRequest>,
) -> Result<Response<api::AddNodeResponse>, Status> {
    let (_, actor) = admin.authorize_as(&request, Scope::Management, "nodes.add")?;
    let source = request.remote_addr();
    let node = request.into_inner().node;
    let store = admin.credentials.clone();
    let name = node.clone();
    let issued = run(move || store.add(&name, now_ms())).await;
    admin.record(&actor, source, "nodes.add", &node, &issued);
    let (token, listed) = issued?;
    tracing::info!(%node, "node token issued");
    // Every peer's next snapshot carries its hop keys with the node.
    admin.hub.update_runtime(|_| {});
    let connected = connected(admin, &node);
    Ok(Response::new(api::AddNodeResponse {
        credential: Some(credential(listed, connected)),
        token: token.expose().to_owned(),
    }))
}

/// Withdraws a node's own token; its watch ends at once.
pub(super) async fn revoke(
    admin: &AdminApi,
    request: Request<api::RevokeNodeRequest>,
) -> Result<Response<api::RevokeNodeResponse>, Status> {
    let (_, actor) = admin.authorize_as(&request, Scope::Management, "nodes.revoke")?;
    let source = request.remote_addr();
    let node = request.into_inner().node;
    let was_connected = connected(admin, &node);
    let store = admin.credentials.clone();
    let name = node.clone();
    let revoked = run(move || store.revoke(&name, now_ms())).await;
    admin.record(&actor, source, "nodes.revoke", &node, &revoked);
    revoked?;
    tracing::warn!(%node, was_connected, "node token revoked");
    // Every peer's next snapshot drops its hop keys with the node.
    admin.hub.update_runtime(|_| {});
    Ok(Response::new(api::RevokeNodeResponse { was_connected }))
}

/// The nodes with their own token, and those revoked.
pub(super) fn list(
    admin: &AdminApi,
    request: &Request<api::ListNodesRequest>,
) -> Result<Response<api::ListNodesResponse>, Status> {
    admin.authorize(request, Scope::Read, "nodes.list")?;
    let seen = admin.hub.nodes();
    let nodes = admin
        .credentials
        .list()
        .into_iter()
        .map(|listed| {
            let connected = listed.revoked_unix_ms.is_none()
                && seen.get(&listed.node).is_some_and(|node| node.watches > 0);
            credential(listed, connected)
        })
        .collect();
    Ok(Response::new(api::ListNodesResponse { nodes }))
}

fn connected(admin: &AdminApi, node: &str) -> bool {
    admin
        .hub
        .nodes()
        .get(node)
        .is_some_and(|node| node.watches > 0)
}

fn credential(listed: Listed, connected: bool) -> api::NodeCredential {
    api::NodeCredential {
        node: listed.node,
        created_unix_ms: i64::try_from(listed.created_unix_ms).unwrap_or(i64::MAX),
        revoked_unix_ms: listed
            .revoked_unix_ms
            .map_or(0, |at| i64::try_from(at).unwrap_or(i64::MAX)),
        connected,
    }
}

fn now_ms() -> u64 {
    u64::try_from(unix_ms(SystemTime::now())).unwrap_or(0)
}

/// Runs a store change (a file write and fsyncs) off the async workers.
async fn run<T: Send + 'static>(
    change: impl FnOnce() -> Result<T, CredentialError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(change)
        .await
        .map_err(|error| Status::internal(format!("node credential task failed: {error}")))?
        .map_err(status)
}

/// The gRPC status of a refused change.
fn status(error: CredentialError) -> Status {
    let message = error.to_string();
    match error {
        CredentialError::InvalidName(_) | CredentialError::Reserved => {
            Status::invalid_argument(message)
        }
        CredentialError::Exists(_) => Status::already_exists(message),
        CredentialError::NotFound(_) => Status::not_found(message),
        CredentialError::Write { .. } | CredentialError::Random(_) => {
            tracing::error!("{message}");
            Status::internal(message)
        }
    }
}
