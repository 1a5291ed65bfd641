//! The two shapes of Ollama Cloud's `GET /api/balance`, read into one [`Balance`].
//!
//! - Credit plans (since 2026-08-31): `included.balance_usd`, `allowance_usd` (inside
//!   `included` or beside it) and `period` (an object with `resets_at`/`ending_at`, or a
//!   name), and the purchased extra usage as `extra.balance_usd` (or `credits.balance_usd`).
//! - Legacy window plans: `session` and `weekly`, each with `remaining_percent` and
//!   `resets_at`.
//!
//! Anything else is not a balance (`None`); the reader logs it once per account.

use std::time::SystemTime;

use oqp_proto::balance::{Balance, WindowLeft};
use serde_json::Value;

/// Parses a `/api/balance` body; `None` for a shape that is neither plan's.
pub fn parse(body: &[u8]) -> Option<Balance> {
    let value: Value = serde_json::from_slice(body).ok()?;
    if let Some(included) = value.get("included") {
        let included_usd = number(included.get("balance_usd"))?;
        let allowance_usd =
            number(included.get("allowance_usd")).or(number(value.get("allowance_usd")));
        let extra_usd = ["extra", "credits"]
            .iter()
            .find_map(|name| number(value.get(name).and_then(|v| v.get("balance_usd"))))
            .unwrap_or(0.0);
        let resets_at = value.get("period").and_then(|period| {
            ["resets_at", "ending_at", "ends_at"]
                .iter()
                .find_map(|name| time(period.get(name)))
        });
        return Some(Balance::Credits {
            included_usd: included_usd.max(0.0),
            allowance_usd: allowance_usd.filter(|usd| *usd > 0.0),
            extra_usd: extra_usd.max(0.0),
            resets_at,
        });
    }
    let window = |name: &str| {
        let window = value.get(name)?;
        Some(WindowLeft {
            remaining_percent: number(window.get("remaining_percent"))?.clamp(0.0, 100.0),
            resets_at: time(window.get("resets_at")),
        })
    };
    let (session, weekly) = (window("session"), window("weekly"));
    if session.is_none() && weekly.is_none() {
        return None;
    }
    Some(Balance::Windows { session, weekly })
}

/// A finite number, given as a JSON number or a numeric string (`"1.68"`).
fn number(value: Option<&Value>) -> Option<f64> {
    let number = match value? {
        Value::Number(number) => number.as_f64()?,
        Value::String(text) => text.trim().parse().ok()?,
        _ => return None,
    };
    number.is_finite().then_some(number)
}

/// An RFC 3339 time.
fn time(value: Option<&Value>) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(value?.as_str()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_credit_plan() {
        let body = br#"{"included":{"balance_usd":12.5,"allowance_usd":20},
            "period":{"type":"monthly","resets_at":"2026-12-31T00:00:00Z"},
            "extra":{"balance_usd":"3.25"}}"#;
        let Some(Balance::Credits {
            included_usd,
            allowance_usd,
            extra_usd,
            resets_at,
        }) = parse(body)
        else {
            panic!("not a credit plan");
        };
        assert_eq!(
            (included_usd, allowance_usd, extra_usd),
            (12.5, Some(20.0), 3.25)
        );
        assert_eq!(
            resets_at,
            Some(humantime::parse_rfc3339("2026-12-31T00:00:00Z").unwrap())
        );
        // The allowance beside `included`, the period named only, no extra usage.
        let beside = br#"{"included":{"balance_usd":1},"allowance_usd":20,"period":"monthly"}"#;
        assert_eq!(
            parse(beside),
            Some(Balance::Credits {
                included_usd: 1.0,
                allowance_usd: Some(20.0),
                extra_usd: 0.0,
                resets_at: None,
            })
        );
    }

    #[test]
    fn reads_a_legacy_window_plan() {
        let body = br#"{"session":{"remaining_percent":73.5,"resets_at":"2026-12-04T18:00:00.5Z"},
            "weekly":{"remaining_percent":140}}"#;
        let Some(Balance::Windows { session, weekly }) = parse(body) else {
            panic!("not a window plan");
        };
        let session = session.unwrap();
        assert_eq!(session.remaining_percent, 73.5);
        assert!(session.resets_at.is_some());
        assert_eq!(weekly.unwrap().remaining_percent, 100.0, "clamped");
        assert_eq!(parse(body).unwrap().plan(), "windows");
    }

    #[test]
    fn other_shapes_are_not_balances() {
        for body in [
            &br#"{"limits":{"monthly":{"usage":0.2}}}"#[..],
            br#"{"included":{"balance":"x"}}"#,
            br#"{"session":{"usage":0.5}}"#,
            br#"[]"#,
            b"not json",
        ] {
            assert_eq!(parse(body), None, "{}", String::from_utf8_lossy(body));
        }
    }
}
