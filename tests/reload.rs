//! Reloading a running agent's configuration (SIGHUP): the real binary, a
//! test route source, a UDP client; the log read from the agent's standard
//! error (JSON lines). Every wait is bounded.

#[path = "support/common.rs"]
mod common;
#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/routesrc.rs"]
mod routesrc;
#[path = "support/udpclient.rs"]
mod udpclient;

use common::{addr_after, http_get, nowhere, spawn_logged, wait_for, wait_logged};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lbagent::host::heartbeat::HeartbeatReader;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use routesrc::RouteSource;
use udpclient::Client;

const M: ModuleId = ModuleId::new(300, 1);

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 3, 0, i), 9000)
}

/// An agent (or server) process whose config file the test rewrites, and
/// whose standard error goes to a file.
struct Agent {
    /// None: the test owns the child.
    child: Option<Child>,
    pid: u32,
    config: PathBuf,
    log: PathBuf,
    metrics: SocketAddr,
    port: u16,
}

/// The config: `lb` is the `[lb]` table's extra lines, `agent` the
/// `[agent]` table's. Consecutive failures never overload (contin_err_lim
/// 1000) and windows never end within a test (clear_timeout 3600): only
/// `err_rate` decides. Metrics on port 0 (the agent says which it got in
/// its log), in every version of the file: a reload changes nothing there.
fn config_text(dir: &Path, route_server: SocketAddr, lb: &str, agent: &str) -> String {
    format!(
        "[lb]\ncontin_err_lim = 1000\nclear_timeout = 3600\n{lb}\n\
         [agent]\nbase_port = 0\nshards = 1\nroute_servers = [\"{route_server}\"]\nreporters = [\"127.0.0.1:1\"]\n\
         heartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\nmetrics_addr = \"127.0.0.1:0\"\n{agent}\n\
         [log]\nformat = \"json\"\n",
        dir.join("heartbeat").display(),
        dir.join("routes.snapshot").display()
    )
}

impl Agent {
    fn start(dir: &Path, route_server: SocketAddr, lb: &str) -> Agent {
        let config = dir.join("lbagent.toml");
        std::fs::write(&config, config_text(dir, route_server, lb, "")).unwrap();
        let log = dir.join("agent.log");
        let mut child = spawn_logged(
            Command::new(env!("CARGO_BIN_EXE_lbagent"))
                .args(["agent", "--config", config.to_str().unwrap()])
                .stdout(Stdio::null()),
            &log,
        )
        .expect("start lbagent agent");
        let pid = child.id();
        let hb = wait_for(Duration::from_secs(10), || {
            let h = HeartbeatReader::open(&dir.join("heartbeat"))
                .ok()?
                .read()
                .ok()?;
            (h.info.pid == pid && h.beat_unix_ms > 0).then_some(h)
        })
        .expect("the agent writes its heartbeat within 10 s");
        let metrics = wait_logged(&mut child, &log, Duration::from_secs(10), |l| {
            addr_after(l, "metrics on http://")
        })
        .unwrap_or_else(|e| panic!("the agent logs its metrics address within 10 s: {e}"));
        Agent {
            child: Some(child),
            pid,
            config,
            log,
            metrics,
            port: hb.info.base_port,
        }
    }

    /// A process the caller started.
    fn attach(pid: u32, config: &Path, log: &Path, metrics: SocketAddr) -> Agent {
        Agent {
            child: None,
            pid,
            config: config.to_path_buf(),
            log: log.to_path_buf(),
            metrics,
            port: 0,
        }
    }

    /// Rewrites the config file and sends SIGHUP; waits until the agent
    /// counted one more reload with `result` (ok or failed).
    fn reload(&self, text: &str, result: &str) {
        let before = self.reloads(result);
        std::fs::write(&self.config, text).unwrap();
        let _ = kill(Pid::from_raw(self.pid as i32), Signal::SIGHUP);
        wait_for(Duration::from_secs(10), || {
            (self.reloads(result) > before).then_some(())
        })
        .unwrap_or_else(|| panic!("the agent counts a {result} reload within 10 s"));
    }

    fn reloads(&self, result: &str) -> u64 {
        // Retried: a scrape that failed on a loaded machine must not read
        // as 0 (a count taken before a reload would be wrong).
        let text = wait_for(Duration::from_secs(10), || {
            http_get(self.metrics, "/metrics")
        })
        .expect("the metrics endpoint answers within 10 s");
        let key = format!("lbagent_config_reloads_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The complete log lines so far (a line being written is left for
    /// later, not read half), each parsed as JSON (panics on one that is
    /// not).
    fn log_lines(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(&self.log).unwrap();
        let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        complete
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))
            })
            .collect()
    }

    fn messages(&self) -> Vec<String> {
        self.log_lines()
            .iter()
            .filter_map(|v| v["message"].as_str().map(str::to_string))
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Reports `n` failures of node 1, then whether getRoute shows it
/// overloaded, and its verr.
fn fail(c: &mut Client, n: u32) -> (bool, u32) {
    for _ in 0..n {
        c.report(M, node(1), 1);
    }
    let (_, _, nodes) = c.get_route(M);
    let n1 = nodes.iter().find(|v| v.0 == node(1)).expect("node 1 held");
    (n1.1, n1.3)
}

fn routed(dir: &Path, lb: &str) -> (RouteSource, Agent, Client) {
    let source = RouteSource::start();
    source.set_route(
        M,
        &[1, 2].map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        }),
    );
    let agent = Agent::start(dir, source.addr(), lb);
    let mut c = Client::new(agent.port);
    c.get_host(M);
    c.wait_route(M);
    (source, agent, c)
}

#[test]
fn sighup_changes_err_rate_live_and_a_node_overloads_at_the_new_rate() {
    let dir = tempfile::tempdir().unwrap();
    // err_rate 0.5: with init_succ_cnt 180, a node overloads past 180
    // failures. 30 leave it idle (30 / 210 = 0.14).
    let (source, agent, mut c) = routed(dir.path(), "err_rate = 0.5");
    assert_eq!(fail(&mut c, 30), (false, 30), "idle at err_rate 0.5");

    // err_rate 0.1: the next failure (31 / 211 = 0.147) overloads it. The
    // parameters reach the shard through its ring after the reload is
    // counted; until then a failure only adds to verr, so report one at a
    // time until it overloads, far below the 181 the old rate needs.
    let text = config_text(dir.path(), source.addr(), "err_rate = 0.1", "");
    agent.reload(&text, "ok");
    // One failure per 50 ms: the old rate would need 151 more (7.5 s).
    let mut failures = 30;
    let mut overloaded_at = None;
    while failures < 180 {
        let (overloaded, verr) = fail(&mut c, 1);
        failures += 1;
        if overloaded {
            // Overload sets verr to ovld_err_cnt.
            assert_eq!(verr, 5, "overloaded: verr = ovld_err_cnt");
            overloaded_at = Some(failures);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let at = overloaded_at.expect("node 1 overloads before the old err_rate's 181 failures");
    assert!(at < 180, "overloaded after {at} failures");
    let msgs = agent.messages();
    assert!(
        msgs.iter().any(|m| m == "reload: applied lb.err_rate"),
        "{msgs:?}"
    );
    assert_eq!(agent.reloads("failed"), 0);
    drop(source);
}

#[test]
fn an_invalid_or_refused_reload_keeps_the_old_config() {
    let dir = tempfile::tempdir().unwrap();
    let (source, agent, mut c) = routed(dir.path(), "err_rate = 0.5");
    assert_eq!(fail(&mut c, 30), (false, 30));

    // Not TOML: refused, one line naming the file and the place.
    agent.reload("[lb\nerr_rate = 0.1\n", "failed");
    // Out of range: refused, naming the field.
    let bad = config_text(dir.path(), source.addr(), "err_rate = 7", "");
    agent.reload(&bad, "failed");
    // A field that cannot change live beside a live one: refused whole.
    let fixed = config_text(
        dir.path(),
        source.addr(),
        "err_rate = 0.1",
        "max_modules = 5000",
    );
    agent.reload(&fixed, "failed");

    // The old err_rate holds: 30 more failures (60 / 240 = 0.25 < 0.5)
    // leave the node idle.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(fail(&mut c, 30), (false, 60), "err_rate 0.5 still");
    assert_eq!(agent.reloads("ok"), 0);

    let msgs = agent.messages();
    let refused: Vec<&String> = msgs
        .iter()
        .filter(|m| m.starts_with("reload refused"))
        .collect();
    assert_eq!(refused.len(), 3, "one line per refused reload: {msgs:?}");
    let config = agent.config.display().to_string();
    assert!(
        refused[0].contains(&config),
        "the parse error names the file: {}",
        refused[0]
    );
    assert!(refused[1].contains("lb.err_rate"), "{}", refused[1]);
    assert!(
        refused[2].contains("agent.max_modules cannot change without a restart"),
        "{}",
        refused[2]
    );
    // Every line is JSON with a time, a level and the component; the
    // reload lines come from the main thread's `agent` span.
    for v in agent.log_lines() {
        assert!(v["timestamp"].is_string(), "{v}");
        assert!(v["level"].is_string(), "{v}");
        assert!(v["target"].as_str().unwrap().starts_with("lbagent"), "{v}");
    }
    let line = agent
        .log_lines()
        .into_iter()
        .find(|v| v["message"].as_str().unwrap().starts_with("reload refused"))
        .unwrap();
    assert_eq!(line["level"], "ERROR", "{line}");
    assert_eq!(line["spans"][0]["name"], "agent", "{line}");
    drop(source);
}

/// The route server and the reporter: a reload changes the log level live,
/// ignores the agent's fields, and refuses a change to their own section,
/// naming the field.
#[test]
fn the_servers_reload_the_log_level_and_refuse_their_own_fields() {
    for role in ["dnsserver", "reporter"] {
        let dir = tempfile::tempdir().unwrap();
        // Port 0 in every version of the file: the server says which port
        // it got in its log, and a reload changes nothing there.
        let text = |extra: &str, level: &str| {
            format!(
                "[store]\nurl = \"sqlite:{}\"\n[{role}]\nlisten = \"127.0.0.1:0\"\nmetrics_addr = \"127.0.0.1:0\"\n{extra}\n\
                 [log]\nformat = \"json\"\nlevel = \"{level}\"\n",
                dir.path().join("lbagent.db").display()
            )
        };
        let config = dir.path().join("lbagent.toml");
        std::fs::write(&config, text("", "info")).unwrap();
        let log = dir.path().join("server.log");
        let mut child = spawn_logged(
            Command::new(env!("CARGO_BIN_EXE_lbagent"))
                .args([role, "--config", config.to_str().unwrap()])
                .stdout(Stdio::null()),
            &log,
        )
        .unwrap();
        // "metrics on http://..." (dnsserver), "metrics at http://..."
        // (reporter): logged once it serves them.
        let metrics = wait_logged(&mut child, &log, Duration::from_secs(15), |l| {
            addr_after(l, "on http://").or_else(|| addr_after(l, "at http://"))
        })
        .unwrap_or_else(|e| panic!("{role} logs its metrics address within 15 s: {e}"));
        let server = Agent::attach(child.id(), &config, &log, metrics);

        server.reload(&text("", "debug"), "ok");
        // An agent's field: not the server's business.
        server.reload(
            &format!("{}[lb]\nerr_rate = 0.3\n", text("", "debug")),
            "ok",
        );
        server.reload(&text("idle_timeout = 77", "debug"), "failed");
        assert_eq!(server.reloads("ok"), 2, "{role}");

        let msgs = server.messages();
        assert!(
            msgs.iter().any(|m| m == "reload: applied log.level"),
            "{role}: {msgs:?}"
        );
        assert!(
            msgs.iter().any(|m| m == "reload: nothing to change"),
            "{role}: {msgs:?}"
        );
        let want = format!("reload refused: {role}.idle_timeout cannot change without a restart");
        assert!(
            msgs.iter().any(|m| m.starts_with(&want)),
            "{role}: {msgs:?}"
        );
        drop(server);
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A reload that replaces the route server list: an agent started with a
/// dead route server gets its routes from the new one.
#[test]
fn sighup_moves_the_agent_to_a_new_route_server_list() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), nowhere(), "");
    let mut c = Client::new(agent.port);
    assert_eq!(c.get_host(M).0, lbagent::wire::RetCode::NoSuchModule);

    let source = RouteSource::start();
    source.set_route(
        M,
        &[RouteNode {
            addr: node(7),
            weight: 1,
        }],
    );
    let text = config_text(dir.path(), source.addr(), "", "");
    agent.reload(&text, "ok");
    // Taken at the next connection attempt (back-off at most 5 s).
    wait_for(Duration::from_secs(20), || {
        (c.get_host(M) == (lbagent::wire::RetCode::Ok, Some(node(7)))).then_some(())
    })
    .expect("the route comes from the new route server within 20 s");
    let msgs = agent.messages();
    assert!(
        msgs.iter()
            .any(|m| m == "reload: applied agent.route_servers"),
        "{msgs:?}"
    );
}

/// `--log-level` and `--log-format` are checked like the file's fields:
/// a bad value is one line naming the field, exit 78.
#[test]
fn bad_log_flags_name_the_field() {
    for (args, field) in [
        (["agent", "--check", "--log-level", "loud"], "log.level"),
        (
            ["dnsserver", "--check", "--log-format", "xml"],
            "log.format",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_lbagent"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(field), "{err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_lbagent"))
        .args([
            "agent",
            "--check",
            "--log-level",
            "debug",
            "--log-format",
            "json",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
}
