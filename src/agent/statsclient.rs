//! The stats client: the control core's TCP connection to the reporters:
//! per-module, per-node call statistics out as StatsReports, StatsAcks in,
//! a bounded buffer across outages, reconnection with back-off and
//! fail-over across the configured addresses.
//!
//! Two layers, as [`super::routeclient`]:
//!
//! - [`StatsClientCore`]: the protocol, pure. Time is an argument (`now`,
//!   milliseconds since the Unix epoch: the shell reads the wall clock once
//!   and advances it monotonically), bytes go in and out as slices; no
//!   sockets, no clocks, no randomness but a seeded generator. Batching,
//!   acknowledgement, re-sending, the buffer bound, back-off and fail-over
//!   are decided and tested here.
//! - [`run`]: the glommio shell (`link_shell`, shared with the route
//!   client). It connects, moves bytes between the socket
//!   and the core, sleeps until the core's next deadline, flushes once on
//!   shutdown, and hands [`StatsClientEvent`]s to the caller. It decides
//!   nothing.
//!
//! The rules, in one place:
//!
//! - Statistics are queued as *entries*, one per `(module, nodes)` pushed
//!   (a module with more than [`StatsClientConfig::max_nodes_per_report`]
//!   nodes becomes several entries). Entries are sent in push order, batched
//!   into StatsReports of at most [`StatsClientConfig::max_modules_per_report`]
//!   entries and `max_nodes_per_report` nodes, all taken in the same second
//!   (the report's `time_s`).
//! - A report stays in flight until the reporter's StatsAck echoes its
//!   `seq`; at most [`StatsClientConfig::max_reports_in_flight`] are.
//! - When the connection ends, every report in flight goes back to the
//!   front of the queue, and is re-sent first, with the same `seq` and (bar
//!   entries dropped meanwhile) the same content, so that a reporter may
//!   deduplicate on `(caller, seq)`. Nothing is lost while the bound holds;
//!   a report may arrive twice when its ack was lost.
//! - At most [`StatsClientConfig::max_queued`] entries wait (reports in
//!   flight are bounded apart, by the window). Past the bound the oldest
//!   waiting entries are dropped, counted, and reported as one
//!   [`StatsClientEvent::Dropped`] per burst.
//! - An ErrorResp refuses one report: it is dropped (re-sending would be
//!   refused again), counted as rejected, and reported. An ErrorResp
//!   `Unavailable` instead closes the connection: its report is re-sent,
//!   elsewhere if need be.
//! - Reconnection: the same capped, jittered exponential back-off and
//!   round-robin fail-over as the route client (one shared helper).
//!
//! Owns the wire conversation with the reporter and nothing else: it does
//! not collect statistics (the shards do, and the caller pushes them), keeps
//! nothing once acknowledged, touches no shard and no LB state, and must not
//! grow policy about what to report or when (the caller pushes when it has
//! something).
//!
//! # Embedding
//!
//! The control core runs [`run`] as one task of its glommio executor:
//!
//! ```no_run
//! use glommio::channels::local_channel;
//! use lbagent_agent::statsclient::{run, StatsClientConfig, StatsClientStatus};
//! use lbagent_lb::NodeCallStats;
//! use lbagent_model::{ModuleId, NodeAddr};
//!
//! glommio::LocalExecutorBuilder::default()
//!     .io_memory(512 << 10)
//!     .make()
//!     .unwrap()
//!     .run(async {
//!         let mut config = StatsClientConfig::new(vec!["127.0.0.1:7778".parse().unwrap()]);
//!         config.caller = "10.0.0.7".parse().unwrap();
//!         let (stats_tx, stats_rx) = local_channel::new_unbounded();
//!         let (event_tx, event_rx) = local_channel::new_bounded(1024);
//!         let status = StatsClientStatus::default();
//!         let (stop_tx, stop_rx) = local_channel::new_bounded::<()>(1);
//!         let shutdown = async move {
//!             let _ = stop_rx.recv().await;
//!         };
//!         let client = glommio::spawn_local(run(config, stats_rx, event_tx, shutdown, status.clone()));
//!         glommio::spawn_local(async move {
//!             while let Some(event) = event_rx.recv().await {
//!                 eprintln!("reporter: {event}");
//!             }
//!         })
//!         .detach();
//!         let node = NodeCallStats {
//!             addr: "10.0.0.1:9000".parse::<NodeAddr>().unwrap(),
//!             succ: 120,
//!             err: 3,
//!             overloaded: false,
//!             consumed: 0,
//!         };
//!         stats_tx.try_send((ModuleId::new(10001, 1), vec![node])).unwrap();
//!         // ... later: stop; the client flushes for at most flush_timeout_ms.
//!         stop_tx.try_send(()).unwrap();
//!         client.await.unwrap();
//!         let left = status.stats().queued + status.stats().in_flight;
//!         # let _ = left;
//!     });
//! ```

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::pin;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel::{LocalReceiver, LocalSender};
use glommio::net::TcpStream;

use super::link_shell::{LinkCore, LinkShell};
use super::reconnect::{LinkState, Reconnect, ReconnectPolicy};
use lbagent_host::clock;
use lbagent_lb::NodeCallStats;
use lbagent_model::{ModuleId, NodeAddr};
use lbagent_service::conn::{race, Either};
use lbagent_wire::{
    decode, write_frame, DecodeError, Encoder, FrameError, Limits, Message, ModuleStats, NodeStats,
    RetCode,
};

/// The most entries one StatsReport may carry.
pub const MAX_MODULES_PER_REPORT: usize = 65_536;

/// The most nodes one StatsReport may carry. With
/// [`MAX_MODULES_PER_REPORT`], a report stays well under the 16 MiB frame
/// limit (about 20 bytes a node, 32 a module).
pub const MAX_NODES_PER_REPORT: usize = 262_144;

// === config ===

/// The stats client's settings. Times are milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsClientConfig {
    /// The reporters, in order of preference. The client starts with the
    /// first and moves to the next (wrapping around) after every failed
    /// attempt or lost connection. Shuffle it per host to spread a fleet.
    pub addrs: Vec<SocketAddr>,
    /// This agent's address, sent as every report's `caller` (default
    /// 0.0.0.0: unknown).
    pub caller: Ipv4Addr,
    /// How long one connection attempt may take (default 1000).
    pub connect_timeout_ms: u64,
    /// A connection that receives nothing for this long while reports are
    /// in flight is dead (default 15000); so is a write that cannot proceed
    /// for this long.
    pub ack_timeout_ms: u64,
    /// The first reconnection delay (default 100); it doubles per failed
    /// attempt up to [`Self::backoff_max_ms`].
    pub backoff_initial_ms: u64,
    /// The longest reconnection delay (default 5000).
    pub backoff_max_ms: u64,
    /// The most entries one StatsReport carries (default 1024; at most
    /// [`MAX_MODULES_PER_REPORT`]).
    pub max_modules_per_report: usize,
    /// The most nodes one StatsReport carries (default 65536; at most
    /// [`MAX_NODES_PER_REPORT`]); a module with more is split.
    pub max_nodes_per_report: usize,
    /// The most reports sent and not yet acknowledged (default 8).
    pub max_reports_in_flight: usize,
    /// The most entries waiting to be sent, re-sends included (default
    /// 100000); past it the oldest are dropped.
    pub max_queued: usize,
    /// On shutdown, how long the one attempt to send what is queued (and
    /// have it acknowledged) may take (default 500; 0: no attempt).
    pub flush_timeout_ms: u64,
    /// Seed of the back-off jitter. [`StatsClientConfig::new`] draws it at
    /// random so that a fleet's agents do not reconnect in step; tests fix it.
    pub jitter_seed: u64,
}

impl StatsClientConfig {
    /// The defaults for `addrs`, with a random jitter seed and an unknown
    /// caller (set [`Self::caller`]).
    pub fn new(addrs: Vec<SocketAddr>) -> Self {
        StatsClientConfig {
            addrs,
            caller: Ipv4Addr::UNSPECIFIED,
            connect_timeout_ms: 1000,
            ack_timeout_ms: 15_000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5000,
            max_modules_per_report: 1024,
            max_nodes_per_report: 65_536,
            max_reports_in_flight: 8,
            max_queued: 100_000,
            flush_timeout_ms: 500,
            jitter_seed: fastrand::u64(..),
        }
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`StatsConfigError::NoAddrs`] for an empty address list,
    /// [`StatsConfigError::OutOfRange`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), StatsConfigError> {
        if self.addrs.is_empty() {
            return Err(StatsConfigError::NoAddrs);
        }
        let checks: [(&'static str, u64, bool, &'static str); 8] = [
            (
                "connect_timeout_ms",
                self.connect_timeout_ms,
                self.connect_timeout_ms > 0,
                "at least 1",
            ),
            (
                "ack_timeout_ms",
                self.ack_timeout_ms,
                self.ack_timeout_ms > 0,
                "at least 1",
            ),
            (
                "backoff_initial_ms",
                self.backoff_initial_ms,
                self.backoff_initial_ms > 0,
                "at least 1",
            ),
            (
                "backoff_max_ms",
                self.backoff_max_ms,
                self.backoff_max_ms >= self.backoff_initial_ms,
                "at least backoff_initial_ms",
            ),
            (
                "max_modules_per_report",
                self.max_modules_per_report as u64,
                (1..=MAX_MODULES_PER_REPORT).contains(&self.max_modules_per_report),
                "1..=65536",
            ),
            (
                "max_nodes_per_report",
                self.max_nodes_per_report as u64,
                (1..=MAX_NODES_PER_REPORT).contains(&self.max_nodes_per_report),
                "1..=262144",
            ),
            (
                "max_reports_in_flight",
                self.max_reports_in_flight as u64,
                self.max_reports_in_flight > 0,
                "at least 1",
            ),
            (
                "max_queued",
                self.max_queued as u64,
                self.max_queued > 0,
                "at least 1",
            ),
        ];
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, allowed)) => Err(StatsConfigError::OutOfRange {
                field,
                value,
                allowed,
            }),
            None => Ok(()),
        }
    }
}

impl StatsClientConfig {
    /// The servers and back-off, for [`Reconnect`].
    fn reconnect_policy(&self) -> ReconnectPolicy {
        ReconnectPolicy {
            addrs: self.addrs.clone(),
            backoff_initial_ms: self.backoff_initial_ms,
            backoff_max_ms: self.backoff_max_ms,
        }
    }
}

/// Why a [`StatsClientConfig`] is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StatsConfigError {
    /// `addrs` is empty.
    #[error("stats client addrs is empty: configure at least one reporter address")]
    NoAddrs,
    /// A field is outside its allowed range.
    #[error("stats client {field} is {value}: must be {allowed}")]
    OutOfRange {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it must be.
        allowed: &'static str,
    },
}

// === events and errors ===

/// An ErrorResp: the reporter refused a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsServerError {
    /// The refused report's sequence number (0: it could not be read).
    pub seq: u64,
    /// The module the error names ((0, 0) when none).
    pub module: ModuleId,
    /// Why, as a code.
    pub retcode: RetCode,
    /// Why, in words.
    pub message: String,
    /// Entries of the refused report, dropped (0 when `seq` names no
    /// report in flight).
    pub rejected: usize,
}

/// What the stats client tells its caller; every event is for a log line
/// (`Display` writes one).
#[derive(Debug)]
pub enum StatsClientEvent {
    /// The buffer bound was exceeded: the oldest waiting entries were
    /// dropped.
    Dropped {
        /// Entries dropped since the last such event.
        entries: u64,
        /// Entries dropped since the start.
        total: u64,
    },
    /// The reporter refused a report; its entries are dropped.
    ServerError(StatsServerError),
    /// Connected to this reporter (shell only).
    Connected(SocketAddr),
    /// A connection attempt failed; the next one follows the back-off
    /// (shell only).
    ConnectFailed {
        /// The address tried.
        addr: SocketAddr,
        /// Why it failed.
        error: StatsClientError,
    },
    /// An established connection ended (shell only).
    Disconnected {
        /// The reporter's address.
        addr: SocketAddr,
        /// Why the connection ended.
        error: StatsClientError,
        /// Entries sent and not acknowledged, queued again to be re-sent.
        requeued: u64,
    },
}

impl fmt::Display for StatsClientEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatsClientEvent::Dropped { entries, total } => write!(
                f,
                "statistics buffer full: dropped the {entries} oldest entries ({total} in all)"
            ),
            StatsClientEvent::ServerError(e) => write!(
                f,
                "reporter refused report {} ({:?}, {} entries dropped): {}",
                e.seq, e.retcode, e.rejected, e.message
            ),
            StatsClientEvent::Connected(addr) => write!(f, "connected to reporter {addr}"),
            StatsClientEvent::ConnectFailed { addr, error } => write!(
                f,
                "cannot connect to reporter {addr}: {error}; retrying with back-off"
            ),
            StatsClientEvent::Disconnected {
                addr,
                error,
                requeued,
            } => write!(
                f,
                "lost reporter {addr}: {error}; {requeued} unacknowledged entries will be re-sent"
            ),
        }
    }
}

/// Why a connection to a reporter ends. Every variant means: close the
/// connection; the client reconnects per its back-off.
#[derive(Debug, thiserror::Error)]
pub enum StatsClientError {
    /// The byte stream is not a sequence of frames.
    #[error("bad frame from the reporter: {0}")]
    Frame(#[from] FrameError),
    /// A frame is not a valid message.
    #[error("undecodable message from the reporter: {0}")]
    Decode(#[from] DecodeError),
    /// A valid message that a reporter never sends to an agent.
    #[error(
        "unexpected {0} from the reporter: only StatsAck and ErrorResp belong on this connection"
    )]
    Unexpected(&'static str),
    /// The reporter answered ErrorResp `Unavailable`.
    #[error("reporter unavailable: {0}")]
    Unavailable(String),
    /// Nothing arrived for `ack_timeout_ms` while reports were in flight.
    #[error("reporter silent for {0} ms while reports were in flight")]
    AckTimeout(u64),
    /// The reporter closed the connection.
    #[error("reporter closed the connection")]
    Closed,
    /// A socket call failed (connect, read, write, or a write that could
    /// not proceed for `ack_timeout_ms`).
    #[error("reporter connection i/o failed: {0}")]
    Io(#[from] io::Error),
}

/// Counters for metrics, kept by [`StatsClientCore`]. Entries are counted
/// as pushed (after splitting); at every moment
/// `pushed == acked + dropped + rejected + queued + in_flight`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsClientStats {
    /// Connections established.
    pub connects: u64,
    /// Connection attempts failed or connections lost.
    pub disconnects: u64,
    /// Entries accepted by [`StatsClientCore::push`].
    pub pushed: u64,
    /// Entries sent, re-sends included.
    pub sent: u64,
    /// Entries sent again after a lost connection.
    pub resent: u64,
    /// Entries acknowledged by a reporter.
    pub acked: u64,
    /// Entries dropped past [`StatsClientConfig::max_queued`].
    pub dropped: u64,
    /// Entries refused by a reporter's ErrorResp.
    pub rejected: u64,
    /// Entries waiting to be sent now (a gauge).
    pub queued: u64,
    /// Entries sent and not acknowledged now (a gauge).
    pub in_flight: u64,
    /// StatsReport frames sent, re-sends included.
    pub reports_sent: u64,
    /// StatsAcks matching a report in flight.
    pub reports_acked: u64,
    /// StatsAcks matching no report in flight.
    pub stale_acks: u64,
    /// ErrorResps received.
    pub server_errors: u64,
}

pub use super::reconnect::Wake;

// === the core ===

/// One module's statistics as pushed (or one part of them).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    module: ModuleId,
    /// When they were taken, Unix seconds.
    time_s: u64,
    nodes: Vec<NodeStats>,
    /// `(node, units)` reported consumed for good (a `balance` module).
    consumed: Vec<(NodeAddr, u32)>,
}

/// One StatsReport: sent, or formed and waiting to be re-sent.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Batch {
    seq: u64,
    time_s: u64,
    entries: VecDeque<Entry>,
}

/// The stats client's protocol state, without I/O: see the module docs.
#[derive(Debug)]
pub struct StatsClientCore {
    config: StatsClientConfig,
    /// The server list, the rotation and the back-off.
    link: Reconnect,
    /// Reports that lost their connection, to send first, oldest first.
    resend: VecDeque<Batch>,
    /// Entries in no report yet, oldest first.
    queue: VecDeque<Entry>,
    /// Entries in `resend` and `queue`.
    queued: usize,
    /// Reports sent on this connection and not acknowledged, in send order.
    in_flight: VecDeque<Batch>,
    /// Entries in `in_flight`.
    in_flight_entries: usize,
    next_seq: u64,
    /// Since when acks are due with nothing received (None: none due).
    waiting_since: Option<u64>,
    /// Shutting down: no window.
    flushing: bool,
    /// Entries dropped since the last [`StatsClientEvent::Dropped`].
    unreported_drops: u64,
    encoder: Encoder,
    stats: StatsClientStats,
}

impl StatsClientCore {
    /// A core for `config`, disconnected, its first attempt due at once.
    ///
    /// # Errors
    /// What [`StatsClientConfig::validate`] returns.
    pub fn new(config: &StatsClientConfig) -> Result<Self, StatsConfigError> {
        config.validate()?;
        Ok(StatsClientCore {
            config: config.clone(),
            link: Reconnect::new(config.reconnect_policy(), config.jitter_seed),
            resend: VecDeque::new(),
            queue: VecDeque::new(),
            queued: 0,
            in_flight: VecDeque::new(),
            in_flight_entries: 0,
            next_seq: 1,
            waiting_since: None,
            flushing: false,
            unreported_drops: 0,
            encoder: Encoder::new(),
            stats: StatsClientStats::default(),
        })
    }

    /// Queues `module`'s statistics, taken at `now`. A module with more than
    /// [`StatsClientConfig::max_nodes_per_report`] nodes becomes several
    /// entries; one with no node is ignored. Returns the number of entries
    /// dropped to keep [`StatsClientConfig::max_queued`] (the oldest; see
    /// [`Self::poll_event`]).
    pub fn push(&mut self, module: ModuleId, nodes: Vec<NodeCallStats>, now: u64) -> usize {
        let time_s = now / 1000;
        for part in nodes.chunks(self.config.max_nodes_per_report) {
            let nodes = part.iter().map(|n| NodeStats {
                addr: n.addr,
                succ: n.succ,
                err: n.err,
                overloaded: n.overloaded,
            });
            let consumed = part.iter().filter(|n| n.consumed > 0);
            self.queue.push_back(Entry {
                module,
                time_s,
                nodes: nodes.collect(),
                consumed: consumed.map(|n| (n.addr, n.consumed)).collect(),
            });
            self.queued += 1;
            self.stats.pushed += 1;
        }
        self.enforce_bound()
    }

    /// Drops the oldest waiting entries (re-sends first) past the bound;
    /// returns how many.
    fn enforce_bound(&mut self) -> usize {
        let excess = self.queued.saturating_sub(self.config.max_queued);
        for _ in 0..excess {
            if let Some(batch) = self.resend.front_mut() {
                batch.entries.pop_front();
                if batch.entries.is_empty() {
                    self.resend.pop_front();
                }
            } else {
                self.queue.pop_front();
            }
        }
        self.queued -= excess;
        self.stats.dropped += excess as u64;
        self.unreported_drops += excess as u64;
        excess
    }

    /// A [`StatsClientEvent::Dropped`] summing the entries dropped since the
    /// last one, if any were; call it after pushes and disconnections.
    pub fn poll_event(&mut self) -> Option<StatsClientEvent> {
        (self.unreported_drops > 0).then(|| StatsClientEvent::Dropped {
            entries: std::mem::take(&mut self.unreported_drops),
            total: self.stats.dropped,
        })
    }

    /// The connection state and reporter list (which reporter is
    /// connected, or being connected to, or next to try).
    pub fn link(&self) -> &Reconnect {
        &self.link
    }

    /// Replaces the address list (a configuration reload), as
    /// [`Reconnect::reconfigure`] says: a connection up now (or an attempt
    /// under way) is kept and the new list applies when it ends; while
    /// waiting for an attempt, the next one goes to the current address if
    /// the new list has it, else to the list's first. Empty: ignored.
    pub fn set_addrs(&mut self, addrs: Vec<SocketAddr>) {
        if addrs.is_empty() {
            return;
        }
        self.config.addrs = addrs;
        self.link.reconfigure(self.config.reconnect_policy());
    }

    /// The counters, gauges included.
    pub fn stats(&self) -> StatsClientStats {
        StatsClientStats {
            queued: self.queued as u64,
            in_flight: self.in_flight_entries as u64,
            ..self.stats
        }
    }

    /// Whether nothing waits and nothing is in flight: every entry pushed
    /// was acknowledged, dropped or rejected.
    pub fn is_drained(&self) -> bool {
        self.queued == 0 && self.in_flight.is_empty()
    }

    /// The address to connect to now, when disconnected and the back-off
    /// has elapsed; the core then waits for [`Self::on_connected`] or
    /// [`Self::on_disconnected`].
    pub fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        self.link.poll_connect(now)
    }

    /// Takes a reloaded configuration: the server list and back-off (from
    /// the next attempt on; the connection in place is kept), the caller
    /// address, the bounds and timeouts (from their next use). The jitter
    /// seed is kept. A smaller `max_queued` applies at the next push or
    /// disconnection.
    ///
    /// # Errors
    /// What [`StatsClientConfig::validate`] returns; nothing changes then.
    pub fn reconfigure(&mut self, config: &StatsClientConfig) -> Result<(), StatsConfigError> {
        config.validate()?;
        self.link.reconfigure(config.reconnect_policy());
        self.config = StatsClientConfig {
            jitter_seed: self.config.jitter_seed,
            ..config.clone()
        };
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> &StatsClientConfig {
        &self.config
    }

    /// The connection to [`Reconnect::current_addr`] is up: reports that lost
    /// their connection are sent first, then the queue.
    pub fn on_connected(&mut self, _now: u64) {
        self.link.on_connected();
        self.stats.connects += 1;
        self.waiting_since = None;
    }

    /// The connection (or the attempt) ended: reports in flight go back to
    /// the front of the queue (the bound applies), the next attempt goes to
    /// the next address after the route client's back-off of
    /// `min(max, initial * 2^failures)`, jittered down by up to half.
    pub fn on_disconnected(&mut self, now: u64) {
        while let Some(batch) = self.in_flight.pop_back() {
            self.queued += batch.entries.len();
            self.resend.push_front(batch);
        }
        self.in_flight_entries = 0;
        self.enforce_bound();
        self.link.on_disconnected(now);
        self.waiting_since = None;
        self.stats.disconnects += 1;
    }

    /// Shutting down: lifts the in-flight window so that everything queued
    /// goes out at once, and, when not connected, makes an attempt due now
    /// (an attempt under way is taken as abandoned).
    pub fn start_flush(&mut self, now: u64) {
        self.flushing = true;
        self.link.attempt_now(now);
    }

    /// Appends to `out` every StatsReport due now: re-sends first, then new
    /// reports from the queue, while fewer than
    /// [`StatsClientConfig::max_reports_in_flight`] are in flight. Returns
    /// the number of frames appended; none while not connected.
    pub fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize {
        if !self.link.is_connected() {
            return 0;
        }
        let mut frames = 0;
        while self.flushing || self.in_flight.len() < self.config.max_reports_in_flight {
            let batch = match self.resend.pop_front() {
                Some(batch) => {
                    self.stats.resent += batch.entries.len() as u64;
                    batch
                }
                None => match self.next_batch() {
                    Some(batch) => batch,
                    None => break,
                },
            };
            self.encode(&batch, out);
            let entries = batch.entries.len();
            self.queued -= entries;
            self.in_flight_entries += entries;
            self.stats.sent += entries as u64;
            self.stats.reports_sent += 1;
            self.in_flight.push_back(batch);
            self.waiting_since.get_or_insert(now);
            frames += 1;
        }
        frames
    }

    /// Takes the next report's worth of entries from the queue: the oldest
    /// entry and those after it taken in the same second, within the
    /// module and node bounds.
    fn next_batch(&mut self) -> Option<Batch> {
        let time_s = self.queue.front()?.time_s;
        let (mut entries, mut nodes) = (VecDeque::new(), 0);
        while let Some(entry) = self.queue.front() {
            let full = entries.len() == self.config.max_modules_per_report
                || (!entries.is_empty()
                    && nodes + entry.nodes.len() > self.config.max_nodes_per_report);
            if full || entry.time_s != time_s {
                break;
            }
            nodes += entry.nodes.len();
            entries.extend(self.queue.pop_front());
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        Some(Batch {
            seq,
            time_s,
            entries,
        })
    }

    fn encode(&mut self, batch: &Batch, out: &mut Vec<u8>) {
        let modules: Vec<ModuleStats<'_>> = batch
            .entries
            .iter()
            .map(|e| ModuleStats {
                module: e.module,
                nodes: &e.nodes,
                consumed: &e.consumed,
            })
            .collect();
        let caller = u32::from(self.config.caller);
        let frame = self
            .encoder
            .stats_report(batch.seq, caller, batch.time_s, &modules);
        write_frame(out, frame).expect("a StatsReport within the configured bounds fits a frame");
    }

    /// Handles one frame's payload received at `now`.
    ///
    /// A StatsAck settles its report (nothing is returned; an ack of no
    /// report in flight is counted as stale); an ErrorResp drops its report
    /// and returns [`StatsClientEvent::ServerError`].
    ///
    /// # Errors
    /// [`StatsClientError::Decode`] when the verifier refuses the frame,
    /// [`StatsClientError::Unexpected`] for a message that is not the
    /// reporter's to send, [`StatsClientError::Unavailable`] for an
    /// ErrorResp `Unavailable` (its report is re-sent after reconnecting).
    /// Each means: close the connection.
    pub fn on_frame(
        &mut self,
        frame: &[u8],
        now: u64,
    ) -> Result<Option<StatsClientEvent>, StatsClientError> {
        let event = match decode(frame, &Limits::TCP_FRAME)? {
            Message::StatsAck(m) => {
                match self.take_in_flight(m.seq()) {
                    Some(batch) => {
                        self.stats.acked += batch.entries.len() as u64;
                        self.stats.reports_acked += 1;
                    }
                    None => self.stats.stale_acks += 1,
                }
                None
            }
            Message::ErrorResp(m) if m.retcode() == RetCode::Unavailable => {
                self.stats.server_errors += 1;
                let message = m.message().unwrap_or_default().to_string();
                return Err(StatsClientError::Unavailable(message));
            }
            Message::ErrorResp(m) => {
                let rejected = self.take_in_flight(m.seq()).map_or(0, |b| b.entries.len());
                self.stats.rejected += rejected as u64;
                self.stats.server_errors += 1;
                Some(StatsClientEvent::ServerError(StatsServerError {
                    seq: m.seq(),
                    module: ModuleId::new(m.modid(), m.cmdid()),
                    retcode: m.retcode(),
                    message: m.message().unwrap_or_default().to_string(),
                    rejected,
                }))
            }
            other => return Err(StatsClientError::Unexpected(other.name())),
        };
        // The reporter is alive and the connection healthy: reset the back-off.
        self.link.on_healthy();
        self.waiting_since = (!self.in_flight.is_empty()).then_some(now);
        Ok(event)
    }

    /// Removes report `seq` from the reports in flight.
    fn take_in_flight(&mut self, seq: u64) -> Option<Batch> {
        let at = self.in_flight.iter().position(|b| b.seq == seq)?;
        let batch = self.in_flight.remove(at)?;
        self.in_flight_entries -= batch.entries.len();
        Some(batch)
    }

    /// When the shell must call in again: the next connection attempt or
    /// the ack deadline; or [`Wake::Drop`] when the connection is dead.
    pub fn poll_timeout(&self, now: u64) -> Wake {
        match self.link.state() {
            LinkState::Idle { next_attempt_at } => Wake::At(next_attempt_at),
            LinkState::Connecting => Wake::Never,
            LinkState::Connected => match self.waiting_since {
                Some(since) => {
                    let deadline = since.saturating_add(self.config.ack_timeout_ms);
                    if now >= deadline {
                        Wake::Drop
                    } else {
                        Wake::At(deadline)
                    }
                }
                None => Wake::Never,
            },
        }
    }
}

// === the glommio shell ===

/// The connection state and counters for metrics, shared between [`run`]
/// and its caller on the same executor (an `Rc`, not `Send`).
#[derive(Clone, Debug, Default)]
pub struct StatsClientStatus {
    inner: Rc<StatusInner>,
}

#[derive(Debug, Default)]
struct StatusInner {
    connected: Cell<Option<SocketAddr>>,
    /// A new address list from a configuration reload, for [`run`] to take.
    new_addrs: RefCell<Option<Vec<SocketAddr>>>,
    stats: Cell<StatsClientStats>,
}

impl StatsClientStatus {
    /// The reporter connected to, if any.
    pub fn connected(&self) -> Option<SocketAddr> {
        self.inner.connected.get()
    }

    /// The counters (sent, acked, dropped, queued, ...), as of the last
    /// I/O. After [`run`] returns, `queued + in_flight` is what the flush
    /// could not deliver.
    pub fn stats(&self) -> StatsClientStats {
        self.inner.stats.get()
    }

    /// Replaces the reporters (a configuration reload): taken at the client's
    /// next wake-up (the next statistics pushed, an ack, or the back-off); a connection up now is
    /// kept until it ends. An empty list is ignored.
    pub fn set_addrs(&self, addrs: Vec<SocketAddr>) {
        if !addrs.is_empty() {
            *self.inner.new_addrs.borrow_mut() = Some(addrs);
        }
    }

    /// Applies a pending reload and publishes the core's state.
    fn sync(&self, core: &mut StatsClientCore) {
        if let Some(addrs) = self.inner.new_addrs.borrow_mut().take() {
            core.set_addrs(addrs);
        }
        self.inner.connected.set(core.link().connected());
        self.inner.stats.set(core.stats());
    }
}

/// One `(module, nodes)` item, as the shards hand them over.
pub type StatsItem = (ModuleId, Vec<NodeCallStats>);

/// Runs the stats client until `shutdown` completes or `events` is closed,
/// then makes one attempt, bounded by
/// [`StatsClientConfig::flush_timeout_ms`], to send what is queued and have
/// it acknowledged.
///
/// Must run inside a glommio `LocalExecutor`. The caller sends statistics
/// on `input` (a closed `input` only stops new statistics) and receives
/// every [`StatsClientEvent`] on `events`; `status` shows the connection and
/// the counters for metrics. Both channels are glommio `local_channel`s: a
/// bounded `events` channel gives back-pressure (the client waits while it
/// is full). Statistics are kept only until acknowledged.
///
/// # Errors
/// [`StatsConfigError`] when `config` is invalid; nothing else: connection
/// failures are reported as events and retried.
pub async fn run(
    config: StatsClientConfig,
    input: LocalReceiver<StatsItem>,
    events: LocalSender<StatsClientEvent>,
    shutdown: impl Future<Output = ()>,
    status: StatsClientStatus,
) -> Result<(), StatsConfigError> {
    let core = StatsClientCore::new(&config)?;
    let sync = {
        let status = status.clone();
        Box::new(move |core: &mut StatsClientCore| status.sync(core))
    };
    let mut shell = LinkShell::new(
        core,
        clock::unix_ms(),
        Duration::from_millis(config.connect_timeout_ms),
        Duration::from_millis(config.ack_timeout_ms),
        input,
        events,
        sync,
    );
    let mut stream = shell.run(pin!(shutdown)).await;
    let flush_timeout = Duration::from_millis(shell.core.config.flush_timeout_ms);
    flush(&mut shell, stream.as_mut(), flush_timeout).await;
    shell.publish();
    status.inner.connected.set(None);
    Ok(())
}

type Shell = LinkShell<StatsClientCore, StatsItem>;

/// The one bounded attempt on shutdown: takes what the input holds, then,
/// unless nothing waits, sends everything on `stream` (or on a new
/// connection to the current address) and waits for the acks, all within
/// `flush_timeout`. Events go out only where the channel has room.
async fn flush(shell: &mut Shell, stream: Option<&mut TcpStream>, flush_timeout: Duration) {
    let deadline = Instant::now() + flush_timeout;
    shell.drain_input().await;
    shell.try_emit_pending();
    shell.publish();
    if shell.core.is_drained() || flush_timeout.is_zero() {
        return;
    }
    let now = shell.now();
    shell.core.start_flush(now);
    let mut connected;
    let stream = match stream {
        Some(stream) => stream,
        None => {
            let Some(addr) = shell.core.poll_connect(shell.now()) else {
                return;
            };
            let timeout = shell.connect_timeout().min(left(deadline));
            match TcpStream::connect_timeout(addr, timeout).await {
                Ok(stream) => {
                    shell.set_up(&stream);
                    connected = stream;
                    &mut connected
                }
                Err(e) => {
                    let now = shell.now();
                    shell.core.on_disconnected(now);
                    let error = StatsClientError::Io(e.into());
                    let failed = StatsClientEvent::ConnectFailed { addr, error };
                    let _ = shell.events.try_send(failed);
                    shell.try_emit_pending();
                    shell.publish();
                    return;
                }
            }
        }
    };
    flush_on(shell, stream, deadline).await;
    shell.publish();
}

/// Sends everything and reads acks until drained, the deadline, or an
/// error.
async fn flush_on(shell: &mut Shell, stream: &mut TcpStream, deadline: Instant) {
    let (mut out, mut buf) = (Vec::new(), vec![0; 16 << 10]);
    loop {
        out.clear();
        let now = shell.now();
        if shell.core.poll_transmit(now, &mut out) > 0 {
            let sleep = glommio::timer::sleep(left(deadline));
            if !matches!(
                race(sleep, stream.write_all(&out)).await,
                Either::Right(Ok(()))
            ) {
                return;
            }
        }
        shell.publish();
        let remaining = left(deadline);
        if shell.core.is_drained() || remaining.is_zero() {
            return;
        }
        let sleep = glommio::timer::sleep(remaining);
        match race(sleep, stream.read(&mut buf)).await {
            Either::Right(Ok(n)) if n > 0 => shell.frames.feed(&buf[..n]),
            _ => return,
        }
        let now = shell.now();
        while let Ok(Some(frame)) = shell.frames.next_frame() {
            match shell.core.on_frame(frame, now) {
                Ok(Some(event)) => {
                    let _ = shell.events.try_send(event);
                }
                Ok(None) => {}
                Err(_) => return,
            }
        }
    }
}

// === impl LinkCore ===

impl LinkCore for StatsClientCore {
    type Input = StatsItem;
    type Event = StatsClientEvent;
    type Error = StatsClientError;

    fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        StatsClientCore::poll_connect(self, now)
    }
    fn on_connected(&mut self, now: u64) {
        StatsClientCore::on_connected(self, now)
    }
    fn on_disconnected(&mut self, now: u64) {
        StatsClientCore::on_disconnected(self, now)
    }
    fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize {
        StatsClientCore::poll_transmit(self, now, out)
    }
    fn on_frame(
        &mut self,
        frame: &[u8],
        now: u64,
    ) -> Result<Option<StatsClientEvent>, Self::Error> {
        StatsClientCore::on_frame(self, frame, now)
    }
    fn poll_timeout(&self, now: u64) -> Wake {
        StatsClientCore::poll_timeout(self, now)
    }
    fn on_input(&mut self, (module, nodes): StatsItem, now: u64) {
        self.push(module, nodes, now);
    }
    fn poll_event(&mut self) -> Option<StatsClientEvent> {
        StatsClientCore::poll_event(self)
    }
    fn timed_out(&self) -> StatsClientError {
        StatsClientError::AckTimeout(self.config.ack_timeout_ms)
    }
    fn closed(&self) -> StatsClientError {
        StatsClientError::Closed
    }
    fn connected_event(&self, addr: SocketAddr) -> StatsClientEvent {
        StatsClientEvent::Connected(addr)
    }
    fn connect_failed_event(&self, addr: SocketAddr, error: StatsClientError) -> StatsClientEvent {
        StatsClientEvent::ConnectFailed { addr, error }
    }
    fn disconnected_event(&self, addr: SocketAddr, error: StatsClientError) -> StatsClientEvent {
        StatsClientEvent::Disconnected {
            addr,
            error,
            requeued: self.stats().in_flight,
        }
    }
}

/// How long until `deadline` (zero once past).
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_model::NodeAddr;
    use lbagent_wire::FrameDecoder;

    const A: ModuleId = ModuleId::new(1, 1);
    const B: ModuleId = ModuleId::new(2, 1);
    const C: ModuleId = ModuleId::new(3, 1);
    /// A `now` well past the epoch: second 1_700_000_000.
    const T0: u64 = 1_700_000_000_000;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn config() -> StatsClientConfig {
        StatsClientConfig {
            addrs: vec![addr(1), addr(2), addr(3)],
            caller: Ipv4Addr::new(10, 0, 0, 7),
            connect_timeout_ms: 100,
            ack_timeout_ms: 3000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5000,
            max_modules_per_report: 2,
            max_nodes_per_report: 4,
            max_reports_in_flight: 2,
            max_queued: 6,
            flush_timeout_ms: 500,
            jitter_seed: 7,
        }
    }

    fn node(i: u8) -> NodeCallStats {
        NodeCallStats {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 1, i), 9000),
            succ: u32::from(i) * 10,
            err: u32::from(i),
            overloaded: i % 2 == 0,
            consumed: 0,
        }
    }

    fn nodes(n: u8) -> Vec<NodeCallStats> {
        (1..=n).map(node).collect()
    }

    fn connected(config: &StatsClientConfig, now: u64) -> StatsClientCore {
        let mut core = StatsClientCore::new(config).unwrap();
        core.poll_connect(now).unwrap();
        core.on_connected(now);
        core
    }

    /// A StatsReport as the reporter reads it.
    #[derive(Debug, PartialEq, Eq)]
    struct Report {
        seq: u64,
        caller: u32,
        time_s: u64,
        modules: Vec<(ModuleId, Vec<NodeStats>)>,
    }

    impl Report {
        fn modules(&self) -> Vec<ModuleId> {
            self.modules.iter().map(|m| m.0).collect()
        }
    }

    /// Every report due now, decoded.
    fn transmit(core: &mut StatsClientCore, now: u64) -> Vec<Report> {
        let mut out = Vec::new();
        let n = core.poll_transmit(now, &mut out);
        let mut frames = FrameDecoder::default();
        frames.feed(&out);
        let mut reports = Vec::new();
        while let Some(frame) = frames.next_frame().unwrap() {
            let Message::StatsReport(r) = decode(frame, &Limits::TCP_FRAME).unwrap() else {
                panic!("not a StatsReport")
            };
            let modules = r.modules().unwrap_or_default().iter().map(|m| {
                let nodes = m.nodes().unwrap_or_default().iter().map(NodeStats::from);
                (ModuleId::new(m.modid(), m.cmdid()), nodes.collect())
            });
            reports.push(Report {
                seq: r.seq(),
                caller: r.caller(),
                time_s: r.time_s(),
                modules: modules.collect(),
            });
        }
        assert_eq!(reports.len(), n);
        reports
    }

    fn seqs(reports: &[Report]) -> Vec<u64> {
        reports.iter().map(|r| r.seq).collect()
    }

    fn ack(core: &mut StatsClientCore, seq: u64, now: u64) -> Option<StatsClientEvent> {
        let frame = Encoder::new().stats_ack(seq).to_vec();
        core.on_frame(&frame, now).unwrap()
    }

    fn assert_accounted(core: &StatsClientCore) {
        let s = core.stats();
        assert_eq!(
            s.pushed,
            s.acked + s.dropped + s.rejected + s.queued + s.in_flight,
            "{s:?}"
        );
    }

    // --- config ---

    #[test]
    fn the_defaults_are_valid() {
        let c = StatsClientConfig::new(vec![addr(1)]);
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.flush_timeout_ms, 500);
        assert_eq!(c.caller, Ipv4Addr::UNSPECIFIED);
    }

    #[test]
    fn validation_names_the_field_and_the_range() {
        let mut c = config();
        c.addrs.clear();
        assert_eq!(c.validate(), Err(StatsConfigError::NoAddrs));
        let mut c = config();
        c.max_modules_per_report = 0;
        let err = c.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "stats client max_modules_per_report is 0: must be 1..=65536"
        );
        let mut c = config();
        c.backoff_max_ms = 50;
        assert!(matches!(
            c.validate(),
            Err(StatsConfigError::OutOfRange {
                field: "backoff_max_ms",
                ..
            })
        ));
        for f in [
            |c: &mut StatsClientConfig| c.max_queued = 0,
            |c: &mut StatsClientConfig| c.max_reports_in_flight = 0,
            |c: &mut StatsClientConfig| c.max_nodes_per_report = MAX_NODES_PER_REPORT + 1,
            |c: &mut StatsClientConfig| c.ack_timeout_ms = 0,
        ] {
            let mut c = config();
            f(&mut c);
            assert!(StatsClientCore::new(&c).is_err());
        }
    }

    #[test]
    fn the_largest_report_allowed_fits_a_frame() {
        let mut c = config();
        c.max_modules_per_report = MAX_MODULES_PER_REPORT;
        c.max_nodes_per_report = MAX_NODES_PER_REPORT;
        c.max_queued = MAX_MODULES_PER_REPORT;
        let mut core = connected(&c, T0);
        let per_module = (MAX_NODES_PER_REPORT / MAX_MODULES_PER_REPORT) as u8;
        for i in 0..MAX_MODULES_PER_REPORT as u32 {
            core.push(ModuleId::new(i, u32::MAX), nodes(per_module), T0);
        }
        let mut out = Vec::new();
        assert_eq!(core.poll_transmit(T0, &mut out), 1);
        assert!(
            out.len() < lbagent_wire::MAX_FRAME_LEN,
            "{} bytes",
            out.len()
        );
    }

    // --- batching ---

    #[test]
    fn nothing_is_sent_until_connected_and_then_everything_is() {
        let mut core = StatsClientCore::new(&config()).unwrap();
        core.push(A, nodes(1), T0);
        assert!(transmit(&mut core, T0).is_empty());
        assert_eq!(core.poll_connect(T0), Some(addr(1)));
        assert!(transmit(&mut core, T0).is_empty(), "connecting");
        core.on_connected(T0 + 10);
        let sent = transmit(&mut core, T0 + 10);
        assert_eq!(
            sent,
            vec![Report {
                seq: 1,
                caller: 0x0a00_0007,
                time_s: T0 / 1000,
                modules: vec![(
                    A,
                    vec![NodeStats {
                        addr: node(1).addr,
                        succ: 10,
                        err: 1,
                        overloaded: false
                    }]
                )],
            }]
        );
        assert_eq!(core.stats().sent, 1);
        assert_eq!(core.stats().in_flight, 1);
    }

    #[test]
    fn entries_are_batched_up_to_the_module_limit_in_push_order() {
        let mut c = config();
        c.max_reports_in_flight = 10;
        let mut core = connected(&c, T0);
        for m in [A, B, C] {
            core.push(m, nodes(1), T0);
        }
        let sent = transmit(&mut core, T0);
        assert_eq!(sent.len(), 2);
        assert_eq!(
            (sent[0].modules(), sent[1].modules()),
            (vec![A, B], vec![C])
        );
        assert_eq!(seqs(&sent), vec![1, 2]);
        assert_eq!(core.stats().reports_sent, 2);
    }

    #[test]
    fn reports_are_bounded_in_nodes_and_a_large_module_is_split() {
        let mut c = config();
        c.max_reports_in_flight = 10;
        c.max_queued = 100;
        let mut core = connected(&c, T0);
        core.push(A, nodes(3), T0);
        core.push(B, nodes(2), T0);
        core.push(C, nodes(9), T0);
        assert_eq!(core.stats().pushed, 5, "C is split into 4 + 4 + 1");
        let sent = transmit(&mut core, T0);
        let shape: Vec<Vec<(ModuleId, usize)>> = sent
            .iter()
            .map(|r| r.modules.iter().map(|(m, n)| (*m, n.len())).collect())
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![(A, 3)],
                vec![(B, 2)],
                vec![(C, 4)],
                vec![(C, 4)],
                vec![(C, 1)]
            ]
        );
        let c_nodes: Vec<NodeAddr> = sent[2..]
            .iter()
            .flat_map(|r| r.modules[0].1.iter().map(|n| n.addr))
            .collect();
        let expected: Vec<NodeAddr> = nodes(9).iter().map(|n| n.addr).collect();
        assert_eq!(c_nodes, expected);
    }

    #[test]
    fn a_report_holds_only_statistics_taken_in_the_same_second() {
        let mut c = config();
        c.max_reports_in_flight = 10;
        let mut core = connected(&c, T0);
        core.push(A, nodes(1), T0 + 100);
        core.push(B, nodes(1), T0 + 1100);
        core.push(C, nodes(1), T0 + 1999);
        let sent = transmit(&mut core, T0 + 2000);
        let got: Vec<(u64, Vec<ModuleId>)> = sent.iter().map(|r| (r.time_s, r.modules())).collect();
        let s = T0 / 1000;
        assert_eq!(got, vec![(s, vec![A]), (s + 1, vec![B, C])]);
    }

    #[test]
    fn a_module_without_nodes_is_ignored() {
        let mut core = connected(&config(), T0);
        assert_eq!(core.push(A, Vec::new(), T0), 0);
        assert!(transmit(&mut core, T0).is_empty());
        assert_eq!(
            core.stats(),
            StatsClientStats {
                connects: 1,
                ..Default::default()
            }
        );
        assert!(core.is_drained());
    }

    // --- acknowledgement ---

    #[test]
    fn an_ack_settles_its_report_and_a_stale_one_is_counted() {
        let mut core = connected(&config(), T0);
        for m in [A, B, C] {
            core.push(m, nodes(1), T0);
        }
        let sent = transmit(&mut core, T0);
        assert_eq!(seqs(&sent), vec![1, 2]);
        assert!(
            ack(&mut core, 2, T0 + 1).is_none(),
            "acks may come in any order"
        );
        assert_eq!(core.stats().acked, 1);
        assert!(ack(&mut core, 2, T0 + 1).is_none());
        assert!(ack(&mut core, 99, T0 + 1).is_none());
        assert_eq!(core.stats().stale_acks, 2);
        ack(&mut core, 1, T0 + 2);
        let s = core.stats();
        assert_eq!((s.acked, s.reports_acked, s.in_flight), (3, 2, 0));
        assert!(core.is_drained());
        assert_accounted(&core);
    }

    #[test]
    fn at_most_the_window_is_in_flight_and_an_ack_opens_it() {
        let mut c = config();
        c.max_modules_per_report = 1;
        c.max_queued = 100;
        let mut core = connected(&c, T0);
        for i in 0..5 {
            core.push(ModuleId::new(i, 0), nodes(1), T0);
        }
        assert_eq!(seqs(&transmit(&mut core, T0)), vec![1, 2]);
        assert!(transmit(&mut core, T0).is_empty(), "window full");
        ack(&mut core, 1, T0 + 1);
        assert_eq!(seqs(&transmit(&mut core, T0 + 1)), vec![3]);
        assert_eq!(core.stats().queued, 2);
    }

    // --- re-sending ---

    #[test]
    fn reports_in_flight_are_resent_first_and_unchanged_after_reconnecting() {
        let mut c = config();
        c.max_queued = 100;
        let mut core = connected(&c, T0);
        for m in [A, B, C] {
            core.push(m, nodes(2), T0);
        }
        let first = transmit(&mut core, T0);
        assert_eq!(seqs(&first), vec![1, 2]);
        ack(&mut core, 2, T0 + 1);
        core.push(ModuleId::new(9, 9), nodes(1), T0 + 1000);
        core.on_disconnected(T0 + 5);
        assert_eq!(core.stats().queued, 3, "report 1 (A, B) is queued again");
        assert_eq!(core.stats().in_flight, 0);
        let Wake::At(at) = core.poll_timeout(T0 + 5) else {
            panic!("no attempt scheduled")
        };
        assert_eq!(core.poll_connect(at), Some(addr(2)));
        core.on_connected(at);
        let again = transmit(&mut core, at);
        assert_eq!(again[0], first[0], "same seq, same content");
        assert_eq!(again[1].seq, 3);
        assert_eq!(again[1].modules(), vec![ModuleId::new(9, 9)]);
        let s = core.stats();
        assert_eq!((s.sent, s.resent), (6, 2), "3 first, 2 again, 1 new");
        assert_accounted(&core);
    }

    #[test]
    fn nothing_accepted_is_lost_across_many_disconnections() {
        let mut c = config();
        c.max_queued = 1000;
        c.max_modules_per_report = 3;
        let mut core = connected(&c, T0);
        let mut now = T0;
        let mut delivered = Vec::new();
        for round in 0u32..20 {
            for i in 0..7 {
                core.push(ModuleId::new(round, i), nodes(1), now);
            }
            let sent = transmit(&mut core, now);
            // The reporter acks every other report, then the link drops.
            for r in sent.iter().step_by(2) {
                delivered.extend(r.modules());
                ack(&mut core, r.seq, now);
            }
            core.on_disconnected(now);
            now += 10_000;
            core.poll_connect(now).unwrap();
            core.on_connected(now);
        }
        while !core.is_drained() {
            for r in transmit(&mut core, now) {
                delivered.extend(r.modules());
                ack(&mut core, r.seq, now);
            }
        }
        delivered.sort();
        let mut expected: Vec<ModuleId> = (0..20)
            .flat_map(|r| (0..7).map(move |i| ModuleId::new(r, i)))
            .collect();
        expected.sort();
        assert_eq!(
            delivered, expected,
            "each once: only acked reports count here"
        );
        assert_eq!(core.stats().dropped, 0);
        assert_accounted(&core);
    }

    // --- the bound ---

    #[test]
    fn past_the_bound_the_oldest_entries_are_dropped_and_counted() {
        let mut core = StatsClientCore::new(&config()).unwrap();
        for i in 0..6 {
            assert_eq!(core.push(ModuleId::new(i, 0), nodes(1), T0), 0);
        }
        assert!(core.poll_event().is_none());
        assert_eq!(core.push(ModuleId::new(6, 0), nodes(1), T0), 1);
        assert_eq!(core.push(ModuleId::new(7, 0), nodes(1), T0), 1);
        let Some(StatsClientEvent::Dropped { entries, total }) = core.poll_event() else {
            panic!("expected a drop event")
        };
        assert_eq!((entries, total), (2, 2), "one event per burst");
        assert!(core.poll_event().is_none());
        assert_eq!(core.stats().dropped, 2);
        assert_eq!(core.stats().queued, 6);
        core.poll_connect(T0).unwrap();
        core.on_connected(T0);
        core.config.max_reports_in_flight = 10;
        let left: Vec<ModuleId> = transmit(&mut core, T0)
            .iter()
            .flat_map(Report::modules)
            .collect();
        assert_eq!(
            left,
            (2..8).map(|i| ModuleId::new(i, 0)).collect::<Vec<_>>()
        );
        assert_accounted(&core);
    }

    #[test]
    fn requeued_reports_count_against_the_bound_and_are_the_oldest() {
        let mut core = connected(&config(), T0);
        for i in 0..4 {
            core.push(ModuleId::new(i, 0), nodes(1), T0);
        }
        let first = transmit(&mut core, T0);
        assert_eq!(seqs(&first), vec![1, 2]);
        for i in 4..10 {
            core.push(ModuleId::new(i, 0), nodes(1), T0);
        }
        assert_eq!(core.stats().dropped, 0, "in flight is bounded apart");
        core.on_disconnected(T0 + 1);
        // 4 requeued + 6 waiting = 10 > 6: the 4 oldest, report 1 and 2's, go.
        assert_eq!(core.stats().dropped, 4);
        assert!(matches!(
            core.poll_event(),
            Some(StatsClientEvent::Dropped {
                entries: 4,
                total: 4
            })
        ));
        core.poll_connect(T0 + 10_000).unwrap();
        core.on_connected(T0 + 10_000);
        let sent = transmit(&mut core, T0 + 10_000);
        assert_eq!(
            sent[0].modules(),
            vec![ModuleId::new(4, 0), ModuleId::new(5, 0)]
        );
        assert_eq!(sent[0].seq, 3);
        assert_accounted(&core);
    }

    #[test]
    fn dropping_from_a_requeued_report_keeps_the_rest_and_its_seq() {
        let mut core = connected(&config(), T0);
        for i in 0..4 {
            core.push(ModuleId::new(i, 0), nodes(1), T0);
        }
        transmit(&mut core, T0);
        core.on_disconnected(T0);
        for i in 4..7 {
            core.push(ModuleId::new(i, 0), nodes(1), T0);
        }
        assert_eq!(core.stats().dropped, 1);
        core.poll_connect(T0 + 10_000).unwrap();
        core.on_connected(T0 + 10_000);
        let sent = transmit(&mut core, T0 + 10_000);
        assert_eq!(
            (sent[0].seq, sent[0].modules()),
            (1, vec![ModuleId::new(1, 0)])
        );
        assert_eq!((sent[1].seq, sent[1].modules().len()), (2, 2));
    }

    // --- frames in ---

    #[test]
    fn an_error_resp_drops_the_refused_report_and_is_reported() {
        let mut core = connected(&config(), T0);
        for m in [A, B, C] {
            core.push(m, nodes(1), T0);
        }
        transmit(&mut core, T0);
        let err = Encoder::new()
            .error_resp(
                1,
                ModuleId::new(0, 0),
                RetCode::BadRequest,
                "caller unknown",
            )
            .to_vec();
        let Some(StatsClientEvent::ServerError(e)) = core.on_frame(&err, T0 + 1).unwrap() else {
            panic!("expected a server error")
        };
        assert_eq!((e.seq, e.retcode, e.rejected), (1, RetCode::BadRequest, 2));
        assert_eq!(e.message, "caller unknown");
        let s = core.stats();
        assert_eq!((s.rejected, s.server_errors, s.in_flight), (2, 1, 1));
        core.on_disconnected(T0 + 2);
        assert_eq!(core.stats().queued, 1, "only report 2 is re-sent");
        assert_accounted(&core);
        let ev = StatsClientEvent::ServerError(e).to_string();
        assert!(
            ev.contains("refused report 1") && ev.contains("caller unknown"),
            "{ev}"
        );
    }

    #[test]
    fn an_unavailable_reporter_closes_the_connection_and_its_report_is_resent() {
        let mut core = connected(&config(), T0);
        core.push(A, nodes(1), T0);
        transmit(&mut core, T0);
        let err = Encoder::new()
            .error_resp(1, ModuleId::new(0, 0), RetCode::Unavailable, "draining")
            .to_vec();
        let e = core.on_frame(&err, T0 + 1).unwrap_err();
        assert!(matches!(&e, StatsClientError::Unavailable(m) if m == "draining"));
        assert_eq!(e.to_string(), "reporter unavailable: draining");
        core.on_disconnected(T0 + 1);
        core.poll_connect(T0 + 10_000).unwrap();
        core.on_connected(T0 + 10_000);
        assert_eq!(transmit(&mut core, T0 + 10_000)[0].seq, 1);
    }

    #[test]
    fn a_message_the_reporter_never_sends_is_an_error() {
        let mut core = connected(&config(), T0);
        let pull = Encoder::new().pull_req(1, &[A]).to_vec();
        let err = core.on_frame(&pull, T0).unwrap_err();
        assert!(matches!(err, StatsClientError::Unexpected("PullReq")));
        assert!(err.to_string().contains("unexpected PullReq"));
        let ack = Encoder::new().keep_alive_ack(1).to_vec();
        assert!(matches!(
            core.on_frame(&ack, T0),
            Err(StatsClientError::Unexpected("KeepAliveAck"))
        ));
    }

    #[test]
    fn garbage_is_an_error_that_closes_the_connection() {
        let mut core = connected(&config(), T0);
        assert!(matches!(
            core.on_frame(b"definitely not a flatbuffer", T0),
            Err(StatsClientError::Decode(_))
        ));
        let mut frames = FrameDecoder::default();
        frames.feed(&[0, 0, 0, 0]);
        let err = StatsClientError::from(frames.next_frame().unwrap_err());
        assert!(err.to_string().starts_with("bad frame from the reporter"));
    }

    #[test]
    fn acks_split_anywhere_across_reads_settle_their_reports() {
        let mut stream = Vec::new();
        write_frame(&mut stream, Encoder::new().stats_ack(1)).unwrap();
        write_frame(&mut stream, Encoder::new().stats_ack(2)).unwrap();
        for cut in 0..=stream.len() {
            let mut core = connected(&config(), T0);
            for m in [A, B, C] {
                core.push(m, nodes(1), T0);
            }
            transmit(&mut core, T0);
            let mut frames = FrameDecoder::default();
            for part in [&stream[..cut], &stream[cut..]] {
                frames.feed(part);
                while let Some(frame) = frames.next_frame().unwrap() {
                    core.on_frame(frame, T0).unwrap();
                }
            }
            assert_eq!(core.stats().acked, 3, "cut at {cut}");
        }
    }

    // --- liveness ---

    #[test]
    fn an_idle_connection_has_no_deadline() {
        let core = connected(&config(), T0);
        assert_eq!(core.poll_timeout(T0 + 1_000_000), Wake::Never);
    }

    #[test]
    fn an_unacknowledged_report_makes_a_silent_connection_dead() {
        let mut core = connected(&config(), T0);
        core.push(A, nodes(1), T0);
        core.push(B, nodes(1), T0);
        core.push(C, nodes(1), T0);
        transmit(&mut core, T0 + 10);
        assert_eq!(core.poll_timeout(T0 + 10), Wake::At(T0 + 3010));
        ack(&mut core, 1, T0 + 2000);
        assert_eq!(
            core.poll_timeout(T0 + 3010),
            Wake::At(T0 + 5000),
            "progress restarts the wait"
        );
        assert_eq!(core.poll_timeout(T0 + 5000), Wake::Drop);
        ack(&mut core, 2, T0 + 4000);
        assert_eq!(core.poll_timeout(T0 + 100_000), Wake::Never);
    }

    // --- reconnecting ---

    /// The delays of `failures` consecutive failed attempts.
    fn delays(config: &StatsClientConfig, failures: usize) -> Vec<u64> {
        let mut core = StatsClientCore::new(config).unwrap();
        let mut now = 0;
        (0..failures)
            .map(|_| {
                core.poll_connect(now).unwrap();
                core.on_disconnected(now);
                let Wake::At(at) = core.poll_timeout(now) else {
                    panic!("no attempt scheduled")
                };
                let delay = at - now;
                now = at;
                delay
            })
            .collect()
    }

    #[test]
    fn the_backoff_doubles_up_to_the_cap_within_its_jitter() {
        for seed in 0..200 {
            let mut c = config();
            c.jitter_seed = seed;
            for (n, delay) in delays(&c, 12).into_iter().enumerate() {
                let base = (100u64 << n).min(5000);
                assert!(
                    (base / 2..=base).contains(&delay),
                    "seed {seed} attempt {n}: {delay} ms outside [{}, {base}]",
                    base / 2
                );
            }
        }
    }

    #[test]
    fn the_jitter_is_seeded() {
        let c = config();
        assert_eq!(delays(&c, 8), delays(&c, 8));
        let mut other = config();
        other.jitter_seed = 8;
        assert_ne!(delays(&c, 8), delays(&other, 8));
    }

    #[test]
    fn an_acknowledging_reporter_resets_the_backoff() {
        let mut core = StatsClientCore::new(&config()).unwrap();
        let mut now = 0;
        for _ in 0..6 {
            core.poll_connect(now).unwrap();
            core.on_disconnected(now);
            now += 10_000;
        }
        core.poll_connect(now).unwrap();
        core.on_connected(now);
        core.push(A, nodes(1), now);
        transmit(&mut core, now);
        ack(&mut core, 1, now);
        core.on_disconnected(now);
        let Wake::At(at) = core.poll_timeout(now) else {
            panic!()
        };
        assert!(at - now <= 100, "back to the initial delay: {}", at - now);
    }

    #[test]
    fn attempts_fail_over_through_the_addresses_and_wrap() {
        let mut core = StatsClientCore::new(&config()).unwrap();
        let mut tried = Vec::new();
        let mut now = 0;
        for _ in 0..7 {
            tried.push(core.poll_connect(now).unwrap());
            core.on_disconnected(now);
            now += 10_000;
        }
        let (a, b, c) = (addr(1), addr(2), addr(3));
        assert_eq!(tried, vec![a, b, c, a, b, c, a]);
    }

    #[test]
    fn a_reloaded_reporter_list_keeps_what_is_queued_and_is_used_from_the_next_attempt() {
        let mut core = connected(&config(), T0);
        core.push(A, nodes(2), T0);
        let mut c = config();
        c.addrs = vec![addr(9)];
        core.reconfigure(&c).unwrap();
        assert_eq!(core.link().connected(), Some(addr(1)), "kept");
        core.on_disconnected(T0 + 1);
        let Wake::At(at) = core.poll_timeout(T0 + 1) else {
            panic!()
        };
        assert_eq!(core.poll_connect(at), Some(addr(9)));
        core.on_connected(at);
        assert_eq!(
            transmit(&mut core, at).len(),
            1,
            "the queued statistics go out"
        );
        let mut bad = config();
        bad.addrs.clear();
        assert!(core.reconfigure(&bad).is_err());
        assert_accounted(&core);
    }

    #[test]
    fn a_lost_connection_moves_to_the_next_address() {
        let mut core = connected(&config(), 0);
        assert_eq!(core.link().connected(), Some(addr(1)));
        core.on_disconnected(5);
        assert_eq!(core.link().connected(), None);
        assert_eq!(core.link().current_addr(), addr(2));
        let s = core.stats();
        assert_eq!((s.connects, s.disconnects), (1, 1));
    }

    // --- flushing ---

    #[test]
    fn a_flush_makes_an_attempt_due_now_and_lifts_the_window() {
        let mut core = StatsClientCore::new(&config()).unwrap();
        core.poll_connect(0).unwrap();
        core.on_disconnected(0);
        for i in 0..6 {
            core.push(ModuleId::new(i, 0), nodes(1), T0);
        }
        assert_eq!(core.poll_connect(1), None, "backing off");
        core.start_flush(1);
        assert_eq!(core.poll_connect(1), Some(addr(2)));
        core.on_connected(1);
        assert_eq!(transmit(&mut core, 1).len(), 3, "past the window of 2");
        for seq in 1..=3 {
            ack(&mut core, seq, 2);
        }
        assert!(core.is_drained());
    }

    // --- accounting ---

    #[test]
    fn every_entry_is_accounted_for_whatever_happens() {
        for seed in 0..50 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut core = StatsClientCore::new(&config()).unwrap();
            let mut sent = Vec::new();
            for step in 0..300u64 {
                let now = T0 + step * 700;
                match rng.u8(0..8) {
                    0..=2 => {
                        core.push(ModuleId::new(rng.u32(..), 0), nodes(rng.u8(0..7)), now);
                    }
                    3 => {
                        if core.poll_connect(now).is_some() {
                            core.on_connected(now);
                        }
                    }
                    4 => {
                        if core.link().connected().is_some() {
                            core.on_disconnected(now);
                        }
                    }
                    5 => sent.extend(seqs(&transmit(&mut core, now))),
                    6 if !sent.is_empty() => {
                        let seq = sent.swap_remove(rng.usize(..sent.len()));
                        ack(&mut core, seq, now);
                    }
                    _ => {
                        let seq = rng.u64(0..core.next_seq + 1);
                        let frame = Encoder::new()
                            .error_resp(seq, A, RetCode::BadRequest, "no")
                            .to_vec();
                        if core.link().connected().is_some() {
                            core.on_frame(&frame, now).unwrap();
                        }
                    }
                }
                assert_accounted(&core);
                assert!(core.stats().queued <= 6);
                assert!(core.in_flight.len() <= 2);
            }
        }
    }
}
