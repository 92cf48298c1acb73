//! A module's options beyond the original L5 (issue 31): its weights,
//! slow start, ejection limit, panic threshold and the `p2c` policy's
//! state, resolved from the module's own options over the agent's `[lb]`
//! defaults. [`super::ModuleLb`] holds one only when some of it is on, so
//! that the original's path pays one test.

use super::node::{Millis, Node};
use super::p2c::PeakEwma;
use super::params::LbParams;
use super::weights::{ramped, scaled_weight, slow_start_share};
use lbagent_model::{ModuleOptions, RouteNode};

/// The options in force for one module: its own where set, the agent's
/// defaults otherwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Resolved {
    /// Slow-start window, milliseconds; 0 = off.
    pub slow_start_ms: u64,
    /// Slow start's aggression.
    pub aggression: f64,
    /// Slow start's floor, percent of the weight.
    pub min_weight_percent: u8,
    /// The ejection limit, percent of the nodes; 100 = none.
    pub max_overloaded_percent: u8,
    /// The panic threshold, percent of the nodes idle; 0 = off.
    pub panic_percent: u8,
    /// The locality spill threshold, percent (held for the locality code).
    pub locality_min_percent: u8,
}

impl Resolved {
    /// `own` over `p`'s defaults.
    pub fn new(own: &ModuleOptions, p: &LbParams) -> Self {
        Resolved {
            slow_start_ms: own.slow_start_ms.map_or(p.slow_start_ms, u64::from),
            aggression: p.slow_start_aggression,
            min_weight_percent: p.slow_start_min_weight_percent,
            max_overloaded_percent: own
                .max_overloaded_percent
                .unwrap_or(p.max_overloaded_percent),
            panic_percent: own.panic_percent.unwrap_or(p.panic_percent),
            locality_min_percent: own.locality_min_percent.unwrap_or(p.locality_min_percent),
        }
    }

    /// True when every option is off or neutral: the original's behaviour.
    /// (`locality_min_percent` is not looked at: the locality code applies
    /// it only where nodes carry zones.)
    pub fn is_neutral(&self) -> bool {
        self.slow_start_ms == 0 && self.max_overloaded_percent >= 100 && self.panic_percent == 0
    }
}

/// The per-module state of the options: per node (indexed as the
/// module's nodes) the smooth round robin's current weight, when the node
/// last entered the idle list, and its `p2c` cost; the module's panic
/// episode.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuned {
    /// The options in force.
    pub opts: Resolved,
    /// The module's policy is `p2c`.
    pub p2c: bool,
    /// The idle nodes' weights are not all equal.
    pub weighted: bool,
    /// Smooth weighted round robin's current weight per node.
    pub current: Vec<i64>,
    /// When each node last entered the idle list.
    pub entered: Vec<Millis>,
    /// The `p2c` cost per node (empty unless `p2c`).
    pub cost: Vec<PeakEwma>,
    /// The `p2c` draws' generator, seeded per module: reproducible.
    pub rng: fastrand::Rng,
    /// The module is in panic now.
    pub panicking: bool,
    /// A panic began (true) or ended (false) and nobody has been told.
    pub panic_news: Option<bool>,
    /// The next node of the panic round robin.
    pub panic_next: usize,
    /// getHosts answered in panic.
    pub panic_answers: u64,
    /// Overload marks the ejection limit held back.
    pub held_back: u64,
}

impl Tuned {
    /// Fresh state for `nodes`, every node at full weight (as if it had
    /// entered the idle list long ago).
    pub fn new(opts: Resolved, p2c: bool, nodes: &[Node], now: Millis) -> Self {
        let seed = nodes.first().map_or(0x31, |n| n.key()) ^ 0x9e37_79b9_7f4a_7c15;
        Tuned {
            opts,
            p2c,
            weighted: unequal_weights(nodes),
            current: vec![0; nodes.len()],
            entered: vec![0; nodes.len()],
            cost: if p2c {
                vec![PeakEwma::new(now); nodes.len()]
            } else {
                Vec::new()
            },
            rng: fastrand::Rng::with_seed(seed),
            panicking: false,
            panic_news: None,
            panic_next: 0,
            panic_answers: 0,
            held_back: 0,
        }
    }

    /// The route changed: `remap[old] = new index` (u32::MAX for a node
    /// gone), `len` nodes now, the new ones (not in `remap`'s image)
    /// entering the idle list at `now`.
    pub fn remap(&mut self, remap: &[u32], nodes: &[Node], now: Millis) {
        let len = nodes.len();
        let mut current = vec![0; len];
        let mut entered = vec![now; len];
        let mut cost = if self.p2c {
            vec![PeakEwma::new(now); len]
        } else {
            Vec::new()
        };
        for (old, &new) in remap.iter().enumerate() {
            if new == u32::MAX {
                continue;
            }
            let new = new as usize;
            current[new] = self.current[old];
            entered[new] = self.entered[old];
            if self.p2c && old < self.cost.len() {
                cost[new] = self.cost[old].clone();
            }
        }
        self.current = current;
        self.entered = entered;
        self.cost = cost;
        self.weighted = unequal_weights(nodes);
    }

    /// Switches `p2c` on or off, keeping the costs when it stays on.
    pub fn set_p2c(&mut self, on: bool, len: usize, now: Millis) {
        if on && self.cost.len() != len {
            self.cost = vec![PeakEwma::new(now); len];
        }
        if !on {
            self.cost = Vec::new();
        }
        self.p2c = on;
    }

    /// Node `i` entered the idle list at `now`: its ramp starts, its round
    /// robin credit is cleared.
    pub fn entered_idle(&mut self, i: usize, now: Millis) {
        self.entered[i] = now;
        self.current[i] = 0;
    }

    /// A node's weight as the choice counts it at `now`: its route weight
    /// (scaled) times its slow-start share, `entered` being when it last
    /// entered the idle list.
    pub fn weight_of(opts: &Resolved, entered: Millis, node: &Node, now: Millis) -> i64 {
        let w = scaled_weight(node.weight());
        if opts.slow_start_ms == 0 {
            return w;
        }
        let share = slow_start_share(
            now.saturating_sub(entered),
            opts.slow_start_ms,
            opts.aggression,
            opts.min_weight_percent,
        );
        ramped(w, share)
    }

    /// Whether getHost needs the weighted choice (else plain rotation).
    pub fn weighs(&self) -> bool {
        self.weighted || self.opts.slow_start_ms > 0
    }
}

/// False when every entry of `route` has the same weight (0 counted as
/// 1): then its nodes' weights are all equal. True may be a duplicate's
/// weight alone ([`unequal_weights`] over the nodes decides). One pass
/// without an early exit, which the compiler vectorizes: a route update
/// of 10,000 equal-weight nodes pays about one instruction a node.
pub fn route_weights_differ(route: &[RouteNode]) -> bool {
    let Some(first) = route.first() else {
        return false;
    };
    let w0 = first.weight.max(1);
    route.iter().fold(0, |acc, r| acc | (r.weight.max(1) ^ w0)) != 0
}

/// True when the nodes' weights (0 counted as 1) are not all equal.
pub fn unequal_weights(nodes: &[Node]) -> bool {
    let mut w = nodes.iter().map(|n| n.weight().max(1));
    match w.next() {
        Some(first) => w.any(|x| x != first),
        None => false,
    }
}
