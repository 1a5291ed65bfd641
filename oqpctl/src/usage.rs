//! `oqpctl usage` (who used how much GPU time, Ollama Cloud spend in USD and how many
//! tokens) and the budget pieces of
//! the other commands: `keys add --budget-*` parsing, the budget columns of `keys list`,
//! GPU time as `h:mm:ss`. Rendering is pure, from the response to text.

use std::time::Duration;

use oqp_proto::admin::v1 as api;
use serde_json::{Value, json};

use crate::figures::{gpu_seconds, hms};
use crate::render::{Output, Style, pretty, table};

/// `oqpctl usage`.
#[derive(Debug, Clone, clap::Args)]
pub struct UsageArgs {
    /// The period: the last 24h, 7d, 30d (any duration; whole UTC hours).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "24h")]
    pub since: Duration,
    /// Group rows by client (an app key's users apart, as `<client_id>/<user>`), by app (its
    /// users folded into it), by model, or by both (client,model; app,model).
    #[arg(long, value_parser = ["client", "app", "model", "client,model", "model,client", "app,model", "model,app"], default_value = "client")]
    pub by: String,
}

impl UsageArgs {
    /// The request for the control plane.
    pub fn request(&self) -> api::GetUsageRequest {
        api::GetUsageRequest {
            since_seconds: self.since.as_secs().max(1),
            by_client: self.by.contains("client") || self.by.contains("app"),
            by_model: self.by.contains("model"),
        }
    }

    /// Whether an app's users are folded into it.
    pub fn by_app(&self) -> bool {
        self.by.contains("app")
    }
}

/// The rows with each app key's users (`<client_id>/<user>`) added into their app, most GPU
/// time first (ties: client, model), as the control plane orders them.
pub fn fold_apps(response: &mut api::GetUsageResponse) {
    let mut folded: Vec<api::UsageTotals> = Vec::new();
    for row in response.rows.drain(..) {
        let app = row
            .client_id
            .split_once('/')
            .map_or(row.client_id.as_str(), |(app, _)| app)
            .to_owned();
        match folded
            .iter_mut()
            .find(|seen| seen.client_id == app && seen.model == row.model)
        {
            Some(seen) => {
                seen.gpu_ns += row.gpu_ns;
                seen.prompt_tokens += row.prompt_tokens;
                seen.completion_tokens += row.completion_tokens;
                seen.requests += row.requests;
                seen.embedding_inputs += row.embedding_inputs;
                seen.cached_inputs += row.cached_inputs;
                seen.cached_tokens = match (seen.cached_tokens, row.cached_tokens) {
                    (None, None) => None,
                    (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
                };
                seen.cloud_usd = match (seen.cloud_usd, row.cloud_usd) {
                    (None, None) => None,
                    (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
                };
            }
            None => folded.push(api::UsageTotals {
                client_id: app,
                ..row
            }),
        }
    }
    folded.sort_by(|a, b| {
        b.gpu_ns
            .cmp(&a.gpu_ns)
            .then_with(|| a.client_id.cmp(&b.client_id))
            .then_with(|| a.model.cmp(&b.model))
    });
    response.rows = folded;
}

/// `keys add`'s budget flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct BudgetArgs {
    /// GPU time allowed per window (e.g. 2h, 90m).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub budget_gpu: Option<Duration>,
    /// Tokens (prompt + completion) allowed per window (e.g. 500k, 2M).
    #[arg(long, value_parser = parse_count)]
    pub budget_tokens: Option<u64>,
    /// The budget's window, aligned to UTC (default 1d).
    #[arg(long, value_parser = ["1h", "1d", "7d", "30d"])]
    pub budget_window: Option<String>,
}

impl BudgetArgs {
    /// The budget asked for, or why the flags do not make one.
    pub fn budget(&self) -> Result<Option<api::KeyBudget>, String> {
        let gpu_ns = self
            .budget_gpu
            .map(|gpu| u64::try_from(gpu.as_nanos()).unwrap_or(u64::MAX));
        if gpu_ns == Some(0) || self.budget_tokens == Some(0) {
            return Err("a budget must be more than 0".to_owned());
        }
        match (gpu_ns, self.budget_tokens, &self.budget_window) {
            (None, None, None) => Ok(None),
            (None, None, Some(_)) => {
                Err("--budget-window needs --budget-gpu or --budget-tokens".to_owned())
            }
            (gpu_ns, tokens, window) => Ok(Some(api::KeyBudget {
                gpu_ns: gpu_ns.unwrap_or(0),
                tokens: tokens.unwrap_or(0),
                window: window.clone().unwrap_or_else(|| "1d".to_owned()),
                ..api::KeyBudget::default()
            })),
        }
    }
}

/// A count with an optional `k`, `M` or `G` suffix: `2M` = 2 000 000.
pub fn parse_count(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, factor) = match text.char_indices().last() {
        Some((at, 'k' | 'K')) => (&text[..at], 1_000),
        Some((at, 'm' | 'M')) => (&text[..at], 1_000_000),
        Some((at, 'g' | 'G')) => (&text[..at], 1_000_000_000),
        _ => (text, 1),
    };
    let number: f64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a count (e.g. 500000, 500k, 2M)"))?;
    if !(number.is_finite() && number >= 0.0) {
        return Err(format!("'{text}' is not a count (e.g. 500000, 500k, 2M)"));
    }
    Ok((number * factor as f64).round() as u64)
}

fn totals_json(row: &api::UsageTotals) -> Value {
    let mut value = json!({
        "gpu_seconds": gpu_seconds(row.gpu_ns),
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "requests": row.requests,
        "embedding_inputs": row.embedding_inputs,
        "cached_inputs": row.cached_inputs,
    });
    // Omitted, never 0, when no request had an estimate.
    if let (Some(cached), Some(object)) = (row.cached_tokens, value.as_object_mut()) {
        object.insert("cached_tokens".to_owned(), json!(cached));
    }
    // Omitted when no Ollama Cloud spend was attributed to the group.
    if let (Some(usd), Some(object)) = (row.cloud_usd, value.as_object_mut()) {
        object.insert("cloud_usd".to_owned(), json!(usd));
    }
    value
}

/// `oqpctl usage`: one row per group, most GPU time first, and the total; `by_app` names the
/// client column `app` (the rows were folded with [`fold_apps`]).
pub fn render(
    response: &api::GetUsageResponse,
    request: &api::GetUsageRequest,
    by_app: bool,
    output: Output,
    style: Style,
) -> String {
    let total = response.total.clone().unwrap_or_default();
    let since = humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + Duration::from_secs(response.since_unix_s.max(0).unsigned_abs()),
    )
    .to_string();
    match output {
        Output::Json => {
            let rows: Vec<Value> = response
                .rows
                .iter()
                .map(|row| {
                    let mut value = totals_json(row);
                    if request.by_client {
                        value["client_id"] = json!(row.client_id);
                    }
                    if request.by_model {
                        value["model"] = json!(row.model);
                    }
                    value
                })
                .collect();
            pretty(&json!({ "since": since, "rows": rows, "total": totals_json(&total) }))
        }
        Output::Table => {
            let mut header = Vec::new();
            if request.by_client {
                header.push(if by_app { "app" } else { "client" });
            }
            if request.by_model {
                header.push("model");
            }
            // Ollama Cloud spend beside GPU time, when any was attributed.
            let cloud = total.cloud_usd.is_some()
                || response.rows.iter().any(|row| row.cloud_usd.is_some());
            header.push("GPU time");
            if cloud {
                header.push("cloud spend");
            }
            header.extend([
                "prompt tokens",
                "completion tokens",
                "requests",
                "cache hits",
            ]);
            let mut rows = table(style, &header);
            let cells = |row: &api::UsageTotals, names: Vec<String>| {
                let mut cells = names;
                cells.push(hms(row.gpu_ns));
                if cloud {
                    cells.push(
                        row.cloud_usd
                            .map_or("-".to_owned(), |usd| format!("${usd:.2}")),
                    );
                }
                cells.extend([
                    row.prompt_tokens.to_string(),
                    row.completion_tokens.to_string(),
                    row.requests.to_string(),
                    row.cached_inputs.to_string(),
                ]);
                cells
            };
            for row in &response.rows {
                let mut names = Vec::new();
                if request.by_client {
                    names.push(row.client_id.clone());
                }
                if request.by_model {
                    names.push(if row.model.is_empty() {
                        "-".to_owned()
                    } else {
                        row.model.clone()
                    });
                }
                rows.add_row(cells(row, names));
            }
            let mut names = vec!["total".to_owned()];
            if request.by_client && request.by_model {
                names.push(String::new());
            }
            rows.add_row(cells(&total, names));
            format!("{rows}\nSince {since} (UTC, whole hours).")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    fn totals(client: &str, model: &str, gpu_seconds: u64) -> api::UsageTotals {
        api::UsageTotals {
            client_id: client.to_owned(),
            model: model.to_owned(),
            gpu_ns: gpu_seconds * SECOND,
            prompt_tokens: 120,
            completion_tokens: 3400,
            requests: 12,
            embedding_inputs: 0,
            cached_inputs: 3,
            cached_tokens: None,
            cloud_usd: None,
        }
    }

    fn response() -> api::GetUsageResponse {
        api::GetUsageResponse {
            rows: vec![totals("batch", "", 7384), totals("chat", "", 65)],
            total: Some(totals("", "", 7449)),
            since_unix_s: 1_796_108_400,
        }
    }

    #[test]
    fn by_app_folds_an_apps_users_into_it() {
        let mut response = api::GetUsageResponse {
            rows: vec![
                totals("webui/alice", "llama3.2", 10),
                totals("batch", "llama3.2", 15),
                totals("webui/bob", "llama3.2", 8),
                totals("webui", "llama3.2", 1),
                totals("webui/bob", "qwen3", 2),
            ],
            ..response()
        };
        fold_apps(&mut response);
        let rows: Vec<(&str, &str, u64)> = response
            .rows
            .iter()
            .map(|row| {
                (
                    row.client_id.as_str(),
                    row.model.as_str(),
                    row.gpu_ns / SECOND,
                )
            })
            .collect();
        assert_eq!(
            rows,
            vec![
                ("webui", "llama3.2", 19),
                ("batch", "llama3.2", 15),
                ("webui", "qwen3", 2)
            ]
        );
        assert_eq!(response.rows[0].requests, 36);
    }

    fn by_client() -> api::GetUsageRequest {
        api::GetUsageRequest {
            since_seconds: 86_400,
            by_client: true,
            by_model: false,
        }
    }

    #[test]
    fn the_table_shows_gpu_time_as_hours_minutes_seconds_with_a_total() {
        let text = render(
            &response(),
            &by_client(),
            false,
            Output::Table,
            Style::PLAIN,
        );
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[1].contains("client") && lines[1].contains("GPU time"),
            "{text}"
        );
        assert!(text.contains("| batch  | 2:03:04  |"), "{text}");
        assert!(text.contains("| chat   | 0:01:05  |"), "{text}");
        assert!(text.contains("| total  | 2:04:09  |"), "{text}");
        assert!(
            text.ends_with("Since 2026-12-01T07:00:00Z (UTC, whole hours)."),
            "{text}"
        );
    }

    #[test]
    fn cloud_spend_is_shown_beside_gpu_time_only_when_some_was_attributed() {
        let plain = render(
            &response(),
            &by_client(),
            false,
            Output::Table,
            Style::PLAIN,
        );
        assert!(!plain.contains("cloud spend"), "{plain}");
        let mut response = response();
        response.rows[0].cloud_usd = Some(1.5);
        response.total.as_mut().unwrap().cloud_usd = Some(1.5);
        let text = render(&response, &by_client(), false, Output::Table, Style::PLAIN);
        let lines: Vec<&str> = text.lines().collect();
        let header: Vec<&str> = lines[1].split('|').map(str::trim).collect();
        let at = |name: &str| header.iter().position(|cell| *cell == name).unwrap();
        assert_eq!(at("cloud spend"), at("GPU time") + 1, "{text}");
        assert!(text.contains("| $1.50 "), "{text}");
        assert!(text.contains("| chat   | 0:01:05  | -  "), "{text}");
        let json: Value = serde_json::from_str(&render(
            &response,
            &by_client(),
            false,
            Output::Json,
            Style::PLAIN,
        ))
        .unwrap();
        assert_eq!(json["rows"][0]["cloud_usd"], 1.5);
        assert!(json["rows"][1].get("cloud_usd").is_none());
        assert_eq!(json["total"]["cloud_usd"], 1.5);
    }

    #[test]
    fn json_keeps_the_figures_and_the_groups_asked_for() {
        let text = render(&response(), &by_client(), false, Output::Json, Style::PLAIN);
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["rows"][0]["client_id"], "batch");
        assert_eq!(value["rows"][0]["gpu_seconds"], 7384.0);
        assert!(value["rows"][0].get("model").is_none());
        assert_eq!(value["total"]["requests"], 12);
        assert_eq!(value["since"], "2026-12-01T07:00:00Z");
    }

    #[test]
    fn counts_take_suffixes() {
        assert_eq!(parse_count("2M"), Ok(2_000_000));
        assert_eq!(parse_count("500k"), Ok(500_000));
        assert_eq!(parse_count("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_count("42"), Ok(42));
        assert!(parse_count("lots").unwrap_err().contains("not a count"));
        assert!(parse_count("-3").is_err());
    }

    #[test]
    fn budget_flags_make_one_budget() {
        let args = BudgetArgs {
            budget_gpu: Some(Duration::from_secs(7200)),
            budget_tokens: Some(2_000_000),
            budget_window: None,
        };
        let budget = args.budget().unwrap().unwrap();
        assert_eq!(budget.gpu_ns, 7200 * SECOND);
        assert_eq!(budget.tokens, 2_000_000);
        assert_eq!(budget.window, "1d", "the default window");
        assert_eq!(BudgetArgs::default().budget(), Ok(None));
        let window_only = BudgetArgs {
            budget_window: Some("7d".into()),
            ..BudgetArgs::default()
        };
        assert!(window_only.budget().unwrap_err().contains("--budget-gpu"));
        let zero = BudgetArgs {
            budget_gpu: Some(Duration::ZERO),
            ..BudgetArgs::default()
        };
        assert!(zero.budget().is_err());
    }
}
