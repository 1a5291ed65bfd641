//! What an Ollama Cloud failure means for the pool: which window ran out, whether it is the
//! key's, the account's or the host's problem, and how long each backs off.
//!
//! Ollama Cloud sends no `Retry-After` and no `x-ratelimit-*` headers; the only signal is the
//! error text (protocol reference §A.9), so classification reads the body.

use std::time::Duration;

use http::StatusCode;

/// A usage window of an Ollama Cloud account.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Window {
    /// "hourly usage limit" (older wording).
    Hourly,
    /// "session usage limit": a 5-hour window.
    Session,
    /// "weekly usage limit".
    Weekly,
    /// "monthly usage limit" (some newer accounts).
    Monthly,
    /// A quota error naming no known window.
    Unknown,
}

/// Why one attempt with one key failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// 429 (or a 402 that is not about extra usage): the key's ACCOUNT ran out of this window;
    /// all its keys cool down.
    Quota(Window),
    /// "timed out waiting for a concurrent request slot": the account is at its plan's
    /// concurrency, not out of quota. No cooldown; another account is tried now.
    SlotTimeout,
    /// 503 "Server overloaded": the HOST backs off briefly; no key is to blame.
    Overloaded,
    /// 401, or a 403 that a model-free check with the same key confirmed: this KEY (not its
    /// account) is disabled for a long time.
    Auth,
    /// 403 for one request: the key, or only the model (one that needs a subscription the
    /// account lacks), is refused. The request path tells them apart with a model-free check
    /// and reports [`Auth`](Failure::Auth) or [`ModelRefused`](Failure::ModelRefused) instead.
    Forbidden,
    /// A 403 for this model while the key itself is good: only the (account, model) pair is
    /// out of rotation, for [`Cooldowns::model_refused`]; every key keeps serving other models.
    ModelRefused,
    /// 402 "this model uses extra usage only … your extra usage balance is empty": the model
    /// bills only the account's purchased extra usage, and it has none. Only the (account,
    /// model) pair is out of rotation, until the account's balance is seen to change or for
    /// [`Cooldowns::extra_usage`]; every key keeps serving other models.
    ExtraUsageEmpty,
    /// Another 5xx: the next key is tried; nothing cools down.
    Server,
    /// No response headers in time: probably the account's concurrency queue at ollama.com, so
    /// another account is tried; nothing cools down.
    Timeout,
    /// Connecting failed (DNS, TCP, TLS): the host's problem, so no other key is tried in this
    /// call; the request path fails over to another host.
    Connect,
}

/// How long each kind of failure keeps a key, account or host out of rotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cooldowns {
    /// After an hourly limit.
    pub hourly: Duration,
    /// After a session limit: long enough that the 5-hour window has reset.
    pub session: Duration,
    /// After a weekly limit.
    pub weekly: Duration,
    /// After a monthly limit: re-probed daily rather than held for a month.
    pub monthly: Duration,
    /// After a quota error naming no window.
    pub unknown_quota: Duration,
    /// The whole host after "Server overloaded".
    pub overloaded: Duration,
    /// A key after 401 (or a 403 confirmed by a model-free check).
    pub auth: Duration,
    /// An (account, model) pair after a model-specific 403 (a model needing a subscription).
    pub model_refused: Duration,
    /// An (account, model) pair after a 402 for an extra-usage-only model, unless the
    /// account's balance is seen to change first.
    pub extra_usage: Duration,
    /// How long a released key counts as warm for its bound model: an idle key bound to another
    /// model is rebound only after this (Ollama's default `keep_alive` is 5 minutes).
    pub warm_for: Duration,
}

const HOUR: Duration = Duration::from_secs(3600);

impl Default for Cooldowns {
    fn default() -> Self {
        Cooldowns {
            hourly: HOUR,
            session: 5 * HOUR,
            weekly: 7 * 24 * HOUR,
            monthly: 24 * HOUR,
            unknown_quota: Duration::from_secs(60),
            overloaded: Duration::from_secs(15),
            auth: HOUR,
            model_refused: Duration::from_secs(15 * 60),
            extra_usage: HOUR,
            warm_for: Duration::from_secs(300),
        }
    }
}

impl Cooldowns {
    /// The account cooldown after a quota error for `window`.
    pub fn quota(&self, window: Window) -> Duration {
        match window {
            Window::Hourly => self.hourly,
            Window::Session => self.session,
            Window::Weekly => self.weekly,
            Window::Monthly => self.monthly,
            Window::Unknown => self.unknown_quota,
        }
    }
}

impl Failure {
    /// Classifies an upstream answer from its status and (the start of) its body; `None` when it
    /// is not a key failure and should be relayed as is (success, 404, 400, …).
    pub fn classify(status: StatusCode, body: &[u8]) -> Option<Failure> {
        if !(status.is_client_error() || status.is_server_error()) {
            return None;
        }
        let text = error_text(body);
        if text.contains("concurrent request slot") {
            return Some(Failure::SlotTimeout);
        }
        if status == StatusCode::PAYMENT_REQUIRED && text.contains("extra usage") {
            return Some(Failure::ExtraUsageEmpty);
        }
        match status.as_u16() {
            402 | 429 => Some(Failure::Quota(window_of(&text))),
            401 => Some(Failure::Auth),
            403 => Some(Failure::Forbidden),
            503 if text.contains("overloaded") => Some(Failure::Overloaded),
            500..=599 => Some(Failure::Server),
            _ => None,
        }
    }

    /// A short name for status displays and logs (`KeyStatus::last_error`).
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Quota(_) => "quota",
            Failure::SlotTimeout => "slot_timeout",
            Failure::Overloaded => "overloaded",
            Failure::Auth => "auth",
            Failure::Forbidden => "forbidden",
            Failure::ModelRefused => "model_refused",
            Failure::ExtraUsageEmpty => "extra_usage_empty",
            Failure::Server => "server",
            Failure::Timeout => "timeout",
            Failure::Connect => "connect",
        }
    }
}

/// The error message, lower-cased: the `error` string (or OpenAI `error.message`) of a JSON
/// body, else the body as text.
fn error_text(body: &[u8]) -> String {
    let parsed = serde_json::from_slice::<serde_json::Value>(body).ok();
    let message = parsed.as_ref().and_then(|value| {
        let error = value.get("error")?;
        error
            .as_str()
            .or_else(|| error.get("message").and_then(|message| message.as_str()))
            .map(str::to_owned)
    });
    message
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
        .to_ascii_lowercase()
}

fn window_of(text: &str) -> Window {
    if text.contains("session") {
        Window::Session
    } else if text.contains("weekly") {
        Window::Weekly
    } else if text.contains("hourly") {
        Window::Hourly
    } else if text.contains("monthly") {
        Window::Monthly
    } else {
        Window::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(status: u16, body: &str) -> Option<Failure> {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::IM_A_TEAPOT);
        Failure::classify(status, body.as_bytes())
    }

    #[test]
    fn reads_the_window_from_the_body() {
        let session = r#"{"error":"you (user) have reached your session usage limit, upgrade for higher limits: https://ollama.com/upgrade (ref: 1234)"}"#;
        assert_eq!(
            classify(429, session),
            Some(Failure::Quota(Window::Session))
        );
        let weekly = r#"{"error":"you've reached your weekly usage limit, please wait or upgrade to continue"}"#;
        assert_eq!(classify(429, weekly), Some(Failure::Quota(Window::Weekly)));
        let hourly = r#"{"error":"you've reached your hourly usage limit, please wait or upgrade to continue"}"#;
        assert_eq!(classify(429, hourly), Some(Failure::Quota(Window::Hourly)));
        assert_eq!(
            classify(429, "Too Many Requests"),
            Some(Failure::Quota(Window::Unknown))
        );
        assert_eq!(classify(402, "{}"), Some(Failure::Quota(Window::Unknown)));
    }

    #[test]
    fn an_extra_usage_402_refuses_the_model_not_the_account() {
        // ollama/ollama#17639, in Ollama's and in OpenAI's error shape.
        let text = "this model uses extra usage only (not included plan usage) and your extra \
                    usage balance is empty, add extra usage or turn on auto reload";
        let native = serde_json::json!({ "error": text }).to_string();
        assert_eq!(classify(402, &native), Some(Failure::ExtraUsageEmpty));
        let openai =
            serde_json::json!({ "error": { "message": text, "type": "invalid_request_error" } })
                .to_string();
        assert_eq!(classify(402, &openai), Some(Failure::ExtraUsageEmpty));
        // The same words on another status are not this refusal.
        assert_eq!(
            classify(429, &native),
            Some(Failure::Quota(Window::Unknown))
        );
    }

    #[test]
    fn tells_slot_timeouts_overload_auth_and_server_errors_apart() {
        let slot = r#"{"error":"timed out waiting for a concurrent request slot"}"#;
        assert_eq!(classify(503, slot), Some(Failure::SlotTimeout));
        assert_eq!(classify(429, slot), Some(Failure::SlotTimeout));
        let overloaded = r#"{"error":"Server overloaded, please retry shortly (ref: 77)"}"#;
        assert_eq!(classify(503, overloaded), Some(Failure::Overloaded));
        assert_eq!(
            classify(401, r#"{"error":"unauthorized"}"#),
            Some(Failure::Auth)
        );
        // A 403 alone does not say whether the key or only the model is refused.
        assert_eq!(classify(403, ""), Some(Failure::Forbidden));
        assert_eq!(classify(502, "bad gateway"), Some(Failure::Server));
        assert_eq!(classify(503, "busy"), Some(Failure::Server));
        let openai = r#"{"error":{"message":"Server overloaded","type":"api_error"}}"#;
        assert_eq!(classify(503, openai), Some(Failure::Overloaded));
    }

    #[test]
    fn relays_what_is_not_a_key_failure() {
        assert_eq!(classify(200, "{}"), None);
        assert_eq!(classify(404, r#"{"error":"model 'x' not found"}"#), None);
        assert_eq!(classify(400, r#"{"error":"invalid model name"}"#), None);
    }
}
