//! The route cache (the original's CacheLayer), sans-IO: which node to
//! return, when to ask the agent for the route again, and which reports to
//! hold or send. Time is an argument; the client shell does the sending.
//!
//! # Rules
//!
//! - A module's route is kept in process while the agent says no node of it
//!   is overloaded; getHost then chooses round robin locally, starting at a
//!   random node (so that many processes do not all begin with the same one).
//! - The route is refreshed at most every [`REFRESH_INTERVAL`] (2 s) while
//!   the module is in use, with the cache getRoute message naming the
//!   version held (an unchanged route costs no route transfer); the first
//!   getHost after a failure report refreshes at once, so that a node the
//!   failure made overloaded is seen without delay.
//! - While any node of the module is overloaded, every getHost goes through
//!   the agent ([`Pick::PassThrough`]), as without the cache, and every
//!   report is sent at once.
//! - Successful reports of a cached module are held, counted per node, and
//!   sent as one batch report: before the module's refresh (so at most every
//!   2 s while it is in use), when the oldest has been held
//!   [`HOLD_LIMIT`] at a report, when [`MAX_HELD_NODES`] nodes are held,
//!   before any failure report of the module (so the agent sees them in the
//!   order they happened), and on [`super::Client::flush`] or drop.
//! - Failures are never held, nor reports that carry a downstream
//!   admission level ([`RouteCache::refresh_soon`]); the agent reads a
//!   module any of whose nodes has a live level as overloaded, so the cache
//!   passes its getHosts through the agent, which applies the levels.
//! - A success reported for a node that is not in the cached route is
//!   dropped (neither held nor sent), and a route change drops the held
//!   successes of the nodes that left, as the original's cache does: they
//!   belong to a route the agent no longer has.
//! - When a refresh is not answered (timeout, or the agent's port refused
//!   it) and a route is cached with no node overloaded, the cached route
//!   keeps answering ([`RouteCache::pick_unrefreshed`]), as the original
//!   does; the next getHost tries the refresh again. The static route file
//!   is for when no route is cached, or the agent's heartbeat is stale.
//!
//! # Speed
//!
//! A getHost the cache answers and a success it holds are memory work
//! only ([`RouteCache::pick_cached`], [`RouteCache::hold`]): the entry of
//! the module used last is kept out of the vector of entries, in the cache
//! itself ("hot"), and a call about that module reaches it with one
//! compare of the module as one word (another module is found through a
//! foldhash map, seeded per process, and swapped in); "serve" and "hold"
//! are each one comparison with a precomputed deadline; round robin is an
//! increment and a conditional move; held successes are counts kept beside
//! each node of the route, indexed by its position (the report's node is
//! found as the node given last, else by binary search), with the positions
//! held listed in the order first held. Nothing allocates there.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use lbagent_model::{ModuleId, NodeAddr, RouteNode};

/// How often a module in use is asked for again, at most: milliseconds.
pub const REFRESH_INTERVAL_MS: u64 = 2_000;

/// [`REFRESH_INTERVAL_MS`] as a duration.
pub const REFRESH_INTERVAL: std::time::Duration =
    std::time::Duration::from_millis(REFRESH_INTERVAL_MS);

/// The longest a success is held before the next report of its module
/// sends the batch: milliseconds.
pub const HOLD_LIMIT_MS: u64 = 2_000;

/// [`HOLD_LIMIT_MS`] as a duration.
pub const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_millis(HOLD_LIMIT_MS);

/// The most distinct nodes one batch report carries (12 bytes each: a
/// batch stays far below a datagram's limit).
pub const MAX_HELD_NODES: usize = 1_024;

/// The most modules cached; getHosts of further modules pass through.
pub const MAX_MODULES: usize = 65_536;

/// What the cache answers a getHost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// This node, chosen locally.
    Host(NodeAddr),
    /// Ask the agent for the route first (cache getRoute with
    /// `known_version`, 0 = none held), then pick again.
    Refresh {
        /// The version held, 0 when none.
        known_version: u64,
    },
    /// Go through the agent for this getHost.
    PassThrough,
}

/// The agent's answer to a cache getRoute, as the cache needs it.
#[derive(Clone, Copy, Debug)]
pub struct Refreshed<'a> {
    /// The route's version.
    pub version: u64,
    /// True when the route is the one held (`nodes` is then empty).
    pub unchanged: bool,
    /// True when any node of the module is overloaded.
    pub any_overloaded: bool,
    /// The route's nodes when it changed.
    pub nodes: &'a [RouteNode],
}

/// A node of the cached route and the successes held for it.
#[derive(Clone, Copy, Debug)]
struct Slot {
    addr: NodeAddr,
    /// Successes held (0: none; the position is then not in `held`). A
    /// u64 never fills up, so the cached path's only test is "not 0"; a
    /// batch carries u32 counts and splits a larger one.
    held: u64,
}

#[derive(Debug)]
struct Entry {
    version: u64,
    /// The route, in the agent's order, with the held counts. Kept when
    /// the route is forgotten (the held counts name their nodes by
    /// position).
    slots: Vec<Slot>,
    /// `(node, position)` sorted by node: the report path's lookup.
    sorted: Vec<(NodeAddr, u32)>,
    /// The position given last (< `slots.len()` when any): round robin
    /// gives the one after it, and a report is usually about it.
    last: usize,
    any_overloaded: bool,
    /// When the route was last refreshed; None: never (or forgotten).
    refreshed_at: Option<u64>,
    /// Refresh at the next getHost (a failure was reported).
    refresh_now: bool,
    /// getHost is answered here while `now < serve_until` (0: not now):
    /// a route cached, no node overloaded, no refresh due.
    serve_until: u64,
    /// The positions whose count is not 0, in the order first held.
    held: Vec<u32>,
    /// When the oldest held success was reported.
    held_since: u64,
    /// `held_since + HOLD_LIMIT_MS` while anything is held, else `u64::MAX`:
    /// a report at or after it sends the batch.
    hold_until: u64,
    /// `hold_until` while [`Entry::holds`], else 0: the cached report
    /// path's one time check.
    hold_open_until: u64,
}

impl Default for Entry {
    fn default() -> Self {
        Entry {
            version: 0,
            slots: Vec::new(),
            sorted: Vec::new(),
            last: 0,
            any_overloaded: false,
            refreshed_at: None,
            refresh_now: false,
            serve_until: 0,
            held: Vec::new(),
            held_since: 0,
            hold_until: u64::MAX,
            hold_open_until: 0,
        }
    }
}

impl Entry {
    fn cached(&self) -> bool {
        self.refreshed_at.is_some() && !self.slots.is_empty()
    }

    /// A route is cached and no node of it is overloaded: successes are
    /// held.
    fn holds(&self) -> bool {
        self.cached() && !self.any_overloaded
    }

    /// Recomputes `serve_until` and `hold_open_until` after any change of
    /// state.
    fn update(&mut self) {
        self.serve_until = match self.refreshed_at {
            Some(t) if self.holds() && !self.refresh_now => t.saturating_add(REFRESH_INTERVAL_MS),
            _ => 0,
        };
        self.sync_hold();
    }

    /// Recomputes `hold_open_until` after [`Entry::holds`] or `hold_until`
    /// changed.
    fn sync_hold(&mut self) {
        self.hold_open_until = if self.holds() { self.hold_until } else { 0 };
    }

    /// The position of `host` in the route: the node given last, else
    /// found by binary search.
    fn position(&self, host: NodeAddr) -> Option<usize> {
        if self.slots.get(self.last).is_some_and(|s| s.addr == host) {
            return Some(self.last);
        }
        self.search(host)
    }

    /// The position of `host` in the route, by binary search.
    fn search(&self, host: NodeAddr) -> Option<usize> {
        self.sorted
            .binary_search_by(|(a, _)| a.cmp(&host))
            .ok()
            .map(|k| self.sorted[k].1 as usize)
    }

    /// The next node, round robin; None for an empty route.
    #[inline(always)]
    fn next_host(&mut self) -> Option<NodeAddr> {
        let i = self.last + 1;
        // One test on the way (the bounds check); back to the start once
        // per round.
        match self.slots.get(i) {
            Some(s) => {
                self.last = i;
                Some(s.addr)
            }
            None => self.first_host(),
        }
    }

    /// Round robin back at the start.
    fn first_host(&mut self) -> Option<NodeAddr> {
        self.last = 0;
        self.slots.first().map(|s| s.addr)
    }

    /// [`RouteCache::hold`] for a node other than the one given last
    /// (which the caller compared already).
    #[inline(never)]
    fn hold_elsewhere(&mut self, host: NodeAddr) -> bool {
        match self.search(host) {
            Some(p) => add_one_held(&mut self.slots[p]),
            None => false,
        }
    }

    /// Moves the held successes into `out`, in the order first held (a
    /// count above u32::MAX as several).
    fn take_held(&mut self, out: &mut Vec<(NodeAddr, u32)>) {
        for &p in &self.held {
            let s = &mut self.slots[p as usize];
            while s.held > 0 {
                let n = u32::try_from(s.held).unwrap_or(u32::MAX);
                out.push((s.addr, n));
                s.held -= u64::from(n);
            }
        }
        self.held.clear();
        self.hold_until = u64::MAX;
        self.sync_hold();
    }

    /// Counts `n` more successes of the node at `p`; `now` starts the hold
    /// when nothing was held.
    fn add_held(&mut self, p: usize, n: u64, now: u64) {
        if self.held.is_empty() {
            self.held_since = now;
            self.hold_until = now.saturating_add(HOLD_LIMIT_MS);
            self.sync_hold();
        }
        let s = &mut self.slots[p];
        if s.held == 0 {
            self.held.push(p as u32);
        }
        s.held = s.held.saturating_add(n);
    }

    /// Takes a new route; keeps the held successes of the nodes still in
    /// it, in the order first held.
    fn set_route(&mut self, nodes: &[RouteNode], start: usize) {
        let kept: Vec<(NodeAddr, u64)> = self
            .held
            .iter()
            .map(|&p| {
                let s = self.slots[p as usize];
                (s.addr, s.held)
            })
            .collect();
        let held_since = self.held_since;
        self.slots.clear();
        self.slots.extend(nodes.iter().map(|n| Slot {
            addr: n.addr,
            held: 0,
        }));
        self.sorted.clear();
        self.sorted.extend(
            self.slots
                .iter()
                .enumerate()
                .map(|(p, s)| (s.addr, p as u32)),
        );
        self.sorted.sort_unstable();
        self.held.clear();
        self.hold_until = u64::MAX;
        self.sync_hold();
        // Round robin gives `start` first.
        let n = self.slots.len();
        self.last = (start % n + n - 1) % n;
        for (addr, k) in kept {
            if let Some(p) = self.position(addr) {
                self.add_held(p, k, held_since);
            }
        }
    }
}

/// Counts one more success of `slot` when it is already held: the cached
/// report path.
#[inline(always)]
fn add_one_held(slot: &mut Slot) -> bool {
    if slot.held == 0 {
        return false;
    }
    slot.held += 1;
    true
}

/// Every module's cached route and held successes.
#[derive(Debug)]
pub struct RouteCache {
    /// Module to index in `entries` (entries are never removed).
    index: HashMap<ModuleId, u32, RandomState>,
    /// Every module's entry but the hot one's (whose place holds an empty
    /// entry while it is out).
    entries: Vec<Entry>,
    /// The entry of the module used last, out of `entries` (at
    /// `hot_index`): the cached paths reach it with one compare of
    /// `hot_key`. An empty entry (every deadline 0) while `hot_index` is
    /// None.
    hot: Entry,
    /// The hot module ([`module_key`]); [`NO_MODULE`] while `hot_index` is
    /// None.
    hot_key: u64,
    /// Where the hot entry belongs in `entries`.
    hot_index: Option<usize>,
}

/// A module as one word: the hot entry's compare.
#[inline(always)]
fn module_key(m: ModuleId) -> u64 {
    (u64::from(m.modid) << 32) | u64::from(m.cmdid)
}

/// `hot_key` before any module is hot. It is also a module's key,
/// (u32::MAX, u32::MAX): the cached paths then find the empty hot entry,
/// whose deadlines decline every call; the other paths look at
/// `hot_index` too.
const NO_MODULE: u64 = u64::MAX;

impl Default for RouteCache {
    fn default() -> Self {
        RouteCache {
            index: HashMap::default(),
            entries: Vec::new(),
            hot: Entry::default(),
            hot_key: NO_MODULE,
            hot_index: None,
        }
    }
}

impl RouteCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// `module`'s entry, made hot, if it has one.
    fn entry(&mut self, module: ModuleId) -> Option<&mut Entry> {
        let key = module_key(module);
        if self.hot_index.is_none() || key != self.hot_key {
            let i = *self.index.get(&module)? as usize;
            self.make_hot(i, key);
        }
        Some(&mut self.hot)
    }

    /// Puts the hot entry back in its place and takes out entry `i`.
    fn make_hot(&mut self, i: usize, key: u64) {
        if let Some(h) = self.hot_index {
            std::mem::swap(&mut self.hot, &mut self.entries[h]);
        }
        std::mem::swap(&mut self.hot, &mut self.entries[i]);
        self.hot_index = Some(i);
        self.hot_key = key;
    }

    /// Entry `i`, wherever it is.
    fn get(&self, i: usize) -> &Entry {
        if self.hot_index == Some(i) {
            &self.hot
        } else {
            &self.entries[i]
        }
    }

    /// `module`'s entry, made hot; created if there is room for it
    /// (`bounded`) or in any case.
    fn entry_or_insert(&mut self, module: ModuleId, bounded: bool) -> Option<&mut Entry> {
        let hot = self.hot_index.is_some() && module_key(module) == self.hot_key;
        if !hot && !self.index.contains_key(&module) {
            if bounded && self.entries.len() >= MAX_MODULES {
                return None;
            }
            let i = self.entries.len();
            self.entries.push(Entry::default());
            self.index.insert(module, i as u32);
        }
        self.entry(module)
    }

    /// The cached path of a getHost: the next node of `module`'s route,
    /// round robin, when `module` is the module used last (the hot entry)
    /// and the cache answers it at `now_ms` (a route cached, no node
    /// overloaded, no refresh due); None: ask
    /// [`RouteCache::pick_cached_other`], then [`RouteCache::pick`].
    #[inline(always)]
    pub fn pick_cached(&mut self, module: ModuleId, now_ms: u64) -> Option<NodeAddr> {
        if module_key(module) != self.hot_key || now_ms >= self.hot.serve_until {
            return None;
        }
        self.hot.next_host()
    }

    /// [`RouteCache::pick_cached`] for a module that may not be hot: makes
    /// it hot first (a map lookup and a swap), if it has an entry.
    pub fn pick_cached_other(&mut self, module: ModuleId, now_ms: u64) -> Option<NodeAddr> {
        self.entry(module)?;
        self.pick_cached(module, now_ms)
    }

    /// What to do for a getHost of `module` at `now_ms` (monotonic).
    pub fn pick(&mut self, module: ModuleId, now_ms: u64) -> Pick {
        let Some(e) = self.entry_or_insert(module, true) else {
            return Pick::PassThrough;
        };
        if now_ms < e.serve_until {
            if let Some(addr) = e.next_host() {
                return Pick::Host(addr);
            }
        }
        let due = match e.refreshed_at {
            None => true,
            Some(t) => e.refresh_now || now_ms.saturating_sub(t) >= REFRESH_INTERVAL_MS,
        };
        if due {
            return Pick::Refresh {
                known_version: if e.cached() { e.version } else { 0 },
            };
        }
        // Not due and not served: a node is overloaded (or no nodes).
        Pick::PassThrough
    }

    /// A refresh of `module` went unanswered: the next node of the cached
    /// route, round robin, when a route is cached and no node of it was
    /// overloaded at the last refresh; None otherwise (no route to serve:
    /// the caller falls back as without the cache). The refresh stays due,
    /// so the next getHost asks again.
    pub fn pick_unrefreshed(&mut self, module: ModuleId) -> Option<NodeAddr> {
        let e = self.entry(module)?;
        if e.holds() {
            e.next_host()
        } else {
            None
        }
    }

    /// Applies the agent's answer to a cache getRoute of `module`;
    /// `start` picks where round robin starts in a new route. Returns false
    /// (and changes nothing) when the answer says "unchanged" about a
    /// version the cache does not hold, or carries a route without nodes:
    /// a bad response.
    pub fn refreshed(
        &mut self,
        module: ModuleId,
        r: &Refreshed<'_>,
        now_ms: u64,
        start: usize,
    ) -> bool {
        let Some(e) = self.entry_or_insert(module, false) else {
            return false;
        };
        if r.unchanged {
            if !e.cached() || e.version != r.version {
                return false;
            }
        } else {
            if r.nodes.is_empty() {
                return false;
            }
            e.set_route(r.nodes, start);
            e.version = r.version;
        }
        e.any_overloaded = r.any_overloaded;
        e.refreshed_at = Some(now_ms);
        e.refresh_now = false;
        e.update();
        true
    }

    /// The agent knows no route for `module` (or the refresh failed): drop
    /// the route, so that the next getHost asks again. Held successes stay
    /// until they are sent.
    pub fn forget(&mut self, module: ModuleId) {
        if let Some(e) = self.entry(module) {
            e.version = 0;
            e.refreshed_at = None;
            e.any_overloaded = false;
            e.update();
        }
    }

    /// The cached path of a success report: counts it, held, and returns
    /// true when `module` is the module used last (the hot entry), holds
    /// successes at `now_ms`, and this node is of its route and already
    /// held (no batch is due); false: ask [`RouteCache::hold_other`], then
    /// [`RouteCache::report`], which decides in every case.
    #[inline(always)]
    pub fn hold(&mut self, module: ModuleId, host: NodeAddr, now_ms: u64) -> bool {
        if module_key(module) != self.hot_key || now_ms >= self.hot.hold_open_until {
            return false;
        }
        let e = &mut self.hot;
        match e.slots.get_mut(e.last) {
            Some(s) if s.addr == host => add_one_held(s),
            _ => e.hold_elsewhere(host),
        }
    }

    /// [`RouteCache::hold`] for a module that may not be hot: makes it hot
    /// first (a map lookup and a swap), if it has an entry.
    pub fn hold_other(&mut self, module: ModuleId, host: NodeAddr, now_ms: u64) -> bool {
        self.entry(module).is_some() && self.hold(module, host, now_ms)
    }

    /// Records a report of `module` at `now_ms`. Moves into `out` the
    /// successes that must be sent (as one batch) before anything else;
    /// returns true when this report must be sent now, after that batch,
    /// and false when it is held, or dropped (a success for a node that is
    /// not in the cached route).
    pub fn report(
        &mut self,
        module: ModuleId,
        host: NodeAddr,
        retcode: i32,
        now_ms: u64,
        out: &mut Vec<(NodeAddr, u32)>,
    ) -> bool {
        let Some(e) = self.entry(module) else {
            return true;
        };
        if retcode != 0 {
            e.take_held(out);
            e.refresh_now = true;
            e.update();
            return true;
        }
        if !e.holds() {
            e.take_held(out);
            return true;
        }
        let Some(p) = e.position(host) else {
            return false;
        };
        let count = e.slots[p].held;
        let full = count == 0 && e.held.len() >= MAX_HELD_NODES;
        let old = now_ms >= e.hold_until;
        if full || old {
            e.take_held(out);
        }
        e.add_held(p, 1, now_ms);
        false
    }

    /// Makes the next getHost of `module` refresh the route (a report
    /// carried a downstream admission level: the agent's answer then says
    /// whether to pass getHosts through it). Issue 12, collaborative
    /// admission: the agent reads a module with levels as overloaded.
    pub fn refresh_soon(&mut self, module: ModuleId) {
        if let Some(e) = self.entry(module) {
            e.refresh_now = true;
            e.update();
        }
    }

    /// Moves `module`'s held successes into `out` (before a refresh).
    pub fn take_held(&mut self, module: ModuleId, out: &mut Vec<(NodeAddr, u32)>) {
        if let Some(e) = self.entry(module) {
            e.take_held(out);
        }
    }

    /// The modules that hold successes, for a flush of everything.
    pub fn modules_holding(&self) -> Vec<ModuleId> {
        self.index
            .iter()
            .filter(|(_, &i)| !self.get(i as usize).held.is_empty())
            .map(|(m, _)| *m)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const M: ModuleId = ModuleId::new(1, 1);

    fn node(i: u8) -> NodeAddr {
        NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
    }

    fn route(n: u8) -> Vec<RouteNode> {
        (1..=n)
            .map(|i| RouteNode {
                addr: node(i),
                weight: 1,
            })
            .collect()
    }

    fn fresh(version: u64, nodes: &[RouteNode], any_overloaded: bool) -> Refreshed<'_> {
        Refreshed {
            version,
            unchanged: false,
            any_overloaded,
            nodes,
        }
    }

    fn unchanged(version: u64, any_overloaded: bool) -> Refreshed<'static> {
        Refreshed {
            version,
            unchanged: true,
            any_overloaded,
            nodes: &[],
        }
    }

    fn cached(start: usize) -> RouteCache {
        let mut c = RouteCache::new();
        assert_eq!(c.pick(M, 0), Pick::Refresh { known_version: 0 });
        assert!(c.refreshed(M, &fresh(5, &route(3), false), 0, start));
        c
    }

    #[test]
    fn a_cached_route_is_served_round_robin_from_the_start_given() {
        let mut c = cached(1);
        let picks: Vec<Pick> = (0..4).map(|t| c.pick(M, t)).collect();
        assert_eq!(
            picks,
            [node(2), node(3), node(1), node(2)]
                .map(Pick::Host)
                .to_vec()
        );
    }

    #[test]
    fn refresh_is_due_every_interval_and_names_the_version_held() {
        let mut c = cached(0);
        assert!(matches!(c.pick(M, REFRESH_INTERVAL_MS - 1), Pick::Host(_)));
        assert_eq!(
            c.pick(M, REFRESH_INTERVAL_MS),
            Pick::Refresh { known_version: 5 }
        );
        assert!(c.refreshed(M, &unchanged(5, false), REFRESH_INTERVAL_MS, 0));
        assert!(matches!(c.pick(M, REFRESH_INTERVAL_MS + 1), Pick::Host(_)));
    }

    #[test]
    fn unchanged_about_another_version_or_an_empty_route_is_refused() {
        let mut c = cached(0);
        assert!(!c.refreshed(M, &unchanged(6, false), 10, 0));
        assert!(!c.refreshed(M, &fresh(7, &[], false), 10, 0));
        let mut empty = RouteCache::new();
        assert!(!empty.refreshed(M, &unchanged(5, false), 0, 0));
    }

    #[test]
    fn any_overloaded_node_sends_every_get_host_and_report_through_the_agent() {
        let mut c = RouteCache::new();
        c.pick(M, 0);
        c.refreshed(M, &fresh(5, &route(2), true), 0, 0);
        assert_eq!(c.pick(M, 1), Pick::PassThrough);
        let mut out = Vec::new();
        assert!(c.report(M, node(1), 0, 1, &mut out), "not held");
        assert!(out.is_empty());
        // Back to caching once the agent says no node is overloaded.
        assert_eq!(
            c.pick(M, REFRESH_INTERVAL_MS),
            Pick::Refresh { known_version: 5 }
        );
        c.refreshed(M, &unchanged(5, false), REFRESH_INTERVAL_MS, 0);
        assert!(matches!(c.pick(M, REFRESH_INTERVAL_MS), Pick::Host(_)));
    }

    #[test]
    fn successes_are_held_and_a_failure_sends_them_first() {
        let mut c = cached(0);
        let mut out = Vec::new();
        for h in [1, 2, 1, 1] {
            assert!(!c.report(M, node(h), 0, 10, &mut out), "held");
        }
        assert!(out.is_empty());
        assert!(
            c.report(M, node(2), -1, 11, &mut out),
            "failures go at once"
        );
        assert_eq!(out, vec![(node(1), 3), (node(2), 1)]);
        // The next getHost refreshes at once.
        assert_eq!(c.pick(M, 12), Pick::Refresh { known_version: 5 });
    }

    #[test]
    fn held_successes_go_out_when_old_or_too_many_nodes() {
        let mut c = cached(0);
        let mut out = Vec::new();
        assert!(!c.report(M, node(1), 0, 100, &mut out));
        assert!(!c.report(M, node(1), 0, 100 + HOLD_LIMIT_MS - 1, &mut out));
        assert!(out.is_empty());
        assert!(!c.report(M, node(2), 0, 100 + HOLD_LIMIT_MS, &mut out));
        assert_eq!(
            out,
            vec![(node(1), 2)],
            "the old ones go, the new one is held"
        );
        out.clear();
        let mut held = Vec::new();
        c.take_held(M, &mut held);
        assert_eq!(held, vec![(node(2), 1)]);

        // A route of MAX_HELD_NODES + 1 nodes: the last one overflows.
        let big: Vec<RouteNode> = (0..MAX_HELD_NODES)
            .map(|i| RouteNode {
                addr: NodeAddr {
                    ip: i as u32 + 1,
                    port: 1,
                },
                weight: 1,
            })
            .chain(route(9).into_iter().skip(8))
            .collect();
        assert!(c.refreshed(M, &fresh(6, &big, false), 200, 0));
        for r in &big[..MAX_HELD_NODES] {
            assert!(!c.report(M, r.addr, 0, 200, &mut out));
        }
        assert!(out.is_empty());
        assert!(!c.report(M, node(9), 0, 200, &mut out));
        assert_eq!(out.len(), MAX_HELD_NODES);
        assert_eq!(c.modules_holding(), vec![M]);
    }

    #[test]
    fn a_success_for_a_node_not_in_the_cached_route_is_dropped() {
        // The original counts a success only for a node of the cached route.
        let mut c = cached(0);
        let mut out = Vec::new();
        assert!(!c.report(M, node(9), 0, 10, &mut out), "not sent");
        assert!(out.is_empty());
        let mut held = Vec::new();
        c.take_held(M, &mut held);
        assert!(held.is_empty(), "not held either: {held:?}");
    }

    #[test]
    fn a_route_change_drops_the_held_successes_of_nodes_that_left() {
        let mut c = cached(0);
        let mut out = Vec::new();
        for h in [1, 2, 3, 2] {
            assert!(!c.report(M, node(h), 0, 10, &mut out));
        }
        // Version 6 keeps nodes 2 and 3, drops 1, adds 4.
        let v6: Vec<RouteNode> = route(4).into_iter().skip(1).collect();
        assert!(c.refreshed(M, &fresh(6, &v6, false), 20, 0));
        c.take_held(M, &mut out);
        assert_eq!(out, vec![(node(2), 2), (node(3), 1)]);
    }

    #[test]
    fn an_unanswered_refresh_keeps_serving_the_cached_route() {
        let mut c = cached(0);
        assert_eq!(c.pick(M, 1), Pick::Host(node(1)));
        // The refresh is due and goes unanswered: the cached route answers,
        // round robin, and the refresh stays due.
        assert_eq!(
            c.pick(M, REFRESH_INTERVAL_MS),
            Pick::Refresh { known_version: 5 }
        );
        assert_eq!(c.pick_unrefreshed(M), Some(node(2)));
        assert_eq!(
            c.pick(M, REFRESH_INTERVAL_MS + 1),
            Pick::Refresh { known_version: 5 }
        );
        assert_eq!(c.pick_unrefreshed(M), Some(node(3)));
        // Nothing cached, or a node overloaded at the last refresh: no answer
        // from the cache.
        assert_eq!(RouteCache::new().pick_unrefreshed(M), None);
        let mut o = RouteCache::new();
        o.pick(M, 0);
        o.refreshed(M, &fresh(5, &route(2), true), 0, 0);
        assert_eq!(o.pick_unrefreshed(M), None);
        c.forget(M);
        assert_eq!(c.pick_unrefreshed(M), None);
    }

    #[test]
    fn reports_of_an_uncached_module_go_at_once() {
        let mut c = RouteCache::new();
        let mut out = Vec::new();
        assert!(c.report(M, node(1), 0, 0, &mut out));
        c.pick(M, 0);
        assert!(
            c.report(M, node(1), 0, 0, &mut out),
            "asked but never answered"
        );
        let mut c = cached(0);
        c.forget(M);
        assert!(c.report(M, node(1), 0, 0, &mut out));
        assert_eq!(c.pick(M, 1), Pick::Refresh { known_version: 0 });
    }

    const N: ModuleId = ModuleId::new(2, 1);

    #[test]
    fn only_the_hot_module_is_one_compare_away_and_another_is_swapped_in() {
        let mut c = cached(0);
        assert_eq!(c.pick(N, 0), Pick::Refresh { known_version: 0 });
        assert!(c.refreshed(N, &fresh(9, &route(2), false), 0, 1));
        // N is hot now: M's cached path declines until M is swapped in.
        assert_eq!(c.pick_cached(N, 1), Some(node(2)));
        assert_eq!(c.pick_cached(M, 1), None);
        assert_eq!(c.pick_cached_other(M, 1), Some(node(1)));
        assert_eq!(c.pick_cached(M, 1), Some(node(2)));
        assert_eq!(c.pick_cached(N, 1), None);
        // Each keeps its round robin and its held successes across swaps.
        assert_eq!(c.pick_cached_other(N, 1), Some(node(1)));
        let mut out = Vec::new();
        assert!(!c.report(M, node(2), 0, 5, &mut out));
        assert!(!c.report(N, node(1), 0, 5, &mut out));
        assert!(!c.hold(M, node(2), 6), "M is not hot");
        assert!(c.hold_other(M, node(2), 6));
        assert!(c.hold(M, node(2), 6));
        assert!(c.hold_other(N, node(1), 6));
        let mut holding = c.modules_holding();
        holding.sort();
        assert_eq!(holding, vec![M, N]);
        c.take_held(M, &mut out);
        assert_eq!(out, vec![(node(2), 3)]);
        out.clear();
        c.take_held(N, &mut out);
        assert_eq!(out, vec![(node(1), 2)]);
        assert!(out.len() == 1 && c.modules_holding().is_empty());
    }

    #[test]
    fn before_any_route_the_cached_paths_decline_even_for_the_largest_module() {
        // (u32::MAX, u32::MAX) has the key of "no module hot".
        const MAX: ModuleId = ModuleId::new(u32::MAX, u32::MAX);
        let mut c = RouteCache::new();
        assert_eq!(c.pick_cached(MAX, 0), None);
        assert!(!c.hold(MAX, node(1), 0));
        assert_eq!(c.pick_cached_other(MAX, 0), None);
        assert!(!c.hold_other(MAX, node(1), 0));
        assert_eq!(c.pick(MAX, 0), Pick::Refresh { known_version: 0 });
        assert!(c.refreshed(MAX, &fresh(3, &route(2), false), 0, 0));
        assert_eq!(c.pick_cached(MAX, 1), Some(node(1)));
    }

    #[test]
    fn the_cached_paths_go_by_the_deadlines_and_the_node_given_last() {
        let mut c = cached(0);
        let mut out = Vec::new();
        assert_eq!(c.pick_cached(M, 0), Some(node(1)));
        // The first success of a node is the slow path's (it starts the
        // hold); then the cached path counts it.
        assert!(!c.hold(M, node(1), 0));
        assert!(!c.report(M, node(1), 0, 0, &mut out));
        assert!(c.hold(M, node(1), 1));
        // Another node than the one given last, held: found by search.
        assert_eq!(c.pick_cached(M, 1), Some(node(2)));
        assert!(c.hold(M, node(1), 1));
        // A node not in the route: never held here.
        assert!(!c.hold(M, node(9), 1));
        // The hold is 2 s old at 2000: the slow path sends it.
        assert!(!c.hold(M, node(1), HOLD_LIMIT_MS));
        // The route is due at 2000: the cached getHost declines.
        assert_eq!(c.pick_cached(M, REFRESH_INTERVAL_MS - 1), Some(node(3)));
        assert_eq!(c.pick_cached(M, REFRESH_INTERVAL_MS), None);
        // An overloaded node: neither path caches.
        assert!(c.refreshed(M, &unchanged(5, true), 10, 0));
        assert_eq!(c.pick_cached(M, 11), None);
        assert!(!c.hold(M, node(1), 11));
        c.take_held(M, &mut out);
        assert_eq!(out, vec![(node(1), 3)]);
    }

    #[test]
    fn a_count_above_u32_max_goes_out_as_several() {
        let mut c = cached(0);
        let mut out = Vec::new();
        assert!(!c.report(M, node(2), 0, 0, &mut out));
        c.hot.slots[1].held = u64::from(u32::MAX) + 5;
        c.take_held(M, &mut out);
        assert_eq!(out, vec![(node(2), u32::MAX), (node(2), 5)]);
    }
}
