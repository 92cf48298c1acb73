//! The row buffer between the agents' connections and the writer threads,
//! sans-IO: a bounded, sharded queue that never refuses a row.
//!
//! - **Sharded by module.** A row goes to shard [`shard_of`]`(module)`;
//!   writer `i` drains shard `i` only, so the rows of one key are written in
//!   the order they arrived.
//! - **Coalescing.** A row whose key (module, node, caller) already waits in
//!   its shard replaces the waiting one (the store would replace it
//!   anyway): the older is removed, counted as coalesced, and the newer
//!   queues at the back. Newer is the store's rule
//!   ([`CallStatus::supersedes`]): a row from an earlier report of the same
//!   agent run (a re-send) queues at the back with the waiting row's
//!   values. Rows a writer holds are not coalesced.
//! - **Bounded, dropping the oldest.** Rows waiting plus rows the writers
//!   hold never exceed the bound. A push past it drops the oldest waiting
//!   rows over all shards (by arrival), counted as dropped; it never waits
//!   and never refuses. Rows a writer holds are never dropped (they may be
//!   inside a transaction); they are at most `shards * batch` rows.
//! - **Batches.** A writer takes up to `max` of its shard's oldest rows
//!   ([`Buffer::take_batch`]) and settles them once: written, rejected by
//!   the store, or failed, in which case they return to the front of the
//!   shard, still the oldest, to be retried or dropped.
//! - **Tickets: what an acknowledgement waits for.** The rows of one
//!   report are pushed under one ticket ([`Buffer::push_report`]), with
//!   as many extra holds as the report has other parts to write (its
//!   consumed units, released with [`Buffer::release`]). A ticket settles
//!   ([`Buffer::take_settled`]) once every row and hold has: committed
//!   when all were written, [`Settled::Rejected`] when the store refused
//!   one, [`Settled::Dropped`] when one was dropped at the bound. A row
//!   replaced by a newer row of its key hands its tickets to that row: the
//!   report is committed when the row that replaced it is.
//!
//! No locks, clocks or threads here: the shell holds the buffer in one
//! mutex, taken for the length of a push or a take.

use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, VecDeque};

use lbagent_model::{ModuleId, NodeAddr};
use lbagent_store::CallStatus;

pub use super::session::Settled;

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
    tickets: Vec<u64>,
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
        self.tickets.clear();
        n
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Arrival order over every shard.
    seq: u64,
    row: CallStatus,
    /// The ticket of the report it came with (0: none).
    ticket: u64,
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

    /// Marks the waiting row `seq` replaced and returns its ticket (0:
    /// none) and its row; compacts when replaced rows outnumber live ones,
    /// so dead slots never exceed the live ones by much.
    fn kill(&mut self, seq: u64) -> (u64, Option<CallStatus>) {
        let (mut ticket, mut row) = (0, None);
        if let Ok(i) = self.slots.binary_search_by_key(&seq, |s| s.seq) {
            self.slots[i].live = false;
            ticket = self.slots[i].ticket;
            row = Some(self.slots[i].row);
            self.live -= 1;
        }
        self.pop_dead_front();
        if self.slots.len() > 2 * self.live + 64 {
            self.slots.retain(|s| s.live);
        }
        (ticket, row)
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
    /// Open tickets: rows and holds not settled yet, and the worst end so
    /// far.
    tickets: HashMap<u64, (u32, Settled)>,
    /// Tickets a row answers for besides its own (handed on by the rows
    /// it replaced), by the row's arrival `seq`.
    carried: HashMap<u64, Vec<u64>>,
    /// Tickets settled and not taken yet.
    settled: Vec<(u64, Settled)>,
}

/// One ticket's row or hold ended as `how`: the ticket settles when it was
/// the last (the worst end wins).
fn settle_one(
    tickets: &mut HashMap<u64, (u32, Settled)>,
    settled: &mut Vec<(u64, Settled)>,
    ticket: u64,
    how: Settled,
) {
    if ticket == 0 {
        return;
    }
    if let MapEntry::Occupied(mut e) = tickets.entry(ticket) {
        let (open, worst) = e.get_mut();
        *worst = (*worst).max(how);
        *open -= 1;
        if *open == 0 {
            let (_, how) = e.remove();
            settled.push((ticket, how));
        }
    }
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
            tickets: HashMap::new(),
            carried: HashMap::new(),
            settled: Vec::new(),
        }
    }

    /// Tickets not settled yet.
    pub fn open_tickets(&self) -> usize {
        self.tickets.len()
    }

    /// Queues the rows of one report under `ticket` (not 0, not open
    /// already), which also waits for `holds` releases ([`Self::release`]);
    /// see [`Self::push`]. A report of no row and no hold settles at once.
    /// Returns the number of rows dropped.
    pub fn push_report(&mut self, rows: &[CallStatus], ticket: u64, holds: u32) -> u64 {
        debug_assert!(ticket != 0 && !self.tickets.contains_key(&ticket));
        let open = rows.len() as u32 + holds;
        if open == 0 {
            self.settled.push((ticket, Settled::Committed));
            return 0;
        }
        self.tickets.insert(ticket, (open, Settled::Committed));
        self.push_with(rows, ticket)
    }

    /// Forgets `ticket`: nobody waits for its answer any more (its
    /// connection closed). Its rows stay and are written as any.
    pub fn forget(&mut self, ticket: u64) {
        self.tickets.remove(&ticket);
    }

    /// One hold of `ticket` ended as `how`.
    pub fn release(&mut self, ticket: u64, how: Settled) {
        settle_one(&mut self.tickets, &mut self.settled, ticket, how);
    }

    /// Moves the tickets settled since the last call to `out`.
    pub fn take_settled(&mut self, out: &mut Vec<(u64, Settled)>) {
        out.append(&mut self.settled);
    }

    /// The tickets the row `seq` answers for settle as `how`.
    fn settle_row(&mut self, seq: u64, ticket: u64, how: Settled) {
        settle_one(&mut self.tickets, &mut self.settled, ticket, how);
        if let Some(more) = self.carried.remove(&seq) {
            for t in more {
                settle_one(&mut self.tickets, &mut self.settled, t, how);
            }
        }
    }

    /// The row `old` (of ticket `ticket`) was replaced by the row `new`:
    /// `new` answers for its tickets.
    fn hand_on(&mut self, old: u64, ticket: u64, new: u64) {
        let mut more = self.carried.remove(&old).unwrap_or_default();
        if ticket != 0 {
            more.push(ticket);
        }
        // Forgotten tickets are not carried on: a key replaced forever
        // carries no more than its open reports.
        more.retain(|t| self.tickets.contains_key(t));
        if !more.is_empty() {
            self.carried.entry(new).or_default().append(&mut more);
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
        self.push_with(rows, 0)
    }

    fn push_with(&mut self, rows: &[CallStatus], ticket: u64) -> u64 {
        let shards = self.shards.len();
        for row in rows {
            let i = shard_of(row.module, shards);
            let seq = self.next_seq;
            self.next_seq += 1;
            self.counts.accepted += 1;
            let shard = &mut self.shards[i];
            let mut kept = *row;
            let replaced = match shard.index.entry(key(row)) {
                MapEntry::Occupied(mut e) => {
                    let old = e.insert(seq);
                    let (old_ticket, old_row) = shard.kill(old);
                    // A re-sent older report keeps the waiting newer row's
                    // values (the store would not take the older either).
                    if let Some(old_row) = old_row.filter(|o| !row.supersedes(o)) {
                        kept = old_row;
                    }
                    self.counts.coalesced += 1;
                    self.live -= 1;
                    Some((old, old_ticket))
                }
                MapEntry::Vacant(e) => {
                    e.insert(seq);
                    None
                }
            };
            shard.slots.push_back(Slot {
                seq,
                row: kept,
                ticket,
                live: true,
            });
            shard.live += 1;
            self.live += 1;
            if let Some((old, old_ticket)) = replaced {
                self.hand_on(old, old_ticket, seq);
            }
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
        if let Some(slot) = self.shards[i].pop_oldest() {
            self.settle_row(slot.seq, slot.ticket, Settled::Dropped);
        }
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
            batch.tickets.push(slot.ticket);
        }
        let n = batch.rows.len();
        s.in_flight += n;
        self.live -= n;
        self.in_flight += n;
        n > 0
    }

    /// The store wrote `batch` in one transaction.
    pub fn written(&mut self, batch: &mut Batch) {
        let n = self.settle(batch, Settled::Committed);
        self.counts.written += n as u64;
        self.counts.transactions += 1;
    }

    /// The store refused `batch` as invalid: its rows are not retried.
    pub fn rejected(&mut self, batch: &mut Batch) {
        let n = self.settle(batch, Settled::Rejected);
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
        let mut handed = Vec::new();
        let rows = batch.rows.iter().zip(&batch.seqs).zip(&batch.tickets);
        for ((row, &seq), &ticket) in rows.rev() {
            let mut kept = *row;
            match s.index.get(&key(row)).copied() {
                Some(newer) if newer > seq => {
                    // The row that arrived since answers for this one, with
                    // this one's values if it came from an earlier report
                    // of the same run (a re-send).
                    if let Ok(i) = s.slots.binary_search_by_key(&newer, |x| x.seq) {
                        if !s.slots[i].row.supersedes(row) {
                            s.slots[i].row = *row;
                        }
                    }
                    self.counts.coalesced += 1;
                    handed.push((seq, ticket, newer));
                    continue;
                }
                Some(older) => {
                    // An older row of the key came back first (two batches
                    // of one shard out at once): this one replaces it.
                    let (old_ticket, old_row) = s.kill(older);
                    if let Some(old_row) = old_row.filter(|o| !row.supersedes(o)) {
                        kept = old_row;
                    }
                    handed.push((older, old_ticket, seq));
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
                row: kept,
                ticket,
                live: true,
            };
            s.slots.insert(at, slot);
            s.live += 1;
            self.live += 1;
        }
        s.in_flight = s.in_flight.saturating_sub(n);
        self.in_flight = self.in_flight.saturating_sub(n);
        batch.clear();
        for (old, ticket, new) in handed {
            self.hand_on(old, ticket, new);
        }
    }

    fn settle(&mut self, batch: &mut Batch, how: Settled) -> usize {
        for (&seq, &ticket) in batch.seqs.iter().zip(&batch.tickets) {
            self.settle_row(seq, ticket, how);
        }
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
            agent_start: 0,
            seq: 0,
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

    /// `r` as carried by report `seq` of agent run 77.
    fn of_report(r: CallStatus, seq: u64, succ: u32) -> CallStatus {
        CallStatus {
            agent_start: 77,
            seq,
            succ,
            ..r
        }
    }

    #[test]
    fn a_resent_older_report_keeps_the_waiting_newer_rows_values() {
        let mut buf = Buffer::new(1, 100);
        let newer = of_report(row(1, 1, 10), 5, 50);
        let resent = of_report(row(1, 1, 10), 4, 40);
        buf.push_report(&[newer], 1, 0);
        buf.push_report(&[resent], 2, 0);
        assert_eq!(buf.counts().coalesced, 1);
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        assert_eq!(batch.rows(), [newer], "the re-send does not undo report 5");
        buf.written(&mut batch);
        let mut done = settled(&mut buf);
        done.sort();
        assert_eq!(
            done,
            [(1, Settled::Committed), (2, Settled::Committed)],
            "both answered once the newer values are stored"
        );
        // Another run, or a run unknown, replaces as it comes.
        let other_run = CallStatus {
            agent_start: 78,
            ..resent
        };
        let unknown = CallStatus {
            agent_start: 0,
            seq: 0,
            ..resent
        };
        for later in [other_run, unknown] {
            buf.push(&[newer, later]);
            assert_eq!(drain_all(&mut buf), [later]);
        }
    }

    #[test]
    fn a_failed_newer_row_gives_its_values_to_a_waiting_resent_one() {
        let mut buf = Buffer::new(1, 100);
        let newer = of_report(row(1, 1, 10), 5, 50);
        let resent = of_report(row(1, 1, 10), 4, 40);
        buf.push(&[newer]);
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        buf.push(&[resent]);
        buf.failed(&mut batch);
        assert_eq!(drain_all(&mut buf), [newer]);
        // The other way round: the re-send failed, the newer row waits.
        buf.push(&[resent]);
        buf.take_batch(0, 10, &mut batch);
        buf.push(&[newer]);
        buf.failed(&mut batch);
        assert_eq!(drain_all(&mut buf), [newer]);
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

    fn settled(buf: &mut Buffer) -> Vec<(u64, Settled)> {
        let mut out = Vec::new();
        buf.take_settled(&mut out);
        out
    }

    #[test]
    fn a_report_settles_only_once_every_row_is_written() {
        let mut buf = Buffer::new(1, 100);
        let rows = [row(1, 1, 0), row(1, 2, 0), row(1, 3, 0)];
        buf.push_report(&rows, 7, 0);
        let mut batch = Batch::default();
        buf.take_batch(0, 2, &mut batch);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), [], "one row is not in the database");
        assert_eq!(buf.open_tickets(), 1);
        buf.take_batch(0, 2, &mut batch);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), [(7, Settled::Committed)]);
        assert_eq!(buf.open_tickets(), 0);
    }

    #[test]
    fn a_failed_batch_keeps_its_reports_open_until_written() {
        let mut buf = Buffer::new(1, 100);
        buf.push_report(&[row(1, 1, 0)], 1, 0);
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        buf.failed(&mut batch);
        assert_eq!(settled(&mut buf), []);
        buf.take_batch(0, 10, &mut batch);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), [(1, Settled::Committed)]);
    }

    #[test]
    fn a_replaced_row_hands_its_report_to_the_row_that_replaced_it() {
        let mut buf = Buffer::new(1, 100);
        buf.push_report(&[row(1, 1, 10)], 1, 0);
        buf.push_report(&[row(1, 1, 20), row(1, 2, 20)], 2, 0);
        assert_eq!(buf.counts().coalesced, 1);
        assert_eq!(settled(&mut buf), [], "report 1's row waits in report 2's");
        let mut batch = Batch::default();
        buf.take_batch(0, 1, &mut batch);
        assert_eq!(batch.rows()[0].ts, 20);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), [(1, Settled::Committed)]);
        buf.take_batch(0, 1, &mut batch);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), [(2, Settled::Committed)]);
    }

    #[test]
    fn a_failed_row_replaced_meanwhile_hands_its_report_on() {
        let mut buf = Buffer::new(1, 100);
        buf.push_report(&[row(1, 1, 10)], 1, 0);
        let mut batch = Batch::default();
        buf.take_batch(0, 1, &mut batch);
        buf.push_report(&[row(1, 1, 20)], 2, 0);
        buf.failed(&mut batch);
        assert_eq!(settled(&mut buf), []);
        buf.take_batch(0, 10, &mut batch);
        assert_eq!(batch.rows().len(), 1, "only the newer row is written");
        buf.written(&mut batch);
        let mut got = settled(&mut buf);
        got.sort_unstable();
        assert_eq!(got, [(1, Settled::Committed), (2, Settled::Committed)]);
    }

    #[test]
    fn a_report_with_a_dropped_or_rejected_row_is_not_committed() {
        let mut buf = Buffer::new(1, 2);
        buf.push_report(&[row(1, 1, 0), row(1, 2, 0)], 1, 0);
        buf.push_report(&[row(1, 3, 0)], 2, 0);
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        buf.written(&mut batch);
        assert_eq!(
            settled(&mut buf),
            [(1, Settled::Dropped), (2, Settled::Committed)]
        );
        buf.push_report(&[row(1, 4, 0)], 3, 0);
        buf.take_batch(0, 10, &mut batch);
        buf.rejected(&mut batch);
        assert_eq!(settled(&mut buf), [(3, Settled::Rejected)]);
    }

    #[test]
    fn a_forgotten_report_is_never_settled_and_not_carried_on() {
        let mut buf = Buffer::new(1, 100);
        for t in 1..=1000 {
            buf.push_report(&[row(1, 1, t)], t, 0);
            buf.forget(t);
        }
        assert_eq!(buf.open_tickets(), 0);
        assert!(
            buf.carried.values().all(|v| v.is_empty()),
            "nothing carried"
        );
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), []);
    }

    #[test]
    fn a_hold_keeps_a_report_open_until_released_and_an_empty_one_settles_at_once() {
        let mut buf = Buffer::new(1, 100);
        buf.push_report(&[row(1, 1, 0)], 1, 1);
        let mut batch = Batch::default();
        buf.take_batch(0, 10, &mut batch);
        buf.written(&mut batch);
        assert_eq!(settled(&mut buf), []);
        buf.release(1, Settled::Committed);
        assert_eq!(settled(&mut buf), [(1, Settled::Committed)]);
        buf.push_report(&[], 2, 1);
        buf.release(2, Settled::Dropped);
        buf.push_report(&[], 3, 0);
        assert_eq!(
            settled(&mut buf),
            [(2, Settled::Dropped), (3, Settled::Committed)]
        );
        assert_eq!(buf.open_tickets(), 0);
    }

    proptest! {
        /// Whatever happens, every report settles exactly once when
        /// everything is written in the end, and a report settles
        /// committed only when each of its rows is in the store: written
        /// itself, or replaced by a newer row of its key that was.
        #[test]
        fn a_report_is_committed_only_once_each_of_its_rows_is_in_the_store(
            ops in proptest::collection::vec((0u8..5, 0u32..6, 1u16..6, 0usize..4), 1..200),
            bound in 1usize..20,
        ) {
            let mut buf = Buffer::new(3, bound);
            let mut held: Vec<Batch> = (0..3).map(|_| Batch::default()).collect();
            let mut rows_of: HashMap<u64, Vec<CallStatus>> = HashMap::new();
            // Per key, the newest `ts` the store holds.
            let mut store: HashMap<Key, u64> = HashMap::new();
            let mut out = Vec::new();
            let check = |buf: &mut Buffer,
                         store: &HashMap<Key, u64>,
                         rows_of: &HashMap<u64, Vec<CallStatus>>|
             -> Vec<(u64, Settled)> {
                let mut now = Vec::new();
                buf.take_settled(&mut now);
                for &(t, how) in &now {
                    if how == Settled::Committed {
                        for r in &rows_of[&t] {
                            assert!(
                                store.get(&key(r)).is_some_and(|&ts| ts >= r.ts),
                                "report {t} committed before its row {r:?} was stored"
                            );
                        }
                    }
                }
                now
            };
            let write = |buf: &mut Buffer, batch: &mut Batch, store: &mut HashMap<Key, u64>| {
                for r in batch.rows() {
                    let ts = store.entry(key(r)).or_insert(r.ts);
                    *ts = (*ts).max(r.ts);
                }
                buf.written(batch);
            };
            for (ts, (op, modid, port, n)) in ops.into_iter().enumerate() {
                let shard = shard_of(ModuleId::new(modid, 1), 3);
                match op {
                    0 | 1 => {
                        let rows: Vec<_> = (0..n as u16 + 1).map(|k| row(modid, port + k, ts as u64)).collect();
                        let t = ts as u64 + 1;
                        rows_of.insert(t, rows.clone());
                        buf.push_report(&rows, t, 0);
                    }
                    2 if held[shard].is_empty() => {
                        buf.take_batch(shard, n + 1, &mut held[shard]);
                    }
                    2 => buf.failed(&mut held[shard]),
                    3 => write(&mut buf, &mut held[shard], &mut store),
                    _ => buf.rejected(&mut held[shard]),
                }
                out.extend(check(&mut buf, &store, &rows_of));
            }
            for b in &mut held {
                buf.failed(b);
            }
            let mut batch = Batch::default();
            for i in 0..3 {
                while buf.take_batch(i, 1000, &mut batch) {
                    write(&mut buf, &mut batch, &mut store);
                }
            }
            out.extend(check(&mut buf, &store, &rows_of));
            let mut seen: Vec<u64> = out.iter().map(|t| t.0).collect();
            seen.sort_unstable();
            let mut pushed: Vec<u64> = rows_of.keys().copied().collect();
            pushed.sort_unstable();
            prop_assert_eq!(seen, pushed, "every report settled exactly once");
            prop_assert_eq!(buf.open_tickets(), 0);
            let c = buf.counts();
            if c.dropped + c.rejected == 0 {
                prop_assert!(out.iter().all(|t| t.1 == Settled::Committed));
            }
        }

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
