//! The snapshot at start: held as the file's bytes and made into modules
//! in slices ([`ShardCore::preload_step`]), or one at a time when a
//! request or a route names a module not yet made, so that the shard
//! serves at once.

use std::sync::Arc;

use super::ShardCore;
use crate::messages::ToShard;
use lbagent_host::snapshot::SnapshotIndex;
use lbagent_lb::Millis;
use lbagent_model::{ModuleId, Policy};

impl ShardCore {
    /// Takes the snapshot at start without making its modules yet, so
    /// that the shard serves at once: a request (or a route) for one of its
    /// share makes its module first, and [`ShardCore::preload_step`] makes
    /// the rest in slices of a bounded number of nodes. Routes with no node are not made (the agent
    /// writes none). Costs one pass over the file's route headers to count
    /// this shard's share; once all are made the shard lets go of the
    /// snapshot.
    pub fn preload(&mut self, snapshot: Arc<SnapshotIndex>) {
        let (id, shards) = (self.setup.id, self.setup.shards);
        let mut preload = Preload {
            made: vec![0; snapshot.len().div_ceil(64)],
            next: 0,
            left: 0,
            snapshot: None,
        };
        for i in 0..snapshot.len() {
            if snapshot.module(i).shard(shards) == id && snapshot.node_count(i) > 0 {
                preload.left += 1;
            } else {
                preload.set_made(i);
            }
        }
        if preload.left > 0 {
            preload.snapshot = Some(snapshot);
            self.preload = preload;
        } else {
            self.preload = Preload::default();
        }
    }

    /// Makes more of the preloaded modules at `now`, until modules of
    /// `max_nodes` nodes in all were made (at least one module, even with
    /// `max_nodes` 0); true while some remain. Nothing to make (an empty
    /// snapshot, or a share of routes with no node, which
    /// [`ShardCore::preload`] marks made): false at once.
    pub fn preload_step(&mut self, now: Millis, max_nodes: usize) -> bool {
        let mut made = 0;
        while (made == 0 || made < max_nodes) && self.preload.left > 0 {
            let i = self.preload.next;
            self.preload.next += 1;
            if !self.preload.is_made(i) {
                made += self.make_preloaded(i, now);
            }
        }
        if self.preload.left == 0 {
            self.preload = Preload::default();
        }
        self.preload.left > 0
    }

    /// How many of the snapshot's modules are not made yet.
    pub fn preloading(&self) -> usize {
        self.preload.left
    }

    /// Makes `module` from its preloaded route, if it has one waiting.
    /// Out of line: only the first seconds after a start come here.
    #[cold]
    #[inline(never)]
    pub(super) fn take_preloaded(&mut self, module: ModuleId, now: Millis) {
        // No clone of the Arc: its count is shared by every shard.
        let Some(i) = self.preload.snapshot.as_ref().and_then(|s| s.find(module)) else {
            return;
        };
        if !self.preload.is_made(i) {
            self.make_preloaded(i, now);
            if self.preload.left == 0 {
                self.preload = Preload::default();
            }
        }
    }

    /// Makes route `i` of the snapshot a module, as a route from the
    /// control core would; the number of its nodes (at least 1: routes
    /// with none are never made). The snapshot is held while any route is
    /// left to make (0 if not: nothing made).
    pub(super) fn make_preloaded(&mut self, i: usize, now: Millis) -> usize {
        let Some(snapshot) = &self.preload.snapshot else {
            return 0;
        };
        let nodes = snapshot.nodes(i);
        let count = nodes.len();
        let msg = ToShard::Route {
            module: snapshot.module(i),
            exists: true,
            version: snapshot.version(i),
            nodes,
            // The static route file keeps no policy: `l5` until the
            // module's route is pulled again. The nodes' zones and labels
            // come from the zones file beside it.
            policy: Policy::L5,
            options: Default::default(),
            meta: snapshot.meta(i),
        };
        self.preload.set_made(i);
        self.preload.left -= 1;
        // No register can wait on a module not yet made: nothing released.
        let released = self.apply_route(msg, now);
        debug_assert!(released.is_empty());
        count
    }
}

/// The snapshot a shard holds until it has made the modules of its share:
/// the file's bytes and index, shared by every shard and the control core
/// (nothing is copied per shard), and which of its routes this shard has
/// made (a bit per route of the whole file).
#[derive(Default)]
pub(super) struct Preload {
    pub(super) snapshot: Option<Arc<SnapshotIndex>>,
    /// Routes of the file made into modules (or not this shard's, or with
    /// no node: never to be made), a bit each.
    pub(super) made: Vec<u64>,
    /// The first route not yet looked at by [`ShardCore::preload_step`].
    pub(super) next: usize,
    /// How many of this shard's routes are still to be made.
    pub(super) left: usize,
}

impl Preload {
    fn is_made(&self, i: usize) -> bool {
        self.made[i / 64] & (1 << (i % 64)) != 0
    }
    fn set_made(&mut self, i: usize) {
        self.made[i / 64] |= 1 << (i % 64);
    }
}
