//! The options beyond the original (issue 31) through [`ModuleLb`]:
//! weights, slow start, the ejection limit, panic and `p2c`, each on its
//! own, and the original's path untouched while they are off.

use super::*;
use lbagent_model::{ModuleOptions, NodeAddr, Policy, RouteNode};
use proptest::prelude::*;
use std::net::Ipv4Addr;

fn addr(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 9000)
}

fn weighted(ws: &[u32]) -> Vec<RouteNode> {
    ws.iter()
        .enumerate()
        .map(|(i, &weight)| RouteNode {
            addr: addr(i as u8 + 1),
            weight,
        })
        .collect()
}

const T0: Millis = 1_000_000;
const FAIL: Outcome = Outcome::Failure { tcost_ms: 0 };

fn pick(m: &mut ModuleLb, p: &LbParams, now: Millis) -> Pick {
    let got = m.get_host_for(p, 0, 0, now);
    m.check_invariants().unwrap();
    got
}

fn counts(m: &mut ModuleLb, p: &LbParams, now: Millis, calls: usize) -> Vec<usize> {
    let mut c = vec![0; m.nodes().len()];
    for _ in 0..calls {
        let a = pick(m, p, now).addr().unwrap();
        c[m.nodes().iter().position(|n| n.addr() == a).unwrap()] += 1;
    }
    c
}

fn overload(m: &mut ModuleLb, p: &LbParams, a: NodeAddr, now: Millis) -> bool {
    for _ in 0..p.contin_err_lim {
        if m.report(a, FAIL, now, p).unwrap().is_some() {
            return true;
        }
    }
    false
}

// === weights ===

#[test]
fn equal_weights_keep_the_original_path_and_order() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[7, 7, 7]), 1, T0, &p);
    assert!(!m.is_tuned(), "equal weights need no extra state");
    let mut original = m.clone();
    for _ in 0..9 {
        assert_eq!(pick(&mut m, &p, T0), original.get_host(&p));
    }
}

#[test]
fn a_route_update_tunes_the_module_exactly_when_its_nodes_weights_differ() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[3, 3, 3]), 1, T0, &p);
    assert!(!m.is_tuned());
    // Weights 0 and 1 are the same weight.
    m.update_route(&weighted(&[0, 1, 1]), 2, T0, &p);
    assert!(!m.is_tuned(), "0 counts as 1");
    m.update_route(&weighted(&[1, 1, 2]), 3, T0, &p);
    assert!(m.is_tuned(), "the last entry's weight differs");
    m.update_route(&weighted(&[5, 5, 5]), 4, T0, &p);
    assert!(!m.is_tuned(), "equal again: the extra state goes");
    // A duplicate entry's weight is ignored with the entry: the nodes'
    // weights are equal, so the module stays untuned.
    let mut dup = weighted(&[4, 4]);
    dup.push(RouteNode {
        addr: addr(1),
        weight: 9,
    });
    m.update_route(&dup, 5, T0, &p);
    assert_eq!(m.nodes().len(), 2);
    assert!(!m.is_tuned(), "only a duplicate's weight differs");
    assert!(tuning::route_weights_differ(&dup));
    assert!(!tuning::route_weights_differ(&[]));
}

#[test]
fn l5_follows_route_weights_smoothly() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[5, 1, 1]), 1, T0, &p);
    assert!(m.is_tuned());
    let picks: Vec<NodeAddr> = (0..7)
        .map(|_| pick(&mut m, &p, T0).addr().unwrap())
        .collect();
    let want: Vec<NodeAddr> = [1, 1, 2, 1, 3, 1, 1].iter().map(|&i| addr(i)).collect();
    assert_eq!(picks, want, "nginx's smooth order for 5, 1, 1");
    assert_eq!(counts(&mut m, &p, T0, 70), vec![50, 10, 10]);
}

#[test]
fn an_overloaded_weighted_node_is_left_out_and_probed() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[3, 1, 1]), 1, T0, &p);
    assert!(overload(&mut m, &p, addr(1), T0));
    let picks: Vec<Pick> = (0..11).map(|_| pick(&mut m, &p, T0)).collect();
    assert!(picks[..10]
        .iter()
        .all(|&x| matches!(x, Pick::Idle(a) if a != addr(1))));
    assert_eq!(
        picks[10],
        Pick::Probe(addr(1)),
        "the probe rule is unchanged"
    );
}

// === slow start ===

#[test]
fn a_new_node_ramps_up_over_the_slow_start_window() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[1, 1]), 1, T0, &p);
    let opts = ModuleOptions {
        slow_start_ms: Some(10_000),
        ..ModuleOptions::default()
    };
    m.set_options(opts, T0, &p);
    // A third node joins at T0: its share starts at the 10% floor.
    m.update_route(&weighted(&[1, 1, 1]), 2, T0, &p);
    let early = counts(&mut m, &p, T0, 2_100);
    assert_eq!(
        early[2], 100,
        "weights 1 : 1 : 0.1 over 2,100 picks: {early:?}"
    );
    // Half-way, half its weight: 1 : 1 : 0.5.
    let half = counts(&mut m, &p, T0 + 5_000, 2_500);
    assert_eq!(half[2], 500, "{half:?}");
    // After the window, a full share.
    let full = counts(&mut m, &p, T0 + 10_000, 3_000);
    assert_eq!(full, vec![1_000, 1_000, 1_000]);
}

#[test]
fn a_recovered_node_ramps_up_again() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[1, 1]), 1, T0, &p);
    m.set_options(
        ModuleOptions {
            slow_start_ms: Some(10_000),
            ..ModuleOptions::default()
        },
        T0,
        &p,
    );
    assert!(overload(&mut m, &p, addr(2), T0));
    for _ in 0..p.contin_succ_lim {
        m.report(addr(2), Outcome::Success, T0 + 1, &p).unwrap();
    }
    assert_eq!(m.overloaded_count(), 0);
    let c = counts(&mut m, &p, T0 + 1, 1_100);
    assert_eq!(c, vec![1_000, 100], "back at the 10% floor");
}

// === ejection limit ===

#[test]
fn the_ejection_limit_keeps_the_node_idle_with_its_counts() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[1, 1, 1, 1]), 1, T0, &p);
    m.set_options(
        ModuleOptions {
            max_overloaded_percent: Some(50),
            ..ModuleOptions::default()
        },
        T0,
        &p,
    );
    assert!(overload(&mut m, &p, addr(1), T0));
    assert!(overload(&mut m, &p, addr(2), T0));
    assert!(
        !overload(&mut m, &p, addr(3), T0),
        "a third of four is past 50%"
    );
    let n3 = m.nodes()[2].clone();
    assert_eq!(n3.state(), NodeState::Idle);
    assert_eq!(n3.contin_err(), p.contin_err_lim, "its counts stay");
    assert_eq!(m.overloads_held_back(), 1);
    // Node 1 recovers: the next failure of node 3 marks it.
    for _ in 0..p.contin_succ_lim {
        m.report(addr(1), Outcome::Success, T0 + 1, &p).unwrap();
    }
    let t = m.report(addr(3), FAIL, T0 + 1, &p).unwrap().unwrap();
    assert_eq!(t.to, NodeState::Overloaded);
}

/// One step of a report history.
#[derive(Clone, Debug)]
enum Op {
    Report { node: u8, ok: bool, tcost_ms: u32 },
    Batch { node: u8, count: u32 },
    Advance(u64),
    GetHost,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (1u8..9, any::<bool>(), prop_oneof![Just(0u32), 0u32..3_000])
            .prop_map(|(node, ok, tcost_ms)| Op::Report { node, ok, tcost_ms }),
        1 => (1u8..9, 0u32..300).prop_map(|(node, count)| Op::Batch { node, count }),
        2 => prop_oneof![0u64..2_000, 10_000u64..200_000].prop_map(Op::Advance),
        2 => Just(Op::GetHost),
    ]
}

proptest! {
    /// Whatever the reports, the overloaded nodes never exceed
    /// `max_overloaded_percent` of the module's.
    #[test]
    fn the_ejection_limit_is_never_exceeded(
        n in 1usize..9,
        max in 1u8..=100,
        ops in proptest::collection::vec(op(), 0..400),
    ) {
        let p = LbParams { max_overloaded_percent: max, ..LbParams::default() };
        let mut now = T0;
        let mut m = ModuleLb::new(&weighted(&vec![1; n]), 1, now, &p);
        let limit = n * usize::from(max) / 100;
        for op in &ops {
            match *op {
                Op::Report { node, ok, tcost_ms } => {
                    let _ = m.report(addr(node), Outcome::from_retcode(i32::from(!ok), tcost_ms), now, &p);
                }
                Op::Batch { node, count } => {
                    let _ = m.report_successes(addr(node), count, now, &p, |_| {});
                }
                Op::Advance(ms) => now += ms,
                Op::GetHost => { m.get_host_for(&p, 0, 0, now); }
            }
            prop_assert!(m.overloaded_count() <= limit, "{} of {} overloaded, limit {}%", m.overloaded_count(), n, max);
            prop_assert!(m.check_invariants().is_ok());
        }
    }

    /// With every option off, a module answers exactly as the original's
    /// getHost, whatever the history (equal weights).
    #[test]
    fn options_off_is_the_original(ops in proptest::collection::vec(op(), 0..300)) {
        let p = LbParams::default();
        let mut now = T0;
        let mut m = ModuleLb::new(&weighted(&[1; 6]), 1, now, &p);
        let mut original = m.clone();
        for op in &ops {
            match *op {
                Op::Report { node, ok, tcost_ms } => {
                    let o = Outcome::from_retcode(i32::from(!ok), tcost_ms);
                    let _ = m.report_call(ANY_CLIENT, addr(node), o, Some(tcost_ms), now, &p);
                    let _ = original.report(addr(node), o, now, &p);
                }
                Op::Batch { node, count } => {
                    let _ = m.report_successes(addr(node), count, now, &p, |_| {});
                    let _ = original.report_successes(addr(node), count, now, &p, |_| {});
                }
                Op::Advance(ms) => now += ms,
                Op::GetHost => prop_assert_eq!(m.get_host_for(&p, 0, 0, now), original.get_host(&p)),
            }
            prop_assert_eq!(&m, &original);
        }
    }
}

// === panic ===

#[test]
fn panic_answers_every_node_in_turn_and_ends_when_nodes_recover() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[1, 1, 1, 1]), 1, T0, &p);
    m.set_options(
        ModuleOptions {
            panic_percent: Some(50),
            ..ModuleOptions::default()
        },
        T0,
        &p,
    );
    assert!(overload(&mut m, &p, addr(1), T0));
    assert!(overload(&mut m, &p, addr(2), T0));
    // Half idle is not below half: no panic yet.
    assert!(matches!(pick(&mut m, &p, T0), Pick::Idle(_)));
    assert_eq!(m.take_panic_news(), None);
    assert!(overload(&mut m, &p, addr(3), T0));
    let picks: Vec<Pick> = (0..8).map(|_| pick(&mut m, &p, T0)).collect();
    let want: Vec<Pick> = [1, 2, 3, 4, 1, 2, 3, 4]
        .iter()
        .map(|&i| Pick::Panic(addr(i)))
        .collect();
    assert_eq!(picks, want, "round robin over every node");
    assert_eq!(m.take_panic_news(), Some(true), "told once");
    assert_eq!(m.take_panic_news(), None);
    assert_eq!(m.panic_answers(), 8);
    assert!(m.in_panic());
    // Node 3 recovers: half idle again, the episode ends.
    for _ in 0..p.contin_succ_lim {
        m.report(addr(3), Outcome::Success, T0 + 1, &p).unwrap();
    }
    assert!(matches!(pick(&mut m, &p, T0 + 1), Pick::Idle(_)));
    assert_eq!(m.take_panic_news(), Some(false));
    assert!(!m.in_panic());
}

#[test]
fn without_panic_every_node_overloaded_answers_overloaded() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&[1, 2]), 1, T0, &p);
    assert!(overload(&mut m, &p, addr(1), T0));
    assert!(overload(&mut m, &p, addr(2), T0));
    assert_eq!(pick(&mut m, &p, T0), Pick::Overloaded);
}

// === p2c ===

fn p2c_module(n: usize) -> (ModuleLb, LbParams) {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&weighted(&vec![1; n]), 1, T0, &p);
    m.set_policy(Policy::P2c);
    (m, p)
}

#[test]
fn p2c_is_a_policy_and_prefers_the_faster_of_two() {
    let (mut m, p) = p2c_module(2);
    assert_eq!(m.policy(), Policy::P2c);
    // Teach it: node 1 answers in 10 ms, node 2 in 2 ms.
    let ok = Outcome::Success;
    m.report_call(ANY_CLIENT, addr(1), ok, Some(10), T0, &p)
        .unwrap();
    m.report_call(ANY_CLIENT, addr(2), ok, Some(2), T0, &p)
        .unwrap();
    // With two nodes both are drawn: the faster is taken while its
    // outstanding calls keep its load below the slower's (2·(k+1) < 10).
    let picks: Vec<Pick> = (0..4).map(|_| pick(&mut m, &p, T0)).collect();
    assert_eq!(&picks[..], &[Pick::Idle(addr(2)); 4]);
    assert_eq!(m.p2c_cost(addr(2), T0), Some((2.0, 4)));
    // 2·5 is not below 10: the next is the slower node, or the faster on
    // the tie, whichever was drawn first.
    assert!(matches!(pick(&mut m, &p, T0), Pick::Idle(_)));
}

#[test]
fn p2c_shuns_a_node_that_fails_fast() {
    let (mut m, p) = p2c_module(3);
    for i in 1..=3 {
        let o = if i == 3 { FAIL } else { Outcome::Success };
        m.report_call(ANY_CLIENT, addr(i), o, Some(1), T0, &p)
            .unwrap();
    }
    let mut c = [0usize; 3];
    for k in 0..300 {
        let a = pick(&mut m, &p, T0 + k).addr().unwrap();
        let i = m.nodes().iter().position(|n| n.addr() == a).unwrap();
        c[i] += 1;
        m.report_call(ANY_CLIENT, a, Outcome::Success, Some(1), T0 + k, &p)
            .unwrap();
    }
    assert!(c[2] < 10, "the failing node got {c:?}");
}

#[test]
fn p2c_keeps_l5s_overload_marking_and_probes() {
    let (mut m, p) = p2c_module(3);
    assert!(overload(&mut m, &p, addr(1), T0));
    let picks: Vec<Pick> = (0..11).map(|_| pick(&mut m, &p, T0)).collect();
    assert!(picks[..10]
        .iter()
        .all(|&x| matches!(x, Pick::Idle(a) if a != addr(1))));
    assert_eq!(picks[10], Pick::Probe(addr(1)));
    m.set_policy(Policy::L5);
    assert!(!m.is_tuned(), "back to the original's path");
}
