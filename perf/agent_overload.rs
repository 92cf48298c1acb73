//! The agent's self-protection (issue 12 item 4, DAGOR on the agent's own
//! shards), measured on loopback against an embedded agent with one shard.
//!
//! 1. Saturation: open-loop senders flood the shard as fast as they can
//!    (shedding off); the answered rate is the shard's saturation rate S.
//! 2. At 2·S, open loop, with the priority mix (business priority 5 for
//!    20% of the getHosts, 60 for 80%; user priorities uniform), three
//!    runs: shedding off; `admission.agent_shedding` on; on, with callers
//!    that hold back below the level the shard attaches to its answers,
//!    decided by the client library's own [`HoldBack`] (the table
//!    `Client`'s uncached getHost consults; default freshness 100 ms), one
//!    per sender, fed by that sender's answers. The senders stay open-loop
//!    raw-UDP generators (a synchronous `Client` per thread could not offer
//!    2× the shard's rate from a few threads); the hold-back decision is
//!    the library's. A getHost a caller holds back counts as rejected.
//!
//! The two shedding runs are repeated with the shard socket's receive
//! buffer set to `--rcvbuf` bytes (`SO_RCVBUF`, set by this runner on the
//! embedded agent's socket; the kernel doubles it): a short kernel queue
//! bounds how long any datagram can wait, at the price of drops that do
//! not look at priorities.
//!
//! Per class: answered / Rejected / unanswered shares and the round trip
//! of the answered getHosts; the shard's own queuing-time histogram
//! (`lbagent_queuing_seconds`, all datagrams), read from its /metrics; and
//! the CPU this process (agent and senders together) used per second of
//! the measured part, in cores: at 2.0 on a 2-core machine the run is
//! CPU-bound, and the senders and the shard take turns on the cores.
//!
//! ```text
//! cargo bench --bench agent_overload -- [--seconds 3] [--senders 4] [--threshold-us 500] [--rcvbuf 32768]
//! ```

use std::io::{Read, Write as _};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use lbagent::admission::AdmissionLevel;
use lbagent::agent::udp::{RecvBatch, SendBatch};
use lbagent::client::holdback::{HoldBack, DEFAULT_HOLDBACK_MS};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::standalone::{Standalone, StandaloneOptions};
use lbagent::store::{self, StoreUrl};
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};

const MODULE: ModuleId = ModuleId::new(10_000, 1);
/// (business priority, share of the getHosts).
const MIX: [(u8, f64); 2] = [(5, 0.2), (60, 0.8)];
/// Send times are kept for this many outstanding getHosts per sender.
const RING: usize = 1 << 20;

struct Opts {
    seconds: u64,
    senders: usize,
    threshold_us: u64,
    rcvbuf: u64,
}

fn main() {
    let mut o = Opts {
        seconds: 3,
        senders: 4,
        threshold_us: 500,
        rcvbuf: 32_768,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |flag: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|&v| v > 0)
                .unwrap_or_else(|| {
                    eprintln!("agent_overload: {flag} takes a number above 0");
                    std::process::exit(2)
                })
        };
        match a.as_str() {
            "--seconds" => o.seconds = num("--seconds"),
            "--senders" => o.senders = num("--senders") as usize,
            "--threshold-us" => o.threshold_us = num("--threshold-us"),
            "--rcvbuf" => o.rcvbuf = num("--rcvbuf"),
            "--bench" => {}
            other => {
                eprintln!("agent_overload: unknown argument `{other}`");
                std::process::exit(2);
            }
        }
    }
    // Paced senders, rates doubling: the most the shard answered is its
    // saturation rate (senders flat out would take the cores from the
    // agent on a small machine and measure the senders instead).
    println!(
        "load average at the start: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let mut s = 0f64;
    for rate in [
        12_500.0, 25_000.0, 50_000.0, 100_000.0, 200_000.0, 400_000.0,
    ] {
        let r = run(&o, Mode::Off, None, Some(rate));
        println!(
            "saturation search: offered {:.0}/s, answered {:.0}/s",
            r.sent_rate(),
            r.answered_rate()
        );
        if r.answered_rate() < 0.9 * s {
            break;
        }
        s = s.max(r.answered_rate());
    }
    println!("saturation (shedding off): {s:.0} answered/s");
    println!(
        "\nat 2x saturation ({:.0}/s offered), mix {MIX:?}, threshold {} us:\n",
        2.0 * s,
        o.threshold_us
    );
    println!(
        "| run | receive buffer | class | offered/s | answered | rejected | unanswered | RTT p50 (µs) | RTT p99 (µs) | shard queuing p50 / p99 (µs, all datagrams) | CPU (cores) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let small = Some(o.rcvbuf);
    for (mode, rcvbuf) in [
        (Mode::Off, None),
        (Mode::Shedding, None),
        (Mode::Honouring, None),
        (Mode::Shedding, small),
        (Mode::Honouring, small),
    ] {
        let r = run(&o, mode, rcvbuf, Some(2.0 * s));
        for (c, &(b, _)) in MIX.iter().enumerate() {
            let k = &r.classes[c];
            let offered = (k.sent + k.held_back).max(1) as f64;
            let (p50, p99) = if k.rtt.is_empty() {
                (f64::NAN, f64::NAN)
            } else {
                (
                    k.rtt.value_at_quantile(0.5) as f64 / 1e3,
                    k.rtt.value_at_quantile(0.99) as f64 / 1e3,
                )
            };
            println!(
                "| {} | {} | {b} | {:.0} | {:.3} | {:.3} | {:.3} | {p50:.0} | {p99:.0} | {} | {:.2} |",
                mode.name(),
                r.rcvbuf,
                offered / r.seconds,
                k.ok as f64 / offered,
                (k.rejected + k.held_back) as f64 / offered,
                k.sent.saturating_sub(k.ok + k.rejected) as f64 / offered,
                r.queuing,
                r.cores,
            );
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Off,
    Shedding,
    Honouring,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Off => "shedding off",
            Mode::Shedding => "agent sheds",
            Mode::Honouring => "agent sheds, callers hold back (library HoldBack)",
        }
    }
}

struct Class {
    sent: u64,
    /// Not sent: the caller shed it below the agent's level.
    held_back: u64,
    ok: u64,
    rejected: u64,
    rtt: Histogram<u64>,
}

impl Default for Class {
    fn default() -> Self {
        Class {
            sent: 0,
            held_back: 0,
            ok: 0,
            rejected: 0,
            rtt: Histogram::new_with_bounds(1, 60_000_000_000, 2).expect("bounds"),
        }
    }
}

struct Run {
    seconds: f64,
    classes: Vec<Class>,
    queuing: String,
    /// The shard socket's receive buffer as the kernel reports it.
    rcvbuf: String,
    /// CPU seconds this process used per second measured.
    cores: f64,
}

impl Run {
    fn sent_rate(&self) -> f64 {
        self.classes.iter().map(|c| c.sent).sum::<u64>() as f64 / self.seconds
    }
    fn answered_rate(&self) -> f64 {
        self.classes.iter().map(|c| c.ok + c.rejected).sum::<u64>() as f64 / self.seconds
    }
}

/// One run against a fresh agent: `rate` getHosts per second in all
/// (None: as fast as the senders can), for the measured seconds after a
/// 1 s warm-up; with `rcvbuf`, the shard socket's receive buffer set to it.
fn run(o: &Opts, mode: Mode, rcvbuf: Option<u64>, rate: Option<f64>) -> Run {
    let dir = std::env::temp_dir().join(format!("lbagent-overload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    let url = StoreUrl::Sqlite(dir.join(lbagent::standalone::STORE_FILE));
    let nodes: Vec<(ModuleId, RouteNode)> = (1..=10u8)
        .map(|i| {
            let addr = NodeAddr::new(std::net::Ipv4Addr::new(10, 0, 0, i), 80);
            (MODULE, RouteNode { addr, weight: 1 })
        })
        .collect();
    store::open(&url)
        .and_then(|mut s| s.import_routes(&nodes, true))
        .expect("routes");
    let mut so = StandaloneOptions::ephemeral(&dir);
    so.config.agent.shards = 1;
    so.config.admission.agent_shedding = mode != Mode::Off;
    so.config.admission.agent_queuing_threshold_us = o.threshold_us;
    // Windows of 100 ms / 2000 datagrams: at hundreds of thousands per
    // second the count ends them every few milliseconds.
    so.config.admission.window_ms = 100;
    let system = Standalone::start(so).expect("standalone");
    let agent = SocketAddr::from(([127, 0, 0, 1], system.agent_ports()[0]));
    let metrics = system.metrics_addrs()[0];
    let rcvbuf = shard_rcvbuf(agent.port(), rcvbuf);
    warm(agent);

    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let results = Arc::new(Mutex::new(
        (0..MIX.len()).map(|_| Class::default()).collect::<Vec<_>>(),
    ));
    let mut threads = Vec::new();
    for t in 0..o.senders {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
        socket.connect(agent).expect("connect");
        let rx = socket.try_clone().expect("clone");
        let sent_at: Arc<Vec<AtomicU64>> = Arc::new((0..RING).map(|_| AtomicU64::new(0)).collect());
        // This sender's hold-back table (the one shard is shard 0).
        let level = Arc::new(Mutex::new(HoldBack::new(DEFAULT_HOLDBACK_MS)));
        let per_sender = rate.map(|r| r / o.senders as f64);
        let (stop_s, meas_s, level_s, res_s, sent_s) = (
            stop.clone(),
            measuring.clone(),
            level.clone(),
            results.clone(),
            sent_at.clone(),
        );
        threads.push(std::thread::spawn(move || {
            send_loop(
                &socket, agent, t as u64, per_sender, mode, &stop_s, &meas_s, &level_s, &sent_s,
                &res_s,
            )
        }));
        let (stop_r, meas_r, level_r, res_r) = (
            stop.clone(),
            measuring.clone(),
            level.clone(),
            results.clone(),
        );
        threads.push(std::thread::spawn(move || {
            recv_loop(&rx, &stop_r, &meas_r, &level_r, &sent_at, &res_r)
        }));
    }
    std::thread::sleep(Duration::from_secs(1));
    let q0 = queuing_buckets(metrics);
    let cpu0 = cpu_seconds();
    measuring.store(true, Relaxed);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(o.seconds));
    measuring.store(false, Relaxed);
    let seconds = t0.elapsed().as_secs_f64();
    let cores = (cpu_seconds() - cpu0) / seconds;
    let q1 = queuing_buckets(metrics);
    stop.store(true, Relaxed);
    for t in threads {
        t.join().expect("thread");
    }
    system.stop().expect("stop");
    let _ = std::fs::remove_dir_all(&dir);
    let classes = std::mem::take(&mut *results.lock().unwrap());
    Run {
        seconds,
        classes,
        queuing: quantiles(&q0, &q1),
        rcvbuf,
        cores,
    }
}

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Finds the embedded agent's UDP socket bound to `port` among this
/// process's descriptors, sets its receive buffer to `bytes` when given,
/// and says the size the kernel reports ("?" when not found).
fn shard_rcvbuf(port: u16, bytes: Option<u64>) -> String {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return "?".into();
    };
    for fd in dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()) {
        // SAFETY: plain socket calls on a descriptor number; a descriptor
        // that is not a socket fails them.
        unsafe {
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let (mut ty, mut tlen) = (0i32, std::mem::size_of::<i32>() as libc::socklen_t);
            if libc::getsockname(fd, (&mut addr as *mut libc::sockaddr_in).cast(), &mut len) != 0
                || i32::from(addr.sin_family) != libc::AF_INET
                || u16::from_be(addr.sin_port) != port
                || libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_TYPE,
                    (&mut ty as *mut i32).cast(),
                    &mut tlen,
                ) != 0
                || ty != libc::SOCK_DGRAM
            {
                continue;
            }
            if let Some(b) = bytes {
                let v = b.min(i32::MAX as u64) as i32;
                let size = std::mem::size_of::<i32>() as libc::socklen_t;
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUF,
                    (&v as *const i32).cast(),
                    size,
                );
            }
            let (mut v, mut vlen) = (0i32, std::mem::size_of::<i32>() as libc::socklen_t);
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&mut v as *mut i32).cast(),
                &mut vlen,
            );
            return v.to_string();
        }
    }
    "?".into()
}

/// Asks for a host until the agent has the route.
fn warm(agent: SocketAddr) {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut enc = Encoder::new();
    let mut buf = [0u8; 2048];
    for _ in 0..200 {
        let _ = s.send_to(enc.get_host_req(1, MODULE, 1, 1), agent);
        if let Ok(n) = s.recv(&mut buf) {
            if let Ok(Message::GetHostResp(r)) = decode(&buf[..n], &Limits::UDP) {
                if r.retcode() == RetCode::Ok {
                    return;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the agent found no route");
}

#[allow(clippy::too_many_arguments)]
fn send_loop(
    socket: &UdpSocket,
    agent: SocketAddr,
    seed: u64,
    rate: Option<f64>,
    mode: Mode,
    stop: &AtomicBool,
    measuring: &AtomicBool,
    level: &Mutex<HoldBack>,
    sent_at: &[AtomicU64],
    results: &Mutex<Vec<Class>>,
) {
    let mut rng = fastrand::Rng::with_seed(seed + 1);
    let mut enc = Encoder::new();
    let mut out = SendBatch::new();
    let start = Instant::now();
    let mut seq = 0u32;
    let mut due = 0f64;
    let mut local: Vec<(u64, u64)> = vec![(0, 0); MIX.len()];
    while !stop.load(Relaxed) {
        let batch = match rate {
            None => 32,
            Some(r) => {
                let now = start.elapsed().as_secs_f64();
                let n = ((now * r) - due).floor().clamp(0.0, 256.0);
                if n < 1.0 {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
                due += n;
                n as usize
            }
        };
        // The library's hold-back table decides, at this batch's time.
        let mut holdback = level.lock().unwrap();
        let now_ms = clock_ns() / 1_000_000;
        let m = measuring.load(Relaxed);
        for _ in 0..batch {
            let x = rng.f64();
            let class = if x < MIX[0].1 { 0 } else { 1 };
            let (b, u) = (MIX[class].0, rng.u8(1..=128));
            if mode == Mode::Honouring && holdback.hold(0, b, u, now_ms) {
                if m {
                    local[class].1 += 1;
                }
                continue;
            }
            seq = seq.wrapping_add(1);
            // seq's top bit holds the class; its ring slot the send time.
            let tagged = (seq & 0x7fff_ffff) | ((class as u32) << 31);
            let ns = clock_ns() | 1;
            sent_at[(tagged & 0x7fff_ffff) as usize % RING].store(if m { ns } else { 0 }, Relaxed);
            out.push(agent, enc.get_host_req(tagged, MODULE, b, u));
            if m {
                local[class].0 += 1;
            }
        }
        drop(holdback);
        out.flush(socket.as_raw_fd());
    }
    let mut r = results.lock().unwrap();
    for (c, (sent, held)) in local.into_iter().enumerate() {
        r[c].sent += sent;
        r[c].held_back += held;
    }
}

fn recv_loop(
    socket: &UdpSocket,
    stop: &AtomicBool,
    measuring: &AtomicBool,
    level: &Mutex<HoldBack>,
    sent_at: &[AtomicU64],
    results: &Mutex<Vec<Class>>,
) {
    let mut rx = RecvBatch::new(32);
    let mut local: Vec<Class> = (0..MIX.len()).map(|_| Class::default()).collect();
    let fd = socket.as_raw_fd();
    while !stop.load(Relaxed) {
        let n = rx.recv(fd).unwrap_or(0);
        if n == 0 {
            std::thread::sleep(Duration::from_micros(20));
            continue;
        }
        let now_ms = clock_ns() / 1_000_000;
        let mut holdback = level.lock().unwrap();
        for i in 0..n {
            let (bytes, _, _) = rx.get(i);
            let Ok(Message::GetHostResp(r)) = decode(bytes, &Limits::UDP) else {
                continue;
            };
            holdback.observe(0, AdmissionLevel::from_wire(r.admission_level()), now_ms);
            let tagged = r.seq();
            let class = (tagged >> 31) as usize;
            let slot = &sent_at[(tagged & 0x7fff_ffff) as usize % RING];
            let at = slot.swap(0, Relaxed);
            if at == 0 || !measuring.load(Relaxed) {
                continue;
            }
            let c = &mut local[class];
            match r.retcode() {
                RetCode::Ok => {
                    c.ok += 1;
                    c.rtt.saturating_record(rtt_ns(at));
                }
                RetCode::Rejected => c.rejected += 1,
                _ => {}
            }
        }
    }
    let mut r = results.lock().unwrap();
    for (a, b) in r.iter_mut().zip(local) {
        a.ok += b.ok;
        a.rejected += b.rejected;
        let _ = a.rtt.add(&b.rtt);
    }
}

/// Nanoseconds since a send stamped `at` on the process-wide clock.
fn rtt_ns(at: u64) -> u64 {
    clock_ns().saturating_sub(at).max(1)
}

fn clock_ns() -> u64 {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// The shard's `lbagent_queuing_seconds_bucket` counts (le in µs, count).
fn queuing_buckets(metrics: SocketAddr) -> Vec<(f64, u64)> {
    let Ok(mut s) = TcpStream::connect(metrics) else {
        return Vec::new();
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.lines()
        .filter(|l| l.starts_with("lbagent_queuing_seconds_bucket"))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse::<f64>().ok()? * 1e6
            };
            let v = l.rsplit(' ').next()?.parse::<f64>().ok()? as u64;
            Some((le, v))
        })
        .collect()
}

/// The p50 / p99 bucket bounds of the queuing times counted between two
/// readings.
fn quantiles(a: &[(f64, u64)], b: &[(f64, u64)]) -> String {
    if a.len() != b.len() || b.is_empty() {
        return "-".into();
    }
    let d: Vec<(f64, u64)> = a.iter().zip(b).map(|(x, y)| (y.0, y.1 - x.1)).collect();
    let total = d.last().map_or(0, |x| x.1);
    if total == 0 {
        return "-".into();
    }
    let q = |p: f64| {
        let want = (p * total as f64).ceil() as u64;
        d.iter().find(|x| x.1 >= want).map_or("?".to_string(), |x| {
            if x.0.is_infinite() {
                "> 100000".into()
            } else {
                format!("≤ {:.0}", x.0)
            }
        })
    };
    format!("{} / {}", q(0.5), q(0.99))
}
