//! `oqpctl health [URL]`: a liveness probe for containers and scripts, with nothing else
//! installed (the runtime image has no curl).
//!
//! An `http://` URL is fetched with one plain HTTP/1.1 `GET`; the probe passes on a `200`
//! status. A `tcp://host:port` URL passes when the port accepts a connection: the control
//! plane alone serves gRPC only, and a connection is what it can show without a key. No
//! key is sent and none is needed (`/health` is open whatever `auth` says). TLS is not
//! spoken: a probe runs beside the process, on its plain listener.

use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Where the probe looks by default: the proxy's `/health` on its default port.
pub const DEFAULT_URL: &str = "http://127.0.0.1:11435/health";

/// How long the whole probe may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The most of the answer read: its status line is all that counts.
const MAX_HEAD: usize = 4096;

/// What the probe found: `Ok` with a line to print when healthy.
pub async fn probe(url: &str) -> anyhow::Result<String> {
    tokio::time::timeout(TIMEOUT, check(url))
        .await
        .with_context(|| format!("{url}: no answer within {}s", TIMEOUT.as_secs()))?
}

async fn check(url: &str) -> anyhow::Result<String> {
    let target = Target::parse(url)?;
    let mut stream = TcpStream::connect(&target.authority)
        .await
        .with_context(|| format!("cannot connect to {}", target.authority))?;
    let Some(path) = target.path else {
        return Ok(format!("{}: accepting connections", target.authority));
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nUser-Agent: oqpctl-health\r\n\r\n",
        target.authority
    );
    stream
        .write_all(request.as_bytes())
        .await
        .context("cannot send the request")?;
    let mut head = Vec::new();
    let mut buffer = [0u8; 512];
    while head.len() < MAX_HEAD && !head.windows(2).any(|w| w == b"\r\n") {
        let read = stream
            .read(&mut buffer)
            .await
            .context("cannot read the answer")?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..read]);
    }
    let line = head
        .split(|byte| *byte == b'\n')
        .next()
        .map(|line| String::from_utf8_lossy(line).trim().to_owned())
        .unwrap_or_default();
    match status_of(&line) {
        Some(200) => Ok(format!("{url}: 200 OK")),
        Some(status) => bail!("{url}: HTTP {status}"),
        None => bail!("{url}: not an HTTP answer"),
    }
}

/// The status code of an HTTP/1 status line.
fn status_of(line: &str) -> Option<u16> {
    let mut parts = line.split(' ');
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.parse().ok()
}

/// Where to connect, and the path to get (none for `tcp://`).
#[derive(Debug, PartialEq, Eq)]
struct Target {
    authority: String,
    path: Option<String>,
}

impl Target {
    fn parse(url: &str) -> anyhow::Result<Self> {
        let (rest, http) = if let Some(rest) = url.strip_prefix("http://") {
            (rest, true)
        } else if let Some(rest) = url.strip_prefix("tcp://") {
            (rest, false)
        } else {
            bail!("'{url}': the probe speaks http:// or tcp:// (a probe runs beside the process)");
        };
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.contains(['@', ' ']) {
            bail!("'{url}' names no host");
        }
        let authority = if authority
            .rsplit_once(':')
            .is_some_and(|(_, port)| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
        {
            authority.to_owned()
        } else if http {
            format!("{authority}:80")
        } else {
            bail!("'{url}' names no port");
        };
        Ok(Self {
            authority,
            path: http.then(|| path.to_owned()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_where_and_what() {
        assert_eq!(
            Target::parse(DEFAULT_URL).unwrap(),
            Target {
                authority: "127.0.0.1:11435".into(),
                path: Some("/health".into())
            }
        );
        assert_eq!(
            Target::parse("http://oqp").unwrap(),
            Target {
                authority: "oqp:80".into(),
                path: Some("/".into())
            }
        );
        assert_eq!(
            Target::parse("tcp://127.0.0.1:50051").unwrap(),
            Target {
                authority: "127.0.0.1:50051".into(),
                path: None
            }
        );
        for bad in [
            "https://x/health",
            "ftp://x",
            "tcp://x",
            "http:///health",
            "x:1",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_a_status_line_counts() {
        assert_eq!(status_of("HTTP/1.1 200 OK"), Some(200));
        assert_eq!(status_of("HTTP/1.0 503 Service Unavailable"), Some(503));
        assert_eq!(status_of("SSH-2.0-OpenSSH"), None);
        assert_eq!(status_of(""), None);
    }
}
