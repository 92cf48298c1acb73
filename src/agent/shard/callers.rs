//! Who sent a request: the channel its peer address names (a UDP source,
//! a shared-memory slot, a local-socket connection), the [`ClientKey`] a
//! `balance` module books units to, and whether the agent trusts the
//! caller with requests that act beyond itself (see the shard's
//! "Who may act beyond itself").
//!
//! A local-socket connection is identified once, when the shell accepts
//! it (the kernel's `SO_PEERCRED`: uid, gid, pid), and registered here
//! with its verdict ([`ShardCore::local_connected`]); its requests carry
//! only its number. When it closes ([`ShardCore::local_closed`]) the
//! units its client held go back at once.

use std::collections::HashMap;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use super::ShardCore;
use lbagent_lb::ClientKey;
use lbagent_shm::layout::peer_slot;

/// The address a local-socket connection's requests come "from" inside
/// the shard: `[::]`, port 0, the connection's number as the scope id (never
/// a UDP source: the shards bind IPv4; never a slot, which is IPv4 too).
pub fn local_peer(conn: u32) -> SocketAddr {
    SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, conn))
}

/// The connection a [`local_peer`] address names; `None` for any other.
pub fn peer_local(peer: SocketAddr) -> Option<u32> {
    match peer {
        SocketAddr::V6(v6) if v6.ip().is_unspecified() && v6.port() == 0 => Some(v6.scope_id()),
        _ => None,
    }
}

/// The client a request's channel names: an IPv4 source as `ip << 16 |
/// port` (a slot's address is 0.0.0.0 and its index + 1), a local
/// connection as `1 << 48 | number`. Never [`lbagent_lb::ANY_CLIENT`] for
/// a real peer (its port is not 0).
pub fn client_key(peer: SocketAddr) -> ClientKey {
    match peer {
        SocketAddr::V4(v4) => v4_key(v4),
        SocketAddr::V6(v6) => match peer_local(peer) {
            Some(conn) => 1 << 48 | u64::from(conn),
            // No shard binds IPv6 today; fold it so that it is still
            // one key per source.
            None => 1 << 49 | (v6.ip().to_bits() as u64) << 16 | u64::from(v6.port()),
        },
    }
}

fn v4_key(v4: SocketAddrV4) -> ClientKey {
    u64::from(u32::from(*v4.ip())) << 16 | u64::from(v4.port())
}

/// One identified local connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalCaller {
    /// The connecting process's uid, gid and pid (as the agent's pid
    /// namespace sees it), from `SO_PEERCRED` at accept.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its pid.
    pub pid: i32,
    /// Whether the configuration trusts it with requests that act beyond
    /// itself.
    pub trusted: bool,
    /// The UDP source it proved it owns (it passed the socket when it
    /// connected): its datagrams are its own, trusted as the connection
    /// is, and their units go back when the connection closes.
    pub udp: Option<SocketAddr>,
}

/// The open local connections of a shard.
#[derive(Debug, Default)]
pub(super) struct Locals {
    open: HashMap<u32, LocalCaller>,
    /// UDP sources identified by a local connection, and which.
    by_udp: HashMap<SocketAddr, u32>,
}

impl ShardCore {
    /// Whether the caller at `peer` may act beyond itself: a slot always
    /// (the region's group is the check), a local connection when it was
    /// registered trusted, a UDP source only with `agent.udp_acts_beyond`.
    pub fn trusts(&self, peer: SocketAddr) -> bool {
        if peer_slot(peer).is_some() {
            return true;
        }
        let conn = match peer_local(peer) {
            Some(conn) => conn,
            None if self.setup.udp_acts_beyond => return true,
            None => match self.locals.by_udp.get(&peer) {
                Some(&conn) => conn,
                None => return false,
            },
        };
        self.locals.open.get(&conn).is_some_and(|c| c.trusted)
    }

    /// The shell accepted local connection `conn` from `caller`.
    pub fn local_connected(&mut self, conn: u32, caller: LocalCaller) {
        if let Some(udp) = caller.udp {
            self.locals.by_udp.insert(udp, conn);
        }
        self.locals.open.insert(conn, caller);
        self.metrics.local_connections += 1;
    }

    /// The first answer on local connection `conn`: ErrorResp `Ok` with
    /// sequence 0, saying who the agent took the caller for. The client
    /// waits for it before its first request, so that a UDP source the
    /// connection identified is known before the source's first datagram.
    pub fn local_hello(&mut self, conn: u32) -> &[u8] {
        let said = match self.locals.open.get(&conn) {
            Some(c) => format!(
                "identified: uid {} gid {} pid {}{}; {}",
                c.uid,
                c.gid,
                c.pid,
                c.udp.map_or(String::new(), |a| format!(", UDP {a}")),
                if c.trusted {
                    "trusted with requests that act beyond the caller"
                } else {
                    "not trusted with requests that act beyond the caller (agent.trusted_uids)"
                }
            ),
            None => "not identified".to_string(),
        };
        self.enc.error_resp(
            0,
            lbagent_model::ModuleId::new(0, 0),
            lbagent_wire::RetCode::Ok,
            &said,
        )
    }

    /// Local connection `conn` closed (its client exited or let go): the
    /// units it held of every `balance` module go back at once, and those
    /// of the UDP source it identified.
    pub fn local_closed(&mut self, conn: u32) {
        let Some(caller) = self.locals.open.remove(&conn) else {
            return;
        };
        self.metrics.local_connections -= 1;
        self.release_client(client_key(local_peer(conn)));
        if let Some(udp) = caller.udp {
            if self.locals.by_udp.get(&udp) == Some(&conn) {
                self.locals.by_udp.remove(&udp);
                self.release_client(client_key(udp));
            }
        }
    }

    /// A client is gone (a local connection closed, a slot reclaimed):
    /// its units of every `balance` module go back. Returns how many.
    pub fn release_client(&mut self, client: ClientKey) -> u32 {
        let mut n = 0;
        let modules = &mut self.modules;
        self.balanced.retain(|m| match modules.get_mut(m) {
            Some(e) if e.lb.units().is_some() => {
                n += e.lb.release_client(client);
                true
            }
            _ => false,
        });
        self.metrics.units_released += u64::from(n);
        n
    }

    /// The caller registered for local connection `conn`, if open.
    pub fn local_caller(&self, conn: u32) -> Option<LocalCaller> {
        self.locals.open.get(&conn).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_shm::layout::slot_peer;

    #[test]
    fn every_channel_has_its_own_key_and_none_is_any_client() {
        let keys = [
            client_key("127.0.0.1:5000".parse().unwrap()),
            client_key("127.0.0.1:5001".parse().unwrap()),
            client_key("127.0.0.2:5000".parse().unwrap()),
            client_key(slot_peer(0)),
            client_key(slot_peer(1)),
            client_key(local_peer(0)),
            client_key(local_peer(1)),
        ];
        let mut dedup = keys.to_vec();
        dedup.sort_unstable();
        dedup.dedup();
        assert_eq!(dedup.len(), keys.len());
        assert!(!keys.contains(&lbagent_lb::ANY_CLIENT));
    }

    #[test]
    fn local_peers_round_trip_and_are_neither_slots_nor_udp() {
        for c in [0, 1, 7, u32::MAX] {
            assert_eq!(peer_local(local_peer(c)), Some(c));
            assert_eq!(peer_slot(local_peer(c)), None);
        }
        assert_eq!(peer_local(slot_peer(3)), None);
        assert_eq!(peer_local("127.0.0.1:1".parse().unwrap()), None);
    }
}
