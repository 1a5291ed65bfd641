//! `HostInfo.cloud_accounts` for `oqpctl cloud`: each account of a cloud host's pool, its
//! balance as the control plane read it (from the snapshot), and what the data planes report
//! of it (refused models, cooldown), merged over nodes. Keys appear only redacted.

use std::collections::BTreeMap;

use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;

use crate::config::Config;
use crate::hub::Node;

/// The accounts of `host` (a snapshot host) as the admin API shows them.
pub(super) fn accounts(
    host: &wire::Host,
    config: &Config,
    nodes: &BTreeMap<String, Node>,
) -> Vec<api::CloudAccountInfo> {
    let configured = config.ollama.hosts.iter().find(|h| h.name == host.name);
    host.cloud_accounts
        .iter()
        .map(|account| {
            let keys: Vec<String> = configured
                .map(|h| {
                    h.api_keys
                        .iter()
                        .filter(|key| crate::balances::account_id(key) == account.account)
                        .map(|key| super::redact(key.key.expose()))
                        .collect()
                })
                .unwrap_or_default();
            let name = if account.account.starts_with("key:") {
                keys.first().cloned().unwrap_or_else(|| "…".to_owned())
            } else {
                account.account.clone()
            };
            let mut refused_models: Vec<String> = Vec::new();
            let mut cooldown_until_unix_ms = 0;
            for report in nodes
                .values()
                .flat_map(|node| node.report.hosts.iter())
                .filter(|report| report.name == host.name)
                .flat_map(|report| report.cloud_accounts.iter())
                .filter(|report| report.account == account.account)
            {
                for model in &report.refused_models {
                    if !refused_models.contains(model) {
                        refused_models.push(model.clone());
                    }
                }
                cooldown_until_unix_ms = cooldown_until_unix_ms.max(report.cooldown_until_unix_ms);
            }
            refused_models.sort();
            api::CloudAccountInfo {
                account: name,
                team: account.team.clone(),
                plan: account.plan.clone(),
                included_usd: account.included_usd,
                allowance_usd: account.allowance_usd,
                extra_usd: account.extra_usd,
                resets_at_unix_ms: account.resets_at_unix_ms,
                session: account.session,
                weekly: account.weekly,
                read_at_unix_ms: account.read_at_unix_ms,
                reserve_usd: account.reserve_usd,
                reserve_percent: account.reserve_percent,
                refused_models,
                cooldown_until_unix_ms,
                keys,
            }
        })
        .collect()
}
