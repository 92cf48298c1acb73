//! Issue 32: a reporter's StatsAck means the database committed the
//! report, and a re-sent report is stored once. Real `lbagent reporter`
//! processes on loopback, killed with SIGKILL; the agent played by the
//! test with a std socket speaking the real protocol; the store SQLite in
//! a temporary directory, and PostgreSQL too when
//! `LBAGENT_TEST_POSTGRES_URL` is set (as tests/store.rs).
//!
//! - Killed between receive and commit (the database held by a lock):
//!   no ack was given, nothing is stored; the report re-sent to the next
//!   reporter is stored, its consumed units applied once.
//! - Killed between commit and ack (the test waits for the commit and
//!   never reads the ack): the report re-sent to the next reporter is
//!   acknowledged and changes nothing: the rows hold the same values, the
//!   consumed units are not applied twice.

#[path = "support/common.rs"]
mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{addr_after, spawn_logged, wait_logged};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::store::{self, CallStatus, StoreUrl};
use lbagent::wire::{
    decode, write_frame, Encoder, FrameDecoder, Limits, Message, ModuleStats, NodeStats, RetCode,
};

/// The longest any single wait may take (a busy machine).
const WAIT: Duration = Duration::from_secs(30);

const MODULE: ModuleId = ModuleId::new(3201, 1);
const CALLER: u32 = 0x0a00_0020;
const RUN: u64 = 0x0032_0032_0032;

fn node() -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 3, 2, 1), 8080)
}

/// Report `seq` of run [`RUN`]: one node's counts, 3 units consumed.
fn report(seq: u64, time_s: u64) -> Vec<u8> {
    let nodes = [NodeStats {
        addr: node(),
        succ: 100 + seq as u32,
        err: seq as u32,
        overloaded: false,
    }];
    let consumed = [(node(), 3)];
    let modules = [ModuleStats {
        module: MODULE,
        nodes: &nodes,
        consumed: &consumed,
    }];
    let mut out = Vec::new();
    let mut enc = Encoder::new();
    write_frame(
        &mut out,
        enc.stats_report_of_run(seq, CALLER, time_s, RUN, &modules),
    )
    .unwrap();
    out
}

/// A reporter process and the address it serves agents on.
struct ReporterProc {
    child: Child,
    addr: SocketAddr,
}

impl ReporterProc {
    fn start(dir: &Path, name: &str, url: &str) -> Self {
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[store]\nurl = \"{url}\"\n[reporter]\nlisten = \"127.0.0.1:0\"\n\
                 metrics_addr = \"127.0.0.1:0\"\nretry_max_ms = 200\n"
            ),
        )
        .unwrap();
        let log = dir.join(format!("{name}.log"));
        let mut child = spawn_logged(
            Command::new(env!("CARGO_BIN_EXE_lbagent"))
                .args(["reporter", "--config", config.to_str().unwrap()])
                .stdout(Stdio::null()),
            &log,
        )
        .unwrap();
        let addr = wait_logged(&mut child, &log, WAIT, |l| {
            addr_after(l, "listening for agents on ")
        })
        .unwrap_or_else(|e| panic!("the reporter {name} starts: {e}"));
        ReporterProc { child, addr }
    }

    /// SIGKILL, and the process reaped.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for ReporterProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An agent's connection.
struct Agent {
    stream: TcpStream,
    frames: FrameDecoder,
}

impl Agent {
    fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_nodelay(true).unwrap();
        Agent {
            stream,
            frames: FrameDecoder::default(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// The next answer within `limit`: `Ok(seq)` for a StatsAck, `Err` for
    /// an ErrorResp; `None` when none came.
    fn answer(&mut self, limit: Duration) -> Option<Result<u64, (u64, RetCode)>> {
        let deadline = Instant::now() + limit;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(frame) = self.frames.next_frame().unwrap() {
                return Some(match decode(frame, &Limits::TCP_FRAME).unwrap() {
                    Message::StatsAck(a) => Ok(a.seq()),
                    Message::ErrorResp(e) => Err((e.seq(), e.retcode())),
                    other => panic!("unexpected {}", other.name()),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            match self.stream.read(&mut buf) {
                Ok(0) => panic!("the reporter closed the connection"),
                Ok(n) => self.frames.feed(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return None
                }
                Err(e) => panic!("read: {e}"),
            }
        }
    }
}

/// The capacity left on the node, and the call status rows.
fn stored(url: &StoreUrl) -> (u32, Vec<CallStatus>) {
    let mut s = store::open(url).unwrap();
    let routes = s.list(Some(MODULE)).unwrap();
    let left = routes[0].nodes.iter().find(|n| n.addr == node()).unwrap();
    (left.weight, s.call_status(Some(MODULE)).unwrap())
}

/// Polls `cond` until it holds; panics with `what` after [`WAIT`].
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What holds the database's write lock, for as long as it lives.
trait Lock {}
impl Lock for rusqlite::Connection {}
impl Lock for ::postgres::Client {}

/// The scenario, on the store at `url` (a store of its own), with
/// `lock` taking the write lock that keeps the reporter from committing.
fn killed_reporters_lose_nothing_acknowledged_and_double_nothing(
    dir: &Path,
    url: &str,
    lock: impl Fn() -> Box<dyn Lock>,
) {
    let store_url: StoreUrl = url.parse().unwrap();
    store::open(&store_url)
        .unwrap()
        .add_node(
            MODULE,
            RouteNode {
                addr: node(),
                weight: 100,
            },
        )
        .unwrap();

    // Killed between receive and commit.
    let first = ReporterProc::start(dir, "first", url);
    let held = lock();
    let mut agent = Agent::connect(first.addr);
    agent.send(&report(1, 1_700_000_001));
    assert_eq!(
        agent.answer(Duration::from_secs(2)),
        None,
        "no ack while the database cannot commit"
    );
    first.kill();
    drop(held);
    assert_eq!(stored(&store_url), (100, vec![]), "nothing was committed");

    // The agent sends it again, to the next reporter.
    let second = ReporterProc::start(dir, "second", url);
    let mut agent = Agent::connect(second.addr);
    agent.send(&report(1, 1_700_000_001));
    assert_eq!(
        agent.answer(WAIT),
        Some(Ok(1)),
        "acknowledged once committed"
    );
    let (left, rows) = stored(&store_url);
    assert_eq!(left, 97, "3 units consumed");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].succ, rows[0].err, rows[0].caller),
        (101, 1, CALLER)
    );

    // Killed between commit and ack: the test waits for the commit and
    // never reads the answer.
    agent.send(&report(2, 1_700_000_002));
    wait_until("report 2 committed", || {
        stored(&store_url).1.first().is_some_and(|r| r.succ == 102)
    });
    second.kill();
    let after_commit = stored(&store_url);
    assert_eq!(after_commit.0, 94, "report 2's units consumed once");

    let third = ReporterProc::start(dir, "third", url);
    let mut agent = Agent::connect(third.addr);
    agent.send(&report(1, 1_700_000_001));
    agent.send(&report(2, 1_700_000_002));
    let mut answers = vec![agent.answer(WAIT), agent.answer(WAIT)];
    answers.sort();
    assert_eq!(answers, [Some(Ok(1)), Some(Ok(2))]);
    let (left, rows) = stored(&store_url);
    assert_eq!(left, 94, "re-sent reports consume nothing again");
    assert_eq!(rows.len(), 1, "one row per (module, node, caller)");
    // The resend of report 1 arrived before report 2's: 2's values stand.
    assert_eq!((rows[0].succ, rows[0].ts), (102, 1_700_000_002));
    third.kill();
}

#[test]
fn killed_reporters_lose_nothing_acknowledged_and_double_nothing_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("lbagent.db");
    let url = format!("sqlite:{}", db.display());
    killed_reporters_lose_nothing_acknowledged_and_double_nothing(dir.path(), &url, || {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch("BEGIN EXCLUSIVE")
            .expect("take the write lock");
        Box::new(conn)
    });
}

#[test]
fn killed_reporters_lose_nothing_acknowledged_and_double_nothing_on_postgres() {
    let Ok(base) = std::env::var("LBAGENT_TEST_POSTGRES_URL") else {
        println!("note: LBAGENT_TEST_POSTGRES_URL is not set: skipping");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let schema = format!("lbagent_test_rcommit_{}", std::process::id());
    let sep = if base.contains('?') { '&' } else { '?' };
    let base = format!("{base}{sep}connect_timeout=30");
    let mut admin = ::postgres::Client::connect(&base, ::postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ))
        .unwrap();
    let url = format!("{base}&options=-csearch_path%3D{schema}");
    // Creates the tables, so that the lock below has them to take.
    store::open(&url.parse().unwrap()).unwrap();
    killed_reporters_lose_nothing_acknowledged_and_double_nothing(dir.path(), &url, || {
        let mut client = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
        // Held until the client drops: BEGIN without COMMIT.
        client
            .batch_execute(
                "BEGIN; LOCK TABLE server_call_status, consumed_report, route_data IN ACCESS EXCLUSIVE MODE",
            )
            .unwrap();
        Box::new(client)
    });
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .unwrap();
}

/// `Store::consume_once` on the store at `url`: a report is applied once
/// however often it comes, another report (or another run's report of the
/// same seq) is applied, and keys older than a week are forgotten.
fn consume_once_applies_each_report_once(url: &str) {
    use lbagent::store::{ReportKey, CONSUMED_REPORT_KEEP_S};
    let mut s = store::open(&url.parse().unwrap()).unwrap();
    s.add_node(
        MODULE,
        RouteNode {
            addr: node(),
            weight: 100,
        },
    )
    .unwrap();
    let entries = [(MODULE, node(), 5)];
    let key = ReportKey {
        caller: CALLER,
        agent_start: u64::MAX, // every bit of the u64 kept
        seq: 1,
    };
    let now = 1_800_000_000;
    let left = |s: &mut Box<dyn store::Store>| s.list(Some(MODULE)).unwrap()[0].nodes[0].weight;
    assert!(s.consume_once(key, &entries, now).unwrap().is_some());
    assert_eq!(s.consume_once(key, &entries, now + 1).unwrap(), None);
    assert_eq!(left(&mut s), 95, "applied once");
    let other_run = ReportKey {
        agent_start: 7,
        ..key
    };
    assert!(s.consume_once(other_run, &entries, now).unwrap().is_some());
    assert_eq!(left(&mut s), 90);
    // A week later the first key is forgotten as another report comes.
    let later = now + CONSUMED_REPORT_KEEP_S + 1;
    let next = ReportKey { seq: 2, ..key };
    assert!(s.consume_once(next, &entries, later).unwrap().is_some());
    assert!(s.consume_once(key, &entries, later).unwrap().is_some());
    assert_eq!(left(&mut s), 80, "5 units each: 95, 90, then 85 and 80");
}

#[test]
fn consume_once_applies_each_report_once_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    consume_once_applies_each_report_once(&format!(
        "sqlite:{}",
        dir.path().join("lbagent.db").display()
    ));
}

#[test]
fn consume_once_applies_each_report_once_on_postgres() {
    let Ok(base) = std::env::var("LBAGENT_TEST_POSTGRES_URL") else {
        println!("note: LBAGENT_TEST_POSTGRES_URL is not set: skipping");
        return;
    };
    let schema = format!("lbagent_test_ronce_{}", std::process::id());
    let mut admin = ::postgres::Client::connect(&base, ::postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ))
        .unwrap();
    let sep = if base.contains('?') { '&' } else { '?' };
    consume_once_applies_each_report_once(&format!("{base}{sep}options=-csearch_path%3D{schema}"));
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .unwrap();
}
