//! The agent end to end: the real binary on loopback ports the OS picks, a
//! test route source speaking the real TCP protocol, a UDP client speaking
//! the real wire format. Every wait is bounded.

#[path = "support/common.rs"]
mod common;

#[path = "support/reportsink.rs"]
mod reportsink;
#[path = "support/routesrc.rs"]
mod routesrc;
#[path = "support/udpclient.rs"]
mod udpclient;

use common::{free_tcp_port, wait_for};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lbagent::agent::heartbeat::HeartbeatReader;
use lbagent::agent::snapshot;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{Encoder, RetCode};
use routesrc::RouteSource;
use udpclient::Client;

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 1, 0, i), 9000)
}

fn nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        })
        .collect()
}

struct AgentProc {
    child: Option<Child>,
    dir: PathBuf,
    config: PathBuf,
    port: u16,
    metrics: SocketAddr,
}

impl AgentProc {
    fn config_text(
        dir: &Path,
        route_server: SocketAddr,
        reporter: &str,
        shards: u32,
        metrics: SocketAddr,
    ) -> String {
        format!(
            "[lb]\nreport_timeout = 1\n[agent]\nbase_port = 0\nshards = {shards}\nroute_servers = [\"{route_server}\"]\nreporters = [\"{reporter}\"]\n\
             heartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\nsnapshot_interval = 1\nmetrics_addr = \"{metrics}\"\n",
            dir.join("heartbeat").display(),
            dir.join("routes.snapshot").display()
        )
    }

    fn start(dir: &Path, route_server: SocketAddr, shards: u32) -> AgentProc {
        Self::start_with_reporter(dir, route_server, "127.0.0.1:1", shards)
    }

    fn start_with_reporter(
        dir: &Path,
        route_server: SocketAddr,
        reporter: &str,
        shards: u32,
    ) -> AgentProc {
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_tcp_port()).parse().unwrap();
        let config = dir.join("lbagent.toml");
        std::fs::write(
            &config,
            Self::config_text(dir, route_server, reporter, shards, metrics),
        )
        .unwrap();
        let mut a = AgentProc {
            child: None,
            dir: dir.to_path_buf(),
            config,
            port: 0,
            metrics,
        };
        a.spawn();
        a
    }

    fn spawn(&mut self) {
        // A fresh heartbeat file tells us when this process is up.
        let _ = std::fs::remove_file(self.heartbeat_path());
        let child = Command::new(env!("CARGO_BIN_EXE_lbagent"))
            .args(["agent", "--config", self.config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("LBAGENT_TEST_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("start lbagent agent");
        let pid = child.id();
        self.child = Some(child);
        let hb = wait_for(Duration::from_secs(10), || {
            let r = HeartbeatReader::open(&self.heartbeat_path()).ok()?;
            let h = r.read().ok()?;
            (h.info.pid == pid && h.beat_unix_ms > 0).then_some(h)
        })
        .expect("the agent writes its heartbeat within 10 s");
        self.port = hb.info.base_port;
    }

    fn heartbeat_path(&self) -> PathBuf {
        self.dir.join("heartbeat")
    }

    fn snapshot_path(&self) -> PathBuf {
        self.dir.join("routes.snapshot")
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn sigterm(&mut self) -> (Option<i32>, Duration) {
        let mut c = self.child.take().expect("running");
        let t0 = Instant::now();
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let status = wait_for(Duration::from_secs(5), || c.try_wait().unwrap())
            .expect("exits after SIGTERM");
        (status.code(), t0.elapsed())
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A UDP client speaking the wire format, matching answers by sequence.
const M: ModuleId = ModuleId::new(100, 1);

#[test]
fn first_get_host_is_no_such_module_then_hosts_come_round_robin() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(3));
    let agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    assert_eq!(c.get_host(M), (RetCode::NoSuchModule, None));
    c.wait_route(M);
    let hosts: Vec<NodeAddr> = (0..6).map(|_| c.get_host(M).1.unwrap()).collect();
    for i in 0..3 {
        assert_eq!(hosts[i], hosts[i + 3], "round robin: {hosts:?}");
    }
    let mut distinct = hosts[..3].to_vec();
    distinct.sort();
    assert_eq!(distinct, vec![node(1), node(2), node(3)]);
    assert_eq!(source.pulls(M), 1);
}

#[test]
fn failures_overload_a_node_get_host_skips_it_but_probes_and_get_route_shows_it() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    for _ in 0..15 {
        c.report(M, node(1), 1);
    }
    c.report(M, node(2), 0);
    let route = wait_for(Duration::from_secs(2), || {
        let r = c.get_route(M);
        r.2.iter().any(|n| n.0 == node(1) && n.1).then_some(r)
    })
    .expect("node 1 becomes overloaded");
    let n1 = route.2.iter().find(|n| n.0 == node(1)).unwrap();
    let n2 = route.2.iter().find(|n| n.0 == node(2)).unwrap();
    assert_eq!(
        (n1.1, n1.2, n1.3),
        (true, 0, 5),
        "overloaded: vsucc 0, verr ovld_err_cnt"
    );
    assert_eq!(
        (n2.1, n2.2, n2.3),
        (false, 181, 0),
        "idle: init_succ_cnt + 1 success"
    );
    // As the original: 10 getHosts from the idle list, the 11th probes the
    // overloaded node, and again.
    let hosts: Vec<NodeAddr> = (0..22).map(|_| c.get_host(M).1.unwrap()).collect();
    let probes: Vec<usize> = (0..hosts.len()).filter(|&i| hosts[i] == node(1)).collect();
    assert_eq!(probes, vec![10, 21], "only probes reach node 1: {hosts:?}");
}

#[test]
fn a_route_change_at_the_source_reaches_the_agent_without_a_get_host() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    let version = source.set_route(M, &nodes(4));
    let route = wait_for(Duration::from_secs(2), || {
        let r = c.get_route(M);
        (r.1 == version).then_some(r)
    })
    .expect("the push arrives within 2 s");
    assert_eq!(route.2.len(), 4);
    assert_eq!(source.pulls(M), 1, "a push, not a pull");
    source.del_route(M);
    wait_for(Duration::from_secs(2), || {
        (c.get_host(M).0 == RetCode::NoSuchModule).then_some(())
    })
    .expect("a deleted module answers no such module");
}

#[test]
fn a_datagram_for_another_shard_gets_an_error_naming_the_owner() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    let agent = AgentProc::start(dir.path(), source.addr(), 2);
    let mut c = Client::new(agent.port);
    let other = ModuleId::new(100, 2); // (100 + 2) % 2 == 0 -> shard 0; M is shard 1
    assert_eq!(c.get_host(other).0, RetCode::NoSuchModule);
    assert_eq!(c.get_host(M).0, RetCode::WrongShard);
    let mut c1 = Client::new(agent.port + 1);
    assert_eq!(c1.get_host(M).0, RetCode::NoSuchModule);
}

#[test]
fn garbage_is_dropped_and_every_valid_request_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(3));
    let agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    let junk = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to = SocketAddr::from((Ipv4Addr::LOCALHOST, agent.port));
    let mut unknown_type = Encoder::new().keep_alive(1).to_vec();
    unknown_type[12] = 0x7f; // not a valid message any more
    let garbage: Vec<Vec<u8>> = vec![
        vec![0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 9], // the original agent aborted on this
        vec![],
        vec![0u8; 4],
        vec![0xff; 1000],
        vec![7u8; 20_000],
        unknown_type,
    ];
    for i in 0..2000 {
        for g in &garbage {
            let _ = junk.send_to(g, to);
        }
        let (code, host) = c.get_host(M);
        assert_eq!(code, RetCode::Ok, "valid request {i} answered");
        assert!(host.is_some());
    }
    // Shards ship their counters to the control core once a second.
    let malformed = wait_for(Duration::from_secs(3), || {
        let text = http_get(agent.metrics, "/metrics")?;
        let n: f64 = text
            .lines()
            .filter(|l| l.starts_with("lbagent_malformed_datagrams_total{"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum();
        (n >= 10_000.0).then_some(n)
    });
    assert!(malformed.is_some(), "the malformed datagrams are counted");
}

#[test]
fn the_heartbeat_advances_every_second_and_stops_when_the_agent_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    let mut agent = AgentProc::start(dir.path(), source.addr(), 1);
    let r = HeartbeatReader::open(&agent.heartbeat_path()).unwrap();
    let mut beats = vec![r.beat_unix_ms().unwrap()];
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1100));
        beats.push(r.beat_unix_ms().unwrap());
    }
    for w in beats.windows(2) {
        assert!(
            w[1] > w[0],
            "the heartbeat advances every second: {beats:?}"
        );
        assert!(w[1] - w[0] <= 2000, "{beats:?}");
    }
    agent.kill9();
    let last = r.beat_unix_ms().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        r.beat_unix_ms().unwrap(),
        last,
        "a dead agent's heartbeat stops"
    );
}

#[test]
fn the_snapshot_is_valid_after_kill_9_at_any_moment_and_is_loaded_on_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut source = RouteSource::start();
    source.set_route(M, &nodes(3));
    let mut agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    wait_for(Duration::from_secs(3), || {
        snapshot::read(&agent.snapshot_path())
            .ok()?
            .route(M)
            .map(|_| ())
    })
    .expect("the first snapshot is written within the interval");
    let mut seen_valid = 0;
    for i in 0..8u64 {
        std::thread::sleep(Duration::from_millis(150 + (i * 173) % 1100));
        agent.kill9();
        match snapshot::read(&agent.snapshot_path()) {
            Ok(s) => {
                seen_valid += 1;
                assert!(
                    s.route(M).is_some(),
                    "the snapshot holds the module after kill {i}: {s:?}"
                );
            }
            Err(e) => panic!("the snapshot is corrupt after kill -9: {e}"),
        }
        agent.spawn();
        // The restarted agent serves the module from the snapshot at once.
        assert_eq!(
            Client::new(agent.port).get_host(M).0,
            RetCode::Ok,
            "after restart {i}"
        );
    }
    assert!(seen_valid > 0);
    // With the route server gone, a restarted agent serves from the snapshot at once.
    source.stop();
    agent.kill9();
    agent.spawn();
    let mut c = Client::new(agent.port);
    let (code, host) = c.get_host(M);
    assert_eq!(code, RetCode::Ok, "served from the snapshot");
    assert!(nodes(3).iter().any(|n| Some(n.addr) == host));
}

#[test]
fn sigterm_writes_the_snapshot_and_exits_0_within_2_s() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let mut agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    let _ = std::fs::remove_file(agent.snapshot_path());
    let (code, took) = agent.sigterm();
    assert_eq!(code, Some(0));
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let s = snapshot::read(&agent.snapshot_path()).expect("a snapshot written at shutdown");
    assert_eq!(s.route(M).unwrap().nodes.len(), 2);
}

#[test]
fn metrics_are_served_in_prometheus_text_format() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let agent = AgentProc::start(dir.path(), source.addr(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    let text = wait_for(Duration::from_secs(3), || {
        let t = http_get(agent.metrics, "/metrics")?;
        t.contains("lbagent_modules{shard=\"0\"} 1").then_some(t)
    })
    .expect("metrics show the module within 3 s");
    for family in [
        "lbagent_requests_total{shard=\"0\",kind=\"gethost\"}",
        "lbagent_errors_total{shard=\"0\",kind=\"gethost\"}",
        "lbagent_nodes_idle{shard=\"0\"} 2",
        "lbagent_ring_drops_total",
        "lbagent_malformed_datagrams_total",
        "lbagent_route_server_connected{addr=\"",
        "lbagent_reporter_connected",
        "lbagent_heartbeat_age_seconds",
        "lbagent_gethost_service_seconds{shard=\"0\",quantile=\"0.99\"}",
    ] {
        assert!(text.contains(family), "missing {family}");
    }
    assert!(http_get(agent.metrics, "/nope")
        .unwrap_or_default()
        .is_empty());
}

/// GET `path`; the body when the status is 200.
fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

#[test]
fn call_statistics_reach_the_reporter_after_report_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let sink = reportsink::ReportSink::start();
    let agent =
        AgentProc::start_with_reporter(dir.path(), source.addr(), &sink.addr().to_string(), 1);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    for _ in 0..3 {
        c.report(M, node(1), 0);
    }
    c.report(M, node(2), 1);
    // report_timeout is 1 s: a report after it sends the module's statistics.
    std::thread::sleep(Duration::from_millis(1100));
    c.report(M, node(2), 0);
    let stats = wait_for(Duration::from_secs(3), || {
        let all: Vec<_> = sink
            .reports()
            .into_iter()
            .flat_map(|r| r.modules)
            .filter(|(m, _)| *m == M)
            .collect();
        (!all.is_empty()).then_some(all)
    })
    .expect("statistics reach the reporter within 3 s");
    let nodes = &stats[0].1;
    let n1 = nodes.iter().find(|n| n.addr == node(1)).unwrap();
    let n2 = nodes.iter().find(|n| n.addr == node(2)).unwrap();
    assert_eq!((n1.succ, n1.err), (3, 0));
    assert_eq!((n2.succ, n2.err), (1, 1));
}
