//! `oqpctl audit`: the control plane's audit trail (`ListAudit`), as an
//! aligned table that fits 100 columns or as JSON lines; `--follow` polls
//! for new entries until Ctrl-C.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use oqp_proto::admin::v1 as api;
use serde_json::json;

use crate::render::Output;

/// How often `--follow` asks for new entries.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// The columns: (header, width); the last takes what is left of 100.
const COLUMNS: [(&str, usize); 6] = [
    ("TIME (UTC)", 19),
    ("ACTOR", 10),
    ("SOURCE", 21),
    ("ACTION", 15),
    ("TARGET", 12),
    ("OUTCOME", 18),
];

/// `oqpctl audit`'s arguments.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// Only entries this recent (e.g. 1h, 7d); default: the whole trail.
    #[arg(long, value_parser = humantime::parse_duration)]
    since: Option<Duration>,
    /// Only this action (keys.revoke) or those under a prefix (keys).
    #[arg(long)]
    action: Option<String>,
    /// At most this many entries, the newest.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Keep printing new entries until Ctrl-C.
    #[arg(long)]
    follow: bool,
    /// JSON lines (as `--output json`).
    #[arg(long)]
    json: bool,
}

impl AuditArgs {
    /// The first request.
    pub fn request(&self, now: SystemTime) -> api::ListAuditRequest {
        api::ListAuditRequest {
            since_unix_ms: self.since.map_or(0, |since| {
                unix_ms(now.checked_sub(since).unwrap_or(SystemTime::UNIX_EPOCH))
            }),
            action: self.action.clone().unwrap_or_default(),
            limit: self.limit,
        }
    }

    /// The output format asked for.
    pub fn output(&self, output: Output) -> Output {
        if self.json { Output::Json } else { output }
    }

    /// Whether to poll for more.
    pub fn follow(&self) -> bool {
        self.follow
    }
}

/// Prints the trail, then with `--follow` what is added to it.
pub async fn run(
    admin: &mut crate::client::Admin,
    args: &AuditArgs,
    output: Output,
) -> Result<(), tonic::Status> {
    let output = args.output(output);
    let mut request = args.request(SystemTime::now());
    let entries = admin
        .list_audit(request.clone())
        .await?
        .into_inner()
        .entries;
    print!("{}", render(&entries, output, true));
    if !args.follow() {
        return Ok(());
    }
    let mut seen = Seen::default();
    seen.note(&entries);
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(()),
            () = tokio::time::sleep(FOLLOW_EVERY) => {}
        }
        if let Some(since) = seen.since() {
            request.since_unix_ms = since;
        }
        request.limit = 10_000;
        let entries = admin
            .list_audit(request.clone())
            .await?
            .into_inner()
            .entries;
        let new = seen.fresh(entries);
        if !new.is_empty() {
            print!("{}", render(&new, output, false));
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    }
}

/// What `--follow` printed at its newest millisecond: the next poll asks
/// from that millisecond and leaves out what was already printed.
#[derive(Debug, Default)]
struct Seen {
    newest_ms: Option<i64>,
    at_newest: HashSet<String>,
}

impl Seen {
    fn note(&mut self, entries: &[api::AuditEntry]) {
        for entry in entries {
            let Some(ms) = entry_ms(entry) else { continue };
            if self.newest_ms.is_none_or(|newest| ms > newest) {
                self.newest_ms = Some(ms);
                self.at_newest.clear();
            }
            if Some(ms) == self.newest_ms {
                self.at_newest.insert(line(entry));
            }
        }
    }

    fn since(&self) -> Option<i64> {
        self.newest_ms
    }

    fn fresh(&mut self, entries: Vec<api::AuditEntry>) -> Vec<api::AuditEntry> {
        let newest = self.newest_ms;
        let fresh: Vec<_> = entries
            .into_iter()
            .filter(|entry| {
                let ms = entry_ms(entry);
                !(ms.is_some() && ms == newest && self.at_newest.contains(&line(entry)))
                    && ms >= newest
            })
            .collect();
        self.note(&fresh);
        fresh
    }
}

fn entry_ms(entry: &api::AuditEntry) -> Option<i64> {
    humantime::parse_rfc3339(&entry.time).ok().map(unix_ms)
}

fn unix_ms(time: SystemTime) -> i64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}

/// One entry as a JSON line, with the field names of `audit.jsonl`.
fn line(entry: &api::AuditEntry) -> String {
    let mut value = json!({
        "time": entry.time,
        "actor": entry.actor,
        "action": entry.action,
        "outcome": entry.outcome,
    });
    for (field, text) in [
        ("source", &entry.source),
        ("target", &entry.target),
        ("reason", &entry.reason),
    ] {
        if !text.is_empty() {
            value[field] = json!(text);
        }
    }
    value.to_string()
}

/// The entries as JSON lines, or as table rows (with the header when
/// `header`); every line ends with a newline.
pub fn render(entries: &[api::AuditEntry], output: Output, header: bool) -> String {
    let mut text = String::new();
    match output {
        Output::Json => {
            for entry in entries {
                text.push_str(&line(entry));
                text.push('\n');
            }
        }
        Output::Table => {
            if header {
                text.push_str(&row(COLUMNS.map(|(name, _)| name.to_owned())));
            }
            for entry in entries {
                let outcome = if entry.reason.is_empty() {
                    entry.outcome.clone()
                } else {
                    format!("{}: {}", entry.outcome, entry.reason)
                };
                let time = entry
                    .time
                    .get(..19)
                    .unwrap_or(&entry.time)
                    .replace('T', " ");
                text.push_str(&row([
                    time,
                    entry.actor.clone(),
                    entry.source.clone(),
                    entry.action.clone(),
                    entry.target.clone(),
                    outcome,
                ]));
            }
            if header && entries.is_empty() {
                text.push_str("(no entries)\n");
            }
        }
    }
    text
}

/// Cells padded or cut (with `…`) to their column's width.
fn row(cells: [String; 6]) -> String {
    let mut line = String::new();
    for (index, (cell, (_, width))) in cells.iter().zip(COLUMNS).enumerate() {
        let count = cell.chars().count();
        let fitted = if count > width {
            let mut cut: String = cell.chars().take(width - 1).collect();
            cut.push('…');
            cut
        } else {
            format!("{cell:<width$}")
        };
        line.push_str(&fitted);
        if index + 1 < COLUMNS.len() {
            line.push(' ');
        }
    }
    line.truncate(line.trim_end().len());
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(time: &str, action: &str, reason: &str) -> api::AuditEntry {
        api::AuditEntry {
            time: time.to_owned(),
            actor: "a-rather-long-client-id".to_owned(),
            source: "[2001:db8::1234]:65535".to_owned(),
            action: action.to_owned(),
            target: "batch".to_owned(),
            outcome: if reason.is_empty() { "ok" } else { "refused" }.to_owned(),
            reason: reason.to_owned(),
        }
    }

    #[test]
    fn the_table_fits_100_columns() {
        let entries = [
            entry("2026-12-04T13:02:11.532Z", "keys.revoke", ""),
            entry(
                "2026-12-04T13:02:12.000Z",
                "keys.list",
                "management permission required",
            ),
        ];
        let text = render(&entries, Output::Table, true);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("TIME (UTC)"));
        assert!(
            lines[1].starts_with("2026-12-04 13:02:11 a-rather-…"),
            "{text}"
        );
        assert!(lines[2].contains("refused: manag"), "{text}");
        for line in lines {
            assert!(line.chars().count() <= 100, "{line}");
        }
    }

    #[test]
    fn json_lines_carry_the_file_fields() {
        let text = render(
            &[entry("2026-12-04T13:02:11.532Z", "keys.revoke", "")],
            Output::Json,
            true,
        );
        let value: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(value["action"], "keys.revoke");
        assert_eq!(value["outcome"], "ok");
        assert!(value.get("reason").is_none());
    }

    #[test]
    fn follow_prints_each_entry_once() {
        let mut seen = Seen::default();
        let first = entry("2026-12-04T13:02:11.532Z", "keys.add", "");
        seen.note(std::slice::from_ref(&first));
        let same_ms = entry("2026-12-04T13:02:11.532Z", "keys.revoke", "");
        let later = entry("2026-12-04T13:02:12.000Z", "queue.pause", "");
        let fresh = seen.fresh(vec![first, same_ms.clone(), later.clone()]);
        assert_eq!(fresh, vec![same_ms.clone(), later.clone()]);
        assert!(seen.fresh(vec![later]).is_empty());
    }
}
