//! The `p2c` policy's arithmetic: each node's peak-EWMA of reported time
//! cost (Finagle's `PeakEwma`, as Linkerd uses it) and the choice of the
//! less loaded of two nodes. Pure: time is the caller's `now`.
//!
//! A node's load is its cost times its outstanding getHosts + 1, divided
//! by its weight share: a slow node, a busy node and a node that fails
//! (a failure is observed as at least [`FAILURE_COST_MS`]) all look
//! loaded. A node with no report yet and a getHost outstanding looks
//! loaded past any other ([`UNPROBED_LOAD`], Finagle's penalty), so that
//! an unknown node gets one request at a time until it answers.

use super::node::Millis;

/// How fast the cost forgets, milliseconds: an observation weighs
/// `1 − e^(−Δt/DECAY_MS)` against the cost held (Finagle's and Linkerd's
/// default decay of 10 s).
pub const DECAY_MS: f64 = 10_000.0;

/// A failed call is observed as taking at least this long, milliseconds:
/// a node that fails fast must not look fast.
pub const FAILURE_COST_MS: f64 = 1_000.0;

/// The cost below which two nodes count as equally fast, milliseconds
/// (reports carry whole milliseconds).
pub const MIN_COST_MS: f64 = 1.0;

/// The load of a node with a getHost outstanding and no report yet.
pub const UNPROBED_LOAD: f64 = 1e12;

/// One node's `p2c` state: its peak-EWMA cost and its outstanding getHosts.
#[derive(Clone, Debug, PartialEq)]
pub struct PeakEwma {
    cost: f64,
    stamp: Millis,
    observed: bool,
    outstanding: u32,
    last_report: Millis,
}

impl PeakEwma {
    /// A node first seen at `now`: no cost known, nothing outstanding.
    pub fn new(now: Millis) -> Self {
        PeakEwma {
            cost: 0.0,
            stamp: now,
            observed: false,
            outstanding: 0,
            last_report: now,
        }
    }

    /// The cost held, decayed toward 0 since the last observation.
    pub fn cost(&self, now: Millis) -> f64 {
        self.cost * decay(self.stamp, now)
    }

    /// getHosts handed out and not reported.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// A getHost chose the node.
    pub fn picked(&mut self) {
        self.outstanding = self.outstanding.saturating_add(1);
    }

    /// A call to the node was reported at `now`, `tcost_ms` long
    /// (failures at least [`FAILURE_COST_MS`]): a cost above the one held
    /// replaces it (the peak), a lower one is averaged in by the time since
    /// the last observation. One outstanding getHost is closed.
    pub fn observe(&mut self, success: bool, tcost_ms: u32, now: Millis) {
        let mut rtt = f64::from(tcost_ms);
        if !success {
            rtt = rtt.max(FAILURE_COST_MS);
        }
        if !self.observed || rtt > self.cost {
            self.cost = rtt;
        } else {
            let w = decay(self.stamp, now);
            self.cost = self.cost * w + rtt * (1.0 - w);
        }
        self.observed = true;
        self.stamp = self.stamp.max(now);
        self.closed(1, now);
    }

    /// `n` outstanding getHosts were reported without a time (a batch).
    pub fn closed(&mut self, n: u32, now: Millis) {
        self.outstanding = self.outstanding.saturating_sub(n);
        self.last_report = self.last_report.max(now);
    }

    /// getHosts outstanding with no report for `timeout_ms` are forgotten
    /// (a caller that never reports must not weigh a node down for ever).
    pub fn forget_stale(&mut self, now: Millis, timeout_ms: u64) {
        if self.outstanding > 0 && now.saturating_sub(self.last_report) >= timeout_ms {
            self.outstanding = 0;
            self.last_report = now;
        }
    }

    /// The node's load at `now` for a weight share `weight` (> 0): cost
    /// (at least [`MIN_COST_MS`]) × (outstanding + 1) / weight; with no
    /// report yet, [`UNPROBED_LOAD`] while a getHost is outstanding.
    pub fn load(&self, now: Millis, weight: f64) -> f64 {
        if !self.observed && self.outstanding > 0 {
            return UNPROBED_LOAD;
        }
        self.cost(now).max(MIN_COST_MS) * f64::from(self.outstanding.saturating_add(1)) / weight
    }
}

/// `e^(−(now − since)/DECAY_MS)`; 1 when `now` is not after `since`.
fn decay(since: Millis, now: Millis) -> f64 {
    (-(now.saturating_sub(since) as f64) / DECAY_MS).exp()
}

/// Two distinct positions among `k` (≥ 2) from two random numbers.
pub fn two_of(k: usize, r1: u64, r2: u64) -> (usize, usize) {
    debug_assert!(k >= 2);
    let a = (r1 % k as u64) as usize;
    let b = (a + 1 + (r2 % (k as u64 - 1)) as usize) % k;
    (a, b)
}

/// Of two candidates `(index, load)`, the less loaded (the first on a tie).
pub fn less_loaded(a: (u32, f64), b: (u32, f64)) -> u32 {
    if b.1 < a.1 {
        b.0
    } else {
        a.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_peak_is_taken_at_once_and_forgotten_slowly() {
        let mut e = PeakEwma::new(0);
        e.picked();
        e.observe(true, 2, 0);
        assert_eq!(e.cost(0), 2.0);
        e.observe(true, 50, 10);
        assert_eq!(e.cost(10), 50.0, "a peak replaces the cost");
        // A fast answer 10 s later weighs 1 - 1/e.
        e.observe(true, 2, 10_010);
        let want = 50.0 * (-1f64).exp() + 2.0 * (1.0 - (-1f64).exp());
        assert!((e.cost(10_010) - want).abs() < 1e-9);
    }

    #[test]
    fn a_failure_counts_as_slow() {
        let mut fast_fail = PeakEwma::new(0);
        fast_fail.observe(false, 0, 0);
        let mut slow = PeakEwma::new(0);
        slow.observe(true, 10, 0);
        assert!(fast_fail.load(0, 1.0) > slow.load(0, 1.0));
    }

    #[test]
    fn an_unknown_node_takes_one_request_at_a_time() {
        let mut e = PeakEwma::new(0);
        let idle_load = e.load(0, 1.0);
        e.picked();
        assert_eq!(e.load(0, 1.0), UNPROBED_LOAD);
        assert!(idle_load < UNPROBED_LOAD);
    }

    #[test]
    fn outstanding_gethosts_never_reported_are_forgotten() {
        let mut e = PeakEwma::new(0);
        e.picked();
        e.picked();
        e.forget_stale(29_999, 30_000);
        assert_eq!(e.outstanding(), 2);
        e.forget_stale(30_000, 30_000);
        assert_eq!(e.outstanding(), 0);
    }

    proptest! {
        /// Power of two choices never takes the worse of its two.
        #[test]
        fn never_the_worse_of_two(
            k in 2usize..50,
            r1 in any::<u64>(),
            r2 in any::<u64>(),
            costs in proptest::collection::vec((0u32..5_000, 0u32..100, any::<bool>()), 50),
            now in 0u64..100_000,
        ) {
            let nodes: Vec<PeakEwma> = costs.iter().map(|&(c, pending, ok)| {
                let mut e = PeakEwma::new(0);
                for _ in 0..pending { e.picked(); }
                e.observe(ok, c, 0);
                e
            }).collect();
            let (a, b) = two_of(k, r1, r2);
            prop_assert!(a != b && a < k && b < k);
            let la = nodes[a].load(now, 1.0);
            let lb = nodes[b].load(now, 1.0);
            let chosen = less_loaded((a as u32, la), (b as u32, lb));
            let (lc, lo) = if chosen as usize == a { (la, lb) } else { (lb, la) };
            prop_assert!(lc <= lo, "chose load {} over {}", lc, lo);
        }
    }
}
