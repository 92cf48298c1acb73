//! The cached path against time driven by hand ([`Clock::manual`]): a real
//! heartbeat file and a fake agent on loopback, the client's clock (and
//! the tick the cached path reads) moved by the test. They show that going
//! by the tick and by the heartbeat deadline of the last full check still
//! notices a stale heartbeat after 2 s, refreshes a route on time, and
//! sends held successes when they are 2 s old; that a lagging tick makes
//! those deadlines late by its lag only; and that with no tick the slow
//! path keeps the same rules.

use std::net::{Ipv4Addr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::cache::{HOLD_LIMIT_MS, REFRESH_INTERVAL_MS};
use super::clock::{Clock, STOPPED};
use super::{Client, ClientError, ClientOptions, HostSource};
use lbagent_host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent_model::{ModuleId, NodeAddr, RouteNode};
use lbagent_wire::{decode, CacheRoute, Encoder, Limits, Message, RetCode};

const M: ModuleId = ModuleId::new(31, 7);
/// Every call here must be answered: generous, so a stall of the fake agent
/// (a thread of this busy process) cannot time a refresh out and send it again.
const T: Duration = Duration::from_secs(10);
/// The test's start, on both clocks (milliseconds).
const T0: u64 = 1_000_000;
const VERSION: u64 = 7;

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 9, 0, i), 80)
}

/// What the fake agent received, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Got {
    CacheGetRoute { known_version: u64 },
    Batch(Vec<(NodeAddr, u32)>),
    Report { host: NodeAddr, retcode: i32 },
    Other(&'static str),
}

/// A fake agent answering cache getRoutes with a 3-node route at
/// [`VERSION`], and the heartbeat that names it; the time is the test's.
struct Setup {
    _dir: tempfile::TempDir,
    hb_path: PathBuf,
    hb: HeartbeatWriter,
    now: Arc<AtomicU64>,
    got: Arc<Mutex<Vec<Got>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let port = sock.local_addr().unwrap().port();
        let hb_path = dir.path().join("hb");
        let hb = HeartbeatWriter::create(
            &hb_path,
            &AgentInfo {
                shards: 1,
                base_port: port,
                bind: Ipv4Addr::LOCALHOST,
                pid: 1,
                snapshot_path: dir.path().join("snapshot"),
            },
        )
        .unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (g, s) = (got.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let route: Vec<RouteNode> = (1..=3)
                .map(|i| RouteNode {
                    addr: node(i),
                    weight: 1,
                })
                .collect();
            let mut enc = Encoder::new();
            let mut buf = vec![0u8; 65_536];
            while !s.load(Ordering::Relaxed) {
                let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let (what, answer) = match decode(&buf[..n], &Limits::UDP).unwrap() {
                    Message::CacheGetRouteReq(r) => {
                        let unchanged = r.known_version() == VERSION;
                        let resp = CacheRoute {
                            seq: r.seq(),
                            module: ModuleId::new(r.modid(), r.cmdid()),
                            retcode: RetCode::Ok,
                            version: VERSION,
                            unchanged,
                            any_overloaded: false,
                            nodes: if unchanged { &[] } else { &route },
                        };
                        let known_version = r.known_version();
                        (
                            Got::CacheGetRoute { known_version },
                            Some(enc.cache_get_route_resp(&resp).to_vec()),
                        )
                    }
                    Message::BatchReportReq(b) => {
                        let b = b.validate().unwrap();
                        (Got::Batch(b.successes().collect()), None)
                    }
                    Message::ReportReq(r) => (
                        Got::Report {
                            host: NodeAddr::from(r.host().unwrap()),
                            retcode: r.retcode(),
                        },
                        None,
                    ),
                    other => (Got::Other(other.name()), None),
                };
                g.lock().unwrap().push(what);
                if let Some(a) = answer {
                    sock.send_to(&a, peer).unwrap();
                }
            }
        });
        Setup {
            _dir: dir,
            hb_path,
            hb,
            now: Arc::new(AtomicU64::new(T0)),
            got,
            stop,
            thread: Some(thread),
        }
    }

    fn client(&self) -> Client {
        let opts = ClientOptions {
            heartbeat_path: self.hb_path.clone(),
            cache: true,
            static_fallback: false,
            ..ClientOptions::default()
        };
        Client::with_clock(opts, Clock::manual(self.now.clone())).unwrap()
    }

    /// A client whose cached path reads `tick` (the clock stays the test's).
    fn client_with_tick(&self, tick: Arc<AtomicU64>) -> Client {
        let opts = ClientOptions {
            heartbeat_path: self.hb_path.clone(),
            cache: true,
            static_fallback: false,
            ..ClientOptions::default()
        };
        Client::with_clock(opts, Clock::manual_with_tick(self.now.clone(), tick)).unwrap()
    }

    /// Moves the client's clock to `T0 + ms`.
    fn at(&self, ms: u64) {
        self.now.store(T0 + ms, Ordering::Relaxed);
    }

    /// The agent beats at `T0 + ms`.
    fn beat(&self, ms: u64) {
        self.hb.beat(T0 + ms);
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn cached(c: &mut Client) -> NodeAddr {
    let h = c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(h.source, HostSource::Cache);
    h.addr
}

#[test]
fn a_heartbeat_older_than_2_s_stops_the_cached_path_and_a_new_beat_resumes_it() {
    let s = Setup::new();
    let mut c = s.client();
    s.beat(0);
    s.at(0);
    let h0 = cached(&mut c);
    c.report(M.modid, M.cmdid, h0, 0, 1).unwrap();
    s.beat(1_500);
    s.at(1_500);
    let h1 = cached(&mut c);
    c.report(M.modid, M.cmdid, h1, 0, 1).unwrap();
    // The route is due: the held successes go first, then the refresh.
    s.at(2_000);
    cached(&mut c);
    // No beat since 1500. At 3499 and 3500 the beat is young enough (the
    // seed's rule is "more than 2 s"): the cache answers, a success is held.
    s.at(3_499);
    let h = cached(&mut c);
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    s.at(3_500);
    cached(&mut c);
    // 2001 ms: the agent is down, though nothing but the clock moved.
    s.at(3_501);
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert!(
        matches!(&e, ClientError::AgentDown(why) if why.contains("2001 ms ago")),
        "{e}"
    );
    // A report while down is dropped, with what was held.
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    // The agent beats again: the cache answers at once (its route is 1.6 s
    // old), then refreshes on time, with no batch before (the held
    // successes went with the agent).
    s.beat(3_600);
    s.at(3_600);
    cached(&mut c);
    s.beat(4_000);
    s.at(4_000);
    cached(&mut c);
    let v = VERSION;
    assert_eq!(
        s.got(),
        vec![
            Got::CacheGetRoute { known_version: 0 },
            Got::Batch(vec![(h0, 1), (h1, 1)]),
            Got::CacheGetRoute { known_version: v },
            Got::CacheGetRoute { known_version: v },
        ]
    );
}

#[test]
fn a_route_is_refreshed_when_2_s_old_while_the_agent_beats() {
    let s = Setup::new();
    let mut c = s.client();
    s.beat(0);
    s.at(0);
    cached(&mut c);
    let mut ms = 0;
    while ms < REFRESH_INTERVAL_MS - 1 {
        ms += 100;
        ms = ms.min(REFRESH_INTERVAL_MS - 1);
        s.at(ms);
        if ms % 1_000 == 0 {
            s.beat(ms);
        }
        for _ in 0..5 {
            cached(&mut c);
        }
    }
    assert_eq!(s.got(), vec![Got::CacheGetRoute { known_version: 0 }]);
    s.beat(REFRESH_INTERVAL_MS);
    s.at(REFRESH_INTERVAL_MS);
    cached(&mut c);
    assert_eq!(
        s.got(),
        vec![
            Got::CacheGetRoute { known_version: 0 },
            Got::CacheGetRoute {
                known_version: VERSION
            }
        ]
    );
    // The next one is due 2 s after that refresh, not before.
    s.at(2 * REFRESH_INTERVAL_MS - 1);
    s.beat(2 * REFRESH_INTERVAL_MS - 1);
    cached(&mut c);
    assert_eq!(s.got().len(), 2);
}

#[test]
fn held_successes_go_out_when_2_s_old_before_the_report_that_finds_them_so() {
    let s = Setup::new();
    let mut c = s.client();
    s.beat(0);
    s.at(0);
    let mut picked = Vec::new();
    for _ in 0..3 {
        picked.push(cached(&mut c));
    }
    for &h in &picked {
        c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    }
    s.beat(1_000);
    s.at(HOLD_LIMIT_MS - 1);
    c.report(M.modid, M.cmdid, picked[0], 0, 1).unwrap();
    s.at(HOLD_LIMIT_MS);
    c.report(M.modid, M.cmdid, picked[1], 0, 1).unwrap();
    // A failure sends what is held (the report at 2000 ms) first.
    c.report(M.modid, M.cmdid, picked[2], -1, 300).unwrap();
    // Wait for the three datagrams (a refresh answered is the sync point).
    cached(&mut c);
    let got = s.got();
    assert_eq!(
        got,
        vec![
            Got::CacheGetRoute { known_version: 0 },
            Got::Batch(vec![(picked[0], 2), (picked[1], 1), (picked[2], 1)]),
            Got::Batch(vec![(picked[1], 1)]),
            Got::Report {
                host: picked[2],
                retcode: -1
            },
            Got::CacheGetRoute {
                known_version: VERSION
            },
        ]
    );
}

/// The cached path goes by the tick, which lags the clock (the ticker's
/// period and scheduling delay): a lagging tick makes each deadline late
/// by the lag, never early. Here the tick lags the clock by 5 ms; the slow
/// path (a refresh, a beat's check) reads the clock itself.
#[test]
fn a_lagging_tick_delays_the_cached_paths_deadlines_by_its_lag() {
    const LAG: u64 = 5;
    let s = Setup::new();
    let tick = Arc::new(AtomicU64::new(T0));
    let mut c = s.client_with_tick(tick.clone());
    let at = |ms: u64| {
        s.at(ms);
        tick.store(T0 + ms - LAG, Ordering::Relaxed);
    };
    s.beat(0);
    at(LAG);
    let h = cached(&mut c);
    // First success of its node: the slow path holds it, from 5 (the clock).
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    assert_eq!(s.got(), vec![Got::CacheGetRoute { known_version: 0 }]);
    // The route was refreshed at 5 (the clock): due at 2005. At 2005 by
    // the clock the tick says 2000: still served, the success counted.
    at(REFRESH_INTERVAL_MS + LAG - 1);
    s.beat(1_000);
    cached(&mut c);
    at(REFRESH_INTERVAL_MS + LAG);
    cached(&mut c);
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    assert_eq!(s.got().len(), 1, "nothing due by the tick: {:?}", s.got());
    // One lag later the tick reaches 2005: the batch, then the refresh.
    at(REFRESH_INTERVAL_MS + 2 * LAG);
    cached(&mut c);
    // The beat at 1000 is young enough until 3000 (the full check at the
    // refresh, by the clock); the tick reaches 3000 when the clock says
    // 3005, and the next call, past it, takes the slow path, which reads
    // the clock: 2006 ms.
    at(3_000 + LAG);
    cached(&mut c);
    at(3_000 + LAG + 1);
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert!(
        matches!(&e, ClientError::AgentDown(why) if why.contains("2006 ms ago")),
        "{e}"
    );
    assert_eq!(
        s.got(),
        vec![
            Got::CacheGetRoute { known_version: 0 },
            Got::Batch(vec![(h, 2)]),
            Got::CacheGetRoute {
                known_version: VERSION
            },
        ]
    );
}

/// While no ticker runs (the tick reads STOPPED: after a fork, or a thread
/// that could not start) every call takes the slow path, which reads the
/// clock: the cache still answers, holds and refreshes on time.
#[test]
fn with_the_tick_stopped_the_slow_path_keeps_the_cache_rules() {
    let s = Setup::new();
    let mut c = s.client_with_tick(Arc::new(AtomicU64::new(STOPPED)));
    s.beat(0);
    s.at(0);
    let h = cached(&mut c);
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    s.at(1_999);
    s.beat(1_000);
    cached(&mut c);
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    assert_eq!(s.got().len(), 1, "{:?}", s.got());
    s.at(REFRESH_INTERVAL_MS);
    cached(&mut c);
    // No beat since 1000: down at 3001.
    s.at(3_001);
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert!(matches!(&e, ClientError::AgentDown(_)), "{e}");
    assert_eq!(
        s.got(),
        vec![
            Got::CacheGetRoute { known_version: 0 },
            Got::Batch(vec![(h, 2)]),
            Got::CacheGetRoute {
                known_version: VERSION
            },
        ]
    );
}

/// Two modules used in turn: each call finds the other module's entry
/// (a map lookup, no datagram), each keeps its own round robin and held
/// successes.
#[test]
fn modules_used_in_turn_are_each_answered_from_the_cache() {
    const N: ModuleId = ModuleId::new(31, 8);
    let s = Setup::new();
    let mut c = s.client();
    s.beat(0);
    s.at(0);
    let get = |c: &mut Client, m: ModuleId| {
        let h = c.get_host(m.modid, m.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::Cache);
        h.addr
    };
    let mut picked = Vec::new();
    for _ in 0..3 {
        let a = get(&mut c, M);
        let b = get(&mut c, N);
        c.report(M.modid, M.cmdid, a, 0, 1).unwrap();
        c.report(N.modid, N.cmdid, b, 0, 1).unwrap();
        picked.push((a, b));
    }
    // Round robin per module: three distinct nodes each.
    let mut a: Vec<NodeAddr> = picked.iter().map(|p| p.0).collect();
    let mut b: Vec<NodeAddr> = picked.iter().map(|p| p.1).collect();
    a.sort();
    a.dedup();
    b.sort();
    b.dedup();
    assert_eq!((a.len(), b.len()), (3, 3));
    // Each module's successes go in its own batch (datagrams: wait for
    // the fake agent to have them, at most 10 s).
    c.flush().unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while s.got().len() < 4 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = s.got();
    assert_eq!(got.len(), 4, "two refreshes, two batches: {got:?}");
    assert_eq!(
        got.iter()
            .filter(|g| matches!(g, Got::Batch(b) if b.len() == 3))
            .count(),
        2,
        "{got:?}"
    );
}
