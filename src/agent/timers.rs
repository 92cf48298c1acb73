//! Deadlines for a shard's background work: a min-heap of `(deadline, key)`
//! with lazy deletion. Pure: time is an argument, nothing here sleeps.
//!
//! Scheduling costs O(log n); taking what is due costs O(log n) per entry
//! taken, and looking at the next deadline O(1). Nothing ever walks the
//! whole set, so an idle shard's tick costs the same with one module or a
//! million: the cost is the work that is due.
//!
//! There is no cancel. The owner keeps, beside each thing it schedules,
//! the deadline it currently wants (or none); an entry taken from the heap
//! whose deadline no longer matches is stale and skipped. Moving a deadline
//! later costs nothing until the old one comes due (the owner then
//! schedules the new one); moving it earlier pushes a second entry and the
//! later one turns stale. So the heap holds at most one live entry per
//! thing plus the stale ones the owner created by moving deadlines earlier.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use lbagent_lb::Millis;

/// A set of deadlines, each naming a key.
#[derive(Debug)]
pub struct Timers<K> {
    heap: BinaryHeap<Reverse<(Millis, K)>>,
}

impl<K: Ord + Copy> Default for Timers<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Copy> Timers<K> {
    /// No deadlines.
    pub fn new() -> Self {
        Timers {
            heap: BinaryHeap::new(),
        }
    }

    /// Adds a deadline for `key` at `at`.
    pub fn schedule(&mut self, at: Millis, key: K) {
        self.heap.push(Reverse((at, key)));
    }

    /// The earliest deadline held (live or stale), if any.
    pub fn next_deadline(&self) -> Option<Millis> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Takes the earliest entry due at `now` (deadline `<= now`), if any.
    pub fn pop_due(&mut self, now: Millis) -> Option<(Millis, K)> {
        match self.heap.peek() {
            Some(Reverse((at, _))) if *at <= now => self.heap.pop().map(|Reverse(e)| e),
            _ => None,
        }
    }

    /// Entries held, stale ones included.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Keeps only the entries `live` accepts, when stale ones make up more
    /// than half the heap (O(n), so that amortised over the pushes that
    /// made them it stays O(1) each). Returns whether it rebuilt.
    pub fn compact_if_stale(
        &mut self,
        live: usize,
        mut keep: impl FnMut(Millis, K) -> bool,
    ) -> bool {
        if self.heap.len() <= 64 || self.heap.len() <= 2 * live {
            return false;
        }
        let entries = std::mem::take(&mut self.heap).into_vec();
        self.heap = entries
            .into_iter()
            .filter(|Reverse((at, k))| keep(*at, *k))
            .collect();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(t: &mut Timers<u32>, now: Millis) -> Vec<(Millis, u32)> {
        std::iter::from_fn(|| t.pop_due(now)).collect()
    }

    #[test]
    fn nothing_is_due_before_its_deadline() {
        let mut t = Timers::new();
        t.schedule(10, 1);
        assert_eq!(t.next_deadline(), Some(10));
        assert_eq!(t.pop_due(9), None);
        assert_eq!(t.pop_due(10), Some((10, 1)));
        assert!(t.is_empty());
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn due_entries_come_out_earliest_first() {
        let mut t = Timers::new();
        for (at, k) in [(30, 3), (10, 1), (20, 2), (40, 4)] {
            t.schedule(at, k);
        }
        assert_eq!(drain(&mut t, 35), vec![(10, 1), (20, 2), (30, 3)]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.next_deadline(), Some(40));
    }

    #[test]
    fn equal_deadlines_all_come_out() {
        let mut t = Timers::new();
        for k in 0..5 {
            t.schedule(7, k);
        }
        assert_eq!(drain(&mut t, 7).len(), 5);
    }

    #[test]
    fn taking_what_is_due_costs_only_what_is_due() {
        // A million far deadlines, three near ones: only three come out and
        // the rest stay untouched.
        let mut t = Timers::new();
        for k in 0..1_000_000u32 {
            t.schedule(1_000_000 + Millis::from(k), k);
        }
        for k in 0..3 {
            t.schedule(5, 2_000_000 + k);
        }
        assert_eq!(drain(&mut t, 10).len(), 3);
        assert_eq!(t.len(), 1_000_000);
    }

    #[test]
    fn compaction_drops_only_stale_entries_and_only_when_worth_it() {
        let mut t = Timers::new();
        for k in 0..100u32 {
            t.schedule(Millis::from(k), k);
        }
        // Half or more live: no rebuild.
        assert!(!t.compact_if_stale(50, |_, _| true));
        // Mostly stale: rebuild keeping the even keys.
        assert!(t.compact_if_stale(10, |_, k| k % 2 == 0));
        assert_eq!(t.len(), 50);
        assert!(drain(&mut t, 1000).iter().all(|(_, k)| k % 2 == 0));
    }
}
