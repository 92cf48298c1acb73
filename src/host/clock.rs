//! The agent's two clocks: monotonic milliseconds for the LB core (never
//! goes back), and Unix time for the heartbeat and the snapshot.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// The monotonic clock when the process first asked, nanoseconds.
static START: OnceLock<u64> = OnceLock::new();

/// Milliseconds since the process first asked, on a monotonic clock.
///
/// Read on every shard turn that serves something: `clock_gettime`
/// straight from the vDSO, integer arithmetic after, where `Instant::now`,
/// `elapsed` and `as_millis` cost about a hundred instructions more
/// (`Duration` subtraction with its checks, a `u128` product; callgrind,
/// issue 29).
#[inline]
pub fn now_ms() -> u64 {
    let start = *START.get_or_init(|| read_ns(libc::CLOCK_MONOTONIC));
    read_ns(libc::CLOCK_MONOTONIC).saturating_sub(start) / 1_000_000
}

/// Nanoseconds on clock `id` (`CLOCK_MONOTONIC`, `CLOCK_REALTIME`; 0 for a
/// time before the clock's epoch).
#[inline]
pub fn read_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the callers pass clock
    // ids every Linux the agent runs on has, so the call cannot fail (on
    // failure `ts` stays zero).
    unsafe {
        libc::clock_gettime(id, &mut ts);
    }
    u64::try_from(ts.tv_sec).map_or(0, |s| s * 1_000_000_000 + ts.tv_nsec as u64)
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
