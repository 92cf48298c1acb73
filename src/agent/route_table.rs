//! The control core's copy of every route it knows, what the static route
//! file is written from (so a snapshot never asks the shards). Pure: no
//! ring, no clock, no file.
//!
//! After a restart the table starts from the snapshot the agent read
//! ([`RouteTable::from_snapshot`]) without decoding it first: the control
//! core fills the table from it in slices ([`RouteTable::fill_step`]) once
//! the agent serves, so that the first heartbeat (and with it the first
//! answer) does not wait for 100,000 routes to be made into vectors.
//! Whatever the route server says about a module meanwhile wins over the
//! snapshot: a module set or forgotten before its slice came is left as the
//! route server made it.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use lbagent_host::snapshot::{SnapshotIndex, SnapshotRoute};
use lbagent_model::{ModuleId, NodeAddr, NodeMeta, RouteNode};

/// A module's route as held: version, nodes, and the zones and labels of
/// those nodes that have any.
type Held = (u64, Vec<RouteNode>, Vec<(NodeAddr, NodeMeta)>);

/// module → (version, nodes, meta): the routes the control core holds.
#[derive(Debug, Default)]
pub struct RouteTable {
    routes: HashMap<ModuleId, Held>,
    fill: Option<Fill>,
}

/// The snapshot's routes not yet in the table.
#[derive(Debug)]
struct Fill {
    snapshot: Arc<SnapshotIndex>,
    /// The first route of the snapshot not yet looked at.
    next: usize,
    /// Modules still ahead of `next` that the route server dropped or the
    /// shards forgot while filling: the snapshot's (older) word on them is
    /// not taken. (A module the route server set needs no entry: the table
    /// holds it, and the fill never overwrites a held module.)
    touched: HashSet<ModuleId>,
}

impl RouteTable {
    /// An empty table.
    pub fn new() -> Self {
        RouteTable::default()
    }

    /// A table to be filled from `snapshot` by [`RouteTable::fill_step`].
    pub fn from_snapshot(snapshot: Arc<SnapshotIndex>) -> Self {
        RouteTable {
            routes: HashMap::with_capacity(snapshot.len()),
            fill: (!snapshot.is_empty()).then(|| Fill {
                snapshot,
                next: 0,
                touched: HashSet::new(),
            }),
        }
    }

    /// Takes a route from the route server, with its nodes' zones and
    /// labels (`meta`, kept for the snapshot): `nodes` empty (or the module
    /// absent there) drops the module.
    pub fn set(
        &mut self,
        module: ModuleId,
        version: u64,
        nodes: Vec<RouteNode>,
        meta: Vec<(NodeAddr, NodeMeta)>,
    ) {
        if nodes.is_empty() {
            self.touch(module);
            self.routes.remove(&module);
        } else {
            self.routes.insert(module, (version, nodes, meta));
        }
    }

    /// Drops a module no shard holds any more.
    pub fn forget(&mut self, module: ModuleId) {
        self.touch(module);
        self.routes.remove(&module);
    }

    /// Keeps the fill from taking `module` later (only a module the fill
    /// has yet to reach needs it).
    fn touch(&mut self, module: ModuleId) {
        if let Some(f) = &mut self.fill {
            if f.snapshot.find(module).is_some_and(|i| i >= f.next) {
                f.touched.insert(module);
            }
        }
    }

    /// Takes more of the snapshot's routes into the table, until routes of
    /// `max_nodes` nodes in all were looked at (at least one route),
    /// calling `taken` with each module taken (the control core subscribes
    /// to it); true while some remain. Once all are taken the table lets go
    /// of the snapshot.
    pub fn fill_step(&mut self, max_nodes: usize, mut taken: impl FnMut(ModuleId)) -> bool {
        let Some(f) = &mut self.fill else {
            return false;
        };
        // Every route counts at least one node, so a budget of at least
        // one takes at least one route.
        let budget = max_nodes.max(1);
        let mut nodes = 0usize;
        while f.next < f.snapshot.len() && nodes < budget {
            let i = f.next;
            f.next += 1;
            let module = f.snapshot.module(i);
            let count = f.snapshot.node_count(i);
            nodes += count.max(1);
            if f.touched.contains(&module) || count == 0 {
                continue;
            }
            if let Entry::Vacant(e) = self.routes.entry(module) {
                e.insert((
                    f.snapshot.version(i),
                    f.snapshot.nodes(i),
                    f.snapshot.meta(i),
                ));
                taken(module);
            }
        }
        if f.next == f.snapshot.len() {
            self.fill = None;
        }
        self.fill.is_some()
    }

    /// True while some of the snapshot's routes are not yet in the table
    /// (what a snapshot written now would lose).
    pub fn filling(&self) -> bool {
        self.fill.is_some()
    }

    /// How many modules the table holds.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True when it holds none.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// `module`'s (version, nodes), if held.
    #[cfg(test)]
    pub fn get(&self, module: ModuleId) -> Option<(u64, &[RouteNode])> {
        self.routes.get(&module).map(|(v, n, _)| (*v, n.as_slice()))
    }

    /// The table as the snapshot file's sorted list.
    pub fn snapshot_routes(&self) -> Vec<SnapshotRoute> {
        let mut routes: Vec<SnapshotRoute> = self
            .routes
            .iter()
            .map(|(m, (v, nodes, meta))| SnapshotRoute {
                module: *m,
                version: *v,
                nodes: nodes.clone(),
                meta: meta.clone(),
            })
            .collect();
        routes.sort_by_key(|r| r.module);
        routes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_host::snapshot;
    use lbagent_model::NodeAddr;

    fn nodes(n: u32) -> Vec<RouteNode> {
        (0..n)
            .map(|i| RouteNode {
                addr: NodeAddr {
                    ip: 0x0a00_0000 + i,
                    port: 80,
                },
                weight: 1,
            })
            .collect()
    }

    fn index(routes: &[SnapshotRoute]) -> Arc<SnapshotIndex> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        snapshot::write(&path, 1, routes).unwrap();
        Arc::new(snapshot::read_index(&path).unwrap())
    }

    /// Modules 0..4 at version 1, two nodes each.
    fn four_modules() -> Vec<SnapshotRoute> {
        (0..4)
            .map(|k| SnapshotRoute {
                module: m(k),
                version: 1,
                nodes: nodes(2),
                meta: Vec::new(),
            })
            .collect()
    }

    fn m(k: u32) -> ModuleId {
        ModuleId::new(k, 1)
    }

    #[test]
    fn fills_from_the_snapshot_in_slices_and_lets_go_of_it() {
        let routes: Vec<SnapshotRoute> = (0..10)
            .map(|k| SnapshotRoute {
                module: m(k),
                version: u64::from(k) + 100,
                nodes: nodes(k % 3),
                meta: Vec::new(),
            })
            .collect();
        let snap = index(&routes);
        let mut t = RouteTable::from_snapshot(snap.clone());
        assert!(t.filling() && t.is_empty());
        let mut taken = Vec::new();
        // Nodes 0, 1, 2, 0, 1, 2, ... (an empty route counts as one): 4
        // nodes are routes 0-2, then 3-5, then 6-8, then 9.
        assert!(t.fill_step(4, |m| taken.push(m)));
        assert_eq!(taken, [m(1), m(2)]);
        assert!(t.fill_step(4, |m| taken.push(m)));
        assert!(t.fill_step(4, |m| taken.push(m)));
        assert!(!t.fill_step(4, |m| taken.push(m)));
        assert!(!t.filling());
        assert_eq!(Arc::strong_count(&snap), 1, "the snapshot is let go");
        // Routes with no node are not taken (the agent writes none).
        let expected: Vec<ModuleId> = (0..10).filter(|k| k % 3 != 0).map(m).collect();
        assert_eq!(taken, expected);
        assert_eq!(t.len(), expected.len());
        assert_eq!(t.get(m(5)), Some((105, nodes(2).as_slice())));
        let written: Vec<SnapshotRoute> =
            routes.into_iter().filter(|r| !r.nodes.is_empty()).collect();
        assert_eq!(t.snapshot_routes(), written);
        assert!(!t.fill_step(4, |_| panic!("nothing left")));
    }

    #[test]
    fn the_route_servers_word_wins_over_the_snapshot() {
        let routes = four_modules();
        let mut t = RouteTable::from_snapshot(index(&routes));
        // Before their slice: 0 updated, 1 gone at the route server, 2
        // forgotten by its shard.
        t.set(m(0), 9, nodes(5), vec![]);
        t.set(m(1), 9, Vec::new(), vec![]);
        t.forget(m(2));
        let mut taken = Vec::new();
        while t.fill_step(1, |m| taken.push(m)) {}
        assert_eq!(taken, [m(3)]);
        assert_eq!(t.get(m(0)), Some((9, nodes(5).as_slice())));
        assert_eq!(t.get(m(1)), None);
        assert_eq!(t.get(m(2)), None);
        assert_eq!(t.get(m(3)), Some((1, nodes(2).as_slice())));
        // After the fill, changes need no bookkeeping.
        t.forget(m(3));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn only_dropped_modules_ahead_of_the_fill_are_remembered() {
        let routes = four_modules();
        let mut t = RouteTable::from_snapshot(index(&routes));
        assert!(t.fill_step(1, |_| {}));
        t.set(m(0), 9, Vec::new(), vec![]); // behind the fill
        t.set(m(2), 9, nodes(3), vec![]); // set: the table holds it
        t.forget(m(3)); // ahead: remembered
        t.set(m(7), 9, Vec::new(), vec![]); // not in the snapshot
        let touched = &t.fill.as_ref().expect("still filling").touched;
        assert_eq!(touched.iter().copied().collect::<Vec<_>>(), [m(3)]);
        while t.fill_step(1, |_| {}) {}
        assert_eq!(t.get(m(2)), Some((9, nodes(3).as_slice())));
        assert_eq!(t.get(m(3)), None);
    }

    #[test]
    fn a_step_takes_at_least_one_route_whatever_its_budget() {
        let routes: Vec<SnapshotRoute> = [3, 0, 1]
            .into_iter()
            .enumerate()
            .map(|(k, n)| SnapshotRoute {
                module: m(k as u32),
                version: 1,
                nodes: nodes(n),
                meta: Vec::new(),
            })
            .collect();
        let mut t = RouteTable::from_snapshot(index(&routes));
        let mut taken = Vec::new();
        // A route of 3 nodes over a budget of 1; an empty one counts 1.
        assert!(t.fill_step(1, |m| taken.push(m)));
        assert_eq!(taken, [m(0)]);
        assert!(t.fill_step(0, |m| taken.push(m)));
        assert_eq!(taken, [m(0)], "the empty route is looked at, not taken");
        assert!(!t.fill_step(0, |m| taken.push(m)));
        assert_eq!(taken, [m(0), m(2)]);
    }

    #[test]
    fn an_empty_table_has_nothing_to_fill() {
        let mut t = RouteTable::new();
        assert!(!t.filling());
        assert!(!t.fill_step(10, |_| panic!("nothing to take")));
        t.set(m(1), 2, nodes(1), vec![]);
        assert_eq!(t.snapshot_routes().len(), 1);
    }
}
