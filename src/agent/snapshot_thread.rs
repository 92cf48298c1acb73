//! The thread that writes route snapshots, so that disk I/O never runs on
//! the control core: a slow or hung disk cannot delay the heartbeat, a
//! route update or the metrics. The control core hands over a copy of its
//! table and goes on; one write runs at a time, and a snapshot offered while
//! the last one is still being written is skipped (the next interval's
//! follows, and the caller counts the skip).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lbagent_host::snapshot::SnapshotRoute;

/// A snapshot writer running on its own thread.
pub struct SnapshotThread {
    tx: Option<SyncSender<Vec<SnapshotRoute>>>,
    thread: Option<JoinHandle<()>>,
    written: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
}

impl SnapshotThread {
    /// Starts the thread; `write` writes one snapshot (an error is logged
    /// and counted). When the thread cannot start, every offer is refused.
    pub fn spawn(
        write: impl Fn(&[SnapshotRoute]) -> Result<(), String> + Send + 'static,
    ) -> SnapshotThread {
        // A rendezvous channel: a hand-over succeeds only while the thread
        // waits for work, i.e. no write is in progress.
        let (tx, rx) = mpsc::sync_channel::<Vec<SnapshotRoute>>(0);
        let written = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let (w, f) = (written.clone(), failed.clone());
        let thread = std::thread::Builder::new()
            .name("lbagent-snapshot".into())
            .spawn(move || {
                for routes in rx {
                    match write(&routes) {
                        Ok(()) => {
                            w.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            f.fetch_add(1, Ordering::Relaxed);
                            tracing::error!("cannot write the route snapshot: {e}");
                        }
                    }
                }
            })
            .ok();
        SnapshotThread {
            tx: thread.is_some().then_some(tx),
            thread,
            written,
            failed,
        }
    }

    /// Hands `routes` to the thread when it is idle, without waiting;
    /// false when a write is still in progress (or the thread is gone).
    pub fn offer(&self, routes: Vec<SnapshotRoute>) -> bool {
        self.tx
            .as_ref()
            .is_some_and(|tx| tx.try_send(routes).is_ok())
    }

    /// Snapshots written and failed so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.written.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// The final snapshot at shutdown: waits for the write in progress,
    /// writes `routes`, and joins the thread, all within `wait`. Returns
    /// false when the disk did not let it finish in time (the thread is
    /// then left behind; the process is exiting).
    pub fn finish(mut self, routes: Vec<SnapshotRoute>, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut routes = Some(routes);
        if let Some(tx) = self.tx.take() {
            while let Some(r) = routes.take() {
                match tx.try_send(r) {
                    Ok(()) => {}
                    Err(TrySendError::Full(r)) if Instant::now() < deadline => {
                        routes = Some(r);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(_) => return false,
                }
            }
        }
        let Some(t) = self.thread.take() else {
            return false;
        };
        while !t.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        t.join().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Condvar, Mutex};

    /// A "disk" that blocks every write until released.
    #[derive(Default)]
    struct Gate {
        open: Mutex<bool>,
        cv: Condvar,
        started: AtomicU64,
    }

    fn wait_until(what: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !what() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_hung_write_never_blocks_the_caller_and_later_snapshots_are_skipped() {
        let gate = Arc::new(Gate::default());
        let g = gate.clone();
        let t = SnapshotThread::spawn(move |_| {
            g.started.fetch_add(1, Ordering::SeqCst);
            let mut open = g.open.lock().unwrap();
            while !*open {
                open = g.cv.wait(open).unwrap();
            }
            Ok(())
        });
        // The thread may not wait for work yet: offer until it takes one.
        wait_until(|| t.offer(Vec::new()));
        wait_until(|| gate.started.load(Ordering::SeqCst) == 1);
        // The disk hangs: every further offer returns at once, refused.
        for _ in 0..100 {
            assert!(!t.offer(Vec::new()));
        }
        assert_eq!(t.counts(), (0, 0));
        *gate.open.lock().unwrap() = true;
        gate.cv.notify_all();
        wait_until(|| t.counts() == (1, 0));
        assert!(t.finish(Vec::new(), Duration::from_secs(10)));
        assert_eq!(
            gate.started.load(Ordering::SeqCst),
            2,
            "the final snapshot is written"
        );
    }

    #[test]
    fn a_hung_disk_at_shutdown_costs_at_most_the_wait() {
        let t = SnapshotThread::spawn(|_| {
            std::thread::sleep(Duration::from_secs(3600));
            Ok(())
        });
        wait_until(|| t.offer(Vec::new()));
        let t0 = Instant::now();
        assert!(!t.finish(Vec::new(), Duration::from_millis(200)));
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn failures_are_counted() {
        let t = SnapshotThread::spawn(|_| Err("disk full".into()));
        wait_until(|| t.offer(Vec::new()));
        wait_until(|| t.counts() == (0, 1));
        assert!(t.finish(Vec::new(), Duration::from_secs(10)));
    }
}
