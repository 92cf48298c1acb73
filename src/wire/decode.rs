//! Decoding: bytes in, a verified zero-copy [`Message`] or a typed
//! [`DecodeError`] out. Never panics, never allocates on success.

use flatbuffers::{InvalidFlatbuffer, VerifierOptions};

use super::fb;

/// The shortest buffer a FlatBuffers encoder can produce for an `Envelope`:
/// root offset, file identifier, a vtable and a table of 4 bytes each.
pub const MIN_LEN: usize = 16;

/// How much a decoder accepts: the buffer's length and the verifier's bounds
/// on the work one buffer may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The longest buffer accepted, in bytes.
    pub max_len: usize,
    /// The deepest nesting of tables accepted (the schema needs 3).
    pub max_depth: usize,
    /// The most tables one buffer may hold.
    pub max_tables: usize,
    /// The most bytes the verifier may read, counting shared objects once
    /// per reference (bounds a buffer whose offsets all point at one table).
    pub max_apparent_size: usize,
}

impl Limits {
    /// A UDP datagram: at most 65507 bytes, the largest IPv4 UDP payload.
    pub const UDP: Limits = Limits::new(65_507);

    /// A TCP frame: at most 16 MiB.
    pub const TCP_FRAME: Limits = Limits::new(16 << 20);

    /// Limits for buffers of at most `max_len` bytes; the verifier's bounds
    /// scale with it (a table is at least 8 bytes; 8x apparent size).
    pub const fn new(max_len: usize) -> Self {
        Limits {
            max_len,
            max_depth: 8,
            max_tables: max_len / 8 + 1,
            max_apparent_size: max_len.saturating_mul(8),
        }
    }

    fn verifier_options(&self) -> VerifierOptions {
        VerifierOptions {
            max_depth: self.max_depth,
            max_tables: self.max_tables,
            max_apparent_size: self.max_apparent_size,
            ignore_missing_null_terminator: false,
        }
    }
}

/// Why bytes are not a message. Every variant means: count it and drop the
/// datagram, or close the TCP connection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Empty, or shorter than [`MIN_LEN`]: no envelope fits.
    #[error("message truncated: {len} bytes, shorter than the {MIN_LEN}-byte minimum")]
    Truncated {
        /// The buffer's length.
        len: usize,
    },
    /// Longer than [`Limits::max_len`].
    #[error("message oversized: {len} bytes, more than the {max}-byte limit")]
    Oversized {
        /// The buffer's length.
        len: usize,
        /// The limit it exceeds.
        max: usize,
    },
    /// Bytes 4..8 are not [`super::FILE_IDENTIFIER`]: not an lbagent message.
    #[error("bad file identifier {found:?}: not an lbagent message (expected \"LBA1\")")]
    BadIdentifier {
        /// The four bytes found where the identifier belongs.
        found: [u8; 4],
    },
    /// The FlatBuffers verifier rejected the buffer (an offset out of
    /// bounds, a misaligned field, invalid UTF-8, a limit exceeded...).
    #[error("malformed message: {0}")]
    Malformed(InvalidFlatbuffer),
    /// The envelope carries no body (union type NONE).
    #[error("message has no body")]
    NoBody,
    /// The union type is beyond the members this build knows (a newer peer).
    #[error("unknown message type {0}")]
    UnknownType(u8),
}

/// Verifies `buf` and returns the message it carries, borrowing `buf`.
///
/// Checks, in order: the length against [`MIN_LEN`] and `limits.max_len`,
/// the file identifier, the FlatBuffers verifier bounded by `limits`, then
/// the union type. Field values are not judged here: see the `validate()`
/// methods of the request tables.
///
/// # Errors
/// [`DecodeError::Truncated`] (empty or too short),
/// [`DecodeError::Oversized`], [`DecodeError::BadIdentifier`],
/// [`DecodeError::Malformed`] (the verifier's message),
/// [`DecodeError::NoBody`], [`DecodeError::UnknownType`].
pub fn decode<'a>(buf: &'a [u8], limits: &Limits) -> Result<Message<'a>, DecodeError> {
    let len = buf.len();
    if len < MIN_LEN {
        return Err(DecodeError::Truncated { len });
    }
    if len > limits.max_len {
        return Err(DecodeError::Oversized {
            len,
            max: limits.max_len,
        });
    }
    if !fb::envelope_buffer_has_identifier(buf) {
        let mut found = [0; 4];
        found.copy_from_slice(&buf[4..8]);
        return Err(DecodeError::BadIdentifier { found });
    }
    let envelope = fb::root_as_envelope_with_opts(&limits.verifier_options(), buf)
        .map_err(DecodeError::Malformed)?;
    Message::from_envelope(envelope)
}

/// Declares [`Message`] with one variant per union member, in schema order.
macro_rules! messages {
    ($($(#[$doc:meta])* $name:ident => $accessor:ident,)*) => {
        /// A verified message: one variant per member of the schema's `Body`
        /// union, holding the generated table accessor (zero copy).
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum Message<'a> {
            $($(#[$doc])* $name(fb::$name<'a>),)*
        }

        impl<'a> Message<'a> {
            fn from_envelope(envelope: fb::Envelope<'a>) -> Result<Self, DecodeError> {
                let message = match envelope.body_type() {
                    fb::Body::NONE => None,
                    $(fb::Body::$name => envelope.$accessor().map(Message::$name),)*
                    unknown => return Err(DecodeError::UnknownType(unknown.0)),
                };
                // A known type without a body fails verification; NoBody
                // covers it anyway rather than trust that.
                message.ok_or(DecodeError::NoBody)
            }

            /// The message's name in the schema, for logs and metrics.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Message::$name(_) => stringify!($name),)*
                }
            }
        }
    };
}

messages! {
    /// app -> agent: ask for one node of a module.
    GetHostReq => body_as_get_host_req,
    /// agent -> app: the answer to GetHostReq.
    GetHostResp => body_as_get_host_resp,
    /// app -> agent: the result of one call.
    ReportReq => body_as_report_req,
    /// app -> agent: successes held by the route cache.
    BatchReportReq => body_as_batch_report_req,
    /// app -> agent: pull a module before first use.
    RegisterReq => body_as_register_req,
    /// agent -> app: the answer to RegisterReq.
    RegisterResp => body_as_register_resp,
    /// tools -> agent: ask for the agent's view of a module.
    GetRouteReq => body_as_get_route_req,
    /// agent -> tools: the answer to GetRouteReq.
    GetRouteResp => body_as_get_route_resp,
    /// route cache -> agent: ask for a module's route.
    CacheGetRouteReq => body_as_cache_get_route_req,
    /// agent -> route cache: the answer to CacheGetRouteReq.
    CacheGetRouteResp => body_as_cache_get_route_resp,
    /// Any server: a refused request.
    ErrorResp => body_as_error_resp,
    /// agent -> route server: ask for modules' routes.
    PullReq => body_as_pull_req,
    /// route server -> agent: one module's route.
    RouteAnswer => body_as_route_answer,
    /// route server -> agent: a subscribed module changed.
    RoutePush => body_as_route_push,
    /// agent -> route server: subscription keep-alive.
    KeepAlive => body_as_keep_alive,
    /// route server -> agent: the answer to KeepAlive.
    KeepAliveAck => body_as_keep_alive_ack,
    /// agent -> reporter: a batch of statistics.
    StatsReport => body_as_stats_report,
    /// reporter -> agent: a StatsReport was accepted.
    StatsAck => body_as_stats_ack,
    /// agent -> route server: drop these modules' subscriptions.
    Unsubscribe => body_as_unsubscribe,
    /// route server -> agent: modules of a pull unchanged at the versions held.
    RouteUnchanged => body_as_route_unchanged,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Encoder, NodeStatus, Report, RetCode};
    use flatbuffers::{FlatBufferBuilder, WIPOffset};
    use lbagent_model::{ModuleId, NodeAddr, RouteNode};
    use proptest::prelude::*;

    const M: ModuleId = ModuleId::new(3, 4);
    const HOST: NodeAddr = NodeAddr {
        ip: 0x0a00_0001,
        port: 9000,
    };

    fn keep_alive() -> Vec<u8> {
        Encoder::new().keep_alive(7).to_vec()
    }

    /// An envelope built by hand: any union type byte, any body.
    fn envelope(body_type: u8, with_body: bool) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let body = with_body.then(|| {
            fb::KeepAlive::create(&mut fbb, &fb::KeepAliveArgs { seq: 1 }).as_union_value()
        });
        let args = fb::EnvelopeArgs {
            body_type: fb::Body(body_type),
            body,
        };
        let root = fb::Envelope::create(&mut fbb, &args);
        fb::finish_envelope_buffer(&mut fbb, root);
        fbb.finished_data().to_vec()
    }

    fn status(n: u32) -> NodeStatus {
        NodeStatus {
            addr: HOST,
            weight: n,
            overloaded: true,
            vsucc: n,
            verr: n,
            rsucc: n,
            rerr: n,
            contin_succ: n,
            contin_err: n,
            bad_windows: n,
            window_age_ms: u64::from(n),
            overload_age_ms: u64::from(n),
            capacity: 0,
            in_use: 0,
            phi: 0.0,
        }
    }

    #[test]
    fn a_valid_message_decodes() {
        let buf = keep_alive();
        let msg = decode(&buf, &Limits::UDP).unwrap();
        assert_eq!(msg.name(), "KeepAlive");
        assert!(matches!(msg, Message::KeepAlive(m) if m.seq() == 7));
    }

    #[test]
    fn an_empty_buffer_is_truncated() {
        assert_eq!(
            decode(&[], &Limits::UDP),
            Err(DecodeError::Truncated { len: 0 })
        );
    }

    #[test]
    fn a_buffer_shorter_than_an_envelope_is_truncated() {
        let buf = keep_alive();
        let err = decode(&buf[..MIN_LEN - 1], &Limits::UDP);
        assert_eq!(err, Err(DecodeError::Truncated { len: MIN_LEN - 1 }));
        // A cut that keeps MIN_LEN bytes is the verifier's to catch.
        let err = decode(&buf[..buf.len() - 1], &Limits::UDP).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed(_)), "{err}");
    }

    #[test]
    fn a_buffer_over_the_limit_is_oversized() {
        let buf = keep_alive();
        let limits = Limits::new(buf.len() - 1);
        let err = decode(&buf, &limits);
        assert_eq!(
            err,
            Err(DecodeError::Oversized {
                len: buf.len(),
                max: buf.len() - 1
            })
        );
        let datagram = vec![0; Limits::UDP.max_len + 1];
        assert!(matches!(
            decode(&datagram, &Limits::UDP),
            Err(DecodeError::Oversized { max: 65_507, .. })
        ));
    }

    #[test]
    fn a_foreign_identifier_is_refused_before_verifying() {
        let mut buf = keep_alive();
        buf[4..8].copy_from_slice(b"LBA0");
        let err = decode(&buf, &Limits::UDP).unwrap_err();
        assert_eq!(err, DecodeError::BadIdentifier { found: *b"LBA0" });
        assert!(err.to_string().contains("not an lbagent message"), "{err}");
    }

    #[test]
    fn a_root_offset_out_of_bounds_is_malformed() {
        let mut buf = keep_alive();
        let past_end = u32::try_from(buf.len()).unwrap() + 64;
        buf[..4].copy_from_slice(&past_end.to_le_bytes());
        let err = decode(&buf, &Limits::UDP).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed(_)), "{err}");
        assert!(err.to_string().starts_with("malformed message: "), "{err}");
    }

    #[test]
    fn a_vtable_offset_out_of_bounds_is_malformed() {
        let mut buf = keep_alive();
        let root = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        buf[root..root + 4].copy_from_slice(&i32::MIN.to_le_bytes());
        let err = decode(&buf, &Limits::UDP).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed(_)), "{err}");
    }

    #[test]
    fn a_type_without_its_body_is_malformed() {
        let buf = envelope(fb::Body::KeepAlive.0, false);
        let err = decode(&buf, &Limits::UDP).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed(_)), "{err}");
    }

    #[test]
    fn an_envelope_without_a_body_has_no_body() {
        let buf = envelope(fb::Body::NONE.0, false);
        assert_eq!(buf.len(), MIN_LEN, "MIN_LEN is the smallest envelope");
        assert_eq!(decode(&buf, &Limits::UDP), Err(DecodeError::NoBody));
        // A body under type NONE is an inconsistent union.
        let buf = envelope(fb::Body::NONE.0, true);
        let err = decode(&buf, &Limits::UDP).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed(_)), "{err}");
    }

    #[test]
    fn a_union_type_beyond_the_last_member_is_unknown() {
        let newer = fb::Body::ENUM_MAX + 1;
        let buf = envelope(newer, true);
        assert_eq!(
            decode(&buf, &Limits::UDP),
            Err(DecodeError::UnknownType(newer))
        );
        let buf = envelope(u8::MAX, true);
        assert_eq!(
            decode(&buf, &Limits::UDP),
            Err(DecodeError::UnknownType(u8::MAX))
        );
    }

    #[test]
    fn too_many_tables_is_malformed() {
        let nodes: Vec<NodeStatus> = (0..10).map(status).collect();
        let mut enc = Encoder::new();
        let buf = enc.get_route_resp(1, M, RetCode::Ok, 1, &nodes);
        let limits = Limits {
            max_tables: 5,
            ..Limits::UDP
        };
        assert!(decode(buf, &Limits::UDP).is_ok());
        assert!(matches!(
            decode(buf, &limits),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn offsets_sharing_one_table_are_bounded_by_apparent_size() {
        // 8000 vector entries pointing at one big table: a 32 KiB datagram
        // that verifies as if it were 8000 tables (680 KB).
        let mut fbb = FlatBufferBuilder::new();
        let host = fb::Host::from(HOST);
        let s = status(u32::MAX);
        let node = fb::NodeStatus::create(
            &mut fbb,
            &fb::NodeStatusArgs {
                host: Some(&host),
                weight: s.weight,
                overloaded: true,
                vsucc: s.vsucc,
                verr: s.verr,
                rsucc: s.rsucc,
                rerr: s.rerr,
                contin_succ: s.contin_succ,
                contin_err: s.contin_err,
                bad_windows: s.bad_windows,
                window_age_ms: s.window_age_ms,
                overload_age_ms: s.overload_age_ms,
                capacity: s.capacity,
                in_use: s.in_use,
                phi: s.phi,
            },
        );
        let shared: Vec<WIPOffset<fb::NodeStatus>> = vec![node; 8000];
        let nodes = fbb.create_vector(&shared);
        let args = fb::GetRouteRespArgs {
            nodes: Some(nodes),
            ..Default::default()
        };
        let body = fb::GetRouteResp::create(&mut fbb, &args).as_union_value();
        let args = fb::EnvelopeArgs {
            body_type: fb::Body::GetRouteResp,
            body: Some(body),
        };
        let root = fb::Envelope::create(&mut fbb, &args);
        fb::finish_envelope_buffer(&mut fbb, root);
        let buf = fbb.finished_data();
        assert!(buf.len() < Limits::UDP.max_len);
        let verdict = decode(buf, &Limits::UDP).map(|m| m.name());
        let expected = DecodeError::Malformed(flatbuffers::InvalidFlatbuffer::ApparentSizeTooLarge);
        assert_eq!(verdict, Err(expected));
    }

    #[test]
    fn the_limits_scale_with_the_length() {
        assert_eq!(Limits::UDP.max_len, 65_507);
        assert_eq!(Limits::TCP_FRAME.max_len, 16 << 20);
        let custom = Limits::new(1000);
        assert_eq!(custom.max_len, 1000);
        assert!(custom.max_tables < Limits::UDP.max_tables);
    }

    /// One valid buffer of every message type.
    fn samples() -> Vec<Vec<u8>> {
        let mut e = Encoder::new();
        let route = [RouteNode {
            addr: HOST,
            weight: 2,
        }];
        let stats = [crate::NodeStats {
            addr: HOST,
            succ: 1,
            err: 2,
            overloaded: true,
        }];
        let modules = [crate::ModuleStats {
            module: M,
            nodes: &stats,
            consumed: &[],
        }];
        let report = Report {
            seq: 1,
            module: M,
            host: HOST,
            retcode: 1,
            tcost_ms: 300,
            downstream_level: Some(crate::AdmissionLevel::new(2, 3)),
            consumed: 0,
        };
        let cache = crate::CacheRoute {
            seq: 1,
            module: M,
            retcode: RetCode::Ok,
            version: 2,
            unchanged: false,
            any_overloaded: false,
            nodes: &route,
        };
        vec![
            e.get_host_req(1, M, 1, 2).to_vec(),
            e.get_host_resp(1, M, RetCode::Ok, Some(HOST), None)
                .to_vec(),
            e.report_req(&report).to_vec(),
            e.batch_report_req(1, M, &[(HOST, 5), (HOST, 6)]).to_vec(),
            e.register_req(1, M, 100).to_vec(),
            e.register_resp(1, M, RetCode::Ok, 3).to_vec(),
            e.get_route_req(1, M).to_vec(),
            e.get_route_resp(1, M, RetCode::Ok, 3, &[status(1), status(2)])
                .to_vec(),
            e.cache_get_route_req(1, M, 0).to_vec(),
            e.cache_get_route_resp(&cache).to_vec(),
            e.error_resp(1, M, RetCode::BadRequest, "bad").to_vec(),
            e.pull_req_known(1, &[M, M], &[0, 4]).to_vec(),
            e.route_answer(1, M, true, 4, &route).to_vec(),
            e.route_push(M, true, 5, &route).to_vec(),
            e.keep_alive(1).to_vec(),
            e.keep_alive_ack(1).to_vec(),
            e.stats_report(1, 2, 3, &modules).to_vec(),
            e.stats_ack(1).to_vec(),
            e.unsubscribe(&[M, M]).to_vec(),
            e.route_unchanged(1, &[M, M], &[4, 5]).to_vec(),
        ]
    }

    #[test]
    fn every_union_member_has_a_sample() {
        let names: Vec<&str> = samples()
            .iter()
            .map(|b| decode(b, &Limits::UDP).unwrap().name())
            .collect();
        let schema: Vec<&str> = fb::Body::ENUM_VALUES[1..]
            .iter()
            .map(|b| b.variant_name().unwrap())
            .collect();
        assert_eq!(names, schema);
    }

    /// Decodes and, when that succeeds, reads every field the way a server
    /// would: Debug walks every table, vector and string.
    fn exercise(buf: &[u8]) {
        let Ok(msg) = decode(buf, &Limits::UDP) else {
            return;
        };
        let _ = format!("{msg:?}");
        match msg {
            Message::GetHostReq(m) => drop(m.validate()),
            Message::ReportReq(m) => drop(m.validate()),
            Message::BatchReportReq(m) => {
                if let Ok(b) = m.validate() {
                    let _ = b.successes().count();
                }
            }
            Message::RegisterReq(m) => drop(m.validate()),
            Message::PullReq(m) => {
                if let Ok(p) = m.validate() {
                    let _ = p.modules().count();
                    let _ = p.modules_known().count();
                }
            }
            Message::RouteUnchanged(m) => {
                if let Ok(u) = m.validate() {
                    let _ = u.modules().count();
                }
            }
            Message::GetRouteResp(m) => {
                let _ = m.nodes().map(|v| v.iter().map(NodeStatus::from).count());
            }
            _ => {}
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            exercise(&bytes);
        }

        #[test]
        fn arbitrary_bytes_behind_the_identifier_never_panic(
            mut bytes in proptest::collection::vec(any::<u8>(), MIN_LEN..256),
            root in 0u32..64,
        ) {
            bytes[..4].copy_from_slice(&root.to_le_bytes());
            bytes[4..8].copy_from_slice(b"LBA1");
            exercise(&bytes);
        }

        #[test]
        fn flipped_and_truncated_messages_never_panic(
            which in any::<prop::sample::Index>(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..8), 0..6),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let all = samples();
            let mut buf = all[which.index(all.len())].clone();
            for (at, bit) in flips {
                let i = at.index(buf.len());
                buf[i] ^= 1 << bit;
            }
            if let Some(cut) = cut {
                buf.truncate(cut.index(buf.len() + 1));
            }
            exercise(&buf);
        }
    }
}
