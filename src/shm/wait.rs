//! How a client thread waits for its answer, from how long its recent
//! answers took: pure, no clock (the caller measures and passes durations).
//!
//! A waiting client spins [`SPIN`], then naps: futex waits that end by
//! their own timeout, which the shard need not end, so a busy shard answers
//! without a wake system call (a wake was the largest part of a busy
//! shard's time, perf: `try_to_wake_up`). Only after [`Plan::naps_for`]
//! does it declare itself asleep and let the shard wake it. How long it
//! naps follows how long answers have recently taken: a client of a shard
//! that answers in microseconds gives up napping after [`NAPS_FOR_MIN`] (a
//! register waiting for its route, a stopped shard), one of a shard that
//! keeps up with many clients only after a few times its usual wait.

use std::time::Duration;

/// How long a waiting client spins before it naps. Short: on a host with
/// fewer cores than busy threads a spinning client takes the core its
/// shard needs; long enough for a polling shard's answer (about 2.5 µs
/// here, README "Shared memory").
pub const SPIN: Duration = Duration::from_micros(10);

/// The shortest nap: one futex wait with this timeout (the kernel's timer
/// slack, 50 µs for a normal thread, makes a shorter one no shorter).
pub const NAP_MIN: Duration = Duration::from_micros(50);

/// The longest nap: an answer that arrives meanwhile waits at most this
/// long for its client to look.
pub const NAP_MAX: Duration = Duration::from_micros(200);

/// A client naps at least this long before it declares itself asleep.
pub const NAPS_FOR_MIN: Duration = Duration::from_micros(300);

/// ... and at most this long: past it the answer is not coming soon (the
/// shard is stopped or waits for a route), and the client sleeps until
/// the shard wakes it.
pub const NAPS_FOR_MAX: Duration = Duration::from_millis(4);

/// A client naps this many times its recent answer time.
pub const NAPS_FACTOR: u32 = 4;

/// A single answer time counts as at most this much in the average (a
/// register's 10 s wait would otherwise keep its client napping through
/// many later calls).
pub const SAMPLE_MAX: Duration = Duration::from_millis(8);

/// A client whose request is unanswered this long rings the shard's
/// doorbell whatever the region's `parked` word says: that word is
/// shared with every member of `shm.group`, and one that keeps writing 0
/// there would otherwise make every idle call wait for the shard's own
/// timer (about 300 ms, issue 27). Past the longest nap
/// ([`NAPS_FOR_MAX`]): a shard that answers at all answers sooner.
pub const RING_ANYWAY: Duration = Duration::from_millis(5);

/// Whether a client unanswered for `waited`, that last rang regardless at
/// `last` (time since its request), rings the doorbell now whatever
/// `parked` says: once past [`RING_ANYWAY`], then every `again`.
pub fn ring_anyway(waited: Duration, last: Option<Duration>, again: Duration) -> bool {
    waited >= RING_ANYWAY && last.is_none_or(|l| waited.saturating_sub(l) >= again)
}

/// How a client waits for one answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Each nap's futex timeout.
    pub nap: Duration,
    /// How long after the request it naps before it sleeps.
    pub naps_for: Duration,
}

/// The plan for a client whose recent answers took `recent` (see
/// [`smooth`]): naps of a quarter of it (within [`NAP_MIN`]..=[`NAP_MAX`])
/// for [`NAPS_FACTOR`] times it (within
/// [`NAPS_FOR_MIN`]..=[`NAPS_FOR_MAX`]).
pub fn plan(recent: Duration) -> Plan {
    Plan {
        nap: (recent / 4).clamp(NAP_MIN, NAP_MAX),
        naps_for: recent
            .saturating_mul(NAPS_FACTOR)
            .clamp(NAPS_FOR_MIN, NAPS_FOR_MAX),
    }
}

/// The recent answer time after one of `sample`: an exponentially
/// weighted average (weight 1/4 for the sample, capped at [`SAMPLE_MAX`]).
pub fn smooth(recent: Duration, sample: Duration) -> Duration {
    (recent * 3 + sample.min(SAMPLE_MAX)) / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn an_unanswered_client_rings_past_the_bound_then_at_each_interval() {
        let again = Duration::from_millis(20);
        let ms = Duration::from_millis;
        assert!(!ring_anyway(ms(4), None, again));
        assert!(ring_anyway(RING_ANYWAY, None, again));
        assert!(!ring_anyway(ms(15), Some(ms(5)), again));
        assert!(ring_anyway(ms(25), Some(ms(5)), again));
        assert!(RING_ANYWAY > NAPS_FOR_MAX);
    }

    #[test]
    fn a_fast_shard_gets_the_shortest_naps_for_the_shortest_time() {
        assert_eq!(
            plan(Duration::ZERO),
            Plan {
                nap: NAP_MIN,
                naps_for: NAPS_FOR_MIN
            }
        );
        assert_eq!(plan(3 * US), plan(Duration::ZERO));
    }

    #[test]
    fn a_busy_shard_gets_longer_naps_within_the_bounds() {
        let p = plan(500 * US);
        assert_eq!(p.nap, 125 * US);
        assert_eq!(p.naps_for, 2000 * US);
        let p = plan(Duration::from_secs(10));
        assert_eq!(p.nap, NAP_MAX);
        assert_eq!(p.naps_for, NAPS_FOR_MAX);
        // No overflow on absurd inputs.
        assert_eq!(plan(Duration::MAX).naps_for, NAPS_FOR_MAX);
    }

    #[test]
    fn the_average_follows_samples_and_caps_outliers() {
        let mut r = Duration::ZERO;
        for _ in 0..40 {
            r = smooth(r, 400 * US);
        }
        assert!(r > 399 * US && r <= 400 * US, "{r:?}");
        // One 10 s wait (a register) moves it by at most SAMPLE_MAX / 4.
        let after = smooth(r, Duration::from_secs(10));
        assert_eq!(after, (r * 3 + SAMPLE_MAX) / 4);
        // Fast answers bring it back down.
        let mut r = after;
        for _ in 0..40 {
            r = smooth(r, 2 * US);
        }
        assert!(r < 10 * US, "{r:?}");
    }
}
