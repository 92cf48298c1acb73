use std::sync::Arc;

use super::*;
use crate::messages::ToShard;
use crate::metrics::priority_class;
use lbagent_admission::AdmissionParams;
use lbagent_host::snapshot::SnapshotIndex;
use lbagent_model::{NodeAddr, Policy, RouteNode};
use lbagent_wire::CacheRoute;
use lbagent_wire::{decode, Report};
use std::net::Ipv4Addr;

const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40000));
// (3 + 1) % 2 == 0: shard 0 of 2 owns it.
const M: ModuleId = ModuleId::new(3, 1);

fn shard() -> ShardCore {
    ShardCore::new(ShardSetup::new(0, 2, 8888))
}

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
}

/// Nodes 1..=n, weight 1.
fn route_nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        })
        .collect()
}

fn route(n: u8) -> ToShard {
    ToShard::Route {
        module: M,
        exists: true,
        version: 7,
        nodes: route_nodes(n),
        policy: Policy::L5,
        options: Default::default(),
        meta: Vec::new(),
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
            consumed: 0,
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
            policy: Policy::L5,
            options: Default::default(),
            meta: Vec::new(),
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
fn an_answered_module_is_not_pulled_again_by_requests() {
    // The route client keeps it current (pushes, versioned re-pulls): the
    // shard's requests cost no ring message, however old the route.
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    s.outbox.clear();
    for t in [14_999, 15_000, 15_001, 300_000] {
        get_host(&mut s, M, t);
    }
    assert!(s.outbox.is_empty());
}

#[test]
fn a_pull_unanswered_for_update_timeout_is_asked_for_again() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    assert_eq!(s.outbox, vec![ToControl::Pull(M)]);
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
            policy: Policy::L5,
            options: Default::default(),
            meta: Vec::new(),
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
            consumed: 0,
        })
        .to_vec();
    let resp = s.handle(&bad, PEER, 0).unwrap().to_vec();
    let Message::ErrorResp(e) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!()
    };
    assert_eq!(e.retcode(), RetCode::BadRequest);
    // A refused request is still a request: errors never exceed requests.
    let report = crate::metrics::Kind::Report as usize;
    assert_eq!(
        (
            s.metrics.requests[report],
            s.metrics.errors[report],
            s.metrics.invalid
        ),
        (1, 1, 1)
    );
}

// === bounds, expiry, timers (issue 10 item 1, issue 11) ===

fn bounded(max_unknown: usize) -> ShardCore {
    ShardCore::new(ShardSetup {
        max_unknown,
        module_idle_ms: 60_000,
        unknown_ttl_ms: 1_000,
        ..ShardSetup::new(0, 1, 8888)
    })
}

fn module_route(module: ModuleId, n: u32, version: u64) -> ToShard {
    ToShard::Route {
        module,
        exists: true,
        version,
        nodes: (1..=n)
            .map(|i| RouteNode {
                addr: NodeAddr::new(Ipv4Addr::from(0x0a00_0000 + i), 80),
                weight: 1,
            })
            .collect(),
        policy: Policy::L5,
        options: Default::default(),
        meta: Vec::new(),
    }
}

fn absent(module: ModuleId) -> ToShard {
    ToShard::Route {
        module,
        exists: false,
        version: 0,
        nodes: vec![],
        policy: Policy::L5,
        options: Default::default(),
        meta: Vec::new(),
    }
}

fn error_of(s: &mut ShardCore, req: &[u8], now: Millis) -> (RetCode, String) {
    let resp = s.handle(req, PEER, now).expect("an answer").to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::ErrorResp(e) => (e.retcode(), e.message().unwrap_or_default().to_string()),
        other => panic!("expected an ErrorResp, got {}", other.name()),
    }
}

#[test]
fn unknown_modules_past_the_bound_are_refused_clearly_without_a_pull() {
    let mut s = bounded(4);
    for i in 0..4 {
        assert_eq!(
            get_host(&mut s, ModuleId::new(100 + i, 0), 0).0,
            RetCode::NoSuchModule
        );
    }
    assert_eq!(s.outbox.len(), 4);
    s.outbox.clear();
    let mut enc = Encoder::new();
    let req = enc.get_host_req(1, ModuleId::new(999, 0), 0, 0).to_vec();
    let (rc, msg) = error_of(&mut s, &req, 1);
    assert_eq!(rc, RetCode::Unavailable);
    assert!(msg.contains("agent.max_unknown_modules"), "{msg}");
    assert!(s.outbox.is_empty(), "a refused module is not pulled");
    assert_eq!(s.metrics.unknown_refused, 1);
    s.refresh_gauges();
    assert_eq!((s.metrics.unknown_modules, s.metrics.modules), (4, 0));
}

#[test]
fn unknown_modules_are_forgotten_after_their_ttl_and_the_control_core_is_told() {
    let mut s = bounded(4);
    let a = ModuleId::new(100, 0);
    get_host(&mut s, a, 0);
    s.apply(absent(a), 10);
    s.outbox.clear();
    assert!(s.expire(1_009).is_empty());
    assert!(
        s.outbox.is_empty(),
        "remembered for the TTL after the answer"
    );
    s.expire(1_010);
    assert_eq!(s.outbox, vec![ToControl::Forget(a)]);
    assert_eq!(s.metrics.modules_expired, 1);
    s.refresh_gauges();
    assert_eq!(s.metrics.unknown_modules, 0);
}

#[test]
fn a_flood_of_unknown_ids_never_displaces_a_module_in_use_and_a_later_module_answers() {
    let mut s = bounded(1024);
    let used = ModuleId::new(1, 1);
    get_host(&mut s, used, 0);
    s.apply(module_route(used, 3, 1), 0);
    s.outbox.clear();
    let mut enc = Encoder::new();
    // 200,000 made-up ids over 10 s of shard time, the module in use
    // asked for all along; the route server answers "absent" to every pull.
    // (The end-to-end test in tests/agent.rs sends over a million.)
    let mut refused = 0u64;
    for i in 0..200_000u32 {
        let now = Millis::from(i / 20);
        let m = ModuleId::new(1_000_000 + i, 7);
        let req = enc.get_host_req(i, m, 0, 0).to_vec();
        let resp = s.handle(&req, PEER, now).unwrap().to_vec();
        if let Message::ErrorResp(_) = decode(&resp, &Limits::UDP).unwrap() {
            refused += 1;
        }
        for msg in std::mem::take(&mut s.outbox) {
            if let ToControl::Pull(p) = msg {
                s.apply(absent(p), now);
            }
        }
        if i % 20 == 0 {
            s.expire(now);
            assert_eq!(get_host(&mut s, used, now).0, RetCode::Ok, "at {i}");
        }
        assert!(s.modules.len() <= 1 + 1024);
    }
    assert!(refused > 180_000, "{refused} refused");
    assert_eq!(s.metrics.unknown_refused, refused);
    // After the flood: the made-up ids age out, a new module is looked up.
    let end = 10_000 + 1_000;
    s.expire(end);
    s.outbox.clear();
    let new = ModuleId::new(42, 42);
    assert_eq!(get_host(&mut s, new, end).0, RetCode::NoSuchModule);
    assert_eq!(s.outbox, vec![ToControl::Pull(new)]);
    s.apply(module_route(new, 2, 1), end + 1);
    assert_eq!(get_host(&mut s, new, end + 2).0, RetCode::Ok);
    assert_eq!(get_host(&mut s, used, end + 2).0, RetCode::Ok);
}

#[test]
fn a_module_unused_past_the_idle_time_expires_and_one_in_use_does_not() {
    let mut s = bounded(16);
    let (idle, busy) = (ModuleId::new(1, 0), ModuleId::new(2, 0));
    for m in [idle, busy] {
        get_host(&mut s, m, 0);
        s.apply(module_route(m, 2, 1), 0);
    }
    s.outbox.clear();
    for t in (0..=60_000).step_by(10_000) {
        get_host(&mut s, busy, t);
        s.expire(t);
    }
    s.outbox.retain(|m| matches!(m, ToControl::Forget(_)));
    assert_eq!(s.outbox, vec![ToControl::Forget(idle)]);
    s.outbox.clear();
    assert_eq!(get_host(&mut s, busy, 60_001).0, RetCode::Ok);
    // The forgotten module is looked up again on its next request.
    assert_eq!(get_host(&mut s, idle, 60_002).0, RetCode::NoSuchModule);
    assert_eq!(s.outbox, vec![ToControl::Pull(idle)]);
}

#[test]
fn an_expiring_module_hands_over_its_statistics_first() {
    let mut s = bounded(16);
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    report(&mut s, node(1), 0, 5);
    s.outbox.clear();
    s.expire(60_005);
    assert_eq!(s.outbox.len(), 2, "{:?}", s.outbox);
    assert!(
        matches!(&s.outbox[0], ToControl::Stats { module, nodes } if *module == M && nodes[0].succ == 1)
    );
    assert_eq!(s.outbox[1], ToControl::Forget(M));
}

#[test]
fn an_idle_shard_with_many_modules_has_nothing_due() {
    let mut s = bounded(16);
    for i in 0..100_000u32 {
        s.apply(module_route(ModuleId::new(i, 0), 1, 1), 0);
    }
    // Each entry's first expiry check (at its making + the unknown TTL)
    // re-arms it at the idle expiry, once.
    assert_eq!(s.next_deadline(), Some(1_000));
    s.expire(1_000);
    assert!(s.outbox.is_empty());
    // Every deadline is now the idle expiry: nothing is due before it, so
    // a tick takes nothing from the heap and walks no module.
    assert_eq!(s.next_deadline(), Some(60_000));
    assert!(s.expire(59_999).is_empty());
    assert_eq!(s.next_deadline(), Some(60_000));
    assert!(s.outbox.is_empty());
}

#[test]
fn a_module_made_by_a_route_expires_after_the_idle_time_from_its_making() {
    let mut s = bounded(16);
    s.apply(module_route(M, 1, 1), 0);
    s.expire(1_000);
    assert!(s.outbox.is_empty());
    s.expire(60_000);
    assert_eq!(s.outbox, vec![ToControl::Forget(M)]);
}

#[test]
fn statistics_are_sent_by_the_timer_without_a_further_report() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    s.outbox.clear();
    report(&mut s, node(1), 0, 100);
    assert!(s.outbox.is_empty());
    // No report after report_timeout: the timer sends at twice the period.
    s.expire(29_999);
    assert!(s.outbox.is_empty());
    s.expire(30_000);
    let ToControl::Stats { nodes, .. } = &s.outbox[0] else {
        panic!("{:?}", s.outbox)
    };
    assert_eq!(nodes[0].succ, 1);
}

#[test]
fn statistics_refused_by_a_full_ring_keep_exact_counts_for_the_next_send() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    s.outbox.clear();
    for _ in 0..3 {
        report(&mut s, node(1), 0, 10);
    }
    report(&mut s, node(2), 1, 10);
    report(&mut s, node(1), 0, 15_000);
    let Some(ToControl::Stats { module, nodes }) = s.outbox.pop() else {
        panic!("{:?}", s.outbox)
    };
    // The ring is full: the shell hands the message back.
    s.stats_refused(module, nodes, 15_000);
    assert_eq!(s.unsent_stats(), 1);
    report(&mut s, node(2), 0, 20_000);
    report(&mut s, node(1), 1, 30_000);
    let Some(ToControl::Stats { nodes, .. }) = s.outbox.pop() else {
        panic!("{:?}", s.outbox)
    };
    let count = |a: NodeAddr| {
        nodes
            .iter()
            .filter(|n| n.addr == a)
            .map(|n| (n.succ, n.err))
            .fold((0, 0), |x, y| (x.0 + y.0, x.1 + y.1))
    };
    assert_eq!(count(node(1)), (4, 1));
    assert_eq!(count(node(2)), (1, 1));
    assert_eq!(s.unsent_stats(), 0);
    assert_eq!(s.metrics.stats_kept, 1);
}

#[test]
fn kept_statistics_are_offered_again_by_the_timer() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    s.outbox.clear();
    report(&mut s, node(1), 0, 15_000);
    let Some(ToControl::Stats { module, nodes }) = s.outbox.pop() else {
        panic!()
    };
    s.stats_refused(module, nodes, 15_000);
    s.expire(15_000 + STATS_RETRY_MS);
    assert!(matches!(&s.outbox[..], [ToControl::Stats { nodes, .. }] if nodes[0].succ == 1));
}

#[test]
fn flush_stats_hands_over_every_count_held() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    s.outbox.clear();
    report(&mut s, node(1), 0, 10);
    report(&mut s, node(2), 1, 11);
    s.flush_stats(12);
    let ToControl::Stats { nodes, .. } = &s.outbox[0] else {
        panic!("{:?}", s.outbox)
    };
    let total: u32 = nodes.iter().map(|n| n.succ + n.err).sum();
    assert_eq!(total, 2);
    s.outbox.clear();
    s.flush_stats(13);
    assert!(s.outbox.is_empty(), "nothing left: nothing sent");
}

#[test]
fn register_requests_past_the_bound_are_refused() {
    let mut s = bounded(MAX_WAITERS + 1);
    let mut enc = Encoder::new();
    for i in 0..MAX_WAITERS as u32 {
        let req = enc.register_req(i, ModuleId::new(i, 0), 5_000).to_vec();
        assert!(s.handle(&req, PEER, 0).is_none());
    }
    let req = enc.register_req(1, ModuleId::new(1, 0), 5_000).to_vec();
    let (rc, _) = error_of(&mut s, &req, 1);
    assert_eq!(rc, RetCode::Unavailable);
    assert_eq!(s.metrics.registers_refused, 1);
    // Their deadlines pass: every one is answered, the count goes back to 0.
    assert_eq!(s.expire(5_000).len(), MAX_WAITERS);
    s.refresh_gauges();
    assert_eq!(s.metrics.waiting_registers, 0);
}

// === getRoute of modules larger than a datagram (issue 10 item 3) ===

#[test]
fn get_route_of_a_10000_node_module_comes_in_parts_that_each_fit_a_datagram() {
    let mut s = bounded(16);
    let big = ModuleId::new(7, 7);
    s.apply(module_route(big, 10_000, 3), 0);
    let mut enc = Encoder::new();
    let mut seen = Vec::new();
    let parts = wire::route_parts(10_000, wire::GETROUTE_PART_NODES);
    assert_eq!(parts, 20);
    for part in 0..parts {
        let req = enc.get_route_req_part(part, big, part).to_vec();
        let resp = s.handle(&req, PEER, 1).unwrap().to_vec();
        assert!(resp.len() <= 65_507, "part {part}: {} bytes", resp.len());
        let Message::GetRouteResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
            panic!()
        };
        assert_eq!((r.part(), r.parts(), r.version()), (part, parts, 3));
        seen.extend(
            r.nodes()
                .unwrap()
                .iter()
                .map(|n| NodeAddr::from(n.host().unwrap())),
        );
    }
    let want: Vec<NodeAddr> = s.modules[&big]
        .lb
        .nodes()
        .iter()
        .map(|n| n.addr())
        .collect();
    assert_eq!(seen, want);
    // A part past the last: a clear BadRequest.
    let req = enc.get_route_req_part(1, big, parts).to_vec();
    let (rc, msg) = error_of(&mut s, &req, 2);
    assert_eq!(rc, RetCode::BadRequest);
    assert!(msg.contains("20 part"), "{msg}");
}

#[test]
fn the_largest_get_route_part_fits_a_datagram() {
    let mut enc = Encoder::new();
    let worst = NodeStatus {
        addr: NodeAddr::new(Ipv4Addr::BROADCAST, u16::MAX),
        weight: u32::MAX,
        overloaded: true,
        vsucc: u32::MAX,
        verr: u32::MAX,
        rsucc: u32::MAX,
        rerr: u32::MAX,
        contin_succ: u32::MAX,
        contin_err: u32::MAX,
        bad_windows: u32::MAX,
        window_age_ms: u64::MAX,
        overload_age_ms: u64::MAX,
        capacity: 0,
        in_use: 0,
        phi: 0.0,
    };
    let nodes = vec![worst; wire::GETROUTE_PART_NODES];
    let m = ModuleId::new(u32::MAX, u32::MAX);
    let len = enc
        .get_route_resp_part(
            u32::MAX,
            m,
            RetCode::Ok,
            u64::MAX,
            &nodes,
            (u32::MAX, u32::MAX),
            Policy::L5,
            &lbagent_model::ModuleOptions {
                slow_start_ms: Some(u32::MAX),
                max_overloaded_percent: Some(100),
                panic_percent: Some(100),
                locality_min_percent: Some(100),
            },
        )
        .len();
    assert!(len <= 65_507, "{len} bytes");
    let route = vec![
        RouteNode {
            addr: NodeAddr::new(Ipv4Addr::BROADCAST, u16::MAX),
            weight: u32::MAX
        };
        wire::CACHE_ROUTE_PART_NODES
    ];
    let resp = CacheRoute {
        seq: u32::MAX,
        module: m,
        retcode: RetCode::Ok,
        version: u64::MAX,
        unchanged: false,
        any_overloaded: true,
        nodes: &route,
    };
    let len = enc
        .cache_get_route_resp_part(&resp, (u32::MAX, u32::MAX))
        .len();
    assert!(len <= 65_507, "{len} bytes");
}

#[test]
fn cache_get_route_of_a_10000_node_module_comes_in_parts() {
    let mut s = bounded(16);
    let big = ModuleId::new(7, 7);
    s.apply(module_route(big, 10_000, 3), 0);
    let mut enc = Encoder::new();
    let mut total = 0;
    for part in 0..3 {
        let req = enc.cache_get_route_req_part(1, big, 0, part).to_vec();
        let resp = s.handle(&req, PEER, 1).unwrap().to_vec();
        let Message::CacheGetRouteResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
            panic!()
        };
        assert_eq!((r.part(), r.parts()), (part, 3));
        total += r.nodes().unwrap().len();
    }
    assert_eq!(total, 10_000);
}

// === downstream admission levels (issue 12 item 3) ===

fn get_host_as(s: &mut ShardCore, b: u8, u: u8, now: Millis) -> (RetCode, Option<NodeAddr>) {
    let mut enc = Encoder::new();
    let req = enc.get_host_req(9, M, b, u).to_vec();
    let resp = s.handle(&req, PEER, now).expect("an answer").to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::GetHostResp(r) => (r.retcode(), r.host().map(NodeAddr::from)),
        other => panic!("unexpected {}", other.name()),
    }
}

fn report_level(s: &mut ShardCore, host: NodeAddr, level: wire::AdmissionLevel, now: Millis) {
    let mut enc = Encoder::new();
    let req = enc
        .report_req(&Report {
            seq: 1,
            module: M,
            host,
            retcode: 0,
            tcost_ms: 0,
            downstream_level: Some(level),
            consumed: 0,
        })
        .to_vec();
    assert!(s.handle(&req, PEER, now).is_none());
}

fn cache_says_overloaded(s: &mut ShardCore, now: Millis) -> bool {
    let req = Encoder::new().cache_get_route_req(1, M, 7).to_vec();
    let resp = s.handle(&req, PEER, now).unwrap().to_vec();
    let Message::CacheGetRouteResp(r) = decode(&resp, &Limits::UDP).unwrap() else {
        panic!()
    };
    r.any_overloaded()
}

/// A shard that takes levels every caller shares from UDP callers too
/// (`agent.udp_acts_beyond`), as every shard did before issue 27.
fn trusting_shard() -> ShardCore {
    ShardCore::new(ShardSetup {
        udp_acts_beyond: true,
        ..ShardSetup::new(0, 2, 8888)
    })
}

#[test]
fn a_reported_level_rejects_lower_priorities_until_it_times_out() {
    let mut s = trusting_shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    assert!(!cache_says_overloaded(&mut s, 1));
    report_level(&mut s, node(1), wire::AdmissionLevel::new(10, 128), 10);
    assert_eq!(get_host_as(&mut s, 20, 1, 11), (RetCode::Rejected, None));
    assert_eq!(get_host_as(&mut s, 5, 1, 12), (RetCode::Ok, Some(node(1))));
    assert_eq!(
        get_host_as(&mut s, 10, 128, 13),
        (RetCode::Ok, Some(node(1)))
    );
    assert_eq!(s.metrics.rejected, 1);
    assert_eq!(s.metrics.levels_reported, 1);
    s.refresh_gauges();
    assert_eq!(s.metrics.nodes_levelled, 1);
    assert_eq!(
        s.metrics.module_levels,
        vec![(M, wire::AdmissionLevel::new(10, 128))]
    );
    assert!(
        cache_says_overloaded(&mut s, 14),
        "the cache must pass through"
    );
    let later = 10 + LEVEL_TIMEOUT_MS;
    assert_eq!(
        get_host_as(&mut s, 20, 1, later),
        (RetCode::Ok, Some(node(1)))
    );
    assert!(!cache_says_overloaded(&mut s, later));
}

#[test]
fn a_level_reported_for_a_node_not_in_the_route_is_ignored() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    report_level(&mut s, node(9), wire::AdmissionLevel::new(1, 1), 10);
    assert_eq!(s.metrics.levels_reported, 0);
    assert_eq!(s.metrics.unknown_node_reports, 1);
    assert_eq!(get_host_as(&mut s, 20, 1, 11), (RetCode::Ok, Some(node(1))));
}

#[test]
fn a_balance_module_draws_among_the_nodes_its_levels_admit() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(
        ToShard::Route {
            module: M,
            exists: true,
            version: 7,
            nodes: vec![
                RouteNode {
                    addr: node(1),
                    weight: 3,
                },
                RouteNode {
                    addr: node(2),
                    weight: 2,
                },
            ],
            policy: Policy::Balance,
            options: Default::default(),
            meta: Vec::new(),
        },
        0,
    );
    report_level(&mut s, node(1), wire::AdmissionLevel::new(10, 128), 10);
    // Priority 20: node 2's two units, then Rejected (node 1's three free
    // units refuse it), counted as a downstream rejection.
    for now in 11..13 {
        assert_eq!(
            get_host_as(&mut s, 20, 1, now),
            (RetCode::Ok, Some(node(2)))
        );
    }
    assert_eq!(get_host_as(&mut s, 20, 1, 13), (RetCode::Rejected, None));
    assert_eq!(s.metrics.rejected, 1);
    // Priority 5 is admitted by node 1; with every unit out, Overloaded.
    for now in 14..17 {
        assert_eq!(get_host_as(&mut s, 5, 1, now), (RetCode::Ok, Some(node(1))));
    }
    assert_eq!(get_host_as(&mut s, 5, 1, 17), (RetCode::Overloaded, None));
    // The level times out: node 1's returned unit serves priority 20.
    report(&mut s, node(1), 0, 18);
    let later = 10 + LEVEL_TIMEOUT_MS;
    assert_eq!(
        get_host_as(&mut s, 20, 1, later),
        (RetCode::Ok, Some(node(1)))
    );
}

// === the shard's own admission control (issue 12 item 4) ===

/// A getHost of priorities `(b, u)` that waited `waited_us` in the socket,
/// handled at `now_us`: its retcode and the level the answer carries.
fn queued_get_host(
    s: &mut ShardCore,
    b: u8,
    u: u8,
    now_us: Micros,
    waited_us: Micros,
) -> (RetCode, Option<wire::AdmissionLevel>) {
    let req = Encoder::new().get_host_req(9, M, b, u).to_vec();
    let q = Queued { now_us, waited_us };
    let resp = s
        .handle_queued(&req, PEER, now_us / 1000, Some(q))
        .expect("an answer")
        .to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::GetHostResp(r) => (
            r.retcode(),
            r.admission_level()
                .map(|l| wire::AdmissionLevel::new(l.business(), l.user())),
        ),
        other => panic!("unexpected {}", other.name()),
    }
}

#[test]
fn an_overloaded_shard_sheds_low_priorities_and_keeps_high_ones() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    s.set_shedding(Some(AdmissionParams {
        window_us: 1_000_000,
        window_requests: 100,
        queuing_threshold_us: 500,
        ..AdmissionParams::default()
    }));
    // Calm: short queuing, everything admitted, no level on the answers.
    let mut t = 1_000_000;
    for i in 0..200u32 {
        t += 10;
        let b = if i % 2 == 0 { 5 } else { 60 };
        assert_eq!(queued_get_host(&mut s, b, 1, t, 50), (RetCode::Ok, None));
    }
    assert_eq!(s.self_level(), lbagent_admission::OPEN);
    // Overloaded (2 ms queuing) while class 60 is admitted at all: the
    // level falls until class 60 is shed, while class 5 keeps its answers
    // (but for the odd -5% step that cuts into it when little of class 60
    // was left to cut).
    let (mut shed60, mut shed5) = (0, 0);
    for i in 0..4000u32 {
        t += 10;
        let b = if i % 2 == 0 { 5 } else { 60 };
        let waited = if s.self_level().business >= 60 {
            2_000
        } else {
            100
        };
        let (rc, level) = queued_get_host(&mut s, b, (i % 128) as u8 + 1, t, waited);
        if b == 5 {
            shed5 += u64::from(rc == RetCode::Rejected);
        } else if rc == RetCode::Rejected {
            shed60 += 1;
            let l = level.expect("a shed answer carries the shard's level");
            assert!(!lbagent_admission::admits(l, 60, (i % 128) as u8 + 1));
        }
    }
    assert!(shed60 > 1500, "class 60 shed {shed60} of 2000");
    assert!(shed5 < 100, "class 5 shed {shed5} of 2000");
    assert!(s.self_level().business <= 60);
    let class60 = priority_class(60);
    assert_eq!(s.metrics.self_rejected[class60], shed60);
    assert_eq!(s.metrics.self_rejected[priority_class(5)], shed5);
    assert_eq!(s.metrics.self_level, s.self_level());
    // Every queued getHost of class 5 is in its class's queuing histogram.
    let class5: u64 = s.metrics.gethost_queuing[priority_class(5)].iter().sum();
    assert_eq!(class5, 2100);
    // A getHost without a queuing time (no kernel stamp) is never shed.
    assert_eq!(get_host_as(&mut s, 60, 128, t / 1000).0, RetCode::Ok);
    // Calm again: the time-ended windows raise the level back to open.
    for k in 0..2000u64 {
        t += 1_000_000;
        s.tick_shedding(t);
        queued_get_host(&mut s, 60, 128, t + 1, 10);
        if s.self_level() == lbagent_admission::OPEN {
            assert!(k > 0);
            break;
        }
    }
    assert_eq!(s.self_level(), lbagent_admission::OPEN);
    // Off: nothing is shed whatever the queuing time.
    s.set_shedding(None);
    assert_eq!(
        queued_get_host(&mut s, 128, 128, t + 5, 60_000).0,
        RetCode::Ok
    );
    let total: u64 = s.metrics.queuing_buckets.iter().sum();
    assert!(total > 4200, "every queued datagram is counted: {total}");
}

#[test]
fn kernel_drops_make_the_shards_window_overloaded() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    s.set_shedding(Some(AdmissionParams {
        window_us: 1_000_000,
        window_requests: 100,
        queuing_threshold_us: 500,
        ..AdmissionParams::default()
    }));
    // Short queuing (a receive buffer sized to the threshold never holds
    // more), but the kernel dropped datagrams meanwhile: overloaded.
    let mut t = 1_000_000;
    for i in 0..100u32 {
        t += 10;
        if i == 50 {
            s.kernel_drops(7);
        }
        queued_get_host(&mut s, 60, (i % 128) as u8 + 1, t, 50);
    }
    assert!(s.self_level().business == 60 && s.self_level().user < 128);
    assert_eq!(s.metrics.kernel_drops, 7);
    // Without new drops (the same running count again), the same queuing
    // is calm: the level rises.
    let level = s.self_level();
    s.kernel_drops(7);
    for i in 0..100u32 {
        t += 10;
        queued_get_host(&mut s, 60, (i % 128) as u8 + 1, t, 50);
    }
    assert!(lbagent_admission::level_index(s.self_level()) > lbagent_admission::level_index(level));
    // The count wraps.
    s.kernel_drops(u32::MAX);
    s.kernel_drops(2);
    assert_eq!(s.metrics.kernel_drops, u64::from(u32::MAX) + 3);
}

// === the snapshot's routes at start (preload) ===

/// Modules owned by shard 0 of 2, each with `nodes` nodes, in module order.
/// A snapshot of `modules` modules of shard 0 of 2, (2k, 0), with `nodes`
/// nodes each, between which lie modules of shard 1, (2k + 1, 0), and
/// modules of shard 0 with no node, (2k, 1): neither is made.
fn preloaded(modules: u32, nodes: u8) -> Arc<SnapshotIndex> {
    use lbagent_host::snapshot::{self, SnapshotRoute};
    let route = |module, n: u8| SnapshotRoute {
        module,
        version: 1,
        nodes: route_nodes(n),
        meta: Vec::new(),
    };
    let routes: Vec<SnapshotRoute> = (0..modules)
        .flat_map(|k| {
            [
                route(ModuleId::new(2 * k, 0), nodes),
                route(ModuleId::new(2 * k + 1, 0), nodes),
                route(ModuleId::new(2 * k, 1), 0),
            ]
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.snapshot");
    snapshot::write(&path, 1, &routes).unwrap();
    Arc::new(snapshot::read_index(&path).unwrap())
}

#[test]
fn a_preloaded_module_answers_its_first_request_and_the_rest_are_made_in_slices() {
    let mut s = shard();
    s.preload(preloaded(1000, 3));
    assert_eq!((s.preloading(), s.modules.len()), (1000, 0));
    // The last one, asked first: made on demand, answered from its route,
    // with no pull.
    let last = ModuleId::new(2 * 999, 0);
    assert_eq!(get_host(&mut s, last, 5), (RetCode::Ok, Some(node(1))));
    assert!(s.outbox.is_empty(), "{:?}", s.outbox);
    assert_eq!((s.preloading(), s.modules.len()), (999, 1));
    // A report for another preloaded module finds it too.
    let mut enc = Encoder::new();
    let m = ModuleId::new(2 * 500, 0);
    let req = enc
        .report_req(&Report {
            seq: 1,
            module: m,
            host: node(2),
            retcode: 0,
            tcost_ms: 0,
            downstream_level: None,
            consumed: 0,
        })
        .to_vec();
    assert!(s.handle(&req, PEER, 6).is_none());
    assert_eq!(s.metrics.unknown_module_reports, 0);
    assert_eq!(s.modules[&m].lb.nodes()[1].rsucc(), 1);
    // Slices of 768 nodes, 256 modules of 3: four steps make the other
    // 998 (three say more remain).
    let steps = std::iter::from_fn(|| Some(s.preload_step(7, 768)))
        .take_while(|&more| more)
        .count();
    assert_eq!(steps, 3);
    assert_eq!((s.preloading(), s.modules.len()), (0, 1000));
    assert!(
        s.preload.snapshot.is_none(),
        "nothing of the snapshot is held"
    );
    // Neither the other shard's modules nor the empty routes were made.
    assert!(s.modules.keys().all(|m| m.modid % 2 == 0 && m.cmdid == 0));
    // The module asked first kept its round robin position.
    assert_eq!(get_host(&mut s, last, 8), (RetCode::Ok, Some(node(2))));
}

#[test]
fn a_preload_slice_is_bounded_by_nodes_not_modules() {
    let mut s = shard();
    s.preload(preloaded(10, 100));
    // 250 nodes: three modules of 100 (at least the budget), then 7 left.
    assert!(s.preload_step(7, 250));
    assert_eq!((s.preloading(), s.modules.len()), (7, 3));
    // A budget below one module's nodes still makes one.
    assert!(s.preload_step(7, 1));
    assert_eq!(s.modules.len(), 4);
    while s.preload_step(7, 250) {}
    assert_eq!((s.preloading(), s.modules.len()), (0, 10));
}

#[test]
fn a_preload_step_counts_the_nodes_it_made_and_always_makes_one_module() {
    let mut s = shard();
    s.preload(preloaded(6, 5));
    // A budget of 0 still makes one module (no step can stall the drain).
    assert!(s.preload_step(7, 0));
    assert_eq!((s.preloading(), s.modules.len()), (5, 1));
    // 10 nodes: exactly two modules of 5.
    assert!(s.preload_step(7, 10));
    assert_eq!((s.preloading(), s.modules.len()), (3, 3));
    // 11 nodes: a third module after two; the last ones, so done.
    assert!(!s.preload_step(7, 11));
    assert_eq!((s.preloading(), s.modules.len()), (0, 6));
}

#[test]
fn a_share_with_no_route_to_make_holds_nothing_and_its_step_is_done_at_once() {
    // The shard's share is only routes with no node (and the other shard's
    // routes): nothing to make, nothing held.
    use lbagent_host::snapshot::{self, SnapshotRoute};
    let route = |modid, n| SnapshotRoute {
        module: ModuleId::new(modid, 1),
        version: 1,
        nodes: route_nodes(n),
        meta: Vec::new(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.snapshot");
    // (1, 1) and (3, 1) are shard 0's, (2, 1) the other shard's.
    snapshot::write(&path, 1, &[route(1, 0), route(2, 3), route(3, 0)]).unwrap();
    let index = Arc::new(snapshot::read_index(&path).unwrap());
    let mut s = shard();
    assert_eq!(ModuleId::new(2, 1).shard(2), 1, "not this shard's");
    s.preload(index.clone());
    assert_eq!(s.preloading(), 0);
    assert!(s.preload.snapshot.is_none(), "nothing of the snapshot held");
    assert!(!s.preload_step(7, 0));
    assert!(s.modules.is_empty());
    // An empty snapshot: the same.
    snapshot::write(&path, 1, &[]).unwrap();
    s.preload(Arc::new(snapshot::read_index(&path).unwrap()));
    assert!(!s.preload_step(7, 1));
    assert_eq!((s.preloading(), s.modules.len()), (0, 0));
    assert_eq!(Arc::strong_count(&index), 1, "the shard let go of it");
}

#[test]
fn a_route_for_a_preloaded_module_replaces_the_snapshots() {
    let mut s = shard();
    s.preload(preloaded(3, 3));
    let m = ModuleId::new(2, 0);
    let newer = ToShard::Route {
        module: m,
        exists: true,
        version: 9,
        nodes: vec![RouteNode {
            addr: node(7),
            weight: 1,
        }],
        policy: Policy::L5,
        options: Default::default(),
        meta: Vec::new(),
    };
    assert!(s.apply(newer, 5).is_empty());
    assert_eq!(s.preloading(), 2);
    assert_eq!(s.modules[&m].lb.version(), 9);
    assert_eq!(get_host(&mut s, m, 6), (RetCode::Ok, Some(node(7))));
    while s.preload_step(7, 1) {}
    assert_eq!(
        s.modules[&m].lb.version(),
        9,
        "not overwritten by the drain"
    );
    assert_eq!(s.modules.len(), 3);
}

#[test]
fn node_gauges_follow_routes_transitions_and_forgets_without_a_walk() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(3), 1);
    s.refresh_gauges();
    assert_eq!((s.metrics.nodes_idle, s.metrics.nodes_overloaded), (3, 0));
    for _ in 0..20 {
        report(&mut s, node(2), -1, 2);
    }
    assert_eq!((s.metrics.nodes_idle, s.metrics.nodes_overloaded), (2, 1));
    // A route without node 2 (overloaded) and with a new node 4.
    s.apply(
        ToShard::Route {
            module: M,
            exists: true,
            version: 8,
            nodes: [1, 3, 4]
                .map(|i| RouteNode {
                    addr: node(i),
                    weight: 1,
                })
                .to_vec(),
            policy: Policy::L5,
            options: Default::default(),
            meta: Vec::new(),
        },
        3,
    );
    assert_eq!((s.metrics.nodes_idle, s.metrics.nodes_overloaded), (3, 0));
    // Unused past module_idle_ms: forgotten, its nodes leave the gauges.
    let later = 3 + s.setup.module_idle_ms + 1;
    s.expire(later);
    s.expire(later + s.setup.module_idle_ms + 1);
    assert!(s.modules.is_empty());
    assert_eq!((s.metrics.nodes_idle, s.metrics.nodes_overloaded), (0, 0));
}

// === the shared memory's fixed layout (issue 16) ===

/// What a shard answered, whichever layout: a getHost's values, or the
/// bytes of any other answer, or nothing.
#[derive(Debug, PartialEq)]
enum Said {
    Host(HostAnswer),
    Bytes(Vec<u8>),
    Nothing,
}

/// Two shards fed the same requests, one as FlatBuffers datagrams and one
/// as fixed records: every answer and every count must be the same.
struct Twins {
    flat: ShardCore,
    fixed: ShardCore,
}

impl Twins {
    fn new() -> Twins {
        Twins {
            flat: shard(),
            fixed: shard(),
        }
    }

    fn both(&mut self, f: impl Fn(&mut ShardCore)) {
        f(&mut self.flat);
        f(&mut self.fixed);
    }

    /// Sends `req` to both (with `queued`, if any); asserts that both said
    /// the same, and returns it.
    fn send(&mut self, req: fixed::Request, now: Millis, queued: Option<Queued>) -> Said {
        let mut enc = Encoder::new();
        let datagram = match req {
            fixed::Request::GetHost(g) => enc
                .get_host_req(g.seq, g.module, g.business_priority, g.user_priority)
                .to_vec(),
            fixed::Request::Report(r) => enc.report_req(&r).to_vec(),
        };
        let flat = match self.flat.handle_queued(&datagram, PEER, now, queued) {
            None => Said::Nothing,
            Some(b) => match decode(b, &Limits::UDP).unwrap() {
                Message::GetHostResp(r) => Said::Host(HostAnswer::from_resp(&r)),
                _ => Said::Bytes(b.to_vec()),
            },
        };
        let mut rec = [0u8; fixed::MAX_LEN];
        let n = fixed::encode_request(&req, &mut rec);
        let fixed = match self.fixed.handle_fixed(&rec[..n], PEER, now, queued) {
            FixedReply::Host(a) => Said::Host(a),
            FixedReply::Bytes(b) => Said::Bytes(b.to_vec()),
            FixedReply::Nothing => Said::Nothing,
            FixedReply::Garbage(why) => panic!("a valid record refused: {why}"),
        };
        assert_eq!(flat, fixed, "{req:?}");
        assert_eq!(self.flat.last_kind(), self.fixed.last_kind());
        flat
    }

    fn assert_same_counts(&self) {
        assert_eq!(
            format!("{:?}", self.flat.metrics),
            format!("{:?}", self.fixed.metrics)
        );
    }
}

fn gh(m: ModuleId, b: u8, u: u8) -> fixed::Request {
    fixed::Request::GetHost(wire::GetHost {
        seq: 9,
        module: m,
        business_priority: b,
        user_priority: u,
    })
}

fn rep(host: NodeAddr, retcode: i32, level: Option<wire::AdmissionLevel>) -> fixed::Request {
    fixed::Request::Report(Report {
        seq: 4,
        module: M,
        host,
        retcode,
        tcost_ms: 150,
        downstream_level: level,
        consumed: 0,
    })
}

#[test]
fn a_fixed_record_takes_the_path_of_its_datagram_to_the_same_answer() {
    let mut t = Twins::new();
    // Unknown module: NoSuchModule and a pull, on both.
    let first = t.send(gh(M, 0, 0), 0, None);
    assert!(
        matches!(first, Said::Host(a) if a.retcode == RetCode::NoSuchModule),
        "{first:?}"
    );
    t.both(|s| {
        s.apply(route(3), 0);
    });
    // L5 picks, reports (failures too) move both the same way.
    for i in 0..60u64 {
        let Said::Host(a) = t.send(gh(M, 0, 0), 10 + i, None) else {
            panic!("a getHost answer")
        };
        assert_eq!(a.retcode, RetCode::Ok);
        let host = a.host.expect("a node");
        t.send(
            rep(host, if i % 7 == 0 { 1 } else { 0 }, None),
            10 + i,
            None,
        );
    }
    // Downstream levels: a getHost below every node's level is Rejected,
    // one above is answered.
    let level = wire::AdmissionLevel::new(10, 128);
    for i in 1..=3 {
        assert_eq!(
            t.send(rep(node(i), 0, Some(level)), 100, None),
            Said::Nothing
        );
    }
    let Said::Host(low) = t.send(gh(M, 20, 1), 101, None) else {
        panic!("a getHost answer")
    };
    assert_eq!((low.retcode, low.host), (RetCode::Rejected, None));
    let Said::Host(high) = t.send(gh(M, 5, 1), 102, None) else {
        panic!("a getHost answer")
    };
    assert_eq!(high.retcode, RetCode::Ok);
    // Out-of-range values: the same BadRequest bytes; another shard's
    // module: the same WrongShard bytes; a report of an unknown node.
    for req in [
        gh(M, 129, 1),
        rep(NodeAddr::new(Ipv4Addr::LOCALHOST, 0), 0, None),
        rep(node(1), 0, Some(wire::AdmissionLevel::new(0, 3))),
        gh(ModuleId::new(3, 2), 0, 0),
        rep(node(9), 0, None),
    ] {
        t.send(req, 103, None);
    }
    // The shard's own overload: the same sheds, the same level on every
    // answer.
    t.both(|s| {
        s.set_shedding(Some(AdmissionParams {
            window_us: 1_000_000,
            window_requests: 100,
            queuing_threshold_us: 500,
            ..AdmissionParams::default()
        }))
    });
    let (mut now_us, mut shed, mut levelled) = (1_000_000, 0, 0);
    for i in 0..3000u32 {
        now_us += 10;
        let b = if i % 2 == 0 { 5 } else { 60 };
        let waited_us = if t.flat.self_level().business >= 60 {
            2_000
        } else {
            100
        };
        let q = Some(Queued { now_us, waited_us });
        if let Said::Host(a) = t.send(gh(M, b, (i % 128) as u8 + 1), now_us / 1000, q) {
            shed += u32::from(a.retcode == RetCode::Rejected && b == 60);
            levelled += u32::from(a.level.is_some());
        }
    }
    assert!(shed > 1000, "the shard shed class 60: {shed}");
    assert!(
        levelled > 1000,
        "answers carry the shard's level: {levelled}"
    );
    assert_eq!(t.flat.self_level(), t.fixed.self_level());
    t.assert_same_counts();
    // Bytes that are no record: refused, nothing counted as a request.
    let before = t.fixed.metrics.clone();
    for junk in [&[][..], &[1, 0, 0, 0][..], &[7; 16][..], &[2; 36][..]] {
        assert!(matches!(
            t.fixed.handle_fixed(junk, PEER, 200, None),
            FixedReply::Garbage(_)
        ));
    }
    assert_eq!(format!("{before:?}"), format!("{:?}", t.fixed.metrics));
}

// === requests that act beyond the caller (issue 27) ===

const OTHER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40001));

fn balance_route(weight: u32) -> ToShard {
    ToShard::Route {
        module: M,
        exists: true,
        version: 7,
        nodes: vec![RouteNode {
            addr: node(1),
            weight,
        }],
        policy: Policy::Balance,
        options: Default::default(),
        meta: Vec::new(),
    }
}

fn report_from(
    s: &mut ShardCore,
    peer: SocketAddr,
    level: Option<wire::AdmissionLevel>,
    consumed: u32,
    now: Millis,
) -> Option<(RetCode, String)> {
    let mut enc = Encoder::new();
    let req = enc
        .report_req(&Report {
            seq: 5,
            module: M,
            host: node(1),
            retcode: 0,
            tcost_ms: 0,
            downstream_level: level,
            consumed,
        })
        .to_vec();
    let resp = s.handle(&req, peer, now)?.to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::ErrorResp(e) => Some((e.retcode(), e.message().unwrap_or("").to_string())),
        other => panic!("unexpected {}", other.name()),
    }
}

fn get_host_from(s: &mut ShardCore, peer: SocketAddr, b: u8, now: Millis) -> RetCode {
    let mut enc = Encoder::new();
    let req = enc.get_host_req(9, M, b, 1).to_vec();
    let resp = s.handle(&req, peer, now).expect("an answer").to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::GetHostResp(r) => r.retcode(),
        Message::ErrorResp(e) => e.retcode(),
        other => panic!("unexpected {}", other.name()),
    }
}

fn stats_consumed(s: &mut ShardCore, now: Millis) -> u32 {
    s.flush_stats(now);
    s.outbox
        .drain(..)
        .filter_map(|m| match m {
            ToControl::Stats { nodes, .. } => Some(nodes.iter().map(|n| n.consumed).sum::<u32>()),
            _ => None,
        })
        .sum()
}

#[test]
fn a_report_that_consumes_over_udp_is_refused_and_changes_nothing() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(balance_route(10), 0);
    s.outbox.clear();
    let (rc, why) = report_from(&mut s, PEER, None, 7, 10).expect("an answer");
    assert_eq!(rc, RetCode::Forbidden);
    assert!(
        why.contains("local socket") && why.contains("udp_acts_beyond"),
        "{why}"
    );
    assert_eq!(s.metrics.forbidden, 1);
    assert_eq!(stats_consumed(&mut s, 20), 0);
}

#[test]
fn a_report_that_consumes_from_a_slot_or_a_trusted_local_connection_is_taken() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(balance_route(10), 0);
    s.outbox.clear();
    let slot = lbagent_shm::layout::slot_peer(3);
    // Taken, and said so (the sender waits for it).
    let taken = report_from(&mut s, slot, None, 2, 10);
    assert_eq!(taken.map(|r| r.0), Some(RetCode::Ok));
    let caller = |trusted| callers::LocalCaller {
        uid: 1000,
        gid: 1000,
        pid: 1,
        trusted,
        udp: None,
    };
    s.local_connected(1, caller(true));
    s.local_connected(2, caller(false));
    let taken = report_from(&mut s, callers::local_peer(1), None, 3, 10);
    assert_eq!(taken.map(|r| r.0), Some(RetCode::Ok));
    let refused = report_from(&mut s, callers::local_peer(2), None, 4, 10);
    assert_eq!(refused.map(|r| r.0), Some(RetCode::Forbidden));
    assert_eq!(stats_consumed(&mut s, 20), 5);
}

#[test]
fn a_level_from_an_untrusted_caller_rejects_only_its_own_get_hosts() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(1), 0);
    let strict = wire::AdmissionLevel::new(1, 1);
    assert_eq!(report_from(&mut s, PEER, Some(strict), 0, 10), None);
    assert_eq!(s.metrics.levels_private, 1);
    assert_eq!(get_host_from(&mut s, PEER, 50, 11), RetCode::Rejected);
    assert_eq!(get_host_from(&mut s, OTHER, 50, 12), RetCode::Ok);
    // From a trusted local connection it is shared: OTHER is rejected too.
    s.local_connected(
        4,
        callers::LocalCaller {
            uid: 0,
            gid: 0,
            pid: 1,
            trusted: true,
            udp: None,
        },
    );
    let local = callers::local_peer(4);
    assert_eq!(report_from(&mut s, local, Some(strict), 0, 13), None);
    assert_eq!(get_host_from(&mut s, OTHER, 50, 14), RetCode::Rejected);
}

#[test]
fn a_forged_report_frees_no_unit_and_one_client_is_bounded() {
    let mut s = ShardCore::new(ShardSetup {
        params: LbParams {
            units_per_client: 2,
            ..LbParams::default()
        },
        ..ShardSetup::new(0, 2, 8888)
    });
    get_host(&mut s, M, 0);
    s.apply(balance_route(3), 0);
    assert_eq!(get_host_from(&mut s, PEER, 0, 10), RetCode::Ok);
    assert_eq!(get_host_from(&mut s, PEER, 0, 10), RetCode::Ok);
    // PEER is at its bound; OTHER takes the last unit.
    assert_eq!(get_host_from(&mut s, PEER, 0, 10), RetCode::Overloaded);
    assert_eq!(s.metrics.units_client_limited, 1);
    assert_eq!(get_host_from(&mut s, OTHER, 0, 10), RetCode::Ok);
    // A third client forges reports: nothing is freed.
    let forger = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40002));
    for _ in 0..5 {
        report_from(&mut s, forger, None, 0, 11);
    }
    assert_eq!(get_host_from(&mut s, forger, 0, 12), RetCode::Overloaded);
    // OTHER's own report frees its unit.
    report_from(&mut s, OTHER, None, 0, 13);
    assert_eq!(get_host_from(&mut s, forger, 0, 14), RetCode::Ok);
}

#[test]
fn a_closed_local_connection_gives_its_units_back() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(balance_route(2), 0);
    s.local_connected(
        9,
        callers::LocalCaller {
            uid: 65534,
            gid: 65534,
            pid: 1,
            trusted: false,
            udp: None,
        },
    );
    let local = callers::local_peer(9);
    assert_eq!(get_host_from(&mut s, local, 0, 10), RetCode::Ok);
    assert_eq!(get_host_from(&mut s, local, 0, 10), RetCode::Ok);
    assert_eq!(get_host_from(&mut s, PEER, 0, 10), RetCode::Overloaded);
    s.local_closed(9);
    assert_eq!(s.metrics.units_released, 2);
    assert_eq!(s.metrics.local_connections, 0);
    assert_eq!(get_host_from(&mut s, PEER, 0, 11), RetCode::Ok);
}

#[test]
fn a_udp_source_a_trusted_connection_identified_is_trusted_and_released_with_it() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(balance_route(3), 0);
    s.outbox.clear();
    s.local_connected(
        8,
        callers::LocalCaller {
            uid: 0,
            gid: 0,
            pid: 1,
            trusted: true,
            udp: Some(PEER),
        },
    );
    // PEER's consumption is taken over UDP; OTHER's is not.
    let taken = report_from(&mut s, PEER, None, 1, 10);
    assert_eq!(taken.map(|r| r.0), Some(RetCode::Ok));
    let refused = report_from(&mut s, OTHER, None, 1, 10);
    assert_eq!(refused.map(|r| r.0), Some(RetCode::Forbidden));
    // PEER's units go back when its connection closes.
    assert_eq!(get_host_from(&mut s, PEER, 0, 11), RetCode::Ok);
    assert_eq!(get_host_from(&mut s, PEER, 0, 11), RetCode::Ok);
    s.local_closed(8);
    assert_eq!(s.metrics.units_released, 2);
    assert!(!s.trusts(PEER));
}

// === issue 31: module options through the shard ===

fn route_with(n: u8, policy: Policy, options: lbagent_model::ModuleOptions) -> ToShard {
    ToShard::Route {
        module: M,
        exists: true,
        version: 8,
        nodes: route_nodes(n),
        policy,
        options,
        meta: Vec::new(),
    }
}

#[test]
fn a_module_in_panic_answers_every_node_counts_and_tells_the_control_core_once() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    let panic = lbagent_model::ModuleOptions {
        panic_percent: Some(50),
        ..Default::default()
    };
    s.apply(route_with(2, Policy::L5, panic), 0);
    s.outbox.clear();
    // Node 1 fails until overloaded: 1 of 2 idle is not below half.
    for _ in 0..15 {
        report(&mut s, node(1), 1, 1);
    }
    assert_eq!(get_host(&mut s, M, 2), (RetCode::Ok, Some(node(2))));
    for _ in 0..15 {
        report(&mut s, node(2), 1, 3);
    }
    // Every node overloaded: round robin over all instead of OVERLOADED.
    let hosts: Vec<_> = (0..4).map(|_| get_host(&mut s, M, 4)).collect();
    assert!(hosts
        .iter()
        .all(|&(rc, h)| rc == RetCode::Ok && h.is_some()));
    assert_eq!(s.metrics.panic_answers, 4);
    let told: Vec<_> = s
        .outbox
        .iter()
        .filter(|m| matches!(m, ToControl::Panic { .. }))
        .cloned()
        .collect();
    assert_eq!(
        told,
        vec![ToControl::Panic {
            module: M,
            began: true,
            idle: 0,
            nodes: 2
        }]
    );
}

#[test]
fn without_options_every_node_overloaded_is_overloaded() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    for i in 1..=2 {
        for _ in 0..15 {
            report(&mut s, node(i), 1, 1);
        }
    }
    assert_eq!(get_host(&mut s, M, 2), (RetCode::Overloaded, None));
    assert_eq!(s.metrics.panic_answers, 0);
}

#[test]
fn agent_wide_defaults_reach_held_modules_on_a_reload() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route(2), 0);
    for i in 1..=2 {
        for _ in 0..15 {
            report(&mut s, node(i), 1, 1);
        }
    }
    assert_eq!(get_host(&mut s, M, 2).0, RetCode::Overloaded);
    let params = LbParams {
        panic_percent: 50,
        ..LbParams::default()
    };
    s.apply(
        ToShard::Params(crate::messages::LiveParams {
            params,
            update_timeout_ms: 15_000,
            report_timeout_ms: 15_000,
            locality_min_percent: 0,
            label_fallback: Default::default(),
        }),
        3,
    );
    assert_eq!(get_host(&mut s, M, 4).0, RetCode::Ok, "in panic now");
}

#[test]
fn a_p2c_module_learns_from_the_reported_time_cost() {
    let mut s = shard();
    get_host(&mut s, M, 0);
    s.apply(route_with(2, Policy::P2c, Default::default()), 0);
    let mut enc = Encoder::new();
    for (i, tcost_ms) in [(1u8, 50u32), (2, 2)] {
        let req = enc
            .report_req(&Report {
                seq: 1,
                module: M,
                host: node(i),
                retcode: 0,
                tcost_ms,
                downstream_level: None,
                consumed: 0,
            })
            .to_vec();
        assert!(s.handle(&req, PEER, 1).is_none());
    }
    // Two nodes: both are drawn; the fast one wins while 2·(k+1) < 50.
    for _ in 0..10 {
        assert_eq!(get_host(&mut s, M, 1), (RetCode::Ok, Some(node(2))));
    }
}

/// Issue 29: a getHost answered over UDP is the Ok template patched
/// (`wire::OkAnswer`), a zero sequence number the encoder's full answer:
/// either way byte for byte what the encoder makes, round after round.
#[test]
fn an_answered_get_host_is_byte_for_byte_the_encoders_answer() {
    let mut s = shard();
    s.apply(route(3), 0);
    let mut enc = Encoder::new();
    for seq in [1, 0, 7, u32::MAX, 0, 2] {
        let req = enc.get_host_req(seq, M, 0, 0).to_vec();
        let got = s.handle(&req, PEER, 1).expect("an answer").to_vec();
        let Ok(Message::GetHostResp(r)) = decode(&got, &Limits::UDP) else {
            panic!("not a getHost answer")
        };
        let host = r.host().map(NodeAddr::from);
        assert!(host.is_some(), "answered with a node");
        let want = enc.get_host_resp(seq, M, RetCode::Ok, host, None);
        assert_eq!(got, want, "seq {seq}");
    }
}
