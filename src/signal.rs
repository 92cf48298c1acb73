//! SIGTERM / SIGINT for the long-running subcommands: install a handler
//! that sets a flag, then wait for it. SIGHUP asks for a configuration
//! reload: [`wait`] runs the hook [`on_reload`] set (on the waiting
//! thread, not in the handler).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

static SIGNALLED: AtomicBool = AtomicBool::new(false);
static HANGUP: AtomicBool = AtomicBool::new(false);

/// What a SIGHUP runs (none: it is logged and ignored).
type ReloadHook = Box<dyn FnMut() + Send>;
static RELOAD: Mutex<Option<ReloadHook>> = Mutex::new(None);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

extern "C" fn on_hangup(_: libc::c_int) {
    HANGUP.store(true, Ordering::SeqCst);
}

/// Installs the SIGTERM, SIGINT and SIGHUP handlers. Call before starting
/// anything, so that a signal during start-up is not lost (a SIGHUP before
/// [`wait`] is handled by it).
pub fn install() {
    // SAFETY: the handlers only store to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGHUP, on_hangup as *const () as libc::sighandler_t);
    }
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

/// Blocks until SIGTERM or SIGINT (polling every 20 ms), running the
/// reload hook on each SIGHUP meanwhile.
pub fn wait() {
    while !received() {
        reload_if_asked();
        std::thread::sleep(Duration::from_millis(20));
    }
}
