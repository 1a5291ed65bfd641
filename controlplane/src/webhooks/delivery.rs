//! The sender task: takes queued deliveries off the channel and POSTs each
//! once, a few at a time, with a 5 s deadline and no retries. Failures are
//! logged at WARN with the event name and a redacted target (scheme, host,
//! port and path: never the URL's user info or query, which may carry a
//! token).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, USER_AGENT};
use http::{Method, Request, Uri};
use http_body_util::Full;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Counters;
use crate::config::WebhookEvent;
use crate::outbound::Outbound;

/// How long one delivery may take, connect to last byte.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Deliveries in flight at once; more wait in the channel.
const MAX_IN_FLIGHT: usize = 8;

/// The most of a receiver's answer that is read (and then thrown away).
const REPLY_LIMIT: usize = 64 * 1024;

/// One POST to make.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The event, for logs.
    pub event: WebhookEvent,
    /// The target, as configured when the event happened.
    pub url: String,
    /// The JSON body.
    pub body: Bytes,
    /// The target's host is not in `webhooks.allowed_hosts`: connect only to the addresses
    /// the SSRF check allows, as resolved for this delivery ([`Outbound::public_only`]).
    pub public_only: bool,
}

/// Runs until `shutdown`; deliveries still queued or in flight then are
/// dropped (a shutdown must not wait on a slow receiver).
pub async fn run(
    mut queue: mpsc::Receiver<Delivery>,
    counters: Arc<Counters>,
    client: Outbound,
    shutdown: CancellationToken,
) {
    let mut in_flight = JoinSet::new();
    let guarded = Outbound::public_only();
    loop {
        while in_flight.try_join_next().is_some() {}
        if in_flight.len() >= MAX_IN_FLIGHT {
            tokio::select! {
                _ = in_flight.join_next() => continue,
                () = shutdown.cancelled() => break,
            }
        }
        let delivery = tokio::select! {
            delivery = queue.recv() => match delivery {
                Some(delivery) => delivery,
                None => break,
            },
            () = shutdown.cancelled() => break,
        };
        let client = if delivery.public_only {
            guarded.clone()
        } else {
            client.clone()
        };
        let counters = counters.clone();
        in_flight.spawn(async move {
            let ok = deliver(&client, &delivery, TIMEOUT).await;
            let counter = if ok {
                &counters.delivered
            } else {
                &counters.failed
            };
            counter.fetch_add(1, Ordering::Relaxed);
        });
    }
    in_flight.abort_all();
}

/// POSTs one delivery within `timeout`, once; true on a 2xx answer.
pub(super) async fn deliver(client: &Outbound, delivery: &Delivery, timeout: Duration) -> bool {
    let event = delivery.event.as_str();
    let target = redacted(&delivery.url);
    let request = match request(&delivery.url, delivery.body.clone()) {
        Ok(request) => request,
        Err(error) => {
            tracing::warn!(event, %target, %error, "webhook delivery failed");
            return false;
        }
    };
    match client.send(request, timeout, REPLY_LIMIT).await {
        Ok(reply) if reply.status.is_success() => {
            tracing::debug!(event, %target, status = reply.status.as_u16(), "webhook delivered");
            true
        }
        Ok(reply) => {
            tracing::warn!(event, %target, status = reply.status.as_u16(), "webhook delivery failed: receiver answered with an error status");
            false
        }
        Err(error) => {
            tracing::warn!(event, %target, %error, "webhook delivery failed");
            false
        }
    }
}

/// The POST, without the URL's user info (credentials in a webhook URL are
/// not sent as a header; the reference sends no auth header either).
fn request(url: &str, body: Bytes) -> Result<Request<Full<Bytes>>, String> {
    let uri: Uri = url.parse().map_err(|e| format!("invalid URL: {e}"))?;
    let uri = without_userinfo(uri)?;
    Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(CONTENT_TYPE, "application/json")
        .header(USER_AGENT, concat!("oqp/", env!("CARGO_PKG_VERSION")))
        .body(Full::new(body))
        .map_err(|e| e.to_string())
}

fn without_userinfo(uri: Uri) -> Result<Uri, String> {
    let Some(authority) = uri.authority() else {
        return Err("URL has no host".to_owned());
    };
    let Some((_, host_port)) = authority.as_str().rsplit_once('@') else {
        return Ok(uri);
    };
    let mut parts = uri.clone().into_parts();
    parts.authority = Some(host_port.parse().map_err(|e| format!("invalid URL: {e}"))?);
    Uri::from_parts(parts).map_err(|e| format!("invalid URL: {e}"))
}

/// `scheme://host[:port]/path`: what a log line may say about the target.
pub fn redacted(url: &str) -> String {
    let Ok(uri) = url.parse::<Uri>() else {
        return "(invalid URL)".to_owned();
    };
    let scheme = uri.scheme_str().unwrap_or("?");
    let host = uri.host().unwrap_or("?");
    let port = uri.port_u16().map(|p| format!(":{p}")).unwrap_or_default();
    format!("{scheme}://{host}{port}{}", uri.path())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn logs_never_show_userinfo_or_query() {
        assert_eq!(
            redacted("https://user:hunter2@hooks.example.com:8443/h/1?token=abc#x"),
            "https://hooks.example.com:8443/h/1"
        );
        assert_eq!(redacted("http://10.0.0.1"), "http://10.0.0.1/");
        assert_eq!(redacted("not a url"), "(invalid URL)");
    }

    #[test]
    fn requests_are_json_posts_without_userinfo() {
        let request = request(
            "https://user:pw@hooks.example.com/h?token=abc",
            Bytes::from_static(b"{}"),
        )
        .unwrap();
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().to_string(),
            "https://hooks.example.com/h?token=abc"
        );
        assert_eq!(request.headers()[CONTENT_TYPE], "application/json");
        assert!(
            request.headers()[USER_AGENT]
                .to_str()
                .unwrap()
                .starts_with("oqp/")
        );
    }
}
