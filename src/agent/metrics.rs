//! Counters and the getHost service-time histogram of one shard, and the
//! Prometheus text rendering of every shard's and the control core's
//! figures. Counting is plain field increments on the shard's own struct;
//! the shell ships a copy to the control core once a second.

use std::fmt::Write;

use hdrhistogram::Histogram;

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
            rejected: 0,
            levels_reported: 0,
            units_timed_out: 0,
            consumed_ignored: 0,
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

/// A per-shard figure: name, type, help, and how to read it.
type Figure = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ShardMetrics) -> u64,
);

/// Renders every figure in the Prometheus text format (version 0.0.4).
pub fn render(shards: &[ShardMetrics], control: &ControlMetrics) -> String {
    let mut out = String::with_capacity(8192);
    let o = &mut out;
    family(
        o,
        "lbagent_requests_total",
        "counter",
        "Requests received, by kind and shard.",
    );
    for m in shards {
        for k in Kind::ALL {
            sample(
                o,
                "lbagent_requests_total",
                &[("shard", &m.shard.to_string()), ("kind", k.label())],
                m.requests[k as usize] as f64,
            );
        }
    }
    family(
        o,
        "lbagent_errors_total",
        "counter",
        "Requests answered with an error or dropped, by kind and shard.",
    );
    for m in shards {
        for k in Kind::ALL {
            sample(
                o,
                "lbagent_errors_total",
                &[("shard", &m.shard.to_string()), ("kind", k.label())],
                m.errors[k as usize] as f64,
            );
        }
    }
    family(
        o,
        "lbagent_malformed_datagrams_total",
        "counter",
        "Datagrams dropped because they did not decode, by reason.",
    );
    for m in shards {
        for (i, r) in MALFORMED_REASONS.iter().enumerate() {
            sample(
                o,
                "lbagent_malformed_datagrams_total",
                &[("shard", &m.shard.to_string()), ("reason", r)],
                m.malformed[i] as f64,
            );
        }
    }
    let per_shard: [Figure; 32] = [
        (
            "lbagent_shm_requests_total",
            "counter",
            "Requests taken from the shard's shared-memory slots.",
            |m| m.shm.requests,
        ),
        (
            "lbagent_shm_garbage_total",
            "counter",
            "Shared-memory requests refused because their slot held garbage (a length out of range).",
            |m| m.shm.garbage,
        ),
        (
            "lbagent_shm_reclaimed_total",
            "counter",
            "Shared-memory slots taken back from dead clients.",
            |m| m.shm.reclaimed,
        ),
        (
            "lbagent_shm_wakes_total",
            "counter",
            "Shared-memory clients woken by a futex (they slept waiting for their answer).",
            |m| m.shm.wakes,
        ),
        (
            "lbagent_unexpected_messages_total",
            "counter",
            "Well-formed messages that have no business on a shard.",
            |m| m.unexpected,
        ),
        (
            "lbagent_invalid_requests_total",
            "counter",
            "Requests whose fields failed validation.",
            |m| m.invalid,
        ),
        (
            "lbagent_wrong_shard_total",
            "counter",
            "Requests for modules another shard owns.",
            |m| m.wrong_shard,
        ),
        (
            "lbagent_unknown_module_reports_total",
            "counter",
            "Reports for modules without a route.",
            |m| m.unknown_module_reports,
        ),
        (
            "lbagent_unknown_node_reports_total",
            "counter",
            "Reports for nodes not in the route.",
            |m| m.unknown_node_reports,
        ),
        (
            "lbagent_probes_total",
            "counter",
            "getHosts answered by probing an overloaded node.",
            |m| m.probes,
        ),
        (
            "lbagent_gethost_rejected_total",
            "counter",
            "getHosts answered Rejected by the downstream admission levels (DAGOR).",
            |m| m.rejected,
        ),
        (
            "lbagent_balance_units_timed_out_total",
            "counter",
            "Capacity units of balance modules not reported back within lb.unit_timeout, returned by their time-out.",
            |m| m.units_timed_out,
        ),
        (
            "lbagent_consumed_ignored_total",
            "counter",
            "Reports saying they consumed capacity units, for a module whose policy is not balance (ignored).",
            |m| m.consumed_ignored,
        ),
        (
            "lbagent_downstream_levels_reported_total",
            "counter",
            "Reports that carried a downstream admission level.",
            |m| m.levels_reported,
        ),
        (
            "lbagent_route_updates_total",
            "counter",
            "Route updates applied by the shard.",
            |m| m.route_updates,
        ),
        (
            "lbagent_ring_drops_total",
            "counter",
            "Messages to the control core dropped on a full ring.",
            |m| m.ring_drops,
        ),
        (
            "lbagent_module_limit_hits_total",
            "counter",
            "Unknown modules refused at the per-shard module limit (agent.max_modules).",
            |m| m.module_limit_hits,
        ),
        (
            "lbagent_unknown_modules_refused_total",
            "counter",
            "Requests for unknown modules refused: the shard already remembers agent.max_unknown_modules.",
            |m| m.unknown_refused,
        ),
        (
            "lbagent_registers_refused_total",
            "counter",
            "Register requests refused: too many already wait for a route.",
            |m| m.registers_refused,
        ),
        (
            "lbagent_modules_expired_total",
            "counter",
            "Modules forgotten after agent.module_idle_timeout unused, or agent.unknown_module_ttl_ms unknown.",
            |m| m.modules_expired,
        ),
        (
            "lbagent_stats_kept_total",
            "counter",
            "Statistics messages the full ring refused, kept in the shard and sent later.",
            |m| m.stats_kept,
        ),
        (
            "lbagent_unheld_routes_total",
            "counter",
            "Routes for modules the shard did not hold (the snapshot at start, or expired meanwhile).",
            |m| m.unheld_routes,
        ),
        (
            "lbagent_send_errors_total",
            "counter",
            "Answers that could not be sent.",
            |m| m.send_errors,
        ),
        (
            "lbagent_udp_receive_drops_total",
            "counter",
            "Requests the kernel dropped on the shard's socket, its receive buffer full (counted with admission.agent_shedding only).",
            |m| m.kernel_drops,
        ),
        (
            "lbagent_transitions_to_overloaded_total",
            "counter",
            "Nodes that became overloaded.",
            |m| m.to_overloaded,
        ),
        (
            "lbagent_transitions_to_idle_total",
            "counter",
            "Nodes that became idle.",
            |m| m.to_idle,
        ),
        ("lbagent_modules", "gauge", "Modules with a route.", |m| {
            m.modules
        }),
        ("lbagent_nodes_idle", "gauge", "Idle nodes.", |m| {
            m.nodes_idle
        }),
        (
            "lbagent_nodes_overloaded",
            "gauge",
            "Overloaded nodes.",
            |m| m.nodes_overloaded,
        ),
        (
            "lbagent_nodes_levelled",
            "gauge",
            "Nodes with a downstream admission level held (DAGOR).",
            |m| m.nodes_levelled,
        ),
        (
            "lbagent_unknown_modules",
            "gauge",
            "Unknown modules remembered (asked for, absent or unanswered).",
            |m| m.unknown_modules,
        ),
        (
            "lbagent_waiting_registers",
            "gauge",
            "Register requests waiting for a route.",
            |m| m.waiting_registers,
        ),
    ];
    for (name, kind, help, get) in per_shard {
        family(o, name, kind, help);
        for m in shards {
            sample(o, name, &[("shard", &m.shard.to_string())], get(m) as f64);
        }
    }
    family(
        o,
        "lbagent_gethost_service_seconds",
        "summary",
        "getHost service time in the shard, decode to encoded answer.",
    );
    for m in shards {
        let s = m.shard.to_string();
        for q in [0.5, 0.9, 0.99, 0.999] {
            let v = m.gethost_ns.value_at_quantile(q) as f64 / 1e9;
            sample(
                o,
                "lbagent_gethost_service_seconds",
                &[("shard", &s), ("quantile", &q.to_string())],
                v,
            );
        }
        let sum = m.gethost_ns.mean() * m.gethost_ns.len() as f64 / 1e9;
        sample(
            o,
            "lbagent_gethost_service_seconds_sum",
            &[("shard", &s)],
            sum,
        );
        sample(
            o,
            "lbagent_gethost_service_seconds_count",
            &[("shard", &s)],
            m.gethost_ns.len() as f64,
        );
    }
    render_admission(o, shards);
    render_gethost_queuing(o, shards);
    let c = control;
    family(
        o,
        "lbagent_route_server_connected",
        "gauge",
        "1 when connected to a route server (label: its address).",
    );
    sample(
        o,
        "lbagent_route_server_connected",
        &[("addr", c.route_server.as_deref().unwrap_or(""))],
        c.route_server.is_some() as u8 as f64,
    );
    family(
        o,
        "lbagent_reporter_connected",
        "gauge",
        "1 when connected to a reporter (label: its address).",
    );
    sample(
        o,
        "lbagent_reporter_connected",
        &[("addr", c.reporter.as_deref().unwrap_or(""))],
        c.reporter.is_some() as u8 as f64,
    );
    let control_figs: [(&str, &str, &str, f64); 10] = [
        (
            "lbagent_pulls_sent_total",
            "counter",
            "Route pulls sent to the route server.",
            c.pulls_sent as f64,
        ),
        (
            "lbagent_routes_received_total",
            "counter",
            "Routes received (answers and pushes).",
            c.routes_received as f64,
        ),
        (
            "lbagent_stats_sent_total",
            "counter",
            "Statistics batches accepted by the reporter.",
            c.stats_sent as f64,
        ),
        (
            "lbagent_stats_dropped_total",
            "counter",
            "Statistics dropped past the buffer bound.",
            c.stats_dropped as f64,
        ),
        (
            "lbagent_control_ring_drops_total",
            "counter",
            "Messages to shards dropped on a full ring.",
            c.ring_drops as f64,
        ),
        (
            "lbagent_heartbeat_age_seconds",
            "gauge",
            "Seconds since the heartbeat was last written.",
            c.heartbeat_age_s,
        ),
        (
            "lbagent_snapshots_written_total",
            "counter",
            "Route snapshots written.",
            c.snapshots_written as f64,
        ),
        (
            "lbagent_snapshot_errors_total",
            "counter",
            "Route snapshot writes that failed.",
            c.snapshot_errors as f64,
        ),
        (
            "lbagent_snapshots_skipped_total",
            "counter",
            "Snapshots skipped: the previous write was still running (slow disk).",
            c.snapshots_skipped as f64,
        ),
        (
            "lbagent_modules_forgotten_total",
            "counter",
            "Modules expired by the shards, dropped from the control core and unsubscribed.",
            c.modules_forgotten as f64,
        ),
    ];
    for (name, kind, help, v) in control_figs {
        family(o, name, kind, help);
        sample(o, name, &[], v);
    }
    out
}

/// The DAGOR figures: each shard's own level, getHosts by priority class
/// and outcome, and the queuing-time histogram.
fn render_admission(o: &mut String, shards: &[ShardMetrics]) {
    family(
        o,
        "lbagent_admission_level",
        "gauge",
        "The shard's own admission level (B*, U*): 128,128 admits every getHost.",
    );
    for m in shards {
        let s = m.shard.to_string();
        for (part, v) in [
            ("business", m.self_level.business),
            ("user", m.self_level.user),
        ] {
            sample(
                o,
                "lbagent_admission_level",
                &[("shard", &s), ("part", part)],
                f64::from(v),
            );
        }
    }
    family(
        o,
        "lbagent_module_admission_level",
        "gauge",
        "Per module with downstream levels (DAGOR, reported by callers): the most permissive node level; at most 64 modules per shard.",
    );
    for m in shards {
        let s = m.shard.to_string();
        for (module, level) in &m.module_levels {
            let (modid, cmdid) = (module.modid.to_string(), module.cmdid.to_string());
            for (part, v) in [("business", level.business), ("user", level.user)] {
                sample(
                    o,
                    "lbagent_module_admission_level",
                    &[
                        ("shard", &s),
                        ("modid", &modid),
                        ("cmdid", &cmdid),
                        ("part", part),
                    ],
                    f64::from(v),
                );
            }
        }
    }
    family(
        o,
        "lbagent_gethost_priority_total",
        "counter",
        "getHosts by business-priority class and outcome: admitted, rejected_self (the shard's own level), rejected_downstream (the nodes' levels).",
    );
    for m in shards {
        let s = m.shard.to_string();
        for (c, class) in CLASS_LABELS.iter().enumerate() {
            for (outcome, v) in [
                ("admitted", m.admitted[c]),
                ("rejected_self", m.self_rejected[c]),
                ("rejected_downstream", m.downstream_rejected[c]),
            ] {
                sample(
                    o,
                    "lbagent_gethost_priority_total",
                    &[("shard", &s), ("class", class), ("outcome", outcome)],
                    v as f64,
                );
            }
        }
    }
    family(
        o,
        "lbagent_queuing_seconds",
        "histogram",
        "Datagrams by queuing time in the shard's socket: kernel receive timestamp to handling.",
    );
    for m in shards {
        let s = m.shard.to_string();
        let mut cumulative = 0u64;
        for (i, &n) in m.queuing_buckets.iter().enumerate() {
            cumulative += n;
            let le = QUEUING_BUCKETS_US
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |&us| (us as f64 / 1e6).to_string());
            sample(
                o,
                "lbagent_queuing_seconds_bucket",
                &[("shard", &s), ("le", &le)],
                cumulative as f64,
            );
        }
        sample(
            o,
            "lbagent_queuing_seconds_sum",
            &[("shard", &s)],
            m.queuing_sum_us as f64 / 1e6,
        );
        sample(
            o,
            "lbagent_queuing_seconds_count",
            &[("shard", &s)],
            cumulative as f64,
        );
    }
}

/// getHosts' queuing time by priority class (classes seen only): the
/// figure DAGOR protects is the important classes' wait.
fn render_gethost_queuing(o: &mut String, shards: &[ShardMetrics]) {
    family(
        o,
        "lbagent_gethost_queuing_seconds",
        "histogram",
        "getHosts by business-priority class and queuing time in the shard's socket (kernel receive timestamp to handling).",
    );
    for m in shards {
        let s = m.shard.to_string();
        for (c, class) in CLASS_LABELS.iter().enumerate() {
            let counts = &m.gethost_queuing[c];
            if counts.iter().all(|&n| n == 0) {
                continue;
            }
            let mut cumulative = 0u64;
            for (i, &n) in counts.iter().enumerate() {
                cumulative += n;
                let le = QUEUING_BUCKETS_US
                    .get(i)
                    .map_or_else(|| "+Inf".to_string(), |&us| (us as f64 / 1e6).to_string());
                sample(
                    o,
                    "lbagent_gethost_queuing_seconds_bucket",
                    &[("shard", &s), ("class", class), ("le", &le)],
                    cumulative as f64,
                );
            }
            sample(
                o,
                "lbagent_gethost_queuing_seconds_sum",
                &[("shard", &s), ("class", class)],
                m.gethost_queuing_sum_us[c] as f64 / 1e6,
            );
            sample(
                o,
                "lbagent_gethost_queuing_seconds_count",
                &[("shard", &s), ("class", class)],
                cumulative as f64,
            );
        }
    }
}

fn family(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn sample(o: &mut String, name: &str, labels: &[(&str, &str)], v: f64) {
    o.push_str(name);
    if !labels.is_empty() {
        o.push('{');
        for (i, (k, val)) in labels.iter().enumerate() {
            if i > 0 {
                o.push(',');
            }
            let _ = write!(
                o,
                "{k}=\"{}\"",
                val.replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n")
            );
        }
        o.push('}');
    }
    let _ = writeln!(o, " {v}");
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
        for want in [
            "lbagent_admission_level{shard=\"0\",part=\"business\"} 20\n",
            "lbagent_admission_level{shard=\"0\",part=\"user\"} 7\n",
            "lbagent_module_admission_level{shard=\"0\",modid=\"7\",cmdid=\"9\",part=\"business\"} 10\n",
            "lbagent_gethost_priority_total{shard=\"0\",class=\"4-7\",outcome=\"admitted\"} 2\n",
            "lbagent_gethost_priority_total{shard=\"0\",class=\"128\",outcome=\"rejected_self\"} 1\n",
            "lbagent_gethost_priority_total{shard=\"0\",class=\"1\",outcome=\"rejected_downstream\"} 3\n",
            "lbagent_queuing_seconds_bucket{shard=\"0\",le=\"0.00001\"} 2\n",
            "lbagent_gethost_queuing_seconds_bucket{shard=\"0\",class=\"4-7\",le=\"0.00025\"} 0\n",
            "lbagent_gethost_queuing_seconds_bucket{shard=\"0\",class=\"4-7\",le=\"0.0005\"} 1\n",
            "lbagent_gethost_queuing_seconds_sum{shard=\"0\",class=\"4-7\"} 0.0004\n",
            "lbagent_gethost_queuing_seconds_count{shard=\"0\",class=\"4-7\"} 1\n",
            "lbagent_queuing_seconds_bucket{shard=\"0\",le=\"0.000025\"} 3\n",
            "lbagent_queuing_seconds_bucket{shard=\"0\",le=\"0.005\"} 5\n",
            "lbagent_queuing_seconds_bucket{shard=\"0\",le=\"+Inf\"} 6\n",
            "lbagent_queuing_seconds_count{shard=\"0\"} 6\n",
            "lbagent_queuing_seconds_sum{shard=\"0\"} 1.003426\n",
        ] {
            assert!(text.contains(want), "missing {want}");
        }
        assert!(
            !text.contains("lbagent_gethost_queuing_seconds_bucket{shard=\"0\",class=\"1\""),
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
