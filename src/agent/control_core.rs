//! The control core's decisions, sans-IO: what to do on each event — a
//! message from a shard, a route client or statistics client event, a turn
//! of the main loop (heartbeat, snapshot, reload) — with the time passed
//! in. It keeps the control core's copy of the routes, the metrics the
//! shards sent, the routes waiting for room in a full ring, and when the
//! heartbeat and the snapshot are next due.
//!
//! It must not touch sockets, clocks, files or tasks: the shell
//! ([`super::control`]) gathers the events, reads the clock, and performs
//! what comes back (a pull for the route client, statistics for the
//! reporter, a heartbeat, a snapshot to write, a log line). The one thing
//! it hands on itself is a route for a shard, through [`ShardRings`], so
//! that a full ring's backlog keeps its order.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::live::LiveUpdate;
use super::messages::{ToControl, ToShard};
use super::metrics::{ControlMetrics, ShardMetrics};
use super::route_table::RouteTable;
use super::routeclient::{RouteClientEvent, Want};
use super::statsclient::StatsClientEvent;
use super::wake;
use lbagent_host::snapshot::{SnapshotIndex, SnapshotRoute};
use lbagent_lb::NodeCallStats;
use lbagent_model::ModuleId;
use lbagent_service::logging::{self, Gate, Verdict};

/// How often a link that stays down (connection attempts failing) is
/// logged again, with the count of the attempts in between, ms.
pub const RELOG_MS: u64 = 60_000;

/// How often the main loop looks whether every shard is ready while they
/// start (the first heartbeat waits for them).
pub const STARTING_POLL: Duration = Duration::from_millis(5);

/// Between two heartbeats.
pub const BEAT_EVERY: Duration = Duration::from_secs(1);

/// Nodes of snapshot routes the control core takes into its table per
/// turn of the fill task (well under a millisecond of work, whatever the
/// routes' size).
pub const FILL_NODES: usize = 32_768;

/// The control → shard rings, as the core sees them: a send that does not
/// wait. The shell implements it over glommio's connected senders; tests
/// over queues with a capacity.
pub trait ShardRings {
    /// Hands `msg` to shard `shard`'s ring now, or gives it back: `Full`
    /// when the ring has no room, `Closed` when the shard is gone.
    fn try_send(&self, shard: usize, msg: ToShard) -> Result<(), Refused>;
}

/// Why a ring did not take a message.
#[derive(Debug)]
pub enum Refused {
    /// No room now: the message comes back, to be sent later.
    Full(ToShard),
    /// The shard is gone: the message is lost.
    Closed,
}

/// Where a shard's message goes, as [`ControlCore::shard_message`] decided.
#[derive(Debug, PartialEq)]
pub enum Forward {
    /// To the route client (a pull, or a forget after the shard forgot).
    Want(Want),
    /// To the statistics client.
    Stats(ModuleId, Vec<NodeCallStats>),
    /// A shard stopped and said so: wake the main loop.
    Drained,
    /// A line for the log (a module's panic began or ended).
    Log(Log),
}

/// A line for the log, decided by the core (the shell writes it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Log {
    /// At info level.
    Info(String),
    /// At warn level.
    Warn(String),
}

/// What a turn of the main loop asks the shell to do
/// ([`ControlCore::turn`]).
#[derive(Debug, Default)]
pub struct TurnActions {
    /// Write a heartbeat now.
    pub beat: bool,
    /// Offer these routes to the snapshot thread; when it refuses (still
    /// writing the last), tell [`ControlCore::snapshot_skipped`].
    pub snapshot: Option<Vec<SnapshotRoute>>,
    /// A reload's route server list, for the route client.
    pub route_servers: Option<Vec<SocketAddr>>,
    /// A reload's re-pull period, ms, for the route client.
    pub refresh_ms: Option<u64>,
    /// A reload's reporter list, for the statistics client.
    pub reporters: Option<Vec<SocketAddr>>,
    /// A backlog began: wake the task that retries it.
    pub retry: bool,
}

/// What the core needs from the shell when it starts serving
/// ([`ControlCore::start_serving`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Serving {
    /// Start the task that fills the table from the snapshot
    /// ([`ControlCore::fill_step`]).
    pub fill: bool,
}

/// The links' figures for the metrics page, read by the shell from the
/// clients' statuses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Links {
    /// The connected route server, if any.
    pub route_server: Option<SocketAddr>,
    /// Modules pulled from the route server.
    pub pulls_sent: u64,
    /// The connected reporter, if any.
    pub reporter: Option<SocketAddr>,
    /// Statistics the reporter acknowledged.
    pub stats_sent: u64,
    /// Statistics dropped past the buffer bound.
    pub stats_dropped: u64,
}

/// The control core's state and decisions.
pub struct ControlCore {
    shards: u32,
    routes: RouteTable,
    shard_metrics: Vec<ShardMetrics>,
    control: ControlMetrics,
    /// Route messages waiting for room in a shard's ring, per shard.
    backlog: Vec<VecDeque<ToShard>>,
    /// Every shard is ready: clients may come, heartbeats are written.
    serving: bool,
    last_beat: Instant,
    last_snapshot: Instant,
    snapshot_interval: Duration,
    /// The main loop's longest sleep while serving.
    idle_tick: Duration,
    /// Shards that stopped and handed over what they held.
    drained: u32,
    /// The route server link's state changes, gated (see [`RELOG_MS`]).
    route_link: Gate<bool>,
    /// The reporter link's state changes, gated.
    stats_link: Gate<bool>,
    /// The reporter's drops and refusals, gated.
    stats_trouble: Gate<bool>,
}

impl ControlCore {
    /// A core for `shards` shards at `now`, its table made from the
    /// snapshot the agent started from (taken in slices once serving, see
    /// [`ControlCore::fill_step`]). `idle_tick`: the main loop's longest
    /// sleep.
    pub fn new(
        shards: u32,
        snapshot: Option<Arc<SnapshotIndex>>,
        snapshot_interval: Duration,
        idle_tick: Duration,
        now: Instant,
    ) -> Self {
        ControlCore {
            shards,
            routes: snapshot.map_or_else(RouteTable::new, RouteTable::from_snapshot),
            shard_metrics: (0..shards).map(ShardMetrics::new).collect(),
            control: ControlMetrics::default(),
            backlog: (0..shards).map(|_| VecDeque::new()).collect(),
            serving: false,
            last_beat: now,
            last_snapshot: now,
            snapshot_interval,
            idle_tick,
            drained: 0,
            route_link: Gate::new(RELOG_MS),
            stats_link: Gate::new(RELOG_MS),
            stats_trouble: Gate::new(RELOG_MS),
        }
    }

    // === events from the shards ===

    /// A message from a shard: where it goes on. A forget also drops the
    /// core's copy of the route; a drained shard is counted.
    pub fn shard_message(&mut self, msg: ToControl) -> Forward {
        match msg {
            ToControl::Pull(m) => Forward::Want(Want::Pull(m)),
            ToControl::Forget(m) => {
                self.routes.forget(m);
                self.control.modules_forgotten += 1;
                Forward::Want(Want::Forget(m))
            }
            ToControl::Stats { module, nodes } => Forward::Stats(module, nodes),
            ToControl::Drained => {
                self.drained += 1;
                Forward::Drained
            }
            ToControl::Panic {
                module,
                began,
                idle,
                nodes,
            } => Forward::Log(if began {
                Log::Warn(format!(
                    "module {module} in panic: {idle} of {nodes} nodes idle, below its \
                     panic_percent; getHost answers round robin over every node until \
                     enough recover"
                ))
            } else {
                Log::Info(format!(
                    "module {module} out of panic: {idle} of {nodes} nodes idle"
                ))
            }),
        }
    }

    /// A shard's metrics, replacing its last copy (one from an unknown
    /// shard is ignored).
    pub fn shard_metrics_in(&mut self, m: ShardMetrics) {
        let i = m.shard as usize;
        if i < self.shard_metrics.len() {
            self.shard_metrics[i] = m;
        }
    }

    /// How many shards said they stopped.
    pub fn drained(&self) -> u32 {
        self.drained
    }

    // === events from the clients ===

    /// A route client event at `now_ms` (monotonic milliseconds, for the
    /// log gate): a route goes into the table and to its shard's ring (or
    /// its backlog); the rest are log lines. Returns the line to log, and
    /// whether a backlog began (wake the retry task).
    pub fn route_event(
        &mut self,
        ev: RouteClientEvent,
        now_ms: u64,
        rings: &impl ShardRings,
    ) -> (Option<Log>, bool) {
        match ev {
            RouteClientEvent::Route(r) => {
                self.control.routes_received += 1;
                let (held, meta) = if r.exists {
                    (r.nodes.clone(), r.meta.clone())
                } else {
                    (Vec::new(), Vec::new())
                };
                self.routes.set(r.module, r.version, held, meta);
                let shard = r.module.shard(self.shards) as usize;
                let msg = ToShard::Route {
                    module: r.module,
                    exists: r.exists,
                    version: r.version,
                    nodes: r.nodes,
                    policy: r.policy,
                    options: r.options,
                    meta: r.meta,
                };
                (None, self.deliver(rings, shard, msg))
            }
            RouteClientEvent::ServerError(e) => {
                let line = format!(
                    "route server refused a request: {} ({:?}) for {}",
                    e.message, e.retcode, e.module
                );
                (Some(Log::Warn(line)), false)
            }
            RouteClientEvent::Connected(addr) => {
                let n = self.route_link.check(true, now_ms).suppressed();
                let line = format!("connected to route server {addr}{}", logging::left_out(n));
                (Some(Log::Info(line)), false)
            }
            RouteClientEvent::ConnectFailed { addr, error } => {
                let line = match self.route_link.check(false, now_ms) {
                    Verdict::Log { suppressed } => Some(Log::Warn(format!(
                        "cannot connect to route server {addr}: {error}; retrying with back-off{}",
                        logging::left_out(suppressed)
                    ))),
                    Verdict::Quiet => None,
                };
                (line, false)
            }
            RouteClientEvent::Disconnected { addr, error } => {
                let n = self.route_link.check(false, now_ms).suppressed();
                let line = format!(
                    "lost route server {addr}: {error}; pulls in flight will be re-issued{}",
                    logging::left_out(n)
                );
                (Some(Log::Warn(line)), false)
            }
        }
    }

    /// A statistics client event at `now_ms`: the line to log, if any (the
    /// link's state changes, and while it stays down or keeps dropping one
    /// line per [`RELOG_MS`] with the count).
    pub fn stats_event(&mut self, ev: &StatsClientEvent, now_ms: u64) -> Option<Log> {
        match ev {
            StatsClientEvent::Connected(_) => {
                let n = self.stats_link.check(true, now_ms).suppressed();
                Some(Log::Info(format!("reporter: {ev}{}", logging::left_out(n))))
            }
            StatsClientEvent::ConnectFailed { .. } => match self.stats_link.check(false, now_ms) {
                Verdict::Log { suppressed } => Some(Log::Warn(format!(
                    "reporter: {ev}{}",
                    logging::left_out(suppressed)
                ))),
                Verdict::Quiet => None,
            },
            StatsClientEvent::Disconnected { .. } => {
                let n = self.stats_link.check(false, now_ms).suppressed();
                Some(Log::Warn(format!("reporter: {ev}{}", logging::left_out(n))))
            }
            StatsClientEvent::Dropped { .. } | StatsClientEvent::ServerError(_) => {
                let kind = matches!(ev, StatsClientEvent::Dropped { .. });
                match self.stats_trouble.check(kind, now_ms) {
                    Verdict::Log { suppressed } => Some(Log::Warn(format!(
                        "reporter: {ev}{}",
                        logging::left_out(suppressed)
                    ))),
                    Verdict::Quiet => None,
                }
            }
        }
    }

    // === the rings ===

    /// Sends a message to its shard, or queues it behind the shard's
    /// backlog (or as its start, counted in `ring_drops`, when the ring is
    /// full). True when a backlog began: the shell wakes its retry task.
    fn deliver(&mut self, rings: &impl ShardRings, shard: usize, msg: ToShard) -> bool {
        if !self.backlog[shard].is_empty() {
            self.backlog[shard].push_back(msg);
            return false;
        }
        match rings.try_send(shard, msg) {
            Ok(()) => false,
            Err(e) => {
                self.control.ring_drops += 1;
                match e {
                    Refused::Full(msg) => {
                        self.backlog[shard].push_back(msg);
                        true
                    }
                    Refused::Closed => false,
                }
            }
        }
    }

    /// Hands each shard's backlog to its ring, in order, until a ring is
    /// full again (a closed one loses its backlog). True while some
    /// backlog remains (retry later).
    pub fn retry_backlog(&mut self, rings: &impl ShardRings) -> bool {
        for shard in 0..self.backlog.len() {
            while let Some(msg) = self.backlog[shard].pop_front() {
                if let Err(e) = rings.try_send(shard, msg) {
                    match e {
                        Refused::Full(msg) => self.backlog[shard].push_front(msg),
                        Refused::Closed => self.backlog[shard].clear(),
                    }
                    break;
                }
            }
        }
        !self.backlog.iter().all(VecDeque::is_empty)
    }

    // === the main loop's turns ===

    /// Whether every shard is ready (`ready` of them are): the first time,
    /// the core serves from `now` (the shell writes the first heartbeat)
    /// and says whether the table is to be filled from the snapshot.
    pub fn start_serving(&mut self, ready: u32, now: Instant) -> Option<Serving> {
        if self.serving || ready < self.shards {
            return None;
        }
        self.serving = true;
        self.last_beat = now;
        Some(Serving {
            fill: self.routes.filling(),
        })
    }

    /// Whether the core serves (every shard was ready once).
    pub fn serving(&self) -> bool {
        self.serving
    }

    /// How long the main loop may sleep at `now`: until the next heartbeat
    /// (while serving) or snapshot (once the table is filled) is due, at
    /// most the idle tick, or the starting poll while the shards start.
    pub fn sleep(&self, now: Instant) -> Duration {
        // At least the idle tick: a zero interval must not spin the loop.
        let interval = self.snapshot_interval.max(self.idle_tick);
        let since = |t: Instant| now.saturating_duration_since(t);
        wake::control_sleep(
            self.serving
                .then(|| BEAT_EVERY.saturating_sub(since(self.last_beat))),
            (!self.routes.filling()).then(|| interval.saturating_sub(since(self.last_snapshot))),
            self.idle_tick,
            (!self.serving).then_some(STARTING_POLL),
        )
    }

    /// A turn of the main loop at `now`, after its sleep: a reload
    /// (`reload`) goes to every shard through its ring, behind the routes
    /// already waiting, and its lists to the clients; a heartbeat when
    /// one is due; the snapshot thread's counts (`snapshots`: written,
    /// failed) into the metrics; the routes to write when a snapshot is
    /// due (not while the table is still being filled: the file would
    /// lose the routes not yet taken).
    pub fn turn(
        &mut self,
        now: Instant,
        reload: Option<LiveUpdate>,
        snapshots: (u64, u64),
        rings: &impl ShardRings,
    ) -> TurnActions {
        let mut out = TurnActions::default();
        if let Some(update) = reload {
            for shard in 0..self.backlog.len() {
                let msg = ToShard::Params(update.shard.clone());
                out.retry |= self.deliver(rings, shard, msg);
            }
            out.route_servers = update.route_servers;
            out.refresh_ms = Some(update.shard.update_timeout_ms);
            out.reporters = update.reporters;
            self.snapshot_interval = update.snapshot_interval;
        }
        if self.serving && now.saturating_duration_since(self.last_beat) >= BEAT_EVERY {
            out.beat = true;
            self.last_beat = now;
        }
        (self.control.snapshots_written, self.control.snapshot_errors) = snapshots;
        if now.saturating_duration_since(self.last_snapshot) >= self.snapshot_interval
            && !self.routes.filling()
        {
            self.last_snapshot = now;
            out.snapshot = Some(self.routes.snapshot_routes());
        }
        out
    }

    /// The snapshot thread refused the routes (still writing the last).
    pub fn snapshot_skipped(&mut self) {
        self.control.snapshots_skipped += 1;
    }

    // === the table ===

    /// Takes up to `max_nodes` nodes of the snapshot's routes into the
    /// table; `taken` gets each module taken (the shell subscribes to it).
    /// True while some remain.
    pub fn fill_step(&mut self, max_nodes: usize, taken: impl FnMut(ModuleId)) -> bool {
        self.routes.fill_step(max_nodes, taken)
    }

    /// The routes for the final snapshot at shutdown: the rest of the
    /// snapshot's first (no subscription any more), so the file keeps every
    /// route.
    pub fn final_routes(&mut self) -> Vec<SnapshotRoute> {
        self.routes.fill_step(usize::MAX, |_| {});
        self.routes.snapshot_routes()
    }

    /// The control core's table of routes.
    pub fn routes(&self) -> &RouteTable {
        &self.routes
    }

    // === metrics ===

    /// The figures for the metrics page at `now`: every shard's last
    /// copy, and the control core's own with the links' figures.
    pub fn metrics(&mut self, links: Links, now: Instant) -> (&[ShardMetrics], &ControlMetrics) {
        let c = &mut self.control;
        c.route_server = links.route_server.map(|a| a.to_string());
        c.pulls_sent = links.pulls_sent;
        c.reporter = links.reporter.map(|a| a.to_string());
        c.stats_sent = links.stats_sent;
        c.stats_dropped = links.stats_dropped;
        c.heartbeat_age_s = now.saturating_duration_since(self.last_beat).as_secs_f64();
        (&self.shard_metrics, &self.control)
    }
}

#[cfg(test)]
mod tests;
