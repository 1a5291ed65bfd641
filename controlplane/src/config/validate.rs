//! Checks that span sections: injection listeners against the proxy port and the configured
//! keys, and the security warnings a start-up should print.

use std::collections::BTreeMap;

use super::HostKind;
use super::error::Problems;
use super::field::{checked, ranged};
use super::net;
use super::scalar::Text;
use super::schema::{RawInjection, RawListener};
use super::types::{AuthConfig, ClientInjectionConfig, Config, InjectionListener};

/// Resolves `client_injection`. Needs `proxy.port` and the resolved keys (`inject_as` must name
/// one, even with auth off); the caller passes `None` for either when its section failed, which
/// skips the checks that depend on it.
pub(crate) fn client_injection(
    raw: RawInjection,
    listeners: Option<&[RawListener]>,
    proxy_port: Option<u16>,
    auth: Option<&AuthConfig>,
    problems: &mut Problems,
) -> Option<ClientInjectionConfig> {
    let allow_public_injection = raw.allow_public_injection.is_some_and(|flag| flag.0);
    let listeners = listeners?;
    checked(problems, |problems| {
        let mut ports: BTreeMap<u16, usize> = BTreeMap::new();
        let mut resolved = Vec::new();
        for raw in listeners {
            let listen_port = ranged(Some(raw.listen_port), 0u16, 1024..=65535, problems, |n| {
                format!("client_injection.listeners[].listen_port must be in 1024-65535, got {n}")
            });
            let inject_as = raw.inject_as.0.trim().to_string();
            let bind = raw
                .bind
                .as_ref()
                .map_or(InjectionListener::DEFAULT_BIND.to_string(), |Text(bind)| {
                    bind.trim().to_string()
                });
            if listen_port != 0 {
                let taken =
                    proxy_port == Some(listen_port) || ports.insert(listen_port, 0).is_some();
                if taken {
                    problems.error(format!(
                        "client_injection.listeners[].listen_port {listen_port} conflicts with \
                         another port (proxy.port or another injection listener)."
                    ));
                }
            }
            if let Some(auth) = auth
                && auth.key(&inject_as).is_none()
            {
                let known: Vec<String> = auth
                    .keys
                    .iter()
                    .map(|key| format!("'{}'", key.client_id))
                    .collect();
                problems.error(format!(
                    "client_injection.listeners[].inject_as '{inject_as}' does not match any \
                     auth.keys[].client_id. Known IDs: [{}]",
                    known.join(", ")
                ));
            }
            let bracketless = bind.trim_start_matches('[').trim_end_matches(']');
            if !net::is_host(bracketless) {
                problems.error(format!(
                    "client_injection.listeners[listen_port={listen_port}].bind: '{bind}' is not \
                     an IP address or host name"
                ));
            } else if !net::is_loopback(&bind) && !allow_public_injection {
                problems.error(format!(
                    "client_injection.listeners[listen_port={listen_port}].bind is '{bind}' \
                     (non-loopback) but allow_public_injection is false. Bind to 127.0.0.1, or set \
                     client_injection.allow_public_injection: true to expose this port to the network."
                ));
            }
            let tls = raw.tls.as_ref().and_then(|tls| {
                super::resolve::tls(
                    tls.clone(),
                    &format!("client_injection.listeners[listen_port={listen_port}].tls"),
                    problems,
                )
            });
            resolved.push(InjectionListener {
                listen_port,
                inject_as,
                bind,
                tls,
                trust_users: super::field::flag(raw.trust_users, false),
            });
        }
        ClientInjectionConfig {
            listeners: resolved,
            allow_public_injection,
        }
    })
}

/// Warnings about a configuration that loads but exposes more than its author may think.
pub(crate) fn security_warnings(config: &Config, problems: &mut Problems) {
    let auth_off = !config.auth.enabled;
    if auth_off && !net::is_loopback(&config.proxy.host) {
        problems.warn(format!(
            "SECURITY WARNING: auth.enabled is false and proxy is binding to {}. Any host that can \
             reach port {} has unauthenticated Ollama access. Set auth.enabled: true or bind \
             proxy.host to 127.0.0.1.",
            config.proxy.host, config.proxy.port
        ));
    }
    let injection = &config.client_injection;
    if injection.allow_public_injection && auth_off {
        problems.warn(
            "WARNING: allow_public_injection is true AND auth.enabled is false. Any host on the \
             network can consume GPU time through the injection ports with no credential.",
        );
    } else if injection
        .listeners
        .iter()
        .any(|listener| !net::is_loopback(&listener.bind))
    {
        problems.warn(
            "WARNING: one or more client_injection.listeners bind to a non-loopback address. \
             Anyone who can reach those ports acts as the injected client, without a key.",
        );
    }
    for (index, host) in config.ollama.hosts.iter().enumerate() {
        let plaintext = host.kind == HostKind::Cloud
            && host.url.starts_with("http://")
            && net::parse_http_url(&host.url).is_ok_and(|url| !net::is_loopback(&url.host));
        if plaintext {
            problems.warn(format!(
                "ollama.hosts[{index}] ('{}') is a cloud host at http://: its API keys and every \
                 prompt travel in plaintext; use https://",
                host.name
            ));
        }
    }
    let control_plane = &config.control_plane;
    let listen_host = net::parse_listen(&control_plane.listen).unwrap_or("127.0.0.1");
    if !net::is_loopback(listen_host) {
        if control_plane.node_token.is_none() {
            problems.warn(format!(
                "control_plane.listen is {} but no node_token is set: any host that can reach it \
                 can connect as a data plane and receive key digests and cloud keys",
                control_plane.listen
            ));
        }
        if control_plane.tls.is_none() {
            problems.warn(format!(
                "control_plane.listen is {} without control_plane.tls: policy snapshots (cloud \
                 keys, node token) travel in plaintext",
                control_plane.listen
            ));
        }
    }
}
