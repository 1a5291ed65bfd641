//! The benchmark's one output: a Markdown table (one row per figure, a
//! column per target: direct to the fake, through the minimal proxy, through
//! oqp), a verdict per target figure, and the notes that say how it was
//! measured. Also the formatting of figures.

use std::fmt::Write as _;

use super::stats::Spread;

/// Whether a figure meets its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No target for this figure.
    None,
    /// Met.
    Met,
    /// Not met.
    NotMet,
    /// A target, but no figure to judge.
    Unknown,
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// The scenario (a name from [`super::SCENARIOS`]).
    pub scenario: String,
    /// What is measured.
    pub figure: String,
    /// Direct to the fake.
    pub direct: String,
    /// Through the minimal proxy.
    pub minimal: String,
    /// Through oqp.
    pub oqp: String,
    /// The target, if any.
    pub target: String,
    /// The verdict.
    pub verdict: Verdict,
}

/// The whole report.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Lines above the table.
    pub header: Vec<String>,
    /// The rows.
    pub rows: Vec<Row>,
    /// Lines below the table.
    pub notes: Vec<String>,
}

impl Row {
    /// A row without a target.
    pub fn new(scenario: &str, figure: impl Into<String>) -> Row {
        Row {
            scenario: scenario.to_owned(),
            figure: figure.into(),
            direct: "—".to_owned(),
            minimal: "—".to_owned(),
            oqp: "—".to_owned(),
            target: String::new(),
            verdict: Verdict::None,
        }
    }

    /// Sets the three cells.
    pub fn cells(mut self, direct: String, minimal: String, oqp: String) -> Row {
        self.direct = direct;
        self.minimal = minimal;
        self.oqp = oqp;
        self
    }

    /// Sets the oqp cell.
    pub fn oqp(mut self, oqp: String) -> Row {
        self.oqp = oqp;
        self
    }

    /// Sets the direct cell.
    pub fn direct(mut self, direct: String) -> Row {
        self.direct = direct;
        self
    }

    /// Sets the minimal cell.
    pub fn minimal(mut self, minimal: String) -> Row {
        self.minimal = minimal;
        self
    }

    /// A target and whether `met` (None: no figure to judge).
    pub fn target(mut self, target: &str, met: Option<bool>) -> Row {
        self.target = target.to_owned();
        self.verdict = match met {
            Some(true) => Verdict::Met,
            Some(false) => Verdict::NotMet,
            None => Verdict::Unknown,
        };
        self
    }
}

impl Report {
    /// Adds a row.
    pub fn push(&mut self, row: Row) {
        self.rows.push(row);
    }

    /// A row for a scenario that could not run, with the reason in every cell.
    pub fn not_run(&mut self, scenario: &str, reason: &str) {
        let reason = reason.replace('|', "/").replace('\n', " ");
        self.push(Row::new(scenario, format!("not run: {reason}")).cells(
            "n/a".into(),
            "n/a".into(),
            "n/a".into(),
        ));
    }

    /// The Markdown text.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        for line in &self.header {
            let _ = writeln!(out, "{line}");
        }
        out.push('\n');
        out.push_str("| scenario | figure | direct | minimal proxy | oqp | target | verdict |\n");
        out.push_str("| --- | --- | ---: | ---: | ---: | --- | --- |\n");
        for row in &self.rows {
            let verdict = match row.verdict {
                Verdict::None => "",
                Verdict::Met => "met",
                Verdict::NotMet => "**not met**",
                Verdict::Unknown => "n/a",
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                row.scenario, row.figure, row.direct, row.minimal, row.oqp, row.target, verdict
            );
        }
        if !self.notes.is_empty() {
            out.push('\n');
            for line in &self.notes {
                let _ = writeln!(out, "{line}");
            }
        }
        out
    }

    /// The targets, counted: (met, not met, unknown).
    pub fn verdicts(&self) -> (usize, usize, usize) {
        let count = |verdict| self.rows.iter().filter(|r| r.verdict == verdict).count();
        (
            count(Verdict::Met),
            count(Verdict::NotMet),
            count(Verdict::Unknown),
        )
    }
}

/// `123 µs (118–131)`: median over rounds and the range.
pub fn micros(spread: Option<Spread>) -> String {
    spread.map_or_else(na, |s| {
        if s.min == s.max {
            format!("{:.0} µs", s.median)
        } else {
            format!("{:.0} µs ({:.0}–{:.0})", s.median, s.min, s.max)
        }
    })
}

/// `+12 µs (9–15)`: a signed difference.
pub fn signed_micros(spread: Option<Spread>) -> String {
    spread.map_or_else(na, |s| {
        if s.min == s.max {
            format!("{:+.0} µs", s.median)
        } else {
            format!("{:+.0} µs ({:+.0}…{:+.0})", s.median, s.min, s.max)
        }
    })
}

/// `1.23 ms (1.20–1.31)`.
pub fn millis(spread: Option<Spread>) -> String {
    spread.map_or_else(na, |s| {
        if s.min == s.max {
            format!("{:.2} ms", s.median)
        } else {
            format!("{:.2} ms ({:.2}–{:.2})", s.median, s.min, s.max)
        }
    })
}

/// `12 345/s (12 001–12 800)`.
pub fn rate(spread: Option<Spread>) -> String {
    spread.map_or_else(na, |s| {
        if s.min == s.max {
            format!("{:.0}/s", s.median)
        } else {
            format!("{:.0}/s ({:.0}–{:.0})", s.median, s.min, s.max)
        }
    })
}

/// `0.83× (0.80–0.85)`.
pub fn ratio(spread: Option<Spread>) -> String {
    spread.map_or_else(na, |s| {
        if s.min == s.max {
            format!("{:.3}", s.median)
        } else {
            format!("{:.3} ({:.3}–{:.3})", s.median, s.min, s.max)
        }
    })
}

/// `12.3 MiB`.
pub fn mib(kib: Option<u64>) -> String {
    kib.map_or_else(na, |kib| format!("{:.1} MiB", kib as f64 / 1024.0))
}

/// `n/a`.
pub fn na() -> String {
    "n/a".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_table_with_verdicts() {
        let mut report = Report::default();
        report.header.push("# Bench".into());
        report.push(
            Row::new("fairness", "Jain's index")
                .cells("0.727".into(), "—".into(), "0.999".into())
                .target("≥ 0.99", Some(true)),
        );
        report.not_run("cache hit, redis", "redis-server | missing");
        let text = report.to_markdown();
        assert!(text.contains("| fairness | Jain's index | 0.727 | — | 0.999 | ≥ 0.99 | met |"));
        assert!(text.contains("| cache hit, redis | not run: redis-server / missing |"));
        assert_eq!(report.verdicts(), (1, 0, 0));
        assert_eq!(
            micros(Some(Spread::of(&[1.0, 3.0, 2.0]).unwrap())),
            "2 µs (1–3)"
        );
    }
}
