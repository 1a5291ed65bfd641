//! The observed drain rate of a tier, for `Retry-After`.

use std::collections::VecDeque;
use std::time::Instant;

/// Dispatch instants remembered per tier.
const WINDOW: usize = 32;

/// Recent dispatch instants of one tier.
#[derive(Debug, Default)]
pub struct DrainRate {
    recent: VecDeque<Instant>,
}

impl DrainRate {
    /// Records a dispatch.
    pub fn record(&mut self, at: Instant) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(at);
    }

    /// Seconds until a request refused now could expect a place: the
    /// waiting depth divided by the observed dispatch rate, or, before there
    /// is a rate, the reference's guess of 5 s per request per slot.
    pub fn retry_after(&self, depth: u32, slots: u32) -> u64 {
        let depth = f64::from(depth.max(1));
        let seconds = match (self.recent.front(), self.recent.back()) {
            (Some(first), Some(last)) if self.recent.len() >= 3 && last > first => {
                let span = last.duration_since(*first).as_secs_f64();
                let rate = (self.recent.len() - 1) as f64 / span;
                depth / rate
            }
            _ => depth / f64::from(slots.max(1)) * 5.0,
        };
        (seconds.ceil() as u64).clamp(1, 3600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn retry_after_follows_the_observed_rate() {
        let mut rate = DrainRate::default();
        assert_eq!(
            rate.retry_after(2, 1),
            10,
            "reference default before any sample"
        );
        let start = Instant::now();
        for i in 0..11 {
            rate.record(start + Duration::from_millis(100 * i));
        }
        // 10 dispatches a second: 30 waiting drain in 3 s.
        assert_eq!(rate.retry_after(30, 2), 3);
        assert_eq!(rate.retry_after(1, 2), 1, "never below one second");
    }
}
