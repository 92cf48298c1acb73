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
//!   calls: [`ShardCore::handle`] on a received getHost or report — read
//!   the buffer (the hot path, `wire::read_hot`, since issue 29: the
//!   verifier's checks without the verifier), validate it, the LB decision
//!   (round robin over the idle list; for a report, the node's counts and
//!   state), the answer (the Ok template patched) — [`N`] getHosts and [`N`] reports, interleaved as qpstest sends
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
//! - [`udp_shard_turn`] (issue 29): the shard's UDP shell around the same
//!   requests — `recvmmsg` of a full batch from its socket, the control
//!   messages the socket options the shard sets ask the kernel for
//!   ([`Stamps::for_shard`] with the default configuration), each datagram
//!   handed to the core, the answers sent by one `sendmmsg` — as
//!   [`UDP_ROUNDS`] batches of [`UDP_BATCH`] datagrams (half getHosts, half
//!   reports) that a client socket of this thread queued before the turn,
//!   so every receive takes a full batch. User space only, as callgrind
//!   counts: a cost the kernel pays is not in the count, but what the shard
//!   asks of the kernel per datagram is checked exactly by
//!   [`check_udp`] (control-message bytes: none by default).
//! - [`shm_shard_turn`] (issues 16 and 29): [`SHM_N`] getHosts, each
//!   followed by a report of the node it named (handing back the node
//!   hint its answer carried, as the client library does), through one slot of a
//!   shared-memory region as fixed records, the client and the shard in
//!   one thread (post, sweep, read the answer), the clock advancing 1 ms
//!   every 500 exchanges; only the shard's sweeps are counted (the
//!   default configuration: no queuing time measured). Per request:
//!   the count / (2 × [`SHM_N`]).
//! - [`shm_busy_workload`] (issue 29): the same requests from
//!   [`SHM_BUSY_SLOTS`] clients at once, one sweep serving all of them
//!   (a busy shard's shape: the sweep's own cost shared by its requests).

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
use lbagent::agent::shard_rt::{serve_datagrams, serve_ready, Stamps, BATCH};
use lbagent::client::{Client, ClientOptions, HostSource};
use lbagent::config::Config;
use lbagent::host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent::host::udp::{RecvBatch, SendBatch};
use lbagent::model::{ModuleId, NodeAddr, Policy, RouteNode};
use lbagent::shm::attach::{Attachment, Due};
use lbagent::shm::fixed;
use lbagent::shm::layout::{Geometry, FMT_FIXED, FMT_FLATBUFFERS};
use lbagent::shm::region::{Access, Identity, Region};
use lbagent::shm::serve::Server;
use lbagent::wire::{decode, CacheRoute, Encoder, Limits, Message, Report, RetCode};
use std::os::fd::AsRawFd;

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
            options: Default::default(),
            meta: Vec::new(),
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
                options: Default::default(),
                meta: Vec::new(),
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
                options: Default::default(),
                meta: Vec::new(),
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

// === the shard's UDP shell ===

/// Datagrams per turn of [`udp_shard_turn`]: the shard's batch.
pub const UDP_BATCH: usize = BATCH;
/// Turns of the UDP shell workload: 160,000 getHosts and as many reports.
pub const UDP_ROUNDS: u64 = 10_000;

/// The shard, its socket and a client socket of the UDP shell workload.
pub struct UdpRun {
    /// The shard.
    pub shard: ShardCore,
    /// Its socket.
    pub server: UdpSocket,
    /// What the shard asked the kernel for on it.
    pub stamps: Stamps,
    /// The shard's receive and send batches.
    pub rx: RecvBatch,
    /// See `rx`.
    pub tx: SendBatch,
    /// The client's socket, its batch of requests and its receive batch.
    pub client: UdpSocket,
    /// See `client`.
    pub out: SendBatch,
    /// See `client`.
    pub back: RecvBatch,
    /// The requests.
    pub reqs: Requests,
}

/// What the UDP shell workload saw.
#[derive(Debug, Default)]
pub struct UdpSeen {
    /// Turns whose receive did not take a full batch.
    pub short_turns: u64,
    /// Datagrams the shard received.
    pub received: u64,
    /// Control-message bytes the kernel attached to them.
    pub control_bytes: u64,
    /// Answers the client received.
    pub answers: u64,
}

/// The setup of the UDP shell workload: two loopback sockets, the shard's
/// with the socket options a shard with the default configuration sets.
pub fn udp_run() -> UdpRun {
    let config = Config::default();
    let server = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("a loopback socket");
    let client = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("a loopback socket");
    server.set_nonblocking(true).unwrap();
    client.set_nonblocking(true).unwrap();
    let stamps = Stamps::for_shard(
        server.as_raw_fd(),
        config.agent.queuing_time,
        config.admission.agent_shedding,
    );
    UdpRun {
        shard: shard(),
        server,
        stamps,
        rx: RecvBatch::new(UDP_BATCH),
        tx: SendBatch::new(),
        client,
        out: SendBatch::new(),
        back: RecvBatch::new(UDP_BATCH),
        reqs: requests(),
    }
}

/// The counted part: one turn of the shard's request loop on a socket that
/// holds a full batch — receive it, serve it, send the answers.
#[inline(never)]
pub fn udp_shard_turn(run: &mut UdpRun, now: u64, seen: &mut UdpSeen) {
    let fd = run.server.as_raw_fd();
    let n = run.rx.recv(fd).unwrap_or(0);
    seen.received += n as u64;
    if n < UDP_BATCH {
        seen.short_turns += 1;
    }
    if n == 0 {
        return;
    }
    for i in 0..n {
        seen.control_bytes += run.rx.control_bytes(i) as u64;
    }
    serve_datagrams(&mut run.shard, &run.rx, n, &mut run.tx, fd, run.stamps, now);
    if !run.shard.outbox.is_empty() {
        run.shard.outbox.clear();
    }
}

/// [`UDP_ROUNDS`] turns: the client queues a batch (getHost, report, ...,
/// the reports naming the nodes in turn, one in [`FAIL_EVERY`] a failure),
/// the shard takes its turn, the client reads the answers (none of it but
/// the turn counted).
pub fn udp_workload(run: &mut UdpRun, rounds: u64) -> UdpSeen {
    let mut seen = UdpSeen::default();
    let to = run.server.local_addr().unwrap();
    let mut i = 0u64;
    for round in 0..rounds {
        for _ in 0..UDP_BATCH / 2 {
            run.out.push(to, &run.reqs.get_host);
            let which = (i % u64::from(NODES)) as usize;
            let failed = usize::from(i % FAIL_EVERY == FAIL_EVERY - 1);
            run.out.push(to, &run.reqs.reports[2 * which + failed]);
            i += 1;
        }
        let unsent = run.out.flush(run.client.as_raw_fd());
        assert_eq!(unsent, 0, "the loopback socket took the batch");
        udp_shard_turn(run, round / 100, &mut seen);
        seen.answers += run.back.recv(run.client.as_raw_fd()).unwrap_or(0) as u64;
    }
    seen
}

/// Panics unless every turn took a full batch, every getHost was answered
/// and the kernel attached no control message to any datagram (the
/// default configuration measures no queuing time and sheds nothing: a
/// per-datagram cost that no feature in use asks for is a regression).
pub fn check_udp(seen: &UdpSeen, rounds: u64) {
    println!(
        "callgrind workload: udp shell: {rounds} turns of {UDP_BATCH} datagrams ({} received, {} short turns, {} control-message bytes), {} answers",
        seen.received, seen.short_turns, seen.control_bytes, seen.answers
    );
    assert_eq!(
        seen.control_bytes, 0,
        "the kernel attached control messages to the shard's datagrams with the default configuration: a per-datagram cost no feature in use asks for"
    );
    assert!(
        seen.short_turns == 0
            && seen.received == rounds * UDP_BATCH as u64
            && seen.answers == rounds * UDP_BATCH as u64 / 2,
        "callgrind workload: udp shell: not every turn served a full batch: the count would mean nothing"
    );
}

// === the shared-memory path ===

/// getHosts (and as many reports) of the shared-memory workload.
pub const SHM_N: u64 = 200_000;

/// The shard, its region's server and a client attached to one slot.
pub struct ShmRun {
    /// The shard.
    pub shard: ShardCore,
    /// The region's server side.
    pub srv: Server,
    /// The client's slot.
    pub att: Attachment,
    /// Fixed records (layout 3), or FlatBuffers cells (layout 2).
    pub record: bool,
    /// The client's encoder (FlatBuffers cells).
    pub enc: Encoder,
    /// The client's answer buffer.
    pub buf: Vec<u8>,
}

/// What the shared-memory workload saw.
#[derive(Debug, Default)]
pub struct ShmSeen {
    /// getHosts answered with a host.
    pub hosts: u64,
    /// getHosts without one.
    pub missing: u64,
}

/// The setup of the shared-memory workload: a region of 4 slots in a
/// temporary directory of its own (removed at once; the mappings stay),
/// this process attached to one.
pub fn shm_run(record: bool) -> ShmRun {
    let pid = std::process::id();
    // A directory of its own: the region's must be one only its user can
    // write (host::owned), not the world-writable temporary directory.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("lbagent-callgrind-shm.0");
    let ident = Identity {
        shard: 0,
        pid,
        boot: 1,
    };
    let region = Region::create(&path, Geometry::new(4), ident, Access::Owner)
        .expect("a region in the temporary directory");
    let srv = Server::new(region);
    let att = Attachment::attach(&path, pid).expect("a slot");
    let _ = std::fs::remove_file(&path);
    drop(dir);
    ShmRun {
        shard: shard(),
        srv,
        att,
        record,
        enc: Encoder::new(),
        buf: Vec::new(),
    }
}

/// The counted part: the shard's side of one exchange through a slot, one
/// sweep as the shard's request loop runs it with the default
/// configuration (no queuing time measured), at time `now`.
#[inline(never)]
pub fn shm_shard_turn(shard: &mut ShardCore, srv: &mut Server, now: u64) -> usize {
    let ready = srv.ready(false);
    let n = if ready == 0 {
        0
    } else {
        serve_ready(shard, srv, ready, false, now, None)
    };
    if !shard.outbox.is_empty() {
        shard.outbox.clear();
    }
    n
}

/// The client's side of posting `req`: encode it (a fixed record with
/// `hint`, as the client library writes it to a shard that reads hints, or
/// FlatBuffers bytes as before layout 3) and publish it in the slot.
#[inline(never)]
pub fn shm_client_post(
    att: &mut Attachment,
    enc: &mut Encoder,
    req: &fixed::Request,
    hint: fixed::Hint,
    record: bool,
    answer: bool,
) -> u32 {
    let mut rec = [0u8; fixed::MAX_LEN];
    let (bytes, format) = if record {
        let n = fixed::encode_request_hinted(req, hint, &mut rec);
        (&rec[..n], FMT_FIXED)
    } else {
        let b = match req {
            fixed::Request::GetHost(g) => {
                enc.get_host_req(g.seq, g.module, g.business_priority, g.user_priority)
            }
            fixed::Request::Report(r) => enc.report_req(r),
        };
        (b, FMT_FLATBUFFERS)
    };
    let due = Due::after(Duration::from_secs(10));
    att.post(black_box(bytes), format, answer, &due, &mut || {})
        .expect("the slot takes the request")
}

/// The client's side of reading a getHost's answer: the host it names,
/// and what its report hands back of the node hint.
#[inline(never)]
pub fn shm_client_wait(
    att: &mut Attachment,
    seq: u32,
    buf: &mut Vec<u8>,
) -> Option<(NodeAddr, fixed::Hint)> {
    let due = Due::after(Duration::from_secs(10));
    let (n, format) = att.wait(seq, &due, buf, &mut || {}).ok()?;
    let (a, hint) = if format == FMT_FIXED {
        fixed::decode_answer_hinted(&buf[..n]).ok()?
    } else {
        match decode(&buf[..n], &Limits::UDP).ok()? {
            Message::GetHostResp(r) => (fixed::HostAnswer::from_resp(&r), None),
            _ => return None,
        }
    };
    let hint = hint.map_or(fixed::Hint::None, fixed::Hint::Node);
    (a.retcode == RetCode::Ok)
        .then_some(a.host)
        .flatten()
        .map(|h| (h, hint))
}

/// What a getHost asks of the node hint: as the client library, only of a
/// shard that reads hints.
fn ask(att: &Attachment) -> fixed::Hint {
    if att.reads_hints() {
        fixed::Hint::Ask
    } else {
        fixed::Hint::None
    }
}

/// `n` exchanges: a getHost posted, a sweep, its answer read; a report of
/// the node it named (one in [`FAIL_EVERY`] a failure) posted, a sweep.
pub fn shm_workload(run: &mut ShmRun, n: u64) -> ShmSeen {
    let mut seen = ShmSeen::default();
    for i in 0..n {
        let seq = i as u32;
        let g = fixed::Request::GetHost(lbagent::wire::GetHost {
            seq,
            module: MODULE,
            business_priority: 0,
            user_priority: 0,
        });
        let asks = ask(&run.att);
        let s = shm_client_post(&mut run.att, &mut run.enc, &g, asks, run.record, true);
        let now = i / 500;
        shm_shard_turn(&mut run.shard, &mut run.srv, now);
        let Some((host, hint)) = shm_client_wait(&mut run.att, s, &mut run.buf) else {
            seen.missing += 1;
            continue;
        };
        seen.hosts += 1;
        let failed = i % FAIL_EVERY == FAIL_EVERY - 1;
        let r = fixed::Request::Report(Report {
            seq,
            module: MODULE,
            host,
            retcode: if failed { -1 } else { 0 },
            tcost_ms: 40,
            downstream_level: None,
            consumed: 0,
        });
        shm_client_post(&mut run.att, &mut run.enc, &r, hint, run.record, false);
        shm_shard_turn(&mut run.shard, &mut run.srv, now);
    }
    seen
}

/// Client slots of the busy shared-memory workload ([`shm_busy_workload`]).
pub const SHM_BUSY_SLOTS: u32 = 16;

/// Rounds of the busy workload: [`SHM_BUSY_SLOTS`] getHosts and as many
/// reports a round, [`SHM_N`] of each in all (the single-slot workload's).
pub const SHM_BUSY_ROUNDS: u64 = SHM_N / SHM_BUSY_SLOTS as u64;

/// A shard and a region of [`SHM_BUSY_SLOTS`] slots, each held by a
/// client of this process: the shape of a busy shard, whose sweep finds
/// many requests.
pub struct ShmBusyRun {
    /// The shard.
    pub shard: ShardCore,
    /// The region's server side.
    pub srv: Server,
    /// The clients' slots.
    pub atts: Vec<Attachment>,
    /// The clients' encoder (unused with fixed records).
    pub enc: Encoder,
    /// The clients' answer buffer.
    pub buf: Vec<u8>,
}

/// [`ShmBusyRun`]: the region in a directory of its own, every slot attached.
pub fn shm_busy_run() -> ShmBusyRun {
    let pid = std::process::id();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("lbagent-callgrind-shm-busy.0");
    let ident = Identity {
        shard: 0,
        pid,
        boot: 1,
    };
    let region = Region::create(&path, Geometry::new(SHM_BUSY_SLOTS), ident, Access::Owner)
        .expect("a region in the temporary directory");
    let srv = Server::new(region);
    let atts = (0..SHM_BUSY_SLOTS)
        .map(|_| Attachment::attach(&path, pid).expect("a free slot"))
        .collect();
    let _ = std::fs::remove_file(&path);
    drop(dir);
    ShmBusyRun {
        shard: shard(),
        srv,
        atts,
        enc: Encoder::new(),
        buf: Vec::new(),
    }
}

/// `rounds` rounds of the busy shape: every client posts a getHost, one
/// sweep serves them all, each reads its answer; every client posts a
/// report of its node (one in [`FAIL_EVERY`] a failure), one sweep. Only
/// [`shm_shard_turn`] is counted: per request, the count / (2 ×
/// [`SHM_BUSY_SLOTS`] × rounds).
pub fn shm_busy_workload(run: &mut ShmBusyRun, rounds: u64) -> ShmSeen {
    let mut seen = ShmSeen::default();
    let n = run.atts.len();
    let mut seqs = vec![0u32; n];
    let mut hosts = vec![None; n];
    let mut i = 0u64;
    for r in 0..rounds {
        let now = r * n as u64 / 500;
        for (k, att) in run.atts.iter_mut().enumerate() {
            let g = fixed::Request::GetHost(lbagent::wire::GetHost {
                seq: (i + k as u64) as u32,
                module: MODULE,
                business_priority: 0,
                user_priority: 0,
            });
            let asks = ask(att);
            seqs[k] = shm_client_post(att, &mut run.enc, &g, asks, true, true);
        }
        shm_shard_turn(&mut run.shard, &mut run.srv, now);
        for (k, att) in run.atts.iter_mut().enumerate() {
            hosts[k] = shm_client_wait(att, seqs[k], &mut run.buf);
            match hosts[k] {
                Some(_) => seen.hosts += 1,
                None => seen.missing += 1,
            }
        }
        for (k, att) in run.atts.iter_mut().enumerate() {
            let Some((host, hint)) = hosts[k] else {
                continue;
            };
            let failed = (i + k as u64) % FAIL_EVERY == FAIL_EVERY - 1;
            let rep = fixed::Request::Report(Report {
                seq: (i + k as u64) as u32,
                module: MODULE,
                host,
                retcode: if failed { -1 } else { 0 },
                tcost_ms: 40,
                downstream_level: None,
                consumed: 0,
            });
            shm_client_post(att, &mut run.enc, &rep, hint, true, false);
        }
        shm_shard_turn(&mut run.shard, &mut run.srv, now);
        i += n as u64;
    }
    seen
}

/// Panics unless every getHost of the busy workload was answered with a
/// host and the region took every request as a well-formed one.
pub fn check_shm_busy(run: &ShmBusyRun, seen: &ShmSeen, rounds: u64) {
    let n = u64::from(SHM_BUSY_SLOTS) * rounds;
    let counts = &run.srv.counts;
    println!(
        "callgrind workload: shm busy: {n} getHosts ({} answered with a host) and reports through {SHM_BUSY_SLOTS} slots, one sweep a round; shm requests {}, garbage {}",
        seen.hosts, counts.requests, counts.garbage,
    );
    assert!(
        seen.missing == 0
            && seen.hosts == n
            && counts.requests == 2 * n
            && counts.garbage == 0
            && run.shard.metrics.unknown_node_reports == 0,
        "callgrind workload: shm busy: not every request was answered as expected: the count would mean nothing"
    );
}

/// Panics unless every getHost was answered with a host, the region took
/// every request and nothing was garbage.
pub fn check_shm(run: &ShmRun, seen: &ShmSeen, n: u64) {
    let counts = &run.srv.counts;
    println!(
        "callgrind workload: shm {}: {n} getHosts ({} answered with a host) and reports through a slot; shm requests {}, garbage {}",
        if run.record { "fixed" } else { "flat" },
        seen.hosts,
        counts.requests,
        counts.garbage,
    );
    assert!(
        seen.missing == 0
            && counts.requests == 2 * n
            && counts.garbage == 0
            && run.shard.metrics.unknown_node_reports == 0,
        "callgrind workload: shm: not every request was answered as expected: the count would mean nothing"
    );
}
