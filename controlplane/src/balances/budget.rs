//! The cloud's read limit, kept on our side: at most [`READS_PER_MINUTE`] reads of one
//! account's `/api/balance` (and `/api/usage`) in any rolling minute, whatever the interval
//! says and however many keys the account has, and none before a 429's `Retry-After` ends.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Reads Ollama Cloud allows one account in a rolling minute, across its keys and devices.
pub const READS_PER_MINUTE: usize = 10;

/// The rolling window of [`READS_PER_MINUTE`].
pub const MINUTE: Duration = Duration::from_secs(60);

/// One account's read budget.
#[derive(Debug)]
pub struct ReadBudget {
    limit: usize,
    window: Duration,
    /// The reads of the last window, oldest first.
    reads: VecDeque<Instant>,
    /// A 429's `Retry-After`: no read before.
    blocked_until: Option<Instant>,
}

impl Default for ReadBudget {
    fn default() -> Self {
        ReadBudget::new(READS_PER_MINUTE, MINUTE)
    }
}

impl ReadBudget {
    /// At most `limit` reads in any `window`.
    pub fn new(limit: usize, window: Duration) -> Self {
        ReadBudget {
            limit: limit.max(1),
            window,
            reads: VecDeque::new(),
            blocked_until: None,
        }
    }

    /// The earliest time, not before `wanted`, at which a read keeps within the budget.
    pub fn next_at(&self, wanted: Instant) -> Instant {
        let mut at = wanted;
        if let Some(until) = self.blocked_until {
            at = at.max(until);
        }
        if self.reads.len() >= self.limit {
            // The read that must have left the window first.
            let index = self.reads.len() - self.limit;
            if let Some(oldest) = self.reads.get(index) {
                at = at.max(*oldest + self.window);
            }
        }
        at
    }

    /// Records a read sent at `at`.
    pub fn record(&mut self, at: Instant) {
        while self
            .reads
            .front()
            .is_some_and(|first| at.saturating_duration_since(*first) >= self.window)
        {
            self.reads.pop_front();
        }
        self.reads.push_back(at);
    }

    /// A 429 at `now`: no read for `retry_after`.
    pub fn back_off(&mut self, now: Instant, retry_after: Duration) {
        let until = now + retry_after;
        self.blocked_until = Some(self.blocked_until.map_or(until, |old| old.max(until)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_more_than_ten_reads_in_any_minute() {
        let mut budget = ReadBudget::default();
        let start = Instant::now();
        let mut sent = Vec::new();
        // Asked every second for ten minutes.
        let mut wanted = start;
        while wanted < start + 10 * MINUTE {
            let at = budget.next_at(wanted);
            budget.record(at);
            sent.push(at);
            wanted = at + Duration::from_secs(1);
        }
        for (index, first) in sent.iter().enumerate() {
            let in_window = sent[index..]
                .iter()
                .take_while(|at| at.saturating_duration_since(*first) < MINUTE)
                .count();
            assert!(
                in_window <= READS_PER_MINUTE,
                "{in_window} reads from {index}"
            );
        }
        // And it still reads: ten a minute.
        assert!(sent.len() >= 10 * READS_PER_MINUTE, "{}", sent.len());
    }

    #[test]
    fn a_429_holds_reads_for_its_retry_after() {
        let mut budget = ReadBudget::default();
        let now = Instant::now();
        budget.record(now);
        budget.back_off(now, Duration::from_secs(42));
        assert_eq!(budget.next_at(now), now + Duration::from_secs(42));
        // A shorter one later does not shorten it.
        budget.back_off(now + Duration::from_secs(1), Duration::from_secs(2));
        assert_eq!(budget.next_at(now), now + Duration::from_secs(42));
        assert_eq!(
            budget.next_at(now + Duration::from_secs(50)),
            now + Duration::from_secs(50)
        );
    }
}
