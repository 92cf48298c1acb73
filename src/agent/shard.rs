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
//!
//! # Layout
//!
//! This file holds the state, the datagram's dispatch by request kind and
//! what every request shares (the owner check, a bad request, a refusal);
//! one file per request kind and per concern beside it:
//!
//! - `gethost`: getHost, shed, answered or refused; its decision as values.
//! - `report`: report and batchReport into the module's LB state.
//! - `route`: the control core's routes in; register, getRoute and
//!   cacheGetRoute out.
//! - `admission`: the shard's own admission control (shedding).
//! - `modules`: the module table's bounds, expiry, timers and gauges.
//! - `table`: the module table itself, which remembers the module looked
//!   up last (no hash lookup for a run of one module's requests).
//! - `outbox`: statistics and what a full ring refused, for the control core.
//! - `preload`: the snapshot at start, made into modules in slices.
//! - `callers`: who sent a request (its channel), whether the agent trusts
//!   it with requests that act beyond itself, and the local connections.
//!
//! # Who may act beyond itself
//!
//! Every request names its channel by the peer address the shell passes:
//! a UDP source, a shared-memory slot ([`lbagent_shm::layout::slot_peer`])
//! or a local-socket connection ([`callers::local_peer`]). A report that
//! consumes units is taken only from a trusted caller (a slot: the region's
//! group is the check; a local connection the shell identified and the
//! configuration allows; UDP only with `agent.udp_acts_beyond`), and is
//! answered ErrorResp `Forbidden` otherwise; a downstream level from a
//! caller that is not trusted filters only that caller's getHosts. A
//! `balance` module's units are booked to the caller's channel. Trust is
//! looked up only by the requests that need it: the getHost and report of
//! an `l5` module pay nothing.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use super::messages::ToControl;
use super::metrics::{Kind, ShardMetrics};
use super::timers::Timers;
use gethost::{Decided, RecordSink};
use lbagent_admission::{Admission, Micros};
use lbagent_lb::{LbParams, Millis, ModuleLb, NodeCallStats, NO_HINT};
use lbagent_model::{ModuleId, ShardOf};
use lbagent_shm::fixed::{self, HostAnswer};
use lbagent_wire::{self as wire, Encoder, Hot, Limits, Message, NodeStatus, RetCode};
use preload::Preload;

mod admission;
pub mod callers;
mod gethost;
mod modules;
mod outbox;
mod preload;
mod report;
mod route;
mod table;

use table::Modules;

pub use admission::agent_params;

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
    /// Trust UDP callers with requests that act beyond themselves
    /// (`agent.udp_acts_beyond`, compatibility; off by default).
    pub udp_acts_beyond: bool,
    /// Zones and labels (issue 31): the agent's zone and what a getHost
    /// does with them.
    pub steering: Steering,
}

/// The agent's zone and the agent-wide rules of zone-aware and
/// label-selecting getHosts (`agent.zone`, `[lb] locality_min_percent`,
/// `[lb] label_fallback`). The default: no zone (every getHost as L5),
/// threshold 0, fallback `any`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Steering {
    /// The agent's own zone; None: no zone preference.
    pub zone: Option<lbagent_model::Zone>,
    /// The local zone's idle share, in percent, below which a getHost
    /// spills over to every zone (a module's own value, when its options
    /// carry one, wins: [`lbagent_lb::locality::threshold`]).
    pub locality_min_percent: u32,
    /// What a selector matching no node answers.
    pub label_fallback: lbagent_lb::labels::Fallback,
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
            udp_acts_beyond: false,
            steering: Steering::default(),
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

/// A datagram to send: the bytes and where to.
pub type Reply = (SocketAddr, Vec<u8>);

/// One shard's state and logic.
pub struct ShardCore {
    setup: ShardSetup,
    /// Who owns a module among `setup.shards` (the division done once).
    owner: ShardOf,
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
    /// The Ok answer for the level answers carry, encoded once per level,
    /// its sequence, module and node patched in (see [`wire::OkAnswer`]).
    answered: Option<wire::OkAnswer>,
    /// Counters for the metrics endpoint.
    pub metrics: ShardMetrics,
    /// The open local-socket connections and whether each is trusted.
    locals: callers::Locals,
    /// `balance` modules that may hold units (a gone client's are
    /// released from these).
    balanced: HashSet<ModuleId>,
}

/// What the shard answers to a record of the fixed layout, as values
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

/// What [`ShardCore::serve_record`] did with a record of the fixed layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A getHost answered: its answer record is the first this many bytes
    /// of the `out` given.
    Answer(usize),
    /// An answer in FlatBuffers bytes, in [`ShardCore::encoded`] (an
    /// ErrorResp: wrong shard, unavailable, bad request, forbidden).
    Encoded,
    /// Nothing to answer (a report).
    Nothing,
    /// The bytes are no record (counted by the caller).
    Garbage,
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
            owner: ShardOf::new(setup.shards),
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
            answered: None,
            locals: callers::Locals::default(),
            balanced: HashSet::new(),
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
        // The hot path: a plain getHost or a report read straight from the
        // bytes, with the verifier's checks on their path and the same
        // validation (no verifier pass); anything it does not vouch for
        // takes the full decode below, which answers or counts it.
        match wire::read_hot(datagram, &Limits::UDP) {
            Some(Hot::GetHost(g)) => return self.get_host(g, None, peer, now, shed, bucket),
            Some(Hot::Report(r)) => return self.report(&r, NO_HINT, peer, now, true),
            None => {}
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
                // A plain getHost: its key and selector are not looked up.
                Ok(g) if !r.may_steer() => self.get_host(g, None, peer, now, shed, bucket),
                Ok(g) => match wire::read_selector(r.selector()) {
                    Ok(selector) => {
                        let steer = gethost::Steer {
                            key: r.key_hash(),
                            selector: &selector,
                        };
                        self.get_host(g, Some(&steer), peer, now, shed, bucket)
                    }
                    Err(e) => self.bad_request(Kind::GetHost, u64::from(g.seq), g.module, &e),
                },
                Err(e) => self.bad_request(
                    Kind::GetHost,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::ReportReq(r) => match r.validate() {
                Ok(rep) => self.report(&rep, NO_HINT, peer, now, true),
                Err(e) => self.bad_request(
                    Kind::Report,
                    u64::from(r.seq()),
                    ModuleId::new(r.modid(), r.cmdid()),
                    &e,
                ),
            },
            Message::BatchReportReq(r) => match r.validate() {
                Ok(b) => self.batch_report(b, peer, now),
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

    /// [`ShardCore::handle_queued`] for a getHost or report record of the
    /// shared memory's fixed layout ([`lbagent_shm::fixed`]), decided and
    /// answered in place: the record's fields are read into the same
    /// request the FlatBuffers datagram gives and taken through the same
    /// path (the same L5 and DAGOR decisions, the same counts), and a
    /// getHost's answer is written as a record into `out` from the
    /// decision's values ([`Served::Answer`], with the node hint when the
    /// getHost asked for it). A report's node hint is tried before the
    /// node's search. A record whose values are out of range is answered
    /// BadRequest (FlatBuffers bytes in [`ShardCore::encoded`]), as over
    /// UDP; bytes that are no record are [`Served::Garbage`]. `peer` is
    /// the slot's ([`lbagent_shm::layout::slot_peer`]).
    #[inline]
    pub fn serve_record(
        &mut self,
        record: &[u8],
        peer: SocketAddr,
        now: Millis,
        queued: Option<Queued>,
        out: &mut [u8; fixed::ANSWER_MAX],
    ) -> Served {
        let (shed, bucket) = self.queued_start(queued);
        match fixed::decode_request_hinted(record) {
            Ok((fixed::Request::GetHost(g), hint)) => {
                let mut sink = RecordSink {
                    out,
                    ask: hint == fixed::Hint::Ask,
                    len: 0,
                };
                match self.decide_get_host(g, peer, now, shed, bucket, &mut sink) {
                    Decided::Answered | Decided::Shed(_) => Served::Answer(sink.len),
                    Decided::Encoded => Served::Encoded,
                }
            }
            Ok((fixed::Request::Report(r), hint)) => {
                let hint = match hint {
                    fixed::Hint::Node(i) => i,
                    _ => NO_HINT,
                };
                match self.report(&r, hint, peer, now, false) {
                    Some(_) => Served::Encoded,
                    None => Served::Nothing,
                }
            }
            Err(e) => self.record_refused(e),
        }
    }

    /// [`ShardCore::serve_record`] for a report sent ahead of a request
    /// in the same cell (it has no answer). Out of line: the sweep inlines
    /// the request's own record, not this rarer one's.
    #[inline(never)]
    pub fn serve_report_first(
        &mut self,
        record: &[u8],
        peer: SocketAddr,
        now: Millis,
        queued: Option<Queued>,
    ) -> Served {
        let mut out = [0u8; fixed::ANSWER_MAX];
        self.serve_record(record, peer, now, queued, &mut out)
    }

    /// A record [`ShardCore::serve_record`] could not take: out-of-range
    /// values answered BadRequest, garbage counted by the caller. Out of
    /// line: a valid record pays nothing for it.
    #[cold]
    #[inline(never)]
    fn record_refused(&mut self, e: fixed::FixedError) -> Served {
        match e {
            fixed::FixedError::Invalid {
                kind,
                seq,
                module,
                error,
            } => {
                let kind = if kind == fixed::GET_HOST {
                    Kind::GetHost
                } else {
                    Kind::Report
                };
                match self.bad_request(kind, u64::from(seq), module, &error) {
                    Some(_) => Served::Encoded,
                    None => Served::Nothing,
                }
            }
            fixed::FixedError::Garbage(_) => Served::Garbage,
        }
    }

    /// The FlatBuffers answer the last request left in the shard's
    /// encoder ([`Served::Encoded`]). Out of line: the request paths that
    /// return it are the rare ends, and an inlined one kept the encoder's
    /// address across a sweep (callgrind).
    #[cold]
    #[inline(never)]
    pub fn encoded(&self) -> &[u8] {
        self.enc.finished()
    }

    /// [`ShardCore::serve_record`] with the answer as values (tests and
    /// tools; the shell writes the record in place): a getHost's answer
    /// comes back as [`FixedReply::Host`], read from the record written.
    pub fn handle_fixed(
        &mut self,
        record: &[u8],
        peer: SocketAddr,
        now: Millis,
        queued: Option<Queued>,
    ) -> FixedReply<'_> {
        let mut out = [0u8; fixed::ANSWER_MAX];
        match self.serve_record(record, peer, now, queued, &mut out) {
            Served::Answer(n) => FixedReply::Host(
                fixed::decode_answer(&out[..n]).expect("the shard writes answer records it reads"),
            ),
            Served::Encoded => FixedReply::Bytes(self.enc.finished()),
            Served::Nothing => FixedReply::Nothing,
            Served::Garbage => match fixed::decode_request(record) {
                Err(fixed::FixedError::Garbage(why)) => FixedReply::Garbage(why),
                _ => FixedReply::Garbage("garbage"),
            },
        }
    }

    /// Counts a request of `kind` and checks that this shard owns
    /// `module`. When it does not, the wrong-shard answer is encoded (read it
    /// with `self.enc.finished()`) and the result is false.
    #[inline]
    fn admit(&mut self, kind: Kind, seq: u64, module: ModuleId, now: Millis) -> bool {
        self.last_kind = Some(kind);
        self.metrics.count_request(kind);
        let owner = self.owner.of(module);
        if owner == self.setup.id {
            if self.preload.left > 0 {
                self.take_preloaded(module, now);
            }
            return true;
        }
        self.wrong_shard(kind, seq, module, owner);
        false
    }

    /// The wrong-shard answer of [`ShardCore::admit`], counted. Out of
    /// line: the request path of a module the shard owns pays nothing for
    /// the message it formats.
    #[cold]
    #[inline(never)]
    fn wrong_shard(&mut self, kind: Kind, seq: u64, module: ModuleId, owner: u32) {
        self.metrics.count_error(kind);
        self.metrics.wrong_shard += 1;
        let port = u32::from(self.setup.base_port) + owner;
        let msg = format!(
            "module {module} belongs to shard {owner} (UDP port {port}), not shard {}: (modid + cmdid) % {} = {owner}",
            self.setup.id, self.setup.shards
        );
        self.enc.error_resp(seq, module, RetCode::WrongShard, &msg);
    }

    fn bad_request(
        &mut self,
        kind: Kind,
        seq: u64,
        module: ModuleId,
        e: &dyn std::fmt::Display,
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

    /// An error answer for a request the shard refuses (a bound was hit).
    /// Out of line: the request path keeps no address of the encoder.
    #[cold]
    #[inline(never)]
    fn refuse(&mut self, kind: Kind, seq: u64, module: ModuleId, why: &str) -> &[u8] {
        self.metrics.count_error(kind);
        self.enc.error_resp(seq, module, RetCode::Unavailable, why)
    }
}

#[cfg(test)]
pub(crate) mod record_tests;
#[cfg(test)]
mod steering_tests;
#[cfg(test)]
mod tests;
