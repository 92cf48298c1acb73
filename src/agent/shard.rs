//! One shard's request handling, sans-IO: a datagram and `now` in, an
//! answer (and messages for the control core) out. The shard owns the
//! modules with `(modid + cmdid) % shards == id` outright: their LB state,
//! their pull and statistics timers, the register requests waiting for them.
//!
//! It must not touch sockets, clocks or rings: the runtime shell
//! ([`super::runtime`]) moves the bytes and the messages.

use std::collections::HashMap;
use std::net::SocketAddr;

use super::messages::{ToControl, ToShard};
use super::metrics::{Kind, ShardMetrics};
use crate::lb::{LbParams, Millis, ModuleLb, NodeState, Outcome, Pick};
use crate::model::{ModuleId, RouteNode};
use crate::wire::{self, CacheRoute, Encoder, Limits, Message, NodeStatus, RetCode};

/// The most modules one shard tracks; getHosts for further unknown modules
/// answer "no such module" without a pull (bounds memory under a flood of
/// made-up module ids).
pub const MAX_MODULES: usize = 1 << 20;

/// How a shard is set up.
#[derive(Clone, Debug)]
pub struct ShardSetup {
    /// This shard's index.
    pub id: u32,
    /// How many shards there are.
    pub shards: u32,
    /// The first shard's UDP port (for the wrong-shard answer).
    pub base_port: u16,
    /// The overload algorithm's parameters.
    pub params: LbParams,
    /// Re-pull a module in use after this long, ms.
    pub update_timeout_ms: u64,
    /// Send a module's statistics after a report at most this often, ms.
    pub report_timeout_ms: u64,
}

/// Where a module's route stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RouteState {
    /// Asked for, no answer yet.
    Unknown,
    /// The route server says there is no such module.
    Absent,
    /// A route with at least one node.
    Present,
}

/// A register request waiting for its module's route.
#[derive(Clone, Copy, Debug)]
struct Waiter {
    seq: u32,
    peer: SocketAddr,
    deadline: Millis,
}

struct ModuleEntry {
    lb: ModuleLb,
    route: RouteState,
    /// When the last pull was asked for (None: never, or answered).
    pull_sent: Option<Millis>,
    /// When the route last arrived.
    last_update: Millis,
    last_stats: Millis,
    waiters: Vec<Waiter>,
}

/// A datagram to send: the bytes and where to.
pub type Reply = (SocketAddr, Vec<u8>);

/// One shard's state and logic.
pub struct ShardCore {
    setup: ShardSetup,
    modules: HashMap<ModuleId, ModuleEntry>,
    enc: Encoder,
    statuses: Vec<NodeStatus>,
    /// Messages for the control core, drained by the shell.
    pub outbox: Vec<ToControl>,
    last_kind: Option<Kind>,
    /// Counters for the metrics endpoint.
    pub metrics: ShardMetrics,
}

impl ShardCore {
    /// A shard with no modules.
    pub fn new(setup: ShardSetup) -> Self {
        ShardCore {
            metrics: ShardMetrics::new(setup.id),
            setup,
            modules: HashMap::new(),
            enc: Encoder::with_capacity(1024),
            statuses: Vec::new(),
            outbox: Vec::new(),
            last_kind: None,
        }
    }

    /// The kind of the last request [`ShardCore::handle`] served (None when
    /// it did not decode), so the shell can time getHosts.
    pub fn last_kind(&self) -> Option<Kind> {
        self.last_kind
    }

    /// This shard's setup.
    pub fn setup(&self) -> &ShardSetup {
        &self.setup
    }

    /// Handles one datagram from `peer` at `now`; returns the answer to send
    /// back to `peer`, if any. Malformed datagrams are counted and dropped;
    /// register requests that must wait return nothing now and are answered
    /// by [`ShardCore::apply`] or [`ShardCore::expire`].
    pub fn handle(&mut self, datagram: &[u8], peer: SocketAddr, now: Millis) -> Option<&[u8]> {
        self.last_kind = None;
        let msg = match wire::decode(datagram, &Limits::UDP) {
            Ok(m) => m,
            Err(e) => {
                self.metrics.count_malformed(&e);
                return None;
            }
        };
        match msg {
            Message::GetHostReq(r) => match r.validate() {
                Ok(g) => self.get_host(g.seq, g.module, now),
                Err(e) => self.bad_request(
                    Kind::GetHost,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::ReportReq(r) => match r.validate() {
                Ok(rep) => self.report(
                    rep.seq,
                    rep.module,
                    rep.host,
                    Outcome::from_retcode(rep.retcode, rep.tcost_ms),
                    now,
                ),
                Err(e) => self.bad_request(
                    Kind::Report,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::BatchReportReq(r) => match r.validate() {
                Ok(b) => self.batch_report(b, now),
                Err(e) => self.bad_request(
                    Kind::BatchReport,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::RegisterReq(r) => match r.validate() {
                Ok(reg) => self.register(reg.seq, reg.module, reg.timeout_ms, peer, now),
                Err(e) => self.bad_request(
                    Kind::Register,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::GetRouteReq(r) => {
                self.get_route(r.seq(), ModuleId::new(r.modid(), r.cmdid()), now)
            }
            Message::CacheGetRouteReq(r) => self.cache_get_route(
                r.seq(),
                ModuleId::new(r.modid(), r.cmdid()),
                r.known_version(),
                now,
            ),
            // Answers and TCP messages have no business on a shard's port.
            _ => {
                self.metrics.unexpected += 1;
                None
            }
        }
    }

    /// Applies a message from the control core; returns the register
    /// answers it releases.
    pub fn apply(&mut self, msg: ToShard, now: Millis) -> Vec<Reply> {
        let ToShard::Route {
            module,
            exists,
            version,
            nodes,
        } = msg;
        if module.shard(self.setup.shards) != self.setup.id {
            self.metrics.misrouted_updates += 1;
            return Vec::new();
        }
        let p = &self.setup.params;
        let entry = match self.modules.get_mut(&module) {
            Some(e) => e,
            None => {
                if !exists || nodes.is_empty() || self.modules.len() >= MAX_MODULES {
                    return Vec::new();
                }
                self.modules
                    .entry(module)
                    .or_insert_with(|| new_entry(now, p))
            }
        };
        self.metrics.route_updates += 1;
        entry.pull_sent = None;
        entry.last_update = now;
        if exists && !nodes.is_empty() {
            entry.lb.update_route(&nodes, version, now, p);
            entry.route = RouteState::Present;
        } else {
            entry.lb.update_route(&[], version, now, p);
            entry.route = RouteState::Absent;
        }
        let waiters = std::mem::take(&mut entry.waiters);
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

    /// Answers every register request whose deadline has passed with
    /// Timeout; returns the answers.
    pub fn expire(&mut self, now: Millis) -> Vec<Reply> {
        let mut out = Vec::new();
        for (&module, entry) in self.modules.iter_mut() {
            if entry.waiters.is_empty() {
                continue;
            }
            entry.waiters.retain(|w| {
                if w.deadline <= now {
                    out.push((
                        w.peer,
                        self.enc
                            .register_resp(w.seq, module, RetCode::Timeout, 0)
                            .to_vec(),
                    ));
                    false
                } else {
                    true
                }
            });
        }
        out
    }

    /// The earliest deadline of a waiting register request.
    pub fn next_deadline(&self) -> Option<Millis> {
        self.modules
            .values()
            .flat_map(|e| e.waiters.iter().map(|w| w.deadline))
            .min()
    }

    /// Refreshes the module and node gauges of [`ShardCore::metrics`].
    pub fn refresh_gauges(&mut self) {
        let (mut idle, mut overloaded) = (0u64, 0u64);
        for e in self.modules.values() {
            for n in e.lb.nodes() {
                match n.state() {
                    NodeState::Idle => idle += 1,
                    NodeState::Overloaded => overloaded += 1,
                }
            }
        }
        self.metrics.modules = self
            .modules
            .values()
            .filter(|e| e.route == RouteState::Present)
            .count() as u64;
        self.metrics.nodes_idle = idle;
        self.metrics.nodes_overloaded = overloaded;
    }

    // === requests ===

    /// Counts a request of `kind` and checks that this shard owns
    /// `module`. When it does not, the wrong-shard answer is encoded (read it
    /// with `self.enc.finished()`) and the result is false.
    fn admit(&mut self, kind: Kind, seq: u64, module: ModuleId) -> bool {
        self.last_kind = Some(kind);
        self.metrics.count_request(kind);
        let owner = module.shard(self.setup.shards);
        if owner == self.setup.id {
            return true;
        }
        self.metrics.count_error(kind);
        self.metrics.wrong_shard += 1;
        let port = u32::from(self.setup.base_port) + owner;
        let msg = format!(
            "module {module} belongs to shard {owner} (UDP port {port}), not shard {}: (modid + cmdid) % {} = {owner}",
            self.setup.id, self.setup.shards
        );
        self.enc.error_resp(seq, module, RetCode::WrongShard, &msg);
        false
    }

    fn bad_request(
        &mut self,
        kind: Kind,
        seq: u64,
        module: ModuleId,
        e: &wire::ValidationError,
    ) -> Option<&[u8]> {
        self.last_kind = Some(kind);
        self.metrics.count_request(kind);
        self.metrics.count_error(kind);
        self.metrics.invalid += 1;
        Some(
            self.enc
                .error_resp(seq, module, RetCode::BadRequest, &e.to_string()),
        )
    }

    fn get_host(&mut self, seq: u32, module: ModuleId, now: Millis) -> Option<&[u8]> {
        if !self.admit(Kind::GetHost, u64::from(seq), module) {
            return Some(self.enc.finished());
        }
        let Self {
            modules,
            outbox,
            metrics,
            setup,
            ..
        } = self;
        let pick = match touch(modules, outbox, metrics, setup, module, now) {
            Some(entry) => entry.lb.get_host(&setup.params),
            None => Pick::NoSuchModule,
        };
        let (retcode, host) = match pick {
            Pick::Idle(a) => (RetCode::Ok, Some(a)),
            Pick::Probe(a) => {
                self.metrics.probes += 1;
                (RetCode::Ok, Some(a))
            }
            Pick::Overloaded => (RetCode::Overloaded, None),
            Pick::NoSuchModule => (RetCode::NoSuchModule, None),
        };
        if retcode != RetCode::Ok {
            self.metrics.count_error(Kind::GetHost);
        }
        Some(self.enc.get_host_resp(seq, module, retcode, host, None))
    }

    fn report(
        &mut self,
        seq: u32,
        module: ModuleId,
        host: crate::model::NodeAddr,
        outcome: Outcome,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::Report, u64::from(seq), module) {
            return Some(self.enc.finished());
        }
        let p = &self.setup.params;
        let Some(entry) = self
            .modules
            .get_mut(&module)
            .filter(|e| e.route == RouteState::Present)
        else {
            self.metrics.count_error(Kind::Report);
            self.metrics.unknown_module_reports += 1;
            return None;
        };
        match entry.lb.report(host, outcome, now, p) {
            Ok(Some(t)) => self.metrics.count_transition(t.to),
            Ok(None) => {}
            Err(_) => {
                self.metrics.count_error(Kind::Report);
                self.metrics.unknown_node_reports += 1;
            }
        }
        self.maybe_stats(module, now);
        None
    }

    fn batch_report(&mut self, b: wire::BatchReport<'_>, now: Millis) -> Option<&[u8]> {
        if !self.admit(Kind::BatchReport, u64::from(b.seq), b.module) {
            return Some(self.enc.finished());
        }
        let p = &self.setup.params;
        let Some(entry) = self
            .modules
            .get_mut(&b.module)
            .filter(|e| e.route == RouteState::Present)
        else {
            self.metrics.count_error(Kind::BatchReport);
            self.metrics.unknown_module_reports += 1;
            return None;
        };
        let metrics = &mut self.metrics;
        for (addr, count) in b.successes() {
            if entry
                .lb
                .report_successes(addr, count, now, p, |t| metrics.count_transition(t.to))
                .is_err()
            {
                metrics.unknown_node_reports += 1;
            }
        }
        self.maybe_stats(b.module, now);
        None
    }

    fn register(
        &mut self,
        seq: u32,
        module: ModuleId,
        timeout_ms: u32,
        peer: SocketAddr,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::Register, u64::from(seq), module) {
            return Some(self.enc.finished());
        }
        let Self {
            modules,
            outbox,
            metrics,
            setup,
            ..
        } = self;
        let Some(entry) = touch(modules, outbox, metrics, setup, module, now) else {
            self.metrics.count_error(Kind::Register);
            return Some(
                self.enc
                    .register_resp(seq, module, RetCode::NoSuchModule, 0),
            );
        };
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
            _ => {
                entry.waiters.push(Waiter {
                    seq,
                    peer,
                    deadline: now + u64::from(timeout_ms),
                });
                None
            }
        }
    }

    fn get_route(&mut self, seq: u32, module: ModuleId, now: Millis) -> Option<&[u8]> {
        if !self.admit(Kind::GetRoute, u64::from(seq), module) {
            return Some(self.enc.finished());
        }
        self.statuses.clear();
        let Self {
            modules,
            outbox,
            metrics,
            setup,
            statuses,
            ..
        } = self;
        let (retcode, version) = match touch(modules, outbox, metrics, setup, module, now) {
            Some(entry) if entry.route == RouteState::Present => {
                let version = entry.lb.version();
                statuses.extend(entry.lb.nodes().iter().map(|n| node_status(n, now)));
                (RetCode::Ok, version)
            }
            _ => (RetCode::NoSuchModule, 0),
        };
        if retcode != RetCode::Ok {
            self.metrics.count_error(Kind::GetRoute);
        }
        Some(
            self.enc
                .get_route_resp(seq, module, retcode, version, &self.statuses),
        )
    }

    fn cache_get_route(
        &mut self,
        seq: u32,
        module: ModuleId,
        known: u64,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::CacheGetRoute, u64::from(seq), module) {
            return Some(self.enc.finished());
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
        let Self {
            modules,
            outbox,
            metrics,
            setup,
            ..
        } = self;
        if let Some(entry) = touch(modules, outbox, metrics, setup, module, now)
            .filter(|e| e.route == RouteState::Present)
        {
            resp.retcode = RetCode::Ok;
            resp.version = entry.lb.version();
            resp.any_overloaded = entry.lb.any_overloaded();
            resp.unchanged = known == resp.version;
            if !resp.unchanged {
                nodes.extend(entry.lb.nodes().iter().map(|n| RouteNode {
                    addr: n.addr(),
                    weight: n.weight(),
                }));
            }
        } else {
            self.metrics.count_error(Kind::CacheGetRoute);
        }
        resp.nodes = &nodes;
        Some(self.enc.cache_get_route_resp(&resp))
    }

    // === module lifecycle ===

    fn maybe_stats(&mut self, module: ModuleId, now: Millis) {
        let Some(entry) = self.modules.get_mut(&module) else {
            return;
        };
        if now.saturating_sub(entry.last_stats) < self.setup.report_timeout_ms {
            return;
        }
        entry.last_stats = now;
        let mut nodes = Vec::with_capacity(entry.lb.nodes().len());
        entry.lb.take_stats(&mut nodes);
        self.outbox.push(ToControl::Stats { module, nodes });
    }

    /// Marks a pull as not sent (the ring was full): the next getHost asks again.
    pub fn pull_dropped(&mut self, module: ModuleId) {
        if let Some(e) = self.modules.get_mut(&module) {
            e.pull_sent = None;
        }
        self.metrics.ring_drops += 1;
    }
}

/// Finds or creates the module's entry and asks for a pull when it is new,
/// or when its route is older than `update_timeout` and no pull is
/// outstanding (a pull unanswered for that long counts as lost). A free
/// function over the fields it needs, so callers keep the other fields.
fn touch<'m>(
    modules: &'m mut HashMap<ModuleId, ModuleEntry>,
    outbox: &mut Vec<ToControl>,
    metrics: &mut ShardMetrics,
    setup: &ShardSetup,
    module: ModuleId,
    now: Millis,
) -> Option<&'m mut ModuleEntry> {
    let timeout = setup.update_timeout_ms;
    if !modules.contains_key(&module) {
        if modules.len() >= MAX_MODULES {
            metrics.module_limit_hits += 1;
            return None;
        }
        modules.insert(module, new_entry(now, &setup.params));
    }
    let entry = modules.get_mut(&module).expect("inserted above");
    let stale =
        entry.route == RouteState::Unknown || now.saturating_sub(entry.last_update) >= timeout;
    let outstanding = entry
        .pull_sent
        .is_some_and(|t| now.saturating_sub(t) < timeout);
    if stale && !outstanding {
        entry.pull_sent = Some(now);
        outbox.push(ToControl::Pull(module));
    }
    Some(entry)
}

fn new_entry(now: Millis, p: &LbParams) -> ModuleEntry {
    ModuleEntry {
        lb: ModuleLb::new(&[], 0, now, p),
        route: RouteState::Unknown,
        pull_sent: None,
        last_update: now,
        last_stats: now,
        waiters: Vec::new(),
    }
}

fn node_status(n: &crate::lb::Node, now: Millis) -> NodeStatus {
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
    }
}

#[cfg(test)]
mod tests;
