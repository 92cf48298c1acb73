//! The hot path's reader against the verified decode: the same answer on
//! every input, encoded, hand-built, mutated or arbitrary.

use super::*;
use crate::{decode, AdmissionLevel, Encoder, Message};
use flatbuffers::FlatBufferBuilder;
use lbagent_model::{ModuleId, NodeAddr};
use proptest::prelude::*;

const M: ModuleId = ModuleId::new(10_000, 1);

/// What the shard's full path makes of `buf` for the two hot requests: a
/// verified, plain (not steering) getHost or a report, validated.
fn full(buf: &[u8]) -> Option<Hot> {
    match decode(buf, &Limits::UDP).ok()? {
        Message::GetHostReq(r) if !r.may_steer() => r.validate().ok().map(Hot::GetHost),
        Message::ReportReq(r) => r.validate().ok().map(Hot::Report),
        _ => None,
    }
}

fn hot(buf: &[u8]) -> Option<Hot> {
    read_hot(buf, &Limits::UDP)
}

fn report(seq: u32, host: NodeAddr, retcode: i32) -> Report {
    Report {
        seq,
        module: M,
        host,
        retcode,
        tcost_ms: 40,
        downstream_level: None,
        consumed: 0,
    }
}

fn node(port: u16) -> NodeAddr {
    NodeAddr {
        ip: 0x0a00_0001,
        port,
    }
}

/// One buffer of each shape the reader meets: plain and steering
/// getHosts, reports with and without their optional fields, and other
/// messages.
fn samples() -> Vec<Vec<u8>> {
    let mut e = Encoder::new();
    let mut level = report(7, node(8080), -1);
    level.downstream_level = Some(AdmissionLevel::new(3, 4));
    level.consumed = 12;
    vec![
        e.get_host_req(1, M, 0, 0).to_vec(),
        e.get_host_req(u32::MAX, M, 128, 1).to_vec(),
        e.get_host_req_keyed(1, M, 5, 6, Some(9)).to_vec(),
        e.get_host_req_full(1, M, 0, 0, None, "a=b").to_vec(),
        e.report_req(&report(2, node(8080), 0)).to_vec(),
        level_buf(&mut e, &level),
        e.get_route_req(1, M).to_vec(),
        e.keep_alive(3).to_vec(),
        e.get_host_resp(1, M, crate::RetCode::Ok, Some(node(1)), None)
            .to_vec(),
    ]
}

fn level_buf(e: &mut Encoder, r: &Report) -> Vec<u8> {
    e.report_req(r).to_vec()
}

#[test]
fn a_plain_get_host_reads_as_it_decodes() {
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
        let got = hot(&buf);
        assert!(matches!(got, Some(Hot::GetHost(_))), "{buf:?}");
        assert_eq!(got, full(&buf));
    }
}

#[test]
fn a_report_reads_as_it_decodes() {
    let mut enc = Encoder::new();
    let mut with_all = report(9, node(7000), -1);
    with_all.tcost_ms = 250;
    with_all.downstream_level = Some(AdmissionLevel::new(1, 128));
    with_all.consumed = crate::MAX_CONSUMED;
    for r in [
        report(1, node(8080), 0),
        report(0, node(1), 0),
        report(u32::MAX, node(u16::MAX), i32::MIN),
        with_all,
    ] {
        let buf = enc.report_req(&r).to_vec();
        assert_eq!(hot(&buf), Some(Hot::Report(r)));
        assert_eq!(hot(&buf), full(&buf));
    }
}

#[test]
fn what_validation_refuses_is_left_to_the_full_decode() {
    let mut enc = Encoder::new();
    let mut refused = vec![
        enc.get_host_req(1, M, 129, 1).to_vec(),
        enc.get_host_req(1, M, 1, 200).to_vec(),
        enc.report_req(&report(1, node(0), 0)).to_vec(),
    ];
    let mut r = report(1, node(80), 0);
    r.downstream_level = Some(AdmissionLevel::new(0, 5));
    refused.push(enc.report_req(&r).to_vec());
    r.downstream_level = Some(AdmissionLevel::new(129, 1));
    refused.push(enc.report_req(&r).to_vec());
    r.downstream_level = None;
    r.consumed = crate::MAX_CONSUMED + 1;
    refused.push(enc.report_req(&r).to_vec());
    refused.push(report_without_host());
    for buf in refused {
        assert_eq!(hot(&buf), None, "{buf:?}");
        // The full decode verifies it and its validation says why.
        let why = match decode(&buf, &Limits::UDP).unwrap() {
            Message::GetHostReq(g) => g.validate().map(|_| ()),
            Message::ReportReq(r) => r.validate().map(|_| ()),
            other => panic!("not a hot request: {other:?}"),
        };
        assert!(why.is_err(), "{buf:?}");
    }
}

/// A ReportReq with no host (the encoder always writes one).
fn report_without_host() -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let body = fb::ReportReq::create(
        &mut fbb,
        &fb::ReportReqArgs {
            seq: 1,
            modid: M.modid,
            cmdid: M.cmdid,
            host: None,
            ..Default::default()
        },
    );
    envelope(&mut fbb, fb::Body::ReportReq, body.as_union_value())
}

fn envelope(
    fbb: &mut FlatBufferBuilder<'static>,
    body_type: fb::Body,
    body: flatbuffers::WIPOffset<flatbuffers::UnionWIPOffset>,
) -> Vec<u8> {
    let root = fb::Envelope::create(
        fbb,
        &fb::EnvelopeArgs {
            body_type,
            body: Some(body),
        },
    );
    fb::finish_envelope_buffer(fbb, root);
    fbb.finished_data().to_vec()
}

/// A report as a newer peer might send it: a field this schema does not
/// know after the last one, and the fields pushed in another order.
fn report_from_a_newer_peer(r: &Report, extra: u32) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let start = fbb.start_table();
    fbb.push_slot::<u32>(fb::ReportReq::VT_CONSUMED + 2, extra, 0);
    fbb.push_slot::<u32>(fb::ReportReq::VT_TCOST_MS, r.tcost_ms, 0);
    fbb.push_slot_always::<&fb::Host>(fb::ReportReq::VT_HOST, &fb::Host::from(r.host));
    fbb.push_slot::<u32>(fb::ReportReq::VT_SEQ, r.seq, 0);
    fbb.push_slot::<u32>(fb::ReportReq::VT_CMDID, r.module.cmdid, 0);
    fbb.push_slot::<i32>(fb::ReportReq::VT_RETCODE, r.retcode, 0);
    fbb.push_slot::<u32>(fb::ReportReq::VT_MODID, r.module.modid, 0);
    let body = fbb.end_table(start);
    envelope(&mut fbb, fb::Body::ReportReq, body.as_union_value())
}

#[test]
fn fields_a_newer_peer_adds_are_ignored_as_the_decoder_ignores_them() {
    let r = report(5, node(9), -3);
    let buf = report_from_a_newer_peer(&r, 77);
    assert_eq!(hot(&buf), Some(Hot::Report(r)));
    assert_eq!(hot(&buf), full(&buf));
}

#[test]
fn a_datagram_over_the_limit_or_cut_short_is_left_to_the_full_decode() {
    let mut enc = Encoder::new();
    for ok in [
        enc.get_host_req(1, M, 1, 1).to_vec(),
        enc.report_req(&report(1, node(80), 0)).to_vec(),
    ] {
        assert!(hot(&ok).is_some());
        assert_eq!(read_hot(&ok, &Limits::new(ok.len() - 1)), None);
        for cut in 0..ok.len() {
            assert_eq!(hot(&ok[..cut]), None, "cut {cut}");
            assert_eq!(full(&ok[..cut]), None, "cut {cut}");
        }
    }
}

#[test]
fn a_union_with_no_body_or_an_unknown_type_is_left_to_the_full_decode() {
    let mut fbb = FlatBufferBuilder::new();
    let root = fb::Envelope::create(
        &mut fbb,
        &fb::EnvelopeArgs {
            body_type: fb::Body::GetHostReq,
            body: None,
        },
    );
    fb::finish_envelope_buffer(&mut fbb, root);
    let no_body = fbb.finished_data().to_vec();
    assert_eq!(hot(&no_body), None);
    assert!(decode(&no_body, &Limits::UDP).is_err());

    let mut fbb = FlatBufferBuilder::new();
    let body = fb::GetHostReq::create(&mut fbb, &fb::GetHostReqArgs::default());
    let unknown = envelope(&mut fbb, fb::Body(200), body.as_union_value());
    assert_eq!(hot(&unknown), None);
    assert!(decode(&unknown, &Limits::UDP).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Every getHost the encoder makes, any priorities, keyed or not.
    #[test]
    fn encoded_get_hosts_read_as_they_decode(
        seq: u32, modid: u32, cmdid: u32, b: u8, u: u8, key: Option<u64>,
    ) {
        let buf = Encoder::new()
            .get_host_req_keyed(seq, ModuleId::new(modid, cmdid), b, u, key)
            .to_vec();
        prop_assert_eq!(hot(&buf), full(&buf));
        // What it leaves to the full decode, precisely: a key, or a
        // priority out of range.
        let plain = key.is_none() && b <= crate::MAX_PRIORITY && u <= crate::MAX_PRIORITY;
        prop_assert_eq!(hot(&buf).is_some(), plain);
    }

    /// Every report the encoder makes, any field.
    #[test]
    fn encoded_reports_read_as_they_decode(
        seq: u32, modid: u32, cmdid: u32, ip: u32, port: u16, retcode: i32,
        tcost_ms: u32, level: Option<(u8, u8)>, consumed in prop_oneof![any::<u32>(), 0u32..=1_000_001],
        extra: u32,
    ) {
        let r = Report {
            seq,
            module: ModuleId::new(modid, cmdid),
            host: NodeAddr { ip, port },
            retcode,
            tcost_ms,
            downstream_level: level.map(|(b, u)| AdmissionLevel::new(b, u)),
            consumed,
        };
        let buf = Encoder::new().report_req(&r).to_vec();
        prop_assert_eq!(hot(&buf), full(&buf));
        let valid = full(&buf).is_some();
        prop_assert_eq!(hot(&buf).is_some(), valid);
        if valid {
            // A level of (0, 0) is no level (`validate`).
            let none = AdmissionLevel::new(0, 0);
            let read = Report {
                downstream_level: r.downstream_level.filter(|l| *l != none),
                ..r
            };
            prop_assert_eq!(hot(&buf), Some(Hot::Report(read)));
        }
        let newer = report_from_a_newer_peer(&r, extra);
        prop_assert_eq!(hot(&newer), full(&newer));
    }

    /// Hostile bytes: a sample with bytes overwritten, cut or extended.
    /// The reader and the full decode agree on every one: whatever the
    /// reader accepts the decoder accepts alike, and whatever plain
    /// getHost or report the decoder accepts the reader reads.
    #[test]
    fn mutated_requests_read_as_they_decode(
        which in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..8), 0..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        tail in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let all = samples();
        let mut buf = all[which.index(all.len())].clone();
        for (at, v) in edits {
            let i = at.index(buf.len());
            buf[i] = v;
        }
        for (at, bit) in flips {
            let i = at.index(buf.len());
            buf[i] ^= 1 << bit;
        }
        if let Some(cut) = cut {
            buf.truncate(cut.index(buf.len() + 1));
        }
        buf.extend_from_slice(&tail);
        prop_assert_eq!(hot(&buf), full(&buf), "{:?}", buf);
    }

    /// Arbitrary bytes behind the identifier and a small root offset.
    #[test]
    fn arbitrary_bytes_read_as_they_decode(
        mut bytes in proptest::collection::vec(any::<u8>(), MIN_LEN..160),
        root in 0u32..96,
    ) {
        bytes[..4].copy_from_slice(&root.to_le_bytes());
        bytes[4..8].copy_from_slice(b"LBA1");
        prop_assert_eq!(hot(&bytes), full(&bytes), "{:?}", bytes);
    }
}
