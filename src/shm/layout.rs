//! The shared-memory region's layout and the pure checks on what is read
//! from it. A region belongs to one shard: a header page, then `slots`
//! slots of `slot_size` bytes at fixed offsets. Every word is native-endian
//! (the file never leaves the host) and accessed only through atomics.
//!
//! # Header (page 0)
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 4 | magic, [`MAGIC`] (`"LBSR"` on a little-endian host) |
//! | 4 | 4 | layout version, [`VERSION`] |
//! | 8 | 4 | shard index |
//! | 12 | 4 | agent pid |
//! | 16 | 4 | slot count |
//! | 20 | 4 | slot size, bytes |
//! | 24 | 4 | request capacity, bytes |
//! | 28 | 4 | response capacity, bytes |
//! | 32 | 8 | boot id: random per agent start |
//! | 40 | 4 | closed: 1 once the agent stopped serving the region |
//! | 44 | 4 | features: bit 0 [`FEAT_LEASE`] (slots are leased over the agent's local socket), bit 1 [`FEAT_NODE_HINT`] (the shard reads node hints in fixed records), bit 2 [`FEAT_NO_STAMP`] (the shard reads no request stamps), bit 3 [`FEAT_INLINE`] (the shard reads requests and writes fixed answers in the slot's first two cache lines); 0 from an agent before them |
//! | 64 | 4 | parked: 1 while the shard sleeps (its own cache line) |
//! | 128 | 8 × ⌈slots / 64⌉ | pending: bit `s % 64` of word `s / 64` set by slot `s`'s client after it publishes a request; the shard takes each word (swap to 0) and looks only at those slots |
//!
//! # Slot
//!
//! | offset | size | field | written by |
//! |---:|---:|---|---|
//! | 0 | 4 | state: [`FREE`], else the owner's pid, or the agent's own pid (the header's) for a slot the shard leased to a local-socket connection ([`super::lease`]) | client (CAS), shard (lease, reclaim, CAS) |
//! | 8 | 4 | reserved (0) | |
//! | 12 | 4 | sleeping: 1 while the client waits on a futex | client, shard |
//! | 16 | 4 | request sequence (31 bits, +1 per request published) and [`TAKEN`] | client, shard (CAS) |
//! | 20 | 4 | request length | client |
//! | 24 | 8 | request stamp, `CLOCK_REALTIME` ns (not written while the header has [`FEAT_NO_STAMP`]) | client |
//! | 32 | 4 | split: 0, or the length of a first datagram (a report) before the request | client |
//! | 36 | 4 | request format: byte 0 the request's, byte 1 the first datagram's ([`FMT_FLATBUFFERS`] or [`FMT_FIXED`]), byte 2 where the cell's bytes are ([`PLACE_DATA`], or [`PLACE_INLINE`] in a region with [`FEAT_INLINE`]); byte 3 0 | client |
//! | 40 | 24 | inline bytes 0–23 of a cell placed [`PLACE_INLINE`] | client |
//! | 64 | 4 | response sequence: the request sequence answered | shard |
//! | 68 | 4 | response length ([`NO_ANSWER`]: consumed, nothing to say) | shard |
//! | 72 | 4 | response format: byte 0 [`FMT_FLATBUFFERS`] or [`FMT_FIXED`], byte 1 where the answer is ([`PLACE_DATA`], or [`PLACE_INLINE`] for a fixed answer to a request placed so); other bytes 0 | shard |
//! | 80 | 48 | inline bytes 24–71 of a cell placed [`PLACE_INLINE`]; then its answer, if placed so | client, then shard |
//! | 128 | req cap | request bytes: a FlatBuffers datagram, as over UDP, or a getHost / report record of [`super::fixed`] | client |
//! | 128 + req cap | resp cap | response bytes: FlatBuffers, or a getHost answer record | shard |
//!
//! **Inline cells** ([`FEAT_INLINE`]). A round trip through the slot moves
//! cache lines between the client's core and the shard's: the slot's first
//! line (the request's sequence and format; the shard's compare-and-swap),
//! its second (the response's sequence), the pending word's, and the
//! lines of the request and response areas. A cell of at most
//! [`INLINE_CAP`] bytes (a getHost record, a report, or the two in one
//! cell) may instead go in the unused bytes of the first two lines
//! ([`S_INLINE_A`], then [`S_INLINE_B`]), and its fixed answer in the second
//! line, which its client reads anyway: two lines fewer each way.
//!
//! Nothing read from a slot is trusted by the shard: lengths are bounded
//! here ([`request_len`]), pids are checked ([`owner_pid`]), and the bytes
//! are copied out before they are decoded.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

/// The header's magic word: the bytes `"LBSR"` read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"LBSR");
/// The layout version this code writes and reads (2: clients set the
/// pending bits, which version 1 had not; 3: the format words, and getHost
/// and report in the fixed layout of [`super::fixed`]).
pub const VERSION: u32 = 3;
/// The header's size: one page; slot 0 starts here.
pub const HEADER_LEN: usize = 4096;

/// Header offsets.
pub const H_MAGIC: usize = 0;
/// See the table.
pub const H_VERSION: usize = 4;
/// See the table.
pub const H_SHARD: usize = 8;
/// See the table.
pub const H_PID: usize = 12;
/// See the table.
pub const H_SLOTS: usize = 16;
/// See the table.
pub const H_SLOT_SIZE: usize = 20;
/// See the table.
pub const H_REQ_CAP: usize = 24;
/// See the table.
pub const H_RESP_CAP: usize = 28;
/// See the table.
pub const H_BOOT: usize = 32;
/// See the table.
pub const H_CLOSED: usize = 40;
/// See the table.
pub const H_FEATURES: usize = 44;
/// See the table.
pub const H_PARKED: usize = 64;

/// The features word's bit that says the agent leases slots over its local
/// socket ([`super::lease`]). The layout stays version 3: the word was 0
/// in every region made before it, and a client that does not read it
/// claims by pid as before.
pub const FEAT_LEASE: u32 = 1;
/// The features word's bit that says the shard reads the node hint of the
/// fixed records ([`super::fixed`]'s [`super::fixed::FLAG_HINT`]): a
/// client may ask for it and hand it back. The layout stays version 3: a
/// client that does not read the bit sends no hint, and an agent before it
/// leaves the bit 0, so no client sends it a flag it would refuse.
pub const FEAT_NODE_HINT: u32 = 2;
/// The features word's bit that says the shard reads no request stamps
/// (it measures no queuing times: neither `agent.queuing_time` nor
/// shedding is on), so a client need not read the realtime clock for
/// each request (a clock read was about 6% of a busy client thread's
/// core, perf). A bit that says what the shard does *not* do: an agent
/// before it leaves it 0, and its clients keep stamping.
pub const FEAT_NO_STAMP: u32 = 4;
/// The features word's bit that says the shard reads cells placed
/// [`PLACE_INLINE`] and answers a fixed record to one in the slot's second
/// line. A client places a cell inline only in a region with this bit (an
/// agent before it refuses the placement byte as garbage), and only a
/// request placed inline gets an inline answer (a client before it never
/// sees one).
pub const FEAT_INLINE: u32 = 8;
/// See the table: the first pending word.
pub const H_PENDING: usize = 128;

// `parked` keeps a cache line of its own; the pending words of the most
// slots fit in the header page.
const _: () = assert!(H_PENDING >= H_PARKED + 64);
const _: () = assert!(H_PENDING + 8 * (MAX_SLOTS as usize).div_ceil(64) <= HEADER_LEN);

/// The offset of the pending word that holds slot `slot`'s bit, and the bit.
pub fn pending_bit(slot: u32) -> (usize, u64) {
    (H_PENDING + 8 * (slot / 64) as usize, 1 << (slot % 64))
}

/// Pending words of a region of `slots` slots.
pub fn pending_words(slots: u32) -> usize {
    slots.div_ceil(64) as usize
}

/// The slots named by the bits of pending word `word` that a region of
/// `slots` slots has, in order (a bit past the last slot is garbage:
/// skipped). Visits the set bits only: a walk over all 64 was two fifths
/// of a shard's instructions per request (callgrind).
pub fn pending_slots(word: usize, bits: u64, slots: u32) -> impl Iterator<Item = u32> {
    let base = word as u64 * 64;
    let mut rest = bits;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let s = base + u64::from(rest.trailing_zeros());
        rest &= rest - 1;
        if s < u64::from(slots) {
            Some(s as u32)
        } else {
            // The bits go up: every later one is past the end too.
            rest = 0;
            None
        }
    })
}

/// Slot offsets.
pub const S_STATE: usize = 0;
/// See the table.
pub const S_SLEEPING: usize = 12;
/// See the table.
pub const S_REQ_SEQ: usize = 16;
/// See the table.
pub const S_REQ_LEN: usize = 20;
/// See the table.
pub const S_REQ_STAMP: usize = 24;
/// See the table.
pub const S_REQ_SPLIT: usize = 32;
/// See the table.
pub const S_REQ_FORMAT: usize = 36;
/// See the table.
pub const S_RESP_SEQ: usize = 64;
/// See the table.
pub const S_RESP_LEN: usize = 68;
/// See the table.
pub const S_RESP_FORMAT: usize = 72;
/// Where the request bytes start.
pub const S_DATA: usize = 128;
/// Where an inline cell's first [`INLINE_A`] bytes are (the rest of the
/// slot's first cache line).
pub const S_INLINE_A: usize = 40;
/// How many bytes of an inline cell the first line holds.
pub const INLINE_A: usize = 24;
/// Where an inline cell's next [`INLINE_B`] bytes are, and an inline
/// answer (the rest of the slot's second cache line).
pub const S_INLINE_B: usize = 80;
/// How many bytes of an inline cell, or of an inline answer, the second
/// line holds.
pub const INLINE_B: usize = 48;
/// The most bytes an inline cell holds.
pub const INLINE_CAP: usize = INLINE_A + INLINE_B;
const _: () = assert!(S_INLINE_A >= S_REQ_FORMAT + 4 && S_INLINE_A + INLINE_A == S_RESP_SEQ);
const _: () = assert!(S_INLINE_B >= S_RESP_FORMAT + 4 && S_INLINE_B + INLINE_B == S_DATA);
// The longest hot cell, a hinted report and a getHost, goes inline, and
// so does the longest fixed answer.
const _: () = assert!(crate::fixed::REPORT_HINTED_LEN + crate::fixed::GET_HOST_LEN <= INLINE_CAP);
const _: () = assert!(crate::fixed::ANSWER_MAX <= INLINE_B);

/// A cell whose bytes are in the request area ([`S_DATA`]), or an answer
/// in the response area.
pub const PLACE_DATA: u8 = 0;
/// A cell whose bytes are in the slot's first two lines ([`S_INLINE_A`],
/// then [`S_INLINE_B`]), or an answer at [`S_INLINE_B`].
pub const PLACE_INLINE: u8 = 1;

/// Where byte `at` of an inline cell is, as an offset in its slot.
pub fn inline_offset(at: usize) -> usize {
    if at < INLINE_A {
        S_INLINE_A + at
    } else {
        S_INLINE_B + at - INLINE_A
    }
}
/// The 32-bit words of a slot's header (its first [`S_DATA`] bytes), as
/// [`super::region::Region::slot`] hands them out: word `S_X / 4` is
/// field `S_X`.
pub const SLOT_WORDS: usize = S_DATA / 4;

/// A cell (or part of one) holding FlatBuffers bytes, as over UDP.
pub const FMT_FLATBUFFERS: u8 = 0;
/// A cell (or part of one) holding a record of [`super::fixed`].
pub const FMT_FIXED: u8 = 1;

/// The request format word for a request of format `request` behind a
/// first datagram of format `first`, its bytes placed `place`.
pub fn req_format(request: u8, first: u8, place: u8) -> u32 {
    u32::from_le_bytes([request, first, place, 0])
}

/// What a request format word says: the formats of the request and of the
/// first datagram, and whether the cell is placed inline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellFormat {
    /// The request's format.
    pub request: u8,
    /// The first datagram's (a report in front of the request).
    pub first: u8,
    /// The cell's bytes are in the slot's first two lines.
    pub inline: bool,
}

/// What a request format word names; `None` for garbage (an unknown
/// format or placement, the last byte not 0).
pub fn formats(word: u32) -> Option<CellFormat> {
    let [request, first, place, 0] = word.to_le_bytes() else {
        return None;
    };
    let known = |f: u8| f == FMT_FLATBUFFERS || f == FMT_FIXED;
    (known(request) && known(first) && (place == PLACE_DATA || place == PLACE_INLINE)).then_some(
        CellFormat {
            request,
            first,
            inline: place == PLACE_INLINE,
        },
    )
}

/// The response format word of an answer of format `format` placed
/// `place`.
pub fn resp_format(format: u8, place: u8) -> u32 {
    u32::from_le_bytes([format, place, 0, 0])
}

/// What a response format word says, `(format, inline)`; `None` for
/// garbage (an unknown format or placement, an inline answer that is no
/// fixed record, a byte past the second not 0).
pub fn resp_formats(word: u32) -> Option<(u8, bool)> {
    match word.to_le_bytes() {
        [f @ (FMT_FLATBUFFERS | FMT_FIXED), PLACE_DATA, 0, 0] => Some((f, false)),
        [FMT_FIXED, PLACE_INLINE, 0, 0] => Some((FMT_FIXED, true)),
        _ => None,
    }
}

/// A slot no client holds.
pub const FREE: u32 = 0;
/// The bit of the request sequence word that says the request is taken:
/// by the shard (a compare-and-swap before it copies the cell, so the
/// client never rewrites a cell being read), or by its client taking back
/// a report nobody read yet, to send it again together with its next
/// request.
pub const TAKEN: u32 = 1 << 31;

/// The request sequence after `seq` (31 bits, never 0).
pub fn next_seq(seq: u32) -> u32 {
    let n = seq.wrapping_add(1) & !TAKEN;
    if n == 0 {
        1
    } else {
        n
    }
}

/// Where a cell of `len` bytes splits into a report and a request: `split`
/// (0: one datagram) if it lies strictly inside, else `None` (garbage).
pub fn split_at(split: u32, len: usize) -> Option<usize> {
    let split = split as usize;
    (split == 0 || split < len).then_some(split)
}

/// The response length that says "consumed, no answer" (a report, or a
/// request the shard dropped).
pub const NO_ANSWER: u32 = u32::MAX;

/// The request capacity: the shard's UDP receive buffer
/// ([`lbagent_host::udp::MAX_REQUEST`]), so a request that fits one fits
/// the other.
pub const REQ_CAP: usize = lbagent_host::udp::MAX_REQUEST;
/// The response capacity: the largest UDP payload, so every answer the
/// shard can send over UDP fits.
pub const RESP_CAP: usize = 65_536;
/// The most slots a region may have (`shm.slots`).
pub const MAX_SLOTS: u32 = 4_096;

/// A region's geometry, as the agent sets it up and a client reads it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Number of slots.
    pub slots: u32,
    /// Bytes per slot (a multiple of the page size).
    pub slot_size: usize,
    /// Request capacity, bytes.
    pub req_cap: usize,
    /// Response capacity, bytes.
    pub resp_cap: usize,
}

impl Geometry {
    /// The geometry of a region with `slots` slots and the standard
    /// capacities; each slot starts on its own page.
    pub fn new(slots: u32) -> Geometry {
        let raw = S_DATA + REQ_CAP + RESP_CAP;
        Geometry {
            slots,
            slot_size: raw.div_ceil(4096) * 4096,
            req_cap: REQ_CAP,
            resp_cap: RESP_CAP,
        }
    }

    /// The region file's length.
    pub fn file_len(&self) -> usize {
        HEADER_LEN + self.slots as usize * self.slot_size
    }

    /// Where slot `i` (< `slots`) starts.
    pub fn slot_offset(&self, i: u32) -> usize {
        debug_assert!(i < self.slots);
        HEADER_LEN + i as usize * self.slot_size
    }

    /// Where slot `i`'s response bytes start.
    pub fn resp_offset(&self, i: u32) -> usize {
        self.slot_offset(i) + S_DATA + self.req_cap
    }

    /// Checks a geometry read from a region's header against the file's
    /// length: what a client maps must be what the header says, and every
    /// slot must lie inside the file.
    ///
    /// # Errors
    /// A description of the first field out of range.
    pub fn from_header(
        slots: u32,
        slot_size: u32,
        req_cap: u32,
        resp_cap: u32,
        file_len: u64,
    ) -> Result<Geometry, String> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(format!("{slots} slots (1..={MAX_SLOTS})"));
        }
        let (slot_size, req_cap, resp_cap) =
            (slot_size as usize, req_cap as usize, resp_cap as usize);
        if req_cap < 64 || resp_cap < 64 {
            return Err(format!(
                "capacities {req_cap}/{resp_cap} bytes (at least 64)"
            ));
        }
        if slot_size % 64 != 0 || S_DATA + req_cap + resp_cap > slot_size {
            return Err(format!(
                "slot size {slot_size} does not hold {S_DATA} + {req_cap} + {resp_cap} bytes \
                 (or is not a multiple of 64)"
            ));
        }
        let need = HEADER_LEN as u64 + u64::from(slots) * slot_size as u64;
        if file_len < need {
            return Err(format!("file of {file_len} bytes, the header needs {need}"));
        }
        Ok(Geometry {
            slots,
            slot_size,
            req_cap,
            resp_cap,
        })
    }
}

/// A request length read from a slot, if it is one the shard may copy:
/// at most the capacity and not zero. `None` is garbage.
pub fn request_len(len: u32, cap: usize) -> Option<usize> {
    let len = len as usize;
    (len > 0 && len <= cap).then_some(len)
}

/// A response length read from a slot by a client: `Some(None)` for
/// [`NO_ANSWER`], `Some(Some(n))` for an answer of n bytes within the
/// capacity, `None` for garbage.
pub fn response_len(len: u32, cap: usize) -> Option<Option<usize>> {
    if len == NO_ANSWER {
        return Some(None);
    }
    let len = len as usize;
    (len > 0 && len <= cap).then_some(Some(len))
}

/// Whether a client or the shard may take back a slot whose state word
/// is `owner` by asking whether that pid lives: not a free slot, and not
/// one leased over the local socket, whose state is the agent's own pid
/// `agent_pid` (the header's; such a slot lives as long as its connection,
/// whatever pid namespace its client runs in).
pub fn pid_checked(owner: u32, agent_pid: u32) -> bool {
    owner != FREE && owner != agent_pid
}

/// The owner pid read from a slot, if it can name a process: 1..=i32::MAX
/// (`kill` reads 0 and negative pids as process groups).
pub fn owner_pid(pid: u32) -> Option<i32> {
    i32::try_from(pid).ok().filter(|&p| p > 0)
}

/// How long a request waited in its slot, µs: from the client's stamp to
/// `now_ns`, but never more than since `visited_ns`, when the shard last
/// looked at the slot and found nothing (so a client's stamp can only
/// shorten its own wait, never make the shard shed for everyone).
pub fn waited_us(now_ns: u64, stamp_ns: u64, visited_ns: u64) -> u64 {
    now_ns
        .saturating_sub(stamp_ns)
        .min(now_ns.saturating_sub(visited_ns))
        / 1000
}

/// The address a slot's requests come "from" inside the shard: 0.0.0.0
/// (never a UDP source) and the slot's index + 1 as the port, so that an
/// answer released later (a waiting register) finds its way back.
pub fn slot_peer(slot: u32) -> SocketAddr {
    debug_assert!(slot < u32::from(u16::MAX));
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, (slot + 1) as u16))
}

/// The slot a [`slot_peer`] address names; `None` for a real UDP peer.
pub fn peer_slot(peer: SocketAddr) -> Option<u32> {
    match peer {
        SocketAddr::V4(v4) if v4.ip().is_unspecified() && v4.port() > 0 => {
            Some(u32::from(v4.port()) - 1)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_puts_every_slot_on_its_own_pages_inside_the_file() {
        let g = Geometry::new(64);
        assert_eq!(g.slot_size % 4096, 0);
        assert!(S_DATA + g.req_cap + g.resp_cap <= g.slot_size);
        assert_eq!(g.slot_offset(0), HEADER_LEN);
        assert_eq!(g.slot_offset(63) + g.slot_size, g.file_len());
        assert_eq!(g.resp_offset(1), g.slot_offset(1) + S_DATA + REQ_CAP);
        let back = Geometry::from_header(
            64,
            g.slot_size as u32,
            g.req_cap as u32,
            g.resp_cap as u32,
            g.file_len() as u64,
        );
        assert_eq!(back, Ok(g));
    }

    #[test]
    fn a_header_that_does_not_fit_its_file_is_refused() {
        let g = Geometry::new(4);
        let (s, r, p) = (g.slot_size as u32, g.req_cap as u32, g.resp_cap as u32);
        let len = g.file_len() as u64;
        assert!(Geometry::from_header(0, s, r, p, len)
            .unwrap_err()
            .contains("0 slots"));
        assert!(Geometry::from_header(MAX_SLOTS + 1, s, r, p, u64::MAX).is_err());
        assert!(Geometry::from_header(5, s, r, p, len)
            .unwrap_err()
            .contains("needs"));
        assert!(Geometry::from_header(4, s, r, p + s, len).is_err());
        assert!(Geometry::from_header(4, s + 1, r, p, len + 64).is_err());
        assert!(Geometry::from_header(4, s, 0, p, len).is_err());
        // u32::MAX slots of u32::MAX bytes: no overflow, refused.
        assert!(Geometry::from_header(u32::MAX, u32::MAX, r, p, u64::MAX).is_err());
    }

    #[test]
    fn pending_bits_fit_the_header_and_name_only_real_slots() {
        assert!(H_PENDING + 8 * pending_words(MAX_SLOTS) <= HEADER_LEN);
        assert_eq!(pending_words(1), 1);
        assert_eq!(pending_words(64), 1);
        assert_eq!(pending_words(65), 2);
        assert_eq!(pending_bit(0), (H_PENDING, 1));
        assert_eq!(pending_bit(63), (H_PENDING, 1 << 63));
        assert_eq!(pending_bit(64), (H_PENDING + 8, 1));
        for s in [0, 5, 63, 64, 100, MAX_SLOTS - 1] {
            let (off, bit) = pending_bit(s);
            let word = (off - H_PENDING) / 8;
            assert_eq!(pending_slots(word, bit, MAX_SLOTS).collect::<Vec<_>>(), [s]);
        }
        // Bits past the last slot (a client's garbage) name nothing.
        assert_eq!(
            pending_slots(1, u64::MAX, 70).collect::<Vec<_>>(),
            [64, 65, 66, 67, 68, 69]
        );
        assert_eq!(pending_slots(2, u64::MAX, 70).count(), 0);
    }

    #[test]
    fn lengths_from_a_slot_are_bounded() {
        assert_eq!(request_len(0, 100), None);
        assert_eq!(request_len(100, 100), Some(100));
        assert_eq!(request_len(101, 100), None);
        assert_eq!(request_len(u32::MAX, 100), None);
        assert_eq!(response_len(NO_ANSWER, 100), Some(None));
        assert_eq!(response_len(7, 100), Some(Some(7)));
        assert_eq!(response_len(0, 100), None);
        assert_eq!(response_len(1000, 100), None);
    }

    #[test]
    fn sequences_stay_below_the_taken_bit_and_skip_0() {
        assert_eq!(next_seq(1), 2);
        assert_eq!(next_seq(TAKEN - 1), 1);
        assert_eq!(next_seq(5 | TAKEN), 6);
        assert_eq!(split_at(0, 10), Some(0));
        assert_eq!(split_at(4, 10), Some(4));
        assert_eq!(split_at(10, 10), None);
        assert_eq!(split_at(u32::MAX, 10), None);
    }

    #[test]
    fn inline_cells_fill_the_first_two_lines_around_their_words() {
        let offsets: Vec<usize> = (0..INLINE_CAP).map(inline_offset).collect();
        assert_eq!(offsets[0], S_INLINE_A);
        assert_eq!(offsets[INLINE_A - 1], S_RESP_SEQ - 1);
        assert_eq!(offsets[INLINE_A], S_INLINE_B);
        assert_eq!(offsets[INLINE_CAP - 1], S_DATA - 1);
        // No word of the slot's header is under an inline byte.
        for w in [
            S_STATE,
            S_SLEEPING,
            S_REQ_SEQ,
            S_REQ_LEN,
            S_REQ_SPLIT,
            S_REQ_FORMAT,
            S_RESP_SEQ,
            S_RESP_LEN,
            S_RESP_FORMAT,
        ] {
            assert!(!offsets.iter().any(|&o| (w..w + 4).contains(&o)), "{w}");
        }
        assert!(!offsets
            .iter()
            .any(|&o| (S_REQ_STAMP..S_REQ_STAMP + 8).contains(&o)));
        // Two lines: the first and the second of the slot.
        assert!(offsets.iter().all(|&o| o < 2 * 64));
    }

    #[test]
    fn response_format_words_name_inline_fixed_answers_only() {
        assert_eq!(resp_formats(0), Some((FMT_FLATBUFFERS, false)));
        assert_eq!(resp_formats(1), Some((FMT_FIXED, false)));
        assert_eq!(
            resp_formats(resp_format(FMT_FIXED, PLACE_INLINE)),
            Some((FMT_FIXED, true))
        );
        assert_eq!(
            resp_formats(resp_format(FMT_FLATBUFFERS, PLACE_INLINE)),
            None
        );
        assert_eq!(resp_formats(resp_format(FMT_FIXED, 2)), None);
        assert_eq!(resp_formats(2), None);
        assert_eq!(resp_formats(1 << 16), None);
        assert_eq!(resp_formats(u32::MAX), None);
    }

    #[test]
    fn format_words_name_known_formats_only() {
        for r in [FMT_FLATBUFFERS, FMT_FIXED] {
            for f in [FMT_FLATBUFFERS, FMT_FIXED] {
                for (place, inline) in [(PLACE_DATA, false), (PLACE_INLINE, true)] {
                    assert_eq!(
                        formats(req_format(r, f, place)),
                        Some(CellFormat {
                            request: r,
                            first: f,
                            inline
                        })
                    );
                }
            }
        }
        assert_eq!(
            formats(0),
            Some(CellFormat {
                request: FMT_FLATBUFFERS,
                first: FMT_FLATBUFFERS,
                inline: false
            })
        );
        assert_eq!(formats(2), None);
        assert_eq!(formats(2 << 8), None);
        assert_eq!(formats(2 << 16), None);
        assert_eq!(formats(1 << 24), None);
        assert_eq!(formats(u32::MAX), None);
    }

    #[test]
    fn only_real_pids_are_pids() {
        assert_eq!(owner_pid(0), None);
        assert_eq!(owner_pid(1), Some(1));
        assert_eq!(owner_pid(i32::MAX as u32), Some(i32::MAX));
        assert_eq!(owner_pid(u32::MAX), None, "-1 would be every process");
        assert_eq!(owner_pid(1 << 31), None);
    }

    #[test]
    fn a_leased_or_free_slot_is_never_taken_back_by_a_pid_check() {
        assert!(!pid_checked(FREE, 77));
        assert!(!pid_checked(77, 77), "leased: the agent's pid");
        assert!(pid_checked(78, 77));
        assert!(pid_checked(u32::MAX, 77), "garbage is checked (and freed)");
    }

    #[test]
    fn a_stamp_can_only_shorten_the_measured_wait() {
        // Honest stamp inside the window.
        assert_eq!(waited_us(10_000_000, 9_000_000, 5_000_000), 1000);
        // A stamp from long ago is capped by the last visit.
        assert_eq!(waited_us(10_000_000, 0, 9_500_000), 500);
        // A stamp from the future waits 0.
        assert_eq!(waited_us(10_000_000, u64::MAX, 0), 0);
    }

    #[test]
    fn slot_peers_round_trip_and_real_peers_are_not_slots() {
        for s in [0, 1, 63, 4095, 65_533] {
            assert_eq!(peer_slot(slot_peer(s)), Some(s));
        }
        assert_eq!(peer_slot("127.0.0.1:5000".parse().unwrap()), None);
        assert_eq!(peer_slot("0.0.0.0:0".parse().unwrap()), None);
        assert_eq!(peer_slot("[::]:5".parse().unwrap()), None);
    }
}
