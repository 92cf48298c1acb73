//! qpstest end to end: short runs against the floor, a real agent, and an
//! agent that is not there, through the client library on loopback.

use std::net::Ipv4Addr;
use std::time::Duration;

use lbagent::agent::runtime::Agent;
use lbagent::client::{Client, ClientOptions};
use lbagent::config::Config;
use lbagent::host::heartbeat::HeartbeatReader;
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::qpstest::{self, demo_nodes, QpsOptions, Summary, Target};
use lbagent::wire::AdmissionLevel;

fn short(target: Target) -> QpsOptions {
    QpsOptions {
        target,
        threads: 4,
        duration: Duration::from_secs(1),
        // Generous: a stall of a busy CI machine (a throttled cgroup can stop
        // every thread for hundreds of milliseconds) must not time a call out,
        // which would mark the shard and send the rest of the run to the
        // static routes.
        timeout: Duration::from_secs(5),
        ..QpsOptions::default()
    }
}

fn run_json(opts: &QpsOptions) -> (Summary, serde_json::Value) {
    let mut out = Vec::new();
    let summary = qpstest::run(opts, &mut out).expect("the run completes");
    let text = String::from_utf8(out).unwrap();
    let json = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    (summary, json)
}

#[test]
fn a_short_run_against_the_floor_answers_every_get_host() {
    let (s, json) = run_json(&QpsOptions {
        json: true,
        modules: 3,
        ..short(Target::Floor)
    });
    assert!(s.get_hosts > 0 && s.qps > 0.0, "{s}");
    assert_eq!(s.from_agent, s.get_hosts, "{s}");
    assert_eq!((s.error_total, s.static_route_answers), (0, 0), "{s}");
    assert!(s.report_errors.is_empty(), "{s}");
    assert!(s.reports > 0, "{s}");
    // At least the second asked for; the upper bound only fails a run that
    // does not stop (a stall of a busy machine can add a second or two).
    assert!((0.9..10.0).contains(&s.seconds), "{s}");
    let l = s.latency_us.expect("latency of the answered getHosts");
    assert!(l.p50 > 0.0 && l.p50 <= l.p90 && l.p90 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max);
    let cpu = s.server_cpu.as_ref().expect("the floor's CPU is known");
    assert_eq!(cpu.what, "floor thread");
    assert!(s.get_hosts_per_server_cpu_second.is_some(), "{s}");
    assert_eq!(json["target"], "floor");
    assert_eq!(json["get_hosts"].as_u64(), Some(s.get_hosts));
    assert_eq!(json["error_total"], 0);
}

#[test]
fn the_text_summary_names_every_figure() {
    let mut out = Vec::new();
    let s = qpstest::run(&short(Target::Floor), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    // At least one live line, then the summary.
    assert!(text.contains("getHost/s"), "{text}");
    for needle in [
        "qpstest floor",
        "getHost answered:",
        "not counted: static-route answers 0; errors 0: none",
        "reports:",
        "p99.9",
        "per server CPU-second",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
    assert!(s.get_hosts > 0);
}

#[test]
fn an_agent_that_is_not_there_counts_every_call_as_an_error_and_qps_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let s = qpstest::run(
        &short(Target::Heartbeat(dir.path().join("no-agent.heartbeat"))),
        &mut out,
    )
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!((s.get_hosts, s.qps), (0, 0.0), "{text}");
    assert_eq!((s.from_agent, s.from_cache), (0, 0), "{text}");
    assert!(s.latency_us.is_none(), "{text}");
    // Errors, or hosts from a static route file if this machine has one
    // at the default path: neither counts.
    assert!(s.error_total + s.static_route_answers > 0, "{text}");
    for kind in s.errors.keys() {
        assert!(
            kind == "agent_down" || kind == "static_routes",
            "unexpected kind {kind}: {text}"
        );
    }
    assert!(s.server_cpu.is_none(), "{text}");
    assert!(text.contains("errors"), "{text}");
    assert!(
        text.contains("agent_down") || text.contains("static_routes"),
        "{text}"
    );
}

/// An agent with one shard on `dir`, serving module 0 of `opts` from a
/// snapshot (no route server, no reporter), once it has beaten.
fn start_agent(dir: &std::path::Path, opts: &QpsOptions, level_timeout_ms: u64) -> Agent {
    let snap = dir.join("routes.snapshot");
    snapshot::write(
        &snap,
        0,
        &[SnapshotRoute {
            module: opts.module(0),
            version: 1,
            nodes: demo_nodes(0),
            meta: Vec::new(),
        }],
    )
    .unwrap();
    let mut config = Config::default();
    config.agent.base_port = 0;
    config.agent.shards = 1;
    config.agent.route_servers = vec!["127.0.0.1:1".into()];
    config.agent.reporters = vec!["127.0.0.1:1".into()];
    config.agent.heartbeat_path = dir.join("heartbeat");
    config.agent.snapshot_path = snap;
    config.agent.metrics_addr = (Ipv4Addr::LOCALHOST, 0).into();
    config.admission.level_timeout_ms = level_timeout_ms;
    let agent = Agent::start(&config).expect("the agent starts");
    wait_for_first_beat(&config.agent.heartbeat_path);
    agent
}

#[test]
fn a_short_run_against_a_real_agent_counts_its_answers_and_its_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let opts = short(Target::Heartbeat(dir.path().join("heartbeat")));
    let agent = start_agent(dir.path(), &opts, 3_000);
    let mut out = Vec::new();
    let s = qpstest::run(&opts, &mut out).unwrap();
    agent.stop().unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(s.get_hosts > 0, "{text}");
    assert_eq!((s.error_total, s.static_route_answers), (0, 0), "{text}");
    let cpu = s.server_cpu.as_ref().expect("the agent's CPU is known");
    assert!(cpu.what.contains("agent threads"), "{text}");
    assert!(cpu.seconds > 0.0, "{text}");
}

#[test]
fn a_priority_mix_against_an_agent_holding_a_level_counts_each_class_apart() {
    let dir = tempfile::tempdir().unwrap();
    let heartbeat = dir.path().join("heartbeat");
    let opts = QpsOptions {
        threads: 2,
        // Reports without a level would clear the nodes' levels.
        report: false,
        json: true,
        priority_mix: Some("5:0.5,20:0.5".parse().unwrap()),
        ..short(Target::Heartbeat(heartbeat.clone()))
    };
    // Levels held for a minute: the run and its setup fit well inside.
    let agent = start_agent(dir.path(), &opts, 60_000);
    // Every node of the module reports the level (10, 128): business
    // priority 20 is refused everywhere, 5 admitted.
    let mut c = Client::with_options(ClientOptions {
        heartbeat_path: heartbeat,
        ..ClientOptions::default()
    })
    .unwrap();
    let m = opts.module(0);
    c.get_host(m.modid, m.cmdid, Duration::from_secs(5))
        .expect("the module is served");
    for node in demo_nodes(0) {
        c.report_with_level(
            m.modid,
            m.cmdid,
            node.addr,
            0,
            1,
            Some(AdmissionLevel::new(10, 128)),
        )
        .unwrap();
    }
    let (s, json) = run_json(&opts);
    agent.stop().unwrap();
    let classes = &s.priority_classes;
    assert_eq!(classes.len(), 2, "{s}");
    let (high, low) = (&classes[0], &classes[1]);
    assert_eq!((high.business, low.business), (5, 20), "{s}");
    assert!(high.calls > 0 && low.calls > 0, "{s}");
    assert_eq!(
        (high.answered, high.rejected, high.other_errors),
        (high.calls, 0, 0),
        "{s}"
    );
    assert_eq!(
        (low.answered, low.rejected, low.other_errors),
        (0, low.calls, 0),
        "{s}"
    );
    assert_eq!(
        json["priority_classes"][1]["rejected"].as_u64(),
        Some(low.calls)
    );
}

/// Until the control core's first beat, clients rightly see the agent as down.
fn wait_for_first_beat(path: &std::path::Path) {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if HeartbeatReader::open(path)
            .and_then(|r| r.beat_unix_ms())
            .is_ok_and(|b| b > 0)
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the agent never beat");
}

#[test]
fn a_standalone_run_benchmarks_the_whole_system_with_the_demo_modules() {
    let mut out = Vec::new();
    let s = qpstest::run(
        &QpsOptions {
            modules: 2,
            ..short(Target::Standalone)
        },
        &mut out,
    )
    .expect("the standalone run completes");
    let text = String::from_utf8(out).unwrap();
    assert_eq!(s.info.target, "standalone", "{text}");
    assert!(s.get_hosts > 0, "{text}");
    assert_eq!((s.error_total, s.static_route_answers), (0, 0), "{text}");
    assert!(s.reports > 0 && s.report_errors.is_empty(), "{text}");
    let cpu = s.server_cpu.as_ref().expect("the agent's CPU is known");
    assert!(cpu.what.contains("agent threads"), "{text}");
}

#[test]
fn a_cached_run_counts_every_call_and_times_one_in_64() {
    let mut out = Vec::new();
    let s = qpstest::run(
        &QpsOptions {
            cache: true,
            modules: 3,
            threads: 2,
            ..short(Target::Standalone)
        },
        &mut out,
    )
    .expect("the cached run completes");
    let text = String::from_utf8(out).unwrap();
    assert!(s.info.cache, "{text}");
    assert!(s.from_cache > 0, "{text}");
    assert_eq!((s.error_total, s.static_route_answers), (0, 0), "{text}");
    // Every answered getHost was reported, and every count reached the
    // summary (the threads hand theirs over in steps).
    assert_eq!(s.reports, s.get_hosts, "{text}");
    assert!(s.report_errors.is_empty(), "{text}");
    assert!(s.latency_us.is_some(), "{text}");
    assert!(text.contains("one in 64 timed"), "{text}");
}
