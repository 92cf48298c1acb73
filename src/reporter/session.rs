//! One agent connection's protocol, sans-IO: bytes in, call status rows and
//! answer bytes out.
//!
//! - Frames are reassembled from any chunks ([`FrameDecoder`]); every
//!   complete frame must be a StatsReport. Anything else (a frame that
//!   does not decode, another message) ends the session: the stream cannot
//!   be trusted past it.
//! - A StatsReport becomes one [`CallStatus`] row per node
//!   ([`rows_from_report`]) and one [`Accepted`] entry; it is answered
//!   StatsAck `seq` only when the shell says the database committed it
//!   ([`Session::settled`] with [`Settled::Committed`]): an ack promises
//!   the rows are stored and the consumed units applied, so a reporter
//!   killed or a database failing over loses nothing acknowledged. A
//!   report whose rows were dropped before the database had them is
//!   answered ErrorResp `Unavailable` (the agent sends it again,
//!   elsewhere if need be); one the store refused, ErrorResp
//!   `BadRequest`. A report whose
//!   content the store could not hold (a node of port 0, a time beyond
//!   what the store keeps) is refused whole with ErrorResp `BadRequest`
//!   naming the fault: the agent drops a refused report rather than
//!   re-send it.
//! - Over mutual TLS the peer is [`Peer::Identified`]: every row's caller
//!   is what its certificate names (whatever the frame says), and its
//!   consumed units are taken only when `tls.consume_allow` names it
//!   (refused ones are counted in [`Fed::consumed_refused`], the report is
//!   still acknowledged: its call statistics are stored).
//! - A report that names its agent run (`agent_start`, not 0) carries a
//!   [`ReportKey`]: its consumed units are applied once however often it
//!   is re-sent ([`lbagent_store::Store::consume_once`]). Its rows carry
//!   the run and the report's `seq`: a row replaces the stored row of its
//!   (module, node, caller) unless that row came from a later report of
//!   the same run ([`CallStatus::supersedes`]), so a re-sent report stores
//!   the same values again, and one that reaches a reporter after a newer
//!   report (through another reporter) changes nothing.

use std::fmt;
use std::net::Ipv4Addr;

use lbagent_model::{ModuleId, NodeAddr};
use lbagent_store::{CallStatus, ReportKey};
use lbagent_wire::{
    decode, fb, write_frame, DecodeError, Encoder, FrameDecoder, FrameError, Limits, Message,
    RetCode, MAX_FRAME_LEN,
};

/// The latest time a row may carry, Unix seconds: what a signed 64-bit
/// column (both stores' `ts`) holds.
pub const MAX_TIME_S: u64 = i64::MAX as u64;

/// Rows kept allocated between reads; a larger report's rows are given back.
const KEEP_ROWS: usize = 16 << 10;

/// Why a StatsReport is refused (ErrorResp `BadRequest`, nothing stored).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefusedReport {
    /// A node of port 0: no service listens there.
    #[error(
        "module {module}: node {node} has port 0: report only nodes of a route (ports 1..=65535)"
    )]
    PortZero {
        /// The module of the node.
        module: ModuleId,
        /// The node.
        node: NodeAddr,
    },
    /// A time the store cannot hold.
    #[error("time_s {0} is beyond {MAX_TIME_S}: send Unix seconds")]
    TimeOutOfRange(u64),
}

impl RefusedReport {
    /// The module at fault, or `[0, 0]` when the fault is the report's.
    pub fn module(&self) -> ModuleId {
        match self {
            RefusedReport::PortZero { module, .. } => *module,
            RefusedReport::TimeOutOfRange(_) => ModuleId::new(0, 0),
        }
    }
}

/// Appends `(module, node, units)` for every node of `report` that says it
/// consumed capacity units for good (a `balance` module's stored
/// resources). Entries of port 0 or 0 units are skipped.
pub fn consumed_from_report(
    report: &fb::StatsReport<'_>,
    out: &mut Vec<(ModuleId, NodeAddr, u32)>,
) {
    for m in report.modules().unwrap_or_default() {
        let module = ModuleId::new(m.modid(), m.cmdid());
        for c in m.consumed().unwrap_or_default() {
            let node = NodeAddr::from(c.host());
            if node.port != 0 && c.count() > 0 {
                out.push((module, node, c.count()));
            }
        }
    }
}

/// How the rows and consumed units of one accepted report ended, as the
/// shell learns it from the writers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Settled {
    /// Committed to the database (or replaced there by a newer row of the
    /// same key, itself committed): answered StatsAck.
    Committed,
    /// The store refused some of it as invalid: answered ErrorResp
    /// `BadRequest` (sending it again would be refused again).
    Rejected,
    /// Some of it was dropped before the database had it (the buffer's
    /// bound while the database was slow or down): answered ErrorResp
    /// `Unavailable`, so that the agent sends it again.
    Dropped,
}

/// One accepted StatsReport, waiting for the database: where its rows and
/// consumed units are in [`Session::rows`] and
/// [`Session::consumed_units`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// The report's `seq`, echoed by its answer.
    pub seq: u64,
    /// Its rows, a range of [`Session::rows`].
    pub rows: std::ops::Range<usize>,
    /// Its consumed units, a range of [`Session::consumed_units`].
    pub consumed: std::ops::Range<usize>,
    /// What names it for good, when its agent says which run it is.
    pub key: Option<ReportKey>,
}

/// Who the peer of a session is, as far as the reporter can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// Plain TCP (loopback, or `tls.insecure`): the frame's caller is
    /// taken, and a caller of 0 becomes the connection's remote IPv4
    /// address when known; consumed units are taken.
    Plain(Option<Ipv4Addr>),
    /// Mutual TLS: `caller` from the certificate (its IPv4 address SAN
    /// matching the connection, 0 when it names none); the frame's caller
    /// is ignored. Consumed units only when `may_consume`.
    Identified {
        /// The caller every row is stamped with.
        caller: u32,
        /// Whether `tls.consume_allow` names the identity.
        may_consume: bool,
    },
}

impl Peer {
    /// The caller of `report`'s rows.
    fn caller(&self, report: &fb::StatsReport<'_>) -> u32 {
        match *self {
            Peer::Plain(peer) => match (report.caller(), peer) {
                (0, Some(ip)) => u32::from(ip),
                (caller, _) => caller,
            },
            Peer::Identified { caller, .. } => caller,
        }
    }

    /// Whether its consumed units are taken.
    fn may_consume(&self) -> bool {
        match *self {
            Peer::Plain(_) => true,
            Peer::Identified { may_consume, .. } => may_consume,
        }
    }
}

/// Appends one row per node of `report` to `out`, all stamped with the
/// report's time, caller, run (`agent_start`) and sequence number (0 when
/// the run is unknown); a caller of 0 (the agent does not know its
/// address) becomes `peer`, the connection's remote IPv4 address, when
/// known. Returns the number of rows appended.
///
/// # Errors
/// [`RefusedReport`] when any node or the time cannot be stored; `out` is
/// then as it was.
pub fn rows_from_report(
    report: &fb::StatsReport<'_>,
    peer: Option<Ipv4Addr>,
    out: &mut Vec<CallStatus>,
) -> Result<usize, RefusedReport> {
    rows_from(report, &Peer::Plain(peer), out)
}

/// [`rows_from_report`] with the caller `peer` gives.
fn rows_from(
    report: &fb::StatsReport<'_>,
    peer: &Peer,
    out: &mut Vec<CallStatus>,
) -> Result<usize, RefusedReport> {
    let ts = report.time_s();
    if ts > MAX_TIME_S {
        return Err(RefusedReport::TimeOutOfRange(ts));
    }
    let caller = peer.caller(report);
    // Which report of which run each row came from, for the store's
    // newest-wins rule (CallStatus::supersedes); unknown without a run.
    let agent_start = report.agent_start();
    let seq = if agent_start == 0 { 0 } else { report.seq() };
    let start = out.len();
    for m in report.modules().unwrap_or_default() {
        let module = ModuleId::new(m.modid(), m.cmdid());
        for n in m.nodes().unwrap_or_default() {
            let node = NodeAddr::from(n.host());
            if node.port == 0 {
                out.truncate(start);
                return Err(RefusedReport::PortZero { module, node });
            }
            out.push(CallStatus {
                module,
                node,
                caller,
                succ: n.succ(),
                err: n.err(),
                ts,
                overload: n.overloaded(),
                agent_start,
                seq,
            });
        }
    }
    Ok(out.len() - start)
}

/// Why a session ended: the stream is not a sequence of StatsReports.
#[derive(Clone, Debug, PartialEq)]
pub enum BadFrame {
    /// The framing is broken (length 0 or above the limit).
    Frame(FrameError),
    /// A frame is not an lbagent message.
    Decode(DecodeError),
    /// A well-formed message that has no business here.
    Unexpected(&'static str),
}

impl fmt::Display for BadFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadFrame::Frame(e) => write!(f, "{e}"),
            BadFrame::Decode(e) => write!(f, "{e}"),
            BadFrame::Unexpected(name) => write!(f, "{name} is not a StatsReport"),
        }
    }
}

/// What one [`Session::feed`] found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fed {
    /// StatsReports accepted (their rows are in [`Session::rows`]).
    pub reports: u64,
    /// StatsReports refused (answered ErrorResp).
    pub refused: u64,
    /// The last refusal, for the log.
    pub last_refusal: Option<RefusedReport>,
    /// Consumed-units entries refused: the identity is not on
    /// `tls.consume_allow`.
    pub consumed_refused: u64,
    /// Set when the session must end (after its rows are queued and its
    /// answers written).
    pub bad: Option<BadFrame>,
}

/// The protocol state of one agent connection.
#[derive(Debug)]
pub struct Session {
    frames: FrameDecoder,
    enc: Encoder,
    peer: Peer,
    consumed: Vec<(ModuleId, NodeAddr, u32)>,
    rows: Vec<CallStatus>,
    accepted: Vec<Accepted>,
    out: Vec<u8>,
    broken: Option<BadFrame>,
}

impl Session {
    /// A session with an agent at `peer` (its remote IPv4 address, when
    /// known: the caller of reports that name none).
    pub fn new(peer: Option<Ipv4Addr>) -> Self {
        Session::with_peer(Peer::Plain(peer))
    }

    /// A session with `peer` (see [`Peer`]).
    pub fn with_peer(peer: Peer) -> Self {
        Session {
            frames: FrameDecoder::new(MAX_FRAME_LEN),
            enc: Encoder::new(),
            peer,
            consumed: Vec::new(),
            rows: Vec::new(),
            accepted: Vec::new(),
            out: Vec::new(),
            broken: None,
        }
    }

    /// Takes bytes read from the connection: every complete frame is
    /// handled, an accepted report's rows appended to [`Self::rows`] and
    /// its entry to [`Self::accepted`] (its answer waits for
    /// [`Self::settled`]), a refusal written to [`Self::out`]. After a bad
    /// frame nothing more is read.
    pub fn feed(&mut self, bytes: &[u8]) -> Fed {
        let mut fed = Fed::default();
        if let Some(bad) = &self.broken {
            fed.bad = Some(bad.clone());
            return fed;
        }
        self.frames.feed(bytes);
        loop {
            let frame = match self.frames.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    fed.bad = Some(BadFrame::Frame(e));
                    break;
                }
            };
            let report = match decode(frame, &Limits::TCP_FRAME) {
                Ok(Message::StatsReport(r)) => r,
                Ok(other) => {
                    fed.bad = Some(BadFrame::Unexpected(other.name()));
                    break;
                }
                Err(e) => {
                    fed.bad = Some(BadFrame::Decode(e));
                    break;
                }
            };
            let seq = report.seq();
            let first_row = self.rows.len();
            match rows_from(&report, &self.peer, &mut self.rows) {
                Ok(_) => {
                    fed.reports += 1;
                    let before = self.consumed.len();
                    consumed_from_report(&report, &mut self.consumed);
                    if !self.peer.may_consume() {
                        fed.consumed_refused += (self.consumed.len() - before) as u64;
                        self.consumed.truncate(before);
                    }
                    let key = (report.agent_start() != 0).then(|| ReportKey {
                        caller: self.peer.caller(&report),
                        agent_start: report.agent_start(),
                        seq,
                    });
                    self.accepted.push(Accepted {
                        seq,
                        rows: first_row..self.rows.len(),
                        consumed: before..self.consumed.len(),
                        key,
                    });
                }
                Err(refusal) => {
                    fed.refused += 1;
                    let message = refusal.to_string();
                    let answer =
                        self.enc
                            .error_resp(seq, refusal.module(), RetCode::BadRequest, &message);
                    fed.last_refusal = Some(refusal);
                    // An error of a few dozen bytes always fits a frame.
                    let _ = write_frame(&mut self.out, answer);
                }
            }
        }
        self.broken.clone_from(&fed.bad);
        fed
    }

    /// Bytes received that do not make a whole frame yet.
    pub fn buffered(&self) -> usize {
        self.frames.buffered()
    }

    /// The rows of the reports accepted since the last [`Self::consumed`].
    pub fn rows(&self) -> &[CallStatus] {
        &self.rows
    }

    /// The reports accepted since the last [`Self::consumed`], in order.
    pub fn accepted(&self) -> &[Accepted] {
        &self.accepted
    }

    /// Report `seq` (accepted earlier on this session) ended as `how`:
    /// its answer is appended to [`Self::out`] (StatsAck when committed,
    /// ErrorResp otherwise, see [`Settled`]).
    pub fn settled(&mut self, seq: u64, how: Settled) {
        let answer = match how {
            Settled::Committed => self.enc.stats_ack(seq),
            Settled::Rejected => self.enc.error_resp(
                seq,
                ModuleId::new(0, 0),
                RetCode::BadRequest,
                "the store refused this report's rows as invalid; they are dropped",
            ),
            Settled::Dropped => self.enc.error_resp(
                seq,
                ModuleId::new(0, 0),
                RetCode::Unavailable,
                "the reporter dropped this report before the database had it (its buffer was full while the database was slow or down): send it again",
            ),
        };
        // An ack or an error of a few dozen bytes always fits a frame.
        let _ = write_frame(&mut self.out, answer);
    }

    /// The answers written: forget them (the rows and reports stay).
    pub fn sent(&mut self) {
        self.out.clear();
        if self.out.capacity() > KEEP_ROWS {
            self.out.shrink_to(KEEP_ROWS);
        }
    }

    /// The `(module, node, units)` consumed for good that the reports
    /// accepted since the last [`Self::consumed`] carried.
    pub fn consumed_units(&self) -> &[(ModuleId, NodeAddr, u32)] {
        &self.consumed
    }

    /// The answers to write, in order, since the last [`Self::consumed`].
    pub fn out(&self) -> &[u8] {
        &self.out
    }

    /// The rows and reports were queued and the answers written: forget
    /// them.
    pub fn consumed(&mut self) {
        self.consumed.clear();
        self.accepted.clear();
        self.rows.clear();
        if self.rows.capacity() > KEEP_ROWS {
            self.rows.shrink_to(KEEP_ROWS);
        }
        self.out.clear();
        if self.out.capacity() > KEEP_ROWS {
            self.out.shrink_to(KEEP_ROWS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_wire::{ModuleStats, NodeStats};

    fn node(port: u16, succ: u32, err: u32, overloaded: bool) -> NodeStats {
        NodeStats {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), port),
            succ,
            err,
            overloaded,
        }
    }

    fn report_frame(seq: u64, caller: u32, time_s: u64, modules: &[ModuleStats<'_>]) -> Vec<u8> {
        let mut enc = Encoder::new();
        let mut out = Vec::new();
        write_frame(&mut out, enc.stats_report(seq, caller, time_s, modules)).unwrap();
        out
    }

    /// The answers in `bytes`: `Ok(seq)` for a StatsAck, `Err((seq, code))`
    /// for an ErrorResp.
    fn answers(bytes: &[u8]) -> Vec<Result<u64, (u64, RetCode)>> {
        let mut frames = FrameDecoder::default();
        frames.feed(bytes);
        let mut out = Vec::new();
        while let Some(f) = frames.next_frame().unwrap() {
            match decode(f, &Limits::TCP_FRAME).unwrap() {
                Message::StatsAck(a) => out.push(Ok(a.seq())),
                Message::ErrorResp(e) => out.push(Err((e.seq(), e.retcode()))),
                other => panic!("unexpected answer {}", other.name()),
            }
        }
        out
    }

    #[test]
    fn a_report_becomes_one_row_per_node_with_its_time_and_caller() {
        let a = [node(80, 10, 1, false), node(81, 0, 7, true)];
        let b = [node(90, 3, 0, false)];
        let modules = [
            ModuleStats {
                module: ModuleId::new(1, 2),
                nodes: &a,
                consumed: &[],
            },
            ModuleStats {
                module: ModuleId::new(3, 4),
                nodes: &b,
                consumed: &[],
            },
            ModuleStats {
                module: ModuleId::new(5, 6),
                nodes: &[],
                consumed: &[],
            },
        ];
        let mut s = Session::new(Some(Ipv4Addr::new(192, 168, 0, 9)));
        let fed = s.feed(&report_frame(41, 0x0a00_0007, 1_700_000_000, &modules));
        assert_eq!(fed.reports, 1);
        assert_eq!(fed.bad, None);
        let want = |module, n: &NodeStats| CallStatus {
            module,
            node: n.addr,
            caller: 0x0a00_0007,
            succ: n.succ,
            err: n.err,
            ts: 1_700_000_000,
            overload: n.overloaded,
            agent_start: 0,
            seq: 0,
        };
        assert_eq!(
            s.rows(),
            [
                want(ModuleId::new(1, 2), &a[0]),
                want(ModuleId::new(1, 2), &a[1]),
                want(ModuleId::new(3, 4), &b[0]),
            ]
        );
        assert!(s.out().is_empty(), "no answer before the database has it");
        assert_eq!(
            s.accepted(),
            [Accepted {
                seq: 41,
                rows: 0..3,
                consumed: 0..0,
                key: None,
            }]
        );
        s.settled(41, Settled::Committed);
        assert_eq!(answers(s.out()), [Ok(41)]);
        s.consumed();
        assert!(s.rows().is_empty() && s.out().is_empty() && s.accepted().is_empty());
    }

    #[test]
    fn a_report_is_answered_as_it_settled() {
        let mut s = Session::new(None);
        s.settled(1, Settled::Committed);
        s.settled(2, Settled::Dropped);
        s.settled(3, Settled::Rejected);
        assert_eq!(
            answers(s.out()),
            [
                Ok(1),
                Err((2, RetCode::Unavailable)),
                Err((3, RetCode::BadRequest))
            ]
        );
        s.sent();
        assert!(s.out().is_empty());
    }

    #[test]
    fn a_report_naming_its_run_carries_the_key_of_its_consumed_units() {
        let nodes = [node(80, 1, 0, false)];
        let consumed = [(NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), 80), 3)];
        let modules = [ModuleStats {
            module: ModuleId::new(1, 1),
            nodes: &nodes,
            consumed: &consumed,
        }];
        let mut enc = Encoder::new();
        let mut stream = Vec::new();
        write_frame(
            &mut stream,
            enc.stats_report_of_run(5, 0x0a00_0007, 9, 0xabcd, &modules),
        )
        .unwrap();
        stream.extend(report_frame(6, 0x0a00_0007, 9, &modules));
        let mut s = Session::with_peer(Peer::Identified {
            caller: 0x0a00_0008,
            may_consume: true,
        });
        s.feed(&stream);
        let key = ReportKey {
            caller: 0x0a00_0008,
            agent_start: 0xabcd,
            seq: 5,
        };
        assert_eq!(
            s.accepted()[0].key,
            Some(key),
            "the caller it is stored under"
        );
        assert_eq!(s.accepted()[0].consumed, 0..1);
        assert_eq!(s.accepted()[1].key, None, "an agent that names no run");
        assert_eq!(s.accepted()[1].consumed, 1..2);
        // Its rows carry the run and the report, for the store's
        // newest-wins rule; a report of no run carries neither.
        let order = |r: &CallStatus| (r.agent_start, r.seq);
        assert_eq!(
            s.rows().iter().map(order).collect::<Vec<_>>(),
            [(0xabcd, 5), (0, 0)]
        );
    }

    #[test]
    fn a_report_without_a_caller_is_stamped_with_the_peer_address() {
        let nodes = [node(80, 1, 0, false)];
        let modules = [ModuleStats {
            module: ModuleId::new(1, 1),
            nodes: &nodes,
            consumed: &[],
        }];
        let mut s = Session::new(Some(Ipv4Addr::new(192, 168, 0, 9)));
        s.feed(&report_frame(1, 0, 5, &modules));
        assert_eq!(s.rows()[0].caller, 0xc0a8_0009);
        let mut unknown = Session::new(None);
        unknown.feed(&report_frame(1, 0, 5, &modules));
        assert_eq!(unknown.rows()[0].caller, 0);
    }

    #[test]
    fn an_identified_peer_is_the_caller_whatever_the_frame_says_and_consumes_only_if_allowed() {
        let nodes = [node(80, 1, 0, false)];
        let consumed = [(NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), 80), 3)];
        let modules = [ModuleStats {
            module: ModuleId::new(1, 1),
            nodes: &nodes,
            consumed: &consumed,
        }];
        let frame = report_frame(1, 0x0101_0101, 5, &modules);
        let mut denied = Session::with_peer(Peer::Identified {
            caller: 0x0a00_0007,
            may_consume: false,
        });
        let fed = denied.feed(&frame);
        assert_eq!((fed.reports, fed.consumed_refused), (1, 1));
        assert_eq!(
            denied.rows()[0].caller,
            0x0a00_0007,
            "not the frame's 1.1.1.1"
        );
        assert!(denied.consumed_units().is_empty());
        let mut allowed = Session::with_peer(Peer::Identified {
            caller: 0,
            may_consume: true,
        });
        let fed = allowed.feed(&frame);
        assert_eq!(fed.consumed_refused, 0);
        assert_eq!(
            allowed.rows()[0].caller,
            0,
            "a certificate naming no address"
        );
        assert_eq!(allowed.consumed_units().len(), 1);
    }

    #[test]
    fn pipelined_reports_split_anywhere_are_each_acked_in_order() {
        let nodes = [node(80, 1, 0, false), node(81, 2, 0, false)];
        let modules = [ModuleStats {
            module: ModuleId::new(7, 1),
            nodes: &nodes,
            consumed: &[],
        }];
        let mut stream = Vec::new();
        for seq in 1..=3 {
            stream.extend(report_frame(seq, 9, 100 + seq, &modules));
        }
        for cut in 0..=stream.len() {
            let mut s = Session::new(None);
            let first = s.feed(&stream[..cut]);
            let second = s.feed(&stream[cut..]);
            assert_eq!(first.reports + second.reports, 3, "cut at {cut}");
            let seqs: Vec<u64> = s.accepted().iter().map(|a| a.seq).collect();
            assert_eq!(seqs, [1, 2, 3]);
            let times: Vec<u64> = s.rows().iter().map(|r| r.ts).collect();
            assert_eq!(times, [101, 101, 102, 102, 103, 103]);
        }
    }

    #[test]
    fn a_report_the_store_cannot_hold_is_refused_whole_and_the_session_goes_on() {
        let nodes = [node(80, 1, 0, false), node(0, 1, 0, false)];
        let modules = [ModuleStats {
            module: ModuleId::new(4, 2),
            nodes: &nodes,
            consumed: &[],
        }];
        let good = [node(80, 1, 0, false)];
        let good_modules = [ModuleStats {
            module: ModuleId::new(4, 2),
            nodes: &good,
            consumed: &[],
        }];
        let mut stream = report_frame(1, 9, 5, &modules);
        stream.extend(report_frame(2, 9, MAX_TIME_S + 1, &good_modules));
        stream.extend(report_frame(3, 9, MAX_TIME_S, &good_modules));
        let mut s = Session::new(None);
        let fed = s.feed(&stream);
        assert_eq!((fed.reports, fed.refused, fed.bad), (1, 2, None));
        assert_eq!(
            fed.last_refusal,
            Some(RefusedReport::TimeOutOfRange(MAX_TIME_S + 1))
        );
        assert_eq!(s.rows().len(), 1, "only report 3's row");
        assert_eq!(s.rows()[0].ts, MAX_TIME_S);
        assert_eq!(
            answers(s.out()),
            [Err((1, RetCode::BadRequest)), Err((2, RetCode::BadRequest))]
        );
        assert_eq!(s.accepted().len(), 1);
        assert_eq!(
            (s.accepted()[0].seq, s.accepted()[0].rows.clone()),
            (3, 0..1)
        );
        let port_zero = RefusedReport::PortZero {
            module: ModuleId::new(4, 2),
            node: nodes[1].addr,
        };
        assert_eq!(port_zero.module(), ModuleId::new(4, 2));
        assert!(port_zero.to_string().contains("10.0.0.1:0 has port 0"));
    }

    #[test]
    fn a_bad_frame_ends_the_session_after_the_good_ones_before_it() {
        let nodes = [node(80, 1, 0, false)];
        let modules = [ModuleStats {
            module: ModuleId::new(1, 1),
            nodes: &nodes,
            consumed: &[],
        }];
        let mut stream = report_frame(1, 9, 5, &modules);
        write_frame(&mut stream, b"this is no flatbuffer at all").unwrap();
        stream.extend(report_frame(2, 9, 5, &modules));
        let mut s = Session::new(None);
        let fed = s.feed(&stream);
        assert_eq!(fed.reports, 1);
        assert!(matches!(
            fed.bad,
            Some(BadFrame::Decode(DecodeError::BadIdentifier { .. }))
        ));
        assert_eq!(s.accepted()[0].seq, 1);
        assert_eq!(s.rows().len(), 1);
        s.consumed();
        let again = s.feed(&report_frame(3, 9, 5, &modules));
        assert!(again.bad.is_some(), "nothing is read past a bad frame");
        assert_eq!(again.reports, 0);
    }

    #[test]
    fn broken_framing_and_other_messages_end_the_session() {
        let mut zero = Session::new(None);
        let fed = zero.feed(&[0, 0, 0, 0]);
        assert_eq!(fed.bad, Some(BadFrame::Frame(FrameError::Empty)));
        let mut huge = Session::new(None);
        let fed = huge.feed(&u32::MAX.to_le_bytes());
        assert!(matches!(
            fed.bad,
            Some(BadFrame::Frame(FrameError::Oversized { .. }))
        ));
        let mut other = Session::new(None);
        let mut stream = Vec::new();
        write_frame(&mut stream, Encoder::new().stats_ack(3)).unwrap();
        let fed = other.feed(&stream);
        assert_eq!(fed.bad, Some(BadFrame::Unexpected("StatsAck")));
        assert_eq!(
            fed.bad.unwrap().to_string(),
            "StatsAck is not a StatsReport"
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2000 {
            let len = rng.usize(0..64);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            if rng.bool() && bytes.len() >= 4 {
                let n = (bytes.len() - 4) as u32;
                bytes[..4].copy_from_slice(&n.to_le_bytes());
            }
            let mut s = Session::new(None);
            let _ = s.feed(&bytes);
        }
    }
}
