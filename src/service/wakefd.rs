//! A stop that a blocked thread hears at once instead of polling for it:
//! an `eventfd` (nix's `EventFd`) that any thread makes readable, beside a
//! flag. A thread that waits in
//! `poll` adds [`WakeFd::fd`] to its set; a thread with nothing else to
//! wait for calls [`WakeFd::wait`].

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

/// A readable-when-woken file descriptor (an `eventfd`, non-blocking).
#[derive(Debug)]
pub struct WakeFd {
    fd: EventFd,
}

impl WakeFd {
    /// A new, unwoken one.
    ///
    /// # Errors
    /// When the kernel refuses an `eventfd` (the open files limit: raise
    /// `ulimit -n`).
    pub fn new() -> io::Result<WakeFd> {
        let fd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        Ok(WakeFd { fd })
    }

    /// Makes the descriptor readable until [`Self::drain`]ed. A full counter
    /// (2^64 - 2 wakes not taken) is already readable, so a failed write
    /// loses nothing.
    pub fn wake(&self) {
        let _ = self.fd.write(1);
    }

    /// The descriptor to add to a `poll` set (`POLLIN` when woken).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Takes every wake so far; true when there was one.
    pub fn drain(&self) -> bool {
        matches!(self.fd.read(), Ok(n) if n > 0)
    }

    /// Blocks until woken (then takes the wakes) or until `timeout` passed
    /// (`None`: no limit). True when woken.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        // An interrupted or failed poll only ends the wait early; the
        // drain below says whether a wake came.
        let _ = poll(&mut fds, poll_timeout(timeout));
        self.drain()
    }
}

impl AsFd for WakeFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// [`poll_timeout_ms`] as nix's `poll` takes it.
pub fn poll_timeout(timeout: Option<Duration>) -> PollTimeout {
    PollTimeout::try_from(poll_timeout_ms(timeout)).unwrap_or(PollTimeout::NONE)
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

impl AsFd for StopEvent {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
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
        let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
        assert_eq!(poll(&mut fds, PollTimeout::ZERO), Ok(1));
    }
}
