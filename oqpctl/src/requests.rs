//! `oqpctl requests`: reads the request log (`logging.requests`) where it is written, on a
//! data plane's machine: the day files beside `--file` (or `OQP_REQUEST_LOG`) for the period
//! asked, filtered by client, as a table or as the log's own JSON lines. It needs no control
//! plane.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::render::{Output, Style};

/// `oqpctl requests`'s arguments.
#[derive(Debug, clap::Args)]
pub struct RequestsArgs {
    /// The request log's path as `logging.requests.file` names it (the day files beside it
    /// are read).
    #[arg(long, env = "OQP_REQUEST_LOG")]
    file: PathBuf,
    /// Only this client's requests (an app also shows its users').
    #[arg(long)]
    client: Option<String>,
    /// Only requests this recent (e.g. 15m, 1h, 7d).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1h")]
    since: Duration,
}

/// Prints the requests `args` selects.
pub fn run(args: &RequestsArgs, output: Output, style: Style) -> anyhow::Result<()> {
    let now = SystemTime::now();
    let from = now
        .checked_sub(args.since)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let cutoff = humantime::format_rfc3339_millis(from).to_string();
    let mut selected = Vec::new();
    let mut found = false;
    for path in day_files(&args.file, from, now) {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        found = true;
        selected.extend(select(text.lines(), args.client.as_deref(), &cutoff));
    }
    if !found {
        anyhow::bail!(
            "no request log for the period beside {} (is logging.requests on, and is this \
             the data plane's machine?)",
            args.file.display()
        );
    }
    println!("{}", render(&selected, output, style));
    Ok(())
}

/// The day files of `file` from `from`'s UTC day to `to`'s, oldest first.
fn day_files(file: &Path, from: SystemTime, to: SystemTime) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut at = from;
    loop {
        let day = humantime::format_rfc3339_seconds(at).to_string();
        files.push(day_file(file, &day[..10]));
        if at >= to {
            break;
        }
        at = (at + Duration::from_secs(86_400)).min(to);
    }
    files.dedup();
    files
}

/// The day file of `file` for `day`: the date before the extension (as the data plane names
/// it).
fn day_file(file: &Path, day: &str) -> PathBuf {
    let stem = file
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match file.extension() {
        Some(extension) => format!("{stem}.{day}.{}", extension.to_string_lossy()),
        None => format!("{stem}.{day}"),
    };
    file.with_file_name(name)
}

/// The lines at or after `cutoff` (RFC 3339, as the log writes times) of `client` (or its
/// users), parsed; lines that are not JSON are skipped.
fn select<'a>(
    lines: impl Iterator<Item = &'a str>,
    client: Option<&str>,
    cutoff: &str,
) -> Vec<Value> {
    lines
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|entry| entry["time"].as_str().is_some_and(|time| time >= cutoff))
        .filter(|entry| {
            client.is_none_or(|wanted| {
                entry["client"].as_str().is_some_and(|id| {
                    id.strip_prefix(wanted)
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
                })
            })
        })
        .collect()
}

fn render(entries: &[Value], output: Output, style: Style) -> String {
    if output == Output::Json {
        return entries
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n");
    }
    let mut table = crate::render::table(
        style,
        &[
            "time (UTC)",
            "client",
            "route",
            "model",
            "status",
            "wait ms",
            "ms",
            "tokens",
            "host / error",
        ],
    );
    let text = |value: &Value| match value {
        Value::Null => "-".to_owned(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    for entry in entries {
        let time = text(&entry["time"]);
        let tokens = match (&entry["prompt_tokens"], &entry["completion_tokens"]) {
            (Value::Null, Value::Null) => "-".to_owned(),
            (prompt, completion) => format!("{} + {}", text(prompt), text(completion)),
        };
        let host_or_error = if entry["error"].is_null() {
            text(&entry["host"])
        } else {
            text(&entry["error"])
        };
        table.add_row(vec![
            time.get(..19).unwrap_or(&time).replace('T', " "),
            text(&entry["client"]),
            text(&entry["route"]),
            text(&entry["model"]),
            text(&entry["status"]),
            text(&entry["queue_wait_ms"]),
            text(&entry["duration_ms"]),
            tokens,
            host_or_error,
        ]);
    }
    table.to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_period_reads_each_day_file_once() {
        let file = Path::new("/var/log/oqp/requests.jsonl");
        let at = |text: &str| humantime::parse_rfc3339(text).unwrap();
        assert_eq!(
            day_files(file, at("2026-12-03T23:00:00Z"), at("2026-12-04T01:00:00Z")),
            [
                PathBuf::from("/var/log/oqp/requests.2026-12-03.jsonl"),
                PathBuf::from("/var/log/oqp/requests.2026-12-04.jsonl"),
            ]
        );
        assert_eq!(
            day_files(file, at("2026-12-04T00:10:00Z"), at("2026-12-04T01:00:00Z")).len(),
            1
        );
    }

    #[test]
    fn a_client_and_its_users_since_the_cutoff() {
        let lines = [
            r#"{"time":"2026-12-04T10:00:00.000Z","client":"webui/ada","status":200,"host":"gpu-a","prompt_tokens":3,"completion_tokens":4}"#,
            r#"{"time":"2026-12-04T09:00:00.000Z","client":"webui","status":200}"#,
            r#"{"time":"2026-12-04T10:30:00.000Z","client":"webui2","status":200}"#,
            r#"{"time":"2026-12-04T10:40:00.000Z","client":"webui","status":429,"error":"rate limit exceeded: 1 requests per minute"}"#,
            "not json",
        ];
        let selected = select(lines.into_iter(), Some("webui"), "2026-12-04T09:30:00.000Z");
        assert_eq!(selected.len(), 2);
        assert_eq!(selected[0]["client"], "webui/ada");
        assert_eq!(selected[1]["status"], 429);
        assert_eq!(select(lines.into_iter(), None, "").len(), 4);
        let table = render(&selected, Output::Table, Style::PLAIN);
        assert!(table.contains("2026-12-04 10:00:00"), "{table}");
        assert!(
            table.contains("3 + 4") && table.contains("gpu-a"),
            "{table}"
        );
        assert!(table.contains("rate limit exceeded"), "{table}");
        let json = render(&selected, Output::Json, Style::PLAIN);
        assert_eq!(json.lines().count(), 2);
    }
}
