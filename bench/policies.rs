//! Issue 31's experiment through the real agent: a fleet of demo-service
//! nodes of different speeds (four at 2 ms, one at 10 ms, one that fails
//! fast), driven open loop through an embedded agent (route server,
//! reporter and agent: `Standalone`) at 70% and 90% of the fleet's
//! capacity, under `l5`, `l5` with weights and `p2c`: p50 / p99 latency
//! (from each call's intended start, coordinated omission corrected) and
//! success rate. Then a 2 ms node restarted under load (down from 3 s to
//! 8 s in, then back "cold", four times slower for its first 2 s) with and
//! without slow start: per second after its return, the calls sent to it
//! (counted by the second they were sent) and how many failed, its
//! queue-full answers and mean queuing time. Each figure is the median of
//! `--rounds` runs (3) with its range.
//!
//! ```text
//! cargo bench --bench policies                 # the whole experiment
//! cargo bench --bench policies -- --quick      # 1 s warm-up, 3 s measured, 1 round
//! cargo bench --bench policies -- --rounds 5   # medians of 5
//! cargo bench --bench policies -- --restart-only
//! cargo bench --bench policies -- --plot FILE  # also a PNG of the table
//! ```
//!
//! Every call: getHost to the agent, the request to the node it names,
//! the node's answer (or 1 s without one: a failure), a report to the
//! agent with the call's retcode and time cost. Not run by CI.

#[path = "support/standalone.rs"]
mod standalone;

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use lbagent::admission::AdmissionParams;
use lbagent::demo_service::{serve, serve_cold, ColdStart, Counters, ServiceParams, Shedding};
use lbagent::model::{ModuleId, ModuleOptions, NodeAddr, Policy, RouteNode};
use lbagent::wire::{decode, Encoder, Limits, Message, Report, RetCode};

const MODULE: ModuleId = ModuleId::new(31, 1);
/// A call unanswered this long failed.
const DEADLINE: Duration = Duration::from_secs(1);
/// Each node's queue: past it a request is answered Unavailable at once.
const QUEUE: usize = 16;

/// One node of the fleet: its service time and whether it fails fast.
#[derive(Clone, Copy)]
struct NodeSpec {
    #[allow(dead_code)]
    name: &'static str,
    service_us: u64,
    fails: bool,
    weight: u32,
}

const FLEET: [NodeSpec; 6] = [
    NodeSpec {
        name: "2ms-a",
        service_us: 2_000,
        fails: false,
        weight: 5,
    },
    NodeSpec {
        name: "2ms-b",
        service_us: 2_000,
        fails: false,
        weight: 5,
    },
    NodeSpec {
        name: "2ms-c",
        service_us: 2_000,
        fails: false,
        weight: 5,
    },
    NodeSpec {
        name: "2ms-d",
        service_us: 2_000,
        fails: false,
        weight: 5,
    },
    NodeSpec {
        name: "10ms",
        service_us: 10_000,
        fails: false,
        weight: 1,
    },
    NodeSpec {
        name: "fails",
        service_us: 2_000,
        fails: true,
        weight: 1,
    },
];

fn params(service_us: u64, fails: bool) -> ServiceParams {
    ServiceParams {
        workers: 1,
        service_us,
        queue: QUEUE,
        shedding: if fails {
            Shedding::Random { rate: 1.0 }
        } else {
            Shedding::Off
        },
        admission: AdmissionParams::default(),
        seed: 31,
    }
}

/// The fleet's capacity, calls per second (the failing node counts none).
fn capacity() -> f64 {
    FLEET
        .iter()
        .filter(|n| !n.fails)
        .map(|n| params(n.service_us, false).capacity())
        .sum()
}

/// A node served on its own thread until `stop`; `slow` (when set) makes
/// it answer at half speed until that instant, as a cold restart.
struct Served {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn start_node(spec: NodeSpec, bind: SocketAddr, cold_for: Option<Duration>) -> Served {
    let socket = UdpSocket::bind(bind).expect("bind a node");
    let addr = socket.local_addr().expect("node address");
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let (s, c) = (stop.clone(), counters.clone());
    let thread = std::thread::spawn(move || {
        let p = params(spec.service_us, spec.fails);
        let _ = match cold_for {
            Some(duration) => {
                let cold = ColdStart {
                    duration,
                    factor: COLD_FACTOR,
                };
                serve_cold(&socket, p, cold, &s, &c)
            }
            None => serve(&socket, p, &s, &c),
        };
    });
    Served {
        addr,
        stop,
        counters,
        thread: Some(thread),
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn node_of(a: SocketAddr) -> NodeAddr {
    let SocketAddr::V4(v4) = a else {
        panic!("nodes bind IPv4")
    };
    NodeAddr::new(*v4.ip(), v4.port())
}

/// An embedded route server, reporter and agent whose route for
/// [`MODULE`] is `nodes`, of `policy` and `options`, while `f` drives it.
fn with_agent<R>(
    nodes: &[RouteNode],
    policy: Policy,
    options: ModuleOptions,
    f: impl FnOnce(SocketAddr) -> R,
) -> R {
    let rows: Vec<(ModuleId, RouteNode)> = nodes.iter().map(|&n| (MODULE, n)).collect();
    let fill = |s: &mut dyn lbagent::store::Store| {
        s.import_routes(&rows, true).expect("the route");
        s.set_policy(MODULE, policy).expect("the policy");
        s.set_options(MODULE, options).expect("the options");
    };
    standalone::with_agent("policies", MODULE, fill, f)
}

/// What a run measured over its measured part.
#[derive(Default)]
struct Measured {
    calls: u64,
    ok: u64,
    latency_us: Option<Histogram<u64>>,
    /// Calls and failures per node (by address), in the measured part.
    per_node: HashMap<NodeAddr, (u64, u64)>,
    /// Calls and failures per node in each second since the start.
    per_second: Vec<HashMap<NodeAddr, (u64, u64)>>,
}

/// One call in flight.
struct Call {
    intended: Instant,
    measured: bool,
    node: Option<(NodeAddr, Instant)>,
}

/// Drives the agent open loop at `rate` calls/s for `warmup + measure`,
/// calling `at(elapsed)` each turn (for a restart).
fn drive(
    agent: SocketAddr,
    rate: f64,
    warmup: Duration,
    measure: Duration,
    mut at: impl FnMut(Duration),
) -> Measured {
    let sock = UdpSocket::bind("127.0.0.1:0").expect("bind the caller");
    sock.set_nonblocking(true).expect("non-blocking");
    let mut enc = Encoder::new();
    let mut buf = vec![0u8; 65_536];
    let mut m = Measured {
        latency_us: Some(Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram")),
        ..Measured::default()
    };
    let total = warmup + measure;
    let mut calls: HashMap<u32, Call> = HashMap::new();
    let mut seq: u32 = 0;
    let mut sent: u64 = 0;
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let finish = |m: &mut Measured, c: &Call, ok: bool, now: Instant| {
        if let Some((node, asked)) = c.node {
            // By the second the call was sent to the node, so that a call
            // sent while the node was down counts there, not when it
            // timed out.
            let second = asked.duration_since(start).as_secs() as usize;
            if m.per_second.len() <= second {
                m.per_second.resize_with(second + 1, HashMap::new);
            }
            let e = m.per_second[second].entry(node).or_default();
            e.0 += 1;
            e.1 += u64::from(!ok);
        }
        if !c.measured {
            return;
        }
        m.calls += 1;
        if ok {
            m.ok += 1;
        }
        if let Some((node, _)) = c.node {
            let e = m.per_node.entry(node).or_default();
            e.0 += 1;
            e.1 += u64::from(!ok);
        }
        let us = now.duration_since(c.intended).as_micros() as u64;
        let _ = m.latency_us.as_mut().expect("set").record(us.max(1));
    };
    loop {
        let now = Instant::now();
        let el = now.duration_since(start);
        at(el);
        // New calls, at their intended times.
        while start + interval * sent as u32 <= now && interval * (sent as u32) < total {
            let intended = start + interval * sent as u32;
            sent += 1;
            seq = seq.wrapping_add(1);
            let measured = intended.duration_since(start) >= warmup;
            let _ = sock.send_to(enc.get_host_req(seq, MODULE, 0, 0), agent);
            calls.insert(
                seq,
                Call {
                    intended,
                    measured,
                    node: None,
                },
            );
        }
        // Answers: the agent's and the nodes'.
        let mut busy = false;
        while let Ok((n, from)) = sock.recv_from(&mut buf) {
            busy = true;
            let Ok(Message::GetHostResp(r)) = decode(&buf[..n], &Limits::UDP) else {
                continue;
            };
            let now = Instant::now();
            if from == agent {
                let Some(c) = calls.get_mut(&r.seq()) else {
                    continue;
                };
                match (r.retcode(), r.host()) {
                    (RetCode::Ok, Some(h)) => {
                        let node = NodeAddr::from(h);
                        c.node = Some((node, now));
                        let to = SocketAddr::from((node.ipv4(), node.port));
                        let _ = sock.send_to(enc.get_host_req(r.seq(), MODULE, 0, 0), to);
                    }
                    _ => {
                        let c = calls.remove(&r.seq()).expect("held");
                        finish(&mut m, &c, false, now);
                    }
                }
            } else if let Some(c) = calls.remove(&r.seq()) {
                let ok = r.retcode() == RetCode::Ok;
                if let Some((node, asked)) = c.node {
                    let tcost = now.duration_since(asked).as_millis() as u32;
                    report(&sock, &mut enc, agent, node, ok, tcost);
                }
                finish(&mut m, &c, ok, now);
            }
        }
        // Calls past their deadline failed.
        let now = Instant::now();
        let late: Vec<u32> = calls
            .iter()
            .filter(|(_, c)| now.duration_since(c.intended) >= DEADLINE)
            .map(|(&s, _)| s)
            .collect();
        for s in late {
            let c = calls.remove(&s).expect("listed");
            if let Some((node, asked)) = c.node {
                let tcost = now.duration_since(asked).as_millis() as u32;
                report(&sock, &mut enc, agent, node, false, tcost);
            }
            finish(&mut m, &c, false, now);
        }
        if el >= total && calls.is_empty() {
            break;
        }
        if el >= total + DEADLINE * 2 {
            break;
        }
        if !busy {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    m
}

fn report(
    sock: &UdpSocket,
    enc: &mut Encoder,
    agent: SocketAddr,
    node: NodeAddr,
    ok: bool,
    tcost_ms: u32,
) {
    let rep = Report {
        seq: 0,
        module: MODULE,
        host: node,
        retcode: if ok { 0 } else { -1 },
        tcost_ms,
        downstream_level: None,
        consumed: 0,
    };
    let _ = sock.send_to(enc.report_req(&rep), agent);
}

struct Opts {
    warmup: Duration,
    measure: Duration,
    rounds: usize,
    plot: Option<PathBuf>,
    only_restart: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        warmup: Duration::from_secs(2),
        measure: Duration::from_secs(8),
        rounds: 3,
        plot: None,
        only_restart: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => {
                o.warmup = Duration::from_secs(1);
                o.measure = Duration::from_secs(3);
                o.rounds = 1;
            }
            "--rounds" => {
                o.rounds = args
                    .next()
                    .and_then(|r| r.parse().ok())
                    .filter(|&r| r > 0)
                    .expect("--rounds takes a count of at least 1")
            }
            "--restart-only" => o.only_restart = true,
            "--plot" => o.plot = args.next().map(PathBuf::from),
            _ => {}
        }
    }
    o
}

/// One line of the table: the median of the rounds, with each figure's
/// range.
struct Row {
    policy: &'static str,
    load: f64,
    p50_ms: Spread,
    p99_ms: Spread,
    success: Spread,
    slow_share: Spread,
    failing_share: Spread,
}

/// The median of several rounds' figures and their range.
#[derive(Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Spread {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }

    fn show(&self, scale: f64, digits: usize) -> String {
        if self.min == self.max {
            return format!("{:.*}", digits, self.median * scale);
        }
        format!(
            "{:.*} ({:.*}–{:.*})",
            digits,
            self.median * scale,
            digits,
            self.min * scale,
            digits,
            self.max * scale
        )
    }
}

/// One round of one policy at one load: p50 ms, p99 ms, success, the
/// slow node's share, the failing node's share.
fn policy_round(o: &Opts, policy: Policy, weighted: bool, load: f64) -> [f64; 5] {
    let served: Vec<Served> = FLEET
        .iter()
        .map(|&s| start_node(s, "127.0.0.1:0".parse().unwrap(), None))
        .collect();
    let route: Vec<RouteNode> = FLEET
        .iter()
        .zip(&served)
        .map(|(s, n)| RouteNode {
            addr: node_of(n.addr),
            weight: if weighted { s.weight } else { 1 },
        })
        .collect();
    let m = with_agent(&route, policy, ModuleOptions::default(), |agent| {
        drive(agent, capacity() * load, o.warmup, o.measure, |_| {})
    });
    let h = m.latency_us.as_ref().expect("set");
    let share = |i: usize| {
        let calls = m.per_node.get(&node_of(served[i].addr)).map_or(0, |e| e.0);
        calls as f64 / m.calls.max(1) as f64
    };
    [
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        m.ok as f64 / m.calls.max(1) as f64,
        share(4),
        share(5),
    ]
}

/// How long the restarted node is down, from `RESTART_DOWN` in.
const RESTART_DOWN: Duration = Duration::from_secs(3);
/// When it comes back.
const RESTART_UP: Duration = Duration::from_secs(8);
/// How long it is cold once back, and how much slower it then is.
const COLD: Duration = Duration::from_secs(2);
/// See [`COLD`].
const COLD_FACTOR: u64 = 4;
/// Seconds after its return shown per second.
const AFTER: usize = 4;

/// One restart run: per second after the node's return, the calls sent to
/// it and how many failed; the queue-full answers it gave while cold and
/// after; its mean queuing time, ms; the run's overall success.
struct RestartRound {
    per_second: Vec<(u64, u64)>,
    queue_full: u64,
    mean_queue_ms: f64,
    success: f64,
}

fn restart_round(slow_start: u32) -> RestartRound {
    let mut served: Vec<Option<Served>> = FLEET
        .iter()
        .map(|&s| Some(start_node(s, "127.0.0.1:0".parse().unwrap(), None)))
        .collect();
    let addr = served[0].as_ref().expect("started").addr;
    let route: Vec<RouteNode> = served
        .iter()
        .map(|n| RouteNode {
            addr: node_of(n.as_ref().expect("started").addr),
            weight: 1,
        })
        .collect();
    let options = ModuleOptions {
        slow_start_ms: Some(slow_start),
        ..ModuleOptions::default()
    };
    let total = RESTART_UP + Duration::from_secs(AFTER as u64 + 1);
    let m = with_agent(&route, Policy::L5, options, |agent| {
        drive(agent, capacity() * 0.7, Duration::ZERO, total, |el| {
            if el >= RESTART_DOWN && el < RESTART_UP && served[0].is_some() {
                served[0] = None;
            }
            if el >= RESTART_UP && served[0].is_none() {
                served[0] = Some(start_node(FLEET[0], addr, Some(COLD)));
            }
        })
    });
    let node = node_of(addr);
    let up = RESTART_UP.as_secs() as usize;
    let per_second = (up..up + AFTER)
        .map(|s| {
            m.per_second
                .get(s)
                .and_then(|s| s.get(&node))
                .copied()
                .unwrap_or((0, 0))
        })
        .collect();
    let back = served[0].as_ref().expect("restarted");
    let started = back.counters.started.load(Relaxed);
    RestartRound {
        per_second,
        queue_full: back.counters.queue_full.load(Relaxed),
        mean_queue_ms: back.counters.queuing_us_sum.load(Relaxed) as f64
            / 1000.0
            / started.max(1) as f64,
        success: m.ok as f64 / m.calls.max(1) as f64,
    }
}

fn main() {
    let o = opts();
    let cap = capacity();
    println!(
        "# fleet: 4 nodes at 2 ms, 1 at 10 ms, 1 failing fast (1 worker each, queue {QUEUE}); capacity {cap:.0} calls/s"
    );
    println!(
        "# {} round(s), {} s warm-up + {} s measured each; medians, range in brackets",
        o.rounds,
        o.warmup.as_secs(),
        o.measure.as_secs()
    );
    println!("# machine load at the start: {}", load_average());
    let mut rows = Vec::new();
    let shapes: [(&str, Policy, bool); 3] = [
        ("l5", Policy::L5, false),
        ("l5+weights", Policy::L5, true),
        ("p2c", Policy::P2c, false),
    ];
    if !o.only_restart {
        println!("| policy | offered | p50 ms | p99 ms | success % | 10 ms node's share % | failing node's share % |");
        println!("|---|---|---:|---:|---:|---:|---:|");
        for load in [0.7, 0.9] {
            for &(name, policy, weighted) in &shapes {
                // Rounds interleaved with nothing else: one policy's
                // rounds back to back, each on fresh nodes and a fresh
                // agent.
                let runs: Vec<[f64; 5]> = (0..o.rounds)
                    .map(|_| policy_round(&o, policy, weighted, load))
                    .collect();
                let col = |k: usize| Spread::of(runs.iter().map(|r| r[k]).collect());
                let row = Row {
                    policy: name,
                    load,
                    p50_ms: col(0),
                    p99_ms: col(1),
                    success: col(2),
                    slow_share: col(3),
                    failing_share: col(4),
                };
                println!(
                    "| {} | {:.0}% ({:.0}/s) | {} | {} | {} | {} | {} |",
                    row.policy,
                    row.load * 100.0,
                    cap * load,
                    row.p50_ms.show(1.0, 2),
                    row.p99_ms.show(1.0, 2),
                    row.success.show(100.0, 2),
                    row.slow_share.show(100.0, 1),
                    row.failing_share.show(100.0, 1)
                );
                rows.push(row);
            }
        }
    }
    // A 2 ms node restarted under load at 70%: down from 3 s to 8 s in
    // (long enough for L5 to mark it overloaded and for its probes to
    // fail), then back cold, four times slower for its first 2 s.
    println!(
        "# restart: a 2 ms node down {}–{} s, then {}× slower for {} s; calls counted by the second they were sent to it",
        RESTART_DOWN.as_secs(),
        RESTART_UP.as_secs(),
        COLD_FACTOR,
        COLD.as_secs()
    );
    let mut head = String::from("| slow_start_ms |");
    let mut rule = String::from("|---:|");
    for s in 0..AFTER {
        head.push_str(&format!(" second {} back: calls, failed % |", s + 1));
        rule.push_str("---:|");
    }
    head.push_str(" queue-full answers | mean queuing ms | overall success % |");
    rule.push_str("---:|---:|---:|");
    println!("{head}\n{rule}");
    for slow_start in [0u32, 3_000] {
        let runs: Vec<RestartRound> = (0..o.rounds).map(|_| restart_round(slow_start)).collect();
        let mut line = format!("| {slow_start} |");
        for s in 0..AFTER {
            let calls = Spread::of(runs.iter().map(|r| r.per_second[s].0 as f64).collect());
            let failed = Spread::of(
                runs.iter()
                    .map(|r| r.per_second[s].1 as f64 / r.per_second[s].0.max(1) as f64)
                    .collect(),
            );
            line.push_str(&format!(
                " {}, {} |",
                calls.show(1.0, 0),
                failed.show(100.0, 1)
            ));
        }
        let qf = Spread::of(runs.iter().map(|r| r.queue_full as f64).collect());
        let mq = Spread::of(runs.iter().map(|r| r.mean_queue_ms).collect());
        let ok = Spread::of(runs.iter().map(|r| r.success).collect());
        line.push_str(&format!(
            " {} | {} | {} |",
            qf.show(1.0, 0),
            mq.show(1.0, 2),
            ok.show(100.0, 2)
        ));
        println!("{line}");
    }
    if let Some(path) = &o.plot {
        match plot(&rows, path) {
            Ok(()) => println!("# plot: {}", path.display()),
            Err(e) => eprintln!("plot: {e}"),
        }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn font() -> Result<&'static [u8], String> {
    for p in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ] {
        if let Ok(bytes) = std::fs::read(p) {
            return Ok(Box::leak(bytes.into_boxed_slice()));
        }
    }
    Err("no TrueType font found: install fonts-dejavu-core".into())
}

/// p99 latency and success per policy, at 70% and 90% load: medians, a
/// vertical line for the range over the rounds.
fn plot(rows: &[Row], path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let bytes = font()?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| "the font file is not a usable TrueType font".to_string())?;
    let root = BitMapBackend::new(path, (1200, 480)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let panels = root.split_evenly((1, 2));
    let policies = ["l5", "l5+weights", "p2c"];
    let colors = [
        RGBColor(200, 60, 40),
        RGBColor(40, 120, 200),
        RGBColor(30, 150, 60),
    ];
    let max_p99 = rows.iter().map(|r| r.p99_ms.max).fold(1.0, f64::max) * 1.1;
    for (k, (title, top)) in [("p99 latency, ms", max_p99), ("success, %", 100.0)]
        .into_iter()
        .enumerate()
    {
        let mut chart = ChartBuilder::on(&panels[k])
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(60.0..100.0, 0.0..top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("offered load, % of the fleet's capacity")
            .draw()
            .map_err(err)?;
        for (i, p) in policies.iter().enumerate() {
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.policy == *p)
                .map(|r| {
                    let y = if k == 0 {
                        r.p99_ms.median
                    } else {
                        r.success.median * 100.0
                    };
                    (r.load * 100.0, y)
                })
                .collect();
            let c = colors[i];
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(err)?
                .label(*p)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
            chart
                .draw_series(pts.iter().map(|&xy| Circle::new(xy, 4, c.filled())))
                .map_err(err)?;
            // Each point's range over the rounds.
            let ranges = rows.iter().filter(|r| r.policy == *p).map(|r| {
                let (lo, hi) = if k == 0 {
                    (r.p99_ms.min, r.p99_ms.max)
                } else {
                    (r.success.min * 100.0, r.success.max * 100.0)
                };
                let x = r.load * 100.0;
                PathElement::new(vec![(x, lo), (x, hi)], c.stroke_width(1))
            });
            chart.draw_series(ranges).map_err(err)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
