//! Virtual-time accounting for fair sharing inside a tier: the per-(client, tier) [`Flow`], the
//! exponential decay helper, decayed usage for reporting, and the running cost estimate.
//!
//! All tags are in *normalised seconds*: seconds of GPU time divided by the client's weight.
//! The algorithm is described in the parent module's documentation.

use std::time::{Duration, Instant};

/// The cost charged at dispatch when neither the client nor anyone else has completed a request yet.
pub(super) const DEFAULT_COST_SECS: f64 = 1.0;

/// Weight of the newest sample in the running mean of costs.
const COST_MEAN_ALPHA: f64 = 0.125;

/// `2^(-elapsed / half_life)`: the factor by which a quantity decays over `elapsed`.
/// A zero half-life forgets everything at once; zero elapsed time forgets nothing.
pub(super) fn decay_factor(elapsed: Duration, half_life: Duration) -> f64 {
    if elapsed.is_zero() {
        1.0
    } else if half_life.is_zero() {
        0.0
    } else {
        (-(elapsed.as_secs_f64() / half_life.as_secs_f64())).exp2()
    }
}

/// A sum that decays exponentially with a half-life (a client's recent GPU seconds).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Decayed {
    value: f64,
    at: Option<Instant>,
}

impl Decayed {
    /// The value seen at `now` (never grows while nothing is added).
    pub(super) fn value_at(&self, now: Instant, half_life: Duration) -> f64 {
        match self.at {
            None => 0.0,
            Some(at) => self.value * decay_factor(now.saturating_duration_since(at), half_life),
        }
    }

    pub(super) fn add(&mut self, now: Instant, half_life: Duration, amount: f64) {
        self.value = self.value_at(now, half_life) + amount;
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
    }
}

/// A running mean of request costs in seconds (exponentially weighted by count).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CostMean(Option<f64>);

impl CostMean {
    pub(super) fn get(&self) -> Option<f64> {
        self.0
    }

    pub(super) fn record(&mut self, cost_secs: f64) {
        self.0 = Some(match self.0 {
            None => cost_secs,
            Some(mean) => mean + COST_MEAN_ALPHA * (cost_secs - mean),
        });
    }
}

/// The fair-queuing state of one client inside one tier.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Flow {
    /// Virtual finish tag: where the flow's next ticket starts. Advanced at dispatch by the
    /// estimated cost / weight, corrected at completion by (actual − estimate) / weight.
    finish: f64,
    /// Requests of this flow in flight.
    pub(super) inflight: u32,
    /// Reference instant for decay: when the flow was last activated or charged, or (while it is
    /// fully idle: nothing waiting, nothing in flight) when it became idle. `None`: never used.
    since: Option<Instant>,
}

impl Flow {
    /// The flow gets a waiting ticket after having none, at `now`, in a tier whose virtual clock
    /// is `vclock`. Start-time fair queuing: the next start tag is `max(vclock, finish)`, so an
    /// idle flow banks no credit and a newcomer starts level with the busy flows. A debt
    /// (`finish > vclock`) left by a flow that then went fully idle decays with the half-life over
    /// the idle time, so old work is not held against a client for ever.
    pub(super) fn activate(&mut self, vclock: f64, now: Instant, half_life: Duration) {
        let lag = self.finish - vclock;
        self.finish = match self.since {
            Some(since) if lag > 0.0 => {
                if self.inflight == 0 {
                    vclock + lag * decay_factor(now.saturating_duration_since(since), half_life)
                } else {
                    self.finish
                }
            }
            _ => vclock,
        };
        self.since = Some(now);
    }

    /// The flow has nothing waiting and nothing in flight since `now`.
    pub(super) fn idle(&mut self, now: Instant) {
        self.since = Some(now);
    }

    /// The start tag of the flow's head ticket: its finish tag, except that a credit (`finish <
    /// vclock`) is worth at most `max_credit` (one request: the flow's normalised estimate) and
    /// decays with the half-life. Credit comes from waiting while no host was free for the flow's
    /// model and others ran, and from corrections of over-estimated requests: a first request
    /// charged the no-history default (1 s) that took 25 ms moved the virtual clock by 1 s, and
    /// without the cap the flow would then run alone for 40 requests. With it, no flow gets more
    /// than one request ahead of the others.
    pub(super) fn start_tag(
        &self,
        vclock: f64,
        now: Instant,
        half_life: Duration,
        max_credit: f64,
    ) -> f64 {
        match self.since {
            Some(since) if self.finish < vclock => {
                let credit = (vclock - self.finish).min(max_credit);
                vclock - credit * decay_factor(now.saturating_duration_since(since), half_life)
            }
            _ => self.finish,
        }
    }

    /// Drops any credit: the flow's next start tag is at least `vclock`.
    pub(super) fn catch_up(&mut self, vclock: f64) {
        self.finish = self.finish.max(vclock);
    }

    /// Dispatches the head ticket whose start tag was `start`, charging `normalised_estimate`.
    pub(super) fn charge(&mut self, start: f64, normalised_estimate: f64, now: Instant) {
        self.finish = start + normalised_estimate;
        self.inflight += 1;
        self.since = Some(now);
    }

    /// Charges `normalised_cost` outside any request (a switch's drain).
    pub(super) fn add(&mut self, normalised_cost: f64) {
        self.finish += normalised_cost;
    }

    /// A request completed; `normalised_correction` is (actual − estimate) / weight.
    pub(super) fn complete(&mut self, normalised_correction: f64) {
        self.finish += normalised_correction;
        self.inflight = self.inflight.saturating_sub(1);
    }

    #[cfg(test)]
    pub(super) fn finish(&self) -> f64 {
        self.finish
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_halves_per_half_life() {
        let h = Duration::from_secs(10);
        assert_eq!(decay_factor(Duration::ZERO, h), 1.0);
        assert!((decay_factor(h, h) - 0.5).abs() < 1e-12);
        assert!((decay_factor(3 * h, h) - 0.125).abs() < 1e-12);
        assert_eq!(decay_factor(h, Duration::ZERO), 0.0);
        assert_eq!(decay_factor(Duration::ZERO, Duration::ZERO), 1.0);
    }

    #[test]
    fn decayed_sum() {
        let h = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut usage = Decayed::default();
        assert_eq!(usage.value_at(t0, h), 0.0);
        usage.add(t0, h, 8.0);
        usage.add(t0 + h, h, 4.0);
        assert!((usage.value_at(t0 + h, h) - 8.0).abs() < 1e-9);
        assert!((usage.value_at(t0 + 2 * h, h) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn idle_debt_decays_but_credit_is_not_banked() {
        let h = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut flow = Flow::default();
        flow.activate(5.0, t0, h);
        assert_eq!(flow.finish(), 5.0, "a newcomer starts at the virtual clock");
        flow.charge(5.0, 20.0, t0);
        flow.complete(0.0);
        flow.idle(t0);
        flow.activate(5.0, t0 + h, h);
        assert!(
            (flow.finish() - 15.0).abs() < 1e-9,
            "debt of 20 halves over one idle half-life"
        );
        flow.activate(100.0, t0 + h, h);
        assert_eq!(flow.finish(), 100.0, "no credit banked while idle");
    }

    #[test]
    fn debt_does_not_decay_while_in_flight() {
        let h = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut flow = Flow::default();
        flow.activate(0.0, t0, h);
        flow.charge(0.0, 3.0, t0);
        flow.activate(1.0, t0 + 4 * h, h);
        assert_eq!(flow.finish(), 3.0);
    }
}
