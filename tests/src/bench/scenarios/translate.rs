//! Translation: what Ollama's API costs in front of an OpenAI-compatible engine. One oqp whose
//! only host is the fake as `kind: openai` (its OpenAI-compatible layer plays the engine): the
//! same streamed chat sent as `/api/chat` (translated to `/v1/chat/completions`, its SSE
//! rewritten to NDJSON line by line) and as `/v1/chat/completions` (passed through), one at a
//! time, alternating, so that each translated sample has a native one taken moments before or
//! after it. Three figures: the time to the first body byte (the median of paired
//! differences), the same for the first line with content, and, with tokens 20 ms apart, how
//! much later each content line arrives translated than the same event arrives native (paired
//! by the line's place). The first two differ by what the engine sends first: the fake (like
//! OpenAI) writes a role-only event (`delta: {role}`) on its own before the first token, which
//! is the native route's first byte, while Ollama's NDJSON has no line without content, so the
//! translated first byte is the first token's line. A llama-server writes the role event and
//! the first token together: there the first content line is what a client waits for on
//! both routes, and its paired difference is the translation's own cost.

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
            let is_content: [fn(&str) -> bool; 2] = [native_content, translated_content];
            for i in 0..per_round {
                let order = if (i + round) % 2 == 0 { [0, 1] } else { [1, 0] };
                for which in order {
                    let (start, lines) = conns[which].lines(&requests[which]).await?;
                    let first = lines.first().map(|line| line.at.duration_since(start));
                    let first_content = lines
                        .iter()
                        .find(|line| is_content[which](&line.text))
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

/// How much later each translated content line arrived than the native event of its place,
/// counted from each request's start, ms; and the streams that did not pair up.
#[derive(Debug, Default)]
struct LineDelays {
    delays: Vec<f64>,
    unpaired: usize,
}

async fn line_delays(bench: &Bench, upstream: &str) -> anyhow::Result<LineDelays> {
    let oqp = engine_oqp(bench, upstream).await?;
    let result = async {
        let mut conn = Conn::open(oqp.addr()).await?;
        let mut figures = LineDelays::default();
        for i in 0..size(bench, 60, 6) {
            let (native_start, native_lines) = conn.lines(&native()).await?;
            let (translated_start, translated_lines) = conn.lines(&translated()).await?;
            let native_at = offsets(native_start, &native_lines, native_content);
            let translated_at = offsets(translated_start, &translated_lines, translated_content);
            if native_at.len() != translated_at.len() || native_at.is_empty() {
                figures.unpaired += 1;
                continue;
            }
            // The first pair also carries the first-byte difference; from the second on, only
            // what each line adds.
            let skip = usize::from(i % 2 == 0 && native_at.len() > 1);
            figures.delays.extend(
                translated_at
                    .iter()
                    .zip(&native_at)
                    .skip(skip)
                    .map(|(translated, native)| translated - native),
            );
        }
        anyhow::Ok(figures)
    }
    .await;
    oqp.stop().await;
    result
}

/// The arrival of each line `is_content` keeps, ms after `start`.
fn offsets(start: std::time::Instant, lines: &[Line], is_content: fn(&str) -> bool) -> Vec<f64> {
    lines
        .iter()
        .filter(|line| is_content(&line.text))
        .map(|line| line.at.duration_since(start).as_secs_f64() * 1e3)
        .collect()
}

/// An SSE event with a content delta.
fn native_content(line: &str) -> bool {
    line.strip_prefix("data: ")
        .and_then(|data| serde_json::from_str::<Value>(data).ok())
        .and_then(|event| {
            event["choices"][0]["delta"]["content"]
                .as_str()
                .map(|content| !content.is_empty())
        })
        .unwrap_or(false)
}

/// An NDJSON line of content (not the last).
fn translated_content(line: &str) -> bool {
    serde_json::from_str::<Value>(line).is_ok_and(|line| line["done"] == false)
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
    let cell = match (percentile(&lines.delays, 50.0), worst) {
        (Some(p50), Some(worst)) => format!(
            "p50 {p50:+.2} ms, p99 {:+.2} ms, max {worst:+.2} ms ({} lines)",
            percentile(&lines.delays, 99.0).unwrap_or(worst),
            lines.delays.len()
        ),
        _ => report::na(),
    };
    report.push(
        Row::new(
            SCENARIO_TRANSLATE,
            format!("translated stream lines, 20 ms apart: later than the native event of the same place{unpaired}"),
        )
        .oqp(cell)
        .target(
            &format!("every line < {LINE_TARGET_MS:.0} ms late"),
            worst.map(|worst| worst < LINE_TARGET_MS && lines.unpaired == 0),
        ),
    );
}
