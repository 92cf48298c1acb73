//! The fixed binary layout of the hot requests over shared memory (layout
//! version 3): getHost, report, and the getHost answer, as little-endian
//! records of a fixed size, so that neither side runs the FlatBuffers
//! builder or verifier for them. Every other request and answer (register,
//! getRoute, the route cache's, ErrorResp) stays FlatBuffers bytes in the
//! cell; the slot's format word says which a cell holds
//! ([`super::layout::S_REQ_FORMAT`], [`super::layout::S_RESP_FORMAT`]).
//! UDP is unchanged: FlatBuffers only.
//!
//! Pure: bytes in, values out. Nothing read is trusted: every length,
//! tag, reserved byte and value is checked, and the field rules are those
//! of the FlatBuffers path ([`lbagent_wire::fb::GetHostReq::validate`],
//! [`lbagent_wire::fb::ReportReq::validate`]), so that both decode to the
//! same request (a property test checks it) and an out-of-range value gets
//! the same BadRequest answer.
//!
//! # Records
//!
//! Every record starts with its kind byte. Offsets in bytes, integers
//! little-endian; a reserved byte must be 0.
//!
//! getHost ([`GET_HOST`], [`GET_HOST_LEN`] bytes):
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 1 | kind, 1 |
//! | 1 | 1 | business priority (0 = unset, 1..=128) |
//! | 2 | 1 | user priority (0 = unset, 1..=128) |
//! | 3 | 1 | flags: bit 0 [`FLAG_HINT`] = answer with the node hint; other bits 0 |
//! | 4 | 4 | seq |
//! | 8 | 4 | modid |
//! | 12 | 4 | cmdid |
//!
//! report ([`REPORT`], [`REPORT_LEN`] bytes):
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 1 | kind, 2 |
//! | 1 | 1 | downstream level, business part (0 with the user part 0: none) |
//! | 2 | 1 | downstream level, user part |
//! | 3 | 1 | flags: bit 0 [`FLAG_HINT`] = the node hint follows ([`REPORT_HINTED_LEN`] bytes); other bits 0 |
//! | 4 | 4 | seq |
//! | 8 | 4 | modid |
//! | 12 | 4 | cmdid |
//! | 16 | 4 | node IPv4 address (as the wire's `Host.ip`) |
//! | 20 | 2 | node port (never 0) |
//! | 22 | 2 | reserved |
//! | 24 | 4 | the call's retcode (i32) |
//! | 28 | 4 | tcost, ms |
//! | 32 | 4 | consumed units (at most [`lbagent_wire::MAX_CONSUMED`]) |
//! | 36 | 4 | with [`FLAG_HINT`]: the node hint its getHost's answer carried |
//!
//! getHost answer ([`HOST_ANSWER`], [`HOST_ANSWER_LEN`] bytes), what a
//! GetHostResp carries:
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 1 | kind, 0x81 |
//! | 1 | 1 | retcode (the wire's `RetCode`, i8) |
//! | 2 | 1 | admission level, business part (0 with the user part 0: none) |
//! | 3 | 1 | admission level, user part |
//! | 4 | 4 | seq |
//! | 8 | 4 | modid |
//! | 12 | 4 | cmdid |
//! | 16 | 4 | host IPv4 address |
//! | 20 | 2 | host port |
//! | 22 | 1 | flags: bit 0 = a host is named; bit 1 = the node hint follows ([`HOST_ANSWER_HINTED_LEN`] bytes); other bits 0 |
//! | 23 | 1 | reserved |
//! | 24 | 4 | with bit 1: the node hint |
//!
//! # The node hint
//!
//! A report names its node by address, and the shard finds the node in
//! the module's route by a binary search. The getHost that named the node
//! knew where it was: a client that asks ([`FLAG_HINT`] on its getHost)
//! gets the node's index in the route as a hint in the answer, and hands
//! it back with its report of that node. The shard tries that index first
//! and takes it only if the node there has the report's address (the
//! addresses in a route are unique); otherwise (the route changed since,
//! or the hint is made up or out of range) it searches as without one. A
//! hint changes what a report costs, never which node it counts for, so
//! it needs no version: the address is the check.
//!
//! A client sets [`FLAG_HINT`] only in a region whose header's features
//! word has [`super::layout::FEAT_NODE_HINT`] (an agent that reads the
//! flag): an older agent finds a reserved byte set and drops the record as
//! garbage. An older client never sets it, and gets the answers it knows
//! (24 bytes, no hint), its reports found by address as before.

use lbagent_model::{ModuleId, NodeAddr};
use lbagent_wire::fb;
use lbagent_wire::{
    AdmissionLevel, GetHost, Message, Report, RetCode, ValidationError, MAX_CONSUMED, MAX_PRIORITY,
};

/// The kind byte of a getHost record.
pub const GET_HOST: u8 = 1;
/// The kind byte of a report record.
pub const REPORT: u8 = 2;
/// The kind byte of a getHost answer record.
pub const HOST_ANSWER: u8 = 0x81;
/// A getHost record's length.
pub const GET_HOST_LEN: usize = 16;
/// A report record's length.
pub const REPORT_LEN: usize = 36;
/// A report record's length with the node hint ([`FLAG_HINT`]).
pub const REPORT_HINTED_LEN: usize = REPORT_LEN + 4;
/// A getHost answer record's length.
pub const HOST_ANSWER_LEN: usize = 24;
/// A getHost answer record's length with the node hint.
pub const HOST_ANSWER_HINTED_LEN: usize = HOST_ANSWER_LEN + 4;
/// The longest answer record.
pub const ANSWER_MAX: usize = HOST_ANSWER_HINTED_LEN;
/// The longest request record.
pub const MAX_LEN: usize = REPORT_HINTED_LEN;

/// A request's flag (byte 3): a getHost asks for the node hint in its
/// answer; a report carries the hint its getHost's answer gave.
pub const FLAG_HINT: u8 = 1;

/// The answer's flag saying a host is named.
const HAS_HOST: u8 = 1;
/// The answer's flag saying the node hint follows.
const HAS_HINT: u8 = 2;

/// What a request record carries of the node hint (see the module's
/// header).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Hint {
    /// Nothing: a getHost that does not ask, a report without a hint.
    #[default]
    None,
    /// A getHost asking for the hint in its answer.
    Ask,
    /// A report handing back the hint of its getHost's answer.
    Node(u32),
}

/// A hot request in its fixed layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// A getHost, as [`fb::GetHostReq::validate`] gives it.
    GetHost(GetHost),
    /// A report, as [`fb::ReportReq::validate`] gives it.
    Report(Report),
}

impl Request {
    /// The request's sequence number.
    pub fn seq(&self) -> u32 {
        match self {
            Request::GetHost(g) => g.seq,
            Request::Report(r) => r.seq,
        }
    }

    /// The same request with sequence number `seq`.
    pub fn with_seq(self, seq: u32) -> Request {
        match self {
            Request::GetHost(g) => Request::GetHost(GetHost { seq, ..g }),
            Request::Report(r) => Request::Report(Report { seq, ..r }),
        }
    }
}

/// What a GetHostResp says, whichever layout carried it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostAnswer {
    /// The request's sequence number, echoed.
    pub seq: u32,
    /// The module asked for, echoed.
    pub module: ModuleId,
    /// Ok, or why there is no host.
    pub retcode: RetCode,
    /// The node picked (set with Ok).
    pub host: Option<NodeAddr>,
    /// The admission level the answer carries (none: admission is open).
    pub level: Option<AdmissionLevel>,
}

impl HostAnswer {
    /// The values of a decoded GetHostResp.
    pub fn from_resp(r: &fb::GetHostResp<'_>) -> HostAnswer {
        HostAnswer {
            seq: r.seq(),
            module: ModuleId::new(r.modid(), r.cmdid()),
            retcode: r.retcode(),
            host: r.host().map(NodeAddr::from),
            level: AdmissionLevel::from_wire(r.admission_level()),
        }
    }
}

/// Why a record was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FixedError {
    /// Not a record of this layout: a length, kind or reserved byte that
    /// no writer of it produces. The cell is garbage.
    #[error("not a fixed-layout record: {0}")]
    Garbage(&'static str),
    /// A well-formed request whose field values are out of range: answered
    /// BadRequest, as the FlatBuffers request would be.
    #[error("{kind} {seq} for module {module}: {error}")]
    Invalid {
        /// The request's kind byte ([`GET_HOST`] or [`REPORT`]).
        kind: u8,
        /// Its sequence number.
        seq: u32,
        /// Its module.
        module: ModuleId,
        /// What is out of range.
        error: ValidationError,
    },
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// A level's two bytes: (0, 0) for none.
fn level_bytes(l: Option<AdmissionLevel>) -> (u8, u8) {
    l.map_or((0, 0), |l| (l.business, l.user))
}

/// Writes `req` into `out`, without a node hint; returns the record's
/// length ([`GET_HOST_LEN`] or [`REPORT_LEN`]).
pub fn encode_request(req: &Request, out: &mut [u8; MAX_LEN]) -> usize {
    encode_request_hinted(req, Hint::None, out)
}

/// Writes `req` into `out` with `hint` (a getHost takes [`Hint::Ask`], a
/// report [`Hint::Node`]; any other pairing writes no hint); returns the
/// record's length. Only for a region whose agent reads hints
/// ([`super::layout::FEAT_NODE_HINT`]).
pub fn encode_request_hinted(req: &Request, hint: Hint, out: &mut [u8; MAX_LEN]) -> usize {
    match req {
        Request::GetHost(g) => {
            let b = &mut out[..GET_HOST_LEN];
            b[0] = GET_HOST;
            b[1] = g.business_priority;
            b[2] = g.user_priority;
            b[3] = if hint == Hint::Ask { FLAG_HINT } else { 0 };
            put32(b, 4, g.seq);
            put32(b, 8, g.module.modid);
            put32(b, 12, g.module.cmdid);
            GET_HOST_LEN
        }
        Request::Report(r) => {
            let b = &mut out[..REPORT_HINTED_LEN];
            let (lb, lu) = level_bytes(r.downstream_level);
            b[0] = REPORT;
            b[1] = lb;
            b[2] = lu;
            b[3] = 0;
            put32(b, 4, r.seq);
            put32(b, 8, r.module.modid);
            put32(b, 12, r.module.cmdid);
            put32(b, 16, r.host.ip);
            put16(b, 20, r.host.port);
            put16(b, 22, 0);
            put32(b, 24, r.retcode as u32);
            put32(b, 28, r.tcost_ms);
            put32(b, 32, r.consumed);
            match hint {
                Hint::Node(i) => {
                    b[3] = FLAG_HINT;
                    put32(b, REPORT_LEN, i);
                    REPORT_HINTED_LEN
                }
                _ => REPORT_LEN,
            }
        }
    }
}

/// Reads a request record: the same values, and the same field rules, as
/// the FlatBuffers request's `validate()`.
///
/// # Errors
/// [`FixedError::Garbage`] for bytes that are no record (wrong length,
/// unknown kind, a reserved byte not 0); [`FixedError::Invalid`] for a
/// record whose values are out of range.
#[inline]
pub fn decode_request(b: &[u8]) -> Result<Request, FixedError> {
    decode_request_hinted(b).map(|(req, _)| req)
}

/// [`decode_request`] with what the record carries of the node hint.
///
/// # Errors
/// As [`decode_request`]; a flag bit other than [`FLAG_HINT`] set, or a
/// length that does not match the flag, is garbage.
#[inline(always)]
pub fn decode_request_hinted(b: &[u8]) -> Result<(Request, Hint), FixedError> {
    let Some(&kind) = b.first() else {
        return Err(FixedError::Garbage("empty"));
    };
    match kind {
        GET_HOST => {
            if b.len() != GET_HOST_LEN {
                return Err(FixedError::Garbage("a getHost record of the wrong length"));
            }
            if b[3] & !FLAG_HINT != 0 {
                return Err(FixedError::Garbage("a reserved bit is not 0"));
            }
            let hint = if b[3] == FLAG_HINT {
                Hint::Ask
            } else {
                Hint::None
            };
            let g = GetHost {
                seq: u32_at(b, 4),
                module: ModuleId::new(u32_at(b, 8), u32_at(b, 12)),
                business_priority: b[1],
                user_priority: b[2],
            };
            if g.business_priority > MAX_PRIORITY || g.user_priority > MAX_PRIORITY {
                return Err(FixedError::Invalid {
                    kind,
                    seq: g.seq,
                    module: g.module,
                    error: ValidationError::PriorityOutOfRange {
                        business: g.business_priority,
                        user: g.user_priority,
                    },
                });
            }
            Ok((Request::GetHost(g), hint))
        }
        REPORT => {
            // The flags byte is read with `get`: a record shorter than 4
            // bytes is the wrong length, not a panic of the shard.
            let hint = match (b.get(3).copied(), b.len()) {
                (Some(0), REPORT_LEN) => Hint::None,
                (Some(FLAG_HINT), REPORT_HINTED_LEN) => Hint::Node(u32_at(b, REPORT_LEN)),
                (Some(0 | FLAG_HINT) | None, _) => {
                    return Err(FixedError::Garbage("a report record of the wrong length"))
                }
                _ => return Err(FixedError::Garbage("a reserved bit is not 0")),
            };
            if u16_at(b, 22) != 0 {
                return Err(FixedError::Garbage("a reserved byte is not 0"));
            }
            let (seq, module) = (u32_at(b, 4), ModuleId::new(u32_at(b, 8), u32_at(b, 12)));
            let invalid = |error| FixedError::Invalid {
                kind,
                seq,
                module,
                error,
            };
            let host = NodeAddr {
                ip: u32_at(b, 16),
                port: u16_at(b, 20),
            };
            if host.port == 0 {
                return Err(invalid(ValidationError::PortZero(host)));
            }
            let downstream_level = match (b[1], b[2]) {
                (0, 0) => None,
                (business, user)
                    if (1..=MAX_PRIORITY).contains(&business)
                        && (1..=MAX_PRIORITY).contains(&user) =>
                {
                    Some(AdmissionLevel::new(business, user))
                }
                (business, user) => {
                    return Err(invalid(ValidationError::LevelOutOfRange { business, user }))
                }
            };
            let consumed = u32_at(b, 32);
            if consumed > MAX_CONSUMED {
                return Err(invalid(ValidationError::ConsumedOutOfRange(consumed)));
            }
            Ok((
                Request::Report(Report {
                    seq,
                    module,
                    host,
                    retcode: u32_at(b, 24) as i32,
                    tcost_ms: u32_at(b, 28),
                    downstream_level,
                    consumed,
                }),
                hint,
            ))
        }
        _ => Err(FixedError::Garbage("an unknown request kind")),
    }
}

/// Writes answer `a` into `out`, without a node hint.
pub fn encode_answer(a: &HostAnswer, out: &mut [u8; HOST_ANSWER_LEN]) {
    let mut full = [0u8; ANSWER_MAX];
    let n = write_answer(&mut full, a.seq, a.module, a.retcode, a.host, a.level, None);
    out.copy_from_slice(&full[..n]);
}

/// Writes a getHost answer into `out` from its values (the shard's path:
/// no [`HostAnswer`] made); `hint`, the node hint, is written only with a
/// host. Returns the record's length ([`HOST_ANSWER_LEN`] or
/// [`HOST_ANSWER_HINTED_LEN`]).
#[inline(always)]
pub fn write_answer(
    out: &mut [u8; ANSWER_MAX],
    seq: u32,
    module: ModuleId,
    retcode: RetCode,
    host: Option<NodeAddr>,
    level: Option<AdmissionLevel>,
    hint: Option<u32>,
) -> usize {
    let (lb, lu) = level_bytes(level);
    out[0] = HOST_ANSWER;
    out[1] = retcode.0 as u8;
    out[2] = lb;
    out[3] = lu;
    put32(out, 4, seq);
    put32(out, 8, module.modid);
    put32(out, 12, module.cmdid);
    out[23] = 0;
    let Some(host) = host else {
        out[16..23].fill(0);
        return HOST_ANSWER_LEN;
    };
    put32(out, 16, host.ip);
    put16(out, 20, host.port);
    match hint {
        Some(i) => {
            out[22] = HAS_HOST | HAS_HINT;
            put32(out, HOST_ANSWER_LEN, i);
            HOST_ANSWER_HINTED_LEN
        }
        None => {
            out[22] = HAS_HOST;
            HOST_ANSWER_LEN
        }
    }
}

/// Reads a getHost answer record (a client reads what its agent wrote:
/// checked all the same), with or without a node hint.
///
/// # Errors
/// [`FixedError::Garbage`] for bytes that are no answer record.
pub fn decode_answer(b: &[u8]) -> Result<HostAnswer, FixedError> {
    decode_answer_hinted(b).map(|(a, _)| a)
}

/// [`decode_answer`] with the node hint the answer carries, if any (hand
/// it back with the report of the host: [`Hint::Node`]).
///
/// # Errors
/// [`FixedError::Garbage`] for bytes that are no answer record: a hint
/// without a host, or a length that does not match the flags, included.
pub fn decode_answer_hinted(b: &[u8]) -> Result<(HostAnswer, Option<u32>), FixedError> {
    if b.len() < HOST_ANSWER_LEN || b[0] != HOST_ANSWER {
        return Err(FixedError::Garbage("not a getHost answer record"));
    }
    if b[22] & !(HAS_HOST | HAS_HINT) != 0 || b[23] != 0 {
        return Err(FixedError::Garbage("a reserved bit is not 0"));
    }
    let host = NodeAddr {
        ip: u32_at(b, 16),
        port: u16_at(b, 20),
    };
    let named = b[22] & HAS_HOST != 0;
    if !named && (host.ip != 0 || host.port != 0) {
        return Err(FixedError::Garbage("an address with no host flag"));
    }
    let hint = match (b[22] & HAS_HINT != 0, b.len()) {
        (false, HOST_ANSWER_LEN) => None,
        (true, HOST_ANSWER_HINTED_LEN) if named => Some(u32_at(b, HOST_ANSWER_LEN)),
        _ => return Err(FixedError::Garbage("a getHost answer of the wrong length")),
    };
    let a = HostAnswer {
        seq: u32_at(b, 4),
        module: ModuleId::new(u32_at(b, 8), u32_at(b, 12)),
        retcode: RetCode(b[1] as i8),
        host: named.then_some(host),
        level: Some(AdmissionLevel::new(b[2], b[3])).filter(|l| *l != AdmissionLevel::default()),
    };
    Ok((a, hint))
}

/// The request a FlatBuffers datagram carries, in the values the fixed
/// layout gives (for tests and the fuzz check: both layouts must agree).
/// `None` for anything but a valid getHost or report.
pub fn from_message(msg: &Message<'_>) -> Option<Request> {
    match msg {
        Message::GetHostReq(r) => r.validate().ok().map(Request::GetHost),
        Message::ReportReq(r) => r.validate().ok().map(Request::Report),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_wire::{decode, Encoder, Limits};
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    const M: ModuleId = ModuleId::new(7, 9);

    fn host(port: u16) -> NodeAddr {
        NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), port)
    }

    fn report() -> Report {
        Report {
            seq: 5,
            module: M,
            host: host(80),
            retcode: -3,
            tcost_ms: 12,
            downstream_level: Some(AdmissionLevel::new(3, 128)),
            consumed: 4,
        }
    }

    fn fixed(req: &Request) -> Vec<u8> {
        let mut out = [0u8; MAX_LEN];
        let n = encode_request(req, &mut out);
        out[..n].to_vec()
    }

    /// The FlatBuffers bytes of `req`, as the client encodes them.
    fn flat(enc: &mut Encoder, req: &Request) -> Vec<u8> {
        match req {
            Request::GetHost(g) => enc
                .get_host_req(g.seq, g.module, g.business_priority, g.user_priority)
                .to_vec(),
            Request::Report(r) => enc.report_req(r).to_vec(),
        }
    }

    #[test]
    fn a_report_record_too_short_for_its_flags_is_the_wrong_length_not_a_panic() {
        for len in 1..4 {
            let mut b = vec![0u8; len];
            b[0] = REPORT;
            assert_eq!(
                decode_request_hinted(&b),
                Err(FixedError::Garbage("a report record of the wrong length")),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn records_have_their_documented_lengths_and_kinds() {
        let g = Request::GetHost(GetHost {
            seq: 1,
            module: M,
            business_priority: 2,
            user_priority: 3,
        });
        let b = fixed(&g);
        assert_eq!((b.len(), b[0]), (GET_HOST_LEN, GET_HOST));
        assert_eq!(&b[4..8], &1u32.to_le_bytes());
        assert_eq!(&b[8..12], &7u32.to_le_bytes());
        let r = fixed(&Request::Report(report()));
        assert_eq!((r.len(), r[0]), (REPORT_LEN, REPORT));
        assert_eq!(&r[24..28], &(-3i32).to_le_bytes());
        assert_eq!(decode_request(&r), Ok(Request::Report(report())));
    }

    #[test]
    fn garbage_is_refused_without_a_panic() {
        assert!(matches!(decode_request(&[]), Err(FixedError::Garbage(_))));
        let mut g = fixed(&Request::GetHost(GetHost {
            seq: 1,
            module: M,
            business_priority: 0,
            user_priority: 0,
        }));
        for n in 0..g.len() {
            assert!(matches!(
                decode_request(&g[..n]),
                Err(FixedError::Garbage(_))
            ));
        }
        g.push(0);
        assert!(matches!(decode_request(&g), Err(FixedError::Garbage(_))));
        g.pop();
        // A flag bit no writer sets (bit 0 is FLAG_HINT).
        g[3] = 2;
        assert!(matches!(decode_request(&g), Err(FixedError::Garbage(_))));
        g[0] = 9;
        assert!(matches!(decode_request(&g), Err(FixedError::Garbage(_))));
        let mut r = fixed(&Request::Report(report()));
        r[23] = 1;
        assert!(matches!(decode_request(&r), Err(FixedError::Garbage(_))));
        let a = HostAnswer {
            seq: 1,
            module: M,
            retcode: RetCode::Ok,
            host: Some(host(80)),
            level: None,
        };
        let mut out = [0u8; HOST_ANSWER_LEN];
        encode_answer(&a, &mut out);
        assert_eq!(decode_answer(&out), Ok(a));
        assert!(decode_answer(&out[..HOST_ANSWER_LEN - 1]).is_err());
        out[22] = 3;
        assert!(decode_answer(&out).is_err());
        // A request record is no answer.
        assert!(decode_answer(&r[..HOST_ANSWER_LEN]).is_err());
    }

    #[test]
    fn hinted_records_have_their_documented_layout() {
        let g = Request::GetHost(GetHost {
            seq: 1,
            module: M,
            business_priority: 2,
            user_priority: 3,
        });
        let mut out = [0u8; MAX_LEN];
        assert_eq!(encode_request_hinted(&g, Hint::Ask, &mut out), GET_HOST_LEN);
        assert_eq!(out[3], FLAG_HINT);
        let n = encode_request_hinted(&Request::Report(report()), Hint::Node(7), &mut out);
        assert_eq!((n, out[3]), (REPORT_HINTED_LEN, FLAG_HINT));
        assert_eq!(&out[36..40], &7u32.to_le_bytes());
        // The flag without the hint's bytes, the bytes without the flag,
        // and any other flag bit: garbage.
        let mut r = out;
        assert!(matches!(
            decode_request(&r[..REPORT_LEN]),
            Err(FixedError::Garbage(_))
        ));
        r[3] = 0;
        assert!(matches!(
            decode_request(&r[..REPORT_HINTED_LEN]),
            Err(FixedError::Garbage(_))
        ));
        r[3] = 2;
        assert!(matches!(
            decode_request(&r[..REPORT_LEN]),
            Err(FixedError::Garbage(_))
        ));
        let mut gb = fixed(&g);
        gb[3] = 3;
        assert!(matches!(decode_request(&gb), Err(FixedError::Garbage(_))));
        // An answer with the hint: 28 bytes, read back; an old reader
        // (24 bytes exactly) is never sent one.
        let mut a = [0u8; ANSWER_MAX];
        let n = write_answer(&mut a, 4, M, RetCode::Ok, Some(host(80)), None, Some(9));
        assert_eq!((n, a[22]), (HOST_ANSWER_HINTED_LEN, 3));
        let (got, hint) = decode_answer_hinted(&a[..n]).unwrap();
        assert_eq!((got.host, hint), (Some(host(80)), Some(9)));
        assert!(decode_answer_hinted(&a[..HOST_ANSWER_LEN]).is_err());
        // No host: no hint, whatever was asked.
        let n = write_answer(&mut a, 4, M, RetCode::Overloaded, None, None, Some(9));
        assert_eq!((n, a[22]), (HOST_ANSWER_LEN, 0));
        assert_eq!(decode_answer_hinted(&a[..n]).unwrap().1, None);
    }

    #[test]
    fn out_of_range_values_are_invalid_with_the_flatbuffers_error() {
        let mut enc = Encoder::new();
        let cases = [
            Request::GetHost(GetHost {
                seq: 3,
                module: M,
                business_priority: 129,
                user_priority: 1,
            }),
            Request::Report(Report {
                host: host(0),
                ..report()
            }),
            Request::Report(Report {
                downstream_level: Some(AdmissionLevel::new(0, 5)),
                ..report()
            }),
            Request::Report(Report {
                downstream_level: Some(AdmissionLevel::new(200, 5)),
                ..report()
            }),
            Request::Report(Report {
                consumed: MAX_CONSUMED + 1,
                ..report()
            }),
        ];
        for req in cases {
            let flat = flat(&mut enc, &req);
            let want = match decode(&flat, &Limits::UDP).unwrap() {
                Message::GetHostReq(r) => r.validate().unwrap_err(),
                Message::ReportReq(r) => r.validate().unwrap_err(),
                _ => unreachable!(),
            };
            match decode_request(&fixed(&req)) {
                Err(FixedError::Invalid {
                    seq, module, error, ..
                }) => {
                    assert_eq!((seq, module, error), (req.seq(), M, want), "{req:?}");
                }
                other => panic!("{req:?}: {other:?}"),
            }
        }
    }

    fn any_level() -> impl Strategy<Value = Option<AdmissionLevel>> {
        prop_oneof![
            Just(None),
            (1..=MAX_PRIORITY, 1..=MAX_PRIORITY).prop_map(|(b, u)| Some(AdmissionLevel::new(b, u))),
        ]
    }

    fn any_request() -> impl Strategy<Value = Request> {
        let get_host = (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            0..=MAX_PRIORITY,
            0..=MAX_PRIORITY,
        )
            .prop_map(|(seq, modid, cmdid, b, u)| {
                Request::GetHost(GetHost {
                    seq,
                    module: ModuleId::new(modid, cmdid),
                    business_priority: b,
                    user_priority: u,
                })
            });
        let report = (
            (any::<u32>(), any::<u32>(), any::<u32>()),
            (any::<u32>(), 1..=u16::MAX),
            (any::<i32>(), any::<u32>()),
            any_level(),
            0..=MAX_CONSUMED,
        )
            .prop_map(
                |((seq, modid, cmdid), (ip, port), (rc, tcost), level, consumed)| {
                    Request::Report(Report {
                        seq,
                        module: ModuleId::new(modid, cmdid),
                        host: NodeAddr { ip, port },
                        retcode: rc,
                        tcost_ms: tcost,
                        downstream_level: level,
                        consumed,
                    })
                },
            );
        prop_oneof![get_host, report]
    }

    proptest! {
        /// Every valid getHost and report decodes to the same request from
        /// its fixed record as from its FlatBuffers datagram.
        #[test]
        fn fixed_and_flatbuffers_decode_to_the_same_request(req in any_request()) {
            let mut enc = Encoder::new();
            let flat = flat(&mut enc, &req);
            let from_flat = from_message(&decode(&flat, &Limits::UDP).unwrap());
            prop_assert_eq!(from_flat, Some(req));
            prop_assert_eq!(decode_request(&fixed(&req)), Ok(req));
        }

        /// Every getHost answer reads the same from its fixed record as
        /// from the GetHostResp the shard encodes over UDP.
        #[test]
        fn answers_read_the_same_in_both_layouts(
            seq in any::<u32>(),
            modid in any::<u32>(),
            rc in any::<i8>(),
            host in proptest::option::of((any::<u32>(), any::<u16>())),
            level in any_level(),
        ) {
            let a = HostAnswer {
                seq,
                module: ModuleId::new(modid, 3),
                retcode: RetCode(rc),
                host: host.map(|(ip, port)| NodeAddr { ip, port }),
                level,
            };
            let mut enc = Encoder::new();
            let flat = enc.get_host_resp(a.seq, a.module, a.retcode, a.host, a.level).to_vec();
            let Ok(Message::GetHostResp(r)) = decode(&flat, &Limits::UDP) else {
                panic!("a GetHostResp");
            };
            prop_assert_eq!(HostAnswer::from_resp(&r), a);
            let mut out = [0u8; HOST_ANSWER_LEN];
            encode_answer(&a, &mut out);
            prop_assert_eq!(decode_answer(&out), Ok(a));
        }

        /// Any bytes: a clean result, never a panic; and what decodes
        /// encodes back to the same bytes (no two records mean one request).
        #[test]
        fn any_bytes_decode_cleanly(b in proptest::collection::vec(any::<u8>(), 0..48)) {
            if let Ok((req, hint)) = decode_request_hinted(&b) {
                let mut out = [0u8; MAX_LEN];
                let n = encode_request_hinted(&req, hint, &mut out);
                prop_assert_eq!(&out[..n], &b[..]);
            }
            if let Ok((a, hint)) = decode_answer_hinted(&b) {
                let mut out = [0u8; ANSWER_MAX];
                let n = write_answer(&mut out, a.seq, a.module, a.retcode, a.host, a.level, hint);
                prop_assert_eq!(&out[..n], &b[..]);
            }
        }

        /// A hint survives the trip both ways, and a record with it reads
        /// as the same request as without it.
        #[test]
        fn hints_read_back_and_change_nothing_else(req in any_request(), i in any::<u32>()) {
            let hint = match req {
                Request::GetHost(_) => Hint::Ask,
                Request::Report(_) => Hint::Node(i),
            };
            let mut out = [0u8; MAX_LEN];
            let n = encode_request_hinted(&req, hint, &mut out);
            prop_assert_eq!(decode_request_hinted(&out[..n]), Ok((req, hint)));
            prop_assert_eq!(decode_request(&out[..n]), Ok(req));
        }
    }
}
