//! The byte budget of buffered request bodies: every body the data plane
//! holds in memory (being read, waiting in the queue, on its way to a host
//! before the answer's head) counts against `queue.max_queued_mb`, so that
//! slow or concurrent uploads cannot take more memory than the queue may.
//!
//! A body is counted from its first byte (or at once, when it declares its
//! length) until its request has an answer's head. Like the queue's own
//! check, a body that arrives when nothing else is held is taken whatever
//! its size, or it could never run.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of buffered bodies held now.
#[derive(Debug, Default)]
pub struct BodyBudget {
    used: AtomicU64,
}

/// One body's share of the budget, returned when dropped. It borrows the
/// budget: a request with no body touches no shared counter at all.
#[derive(Debug)]
pub struct Reservation<'a> {
    budget: &'a BodyBudget,
    limit: u64,
    bytes: u64,
}

/// The budget has no room for more of a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("buffered request bodies over queue.max_queued_mb")]
pub struct OverBudget;

impl BodyBudget {
    /// An empty reservation against at most `limit` bytes in all.
    pub fn reserve(&self, limit: u64) -> Reservation<'_> {
        Reservation {
            budget: self,
            limit,
            bytes: 0,
        }
    }

    /// Bytes held now, all bodies together.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

impl Reservation<'_> {
    /// Bytes this body holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Makes this body's share `total` bytes (never smaller), or refuses
    /// when that would take the budget past its limit while other bodies
    /// are held.
    pub fn grow_to(&mut self, total: u64) -> Result<(), OverBudget> {
        let more = total.saturating_sub(self.bytes);
        if more == 0 {
            return Ok(());
        }
        let mine = self.bytes;
        let limit = self.limit;
        self.budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let others = used.saturating_sub(mine);
                let after = used.saturating_add(more);
                (others == 0 || after <= limit).then_some(after)
            })
            .map_err(|_| OverBudget)?;
        self.bytes = total;
        Ok(())
    }

    /// Gives back what this body's share holds beyond `total` bytes: the end of a
    /// transient charge (a reading of the body, see [`crate::view`]).
    pub fn shrink_to(&mut self, total: u64) {
        let less = self.bytes.saturating_sub(total);
        if less == 0 {
            return;
        }
        let _ = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(less))
            });
        self.bytes = total;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let bytes = self.bytes;
        if bytes == 0 {
            return;
        }
        let _ = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(bytes))
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_share_one_limit_and_a_lone_body_always_fits() {
        let budget = BodyBudget::default();
        let mut big = budget.reserve(100);
        assert!(big.grow_to(150).is_ok(), "alone, any size fits");
        let mut other = budget.reserve(100);
        assert_eq!(other.grow_to(1), Err(OverBudget));
        drop(big);
        assert_eq!(budget.used(), 0);
        assert!(other.grow_to(60).is_ok());
        let mut third = budget.reserve(100);
        assert!(third.grow_to(40).is_ok());
        assert_eq!(third.grow_to(41), Err(OverBudget));
        assert_eq!(third.bytes(), 40);
        drop((other, third));
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_transient_charge_is_given_back() {
        let budget = BodyBudget::default();
        let mut body = budget.reserve(100);
        assert!(body.grow_to(30).is_ok());
        assert!(body.grow_to(60).is_ok());
        body.shrink_to(30);
        assert_eq!((body.bytes(), budget.used()), (30, 30));
        body.shrink_to(40);
        assert_eq!(body.bytes(), 30);
        drop(body);
        assert_eq!(budget.used(), 0);
    }
}
