//! Downstream admission levels (DAGOR collaborative admission, seed 004):
//! the level each node last piggybacked on a response, as reports carry it,
//! kept until `expires` and forgotten when not refreshed in time.
//!
//! A side table held by a module only while some node has a live level, so
//! a module (and the getHost path) without levels pays one pointer test and
//! no memory per node. Entries are keyed by the node's address key, which
//! survives route updates; a node that left the route keeps its entry until
//! it expires (it can no longer be chosen, so it changes no answer).
//!
//! A level comes either from a caller the agent trusts to speak for every
//! caller of the module on the host (shared: DAGOR's collaborative
//! admission, [`Levels::set`]) or from anyone else (private to that caller:
//! the paper's per-upstream model, [`Levels::set_private`]), so that one
//! process cannot reject another's getHosts. A node admits a request when
//! its shared level and the caller's own level for it both do. At most
//! [`MAX_PRIVATE`] private levels are held per module: past that, a new
//! caller's level is ignored (counted by the caller) until some expire.

use super::node::Millis;
use super::units::ClientKey;
use lbagent_admission::{admits, AdmissionLevel};

/// The most private levels ([`Levels::set_private`]) one module holds.
pub const MAX_PRIVATE: usize = 4096;

/// The default `admission.level_timeout_ms`: a downstream level not
/// refreshed by a report within three 1 s windows is forgotten.
pub const LEVEL_TIMEOUT_MS: u64 = 3_000;

/// One node's live level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    key: u64,
    level: AdmissionLevel,
    expires: Millis,
}

/// One caller's own level for one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Private {
    client: ClientKey,
    key: u64,
    level: AdmissionLevel,
    expires: Millis,
}

/// The live levels of one module's nodes, sorted by key, and the callers'
/// own, sorted by (caller, key) (never both empty while held).
#[derive(Clone, Debug, PartialEq, Default)]
pub(super) struct Levels {
    entries: Vec<Entry>,
    private: Vec<Private>,
    /// The earliest `expires` of the entries.
    next_expiry: Millis,
}

impl Levels {
    /// Sets node `key`'s level until `expires` (a later report refreshes it).
    pub(super) fn set(&mut self, key: u64, level: AdmissionLevel, expires: Millis) {
        match self.entries.binary_search_by_key(&key, |e| e.key) {
            Ok(i) => {
                self.entries[i].level = level;
                self.entries[i].expires = expires;
            }
            Err(i) => self.entries.insert(
                i,
                Entry {
                    key,
                    level,
                    expires,
                },
            ),
        }
        self.next_expiry = self.earliest();
    }

    /// Sets `client`'s own level for node `key` until `expires`; false
    /// (nothing set) when [`MAX_PRIVATE`] levels are held and this is a
    /// new one.
    pub(super) fn set_private(
        &mut self,
        client: ClientKey,
        key: u64,
        level: AdmissionLevel,
        expires: Millis,
    ) -> bool {
        match self
            .private
            .binary_search_by_key(&(client, key), |e| (e.client, e.key))
        {
            Ok(i) => {
                self.private[i].level = level;
                self.private[i].expires = expires;
            }
            Err(_) if self.private.len() >= MAX_PRIVATE => return false,
            Err(i) => self.private.insert(
                i,
                Private {
                    client,
                    key,
                    level,
                    expires,
                },
            ),
        }
        self.next_expiry = self.earliest();
        true
    }

    /// Drops `client`'s own level for node `key`.
    pub(super) fn clear_private(&mut self, client: ClientKey, key: u64) {
        self.private.retain(|e| (e.client, e.key) != (client, key));
        self.next_expiry = self.earliest();
    }

    /// Whether node `key` admits a request of clamped priorities `(b, u)`
    /// from `client`: its shared level and the client's own both do (no
    /// level admits everything).
    pub(super) fn admits(&self, key: u64, client: ClientKey, b: u8, u: u8) -> bool {
        self.get(key).is_none_or(|l| admits(l, b, u))
            && (self.private.is_empty()
                || self.private_of(client, key).is_none_or(|l| admits(l, b, u)))
    }

    /// `client`'s own level for node `key`, if it has one.
    pub(super) fn private_of(&self, client: ClientKey, key: u64) -> Option<AdmissionLevel> {
        self.private
            .binary_search_by_key(&(client, key), |e| (e.client, e.key))
            .ok()
            .map(|i| self.private[i].level)
    }

    /// Drops node `key`'s level.
    pub(super) fn clear(&mut self, key: u64) {
        self.entries.retain(|e| e.key != key);
        self.next_expiry = self.earliest();
    }

    /// Drops the levels not refreshed by `now`; true when some remain.
    pub(super) fn expire(&mut self, now: Millis) -> bool {
        if now >= self.next_expiry {
            self.entries.retain(|e| e.expires > now);
            self.private.retain(|e| e.expires > now);
            self.next_expiry = self.earliest();
        }
        !self.entries.is_empty() || !self.private.is_empty()
    }

    /// How many levels are held: the nodes' shared ones and the callers'
    /// own.
    pub(super) fn len(&self) -> usize {
        self.entries.len() + self.private.len()
    }

    /// How many of them are callers' own.
    pub(super) fn private_len(&self) -> usize {
        self.private.len()
    }

    /// Node `key`'s level, if it has one.
    pub(super) fn get(&self, key: u64) -> Option<AdmissionLevel> {
        self.entries
            .binary_search_by_key(&key, |e| e.key)
            .ok()
            .map(|i| self.entries[i].level)
    }

    fn earliest(&self) -> Millis {
        self.entries
            .iter()
            .map(|e| e.expires)
            .chain(self.private.iter().map(|e| e.expires))
            .min()
            .unwrap_or(Millis::MAX)
    }
}
