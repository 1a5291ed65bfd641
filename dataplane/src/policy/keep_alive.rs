//! The keep_alive rule: what a request's `keep_alive` may be when it reaches Ollama.
//!
//! A model in VRAM is shared by every tenant, and the latest request's `keep_alive` sets its
//! expiry for all of them: `0` unloads it under the others, a negative value pins it forever.
//! While model-swap holding is on (oqp decides residency), a caller below `management` is
//! therefore held to a window: a duration of at least [`MIN_KEPT`] and at most `keep_alive.max`
//! passes as the client wrote it, a longer one is cut to `max`, and anything else (`0`, a
//! negative value, `null`, a value Ollama would not read as a duration) is replaced by
//! `keep_alive.default`. This module decides the value; `rewrite` splices it into the bytes.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

/// `keep_alive.max` when the snapshot leaves it unset (an older control plane): 30 minutes.
pub const DEFAULT_KEEP_ALIVE_MAX: Duration = Duration::from_secs(30 * 60);

/// The shortest client keep_alive kept inside the window: a model kept for less than a second
/// after its request is unloaded in all but name.
pub const MIN_KEPT: Duration = Duration::from_secs(1);

/// keep_alive defaulting.
#[derive(Debug, Clone)]
pub struct KeepAlive {
    /// JSON literal to insert; `None` = insert nothing.
    pub default_json: Option<Arc<str>>,
    /// Replace the client's value too.
    pub override_client: bool,
    /// The longest keep_alive a caller held to the window may set (`keep_alive.max`).
    pub max: Duration,
    /// Hold the client's own value to the window (see the module doc); set by
    /// [`KeepAlive::for_caller`].
    pub bounded: bool,
}

/// How Ollama reads a `keep_alive` value (its `api.Duration`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Asked {
    /// Keep the model this many seconds after the request (`0` unloads it).
    Seconds(f64),
    /// Negative: keep it loaded forever.
    Forever,
    /// `null`: the server's own default; or a value Ollama refuses.
    Other,
}

impl KeepAlive {
    /// The rule for one request. A client's own keep_alive decides how long a model shared by
    /// every tenant stays in VRAM, so while model-swap holding is on (`holding`: oqp decides
    /// residency) a caller that may not set it freely (`may_set`: a `management` key, or anyone
    /// with auth off) is held to the window. `override_client` replaces everyone's.
    pub fn for_caller(&self, holding: bool, may_set: bool) -> Cow<'_, KeepAlive> {
        if self.override_client || !holding || may_set {
            return Cow::Borrowed(self);
        }
        Cow::Owned(KeepAlive {
            bounded: true,
            ..self.clone()
        })
    }

    /// What replaces a client's own keep_alive, given the JSON literal Ollama would read
    /// (`value`, the last member of that name); `None` keeps the client's bytes.
    pub fn replacement(&self, value: &[u8]) -> Option<Cow<'_, str>> {
        let default = self.default_json.as_deref()?;
        if self.override_client {
            return Some(Cow::Borrowed(default));
        }
        if !self.bounded {
            return None;
        }
        match asked(value) {
            Asked::Seconds(seconds) if seconds > self.max.as_secs_f64() => {
                Some(Cow::Owned(self.max.as_secs().to_string()))
            }
            Asked::Seconds(seconds) if seconds >= MIN_KEPT.as_secs_f64() => None,
            Asked::Seconds(_) | Asked::Forever | Asked::Other => Some(Cow::Borrowed(default)),
        }
    }
}

/// Reads a `keep_alive` literal as Ollama does: a number is seconds, a string is Go's
/// `time.ParseDuration`, a negative value of either means forever.
fn asked(value: &[u8]) -> Asked {
    let seconds = match serde_json::from_slice::<serde_json::Value>(value) {
        Ok(serde_json::Value::Number(number)) => number.as_f64(),
        Ok(serde_json::Value::String(text)) => go_duration_seconds(&text),
        _ => None,
    };
    match seconds {
        Some(seconds) if seconds < 0.0 => Asked::Forever,
        Some(seconds) if seconds.is_finite() => Asked::Seconds(seconds),
        _ => Asked::Other,
    }
}

/// Go's `time.ParseDuration`, in seconds: `"0"`, or one or more `<number><unit>` (ns, us, µs,
/// ms, s, m, h), optionally signed; `None` where Go returns an error.
fn go_duration_seconds(text: &str) -> Option<f64> {
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Some(0.0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..digits];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return None;
        }
        let value: f64 = number.parse().ok()?;
        rest = &rest[digits..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Some(if negative { -total } else { total })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn held(max_seconds: u64) -> KeepAlive {
        KeepAlive {
            default_json: Some(Arc::from(r#""5m""#)),
            override_client: false,
            max: Duration::from_secs(max_seconds),
            bounded: false,
        }
        .for_caller(true, false)
        .into_owned()
    }

    fn decide(rule: &KeepAlive, value: &str) -> Option<String> {
        rule.replacement(value.as_bytes()).map(Cow::into_owned)
    }

    #[test]
    fn a_positive_duration_up_to_max_passes_as_written() {
        let rule = held(1800);
        for value in [
            r#""10m""#,
            r#""1s""#,
            r#""30m""#,
            r#""1h""#,
            "600",
            "600.0",
            "1",
            r#""1h30m""#,
            r#""+2m""#,
            r#""1.5m""#,
            r#""1000ms""#,
        ] {
            let expected = match value {
                r#""1h""# | r#""1h30m""# => Some("1800".to_owned()),
                _ => None,
            };
            assert_eq!(decide(&rule, value), expected, "{value}");
        }
    }

    #[test]
    fn a_longer_duration_is_cut_to_max() {
        let rule = held(1800);
        assert_eq!(decide(&rule, "1801").as_deref(), Some("1800"));
        assert_eq!(decide(&rule, r#""24h""#).as_deref(), Some("1800"));
        assert_eq!(decide(&rule, "1e300").as_deref(), Some("1800"));
        assert_eq!(decide(&held(60), r#""10m""#).as_deref(), Some("60"));
    }

    #[test]
    fn an_unload_a_pin_or_no_duration_gets_the_default() {
        let rule = held(1800);
        for value in [
            "0",
            "0.0",
            "0.5",
            r#""0""#,
            r#""0s""#,
            r#""500ms""#,
            "-1",
            "-1.0",
            r#""-1m""#,
            "null",
            "true",
            r#""300""#,
            r#""5x""#,
            "{}",
            "[]",
            r#""""#,
        ] {
            assert_eq!(decide(&rule, value).as_deref(), Some(r#""5m""#), "{value}");
        }
    }

    #[test]
    fn a_caller_free_to_set_it_or_holding_off_keeps_its_own() {
        let rule = KeepAlive {
            default_json: Some(Arc::from(r#""5m""#)),
            override_client: false,
            max: DEFAULT_KEEP_ALIVE_MAX,
            bounded: false,
        };
        for (holding, may_set) in [(false, false), (true, true), (false, true)] {
            let rule = rule.for_caller(holding, may_set);
            assert_eq!(decide(&rule, "0"), None);
            assert_eq!(decide(&rule, "-1"), None);
            assert_eq!(decide(&rule, r#""24h""#), None);
        }
    }

    #[test]
    fn override_replaces_everyones_value() {
        let rule = KeepAlive {
            default_json: Some(Arc::from("-1")),
            override_client: true,
            max: DEFAULT_KEEP_ALIVE_MAX,
            bounded: false,
        };
        for (holding, may_set) in [(false, false), (true, true), (true, false)] {
            let rule = rule.for_caller(holding, may_set);
            assert_eq!(decide(&rule, r#""10m""#).as_deref(), Some("-1"));
        }
    }

    #[test]
    fn go_durations_read_as_go_reads_them() {
        assert_eq!(go_duration_seconds("1h30m"), Some(5400.0));
        assert_eq!(go_duration_seconds("-1.5s"), Some(-1.5));
        assert_eq!(go_duration_seconds("0"), Some(0.0));
        assert_eq!(go_duration_seconds("250µs"), Some(0.000_25));
        for invalid in ["", "300", "5", "m", "1.2.3s", "1d", "-", ".s"] {
            assert_eq!(go_duration_seconds(invalid), None, "{invalid}");
        }
    }
}
