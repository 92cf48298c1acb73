//! The shard's module table: each module's entry by its id, found by one
//! hash lookup, or by none for the module looked up last.
//!
//! A shard's requests come in runs of one module (a getHost and its
//! report; a sweep of the shared-memory slots whose clients call one
//! service; a UDP batch), and the hash and probe of a lookup (foldhash
//! and a hashbrown group probe, about 27 instructions) are a tenth of a
//! request over shared memory. So the table remembers the bucket of the
//! module looked up last, and tries that bucket first
//! ([`hashbrown::HashTable::get_bucket`], which the standard library's
//! map does not offer): a bucket holds one entry, so its key is the whole
//! check.
//!
//! The memory is forgotten whenever the table changes shape: an entry
//! inserted (the table may grow and move every entry) or removed. A route
//! update, a statistics send or a tick changes entries, not buckets, and
//! an entry is read afresh at each lookup. The memory is also only a
//! hint: the bucket is taken only if it still holds that module, so even
//! a memory not forgotten could never give another module's entry.

use std::hash::BuildHasher;

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use lbagent_model::ModuleId;

use super::ModuleEntry;

/// No bucket remembered (no table has this many).
const NONE: usize = usize::MAX;

/// Each module's entry, by its id (foldhash, seeded per process).
pub(super) struct Modules {
    table: HashTable<(ModuleId, Box<ModuleEntry>)>,
    hasher: foldhash::fast::RandomState,
    /// The bucket of the module looked up last ([`NONE`]: none): tried
    /// before hashing, and taken if it holds the module asked for.
    last: usize,
}

impl Default for Modules {
    fn default() -> Self {
        Modules {
            table: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            last: NONE,
        }
    }
}

impl Modules {
    fn hash(&self, module: ModuleId) -> u64 {
        self.hasher.hash_one(module)
    }

    /// The bucket remembered, if it holds `module` (a bucket holds one
    /// entry: its key is the whole check): the module looked up last, no
    /// hash, no probe; its entry is then [`Modules::at_mut`]'s.
    #[inline(always)]
    pub fn remembered_bucket(&self, module: ModuleId) -> Option<usize> {
        let i = self.last;
        self.table
            .get_bucket(i)
            .is_some_and(|e| e.0 == module)
            .then_some(i)
    }

    /// The bucket that holds `module`, if the table does: the one
    /// remembered when it still holds `module`, else found by hash.
    #[inline]
    fn lookup(&self, module: ModuleId) -> Option<usize> {
        self.remembered_bucket(module).or_else(|| {
            self.table
                .find_bucket_index(self.hash(module), |e| e.0 == module)
        })
    }

    /// The entry in bucket `i`, as [`Modules::remembered_bucket`] or
    /// [`Modules::bucket_or_make`] gave it (the table unchanged since).
    ///
    /// # Panics
    /// When bucket `i` holds no entry (a bug: the table changed since).
    #[inline(always)]
    pub fn at_mut(&mut self, i: usize) -> &mut ModuleEntry {
        &mut self
            .table
            .get_bucket_mut(i)
            .expect("a bucket looked up since the table last changed")
            .1
    }

    /// The bucket of `module`'s entry (read it with [`Modules::at_mut`]),
    /// made by `make` when the table does not hold it (its error returned
    /// as it is, nothing made); found or made, it is remembered. One probe
    /// either way, as a map's entry.
    ///
    /// Inlined whole: a call's frame would cost more than the remembered
    /// bucket saves (callgrind: 41 instructions a getHost out of line).
    ///
    /// # Errors
    /// `make`'s.
    #[inline(always)]
    pub fn bucket_or_make<E>(
        &mut self,
        module: ModuleId,
        make: impl FnOnce() -> Result<Box<ModuleEntry>, E>,
    ) -> Result<usize, E> {
        if let Some(i) = self.remembered_bucket(module) {
            return Ok(i);
        }
        let hasher = &self.hasher;
        let e = match self.table.entry(
            hasher.hash_one(module),
            |e| e.0 == module,
            |e| hasher.hash_one(e.0),
        ) {
            Entry::Occupied(held) => held,
            Entry::Vacant(slot) => slot.insert((module, make()?)),
        };
        self.last = e.bucket_index();
        Ok(self.last)
    }

    /// `module`'s entry (not remembered: a reader, not a request).
    #[inline]
    pub fn get(&self, module: &ModuleId) -> Option<&ModuleEntry> {
        let i = self.lookup(*module)?;
        self.table.get_bucket(i).map(|e| &*e.1)
    }

    /// `module`'s entry, to change (remembered).
    #[inline]
    pub fn get_mut(&mut self, module: &ModuleId) -> Option<&mut ModuleEntry> {
        let module = *module;
        if let Some(i) = self.remembered_bucket(module) {
            return self.table.get_bucket_mut(i).map(|e| &mut *e.1);
        }
        let hash = self.hash(module);
        let e = self.table.find_entry(hash, |e| e.0 == module).ok()?;
        self.last = e.bucket_index();
        Some(&mut e.into_mut().1)
    }

    /// Whether the table holds `module`.
    pub fn contains_key(&self, module: &ModuleId) -> bool {
        self.lookup(*module).is_some()
    }

    /// Puts `entry` in as `module`'s (replacing the one it had) and
    /// returns it.
    pub fn insert(&mut self, module: ModuleId, entry: Box<ModuleEntry>) -> &mut ModuleEntry {
        // The table may grow: every bucket may move.
        self.last = NONE;
        let hasher = &self.hasher;
        let e = self
            .table
            .entry(
                hasher.hash_one(module),
                |e| e.0 == module,
                |e| hasher.hash_one(e.0),
            )
            .insert((module, entry));
        self.last = e.bucket_index();
        &mut e.into_mut().1
    }

    /// Takes `module`'s entry out.
    pub fn remove(&mut self, module: &ModuleId) -> Option<Box<ModuleEntry>> {
        self.last = NONE;
        let hash = self.hash(*module);
        let found = self.table.find_entry(hash, |e| e.0 == *module).ok()?;
        Some(found.remove().0 .1)
    }

    /// How many modules the table holds.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether the table holds no module.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Every module held, in no order.
    pub fn keys(&self) -> impl Iterator<Item = &ModuleId> {
        self.table.iter().map(|e| &e.0)
    }

    /// Every entry, to change, in no order.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut ModuleEntry> {
        self.table.iter_mut().map(|e| &mut *e.1)
    }
}

impl std::ops::Index<&ModuleId> for Modules {
    type Output = ModuleEntry;

    fn index(&self, module: &ModuleId) -> &ModuleEntry {
        self.get(module).expect("the module is in the table")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_lb::{LbParams, ModuleLb};

    fn entry(version: u64) -> Box<ModuleEntry> {
        let mut e = super::super::modules::new_entry(0, &LbParams::default());
        e.lb = ModuleLb::new(&[], version, 0, &LbParams::default());
        Box::new(e)
    }

    /// `m`'s route version, found as a request finds it (remembered).
    fn version(t: &mut Modules, m: ModuleId) -> Option<u64> {
        t.get_mut(&m).map(|e| e.lb.version())
    }

    const A: ModuleId = ModuleId::new(1, 1);

    #[test]
    fn the_module_looked_up_last_is_found_again_after_the_table_grew() {
        let mut t = Modules::default();
        t.insert(A, entry(1));
        assert_eq!(version(&mut t, A), Some(1));
        // Thousands of inserts: the table grows and every bucket moves.
        for k in 0..5000 {
            t.insert(ModuleId::new(2, k), entry(2));
            assert_eq!(version(&mut t, A), Some(1), "after {k}");
        }
        t.get_mut(&A).unwrap().lb = ModuleLb::new(&[], 3, 0, &LbParams::default());
        assert_eq!(version(&mut t, A), Some(3));
        assert_eq!(t.len(), 5001);
    }

    #[test]
    fn a_removed_module_is_not_found_through_the_bucket_it_had() {
        let mut t = Modules::default();
        for k in 0..100 {
            t.insert(ModuleId::new(2, k), entry(2));
        }
        t.insert(A, entry(1));
        assert_eq!(version(&mut t, A), Some(1));
        let had = t.lookup(A).unwrap();
        assert!(t.remove(&A).is_some());
        assert_eq!(version(&mut t, A), None);
        // Another module in A's old bucket: A is still not there.
        let mut k = 1000;
        loop {
            assert!(k < 1_000_000, "no module landed in the old bucket");
            let m = ModuleId::new(3, k);
            t.insert(m, entry(4));
            if t.lookup(m) == Some(had) {
                break;
            }
            assert!(t.remove(&m).is_some());
            k += 1;
        }
        t.last = had;
        assert_eq!(version(&mut t, A), None, "the bucket holds another module");
        t.last = had;
        assert!(t.get(&A).is_none() && !t.contains_key(&A));
        assert!(t.get_mut(&A).is_none());
        t.insert(A, entry(5));
        assert_eq!(version(&mut t, A), Some(5));
    }
}
