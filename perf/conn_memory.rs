//! The route server's resident memory per subscribed connection (issue 32:
//! target at most 16 KiB with 10 modules each).
//!
//! A table of MODULES modules of 10 nodes is imported into SQLite in a
//! temporary directory; the route server runs in-process at its default
//! settings (listen and metrics ports picked by the OS). CONNS client
//! connections, opened from this process with blocking std sockets, each
//! pull 10 modules of their own (which subscribes them) and read the
//! answers; they then stay open, silent. This process's resident set
//! (VmRSS) is read before the connections and once every connection has
//! its answers; the difference over CONNS is the figure. The clients cost
//! the process no user-space memory per connection beyond a socket (one
//! read buffer is shared), so the figure is the server's, plus what the
//! kernel does not count (socket buffers are not in VmRSS).
//!
//! Run: `cargo bench --bench conn_memory -- [CONNS] [MODULES]` (defaults
//! 4000 and 40000; the process holds 2 sockets per connection, so CONNS
//! stays well under `ulimit -n` / 2).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::Instant;

use lbagent::config::DnsServerConfig;
use lbagent::dnsserver::DnsServer;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::store::{self, StoreUrl};
use lbagent::wire::{decode, write_frame, Encoder, FrameDecoder, Limits, Message};

/// Modules each connection subscribes to.
const PER_CONN: u32 = 10;

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .map(|a| a.parse().expect("numbers: CONNS MODULES"))
        .collect();
    let conns = args.first().copied().unwrap_or(4000);
    let modules = args.get(1).copied().unwrap_or(40_000).max(PER_CONN);
    let dir = tempfile::tempdir().unwrap();
    let url = StoreUrl::Sqlite(dir.path().join("routes.db"));
    let rows: Vec<(ModuleId, RouteNode)> = (0..modules)
        .flat_map(|m| {
            (1..=10u16).map(move |n| {
                let addr = NodeAddr::new(
                    Ipv4Addr::new(10, (m >> 16) as u8, (m >> 8) as u8, m as u8),
                    9000 + n,
                );
                (ModuleId::new(m, 1), RouteNode { addr, weight: 1 })
            })
        })
        .collect();
    store::open(&url)
        .unwrap()
        .import_routes(&rows, false)
        .expect("import the table");
    drop(rows);
    let cfg = DnsServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..DnsServerConfig::default()
    };
    let server = DnsServer::start(&cfg, url).expect("the route server starts");
    let mut enc = Encoder::new();
    let mut buf = vec![0u8; 64 << 10];
    // One connection first: the table is loaded and the executors warm.
    let mut warm = TcpStream::connect(server.addr()).unwrap();
    pull(&mut warm, &mut enc, &mut buf, 0);
    let before = rss_kib();
    let t0 = Instant::now();
    let mut open = Vec::with_capacity(conns as usize);
    for c in 0..conns {
        let mut s = TcpStream::connect(server.addr()).expect("connect (raise ulimit -n?)");
        pull(
            &mut s,
            &mut enc,
            &mut buf,
            (c * PER_CONN) % (modules - PER_CONN + 1),
        );
        open.push(s);
    }
    let after = rss_kib();
    let per = (after - before) / f64::from(conns);
    println!(
        "{conns} connections subscribed to {PER_CONN} modules each (of {modules}) in {:.1} s: RSS {before:.0} -> {after:.0} KiB, {per:.1} KiB per connection",
        t0.elapsed().as_secs_f64()
    );
    drop(open);
    drop(warm);
    server.stop().expect("a clean stop");
}

/// Pulls modules `first..first + PER_CONN` on `s` and reads the answers.
fn pull(s: &mut TcpStream, enc: &mut Encoder, buf: &mut [u8], first: u32) {
    let ids: Vec<ModuleId> = (first..first + PER_CONN)
        .map(|m| ModuleId::new(m, 1))
        .collect();
    let mut out = Vec::new();
    write_frame(&mut out, enc.pull_req(1, &ids)).unwrap();
    s.write_all(&out).unwrap();
    let mut frames = FrameDecoder::default();
    let mut answered = 0;
    while answered < PER_CONN {
        let n = s.read(buf).expect("the answers");
        assert!(n > 0, "the route server closed the connection");
        frames.feed(&buf[..n]);
        while let Some(f) = frames.next_frame().unwrap() {
            match decode(f, &Limits::TCP_FRAME).unwrap() {
                Message::RouteAnswer(_) => answered += 1,
                // A module changed (or the table loaded) meanwhile.
                Message::RoutePush(_) => {}
                other => panic!("unexpected {}", other.name()),
            }
        }
    }
}

/// This process's resident set, KiB.
fn rss_kib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}
