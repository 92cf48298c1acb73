//! At most one log line per peer per interval (a minute for refusals):
//! a peer that retries a refused handshake every 100 ms, or sends consumed
//! units it may not, is said once a minute, with how many were not said.
//! Pure: time is passed in. Bounded: past [`PerPeer::MAX_PEERS`] peers the
//! entries older than the interval are dropped, then the oldest half.

use std::collections::HashMap;
use std::hash::Hash;

/// Per-peer log throttle.
#[derive(Debug)]
pub struct PerPeer<K> {
    interval_ms: u64,
    /// Per peer: when it was last said, and how many since were not.
    last: HashMap<K, (u64, u64)>,
}

impl<K: Hash + Eq + Clone> PerPeer<K> {
    /// The most peers remembered.
    pub const MAX_PEERS: usize = 4096;

    /// A throttle of one line per `interval_ms` per peer.
    pub fn new(interval_ms: u64) -> Self {
        PerPeer {
            interval_ms,
            last: HashMap::new(),
        }
    }

    /// Whether to log about `peer` at `now_ms`: `Some(hidden)`, how many
    /// events of that peer went unsaid since its last line, or `None`.
    pub fn allow(&mut self, peer: &K, now_ms: u64) -> Option<u64> {
        if let Some((at, hidden)) = self.last.get_mut(peer) {
            if now_ms.saturating_sub(*at) < self.interval_ms {
                *hidden += 1;
                return None;
            }
            let said = *hidden;
            *at = now_ms;
            *hidden = 0;
            return Some(said);
        }
        if self.last.len() >= Self::MAX_PEERS {
            self.prune(now_ms);
        }
        self.last.insert(peer.clone(), (now_ms, 0));
        Some(0)
    }

    fn prune(&mut self, now_ms: u64) {
        let interval = self.interval_ms;
        self.last
            .retain(|_, (at, _)| now_ms.saturating_sub(*at) < interval);
        if self.last.len() >= Self::MAX_PEERS {
            let mut times: Vec<u64> = self.last.values().map(|v| v.0).collect();
            times.sort_unstable();
            let cut = times[times.len() / 2];
            self.last.retain(|_, (at, _)| *at > cut);
        }
    }

    /// Peers remembered.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// Whether no peer is remembered.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_peer_is_said_once_per_interval_with_what_went_unsaid() {
        let mut t = PerPeer::new(60_000);
        assert_eq!(t.allow(&"a", 0), Some(0));
        assert_eq!(t.allow(&"b", 10), Some(0), "another peer is said at once");
        assert_eq!(t.allow(&"a", 59_999), None);
        assert_eq!(t.allow(&"a", 30_000), None);
        assert_eq!(t.allow(&"a", 60_000), Some(2));
        assert_eq!(t.allow(&"a", 60_001), None);
    }

    #[test]
    fn a_flood_of_peers_stays_bounded() {
        let mut t = PerPeer::new(60_000);
        for i in 0..(3 * PerPeer::<u32>::MAX_PEERS as u32) {
            t.allow(&i, u64::from(i));
            assert!(t.len() <= PerPeer::<u32>::MAX_PEERS);
        }
    }
}
