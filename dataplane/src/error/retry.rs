//! Whether a failed attempt may go to another host, key or box: the one classification the
//! four retry loops share (inference in `forward::send`, a cloud host's keys in its cloud
//! path, metadata reads in `proxy::send`, the hop in `queued::placed` with `relay`).
//!
//! After pingora's `fail_to_connect`: an attempt that never reached the upstream, or that
//! the upstream refused before doing any work, may go elsewhere; one that may have run may
//! not, unless running it again costs nothing (a read) or the host that ran it dropped it
//! with the connection (another host of the same box, see [`Attempt::may_go`]). Each loop
//! asks [`Attempt::may_go`]; what it does besides (marking a host down, counting) is its own.

/// How a failed attempt ended, as far as what it may have run upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// It never reached the upstream: the connection was refused or failed, or a reused
    /// connection was found closed before one byte of the request was read.
    NotSent,
    /// The upstream refused it before doing any work: Ollama's `503 server busy` or `404
    /// model not found`, a cloud key's rate limit, quota or refusal, a box's full queue, its
    /// failed hosts (none of which ran it) or its shutdown.
    Refused,
    /// It was written and the connection broke before the answer's head: it may have run,
    /// and stopped with the connection.
    Broken,
    /// It was written and no head came in time: it may be running still.
    Unanswered,
    /// An answer of the request's own, which any other would give too (a refusal of the
    /// request, not of the place): passed on, never tried elsewhere.
    Final,
}

/// Where a request whose attempt failed would go next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elsewhere {
    /// Another host of this box, for a dispatched request (inference, or anything queued).
    Host,
    /// Another key (account) of the same cloud host. Which key, account or host a refusal
    /// blames (and so whether the host is given up) is the cloud pool's ([`crate::cloud`]).
    Key,
    /// Another host, for a metadata read: never queued, run again at no cost.
    Read,
    /// Another box, through the hop.
    Box,
}

impl Attempt {
    /// Whether a request whose attempt ended so may go to `next`.
    ///
    /// Nothing ran after [`NotSent`](Self::NotSent) or [`Refused`](Self::Refused): anywhere
    /// may take it, but another key of a host that was not reached would not reach it either
    /// (the host's failover decides). A read may always go on. One that may be running still
    /// ([`Unanswered`](Self::Unanswered)) goes nowhere: it would run twice at once. One
    /// whose connection broke ([`Broken`](Self::Broken)) may go to another host of this box,
    /// which takes the broken one for down (as a client would send it again), but not to
    /// another key of the same host (the host failed, not the key) nor to another box (the
    /// owner's hosts may have run it; its own failover already had its turn).
    pub fn may_go(self, next: Elsewhere) -> bool {
        match (self, next) {
            (Self::Final, _) | (Self::NotSent, Elsewhere::Key) => false,
            (Self::NotSent | Self::Refused, _) | (_, Elsewhere::Read) => true,
            (Self::Broken, Elsewhere::Host) => true,
            (Self::Broken | Self::Unanswered, _) => false,
        }
    }

    /// Whether the attempt may have run upstream (it reached it and was not refused): its
    /// slot time is charged, and a request that fails after one is not the box's refusal.
    pub fn may_have_run(self) -> bool {
        matches!(self, Self::Broken | Self::Unanswered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_attempt_that_did_not_run_goes_anywhere_else() {
        use Attempt::*;
        use Elsewhere::{Box, Host, Key, Read};
        // (how the attempt ended, another host, another key, a read's next host, another box)
        let table = [
            (NotSent, true, false, true, true),
            (Refused, true, true, true, true),
            (Broken, true, false, true, false),
            (Unanswered, false, false, true, false),
            (Final, false, false, false, false),
        ];
        for (attempt, host, key, read, other_box) in table {
            let seen = (
                attempt.may_go(Host),
                attempt.may_go(Key),
                attempt.may_go(Read),
                attempt.may_go(Box),
            );
            assert_eq!(seen, (host, key, read, other_box), "{attempt:?}");
        }
        let ran: Vec<Attempt> = [NotSent, Refused, Broken, Unanswered, Final]
            .into_iter()
            .filter(|attempt| attempt.may_have_run())
            .collect();
        assert_eq!(ran, [Broken, Unanswered]);
    }
}
