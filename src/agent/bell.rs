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
//! Who can reach it: the shard's socket takes datagrams from anyone who can
//! reach its port, and an empty datagram was a doorbell before this (a
//! shared-memory client's); a stranger's empty datagram only gives the
//! shard's executor an early turn.

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The control core's side of one shard's doorbell.
#[derive(Debug)]
pub struct ShardBell {
    at: SocketAddr,
    rung: Arc<AtomicBool>,
}

impl ShardBell {
    /// A doorbell for the shard whose socket is at `at`; the flag is the
    /// shard's side ([`taken`]).
    pub fn new(at: SocketAddr) -> (ShardBell, Arc<AtomicBool>) {
        let rung = Arc::new(AtomicBool::new(false));
        (
            ShardBell {
                at,
                rung: rung.clone(),
            },
            rung,
        )
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

/// The shard's side: true when the control core rang since the last call
/// (and takes the ring); the shard then gives its executor a turn, which
/// drains the ring of every message queued before the ring.
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
        let control = UdpSocket::bind("127.0.0.1:0").unwrap();
        let (bell, flag) = ShardBell::new(shard.local_addr().unwrap());
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
        bell.ring(&control);
        assert_eq!(shard.recv(&mut buf).unwrap(), 0, "rings again once taken");
    }
}
