//! The two hot requests, a plain getHost and a report, read straight from
//! the bytes without the FlatBuffers verifier: what a shard does with
//! every datagram before it falls back to the full [`super::decode()`]
//! (issue 29: the verifier was half of the UDP path's user-space
//! instructions).
//!
//! # Why it is safe
//!
//! Safe Rust only: every read is a bounds-checked slice of the buffer, so
//! hostile input cannot make it read outside it or panic. It walks the
//! path the verifier walks for these two messages and makes the same
//! checks there, in the same arithmetic (`flatbuffers` 23.5.26's
//! `Verifier::visit_table`, `TableVerifier::deref`, `in_buffer`,
//! `deref_soffset`):
//!
//! - the length against [`MIN_LEN`] and [`Limits::max_len`], the file
//!   identifier (as [`super::decode()`] checks before verifying);
//! - the root offset; each table 4-byte aligned, its signed offset to a
//!   vtable inside the buffer, the vtable 2-byte aligned, of an even
//!   length, wholly inside the buffer;
//! - each field the schema gives the table, when its vtable names it:
//!   inside the buffer and aligned to its scalar's size (structs, whose
//!   generated types are byte arrays, need no alignment); the union's type
//!   and its body both present, the body's offset aligned and its table
//!   checked as above.
//!
//! Fields are then read where the generated accessors read them (table
//! position plus the vtable's offset, the schema's default when absent), so
//! whatever it accepts the verified decode accepts with the same values;
//! then the same `validate()` rules apply (the priorities, the report's
//! host, level and consumed units), through the functions
//! [`super::validate`] shares with the generated tables.
//!
//! # What it leaves to the full decode
//!
//! `None` means "decode it in full", which then answers or counts the
//! datagram exactly as before: any other message; a getHost whose vtable
//! reaches its key's hash or selector (the steering path, as
//! `GetHostReq::may_steer` says); a request whose fields fail validation
//! (the full path answers BadRequest with the reason); a buffer the
//! verifier's bounds on tables, depth or apparent size could refuse (never
//! under [`Limits::UDP`]: two tables, depth two, at most twice the length
//! plus 128 bytes visited); and anything malformed.

use super::decode::{Limits, MIN_LEN};
use super::fb;
use super::validate::{self, GetHost};
use super::values::Report;

/// A hot request read from the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hot {
    /// A plain getHost (no key, no selector), validated.
    GetHost(GetHost),
    /// A report, validated.
    Report(Report),
}

/// The plain getHost or report in `buf`, when `buf` is an envelope the
/// verified [`super::decode()`] under `limits` accepts holding one whose
/// fields pass validation; `None` for anything else (see the module's
/// header: the full decode judges it).
pub fn read_hot(buf: &[u8], limits: &Limits) -> Option<Hot> {
    let len = buf.len();
    if len < MIN_LEN
        || len > limits.max_len
        || limits.max_depth < 2
        || limits.max_tables < 2
        || limits.max_apparent_size < len.saturating_mul(2).saturating_add(128)
        || !fb::envelope_buffer_has_identifier(buf)
    {
        return None;
    }
    // The root offset at 0 (aligned), then the envelope.
    let envelope = Table::at(buf, u32_at(buf, 0)? as usize)?;
    let body_at = envelope.field(fb::Envelope::VT_BODY);
    let type_at = envelope.field(fb::Envelope::VT_BODY_TYPE);
    let (Some(type_at), Some(body_at)) = (type_at, body_at) else {
        // No body (NoBody) or an inconsistent union (malformed).
        return None;
    };
    let body_type = *buf.get(type_at)?;
    if body_at % 4 != 0 {
        return None;
    }
    let body = Table::at(buf, (u32_at(buf, body_at)? as usize).checked_add(body_at)?)?;
    match fb::Body(body_type) {
        fb::Body::GetHostReq => get_host(buf, &body).map(Hot::GetHost),
        fb::Body::ReportReq => report(buf, &body).map(Hot::Report),
        _ => None,
    }
}

/// A plain getHost's fields, validated.
fn get_host(buf: &[u8], t: &Table<'_>) -> Option<GetHost> {
    // The vtable reaches the key's hash or the selector: the steering path
    // (`may_steer`), which the full decode takes.
    if t.vtable_len() > usize::from(fb::GetHostReq::VT_KEY_HASH) {
        return None;
    }
    validate::get_host_values(
        t.u32(buf, fb::GetHostReq::VT_SEQ)?,
        t.u32(buf, fb::GetHostReq::VT_MODID)?,
        t.u32(buf, fb::GetHostReq::VT_CMDID)?,
        t.u8(buf, fb::GetHostReq::VT_BUSINESS_PRIORITY)?,
        t.u8(buf, fb::GetHostReq::VT_USER_PRIORITY)?,
    )
    .ok()
}

/// A report's fields, validated.
fn report(buf: &[u8], t: &Table<'_>) -> Option<Report> {
    // In the verifier's order (it does not matter which check fails first:
    // any failure is `None`).
    let seq = t.u32(buf, fb::ReportReq::VT_SEQ)?;
    let modid = t.u32(buf, fb::ReportReq::VT_MODID)?;
    let cmdid = t.u32(buf, fb::ReportReq::VT_CMDID)?;
    let host = t.bytes::<8>(buf, fb::ReportReq::VT_HOST)?.map(fb::Host);
    let retcode = t.u32(buf, fb::ReportReq::VT_RETCODE)? as i32;
    let tcost_ms = t.u32(buf, fb::ReportReq::VT_TCOST_MS)?;
    let level = t
        .bytes::<2>(buf, fb::ReportReq::VT_DOWNSTREAM_LEVEL)?
        .map(fb::AdmissionLevel);
    let consumed = t.u32(buf, fb::ReportReq::VT_CONSUMED)?;
    validate::report_values(validate::ReportFields {
        seq,
        modid,
        cmdid,
        host: host.as_ref(),
        retcode,
        tcost_ms,
        level: level.as_ref(),
        consumed,
    })
    .ok()
}

/// A table as the verifier's `visit_table` accepts it: its position and
/// its vtable's bytes (the length word included).
struct Table<'a> {
    at: usize,
    vtable: &'a [u8],
}

impl<'a> Table<'a> {
    /// The table at `at`: 4-byte aligned with its signed offset inside the
    /// buffer, its vtable inside the buffer, 2-byte aligned, of even length.
    fn at(buf: &'a [u8], at: usize) -> Option<Table<'a>> {
        if at % 4 != 0 {
            return None;
        }
        let soffset = i32::from_le_bytes(buf.get(at..at.checked_add(4)?)?.try_into().ok()?);
        // As the verifier's deref_soffset: positive offsets are subtracted.
        let vtable = if soffset > 0 {
            at.checked_sub(soffset.unsigned_abs() as usize)?
        } else {
            at.checked_add(soffset.unsigned_abs() as usize)?
        };
        // 2-byte aligned: u16_at checks it, as the verifier's get_u16.
        let vtable_len = usize::from(u16_at(buf, vtable)?);
        if vtable_len % 2 != 0 {
            return None;
        }
        Some(Table {
            at,
            vtable: buf.get(vtable..vtable.checked_add(vtable_len)?)?,
        })
    }

    /// The vtable's length in bytes (the verifier's `vtable_len`, the
    /// accessors' `num_bytes`).
    fn vtable_len(&self) -> usize {
        self.vtable.len()
    }

    /// Where field `vt` lies: `None` when the vtable does not name it (its
    /// default applies), as the verifier's `deref` and the generated
    /// accessors' `VTable::get` read it. `vt` is even and the vtable's
    /// length too, so an entry is either wholly inside it or past its end.
    #[inline]
    fn field(&self, vt: u16) -> Option<usize> {
        let vt = usize::from(vt);
        let entry = self.vtable.get(vt..vt + 2)?;
        match u16::from_le_bytes([entry[0], entry[1]]) {
            0 => None,
            // No overflow: `at` is inside a buffer, the offset 16 bits.
            off => Some(self.at + usize::from(off)),
        }
    }

    /// Field `vt` of `N` bytes aligned to `align`, inside the buffer:
    /// `Some(None)` when absent, `None` when misaligned or outside it.
    #[inline]
    fn raw<const N: usize>(&self, buf: &[u8], vt: u16, align: usize) -> Option<Option<[u8; N]>> {
        match self.field(vt) {
            None => Some(None),
            Some(at) if at % align == 0 => Some(Some(buf.get(at..at + N)?.try_into().ok()?)),
            Some(_) => None,
        }
    }

    /// A struct field of `N` bytes (no alignment: the generated struct
    /// types are byte arrays).
    fn bytes<const N: usize>(&self, buf: &[u8], vt: u16) -> Option<Option<[u8; N]>> {
        self.raw::<N>(buf, vt, 1)
    }

    /// A 4-byte scalar, 0 when absent.
    fn u32(&self, buf: &[u8], vt: u16) -> Option<u32> {
        Some(self.raw::<4>(buf, vt, 4)?.map_or(0, u32::from_le_bytes))
    }

    /// A 1-byte scalar, 0 when absent.
    fn u8(&self, buf: &[u8], vt: u16) -> Option<u8> {
        Some(self.raw::<1>(buf, vt, 1)?.map_or(0, |[b]| b))
    }
}

/// A 2-byte aligned u16 inside the buffer (the verifier's `get_u16`).
fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    if at % 2 != 0 {
        return None;
    }
    Some(u16::from_le_bytes(
        buf.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

/// A 4-byte aligned u32 inside the buffer (the verifier's `get_uoffset`).
fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    if at % 4 != 0 {
        return None;
    }
    Some(u32::from_le_bytes(
        buf.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests;
