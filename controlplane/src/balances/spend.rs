//! The two shapes of Ollama Cloud's `GET /api/usage?range=30d&scope=…&group_by=model`, read
//! into one [`Spend`]: what an account (or a team) spent in the range, in USD, and the tokens
//! the cloud counted for it when it says.
//!
//! - The figures at the top: `usage_usd`, `request_count`, `input_tokens`,
//!   `cached_input_tokens`, `output_tokens`; or one such object per model in a list
//!   (`models`, `usage`, `data` or `by_model`), which are summed.
//! - The same figures under `limits.monthly.usage` (an object), or `limits.monthly.usage_usd`.
//!
//! Anything else (the legacy `limits.session.usage` fractions among them) is not a spend
//! (`None`); the reader logs it once per account.

use serde_json::Value;

/// What one `/api/usage` read said of an account's spend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spend {
    /// USD spent in the range.
    pub usd: f64,
    /// Input and output tokens the cloud counted in the range, when it stated them.
    pub tokens: Option<u64>,
}

impl Spend {
    /// Parses a `/api/usage` body; `None` for a shape without a USD figure.
    pub fn parse(body: &[u8]) -> Option<Spend> {
        let value: Value = serde_json::from_slice(body).ok()?;
        if let Some(spend) = figures(&value) {
            return Some(spend);
        }
        let monthly = value.get("limits")?.get("monthly")?;
        if let Some(usage) = monthly.get("usage").filter(|usage| usage.is_object()) {
            return figures(usage);
        }
        let usd = monthly.get("usage_usd")?.as_f64()?;
        Some(Spend {
            usd: usd.max(0.0),
            tokens: None,
        })
    }
}

/// The figures of `value`: at its top, or summed over a list of them.
fn figures(value: &Value) -> Option<Spend> {
    if let Some(spend) = one(value) {
        return Some(spend);
    }
    let list = ["models", "usage", "data", "by_model"]
        .iter()
        .find_map(|name| value.get(name).and_then(Value::as_array))?;
    let mut total = Spend {
        usd: 0.0,
        tokens: Some(0),
    };
    for item in list {
        let spend = one(item)?;
        total.usd += spend.usd;
        total.tokens = match (total.tokens, spend.tokens) {
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
            _ => None,
        };
    }
    Some(total)
}

fn one(value: &Value) -> Option<Spend> {
    let usd = value.get("usage_usd")?.as_f64()?;
    let count = |name: &str| value.get(name).and_then(Value::as_u64);
    let tokens = match (count("input_tokens"), count("output_tokens")) {
        (None, None) => None,
        (input, output) => Some(input.unwrap_or(0).saturating_add(output.unwrap_or(0))),
    };
    Some(Spend {
        usd: usd.max(0.0),
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: Value) -> Option<Spend> {
        Spend::parse(value.to_string().as_bytes())
    }

    #[test]
    fn both_shapes() {
        let top = serde_json::json!({
            "range": "30d", "scope": "self", "request_count": 4, "usage_usd": 1.5,
            "input_tokens": 100, "cached_input_tokens": 40, "output_tokens": 20,
        });
        assert_eq!(
            parse(top),
            Some(Spend {
                usd: 1.5,
                tokens: Some(120)
            })
        );
        let per_model = serde_json::json!({"models": [
            {"model": "a", "usage_usd": 1.0, "input_tokens": 10, "output_tokens": 5},
            {"model": "b", "usage_usd": 0.5, "input_tokens": 1, "output_tokens": 4},
        ]});
        assert_eq!(
            parse(per_model),
            Some(Spend {
                usd: 1.5,
                tokens: Some(20)
            })
        );
        let monthly = serde_json::json!({"limits": {"monthly": {"usage": {
            "usage_usd": 2.25, "request_count": 3, "input_tokens": 7, "output_tokens": 3,
        }}}});
        assert_eq!(
            parse(monthly),
            Some(Spend {
                usd: 2.25,
                tokens: Some(10)
            })
        );
        let bare = serde_json::json!({"limits": {"monthly": {"usage_usd": 3.0}}});
        assert_eq!(
            parse(bare),
            Some(Spend {
                usd: 3.0,
                tokens: None
            })
        );
    }

    #[test]
    fn other_shapes_are_not_a_spend() {
        for body in [
            serde_json::json!({"limits": {"session": {"usage": 0.25}, "weekly": {"usage": 0.5}}}),
            serde_json::json!({"limits": {"monthly": {"usage": 0.4}}}),
            serde_json::json!({"usage_usd": "a lot"}),
            serde_json::json!([]),
        ] {
            assert_eq!(parse(body.clone()), None, "{body}");
        }
        assert_eq!(Spend::parse(b"not json"), None);
    }
}
