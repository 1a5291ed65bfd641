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
//! The map is a `std::sync::Mutex` held only for map operations, never
//! across an `.await`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::watch;

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

type Map = HashMap<String, watch::Sender<Slot>>;

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
}

/// The duty to fetch one key. Dropping it without [`Lead::publish`] tells
/// the followers to retry.
#[derive(Debug)]
pub struct Lead {
    key: String,
    sender: watch::Sender<Slot>,
    map: Arc<Mutex<Map>>,
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

    /// Joins the flight of `key`, starting it if there is none.
    pub fn join(&self, key: &str) -> Join {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = map.get(key) {
            return Join::Follow(Follow {
                receiver: sender.subscribe(),
            });
        }
        let (sender, _) = watch::channel(Slot::Pending);
        map.insert(key.to_owned(), sender.clone());
        Join::Lead(Lead {
            key: key.to_owned(),
            sender,
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
            .map_or(0, watch::Sender::receiver_count)
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
            .is_some_and(|sender| sender.same_channel(&self.sender))
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
        let Join::Lead(lead) = flights.join("k") else {
            panic!("the first caller leads");
        };
        let followers: Vec<_> = (0..5)
            .map(|_| match flights.join("k") {
                Join::Follow(follow) => tokio::spawn(follow.wait()),
                Join::Lead(_) => panic!("a second leader"),
            })
            .collect();
        lead.publish(Bytes::from_static(b"[1]"));
        // Published but not finished: a latecomer still gets the value.
        let Join::Follow(late) = flights.join("k") else {
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
        let Join::Lead(lead) = flights.join("k") else {
            panic!("the first caller leads");
        };
        let Join::Follow(follow) = flights.join("k") else {
            panic!("the second caller follows");
        };
        let waiting = tokio::spawn(follow.wait());
        drop(lead);
        assert_eq!(waiting.await.unwrap(), None);
        assert!(matches!(flights.join("k"), Join::Lead(_)));
        // Keys are independent.
        let _a = flights.join("a");
        assert!(matches!(flights.join("b"), Join::Lead(_)));
    }
}
