//! The fixed in-process workload whose instruction count `perf/check`
//! compares with `perf/callgrind.baseline` under `valgrind --tool=callgrind`.
//!
//! What it runs is what an agent shard runs per datagram, minus the system
//! calls: [`ShardCore::handle`] on a received getHost or report — verify and
//! decode the buffer, validate it, the LB decision (round robin over the
//! idle list; for a report, the node's counts and state), encode the
//! answer — a million getHosts and a million reports by default, interleaved
//! as qpstest sends them, on one 10-node module. One report in 23 is a
//! failure (spread over the nodes, too few to overload any), and the clock
//! advances 1 ms every 1000 requests, all fixed: the count is the same on
//! every run of the same binary.
//!
//! Only [`workload`] is counted (`--toggle-collect`): building the requests
//! and checking the answers are not. The program checks that every getHost
//! was answered with a host and every report absorbed, and exits non-zero
//! otherwise, so that a broken build cannot pass for a fast one.
//!
//! Two more cases, each counted on its own (its own function, its own
//! baseline line), guard the costs that grow with the table rather than
//! with the requests:
//!
//! - `update_route` ([`update_route_workload`]): 20 route changes of a
//!   10,000-node module through [`ShardCore::apply`], 10% of the nodes
//!   leaving and 10% arriving each time, every other route in reverse
//!   order. Linear today (about 2 million instructions a change); a path
//!   quadratic in the nodes multiplies the count.
//! - `many_modules` ([`many_modules_workload`]): a shard holding 20,000
//!   modules of 10 nodes serves 50,000 getHosts and 50,000 reports spread
//!   over them, and 2,000 turns of its 5 ms tick (`next_deadline` /
//!   `expire`, 10 s of time). The cost is the requests' and the due
//!   timers'; a scan over the modules per tick or per request multiplies it.
//!
//! Run them: `target/release/examples/callgrind_workload update_route`,
//! `... many_modules`.
//!
//! One more, not in the baseline (issue 12's shed path, for the README's
//! agent-overload section): `shed` ([`shed_rejected`] and
//! [`shed_answered`], each counted on its own): a shard with
//! `agent_shedding` on whose level was driven below business priority 60
//! handles 100,000 queued getHosts at priority 60 (each answered
//! `Rejected`) and 100,000 at priority 5 (each answered with a host):
//! what a rejection costs the shard against an answer.
//! `valgrind --tool=callgrind --toggle-collect='callgrind_workload::shed_rejected' target/release/examples/callgrind_workload shed`.
//!
//! One more, not in the baseline (issue 16's shared memory): `shm fixed`
//! and `shm flat` ([`shm_main`]): getHosts and reports through a slot of
//! a region, the client and the shard in one thread; `shm_shard` counts
//! the shard's sweeps, `shm_client_*` the client's side, for the fixed
//! records of layout 3 against the FlatBuffers cells of layout 2.
//! `valgrind --tool=callgrind --toggle-collect='callgrind_workload::shm_shard' target/release/examples/callgrind_workload shm fixed`.
//!
//! Run: `target/release/examples/callgrind_workload [N]` (N of each, default
//! 1000000); under callgrind: `perf/check --callgrind-only`.
//!
//! # The cached client path (`--client`)
//!
//! `callgrind_workload --client [N]` counts [`cached_client`] instead: N
//! getHosts and N success reports through [`Client`] with the route cache
//! on (issue 14's path: the application's own thread, no datagram), on one
//! 10-node module, against a heartbeat file and a fake agent on loopback
//! (a thread of this process) that answers the cache's route requests. The
//! route is fetched before the counted function starts; the function runs
//! in chunks of [`CLIENT_CHUNK`] pairs, and the heartbeat is beaten between
//! them (valgrind runs one thread at a time: a beating thread could fall
//! more than 2 s behind, and the client would rightly see the agent down). Time
//! is real here: the route is asked for again (version only) every 2 s and
//! held successes go out as a batch when 2 s old, so a run that takes
//! longer under valgrind counts those few exchanges too (a few thousand
//! instructions each, under 0.1% of the count). The program checks that
//! every getHost was answered by the cache and every report accepted.

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::ExitCode;

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lbagent::admission::AdmissionParams;
use lbagent::agent::messages::ToShard;
use lbagent::agent::shard::{Queued, ShardCore, ShardSetup};
use lbagent::agent::shard_rt::sweep;
use lbagent::client::{Client, ClientOptions, HostSource};
use lbagent::config::Config;
use lbagent::host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent::model::{ModuleId, NodeAddr, Policy, RouteNode};
use lbagent::shm::attach::Attachment;
use lbagent::shm::fixed;
use lbagent::shm::layout::{Geometry, FMT_FIXED, FMT_FLATBUFFERS};
use lbagent::shm::region::{Access, Identity, Region};
use lbagent::shm::serve::Server;
use lbagent::wire::{decode, CacheRoute, Encoder, Limits, Message, Report, RetCode};

/// The module: shard 0 of 1 owns every module.
const MODULE: ModuleId = ModuleId::new(10_000, 1);
const NODES: u8 = 10;
const PEER: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40_000));
/// One report in this many is a failure.
const FAIL_EVERY: u64 = 23;

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 8080)
}

/// The pre-encoded datagrams: one getHost, and per node a success and a
/// failure report.
struct Requests {
    get_host: Vec<u8>,
    /// `reports[2 * node + failed]`.
    reports: Vec<Vec<u8>>,
}

fn requests() -> Requests {
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

fn shard() -> ShardCore {
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
            policy: lbagent::model::Policy::L5,
        },
        0,
    );
    assert!(released.is_empty());
    shard
}

/// What the workload saw.
#[derive(Debug, Default)]
struct Seen {
    answers: u64,
    answer_bytes: u64,
    silent_reports: u64,
    last_answer: Vec<u8>,
}

/// The counted part: `n` getHosts, each followed by a report of the node
/// the round robin will have given (the shard's answer is not decoded here:
/// a client's work is not the agent's).
#[inline(never)]
fn workload(shard: &mut ShardCore, reqs: &Requests, n: u64) -> Seen {
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

// === the cached client path ===

/// What [`cached_client`] saw.
#[derive(Debug, Default)]
struct ClientSeen {
    from_cache: u64,
    other_hosts: u64,
    errors: u64,
    reported: u64,
}

const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Pairs per call of [`cached_client`]; the heartbeat is beaten between.
const CLIENT_CHUNK: u64 = 10_000;

/// The counted part of `--client`: `n` getHosts through the route cache,
/// each followed by a success report of the host it gave.
#[inline(never)]
fn cached_client(client: &mut Client, n: u64) -> ClientSeen {
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

/// Sets up a heartbeat, a beating thread and a fake agent, fetches the
/// route, then runs [`cached_client`].
fn client_main(n: u64) -> ExitCode {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("callgrind workload: no temporary directory: {e}");
            return ExitCode::FAILURE;
        }
    };
    let sock = UdpSocket::bind("127.0.0.1:0").expect("bind a loopback port");
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("set a receive timeout");
    let port = sock.local_addr().expect("local address").port();
    let hb_path = dir.path().join("heartbeat");
    let hb = HeartbeatWriter::create(
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
    hb.beat(unix_ms());
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    // The agent: answers the cache's route requests (version 1, unchanged
    // when the client names it), absorbs reports.
    let agent = std::thread::spawn(move || {
        let route: Vec<RouteNode> = (1..=NODES)
            .map(|i| RouteNode {
                addr: node(i),
                weight: 1,
            })
            .collect();
        let mut enc = Encoder::new();
        let mut buf = vec![0u8; 65_536];
        while !s.load(Ordering::Relaxed) {
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
    });
    let mut client = Client::with_options(ClientOptions {
        heartbeat_path: hb_path,
        cache: true,
        static_fallback: false,
        ..ClientOptions::default()
    })
    .expect("valid client options");
    // Warm up, not counted: the route is fetched, every node holds a success.
    let warm = cached_client_warm_up(&mut client);
    let mut seen = ClientSeen::default();
    let mut left = n;
    while left > 0 {
        hb.beat(unix_ms());
        let chunk = left.min(CLIENT_CHUNK);
        let s = cached_client(&mut client, chunk);
        seen.from_cache += s.from_cache;
        seen.other_hosts += s.other_hosts;
        seen.errors += s.errors;
        seen.reported += s.reported;
        left -= chunk;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = agent.join();
    println!(
        "callgrind workload: cached client: {n} getHosts ({} from the cache, {} elsewhere, {} errors), {} reports accepted (warm-up: {warm})",
        seen.from_cache, seen.other_hosts, seen.errors, seen.reported
    );
    if seen.from_cache != n || seen.reported != n || !warm {
        eprintln!("callgrind workload: the cache did not answer as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
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

// === the update_route case ===

/// Nodes of the module the update_route case changes.
const BIG_ROUTE: u32 = 10_000;
/// Route changes the update_route case counts.
const CHANGES: u32 = 20;

/// The route changes, prepared outside the counted part (the messages own
/// their nodes): version v keeps nodes v*1000 .. v*1000 + 10000, so each
/// change drops 1,000 and adds 1,000; odd versions come in reverse order.
fn route_changes() -> Vec<ToShard> {
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

/// The counted part of the update_route case: every change through the
/// shard's route path. Returns the nodes held after each.
#[inline(never)]
fn update_route_workload(shard: &mut ShardCore, changes: Vec<ToShard>, get_host: &[u8]) -> u64 {
    let mut held = 0;
    for (i, msg) in changes.into_iter().enumerate() {
        let released = shard.apply(msg, i as u64);
        held += released.len() as u64;
        held += u64::from(shard.handle(black_box(get_host), PEER, 0).is_some());
    }
    held
}

// === the many-modules case ===

/// Modules the many-modules case holds.
const MANY: u32 = 20_000;
/// getHosts (and as many reports) it sends, spread over the modules.
const MANY_REQUESTS: u32 = 50_000;
/// Turns of the 5 ms tick it runs.
const TICKS: u32 = 2_000;

fn many_module(k: u32) -> ModuleId {
    // Shard 0 of 1 owns them all.
    ModuleId::new(20_000 + k, 1)
}

/// Per module of the many-modules case: a getHost and a success report of
/// one of its nodes, pre-encoded.
type ModuleRequests = Vec<(Vec<u8>, Vec<u8>)>;

/// A shard holding [`MANY`] modules, and their requests.
fn many_modules() -> (ShardCore, ModuleRequests) {
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
    (shard, reqs)
}

/// The counted part of the many-modules case: the requests, one tick every
/// 25 of them, the clock 5 ms a tick. Returns the getHosts answered.
#[inline(never)]
fn many_modules_workload(shard: &mut ShardCore, reqs: &[(Vec<u8>, Vec<u8>)]) -> u64 {
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

/// getHosts per half of the `shed` case.
const SHED_N: u64 = 100_000;

/// A shard with shedding on, its level driven below (60, 64) by
/// overloaded 1 ms windows of priority-(60, 64) getHosts (not counted).
/// Returns it and the time it stopped at: while the clock stays there, no
/// window ends (the count bound is out of reach), so the level holds.
fn shedding_shard() -> (ShardCore, u64) {
    let mut shard = shard();
    shard.set_shedding(Some(AdmissionParams {
        window_us: 1000,
        window_requests: u32::MAX,
        queuing_threshold_us: 500,
        ..AdmissionParams::default()
    }));
    let req = Encoder::new().get_host_req(1, MODULE, 60, 64).to_vec();
    let mut t = 1_000_000_000u64;
    for _ in 0..1_000_000 {
        if !lbagent::admission::admits(shard.self_level(), 60, 64) {
            break;
        }
        t += 1;
        let q = Queued {
            now_us: t,
            waited_us: 5_000,
        };
        let _ = shard.handle_queued(&req, PEER, t / 1000, Some(q));
    }
    (shard, t)
}

/// `n` queued getHosts that the shard's level rejects. Returns how many
/// answers were `Rejected`-sized (checked by the caller).
#[inline(never)]
fn shed_rejected(shard: &mut ShardCore, req: &[u8], t: u64, n: u64) -> (u64, Vec<u8>) {
    // A constant of its own, so that the linker cannot fold the two
    // counted functions into one symbol.
    black_box(1u32);
    shed_loop(shard, req, t, n)
}

/// `n` queued getHosts that the shard's level admits (answered with a host).
#[inline(never)]
fn shed_answered(shard: &mut ShardCore, req: &[u8], t: u64, n: u64) -> (u64, Vec<u8>) {
    black_box(2u32);
    shed_loop(shard, req, t, n)
}

fn shed_loop(shard: &mut ShardCore, req: &[u8], t: u64, n: u64) -> (u64, Vec<u8>) {
    let mut answers = 0;
    let mut last = Vec::new();
    for i in 0..n {
        let q = Queued {
            now_us: t,
            waited_us: 20,
        };
        if let Some(a) = shard.handle_queued(black_box(req), PEER, t / 1000, Some(q)) {
            answers += 1;
            if i + 1 == n {
                last = a.to_vec();
            }
        }
    }
    (answers, last)
}

fn shed_main() -> ExitCode {
    let (mut shard, t) = shedding_shard();
    let level = shard.self_level();
    let mut enc = Encoder::new();
    let low = enc.get_host_req(7, MODULE, 60, 64).to_vec();
    let high = enc.get_host_req(8, MODULE, 5, 64).to_vec();
    let (rejected, last_r) = shed_rejected(&mut shard, &low, t, SHED_N);
    let (answered, last_a) = shed_answered(&mut shard, &high, t, SHED_N);
    let code = |b: &[u8]| match decode(b, &Limits::UDP) {
        Ok(Message::GetHostResp(r)) => Some(r.retcode()),
        _ => None,
    };
    println!(
        "callgrind workload: shed: level {level:?}; {SHED_N} getHosts at priority 60 ({rejected} answered, last {:?}), {SHED_N} at priority 5 ({answered} answered, last {:?})",
        code(&last_r),
        code(&last_a)
    );
    if lbagent::admission::admits(level, 60, 64)
        || shard.self_level() != level
        || rejected != SHED_N
        || answered != SHED_N
        || code(&last_r) != Some(RetCode::Rejected)
        || code(&last_a) != Some(RetCode::Ok)
    {
        eprintln!("callgrind workload: shed: the shard did not shed as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

// === the shared-memory path (issue 16) ===

/// getHosts (and as many reports) of a `shm` run.
const SHM_N: u64 = 200_000;

/// The shard's side of one exchange through a slot: one sweep, as the
/// shard's request loop runs it (counted alone: `shm_shard`).
#[inline(never)]
fn shm_shard(shard: &mut ShardCore, srv: &mut Server) -> usize {
    let n = sweep(shard, srv, false, false);
    if !shard.outbox.is_empty() {
        shard.outbox.clear();
    }
    n
}

/// The client's side of posting `req`: encode it (a fixed record, or
/// FlatBuffers bytes as before layout 3) and publish it in the slot.
#[inline(never)]
fn shm_client_post(
    att: &mut Attachment,
    enc: &mut Encoder,
    req: &fixed::Request,
    record: bool,
    answer: bool,
) -> u32 {
    let mut rec = [0u8; fixed::MAX_LEN];
    let (bytes, format) = if record {
        let n = fixed::encode_request(req, &mut rec);
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
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    att.post(black_box(bytes), format, answer, deadline, &mut || {})
        .expect("the slot takes the request")
}

/// The client's side of reading a getHost's answer: the host it names.
#[inline(never)]
fn shm_client_wait(att: &mut Attachment, seq: u32, buf: &mut Vec<u8>) -> Option<NodeAddr> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (n, format) = att.wait(seq, deadline, buf, &mut || {}).ok()?;
    let a = if format == FMT_FIXED {
        fixed::decode_answer(&buf[..n]).ok()?
    } else {
        match decode(&buf[..n], &Limits::UDP).ok()? {
            Message::GetHostResp(r) => fixed::HostAnswer::from_resp(&r),
            _ => return None,
        }
    };
    (a.retcode == RetCode::Ok).then_some(a.host).flatten()
}

/// `shm fixed|flat`: [`SHM_N`] getHosts, each followed by a report of the
/// node it named, through one slot of a region, the shard and the client
/// in this one thread (post, sweep, read the answer): the shard's
/// instructions per request are `shm_shard`'s count / (2 × N), the
/// client's those of `shm_client_*`. `flat` sends FlatBuffers bytes (the
/// cells of layout 2), `fixed` the records of layout 3.
fn shm_main(mode: Option<&str>) -> ExitCode {
    let record = match mode {
        Some("fixed") => true,
        Some("flat") => false,
        _ => {
            eprintln!("usage: callgrind_workload shm fixed|flat");
            return ExitCode::FAILURE;
        }
    };
    let pid = std::process::id();
    let path = std::env::temp_dir().join(format!("lbagent-callgrind-shm-{pid}.0"));
    let ident = Identity {
        shard: 0,
        pid,
        boot: 1,
    };
    let region = Region::create(&path, Geometry::new(4), ident, Access::Owner)
        .expect("a region in the temporary directory");
    let mut srv = Server::new(region);
    let mut att = Attachment::attach(&path, pid).expect("a slot");
    let _ = std::fs::remove_file(&path);
    let mut shard = shard();
    let mut enc = Encoder::new();
    let mut buf = Vec::new();
    let (mut hosts, mut missing) = (0u64, 0u64);
    for i in 0..SHM_N {
        let seq = i as u32;
        let g = fixed::Request::GetHost(lbagent::wire::GetHost {
            seq,
            module: MODULE,
            business_priority: 0,
            user_priority: 0,
        });
        let s = shm_client_post(&mut att, &mut enc, &g, record, true);
        shm_shard(&mut shard, &mut srv);
        let Some(host) = shm_client_wait(&mut att, s, &mut buf) else {
            missing += 1;
            continue;
        };
        hosts += 1;
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
        shm_client_post(&mut att, &mut enc, &r, record, false);
        shm_shard(&mut shard, &mut srv);
    }
    let m = &shard.metrics;
    println!(
        "callgrind workload: shm {}: {SHM_N} getHosts ({hosts} answered with a host) and reports through a slot; shm requests {}, garbage {}",
        if record { "fixed" } else { "flat" },
        srv.counts.requests,
        srv.counts.garbage,
    );
    if missing > 0
        || srv.counts.requests != 2 * SHM_N
        || srv.counts.garbage > 0
        || m.unknown_node_reports > 0
    {
        eprintln!("callgrind workload: shm: not every request was answered as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    match std::env::args().nth(1).as_deref() {
        Some("shed") => return shed_main(),
        Some("shm") => return shm_main(std::env::args().nth(2).as_deref()),
        Some("update_route") => {
            let mut shard = shard();
            let changes = route_changes();
            let get_host = requests().get_host;
            let held = update_route_workload(&mut shard, changes, &get_host);
            println!("callgrind workload: update_route: {CHANGES} changes of a {BIG_ROUTE}-node module ({held} getHosts answered)");
            return if held == u64::from(CHANGES) {
                ExitCode::SUCCESS
            } else {
                eprintln!("callgrind workload: the module did not answer after each change");
                ExitCode::FAILURE
            };
        }
        Some("many_modules") => {
            let (mut shard, reqs) = many_modules();
            let answered = many_modules_workload(&mut shard, &reqs);
            println!("callgrind workload: many_modules: {MANY} modules, {MANY_REQUESTS} getHosts ({answered} answered) and reports, {TICKS} ticks");
            return if answered == u64::from(MANY_REQUESTS) {
                ExitCode::SUCCESS
            } else {
                eprintln!("callgrind workload: the shard did not answer every getHost");
                ExitCode::FAILURE
            };
        }
        _ => {}
    }
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let client = args.first().is_some_and(|a| a == "--client");
    if client {
        args.remove(0);
    }
    let n: u64 = match args.first().map(|s| s.parse()) {
        None => 1_000_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: callgrind_workload [--client] [N > 0 getHosts and N reports]");
            return ExitCode::from(2);
        }
    };
    if client {
        return client_main(n);
    }
    let reqs = requests();
    let mut shard = shard();
    let seen = workload(&mut shard, &reqs, n);
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
    if seen.answers != n || seen.silent_reports != n || host.is_none() {
        eprintln!("callgrind workload: the shard did not answer as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
