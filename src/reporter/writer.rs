//! The writer threads: writer `i` owns one store connection and drains
//! shard `i` of the buffer in transactions of up to `batch_rows` rows.
//!
//! - A failed connection or transaction puts the batch back (the rows stay
//!   the oldest of the shard: retried first, dropped first if the bound is
//!   passed), drops the connection, and retries after a jittered
//!   exponential back-off capped at `retry_max_ms`; rows are never given
//!   up while the bound holds them. Only a successful write ends an
//!   outage: a connection that opens again (a read-only or locked file
//!   opens fine) neither resets the back-off nor counts the writer up.
//! - A write blocked for longer than [`WRITE_STALL`] (a lock held by
//!   another process) counts the writer down in the metrics while it
//!   waits.
//! - A batch the store refuses as invalid is counted as rejected and not
//!   retried (retrying would fail forever and block the shard).
//! - The log says when the store goes down (once per writer, then a
//!   reminder every [`OUTAGE_NOTE_INTERVAL_MS`]) and when it is back.
//! - While stopping, a writer writes what its shard holds and ends when it
//!   is empty; past the deadline it ends after its current attempt.
//!
//! A writer waits on its own condition variable, without a timeout: the
//! executor wakes it when rows arrive in its shard, a stop when the phase
//! changes; it never makes the executor wait.

use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::buffer::{Batch, Settled};
use super::notes::OutageNotes;
use super::shared::{unix_ms, ConsumedReport, Phase, Shared};
use super::OpenStore;
use lbagent_store::{Store, StoreError};

/// At most one reminder per writer per this many milliseconds while the
/// store stays down.
pub const OUTAGE_NOTE_INTERVAL_MS: u64 = 30_000;

/// A write in progress for longer than this counts its writer down.
pub const WRITE_STALL: Duration = Duration::from_secs(1);

/// The first retry delay, milliseconds (capped by `retry_max_ms`).
const BACKOFF_INITIAL_MS: u64 = 50;

/// The retry delay after `failures` (at least 1) consecutive failures:
/// `min(max, initial * 2^(failures-1))`, jittered down by up to a half with
/// `rng`, and at least 1 ms.
pub fn backoff_ms(failures: u32, initial: u64, max: u64, rng: &mut fastrand::Rng) -> u64 {
    let base = 1u64
        .checked_shl(failures.saturating_sub(1))
        .and_then(|factor| initial.checked_mul(factor))
        .map_or(max, |d| d.min(max));
    (base - rng.u64(0..=base / 2)).max(1)
}

/// Starts writer `i`, with `first` as its connection when given.
///
/// # Errors
/// When the thread cannot be spawned.
pub(super) fn spawn(
    i: usize,
    shared: Arc<Shared>,
    open: OpenStore,
    first: Option<Box<dyn Store>>,
) -> std::io::Result<JoinHandle<()>> {
    shared.lock().running += 1;
    let result = thread::Builder::new()
        // A name the kernel's 15-byte thread name keeps apart from the
        // executor's ("lbagent-reporter" shows as "lbagent-reporte"), so
        // that top, perf and /proc tell the store's CPU from the network's.
        .name(format!("lbagent-repw-{i}"))
        .spawn({
            let shared = shared.clone();
            move || {
                let _ended = Ended { shared: &shared, i };
                Writer::new(i, &shared, open, first).run();
            }
        });
    if result.is_err() {
        shared.lock().running -= 1;
    }
    result
}

/// Tells the shared state that the writer ended, even when it panicked.
struct Ended<'a> {
    shared: &'a Shared,
    i: usize,
}

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.shared.writer_ended(self.i);
    }
}

struct Writer<'a> {
    i: usize,
    shared: &'a Shared,
    open: OpenStore,
    store: Option<Box<dyn Store>>,
    failures: u32,
    outage: OutageNotes,
    rng: fastrand::Rng,
}

impl<'a> Writer<'a> {
    fn new(i: usize, shared: &'a Shared, open: OpenStore, store: Option<Box<dyn Store>>) -> Self {
        Writer {
            i,
            shared,
            open,
            store,
            failures: 0,
            outage: OutageNotes::new(OUTAGE_NOTE_INTERVAL_MS),
            rng: fastrand::Rng::new(),
        }
    }

    fn run(&mut self) {
        if self.store.is_some() {
            self.connected();
        }
        let mut batch = Batch::default();
        while self.has_work() {
            if self.store.is_none() {
                match (self.open)() {
                    Ok(store) => {
                        self.store = Some(store);
                        self.connected();
                    }
                    Err(e) => {
                        self.down(&e);
                        self.pause();
                        continue;
                    }
                }
            }
            if !self.next_batch(&mut batch) {
                break;
            }
            self.write_consumed();
            if !batch.is_empty() {
                self.write(&mut batch);
            }
        }
    }

    /// Whether the writer should go on: not abandoned, and not stopping
    /// with an empty shard.
    fn has_work(&self) -> bool {
        let core = self.shared.lock();
        match core.phase {
            Phase::Running => true,
            Phase::Draining(_) => {
                core.buffer.waiting(self.i) > 0 || !core.consumed[self.i].is_empty()
            }
            Phase::Abandoned => false,
        }
    }

    /// Waits for rows in the shard and takes a batch; false when the writer
    /// is to end instead.
    fn next_batch(&self, batch: &mut Batch) -> bool {
        let mut core = self.shared.lock();
        loop {
            match core.phase {
                Phase::Abandoned => return false,
                Phase::Draining(_)
                    if core.buffer.waiting(self.i) == 0 && core.consumed[self.i].is_empty() =>
                {
                    return false
                }
                _ => {}
            }
            let rows = core
                .buffer
                .take_batch(self.i, self.shared.batch_rows, batch);
            if rows || !core.consumed[self.i].is_empty() {
                return true;
            }
            // No timeout: rows, consumed units and every phase change are
            // made under the lock and notified, so nothing is missed, and
            // an idle writer sleeps until one comes.
            core = self
                .shared
                .wake(self.i)
                .wait(core)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Applies the capacity units consumed for good that wait for this
    /// writer, a transaction per report: exactly once for a report that
    /// names its agent run ([`Store::consume_once`]), else as given. A
    /// report applied releases its hold on its ticket; on a store failure
    /// the rest wait again (oldest first); a report the store refuses is
    /// logged and released as rejected.
    fn write_consumed(&mut self) {
        let reports = {
            let mut core = self.shared.lock();
            core.consumed_entries[self.i] = 0;
            std::mem::take(&mut core.consumed[self.i])
        };
        if reports.is_empty() {
            return;
        }
        let mut reports = reports.into_iter();
        while let Some(report) = reports.next() {
            let Some(store) = self.store.as_mut() else {
                self.requeue_consumed(std::iter::once(report).chain(reports));
                return;
            };
            let result = match report.key {
                Some(key) => store
                    .consume_once(key, &report.entries, unix_ms() / 1000)
                    .map(|_| ()),
                None => store.consume(&report.entries).map(|_| ()),
            };
            match result {
                Ok(()) => self
                    .shared
                    .settle(|core| core.buffer.release(report.ticket, Settled::Committed)),
                Err(StoreError::BadInput(why)) => {
                    self.shared.log(&format!(
                        "writer {}: the store refused {} consumed-units entries, which are dropped: {why}",
                        self.i,
                        report.entries.len()
                    ));
                    self.shared
                        .settle(|core| core.buffer.release(report.ticket, Settled::Rejected));
                }
                Err(e) => {
                    self.requeue_consumed(std::iter::once(report).chain(reports));
                    self.down(&e);
                    self.store = None;
                    return;
                }
            }
        }
    }

    /// Puts `reports` back at the front of this writer's consumed units.
    fn requeue_consumed(&self, reports: impl Iterator<Item = ConsumedReport>) {
        let reports: Vec<ConsumedReport> = reports.collect();
        let mut core = self.shared.lock();
        core.consumed_entries[self.i] += reports.iter().map(|r| r.entries.len()).sum::<usize>();
        core.consumed[self.i].splice(0..0, reports);
    }

    /// Writes `batch` in one transaction and settles it.
    fn write(&mut self, batch: &mut Batch) {
        let Some(store) = self.store.as_mut() else {
            self.shared.settle(|core| core.buffer.failed(batch));
            return;
        };
        self.shared.lock().writing_since[self.i] = Some(Instant::now());
        let result = store.upsert_status(batch.rows());
        self.shared.lock().writing_since[self.i] = None;
        match result {
            Ok(()) => {
                self.shared.settle(|core| core.buffer.written(batch));
                self.up();
            }
            Err(StoreError::BadInput(why)) => {
                let n = batch.rows().len();
                self.shared.settle(|core| core.buffer.rejected(batch));
                self.shared.log(&format!(
                    "writer {}: the store refused {n} rows, which are dropped (counted in lbagent_reporter_rows_rejected_total): {why}",
                    self.i
                ));
                self.up();
            }
            Err(e) => {
                self.shared.settle(|core| core.buffer.failed(batch));
                self.store = None;
                self.down(&e);
                self.pause();
            }
        }
    }

    /// A connection was opened. That says little of whether writes work (a
    /// read-only or locked database opens fine): after failures, a writer
    /// with rows to write stays down, and its back-off keeps growing, until
    /// a write succeeds. One with nothing to write has no better evidence
    /// than the open, and counts up.
    fn connected(&mut self) {
        let mut core = self.shared.lock();
        if self.failures == 0 || core.buffer.waiting(self.i) == 0 {
            core.writer_up[self.i] = true;
        }
    }

    /// The last write succeeded.
    fn up(&mut self) {
        self.failures = 0;
        self.shared.lock().writer_up[self.i] = true;
        if let Some(line) = self.outage.succeeded(unix_ms()) {
            self.shared.log(&format!("writer {}: {line}", self.i));
        }
    }

    /// An attempt to connect or to write failed.
    fn down(&mut self, e: &StoreError) {
        self.failures = self.failures.saturating_add(1);
        if matches!(e, StoreError::Replaced { .. }) {
            self.shared
                .store_replaced
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.shared.write_failed();
        {
            let mut core = self.shared.lock();
            core.writer_up[self.i] = false;
            core.last_error = Some(e.to_string());
        }
        let line = self.outage.failed(unix_ms(), e, self.shared.retry_max_ms);
        if let Some(line) = line {
            self.shared.log(&format!("writer {}: {line}", self.i));
        }
    }

    /// Sleeps for the back-off delay; cut short when the reporter is
    /// abandoned or its stop deadline comes first.
    fn pause(&mut self) {
        let max = self.shared.retry_max_ms.max(1);
        let delay = backoff_ms(
            self.failures,
            BACKOFF_INITIAL_MS.min(max),
            max,
            &mut self.rng,
        );
        let mut until = Instant::now() + Duration::from_millis(delay);
        let mut core = self.shared.lock();
        loop {
            match core.phase {
                Phase::Abandoned => return,
                Phase::Draining(deadline) => until = until.min(deadline),
                Phase::Running => {}
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            core = self
                .shared
                .wake(self.i)
                .wait_timeout(core, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_up_to_its_cap_with_jitter_below() {
        let mut rng = fastrand::Rng::with_seed(1);
        for failures in 1..80 {
            let base = (50u64 << (failures - 1).min(20)).min(5000);
            for _ in 0..20 {
                let d = backoff_ms(failures, 50, 5000, &mut rng);
                assert!(
                    d <= base && d >= base - base / 2,
                    "{failures}: {d} vs {base}"
                );
            }
        }
        let huge = backoff_ms(u32::MAX, 50, 10, &mut rng);
        assert!((5..=10).contains(&huge), "no overflow past the cap: {huge}");
        assert!(backoff_ms(1, 1, 1, &mut rng) >= 1, "never 0");
        assert!(
            backoff_ms(0, 50, 5000, &mut rng) <= 50,
            "0 failures reads as 1"
        );
    }
}
