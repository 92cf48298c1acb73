//! The shard's side of a region: find the slots with a new request, copy
//! each request out (never trusting a length or an index read from the
//! slot), hand it to the shard's core as a datagram from the slot's
//! [`slot_peer`](super::layout::slot_peer), and write the answer back,
//! waking the client only if it sleeps. It owns no socket and no clock:
//! the runtime shell calls it in its request loop.

use std::sync::atomic::{fence, AtomicU32, Ordering};

use super::fixed;
use super::layout::{self, Geometry, SLOT_WORDS};
use super::lease::Leases;
use super::region::{process_gone, Region};
use lbagent_wire::{decode, Limits, Message};

/// The requests up to this many bytes are copied out of their cell as one
/// block of this size (see [`Server::take`]).
const SMALL: usize = 64;
const _: () = assert!(fixed::REPORT_HINTED_LEN + fixed::GET_HOST_LEN <= SMALL);

/// Counters of the shard's side, shipped with the shard's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmCounts {
    /// Requests taken from slots.
    pub requests: u64,
    /// Requests refused because their slot held garbage (a length out of
    /// range, or an answer too large for the slot).
    pub garbage: u64,
    /// Slots taken back from dead clients.
    pub reclaimed: u64,
    /// Clients woken by a futex (they slept waiting for their answer).
    pub wakes: u64,
    /// Times the region's file was found truncated under the shard (a
    /// client cut it; the region is then closed and the shard goes on).
    pub truncated: u64,
}

/// A request taken from a slot (its bytes: [`Server::request`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken {
    /// The slot.
    pub slot: u32,
    /// The slot's request sequence it carried.
    pub seq: u32,
    /// The cell's length.
    pub len: usize,
    /// Where the request starts: 0, or after a report sent with it.
    pub split: usize,
    /// The request's format ([`layout::FMT_FLATBUFFERS`] or
    /// [`layout::FMT_FIXED`]).
    pub format: u8,
    /// The format of the report in front of it, if any.
    pub first_format: u8,
    /// How long it waited in the slot, µs (see [`layout::waited_us`]).
    pub waited_us: u64,
    /// The cell was placed inline ([`layout::PLACE_INLINE`]): a fixed
    /// answer goes there too.
    pub inline: bool,
}

/// What the server remembers about one slot.
#[derive(Clone, Copy, Debug, Default)]
struct SlotMemo {
    /// The last request sequence taken.
    last: u32,
    /// A request the core holds for later (a register waiting for its
    /// route): its slot sequence and its wire sequence.
    held: Option<(u32, u64)>,
}

/// One shard's region and what the shard remembers about each slot.
pub struct Server {
    region: Region,
    /// Per slot: the last request taken and the one held (one vector, so
    /// that a request taken pays one bounds check for both).
    memo: Vec<SlotMemo>,
    buf: Vec<u8>,
    /// When the previous sweep started (ns, realtime).
    visited_ns: u64,
    /// The slots the current sweep looks at ([`Server::ready`]).
    ready: Vec<u32>,
    /// The slots leased to local-socket connections ([`super::lease`]).
    leases: Leases,
    /// Slots some client held at the last [`Server::reclaim_dead`] (or
    /// leased since).
    claimed: u32,
    /// The counters.
    pub counts: ShmCounts,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Serves `region` (made by the agent for this shard), guarded against
    /// its file being truncated under it ([`Region::guard`]).
    pub fn new(mut region: Region) -> Server {
        if !region.guard() {
            tracing::warn!(
                "{}: no SIGBUS guard: a client that truncates the file can stop the agent",
                region.path().display()
            );
        }
        // This shard reads the node hints of fixed records (its clients
        // may ask for them) and cells placed inline.
        region.add_features(layout::FEAT_NODE_HINT | layout::FEAT_INLINE);
        let slots = region.geometry().slots as usize;
        let req_cap = region.geometry().req_cap;
        Server {
            region,
            memo: vec![SlotMemo::default(); slots],
            buf: vec![0; req_cap.max(layout::INLINE_CAP)],
            visited_ns: 0,
            ready: Vec::with_capacity(slots),
            leases: Leases::new(slots as u32),
            claimed: 0,
            counts: ShmCounts::default(),
        }
    }

    fn g(&self) -> &Geometry {
        self.region.geometry()
    }

    /// Says in the region's header whether this shard reads its clients'
    /// request stamps (it measures queuing times): when it does not
    /// ([`layout::FEAT_NO_STAMP`]), clients write none. Called once, before
    /// the region is offered.
    pub fn reads_stamps(&self, reads: bool) {
        if !reads {
            self.region.add_features(layout::FEAT_NO_STAMP);
        }
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.g().slots
    }

    /// Starts a sweep at `now_ns` (realtime); returns the previous
    /// sweep's start, the bound on any request's wait.
    pub fn begin_sweep(&mut self, now_ns: u64) -> u64 {
        std::mem::replace(&mut self.visited_ns, now_ns)
    }

    /// Takes slot `slot`'s new request, if it has one, into the server's
    /// buffer: a compare-and-swap sets [`layout::TAKEN`] first, so its
    /// client no longer touches the cell. A request whose length or split
    /// is garbage is answered [`layout::NO_ANSWER`] and counted.
    #[inline(always)]
    pub fn take(&mut self, slot: u32, now_ns: u64, visited_ns: u64) -> Option<Taken> {
        let (base, w) = self.region.slot(slot);
        let word = &w[layout::S_REQ_SEQ / 4];
        let seq = word.load(Ordering::Acquire);
        let memo = self.memo.get_mut(slot as usize)?;
        if seq & layout::TAKEN != 0 || seq == memo.last {
            return None;
        }
        if word
            .compare_exchange(
                seq,
                seq | layout::TAKEN,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_err()
        {
            return None;
        }
        *memo = SlotMemo {
            last: seq,
            held: None,
        };
        let raw_len = w[layout::S_REQ_LEN / 4].load(Ordering::Relaxed);
        let raw_split = w[layout::S_REQ_SPLIT / 4].load(Ordering::Relaxed);
        let raw_format = w[layout::S_REQ_FORMAT / 4].load(Ordering::Relaxed);
        let parts = layout::request_len(raw_len, self.g().req_cap).and_then(|len| {
            let f = layout::formats(raw_format)?;
            if f.inline && len > layout::INLINE_CAP {
                return None;
            }
            Some((len, layout::split_at(raw_split, len)?, f))
        });
        let Some((len, split, f)) = parts else {
            self.refuse_garbage(slot, seq);
            return None;
        };
        // The client's stamp only matters when queuing times are measured.
        let waited_us = if now_ns == 0 {
            0
        } else {
            let stamp = self
                .region
                .u64(base + layout::S_REQ_STAMP)
                .load(Ordering::Relaxed);
            layout::waited_us(now_ns, stamp, visited_ns)
        };
        // A hot request (a record, or a report and a getHost in one cell)
        // fits in the cell's first SMALL bytes: copied as one block of a
        // fixed size (no call to memcpy); the bytes past `len` are never
        // read (every geometry's request area holds 64 bytes at least).
        if f.inline {
            // Both parts whole, whatever the length (fixed sizes: no call
            // to memcpy); the bytes past `len` are never read.
            let cell: &mut [u8; layout::INLINE_CAP] = (&mut self.buf[..layout::INLINE_CAP])
                .try_into()
                .expect("the buffer holds an inline cell");
            self.region.copy_out_inline_of(slot, cell);
        } else if len <= SMALL {
            self.region
                .copy_out(base + layout::S_DATA, &mut self.buf[..SMALL]);
        } else {
            self.region
                .copy_out(base + layout::S_DATA, &mut self.buf[..len]);
        }
        fence(Ordering::Acquire);
        self.counts.requests += 1;
        if split > 0 {
            self.count_first();
        }
        Some(Taken {
            slot,
            seq,
            len,
            split,
            format: f.request,
            first_format: f.first,
            waited_us,
            inline: f.inline,
        })
    }

    /// Counts the report sent ahead of a request in its cell. Out of
    /// line, so that a cell of one request pays a test, not the branch-free
    /// sum the compiler otherwise makes of both counts (5 instructions).
    #[cold]
    #[inline(never)]
    fn count_first(&mut self) {
        self.counts.requests += 1;
    }

    /// A request whose length, split or format is garbage: counted and
    /// answered [`layout::NO_ANSWER`]. Out of line: a request taken pays
    /// only the test.
    #[cold]
    #[inline(never)]
    fn refuse_garbage(&mut self, slot: u32, seq: u32) {
        self.counts.garbage += 1;
        self.respond(slot, seq, None);
    }

    /// The report sent in the same cell before the request, if any.
    #[inline(always)]
    pub fn first(&self, t: &Taken) -> Option<&[u8]> {
        (t.split > 0).then(|| &self.buf[..t.split])
    }

    /// The bytes of the request last taken (after its report, if any).
    #[inline(always)]
    pub fn request(&self, t: &Taken) -> &[u8] {
        &self.buf[t.split..t.len]
    }

    /// Writes the answer to request `seq` of `slot` (`None`: consumed,
    /// nothing to say) and wakes the client if it sleeps. An answer larger
    /// than the slot's response area is counted as garbage and replaced by
    /// no answer.
    #[inline(always)]
    pub fn respond(&mut self, slot: u32, seq: u32, answer: Option<&[u8]>) {
        self.respond_as(
            slot,
            seq,
            answer,
            layout::resp_format(layout::FMT_FLATBUFFERS, layout::PLACE_DATA),
        );
    }

    /// Writes getHost answer `a` to request `seq` of `slot` as a record of
    /// the fixed layout (no node hint), and wakes the client if it sleeps.
    pub fn respond_host(&mut self, slot: u32, seq: u32, a: &fixed::HostAnswer) {
        let mut rec = [0u8; fixed::HOST_ANSWER_LEN];
        fixed::encode_answer(a, &mut rec);
        self.respond_as(
            slot,
            seq,
            Some(&rec),
            layout::resp_format(layout::FMT_FIXED, layout::PLACE_DATA),
        );
    }

    /// Writes the first `len` bytes of `record`, a getHost answer record
    /// of the fixed layout the shard wrote ([`fixed::write_answer`]), as
    /// the answer to request `t`, and wakes the client if it sleeps. The
    /// whole array is copied (a fixed size: no call to memcpy; every
    /// geometry's response area holds 64 bytes at least); the client
    /// reads `len`. When the request was placed inline the record goes in
    /// the slot's second line.
    #[inline(always)]
    pub fn respond_record(&mut self, t: &Taken, record: &[u8; fixed::ANSWER_MAX], len: usize) {
        let place = if t.inline {
            self.region.copy_in_inline(t.slot, record);
            layout::PLACE_INLINE
        } else {
            self.region.copy_in(self.g().resp_offset(t.slot), record);
            layout::PLACE_DATA
        };
        let len = if (1..=fixed::ANSWER_MAX).contains(&len) {
            len as u32
        } else {
            self.counts.garbage += 1;
            layout::NO_ANSWER
        };
        self.publish(
            t.slot,
            t.seq,
            len,
            layout::resp_format(layout::FMT_FIXED, place),
        );
    }

    #[inline]
    fn respond_as(&mut self, slot: u32, seq: u32, answer: Option<&[u8]>, format: u32) {
        let g = *self.g();
        let len = match answer {
            Some(a) if a.len() <= g.resp_cap && !a.is_empty() => {
                self.region.copy_in(g.resp_offset(slot), a);
                a.len() as u32
            }
            Some(_) => {
                self.counts.garbage += 1;
                layout::NO_ANSWER
            }
            None => layout::NO_ANSWER,
        };
        self.publish(slot, seq, len, format);
    }

    /// Publishes the answer of `len` bytes (or [`layout::NO_ANSWER`]) of
    /// response format word `format` ([`layout::resp_format`]) to request
    /// `seq` of `slot`, whose bytes are in place, and wakes the client if
    /// it sleeps.
    #[inline(always)]
    fn publish(&mut self, slot: u32, seq: u32, len: u32, format: u32) {
        let (base, w) = self.region.slot(slot);
        w[layout::S_RESP_LEN / 4].store(len, Ordering::Relaxed);
        w[layout::S_RESP_FORMAT / 4].store(format, Ordering::Relaxed);
        w[layout::S_RESP_SEQ / 4].store(seq, Ordering::SeqCst);
        if w[layout::S_SLEEPING / 4].load(Ordering::SeqCst) != 0 {
            wake(&self.region, w, base, &mut self.counts);
        }
    }

    /// The core answered request `t` with nothing for now: a register that
    /// waits for its route is held (answered later through
    /// [`Server::deliver`]); anything else (a report, a dropped datagram)
    /// is acknowledged as consumed.
    pub fn unanswered(&mut self, t: Taken) {
        if t.format != layout::FMT_FLATBUFFERS {
            // A getHost or report record: never held.
            self.respond(t.slot, t.seq, None);
            return;
        }
        let wire = match decode(self.request(&t), &Limits::UDP) {
            Ok(Message::RegisterReq(r)) => Some(u64::from(r.seq())),
            _ => None,
        };
        match wire {
            Some(w) => self.memo[t.slot as usize].held = Some((t.seq, w)),
            None => self.respond(t.slot, t.seq, None),
        }
    }

    /// Delivers an answer the core released later to `slot`, if the slot
    /// still waits for it (same request, same wire sequence); else drops
    /// it, as a UDP client that moved on would. Returns whether it was
    /// delivered.
    pub fn deliver(&mut self, slot: u32, answer: &[u8]) -> bool {
        if slot >= self.slots() {
            return false;
        }
        let Some((seq, wire)) = self.memo[slot as usize].held else {
            return false;
        };
        let answer_seq = match decode(answer, &Limits::UDP) {
            Ok(Message::RegisterResp(r)) => u64::from(r.seq()),
            Ok(Message::ErrorResp(r)) => r.seq(),
            _ => return false,
        };
        let base = self.g().slot_offset(slot);
        let current = self
            .region
            .u32(base + layout::S_REQ_SEQ)
            .load(Ordering::Acquire);
        if answer_seq != wire || current != seq | layout::TAKEN {
            return false;
        }
        self.memo[slot as usize].held = None;
        self.respond(slot, seq, Some(answer));
        true
    }

    /// True once the region's file was found truncated under the mapping
    /// (its slots past the new end read as empty; see [`Region::guard`]).
    pub fn truncated(&self) -> bool {
        self.region.truncated()
    }

    /// Collects the slots a sweep should look at and returns how many
    /// ([`Server::ready_slot`] gives them): those whose pending bit their
    /// client set since the last sweep (each pending word is taken, swapped
    /// to 0, only if it is not 0 already), or with `full` every slot that
    /// holds a request not yet taken, whatever its bit says (a client
    /// that does not set it is served by these full sweeps only). A bit is
    /// only a hint: [`Server::take`] checks the slot itself.
    #[inline]
    pub fn ready(&mut self, full: bool) -> usize {
        if full {
            return self.ready_all();
        }
        self.ready.clear();
        let slots = self.slots();
        if slots <= 64 {
            // One pending word (the default geometry's): no loop over
            // words (callgrind: 8 instructions a sweep).
            self.take_pending(0, slots);
        } else {
            for w in 0..layout::pending_words(slots) {
                self.take_pending(w, slots);
            }
        }
        self.ready.len()
    }

    /// Takes pending word `w` (swapped to 0 if it is not 0 already) and
    /// collects the slots its bits name.
    #[inline(always)]
    fn take_pending(&mut self, w: usize, slots: u32) {
        let word = self.region.u64(layout::H_PENDING + 8 * w);
        if word.load(Ordering::Relaxed) == 0 {
            return;
        }
        let bits = word.swap(0, Ordering::AcqRel);
        self.ready.extend(layout::pending_slots(w, bits, slots));
    }

    /// [`Server::ready`] with `full`: every pending word cleared, every
    /// slot holding a request not yet taken collected. Out of line: the
    /// full sweeps are the periodic ones.
    #[inline(never)]
    fn ready_all(&mut self) -> usize {
        self.ready.clear();
        let slots = self.slots();
        for w in 0..layout::pending_words(slots) {
            let word = self.region.u64(layout::H_PENDING + 8 * w);
            if word.load(Ordering::Relaxed) != 0 {
                word.swap(0, Ordering::AcqRel);
            }
        }
        for s in 0..slots {
            if self.has_request(s, Ordering::Acquire) {
                self.ready.push(s);
            }
        }
        self.ready.len()
    }

    /// The `i`th slot [`Server::ready`] collected.
    #[inline(always)]
    pub fn ready_slot(&self, i: usize) -> u32 {
        self.ready[i]
    }

    fn has_request(&self, s: u32, order: Ordering) -> bool {
        let w = self
            .region
            .u32(self.g().slot_offset(s) + layout::S_REQ_SEQ)
            .load(order);
        w & layout::TAKEN == 0 && w != self.memo[s as usize].last
    }

    /// True when some slot holds a request not yet taken (every slot is
    /// looked at, whatever the pending bits say), or some pending bit is
    /// set.
    pub fn pending(&self) -> bool {
        let words = layout::pending_words(self.slots());
        (0..words).any(|w| {
            self.region
                .u64(layout::H_PENDING + 8 * w)
                .load(Ordering::SeqCst)
                != 0
        }) || (0..self.slots()).any(|s| self.has_request(s, Ordering::SeqCst))
    }

    /// Says the shard is about to sleep: a client that publishes a request
    /// from now on rings the doorbell. Call [`Server::pending`] after it.
    pub fn park(&self) {
        self.region.u32(layout::H_PARKED).store(1, Ordering::SeqCst);
    }

    /// Says the shard is awake and polling.
    pub fn unpark(&self) {
        self.region.u32(layout::H_PARKED).store(0, Ordering::SeqCst);
    }

    /// Takes back every claimed slot whose owner is dead (or whose owner
    /// field is not a pid), and every slot that says it is leased (the
    /// agent's pid) but is not ([`super::lease`]); a leased slot is left
    /// to its connection. Returns the slots taken back (their balance
    /// units go back too). First, once the region's file was found
    /// truncated, closes it and counts that ([`ShmCounts::truncated`]):
    /// this runs once a second, outside any signal handler.
    pub fn reclaim_dead(&mut self) -> Vec<u32> {
        if self.counts.truncated == 0 && self.region.close_if_truncated() {
            self.counts.truncated = 1;
        }
        let agent = self.region.identity().pid;
        let mut gone = Vec::new();
        let mut claimed = 0;
        for s in 0..self.slots() {
            if self.leases.holder(s).is_some() {
                claimed += 1;
                continue;
            }
            let owner = self.owner(s);
            let freed = if owner == agent {
                free_if(&self.region, s, agent)
            } else {
                reclaim_if_dead(&self.region, s)
            };
            if freed {
                self.memo[s as usize].held = None;
                gone.push(s);
            } else if owner != layout::FREE {
                claimed += 1;
            }
        }
        self.counts.reclaimed += gone.len() as u64;
        self.claimed = claimed;
        gone
    }

    /// How many slots clients held at the last [`Server::reclaim_dead`]
    /// (once a second), plus those leased since: 0 when nobody has used
    /// the region for about a second. A client that claims a slot after
    /// that count rings the doorbell with its first request if the shard
    /// is marked parked ([`Server::park`]), which a shard that counts no
    /// client stays.
    pub fn claimed(&self) -> u32 {
        self.claimed
    }

    /// A client showed it holds a slot (its doorbell, or a request found
    /// pending): [`Server::claimed`] says at least 1 until the next count.
    pub fn assume_held(&mut self) {
        self.claimed = self.claimed.max(1);
    }

    fn owner(&self, slot: u32) -> u32 {
        self.region
            .u32(self.g().slot_offset(slot) + layout::S_STATE)
            .load(Ordering::Acquire)
    }

    /// Leases a free slot to local connection `conn` (its client proved
    /// it may use the region): claims it with the agent's pid as the owner
    /// and records the connection. `None` when every slot is taken.
    pub fn lease(&mut self, conn: u32) -> Option<u32> {
        let agent = self.region.identity().pid;
        let slots = self.slots();
        let start = fastrand::u32(..slots);
        let slot = (0..slots).map(|k| (start + k) % slots).find(|&s| {
            let base = self.g().slot_offset(s);
            self.region
                .u32(base + layout::S_STATE)
                .compare_exchange(layout::FREE, agent, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        let base = self.g().slot_offset(slot);
        self.region
            .u32(base + layout::S_SLEEPING)
            .store(0, Ordering::Relaxed);
        self.memo[slot as usize].held = None;
        self.leases.grant(slot, conn);
        self.claimed += 1;
        Some(slot)
    }

    /// Local connection `conn` closed: frees every slot it leased (still
    /// the agent's) and returns them (their balance units go back too).
    pub fn end_leases(&mut self, conn: u32) -> Vec<u32> {
        let agent = self.region.identity().pid;
        let mut ended = self.leases.end(conn);
        ended.retain(|&s| {
            self.memo[s as usize].held = None;
            free_if(&self.region, s, agent)
        });
        self.counts.reclaimed += ended.len() as u64;
        ended
    }

    /// Marks the region closed (clients fall back to UDP at once), wakes
    /// every sleeping client, and removes the file if it is still the one
    /// this server made.
    pub fn close(&self) {
        self.region.u32(layout::H_CLOSED).store(1, Ordering::SeqCst);
        for s in 0..self.slots() {
            self.region
                .futex_wake(self.g().slot_offset(s) + layout::S_RESP_SEQ);
        }
        remove_if_ours(&self.region);
    }
}

/// Wakes the client of the slot at `base` (its header words `w`), which
/// sleeps on its answer. Out of line: a client that polls is answered
/// without it.
#[cold]
#[inline(never)]
fn wake(region: &Region, w: &[AtomicU32; SLOT_WORDS], base: usize, counts: &mut ShmCounts) {
    w[layout::S_SLEEPING / 4].store(0, Ordering::Relaxed);
    region.futex_wake(base + layout::S_RESP_SEQ);
    counts.wakes += 1;
}

fn remove_if_ours(region: &Region) {
    let path = region.path();
    if let Ok(r) = Region::open(path) {
        if r.identity() == region.identity() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Frees `slot` if it is claimed by a process that no longer exists (or by
/// a state word that names no pid). One compare-and-swap of the state
/// word, which holds the owner's pid: a slot claimed again meanwhile holds
/// another pid and is left alone. A slot leased over the local socket
/// (its state is the agent's pid, [`layout::pid_checked`]) is never taken
/// back here: its connection holds it.
pub fn reclaim_if_dead(region: &Region, slot: u32) -> bool {
    let base = region.geometry().slot_offset(slot);
    let owner = region.u32(base + layout::S_STATE).load(Ordering::Acquire);
    if !layout::pid_checked(owner, region.identity().pid)
        || !layout::owner_pid(owner).is_none_or(process_gone)
    {
        return false;
    }
    free_if(region, slot, owner)
}

/// Frees `slot` if its state word still holds `owner`.
fn free_if(region: &Region, slot: u32, owner: u32) -> bool {
    let base = region.geometry().slot_offset(slot);
    region
        .u32(base + layout::S_STATE)
        .compare_exchange(owner, layout::FREE, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{Access, Identity};

    /// A region of 70 slots (two pending words) and its server; `publish`
    /// stores a request of 3 bytes in a slot as a client does, with or
    /// without its pending bit.
    fn setup(dir: &std::path::Path) -> (Server, Region) {
        let path = dir.join("r.0");
        let ident = Identity {
            shard: 0,
            pid: std::process::id(),
            boot: 1,
        };
        let made = Region::create(&path, Geometry::new(70), ident, Access::Owner).unwrap();
        (Server::new(made), Region::open(&path).unwrap())
    }

    fn publish(client: &Region, slot: u32, seq: u32, bit: bool) {
        let base = client.geometry().slot_offset(slot);
        client.copy_in(base + layout::S_DATA, b"abc");
        client
            .u32(base + layout::S_REQ_LEN)
            .store(3, Ordering::Relaxed);
        client
            .u32(base + layout::S_REQ_SEQ)
            .store(seq, Ordering::SeqCst);
        if bit {
            let (off, b) = layout::pending_bit(slot);
            client.u64(off).fetch_or(b, Ordering::SeqCst);
        }
    }

    fn ready_slots(srv: &mut Server, full: bool) -> Vec<u32> {
        let n = srv.ready(full);
        (0..n).map(|i| srv.ready_slot(i)).collect()
    }

    #[test]
    fn a_sweep_looks_at_the_slots_whose_bits_are_set_and_a_full_one_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let (mut srv, client) = setup(dir.path());
        assert!(!srv.pending());
        assert!(ready_slots(&mut srv, false).is_empty());
        publish(&client, 3, 1, true);
        publish(&client, 66, 1, true);
        // A request without its bit: not seen by a bit sweep, but by the
        // park check and by a full sweep.
        publish(&client, 9, 1, false);
        assert!(srv.pending());
        assert_eq!(ready_slots(&mut srv, false), [3, 66]);
        // The bits were taken.
        assert_eq!(client.u64(layout::H_PENDING).load(Ordering::SeqCst), 0);
        assert_eq!(client.u64(layout::H_PENDING + 8).load(Ordering::SeqCst), 0);
        for s in [3, 66] {
            assert_eq!(srv.take(s, 0, 0).map(|t| t.len), Some(3));
        }
        assert!(srv.pending(), "slot 9 still waits");
        assert_eq!(ready_slots(&mut srv, true), [9]);
        assert!(srv.take(9, 0, 0).is_some());
        assert!(!srv.pending());
    }

    fn state(r: &Region, slot: u32) -> u32 {
        r.u32(r.geometry().slot_offset(slot) + layout::S_STATE)
            .load(Ordering::SeqCst)
    }

    #[test]
    fn a_leased_slot_lives_with_its_connection_whatever_pid_checks_say() {
        let dir = tempfile::tempdir().unwrap();
        let (mut srv, client) = setup(dir.path());
        let agent = std::process::id();
        let a = srv.lease(5).unwrap();
        let b = srv.lease(6).unwrap();
        assert_ne!(a, b);
        assert_eq!((state(&client, a), state(&client, b)), (agent, agent));
        // Neither the shard's sweep nor a client's pid check takes it.
        assert!(srv.reclaim_dead().is_empty());
        assert!(!reclaim_if_dead(&client, a));
        // A slot that says it is leased but is not is garbage: freed.
        let fake = (0..70)
            .find(|&s| state(&client, s) == layout::FREE)
            .unwrap();
        client
            .u32(client.geometry().slot_offset(fake) + layout::S_STATE)
            .store(agent, Ordering::SeqCst);
        assert_eq!(srv.reclaim_dead(), [fake]);
        // The connection closes: its slot, and only its, is free.
        assert_eq!(srv.end_leases(5), [a]);
        assert_eq!(
            (state(&client, a), state(&client, b)),
            (layout::FREE, agent)
        );
        assert!(srv.end_leases(5).is_empty());
        assert_eq!(srv.counts.reclaimed, 2);
    }

    #[test]
    fn a_full_region_leases_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (mut srv, _client) = setup(dir.path());
        for conn in 0..70 {
            assert!(srv.lease(conn).is_some());
        }
        assert_eq!(srv.lease(70), None);
    }

    #[test]
    fn stale_or_garbage_bits_name_nothing_to_take() {
        let dir = tempfile::tempdir().unwrap();
        let (mut srv, client) = setup(dir.path());
        publish(&client, 5, 1, true);
        assert_eq!(ready_slots(&mut srv, false), [5]);
        assert!(srv.take(5, 0, 0).is_some());
        // The bit set again with no new request, and bits past slot 69.
        client
            .u64(layout::H_PENDING)
            .fetch_or(1 << 5, Ordering::SeqCst);
        client
            .u64(layout::H_PENDING + 8)
            .store(u64::MAX, Ordering::SeqCst);
        assert_eq!(ready_slots(&mut srv, false), [5, 64, 65, 66, 67, 68, 69]);
        for s in [5, 64, 65, 66, 67, 68, 69] {
            assert_eq!(srv.take(s, 0, 0), None);
        }
        // Taken: the next park check finds nothing.
        assert!(!srv.pending());
    }
}
