//! Downstream admission levels (DAGOR collaborative admission, seed 004):
//! the level each node last piggybacked on a response, as reports carry it,
//! kept until `expires` and forgotten when not refreshed in time.
//!
//! A side table held by a module only while some node has a live level, so
//! a module (and the getHost path) without levels pays one pointer test and
//! no memory per node. Entries are keyed by the node's address key, which
//! survives route updates; a node that left the route keeps its entry until
//! it expires (it can no longer be chosen, so it changes no answer).

use super::node::Millis;
use lbagent_admission::AdmissionLevel;

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

/// The live levels of one module's nodes, sorted by key (never empty
/// while held).
#[derive(Clone, Debug, PartialEq, Default)]
pub(super) struct Levels {
    entries: Vec<Entry>,
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

    /// Drops node `key`'s level.
    pub(super) fn clear(&mut self, key: u64) {
        self.entries.retain(|e| e.key != key);
        self.next_expiry = self.earliest();
    }

    /// Drops the levels not refreshed by `now`; true when some remain.
    pub(super) fn expire(&mut self, now: Millis) -> bool {
        if now >= self.next_expiry {
            self.entries.retain(|e| e.expires > now);
            self.next_expiry = self.earliest();
        }
        !self.entries.is_empty()
    }

    /// How many nodes have a level.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
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
            .min()
            .unwrap_or(Millis::MAX)
    }
}
