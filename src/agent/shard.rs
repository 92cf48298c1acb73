//! One shard's request handling, sans-IO: a datagram and `now` in, an
//! answer (and messages for the control core) out. The shard owns the
//! modules with `(modid + cmdid) % shards == id` outright: their LB state,
//! their pull and statistics timers, the register requests waiting for them.
//!
//! It must not touch sockets, clocks or rings: the runtime shell
//! ([`super::runtime`]) moves the bytes and the messages.
//!
//! # Bounds and background work
//!
//! The module table holds two kinds of entries. Modules *with a route* (in
//! use) stay until unused for [`ShardSetup::module_idle_ms`]; modules
//! *without one* (asked for and unanswered, or absent at the route server)
//! are remembered for [`ShardSetup::unknown_ttl_ms`] and at most
//! [`ShardSetup::max_unknown`] at once. Past that bound a request for a
//! further unknown module is refused (ErrorResp `Unavailable`, counted in
//! `unknown_refused`) without a pull, so a flood of made-up ids can neither
//! grow the table nor displace a module in use. A forgotten module is
//! reported to the control core ([`ToControl::Forget`]), which drops its
//! copy and the route server subscription.
//!
//! Every deadline (register timeouts, statistics sends, expiry) lives in one
//! [`Timers`] heap: [`ShardCore::expire`] costs the work that is due, never
//! a walk over the modules. Re-pulls and the overload windows need no timer:
//! they are checked, O(1), by the request that uses the module.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use super::messages::{ToControl, ToShard};
use super::metrics::priority_class;
use super::metrics::{Kind, ShardMetrics};
use super::timers::Timers;
use lbagent_admission::{Admission, AdmissionLevel, AdmissionParams, Micros, OPEN};
use lbagent_host::snapshot::SnapshotIndex;
use lbagent_lb::{LbParams, Millis, ModuleLb, NodeCallStats, NodeState, Outcome, Pick, Units};
use lbagent_model::{ModuleId, Policy, RouteNode};
use lbagent_shm::fixed::{self, HostAnswer};
use lbagent_wire::{self as wire, CacheRoute, Encoder, Limits, Message, NodeStatus, RetCode};

/// The shard's module table, looked up two or three times per request:
/// foldhash (seeded per process), not SipHash.
type Modules = HashMap<ModuleId, Box<ModuleEntry>, foldhash::fast::RandomState>;

/// The default most modules one shard tracks (`agent.max_modules`).
pub const MAX_MODULES: usize = 1 << 20;

pub use lbagent_lb::LEVEL_TIMEOUT_MS;

/// The most register requests one shard keeps waiting for routes; further
/// ones are refused (`Unavailable`).
pub const MAX_WAITERS: usize = 4096;

/// How long statistics the ring refused wait before the shard offers them
/// again, ms.
pub const STATS_RETRY_MS: Millis = 100;

/// The answer to a request for an unknown module past the bound.
const REFUSED_UNKNOWN: &str = "too many unknown modules on this shard (agent.max_unknown_modules): not looked up; retry later";
/// The answer to a request for a new module past `agent.max_modules`.
const REFUSED_FULL: &str = "this shard holds agent.max_modules modules: not looked up; retry later";
/// The answer to a register past [`MAX_WAITERS`].
const REFUSED_WAITERS: &str = "too many register requests wait on this shard; retry later";

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
    /// A pull unanswered this long is lost and asked for again, ms (the
    /// route client re-pulls answered modules on the same period).
    pub update_timeout_ms: u64,
    /// Send a module's statistics after a report at most this often, ms.
    pub report_timeout_ms: u64,
    /// Forget a module with a route after this long without a request, ms.
    pub module_idle_ms: u64,
    /// Forget a module without a route after this long, ms.
    pub unknown_ttl_ms: u64,
    /// The most modules the shard holds.
    pub max_modules: usize,
    /// The most modules without a route the shard remembers at once.
    pub max_unknown: usize,
    /// A node's downstream admission level (DAGOR), as a report carried
    /// it, is forgotten when no report refreshes it within this long, ms.
    pub level_timeout_ms: u64,
}

impl ShardSetup {
    /// A setup with the default bounds and timers (tests, tools).
    pub fn new(id: u32, shards: u32, base_port: u16) -> Self {
        ShardSetup {
            id,
            shards,
            base_port,
            params: LbParams::default(),
            update_timeout_ms: 15_000,
            report_timeout_ms: 15_000,
            module_idle_ms: 600_000,
            unknown_ttl_ms: 1_000,
            max_modules: MAX_MODULES,
            max_unknown: 1024,
            level_timeout_ms: LEVEL_TIMEOUT_MS,
        }
    }
}

/// What a timer entry is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// The earliest deadline of the module's waiting registers.
    Waiters,
    /// The module's statistics are due.
    Stats,
    /// The module may have expired.
    Expiry,
    /// Statistics the ring refused are offered again.
    Unsent,
}

/// No timer armed.
const NONE: Millis = Millis::MAX;

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
    /// When the route last arrived (or the entry was made).
    last_update: Millis,
    last_stats: Millis,
    /// When a request last named the module.
    last_used: Millis,
    waiters: Vec<Waiter>,
    /// The deadlines armed in the shard's timers ([`NONE`]: none); a timer
    /// entry with another deadline is stale.
    waiters_at: Millis,
    stats_at: Millis,
    expiry_at: Millis,
}

/// The snapshot a shard holds until it has made the modules of its share:
/// the file's bytes and index, shared by every shard and the control core
/// (nothing is copied per shard), and which of its routes this shard has
/// made (a bit per route of the whole file).
#[derive(Default)]
struct Preload {
    snapshot: Option<Arc<SnapshotIndex>>,
    /// Routes of the file made into modules (or not this shard's, or with
    /// no node: never to be made), a bit each.
    made: Vec<u64>,
    /// The first route not yet looked at by [`ShardCore::preload_step`].
    next: usize,
    /// How many of this shard's routes are still to be made.
    left: usize,
}

impl Preload {
    fn is_made(&self, i: usize) -> bool {
        self.made[i / 64] & (1 << (i % 64)) != 0
    }
    fn set_made(&mut self, i: usize) {
        self.made[i / 64] |= 1 << (i % 64);
    }
}

/// A datagram to send: the bytes and where to.
pub type Reply = (SocketAddr, Vec<u8>);

/// One shard's state and logic.
pub struct ShardCore {
    setup: ShardSetup,
    /// Boxed: the table then holds 16 bytes a slot instead of an entry's
    /// 230, which its free slots (up to half of them after it grows) would
    /// waste; the entry is allocated once, when the module is first named.
    modules: Modules,
    timers: Timers<(ModuleId, Due)>,
    /// Modules without a route (Unknown or Absent).
    unknown: usize,
    /// Register requests waiting.
    waiting: usize,
    /// Statistics the ring refused, per module, merged; sent with the
    /// module's next statistics or offered again after [`STATS_RETRY_MS`].
    unsent: HashMap<ModuleId, Vec<NodeCallStats>>,
    /// Forget messages the ring refused.
    forgets: Vec<ModuleId>,
    unsent_at: Millis,
    enc: Encoder,
    statuses: Vec<NodeStatus>,
    /// The snapshot's routes not yet made modules (see [`ShardCore::preload`]).
    preload: Preload,
    /// Modules that may hold downstream levels (the levels gauge looks
    /// only at these).
    levelled: HashSet<ModuleId>,
    /// Messages for the control core, drained by the shell.
    pub outbox: Vec<ToControl>,
    last_kind: Option<Kind>,
    /// The shard's own DAGOR admission control (`admission.agent_shedding`):
    /// fed with each datagram's queuing time, it sheds getHosts below its
    /// level. None when off.
    shedding: Option<Box<Admission>>,
    /// The kernel's drop count as last seen ([`ShardCore::kernel_drops`]).
    drops_seen: u32,
    /// The shed answer for the shard's current level, encoded once per
    /// level (see [`wire::RejectedAnswer`]).
    rejected: Option<wire::RejectedAnswer>,
    /// Counters for the metrics endpoint.
    pub metrics: ShardMetrics,
}

/// The admission parameters a shard's own shedding runs with: `p` with
/// `hold_while_draining` off (the kernel's receive queue holds every
/// datagram, admitted or not, so the counts do not measure its drain) and
/// `callers_hold_back` on (every answer carries the shard's level while it
/// sheds, and callers hold back below it: a calm window's rise is placed on
/// the demand's remembered mix, see [`Admission`]).
pub fn agent_params(p: AdmissionParams) -> AdmissionParams {
    AdmissionParams {
        hold_while_draining: false,
        callers_hold_back: true,
        ..p
    }
}

/// What the shard answers to a record of the fixed layout
/// ([`ShardCore::handle_fixed`]).
#[derive(Debug)]
pub enum FixedReply<'a> {
    /// A getHost's answer, as values.
    Host(HostAnswer),
    /// An answer in FlatBuffers bytes (an ErrorResp: wrong shard,
    /// unavailable, bad request).
    Bytes(&'a [u8]),
    /// Nothing to answer (a report).
    Nothing,
    /// The bytes are no record: why.
    Garbage(&'static str),
}

/// A getHost's decision.
enum HostDecision {
    /// Answer with these values.
    Answer(HostAnswer),
    /// Rejected below the shard's own level (this one).
    Shed(HostAnswer, AdmissionLevel),
    /// An ErrorResp is encoded in the shard's encoder.
    Encoded,
}

/// How long a datagram waited in the socket before the shard handled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    /// When handling starts, µs on the clock the arrival was stamped by.
    pub now_us: Micros,
    /// Arrival (the kernel's receive timestamp) to now, µs.
    pub waited_us: Micros,
}

impl ShardCore {
    /// A shard with no modules.
    pub fn new(setup: ShardSetup) -> Self {
        ShardCore {
            metrics: ShardMetrics::new(setup.id),
            setup,
            modules: Modules::default(),
            timers: Timers::new(),
            unknown: 0,
            waiting: 0,
            unsent: HashMap::new(),
            forgets: Vec::new(),
            unsent_at: NONE,
            preload: Preload::default(),
            levelled: HashSet::new(),
            enc: Encoder::with_capacity(1024),
            statuses: Vec::new(),
            outbox: Vec::new(),
            last_kind: None,
            shedding: None,
            drops_seen: 0,
            rejected: None,
        }
    }

    /// Turns the shard's own admission control on (`Some`) or off. While
    /// on, [`ShardCore::handle_queued`] feeds it each datagram's queuing
    /// time and a getHost its level does not admit is answered `Rejected`
    /// with the shard's level attached. See [`agent_params`] for how the
    /// parameters are adapted to a shard.
    pub fn set_shedding(&mut self, params: Option<AdmissionParams>) {
        self.shedding = params.map(|p| Box::new(Admission::new(agent_params(p))));
        self.metrics.self_level = OPEN;
        self.drops_seen = 0;
    }

    /// The kernel's count of datagrams it dropped on this shard's socket
    /// for want of receive buffer (`SO_RXQ_OVFL`, as the latest datagram
    /// carried it: a running count that wraps). With shedding on, the
    /// drops since the last count make the current admission window
    /// overloaded ([`Admission::dropped`]): a receive buffer sized to the
    /// threshold overflows before its queue averages above the threshold.
    pub fn kernel_drops(&mut self, total: u32) {
        let new = total.wrapping_sub(self.drops_seen);
        self.drops_seen = total;
        if new > 0 {
            self.metrics.kernel_drops += u64::from(new);
            if let Some(a) = self.shedding.as_mut() {
                a.dropped(new);
            }
        }
    }

    /// The shard's own admission level (open when shedding is off).
    pub fn self_level(&self) -> AdmissionLevel {
        self.shedding.as_ref().map_or(OPEN, |a| a.level())
    }

    /// Ends the shard's admission window by time when it is due, so that
    /// the level moves even while no datagram arrives (the shell calls it
    /// every few milliseconds).
    pub fn tick_shedding(&mut self, now_us: Micros) {
        if let Some(a) = self.shedding.as_mut() {
            if let Some(o) = a.tick(now_us) {
                self.metrics.self_level = o.after;
            }
        }
    }

    /// When [`ShardCore::tick_shedding`] next has something to decide
    /// (realtime microseconds), None when shedding is off or its window
    /// needs no timer (see [`Admission::next_tick`]).
    pub fn shedding_due(&self) -> Option<Micros> {
        self.shedding.as_ref().and_then(|a| a.next_tick())
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
        self.handle_queued(datagram, peer, now, None)
    }

    /// [`ShardCore::handle`] for a datagram that waited `queued` in the
    /// socket (from the kernel's receive timestamp): the queuing time is
    /// counted, and with shedding on it feeds the shard's admission window
    /// and a getHost below the shard's level is answered `Rejected`.
    /// Without `queued` nothing is shed.
    pub fn handle_queued(
        &mut self,
        datagram: &[u8],
        peer: SocketAddr,
        now: Millis,
        queued: Option<Queued>,
    ) -> Option<&[u8]> {
        let (shed, bucket) = self.queued_start(queued);
        if shed {
            // The shed path: a getHost read straight from the bytes (no
            // verifier; anything it cannot vouch for takes the full decode
            // below), so that a rejection costs a fraction of an answer.
            if let Some(g) = wire::peek_get_host(datagram, Limits::UDP.max_len) {
                return self.get_host(g, now, shed, bucket);
            }
        }
        let msg = match wire::decode(datagram, &Limits::UDP) {
            Ok(m) => m,
            Err(e) => {
                self.metrics.count_malformed(&e);
                return None;
            }
        };
        match msg {
            Message::GetHostReq(r) => match r.validate() {
                Ok(g) => self.get_host(g, now, shed, bucket),
                Err(e) => self.bad_request(
                    Kind::GetHost,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::ReportReq(r) => match r.validate() {
                Ok(rep) => self.report(&rep, now),
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
                self.get_route(r.seq(), ModuleId::new(r.modid(), r.cmdid()), r.part(), now)
            }
            Message::CacheGetRouteReq(r) => self.cache_get_route(
                r.seq(),
                ModuleId::new(r.modid(), r.cmdid()),
                r.known_version(),
                r.part(),
                now,
            ),
            // Answers and TCP messages have no business on a shard's port.
            _ => {
                self.metrics.unexpected += 1;
                None
            }
        }
    }

    /// What every request does first: no kind yet; with `queued`, its
    /// queuing time counted and, with shedding on, fed to the shard's
    /// admission window. Returns whether the shard's level applies and the
    /// queuing-time bucket.
    fn queued_start(&mut self, queued: Option<Queued>) -> (bool, Option<(usize, u64)>) {
        self.last_kind = None;
        let mut shed = false;
        let mut bucket = None;
        if let Some(q) = queued {
            bucket = Some((self.metrics.record_queuing_us(q.waited_us), q.waited_us));
            if let Some(a) = self.shedding.as_mut() {
                if let Some(o) = a.started(q.now_us, q.waited_us) {
                    self.metrics.self_level = o.after;
                }
                shed = true;
            }
        }
        (shed, bucket)
    }

    /// [`ShardCore::handle_queued`] for a getHost or report record of the
    /// shared memory's fixed layout ([`lbagent_shm::fixed`]): decoded into
    /// the same request the FlatBuffers datagram gives, and taken through
    /// the same path (the same L5 and DAGOR decisions, the same counts); a
    /// getHost's answer comes back as values, not bytes. A record whose
    /// values are out of range is answered BadRequest (FlatBuffers bytes),
    /// as over UDP; bytes that are no record are [`FixedReply::Garbage`].
    pub fn handle_fixed(
        &mut self,
        record: &[u8],
        now: Millis,
        queued: Option<Queued>,
    ) -> FixedReply<'_> {
        let (shed, bucket) = self.queued_start(queued);
        match fixed::decode_request(record) {
            Ok(fixed::Request::GetHost(g)) => match self.decide_get_host(g, now, shed, bucket) {
                HostDecision::Answer(a) | HostDecision::Shed(a, _) => FixedReply::Host(a),
                HostDecision::Encoded => FixedReply::Bytes(self.enc.finished()),
            },
            Ok(fixed::Request::Report(r)) => match self.report(&r, now) {
                Some(b) => FixedReply::Bytes(b),
                None => FixedReply::Nothing,
            },
            Err(fixed::FixedError::Invalid {
                kind,
                seq,
                module,
                error,
            }) => {
                let kind = if kind == fixed::GET_HOST {
                    Kind::GetHost
                } else {
                    Kind::Report
                };
                match self.bad_request(kind, u64::from(seq), module, &error) {
                    Some(b) => FixedReply::Bytes(b),
                    None => FixedReply::Nothing,
                }
            }
            Err(fixed::FixedError::Garbage(why)) => FixedReply::Garbage(why),
        }
    }

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

    fn apply_route(&mut self, msg: ToShard, now: Millis) -> Vec<Reply> {
        let (module, exists, version, nodes, policy) = match msg {
            ToShard::Route {
                module,
                exists,
                version,
                nodes,
                policy,
            } => (module, exists, version, nodes, policy),
            ToShard::Params(live) => {
                // Read at each use: every module follows them from now on.
                self.setup.params = live.params;
                self.setup.update_timeout_ms = live.update_timeout_ms;
                self.setup.report_timeout_ms = live.report_timeout_ms;
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
            entry.route = RouteState::Present;
        } else {
            entry.lb.update_route(&[], version, now, p);
            entry.lb.set_policy(Policy::L5);
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
    fn take_preloaded(&mut self, module: ModuleId, now: Millis) {
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
    fn make_preloaded(&mut self, i: usize, now: Millis) -> usize {
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
            // module's route is pulled again.
            policy: Policy::L5,
        };
        self.preload.set_made(i);
        self.preload.left -= 1;
        // No register can wait on a module not yet made: nothing released.
        let released = self.apply_route(msg, now);
        debug_assert!(released.is_empty());
        count
    }

    /// Runs every timer due at `now`: register requests past their
    /// deadline are answered Timeout (the answers are returned), statistics
    /// due are sent, expired modules are forgotten. Costs the work due.
    pub fn expire(&mut self, now: Millis) -> Vec<Reply> {
        let mut out = Vec::new();
        while let Some((at, (module, due))) = self.timers.pop_due(now) {
            if due == Due::Unsent {
                if at == self.unsent_at {
                    self.unsent_at = NONE;
                    self.offer_unsent(now);
                }
                continue;
            }
            let Some(entry) = self.modules.get_mut(&module) else {
                continue;
            };
            match due {
                Due::Waiters if entry.waiters_at == at => {
                    entry.waiters_at = NONE;
                    let before = entry.waiters.len();
                    let enc = &mut self.enc;
                    entry.waiters.retain(|w| {
                        if w.deadline <= now {
                            out.push((
                                w.peer,
                                enc.register_resp(w.seq, module, RetCode::Timeout, 0)
                                    .to_vec(),
                            ));
                            false
                        } else {
                            true
                        }
                    });
                    self.waiting -= before - entry.waiters.len();
                    if let Some(next) = entry.waiters.iter().map(|w| w.deadline).min() {
                        entry.waiters_at = next;
                        self.timers.schedule(next, (module, Due::Waiters));
                    }
                }
                Due::Stats if entry.stats_at == at => {
                    entry.stats_at = NONE;
                    self.send_stats(module, now);
                }
                Due::Expiry if entry.expiry_at == at => {
                    let due_at = expiry_due(entry, &self.setup);
                    if due_at <= now && entry.waiters.is_empty() {
                        self.forget(module, now);
                    } else {
                        let later = entry.waiters.iter().map(|w| w.deadline).max();
                        let at = due_at.max(later.unwrap_or(0)).max(now + 1);
                        entry.expiry_at = at;
                        self.timers.schedule(at, (module, Due::Expiry));
                    }
                }
                _ => {} // stale
            }
        }
        let live = self.modules.len() * 3 + 1;
        let modules = &self.modules;
        let unsent_at = self.unsent_at;
        self.timers
            .compact_if_stale(live, |at, (m, due)| match (due, modules.get(&m)) {
                (Due::Unsent, _) => at == unsent_at,
                (_, None) => false,
                (Due::Waiters, Some(e)) => e.waiters_at == at,
                (Due::Stats, Some(e)) => e.stats_at == at,
                (Due::Expiry, Some(e)) => e.expiry_at == at,
            });
        out
    }

    /// The earliest deadline of any timer (a stale one may come first:
    /// [`ShardCore::expire`] then does nothing).
    pub fn next_deadline(&self) -> Option<Millis> {
        self.timers.next_deadline()
    }

    /// Everything the shard holds for the reporter, now: every module's
    /// counts since its last statistics and every kept statistics message
    /// (at shutdown). Modules without calls are skipped.
    pub fn flush_stats(&mut self, now: Millis) {
        let modules: Vec<ModuleId> = self.modules.keys().copied().collect();
        for m in modules {
            self.send_stats(m, now);
        }
        self.offer_unsent(now);
    }

    /// Statistics the ring refused: kept, merged per node, for the module's
    /// next send (or offered again after [`STATS_RETRY_MS`]). No count is lost.
    pub fn stats_refused(&mut self, module: ModuleId, nodes: Vec<NodeCallStats>, now: Millis) {
        self.metrics.stats_kept += 1;
        merge_stats(self.unsent.entry(module).or_default(), nodes);
        if self.unsent_at == NONE {
            self.unsent_at = now + STATS_RETRY_MS;
            self.timers.schedule(self.unsent_at, (module, Due::Unsent));
        }
    }

    /// How many modules' statistics wait in the shard after a full ring.
    pub fn unsent_stats(&self) -> usize {
        self.unsent.len()
    }

    /// Refreshes the module gauges of [`ShardCore::metrics`] (the node
    /// gauges are kept as routes and states change). Costs the modules
    /// with downstream levels, not all of them: no periodic walk over the
    /// table.
    pub fn refresh_gauges(&mut self) {
        self.metrics.modules = (self.modules.len() - self.unknown) as u64;
        self.metrics.unknown_modules = self.unknown as u64;
        self.metrics.waiting_registers = self.waiting as u64;
        let modules = &self.modules;
        let mut levelled = 0;
        self.levelled.retain(|m| {
            let held = modules.get(m).map_or(0, |e| e.lb.levels_held() as u64);
            levelled += held;
            held > 0
        });
        self.metrics.nodes_levelled = levelled;
        // Per module with downstream levels: the most permissive one (the
        // level a request must pass at some node), at most
        // MODULE_LEVELS_SHOWN modules.
        self.metrics.module_levels.clear();
        for m in &self.levelled {
            if self.metrics.module_levels.len() >= super::metrics::MODULE_LEVELS_SHOWN {
                break;
            }
            let Some(e) = self.modules.get(m) else {
                continue;
            };
            let most =
                e.lb.nodes()
                    .iter()
                    .filter_map(|n| e.lb.level_of(n.addr()))
                    .max_by_key(|&l| lbagent_admission::level_index(l));
            if let Some(l) = most {
                self.metrics.module_levels.push((*m, l));
            }
        }
        self.metrics.module_levels.sort_unstable_by_key(|x| x.0);
    }

    // === requests ===

    /// Counts a request of `kind` and checks that this shard owns
    /// `module`. When it does not, the wrong-shard answer is encoded (read it
    /// with `self.enc.finished()`) and the result is false.
    fn admit(&mut self, kind: Kind, seq: u64, module: ModuleId, now: Millis) -> bool {
        self.last_kind = Some(kind);
        self.metrics.count_request(kind);
        let owner = module.shard(self.setup.shards);
        if owner == self.setup.id {
            if self.preload.left > 0 {
                self.take_preloaded(module, now);
            }
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

    /// A getHost; `shed`: the shard's own level applies; `bucket`: its
    /// queuing-time bucket and queuing time (µs), when the kernel stamped it.
    fn get_host(
        &mut self,
        g: wire::GetHost,
        now: Millis,
        shed: bool,
        bucket: Option<(usize, u64)>,
    ) -> Option<&[u8]> {
        match self.decide_get_host(g, now, shed, bucket) {
            HostDecision::Answer(a) => Some(
                self.enc
                    .get_host_resp(a.seq, a.module, a.retcode, a.host, a.level),
            ),
            HostDecision::Shed(a, level) => {
                // One answer encoded per level, its sequence and module
                // patched in.
                if self.rejected.as_ref().is_none_or(|r| r.level() != level) {
                    self.rejected = Some(wire::RejectedAnswer::new(&mut self.enc, level));
                }
                if let Some(r) = self
                    .rejected
                    .as_mut()
                    .and_then(|r| r.answer(a.seq, a.module))
                {
                    return Some(r);
                }
                Some(
                    self.enc
                        .get_host_resp(a.seq, a.module, a.retcode, None, a.level),
                )
            }
            HostDecision::Encoded => Some(self.enc.finished()),
        }
    }

    /// A getHost's decision, before any encoding (the UDP path encodes
    /// it, the fixed layout writes it as it is).
    fn decide_get_host(
        &mut self,
        g: wire::GetHost,
        now: Millis,
        shed: bool,
        bucket: Option<(usize, u64)>,
    ) -> HostDecision {
        let (seq, module) = (g.seq, g.module);
        let answer = |retcode, host, level| HostAnswer {
            seq,
            module,
            retcode,
            host,
            level,
        };
        let class = priority_class(g.business_priority);
        if let Some((b, us)) = bucket {
            self.metrics.record_gethost_queuing(class, b, us);
        }
        // Shed below the shard's own level before anything else: no
        // module lookup, no LB work (a getHost for another shard's module
        // is answered WrongShard below, as without shedding).
        if shed && module.shard(self.setup.shards) == self.setup.id {
            if let Some(a) = self.shedding.as_mut() {
                if !a.admit(g.business_priority, g.user_priority) {
                    let level = a.level();
                    self.last_kind = Some(Kind::GetHost);
                    self.metrics.count_request(Kind::GetHost);
                    self.metrics.self_rejected[class] += 1;
                    self.metrics.count_error(Kind::GetHost);
                    return HostDecision::Shed(answer(RetCode::Rejected, None, Some(level)), level);
                }
            }
        }
        if !self.admit(Kind::GetHost, u64::from(seq), module, now) {
            return HostDecision::Encoded;
        }
        if let Err(why) = self.ensure(module, now) {
            self.refuse(Kind::GetHost, u64::from(seq), module, why);
            return HostDecision::Encoded;
        }
        let Self {
            modules,
            outbox,
            setup,
            ..
        } = self;
        let lb = &mut touch(modules, outbox, setup, module, now).lb;
        if lb.units().is_some() {
            self.metrics.units_timed_out += u64::from(lb.expire_units(now));
        }
        let pick = lb.get_host_for(&setup.params, g.business_priority, g.user_priority, now);
        let (retcode, host) = match pick {
            Pick::Idle(a) => (RetCode::Ok, Some(a)),
            Pick::Rejected => {
                self.metrics.rejected += 1;
                self.metrics.downstream_rejected[class] += 1;
                (RetCode::Rejected, None)
            }
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
        if retcode != RetCode::Rejected {
            self.metrics.admitted[class] += 1;
        }
        // While the shard sheds, every answer carries its level, so that a
        // caller can shed below it before sending (collaborative admission
        // with the agent itself).
        let level = Some(self.self_level()).filter(|&l| l != OPEN);
        HostDecision::Answer(answer(retcode, host, level))
    }

    fn report(&mut self, rep: &wire::Report, now: Millis) -> Option<&[u8]> {
        let (seq, module, host) = (rep.seq, rep.module, rep.host);
        let outcome = Outcome::from_retcode(rep.retcode, rep.tcost_ms);
        if !self.admit(Kind::Report, u64::from(seq), module, now) {
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
        entry.last_used = now;
        match entry.lb.report(host, outcome, now, p) {
            Ok(t) => {
                if let Some(t) = t {
                    node_moved(&mut self.metrics, t.to);
                }
                // The node is in the route: report() just found it.
                if rep.consumed > 0 && !entry.lb.consume(host, rep.consumed).unwrap_or(false) {
                    self.metrics.consumed_ignored += 1;
                }
                if let Some(level) = rep.downstream_level {
                    let expires = now + self.setup.level_timeout_ms;
                    // The node is in the route: report() just found it.
                    let _ = entry.lb.set_level(host, Some(level), expires);
                    self.metrics.levels_reported += 1;
                    self.levelled.insert(module);
                }
            }
            Err(_) => {
                self.metrics.count_error(Kind::Report);
                self.metrics.unknown_node_reports += 1;
            }
        }
        self.maybe_stats(module, now);
        None
    }

    fn batch_report(&mut self, b: wire::BatchReport<'_>, now: Millis) -> Option<&[u8]> {
        if !self.admit(Kind::BatchReport, u64::from(b.seq), b.module, now) {
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
        entry.last_used = now;
        let metrics = &mut self.metrics;
        for (addr, count) in b.successes() {
            if entry
                .lb
                .report_successes(addr, count, now, p, |t| node_moved(metrics, t.to))
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

    fn get_route(&mut self, seq: u32, module: ModuleId, part: u32, now: Millis) -> Option<&[u8]> {
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
        let (retcode, version, parts) = match touch(modules, outbox, setup, module, now) {
            entry if entry.route == RouteState::Present => {
                let timed_out = entry.lb.expire_units(now);
                self.metrics.units_timed_out += u64::from(timed_out);
                policy = entry.lb.policy();
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
        ))
    }

    fn cache_get_route(
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
    fn no_such_part(
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

    // === module lifecycle ===

    /// Makes sure the shard holds `module`, creating an unknown entry
    /// within the bounds; the refusal's message otherwise (counted).
    fn ensure(&mut self, module: ModuleId, now: Millis) -> Result<(), &'static str> {
        if self.modules.contains_key(&module) {
            return Ok(());
        }
        if self.modules.len() >= self.setup.max_modules {
            self.metrics.module_limit_hits += 1;
            return Err(REFUSED_FULL);
        }
        if self.unknown >= self.setup.max_unknown {
            self.metrics.unknown_refused += 1;
            return Err(REFUSED_UNKNOWN);
        }
        self.create(module, now);
        Ok(())
    }

    /// A new entry without a route, its expiry armed.
    fn create(&mut self, module: ModuleId, now: Millis) {
        let mut entry = new_entry(now, &self.setup.params);
        let at = now + self.setup.unknown_ttl_ms;
        entry.expiry_at = at;
        self.timers.schedule(at, (module, Due::Expiry));
        self.modules.insert(module, Box::new(entry));
        self.unknown += 1;
    }

    /// Forgets `module`: its statistics go out first, then the control
    /// core is told to drop its copy and the subscription.
    fn forget(&mut self, module: ModuleId, now: Millis) {
        self.send_stats(module, now);
        let Some(entry) = self.modules.remove(&module) else {
            return;
        };
        if entry.route != RouteState::Present {
            self.unknown -= 1;
        }
        nodes_changed(&mut self.metrics, node_counts(&entry.lb), (0, 0));
        self.levelled.remove(&module);
        self.metrics.modules_expired += 1;
        self.outbox.push(ToControl::Forget(module));
    }

    /// An error answer for a request the shard refuses (a bound was hit).
    fn refuse(&mut self, kind: Kind, seq: u64, module: ModuleId, why: &str) -> &[u8] {
        self.metrics.count_error(kind);
        self.enc.error_resp(seq, module, RetCode::Unavailable, why)
    }

    /// After a report: sends the module's statistics when `report_timeout`
    /// has passed since the last send, as the original does (the period
    /// ends with the first report after it, so one message carries it).
    /// Otherwise arms a timer at twice the period: the counts of a module
    /// whose reports stop go out then, without a further report.
    fn maybe_stats(&mut self, module: ModuleId, now: Millis) {
        let Some(entry) = self.modules.get_mut(&module) else {
            return;
        };
        let timeout = self.setup.report_timeout_ms;
        if now >= entry.last_stats + timeout {
            self.send_stats(module, now);
        } else if entry.stats_at == NONE {
            let at = entry.last_stats + 2 * timeout;
            entry.stats_at = at;
            self.timers.schedule(at, (module, Due::Stats));
        }
    }

    /// Takes the module's counts (and any kept after a full ring) into a
    /// statistics message; nothing when there are none.
    fn send_stats(&mut self, module: ModuleId, now: Millis) {
        let kept = self.unsent.remove(&module);
        let mut nodes = Vec::new();
        if let Some(entry) = self.modules.get_mut(&module) {
            entry.last_stats = now;
            entry.stats_at = NONE;
            entry.lb.take_stats(&mut nodes);
            if nodes
                .iter()
                .all(|n| n.succ == 0 && n.err == 0 && n.consumed == 0)
            {
                nodes.clear();
            }
        }
        if let Some(kept) = kept {
            merge_stats(&mut nodes, kept);
        }
        if !nodes.is_empty() {
            self.outbox.push(ToControl::Stats { module, nodes });
        }
    }

    /// Offers again every message the ring refused.
    fn offer_unsent(&mut self, _now: Millis) {
        for (module, nodes) in self.unsent.drain() {
            self.outbox.push(ToControl::Stats { module, nodes });
        }
        for module in self.forgets.drain(..) {
            self.outbox.push(ToControl::Forget(module));
        }
    }

    /// A Forget the ring refused: offered again after [`STATS_RETRY_MS`].
    pub fn forget_refused(&mut self, module: ModuleId, now: Millis) {
        self.metrics.ring_drops += 1;
        self.forgets.push(module);
        if self.unsent_at == NONE {
            self.unsent_at = now + STATS_RETRY_MS;
            self.timers.schedule(self.unsent_at, (module, Due::Unsent));
        }
    }

    /// Marks a pull as not sent (the ring was full): the next getHost asks again.
    pub fn pull_dropped(&mut self, module: ModuleId) {
        if let Some(e) = self.modules.get_mut(&module) {
            e.pull_sent = None;
        }
        self.metrics.ring_drops += 1;
    }
}

/// Records a request naming `module` (held: see [`ShardCore::ensure`]) and
/// asks for a pull when it has no answer yet and no pull is outstanding (a
/// pull unanswered for `update_timeout` counts as lost). A module answered
/// once is kept current by the route client (pushes, and its own versioned
/// re-pull every `update_timeout`), not by requests: the shard asks again
/// only after forgetting it. A free function over the fields it needs, so
/// callers keep the other fields.
fn touch<'m>(
    modules: &'m mut Modules,
    outbox: &mut Vec<ToControl>,
    setup: &ShardSetup,
    module: ModuleId,
    now: Millis,
) -> &'m mut ModuleEntry {
    let timeout = setup.update_timeout_ms;
    let entry = modules.get_mut(&module).expect("held: ensure() ran first");
    entry.last_used = now;
    let stale = entry.route == RouteState::Unknown;
    let outstanding = entry
        .pull_sent
        .is_some_and(|t| now.saturating_sub(t) < timeout);
    if stale && !outstanding {
        entry.pull_sent = Some(now);
        outbox.push(ToControl::Pull(module));
    }
    entry
}

/// When `entry` expires: unused for `module_idle_ms` with a route,
/// `unknown_ttl_ms` after its last answer (or its making) without one.
fn expiry_due(entry: &ModuleEntry, setup: &ShardSetup) -> Millis {
    match entry.route {
        RouteState::Present => entry.last_used.saturating_add(setup.module_idle_ms),
        _ => entry.last_update.saturating_add(setup.unknown_ttl_ms),
    }
}

/// A module's (nodes, overloaded nodes), for the node gauges.
fn node_counts(lb: &ModuleLb) -> (u64, u64) {
    (lb.nodes().len() as u64, lb.overloaded_count() as u64)
}

/// The node gauges after a module's counts went from `before` to `after`.
fn nodes_changed(m: &mut ShardMetrics, before: (u64, u64), after: (u64, u64)) {
    let idle = |(n, o): (u64, u64)| n - o;
    m.nodes_idle = m.nodes_idle + idle(after) - idle(before);
    m.nodes_overloaded = m.nodes_overloaded + after.1 - before.1;
}

/// Counts a node's state change, and moves it between the node gauges.
fn node_moved(m: &mut ShardMetrics, to: NodeState) {
    m.count_transition(to);
    match to {
        NodeState::Overloaded => {
            m.nodes_idle -= 1;
            m.nodes_overloaded += 1;
        }
        NodeState::Idle => {
            m.nodes_overloaded -= 1;
            m.nodes_idle += 1;
        }
    }
}

/// Adds `more` into `into`, node by node (counts summed, the later
/// overload flag kept).
fn merge_stats(into: &mut Vec<NodeCallStats>, more: Vec<NodeCallStats>) {
    for m in more {
        match into.iter_mut().find(|n| n.addr == m.addr) {
            Some(n) => {
                n.succ = n.succ.saturating_add(m.succ);
                n.err = n.err.saturating_add(m.err);
                n.consumed = n.consumed.saturating_add(m.consumed);
            }
            None => into.push(m),
        }
    }
}

fn new_entry(now: Millis, p: &LbParams) -> ModuleEntry {
    ModuleEntry {
        lb: ModuleLb::new(&[], 0, now, p),
        route: RouteState::Unknown,
        pull_sent: None,
        last_update: now,
        last_stats: now,
        last_used: now,
        waiters: Vec::new(),
        waiters_at: NONE,
        stats_at: NONE,
        expiry_at: NONE,
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

#[cfg(test)]
mod tests;
