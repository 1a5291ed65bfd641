//! Translation: what Ollama's API costs in front of an OpenAI-compatible engine. One oqp whose
//! only host is the fake as `kind: openai` (its OpenAI-compatible layer plays the engine): the
//! same streamed chat sent as `/api/chat` (translated to `/v1/chat/completions`, its SSE
//! rewritten to NDJSON line by line) and as `/v1/chat/completions` (passed through), one at a
//! time, alternating, so that each translated sample has a native one taken moments before or
//! after it. The time to the first body byte (the median of paired differences), and the same
//! for the first line with content: the fake (like OpenAI) writes a role-only event on its own
//! before the first token, the native route's first byte, which the translation answers at once
//! with an opening line of nothing (a llama-server writes the role with its first token, and
//! there the first content line is the first byte on both routes). Then, with tokens 20 ms
//! apart and each token stamped by the fake with the moment it wrote it (`--stamp-tokens`), how
//! late each content line arrives after its token was written, per route, and how much later a
//! translated line is than the native one of its place: each line timed from its own stamp, so
//! that the fake's timer (a stream's tokens come when its own sleeps end) is not in the pairing.

use std::time::Duration;

use serde_json::Value;

use super::{ADMIN_KEY, OqpConfig, USER_KEY, seconds, size};
use crate::bench::load::{Conn, Line, Req};
use crate::bench::procs::{self, FakeSpec};
use crate::bench::report::{self, Report, Row};
use crate::bench::stats::{Spread, max, median, micros, percentile};
use crate::bench::{Bench, SCENARIO_TRANSLATE};

/// The first-byte target: the translation adds at most this over the native route, p50, µs.
const FIRST_BYTE_TARGET_US: f64 = 50.0;
/// The line target: no translated line later than this behind the native one, ms.
const LINE_TARGET_MS: f64 = 1.0;

const CHAT: &str =
    r#"{"model":"llama3","messages":[{"role":"user","content":"Why is the sky blue?"}]}"#;

fn native() -> Req {
    Req::post(
        "/v1/chat/completions",
        Some(USER_KEY),
        r#"{"model":"llama3","messages":[{"role":"user","content":"Why is the sky blue?"}],"stream":true}"#,
    )
}

fn translated() -> Req {
    Req::post("/api/chat", Some(USER_KEY), CHAT)
}

/// Runs both measures and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let first_byte = {
        let fake = procs::spawn_fake(&bench.binaries, FakeSpec::default()).await?;
        let result = first_bytes(bench, &fake.url()).await;
        fake.stop().await;
        result?
    };
    let gap = seconds(bench, 0.02, 0.02);
    let spec = FakeSpec {
        token_interval: gap,
        tokens: size(bench, 10, 5),
        stamp_tokens: true,
        ..FakeSpec::default()
    };
    let lines = {
        let fake = procs::spawn_fake(&bench.binaries, spec).await?;
        let result = line_delays(bench, &fake.url()).await;
        fake.stop().await;
        result?
    };
    push_rows(report, &first_byte, &lines);
    Ok(())
}

/// oqp in front of the fake as an engine, once it lists the fake's models (the translation
/// applies from then on).
async fn engine_oqp(bench: &Bench, upstream: &str) -> anyhow::Result<procs::Proc> {
    let config = OqpConfig {
        kind: Some("openai"),
        ..OqpConfig::new(upstream, 64)
    };
    let oqp = procs::spawn_oqp(&bench.binaries, &config.render()).await?;
    let mut conn = Conn::open(oqp.addr()).await?;
    let status = Req::get("/queue/status", Some(ADMIN_KEY));
    for _ in 0..600 {
        let answer = conn.send(&status).await?;
        let listed = serde_json::from_slice::<Value>(&answer.body)
            .ok()
            .and_then(|status| status["hosts"][0]["models"].as_array().cloned())
            .is_some_and(|models| !models.is_empty());
        if listed {
            return Ok(oqp);
        }
        // The control plane's first poll of the engine has no event to wait on from here.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    oqp.stop().await;
    anyhow::bail!("oqp never listed the engine's models")
}

/// Per-round p50 of each route's first byte, and the per-round medians of paired differences.
#[derive(Debug, Default)]
struct FirstBytes {
    native: Vec<f64>,
    translated: Vec<f64>,
    added: Vec<f64>,
    /// Per-round medians of paired differences of the first line with content.
    content_added: Vec<f64>,
    failures: usize,
}

async fn first_bytes(bench: &Bench, upstream: &str) -> anyhow::Result<FirstBytes> {
    let oqp = engine_oqp(bench, upstream).await?;
    let result = async {
        let per_round = size(bench, 1500, 40);
        let mut conns = [Conn::open(oqp.addr()).await?, Conn::open(oqp.addr()).await?];
        let requests = [native(), translated()];
        for (conn, request) in conns.iter_mut().zip(&requests) {
            for _ in 0..size(bench, 200, 5) {
                conn.send(request).await?;
            }
        }
        let mut figures = FirstBytes::default();
        for round in 0..bench.rounds {
            let mut samples: [Vec<f64>; 2] = Default::default();
            let mut content: [Vec<f64>; 2] = Default::default();
            let is_content: [fn(&str) -> Option<String>; 2] = [native_content, translated_content];
            for i in 0..per_round {
                let order = if (i + round) % 2 == 0 { [0, 1] } else { [1, 0] };
                for which in order {
                    let (start, lines) = conns[which].lines(&requests[which]).await?;
                    let first = lines.first().map(|line| line.at.duration_since(start));
                    let first_content = lines
                        .iter()
                        .find(|line| is_content[which](&line.text).is_some())
                        .map(|line| line.at.duration_since(start));
                    match (first, first_content) {
                        (Some(first), Some(first_content)) => {
                            samples[which].push(micros(first));
                            content[which].push(micros(first_content));
                        }
                        _ => figures.failures += 1,
                    }
                }
            }
            let content_diffs: Vec<f64> = content[1]
                .iter()
                .zip(&content[0])
                .map(|(translated, native)| translated - native)
                .collect();
            figures.content_added.extend(median(&content_diffs));
            figures.native.extend(percentile(&samples[0], 50.0));
            figures.translated.extend(percentile(&samples[1], 50.0));
            let diffs: Vec<f64> = samples[1]
                .iter()
                .zip(&samples[0])
                .map(|(translated, native)| translated - native)
                .collect();
            figures.added.extend(median(&diffs));
        }
        anyhow::Ok(figures)
    }
    .await;
    oqp.stop().await;
    result
}

/// How late each content line arrived after the fake wrote its token (its stamp), ms, per
/// route; how much later each translated line was than the native event of its place; and
/// the streams that did not pair up.
#[derive(Debug, Default)]
struct LineDelays {
    native: Vec<f64>,
    translated: Vec<f64>,
    delays: Vec<f64>,
    unpaired: usize,
}

async fn line_delays(bench: &Bench, upstream: &str) -> anyhow::Result<LineDelays> {
    let oqp = engine_oqp(bench, upstream).await?;
    let result = async {
        let mut conn = Conn::open(oqp.addr()).await?;
        let mut figures = LineDelays::default();
        for i in 0..size(bench, 60, 6) {
            // The order alternates, so that neither route is always the one a pause follows.
            let (native_lines, translated_lines) = if i % 2 == 0 {
                let native = conn.lines(&native()).await?.1;
                (native, conn.lines(&translated()).await?.1)
            } else {
                let translated = conn.lines(&translated()).await?.1;
                (conn.lines(&native()).await?.1, translated)
            };
            let native_late = lateness(&native_lines, native_content);
            let translated_late = lateness(&translated_lines, translated_content);
            figures.native.extend(&native_late);
            figures.translated.extend(&translated_late);
            if native_late.len() != translated_late.len() || native_late.is_empty() {
                figures.unpaired += 1;
                continue;
            }
            figures.delays.extend(
                translated_late
                    .iter()
                    .zip(&native_late)
                    .map(|(translated, native)| translated - native),
            );
        }
        anyhow::Ok(figures)
    }
    .await;
    oqp.stop().await;
    result
}

/// How late each content line `content` finds arrived after the fake stamped its token
/// (`…@<Unix ns>`), ms, on this machine's wall clock.
fn lateness(lines: &[Line], content: fn(&str) -> Option<String>) -> Vec<f64> {
    lines
        .iter()
        .filter_map(|line| {
            let text = content(&line.text)?;
            let nanos: u64 = text.rsplit_once('@')?.1.parse().ok()?;
            let sent = std::time::UNIX_EPOCH + Duration::from_nanos(nanos);
            Some(match line.wall.duration_since(sent) {
                Ok(late) => late.as_secs_f64() * 1e3,
                // Received "before" it was sent: clock noise of a few µs.
                Err(early) => -early.duration().as_secs_f64() * 1e3,
            })
        })
        .collect()
}

/// An SSE event's content delta, when it has one.
fn native_content(line: &str) -> Option<String> {
    let event: Value = serde_json::from_str(line.strip_prefix("data: ")?).ok()?;
    let content = event["choices"][0]["delta"]["content"].as_str()?;
    (!content.is_empty()).then(|| content.to_owned())
}

/// An NDJSON line's content (not the last line, nor an opening line of nothing).
fn translated_content(line: &str) -> Option<String> {
    let line: Value = serde_json::from_str(line).ok()?;
    let content = line["message"]["content"].as_str()?;
    (line["done"] == false && !content.is_empty()).then(|| content.to_owned())
}

fn push_rows(report: &mut Report, first: &FirstBytes, lines: &LineDelays) {
    let failures = if first.failures > 0 {
        format!(" — {} non-2xx answers", first.failures)
    } else {
        String::new()
    };
    report.push(
        Row::new(
            SCENARIO_TRANSLATE,
            format!("streamed chat, first byte p50: /v1/chat/completions (minimal column) vs /api/chat translated (oqp column){failures}"),
        )
        .minimal(report::micros(Spread::of(&first.native)))
        .oqp(report::micros(Spread::of(&first.translated))),
    );
    let added = Spread::of(&first.added);
    report.push(
        Row::new(
            SCENARIO_TRANSLATE,
            "translated /api/chat first byte: added over /v1/chat/completions, median of paired differences",
        )
        .oqp(report::signed_micros(added))
        .target(
            &format!("≤ +{FIRST_BYTE_TARGET_US:.0} µs"),
            added.map(|added| added.median <= FIRST_BYTE_TARGET_US && first.failures == 0),
        ),
    );
    let content_added = Spread::of(&first.content_added);
    report.push(
        Row::new(
            SCENARIO_TRANSLATE,
            "translated /api/chat first content line: added over the first /v1/chat/completions event with content, median of paired differences",
        )
        .oqp(report::signed_micros(content_added))
        .target(
            &format!("≤ +{FIRST_BYTE_TARGET_US:.0} µs"),
            content_added.map(|added| added.median <= FIRST_BYTE_TARGET_US && first.failures == 0),
        ),
    );
    let worst = max(&lines.delays);
    let unpaired = if lines.unpaired > 0 {
        format!(" — {} streams did not pair", lines.unpaired)
    } else {
        String::new()
    };
    let spread = |samples: &[f64]| match (percentile(samples, 50.0), max(samples)) {
        (Some(p50), Some(worst)) => format!(
            "p50 {p50:+.2} ms, p99 {:+.2} ms, max {worst:+.2} ms ({} lines)",
            percentile(samples, 99.0).unwrap_or(worst),
            samples.len()
        ),
        _ => report::na(),
    };
    report.push(
        Row::new(
            SCENARIO_TRANSLATE,
            "stream lines, 20 ms apart: arrival after the engine wrote the token (its stamp), /v1/chat/completions (minimal column) vs /api/chat translated (oqp column)",
        )
        .minimal(spread(&lines.native))
        .oqp(spread(&lines.translated)),
    );
    report.push(
        Row::new(
            SCENARIO_TRANSLATE,
            format!("translated stream lines: later than the native event of the same place, each timed from its own token's stamp{unpaired}"),
        )
        .oqp(spread(&lines.delays))
        .target(
            &format!("every line < {LINE_TARGET_MS:.0} ms late"),
            worst.map(|worst| worst < LINE_TARGET_MS && lines.unpaired == 0),
        ),
    );
}
