//! Holding back what the agent would shed: the client side of the agent's
//! own DAGOR admission (collaborative admission with the agent itself).
//!
//! While an agent shard sheds, every getHost answer carries the shard's
//! own admission level (B*, U*). [`HoldBack`] remembers, per shard, the
//! last level seen and when. A getHost whose priorities that level does
//! not admit ([`crate::admits`], unset priorities counting as
//! 128) is refused at once with [`super::ClientError::Rejected`], without a
//! datagram: it would cost the overloaded shard a queue slot and an answer
//! only to be rejected (a `Rejected` costs the shard about what an answer
//! does, and the kernel's queue is FIFO, so shedding at the shard alone
//! does not protect the important calls; holding back at the caller does).
//!
//! **Freshness.** A level is trusted for [`super::ClientOptions::holdback`]
//! after the answer that carried it (default 100 ms, a few of the shard's
//! admission windows under load); an answer without a level (the shard no
//! longer sheds) forgets it at once. Once a level is stale, the next call
//! is sent whatever its priority, so a recovered shard is tried again.
//!
//! **No separate probes.** Every answer, accepted or rejected, carries the
//! shard's current level, so a client whose admitted calls keep flowing
//! sees the level rise as soon as the shard raises it; a client whose
//! calls are all held back sends its next call when the level goes stale
//! (one call per time-out per client: calls are synchronous). The shard's
//! controller steps its level up when a calm window saw nothing below it
//! (its histogram is censored by callers holding back), so it does recover.
//!
//! Pure: time (coarse monotonic milliseconds) is passed in.

use crate::{admits, clamp_priority, AdmissionLevel, LEAST_IMPORTANT, MOST_IMPORTANT};

/// The default freshness of a shard's level: 100 ms.
pub const DEFAULT_HOLDBACK_MS: u64 = 100;

/// A level a shard attached, and when it was seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    level: AdmissionLevel,
    at_ms: u64,
}

/// Per agent shard, the last level it attached (see the module
/// documentation).
#[derive(Clone, Debug, Default)]
pub struct HoldBack {
    /// Indexed by shard; `None` = no level (the shard admits everything).
    seen: Vec<Option<Seen>>,
    /// How long a level is trusted, in ms; 0 = never hold back.
    fresh_ms: u64,
    /// Calls held back so far.
    held: u64,
}

impl HoldBack {
    /// A table that trusts a level for `fresh_ms` (0: holding back is off).
    pub fn new(fresh_ms: u64) -> Self {
        HoldBack {
            seen: Vec::new(),
            fresh_ms,
            held: 0,
        }
    }

    /// Whether a getHost of priorities `(b, u)` to `shard` at `now_ms`
    /// must be held back (and counts it when so): the shard's level, seen
    /// at most `fresh_ms` ago, does not admit it.
    #[inline]
    pub fn hold(&mut self, shard: u32, b: u8, u: u8, now_ms: u64) -> bool {
        let Some(Some(s)) = self.seen.get(shard as usize) else {
            return false;
        };
        if now_ms.saturating_sub(s.at_ms) >= self.fresh_ms
            || admits(s.level, clamp_priority(b), clamp_priority(u))
        {
            return false;
        }
        self.held += 1;
        true
    }

    /// The answer of `shard` at `now_ms` carried `level` (`None`: the
    /// shard does not shed). A level with a part outside 1..=128 is not
    /// one the agent sends: it counts as none.
    #[inline]
    pub fn observe(&mut self, shard: u32, level: Option<AdmissionLevel>, now_ms: u64) {
        let i = shard as usize;
        if self.fresh_ms == 0 {
            return;
        }
        let valid = |l: &AdmissionLevel| {
            (MOST_IMPORTANT..=LEAST_IMPORTANT).contains(&l.business)
                && (MOST_IMPORTANT..=LEAST_IMPORTANT).contains(&l.user)
        };
        match level.filter(valid) {
            None => {
                if let Some(slot) = self.seen.get_mut(i) {
                    *slot = None;
                }
            }
            Some(level) => {
                if self.seen.len() <= i {
                    self.seen.resize(i + 1, None);
                }
                self.seen[i] = Some(Seen {
                    level,
                    at_ms: now_ms,
                });
            }
        }
    }

    /// Forgets every level (the agent moved: its shards are new).
    pub fn clear(&mut self) {
        self.seen.clear();
    }

    /// Calls held back so far.
    pub fn held(&self) -> u64 {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: AdmissionLevel = AdmissionLevel::new(10, 50);

    #[test]
    fn nothing_is_held_without_a_level() {
        let mut h = HoldBack::new(100);
        assert!(!h.hold(0, 128, 128, 5));
        h.observe(3, None, 5);
        assert!(!h.hold(3, 128, 128, 5));
        assert_eq!(h.held(), 0);
    }

    #[test]
    fn the_level_decides_at_its_boundaries() {
        let mut h = HoldBack::new(100);
        h.observe(1, Some(L), 1000);
        assert!(!h.hold(1, 9, 128, 1000), "a more important class passes");
        assert!(!h.hold(1, 10, 50, 1000), "u == U* is admitted");
        assert!(h.hold(1, 10, 51, 1000), "u == U* + 1 is held");
        assert!(h.hold(1, 11, 1, 1000), "a less important class is held");
        assert!(h.hold(1, 0, 0, 1000), "unset counts as (128, 128)");
        assert!(!h.hold(0, 128, 128, 1000), "another shard has no level");
        assert!(!h.hold(2, 128, 128, 1000), "a shard past the table");
        assert_eq!(h.held(), 3);
    }

    #[test]
    fn a_level_is_trusted_for_its_freshness_only() {
        let mut h = HoldBack::new(100);
        h.observe(0, Some(L), 1000);
        assert!(h.hold(0, 20, 1, 1099), "99 ms later: fresh");
        assert!(!h.hold(0, 20, 1, 1100), "100 ms later: stale, sent");
        h.observe(0, Some(L), 1100);
        assert!(h.hold(0, 20, 1, 1100), "a new answer refreshes it");
        // A clock that went back (never on a monotonic clock) holds.
        assert!(h.hold(0, 20, 1, 900));
    }

    #[test]
    fn an_answer_without_a_level_or_a_rising_level_lets_calls_through() {
        let mut h = HoldBack::new(100);
        h.observe(0, Some(L), 0);
        assert!(h.hold(0, 20, 1, 1));
        h.observe(0, Some(AdmissionLevel::new(20, 1)), 2);
        assert!(!h.hold(0, 20, 1, 3), "the level rose to admit it");
        h.observe(0, None, 4);
        assert!(!h.hold(0, 128, 128, 5), "the shard stopped shedding");
        h.observe(0, Some(L), 6);
        h.clear();
        assert!(!h.hold(0, 128, 128, 7), "the agent moved");
    }

    #[test]
    fn a_level_out_of_range_counts_as_none() {
        let mut h = HoldBack::new(100);
        h.observe(0, Some(L), 0);
        h.observe(0, Some(AdmissionLevel::new(0, 5)), 1);
        assert!(!h.hold(0, 128, 128, 2), "(0, 5) would hold everything");
        h.observe(0, Some(AdmissionLevel::new(5, 129)), 3);
        assert!(!h.hold(0, 128, 128, 4));
    }

    #[test]
    fn zero_freshness_never_holds() {
        let mut h = HoldBack::new(0);
        h.observe(0, Some(AdmissionLevel::new(1, 1)), 0);
        assert!(!h.hold(0, 128, 128, 0));
        assert_eq!(h.held(), 0);
    }
}
