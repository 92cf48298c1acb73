//! The client library end to end: against the real agent binary (routes
//! from the test route source), against fake agents on loopback (a UDP
//! socket and a heartbeat written with the agent's own writer) that answer
//! what a test needs, and with no agent at all. Every wait is bounded.

#[path = "support/common.rs"]
mod common;

#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/routesrc.rs"]
mod routesrc;

#[path = "support/agentproc.rs"]
mod agentproc;

use common::{unix_ms, wait_for};
use std::net::{Ipv4Addr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use agentproc::AgentProc;
use lbagent::client::{Client, ClientError, ClientOptions, HostSource};
use lbagent::host::heartbeat::{AgentInfo, HeartbeatReader, HeartbeatWriter};
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{decode, CacheRoute, Encoder, Limits, Message, RetCode};
use routesrc::RouteSource;

const M: ModuleId = ModuleId::new(100, 1);
/// The timeout of a call that is meant to be answered: generous, so that a
/// stall of a busy machine (a throttled cgroup stops the agent and this
/// process for hundreds of milliseconds) cannot turn an answer into a
/// timeout, a static answer or a marked shard. Calls meant to time out
/// name their own short timeout.
const T: Duration = Duration::from_secs(5);

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 1, 0, i), 9000)
}

fn nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        })
        .collect()
}

// === the real agent ===

/// A route source with `M` on `n` nodes and an agent that has pulled it.
fn agent_with_route(dir: &Path, n: u8, shards: u32) -> (RouteSource, AgentProc) {
    let source = RouteSource::start();
    source.set_route(M, &nodes(n));
    let agent = AgentProc::start(dir, source.addr(), shards, "");
    let version = agent
        .client()
        .register(M.modid, M.cmdid, Duration::from_secs(5))
        .expect("the route arrives");
    assert!(version > 0);
    (source, agent)
}

/// The agent's view of one node: (rsucc, rerr, contin_succ, contin_err, vsucc, verr).
fn counters(c: &mut Client, n: NodeAddr) -> (u32, u32, u32, u32, u32, u32) {
    let view = c.get_route(M.modid, M.cmdid, T).unwrap();
    let s = view
        .nodes
        .iter()
        .find(|s| s.addr == n)
        .expect("node in route");
    (
        s.rsucc,
        s.rerr,
        s.contin_succ,
        s.contin_err,
        s.vsucc,
        s.verr,
    )
}

#[test]
fn get_host_round_trips_through_a_real_agent_on_the_owning_shard() {
    let dir = tempfile::tempdir().unwrap();
    let (source, agent) = agent_with_route(dir.path(), 3, 2);
    let other = ModuleId::new(100, 2); // (100 + 2) % 2 = shard 0; M is shard 1
    source.set_route(other, &nodes(1));
    let mut c = agent.client();
    c.register(other.modid, other.cmdid, Duration::from_secs(5))
        .unwrap();
    let hosts: Vec<NodeAddr> = (0..6)
        .map(|_| {
            let h = c.get_host(M.modid, M.cmdid, T).unwrap();
            assert_eq!(h.source, HostSource::Agent);
            h.addr
        })
        .collect();
    for i in 0..3 {
        assert_eq!(hosts[i], hosts[i + 3], "round robin: {hosts:?}");
    }
    let mut distinct = hosts[..3].to_vec();
    distinct.sort();
    assert_eq!(distinct, vec![node(1), node(2), node(3)]);
    let h = c.get_host(other.modid, other.cmdid, T).unwrap();
    assert_eq!(h.addr, node(1));

    c.report(M.modid, M.cmdid, node(2), 0, 3).unwrap();
    let view = c.get_route(M.modid, M.cmdid, T).unwrap();
    assert_eq!(view.nodes.len(), 3);
    let n2 = view.nodes.iter().find(|n| n.addr == node(2)).unwrap();
    assert_eq!((n2.rsucc, n2.vsucc), (1, 181), "the report arrived first");
    assert_eq!(
        c.register(M.modid, M.cmdid, T).unwrap(),
        view.version,
        "register of a present module answers its version at once"
    );
    let info = c.agent().unwrap();
    assert_eq!(info.shards, 2);
}

#[test]
fn the_real_agent_answers_no_such_module_and_overloaded_as_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 1, 1);
    let mut c = agent.client();
    let unknown = ModuleId::new(999, 9);
    let e = c
        .register(unknown.modid, unknown.cmdid, Duration::from_secs(3))
        .unwrap_err();
    assert_eq!(e, ClientError::NoSuchModule { module: unknown });
    let e = c.get_host(unknown.modid, unknown.cmdid, T).unwrap_err();
    assert_eq!(e, ClientError::NoSuchModule { module: unknown });
    let e = c.get_route(unknown.modid, unknown.cmdid, T).unwrap_err();
    assert_eq!(e.kind(), "no_such_module");

    // contin_err_lim (15) failures make the only node overloaded; the next
    // getHost is not a probe (the 11th is).
    for _ in 0..15 {
        c.report(M.modid, M.cmdid, node(1), -1, 0).unwrap();
    }
    let e = c.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert_eq!(e, ClientError::Overloaded { module: M });
}

/// One getHost of a [`Looper`]: when it was asked and when it returned
/// (both: a thread can be kept off its core between a call and its
/// record), and what.
type Answer = (Span, Result<(NodeAddr, HostSource), ClientError>);

/// When a call was asked and when it returned.
#[derive(Clone, Copy)]
struct Span {
    asked: Instant,
    returned: Instant,
}

/// A thread calling getHost in a loop with its own client, recording
/// every answer with the time it came.
struct Looper {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Answer>>>,
    thread: Option<JoinHandle<()>>,
}

impl Looper {
    fn start(opts: ClientOptions, timeout: Duration) -> Looper {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (s, l) = (stop.clone(), log.clone());
        let thread = std::thread::spawn(move || {
            let mut c = Client::with_options(opts).unwrap();
            while !s.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let r = c
                    .get_host(M.modid, M.cmdid, timeout)
                    .map(|h| (h.addr, h.source));
                let returned = Instant::now();
                l.lock().unwrap().push((Span { asked, returned }, r));
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Looper {
            stop,
            log,
            thread: Some(thread),
        }
    }

    /// Answers from `source` to calls asked since `t`.
    fn count_since(&self, t: Instant, source: HostSource) -> usize {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|(at, r)| at.asked >= t && matches!(r, Ok((_, s)) if *s == source))
            .count()
    }

    fn wait(&self, limit: Duration, t: Instant, source: HostSource, n: usize) -> bool {
        wait_for(limit, || (self.count_since(t, source) >= n).then_some(())).is_some()
    }

    fn finish(mut self) -> Vec<Answer> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

fn assert_no_failure(log: &[Answer]) {
    let failures: Vec<&ClientError> = log.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} calls failed, first: {}",
        failures.len(),
        log.len(),
        failures[0]
    );
    let valid = nodes(3);
    for (_, r) in log {
        let (addr, _) = r.as_ref().unwrap();
        assert!(valid.iter().any(|n| n.addr == *addr), "a wrong host {addr}");
    }
}

#[test]
fn killed_agent_static_answers_while_down_then_back_to_the_agent_without_a_failed_call() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, mut agent) = agent_with_route(dir.path(), 3, 1);
    agent.wait_snapshot(M);
    let looper = Looper::start(agent.options(), Duration::from_millis(300));
    let t0 = Instant::now();
    // (The waits are long: only a failure waits them out, and a stall of
    // a busy machine must not.)
    assert!(looper.wait(Duration::from_secs(10), t0, HostSource::Agent, 5));

    agent.kill9();
    let killed = Instant::now();
    // The heartbeat ages past 2 s: answers keep coming, from the file.
    let stale = killed + Duration::from_millis(2_300);
    assert!(
        looper.wait(Duration::from_secs(12), stale, HostSource::StaticRoutes, 10),
        "static answers after the heartbeat went stale"
    );
    // A call asked once the agent was dead (killed and reaped) cannot be
    // its answer, however late the looper got to record it.
    assert_eq!(looper.count_since(killed, HostSource::Agent), 0);

    // Restarted (on other ports: base_port 0), the agent is used again.
    agent.spawn();
    let restarted = Instant::now();
    assert!(
        looper.wait(Duration::from_secs(10), restarted, HostSource::Agent, 10),
        "back to the agent once it beats"
    );
    let log = looper.finish();
    assert_no_failure(&log);
}

#[test]
fn a_stopped_agent_is_ridden_over_with_static_answers_until_it_beats_again() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 3, 1);
    agent.wait_snapshot(M);
    let looper = Looper::start(agent.options(), Duration::from_millis(100));
    let t0 = Instant::now();
    assert!(looper.wait(Duration::from_secs(10), t0, HostSource::Agent, 5));

    // Stopped, its port still accepts datagrams but nothing answers; the
    // heartbeat is fresh for 2 s more.
    agent.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    assert!(looper.wait(
        Duration::from_secs(10),
        stopped,
        HostSource::StaticRoutes,
        5
    ));
    std::thread::sleep(Duration::from_millis(2_500));
    // Taken before the signal: nothing returned before it was answered by
    // a resumed agent, whatever keeps this thread off its core meanwhile.
    let resuming = Instant::now();
    agent.signal(libc::SIGCONT);
    assert!(
        looper.wait(Duration::from_secs(10), resuming, HostSource::Agent, 10),
        "back to the agent once it beats"
    );
    let log = looper.finish();
    assert_no_failure(&log);
    // Asked after the stop took hold (150 ms: a thread of the agent busy
    // when the signal came may finish one answer) and returned before the
    // resume: by call times, not record times, which a stalled looper
    // thread could make late.
    let during: usize = log
        .iter()
        .filter(|(at, _)| at.asked > stopped + Duration::from_millis(150) && at.returned < resuming)
        .filter(|(_, r)| matches!(r, Ok((_, HostSource::Agent))))
        .count();
    assert_eq!(during, 0, "no agent answer while it was stopped");
}

// === no agent: the static route file alone ===

fn write_snapshot(path: &Path, module: ModuleId, n: u8) {
    let route = SnapshotRoute {
        module,
        version: 3,
        nodes: nodes(n),
        meta: Vec::new(),
    };
    snapshot::write(path, 1, &[route]).unwrap();
}

#[test]
fn a_missing_truncated_or_corrupt_route_file_is_a_static_routes_error_never_a_host() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.snapshot");
    let opts = ClientOptions {
        heartbeat_path: dir.path().join("no-heartbeat"),
        snapshot_path: file.clone(),
        ..ClientOptions::default()
    };
    let mut c = Client::with_options(opts.clone()).unwrap();
    let static_err = |c: &mut Client| match c.get_host(M.modid, M.cmdid, T) {
        Err(ClientError::StaticRoutes(why)) => why,
        other => panic!("expected a static routes error, got {other:?}"),
    };
    let why = static_err(&mut c);
    assert!(why.contains("does not exist"), "{why}");
    assert!(
        why.contains("no-heartbeat"),
        "says why the agent is down: {why}"
    );

    write_snapshot(&file, M, 2);
    for _ in 0..10 {
        let h = c.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::StaticRoutes);
        assert!(h.addr == node(1) || h.addr == node(2));
    }
    let why = match c.get_host(7, 7, T) {
        Err(ClientError::StaticRoutes(why)) => why,
        other => panic!("{other:?}"),
    };
    assert!(why.contains("no node of module [7, 7]"), "{why}");

    let good = std::fs::read(&file).unwrap();
    std::fs::write(&file, &good[..good.len() - 5]).unwrap();
    assert!(static_err(&mut c).contains("truncated"));
    std::fs::write(&file, &good[..10]).unwrap();
    assert!(static_err(&mut c).contains("truncated"));
    let mut corrupt = good.clone();
    corrupt[40] ^= 0x01; // a node's address
    corrupt.push(0); // and a size of its own, so the change is seen at once
    std::fs::write(&file, &corrupt).unwrap();
    let why = static_err(&mut c);
    assert!(
        why.contains("malformed") || why.contains("corrupt"),
        "{why}"
    );
    std::fs::write(&file, b"").unwrap();
    assert!(static_err(&mut c).contains("truncated"));

    // Fixed: answers again. Without static fallback: agent down.
    write_snapshot(&file, M, 1);
    assert_eq!(c.get_host(M.modid, M.cmdid, T).unwrap().addr, node(1));
    let mut strict = Client::with_options(ClientOptions {
        static_fallback: false,
        ..opts
    })
    .unwrap();
    let e = strict.get_host(M.modid, M.cmdid, T).unwrap_err();
    assert_eq!(e.kind(), "agent_down");
    // register and getRoute have no static answer; report is dropped.
    assert_eq!(
        c.register(M.modid, M.cmdid, T).unwrap_err().kind(),
        "agent_down"
    );
    assert_eq!(
        c.get_route(M.modid, M.cmdid, T).unwrap_err().kind(),
        "agent_down"
    );
    assert_eq!(c.report(M.modid, M.cmdid, node(1), 0, 1), Ok(()));
}

// === hostile files: the client never aborts, never hangs past its timeout ===

/// A heartbeat beaten now that names `shards` shards from `base_port`, and
/// a static route file holding module M.
fn hostile_heartbeat(dir: &Path, shards: u32, base_port: u16) -> (HeartbeatWriter, Client) {
    let snap = dir.join("routes.snapshot");
    write_snapshot(&snap, M, 1);
    let hb = dir.join("heartbeat");
    let w = HeartbeatWriter::create(
        &hb,
        &AgentInfo {
            shards,
            base_port,
            bind: Ipv4Addr::LOCALHOST,
            pid: 1,
            snapshot_path: snap,
        },
    )
    .unwrap();
    w.beat(unix_ms());
    // The default static route file is a fixed path of the machine
    // (/var/lib/lbagent/...): one in this directory that does not exist,
    // so that only the header's path can give a static answer.
    let c = Client::with_options(ClientOptions {
        heartbeat_path: hb,
        snapshot_path: dir.join("not-the-snapshot"),
        ..ClientOptions::default()
    })
    .unwrap();
    (w, c)
}

#[test]
fn a_heartbeat_with_an_impossible_shard_count_is_agent_down_and_static_answers() {
    // u32::MAX and 2^32 - 9000 wrap `base_port + shards - 1` past the port
    // check in u32; 1025 is past the agent's own bound. None may size a
    // table or pick a port.
    for (shards, base_port) in [(u32::MAX, 9000), (u32::MAX - 8999, 9000), (1_025, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let (_w, mut c) = hostile_heartbeat(dir.path(), shards, base_port);
        let e = c.agent().unwrap_err();
        assert!(
            matches!(&e, ClientError::AgentDown(m) if m.contains(&format!("{shards} shards, at most 1024"))),
            "{shards} shards: {e}"
        );
        let h = c.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!((h.addr, h.source), (node(1), HostSource::StaticRoutes));
        assert_eq!(
            c.get_route(M.modid, M.cmdid, T).unwrap_err().kind(),
            "agent_down"
        );
        assert_eq!(c.report(M.modid, M.cmdid, node(1), 0, 1), Ok(()));
    }
}

#[test]
fn a_heartbeat_base_port_above_65535_is_corruption_not_another_port() {
    let dir = tempfile::tempdir().unwrap();
    let (_w, mut c) = hostile_heartbeat(dir.path(), 1, 9000);
    // Read once while sound: the client learns the static route file.
    assert_eq!(c.agent().unwrap().base_port, 9000);
    // The base port's word at offset 28: 0x1_2345 would truncate to 0x2345.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("heartbeat"))
        .unwrap();
    f.write_all_at(&0x1_2345u32.to_ne_bytes(), 28).unwrap();
    // The header is re-read when the beat moves.
    _w.beat(unix_ms() + 1);
    let e = c.agent().unwrap_err();
    assert!(
        matches!(&e, ClientError::AgentDown(m) if m.contains("base port is 74565")),
        "{e}"
    );
    let h = c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(h.source, HostSource::StaticRoutes);
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
}

/// Runs `f` on a thread and fails the test if it takes more than `limit`
/// (a FIFO open used to block forever: the thread is then unblocked by
/// opening `fifo` for writing, so the test ends either way).
fn within<R: Send + 'static>(
    limit: Duration,
    fifo: &Path,
    f: impl FnOnce() -> R + Send + 'static,
) -> (R, Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = f();
        let _ = tx.send((r, t0.elapsed()));
    });
    match rx.recv_timeout(limit) {
        Ok(r) => {
            t.join().unwrap();
            r
        }
        Err(_) => {
            use std::os::unix::fs::OpenOptionsExt;
            let _w = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(fifo);
            panic!("still blocked after {limit:?} (the call's timeout is {T:?})");
        }
    }
}

#[test]
fn a_fifo_at_the_route_file_path_fails_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("routes.snapshot");
    mkfifo(&fifo);
    let opts = ClientOptions {
        heartbeat_path: dir.path().join("no-heartbeat"),
        snapshot_path: fifo.clone(),
        ..ClientOptions::default()
    };
    let (r, took) = within(T * 4, &fifo, move || {
        let mut c = Client::with_options(opts).unwrap();
        c.get_host(M.modid, M.cmdid, T)
    });
    assert!(
        matches!(&r, Err(ClientError::StaticRoutes(m)) if m.contains("is a FIFO, not a regular file")),
        "{r:?}"
    );
    assert!(took < T, "took {took:?}, timeout {T:?}");
}

#[test]
fn a_fifo_at_the_heartbeat_path_is_agent_down_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("heartbeat");
    mkfifo(&fifo);
    let snap = dir.path().join("routes.snapshot");
    write_snapshot(&snap, M, 1);
    let opts = ClientOptions {
        heartbeat_path: fifo.clone(),
        snapshot_path: snap,
        ..ClientOptions::default()
    };
    let (r, took) = within(T * 4, &fifo, move || {
        let mut c = Client::with_options(opts).unwrap();
        (c.get_host(M.modid, M.cmdid, T), c.agent())
    });
    let h = r.0.unwrap();
    assert_eq!((h.addr, h.source), (node(1), HostSource::StaticRoutes));
    assert!(
        matches!(&r.1, Err(ClientError::AgentDown(m)) if m.contains("is a FIFO")),
        "{:?}",
        r.1
    );
    assert!(took < T * 2, "took {took:?} for two calls, timeout {T:?}");
}

#[test]
fn a_directory_a_device_or_a_huge_file_at_either_path_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let huge = dir.path().join("huge");
    // Sparse: past the bound without using the disk.
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(snapshot::MAX_LEN + 1)
        .unwrap();
    // A valid header that claims a 4 GiB payload.
    let claims = dir.path().join("claims");
    write_snapshot(&claims, M, 1);
    let mut bytes = std::fs::read(&claims).unwrap();
    bytes[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&claims, &bytes).unwrap();
    let cases: [(PathBuf, &str); 4] = [
        (
            dir.path().to_path_buf(),
            "is a directory, not a regular file",
        ),
        (
            PathBuf::from("/dev/zero"),
            "is a character device, not a regular file",
        ),
        (huge, "too large"),
        (claims, "too large"),
    ];
    for (path, says) in cases {
        let mut c = Client::with_options(ClientOptions {
            heartbeat_path: dir.path().join("no-heartbeat"),
            snapshot_path: path.clone(),
            ..ClientOptions::default()
        })
        .unwrap();
        let r = c.get_host(M.modid, M.cmdid, T);
        assert!(
            matches!(&r, Err(ClientError::StaticRoutes(m)) if m.contains(says)),
            "{}: {r:?}",
            path.display()
        );
    }
    for (path, says) in [
        (dir.path().to_path_buf(), "is a directory"),
        (PathBuf::from("/dev/zero"), "is a character device"),
    ] {
        let mut c = Client::with_options(ClientOptions {
            heartbeat_path: path.clone(),
            static_fallback: false,
            ..ClientOptions::default()
        })
        .unwrap();
        let r = c.get_host(M.modid, M.cmdid, T);
        assert!(
            matches!(&r, Err(ClientError::AgentDown(m)) if m.contains(says)),
            "{}: {r:?}",
            path.display()
        );
    }
}

#[test]
fn a_stale_heartbeat_names_the_route_file_to_use() {
    let dir = tempfile::tempdir().unwrap();
    let published = dir.path().join("published.snapshot");
    write_snapshot(&published, M, 1);
    let hb = dir.path().join("heartbeat");
    let w = HeartbeatWriter::create(
        &hb,
        &AgentInfo {
            shards: 1,
            base_port: 1,
            bind: Ipv4Addr::LOCALHOST,
            pid: 1,
            snapshot_path: published,
        },
    )
    .unwrap();
    w.beat(unix_ms() - 5_000);
    let mut c = Client::with_options(ClientOptions {
        heartbeat_path: hb,
        snapshot_path: dir.path().join("default.snapshot"),
        ..ClientOptions::default()
    })
    .unwrap();
    let h = c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!((h.addr, h.source), (node(1), HostSource::StaticRoutes));
}

// === fake agents ===

/// A fake agent: one UDP socket as its only shard, a heartbeat beaten every
/// 20 ms by the agent's own writer, and a script that answers each
/// datagram with any datagrams it likes. Every datagram received is kept.
struct FakeAgent {
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    beating: Arc<AtomicBool>,
    received: Arc<Mutex<Vec<Vec<u8>>>>,
    threads: Vec<JoinHandle<()>>,
}

type Script = Box<dyn FnMut(&[u8]) -> Vec<Vec<u8>> + Send>;

impl FakeAgent {
    fn start(dir: &Path, mut script: Script) -> FakeAgent {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let port = sock.local_addr().unwrap().port();
        let writer = HeartbeatWriter::create(
            &dir.join("heartbeat"),
            &AgentInfo {
                shards: 1,
                base_port: port,
                bind: Ipv4Addr::LOCALHOST,
                pid: std::process::id(),
                snapshot_path: dir.join("routes.snapshot"),
            },
        )
        .unwrap();
        writer.beat(unix_ms());
        let stop = Arc::new(AtomicBool::new(false));
        let beating = Arc::new(AtomicBool::new(true));
        let received = Arc::new(Mutex::new(Vec::new()));
        let (s, b) = (stop.clone(), beating.clone());
        let beat = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                if b.load(Ordering::SeqCst) {
                    writer.beat(unix_ms());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let (s, r) = (stop.clone(), received.clone());
        let serve = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !s.load(Ordering::SeqCst) {
                let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                r.lock().unwrap().push(buf[..n].to_vec());
                for answer in script(&buf[..n]) {
                    let _ = sock.send_to(&answer, peer);
                }
            }
        });
        FakeAgent {
            dir: dir.to_path_buf(),
            stop,
            beating,
            received,
            threads: vec![beat, serve],
        }
    }

    fn options(&self) -> ClientOptions {
        ClientOptions {
            heartbeat_path: self.dir.join("heartbeat"),
            ..ClientOptions::default()
        }
    }

    fn received(&self) -> Vec<Vec<u8>> {
        self.received.lock().unwrap().clone()
    }

    /// Waits (5 s at most) for the next beat: one every 20 ms, unless a
    /// loaded machine keeps the beating thread off its core for longer.
    fn next_beat(&self) {
        let r = HeartbeatReader::open(&self.dir.join("heartbeat")).unwrap();
        let last = r.beat_unix_ms().unwrap();
        wait_for(Duration::from_secs(5), || {
            (r.beat_unix_ms().unwrap() != last).then_some(())
        })
        .expect("the fake agent beats again within 5 s");
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// (kind, seq, module) of a request.
fn request(bytes: &[u8]) -> (&'static str, u32, ModuleId) {
    let msg = decode(bytes, &Limits::UDP).expect("the client sends valid datagrams");
    let (seq, modid, cmdid) = match msg {
        Message::GetHostReq(r) => (r.seq(), r.modid(), r.cmdid()),
        Message::RegisterReq(r) => (r.seq(), r.modid(), r.cmdid()),
        Message::GetRouteReq(r) => (r.seq(), r.modid(), r.cmdid()),
        Message::CacheGetRouteReq(r) => (r.seq(), r.modid(), r.cmdid()),
        Message::ReportReq(r) => (r.seq(), r.modid(), r.cmdid()),
        Message::BatchReportReq(r) => (r.seq(), r.modid(), r.cmdid()),
        other => panic!("unexpected {}", other.name()),
    };
    (msg.name(), seq, ModuleId::new(modid, cmdid))
}

// What the typed-errors fake agent does, switched between calls.
const ANSWER_OK: u8 = 0;
const NO_SUCH_MODULE: u8 = 1;
const OVERLOADED: u8 = 2;
const REJECTED: u8 = 3;
const BAD_REQUEST: u8 = 4;
const UNAVAILABLE: u8 = 5;
const GARBAGE: u8 = 6;
const OTHER_MODULE: u8 = 7;
const SILENT: u8 = 8;
const STALE_ONLY: u8 = 9;
const STALE_THEN_OK: u8 = 10;
const LOSE_TWO: u8 = 11;
const WRONG_KIND: u8 = 12;

fn typed_script(mode: Arc<AtomicU8>) -> Script {
    let mut enc = Encoder::new();
    let mut copies = 0u32;
    Box::new(move |bytes| {
        let (kind, seq, module) = request(bytes);
        let ok_host = Some(node(7));
        let answer = |enc: &mut Encoder, rc: RetCode, host: Option<NodeAddr>| match kind {
            "GetHostReq" => enc.get_host_resp(seq, module, rc, host, None).to_vec(),
            "RegisterReq" => enc.register_resp(seq, module, rc, 0).to_vec(),
            "GetRouteReq" => enc.get_route_resp(seq, module, rc, 0, &[]).to_vec(),
            other => panic!("unexpected {other}"),
        };
        match mode.load(Ordering::SeqCst) {
            ANSWER_OK => vec![answer(&mut enc, RetCode::Ok, ok_host)],
            NO_SUCH_MODULE => vec![answer(&mut enc, RetCode::NoSuchModule, None)],
            OVERLOADED => vec![answer(&mut enc, RetCode::Overloaded, None)],
            REJECTED => vec![answer(&mut enc, RetCode::Rejected, None)],
            BAD_REQUEST => vec![enc
                .error_resp(
                    u64::from(seq),
                    module,
                    RetCode::BadRequest,
                    "priority out of range",
                )
                .to_vec()],
            UNAVAILABLE => vec![enc
                .error_resp(u64::from(seq), module, RetCode::Unavailable, "draining")
                .to_vec()],
            GARBAGE => vec![b"this is not an lbagent message at all".to_vec()],
            OTHER_MODULE => vec![enc
                .get_host_resp(seq, ModuleId::new(1, 1), RetCode::Ok, ok_host, None)
                .to_vec()],
            SILENT => vec![],
            STALE_ONLY => vec![enc
                .get_host_resp(seq.wrapping_sub(1), module, RetCode::Ok, ok_host, None)
                .to_vec()],
            STALE_THEN_OK => vec![
                enc.get_host_resp(seq.wrapping_sub(1), module, RetCode::Overloaded, None, None)
                    .to_vec(),
                enc.get_host_resp(seq, module, RetCode::Ok, ok_host, None)
                    .to_vec(),
            ],
            LOSE_TWO => {
                copies += 1;
                if copies % 3 == 0 {
                    vec![answer(&mut enc, RetCode::Ok, ok_host)]
                } else {
                    vec![]
                }
            }
            WRONG_KIND => vec![enc.keep_alive(u64::from(seq)).to_vec()],
            other => panic!("mode {other}"),
        }
    })
}

#[test]
fn every_failure_is_its_own_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let mode = Arc::new(AtomicU8::new(ANSWER_OK));
    let fake = FakeAgent::start(dir.path(), typed_script(mode.clone()));
    // No static route file exists: a timeout stays a timeout.
    let mut c = Client::with_options(fake.options()).unwrap();
    // The modes that are answered get the long timeout (a loaded machine
    // can keep the fake agent's thread off its core for longer than a short
    // one); the two that must time out wait 1 s.
    let mut get = |m: u8| {
        mode.store(m, Ordering::SeqCst);
        let timeout = if m == SILENT || m == STALE_ONLY {
            Duration::from_secs(1)
        } else {
            T
        };
        c.get_host(M.modid, M.cmdid, timeout)
    };
    assert_eq!(get(ANSWER_OK).unwrap().addr, node(7));
    assert_eq!(
        get(NO_SUCH_MODULE),
        Err(ClientError::NoSuchModule { module: M })
    );
    assert_eq!(get(OVERLOADED), Err(ClientError::Overloaded { module: M }));
    assert_eq!(get(REJECTED), Err(ClientError::Rejected { module: M }));
    let e = get(BAD_REQUEST).unwrap_err();
    assert!(
        matches!(&e, ClientError::BadRequest(m) if m.contains("priority out of range")),
        "{e}"
    );
    assert_eq!(get(UNAVAILABLE).unwrap_err().kind(), "agent_down");
    let e = get(GARBAGE).unwrap_err();
    assert!(
        matches!(&e, ClientError::BadResponse(m) if m.contains("undecodable")),
        "{e}"
    );
    let e = get(OTHER_MODULE).unwrap_err();
    assert!(
        matches!(&e, ClientError::BadResponse(m) if m.contains("[1, 1]")),
        "{e}"
    );
    let e = get(WRONG_KIND).unwrap_err();
    assert!(
        matches!(&e, ClientError::BadResponse(m) if m.contains("KeepAlive")),
        "{e}"
    );
    let t0 = Instant::now();
    let e = get(SILENT).unwrap_err();
    assert!(
        matches!(e, ClientError::Timeout { module: M, waited } if waited >= Duration::from_secs(1)),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A shard that timed out is not asked again until the heartbeat moves
    // (every 20 ms here): the next call is answered again.
    fake.next_beat();
    assert_eq!(get(ANSWER_OK).unwrap().source, HostSource::Agent);
    assert_eq!(
        get(STALE_ONLY).unwrap_err().kind(),
        "timeout",
        "stale answers are discarded"
    );
    fake.next_beat();
    assert_eq!(
        get(STALE_THEN_OK).unwrap().addr,
        node(7),
        "the stale overload is skipped"
    );
    let t0 = Instant::now();
    assert_eq!(get(LOSE_TWO).unwrap().addr, node(7), "re-sent twice");
    assert!(
        t0.elapsed() >= Duration::from_millis(100),
        "two copies lost, 50 ms apart"
    );

    mode.store(NO_SUCH_MODULE, Ordering::SeqCst);
    assert_eq!(
        c.register(M.modid, M.cmdid, T).unwrap_err().kind(),
        "no_such_module"
    );
    assert_eq!(
        c.get_route(M.modid, M.cmdid, T).unwrap_err().kind(),
        "no_such_module"
    );

    // Sequence numbers only grow (copies of one request share theirs).
    let seqs: Vec<u32> = fake.received().iter().map(|d| request(d).1).collect();
    assert!(seqs.windows(2).all(|w| w[1] >= w[0]), "{seqs:?}");
}

#[test]
fn register_timeout_and_agent_down_are_typed() {
    let dir = tempfile::tempdir().unwrap();
    let mut enc = Encoder::new();
    let fake = FakeAgent::start(
        dir.path(),
        Box::new(move |bytes| {
            let msg = decode(bytes, &Limits::UDP).unwrap();
            match msg {
                Message::RegisterReq(r) => {
                    assert!(
                        r.timeout_ms() >= 1 && r.timeout_ms() <= 300,
                        "{}",
                        r.timeout_ms()
                    );
                    let m = ModuleId::new(r.modid(), r.cmdid());
                    vec![enc.register_resp(r.seq(), m, RetCode::Timeout, 0).to_vec()]
                }
                _ => vec![],
            }
        }),
    );
    let mut c = Client::with_options(fake.options()).unwrap();
    let e = c
        .register(M.modid, M.cmdid, Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(e, ClientError::Timeout { module: M, .. }), "{e}");

    // The heartbeat stops: after 2 s the agent is down.
    fake.beating.store(false, Ordering::SeqCst);
    let mut strict = Client::with_options(ClientOptions {
        static_fallback: false,
        ..fake.options()
    })
    .unwrap();
    // (The fake agent does not answer a getHost: each call times out until
    // then, after a short timeout of its own; the wait is long.)
    let e = wait_for(Duration::from_secs(12), || {
        strict
            .get_host(M.modid, M.cmdid, Duration::from_millis(300))
            .err()
            .filter(|e| e.kind() == "agent_down")
    })
    .expect("agent down once the heartbeat is 2 s old");
    assert!(e.to_string().contains("ms ago"), "{e}");
}

#[test]
fn a_closed_port_with_a_fresh_heartbeat_is_agent_down_at_once() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there (a port bound and released here could be
    // another test's socket by the time the client sends to it).
    let port = common::nowhere().port();
    let w = HeartbeatWriter::create(
        &dir.path().join("heartbeat"),
        &AgentInfo {
            shards: 1,
            base_port: port,
            bind: Ipv4Addr::LOCALHOST,
            pid: 1,
            snapshot_path: dir.path().join("routes.snapshot"),
        },
    )
    .unwrap();
    w.beat(unix_ms());
    let opts = ClientOptions {
        heartbeat_path: dir.path().join("heartbeat"),
        static_fallback: false,
        ..ClientOptions::default()
    };
    let mut c = Client::with_options(opts.clone()).unwrap();
    // Refused at once, not after the (long) timeout; the margin between
    // is for a stall of a busy machine.
    let t0 = Instant::now();
    let e = c
        .get_host(M.modid, M.cmdid, Duration::from_secs(20))
        .unwrap_err();
    assert!(
        matches!(&e, ClientError::AgentDown(m) if m.contains("refused")),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "not a timeout");
    assert_eq!(
        c.get_route(M.modid, M.cmdid, T).unwrap_err().kind(),
        "agent_down"
    );

    // With static fallback the file answers.
    write_snapshot(&dir.path().join("routes.snapshot"), M, 1);
    let mut c = Client::with_options(ClientOptions {
        static_fallback: true,
        ..opts
    })
    .unwrap();
    let h = c
        .get_host(M.modid, M.cmdid, Duration::from_secs(3))
        .unwrap();
    assert_eq!((h.addr, h.source), (node(1), HostSource::StaticRoutes));
}

// === the route cache ===

#[test]
fn the_cache_holds_successes_and_a_failure_sends_them_first_as_the_agent_sees() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 2, 1);
    let mut view = agent.client();
    let mut c = Client::with_options(ClientOptions {
        cache: true,
        ..agent.options()
    })
    .unwrap();
    let hosts: Vec<NodeAddr> = (0..4)
        .map(|_| {
            let h = c.get_host(M.modid, M.cmdid, T).unwrap();
            assert_eq!(h.source, HostSource::Cache);
            h.addr
        })
        .collect();
    assert_ne!(hosts[0], hosts[1], "round robin: {hosts:?}");
    assert_eq!(hosts[0], hosts[2]);

    for _ in 0..5 {
        c.report(M.modid, M.cmdid, node(1), 0, 1).unwrap();
    }
    // Sent datagrams are in the agent's queue before the view's request:
    // nothing arrived, the successes are held.
    assert_eq!(counters(&mut view, node(1)), (0, 0, 0, 0, 180, 0));

    c.report(M.modid, M.cmdid, node(1), -1, 0).unwrap();
    // Five successes, then one failure: had the failure come first the
    // node would show 5 consecutive successes and 0 consecutive errors.
    let after = wait_for(Duration::from_secs(10), || {
        let c = counters(&mut view, node(1));
        (c.1 == 1).then_some(c)
    })
    .expect("the failure arrives at once");
    assert_eq!(after, (5, 1, 0, 1, 185, 1));

    // Held successes are flushed on drop.
    for _ in 0..3 {
        c.report(M.modid, M.cmdid, node(2), 0, 1).unwrap();
    }
    assert_eq!(counters(&mut view, node(2)).0, 0);
    drop(c);
    assert_eq!(counters(&mut view, node(2)).0, 3);
}

#[test]
fn with_an_overloaded_node_the_cache_goes_through_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 2, 1);
    let mut c = Client::with_options(ClientOptions {
        cache: true,
        ..agent.options()
    })
    .unwrap();
    assert_eq!(
        c.get_host(M.modid, M.cmdid, T).unwrap().source,
        HostSource::Cache
    );
    for _ in 0..15 {
        c.report(M.modid, M.cmdid, node(1), -1, 0).unwrap();
    }
    let mut view = agent.client();
    wait_for(Duration::from_secs(10), || {
        let v = view.get_route(M.modid, M.cmdid, T).ok()?;
        v.nodes.iter().any(|n| n.overloaded).then_some(())
    })
    .expect("node 1 overloaded");
    // The failures made the cache refresh: it learns a node is overloaded.
    for _ in 0..9 {
        let h = c.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::Agent);
        assert_eq!(h.addr, node(2), "the agent steers away from node 1");
    }
}

#[test]
fn the_cache_sends_exactly_a_batch_then_the_failure_and_refreshes_by_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut enc = Encoder::new();
    let route = nodes(2);
    let fake = FakeAgent::start(
        dir.path(),
        Box::new(move |bytes| match decode(bytes, &Limits::UDP).unwrap() {
            Message::CacheGetRouteReq(r) => {
                let unchanged = r.known_version() == 7;
                let resp = CacheRoute {
                    seq: r.seq(),
                    module: ModuleId::new(r.modid(), r.cmdid()),
                    retcode: RetCode::Ok,
                    version: 7,
                    unchanged,
                    any_overloaded: false,
                    nodes: if unchanged { &[] } else { &route },
                };
                vec![enc.cache_get_route_resp(&resp).to_vec()]
            }
            _ => vec![],
        }),
    );
    let mut c = Client::with_options(ClientOptions {
        cache: true,
        ..fake.options()
    })
    .unwrap();
    let first = c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(first.source, HostSource::Cache);
    for n in [1, 1, 2] {
        c.report(M.modid, M.cmdid, node(n), 0, 1).unwrap();
    }
    c.report(M.modid, M.cmdid, node(1), 5, 700).unwrap();
    // The next getHost refreshes (a failure was reported), naming version 7.
    let second = c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(second.source, HostSource::Cache);
    assert_ne!(
        first.addr, second.addr,
        "round robin goes on over the route held"
    );
    c.report(M.modid, M.cmdid, node(2), 0, 1).unwrap();
    drop(c);

    let got = wait_for(Duration::from_secs(10), || {
        let r = fake.received();
        (r.len() >= 5).then_some(r)
    })
    .expect("five datagrams");
    assert_eq!(got.len(), 5, "nothing else was sent");
    let msgs: Vec<Message<'_>> = got
        .iter()
        .map(|d| decode(d, &Limits::UDP).unwrap())
        .collect();
    assert!(matches!(msgs[0], Message::CacheGetRouteReq(r) if r.known_version() == 0));
    let Message::BatchReportReq(b) = msgs[1] else {
        panic!("{} where the batch was expected", msgs[1].name())
    };
    let held: Vec<(NodeAddr, u32)> = b
        .successes()
        .unwrap()
        .iter()
        .map(|s| (NodeAddr::from(s.host()), s.count()))
        .collect();
    assert_eq!(held, vec![(node(1), 2), (node(2), 1)]);
    let Message::ReportReq(f) = msgs[2] else {
        panic!("{} where the failure was expected", msgs[2].name())
    };
    assert_eq!((f.retcode(), f.tcost_ms()), (5, 700));
    assert_eq!(NodeAddr::from(f.host().unwrap()), node(1));
    assert!(matches!(msgs[3], Message::CacheGetRouteReq(r) if r.known_version() == 7));
    let Message::BatchReportReq(b) = msgs[4] else {
        panic!("{} where the flush on drop was expected", msgs[4].name())
    };
    assert_eq!(b.successes().unwrap().len(), 1);
}
