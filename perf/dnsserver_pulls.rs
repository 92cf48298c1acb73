//! Route server pull throughput: pulls answered per second and per server
//! CPU-second.
//!
//! The route server runs in-process on a SQLite store in a temporary
//! directory holding MODULES modules of 10 nodes each, with THREADS serving
//! executors. The load: CONNS client threads, one TCP connection each,
//! each keeping PIPELINE PullReqs (one module each, modules in rotation) in
//! flight: every answer read is replaced by a new request, the requests of
//! one read leaving in one write. Every answer is verified (decoded, its
//! sequence number the next expected, the module present). Server CPU is
//! the user + system time of the serving executors' threads
//! (`lbagent-dns-N-…`) from /proc, so the figure that matters is pulls per
//! server CPU-second: the load generator shares this machine's cores.
//!
//! Run: `cargo bench --bench dnsserver_pulls -- [CONNS] [PIPELINE] [SECONDS]
//! [ROUNDS] [THREADS] [MODULES]` (defaults 4, 64, 3, 3, 1, 1000).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        args.get(i)
            .map(|s| {
                s.parse()
                    .unwrap_or_else(|_| panic!("argument {i} `{s}` is not a number"))
            })
            .unwrap_or(default)
    };
    let conns = arg(0, 4) as usize;
    let pipeline = arg(1, 64) as usize;
    let secs = arg(2, 3);
    let rounds = arg(3, 3) as usize;
    let threads = arg(4, 1) as u32;
    let modules = arg(5, 1000) as u32;
    assert!(conns > 0 && pipeline > 0 && secs > 0 && rounds > 0 && modules > 0);

    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = StoreUrl::Sqlite(dir.path().join("routes.db"));
    let t0 = Instant::now();
    let mut admin = store::open(&url).expect("the store opens");
    for m in 0..modules {
        for n in 1..=10u8 {
            let node = RouteNode {
                addr: NodeAddr::new(Ipv4Addr::new(10, (m >> 8) as u8, m as u8, n), 9000),
                weight: 1,
            };
            admin
                .add_node(ModuleId::new(m, 1), node)
                .expect("add a node");
        }
    }
    drop(admin);
    println!(
        "store: {modules} modules x 10 nodes written in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    let cfg = DnsServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        threads,
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..DnsServerConfig::default()
    };
    let server = DnsServer::start(&cfg, url).expect("the route server starts");
    println!(
        "pulls: {conns} connections x {pipeline} in flight, {secs} s per round, {rounds} rounds, {threads} server executor(s)"
    );
    let mut runs = Vec::new();
    for round in 0..rounds {
        let run = load(
            server.addr(),
            conns,
            pipeline,
            modules,
            Duration::from_secs(secs),
        );
        println!("round {round}: {run}");
        runs.push(run);
    }
    server.stop().expect("the route server stops");

    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let qps = median(runs.iter().map(Run::qps).collect());
    let per_cpu = median(runs.iter().map(Run::per_cpu_s).collect());
    let cpu_share = median(runs.iter().map(|r| r.server_cpu_s / r.secs).collect());
    println!(
        "median: {qps:.0} pulls/s, {per_cpu:.0} pulls per server CPU-second, server busy {:.0}% of one core per executor",
        100.0 * cpu_share / f64::from(threads.max(1))
    );
}

/// One measured round.
struct Run {
    answers: u64,
    secs: f64,
    server_cpu_s: f64,
}

impl Run {
    fn qps(&self) -> f64 {
        self.answers as f64 / self.secs
    }

    fn per_cpu_s(&self) -> f64 {
        self.answers as f64 / self.server_cpu_s.max(1e-9)
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0} pulls/s ({} answers), server CPU {:.2} s, {:.0} pulls per server CPU-second",
            self.qps(),
            self.answers,
            self.server_cpu_s,
            self.per_cpu_s()
        )
    }
}

/// Drives `conns` pipelined connections for `dur`.
fn load(addr: SocketAddr, conns: usize, pipeline: usize, modules: u32, dur: Duration) -> Run {
    let go = Arc::new(AtomicBool::new(true));
    let workers: Vec<_> = (0..conns)
        .map(|i| {
            let go = go.clone();
            std::thread::spawn(move || client(addr, i as u32, pipeline, modules, &go))
        })
        .collect();
    // Let the connections open before the clock starts.
    std::thread::sleep(Duration::from_millis(100));
    let (cpu0, t0, answers0) = (
        server_cpu_s(),
        Instant::now(),
        ANSWERS.load(Ordering::Relaxed),
    );
    std::thread::sleep(dur);
    let (cpu1, secs) = (server_cpu_s(), t0.elapsed().as_secs_f64());
    let answers1 = ANSWERS.load(Ordering::Relaxed);
    go.store(false, Ordering::Relaxed);
    for w in workers {
        w.join().expect("a client thread panicked");
    }
    Run {
        answers: answers1 - answers0,
        secs,
        server_cpu_s: cpu1 - cpu0,
    }
}

/// Answers verified by every client, published every 256 answers.
static ANSWERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One connection keeping `pipeline` pulls in flight until `go` clears.
fn client(addr: SocketAddr, id: u32, pipeline: usize, modules: u32, go: &AtomicBool) {
    let mut stream = TcpStream::connect(addr).expect("connect to the route server");
    stream.set_nodelay(true).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut enc = Encoder::new();
    let mut frames = FrameDecoder::default();
    let mut buf = vec![0u8; 64 << 10];
    let mut out = Vec::new();
    let (mut next_seq, mut expect_seq) = (1u64, 1u64);
    let module = |seq: u64| ModuleId::new((seq as u32).wrapping_add(id * 7919) % modules, 1);
    for _ in 0..pipeline {
        write_frame(&mut out, enc.pull_req(next_seq, &[module(next_seq)])).unwrap();
        next_seq += 1;
    }
    stream.write_all(&out).unwrap();
    let mut unpublished = 0u64;
    while go.load(Ordering::Relaxed) {
        let n = match stream.read(&mut buf) {
            Ok(0) => panic!("the route server closed the connection"),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => panic!("read failed: {e}"),
        };
        frames.feed(&buf[..n]);
        out.clear();
        while let Some(frame) = frames.next_frame().expect("the server frames its answers") {
            match decode(frame, &Limits::TCP_FRAME) {
                Ok(Message::RouteAnswer(a))
                    if a.seq() == expect_seq
                        && a.exists()
                        && ModuleId::new(a.modid(), a.cmdid()) == module(expect_seq) => {}
                other => panic!("unexpected answer to pull {expect_seq}: {other:?}"),
            }
            expect_seq += 1;
            unpublished += 1;
            write_frame(&mut out, enc.pull_req(next_seq, &[module(next_seq)])).unwrap();
            next_seq += 1;
        }
        if unpublished >= 256 {
            ANSWERS.fetch_add(unpublished, Ordering::Relaxed);
            unpublished = 0;
        }
        stream.write_all(&out).expect("write pulls");
    }
    ANSWERS.fetch_add(unpublished, Ordering::Relaxed);
}

/// CPU seconds (user + system) of this process's serving executor threads:
/// `lbagent-dns-N-ID` (glommio appends its executor id to the name; the
/// store and metrics threads are `lbagent-dns-store` and `-metrics`).
fn server_cpu_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut total = 0.0;
    for t in std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
    {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let serving = comm.trim().strip_prefix("lbagent-dns-").is_some_and(|n| {
            n.starts_with(|c: char| c.is_ascii_digit())
                && n.bytes().all(|b| b.is_ascii_digit() || b == b'-')
        });
        if !serving {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let (u, s): (f64, f64) = (f[11].parse().unwrap_or(0.0), f[12].parse().unwrap_or(0.0));
        total += (u + s) / ticks;
    }
    total
}
