//! What a module knows of its nodes beyond their addresses (zones and
//! labels) and the getHosts that use it: keyed (consistent hashing),
//! with a label selector, and near (zone-aware).
//!
//! All of it lives in one boxed [`Meta`] that a module without zones,
//! labels or keyed getHosts does not have: the common path pays one
//! pointer in the struct and no test on getHost (these are separate
//! entry points). The Maglev table is built on the first keyed getHost
//! and then again at every route update, never per getHost.
//!
//! It must not touch: the node state machine, clocks, sockets.

use super::{rotate, ModuleLb, Pick};
use crate::labels::{plan, Fallback, NoMatch, Plan};
use crate::locality::stay_local;
use crate::maglev::Maglev;
use crate::node::NodeState;
use crate::params::LbParams;
use lbagent_model::{Labels, NodeAddr, NodeMeta, Selector, Zone};

/// The module's node metadata, per node index, and its Maglev table.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Meta {
    /// `(node key, labels, zone)` as the route gave them, sorted by key.
    given: Vec<(u64, Labels, Option<Zone>)>,
    /// The agent's zone, as last set.
    agent_zone: Option<Zone>,
    /// Per node index: whether it is in the agent's zone.
    local: Vec<bool>,
    /// How many nodes are local.
    local_count: usize,
    /// Per node index: its labels.
    labels: Vec<Labels>,
    /// Every distinct `(key, value)` label of the route, sorted, when there
    /// are at most 64 (interned at route update; empty past 64, and then
    /// selectors compare strings).
    vocab: Vec<(String, String)>,
    /// Per node index: its labels as bits of `vocab` (empty when `vocab`
    /// is not used).
    masks: Vec<u64>,
    /// The consistent-hashing table, once a keyed getHost asked for it.
    maglev: Option<Maglev>,
}

impl ModuleLb {
    /// Sets the nodes' zones and labels (a route's metadata; nodes not
    /// named have none) and the agent's own zone. Nothing given, no agent
    /// zone and no keyed getHost so far: the module holds nothing.
    pub fn set_meta(&mut self, meta: &[(NodeAddr, NodeMeta)], agent_zone: Option<&Zone>) {
        let mut given: Vec<(u64, Labels, Option<Zone>)> = meta
            .iter()
            .filter(|(_, m)| !m.is_empty())
            .map(|(a, m)| (a.key(), m.labels.clone(), m.zone.clone()))
            .collect();
        given.sort_by_key(|g| g.0);
        given.dedup_by_key(|g| g.0);
        if let Some(m) = self.meta.as_deref() {
            if m.given == given && m.agent_zone.as_ref() == agent_zone {
                return; // the same: the route update refreshed the rest
            }
        }
        let maglev = self.meta.as_mut().and_then(|m| m.maglev.take());
        if given.is_empty() && maglev.is_none() {
            self.meta = None;
            return;
        }
        let vocab = vocab_of(&given);
        self.meta = Some(Box::new(Meta {
            given,
            agent_zone: agent_zone.cloned(),
            maglev,
            vocab,
            ..Meta::default()
        }));
        self.refresh_meta();
    }

    /// Recomputes the per-index metadata and the Maglev table after the
    /// nodes changed (called by the route update).
    pub(super) fn refresh_meta(&mut self) {
        let Some(meta) = self.meta.as_deref_mut() else {
            return;
        };
        let n = self.nodes.len();
        meta.local = vec![false; n];
        meta.labels = vec![Labels::default(); n];
        for (i, node) in self.nodes.iter().enumerate() {
            if let Ok(g) = meta.given.binary_search_by_key(&node.key(), |g| g.0) {
                let (_, labels, zone) = &meta.given[g];
                meta.labels[i] = labels.clone();
                meta.local[i] = zone.is_some() && *zone == meta.agent_zone;
            }
        }
        meta.local_count = meta.local.iter().filter(|&&l| l).count();
        meta.masks = if meta.vocab.is_empty() {
            Vec::new()
        } else {
            meta.labels
                .iter()
                .map(|l| mask_of(&meta.vocab, l).unwrap_or(0))
                .collect()
        };
        if meta.maglev.is_some() {
            let table = self.build_maglev();
            if let Some(m) = self.meta.as_deref_mut() {
                m.maglev = Some(table);
            }
        }
    }

    fn build_maglev(&self) -> Maglev {
        let ids: Vec<u64> = self.nodes.iter().map(|n| n.key()).collect();
        Maglev::new(&ids)
    }

    /// The L5 probe rule shared by the getHosts below: while some node is
    /// overloaded, every `probe_num + 1`-th getHost probes the head of the
    /// overload list (Some); otherwise None and the caller chooses among
    /// the idle nodes.
    fn probe_due(&mut self, p: &LbParams) -> Option<Pick> {
        if self.overload.is_empty() {
            self.access_cnt = 0;
            return None;
        }
        if self.access_cnt >= p.probe_num {
            self.access_cnt = 0;
            let i = rotate(&mut self.overload).expect("overload list is not empty");
            return Some(Pick::Probe(self.nodes[i as usize].addr()));
        }
        self.access_cnt += 1;
        None
    }

    /// The idle node first in the idle list among those `want` takes,
    /// rotating the list past it (round robin among them); None if none.
    fn rotate_to(&mut self, want: impl Fn(usize) -> bool) -> Option<NodeAddr> {
        let k = self.idle.iter().position(|&i| want(i as usize))?;
        self.idle.rotate_left(k + 1);
        let i = *self.idle.back().expect("not empty");
        Some(self.nodes[i as usize].addr())
    }

    /// getHost with a hash key (consistent hashing): the L5 probe rule
    /// first, then the key's node in the module's Maglev table, skipping
    /// overloaded nodes to the next candidate
    /// ([`crate::maglev::Maglev::lookup`]); [`Pick::Overloaded`] when no
    /// node is idle. `hash` is [`crate::maglev::key_hash`] of the key. The
    /// first keyed getHost of a module builds its table (once; a route
    /// update rebuilds it).
    pub fn get_host_keyed(&mut self, p: &LbParams, hash: u64) -> Pick {
        if self.nodes.is_empty() {
            return Pick::NoSuchModule;
        }
        if let Some(probe) = self.probe_due(p) {
            return probe;
        }
        if !self.has_keyed_table() {
            // Mark the table wanted; the refresh builds it (once) with the
            // per-node vectors.
            self.meta.get_or_insert_with(Box::default).maglev = Some(Maglev::new(&[]));
            self.refresh_meta();
        }
        let table = self
            .meta
            .as_ref()
            .and_then(|m| m.maglev.as_ref())
            .expect("built above");
        let nodes = &self.nodes;
        match table.lookup(hash, |i| nodes[i].state() == NodeState::Idle) {
            Some(i) => Pick::Idle(nodes[i].addr()),
            None => Pick::Overloaded,
        }
    }

    /// getHost with a label selector: the L5 probe rule first (a probe
    /// goes whatever its labels: it learns whether the node recovered),
    /// then round robin among the idle nodes whose labels match; matching
    /// nodes all overloaded: [`Pick::Overloaded`]. No node of the route
    /// matching: `fallback` ([`crate::labels`]). An empty selector is
    /// [`ModuleLb::get_host`].
    ///
    /// # Errors
    /// [`NoMatch`] when no node matches and `fallback` is
    /// [`Fallback::Fail`].
    pub fn get_host_selecting(
        &mut self,
        p: &LbParams,
        selector: &Selector,
        fallback: Fallback,
    ) -> Result<Pick, NoMatch> {
        if selector.is_empty() || self.nodes.is_empty() {
            return Ok(self.get_host(p));
        }
        // Interned: the selector's terms as bits (a term no node has: no
        // match), then one AND a node; else strings compared a node.
        let want = self
            .meta
            .as_ref()
            .and_then(|m| (!m.vocab.is_empty()).then(|| mask_of(&m.vocab, selector.terms())));
        let matching = match (want, self.meta.as_ref()) {
            (Some(None), _) | (_, None) => 0,
            (Some(Some(w)), Some(m)) => m.masks.iter().filter(|&&b| b & w == w).count(),
            (None, Some(m)) => m.labels.iter().filter(|l| selector.matches(l)).count(),
        };
        if plan(matching, fallback)? == Plan::Everyone {
            return Ok(self.get_host(p));
        }
        if let Some(probe) = self.probe_due(p) {
            return Ok(probe);
        }
        let meta = self.meta.take().expect("some node matches");
        let found = match want {
            Some(Some(w)) => self.rotate_to(|i| meta.masks[i] & w == w),
            _ => self.rotate_to(|i| selector.matches(&meta.labels[i])),
        };
        self.meta = Some(meta);
        Ok(found.map_or(Pick::Overloaded, Pick::Idle))
    }

    /// getHost that prefers the agent's zone: with nodes in it
    /// ([`ModuleLb::set_meta`]), the L5 probe rule first, then round robin
    /// among the idle local nodes while their idle share is at least
    /// `min_percent` ([`crate::locality::stay_local`]), else among every
    /// idle node. A module with no node in the agent's zone (or an agent
    /// without one) is [`ModuleLb::get_host`].
    pub fn get_host_near(&mut self, p: &LbParams, min_percent: u32) -> Pick {
        let Some(local_count) = self.meta.as_ref().map(|m| m.local_count) else {
            return self.get_host(p);
        };
        if local_count == 0 {
            return self.get_host(p);
        }
        if let Some(probe) = self.probe_due(p) {
            return probe;
        }
        let meta = self.meta.take().expect("checked above");
        let local_idle = self
            .idle
            .iter()
            .filter(|&&i| meta.local[i as usize])
            .count();
        let found = if stay_local(local_idle, local_count, min_percent) {
            self.rotate_to(|i| meta.local[i])
        } else {
            self.rotate_to(|_| true)
        };
        self.meta = Some(meta);
        found.map_or(Pick::Overloaded, Pick::Idle)
    }

    /// True when the module's labels are interned (at most 64 distinct),
    /// so that a selecting getHost compares bits, not strings.
    pub fn labels_interned(&self) -> bool {
        self.meta.as_ref().is_some_and(|m| !m.vocab.is_empty())
    }

    /// True when some node of the module has a zone or labels.
    pub fn has_meta(&self) -> bool {
        self.meta.as_ref().is_some_and(|m| !m.given.is_empty())
    }

    /// How many of the module's nodes are in the agent's zone.
    pub fn local_nodes(&self) -> usize {
        self.meta.as_ref().map_or(0, |m| m.local_count)
    }

    /// True when the module holds a Maglev table (it was asked with a key).
    pub fn has_keyed_table(&self) -> bool {
        self.meta.as_ref().is_some_and(|m| m.maglev.is_some())
    }
}

/// The distinct labels of `given`, sorted, when at most 64 (a `u64` of
/// bits a node); empty otherwise.
fn vocab_of(given: &[(u64, Labels, Option<Zone>)]) -> Vec<(String, String)> {
    let mut vocab: Vec<(String, String)> = given
        .iter()
        .flat_map(|g| g.1.iter())
        .map(|l| (l.key().to_string(), l.value().to_string()))
        .collect();
    vocab.sort_unstable();
    vocab.dedup();
    if vocab.len() > 64 {
        vocab.clear();
    }
    vocab
}

/// `labels` as bits of `vocab`; None when one of them is not in it.
fn mask_of(vocab: &[(String, String)], labels: &Labels) -> Option<u64> {
    labels.iter().try_fold(0u64, |bits, l| {
        let i = vocab
            .binary_search_by(|(k, v)| (k.as_str(), v.as_str()).cmp(&(l.key(), l.value())))
            .ok()?;
        Some(bits | 1 << i)
    })
}
