//! Keyed, selecting and zone-aware getHosts through the shard (issue 31):
//! the request's key and selector from the wire, the route's zones and
//! labels from the control core, the agent's zone from the setup.

use super::*;
use crate::messages::ToShard;
use lbagent_model::{NodeAddr, NodeMeta, Policy, RouteNode};
use lbagent_wire::decode;
use std::net::Ipv4Addr;

const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40000));
const M: ModuleId = ModuleId::new(3, 1);

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
}

fn meta(zone: &str, labels: &str) -> NodeMeta {
    NodeMeta {
        zone: (!zone.is_empty()).then(|| zone.parse().unwrap()),
        labels: labels.parse().unwrap(),
    }
}

/// Nodes 1..=6: 1..=3 in zone a, 4..=6 in zone b; 2 and 5 canaries.
fn route() -> ToShard {
    ToShard::Route {
        module: M,
        exists: true,
        version: 7,
        nodes: (1..=6)
            .map(|i| RouteNode {
                addr: node(i),
                weight: 1,
            })
            .collect(),
        policy: Policy::L5,
        options: Default::default(),
        meta: (1..=6)
            .map(|i| {
                let zone = if i <= 3 { "a" } else { "b" };
                let version = if i % 3 == 2 { "canary" } else { "stable" };
                (node(i), meta(zone, &format!("version={version}")))
            })
            .collect(),
    }
}

fn shard(zone: Option<&str>, fallback: &str) -> ShardCore {
    let mut s = ShardCore::new(ShardSetup {
        steering: Steering {
            zone: zone.map(|z| z.parse().unwrap()),
            locality_min_percent: 50,
            label_fallback: fallback.parse().unwrap(),
        },
        ..ShardSetup::new(0, 2, 8888)
    });
    s.apply(route(), 0);
    s
}

/// One getHost with `key` and `selector`: its retcode and node.
fn ask(s: &mut ShardCore, key: Option<&str>, selector: &str) -> (RetCode, Option<NodeAddr>) {
    let mut enc = Encoder::new();
    let hash = key.map(|k| lbagent_model::key_hash(k.as_bytes()));
    let req = enc.get_host_req_full(9, M, 0, 0, hash, selector).to_vec();
    let resp = s.handle(&req, PEER, 0).expect("an answer").to_vec();
    match decode(&resp, &Limits::UDP).unwrap() {
        Message::GetHostResp(r) => (r.retcode(), r.host().map(NodeAddr::from)),
        Message::ErrorResp(e) => (e.retcode(), None),
        other => panic!("unexpected {}", other.name()),
    }
}

#[test]
fn a_keyed_gethost_answers_the_same_node_for_the_same_key() {
    let mut s = shard(None, "any");
    for k in 0..20 {
        let key = format!("user-{k}");
        let first = ask(&mut s, Some(&key), "");
        assert_eq!(first.0, RetCode::Ok);
        for _ in 0..3 {
            assert_eq!(ask(&mut s, Some(&key), ""), first, "key {key}");
        }
    }
    assert_eq!(s.metrics.keyed_gethosts, 80);
}

#[test]
fn a_selector_chooses_among_the_labelled_nodes_and_falls_back_as_configured() {
    let mut s = shard(None, "fail");
    for _ in 0..6 {
        let (rc, host) = ask(&mut s, None, "version=canary");
        assert_eq!(rc, RetCode::Ok);
        assert!([node(2), node(5)].contains(&host.unwrap()));
    }
    assert_eq!(
        ask(&mut s, None, "version=gamma"),
        (RetCode::NoSuchModule, None)
    );
    // A hostile selector: a clear BadRequest, and the shard keeps serving.
    assert_eq!(ask(&mut s, None, "version"), (RetCode::BadRequest, None));
    assert_eq!(
        ask(&mut s, None, &"a=".repeat(40)),
        (RetCode::BadRequest, None)
    );
    assert_eq!(ask(&mut s, None, "").0, RetCode::Ok);
    let mut any = shard(None, "any");
    assert_eq!(ask(&mut any, None, "version=gamma").0, RetCode::Ok);
}

#[test]
fn a_zoned_agent_prefers_its_zone_and_an_unzoned_one_does_not() {
    let mut s = shard(Some("a"), "any");
    for _ in 0..9 {
        let host = ask(&mut s, None, "").1.unwrap();
        assert!(
            [node(1), node(2), node(3)].contains(&host),
            "{host} is not in zone a"
        );
    }
    assert_eq!(s.metrics.near_gethosts, 9);
    let mut plain = shard(None, "any");
    let seen: std::collections::BTreeSet<NodeAddr> = (0..6)
        .map(|_| ask(&mut plain, None, "").1.unwrap())
        .collect();
    assert_eq!(seen.len(), 6, "round robin over every node");
    assert_eq!(plain.metrics.near_gethosts, 0);
}

#[test]
fn a_later_route_without_zones_clears_them() {
    let mut s = shard(Some("a"), "any");
    let ToShard::Route {
        module,
        version,
        nodes,
        ..
    } = route()
    else {
        unreachable!()
    };
    s.apply(
        ToShard::Route {
            module,
            exists: true,
            version: version + 1,
            nodes,
            policy: Policy::L5,
            options: Default::default(),
            meta: Vec::new(),
        },
        0,
    );
    let seen: std::collections::BTreeSet<NodeAddr> =
        (0..6).map(|_| ask(&mut s, None, "").1.unwrap()).collect();
    assert_eq!(seen.len(), 6);
}

/// A module's own `locality_min_percent` (its options, `lbagent route
/// options`) wins over the agent's `[lb]` value: with 50 agent-wide, zone
/// a (nodes 1..=3) with one idle node of three stays local only while the
/// module says 30, and spills over when it says 40.
#[test]
fn a_modules_own_locality_threshold_wins_over_the_agents() {
    for (own, stays) in [(30u8, true), (40, false)] {
        let mut s = shard(Some("a"), "any");
        let ToShard::Route {
            module,
            version,
            nodes,
            meta,
            ..
        } = route()
        else {
            unreachable!()
        };
        s.apply(
            ToShard::Route {
                module,
                exists: true,
                version: version + 1,
                nodes,
                policy: Policy::L5,
                options: lbagent_model::ModuleOptions {
                    locality_min_percent: Some(own),
                    ..Default::default()
                },
                meta,
            },
            1,
        );
        // Nodes 1 and 2 of zone a overloaded: one of its three idle.
        for bad in [node(1), node(2)] {
            for seq in 0..20 {
                let mut enc = Encoder::new();
                let rep = lbagent_wire::Report {
                    seq,
                    module: M,
                    host: bad,
                    retcode: -1,
                    tcost_ms: 10,
                    downstream_level: None,
                    consumed: 0,
                };
                let req = enc.report_req(&rep).to_vec();
                let _ = s.handle(&req, PEER, 2);
            }
        }
        let answers: Vec<NodeAddr> = (0..12).filter_map(|_| ask(&mut s, None, "").1).collect();
        // An overloaded node is still probed now and then (L5): leave
        // the probes out.
        let picked: Vec<NodeAddr> = answers
            .into_iter()
            .filter(|a| *a != node(1) && *a != node(2))
            .collect();
        assert!(picked.len() >= 8, "{picked:?}");
        let answers = picked;
        let local = answers.iter().all(|a| *a == node(3));
        assert_eq!(local, stays, "own threshold {own}%: {answers:?}");
    }
}
