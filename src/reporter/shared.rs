//! What the executor thread and the writer threads share: the row buffer
//! and its notes behind one mutex, a condition variable per writer, the
//! connection counters, the log.
//!
//! The mutex is held for a push, a take or a settle of a batch — copies
//! of at most a report's or a batch's rows — and never across a database
//! call or a socket operation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::buffer::Buffer;
use super::metrics::ReporterStats;
use super::notes::LossNotes;
use super::Log;
use lbagent_model::{ModuleId, NodeAddr};
use lbagent_store::CallStatus;

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
    /// Per writer (the shard of the module): `(module, node, units)`
    /// consumed for good, waiting for [`lbagent_store::Store::consume`].
    pub(super) consumed: Vec<Vec<(ModuleId, NodeAddr, u32)>>,
    /// Consumed entries dropped at [`MAX_CONSUMED_WAITING`] per writer.
    pub(super) consumed_dropped: u64,
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
                consumed: vec![Vec::new(); writers],
                consumed_dropped: 0,
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

    /// Queues the rows of `reports` accepted reports (and counts `refused`
    /// refused ones), wakes the writers concerned, and logs a loss when one
    /// is due. Never waits for a writer. Returns true when drops wait to be
    /// said later (then [`Self::housekeeping`] must run when they are due).
    pub(super) fn accept(&self, rows: &[CallStatus], reports: u64, refused: u64) -> bool {
        self.reports.fetch_add(reports, Ordering::Relaxed);
        self.reports_refused.fetch_add(refused, Ordering::Relaxed);
        if rows.is_empty() {
            return false;
        }
        let now = unix_ms();
        let (line, pending) = {
            let mut core = self.lock();
            let dropped = core.buffer.push(rows);
            let Core { buffer, loss, .. } = &mut *core;
            buffer.drain_touched(|i| self.wake[i].notify_one());
            loss.dropped(dropped, now);
            let bound = buffer.bound();
            (loss.due(now, bound), loss.next_due().is_some())
        };
        if let Some(line) = line {
            self.log(&line);
        }
        pending
    }

    /// Queues capacity units consumed for good for the writer of each
    /// module's shard, and wakes it.
    pub(super) fn accept_consumed(&self, entries: &[(ModuleId, NodeAddr, u32)]) {
        if entries.is_empty() {
            return;
        }
        let dropped = {
            let mut core = self.lock();
            let writers = core.consumed.len();
            let before = core.consumed_dropped;
            for &e in entries {
                let i = super::buffer::shard_of(e.0, writers);
                if core.consumed[i].len() < MAX_CONSUMED_WAITING {
                    core.consumed[i].push(e);
                    self.wake[i].notify_one();
                } else {
                    core.consumed_dropped += 1;
                }
            }
            // A line at the first drop and every 1024th after it.
            (core.consumed_dropped / 1024 != before / 1024
                || (before == 0 && core.consumed_dropped > 0))
                .then_some(core.consumed_dropped)
        };
        if let Some(n) = dropped {
            self.log(&format!(
                "{n} consumed-units entries dropped so far: the store is not taking them ({MAX_CONSUMED_WAITING} wait per writer)"
            ));
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
