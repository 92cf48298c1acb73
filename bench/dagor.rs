//! The DAGOR experiment (seed 004, the paper's figures 7-8 in shape), on
//! loopback: `lbagent`'s demo service at a fixed capacity, driven at 1x,
//! 1.5x, 2x, 3x and 4x of it with mixed priorities, for
//!
//! - DAGOR with collaborative admission through the real agent: each call
//!   asks an embedded agent (route server + agent, `Standalone`) for a host
//!   with its priorities, calls the service only when the agent answers a
//!   host, and reports the call with the level the service attached
//!   (`downstream_level`), so the agent answers `Rejected` below it;
//! - DAGOR at the service only (the level adapts across the feeds, as in a
//!   live system: one service for the five feeds);
//! - random shedding at the rate DAGOR rejected at the same feed (a fresh
//!   service per feed);
//! - no control (a fresh service per feed);
//! - simple calls (M1) and composite calls (M2, M4: one upstream request
//!   makes 2 or 4 sequential calls and succeeds only when all do).
//!
//! Success rate = upstream requests answered Ok within the deadline /
//! upstream requests offered, against the optimum min(1, capacity / feed).
//!
//! Random shedding rejects at the share of calls DAGOR (service only) kept
//! from the service at the same feed, rejections at the agent included.
//!
//! ```text
//! cargo bench --bench dagor -- [--warmup-ms 3000] [--measure-ms 2000] [--out DIR]
//!                              [--seeds 3] [--only MODE:K [--trace]]
//! ```
//! Each DAGOR mode runs `--seeds` times (3) with different driver seeds
//! (arrival times, priorities): one 2 s measurement is one realization of
//! a level that cycles about once a second, and differs from the next by
//! a few points; the tables pool the realizations (answered / offered
//! over all of them) and give the lowest and highest one.
//! `--only dagor:1` (MODE `dagor`, `paper` or `collab`; K 1, 2 or 4) runs
//! that one service through the five feeds, once per seed, and prints
//! each feed's figures (about 25 s a seed); with `--trace` it also writes
//! every request the service saw (`DIR/trace-MODE-MK-seedS-arrivals.csv`)
//! and every admission window (`...-windows.csv`), on the service's clock.
//! writes DIR/dagor.md (the tables) and DIR/dagor.png (the plot; needs a
//! TrueType font: DejaVu Sans from Debian's fonts-dejavu-core, or the file
//! named by LBAGENT_PLOT_FONT). DIR defaults to target/dagor.

#[path = "support/standalone.rs"]
mod standalone;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use lbagent::admission::{piggyback, AdmissionParams, UserPriorities};
use lbagent::demo_service::{
    serve, serve_traced, Arrival, Counters, ServiceParams, ServiceTrace, Shedding,
};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{decode, Encoder, Limits, Message, Report, RetCode};

/// Feed rates, as multiples of the capacity.
const FEEDS: [f64; 5] = [1.0, 1.5, 2.0, 3.0, 4.0];
/// Calls per upstream request: M1 (simple), M2, M4.
const SHAPES: [u32; 3] = [1, 2, 4];
/// A call not answered within this fails (the paper's default timeout).
const DEADLINE: Duration = Duration::from_millis(500);
/// Business priorities 1..=CLASSES, uniform.
const CLASSES: u8 = 8;
/// Distinct user ids, uniform; the user priority is their rotating hash.
const USERS: u64 = 10_000;
/// The time (unix seconds) whose hour's key hashes users to priorities.
const KEY_TIME_S: u64 = 0;
/// The service: 4 workers x 2 ms = 2000 requests/s, queue 4096.
const WORKERS: u32 = 4;
const SERVICE_US: u64 = 2000;
const QUEUE: usize = 4096;

fn main() {
    let opts = match Opts::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("dagor bench: {e}");
            std::process::exit(2);
        }
    };
    let capacity = service(Shedding::Off).capacity();
    let params = service(Shedding::Dagor);
    println!(
        "service: {WORKERS} workers x {SERVICE_US} us = {capacity:.0} requests/s, queue {QUEUE}; \
         DAGOR window {} ms / {} requests, threshold {} ms; deadline {} ms; \
         warm-up {} ms + measure {} ms per feed",
        params.admission.window_us / 1000,
        params.admission.window_requests,
        params.admission.queuing_threshold_us / 1000,
        DEADLINE.as_millis(),
        opts.warmup.as_millis(),
        opts.measure.as_millis()
    );
    if let Some((mode, k)) = opts.only.clone() {
        only(&mode, k, &opts);
        return;
    }
    let started = Instant::now();
    let load_before = load_average();
    let mut results = Vec::new();
    for (si, &k) in SHAPES.iter().enumerate() {
        let seed = seed_of(si, 0);
        let rates: Vec<f64> = FEEDS.iter().map(|f| f * capacity).collect();
        let realizations = |params: ServiceParams, via_agent: bool| {
            Runs::of(
                (0..opts.seeds)
                    .map(|j| {
                        with_service(params, |addr, c| {
                            let seed = seed_of(si, j);
                            if via_agent {
                                with_agent(addr, |agent| {
                                    drive(addr, Some(agent), c, k, &rates, &opts, seed)
                                })
                            } else {
                                drive(addr, None, c, k, &rates, &opts, seed)
                            }
                        })
                    })
                    .collect(),
            )
        };
        let dagor = realizations(service(Shedding::Dagor), false);
        // The same, with the paper's rule (every overloaded window cuts):
        // the same-run baseline for `hold_while_draining`.
        let paper = realizations(paper_rule(service(Shedding::Dagor)), false);
        let collab = realizations(service(Shedding::Dagor), true);
        let (dagor, paper, collab) = (&dagor, &paper, &collab);
        let mut random = Vec::new();
        let mut off = Vec::new();
        for (i, &rate) in rates.iter().enumerate() {
            let reject = dagor.pooled[i].rejected_fraction();
            let shedding = Shedding::Random { rate: reject };
            random.push(
                with_service(service(shedding), |addr, c| {
                    drive(addr, None, c, k, &[rate], &opts, seed)
                })[0],
            );
            off.push(
                with_service(service(Shedding::Off), |addr, c| {
                    drive(addr, None, c, k, &[rate], &opts, seed)
                })[0],
            );
        }
        for i in 0..FEEDS.len() {
            let row = Row {
                feed: FEEDS[i],
                k,
                dagor: dagor.pooled[i],
                paper: paper.pooled[i],
                collab: collab.pooled[i],
                dagor_range: dagor.range(i),
                paper_range: paper.range(i),
                collab_range: collab.range(i),
                random: random[i],
                off: off[i],
            };
            println!("{}", row.line());
            results.push(row);
        }
    }
    println!("bench time: {:.0} s", started.elapsed().as_secs_f64());
    let load = format!(
        "{} at the start, {} at the end",
        load_before,
        load_average()
    );
    let md = tables(&results, &opts, &load);
    println!("\n{md}");
    if let Err(e) = std::fs::create_dir_all(&opts.out) {
        eprintln!("dagor bench: cannot create {}: {e}", opts.out.display());
        std::process::exit(1);
    }
    let md_path = opts.out.join("dagor.md");
    if let Err(e) = std::fs::write(&md_path, &md) {
        eprintln!("dagor bench: cannot write {}: {e}", md_path.display());
    }
    let png = opts.out.join("dagor.png");
    match plot(&results, &png) {
        Ok(()) => println!("wrote {} and {}", md_path.display(), png.display()),
        Err(e) => eprintln!("dagor bench: no plot: {e}"),
    }
}

/// Runs one mode and call shape through the five feeds (`--only`), prints
/// each feed's figures and, with `--trace`, writes the service's trace.
fn only(mode: &str, k: u32, opts: &Opts) {
    let capacity = service(Shedding::Off).capacity();
    let rates: Vec<f64> = FEEDS.iter().map(|f| f * capacity).collect();
    let si = SHAPES.iter().position(|&s| s == k).unwrap_or(0);
    let params = match mode {
        "paper" => paper_rule(service(Shedding::Dagor)),
        _ => service(Shedding::Dagor),
    };
    let load_before = load_average();
    for j in 0..opts.seeds {
        let seed = seed_of(si, j);
        let mut trace = opts.trace.then(ServiceTrace::default);
        let phases = with_service_traced(params, trace.as_mut(), |addr, c| {
            if mode == "collab" {
                with_agent(addr, |agent| {
                    drive(addr, Some(agent), c, k, &rates, opts, seed)
                })
            } else {
                drive(addr, None, c, k, &rates, opts, seed)
            }
        });
        for (feed, p) in FEEDS.iter().zip(&phases) {
            let optimum = (1.0 / feed).min(1.0);
            println!(
                "{mode} M{k} seed {seed} {feed:.1}x: success {:.3} ({:.1}% of optimum), \
                 class 1 {:.3}, rejected {:.3}, avg queuing {:.1} ms",
                p.success(),
                100.0 * p.success() / optimum,
                p.top_success(),
                p.rejected_fraction(),
                p.avg_queuing_ms()
            );
        }
        if let Some(t) = trace {
            if let Err(e) = write_trace(&t, &opts.out, &format!("{mode}-M{k}-seed{seed}")) {
                eprintln!("dagor bench: cannot write the trace: {e}");
                std::process::exit(1);
            }
        }
    }
    println!(
        "load average {load_before} at the start, {} at the end",
        load_average()
    );
}

/// Writes `trace` as `DIR/trace-NAME-arrivals.csv` and `-windows.csv`.
fn write_trace(trace: &ServiceTrace, dir: &Path, name: &str) -> io::Result<()> {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir)?;
    let mut s = String::from("arrival_us,read_us,business,user,outcome\n");
    for a in &trace.arrivals {
        let outcome = match a.outcome {
            Arrival::Queued => "queued",
            Arrival::Rejected => "rejected",
            Arrival::QueueFull => "full",
        };
        let _ = writeln!(
            s,
            "{},{},{},{},{outcome}",
            a.arrival_us, a.read_us, a.business, a.user
        );
    }
    let arrivals = dir.join(format!("trace-{name}-arrivals.csv"));
    std::fs::write(&arrivals, s)?;
    let mut s = String::from(
        "taken_us,queued,before_b,before_u,after_b,after_u,avg_queuing_us,\
         samples,by_count,overloaded,held,arrived,admitted\n",
    );
    for (at, queued, o) in &trace.windows {
        let _ = writeln!(
            s,
            "{at},{queued},{},{},{},{},{},{},{},{},{},{},{}",
            o.before.business,
            o.before.user,
            o.after.business,
            o.after.user,
            o.window.avg_queuing_us,
            o.window.samples,
            u8::from(o.window.by_count),
            u8::from(o.window.overloaded),
            u8::from(o.draining),
            o.arrived,
            o.admitted
        );
    }
    let windows = dir.join(format!("trace-{name}-windows.csv"));
    std::fs::write(&windows, s)?;
    println!("wrote {} and {}", arrivals.display(), windows.display());
    Ok(())
}

/// The command line.
struct Opts {
    warmup: Duration,
    measure: Duration,
    out: PathBuf,
    /// `--only MODE:K`: one mode and call shape.
    only: Option<(String, u32)>,
    /// `--trace`: with `--only`, write the service's trace.
    trace: bool,
    /// `--seeds N`: realizations (driver seeds) of each DAGOR run.
    seeds: u32,
}

impl Opts {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Opts, String> {
        let mut o = Opts {
            warmup: Duration::from_millis(3000),
            measure: Duration::from_millis(2000),
            out: PathBuf::from("target/dagor"),
            only: None,
            trace: false,
            seeds: 3,
        };
        let ms = |v: Option<String>, flag: &str| -> Result<Duration, String> {
            v.and_then(|v| v.parse::<u64>().ok())
                .filter(|&v| (100..=60_000).contains(&v))
                .map(Duration::from_millis)
                .ok_or_else(|| format!("{flag} takes milliseconds in 100..=60000"))
        };
        while let Some(a) = args.next() {
            match a.as_str() {
                "--warmup-ms" => o.warmup = ms(args.next(), "--warmup-ms")?,
                "--measure-ms" => o.measure = ms(args.next(), "--measure-ms")?,
                "--out" => o.out = args.next().ok_or("--out takes a directory")?.into(),
                "--only" => {
                    let v = args.next().unwrap_or_default();
                    let bad = || {
                        format!(
                            "--only takes MODE:K (dagor, paper or collab; 1, 2 or 4), not `{v}`"
                        )
                    };
                    let (mode, k) = v.split_once(':').ok_or_else(bad)?;
                    let k: u32 = k.parse().map_err(|_| bad())?;
                    if !["dagor", "paper", "collab"].contains(&mode) || !SHAPES.contains(&k) {
                        return Err(bad());
                    }
                    o.only = Some((mode.to_string(), k));
                }
                "--trace" => o.trace = true,
                "--seeds" => {
                    o.seeds = args
                        .next()
                        .and_then(|v| v.parse().ok())
                        .filter(|n| (1..=20).contains(n))
                        .ok_or("--seeds takes a count in 1..=20")?;
                }
                // cargo bench passes --bench; other harness flags mean nothing here.
                "--bench" => {}
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        if o.trace && o.only.is_none() {
            return Err("--trace goes with --only".into());
        }
        Ok(o)
    }
}

fn service(shedding: Shedding) -> ServiceParams {
    ServiceParams {
        workers: WORKERS,
        service_us: SERVICE_US,
        queue: QUEUE,
        shedding,
        // The paper's 1 s / 2000 requests scaled down 20x to this service's
        // 2000 requests/s, so that the level settles within the warm-up (a
        // few seconds); the threshold, alpha and beta are the paper's, and
        // an overloaded window whose queue drained keeps the level
        // (`hold_while_draining`, the default).
        admission: AdmissionParams {
            window_us: 50_000,
            window_requests: 100,
            ..AdmissionParams::default()
        },
        seed: 7,
    }
}

/// `p` with the paper's rule: no holding while the queue drains.
fn paper_rule(mut p: ServiceParams) -> ServiceParams {
    p.admission.hold_while_draining = false;
    p
}

/// Runs a demo service on 127.0.0.1:0 while `f` drives it.
fn with_service<R>(params: ServiceParams, f: impl FnOnce(SocketAddr, &Counters) -> R) -> R {
    with_service_traced(params, None, f)
}

/// [`with_service`], keeping the service's trace in `trace` when given.
fn with_service_traced<R>(
    params: ServiceParams,
    trace: Option<&mut ServiceTrace>,
    f: impl FnOnce(SocketAddr, &Counters) -> R,
) -> R {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind the service");
    let addr = socket.local_addr().expect("service address");
    let stop = AtomicBool::new(false);
    let counters = Counters::default();
    std::thread::scope(|s| {
        let server = s.spawn(|| match trace {
            Some(t) => serve_traced(&socket, params, &stop, &counters, t),
            None => serve(&socket, params, &stop, &counters),
        });
        let r = f(addr, &counters);
        stop.store(true, Relaxed);
        server
            .join()
            .expect("service thread")
            .expect("service socket");
        r
    })
}

/// The module the callers ask the agent for; its route is the service.
const MODULE: ModuleId = ModuleId::new(1, 1);

/// Runs an embedded route server, reporter and agent (`Standalone`, every
/// port picked by the OS) whose route for [`MODULE`] is the service at
/// `service`, while `f` drives it with the agent's shard address.
fn with_agent<R>(service: SocketAddr, f: impl FnOnce(SocketAddr) -> R) -> R {
    let SocketAddr::V4(v4) = service else {
        panic!("the service binds IPv4")
    };
    let node = RouteNode {
        addr: NodeAddr::new(*v4.ip(), v4.port()),
        weight: 1,
    };
    let fill = |s: &mut dyn lbagent::store::Store| {
        s.import_routes(&[(MODULE, node)], true)
            .expect("the route into the store");
    };
    standalone::with_agent("dagor", MODULE, fill, f)
}

/// What one feed phase measured.
#[derive(Clone, Copy, Debug, Default)]
struct Phase {
    /// Upstream requests started in the measured part.
    offered: u64,
    /// Of those, all calls answered Ok in time.
    ok: u64,
    /// The same for business priority 1.
    top_offered: u64,
    top_ok: u64,
    /// Service counters over the measured part.
    arrived: u64,
    rejected: u64,
    queue_full: u64,
    started: u64,
    queuing_us_sum: u64,
    /// getHosts the agent answered Rejected (collaborative mode).
    agent_rejected: u64,
    /// getHosts asked of the agent (collaborative mode).
    agent_asked: u64,
}

impl Phase {
    /// Adds `o`'s counts (another realization of the same feed).
    fn add(&mut self, o: &Phase) {
        self.offered += o.offered;
        self.ok += o.ok;
        self.top_offered += o.top_offered;
        self.top_ok += o.top_ok;
        self.arrived += o.arrived;
        self.rejected += o.rejected;
        self.queue_full += o.queue_full;
        self.started += o.started;
        self.queuing_us_sum += o.queuing_us_sum;
        self.agent_rejected += o.agent_rejected;
        self.agent_asked += o.agent_asked;
    }

    fn success(&self) -> f64 {
        ratio(self.ok, self.offered)
    }
    fn top_success(&self) -> f64 {
        ratio(self.top_ok, self.top_offered)
    }
    /// The share of calls kept from the service's workers: rejected by the
    /// service, or by the agent before they were sent.
    fn rejected_fraction(&self) -> f64 {
        ratio(
            self.rejected + self.agent_rejected,
            self.arrived + self.agent_rejected,
        )
    }
    fn agent_rejected_fraction(&self) -> f64 {
        ratio(self.agent_rejected, self.agent_asked)
    }
    fn avg_queuing_ms(&self) -> f64 {
        ratio(self.queuing_us_sum, self.started) / 1000.0
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn snapshot(c: &Counters) -> [u64; 5] {
    [
        c.arrived.load(Relaxed),
        c.rejected.load(Relaxed),
        c.queue_full.load(Relaxed),
        c.started.load(Relaxed),
        c.queuing_us_sum.load(Relaxed),
    ]
}

/// One upstream request.
struct Upstream {
    b: u8,
    u: u8,
    done: u32,
    /// The phase whose measured part it started in.
    measured: Option<usize>,
}

/// Drives the service at `rates` (calls per second) one after the other,
/// each for warm-up + measure, with upstream requests of `k` sequential
/// calls arriving as a Poisson process of rate `rate / k`. With `agent`,
/// each call first asks the agent for a host (its priorities in the
/// getHost), is given up when the agent answers otherwise, and is reported
/// to the agent with the service's level once answered.
fn drive(
    addr: SocketAddr,
    agent: Option<SocketAddr>,
    counters: &Counters,
    k: u32,
    rates: &[f64],
    opts: &Opts,
    seed: u64,
) -> Vec<Phase> {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind the caller");
    socket.connect(addr).expect("connect");
    socket.set_nonblocking(true).expect("non-blocking");
    let agent_socket = agent.map(|a| {
        let s = UdpSocket::bind("127.0.0.1:0").expect("bind the agent's caller");
        s.connect(a).expect("connect");
        s.set_nonblocking(true).expect("non-blocking");
        s
    });
    let SocketAddr::V4(service_v4) = addr else {
        panic!("the service binds IPv4")
    };
    let service_node = NodeAddr::new(*service_v4.ip(), service_v4.port());
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut users = UserPriorities::new(0x5eed, 3600);
    // The user-priority key of a fixed hour, so that the seed alone
    // decides the realization (with the wall clock, every run within an
    // hour measured the same draw and the next hour another).
    let unix_s = KEY_TIME_S;
    let module = MODULE;
    let mut enc = Encoder::new();
    let mut buf = vec![0u8; 65_536];

    let span = opts.warmup + opts.measure;
    let total = span * rates.len() as u32;
    let mut phases = vec![Phase::default(); rates.len()];
    // Counter snapshots at each measured part's start and end.
    let marks: Vec<Duration> = (0..rates.len())
        .flat_map(|i| [span * i as u32 + opts.warmup, span * (i as u32 + 1)])
        .collect();
    let mut snaps = Vec::with_capacity(marks.len());

    let mut ups: Vec<Upstream> = Vec::new();
    // seq -> (upstream request, asked of the agent rather than the service).
    let mut pending: HashMap<u32, (usize, bool)> = HashMap::new();
    let mut timeouts: VecDeque<(Instant, u32)> = VecDeque::new();
    let mut seq = 0u32;
    let start = Instant::now();
    let mut next_arrival = Duration::ZERO;

    let mut send = |to: &UdpSocket,
                    enc: &mut Encoder,
                    pending: &mut HashMap<u32, (usize, bool)>,
                    timeouts: &mut VecDeque<(Instant, u32)>,
                    up: usize,
                    b: u8,
                    u: u8,
                    at_agent: bool| {
        seq = seq.wrapping_add(1);
        // A send that fails (buffer full) is a call that is never answered.
        let _ = to.send(enc.get_host_req(seq, module, b, u));
        pending.insert(seq, (up, at_agent));
        timeouts.push_back((Instant::now() + DEADLINE, seq));
    };
    // The first hop of a call: the agent when there is one, else the service.
    let first = agent_socket.as_ref().unwrap_or(&socket);
    let via_agent = agent_socket.is_some();
    let finish = |ups: &[Upstream], phases: &mut [Phase], up: usize, ok: bool| {
        if let (true, Some(p)) = (ok, ups[up].measured) {
            phases[p].ok += 1;
            if ups[up].b == 1 {
                phases[p].top_ok += 1;
            }
        }
    };

    loop {
        let el = start.elapsed();
        while snaps.len() < marks.len() && el >= marks[snaps.len()] {
            snaps.push(snapshot(counters));
        }
        let mut busy = false;
        // New upstream requests.
        while next_arrival <= el && next_arrival < total {
            let phase = (next_arrival.as_nanos() / span.as_nanos()) as usize;
            let in_measure = next_arrival - span * phase as u32 >= opts.warmup;
            let b = rng.u8(1..=CLASSES);
            let u = users.priority_of_id(rng.u64(0..USERS), unix_s);
            let measured = in_measure.then_some(phase);
            if let Some(p) = measured {
                phases[p].offered += 1;
                phases[p].top_offered += u64::from(b == 1);
            }
            ups.push(Upstream {
                b,
                u,
                done: 0,
                measured,
            });
            if let Some(p) = measured.filter(|_| via_agent) {
                phases[p].agent_asked += 1;
            }
            send(
                first,
                &mut enc,
                &mut pending,
                &mut timeouts,
                ups.len() - 1,
                b,
                u,
                via_agent,
            );
            let up_rate = rates[phase] / f64::from(k);
            next_arrival += Duration::from_secs_f64(-(1.0 - rng.f64()).ln() / up_rate);
            busy = true;
        }
        // The agent's answers: a host (call the service) or not (give up).
        while let Some(a) = &agent_socket {
            let n = match a.recv(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => continue,
            };
            busy = true;
            let Ok(Message::GetHostResp(resp)) = decode(&buf[..n], &Limits::UDP) else {
                continue;
            };
            let Some((up, true)) = pending.remove(&resp.seq()) else {
                continue; // late: its call already failed
            };
            if resp.retcode() != RetCode::Ok || resp.host().is_none() {
                if let (RetCode::Rejected, Some(p)) = (resp.retcode(), ups[up].measured) {
                    phases[p].agent_rejected += 1;
                }
                finish(&ups, &mut phases, up, false);
                continue;
            }
            let (b, u) = (ups[up].b, ups[up].u);
            send(
                &socket,
                &mut enc,
                &mut pending,
                &mut timeouts,
                up,
                b,
                u,
                false,
            );
        }
        // The service's answers.
        loop {
            let n = match socket.recv(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => continue,
            };
            busy = true;
            let Ok(Message::GetHostResp(resp)) = decode(&buf[..n], &Limits::UDP) else {
                continue;
            };
            let Some((up, false)) = pending.remove(&resp.seq()) else {
                continue; // late: its call already failed
            };
            if let Some(a) = &agent_socket {
                // The call completed (answered or shed by level): the node
                // is alive, so retcode 0; the level is the point.
                let level = piggyback::from_fb(resp.admission_level()).unwrap_or(None);
                let report = Report {
                    seq: resp.seq(),
                    module,
                    host: service_node,
                    retcode: 0,
                    tcost_ms: 0,
                    downstream_level: level,
                    consumed: 0,
                };
                let _ = a.send(enc.report_req(&report));
            }
            if resp.retcode() != RetCode::Ok {
                finish(&ups, &mut phases, up, false);
                continue;
            }
            ups[up].done += 1;
            if ups[up].done == k {
                finish(&ups, &mut phases, up, true);
            } else {
                let (b, u) = (ups[up].b, ups[up].u);
                send(
                    first,
                    &mut enc,
                    &mut pending,
                    &mut timeouts,
                    up,
                    b,
                    u,
                    via_agent,
                );
            }
        }
        // Deadlines.
        let now = Instant::now();
        while let Some(&(deadline, s)) = timeouts.front() {
            if deadline > now {
                break;
            }
            timeouts.pop_front();
            if let Some((up, _)) = pending.remove(&s) {
                finish(&ups, &mut phases, up, false);
            }
        }
        let el = start.elapsed();
        if el >= total && (pending.is_empty() || el >= total + DEADLINE * 2) {
            break;
        }
        if !busy {
            let until_next = next_arrival.saturating_sub(el);
            std::thread::sleep(until_next.min(Duration::from_micros(200)));
        }
    }
    while snaps.len() < marks.len() {
        snaps.push(snapshot(counters));
    }
    for (i, p) in phases.iter_mut().enumerate() {
        let (a, z) = (snaps[2 * i], snaps[2 * i + 1]);
        p.arrived = z[0] - a[0];
        p.rejected = z[1] - a[1];
        p.queue_full = z[2] - a[2];
        p.started = z[3] - a[3];
        p.queuing_us_sum = z[4] - a[4];
    }
    phases
}

/// The driver's seed for call shape `si` (index in [`SHAPES`]) in
/// realization `j` (0 is the seed of a one-realization run).
fn seed_of(si: usize, j: u32) -> u64 {
    1000 + si as u64 + 100 * u64::from(j)
}

/// One mode's runs through the feeds, one per realization (seed).
struct Runs {
    /// Per feed: the realizations' phases added up.
    pooled: Vec<Phase>,
    /// Per realization, per feed.
    each: Vec<Vec<Phase>>,
}

impl Runs {
    fn of(each: Vec<Vec<Phase>>) -> Runs {
        let mut pooled = vec![Phase::default(); FEEDS.len()];
        for run in &each {
            for (p, q) in pooled.iter_mut().zip(run) {
                p.add(q);
            }
        }
        Runs { pooled, each }
    }

    /// The lowest and highest success of one realization at feed `i`.
    fn range(&self, i: usize) -> (f64, f64) {
        self.each
            .iter()
            .map(|r| r[i].success())
            .fold((1.0f64, 0.0f64), |(lo, hi), x| (lo.min(x), hi.max(x)))
    }
}

/// One feed of one call shape, in the three modes.
struct Row {
    feed: f64,
    k: u32,
    /// The DAGOR modes pooled over `--seeds` realizations, and the lowest
    /// and highest success of one realization.
    dagor: Phase,
    /// DAGOR at the service only with the paper's rule.
    paper: Phase,
    collab: Phase,
    dagor_range: (f64, f64),
    paper_range: (f64, f64),
    collab_range: (f64, f64),
    random: Phase,
    off: Phase,
}

impl Row {
    fn optimum(&self) -> f64 {
        (1.0 / self.feed).min(1.0)
    }

    fn line(&self) -> String {
        format!(
            "M{} feed {:.1}x: optimum {:.3}  collaborative {:.3} ({:.1}% of optimum, class 1 {:.3}, \
             agent rejected {:.3}, service rejected {}, queuing {:.1} ms)  \
             DAGOR {:.3} ({:.1}% of optimum, class 1 {:.3}, \
             rejected {:.3}, queuing {:.1} ms)  paper's rule {:.3} ({:.1}%)  random {:.3} (class 1 {:.3})  off {:.3} \
             (queue full {}, queuing {:.0} ms)",
            self.k,
            self.feed,
            self.optimum(),
            self.collab.success(),
            100.0 * self.collab.success() / self.optimum(),
            self.collab.top_success(),
            self.collab.agent_rejected_fraction(),
            self.collab.rejected,
            self.collab.avg_queuing_ms(),
            self.dagor.success(),
            100.0 * self.dagor.success() / self.optimum(),
            self.dagor.top_success(),
            self.dagor.rejected_fraction(),
            self.dagor.avg_queuing_ms(),
            self.paper.success(),
            100.0 * self.paper.success() / self.optimum(),
            self.random.success(),
            self.random.top_success(),
            self.off.success(),
            self.off.queue_full,
            self.off.avg_queuing_ms(),
        )
    }
}

fn find(rows: &[Row], feed: f64, k: u32) -> Option<&Row> {
    rows.iter().find(|r| r.feed == feed && r.k == k)
}

/// `f` of the row of each shape (M1 / M2 / M4) at `feed`, joined by " / "
/// ("-" where a shape has no row).
fn per_shape(rows: &[Row], feed: f64, f: &dyn Fn(&Row) -> String) -> String {
    SHAPES
        .iter()
        .map(|&k| find(rows, feed, k).map_or("-".into(), f))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `success` (pooled) as % of `optimum`, then the lowest and highest
/// realization's: `95.8 (93.0–97.1)`.
fn pct_range(success: f64, (lo, hi): (f64, f64), optimum: f64) -> String {
    let pct = |x: f64| 100.0 * x / optimum;
    format!("{:.1} ({:.1}–{:.1})", pct(success), pct(lo), pct(hi))
}

/// The 1, 5 and 15 minute load averages (`/proc/loadavg`), or why not.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |e| format!("(no /proc/loadavg: {e})"),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

fn tables(rows: &[Row], opts: &Opts, load: &str) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "Success rate (upstream requests answered Ok within 500 ms / offered; the DAGOR \
         modes pooled over {} realizations, each a different driver seed, i.e. other \
         arrival times and priorities):\n\n",
        opts.seeds
    ));
    s.push_str(
        "| feed | optimum | collaborative M1 | collaborative M2 | collaborative M4 \
         | DAGOR M1 | DAGOR M2 | DAGOR M4 | random M1 | random M2 | random M4 \
         | no control M1 | no control M2 | no control M4 |\n",
    );
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for &feed in &FEEDS {
        let cell = |k: u32, f: fn(&Row) -> f64| {
            find(rows, feed, k).map_or("-".to_string(), |r| format!("{:.3}", f(r)))
        };
        s.push_str(&format!("| {feed:.1}x | {:.3} ", (1.0 / feed).min(1.0)));
        for f in [
            (|r: &Row| r.collab.success()) as fn(&Row) -> f64,
            |r: &Row| r.dagor.success(),
            |r: &Row| r.random.success(),
            |r: &Row| r.off.success(),
        ] {
            for k in SHAPES {
                s.push_str(&format!("| {} ", cell(k, f)));
            }
        }
        s.push_str("|\n");
    }
    s.push_str(
        "\nCollaborative admission in detail (M1 / M2 / M4): success as a share of the \
         optimum (pooled, then the lowest and highest realization), business class 1's success, the share of getHosts the agent answered \
         Rejected, calls the service itself rejected, the service's average queuing time:\n\n",
    );
    s.push_str(
        "| feed | % of optimum | class 1 success | agent rejected | service rejected | avg queuing (ms) |\n",
    );
    s.push_str("|---|---|---|---|---|---|\n");
    for &feed in &FEEDS {
        let join = |f: &dyn Fn(&Row) -> String| per_shape(rows, feed, f);
        s.push_str(&format!(
            "| {feed:.1}x | {} | {} | {} | {} | {} |\n",
            join(&|r| pct_range(r.collab.success(), r.collab_range, r.optimum())),
            join(&|r| format!("{:.3}", r.collab.top_success())),
            join(&|r| format!("{:.3}", r.collab.agent_rejected_fraction())),
            join(&|r| r.collab.rejected.to_string()),
            join(&|r| format!("{:.1}", r.collab.avg_queuing_ms())),
        ));
    }
    s.push_str(
        "\nDAGOR at the service only in detail (M1 / M2 / M4): success as a share of the optimum \
         (pooled, then the lowest and highest realization), business \
         class 1's success, the share of calls the service rejected (random shedding used \
         the same share), the service's average queuing time, and the same run's service \
         with the paper's rule (every overloaded window cuts; hold_while_draining = false):\n\n",
    );
    s.push_str("| feed | % of optimum | class 1 success | rejected | avg queuing (ms) | random: class 1 success | paper's rule: % of optimum | paper's rule: avg queuing (ms) |\n");
    s.push_str("|---|---|---|---|---|---|---|---|\n");
    for &feed in &FEEDS {
        let join = |f: &dyn Fn(&Row) -> String| per_shape(rows, feed, f);
        s.push_str(&format!(
            "| {feed:.1}x | {} | {} | {} | {} | {} | {} | {} |\n",
            join(&|r| pct_range(r.dagor.success(), r.dagor_range, r.optimum())),
            join(&|r| format!("{:.3}", r.dagor.top_success())),
            join(&|r| format!("{:.3}", r.dagor.rejected_fraction())),
            join(&|r| format!("{:.1}", r.dagor.avg_queuing_ms())),
            join(&|r| format!("{:.3}", r.random.top_success())),
            join(&|r| pct_range(r.paper.success(), r.paper_range, r.optimum())),
            join(&|r| format!("{:.1}", r.paper.avg_queuing_ms())),
        ));
    }
    s.push_str(&format!(
        "\nService {WORKERS} workers x {SERVICE_US} us = {:.0} requests/s, queue {QUEUE}; \
         business priorities 1..={CLASSES} uniform, {USERS} users; warm-up {} ms and \
         measure {} ms per feed; Poisson arrivals. Load average (1, 5, 15 min) {load}: \
         the driver, the service and the agent are threads of this one process, so a busy \
         machine delays answers past the deadline in any mode. The algorithm alone, without \
         the machine (seeded, exact time, the same feeds and shapes): \
         `cargo test --lib sim_report -- --ignored --nocapture`.\n",
        f64::from(WORKERS) * 1e6 / SERVICE_US as f64,
        opts.warmup.as_millis(),
        opts.measure.as_millis(),
    ));
    s
}

/// Loads a TrueType font for the plot's text.
fn font() -> Result<&'static [u8], String> {
    let candidates: Vec<PathBuf> = std::env::var_os("LBAGENT_PLOT_FONT")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            [
                "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/TTF/DejaVuSans.ttf",
                "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            ]
            .map(PathBuf::from),
        )
        .collect();
    for p in &candidates {
        if let Ok(bytes) = std::fs::read(p) {
            return Ok(Box::leak(bytes.into_boxed_slice()));
        }
    }
    Err("no TrueType font found: install fonts-dejavu-core or set LBAGENT_PLOT_FONT".into())
}

fn plot(rows: &[Row], path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let bytes = font()?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| "the font file is not a usable TrueType font".to_string())?;
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let panels = root.split_evenly((1, 2));
    let blue = |k: u32| match k {
        1 => RGBColor(20, 60, 200),
        2 => RGBColor(60, 120, 230),
        _ => RGBColor(120, 170, 250),
    };
    let orange = |k: u32| match k {
        1 => RGBColor(220, 100, 0),
        2 => RGBColor(240, 150, 40),
        _ => RGBColor(250, 190, 110),
    };
    type Series<'a> = (String, RGBColor, Box<dyn Fn(&Row) -> f64 + 'a>, u32);
    let simple: Vec<Series> = vec![
        (
            "DAGOR collaborative (through the agent)".into(),
            RGBColor(120, 0, 160),
            Box::new(|r: &Row| r.collab.success()),
            1,
        ),
        (
            "DAGOR (service only)".into(),
            blue(1),
            Box::new(|r: &Row| r.dagor.success()),
            1,
        ),
        (
            "DAGOR class 1".into(),
            RGBColor(0, 150, 70),
            Box::new(|r: &Row| r.dagor.top_success()),
            1,
        ),
        (
            "random shedding, same rate".into(),
            orange(1),
            Box::new(|r: &Row| r.random.success()),
            1,
        ),
        (
            "no control".into(),
            RGBColor(200, 0, 0),
            Box::new(|r: &Row| r.off.success()),
            1,
        ),
    ];
    let purple = |k: u32| match k {
        1 => RGBColor(120, 0, 160),
        2 => RGBColor(160, 60, 200),
        _ => RGBColor(200, 130, 230),
    };
    let composite: Vec<Series> = SHAPES
        .iter()
        .map(|&k| {
            (
                format!("collaborative M{k}"),
                purple(k),
                Box::new(|r: &Row| r.collab.success()) as Box<dyn Fn(&Row) -> f64>,
                k,
            )
        })
        .chain(SHAPES.iter().map(|&k| {
            (
                format!("DAGOR M{k}"),
                blue(k),
                Box::new(|r: &Row| r.dagor.success()) as Box<dyn Fn(&Row) -> f64>,
                k,
            )
        }))
        .chain(SHAPES.iter().map(|&k| {
            (
                format!("random M{k}"),
                orange(k),
                Box::new(|r: &Row| r.random.success()) as Box<dyn Fn(&Row) -> f64>,
                k,
            )
        }))
        .collect();
    for (area, (title, series)) in panels.iter().zip([
        ("Simple calls (M1): success rate vs feed", simple),
        (
            "Composite calls (M1, M2, M4): success rate vs feed",
            composite,
        ),
    ]) {
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.9f64..4.1f64, 0f64..1.05f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("feed rate / capacity")
            .y_desc("success rate")
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(LineSeries::new(
                (90..=410).map(|x| {
                    let f = f64::from(x) / 100.0;
                    (f, (1.0 / f).min(1.0))
                }),
                BLACK.stroke_width(2),
            ))
            .map_err(err)?
            .label("optimum = capacity / feed")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
        for (name, color, f, k) in series {
            let points: Vec<(f64, f64)> = FEEDS
                .iter()
                .filter_map(|&feed| find(rows, feed, k).map(|r| (feed, f(r))))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}
