//! Batched UDP I/O with `recvmmsg` / `sendmmsg`: one system call moves a
//! whole batch of datagrams. This is what lets a shard approach the floor (a
//! bare recvmmsg/sendmmsg loop): per-datagram io_uring operations cost about
//! 1.4x the CPU per request here.
//!
//! With [`enable_timestamps`], the kernel stamps each datagram with the time
//! it arrived (`SO_TIMESTAMPNS`, else `SO_TIMESTAMP`), read back from the
//! receive's control messages ([`RecvBatch::arrived_ns`]): the shard's
//! queuing time is the handling time minus that stamp.
//!
//! Owns buffers and system calls only; what the bytes mean is not its concern.
//!
//! The socket options go through nix's typed `setsockopt`/`getsockopt`.
//! `recvmmsg`/`sendmmsg` stay raw calls, for two measured reasons. nix
//! 0.32's `recvmmsg` does not restore `msg_controllen` before reusing its
//! headers (nix-rust/nix#2813, open), so once a datagram arrives without
//! a control message the slot loses its timestamps and drop counts. And its
//! iterator API needs the buffers' `IoSlice` arrays built per call (an
//! allocation) and decodes every control message as it goes: a loopback
//! batch of 32 out and 32 in, with both control messages read, cost 185
//! instructions per datagram here against 352 through nix (callgrind).

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags};
use nix::sys::socket::{getsockopt, setsockopt, sockopt};

/// The largest request datagram a shard accepts; longer ones arrive
/// truncated and are counted as oversized.
pub const MAX_REQUEST: usize = 16 * 1024;

/// Received datagrams: a fixed set of slots filled by one `recvmmsg`.
pub struct RecvBatch {
    bufs: Vec<u8>,
    iovs: Vec<libc::iovec>,
    addrs: Vec<libc::sockaddr_in>,
    msgs: Vec<libc::mmsghdr>,
    /// Control-message space per slot (8-byte aligned), for the timestamps.
    ctrl: Vec<[u64; CTRL_WORDS]>,
    len: usize,
}

/// Control-message space per datagram, in 8-byte words: one
/// `CMSG_SPACE(sizeof(struct timespec))` is 32 bytes on 64-bit Linux, one
/// `CMSG_SPACE(sizeof(u32))` (the drop count) 24.
const CTRL_WORDS: usize = 8;

/// Which receive timestamp a socket delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stamping {
    /// `SO_TIMESTAMPNS`: nanoseconds.
    Nanos,
    /// `SO_TIMESTAMP`: microseconds (the fallback).
    Micros,
}

/// `fd` as the borrowed descriptor nix's socket calls take, for one call.
///
/// This module takes raw descriptors because the shard's socket (glommio's
/// `UdpSocket`) offers only `AsRawFd`.
fn borrowed(fd: &RawFd) -> BorrowedFd<'_> {
    // SAFETY: every public function here takes a descriptor its caller
    // holds open for the duration of the call, and the borrow ends with it.
    unsafe { BorrowedFd::borrow_raw(*fd) }
}

/// Asks the kernel to stamp every datagram received on `fd` with its
/// arrival time (`CLOCK_REALTIME`): `SO_TIMESTAMPNS`, else `SO_TIMESTAMP`.
///
/// # Errors
/// Neither option could be set.
pub fn enable_timestamps(fd: RawFd) -> io::Result<Stamping> {
    let fd = borrowed(&fd);
    setsockopt(&fd, sockopt::ReceiveTimestampns, &true)
        .map(|()| Stamping::Nanos)
        .or_else(|_| setsockopt(&fd, sockopt::ReceiveTimestamp, &true).map(|()| Stamping::Micros))
        .map_err(io::Error::from)
}

/// Asks the kernel to attach to every datagram received on `fd` its
/// running count of datagrams dropped on that socket for want of receive
/// buffer (`SO_RXQ_OVFL`), read back with [`RecvBatch::drops`].
///
/// # Errors
/// The system refused the option.
pub fn enable_drop_count(fd: RawFd) -> io::Result<()> {
    Ok(setsockopt(&borrowed(&fd), sockopt::RxqOvfl, &1)?)
}

/// Blocks the calling thread until `fd` is readable or `timeout`
/// passes (`poll(2)`; rounded down to whole milliseconds, at most
/// 65,535). Returns true when it is readable, and when the wait was cut
/// short (a signal, or an error): the caller reads the socket and finds
/// out. One system call, and the thread sleeps meanwhile: the cheapest
/// park for a thread that has nothing else to wait on.
pub fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(borrowed(&fd), PollFlags::POLLIN)];
    !matches!(poll(&mut fds, ms), Ok(0))
}

/// Gives the core to another runnable thread, if there is one
/// (`sched_yield`): a shard's quiet spin calls it now and then, so that on a
/// host with fewer cores than busy threads the clients whose next requests
/// it waits for can run. Returns at once on a core of its own.
pub fn yield_core() {
    // std's yield is `sched_yield` on Linux.
    std::thread::yield_now();
}

/// Sets `fd`'s receive buffer (`SO_RCVBUF`) to `bytes` and returns the
/// size the kernel then reports: it doubles the value (its own bookkeeping
/// per datagram) and caps it at twice `net.core.rmem_max`.
///
/// # Errors
/// The system refused the option.
pub fn set_rcvbuf(fd: RawFd, bytes: u32) -> io::Result<usize> {
    let v = bytes.min(i32::MAX as u32) as usize;
    setsockopt(&borrowed(&fd), sockopt::RcvBuf, &v)?;
    rcvbuf(fd)
}

/// `fd`'s receive buffer as the kernel reports it (`SO_RCVBUF`), bytes.
///
/// # Errors
/// The descriptor is not a socket.
pub fn rcvbuf(fd: RawFd) -> io::Result<usize> {
    Ok(getsockopt(&borrowed(&fd), sockopt::RcvBuf)?)
}

/// Now on `CLOCK_REALTIME` (the clock of the kernel's receive
/// timestamps), nanoseconds since the epoch.
#[inline]
pub fn realtime_ns() -> u64 {
    // The same system call as std's `SystemTime::now`, without its
    // `Duration` arithmetic (see `clock::now_ms`).
    crate::clock::read_ns(libc::CLOCK_REALTIME)
}

impl RecvBatch {
    /// A batch of `slots` datagrams of at most [`MAX_REQUEST`] bytes.
    pub fn new(slots: usize) -> Self {
        let slots = slots.max(1);
        RecvBatch {
            bufs: vec![0; slots * MAX_REQUEST],
            iovs: Vec::with_capacity(slots),
            addrs: vec![to_sockaddr(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)); slots],
            // SAFETY: mmsghdr is a plain C struct for which all-zero bytes
            // are a valid value.
            msgs: vec![unsafe { zeroed() }; slots],
            ctrl: vec![[0; CTRL_WORDS]; slots],
            len: 0,
        }
    }

    /// Receives as many datagrams as are queued, up to the batch size,
    /// without blocking. Returns how many (0 when none is waiting).
    ///
    /// # Errors
    /// The system call's error, other than "would block" and "interrupted".
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        let slots = self.msgs.len();
        self.iovs.clear();
        let base = self.bufs.as_mut_ptr();
        for i in 0..slots {
            self.iovs.push(libc::iovec {
                // SAFETY: i * MAX_REQUEST + MAX_REQUEST <= bufs.len().
                iov_base: unsafe { base.add(i * MAX_REQUEST) }.cast(),
                iov_len: MAX_REQUEST,
            });
        }
        for i in 0..slots {
            let h = &mut self.msgs[i].msg_hdr;
            h.msg_name = (&mut self.addrs[i] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = size_of::<libc::sockaddr_in>() as u32;
            h.msg_iov = &mut self.iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = self.ctrl[i].as_mut_ptr().cast();
            h.msg_controllen = CTRL_WORDS * 8;
            h.msg_flags = 0;
            self.msgs[i].msg_len = 0;
        }
        self.len = 0;
        // SAFETY: every header points at live buffers owned by self.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                self.msgs.as_mut_ptr(),
                slots as u32,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        self.len = n as usize;
        Ok(self.len)
    }

    /// Datagram `i` of the last receive: its bytes, its sender, and whether
    /// it was truncated (longer than [`MAX_REQUEST`]).
    pub fn get(&self, i: usize) -> (&[u8], SocketAddr, bool) {
        assert!(i < self.len, "datagram {i} of {}", self.len);
        let m = &self.msgs[i];
        let len = (m.msg_len as usize).min(MAX_REQUEST);
        let bytes = &self.bufs[i * MAX_REQUEST..i * MAX_REQUEST + len];
        let truncated = m.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
        (bytes, from_sockaddr(&self.addrs[i]), truncated)
    }

    /// Bytes of control messages the kernel attached to datagram `i` of the
    /// last receive (0 unless an option such as [`enable_timestamps`] asked
    /// for them): the per-datagram cost those options add.
    pub fn control_bytes(&self, i: usize) -> usize {
        assert!(i < self.len, "datagram {i} of {}", self.len);
        self.msgs[i].msg_hdr.msg_controllen
    }

    /// The first control message of datagram `i` of the last receive for
    /// which `pick` (level, type, data) returns a value.
    #[inline]
    fn find_cmsg<T>(
        &self,
        i: usize,
        mut pick: impl FnMut(i32, i32, *const u8) -> Option<T>,
    ) -> Option<T> {
        assert!(i < self.len, "datagram {i} of {}", self.len);
        let h = &self.msgs[i].msg_hdr;
        if h.msg_controllen == 0 {
            return None;
        }
        // SAFETY: the header's control fields describe self.ctrl[i], which
        // the kernel filled; the CMSG_* walk stays within msg_controllen,
        // and `pick` reads only the data of the kind it matched.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(h);
            while !c.is_null() {
                if let Some(v) = pick((*c).cmsg_level, (*c).cmsg_type, libc::CMSG_DATA(c)) {
                    return Some(v);
                }
                c = libc::CMSG_NXTHDR(h, c);
            }
        }
        None
    }

    /// When datagram `i` of the last receive arrived, nanoseconds on
    /// `CLOCK_REALTIME`, if the kernel stamped it (see [`enable_timestamps`]).
    pub fn arrived_ns(&self, i: usize) -> Option<u64> {
        // SAFETY (reads): the kernel wrote a timespec / timeval as the data
        // of a control message of that type.
        self.find_cmsg(i, |level, kind, data| unsafe {
            if level == libc::SOL_SOCKET && kind == libc::SCM_TIMESTAMPNS {
                let ts: libc::timespec = std::ptr::read_unaligned(data.cast());
                return Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
            }
            if level == libc::SOL_SOCKET && kind == libc::SCM_TIMESTAMP {
                let tv: libc::timeval = std::ptr::read_unaligned(data.cast());
                return Some(tv.tv_sec as u64 * 1_000_000_000 + tv.tv_usec as u64 * 1000);
            }
            None
        })
    }

    /// The kernel's running count of datagrams dropped on the socket as
    /// datagram `i` of the last receive carried it (see
    /// [`enable_drop_count`]: the count when the datagram was queued;
    /// it wraps). `None` when it carried none: the option is off, or the
    /// socket has dropped nothing yet.
    pub fn drops(&self, i: usize) -> Option<u32> {
        // SAFETY (read): the kernel wrote a u32 as SO_RXQ_OVFL's data.
        self.find_cmsg(i, |level, kind, data| unsafe {
            (level == libc::SOL_SOCKET && kind == libc::SO_RXQ_OVFL)
                .then(|| std::ptr::read_unaligned(data.cast::<u32>()))
        })
    }
}

/// Answers to send: bytes appended to one buffer, sent by one `sendmmsg`.
pub struct SendBatch {
    data: Vec<u8>,
    spans: Vec<(usize, usize, libc::sockaddr_in)>,
    iovs: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
}

impl Default for SendBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl SendBatch {
    /// An empty batch.
    pub fn new() -> Self {
        SendBatch {
            data: Vec::with_capacity(64 * 1024),
            spans: Vec::with_capacity(64),
            iovs: Vec::with_capacity(64),
            msgs: Vec::with_capacity(64),
        }
    }

    /// Queues `bytes` for `to`. IPv6 destinations are ignored (shards bind IPv4).
    pub fn push(&mut self, to: SocketAddr, bytes: &[u8]) {
        let SocketAddr::V4(v4) = to else { return };
        let start = self.data.len();
        self.data.extend_from_slice(bytes);
        self.spans.push((start, bytes.len(), to_sockaddr(v4)));
    }

    /// How many datagrams are queued.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Sends everything queued and empties the batch. Returns how many
    /// datagrams could not be sent (the socket buffer was full, or the
    /// destination refused); those are dropped, as UDP would.
    pub fn flush(&mut self, fd: RawFd) -> usize {
        let total = self.spans.len();
        let mut sent = 0;
        let mut failed = 0;
        while sent < total {
            self.iovs.clear();
            self.msgs.clear();
            let base = self.data.as_mut_ptr();
            for &(start, len, _) in &self.spans[sent..] {
                self.iovs.push(libc::iovec {
                    // SAFETY: start + len <= data.len().
                    iov_base: unsafe { base.add(start) }.cast(),
                    iov_len: len,
                });
            }
            for (k, span) in self.spans[sent..].iter_mut().enumerate() {
                // SAFETY: all-zero is a valid mmsghdr.
                let mut m: libc::mmsghdr = unsafe { zeroed() };
                m.msg_hdr.msg_name = (&mut span.2 as *mut libc::sockaddr_in).cast();
                m.msg_hdr.msg_namelen = size_of::<libc::sockaddr_in>() as u32;
                m.msg_hdr.msg_iov = &mut self.iovs[k];
                m.msg_hdr.msg_iovlen = 1;
                self.msgs.push(m);
            }
            // SAFETY: headers point at live buffers owned by self.
            let n = unsafe {
                libc::sendmmsg(
                    fd,
                    self.msgs.as_mut_ptr(),
                    self.msgs.len() as u32,
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                // The first datagram failed (buffer full, or an ICMP error
                // from an earlier send): drop it and go on with the rest.
                let e = io::Error::last_os_error();
                if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                failed += 1;
                sent += 1;
            } else {
                sent += n as usize;
            }
        }
        self.data.clear();
        self.spans.clear();
        failed
    }
}

fn from_sockaddr(a: &libc::sockaddr_in) -> SocketAddr {
    let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
    SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(a.sin_port)))
}

fn to_sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_batch_goes_out_and_comes_back_in_order() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let mut out = SendBatch::new();
        for i in 0..10u8 {
            out.push(to, &[i; 3]);
        }
        assert_eq!(out.flush(client.as_raw_fd()), 0);
        let mut batch = RecvBatch::new(32);
        let mut got = Vec::new();
        for _ in 0..100 {
            let n = batch.recv(server.as_raw_fd()).unwrap();
            for i in 0..n {
                let (bytes, from, truncated) = batch.get(i);
                assert_eq!(from, client.local_addr().unwrap());
                assert!(!truncated);
                got.push(bytes.to_vec());
            }
            if got.len() == 10 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(got, (0..10u8).map(|i| vec![i; 3]).collect::<Vec<_>>());
        assert_eq!(
            batch.recv(server.as_raw_fd()).unwrap(),
            0,
            "nothing left: does not block"
        );
    }

    #[test]
    fn the_kernel_stamps_arrival_when_asked() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let mut batch = RecvBatch::new(4);
        // Without the option: no stamp.
        client.send_to(b"a", to).unwrap();
        let mut n = 0;
        for _ in 0..100 {
            n = batch.recv(server.as_raw_fd()).unwrap();
            if n > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(n, 1);
        assert_eq!(batch.arrived_ns(0), None);
        enable_timestamps(server.as_raw_fd()).unwrap();
        let before = realtime_ns();
        client.send_to(b"b", to).unwrap();
        for _ in 0..100 {
            n = batch.recv(server.as_raw_fd()).unwrap();
            if n > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let after = realtime_ns();
        assert_eq!(n, 1);
        let at = batch.arrived_ns(0).expect("stamped");
        // The stamp lies between the send and the receive (a microsecond
        // stamp may round down below `before` by under 1 µs).
        assert!(at + 1000 >= before && at <= after, "{before} {at} {after}");
    }

    #[test]
    fn the_kernel_counts_the_datagrams_a_full_buffer_dropped() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        set_rcvbuf(server.as_raw_fd(), 4096).unwrap();
        enable_timestamps(server.as_raw_fd()).unwrap();
        enable_drop_count(server.as_raw_fd()).unwrap();
        client.set_nonblocking(true).unwrap();
        // Far more than a 4 KiB buffer holds (each costs hundreds of bytes
        // of it), none read meanwhile.
        for _ in 0..200 {
            let _ = client.send_to(&[1u8; 100], to);
        }
        let mut batch = RecvBatch::new(32);
        let (mut got, mut last) = (0u32, None);
        for _ in 0..100 {
            let n = batch.recv(server.as_raw_fd()).unwrap();
            for i in 0..n {
                if let Some(d) = batch.drops(i) {
                    last = Some(d);
                }
            }
            got += n as u32;
            if n == 0 && got > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // The count is the one when a datagram was queued: the buffer
        // filled, then the rest were dropped, so none received yet says.
        assert_eq!(last, None, "the drops came after every queued datagram");
        assert!(got > 0 && got < 200, "{got}");
        // The next datagram queued carries the count: every datagram was
        // either received or dropped.
        client.send_to(&[2u8; 10], to).unwrap();
        let mut n = 0;
        for _ in 0..100 {
            n = batch.recv(server.as_raw_fd()).unwrap();
            if n > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(n, 1);
        assert_eq!(
            batch.arrived_ns(0).map(|_| ()),
            Some(()),
            "both messages fit"
        );
        assert_eq!(batch.drops(0), Some(200 - got));
    }

    #[test]
    fn the_receive_buffer_is_set_and_read_back() {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let got = set_rcvbuf(s.as_raw_fd(), 8192).unwrap();
        // Linux doubles it; another kernel may not.
        assert!(got >= 8192, "{got}");
        assert_eq!(rcvbuf(s.as_raw_fd()).unwrap(), got);
    }

    #[test]
    fn an_oversized_datagram_is_flagged_truncated() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .send_to(&vec![7u8; MAX_REQUEST + 100], server.local_addr().unwrap())
            .unwrap();
        let mut batch = RecvBatch::new(4);
        let mut n = 0;
        for _ in 0..100 {
            n = batch.recv(server.as_raw_fd()).unwrap();
            if n > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(n, 1);
        let (bytes, _, truncated) = batch.get(0);
        assert!(truncated && bytes.len() == MAX_REQUEST);
    }
}
