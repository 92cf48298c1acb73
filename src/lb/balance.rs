//! The balance router of seed 002, pure: capacity-aware choice that many
//! independent, concurrent choosers can share without overflowing a node.
//!
//! Owns the probability `Φ` of choosing each node from the nodes' free
//! capacities and the concurrency `η`, and a draw from it. It must not touch
//! sockets, clocks, logging or randomness: the caller passes a uniform
//! random `u64` per draw.
//!
//! # The model (seed 002)
//!
//! Free capacity is counted in whole units (`M = 1`): node `i` has `n(i)`
//! free units, its capacity minus the units in use. The `η` concurrent
//! choosers are `η` balls to place in the boxes (nodes) at once, each ball
//! taking one free slot. The seed places them so that free capacity levels
//! out:
//!
//! 1. balls first fill the boxes with the most free slots, layer by layer,
//!    down to the **balance line** `B`: the lowest level such that the slots
//!    above it, `O = Σ max(0, n(i) − B)`, are no more than `η`;
//! 2. the `η − O` remaining balls go at random, at most one per box, into the
//!    layer just under the line (between `B` and `B − 1`), which the
//!    `N = #{i : n(i) ≥ B}` boxes reaching the line share. Each of them gets a
//!    remaining ball with the naive probability `P = (η − O)/N < 1`;
//! 3. boxes below the line (`n(i) < B`, the seed's boxes "far above the
//!    balance line" in its picture, whose free space starts lower) get
//!    nothing: they are **truncated**.
//!
//! A box above the line holds `Δi = n(i) − B` balls of the filled part, so
//! the expected number of balls in box `i` is `Δi + P`, and the probability
//! that one chooser (one ball) picks it is the seed's
//!
//! ```text
//! Φ(i) = (Δi + P) / (O + N·P)        (O + N·P = η)
//! ```
//!
//! for the `N` boxes reaching the line and 0 for the others. Consequences,
//! all property-tested below:
//!
//! - `Σ Φ = 1`;
//! - the **dilution constraint** `Φ(i)·η ≤ n(i)`: the expected number of the
//!   `η` concurrent choices that land on a node never exceeds its free units
//!   (`Δi + P < n(i) − B + 1 ≤ n(i)`, as `B ≥ 1`);
//! - a node with more free units is never less likely, a node with none is
//!   never chosen, nodes with equal free units are equally likely (the seed's
//!   "equal capacities": they reach or miss the line together);
//! - two boxes `n(0) = n(1) + δ` give `Φ(0) = 1/2 + δ/(2η)` and
//!   `Φ(1) = 1/2 − δ/(2η)` when `η ≥ δ`, and `Φ(0) = 1` when `η ≤ δ`;
//! - `η = 1` picks a node with the most free units.
//!
//! When `η` reaches the total free units `T`, every slot is filled and no
//! placement can keep `Φ(i)·η ≤ n(i)` for `η > T` (the `η` balls do not fit).
//! `Φ` is then the model's limit at `η = T`: `Φ(i) = n(i)/T`, every free unit
//! equally likely, so the balls that do fit are placed as the model places
//! them. In every case `Φ(i) = E[balls in box i] / min(η, T)`.
//!
//! # Where this differs from the seed's pseudo-code
//!
//! The pseudo-code sets `balance = box.capacity` for the last box whose
//! running `avail` (the slots above the *next* box's level) still fits, one
//! level too high: its `occupied` then counts fewer slots than the balls
//! fill, and `P = rest_require / rest_avail` becomes a per-slot probability
//! while `Φ` adds it once per box, so `Φ·η` is no longer the expected load.
//! When truncation happens at the first box its `occupied` even exceeds `η`.
//! This module implements the model the text and the formula describe
//! (above), which the tests check against a brute-force placement of the
//! balls; the seed's own example (7, 6, 6, 5, 3, 3, 2 free, `η = 15`) gives
//! `B = 3`, `O = 12`, `N = 6`, `P = 1/2`, `Φ = (4.5, 3.5, 3.5, 2.5, 0.5, 0.5, 0)/15`.
//!
//! # The draw, in O(log N)
//!
//! In exact integers, `Φ(i) = (N·Δi + r) / (N·η)` with `r = η − O`. A draw
//! takes `t` uniform in `[0, N·η)`: below `N·O` it picks the slot `t / N` of
//! the filled part (a box with probability `Δi / O`), otherwise box
//! `(t − N·O) / r` among the `N` boxes reaching the line (uniform). In the
//! `η ≥ T` case, `t` uniform in `[0, T)` picks a free unit.
//!
//! The nodes are kept sorted by free units, most first, with a Fenwick tree
//! of the free units over that order. The balance line is one descent of the
//! tree (`N` is the longest prefix whose slots above its last box's level are
//! at most `η`), and picking a slot is a second descent, so a draw costs
//! O(log N) and nothing is recomputed per node when `η` changes. Taking or
//! returning a unit moves the node by one place to the edge of its run of
//! equal free units (an O(1) swap found by an O(log N) binary search) and
//! updates one Fenwick entry: O(log N). Only a capacity change rebuilds the
//! order, O(N log N).
//!
//! # A draw restricted to the nodes that admit a request
//!
//! With downstream admission levels (DAGOR), a request may go only to the
//! nodes whose level admits it. [`Balance::choose_admitted`] draws from `Φ`
//! restricted to them: node `i` with probability `Φ(i) / Σ Φ(admitting)`,
//! the same line for the same `η`, so the admitting nodes keep their
//! relative shares. It first makes up to [`PLAIN_DRAWS`] plain draws and
//! keeps the first that lands on an admitting node, then, if none did, one
//! exact draw over the admitting nodes' integer shares. A plain draw
//! accepted only when its node admits is distributed as `Φ` restricted
//! (rejection sampling), and so is the exact draw, so their mix is exact.
//! Why not the exact draw alone: it asks every node with a free unit
//! whether it admits (a level lookup each, O(N log L)), while in the
//! common case (a few nodes levelled, or levels that admit the request)
//! the first plain draw lands on an admitting node for O(log N) and one
//! lookup. With an admitting share `m` the plain draws fall through with
//! probability `(1 − m)^4` (1/16 at `m = 1/2`), so the exact pass bounds the
//! worst case (O(N), as the `l5` walk of the idle list) without costing
//! the common one.
//!
//! When the admitting nodes have free units but `Φ` gives them nothing
//! (they are all below the balance line, which the `η` choosers spread
//! over every node set), there is no share to restrict to: the request is
//! drawn from the `Φ` of the admitting nodes alone, for the same `η` (the
//! model applied to the boxes the request may use; O(k log k) for `k`
//! admitting nodes, on this path only).

use thiserror::Error;

/// Why a unit could not be taken or returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum UnitError {
    /// The node index is not one of this router's nodes.
    #[error("node {0} is not one of the {1} nodes")]
    NoSuchNode(usize, usize),
    /// The node has no free unit to take.
    #[error("node {0} has no free unit")]
    NoFreeUnit(usize),
    /// The node has no unit in use to return.
    #[error("node {0} has no unit in use to return")]
    NoneInUse(usize),
}

/// How many plain draws [`Balance::choose_admitted`] makes before its exact
/// draw over the admitting nodes (see the module's doc).
pub const PLAIN_DRAWS: u32 = 4;

/// Why a draw restricted to the admitting nodes chose none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum NoChoice {
    /// No node has a free unit.
    #[error("no node has a free unit")]
    NoFreeUnit,
    /// Some node has a free unit, but none of those admits the request.
    #[error("no node with a free unit admits the request")]
    NoneAdmits,
}

/// The admitting nodes' part of a line (the exact restricted draw's first
/// pass).
#[derive(Debug, Clone, Copy)]
struct Mass {
    /// How many places hold a node with a free unit (a prefix).
    live: usize,
    /// Σ the admitting nodes' share numerators.
    mass: u64,
    /// Whether some node with a free unit admits.
    any: bool,
    /// The last place of an admitting node with a positive share.
    last: usize,
}

/// The balance router's state: per node, capacity and units in use, kept
/// sorted by free units for O(log N) draws.
#[derive(Debug, Clone)]
pub struct Balance {
    /// Per node: capacity in units.
    cap: Vec<u32>,
    /// Per node: units in use.
    used: Vec<u32>,
    /// Per node: its place in the sorted order.
    place: Vec<u32>,
    /// Per place: the node there (most free units first).
    order: Vec<u32>,
    /// Per place: that node's free units (non-increasing).
    sorted: Vec<u32>,
    /// Fenwick tree (1-based) over `free`.
    tree: Vec<u64>,
    /// Σ free.
    total: u64,
}

/// The balance line for one concurrency `η`: `Φ` in closed form.
///
/// Valid for the [`Balance`] it came from until a unit is taken or returned
/// or a capacity changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line {
    eta: u64,
    /// The balance line `B` (0 when every slot is filled: `η ≥ T`).
    balance: u64,
    /// `N`: the boxes reaching the line (they are the first `N` places).
    boxes: u64,
    /// `O`: slots above the line.
    occupied: u64,
    /// `r = η − O`: balls for the layer under the line.
    rest: u64,
    /// `T`: total free units.
    total: u64,
}

impl Line {
    /// The concurrency `η` this line is for (at least 1).
    pub fn eta(&self) -> u64 {
        self.eta
    }

    /// The balance line `B`; 0 when `η ≥ T` and every free unit is taken.
    pub fn balance(&self) -> u64 {
        self.balance
    }

    /// `N`: how many nodes may be chosen (those with at least `B` free units,
    /// or every node with a free unit when `η ≥ T`).
    pub fn boxes(&self) -> u64 {
        self.boxes
    }

    /// `O`: the free units above the balance line, filled first.
    pub fn occupied(&self) -> u64 {
        self.occupied
    }

    /// `r = η − O`: the choosers left for the layer under the line (0 when
    /// `η ≥ T`).
    pub fn rest(&self) -> u64 {
        self.rest
    }

    /// `T`: the total free units.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Whether `η ≥ T`: every free unit is filled and `Φ(i) = n(i)/T`.
    pub fn saturated(&self) -> bool {
        self.balance == 0
    }

    /// `Φ` of a node with `free` units, exactly, as `(numerator, denominator)`;
    /// the denominator is the same for every node and the numerators sum to it.
    pub fn share(&self, free: u32) -> (u64, u64) {
        let free = u64::from(free);
        if self.saturated() {
            return (free, self.total);
        }
        let num = if free >= self.balance {
            self.boxes * (free - self.balance) + self.rest
        } else {
            0
        };
        (num, self.boxes * self.eta)
    }

    /// `Φ` of a node with `free` units.
    pub fn phi(&self, free: u32) -> f64 {
        let (n, d) = self.share(free);
        n as f64 / d as f64
    }

    /// The size of the integer range a draw picks from.
    fn range(&self) -> u64 {
        if self.saturated() {
            self.total
        } else {
            self.boxes * self.eta
        }
    }
}

impl Balance {
    /// A router over nodes given as `(capacity, in_use)` units, in the
    /// caller's node order (node `i` is the `i`-th pair). A node whose units
    /// in use reach its capacity has no free unit.
    pub fn new(nodes: impl IntoIterator<Item = (u32, u32)>) -> Balance {
        let (cap, used): (Vec<u32>, Vec<u32>) = nodes.into_iter().unzip();
        let mut b = Balance {
            cap,
            used,
            place: Vec::new(),
            order: Vec::new(),
            sorted: Vec::new(),
            tree: Vec::new(),
            total: 0,
        };
        b.rebuild();
        b
    }

    /// A router over nodes of these capacities, no unit in use.
    pub fn with_capacities(capacities: &[u32]) -> Balance {
        Balance::new(capacities.iter().map(|&c| (c, 0)))
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.cap.len()
    }

    /// Whether there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.cap.is_empty()
    }

    /// Node `node`'s capacity in units (0 for an unknown node).
    pub fn capacity(&self, node: usize) -> u32 {
        self.cap.get(node).copied().unwrap_or(0)
    }

    /// Node `node`'s units in use (0 for an unknown node).
    pub fn in_use(&self, node: usize) -> u32 {
        self.used.get(node).copied().unwrap_or(0)
    }

    /// Node `node`'s free units: capacity minus units in use, at least 0
    /// (0 for an unknown node).
    pub fn free(&self, node: usize) -> u32 {
        self.capacity(node).saturating_sub(self.in_use(node))
    }

    /// The total free units `T`.
    pub fn total_free(&self) -> u64 {
        self.total
    }

    /// Sets node `node`'s capacity, keeping its units in use. Rebuilds the
    /// order: O(N log N).
    ///
    /// # Errors
    ///
    /// [`UnitError::NoSuchNode`] for an unknown node.
    pub fn set_capacity(&mut self, node: usize, capacity: u32) -> Result<(), UnitError> {
        self.check(node)?;
        if self.cap[node] != capacity {
            self.cap[node] = capacity;
            self.rebuild();
        }
        Ok(())
    }

    /// Takes one free unit of node `node` (a choice was made): O(log N).
    ///
    /// # Errors
    ///
    /// [`UnitError::NoSuchNode`] for an unknown node, [`UnitError::NoFreeUnit`]
    /// when it has no free unit (nothing changes).
    pub fn take(&mut self, node: usize) -> Result<(), UnitError> {
        self.check(node)?;
        if self.free(node) == 0 {
            return Err(UnitError::NoFreeUnit(node));
        }
        self.used[node] += 1;
        self.step_down(node);
        Ok(())
    }

    /// Returns one unit in use of node `node` (the work was reported done):
    /// O(log N). The node gains a free unit unless its units in use still
    /// reach its capacity (after a capacity cut).
    ///
    /// # Errors
    ///
    /// [`UnitError::NoSuchNode`] for an unknown node, [`UnitError::NoneInUse`]
    /// when it has no unit in use (nothing changes).
    pub fn give_back(&mut self, node: usize) -> Result<(), UnitError> {
        self.check(node)?;
        if self.used[node] == 0 {
            return Err(UnitError::NoneInUse(node));
        }
        let before = self.free(node);
        self.used[node] -= 1;
        if self.free(node) > before {
            self.step_up(node);
        }
        Ok(())
    }

    /// The balance line for `η` concurrent choosers (0 counts as 1): O(log N).
    /// `None` when no node has a free unit.
    pub fn line(&self, eta: u64) -> Option<Line> {
        if self.total == 0 {
            return None;
        }
        let eta = eta.max(1);
        if eta >= self.total {
            let boxes = self.sorted.iter().take_while(|&&f| f > 0).count() as u64;
            return Some(Line {
                eta,
                balance: 0,
                boxes,
                occupied: self.total,
                rest: 0,
                total: self.total,
            });
        }
        // The longest prefix of places whose slots above its last box's
        // level, Σ free − k·free[k−1], are at most η. Non-decreasing in k, so
        // one Fenwick descent finds it.
        let n = self.sorted.len();
        let (mut k, mut prefix) = (0usize, 0u64);
        let mut step = n.next_power_of_two();
        while step > 0 {
            let q = k + step;
            if q <= n {
                let sum = prefix + self.tree[q];
                if sum - q as u64 * u64::from(self.sorted[q - 1]) <= eta {
                    k = q;
                    prefix = sum;
                }
            }
            step /= 2;
        }
        // The slots above the next level exceed η (η < T covers k = n), so
        // the line lies strictly above it: ⌈(prefix − η)/k⌉ ≥ 1.
        let boxes = k as u64;
        let balance = (prefix - eta).div_ceil(boxes);
        let occupied = prefix - boxes * balance;
        let rest = eta - occupied;
        debug_assert!(balance >= 1 && rest < boxes);
        Some(Line {
            eta,
            balance,
            boxes,
            occupied,
            rest,
            total: self.total,
        })
    }

    /// `Φ` of node `node` for `η` concurrent choosers (0 for an unknown node
    /// or when no node has a free unit). O(log N).
    pub fn phi(&self, node: usize, eta: u64) -> f64 {
        match self.line(eta) {
            Some(l) if node < self.len() => l.phi(self.free(node)),
            _ => 0.0,
        }
    }

    /// Draws a node from `Φ` for `η` concurrent choosers, with `u` a uniform
    /// random `u64`: O(log N). `None` when no node has a free unit. Does not
    /// take the unit: call [`Balance::take`] for the node used.
    pub fn choose(&self, eta: u64, u: u64) -> Option<usize> {
        self.line(eta).map(|l| self.draw(&l, u))
    }

    /// Draws a node from the `Φ` of `line`, which must come from this router
    /// unchanged since, with `u` a uniform random `u64`: O(log N).
    pub fn draw(&self, line: &Line, u: u64) -> usize {
        let t = ((u128::from(u) * u128::from(line.range())) >> 64) as u64;
        self.order[self.draw_place(line, t)] as usize
    }

    /// Draws a node from `Φ` for `η` concurrent choosers restricted to the
    /// nodes for which `admits` is true (`Φ(i) / Σ Φ(admitting)`; the
    /// admitting nodes' own `Φ` when that sum is 0 though some of them has
    /// a free unit), taking uniform random `u64`s from `next_u` (at most
    /// [`PLAIN_DRAWS`] + 1). `admits` must answer the same for a node
    /// throughout the call. O(log N) when a plain draw lands on an
    /// admitting node, else O(N) (see the module's doc). Does not take the
    /// unit.
    ///
    /// # Errors
    ///
    /// [`NoChoice::NoFreeUnit`] when no node has a free unit;
    /// [`NoChoice::NoneAdmits`] when some do but none of those admits.
    pub fn choose_admitted(
        &self,
        eta: u64,
        mut next_u: impl FnMut() -> u64,
        admits: impl Fn(usize) -> bool,
    ) -> Result<usize, NoChoice> {
        let line = self.line(eta).ok_or(NoChoice::NoFreeUnit)?;
        for _ in 0..PLAIN_DRAWS {
            let i = self.draw(&line, next_u());
            if admits(i) {
                return Ok(i);
            }
        }
        self.draw_admitted(&line, next_u(), admits)
    }

    /// The exact restricted draw of [`Balance::choose_admitted`], with `u`
    /// a uniform random `u64`: one pass over the nodes with a free unit
    /// sums the admitting ones' shares, a second walks them to the share
    /// that `u` picks.
    fn draw_admitted(
        &self,
        line: &Line,
        u: u64,
        admits: impl Fn(usize) -> bool,
    ) -> Result<usize, NoChoice> {
        let m = self.admitted_mass(line, &admits);
        if m.mass == 0 {
            return if m.any {
                self.draw_among_admitting(line.eta(), u, m.live, admits)
            } else {
                Err(NoChoice::NoneAdmits)
            };
        }
        let t = ((u128::from(u) * u128::from(m.mass)) >> 64) as u64;
        Ok(self.walk_admitted(line, &m, t, admits))
    }

    /// The first pass of the exact restricted draw: the admitting nodes'
    /// shares of `line`, summed.
    fn admitted_mass(&self, line: &Line, admits: impl Fn(usize) -> bool) -> Mass {
        let live = self.sorted.partition_point(|&f| f > 0);
        let mut m = Mass {
            live,
            mass: 0,
            any: false,
            last: 0,
        };
        for p in 0..live {
            if admits(self.order[p] as usize) {
                m.any = true;
                let share = line.share(self.sorted[p]).0;
                if share > 0 {
                    m.mass += share;
                    m.last = p;
                }
            }
        }
        m
    }

    /// The second pass: the node whose admitting share holds `t` in
    /// `[0, m.mass)`, walking the places in order.
    fn walk_admitted(
        &self,
        line: &Line,
        m: &Mass,
        mut t: u64,
        admits: impl Fn(usize) -> bool,
    ) -> usize {
        for p in 0..m.last {
            let share = line.share(self.sorted[p]).0;
            if share > 0 && admits(self.order[p] as usize) {
                if t < share {
                    return self.order[p] as usize;
                }
                t -= share;
            }
        }
        // What is left of the mass is the last admitting share.
        self.order[m.last] as usize
    }

    /// Draws from the `Φ` of the admitting nodes among the first `live`
    /// places alone (every one with a free unit, some admitting), for `η`.
    #[cold]
    fn draw_among_admitting(
        &self,
        eta: u64,
        u: u64,
        live: usize,
        admits: impl Fn(usize) -> bool,
    ) -> Result<usize, NoChoice> {
        let nodes: Vec<usize> = self.order[..live]
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| admits(i))
            .collect();
        let sub = Balance::new(nodes.iter().map(|&i| (self.free(i), 0)));
        sub.choose(eta, u)
            .map(|j| nodes[j])
            .ok_or(NoChoice::NoneAdmits)
    }

    /// The place drawn by `t` in `[0, line.range())`; exposed to the tests,
    /// which enumerate every `t`.
    fn draw_place(&self, line: &Line, t: u64) -> usize {
        if line.saturated() {
            return self.slot_place(t, 0, self.sorted.len());
        }
        let k = line.boxes;
        if t < k * line.occupied {
            self.slot_place(t / k, line.balance, k as usize)
        } else {
            ((t - k * line.occupied) / line.rest) as usize
        }
    }

    /// The place holding slot `slot` when places `[0, limit)` hold
    /// `free − level` slots each (all positive there): a Fenwick descent.
    fn slot_place(&self, slot: u64, level: u64, limit: usize) -> usize {
        let (mut p, mut acc) = (0usize, 0u64);
        let mut step = self.sorted.len().next_power_of_two();
        while step > 0 {
            let q = p + step;
            if q <= limit {
                let s = acc + self.tree[q] - step as u64 * level;
                if s <= slot {
                    p = q;
                    acc = s;
                }
            }
            step /= 2;
        }
        p
    }

    fn check(&self, node: usize) -> Result<(), UnitError> {
        if node < self.len() {
            Ok(())
        } else {
            Err(UnitError::NoSuchNode(node, self.len()))
        }
    }

    /// Node `node` lost one free unit: move it to the last place of its run
    /// of equal free units, then lower that place.
    fn step_down(&mut self, node: usize) {
        let v = self.sorted[self.place[node] as usize];
        let last = self.sorted.partition_point(|&f| f >= v) - 1;
        self.swap_to(node, last);
        self.sorted[last] -= 1;
        self.add(last, u64::MAX); // −1, wrapping
        self.total -= 1;
    }

    /// Node `node` gained one free unit: move it to the first place of its
    /// run of equal free units, then raise that place.
    fn step_up(&mut self, node: usize) {
        let v = self.sorted[self.place[node] as usize];
        let first = self.sorted.partition_point(|&f| f > v);
        self.swap_to(node, first);
        self.sorted[first] += 1;
        self.add(first, 1);
        self.total += 1;
    }

    /// Swaps node `node` with the node at place `to` (same free units).
    fn swap_to(&mut self, node: usize, to: usize) {
        let from = self.place[node] as usize;
        let other = self.order[to] as usize;
        self.order.swap(from, to);
        self.place[node] = to as u32;
        self.place[other] = from as u32;
    }

    /// Adds `delta` (wrapping) to the Fenwick entry of place `at`.
    fn add(&mut self, at: usize, delta: u64) {
        let mut i = at + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add(delta);
            i += i & i.wrapping_neg();
        }
    }

    fn rebuild(&mut self) {
        let n = self.cap.len();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.free(i as usize)));
        self.sorted = order.iter().map(|&i| self.free(i as usize)).collect();
        self.place = vec![0; n];
        for (p, &i) in order.iter().enumerate() {
            self.place[i as usize] = p as u32;
        }
        self.order = order;
        // Linear Fenwick build.
        self.tree = vec![0; n + 1];
        for i in 1..=n {
            self.tree[i] += u64::from(self.sorted[i - 1]);
            let j = i + (i & i.wrapping_neg());
            if j <= n {
                self.tree[j] += self.tree[i];
            }
        }
        self.total = self.sorted.iter().map(|&f| u64::from(f)).sum();
    }
}

#[cfg(test)]
mod tests;
