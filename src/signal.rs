//! SIGTERM / SIGINT for the long-running subcommands: install a handler
//! that sets a flag, then wait for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

/// Installs the SIGTERM and SIGINT handler. Call before starting anything,
/// so that a signal during start-up is not lost.
pub fn install() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
}

/// Whether SIGTERM or SIGINT arrived since [`install`].
pub fn received() -> bool {
    SIGNALLED.load(Ordering::SeqCst)
}

/// Blocks until SIGTERM or SIGINT (polling every 20 ms).
pub fn wait() {
    while !received() {
        std::thread::sleep(Duration::from_millis(20));
    }
}
