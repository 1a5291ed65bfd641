//! The failed-authentication throttle: at most `max_failures` failures per client address in a
//! rolling window, then 429 with a `Retry-After` that a client can obey.
//!
//! - An IPv6 address counts by its /64 (one host usually owns a whole /64); IPv4 and
//!   IPv4-mapped IPv6 by the address.
//! - A success does not clear earlier failures, so a caller holding one good key cannot guess
//!   others without limit.
//! - Memory is bounded: at [`MAX_TRACKED`] addresses, those whose failures are all outside the
//!   window go first, then the address whose last failure is the oldest. A flood of fresh
//!   addresses therefore never resets the count of an address still guessing.
//!
//! Time is passed in (`*_at`), so the rules are tested without sleeping.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::ProxyError;
use crate::policy::canonical;

/// Most addresses remembered.
pub const MAX_TRACKED: usize = 10_000;

/// Most failures kept per address: only the last `max_failures` matter.
const MAX_FAILURES_KEPT: usize = 1024;

/// Failed-authentication throttle, per client address, with bounded memory.
#[derive(Debug, Default)]
pub struct Throttle {
    failures: Mutex<HashMap<Bucket, VecDeque<Instant>>>,
}

/// What failures are counted by: an IPv4 address, or an IPv6 /64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Bucket(IpAddr);

impl Bucket {
    fn of(address: IpAddr) -> Self {
        match canonical(address) {
            IpAddr::V6(v6) => Bucket(IpAddr::from(
                (u128::from(v6) & !u128::from(u64::MAX)).to_be_bytes(),
            )),
            v4 => Bucket(v4),
        }
    }
}

impl Throttle {
    /// Refuses an address with `max_failures` failures inside `window`.
    pub fn check(
        &self,
        peer: IpAddr,
        max_failures: u32,
        window: Duration,
    ) -> Result<(), ProxyError> {
        self.check_at(peer, max_failures, window, Instant::now())
    }

    /// [`check`](Throttle::check) at `now`.
    pub fn check_at(
        &self,
        peer: IpAddr,
        max_failures: u32,
        window: Duration,
        now: Instant,
    ) -> Result<(), ProxyError> {
        let mut failures = self.lock();
        let bucket = Bucket::of(peer);
        let Some(recent) = failures.get_mut(&bucket) else {
            return Ok(());
        };
        while recent
            .front()
            .is_some_and(|at| now.saturating_duration_since(*at) >= window)
        {
            recent.pop_front();
        }
        if recent.len() >= max_failures as usize {
            // Refused until the failure that makes the count full leaves the window.
            let index = recent.len() - max_failures as usize;
            let deciding = recent.get(index).copied().unwrap_or(now);
            let wait = window.saturating_sub(now.saturating_duration_since(deciding));
            return Err(ProxyError::TooManyAuthFailures {
                retry_after: ceil_secs(wait).max(1),
            });
        }
        if recent.is_empty() {
            failures.remove(&bucket);
        }
        Ok(())
    }

    /// Records a failure.
    pub fn fail(&self, peer: IpAddr, window: Duration) {
        self.fail_at(peer, window, Instant::now());
    }

    /// [`fail`](Throttle::fail) at `now`.
    pub fn fail_at(&self, peer: IpAddr, window: Duration, now: Instant) {
        let mut failures = self.lock();
        let bucket = Bucket::of(peer);
        if failures.len() >= MAX_TRACKED && !failures.contains_key(&bucket) {
            evict(&mut failures, window, now);
        }
        let recent = failures.entry(bucket).or_default();
        recent.push_back(now);
        while recent.len() > MAX_FAILURES_KEPT {
            recent.pop_front();
        }
    }

    /// Addresses currently remembered.
    pub fn tracked(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Bucket, VecDeque<Instant>>> {
        // Every step leaves the map consistent, so a panic elsewhere does not poison it.
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Addresses left after an eviction sweep: a full table is swept once per
/// [`MAX_TRACKED`]` / 10` new addresses, not on every one.
const AFTER_EVICTION: usize = MAX_TRACKED - MAX_TRACKED / 10;

/// Forgets the addresses whose failures are all outside `window`, then, if
/// more than [`AFTER_EVICTION`] remain, those whose last failure is the oldest.
fn evict(failures: &mut HashMap<Bucket, VecDeque<Instant>>, window: Duration, now: Instant) {
    failures.retain(|_, recent| {
        recent
            .back()
            .is_some_and(|at| now.saturating_duration_since(*at) < window)
    });
    let excess = failures.len().saturating_sub(AFTER_EVICTION);
    if excess == 0 {
        return;
    }
    let mut by_age: Vec<(Option<Instant>, Bucket)> = failures
        .iter()
        .map(|(bucket, recent)| (recent.back().copied(), *bucket))
        .collect();
    by_age.select_nth_unstable_by_key(excess - 1, |(last, _)| *last);
    for (_, old) in by_age.into_iter().take(excess) {
        failures.remove(&old);
    }
}

/// Whole seconds, rounded up: a client that waits this long is let in.
fn ceil_secs(duration: Duration) -> u64 {
    let secs = duration.as_secs();
    if duration.subsec_nanos() > 0 {
        secs.saturating_add(1)
    } else {
        secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(60);

    fn v4(last: u8) -> IpAddr {
        [10, 0, 0, last].into()
    }

    fn retry_after(result: Result<(), ProxyError>) -> Option<u64> {
        match result {
            Err(ProxyError::TooManyAuthFailures { retry_after }) => Some(retry_after),
            _ => None,
        }
    }

    #[test]
    fn refuses_after_max_failures_and_retry_after_rounds_up() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        for i in 0..3 {
            assert!(throttle.check_at(v4(1), 3, WINDOW, t0).is_ok());
            throttle.fail_at(v4(1), WINDOW, t0 + Duration::from_millis(i));
        }
        // 59.5 s left of the window: 60, never 59 (a client obeying 59 is refused again).
        let now = t0 + Duration::from_millis(500);
        assert_eq!(
            retry_after(throttle.check_at(v4(1), 3, WINDOW, now)),
            Some(60)
        );
        // Obeying it gets the client in.
        let obeyed = now + Duration::from_secs(60);
        assert!(throttle.check_at(v4(1), 3, WINDOW, obeyed).is_ok());
        // Another address is untouched.
        assert!(throttle.check_at(v4(2), 3, WINDOW, now).is_ok());
    }

    #[test]
    fn retry_after_waits_for_the_failure_that_fills_the_count() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        // Five failures, the limit is two: refused until the fourth leaves the window.
        for second in [0, 10, 20, 30, 40] {
            throttle.fail_at(v4(1), WINDOW, t0 + Duration::from_secs(second));
        }
        let now = t0 + Duration::from_secs(41);
        assert_eq!(
            retry_after(throttle.check_at(v4(1), 2, WINDOW, now)),
            Some(49)
        );
        assert!(
            throttle
                .check_at(v4(1), 2, WINDOW, t0 + Duration::from_secs(90))
                .is_ok()
        );
    }

    #[test]
    fn ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        throttle.fail_at(a, WINDOW, t0);
        throttle.fail_at(b, WINDOW, t0);
        assert!(throttle.check_at(a, 2, WINDOW, t0).is_err());
        assert!(throttle.check_at(other, 2, WINDOW, t0).is_ok());
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        throttle.fail_at(mapped, WINDOW, t0);
        throttle.fail_at(v4(1), WINDOW, t0);
        assert!(throttle.check_at(v4(1), 2, WINDOW, t0).is_err());
        assert_eq!(throttle.tracked(), 2);
    }

    #[test]
    fn a_full_table_evicts_the_oldest_tenth_in_one_sweep() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        let address = |i: u32| IpAddr::from(i.to_be_bytes());
        let at = |i: u32| t0 + Duration::from_millis(u64::from(i));
        for i in 0..MAX_TRACKED as u32 {
            throttle.fail_at(address(i), WINDOW, at(i));
        }
        assert_eq!(throttle.tracked(), MAX_TRACKED);
        // One new address sweeps out the oldest tenth at once...
        let mut next = MAX_TRACKED as u32;
        throttle.fail_at(address(next), WINDOW, at(next));
        assert_eq!(throttle.tracked(), AFTER_EVICTION + 1);
        let tenth = (MAX_TRACKED / 10) as u32;
        assert!(
            throttle
                .check_at(address(tenth - 1), 1, WINDOW, at(next))
                .is_ok()
        );
        assert!(
            throttle
                .check_at(address(tenth), 1, WINDOW, at(next))
                .is_err()
        );
        // ...so the next ones fit without another sweep until the table is full again.
        while throttle.tracked() < MAX_TRACKED {
            next += 1;
            throttle.fail_at(address(next), WINDOW, at(next));
        }
        assert_eq!(next, MAX_TRACKED as u32 + tenth - 1);
    }

    #[test]
    fn a_flood_of_fresh_addresses_evicts_the_oldest_not_everyone() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        // The attacker's address fails first, then keeps failing: it is never the oldest.
        let attacker: IpAddr = [192, 0, 2, 1].into();
        throttle.fail_at(attacker, WINDOW, t0);
        throttle.fail_at(attacker, WINDOW, t0);
        let first: IpAddr = IpAddr::from(1_u32.to_be_bytes());
        throttle.fail_at(first, WINDOW, t0);
        for i in 2..(MAX_TRACKED as u32 + 50) {
            let at = t0 + Duration::from_millis(u64::from(i));
            throttle.fail_at(IpAddr::from(i.to_be_bytes()), WINDOW, at);
            if i % 1000 == 0 {
                throttle.fail_at(attacker, WINDOW, at);
            }
        }
        assert!(throttle.tracked() <= MAX_TRACKED);
        let now = t0 + Duration::from_secs(11);
        assert!(
            throttle.check_at(attacker, 3, WINDOW, now).is_err(),
            "the attacker's count survived the flood"
        );
        assert!(
            throttle.check_at(first, 1, WINDOW, now).is_ok(),
            "the oldest address was evicted"
        );
    }
}
