//! The fixed records' own path ([`ShardCore::serve_record`], issue 29):
//! the answer written in place, and the node hint a getHost's answer
//! carries and its report hands back. Whatever the hint, a report counts
//! for the node it names by address.

use super::*;
use crate::messages::{ToControl, ToShard};
use lbagent_model::{NodeAddr, Policy, RouteNode};
use lbagent_wire::{decode, Report};
use std::net::Ipv4Addr;

const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40000));
/// The module of these tests (and of the sweep's, `shard_rt::sweep_tests`).
pub(crate) const M: ModuleId = ModuleId::new(3, 1);

/// Node `i`: 10.0.0.`i`:80.
pub(crate) fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
}

/// The route of `M`'s nodes `ids`, version `version`.
pub(crate) fn route(ids: &[u8], version: u64) -> ToShard {
    route_of(M, ids, version)
}

/// The route of nodes `ids` for `module`.
fn route_of(module: ModuleId, ids: &[u8], version: u64) -> ToShard {
    ToShard::Route {
        module,
        exists: true,
        version,
        nodes: ids
            .iter()
            .map(|&i| RouteNode {
                addr: node(i),
                weight: 1,
            })
            .collect(),
        policy: Policy::L5,
        options: Default::default(),
        meta: Vec::new(),
    }
}

/// A shard holding nodes 1..=3 of `M`.
fn shard() -> ShardCore {
    let mut s = ShardCore::new(ShardSetup::new(0, 2, 8888));
    s.apply(route(&[1, 2, 3], 7), 0);
    s
}

/// A getHost record (asking for the hint or not) through the record path:
/// the answer record's length, the host and the hint.
fn get_host(s: &mut ShardCore, ask: bool, now: Millis) -> (usize, Option<NodeAddr>, Option<u32>) {
    let g = fixed::Request::GetHost(wire::GetHost {
        seq: 5,
        module: M,
        business_priority: 0,
        user_priority: 0,
    });
    let hint = if ask {
        fixed::Hint::Ask
    } else {
        fixed::Hint::None
    };
    let mut rec = [0u8; fixed::MAX_LEN];
    let n = fixed::encode_request_hinted(&g, hint, &mut rec);
    let mut out = [0u8; fixed::ANSWER_MAX];
    let Served::Answer(len) = s.serve_record(&rec[..n], PEER, now, None, &mut out) else {
        panic!("a getHost answer record");
    };
    let (a, hint) = fixed::decode_answer_hinted(&out[..len]).expect("an answer record");
    assert_eq!((a.seq, a.module, a.retcode), (5, M, RetCode::Ok));
    (len, a.host, hint)
}

/// A failed call of `host` reported through the record path with `hint`.
fn report_failure(s: &mut ShardCore, host: NodeAddr, hint: fixed::Hint, now: Millis) {
    let r = fixed::Request::Report(Report {
        seq: 6,
        module: M,
        host,
        retcode: -1,
        tcost_ms: 10,
        downstream_level: None,
        consumed: 0,
    });
    let mut rec = [0u8; fixed::MAX_LEN];
    let n = fixed::encode_request_hinted(&r, hint, &mut rec);
    let mut out = [0u8; fixed::ANSWER_MAX];
    assert_eq!(
        s.serve_record(&rec[..n], PEER, now, None, &mut out),
        Served::Nothing
    );
}

/// Every node's real error count, as getRoute shows it, by address.
fn errors(s: &mut ShardCore, now: Millis) -> Vec<(NodeAddr, u32)> {
    let req = Encoder::new().get_route_req(3, M).to_vec();
    let resp = s
        .handle(&req, PEER, now)
        .expect("a getRoute answer")
        .to_vec();
    let Message::GetRouteResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!("a GetRouteResp")
    };
    let mut out: Vec<_> = r
        .nodes()
        .unwrap()
        .iter()
        .map(|n| (NodeAddr::from(n.host().unwrap()), n.rerr()))
        .collect();
    out.sort();
    out
}

#[test]
fn a_get_host_that_asks_gets_its_nodes_index_and_one_that_does_not_the_old_record() {
    let mut s = shard();
    for (i, want) in [1u8, 2, 3].into_iter().enumerate() {
        let (len, host, hint) = get_host(&mut s, true, 10);
        assert_eq!(
            (len, host, hint),
            (
                fixed::HOST_ANSWER_HINTED_LEN,
                Some(node(want)),
                Some(i as u32)
            )
        );
    }
    // An older client never asks: the 24-byte record it knows.
    let (len, host, hint) = get_host(&mut s, false, 10);
    assert_eq!(
        (len, host, hint),
        (fixed::HOST_ANSWER_LEN, Some(node(1)), None)
    );
}

#[test]
fn a_report_counts_for_the_node_it_names_whatever_its_hint_says() {
    let mut s = shard();
    let (_, host, hint) = get_host(&mut s, true, 10);
    assert_eq!((host, hint), (Some(node(1)), Some(0)));
    // The right hint, a hostile one (node 3's index), one out of range,
    // the largest, and none: each failure lands on node 1 only.
    for (k, hint) in [0, 2, 3, u32::MAX].into_iter().enumerate() {
        report_failure(&mut s, node(1), fixed::Hint::Node(hint), 20);
        let want = vec![(node(1), k as u32 + 1), (node(2), 0), (node(3), 0)];
        assert_eq!(errors(&mut s, 20), want, "hint {hint}");
    }
    report_failure(&mut s, node(2), fixed::Hint::None, 20);
    assert_eq!(
        errors(&mut s, 20),
        [(node(1), 4), (node(2), 1), (node(3), 0)]
    );
    // A node not in the route: counted as such, whatever the hint.
    let before = s.metrics.unknown_node_reports;
    report_failure(&mut s, node(9), fixed::Hint::Node(0), 20);
    assert_eq!(s.metrics.unknown_node_reports, before + 1);
}

#[test]
fn a_hint_from_before_a_route_update_still_counts_for_its_own_node() {
    let mut s = shard();
    get_host(&mut s, true, 10);
    let (_, host, hint) = get_host(&mut s, true, 10);
    assert_eq!((host, hint), (Some(node(2)), Some(1)));
    // Node 1 leaves: index 1 is node 3 now.
    s.apply(route(&[2, 3], 8), 11);
    report_failure(&mut s, node(2), fixed::Hint::Node(1), 12);
    assert_eq!(errors(&mut s, 12), [(node(2), 1), (node(3), 0)]);
    // The hints of the new route name the new indices.
    let (_, host, hint) = get_host(&mut s, true, 13);
    let i = hint.expect("a hint") as usize;
    assert_eq!([node(2), node(3)][i], host.unwrap());
}

#[test]
fn the_module_remembered_by_the_table_follows_route_updates_growth_and_expiry() {
    let mut s = shard();
    assert_eq!(get_host(&mut s, true, 10).1, Some(node(1)));
    // A route update between two requests of the module: the next one
    // reads the new route.
    s.apply(route(&[7, 8], 8), 11);
    let (_, host, _) = get_host(&mut s, true, 12);
    assert!(
        matches!(host, Some(h) if h == node(7) || h == node(8)),
        "{host:?}"
    );
    // Thousands of other modules made between two of its requests (the
    // table grows and moves every entry): still its own entry.
    for k in 0..3000u32 {
        s.apply(route_of(ModuleId::new(2 * k + 10, 0), &[9], 1), 13);
    }
    let (_, host, _) = get_host(&mut s, true, 14);
    assert!(
        matches!(host, Some(h) if h == node(7) || h == node(8)),
        "{host:?}"
    );
    // Forgotten (unused past the idle time), then asked for: unknown.
    let later = 14 + s.setup.module_idle_ms + 1;
    for k in 0..3000u32 {
        let m = ModuleId::new(2 * k + 10, 0);
        let req = Encoder::new().get_host_req(1, m, 0, 0).to_vec();
        s.handle(&req, PEER, later);
    }
    s.expire(later + 1);
    s.outbox.clear();
    let g = fixed::Request::GetHost(wire::GetHost {
        seq: 5,
        module: M,
        business_priority: 0,
        user_priority: 0,
    });
    let mut rec = [0u8; fixed::MAX_LEN];
    let n = fixed::encode_request_hinted(&g, fixed::Hint::Ask, &mut rec);
    let mut out = [0u8; fixed::ANSWER_MAX];
    let Served::Answer(len) = s.serve_record(&rec[..n], PEER, later + 2, None, &mut out) else {
        panic!("an answer record")
    };
    let a = fixed::decode_answer(&out[..len]).unwrap();
    assert_eq!((a.retcode, a.host), (RetCode::NoSuchModule, None));
    assert_eq!(s.outbox, vec![ToControl::Pull(M)]);
}
