//! The cached path against time driven by hand ([`Clock::manual`]): a real
//! heartbeat file and a fake agent on loopback, the client's clock moved
//! by the test. They show that reading a coarse clock once per call (and
//! trusting the heartbeat while its sequence word does not move) still
//! notices a stale heartbeat after 2 s, refreshes a route on time, and
//! sends held successes when they are 2 s old.

use std::net::{Ipv4Addr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::cache::{HOLD_LIMIT_MS, REFRESH_INTERVAL_MS};
use super::clock::Clock;
use super::{Client, ClientError, ClientOptions, HostSource};
use crate::agent::heartbeat::{AgentInfo, HeartbeatWriter};
use crate::model::{ModuleId, NodeAddr, RouteNode};
use crate::wire::{decode, CacheRoute, Encoder, Limits, Message, RetCode};

const M: ModuleId = ModuleId::new(31, 7);
const T: Duration = Duration::from_secs(2);
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

/// The bound a report right after a cached getHost keeps: it goes by that
/// getHost's time (no clock read of its own), so it notices a batch due,
/// or a dead agent, late by at most the time since that getHost; a later
/// call sends the batch, or drops it with the agent. A report with no
/// cached getHost just before reads the clock (as in the test above).
#[test]
fn a_report_after_a_cached_get_host_goes_by_that_get_hosts_time() {
    let s = Setup::new();
    let mut c = s.client();
    s.beat(0);
    s.at(0);
    let h0 = cached(&mut c);
    // Held from 0 (a first success of its node takes the slow path).
    c.report(M.modid, M.cmdid, h0, 0, 1).unwrap();
    s.beat(1_000);
    s.at(1_000);
    let h1 = cached(&mut c);
    c.report(M.modid, M.cmdid, h1, 0, 1).unwrap();
    // A getHost at 1999, its report at 2000 (the batch is 2 s old then):
    // held, by the getHost's time.
    s.at(HOLD_LIMIT_MS - 1);
    cached(&mut c);
    s.at(HOLD_LIMIT_MS);
    c.report(M.modid, M.cmdid, h0, 0, 1).unwrap();
    // The getHost at 2000 refreshes the route: the batch (h0 counted
    // twice: the report at 2000 was held) goes first.
    let h = cached(&mut c);
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    // The agent's last beat is at 1000: the getHost at 3000 finds it alive
    // (2000 ms), its report at 3001 holds (by 3000) though the beat is
    // 2001 ms old then; the next getHost finds the agent down, and the
    // next report drops what was held.
    s.at(3_000);
    cached(&mut c);
    s.at(3_001);
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert!(matches!(&e, ClientError::AgentDown(_)), "{e}");
    c.report(M.modid, M.cmdid, h, 0, 1).unwrap();
    // The agent beats again; the route refreshed at 2000 is due at 4000,
    // with nothing held before it.
    s.beat(4_000);
    s.at(4_000);
    cached(&mut c);
    assert_eq!(
        s.got(),
        vec![
            Got::CacheGetRoute { known_version: 0 },
            Got::Batch(vec![(h0, 2), (h1, 1)]),
            Got::CacheGetRoute {
                known_version: VERSION
            },
            Got::CacheGetRoute {
                known_version: VERSION
            },
        ]
    );
}
