//! Budget windows: consecutive periods of a fixed length from an anchor (UTC boundaries:
//! hours and days from the Unix epoch, weeks from a Monday). Pure: the time is passed in.

/// The start (Unix seconds) of the window of `length` seconds, anchored at `anchor`, that
/// holds `now`: the control plane's windows ([`oqp_proto::window_start`]).
pub fn start(now: i64, length: u64, anchor: i64) -> i64 {
    oqp_proto::window_start(now, length, anchor)
}

/// The end of that window: when it resets.
pub fn end(now: i64, length: u64, anchor: i64) -> i64 {
    let length = i64::try_from(length.max(1)).unwrap_or(i64::MAX);
    start(now, length.unsigned_abs(), anchor).saturating_add(length)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 86_400;
    // 2026-12-02 06:12:42 UTC, a Wednesday.
    const NOW: i64 = 1_796_191_962;
    // 1970-01-05, a Monday.
    const MONDAY: i64 = 4 * 86_400;

    #[test]
    fn days_and_hours_start_on_utc_boundaries() {
        assert_eq!(start(NOW, DAY, 0), 1_796_169_600);
        assert_eq!(end(NOW, DAY, 0), 1_796_169_600 + 86_400);
        assert_eq!(start(NOW, 3600, 0), NOW - NOW % 3600);
        assert_eq!(
            start(1_796_169_600, DAY, 0),
            1_796_169_600,
            "a boundary opens its window"
        );
    }

    #[test]
    fn weeks_start_on_monday() {
        let monday = start(NOW, 7 * DAY, MONDAY);
        // Monday 2026-11-30 00:00 UTC.
        assert_eq!(monday, 1_796_169_600 - 2 * 86_400);
        assert_eq!((monday / 86_400 + 3) % 7, 0, "Unix day 0 was a Thursday");
    }
}
