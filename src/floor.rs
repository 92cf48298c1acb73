//! The floor: the least work any server of this wire format must do per
//! getHost, measured beside the agent so that every throughput figure has a
//! baseline taken in the same run on the same machine.
//!
//! One thread, pinned to a core, runs a bare `recvmmsg` / `sendmmsg` loop
//! ([`crate::host::udp`]) on one UDP socket. Every getHost is read (to echo
//! its sequence number) the way the agent reads it (the verifier-free hot
//! path for a plain getHost or report, the full decode for anything else)
//! and answered with one fixed host, its answer patched into an encoded
//! template as the agent's is: no LB, no maps, no rings. Reports are decoded and ignored (the
//! agent does not answer them either). So that the client library and
//! `lbagent qpstest` can target the floor exactly like an agent, it also
//! answers register (Ok, version 1) and the route cache's getRoute (the one
//! fixed host, version 1), and a second thread writes a heartbeat file (one
//! shard, the floor's port) every second.
//!
//! This module must not grow logic: whatever it does per request, the agent
//! must do as well, or the comparison stops being a floor.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;
use std::{fmt, io};

use crate::host::clock;
use crate::host::heartbeat::{AgentInfo, HeartbeatWriter};
use crate::host::udp::{self, RecvBatch, SendBatch};
use crate::model::{ModuleId, NodeAddr, RouteNode};
use crate::qpstest::cpu;
use crate::wire::{decode, read_hot, CacheRoute, Encoder, Hot, Limits, Message, OkAnswer, RetCode};

/// The host every getHost is answered with: 10.0.0.1:80.
pub const FLOOR_HOST: NodeAddr = NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), 80);

/// The route version the floor answers register and cache getRoute with.
pub const FLOOR_ROUTE_VERSION: u64 = 1;

/// Datagrams moved per system call (as an agent shard).
const BATCH: usize = crate::agent::shard_rt::BATCH;

/// How long an idle loop waits for a datagram before it checks for stop.
const IDLE_POLL: Duration = Duration::from_millis(50);

/// How often the heartbeat is written (as the agent's control core).
const BEAT_EVERY: Duration = Duration::from_secs(1);

/// The thread names, as `/proc/PID/task/*/comm` shows them.
const SERVE_THREAD: &str = "lbagent-floor";
const BEAT_THREAD: &str = "lbagent-floor-hb";

/// How a floor is started.
#[derive(Clone, Debug)]
pub struct FloorOptions {
    /// The address to bind. Default 127.0.0.1.
    pub bind: Ipv4Addr,
    /// The UDP port; 0 picks a free one. Default 0.
    pub port: u16,
    /// The heartbeat file to write (its directory must exist).
    pub heartbeat_path: PathBuf,
    /// The core to pin the serving thread to (None: not pinned). Default
    /// `Some(0)`, where an agent's shard 0 runs.
    pub core: Option<usize>,
}

impl FloorOptions {
    /// The defaults, writing the heartbeat at `heartbeat_path`.
    pub fn new(heartbeat_path: impl Into<PathBuf>) -> Self {
        FloorOptions {
            bind: Ipv4Addr::LOCALHOST,
            port: 0,
            heartbeat_path: heartbeat_path.into(),
            core: Some(0),
        }
    }
}

/// What the serving thread counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloorCounts {
    /// getHosts answered.
    pub get_hosts: u64,
    /// Reports (single or batch) received and ignored.
    pub reports: u64,
    /// Register and cache getRoute requests answered.
    pub other: u64,
    /// Datagrams that did not decode, or that no server answers.
    pub dropped: u64,
}

#[derive(Default)]
struct Counters {
    get_hosts: AtomicU64,
    reports: AtomicU64,
    other: AtomicU64,
    dropped: AtomicU64,
}

/// A running floor. Dropping it stops it.
pub struct Floor {
    port: u16,
    heartbeat_path: PathBuf,
    serve_tid: u32,
    pinned: bool,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    serve: Option<JoinHandle<()>>,
    beat: Option<JoinHandle<()>>,
}

impl Floor {
    /// Binds the socket, writes the first heartbeat and starts the serving
    /// and heartbeat threads. The floor answers as soon as this returns.
    ///
    /// # Errors
    /// The socket cannot be bound, the heartbeat file cannot be created, or
    /// a thread cannot be spawned.
    pub fn start(opts: FloorOptions) -> io::Result<Floor> {
        let socket = UdpSocket::bind((opts.bind, opts.port))?;
        socket.set_nonblocking(true)?;
        let port = socket.local_addr()?.port();
        let info = AgentInfo {
            shards: 1,
            base_port: port,
            bind: opts.bind,
            pid: std::process::id(),
            // The floor keeps no routes: a client that finds it down gets a
            // clear "no static route file" error, never a host.
            snapshot_path: opts.heartbeat_path.with_extension("no-routes"),
        };
        let heartbeat = HeartbeatWriter::create(&opts.heartbeat_path, &info)
            .map_err(|e| io::Error::other(e.to_string()))?;
        heartbeat.beat(clock::unix_ms());

        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (ready_tx, ready_rx) = mpsc::channel();
        let serve = {
            let (stop, counters) = (stop.clone(), counters.clone());
            std::thread::Builder::new()
                .name(SERVE_THREAD.into())
                .spawn(move || {
                    let pinned = opts.core.is_some_and(|id| {
                        core_affinity::set_for_current(core_affinity::CoreId { id })
                    });
                    let _ = ready_tx.send((cpu::current_tid(), pinned));
                    serve(&socket, &stop, &counters);
                })?
        };
        let Ok((serve_tid, pinned)) = ready_rx.recv() else {
            let _ = serve.join();
            return Err(io::Error::other("the floor's serving thread died at start"));
        };
        let beat = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(BEAT_THREAD.into())
                .spawn(move || loop {
                    std::thread::park_timeout(BEAT_EVERY);
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    heartbeat.beat(clock::unix_ms());
                })
        };
        let beat = match beat {
            Ok(b) => b,
            Err(e) => {
                stop.store(true, Ordering::Release);
                let _ = serve.join();
                return Err(e);
            }
        };
        Ok(Floor {
            port,
            heartbeat_path: opts.heartbeat_path,
            serve_tid,
            pinned,
            stop,
            counters,
            serve: Some(serve),
            beat: Some(beat),
        })
    }

    /// The UDP port the floor answers on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The heartbeat file it writes: give it to the client library
    /// (`ClientOptions::heartbeat_path`) to target the floor.
    pub fn heartbeat_path(&self) -> &Path {
        &self.heartbeat_path
    }

    /// True when the serving thread is pinned to the requested core.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// CPU seconds (user + system) the serving thread has used so far.
    ///
    /// # Errors
    /// Its `/proc` stat file cannot be read (no `/proc`), or the floor has
    /// stopped.
    pub fn server_cpu_seconds(&self) -> io::Result<f64> {
        cpu::thread_cpu_seconds(self.serve_tid)
    }

    /// What the serving thread has counted so far.
    pub fn counts(&self) -> FloorCounts {
        let c = &self.counters;
        FloorCounts {
            get_hosts: c.get_hosts.load(Ordering::Relaxed),
            reports: c.reports.load(Ordering::Relaxed),
            other: c.other.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
        }
    }

    /// Stops both threads and waits for them (at most one idle poll, 50 ms).
    /// The heartbeat file stays, with its last beat: clients see the floor
    /// as down once it is 2 s old.
    ///
    /// # Errors
    /// A thread panicked.
    pub fn stop(mut self) -> io::Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> io::Result<()> {
        self.stop.store(true, Ordering::Release);
        let mut panicked = false;
        if let Some(b) = self.beat.take() {
            b.thread().unpark();
            panicked |= b.join().is_err();
        }
        if let Some(s) = self.serve.take() {
            panicked |= s.join().is_err();
        }
        if panicked {
            return Err(io::Error::other("a floor thread panicked"));
        }
        Ok(())
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

impl fmt::Debug for Floor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Floor")
            .field("port", &self.port)
            .field("heartbeat_path", &self.heartbeat_path)
            .field("pinned", &self.pinned)
            .finish_non_exhaustive()
    }
}

/// The serving loop: receive a batch, answer it, send the batch.
fn serve(socket: &UdpSocket, stop: &AtomicBool, counters: &Counters) {
    let fd = socket.as_raw_fd();
    let mut rx = RecvBatch::new(BATCH);
    let mut tx = SendBatch::new();
    let mut answer = Answerer::new();
    while !stop.load(Ordering::Relaxed) {
        // An error (a pending ICMP error from an earlier send, or worse)
        // counts as an empty batch: wait, then go on; the loop must outlive
        // any one bad peer.
        let n = rx.recv(fd).unwrap_or_default();
        if n == 0 {
            udp::wait_readable(fd, IDLE_POLL);
            continue;
        }
        let mut local = FloorCounts::default();
        for i in 0..n {
            let (bytes, peer, truncated) = rx.get(i);
            if truncated {
                local.dropped += 1;
                continue;
            }
            answer.handle(bytes, peer, &mut tx, &mut local);
        }
        // Counted before the answers leave, so that a client holding an
        // answer sees it counted.
        counters
            .get_hosts
            .fetch_add(local.get_hosts, Ordering::Relaxed);
        counters.reports.fetch_add(local.reports, Ordering::Relaxed);
        counters.other.fetch_add(local.other, Ordering::Relaxed);
        counters.dropped.fetch_add(local.dropped, Ordering::Relaxed);
        tx.flush(fd);
    }
}

/// Decodes one datagram and queues its answer, if it has one.
///
/// The least work the agent does too: a plain getHost or a report is read
/// from the bytes without the verifier (`wire::read_hot`, the agent's hot
/// path) and a getHost's answer is the encoded template with its sequence
/// and module patched in (`wire::OkAnswer`); anything else takes the full
/// decode and a full encoding, as in the agent.
struct Answerer {
    enc: Encoder,
    ok: OkAnswer,
    route: [RouteNode; 1],
}

impl Answerer {
    fn new() -> Self {
        let mut enc = Encoder::with_capacity(1024);
        let ok = OkAnswer::new(&mut enc, None);
        Answerer {
            enc,
            ok,
            route: [RouteNode {
                addr: FLOOR_HOST,
                weight: 1,
            }],
        }
    }

    fn handle(&mut self, bytes: &[u8], peer: SocketAddr, tx: &mut SendBatch, n: &mut FloorCounts) {
        match read_hot(bytes, &Limits::UDP) {
            Some(Hot::GetHost(g)) => {
                tx.push(
                    peer,
                    self.ok
                        .answer_or_encode(&mut self.enc, g.seq, g.module, FLOOR_HOST),
                );
                n.get_hosts += 1;
                return;
            }
            Some(Hot::Report(_)) => {
                n.reports += 1;
                return;
            }
            None => {}
        }
        match decode(bytes, &Limits::UDP) {
            Ok(Message::GetHostReq(r)) => {
                let m = ModuleId::new(r.modid(), r.cmdid());
                tx.push(
                    peer,
                    self.enc
                        .get_host_resp(r.seq(), m, RetCode::Ok, Some(FLOOR_HOST), None),
                );
                n.get_hosts += 1;
            }
            Ok(Message::ReportReq(_) | Message::BatchReportReq(_)) => n.reports += 1,
            Ok(Message::RegisterReq(r)) => {
                let m = ModuleId::new(r.modid(), r.cmdid());
                tx.push(
                    peer,
                    self.enc
                        .register_resp(r.seq(), m, RetCode::Ok, FLOOR_ROUTE_VERSION),
                );
                n.other += 1;
            }
            Ok(Message::CacheGetRouteReq(r)) => {
                let unchanged = r.known_version() == FLOOR_ROUTE_VERSION;
                let resp = CacheRoute {
                    seq: r.seq(),
                    module: ModuleId::new(r.modid(), r.cmdid()),
                    retcode: RetCode::Ok,
                    version: FLOOR_ROUTE_VERSION,
                    unchanged,
                    any_overloaded: false,
                    nodes: if unchanged { &[] } else { &self.route },
                };
                tx.push(peer, self.enc.cache_get_route_resp(&resp));
                n.other += 1;
            }
            _ => n.dropped += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::heartbeat::HeartbeatReader;
    use crate::wire::Report;

    fn ask(sock: &UdpSocket, bytes: &[u8]) -> Option<Vec<u8>> {
        sock.send(bytes).unwrap();
        let mut buf = [0u8; 2048];
        sock.recv(&mut buf).ok().map(|n| buf[..n].to_vec())
    }

    fn client(floor: &Floor) -> UdpSocket {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.connect(("127.0.0.1", floor.port())).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s
    }

    fn start(dir: &tempfile::TempDir) -> Floor {
        Floor::start(FloorOptions {
            core: None,
            ..FloorOptions::new(dir.path().join("hb"))
        })
        .unwrap()
    }

    #[test]
    fn answers_get_host_with_the_fixed_host_and_echoes_seq() {
        let dir = tempfile::tempdir().unwrap();
        let floor = start(&dir);
        let s = client(&floor);
        let mut enc = Encoder::new();
        for seq in [1u32, 77, u32::MAX] {
            let got = ask(&s, enc.get_host_req(seq, ModuleId::new(9, 3), 0, 0)).unwrap();
            let Ok(Message::GetHostResp(r)) = decode(&got, &Limits::UDP) else {
                panic!("not a getHost answer");
            };
            assert_eq!((r.seq(), r.modid(), r.cmdid()), (seq, 9, 3));
            assert_eq!(r.retcode(), RetCode::Ok);
            assert_eq!(r.host().map(NodeAddr::from), Some(FLOOR_HOST));
        }
        assert_eq!(floor.counts().get_hosts, 3);
        floor.stop().unwrap();
    }

    #[test]
    fn ignores_reports_and_drops_garbage_but_keeps_serving() {
        let dir = tempfile::tempdir().unwrap();
        let floor = start(&dir);
        let s = client(&floor);
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut enc = Encoder::new();
        let report = Report {
            seq: 5,
            module: ModuleId::new(1, 1),
            host: FLOOR_HOST,
            retcode: 0,
            tcost_ms: 3,
            downstream_level: None,
            consumed: 0,
        };
        assert_eq!(ask(&s, enc.report_req(&report)), None);
        assert_eq!(ask(&s, b"not a flatbuffer at all"), None);
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert!(ask(&s, enc.get_host_req(6, ModuleId::new(1, 1), 0, 0)).is_some());
        let c = floor.counts();
        assert_eq!((c.reports, c.dropped, c.get_hosts), (1, 1, 1));
    }

    #[test]
    fn answers_register_and_cache_get_route_like_an_agent_with_one_node() {
        let dir = tempfile::tempdir().unwrap();
        let floor = start(&dir);
        let s = client(&floor);
        let mut enc = Encoder::new();
        let m = ModuleId::new(4, 2);
        let got = ask(&s, enc.register_req(10, m, 100)).unwrap();
        let Ok(Message::RegisterResp(r)) = decode(&got, &Limits::UDP) else {
            panic!("not a register answer");
        };
        assert_eq!((r.seq(), r.retcode(), r.version()), (10, RetCode::Ok, 1));

        let got = ask(&s, enc.cache_get_route_req(11, m, 0)).unwrap();
        let Ok(Message::CacheGetRouteResp(r)) = decode(&got, &Limits::UDP) else {
            panic!("not a cache route answer");
        };
        assert!(!r.unchanged() && !r.any_overloaded());
        assert_eq!(r.nodes().map(|n| n.len()), Some(1));
        let got = ask(&s, enc.cache_get_route_req(12, m, 1)).unwrap();
        let Ok(Message::CacheGetRouteResp(r)) = decode(&got, &Limits::UDP) else {
            panic!("not a cache route answer");
        };
        assert!(r.unchanged());
    }

    #[test]
    fn writes_a_heartbeat_naming_its_port_and_stops_promptly() {
        let dir = tempfile::tempdir().unwrap();
        let floor = start(&dir);
        let hb = HeartbeatReader::open(floor.heartbeat_path())
            .unwrap()
            .read()
            .unwrap();
        assert_eq!(hb.info.shards, 1);
        assert_eq!(hb.info.base_port, floor.port());
        assert_eq!(hb.info.pid, std::process::id());
        assert!(hb.beat_unix_ms > 0);
        assert!(floor.server_cpu_seconds().is_ok());
        let t0 = std::time::Instant::now();
        floor.stop().unwrap();
        // One idle poll (50 ms); the margin is for a stall of a busy
        // machine, and still fails a stop that hangs.
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_port_in_use_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let taken = UdpSocket::bind("127.0.0.1:0").unwrap();
        let err = Floor::start(FloorOptions {
            port: taken.local_addr().unwrap().port(),
            ..FloorOptions::new(dir.path().join("hb"))
        })
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
    }
}
