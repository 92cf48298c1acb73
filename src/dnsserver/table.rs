//! The route table: every module's route as the route server serves it,
//! immutable once built, with each module's RouteAnswer and RoutePush
//! frames encoded once per module version.
//!
//! Pure: no store, no sockets, no clocks. The store thread builds a new
//! table from what the store returned ([`RouteTable::replace_all`] for a
//! full reload, [`RouteTable::apply`] for the change log) and gets back the
//! list of modules that changed, deletions included; the serving executors
//! only read tables.
//!
//! # Answers without encoding
//!
//! A pull is answered by copying the module's pre-encoded RouteAnswer frame
//! and writing the request's sequence number over the placeholder at
//! [`ModuleEntry::answer_seq_at`]: the `seq` field is a fixed-width u64
//! inside the FlatBuffers table, and the placeholder (`u64::MAX`, never a
//! default) makes sure the builder wrote it. The offset is read back from
//! the verified buffer, not guessed.

use std::sync::Arc;

use super::module_map::ModuleMap;

use lbagent_model::{ModuleId, ModuleOptions, NodeAddr, NodeMeta, Policy, RouteNode};
use lbagent_store::{Changes, ModuleRoute, RouteSet};
use lbagent_wire::{decode, fb, write_frame, Encoder, FrameError, Limits, Message};

/// The length of a frame's length prefix.
const PREFIX_LEN: usize = 4;

/// One module's route and its frames.
#[derive(Debug, PartialEq, Eq)]
pub struct ModuleEntry {
    /// The module.
    pub module: ModuleId,
    /// Its version (from the store; changes whenever its nodes do).
    pub version: u64,
    /// Its nodes, sorted by address.
    pub nodes: Vec<RouteNode>,
    /// Its policy, carried in both frames.
    pub policy: Policy,
    /// Its own options, carried in both frames.
    pub options: ModuleOptions,
    /// Its nodes' zones and labels (those that have any, by address),
    /// carried in both frames as `node_meta`.
    pub meta: Vec<(NodeAddr, NodeMeta)>,
    /// A RouteAnswer frame (length prefix included) with `seq` =
    /// `u64::MAX`, to be patched with [`ModuleEntry::write_answer`].
    answer: Box<[u8]>,
    /// Where, in `answer`, the 8 bytes of `seq` are.
    answer_seq_at: usize,
    /// The RoutePush frame (length prefix included) of this version.
    push: Arc<[u8]>,
}

/// Why a module cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// The module's answer does not fit in one frame.
    #[error("module {module} has {nodes} nodes: its answer does not fit in one frame ({source}); split the module")]
    TooLarge {
        /// The module.
        module: ModuleId,
        /// How many nodes it has.
        nodes: usize,
        /// The framing error.
        source: FrameError,
    },
}

impl ModuleEntry {
    /// Encodes `module`'s frames for `version`, `nodes` (sorted here by
    /// address, duplicates kept as given), `policy`, `options` and the
    /// nodes' zones and labels (`meta`, sorted by address). An agent older
    /// than `node_meta` ignores the appended field (FlatBuffers skips
    /// fields its schema does not know) and serves the nodes without.
    ///
    /// # Errors
    /// [`EntryError::TooLarge`] when a frame would exceed the frame limit.
    pub fn new(
        module: ModuleId,
        version: u64,
        mut nodes: Vec<RouteNode>,
        (policy, options): (Policy, ModuleOptions),
        meta: Vec<(NodeAddr, NodeMeta)>,
        enc: &mut Encoder,
    ) -> Result<ModuleEntry, EntryError> {
        nodes.sort_by_key(|n| n.addr.key());
        let too_large = |source| EntryError::TooLarge {
            module,
            nodes: nodes.len(),
            source,
        };
        let mut answer = Vec::new();
        write_frame(
            &mut answer,
            enc.route_answer_meta(
                u64::MAX,
                module,
                true,
                version,
                &nodes,
                policy,
                &options,
                &meta,
            ),
        )
        .map_err(too_large)?;
        let answer_seq_at = PREFIX_LEN + seq_offset(&answer[PREFIX_LEN..]);
        let mut push = Vec::new();
        let push_msg = enc.route_push_meta(module, true, version, &nodes, policy, &options, &meta);
        write_frame(&mut push, push_msg).map_err(too_large)?;
        Ok(ModuleEntry {
            module,
            version,
            nodes,
            policy,
            options,
            meta,
            answer: answer.into_boxed_slice(),
            answer_seq_at,
            push: push.into(),
        })
    }

    /// Appends this module's RouteAnswer frame for PullReq `seq` to `out`.
    pub fn write_answer(&self, seq: u64, out: &mut Vec<u8>) {
        let at = out.len() + self.answer_seq_at;
        out.extend_from_slice(&self.answer);
        out[at..at + 8].copy_from_slice(&seq.to_le_bytes());
    }

    /// The RoutePush frame of this version, length prefix included.
    pub fn push_frame(&self) -> &Arc<[u8]> {
        &self.push
    }

    /// Where the `seq` bytes are in the answer frame (for tests).
    pub fn answer_seq_at(&self) -> usize {
        self.answer_seq_at
    }

    fn same_route(
        &self,
        version: u64,
        nodes: &[RouteNode],
        policy: (Policy, ModuleOptions),
        meta: &[(NodeAddr, NodeMeta)],
    ) -> bool {
        self.version == version
            && self.nodes == nodes
            && self.policy == policy.0
            && self.options == policy.1
            && self.meta == meta
    }
}

/// The offset of RouteAnswer.seq in `buf`, an encoding of a RouteAnswer
/// whose seq is not the default (so the field is present).
fn seq_offset(buf: &[u8]) -> usize {
    // The encoder's own output always verifies and always has the field;
    // anything else is a bug in the wire module.
    let Ok(Message::RouteAnswer(answer)) = decode(buf, &Limits::TCP_FRAME) else {
        unreachable!("the encoder produced a RouteAnswer that does not decode");
    };
    let table = answer._tab;
    let field = table.vtable().get(fb::RouteAnswer::VT_SEQ) as usize;
    assert!(field != 0, "RouteAnswer.seq was not written");
    table.loc() + field
}

/// A module that changed between two tables, with the frame that tells its
/// subscribers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// The module.
    pub module: ModuleId,
    /// The RoutePush frame, length prefix included: the new route, or
    /// `exists = false` when the module was deleted.
    pub push: Arc<[u8]>,
}

/// Every module's route at one route version. Immutable: a change builds a
/// new table that shares the unchanged modules, and copies only the small
/// part of the module map that leads to the changed ones (see
/// [`ModuleMap`]).
#[derive(Clone, Debug, Default)]
pub struct RouteTable {
    version: u64,
    loaded: bool,
    modules: ModuleMap<ModuleEntry>,
}

/// What a reload produced: the new table, the modules that changed and the
/// modules that could not be served.
#[derive(Debug)]
pub struct Reloaded {
    /// The new table.
    pub table: RouteTable,
    /// Modules whose route changed (added, modified, deleted), by module.
    pub changes: Vec<Change>,
    /// Modules left out of the table, each with why.
    pub refused: Vec<EntryError>,
}

impl RouteTable {
    /// The table before the first load: no module, not loaded.
    pub fn unloaded() -> RouteTable {
        RouteTable::default()
    }

    /// The route version the table reflects.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether the table was ever loaded from the store (until then pulls
    /// cannot be answered truthfully).
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    /// How many modules it holds.
    pub fn len(&self) -> usize {
        self.modules.len()
    }

    /// Whether it holds no module.
    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }

    /// `module`'s route, if it has one.
    pub fn get(&self, module: ModuleId) -> Option<&Arc<ModuleEntry>> {
        self.modules.get(module)
    }

    /// Every module's entry, in no order.
    pub fn entries(&self) -> impl Iterator<Item = &Arc<ModuleEntry>> {
        self.modules.values()
    }

    /// Whether this table and `other` hold `module` in the same leaf of
    /// their module maps (nothing of it was copied): for tests.
    pub fn shares_leaf_of(&self, other: &RouteTable, module: ModuleId) -> bool {
        self.modules.shares_leaf_of(&other.modules, module)
    }

    /// The table after a full reload that read `set`: every module of
    /// `set`, and a [`Change`] for each module added, modified (nodes or
    /// version) or gone. Unchanged modules keep their entries (and frames).
    pub fn replace_all(&self, set: RouteSet, enc: &mut Encoder) -> Reloaded {
        let mut modules = Vec::with_capacity(set.modules.len());
        let mut changes = Vec::new();
        let mut refused = Vec::new();
        for route in set.modules {
            let module = route.module;
            if route.nodes.is_empty() {
                continue;
            }
            match self.updated(route, enc) {
                Ok(Updated::Same(entry)) => modules.push((module, entry)),
                Ok(Updated::New(entry)) => {
                    changes.push(Change {
                        module,
                        push: entry.push.clone(),
                    });
                    modules.push((module, entry));
                }
                Err(e) => {
                    // Keep serving what we had: the refusal is logged.
                    refused.push(e);
                    if let Some(old) = self.modules.get(module) {
                        modules.push((module, old.clone()));
                    }
                }
            }
        }
        let modules: ModuleMap<ModuleEntry> = modules.into_iter().collect();
        for (module, _) in self.modules.iter() {
            if modules.get(module).is_none() {
                changes.push(deleted(module, set.version, enc));
            }
        }
        changes.sort_by_key(|c| c.module);
        Reloaded {
            table: RouteTable {
                version: set.version,
                loaded: true,
                modules,
            },
            changes,
            refused,
        }
    }

    /// The table after applying the change log's `changes`: each listed
    /// module takes its current route (none: deleted), and a [`Change`] is
    /// reported for each module whose route differs from this table's.
    /// A module listed with no nodes that this table does not hold is no
    /// change. The cost is that of the listed modules: the new table
    /// shares every other module, and the map's nodes that lead only to
    /// them, with this one.
    pub fn apply(&self, changes: Changes, enc: &mut Encoder) -> Reloaded {
        let mut modules = self.modules.clone();
        let mut out = Vec::new();
        let mut refused = Vec::new();
        for route in changes.modules {
            let module = route.module;
            if route.nodes.is_empty() {
                if modules.remove(module).is_some() {
                    out.push(deleted(module, route.version, enc));
                }
                continue;
            }
            match self.updated(route, enc) {
                Ok(Updated::Same(_)) => {}
                Ok(Updated::New(entry)) => {
                    out.push(Change {
                        module,
                        push: entry.push.clone(),
                    });
                    modules.insert(module, entry);
                }
                // Keep serving what we had: the refusal is logged.
                Err(e) => refused.push(e),
            }
        }
        out.sort_by_key(|c| c.module);
        out.dedup_by_key(|c| c.module);
        Reloaded {
            table: RouteTable {
                version: changes.version,
                loaded: true,
                modules,
            },
            changes: out,
            refused,
        }
    }

    /// `route` against this table's entry for its module.
    fn updated(&self, route: ModuleRoute, enc: &mut Encoder) -> Result<Updated, EntryError> {
        let ModuleRoute {
            module,
            version,
            mut nodes,
            policy,
            options,
            meta,
        } = route;
        nodes.sort_by_key(|n| n.addr.key());
        if let Some(old) = self.modules.get(module) {
            if old.same_route(version, &nodes, (policy, options), &meta) {
                return Ok(Updated::Same(old.clone()));
            }
        }
        ModuleEntry::new(module, version, nodes, (policy, options), meta, enc)
            .map(|e| Updated::New(Arc::new(e)))
    }
}

enum Updated {
    Same(Arc<ModuleEntry>),
    New(Arc<ModuleEntry>),
}

/// The change that tells subscribers `module` is gone (as of `version`).
fn deleted(module: ModuleId, version: u64, enc: &mut Encoder) -> Change {
    let mut push = Vec::new();
    write_frame(&mut push, enc.route_push(module, false, version, &[]))
        .expect("a RoutePush without nodes fits a frame");
    Change {
        module,
        push: push.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_model::NodeAddr;
    use lbagent_wire::FrameDecoder;
    use std::net::Ipv4Addr;

    const A: ModuleId = ModuleId::new(1, 1);
    const B: ModuleId = ModuleId::new(2, 7);
    const C: ModuleId = ModuleId::new(3, 0);

    fn node(last: u8, port: u16) -> RouteNode {
        RouteNode {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), port),
            weight: 1,
        }
    }

    fn route(module: ModuleId, version: u64, nodes: &[RouteNode]) -> ModuleRoute {
        ModuleRoute {
            module,
            version,
            nodes: nodes.to_vec(),
            policy: Policy::L5,
            options: Default::default(),
            meta: vec![],
        }
    }

    fn loaded(routes: Vec<ModuleRoute>, version: u64) -> RouteTable {
        let set = RouteSet {
            version,
            modules: routes,
        };
        RouteTable::unloaded()
            .replace_all(set, &mut Encoder::new())
            .table
    }

    /// The one frame in `bytes`, decoded as a RoutePush: (module, exists,
    /// version, nodes).
    fn push_of(bytes: &[u8]) -> (ModuleId, bool, u64, Vec<RouteNode>) {
        let mut frames = FrameDecoder::default();
        frames.feed(bytes);
        let frame = frames.next_frame().unwrap().unwrap();
        let Ok(Message::RoutePush(p)) = decode(frame, &Limits::TCP_FRAME) else {
            panic!("not a RoutePush");
        };
        let nodes = p.nodes().unwrap_or_default().iter().map(RouteNode::from);
        let out = (
            ModuleId::new(p.modid(), p.cmdid()),
            p.exists(),
            p.version(),
            nodes.collect(),
        );
        assert_eq!(frames.next_frame().unwrap(), None, "exactly one frame");
        out
    }

    fn changed(r: &Reloaded) -> Vec<(ModuleId, bool, u64)> {
        r.changes
            .iter()
            .map(|c| {
                let (m, exists, version, _) = push_of(&c.push);
                assert_eq!(m, c.module);
                (m, exists, version)
            })
            .collect()
    }

    #[test]
    fn a_patched_answer_carries_the_requests_seq_and_the_route() {
        let nodes = vec![node(2, 80), node(1, 80)];
        let entry =
            ModuleEntry::new(A, 9, nodes, Default::default(), vec![], &mut Encoder::new()).unwrap();
        for seq in [0, 1, 0x0102_0304_0506_0708, u64::MAX] {
            let mut out = b"earlier bytes".to_vec();
            entry.write_answer(seq, &mut out);
            let mut frames = FrameDecoder::default();
            frames.feed(&out[13..]);
            let frame = frames.next_frame().unwrap().unwrap();
            let Ok(Message::RouteAnswer(a)) = decode(frame, &Limits::TCP_FRAME) else {
                panic!("not a RouteAnswer");
            };
            assert_eq!(a.seq(), seq);
            assert_eq!(
                (a.modid(), a.cmdid(), a.exists(), a.version()),
                (1, 1, true, 9)
            );
            let got: Vec<RouteNode> = a.nodes().unwrap().iter().map(RouteNode::from).collect();
            assert_eq!(got, vec![node(1, 80), node(2, 80)], "sorted by address");
            assert_eq!(&out[..13], b"earlier bytes");
        }
    }

    #[test]
    fn the_first_load_reports_every_module_as_changed() {
        let set = RouteSet {
            version: 4,
            modules: vec![route(A, 3, &[node(1, 80)]), route(B, 4, &[node(2, 80)])],
        };
        let r = RouteTable::unloaded().replace_all(set, &mut Encoder::new());
        assert!(r.table.is_loaded());
        assert_eq!(r.table.version(), 4);
        assert_eq!(changed(&r), vec![(A, true, 3), (B, true, 4)]);
    }

    #[test]
    fn a_full_reload_reports_added_modified_and_deleted_modules_only() {
        let old = loaded(
            vec![
                route(A, 1, &[node(1, 80)]),
                route(B, 2, &[node(2, 80)]),
                route(C, 3, &[node(3, 80)]),
            ],
            3,
        );
        let set = RouteSet {
            version: 6,
            modules: vec![
                route(A, 1, &[node(1, 80)]),
                route(B, 5, &[node(2, 80), node(4, 80)]),
                route(ModuleId::new(9, 9), 6, &[node(9, 80)]),
            ],
        };
        let r = old.replace_all(set, &mut Encoder::new());
        assert_eq!(
            changed(&r),
            vec![(B, true, 5), (C, false, 6), (ModuleId::new(9, 9), true, 6)]
        );
        assert!(
            Arc::ptr_eq(r.table.get(A).unwrap(), old.get(A).unwrap()),
            "an unchanged module keeps its entry"
        );
        assert!(r.table.get(C).is_none());
        assert_eq!(r.table.len(), 3);
    }

    #[test]
    fn a_node_order_difference_is_no_change() {
        let old = loaded(vec![route(A, 1, &[node(1, 80), node(2, 80)])], 1);
        let set = RouteSet {
            version: 1,
            modules: vec![route(A, 1, &[node(2, 80), node(1, 80)])],
        };
        assert!(old.replace_all(set, &mut Encoder::new()).changes.is_empty());
    }

    #[test]
    fn a_module_with_no_nodes_in_a_full_reload_is_absent() {
        let old = loaded(vec![route(A, 1, &[node(1, 80)])], 1);
        let set = RouteSet {
            version: 2,
            modules: vec![route(A, 2, &[])],
        };
        let r = old.replace_all(set, &mut Encoder::new());
        assert_eq!(changed(&r), vec![(A, false, 2)]);
        assert!(r.table.is_empty());
    }

    #[test]
    fn the_change_log_applies_changes_and_deletions() {
        let old = loaded(
            vec![route(A, 1, &[node(1, 80)]), route(B, 2, &[node(2, 80)])],
            2,
        );
        let changes = Changes {
            version: 5,
            modules: vec![
                route(A, 4, &[]),
                route(B, 5, &[node(2, 81)]),
                route(C, 3, &[]),
            ],
        };
        let r = old.apply(changes, &mut Encoder::new());
        assert_eq!(changed(&r), vec![(A, false, 4), (B, true, 5)]);
        assert_eq!(r.table.version(), 5);
        assert!(r.table.get(A).is_none());
        assert_eq!(r.table.get(B).unwrap().nodes, vec![node(2, 81)]);
        assert!(
            r.table.get(C).is_none(),
            "a module created and deleted in between"
        );
        assert_eq!(old.len(), 2, "the old table is untouched");
    }

    #[test]
    fn applying_a_change_shares_every_unchanged_module_and_copies_little() {
        let modules: Vec<ModuleRoute> = (0..20_000)
            .map(|i| route(ModuleId::new(i, 1), 1, &[node(1, 80)]))
            .collect();
        let old = loaded(modules, 1);
        let moved = ModuleId::new(7, 1);
        let gone = ModuleId::new(8, 1);
        let changes = Changes {
            version: 3,
            modules: vec![route(moved, 2, &[node(2, 80)]), route(gone, 3, &[])],
        };
        let r = old.apply(changes, &mut Encoder::new());
        assert_eq!(changed(&r), vec![(moved, true, 2), (gone, false, 3)]);
        let mut copied = 0;
        for i in 0..20_000 {
            let m = ModuleId::new(i, 1);
            if m == moved || m == gone {
                continue;
            }
            assert!(
                Arc::ptr_eq(r.table.get(m).unwrap(), old.get(m).unwrap()),
                "module {m} is shared"
            );
            copied += usize::from(!r.table.shares_leaf_of(&old, m));
        }
        // Only the two changed modules' leaves (a few modules each) were copied.
        assert!(
            copied <= 20,
            "{copied} unchanged modules sit in copied leaves"
        );
    }

    #[test]
    fn a_change_log_entry_that_changes_nothing_is_no_change() {
        let old = loaded(vec![route(A, 1, &[node(1, 80)])], 1);
        let changes = Changes {
            version: 2,
            modules: vec![route(A, 1, &[node(1, 80)])],
        };
        let r = old.apply(changes, &mut Encoder::new());
        assert!(r.changes.is_empty());
        assert_eq!(r.table.version(), 2);
    }

    /// Issue 31: the store's zones and labels reach the agents: a change
    /// of a node's zone alone is a change, pushed and answered with
    /// `node_meta`.
    #[test]
    fn a_zone_or_label_change_is_pushed_and_answered_with_the_nodes_meta() {
        let meta = |zone: &str| lbagent_model::NodeMeta {
            zone: Some(zone.parse().unwrap()),
            labels: "version=canary".parse().unwrap(),
        };
        let old = loaded(vec![route(A, 1, &[node(1, 80), node(2, 80)])], 1);
        let mut with_zone = route(A, 1, &[node(1, 80), node(2, 80)]);
        with_zone.meta = vec![(node(2, 80).addr, meta("eu-1"))];
        let r = old.apply(
            Changes {
                version: 2,
                modules: vec![with_zone],
            },
            &mut Encoder::new(),
        );
        assert_eq!(changed(&r), vec![(A, true, 1)], "the meta alone changed");
        let mut frames = FrameDecoder::default();
        frames.feed(&r.changes[0].push);
        let frame = frames.next_frame().unwrap().unwrap();
        let Ok(Message::RoutePush(p)) = decode(frame, &Limits::TCP_FRAME) else {
            panic!("not a RoutePush");
        };
        let got = lbagent_wire::read_node_meta(p.node_meta(), 2).unwrap();
        assert_eq!(got, vec![(node(2, 80).addr, meta("eu-1"))]);
        let mut out = Vec::new();
        r.table.get(A).unwrap().write_answer(7, &mut out);
        let mut frames = FrameDecoder::default();
        frames.feed(&out);
        let frame = frames.next_frame().unwrap().unwrap();
        let Ok(Message::RouteAnswer(a)) = decode(frame, &Limits::TCP_FRAME) else {
            panic!("not a RouteAnswer");
        };
        assert_eq!(a.seq(), 7);
        let got = lbagent_wire::read_node_meta(a.node_meta(), 2).unwrap();
        assert_eq!(got, vec![(node(2, 80).addr, meta("eu-1"))]);
    }

    #[test]
    fn a_module_too_large_for_a_frame_is_refused_not_served() {
        // 16 MiB / 12 bytes per node: 1.4 M nodes do not fit.
        let nodes: Vec<RouteNode> = (0..1_500_000u32)
            .map(|i| RouteNode {
                addr: NodeAddr { ip: i, port: 80 },
                weight: 1,
            })
            .collect();
        let set = RouteSet {
            version: 1,
            modules: vec![route(A, 1, &nodes), route(B, 1, &[node(1, 80)])],
        };
        let r = RouteTable::unloaded().replace_all(set, &mut Encoder::new());
        assert_eq!(r.refused.len(), 1);
        assert!(r.refused[0].to_string().contains("split the module"));
        assert!(r.table.get(A).is_none());
        assert!(r.table.get(B).is_some());
    }
}
