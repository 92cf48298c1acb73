//! Zones, labels and selectors on the wire (issue 31): a route's
//! `node_meta` built and read back, and a getHost's selector, each checked
//! as the store checks them (bounded in length, count and charset;
//! [`lbagent_model::MetaError`]).

use flatbuffers::{FlatBufferBuilder, ForwardsUOffset, Vector, WIPOffset};

use super::fb;
use lbagent_model::{Label, Labels, MetaError, NodeAddr, NodeMeta, Selector, MAX_LABELS};

/// Why a route's `node_meta` or a getHost's selector was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadMeta {
    /// An entry names no node (or port 0).
    #[error("node_meta entry {0} names no node")]
    NoHost(usize),
    /// More entries than the route has nodes.
    #[error("node_meta has {count} entries for a route of {nodes} nodes: at most one per node")]
    TooMany {
        /// Entries sent.
        count: usize,
        /// Nodes in the route.
        nodes: usize,
    },
    /// A node's zone or labels break the rules.
    #[error("node {node}: {error}")]
    Node {
        /// The node.
        node: NodeAddr,
        /// What is wrong.
        error: MetaError,
    },
    /// A getHost's selector breaks the rules.
    #[error("selector: {0}")]
    Selector(MetaError),
}

/// The `node_meta` vector of `meta` (None when empty: the field is left
/// out, as an older route server leaves it).
pub(crate) fn build<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    meta: &[(NodeAddr, NodeMeta)],
) -> Option<WIPOffset<Vector<'a, ForwardsUOffset<fb::NodeMeta<'a>>>>> {
    if meta.is_empty() {
        return None;
    }
    let mut entries = Vec::with_capacity(meta.len());
    for (addr, m) in meta {
        let zone = m.zone.as_ref().map(|z| fbb.create_string(z.as_str()));
        let labels: Vec<WIPOffset<&str>> = m
            .labels
            .iter()
            .map(|l| fbb.create_string(&l.to_string()))
            .collect();
        let labels = (!labels.is_empty()).then(|| fbb.create_vector(&labels));
        let host = fb::Host::from(*addr);
        let args = fb::NodeMetaArgs {
            host: Some(&host),
            zone,
            labels,
        };
        entries.push(fb::NodeMeta::create(fbb, &args));
    }
    Some(fbb.create_vector(&entries))
}

/// The zones and labels of a route of `nodes` nodes, checked: at most one
/// entry per node, each naming a node, its zone and labels within the
/// bounds. Absent: none.
///
/// # Errors
/// [`BadMeta`] naming the first entry at fault.
pub fn read_node_meta(
    v: Option<Vector<'_, ForwardsUOffset<fb::NodeMeta<'_>>>>,
    nodes: usize,
) -> Result<Vec<(NodeAddr, NodeMeta)>, BadMeta> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    if v.len() > nodes {
        return Err(BadMeta::TooMany {
            count: v.len(),
            nodes,
        });
    }
    let mut out = Vec::with_capacity(v.len());
    for (i, e) in v.iter().enumerate() {
        let node = e
            .host()
            .map(NodeAddr::from)
            .filter(|a| a.port != 0)
            .ok_or(BadMeta::NoHost(i))?;
        let bad = |error| BadMeta::Node { node, error };
        let zone = e.zone().map(str::parse).transpose().map_err(bad)?;
        let labels = match e.labels() {
            None => Labels::default(),
            Some(l) if l.len() > MAX_LABELS => {
                return Err(bad(MetaError::TooMany {
                    what: "labels",
                    count: l.len(),
                }))
            }
            Some(l) => {
                let parsed: Result<Vec<Label>, MetaError> = l.iter().map(str::parse).collect();
                Labels::new(parsed.map_err(bad)?).map_err(bad)?
            }
        };
        out.push((node, NodeMeta { zone, labels }));
    }
    Ok(out)
}

/// A getHost's selector, checked (absent or empty: every node).
///
/// # Errors
/// [`BadMeta::Selector`].
pub fn read_selector(s: Option<&str>) -> Result<Selector, BadMeta> {
    match s {
        None | Some("") => Ok(Selector::default()),
        Some(s) => s.parse().map_err(BadMeta::Selector),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, Encoder, Limits, Message};
    use lbagent_model::{ModuleId, Policy, RouteNode};
    use std::net::Ipv4Addr;

    fn addr(i: u8) -> NodeAddr {
        NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
    }

    fn meta(zone: &str, labels: &str) -> NodeMeta {
        NodeMeta {
            zone: (!zone.is_empty()).then(|| zone.parse().unwrap()),
            labels: labels.parse().unwrap(),
        }
    }

    fn route(n: u8) -> Vec<RouteNode> {
        (1..=n)
            .map(|i| RouteNode {
                addr: addr(i),
                weight: 1,
            })
            .collect()
    }

    #[test]
    fn zones_and_labels_round_trip_in_answers_and_pushes() {
        let m = vec![
            (addr(1), meta("eu-1", "version=canary,tier=gold")),
            (addr(3), meta("", "flag=")),
            (addr(2), meta("eu-2", "")),
        ];
        let mut enc = Encoder::new();
        let module = ModuleId::new(1, 2);
        let buf = enc
            .route_answer_meta(
                1,
                module,
                true,
                5,
                &route(3),
                Policy::L5,
                &Default::default(),
                &m,
            )
            .to_vec();
        let Ok(Message::RouteAnswer(a)) = decode(&buf, &Limits::TCP_FRAME) else {
            panic!("not an answer")
        };
        assert_eq!(read_node_meta(a.node_meta(), 3), Ok(m.clone()));
        let buf = enc
            .route_push_meta(
                module,
                true,
                5,
                &route(3),
                Policy::L5,
                &Default::default(),
                &m,
            )
            .to_vec();
        let Ok(Message::RoutePush(p)) = decode(&buf, &Limits::TCP_FRAME) else {
            panic!("not a push")
        };
        assert_eq!(read_node_meta(p.node_meta(), 3), Ok(m));
        let plain = enc.route_answer(1, module, true, 5, &route(3)).to_vec();
        let Ok(Message::RouteAnswer(a)) = decode(&plain, &Limits::TCP_FRAME) else {
            panic!("not an answer")
        };
        assert!(a.node_meta().is_none(), "no metadata, no field");
        assert_eq!(read_node_meta(a.node_meta(), 3), Ok(vec![]));
    }

    /// A hostile route server: every bound is checked on the way in.
    #[test]
    fn hostile_metadata_is_refused_with_what_is_wrong() {
        let mut fbb = FlatBufferBuilder::new();
        let entry = |fbb: &mut FlatBufferBuilder<'static>, zone: &str, labels: &[&str]| {
            let zone = Some(fbb.create_string(zone));
            let l: Vec<_> = labels.iter().map(|s| fbb.create_string(s)).collect();
            let labels = Some(fbb.create_vector(&l));
            let host = fb::Host::from(addr(1));
            fb::NodeMeta::create(
                fbb,
                &fb::NodeMetaArgs {
                    host: Some(&host),
                    zone,
                    labels,
                },
            )
        };
        let long = "z".repeat(64);
        let seventeen: Vec<String> = (0..17).map(|i| format!("k{i}=v")).collect();
        let seventeen: Vec<&str> = seventeen.iter().map(String::as_str).collect();
        let cases: Vec<(&str, Vec<&str>, &str)> = vec![
            (long.as_str(), vec![], "at most 63"),
            ("eu 1", vec![], "the character ' '"),
            ("", vec![], "zone is empty"),
            ("eu", vec!["version"], "not KEY=VALUE"),
            ("eu", vec!["a=1", "a=2"], "given twice"),
            ("eu", seventeen, "at most 16"),
        ];
        for (zone, labels, want) in cases {
            fbb.reset();
            let e = entry(&mut fbb, zone, &labels);
            let v = fbb.create_vector(&[e]);
            let root = fb::RoutePush::create(
                &mut fbb,
                &fb::RoutePushArgs {
                    node_meta: Some(v),
                    ..Default::default()
                },
            );
            fbb.finish_minimal(root);
            let push = flatbuffers::root::<fb::RoutePush>(fbb.finished_data()).unwrap();
            let err = read_node_meta(push.node_meta(), 1).unwrap_err();
            assert!(err.to_string().contains(want), "{zone:?} {labels:?}: {err}");
            assert!(err.to_string().contains("10.0.0.1:80"), "{err}");
            assert_eq!(
                read_node_meta(push.node_meta(), 0).unwrap_err(),
                BadMeta::TooMany { count: 1, nodes: 0 }
            );
        }
    }

    #[test]
    fn a_selector_is_read_with_the_same_bounds() {
        assert!(read_selector(None).unwrap().is_empty());
        assert!(read_selector(Some("")).unwrap().is_empty());
        let s = read_selector(Some("version=canary")).unwrap();
        assert!(s.matches(&"version=canary,x=y".parse().unwrap()));
        assert!(matches!(
            read_selector(Some("version")),
            Err(BadMeta::Selector(MetaError::NotKeyValue(_)))
        ));
        let mut enc = Encoder::new();
        let buf = enc
            .get_host_req_full(1, ModuleId::new(1, 1), 0, 0, None, "a=b")
            .to_vec();
        let Ok(Message::GetHostReq(g)) = decode(&buf, &Limits::UDP) else {
            panic!("not a getHost")
        };
        assert_eq!(g.selector(), Some("a=b"));
        assert_eq!(
            crate::read_hot(&buf, &Limits::UDP),
            None,
            "left to the full decode"
        );
    }

    fn get_host(buf: &[u8]) -> crate::fb::GetHostReq<'_> {
        match decode(buf, &Limits::UDP) {
            Ok(Message::GetHostReq(g)) => g,
            other => panic!("not a getHost: {other:?}"),
        }
    }

    #[test]
    fn only_a_get_host_that_may_carry_a_key_or_a_selector_is_looked_at_for_them() {
        let m = ModuleId::new(1, 1);
        let mut enc = Encoder::new();
        for (b, u) in [(0, 0), (5, 0), (0, 7), (128, 128)] {
            let plain = enc.get_host_req(9, m, b, u).to_vec();
            assert!(!get_host(&plain).may_steer(), "plain getHost ({b}, {u})");
        }
        let keyed = enc.get_host_req_keyed(9, m, 0, 0, Some(0)).to_vec();
        assert!(get_host(&keyed).may_steer());
        assert_eq!(get_host(&keyed).key_hash(), Some(0), "a key hashing to 0");
        let selecting = enc.get_host_req_full(9, m, 3, 3, None, "a=b").to_vec();
        assert!(get_host(&selecting).may_steer());
        // Another builder's getHost: without the fields, the vtable ends
        // before their slots; with an empty selector it reaches them and
        // the key's slot is empty (offset 0): then both are read.
        let raw = |selector: Option<&str>| {
            let mut fbb = flatbuffers::FlatBufferBuilder::new();
            let selector = selector.map(|s| fbb.create_string(s));
            let mut b = crate::fb::GetHostReqBuilder::new(&mut fbb);
            b.add_seq(9);
            b.add_modid(1);
            b.add_cmdid(1);
            if let Some(s) = selector {
                b.add_selector(s);
            }
            let body = b.finish();
            let env = crate::fb::Envelope::create(
                &mut fbb,
                &crate::fb::EnvelopeArgs {
                    body_type: crate::fb::Body::GetHostReq,
                    body: Some(body.as_union_value()),
                },
            );
            fbb.finish(env, Some(crate::FILE_IDENTIFIER));
            fbb.finished_data().to_vec()
        };
        let bare = raw(None);
        let g = get_host(&bare);
        assert!(!g.may_steer(), "a vtable that ends before the key's slot");
        assert_eq!((g.key_hash(), g.selector()), (None, None));
        let empty = raw(Some(""));
        let g = get_host(&empty);
        assert!(g.may_steer(), "a vtable that reaches the selector's slot");
        assert_eq!((g.key_hash(), g.selector()), (None, Some("")));
        assert!(read_selector(g.selector()).unwrap().is_empty());
    }
}
