//! The tool commands (`lbagent gethost`, `report`, `getroute`) as library
//! functions: against the real agent binary, against a fake agent on
//! loopback, and with no agent at all. Checks what they print and their
//! exit status. Every wait is bounded.

#[path = "support/common.rs"]
mod common;

#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/routesrc.rs"]
mod routesrc;

use common::{unix_ms, wait_for};
use std::net::{Ipv4Addr, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lbagent::client_tools::{
    self as tools, AgentConnArgs, GethostArgs, GetrouteArgs, ReportArgs, ToolOutcome,
    EXIT_AGENT_DOWN, EXIT_BAD_ARGUMENT, EXIT_BAD_RESPONSE, EXIT_NO_SUCH_MODULE, EXIT_OK,
    EXIT_OVERLOADED, EXIT_REJECTED, EXIT_STATIC_ROUTES, EXIT_TIMEOUT,
};
use lbagent::host::heartbeat::{AgentInfo, HeartbeatReader, HeartbeatWriter};
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};
use routesrc::RouteSource;
use serde_json::Value;

const M: ModuleId = ModuleId::new(200, 3);

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 2, 0, i), 8080)
}

fn nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 2,
        })
        .collect()
}

/// The timeout of a tool call an agent (real, or the fake one's thread)
/// must answer: 5 s, not 500 ms, so that a stall of a loaded machine
/// delays the answer instead of turning it into a timeout (no call of
/// these helpers is meant to time out; the one that is sets its own).
const ANSWERED_MS: u64 = 5000;

fn conn(dir: &Path, timeout_ms: u64) -> AgentConnArgs {
    AgentConnArgs {
        heartbeat: Some(dir.join("heartbeat")),
        snapshot: Some(dir.join("routes.snapshot")),
        timeout_ms,
    }
}

fn gethost(dir: &Path, m: ModuleId, json: bool) -> ToolOutcome {
    tools::gethost(&GethostArgs {
        modid: m.modid,
        cmdid: m.cmdid,
        json,
        priority: None,
        user: None,
        user_hash_seed: None,
        config: None,
        key: None,
        select: None,
        conn: conn(dir, ANSWERED_MS),
    })
}

fn getroute(dir: &Path, m: ModuleId, json: bool) -> ToolOutcome {
    tools::getroute(&GetrouteArgs {
        modid: m.modid,
        cmdid: m.cmdid,
        json,
        conn: conn(dir, ANSWERED_MS),
    })
}

fn report(dir: &Path, m: ModuleId, n: NodeAddr, retcode: i32, json: bool) -> ToolOutcome {
    tools::report(&ReportArgs {
        modid: m.modid,
        cmdid: m.cmdid,
        node: n,
        retcode,
        tcost: 250,
        downstream_level: None,
        consume: None,
        json,
        conn: conn(dir, ANSWERED_MS),
    })
}

/// The one JSON object on stdout.
fn json_of(out: &ToolOutcome) -> Value {
    assert_eq!(out.stdout.lines().count(), 1, "one line: {out:?}");
    serde_json::from_str(out.stdout.trim()).expect("valid JSON")
}

/// The real agent binary, heartbeat and snapshot in `dir`.
struct AgentProc(Child);

impl AgentProc {
    fn start(dir: &Path, source: &RouteSource) -> AgentProc {
        AgentProc::start_with(dir, source, "")
    }

    /// [`AgentProc::start`] with more lines of the `[agent]` table.
    fn start_with(dir: &Path, source: &RouteSource, agent_lines: &str) -> AgentProc {
        let config = dir.join("lbagent.toml");
        let text = format!(
            "[agent]\nbase_port = 0\nshards = 1\nroute_servers = [\"{}\"]\n\
             reporters = [\"127.0.0.1:1\"]\nheartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\n\
             metrics_addr = \"127.0.0.1:0\"\n{agent_lines}",
            source.addr(),
            dir.join("heartbeat").display(),
            dir.join("routes.snapshot").display()
        );
        std::fs::write(&config, text).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_lbagent"))
            .args(["agent", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start lbagent agent");
        let pid = child.id();
        let agent = AgentProc(child);
        wait_for(Duration::from_secs(10), || {
            let h = HeartbeatReader::open(&dir.join("heartbeat"))
                .ok()?
                .read()
                .ok()?;
            (h.info.pid == pid && h.beat_unix_ms > 0).then_some(())
        })
        .expect("the agent beats within 10 s");
        agent
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `lbagent ARGS... --heartbeat .. --snapshot ..`: the binary's exit code
/// and stdout.
fn tool_binary(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lbagent"))
        .args(args)
        .arg("--heartbeat")
        .arg(dir.join("heartbeat"))
        .arg("--snapshot")
        .arg(dir.join("routes.snapshot"))
        .args(["--timeout-ms", "2000"])
        .output()
        .expect("run lbagent");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A route source serving `M` on one node and a real agent in `d` that
/// answers `lbagent gethost` for it (gethost registers on first use; the
/// route arrives within the wait).
fn agent_serving_m(d: &Path) -> (RouteSource, AgentProc) {
    let source = RouteSource::start();
    source.set_route(M, &nodes(1));
    let agent = AgentProc::start(d, &source);
    let (m, c) = (M.modid.to_string(), M.cmdid.to_string());
    wait_for(Duration::from_secs(10), || {
        (tool_binary(d, &["gethost", &m, &c]).0 == i32::from(EXIT_OK)).then_some(())
    })
    .expect("the route arrives");
    (source, agent)
}

#[test]
fn a_reported_downstream_level_makes_the_real_agent_reject_lower_priorities() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_source, _agent) = agent_serving_m(d);
    let (modid, cmdid) = (M.modid.to_string(), M.cmdid.to_string());
    let (m, c) = (modid.as_str(), cmdid.as_str());
    let n = node(1).to_string();
    let (code, out) = tool_binary(
        d,
        &["report", m, c, &n, "0", "--downstream-level", "10,128"],
    );
    assert_eq!(code, i32::from(EXIT_OK), "{out}");
    // The level lives admission.level_timeout_ms (3 s): both asks come
    // well within it on any machine, each a single short exchange.
    let (code, out) = tool_binary(d, &["gethost", m, c, "--priority", "20", "--user", "u1"]);
    assert_eq!(code, i32::from(EXIT_REJECTED), "{out}");
    let (code, out) = tool_binary(d, &["gethost", m, c, "--priority", "5", "--user", "u1"]);
    assert_eq!((code, out.trim()), (i32::from(EXIT_OK), n.as_str()));
    // A bad level is refused by the argument parser.
    let (code, _) = tool_binary(d, &["report", m, c, &n, "0", "--downstream-level", "0,7"]);
    assert_ne!(code, i32::from(EXIT_OK));
}

/// The user priority `U` of `user` now, under `seed` and `period_s`, with
/// the period number it belongs to.
fn user_u(seed: u64, period_s: u64, user: &str) -> (u8, u64) {
    let now = unix_ms() / 1000;
    let mut keys = lbagent::admission::UserPriorities::new(seed, period_s);
    (keys.priority(user.as_bytes(), now), keys.period_of(now))
}

#[test]
fn the_client_hashes_user_ids_and_gethost_takes_the_key_from_its_config() {
    use lbagent::admission::AdmissionLevel;
    use lbagent::client::{Client, ClientError, ClientOptions};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_source, _agent) = agent_serving_m(d);
    let (modid, cmdid) = (M.modid.to_string(), M.cmdid.to_string());
    let (m, c) = (modid.as_str(), cmdid.as_str());
    let n = node(1);
    let (seed, period) = (99u64, 86_400u64);
    let defaults = lbagent::config::AdmissionConfig::default();
    let t = Duration::from_millis(ANSWERED_MS);

    // The Rust client: its own hash under its options' seed and period.
    let mut client = Client::with_options(ClientOptions {
        heartbeat_path: d.join("heartbeat"),
        snapshot_path: d.join("routes.snapshot"),
        user_hash_seed: seed,
        user_key_period_s: period,
        ..ClientOptions::default()
    })
    .unwrap();
    let (u, _) = user_u(seed, period, "alice");
    assert_eq!(client.user_priority(b"alice"), u);
    // A level (10, 128) from the downstream: business 20 is shed at the
    // caller, business 5 gets the node.
    client
        .report_with_level(
            M.modid,
            M.cmdid,
            n,
            0,
            3,
            Some(AdmissionLevel::new(10, 128)),
        )
        .unwrap();
    let e = client
        .get_host_for_user(M.modid, M.cmdid, 20, b"alice", t)
        .unwrap_err();
    assert!(matches!(e, ClientError::Rejected { .. }), "{e}");
    let h = client
        .get_host_for_user(M.modid, M.cmdid, 5, b"alice", t)
        .unwrap();
    assert_eq!(h.addr, n);

    // gethost --user hashes with --config's seed and key period: a user
    // whose U under the config is below its U under the packaged defaults,
    // and a level (10, U under the config) between them: admitted with
    // --config, rejected without.
    let config = d.join("service.toml");
    std::fs::write(
        &config,
        format!("[admission]\nuser_hash_seed = {seed}\nuser_key_period_s = {period}\n"),
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let mut checked = false;
    // A period that ends between the hash and the call changes U: try again.
    for _attempt in 0..3 {
        let before = (0..1000)
            .map(|i| format!("user-{i}"))
            .map(|id| {
                let (uc, pc) = user_u(seed, period, &id);
                let (ud, pd) = user_u(defaults.user_hash_seed, defaults.user_key_period_s, &id);
                (id, uc, ud, (pc, pd))
            })
            .find(|(_, uc, ud, _)| uc < ud)
            .expect("some user hashes lower under the config's key");
        let (id, uc, _, periods) = before;
        client
            .report_with_level(M.modid, M.cmdid, n, 0, 3, Some(AdmissionLevel::new(10, uc)))
            .unwrap();
        let with = tool_binary(
            d,
            &[
                "gethost",
                m,
                c,
                "--priority",
                "10",
                "--user",
                &id,
                "--config",
                cfg,
            ],
        );
        let without = tool_binary(d, &["gethost", m, c, "--priority", "10", "--user", &id]);
        let (_, pc) = user_u(seed, period, &id);
        let (_, pd) = user_u(defaults.user_hash_seed, defaults.user_key_period_s, &id);
        if (pc, pd) != periods {
            continue;
        }
        assert_eq!(
            (with.0, with.1.trim()),
            (i32::from(EXIT_OK), n.to_string().as_str())
        );
        assert_eq!(without.0, i32::from(EXIT_REJECTED), "{}", without.1);
        checked = true;
        break;
    }
    assert!(checked, "three key periods ended during the test");
    // An unusable config file is named, exit 78.
    let out = Command::new(env!("CARGO_BIN_EXE_lbagent"))
        .args(["gethost", m, c, "--user", "u1", "--config"])
        .arg(d.join("missing.toml"))
        .arg("--heartbeat")
        .arg(d.join("heartbeat"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.toml"));
}

/// Issue 31: `gethost --key K` answers the key's node in the Maglev table
/// of the module's nodes, every time, and the keys spread over the nodes.
#[test]
fn gethost_with_a_key_answers_the_keys_node_in_the_maglev_table() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let source = RouteSource::start();
    let route = nodes(6);
    source.set_route(M, &route);
    let _agent = AgentProc::start(d, &source);
    let (m, c) = (M.modid.to_string(), M.cmdid.to_string());
    wait_for(Duration::from_secs(10), || {
        (tool_binary(d, &["gethost", &m, &c]).0 == i32::from(EXIT_OK)).then_some(())
    })
    .expect("the route arrives");
    // The agent's nodes are in address order: the table is built over them.
    let mut ids: Vec<NodeAddr> = route.iter().map(|n| n.addr).collect();
    ids.sort();
    let keys: Vec<u64> = ids.iter().map(|a| a.key()).collect();
    let table = lbagent::lb::maglev::Maglev::new(&keys);
    let mut seen = std::collections::BTreeSet::new();
    for k in 0..12 {
        let key = format!("session-{k}");
        let want = ids[table
            .home(lbagent::model::key_hash(key.as_bytes()))
            .unwrap()];
        for _ in 0..2 {
            let (code, out) = tool_binary(d, &["gethost", &m, &c, "--key", &key]);
            assert_eq!(code, i32::from(EXIT_OK), "{out}");
            assert_eq!(out.trim(), want.to_string(), "key {key}");
        }
        seen.insert(want);
    }
    assert!(seen.len() >= 3, "12 keys went to {seen:?}");
}

/// Issue 31: the route's zones and labels reach the real agent; an agent
/// in zone a answers zone a's nodes, `gethost --select` the labelled ones.
#[test]
fn a_zoned_agent_and_gethost_select_follow_the_routes_zones_and_labels() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let source = RouteSource::start();
    let meta: Vec<(NodeAddr, lbagent::model::NodeMeta)> = (1..=6)
        .map(|i| {
            let zone = if i <= 3 { "a" } else { "b" };
            let version = if i % 3 == 2 { "canary" } else { "stable" };
            let m = lbagent::model::NodeMeta {
                zone: Some(zone.parse().unwrap()),
                labels: format!("version={version}").parse().unwrap(),
            };
            (node(i), m)
        })
        .collect();
    source.set_route_meta(M, &nodes(6), &meta);
    let _agent = AgentProc::start_with(d, &source, "zone = \"a\"\n");
    let (m, c) = (M.modid.to_string(), M.cmdid.to_string());
    wait_for(Duration::from_secs(10), || {
        (tool_binary(d, &["gethost", &m, &c]).0 == i32::from(EXIT_OK)).then_some(())
    })
    .expect("the route arrives");
    let zone_a = [node(1), node(2), node(3)].map(|n| n.to_string());
    for _ in 0..6 {
        let (code, out) = tool_binary(d, &["gethost", &m, &c]);
        assert_eq!(code, i32::from(EXIT_OK), "{out}");
        assert!(
            zone_a.contains(&out.trim().to_string()),
            "{out} is not in zone a"
        );
    }
    let canaries = [node(2), node(5)].map(|n| n.to_string());
    for _ in 0..4 {
        let (code, out) = tool_binary(d, &["gethost", &m, &c, "--select", "version=canary"]);
        assert_eq!(code, i32::from(EXIT_OK), "{out}");
        assert!(
            canaries.contains(&out.trim().to_string()),
            "{out} is no canary"
        );
    }
    // No node matches: the default fallback, any node.
    let (code, out) = tool_binary(d, &["gethost", &m, &c, "--select", "version=gamma"]);
    assert_eq!(code, i32::from(EXIT_OK), "{out}");
    // A selector out of bounds never leaves the command line.
    let (code, _) = tool_binary(d, &["gethost", &m, &c, "--select", "version"]);
    assert_eq!(code, 2);
}

#[test]
fn gethost_report_and_getroute_against_the_real_agent() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let source = RouteSource::start();
    source.set_route(M, &nodes(2));
    let _agent = AgentProc::start(d, &source);

    // The first ask makes the agent pull; until the route is there:
    // "no such module", exit 3 (or, on a loaded machine where the new
    // agent answers late, a timeout, exit 8).
    let first = gethost(d, M, true);
    if first.code == EXIT_NO_SUCH_MODULE {
        assert_eq!(json_of(&first)["error"], "no_such_module");
    } else if first.code != EXIT_OK {
        assert_eq!(first.code, EXIT_TIMEOUT, "{first:?}");
    }
    let ok = wait_for(Duration::from_secs(5), || {
        let o = gethost(d, M, false);
        (o.code == EXIT_OK).then_some(o)
    })
    .expect("the route arrives");
    let host: NodeAddr = ok.stdout.trim().parse().expect("A.B.C.D:PORT");
    assert!(host == node(1) || host == node(2));
    assert!(ok.stderr.is_empty(), "{ok:?}");
    let j = json_of(&gethost(d, M, true));
    assert_eq!(j["source"], "agent");
    assert_eq!(j["port"], 8080);
    assert_eq!(j["modid"], 200);

    let r = report(d, M, node(1), 0, false);
    assert_eq!(r.code, EXIT_OK, "{r:?}");
    assert!(
        r.stdout.contains("reported success of 10.2.0.1:8080"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("vsucc 181"), "{}", r.stdout);
    let r = report(d, M, node(1), -7, true);
    assert_eq!(r.code, EXIT_OK, "{r:?}");
    let j = json_of(&r);
    assert_eq!(j["retcode"], -7);
    // 250 ms counts errcnt = 250 / 100 = 2: virtual errors, real errors and
    // consecutive failures all grow by 2, as in the original.
    assert_eq!(j["status"]["rerr"], 2);
    assert_eq!(j["status"]["verr"], 2, "250 ms counts 250 / 100 errors");
    assert_eq!(j["status"]["contin_err"], 2);

    let stranger = NodeAddr::new(Ipv4Addr::new(10, 9, 9, 9), 1);
    let r = report(d, M, stranger, 0, false);
    assert_eq!(r.code, EXIT_BAD_ARGUMENT, "{r:?}");
    assert!(
        r.stderr.contains("not in module [200, 3]'s route"),
        "{}",
        r.stderr
    );

    let t = getroute(d, M, false);
    assert_eq!(t.code, EXIT_OK, "{t:?}");
    let lines: Vec<&str> = t.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{}", t.stdout);
    assert!(lines[0].contains("2 nodes, 0 overloaded"), "{}", lines[0]);
    assert!(lines[1].starts_with("NODE"));
    let j = json_of(&getroute(d, M, true));
    let route = j["nodes"].as_array().unwrap();
    assert_eq!(route.len(), 2);
    let n1 = route.iter().find(|n| n["host"] == "10.2.0.1:8080").unwrap();
    assert_eq!(
        (n1["rsucc"].as_u64(), n1["rerr"].as_u64()),
        (Some(1), Some(2)),
        "one success; one failure of 250 ms counting 2 real errors"
    );
    assert_eq!(n1["state"], "idle");
    assert_eq!(n1["weight"], 2);

    let unknown = ModuleId::new(1, 999);
    let e = getroute(d, unknown, false);
    assert_eq!(e.code, EXIT_NO_SUCH_MODULE, "{e:?}");
    assert!(e
        .stderr
        .starts_with("lbagent getroute: no such module [1, 999]"));
}

#[test]
fn with_no_agent_the_tools_say_so_and_gethost_answers_from_the_route_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let e = gethost(d, M, true);
    assert_eq!(e.code, EXIT_STATIC_ROUTES, "{e:?}");
    let j = json_of(&e);
    assert_eq!(j["error"], "static_routes");
    assert!(j["message"].as_str().unwrap().contains("does not exist"));
    let e = getroute(d, M, false);
    assert_eq!(e.code, EXIT_AGENT_DOWN, "{e:?}");
    assert!(e.stderr.contains("is the agent running?"), "{}", e.stderr);
    let e = report(d, M, node(1), 0, true);
    assert_eq!(e.code, EXIT_AGENT_DOWN, "{e:?}");
    assert_eq!(json_of(&e)["error"], "agent_down");

    let route = SnapshotRoute {
        module: M,
        version: 1,
        nodes: nodes(1),
        meta: Vec::new(),
    };
    snapshot::write(&d.join("routes.snapshot"), 1, &[route]).unwrap();
    let ok = gethost(d, M, false);
    assert_eq!(ok.code, EXIT_OK, "{ok:?}");
    assert_eq!(ok.stdout, "10.2.0.1:8080\n");
    assert!(ok.stderr.contains("static route file"), "{}", ok.stderr);
    assert_eq!(json_of(&gethost(d, M, true))["source"], "static_routes");
    assert_eq!(
        gethost(d, ModuleId::new(5, 5), false).code,
        EXIT_STATIC_ROUTES
    );
}

/// A fake agent whose only shard answers every request with what `answer`
/// makes of it, beating its heartbeat every 20 ms.
struct FakeAgent {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl FakeAgent {
    fn start(dir: &Path, answer: fn(&mut Encoder, Message<'_>) -> Option<Vec<u8>>) -> FakeAgent {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let writer = HeartbeatWriter::create(
            &dir.join("heartbeat"),
            &AgentInfo {
                shards: 1,
                base_port: sock.local_addr().unwrap().port(),
                bind: Ipv4Addr::LOCALHOST,
                pid: std::process::id(),
                snapshot_path: dir.join("routes.snapshot"),
            },
        )
        .unwrap();
        writer.beat(unix_ms());
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let beat = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                writer.beat(unix_ms());
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let s = stop.clone();
        let serve = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            let mut enc = Encoder::new();
            while !s.load(Ordering::SeqCst) {
                let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let msg = decode(&buf[..n], &Limits::UDP).unwrap();
                if let Some(a) = answer(&mut enc, msg) {
                    let _ = sock.send_to(&a, peer);
                }
            }
        });
        FakeAgent {
            stop,
            threads: vec![beat, serve],
        }
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[test]
fn overloaded_timeout_and_bad_response_have_their_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fake = FakeAgent::start(d, |enc, msg| match msg {
        Message::GetHostReq(r) => {
            let m = ModuleId::new(r.modid(), r.cmdid());
            Some(
                enc.get_host_resp(r.seq(), m, RetCode::Overloaded, None, None)
                    .to_vec(),
            )
        }
        Message::GetRouteReq(r) if r.cmdid() == 1 => Some(b"garbage, not an answer".to_vec()),
        _ => None,
    });
    let e = gethost(d, M, false);
    assert_eq!(e.code, EXIT_OVERLOADED, "{e:?}");
    assert!(e.stderr.contains("overloaded"), "{}", e.stderr);

    let e = getroute(d, ModuleId::new(7, 1), true);
    assert_eq!(e.code, EXIT_BAD_RESPONSE, "{e:?}");
    assert_eq!(json_of(&e)["error"], "bad_response");

    let t0 = Instant::now();
    let e = tools::getroute(&GetrouteArgs {
        modid: 7,
        cmdid: 2,
        json: false,
        conn: conn(d, 150),
    });
    assert_eq!(e.code, EXIT_TIMEOUT, "{e:?}");
    assert!(t0.elapsed() >= Duration::from_millis(150));
    assert!(
        e.stderr.contains("no answer from the agent"),
        "{}",
        e.stderr
    );
    drop(fake);
}
