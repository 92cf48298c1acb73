//! What re-pulls of unchanged modules cost on the wire, before and after
//! versioned re-pulls, against the same route server in the same run.
//!
//! The route server runs in-process on a SQLite store holding MODULES
//! modules of 10 nodes each; nothing changes during the run. Each client
//! reaches it through a counting TCP proxy (bytes in both directions, as
//! they cross loopback). After every module was pulled once (not counted),
//! the next ROUNDS re-pull periods of PERIOD_MS are measured:
//!
//! - `before`: main's wire behaviour at its best: every module re-pulled
//!   once per period with a versionless PullReq (1024 modules per request,
//!   main's default batch), each answered by a whole RouteAnswer.
//! - `after`: the real route client (`routeclient::run`) following every
//!   module with `refresh_ms = PERIOD_MS`: its own jittered, batched
//!   re-pulls carry the versions held, and the route server names unchanged
//!   modules in one RouteUnchanged per request.
//!
//! Printed per mode: PullReq frames, modules re-pulled, nodes and bytes sent
//! by the route server, bytes sent by the client, and after/before ratios.
//! The periods are compressed (default 2 s, the agent's default is 15 s):
//! the cost per module re-pulled does not depend on the period.
//!
//! Run: `cargo bench --bench repull -- [MODULES] [PERIOD_MS] [ROUNDS]`
//! (defaults 10000, 2000, 3).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use glommio::channels::local_channel;
use glommio::LocalExecutorBuilder;
use lbagent::agent::routeclient::{self, RouteClientConfig, RouteClientEvent, RouteClientStatus};
use lbagent::config::DnsServerConfig;
use lbagent::dnsserver::DnsServer;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::store::{self, StoreUrl};
use lbagent::wire::{decode, write_frame, Encoder, FrameDecoder, Limits, Message};

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let arg = |i: usize, default: u64| -> u64 {
        args.get(i).map_or(default, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i} `{s}` is not a number"))
        })
    };
    let modules = arg(0, 10_000) as u32;
    let period = Duration::from_millis(arg(1, 2000));
    let rounds = arg(2, 3) as u32;
    assert!(modules > 0 && !period.is_zero() && rounds > 0);

    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = StoreUrl::Sqlite(dir.path().join("routes.db"));
    let mut admin = store::open(&url).expect("the store opens");
    let rows: Vec<(ModuleId, RouteNode)> = (0..modules)
        .flat_map(|m| (1..=10u8).map(move |n| (module(m), node(m, n))))
        .collect();
    admin.import_routes(&rows, true).expect("the routes import");
    drop(admin);
    let cfg = DnsServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..DnsServerConfig::default()
    };
    let server = DnsServer::start(&cfg, url).expect("the route server starts");
    let all: Vec<ModuleId> = (0..modules).map(module).collect();
    println!(
        "repull: {modules} modules x 10 nodes, {rounds} re-pull periods of {} ms measured",
        period.as_millis()
    );

    let before = before(&server, &all, period, rounds);
    println!("before: {before}");
    let after = after(&server, &all, period, rounds);
    println!("after:  {after}");
    let ratio = |a: u64, b: u64| a as f64 / b.max(1) as f64;
    println!(
        "after/before: server bytes {:.4}, client bytes {:.4}, nodes {:.4}, PullReq frames {:.2}, modules re-pulled {:.2}",
        ratio(after.server_bytes, before.server_bytes),
        ratio(after.client_bytes, before.client_bytes),
        ratio(after.nodes, before.nodes),
        ratio(after.pull_reqs, before.pull_reqs),
        ratio(after.modules, before.modules),
    );
    server.stop().expect("the route server stops");
}

fn module(m: u32) -> ModuleId {
    ModuleId::new(10_000 + m, 1)
}

fn node(m: u32, n: u8) -> RouteNode {
    RouteNode {
        addr: NodeAddr::new(Ipv4Addr::new(10, (m >> 8) as u8, m as u8, n), 9000),
        weight: 1,
    }
}

/// What one mode cost over the measured periods.
#[derive(Debug, Default)]
struct Cost {
    pull_reqs: u64,
    modules: u64,
    nodes: u64,
    unchanged: u64,
    server_bytes: u64,
    client_bytes: u64,
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} PullReq frames, {} modules re-pulled ({} unchanged), {} nodes sent, \
             {} bytes from the route server ({:.1} per module), {} bytes from the client",
            self.pull_reqs,
            self.modules,
            self.unchanged,
            self.nodes,
            self.server_bytes,
            self.server_bytes as f64 / self.modules.max(1) as f64,
            self.client_bytes
        )
    }
}

/// The route server's counters that matter here, read from its metrics.
#[derive(Clone, Copy, Debug)]
struct Counters {
    pull_reqs: u64,
    pulls: u64,
    nodes: u64,
    unchanged: u64,
}

fn counters(server: &DnsServer) -> Counters {
    let mut s = TcpStream::connect(server.metrics_addr()).expect("metrics connect");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let get = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in the route server's metrics")) as u64
    };
    Counters {
        pull_reqs: get("lbagent_dnsserver_pull_requests_total"),
        pulls: get("lbagent_dnsserver_pulls_total"),
        nodes: get("lbagent_dnsserver_answer_nodes_total"),
        unchanged: get("lbagent_dnsserver_unchanged_total"),
    }
}

/// The cost between two samples of the counters and the proxy.
fn cost(c0: Counters, c1: Counters, p0: (u64, u64), p1: (u64, u64)) -> Cost {
    Cost {
        pull_reqs: c1.pull_reqs - c0.pull_reqs,
        modules: c1.pulls - c0.pulls,
        nodes: c1.nodes - c0.nodes,
        unchanged: c1.unchanged - c0.unchanged,
        client_bytes: p1.0 - p0.0,
        server_bytes: p1.1 - p0.1,
    }
}

// === the counting proxy ===

/// A one-connection TCP proxy counting the bytes each way.
struct Proxy {
    addr: SocketAddr,
    /// Client -> server, server -> client.
    bytes: Arc<(AtomicU64, AtomicU64)>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let bytes = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let counts = bytes.clone();
        thread::spawn(move || {
            let (down, _) = listener.accept().expect("the client connects");
            let up = TcpStream::connect(upstream).expect("the route server accepts");
            let _ = (down.set_nodelay(true), up.set_nodelay(true));
            let (down2, up2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
            let c = counts.clone();
            thread::spawn(move || pump(down2, up2, &c.0));
            pump(up, down, &counts.1);
        });
        Proxy { addr, bytes }
    }

    fn sample(&self) -> (u64, u64) {
        (
            self.bytes.0.load(Ordering::Relaxed),
            self.bytes.1.load(Ordering::Relaxed),
        )
    }
}

/// Copies `from` to `to`, counting, until either side closes.
fn pump(mut from: TcpStream, mut to: TcpStream, count: &AtomicU64) {
    let mut buf = vec![0u8; 64 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

// === before: main's wire behaviour ===

fn before(server: &DnsServer, all: &[ModuleId], period: Duration, rounds: u32) -> Cost {
    let proxy = Proxy::start(server.addr());
    let mut conn = TcpStream::connect(proxy.addr).unwrap();
    conn.set_nodelay(true).unwrap();
    let mut enc = Encoder::new();
    let mut frames = FrameDecoder::default();
    let mut seq = 0;
    let mut round = |conn: &mut TcpStream| {
        let mut out = Vec::new();
        for chunk in all.chunks(1024) {
            seq += 1;
            write_frame(&mut out, enc.pull_req(seq, chunk)).unwrap();
        }
        conn.write_all(&out).unwrap();
        read_answers(conn, &mut frames, all.len());
    };
    // The first pull: not counted.
    let base = counters(server).pulls;
    let start = Instant::now();
    round(&mut conn);
    let n = all.len() as u64;
    let (c0, p0) = (published(server, base + n), proxy.sample());
    for r in 1..=rounds {
        sleep_until(start + period * r);
        round(&mut conn);
    }
    sleep_until(start + period * (rounds + 1));
    let c1 = published(server, c0.pulls + u64::from(rounds) * n);
    cost(c0, c1, p0, proxy.sample())
}

/// The route server's counters once they show at least `pulls` modules
/// pulled (each executor publishes them periodically, not at once).
fn published(server: &DnsServer, pulls: u64) -> Counters {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = counters(server);
        if c.pulls >= pulls || Instant::now() >= deadline {
            return c;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Reads until `n` RouteAnswers have arrived.
fn read_answers(conn: &mut TcpStream, frames: &mut FrameDecoder, n: usize) {
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0;
    while got < n {
        while let Some(frame) = frames.next_frame().unwrap() {
            if let Ok(Message::RouteAnswer(_)) = decode(frame, &Limits::TCP_FRAME) {
                got += 1;
            }
        }
        if got < n {
            let k = conn.read(&mut buf).unwrap();
            assert!(k > 0, "the route server closed the connection");
            frames.feed(&buf[..k]);
        }
    }
}

fn sleep_until(t: Instant) {
    thread::sleep(t.saturating_duration_since(Instant::now()));
}

// === after: the route client ===

fn after(server: &DnsServer, all: &[ModuleId], period: Duration, rounds: u32) -> Cost {
    let base = counters(server).pulls;
    let proxy = Proxy::start(server.addr());
    let mut config = RouteClientConfig::new(vec![proxy.addr]);
    config.refresh_ms = period.as_millis() as u64;
    let wanted = all.to_vec();
    let routes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (routes2, stop2) = (routes.clone(), stop.clone());
    let client = thread::spawn(move || {
        let ex = LocalExecutorBuilder::default()
            .io_memory(512 << 10)
            .make()
            .expect("an executor");
        ex.run(async move {
            let (want_tx, want_rx) = local_channel::new_unbounded();
            let (event_tx, event_rx) = local_channel::new_bounded(1024);
            let shutdown = async move {
                while !stop2.load(Ordering::Relaxed) {
                    glommio::timer::sleep(Duration::from_millis(10)).await;
                }
            };
            let status = RouteClientStatus::default();
            let task = glommio::spawn_local(routeclient::run(
                config, want_rx, event_tx, shutdown, status,
            ));
            for m in wanted {
                want_tx.try_send(m).unwrap();
            }
            while let Some(ev) = event_rx.recv().await {
                if let RouteClientEvent::Route(_) = ev {
                    routes2.fetch_add(1, Ordering::Relaxed);
                }
            }
            task.await.expect("valid config");
        });
    });
    // The first pull: not counted.
    let deadline = Instant::now() + Duration::from_secs(120);
    while routes.load(Ordering::Relaxed) < all.len() as u64 {
        assert!(Instant::now() < deadline, "the first pull did not complete");
        thread::sleep(Duration::from_millis(5));
    }
    let (c0, p0) = (published(server, base + all.len() as u64), proxy.sample());
    thread::sleep(period * rounds);
    let c = cost(c0, counters(server), p0, proxy.sample());
    stop.store(true, Ordering::Relaxed);
    client.join().unwrap();
    c
}
