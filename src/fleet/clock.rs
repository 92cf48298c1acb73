//! Wall-clock milliseconds since the Unix epoch that never go back: read
//! once at start, advanced by the monotonic clock. Every program of the
//! lab runs on one machine (namespaces share the clock), so their times
//! compare.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A clock started at the wall-clock time of its creation.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin_ms: u64,
    origin: Instant,
}

impl Clock {
    /// A clock reading the wall clock now.
    pub fn new() -> Clock {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("the system clock is after 1970");
        Clock {
            origin_ms: wall.as_millis() as u64,
            origin: Instant::now(),
        }
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        self.origin_ms + self.origin.elapsed().as_millis() as u64
    }

    /// The instant at which this clock reads `ms` (now, if that is past).
    pub fn instant_at(&self, ms: u64) -> Instant {
        let now = self.now_ms();
        Instant::now() + std::time::Duration::from_millis(ms.saturating_sub(now))
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}
