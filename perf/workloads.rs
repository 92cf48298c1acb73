//! The four fixed in-process workloads whose instruction counts the
//! callgrind regression check compares with the committed baseline
//! (`perf/callgrind.rs`, a Gungraun library benchmark per workload, run by
//! `perf/check`). Shared with `perf/callgrind_workload.rs` (the shed and
//! shared-memory counts, not in the baseline) through `#[path]`.
//!
//! Each workload is a setup (not counted), a counted `#[inline(never)]`
//! function and a check of what it saw (not counted) that panics when the
//! answers were wrong, so that a broken build cannot pass for a fast one.
//! All are deterministic but the cached client's (see [`cached_client`]).
//!
//! - [`workload`]: what an agent shard runs per datagram, minus the system
//!   calls: [`ShardCore::handle`] on a received getHost or report — verify
//!   and decode the buffer, validate it, the LB decision (round robin over
//!   the idle list; for a report, the node's counts and state), encode the
//!   answer — [`N`] getHosts and [`N`] reports, interleaved as qpstest sends
//!   them, on one 10-node module. One report in 23 is a failure (spread over
//!   the nodes, too few to overload any), and the clock advances 1 ms every
//!   1000 requests.
//! - [`cached_client`]: [`N`] getHosts and [`N`] success reports through
//!   [`Client`] with the route cache on (issue 14's path: the application's
//!   own thread, no datagram), against a heartbeat file and a fake agent on
//!   loopback (a thread of this process) that answers the cache's route
//!   requests. The route is fetched in the setup; the counted function runs
//!   in chunks of [`CLIENT_CHUNK`] pairs and the heartbeat is beaten between
//!   them, outside it (valgrind runs one thread at a time: a beating thread
//!   could fall more than 2 s behind, and the client would rightly see the
//!   agent down). Time is real here: the route is asked for again (version
//!   only) every 2 s and held successes go out as a batch when 2 s old, so a
//!   run that takes longer under valgrind counts those few exchanges too (a
//!   few thousand instructions each, under 0.1% of the count).
//! - [`update_route_workload`]: 20 route changes of a 10,000-node module
//!   through [`ShardCore::apply`], 10% of the nodes leaving and 10% arriving
//!   each time, every other route in reverse order. Linear today (about 2
//!   million instructions a change); a path quadratic in the nodes
//!   multiplies the count.
//! - [`many_modules_workload`]: a shard holding 20,000 modules of 10 nodes
//!   serves 50,000 getHosts and 50,000 reports spread over them, and 2,000
//!   turns of its 5 ms tick (`next_deadline` / `expire`, 10 s of time). The
//!   cost is the requests' and the due timers'; a scan over the modules per
//!   tick or per request multiplies it.

// Each including target uses part of this module.
#![allow(dead_code)]

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lbagent::agent::messages::ToShard;
use lbagent::agent::shard::{ShardCore, ShardSetup};
use lbagent::client::{Client, ClientOptions, HostSource};
use lbagent::config::Config;
use lbagent::host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent::model::{ModuleId, NodeAddr, Policy, RouteNode};
use lbagent::wire::{decode, CacheRoute, Encoder, Limits, Message, Report, RetCode};

/// getHosts (and as many reports) of the shard and cached-client workloads;
/// the baseline holds for this value only.
pub const N: u64 = 1_000_000;
/// The module: shard 0 of 1 owns every module.
pub const MODULE: ModuleId = ModuleId::new(10_000, 1);
/// Nodes of [`MODULE`].
pub const NODES: u8 = 10;
/// The peer every request comes from.
pub const PEER: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40_000));
/// One report in this many is a failure.
pub const FAIL_EVERY: u64 = 23;

/// Node `i` of [`MODULE`].
pub fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 8080)
}

/// The pre-encoded datagrams: one getHost, and per node a success and a
/// failure report.
pub struct Requests {
    /// A getHost of [`MODULE`].
    pub get_host: Vec<u8>,
    /// `reports[2 * node + failed]`.
    pub reports: Vec<Vec<u8>>,
}

/// The datagrams of [`workload`].
pub fn requests() -> Requests {
    let mut enc = Encoder::new();
    let get_host = enc.get_host_req(1, MODULE, 0, 0).to_vec();
    let mut reports = Vec::new();
    for i in 1..=NODES {
        for retcode in [0, -1] {
            reports.push(
                enc.report_req(&Report {
                    seq: 2,
                    module: MODULE,
                    host: node(i),
                    retcode,
                    tcost_ms: 40,
                    downstream_level: None,
                    consumed: 0,
                })
                .to_vec(),
            );
        }
    }
    Requests { get_host, reports }
}

/// A shard with the default configuration holding [`MODULE`].
pub fn shard() -> ShardCore {
    let config = Config::default();
    let mut shard = ShardCore::new(ShardSetup {
        params: config.lb.params(),
        update_timeout_ms: config.lb.update_timeout * 1000,
        report_timeout_ms: config.lb.report_timeout * 1000,
        ..ShardSetup::new(0, 1, 8888)
    });
    let released = shard.apply(
        ToShard::Route {
            module: MODULE,
            exists: true,
            version: 1,
            nodes: (1..=NODES)
                .map(|i| RouteNode {
                    addr: node(i),
                    weight: 1,
                })
                .collect(),
            policy: Policy::L5,
        },
        0,
    );
    assert!(released.is_empty());
    shard
}

// === the shard's request path ===

/// What [`workload`] saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// getHosts answered.
    pub answers: u64,
    /// Bytes of those answers.
    pub answer_bytes: u64,
    /// Reports absorbed without an answer.
    pub silent_reports: u64,
    /// The answer to one more getHost after the counted ones.
    pub last_answer: Vec<u8>,
}

/// The shard and the datagrams [`workload`] runs on.
pub struct ShardRun {
    /// The shard.
    pub shard: ShardCore,
    /// Its requests.
    pub reqs: Requests,
}

/// The setup of [`workload`].
pub fn shard_run() -> ShardRun {
    ShardRun {
        reqs: requests(),
        shard: shard(),
    }
}

/// The counted part: `n` getHosts, each followed by a report of the node
/// the round robin will have given (the shard's answer is not decoded here:
/// a client's work is not the agent's).
#[inline(never)]
pub fn workload(shard: &mut ShardCore, reqs: &Requests, n: u64) -> Seen {
    let mut seen = Seen::default();
    for i in 0..n {
        let now = i / 1000;
        if let Some(answer) = shard.handle(black_box(&reqs.get_host), PEER, now) {
            seen.answers += 1;
            seen.answer_bytes += answer.len() as u64;
        }
        let which = (i % u64::from(NODES)) as usize;
        let failed = usize::from(i % FAIL_EVERY == FAIL_EVERY - 1);
        let report = &reqs.reports[2 * which + failed];
        if shard.handle(black_box(report), PEER, now).is_none() {
            seen.silent_reports += 1;
        }
        if !shard.outbox.is_empty() {
            shard.outbox.clear();
        }
    }
    if let Some(answer) = shard.handle(&reqs.get_host, PEER, n / 1000) {
        seen.last_answer = answer.to_vec();
    }
    seen
}

/// Panics unless every one of the `n` getHosts was answered, every report
/// absorbed and the last answer names a host.
pub fn check_shard(seen: &Seen, n: u64) {
    let host = match decode(&seen.last_answer, &Limits::UDP) {
        Ok(Message::GetHostResp(r)) if r.retcode() == RetCode::Ok => r.host().map(NodeAddr::from),
        _ => None,
    };
    println!(
        "callgrind workload: {n} getHosts ({} answered, {} bytes), {n} reports ({} absorbed); last host {}",
        seen.answers,
        seen.answer_bytes,
        seen.silent_reports,
        host.map_or("none".to_string(), |h| h.to_string())
    );
    assert!(
        seen.answers == n && seen.silent_reports == n && host.is_some(),
        "callgrind workload: the shard did not answer as expected: the count would mean nothing"
    );
}

// === the cached client path ===

/// What [`cached_client`] saw.
#[derive(Debug, Default)]
pub struct ClientSeen {
    /// getHosts the route cache answered.
    pub from_cache: u64,
    /// getHosts answered from elsewhere (the agent, the static file).
    pub other_hosts: u64,
    /// getHosts that failed.
    pub errors: u64,
    /// Reports accepted.
    pub reported: u64,
}

const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Pairs per call of [`cached_client`]; the heartbeat is beaten between.
pub const CLIENT_CHUNK: u64 = 10_000;

/// The counted part of the cached client path: `n` getHosts through the
/// route cache, each followed by a success report of the host it gave.
#[inline(never)]
pub fn cached_client(client: &mut Client, n: u64) -> ClientSeen {
    let mut seen = ClientSeen::default();
    for _ in 0..n {
        match client.get_host(MODULE.modid, MODULE.cmdid, black_box(CLIENT_TIMEOUT)) {
            Ok(h) => {
                if h.source == HostSource::Cache {
                    seen.from_cache += 1;
                } else {
                    seen.other_hosts += 1;
                }
                if client
                    .report(MODULE.modid, MODULE.cmdid, h.addr, 0, 40)
                    .is_ok()
                {
                    seen.reported += 1;
                }
            }
            Err(_) => seen.errors += 1,
        }
    }
    seen
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A client with its route cached, the heartbeat it reads and the fake
/// agent that answers it.
pub struct ClientRun {
    /// The client under test.
    pub client: Client,
    /// Its agent's heartbeat, beaten between chunks.
    pub heartbeat: HeartbeatWriter,
    /// Whether the warm-up was answered by the cache.
    pub warm: bool,
    stop: Arc<AtomicBool>,
    agent: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// The setup of [`cached_client`]: a heartbeat, a fake agent that answers
/// the cache's route requests (version 1, unchanged when the client names
/// it) and absorbs reports, and a client whose route is fetched and whose
/// every node holds a success.
pub fn client_run() -> ClientRun {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sock = UdpSocket::bind("127.0.0.1:0").expect("bind a loopback port");
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("set a receive timeout");
    let port = sock.local_addr().expect("local address").port();
    let hb_path = dir.path().join("heartbeat");
    let heartbeat = HeartbeatWriter::create(
        &hb_path,
        &AgentInfo {
            shards: 1,
            base_port: port,
            bind: Ipv4Addr::LOCALHOST,
            pid: std::process::id(),
            snapshot_path: dir.path().join("snapshot"),
        },
    )
    .expect("create the heartbeat file");
    heartbeat.beat(unix_ms());
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let agent = std::thread::spawn(move || fake_agent(&sock, &s));
    let mut client = Client::with_options(ClientOptions {
        heartbeat_path: hb_path,
        cache: true,
        static_fallback: false,
        ..ClientOptions::default()
    })
    .expect("valid client options");
    let warm = cached_client_warm_up(&mut client);
    ClientRun {
        client,
        heartbeat,
        warm,
        stop,
        agent,
        _dir: dir,
    }
}

/// Answers the cache's route requests on `sock` until `stop`.
fn fake_agent(sock: &UdpSocket, stop: &AtomicBool) {
    let route: Vec<RouteNode> = (1..=NODES)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        })
        .collect();
    let mut enc = Encoder::new();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        let Ok((len, peer)) = sock.recv_from(&mut buf) else {
            continue;
        };
        if let Ok(Message::CacheGetRouteReq(q)) = decode(&buf[..len], &Limits::UDP) {
            let unchanged = q.known_version() == 1;
            let resp = CacheRoute {
                seq: q.seq(),
                module: ModuleId::new(q.modid(), q.cmdid()),
                retcode: RetCode::Ok,
                version: 1,
                unchanged,
                any_overloaded: false,
                nodes: if unchanged { &[] } else { &route },
            };
            let _ = sock.send_to(enc.cache_get_route_resp(&resp), peer);
        }
    }
}

/// Fetches the route and holds a success for every node; true when the
/// cache answered.
fn cached_client_warm_up(client: &mut Client) -> bool {
    (0..u64::from(NODES) * 2).all(|_| {
        client
            .get_host(MODULE.modid, MODULE.cmdid, CLIENT_TIMEOUT)
            .is_ok_and(|h| {
                h.source == HostSource::Cache
                    && client
                        .report(MODULE.modid, MODULE.cmdid, h.addr, 0, 40)
                        .is_ok()
            })
    })
}

/// [`cached_client`] over `n` pairs in chunks of [`CLIENT_CHUNK`], the
/// heartbeat beaten before each chunk.
pub fn cached_client_chunks(run: &mut ClientRun, n: u64) -> ClientSeen {
    let mut seen = ClientSeen::default();
    let mut left = n;
    while left > 0 {
        run.heartbeat.beat(unix_ms());
        let chunk = left.min(CLIENT_CHUNK);
        let s = cached_client(&mut run.client, chunk);
        seen.from_cache += s.from_cache;
        seen.other_hosts += s.other_hosts;
        seen.errors += s.errors;
        seen.reported += s.reported;
        left -= chunk;
    }
    seen
}

/// Stops the fake agent; panics unless the cache answered every one of the
/// `n` getHosts and every report was accepted.
pub fn check_client(run: ClientRun, seen: &ClientSeen, n: u64) {
    run.stop.store(true, Ordering::Relaxed);
    let _ = run.agent.join();
    println!(
        "callgrind workload: cached client: {n} getHosts ({} from the cache, {} elsewhere, {} errors), {} reports accepted (warm-up: {})",
        seen.from_cache, seen.other_hosts, seen.errors, seen.reported, run.warm
    );
    assert!(
        seen.from_cache == n && seen.reported == n && run.warm,
        "callgrind workload: the cache did not answer as expected: the count would mean nothing"
    );
}

// === the update_route case ===

/// Nodes of the module the update_route case changes.
pub const BIG_ROUTE: u32 = 10_000;
/// Route changes the update_route case counts.
pub const CHANGES: u32 = 20;

/// The route changes, prepared outside the counted part (the messages own
/// their nodes): version v keeps nodes v*1000 .. v*1000 + 10000, so each
/// change drops 1,000 and adds 1,000; odd versions come in reverse order.
pub fn route_changes() -> Vec<ToShard> {
    (1..=CHANGES)
        .map(|v| {
            let first = v * BIG_ROUTE / 10;
            let mut nodes: Vec<RouteNode> = (first..first + BIG_ROUTE)
                .map(|i| RouteNode {
                    addr: NodeAddr {
                        ip: 0x0a00_0000 + i,
                        port: 8080,
                    },
                    weight: 1,
                })
                .collect();
            if v % 2 == 1 {
                nodes.reverse();
            }
            ToShard::Route {
                module: MODULE,
                exists: true,
                version: u64::from(v),
                nodes,
                policy: Policy::L5,
            }
        })
        .collect()
}

/// The shard, the changes and the getHost of the update_route case.
pub struct UpdateRouteRun {
    /// The shard.
    pub shard: ShardCore,
    /// The route changes ([`route_changes`]).
    pub changes: Vec<ToShard>,
    /// A getHost of [`MODULE`], asked after each change.
    pub get_host: Vec<u8>,
}

/// The setup of [`update_route_workload`].
pub fn update_route_run() -> UpdateRouteRun {
    UpdateRouteRun {
        shard: shard(),
        changes: route_changes(),
        get_host: requests().get_host,
    }
}

/// The counted part of the update_route case: every change through the
/// shard's route path. Returns the nodes held after each.
#[inline(never)]
pub fn update_route_workload(shard: &mut ShardCore, changes: Vec<ToShard>, get_host: &[u8]) -> u64 {
    let mut held = 0;
    for (i, msg) in changes.into_iter().enumerate() {
        let released = shard.apply(msg, i as u64);
        held += released.len() as u64;
        held += u64::from(shard.handle(black_box(get_host), PEER, 0).is_some());
    }
    held
}

/// Panics unless the module answered after each change.
pub fn check_update_route(held: u64) {
    println!("callgrind workload: update_route: {CHANGES} changes of a {BIG_ROUTE}-node module ({held} getHosts answered)");
    assert_eq!(
        held,
        u64::from(CHANGES),
        "callgrind workload: the module did not answer after each change"
    );
}

// === the many-modules case ===

/// Modules the many-modules case holds.
pub const MANY: u32 = 20_000;
/// getHosts (and as many reports) it sends, spread over the modules.
pub const MANY_REQUESTS: u32 = 50_000;
/// Turns of the 5 ms tick it runs.
pub const TICKS: u32 = 2_000;

fn many_module(k: u32) -> ModuleId {
    // Shard 0 of 1 owns them all.
    ModuleId::new(20_000 + k, 1)
}

/// Per module of the many-modules case: a getHost and a success report of
/// one of its nodes, pre-encoded.
pub type ModuleRequests = Vec<(Vec<u8>, Vec<u8>)>;

/// A shard holding [`MANY`] modules, and their requests.
pub struct ManyModulesRun {
    /// The shard.
    pub shard: ShardCore,
    /// Its requests.
    pub reqs: ModuleRequests,
}

/// The setup of [`many_modules_workload`].
pub fn many_modules_run() -> ManyModulesRun {
    let mut shard = shard();
    let mut enc = Encoder::new();
    let mut reqs = Vec::new();
    for k in 0..MANY {
        let m = many_module(k);
        let nodes: Vec<RouteNode> = (1..=NODES)
            .map(|i| RouteNode {
                addr: node(i),
                weight: 1,
            })
            .collect();
        let _ = shard.apply(
            ToShard::Route {
                module: m,
                exists: true,
                version: 1,
                nodes,
                policy: Policy::L5,
            },
            0,
        );
        let get_host = enc.get_host_req(k, m, 0, 0).to_vec();
        let report = enc
            .report_req(&Report {
                seq: k,
                module: m,
                host: node(1 + (k % u32::from(NODES)) as u8),
                retcode: 0,
                tcost_ms: 3,
                downstream_level: None,
                consumed: 0,
            })
            .to_vec();
        reqs.push((get_host, report));
    }
    shard.outbox.clear();
    ManyModulesRun { shard, reqs }
}

/// The counted part of the many-modules case: the requests, one tick every
/// 25 of them, the clock 5 ms a tick. Returns the getHosts answered.
#[inline(never)]
pub fn many_modules_workload(shard: &mut ShardCore, reqs: &[(Vec<u8>, Vec<u8>)]) -> u64 {
    let mut answered = 0;
    let per_tick = MANY_REQUESTS / TICKS;
    for i in 0..MANY_REQUESTS {
        let now = u64::from(i / per_tick) * 5;
        let (get_host, report) = &reqs[(i % MANY) as usize];
        answered += u64::from(shard.handle(black_box(get_host), PEER, now).is_some());
        let _ = shard.handle(black_box(report), PEER, now);
        if i % per_tick == per_tick - 1 {
            if shard.next_deadline().is_some_and(|d| d <= now) {
                let _ = shard.expire(now);
            }
            shard.outbox.clear();
        }
    }
    answered
}

/// Panics unless every getHost of the many-modules case was answered.
pub fn check_many_modules(answered: u64) {
    println!("callgrind workload: many_modules: {MANY} modules, {MANY_REQUESTS} getHosts ({answered} answered) and reports, {TICKS} ticks");
    assert_eq!(
        answered,
        u64::from(MANY_REQUESTS),
        "callgrind workload: the shard did not answer every getHost"
    );
}
