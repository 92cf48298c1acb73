//! qpstest's open loop end to end: a fake agent on loopback that stalls
//! once or answers slowly, the floor, the interval log read back with the
//! `hdrhistogram` crate, a rate the generator cannot keep, and `qpstest
//! compare` on runs of an agent and of a 20% slower one.
//!
//! Rates and bounds are chosen for a busy 2-core machine: the figures
//! asserted differ from their thresholds by several times what a stalled
//! or throttled machine adds.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hdrhistogram::serialization::interval_log::{IntervalLogIterator, LogEntry};
use hdrhistogram::serialization::Deserializer;
use hdrhistogram::Histogram;
use lbagent::host::clock;
use lbagent::host::heartbeat::{AgentInfo, HeartbeatWriter};
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::qpstest::compare::{compare, Verdict};
use lbagent::qpstest::{run_open, OpenLoop, OpenReport, QpsOptions, Summary, Target};
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};

// === a fake agent ===

/// How the fake agent answers.
#[derive(Clone, Copy)]
struct Behaviour {
    /// Sleep this long before each getHost answer.
    delay: Duration,
    /// After this many getHosts, stall once for `stall`.
    stall_after: u64,
    stall: Duration,
}

/// One UDP thread answering getHost (and register; reports are ignored)
/// with a fixed host, a heartbeat thread beating every 100 ms.
struct FakeAgent {
    heartbeat: PathBuf,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

const HOST: NodeAddr = NodeAddr::new(Ipv4Addr::new(10, 0, 0, 1), 80);

impl FakeAgent {
    fn start(dir: &Path, b: Behaviour) -> FakeAgent {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let heartbeat = dir.join("heartbeat");
        let info = AgentInfo {
            shards: 1,
            base_port: socket.local_addr().unwrap().port(),
            bind: Ipv4Addr::LOCALHOST,
            pid: std::process::id(),
            snapshot_path: dir.join("no-routes"),
        };
        let writer = HeartbeatWriter::create(&heartbeat, &info).unwrap();
        writer.beat(clock::unix_ms());
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let beat = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    writer.beat(clock::unix_ms());
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let serve = {
            let (stop, answered) = (stop.clone(), answered.clone());
            std::thread::spawn(move || serve(&socket, b, &stop, &answered))
        };
        FakeAgent {
            heartbeat,
            stop,
            answered,
            threads: vec![beat, serve],
        }
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

fn serve(socket: &UdpSocket, b: Behaviour, stop: &AtomicBool, answered: &AtomicU64) {
    let mut enc = Encoder::new();
    let mut buf = [0u8; 2048];
    let mut stalled = false;
    // Delayed answers go through a delay line: each leaves `delay` after
    // its request came in, however many are waiting (the agent's service
    // time, not its capacity).
    let (line_tx, line_rx) = std::sync::mpsc::channel::<(Instant, SocketAddr, Vec<u8>)>();
    let sender = socket.try_clone().unwrap();
    let line = std::thread::spawn(move || {
        let _ = nix::sys::prctl::set_timerslack(1);
        for (due, peer, bytes) in line_rx {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let _ = sender.send_to(&bytes, peer);
        }
    });
    while !stop.load(Ordering::Relaxed) {
        let Ok((n, peer)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let came = Instant::now();
        let reply: Option<Vec<u8>> = match decode(&buf[..n], &Limits::UDP) {
            Ok(Message::GetHostReq(r)) => {
                let m = ModuleId::new(r.modid(), r.cmdid());
                let seq = r.seq();
                let k = answered.fetch_add(1, Ordering::Relaxed) + 1;
                if !stalled && k == b.stall_after {
                    stalled = true;
                    std::thread::sleep(b.stall);
                }
                Some(
                    enc.get_host_resp(seq, m, RetCode::Ok, Some(HOST), None)
                        .to_vec(),
                )
            }
            Ok(Message::RegisterReq(r)) => {
                let m = ModuleId::new(r.modid(), r.cmdid());
                Some(enc.register_resp(r.seq(), m, RetCode::Ok, 1).to_vec())
            }
            _ => None,
        };
        match reply {
            Some(bytes) if !b.delay.is_zero() => {
                let _ = line_tx.send((came + b.delay, peer, bytes));
            }
            Some(bytes) => {
                let _ = socket.send_to(&bytes, peer);
            }
            None => {}
        }
    }
    drop(line_tx);
    line.join().unwrap();
}

/// A fake agent answering at once: a target whose heartbeat (every
/// 100 ms) survives a machine too busy for the floor's (every second,
/// stale after 2 s).
fn prompt_agent(dir: &Path) -> FakeAgent {
    FakeAgent::start(
        dir,
        Behaviour {
            delay: Duration::ZERO,
            stall_after: u64::MAX,
            stall: Duration::ZERO,
        },
    )
}

// === runs ===

fn open_opts(target: Target, rate: &str, threads: u32, duration: Duration) -> QpsOptions {
    QpsOptions {
        target,
        threads,
        duration,
        // Generous: a call timed out by a stalled machine would be an
        // error, not a latency.
        timeout: Duration::from_secs(5),
        json: true,
        report: false,
        open: Some(OpenLoop {
            plan: rate.parse().unwrap(),
            arrivals: Default::default(),
            rounds: 1,
            plot: None,
        }),
        ..QpsOptions::default()
    }
}

fn run(opts: &QpsOptions) -> (OpenReport, serde_json::Value) {
    let mut out = Vec::new();
    let report = run_open(opts, &mut out).expect("the open-loop run completes");
    let text = String::from_utf8(out).unwrap();
    let json = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    (report, json)
}

fn only_round(r: &OpenReport) -> &Summary {
    assert_eq!(r.steps.len(), 1);
    &r.steps[0].rounds[0]
}

// === the tests ===

#[test]
fn a_stall_of_the_agent_shows_in_the_corrected_p99_and_not_in_the_service_time() {
    let dir = tempfile::tempdir().unwrap();
    // 2000/s for 2 s: the 1000th getHost (about 0.5 s in) stalls the agent
    // 200 ms. The 400 requests due meanwhile wait: 10% of the run, late by
    // 0 to 200 ms, so the corrected p99 is about 180 ms. Only the 4
    // requests in flight (one per thread) see the stall as service time:
    // 0.1% of the run, below its p99.
    let agent = FakeAgent::start(
        dir.path(),
        Behaviour {
            delay: Duration::ZERO,
            stall_after: 1_000,
            stall: Duration::from_millis(200),
        },
    );
    let opts = open_opts(
        Target::Heartbeat(agent.heartbeat.clone()),
        "2000",
        4,
        Duration::from_secs(2),
    );
    let (report, json) = run(&opts);
    let answered = agent.answered.load(Ordering::Relaxed);
    agent.stop();
    let s = only_round(&report);
    let o = s.open_loop.as_ref().expect("open-loop figures");
    assert!(answered > 1_000, "the agent stalled once: {s}");
    assert_eq!((s.error_total, s.static_route_answers), (0, 0), "{s}");
    assert!(o.rate_kept && report.valid, "{s}");
    let corrected = s.latency_us.expect("latency").p99;
    let service = o.service_us.expect("service time").p99;
    assert!(corrected >= 100_000.0, "corrected p99 {corrected} µs: {s}");
    assert!(service <= 50_000.0, "service p99 {service} µs: {s}");
    assert!(s.latency_us.unwrap().max >= 150_000.0, "{s}");
    let round = &json["steps"][0]["rounds"][0];
    assert_eq!(round["open_loop"]["rate_kept"], true);
    assert!(round["latency_us"]["p99"].as_f64().unwrap() >= 100_000.0);
    assert!(round["open_loop"]["service_us"]["p99"].as_f64().unwrap() <= 50_000.0);
}

#[test]
fn the_interval_log_parses_back_and_its_counts_sum_to_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("run.hlog");
    let hgrm = dir.path().join("run.hgrm");
    let agent = prompt_agent(dir.path());
    let opts = QpsOptions {
        warmup: Duration::from_secs(1),
        hist_log: Some(log.clone()),
        percentiles: Some(hgrm.clone()),
        ..open_opts(
            Target::Heartbeat(agent.heartbeat.clone()),
            "1000",
            4,
            Duration::from_secs(2),
        )
    };
    let (report, _) = run(&opts);
    agent.stop();
    let s = only_round(&report);
    assert!(s.get_hosts > 0, "{s}");
    let (intervals, total) = read_hist_log(&log);
    // One a second of the 2 s window, and one for the answers that came
    // after its last second, if any: 2 or 3; a tick that a very busy
    // machine delays past the next second's covers both (at a load
    // average of 25 one run had fewer).
    assert!((1..=4).contains(&intervals), "{intervals} intervals");
    assert_eq!(total.len(), s.get_hosts, "{s}");
    let p99 = s.latency_us.unwrap().p99;
    let logged = total.value_at_quantile(0.99) as f64 / 1_000.0;
    assert!((logged / p99 - 1.0).abs() < 0.01, "{logged} vs {p99}");
    let text = std::fs::read_to_string(&hgrm).unwrap();
    assert!(
        text.contains(&format!("Total count    = {:>12}]", s.get_hosts)),
        "{text}"
    );
}

/// The intervals of the log at `path`, read with the `hdrhistogram`
/// crate, and their sum; every interval starts after the 1 s warm-up.
fn read_hist_log(path: &Path) -> (usize, Histogram<u64>) {
    let bytes = std::fs::read(path).unwrap();
    let mut deser = Deserializer::new();
    let mut total: Histogram<u64> = Histogram::new(3).unwrap();
    let mut intervals = 0;
    for entry in IntervalLogIterator::new(&bytes) {
        match entry.expect("every line parses") {
            LogEntry::Interval(i) => {
                intervals += 1;
                // Measured windows only: they start after the warm-up.
                assert!(i.start_timestamp() >= Duration::from_millis(990), "{i:?}");
                let raw = STANDARD.decode(i.encoded_histogram()).unwrap();
                let h: Histogram<u64> = deser.deserialize(&mut raw.as_slice()).unwrap();
                total.add(&h).unwrap();
            }
            LogEntry::StartTime(_) | LogEntry::BaseTime(_) => {}
        }
    }
    (intervals, total)
}

#[test]
fn the_closed_loop_writes_its_warm_up_free_interval_log_and_spectrum_too() {
    let dir = tempfile::tempdir().unwrap();
    let (log, hgrm) = (
        dir.path().join("closed.hlog"),
        dir.path().join("closed.hgrm"),
    );
    let agent = prompt_agent(dir.path());
    let opts = QpsOptions {
        threads: 2,
        duration: Duration::from_secs(2),
        timeout: Duration::from_secs(5),
        warmup: Duration::from_secs(1),
        hist_log: Some(log.clone()),
        percentiles: Some(hgrm.clone()),
        target: Target::Heartbeat(agent.heartbeat.clone()),
        ..QpsOptions::default()
    };
    let mut out = Vec::new();
    let s = lbagent::qpstest::run(&opts, &mut out).unwrap();
    agent.stop();
    let text = String::from_utf8(out).unwrap();
    assert!(s.get_hosts > 0, "{text}");
    // The warm-up's second is in the live lines, not in the summary (whose
    // window starts at the tick ending the warm-up: late on a busy machine).
    assert!((0.5..10.0).contains(&s.seconds), "{text}");
    let lines = text.lines().filter(|l| l.contains("getHost/s")).count();
    assert!(lines >= 3, "{text}");
    let (intervals, total) = read_hist_log(&log);
    assert!((1..=4).contains(&intervals), "{intervals} intervals");
    assert_eq!(total.len(), s.get_hosts, "{text}");
    let spectrum = std::fs::read_to_string(&hgrm).unwrap();
    assert!(
        spectrum.contains(&format!("Total count    = {:>12}]", s.get_hosts)),
        "{spectrum}"
    );
}

#[test]
fn a_rate_the_generator_cannot_keep_is_reported_not_kept_and_invalid() {
    // One synchronous thread cannot send 2 million getHosts a second on
    // any machine: each waits for its answer (tens of µs on loopback).
    // The backlog is given up a second after its due time.
    let dir = tempfile::tempdir().unwrap();
    let agent = prompt_agent(dir.path());
    let opts = QpsOptions {
        timeout: Duration::from_secs(1),
        ..open_opts(
            Target::Heartbeat(agent.heartbeat.clone()),
            "2m",
            1,
            Duration::from_secs(1),
        )
    };
    let (report, json) = run(&opts);
    agent.stop();
    let s = only_round(&report);
    let o = s.open_loop.as_ref().unwrap();
    assert!(!o.rate_kept && !report.valid, "{s}");
    assert!(o.sent < o.scheduled / 2, "{s}");
    assert_eq!(s.errors["not_sent"], o.not_sent, "{s}");
    let why = o.invalid.as_deref().expect("a reason");
    assert!(why.contains("did not keep the offered rate"), "{why}");
    assert!(s.to_string().contains("INVALID:"), "{s}");
    assert_eq!(json["valid"], false);
    assert_eq!(
        json["steps"][0]["rounds"][0]["open_loop"]["rate_kept"],
        false
    );
    assert!(json["steps"][0]["rounds"][0]["open_loop"]["invalid"].is_string());
    assert!(report.to_string().contains("NOT KEPT"), "{report}");
}

#[test]
fn compare_calls_identical_runs_equal_and_a_20_percent_slower_agent_slower() {
    // Service time 100 ms against 120 ms, at 50 requests a second: the
    // latency is the service time, and what a busy machine adds to a
    // round's median (a few ms) stays well under the 20 ms between the
    // agents. Rounds of 0.5 s, A and B in turn, so that the machine's
    // load drifts alike for both; "identical runs" are A's rounds of the
    // even turns against its rounds of the odd ones (run as A, A again,
    // B, the second A's tails came out worse than the first's in most
    // turns at a load average of 26). The noise test leaves out the
    // lowest and highest fifth of the rounds a side (at a load average of
    // 15, a stall spoiled a round's median in one of five).
    let dir = tempfile::tempdir().unwrap();
    let (da, db) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let at = |d: Duration, dir: &Path| {
        FakeAgent::start(
            dir,
            Behaviour {
                delay: d,
                stall_after: u64::MAX,
                stall: Duration::ZERO,
            },
        )
    };
    let a = at(Duration::from_millis(100), &da);
    let b = at(Duration::from_millis(120), &db);
    let opts = |hb: &Path| {
        open_opts(
            Target::Heartbeat(hb.to_path_buf()),
            "50",
            16,
            Duration::from_millis(500),
        )
    };
    let (mut ra, mut ra2, mut rb) = (Vec::new(), Vec::new(), Vec::new());
    for turn in 0..20 {
        let r = run(&opts(&a.heartbeat)).1;
        if turn % 2 == 0 {
            ra.push(r);
        } else {
            ra2.push(r);
        }
        rb.push(run(&opts(&b.heartbeat)).1);
    }
    a.stop();
    b.stop();
    let pooled = |runs: &[serde_json::Value]| {
        let mut first = runs[0].clone();
        first["steps"][0]["rounds"] = runs
            .iter()
            .map(|r| r["steps"][0]["rounds"][0].clone())
            .collect();
        first
    };
    let (a, a2, b) = (pooled(&ra), pooled(&ra2), pooled(&rb));
    let same = compare(&a, &a2).unwrap();
    let slower = compare(&a, &b).unwrap();
    eprintln!("A against A:\n{same}\nA against B:\n{slower}");
    assert_eq!(same.verdict, Verdict::Same, "{same}");
    assert_eq!(slower.verdict, Verdict::Slower, "{slower}");
    let p50 = &slower.steps[0].lines[1];
    assert_eq!(p50.verdict, Verdict::Slower, "{slower}");
    assert!(p50.ratio.unwrap() > 1.1, "{slower}");

    // The same through the command line: exit 5 when B is slower, 0 when not.
    let (fa, fb) = (dir.path().join("a.json"), dir.path().join("b.json"));
    std::fs::write(&fa, a.to_string()).unwrap();
    std::fs::write(&fb, b.to_string()).unwrap();
    let cli = |x: &Path, y: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lbagent"))
            .args(["qpstest", "compare"])
            .arg(x)
            .arg(y)
            .output()
            .unwrap()
    };
    let out = cli(&fa, &fb);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(5), "{text}");
    assert!(text.contains("B is SLOWER"), "{text}");
    assert_eq!(cli(&fb, &fa).status.code(), Some(0));
    let bad = cli(&fa, &dir.path().join("missing.json"));
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("missing.json"));
}

#[test]
fn a_sweep_prints_a_row_per_step_and_draws_its_curves() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("sweep.png");
    let agent = prompt_agent(dir.path());
    let mut opts = open_opts(
        Target::Heartbeat(agent.heartbeat.clone()),
        "500,1000",
        2,
        Duration::from_secs(1),
    );
    opts.json = false;
    opts.open.as_mut().unwrap().plot = Some(png.clone());
    let mut out = Vec::new();
    let report = run_open(&opts, &mut out).unwrap();
    agent.stop();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(report.steps.len(), 2, "{text}");
    assert!(report.knee.is_some(), "{text}");
    assert!(
        text.contains("offered/s") && text.contains("answered/s"),
        "{text}"
    );
    for rate in ["500", "1000"] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(rate)),
            "{rate}: {text}"
        );
    }
    let bytes = std::fs::read(&png).expect("the plot is written");
    assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
    assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
}

#[test]
fn every_transport_and_mode_runs_open_loop() {
    let short = |target| QpsOptions {
        report: true,
        ..open_opts(target, "200", 4, Duration::from_secs(1))
    };
    // Shared memory, getHost + report, each host held 1 ms.
    let (r, _) = run(&QpsOptions {
        transport: lbagent::qpstest::Transport::Shm,
        hold: Duration::from_millis(1),
        ..short(Target::Standalone)
    });
    let s = only_round(&r);
    assert_eq!(r.transport, "shm");
    assert!(s.from_agent > 0 && s.reports > 0, "{s}");
    assert!(s.errors.keys().all(|k| k == "not_sent"), "{s}");
    // The route cache.
    let (r, _) = run(&QpsOptions {
        cache: true,
        ..short(Target::Standalone)
    });
    let s = only_round(&r);
    assert!(s.from_cache > 0 && s.reports > 0, "{s}");
    assert!(s.errors.keys().all(|k| k == "not_sent"), "{s}");
    // A priority mix, counted per class.
    let dir = tempfile::tempdir().unwrap();
    let agent = prompt_agent(dir.path());
    let (r, _) = run(&QpsOptions {
        priority_mix: Some("5:0.5,60:0.5".parse().unwrap()),
        ..short(Target::Heartbeat(agent.heartbeat.clone()))
    });
    agent.stop();
    let s = only_round(&r);
    assert_eq!(s.priority_classes.len(), 2, "{s}");
    assert!(s.priority_classes.iter().all(|c| c.answered > 0), "{s}");
    let calls: u64 = s.priority_classes.iter().map(|c| c.calls).sum();
    assert_eq!(calls, s.open_loop.as_ref().unwrap().sent, "{s}");
}
