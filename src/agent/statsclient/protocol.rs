//! The statistics client's sans-IO core: every decision, time passed in; the
//! glommio shell ([`super::run`]) only moves bytes and time to it.

use super::*;

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
pub(super) struct Batch {
    seq: u64,
    time_s: u64,
    entries: VecDeque<Entry>,
}

/// The stats client's protocol state, without I/O: see the module docs.
#[derive(Debug)]
pub struct StatsClientCore {
    pub(super) config: StatsClientConfig,
    /// The server list, the rotation and the back-off.
    link: Reconnect,
    /// Reports that lost their connection, to send first, oldest first.
    resend: VecDeque<Batch>,
    /// Entries in no report yet, oldest first.
    queue: VecDeque<Entry>,
    /// Entries in `resend` and `queue`.
    queued: usize,
    /// Reports sent on this connection and not acknowledged, in send order.
    pub(super) in_flight: VecDeque<Batch>,
    /// Entries in `in_flight`.
    in_flight_entries: usize,
    pub(super) next_seq: u64,
    /// Since when acks are due with nothing received (None: none due).
    waiting_since: Option<u64>,
    /// Shutting down: no window.
    flushing: bool,
    /// Entries dropped since the last [`StatsClientEvent::Dropped`].
    unreported_drops: u64,
    encoder: Encoder,
    stats: StatsClientStats,
    /// This run's number, sent as every report's `agent_start` (never 0).
    agent_start: u64,
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
            agent_start: agent_start_of(config.jitter_seed),
        })
    }

    /// This run's number, sent as every report's `agent_start`: with the
    /// caller and `seq` it names a report for good, so that a reporter
    /// applies a re-sent report's consumed units once. Drawn from
    /// [`StatsClientConfig::jitter_seed`] (random per process), never 0.
    pub fn agent_start(&self) -> u64 {
        self.agent_start
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
    /// the next address after the route client's back-off: a delay drawn
    /// from `0..=min(max, initial * 2^failures)` (full jitter).
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
        let frame = self.encoder.stats_report_of_run(
            batch.seq,
            caller,
            batch.time_s,
            self.agent_start,
            &modules,
        );
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

/// The run number of a core seeded `jitter_seed`: a draw of its own
/// (not the jitter's), never 0.
fn agent_start_of(jitter_seed: u64) -> u64 {
    fastrand::Rng::with_seed(jitter_seed ^ 0x5354_4152_5453_5441).u64(1..)
}

/// How long until `deadline` (zero once past).
pub(super) fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}
