//! The starting corpora: real messages from the [`Encoder`], real files
//! from the agent's heartbeat and snapshot writers, the shipped
//! configuration. Written fresh before each run, so they follow the code.

use std::io;
use std::net::Ipv4Addr;
use std::path::Path;

use lbagent::host::heartbeat::{self, AgentInfo, HeartbeatWriter};
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{
    write_frame, AdmissionLevel, CacheRoute, Encoder, ModuleStats, NodeStats, NodeStatus, Report,
    RetCode,
};

const M: ModuleId = ModuleId::new(100, 7);

fn addr(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 9000 + u16::from(i))
}

fn route_nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: addr(i),
            weight: u32::from(i),
        })
        .collect()
}

/// The hot path's requests in each shape it reads or leaves to the full
/// decode: plain getHosts, steering ones, reports with and without a level
/// and consumed units, and values validation refuses.
pub fn hot_requests() -> Vec<Vec<u8>> {
    let mut e = Encoder::new();
    let report = |host: NodeAddr, level: Option<AdmissionLevel>, consumed: u32| Report {
        seq: 9,
        module: M,
        host,
        retcode: -1,
        tcost_ms: 120,
        downstream_level: level,
        consumed,
    };
    let level = Some(AdmissionLevel {
        business: 3,
        user: 9,
    });
    vec![
        e.get_host_req(1, M, 0, 0).to_vec(),
        e.get_host_req(u32::MAX, M, 128, 60).to_vec(),
        e.get_host_req(2, M, 129, 1).to_vec(),
        e.get_host_req_keyed(3, M, 1, 1, Some(42)).to_vec(),
        e.get_host_req_full(4, M, 0, 0, None, "tier=gold").to_vec(),
        e.report_req(&report(addr(1), None, 0)).to_vec(),
        e.report_req(&report(addr(2), level, 7)).to_vec(),
        e.report_req(&report(NodeAddr::new(Ipv4Addr::LOCALHOST, 0), None, 0))
            .to_vec(),
        e.report_req(&report(addr(3), None, 2_000_000)).to_vec(),
    ]
}

/// One encoding of every message of the schema, some in two shapes.
pub fn messages() -> Vec<Vec<u8>> {
    let mut e = Encoder::new();
    let level = Some(AdmissionLevel {
        business: 3,
        user: 9,
    });
    let status: Vec<NodeStatus> = (1..=3)
        .map(|i| NodeStatus {
            addr: addr(i),
            weight: 10,
            overloaded: i == 2,
            vsucc: 180,
            verr: 5,
            rsucc: 40,
            rerr: 1,
            contin_succ: 3,
            contin_err: 0,
            bad_windows: 1,
            window_age_ms: 1_500,
            overload_age_ms: 0,
            capacity: 0,
            in_use: 0,
            phi: 0.0,
        })
        .collect();
    let nodes = route_nodes(4);
    let stats = [NodeStats {
        addr: addr(1),
        succ: 100,
        err: 2,
        overloaded: false,
    }];
    let modules = [
        ModuleStats {
            module: M,
            nodes: &stats,
            consumed: &[],
        },
        ModuleStats {
            module: ModuleId::new(1, 1),
            nodes: &[],
            consumed: &[],
        },
    ];
    let report = Report {
        seq: 5,
        module: M,
        host: addr(1),
        retcode: -1,
        tcost_ms: 250,
        downstream_level: level,
        consumed: 0,
    };
    vec![
        e.get_host_req(1, M, 0, 0).to_vec(),
        e.get_host_req(2, M, 5, 128).to_vec(),
        e.get_host_resp(1, M, RetCode::Ok, Some(addr(1)), None)
            .to_vec(),
        e.get_host_resp(2, M, RetCode::Overloaded, None, level)
            .to_vec(),
        e.report_req(&report).to_vec(),
        e.report_req(&Report {
            downstream_level: None,
            consumed: 0,
            retcode: 0,
            ..report
        })
        .to_vec(),
        e.batch_report_req(6, M, &[(addr(1), 40), (addr(2), 1)])
            .to_vec(),
        e.register_req(7, M, 1_000).to_vec(),
        e.register_resp(7, M, RetCode::Ok, 42).to_vec(),
        e.get_route_req(8, M).to_vec(),
        e.get_route_resp(8, M, RetCode::Ok, 42, &status).to_vec(),
        e.get_route_resp(8, M, RetCode::NoSuchModule, 0, &[])
            .to_vec(),
        e.cache_get_route_req(9, M, 41).to_vec(),
        e.cache_get_route_resp(&CacheRoute {
            seq: 9,
            module: M,
            retcode: RetCode::Ok,
            version: 42,
            unchanged: false,
            any_overloaded: true,
            nodes: &nodes,
        })
        .to_vec(),
        e.error_resp(10, M, RetCode::WrongShard, "module [100, 7] is shard 3's")
            .to_vec(),
        e.pull_req(11, &[M, ModuleId::new(1, 2)]).to_vec(),
        e.route_answer(11, M, true, 42, &nodes).to_vec(),
        e.route_push(M, false, 43, &[]).to_vec(),
        e.keep_alive(12).to_vec(),
        e.keep_alive_ack(12).to_vec(),
        e.stats_report(13, 0x0a00_0001, 1_700_000_000, &modules)
            .to_vec(),
        e.stats_ack(13).to_vec(),
        e.pull_req_known(14, &[M, ModuleId::new(1, 2)], &[42, 0])
            .to_vec(),
        e.route_unchanged(14, &[M], &[42]).to_vec(),
    ]
}

/// One record of each kind of the shared memory's fixed layout
/// ([`lbagent::shm::fixed`]).
pub fn fixed_records() -> Vec<Vec<u8>> {
    use lbagent::shm::fixed::{self, HostAnswer, Request};
    let g = Request::GetHost(lbagent::wire::GetHost {
        seq: 1,
        module: M,
        business_priority: 5,
        user_priority: 128,
    });
    let r = Request::Report(Report {
        seq: 2,
        module: M,
        host: addr(1),
        retcode: -1,
        tcost_ms: 30,
        downstream_level: Some(AdmissionLevel::new(3, 9)),
        consumed: 2,
    });
    let mut out = Vec::new();
    // Each without and with the node hint.
    for (req, hint) in [
        (g, fixed::Hint::None),
        (r, fixed::Hint::None),
        (g, fixed::Hint::Ask),
        (r, fixed::Hint::Node(3)),
    ] {
        let mut b = [0u8; fixed::MAX_LEN];
        let n = fixed::encode_request_hinted(&req, hint, &mut b);
        out.push(b[..n].to_vec());
    }
    let mut a = [0u8; fixed::HOST_ANSWER_LEN];
    fixed::encode_answer(
        &HostAnswer {
            seq: 1,
            module: M,
            retcode: lbagent::wire::RetCode::Ok,
            host: Some(addr(2)),
            level: Some(AdmissionLevel::new(10, 50)),
        },
        &mut a,
    );
    out.push(a.to_vec());
    let mut h = [0u8; fixed::ANSWER_MAX];
    let n = fixed::write_answer(
        &mut h,
        1,
        M,
        lbagent::wire::RetCode::Ok,
        Some(addr(2)),
        None,
        Some(1),
    );
    out.push(h[..n].to_vec());
    out
}

/// Writes every target's corpus under `dir/TARGET/`.
///
/// # Errors
/// When a directory or file cannot be written.
pub fn write_all(dir: &Path) -> io::Result<()> {
    let put = |target: &str, name: String, bytes: &[u8]| -> io::Result<()> {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(name), bytes)
    };
    let messages = messages();
    for (i, m) in messages.iter().enumerate() {
        put("datagram", format!("msg{i:02}"), m)?;
    }
    for (i, r) in fixed_records().iter().enumerate() {
        put("datagram", format!("fixed{i:02}"), r)?;
    }
    for (i, m) in hot_requests().iter().enumerate() {
        put("hot", format!("hot{i:02}"), m)?;
    }
    // Frame streams: a chunk-size byte, then a few frames; one cut short.
    for (i, group) in messages.chunks(4).enumerate() {
        let mut stream = vec![i as u8 * 7];
        for m in group {
            write_frame(&mut stream, m).map_err(io::Error::other)?;
        }
        put("frame", format!("stream{i:02}"), &stream)?;
        if i == 0 {
            stream.truncate(stream.len() - 3);
            put("frame", "cut".into(), &stream)?;
        }
    }

    let scratch = dir.join(".scratch");
    std::fs::create_dir_all(&scratch)?;
    let infos = [
        (
            1,
            8888,
            Ipv4Addr::LOCALHOST,
            "/var/lib/lbagent/routes.snapshot",
        ),
        (8, 9000, Ipv4Addr::UNSPECIFIED, "/tmp/r"),
        (1_024, 64_512, Ipv4Addr::new(10, 0, 0, 1), ""),
    ];
    for (i, (shards, base_port, bind, snap)) in infos.into_iter().enumerate() {
        let path = scratch.join(format!("hb{i}"));
        let w = HeartbeatWriter::create(
            &path,
            &AgentInfo {
                shards,
                base_port,
                bind,
                pid: 4242,
                snapshot_path: snap.into(),
            },
        )
        .map_err(io::Error::other)?;
        w.beat(1_700_000_000_000);
        drop(w);
        let bytes = std::fs::read(&path)?;
        // Only the header is read: the rest of the page is left out.
        put(
            "heartbeat",
            format!("hb{i}"),
            &bytes[..heartbeat::HEADER_LEN],
        )?;
    }

    let snapshots: [Vec<SnapshotRoute>; 3] = [
        vec![],
        vec![SnapshotRoute {
            module: M,
            version: 3,
            nodes: route_nodes(2),
            meta: Vec::new(),
        }],
        vec![
            SnapshotRoute {
                module: ModuleId::new(1, 1),
                version: 1,
                nodes: vec![],
                meta: Vec::new(),
            },
            SnapshotRoute {
                module: M,
                version: 9,
                nodes: route_nodes(5),
                meta: Vec::new(),
            },
            SnapshotRoute {
                module: ModuleId::new(100, 8),
                version: 2,
                nodes: route_nodes(1),
                meta: Vec::new(),
            },
        ],
    ];
    for (i, routes) in snapshots.iter().enumerate() {
        let path = scratch.join(format!("snap{i}"));
        snapshot::write(&path, 1_700_000_000, routes).map_err(io::Error::other)?;
        put("snapshot", format!("snap{i}"), &std::fs::read(&path)?)?;
    }
    std::fs::remove_dir_all(&scratch)?;

    let shipped = include_str!("../../../src/config/lbagent.toml");
    put("config", "shipped".into(), shipped.as_bytes())?;
    put(
        "config",
        "small".into(),
        b"[agent]\nshards = 4\nbase_port = 8888\nroute_servers = [\"127.0.0.1:7787\"]\n",
    )?;
    put(
        "config",
        "overrides".into(),
        b"[lb]\nprobe_num = 3\n\0agent.shards=2\nlb.succ_rate=0.5\n",
    )?;
    Ok(())
}
