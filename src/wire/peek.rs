//! A getHost's fields read straight from the bytes, without the verifier:
//! what a shard needs to shed a getHost below its own level (issue 12, the
//! agent's own overload) at a fraction of a full [`super::decode()`].
//!
//! Every read is bounds-checked against the buffer, so hostile input cannot
//! make it read outside it; and it checks what the verifier would check on
//! the path it walks (the identifier, 4-byte-aligned tables and 2-byte
//! vtables inside the buffer, every field inside its table, the union's
//! offset inside the buffer) and what [`super::fb::GetHostReq::validate`]
//! checks (priorities at most 128). Anything else is `None`, and the caller
//! takes the full decode, which counts it as the malformed datagram it is.
//! What it does not look at (other tables, the envelope's depth) a getHost
//! does not have.

use super::decode::MIN_LEN;
use super::fb;
use super::validate::GetHost;
use lbagent_model::ModuleId;

/// The union member a getHost's envelope carries.
const GET_HOST: u8 = fb::Body::GetHostReq.0;

/// The getHost in `buf`, when `buf` is a well-formed envelope holding one
/// whose priorities are in range; `None` for anything else (another
/// message, or bytes the full decode must judge). At most `max_len` bytes.
pub fn peek_get_host(buf: &[u8], max_len: usize) -> Option<GetHost> {
    if buf.len() < MIN_LEN || buf.len() > max_len || !fb::envelope_buffer_has_identifier(buf) {
        return None;
    }
    let root = Table::at(buf, u32_at(buf, 0)? as usize)?;
    if root.u8(buf, fb::Envelope::VT_BODY_TYPE)? != GET_HOST {
        return None;
    }
    let at = root.field(buf, fb::Envelope::VT_BODY, 4)?;
    if at % 4 != 0 {
        return None;
    }
    let body = Table::at(buf, at.checked_add(u32_at(buf, at)? as usize)?)?;
    let business_priority = body.u8(buf, fb::GetHostReq::VT_BUSINESS_PRIORITY)?;
    let user_priority = body.u8(buf, fb::GetHostReq::VT_USER_PRIORITY)?;
    if business_priority > super::MAX_PRIORITY || user_priority > super::MAX_PRIORITY {
        return None;
    }
    // A keyed or selecting getHost takes the full decode: neither the key
    // nor the selector is read here.
    if body.slot(buf, fb::GetHostReq::VT_KEY_HASH, 8)?.is_some()
        || body.slot(buf, fb::GetHostReq::VT_SELECTOR, 4)?.is_some()
    {
        return None;
    }
    Some(GetHost {
        seq: body.u32(buf, fb::GetHostReq::VT_SEQ)?,
        module: ModuleId::new(
            body.u32(buf, fb::GetHostReq::VT_MODID)?,
            body.u32(buf, fb::GetHostReq::VT_CMDID)?,
        ),
        business_priority,
        user_priority,
    })
}

/// A table checked to lie in the buffer with its vtable.
struct Table {
    at: usize,
    size: usize,
    vtable: usize,
    vtable_size: usize,
}

impl Table {
    fn at(buf: &[u8], at: usize) -> Option<Table> {
        if at % 4 != 0 {
            return None;
        }
        let soffset = i32::from_le_bytes(buf.get(at..at.checked_add(4)?)?.try_into().ok()?);
        let vtable = usize::try_from(at as i64 - i64::from(soffset)).ok()?;
        if vtable % 2 != 0 {
            return None;
        }
        let vtable_size = u16_at(buf, vtable)? as usize;
        let size = u16_at(buf, vtable + 2)? as usize;
        if vtable_size < 4
            || vtable_size % 2 != 0
            || vtable.checked_add(vtable_size)? > buf.len()
            || size < 4
            || at.checked_add(size)? > buf.len()
        {
            return None;
        }
        Some(Table {
            at,
            size,
            vtable,
            vtable_size,
        })
    }

    /// Where field `vt` of `width` bytes lies: `Some(None)` when absent
    /// (its default applies), `None` when the vtable puts it outside the
    /// table.
    fn slot(&self, buf: &[u8], vt: u16, width: usize) -> Option<Option<usize>> {
        let vt = usize::from(vt);
        if vt + 2 > self.vtable_size {
            return Some(None);
        }
        let off = usize::from(u16_at(buf, self.vtable + vt)?);
        if off == 0 {
            return Some(None);
        }
        (off >= 4 && off + width <= self.size).then_some(Some(self.at + off))
    }

    /// Where field `vt` (present) of `width` bytes lies.
    fn field(&self, buf: &[u8], vt: u16, width: usize) -> Option<usize> {
        self.slot(buf, vt, width)?
    }

    fn u8(&self, buf: &[u8], vt: u16) -> Option<u8> {
        match self.slot(buf, vt, 1)? {
            Some(at) => buf.get(at).copied(),
            None => Some(0),
        }
    }

    fn u32(&self, buf: &[u8], vt: u16) -> Option<u32> {
        match self.slot(buf, vt, 4)? {
            Some(at) if at % 4 == 0 => u32_at(buf, at),
            Some(_) => None,
            None => Some(0),
        }
    }
}

fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        buf.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        buf.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, Encoder, Limits, Message};
    use proptest::prelude::*;

    fn full(buf: &[u8]) -> Option<GetHost> {
        match decode(buf, &Limits::UDP) {
            Ok(Message::GetHostReq(r)) => r.validate().ok(),
            _ => None,
        }
    }

    #[test]
    fn a_get_host_peeks_as_it_decodes() {
        let mut enc = Encoder::new();
        for (seq, modid, cmdid, b, u) in [
            (1, 10_000, 1, 5, 60),
            (0, 0, 0, 0, 0),
            (u32::MAX, u32::MAX, 7, 128, 128),
            (42, 1, u32::MAX, 1, 0),
        ] {
            let buf = enc
                .get_host_req(seq, ModuleId::new(modid, cmdid), b, u)
                .to_vec();
            let got = peek_get_host(&buf, Limits::UDP.max_len);
            assert_eq!(got, full(&buf), "{buf:?}");
            assert!(got.is_some());
        }
    }

    #[test]
    fn out_of_range_priorities_and_other_messages_are_left_to_the_decoder() {
        let mut enc = Encoder::new();
        let m = ModuleId::new(1, 2);
        let bad = enc.get_host_req(1, m, 129, 1).to_vec();
        assert_eq!(peek_get_host(&bad, Limits::UDP.max_len), None);
        let bad = enc.get_host_req(1, m, 1, 200).to_vec();
        assert_eq!(peek_get_host(&bad, Limits::UDP.max_len), None);
        let route = enc.get_route_req(1, m).to_vec();
        assert_eq!(peek_get_host(&route, Limits::UDP.max_len), None);
        let ok = enc.get_host_req(1, m, 1, 1).to_vec();
        assert_eq!(peek_get_host(&ok, ok.len() - 1), None, "over max_len");
        for cut in 0..ok.len() {
            assert_eq!(
                peek_get_host(&ok[..cut], Limits::UDP.max_len),
                None,
                "cut {cut}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// Hostile bytes: a getHost with bytes overwritten, cut or
        /// extended. Whatever the peek accepts, the full decode accepts as
        /// the same getHost (it never says more than the decoder would).
        #[test]
        fn what_the_peek_accepts_the_decoder_accepts_alike(
            seq: u32, modid: u32, b in 0u8..=128, u in 0u8..=128,
            edits in proptest::collection::vec((0usize..64, any::<u8>()), 0..6),
            cut in 0usize..80, tail in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let mut buf = Encoder::new().get_host_req(seq, ModuleId::new(modid, 3), b, u).to_vec();
            for (at, v) in edits {
                let n = buf.len();
                buf[at % n] = v;
            }
            buf.truncate(cut.max(1));
            buf.extend_from_slice(&tail);
            if let Some(p) = peek_get_host(&buf, Limits::UDP.max_len) {
                prop_assert_eq!(Some(p), full(&buf));
            }
        }
    }
}
