//! getHost throughput of one agent shard against the floor, same load
//! generator, same run.
//!
//! The floor ([`lbagent::floor`]) is a bare recvmmsg/sendmmsg loop on one
//! thread pinned to core 0 that answers every getHost with a fixed host: it
//! verifies and decodes the request (to echo its sequence number) and
//! encodes the answer, as any server of this wire format must, but does no
//! LB work and holds no maps.
//! The agent runs in-process with one shard (pinned to core 0) and the
//! control core, serving a 10-node module loaded from a snapshot.
//!
//! The load: T synchronous client threads, each with its own socket, each
//! looping getHost → wait for the answer. Only answers with a host count.
//! Server CPU is read from /proc for the serving thread, so the figure that
//! matters is getHosts per server CPU-second (the load generator shares this
//! machine's cores).
//!
//! Run: `cargo bench --bench agent_vs_floor -- [THREADS] [SECONDS] [ROUNDS]`
//! (defaults 30, 3, 3).

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lbagent::agent::runtime::Agent;
use lbagent::config::Config;
use lbagent::floor::{Floor, FloorOptions};
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::qpstest::cpu::named_threads_cpu_seconds;
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};

const M: ModuleId = ModuleId::new(7, 1);

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let threads: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(30);
    let secs: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let dur = Duration::from_secs(secs);
    println!("getHost, {threads} client threads, {secs} s per run, {rounds} rounds (floor and agent alternate)");
    let mut floor_runs = Vec::new();
    let mut agent_runs = Vec::new();
    for round in 0..rounds {
        let f = run_floor(threads, dur);
        println!("round {round} floor: {f}");
        floor_runs.push(f);
        let a = run_agent(threads, dur);
        println!("round {round} agent: {a}");
        agent_runs.push(a);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let mut fq: Vec<f64> = floor_runs.iter().map(|r| r.qps()).collect();
    let mut aq: Vec<f64> = agent_runs.iter().map(|r| r.qps()).collect();
    let mut fc: Vec<f64> = floor_runs.iter().map(|r| r.per_cpu_s()).collect();
    let mut ac: Vec<f64> = agent_runs.iter().map(|r| r.per_cpu_s()).collect();
    let ratios: Vec<f64> = agent_runs
        .iter()
        .zip(&floor_runs)
        .map(|(a, f)| a.per_cpu_s() / f.per_cpu_s())
        .collect();
    let (fq, aq, fc, ac) = (med(&mut fq), med(&mut aq), med(&mut fc), med(&mut ac));
    println!("median floor: {fq:.0} getHost/s, {fc:.0} per server CPU-second");
    println!("median agent: {aq:.0} getHost/s, {ac:.0} per server CPU-second");
    println!(
        "agent/floor per server CPU-second: {:.2} (per round: {ratios:.2?}); wall QPS ratio {:.2}",
        ac / fc,
        aq / fq
    );
}

/// One measured run.
struct Run {
    ok: u64,
    errors: u64,
    secs: f64,
    server_cpu_s: f64,
}

impl Run {
    fn qps(&self) -> f64 {
        self.ok as f64 / self.secs
    }
    fn per_cpu_s(&self) -> f64 {
        self.ok as f64 / self.server_cpu_s.max(1e-9)
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0} getHost/s ({} ok, {} errors), server CPU {:.2} s, {:.0} per server CPU-second",
            self.qps(),
            self.ok,
            self.errors,
            self.server_cpu_s,
            self.per_cpu_s()
        )
    }
}

fn run_floor(threads: usize, dur: Duration) -> Run {
    let dir = tempfile::tempdir().expect("a temp dir");
    let floor =
        Floor::start(FloorOptions::new(dir.path().join("heartbeat"))).expect("floor starts");
    let run = load(floor.port(), threads, dur, || {
        floor.server_cpu_seconds().expect("the floor's CPU time")
    });
    floor.stop().expect("floor stops");
    run
}

fn run_agent(threads: usize, dur: Duration) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("routes.snapshot");
    let nodes: Vec<RouteNode> = (1..=10)
        .map(|i| RouteNode {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80),
            weight: 1,
        })
        .collect();
    snapshot::write(
        &snap,
        0,
        &[SnapshotRoute {
            module: M,
            version: 1,
            nodes,
            meta: Vec::new(),
        }],
    )
    .unwrap();
    let mut config = Config::default();
    config.agent.base_port = 0;
    config.agent.shards = 1;
    config.agent.route_servers = vec!["127.0.0.1:1".into()];
    config.agent.reporters = vec!["127.0.0.1:1".into()];
    config.agent.heartbeat_path = dir.path().join("heartbeat");
    config.agent.snapshot_path = snap;
    config.agent.metrics_addr = "127.0.0.1:0".parse().unwrap();
    let agent = Agent::start(&config).expect("agent starts");
    std::thread::sleep(Duration::from_millis(200));
    let run = load(agent.ports()[0], threads, dur, || {
        thread_cpu_s("lbagent-shard-0")
    });
    agent.stop().unwrap();
    run
}

/// Runs the load for `dur`; `cpu` reads the server thread's CPU seconds.
fn load(port: u16, threads: usize, dur: Duration, cpu: impl Fn() -> f64) -> Run {
    let to = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let go = Arc::new(AtomicBool::new(true));
    let cpu0 = cpu();
    let t0 = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (ok, errors, go) = (ok.clone(), errors.clone(), go.clone());
            std::thread::spawn(move || {
                let s = UdpSocket::bind("127.0.0.1:0").unwrap();
                s.connect(to).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                let mut enc = Encoder::new();
                let mut buf = [0u8; 2048];
                let (mut n_ok, mut n_err) = (0u64, 0u64);
                let mut seq = 0u32;
                while go.load(Ordering::Relaxed) {
                    seq = seq.wrapping_add(1);
                    let _ = s.send(enc.get_host_req(seq, M, 0, 0));
                    match s.recv(&mut buf) {
                        Ok(n) => match decode(&buf[..n], &Limits::UDP) {
                            Ok(Message::GetHostResp(r))
                                if r.seq() == seq && r.retcode() == RetCode::Ok =>
                            {
                                n_ok += 1
                            }
                            _ => n_err += 1,
                        },
                        Err(_) => n_err += 1,
                    }
                }
                ok.fetch_add(n_ok, Ordering::Relaxed);
                errors.fetch_add(n_err, Ordering::Relaxed);
            })
        })
        .collect();
    std::thread::sleep(dur);
    go.store(false, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let server_cpu_s = cpu() - cpu0;
    for h in handles {
        h.join().unwrap();
    }
    Run {
        ok: ok.load(Ordering::Relaxed),
        errors: errors.load(Ordering::Relaxed),
        secs,
        server_cpu_s,
    }
}

/// CPU seconds (user + system) of this process's threads named `name` (a
/// glommio executor's helper thread inherits its name: its work counts).
fn thread_cpu_s(name: &str) -> f64 {
    let (secs, n) = named_threads_cpu_seconds(std::process::id(), |c| c == name)
        .expect("/proc/self/task is readable");
    assert!(n > 0, "no thread named {name}");
    secs
}
