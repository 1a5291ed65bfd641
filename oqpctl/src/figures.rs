//! How oqpctl writes figures: GPU time, a key's budget as a cell or JSON.
//! A leaf that the tables (`render`) and the usage report both use.

use oqp_proto::admin::v1 as api;
use serde_json::{Value, json};

/// GPU time as `h:mm:ss`.
pub fn hms(ns: u64) -> String {
    let seconds = ns / 1_000_000_000;
    format!(
        "{}:{:02}:{:02}",
        seconds / 3600,
        (seconds % 3600) / 60,
        seconds % 60
    )
}

/// GPU time in seconds, to the millisecond.
pub fn gpu_seconds(ns: u64) -> f64 {
    (ns as f64 / 1e6).round() / 1e3
}

/// `keys list`'s budget cell: `2:00:00 GPU, 2000000 tokens / 1d`, or `-`.
pub fn budget_cell(budget: Option<&api::KeyBudget>) -> String {
    let Some(budget) = budget else {
        return "-".to_owned();
    };
    let mut parts = Vec::new();
    if budget.gpu_ns > 0 {
        parts.push(format!("{} GPU", hms(budget.gpu_ns)));
    }
    if budget.tokens > 0 {
        parts.push(format!("{} tokens", budget.tokens));
    }
    format!("{} / {}", parts.join(", "), budget.window)
}

/// `keys list`'s "left" cell: what is left of each budget this window, or `-`.
pub fn left_cell(budget: Option<&api::KeyBudget>) -> String {
    let Some(budget) = budget else {
        return "-".to_owned();
    };
    let mut parts = Vec::new();
    if budget.gpu_ns > 0 {
        parts.push(format!(
            "{} GPU",
            hms(budget.gpu_ns.saturating_sub(budget.used_gpu_ns))
        ));
    }
    if budget.tokens > 0 {
        parts.push(format!(
            "{} tokens",
            budget.tokens.saturating_sub(budget.used_tokens)
        ));
    }
    parts.join(", ")
}

/// A key's budget as JSON (`null` without one).
pub fn budget_json(budget: Option<&api::KeyBudget>) -> Value {
    let Some(budget) = budget else {
        return Value::Null;
    };
    json!({
        "gpu_seconds": (budget.gpu_ns > 0).then(|| gpu_seconds(budget.gpu_ns)),
        "tokens": (budget.tokens > 0).then_some(budget.tokens),
        "window": budget.window,
        "used_gpu_seconds": gpu_seconds(budget.used_gpu_ns),
        "used_tokens": budget.used_tokens,
        "left_gpu_seconds": (budget.gpu_ns > 0)
            .then(|| gpu_seconds(budget.gpu_ns.saturating_sub(budget.used_gpu_ns))),
        "left_tokens": (budget.tokens > 0).then(|| budget.tokens.saturating_sub(budget.used_tokens)),
        "resets_unix_s": (budget.resets_unix_s > 0).then_some(budget.resets_unix_s),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn budget_cells_show_the_limit_and_what_is_left() {
        let budget = api::KeyBudget {
            gpu_ns: 7200 * SECOND,
            tokens: 0,
            window: "1d".into(),
            used_gpu_ns: 2700 * SECOND,
            used_tokens: 9,
            resets_unix_s: 1,
        };
        assert_eq!(budget_cell(Some(&budget)), "2:00:00 GPU / 1d");
        assert_eq!(left_cell(Some(&budget)), "1:15:00 GPU");
        assert_eq!(budget_cell(None), "-");
        let json = budget_json(Some(&budget));
        assert_eq!(json["left_gpu_seconds"], 4500.0);
        assert_eq!(json["tokens"], Value::Null);
    }
}
