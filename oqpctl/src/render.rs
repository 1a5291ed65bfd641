//! Rendering of admin API answers as tables (comfy-table) or JSON. Pure
//! functions from response to text, so that they are unit-tested.

use std::time::Duration;

use comfy_table::{ColumnConstraint, ContentArrangement, Table, presets};
use oqp_proto::admin::v1 as api;
use oqp_proto::policy::v1 as wire;
use serde_json::{Value, json};

mod cloud;
mod status;

pub use cloud::cloud;
pub use status::status;

/// How answers are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Human-readable tables.
    Table,
    /// JSON, for scripts.
    Json,
}

/// Table options.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    /// Whether colours and box drawing may be used.
    pub color: bool,
    /// How wide tables may be.
    pub width: Width,
}

impl Style {
    /// ASCII, no colour, as wide as the content: what unit tests compare.
    #[cfg(test)]
    pub const PLAIN: Self = Self {
        color: false,
        width: Width::Wide,
    };

    /// Whether every column is shown (`--wide`), not only those that fit a terminal.
    pub fn wide(self) -> bool {
        self.width == Width::Wide
    }
}

/// How wide a table may be. Columns are narrowed and cells wrap inside them (at spaces
/// where they can) to fit; `--wide` lifts the limit and adds the columns left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    /// At most this many columns (`COLUMNS`, or [`DEFAULT_WIDTH`] when output is not a
    /// terminal).
    Fit(u16),
    /// The terminal's width, asked of the terminal.
    Terminal,
    /// As wide as the content (`--wide`).
    Wide,
}

/// The width for output that is not a terminal and names none in `COLUMNS`.
pub const DEFAULT_WIDTH: u16 = 100;

impl Width {
    /// `--wide`, else `COLUMNS` when it is a number, else the terminal's, else
    /// [`DEFAULT_WIDTH`].
    pub fn choose(wide: bool, columns: Option<&str>, terminal: bool) -> Self {
        if wide {
            return Self::Wide;
        }
        match columns.and_then(|value| value.trim().parse::<u16>().ok()) {
            Some(columns) if columns > 0 => Self::Fit(columns),
            _ if terminal => Self::Terminal,
            _ => Self::Fit(DEFAULT_WIDTH),
        }
    }
}

/// A table that fits its style's width when shown: columns narrowed, cells wrapped inside
/// them, and no word shorter than [`WHOLE_WORD`] (no cell line shorter than [`WHOLE_LINE`])
/// split while the width allows.
#[derive(Debug, Clone)]
pub(crate) struct Grid {
    table: Table,
    style: Style,
    /// The header and every row, to measure the words of each column.
    cells: Vec<Vec<String>>,
}

/// Words up to this long are kept whole when the width allows it (a status word, a scope,
/// a duration); longer ones (host names, model tags) may be split.
const WHOLE_WORD: usize = 12;

/// Cell lines up to this long are kept on one line when the width allows it.
const WHOLE_LINE: usize = 16;

impl Grid {
    /// Adds a row.
    pub(crate) fn add_row(&mut self, row: Vec<String>) -> &mut Self {
        self.cells.push(row.clone());
        self.table.add_row(row);
        self
    }

    /// The table with each column's lower bound set: its longest word (at most
    /// [`WHOLE_WORD`]) or short line, shortened, longest first, until the bounds fit the width.
    fn fitted(&self) -> Table {
        let mut table = self.table.clone();
        let width = match self.style.width {
            Width::Wide => return table,
            Width::Fit(columns) => columns,
            Width::Terminal => match table.width() {
                Some(columns) => columns,
                None => return table,
            },
        };
        let count = self.cells.iter().map(Vec::len).max().unwrap_or(0);
        // `| a | b |`: three characters per column and one more.
        let Some(room) = usize::from(width).checked_sub(3 * count + 1) else {
            return table;
        };
        // Per column: its longest word, and its longest short line (at least the word).
        let (words, mut bounds): (Vec<usize>, Vec<usize>) = (0..count)
            .map(|column| {
                let cells = || self.cells.iter().filter_map(|row| row.get(column));
                let word = cells()
                    .flat_map(|cell| cell.split_whitespace())
                    .map(|word| word.chars().count().min(WHOLE_WORD))
                    .max()
                    .unwrap_or(1);
                // A short cell of a few words ("never connected") stays on one line.
                let line = cells()
                    .skip(1)
                    .flat_map(|cell| cell.lines())
                    .map(|line| line.chars().count())
                    .filter(|length| *length <= WHOLE_LINE)
                    .max()
                    .unwrap_or(1);
                (word, word.max(line))
            })
            .unzip();
        // Too wide: lines wrap at spaces first, then the longest words are split.
        while bounds.iter().sum::<usize>() > room {
            let slack = bounds
                .iter()
                .zip(&words)
                .enumerate()
                .filter(|(_, (bound, word))| bound > word)
                .max_by_key(|(_, (bound, word))| **bound - **word)
                .map(|(index, _)| index);
            let index = match slack {
                Some(index) => index,
                None => match bounds.iter().enumerate().max_by_key(|(_, bound)| **bound) {
                    Some((index, bound)) if *bound > 1 => index,
                    _ => break,
                },
            };
            bounds[index] -= 1;
        }
        for (column, bound) in bounds.into_iter().enumerate() {
            if let (Some(column), Ok(bound)) = (table.column_mut(column), u16::try_from(bound + 2))
            {
                column.set_constraint(ColumnConstraint::LowerBoundary(comfy_table::Width::Fixed(
                    bound,
                )));
            }
        }
        table
    }
}

impl std::fmt::Display for Grid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.fitted())
    }
}

pub(crate) fn table(style: Style, header: &[&str]) -> Grid {
    let mut table = Table::new();
    table
        .load_preset(if style.color {
            presets::UTF8_FULL_CONDENSED
        } else {
            presets::ASCII_FULL_CONDENSED
        })
        .set_header(header.to_vec());
    match style.width {
        Width::Fit(columns) => {
            table
                .set_width(columns)
                .set_content_arrangement(ContentArrangement::Dynamic);
        }
        Width::Terminal => {
            table.set_content_arrangement(ContentArrangement::Dynamic);
        }
        Width::Wide => {
            table.set_content_arrangement(ContentArrangement::Disabled);
        }
    }
    Grid {
        table,
        style,
        cells: vec![header.iter().map(|cell| (*cell).to_owned()).collect()],
    }
}

/// `2h 3m`, `45s`, `-` for unknown.
pub fn age(duration: Option<Duration>) -> String {
    let Some(duration) = duration else {
        return "-".to_owned();
    };
    let secs = duration.as_secs();
    match secs {
        0..=59 => format!("{secs}s"),
        60..=3599 => format!("{}m {}s", secs / 60, secs % 60),
        3600..=86_399 => format!("{}h {}m", secs / 3600, (secs % 3600) / 60),
        _ => format!("{}d {}h", secs / 86_400, (secs % 86_400) / 3600),
    }
}

/// A tier's name.
pub fn tier_name(tier: i32) -> &'static str {
    match wire::Tier::try_from(tier) {
        Ok(wire::Tier::High) => "high",
        Ok(wire::Tier::Normal) => "normal",
        Ok(wire::Tier::Low) => "low",
        _ => "-",
    }
}

/// A scope's name.
pub fn scope_name(scope: i32) -> &'static str {
    match wire::Scope::try_from(scope) {
        Ok(wire::Scope::Read) => "read",
        Ok(wire::Scope::Management) => "management",
        _ => "inference",
    }
}

fn millis_age(ms: u64) -> Option<Duration> {
    (ms != u64::MAX).then(|| Duration::from_millis(ms))
}

fn unix_ms_age(unix_ms: i64) -> Option<Duration> {
    if unix_ms <= 0 {
        return None;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    Some(Duration::from_millis(
        u64::try_from(now - unix_ms).unwrap_or(0),
    ))
}

/// `oqpctl keys list`.
pub fn keys(response: &api::ListKeysResponse, output: Output, style: Style) -> String {
    match output {
        Output::Json => pretty(&Value::Array(response.keys.iter().map(key_json).collect())),
        Output::Table if !style.wide() => {
            let mut keys = table(
                style,
                &[
                    "client_id",
                    "scope",
                    "ceiling",
                    "caps / box",
                    "expires",
                    "last used",
                    "budget",
                    "left",
                    "models",
                ],
            );
            for key in &response.keys {
                keys.add_row(vec![
                    key.client_id.clone(),
                    scope_name(key.scope).to_owned(),
                    tier_name(key.max_priority).to_owned(),
                    caps(key.max_concurrent, key.max_queued),
                    expires(key.expires_unix_ms),
                    ago(unix_ms_age(key.last_used_unix_ms)),
                    crate::figures::budget_cell(key.budget.as_ref()),
                    crate::figures::left_cell(key.budget.as_ref()),
                    models_cell(key),
                ]);
            }
            with_caps_note(keys, capped(response), style)
        }
        Output::Table => {
            let mut keys = table(
                style,
                &[
                    "client_id",
                    "source",
                    "scope",
                    "max_priority",
                    "max_concurrent / box",
                    "max_queued / box",
                    "weight",
                    "created",
                    "expires",
                    "last used",
                    "budget",
                    "left",
                    "models",
                ],
            );
            for key in &response.keys {
                keys.add_row(vec![
                    key.client_id.clone(),
                    key.source.clone(),
                    scope_name(key.scope).to_owned(),
                    tier_name(key.max_priority).to_owned(),
                    cap(key.max_concurrent),
                    cap(key.max_queued),
                    format!("{}", key.weight),
                    ago(unix_ms_age(key.created_unix_ms)),
                    expires(key.expires_unix_ms),
                    ago(unix_ms_age(key.last_used_unix_ms)),
                    crate::figures::budget_cell(key.budget.as_ref()),
                    crate::figures::left_cell(key.budget.as_ref()),
                    models_cell(key),
                ]);
            }
            with_caps_note(keys, capped(response), style)
        }
    }
}

/// Whether any key has a cap, which the note under the table explains.
fn capped(response: &api::ListKeysResponse) -> bool {
    response
        .keys
        .iter()
        .any(|key| key.max_concurrent > 0 || key.max_queued > 0)
}

/// In flight and queued caps in one cell: `2 / 8`, `2 / -`; `unlimited` when neither is set.
fn caps(max_concurrent: u32, max_queued: u32) -> String {
    if max_concurrent == 0 && max_queued == 0 {
        return "unlimited".to_owned();
    }
    let shown = |value: u32| {
        if value == 0 {
            "-".to_owned()
        } else {
            value.to_string()
        }
    };
    format!("{} / {}", shown(max_concurrent), shown(max_queued))
}

/// `table`, with the note on per-box caps under it when `capped`, wrapped to the width.
fn with_caps_note(table: Grid, capped: bool, style: Style) -> String {
    if capped {
        format!("{table}\n{}", wrap(PER_BOX, style))
    } else {
        table.to_string()
    }
}

/// `text` broken at spaces into lines no wider than the style's width.
pub(crate) fn wrap(text: &str, style: Style) -> String {
    let width = match style.width {
        Width::Fit(columns) => usize::from(columns),
        Width::Terminal => Table::new().width().map_or(usize::MAX, usize::from),
        Width::Wide => usize::MAX,
    };
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines.join("\n")
}

/// The models a key may use ("all" without a list), and whose users it speaks for.
fn models_cell(key: &api::KeyInfo) -> String {
    let models = if key.models.is_empty() {
        "all".to_owned()
    } else {
        key.models.join(", ")
    };
    if key.users.is_empty() {
        models
    } else {
        format!("{models}\nusers: {}", key.users)
    }
}

/// Under a table with caps: what "/ box" means.
const PER_BOX: &str = "Caps are per GPU box: the data plane beside each box enforces them for its \
                       own hosts, so a client may have that many on every box at once.";

/// One key as JSON (never its value: the API has none to give).
pub fn key_json(key: &api::KeyInfo) -> Value {
    json!({
        "client_id": key.client_id,
        "source": key.source,
        "scope": scope_name(key.scope),
        "max_priority": tier_name(key.max_priority),
        "default_priority": tier_name(key.default_priority),
        "max_concurrent": key.max_concurrent,
        "max_queued": key.max_queued,
        "weight": key.weight,
        "description": key.description,
        "created_unix_ms": (key.created_unix_ms > 0).then_some(key.created_unix_ms),
        "expires_unix_ms": (key.expires_unix_ms > 0).then_some(key.expires_unix_ms),
        "last_used_unix_ms": (key.last_used_unix_ms > 0).then_some(key.last_used_unix_ms),
        "budget": crate::figures::budget_json(key.budget.as_ref()),
        "models": (!key.models.is_empty()).then_some(&key.models),
        "users": (!key.users.is_empty()).then_some(&key.users),
    })
}

/// `oqpctl keys add`: the key, once, with what it may do.
pub fn key_added(response: &api::AddKeyResponse, output: Output) -> String {
    let info = response.info.clone().unwrap_or_default();
    match output {
        Output::Json => {
            let mut value = key_json(&info);
            value["key"] = json!(response.key);
            value["snapshot_version"] = json!(response.snapshot_version);
            pretty(&value)
        }
        Output::Table => format!(
            "Added client '{}' ({}scope {}, max priority {}, expires {}); snapshot {}.\n\
             Its key, shown only this once:\n\n    {}\n\n\
             Clients present it as `Authorization: Bearer <key>`.",
            info.client_id,
            if info.source.is_empty() {
                String::new()
            } else {
                format!("{}, ", info.source)
            },
            scope_name(info.scope),
            tier_name(info.max_priority),
            expires(info.expires_unix_ms),
            response.snapshot_version,
            response.key,
        ),
    }
}

/// `oqpctl keys rotate`: the new key, once, and when the old one stops.
pub fn key_rotated(response: &api::RotateKeyResponse, output: Output) -> String {
    let info = response.info.clone().unwrap_or_default();
    match output {
        Output::Json => {
            let mut value = key_json(&info);
            value["key"] = json!(response.key);
            value["old_key_expires_unix_ms"] = json!(response.old_key_expires_unix_ms);
            value["snapshot_version"] = json!(response.snapshot_version);
            pretty(&value)
        }
        Output::Table => {
            let old = match expires(response.old_key_expires_unix_ms).as_str() {
                "expired" | "never" => "The old key no longer works.".to_owned(),
                remaining => format!(
                    "The old key works until {} ({remaining}).",
                    rfc3339(response.old_key_expires_unix_ms)
                ),
            };
            format!(
                "Rotated the key of client '{}'; snapshot {}.\n{old}\n\
                 The new key, shown only this once:\n\n    {}\n",
                info.client_id, response.snapshot_version, response.key,
            )
        }
    }
}

/// `oqpctl keys revoke`.
pub fn key_revoked(client_id: &str, response: &api::RevokeKeyResponse, output: Output) -> String {
    match output {
        Output::Json => pretty(&json!({
            "client_id": client_id,
            "revoked": true,
            "snapshot_version": response.snapshot_version,
        })),
        Output::Table => format!(
            "Revoked client '{client_id}': snapshot {} removes its keys from every data plane.",
            response.snapshot_version
        ),
    }
}

/// `oqpctl hosts`.
/// Each model runner: requests in flight over its slots, `forced` where Ollama runs it with
/// one slot whatever the setting, and the conversations warm in its prompt cache
/// (`llama3.2:3b 2/4 · 3 warm`, `all-minilm 1/1 forced`).
fn runners(host: &api::HostInfo) -> String {
    if host.runners.is_empty() {
        return "-".to_owned();
    }
    host.runners
        .iter()
        .map(|runner| {
            let slots = if runner.slots == u32::MAX {
                "-".to_owned()
            } else {
                runner.slots.to_string()
            };
            let forced = if runner.forced.is_empty() {
                ""
            } else {
                " forced"
            };
            let model = runner
                .model
                .strip_suffix(":latest")
                .unwrap_or(&runner.model);
            let warm = match runner.warm {
                0 => String::new(),
                n => format!(" · {n} warm"),
            };
            format!("{model} {}/{slots}{forced}{warm}", runner.in_flight)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn hosts(response: &api::ListHostsResponse, output: Output, style: Style) -> String {
    match output {
        Output::Json => pretty(&Value::Array(
            response
                .hosts
                .iter()
                .map(|host| {
                    json!({
                        "name": host.name,
                        "owner": (!host.node.is_empty()).then_some(&host.node),
                        "url": host.url,
                        "kind": kind(host.kind),
                        "healthy": host.healthy,
                        "slots_in_use": host.slots_in_use,
                        "max_concurrent": host.max_concurrent,
                        "weight": host.weight,
                        "installed_models": host.installed_models,
                        "loaded_models": host.loaded_models,
                        "resident": host.resident.iter().map(|m| json!({"model": m.name, "bytes": m.bytes})).collect::<Vec<_>>(),
                        "vram_bytes": (host.vram_bytes > 0).then_some(host.vram_bytes),
                        "vram_learned": host.vram_learned,
                        "held": host.held,
                        "oldest_held_ms": (host.held > 0).then_some(host.oldest_held_ms),
                        "switching_to": (!host.switching_to.is_empty()).then_some(&host.switching_to),
                        "switches": host.switches,
                        "swap_bypassed": host.swap_bypassed,
                        "requests": host.requests,
                        "failures": host.failures,
                        "runners": host.runners.iter().map(|r| json!({
                            "model": r.model,
                            "slots": r.slots,
                            "in_flight": r.in_flight,
                            "forced": (!r.forced.is_empty()).then_some(&r.forced),
                            "warm": r.warm,
                        })).collect::<Vec<_>>(),
                        "cloud_keys": host.cloud_keys.iter().map(|k| json!({
                            "label": k.label,
                            "bound_model": (!k.bound_model.is_empty()).then_some(&k.bound_model),
                            "busy": k.busy,
                            "cooldown_until_unix_ms": (k.cooldown_until_unix_ms > 0).then_some(k.cooldown_until_unix_ms),
                            "last_error": (!k.last_error.is_empty()).then_some(&k.last_error),
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect(),
        )),
        Output::Table => {
            // A terminal gets the columns that say what a host is doing; `--wide` adds its
            // URL and counters.
            let wide = style.wide();
            let mut header = vec!["host", "owner"];
            if wide {
                header.push("url");
            }
            header.extend(["kind", "health", "slots", "runners", "resident", "vram", "held", "installed"]);
            if wide {
                header.extend(["requests", "failures"]);
            }
            let mut hosts = table(style, &header);
            for host in &response.hosts {
                let mut row = vec![host.name.clone(), owner(host)];
                if wide {
                    row.push(host.url.clone());
                }
                row.extend([
                    kind(host.kind).to_owned(),
                    if host.healthy { "up" } else { "DOWN" }.to_owned(),
                    format!("{}/{}", host.slots_in_use, host.max_concurrent),
                    runners(host),
                    resident(host),
                    vram(host),
                    held(host),
                    list(&host.installed_models),
                ]);
                if wide {
                    row.extend([host.requests.to_string(), host.failures.to_string()]);
                }
                hosts.add_row(row);
            }
            let pools: Vec<_> = response
                .hosts
                .iter()
                .flat_map(|host| host.cloud_keys.iter().map(move |key| (host, key)))
                .collect();
            if pools.is_empty() {
                return hosts.to_string();
            }
            let mut pool = table(
                style,
                &["cloud host", "key", "bound model", "busy", "cooling down", "last error"],
            );
            for (host, key) in pools {
                pool.add_row(vec![
                    host.name.clone(),
                    key.label.clone(),
                    if key.bound_model.is_empty() { "-".to_owned() } else { key.bound_model.clone() },
                    yes_no(key.busy).to_owned(),
                    match expires(key.cooldown_until_unix_ms).as_str() {
                        "never" | "expired" => "-".to_owned(),
                        left => left.replacen("in ", "for ", 1),
                    },
                    if key.last_error.is_empty() { "-".to_owned() } else { key.last_error.clone() },
                ]);
            }
            format!("{hosts}\n{pool}")
        }
    }
}

/// `oqpctl clients`.
pub fn clients(response: &api::ListClientsResponse, output: Output, style: Style) -> String {
    match output {
        Output::Json => pretty(&Value::Array(
            response
                .clients
                .iter()
                .map(|client| {
                    json!({
                        "client_id": client.client_id,
                        "max_priority": tier_name(client.max_priority),
                        "scope": scope_name(client.scope),
                        "waiting": client.waiting,
                        "inflight": client.inflight,
                        "max_concurrent": client.max_concurrent,
                        "weight": client.weight,
                        "recent_share": client.recent_share,
                        "processed": client.processed,
                        "rejected": client.rejected,
                        "gpu_seconds_today": (client.gpu_ns_today as f64 / 1e6).round() / 1e3,
                        "rate_limit": client.rate_limit.map(|limit| json!({
                            "requests_per_minute": limit.requests_per_minute,
                            "tokens_per_minute": limit.tokens_per_minute,
                        })),
                        "rate_limited": client.rate_limited,
                    })
                })
                .collect(),
        )),
        Output::Table => {
            // Each column: its header, whether only `--wide` shows it, its cell.
            type Cell = fn(&api::ClientInfo) -> String;
            let columns: [(&str, bool, Cell); 13] = [
                ("client", false, |c| c.client_id.clone()),
                ("ceiling", false, |c| tier_name(c.max_priority).to_owned()),
                ("scope", false, |c| scope_name(c.scope).to_owned()),
                ("waiting", false, |c| c.waiting.to_string()),
                ("in flight", false, |c| c.inflight.to_string()),
                ("cap / box", false, |c| cap(c.max_concurrent)),
                ("weight", true, |c| format!("{}", c.weight)),
                ("share", false, |c| {
                    format!("{:.0}%", c.recent_share * 100.0)
                }),
                ("processed", true, |c| c.processed.to_string()),
                ("rejected", true, |c| c.rejected.to_string()),
                ("per minute", true, |c| per_minute(c.rate_limit.as_ref())),
                ("limited", true, |c| c.rate_limited.to_string()),
                ("GPU today", false, |c| crate::figures::hms(c.gpu_ns_today)),
            ];
            let shown: Vec<&(&str, bool, Cell)> = columns
                .iter()
                .filter(|(_, wide_only, _)| style.wide() || !wide_only)
                .collect();
            let header: Vec<&str> = shown.iter().map(|(name, _, _)| *name).collect();
            let mut clients = table(style, &header);
            for client in &response.clients {
                clients.add_row(
                    shown
                        .iter()
                        .map(|(_, _, cell)| cell(client))
                        .collect::<Vec<_>>(),
                );
            }
            with_caps_note(clients, clients_capped(response), style)
        }
    }
}

/// A client's per-minute limits in a cell: "60 req, 10000 tok", "-" when it has none.
fn per_minute(limit: Option<&wire::RateLimit>) -> String {
    let Some(limit) = limit else {
        return "-".to_owned();
    };
    let mut parts = Vec::new();
    if limit.requests_per_minute > 0 {
        parts.push(format!("{} req", limit.requests_per_minute));
    }
    if limit.tokens_per_minute > 0 {
        parts.push(format!("{} tok", limit.tokens_per_minute));
    }
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

fn clients_capped(response: &api::ListClientsResponse) -> bool {
    response
        .clients
        .iter()
        .any(|client| client.max_concurrent > 0)
}

/// A tier operation's answer, in the shape of the HTTP endpoints.
pub fn tier_change(response: &api::TierResponse, output: Output) -> String {
    match output {
        Output::Json => pretty(&json!({
            "status": response.status,
            "tier": response.tier,
            "snapshot_version": response.snapshot_version,
        })),
        Output::Table => format!(
            "{} {} (snapshot {})",
            response.tier, response.status, response.snapshot_version
        ),
    }
}

/// One line of drain progress.
pub fn drain_progress(progress: &api::DrainProgress, output: Output) -> String {
    match output {
        Output::Json => serde_json::to_string(&json!({
            "drained": progress.drained,
            "timed_out": progress.timed_out,
            "nodes": progress.nodes.iter().map(|n| json!({"node": n.node, "waiting": n.depths})).collect::<Vec<_>>(),
        }))
        .unwrap_or_default(),
        Output::Table => {
            let nodes: Vec<String> = progress
                .nodes
                .iter()
                .map(|node| {
                    let depths: Vec<String> = node
                        .depths
                        .iter()
                        .zip(["high", "normal", "low"])
                        .map(|(depth, tier)| format!("{tier} {depth}"))
                        .collect();
                    format!("{}: {}", node.node, depths.join(", "))
                })
                .collect();
            let state = if progress.drained {
                "drained"
            } else if progress.timed_out {
                "timed out"
            } else {
                "waiting"
            };
            if nodes.is_empty() {
                state.to_owned()
            } else {
                format!("{state} — {}", nodes.join("; "))
            }
        }
    }
}

/// The node that owns a host; "every node" when it names none (each data
/// plane dispatches to it).
fn owner(host: &api::HostInfo) -> String {
    if host.node.is_empty() {
        "every node".to_owned()
    } else {
        host.node.clone()
    }
}

fn yes_no(value: bool) -> &'static str {
    if value { "yes" } else { "no" }
}

fn cap(value: u32) -> String {
    if value == 0 {
        "unlimited".to_owned()
    } else {
        value.to_string()
    }
}

/// A byte count as `4.7 GiB` (`24 GiB` when whole).
pub fn bytes(bytes: u64) -> String {
    let shown = bytesize::ByteSize(bytes).display().iec().to_string();
    match shown.split_once(".0 ") {
        Some((whole, unit)) => format!("{whole} {unit}"),
        None => shown,
    }
}

/// The models in VRAM with their bytes, one per line; the loaded names when no sizes are known
/// (a control plane that predates them).
fn resident(host: &api::HostInfo) -> String {
    if host.resident.is_empty() {
        return list(&host.loaded_models);
    }
    let rows: Vec<String> = host
        .resident
        .iter()
        .map(|model| match model.bytes {
            0 => model.name.clone(),
            size => format!("{} {}", model.name, bytes(size)),
        })
        .collect();
    rows.join("\n")
}

/// A host's kind as the config spells it.
fn kind(kind: i32) -> &'static str {
    match wire::HostKind::try_from(kind) {
        Ok(wire::HostKind::Cloud) => "cloud",
        Ok(wire::HostKind::Openai) => "openai",
        _ => "ollama",
    }
}

/// `24 GiB` (configured), `~16 GiB learned`, `?` (not known yet), `-` (cloud).
fn vram(host: &api::HostInfo) -> String {
    match (host.vram_bytes, host.vram_learned) {
        _ if host.kind == wire::HostKind::Cloud as i32 => "-".to_owned(),
        (0, _) => "?".to_owned(),
        (size, false) => bytes(size),
        (size, true) => format!("~{} learned", bytes(size)),
    }
}

/// Requests held back for a model switch: `2 (3.1 s)` with the oldest's wait, `0`; a switch
/// under way and a host that swap-aware scheduling leaves alone are named.
fn held(host: &api::HostInfo) -> String {
    let mut shown = match host.held {
        0 => "0".to_owned(),
        n => format!("{n} ({:.1} s)", host.oldest_held_ms as f64 / 1000.0),
    };
    if !host.switching_to.is_empty() {
        shown.push_str(&format!("\n→ {}", host.switching_to));
    }
    if host.swap_bypassed {
        shown.push_str("\nbypassed");
    }
    shown
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "-".to_owned()
    } else {
        items.join(", ")
    }
}

fn ago(duration: Option<Duration>) -> String {
    match duration {
        Some(duration) => format!("{} ago", age(Some(duration))),
        None => "-".to_owned(),
    }
}

fn expires(unix_ms: i64) -> String {
    if unix_ms <= 0 {
        return "never".to_owned();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    if unix_ms <= now {
        "expired".to_owned()
    } else {
        format!(
            "in {}",
            age(Some(Duration::from_millis((unix_ms - now) as u64)))
        )
    }
}

fn rfc3339(unix_ms: i64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(unix_ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}

pub(crate) fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_never_show_a_value_and_name_unlimited_caps() {
        let response = api::ListKeysResponse {
            keys: vec![api::KeyInfo {
                client_id: "batch".into(),
                source: "store".into(),
                scope: wire::Scope::Inference as i32,
                max_priority: wire::Tier::Low as i32,
                weight: 1.0,
                ..Default::default()
            }],
        };
        let text = keys(&response, Output::Table, Style::PLAIN);
        assert!(text.contains("batch") && text.contains("low") && text.contains("unlimited"));
        let value: Value =
            serde_json::from_str(&keys(&response, Output::Json, Style::PLAIN)).unwrap();
        assert_eq!(value[0]["client_id"], "batch");
        assert!(value[0].get("key").is_none());
    }

    fn now_ms() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    }

    fn stored_info() -> api::KeyInfo {
        api::KeyInfo {
            client_id: "batch".into(),
            source: "store".into(),
            scope: wire::Scope::Inference as i32,
            max_priority: wire::Tier::Low as i32,
            default_priority: wire::Tier::Low as i32,
            weight: 1.0,
            created_unix_ms: now_ms() - 90_000,
            expires_unix_ms: now_ms() + 3 * 86_400_000 + 60_000,
            ..Default::default()
        }
    }

    #[test]
    fn keys_list_shows_source_created_and_expiry() {
        let mut config_key = stored_info();
        config_key.client_id = "admin".into();
        config_key.source = "config".into();
        config_key.created_unix_ms = 0;
        config_key.expires_unix_ms = 0;
        config_key.last_used_unix_ms = now_ms() - 5_000;
        let mut expired = stored_info();
        expired.client_id = "old".into();
        expired.expires_unix_ms = now_ms() - 1;
        let response = api::ListKeysResponse {
            keys: vec![config_key, stored_info(), expired],
        };
        let text = keys(&response, Output::Table, Style::PLAIN);
        let row = |id: &str| {
            text.lines()
                .find(|line| line.contains(&format!(" {id} ")))
                .unwrap_or_else(|| panic!("no row for {id}:\n{text}"))
                .to_owned()
        };
        let admin = row("admin");
        assert!(
            admin.contains("config") && admin.contains("never"),
            "{admin}"
        );
        assert!(admin.contains("5s ago"), "{admin}");
        let batch = row("batch");
        assert!(
            batch.contains("store") && batch.contains("1m 30s ago"),
            "{batch}"
        );
        assert!(batch.contains("in 3d 0h"), "{batch}");
        assert!(row("old").contains("expired"));
    }

    #[test]
    fn an_added_key_is_shown_once_in_both_formats() {
        let response = api::AddKeyResponse {
            info: Some(stored_info()),
            key: "oqp_secretvalue".into(),
            snapshot_version: 7,
        };
        let text = key_added(&response, Output::Table);
        assert!(text.contains("\n    oqp_secretvalue\n"), "{text}");
        assert!(text.contains("'batch'") && text.contains("snapshot 7"));
        assert!(text.contains("shown only this once"));
        assert_eq!(text.matches("oqp_secretvalue").count(), 1);
        let value: Value = serde_json::from_str(&key_added(&response, Output::Json)).unwrap();
        assert_eq!(value["key"], "oqp_secretvalue");
        assert_eq!(value["client_id"], "batch");
        assert_eq!(value["snapshot_version"], 7);
        assert_eq!(value["scope"], "inference");
    }

    #[test]
    fn a_rotation_says_when_the_old_key_stops() {
        let until = now_ms() + 3_600_000 + 30_000;
        let response = api::RotateKeyResponse {
            info: Some(stored_info()),
            key: "oqp_newvalue".into(),
            old_key_expires_unix_ms: until,
            snapshot_version: 8,
        };
        let text = key_rotated(&response, Output::Table);
        assert!(text.contains("The old key works until 20"), "{text}");
        assert!(text.contains("(in 1h 0m)"), "{text}");
        assert!(text.contains("\n    oqp_newvalue\n"), "{text}");
        let now = api::RotateKeyResponse {
            old_key_expires_unix_ms: now_ms() - 1,
            ..response.clone()
        };
        assert!(key_rotated(&now, Output::Table).contains("The old key no longer works."));
        let value: Value = serde_json::from_str(&key_rotated(&response, Output::Json)).unwrap();
        assert_eq!(value["key"], "oqp_newvalue");
        assert_eq!(value["old_key_expires_unix_ms"], until);
    }

    #[test]
    fn a_revocation_names_the_client_and_snapshot() {
        let response = api::RevokeKeyResponse {
            snapshot_version: 9,
        };
        let text = key_revoked("batch", &response, Output::Table);
        assert!(text.contains("'batch'") && text.contains("snapshot 9"));
        let value: Value =
            serde_json::from_str(&key_revoked("batch", &response, Output::Json)).unwrap();
        assert_eq!(value["revoked"], true);
    }

    fn host(name: &str, node: &str) -> api::HostInfo {
        api::HostInfo {
            name: name.into(),
            url: format!("http://{name}.lan:11434"),
            healthy: true,
            max_concurrent: 2,
            node: node.into(),
            ..Default::default()
        }
    }

    #[test]
    fn hosts_show_vram_resident_models_and_held_requests() {
        let size = |name: &str, bytes: u64| wire::ModelSize {
            name: name.to_owned(),
            bytes,
        };
        let response = api::ListHostsResponse {
            hosts: vec![
                api::HostInfo {
                    resident: vec![size("llama3:8b", 5_046_586_573)],
                    vram_bytes: 24 << 30,
                    held: 2,
                    oldest_held_ms: 3_140,
                    ..host("gpu1", "box1")
                },
                api::HostInfo {
                    resident: vec![size("qwen3:8b", 5 << 30), size("phi3:mini", 0)],
                    vram_bytes: 16 << 30,
                    vram_learned: true,
                    switching_to: "llama3:8b".to_owned(),
                    ..host("gpu2", "box2")
                },
                api::HostInfo {
                    loaded_models: vec!["old:1b".to_owned()],
                    ..host("spare", "")
                },
            ],
        };
        let text = hosts(&response, Output::Table, Style::PLAIN);
        let header = text.lines().find(|line| line.contains("host")).unwrap();
        for column in [" resident ", " vram ", " held "] {
            assert!(header.contains(column), "{text}");
        }
        let row = |name: &str| {
            text.lines()
                .find(|line| line.contains(&format!(" {name} ")))
                .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
                .to_owned()
        };
        assert!(row("gpu1").contains(" llama3:8b 4.7 GiB "), "{text}");
        assert!(row("gpu1").contains(" 24 GiB "), "{text}");
        assert!(row("gpu1").contains(" 2 (3.1 s) "), "{text}");
        assert!(row("gpu2").contains(" qwen3:8b 5 GiB "), "{text}");
        assert!(row("gpu2").contains(" ~16 GiB learned "), "{text}");
        assert!(text.contains(" phi3:mini "), "{text}");
        assert!(text.contains("→ llama3:8b"), "{text}");
        assert!(row("spare").contains(" old:1b "), "{text}");
        assert!(row("spare").contains(" ? "), "{text}");
        assert!(row("spare").contains(" 0 "), "{text}");

        let value: Value =
            serde_json::from_str(&hosts(&response, Output::Json, Style::PLAIN)).unwrap();
        assert_eq!(value[0]["resident"][0]["model"], "llama3:8b");
        assert_eq!(value[0]["vram_bytes"], 24u64 << 30);
        assert_eq!(value[0]["vram_learned"], false);
        assert_eq!(value[0]["held"], 2);
        assert_eq!(value[0]["oldest_held_ms"], 3_140);
        assert_eq!(value[1]["switching_to"], "llama3:8b");
        assert_eq!(value[2]["vram_bytes"], Value::Null);
        assert_eq!(value[2]["oldest_held_ms"], Value::Null);
    }

    #[test]
    fn byte_sizes_read_like_people_write_them() {
        assert_eq!(bytes(24 << 30), "24 GiB");
        assert_eq!(bytes(5_046_586_573), "4.7 GiB");
        assert_eq!(bytes(512), "512 B");
    }

    #[test]
    fn hosts_show_their_owner_node() {
        let response = api::ListHostsResponse {
            hosts: vec![
                host("gpu1", "box1"),
                host("gpu2", "box2"),
                host("spare", ""),
            ],
        };
        let text = hosts(&response, Output::Table, Style::PLAIN);
        let header = text.lines().find(|line| line.contains("host")).unwrap();
        assert!(header.contains(" owner "), "{text}");
        let row = |name: &str| {
            text.lines()
                .find(|line| line.contains(&format!(" {name} ")))
                .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
                .to_owned()
        };
        assert!(row("gpu1").contains(" box1 "), "{text}");
        assert!(row("gpu2").contains(" box2 "), "{text}");
        assert!(row("spare").contains(" every node "), "{text}");
        let engine = api::ListHostsResponse {
            hosts: vec![api::HostInfo {
                kind: wire::HostKind::Openai as i32,
                ..host("llama", "")
            }],
        };
        let text = hosts(&engine, Output::Table, Style::PLAIN);
        let header = text.lines().find(|line| line.contains("host")).unwrap();
        assert!(header.contains(" kind "), "{text}");
        let row = text.lines().find(|line| line.contains(" llama ")).unwrap();
        assert!(row.contains(" openai "), "{text}");
        let text = hosts(&response, Output::Table, Style::PLAIN);
        let row = text.lines().find(|line| line.contains(" gpu1 ")).unwrap();
        assert!(row.contains(" ollama "), "{text}");
        let value: Value =
            serde_json::from_str(&hosts(&response, Output::Json, Style::PLAIN)).unwrap();
        assert_eq!(value[0]["owner"], "box1");
        assert_eq!(value[2]["owner"], Value::Null);
    }

    #[test]
    fn caps_are_labelled_per_gpu_box_and_json_keeps_its_names() {
        let response = api::ListKeysResponse {
            keys: vec![api::KeyInfo {
                max_concurrent: 2,
                max_queued: 8,
                ..stored_info()
            }],
        };
        let text = keys(&response, Output::Table, Style::PLAIN);
        assert!(text.contains("max_concurrent / box"), "{text}");
        assert!(text.contains("max_queued / box"), "{text}");
        assert!(text.contains("Caps are per GPU box"), "{text}");
        let batch = text.lines().find(|line| line.contains(" batch ")).unwrap();
        assert!(batch.contains(" 2 ") && batch.contains(" 8 "), "{batch}");
        let value: Value =
            serde_json::from_str(&keys(&response, Output::Json, Style::PLAIN)).unwrap();
        assert_eq!(value[0]["max_concurrent"], 2);
        assert_eq!(value[0]["max_queued"], 8);
        let uncapped = api::ListKeysResponse {
            keys: vec![stored_info()],
        };
        let text = keys(&uncapped, Output::Table, Style::PLAIN);
        assert!(!text.contains("Caps are per GPU box"), "{text}");

        let clients_response = api::ListClientsResponse {
            clients: vec![api::ClientInfo {
                client_id: "batch".into(),
                max_concurrent: 1,
                ..Default::default()
            }],
        };
        let text = clients(&clients_response, Output::Table, Style::PLAIN);
        assert!(
            text.contains("cap / box") && text.contains("Caps are per GPU box"),
            "{text}"
        );
    }

    #[test]
    fn clients_show_their_per_minute_limits_when_wide_and_in_json() {
        let response = api::ListClientsResponse {
            clients: vec![
                api::ClientInfo {
                    client_id: "batch".into(),
                    rate_limit: Some(wire::RateLimit {
                        requests_per_minute: 30,
                        tokens_per_minute: 50_000,
                    }),
                    rate_limited: 7,
                    ..Default::default()
                },
                api::ClientInfo {
                    client_id: "free".into(),
                    ..Default::default()
                },
            ],
        };
        let style = Style {
            color: false,
            width: Width::Wide,
        };
        let text = clients(&response, Output::Table, style);
        assert!(
            text.contains("per minute") && text.contains("limited"),
            "{text}"
        );
        let batch = text.lines().find(|line| line.contains(" batch ")).unwrap();
        assert!(
            batch.contains("30 req, 50000 tok") && batch.contains(" 7 "),
            "{batch}"
        );
        let value: Value =
            serde_json::from_str(&clients(&response, Output::Json, Style::PLAIN)).unwrap();
        assert_eq!(value[0]["rate_limit"]["tokens_per_minute"], 50_000);
        assert_eq!(value[0]["rate_limited"], 7);
        assert!(value[1]["rate_limit"].is_null());
    }

    #[test]
    fn the_width_comes_from_wide_columns_or_the_terminal() {
        assert_eq!(Width::choose(true, Some("80"), true), Width::Wide);
        assert_eq!(Width::choose(false, Some("80"), true), Width::Fit(80));
        assert_eq!(Width::choose(false, Some("x"), true), Width::Terminal);
        assert_eq!(Width::choose(false, None, false), Width::Fit(DEFAULT_WIDTH));
        let style = Style {
            color: false,
            width: Width::Fit(30),
        };
        let note = wrap(PER_BOX, style);
        assert!(
            note.lines().all(|line| line.chars().count() <= 30),
            "{note}"
        );
        assert_eq!(
            note.split_whitespace().collect::<Vec<_>>().join(" "),
            PER_BOX
        );
    }

    #[test]
    fn a_terminal_gets_caps_in_one_cell_and_wide_gets_every_column() {
        let response = api::ListKeysResponse {
            keys: vec![api::KeyInfo {
                max_concurrent: 2,
                max_queued: 8,
                ..stored_info()
            }],
        };
        let narrow = Style {
            color: false,
            width: Width::Fit(100),
        };
        let text = keys(&response, Output::Table, narrow);
        assert!(text.contains(" 2 / 8 "), "{text}");
        assert!(!text.contains("created"), "{text}");
        assert!(
            text.lines().all(|line| line.chars().count() <= 100),
            "{text}"
        );
        let wide = keys(&response, Output::Table, Style::PLAIN);
        assert!(
            wide.contains("created") && wide.contains("source"),
            "{wide}"
        );
    }

    #[test]
    fn ages_read_naturally() {
        assert_eq!(age(Some(Duration::from_secs(5))), "5s");
        assert_eq!(age(Some(Duration::from_secs(125))), "2m 5s");
        assert_eq!(age(Some(Duration::from_secs(90_000))), "1d 1h");
        assert_eq!(age(None), "-");
    }
}
