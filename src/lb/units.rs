//! The balance policy's per-module state in one agent (seeds 002 and 003):
//! the capacity units this agent handed out and has not had back, and the
//! draw from `Φ` over what is left.
//!
//! Owns, per node of a `balance` module: its capacity (the route's weight,
//! 0 while L5 holds the node overloaded), the units in use (seed 003's
//! "running": getHost takes one, a report returns one), and the deadline of
//! every unit handed out (a unit not reported within `unit_timeout_ms`
//! returns by itself, counted). `η`, the concurrency the draw assumes, is
//! the module's getHosts in flight on this agent: the units in use plus the
//! one being chosen.
//!
//! Kept apart from [`super::Node`] so that `l5` modules pay nothing for it:
//! [`super::ModuleLb`] holds an `Option<Box<Units>>`, `None` for them.
//! Vectors are indexed by the node's position in the module's route; a
//! route change rebuilds them by address ([`Units::rebuild`]).
//!
//! Pure: time is the caller's `now`, randomness a seeded xorshift.

use std::collections::VecDeque;

use super::balance::{Balance, NoChoice};
use super::node::{Millis, Node, NodeState};

/// One `balance` module's units on this agent.
#[derive(Clone, Debug)]
pub struct Units {
    router: Balance,
    /// Per node: its address key (the route's order), for rebuilds.
    keys: Vec<u64>,
    /// Per node: units reported back early whose deadline entry is still
    /// queued in `deadlines` (skipped when it comes due).
    early: Vec<u32>,
    /// `(deadline, node key)` of every unit handed out, in the order handed
    /// out (deadlines are non-decreasing: one time-out for all).
    deadlines: VecDeque<(Millis, u64)>,
    /// Σ units in use.
    held: u64,
    rng: u64,
    /// Units returned by their time-out since the module was made.
    timed_out: u64,
    /// Per node: units reported consumed for good since the statistics
    /// were last taken.
    consumed: Vec<u32>,
}

impl PartialEq for Units {
    /// Two states are equal when every node has the same capacity and units
    /// in use (the draw's order and the random state aside).
    fn eq(&self, other: &Self) -> bool {
        self.keys == other.keys
            && (0..self.keys.len()).all(|i| {
                self.router.capacity(i) == other.router.capacity(i)
                    && self.router.in_use(i) == other.router.in_use(i)
            })
    }
}

/// A node's capacity as the balance policy counts it: its weight, none
/// while it is overloaded.
fn capacity_of(n: &Node) -> u32 {
    match n.state() {
        NodeState::Idle => n.weight(),
        NodeState::Overloaded => 0,
    }
}

impl Units {
    /// The state for `nodes`, no unit in use.
    pub fn new(nodes: &[Node]) -> Units {
        let seed = nodes.first().map_or(0, |n| n.addr().key());
        Units {
            router: Balance::new(nodes.iter().map(|n| (capacity_of(n), 0))),
            keys: nodes.iter().map(|n| n.addr().key()).collect(),
            early: vec![0; nodes.len()],
            deadlines: VecDeque::new(),
            held: 0,
            rng: (seed ^ 0x9E37_79B9_7F4A_7C15) | 1,
            timed_out: 0,
            consumed: vec![0; nodes.len()],
        }
    }

    /// Rebuilds for a new route: nodes that stay keep their units in use,
    /// new ones start with none, removed ones are forgotten (their queued
    /// deadlines are skipped when due). O(n log n).
    pub fn rebuild(&mut self, nodes: &[Node]) {
        let mut old: Vec<(u64, u32, u32, u32)> = self
            .keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, self.router.in_use(i), self.early[i], self.consumed[i]))
            .collect();
        old.sort_unstable();
        let kept = |key: u64| {
            old.binary_search_by_key(&key, |&(k, ..)| k)
                .map_or((0, 0, 0), |p| (old[p].1, old[p].2, old[p].3))
        };
        self.keys = nodes.iter().map(|n| n.addr().key()).collect();
        let per_node: Vec<(u32, u32, u32)> = self.keys.iter().map(|&k| kept(k)).collect();
        self.early = per_node.iter().map(|&(_, e, _)| e).collect();
        self.consumed = per_node.iter().map(|&(_, _, c)| c).collect();
        self.held = per_node.iter().map(|&(u, ..)| u64::from(u)).sum();
        self.router = Balance::new(
            nodes
                .iter()
                .zip(&per_node)
                .map(|(n, &(used, ..))| (capacity_of(n), used)),
        );
    }

    /// Node `i`'s capacity as the policy counts it changed (its weight or
    /// its overload state): O(n log n), as transitions are rare.
    pub fn refresh(&mut self, i: usize, node: &Node) {
        // `i` is a node of this module: the caller indexes its own nodes.
        let _ = self.router.set_capacity(i, capacity_of(node));
    }

    /// `η` for the next choice: the getHosts in flight, this one included.
    pub fn eta(&self) -> u64 {
        self.held + 1
    }

    /// Chooses a node by a draw from `Φ` and takes one of its units, due
    /// back by `deadline`; `None` when no node has a free unit.
    pub fn take(&mut self, deadline: Millis) -> Option<usize> {
        let u = self.next_u64();
        let i = self.router.choose(self.eta(), u)?;
        self.router.take(i).ok()?;
        self.held += 1;
        self.deadlines.push_back((deadline, self.keys[i]));
        Some(i)
    }

    /// As [`Units::take`], drawing only among the nodes for which `admits`
    /// is true (a request's downstream admission levels): `Φ` restricted
    /// to them ([`Balance::choose_admitted`]).
    ///
    /// # Errors
    ///
    /// [`NoChoice::NoFreeUnit`] when no node has a free unit,
    /// [`NoChoice::NoneAdmits`] when some do but none of those admits;
    /// nothing is taken.
    pub fn take_admitted(
        &mut self,
        deadline: Millis,
        admits: impl Fn(usize) -> bool,
    ) -> Result<usize, NoChoice> {
        let eta = self.eta();
        let rng = &mut self.rng;
        let i = self.router.choose_admitted(eta, || xorshift(rng), admits)?;
        // The draw chose a node with a free unit.
        self.router.take(i).map_err(|_| NoChoice::NoFreeUnit)?;
        self.held += 1;
        self.deadlines.push_back((deadline, self.keys[i]));
        Ok(i)
    }

    /// A report for node `i`: returns its oldest unit in use. False when it
    /// has none (a probe's report, a unit already timed out, a report of a
    /// host this agent did not hand out).
    pub fn give_back(&mut self, i: usize) -> bool {
        if self.router.give_back(i).is_err() {
            return false;
        }
        self.held -= 1;
        self.early[i] += 1;
        true
    }

    /// Returns the units due by `now` that were not reported; `find` maps a
    /// node key to its position (None: the node left the route). Returns
    /// how many returned by time-out. Costs the entries due.
    pub fn expire(&mut self, now: Millis, find: impl Fn(u64) -> Option<usize>) -> u32 {
        let mut n = 0;
        while let Some(&(at, key)) = self.deadlines.front() {
            if at > now {
                break;
            }
            self.deadlines.pop_front();
            let Some(i) = find(key) else { continue };
            if self.early[i] > 0 {
                self.early[i] -= 1;
            } else if self.router.give_back(i).is_ok() {
                self.held -= 1;
                n += 1;
            }
        }
        self.timed_out += u64::from(n);
        n
    }

    /// Node `i`'s capacity as counted now (0 while overloaded).
    pub fn capacity(&self, i: usize) -> u32 {
        self.router.capacity(i)
    }

    /// Node `i`'s units in use.
    pub fn in_use(&self, i: usize) -> u32 {
        self.router.in_use(i)
    }

    /// Node `i`'s `Φ` for the next choice (`η` = [`Units::eta`]).
    pub fn phi(&self, i: usize) -> f64 {
        self.router.phi(i, self.eta())
    }

    /// Σ units in use.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Σ free units.
    pub fn free(&self) -> u64 {
        self.router.total_free()
    }

    /// Units returned by their time-out since the module was made.
    pub fn timed_out(&self) -> u64 {
        self.timed_out
    }

    /// Node `i`'s call consumed `units` for good (sent with the statistics).
    pub fn add_consumed(&mut self, i: usize, units: u32) {
        self.consumed[i] = self.consumed[i].saturating_add(units);
    }

    /// Takes node `i`'s units consumed since the last call.
    pub fn take_consumed(&mut self, i: usize) -> u32 {
        std::mem::take(&mut self.consumed[i])
    }

    /// The draw's uniform `u64`.
    fn next_u64(&mut self) -> u64 {
        xorshift(&mut self.rng)
    }
}

/// xorshift64*: the next uniform `u64` from `state` (odd, so never 0).
#[inline]
fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

#[cfg(test)]
mod tests;
