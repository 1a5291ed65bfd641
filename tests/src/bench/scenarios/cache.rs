//! Embedding cache: the latency of a hit (memory and Redis backends) against
//! an upstream call. The fake answers embeddings at once (no service time),
//! so the comparison is of mechanisms, not of a GPU: a hit must cost less
//! than a round trip to Ollama that does no work.
//!
//! The cache is on when oqp's answers carry `X-Cache`; without it the rows
//! say "n/a". The Redis variant starts `redis-server` on a free port.

use super::{OqpConfig, USER_KEY, embed, size};
use crate::bench::load::Conn;
use crate::bench::procs::{self, FakeSpec, Proc};
use crate::bench::report::{self, Report, Row};
use crate::bench::stats::{Spread, micros, percentile};
use crate::bench::{Bench, SCENARIO_CACHE_MEMORY, SCENARIO_CACHE_REDIS};

/// Runs both backends.
pub async fn run(bench: &Bench, report: &mut Report) -> anyhow::Result<()> {
    if let Err(error) = backend(bench, report, SCENARIO_CACHE_MEMORY, None).await {
        report.not_run(SCENARIO_CACHE_MEMORY, &format!("{error:#}"));
    }
    if !procs::on_path("redis-server") {
        report.not_run(SCENARIO_CACHE_REDIS, "redis-server is not installed");
        return Ok(());
    }
    let redis = procs::spawn_redis().await?;
    let result = backend(bench, report, SCENARIO_CACHE_REDIS, Some(&redis)).await;
    redis.stop().await;
    if let Err(error) = result {
        report.not_run(SCENARIO_CACHE_REDIS, &format!("{error:#}"));
    }
    Ok(())
}

async fn backend(
    bench: &Bench,
    report: &mut Report,
    scenario: &str,
    redis: Option<&Proc>,
) -> anyhow::Result<()> {
    let fake = procs::spawn_fake(&bench.binaries, FakeSpec::default()).await?;
    let mut config = OqpConfig::new(&fake.url(), 64);
    config.cache = Some(match redis {
        Some(redis) => format!("redis://{}/0", redis.addr()),
        None => "memory".to_owned(),
    });
    let oqp = match procs::spawn_oqp(&bench.binaries, &config.render()).await {
        Ok(oqp) => oqp,
        Err(error) => {
            fake.stop().await;
            return Err(error);
        }
    };
    let result = measure(bench, &fake, &oqp).await;
    oqp.stop().await;
    fake.stop().await;
    match result? {
        Some(figures) => push_rows(report, scenario, &figures),
        None => {
            let row = |figure: &str| {
                Row::new(scenario, figure)
                    .direct(report::na())
                    .oqp("n/a (no `X-Cache` header: the embedding cache is not active)".into())
            };
            report.push(row("hit, p50 / p99"));
            report.push(row("upstream call, p50 / p99"));
        }
    }
    Ok(())
}

/// Samples in µs.
#[derive(Debug, Default)]
struct Figures {
    hit: Vec<f64>,
    miss: Vec<f64>,
    direct: Vec<f64>,
    not_hits: usize,
}

async fn measure(bench: &Bench, fake: &Proc, oqp: &Proc) -> anyhow::Result<Option<Figures>> {
    let mut through = Conn::open(oqp.addr()).await?;
    let mut direct = Conn::open(fake.addr()).await?;
    let hot = embed(USER_KEY, "a sentence everybody embeds");
    let first = through.send(&hot).await?;
    if !first.headers.contains_key("x-cache") {
        return Ok(None);
    }
    let count = size(bench, 2000, 30);
    let mut figures = Figures::default();
    // Warm both paths; the hot entry is stored by now.
    for i in 0..size(bench, 100, 3) {
        through.send(&hot).await?;
        direct.send(&embed(USER_KEY, &format!("warm {i}"))).await?;
    }
    let run = std::process::id();
    for i in 0..count {
        let (took, answer) = through.timed(&hot).await?;
        if answer.headers.get("x-cache").and_then(|v| v.to_str().ok()) != Some("HIT") {
            figures.not_hits += 1;
        }
        figures.hit.push(micros(took));
        // A new input each time: a miss, answered by the upstream.
        let cold = embed(USER_KEY, &format!("cold {run} {i}"));
        let (took, _) = through.timed(&cold).await?;
        figures.miss.push(micros(took));
        let (took, _) = direct.timed(&cold).await?;
        figures.direct.push(micros(took));
    }
    Ok(Some(figures))
}

fn push_rows(report: &mut Report, scenario: &str, figures: &Figures) {
    let pair = |samples: &[f64]| match (percentile(samples, 50.0), percentile(samples, 99.0)) {
        (Some(p50), Some(p99)) => format!("{p50:.0} / {p99:.0} µs"),
        _ => report::na(),
    };
    let not_hits = if figures.not_hits > 0 {
        format!(" — {} answers were not `X-Cache: HIT`", figures.not_hits)
    } else {
        String::new()
    };
    report.push(Row::new(scenario, format!("hit, p50 / p99{not_hits}")).oqp(pair(&figures.hit)));
    report.push(
        Row::new(
            scenario,
            "upstream call (miss through oqp; direct), p50 / p99",
        )
        .direct(pair(&figures.direct))
        .oqp(pair(&figures.miss)),
    );
    let saved = |a: &[f64], b: &[f64]| Some(percentile(a, 50.0)? - percentile(b, 50.0)?);
    if let Some(saved) = saved(&figures.miss, &figures.hit) {
        report.push(
            Row::new(scenario, "hit − miss through oqp, p50")
                .oqp(report::signed_micros(Some(Spread::single(-saved)))),
        );
    }
}
