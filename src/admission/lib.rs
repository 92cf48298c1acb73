//! DAGOR admission control (seed 004), pure: no sockets, no clock, no
//! globals. One [`Admission`] per service instance.
//!
//! - **Priorities** ([`priority`]): business priority `B` and user priority
//!   `U`, each `1..=128`, lower = more important. `U` is a keyed hash of the
//!   user id whose key rotates every period (an hour by default), so one user
//!   keeps one `U` within the hour and users spread over all 128 values.
//! - **Histogram** ([`Histogram`]): `C[B][U]`, the requests that arrived in
//!   the current window, and its prefix sums in admission order.
//! - **Overload detection** ([`Window`]): the average queuing time (arrival
//!   to start of processing) over a window that ends after `window_ms` or
//!   `window_requests` samples, whichever comes first; overloaded when the
//!   average exceeds `queuing_threshold_us`.
//! - **Adaptive level** ([`Admission`]): at each window's end, overloaded:
//!   the level `(B*, U*)` moves down so that the admitted count falls to at
//!   most `(1 − α)·N_adm`; otherwise it moves up so that it reaches at least
//!   `(1 + β)·N_adm`. It never goes below [`AdmissionParams::floor`] (by
//!   default `(1, 128)`: the most important business class is never shed).
//!   One deviation, on by default: an overloaded window whose queue drains
//!   fast enough keeps the level ([`AdmissionParams::hold_while_draining`]).
//!   For the agent's own shedding, whose callers hold back below its level,
//!   a calm window's rise is placed on the demand's remembered mix
//!   ([`AdmissionParams::callers_hold_back`]), and requests the kernel
//!   dropped make a window overloaded ([`Admission::dropped`]).
//! - **Admission rule** ([`admits`]): `b < B*`, or `b == B*` and `u ≤ U*`.
//! - **The level on the wire** ([`piggyback`]): a 2-byte encoding a service
//!   can put in its own responses, and the FlatBuffers `AdmissionLevel`.
//! - **Holding back** ([`holdback`]): the caller's side of the agent's own
//!   shedding: the last level each shard sent, and whether to send at all.
//!
//! It must not touch: sockets, clocks, logging. Time is the caller's `now`
//! in microseconds on any monotonic clock.
//!
//! # Layout
//!
//! - [`priority`]: business and user priorities, the rotating user hash.
//! - `histogram` ([`Histogram`]): `C[B][U]` and its prefix sums.
//! - `window` ([`Window`]): queuing time over a window.
//! - `controller` ([`Admission`]): the adaptive level.
//! - [`piggyback`]: the level on the wire.
//! - [`holdback`]: a caller holding back below the agent's own level.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod controller;
mod histogram;
pub mod holdback;
pub mod piggyback;
pub mod priority;
mod window;

pub use controller::{
    Admission, AdmissionParams, WindowOutcome, CENSORED_STEP, HOLD_QUEUE_THRESHOLDS, MIN_DEMAND,
    NOT_HELD_BACK,
};
pub use histogram::{level_index, level_of_index, Histogram, LEVELS};
pub use lbagent_wire::AdmissionLevel;
pub use priority::{user_priority, UserPriorities};
pub use window::{Window, WindowEnd};

/// Microseconds on the caller's monotonic clock.
pub type Micros = u64;

/// The lowest (most important) priority value.
pub const MOST_IMPORTANT: u8 = 1;
/// The highest (least important) priority value.
pub const LEAST_IMPORTANT: u8 = 128;

/// The level that admits everything: `(128, 128)`.
pub const OPEN: AdmissionLevel = AdmissionLevel::new(LEAST_IMPORTANT, LEAST_IMPORTANT);

/// The admission rule: a request of priorities `(b, u)` is admitted under
/// `level` when `b < B*`, or `b == B*` and `u <= U*`.
pub fn admits(level: AdmissionLevel, b: u8, u: u8) -> bool {
    b < level.business || (b == level.business && u <= level.user)
}

/// A priority as a request carries it, made usable: 0 (unset) and values
/// above 128 count as the least important, 128.
pub fn clamp_priority(p: u8) -> u8 {
    if p == 0 || p > LEAST_IMPORTANT {
        LEAST_IMPORTANT
    } else {
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_at_its_boundaries() {
        let l = AdmissionLevel::new(10, 50);
        assert!(
            admits(l, 9, 128),
            "a more important business class passes whatever u"
        );
        assert!(admits(l, 10, 1));
        assert!(admits(l, 10, 50), "u == U* is admitted");
        assert!(!admits(l, 10, 51), "u == U* + 1 is not");
        assert!(
            !admits(l, 11, 1),
            "a less important business class never passes"
        );
        assert!(admits(OPEN, 128, 128), "the open level admits everything");
        let tightest = AdmissionLevel::new(1, 1);
        assert!(admits(tightest, 1, 1));
        assert!(!admits(tightest, 1, 2));
    }

    #[test]
    fn unset_or_out_of_range_priorities_are_the_least_important() {
        assert_eq!(clamp_priority(0), 128);
        assert_eq!(clamp_priority(200), 128);
        assert_eq!(clamp_priority(1), 1);
        assert_eq!(clamp_priority(128), 128);
    }
}
