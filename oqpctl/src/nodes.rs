//! `oqpctl nodes`: the data planes' own tokens (`AddNode`, `RevokeNode`, `ListNodes`).
//! A node's token is printed once, by `add`; the control plane keeps only its digests.

use std::time::{Duration, UNIX_EPOCH};

use clap::Subcommand;
use oqp_proto::admin::v1 as api;
use serde_json::{Value, json};

use crate::render::{Output, Style, pretty, table};

/// `oqpctl nodes …`.
#[derive(Debug, Subcommand)]
pub enum NodesCommand {
    /// The nodes that have their own token, and those revoked (never a token).
    List,
    /// Issues a data plane its own token, valid for its name alone; prints it once.
    Add {
        /// The node's name, as its data plane starts with (`--node NAME`).
        node: String,
    },
    /// Withdraws a node's token at once: its calls are refused and its watch ended.
    Revoke {
        /// The node's name.
        node: String,
    },
}

/// Runs `command` against the admin API.
pub async fn run(
    admin: &mut crate::client::Admin,
    command: NodesCommand,
    output: Output,
    style: Style,
) -> Result<(), tonic::Status> {
    let text = match command {
        NodesCommand::List => {
            let response = admin.list_nodes(api::ListNodesRequest {}).await?;
            list(&response.into_inner(), output, style)
        }
        NodesCommand::Add { node } => {
            let response = admin.add_node(api::AddNodeRequest { node }).await?;
            added(&response.into_inner(), output)
        }
        NodesCommand::Revoke { node } => {
            let response = admin
                .revoke_node(api::RevokeNodeRequest { node: node.clone() })
                .await?;
            revoked(&node, &response.into_inner(), output)
        }
    };
    println!("{text}");
    Ok(())
}

/// `oqpctl nodes list`.
pub fn list(response: &api::ListNodesResponse, output: Output, style: Style) -> String {
    match output {
        Output::Json => pretty(&Value::Array(response.nodes.iter().map(row_json).collect())),
        Output::Table => {
            let mut rows = table(style, &["node", "token", "issued", "connected"]);
            for node in &response.nodes {
                let state = if node.revoked_unix_ms > 0 {
                    format!("revoked {}", rfc3339(node.revoked_unix_ms))
                } else {
                    "valid".to_owned()
                };
                rows.add_row(vec![
                    node.node.clone(),
                    state,
                    rfc3339(node.created_unix_ms),
                    if node.connected { "yes" } else { "no" }.to_owned(),
                ]);
            }
            rows.to_string()
        }
    }
}

/// `oqpctl nodes add`: the token, once.
pub fn added(response: &api::AddNodeResponse, output: Output) -> String {
    let node = response.credential.clone().unwrap_or_default();
    match output {
        Output::Json => {
            let mut value = row_json(&node);
            value["token"] = json!(response.token);
            pretty(&value)
        }
        Output::Table => format!(
            "Issued node '{name}' its own token, shown only this once:\n\n    {token}\n\n\
             Start its data plane with --node {name} --node-token-file FILE (the token in \
             FILE, mode 0600). From now on only this token admits the name '{name}'.",
            name = node.node,
            token = response.token,
        ),
    }
}

/// `oqpctl nodes revoke`.
pub fn revoked(node: &str, response: &api::RevokeNodeResponse, output: Output) -> String {
    match output {
        Output::Json => pretty(&json!({
            "node": node,
            "revoked": true,
            "was_connected": response.was_connected,
        })),
        Output::Table => {
            let watch = if response.was_connected {
                " and its watch was ended"
            } else {
                ""
            };
            format!(
                "Revoked node '{node}': its token is refused from now on{watch}. \
                 `oqpctl nodes add {node}` issues it a new one."
            )
        }
    }
}

fn row_json(node: &api::NodeCredential) -> Value {
    json!({
        "node": node.node,
        "created_unix_ms": node.created_unix_ms,
        "revoked_unix_ms": (node.revoked_unix_ms > 0).then_some(node.revoked_unix_ms),
        "connected": node.connected,
    })
}

fn rfc3339(unix_ms: i64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(u64::try_from(unix_ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_shows_state_and_no_token() {
        let response = api::ListNodesResponse {
            nodes: vec![
                api::NodeCredential {
                    node: "box-a".into(),
                    created_unix_ms: 1_776_758_400_000,
                    revoked_unix_ms: 0,
                    connected: true,
                },
                api::NodeCredential {
                    node: "box-b".into(),
                    created_unix_ms: 1_776_758_400_000,
                    revoked_unix_ms: 1_776_762_000_000,
                    connected: false,
                },
            ],
        };
        let text = list(&response, Output::Table, Style::PLAIN);
        assert!(text.contains("box-a") && text.contains("valid"), "{text}");
        assert!(text.contains("revoked 2026-04-21T09:00:00Z"), "{text}");
        let json: Value =
            serde_json::from_str(&list(&response, Output::Json, Style::PLAIN)).unwrap();
        assert_eq!(json[0]["revoked_unix_ms"], Value::Null);
        assert_eq!(json[1]["revoked_unix_ms"], 1_776_762_000_000_i64);
        assert_eq!(json[0]["connected"], true);
    }
}
