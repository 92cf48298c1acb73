//! Routes in and out: the routes the control core sends ([`ShardCore::apply`],
//! which release waiting registers), register (wait for a module's route),
//! getRoute (the nodes and their state, in parts) and cacheGetRoute (the
//! route cache's versioned copy, in parts).

use std::net::SocketAddr;

use super::modules::{node_counts, nodes_changed, touch};
use super::{Due, Reply, RouteState, ShardCore, Waiter, MAX_WAITERS, NONE, REFUSED_WAITERS};
use crate::messages::ToShard;
use crate::metrics::Kind;
use lbagent_lb::{Millis, NodeState, Units};
use lbagent_model::{ModuleId, Policy, RouteNode};
use lbagent_wire::{self as wire, CacheRoute, NodeStatus, RetCode};

impl ShardCore {
    /// Applies a message from the control core; returns the register
    /// answers it releases. A route for a module the shard does not hold
    /// (from the snapshot at start, or one that expired while its route
    /// was on the way) makes an entry, as if just used, within
    /// `max_modules`; it expires as any other.
    pub fn apply(&mut self, msg: ToShard, now: Millis) -> Vec<Reply> {
        if let ToShard::Route { module, .. } = &msg {
            if self.preload.left > 0 && module.shard(self.setup.shards) == self.setup.id {
                // The snapshot's route first, so the new one replaces it
                // as any update does.
                self.take_preloaded(*module, now);
            }
        }
        self.apply_route(msg, now)
    }

    pub(super) fn apply_route(&mut self, msg: ToShard, now: Millis) -> Vec<Reply> {
        let (module, exists, version, nodes, policy, options, meta) = match msg {
            ToShard::Route {
                module,
                exists,
                version,
                nodes,
                policy,
                options,
                meta,
            } => (module, exists, version, nodes, policy, options, meta),
            ToShard::Params(live) => {
                // Read at each use: every module follows them from now on,
                // its options resolved again over the new defaults.
                for entry in self.modules.values_mut() {
                    entry.lb.configure(now, &live.params);
                }
                self.setup.params = live.params;
                self.setup.update_timeout_ms = live.update_timeout_ms;
                self.setup.report_timeout_ms = live.report_timeout_ms;
                self.setup.steering.locality_min_percent = live.locality_min_percent;
                self.setup.steering.label_fallback = live.label_fallback;
                return Vec::new();
            }
        };
        if module.shard(self.setup.shards) != self.setup.id {
            self.metrics.misrouted_updates += 1;
            return Vec::new();
        }
        if !self.modules.contains_key(&module) {
            if !exists || nodes.is_empty() || self.modules.len() >= self.setup.max_modules {
                return Vec::new();
            }
            self.metrics.unheld_routes += 1;
            self.create(module, now);
        }
        let p = &self.setup.params;
        let entry = self.modules.get_mut(&module).expect("held or made above");
        self.metrics.route_updates += 1;
        entry.pull_sent = None;
        entry.last_update = now;
        let was_unknown = entry.route != RouteState::Present;
        let before = node_counts(&entry.lb);
        if exists && !nodes.is_empty() {
            entry.lb.update_route(&nodes, version, now, p);
            entry.lb.set_policy(policy);
            entry.lb.set_options(options, now, p);
            // Zones and labels: only for a route that has them, or to
            // clear those of the route before (no cost otherwise).
            if !meta.is_empty() || entry.lb.has_meta() {
                entry.lb.set_meta(&meta, self.setup.steering.zone.as_ref());
            }
            entry.route = RouteState::Present;
        } else {
            entry.lb.update_route(&[], version, now, p);
            entry.lb.set_policy(Policy::L5);
            entry.lb.set_options(Default::default(), now, p);
            entry.route = RouteState::Absent;
        }
        let after = node_counts(&entry.lb);
        nodes_changed(&mut self.metrics, before, after);
        let is_unknown = entry.route != RouteState::Present;
        match (was_unknown, is_unknown) {
            (true, false) => self.unknown -= 1,
            (false, true) => self.unknown += 1,
            _ => {}
        }
        // The expiry timer (armed at the entry's making) reads
        // `last_update` / `last_used` when it fires: nothing to move here.
        let waiters = std::mem::take(&mut entry.waiters);
        entry.waiters_at = NONE;
        self.waiting -= waiters.len();
        let (retcode, version) = match entry.route {
            RouteState::Present => (RetCode::Ok, entry.lb.version()),
            _ => (RetCode::NoSuchModule, 0),
        };
        waiters
            .into_iter()
            .map(|w| {
                (
                    w.peer,
                    self.enc
                        .register_resp(w.seq, module, retcode, version)
                        .to_vec(),
                )
            })
            .collect()
    }

    pub(super) fn register(
        &mut self,
        seq: u32,
        module: ModuleId,
        timeout_ms: u32,
        peer: SocketAddr,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::Register, u64::from(seq), module, now) {
            return Some(self.enc.finished());
        }
        if let Err(why) = self.ensure(module, now) {
            return Some(self.refuse(Kind::Register, u64::from(seq), module, why));
        }
        let full = self.waiting >= MAX_WAITERS;
        let Self {
            modules,
            outbox,
            setup,
            ..
        } = self;
        let entry = touch(modules, outbox, setup, module, now);
        match entry.route {
            RouteState::Present => {
                let v = entry.lb.version();
                Some(self.enc.register_resp(seq, module, RetCode::Ok, v))
            }
            RouteState::Absent if entry.pull_sent.is_none() => {
                self.metrics.count_error(Kind::Register);
                Some(
                    self.enc
                        .register_resp(seq, module, RetCode::NoSuchModule, 0),
                )
            }
            _ if full => {
                self.metrics.registers_refused += 1;
                Some(self.refuse(Kind::Register, u64::from(seq), module, REFUSED_WAITERS))
            }
            _ => {
                let deadline = now + u64::from(timeout_ms);
                entry.waiters.push(Waiter {
                    seq,
                    peer,
                    deadline,
                });
                if deadline < entry.waiters_at {
                    entry.waiters_at = deadline;
                    self.timers.schedule(deadline, (module, Due::Waiters));
                }
                self.waiting += 1;
                None
            }
        }
    }

    pub(super) fn get_route(
        &mut self,
        seq: u32,
        module: ModuleId,
        part: u32,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::GetRoute, u64::from(seq), module, now) {
            return Some(self.enc.finished());
        }
        if let Err(why) = self.ensure(module, now) {
            return Some(self.refuse(Kind::GetRoute, u64::from(seq), module, why));
        }
        self.statuses.clear();
        let Self {
            modules,
            outbox,
            setup,
            statuses,
            ..
        } = self;
        let mut policy = Policy::L5;
        let mut options = Default::default();
        let (retcode, version, parts) = match touch(modules, outbox, setup, module, now) {
            entry if entry.route == RouteState::Present => {
                let timed_out = entry.lb.expire_units(now);
                self.metrics.units_timed_out += u64::from(timed_out);
                policy = entry.lb.policy();
                options = entry.lb.options();
                let (nodes, units) = (entry.lb.nodes(), entry.lb.units());
                let parts = wire::route_parts(nodes.len(), wire::GETROUTE_PART_NODES);
                let first = (part as usize).saturating_mul(wire::GETROUTE_PART_NODES);
                let these = nodes.iter().enumerate().skip(first);
                let these = these.take(wire::GETROUTE_PART_NODES);
                statuses.extend(these.map(|(i, n)| node_status(n, i, units, now)));
                (RetCode::Ok, entry.lb.version(), parts)
            }
            _ => (RetCode::NoSuchModule, 0, 1),
        };
        if retcode == RetCode::Ok && part >= parts {
            return Some(self.no_such_part(Kind::GetRoute, seq, module, part, parts));
        }
        if retcode != RetCode::Ok {
            self.metrics.count_error(Kind::GetRoute);
        }
        Some(self.enc.get_route_resp_part(
            seq,
            module,
            retcode,
            version,
            &self.statuses,
            (part.min(parts - 1), parts),
            policy,
            &options,
        ))
    }

    pub(super) fn cache_get_route(
        &mut self,
        seq: u32,
        module: ModuleId,
        known: u64,
        part: u32,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::CacheGetRoute, u64::from(seq), module, now) {
            return Some(self.enc.finished());
        }
        if let Err(why) = self.ensure(module, now) {
            return Some(self.refuse(Kind::CacheGetRoute, u64::from(seq), module, why));
        }
        let mut nodes: Vec<RouteNode> = Vec::new();
        let mut resp = CacheRoute {
            seq,
            module,
            retcode: RetCode::NoSuchModule,
            version: 0,
            unchanged: false,
            any_overloaded: false,
            nodes: &[],
        };
        let mut parts = 1;
        let Self {
            modules,
            outbox,
            setup,
            ..
        } = self;
        if let Some(entry) = Some(touch(modules, outbox, setup, module, now))
            .filter(|e| e.route == RouteState::Present)
        {
            resp.retcode = RetCode::Ok;
            resp.version = entry.lb.version();
            // A node with a downstream level, or a `balance` module (whose
            // every getHost takes a unit), reads as overloaded to the route
            // cache: it then passes every getHost (and report) through the
            // agent, which applies the levels and counts the units.
            resp.any_overloaded = entry.lb.any_overloaded()
                || entry.lb.units().is_some()
                || entry.lb.levelled_nodes(now) > 0;
            resp.unchanged = known == resp.version;
            if !resp.unchanged {
                let all = entry.lb.nodes();
                parts = wire::route_parts(all.len(), wire::CACHE_ROUTE_PART_NODES);
                let first = (part as usize).saturating_mul(wire::CACHE_ROUTE_PART_NODES);
                let these = all.iter().skip(first).take(wire::CACHE_ROUTE_PART_NODES);
                nodes.extend(these.map(|n| RouteNode {
                    addr: n.addr(),
                    weight: n.weight(),
                }));
            }
        } else {
            self.metrics.count_error(Kind::CacheGetRoute);
        }
        if part >= parts {
            return Some(self.no_such_part(Kind::CacheGetRoute, seq, module, part, parts));
        }
        resp.nodes = &nodes;
        Some(self.enc.cache_get_route_resp_part(&resp, (part, parts)))
    }

    /// The answer to a request for a part past the last (the route shrank
    /// between parts, or a broken client): BadRequest, so the client starts
    /// again from part 0.
    pub(super) fn no_such_part(
        &mut self,
        kind: Kind,
        seq: u32,
        module: ModuleId,
        part: u32,
        parts: u32,
    ) -> &[u8] {
        self.metrics.count_error(kind);
        self.metrics.invalid += 1;
        let msg =
            format!("part {part} asked, the answer has {parts} part(s) now: ask again from part 0");
        self.enc
            .error_resp(u64::from(seq), module, RetCode::BadRequest, &msg)
    }
}

/// Node `i`'s status; `units`: its module's, for a `balance` module.
fn node_status(n: &lbagent_lb::Node, i: usize, units: Option<&Units>, now: Millis) -> NodeStatus {
    let overloaded = n.state() == NodeState::Overloaded;
    NodeStatus {
        addr: n.addr(),
        weight: n.weight(),
        overloaded,
        vsucc: n.vsucc(),
        verr: n.verr(),
        rsucc: n.rsucc(),
        rerr: n.rerr(),
        contin_succ: n.contin_succ(),
        contin_err: n.contin_err(),
        bad_windows: n.bad_windows(),
        window_age_ms: if overloaded {
            0
        } else {
            now.saturating_sub(n.window_start())
        },
        overload_age_ms: if overloaded {
            now.saturating_sub(n.overload_start())
        } else {
            0
        },
        capacity: units.map_or(0, |u| u.capacity(i)),
        in_use: units.map_or(0, |u| u.in_use(i)),
        phi: units.map_or(0.0, |u| u.phi(i)),
    }
}
