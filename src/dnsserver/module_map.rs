//! A persistent map from module to entry: a new version with a few
//! modules changed copies only the paths to them, and shares everything
//! else with the old version.
//!
//! Two levels of [`FAN`] slots, picked by a hash of the module, over
//! sorted leaves: a change copies the root's slots, one middle node's
//! slots and the changed module's leaf (about 24 modules at 100k modules),
//! never the whole map. 64 × 64 leaves keep a small map cheap to build and
//! walk (a full reload of a one-module table touches 4,096 slots). Every version is immutable once built, so readers
//! on other threads hold one without locks (the route server's executors
//! keep an `Arc` of the table). Unchanged entries, leaves and middle nodes
//! are the very same allocations in both versions ([`Arc::ptr_eq`]).
//!
//! Pure: no I/O, no clocks.

use std::sync::Arc;

use lbagent_model::ModuleId;

/// Slots per level: 64 × 64 leaves.
pub const FAN: usize = 64;

/// One leaf: its modules and their values, sorted by module.
type Leaf<V> = Vec<(ModuleId, Arc<V>)>;

/// A middle node: [`FAN`] leaves.
type Mid<V> = Vec<Arc<Leaf<V>>>;

/// The map. Cloning is O([`FAN`]) pointer copies at most (the root is
/// shared until changed).
#[derive(Debug)]
pub struct ModuleMap<V> {
    len: usize,
    root: Arc<Vec<Arc<Mid<V>>>>,
}

impl<V> Clone for ModuleMap<V> {
    fn clone(&self) -> Self {
        ModuleMap {
            len: self.len,
            root: self.root.clone(),
        }
    }
}

impl<V> Default for ModuleMap<V> {
    fn default() -> Self {
        ModuleMap::new()
    }
}

/// The (root slot, middle slot) of `module`: the top 12 bits of a
/// multiplicative hash of (modid, cmdid).
fn slots(module: ModuleId) -> (usize, usize) {
    let key = (u64::from(module.modid) << 32) | u64::from(module.cmdid);
    let h = (key ^ (key >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 58) as usize, ((h >> 52) & 0x3f) as usize)
}

impl<V> ModuleMap<V> {
    /// An empty map: every slot shares one empty middle node and one empty
    /// leaf.
    pub fn new() -> Self {
        let leaf: Arc<Leaf<V>> = Arc::new(Vec::new());
        let mid: Arc<Mid<V>> = Arc::new(vec![leaf; FAN]);
        ModuleMap {
            len: 0,
            root: Arc::new(vec![mid; FAN]),
        }
    }

    /// How many modules it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `module`'s value.
    pub fn get(&self, module: ModuleId) -> Option<&Arc<V>> {
        let (i, j) = slots(module);
        let leaf = &self.root[i][j];
        leaf.binary_search_by_key(&module, |e| e.0)
            .ok()
            .map(|k| &leaf[k].1)
    }

    /// Every value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &Arc<V>> {
        self.iter().map(|(_, v)| v)
    }

    /// Every (module, value), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (ModuleId, &Arc<V>)> {
        self.root
            .iter()
            .flat_map(|mid| mid.iter())
            .flat_map(|leaf| leaf.iter())
            .map(|(m, v)| (*m, v))
    }

    /// Sets `module` to `value`; returns the value it replaced. Copies the
    /// nodes on the path that this version shares with another.
    pub fn insert(&mut self, module: ModuleId, value: Arc<V>) -> Option<Arc<V>> {
        let leaf = self.leaf_mut(module);
        match leaf.binary_search_by_key(&module, |e| e.0) {
            Ok(k) => Some(std::mem::replace(&mut leaf[k].1, value)),
            Err(k) => {
                leaf.insert(k, (module, value));
                self.len += 1;
                None
            }
        }
    }

    /// Removes `module`; returns its value. Copies nothing when the module
    /// is absent.
    pub fn remove(&mut self, module: ModuleId) -> Option<Arc<V>> {
        self.get(module)?;
        let leaf = self.leaf_mut(module);
        let k = leaf.binary_search_by_key(&module, |e| e.0).ok()?;
        let (_, value) = leaf.remove(k);
        self.len -= 1;
        Some(value)
    }

    /// The leaf of `module`, copied first where shared.
    fn leaf_mut(&mut self, module: ModuleId) -> &mut Leaf<V> {
        let (i, j) = slots(module);
        let root = Arc::make_mut(&mut self.root);
        let mid = Arc::make_mut(&mut root[i]);
        Arc::make_mut(&mut mid[j])
    }

    /// Whether this version and `other` share `module`'s leaf (the same
    /// allocation): for tests of what a change copies.
    pub fn shares_leaf_of(&self, other: &ModuleMap<V>, module: ModuleId) -> bool {
        let (i, j) = slots(module);
        Arc::ptr_eq(&self.root[i][j], &other.root[i][j])
    }
}

impl<V> FromIterator<(ModuleId, Arc<V>)> for ModuleMap<V> {
    /// Builds a map in one pass (a module given twice: the last wins).
    fn from_iter<I: IntoIterator<Item = (ModuleId, Arc<V>)>>(iter: I) -> Self {
        let mut leaves: Vec<Vec<Leaf<V>>> = (0..FAN)
            .map(|_| (0..FAN).map(|_| Vec::new()).collect())
            .collect();
        for (module, value) in iter {
            let (i, j) = slots(module);
            leaves[i][j].push((module, value));
        }
        let mut len = 0;
        let empty: Arc<Leaf<V>> = Arc::new(Vec::new());
        let root = leaves
            .into_iter()
            .map(|mid| {
                let mid: Mid<V> = mid
                    .into_iter()
                    .map(|mut leaf| {
                        if leaf.is_empty() {
                            return empty.clone();
                        }
                        // Stable: of two entries for one module, the last given wins.
                        leaf.sort_by_key(|e| e.0);
                        leaf.reverse();
                        leaf.dedup_by_key(|e| e.0);
                        leaf.reverse();
                        len += leaf.len();
                        Arc::new(leaf)
                    })
                    .collect();
                Arc::new(mid)
            })
            .collect();
        ModuleMap {
            len,
            root: Arc::new(root),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn m(i: u32) -> ModuleId {
        ModuleId::new(i, i % 7)
    }

    #[test]
    fn it_behaves_as_a_map() {
        let mut map = ModuleMap::new();
        let mut model = BTreeMap::new();
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..20_000 {
            let k = m(rng.u32(0..3_000));
            if rng.bool() {
                let v = rng.u32(..);
                assert_eq!(
                    map.insert(k, Arc::new(v)).map(|v| *v),
                    model.insert(k, v),
                    "{k}"
                );
            } else {
                assert_eq!(map.remove(k).map(|v| *v), model.remove(&k), "{k}");
            }
            assert_eq!(map.len(), model.len());
        }
        for (k, v) in &model {
            assert_eq!(map.get(*k).map(|v| **v), Some(*v));
        }
        let mut all: Vec<(ModuleId, u32)> = map.iter().map(|(k, v)| (k, **v)).collect();
        all.sort();
        assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        let built: ModuleMap<u32> = map.iter().map(|(k, v)| (k, v.clone())).collect();
        assert_eq!(built.len(), map.len());
        assert!(map
            .iter()
            .all(|(k, v)| Arc::ptr_eq(built.get(k).unwrap(), v)));
    }

    #[test]
    fn a_change_copies_only_the_changed_modules_leaf() {
        let old: ModuleMap<u32> = (0..100_000).map(|i| (m(i), Arc::new(i))).collect();
        assert_eq!(old.len(), 100_000);
        let mut new = old.clone();
        new.insert(m(5), Arc::new(0));
        new.remove(m(6));
        assert!(new.remove(m(200_000)).is_none());
        assert_eq!(new.len(), 99_999);
        assert_eq!(
            *old.get(m(5)).unwrap().as_ref(),
            5,
            "the old version is untouched"
        );
        assert!(old.get(m(6)).is_some());
        let shared_leaves = (0..100_000)
            .filter(|&i| new.shares_leaf_of(&old, m(i)))
            .count();
        let unshared = 100_000 - shared_leaves;
        // 100,000 modules over 4,096 leaves: about 24 a leaf.
        assert!(
            unshared <= 2 * 60,
            "{unshared} modules live in copied leaves: only the two changed leaves should be"
        );
        for i in (0..100_000).filter(|&i| i != 5 && i != 6) {
            assert!(
                Arc::ptr_eq(new.get(m(i)).unwrap(), old.get(m(i)).unwrap()),
                "module {i} is shared"
            );
        }
    }

    #[test]
    fn the_last_of_two_values_given_for_one_module_wins() {
        let map: ModuleMap<u32> = [(m(1), Arc::new(1)), (m(1), Arc::new(2))]
            .into_iter()
            .collect();
        assert_eq!(map.len(), 1);
        assert_eq!(**map.get(m(1)).unwrap(), 2);
    }
}
