//! Property tests: fairness of round robin, no starvation, probing order,
//! the list invariants, and reports against a reference model of the
//! original's rules, over arbitrary histories.

use super::*;
use lbagent_model::{NodeAddr, RouteNode};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
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

/// Rates that put the threshold formula at its edges: the defaults, the
/// issue 28 cases' (0.3, 0.35, 0.4, 0.5, 0.9), and 1 (no rate test).
fn rate() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => Just(0.95),
        4 => Just(0.1),
        4 => proptest::sample::select(vec![0.3, 0.35, 0.4, 0.5, 0.9]),
        1 => Just(1.0),
    ]
}

fn params() -> impl Strategy<Value = LbParams> {
    (
        (2u32..12, 1u32..20, 1u32..20, 0u32..300, 1u32..12, 1u32..4),
        (rate(), rate()),
    )
        .prop_map(
            |(
                (
                    probe_num,
                    contin_succ_lim,
                    contin_err_lim,
                    init_succ_cnt,
                    ovld_err_cnt,
                    wind_err_limit,
                ),
                (succ_rate, err_rate),
            )| LbParams {
                probe_num,
                contin_succ_lim,
                contin_err_lim,
                init_succ_cnt,
                ovld_err_cnt,
                wind_err_limit,
                succ_rate,
                err_rate,
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
    // Failure seeds live beside this file (src/lb/props.proptest-regressions),
    // not in a top-level folder: the top level is fixed by the design card.
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

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
        // picks, plus at most one probe per probe_num of them.
        let budget = idle.len() + if overloaded { idle.len() / p.probe_num as usize + 1 } else { 0 };
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
        for _ in 0..(2 * overloaded.len() + 1) * (p.probe_num as usize + 1) {
            if let Pick::Probe(a) = m.get_host(&p) { probes.push(a); }
        }
        prop_assert!(probes.len() >= 2 * overloaded.len());
        for (i, a) in probes.iter().enumerate() {
            prop_assert_eq!(*a, overloaded[i % overloaded.len()]);
        }
    }

    #[test]
    fn a_batch_follows_the_original_batch_rule(
        p in params(),
        ops in proptest::collection::vec(op(), 0..200),
        node in 0u8..8,
        count in 1u32..400,
        later in prop_oneof![Just(0u64), 0u64..400_000],
    ) {
        let (mut m, now) = run(&ops, &p);
        let now = now + later;
        let before = m.clone();
        let mut got = Vec::new();
        let r = m.report_successes(addr(node), count, now, &p, |t| got.push(t));
        // Every batch is a multi-count report, a batch of 1 included.
        check_against_reference(&before, &m, r.is_ok(), node, true, count, true, now, &p, &got)?;
    }

    #[test]
    fn a_failure_follows_the_original_rule_and_errcnt_1_is_a_plain_failure(
        p in params(),
        ops in proptest::collection::vec(op(), 0..200),
        node in 0u8..8,
        tcost_ms in prop_oneof![0u32..200, 0u32..10_000],
        later in prop_oneof![Just(0u64), 0u64..400_000],
    ) {
        let (mut m, now) = run(&ops, &p);
        let now = now + later;
        let before = m.clone();
        let o = Outcome::Failure { tcost_ms };
        let t = m.report(addr(node), o, now, &p);
        let got: Vec<Transition> = t.ok().flatten().into_iter().collect();
        let errcnt = (tcost_ms / 100).clamp(1, 50);
        // errcnt > 1 is a multi-count report; errcnt 1 a single one.
        check_against_reference(&before, &m, t.is_ok(), node, false, errcnt, errcnt > 1, now, &p, &got)?;
        if errcnt == 1 {
            let mut plain = before.clone();
            let t0 = plain.report(addr(node), Outcome::Failure { tcost_ms: 0 }, now, &p);
            prop_assert_eq!(t0, t);
            prop_assert_eq!(plain, m);
        }
    }

    #[test]
    fn a_multi_count_report_at_its_threshold_and_one_below_follows_the_rule(
        p in params(),
        ops in proptest::collection::vec(op(), 0..200),
        node in 0u8..6,
        below in any::<bool>(),
    ) {
        // Random histories seldom land on `part + n == need` exactly: pick
        // the count that lands there (or one short), for a batch on an
        // overloaded node or a slow failure on an idle one.
        let (m, now) = run(&ops, &p);
        let Some(x) = m.nodes().iter().find(|x| x.addr() == addr(node)) else {
            return Ok(());
        };
        let success = x.state() == NodeState::Overloaded;
        let (part, other, rate) = if success {
            (x.vsucc(), x.verr(), p.succ_rate)
        } else {
            (x.verr(), x.vsucc(), p.err_rate)
        };
        let Some(need) = threshold(other, rate) else { return Ok(()) };
        let n = need.saturating_sub(u64::from(part)).saturating_sub(u64::from(below));
        let max = if success { 400 } else { u64::from(MAX_ERRORS_PER_FAILURE) };
        prop_assume!(n >= if success { 1 } else { 2 } && n <= max);
        let n = n as u32;
        let before = m.clone();
        let mut after = m;
        let mut got = Vec::new();
        if success {
            after.report_successes(addr(node), n, now, &p, |t| got.push(t)).unwrap();
        } else {
            let t = after.report(addr(node), Outcome::Failure { tcost_ms: n * 100 }, now, &p).unwrap();
            got.extend(t);
        }
        check_against_reference(&before, &after, true, node, success, n, true, now, &p, &got)?;
    }
}

/// A node's observable state, as the reference model computes it.
#[derive(Clone, Debug, PartialEq)]
struct Snap {
    state: NodeState,
    vsucc: u32,
    verr: u32,
    rsucc: u32,
    rerr: u32,
    contin_succ: u32,
    contin_err: u32,
    bad_windows: u32,
    window_start: Millis,
    overload_start: Millis,
    stats: (u32, u32),
}

fn snap(n: &Node) -> Snap {
    Snap {
        state: n.state(),
        vsucc: n.vsucc(),
        verr: n.verr(),
        rsucc: n.rsucc(),
        rerr: n.rerr(),
        contin_succ: n.contin_succ(),
        contin_err: n.contin_err(),
        bad_windows: n.bad_windows(),
        window_start: n.window_start(),
        overload_start: n.overload_start(),
        stats: n.pending_stats(),
    }
}

/// What a [`Node`] can show of the model's state: one timestamp per state
/// (the window start while idle, the overload start while overloaded),
/// the other reads 0.
fn visible(mut s: Snap) -> Snap {
    match s.state {
        NodeState::Idle => s.overload_start = 0,
        NodeState::Overloaded => s.window_start = 0,
    }
    s
}

/// The original's threshold: trunc(rate * other / (1 - rate)) in f64, +1
/// when need / (need + other) < rate (a wrapping u32 sum; 0 / 0 is NaN,
/// not <); no rate test at all when rate >= 1.
fn threshold(other: u32, rate: f64) -> Option<u64> {
    if rate >= 1.0 {
        return None;
    }
    let mut need = (rate * other as f64 / (1.0 - rate)) as u32;
    let sum = need.wrapping_add(other);
    if (need as f64) / (sum as f64) < rate {
        need = need.saturating_add(1);
    }
    Some(u64::from(need))
}

/// The original's report of `n` counts of one outcome, written out step by
/// step from its rules: add all `n`; then, where the outcome goes against
/// the node's state:
///
/// - a single report (`multi` false, `n` = 1: one success, or a failure
///   of errcnt 1): the rate on the counted virtual counts, strictly above
///   the limit, tested before the consecutive run; no carry;
/// - a multi-count report (`multi`: a batch of `n` successes, `n` = 1
///   included, or a failure of errcnt `n` > 1): the consecutive run first,
///   carry `run − limit`; only when it is below its limit, the rate: `need`
///   from the original's formula, reached by the virtual count before the
///   report plus `n`, carry `min(part + n − need, n)`.
///
/// Reset to the new state and add the carry to its virtual count of this
/// outcome; otherwise one window / overload-timeout check. Returns the
/// reason of the change, if any.
fn reference(
    s: &mut Snap,
    success: bool,
    n: u32,
    multi: bool,
    now: Millis,
    p: &LbParams,
) -> Option<Reason> {
    let exceeds = |part: u32, other: u32, rate: f64| {
        let total = u64::from(part) + u64::from(other);
        total != 0 && part as f64 / total as f64 > rate
    };
    let old = s.clone();
    if success {
        s.vsucc = s.vsucc.saturating_add(n);
        s.rsucc = s.rsucc.saturating_add(n);
        s.stats.0 = s.stats.0.saturating_add(n);
        s.contin_succ = s.contin_succ.saturating_add(n);
        s.contin_err = 0;
    } else {
        s.verr = s.verr.saturating_add(n);
        s.rerr = s.rerr.saturating_add(n);
        s.stats.1 = s.stats.1.saturating_add(1);
        s.contin_err = s.contin_err.saturating_add(n);
        s.contin_succ = 0;
    }
    // (the virtual count of this outcome before, the other one, the run
    // after the counts, its limit, the rate, the reasons by rate and by run)
    let against = match (old.state, success) {
        (NodeState::Idle, false) => Some((
            old.verr,
            old.vsucc,
            s.contin_err,
            p.contin_err_lim,
            p.err_rate,
            Reason::ErrRate,
            Reason::ContinErr,
        )),
        (NodeState::Overloaded, true) => Some((
            old.vsucc,
            old.verr,
            s.contin_succ,
            p.contin_succ_lim,
            p.succ_rate,
            Reason::SuccRate,
            Reason::ContinSucc,
        )),
        _ => None,
    };
    // (carry, reason)
    let mut change: Option<(u32, Reason)> = None;
    if let Some((part, other, run, lim, rate, by_rate, by_run)) = against {
        if !multi {
            assert_eq!(n, 1);
            if exceeds(part.saturating_add(1), other, rate) {
                change = Some((0, by_rate));
            } else if run >= lim {
                change = Some((0, by_run));
            }
        } else if run >= lim {
            change = Some((run - lim, by_run));
        } else if let Some(need) = threshold(other, rate) {
            let reached = u64::from(part) + u64::from(n);
            if reached >= need {
                let carry = (reached - need).min(u64::from(n));
                change = Some((carry as u32, by_rate));
            }
        }
    }
    let enter_idle = |s: &mut Snap| {
        s.state = NodeState::Idle;
        (
            s.vsucc,
            s.verr,
            s.rsucc,
            s.rerr,
            s.contin_succ,
            s.contin_err,
        ) = (p.init_succ_cnt, 0, 0, 0, 0, 0);
        s.window_start = now;
    };
    let enter_overload = |s: &mut Snap| {
        s.state = NodeState::Overloaded;
        (
            s.vsucc,
            s.verr,
            s.rsucc,
            s.rerr,
            s.contin_succ,
            s.contin_err,
        ) = (0, p.ovld_err_cnt, 0, 0, 0, 0);
        s.bad_windows = 0;
        s.overload_start = now;
    };
    if let Some((carry, r)) = change {
        if success {
            enter_idle(s);
            s.bad_windows = 0;
            s.vsucc = s.vsucc.saturating_add(carry);
        } else {
            enter_overload(s);
            s.verr = s.verr.saturating_add(carry);
        }
        return Some(r);
    }
    match s.state {
        NodeState::Idle if now.saturating_sub(s.window_start) >= p.clear_timeout_ms => {
            let total = u64::from(s.rsucc) + u64::from(s.rerr);
            let bad = total != 0 && s.rerr as f64 / total as f64 >= p.wind_err_rate;
            if bad {
                s.bad_windows += 1;
                if s.bad_windows >= p.wind_err_limit {
                    enter_overload(s);
                    return Some(Reason::Window);
                }
            } else {
                s.bad_windows = 0;
            }
            enter_idle(s);
            None
        }
        NodeState::Overloaded if now.saturating_sub(s.overload_start) >= p.overload_wait_ms => {
            enter_idle(s);
            s.bad_windows = 0;
            Some(Reason::OverloadTimeout)
        }
        _ => None,
    }
}

/// Checks one report of `n` counts to `node` against [`reference`]: the
/// node's state, the transition reported, where the node sits in the
/// lists, and that no other node changed.
#[allow(clippy::too_many_arguments)]
fn check_against_reference(
    before: &ModuleLb,
    after: &ModuleLb,
    ok: bool,
    node: u8,
    success: bool,
    n: u32,
    multi: bool,
    now: Millis,
    p: &LbParams,
    got: &[Transition],
) -> Result<(), TestCaseError> {
    let a = addr(node);
    let Some(old) = before.nodes().iter().find(|x| x.addr() == a) else {
        prop_assert!(!ok);
        prop_assert_eq!(after, before);
        return Ok(());
    };
    prop_assert!(ok);
    let mut want = snap(old);
    let reason = reference(&mut want, success, n, multi, now, p);
    let new = after.nodes().iter().find(|x| x.addr() == a).unwrap();
    prop_assert_eq!(snap(new), visible(want.clone()));
    let want_t: Vec<(NodeState, Reason)> = reason.map(|r| (want.state, r)).into_iter().collect();
    let got_t: Vec<(NodeState, Reason)> = got.iter().map(|t| (t.to, t.reason)).collect();
    prop_assert_eq!(got_t, want_t);
    prop_assert!(after.check_invariants().is_ok());
    for (x, y) in before.nodes().iter().zip(after.nodes()) {
        if x.addr() != a {
            prop_assert_eq!(x, y);
        }
    }
    // A node that changed state joins the tail of its new list; otherwise
    // the lists are as they were.
    let drop_a =
        |l: Vec<NodeAddr>| -> Vec<NodeAddr> { l.into_iter().filter(|&x| x != a).collect() };
    if reason.is_some() {
        let (list, other): (Vec<NodeAddr>, Vec<NodeAddr>) = match want.state {
            NodeState::Idle => (after.idle_list().collect(), after.overload_list().collect()),
            NodeState::Overloaded => (after.overload_list().collect(), after.idle_list().collect()),
        };
        prop_assert_eq!(list.last().copied(), Some(a));
        prop_assert!(!other.contains(&a));
    } else {
        prop_assert_eq!(
            after.idle_list().collect::<Vec<_>>(),
            before.idle_list().collect::<Vec<_>>()
        );
        prop_assert_eq!(
            after.overload_list().collect::<Vec<_>>(),
            before.overload_list().collect::<Vec<_>>()
        );
    }
    prop_assert_eq!(
        drop_a(after.idle_list().chain(after.overload_list()).collect()).len(),
        drop_a(before.idle_list().chain(before.overload_list()).collect()).len()
    );
    Ok(())
}
