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
//! Every unit is held by the client that took it (a [`ClientKey`]: its
//! UDP source, shared-memory slot or Unix connection): a report returns
//! one of *that client's* units of the node, and a report from a client
//! holding none frees nothing (a forged report cannot hand another
//! client's units back). A client holds at most the bound the caller passes
//! ([`Units::take_for`], `lb.units_per_client`), and a client that is gone
//! (its connection closed, its slot reclaimed) gives back everything it
//! held ([`Units::release_client`]).
//!
//! Kept apart from [`super::Node`] so that `l5` modules pay nothing for it:
//! [`super::ModuleLb`] holds an `Option<Box<Units>>`, `None` for them.
//! Vectors are indexed by the node's position in the module's route; a
//! route change rebuilds them by address ([`Units::rebuild`]).
//!
//! Pure: time is the caller's `now`, randomness a seeded xorshift.

use std::collections::{HashMap, VecDeque};

use super::balance::{Balance, NoChoice};
use super::node::{Millis, Node, NodeState};

/// Who took a unit: a number the shard derives from the request's channel
/// (a UDP source address, a shared-memory slot, a Unix connection), the
/// same for every request of one client.
pub type ClientKey = u64;

/// The client of the calls that name none ([`Units::take`],
/// [`Units::give_back`]): tools, tests, the callers of the plain API. It
/// is not bounded by the per-client limit.
pub const ANY_CLIENT: ClientKey = 0;

/// What one client holds of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    /// The node's address key.
    node: u64,
    /// Units in use.
    held: u32,
    /// Units given back (reported, or released with the client) whose
    /// deadline entry is still queued (skipped when it comes due).
    early: u32,
}

/// Why a client's draw took no unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakeRefused {
    /// The draw found nothing ([`NoChoice`]).
    NoChoice(NoChoice),
    /// The client already holds the most units one client may.
    ClientLimit,
}

/// One `balance` module's units on this agent.
#[derive(Clone, Debug)]
pub struct Units {
    router: Balance,
    /// Per node: its address key (the route's order), for rebuilds.
    keys: Vec<u64>,
    /// Per client: what it holds of each node (entries go when nothing is
    /// held and no deadline is queued).
    holders: HashMap<ClientKey, Vec<Held>>,
    /// `(deadline, node key, client)` of every unit handed out, in the
    /// order handed out (deadlines are non-decreasing: one time-out for
    /// all).
    deadlines: VecDeque<(Millis, u64, ClientKey)>,
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
            holders: HashMap::new(),
            deadlines: VecDeque::new(),
            held: 0,
            rng: (seed ^ 0x9E37_79B9_7F4A_7C15) | 1,
            timed_out: 0,
            consumed: vec![0; nodes.len()],
        }
    }

    /// Rebuilds for a new route: nodes that stay keep their units in use
    /// (and their holders), new ones start with none, removed ones are
    /// forgotten (their holders' entries go as the queued deadlines come
    /// due). O(n log n).
    pub fn rebuild(&mut self, nodes: &[Node]) {
        let mut old: Vec<(u64, u32, u32)> = self
            .keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, self.router.in_use(i), self.consumed[i]))
            .collect();
        old.sort_unstable();
        let kept = |key: u64| {
            old.binary_search_by_key(&key, |&(k, ..)| k)
                .map_or((0, 0), |p| (old[p].1, old[p].2))
        };
        self.keys = nodes.iter().map(|n| n.addr().key()).collect();
        let per_node: Vec<(u32, u32)> = self.keys.iter().map(|&k| kept(k)).collect();
        self.consumed = per_node.iter().map(|&(_, c)| c).collect();
        self.held = per_node.iter().map(|&(u, _)| u64::from(u)).sum();
        self.router = Balance::new(
            nodes
                .iter()
                .zip(&per_node)
                .map(|(n, &(used, _))| (capacity_of(n), used)),
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
    /// back by `deadline`, for [`ANY_CLIENT`]; `None` when no node has a
    /// free unit.
    pub fn take(&mut self, deadline: Millis) -> Option<usize> {
        self.take_for(ANY_CLIENT, u32::MAX, deadline).ok()
    }

    /// [`Units::take`] for `client`, which may hold at most `limit` units
    /// of the module at once.
    ///
    /// # Errors
    /// [`TakeRefused::ClientLimit`] when the client holds `limit` already,
    /// [`TakeRefused::NoChoice`] when no node has a free unit; nothing is
    /// taken.
    pub fn take_for(
        &mut self,
        client: ClientKey,
        limit: u32,
        deadline: Millis,
    ) -> Result<usize, TakeRefused> {
        if client != ANY_CLIENT && self.client_held(client) >= limit {
            return Err(TakeRefused::ClientLimit);
        }
        let u = self.next_u64();
        let no_unit = TakeRefused::NoChoice(NoChoice::NoFreeUnit);
        let i = self.router.choose(self.eta(), u).ok_or(no_unit)?;
        self.router.take(i).map_err(|_| no_unit)?;
        self.took(i, client, deadline);
        Ok(i)
    }

    /// Books node `i`'s unit just taken to `client`.
    fn took(&mut self, i: usize, client: ClientKey, deadline: Millis) {
        let node = self.keys[i];
        self.held += 1;
        self.deadlines.push_back((deadline, node, client));
        let held = self.holders.entry(client).or_default();
        match held.iter_mut().find(|h| h.node == node) {
            Some(h) => h.held += 1,
            None => held.push(Held {
                node,
                held: 1,
                early: 0,
            }),
        }
    }

    /// How many units `client` holds of the module.
    pub fn client_held(&self, client: ClientKey) -> u32 {
        self.holders
            .get(&client)
            .map_or(0, |h| h.iter().map(|h| h.held).sum())
    }

    /// How many clients hold units or wait for a queued deadline.
    pub fn clients(&self) -> usize {
        self.holders.len()
    }

    /// As [`Units::take_for`], drawing only among the nodes for which
    /// `admits` is true (a request's downstream admission levels): `Φ`
    /// restricted to them ([`Balance::choose_admitted`]).
    ///
    /// # Errors
    ///
    /// [`TakeRefused::ClientLimit`] as [`Units::take_for`];
    /// [`NoChoice::NoFreeUnit`] when no node has a free unit,
    /// [`NoChoice::NoneAdmits`] when some do but none of those admits;
    /// nothing is taken.
    pub fn take_admitted(
        &mut self,
        client: ClientKey,
        limit: u32,
        deadline: Millis,
        admits: impl Fn(usize) -> bool,
    ) -> Result<usize, TakeRefused> {
        if client != ANY_CLIENT && self.client_held(client) >= limit {
            return Err(TakeRefused::ClientLimit);
        }
        let eta = self.eta();
        let rng = &mut self.rng;
        let i = self
            .router
            .choose_admitted(eta, || xorshift(rng), admits)
            .map_err(TakeRefused::NoChoice)?;
        // The draw chose a node with a free unit.
        self.router
            .take(i)
            .map_err(|_| TakeRefused::NoChoice(NoChoice::NoFreeUnit))?;
        self.took(i, client, deadline);
        Ok(i)
    }

    /// A report for node `i` from [`ANY_CLIENT`] ([`Units::give_back_from`]).
    pub fn give_back(&mut self, i: usize) -> bool {
        self.give_back_from(ANY_CLIENT, i)
    }

    /// A report for node `i` from `client`: returns one of the units
    /// `client` holds of it. False when it holds none (a probe's report, a
    /// unit already timed out, a host this agent did not hand out to it):
    /// nothing is freed.
    pub fn give_back_from(&mut self, client: ClientKey, i: usize) -> bool {
        let node = self.keys[i];
        let Some(h) = self
            .holders
            .get_mut(&client)
            .and_then(|held| held.iter_mut().find(|h| h.node == node && h.held > 0))
        else {
            return false;
        };
        if self.router.give_back(i).is_err() {
            return false;
        }
        h.held -= 1;
        h.early += 1;
        self.held -= 1;
        true
    }

    /// `client` is gone (its connection closed, its slot reclaimed): every
    /// unit it holds goes back at once; `find` maps a node key to its
    /// position (None: the node left the route). Returns how many.
    pub fn release_client(
        &mut self,
        client: ClientKey,
        find: impl Fn(u64) -> Option<usize>,
    ) -> u32 {
        let Some(held) = self.holders.get_mut(&client) else {
            return 0;
        };
        let mut n = 0;
        for h in held.iter_mut() {
            if let Some(i) = find(h.node) {
                for _ in 0..h.held {
                    if self.router.give_back(i).is_ok() {
                        self.held -= 1;
                        n += 1;
                    }
                }
            }
            // Their deadlines stay queued: skipped when due.
            h.early += h.held;
            h.held = 0;
        }
        n
    }

    /// Returns the units due by `now` that were not reported; `find` maps a
    /// node key to its position (None: the node left the route). Returns
    /// how many returned by time-out. Costs the entries due.
    pub fn expire(&mut self, now: Millis, find: impl Fn(u64) -> Option<usize>) -> u32 {
        let mut n = 0;
        while let Some(&(at, key, client)) = self.deadlines.front() {
            if at > now {
                break;
            }
            self.deadlines.pop_front();
            let Some(held) = self.holders.get_mut(&client) else {
                continue;
            };
            let Some(p) = held.iter().position(|h| h.node == key) else {
                continue;
            };
            let h = &mut held[p];
            if h.early > 0 {
                h.early -= 1;
            } else if h.held > 0 {
                h.held -= 1;
                // A node that left the route: the router forgot its units.
                if let Some(i) = find(key) {
                    if self.router.give_back(i).is_ok() {
                        self.held -= 1;
                        n += 1;
                    }
                }
            }
            if h.held == 0 && h.early == 0 {
                held.swap_remove(p);
                if held.is_empty() {
                    self.holders.remove(&client);
                }
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
