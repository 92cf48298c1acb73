//! A client thread's side of a region: claim a slot, publish a request,
//! wait for its answer (spin briefly, nap, then sleep on a futex: see
//! [`super::wait`]), ring the
//! shard's doorbell while the shard is parked, and whatever it says once
//! the answer is late ([`super::wait::RING_ANYWAY`]). It knows nothing of
//! heartbeats: the caller gives it the region's path, the pid the
//! heartbeat names, and a doorbell to ring. A slot is claimed by pid
//! ([`Attachment::claim`]) or leased over the agent's local socket
//! ([`Attachment::leased`], see [`super::lease`]: the caller makes the
//! connection, the attachment holds it as long as the slot).

use std::cell::Cell;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::layout;
use super::region::Region;
use super::serve::reclaim_if_dead;
use super::wait;
use lbagent_host::udp::realtime_ns;

/// While asleep, a client wakes this often to ring the doorbell again if
/// the shard still sleeps (a doorbell datagram can be lost).
pub const RING_AGAIN: Duration = Duration::from_millis(20);

/// How long a report waits, at most, for the slot's previous request to
/// be consumed before it goes by UDP instead.
pub const REPORT_WAIT: Duration = Duration::from_millis(50);

/// A call's timeout, and its start read from the clock only when it is
/// first needed (by a wait past its first spins, an error's elapsed time,
/// a retry, the UDP path): a call answered within its spins reads no
/// clock. Two precise clock reads a call (its start, for the deadline, and
/// the start of the wait) were about a tenth of a busy client thread's
/// core (perf, 30 threads on one core). The timeout therefore counts from
/// that first read, a few spins after the call began. One per call,
/// shared by the steps of the call (`&Due`).
#[derive(Debug)]
pub struct Due {
    timeout: Duration,
    start: Cell<Option<Instant>>,
}

impl Due {
    /// A call of `timeout`, its start not read yet.
    pub fn after(timeout: Duration) -> Due {
        Due {
            timeout,
            start: Cell::new(None),
        }
    }

    /// The call's start: now, the first time it is asked.
    pub fn start(&self) -> Instant {
        match self.start.get() {
            Some(t) => t,
            None => {
                let now = Instant::now();
                self.start.set(Some(now));
                now
            }
        }
    }

    /// The call's deadline: its start plus its timeout.
    pub fn deadline(&self) -> Instant {
        self.start() + self.timeout
    }

    /// How long since the call's start.
    pub fn elapsed(&self) -> Duration {
        self.start().elapsed()
    }

    /// How long until the deadline (zero once past).
    pub fn remaining(&self) -> Duration {
        self.deadline().saturating_duration_since(Instant::now())
    }
}

/// The placement byte of a cell placed inline or not.
fn place(inline: bool) -> u8 {
    if inline {
        layout::PLACE_INLINE
    } else {
        layout::PLACE_DATA
    }
}

/// Why an exchange through the region failed.
#[derive(Debug, PartialEq, Eq)]
pub enum ShmFailure {
    /// The agent closed the region or another agent replaced it: detach
    /// and use UDP.
    Closed,
    /// No answer before the deadline.
    TimedOut,
    /// The shard consumed the request without an answer (it did not decode).
    Dropped,
    /// The response cell holds a length out of range.
    Garbage(String),
}

/// A claimed slot of a mapped region.
pub struct Attachment {
    region: Region,
    slot: u32,
    /// The slot's state word while it is ours: this process's pid, or the
    /// agent's for a leased slot.
    pid: u32,
    /// The connection that holds a leased slot (closed when dropped: the
    /// shard then frees the slot).
    lease: Option<UnixStream>,
    /// Ring the doorbell over the lease's connection (the shard's UDP
    /// port is out of reach).
    ring_over_lease: bool,
    /// The last request sequence published.
    seq: u32,
    /// The last request published expects no answer and may not have been
    /// consumed yet.
    unacked: bool,
    /// The last request rang the doorbell: the shard was parked, so it
    /// will be slower than a nap and idle enough to wake the client.
    rang: bool,
    /// How long recent answers took ([`wait::smooth`]).
    recent: Duration,
}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attachment")
            .field("region", &self.region)
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl Attachment {
    /// Maps the region at `path`, checks that agent `agent_pid` made it
    /// and still serves it, and claims a free slot (or one whose owner
    /// died) by pid.
    ///
    /// # Errors
    /// Why the region cannot be used, in words.
    pub fn attach(path: &Path, agent_pid: u32) -> Result<Attachment, String> {
        let (region, _) = Self::open(path, agent_pid)?;
        Self::claim(region)
    }

    /// Maps the region at `path` and checks that agent `agent_pid` made it
    /// and still serves it; returns it and its file, open read-write (what
    /// a lease passes to the agent).
    ///
    /// # Errors
    /// Why the region cannot be used, in words.
    pub fn open(path: &Path, agent_pid: u32) -> Result<(Region, File), String> {
        let (region, file) = Region::open_file(path).map_err(|e| e.to_string())?;
        if region.identity().pid != agent_pid {
            return Err(format!(
                "{} was made by pid {}, the heartbeat names pid {agent_pid}",
                path.display(),
                region.identity().pid
            ));
        }
        if region.u32(layout::H_CLOSED).load(Ordering::Acquire) != 0 {
            return Err(format!("{} is closed", path.display()));
        }
        Ok((region, file))
    }

    /// Whether the shard serving this slot reads node hints
    /// ([`layout::FEAT_NODE_HINT`]): only then may a request carry
    /// [`super::fixed::FLAG_HINT`].
    pub fn reads_hints(&self) -> bool {
        self.region.features() & layout::FEAT_NODE_HINT != 0
    }

    /// Whether the agent that made `region` leases its slots over its
    /// local socket ([`layout::FEAT_LEASE`]).
    pub fn leases(region: &Region) -> bool {
        region.features() & layout::FEAT_LEASE != 0
    }

    /// Takes `slot` of `region`, which the agent leased to the connection
    /// `conn` (this process made it, passing the region's file): the slot
    /// is held while `conn` is open, whatever pid namespace this process
    /// runs in.
    ///
    /// # Errors
    /// The slot is out of range or not leased (its state is not the
    /// agent's pid).
    pub fn leased(region: Region, slot: u32, conn: UnixStream) -> Result<Attachment, String> {
        if slot >= region.geometry().slots {
            return Err(format!(
                "{}: the agent leased slot {slot} of {}",
                region.path().display(),
                region.geometry().slots
            ));
        }
        let agent = region.identity().pid;
        let base = region.geometry().slot_offset(slot);
        if region.u32(base + layout::S_STATE).load(Ordering::Acquire) != agent {
            return Err(format!(
                "{}: slot {slot} is not leased to this client",
                region.path().display()
            ));
        }
        let seq = region.u32(base + layout::S_REQ_SEQ).load(Ordering::Acquire);
        Ok(Attachment {
            region,
            slot,
            pid: agent,
            lease: Some(conn),
            ring_over_lease: false,
            seq,
            unacked: false,
            rang: false,
            recent: Duration::ZERO,
        })
    }

    /// Claims a free slot of `region` (or one whose owner died) for this
    /// process, by its pid.
    ///
    /// # Errors
    /// Every slot is taken.
    pub fn claim(region: Region) -> Result<Attachment, String> {
        let path = region.path().to_path_buf();
        let pid = std::process::id();
        let slots = region.geometry().slots;
        // Start at a random slot so threads of many processes do not all
        // race for slot 0.
        let start = fastrand::u32(..slots);
        for pass in 0..2 {
            for k in 0..slots {
                let slot = (start + k) % slots;
                let base = region.geometry().slot_offset(slot);
                if pass == 1 {
                    reclaim_if_dead(&region, slot);
                }
                let state = region.u32(base + layout::S_STATE);
                if state
                    .compare_exchange(layout::FREE, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    region
                        .u32(base + layout::S_SLEEPING)
                        .store(0, Ordering::Relaxed);
                    let seq = region.u32(base + layout::S_REQ_SEQ).load(Ordering::Acquire);
                    // A request of the previous owner may be unanswered:
                    // the next one waits for its own sequence anyway.
                    return Ok(Attachment {
                        region,
                        slot,
                        pid,
                        lease: None,
                        ring_over_lease: false,
                        seq,
                        unacked: false,
                        rang: false,
                        recent: Duration::ZERO,
                    });
                }
            }
        }
        Err(format!("{}: all {slots} slots are taken", path.display()))
    }

    /// Whether the slot is leased over the local socket.
    pub fn is_leased(&self) -> bool {
        self.lease.is_some()
    }

    /// Rings the doorbell over the lease's connection ([`super::lease::RING_FRAME`])
    /// instead of calling the caller's doorbell, when `on` and the slot is
    /// leased (for a client whose UDP cannot reach the shard).
    pub fn ring_over_lease(&mut self, on: bool) {
        self.ring_over_lease = on && self.lease.is_some();
    }

    /// Whether the doorbell goes over the lease's connection
    /// ([`Attachment::ring_over_lease`]).
    pub fn rings_over_lease(&self) -> bool {
        self.ring_over_lease
    }

    /// Rings the shard: over the lease's connection, or `doorbell`.
    fn ring(&self, doorbell: &mut dyn FnMut()) {
        match &self.lease {
            Some(conn) if self.ring_over_lease => {
                // A full socket buffer already holds a doorbell.
                let _ = nix::sys::socket::send(
                    conn.as_raw_fd(),
                    &super::lease::RING_FRAME,
                    nix::sys::socket::MsgFlags::MSG_NOSIGNAL
                        | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
                );
            }
            _ => doorbell(),
        }
    }

    fn base(&self) -> usize {
        self.region.geometry().slot_offset(self.slot)
    }

    /// True while the slot is still ours and the agent serves the region.
    fn usable(&self) -> bool {
        self.region.u32(layout::H_CLOSED).load(Ordering::Relaxed) == 0
            && self
                .region
                .u32(self.base() + layout::S_STATE)
                .load(Ordering::Relaxed)
                == self.pid
    }

    /// Publishes `req` (an encoded request, FlatBuffers or a record of the
    /// fixed layout as `format` says); `answer` says whether one is
    /// expected. Rings `doorbell` if the shard is parked. Waits first, until
    /// `due`, for the previous request to be consumed if it expected no
    /// answer.
    ///
    /// # Errors
    /// [`ShmFailure::Closed`], [`ShmFailure::TimedOut`] (the previous request
    /// was not consumed in time).
    pub fn post(
        &mut self,
        req: &[u8],
        format: u8,
        answer: bool,
        due: &Due,
        doorbell: &mut dyn FnMut(),
    ) -> Result<u32, ShmFailure> {
        if !self.usable() {
            return Err(ShmFailure::Closed);
        }
        if req.is_empty() || req.len() > self.region.geometry().req_cap {
            // Not a request the slot can hold: the caller goes by UDP.
            return Err(ShmFailure::Closed);
        }
        let base = self.base();
        let word = self.region.u32(base + layout::S_REQ_SEQ);
        // A report not read yet: take it back and send it again in front
        // of this request (one cell, one sweep); read already: wait for
        // the shard to finish it (it is handling it now).
        let mut split = 0;
        let mut first_format = layout::FMT_FLATBUFFERS;
        // A cell small enough goes in the slot's first two lines, in a
        // region whose shard reads it there.
        let features = self.region.features();
        let mut inline = features & layout::FEAT_INLINE != 0 && req.len() <= layout::INLINE_CAP;
        if self.unacked {
            let resp = self.region.u32(base + layout::S_RESP_SEQ);
            let report_len = self
                .region
                .u32(base + layout::S_REQ_LEN)
                .load(Ordering::Relaxed) as usize;
            // Only a report alone in its cell (not one already carried in
            // front of another) is taken back, and only if both fit.
            let alone = self
                .region
                .u32(base + layout::S_REQ_SPLIT)
                .load(Ordering::Relaxed)
                == 0;
            let fits = alone && report_len + req.len() <= self.region.geometry().req_cap;
            let report_format = self
                .region
                .u32(base + layout::S_REQ_FORMAT)
                .load(Ordering::Relaxed);
            // Where this client put it (it wrote the word itself).
            let report_inline = report_format >> 16 & 0xff == u32::from(layout::PLACE_INLINE);
            if resp.load(Ordering::Acquire) != self.seq
                && fits
                && word
                    .compare_exchange(
                        self.seq,
                        self.seq | layout::TAKEN,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                split = report_len;
                // The report's own format (this client wrote it, alone).
                first_format = report_format as u8;
                inline = report_inline && split + req.len() <= layout::INLINE_CAP;
                if report_inline && !inline {
                    // Too long together for the inline bytes: the report
                    // moves to the request area, where the request follows.
                    let mut moved = [0u8; layout::INLINE_CAP];
                    self.region.copy_out_inline(base, &mut moved);
                    self.region.copy_in(base + layout::S_DATA, &moved[..split]);
                }
            } else {
                let took = self.wait_seq(self.seq, due, doorbell)?;
                self.recent = wait::smooth(self.recent, took);
            }
            self.unacked = false;
        }
        self.seq = layout::next_seq(self.seq);
        if inline {
            self.copy_in_inline(split, req);
        } else {
            self.region.copy_in(base + layout::S_DATA + split, req);
        }
        self.region
            .u32(base + layout::S_REQ_LEN)
            .store((split + req.len()) as u32, Ordering::Relaxed);
        self.region
            .u32(base + layout::S_REQ_SPLIT)
            .store(split as u32, Ordering::Relaxed);
        self.region.u32(base + layout::S_REQ_FORMAT).store(
            layout::req_format(format, first_format, place(inline)),
            Ordering::Relaxed,
        );
        // The stamp, only for a shard that reads it (queuing times).
        if features & layout::FEAT_NO_STAMP == 0 {
            self.region
                .u64(base + layout::S_REQ_STAMP)
                .store(realtime_ns(), Ordering::Relaxed);
        }
        word.store(self.seq, Ordering::SeqCst);
        // Then the slot's pending bit: a shard that takes the bit finds
        // the sequence (stored before it); one that parks meanwhile sees
        // the bit, or this client sees it parked (both SeqCst).
        let (off, bit) = layout::pending_bit(self.slot);
        self.region.u64(off).fetch_or(bit, Ordering::SeqCst);
        self.unacked = !answer;
        // A report taken back carries its doorbell over: the shard it woke
        // is still on its way.
        let carried = split > 0 && self.rang;
        self.rang = self.ring_if_parked(doorbell) || carried;
        Ok(self.seq)
    }

    /// Writes `src` at byte `at` of the slot's inline cell
    /// ([`layout::inline_offset`]; `at + src.len()` at most
    /// [`layout::INLINE_CAP`]).
    fn copy_in_inline(&self, at: usize, src: &[u8]) {
        let base = self.base();
        let first = src.len().min(layout::INLINE_A.saturating_sub(at));
        let (a, b) = src.split_at(first);
        if !a.is_empty() {
            self.region.copy_in(base + layout::inline_offset(at), a);
        }
        if !b.is_empty() {
            self.region
                .copy_in(base + layout::inline_offset(at + first), b);
        }
    }

    /// Rings `doorbell` if the shard is parked; true if it did.
    fn ring_if_parked(&self, doorbell: &mut dyn FnMut()) -> bool {
        let parked = self.region.u32(layout::H_PARKED);
        let ring = parked.load(Ordering::SeqCst) != 0 && parked.swap(0, Ordering::SeqCst) != 0;
        if ring {
            self.ring(doorbell);
        }
        ring
    }

    /// Waits until the response sequence is `seq` or `due` passes;
    /// returns how long it waited (zero if answered within the first
    /// spins, before any clock read: the wait is timed from the first
    /// read, after them).
    fn wait_seq(
        &self,
        seq: u32,
        due: &Due,
        doorbell: &mut dyn FnMut(),
    ) -> Result<Duration, ShmFailure> {
        let base = self.base();
        let resp = self.region.u32(base + layout::S_RESP_SEQ);
        let mut started: Option<Instant> = None;
        let plan = wait::plan(self.recent);
        let mut spins = 0u32;
        // When this client last rang whatever `parked` said.
        let mut rang_anyway: Option<Duration> = None;
        loop {
            let seen = resp.load(Ordering::Acquire);
            if seen == seq {
                // Answered within the first spins: no clock read.
                return Ok(started.map_or(Duration::ZERO, |s| s.elapsed()));
            }
            spins += 1;
            if spins % 64 != 0 {
                std::hint::spin_loop();
                continue;
            }
            if !self.usable() {
                return Err(ShmFailure::Closed);
            }
            let now = Instant::now();
            let start = *started.get_or_insert(now);
            let deadline = due.deadline();
            if now >= deadline {
                return Err(ShmFailure::TimedOut);
            }
            let waited = now - start;
            if waited < wait::SPIN {
                std::hint::spin_loop();
                continue;
            }
            if !self.rang && waited < plan.naps_for {
                // A nap the shard need not end (it pays no wake).
                self.ring_if_parked(doorbell);
                self.region.futex_wait(
                    base + layout::S_RESP_SEQ,
                    seen,
                    plan.nap.min(deadline - now),
                );
                continue;
            }
            let sleeping = self.region.u32(base + layout::S_SLEEPING);
            sleeping.store(1, Ordering::SeqCst);
            let seen = resp.load(Ordering::SeqCst);
            if seen == seq {
                sleeping.store(0, Ordering::Relaxed);
                return Ok(start.elapsed());
            }
            if !self.ring_if_parked(doorbell) && wait::ring_anyway(waited, rang_anyway, RING_AGAIN)
            {
                // `parked` may lie (any group member can write it): an
                // answer this late means the shard may well be asleep.
                self.ring(doorbell);
                rang_anyway = Some(waited);
            }
            let until_bound = match rang_anyway {
                None if waited < wait::RING_ANYWAY => wait::RING_ANYWAY - waited,
                _ => RING_AGAIN,
            };
            let nap = (deadline - now).min(until_bound);
            self.region.futex_wait(base + layout::S_RESP_SEQ, seen, nap);
        }
    }

    /// Waits for the answer to request `seq` until `due` and copies
    /// it into `buf` (resized); returns its length and its format
    /// ([`layout::FMT_FLATBUFFERS`] or [`layout::FMT_FIXED`]).
    ///
    /// # Errors
    /// [`ShmFailure::TimedOut`], [`ShmFailure::Closed`],
    /// [`ShmFailure::Dropped`], [`ShmFailure::Garbage`].
    pub fn wait(
        &mut self,
        seq: u32,
        due: &Due,
        buf: &mut Vec<u8>,
        doorbell: &mut dyn FnMut(),
    ) -> Result<(usize, u8), ShmFailure> {
        let took = self.wait_seq(seq, due, doorbell)?;
        self.recent = wait::smooth(self.recent, took);
        let base = self.base();
        let raw = self
            .region
            .u32(base + layout::S_RESP_LEN)
            .load(Ordering::Relaxed);
        let cap = self.region.geometry().resp_cap;
        let word = self
            .region
            .u32(base + layout::S_RESP_FORMAT)
            .load(Ordering::Relaxed);
        let Some((format, inline)) = layout::resp_formats(word) else {
            return Err(ShmFailure::Garbage(format!(
                "a response format word of {word:#x} (0 or 1, or an inline record 0x101)"
            )));
        };
        let cap = if inline { layout::INLINE_B } else { cap };
        let len = match layout::response_len(raw, cap) {
            Some(Some(n)) => n,
            Some(None) => return Err(ShmFailure::Dropped),
            None => {
                return Err(ShmFailure::Garbage(format!(
                    "a response length of {raw} bytes in a {cap}-byte cell"
                )))
            }
        };
        if buf.len() < len {
            buf.resize(len, 0);
        }
        let at = if inline {
            base + layout::S_INLINE_B
        } else {
            self.region.geometry().resp_offset(self.slot)
        };
        self.region.copy_out(at, &mut buf[..len]);
        fence(Ordering::Acquire);
        Ok((len, format))
    }
}

impl Drop for Attachment {
    /// Gives the slot back (if it is still ours); a leased slot goes back
    /// when its connection, dropped with it, closes.
    fn drop(&mut self) {
        if self.lease.is_some() {
            return;
        }
        let base = self.base();
        let _ = self.region.u32(base + layout::S_STATE).compare_exchange(
            self.pid,
            layout::FREE,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}
