//! `--watch [SECONDS]`: redraw a view in place until Ctrl-C.
//!
//! The loop lives in `main` (it owns the connection); what is drawn is the
//! pure [`frame`], so that it is unit-tested.

use std::time::{Duration, SystemTime};

/// ANSI: clear the screen and move the cursor home.
pub const CLEAR: &str = "\x1b[2J\x1b[H";

/// The default interval of a bare `--watch`.
pub const DEFAULT_SECONDS: &str = "2";

/// The interval for `--watch SECONDS` (at least one second).
pub fn interval(seconds: u64) -> Duration {
    Duration::from_secs(seconds.max(1))
}

/// One redraw: a header naming the command, the interval and the time, then
/// the view. With `clear` (colour allowed) the screen is cleared first, so
/// the view redraws in place; without it frames follow each other, separated
/// by a blank line, which suits logs and dumb terminals.
pub fn frame(command: &str, every: Duration, at: SystemTime, body: &str, clear: bool) -> String {
    let header = format!(
        "Every {}s: oqpctl {command}    {}",
        every.as_secs(),
        humantime::format_rfc3339_seconds(at)
    );
    let body = body.trim_end_matches('\n');
    if clear {
        format!("{CLEAR}{header}\n\n{body}\n")
    } else {
        format!("{header}\n\n{body}\n\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
    }

    #[test]
    fn a_frame_clears_the_screen_then_draws_header_and_view() {
        let text = frame("hosts", interval(5), at(), "table\n", true);
        assert_eq!(
            text,
            "\x1b[2J\x1b[HEvery 5s: oqpctl hosts    2027-01-15T08:00:00Z\n\ntable\n"
        );
    }

    #[test]
    fn without_colour_frames_follow_each_other_with_no_escape_codes() {
        let text = frame("status", interval(2), at(), "body", false);
        assert!(!text.contains('\x1b'));
        assert_eq!(
            text,
            "Every 2s: oqpctl status    2027-01-15T08:00:00Z\n\nbody\n\n"
        );
    }

    #[test]
    fn the_interval_is_at_least_a_second() {
        assert_eq!(interval(0), Duration::from_secs(1));
        assert_eq!(interval(7), Duration::from_secs(7));
    }
}
