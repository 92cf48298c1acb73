//! One module's route and its scheduling: the idle list served round robin,
//! the overload list served by probes, and route updates that keep the
//! state of the nodes that stay.

use std::collections::VecDeque;

mod meta;
#[cfg(test)]
mod meta_tests;

use super::balance::NoChoice;
use super::levels::Levels;
use super::limits;
use super::node::{Millis, Node, NodeState, Outcome, Reason, Transition};
use super::p2c::{less_loaded, two_of};
use super::params::LbParams;
use super::tuning::{self, Resolved, Tuned};
use super::units::{ClientKey, TakeRefused, Units, ANY_CLIENT};
use super::weights::{swrr_pick, WEIGHT_SCALE};
use lbagent_admission::AdmissionLevel;
use lbagent_admission::{clamp_priority, OPEN};
use lbagent_model::{ModuleOptions, NodeAddr, Policy, RouteNode};

/// What getHost answers for a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// An idle node, by round robin.
    Idle(NodeAddr),
    /// An overloaded node, given a chance by the probe rule.
    Probe(NodeAddr),
    /// Every node is overloaded and no probe is due.
    Overloaded,
    /// The module's route is empty.
    NoSuchModule,
    /// Idle nodes exist (for a `balance` module: nodes with a free unit),
    /// but the downstream level of every one refuses the request's
    /// priorities (DAGOR collaborative admission).
    Rejected,
    /// A `balance` module: the calling client already holds
    /// `lb.units_per_client` units of the module (it must report its calls
    /// first).
    ClientLimit,
    /// The module is in panic (its idle share below `panic_percent`): a
    /// node by round robin over every node, overloaded or not.
    Panic(NodeAddr),
}

impl Pick {
    /// The chosen node, if any.
    pub fn addr(self) -> Option<NodeAddr> {
        match self {
            Pick::Idle(a) | Pick::Probe(a) | Pick::Panic(a) => Some(a),
            Pick::Overloaded | Pick::NoSuchModule | Pick::Rejected | Pick::ClientLimit => None,
        }
    }
}

/// A report named a node that is not in the module's route (it was removed,
/// or the application reports a node it did not get from us).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("node {0} is not in the module's route")]
pub struct UnknownNode(pub NodeAddr);

/// The real call counts of one node since the statistics were last taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeCallStats {
    /// The node.
    pub addr: NodeAddr,
    /// Successful calls.
    pub succ: u32,
    /// Failed calls.
    pub err: u32,
    /// Whether the node is overloaded now.
    pub overloaded: bool,
    /// Capacity units reported consumed for good (a `balance` module).
    pub consumed: u32,
}

/// The L5 load balancer of one module.
///
/// Nodes live in `nodes`, sorted by address with no address twice, so the
/// report path finds a node by binary search with no separate index; the
/// two lists hold indices into it. Every node is in exactly one list, the
/// one its state names.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleLb {
    nodes: Vec<Node>,
    idle: VecDeque<u32>,
    overload: VecDeque<u32>,
    /// getHosts since the last probe, counted only while some node is overloaded.
    access_cnt: u32,
    version: u64,
    /// The nodes' live downstream admission levels; None while no node has
    /// one (the common case: no memory, one test on getHost).
    levels: Option<Box<Levels>>,
    /// The balance policy's units; None for an `l5` module (the default:
    /// no memory, one test on getHost).
    units: Option<Box<Units>>,
    /// The module's own options, as the route carries them.
    options: ModuleOptions,
    /// The options in force (the module's over the agent's defaults).
    resolved: Resolved,
    /// The module's policy is `p2c`.
    p2c: bool,
    /// Weights, slow start, the ejection limit, panic, `p2c`: None while
    /// all are off (the original's path: no memory, one test on getHost).
    tuned: Option<Box<Tuned>>,
    /// Zones, labels and the Maglev table (`module/meta.rs`); None for a
    /// module without them (the default: no memory, no test on getHost).
    meta: Option<Box<meta::Meta>>,
    /// The index in `nodes` of the node the last getHost named on the
    /// original's path ([`NO_HINT`] after any other): a hint the caller
    /// may hand back with the report ([`ModuleLb::report_call_hinted`]).
    picked: u32,
}

/// No node hint: a report's node is found by its address alone.
pub const NO_HINT: u32 = u32::MAX;

impl ModuleLb {
    /// A module with `route` (duplicates after the first are ignored), every
    /// node idle with its window starting at `now`.
    pub fn new(route: &[RouteNode], version: u64, now: Millis, p: &LbParams) -> Self {
        let mut m = ModuleLb {
            nodes: Vec::new(),
            idle: VecDeque::new(),
            overload: VecDeque::new(),
            access_cnt: 0,
            version,
            levels: None,
            units: None,
            options: ModuleOptions::default(),
            resolved: Resolved::new(&ModuleOptions::default(), p),
            p2c: false,
            tuned: None,
            meta: None,
            picked: NO_HINT,
        };
        m.update_route(route, version, now, p);
        m
    }

    /// The route version this state was last updated to.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// True when the route has no node: getHost answers "no such module".
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Every node, in address order ([`NodeAddr::key`]).
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// How many nodes are overloaded.
    pub fn overloaded_count(&self) -> usize {
        self.overload.len()
    }

    /// True when some node is overloaded.
    pub fn any_overloaded(&self) -> bool {
        !self.overload.is_empty()
    }

    /// The idle list, head first.
    pub fn idle_list(&self) -> impl Iterator<Item = NodeAddr> + '_ {
        self.idle.iter().map(|&i| self.nodes[i as usize].addr())
    }

    /// The overload list, head first.
    pub fn overload_list(&self) -> impl Iterator<Item = NodeAddr> + '_ {
        self.overload.iter().map(|&i| self.nodes[i as usize].addr())
    }

    /// Chooses a node: round robin over the idle list (take the head, append
    /// it to the tail). While some node is overloaded, the probe counter is
    /// looked at before it counts: `probe_num` getHosts are answered from the
    /// idle list (or, with every node overloaded, [`Pick::Overloaded`]), each
    /// adding one, and the next takes the head of the overload list instead
    /// (and rotates it), restarting the count: 10 then 1 with the default
    /// `probe_num` of 10. With no node overloaded the count stays 0.
    ///
    /// This is the original's choice alone: the module's options (weights,
    /// slow start, panic, `p2c`) apply through [`ModuleLb::get_host_for`]
    /// and [`ModuleLb::get_host_from`], which take the time.
    ///
    /// The index of the node named is kept as the next report's hint
    /// ([`ModuleLb::picked`]).
    #[inline]
    pub fn get_host(&mut self, p: &LbParams) -> Pick {
        if self.overload.is_empty() {
            self.access_cnt = 0;
            return match rotate(&mut self.idle) {
                Some(i) => Pick::Idle(self.named(i)),
                None => Pick::NoSuchModule,
            };
        }
        if self.access_cnt >= p.probe_num {
            self.access_cnt = 0;
            let i = rotate(&mut self.overload).expect("overload list is not empty");
            return Pick::Probe(self.named(i));
        }
        self.access_cnt += 1;
        match rotate(&mut self.idle) {
            Some(i) => Pick::Idle(self.named(i)),
            None => Pick::Overloaded,
        }
    }

    /// Node `i`'s address, `i` kept as the hint of the getHost naming it.
    #[inline(always)]
    fn named(&mut self, i: u32) -> NodeAddr {
        self.picked = i;
        self.nodes[i as usize].addr()
    }

    /// The node hint of the last getHost: the index of the node it named
    /// on the original's path, [`NO_HINT`] when it named none or took
    /// another path (levels, units, options). Only a hint: a report that
    /// hands it back is checked against the node's address
    /// ([`ModuleLb::report_call_hinted`]), so a stale one (the route
    /// changed since) costs the search it saves, never a wrong node.
    pub fn picked(&self) -> u32 {
        self.picked
    }

    /// Chooses a node for a request of DAGOR priorities `(business, user)`
    /// (0 = unset, counted as the least important, 128) at `now`. Without
    /// live downstream levels this is [`ModuleLb::get_host`]. With them, the
    /// levels only filter among the nodes L5 would choose:
    ///
    /// - a probe goes as [`ModuleLb::get_host`] sends it, whatever the
    ///   probed node's level: its purpose is to learn whether the node
    ///   recovered, and an overloaded node stays overloaded;
    /// - otherwise the idle list is walked from its head to the first node
    ///   whose level admits the request (a node without a level admits
    ///   everything), and the list is rotated past it, so round robin goes
    ///   on among the admitting nodes;
    /// - no idle node: [`Pick::Overloaded`] as before; idle nodes, none of
    ///   which admits: [`Pick::Rejected`].
    ///
    /// A `balance` module keeps the same rules: probes go whatever the
    /// level, the draw from `Φ` is restricted to the nodes whose level
    /// admits the request, and "idle" reads "with a free unit": no node
    /// with a free unit is [`Pick::Overloaded`], nodes with free units none
    /// of which admits are [`Pick::Rejected`].
    ///
    /// Levels not refreshed by `now` are forgotten here first.
    pub fn get_host_for(&mut self, p: &LbParams, business: u8, user: u8, now: Millis) -> Pick {
        self.get_host_from(p, ANY_CLIENT, business, user, now)
    }

    /// [`ModuleLb::get_host_for`] for the request of `client`: its own
    /// downstream levels ([`ModuleLb::set_private_level`]) filter too, and
    /// a `balance` module's unit is booked to it, at most
    /// `p.units_per_client` at once ([`Pick::ClientLimit`] past that).
    #[inline(always)]
    pub fn get_host_from(
        &mut self,
        p: &LbParams,
        client: ClientKey,
        business: u8,
        user: u8,
        now: Millis,
    ) -> Pick {
        if self.levels.is_none() && self.units.is_none() && self.tuned.is_none() {
            return self.get_host(p);
        }
        let pick = self.get_host_beyond(p, client, business, user, now);
        // A path beyond the original may have run the original's pick: its
        // node is no hint for this answer.
        self.picked = NO_HINT;
        pick
    }

    /// [`ModuleLb::get_host_from`] of a module with downstream levels,
    /// units or options. Out of line: the original's path inlines into
    /// its caller and pays three tests.
    #[inline(never)]
    fn get_host_beyond(
        &mut self,
        p: &LbParams,
        client: ClientKey,
        business: u8,
        user: u8,
        now: Millis,
    ) -> Pick {
        if self.levels.is_none() && self.units.is_none() {
            return self.get_host_tuned(p, now);
        }
        if self.units.is_some() {
            return self.get_host_balance(p, client, business, user, now);
        }
        if !self.levels_live(now) {
            return self.get_host(p);
        }
        if !self.overload.is_empty() {
            if self.access_cnt >= p.probe_num {
                return self.get_host(p);
            }
            self.access_cnt += 1;
        } else {
            self.access_cnt = 0;
        }
        if self.idle.is_empty() {
            return if self.nodes.is_empty() {
                Pick::NoSuchModule
            } else {
                Pick::Overloaded
            };
        }
        let (b, u) = (clamp_priority(business), clamp_priority(user));
        let levels = self.levels.as_deref().expect("checked above");
        let nodes = &self.nodes;
        let found = self
            .idle
            .iter()
            .position(|&i| levels.admits(nodes[i as usize].addr().key(), client, b, u));
        match found {
            Some(k) => {
                self.idle.rotate_left(k + 1);
                let i = *self.idle.back().expect("not empty");
                Pick::Idle(self.nodes[i as usize].addr())
            }
            None => Pick::Rejected,
        }
    }

    /// Forgets the levels not refreshed by `now` (the table itself when
    /// none is left); true when some remain.
    fn levels_live(&mut self, now: Millis) -> bool {
        if self.levels.as_mut().is_some_and(|l| l.expire(now)) {
            return true;
        }
        self.levels = None;
        false
    }

    /// Sets `addr`'s downstream admission level, as a report carried it,
    /// until `expires`: None or the open level (128, 128) clears it.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn set_level(
        &mut self,
        addr: NodeAddr,
        level: Option<AdmissionLevel>,
        expires: Millis,
    ) -> Result<(), UnknownNode> {
        self.find(addr).ok_or(UnknownNode(addr))?;
        match level.filter(|&l| l != OPEN) {
            Some(l) => self
                .levels
                .get_or_insert_with(Box::default)
                .set(addr.key(), l, expires),
            None => {
                if let Some(levels) = &mut self.levels {
                    levels.clear(addr.key());
                    if levels.len() == 0 {
                        self.levels = None;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets `client`'s own downstream level for `addr` until `expires`
    /// (None or the open level clears it): it filters only that client's
    /// getHosts ([`ModuleLb::get_host_from`]). Ok(false) when the module
    /// holds [`super::levels::MAX_PRIVATE`] such levels already (nothing
    /// set).
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn set_private_level(
        &mut self,
        client: ClientKey,
        addr: NodeAddr,
        level: Option<AdmissionLevel>,
        expires: Millis,
    ) -> Result<bool, UnknownNode> {
        self.find(addr).ok_or(UnknownNode(addr))?;
        match level.filter(|&l| l != OPEN) {
            Some(l) => Ok(self.levels.get_or_insert_with(Box::default).set_private(
                client,
                addr.key(),
                l,
                expires,
            )),
            None => {
                if let Some(levels) = &mut self.levels {
                    levels.clear_private(client, addr.key());
                    if levels.len() == 0 {
                        self.levels = None;
                    }
                }
                Ok(true)
            }
        }
    }

    /// How many callers' own levels the module holds (expired or not).
    pub fn private_levels_held(&self) -> usize {
        self.levels.as_ref().map_or(0, |l| l.private_len())
    }

    /// How many nodes have a downstream level live at `now` (expired ones
    /// are forgotten first).
    pub fn levelled_nodes(&mut self, now: Millis) -> usize {
        let live = self
            .levels
            .as_mut()
            .map_or(0, |l| if l.expire(now) { l.len() } else { 0 });
        if live == 0 {
            self.levels = None;
        }
        live
    }

    /// How many nodes have a downstream level held, without forgetting the
    /// expired ones (a gauge's view: they go at the next getHost).
    pub fn levels_held(&self) -> usize {
        self.levels.as_ref().map_or(0, |l| l.len())
    }

    /// `addr`'s downstream level, if it has one (expired or not).
    pub fn level_of(&self, addr: NodeAddr) -> Option<AdmissionLevel> {
        self.levels.as_ref()?.get(addr.key())
    }

    /// `client`'s own level for `addr`, if it has one (expired or not).
    pub fn private_level_of(&self, client: ClientKey, addr: NodeAddr) -> Option<AdmissionLevel> {
        self.levels.as_ref()?.private_of(client, addr.key())
    }

    /// Applies one reported call to `addr` at `now`: a success counts 1, a
    /// failure [`Outcome::error_count`] (the original's multi-count path when
    /// above 1, see [`Node::report_calls`]); returns the node's state
    /// change, if the call caused one.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn report(
        &mut self,
        addr: NodeAddr,
        outcome: Outcome,
        now: Millis,
        p: &LbParams,
    ) -> Result<Option<Transition>, UnknownNode> {
        self.report_from(ANY_CLIENT, addr, outcome, now, p)
    }

    /// [`ModuleLb::report`] from `client`: a `balance` module's unit goes
    /// back only if `client` holds one of the node (a report from anyone
    /// else frees nothing).
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    #[inline]
    pub fn report_from(
        &mut self,
        client: ClientKey,
        addr: NodeAddr,
        outcome: Outcome,
        now: Millis,
        p: &LbParams,
    ) -> Result<Option<Transition>, UnknownNode> {
        self.report_call(client, addr, outcome, None, now, p)
    }

    /// [`ModuleLb::report_from`] with the call's time cost, which a `p2c`
    /// module's choice learns from (a failure's is in its [`Outcome`];
    /// None: the call closes an outstanding getHost and teaches nothing).
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    #[inline]
    pub fn report_call(
        &mut self,
        client: ClientKey,
        addr: NodeAddr,
        outcome: Outcome,
        tcost_ms: Option<u32>,
        now: Millis,
        p: &LbParams,
    ) -> Result<Option<Transition>, UnknownNode> {
        self.report_call_hinted(client, addr, NO_HINT, outcome, tcost_ms, now, p)
    }

    /// [`ModuleLb::report_call`] with the node hint of the getHost that
    /// named `addr` ([`ModuleLb::picked`]): the node at index `hint` when
    /// it is `addr` (one comparison instead of the binary search), found
    /// by its address otherwise. Any `hint` is safe: one out of range, or
    /// naming another node (stale, or made up), finds the node by address,
    /// as [`NO_HINT`] does.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn report_call_hinted(
        &mut self,
        client: ClientKey,
        addr: NodeAddr,
        hint: u32,
        outcome: Outcome,
        tcost_ms: Option<u32>,
        now: Millis,
        p: &LbParams,
    ) -> Result<Option<Transition>, UnknownNode> {
        let i = self.find_hinted(addr, hint).ok_or(UnknownNode(addr))?;
        if self.units.is_some() {
            self.give_back_unit(client, i);
        }
        if self.tuned.is_some() {
            self.observe(i, outcome, tcost_ms, now);
        }
        Ok(self.report_at(i, outcome, now, p))
    }

    /// Applies a batch of `count` successful calls to `addr` at `now` all at
    /// once, as the original's batch report (a multi-count report, whatever
    /// `count`, 1 included: see [`Node::report_calls`]): the counts grow by
    /// `count`; an overloaded node returns to idle at most once, the
    /// consecutive run tested before the rate's threshold, and the carry
    /// goes into its idle virtual count; otherwise one window /
    /// overload-timeout check. Calls `on_transition` for the state change, if
    /// any. O(1). A batch of 0 changes nothing.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn report_successes(
        &mut self,
        addr: NodeAddr,
        count: u32,
        now: Millis,
        p: &LbParams,
        on_transition: impl FnMut(Transition),
    ) -> Result<(), UnknownNode> {
        self.report_successes_from(ANY_CLIENT, addr, count, now, p, on_transition)
    }

    /// [`ModuleLb::report_successes`] from `client`: of a `balance`
    /// module's units, only those `client` holds of the node go back.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn report_successes_from(
        &mut self,
        client: ClientKey,
        addr: NodeAddr,
        count: u32,
        now: Millis,
        p: &LbParams,
        mut on_transition: impl FnMut(Transition),
    ) -> Result<(), UnknownNode> {
        let i = self.find(addr).ok_or(UnknownNode(addr))?;
        if let Some(u) = &mut self.units {
            for _ in 0..count.min(u.in_use(i)) {
                if !u.give_back_from(client, i) {
                    break;
                }
            }
        }
        if let Some(t) = self.tuned.as_deref_mut().filter(|t| t.p2c) {
            t.cost[i].closed(count, now);
        }
        if count > 0 {
            if let Some(t) = self.report_calls_at(i, true, count, true, now, p) {
                on_transition(t);
            }
        }
        Ok(())
    }

    /// Replaces the route: nodes that stay keep their state and list position
    /// (their weight is updated), new nodes join the tail of the idle list in
    /// the route's order, removed nodes leave both lists. Duplicate entries
    /// after the first are ignored. An empty route leaves a module that
    /// answers [`Pick::NoSuchModule`].
    ///
    /// Cost: linear in the nodes of both routes. The route's addresses are
    /// put in order by a radix sort over the bytes in which they differ
    /// (none when the route comes sorted, as the route server sends it),
    /// then merged with the nodes held, which are kept in that order.
    pub fn update_route(&mut self, route: &[RouteNode], version: u64, now: Millis, p: &LbParams) {
        self.version = version;
        // The wanted keys in order, each with its first position in `route`.
        let wanted = sorted_keys(route);
        let old = std::mem::take(&mut self.nodes);
        // Old index -> new index; route position -> new index of a new node.
        let mut remap = vec![u32::MAX; old.len()];
        let mut fresh = vec![u32::MAX; route.len()];
        let mut nodes = Vec::with_capacity(wanted.len());
        let mut old_iter = old.into_iter().enumerate().peekable();
        for &(key, pos) in &wanted {
            // Old nodes before this key are gone.
            while old_iter.next_if(|(_, n)| n.key() < key).is_some() {}
            let r = &route[pos as usize];
            let new_index = nodes.len() as u32;
            match old_iter.next_if(|(_, n)| n.key() == key) {
                Some((i, mut node)) => {
                    node.set_weight(r.weight);
                    remap[i] = new_index;
                    nodes.push(node);
                }
                None => {
                    fresh[pos as usize] = new_index;
                    nodes.push(Node::new(*r, now, p));
                }
            }
        }
        let keep = |list: &VecDeque<u32>, extra: usize| -> VecDeque<u32> {
            let mut out = VecDeque::with_capacity(list.len() + extra);
            out.extend(
                list.iter()
                    .map(|&i| remap[i as usize])
                    .filter(|&i| i != u32::MAX),
            );
            out
        };
        let added = fresh.iter().filter(|&&i| i != u32::MAX).count();
        let mut idle = keep(&self.idle, added);
        self.overload = keep(&self.overload, 0);
        // New nodes, in the route's own order.
        idle.extend(fresh.iter().copied().filter(|&i| i != u32::MAX));
        self.idle = idle;
        self.nodes = nodes;
        if self.overload.is_empty() {
            self.access_cnt = 0;
        }
        if let Some(u) = &mut self.units {
            u.rebuild(&self.nodes);
        }
        if let Some(t) = &mut self.tuned {
            t.remap(&remap, &self.nodes, now);
        }
        // Whether the weights differ, from the route's own entries first:
        // one pass over them, branch-free, that a route of equal weights
        // (every default route) ends with; only a route whose entries
        // differ has the nodes looked at (duplicates left out).
        let differ = tuning::route_weights_differ(route) && tuning::unequal_weights(&self.nodes);
        self.resolved = Resolved::new(&self.options, p);
        self.retune_with(now, differ);
        if self.meta.is_some() {
            self.refresh_meta();
        }
    }

    /// Takes every node's real call counts since the last call (for the
    /// reporter), appending one entry per node to `out`.
    pub fn take_stats(&mut self, out: &mut Vec<NodeCallStats>) {
        for (i, n) in self.nodes.iter_mut().enumerate() {
            let (succ, err) = n.take_stats();
            out.push(NodeCallStats {
                addr: n.addr(),
                succ,
                err,
                overloaded: n.state() == NodeState::Overloaded,
                consumed: self.units.as_deref_mut().map_or(0, |u| u.take_consumed(i)),
            });
        }
    }

    /// Records that a call to `addr` consumed `units` capacity units for
    /// good (a `balance` module's stored resources): they go to the
    /// reporter with the next statistics, and the route server lowers the
    /// node's capacity. False (nothing recorded) for an `l5` module.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn consume(&mut self, addr: NodeAddr, units: u32) -> Result<bool, UnknownNode> {
        let i = self.find(addr).ok_or(UnknownNode(addr))?;
        Ok(match self.units.as_deref_mut() {
            Some(u) => {
                u.add_consumed(i, units);
                true
            }
            None => false,
        })
    }

    // === the balance policy ===

    /// A report of node `i` returns one of its units (a `balance` module).
    /// Out of line: `l5` reports pay only the test.
    #[cold]
    #[inline(never)]
    fn give_back_unit(&mut self, client: ClientKey, i: usize) {
        if let Some(u) = &mut self.units {
            u.give_back_from(client, i);
        }
    }

    /// `client` is gone: every unit it holds of this module goes back (a
    /// `balance` module; 0 otherwise). Returns how many.
    pub fn release_client(&mut self, client: ClientKey) -> u32 {
        let Some(u) = self.units.as_deref_mut() else {
            return 0;
        };
        let nodes = &self.nodes;
        u.release_client(client, |key| {
            nodes.binary_search_by_key(&key, Node::key).ok()
        })
    }

    /// Node `i`'s state changed: its capacity as the balance policy counts
    /// it follows. Out of line, as [`ModuleLb::give_back_unit`].
    #[cold]
    #[inline(never)]
    fn refresh_unit(&mut self, i: usize) {
        if let Some(u) = &mut self.units {
            u.refresh(i, &self.nodes[i]);
        }
    }

    /// Sets the module's policy: `balance` keeps the units in use if it was
    /// `balance` already, and starts with none otherwise; `l5` drops them.
    pub fn set_policy(&mut self, policy: Policy) {
        match policy {
            Policy::L5 | Policy::P2c => self.units = None,
            Policy::Balance => {
                if self.units.is_none() {
                    self.units = Some(Box::new(Units::new(&self.nodes)));
                }
            }
        }
        let p2c = policy == Policy::P2c;
        if p2c != self.p2c {
            self.p2c = p2c;
            self.retune(0);
        }
    }

    /// The module's policy.
    pub fn policy(&self) -> Policy {
        if self.units.is_some() {
            Policy::Balance
        } else if self.p2c {
            Policy::P2c
        } else {
            Policy::L5
        }
    }

    /// The balance policy's units (None for an `l5` module).
    pub fn units(&self) -> Option<&Units> {
        self.units.as_deref()
    }

    /// Returns the units handed out and not reported by `now` (a `balance`
    /// module; 0 otherwise): how many returned by time-out. getHost does
    /// not call this itself: the caller does, and counts the result.
    pub fn expire_units(&mut self, now: Millis) -> u32 {
        let Some(u) = self.units.as_deref_mut() else {
            return 0;
        };
        let nodes = &self.nodes;
        u.expire(now, |key| nodes.binary_search_by_key(&key, Node::key).ok())
    }

    /// getHost of a `balance` module for a request of priorities
    /// `(business, user)`: the L5 probe rule first (while some node is
    /// overloaded, every `probe_num + 1`-th getHost probes the head of the
    /// overload list, taking no unit: an overloaded node has no capacity;
    /// a probe goes whatever the node's level, as for an `l5` module), then
    /// a draw from `Φ` that takes a unit due back by
    /// `now + unit_timeout_ms`; [`Pick::Overloaded`] when no node has a
    /// free unit. With live downstream levels (expired ones are forgotten
    /// first) the draw is restricted to the nodes whose level admits the
    /// request ([`ModuleLb::take_admitted`]), and nodes with free units
    /// none of which admits answer [`Pick::Rejected`], as the idle nodes of
    /// an `l5` module do.
    fn get_host_balance(
        &mut self,
        p: &LbParams,
        client: ClientKey,
        business: u8,
        user: u8,
        now: Millis,
    ) -> Pick {
        if self.nodes.is_empty() {
            return Pick::NoSuchModule;
        }
        if self.levels.is_some() {
            self.levels_live(now);
        }
        if !self.overload.is_empty() {
            if self.access_cnt >= p.probe_num {
                self.access_cnt = 0;
                let i = rotate(&mut self.overload).expect("overload list is not empty");
                return Pick::Probe(self.nodes[i as usize].addr());
            }
            self.access_cnt += 1;
        } else {
            self.access_cnt = 0;
        }
        let deadline = now.saturating_add(p.unit_timeout_ms);
        if self.levels.is_some() {
            return self.take_admitted(p, client, deadline, business, user);
        }
        let units = self.units.as_deref_mut().expect("a balance module");
        match units.take_for(client, p.units_per_client, deadline) {
            Ok(i) => Pick::Idle(self.nodes[i].addr()),
            Err(TakeRefused::ClientLimit) => Pick::ClientLimit,
            Err(TakeRefused::NoChoice(_)) => Pick::Overloaded,
        }
    }

    /// The draw of a `balance` module with live levels: `Φ` restricted to
    /// the nodes whose level admits `(business, user)` (a node without a
    /// level admits everything), taking a unit due back by `deadline`.
    /// Out of line: the calm path pays only the test.
    #[cold]
    #[inline(never)]
    fn take_admitted(
        &mut self,
        p: &LbParams,
        client: ClientKey,
        deadline: Millis,
        business: u8,
        user: u8,
    ) -> Pick {
        let (b, u) = (clamp_priority(business), clamp_priority(user));
        let units = self.units.as_deref_mut().expect("a balance module");
        let levels = self.levels.as_deref().expect("checked by the caller");
        let nodes = &self.nodes;
        let admitting = |i: usize| levels.admits(nodes[i].addr().key(), client, b, u);
        match units.take_admitted(client, p.units_per_client, deadline, admitting) {
            Ok(i) => Pick::Idle(nodes[i].addr()),
            Err(TakeRefused::ClientLimit) => Pick::ClientLimit,
            Err(TakeRefused::NoChoice(NoChoice::NoneAdmits)) => Pick::Rejected,
            Err(TakeRefused::NoChoice(NoChoice::NoFreeUnit)) => Pick::Overloaded,
        }
    }

    // === the options beyond L5 (issue 31) ===

    /// Sets the module's own options (as its route carries them) over the
    /// agent's defaults in `p`, at `now`.
    pub fn set_options(&mut self, options: ModuleOptions, now: Millis, p: &LbParams) {
        // The shard sets them with every route update, right after
        // update_route resolved them: unchanged, nothing to redo (no second
        // pass over the nodes).
        if options == self.options && Resolved::new(&options, p) == self.resolved {
            return;
        }
        self.options = options;
        self.configure(now, p);
    }

    /// The module's own options.
    pub fn options(&self) -> ModuleOptions {
        self.options
    }

    /// The options in force: the module's over the agent's defaults.
    pub fn resolved(&self) -> Resolved {
        self.resolved
    }

    /// The locality spill threshold in force, percent: the module's
    /// `locality_min_percent` or the agent's `lb.locality_min_percent`
    /// (held here for the locality code, which applies it).
    pub fn locality_min_percent(&self) -> u8 {
        self.resolved.locality_min_percent
    }

    /// Resolves the options again over `p` (the agent's defaults changed,
    /// or the route): the extra state is made, kept or dropped.
    pub fn configure(&mut self, now: Millis, p: &LbParams) {
        self.resolved = Resolved::new(&self.options, p);
        self.retune(now);
    }

    /// Makes, updates or drops the extra state for the options resolved.
    fn retune(&mut self, now: Millis) {
        let differ = tuning::unequal_weights(&self.nodes);
        self.retune_with(now, differ);
    }

    /// [`Self::retune`] knowing whether the nodes' weights differ.
    fn retune_with(&mut self, now: Millis, weights_differ: bool) {
        if !(self.p2c || !self.resolved.is_neutral() || weights_differ) {
            self.tuned = None;
            return;
        }
        match &mut self.tuned {
            Some(t) => {
                t.opts = self.resolved;
                t.weighted = weights_differ;
                t.set_p2c(self.p2c, self.nodes.len(), now);
            }
            None => {
                self.tuned = Some(Box::new(Tuned::new(
                    self.resolved,
                    self.p2c,
                    &self.nodes,
                    now,
                )))
            }
        }
    }

    /// True when some option beyond the original is on for this module.
    pub fn is_tuned(&self) -> bool {
        self.tuned.is_some()
    }

    /// Whether a panic began (Some(true)) or ended (Some(false)) since
    /// the last call: the caller logs it, once per episode.
    pub fn take_panic_news(&mut self) -> Option<bool> {
        self.tuned.as_mut()?.panic_news.take()
    }

    /// True while the module is in panic.
    pub fn in_panic(&self) -> bool {
        self.tuned.as_ref().is_some_and(|t| t.panicking)
    }

    /// getHosts answered in panic, in all.
    pub fn panic_answers(&self) -> u64 {
        self.tuned.as_ref().map_or(0, |t| t.panic_answers)
    }

    /// Overload marks the ejection limit held back, in all.
    pub fn overloads_held_back(&self) -> u64 {
        self.tuned.as_ref().map_or(0, |t| t.held_back)
    }

    /// Node `addr`'s `p2c` load inputs: its peak-EWMA cost at `now` and its
    /// outstanding getHosts (None unless a `p2c` module holds the node).
    pub fn p2c_cost(&self, addr: NodeAddr, now: Millis) -> Option<(f64, u32)> {
        let t = self.tuned.as_deref().filter(|t| t.p2c)?;
        let e = t.cost.get(self.find(addr)?)?;
        Some((e.cost(now), e.outstanding()))
    }

    /// getHost with the options on: panic first (round robin over every
    /// node), then the L5 probe rule, then the choice among the idle
    /// nodes: `p2c`, or smooth weighted round robin when weights differ or
    /// slow start is on, or the original's rotation. Out of line: the
    /// original's path pays only the test.
    #[cold]
    #[inline(never)]
    fn get_host_tuned(&mut self, p: &LbParams, now: Millis) -> Pick {
        if self.nodes.is_empty() {
            return Pick::NoSuchModule;
        }
        let t = self.tuned.as_deref_mut().expect("checked by the caller");
        let panic = limits::in_panic(self.idle.len(), self.nodes.len(), t.opts.panic_percent);
        if panic != t.panicking {
            t.panicking = panic;
            t.panic_news = Some(panic);
        }
        if panic {
            let i = t.panic_next % self.nodes.len();
            t.panic_next = i + 1;
            t.panic_answers += 1;
            if t.p2c {
                t.cost[i].picked();
            }
            return Pick::Panic(self.nodes[i].addr());
        }
        if !self.overload.is_empty() {
            if self.access_cnt >= p.probe_num {
                self.access_cnt = 0;
                let i = rotate(&mut self.overload).expect("overload list is not empty");
                if t.p2c {
                    t.cost[i as usize].picked();
                }
                return Pick::Probe(self.nodes[i as usize].addr());
            }
            self.access_cnt += 1;
        } else {
            self.access_cnt = 0;
        }
        let nodes = &self.nodes;
        let chosen = if t.p2c {
            p2c_pick(t, &self.idle, nodes, now, p)
        } else if t.weighs() {
            let Tuned {
                current,
                entered,
                opts,
                ..
            } = t;
            let weight = |i: u32| {
                let i = i as usize;
                (i as u32, Tuned::weight_of(opts, entered[i], &nodes[i], now))
            };
            swrr_pick(current, self.idle.iter().map(|&i| weight(i)))
        } else {
            rotate(&mut self.idle)
        };
        match chosen {
            Some(i) => Pick::Idle(self.nodes[i as usize].addr()),
            None => Pick::Overloaded,
        }
    }

    /// A report of node `i` for the options' state: a `p2c` module learns
    /// its cost (or only closes the getHost when the time is unknown).
    fn observe(&mut self, i: usize, outcome: Outcome, tcost_ms: Option<u32>, now: Millis) {
        let Some(t) = self.tuned.as_deref_mut().filter(|t| t.p2c) else {
            return;
        };
        let e = &mut t.cost[i];
        match (outcome, tcost_ms) {
            (Outcome::Failure { tcost_ms }, _) => e.observe(false, tcost_ms, now),
            (Outcome::Success, Some(ms)) => e.observe(true, ms, now),
            (Outcome::Success, None) => e.closed(1, now),
        }
    }

    /// Checks the structural invariants: every node is in exactly one list,
    /// the one its state names, and the lookup index matches the nodes.
    ///
    /// # Errors
    /// A description of the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.nodes.len()];
        for (list, state) in [
            (&self.idle, NodeState::Idle),
            (&self.overload, NodeState::Overloaded),
        ] {
            for &i in list {
                let n = self
                    .nodes
                    .get(i as usize)
                    .ok_or(format!("index {i} out of range"))?;
                if n.state() != state {
                    return Err(format!(
                        "{} is {:?} but on the {state:?} list",
                        n.addr(),
                        n.state()
                    ));
                }
                seen[i as usize] += 1;
            }
        }
        if let Some(i) = seen.iter().position(|&c| c != 1) {
            return Err(format!("{} is on {} lists", self.nodes[i].addr(), seen[i]));
        }
        if let Some(w) = self.nodes.windows(2).find(|w| w[0].key() >= w[1].key()) {
            return Err(format!(
                "nodes out of address order: {} before {}",
                w[0].addr(),
                w[1].addr()
            ));
        }
        Ok(())
    }

    fn find(&self, addr: NodeAddr) -> Option<usize> {
        let key = addr.key();
        self.nodes.binary_search_by_key(&key, Node::key).ok()
    }

    /// [`ModuleLb::find`], trying index `hint` first: it is the node only
    /// if the node there has `addr`'s key (the keys are unique).
    #[inline(always)]
    fn find_hinted(&self, addr: NodeAddr, hint: u32) -> Option<usize> {
        match self.nodes.get(hint as usize) {
            Some(n) if n.key() == addr.key() => Some(hint as usize),
            _ => self.find(addr),
        }
    }

    /// Inlined, as [`ModuleLb::report_calls_at`]: a report's two calls'
    /// frames were a third of its cost in the agent (callgrind).
    #[inline]
    fn report_at(
        &mut self,
        i: usize,
        outcome: Outcome,
        now: Millis,
        p: &LbParams,
    ) -> Option<Transition> {
        match outcome {
            Outcome::Success => self.report_calls_at(i, true, 1, false, now, p),
            Outcome::Failure { .. } => {
                let errcnt = outcome.error_count();
                self.report_calls_at(i, false, errcnt, errcnt > 1, now, p)
            }
        }
    }

    /// Applies `n` counts of one outcome to node `i` (a multi-count report
    /// when `multi`, see [`Node::report_calls`]) and moves it between the
    /// lists when its state changes ([`ModuleLb::moved`], out of line:
    /// most reports change no state). A module with options takes
    /// [`ModuleLb::report_calls_tuned`].
    #[inline(always)]
    fn report_calls_at(
        &mut self,
        i: usize,
        success: bool,
        n: u32,
        multi: bool,
        now: Millis,
        p: &LbParams,
    ) -> Option<Transition> {
        if self.tuned.is_some() {
            return self.report_calls_tuned(i, success, n, multi, now, p);
        }
        let (to, reason) = self.nodes[i].report_calls(success, n, multi, now, p)?;
        self.moved(i, success, n, None, to, reason, now)
    }

    /// [`ModuleLb::report_calls_at`] in a module with options: a node
    /// the report would overload stays idle at the ejection limit. Out of
    /// line: the original's path pays one test for it (one body for both,
    /// with the node kept as it was on the original's path too, cost a
    /// shared-memory request 4 instructions, callgrind).
    #[inline(never)]
    fn report_calls_tuned(
        &mut self,
        i: usize,
        success: bool,
        n: u32,
        multi: bool,
        now: Millis,
        p: &LbParams,
    ) -> Option<Transition> {
        let held = self.at_ejection_limit(i);
        let (to, reason) = self.nodes[i].report_calls(success, n, multi, now, p)?;
        self.moved(i, success, n, held, to, reason, now)
    }

    /// Node `i` changed state to `to` on a report of `n` counts
    /// ([`ModuleLb::report_calls_at`]): held idle at the ejection limit
    /// (`held`: the node as it was), or moved between the lists.
    #[allow(clippy::too_many_arguments)]
    #[cold]
    #[inline(never)]
    fn moved(
        &mut self,
        i: usize,
        success: bool,
        n: u32,
        held: Option<Node>,
        to: NodeState,
        reason: Reason,
        now: Millis,
    ) -> Option<Transition> {
        if let (Some(before), NodeState::Overloaded) = (held, to) {
            // The ejection limit: the node stays idle with its counts.
            self.nodes[i] = before;
            self.nodes[i].count(success, n);
            if let Some(t) = &mut self.tuned {
                t.held_back += 1;
            }
            return None;
        }
        if to == NodeState::Idle {
            if let Some(t) = &mut self.tuned {
                t.entered_idle(i, now);
            }
        }
        let idx = i as u32;
        let (from_list, to_list) = match to {
            NodeState::Overloaded => (&mut self.idle, &mut self.overload),
            NodeState::Idle => (&mut self.overload, &mut self.idle),
        };
        if let Some(pos) = from_list.iter().position(|&j| j == idx) {
            from_list.remove(pos);
        }
        to_list.push_back(idx);
        if self.overload.is_empty() {
            self.access_cnt = 0;
        }
        if self.units.is_some() {
            self.refresh_unit(i);
        }
        Some(Transition {
            addr: self.nodes[i].addr(),
            to,
            reason,
        })
    }
}

impl ModuleLb {
    /// A copy of idle node `i` when the module is at its ejection limit (a
    /// report that would overload the node must leave it idle); None
    /// otherwise. Out of line: a module without options pays only the test
    /// of `tuned`.
    #[cold]
    #[inline(never)]
    fn at_ejection_limit(&self, i: usize) -> Option<Node> {
        let limit = self.tuned.as_deref()?.opts.max_overloaded_percent;
        let at_limit = !limits::may_overload(self.overload.len(), self.nodes.len(), limit);
        (at_limit && self.nodes[i].state() == NodeState::Idle).then(|| self.nodes[i].clone())
    }
}

/// `p2c`'s choice among the idle nodes: two drawn at random, the less
/// loaded taken (one idle node: that one); its getHost counted outstanding.
fn p2c_pick(
    t: &mut Tuned,
    idle: &VecDeque<u32>,
    nodes: &[Node],
    now: Millis,
    p: &LbParams,
) -> Option<u32> {
    let chosen = match idle.len() {
        0 => return None,
        1 => idle[0],
        k => {
            let (a, b) = two_of(k, t.rng.u64(..), t.rng.u64(..));
            let mut load = |i: u32| {
                let i = i as usize;
                t.cost[i].forget_stale(now, p.unit_timeout_ms);
                let w = Tuned::weight_of(&t.opts, t.entered[i], &nodes[i], now);
                t.cost[i].load(now, w as f64 / WEIGHT_SCALE as f64)
            };
            let (ia, ib) = (idle[a], idle[b]);
            less_loaded((ia, load(ia)), (ib, load(ib)))
        }
    };
    t.cost[chosen as usize].picked();
    Some(chosen)
}

/// Takes the head of a list and appends it to the tail.
fn rotate(list: &mut VecDeque<u32>) -> Option<u32> {
    let head = list.pop_front()?;
    list.push_back(head);
    Some(head)
}

/// The keys of `route` in increasing order, each once, with the position
/// of its first entry in `route`. Linear: a route that comes sorted costs
/// one pass; otherwise a stable LSD radix sort over only the bytes in which
/// the keys differ (one or two for a route within one subnet and port),
/// insertion sort for a handful of nodes.
fn sorted_keys(route: &[RouteNode]) -> Vec<(u64, u32)> {
    let mut keys: Vec<(u64, u32)> = route
        .iter()
        .enumerate()
        .map(|(pos, r)| (r.addr.key(), pos as u32))
        .collect();
    if !keys.windows(2).all(|w| w[0].0 <= w[1].0) {
        if keys.len() <= SMALL_SORT {
            // Stable: among equal keys the first entry stays first.
            for i in 1..keys.len() {
                let mut j = i;
                while j > 0 && keys[j - 1].0 > keys[j].0 {
                    keys.swap(j - 1, j);
                    j -= 1;
                }
            }
        } else {
            radix_sort(&mut keys);
        }
    }
    keys.dedup_by_key(|&mut (k, _)| k);
    keys
}

/// Routes of at most this many nodes are put in order by insertion sort.
const SMALL_SORT: usize = 16;

/// Sorts by key, stably, one counting pass per byte that varies among the
/// keys (a key is `ip << 16 | port`: 6 bytes).
fn radix_sort(keys: &mut Vec<(u64, u32)>) {
    let first = keys[0].0;
    let varying = keys.iter().fold(0u64, |acc, &(k, _)| acc | (k ^ first));
    let mut scratch = vec![(0u64, 0u32); keys.len()];
    for byte in 0..6 {
        let shift = 8 * byte;
        if (varying >> shift) & 0xff == 0 {
            continue;
        }
        let mut start = [0usize; 256];
        for &(k, _) in keys.iter() {
            start[((k >> shift) & 0xff) as usize] += 1;
        }
        let mut sum = 0;
        for c in start.iter_mut() {
            let n = *c;
            *c = sum;
            sum += n;
        }
        for &e in keys.iter() {
            let d = ((e.0 >> shift) & 0xff) as usize;
            scratch[start[d]] = e;
            start[d] += 1;
        }
        std::mem::swap(keys, &mut scratch);
    }
}
