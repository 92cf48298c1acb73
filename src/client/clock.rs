//! The client's clock: coarse monotonic milliseconds, read at most once per
//! getHost + report pair on the cached path (a report right after a cached
//! getHost goes by its time).
//!
//! `CLOCK_MONOTONIC_COARSE` is the kernel's last tick, read from the vDSO
//! without a system call and without reading the TSC: a few loads (about
//! 8 ns here, against 30 ns for `CLOCK_MONOTONIC`, which `Instant::now`
//! reads). It lags real time by at most one tick (1 to 10 ms, 4 ms on a
//! HZ=250 kernel), far below the 2 s the cache and the heartbeat rules
//! measure. Unix time (to compare with the agent's beat, which is Unix
//! milliseconds) is read only on the slow path.
//!
//! Tests drive time by hand ([`Clock::manual`]): then both readings are the
//! value the test set, so a test writes beats and advances the client's
//! clock on one timeline.

#[cfg(test)]
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
use std::sync::Arc;

/// Where a client's time comes from.
#[derive(Clone, Debug, Default)]
pub(crate) struct Clock {
    /// Time set by a test, milliseconds on both clocks.
    #[cfg(test)]
    manual: Option<Arc<AtomicU64>>,
}

impl Clock {
    /// The system's clocks.
    pub fn real() -> Clock {
        Clock::default()
    }

    /// A clock that reads `now` (milliseconds) as both monotonic and Unix
    /// time: the test moves it.
    #[cfg(test)]
    pub fn manual(now: Arc<AtomicU64>) -> Clock {
        Clock { manual: Some(now) }
    }

    /// Monotonic milliseconds (coarse: the kernel's last tick).
    #[inline(always)]
    pub fn now_ms(&self) -> u64 {
        #[cfg(test)]
        if let Some(m) = &self.manual {
            return m.load(Ordering::Relaxed);
        }
        coarse_monotonic_ms()
    }

    /// Unix milliseconds (precise; slow path only).
    pub fn unix_ms(&self) -> u64 {
        #[cfg(test)]
        if let Some(m) = &self.manual {
            return m.load(Ordering::Relaxed);
        }
        crate::agent::clock::unix_ms()
    }
}

/// `CLOCK_MONOTONIC_COARSE` in milliseconds.
#[inline(always)]
fn coarse_monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // Linux has had since 2.6.32, so the call cannot fail.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts);
    }
    (ts.tv_sec as u64) * 1_000 + (ts.tv_nsec as u64) / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coarse_clock_moves_forward_with_real_time() {
        let c = Clock::real();
        let a = c.now_ms();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let b = c.now_ms();
        // One tick of lag at each end at most (10 ms at HZ=100).
        assert!(b >= a + 10 && b < a + 10_000, "{a} then {b}");
    }

    #[test]
    fn a_manual_clock_reads_what_the_test_set_on_both_clocks() {
        let t = Arc::new(AtomicU64::new(5_000));
        let c = Clock::manual(t.clone());
        assert_eq!((c.now_ms(), c.unix_ms()), (5_000, 5_000));
        t.store(7_001, Ordering::Relaxed);
        assert_eq!((c.now_ms(), c.unix_ms()), (7_001, 7_001));
    }
}
