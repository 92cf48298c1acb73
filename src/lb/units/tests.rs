//! The balance policy in a module: units taken and returned, the time-out,
//! the overload rules, route changes. Through [`crate::ModuleLb`], as
//! the shard drives it.

use crate::{LbParams, Millis, ModuleLb, NodeState, Outcome, Pick};
use lbagent_model::{NodeAddr, Policy, RouteNode};
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

const T0: Millis = 1_000_000;

fn addr(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 9000)
}

/// A `balance` module of these weights, nodes 1, 2, ...
fn balance(weights: &[u32]) -> (ModuleLb, LbParams) {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&route(weights), 1, T0, &p);
    m.set_policy(Policy::Balance);
    (m, p)
}

fn route(weights: &[u32]) -> Vec<RouteNode> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &weight)| RouteNode {
            addr: addr(i as u8 + 1),
            weight,
        })
        .collect()
}

fn get(m: &mut ModuleLb, p: &LbParams, now: Millis) -> Pick {
    m.get_host_for(p, 0, 0, now)
}

/// getHosts until one answers without a node; the hosts given, counted.
fn drain(m: &mut ModuleLb, p: &LbParams, now: Millis) -> (BTreeMap<NodeAddr, u32>, Pick) {
    let mut given = BTreeMap::new();
    loop {
        match get(m, p, now) {
            Pick::Idle(a) => *given.entry(a).or_default() += 1,
            other => return (given, other),
        }
    }
}

fn in_use(m: &ModuleLb) -> Vec<u32> {
    let u = m.units().expect("a balance module");
    (0..m.nodes().len()).map(|i| u.in_use(i)).collect()
}

#[test]
fn an_l5_module_has_no_units_and_keeps_round_robin() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&route(&[2, 3]), 1, T0, &p);
    assert_eq!(m.policy(), Policy::L5);
    assert!(m.units().is_none());
    let picks: Vec<Pick> = (0..5).map(|_| get(&mut m, &p, T0)).collect();
    assert_eq!(
        picks,
        [2, 1, 2, 1, 2].map(|i| Pick::Idle(addr(i))),
        "smooth weighted round robin by the weights (issue 31), no units"
    );
}

#[test]
fn every_unit_is_handed_out_once_and_then_the_module_is_overloaded() {
    let (mut m, p) = balance(&[2, 3]);
    let (given, last) = drain(&mut m, &p, T0);
    assert_eq!(given, BTreeMap::from([(addr(1), 2), (addr(2), 3)]));
    assert_eq!(last, Pick::Overloaded);
    assert_eq!(in_use(&m), [2, 3]);
    assert_eq!(m.units().unwrap().held(), 5);
}

#[test]
fn a_report_returns_a_unit_of_its_node_for_the_next_get_host() {
    let (mut m, p) = balance(&[2, 3]);
    drain(&mut m, &p, T0);
    m.report(addr(1), Outcome::Success, T0, &p).unwrap();
    assert_eq!(in_use(&m), [1, 3]);
    assert_eq!(get(&mut m, &p, T0), Pick::Idle(addr(1)));
    assert_eq!(get(&mut m, &p, T0), Pick::Overloaded);
}

#[test]
fn a_report_of_a_node_with_no_unit_out_changes_no_count() {
    let (mut m, p) = balance(&[2, 3]);
    m.report(addr(2), Outcome::Success, T0, &p).unwrap();
    assert_eq!(in_use(&m), [0, 0]);
    assert_eq!(drain(&mut m, &p, T0).0.values().sum::<u32>(), 5);
}

#[test]
fn a_unit_not_reported_returns_by_its_time_out_and_is_counted() {
    let (mut m, p) = balance(&[1, 1]);
    assert!(matches!(get(&mut m, &p, T0), Pick::Idle(_)));
    assert!(matches!(get(&mut m, &p, T0 + 10), Pick::Idle(_)));
    assert_eq!(m.expire_units(T0 + p.unit_timeout_ms - 1), 0);
    assert_eq!(m.expire_units(T0 + p.unit_timeout_ms), 1);
    assert_eq!(m.units().unwrap().held(), 1);
    assert_eq!(m.expire_units(T0 + p.unit_timeout_ms + 10), 1);
    assert_eq!(m.units().unwrap().held(), 0);
    assert_eq!(m.units().unwrap().timed_out(), 2);
}

#[test]
fn a_unit_reported_in_time_is_not_returned_twice_by_the_time_out() {
    let (mut m, p) = balance(&[2]);
    let a = addr(1);
    assert_eq!(get(&mut m, &p, T0), Pick::Idle(a));
    assert_eq!(get(&mut m, &p, T0 + 5), Pick::Idle(a));
    m.report(a, Outcome::Success, T0 + 6, &p).unwrap();
    // The report returned the older unit: its deadline passes with nothing
    // to return; the younger one times out at its own.
    assert_eq!(m.expire_units(T0 + p.unit_timeout_ms), 0);
    assert_eq!(in_use(&m), [1]);
    assert_eq!(m.expire_units(T0 + 5 + p.unit_timeout_ms), 1);
    assert_eq!(in_use(&m), [0]);
}

#[test]
fn an_overloaded_node_has_no_capacity_until_it_recovers() {
    let (mut m, p) = balance(&[5, 5]);
    for _ in 0..p.contin_err_lim {
        m.report(addr(1), Outcome::Failure { tcost_ms: 0 }, T0, &p)
            .unwrap();
    }
    assert_eq!(m.nodes()[0].state(), NodeState::Overloaded);
    assert_eq!(m.units().unwrap().capacity(0), 0);
    // L5's probe rule still sends one getHost in probe_num + 1 to the
    // overloaded node (taking no unit); every other one goes to node 2.
    let mut probes = 0;
    for _ in 0..5 + 5 / p.probe_num + 1 {
        match get(&mut m, &p, T0) {
            Pick::Idle(a) => assert_eq!(a, addr(2)),
            Pick::Probe(a) => {
                assert_eq!(a, addr(1));
                probes += 1;
            }
            Pick::Overloaded => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(in_use(&m), [0, 5]);
    assert!(probes <= 1);
    // Recovered (the overload wait passed): its weight is its capacity again.
    m.report(addr(1), Outcome::Success, T0 + p.overload_wait_ms, &p)
        .unwrap();
    assert_eq!(m.nodes()[0].state(), NodeState::Idle);
    assert_eq!(m.units().unwrap().capacity(0), 5);
    assert_eq!(drain(&mut m, &p, T0).0, BTreeMap::from([(addr(1), 5)]));
}

#[test]
fn a_route_change_keeps_the_units_of_the_nodes_that_stay() {
    let (mut m, p) = balance(&[2, 3]);
    drain(&mut m, &p, T0);
    // Node 1 leaves, node 2's weight grows to 4, node 3 joins with 1.
    let new = vec![
        RouteNode {
            addr: addr(2),
            weight: 4,
        },
        RouteNode {
            addr: addr(3),
            weight: 1,
        },
    ];
    m.update_route(&new, 2, T0, &p);
    assert_eq!(m.policy(), Policy::Balance);
    assert_eq!(in_use(&m), [3, 0]);
    let (given, _) = drain(&mut m, &p, T0);
    assert_eq!(given, BTreeMap::from([(addr(2), 1), (addr(3), 1)]));
    // The time-out of a unit of the removed node finds nothing to return.
    let due = T0 + p.unit_timeout_ms;
    assert_eq!(m.expire_units(due), 5);
    assert_eq!(in_use(&m), [0, 0]);
}

#[test]
fn a_module_set_back_to_l5_drops_its_units() {
    let (mut m, p) = balance(&[1, 1]);
    drain(&mut m, &p, T0);
    m.set_policy(Policy::L5);
    assert!(m.units().is_none());
    assert!(matches!(get(&mut m, &p, T0), Pick::Idle(_)));
    m.set_policy(Policy::Balance);
    assert_eq!(in_use(&m), [0, 0]);
}

#[test]
fn with_nothing_in_flight_the_draw_picks_the_node_with_most_free_units() {
    // 60 and 20 units, every unit returned at once: η = 1 each time, and
    // η = 1 picks a node with the most free units. With units held, η
    // grows and the draw spreads by Φ; never past a node's capacity.
    let (mut m, p) = balance(&[60, 20]);
    let (given, _) = drain(&mut m, &p, T0);
    assert_eq!(given, BTreeMap::from([(addr(1), 60), (addr(2), 20)]));
    for _ in 0..80 {
        m.report(addr(1), Outcome::Success, T0, &p).ok();
        m.report(addr(2), Outcome::Success, T0, &p).ok();
    }
    assert_eq!(
        get(&mut m, &p, T0),
        Pick::Idle(addr(1)),
        "η = 1: the largest"
    );
}

// === downstream admission levels (DAGOR) on a `balance` module ===

use lbagent_admission::admits;
use lbagent_admission::AdmissionLevel;
use proptest::prelude::*;

const TTL: Millis = 3_000;

fn get_as(m: &mut ModuleLb, p: &LbParams, b: u8, u: u8, now: Millis) -> Pick {
    m.get_host_for(p, b, u, now)
}

#[test]
fn a_level_restricts_the_draw_to_the_admitting_nodes_then_rejects() {
    let (mut m, p) = balance(&[3, 2]);
    m.set_level(addr(1), Some(AdmissionLevel::new(10, 128)), T0 + TTL)
        .unwrap();
    // Priority 20 is refused by node 1: node 2's units only.
    for _ in 0..2 {
        assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Idle(addr(2)));
    }
    // Node 1 still has free units, and refuses: Rejected at once.
    assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Rejected);
    assert_eq!(in_use(&m), [0, 2]);
    // Priority 5 (and b == B*, u <= U*) is admitted: node 1's units.
    assert_eq!(get_as(&mut m, &p, 5, 1, T0), Pick::Idle(addr(1)));
    assert_eq!(get_as(&mut m, &p, 10, 128, T0), Pick::Idle(addr(1)));
    assert_eq!(get_as(&mut m, &p, 10, 128, T0), Pick::Idle(addr(1)));
    // No free unit anywhere: Overloaded, whatever the priority.
    assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Overloaded);
    assert_eq!(get_as(&mut m, &p, 1, 1, T0), Pick::Overloaded);
    // A unit of the refusing node comes back: still Rejected for 20.
    m.report(addr(1), Outcome::Success, T0, &p).unwrap();
    assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Rejected);
    m.check_invariants().unwrap();
}

#[test]
fn a_level_not_refreshed_is_forgotten_by_the_balance_draw() {
    let (mut m, p) = balance(&[1, 1]);
    m.set_level(addr(1), Some(AdmissionLevel::new(10, 128)), T0 + TTL)
        .unwrap();
    m.set_level(addr(2), Some(AdmissionLevel::new(10, 128)), T0 + TTL)
        .unwrap();
    assert_eq!(get_as(&mut m, &p, 0, 0, T0 + TTL - 1), Pick::Rejected);
    assert_eq!(m.levels_held(), 2);
    assert!(matches!(get_as(&mut m, &p, 0, 0, T0 + TTL), Pick::Idle(_)));
    assert_eq!(m.levels_held(), 0, "expired levels go at the getHost");
    assert!(matches!(get_as(&mut m, &p, 0, 0, T0 + TTL), Pick::Idle(_)));
}

#[test]
fn probes_of_a_balance_module_go_whatever_the_level() {
    let (mut m, p) = balance(&[5, 5]);
    for _ in 0..p.contin_err_lim {
        m.report(addr(1), Outcome::Failure { tcost_ms: 0 }, T0, &p)
            .unwrap();
    }
    assert_eq!(m.nodes()[0].state(), NodeState::Overloaded);
    for i in 1..=2 {
        m.set_level(addr(i), Some(AdmissionLevel::new(1, 1)), T0 + TTL)
            .unwrap();
    }
    // Node 2 has free units and refuses; node 1 has none (overloaded).
    for _ in 0..p.probe_num {
        assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Rejected);
    }
    assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Probe(addr(1)));
    // An admitting level does not give the overloaded node units.
    m.set_level(addr(1), Some(AdmissionLevel::new(100, 1)), T0 + TTL)
        .unwrap();
    assert_eq!(get_as(&mut m, &p, 20, 1, T0), Pick::Rejected);
    assert_eq!(in_use(&m), [0, 0]);
}

#[test]
fn without_levels_the_balance_draw_is_unchanged() {
    // The same module twice, one of which had a level that expired: the
    // same draws (the level path consumes no randomness once forgotten).
    let (mut a, p) = balance(&[4, 3, 2]);
    let mut b = a.clone();
    b.set_level(addr(1), Some(AdmissionLevel::new(1, 1)), T0)
        .unwrap();
    for i in 0..9 {
        assert_eq!(
            get_as(&mut a, &p, 50, 50, T0 + i),
            get_as(&mut b, &p, 50, 50, T0 + i)
        );
    }
}

/// A `balance` module of `weights` (nodes 1, 2, ...) with `held` units
/// taken first (η > 1), and `levels` per node (None: no level).
fn levelled(weights: &[u32], held: u32, levels: &[Option<(u8, u8)>]) -> (ModuleLb, LbParams) {
    let (mut m, p) = balance(weights);
    for _ in 0..held {
        get_as(&mut m, &p, 0, 0, T0);
    }
    for (i, l) in levels.iter().enumerate().take(weights.len()) {
        if let &Some((b, u)) = l {
            m.set_level(
                addr(i as u8 + 1),
                Some(AdmissionLevel::new(b, u)),
                Millis::MAX,
            )
            .unwrap();
        }
    }
    (m, p)
}

fn admitted_by(m: &ModuleLb, i: usize, b: u8, u: u8) -> bool {
    m.level_of(m.nodes()[i].addr())
        .is_none_or(|l| admits(l, b, u))
}

fn level() -> impl Strategy<Value = Option<(u8, u8)>> {
    prop_oneof![1 => Just(None), 2 => (1u8..=128, 1u8..=128).prop_map(Some)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Every answer of a levelled `balance` module, over getHosts of
    /// arbitrary priorities and reports: a node that admits the request
    /// and had a free unit; `Rejected` only with free units none of which
    /// is on an admitting node; `Overloaded` only with no free unit.
    #[test]
    fn with_levels_the_chosen_node_always_admits_the_request(
        weights in proptest::collection::vec(0u32..8, 1..10),
        held in 0u32..20,
        levels in proptest::collection::vec(level(), 10),
        ops in proptest::collection::vec((1u8..=128, 1u8..=128, 0u8..12), 1..80),
    ) {
        let (mut m, p) = levelled(&weights, held, &levels);
        for (b, u, report) in ops {
            if usize::from(report) < weights.len() {
                m.report(addr(report + 1), Outcome::Success, T0, &p).unwrap();
                continue;
            }
            let before = in_use(&m);
            let units = m.units().unwrap();
            let free: Vec<bool> = (0..weights.len()).map(|i| units.capacity(i) > units.in_use(i)).collect();
            let admitting_free = (0..weights.len()).any(|i| free[i] && admitted_by(&m, i, b, u));
            match get_as(&mut m, &p, b, u, T0) {
                Pick::Idle(a) => {
                    let i = m.nodes().iter().position(|n| n.addr() == a).unwrap();
                    prop_assert!(admitted_by(&m, i, b, u), "node {} refuses ({}, {})", i, b, u);
                    prop_assert!(free[i]);
                    prop_assert_eq!(in_use(&m)[i], before[i] + 1);
                }
                Pick::Rejected => {
                    prop_assert!(free.iter().any(|&f| f));
                    prop_assert!(!admitting_free);
                }
                Pick::Overloaded => prop_assert!(!free.iter().any(|&f| f)),
                other => prop_assert!(false, "{:?}", other),
            }
        }
    }
}

/// Through the module, as the shard drives it: with units held (η > 1)
/// and each unit handed out returned at once (so `Φ` stays put), the
/// admitting nodes are chosen in proportion to their `Φ`. Fixed seeds
/// (the cases and the module's draw), within 6 standard deviations of a
/// binomial count plus 0.2 points.
#[test]
fn with_levels_the_admitting_nodes_share_as_their_phi() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    const DRAWS: u32 = 20_000;
    let cases = (
        proptest::collection::vec(1u32..30, 2..10),
        0u32..60,
        proptest::collection::vec(level(), 10),
        (1u8..=128, 1u8..=128),
    );
    let mut runner = TestRunner::deterministic();
    let mut tested = 0;
    for case in 0..40 {
        let (weights, held, levels, (b, u)) = cases.new_tree(&mut runner).unwrap().current();
        let (mut m, p) = levelled(&weights, held, &levels);
        let n = weights.len();
        let units = m.units().unwrap();
        let phi: Vec<f64> = (0..n)
            .map(|i| {
                if admitted_by(&m, i, b, u) {
                    units.phi(i)
                } else {
                    0.0
                }
            })
            .collect();
        let mass: f64 = phi.iter().sum();
        if mass == 0.0 {
            continue;
        }
        tested += 1;
        let mut counts = vec![0u32; n];
        for _ in 0..DRAWS {
            let Pick::Idle(a) = get_as(&mut m, &p, b, u, T0) else {
                panic!("case {case}: no node though the admitting Φ is {mass}");
            };
            let i = m.nodes().iter().position(|x| x.addr() == a).unwrap();
            counts[i] += 1;
            m.report(a, Outcome::Success, T0, &p).unwrap();
        }
        for i in 0..n {
            let want = phi[i] / mass;
            let f = f64::from(counts[i]) / f64::from(DRAWS);
            let bound = 6.0 * (want * (1.0 - want) / f64::from(DRAWS)).sqrt() + 0.002;
            assert!(
                (f - want).abs() <= bound,
                "case {case}: node {i} drawn {f} of the time, its restricted Φ is {want} (weights {weights:?}, held {held}, levels {levels:?}, priority ({b}, {u}))"
            );
        }
    }
    assert!(tested >= 20, "only {tested} cases with an admitting Φ");
}

// === units held by the client that took them ===

const A: u64 = 11;
const B: u64 = 22;

fn get_from(m: &mut ModuleLb, p: &LbParams, client: u64, now: Millis) -> Pick {
    m.get_host_from(p, client, 0, 0, now)
}

#[test]
fn a_report_from_a_client_that_took_no_unit_frees_nothing() {
    let (mut m, p) = balance(&[2]);
    assert_eq!(get_from(&mut m, &p, A, T0), Pick::Idle(addr(1)));
    assert_eq!(get_from(&mut m, &p, A, T0), Pick::Idle(addr(1)));
    assert_eq!(get_from(&mut m, &p, B, T0), Pick::Overloaded);
    // B forges reports of A's node: nothing goes back.
    for _ in 0..5 {
        m.report_from(B, addr(1), Outcome::Success, T0, &p).unwrap();
    }
    assert_eq!(in_use(&m), vec![2]);
    assert_eq!(get_from(&mut m, &p, B, T0), Pick::Overloaded);
    // A's own report returns its unit.
    m.report_from(A, addr(1), Outcome::Success, T0, &p).unwrap();
    assert_eq!(in_use(&m), vec![1]);
    assert_eq!(get_from(&mut m, &p, B, T0), Pick::Idle(addr(1)));
}

#[test]
fn a_forged_batch_report_frees_nothing_either() {
    let (mut m, p) = balance(&[3]);
    for _ in 0..3 {
        get_from(&mut m, &p, A, T0);
    }
    m.report_successes_from(B, addr(1), 3, T0, &p, |_| {})
        .unwrap();
    assert_eq!(in_use(&m), vec![3]);
    m.report_successes_from(A, addr(1), 2, T0, &p, |_| {})
        .unwrap();
    assert_eq!(in_use(&m), vec![1]);
}

#[test]
fn one_client_takes_at_most_units_per_client_and_others_still_get_theirs() {
    let (mut m, mut p) = balance(&[10]);
    p.units_per_client = 3;
    for _ in 0..3 {
        assert_eq!(get_from(&mut m, &p, A, T0), Pick::Idle(addr(1)));
    }
    for _ in 0..100 {
        assert_eq!(get_from(&mut m, &p, A, T0), Pick::ClientLimit);
    }
    assert_eq!(in_use(&m), vec![3]);
    assert_eq!(m.units().unwrap().client_held(A), 3);
    for _ in 0..3 {
        assert_eq!(get_from(&mut m, &p, B, T0), Pick::Idle(addr(1)));
    }
    // A report makes room for one more.
    m.report_from(A, addr(1), Outcome::Success, T0, &p).unwrap();
    assert_eq!(get_from(&mut m, &p, A, T0), Pick::Idle(addr(1)));
}

#[test]
fn a_client_that_is_gone_gives_back_everything_it_held_once() {
    let (mut m, p) = balance(&[2, 2]);
    for _ in 0..3 {
        get_from(&mut m, &p, A, T0);
    }
    get_from(&mut m, &p, B, T0);
    assert_eq!(m.release_client(A), 3);
    assert_eq!(in_use(&m).iter().sum::<u32>(), 1);
    assert_eq!(m.release_client(A), 0);
    // The released units' deadlines pass without returning anything twice,
    // and B's unit times out as before.
    assert_eq!(m.expire_units(T0 + p.unit_timeout_ms), 1);
    assert_eq!(in_use(&m), vec![0, 0]);
    assert_eq!(m.units().unwrap().clients(), 0);
}

#[test]
fn units_time_out_per_client_after_another_client_reported_early() {
    let (mut m, p) = balance(&[2]);
    get_from(&mut m, &p, A, T0);
    get_from(&mut m, &p, B, T0 + 10);
    m.report_from(B, addr(1), Outcome::Success, T0 + 20, &p)
        .unwrap();
    // A's unit is still out, and times out at its own deadline.
    assert_eq!(in_use(&m), vec![1]);
    assert_eq!(m.expire_units(T0 + p.unit_timeout_ms), 1);
    assert_eq!(in_use(&m), vec![0]);
    assert_eq!(m.expire_units(T0 + 10 + p.unit_timeout_ms), 0);
}

#[test]
fn a_callers_own_level_rejects_only_its_own_get_hosts() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&route(&[1, 1]), 1, T0, &p);
    let strict = lbagent_admission::AdmissionLevel::new(1, 1);
    for i in 1..=2 {
        assert!(m
            .set_private_level(A, addr(i), Some(strict), T0 + 3_000)
            .unwrap());
    }
    assert_eq!(m.get_host_from(&p, A, 50, 50, T0), Pick::Rejected);
    assert!(matches!(m.get_host_from(&p, B, 50, 50, T0), Pick::Idle(_)));
    // A shared level rejects everyone.
    for i in 1..=2 {
        m.set_level(addr(i), Some(strict), T0 + 3_000).unwrap();
    }
    assert_eq!(m.get_host_from(&p, B, 50, 50, T0), Pick::Rejected);
    // Both expire.
    assert!(matches!(
        m.get_host_from(&p, A, 50, 50, T0 + 3_000),
        Pick::Idle(_)
    ));
    assert_eq!(m.private_levels_held(), 0);
}

#[test]
fn private_levels_are_bounded_per_module() {
    let p = LbParams::default();
    let mut m = ModuleLb::new(&route(&[1]), 1, T0, &p);
    let l = lbagent_admission::AdmissionLevel::new(1, 1);
    let max = crate::levels::MAX_PRIVATE as u64;
    for c in 0..max {
        assert!(m
            .set_private_level(c + 1, addr(1), Some(l), T0 + 1)
            .unwrap());
    }
    assert!(!m
        .set_private_level(max + 1, addr(1), Some(l), T0 + 1)
        .unwrap());
    // A caller already held refreshes its level.
    assert!(m.set_private_level(1, addr(1), Some(l), T0 + 2).unwrap());
}
