//! The start-up SSRF check of `webhooks.url`: a webhook must not be a way to
//! make the control plane POST into the private network it sits in.
//!
//! The check is static: it looks at the URL and at what its host name
//! resolves to once, at start-up (and on a reload that changes the URL); it
//! sends nothing. Host names listed in `webhooks.allowed_hosts` skip it, which
//! is how a LAN target is allowed on purpose. Against DNS rebinding after the
//! check, each delivery to a host not listed resolves the name again and connects
//! only to the addresses [`is_blocked`] lets through
//! ([`Outbound::public_only`](crate::outbound::Outbound::public_only)).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};

use http::Uri;

use crate::config::WebhooksConfig;

/// Why a webhook URL was refused. The messages are the reference's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SsrfError {
    /// Not `http` or `https`.
    #[error("Webhook URL must use http or https scheme, got: '{0}'")]
    Scheme(String),
    /// No host name after the scheme.
    #[error("Webhook URL has no hostname")]
    NoHost,
    /// The URL does not parse.
    #[error("Webhook URL is invalid: {0}")]
    Invalid(String),
    /// The host (or one of its addresses) is private, loopback or link-local.
    #[error(
        "Webhook URL resolves to a private/loopback address ({host} -> {addr}). This is an SSRF risk. Use a public URL."
    )]
    Private { host: String, addr: IpAddr },
    /// The host name does not resolve.
    #[error("Webhook URL hostname cannot be resolved: {host} ({error})")]
    Unresolvable { host: String, error: String },
}

/// What the check has to do for a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// Listed in `allowed_hosts`: accepted as is.
    Allowed(String),
    /// An IP literal: classified without DNS.
    Literal(String, IpAddr),
    /// A host name to resolve, with the port to resolve it for.
    Name(String, u16),
}

/// Whether `url`'s host is in `allowed_hosts` (exempt from the check, at start-up and at
/// each delivery).
pub fn is_allowed(url: &str, allowed_hosts: &[String]) -> bool {
    matches!(target(url, allowed_hosts), Ok(Target::Allowed(_)))
}

/// Checks `config.webhooks` when enabled, resolving names with tokio (start-up).
pub async fn check(config: &WebhooksConfig) -> Result<(), SsrfError> {
    if !config.enabled {
        return Ok(());
    }
    match target(&config.url, &config.allowed_hosts)? {
        Target::Allowed(host) => {
            tracing::info!(%host, "webhook SSRF check bypassed: host is in webhooks.allowed_hosts");
            Ok(())
        }
        Target::Literal(host, addr) => verdict(&host, &[addr]),
        Target::Name(host, port) => {
            let resolved = tokio::net::lookup_host((host.as_str(), port))
                .await
                .map(|addrs| addrs.map(|a| a.ip()).collect::<Vec<_>>());
            match resolved {
                Ok(addrs) => verdict(&host, &addrs),
                Err(error) => Err(SsrfError::Unresolvable {
                    host,
                    error: error.to_string(),
                }),
            }
        }
    }
}

/// The same check for another URL the control plane fetches by itself (a `jwt`'s
/// `jwks_url`), with that URL's own `allowed_hosts`: `Ok(true)` when its host is listed there
/// (exempt, also when connecting), `Ok(false)` when it passed, and is then reached only
/// through [`Outbound::public_only`](crate::outbound::Outbound::public_only).
pub async fn check_url(url: &str, allowed_hosts: &[String]) -> Result<bool, SsrfError> {
    match target(url, allowed_hosts)? {
        Target::Allowed(_) => Ok(true),
        Target::Literal(host, addr) => verdict(&host, &[addr]).map(|()| false),
        Target::Name(host, port) => {
            let resolved = tokio::net::lookup_host((host.as_str(), port))
                .await
                .map_err(|error| SsrfError::Unresolvable {
                    host: host.clone(),
                    error: error.to_string(),
                })?;
            let addrs: Vec<IpAddr> = resolved.map(|addr| addr.ip()).collect();
            verdict(&host, &addrs).map(|()| false)
        }
    }
}

/// The same check with a blocking resolver, for the (synchronous) reload
/// path; like reading the config file there, it blocks the caller briefly.
pub fn check_blocking(config: &WebhooksConfig) -> Result<(), SsrfError> {
    if !config.enabled {
        return Ok(());
    }
    match target(&config.url, &config.allowed_hosts)? {
        Target::Allowed(host) => {
            tracing::info!(%host, "webhook SSRF check bypassed: host is in webhooks.allowed_hosts");
            Ok(())
        }
        Target::Literal(host, addr) => verdict(&host, &[addr]),
        Target::Name(host, port) => match (host.as_str(), port).to_socket_addrs() {
            Ok(addrs) => verdict(&host, &addrs.map(|a| a.ip()).collect::<Vec<_>>()),
            Err(error) => Err(SsrfError::Unresolvable {
                host,
                error: error.to_string(),
            }),
        },
    }
}

/// Whether an address is one a webhook must not reach: 10/8, 172.16/12,
/// 192.168/16, 127/8, 169.254/16, 100.64/10, 0/8, 198.18/15 (benchmarking,
/// often routed internally), multicast 224/4 and reserved 240/4 (broadcast
/// included), `::1`, `::`, fc00::/7, fe80::/10, multicast ff00::/8, the NAT64
/// prefixes 64:ff9b::/96 and 64:ff9b:1::/48 (a gateway translates them to
/// any IPv4 address, private ones included), and the IPv4-mapped and
/// IPv4-compatible forms of the IPv4 ranges.
pub fn is_blocked(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(v4) => is_blocked_v4(v4),
        IpAddr::V6(v6) => is_blocked_v6(v6),
    }
}

fn is_blocked_v4(addr: Ipv4Addr) -> bool {
    let [a, b, ..] = addr.octets();
    a == 10
        || (a == 172 && (16..=31).contains(&b))
        || (a == 192 && b == 168)
        || a == 127
        || (a == 169 && b == 254)
        || (a == 100 && (64..=127).contains(&b))
        || a == 0
        || (a == 198 && (18..=19).contains(&b))
        || a >= 224
}

fn is_blocked_v6(addr: Ipv6Addr) -> bool {
    let segments = addr.segments();
    let first = segments[0];
    let nat64 = first == 0x0064
        && segments[1] == 0xff9b
        && (segments[2] == 0x0001 || segments[2..6] == [0, 0, 0, 0]);
    addr.is_loopback()
        || addr.is_unspecified()
        || (first & 0xfe00) == 0xfc00
        || (first & 0xffc0) == 0xfe80
        || (first & 0xff00) == 0xff00
        || nat64
        // `::ffff:10.0.0.1` and `::10.0.0.1` reach the IPv4 address.
        || addr.to_ipv4().is_some_and(is_blocked_v4)
}

/// Parses the URL and decides whether DNS is needed.
fn target(url: &str, allowed_hosts: &[String]) -> Result<Target, SsrfError> {
    let url = url.trim();
    let Some((scheme, _)) = url.split_once("://") else {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        return Err(SsrfError::Scheme(scheme.to_owned()));
    };
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => 80,
        "https" => 443,
        _ => return Err(SsrfError::Scheme(scheme)),
    };
    let uri: Uri = url
        .parse()
        .map_err(|error: http::uri::InvalidUri| SsrfError::Invalid(error.to_string()))?;
    let host = uri.host().unwrap_or_default();
    let host = host
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(SsrfError::NoHost);
    }
    let listed = allowed_hosts.iter().any(|allowed| {
        let allowed = allowed.trim();
        let allowed = allowed
            .strip_prefix('[')
            .and_then(|inner| inner.strip_suffix(']'))
            .unwrap_or(allowed);
        allowed.eq_ignore_ascii_case(host)
    });
    if listed {
        return Ok(Target::Allowed(host.to_owned()));
    }
    Ok(match host.parse::<IpAddr>() {
        Ok(addr) => Target::Literal(host.to_owned(), addr),
        Err(_) => Target::Name(host.to_owned(), uri.port_u16().unwrap_or(default_port)),
    })
}

/// Refuses if any address is blocked: a name with one private address among
/// public ones could still be made to reach it.
fn verdict(host: &str, addrs: &[IpAddr]) -> Result<(), SsrfError> {
    if addrs.is_empty() {
        return Err(SsrfError::Unresolvable {
            host: host.to_owned(),
            error: "no addresses".to_owned(),
        });
    }
    match addrs.iter().find(|addr| is_blocked(**addr)) {
        Some(addr) => Err(SsrfError::Private {
            host: host.to_owned(),
            addr: *addr,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn config(url: &str, allowed: &[&str]) -> WebhooksConfig {
        WebhooksConfig {
            enabled: true,
            url: url.to_owned(),
            allowed_hosts: allowed.iter().map(|h| (*h).to_owned()).collect(),
            ..WebhooksConfig::default()
        }
    }

    #[test]
    fn private_literals_are_blocked() {
        for blocked in [
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "127.0.0.1",
            "127.9.9.9",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "0.0.0.0",
            "0.1.2.3",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "febf::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::192.168.0.1",
            "198.18.0.1",
            "198.19.255.255",
            "224.0.0.1",
            "239.255.255.250",
            "255.255.255.255",
            "240.0.0.1",
            "ff02::1",
            "ff05::1:3",
            "ff0e::1",
            "64:ff9b::a00:1",
            "64:ff9b::808:808",
            "64:ff9b::7f00:1",
            "64:ff9b:1::1",
            "64:ff9b:1:ffff:ffff:ffff:ffff:ffff",
            "::ffff:224.0.0.1",
        ] {
            assert!(is_blocked(blocked.parse().unwrap()), "{blocked}");
        }
        for public in [
            "8.8.8.8",
            "1.1.1.1",
            "172.15.255.255",
            "172.32.0.1",
            "192.169.0.1",
            "100.63.255.255",
            "100.128.0.1",
            "169.253.0.1",
            "2606:4700:4700::1111",
            "fec0::1",
            "::ffff:8.8.8.8",
            "198.17.255.255",
            "198.20.0.1",
            "223.255.255.255",
            "64:ff9b:2::1",
            "64:ff9b:0:0:1::1",
            "fe00::1",
        ] {
            assert!(!is_blocked(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn literal_urls_are_checked_without_dns() {
        let error = check_blocking(&config("http://10.0.0.1/hook", &[])).unwrap_err();
        assert_eq!(
            error.to_string(),
            "Webhook URL resolves to a private/loopback address (10.0.0.1 -> 10.0.0.1). \
             This is an SSRF risk. Use a public URL."
        );
        assert!(matches!(
            check_blocking(&config("http://[::ffff:192.168.1.1]:8080/x", &[])),
            Err(SsrfError::Private { .. })
        ));
        assert_eq!(check_blocking(&config("https://8.8.8.8/hook", &[])), Ok(()));
        assert_eq!(
            check_blocking(&config("https://[2606:4700::1111]/hook", &[])),
            Ok(())
        );
    }

    #[test]
    fn allowed_hosts_bypass_the_check() {
        assert_eq!(
            check_blocking(&config("http://127.0.0.1:9000/hook", &["127.0.0.1"])),
            Ok(())
        );
        assert_eq!(
            check_blocking(&config("http://LocalHost/hook", &["localhost"])),
            Ok(())
        );
        assert_eq!(
            check_blocking(&config("http://[::1]/hook", &["[::1]"])),
            Ok(())
        );
        // Exact host match only: another host is still checked.
        assert!(check_blocking(&config("http://10.0.0.2/hook", &["10.0.0.1"])).is_err());
    }

    #[test]
    fn disabled_webhooks_are_not_checked() {
        let mut disabled = config("http://10.0.0.1/hook", &[]);
        disabled.enabled = false;
        assert_eq!(check_blocking(&disabled), Ok(()));
    }

    #[test]
    fn scheme_and_host_are_required() {
        assert_eq!(
            check_blocking(&config("ftp://example.com/x", &[])),
            Err(SsrfError::Scheme("ftp".to_owned()))
        );
        assert_eq!(
            check_blocking(&config("example.com/x", &[])),
            Err(SsrfError::Scheme(String::new()))
        );
        assert!(check_blocking(&config("http:///x", &[])).is_err());
    }

    #[test]
    fn every_resolved_address_must_be_public() {
        let public: IpAddr = "93.184.216.34".parse().unwrap();
        let private: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(verdict("example.com", &[public]), Ok(()));
        assert_eq!(
            verdict("example.com", &[public, private]),
            Err(SsrfError::Private {
                host: "example.com".to_owned(),
                addr: private
            })
        );
        assert!(matches!(
            verdict("example.com", &[]),
            Err(SsrfError::Unresolvable { .. })
        ));
        assert_eq!(
            target("https://hooks.example.com/x", &[]),
            Ok(Target::Name("hooks.example.com".to_owned(), 443))
        );
        assert_eq!(
            target("http://hooks.example.com:8080/x", &[]),
            Ok(Target::Name("hooks.example.com".to_owned(), 8080))
        );
    }

    #[tokio::test]
    async fn names_resolving_to_loopback_are_refused() {
        // `localhost` resolves from /etc/hosts, without the network.
        let error = check(&config("http://localhost:9/hook", &[]))
            .await
            .unwrap_err();
        assert!(
            matches!(&error, SsrfError::Private { host, addr } if host == "localhost" && addr.is_loopback()),
            "{error}"
        );
        assert!(check_blocking(&config("http://localhost:9/hook", &[])).is_err());
    }
}
