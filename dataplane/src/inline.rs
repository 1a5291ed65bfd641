//! A connection's wake-ups from inside its own poll, taken inline.
//!
//! hyper serves an HTTP/1 connection and runs its handler in one task, and the two talk
//! through channels (the request body, the dispatcher's read and write notifications): the
//! handler reading the body wakes the connection's dispatcher, and the dispatcher handing it
//! a chunk wakes the handler, each time the same task, woken while it runs. tokio
//! reschedules such a task at the back of its worker's queue and wakes an idle worker to
//! share it, which finds nothing to do and parks again: four futex calls and a context
//! switch on the other CPU per request (`docs/performance.md`). [`Inline`] notices a wake-up that arrives while the
//! future it wraps is being polled and polls it again at once instead, while the task has
//! scheduling budget left ([`tokio::task::coop`]) and at most [`MAX_INLINE`] times a
//! poll; any other wake-up, from another task or thread or after the poll, goes to the
//! runtime as it is.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Most polls of one wake-up from inside the wrapped future before it is handed to the
/// runtime (as hyper's own dispatcher yields after a few rounds, so that one busy
/// connection does not starve the others on its worker).
pub const MAX_INLINE: usize = 8;

/// Not being polled.
const IDLE: u8 = 0;
/// Being polled, not woken since the poll began.
const POLLING: u8 = 1;
/// Being polled, and woken during it.
const WOKEN: u8 = 2;

/// A future whose wake-ups during its own poll are taken by polling it again.
pub struct Inline<F> {
    inner: Pin<Box<F>>,
    state: Arc<State>,
    waker: Waker,
}

struct State {
    phase: AtomicU8,
    /// The task's own waker, for the wake-ups that come from outside a poll.
    task: AtomicWaker,
}

impl Wake for State {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // While a poll runs, the wake-up is noted and taken by that poll; otherwise it is the
        // task's. Noting it always writes (the poll's swap then sees every write made before
        // the wake-up).
        let mut phase = self.phase.load(Ordering::Acquire);
        loop {
            if phase == IDLE {
                self.task.wake();
                return;
            }
            match self.phase.compare_exchange_weak(
                phase,
                WOKEN,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(actual) => phase = actual,
            }
        }
    }
}

impl<F> std::fmt::Debug for Inline<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inline").finish_non_exhaustive()
    }
}

impl<F: Future> Inline<F> {
    /// Wraps `future`.
    pub fn new(future: F) -> Self {
        let state = Arc::new(State {
            phase: AtomicU8::new(IDLE),
            task: AtomicWaker::new(),
        });
        Self {
            inner: Box::pin(future),
            waker: Waker::from(state.clone()),
            state,
        }
    }
}

impl<F: Future> Future for Inline<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        this.state.task.register(cx.waker());
        let mut inner = Context::from_waker(&this.waker);
        for _ in 0..MAX_INLINE {
            this.state.phase.store(POLLING, Ordering::Release);
            if let Poll::Ready(output) = this.inner.as_mut().poll(&mut inner) {
                this.state.phase.store(IDLE, Ordering::Release);
                return Poll::Ready(output);
            }
            // From here on a wake-up goes to the task; one that came during the poll is
            // taken by polling again.
            if this.state.phase.swap(IDLE, Ordering::AcqRel) == POLLING {
                return Poll::Pending;
            }
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        // Woken during every poll, or out of budget: the runtime decides when to go on.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A waker that counts its wake-ups.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Waker, Arc<Count>) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (Waker::from(count.clone()), count)
    }

    /// Polls `future` once with a waker that counts its wake-ups.
    fn poll_once<F: Future>(future: &mut Inline<F>) -> (Poll<F::Output>, usize) {
        let (waker, count) = counting();
        let poll = Pin::new(future).poll(&mut Context::from_waker(&waker));
        (poll, count.0.load(Ordering::SeqCst))
    }

    #[test]
    fn a_wake_up_during_the_poll_is_taken_by_polling_again() {
        let mut polls = 0;
        let mut future = Inline::new(std::future::poll_fn(move |cx| {
            polls += 1;
            if polls < 3 {
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(polls)
            }
        }));
        assert_eq!(poll_once(&mut future), (Poll::Ready(3), 0));
    }

    #[test]
    fn a_wake_up_from_another_thread_during_the_poll_is_taken_by_polling_again() {
        let mut polls = 0;
        let mut future = Inline::new(std::future::poll_fn(move |cx| {
            polls += 1;
            if polls == 1 {
                let waker = cx.waker().clone();
                std::thread::spawn(move || waker.wake()).join().unwrap();
                Poll::Pending
            } else {
                Poll::Ready(polls)
            }
        }));
        assert_eq!(poll_once(&mut future), (Poll::Ready(2), 0));
    }

    #[test]
    fn a_future_that_always_wakes_itself_is_handed_back_to_the_runtime() {
        let mut future = Inline::new(std::future::poll_fn(|cx| {
            cx.waker().wake_by_ref();
            Poll::<()>::Pending
        }));
        assert_eq!(poll_once(&mut future), (Poll::Pending, 1));
    }

    #[test]
    fn a_wake_up_after_the_poll_reaches_the_task() {
        let stored = Arc::new(std::sync::Mutex::new(None::<Waker>));
        let keep = stored.clone();
        let mut future = Inline::new(std::future::poll_fn(move |cx| {
            *keep.lock().unwrap() = Some(cx.waker().clone());
            Poll::<()>::Pending
        }));
        let (waker, count) = counting();
        let poll = Pin::new(&mut future).poll(&mut Context::from_waker(&waker));
        assert!(poll.is_pending());
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "not woken during the poll"
        );
        let later = stored.lock().unwrap().take().unwrap();
        std::thread::spawn(move || later.wake()).join().unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the task is woken");
    }
}
