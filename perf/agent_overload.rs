//! The agent's self-protection (issue 12 item 4, DAGOR on the agent's own
//! shards), measured on loopback against an embedded agent with one shard.
//!
//! Placement: the shard's executor is pinned to CPU 0 (the agent pins shard
//! i to CPU i); this runner pins its sender and receiver threads to the
//! other CPUs (`sched_setaffinity`), so that the shard's queuing time is
//! the shard's, not the generator's. The senders are cheap: pre-encoded
//! requests with the sequence number patched in, pacing that sleeps while
//! nothing is due, and UDP segmentation offload (`UDP_SEGMENT`): one
//! `send` of up to 64 equal-sized getHosts, which the kernel carries
//! through loopback as one packet and cuts into datagrams at the shard's
//! socket. A loopback datagram's delivery (route, IP, the loopback device,
//! the receive path up to the socket) is paid by the sending CPU, so a
//! sender with one datagram a system-call slot cannot offer more than
//! about what one shard answers; with segmentation it pays that path once
//! per 64. The shard sees ordinary datagrams, each with its own receive
//! stamp, as from any callers (`--no-gso` sends `sendmmsg` batches of
//! single datagrams instead).
//!
//! 1. Saturation: paced senders at doubling rates, shedding off; the most
//!    the shard answered is its saturation rate S.
//! 2. The kernel's cost of a small datagram in a receive buffer (a socket
//!    filled without reading), from which the sized buffer for the
//!    threshold follows: `threshold × S × bytes per datagram / 2` (the
//!    kernel doubles `SO_RCVBUF`), unless `--rcvbuf` gives one.
//! 3. At 2·S, open loop, with the priority mix (business priority 5 for
//!    20% of the getHosts, 60 for 80%; user priorities uniform): shedding
//!    off; `admission.agent_shedding` on; on, with callers that hold back
//!    below the level the shard attaches to its answers, decided by the
//!    client library's own [`HoldBack`] (one per sender, fed by that
//!    sender's answers; default freshness 100 ms). The two shedding runs
//!    are repeated with `agent.udp_rcvbuf_bytes` set to the sized buffer.
//!    A getHost a caller holds back counts as rejected.
//!
//! Per class: offered rate, answered / Rejected / unanswered shares, the
//! round trip of the answered getHosts, and the shard's queuing time of
//! that class's getHosts (`lbagent_gethost_queuing_seconds`, p50 / p99 as
//! the bucket bounds that hold them); then the queuing time of all
//! datagrams, the CPU this process used (cores) and the load average.
//! After the table, per run: the datagrams the kernel dropped on the
//! shard's socket per second, and the shard's level over the measured
//! part, per 100 ms, as the lowest..highest level its answers carried (so
//! that a run shows whether the level oscillates).
//!
//! ```text
//! nice -n -15 cargo bench --locked --bench agent_overload -- [--seconds 2] [--senders 1] [--threshold-us 500] [--rcvbuf BYTES] [--no-gso]
//! ```

use std::io::{Read, Write as _};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use lbagent::admission::holdback::{HoldBack, DEFAULT_HOLDBACK_MS};
use lbagent::admission::{level_index, level_of_index, AdmissionLevel, OPEN};
use lbagent::host::udp::{self, RecvBatch, SendBatch};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::standalone::{Standalone, StandaloneOptions};
use lbagent::store::{self, StoreUrl};
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};
use nix::sys::socket::{setsockopt, sockopt};

const MODULE: ModuleId = ModuleId::new(10_000, 1);
/// (business priority, share of the getHosts, the metrics' class label).
const MIX: [(u8, f64, &str); 2] = [(5, 0.2, "4-7"), (60, 0.8, "32-63")];
/// Send times are kept for this many outstanding getHosts per sender.
const RING: usize = 1 << 20;
/// The CPU the agent pins its only shard to.
const SHARD_CPU: usize = 0;
/// getHosts per segmented send (the kernel's `UDP_MAX_SEGMENTS` is 64 on
/// older kernels, 128 on newer).
const GSO_SEGMENTS: usize = 64;

struct Opts {
    seconds: u64,
    senders: usize,
    threshold_us: u64,
    rcvbuf: Option<u64>,
    /// Send with UDP segmentation offload (`--no-gso` turns it off).
    gso: bool,
}

fn main() {
    let mut o = Opts {
        seconds: 2,
        senders: 1,
        threshold_us: 500,
        rcvbuf: None,
        gso: true,
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
            "--rcvbuf" => o.rcvbuf = Some(num("--rcvbuf")),
            "--no-gso" => o.gso = false,
            "--bench" => {}
            other => {
                eprintln!("agent_overload: unknown argument `{other}`");
                std::process::exit(2);
            }
        }
    }
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "agent_overload: {} CPUs; the shard on CPU {SHARD_CPU}, {} sender(s) and receiver(s) on CPUs {:?}; \
         senders {}; {} s measured per run after 1 s of warm-up; load average at the start: {}",
        ncpu,
        o.senders,
        generator_cpus(),
        if o.gso {
            format!("segment (UDP_SEGMENT, up to {GSO_SEGMENTS} getHosts a send)")
        } else {
            "send sendmmsg batches of single datagrams (--no-gso)".to_string()
        },
        o.seconds,
        loadavg()
    );
    // Paced senders, rates doubling: the most answers that came back is
    // the shard's saturation rate (what callers get; the shard's own
    // count is printed beside it).
    let mut s = 0f64;
    for rate in [
        25_000.0, 50_000.0, 100_000.0, 200_000.0, 400_000.0, 800_000.0,
    ] {
        let r = run(&o, Mode::Off, None, rate);
        println!(
            "saturation search: asked {rate:.0}/s, offered {:.0}/s, the shard answered {:.0}/s \
             ({:.0}/s came back, {:.0}/s dropped by the generator's socket; load average {})",
            r.sent_rate(),
            r.shard_rate,
            r.answered_rate(),
            r.lost_rate,
            r.load
        );
        let best = s;
        s = s.max(r.answered_rate());
        if r.answered_rate() < 1.05 * best || r.sent_rate() < 0.9 * rate {
            break;
        }
    }
    println!("saturation S (shedding off): {s:.0} answered/s");
    if s < 1.0 {
        eprintln!("agent_overload: the shard answered nothing: no saturation rate to double");
        std::process::exit(1);
    }
    let per = bytes_per_datagram();
    let sized = o.rcvbuf.unwrap_or_else(|| {
        let held = o.threshold_us as f64 * 1e-6 * s;
        let v = (held * per / 2.0).round().max(4096.0) as u64;
        println!(
            "a getHost datagram takes {per:.0} bytes of a receive buffer (the kernel's accounting, measured); \
             threshold {} us at S holds {held:.0} datagrams: udp_rcvbuf_bytes = {held:.0} x {per:.0} / 2 = {v} \
             (the kernel doubles it)",
            o.threshold_us
        );
        v
    });
    println!(
        "\nat 2x saturation ({:.0}/s asked), mix {:?} (business priority, share), threshold {} us; \
         queuing = the shard's, from the kernel's receive stamp to handling, as the histogram buckets that hold p50 / p99:\n",
        2.0 * s,
        MIX.iter().map(|m| (m.0, m.1)).collect::<Vec<_>>(),
        o.threshold_us
    );
    println!(
        "| run | udp_rcvbuf_bytes (kernel reports) | class | offered/s | answered | rejected | unanswered | RTT p50 / p99 (µs) | this class's queuing p50 / p99 (µs) | all datagrams' queuing p50 / p99 (µs) | the shard read/s (both classes) | answers back/s (Ok + Rejected) | answers lost at the generator/s | CPU (cores) | load average |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut traces = Vec::new();
    for (mode, rcvbuf) in [
        (Mode::Off, None),
        (Mode::Shedding, None),
        (Mode::Honouring, None),
        (Mode::Shedding, Some(sized)),
        (Mode::Honouring, Some(sized)),
    ] {
        let r = run(&o, mode, rcvbuf, 2.0 * s);
        for (c, &(b, _, _)) in MIX.iter().enumerate() {
            let k = &r.classes[c];
            let offered = (k.sent + k.held_back).max(1) as f64;
            let rtt = if k.rtt.is_empty() {
                "–".to_string()
            } else {
                format!(
                    "{:.0} / {:.0}",
                    k.rtt.value_at_quantile(0.5) as f64 / 1e3,
                    k.rtt.value_at_quantile(0.99) as f64 / 1e3,
                )
            };
            println!(
                "| {} | {} ({}) | {b} | {:.0} | {:.3} | {:.3} | {:.3} | {rtt} | {} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {} |",
                mode.name(),
                rcvbuf.map_or("0 (system default)".to_string(), |v| v.to_string()),
                r.rcvbuf,
                offered / r.seconds,
                k.ok as f64 / offered,
                (k.rejected + k.held_back) as f64 / offered,
                k.sent.saturating_sub(k.ok + k.rejected) as f64 / offered,
                r.class_queuing[c],
                r.queuing,
                r.shard_rate,
                r.answered_rate(),
                r.lost_rate,
                r.cores,
                r.load,
            );
        }
        traces.push(format!(
            "{} ({}): kernel drops {:.0}/s; level per 100 ms: {}",
            mode.name(),
            rcvbuf.map_or("default buffer".to_string(), |v| format!(
                "udp_rcvbuf_bytes {v}"
            )),
            r.drops_rate,
            r.levels
        ));
    }
    println!(
        "\nThe shard's level over each run's measured part, per 100 ms: the lowest..highest level its answers \
         carried (B,U; 128,128 = open: no level attached; - = no answer in the slot):\n"
    );
    for t in traces {
        println!("{t}");
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The CPUs the generator threads may use: all but the shard's (all when
/// there is only one).
fn generator_cpus() -> Vec<usize> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let v: Vec<usize> = (0..ncpu).filter(|&c| c != SHARD_CPU).collect();
    if v.is_empty() {
        vec![SHARD_CPU]
    } else {
        v
    }
}

/// Pins the calling thread to the generator's CPUs.
fn pin_generator() {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET writes within it;
    // sched_setaffinity(0) applies to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in generator_cpus() {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            eprintln!(
                "agent_overload: cannot pin a generator thread: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// What one small getHost datagram costs a receive buffer as the kernel
/// counts it: a socket with a known buffer is filled without reading, and
/// its size is divided by the datagrams it held.
fn bytes_per_datagram() -> f64 {
    let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let size = udp::set_rcvbuf(rx.as_raw_fd(), 65_536).expect("SO_RCVBUF") as f64;
    let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
    tx.connect(rx.local_addr().unwrap()).expect("connect");
    tx.set_nonblocking(true).unwrap();
    let req = Encoder::new().get_host_req(1, MODULE, 5, 5).to_vec();
    for _ in 0..20_000 {
        let _ = tx.send(&req);
    }
    rx.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 256];
    let mut held = 0u64;
    while rx.recv(&mut buf).is_ok() {
        held += 1;
    }
    size / held.max(1) as f64
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
    /// All datagrams' queuing time, p50 / p99 bucket bounds.
    queuing: String,
    /// Each class's getHosts' queuing time, p50 / p99 bucket bounds.
    class_queuing: Vec<String>,
    /// The shard socket's receive buffer as the kernel reports it.
    rcvbuf: String,
    /// CPU seconds this process used per second measured.
    cores: f64,
    /// The load average at the end of the measured part.
    load: String,
    /// Per 100 ms of the measured part, the lowest..highest level the
    /// shard's answers carried.
    levels: String,
    /// Datagrams the kernel dropped on the shard's socket per second
    /// (`lbagent_udp_receive_drops_total`; counted with shedding on).
    drops_rate: f64,
    /// Requests the shard read per second (`lbagent_requests_total`).
    shard_rate: f64,
    /// Answers the kernel dropped on the generator's sockets per second
    /// (`SO_RXQ_OVFL`): lost to the generator, not to the shard.
    lost_rate: f64,
}

/// The lowest and highest level index the answers carried since the last
/// [`LevelSpan::take`] (an answer without a level counts as open).
struct LevelSpan {
    lo: AtomicUsize,
    hi: AtomicUsize,
}

impl LevelSpan {
    fn new() -> Self {
        LevelSpan {
            lo: AtomicUsize::new(usize::MAX),
            hi: AtomicUsize::new(0),
        }
    }
    fn note(&self, lo: usize, hi: usize) {
        self.lo.fetch_min(lo, Relaxed);
        self.hi.fetch_max(hi, Relaxed);
    }
    /// "B,U..B,U" since the last take ("-" when no answer came).
    fn take(&self) -> String {
        let lo = self.lo.swap(usize::MAX, Relaxed);
        let hi = self.hi.swap(0, Relaxed);
        if lo == usize::MAX {
            return "-".into();
        }
        let (a, b) = (level_of_index(lo), level_of_index(hi));
        if a == b {
            format!("{},{}", a.business, a.user)
        } else {
            format!("{},{}..{},{}", a.business, a.user, b.business, b.user)
        }
    }
}

impl Run {
    fn sent_rate(&self) -> f64 {
        self.classes.iter().map(|c| c.sent).sum::<u64>() as f64 / self.seconds
    }
    fn answered_rate(&self) -> f64 {
        self.classes.iter().map(|c| c.ok + c.rejected).sum::<u64>() as f64 / self.seconds
    }
}

/// One run against a fresh agent: `rate` getHosts per second in all, for
/// the measured seconds after a 1 s warm-up; with `rcvbuf`,
/// `agent.udp_rcvbuf_bytes` set to it.
fn run(o: &Opts, mode: Mode, rcvbuf: Option<u64>, rate: f64) -> Run {
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
    so.config.agent.udp_rcvbuf_bytes = rcvbuf.map_or(0, |v| v.min(u64::from(u32::MAX)) as u32);
    so.config.admission.agent_shedding = mode != Mode::Off;
    // The queuing times are reported with shedding off too.
    so.config.agent.queuing_time = true;
    so.config.admission.agent_queuing_threshold_us = o.threshold_us;
    // Windows of 100 ms / 2000 datagrams: at hundreds of thousands per
    // second the count ends them every few milliseconds.
    so.config.admission.window_ms = 100;
    let system = Standalone::start(so).expect("standalone");
    let agent = SocketAddr::from(([127, 0, 0, 1], system.agent_ports()[0]));
    let metrics = system.metrics_addrs()[0];
    let rcvbuf = shard_rcvbuf(agent.port());
    warm(agent);

    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let results = Arc::new(Mutex::new(
        (0..MIX.len()).map(|_| Class::default()).collect::<Vec<_>>(),
    ));
    let span = Arc::new(LevelSpan::new());
    // Each receiver's socket's running count of dropped answers.
    let lost: Arc<Vec<AtomicU64>> = Arc::new((0..o.senders).map(|_| AtomicU64::new(0)).collect());
    let lost_now = || lost.iter().map(|c| c.load(Relaxed)).sum::<u64>() as f64;
    let mut threads = Vec::new();
    for t in 0..o.senders {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
        socket.connect(agent).expect("connect");
        // Room for the answers: a receiver that falls behind must not
        // turn answers into "unanswered".
        answer_room(&socket);
        let rx = socket.try_clone().expect("clone");
        let sent_at: Arc<Vec<AtomicU64>> = Arc::new((0..RING).map(|_| AtomicU64::new(0)).collect());
        // This sender's hold-back table (the one shard is shard 0).
        let level = Arc::new(Mutex::new(HoldBack::new(DEFAULT_HOLDBACK_MS)));
        let per_sender = rate / o.senders as f64;
        let (stop_s, meas_s, level_s, res_s, sent_s) = (
            stop.clone(),
            measuring.clone(),
            level.clone(),
            results.clone(),
            sent_at.clone(),
        );
        let gso = o.gso;
        threads.push(std::thread::spawn(move || {
            pin_generator();
            send_loop(
                &socket, agent, t as u64, per_sender, mode, gso, &stop_s, &meas_s, &level_s,
                &sent_s, &res_s,
            )
        }));
        let (stop_r, meas_r, level_r, res_r, span_r, lost_r) = (
            stop.clone(),
            measuring.clone(),
            level.clone(),
            results.clone(),
            span.clone(),
            lost.clone(),
        );
        threads.push(std::thread::spawn(move || {
            pin_generator();
            recv_loop(
                &rx, &stop_r, &meas_r, &level_r, &sent_at, &res_r, &span_r, &lost_r[t],
            )
        }));
    }
    std::thread::sleep(Duration::from_secs(1));
    // The shard ships its counts to the control core once a second: the
    // metrics' rates are taken between two fresh shipments.
    let (text0, m0) = next_shipment(metrics);
    let lost0 = lost_now();
    let cpu0 = cpu_seconds();
    measuring.store(true, Relaxed);
    let t0 = Instant::now();
    span.take();
    // The level the answers carried, per 100 ms.
    let mut levels = Vec::new();
    let mut next = Duration::from_millis(100);
    while next <= Duration::from_secs(o.seconds) {
        std::thread::sleep(next.saturating_sub(t0.elapsed()));
        levels.push(span.take());
        next += Duration::from_millis(100);
    }
    measuring.store(false, Relaxed);
    let seconds = t0.elapsed().as_secs_f64();
    let cores = (cpu_seconds() - cpu0) / seconds;
    let lost1 = lost_now();
    let (text1, m1) = next_shipment(metrics);
    let shipped = (m1 - m0).as_secs_f64();
    let load = loadavg();
    stop.store(true, Relaxed);
    for t in threads {
        t.join().expect("thread");
    }
    system.stop().expect("stop");
    let _ = std::fs::remove_dir_all(&dir);
    let classes = std::mem::take(&mut *results.lock().unwrap());
    let drops = |t: &str| family_sum(t, "lbagent_udp_receive_drops_total{");
    let read = |t: &str| family_sum(t, "lbagent_requests_total{");
    let all = |t: &str| buckets(t, "lbagent_queuing_seconds_bucket{", None);
    let class = |t: &str, c: &str| buckets(t, "lbagent_gethost_queuing_seconds_bucket{", Some(c));
    Run {
        seconds,
        classes,
        queuing: quantiles(&all(&text0), &all(&text1)),
        class_queuing: MIX
            .iter()
            .map(|m| quantiles(&class(&text0, m.2), &class(&text1, m.2)))
            .collect(),
        rcvbuf,
        cores,
        load,
        levels: levels.join(" "),
        drops_rate: (drops(&text1) - drops(&text0)) / shipped,
        shard_rate: (read(&text1) - read(&text0)) / shipped,
        lost_rate: (lost1 - lost0) / seconds,
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

/// The receive buffer of the embedded agent's UDP socket bound to `port`
/// (found among this process's descriptors) as the kernel reports it ("?"
/// when not found).
fn shard_rcvbuf(port: u16) -> String {
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
        }
        return udp::rcvbuf(fd).map_or("?".into(), |v| v.to_string());
    }
    "?".into()
}

/// Gives a generator socket 8 MiB of receive buffer: past
/// `net.core.rmem_max` with `SO_RCVBUFFORCE` where the process may
/// (`CAP_NET_ADMIN`), else as much as `SO_RCVBUF` gets.
fn answer_room(socket: &UdpSocket) {
    if setsockopt(socket, sockopt::RcvBufForce, &(8 << 20)).is_err() {
        let _ = udp::set_rcvbuf(socket.as_raw_fd(), 8 << 20);
    }
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

/// Where the sequence number lies in an encoded getHost: the bytes that
/// differ between two encodings that differ only in it.
fn seq_offset() -> usize {
    let mut enc = Encoder::new();
    let a = enc.get_host_req(0x0102_0304, MODULE, 5, 5).to_vec();
    let b = enc.get_host_req(0xa1b2_c3d4, MODULE, 5, 5).to_vec();
    assert_eq!(a.len(), b.len());
    let at = (0..a.len())
        .find(|&i| a[i] != b[i])
        .expect("seq in the bytes");
    assert_eq!(&a[at..at + 4], &0x0102_0304u32.to_le_bytes());
    at
}

#[allow(clippy::too_many_arguments)]
fn send_loop(
    socket: &UdpSocket,
    agent: SocketAddr,
    seed: u64,
    rate: f64,
    mode: Mode,
    gso: bool,
    stop: &AtomicBool,
    measuring: &AtomicBool,
    level: &Mutex<HoldBack>,
    sent_at: &[AtomicU64],
    results: &Mutex<Vec<Class>>,
) {
    let mut rng = fastrand::Rng::with_seed(seed + 1);
    // Every request pre-encoded (class x user priority); only the
    // sequence number is patched in per datagram (encoded non-zero: a
    // zero field is left out, and the layout would differ).
    let at = seq_offset();
    let mut enc = Encoder::new();
    let mut templates: Vec<Vec<Vec<u8>>> = MIX
        .iter()
        .map(|&(b, _, _)| {
            (0..=128u8)
                .map(|u| enc.get_host_req(1, MODULE, b, u).to_vec())
                .collect()
        })
        .collect();
    let mut out = SendBatch::new();
    // Segmentation needs every datagram of a send the same size: the
    // templates sent are (user priorities 1..=128, all fields non-zero),
    // checked here.
    let size = templates[0][1].len();
    let gso = gso
        && templates
            .iter()
            .all(|c| c[1..].iter().all(|t| t.len() == size))
        && enable_gso(socket, size).is_ok();
    let mut segments: Vec<u8> = Vec::with_capacity(GSO_SEGMENTS * size);
    let start = Instant::now();
    let mut seq = 0u32;
    let mut due = 0f64;
    let mut local: Vec<(u64, u64)> = vec![(0, 0); MIX.len()];
    while !stop.load(Relaxed) {
        let now = start.elapsed().as_secs_f64();
        let n = ((now * rate) - due).floor().clamp(0.0, 256.0);
        if n < 1.0 {
            // Sleep until the next datagram is due (at least 20 µs).
            let wait = (due + 1.0) / rate - now;
            std::thread::sleep(Duration::from_secs_f64(wait.max(20e-6)));
            continue;
        }
        due += n;
        let batch = n as usize;
        // The library's hold-back table decides, at this batch's time.
        let mut holdback = level.lock().unwrap();
        let now_ns = clock_ns() | 1;
        let now_ms = now_ns / 1_000_000;
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
            // seq's top bit holds the class; its ring slot the send time
            // (the batch's: they leave in one system call).
            let tagged = (seq & 0x7fff_ffff) | ((class as u32) << 31);
            sent_at[(tagged & 0x7fff_ffff) as usize % RING]
                .store(if m { now_ns } else { 0 }, Relaxed);
            let req = &mut templates[class][usize::from(u)];
            req[at..at + 4].copy_from_slice(&tagged.to_le_bytes());
            if gso {
                segments.extend_from_slice(req);
                if segments.len() == GSO_SEGMENTS * size {
                    send_segments(socket, &mut segments);
                }
            } else {
                out.push(agent, req);
            }
            if m {
                local[class].0 += 1;
            }
        }
        drop(holdback);
        if gso {
            send_segments(socket, &mut segments);
        } else {
            out.flush(socket.as_raw_fd());
        }
    }
    let mut r = results.lock().unwrap();
    for (c, (sent, held)) in local.into_iter().enumerate() {
        r[c].sent += sent;
        r[c].held_back += held;
    }
}

/// Asks the kernel to cut every send on `socket` into datagrams of `size`
/// bytes (`UDP_SEGMENT`; Linux 4.18 and later).
fn enable_gso(socket: &UdpSocket, size: usize) -> std::io::Result<()> {
    setsockopt(socket, sockopt::UdpGsoSegment, &(size as libc::c_int))
        .map_err(std::io::Error::from)
        .inspect_err(|e| {
            eprintln!("agent_overload: UDP_SEGMENT unavailable ({e}); sending single datagrams");
        })
}

/// Sends the equal-sized getHosts in `segments` in one system call (the
/// kernel cuts them apart) and empties it. A failed send is dropped, as
/// UDP would.
fn send_segments(socket: &UdpSocket, segments: &mut Vec<u8>) {
    if !segments.is_empty() {
        let _ = socket.send(segments);
        segments.clear();
    }
}

#[allow(clippy::too_many_arguments)]
fn recv_loop(
    socket: &UdpSocket,
    stop: &AtomicBool,
    measuring: &AtomicBool,
    level: &Mutex<HoldBack>,
    sent_at: &[AtomicU64],
    results: &Mutex<Vec<Class>>,
    span: &LevelSpan,
    lost: &AtomicU64,
) {
    let open = level_index(OPEN);
    let mut rx = RecvBatch::new(32);
    let mut local: Vec<Class> = (0..MIX.len()).map(|_| Class::default()).collect();
    let fd = socket.as_raw_fd();
    if let Err(e) = udp::enable_drop_count(fd) {
        eprintln!("agent_overload: answers lost at the generator will not be counted: {e}");
    }
    while !stop.load(Relaxed) {
        let n = rx.recv(fd).unwrap_or(0);
        if n == 0 {
            std::thread::sleep(Duration::from_micros(20));
            continue;
        }
        if let Some(d) = rx.drops(n - 1) {
            lost.store(u64::from(d), Relaxed);
        }
        let now_ms = clock_ns() / 1_000_000;
        let mut holdback = level.lock().unwrap();
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in 0..n {
            let (bytes, _, _) = rx.get(i);
            let Ok(Message::GetHostResp(r)) = decode(bytes, &Limits::UDP) else {
                continue;
            };
            let seen = AdmissionLevel::from_wire(r.admission_level());
            let at = seen
                .filter(|l| (1..=128).contains(&l.business) && (1..=128).contains(&l.user))
                .map_or(open, level_index);
            (lo, hi) = (lo.min(at), hi.max(at));
            holdback.observe(0, seen, now_ms);
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
        drop(holdback);
        if lo != usize::MAX {
            span.note(lo, hi);
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

/// The agent's /metrics page as soon as it shows a new shipment of the
/// shard's counts (its request count moved; at most 1.5 s of polling), and
/// when that was seen.
fn next_shipment(metrics: SocketAddr) -> (String, Instant) {
    let read = |t: &str| family_sum(t, "lbagent_requests_total{");
    let before = read(&metrics_text(metrics));
    let t0 = Instant::now();
    loop {
        let text = metrics_text(metrics);
        let at = Instant::now();
        if read(&text) != before || t0.elapsed() > Duration::from_millis(1500) {
            return (text, at);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The sum of the samples whose lines start with `prefix`.
fn family_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The agent's /metrics page.
fn metrics_text(metrics: SocketAddr) -> String {
    let Ok(mut s) = TcpStream::connect(metrics) else {
        return String::new();
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// A histogram's bucket counts (le in µs, cumulative count) from the
/// samples starting with `prefix`, of priority class `class` when given.
fn buckets(text: &str, prefix: &str, class: Option<&str>) -> Vec<(f64, u64)> {
    let want = class.map(|c| format!("class=\"{c}\""));
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter(|l| want.as_ref().is_none_or(|w| l.contains(w.as_str())))
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
    if b.is_empty() || (!a.is_empty() && a.len() != b.len()) {
        return "-".into();
    }
    // A series that did not exist at the first reading started at zero.
    let d: Vec<(f64, u64)> = b
        .iter()
        .enumerate()
        .map(|(i, y)| (y.0, y.1 - a.get(i).map_or(0, |x| x.1)))
        .collect();
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
