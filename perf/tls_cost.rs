//! What mutual TLS costs the route server and the reporter, against plain
//! TCP in the same run (issue 26: within 10%).
//!
//! Both servers run in-process at their default settings (listen and
//! metrics ports picked by the OS), first plain, then with `[tls]`
//! (certificates made here with rcgen; ECDSA P-256, rustls with ring).
//! AGENTS client connections stand in for agents, each on its own thread
//! with a blocking socket (rustls' `StreamOwned` over TLS):
//!
//! - **Push latency:** every connection pulls module 0 (and a module of
//!   its own), so module 0 has AGENTS subscribers. ROUNDS times, after a
//!   random pause of 100 to 400 ms, one admin connection adds or deletes a
//!   node of module 0; from the commit's return to the RoutePush's
//!   arrival, the median over connections and the last arrival (all
//!   AGENTS pushed), each round; reported: the median over rounds of both.
//! - **Reporter rows/s:** every connection sends REPORTS StatsReports of
//!   NODES rows, each after the previous one's StatsAck; rows acknowledged
//!   per second over the whole run. Since issue 32 an ack waits for the
//!   database's commit, so this is the committed rate (SQLite here); until
//!   then it was the ingest rate (an ack waited for the buffer only, and
//!   the rows were mostly still unwritten when the run ended).
//!
//! Beside the wall figures (which include the clients' own TLS work, on
//! the same cores), the servers' own cost: the CPU time (user + system,
//! from /proc) of the route server's executor thread over the rounds, and
//! of the reporter's executor thread while the reports flow, per million
//! rows (the executor alone: until 2026-11-27 the figure also summed the
//! store writer threads, whose 15-byte thread names were the executor's,
//! and whose SQLite work per row follows the arrival rate, not TLS).
//!
//! Run: `cargo bench --bench tls_cost -- [AGENTS] [ROUNDS] [REPORTS] [NODES]`
//! (defaults 1000, 15, 100, 100: with 20 reports a connection the
//! reporter's part lasted about a second, and its CPU ratio swung from
//! 0.86x to 1.32x between runs).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use lbagent::config::{DnsServerConfig, ReporterConfig};
use lbagent::dnsserver::DnsServer;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::qpstest::cpu::named_threads_cpu_seconds;
use lbagent::reporter::Reporter;
use lbagent::store::{self, StoreUrl};
use lbagent::tls::testing::{TestCa, Validity};
use lbagent::tls::Tls;
use lbagent::wire::{
    decode, write_frame, Encoder, FrameDecoder, Limits, Message, ModuleStats, NodeStats,
};
use rustls::pki_types::ServerName;

const TARGET: ModuleId = ModuleId::new(0, 1);

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .map(|a| a.parse().expect("numbers: AGENTS ROUNDS REPORTS NODES"))
        .collect();
    let arg = |i: usize, d: u64| args.get(i).copied().unwrap_or(d);
    let (agents, rounds) = (arg(0, 1000) as usize, arg(1, 15) as usize);
    let (reports, nodes) = (arg(2, 100) as usize, arg(3, 100) as usize);

    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("bench");
    let server = ca.write(dir.path(), "server", &["127.0.0.1"], Validity::Now);
    let agent = ca.write(
        dir.path(),
        "agent",
        &["agent.bench.test", "127.0.0.1"],
        Validity::Now,
    );
    let mut results = Vec::new();
    for tls in [false, true] {
        let what = if tls { "mutual TLS" } else { "plain TCP" };
        let (server_tls, client) = match tls {
            true => (
                Some(Tls::load(&server).unwrap()),
                Some(Tls::load(&agent).unwrap()),
            ),
            false => (None, None),
        };
        let push = push_latency(
            dir.path(),
            what,
            agents,
            rounds,
            server_tls.clone(),
            &client,
        );
        let rows = reporter_rows(
            dir.path(),
            what,
            agents,
            reports,
            nodes,
            server_tls,
            &client,
        );
        results.push((what, push, rows));
    }
    println!();
    println!("{agents} agents' connections, same run:");
    for (what, (median, last, dns_cpu), (rows, per_m)) in &results {
        println!(
            "  {what:10}: commit -> push median {median:.1} ms, all {agents} pushed {last:.1} ms, route server {dns_cpu:.1} ms CPU per round; reporter {rows:.0} rows/s, {per_m:.2} s CPU per million rows"
        );
    }
    let (plain, tls) = (&results[0], &results[1]);
    println!(
        "  TLS / plain: push median {:.2}x, all pushed {:.2}x, route server CPU {:.2}x; reporter rows/s {:.2}x, reporter CPU per row {:.2}x",
        tls.1 .0 / plain.1 .0,
        tls.1 .1 / plain.1 .1,
        tls.1 .2 / plain.1 .2,
        tls.2 .0 / plain.2 .0,
        tls.2 .1 / plain.2 .1
    );
}

// === the connections ===

/// A plain or TLS connection, blocking.
enum Conn {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Conn {
    fn open(addr: SocketAddr, tls: &Option<Arc<Tls>>) -> Conn {
        let tcp = TcpStream::connect(addr).expect("connect");
        tcp.set_nodelay(true).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        match tls {
            None => Conn::Plain(tcp),
            Some(tls) => {
                let name = ServerName::IpAddress(addr.ip().into());
                let c = rustls::ClientConnection::new(tls.client_config(), name).unwrap();
                Conn::Tls(Box::new(rustls::StreamOwned::new(c, tcp)))
            }
        }
    }

    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Conn::Plain(s) => s,
            Conn::Tls(s) => s.as_mut(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        let io = self.io();
        io.write_all(bytes).expect("write");
        io.flush().expect("flush");
    }

    /// The next frame's bytes.
    fn frame(&mut self, frames: &mut FrameDecoder, buf: &mut [u8]) -> Vec<u8> {
        loop {
            if let Some(f) = frames.next_frame().expect("well framed") {
                return f.to_vec();
            }
            let n = self.io().read(buf).expect("read");
            assert!(n > 0, "the server closed the connection");
            frames.feed(&buf[..n]);
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn framed(msg: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame(&mut out, msg).unwrap();
    out
}

// === the route server ===

fn push_latency(
    dir: &std::path::Path,
    what: &str,
    agents: usize,
    rounds: usize,
    tls: Option<Arc<Tls>>,
    client: &Option<Arc<Tls>>,
) -> (f64, f64, f64) {
    let url = StoreUrl::Sqlite(dir.join(format!("routes-{}.db", tls.is_some())));
    let mut admin = store::open(&url).unwrap();
    let rows: Vec<(ModuleId, RouteNode)> = (0..agents as u32 + 1)
        .flat_map(|m| {
            (1..=10u16).map(move |n| {
                let addr = NodeAddr::new(Ipv4Addr::new(10, (m >> 8) as u8, m as u8, 1), 9000 + n);
                (ModuleId::new(m, 1), RouteNode { addr, weight: 1 })
            })
        })
        .collect();
    admin.import_routes(&rows, false).unwrap();
    let cfg = DnsServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..DnsServerConfig::default()
    };
    let server = DnsServer::start_tls(&cfg, url, tls).expect("the route server starts");
    let addr = server.addr();
    // Each connection's thread: pull, then per round wait for the push and
    // stamp its arrival.
    let arrivals = Arc::new(Mutex::new(vec![Vec::new(); rounds]));
    let ready = Arc::new(Barrier::new(agents + 1));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..agents)
        .map(|i| {
            let (arrivals, ready, client) = (arrivals.clone(), ready.clone(), client.clone());
            std::thread::spawn(move || {
                let mut c = Conn::open(addr, &client);
                let (mut frames, mut buf) = (FrameDecoder::default(), vec![0u8; 64 << 10]);
                let mut enc = Encoder::new();
                let modules = [TARGET, ModuleId::new(i as u32 + 1, 1)];
                c.send(&framed(enc.pull_req(1, &modules)));
                let mut answered = 0;
                while answered < 2 {
                    let f = c.frame(&mut frames, &mut buf);
                    if let Ok(Message::RouteAnswer(_)) = decode(&f, &Limits::TCP_FRAME) {
                        answered += 1;
                    }
                }
                ready.wait();
                for round in 0..rounds {
                    loop {
                        let f = c.frame(&mut frames, &mut buf);
                        if let Ok(Message::RoutePush(_)) = decode(&f, &Limits::TCP_FRAME) {
                            break;
                        }
                    }
                    let at = Instant::now();
                    arrivals.lock().unwrap()[round].push(at);
                    if round % 4 == 3 {
                        c.send(&framed(enc.keep_alive(round as u64)));
                    }
                }
            })
        })
        .collect();
    ready.wait();
    println!(
        "{what}: {agents} connections subscribed in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    let extra = NodeAddr::new(Ipv4Addr::new(192, 168, 0, 1), 8080);
    let (mut medians, mut lasts) = (Vec::new(), Vec::new());
    let cpu0 = thread_cpu_s("lbagent-dns-");
    for round in 0..rounds {
        std::thread::sleep(Duration::from_millis(100 + fastrand::u64(0..300)));
        if round % 2 == 0 {
            admin
                .add_node(
                    TARGET,
                    RouteNode {
                        addr: extra,
                        weight: 1,
                    },
                )
                .unwrap();
        } else {
            admin.del_node(TARGET, extra).unwrap();
        }
        let committed = Instant::now();
        let deadline = committed + Duration::from_secs(60);
        while arrivals.lock().unwrap()[round].len() < agents {
            assert!(Instant::now() < deadline, "every push within 60 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut ms: Vec<f64> = arrivals.lock().unwrap()[round]
            .iter()
            .map(|a| a.saturating_duration_since(committed).as_secs_f64() * 1e3)
            .collect();
        ms.sort_by(f64::total_cmp);
        medians.push(ms[ms.len() / 2]);
        lasts.push(ms[ms.len() - 1]);
    }
    let cpu = thread_cpu_s("lbagent-dns-") - cpu0;
    for t in threads {
        t.join().unwrap();
    }
    server.stop().unwrap();
    medians.sort_by(f64::total_cmp);
    lasts.sort_by(f64::total_cmp);
    let (m, l) = (medians[rounds / 2], lasts[rounds / 2]);
    println!("{what}: commit -> push over {rounds} rounds: median {m:.1} ms, all pushed {l:.1} ms (medians over rounds); route server executor CPU {:.1} ms per round", cpu * 1e3 / rounds as f64);
    (m, l, cpu * 1e3 / rounds as f64)
}

// === the reporter ===

fn reporter_rows(
    dir: &std::path::Path,
    what: &str,
    agents: usize,
    reports: usize,
    nodes: usize,
    tls: Option<Arc<Tls>>,
    client: &Option<Arc<Tls>>,
) -> (f64, f64) {
    let url = StoreUrl::Sqlite(dir.join(format!("stats-{}.db", tls.is_some())));
    let cfg = ReporterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..ReporterConfig::default()
    };
    let reporter = Reporter::start_tls(&cfg, url, tls).expect("the reporter starts");
    let addr = reporter.addr();
    let ready = Arc::new(Barrier::new(agents + 1));
    let done = Arc::new(Barrier::new(agents + 1));
    let threads: Vec<_> = (0..agents)
        .map(|i| {
            let (ready, done, client) = (ready.clone(), done.clone(), client.clone());
            std::thread::spawn(move || {
                let mut c = Conn::open(addr, &client);
                let (mut frames, mut buf) = (FrameDecoder::default(), vec![0u8; 4096]);
                let stats: Vec<NodeStats> = (0..nodes)
                    .map(|n| NodeStats {
                        addr: NodeAddr::new(Ipv4Addr::new(10, 1, (n >> 8) as u8, n as u8), 80),
                        succ: 10,
                        err: 1,
                        overloaded: false,
                    })
                    .collect();
                let modules = [ModuleStats {
                    module: ModuleId::new(i as u32, 1),
                    nodes: &stats,
                    consumed: &[],
                }];
                let mut enc = Encoder::new();
                let caller = u32::from(Ipv4Addr::new(10, 2, (i >> 8) as u8, i as u8));
                let frames_out: Vec<Vec<u8>> = (0..reports)
                    .map(|k| {
                        framed(enc.stats_report(
                            k as u64,
                            caller,
                            1_700_000_000 + k as u64,
                            &modules,
                        ))
                    })
                    .collect();
                // Connected (and shaken hands) before the clock starts.
                c.send(&frames_out[0]);
                c.frame(&mut frames, &mut buf);
                ready.wait();
                for f in &frames_out[1..] {
                    c.send(f);
                    let ack = c.frame(&mut frames, &mut buf);
                    assert!(matches!(
                        decode(&ack, &Limits::TCP_FRAME),
                        Ok(Message::StatsAck(_))
                    ));
                }
                done.wait();
            })
        })
        .collect();
    ready.wait();
    let t0 = Instant::now();
    let cpu0 = thread_cpu_s("lbagent-reporte");
    let store0 = thread_cpu_s("lbagent-repw-");
    done.wait();
    let secs = t0.elapsed().as_secs_f64();
    let cpu = thread_cpu_s("lbagent-reporte") - cpu0;
    let store = thread_cpu_s("lbagent-repw-") - store0;
    for t in threads {
        t.join().unwrap();
    }
    let rows = (agents * (reports - 1) * nodes) as f64;
    let _ = reporter.stop_within(Duration::from_secs(1));
    let per_m = cpu / rows * 1e6;
    println!(
        "{what}: reporter acknowledged {rows} rows in {secs:.2} s = {:.0} rows/s; executor CPU {cpu:.2} s = {per_m:.2} s per million rows; store writers {store:.2} s CPU (apart: they write what the executor buffered, at their own pace)",
        rows / secs
    );
    (rows / secs, per_m)
}

/// CPU seconds (user + system) of this process's threads whose name
/// (as /proc keeps it, 15 bytes) starts with `prefix`.
fn thread_cpu_s(prefix: &str) -> f64 {
    named_threads_cpu_seconds(std::process::id(), |c| c.starts_with(prefix))
        .expect("/proc/self/task")
        .0
}
