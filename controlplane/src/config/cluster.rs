//! The `control_plane` and `nodes` sections: where data planes connect and with which token;
//! each node's listener overrides, how its peers reach it, and which hosts it owns.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::env::Env;
use super::error::Problems;
use super::field::{checked, ranged, text};
use super::keys::{KeySource, Required};
use super::net;
use super::scalar::Text;
use super::schema::{RawControlPlane, RawNode};
use super::types::{
    AuditConfig, ControlPlaneConfig, HostConfig, NodeOverride, ProxyConfig, TlsConfig,
};

pub(crate) fn control_plane(
    raw: RawControlPlane,
    env: &Env,
    problems: &mut Problems,
) -> Option<ControlPlaneConfig> {
    let defaults = ControlPlaneConfig::default();
    checked(problems, |problems| {
        let listen = text(raw.listen, &defaults.listen);
        if let Err(reason) = net::parse_listen(&listen) {
            problems.error(format!("control_plane.listen: {reason}"));
        }
        let source = KeySource {
            fields: ["node_token", "node_token_env", "node_token_file"],
            literal: raw.node_token.as_ref(),
            env_var: raw.node_token_env.as_ref(),
            file: raw.node_token_file.as_ref(),
        };
        let node_token = source
            .resolve("control_plane", Required::AtMostOne, env, problems)
            .ok()
            .flatten();
        let state_dir = match raw.state_dir {
            None => defaults.state_dir.clone(),
            Some(Text(dir)) if dir.trim().is_empty() => {
                problems.error("control_plane.state_dir must not be empty");
                defaults.state_dir.clone()
            }
            Some(Text(dir)) => PathBuf::from(dir.trim()),
        };
        let tls = raw.tls.map(|tls| {
            for (field, value) in [("cert", &tls.cert.0), ("key", &tls.key.0)] {
                if value.trim().is_empty() {
                    problems.error(format!("control_plane.tls.{field} must be a file path"));
                }
            }
            TlsConfig {
                cert: PathBuf::from(tls.cert.0.trim()),
                key: PathBuf::from(tls.key.0.trim()),
            }
        });
        let audit = raw.audit.map_or_else(AuditConfig::default, |audit| {
            let defaults = AuditConfig::default();
            AuditConfig {
                max_file_mb: ranged(
                    audit.max_file_mb,
                    defaults.max_file_mb,
                    1..=1024,
                    problems,
                    |value| {
                        format!("control_plane.audit.max_file_mb must be 1 to 1024, got {value}")
                    },
                ),
                keep_files: ranged(
                    audit.keep_files,
                    defaults.keep_files,
                    0..=100,
                    problems,
                    |value| format!("control_plane.audit.keep_files must be 0 to 100, got {value}"),
                ),
            }
        });
        ControlPlaneConfig {
            listen,
            node_token,
            state_dir,
            tls,
            audit,
        }
    })
}

/// `nodes.NAME.url`: an `http`/`https` base URL — a reachable host, an optional port and
/// nothing after them (requests keep their own paths).
fn peer_url(text: &str, path: &str, problems: &mut Problems) -> Option<String> {
    match net::parse_http_url(text) {
        Ok(url) if url.has_userinfo || url.has_query_or_fragment || has_path(&url.normalized) => {
            problems.error(format!(
                "{path}.url must be scheme://host[:port] only, without credentials, a path, a \
                 query or a fragment"
            ));
            None
        }
        Ok(url) if is_wildcard(&url.host) => {
            problems.error(format!(
                "{path}.url names the wildcard address '{}': give an address peers can reach",
                url.host
            ));
            None
        }
        Ok(url) => Some(url.normalized),
        Err(_) => {
            problems.error(format!(
                "{path}.url must be an http:// or https:// URL, e.g. http://10.0.0.2:11435"
            ));
            None
        }
    }
}

/// Ownership: with two or more nodes listed, every host names the node beside it, that node
/// is listed, peers can reach every node, and the node token that keys the hop is set. A host
/// naming an unlisted node is an error however many nodes there are.
pub(crate) fn ownership(
    hosts: &[HostConfig],
    nodes: &BTreeMap<String, NodeOverride>,
    proxy: &ProxyConfig,
    control_plane: &ControlPlaneConfig,
    problems: &mut Problems,
) {
    let several = nodes.len() >= 2;
    for (index, host) in hosts.iter().enumerate() {
        let path = format!("ollama.hosts[{index}].node");
        match host.node.as_deref() {
            Some("") => problems.error(format!(
                "{path} must name a node listed under nodes (listed: {})",
                listed(nodes)
            )),
            Some(node) if !nodes.contains_key(node) => {
                problems.error(format!(
                    "{path}: node '{node}' is not listed under nodes (listed: {})",
                    listed(nodes)
                ));
            }
            None if several => problems.error(format!(
                "{path} is required when nodes lists two or more nodes: name the data plane \
                 beside host '{}' (one of {})",
                host.name,
                listed(nodes)
            )),
            _ => {}
        }
    }
    let owned = hosts.iter().any(|host| host.node.is_some());
    if (several || owned) && control_plane.node_token.is_none() {
        problems.error(
            "control_plane.node_token is required when nodes lists two or more nodes or a host \
             names its node: it authenticates data planes and keys the identity they assert to \
             each other",
        );
    }
    if !several {
        return;
    }
    for (name, node) in nodes {
        let host = node.host.as_deref().unwrap_or(&proxy.host);
        if node.url.is_none() && is_wildcard(host) {
            problems.error(format!(
                "nodes.{name}.url is required: node '{name}' listens on the wildcard address \
                 '{host}', so its peers cannot tell where to reach it"
            ));
        }
    }
}

fn has_path(normalized: &str) -> bool {
    normalized
        .split_once("://")
        .is_some_and(|(_, rest)| rest.contains('/'))
}

fn listed(nodes: &BTreeMap<String, NodeOverride>) -> String {
    if nodes.is_empty() {
        return "none".to_owned();
    }
    nodes
        .keys()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `0.0.0.0`, `::` and their spellings: an address to bind, not one to reach.
fn is_wildcard(host: &str) -> bool {
    host.trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
}

pub(crate) fn nodes(
    raw: BTreeMap<String, RawNode>,
    problems: &mut Problems,
) -> Option<BTreeMap<String, NodeOverride>> {
    checked(problems, |problems| {
        raw.into_iter()
            .map(|(name, node)| {
                let path = format!("nodes.{name}");
                if name.trim().is_empty() {
                    problems.error("nodes: a node name must not be empty");
                }
                let host = node.host.map(|text| text.0.trim().to_string());
                if let Some(host) = host.as_deref()
                    && !net::is_host(host)
                {
                    problems.error(format!(
                        "{path}.host: '{host}' is not an IP address or host name"
                    ));
                }
                let port = node.port.map(|port| {
                    ranged(Some(port), 0, 0..=65535, problems, |n| {
                        format!(
                            "{path}.port: invalid port {n} (must be 0-65535; 0 = any free port)"
                        )
                    })
                });
                let url = node.url.and_then(|url| peer_url(&url.0, &path, problems));
                (name, NodeOverride { host, port, url })
            })
            .collect()
    })
}
