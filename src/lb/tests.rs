//! Each rule of the algorithm at its exact boundary: one step below, then
//! the crossing. Defaults are the original `lbagent.ini`.

use super::*;
use crate::model::{NodeAddr, RouteNode};
use std::net::Ipv4Addr;

fn addr(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 9000)
}

fn route(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: addr(i),
            weight: 1,
        })
        .collect()
}

const T0: Millis = 1_000_000;
const OK: Outcome = Outcome::Success;
const FAIL: Outcome = Outcome::Failure { tcost_ms: 0 };

fn fail_costing(tcost_ms: u32) -> Outcome {
    Outcome::Failure { tcost_ms }
}

fn module(n: u8) -> (ModuleLb, LbParams) {
    let p = LbParams::default();
    (ModuleLb::new(&route(n), 1, T0, &p), p)
}

fn node(m: &ModuleLb, a: NodeAddr) -> &Node {
    m.nodes().iter().find(|n| n.addr() == a).unwrap()
}

fn report(
    m: &mut ModuleLb,
    p: &LbParams,
    a: NodeAddr,
    o: Outcome,
    now: Millis,
) -> Option<Transition> {
    let t = m.report(a, o, now, p).unwrap();
    m.check_invariants().unwrap();
    t
}

fn overload(m: &mut ModuleLb, p: &LbParams, a: NodeAddr, now: Millis) {
    let t = report(m, p, a, fail_costing(100_000), now).unwrap();
    assert_eq!(t.to, NodeState::Overloaded);
}

// === getHost ===

#[test]
fn get_host_round_robins_over_the_idle_list() {
    let (mut m, p) = module(3);
    let picks: Vec<_> = (0..6).map(|_| m.get_host(&p)).collect();
    let want: Vec<_> = [1, 2, 3, 1, 2, 3]
        .iter()
        .map(|&i| Pick::Idle(addr(i)))
        .collect();
    assert_eq!(picks, want);
}

#[test]
fn every_probe_num_th_get_host_probes_the_overload_list() {
    let (mut m, p) = module(4);
    overload(&mut m, &p, addr(1), T0);
    overload(&mut m, &p, addr(2), T0);
    let picks: Vec<_> = (0..2 * p.probe_num).map(|_| m.get_host(&p)).collect();
    for (i, pick) in picks.iter().enumerate() {
        let nth = i as u32 + 1;
        if nth % p.probe_num == 0 {
            let want = if nth == p.probe_num { addr(1) } else { addr(2) };
            assert_eq!(*pick, Pick::Probe(want), "getHost #{nth}");
        } else {
            assert!(
                matches!(pick, Pick::Idle(a) if *a == addr(3) || *a == addr(4)),
                "getHost #{nth}: {pick:?}"
            );
        }
    }
}

#[test]
fn with_every_node_overloaded_only_probes_get_a_host() {
    let (mut m, p) = module(2);
    overload(&mut m, &p, addr(1), T0);
    overload(&mut m, &p, addr(2), T0);
    for round in 0..3u8 {
        for _ in 1..p.probe_num {
            assert_eq!(m.get_host(&p), Pick::Overloaded);
        }
        assert_eq!(m.get_host(&p), Pick::Probe(addr(1 + round % 2)));
    }
}

#[test]
fn probe_count_restarts_when_no_node_is_overloaded() {
    let (mut m, p) = module(2);
    overload(&mut m, &p, addr(1), T0);
    for _ in 1..p.probe_num {
        assert_eq!(m.get_host(&p), Pick::Idle(addr(2)));
    }
    // Node 1 recovers before its probe was due; the count starts over.
    for _ in 0..p.contin_succ_lim {
        report(&mut m, &p, addr(1), OK, T0);
    }
    assert!(!m.any_overloaded());
    m.get_host(&p);
    overload(&mut m, &p, addr(1), T0);
    for _ in 1..p.probe_num {
        assert!(matches!(m.get_host(&p), Pick::Idle(_)));
    }
    assert_eq!(m.get_host(&p), Pick::Probe(addr(1)));
}

#[test]
fn an_empty_route_answers_no_such_module() {
    let (mut m, p) = module(0);
    assert!(m.is_empty());
    assert_eq!(m.get_host(&p), Pick::NoSuchModule);
}

// === report: counts ===

#[test]
fn a_failure_counts_max_1_tcost_over_100_virtual_errors_and_one_real_error() {
    for (tcost, verr) in [
        (0, 1),
        (99, 1),
        (100, 1),
        (199, 1),
        (200, 2),
        (250, 2),
        (1_000, 10),
    ] {
        let (mut m, p) = module(1);
        report(&mut m, &p, addr(1), fail_costing(tcost), T0);
        let n = node(&m, addr(1));
        assert_eq!(
            (n.verr(), n.rerr(), n.contin_err()),
            (verr, 1, 1),
            "tcost {tcost}"
        );
    }
}

#[test]
fn a_report_for_a_node_not_in_the_route_changes_nothing() {
    let (mut m, p) = module(2);
    let before = m.clone();
    let stranger = NodeAddr::new(Ipv4Addr::new(10, 9, 9, 9), 1);
    assert_eq!(m.report(stranger, FAIL, T0, &p), Err(UnknownNode(stranger)));
    assert_eq!(m, before);
}

// === report: idle -> overloaded ===

#[test]
fn idle_becomes_overloaded_when_error_rate_exceeds_err_rate() {
    // verr / (vsucc + verr) > 0.1 with vsucc = 180 + 9: at verr = 21 the rate is
    // exactly 0.1 (stays idle), at verr = 22 it exceeds it.
    let (mut m, p) = module(2);
    for _ in 0..9 {
        report(&mut m, &p, addr(1), OK, T0);
    }
    assert_eq!(report(&mut m, &p, addr(1), fail_costing(2_100), T0), None);
    let n = node(&m, addr(1));
    assert_eq!((n.vsucc(), n.verr(), n.state()), (189, 21, NodeState::Idle));
    let t = report(&mut m, &p, addr(1), FAIL, T0).unwrap();
    assert_eq!((t.to, t.reason), (NodeState::Overloaded, Reason::ErrRate));
}

#[test]
fn entering_overload_sets_vsucc_0_and_verr_ovld_err_cnt() {
    let (mut m, p) = module(2);
    report(&mut m, &p, addr(1), fail_costing(2_000), T0);
    let t = report(&mut m, &p, addr(1), FAIL, T0).unwrap();
    assert_eq!(t.reason, Reason::ErrRate);
    let n = node(&m, addr(1));
    assert_eq!(
        (n.vsucc(), n.verr(), n.rsucc(), n.rerr()),
        (0, p.ovld_err_cnt, 0, 0)
    );
    assert_eq!(
        (n.contin_succ(), n.contin_err(), n.overload_start()),
        (0, 0, T0)
    );
    assert_eq!(m.overload_list().collect::<Vec<_>>(), vec![addr(1)]);
    assert_eq!(m.idle_list().collect::<Vec<_>>(), vec![addr(2)]);
}

#[test]
fn idle_becomes_overloaded_when_consecutive_failures_reach_contin_err_lim() {
    let (mut m, p) = module(2);
    for _ in 1..p.contin_err_lim {
        assert_eq!(report(&mut m, &p, addr(1), FAIL, T0), None);
    }
    // 14 / 194 is well under err_rate: only the consecutive rule can fire.
    let t = report(&mut m, &p, addr(1), FAIL, T0).unwrap();
    assert_eq!((t.to, t.reason), (NodeState::Overloaded, Reason::ContinErr));
}

#[test]
fn a_success_breaks_a_run_of_failures() {
    let (mut m, p) = module(2);
    for _ in 1..p.contin_err_lim {
        report(&mut m, &p, addr(1), FAIL, T0);
    }
    report(&mut m, &p, addr(1), OK, T0);
    assert_eq!(report(&mut m, &p, addr(1), FAIL, T0), None);
    assert_eq!(node(&m, addr(1)).contin_err(), 1);
}

#[test]
fn successes_never_overload_an_idle_node_by_rate() {
    let (mut m, p) = module(1);
    report(&mut m, &p, addr(1), fail_costing(2_000), T0); // verr 20: rate exactly 0.1
    assert_eq!(report(&mut m, &p, addr(1), OK, T0), None);
}

// === report: overloaded -> idle ===

#[test]
fn overloaded_becomes_idle_when_success_rate_exceeds_succ_rate() {
    // vsucc / (vsucc + 5) > 0.95: 95 successes give exactly 0.95, 96 exceed it.
    let p = LbParams {
        contin_succ_lim: 1_000,
        ..LbParams::default()
    };
    let mut m = ModuleLb::new(&route(2), 1, T0, &p);
    overload(&mut m, &p, addr(1), T0);
    for _ in 0..95 {
        assert_eq!(report(&mut m, &p, addr(1), OK, T0), None);
    }
    let t = report(&mut m, &p, addr(1), OK, T0).unwrap();
    assert_eq!((t.to, t.reason), (NodeState::Idle, Reason::SuccRate));
}

#[test]
fn overloaded_becomes_idle_when_consecutive_successes_reach_contin_succ_lim() {
    let (mut m, p) = module(2);
    overload(&mut m, &p, addr(1), T0);
    for _ in 1..p.contin_succ_lim {
        assert_eq!(report(&mut m, &p, addr(1), OK, T0), None);
    }
    let t = report(&mut m, &p, addr(1), OK, T0).unwrap();
    assert_eq!((t.to, t.reason), (NodeState::Idle, Reason::ContinSucc));
    let n = node(&m, addr(1));
    assert_eq!(
        (n.vsucc(), n.verr(), n.window_start()),
        (p.init_succ_cnt, 0, T0)
    );
    assert_eq!(m.idle_list().last(), Some(addr(1)));
}

#[test]
fn failures_never_return_an_overloaded_node_to_idle_before_its_timeout() {
    let (mut m, p) = module(1);
    overload(&mut m, &p, addr(1), T0);
    for i in 0..100 {
        assert_eq!(report(&mut m, &p, addr(1), FAIL, T0 + i), None);
    }
}

// === windows ===

/// Reports `succ` successes and `err` failures, alternating so that no
/// consecutive limit fires, at `now`.
fn window(m: &mut ModuleLb, p: &LbParams, a: NodeAddr, succ: u32, err: u32, now: Millis) {
    for i in 0..succ.max(err) {
        if i < err {
            report(m, p, a, FAIL, now);
        }
        if i < succ {
            report(m, p, a, OK, now);
        }
    }
}

#[test]
fn a_window_ends_exactly_after_clear_timeout() {
    let (mut m, p) = module(1);
    window(&mut m, &p, addr(1), 10, 0, T0);
    report(&mut m, &p, addr(1), OK, T0 + p.clear_timeout_ms - 1);
    assert_eq!(node(&m, addr(1)).vsucc(), p.init_succ_cnt + 11);
    report(&mut m, &p, addr(1), OK, T0 + p.clear_timeout_ms);
    let n = node(&m, addr(1));
    assert_eq!(
        (n.vsucc(), n.rsucc(), n.window_start()),
        (p.init_succ_cnt, 0, T0 + p.clear_timeout_ms)
    );
}

#[test]
fn wind_err_limit_consecutive_bad_windows_overload_an_idle_node() {
    let (mut m, p) = module(2);
    let w = p.clear_timeout_ms;
    // Window 1: 3 successes, 6 failures, and the closing report a failure:
    // real error rate 7/10 = 0.7, at the threshold: bad.
    window(&mut m, &p, addr(1), 3, 6, T0);
    assert_eq!(report(&mut m, &p, addr(1), FAIL, T0 + w), None);
    assert_eq!(node(&m, addr(1)).bad_windows(), 1);
    assert_eq!(node(&m, addr(1)).vsucc(), p.init_succ_cnt);
    // Window 2: the same: the second consecutive bad window.
    window(&mut m, &p, addr(1), 3, 6, T0 + w);
    let t = report(&mut m, &p, addr(1), FAIL, T0 + 2 * w).unwrap();
    assert_eq!((t.to, t.reason), (NodeState::Overloaded, Reason::Window));
}

#[test]
fn a_window_just_below_wind_err_rate_is_not_bad() {
    let (mut m, p) = module(2);
    let w = p.clear_timeout_ms;
    for k in 1..=3 {
        // 7 failures of 11 calls: 0.636 < 0.7.
        window(&mut m, &p, addr(1), 3, 7, T0 + (k - 1) * w);
        assert_eq!(report(&mut m, &p, addr(1), OK, T0 + k * w), None);
        assert_eq!(node(&m, addr(1)).bad_windows(), 0);
    }
}

#[test]
fn a_good_window_breaks_the_run_of_bad_windows() {
    let (mut m, p) = module(2);
    let w = p.clear_timeout_ms;
    window(&mut m, &p, addr(1), 3, 6, T0);
    report(&mut m, &p, addr(1), FAIL, T0 + w); // bad
    window(&mut m, &p, addr(1), 9, 0, T0 + w);
    report(&mut m, &p, addr(1), OK, T0 + 2 * w); // good
    assert_eq!(node(&m, addr(1)).bad_windows(), 0);
    window(&mut m, &p, addr(1), 3, 6, T0 + 2 * w);
    assert_eq!(report(&mut m, &p, addr(1), FAIL, T0 + 3 * w), None); // bad, but only one
    assert_eq!(node(&m, addr(1)).state(), NodeState::Idle);
}

#[test]
fn an_overloaded_node_returns_to_idle_exactly_after_overload_wait_lim() {
    let (mut m, p) = module(2);
    overload(&mut m, &p, addr(1), T0);
    assert_eq!(
        report(&mut m, &p, addr(1), FAIL, T0 + p.overload_wait_ms - 1),
        None
    );
    let t = report(&mut m, &p, addr(1), FAIL, T0 + p.overload_wait_ms).unwrap();
    assert_eq!((t.to, t.reason), (NodeState::Idle, Reason::OverloadTimeout));
    assert_eq!(node(&m, addr(1)).vsucc(), p.init_succ_cnt);
}

// === batch report ===

#[test]
fn a_batch_of_successes_equals_single_successes() {
    let (mut singles, p) = module(2);
    overload(&mut singles, &p, addr(1), T0);
    let mut batch = singles.clone();
    let mut want = Vec::new();
    for _ in 0..40 {
        want.extend(singles.report(addr(1), OK, T0 + 5, &p).unwrap());
    }
    let mut got = Vec::new();
    batch
        .report_successes(addr(1), 40, T0 + 5, &p, |t| got.push(t))
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(batch, singles);
}

// === route updates ===

#[test]
fn a_route_update_keeps_nodes_that_stay_adds_new_ones_idle_and_drops_removed_ones() {
    let (mut m, p) = module(3);
    overload(&mut m, &p, addr(2), T0);
    report(&mut m, &p, addr(3), OK, T0);
    let kept2 = node(&m, addr(2)).clone();
    let kept3 = node(&m, addr(3)).clone();
    let new_route = [
        RouteNode {
            addr: addr(4),
            weight: 7,
        },
        RouteNode {
            addr: addr(3),
            weight: 1,
        },
        RouteNode {
            addr: addr(2),
            weight: 1,
        },
        RouteNode {
            addr: addr(4),
            weight: 9,
        }, // duplicate: ignored
    ];
    m.update_route(&new_route, 2, T0 + 10, &p);
    m.check_invariants().unwrap();
    assert_eq!(m.version(), 2);
    assert_eq!(m.nodes().len(), 3);
    assert_eq!(node(&m, addr(2)), &kept2);
    assert_eq!(node(&m, addr(3)), &kept3);
    assert_eq!(node(&m, addr(4)).weight(), 7);
    assert_eq!(node(&m, addr(4)).window_start(), T0 + 10);
    assert_eq!(m.idle_list().collect::<Vec<_>>(), vec![addr(3), addr(4)]);
    assert_eq!(m.overload_list().collect::<Vec<_>>(), vec![addr(2)]);
    assert_eq!(m.report(addr(1), OK, T0, &p), Err(UnknownNode(addr(1))));
}

#[test]
fn a_route_update_to_empty_makes_the_module_answer_no_such_module() {
    let (mut m, p) = module(3);
    overload(&mut m, &p, addr(1), T0);
    m.update_route(&[], 5, T0, &p);
    m.check_invariants().unwrap();
    assert!(m.is_empty());
    assert_eq!(m.get_host(&p), Pick::NoSuchModule);
}

// === statistics ===

#[test]
fn take_stats_returns_real_counts_since_last_taken() {
    let (mut m, p) = module(2);
    window(&mut m, &p, addr(1), 4, 2, T0);
    let mut out = Vec::new();
    m.take_stats(&mut out);
    assert_eq!(
        out[0],
        NodeCallStats {
            addr: addr(1),
            succ: 4,
            err: 2,
            overloaded: false
        }
    );
    assert_eq!(
        out[1],
        NodeCallStats {
            addr: addr(2),
            succ: 0,
            err: 0,
            overloaded: false
        }
    );
    out.clear();
    m.take_stats(&mut out);
    assert_eq!((out[0].succ, out[0].err), (0, 0));
}
