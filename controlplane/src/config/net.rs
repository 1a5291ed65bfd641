//! Address checks: upstream and webhook URLs, `host:port` listen addresses, and loopback
//! detection by parsing (not by comparing strings).

use std::net::{IpAddr, Ipv6Addr};

/// An `http`/`https` URL split into what the checks need.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HttpUrl {
    /// The URL with a lower-case scheme and without trailing slashes.
    pub normalized: String,
    /// Host name or IP address, without brackets.
    pub host: String,
    /// Whether a `?query` or `#fragment` is present.
    pub has_query_or_fragment: bool,
    /// Whether `user[:password]@` is present.
    pub has_userinfo: bool,
}

/// Why a URL was rejected.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum UrlError {
    /// Not `http` or `https`; carries the scheme found (`""` if none).
    Scheme(String),
    /// No host name after the scheme.
    NoHost,
    /// Anything else, as a message.
    Invalid(String),
}

/// Parses `scheme://[user@]host[:port][/path][?query][#fragment]` with scheme http or https.
pub(crate) fn parse_http_url(text: &str) -> Result<HttpUrl, UrlError> {
    let text = text.trim();
    let Some((scheme, rest)) = text.split_once("://") else {
        let scheme = text.split_once(':').map_or("", |(scheme, _)| scheme);
        return Err(UrlError::Scheme(scheme.to_string()));
    };
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "http" && scheme != "https" {
        return Err(UrlError::Scheme(scheme));
    }
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (has_userinfo, host_port) = match authority.rsplit_once('@') {
        Some((_, host_port)) => (true, host_port),
        None => (false, authority),
    };
    let (host, port) = split_host_port(host_port).map_err(UrlError::Invalid)?;
    if host.is_empty() {
        return Err(UrlError::NoHost);
    }
    if let Some(port) = port {
        match port.parse::<u16>() {
            Ok(port) if port > 0 => {}
            _ => return Err(UrlError::Invalid(format!("invalid port '{port}'"))),
        }
    }
    if host.parse::<IpAddr>().is_err() && !is_host_name(host) {
        return Err(UrlError::Invalid(format!("invalid host name '{host}'")));
    }
    let has_query_or_fragment = tail.contains(['?', '#']);
    let tail = if has_query_or_fragment {
        tail
    } else {
        tail.trim_end_matches('/')
    };
    Ok(HttpUrl {
        normalized: format!("{scheme}://{authority}{tail}"),
        host: host.to_string(),
        has_query_or_fragment,
        has_userinfo,
    })
}

/// Splits `host:port`, `[v6]:port`, `host`, `[v6]` or a bare IPv6 address.
pub(crate) fn split_host_port(text: &str) -> Result<(&str, Option<&str>), String> {
    if let Some(rest) = text.strip_prefix('[') {
        let Some((host, after)) = rest.split_once(']') else {
            return Err(format!("unclosed '[' in '{text}'"));
        };
        if host.parse::<Ipv6Addr>().is_err() {
            return Err(format!("'{host}' is not an IPv6 address"));
        }
        return match after {
            "" => Ok((host, None)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((host, Some(port))),
                None => Err(format!("unexpected '{after}' after ']'")),
            },
        };
    }
    if text.parse::<Ipv6Addr>().is_ok() {
        return Ok((text, None));
    }
    match text.rsplit_once(':') {
        Some((host, port)) => Ok((host, Some(port))),
        None => Ok((text, None)),
    }
}

/// Checks a `host:port` listen address; returns the host part.
pub(crate) fn parse_listen(text: &str) -> Result<&str, String> {
    let (host, port) = split_host_port(text.trim())?;
    let Some(port) = port else {
        return Err("expected host:port, e.g. 127.0.0.1:50051".to_string());
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("invalid port '{port}'"));
    }
    if host.is_empty() || (host.parse::<IpAddr>().is_err() && !is_host_name(host)) {
        return Err(format!("invalid host '{host}'"));
    }
    Ok(host)
}

/// Whether a bind address stays on this machine: `127.0.0.0/8`, `::1` (also IPv4-mapped) and
/// `localhost`.
pub(crate) fn is_loopback(address: &str) -> bool {
    let address = address.trim();
    let address = address
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .unwrap_or(address);
    if address
        .trim_end_matches('.')
        .eq_ignore_ascii_case("localhost")
    {
        return true;
    }
    match address.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

/// Whether `text` is an IP address or a syntactically valid host name.
pub(crate) fn is_host(text: &str) -> bool {
    text.parse::<IpAddr>().is_ok() || is_host_name(text)
}

/// Whether `host` is a syntactically valid DNS host name.
fn is_host_name(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalized() {
        let url = parse_http_url("HTTP://ollama:11434/").unwrap();
        assert_eq!(url.normalized, "http://ollama:11434");
        assert_eq!(url.host, "ollama");
        assert_eq!(
            parse_http_url("https://ollama.com").unwrap().host,
            "ollama.com"
        );
        assert_eq!(parse_http_url("http://[::1]:11434//").unwrap().host, "::1");
        assert_eq!(
            parse_http_url("http://gpu/ollama/").unwrap().normalized,
            "http://gpu/ollama"
        );
        assert!(
            parse_http_url("http://h/x?a=1")
                .unwrap()
                .has_query_or_fragment
        );
        assert!(parse_http_url("http://u:p@h").unwrap().has_userinfo);
    }

    #[test]
    fn bad_urls() {
        assert_eq!(
            parse_http_url("ftp://x"),
            Err(UrlError::Scheme("ftp".into()))
        );
        assert_eq!(
            parse_http_url("localhost:11434"),
            Err(UrlError::Scheme("localhost".into()))
        );
        assert_eq!(
            parse_http_url("ollama"),
            Err(UrlError::Scheme(String::new()))
        );
        assert_eq!(parse_http_url("http:///api"), Err(UrlError::NoHost));
        assert!(matches!(
            parse_http_url("http://h:99999"),
            Err(UrlError::Invalid(_))
        ));
        assert!(matches!(
            parse_http_url("http://bad host"),
            Err(UrlError::Invalid(_))
        ));
    }

    #[test]
    fn loopback_is_parsed() {
        for yes in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "[::1]",
            "localhost",
            "LOCALHOST",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_loopback(yes), "{yes}");
        }
        for no in [
            "0.0.0.0",
            "192.168.1.2",
            "::",
            "localhost.example.com",
            "127.0.0.1.nip.io",
            "128.0.0.1",
        ] {
            assert!(!is_loopback(no), "{no}");
        }
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(parse_listen("127.0.0.1:50051"), Ok("127.0.0.1"));
        assert_eq!(parse_listen("[::]:50051"), Ok("::"));
        assert_eq!(parse_listen("cp.internal:50051"), Ok("cp.internal"));
        assert!(parse_listen("127.0.0.1").is_err());
        assert!(parse_listen("127.0.0.1:http").is_err());
    }
}
