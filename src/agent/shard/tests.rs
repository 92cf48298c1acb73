use super::*;
use crate::model::NodeAddr;
use crate::wire::{decode, Report};
use std::net::Ipv4Addr;

const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40000));
// (3 + 1) % 2 == 0: shard 0 of 2 owns it.
const M: ModuleId = ModuleId::new(3, 1);

fn shard() -> ShardCore {
    ShardCore::new(ShardSetup {
        id: 0,
        shards: 2,
        base_port: 8888,
        params: LbParams::default(),
        update_timeout_ms: 15_000,
        report_timeout_ms: 15_000,
    })
}

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
}

fn route(n: u8) -> ToShard {
    ToShard::Route {
        module: M,
        exists: true,
        version: 7,
        nodes: (1..=n)
            .map(|i| RouteNode {
                addr: node(i),
                weight: 1,
            })
            .collect(),
    }
}

fn get_host(s: &mut ShardCore, m: ModuleId, now: Millis) -> (RetCode, Option<NodeAddr>) {
    let mut enc = Encoder::new();
    let req = enc.get_host_req(9, m, 0, 0).to_vec();
    let resp = s.handle(&req, PEER, now).expect("an answer").to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::GetHostResp(r) => {
            assert_eq!(r.seq(), 9);
            (r.retcode(), r.host().map(NodeAddr::from))
        }
        Message::ErrorResp(e) => (e.retcode(), None),
        other => panic!("unexpected {}", other.name()),
    }
}

fn report(s: &mut ShardCore, host: NodeAddr, retcode: i32, now: Millis) {
    let mut enc = Encoder::new();
    let req = enc
        .report_req(&Report {
            seq: 1,
            module: M,
            host,
            retcode,
            tcost_ms: 0,
            downstream_level: None,
        })
        .to_vec();
    assert!(s.handle(&req, PEER, now).is_none());
}

#[test]
fn first_get_host_answers_no_such_module_and_asks_for_one_pull() {
    let mut s = shard();
    assert_eq!(get_host(&mut s, M, 0), (RetCode::NoSuchModule, None));
    assert_eq!(get_host(&mut s, M, 1), (RetCode::NoSuchModule, None));
    assert_eq!(s.outbox, vec![ToControl::Pull(M)]);
}

#[test]
fn after_the_route_arrives_hosts_come_in_round_robin_order() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(3), 5);
    let hosts: Vec<_> = (0..6).map(|_| get_host(&mut s, M, 10).1.unwrap()).collect();
    assert_eq!(
        hosts,
        vec![node(1), node(2), node(3), node(1), node(2), node(3)]
    );
}

#[test]
fn a_module_of_another_shard_gets_a_wrong_shard_error_naming_the_owner() {
    let mut s = shard();
    let other = ModuleId::new(2, 1);
    let mut enc = Encoder::new();
    let req = enc.get_host_req(4, other, 0, 0).to_vec();
    let resp = s.handle(&req, PEER, 0).unwrap().to_vec();
    let Message::ErrorResp(e) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!((e.retcode(), e.seq()), (RetCode::WrongShard, 4));
    assert!(
        e.message().unwrap().contains("shard 1 (UDP port 8889)"),
        "{:?}",
        e.message()
    );
    assert!(s.outbox.is_empty());
}

#[test]
fn failures_move_a_node_to_the_overload_list_and_get_host_skips_it_except_probes() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    for _ in 0..15 {
        report(&mut s, node(1), 1, 10);
    }
    assert_eq!(s.metrics.to_overloaded, 1);
    // As the original: 10 getHosts from the idle list, the 11th probes.
    let hosts: Vec<_> = (0..11)
        .map(|_| get_host(&mut s, M, 10).1.unwrap())
        .collect();
    assert_eq!(
        hosts.iter().filter(|&&h| h == node(1)).count(),
        1,
        "only the probe: {hosts:?}"
    );
    assert_eq!(hosts[10], node(1));
}

#[test]
fn get_route_shows_each_node_state_and_counters() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    report(&mut s, node(2), 0, 100);
    for _ in 0..15 {
        report(&mut s, node(1), 1, 100);
    }
    let mut enc = Encoder::new();
    let req = enc.get_route_req(3, M).to_vec();
    let resp = s.handle(&req, PEER, 1100).unwrap().to_vec();
    let Message::GetRouteResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!((r.retcode(), r.version()), (RetCode::Ok, 7));
    let nodes = r.nodes().unwrap();
    let n1 = nodes
        .iter()
        .find(|n| NodeAddr::from(n.host().unwrap()) == node(1))
        .unwrap();
    let n2 = nodes
        .iter()
        .find(|n| NodeAddr::from(n.host().unwrap()) == node(2))
        .unwrap();
    assert!(n1.overloaded() && n1.verr() == 5 && n1.overload_age_ms() == 1000);
    assert!(!n2.overloaded() && n2.vsucc() == 181 && n2.rsucc() == 1 && n2.window_age_ms() == 1100);
}

#[test]
fn register_waits_for_the_route_then_answers() {
    let mut s = shard();
    let mut enc = Encoder::new();
    let req = enc.register_req(5, M, 1000).to_vec();
    assert!(s.handle(&req, PEER, 0).is_none());
    assert_eq!(s.outbox, vec![ToControl::Pull(M)]);
    assert_eq!(s.next_deadline(), Some(1000));
    let answers = s.apply(route(1), 10);
    assert_eq!(answers.len(), 1);
    let Message::RegisterResp(r) = decode(&answers[0].1, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!((r.seq(), r.retcode(), r.version()), (5, RetCode::Ok, 7));
    // Known now: answered at once.
    let resp = s.handle(&req, PEER, 20).unwrap().to_vec();
    let Message::RegisterResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!(r.retcode(), RetCode::Ok);
}

#[test]
fn register_times_out_or_learns_the_module_does_not_exist() {
    let mut s = shard();
    let mut enc = Encoder::new();
    let req = enc.register_req(5, M, 1000).to_vec();
    s.handle(&req, PEER, 0);
    assert!(s.expire(999).is_empty());
    let out = s.expire(1000);
    let Message::RegisterResp(r) = decode(&out[0].1, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!(r.retcode(), RetCode::Timeout);

    s.handle(&req, PEER, 2000);
    let out = s.apply(
        ToShard::Route {
            module: M,
            exists: false,
            version: 0,
            nodes: vec![],
        },
        2001,
    );
    let Message::RegisterResp(r) = decode(&out[0].1, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!(r.retcode(), RetCode::NoSuchModule);
    assert_eq!(get_host(&mut s, M, 2002).0, RetCode::NoSuchModule);
}

#[test]
fn a_route_older_than_update_timeout_is_pulled_again_on_its_next_get_host() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    s.outbox.clear();
    get_host(&mut s, M, 14_999);
    assert!(s.outbox.is_empty());
    get_host(&mut s, M, 15_000);
    get_host(&mut s, M, 15_001);
    assert_eq!(s.outbox, vec![ToControl::Pull(M)]);
}

#[test]
fn a_dropped_pull_is_asked_for_again() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.outbox.clear();
    s.pull_dropped(M);
    get_host(&mut s, M, 1);
    assert_eq!(s.outbox, vec![ToControl::Pull(M)]);
    assert_eq!(s.metrics.ring_drops, 1);
}

#[test]
fn a_route_update_to_empty_answers_no_such_module() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    s.apply(
        ToShard::Route {
            module: M,
            exists: true,
            version: 8,
            nodes: vec![],
        },
        1,
    );
    assert_eq!(get_host(&mut s, M, 2).0, RetCode::NoSuchModule);
}

#[test]
fn statistics_go_to_the_control_core_after_report_timeout() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    s.outbox.clear();
    report(&mut s, node(1), 0, 14_999);
    assert!(s.outbox.is_empty());
    report(&mut s, node(1), 1, 15_000);
    let ToControl::Stats { module, nodes } = &s.outbox[0] else {
        panic!("{:?}", s.outbox)
    };
    assert_eq!((*module, nodes[0].succ, nodes[0].err), (M, 1, 1));
}

#[test]
fn a_batch_report_counts_every_success() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    let mut enc = Encoder::new();
    let req = enc
        .batch_report_req(1, M, &[(node(1), 40), (node(2), 2)])
        .to_vec();
    assert!(s.handle(&req, PEER, 5).is_none());
    let mut stats = Vec::new();
    s.modules.get_mut(&M).unwrap().lb.take_stats(&mut stats);
    assert_eq!((stats[0].succ, stats[1].succ), (40, 2));
}

#[test]
fn cache_get_route_sends_nodes_only_when_the_version_changed() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    let mut enc = Encoder::new();
    for (known, unchanged, n) in [(0, false, 2), (7, true, 0)] {
        let req = enc.cache_get_route_req(1, M, known).to_vec();
        let resp = s.handle(&req, PEER, 1).unwrap().to_vec();
        let Message::CacheGetRouteResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
            panic!()
        };
        assert_eq!(
            (
                r.unchanged(),
                r.nodes().map_or(0, |v| v.len()),
                r.any_overloaded()
            ),
            (unchanged, n, false)
        );
    }
}

#[test]
fn garbage_is_counted_and_dropped() {
    let mut s = shard();
    assert!(s.handle(&[0u8; 8], PEER, 0).is_none());
    assert!(s.handle(&[0xffu8; 100], PEER, 0).is_none());
    let mut enc = Encoder::new();
    let answer = enc.stats_ack(3).to_vec();
    assert!(s.handle(&answer, PEER, 0).is_none());
    assert_eq!((s.metrics.malformed_total(), s.metrics.unexpected), (2, 1));
    // A report with port 0 is refused with a reason.
    let bad = enc
        .report_req(&Report {
            seq: 2,
            module: M,
            host: NodeAddr { ip: 1, port: 0 },
            retcode: 0,
            tcost_ms: 0,
            downstream_level: None,
        })
        .to_vec();
    let resp = s.handle(&bad, PEER, 0).unwrap().to_vec();
    let Message::ErrorResp(e) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!(e.retcode(), RetCode::BadRequest);
    // A refused request is still a request: errors never exceed requests.
    let report = crate::agent::metrics::Kind::Report as usize;
    assert_eq!(
        (
            s.metrics.requests[report],
            s.metrics.errors[report],
            s.metrics.invalid
        ),
        (1, 1, 1)
    );
}
