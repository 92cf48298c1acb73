//! SIGTERM / SIGINT for the long-running subcommands: install handlers that
//! set a flag, then wait for it. SIGHUP asks for a configuration reload:
//! [`wait`] runs the hook [`on_reload`] set (on the waiting thread, not in
//! the handler).
//!
//! The handlers are signal-hook's: `flag::register` sets the flags any
//! thread reads ([`received`]), and a `Signals` iterator (its self-pipe)
//! is what [`wait`] blocks on: the waiting thread sleeps until a signal
//! comes, it does not poll the flags.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

static SIGNALLED: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);
static HANGUP: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);

/// What [`wait`] blocks on, created by [`install`] (or the first [`wait`]);
/// `None` when the kernel refused its descriptors (then [`wait`] polls the
/// flags).
static WAKE: OnceLock<Option<Mutex<Signals>>> = OnceLock::new();

/// The signals [`wait`] wakes for, created once.
fn wake() -> Option<&'static Mutex<Signals>> {
    WAKE.get_or_init(|| match Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(s) => Some(Mutex::new(s)),
        Err(e) => {
            tracing::warn!(
                "cannot create the signal wake-up descriptor ({e}); polling for signals every 20 ms instead"
            );
            None
        }
    })
    .as_ref()
}

/// What a SIGHUP runs (none: it is logged and ignored).
type ReloadHook = Box<dyn FnMut() + Send>;
static RELOAD: Mutex<Option<ReloadHook>> = Mutex::new(None);

/// Installs the SIGTERM, SIGINT and SIGHUP handlers. Call before starting
/// anything, so that a signal during start-up is not lost (a SIGHUP before
/// [`wait`] is handled by it).
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
    let _ = wake();
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
/// meanwhile. Sleeps until a signal wakes it (every 20 ms only if no
/// wake-up descriptor could be made).
pub fn wait() {
    let wake = wake();
    while !received() {
        reload_if_asked();
        if received() {
            break;
        }
        match wake {
            // The signals that woke it set the flags here too: the flag
            // handler of the same signal may not have run yet.
            Some(w) => {
                for sig in w.lock().unwrap_or_else(|e| e.into_inner()).wait() {
                    let flag = if sig == SIGHUP { &HANGUP } else { &SIGNALLED };
                    flag.store(true, Ordering::SeqCst);
                }
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
