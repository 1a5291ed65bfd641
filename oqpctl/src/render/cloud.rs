//! `oqpctl cloud`: the Ollama Cloud accounts of every cloud host: plan, balance (credit plans)
//! or windows (legacy plans), when it resets, the reserve, the models each account refused
//! (402: extra usage only; 403: a subscription), its cooldown and its keys, redacted.

use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;
use serde_json::{Value, json};

use super::{Output, Style, expires, pretty, table};

/// `oqpctl cloud`.
pub fn cloud(response: &api::ListHostsResponse, output: Output, style: Style) -> String {
    let accounts: Vec<(&api::HostInfo, &api::CloudAccountInfo)> = response
        .hosts
        .iter()
        .flat_map(|host| {
            host.cloud_accounts
                .iter()
                .map(move |account| (host, account))
        })
        .collect();
    match output {
        Output::Json => pretty(&Value::Array(
            accounts
                .iter()
                .map(|(host, account)| account_json(host, account))
                .collect(),
        )),
        Output::Table => {
            if accounts.is_empty() {
                return "no cloud host".to_owned();
            }
            let mut grid = table(
                style,
                &[
                    "host", "account", "plan", "left", "resets", "reserve", "refused", "cooldown",
                    "keys",
                ],
            );
            for (host, account) in accounts {
                grid.add_row(vec![
                    host.name.clone(),
                    if account.team.is_empty() {
                        account.account.clone()
                    } else {
                        format!("{} ({})", account.account, account.team)
                    },
                    if account.plan.is_empty() {
                        "-".to_owned()
                    } else {
                        account.plan.clone()
                    },
                    left(account),
                    resets(account),
                    reserve(account),
                    if account.refused_models.is_empty() {
                        "-".to_owned()
                    } else {
                        account.refused_models.join(", ")
                    },
                    match expires(account.cooldown_until_unix_ms).as_str() {
                        "never" | "expired" => "-".to_owned(),
                        left => left.replacen("in ", "for ", 1),
                    },
                    account.keys.join(" "),
                ]);
            }
            grid.to_string()
        }
    }
}

/// What is left: `$12.50 +$3.00 extra of $20` or `session 70% weekly 40%`.
fn left(account: &api::CloudAccountInfo) -> String {
    match account.plan.as_str() {
        "credits" => {
            let mut text = format!("${:.2}", account.included_usd);
            if account.extra_usd > 0.0 {
                text.push_str(&format!(" +${:.2} extra", account.extra_usd));
            }
            if account.allowance_usd > 0.0 {
                text.push_str(&format!(" of ${:.0}", account.allowance_usd));
            }
            text
        }
        "windows" => [("session", &account.session), ("weekly", &account.weekly)]
            .into_iter()
            .filter_map(|(name, window)| {
                window
                    .as_ref()
                    .map(|window| format!("{name} {:.0}%", window.remaining_percent))
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => "not read".to_owned(),
    }
}

/// When the allowance (or the nearer window) resets.
fn resets(account: &api::CloudAccountInfo) -> String {
    let at = match account.plan.as_str() {
        "credits" => account.resets_at_unix_ms,
        _ => [&account.session, &account.weekly]
            .into_iter()
            .flatten()
            .map(|window| window.resets_at_unix_ms)
            .filter(|ms| *ms > 0)
            .min()
            .unwrap_or(0),
    };
    match expires(at).as_str() {
        "never" | "expired" => "-".to_owned(),
        left => left.to_owned(),
    }
}

fn reserve(account: &api::CloudAccountInfo) -> String {
    let mut parts = Vec::new();
    if account.reserve_usd > 0.0 {
        parts.push(format!("${:.2}", account.reserve_usd));
    }
    if account.reserve_percent > 0.0 {
        parts.push(format!("{}%", account.reserve_percent));
    }
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(" ")
    }
}

fn account_json(host: &api::HostInfo, account: &api::CloudAccountInfo) -> Value {
    let window = |window: &Option<wire::CloudWindow>| {
        window.as_ref().map(|window| {
            json!({
                "remaining_percent": window.remaining_percent,
                "resets_at_unix_ms": (window.resets_at_unix_ms > 0).then_some(window.resets_at_unix_ms),
            })
        })
    };
    let credits = account.plan == "credits";
    json!({
        "host": host.name,
        "account": account.account,
        "team": (!account.team.is_empty()).then_some(&account.team),
        "plan": (!account.plan.is_empty()).then_some(&account.plan),
        "included_usd": credits.then_some(account.included_usd),
        "allowance_usd": (credits && account.allowance_usd > 0.0).then_some(account.allowance_usd),
        "extra_usd": credits.then_some(account.extra_usd),
        "resets_at_unix_ms": (account.resets_at_unix_ms > 0).then_some(account.resets_at_unix_ms),
        "session": window(&account.session),
        "weekly": window(&account.weekly),
        "read_at_unix_ms": (account.read_at_unix_ms > 0).then_some(account.read_at_unix_ms),
        "reserve_usd": account.reserve_usd,
        "reserve_percent": account.reserve_percent,
        "refused_models": account.refused_models,
        "cooldown_until_unix_ms": (account.cooldown_until_unix_ms > 0).then_some(account.cooldown_until_unix_ms),
        "keys": account.keys,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::Width;

    fn response() -> api::ListHostsResponse {
        let in_a_day = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
            + 86_400_000;
        api::ListHostsResponse {
            hosts: vec![api::HostInfo {
                name: "cloud".into(),
                cloud_accounts: vec![
                    api::CloudAccountInfo {
                        account: "alice@example.com".into(),
                        team: "acme".into(),
                        plan: "credits".into(),
                        included_usd: 12.5,
                        allowance_usd: 20.0,
                        extra_usd: 3.0,
                        resets_at_unix_ms: in_a_day,
                        reserve_usd: 5.0,
                        refused_models: vec!["glm-5.2:latest (extra_usage)".into()],
                        keys: vec!["…0001".into(), "…0002".into()],
                        ..Default::default()
                    },
                    api::CloudAccountInfo {
                        account: "bob".into(),
                        plan: "windows".into(),
                        session: Some(wire::CloudWindow {
                            remaining_percent: 70.0,
                            resets_at_unix_ms: in_a_day,
                        }),
                        weekly: Some(wire::CloudWindow {
                            remaining_percent: 40.0,
                            resets_at_unix_ms: 0,
                        }),
                        cooldown_until_unix_ms: in_a_day,
                        keys: vec!["…0003".into()],
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn shows_both_plan_kinds_within_a_hundred_columns() {
        let style = Style {
            width: Width::Fit(100),
            ..Style::PLAIN
        };
        let fitted = cloud(&response(), Output::Table, style);
        for line in fitted.lines() {
            assert!(line.chars().count() <= 100, "{line}");
        }
        let text = cloud(&response(), Output::Table, Style::PLAIN);
        for cell in [
            "alice@example.com",
            "acme",
            "$12.50",
            "+$3.00",
            "$20",
            "session 70%",
            "weekly 40%",
            "$5.00",
            "extra_usage",
            "…0001",
            "…0003",
            "for ",
        ] {
            assert!(text.contains(cell), "{cell} not in\n{text}");
        }
        let json: Value = serde_json::from_str(&cloud(&response(), Output::Json, style)).unwrap();
        assert_eq!(json[0]["included_usd"], 12.5);
        assert_eq!(json[1]["session"]["remaining_percent"], 70.0);
        assert!(json[1]["included_usd"].is_null());
    }
}
