//! One agent connection's protocol, without I/O: bytes read in, answer
//! bytes out, subscriptions recorded.
//!
//! The runtime reads whatever the socket has, hands it to
//! [`Session::on_read`] with the executor's table and registry, and writes
//! everything appended to `out` in one write: the answers to every frame of
//! one read leave together. Frames split across reads wait in the
//! session's [`FrameDecoder`].
//!
//! - `PullReq{seq, modules}`: one RouteAnswer per module, echoing `seq`
//!   (`exists = false` for a module the table does not hold), and the
//!   connection subscribes to each module. With `known_versions` (the
//!   versions the agent holds), every module still at the version held is
//!   left out of the RouteAnswers and named instead in one RouteUnchanged
//!   echoing `seq`, after them: a re-pull of an unchanged module sends no
//!   node. Before the first load from the
//!   store the answers are held instead: the connection subscribes, and
//!   the first load pushes every subscribed module.
//! - `KeepAlive{seq}`: a KeepAliveAck echoing `seq`.
//! - `Unsubscribe{modules}`: the connection's subscriptions to them are
//!   dropped (the agent forgot the modules); no answer.
//! - A PullReq with no modules, or too many: an ErrorResp (BadRequest);
//!   the connection stays.
//! - Anything else closes the connection after an ErrorResp saying why: a
//!   length prefix of 0 or above [`MAX_REQUEST_LEN`], a frame that does not
//!   decode, a message that is not a route server request.

use std::fmt;

use super::metrics::{CloseKind, Counters};
use super::subs::{ConnId, Registry, Subscribed};
use super::table::RouteTable;
use lbagent_model::ModuleId;
use lbagent_wire::{
    decode, write_frame, DecodeError, Encoder, FrameDecoder, FrameError, Limits, Message, RetCode,
    ValidationError,
};

/// The longest request frame accepted: 1 MiB, twice a PullReq naming the
/// most modules allowed (65536 x 8 bytes). A longer length prefix closes
/// the connection before its payload is buffered.
pub const MAX_REQUEST_LEN: usize = 1 << 20;

const LIMITS: Limits = Limits::new(MAX_REQUEST_LEN);

/// Why a connection is closed.
#[derive(Debug)]
pub enum CloseReason {
    /// The peer closed it.
    PeerClosed,
    /// The byte stream is not a sequence of frames.
    Frame(FrameError),
    /// A frame is not a message.
    Decode(DecodeError),
    /// A message a route server is never sent.
    Unexpected(&'static str),
    /// Silent past the idle timeout.
    Idle,
    /// Pushes piled up for a peer that does not read.
    SlowReader,
    /// A socket call failed.
    Io(std::io::Error),
    /// The route server is stopping.
    Shutdown,
}

impl CloseReason {
    /// The metric kind.
    pub fn kind(&self) -> CloseKind {
        match self {
            CloseReason::PeerClosed => CloseKind::Peer,
            CloseReason::Frame(_) => CloseKind::BadFrame,
            CloseReason::Decode(_) => CloseKind::Undecodable,
            CloseReason::Unexpected(_) => CloseKind::Unexpected,
            CloseReason::Idle => CloseKind::Idle,
            CloseReason::SlowReader => CloseKind::SlowReader,
            CloseReason::Io(_) => CloseKind::Io,
            CloseReason::Shutdown => CloseKind::Shutdown,
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::PeerClosed => f.write_str("the peer closed the connection"),
            CloseReason::Frame(e) => write!(f, "bad frame: {e}"),
            CloseReason::Decode(e) => write!(f, "undecodable frame: {e}"),
            CloseReason::Unexpected(name) => write!(
                f,
                "{name} does not belong on a route server connection: send PullReq or KeepAlive"
            ),
            CloseReason::Idle => f.write_str("silent past dnsserver.idle_timeout"),
            CloseReason::SlowReader => f.write_str("pushes piled up unread"),
            CloseReason::Io(e) => write!(f, "socket error: {e}"),
            CloseReason::Shutdown => f.write_str("the route server is stopping"),
        }
    }
}

/// What a session needs from its executor while it handles one read.
pub struct Ctx<'a, T> {
    /// The routes served.
    pub table: &'a RouteTable,
    /// The executor's connections and subscriptions.
    pub registry: &'a mut Registry<T>,
    /// The executor's encoder (for answers not pre-encoded).
    pub enc: &'a mut Encoder,
    /// The executor's counters.
    pub counters: &'a mut Counters,
    /// The executor's coarse clock, milliseconds.
    pub now: u64,
}

/// One connection's reassembly buffer and identity.
#[derive(Debug)]
pub struct Session {
    id: ConnId,
    frames: FrameDecoder,
}

impl Session {
    /// The session of connection `id`.
    pub fn new(id: ConnId) -> Self {
        Session {
            id,
            frames: FrameDecoder::new(MAX_REQUEST_LEN),
        }
    }

    /// The connection's id in the registry.
    pub fn id(&self) -> ConnId {
        self.id
    }

    /// Bytes received that do not make a whole frame yet.
    pub fn buffered(&self) -> usize {
        self.frames.buffered()
    }

    /// Handles `bytes` read from the connection: appends the answer to
    /// every complete frame to `out`, subscribes, and stamps the connection
    /// as heard from when a frame completed.
    ///
    /// # Errors
    /// The reason to close the connection (a bad frame, an undecodable or
    /// unexpected message), after appending the answers to the frames
    /// before it and an ErrorResp that says why.
    pub fn on_read<T>(
        &mut self,
        bytes: &[u8],
        ctx: &mut Ctx<'_, T>,
        out: &mut Vec<u8>,
    ) -> Result<(), CloseReason> {
        self.frames.feed(bytes);
        let mut heard = false;
        let result = loop {
            let frame = match self.frames.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break Ok(()),
                Err(e) => break Err(CloseReason::Frame(e)),
            };
            heard = true;
            if let Err(e) = handle(self.id, frame, ctx, out) {
                break Err(e);
            }
        };
        if heard {
            ctx.registry.touch(self.id, ctx.now);
        }
        if let Err(reason) = &result {
            let message = format!("{reason}; closing the connection");
            let frame = ctx
                .enc
                .error_resp(0, ModuleId::new(0, 0), RetCode::BadRequest, &message);
            let _ = write_frame(out, frame);
        }
        result
    }
}

/// Answers one frame.
fn handle<T>(
    id: ConnId,
    frame: &[u8],
    ctx: &mut Ctx<'_, T>,
    out: &mut Vec<u8>,
) -> Result<(), CloseReason> {
    match decode(frame, &LIMITS).map_err(CloseReason::Decode)? {
        Message::PullReq(req) => {
            let pull = match req.validate() {
                Ok(pull) => pull,
                Err(e) => {
                    ctx.counters.bad_requests += 1;
                    let message = match e {
                        ValidationError::VersionCount { .. } => e.to_string(),
                        _ => format!("{e}: name 1..=65536 modules per PullReq"),
                    };
                    let frame = ctx.enc.error_resp(
                        req.seq(),
                        ModuleId::new(0, 0),
                        RetCode::BadRequest,
                        &message,
                    );
                    write(out, frame);
                    return Ok(());
                }
            };
            ctx.counters.pull_reqs += 1;
            let seq = pull.seq;
            let mut unheld = None;
            // The first module not subscribed, the bound it met, how many.
            let mut unsubscribed: Option<(ModuleId, Subscribed, u32)> = None;
            // Modules still at the version the agent holds, and that version.
            let (mut same, mut same_versions) = (Vec::new(), Vec::new());
            for (module, known) in pull.modules_known() {
                ctx.counters.pulls += 1;
                let subscribed = ctx.registry.subscribe(id, module);
                let refused = matches!(subscribed, Subscribed::Full | Subscribed::TotalFull);
                if refused {
                    if subscribed == Subscribed::Full {
                        ctx.counters.subscriptions_refused += 1;
                    } else {
                        ctx.counters.subscriptions_refused_total_bound += 1;
                    }
                    unsubscribed.get_or_insert((module, subscribed, 0)).2 += 1;
                }
                if !ctx.table.is_loaded() {
                    if refused {
                        unheld.get_or_insert(module);
                    } else {
                        ctx.counters.pulls_held += 1;
                    }
                    continue;
                }
                match ctx.table.get(module) {
                    Some(entry) if known.is_some_and(|v| v != 0 && v == entry.version) => {
                        same.push(module);
                        same_versions.push(entry.version);
                    }
                    Some(entry) => {
                        entry.write_answer(seq, out);
                        ctx.counters.answers += 1;
                        ctx.counters.answer_nodes += entry.nodes.len() as u64;
                    }
                    None => {
                        write(out, ctx.enc.route_answer(seq, module, false, 0, &[]));
                        ctx.counters.answers_unknown += 1;
                    }
                }
            }
            if !same.is_empty() {
                // At most MAX_PULL_MODULES x 16 bytes: far below a frame.
                write(out, ctx.enc.route_unchanged(seq, &same, &same_versions));
                ctx.counters.unchanged += same.len() as u64;
                ctx.counters.unchanged_frames += 1;
            }
            if let Some(module) = unheld {
                // Neither answered nor subscribed: the agent must hear why.
                let message = "no route is loaded yet and the route server holds the most \
                               subscriptions allowed: pull again later";
                let frame = ctx
                    .enc
                    .error_resp(seq, module, RetCode::Unavailable, message);
                write(out, frame);
            } else if let Some((module, bound, n)) = unsubscribed {
                // Answered, but no push will follow: the agent must hear why.
                let which = if bound == Subscribed::Full {
                    "this connection holds dnsserver.max_subscriptions_per_connection"
                } else {
                    "the route server holds dnsserver.max_subscriptions"
                };
                let message = format!(
                    "{n} module(s) answered but not subscribed, the first {module}: {which}; \
                     changes to them are not pushed: pull them again to refresh"
                );
                let frame = ctx
                    .enc
                    .error_resp(seq, module, RetCode::Unavailable, &message);
                write(out, frame);
            }
            Ok(())
        }
        Message::Unsubscribe(m) => {
            for module in m.modules().into_iter().flatten() {
                let module = ModuleId::new(module.modid(), module.cmdid());
                if ctx.registry.unsubscribe(id, module) {
                    ctx.counters.unsubscribes += 1;
                }
            }
            Ok(())
        }
        Message::KeepAlive(m) => {
            ctx.counters.keepalives += 1;
            write(out, ctx.enc.keep_alive_ack(m.seq()));
            Ok(())
        }
        other => Err(CloseReason::Unexpected(other.name())),
    }
}

/// Appends one encoded message as a frame. Every message written here is
/// far below the frame limit (answers of unknown modules, acks, errors).
fn write(out: &mut Vec<u8>, payload: &[u8]) {
    write_frame(out, payload).expect("a small message fits a frame");
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_model::{NodeAddr, RouteNode};
    use lbagent_store::{ModuleRoute, RouteSet};
    use std::net::Ipv4Addr;

    const A: ModuleId = ModuleId::new(10, 1);
    const B: ModuleId = ModuleId::new(20, 2);
    const UNKNOWN: ModuleId = ModuleId::new(99, 9);

    fn nodes(n: u8) -> Vec<RouteNode> {
        (1..=n)
            .map(|i| RouteNode {
                addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 8000),
                weight: u32::from(i),
            })
            .collect()
    }

    fn table() -> RouteTable {
        let set = RouteSet {
            version: 7,
            modules: vec![
                ModuleRoute {
                    module: A,
                    version: 5,
                    nodes: nodes(3),
                    policy: lbagent_model::Policy::L5,
                    options: Default::default(),
                    meta: vec![],
                },
                ModuleRoute {
                    module: B,
                    version: 7,
                    nodes: nodes(1),
                    options: Default::default(),
                    policy: lbagent_model::Policy::L5,
                    meta: vec![],
                },
            ],
        };
        RouteTable::unloaded()
            .replace_all(set, &mut Encoder::new())
            .table
    }

    /// A server side for one connection.
    struct Harness {
        table: RouteTable,
        registry: Registry<()>,
        enc: Encoder,
        counters: Counters,
        session: Session,
    }

    impl Harness {
        fn new(table: RouteTable) -> Self {
            let mut registry = Registry::new(30_000, 4);
            let id = registry.open((), 0);
            Harness {
                table,
                registry,
                enc: Encoder::new(),
                counters: Counters::default(),
                session: Session::new(id),
            }
        }

        fn read(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Result<(), CloseReason> {
            let mut ctx = Ctx {
                table: &self.table,
                registry: &mut self.registry,
                enc: &mut self.enc,
                counters: &mut self.counters,
                now: 1_000,
            };
            self.session.on_read(bytes, &mut ctx, out)
        }
    }

    #[derive(Debug, PartialEq)]
    enum Reply {
        Answer {
            seq: u64,
            module: ModuleId,
            exists: bool,
            version: u64,
            nodes: usize,
        },
        Ack(u64),
        Error(u64, RetCode),
        Unchanged(u64, Vec<(ModuleId, u64)>),
    }

    fn replies(bytes: &[u8]) -> Vec<Reply> {
        let mut frames = FrameDecoder::default();
        frames.feed(bytes);
        let mut out = Vec::new();
        while let Some(frame) = frames.next_frame().unwrap() {
            out.push(match decode(frame, &Limits::TCP_FRAME).unwrap() {
                Message::RouteAnswer(a) => Reply::Answer {
                    seq: a.seq(),
                    module: ModuleId::new(a.modid(), a.cmdid()),
                    exists: a.exists(),
                    version: a.version(),
                    nodes: a.nodes().map_or(0, |n| n.len()),
                },
                Message::KeepAliveAck(k) => Reply::Ack(k.seq()),
                Message::ErrorResp(e) => Reply::Error(e.seq(), e.retcode()),
                Message::RouteUnchanged(u) => {
                    let u = u.validate().unwrap();
                    Reply::Unchanged(u.seq, u.modules().collect())
                }
                other => panic!("unexpected {}", other.name()),
            });
        }
        assert_eq!(frames.buffered(), 0, "only whole frames");
        out
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame(&mut out, payload).unwrap();
        out
    }

    fn answer(seq: u64, module: ModuleId, version: u64, nodes: usize) -> Reply {
        Reply::Answer {
            seq,
            module,
            exists: true,
            version,
            nodes,
        }
    }

    #[test]
    fn a_versioned_pull_names_unchanged_modules_in_one_frame_without_nodes() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        // A is held at its current version, B at an older one, UNKNOWN at
        // none: only A is unchanged.
        let req = frame(Encoder::new().pull_req_known(8, &[A, B, UNKNOWN], &[5, 6, 0]));
        h.read(&req, &mut out).unwrap();
        assert_eq!(
            replies(&out),
            vec![
                answer(8, B, 7, 1),
                Reply::Answer {
                    seq: 8,
                    module: UNKNOWN,
                    exists: false,
                    version: 0,
                    nodes: 0
                },
                Reply::Unchanged(8, vec![(A, 5)]),
            ]
        );
        assert_eq!(h.counters.unchanged, 1);
        assert_eq!(h.counters.unchanged_frames, 1);
        assert_eq!(
            h.counters.answer_nodes, 1,
            "B's one node, none of A's three"
        );
        // Unchanged modules are subscribed as any pull.
        assert!(h.registry.is_subscribed(h.session.id(), A));
    }

    #[test]
    fn a_re_pull_of_unchanged_modules_sends_no_node_at_all() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let req = frame(Encoder::new().pull_req_known(9, &[A, B], &[5, 7]));
        h.read(&req, &mut out).unwrap();
        assert_eq!(
            replies(&out),
            vec![Reply::Unchanged(9, vec![(A, 5), (B, 7)])]
        );
        assert_eq!(h.counters.answer_nodes, 0);
        assert_eq!(h.counters.answers, 0);
    }

    #[test]
    fn an_old_peers_pull_without_versions_is_answered_in_full() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let req = frame(Encoder::new().pull_req(3, &[A, B]));
        h.read(&req, &mut out).unwrap();
        assert_eq!(replies(&out), vec![answer(3, A, 5, 3), answer(3, B, 7, 1)]);
        assert_eq!(h.counters.unchanged_frames, 0);
        assert_eq!(h.counters.answer_nodes, 4);
    }

    #[test]
    fn a_pull_with_a_version_count_that_is_not_the_module_count_is_refused() {
        use flatbuffers::FlatBufferBuilder;
        let mut fbb = FlatBufferBuilder::new();
        let modules = fbb.create_vector(&[lbagent_wire::fb::ModuleId::from(A)]);
        let known_versions = fbb.create_vector(&[5u64, 6]);
        let args = lbagent_wire::fb::PullReqArgs {
            seq: 4,
            modules: Some(modules),
            known_versions: Some(known_versions),
        };
        let body = lbagent_wire::fb::PullReq::create(&mut fbb, &args).as_union_value();
        let env = lbagent_wire::fb::Envelope::create(
            &mut fbb,
            &lbagent_wire::fb::EnvelopeArgs {
                body_type: lbagent_wire::fb::Body::PullReq,
                body: Some(body),
            },
        );
        lbagent_wire::fb::finish_envelope_buffer(&mut fbb, env);
        let mut out = Vec::new();
        h_read_ok(&frame(fbb.finished_data()), &mut out);
        assert_eq!(replies(&out), vec![Reply::Error(4, RetCode::BadRequest)]);
    }

    fn h_read_ok(req: &[u8], out: &mut Vec<u8>) {
        let mut h = Harness::new(table());
        h.read(req, out).unwrap();
        assert_eq!(h.counters.bad_requests, 1);
    }

    #[test]
    fn a_pull_gets_one_answer_per_module_echoing_seq() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let req = frame(Encoder::new().pull_req(41, &[A, UNKNOWN, B]));
        h.read(&req, &mut out).unwrap();
        assert_eq!(
            replies(&out),
            vec![
                answer(41, A, 5, 3),
                Reply::Answer {
                    seq: 41,
                    module: UNKNOWN,
                    exists: false,
                    version: 0,
                    nodes: 0
                },
                answer(41, B, 7, 1),
            ]
        );
        let id = h.session.id();
        for m in [A, B, UNKNOWN] {
            assert!(h.registry.is_subscribed(id, m), "{m}");
        }
        assert_eq!((h.counters.pull_reqs, h.counters.pulls), (1, 3));
        assert_eq!((h.counters.answers, h.counters.answers_unknown), (2, 1));
    }

    #[test]
    fn many_frames_in_one_read_are_answered_in_order() {
        let mut h = Harness::new(table());
        let mut enc = Encoder::new();
        let mut bytes = Vec::new();
        for seq in 1..=50u64 {
            let module = if seq % 2 == 0 { A } else { B };
            write_frame(&mut bytes, enc.pull_req(seq, &[module])).unwrap();
        }
        write_frame(&mut bytes, enc.keep_alive(51)).unwrap();
        let mut out = Vec::new();
        h.read(&bytes, &mut out).unwrap();
        let got = replies(&out);
        assert_eq!(got.len(), 51);
        for (i, r) in got[..50].iter().enumerate() {
            let seq = i as u64 + 1;
            let want = if seq % 2 == 0 {
                answer(seq, A, 5, 3)
            } else {
                answer(seq, B, 7, 1)
            };
            assert_eq!(*r, want);
        }
        assert_eq!(got[50], Reply::Ack(51));
    }

    #[test]
    fn a_frame_split_at_every_byte_is_answered_once_whole() {
        let mut enc = Encoder::new();
        let mut bytes = frame(enc.pull_req(3, &[A]));
        bytes.extend(frame(enc.keep_alive(4)));
        for cut in 0..=bytes.len() {
            let mut h = Harness::new(table());
            let mut out = Vec::new();
            h.read(&bytes[..cut], &mut out).unwrap();
            let first = replies(&out).len();
            h.read(&bytes[cut..], &mut out).unwrap();
            assert_eq!(
                replies(&out),
                vec![answer(3, A, 5, 3), Reply::Ack(4)],
                "cut {cut}"
            );
            assert!(first <= 2);
        }
    }

    #[test]
    fn before_the_first_load_pulls_are_held_and_subscribed() {
        let mut h = Harness::new(RouteTable::unloaded());
        let mut out = Vec::new();
        let mut enc = Encoder::new();
        let mut bytes = frame(enc.pull_req(1, &[A, B]));
        bytes.extend(frame(enc.keep_alive(2)));
        h.read(&bytes, &mut out).unwrap();
        assert_eq!(replies(&out), vec![Reply::Ack(2)]);
        assert!(h.registry.is_subscribed(h.session.id(), A));
        assert_eq!(h.counters.pulls_held, 2);
    }

    #[test]
    fn a_held_pull_beyond_the_subscription_limit_is_refused() {
        let mut h = Harness::new(RouteTable::unloaded());
        let modules: Vec<ModuleId> = (0..6).map(|i| ModuleId::new(i, 0)).collect();
        let mut out = Vec::new();
        h.read(&frame(Encoder::new().pull_req(8, &modules)), &mut out)
            .unwrap();
        assert_eq!(replies(&out), vec![Reply::Error(8, RetCode::Unavailable)]);
        assert_eq!(h.counters.subscriptions_refused, 2);
    }

    #[test]
    fn a_pull_past_the_subscription_bound_is_answered_and_refused_clearly() {
        let mut h = Harness::new(table());
        // The harness allows 4 per connection: the 5th and 6th are refused.
        let modules: Vec<ModuleId> = (0..6).map(|i| ModuleId::new(i, 0)).collect();
        let mut out = Vec::new();
        h.read(&frame(Encoder::new().pull_req(8, &modules)), &mut out)
            .unwrap();
        let got = replies(&out);
        assert_eq!(got.len(), 7, "six answers and one error: {got:?}");
        assert_eq!(got[6], Reply::Error(8, RetCode::Unavailable));
        assert_eq!(h.counters.subscriptions_refused, 2);
        assert!(!h.registry.is_subscribed(h.session.id(), modules[5]));
        assert!(h.registry.is_subscribed(h.session.id(), modules[0]));
        // The connection keeps serving what it holds.
        out.clear();
        h.read(&frame(Encoder::new().pull_req(9, &[A])), &mut out)
            .unwrap();
        assert_eq!(
            replies(&out).len(),
            2,
            "A is answered, and refused a subscription"
        );
    }

    #[test]
    fn a_pull_naming_no_module_gets_an_error_and_the_connection_stays() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let mut bytes = frame(Encoder::new().pull_req(5, &[]));
        bytes.extend(frame(Encoder::new().pull_req(6, &[A])));
        h.read(&bytes, &mut out).unwrap();
        assert_eq!(
            replies(&out),
            vec![Reply::Error(5, RetCode::BadRequest), answer(6, A, 5, 3)]
        );
        assert_eq!(h.counters.bad_requests, 1);
    }

    #[test]
    fn garbage_closes_after_answering_what_came_before() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let mut bytes = frame(Encoder::new().pull_req(1, &[A]));
        bytes.extend(frame(b"definitely not a flatbuffer"));
        bytes.extend(frame(Encoder::new().pull_req(2, &[A])));
        let err = h.read(&bytes, &mut out).unwrap_err();
        assert!(matches!(err, CloseReason::Decode(_)), "{err}");
        assert_eq!(err.kind(), CloseKind::Undecodable);
        assert_eq!(
            replies(&out),
            vec![answer(1, A, 5, 3), Reply::Error(0, RetCode::BadRequest)]
        );
    }

    #[test]
    fn a_length_over_the_limit_closes_before_the_payload_arrives() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let len = (MAX_REQUEST_LEN as u32 + 1).to_le_bytes();
        let err = h.read(&len, &mut out).unwrap_err();
        assert!(matches!(
            err,
            CloseReason::Frame(FrameError::Oversized { .. })
        ));
        let err = Harness::new(table())
            .read(&[0, 0, 0, 0], &mut Vec::new())
            .unwrap_err();
        assert!(matches!(err, CloseReason::Frame(FrameError::Empty)));
        assert_eq!(replies(&out), vec![Reply::Error(0, RetCode::BadRequest)]);
    }

    #[test]
    fn a_message_that_is_not_a_request_closes() {
        let mut h = Harness::new(table());
        let mut out = Vec::new();
        let push = frame(Encoder::new().route_push(A, true, 1, &[]));
        let err = h.read(&push, &mut out).unwrap_err();
        assert!(matches!(err, CloseReason::Unexpected("RoutePush")), "{err}");
        assert!(err.to_string().contains("send PullReq or KeepAlive"));
    }

    #[test]
    fn only_a_complete_frame_counts_as_hearing_from_the_peer() {
        let mut h = Harness::new(table());
        let id = h.session.id();
        let bytes = frame(Encoder::new().keep_alive(1));
        h.read(&bytes[..3], &mut Vec::new()).unwrap();
        let mut expired = Vec::new();
        h.registry.expire(30_500, &mut expired);
        assert_eq!(expired, [id], "a partial frame is not a sign of life");
        let mut h = Harness::new(table());
        h.read(&bytes, &mut Vec::new()).unwrap();
        expired.clear();
        h.registry.expire(30_500, &mut expired);
        assert!(expired.is_empty(), "heard from at 1000: alive until 31000");
    }
}
