//! Small statistics for the benchmark: percentiles of samples, the median
//! and range of per-round figures, Jain's fairness index, and the clock
//! arithmetic the streaming scenario needs (RFC 3339 stamps to `SystemTime`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    let stamp = stamp.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut date = date.splitn(3, '-');
    let year: i64 = date.next()?.parse().ok()?;
    let month: u32 = date.next()?.parse().ok()?;
    let day: u32 = date.next()?.parse().ok()?;
    let (clock, fraction) = match time.split_once('.') {
        Some((clock, fraction)) => (clock, fraction),
        None => (time, ""),
    };
    let mut clock = clock.splitn(3, ':');
    let hour: u64 = clock.next()?.parse().ok()?;
    let minute: u64 = clock.next()?.parse().ok()?;
    let second: u64 = clock.next()?.parse().ok()?;
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        if fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        format!("{fraction:0<9}").parse().ok()?
    };
    let days = u64::try_from(days_from_civil(year, month, day)).ok()?;
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second;
    Some(UNIX_EPOCH + Duration::new(seconds, nanos))
}

/// `YYYY-MM-DD HH:MM:SS UTC` for a report header.
pub fn format_utc(time: SystemTime) -> String {
    let seconds = time
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64;
    let (days, second_of_day) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        second_of_day / 3600,
        second_of_day % 3600 / 60,
        second_of_day % 60
    )
}

// Howard Hinnant's civil-calendar algorithms.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month = i64::from(month);
    let day_of_year =
        (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

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
