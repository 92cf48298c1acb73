//! Slots leased over the agent's local socket, whatever pid namespace the
//! client runs in (issue 27). A slot claimed by pid ([`super::attach`])
//! lives while `kill(pid, 0)` finds its owner; a client in its own pid
//! namespace writes a pid the agent cannot check (its slot looks dead and
//! is taken from under it, or never dies). A leased slot is bound to a
//! connection instead: the client opens a connection to the shard's local
//! socket whose first message is [`LEASE_MAGIC`] with the region file,
//! opened read-write, attached (`SCM_RIGHTS`: holding it proves the
//! client may use the region, as opening it did); the shard claims a
//! free slot for it, writing the agent's own pid (the header's) as the
//! owner, and answers with the slot's index in a frame
//! ([`lease_answer`]). The kernel closes the connection when the client
//! dies, however it dies; the shard then frees the slot and gives back
//! the balance units held through it. No pid is compared across
//! namespaces.
//!
//! The owner word holds the agent's pid so that nobody takes the slot
//! back by a pid check: clients of this version skip it
//! ([`super::layout::pid_checked`]), and an older client on the agent's
//! host finds that pid alive. The region says the agent leases
//! ([`super::layout::FEAT_LEASE`] in the header) only when it serves the
//! local socket; a client of an older version never asks and claims by
//! pid as before, and a client of this version facing an older agent
//! (the bit is 0) does the same.
//!
//! A client whose UDP cannot reach the shard (its own network namespace)
//! rings the shard's doorbell with a [`RING_FRAME`] on the same
//! connection instead of an empty datagram.
//!
//! [`Leases`] is the shard's table of which connection holds which slot:
//! pure, tested here.

/// The first message of a connection that asks for a slot (4 bytes, the
/// region file attached), in place of the identification message.
pub const LEASE_MAGIC: &[u8; 4] = b"LBSL";

/// The doorbell over a connection: a frame (u32 little-endian length 4,
/// then `"LBRG"`) that no FlatBuffers message can be (one needs 8 bytes at
/// least). Wakes the shard as an empty datagram on its port does.
pub const RING_FRAME: [u8; 8] = *b"\x04\0\0\0LBRG";

/// The body of [`RING_FRAME`].
pub const RING_MAGIC: &[u8; 4] = b"LBRG";

/// The slot index of an answer that grants none (no free slot, no region).
pub const NO_SLOT: u32 = u32::MAX;

/// The body of the frame that answers a lease: [`LEASE_MAGIC`], then the
/// slot's index (u32 little-endian; [`NO_SLOT`]: none).
pub fn lease_answer(slot: Option<u32>) -> [u8; 8] {
    let mut a = [0u8; 8];
    a[..4].copy_from_slice(LEASE_MAGIC);
    a[4..].copy_from_slice(&slot.unwrap_or(NO_SLOT).to_le_bytes());
    a
}

/// The slot a lease answer's body grants: `Some(None)` for none, `None`
/// when the bytes are no lease answer.
pub fn parse_lease_answer(body: &[u8]) -> Option<Option<u32>> {
    let (magic, slot) = body.split_first_chunk::<4>()?;
    let slot = u32::from_le_bytes(slot.try_into().ok()?);
    (magic == LEASE_MAGIC).then_some((slot != NO_SLOT).then_some(slot))
}

/// Which local connection holds each leased slot of one region.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leases {
    by_slot: Vec<Option<u32>>,
}

impl Leases {
    /// No slot of a region of `slots` slots leased.
    pub fn new(slots: u32) -> Leases {
        Leases {
            by_slot: vec![None; slots as usize],
        }
    }

    /// Records that connection `conn` holds `slot`.
    pub fn grant(&mut self, slot: u32, conn: u32) {
        if let Some(s) = self.by_slot.get_mut(slot as usize) {
            *s = Some(conn);
        }
    }

    /// The connection that holds `slot`, if leased.
    pub fn holder(&self, slot: u32) -> Option<u32> {
        self.by_slot.get(slot as usize).copied().flatten()
    }

    /// Ends every lease of connection `conn`; the slots it held.
    pub fn end(&mut self, conn: u32) -> Vec<u32> {
        let mut ended = Vec::new();
        for (i, s) in self.by_slot.iter_mut().enumerate() {
            if *s == Some(conn) {
                *s = None;
                ended.push(i as u32);
            }
        }
        ended
    }

    /// How many slots are leased.
    pub fn count(&self) -> usize {
        self.by_slot.iter().filter(|s| s.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ends_with_its_connection_and_only_its_own() {
        let mut l = Leases::new(4);
        l.grant(1, 7);
        l.grant(3, 7);
        l.grant(2, 8);
        l.grant(9, 7); // past the end: nothing
        assert_eq!(
            (l.holder(1), l.holder(2), l.holder(0)),
            (Some(7), Some(8), None)
        );
        assert_eq!(l.count(), 3);
        assert_eq!(l.end(7), [1, 3]);
        assert_eq!(l.end(7), Vec::<u32>::new());
        assert_eq!((l.holder(1), l.holder(2)), (None, Some(8)));
    }

    #[test]
    fn lease_answers_round_trip_and_nothing_else_is_one() {
        for slot in [Some(0), Some(4095), None] {
            assert_eq!(parse_lease_answer(&lease_answer(slot)), Some(slot));
        }
        assert_eq!(parse_lease_answer(b"LBSL\0\0"), None);
        assert_eq!(parse_lease_answer(b"LBXX\0\0\0\0"), None);
        assert_eq!(&RING_FRAME[4..], RING_MAGIC);
        assert_eq!(u32::from_le_bytes(RING_FRAME[..4].try_into().unwrap()), 4);
    }
}
