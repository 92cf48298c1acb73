//! SIGTERM / SIGINT for the long-running subcommands: install a handler
//! that sets a flag, then wait for it. SIGHUP asks for a configuration
//! reload: [`wait`] runs the hook [`on_reload`] set (on the waiting
//! thread, not in the handler).
//!
//! The handlers also wake an `eventfd` ([`crate::wakefd`]) that [`wait`]
//! blocks on: the waiting thread sleeps until a signal comes, it does not
//! poll the flags.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::wakefd::{self, WakeFd};

static SIGNALLED: AtomicBool = AtomicBool::new(false);
static HANGUP: AtomicBool = AtomicBool::new(false);

/// What the handlers wake; created by [`install`] (or the first [`wait`]).
static WAKE: OnceLock<Option<WakeFd>> = OnceLock::new();
/// [`WAKE`]'s descriptor for the handlers (-1: none).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);

/// The descriptor [`wait`] blocks on, created once; `None` when the kernel
/// refused one (then [`wait`] polls the flags).
fn wake_fd() -> Option<&'static WakeFd> {
    WAKE.get_or_init(|| match WakeFd::new() {
        Ok(w) => {
            WAKE_FD.store(w.fd(), Ordering::SeqCst);
            Some(w)
        }
        Err(e) => {
            tracing::warn!(
                "cannot create the signal wake-up descriptor ({e}); polling for signals every 20 ms instead"
            );
            None
        }
    })
    .as_ref()
}

/// Wakes [`wait`] from a handler (async-signal-safe: one `write`).
fn wake_waiter() {
    let fd = WAKE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        wakefd::wake_raw(fd);
    }
}

/// What a SIGHUP runs (none: it is logged and ignored).
type ReloadHook = Box<dyn FnMut() + Send>;
static RELOAD: Mutex<Option<ReloadHook>> = Mutex::new(None);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
    wake_waiter();
}

extern "C" fn on_hangup(_: libc::c_int) {
    HANGUP.store(true, Ordering::SeqCst);
    wake_waiter();
}

/// Installs the SIGTERM, SIGINT and SIGHUP handlers. Call before starting
/// anything, so that a signal during start-up is not lost (a SIGHUP before
/// [`wait`] is handled by it).
pub fn install() {
    let _ = wake_fd();
    // SAFETY: the handlers only store to atomics and write to an eventfd,
    // which are async-signal-safe.
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

/// Blocks until SIGTERM or SIGINT, running the reload hook on each SIGHUP
/// meanwhile. Sleeps until a signal wakes it (every 20 ms only if no
/// wake-up descriptor could be made).
pub fn wait() {
    let wake = wake_fd();
    while !received() {
        reload_if_asked();
        if received() {
            break;
        }
        match wake {
            Some(w) => {
                w.wait(None);
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
