//! What the executor thread and the writer threads share: the row buffer
//! and its notes behind one mutex, a condition variable per writer, the
//! connection counters, the log.
//!
//! The mutex is held for a push, a take or a settle of a batch — copies
//! of at most a report's or a batch's rows — and never across a database
//! call or a socket operation.
//!
//! Acknowledgements: every accepted report gets a ticket in the buffer
//! (see [`super::buffer`]); when the writers settle it, its connection's
//! [`Acks`] gets `(seq, how)` and its doorbell rings, and the connection's
//! task answers. A connection that closed meanwhile is not answered (its
//! agent sends the report again).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::buffer::{Buffer, Settled};
use super::metrics::ReporterStats;
use super::notes::LossNotes;
use super::session::Session;
use super::Log;
use lbagent_model::{ModuleId, NodeAddr};
use lbagent_service::doorbell::Doorbell;
use lbagent_store::ReportKey;

/// One connection's answers, settled by the writers and waiting for its
/// task: `(seq, how)` per report, and the doorbell that wakes the task.
#[derive(Debug, Default)]
pub(super) struct Acks {
    ready: Mutex<Vec<(u64, Settled)>>,
    bell: Doorbell,
    /// Its tickets not settled yet (changed under the core's lock).
    open: Mutex<Vec<u64>>,
}

impl Acks {
    /// Rung when answers wait.
    pub(super) fn bell(&self) -> &Doorbell {
        &self.bell
    }

    fn open(&self) -> MutexGuard<'_, Vec<u64>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the waiting answers to `out`.
    pub(super) fn take(&self, out: &mut Vec<(u64, Settled)>) {
        out.append(&mut self.ready.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// One report's consumed units, waiting for a writer.
#[derive(Debug)]
pub(super) struct ConsumedReport {
    /// The report's ticket (one hold on it).
    pub(super) ticket: u64,
    /// What names it for good, when its agent says which run it is.
    pub(super) key: Option<ReportKey>,
    /// `(module, node, units)`.
    pub(super) entries: Vec<(ModuleId, NodeAddr, u32)>,
}

/// At most one line about dropped rows per this many milliseconds.
pub(super) const LOSS_NOTE_INTERVAL_MS: u64 = 10_000;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where the reporter is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Accepting; writers write as rows come.
    Running,
    /// Stopping: nothing more is accepted; writers write what is left and
    /// end when their shard is empty, or at the deadline.
    Draining(Instant),
    /// Writers end after their current attempt.
    Abandoned,
}

/// Everything behind the mutex.
pub(super) struct Core {
    /// The rows.
    pub(super) buffer: Buffer,
    /// What the log says about dropped rows.
    pub(super) loss: LossNotes,
    /// Per writer: connected, and its last write succeeded.
    pub(super) writer_up: Vec<bool>,
    /// Per writer: since when its current write runs.
    pub(super) writing_since: Vec<Option<Instant>>,
    /// Writer threads not ended yet.
    pub(super) running: usize,
    /// See [`Phase`].
    pub(super) phase: Phase,
    /// The latest store error, for the stop report.
    pub(super) last_error: Option<String>,
    /// Per writer (the shard of the report's first module): the reports'
    /// consumed units waiting for the store, oldest first.
    pub(super) consumed: Vec<Vec<ConsumedReport>>,
    /// Entries in `consumed`, per writer.
    pub(super) consumed_entries: Vec<usize>,
    /// Consumed entries dropped at [`MAX_CONSUMED_WAITING`] per writer.
    pub(super) consumed_dropped: u64,
    /// Open tickets: whose connection and which report.
    pub(super) tickets: HashMap<u64, (Arc<Acks>, u64)>,
    /// The last ticket given.
    pub(super) last_ticket: u64,
}

impl Core {
    /// Hands every ticket the buffer settled to its connection; returns
    /// the connections to wake (ring them once the lock is released).
    pub(super) fn deliver(&mut self, wake: &mut Vec<Arc<Acks>>) {
        let mut settled = Vec::new();
        self.buffer.take_settled(&mut settled);
        for (ticket, how) in settled {
            let Some((acks, seq)) = self.tickets.remove(&ticket) else {
                continue;
            };
            acks.open().retain(|&t| t != ticket);
            acks.ready
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((seq, how));
            if !wake.iter().any(|a| Arc::ptr_eq(a, &acks)) {
                wake.push(acks);
            }
        }
    }
}

/// Consumed-units entries one writer keeps waiting for the store at most;
/// past it the newest are dropped (counted).
pub(super) const MAX_CONSUMED_WAITING: usize = 65_536;

/// The state shared by the executor and the writers.
pub(super) struct Shared {
    core: Mutex<Core>,
    /// One per writer: rows arrived in its shard, or the phase changed.
    wake: Vec<Condvar>,
    /// A writer ended.
    exited: Condvar,
    connections: AtomicU64,
    connections_open: AtomicU64,
    reports: AtomicU64,
    reports_refused: AtomicU64,
    bad_frames: AtomicU64,
    write_failures: AtomicU64,
    /// Connections refused at `reporter.max_connections`.
    pub(super) connections_refused: AtomicU64,
    /// Connections refused at the TLS handshake.
    pub(super) tls_refused: AtomicU64,
    /// Consumed-units entries refused (identity not on `tls.consume_allow`).
    pub(super) consumed_refused: AtomicU64,
    /// Connections closed after `reporter.idle_timeout` without a frame.
    pub(super) idle_closed: AtomicU64,
    /// Connections closed for a frame slower than `reporter.read_timeout_ms`.
    pub(super) read_timeouts: AtomicU64,
    /// Connections closed for passing `reporter.max_buffered_bytes`.
    pub(super) buffer_full_closed: AtomicU64,
    /// Bytes of incomplete frames held now, every connection together.
    pub(super) partial_bytes: AtomicU64,
    /// Times a writer found the SQLite file deleted or replaced.
    pub(super) store_replaced: AtomicU64,
    /// What the metrics endpoint refused or timed out.
    pub(super) http: lbagent_service::metrics_http::HttpCounters,
    log: Log,
    /// Rows per transaction.
    pub(super) batch_rows: usize,
    /// The back-off's cap, milliseconds.
    pub(super) retry_max_ms: u64,
}

impl Shared {
    /// Shared state for `writers` writers and at most `bound` rows.
    pub(super) fn new(
        writers: usize,
        bound: usize,
        batch_rows: usize,
        retry_max_ms: u64,
        log: Log,
    ) -> Self {
        Shared {
            core: Mutex::new(Core {
                buffer: Buffer::new(writers, bound),
                loss: LossNotes::new(LOSS_NOTE_INTERVAL_MS),
                writer_up: vec![false; writers],
                writing_since: vec![None; writers],
                running: 0,
                phase: Phase::Running,
                last_error: None,
                consumed: (0..writers).map(|_| Vec::new()).collect(),
                consumed_entries: vec![0; writers],
                consumed_dropped: 0,
                tickets: HashMap::new(),
                last_ticket: 0,
            }),
            wake: (0..writers).map(|_| Condvar::new()).collect(),
            exited: Condvar::new(),
            connections: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            reports: AtomicU64::new(0),
            reports_refused: AtomicU64::new(0),
            bad_frames: AtomicU64::new(0),
            write_failures: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            tls_refused: AtomicU64::new(0),
            consumed_refused: AtomicU64::new(0),
            idle_closed: AtomicU64::new(0),
            read_timeouts: AtomicU64::new(0),
            buffer_full_closed: AtomicU64::new(0),
            partial_bytes: AtomicU64::new(0),
            store_replaced: AtomicU64::new(0),
            http: lbagent_service::metrics_http::HttpCounters::default(),
            log,
            batch_rows: batch_rows.max(1),
            retry_max_ms,
        }
    }

    /// The state, even if a thread panicked holding it (every update keeps
    /// it consistent before anything can panic).
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs one line.
    pub(super) fn log(&self, line: &str) {
        self.log.line(line);
    }

    /// Queues the rows and consumed units of the reports `session`
    /// accepted (and counts `refused` refused ones), each under a ticket
    /// answered to `acks` once the writers settle it; wakes the writers
    /// concerned, and logs a loss when one is due. Never waits for a
    /// writer. Returns true when drops wait to be said later (then
    /// [`Self::housekeeping`] must run when they are due).
    pub(super) fn accept(&self, session: &Session, refused: u64, acks: &Arc<Acks>) -> bool {
        let accepted = session.accepted();
        self.reports
            .fetch_add(accepted.len() as u64, Ordering::Relaxed);
        self.reports_refused.fetch_add(refused, Ordering::Relaxed);
        if accepted.is_empty() {
            return false;
        }
        let (rows, units) = (session.rows(), session.consumed_units());
        let now = unix_ms();
        let mut wake = Vec::new();
        let (line, pending, consumed_line) = {
            let mut core = self.lock();
            let writers = core.consumed.len();
            let mut dropped = 0;
            let before = core.consumed_dropped;
            for report in accepted {
                if core.tickets.len() >= core.buffer.bound() {
                    // As many reports wait as rows may: store this one's
                    // rows, but promise nothing (the agent sends it again).
                    dropped += core.buffer.push(&rows[report.rows.clone()]);
                    acks.ready
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((report.seq, Settled::Dropped));
                    if !wake.iter().any(|a| Arc::ptr_eq(a, acks)) {
                        wake.push(acks.clone());
                    }
                    continue;
                }
                core.last_ticket += 1;
                let ticket = core.last_ticket;
                core.tickets.insert(ticket, (acks.clone(), report.seq));
                acks.open().push(ticket);
                let entries = &units[report.consumed.clone()];
                let holds = u32::from(!entries.is_empty());
                dropped += core
                    .buffer
                    .push_report(&rows[report.rows.clone()], ticket, holds);
                if let Some(&(module, _, _)) = entries.first() {
                    let i = super::buffer::shard_of(module, writers);
                    if core.consumed_entries[i] + entries.len() <= MAX_CONSUMED_WAITING {
                        core.consumed_entries[i] += entries.len();
                        core.consumed[i].push(ConsumedReport {
                            ticket,
                            key: report.key,
                            entries: entries.to_vec(),
                        });
                        self.wake[i].notify_one();
                    } else {
                        core.consumed_dropped += entries.len() as u64;
                        core.buffer.release(ticket, Settled::Dropped);
                    }
                }
            }
            core.deliver(&mut wake);
            let Core {
                buffer,
                loss,
                consumed_dropped,
                ..
            } = &mut *core;
            buffer.drain_touched(|i| self.wake[i].notify_one());
            loss.dropped(dropped, now);
            let bound = buffer.bound();
            // A line at the first consumed drop and every 1024th after it.
            let consumed_line = (*consumed_dropped / 1024 != before / 1024
                || (before == 0 && *consumed_dropped > 0))
                .then_some(*consumed_dropped);
            (
                loss.due(now, bound),
                loss.next_due().is_some(),
                consumed_line,
            )
        };
        for acks in wake {
            acks.bell.ring();
        }
        if let Some(line) = line {
            self.log(&line);
        }
        if let Some(n) = consumed_line {
            self.log(&format!(
                "{n} consumed-units entries dropped so far: the store is not taking them ({MAX_CONSUMED_WAITING} wait per writer); their reports are answered Unavailable and sent again"
            ));
        }
        pending
    }

    /// The connection of `acks` closed: its reports are no longer answered
    /// (their rows are still written), and their tickets go.
    pub(super) fn forget(&self, acks: &Acks) {
        let mut core = self.lock();
        for t in std::mem::take(&mut *acks.open()) {
            core.tickets.remove(&t);
            core.buffer.forget(t);
        }
    }

    /// Runs `f` on the state, then answers the reports it settled.
    pub(super) fn settle(&self, f: impl FnOnce(&mut Core)) {
        let mut wake = Vec::new();
        {
            let mut core = self.lock();
            f(&mut core);
            core.deliver(&mut wake);
        }
        for acks in wake {
            acks.bell.ring();
        }
    }

    /// Logs the summary of dropped rows when one is due. Returns when the
    /// next one will be (milliseconds since the epoch), `None` while no
    /// drop waits to be said.
    pub(super) fn housekeeping(&self) -> Option<u64> {
        let (line, next) = {
            let mut core = self.lock();
            let bound = core.buffer.bound();
            let line = core.loss.due(unix_ms(), bound);
            (line, core.loss.next_due())
        };
        if let Some(line) = line {
            self.log(&line);
        }
        next
    }

    /// An agent connected.
    pub(super) fn connection_opened(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
        self.connections_open.fetch_add(1, Ordering::Relaxed);
    }

    /// An agent connection ended.
    pub(super) fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Ordering::Relaxed);
    }

    /// A connection was closed for a bad frame.
    pub(super) fn bad_frame(&self) {
        self.bad_frames.fetch_add(1, Ordering::Relaxed);
    }

    /// An attempt to connect to the store or write failed.
    pub(super) fn write_failed(&self) {
        self.write_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Writer `i`'s condition variable.
    pub(super) fn wake(&self, i: usize) -> &Condvar {
        &self.wake[i]
    }

    /// Wakes every writer (the phase changed).
    pub(super) fn wake_all(&self) {
        for cv in &self.wake {
            cv.notify_all();
        }
    }

    /// A writer thread ended.
    pub(super) fn writer_ended(&self, i: usize) {
        let mut core = self.lock();
        core.running = core.running.saturating_sub(1);
        if let Some(up) = core.writer_up.get_mut(i) {
            *up = false;
        }
        drop(core);
        self.exited.notify_all();
    }

    /// Waits until every writer ended or `deadline` passed; returns the
    /// state then.
    pub(super) fn wait_writers(&self, deadline: Instant) -> MutexGuard<'_, Core> {
        let mut core = self.lock();
        while core.running > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            core = self
                .exited
                .wait_timeout(core, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        core
    }

    /// Every counter and gauge now.
    pub(super) fn stats(&self) -> ReporterStats {
        let (counts, buffered, bound, writers, writers_up) = {
            let core = self.lock();
            let now = Instant::now();
            let stalled = |since: &Option<Instant>| {
                since.is_some_and(|t| now.saturating_duration_since(t) > super::writer::WRITE_STALL)
            };
            let up = core
                .writer_up
                .iter()
                .zip(&core.writing_since)
                .filter(|(&u, since)| u && !stalled(since))
                .count();
            (
                core.buffer.counts(),
                core.buffer.len(),
                core.buffer.bound(),
                core.writer_up.len(),
                up,
            )
        };
        ReporterStats {
            connections_open: self.connections_open.load(Ordering::Relaxed),
            connections: self.connections.load(Ordering::Relaxed),
            reports: self.reports.load(Ordering::Relaxed),
            reports_refused: self.reports_refused.load(Ordering::Relaxed),
            bad_frames: self.bad_frames.load(Ordering::Relaxed),
            connections_refused: self.connections_refused.load(Ordering::Relaxed),
            tls_refused: self.tls_refused.load(Ordering::Relaxed),
            consumed_refused: self.consumed_refused.load(Ordering::Relaxed),
            idle_closed: self.idle_closed.load(Ordering::Relaxed),
            read_timeouts: self.read_timeouts.load(Ordering::Relaxed),
            buffer_full_closed: self.buffer_full_closed.load(Ordering::Relaxed),
            partial_bytes: self.partial_bytes.load(Ordering::Relaxed),
            store_replaced: self.store_replaced.load(Ordering::Relaxed),
            metrics_refused: self.http.refused(),
            metrics_timeouts: self.http.timed_out(),
            rows_accepted: counts.accepted,
            rows_coalesced: counts.coalesced,
            rows_written: counts.written,
            rows_dropped: counts.dropped,
            rows_rejected: counts.rejected,
            rows_buffered: buffered as u64,
            buffer_rows: bound as u64,
            transactions: counts.transactions,
            write_failures: self.write_failures.load(Ordering::Relaxed),
            writers: writers as u64,
            writers_up: writers_up as u64,
        }
    }
}
