//! Mutual TLS between hosts (issue 26), through the binary: the route
//! server and the reporter refuse plain TCP and certificates that are
//! expired, not yet valid, of another CA or of another name, each with a
//! log line naming why; the reporter stores the caller the certificate
//! names and takes consumed units only from identities on
//! `tls.consume_allow`; an agent keeps serving, with no failed call and no
//! dropped connection, while the certificates are rotated under load and a
//! route change is pushed; and the servers listen on loopback unless told
//! otherwise. Certificates are made by the test (rcgen, through
//! `lbagent_tls::testing`); every wait is bounded and generous.

#[path = "support/common.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{addr_after, http_get, spawn_logged, wait_for, wait_logged};
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::tls::testing::{TestCa, Validity};
use lbagent::tls::{Tls, TlsConfig};
use lbagent::wire::{
    decode, write_frame, Encoder, FrameDecoder, Limits, Message, ModuleStats, NodeStats,
};
use rustls::pki_types::ServerName;

/// The longest any single wait may take (a busy machine stalls).
const WAIT: Duration = Duration::from_secs(30);

/// The server's certificate names: its address and a host name.
const SERVER_NAMES: &[&str] = &["127.0.0.1", "server.fleet.test"];

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lbagent"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run lbagent")
}

fn run_ok(args: &[&str]) -> Output {
    let out = run(args);
    assert!(
        out.status.success(),
        "lbagent {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The `[tls]` table naming `cfg`'s files, with `extra` lines.
fn tls_table(cfg: &TlsConfig, extra: &str) -> String {
    format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n{extra}\n",
        cfg.cert.display(),
        cfg.key.display(),
        cfg.ca.display()
    )
}

/// A route server or reporter process, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    metrics: SocketAddr,
    log: PathBuf,
}

impl Server {
    /// `lbagent ROLE` on loopback port 0, on the SQLite store `db`, with
    /// `tls` (a `[tls]` table, or "").
    fn start(role: &str, dir: &Path, db: &Path, tls: &str) -> Server {
        let config = dir.join(format!("{role}.toml"));
        std::fs::write(
            &config,
            format!(
                "[store]\nurl = \"sqlite:{}\"\n[{role}]\nlisten = \"127.0.0.1:0\"\nmetrics_addr = \"127.0.0.1:0\"\n{tls}",
                db.display()
            ),
        )
        .unwrap();
        let log = dir.join(format!("{role}.log"));
        let mut child = spawn_logged(
            bin()
                .args([role, "--config", config.to_str().unwrap()])
                .stdout(Stdio::null()),
            &log,
        )
        .unwrap();
        // "serving pulls on ADDR (...), metrics on http://..." (route
        // server); "listening for agents on ADDR (...), metrics at http://".
        let (addr, metrics) = wait_logged(&mut child, &log, WAIT, |l| {
            let addr = addr_after(l, "serving pulls on ")
                .or_else(|| addr_after(l, "listening for agents on "))?;
            let metrics = addr_after(l, "on http://").or_else(|| addr_after(l, "at http://"))?;
            Some((addr, metrics))
        })
        .unwrap_or_else(|e| panic!("{role} starts within {WAIT:?}: {e}"));
        Server {
            child,
            addr,
            metrics,
            log,
        }
    }

    fn metric(&self, name: &str) -> Option<f64> {
        let text = http_get(self.metrics, "/metrics")?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for a log line holding every one of `needles`; the line.
    fn wait_line(&self, needles: &[&str]) -> String {
        wait_for(WAIT, || {
            self.log_text()
                .lines()
                .find(|l| needles.iter().all(|n| l.contains(n)))
                .map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("a line with {needles:?}; the log:\n{}", self.log_text()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking TLS client with `cfg`'s files, to `addr` (checked as the
/// server's name).
fn tls_client(
    cfg: &TlsConfig,
    addr: SocketAddr,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let tls = Tls::load(cfg).expect("the client's files load");
    let name = ServerName::IpAddress(addr.ip().into());
    let conn = rustls::ClientConnection::new(tls.client_config(), name).unwrap();
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(WAIT)).unwrap();
    rustls::StreamOwned::new(conn, tcp)
}

/// Sends `frame` on `s` and reads one frame back; None when the
/// connection is refused or closed first.
fn ask(s: &mut impl ReadWrite, frame: &[u8]) -> Option<Vec<u8>> {
    s.write_all(frame).ok()?;
    s.flush().ok()?;
    let mut frames = FrameDecoder::default();
    let mut buf = [0u8; 4096];
    loop {
        if let Ok(Some(f)) = frames.next_frame() {
            return Some(f.to_vec());
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => frames.feed(&buf[..n]),
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// The frame each server answers: a KeepAlive (route server) or a
/// StatsReport (reporter).
fn probe(role: &str) -> Vec<u8> {
    let mut enc = Encoder::new();
    let mut out = Vec::new();
    let msg = if role == "dnsserver" {
        enc.keep_alive(7).to_vec()
    } else {
        enc.stats_report(7, 0, 1_700_000_000, &[]).to_vec()
    };
    write_frame(&mut out, &msg).unwrap();
    out
}

#[test]
fn both_servers_refuse_plain_tcp_and_bad_certificates_each_with_a_line_naming_why() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = TestCa::new("fleet");
    let other = TestCa::new("elsewhere");
    let server = ca.write(d, "server", SERVER_NAMES, Validity::Now);
    let good = ca.write(d, "agent", &["agent-1.fleet.test"], Validity::Now);
    let bad = |stem: &str, signer: &TestCa, names: &[&str], validity| {
        let mut cfg = signer.write(d, stem, names, validity);
        cfg.ca = server.ca.clone();
        cfg
    };
    let cases = [
        (
            "expired",
            bad("expired", &ca, &["agent-2.fleet.test"], Validity::Expired),
            "has expired",
        ),
        (
            "not yet valid",
            bad("early", &ca, &["agent-3.fleet.test"], Validity::NotYet),
            "not valid yet",
        ),
        (
            "another CA",
            bad("foreign", &other, &["agent-4.fleet.test"], Validity::Now),
            "wrong CA",
        ),
        (
            "another name",
            bad("intruder", &ca, &["intruder.example"], Validity::Now),
            "wrong name",
        ),
    ];
    let tls = tls_table(&server, "peer_names = [\"*.fleet.test\"]");
    for role in ["dnsserver", "reporter"] {
        let s = Server::start(role, d, &d.join("lbagent.db"), &tls);
        assert!(
            s.log_text().contains("mutual TLS"),
            "{role} says it speaks TLS"
        );
        // The fleet's agent is answered.
        let mut ok = tls_client(&good, s.addr);
        assert!(
            ask(&mut ok, &probe(role)).is_some(),
            "{role} answers the fleet's agent"
        );

        // A plain-TCP peer: nothing comes back but the close.
        let mut plain = TcpStream::connect(s.addr).unwrap();
        plain.set_read_timeout(Some(WAIT)).unwrap();
        let answer = ask(&mut plain, &probe(role));
        assert!(answer.is_none(), "{role} answers plain TCP: {answer:?}");
        s.wait_line(&[
            "refused a connection from 127.0.0.1",
            "not TLS",
            "plain TCP",
        ]);

        for (what, cfg, why) in &cases {
            let mut c = tls_client(cfg, s.addr);
            assert!(
                ask(&mut c, &probe(role)).is_none(),
                "{role} answers a certificate of {what}"
            );
            let line = s.wait_line(&["refused a connection from 127.0.0.1", why]);
            assert!(line.contains("the client's certificate"), "{role}: {line}");
        }
        let refused = wait_for(WAIT, || {
            let n = s.metric(&format!("lbagent_{role}_tls_refused_total"))?;
            (n == 5.0).then_some(n)
        });
        assert_eq!(refused, Some(5.0), "{role} counts the five refusals");
        drop(ok);
    }
}

/// One StatsReport frame: `node` of `module` with a success, and
/// `consumed` units of it consumed for good, sent as `caller`.
fn report(seq: u64, caller: u32, module: ModuleId, node: NodeAddr, consumed: u32) -> Vec<u8> {
    let nodes = [NodeStats {
        addr: node,
        succ: 5,
        err: 1,
        overloaded: false,
    }];
    let consumed = [(node, consumed)];
    let modules = [ModuleStats {
        module,
        nodes: &nodes,
        consumed: &consumed,
    }];
    let mut out = Vec::new();
    let mut enc = Encoder::new();
    write_frame(
        &mut out,
        enc.stats_report(seq, caller, 1_700_000_000, &modules),
    )
    .unwrap();
    out
}

fn is_ack(frame: &[u8], seq: u64) -> bool {
    matches!(decode(frame, &Limits::TCP_FRAME), Ok(Message::StatsAck(a)) if a.seq() == seq)
}

#[test]
fn the_reporter_stores_the_certificates_caller_and_takes_consumed_units_only_from_the_allow_list() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let db = d.join("lbagent.db");
    let url = format!("sqlite:{}", db.display());
    let module = ModuleId::new(79, 1);
    let node = NodeAddr::new(Ipv4Addr::new(10, 9, 0, 2), 80);
    run_ok(&[
        "route",
        "add",
        "79",
        "1",
        "10.9.0.2:80",
        "--weight",
        "3",
        "--create",
        "--store",
        &url,
    ]);
    run_ok(&["route", "policy", "79", "1", "balance", "--store", &url]);
    let ca = TestCa::new("fleet");
    let server = ca.write(d, "server", SERVER_NAMES, Validity::Now);
    // Both agents' certificates name 127.0.0.1, the address they connect
    // from: that is the caller stored.
    let denied = ca.write(
        d,
        "agent",
        &["agent-1.fleet.test", "127.0.0.1"],
        Validity::Now,
    );
    let allowed = ca.write(
        d,
        "trusted",
        &["trusted.fleet.test", "127.0.0.1"],
        Validity::Now,
    );
    let tls = tls_table(&server, "consume_allow = [\"trusted.fleet.test\"]");
    let s = Server::start("reporter", d, &db, &tls);

    let weight = || -> u32 {
        let url = url.parse().unwrap();
        let mut store = lbagent::store::open(&url).unwrap();
        store.list(Some(module)).unwrap()[0].nodes[0].weight
    };
    let callers = || -> Vec<u32> {
        let url = url.parse().unwrap();
        let mut store = lbagent::store::open(&url).unwrap();
        let rows = store.call_status(Some(module)).unwrap();
        rows.iter().map(|r| r.caller).collect()
    };
    // The frame says 1.1.1.1; the certificate says 127.0.0.1.
    let mut agent = tls_client(&denied, s.addr);
    let ack = ask(&mut agent, &report(1, 0x0101_0101, module, node, 2)).expect("an answer");
    assert!(is_ack(&ack, 1), "the report is acknowledged");
    let stored = wait_for(WAIT, || {
        let c = callers();
        (!c.is_empty()).then_some(c)
    })
    .expect("the row is stored");
    assert_eq!(
        stored,
        [u32::from(Ipv4Addr::LOCALHOST)],
        "the certificate's caller"
    );
    s.wait_line(&[
        "refused 1 consumed-units entries from agent-1.fleet.test",
        "tls.consume_allow",
    ]);
    assert_eq!(
        s.metric("lbagent_reporter_consumed_refused_total"),
        Some(1.0)
    );
    // Refused for good: the row is written and the capacity never moves.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        weight(),
        3,
        "consumed units of an identity off the list change nothing"
    );

    // The same report from an identity on the list consumes.
    let mut trusted = tls_client(&allowed, s.addr);
    let ack = ask(&mut trusted, &report(2, 0x0101_0101, module, node, 2)).expect("an answer");
    assert!(is_ack(&ack, 2));
    let w = wait_for(WAIT, || (weight() == 1).then_some(1));
    assert_eq!(w, Some(1), "2 of 3 units consumed by the trusted identity");
    assert_eq!(callers(), [u32::from(Ipv4Addr::LOCALHOST)]);
}

/// The agent's config: TLS with `tls`, talking to `dns` and `rep`,
/// heartbeat and snapshot in `dir`.
fn agent_config(dir: &Path, dns: SocketAddr, rep: SocketAddr, tls: &str) -> PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(
        &path,
        format!(
            "[lb]\nreport_timeout = 1\n[agent]\nbase_port = 0\nshards = 1\nroute_servers = [\"{dns}\"]\nreporters = [\"{rep}\"]\n\
             heartbeat_path = \"{}\"\nsnapshot_path = \"{}\"\nmetrics_addr = \"127.0.0.1:0\"\n{tls}",
            dir.join("heartbeat").display(),
            dir.join("routes.snapshot").display()
        ),
    )
    .unwrap();
    path
}

#[test]
fn a_certificate_rotation_under_load_fails_no_call_and_drops_no_connection() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let db = d.join("lbagent.db");
    let url = format!("sqlite:{}", db.display());
    run_ok(&[
        "route",
        "add",
        "81",
        "1",
        "10.8.0.1:80",
        "--create",
        "--store",
        &url,
    ]);
    let ca = TestCa::new("fleet");
    let server = ca.write(d, "server", SERVER_NAMES, Validity::Now);
    let agent_tls = ca.write(
        d,
        "agent",
        &["agent-1.fleet.test", "127.0.0.1"],
        Validity::Now,
    );
    let dns = Server::start("dnsserver", d, &db, &tls_table(&server, ""));
    let rep = Server::start("reporter", d, &db, &tls_table(&server, ""));
    let config = agent_config(d, dns.addr, rep.addr, &tls_table(&agent_tls, ""));
    let log = d.join("agent.log");
    let mut agent = spawn_logged(
        bin()
            .args(["agent", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null()),
        &log,
    )
    .unwrap();
    let heartbeat = d.join("heartbeat");
    let hb = heartbeat.to_str().unwrap();
    let hosts = |want: usize| {
        let out = run(&["getroute", "81", "1", "--json", "--heartbeat", hb]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (v["nodes"].as_array()?.len() == want).then_some(())
    };
    wait_for(WAIT, || hosts(1)).expect("the agent has the route over TLS");

    let qps = bin()
        .args([
            "qpstest",
            "--threads",
            "2",
            "--duration",
            "8",
            "--modid",
            "81",
            "--cmdid",
            "1",
            "--json",
            // Generous: a stalled busy machine must not turn a slow
            // answer into a failed call.
            "--timeout-ms",
            "5000",
            "--heartbeat",
            hb,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    // Rotate every certificate and key (new keys, same CA), then push a
    // route change through the live connection.
    let new_server = ca.write(d, "server", SERVER_NAMES, Validity::Now);
    ca.write(
        d,
        "agent",
        &["agent-1.fleet.test", "127.0.0.1"],
        Validity::Now,
    );
    run_ok(&["route", "add", "81", "1", "10.8.0.2:80", "--store", &url]);
    wait_for(WAIT, || hosts(2)).expect("the route change is pushed during the rotation");
    // A new connection gets the new certificate.
    let mut probe_client = tls_client(&agent_tls, dns.addr);
    assert!(ask(&mut probe_client, &probe("dnsserver")).is_some());
    let presented = probe_client.conn.peer_certificates().unwrap()[0].clone();
    let pem = std::fs::read(&new_server.cert).unwrap();
    let der: Vec<_> = rustls::pki_types::pem::PemObject::pem_slice_iter(&pem)
        .collect::<Result<Vec<rustls::pki_types::CertificateDer>, _>>()
        .unwrap();
    assert_eq!(
        presented, der[0],
        "new connections get the rotated certificate"
    );
    drop(probe_client);

    let out = qps.wait_with_output().unwrap();
    assert!(out.status.success(), "qpstest ran");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["get_hosts"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["error_total"], 0, "no failed call: {v}");
    assert_eq!(v["static_route_answers"], 0, "{v}");
    // The agent's connections were never dropped: one accepted by each
    // server, none closed.
    let closed = |s: &Server, name: &str| {
        let text = http_get(s.metrics, "/metrics").unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(
        dns.metric("lbagent_dnsserver_connections_accepted_total"),
        Some(2.0),
        "the agent's and the probe's"
    );
    assert_eq!(
        closed(&dns, "lbagent_dnsserver_connections_closed_total"),
        1.0,
        "only the probe's"
    );
    assert_eq!(rep.metric("lbagent_reporter_connections_total"), Some(1.0));
    assert!(
        rep.metric("lbagent_reporter_reports_total").unwrap_or(0.0) > 0.0,
        "statistics flowed over TLS"
    );
    let _ = agent.kill();
    let _ = agent.wait();
}

#[test]
fn the_servers_listen_on_loopback_by_default_and_plain_tcp_beyond_it_needs_insecure() {
    let defaults = lbagent::config::Config::default();
    assert!(defaults.dnsserver.listen.ip().is_loopback());
    assert!(defaults.reporter.listen.ip().is_loopback());
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for role in ["dnsserver", "reporter"] {
        let out = run_ok(&[role, "--check"]);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains(" on 127.0.0.1:"), "{role}: {said}");
        let config = d.join("open.toml");
        std::fs::write(&config, format!("[{role}]\nlisten = \"0.0.0.0:7000\"\n")).unwrap();
        let out = run(&[role, "--check", "--config", config.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{role}: plain TCP on 0.0.0.0 is refused"
        );
        assert!(
            err.contains(&format!("{role}.listen")) && err.contains("tls.insecure"),
            "{role}: {err}"
        );
        std::fs::write(
            &config,
            format!("[{role}]\nlisten = \"0.0.0.0:7000\"\n[tls]\ninsecure = true\n"),
        )
        .unwrap();
        run_ok(&[role, "--check", "--config", config.to_str().unwrap()]);
    }
    // --check reads the TLS files: a missing key is named.
    let ca = TestCa::new("fleet");
    let mut cfg = ca.write(d, "host", SERVER_NAMES, Validity::Now);
    cfg.key = d.join("missing.key");
    let config = d.join("tls.toml");
    std::fs::write(&config, tls_table(&cfg, "")).unwrap();
    for role in ["agent", "dnsserver", "reporter"] {
        let out = run(&[role, "--check", "--config", config.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{role}: {err}");
        assert!(
            err.contains("tls.key") && err.contains("missing.key"),
            "{role}: {err}"
        );
    }
    // insecure warns at start.
    let s = Server::start(
        "reporter",
        d,
        &d.join("lbagent.db"),
        "[tls]\ninsecure = true\n",
    );
    s.wait_line(&["tls.insecure = true", "plain TCP between hosts"]);
}
