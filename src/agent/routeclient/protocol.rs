//! The route client's sans-IO core: every decision, time passed in; the
//! glommio shell ([`super::run`]) only moves bytes and time to it.

use super::*;

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
    pub(super) config: RouteClientConfig,
    /// The server list, the rotation and the back-off.
    pub(super) link: Reconnect,
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
    /// back-off drawn from `0..=min(max, initial * 2^failures)` (full
    /// jitter).
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
                    let meta = read_node_meta(m.node_meta(), nodes.len())?;
                    self.stats.nodes_received += nodes.len() as u64;
                    Some(RouteClientEvent::Route(RouteEvent {
                        module,
                        exists: m.exists(),
                        version: m.version(),
                        nodes,
                        pushed: false,
                        policy: Policy::from_code(m.policy()).unwrap_or_default(),
                        options: lbagent_wire::module_options(m.options()),
                        meta,
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
                let meta = read_node_meta(m.node_meta(), nodes.len())?;
                self.stats.nodes_received += nodes.len() as u64;
                Some(RouteClientEvent::Route(RouteEvent {
                    module,
                    exists: m.exists(),
                    version: m.version(),
                    nodes,
                    pushed: true,
                    policy: Policy::from_code(m.policy()).unwrap_or_default(),
                    options: lbagent_wire::module_options(m.options()),
                    meta,
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
