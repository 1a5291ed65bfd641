//! The recorded baseline: oqp's figures in µs from an earlier run
//! (`docs/bench-baseline.tsv`, one `scenario<TAB>figure<TAB>µs` per line),
//! so that a run says when a path got slower. Every row whose oqp cell is in
//! µs is compared by its median: more than [`MARGIN_US`] above the baseline
//! is a warning, printed and listed under the table. `--write-baseline`
//! records the run's figures (only the rows it ran).

use std::collections::BTreeMap;
use std::path::Path;

use super::report::Report;

/// How much slower than the baseline a figure may be before it is a warning.
pub const MARGIN_US: f64 = 10.0;

/// Figures by (scenario, figure).
pub type Figures = BTreeMap<(String, String), f64>;

/// The µs figures of `report`'s oqp column.
pub fn figures(report: &Report) -> Figures {
    report
        .rows
        .iter()
        .filter_map(|row| {
            let us = micros_of(&row.oqp)?;
            Some(((row.scenario.clone(), row.figure.clone()), us))
        })
        .collect()
}

/// The median of a cell such as `+26 µs (+25…+30)` or `187 µs (182–196)`.
pub fn micros_of(cell: &str) -> Option<f64> {
    let (number, rest) = cell.split_once(' ')?;
    if !rest.starts_with("µs") {
        return None;
    }
    number.trim_start_matches('+').parse().ok()
}

/// Reads a baseline file (absent: empty).
pub fn read(path: &Path) -> Figures {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Figures::new();
    };
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let scenario = fields.next()?.to_owned();
            let figure = fields.next()?.to_owned();
            let us = fields.next()?.trim().parse().ok()?;
            Some(((scenario, figure), us))
        })
        .collect()
}

/// `old` with `new`'s figures written over it, as the file's text.
pub fn render(old: &Figures, new: &Figures) -> String {
    let mut merged = old.clone();
    merged.extend(new.iter().map(|(key, us)| (key.clone(), *us)));
    let mut text = String::from(
        "# oqp's figures in µs (median), the baseline oqp-bench warns against: scenario, figure, µs\n",
    );
    for ((scenario, figure), us) in merged {
        text.push_str(&format!("{scenario}\t{figure}\t{us:.0}\n"));
    }
    text
}

/// One warning per figure more than [`MARGIN_US`] above its baseline.
pub fn regressions(baseline: &Figures, now: &Figures) -> Vec<String> {
    now.iter()
        .filter_map(|(key, us)| {
            let before = baseline.get(key)?;
            (us - before > MARGIN_US).then(|| {
                format!(
                    "{} — {}: {us:.0} µs against {before:.0} µs in the baseline (+{:.0} µs)",
                    key.0,
                    key.1,
                    us - before
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cells_and_warns_past_the_margin() {
        assert_eq!(micros_of("+26 µs (+25…+30)"), Some(26.0));
        assert_eq!(micros_of("187 µs (182–196)"), Some(187.0));
        assert_eq!(micros_of("-3 µs"), Some(-3.0));
        assert_eq!(micros_of("0.706 (0.564–1.013)"), None);
        assert_eq!(micros_of("—"), None);
        let key = |figure: &str| ("s".to_owned(), figure.to_owned());
        let baseline: Figures = [(key("a"), 50.0), (key("b"), 50.0)].into();
        let now: Figures = [(key("a"), 60.0), (key("b"), 61.0), (key("c"), 99.0)].into();
        let warnings = regressions(&baseline, &now);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("s — b: 61 µs against 50 µs"));
        let text = render(&baseline, &now);
        assert_eq!(read_text(&text), {
            let mut merged = baseline.clone();
            merged.extend(now.clone());
            merged
        });
    }

    fn read_text(text: &str) -> Figures {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baseline.tsv");
        std::fs::write(&path, text).unwrap();
        read(&path)
    }
}
