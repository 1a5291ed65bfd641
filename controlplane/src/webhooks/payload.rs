//! The webhook body: `{"event", "timestamp", "tier"?, …extra fields}`.
//!
//! `timestamp` is RFC 3339 in UTC with microseconds and a `Z`
//! (`2026-04-21T08:00:00.123456Z`); `tier` is present only when the event
//! concerns a tier (never `null`, as in the reference's code rather than its
//! README). The extra fields per event are documented on
//! [`super::Webhooks`].

use std::time::SystemTime;

use serde_json::{Map, Value};

use crate::config::{Tier, WebhookEvent};

/// One event to deliver.
#[derive(Debug, Clone, PartialEq)]
pub struct Notice {
    event: WebhookEvent,
    at: SystemTime,
    tier: Option<Tier>,
    fields: Map<String, Value>,
}

impl Notice {
    /// An event that happens now, without a tier or extra fields.
    pub fn new(event: WebhookEvent) -> Self {
        Self {
            event,
            at: SystemTime::now(),
            tier: None,
            fields: Map::new(),
        }
    }

    /// When it happened (default: when the notice was built).
    #[must_use]
    pub fn at(mut self, at: SystemTime) -> Self {
        self.at = at;
        self
    }

    /// The tier concerned; `None` leaves the key out.
    #[must_use]
    pub fn tier(mut self, tier: Option<Tier>) -> Self {
        self.tier = tier;
        self
    }

    /// Adds an extra field. `event` and `timestamp` are reserved and ignored;
    /// a `tier` given this way is kept unless it is `null`.
    #[must_use]
    pub fn field(mut self, key: &str, value: impl Into<Value>) -> Self {
        let value = value.into();
        match key {
            "event" | "timestamp" => {}
            "tier" if value.is_null() => {}
            _ => {
                self.fields.insert(key.to_owned(), value);
            }
        }
        self
    }

    /// Adds every field of `fields`, as [`Notice::field`] does.
    #[must_use]
    pub fn fields(self, fields: Map<String, Value>) -> Self {
        fields
            .into_iter()
            .fold(self, |notice, (key, value)| notice.field(&key, value))
    }

    /// The event.
    pub fn event(&self) -> WebhookEvent {
        self.event
    }

    /// The JSON body, keys in order `event`, `timestamp`, `tier`, extras.
    pub fn to_json(&self) -> Value {
        let mut body = Map::new();
        body.insert("event".to_owned(), self.event.as_str().into());
        body.insert("timestamp".to_owned(), timestamp(self.at).into());
        if let Some(tier) = self.tier {
            body.insert("tier".to_owned(), tier.as_str().into());
        }
        for (key, value) in &self.fields {
            body.entry(key.clone()).or_insert_with(|| value.clone());
        }
        Value::Object(body)
    }
}

/// RFC 3339, UTC, microseconds, `Z`.
pub fn timestamp(at: SystemTime) -> String {
    humantime::format_rfc3339_micros(at).to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use serde_json::json;

    use super::*;

    fn at() -> SystemTime {
        // 2026-04-21T08:00:00.123456Z
        UNIX_EPOCH + Duration::from_micros(1_776_758_400_123_456)
    }

    fn keys(value: &Value) -> Vec<&str> {
        value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect()
    }

    #[test]
    fn timestamps_are_utc_with_microseconds() {
        assert_eq!(timestamp(at()), "2026-04-21T08:00:00.123456Z");
        assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
    }

    #[test]
    fn queue_full_carries_tier_client_and_node() {
        let body = Notice::new(WebhookEvent::QueueFull)
            .at(at())
            .tier(Some(Tier::High))
            .field("client_id", "alice")
            .field("node", "gpu-1")
            .to_json();
        assert_eq!(
            body,
            json!({
                "event": "queue.full",
                "timestamp": "2026-04-21T08:00:00.123456Z",
                "tier": "high",
                "client_id": "alice",
                "node": "gpu-1",
            })
        );
        assert_eq!(
            keys(&body),
            ["event", "timestamp", "tier", "client_id", "node"]
        );
    }

    #[test]
    fn tier_is_omitted_when_none() {
        let body = Notice::new(WebhookEvent::HostUnhealthy)
            .at(at())
            .tier(None)
            .field("name", "primary")
            .to_json();
        assert_eq!(keys(&body), ["event", "timestamp", "name"]);
        assert_eq!(body["event"], "host.unhealthy");
        assert_eq!(body["name"], "primary");

        let drained = Notice::new(WebhookEvent::QueueDrained)
            .field("node", "local")
            .field("tier", Value::Null)
            .to_json();
        assert_eq!(keys(&drained), ["event", "timestamp", "node"]);
    }

    #[test]
    fn reserved_keys_cannot_be_overridden() {
        let mut fields = Map::new();
        fields.insert("event".to_owned(), "spoofed".into());
        fields.insert("timestamp".to_owned(), "yesterday".into());
        fields.insert("client_id".to_owned(), "bob".into());
        let body = Notice::new(WebhookEvent::KeyRevoked)
            .at(at())
            .fields(fields)
            .to_json();
        assert_eq!(
            body,
            json!({
                "event": "key.revoked",
                "timestamp": "2026-04-21T08:00:00.123456Z",
                "client_id": "bob",
            })
        );
    }

    #[test]
    fn high_watermark_carries_the_depth() {
        let body = Notice::new(WebhookEvent::QueueHighWatermark)
            .at(at())
            .tier(Some(Tier::Low))
            .field("queue_depth", 160)
            .field("node", "local")
            .to_json();
        assert_eq!(
            keys(&body),
            ["event", "timestamp", "tier", "queue_depth", "node"]
        );
        assert_eq!(body["queue_depth"], 160);
        assert_eq!(body["tier"], "low");
    }
}
