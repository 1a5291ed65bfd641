//! The benchmark, at smoke-test size: `oqp-bench --quick` through its library
//! entry, against this build's `fake-ollama` and `oqp-bench` binaries (oqp
//! runs as `oqp-bench single-box`, the same libraries as
//! `oqp-controlplane --with-dataplane`). It checks that every scenario
//! produced its rows and none failed; the figures themselves mean nothing
//! in a debug build on a shared CI machine.

use clap::Parser;
use oqp_tests::bench::{self, Args, SCENARIOS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_benchmark_reports_every_scenario() {
    let _exclusive = crate::support::exclusive().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("latest.md");
    let args = Args::try_parse_from([
        "oqp-bench",
        "--quick",
        "--oqp-self",
        "--fake-bin",
        env!("CARGO_BIN_EXE_fake-ollama"),
        "--bench-bin",
        env!("CARGO_BIN_EXE_oqp-bench"),
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap();
    let table = bench::run(args).await.expect("the benchmark runs");
    println!("{table}");

    let rows: Vec<&str> = table
        .lines()
        .filter(|line| line.starts_with("| "))
        .collect();
    for scenario in SCENARIOS {
        let prefix = format!("| {scenario} |");
        let mine: Vec<&&str> = rows.iter().filter(|row| row.starts_with(&prefix)).collect();
        assert!(!mine.is_empty(), "no row for {scenario:?}");
        for row in mine {
            assert!(!row.contains("not run: error"), "{scenario} failed: {row}");
        }
    }
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        table,
        "the table is written to --out"
    );
}
