//! [`Cache::resolve`]: one embedding request answered from the cache,
//! upstream fetching only what is missing and not already in flight.
//!
//! Per round: join the flight of every missing item; look the led ones up
//! again (a flight may have ended between the first lookup and the join);
//! fetch the rest in one upstream request; publish, store, end the flights;
//! then wait for the followed items. An item whose leader is queued in a less
//! urgent tier is fetched with the led ones, outside the flight (see
//! [`super::flight`]). An item whose leader gave up is missing
//! again in the next round. After [`FLIGHT_ROUNDS`] rounds whatever is still
//! missing is fetched without a flight, so a chain of failing leaders cannot
//! keep a request waiting.

use bytes::Bytes;

use super::{Cache, Dispatch, Follow, Join, Lead, Plan, PlanError, Timing};
use crate::scheduler::Tier;

/// How many times a request joins flights before fetching what it still
/// lacks on its own (each retry follows a leader that failed).
const FLIGHT_ROUNDS: usize = 3;

/// What the cache contributed to an answer (the `X-Cache` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Every item without an upstream request of this request's own.
    Hit,
    /// Some items cached, the others fetched.
    Partial,
    /// Every item fetched.
    Miss,
}

impl Outcome {
    /// The header value: `HIT`, `PARTIAL` or `MISS`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "HIT",
            Self::Partial => "PARTIAL",
            Self::Miss => "MISS",
        }
    }

    /// The outcome of an answer with `reused` items from the cache or another
    /// request's fetch and `fetched` items from its own.
    pub fn of(reused: usize, fetched: usize) -> Self {
        match (reused, fetched) {
            (_, 0) => Self::Hit,
            (0, _) => Self::Miss,
            _ => Self::Partial,
        }
    }
}

/// Where an answer's items came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Items {
    /// Found in the cache.
    pub cached: usize,
    /// Received from another request's fetch (single flight).
    pub coalesced: usize,
    /// Fetched from upstream by this request.
    pub fetched: usize,
}

/// A resolved embedding request.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The answer, in Ollama's shape for the endpoint.
    pub body: Bytes,
    /// For `X-Cache`.
    pub outcome: Outcome,
    /// Where the items came from.
    pub items: Items,
}

/// Why [`Cache::resolve`] has no answer.
#[derive(Debug)]
pub enum ResolveError<E> {
    /// `fetch` failed; relay its error.
    Upstream(E),
    /// Upstream's 200 answer did not fit the request (a 502).
    Plan(PlanError),
}

impl Cache {
    /// Answers an embedding request from the cache, fetching only what is
    /// missing and not already being fetched by another request.
    ///
    /// `fetch` sends a body to the request's upstream endpoint in `tier`,
    /// calls [`Dispatch::dispatched`] once it has an upstream slot (from
    /// then on requests of any tier wait for it rather than fetch the same
    /// items), and returns the body of a 200 answer, or an error the caller
    /// relays. Fetched
    /// vectors are stored and handed to concurrent requests waiting for
    /// them. On success the outcome is recorded under
    /// `(client_id, model, endpoint)`.
    pub async fn resolve<F, Fut, E>(
        &self,
        plan: &Plan,
        client_id: &str,
        endpoint: &str,
        tier: Tier,
        mut fetch: F,
    ) -> Result<Resolved, ResolveError<E>>
    where
        F: FnMut(Bytes, Dispatch) -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        let keys = self.keys(plan, client_id);
        let mut found = self.lookup(&keys).await;
        let mut items = Items {
            cached: found.iter().flatten().count(),
            ..Items::default()
        };
        let mut timing = Timing::default();
        let mut relay = None;

        for round in 0..=FLIGHT_ROUNDS {
            let missing: Vec<usize> = (0..plan.len()).filter(|&i| found[i].is_none()).collect();
            if missing.is_empty() {
                break;
            }
            // Which items this round fetches (with the flight it leads, if
            // any) and which it waits for.
            let mut leads: Vec<(usize, Option<Lead>)> = Vec::new();
            let mut follows: Vec<(usize, Follow)> = Vec::new();
            if round < FLIGHT_ROUNDS {
                for item in missing {
                    match self.inner.flights.join(&keys[item], tier) {
                        Join::Lead(lead) => leads.push((item, Some(lead))),
                        Join::Follow(follow) => follows.push((item, follow)),
                        Join::Alone => leads.push((item, None)),
                    }
                }
                // A flight that ended between our lookup and our join has
                // stored its vector: look again before fetching.
                if !leads.is_empty() {
                    let led: Vec<String> = leads.iter().map(|(i, _)| keys[*i].clone()).collect();
                    let again = self.lookup(&led).await;
                    for ((item, lead), vector) in leads.iter_mut().zip(again) {
                        let Some(vector) = vector else { continue };
                        if let Some(flight) = lead.take() {
                            flight.publish(vector.clone());
                        }
                        found[*item] = Some(vector);
                        items.cached += 1;
                    }
                    leads.retain(|(item, _)| found[*item].is_none());
                }
            } else {
                leads = missing.into_iter().map(|item| (item, None)).collect();
            }

            if !leads.is_empty() {
                let wanted: Vec<usize> = leads.iter().map(|(item, _)| *item).collect();
                let request = plan.fetch(&wanted);
                let dispatch = Dispatch::of(leads.iter().filter_map(|(_, lead)| lead.as_ref()));
                // On an error the leads drop here: followers retry.
                let answer = fetch(request.body.clone(), dispatch)
                    .await
                    .map_err(ResolveError::Upstream)?;
                let got = match plan.vectors(&request, &answer) {
                    Ok(got) => got,
                    // The client's own request, answered oddly: relay it,
                    // cache nothing.
                    Err(_) if request.is_whole() => {
                        items.fetched += wanted.len();
                        relay = Some(answer);
                        break;
                    }
                    Err(error) => return Err(ResolveError::Plan(error)),
                };
                timing.merge(got.timing);
                items.fetched += got.vectors.len();
                for (item, vector) in &got.vectors {
                    found[*item] = Some(vector.clone());
                }
                for (item, lead) in &leads {
                    if let (Some(lead), Some(vector)) = (lead, &found[*item]) {
                        lead.publish(vector.clone());
                    }
                }
                let entries = got
                    .vectors
                    .into_iter()
                    .map(|(item, vector)| (keys[item].clone(), vector))
                    .collect();
                self.store(entries).await;
                // Stored: the flights may end.
                drop(leads);
                if request.is_whole() {
                    relay = Some(answer);
                }
            }
            for (item, follow) in follows {
                if let Some(vector) = follow.wait().await {
                    found[item] = Some(vector);
                    items.coalesced += 1;
                }
            }
        }

        let body = match relay {
            Some(answer) => answer,
            None => plan.assemble(&found, timing).map_err(ResolveError::Plan)?,
        };
        let outcome = Outcome::of(items.cached + items.coalesced, items.fetched);
        self.record(client_id, plan.model(), endpoint, outcome, items);
        Ok(Resolved {
            body,
            outcome,
            items,
        })
    }
}
