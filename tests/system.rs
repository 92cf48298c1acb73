//! The whole system end to end, through the real binary: `lbagent
//! dnsserver` on the embedded store, `lbagent agent`, `lbagent route
//! add|del|list`, and `lbagent standalone`. Every process binds loopback
//! ports the OS picks and says which in its log (a route server restarted
//! binds its old port again, retried while another process holds it);
//! every wait is bounded.

#[path = "support/common.rs"]
mod common;
#[path = "support/udpclient.rs"]
mod udpclient;

use common::{addr_after, http_get, spawn_logged, wait_for, wait_logged};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use udpclient::Client;

use lbagent::host::heartbeat::HeartbeatReader;
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::store::{self, StoreUrl};
use lbagent::wire::RetCode;

const BIN: &str = env!("CARGO_BIN_EXE_lbagent");

/// A child process killed when dropped.
struct Proc(Child);

impl Proc {
    /// `lbagent ARGS`, its log in the file `log` ([`spawn_logged`]).
    fn spawn(args: &[&str], log: &Path) -> Proc {
        let child = spawn_logged(Command::new(BIN).args(args).stdout(Stdio::null()), log)
            .unwrap_or_else(|e| panic!("start lbagent {args:?}: {e}"));
        Proc(child)
    }

    fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `lbagent route ...` against `store`; returns the finished process.
fn route(store: &str, args: &[&str]) -> Output {
    let mut all = vec!["route"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--store", store]);
    Command::new(BIN)
        .args(&all)
        .output()
        .expect("run lbagent route")
}

fn route_ok(store: &str, args: &[&str]) {
    let out = route(store, args);
    assert!(
        out.status.success(),
        "lbagent route {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts `lbagent dnsserver` on `listen` with its log in `log`; the
/// process and the address it serves pulls on, as it logged it (so a port
/// another process holds is never taken for this server's), or why it did
/// not start, with its log.
fn try_dnsserver(
    store: &str,
    listen: SocketAddr,
    log: &Path,
) -> Result<(Proc, SocketAddr), String> {
    let listen = format!("dnsserver.listen={listen}");
    let mut p = Proc::spawn(
        &[
            "dnsserver",
            "--store",
            store,
            "--set",
            &listen,
            "--set",
            "dnsserver.metrics_addr=127.0.0.1:0",
        ],
        log,
    );
    let addr = wait_logged(&mut p.0, log, Duration::from_secs(20), |l| {
        addr_after(l, "serving pulls on ")
    })?;
    Ok((p, addr))
}

/// A route server on a port the OS picks, its log in `dir`.
fn dnsserver(store: &str, dir: &Path) -> (Proc, SocketAddr) {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    try_dnsserver(store, any, &dir.join("dnsserver.log"))
        .unwrap_or_else(|e| panic!("the route server starts within 20 s: {e}"))
}

/// A route server again on `addr`, the port of one that was killed (the
/// agent's config names it). While it was down, another process (a test
/// beside this one binding port 0 or connecting out) may have been handed
/// the port: the server retries for 3 s itself, and this starts it again
/// for up to 30 s, until whatever took the port lets go.
fn restart_dnsserver(store: &str, addr: SocketAddr, dir: &Path) -> Proc {
    let log = dir.join("dnsserver.log");
    let t0 = Instant::now();
    loop {
        match try_dnsserver(store, addr, &log) {
            Ok((p, got)) => {
                assert_eq!(got, addr, "the route server is back on its port");
                return p;
            }
            Err(e) if e.contains("address in use") && t0.elapsed() < Duration::from_secs(30) => {
                eprintln!("port {} still taken; starting again", addr.port());
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("the route server restarts on {addr}: {e}"),
        }
    }
}

/// Writes an agent config into `dir` and starts `lbagent agent`; returns
/// the process and its first shard's UDP port, once the heartbeat shows it.
fn agent(dir: &Path, route_server: SocketAddr, reporter: &str) -> (Proc, u16) {
    let heartbeat = dir.join("heartbeat");
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[lb]\nreport_timeout = 1\n[agent]\nbase_port = 0\nshards = 1\n\
             route_servers = [\"{route_server}\"]\nreporters = [\"{reporter}\"]\n\
             heartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\nmetrics_addr = \"127.0.0.1:0\"\n",
            heartbeat.display(),
            dir.join("routes.snapshot").display()
        ),
    )
    .unwrap();
    let p = Proc::spawn(
        &["agent", "--config", config.to_str().unwrap()],
        &dir.join("agent.log"),
    );
    let port = wait_heartbeat(&heartbeat, p.pid());
    (p, port)
}

/// Waits for a heartbeat written by `pid`; returns its base port.
fn wait_heartbeat(path: &Path, pid: u32) -> u16 {
    wait_for(Duration::from_secs(15), || {
        let h = HeartbeatReader::open(path).ok()?.read().ok()?;
        (h.info.pid == pid && h.beat_unix_ms > 0).then_some(h.info.base_port)
    })
    .expect("the agent writes its heartbeat within 15 s")
}

/// The set of hosts 40 getHosts return, sorted (empty when the module is
/// not served).
fn hosts(udp: &mut Client, m: ModuleId) -> Vec<NodeAddr> {
    let mut seen = Vec::new();
    for _ in 0..40 {
        if let (RetCode::Ok, Some(h)) = udp.get_host(m) {
            if !seen.contains(&h) {
                seen.push(h);
            }
        }
    }
    seen.sort();
    seen
}

fn addr(s: &str) -> NodeAddr {
    s.parse().unwrap()
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite:{}", dir.join("lbagent.db").display())
}

const M: ModuleId = ModuleId::new(4001, 7);

/// How long a pushed route change may take to reach the agent: well under
/// the agent's 15 s re-pull (update_timeout), so that what arrives was
/// pushed, and long enough that a stall of a busy machine cannot fail it.
const PUSHED: Duration = Duration::from_secs(10);

#[test]
fn route_changes_reach_a_subscribed_agent_within_2_s_and_survive_a_route_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_url(dir.path());
    let (mut server, server_addr) = dnsserver(&store, dir.path());
    let (_agent, udp_port) = agent(dir.path(), server_addr, "127.0.0.1:1");
    let mut udp = Client::new(udp_port);

    // The first getHost makes the agent ask; the route server has nothing.
    assert_eq!(udp.get_host(M).0, RetCode::NoSuchModule);
    std::thread::sleep(Duration::from_millis(300));

    // The agent re-pulls an absent module only after update_timeout (15 s),
    // so a route seen within PUSHED (10 s) was pushed. A push takes tens of
    // milliseconds (printed below); the margin is for a stall of a busy
    // machine, which must not fail the test.
    let t0 = Instant::now();
    route_ok(&store, &["add", "4001", "7", "10.9.0.1:80"]);
    wait_for(PUSHED, || {
        (hosts(&mut udp, M) == vec![addr("10.9.0.1:80")]).then_some(())
    })
    .unwrap_or_else(|| panic!("route add did not reach the agent in {PUSHED:?}"));
    eprintln!("route add reached the agent in {:?}", t0.elapsed());

    let t0 = Instant::now();
    route_ok(
        &store,
        &["add", "4001", "7", "10.9.0.2:80", "--weight", "3"],
    );
    wait_for(PUSHED, || {
        (hosts(&mut udp, M) == vec![addr("10.9.0.1:80"), addr("10.9.0.2:80")]).then_some(())
    })
    .expect("the second node reaches the agent within PUSHED");
    eprintln!("second node in {:?}", t0.elapsed());

    // Deleting every node: the agent answers "no such module".
    route_ok(&store, &["del", "4001", "7", "10.9.0.1:80"]);
    route_ok(&store, &["del", "4001", "7", "10.9.0.2:80"]);
    wait_for(PUSHED, || {
        (udp.get_host(M).0 == RetCode::NoSuchModule).then_some(())
    })
    .expect("deleting the last node reaches the agent within PUSHED");

    // Killing the route server: the agent keeps answering from its routes.
    route_ok(&store, &["add", "4001", "7", "10.9.0.3:80"]);
    wait_for(PUSHED, || {
        (hosts(&mut udp, M) == vec![addr("10.9.0.3:80")]).then_some(())
    })
    .expect("the re-added node reaches the agent within PUSHED");
    server.kill9();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        assert_eq!(
            udp.get_host(M),
            (RetCode::Ok, Some(addr("10.9.0.3:80"))),
            "the agent answers from its routes while the route server is down"
        );
    }

    // A change made while the server is down arrives once it is back.
    route_ok(&store, &["add", "4001", "7", "10.9.0.4:80"]);
    let _server = restart_dnsserver(&store, server_addr, dir.path());
    let t0 = Instant::now();
    wait_for(Duration::from_secs(20), || {
        (hosts(&mut udp, M) == vec![addr("10.9.0.3:80"), addr("10.9.0.4:80")]).then_some(())
    })
    .expect("after the restart the agent reconnects and gets the later change");
    eprintln!("reconnected and updated in {:?}", t0.elapsed());
}

#[test]
fn route_admin_refuses_bad_input_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_url(dir.path());
    route_ok(&store, &["add", "5", "5", "10.0.0.1:80", "--create"]);
    let before = route(&store, &["list", "--json"]);
    assert!(before.status.success());

    let refused: &[(&[&str], &str)] = &[
        (&["add", "5", "5", "10.0.0.300:80"], "address"),
        (&["add", "5", "5", "10.0.0.2:0"], "port"),
        (&["add", "5", "5", "10.0.0.2:65536"], "port"),
        (&["add", "5", "5", "10.0.0.2"], "PORT"),
        (&["add", "5", "5", "10.0.0.1:80"], "already has"),
        (&["del", "5", "5", "10.0.0.9:80"], "has no node"),
        (&["del", "6", "6", "10.0.0.1:80"], "has no node"),
        (&["add", "x", "5", "10.0.0.2:80"], "invalid"),
        (&["list", "5"], "CMDID"),
        (&["add", "5", "5", "0.0.0.0:80"], "unspecified"),
        (&["add", "5", "5", "255.255.255.255:80"], "broadcast"),
        (&["add", "5", "5", "224.0.0.1:80"], "multicast"),
        (&["add", "5", "5", "10.0.0.2:80", "--weight", "0"], "weight"),
        (
            &["add", "5", "5", "10.0.0.2:80", "--weight", "1000001"],
            "weight",
        ),
    ];
    for (args, says) in refused {
        let out = route(&store, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "route {args:?} was accepted");
        let usage = args.iter().any(|a| {
            *a == "--weight"
                || ["0.0.0.0:", "255.255.255.255:", "224."]
                    .iter()
                    .any(|p| a.starts_with(p))
        });
        if usage {
            assert_eq!(
                out.status.code(),
                Some(2),
                "route {args:?}: a bad command line: {err}"
            );
        }
        assert!(
            err.contains(says),
            "route {args:?}: the error should mention {says:?}: {err}"
        );
        assert!(
            err.trim().lines().count() <= 3,
            "route {args:?}: a short error, got {err}"
        );
    }
    let after = route(&store, &["list", "--json"]);
    assert_eq!(
        before.stdout, after.stdout,
        "refused commands changed nothing"
    );

    let list: serde_json::Value = serde_json::from_slice(&after.stdout).unwrap();
    let modules = list["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 1);
    assert_eq!(modules[0]["modid"], 5);
    assert_eq!(modules[0]["nodes"][0]["node"], "10.0.0.1:80");

    let text = route(&store, &["list", "5", "5"]);
    assert!(text.status.success());
    assert!(String::from_utf8_lossy(&text.stdout).contains("10.0.0.1:80"));
}

#[test]
fn route_commands_never_create_a_store_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let mistyped = format!("sqlite:{}", dir.path().join("lbagnet.db").display());
    for args in [
        &["list"][..],
        &["add", "1", "1", "10.0.0.1:80"][..],
        &["del", "1", "1", "10.0.0.1:80"][..],
    ] {
        let out = route(&mistyped, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "route {args:?}: {err}");
        assert!(err.contains("does not exist"), "route {args:?}: {err}");
        assert!(err.contains("--create"), "route {args:?} says how: {err}");
        assert!(
            std::fs::read_dir(dir.path()).unwrap().next().is_none(),
            "route {args:?} created a file"
        );
    }
    route_ok(&mistyped, &["add", "1", "1", "10.0.0.1:80", "--create"]);
    let list = route(&mistyped, &["list"]);
    assert!(String::from_utf8_lossy(&list.stdout).contains("10.0.0.1:80"));
}

#[test]
fn standalone_serves_routes_added_with_route_add_and_writes_call_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let heartbeat = dir.path().join("heartbeat");
    let sets = [
        "dnsserver.listen=127.0.0.1:0".to_string(),
        "dnsserver.metrics_addr=127.0.0.1:0".to_string(),
        "reporter.listen=127.0.0.1:0".to_string(),
        "reporter.metrics_addr=127.0.0.1:0".to_string(),
        "agent.metrics_addr=127.0.0.1:0".to_string(),
        "agent.base_port=0".to_string(),
        "agent.shards=1".to_string(),
        "lb.report_timeout=2".to_string(),
        format!("agent.heartbeat_path={}", heartbeat.display()),
    ];
    let mut args = vec!["standalone", "--data", data.to_str().unwrap()];
    for s in &sets {
        args.extend_from_slice(&["--set", s]);
    }
    let log = dir.path().join("standalone.log");
    let mut standalone = Proc::spawn(&args, &log);
    let port = wait_heartbeat(&heartbeat, standalone.pid());
    // "metrics on AGENT, DNSSERVER, REPORTER; ...": the ports they got.
    let [agent_metrics, _, reporter_metrics] =
        wait_logged(&mut standalone.0, &log, Duration::from_secs(20), |l| {
            let list = l.split_once("metrics on ")?.1;
            let mut addrs = list.split(", ").map(|a| addr_after(a, ""));
            Some([addrs.next()??, addrs.next()??, addrs.next()??])
        })
        .unwrap_or_else(|e| panic!("standalone logs its metrics addresses: {e}"));
    let store = sqlite_url(&data);
    assert!(
        data.join("lbagent.db").exists(),
        "the store is created on first run"
    );

    let m = ModuleId::new(77, 1);
    let mut udp = Client::new(port);
    assert_eq!(udp.get_host(m).0, RetCode::NoSuchModule);
    route_ok(&store, &["add", "77", "1", "10.7.0.1:80"]);
    let host = wait_for(PUSHED, || match udp.get_host(m) {
        (RetCode::Ok, Some(h)) => Some(h),
        _ => None,
    })
    .expect("a route added with `lbagent route add` is served within PUSHED");
    assert_eq!(host, addr("10.7.0.1:80"));
    for _ in 0..5 {
        udp.report(m, host, 0);
    }
    udp.report(m, host, 1);
    // As in the original, a module's statistics leave with the first report
    // after report_timeout: this one carries all seven.
    std::thread::sleep(Duration::from_millis(2100));
    udp.report(m, host, 0);

    let url: StoreUrl = store.parse().unwrap();
    let rows = wait_for(Duration::from_secs(10), || {
        let mut s = store::open(&url).ok()?;
        let rows = s.call_status(Some(m)).ok()?;
        let total: u32 = rows.iter().map(|r| r.succ + r.err).sum();
        (total >= 7).then_some(rows)
    })
    .unwrap_or_else(|| {
        panic!(
            "call statistics reach the store within 10 s; agent metrics:\n{}\nreporter metrics:\n{}",
            http_get(agent_metrics, "/metrics").unwrap_or_default(),
            http_get(reporter_metrics, "/metrics").unwrap_or_default()
        )
    });
    assert!(rows.iter().all(|r| r.node == host));
    assert_eq!(rows.iter().map(|r| r.succ).sum::<u32>(), 6);
    assert_eq!(rows.iter().map(|r| r.err).sum::<u32>(), 1);
}
