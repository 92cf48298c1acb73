//! Counters and the getHost service-time histogram of one shard, and the
//! Prometheus exposition of every shard's and the control core's figures.
//! Counting is plain field increments on the shard's own struct; the shell
//! ships a copy to the control core once a second, and the control core
//! writes what it holds when scraped, through prometheus-client's text
//! encoder (the families are declared once, under `=== the exposition ===`).

use std::fmt::{self, Write};

use hdrhistogram::Histogram;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelValue, LabelValueEncoder, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType::{self, Counter, Gauge};
use prometheus_client::registry::Registry;

use lbagent_service::exposition::{family, figures, Figure};

use lbagent_admission::{clamp_priority, AdmissionLevel, OPEN};
use lbagent_lb::NodeState;
use lbagent_wire::DecodeError;

/// A request kind, for per-kind counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// getHost.
    GetHost = 0,
    /// report.
    Report = 1,
    /// batch report.
    BatchReport = 2,
    /// register.
    Register = 3,
    /// getRoute.
    GetRoute = 4,
    /// cache getRoute.
    CacheGetRoute = 5,
}

impl Kind {
    /// Every kind, in label order.
    pub const ALL: [Kind; 6] = [
        Kind::GetHost,
        Kind::Report,
        Kind::BatchReport,
        Kind::Register,
        Kind::GetRoute,
        Kind::CacheGetRoute,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        [
            "gethost",
            "report",
            "batch_report",
            "register",
            "getroute",
            "cache_getroute",
        ][self as usize]
    }
}

/// Priority classes of the per-class getHost counts: business priority
/// 1, 2-3, 4-7, ... 64-127, 128 (unset counts as 128).
pub const CLASSES: usize = 8;

/// The `class` label of each priority class.
pub const CLASS_LABELS: [&str; CLASSES] =
    ["1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128"];

/// The priority class of business priority `b` (an index into
/// [`CLASS_LABELS`]).
pub fn priority_class(b: u8) -> usize {
    clamp_priority(b).ilog2() as usize
}

/// Upper bounds of the queuing-time histogram's buckets, µs (then +Inf).
pub const QUEUING_BUCKETS_US: [u64; 12] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000,
];

/// One shard's counters and gauges.
#[derive(Clone, Debug)]
pub struct ShardMetrics {
    /// The shard's index.
    pub shard: u32,
    /// Requests by kind.
    pub requests: [u64; 6],
    /// Requests answered with an error (or dropped), by kind.
    pub errors: [u64; 6],
    /// Datagrams that did not decode, by reason: truncated, oversized, bad
    /// identifier, malformed, no body, unknown type.
    pub malformed: [u64; 6],
    /// Well-formed messages that have no business on a shard (answers, TCP messages).
    pub unexpected: u64,
    /// Requests whose fields failed validation.
    pub invalid: u64,
    /// Requests for modules another shard owns.
    pub wrong_shard: u64,
    /// Reports for modules without a route.
    pub unknown_module_reports: u64,
    /// Reports for nodes not in the module's route.
    pub unknown_node_reports: u64,
    /// getHosts answered by a probe of an overloaded node.
    pub probes: u64,
    /// getHosts answered in panic: a module's idle share below its
    /// `panic_percent`, a node by round robin over every node.
    pub panic_answers: u64,
    /// getHosts that carried a key and were answered by consistent hashing.
    pub keyed_gethosts: u64,
    /// getHosts that carried a label selector.
    pub selecting_gethosts: u64,
    /// getHosts answered with the agent's zone preferred (`agent.zone`).
    pub near_gethosts: u64,
    /// getHosts answered Rejected: every idle node's downstream level
    /// refuses the request's priorities (DAGOR collaborative admission).
    pub rejected: u64,
    /// Reports that carried a downstream admission level.
    pub levels_reported: u64,
    /// `balance` modules' units not reported within `lb.unit_timeout`,
    /// returned by their time-out.
    pub units_timed_out: u64,
    /// Reports saying they consumed capacity units for good, for a module
    /// that is not `balance` (ignored).
    pub consumed_ignored: u64,
    /// Requests that act beyond their caller (a report consuming units)
    /// refused from a caller the agent does not trust with them.
    pub forbidden: u64,
    /// Downstream levels kept to the reporting caller's own getHosts (it
    /// is not trusted to set a level every caller shares).
    pub levels_private: u64,
    /// getHosts of `balance` modules answered overloaded because the
    /// client already held `lb.units_per_client` units.
    pub units_client_limited: u64,
    /// Units given back because the client that held them is gone (its
    /// local connection closed).
    pub units_released: u64,
    /// Open local-socket connections (gauge).
    pub local_connections: u64,
    /// Local-socket connections refused (the shard held its most, or the
    /// kernel gave no credentials).
    pub local_refused: u64,
    /// Nodes with a downstream admission level held (gauge).
    pub nodes_levelled: u64,
    /// Nodes that became overloaded.
    pub to_overloaded: u64,
    /// Nodes that became idle.
    pub to_idle: u64,
    /// Route updates applied.
    pub route_updates: u64,
    /// Route updates for modules this shard does not own (a control core bug).
    pub misrouted_updates: u64,
    /// Messages to the control core dropped because the ring was full.
    pub ring_drops: u64,
    /// Unknown modules refused because the shard holds `agent.max_modules`.
    pub module_limit_hits: u64,
    /// Requests for unknown modules refused because the shard already
    /// remembers `agent.max_unknown_modules` of them.
    pub unknown_refused: u64,
    /// Register requests refused because `MAX_WAITERS` already wait.
    pub registers_refused: u64,
    /// Modules forgotten: unused past `agent.module_idle_timeout`, or
    /// unknown past `agent.unknown_module_ttl_ms`.
    pub modules_expired: u64,
    /// Statistics the ring refused, kept in the shard for the next send.
    pub stats_kept: u64,
    /// Routes for modules the shard did not hold (the snapshot's at start,
    /// or one that expired while its route was on the way).
    pub unheld_routes: u64,
    /// Unknown modules remembered: asked for, absent or unanswered (gauge).
    pub unknown_modules: u64,
    /// Register requests waiting for a route (gauge).
    pub waiting_registers: u64,
    /// Answers that could not be sent.
    pub send_errors: u64,
    /// Datagrams the kernel dropped on the shard's socket for want of
    /// receive buffer (`SO_RXQ_OVFL`; counted only with
    /// `admission.agent_shedding`).
    pub kernel_drops: u64,
    /// Modules with a route (gauge).
    pub modules: u64,
    /// Idle nodes (gauge).
    pub nodes_idle: u64,
    /// Overloaded nodes (gauge).
    pub nodes_overloaded: u64,
    /// getHost service time in nanoseconds, decode to encoded answer.
    pub gethost_ns: Histogram<u64>,
    /// The shard's own admission level (DAGOR self-protection; open when
    /// it does not shed).
    pub self_level: AdmissionLevel,
    /// getHosts let through by the shard's own admission and the
    /// downstream levels, by priority class.
    pub admitted: [u64; CLASSES],
    /// getHosts the shard shed itself (its own level), by priority class.
    pub self_rejected: [u64; CLASSES],
    /// getHosts rejected by the downstream levels, by priority class.
    pub downstream_rejected: [u64; CLASSES],
    /// Datagrams by queuing time (kernel receive timestamp to handling):
    /// one count per bucket of [`QUEUING_BUCKETS_US`], then +Inf.
    pub queuing_buckets: [u64; QUEUING_BUCKETS_US.len() + 1],
    /// Sum of the queuing times counted, µs.
    pub queuing_sum_us: u64,
    /// getHosts by priority class and queuing time: per class, one count
    /// per bucket of [`QUEUING_BUCKETS_US`], then +Inf.
    pub gethost_queuing: [[u64; QUEUING_BUCKETS_US.len() + 1]; CLASSES],
    /// Per priority class, the sum of those getHosts' queuing times, µs.
    pub gethost_queuing_sum_us: [u64; CLASSES],
    /// The shared-memory transport's counters (zero without `[shm]`).
    pub shm: lbagent_shm::serve::ShmCounts,
    /// Modules with downstream levels and the most permissive one (gauge;
    /// at most [`MODULE_LEVELS_SHOWN`], by module).
    pub module_levels: Vec<(lbagent_model::ModuleId, AdmissionLevel)>,
}

/// The most modules per shard whose downstream level is exported.
pub const MODULE_LEVELS_SHOWN: usize = 64;

impl ShardMetrics {
    /// Zeroed metrics for shard `shard`.
    pub fn new(shard: u32) -> Self {
        ShardMetrics {
            shard,
            requests: [0; 6],
            errors: [0; 6],
            malformed: [0; 6],
            unexpected: 0,
            invalid: 0,
            wrong_shard: 0,
            unknown_module_reports: 0,
            unknown_node_reports: 0,
            probes: 0,
            panic_answers: 0,
            keyed_gethosts: 0,
            selecting_gethosts: 0,
            near_gethosts: 0,
            rejected: 0,
            levels_reported: 0,
            units_timed_out: 0,
            consumed_ignored: 0,
            forbidden: 0,
            levels_private: 0,
            units_client_limited: 0,
            units_released: 0,
            local_connections: 0,
            local_refused: 0,
            nodes_levelled: 0,
            to_overloaded: 0,
            to_idle: 0,
            route_updates: 0,
            misrouted_updates: 0,
            ring_drops: 0,
            module_limit_hits: 0,
            unknown_refused: 0,
            registers_refused: 0,
            modules_expired: 0,
            stats_kept: 0,
            unheld_routes: 0,
            unknown_modules: 0,
            waiting_registers: 0,
            send_errors: 0,
            kernel_drops: 0,
            modules: 0,
            nodes_idle: 0,
            nodes_overloaded: 0,
            gethost_ns: Histogram::new_with_bounds(1, 10_000_000_000, 2)
                .expect("valid histogram bounds"),
            self_level: OPEN,
            admitted: [0; CLASSES],
            self_rejected: [0; CLASSES],
            downstream_rejected: [0; CLASSES],
            queuing_buckets: [0; QUEUING_BUCKETS_US.len() + 1],
            queuing_sum_us: 0,
            gethost_queuing: [[0; QUEUING_BUCKETS_US.len() + 1]; CLASSES],
            gethost_queuing_sum_us: [0; CLASSES],
            shm: Default::default(),
            module_levels: Vec::new(),
        }
    }

    /// Counts a request of `kind`.
    pub fn count_request(&mut self, kind: Kind) {
        self.requests[kind as usize] += 1;
    }

    /// Counts an error answer of `kind`.
    pub fn count_error(&mut self, kind: Kind) {
        self.errors[kind as usize] += 1;
    }

    /// Counts a datagram that did not decode.
    pub fn count_malformed(&mut self, e: &DecodeError) {
        let i = match e {
            DecodeError::Truncated { .. } => 0,
            DecodeError::Oversized { .. } => 1,
            DecodeError::BadIdentifier { .. } => 2,
            DecodeError::Malformed(_) => 3,
            DecodeError::NoBody => 4,
            DecodeError::UnknownType(_) => 5,
        };
        self.malformed[i] += 1;
    }

    /// Counts a node's state change.
    pub fn count_transition(&mut self, to: NodeState) {
        match to {
            NodeState::Overloaded => self.to_overloaded += 1,
            NodeState::Idle => self.to_idle += 1,
        }
    }

    /// Records one datagram's queuing time, µs; returns its bucket (for
    /// [`ShardMetrics::record_gethost_queuing`]).
    pub fn record_queuing_us(&mut self, us: u64) -> usize {
        let i = QUEUING_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(QUEUING_BUCKETS_US.len());
        self.queuing_buckets[i] += 1;
        self.queuing_sum_us = self.queuing_sum_us.saturating_add(us);
        i
    }

    /// Counts a getHost of priority class `class` in queuing-time bucket
    /// `bucket` (as [`ShardMetrics::record_queuing_us`] returned it) that
    /// waited `us` µs.
    pub fn record_gethost_queuing(&mut self, class: usize, bucket: usize, us: u64) {
        self.gethost_queuing[class][bucket] += 1;
        self.gethost_queuing_sum_us[class] = self.gethost_queuing_sum_us[class].saturating_add(us);
    }

    /// Records one getHost's service time, ns.
    pub fn record_gethost_ns(&mut self, ns: u64) {
        self.gethost_ns.saturating_record(ns.max(1));
    }

    /// All datagrams that did not decode.
    pub fn malformed_total(&self) -> u64 {
        self.malformed.iter().sum()
    }
}

const MALFORMED_REASONS: [&str; 6] = [
    "truncated",
    "oversized",
    "bad_identifier",
    "malformed",
    "no_body",
    "unknown_type",
];

/// The control core's own figures.
#[derive(Clone, Debug, Default)]
pub struct ControlMetrics {
    /// The connected route server, if any.
    pub route_server: Option<String>,
    /// The connected reporter, if any.
    pub reporter: Option<String>,
    /// Pulls sent to the route server.
    pub pulls_sent: u64,
    /// Routes received (answers and pushes).
    pub routes_received: u64,
    /// Statistics batches accepted by the reporter.
    pub stats_sent: u64,
    /// Statistics dropped (reporter unreachable past the buffer bound).
    pub stats_dropped: u64,
    /// Messages to shards dropped because a ring was full.
    pub ring_drops: u64,
    /// Seconds since the last heartbeat write.
    pub heartbeat_age_s: f64,
    /// Snapshots written.
    pub snapshots_written: u64,
    /// Snapshot writes that failed.
    pub snapshot_errors: u64,
    /// Snapshots not started because the previous one was still being
    /// written (a slow disk).
    pub snapshots_skipped: u64,
    /// Modules the shards forgot (expired): dropped from the control core's
    /// table and unsubscribed at the route server.
    pub modules_forgotten: u64,
}

// === the exposition ===
//
// Every family is declared once below (name, TYPE, HELP, how to read it)
// and written by prometheus-client's text encoder at scrape time, from a
// copy of the figures the shards last shipped: the shards' counting stays
// plain field increments, with no atomic on the hot path.
//
// The endpoint serves the Prometheus text format 0.0.4 (`Content-Type:
// text/plain; version=0.0.4`, the reload counts appended after it); how
// counters are written for it: `lbagent_service::exposition`.
// prometheus-client 0.24 has no summary type: the one summary is written by
// [`render_service_time`].

/// The per-shard figures with no label but `shard`, in exposition order.
const SHARD_FIGURES: [Figure<ShardMetrics>; 43] = [
    (
        "lbagent_shm_requests_total",
        Counter,
        "Requests taken from the shard's shared-memory slots.",
        |m| m.shm.requests,
    ),
    (
        "lbagent_shm_garbage_total",
        Counter,
        "Shared-memory requests refused because their slot held garbage (a length out of range).",
        |m| m.shm.garbage,
    ),
    (
        "lbagent_shm_reclaimed_total",
        Counter,
        "Shared-memory slots taken back from dead clients.",
        |m| m.shm.reclaimed,
    ),
    (
        "lbagent_shm_wakes_total",
        Counter,
        "Shared-memory clients woken by a futex (they slept waiting for their answer).",
        |m| m.shm.wakes,
    ),
    (
        "lbagent_shm_truncated_total",
        Counter,
        "Shared-memory regions found truncated under their shard by a client (the region is closed, the shard goes on by UDP).",
        |m| m.shm.truncated,
    ),
    (
        "lbagent_unexpected_messages_total",
        Counter,
        "Well-formed messages that have no business on a shard.",
        |m| m.unexpected,
    ),
    (
        "lbagent_invalid_requests_total",
        Counter,
        "Requests whose fields failed validation.",
        |m| m.invalid,
    ),
    (
        "lbagent_wrong_shard_total",
        Counter,
        "Requests for modules another shard owns.",
        |m| m.wrong_shard,
    ),
    (
        "lbagent_unknown_module_reports_total",
        Counter,
        "Reports for modules without a route.",
        |m| m.unknown_module_reports,
    ),
    (
        "lbagent_unknown_node_reports_total",
        Counter,
        "Reports for nodes not in the route.",
        |m| m.unknown_node_reports,
    ),
    (
        "lbagent_probes_total",
        Counter,
        "getHosts answered by probing an overloaded node.",
        |m| m.probes,
    ),
    (
        "lbagent_gethost_panic_total",
        Counter,
        "getHosts answered in panic (a module's idle share below its panic_percent).",
        |m| m.panic_answers,
    ),
    (
        "lbagent_keyed_gethosts_total",
        Counter,
        "getHosts with a key, answered by consistent hashing (Maglev).",
        |m| m.keyed_gethosts,
    ),
    (
        "lbagent_selecting_gethosts_total",
        Counter,
        "getHosts with a label selector.",
        |m| m.selecting_gethosts,
    ),
    (
        "lbagent_near_gethosts_total",
        Counter,
        "getHosts answered preferring the agent's zone (agent.zone).",
        |m| m.near_gethosts,
    ),
    (
        "lbagent_gethost_rejected_total",
        Counter,
        "getHosts answered Rejected by the downstream admission levels (DAGOR).",
        |m| m.rejected,
    ),
    (
        "lbagent_balance_units_timed_out_total",
        Counter,
        "Capacity units of balance modules not reported back within lb.unit_timeout, returned by their time-out.",
        |m| m.units_timed_out,
    ),
    (
        "lbagent_consumed_ignored_total",
        Counter,
        "Reports saying they consumed capacity units, for a module whose policy is not balance (ignored).",
        |m| m.consumed_ignored,
    ),
    (
        "lbagent_requests_forbidden_total",
        Counter,
        "Reports consuming units refused: the caller is not trusted with requests that act beyond itself (UDP, or a local-socket user not in agent.trusted_uids / trusted_gids).",
        |m| m.forbidden,
    ),
    (
        "lbagent_downstream_levels_private_total",
        Counter,
        "Downstream levels kept to the reporting caller's own getHosts (the caller is not trusted to set a level every caller shares).",
        |m| m.levels_private,
    ),
    (
        "lbagent_balance_units_client_limited_total",
        Counter,
        "getHosts of balance modules answered overloaded: the client already held lb.units_per_client units.",
        |m| m.units_client_limited,
    ),
    (
        "lbagent_balance_units_released_total",
        Counter,
        "Capacity units given back because the client that held them is gone (its local connection closed).",
        |m| m.units_released,
    ),
    (
        "lbagent_local_connections_refused_total",
        Counter,
        "Local-socket connections refused (the shard held its most, or the kernel gave no credentials).",
        |m| m.local_refused,
    ),
    (
        "lbagent_downstream_levels_reported_total",
        Counter,
        "Reports that carried a downstream admission level.",
        |m| m.levels_reported,
    ),
    (
        "lbagent_route_updates_total",
        Counter,
        "Route updates applied by the shard.",
        |m| m.route_updates,
    ),
    (
        "lbagent_ring_drops_total",
        Counter,
        "Messages to the control core dropped on a full ring.",
        |m| m.ring_drops,
    ),
    (
        "lbagent_module_limit_hits_total",
        Counter,
        "Unknown modules refused at the per-shard module limit (agent.max_modules).",
        |m| m.module_limit_hits,
    ),
    (
        "lbagent_unknown_modules_refused_total",
        Counter,
        "Requests for unknown modules refused: the shard already remembers agent.max_unknown_modules.",
        |m| m.unknown_refused,
    ),
    (
        "lbagent_registers_refused_total",
        Counter,
        "Register requests refused: too many already wait for a route.",
        |m| m.registers_refused,
    ),
    (
        "lbagent_modules_expired_total",
        Counter,
        "Modules forgotten after agent.module_idle_timeout unused, or agent.unknown_module_ttl_ms unknown.",
        |m| m.modules_expired,
    ),
    (
        "lbagent_stats_kept_total",
        Counter,
        "Statistics messages the full ring refused, kept in the shard and sent later.",
        |m| m.stats_kept,
    ),
    (
        "lbagent_unheld_routes_total",
        Counter,
        "Routes for modules the shard did not hold (the snapshot at start, or expired meanwhile).",
        |m| m.unheld_routes,
    ),
    (
        "lbagent_send_errors_total",
        Counter,
        "Answers that could not be sent.",
        |m| m.send_errors,
    ),
    (
        "lbagent_udp_receive_drops_total",
        Counter,
        "Requests the kernel dropped on the shard's socket, its receive buffer full (counted with admission.agent_shedding only).",
        |m| m.kernel_drops,
    ),
    (
        "lbagent_transitions_to_overloaded_total",
        Counter,
        "Nodes that became overloaded.",
        |m| m.to_overloaded,
    ),
    (
        "lbagent_transitions_to_idle_total",
        Counter,
        "Nodes that became idle.",
        |m| m.to_idle,
    ),
    ("lbagent_modules", Gauge, "Modules with a route.", |m| {
        m.modules
    }),
    (
        "lbagent_local_connections",
        Gauge,
        "Open local-socket connections.",
        |m| m.local_connections,
    ),
    ("lbagent_nodes_idle", Gauge, "Idle nodes.", |m| {
        m.nodes_idle
    }),
    (
        "lbagent_nodes_overloaded",
        Gauge,
        "Overloaded nodes.",
        |m| m.nodes_overloaded,
    ),
    (
        "lbagent_nodes_levelled",
        Gauge,
        "Nodes with a downstream admission level held (DAGOR).",
        |m| m.nodes_levelled,
    ),
    (
        "lbagent_unknown_modules",
        Gauge,
        "Unknown modules remembered (asked for, absent or unanswered).",
        |m| m.unknown_modules,
    ),
    (
        "lbagent_waiting_registers",
        Gauge,
        "Register requests waiting for a route.",
        |m| m.waiting_registers,
    ),
];

/// The control core's counters, in exposition order (after the connection
/// gauges and the heartbeat age).
const CONTROL_FIGURES: [Figure<ControlMetrics>; 9] = [
    (
        "lbagent_pulls_sent_total",
        Counter,
        "Route pulls sent to the route server.",
        |c| c.pulls_sent,
    ),
    (
        "lbagent_routes_received_total",
        Counter,
        "Routes received (answers and pushes).",
        |c| c.routes_received,
    ),
    (
        "lbagent_stats_sent_total",
        Counter,
        "Statistics batches accepted by the reporter.",
        |c| c.stats_sent,
    ),
    (
        "lbagent_stats_dropped_total",
        Counter,
        "Statistics dropped past the buffer bound.",
        |c| c.stats_dropped,
    ),
    (
        "lbagent_control_ring_drops_total",
        Counter,
        "Messages to shards dropped on a full ring.",
        |c| c.ring_drops,
    ),
    (
        "lbagent_snapshots_written_total",
        Counter,
        "Route snapshots written.",
        |c| c.snapshots_written,
    ),
    (
        "lbagent_snapshot_errors_total",
        Counter,
        "Route snapshot writes that failed.",
        |c| c.snapshot_errors,
    ),
    (
        "lbagent_snapshots_skipped_total",
        Counter,
        "Snapshots skipped: the previous write was still running (slow disk).",
        |c| c.snapshots_skipped,
    ),
    (
        "lbagent_modules_forgotten_total",
        Counter,
        "Modules expired by the shards, dropped from the control core and unsubscribed.",
        |c| c.modules_forgotten,
    ),
];

/// Renders every figure in the Prometheus text format (version 0.0.4).
pub fn render(shards: &[ShardMetrics], control: &ControlMetrics) -> String {
    let mut out = String::with_capacity(16384);
    let scrape = Scrape {
        shards: shards.to_vec(),
        control: control.clone(),
    };
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    encode_registry(&mut out, &registry).expect("a String takes every write");
    render_service_time(&mut out, shards);
    out
}

/// What one scrape writes: a copy of the figures (prometheus-client's
/// collectors own what they encode).
#[derive(Debug)]
struct Scrape {
    shards: Vec<ShardMetrics>,
    control: ControlMetrics,
}

/// The `shard` label of `m`'s series.
fn shard(m: &ShardMetrics) -> [(&'static str, u32); 1] {
    [("shard", m.shard)]
}

/// The `outcome` label of getHosts by priority class.
const OUTCOMES: [&str; 3] = ["admitted", "rejected_self", "rejected_downstream"];

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let shards = &self.shards;
        let by_kind = |get: fn(&ShardMetrics) -> &[u64; 6]| {
            shards.iter().flat_map(move |s| {
                Kind::ALL.map(|k| ((shard(s), [("kind", k.label())]), get(s)[k as usize]))
            })
        };
        let help = "Requests received, by kind and shard.";
        family(
            &mut e,
            "lbagent_requests_total",
            Counter,
            help,
            by_kind(|s| &s.requests),
        )?;
        let help = "Requests answered with an error or dropped, by kind and shard.";
        family(
            &mut e,
            "lbagent_errors_total",
            Counter,
            help,
            by_kind(|s| &s.errors),
        )?;
        let malformed = shards.iter().flat_map(|s| {
            let reasons = MALFORMED_REASONS.iter().zip(s.malformed);
            reasons.map(|(r, n)| ((shard(s), [("reason", *r)]), n))
        });
        let help = "Datagrams dropped because they did not decode, by reason.";
        family(
            &mut e,
            "lbagent_malformed_datagrams_total",
            Counter,
            help,
            malformed,
        )?;
        for (name, ty, help, get) in SHARD_FIGURES {
            let series = shards.iter().map(|s| (shard(s), get(s)));
            family(&mut e, name, ty, help, series)?;
        }
        encode_admission(&mut e, shards)?;
        encode_queuing(&mut e, shards)?;
        encode_control(&mut e, &self.control)
    }
}

/// The DAGOR figures: each shard's own level, the modules' downstream
/// levels and getHosts by priority class and outcome.
fn encode_admission(e: &mut DescriptorEncoder, shards: &[ShardMetrics]) -> fmt::Result {
    let parts = |l: &AdmissionLevel| [("business", l.business.into()), ("user", l.user.into())];
    let own = shards
        .iter()
        .flat_map(|s| parts(&s.self_level).map(|(part, v)| ((shard(s), [("part", part)]), v)));
    let help = "The shard's own admission level (B*, U*): 128,128 admits every getHost.";
    family(e, "lbagent_admission_level", Gauge, help, own)?;
    let modules = shards.iter().flat_map(|s| {
        s.module_levels.iter().flat_map(move |(module, level)| {
            let ids = [("modid", module.modid), ("cmdid", module.cmdid)];
            parts(level).map(move |(part, v)| ((shard(s), (ids, [("part", part)])), v))
        })
    });
    let help = "Per module with downstream levels (DAGOR, reported by callers): the most \
                permissive node level; at most 64 modules per shard.";
    family(e, "lbagent_module_admission_level", Gauge, help, modules)?;
    let outcomes = shards.iter().flat_map(|s| {
        CLASS_LABELS.iter().enumerate().flat_map(move |(c, class)| {
            let counts = [s.admitted[c], s.self_rejected[c], s.downstream_rejected[c]];
            let labels = |o| (shard(s), ([("class", *class)], [("outcome", o)]));
            OUTCOMES
                .iter()
                .zip(counts)
                .map(move |(o, n)| (labels(*o), n))
        })
    });
    let help = "getHosts by business-priority class and outcome: admitted, rejected_self (the \
                shard's own level), rejected_downstream (the nodes' levels).";
    family(e, "lbagent_gethost_priority_total", Counter, help, outcomes)
}

/// The queuing-time histograms: every datagram's, and getHosts' by
/// priority class (classes seen only: the figure DAGOR protects is the
/// important classes' wait).
fn encode_queuing(e: &mut DescriptorEncoder, shards: &[ShardMetrics]) -> fmt::Result {
    let help = "Datagrams by queuing time in the shard's socket: kernel receive timestamp to \
                handling.";
    let mut m =
        e.encode_descriptor("lbagent_queuing_seconds", help, None, MetricType::Histogram)?;
    for s in shards {
        let labels = shard(s);
        histogram(
            &mut m.encode_family(&labels)?,
            &s.queuing_buckets,
            s.queuing_sum_us,
        )?;
    }
    let help = "getHosts by business-priority class and queuing time in the shard's socket \
                (kernel receive timestamp to handling).";
    let name = "lbagent_gethost_queuing_seconds";
    let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for s in shards {
        for (c, class) in CLASS_LABELS.iter().enumerate() {
            let counts = &s.gethost_queuing[c];
            if counts.iter().any(|&n| n > 0) {
                let labels = (shard(s), [("class", *class)]);
                let sum = s.gethost_queuing_sum_us[c];
                histogram(&mut m.encode_family(&labels)?, counts, sum)?;
            }
        }
    }
    Ok(())
}

/// One queuing-time histogram: `counts` per bucket of
/// [`QUEUING_BUCKETS_US`] then +Inf, and their sum in µs.
fn histogram(m: &mut MetricEncoder, counts: &[u64], sum_us: u64) -> fmt::Result {
    let bounds = QUEUING_BUCKETS_US.iter().map(|&us| us as f64 / 1e6);
    let buckets: Vec<(f64, u64)> = bounds
        .chain([f64::MAX]) // prometheus-client's +Inf
        .zip(counts.iter().copied())
        .collect();
    let count = counts.iter().sum();
    m.encode_histogram::<NoLabelSet>(sum_us as f64 / 1e6, count, &buckets, None)
}

/// The control core's figures: the connections, the heartbeat's age and
/// its counters.
fn encode_control(e: &mut DescriptorEncoder, c: &ControlMetrics) -> fmt::Result {
    for (name, help, peer) in [
        (
            "lbagent_route_server_connected",
            "1 when connected to a route server (label: its address).",
            &c.route_server,
        ),
        (
            "lbagent_reporter_connected",
            "1 when connected to a reporter (label: its address).",
            &c.reporter,
        ),
    ] {
        let addr = [("addr", Escaped(peer.as_deref().unwrap_or("")))];
        family(e, name, Gauge, help, [(addr, u64::from(peer.is_some()))])?;
    }
    let help = "Seconds since the heartbeat was last written.";
    e.encode_descriptor("lbagent_heartbeat_age_seconds", help, None, Gauge)?
        .encode_gauge(&c.heartbeat_age_s)?;
    figures(e, &CONTROL_FIGURES, c)
}

/// A label value escaped as the text format requires (prometheus-client
/// writes values as they are): backslash, double quote and newline.
#[derive(Debug)]
struct Escaped<'a>(&'a str);

impl EncodeLabelValue for Escaped<'_> {
    fn encode(&self, e: &mut LabelValueEncoder) -> fmt::Result {
        for c in self.0.chars() {
            match c {
                '\\' => e.write_str("\\\\")?,
                '"' => e.write_str("\\\"")?,
                '\n' => e.write_str("\\n")?,
                c => e.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// The getHost service-time summary (quantiles of each shard's HDR
/// histogram), written by hand: prometheus-client has no summary type.
fn render_service_time(o: &mut String, shards: &[ShardMetrics]) {
    let name = "lbagent_gethost_service_seconds";
    let help = "getHost service time in the shard, decode to encoded answer: a sample, \
                over UDP the first getHost of each batch of datagrams, over shared memory one \
                every few sweeps.";
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} summary");
    for m in shards {
        let (s, h) = (m.shard, &m.gethost_ns);
        for q in [0.5, 0.9, 0.99, 0.999] {
            let v = h.value_at_quantile(q) as f64 / 1e9;
            let _ = writeln!(o, "{name}{{shard=\"{s}\",quantile=\"{q}\"}} {v}");
        }
        let sum = h.mean() * h.len() as f64 / 1e9;
        let _ = writeln!(o, "{name}_sum{{shard=\"{s}\"}} {sum}");
        let _ = writeln!(o, "{name}_count{{shard=\"{s}\"}} {}", h.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_figures_render_by_class_and_bucket() {
        let mut m = ShardMetrics::new(0);
        m.self_level = AdmissionLevel::new(20, 7);
        m.admitted[priority_class(5)] += 2;
        m.self_rejected[priority_class(0)] += 1;
        m.downstream_rejected[priority_class(1)] += 3;
        m.module_levels.push((
            lbagent_model::ModuleId::new(7, 9),
            AdmissionLevel::new(10, 128),
        ));
        for us in [5, 10, 11, 3_000, 1_000_000] {
            m.record_queuing_us(us);
        }
        let b = m.record_queuing_us(400);
        m.record_gethost_queuing(priority_class(5), b, 400);
        let text = render(&[m], &ControlMetrics::default());
        // prometheus-client writes a bucket's `le` before the series' labels.
        for want in [
            "lbagent_admission_level{shard=\"0\",part=\"business\"} 20\n",
            "lbagent_admission_level{shard=\"0\",part=\"user\"} 7\n",
            "lbagent_module_admission_level{shard=\"0\",modid=\"7\",cmdid=\"9\",part=\"business\"} 10\n",
            "lbagent_gethost_priority_total{shard=\"0\",class=\"4-7\",outcome=\"admitted\"} 2\n",
            "lbagent_gethost_priority_total{shard=\"0\",class=\"128\",outcome=\"rejected_self\"} 1\n",
            "lbagent_gethost_priority_total{shard=\"0\",class=\"1\",outcome=\"rejected_downstream\"} 3\n",
            "lbagent_queuing_seconds_bucket{le=\"0.00001\",shard=\"0\"} 2\n",
            "lbagent_gethost_queuing_seconds_bucket{le=\"0.00025\",shard=\"0\",class=\"4-7\"} 0\n",
            "lbagent_gethost_queuing_seconds_bucket{le=\"0.0005\",shard=\"0\",class=\"4-7\"} 1\n",
            "lbagent_gethost_queuing_seconds_sum{shard=\"0\",class=\"4-7\"} 0.0004\n",
            "lbagent_gethost_queuing_seconds_count{shard=\"0\",class=\"4-7\"} 1\n",
            "lbagent_queuing_seconds_bucket{le=\"0.000025\",shard=\"0\"} 3\n",
            "lbagent_queuing_seconds_bucket{le=\"0.005\",shard=\"0\"} 5\n",
            "lbagent_queuing_seconds_bucket{le=\"+Inf\",shard=\"0\"} 6\n",
            "lbagent_queuing_seconds_count{shard=\"0\"} 6\n",
            "lbagent_queuing_seconds_sum{shard=\"0\"} 1.003426\n",
        ] {
            assert!(text.contains(want), "missing {want}");
        }
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("lbagent_gethost_queuing") && l.contains("class=\"1\"")),
            "a class without getHosts has no series"
        );
    }

    #[test]
    fn priority_classes_are_powers_of_two() {
        let got: Vec<usize> = [1u8, 2, 3, 4, 7, 8, 64, 127, 128, 0, 200]
            .iter()
            .map(|&b| priority_class(b))
            .collect();
        assert_eq!(got, [0, 1, 1, 2, 2, 3, 6, 6, 7, 7, 7]);
    }

    #[test]
    fn renders_every_family_with_help_and_type() {
        let mut m = ShardMetrics::new(1);
        m.count_request(Kind::GetHost);
        m.record_gethost_ns(1500);
        let control = ControlMetrics {
            route_server: Some("127.0.0.1:7777".into()),
            ..Default::default()
        };
        let text = render(&[ShardMetrics::new(0), m], &control);
        assert!(text.contains("lbagent_requests_total{shard=\"1\",kind=\"gethost\"} 1\n"));
        assert!(text.contains("lbagent_route_server_connected{addr=\"127.0.0.1:7777\"} 1\n"));
        assert!(text.contains("lbagent_gethost_service_seconds_count{shard=\"1\"} 1\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let base = name
                .trim_end_matches("_sum")
                .trim_end_matches("_count")
                .trim_end_matches("_bucket");
            assert!(
                text.contains(&format!("# TYPE {base} ")),
                "{name} has no TYPE line"
            );
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let control = ControlMetrics {
            reporter: Some("a\"b\\c".into()),
            ..Default::default()
        };
        assert!(render(&[], &control).contains("addr=\"a\\\"b\\\\c\""));
    }
}
