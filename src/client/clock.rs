//! The client's clock: coarse monotonic milliseconds. The cached path
//! reads them from a shared tick (one relaxed atomic load) that a ticker
//! thread keeps; every other path reads the clock itself.
//!
//! # The clock
//!
//! `CLOCK_MONOTONIC_COARSE` is the kernel's last tick, read from the vDSO
//! without a system call and without reading the TSC: a few loads (about
//! 8 ns here, against 30 ns for `CLOCK_MONOTONIC`, which `Instant::now`
//! reads). It lags real time by at most one kernel tick (1 to 10 ms, 4 ms
//! on a HZ=250 kernel), far below the 2 s the cache and the heartbeat rules
//! measure. Unix time (to compare with the agent's beat, which is Unix
//! milliseconds) is read only on the slow path.
//!
//! # The tick
//!
//! Even that read is about twenty instructions, a quarter of a cached
//! getHost + report. So a client with the route cache on reads its time
//! from the process's [`Ticker`]: an atomic word that one thread stores
//! the same coarse clock into every [`TICK_PERIOD`]. The cached path
//! compares that word with its deadlines (computed on the slow path from
//! the clock itself: one timeline). Bounds:
//!
//! - The tick lags the clock by at most [`TICK_PERIOD`] plus the ticker
//!   thread's scheduling delay (a normally loaded machine: well under
//!   10 ms; a machine with far more runnable threads than cores: more). A
//!   deadline of the cached path (heartbeat 2 s old, route due, held
//!   successes 2 s old) is noticed late by that lag, never early.
//! - The thread starts with the first cached client of the process. It
//!   stops within one period after the last one is dropped (it checks the
//!   count of clients at every tick), and when no client took a slow path
//!   for [`IDLE_MS`] (an idle process pays for no wake-ups): a client that
//!   calls at all takes one at least every 2 s (a route's refresh, the
//!   heartbeat's check, a batch due are all deadlines of 2 s), so only
//!   clients that stopped calling lose it. While no ticker runs the tick
//!   reads [`STOPPED`], which fails every deadline: calls take the slow
//!   path and read the clock themselves, and the slow path starts the
//!   ticker again.
//! - After `fork`, the child has no ticker thread: a `pthread_atfork`
//!   handler sets the child's tick to [`STOPPED`] (so a child never serves
//!   from a frozen time), and the child's next slow call starts a ticker.
//!
//! Tests drive time by hand ([`Clock::manual`]): then the tick and both
//! clocks read the value the test set, so a test writes beats and advances
//! the client's clock on one timeline.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(test)]
use std::sync::Arc;
use std::time::Duration;

/// How often the ticker stores the time: half a kernel tick at HZ=250
/// (the coarse clock's resolution there is 4 ms). About 500 wake-ups a
/// second, 0.5 % of a core on the development machine (a VM).
pub(crate) const TICK_PERIOD: Duration = Duration::from_millis(2);

/// The ticker stops when no client of the process took a slow path for
/// this long (milliseconds).
pub(crate) const IDLE_MS: u64 = 5_000;

/// The tick while no ticker runs: after every deadline, so the cached path
/// declines and the slow path reads the clock.
pub(crate) const STOPPED: u64 = u64::MAX;

/// The tick of a client that keeps no ticker (route cache off).
static NEVER_TICKS: AtomicU64 = AtomicU64::new(STOPPED);

/// The process's ticker.
static TICKER: Ticker = Ticker::new(IDLE_MS);

/// An atomic word alone on its cache lines: the readers' copy is
/// invalidated by the ticker's stores only.
#[repr(align(128))]
#[derive(Debug)]
struct Padded(AtomicU64);

/// A shared coarse time, kept by a thread of its own while anyone uses it.
#[derive(Debug)]
pub(crate) struct Ticker {
    /// Coarse monotonic milliseconds, or [`STOPPED`].
    now: Padded,
    /// The [`TickerUse`]s alive.
    users: AtomicUsize,
    /// A thread is ticking (or about to).
    running: AtomicBool,
    /// When a client last took a slow path (coarse monotonic ms).
    last_active: AtomicU64,
    /// The thread stops when `last_active` is older than this.
    idle_ms: u64,
}

impl Ticker {
    const fn new(idle_ms: u64) -> Ticker {
        Ticker {
            now: Padded(AtomicU64::new(STOPPED)),
            users: AtomicUsize::new(0),
            running: AtomicBool::new(false),
            last_active: AtomicU64::new(0),
            idle_ms,
        }
    }

    /// One more user: the ticker runs until every use is dropped (or all
    /// are idle).
    fn acquire(&'static self) -> TickerUse {
        self.users.fetch_add(1, Ordering::SeqCst);
        self.active(coarse_monotonic_ms());
        TickerUse(self)
    }

    /// A client takes a slow path at `now`: the ticker must run.
    fn active(&'static self, now: u64) {
        if self.last_active.load(Ordering::Relaxed) != now {
            self.last_active.store(now, Ordering::Relaxed);
        }
        if self.now.0.load(Ordering::Relaxed) == STOPPED {
            self.ensure_running();
        }
    }

    /// Starts the thread when none runs. On a failed start the tick stays
    /// [`STOPPED`] (every call takes the slow path) and the next slow call
    /// tries again.
    fn ensure_running(&'static self) {
        if self.running.swap(true, Ordering::SeqCst) {
            return;
        }
        let now = coarse_monotonic_ms();
        self.last_active.fetch_max(now, Ordering::Relaxed);
        self.now.0.store(now, Ordering::Relaxed);
        let started = std::thread::Builder::new()
            .name("lbagent-tick".into())
            .spawn(move || self.run());
        if started.is_err() {
            self.now.0.store(STOPPED, Ordering::Relaxed);
            self.running.store(false, Ordering::SeqCst);
        }
    }

    /// The thread: stores the time every period while anyone uses it.
    fn run(&'static self) {
        loop {
            let now = coarse_monotonic_ms();
            let idle = self.idle(now);
            if idle || self.users.load(Ordering::SeqCst) == 0 {
                self.now.0.store(STOPPED, Ordering::Relaxed);
                self.running.store(false, Ordering::SeqCst);
                // A user that came in meanwhile either saw `running` false
                // and started a thread, or saw it true before the store
                // above: then its count is visible here, and this thread
                // goes on (unless another took over). Idle (looked at
                // again: a slow call may have come in): the next slow call
                // starts a thread. Only speed depends on this: with no
                // thread, calls take the slow path.
                if self.idle(now)
                    || self.users.load(Ordering::SeqCst) == 0
                    || self.running.swap(true, Ordering::SeqCst)
                {
                    return;
                }
            }
            self.now.0.store(now, Ordering::Relaxed);
            std::thread::sleep(TICK_PERIOD);
        }
    }

    /// No client took a slow path for `idle_ms` at `now`.
    fn idle(&self, now: u64) -> bool {
        now.saturating_sub(self.last_active.load(Ordering::Relaxed)) > self.idle_ms
    }

    /// In a child after `fork`: no thread ticks there.
    fn after_fork(&self) {
        self.now.0.store(STOPPED, Ordering::Relaxed);
        self.running.store(false, Ordering::SeqCst);
    }
}

/// Keeps a [`Ticker`] running while alive.
#[derive(Debug)]
pub(crate) struct TickerUse(&'static Ticker);

impl Drop for TickerUse {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The `pthread_atfork` child handler: only atomic stores
/// (async-signal-safe).
extern "C" fn ticker_after_fork() {
    TICKER.after_fork();
}

/// Registers [`ticker_after_fork`] once per process.
fn register_fork_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handler is a plain `extern "C" fn` with no arguments
        // that only stores to atomics of a static. A failed registration
        // (ENOMEM) is tolerated: the child would then serve from a frozen
        // tick, so the ticker is not used at all (see `Clock::ticking`).
        let rc = unsafe { libc::pthread_atfork(None, None, Some(ticker_after_fork)) };
        FORK_SAFE.store(rc == 0, Ordering::SeqCst);
    });
}

/// The fork handler is registered.
static FORK_SAFE: AtomicBool = AtomicBool::new(false);

/// Where a client's time comes from.
#[derive(Debug)]
pub(crate) struct Clock {
    /// The cached path's time: the process's tick, [`NEVER_TICKS`], or a
    /// test's manual time.
    tick: &'static AtomicU64,
    /// Keeps the ticker running while the client lives.
    ticker: Option<TickerUse>,
    /// Time set by a test, milliseconds on both clocks.
    #[cfg(test)]
    manual: Option<Arc<AtomicU64>>,
}

impl Clock {
    /// The system's clocks, and a tick that never reads a time (for a
    /// client without the route cache: it has no cached path).
    pub fn real() -> Clock {
        Clock {
            tick: &NEVER_TICKS,
            ticker: None,
            #[cfg(test)]
            manual: None,
        }
    }

    /// The system's clocks and the process's ticker, kept running while
    /// this clock lives.
    pub fn ticking() -> Clock {
        register_fork_handler();
        if !FORK_SAFE.load(Ordering::SeqCst) {
            return Clock::real();
        }
        Clock {
            tick: &TICKER.now.0,
            ticker: Some(TICKER.acquire()),
            #[cfg(test)]
            manual: None,
        }
    }

    /// A clock that reads `now` (milliseconds) as the tick, monotonic and
    /// Unix time: the test moves it.
    #[cfg(test)]
    pub fn manual(now: Arc<AtomicU64>) -> Clock {
        Clock::manual_with_tick(now.clone(), now)
    }

    /// A clock that reads `now` as monotonic and Unix time, and `tick` as
    /// the cached path's time (a tick that lags, or [`STOPPED`]).
    #[cfg(test)]
    pub fn manual_with_tick(now: Arc<AtomicU64>, tick: Arc<AtomicU64>) -> Clock {
        // The tick is read through a plain reference: leak one Arc (tests).
        let tick: &'static Arc<AtomicU64> = Box::leak(Box::new(tick));
        Clock {
            tick,
            ticker: None,
            manual: Some(now),
        }
    }

    /// The cached path's time: the tick (coarse monotonic milliseconds,
    /// late by at most the ticker's lag), or [`STOPPED`] when no ticker
    /// runs. One load.
    #[inline(always)]
    pub fn tick_ms(&self) -> u64 {
        self.tick.load(Ordering::Relaxed)
    }

    /// On the slow path, at `now` ([`Clock::now_ms`]): the client is in
    /// use; starts the ticker again if it stopped while this clock uses it
    /// (idle, after `fork`, or a failed start).
    pub fn keep_ticking(&self, now: u64) {
        if let Some(t) = &self.ticker {
            t.0.active(now);
        }
    }

    /// Monotonic milliseconds (coarse: the kernel's last tick), read now.
    #[inline(always)]
    pub fn now_ms(&self) -> u64 {
        #[cfg(test)]
        if let Some(m) = &self.manual {
            return m.load(Ordering::Relaxed);
        }
        coarse_monotonic_ms()
    }

    /// Unix milliseconds (precise; slow path only).
    pub fn unix_ms(&self) -> u64 {
        #[cfg(test)]
        if let Some(m) = &self.manual {
            return m.load(Ordering::Relaxed);
        }
        lbagent_host::clock::unix_ms()
    }
}

/// `CLOCK_MONOTONIC_COARSE` in milliseconds.
#[inline(always)]
fn coarse_monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // Linux has had since 2.6.32, so the call cannot fail.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts);
    }
    (ts.tv_sec as u64) * 1_000 + (ts.tv_nsec as u64) / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Polls `f` every millisecond for at most 10 s (a loaded machine may
    /// not run a thread for a while); true when it held.
    fn within_10_s(mut f: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        f()
    }

    /// A ticker of the test's own (the process's is shared by every test),
    /// never idle.
    fn own_ticker() -> &'static Ticker {
        Box::leak(Box::new(Ticker::new(u64::MAX)))
    }

    #[test]
    fn the_coarse_clock_moves_forward_with_real_time() {
        let c = Clock::real();
        let a = c.now_ms();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let b = c.now_ms();
        // One tick of lag at each end at most (10 ms at HZ=100).
        assert!(b >= a + 10 && b < a + 10_000, "{a} then {b}");
    }

    #[test]
    fn a_manual_clock_reads_what_the_test_set_on_every_reading() {
        let t = Arc::new(AtomicU64::new(5_000));
        let c = Clock::manual(t.clone());
        assert_eq!(
            (c.tick_ms(), c.now_ms(), c.unix_ms()),
            (5_000, 5_000, 5_000)
        );
        t.store(7_001, Ordering::Relaxed);
        assert_eq!(
            (c.tick_ms(), c.now_ms(), c.unix_ms()),
            (7_001, 7_001, 7_001)
        );
    }

    #[test]
    fn a_client_without_a_ticker_reads_a_stopped_tick() {
        assert_eq!(Clock::real().tick_ms(), STOPPED);
    }

    #[test]
    fn the_tick_follows_the_clock_while_used_and_stops_after_the_last_use() {
        let t = own_ticker();
        assert_eq!(t.now.0.load(Ordering::Relaxed), STOPPED);
        let a = t.acquire();
        let b = t.acquire();
        // The tick is set when the ticker starts, then moves with the clock
        // (a coarse clock moves every 1 to 10 ms).
        let first = t.now.0.load(Ordering::Relaxed);
        assert_ne!(first, STOPPED);
        assert!(first <= coarse_monotonic_ms());
        assert!(within_10_s(|| {
            let n = t.now.0.load(Ordering::Relaxed);
            n != STOPPED && n > first
        }));
        // One use dropped: still ticking (the count is 1).
        drop(a);
        std::thread::sleep(Duration::from_millis(20));
        assert!(t.running.load(Ordering::SeqCst));
        assert_ne!(t.now.0.load(Ordering::Relaxed), STOPPED);
        // The last one dropped: the thread stops, the tick reads STOPPED.
        drop(b);
        assert!(within_10_s(|| !t.running.load(Ordering::SeqCst)));
        assert_eq!(t.now.0.load(Ordering::Relaxed), STOPPED);
        // And starts again with a new use.
        let c = t.acquire();
        assert_ne!(t.now.0.load(Ordering::Relaxed), STOPPED);
        assert!(t.running.load(Ordering::SeqCst));
        drop(c);
        assert!(within_10_s(|| !t.running.load(Ordering::SeqCst)));
    }

    #[test]
    fn after_fork_the_tick_reads_stopped_until_a_slow_call_restarts_it() {
        let t = own_ticker();
        // The state a child inherits: a user, `running`, a time, and no
        // thread (none was started here).
        t.users.store(1, Ordering::SeqCst);
        t.running.store(true, Ordering::SeqCst);
        t.now.0.store(coarse_monotonic_ms(), Ordering::Relaxed);
        let u = TickerUse(t);
        t.after_fork();
        assert_eq!(t.now.0.load(Ordering::Relaxed), STOPPED);
        assert!(!t.running.load(Ordering::SeqCst));
        t.ensure_running();
        assert!(t.running.load(Ordering::SeqCst));
        assert!(within_10_s(|| t.now.0.load(Ordering::Relaxed) != STOPPED));
        drop(u);
        assert!(within_10_s(|| !t.running.load(Ordering::SeqCst)));
    }

    #[test]
    fn a_forked_child_reads_a_stopped_tick() {
        let c = Clock::ticking();
        // (A slow call in the loop: the process's ticker stops when idle.)
        assert!(within_10_s(|| {
            c.keep_ticking(c.now_ms());
            c.tick_ms() != STOPPED
        }));
        // SAFETY: the child only loads two atomics and calls `_exit`, both
        // async-signal-safe (the parent has other threads).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let stopped = c.tick_ms() == STOPPED && !TICKER.running.load(Ordering::SeqCst);
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if stopped { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is writable.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child saw a running tick: {status:#x}"
        );
        // The parent's ticker runs on.
        assert!(within_10_s(|| {
            c.keep_ticking(c.now_ms());
            c.tick_ms() != STOPPED
        }));
    }

    #[test]
    fn an_idle_ticker_stops_and_a_slow_call_starts_it_again() {
        let t: &'static Ticker = Box::leak(Box::new(Ticker::new(50)));
        let u = t.acquire();
        assert!(t.running.load(Ordering::SeqCst));
        // No slow call for 50 ms: stopped, though a user is alive.
        assert!(within_10_s(|| !t.running.load(Ordering::SeqCst)));
        assert_eq!(t.now.0.load(Ordering::Relaxed), STOPPED);
        t.active(coarse_monotonic_ms());
        assert!(t.running.load(Ordering::SeqCst));
        assert_ne!(t.now.0.load(Ordering::Relaxed), STOPPED);
        drop(u);
        assert!(within_10_s(|| !t.running.load(Ordering::SeqCst)));
    }

    #[test]
    fn idleness_is_the_time_since_the_last_slow_call() {
        let t = Ticker::new(5_000);
        t.last_active.store(10_000, Ordering::Relaxed);
        assert!(!t.idle(10_000));
        assert!(!t.idle(15_000));
        assert!(t.idle(15_001));
        // A clock read before the last activity (another thread's) is not
        // idle.
        assert!(!t.idle(9_000));
    }

    #[test]
    fn a_ticking_clock_keeps_the_process_ticker_running() {
        let c = Clock::ticking();
        // (A slow call in the loop: the process's ticker stops when idle.)
        assert!(within_10_s(|| {
            c.keep_ticking(c.now_ms());
            c.tick_ms() != STOPPED
        }));
        // The tick lags the clock, never leads it (the same clock, read
        // earlier); STOPPED for a moment only if a thread was handing over.
        for _ in 0..1_000 {
            let tick = c.tick_ms();
            let now = c.now_ms();
            assert!(tick == STOPPED || tick <= now, "tick {tick}, clock {now}");
        }
        assert!(within_10_s(|| {
            c.keep_ticking(c.now_ms());
            c.tick_ms() != STOPPED
        }));
    }
}
