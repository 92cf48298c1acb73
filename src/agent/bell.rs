//! The control core's doorbell to a shard that waits on its socket alone.
//!
//! A shard under UDP load waits for its next datagram in `poll(2)` on its
//! socket ([`super::park::POLL_PARK`]), not in its executor, so a message
//! the control core queues for it (a route a client's register or getHost
//! waits for) would sit in the ring until the wait ends. The control core
//! therefore rings: after it queues a message it sends the shard's socket
//! an empty datagram (a doorbell, which the shard counts as nothing more),
//! and the shard, woken, gives its executor a turn at once.
//!
//! One ring per turn: the flag says a doorbell is on its way and the shard
//! has not yet taken it, so a burst of routes (a push of thousands) costs
//! one datagram until the shard's next turn, not one each (the receive
//! buffer holds client requests, not doorbells).
//!
//! The local socket's acceptor rings the same doorbell when it queues a new
//! connection for the shard (its first request comes through the
//! executor).
//!
//! Who can reach it: the shard's socket takes datagrams from anyone who can
//! reach its port, and an empty datagram was a doorbell before this (a
//! shared-memory client's); a stranger's empty datagram only gives the
//! shard's executor an early turn. The ringers' own sockets are bound to
//! the shard's address and never read.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The ringing side of one shard's doorbell: the control core's, and the
/// local socket's acceptor's (a new connection for the shard). Clones
/// share the flag, so that all of them together send one doorbell until
/// the shard takes it.
#[derive(Clone, Debug)]
pub struct ShardBell {
    at: SocketAddr,
    rung: Arc<AtomicBool>,
}

impl ShardBell {
    /// A doorbell for the shard whose socket is at `at` (bound to every
    /// address: rung on loopback); the flag is the shard's side
    /// ([`taken`]).
    pub fn new(at: SocketAddr) -> (ShardBell, Arc<AtomicBool>) {
        let at = doorbell_address(at);
        let rung = Arc::new(AtomicBool::new(false));
        (
            ShardBell {
                at,
                rung: rung.clone(),
            },
            rung,
        )
    }

    /// A non-blocking socket of the ringer's own to ring from, bound to the
    /// shard's address (a free port): reachable by no one who cannot reach
    /// the shard already, and never read (what strangers send it is
    /// dropped once its small buffer is full).
    ///
    /// # Errors
    /// No socket can be made (the process is out of descriptors).
    pub fn socket(&self) -> std::io::Result<UdpSocket> {
        ringer(self.at)
    }

    /// Call after queuing a message for the shard: sends the doorbell on
    /// `socket` unless one is on its way that the shard has not taken. A
    /// send that fails (a full socket buffer) is left: the shard's wait
    /// ends by itself within [`super::park::POLL_PARK`].
    pub fn ring(&self, socket: &UdpSocket) {
        if !self.rung.swap(true, Ordering::AcqRel) {
            let _ = socket.send_to(&[], self.at);
        }
    }
}

/// Where a doorbell to a socket bound at `at` goes: `at`, on loopback when
/// the socket is bound to every address.
pub fn doorbell_address(mut at: SocketAddr) -> SocketAddr {
    if at.ip().is_unspecified() {
        at.set_ip(Ipv4Addr::LOCALHOST.into());
    }
    at
}

/// A non-blocking socket to ring a doorbell at `at` (a
/// [`doorbell_address`]) from: bound to `at`'s address on a free port,
/// never read, its receive buffer the smallest (what strangers send it is
/// dropped once that is full).
///
/// # Errors
/// No socket can be made (the process is out of descriptors).
pub fn ringer(at: SocketAddr) -> std::io::Result<UdpSocket> {
    let s = UdpSocket::bind((at.ip(), 0))?;
    s.set_nonblocking(true)?;
    let _ = lbagent_host::udp::set_rcvbuf(s.as_raw_fd(), 1);
    Ok(s)
}

/// The shard's side: true when the control core or the acceptor rang
/// since the last call (and takes the ring); the shard then gives its
/// executor a turn, which takes every message and connection queued
/// before the ring.
pub fn taken(rung: &AtomicBool) -> bool {
    rung.load(Ordering::Relaxed) && rung.swap(false, Ordering::AcqRel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_of_rings_sends_one_doorbell_until_the_shard_takes_it() {
        let shard = UdpSocket::bind("127.0.0.1:0").unwrap();
        shard
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let (bell, flag) = ShardBell::new(shard.local_addr().unwrap());
        let control = bell.socket().unwrap();
        assert!(!taken(&flag));
        for _ in 0..100 {
            bell.ring(&control);
        }
        let mut buf = [0u8; 8];
        assert_eq!(shard.recv(&mut buf).unwrap(), 0, "an empty datagram");
        shard.set_nonblocking(true).unwrap();
        assert!(shard.recv(&mut buf).is_err(), "one doorbell for the burst");
        assert!(taken(&flag));
        assert!(!taken(&flag), "taken once");
        shard.set_nonblocking(false).unwrap();
        bell.clone().ring(&control);
        assert_eq!(shard.recv(&mut buf).unwrap(), 0, "rings again once taken");
    }

    #[test]
    fn a_shard_bound_to_every_address_is_rung_on_loopback() {
        let shard = UdpSocket::bind("0.0.0.0:0").unwrap();
        shard
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let (bell, flag) = ShardBell::new(shard.local_addr().unwrap());
        let ringer = bell.socket().unwrap();
        assert!(ringer.local_addr().unwrap().ip().is_loopback());
        bell.ring(&ringer);
        let mut buf = [0u8; 8];
        let (n, from) = shard.recv_from(&mut buf).unwrap();
        assert_eq!((n, from), (0, ringer.local_addr().unwrap()));
        assert!(taken(&flag));
    }
}
