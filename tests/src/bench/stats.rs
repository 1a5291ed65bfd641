//! Small statistics for the benchmark: percentiles of samples, the median
//! and range of per-round figures, Jain's fairness index, and the clock
//! arithmetic the streaming scenario needs (RFC 3339 stamps to `SystemTime`).

use std::time::{Duration, SystemTime};

/// The `p`-th percentile (0..=100) of `samples`, nearest rank; `None` when
/// empty. Sorts a copy.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median of `samples`; `None` when empty.
pub fn median(samples: &[f64]) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    Some(if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    })
}

/// The largest sample; `None` when empty.
pub fn max(samples: &[f64]) -> Option<f64> {
    samples.iter().copied().reduce(f64::max)
}

/// A figure measured once per round: its median and its range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Median over rounds.
    pub median: f64,
    /// Smallest round.
    pub min: f64,
    /// Largest round.
    pub max: f64,
}

impl Spread {
    /// The spread of per-round values; `None` when there are none.
    pub fn of(rounds: &[f64]) -> Option<Spread> {
        Some(Spread {
            median: median(rounds)?,
            min: rounds.iter().copied().reduce(f64::min)?,
            max: max(rounds)?,
        })
    }

    /// A single measurement.
    pub fn single(value: f64) -> Spread {
        Spread {
            median: value,
            min: value,
            max: value,
        }
    }
}

/// Jain's fairness index of `shares`: 1 when equal, 1/n when one takes all.
pub fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|share| share * share).sum();
    if squares == 0.0 {
        return 0.0;
    }
    sum * sum / (shares.len() as f64 * squares)
}

/// Microseconds in a duration, as a float.
pub fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

/// Parses an RFC 3339 UTC stamp as the fake writes it
/// (`2026-05-17T10:11:12.123456789Z`, fraction optional).
pub fn parse_rfc3339(stamp: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339(stamp).ok()
}

/// `YYYY-MM-DD HH:MM:SS UTC` for a report header.
pub fn format_utc(time: SystemTime) -> String {
    let stamp = humantime::format_rfc3339_seconds(time).to_string();
    format!("{} UTC", stamp.trim_end_matches('Z').replacen('T', " ", 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 50.0), Some(50.0));
        assert_eq!(percentile(&samples, 99.0), Some(99.0));
        assert_eq!(percentile(&samples, 100.0), Some(100.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(median(&[3.0, 1.0, 2.0, 10.0]), Some(2.5));
    }

    #[test]
    fn jain_is_one_when_equal_and_lower_when_not() {
        assert!((jain(&[5.0, 5.0, 5.0, 5.0]) - 1.0).abs() < 1e-12);
        let fifo = jain(&[8.0, 8.0, 16.0, 32.0]);
        assert!((fifo - 0.7273).abs() < 1e-3, "{fifo}");
    }

    #[test]
    fn rfc3339_round_trips_through_the_calendar() {
        let stamp = parse_rfc3339("2026-05-17T10:11:12.5Z").unwrap();
        let since = stamp.duration_since(UNIX_EPOCH).unwrap();
        assert_eq!(since, Duration::new(1_779_012_672, 500_000_000));
        assert_eq!(format_utc(stamp), "2026-05-17 10:11:12 UTC");
        let nanos = parse_rfc3339("1970-01-01T00:00:00.000000001Z").unwrap();
        assert_eq!(nanos.duration_since(UNIX_EPOCH).unwrap().as_nanos(), 1);
        assert!(parse_rfc3339("2026-05-17 10:11:12Z").is_none());
    }
}
