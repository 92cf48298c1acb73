//! Route change → push latency at a large table, and what the route
//! server's store thread costs while nothing changes.
//!
//! A NODES-node table (modules of 10 nodes) is imported into a fresh store:
//! SQLite in a temporary directory, or PostgreSQL (a fresh schema, dropped
//! afterwards) when the first argument is `postgres` and
//! `LBAGENT_TEST_POSTGRES_URL` names a database. The route server runs
//! in-process at its default settings (only the listen and metrics ports
//! are picked by the OS); one client connection pulls module 0, which
//! subscribes it.
//!
//! - **Idle:** for IDLE seconds nothing changes; the store thread's CPU
//!   (`lbagent-dns-store`, user + system, from /proc) as a share of one
//!   core, and this process's RSS sampled every 50 ms (min and max: a
//!   full reload shows as the max).
//! - **Latency:** ROUNDS times, after a random pause of 100 to 400 ms (so
//!   that the change falls anywhere in the poll cycle), one admin
//!   connection adds or deletes a node of module 0 (one transaction); the
//!   time from the commit's return to the RoutePush's arrival at the
//!   client. Median, min and max.
//!
//! Run: `cargo bench --bench route_push_latency -- [sqlite|postgres]
//! [NODES] [ROUNDS] [IDLE]` (defaults sqlite, 1000000, 15, 12).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use lbagent::config::DnsServerConfig;
use lbagent::dnsserver::DnsServer;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::qpstest::cpu::named_threads_cpu_seconds;
use lbagent::store::{self, StoreUrl};
use lbagent::wire::{decode, write_frame, Encoder, FrameDecoder, Limits, Message};

const PER_MODULE: u32 = 10;
const TARGET: ModuleId = ModuleId::new(0, 1);

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let backend = args.first().map_or("sqlite", String::as_str).to_string();
    let arg = |i: usize, default: u64| -> u64 {
        args.get(i).map_or(default, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i} `{s}` is not a number"))
        })
    };
    let nodes = arg(1, 1_000_000) as u32;
    let rounds = arg(2, 15) as usize;
    let idle = arg(3, 12);
    assert!(nodes >= PER_MODULE && rounds > 0);

    let dir = tempfile::tempdir().expect("a temporary directory");
    let (url, _schema) = match backend.as_str() {
        "sqlite" => (StoreUrl::Sqlite(dir.path().join("routes.db")), None),
        "postgres" => {
            let s = Schema::new();
            (StoreUrl::Postgres(s.url.clone()), Some(s))
        }
        other => panic!("backend `{other}`: use sqlite or postgres"),
    };

    let modules = nodes / PER_MODULE;
    let rows: Vec<(ModuleId, RouteNode)> = (0..modules)
        .flat_map(|m| {
            (1..=PER_MODULE).map(move |n| {
                let node = RouteNode {
                    addr: NodeAddr::new(
                        Ipv4Addr::new(10, (m >> 16) as u8, (m >> 8) as u8, m as u8),
                        9000 + n as u16,
                    ),
                    weight: 1,
                };
                (ModuleId::new(m, 1), node)
            })
        })
        .collect();
    let t0 = Instant::now();
    let mut admin = store::open(&url).expect("the store opens");
    admin.import_routes(&rows, false).expect("import the table");
    drop(rows);
    println!(
        "{backend}: {modules} modules x {PER_MODULE} nodes imported in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    let cfg = DnsServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..DnsServerConfig::default()
    };
    println!(
        "route server defaults: poll_interval_ms {}, full_reload_interval {:?}",
        cfg.poll_interval_ms,
        full_reload_of(&cfg)
    );
    let t0 = Instant::now();
    let server = DnsServer::start(&cfg, url).expect("the route server starts");
    let mut client = Client::connect(server.addr());
    client.pull(TARGET);
    println!(
        "first load and answer in {:.2} s",
        t0.elapsed().as_secs_f64()
    );

    // Idle.
    let cpu0 = store_cpu_s();
    let t0 = Instant::now();
    let mut rss = Vec::new();
    let mut said = Instant::now();
    while t0.elapsed() < Duration::from_secs(idle) {
        rss.push(rss_mib());
        if said.elapsed() > Duration::from_secs(5) {
            client.keep_alive();
            said = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let cpu = store_cpu_s() - cpu0;
    let secs = t0.elapsed().as_secs_f64();
    rss.sort_by(f64::total_cmp);
    println!(
        "idle {secs:.0} s: store thread CPU {:.2} s = {:.1}% of a core; RSS min {:.0} MiB, max {:.0} MiB",
        cpu,
        100.0 * cpu / secs,
        rss[0],
        rss[rss.len() - 1]
    );

    // Latency.
    let extra = NodeAddr::new(Ipv4Addr::new(192, 168, 0, 1), 8080);
    let mut lat = Vec::new();
    for round in 0..rounds {
        // The connection stays alive however long the rounds take.
        client.keep_alive();
        std::thread::sleep(Duration::from_millis(100 + fastrand::u64(0..300)));
        let c0 = Instant::now();
        let version = if round % 2 == 0 {
            admin
                .add_node(
                    TARGET,
                    RouteNode {
                        addr: extra,
                        weight: 1,
                    },
                )
                .expect("add a node")
        } else {
            admin.del_node(TARGET, extra).expect("delete a node")
        };
        let committed = Instant::now();
        client.push(TARGET, version);
        let ms = committed.elapsed().as_secs_f64() * 1e3;
        println!(
            "round {round}: commit {:.1} ms, commit -> push {ms:.1} ms",
            (committed - c0).as_secs_f64() * 1e3
        );
        lat.push(ms);
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "{backend} {nodes} nodes: commit -> push median {:.1} ms (min {:.1}, max {:.1}) over {rounds} rounds",
        lat[lat.len() / 2],
        lat[0],
        lat[lat.len() - 1]
    );
    server.stop().expect("the route server stops");
}

/// The full-reload setting as configured (its type differs across
/// versions of the config: printed as is).
fn full_reload_of(cfg: &DnsServerConfig) -> impl std::fmt::Debug + '_ {
    &cfg.full_reload_interval
}

/// One subscribed connection.
struct Client {
    stream: TcpStream,
    frames: FrameDecoder,
    buf: Vec<u8>,
}

impl Client {
    fn connect(addr: std::net::SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).expect("connect to the route server");
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Client {
            stream,
            frames: FrameDecoder::default(),
            buf: vec![0u8; 64 << 10],
        }
    }

    /// Pulls `module` (which subscribes) and waits for its answer.
    fn pull(&mut self, module: ModuleId) {
        let mut out = Vec::new();
        write_frame(&mut out, Encoder::new().pull_req(1, &[module])).unwrap();
        self.stream.write_all(&out).expect("send the pull");
        self.wait(|m| matches!(m, Message::RouteAnswer(a) if a.seq() == 1 && a.exists()));
    }

    /// Sends a keep-alive (the server closes a connection silent for
    /// `idle_timeout`); its ack is skipped by the next wait.
    fn keep_alive(&mut self) {
        let mut out = Vec::new();
        write_frame(&mut out, Encoder::new().keep_alive(0)).unwrap();
        self.stream.write_all(&out).expect("send a keep-alive");
    }

    /// Waits for the push of `module` at `version`.
    fn push(&mut self, module: ModuleId, version: u64) {
        self.wait(|m| {
            matches!(m, Message::RoutePush(p)
                if ModuleId::new(p.modid(), p.cmdid()) == module && p.version() >= version)
        });
    }

    fn wait(&mut self, done: impl Fn(&Message<'_>) -> bool) {
        loop {
            while let Some(frame) = self.frames.next_frame().expect("framed") {
                let msg = decode(frame, &Limits::TCP_FRAME).expect("a valid message");
                if done(&msg) {
                    return;
                }
            }
            let n = self
                .stream
                .read(&mut self.buf)
                .expect("read from the server");
            assert!(n > 0, "the route server closed the connection");
            self.frames.feed(&self.buf[..n]);
        }
    }
}

/// A fresh PostgreSQL schema, dropped on drop.
struct Schema {
    base: String,
    name: String,
    url: String,
}

impl Schema {
    fn new() -> Schema {
        let base = std::env::var("LBAGENT_TEST_POSTGRES_URL")
            .expect("postgres: set LBAGENT_TEST_POSTGRES_URL (tools/ci-postgres.sh prints one)");
        let name = format!("lbagent_perf_push_{}", std::process::id());
        let mut c = ::postgres::Client::connect(&base, ::postgres::NoTls).expect("connect");
        c.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {name} CASCADE; CREATE SCHEMA {name};"
        ))
        .expect("create the schema");
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-csearch_path%3D{name}");
        Schema { base, name, url }
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Ok(mut c) = ::postgres::Client::connect(&self.base, ::postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name));
        }
    }
}

/// CPU seconds (user + system) of the route server's store thread.
fn store_cpu_s() -> f64 {
    // comm is cut at 15 bytes: `lbagent-dns-sto`.
    named_threads_cpu_seconds(std::process::id(), |c| c.starts_with("lbagent-dns-sto"))
        .map(|(s, _)| s)
        .expect("/proc/self/task")
}

/// This process's resident set, MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}
