//! Property tests: fairness of round robin, no starvation, probing order,
//! batch ≡ singles, and the list invariants, over arbitrary histories.

use super::*;
use crate::model::{NodeAddr, RouteNode};
use proptest::prelude::*;
use std::net::Ipv4Addr;

fn addr(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 1, i), 7000 + u16::from(i))
}

fn route_of(ids: &[u8]) -> Vec<RouteNode> {
    ids.iter()
        .map(|&i| RouteNode {
            addr: addr(i),
            weight: u32::from(i),
        })
        .collect()
}

/// One step of an arbitrary history.
#[derive(Clone, Debug)]
enum Op {
    GetHost,
    Report { node: u8, ok: bool, tcost_ms: u32 },
    Batch { node: u8, count: u32 },
    Advance(u64),
    Update(Vec<u8>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::GetHost),
        6 => (0u8..12, any::<bool>(), prop_oneof![Just(0u32), 0u32..3_000]).prop_map(|(node, ok, tcost_ms)| Op::Report { node, ok, tcost_ms }),
        1 => (0u8..12, 0u32..300).prop_map(|(node, count)| Op::Batch { node, count }),
        2 => prop_oneof![0u64..2_000, 10_000u64..200_000].prop_map(Op::Advance),
        1 => proptest::collection::vec(0u8..12, 0..10).prop_map(Op::Update),
    ]
}

fn params() -> impl Strategy<Value = LbParams> {
    (2u32..12, 1u32..20, 1u32..20, 0u32..300, 1u32..12, 1u32..4).prop_map(
        |(
            probe_num,
            contin_succ_lim,
            contin_err_lim,
            init_succ_cnt,
            ovld_err_cnt,
            wind_err_limit,
        )| LbParams {
            probe_num,
            contin_succ_lim,
            contin_err_lim,
            init_succ_cnt,
            ovld_err_cnt,
            wind_err_limit,
            ..LbParams::default()
        },
    )
}

/// Runs a history; returns the module and the clock at its end.
fn run(ops: &[Op], p: &LbParams) -> (ModuleLb, Millis) {
    let mut now: Millis = 5_000;
    let mut m = ModuleLb::new(&route_of(&[0, 1, 2, 3, 4, 5]), 1, now, p);
    for (v, op) in ops.iter().enumerate() {
        match op {
            Op::GetHost => {
                m.get_host(p);
            }
            Op::Report { node, ok, tcost_ms } => {
                let o = if *ok {
                    Outcome::Success
                } else {
                    Outcome::Failure {
                        tcost_ms: *tcost_ms,
                    }
                };
                let _ = m.report(addr(*node), o, now, p);
            }
            Op::Batch { node, count } => {
                let _ = m.report_successes(addr(*node), *count, now, p, |_| {});
            }
            Op::Advance(ms) => now += ms,
            Op::Update(ids) => m.update_route(&route_of(ids), v as u64 + 2, now, p),
        }
    }
    (m, now)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_node_is_in_exactly_the_list_its_state_names(p in params(), ops in proptest::collection::vec(op(), 0..300)) {
        let mut now: Millis = 5_000;
        let mut m = ModuleLb::new(&route_of(&[0, 1, 2, 3, 4, 5]), 1, now, &p);
        let mut route: Vec<u8> = vec![0, 1, 2, 3, 4, 5];
        for op in &ops {
            match op {
                Op::GetHost => { m.get_host(&p); }
                Op::Report { node, ok, tcost_ms } => {
                    let o = if *ok { Outcome::Success } else { Outcome::Failure { tcost_ms: *tcost_ms } };
                    let r = m.report(addr(*node), o, now, &p);
                    prop_assert_eq!(r.is_ok(), route.contains(node));
                }
                Op::Batch { node, count } => {
                    let r = m.report_successes(addr(*node), *count, now, &p, |_| {});
                    prop_assert_eq!(r.is_ok(), route.contains(node));
                }
                Op::Advance(ms) => now += ms,
                Op::Update(ids) => {
                    m.update_route(&route_of(ids), 9, now, &p);
                    route = ids.clone();
                }
            }
            prop_assert!(m.check_invariants().is_ok(), "{:?}", m.check_invariants());
            let mut listed: Vec<NodeAddr> = m.idle_list().chain(m.overload_list()).collect();
            listed.sort();
            let mut want: Vec<NodeAddr> = route.iter().map(|&i| addr(i)).collect();
            want.sort();
            want.dedup();
            prop_assert_eq!(listed, want);
        }
    }

    #[test]
    fn round_robin_gives_every_idle_node_its_share_within_one(n in 1u8..20, calls in 0usize..500) {
        let p = LbParams::default();
        let ids: Vec<u8> = (0..n).collect();
        let mut m = ModuleLb::new(&route_of(&ids), 1, 0, &p);
        let mut counts = vec![0usize; n as usize];
        for _ in 0..calls {
            let a = m.get_host(&p).addr().unwrap();
            counts[ids.iter().position(|&i| addr(i) == a).unwrap()] += 1;
        }
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        prop_assert!(hi - lo <= 1, "{:?}", counts);
    }

    #[test]
    fn no_idle_node_is_starved(p in params(), ops in proptest::collection::vec(op(), 0..200)) {
        let (mut m, _) = run(&ops, &p);
        let idle: Vec<NodeAddr> = m.idle_list().collect();
        let overloaded = m.any_overloaded();
        // Without reports, a full turn of the idle list takes idle.len() idle
        // picks, plus at most one probe per probe_num - 1 of them.
        let budget = idle.len() + if overloaded { idle.len() / (p.probe_num as usize - 1) + 1 } else { 0 };
        let mut seen = std::collections::HashSet::new();
        for _ in 0..budget {
            if let Pick::Idle(a) = m.get_host(&p) { seen.insert(a); }
        }
        for a in idle {
            prop_assert!(seen.contains(&a), "{} not chosen in {} getHosts", a, budget);
        }
    }

    #[test]
    fn probes_visit_each_overloaded_node_in_turn(p in params(), ops in proptest::collection::vec(op(), 0..200)) {
        let (mut m, _) = run(&ops, &p);
        let overloaded: Vec<NodeAddr> = m.overload_list().collect();
        let mut probes = Vec::new();
        for _ in 0..(2 * overloaded.len() + 1) * p.probe_num as usize {
            if let Pick::Probe(a) = m.get_host(&p) { probes.push(a); }
        }
        prop_assert!(probes.len() >= 2 * overloaded.len());
        for (i, a) in probes.iter().enumerate() {
            prop_assert_eq!(*a, overloaded[i % overloaded.len()]);
        }
    }

    #[test]
    fn a_batch_report_equals_repeated_single_reports(
        p in params(),
        ops in proptest::collection::vec(op(), 0..200),
        node in 0u8..8,
        count in 0u32..400,
        later in prop_oneof![Just(0u64), 0u64..400_000],
    ) {
        let (mut singles, now) = run(&ops, &p);
        let mut batch = singles.clone();
        let now = now + later;
        let mut want = Vec::new();
        let mut single_err = None;
        for _ in 0..count {
            match singles.report(addr(node), Outcome::Success, now, &p) {
                Ok(t) => want.extend(t),
                Err(e) => single_err = Some(e),
            }
        }
        let mut got = Vec::new();
        let r = batch.report_successes(addr(node), count, now, &p, |t| got.push(t));
        if count > 0 {
            prop_assert_eq!(r.err(), single_err);
        }
        prop_assert_eq!(got, want);
        prop_assert_eq!(batch, singles);
    }
}
