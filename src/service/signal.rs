//! SIGTERM / SIGINT for the long-running subcommands: install handlers that
//! set a flag, then wait for it. SIGHUP asks for a configuration reload:
//! [`wait`] runs the hook [`on_reload`] set (on the waiting thread, not in
//! the handler).
//!
//! The handlers are signal-hook's: `flag::register` sets the flags any
//! thread reads ([`received`]), and a thread of its own
//! (`lbagent-signals`) reads a `Signals` iterator (its self-pipe) and
//! wakes [`wait`]: the waiting thread sleeps until a signal comes, it does
//! not poll the flags.
//!
//! # SIGTERM at every moment
//!
//! The signal thread acts on SIGTERM or SIGINT whatever the main thread is
//! doing (starting, reloading, reading a file, shutting down): it arms the
//! stop bound, and a process still running [`STOP_BOUND`] after the
//! signal logs one line and exits with [`EXIT_STOP_BOUND`]. The orderly
//! shutdown of each service is bounded well within it (the agent: its
//! shards' hand-over, one delivery attempt of its statistics, the final
//! snapshot within 5 s); the bound is what keeps SIGTERM honoured when a
//! step blocks where it should not (a name that does not resolve, a file
//! system that stopped answering).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, OnceLock};
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

static SIGNALLED: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);
static HANGUP: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);

/// How long a process may take to stop after SIGTERM or SIGINT before it
/// exits anyway (systemd's own stop timeout is 90 s by default).
pub const STOP_BOUND: Duration = Duration::from_secs(30);

/// The exit status of a process that did not stop within [`STOP_BOUND`].
pub const EXIT_STOP_BOUND: i32 = 75;

/// Signals seen by the signal thread, counted: [`wait`] sleeps until the
/// count moves.
static WOKEN: (Mutex<u64>, Condvar) = (Mutex::new(0), Condvar::new());

/// Whether the signal thread runs (false: the kernel refused its
/// descriptors, and [`wait`] polls the flags).
static THREAD: OnceLock<bool> = OnceLock::new();

/// Starts the signal thread once.
fn start_thread() -> bool {
    *THREAD.get_or_init(|| {
        let mut signals = match Signals::new([SIGTERM, SIGINT, SIGHUP]) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(
                    "cannot create the signal wake-up descriptor ({e}); polling for signals every 20 ms instead"
                );
                return false;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("lbagent-signals".into())
            .spawn(move || {
                let mut armed = false;
                for sig in signals.forever() {
                    // The flag handler of the same signal may not have
                    // run yet: set the flag here too.
                    let flag = if sig == SIGHUP { &HANGUP } else { &SIGNALLED };
                    flag.store(true, Ordering::SeqCst);
                    if sig != SIGHUP && !armed {
                        armed = true;
                        arm_stop_bound(STOP_BOUND, || {
                            tracing::error!(
                                "not stopped {} s after SIGTERM (a step of the shutdown, or of the \
                                 start or reload it interrupted, is blocked): exiting now, what was \
                                 not delivered or written is lost",
                                STOP_BOUND.as_secs()
                            );
                            std::process::exit(EXIT_STOP_BOUND);
                        });
                    }
                    let (count, cv) = &WOKEN;
                    *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                    cv.notify_all();
                }
            });
        match spawned {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(
                    "cannot start the signal thread ({e}); polling for signals every 20 ms instead"
                );
                false
            }
        }
    })
}

/// Runs `expire` on a thread of its own once `bound` has passed (unless the
/// process ended first).
fn arm_stop_bound(bound: Duration, expire: impl FnOnce() + Send + 'static) {
    let armed = std::thread::Builder::new()
        .name("lbagent-stop-bound".into())
        .spawn(move || {
            std::thread::sleep(bound);
            expire();
        });
    if let Err(e) = armed {
        tracing::warn!(
            "cannot start the stop bound's thread ({e}): SIGTERM waits for the shutdown"
        );
    }
}

/// What a SIGHUP runs (none: it is logged and ignored).
type ReloadHook = Box<dyn FnMut() + Send>;
static RELOAD: Mutex<Option<ReloadHook>> = Mutex::new(None);

/// Installs the SIGTERM, SIGINT and SIGHUP handlers and the signal thread.
/// Call before starting anything, so that a signal during start-up is not
/// lost (a SIGHUP before [`wait`] is handled by it; a SIGTERM makes
/// [`wait`] return at once, and arms the stop bound from that moment).
pub fn install() {
    for (sig, flag) in [
        (SIGTERM, &SIGNALLED),
        (SIGINT, &SIGNALLED),
        (SIGHUP, &HANGUP),
    ] {
        // Fails only for the signals that cannot be caught, not these.
        if let Err(e) = signal_hook::flag::register(sig, Arc::clone(flag)) {
            tracing::warn!("cannot install the handler of signal {sig}: {e}");
        }
    }
    let _ = start_thread();
}

/// Sets what a SIGHUP runs while [`wait`] waits (replacing any earlier hook).
pub fn on_reload(hook: impl FnMut() + Send + 'static) {
    *RELOAD.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(hook));
}

/// Runs the reload hook if a SIGHUP arrived since the last call.
fn reload_if_asked() {
    if !HANGUP.swap(false, Ordering::SeqCst) {
        return;
    }
    match RELOAD.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        Some(hook) => hook(),
        None => tracing::warn!("SIGHUP: this command does not reload its configuration; ignored"),
    }
}

/// Whether SIGTERM or SIGINT arrived since [`install`].
pub fn received() -> bool {
    SIGNALLED.load(Ordering::SeqCst)
}

/// Blocks until SIGTERM or SIGINT, running the reload hook on each SIGHUP
/// meanwhile. Sleeps until the signal thread wakes it (every 20 ms only
/// if it could not be started).
pub fn wait() {
    let threaded = start_thread();
    let (count, cv) = &WOKEN;
    loop {
        // The count before the flags are looked at: a signal after this
        // read moves it, and the wait below returns at once.
        let seen = *count.lock().unwrap_or_else(|e| e.into_inner());
        if received() {
            return;
        }
        reload_if_asked();
        if received() {
            return;
        }
        if !threaded {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let guard = count.lock().unwrap_or_else(|e| e.into_inner());
        // A second now and then: a wake-up lost to a bug costs a second,
        // not the process.
        let _ = cv
            .wait_timeout_while(guard, Duration::from_secs(1), |c| *c == seen)
            .unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Instant;

    #[test]
    fn the_stop_bound_fires_after_its_time_on_a_thread_of_its_own() {
        let (tx, rx) = mpsc::channel();
        let t0 = Instant::now();
        arm_stop_bound(Duration::from_millis(50), move || {
            let _ = tx.send(t0.elapsed());
        });
        // Not before its time; within a generous deadline for a busy
        // machine.
        let took = rx.recv_timeout(Duration::from_secs(30)).expect("it fires");
        assert!(took >= Duration::from_millis(50), "{took:?}");
    }
}
