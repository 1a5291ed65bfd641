//! The `control_plane` and `nodes` sections: where data planes connect, with which token, and
//! per-node listener overrides.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::env::Env;
use super::error::Problems;
use super::keys::{KeySource, Required};
use super::net;
use super::resolve::{checked, ranged, text};
use super::scalar::Text;
use super::schema::{RawControlPlane, RawNode};
use super::types::{ControlPlaneConfig, NodeOverride, TlsConfig};

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
        ControlPlaneConfig {
            listen,
            node_token,
            state_dir,
            tls,
        }
    })
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
                    ranged(Some(port), 0, 1..=65535, problems, |n| {
                        format!("{path}.port: invalid port {n} (must be 1-65535)")
                    })
                });
                (name, NodeOverride { host, port })
            })
            .collect()
    })
}
