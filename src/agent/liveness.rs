//! Whether the agent's loops are alive, for systemd's watchdog.
//!
//! Each shard's request loop and the control core's main loop bump their
//! own counter ([`Beat::beat`]) on every turn: a relaxed load and store of a
//! cache-line-padded `AtomicU64` that only that loop writes. An idle shard
//! still turns: it parks on its socket for at most one tick ([`idle_tick`]:
//! a quarter of the watchdog's check, at most 500 ms) and then loops, so "parked waiting for datagrams" keeps its counter moving, while
//! an executor stuck in a computation (or blocked in a system call) does not
//! turn at all.
//!
//! The watchdog thread ([`spawn_watchdog`]) reads every counter once per
//! interval (half of systemd's `WatchdogSec=`) and sends `WATCHDOG=1` only
//! when every counter moved since its previous look ([`Progress`]): a wedged
//! shard or control core stops the pings, and systemd restarts the agent.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::runtime::Agent;
use lbagent_service::sdnotify::Notifier;

/// One loop's counter, alone on its cache line so that shards writing
/// their own never contend.
#[repr(align(128))]
#[derive(Default)]
struct Slot {
    turns: AtomicU64,
    /// Test hook: while set, the loop blocks inside [`Beat::beat`].
    #[cfg(test)]
    blocked: AtomicBool,
    /// Test hook: the loop is inside that block (its counter cannot move).
    #[cfg(test)]
    inside_block: AtomicBool,
}

/// The turn counters of the agent's loops: one per shard, then the control
/// core's.
pub struct Liveness {
    slots: Box<[Slot]>,
}

impl Liveness {
    /// Counters for `shards` shards plus the control core.
    pub fn new(shards: u32) -> Arc<Liveness> {
        Arc::new(Liveness {
            slots: (0..=shards).map(|_| Slot::default()).collect(),
        })
    }

    /// Shard `i`'s handle.
    pub fn shard(self: &Arc<Self>, i: u32) -> Beat {
        Beat {
            live: self.clone(),
            slot: i as usize,
        }
    }

    /// The control core's handle.
    pub fn control(self: &Arc<Self>) -> Beat {
        Beat {
            live: self.clone(),
            slot: self.slots.len() - 1,
        }
    }

    /// Every counter now, shards first, the control core last.
    pub fn counts(&self) -> Vec<u64> {
        self.slots
            .iter()
            .map(|s| s.turns.load(Ordering::Relaxed))
            .collect()
    }

    /// What slot `i` is, for log lines.
    fn name(&self, i: usize) -> String {
        if i + 1 == self.slots.len() {
            "the control core".to_string()
        } else {
            format!("shard {i}")
        }
    }

    /// Test hook: blocks (or releases) loop `slot` at its next turn, as a
    /// wedged shard would be.
    #[cfg(test)]
    pub(crate) fn block_for_test(&self, slot: usize, blocked: bool) {
        self.slots[slot].blocked.store(blocked, Ordering::SeqCst);
    }

    /// Test hook: loop `slot` is blocked inside [`Beat::beat`] now.
    #[cfg(test)]
    pub(crate) fn inside_block_for_test(&self, slot: usize) -> bool {
        self.slots[slot].inside_block.load(Ordering::SeqCst)
    }
}

/// One loop's handle on its counter.
pub struct Beat {
    live: Arc<Liveness>,
    slot: usize,
}

impl Beat {
    /// Counts one turn of the loop. Only this loop writes the counter, so a
    /// relaxed load and store suffice (no locked instruction).
    #[inline]
    pub fn beat(&self) {
        let s = &self.live.slots[self.slot];
        s.turns
            .store(s.turns.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        #[cfg(test)]
        if s.blocked.load(Ordering::SeqCst) {
            s.inside_block.store(true, Ordering::SeqCst);
            while s.blocked.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            s.inside_block.store(false, Ordering::SeqCst);
        }
    }
}

/// Which counters moved between two looks (pure).
#[derive(Debug, Default)]
pub struct Progress {
    last: Option<Vec<u64>>,
}

impl Progress {
    /// The first loop (index) whose counter did not move since the previous
    /// call, or `None` when all moved. The first call compares against zero
    /// (a loop that never turned is not alive).
    pub fn stalled(&mut self, counts: &[u64]) -> Option<usize> {
        let stalled = match &self.last {
            Some(last) => counts.iter().zip(last).position(|(now, then)| now == then),
            None => counts.iter().position(|&c| c == 0),
        };
        self.last = Some(counts.to_vec());
        stalled
    }
}

/// The agent's side of systemd's notification protocol (`Type=notify`).
/// Dropping it stops and joins the watchdog thread.
pub struct Systemd {
    notifier: Notifier,
    quit: Arc<AtomicBool>,
    watchdog: Option<JoinHandle<()>>,
}

impl Systemd {
    /// Sends `READY=1` (call once `agent` serves: ports bound, snapshot
    /// loaded) and, when systemd asks for a watchdog (`$WATCHDOG_USEC`),
    /// starts [`spawn_watchdog`] checking every half interval. Without
    /// `$NOTIFY_SOCKET` it does nothing.
    ///
    /// # Errors
    /// The watchdog thread cannot be spawned.
    pub fn ready(agent: &Agent) -> std::io::Result<Systemd> {
        let notifier = Notifier::from_env();
        notifier.notify_or_log("lbagent", "READY=1");
        let quit = Arc::new(AtomicBool::new(false));
        let watchdog = match lbagent_service::sdnotify::watchdog_interval() {
            Some(every) if notifier.enabled() => Some(spawn_watchdog(
                agent.liveness(),
                Notifier::from_env(),
                every / 2,
                quit.clone(),
            )?),
            _ => None,
        };
        Ok(Systemd {
            notifier,
            quit,
            watchdog,
        })
    }

    /// Sends `STOPPING=1` and stops the watchdog pings (call when the
    /// shutdown begins: the loops are about to end).
    pub fn stopping(&self) {
        self.quit.store(true, Ordering::SeqCst);
        if let Some(w) = &self.watchdog {
            w.thread().unpark();
        }
        self.notifier.notify_or_log("lbagent", "STOPPING=1");
    }
}

impl Drop for Systemd {
    fn drop(&mut self) {
        self.quit.store(true, Ordering::SeqCst);
        if let Some(w) = self.watchdog.take() {
            w.thread().unpark();
            let _ = w.join();
        }
    }
}

/// The shortest check interval.
pub const MIN_CHECK: Duration = Duration::from_millis(250);

/// The longest an idle shard parks before its loop turns anyway (without
/// a watchdog, or with one of `WatchdogSec=` 4 s and more).
pub const MAX_IDLE_TICK: Duration = Duration::from_millis(500);

/// The shortest such park.
pub const MIN_IDLE_TICK: Duration = Duration::from_millis(50);

/// How long an idle shard parks before its loop turns anyway, given
/// systemd's watchdog interval (`$WATCHDOG_USEC`, None without one): a
/// quarter of the watchdog's check (half the interval, at least
/// [`MIN_CHECK`]), so that an idle loop turns several times per check,
/// within [`MIN_IDLE_TICK`]..=[`MAX_IDLE_TICK`]. Each idle turn costs the
/// executor tens of microseconds of io_uring work (a timer, a cancelled
/// peek): with 15 shards, 50 ms ticks were 2.6% of a core while idle.
pub fn idle_tick(watchdog: Option<Duration>) -> Duration {
    match watchdog {
        None => MAX_IDLE_TICK,
        Some(every) => ((every / 2).max(MIN_CHECK) / 4).clamp(MIN_IDLE_TICK, MAX_IDLE_TICK),
    }
}

/// Starts the watchdog thread: every `check` (at least [`MIN_CHECK`]) it
/// looks at the counters and sends `WATCHDOG=1` through `notifier` when all
/// moved. A stall is logged once when it starts and once when it ends. The
/// thread ends when `stop` is set and the thread unparked (or at its next
/// check).
///
/// # Errors
/// The thread cannot be spawned.
pub fn spawn_watchdog(
    live: Arc<Liveness>,
    notifier: Notifier,
    check: Duration,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    let check = check.max(MIN_CHECK);
    std::thread::Builder::new()
        .name("lbagent-watchdog".into())
        .spawn(move || {
            let mut progress = Progress::default();
            let mut stalled_since: Option<Instant> = None;
            loop {
                let t0 = Instant::now();
                // Parked, not polling: whoever sets `stop` unparks this
                // thread (a spurious or early return just parks again).
                while let Some(left) = check.checked_sub(t0.elapsed()) {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    std::thread::park_timeout(left);
                }
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                match progress.stalled(&live.counts()) {
                    None => {
                        if let Some(since) = stalled_since.take() {
                            tracing::info!(
                                "every loop turns again after {} ms; watchdog pings resume",
                                since.elapsed().as_millis()
                            );
                        }
                        notifier.notify_or_log("lbagent", "WATCHDOG=1");
                    }
                    Some(i) => {
                        if stalled_since.is_none() {
                            stalled_since = Some(Instant::now());
                            tracing::error!(
                                "{} has not turned its loop for {} ms; withholding the systemd watchdog ping",
                                live.name(i),
                                check.as_millis()
                            );
                        }
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_config::Config;
    use lbagent_service::sdnotify::Target;
    use std::net::Ipv4Addr;
    use std::os::unix::net::UnixDatagram;

    #[test]
    fn progress_names_the_first_loop_that_did_not_move() {
        let mut p = Progress::default();
        assert_eq!(p.stalled(&[0, 3, 1]), Some(0), "never turned");
        assert_eq!(p.stalled(&[1, 4, 2]), None);
        assert_eq!(p.stalled(&[2, 4, 3]), Some(1));
        assert_eq!(p.stalled(&[3, 4, 4]), Some(1), "still stuck");
        assert_eq!(p.stalled(&[4, 5, 5]), None, "moving again");
        assert_eq!(p.stalled(&[5, 6, 5]), Some(2));
    }

    #[test]
    fn beats_count_per_slot() {
        let live = Liveness::new(2);
        let (a, c) = (live.shard(1), live.control());
        a.beat();
        a.beat();
        c.beat();
        assert_eq!(live.counts(), vec![0, 2, 1]);
        assert_eq!(live.name(0), "shard 0");
        assert_eq!(live.name(2), "the control core");
    }

    /// Pings received within `within`.
    fn pings(sock: &UnixDatagram, within: Duration) -> usize {
        let t0 = Instant::now();
        let mut n = 0;
        let mut buf = [0u8; 64];
        while let Some(left) = within.checked_sub(t0.elapsed()) {
            sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match sock.recv(&mut buf) {
                Ok(len) => {
                    assert_eq!(&buf[..len], b"WATCHDOG=1");
                    n += 1;
                }
                // A receive with a timeout fails so when the process is
                // stopped and continued: receive again, for what is left.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        n
    }

    /// Waits up to `limit` for one ping.
    fn a_ping_within(sock: &UnixDatagram, limit: Duration) -> bool {
        let t0 = Instant::now();
        let mut buf = [0u8; 64];
        while let Some(left) = limit.checked_sub(t0.elapsed()) {
            sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match sock.recv(&mut buf) {
                Ok(_) => return true,
                // Interrupted (the process stopped and continued): again.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        false
    }

    #[test]
    fn an_idle_shard_turns_four_times_per_watchdog_check() {
        assert_eq!(idle_tick(None), MAX_IDLE_TICK);
        // WatchdogSec=10s (the shipped unit): a check every 5 s.
        assert_eq!(idle_tick(Some(Duration::from_secs(10))), MAX_IDLE_TICK);
        // WatchdogSec=1s: a check every 500 ms, a turn every 125 ms.
        assert_eq!(
            idle_tick(Some(Duration::from_secs(1))),
            Duration::from_millis(125)
        );
        // Shorter than the shortest check: the check is MIN_CHECK.
        assert_eq!(
            idle_tick(Some(Duration::from_millis(100))),
            MIN_IDLE_TICK.max(MIN_CHECK / 4)
        );
        for ms in [1u64, 10, 100, 499, 500, 501, 999, 1000, 3999, 4000, 60_000] {
            let every = Duration::from_millis(ms);
            let tick = idle_tick(Some(every));
            let check = (every / 2).max(MIN_CHECK);
            assert!(tick * 4 <= check, "{ms} ms: tick {tick:?}, check {check:?}");
            assert!((MIN_IDLE_TICK..=MAX_IDLE_TICK).contains(&tick));
        }
    }

    #[test]
    fn the_watchdog_stops_while_a_shard_is_blocked() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.agent.base_port = 0;
        config.agent.shards = 2;
        config.agent.route_servers = vec!["127.0.0.1:1".into()];
        config.agent.reporters = vec!["127.0.0.1:1".into()];
        config.agent.heartbeat_path = dir.path().join("heartbeat");
        config.agent.snapshot_path = dir.path().join("routes.snapshot");
        config.agent.metrics_addr = (Ipv4Addr::LOCALHOST, 0).into();
        let agent = Agent::start(&config).expect("the agent starts");
        let live = agent.liveness();

        let sock_path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&sock_path).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        // The agent has no watchdog interval (no $WATCHDOG_USEC): its idle
        // shards turn every MAX_IDLE_TICK, four times per check.
        let check = MAX_IDLE_TICK * 4;
        let dog = spawn_watchdog(
            live.clone(),
            Notifier::new(Target::Path(sock_path)),
            check,
            stop.clone(),
        )
        .unwrap();

        // Healthy: pings arrive.
        let healthy = a_ping_within(&sock, Duration::from_secs(20))
            && a_ping_within(&sock, Duration::from_secs(20));

        // Wedge shard 1 and wait until it sits inside the block: its
        // counter's last move is behind us. Only the first watchdog check
        // after that last move can still see a change, so at most one ping
        // may come from now on however late the checks run (a loaded
        // machine delays them; it cannot make more of them see a move).
        live.block_for_test(1, true);
        let entered = {
            let t0 = Instant::now();
            while !live.inside_block_for_test(1) && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(5));
            }
            live.inside_block_for_test(1)
        };
        let _ = pings(&sock, Duration::from_millis(10));
        let while_blocked = pings(&sock, check * 4);

        // Released: pings resume.
        live.block_for_test(1, false);
        let resumed = a_ping_within(&sock, Duration::from_secs(20));

        stop.store(true, Ordering::SeqCst);
        dog.thread().unpark();
        dog.join().unwrap();
        agent.stop().unwrap();
        assert!(healthy, "no pings while every loop turned");
        assert!(entered, "shard 1 never reached the block");
        assert!(
            while_blocked <= 1,
            "{while_blocked} pings while shard 1 was blocked (at most the check right after its last turn may ping)"
        );
        assert!(resumed, "no ping after the shard was released");
    }
}
