//! The row buffer between the agents' connections and the writer threads,
//! sans-IO: a bounded, sharded queue that never refuses a row.
//!
//! - **Sharded by module.** A row goes to shard [`shard_of`]`(module)`;
//!   writer `i` drains shard `i` only, so the rows of one key are written in
//!   the order they arrived.
//! - **Coalescing.** A row whose key (module, node, caller) already waits in
//!   its shard replaces the waiting one (the store would replace it
//!   anyway): the older is removed, counted as coalesced, and the newer
//!   queues at the back. Rows a writer holds are not coalesced.
//! - **Bounded, dropping the oldest.** Rows waiting plus rows the writers
//!   hold never exceed the bound. A push past it drops the oldest waiting
//!   rows over all shards (by arrival), counted as dropped; it never waits
//!   and never refuses. Rows a writer holds are never dropped (they may be
//!   inside a transaction); they are at most `shards * batch` rows.
//! - **Batches.** A writer takes up to `max` of its shard's oldest rows
//!   ([`Buffer::take_batch`]) and settles them once: written, rejected by
//!   the store, or failed, in which case they return to the front of the
//!   shard, still the oldest, to be retried or dropped.
//!
//! No locks, clocks or threads here: the shell holds the buffer in one
//! mutex, taken for the length of a push or a take.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, VecDeque};

use lbagent_model::{ModuleId, NodeAddr};
use lbagent_store::CallStatus;

/// What identifies a row in the store: module, node, caller.
type Key = (ModuleId, NodeAddr, u32);

fn key(row: &CallStatus) -> Key {
    (row.module, row.node, row.caller)
}

/// The shard (and writer) of `module` among `shards` (at least 1): a
/// multiplicative hash of `modid << 32 | cmdid`, so that neighbouring ids
/// spread over the writers.
pub fn shard_of(module: ModuleId, shards: usize) -> usize {
    let id = (u64::from(module.modid) << 32) | u64::from(module.cmdid);
    let hash = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    (hash % shards.max(1) as u64) as usize
}

/// Counters of everything that went through a [`Buffer`], since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufferCounts {
    /// Rows pushed.
    pub accepted: u64,
    /// Rows replaced by a newer row of the same key before being written.
    pub coalesced: u64,
    /// Rows dropped, oldest first, to keep the bound.
    pub dropped: u64,
    /// Rows the store wrote.
    pub written: u64,
    /// Rows the store refused as invalid (not retried).
    pub rejected: u64,
    /// Transactions that wrote a batch.
    pub transactions: u64,
}

/// Rows a writer took from its shard, to settle with [`Buffer::written`],
/// [`Buffer::failed`] or [`Buffer::rejected`]. Reusable: settling empties it.
#[derive(Debug, Default)]
pub struct Batch {
    shard: usize,
    rows: Vec<CallStatus>,
    seqs: Vec<u64>,
}

impl Batch {
    /// The rows, oldest first.
    pub fn rows(&self) -> &[CallStatus] {
        &self.rows
    }

    /// Whether the batch holds no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn clear(&mut self) -> usize {
        let n = self.rows.len();
        self.rows.clear();
        self.seqs.clear();
        n
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Arrival order over every shard.
    seq: u64,
    row: CallStatus,
    /// False once a newer row of the same key replaced it.
    live: bool,
}

/// One writer's queue. Invariant: `slots` is sorted by `seq` and its front,
/// when there is one, is live.
#[derive(Debug, Default)]
struct Shard {
    slots: VecDeque<Slot>,
    /// Every live waiting row's key, to its `seq`.
    index: HashMap<Key, u64>,
    live: usize,
    in_flight: usize,
}

impl Shard {
    fn pop_dead_front(&mut self) {
        while self.slots.front().is_some_and(|s| !s.live) {
            self.slots.pop_front();
        }
    }

    /// Marks the waiting row `seq` replaced; compacts when replaced rows
    /// outnumber live ones, so dead slots never exceed the live ones by much.
    fn kill(&mut self, seq: u64) {
        if let Ok(i) = self.slots.binary_search_by_key(&seq, |s| s.seq) {
            self.slots[i].live = false;
            self.live -= 1;
        }
        self.pop_dead_front();
        if self.slots.len() > 2 * self.live + 64 {
            self.slots.retain(|s| s.live);
        }
    }

    /// Removes and returns the oldest waiting row.
    fn pop_oldest(&mut self) -> Option<Slot> {
        let slot = self.slots.pop_front()?;
        self.index.remove(&key(&slot.row));
        self.live -= 1;
        self.pop_dead_front();
        Some(slot)
    }
}

/// The bounded, sharded, drop-oldest row buffer.
#[derive(Debug)]
pub struct Buffer {
    shards: Vec<Shard>,
    bound: usize,
    next_seq: u64,
    live: usize,
    in_flight: usize,
    counts: BufferCounts,
    touched: Vec<usize>,
    is_touched: Vec<bool>,
}

impl Buffer {
    /// A buffer of `shards` shards holding at most `bound` rows (each at
    /// least 1).
    pub fn new(shards: usize, bound: usize) -> Self {
        let shards = shards.max(1);
        Buffer {
            shards: (0..shards).map(|_| Shard::default()).collect(),
            bound: bound.max(1),
            next_seq: 0,
            live: 0,
            in_flight: 0,
            counts: BufferCounts::default(),
            touched: Vec::new(),
            is_touched: vec![false; shards],
        }
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The most rows held at once.
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// Rows held: waiting plus taken by writers.
    pub fn len(&self) -> usize {
        self.live + self.in_flight
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows taken by writers and not settled yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Rows waiting in `shard` (0 for a shard that does not exist).
    pub fn waiting(&self, shard: usize) -> usize {
        self.shards.get(shard).map_or(0, |s| s.live)
    }

    /// The counters so far.
    pub fn counts(&self) -> BufferCounts {
        self.counts
    }

    /// Queues `rows`, coalescing with waiting rows of the same key, then
    /// drops the oldest waiting rows while more than the bound are held.
    /// Returns the number of rows dropped.
    pub fn push(&mut self, rows: &[CallStatus]) -> u64 {
        let shards = self.shards.len();
        for row in rows {
            let i = shard_of(row.module, shards);
            let seq = self.next_seq;
            self.next_seq += 1;
            self.counts.accepted += 1;
            let shard = &mut self.shards[i];
            match shard.index.entry(key(row)) {
                MapEntry::Occupied(mut e) => {
                    let old = e.insert(seq);
                    shard.kill(old);
                    self.counts.coalesced += 1;
                    self.live -= 1;
                }
                MapEntry::Vacant(e) => {
                    e.insert(seq);
                }
            }
            shard.slots.push_back(Slot {
                seq,
                row: *row,
                live: true,
            });
            shard.live += 1;
            self.live += 1;
            if !self.is_touched[i] {
                self.is_touched[i] = true;
                self.touched.push(i);
            }
        }
        let mut dropped = 0;
        while self.len() > self.bound && self.drop_oldest() {
            dropped += 1;
        }
        self.counts.dropped += dropped;
        dropped
    }

    /// Calls `f` once for every shard that received rows since the last
    /// call (to wake its writer), and forgets them.
    pub fn drain_touched(&mut self, mut f: impl FnMut(usize)) {
        for i in self.touched.drain(..) {
            self.is_touched[i] = false;
            f(i);
        }
    }

    /// Drops the oldest waiting row over every shard; false when none waits.
    fn drop_oldest(&mut self) -> bool {
        let oldest = self
            .shards
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.slots.front().map(|f| (f.seq, i)))
            .min();
        let Some((_, i)) = oldest else {
            return false;
        };
        self.shards[i].pop_oldest();
        self.live -= 1;
        true
    }

    /// Moves up to `max` of `shard`'s oldest waiting rows into `batch`
    /// (emptied first); false when none waits. The rows count as held
    /// until the batch is settled.
    pub fn take_batch(&mut self, shard: usize, max: usize, batch: &mut Batch) -> bool {
        batch.clear();
        batch.shard = shard;
        let Some(s) = self.shards.get_mut(shard) else {
            return false;
        };
        while batch.rows.len() < max {
            let Some(slot) = s.pop_oldest() else {
                break;
            };
            batch.rows.push(slot.row);
            batch.seqs.push(slot.seq);
        }
        let n = batch.rows.len();
        s.in_flight += n;
        self.live -= n;
        self.in_flight += n;
        n > 0
    }

    /// The store wrote `batch` in one transaction.
    pub fn written(&mut self, batch: &mut Batch) {
        let n = self.settle(batch);
        self.counts.written += n as u64;
        self.counts.transactions += 1;
    }

    /// The store refused `batch` as invalid: its rows are not retried.
    pub fn rejected(&mut self, batch: &mut Batch) {
        let n = self.settle(batch);
        self.counts.rejected += n as u64;
    }

    /// Writing `batch` failed: its rows return to the front of their shard
    /// (still the oldest there), except those a newer row of the same key
    /// replaced meanwhile, which count as coalesced.
    pub fn failed(&mut self, batch: &mut Batch) {
        let Some(s) = self.shards.get_mut(batch.shard) else {
            batch.clear();
            return;
        };
        let n = batch.rows.len();
        for (row, &seq) in batch.rows.iter().zip(&batch.seqs).rev() {
            match s.index.get(&key(row)).copied() {
                Some(newer) if newer > seq => {
                    self.counts.coalesced += 1;
                    continue;
                }
                Some(older) => {
                    // An older row of the key came back first (two batches
                    // of one shard out at once): this one replaces it.
                    s.kill(older);
                    self.counts.coalesced += 1;
                    self.live -= 1;
                }
                None => {}
            }
            s.index.insert(key(row), seq);
            // At the front in the usual case; by arrival in any case.
            let at = s.slots.partition_point(|x| x.seq < seq);
            let slot = Slot {
                seq,
                row: *row,
                live: true,
            };
            s.slots.insert(at, slot);
            s.live += 1;
            self.live += 1;
        }
        s.in_flight = s.in_flight.saturating_sub(n);
        self.in_flight = self.in_flight.saturating_sub(n);
        batch.clear();
    }

    fn settle(&mut self, batch: &mut Batch) -> usize {
        let n = batch.clear();
        if let Some(s) = self.shards.get_mut(batch.shard) {
            s.in_flight = s.in_flight.saturating_sub(n);
        }
        self.in_flight = self.in_flight.saturating_sub(n);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn row(modid: u32, port: u16, ts: u64) -> CallStatus {
        CallStatus {
            module: ModuleId::new(modid, 1),
            node: NodeAddr {
                ip: 0x0a00_0001,
                port,
            },
            caller: 7,
            succ: 1,
            err: 0,
            ts,
            overload: false,
        }
    }

    /// Every row waiting or held, by taking everything out.
    fn drain_all(buf: &mut Buffer) -> Vec<CallStatus> {
        let mut out = Vec::new();
        let mut batch = Batch::default();
        for i in 0..buf.shards() {
            while buf.take_batch(i, 1000, &mut batch) {
                out.extend_from_slice(batch.rows());
                buf.written(&mut batch);
            }
        }
        out
    }

    #[test]
    fn rows_of_one_module_go_to_one_shard_and_modules_spread() {
        let mut seen = [0usize; 4];
        for modid in 0..400 {
            let s = shard_of(ModuleId::new(modid, 1), 4);
            assert_eq!(s, shard_of(ModuleId::new(modid, 1), 4));
            seen[s] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "uneven spread: {seen:?}");
        assert_eq!(shard_of(ModuleId::new(u32::MAX, u32::MAX), 1), 0);
        assert_eq!(shard_of(ModuleId::new(5, 5), 0), 0, "0 shards is read as 1");
    }

    #[test]
    fn a_batch_takes_the_oldest_rows_of_its_shard_up_to_the_limit() {
        let mut buf = Buffer::new(1, 100);
        let rows: Vec<_> = (0..10).map(|p| row(1, p + 1, 0)).collect();
        buf.push(&rows);
        let mut batch = Batch::default();
        assert!(buf.take_batch(0, 4, &mut batch));
        assert_eq!(batch.rows(), &rows[..4]);
        assert_eq!((buf.len(), buf.in_flight(), buf.waiting(0)), (10, 4, 6));
        buf.written(&mut batch);
        assert!(batch.is_empty());
        assert_eq!((buf.len(), buf.in_flight()), (6, 0));
        assert!(buf.take_batch(0, 100, &mut batch));
        assert_eq!(batch.rows(), &rows[4..]);
        buf.written(&mut batch);
        assert!(!buf.take_batch(0, 100, &mut batch));
        assert!(!buf.take_batch(9, 100, &mut batch), "no such shard");
        let c = buf.counts();
        assert_eq!((c.accepted, c.written, c.transactions), (10, 10, 2));
    }

    #[test]
    fn past_the_bound_the_oldest_rows_over_all_shards_are_dropped() {
        let mut buf = Buffer::new(3, 5);
        let rows: Vec<_> = (0..8).map(|m| row(m, 80, u64::from(m))).collect();
        assert_eq!(buf.push(&rows[..5]), 0);
        assert_eq!(buf.push(&rows[5..]), 3);
        assert_eq!(buf.len(), 5);
        assert_eq!(buf.counts().dropped, 3);
        let mut left = drain_all(&mut buf);
        left.sort_by_key(|r| r.ts);
        assert_eq!(left, &rows[3..], "the three oldest went");
    }

    #[test]
    fn rows_a_writer_holds_count_against_the_bound_but_are_never_dropped() {
        let mut buf = Buffer::new(1, 4);
        let rows: Vec<_> = (0..10).map(|p| row(1, p + 1, 0)).collect();
        buf.push(&rows[..4]);
        let mut batch = Batch::default();
        buf.take_batch(0, 3, &mut batch);
        assert_eq!(buf.push(&rows[4..6]), 2, "rows 3 and 4 dropped");
        assert_eq!(batch.rows(), &rows[..3], "the held rows are intact");
        assert_eq!(buf.len(), 4);
        // Everything held: a push drops its own new rows.
        let mut batch2 = Batch::default();
        buf.take_batch(0, 3, &mut batch2);
        assert_eq!(buf.push(&rows[6..8]), 2);
        assert_eq!(buf.len(), 4);
        // Returned out of order, they still queue by arrival.
        buf.failed(&mut batch2);
        buf.failed(&mut batch);
        assert_eq!(buf.len(), 4);
        let left = drain_all(&mut buf);
        assert_eq!(left, [rows[0], rows[1], rows[2], rows[5]]);
    }

    #[test]
    fn a_failed_batch_returns_to_the_front_and_is_retried_first() {
        let mut buf = Buffer::new(1, 100);
        let rows: Vec<_> = (0..6).map(|p| row(1, p + 1, 0)).collect();
        buf.push(&rows[..4]);
        let mut batch = Batch::default();
        buf.take_batch(0, 2, &mut batch);
        buf.push(&rows[4..]);
        buf.failed(&mut batch);
        assert_eq!((buf.len(), buf.in_flight()), (6, 0));
        buf.take_batch(0, 100, &mut batch);
        assert_eq!(batch.rows(), &rows[..]);
    }

    #[test]
    fn failed_rows_are_the_first_dropped_and_replaced_ones_are_not_retried() {
        let mut buf = Buffer::new(1, 3);
        let a = row(1, 1, 10);
        let b = row(1, 2, 10);
        buf.push(&[a, b]);
        let mut batch = Batch::default();
        buf.take_batch(0, 2, &mut batch);
        let newer_b = CallStatus { ts: 20, ..b };
        buf.push(&[newer_b]);
        buf.failed(&mut batch);
        assert_eq!(buf.counts().coalesced, 1, "old b is replaced by newer b");
        assert_eq!(buf.len(), 2);
        let c = row(1, 3, 30);
        let d = row(1, 4, 30);
        assert_eq!(buf.push(&[c, d]), 1);
        assert_eq!(drain_all(&mut buf), [newer_b, c, d], "a, the oldest, went");
    }

    #[test]
    fn of_two_failed_batches_the_newer_row_of_a_key_wins_whatever_the_order() {
        let mut buf = Buffer::new(1, 10);
        let old = row(1, 1, 10);
        let new = CallStatus { ts: 20, ..old };
        buf.push(&[old]);
        let (mut first, mut second) = (Batch::default(), Batch::default());
        buf.take_batch(0, 10, &mut first);
        buf.push(&[new]);
        buf.take_batch(0, 10, &mut second);
        buf.failed(&mut first);
        buf.failed(&mut second);
        assert_eq!(drain_all(&mut buf), [new]);
        assert_eq!(buf.counts().coalesced, 1);
    }

    #[test]
    fn a_newer_row_of_a_waiting_key_replaces_it_and_queues_at_the_back() {
        let mut buf = Buffer::new(2, 100);
        let a = row(1, 1, 10);
        let b = row(1, 2, 10);
        let newer_a = CallStatus {
            ts: 20,
            succ: 9,
            ..a
        };
        buf.push(&[a, b, newer_a]);
        assert_eq!(buf.len(), 2);
        assert_eq!(buf.counts().coalesced, 1);
        assert_eq!(drain_all(&mut buf), [b, newer_a]);
        let other_caller = CallStatus { caller: 8, ..a };
        buf.push(&[a, other_caller]);
        assert_eq!(buf.len(), 2, "another caller is another key");
    }

    #[test]
    fn a_rejected_batch_is_counted_and_gone() {
        let mut buf = Buffer::new(1, 10);
        buf.push(&[row(1, 1, 0), row(1, 2, 0)]);
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        buf.rejected(&mut batch);
        assert!(buf.is_empty());
        assert_eq!(buf.counts().rejected, 2);
        assert_eq!(buf.counts().written, 0);
    }

    #[test]
    fn touched_shards_are_reported_once_each() {
        let mut buf = Buffer::new(8, 100);
        let rows: Vec<_> = (0..50).map(|m| row(m, 80, 0)).collect();
        buf.push(&rows);
        buf.push(&rows[..3]);
        let mut touched = Vec::new();
        buf.drain_touched(|i| touched.push(i));
        let mut want: Vec<_> = rows.iter().map(|r| shard_of(r.module, 8)).collect();
        want.sort_unstable();
        want.dedup();
        touched.sort_unstable();
        assert_eq!(touched, want);
        let mut again = Vec::new();
        buf.drain_touched(|i| again.push(i));
        assert!(again.is_empty());
    }

    #[test]
    fn replacing_one_key_forever_keeps_memory_bounded() {
        let mut buf = Buffer::new(1, 10);
        for ts in 0..10_000 {
            buf.push(&[row(1, 1, ts), row(1, 2, ts)]);
        }
        assert_eq!(buf.len(), 2);
        assert!(buf.shards[0].slots.len() <= 2 * 2 + 64 + 1);
        assert_eq!(buf.counts().coalesced, 2 * 9_999);
        assert_eq!(buf.counts().dropped, 0);
    }

    proptest! {
        /// Whatever happens, the bound holds and every row accepted is
        /// exactly once written, rejected, dropped, coalesced or still held.
        #[test]
        fn the_bound_holds_and_every_row_is_accounted_for(
            ops in proptest::collection::vec((0u8..5, 0u32..6, 1u16..6, 0usize..4), 1..200),
            bound in 1usize..20,
        ) {
            let mut buf = Buffer::new(3, bound);
            let mut held: Vec<Batch> = (0..3).map(|_| Batch::default()).collect();
            for (ts, (op, modid, port, n)) in ops.into_iter().enumerate() {
                let shard = shard_of(ModuleId::new(modid, 1), 3);
                match op {
                    0 | 1 => {
                        let rows: Vec<_> = (0..n as u16 + 1).map(|k| row(modid, port + k, ts as u64)).collect();
                        buf.push(&rows);
                    }
                    2 if held[shard].is_empty() => {
                        buf.take_batch(shard, n + 1, &mut held[shard]);
                    }
                    2 => buf.failed(&mut held[shard]),
                    3 => buf.written(&mut held[shard]),
                    _ => buf.rejected(&mut held[shard]),
                }
                prop_assert!(buf.len() <= bound);
                let c = buf.counts();
                prop_assert_eq!(
                    c.accepted,
                    c.written + c.rejected + c.dropped + c.coalesced + buf.len() as u64
                );
                let waiting: usize = (0..3).map(|i| buf.waiting(i)).sum();
                let holding: usize = held.iter().map(|b| b.rows().len()).sum();
                prop_assert_eq!(waiting + holding, buf.len());
            }
        }
    }
}
