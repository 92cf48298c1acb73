//! `perf/scale [OPTIONS]` (an example: `cargo build --release --example
//! scale`, then `target/release/examples/scale`): what the agent
//! costs as the table grows. For each table of MODULES x NODES (default
//! 1x10, 1000x10, 100000x10 and 1000x1000) it measures, in one process:
//!
//! 1. **restart**: a snapshot of the whole table is written, and an agent
//!    is started from it (no route server reachable, so the snapshot is all
//!    it has): milliseconds from `Agent::start` to the first getHost a
//!    client gets answered by the agent (not by the static route file);
//! 2. **bytes per node**: the agent's live heap (a counting global
//!    allocator) once it stopped growing after the start, less that of an agent started from an
//!    empty snapshot in the same run, over the table's nodes; the RSS
//!    growth beside it (what the kernel sees, allocator slack and all);
//! 3. **idle shard CPU**: the shard threads' CPU over a few seconds with no
//!    request, as a share of one core;
//! 4. **getHost per agent CPU-second**: qpstest (30 threads, getHost and a
//!    report each) spread over every module of the table (at most
//!    qpstest's 100k), against the agent's shard and control threads' CPU;
//!    the ratio to the 1-module table of the same run is the figure that
//!    says whether a large table slows the request path;
//! 5. **update_route per node**: a route change of the table's module size
//!    (10% of the nodes leave, 10% arrive), median over rounds, ns per node;
//! 6. **route change → push**: the whole system (`Standalone`: route server,
//!    reporter, agent; default settings) on a store holding the table, the
//!    agent restarted from its snapshot and subscribed (the first and the
//!    last module's routes came through, so the start's pulls are
//!    answered); a node is added to one module through the store, and the
//!    time from the commit to the agent's getRoute showing it is taken,
//!    median of a few changes.
//!
//! Prints progress on stderr and, at the end, a Markdown table on stdout
//! (paste it into the README's "Scale" section). Options:
//! `--tables 1x10,1000x10` (the tables), `--qps-seconds S` (5),
//! `--changes N` (5 route changes per table), `--no-push` (skip 6, which
//! needs a store import of the table), `--only-memory` (1, 2 and 5 only:
//! what a branch that predates some API can still measure).

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lbagent::agent::runtime::Agent;
use lbagent::client::{Client, ClientOptions, HostSource};
use lbagent::config::Config;
use lbagent::host::snapshot::{self, SnapshotRoute};
use lbagent::lb::{LbParams, ModuleLb};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::qpstest::{self, cpu, QpsOptions, Target};
use lbagent::standalone::{Standalone, StandaloneOptions, SNAPSHOT_FILE, STORE_FILE};
use lbagent::store::{self, StoreUrl};

// === a counting allocator: the live heap, exactly ===

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; only the
// byte count beside it is ours.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live_bytes() -> i64 {
    LIVE.load(Ordering::Relaxed) as i64
}

fn rss_bytes() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: i64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as i64
}

// === the tables ===

#[derive(Clone, Copy, Debug)]
struct Table {
    modules: u32,
    nodes: u32,
}

impl Table {
    fn total(self) -> u64 {
        u64::from(self.modules) * u64::from(self.nodes)
    }
    fn name(self) -> String {
        format!("{} x {}", self.modules, self.nodes)
    }
}

const FIRST: ModuleId = ModuleId::new(500_000, 1);

fn module(k: u32) -> ModuleId {
    ModuleId::new(FIRST.modid + k, FIRST.cmdid)
}

/// Node `i` of module `k`: addresses spread over 10.0.0.0/8, port 9000.
fn node(t: Table, k: u32, i: u32) -> RouteNode {
    let n = (u64::from(k) * u64::from(t.nodes) + u64::from(i)) % (1 << 24);
    RouteNode {
        addr: NodeAddr {
            ip: 0x0a00_0000 + n as u32,
            port: 9000,
        },
        weight: 1,
    }
}

fn routes(t: Table, version: u64) -> Vec<SnapshotRoute> {
    (0..t.modules)
        .map(|k| SnapshotRoute {
            module: module(k),
            version,
            nodes: (0..t.nodes).map(|i| node(t, k, i)).collect(),
            meta: Vec::new(),
        })
        .collect()
}

// === one row ===

#[derive(Default)]
struct Row {
    table: Option<Table>,
    restart_ms: f64,
    heap_per_node: Option<f64>,
    rss_per_node: Option<f64>,
    idle_shard_cpu: Option<f64>,
    per_cpu: Option<f64>,
    qps_modules: u32,
    update_ns_per_node: f64,
    push_ms: Option<(f64, f64, f64)>,
}

struct Opts {
    tables: Vec<Table>,
    qps_seconds: u64,
    changes: u32,
    push: bool,
    only_memory: bool,
}

fn parse_args() -> anyhow::Result<Opts> {
    let mut o = Opts {
        tables: vec![
            Table {
                modules: 1,
                nodes: 10,
            },
            Table {
                modules: 1_000,
                nodes: 10,
            },
            Table {
                modules: 100_000,
                nodes: 10,
            },
            Table {
                modules: 1_000,
                nodes: 1_000,
            },
        ],
        qps_seconds: 5,
        changes: 5,
        push: true,
        only_memory: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().with_context(|| format!("{what} needs a value"));
        match a.as_str() {
            "--tables" => {
                o.tables = value("--tables")?
                    .split(',')
                    .map(|t| {
                        let (m, n) = t.split_once('x').context("a table is MODULESxNODES")?;
                        Ok(Table {
                            modules: m.parse().context("MODULES")?,
                            nodes: n.parse().context("NODES")?,
                        })
                    })
                    .collect::<anyhow::Result<_>>()?
            }
            "--qps-seconds" => o.qps_seconds = value("--qps-seconds")?.parse()?,
            "--changes" => o.changes = value("--changes")?.parse()?,
            "--no-push" => o.push = false,
            "--only-memory" => o.only_memory = true,
            other => bail!("unknown argument {other} (see perf/scale.rs)"),
        }
    }
    if o.tables.iter().any(|t| t.modules == 0 || t.nodes == 0) {
        bail!("a table needs at least one module of one node");
    }
    Ok(o)
}

fn agent_config(dir: &Path) -> Config {
    let mut c = Config::default();
    let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    c.agent.base_port = 0;
    c.agent.metrics_addr = any;
    c.agent.heartbeat_path = dir.join("heartbeat");
    c.agent.snapshot_path = dir.join(SNAPSHOT_FILE);
    // Nothing listens there: the snapshot is all the agent has.
    c.agent.route_servers = vec!["127.0.0.1:9".into()];
    c.agent.reporters = vec!["127.0.0.1:9".into()];
    c
}

fn client(heartbeat: &Path) -> anyhow::Result<Client> {
    Ok(Client::with_options(ClientOptions {
        heartbeat_path: heartbeat.to_path_buf(),
        // Until the agent beats, an error: not the static route file (a
        // read of the whole snapshot per call, which would both answer
        // for the agent and slow it down).
        static_fallback: false,
        ..ClientOptions::default()
    })?)
}

/// Starts an agent from the snapshot in `dir` and waits for the first
/// getHost of `m` answered by it: (the agent, milliseconds).
fn restart(dir: &Path, m: Option<ModuleId>) -> anyhow::Result<(Agent, f64)> {
    let config = agent_config(dir);
    let t0 = Instant::now();
    let agent = Agent::start(&config)?;
    let Some(m) = m else {
        return Ok((agent, 0.0));
    };
    let mut c = client(&config.agent.heartbeat_path)?;
    loop {
        if let Ok(h) = c.get_host(m.modid, m.cmdid, Duration::from_millis(200)) {
            if h.source == HostSource::Agent {
                return Ok((agent, t0.elapsed().as_secs_f64() * 1e3));
            }
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("the agent answered no getHost for {m} within 60 s of its start");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The heap and RSS an agent adds over what this process holds, measured
/// after it settled.
fn agent_footprint(dir: &Path, m: Option<ModuleId>) -> anyhow::Result<(Agent, f64, i64, i64)> {
    let (heap0, rss0) = (live_bytes(), rss_bytes());
    let (agent, ms) = restart(dir, m)?;
    // A restarted shard makes the snapshot's modules in slices after it
    // starts serving: wait until the heap stops growing (two readings
    // 500 ms apart within 0.1%, at least 2 s after the start, at most 60 s).
    let t0 = Instant::now();
    let mut last = live_bytes();
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = live_bytes();
        let steady = (now - last).abs() * 1000 <= (now - heap0).abs().max(1);
        if (steady && t0.elapsed() >= Duration::from_secs(2))
            || t0.elapsed() > Duration::from_secs(60)
        {
            break;
        }
        last = now;
    }
    Ok((agent, ms, live_bytes() - heap0, rss_bytes() - rss0))
}

fn shard_cpu() -> f64 {
    cpu::named_threads_cpu_seconds(std::process::id(), |c| c.starts_with("lbagent-shard-"))
        .map_or(0.0, |(s, _)| s)
}

fn update_route_ns_per_node(n: u32) -> f64 {
    let p = LbParams::default();
    let node = |i: u32| RouteNode {
        addr: NodeAddr {
            ip: 0x0a00_0000 + i * 3,
            port: 9000,
        },
        weight: 1,
    };
    let shift = (n / 10).max(1);
    let a: Vec<RouteNode> = (0..n).map(node).collect();
    let b: Vec<RouteNode> = (shift..n + shift).map(node).collect();
    let mut m = ModuleLb::new(&a, 1, 0, &p);
    let iters = (200_000 / n).max(3);
    let mut rounds = Vec::new();
    for _ in 0..7 {
        let t0 = Instant::now();
        for v in 0..iters {
            let route = if v % 2 == 0 { &b } else { &a };
            m.update_route(std::hint::black_box(route), u64::from(v), 0, &p);
        }
        rounds.push(t0.elapsed().as_nanos() as f64 / f64::from(iters) / f64::from(n));
    }
    median(&mut rounds)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The agent-alone part of a row: restart, memory, idle CPU, getHost.
fn agent_part(o: &Opts, t: Table, empty: (i64, i64), row: &mut Row) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    eprintln!("[{}] writing the snapshot", t.name());
    snapshot::write(&dir.path().join(SNAPSHOT_FILE), 0, &routes(t, 1))?;
    eprintln!("[{}] restarting an agent from it", t.name());
    let (agent, ms, heap, rss) = agent_footprint(dir.path(), Some(module(t.modules - 1)))?;
    row.restart_ms = ms;
    row.heap_per_node = Some((heap - empty.0) as f64 / t.total() as f64);
    row.rss_per_node = Some((rss - empty.1) as f64 / t.total() as f64);
    eprintln!(
        "[{}] first getHost after {ms:.1} ms; {:.1} B/node heap, {:.1} B/node RSS",
        t.name(),
        row.heap_per_node.unwrap_or(0.0),
        row.rss_per_node.unwrap_or(0.0)
    );
    if !o.only_memory {
        let (c0, w0) = (shard_cpu(), Instant::now());
        std::thread::sleep(Duration::from_secs(3));
        row.idle_shard_cpu = Some((shard_cpu() - c0) / w0.elapsed().as_secs_f64());
        let modules = t.modules.min(qpstest::MAX_MODULES);
        row.qps_modules = modules;
        let opts = QpsOptions {
            target: Target::Heartbeat(agent_config(dir.path()).agent.heartbeat_path),
            threads: 30,
            duration: Duration::from_secs(o.qps_seconds),
            modules,
            first_module: FIRST,
            json: true,
            ..QpsOptions::default()
        };
        eprintln!("[{}] qpstest over {modules} modules", t.name());
        let s = qpstest::run(&opts, &mut std::io::sink())?;
        row.per_cpu = s.get_hosts_per_server_cpu_second;
        eprintln!(
            "[{}] {} getHosts, {:?} per agent CPU-second, {} errors",
            t.name(),
            s.get_hosts,
            s.get_hosts_per_server_cpu_second,
            s.error_total
        );
    }
    agent.stop()?;
    Ok(())
}

/// Route change → push through the whole system at default settings.
fn push_part(o: &Opts, t: Table, row: &mut Row) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let url = StoreUrl::Sqlite(dir.path().join(STORE_FILE));
    let mut st = store::open(&url)?;
    eprintln!("[{}] importing the table into SQLite", t.name());
    let rows: Vec<(ModuleId, RouteNode)> = (0..t.modules)
        .flat_map(|k| (0..t.nodes).map(move |i| (module(k), node(t, k, i))))
        .collect();
    st.import_routes(&rows, true)?;
    drop(rows);
    let version = st.route_version()?;
    // The agent restarts from a snapshot of version 0: the pull answer
    // (the store's version) then shows the subscription is in place.
    snapshot::write(&dir.path().join(SNAPSHOT_FILE), 0, &routes(t, 0))?;
    eprintln!("[{}] starting route server, reporter and agent", t.name());
    let sys = Standalone::start(StandaloneOptions::ephemeral(dir.path()))?;
    let m = module(0);
    let mut c = client(sys.heartbeat_path())?;
    let t0 = Instant::now();
    // The agent pulls every module of its snapshot at start, in module
    // order: once the first and the last show the store's version, the
    // whole table has come through, and what follows measures a change
    // alone, not a change queued behind the start's 100,000 answers.
    for m in [m, module(t.modules - 1)] {
        loop {
            match c.get_route(m.modid, m.cmdid, Duration::from_millis(500)) {
                Ok(r) if r.version >= version => break,
                _ if t0.elapsed() > Duration::from_secs(120) => {
                    bail!("the agent did not get {m}'s route from the route server in 120 s")
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    eprintln!(
        "[{}] subscribed to every module in {:.0} ms",
        t.name(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    let mut lat = Vec::new();
    for j in 0..o.changes {
        let want = (t.nodes + j + 1) as usize;
        let extra = RouteNode {
            addr: NodeAddr {
                ip: 0x0b00_0000 + j,
                port: 9000,
            },
            weight: 1,
        };
        st.add_node(m, extra)?;
        let t0 = Instant::now();
        loop {
            if c.get_route(m.modid, m.cmdid, Duration::from_millis(500))
                .is_ok_and(|r| r.nodes.len() >= want)
            {
                break;
            }
            if t0.elapsed() > Duration::from_secs(60) {
                bail!("change {j}: the agent did not see it within 60 s");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        lat.push(t0.elapsed().as_secs_f64() * 1e3);
        eprintln!("[{}] change {j}: {:.1} ms", t.name(), lat[lat.len() - 1]);
    }
    let (min, max) = (
        lat.iter().copied().fold(f64::MAX, f64::min),
        lat.iter().copied().fold(0.0, f64::max),
    );
    row.push_ms = Some((median(&mut lat), min, max));
    sys.stop()?;
    Ok(())
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |v| format!("{v:.digits$}"))
}

fn main() -> anyhow::Result<()> {
    let o = parse_args()?;
    let started = Instant::now();
    // The empty agent: what every table's figure is taken against.
    let empty = {
        let dir = tempfile::tempdir()?;
        let (agent, _, heap, rss) = agent_footprint(dir.path(), None)?;
        agent.stop()?;
        (heap, rss)
    };
    eprintln!("empty agent: {} B heap, {} B RSS", empty.0, empty.1);
    let mut rows = Vec::new();
    for &t in &o.tables {
        let mut row = Row {
            table: Some(t),
            ..Row::default()
        };
        agent_part(&o, t, empty, &mut row)?;
        row.update_ns_per_node = update_route_ns_per_node(t.nodes);
        eprintln!(
            "[{}] update_route: {:.1} ns per node",
            t.name(),
            row.update_ns_per_node
        );
        if o.push && !o.only_memory {
            push_part(&o, t, &mut row)?;
        }
        rows.push(row);
    }
    let base = rows.first().and_then(|r| r.per_cpu);
    println!(
        "| modules x nodes | agent heap B/node | RSS B/node | restart: first getHost, ms | idle shard CPU | getHost per agent CPU-s | vs first table | update_route ns/node | change → push, ms (median, min–max) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let t = r.table.expect("set");
        let over = if r.qps_modules != 0 && r.qps_modules != t.modules {
            format!(" (over {} modules)", r.qps_modules)
        } else {
            String::new()
        };
        println!(
            "| {} | {} | {} | {:.0} | {} | {}{over} | {} | {:.1} | {} |",
            t.name(),
            fmt(r.heap_per_node, 0),
            fmt(r.rss_per_node, 0),
            r.restart_ms,
            r.idle_shard_cpu
                .map_or("—".into(), |c| format!("{:.2}%", 100.0 * c)),
            fmt(r.per_cpu, 0),
            fmt(r.per_cpu.zip(base).map(|(a, b)| a / b), 2),
            r.update_ns_per_node,
            r.push_ms
                .map_or("—".into(), |(m, a, b)| format!("{m:.0} ({a:.0}–{b:.0})")),
        );
    }
    eprintln!(
        "perf/scale: done in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
