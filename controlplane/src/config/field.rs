//! Reading one field of the file: a number within its range, a duration within its bounds, a
//! size in MiB, a word, a flag or text, each with the default it takes when absent, and the
//! ceilings most keys share. Every section's resolver uses these; they use no section.

use std::ops::RangeInclusive;
use std::time::Duration;

use super::enums::{Vocabulary, parse_word};
use super::error::Problems;
use super::scalar::{self, Flag, Int, Seconds, Text};

/// Runs `check` and returns its value only if it recorded no error.
pub(crate) fn checked<T>(
    problems: &mut Problems,
    check: impl FnOnce(&mut Problems) -> T,
) -> Option<T> {
    let before = problems.error_count();
    let value = check(problems);
    (problems.error_count() == before).then_some(value)
}

/// An integer within `range`, or `default` when absent; `message(n)` describes a violation.
pub(crate) fn ranged<T: TryFrom<i64>>(
    value: Option<Int>,
    default: T,
    range: RangeInclusive<i64>,
    problems: &mut Problems,
    message: impl FnOnce(i64) -> String,
) -> T {
    let Some(Int(value)) = value else {
        return default;
    };
    match T::try_from(value) {
        Ok(converted) if range.contains(&value) => converted,
        _ => {
            problems.error(message(value));
            default
        }
    }
}

/// An integer of at least `min` (and within `T`), or `default` when absent.
pub(crate) fn at_least<T: TryFrom<i64>>(
    value: Option<Int>,
    default: T,
    min: i64,
    path: &str,
    problems: &mut Problems,
) -> T {
    ranged(value, default, min..=i64::MAX, problems, |n| {
        format!("{path} must be >= {min}, got {n}")
    })
}

/// One day: the ceiling of most timeouts and intervals.
pub(crate) const DAY: Duration = Duration::from_secs(86_400);

/// The longest duration any key accepts unless it names a tighter bound: far
/// beyond any sensible setting, and far below what overflows the data plane's
/// clock arithmetic.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// The largest size in MiB any `*_mb` key accepts (1 TiB): its byte count fits
/// `u64` arithmetic with room to spare.
pub(crate) const MAX_MB: i64 = 1 << 20;

/// A duration of at least `min` (and at most [`MAX_DURATION`]), or `default` when absent.
pub(crate) fn duration_at_least(
    value: Option<Seconds>,
    default: Duration,
    min: Duration,
    path: &str,
    problems: &mut Problems,
) -> Duration {
    duration_within(value, default, min, MAX_DURATION, path, problems)
}

/// A duration in `min..=max`, or `default` when absent.
pub(crate) fn duration_within(
    value: Option<Seconds>,
    default: Duration,
    min: Duration,
    max: Duration,
    path: &str,
    problems: &mut Problems,
) -> Duration {
    let Some(Seconds(value)) = value else {
        return default;
    };
    if value < min {
        let bound = if min == Duration::from_secs(1) {
            ">= 1 second".to_string()
        } else if min <= Duration::from_nanos(1) {
            "> 0".to_string()
        } else {
            format!(">= {}", scalar::show(min))
        };
        problems.error(format!(
            "{path} must be {bound}, got {}",
            scalar::show(value)
        ));
    } else if value > max {
        problems.error(format!(
            "{path} must be at most {}, got {}",
            scalar::show(max),
            scalar::show(value)
        ));
        return default;
    }
    value
}

/// A size in MiB in `1..=`[`MAX_MB`], or `default` when absent.
pub(crate) fn megabytes(
    value: Option<Int>,
    default: u64,
    path: &str,
    problems: &mut Problems,
) -> u64 {
    ranged(value, default, 1..=MAX_MB, problems, |n| {
        if n < 1 {
            format!("{path} must be >= 1, got {n}")
        } else {
            format!("{path} must be at most {MAX_MB} (1 TiB), got {n}")
        }
    })
}

/// A config word (`round_robin`, `json`, …), or `default` when absent.
pub(crate) fn word_or<T: Vocabulary>(
    value: Option<&Text>,
    default: T,
    path: &str,
    problems: &mut Problems,
) -> T {
    value
        .and_then(|text| parse_word(&text.0, path, problems))
        .unwrap_or(default)
}

pub(crate) fn flag(value: Option<Flag>, default: bool) -> bool {
    value.map_or(default, |flag| flag.0)
}

/// Trimmed text, or `default` when absent.
pub(crate) fn text(value: Option<Text>, default: &str) -> String {
    value.map_or_else(|| default.to_string(), |text| text.0.trim().to_string())
}
