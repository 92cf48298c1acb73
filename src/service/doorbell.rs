//! A one-bit wake-up across threads for a glommio task: a plain thread
//! (the route server's store thread, a `stop` call) rings, the one task
//! that waits wakes at once. The route server's update channel rings one
//! per executor; the stops of the route server's and the reporter's
//! executors are one too, so that an idle executor sleeps instead of
//! looking at a stop flag on a timer.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

/// A one-bit wake-up across threads: any thread [`ring`](Self::ring)s, one
/// task waits with [`rung`](Self::rung). Rings while nobody waits are
/// kept (as one): the next wait returns at once.
#[derive(Debug, Default)]
pub struct Doorbell {
    rung: AtomicBool,
    waiter: Mutex<Option<Waker>>,
}

impl Doorbell {
    /// Rings: the waiting task (or the next to wait) wakes.
    pub fn ring(&self) {
        self.rung.store(true, Ordering::SeqCst);
        let waker = self.waiter.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Ready once rung since the last time it was ready; takes the ring.
    pub fn poll_rung(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.rung.swap(false, Ordering::SeqCst) {
            return Poll::Ready(());
        }
        *self.waiter.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        // A ring between the check above and the waker's storing found no
        // waker to wake: look again.
        if self.rung.swap(false, Ordering::SeqCst) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Waits until rung (returns at once if rung since the last wait).
    pub async fn rung(&self) {
        poll_fn(|cx| self.poll_rung(cx)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::task::Wake;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn woken(c: &Arc<Count>) -> usize {
        c.0.load(Ordering::SeqCst)
    }

    #[test]
    fn a_ring_wakes_the_waiter_once_and_is_taken_by_the_next_poll() {
        let bell = Doorbell::default();
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(bell.poll_rung(&mut cx).is_pending());
        assert_eq!(woken(&count), 0);
        bell.ring();
        assert_eq!(woken(&count), 1);
        // Rings coalesce, and a ring with no waiter wakes nobody.
        bell.ring();
        assert_eq!(woken(&count), 1);
        assert!(bell.poll_rung(&mut cx).is_ready());
        assert!(bell.poll_rung(&mut cx).is_pending());
    }

    #[test]
    fn a_ring_before_the_wait_is_kept() {
        let bell = Doorbell::default();
        bell.ring();
        futures_lite::future::block_on(bell.rung());
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        assert!(bell
            .poll_rung(&mut Context::from_waker(&waker))
            .is_pending());
    }
}
