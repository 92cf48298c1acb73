//! The balance policy in a module: units taken and returned, the time-out,
//! the overload rules, route changes. Through [`crate::lb::ModuleLb`], as
//! the shard drives it.

use crate::lb::{LbParams, Millis, ModuleLb, NodeState, Outcome, Pick};
use crate::model::{NodeAddr, Policy, RouteNode};
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
    let picks: Vec<Pick> = (0..4).map(|_| get(&mut m, &p, T0)).collect();
    assert_eq!(
        picks,
        [1, 2, 1, 2].map(|i| Pick::Idle(addr(i))),
        "round robin, weights ignored"
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
