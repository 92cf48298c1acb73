//! The agent-down path as the client library will walk it: open the
//! heartbeat, find the beat stale, read the static route file the heartbeat
//! names, answer with a node of the module.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use lbagent::host::heartbeat::{
    is_alive, AgentInfo, HeartbeatReader, HeartbeatWriter, DEFAULT_MAX_AGE_MS,
};
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};

#[test]
fn a_stale_heartbeat_sends_the_client_to_the_snapshot_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot_path = dir.path().join("state/routes.snap");
    let heartbeat_path = dir.path().join("lbagent.hb");
    let module = ModuleId::new(10, 2);
    let node = NodeAddr::new(Ipv4Addr::new(10, 1, 2, 3), 9000);

    // The agent: header, a beat, a snapshot.
    let info = AgentInfo {
        shards: 3,
        base_port: 8888,
        bind: Ipv4Addr::LOCALHOST,
        pid: std::process::id(),
        snapshot_path: snapshot_path.clone(),
    };
    let writer = HeartbeatWriter::create(&heartbeat_path, &info).unwrap();
    writer.beat(1_000_000);
    let routes = [SnapshotRoute {
        module,
        version: 7,
        nodes: vec![RouteNode {
            addr: node,
            weight: 1,
        }],
        meta: Vec::new(),
    }];
    snapshot::write(&snapshot_path, 1_000, &routes).unwrap();

    // The client: alive at first, then the agent stops beating.
    let reader = HeartbeatReader::open(&heartbeat_path).unwrap();
    let beat = reader.beat_unix_ms().unwrap();
    assert!(is_alive(beat, 1_001_500, DEFAULT_MAX_AGE_MS));
    assert!(!is_alive(beat, 1_002_001, DEFAULT_MAX_AGE_MS));

    let static_path: PathBuf = reader.read().unwrap().info.snapshot_path;
    let snap = snapshot::read(&static_path).unwrap();
    assert_eq!(snap.random_node(module, 12345), Some(node));
    assert_eq!(snap.random_node(ModuleId::new(10, 3), 0), None);
}
