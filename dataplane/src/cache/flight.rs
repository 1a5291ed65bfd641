//! Single flight: concurrent misses of the same item key produce one
//! upstream request.
//!
//! [`Flights::join`] registers interest in a key. The first caller for a key
//! that is not in flight gets a [`Lead`]: it fetches the vector, hands it to
//! everyone waiting with [`Lead::publish`], stores it, then drops the `Lead`,
//! which ends the flight. Later callers get a [`Follow`] and
//! [`Follow::wait`] for the leader's vector. A leader that fails, or whose
//! request is cancelled, drops its `Lead` without publishing: its followers
//! get `None` and join again, so that one of them leads the retry.
//!
//! Publishing before storing and ending the flight only after storing means
//! a caller that arrives while the store is in progress still gets the value
//! from the flight rather than missing the cache and fetching again.
//!
//! A request that needs several keys must finish its own fetch (and publish)
//! before it waits on anything it follows; leading never waits on following,
//! so two requests that each lead what the other follows cannot deadlock.
//!
//! Following never inverts priorities: a caller follows only a leader that
//! is already dispatched upstream ([`Dispatch::dispatched`]) or that waits in a
//! tier at least as urgent as the caller's own. Otherwise (a high-tier
//! request for a text a queued low-tier request leads) it gets
//! [`Join::Alone`] and fetches the key itself, outside the flight.
//!
//! The map is a `std::sync::Mutex` held only for map operations, never
//! across an `.await`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::watch;

use crate::scheduler::Tier;

/// The state of one flight, as followers see it.
#[derive(Debug, Clone)]
enum Slot {
    /// The leader is fetching.
    Pending,
    /// The leader's vector.
    Ready(Bytes),
    /// The leader gave up; join again.
    Abandoned,
}

/// A flight in the map: its channel and who leads it.
#[derive(Debug)]
struct Flight {
    sender: watch::Sender<Slot>,
    leader: Arc<Leader>,
}

/// What followers need to know of a leader to decide whether to wait.
#[derive(Debug)]
struct Leader {
    tier: Tier,
    dispatched: AtomicBool,
}

type Map = HashMap<String, Flight>;

/// The keys in flight.
#[derive(Debug, Clone, Default)]
pub struct Flights {
    map: Arc<Mutex<Map>>,
}

/// This caller's part in a key's flight.
#[derive(Debug)]
pub enum Join {
    /// Nobody was fetching the key: this caller must.
    Lead(Lead),
    /// Someone is: wait for them.
    Follow(Follow),
    /// Someone is, but still queued in a less urgent tier: fetch the key
    /// yourself, without a flight.
    Alone,
}

/// The duty to fetch one key. Dropping it without [`Lead::publish`] tells
/// the followers to retry.
#[derive(Debug)]
pub struct Lead {
    key: String,
    sender: watch::Sender<Slot>,
    leader: Arc<Leader>,
    map: Arc<Mutex<Map>>,
}

/// Marks a set of leads as dispatched (their fetch has a slot upstream), so
/// that callers of any tier may follow them from then on. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Dispatch {
    leaders: Arc<[Arc<Leader>]>,
}

impl Dispatch {
    /// The handle for `leads`.
    pub fn of<'a>(leads: impl IntoIterator<Item = &'a Lead>) -> Self {
        Self {
            leaders: leads.into_iter().map(|lead| lead.leader.clone()).collect(),
        }
    }

    /// The fetch got its upstream slot.
    pub fn dispatched(&self) {
        for leader in self.leaders.iter() {
            leader.dispatched.store(true, Ordering::Release);
        }
    }
}

/// A wait for another request's fetch of one key.
#[derive(Debug)]
pub struct Follow {
    receiver: watch::Receiver<Slot>,
}

impl Flights {
    /// An empty set of flights.
    pub fn new() -> Self {
        Self::default()
    }

    /// Joins the flight of `key` for a request of `tier`, starting it if
    /// there is none.
    pub fn join(&self, key: &str, tier: Tier) -> Join {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(flight) = map.get(key) {
            let leader = &flight.leader;
            // `High < Normal < Low`: a leader at least as urgent is served
            // no later than this caller would be.
            if leader.tier <= tier || leader.dispatched.load(Ordering::Acquire) {
                return Join::Follow(Follow {
                    receiver: flight.sender.subscribe(),
                });
            }
            return Join::Alone;
        }
        let (sender, _) = watch::channel(Slot::Pending);
        let leader = Arc::new(Leader {
            tier,
            dispatched: AtomicBool::new(false),
        });
        map.insert(
            key.to_owned(),
            Flight {
                sender: sender.clone(),
                leader: leader.clone(),
            },
        );
        Join::Lead(Lead {
            key: key.to_owned(),
            sender,
            leader,
            map: Arc::clone(&self.map),
        })
    }

    /// How many keys are in flight.
    pub fn len(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no key is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
impl Flights {
    /// How many callers wait on the flight of `key`.
    pub(crate) fn followers(&self, key: &str) -> usize {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .map_or(0, |flight| flight.sender.receiver_count())
    }
}

impl Lead {
    /// The key this caller leads.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Hands the vector to every follower, present and future, until this
    /// `Lead` is dropped.
    pub fn publish(&self, vector: Bytes) {
        self.sender.send_replace(Slot::Ready(vector));
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if map
            .get(&self.key)
            .is_some_and(|flight| flight.sender.same_channel(&self.sender))
        {
            map.remove(&self.key);
        }
        // Under the lock, so that no follower can join a flight that is
        // already abandoned.
        self.sender.send_if_modified(|slot| {
            if matches!(slot, Slot::Pending) {
                *slot = Slot::Abandoned;
                true
            } else {
                false
            }
        });
    }
}

impl Follow {
    /// The leader's vector, or `None` if the leader gave up (join again).
    pub async fn wait(mut self) -> Option<Bytes> {
        let slot = self
            .receiver
            .wait_for(|slot| !matches!(slot, Slot::Pending))
            .await
            .ok()?
            .clone();
        match slot {
            Slot::Ready(vector) => Some(vector),
            Slot::Pending | Slot::Abandoned => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_leader_many_followers() {
        let flights = Flights::new();
        let Join::Lead(lead) = flights.join("k", Tier::Normal) else {
            panic!("the first caller leads");
        };
        let followers: Vec<_> = (0..5)
            .map(|_| match flights.join("k", Tier::Normal) {
                Join::Follow(follow) => tokio::spawn(follow.wait()),
                Join::Lead(_) | Join::Alone => panic!("a second leader"),
            })
            .collect();
        lead.publish(Bytes::from_static(b"[1]"));
        // Published but not finished: a latecomer still gets the value.
        let Join::Follow(late) = flights.join("k", Tier::Normal) else {
            panic!("the flight is still open");
        };
        drop(lead);
        assert!(flights.is_empty());
        assert_eq!(late.wait().await, Some(Bytes::from_static(b"[1]")));
        for follower in followers {
            assert_eq!(follower.await.unwrap(), Some(Bytes::from_static(b"[1]")));
        }
    }

    #[tokio::test]
    async fn an_abandoned_flight_lets_a_follower_lead() {
        let flights = Flights::new();
        let Join::Lead(lead) = flights.join("k", Tier::Normal) else {
            panic!("the first caller leads");
        };
        let Join::Follow(follow) = flights.join("k", Tier::Normal) else {
            panic!("the second caller follows");
        };
        let waiting = tokio::spawn(follow.wait());
        drop(lead);
        assert_eq!(waiting.await.unwrap(), None);
        assert!(matches!(flights.join("k", Tier::Normal), Join::Lead(_)));
        // Keys are independent.
        let _a = flights.join("a", Tier::Normal);
        assert!(matches!(flights.join("b", Tier::Normal), Join::Lead(_)));
    }

    #[test]
    fn a_caller_never_waits_on_a_queued_leader_of_a_lower_tier() {
        let flights = Flights::new();
        let Join::Lead(low) = flights.join("k", Tier::Low) else {
            panic!("the first caller leads");
        };
        // Queued in Low: a High or Normal caller fetches on its own, a Low
        // one follows.
        assert!(matches!(flights.join("k", Tier::High), Join::Alone));
        assert!(matches!(flights.join("k", Tier::Normal), Join::Alone));
        assert!(matches!(flights.join("k", Tier::Low), Join::Follow(_)));
        // Once dispatched, its fetch is upstream: everyone may wait.
        Dispatch::of([&low]).dispatched();
        assert!(matches!(flights.join("k", Tier::High), Join::Follow(_)));
        drop(low);
        // A High leader is followed by every tier, dispatched or not.
        let Join::Lead(_high) = flights.join("k", Tier::High) else {
            panic!("the flight ended");
        };
        for tier in Tier::ALL {
            assert!(
                matches!(flights.join("k", tier), Join::Follow(_)),
                "{tier:?}"
            );
        }
    }
}
