//! A stop that a blocked thread hears at once instead of polling for it:
//! an `eventfd` that any thread (or a signal handler: `write` is
//! async-signal-safe) makes readable, beside a flag. A thread that waits in
//! `poll` adds [`WakeFd::fd`] to its set; a thread with nothing else to
//! wait for calls [`WakeFd::wait`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A readable-when-woken file descriptor (an `eventfd`, non-blocking).
#[derive(Debug)]
pub struct WakeFd {
    fd: OwnedFd,
}

impl WakeFd {
    /// A new, unwoken one.
    ///
    /// # Errors
    /// When the kernel refuses an `eventfd` (the open files limit: raise
    /// `ulimit -n`).
    pub fn new() -> io::Result<WakeFd> {
        // SAFETY: eventfd takes no pointers; a negative result is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor that nothing else owns.
        Ok(WakeFd {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Makes the descriptor readable until [`Self::drain`]ed. Async-signal-safe
    /// through [`wake_raw`].
    pub fn wake(&self) {
        wake_raw(self.fd.as_raw_fd());
    }

    /// The descriptor to add to a `poll` set (`POLLIN` when woken).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Takes every wake so far; true when there was one.
    pub fn drain(&self) -> bool {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a u64 from a descriptor we own.
        let got = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut n as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        got == std::mem::size_of::<u64>() as isize && n > 0
    }

    /// Blocks until woken (then takes the wakes) or until `timeout` passed
    /// (`None`: no limit). True when woken.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let mut fds = [libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, poll_timeout_ms(timeout)) };
        self.drain()
    }
}

/// Wakes the eventfd `fd` (what [`WakeFd::wake`] does): one `write`, safe
/// inside a signal handler. A full counter (2^64 - 2 wakes not taken) is
/// already readable, so a failed write loses nothing.
pub fn wake_raw(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a u64; the result is not needed (see above).
    unsafe { libc::write(fd, (&one as *const u64).cast(), std::mem::size_of::<u64>()) };
}

/// `poll`'s timeout argument for `timeout`: -1 (none) for `None`, else the
/// milliseconds rounded up (so that a wait never ends before its deadline)
/// and capped at `i32::MAX`. Pure.
pub fn poll_timeout_ms(timeout: Option<Duration>) -> libc::c_int {
    match timeout {
        None => -1,
        Some(d) => {
            let ms = d.as_nanos().div_ceil(1_000_000);
            ms.min(libc::c_int::MAX as u128) as libc::c_int
        }
    }
}

/// A stop flag whose setting also wakes a [`WakeFd`]: the thread that
/// polls it adds [`StopEvent::fd`] to its `poll` set and needs no timeout
/// to notice the stop.
#[derive(Debug)]
pub struct StopEvent {
    set: AtomicBool,
    fd: WakeFd,
}

impl StopEvent {
    /// A stop not yet set.
    ///
    /// # Errors
    /// As [`WakeFd::new`].
    pub fn new() -> io::Result<StopEvent> {
        Ok(StopEvent {
            set: AtomicBool::new(false),
            fd: WakeFd::new()?,
        })
    }

    /// Sets the stop and wakes the waiting thread.
    pub fn set(&self) {
        self.set.store(true, Ordering::SeqCst);
        self.fd.wake();
    }

    /// Whether the stop was set.
    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// The descriptor that becomes readable when the stop is set.
    pub fn fd(&self) -> RawFd {
        self.fd.fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_rounds_up_to_whole_milliseconds_and_none_waits_forever() {
        assert_eq!(poll_timeout_ms(None), -1);
        assert_eq!(poll_timeout_ms(Some(Duration::ZERO)), 0);
        assert_eq!(poll_timeout_ms(Some(Duration::from_nanos(1))), 1);
        assert_eq!(poll_timeout_ms(Some(Duration::from_millis(25))), 25);
        assert_eq!(poll_timeout_ms(Some(Duration::from_micros(25_001))), 26);
        assert_eq!(poll_timeout_ms(Some(Duration::MAX)), libc::c_int::MAX);
    }

    #[test]
    fn a_wake_is_kept_until_taken_and_taken_once() {
        let w = WakeFd::new().unwrap();
        assert!(!w.drain(), "not woken yet");
        w.wake();
        w.wake();
        assert!(w.wait(None), "a kept wake returns at once");
        assert!(!w.drain(), "both wakes were taken together");
        assert!(!w.wait(Some(Duration::ZERO)));
    }

    #[test]
    fn a_wake_from_another_thread_ends_a_wait_without_limit() {
        let w = std::sync::Arc::new(WakeFd::new().unwrap());
        let other = w.clone();
        let h = std::thread::spawn(move || other.wake());
        assert!(w.wait(None));
        h.join().unwrap();
    }

    #[test]
    fn a_set_stop_is_seen_and_makes_its_fd_readable() {
        let s = StopEvent::new().unwrap();
        assert!(!s.is_set());
        s.set();
        assert!(s.is_set());
        let mut fds = [libc::pollfd {
            fd: s.fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) }, 1);
    }
}
