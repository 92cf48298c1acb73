//! One module's route and its scheduling: the idle list served round robin,
//! the overload list served by probes, and route updates that keep the
//! state of the nodes that stay.

use std::collections::VecDeque;

use super::node::{Millis, Node, NodeState, Outcome, Transition};
use super::params::LbParams;
use crate::model::{NodeAddr, RouteNode};

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
}

impl Pick {
    /// The chosen node, if any.
    pub fn addr(self) -> Option<NodeAddr> {
        match self {
            Pick::Idle(a) | Pick::Probe(a) => Some(a),
            Pick::Overloaded | Pick::NoSuchModule => None,
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
}

/// The L5 load balancer of one module.
///
/// Nodes live in `nodes`; the two lists hold indices into it. Every node is
/// in exactly one list, the one its state names.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleLb {
    nodes: Vec<Node>,
    /// `(addr.key(), index)` sorted by key: the report path's lookup.
    index: Vec<(u64, u32)>,
    idle: VecDeque<u32>,
    overload: VecDeque<u32>,
    /// getHosts since the last probe, counted only while some node is overloaded.
    access_cnt: u32,
    version: u64,
}

impl ModuleLb {
    /// A module with `route` (duplicates after the first are ignored), every
    /// node idle with its window starting at `now`.
    pub fn new(route: &[RouteNode], version: u64, now: Millis, p: &LbParams) -> Self {
        let mut m = ModuleLb {
            nodes: Vec::new(),
            index: Vec::new(),
            idle: VecDeque::new(),
            overload: VecDeque::new(),
            access_cnt: 0,
            version,
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

    /// Every node, in route order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
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
    /// it to the tail). While some node is overloaded, every
    /// `probe_num`-th getHost takes the head of the overload list instead
    /// (and rotates it); when every node is overloaded the others answer
    /// [`Pick::Overloaded`].
    pub fn get_host(&mut self, p: &LbParams) -> Pick {
        if self.overload.is_empty() {
            self.access_cnt = 0;
            return match rotate(&mut self.idle) {
                Some(i) => Pick::Idle(self.nodes[i as usize].addr()),
                None => Pick::NoSuchModule,
            };
        }
        self.access_cnt += 1;
        if self.access_cnt >= p.probe_num {
            self.access_cnt = 0;
            let i = rotate(&mut self.overload).expect("overload list is not empty");
            return Pick::Probe(self.nodes[i as usize].addr());
        }
        match rotate(&mut self.idle) {
            Some(i) => Pick::Idle(self.nodes[i as usize].addr()),
            None => Pick::Overloaded,
        }
    }

    /// Applies one reported call to `addr` at `now`; returns the node's state
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
        let i = self.find(addr).ok_or(UnknownNode(addr))?;
        Ok(self.report_at(i, outcome, now, p))
    }

    /// Applies `count` successful calls to `addr` at `now`, exactly as
    /// `count` single successes would, calling `on_transition` for every
    /// state change they cause. Costs O(1) while the node is idle and its
    /// window is not due.
    ///
    /// # Errors
    /// [`UnknownNode`] when `addr` is not in the route; nothing changes.
    pub fn report_successes(
        &mut self,
        addr: NodeAddr,
        mut count: u32,
        now: Millis,
        p: &LbParams,
        mut on_transition: impl FnMut(Transition),
    ) -> Result<(), UnknownNode> {
        let i = self.find(addr).ok_or(UnknownNode(addr))?;
        // An overloaded node returns to idle within contin_succ_lim successes,
        // and a window, once reset, is not due again at the same `now`: the
        // loop runs a bounded number of single steps, then adds the rest.
        while count > 0 && self.nodes[i].success_is_eventful(now, p) {
            if let Some(t) = self.report_at(i, Outcome::Success, now, p) {
                on_transition(t);
            }
            count -= 1;
        }
        if count > 0 {
            self.nodes[i].add_quiet_successes(count);
        }
        Ok(())
    }

    /// Replaces the route: nodes that stay keep their state and list position
    /// (their weight is updated), new nodes join the tail of the idle list,
    /// removed nodes leave both lists. Duplicate entries after the first are
    /// ignored. An empty route leaves a module that answers
    /// [`Pick::NoSuchModule`].
    pub fn update_route(&mut self, route: &[RouteNode], version: u64, now: Millis, p: &LbParams) {
        self.version = version;
        let mut wanted: Vec<(u64, &RouteNode)> = route.iter().map(|r| (r.addr.key(), r)).collect();
        wanted.sort_by_key(|&(k, _)| k);
        wanted.dedup_by_key(|&mut (k, _)| k);

        // Surviving nodes keep their relative order; old index -> new index.
        let mut remap = vec![u32::MAX; self.nodes.len()];
        let mut nodes = Vec::with_capacity(wanted.len());
        for (old, mut node) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            if let Ok(w) = wanted.binary_search_by_key(&node.addr().key(), |&(k, _)| k) {
                node.set_weight(wanted[w].1.weight);
                remap[old] = nodes.len() as u32;
                nodes.push(node);
            }
        }
        let keep = |list: &VecDeque<u32>| -> VecDeque<u32> {
            list.iter()
                .map(|&i| remap[i as usize])
                .filter(|&i| i != u32::MAX)
                .collect()
        };
        let mut idle = keep(&self.idle);
        self.overload = keep(&self.overload);

        // New nodes, in the route's own order.
        let mut seen = Vec::with_capacity(route.len());
        for r in route {
            let key = r.addr.key();
            let known = nodes.iter().any(|n: &Node| n.addr().key() == key);
            if !known && !seen.contains(&key) {
                seen.push(key);
                idle.push_back(nodes.len() as u32);
                nodes.push(Node::new(*r, now, p));
            }
        }
        self.idle = idle;
        self.nodes = nodes;
        self.index = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.addr().key(), i as u32))
            .collect();
        self.index.sort_unstable_by_key(|&(k, _)| k);
        if self.overload.is_empty() {
            self.access_cnt = 0;
        }
    }

    /// Takes every node's real call counts since the last call (for the
    /// reporter), appending one entry per node to `out`.
    pub fn take_stats(&mut self, out: &mut Vec<NodeCallStats>) {
        for n in &mut self.nodes {
            let (succ, err) = n.take_stats();
            out.push(NodeCallStats {
                addr: n.addr(),
                succ,
                err,
                overloaded: n.state() == NodeState::Overloaded,
            });
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
        if self.index.len() != self.nodes.len()
            || self
                .index
                .iter()
                .any(|&(k, i)| self.nodes.get(i as usize).map(|n| n.addr().key()) != Some(k))
        {
            return Err("lookup index does not match the nodes".into());
        }
        Ok(())
    }

    fn find(&self, addr: NodeAddr) -> Option<usize> {
        let key = addr.key();
        self.index
            .binary_search_by_key(&key, |&(k, _)| k)
            .ok()
            .map(|pos| self.index[pos].1 as usize)
    }

    fn report_at(
        &mut self,
        i: usize,
        outcome: Outcome,
        now: Millis,
        p: &LbParams,
    ) -> Option<Transition> {
        let (to, reason) = self.nodes[i].report(outcome, now, p)?;
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
        Some(Transition {
            addr: self.nodes[i].addr(),
            to,
            reason,
        })
    }
}

/// Takes the head of a list and appends it to the tail.
fn rotate(list: &mut VecDeque<u32>) -> Option<u32> {
    let head = list.pop_front()?;
    list.push_back(head);
    Some(head)
}
