//! The route client: the control core's TCP connection to the route servers
//! ("dnsserver"): versioned pulls, answers (whole, or "unchanged at the
//! version held"), pushes, periodic re-pulls, keep-alives, reconnection with
//! back-off and fail-over across the configured addresses.
//!
//! Two layers, as quinn-proto / quinn:
//!
//! - [`RouteClientCore`]: the protocol, pure. Time is an argument (`now`, in
//!   milliseconds from any fixed origin), bytes go in and out as slices; no
//!   sockets, no clocks, no randomness but a seeded generator. Everything
//!   subtle (deduplication, re-issue, versions, the re-pull schedule,
//!   liveness) is decided and tested here; the server list and back-off are
//!   [`super::reconnect`]'s.
//! - [`run`]: the glommio shell (`link_shell`, shared with the
//!   statistics client). It connects, moves bytes between the socket and the
//!   core, sleeps until the core's next deadline, and hands
//!   [`RouteClientEvent`]s to the caller. It decides nothing.
//!
//! The rules, in one place:
//!
//! - Every PullReq carries, for each module, the version the client holds
//!   (the newest it delivered, or the caller's via
//!   [`RouteClientCore::want_known`]; 0 for none). A module still at that
//!   version comes back in a RouteUnchanged: no event (the caller has the
//!   route), no nodes on the wire.
//! - Every module followed is pulled again [`RouteClientConfig::refresh_ms`]
//!   after its last answer, jittered down by up to a quarter and rounded up
//!   to [`REFRESH_TICK_MS`], from one heap of deadlines: the cost is the
//!   modules due, and modules due in one tick share PullReqs.
//!
//! Owns the wire conversation with the route server and nothing else: it
//! keeps no routes (the caller does, from the events), touches no shard and
//! no LB state, and must not grow policy about which modules to follow (the
//! caller says so with [`RouteClientCore::want`] and
//! [`RouteClientCore::forget`]).
//!
//! # Embedding
//!
//! The control core runs [`run`] as one task of its glommio executor:
//!
//! ```no_run
//! use glommio::channels::local_channel;
//! use lbagent_agent::routeclient::{run, RouteClientConfig, RouteClientEvent, RouteClientStatus};
//! use lbagent_model::ModuleId;
//!
//! glommio::LocalExecutorBuilder::default()
//!     .io_memory(512 << 10)
//!     .make()
//!     .unwrap()
//!     .run(async {
//!         let config = RouteClientConfig::new(vec!["127.0.0.1:7777".parse().unwrap()]);
//!         let (want_tx, want_rx) = local_channel::new_unbounded();
//!         let (event_tx, event_rx) = local_channel::new_unbounded();
//!         let status = RouteClientStatus::default();
//!         let (stop_tx, stop_rx) = local_channel::new_bounded::<()>(1);
//!         let shutdown = async move {
//!             let _ = stop_rx.recv().await;
//!         };
//!         let client = glommio::spawn_local(run(config, want_rx, event_tx, shutdown, status.clone()));
//!         want_tx.try_send(ModuleId::new(10001, 1)).unwrap();
//!         while let Some(event) = event_rx.recv().await {
//!             if let RouteClientEvent::Route(route) = event {
//!                 // install route.nodes for route.module, if route.version is newer
//!                 # let _ = route;
//!                 break;
//!             }
//!         }
//!         stop_tx.try_send(()).unwrap();
//!         client.await.unwrap();
//!     });
//! ```

use std::cell::{Cell, RefCell};
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::rc::Rc;
use std::time::Duration;

use glommio::channels::local_channel::{LocalReceiver, LocalSender};

use super::link_shell::{LinkCore, LinkShell};
use super::reconnect::{LinkState, Reconnect, ReconnectPolicy};
use super::timers::Timers;
use lbagent_model::{ModuleId, Policy, RouteNode};
use lbagent_wire::{
    decode, write_frame, DecodeError, Encoder, FrameError, Limits, Message, RetCode,
    ValidationError, MAX_PULL_MODULES,
};

// === config ===

/// The route client's settings. Times are milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteClientConfig {
    /// The route servers, in order of preference. The client starts with the
    /// first and moves to the next (wrapping around) after every failed
    /// attempt or lost connection. Shuffle it per host to spread a fleet.
    pub addrs: Vec<SocketAddr>,
    /// How long one connection attempt may take (default 1000).
    pub connect_timeout_ms: u64,
    /// Interval between KeepAlives while connected (default 5000); it must
    /// be well under the route server's subscription timeout.
    pub keepalive_ms: u64,
    /// A connection that receives nothing for this long while answers are
    /// due (pulls in flight, a KeepAlive unanswered) is dead (default 15000).
    pub idle_timeout_ms: u64,
    /// The first reconnection delay (default 100); it doubles per failed
    /// attempt up to [`Self::backoff_max_ms`].
    pub backoff_initial_ms: u64,
    /// The longest reconnection delay (default 5000).
    pub backoff_max_ms: u64,
    /// The most modules one PullReq names (default 1024; at most
    /// [`MAX_PULL_MODULES`]).
    pub max_modules_per_pull: usize,
    /// How often each module followed is pulled again, carrying the
    /// version held, as a safety net under the pushes (default 15000, the
    /// seed's update_timeout; 0: never). Each module's next re-pull is due
    /// this long after its last answer, jittered down by up to a quarter
    /// and rounded up to [`REFRESH_TICK_MS`], so that modules answered
    /// together drift apart and every tick's due modules share PullReqs.
    pub refresh_ms: u64,
    /// Seed of the back-off jitter. [`RouteClientConfig::new`] draws it at
    /// random so that a fleet's agents do not reconnect in step; tests fix it.
    pub jitter_seed: u64,
}

impl RouteClientConfig {
    /// The defaults for `addrs`, with a random jitter seed.
    pub fn new(addrs: Vec<SocketAddr>) -> Self {
        RouteClientConfig {
            addrs,
            connect_timeout_ms: 1000,
            keepalive_ms: 5000,
            idle_timeout_ms: 15_000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5000,
            max_modules_per_pull: 1024,
            refresh_ms: 15_000,
            jitter_seed: fastrand::u64(..),
        }
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`RouteConfigError::NoAddrs`] for an empty address list,
    /// [`RouteConfigError::OutOfRange`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), RouteConfigError> {
        if self.addrs.is_empty() {
            return Err(RouteConfigError::NoAddrs);
        }
        let checks: [(&'static str, u64, bool, &'static str); 6] = [
            (
                "connect_timeout_ms",
                self.connect_timeout_ms,
                self.connect_timeout_ms > 0,
                "at least 1",
            ),
            (
                "keepalive_ms",
                self.keepalive_ms,
                self.keepalive_ms > 0,
                "at least 1",
            ),
            (
                "idle_timeout_ms",
                self.idle_timeout_ms,
                self.idle_timeout_ms > self.keepalive_ms,
                "more than keepalive_ms",
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
                "max_modules_per_pull",
                self.max_modules_per_pull as u64,
                (1..=MAX_PULL_MODULES).contains(&self.max_modules_per_pull),
                "1..=65536",
            ),
        ];
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, allowed)) => Err(RouteConfigError::OutOfRange {
                field,
                value,
                allowed,
            }),
            None => Ok(()),
        }
    }
}

impl RouteClientConfig {
    /// The servers and back-off, for [`Reconnect`].
    fn reconnect_policy(&self) -> ReconnectPolicy {
        ReconnectPolicy {
            addrs: self.addrs.clone(),
            backoff_initial_ms: self.backoff_initial_ms,
            backoff_max_ms: self.backoff_max_ms,
        }
    }
}

/// Why a [`RouteClientConfig`] is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteConfigError {
    /// `addrs` is empty.
    #[error("route client addrs is empty: configure at least one route server address")]
    NoAddrs,
    /// A field is outside its allowed range.
    #[error("route client {field} is {value}: must be {allowed}")]
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

/// One module's route as the route server sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteEvent {
    /// The module.
    pub module: ModuleId,
    /// False: the route server has no such module (or deleted it).
    pub exists: bool,
    /// The route's version; it changes whenever the nodes do. An event may
    /// repeat a version already seen (a push and an answer crossing, a
    /// re-pull after reconnecting): keep the newer.
    pub version: u64,
    /// The nodes, as sent (empty when `exists` is false).
    pub nodes: Vec<RouteNode>,
    /// True for a RoutePush (sent unasked), false for a RouteAnswer.
    pub pushed: bool,
    /// The module's policy (an unknown code, from a newer route server,
    /// reads as `l5`).
    pub policy: Policy,
}

/// An ErrorResp: the route server refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerError {
    /// The refused request's sequence number (0: it could not be read).
    pub seq: u64,
    /// The module the error names ((0, 0) when none).
    pub module: ModuleId,
    /// Why, as a code.
    pub retcode: RetCode,
    /// Why, in words.
    pub message: String,
    /// The modules of the refused PullReq: no longer in flight, and not
    /// pulled again unless wanted again.
    pub dropped: Vec<ModuleId>,
}

/// What the route client tells its caller.
#[derive(Debug)]
pub enum RouteClientEvent {
    /// A module's route arrived (answer or push).
    Route(RouteEvent),
    /// The route server refused a request; log it.
    ServerError(ServerError),
    /// Connected to this route server (shell only).
    Connected(SocketAddr),
    /// A connection attempt failed; the next one follows the back-off
    /// (shell only).
    ConnectFailed {
        /// The address tried.
        addr: SocketAddr,
        /// Why it failed.
        error: RouteClientError,
    },
    /// An established connection ended; pulls in flight will be re-issued
    /// (shell only).
    Disconnected {
        /// The route server's address.
        addr: SocketAddr,
        /// Why the connection ended.
        error: RouteClientError,
    },
}

/// Why a connection to a route server ends. Every variant means: close the
/// connection; the client reconnects per its back-off.
#[derive(Debug, thiserror::Error)]
pub enum RouteClientError {
    /// The byte stream is not a sequence of frames.
    #[error("bad frame from the route server: {0}")]
    Frame(#[from] FrameError),
    /// A frame is not a valid message.
    #[error("undecodable message from the route server: {0}")]
    Decode(#[from] DecodeError),
    /// A message whose fields break the protocol's rules (a RouteUnchanged
    /// whose versions are not one per module).
    #[error("invalid message from the route server: {0}")]
    Invalid(#[from] ValidationError),
    /// A valid message that a route server never sends to an agent.
    #[error("unexpected {0} from the route server: only RouteAnswer, RouteUnchanged, RoutePush, KeepAliveAck and ErrorResp belong on this connection")]
    Unexpected(&'static str),
    /// Nothing arrived for `idle_timeout_ms` while answers were due.
    #[error("route server silent for {0} ms while answers were due")]
    Idle(u64),
    /// The route server closed the connection.
    #[error("route server closed the connection")]
    Closed,
    /// A socket call failed (connect, read, write, or a write that could
    /// not proceed for `idle_timeout_ms`).
    #[error("route server connection i/o failed: {0}")]
    Io(#[from] io::Error),
}

/// Counters for metrics, kept by [`RouteClientCore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteClientStats {
    /// Connections established.
    pub connects: u64,
    /// Connection attempts failed or connections lost.
    pub disconnects: u64,
    /// PullReq frames sent.
    pub pull_reqs: u64,
    /// Modules named in PullReqs sent (re-issues included).
    pub modules_pulled: u64,
    /// Modules pulled again by the refresh timer ([`RouteClientConfig::refresh_ms`]).
    pub refreshes: u64,
    /// RouteAnswers accepted.
    pub answers: u64,
    /// Nodes received in accepted RouteAnswers and RoutePushes.
    pub nodes_received: u64,
    /// Modules a RouteUnchanged confirmed at the version held (no nodes sent).
    pub unchanged: u64,
    /// RouteAnswers dropped (no pull of that module and sequence in
    /// flight), and RoutePushes of modules no longer followed.
    pub stale_answers: u64,
    /// Modules named in Unsubscribe frames sent.
    pub unsubscribed: u64,
    /// RoutePushes received.
    pub pushes: u64,
    /// ErrorResps received.
    pub server_errors: u64,
    /// KeepAlives sent.
    pub keepalives: u64,
    /// KeepAliveAcks received.
    pub keepalive_acks: u64,
}

pub use super::reconnect::Wake;

// === the core ===

/// The granularity of re-pull deadlines, ms: a low-precision timer (seed
/// 003), so that the modules due within one tick leave in one PullReq.
pub const REFRESH_TICK_MS: u64 = 250;

/// No re-pull scheduled.
const NO_REFRESH: u64 = u64::MAX;

/// What the client knows of a module it follows: the newest version it
/// delivered (or was told the caller holds), and its re-pull deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    version: u64,
    /// When the module is pulled again ([`NO_REFRESH`]: not scheduled,
    /// e.g. while a pull is queued or in flight). A [`Timers`] entry whose
    /// deadline is not this one is stale.
    refresh_at: u64,
}

/// Where one wanted module stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pull {
    /// Queued, not sent on the current connection.
    Wanted,
    /// Sent in PullReq `seq`, not answered yet.
    InFlight { seq: u64 },
}

/// The route client's protocol state, without I/O: see the module docs.
#[derive(Debug)]
pub struct RouteClientCore {
    config: RouteClientConfig,
    /// The server list, the rotation and the back-off.
    link: Reconnect,
    /// The re-pull jitter.
    rng: fastrand::Rng,
    /// Every module wanted and not answered.
    pulls: HashMap<ModuleId, Pull>,
    /// The `Wanted` modules, in the order to send them. May hold modules
    /// whose state has since changed; they are skipped.
    queue: VecDeque<ModuleId>,
    /// PullReqs in flight: seq -> the modules it named.
    /// The count is how many of them still wait for their answer.
    batches: BTreeMap<u64, (Vec<ModuleId>, usize)>,
    /// Modules answered: the server subscribed us to them, and a new
    /// connection must subscribe again.
    subscribed: BTreeSet<ModuleId>,
    /// The version held of every module followed with one, and its re-pull.
    held: HashMap<ModuleId, Held>,
    /// Re-pull deadlines (lazy deletion: see [`Held::refresh_at`]).
    refresh: Timers<ModuleId>,
    /// Modules forgotten while the server held (or was about to hold) a
    /// subscription on this connection: sent in the next Unsubscribe.
    unsubscribe: Vec<ModuleId>,
    next_seq: u64,
    next_keepalive_at: u64,
    /// The KeepAlive sent last, while unanswered.
    keepalive_due: Option<u64>,
    /// Since when answers are due with nothing received (None: none due).
    waiting_since: Option<u64>,
    encoder: Encoder,
    scratch: Vec<ModuleId>,
    /// The versions held of `scratch`'s modules, one each (0: none).
    scratch_versions: Vec<u64>,
    stats: RouteClientStats,
}

impl RouteClientCore {
    /// A core for `config`, disconnected, its first attempt due at once.
    ///
    /// # Errors
    /// What [`RouteClientConfig::validate`] returns.
    pub fn new(config: &RouteClientConfig) -> Result<Self, RouteConfigError> {
        config.validate()?;
        Ok(RouteClientCore {
            config: config.clone(),
            link: Reconnect::new(config.reconnect_policy(), config.jitter_seed),
            rng: fastrand::Rng::with_seed(config.jitter_seed.rotate_left(17)),
            pulls: HashMap::new(),
            queue: VecDeque::new(),
            batches: BTreeMap::new(),
            subscribed: BTreeSet::new(),
            held: HashMap::new(),
            refresh: Timers::new(),
            unsubscribe: Vec::new(),
            next_seq: 1,
            next_keepalive_at: 0,
            keepalive_due: None,
            waiting_since: None,
            encoder: Encoder::new(),
            scratch: Vec::new(),
            scratch_versions: Vec::new(),
            stats: RouteClientStats::default(),
        })
    }

    /// Asks for `module`'s route: it is sent with the next
    /// [`Self::poll_transmit`] while connected, else after connecting.
    /// Returns false, and does nothing, when a pull of `module` is already
    /// queued or in flight.
    pub fn want(&mut self, module: ModuleId) -> bool {
        match self.pulls.entry(module) {
            Entry::Occupied(_) => false,
            Entry::Vacant(slot) => {
                slot.insert(Pull::Wanted);
                self.queue.push_back(module);
                // The pull's answer schedules the next re-pull.
                if let Some(h) = self.held.get_mut(&module) {
                    h.refresh_at = NO_REFRESH;
                }
                true
            }
        }
    }

    /// As [`Self::want`], for a module whose route the caller already holds
    /// at `version` (from the snapshot at start): the pull carries it, and a
    /// route server that still has that version answers without nodes.
    pub fn want_known(&mut self, module: ModuleId, version: u64) -> bool {
        let held = self.held.entry(module).or_insert(Held {
            version,
            refresh_at: NO_REFRESH,
        });
        held.version = held.version.max(version);
        self.want(module)
    }

    /// The version of `module` the client holds (0: none), as its pulls
    /// carry it.
    pub fn held_version(&self, module: ModuleId) -> u64 {
        self.held.get(&module).map_or(0, |h| h.version)
    }

    /// When `module` is pulled again by the refresh timer, if scheduled.
    pub fn refresh_due(&self, module: ModuleId) -> Option<u64> {
        let at = self.held.get(&module)?.refresh_at;
        (at != NO_REFRESH).then_some(at)
    }

    /// Records that the caller now holds `module` at `version` (an answer,
    /// a push or a RouteUnchanged delivered) and, when the answer settled a
    /// pull, schedules its next re-pull from `now`.
    fn hold(&mut self, module: ModuleId, version: u64, now: u64, reschedule: bool) {
        let held = self.held.entry(module).or_insert(Held {
            version,
            refresh_at: NO_REFRESH,
        });
        held.version = held.version.max(version);
        if reschedule && self.config.refresh_ms > 0 && held.refresh_at == NO_REFRESH {
            let every = self.config.refresh_ms;
            let at = now
                .saturating_add(every - self.rng.u64(0..=every / 4))
                .div_ceil(REFRESH_TICK_MS)
                .saturating_mul(REFRESH_TICK_MS);
            held.refresh_at = at;
            self.refresh.schedule(at, module);
        }
    }

    /// Queues every module whose re-pull is due at `now` (stale timer
    /// entries are dropped on the way).
    fn queue_due_refreshes(&mut self, now: u64) {
        while let Some((at, module)) = self.refresh.pop_due(now) {
            let due = match self.held.get_mut(&module) {
                Some(h) if h.refresh_at == at => {
                    h.refresh_at = NO_REFRESH;
                    true
                }
                _ => false,
            };
            if due && self.want(module) {
                self.stats.refreshes += 1;
            }
        }
    }

    /// Stops following `module`: no re-subscription after reconnecting,
    /// a pull queued or in flight is dropped (its answer, if it still
    /// comes, is stale), and when the server holds a subscription on this
    /// connection (or will, answering a pull in flight) an Unsubscribe
    /// goes with the next [`Self::poll_transmit`]. Pushes for it that
    /// still arrive are dropped. Returns whether the module was known.
    pub fn forget(&mut self, module: ModuleId) -> bool {
        self.held.remove(&module);
        let subscribed = self.subscribed.remove(&module);
        let pull = self.pulls.remove(&module);
        let in_flight = matches!(pull, Some(Pull::InFlight { .. }));
        if let Some(Pull::InFlight { seq }) = pull {
            self.close_batch_if_done(seq);
        }
        if self.link.is_connected() && (subscribed || in_flight) {
            self.unsubscribe.push(module);
        }
        subscribed || pull.is_some()
    }

    /// Whether the client follows `module` (subscribed, or a pull queued
    /// or in flight).
    pub fn follows(&self, module: ModuleId) -> bool {
        self.subscribed.contains(&module) || self.pulls.contains_key(&module)
    }

    /// Whether a pull of `module` is queued or in flight.
    pub fn is_pending(&self, module: ModuleId) -> bool {
        self.pulls.contains_key(&module)
    }

    /// Whether a pull of `module` was sent on this connection and not answered.
    pub fn is_in_flight(&self, module: ModuleId) -> bool {
        matches!(self.pulls.get(&module), Some(Pull::InFlight { .. }))
    }

    /// The connection state and server list (which server is connected,
    /// or being connected to, or next to try).
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

    /// The counters.
    pub fn stats(&self) -> RouteClientStats {
        self.stats
    }

    /// The address to connect to now, when disconnected and the back-off
    /// has elapsed; the core then waits for [`Self::on_connected`] or
    /// [`Self::on_disconnected`].
    pub fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        self.link.poll_connect(now)
    }

    /// Takes a reloaded configuration: the server list and back-off (from
    /// the next attempt on; the connection in place is kept), the
    /// keep-alive, idle and re-pull intervals (from their next use), the
    /// batch size. The jitter seed is kept.
    ///
    /// # Errors
    /// What [`RouteClientConfig::validate`] returns; nothing changes then.
    pub fn reconfigure(&mut self, config: &RouteClientConfig) -> Result<(), RouteConfigError> {
        config.validate()?;
        self.link.reconfigure(config.reconnect_policy());
        self.config = RouteClientConfig {
            jitter_seed: self.config.jitter_seed,
            ..config.clone()
        };
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> &RouteClientConfig {
        &self.config
    }

    /// The connection to [`Reconnect::current_addr`] is up: every module queued
    /// or in flight on the lost connection, and every module subscribed
    /// before, is pulled on it.
    pub fn on_connected(&mut self, now: u64) {
        self.requeue_in_flight();
        // Every module followed is pulled now (carrying its version), and
        // its answer schedules its next re-pull: drop the old deadlines.
        self.refresh = Timers::new();
        for h in self.held.values_mut() {
            h.refresh_at = NO_REFRESH;
        }
        let subscribed = std::mem::take(&mut self.subscribed);
        for &module in &subscribed {
            self.want(module);
        }
        self.subscribed = subscribed;
        self.link.on_connected();
        self.stats.connects += 1;
        self.next_keepalive_at = now.saturating_add(self.config.keepalive_ms);
        self.keepalive_due = None;
        self.waiting_since = None;
    }

    /// The connection (or the attempt) ended: pulls in flight go back to
    /// the queue, the next attempt goes to the next address after a
    /// back-off of `min(max, initial * 2^failures)`, jittered down by up to
    /// half.
    pub fn on_disconnected(&mut self, now: u64) {
        self.requeue_in_flight();
        // A new connection starts without subscriptions.
        self.unsubscribe.clear();
        self.link.on_disconnected(now);
        self.keepalive_due = None;
        self.waiting_since = None;
        self.stats.disconnects += 1;
    }

    /// Moves every in-flight pull back to the front of the queue, in the
    /// order it was sent.
    fn requeue_in_flight(&mut self) {
        let mut requeued = Vec::new();
        for (_, (modules, _)) in std::mem::take(&mut self.batches) {
            for module in modules {
                if let Some(pull @ Pull::InFlight { .. }) = self.pulls.get_mut(&module) {
                    *pull = Pull::Wanted;
                    requeued.push(module);
                }
            }
        }
        for module in requeued.into_iter().rev() {
            self.queue.push_front(module);
        }
    }

    /// Appends to `out` every frame due now: an Unsubscribe for modules
    /// forgotten, PullReqs for the queued modules
    /// ([`RouteClientConfig::max_modules_per_pull`] each) and a KeepAlive when one is due. Returns the number of frames appended;
    /// none while not connected.
    pub fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize {
        if !self.link.is_connected() {
            return 0;
        }
        let mut frames = 0;
        // Unsubscribes first: a module forgotten and wanted again since
        // must end subscribed.
        for chunk in self.unsubscribe.chunks(MAX_PULL_MODULES) {
            let frame = self.encoder.unsubscribe(chunk);
            write_frame(out, frame)
                .expect("an Unsubscribe of at most MAX_PULL_MODULES modules fits");
            self.stats.unsubscribed += chunk.len() as u64;
            frames += 1;
        }
        self.unsubscribe.clear();
        self.queue_due_refreshes(now);
        while self.fill_batch(self.next_seq) {
            let seq = self.take_seq();
            let frame = self
                .encoder
                .pull_req_known(seq, &self.scratch, &self.scratch_versions);
            write_frame(out, frame).expect("a PullReq of at most MAX_PULL_MODULES modules fits");
            self.stats.pull_reqs += 1;
            self.stats.modules_pulled += self.scratch.len() as u64;
            let sent = std::mem::take(&mut self.scratch);
            let left = sent.len();
            self.batches.insert(seq, (sent, left));
            self.waiting_since.get_or_insert(now);
            frames += 1;
        }
        if now >= self.next_keepalive_at {
            let seq = self.take_seq();
            write_frame(out, self.encoder.keep_alive(seq)).expect("a KeepAlive fits a frame");
            self.keepalive_due = Some(seq);
            self.next_keepalive_at = now.saturating_add(self.config.keepalive_ms);
            self.waiting_since.get_or_insert(now);
            self.stats.keepalives += 1;
            frames += 1;
        }
        frames
    }

    /// Moves up to one PullReq's worth of queued modules into `scratch`,
    /// each marked in flight in PullReq `seq`; false when none is queued.
    fn fill_batch(&mut self, seq: u64) -> bool {
        self.scratch.clear();
        self.scratch_versions.clear();
        while self.scratch.len() < self.config.max_modules_per_pull {
            let Some(module) = self.queue.pop_front() else {
                break;
            };
            // Skip entries forgotten or already taken (sent, or in this
            // batch) since they were queued.
            if let Some(pull @ Pull::Wanted) = self.pulls.get_mut(&module) {
                *pull = Pull::InFlight { seq };
                self.scratch.push(module);
                let version = self.held.get(&module).map_or(0, |h| h.version);
                self.scratch_versions.push(version);
            }
        }
        !self.scratch.is_empty()
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Handles one frame's payload received at `now`.
    ///
    /// Returns a [`RouteClientEvent::Route`] for a RouteAnswer (of a pull in
    /// flight) or a RoutePush, a [`RouteClientEvent::ServerError`] for an
    /// ErrorResp, and nothing for a KeepAliveAck or a stale answer.
    ///
    /// # Errors
    /// [`RouteClientError::Decode`] when the verifier refuses the frame,
    /// [`RouteClientError::Unexpected`] for a message that is not the route
    /// server's to send. Either means: close the connection.
    pub fn on_frame(
        &mut self,
        frame: &[u8],
        now: u64,
    ) -> Result<Option<RouteClientEvent>, RouteClientError> {
        let message = decode(frame, &Limits::TCP_FRAME)?;
        let event = match message {
            Message::RouteAnswer(m) => {
                let module = ModuleId::new(m.modid(), m.cmdid());
                if self.pulls.get(&module) != Some(&Pull::InFlight { seq: m.seq() }) {
                    self.stats.stale_answers += 1;
                    None
                } else {
                    self.answered(module, m.seq());
                    self.hold(module, m.version(), now, true);
                    self.stats.answers += 1;
                    let nodes = m.nodes().unwrap_or_default().iter().map(RouteNode::from);
                    let nodes: Vec<RouteNode> = nodes.collect();
                    self.stats.nodes_received += nodes.len() as u64;
                    Some(RouteClientEvent::Route(RouteEvent {
                        module,
                        exists: m.exists(),
                        version: m.version(),
                        nodes,
                        pushed: false,
                        policy: Policy::from_code(m.policy()).unwrap_or_default(),
                    }))
                }
            }
            Message::RoutePush(m) if !self.follows(ModuleId::new(m.modid(), m.cmdid())) => {
                // Forgotten: the server has not read our Unsubscribe yet.
                self.stats.stale_answers += 1;
                None
            }
            Message::RoutePush(m) => {
                let module = ModuleId::new(m.modid(), m.cmdid());
                let settles = match self.pulls.get(&module) {
                    Some(&Pull::InFlight { seq }) => Some(seq),
                    _ => None,
                };
                if let Some(seq) = settles {
                    // The push carries a route at least as new as the answer.
                    self.answered(module, seq);
                }
                self.hold(module, m.version(), now, settles.is_some());
                self.stats.pushes += 1;
                let nodes = m.nodes().unwrap_or_default().iter().map(RouteNode::from);
                let nodes: Vec<RouteNode> = nodes.collect();
                self.stats.nodes_received += nodes.len() as u64;
                Some(RouteClientEvent::Route(RouteEvent {
                    module,
                    exists: m.exists(),
                    version: m.version(),
                    nodes,
                    pushed: true,
                    policy: Policy::from_code(m.policy()).unwrap_or_default(),
                }))
            }
            Message::RouteUnchanged(m) => {
                let unchanged = m.validate()?;
                let seq = unchanged.seq;
                for (module, version) in unchanged.modules() {
                    if self.pulls.get(&module) != Some(&Pull::InFlight { seq }) {
                        self.stats.stale_answers += 1;
                        continue;
                    }
                    self.answered(module, seq);
                    self.hold(module, version, now, true);
                    self.stats.unchanged += 1;
                }
                None
            }
            Message::KeepAliveAck(m) => {
                if self.keepalive_due == Some(m.seq()) {
                    self.keepalive_due = None;
                }
                self.stats.keepalive_acks += 1;
                None
            }
            Message::ErrorResp(m) => {
                let seq = m.seq();
                if self.keepalive_due == Some(seq) {
                    self.keepalive_due = None;
                }
                let dropped = self.batches.remove(&seq).unwrap_or_default().0;
                let dropped: Vec<ModuleId> = dropped
                    .into_iter()
                    .filter(|m| self.pulls.get(m) == Some(&Pull::InFlight { seq }))
                    .collect();
                for module in &dropped {
                    self.pulls.remove(module);
                    if self.subscribed.contains(module) {
                        // A re-pull refused: try again at the next round.
                        let version = self.held_version(*module);
                        self.hold(*module, version, now, true);
                    }
                }
                self.stats.server_errors += 1;
                Some(RouteClientEvent::ServerError(ServerError {
                    seq,
                    module: ModuleId::new(m.modid(), m.cmdid()),
                    retcode: m.retcode(),
                    message: m.message().unwrap_or_default().to_string(),
                    dropped,
                }))
            }
            other => return Err(RouteClientError::Unexpected(other.name())),
        };
        // The server is alive and the connection healthy: reset the back-off.
        self.link.on_healthy();
        self.waiting_since = self.awaiting_answers().then_some(now);
        Ok(event)
    }

    /// Clears `module`'s pull, sent in `seq`, and records the subscription.
    fn answered(&mut self, module: ModuleId, seq: u64) {
        self.pulls.remove(&module);
        self.subscribed.insert(module);
        self.close_batch_if_done(seq);
    }

    /// One module of PullReq `seq` no longer waits for it (answered, or
    /// forgotten); forgets the request once none does. O(1): a batch of
    /// 1024 modules answered one by one costs 1024 steps, not 1024².
    fn close_batch_if_done(&mut self, seq: u64) {
        if let Some((_, left)) = self.batches.get_mut(&seq) {
            *left -= 1;
            if *left == 0 {
                self.batches.remove(&seq);
            }
        }
    }

    /// Whether anything sent on this connection still waits for an answer.
    fn awaiting_answers(&self) -> bool {
        self.keepalive_due.is_some() || !self.batches.is_empty()
    }

    /// The earliest re-pull deadline held (it may be stale: waking for it
    /// only drops it).
    fn next_refresh(&self) -> u64 {
        self.refresh.next_deadline().unwrap_or(NO_REFRESH)
    }

    /// When the shell must call in again: the next connection attempt, the
    /// next KeepAlive, or the idle deadline, whichever is first; or
    /// [`Wake::Drop`] when the connection is dead.
    pub fn poll_timeout(&self, now: u64) -> Wake {
        match self.link.state() {
            LinkState::Idle { next_attempt_at } => Wake::At(next_attempt_at),
            LinkState::Connecting => Wake::Never,
            LinkState::Connected => match self.waiting_since {
                Some(since) if now >= since.saturating_add(self.config.idle_timeout_ms) => {
                    Wake::Drop
                }
                Some(since) => Wake::At(
                    self.next_keepalive_at
                        .min(since.saturating_add(self.config.idle_timeout_ms))
                        .min(self.next_refresh()),
                ),
                None => Wake::At(self.next_keepalive_at.min(self.next_refresh())),
            },
        }
    }
}

// === the glommio shell ===

/// What the caller asks of [`run`] over its `wants` channel. A bare
/// [`ModuleId`] is a pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Pull this module and follow it ([`RouteClientCore::want`]).
    Pull(ModuleId),
    /// Stop following it ([`RouteClientCore::forget`]).
    Forget(ModuleId),
}

impl From<ModuleId> for Want {
    fn from(module: ModuleId) -> Want {
        Want::Pull(module)
    }
}

/// The connection state for metrics, shared between [`run`] and its
/// caller on the same executor (an `Rc`, not `Send`).
#[derive(Clone, Debug, Default)]
pub struct RouteClientStatus {
    inner: Rc<StatusInner>,
}

#[derive(Debug, Default)]
struct StatusInner {
    connected: Cell<Option<SocketAddr>>,
    /// A new address list from a configuration reload, for [`run`] to take.
    new_addrs: RefCell<Option<Vec<SocketAddr>>>,
    stats: Cell<RouteClientStats>,
    /// A re-pull period to apply at the client's next step.
    new_refresh: Cell<Option<u64>>,
}

impl RouteClientStatus {
    /// The route server connected to, if any.
    pub fn connected(&self) -> Option<SocketAddr> {
        self.inner.connected.get()
    }

    /// The counters, as of the last I/O.
    pub fn stats(&self) -> RouteClientStats {
        self.inner.stats.get()
    }

    /// Replaces the route servers (a configuration reload): taken at the client's
    /// next wake-up (at most `keepalive_ms` while connected, the back-off while not); a connection up now is
    /// kept until it ends. An empty list is ignored.
    pub fn set_addrs(&self, addrs: Vec<SocketAddr>) {
        if !addrs.is_empty() {
            *self.inner.new_addrs.borrow_mut() = Some(addrs);
        }
    }

    /// Sets the re-pull period (a reload of `lb.update_timeout`): from each
    /// module's next scheduling on (0: no more re-pulls).
    pub fn set_refresh_ms(&self, refresh_ms: u64) {
        self.inner.new_refresh.set(Some(refresh_ms));
    }

    /// Applies a pending reload and publishes the core's state.
    fn sync(&self, core: &mut RouteClientCore) {
        if let Some(addrs) = self.inner.new_addrs.borrow_mut().take() {
            core.set_addrs(addrs);
        }
        if let Some(refresh_ms) = self.inner.new_refresh.take() {
            core.config.refresh_ms = refresh_ms;
        }
        self.inner.connected.set(core.link().connected());
        self.inner.stats.set(core.stats());
    }
}

/// Runs the route client until `shutdown` completes or `events` is closed.
///
/// Must run inside a glommio `LocalExecutor`. The caller sends the modules
/// it needs on `wants` (deduplicated here; a closed `wants` only stops new
/// pulls) and receives every [`RouteClientEvent`] on `events`; `status`
/// shows the connection for metrics. Both channels are glommio
/// `local_channel`s: the client and the rest of the control core share one
/// executor, so a same-thread channel costs no atomics, and a bounded
/// `events` channel gives back-pressure (the client stops reading from the
/// socket while it is full). Routes are only delivered, never kept.
///
/// # Errors
/// [`RouteConfigError`] when `config` is invalid; nothing else: connection
/// failures are reported as events and retried.
pub async fn run<W: Into<Want>>(
    config: RouteClientConfig,
    wants: LocalReceiver<W>,
    events: LocalSender<RouteClientEvent>,
    shutdown: impl Future<Output = ()>,
    status: RouteClientStatus,
) -> Result<(), RouteConfigError> {
    let core = RouteClientCore::new(&config)?;
    let sync = {
        let status = status.clone();
        Box::new(move |core: &mut RouteClientCore| status.sync(core))
    };
    let mut shell = LinkShell::new(
        core,
        0,
        Duration::from_millis(config.connect_timeout_ms),
        Duration::from_millis(config.idle_timeout_ms),
        wants,
        events,
        sync,
    );
    shell.run(pin!(shutdown)).await;
    status.inner.connected.set(None);
    Ok(())
}

// === impl LinkCore ===

impl LinkCore for RouteClientCore {
    type Input = Want;
    type Event = RouteClientEvent;
    type Error = RouteClientError;

    fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        RouteClientCore::poll_connect(self, now)
    }
    fn on_connected(&mut self, now: u64) {
        RouteClientCore::on_connected(self, now)
    }
    fn on_disconnected(&mut self, now: u64) {
        RouteClientCore::on_disconnected(self, now)
    }
    fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize {
        RouteClientCore::poll_transmit(self, now, out)
    }
    fn on_frame(
        &mut self,
        frame: &[u8],
        now: u64,
    ) -> Result<Option<RouteClientEvent>, Self::Error> {
        RouteClientCore::on_frame(self, frame, now)
    }
    fn poll_timeout(&self, now: u64) -> Wake {
        RouteClientCore::poll_timeout(self, now)
    }
    fn on_input(&mut self, want: Want, _now: u64) {
        match want {
            Want::Pull(module) => self.want(module),
            Want::Forget(module) => self.forget(module),
        };
    }
    fn timed_out(&self) -> RouteClientError {
        RouteClientError::Idle(self.config.idle_timeout_ms)
    }
    fn closed(&self) -> RouteClientError {
        RouteClientError::Closed
    }
    fn connected_event(&self, addr: SocketAddr) -> RouteClientEvent {
        RouteClientEvent::Connected(addr)
    }
    fn connect_failed_event(&self, addr: SocketAddr, error: RouteClientError) -> RouteClientEvent {
        RouteClientEvent::ConnectFailed { addr, error }
    }
    fn disconnected_event(&self, addr: SocketAddr, error: RouteClientError) -> RouteClientEvent {
        RouteClientEvent::Disconnected { addr, error }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_model::NodeAddr;
    use lbagent_wire::FrameDecoder;
    use std::net::Ipv4Addr;

    const A: ModuleId = ModuleId::new(1, 1);
    const B: ModuleId = ModuleId::new(2, 1);
    const C: ModuleId = ModuleId::new(3, 1);

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn config() -> RouteClientConfig {
        RouteClientConfig {
            addrs: vec![addr(1), addr(2), addr(3)],
            connect_timeout_ms: 100,
            keepalive_ms: 1000,
            idle_timeout_ms: 3000,
            backoff_initial_ms: 100,
            backoff_max_ms: 5000,
            max_modules_per_pull: 2,
            refresh_ms: 0,
            jitter_seed: 7,
        }
    }

    fn node(last: u8) -> RouteNode {
        RouteNode {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), 9000),
            weight: u32::from(last),
        }
    }

    /// A core connected at `now`.
    fn connected(config: &RouteClientConfig, now: u64) -> RouteClientCore {
        let mut core = RouteClientCore::new(config).unwrap();
        assert!(core.poll_connect(now).is_some());
        core.on_connected(now);
        core
    }

    /// What the core sent: (seq, modules) per PullReq, seq per KeepAlive.
    #[derive(Debug, Default, PartialEq)]
    struct Sent {
        pulls: Vec<(u64, Vec<ModuleId>)>,
        keepalives: Vec<u64>,
        /// The versions each PullReq carried, one per module.
        known: Vec<Vec<u64>>,
    }

    fn transmit(core: &mut RouteClientCore, now: u64) -> Sent {
        let mut out = Vec::new();
        let count = core.poll_transmit(now, &mut out);
        let mut frames = FrameDecoder::default();
        frames.feed(&out);
        let mut sent = Sent::default();
        while let Some(frame) = frames.next_frame().unwrap() {
            match decode(frame, &Limits::TCP_FRAME).unwrap() {
                Message::PullReq(m) => {
                    let p = m.validate().unwrap();
                    sent.pulls.push((p.seq, p.modules().collect()));
                    assert!(p.carries_versions(), "every pull carries versions");
                    sent.known
                        .push(p.modules_known().map(|(_, v)| v.unwrap()).collect());
                }
                Message::KeepAlive(m) => sent.keepalives.push(m.seq()),
                other => panic!("the client sent {}", other.name()),
            }
        }
        assert_eq!(count, sent.pulls.len() + sent.keepalives.len());
        sent
    }

    fn answer(seq: u64, module: ModuleId, version: u64, nodes: &[RouteNode]) -> Vec<u8> {
        Encoder::new()
            .route_answer(seq, module, !nodes.is_empty(), version, nodes)
            .to_vec()
    }

    fn route(event: Option<RouteClientEvent>) -> RouteEvent {
        match event {
            Some(RouteClientEvent::Route(r)) => r,
            other => panic!("expected a route, got {other:?}"),
        }
    }

    // --- config ---

    #[test]
    fn the_defaults_are_valid() {
        RouteClientConfig::new(vec![addr(1)]).validate().unwrap();
    }

    #[test]
    fn a_config_without_addresses_or_with_a_bad_range_is_refused() {
        let mut c = config();
        c.addrs.clear();
        assert_eq!(c.validate(), Err(RouteConfigError::NoAddrs));
        let mut c = config();
        c.idle_timeout_ms = c.keepalive_ms;
        assert!(matches!(
            c.validate(),
            Err(RouteConfigError::OutOfRange {
                field: "idle_timeout_ms",
                ..
            })
        ));
        let mut c = config();
        c.backoff_max_ms = c.backoff_initial_ms - 1;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("backoff_max_ms"));
        let mut c = config();
        c.max_modules_per_pull = MAX_PULL_MODULES + 1;
        assert!(RouteClientCore::new(&c).is_err());
    }

    // --- pulls ---

    #[test]
    fn a_module_wanted_twice_is_pulled_once() {
        let mut core = connected(&config(), 0);
        assert!(core.want(A));
        assert!(!core.want(A), "queued: not wanted again");
        let sent = transmit(&mut core, 0);
        assert_eq!(sent.pulls, vec![(1, vec![A])]);
        assert!(core.is_in_flight(A));
        assert!(!core.want(A), "in flight: not re-sent");
        assert_eq!(transmit(&mut core, 1), Sent::default());
    }

    #[test]
    fn an_answered_module_can_be_pulled_again() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        route(core.on_frame(&answer(1, A, 3, &[node(1)]), 5).unwrap());
        assert!(!core.is_pending(A));
        assert!(core.want(A));
        assert_eq!(transmit(&mut core, 6).pulls, vec![(2, vec![A])]);
    }

    #[test]
    fn wanted_modules_are_batched_up_to_the_limit() {
        let mut core = connected(&config(), 0);
        for m in [A, B, C] {
            core.want(m);
        }
        let sent = transmit(&mut core, 0);
        assert_eq!(sent.pulls, vec![(1, vec![A, B]), (2, vec![C])]);
        assert_eq!(core.stats().pull_reqs, 2);
        assert_eq!(core.stats().modules_pulled, 3);
    }

    #[test]
    fn nothing_is_sent_until_connected_and_then_every_want_is() {
        let mut core = RouteClientCore::new(&config()).unwrap();
        core.want(A);
        core.want(B);
        assert_eq!(transmit(&mut core, 0), Sent::default());
        assert_eq!(core.poll_connect(0), Some(addr(1)));
        assert_eq!(transmit(&mut core, 0), Sent::default(), "connecting");
        core.on_connected(10);
        assert_eq!(transmit(&mut core, 10).pulls, vec![(1, vec![A, B])]);
    }

    #[test]
    fn pulls_in_flight_are_reissued_on_the_next_connection() {
        let mut core = connected(&config(), 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 0);
        core.want(C);
        core.on_disconnected(100);
        assert!(core.is_pending(A) && !core.is_in_flight(A));
        let at = match core.poll_timeout(100) {
            Wake::At(at) => at,
            other => panic!("{other:?}"),
        };
        assert_eq!(core.poll_connect(at - 1), None);
        assert_eq!(core.poll_connect(at), Some(addr(2)));
        core.on_connected(at);
        let sent = transmit(&mut core, at);
        assert_eq!(sent.pulls, vec![(2, vec![A, B]), (3, vec![C])]);
        // The old connection's answer can no longer arrive; one that did
        // would be stale.
        assert_eq!(
            core.on_frame(&answer(1, A, 1, &[node(1)]), at)
                .unwrap()
                .map(|_| ()),
            None
        );
        assert_eq!(core.stats().stale_answers, 1);
        assert!(route(core.on_frame(&answer(2, A, 1, &[node(1)]), at).unwrap()).module == A);
    }

    #[test]
    fn subscribed_modules_are_pulled_again_after_reconnecting() {
        let mut core = connected(&config(), 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 1, &[node(1)]), 1).unwrap();
        core.on_frame(&answer(1, B, 1, &[node(2)]), 1).unwrap();
        core.forget(B);
        core.on_disconnected(2);
        core.poll_connect(1_000).unwrap();
        core.on_connected(1_000);
        assert_eq!(transmit(&mut core, 1_000).pulls, vec![(2, vec![A])]);
    }

    #[test]
    fn forgetting_a_pull_in_flight_leaves_nothing_waiting() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        assert!(core.forget(A));
        assert!(!core.is_pending(A));
        assert_eq!(core.poll_timeout(10), Wake::At(1000), "no idle deadline");
        assert!(core.on_frame(&answer(1, A, 1, &[]), 11).unwrap().is_none());
    }

    // --- versions and re-pulls ---

    fn unchanged(seq: u64, modules: &[(ModuleId, u64)]) -> Vec<u8> {
        let (m, v): (Vec<ModuleId>, Vec<u64>) = modules.iter().copied().unzip();
        Encoder::new().route_unchanged(seq, &m, &v).to_vec()
    }

    fn refreshing(refresh_ms: u64) -> RouteClientConfig {
        let mut c = config();
        c.refresh_ms = refresh_ms;
        c.keepalive_ms = 1_000_000;
        c.idle_timeout_ms = 2_000_000;
        c.max_modules_per_pull = 1024;
        c
    }

    #[test]
    fn a_pull_carries_the_version_held_and_zero_for_none() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 1).unwrap();
        assert_eq!(core.held_version(A), 3);
        core.want(A);
        core.want(B);
        let sent = transmit(&mut core, 2);
        assert_eq!(sent.pulls, vec![(2, vec![A, B])]);
        assert_eq!(sent.known, vec![vec![3, 0]]);
    }

    #[test]
    fn a_push_raises_the_version_a_later_pull_carries() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 1).unwrap();
        let push = Encoder::new().route_push(A, true, 9, &[node(2)]).to_vec();
        core.on_frame(&push, 2).unwrap();
        // An older push (reordered) does not lower it.
        let old = Encoder::new().route_push(A, true, 4, &[node(2)]).to_vec();
        core.on_frame(&old, 3).unwrap();
        core.want(A);
        assert_eq!(transmit(&mut core, 4).known, vec![vec![9]]);
    }

    #[test]
    fn a_snapshot_route_is_pulled_with_its_version() {
        let mut core = connected(&config(), 0);
        assert!(core.want_known(A, 42));
        assert!(!core.want_known(A, 43), "queued: not wanted again");
        assert_eq!(transmit(&mut core, 0).known, vec![vec![43]]);
    }

    #[test]
    fn an_unchanged_answer_settles_the_pull_with_no_event_and_no_nodes() {
        let mut core = connected(&config(), 0);
        core.want_known(A, 5);
        core.want_known(B, 6);
        transmit(&mut core, 0);
        let got = core.on_frame(&unchanged(1, &[(A, 5), (B, 6)]), 1).unwrap();
        assert!(got.is_none(), "the caller already holds these routes");
        assert!(!core.is_pending(A) && !core.is_pending(B));
        assert!(
            core.follows(A) && core.follows(B),
            "subscribed as any answer"
        );
        let st = core.stats();
        assert_eq!((st.unchanged, st.nodes_received, st.answers), (2, 0, 0));
        assert_eq!(core.poll_timeout(2), Wake::At(1000), "nothing awaited");
        // Subscribed: pulled again after reconnecting, with the versions.
        core.on_disconnected(3);
        core.poll_connect(10_000).unwrap();
        core.on_connected(10_000);
        assert_eq!(transmit(&mut core, 10_000).known, vec![vec![5, 6]]);
    }

    #[test]
    fn an_unchanged_answer_for_no_pull_in_flight_is_stale() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        assert!(core
            .on_frame(&unchanged(7, &[(A, 1)]), 1)
            .unwrap()
            .is_none());
        assert!(core.is_in_flight(A));
        assert_eq!(core.stats().stale_answers, 1);
        assert_eq!(core.stats().unchanged, 0);
    }

    #[test]
    fn an_unchanged_answer_with_a_version_per_module_missing_closes_the_connection() {
        let mut fbb = flatbuffers::FlatBufferBuilder::new();
        let modules = fbb.create_vector(&[lbagent_wire::fb::ModuleId::from(A)]);
        let args = lbagent_wire::fb::RouteUnchangedArgs {
            seq: 1,
            modules: Some(modules),
            versions: None,
        };
        let body = lbagent_wire::fb::RouteUnchanged::create(&mut fbb, &args).as_union_value();
        let env = lbagent_wire::fb::Envelope::create(
            &mut fbb,
            &lbagent_wire::fb::EnvelopeArgs {
                body_type: lbagent_wire::fb::Body::RouteUnchanged,
                body: Some(body),
            },
        );
        lbagent_wire::fb::finish_envelope_buffer(&mut fbb, env);
        let mut core = connected(&config(), 0);
        let err = core.on_frame(fbb.finished_data(), 0).unwrap_err();
        assert!(matches!(err, RouteClientError::Invalid(_)), "{err}");
        assert!(err.to_string().contains("one version per module"));
    }

    #[test]
    fn an_answered_module_is_pulled_again_with_its_version_within_the_refresh_period() {
        let mut core = connected(&refreshing(10_000), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 100).unwrap();
        let at = core.refresh_due(A).expect("scheduled");
        assert!((7_600..=10_100).contains(&at), "{at}");
        assert_eq!(at % REFRESH_TICK_MS, 0, "on a tick");
        assert_eq!(core.poll_timeout(100), Wake::At(at));
        assert_eq!(transmit(&mut core, at - 1), Sent::default());
        let sent = transmit(&mut core, at);
        assert_eq!(sent.pulls, vec![(2, vec![A])]);
        assert_eq!(sent.known, vec![vec![3]]);
        assert_eq!(core.stats().refreshes, 1);
        assert_eq!(core.refresh_due(A), None, "in flight");
        // Confirmed unchanged: the next round is scheduled from then.
        core.on_frame(&unchanged(2, &[(A, 3)]), at + 5).unwrap();
        let next = core.refresh_due(A).unwrap();
        assert!(next >= at + 7_500 && next <= at + 10_250, "{next}");
    }

    #[test]
    fn modules_due_in_the_same_tick_share_one_pull() {
        let mut core = connected(&refreshing(10_000), 0);
        let modules: Vec<ModuleId> = (0..200).map(|i| ModuleId::new(i, 0)).collect();
        for &m in &modules {
            core.want(m);
        }
        transmit(&mut core, 0);
        for &m in &modules {
            core.on_frame(&answer(1, m, 1, &[node(1)]), 0).unwrap();
        }
        let mut ticks = BTreeMap::<u64, usize>::new();
        for &m in &modules {
            *ticks.entry(core.refresh_due(m).unwrap()).or_default() += 1;
        }
        let (&first, &n) = ticks.iter().next().unwrap();
        let sent = transmit(&mut core, first);
        assert_eq!(sent.pulls.len(), 1, "one PullReq for the whole tick");
        assert_eq!(sent.pulls[0].1.len(), n);
        assert!(sent.known[0].iter().all(|&v| v == 1));
    }

    #[test]
    fn modules_answered_together_are_re_pulled_spread_over_the_period() {
        // 10,000 modules answered in the same millisecond: their re-pulls
        // spread over the last quarter of the period, not one burst, and
        // every re-pull of a module answered unchanged drifts further.
        let mut core = connected(&refreshing(15_000), 0);
        let modules: Vec<ModuleId> = (0..10_000).map(|i| ModuleId::new(i, 0)).collect();
        for &m in &modules {
            core.want(m);
        }
        let mut out = Vec::new();
        core.poll_transmit(0, &mut out);
        for (seq, chunk) in (1..).zip(modules.chunks(1024)) {
            let pairs: Vec<(ModuleId, u64)> = chunk.iter().map(|&m| (m, 1)).collect();
            core.on_frame(&unchanged(seq, &pairs), 0).unwrap();
        }
        let mut ticks = BTreeMap::<u64, usize>::new();
        for &m in &modules {
            let at = core.refresh_due(m).unwrap();
            assert!((11_250..=15_000).contains(&at), "{at}");
            *ticks.entry(at).or_default() += 1;
        }
        assert!(ticks.len() >= 15, "{} ticks", ticks.len());
        let busiest = ticks.values().max().unwrap();
        assert!(*busiest < 1_500, "the busiest tick holds {busiest}");
    }

    #[test]
    fn no_re_pull_while_disconnected_and_every_module_once_on_reconnecting() {
        let mut core = connected(&refreshing(10_000), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
        core.on_disconnected(1);
        assert!(
            matches!(core.poll_timeout(1), Wake::At(t) if t < 10_000),
            "the next attempt, not the re-pull"
        );
        core.poll_connect(50_000).unwrap();
        core.on_connected(50_000);
        let sent = transmit(&mut core, 50_000);
        assert_eq!(
            sent.pulls,
            vec![(2, vec![A])],
            "once, not once more for the refresh"
        );
        assert_eq!(core.stats().refreshes, 0);
        assert_eq!(transmit(&mut core, 50_001), Sent::default());
    }

    #[test]
    fn a_forgotten_module_is_not_re_pulled() {
        let mut core = connected(&refreshing(10_000), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
        let at = core.refresh_due(A).unwrap();
        core.forget(A);
        let (_, pulls) = unsubscribed(&mut core, at);
        assert!(pulls.is_empty());
        assert_eq!(core.held_version(A), 0);
    }

    #[test]
    fn a_refused_re_pull_is_tried_again_next_round() {
        let mut core = connected(&refreshing(10_000), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
        let at = core.refresh_due(A).unwrap();
        transmit(&mut core, at);
        let err = Encoder::new()
            .error_resp(2, A, RetCode::Unavailable, "busy")
            .to_vec();
        core.on_frame(&err, at + 1).unwrap();
        assert!(!core.is_pending(A));
        assert!(core.refresh_due(A).unwrap() > at);
    }

    #[test]
    fn refresh_off_schedules_nothing() {
        let mut core = connected(&refreshing(0), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
        assert_eq!(core.refresh_due(A), None);
        assert_eq!(core.poll_timeout(1), Wake::At(1_000_000));
    }

    // --- frames in ---

    #[test]
    fn an_answer_becomes_a_route_event() {
        let mut core = connected(&config(), 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 0);
        let r = route(
            core.on_frame(&answer(1, A, 9, &[node(1), node(2)]), 5)
                .unwrap(),
        );
        assert_eq!(
            r,
            RouteEvent {
                module: A,
                exists: true,
                version: 9,
                nodes: vec![node(1), node(2)],
                pushed: false,
                policy: Policy::L5,
            }
        );
        let r = route(core.on_frame(&answer(1, B, 0, &[]), 5).unwrap());
        assert!(!r.exists && r.nodes.is_empty());
        assert_eq!(core.stats().answers, 2);
    }

    #[test]
    fn a_push_arrives_unasked_for_a_subscribed_module_and_settles_a_pull_in_flight() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
        let push = Encoder::new().route_push(A, true, 4, &[node(3)]).to_vec();
        let r = route(core.on_frame(&push, 1).unwrap());
        assert!(r.pushed && r.version == 4 && r.nodes == vec![node(3)]);

        core.want(B);
        transmit(&mut core, 2);
        let push = Encoder::new().route_push(B, false, 5, &[]).to_vec();
        let r = route(core.on_frame(&push, 3).unwrap());
        assert!(r.pushed && !r.exists);
        assert!(!core.is_pending(B));
        assert!(
            core.on_frame(&answer(2, B, 5, &[]), 4).unwrap().is_none(),
            "stale"
        );
        assert_eq!(core.poll_timeout(4), Wake::At(1000), "nothing awaited");
    }

    #[test]
    fn a_push_for_a_module_not_followed_is_dropped() {
        let mut core = connected(&config(), 0);
        let push = Encoder::new().route_push(C, true, 4, &[node(3)]).to_vec();
        assert!(core.on_frame(&push, 1).unwrap().is_none());
        assert_eq!(core.stats().stale_answers, 1);
    }

    fn unsubscribed(core: &mut RouteClientCore, now: u64) -> (Vec<ModuleId>, Vec<u64>) {
        let mut out = Vec::new();
        core.poll_transmit(now, &mut out);
        let mut frames = FrameDecoder::default();
        frames.feed(&out);
        let (mut gone, mut pulls) = (Vec::new(), Vec::new());
        while let Some(frame) = frames.next_frame().unwrap() {
            match decode(frame, &Limits::TCP_FRAME).unwrap() {
                Message::Unsubscribe(m) => gone.extend(
                    m.modules()
                        .unwrap()
                        .iter()
                        .map(|m| ModuleId::new(m.modid(), m.cmdid())),
                ),
                Message::PullReq(m) => pulls.push(m.seq()),
                _ => {}
            }
        }
        (gone, pulls)
    }

    #[test]
    fn forgetting_a_subscribed_module_unsubscribes_it_before_any_new_pull() {
        let mut core = connected(&config(), 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 1, &[node(1)]), 1).unwrap();
        // A answered (subscribed), B in flight (the server subscribed it).
        core.forget(A);
        core.forget(B);
        // A wanted again at once: the Unsubscribe goes first.
        core.want(A);
        let (gone, pulls) = unsubscribed(&mut core, 2);
        assert_eq!(gone, vec![A, B]);
        assert_eq!(pulls.len(), 1);
        assert_eq!(core.stats().unsubscribed, 2);
        // A push for B, sent before the server read the Unsubscribe: dropped.
        let push = Encoder::new().route_push(B, true, 2, &[node(2)]).to_vec();
        assert!(core.on_frame(&push, 3).unwrap().is_none());
    }

    #[test]
    fn a_module_forgotten_while_disconnected_is_neither_unsubscribed_nor_pulled_again() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 1, &[node(1)]), 1).unwrap();
        core.on_disconnected(2);
        core.forget(A);
        core.poll_connect(10_000).unwrap();
        core.on_connected(10_000);
        let (gone, pulls) = unsubscribed(&mut core, 10_000);
        assert!(gone.is_empty() && pulls.is_empty());
    }

    #[test]
    fn an_error_resp_drops_the_refused_pull_and_is_reported() {
        let mut core = connected(&config(), 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 0);
        let err = Encoder::new()
            .error_resp(
                1,
                ModuleId::new(0, 0),
                RetCode::BadRequest,
                "too many modules",
            )
            .to_vec();
        let Some(RouteClientEvent::ServerError(e)) = core.on_frame(&err, 1).unwrap() else {
            panic!("expected a server error")
        };
        assert_eq!((e.seq, e.retcode), (1, RetCode::BadRequest));
        assert_eq!(e.message, "too many modules");
        assert_eq!(e.dropped, vec![A, B]);
        assert!(!core.is_pending(A) && core.want(A));
    }

    #[test]
    fn many_frames_in_one_read_all_come_out() {
        let mut core = connected(&config(), 0);
        for m in [A, B, C] {
            core.want(m);
        }
        transmit(&mut core, 0);
        let mut stream = Vec::new();
        write_frame(&mut stream, &answer(1, A, 1, &[node(1)])).unwrap();
        write_frame(&mut stream, &answer(1, B, 2, &[node(2)])).unwrap();
        write_frame(&mut stream, Encoder::new().keep_alive_ack(99)).unwrap();
        write_frame(&mut stream, &answer(2, C, 3, &[node(3)])).unwrap();
        let mut frames = FrameDecoder::default();
        frames.feed(&stream);
        let mut got = Vec::new();
        while let Some(frame) = frames.next_frame().unwrap() {
            if let Some(ev) = core.on_frame(frame, 1).unwrap() {
                got.push(route(Some(ev)).module);
            }
        }
        assert_eq!(got, vec![A, B, C]);
        assert_eq!(frames.buffered(), 0);
    }

    #[test]
    fn a_frame_split_anywhere_across_reads_comes_out_once() {
        let mut stream = Vec::new();
        write_frame(&mut stream, &answer(1, A, 1, &[node(1)])).unwrap();
        write_frame(&mut stream, &answer(1, B, 2, &[node(2), node(4)])).unwrap();
        for cut in 0..=stream.len() {
            let mut core = connected(&config(), 0);
            core.want(A);
            core.want(B);
            transmit(&mut core, 0);
            let mut frames = FrameDecoder::default();
            let mut got = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                frames.feed(part);
                while let Some(frame) = frames.next_frame().unwrap() {
                    got.push(route(core.on_frame(frame, 1).unwrap()).version);
                }
            }
            assert_eq!(got, vec![1, 2], "cut at {cut}");
        }
    }

    #[test]
    fn garbage_is_an_error_that_closes_the_connection() {
        let mut core = connected(&config(), 0);
        assert!(matches!(
            core.on_frame(b"definitely not a flatbuffer", 0),
            Err(RouteClientError::Decode(_))
        ));
        assert!(matches!(
            core.on_frame(&[], 0),
            Err(RouteClientError::Decode(_))
        ));
        let mut frames = FrameDecoder::default();
        frames.feed(&[0, 0, 0, 0]);
        let err = RouteClientError::from(frames.next_frame().unwrap_err());
        assert!(err
            .to_string()
            .starts_with("bad frame from the route server"));
    }

    #[test]
    fn a_message_the_server_never_sends_is_an_error() {
        let mut core = connected(&config(), 0);
        let pull = Encoder::new().pull_req(1, &[A]).to_vec();
        let err = core.on_frame(&pull, 0).unwrap_err();
        assert!(matches!(err, RouteClientError::Unexpected("PullReq")));
        assert!(err.to_string().contains("unexpected PullReq"));
    }

    // --- liveness ---

    #[test]
    fn keepalives_are_sent_every_interval_while_connected() {
        let mut core = connected(&config(), 0);
        assert!(transmit(&mut core, 999).keepalives.is_empty());
        assert_eq!(transmit(&mut core, 1000).keepalives, vec![1]);
        assert!(transmit(&mut core, 1500).keepalives.is_empty());
        let ack = Encoder::new().keep_alive_ack(1).to_vec();
        assert!(core.on_frame(&ack, 1500).unwrap().is_none());
        assert_eq!(transmit(&mut core, 2000).keepalives, vec![2]);
        assert_eq!(core.stats().keepalive_acks, 1);
        core.on_disconnected(2100);
        assert_eq!(core.poll_transmit(5000, &mut Vec::new()), 0);
    }

    #[test]
    fn an_unanswered_keepalive_makes_the_connection_dead_after_the_idle_timeout() {
        let mut core = connected(&config(), 0);
        transmit(&mut core, 1000);
        assert_eq!(core.poll_timeout(1000), Wake::At(2000));
        transmit(&mut core, 2000);
        transmit(&mut core, 3000);
        assert_eq!(core.poll_timeout(3999), Wake::At(4000));
        assert_eq!(core.poll_timeout(4000), Wake::Drop);
    }

    #[test]
    fn an_answered_connection_stays_alive() {
        let mut core = connected(&config(), 0);
        for t in (1000..20_000).step_by(1000) {
            let sent = transmit(&mut core, t);
            let ack = Encoder::new().keep_alive_ack(sent.keepalives[0]).to_vec();
            core.on_frame(&ack, t + 10).unwrap();
            assert_ne!(core.poll_timeout(t + 999), Wake::Drop);
        }
    }

    #[test]
    fn idleness_counts_from_the_request_not_from_the_last_frame() {
        let mut config = config();
        config.keepalive_ms = 60_000;
        config.idle_timeout_ms = 90_000;
        let mut core = connected(&config, 0);
        core.want(A);
        transmit(&mut core, 50_000);
        assert_eq!(core.poll_timeout(50_000), Wake::At(60_000));
        assert_ne!(core.poll_timeout(139_999), Wake::Drop);
        assert_eq!(core.poll_timeout(140_000), Wake::Drop);
    }

    #[test]
    fn a_pull_in_flight_makes_a_silent_connection_dead() {
        let mut config = config();
        config.keepalive_ms = 60_000;
        config.idle_timeout_ms = 90_000;
        let mut core = connected(&config, 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 10);
        assert_eq!(
            core.poll_timeout(10),
            Wake::At(60_000),
            "the keepalive first"
        );
        core.on_frame(&answer(1, A, 1, &[]), 2000).unwrap();
        assert_ne!(
            core.poll_timeout(91_999),
            Wake::Drop,
            "progress restarts the wait"
        );
        assert_eq!(core.poll_timeout(92_000), Wake::Drop);
        core.on_frame(&answer(1, B, 1, &[]), 91_000).unwrap();
        assert_eq!(
            core.poll_timeout(200_000),
            Wake::At(60_000),
            "nothing awaited"
        );
    }

    // --- reconnecting ---

    /// The delays of `failures` consecutive failed attempts.
    fn delays(config: &RouteClientConfig, failures: usize) -> Vec<u64> {
        let mut core = RouteClientCore::new(config).unwrap();
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
    fn the_backoff_never_overflows() {
        let mut c = config();
        c.backoff_initial_ms = u64::MAX / 2;
        c.backoff_max_ms = u64::MAX;
        let mut core = RouteClientCore::new(&c).unwrap();
        for failures in [0, 1, 2, 63, 64, 65, 1000, u32::MAX] {
            core.link.set_failures(failures);
            assert!(core.link.backoff() >= u64::MAX / 4, "{failures} failures");
        }
        let mut core = RouteClientCore::new(&config()).unwrap();
        core.link.set_failures(u32::MAX);
        assert!((2500..=5000).contains(&core.link.backoff()));
        core.poll_connect(u64::MAX).unwrap();
        core.on_disconnected(u64::MAX);
        assert_eq!(core.poll_timeout(u64::MAX), Wake::At(u64::MAX));
    }

    #[test]
    fn a_healthy_connection_resets_the_backoff() {
        let mut core = RouteClientCore::new(&config()).unwrap();
        let mut now = 0;
        for _ in 0..6 {
            core.poll_connect(now).unwrap();
            core.on_disconnected(now);
            now += 10_000;
        }
        core.poll_connect(now).unwrap();
        core.on_connected(now);
        let ack = Encoder::new().keep_alive_ack(1).to_vec();
        core.on_frame(&ack, now).unwrap();
        core.on_disconnected(now);
        let Wake::At(at) = core.poll_timeout(now) else {
            panic!()
        };
        assert!(at - now <= 100, "back to the initial delay: {}", at - now);
    }

    #[test]
    fn attempts_fail_over_through_the_addresses_and_wrap() {
        let mut core = RouteClientCore::new(&config()).unwrap();
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
    fn a_reloaded_config_keeps_the_connection_and_takes_effect_at_the_next_use() {
        let mut core = connected(&config(), 0);
        core.want(A);
        transmit(&mut core, 0);
        core.on_frame(&answer(1, A, 3, &[node(1)]), 1).unwrap();
        let mut c = config();
        c.addrs = vec![addr(7), addr(8)];
        c.keepalive_ms = 500;
        c.idle_timeout_ms = 1500;
        c.refresh_ms = 4000;
        c.jitter_seed = 99;
        core.reconfigure(&c).unwrap();
        assert_eq!(core.link().connected(), Some(addr(1)), "kept");
        assert!(core.follows(A), "nothing followed is lost");
        assert_eq!(core.config().jitter_seed, 7, "the seed stays");
        // The new list from the next attempt on.
        core.on_disconnected(2);
        let Wake::At(at) = core.poll_timeout(2) else {
            panic!()
        };
        assert_eq!(core.poll_connect(at), Some(addr(7)));
        core.on_connected(at);
        // The new intervals: keep-alive and re-pull.
        assert_eq!(transmit(&mut core, at).pulls.len(), 1, "A again");
        assert_eq!(transmit(&mut core, at + 500).keepalives.len(), 1);
        // A bad config is refused whole.
        let mut bad = config();
        bad.addrs.clear();
        assert_eq!(core.reconfigure(&bad), Err(RouteConfigError::NoAddrs));
        assert_eq!(core.config().keepalive_ms, 500);
    }

    #[test]
    fn a_lost_connection_moves_to_the_next_address() {
        let mut core = connected(&config(), 0);
        assert_eq!(core.link().connected(), Some(addr(1)));
        core.on_disconnected(5);
        assert_eq!(core.link().connected(), None);
        assert_eq!(core.link().current_addr(), addr(2));
        assert_eq!(core.stats().connects, 1);
        assert_eq!(core.stats().disconnects, 1);
    }
}
