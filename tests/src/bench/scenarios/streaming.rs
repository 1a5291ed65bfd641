//! Streaming: time to first line, and how late each line arrives. The fake
//! stamps every NDJSON line's `created_at` with the moment it sends it
//! (RFC 3339, nanoseconds), so a line's delay is the client's receive time
//! minus that stamp, on the same machine's clock. Tokens are 500 ms apart,
//! so a proxy that buffers shows at once.

use std::time::Duration;

use super::{Target, Trio, USER_KEY, seconds, size};
use crate::bench::load::{Conn, Line, Req};
use crate::bench::procs::FakeSpec;
use crate::bench::report::{self, Report, Row};
use crate::bench::stats::{Spread, max, parse_rfc3339, percentile};
use crate::bench::{Bench, SCENARIO_STREAMING};

/// The target: every line less than this late through oqp, in ms.
const TARGET_MS: f64 = 5.0;

/// Per-target samples.
#[derive(Debug, Default)]
struct Samples {
    /// Time to first line per stream, ms.
    first: [Vec<f64>; 3],
    /// Delay of every line, ms.
    delay: [Vec<f64>; 3],
    /// Per-round p50 of the time to first line.
    first_rounds: [Vec<f64>; 3],
    incomplete: usize,
}

/// Runs the streams and adds the rows.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let gap = seconds(bench, 0.5, 0.05);
    let tokens = size(bench, 6, 3);
    let spec = FakeSpec {
        token_interval: gap,
        tokens,
        ..FakeSpec::default()
    };
    let trio = Trio::start(bench, spec, 64).await?;
    let result = streams(bench, &trio, tokens).await;
    trio.stop().await;
    let samples = result?;
    push_rows(report, &samples, gap, tokens);
    Ok(())
}

async fn streams(bench: &Bench, trio: &Trio, tokens: usize) -> anyhow::Result<Samples> {
    let per_target = size(bench, 4, 1);
    let request = Req::post(
        "/api/generate",
        Some(USER_KEY),
        r#"{"model":"llama3","prompt":"Tell me a story.","stream":true}"#,
    );
    let mut samples = Samples::default();
    for round in 0..bench.rounds.min(3) {
        // Every stream of the round at once: they are idle most of the time.
        let mut tasks = Vec::new();
        for target in Target::rotated(round) {
            for _ in 0..per_target {
                let addr = trio.addr(target);
                let request = request.clone();
                tasks.push(tokio::spawn(async move {
                    let mut conn = Conn::open(addr).await?;
                    let (started, lines) = conn.lines(&request).await?;
                    anyhow::Ok((target, started, lines))
                }));
            }
        }
        let mut firsts: [Vec<f64>; 3] = Default::default();
        for task in tasks {
            let (target, started, lines) = task.await??;
            let i = target.index();
            if lines.len() != tokens + 1 {
                samples.incomplete += 1;
            }
            if let Some(first) = lines.first() {
                let ms = (first.at - started).as_secs_f64() * 1e3;
                samples.first[i].push(ms);
                firsts[i].push(ms);
            }
            samples.delay[i].extend(lines.iter().filter_map(line_delay_ms));
        }
        for target in Target::ALL {
            let i = target.index();
            samples.first_rounds[i].extend(percentile(&firsts[i], 50.0));
        }
    }
    Ok(samples)
}

/// How late a line arrived: receive time minus the sender's stamp, in ms.
pub(crate) fn line_delay_ms(line: &Line) -> Option<f64> {
    let value: serde_json::Value = serde_json::from_str(&line.text).ok()?;
    let sent = parse_rfc3339(value.get("created_at")?.as_str()?)?;
    Some(match line.wall.duration_since(sent) {
        Ok(late) => late.as_secs_f64() * 1e3,
        // Received "before" it was sent: clock noise of a few µs.
        Err(early) => -early.duration().as_secs_f64() * 1e3,
    })
}

fn push_rows(report: &mut Report, samples: &Samples, gap: Duration, tokens: usize) {
    let incomplete = if samples.incomplete > 0 {
        format!(" — {} incomplete streams", samples.incomplete)
    } else {
        String::new()
    };
    let first = |t: Target| report::millis(Spread::of(&samples.first_rounds[t.index()]));
    report.push(
        Row::new(
            SCENARIO_STREAMING,
            format!(
                "time to first line, p50 ({tokens} tokens {} ms apart){incomplete}",
                gap.as_millis()
            ),
        )
        .cells(
            first(Target::Direct),
            first(Target::Minimal),
            first(Target::Oqp),
        ),
    );
    let delay = |t: Target, p: f64| {
        report::millis(percentile(&samples.delay[t.index()], p).map(Spread::single))
    };
    report.push(Row::new(SCENARIO_STREAMING, "per-line delay, p50").cells(
        delay(Target::Direct, 50.0),
        delay(Target::Minimal, 50.0),
        delay(Target::Oqp, 50.0),
    ));
    report.push(Row::new(SCENARIO_STREAMING, "per-line delay, p99").cells(
        delay(Target::Direct, 99.0),
        delay(Target::Minimal, 99.0),
        delay(Target::Oqp, 99.0),
    ));
    let worst = |t: Target| max(&samples.delay[t.index()]);
    let oqp_worst = worst(Target::Oqp);
    report.push(
        Row::new(
            SCENARIO_STREAMING,
            format!(
                "per-line delay, worst of {} lines",
                samples.delay[Target::Oqp.index()].len()
            ),
        )
        .cells(
            report::millis(worst(Target::Direct).map(Spread::single)),
            report::millis(worst(Target::Minimal).map(Spread::single)),
            report::millis(oqp_worst.map(Spread::single)),
        )
        .target(
            &format!("every oqp line < {TARGET_MS:.0} ms late"),
            oqp_worst.map(|worst| worst < TARGET_MS && samples.incomplete == 0),
        ),
    );
}
