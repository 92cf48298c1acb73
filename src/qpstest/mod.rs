//! qpstest: the built-in load generator (`lbagent qpstest`).
//!
//! T synchronous threads (30 by default, as the original measurement of
//! seed 000), each with its own [`crate::client::Client`], each looping
//! getHost (and a report of success, unless told not to) on its module:
//! thread `i` uses module `i % modules` of a run of consecutive modules
//! (with more modules than threads, every `threads`-th one in turn).
//! A line is printed every second (getHost/s, errors, p50 / p99 latency,
//! server CPU), then a [`Summary`] with hdrhistogram percentiles of the
//! getHost round trips.
//!
//! The counting rule (see [`summary`]): only a getHost that returned a host
//! from the agent or its route cache counts toward QPS; static-route answers
//! and errors are counted apart, by kind, and always printed. The server's
//! CPU time is read from `/proc` when it can be (the floor's thread; the
//! agent's process, or its threads when it runs in this process), and the
//! summary gives getHosts per server CPU-second: on a small machine the
//! load generator competes with the server for the cores, and that figure
//! stays fair where wall QPS does not.
//!
//! # Layout
//!
//! - this file: [`QpsOptions`], [`Target`] and [`run`], the run itself.
//! - [`summary`]: counting and reporting, no sockets.
//! - [`cpu`]: CPU time of processes and threads from `/proc`.
//! - [`args`]: the command line ([`QpstestArgs`]) and [`command`].
//! - [`mix`]: `--priority-mix`, DAGOR priorities per getHost and the
//!   per-class counts.
//! - [`open`]: the open loop's thin shell (`--rate`): threads sending at
//!   the times of a schedule, latency from each intended send time.
//! - [`schedule`]: the intended send times (constant or Poisson), pure.
//! - [`sweep`]: `--rate` as a rate, a list or a range, and the knee, pure.
//! - [`open_figures`]: a step's open-loop figures: the rate kept or not,
//!   the service time, the spectrum; pure.
//! - [`report`]: an open-loop run's steps, rows and knee (text, JSON).
//! - [`hgrm`]: the percentile spectrum as HdrHistogram text (`.hgrm`).
//! - [`hlog`]: `--hist-log`, the HdrHistogram interval log.
//! - [`compare`]: `qpstest compare`, two runs and the noise test, pure.
//! - [`plot`]: `--plot` and `qpstest plot`, the PNGs.

pub mod args;
pub mod compare;
pub mod cpu;
pub mod hgrm;
pub mod hlog;
pub mod mix;
pub mod open;
pub mod open_figures;
pub mod plot;
pub mod report;
pub mod schedule;
pub mod summary;
pub mod sweep;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::client::{Client, ClientOptions, HostSource};
use crate::floor::{Floor, FloorOptions};
use crate::host::heartbeat::HeartbeatReader;
use crate::model::{ModuleId, NodeAddr, RouteNode};
use crate::standalone::{Standalone, StandaloneOptions};
use crate::store::{self, StoreUrl};

pub use args::{command, QpstestArgs};
pub use open::{run_open, OpenLoop};
pub use report::OpenReport;
pub use summary::{Answer, Latency, LiveLine, RunInfo, ServerCpu, Summary, Tally};

/// The first demo module (`--modid` / `--cmdid` defaults): `--modules N`
/// uses `(modid + k, cmdid)` for `k` in `0..N`, which spreads them over the
/// agent's shards (`(modid + cmdid) % shards`).
pub const DEMO_MODULE: ModuleId = ModuleId::new(10_000, 1);

/// Nodes per demo module in standalone mode.
pub const DEMO_NODES: u8 = 10;

/// What a run measures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The agent whose heartbeat file is at this path.
    Heartbeat(PathBuf),
    /// A floor started in this process for the run.
    Floor,
    /// An embedded route server, reporter and agent, started for the run
    /// with the demo modules.
    Standalone,
}

/// How a run is set up.
#[derive(Clone, Debug)]
pub struct QpsOptions {
    /// What to measure.
    pub target: Target,
    /// Client threads (at least 1).
    pub threads: u32,
    /// How long to measure.
    pub duration: Duration,
    /// Modules to spread the threads over (at least 1).
    pub modules: u32,
    /// The first module.
    pub first_module: ModuleId,
    /// Report a success after each getHost that returned a host.
    pub report: bool,
    /// How long each host is held before its report (a `balance` module's
    /// unit stays taken meanwhile); zero: reported at once.
    pub hold: Duration,
    /// Go through the client's route cache.
    pub cache: bool,
    /// The getHost timeout (registering waits at least 10 s).
    pub timeout: Duration,
    /// Print the summary as one JSON object (the live lines then go to
    /// stderr, so that `out` holds only the object).
    pub json: bool,
    /// getHosts carry DAGOR priorities drawn from this mix, and the
    /// summary counts each class apart (None: no priorities).
    pub priority_mix: Option<mix::PriorityMix>,
    /// How the clients talk to the agent.
    pub transport: Transport,
    /// With [`Target::Standalone`], the agent's shards (0: its default).
    pub shards: u32,
    /// Run this long before the measured window (each step's, in the open
    /// loop); nothing in it is counted.
    pub warmup: Duration,
    /// Write the latency as an HdrHistogram interval log (one histogram
    /// per second of the measured window).
    pub hist_log: Option<PathBuf>,
    /// Write the latency's percentile spectrum (`.hgrm`).
    pub percentiles: Option<PathBuf>,
    /// An open loop at fixed rates ([`open::run_open`]) instead of the
    /// closed loop (None, the default: [`run`]).
    pub open: Option<open::OpenLoop>,
}

/// How the clients talk to the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// UDP datagrams (the clients use neither shared memory nor the
    /// local socket).
    Udp,
    /// The agent's shared-memory regions (a standalone agent offers them;
    /// an agent given by its heartbeat must have `[shm] enabled`).
    Shm,
    /// The agent's local (Unix) socket, one connection per client thread
    /// and shard (the agent must serve it: `agent.local_socket`).
    Local,
}

impl Default for QpsOptions {
    fn default() -> Self {
        QpsOptions {
            target: Target::Heartbeat(ClientOptions::default().heartbeat_path),
            threads: 30,
            duration: Duration::from_secs(10),
            modules: 1,
            first_module: DEMO_MODULE,
            report: true,
            hold: Duration::ZERO,
            cache: false,
            timeout: Duration::from_millis(1000),
            json: false,
            priority_mix: None,
            transport: Transport::Udp,
            shards: 0,
            warmup: Duration::ZERO,
            hist_log: None,
            percentiles: None,
            open: None,
        }
    }
}

impl QpsOptions {
    /// Module `k` of the run.
    pub fn module(&self, k: u32) -> ModuleId {
        ModuleId::new(
            self.first_module.modid.wrapping_add(k),
            self.first_module.cmdid,
        )
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=MAX_THREADS).contains(&self.threads),
            "threads must be 1..={MAX_THREADS}, not {}",
            self.threads
        );
        anyhow::ensure!(
            self.modules >= 1 && self.modules <= MAX_MODULES,
            "modules must be 1..={MAX_MODULES}, not {}",
            self.modules
        );
        anyhow::ensure!(!self.duration.is_zero(), "duration must be above 0");
        anyhow::ensure!(!self.timeout.is_zero(), "timeout must be above 0");
        anyhow::ensure!(
            !(self.target == Target::Floor && self.transport != Transport::Udp),
            "the floor speaks UDP only: --transport shm or local needs an agent"
        );
        anyhow::ensure!(
            self.shards <= 1024,
            "shards must be 0..=1024, not {}",
            self.shards
        );
        Ok(())
    }
}

/// The most client threads a run starts.
pub const MAX_THREADS: u32 = 4096;
/// The most modules a run spreads over.
pub const MAX_MODULES: u32 = 100_000;

/// Runs the load described by `opts`, prints a live line every second and
/// the summary (text, or JSON with `opts.json`) to `out`, and returns the
/// summary. Stops early, with a summary of what it measured, on SIGTERM /
/// SIGINT when [`crate::service::signal::install`] was called.
///
/// # Errors
/// Invalid options, a floor or standalone system that cannot start, a
/// thread that cannot be spawned, or `out` failing. Failed getHosts are
/// not errors: they are counted in the summary.
pub fn run(opts: &QpsOptions, out: &mut dyn Write) -> anyhow::Result<Summary> {
    anyhow::ensure!(
        opts.open.is_none(),
        "an open-loop run (--rate) is run by open::run_open"
    );
    opts.validate()?;
    let server = Server::start(opts)?;
    let mut stderr = std::io::stderr();
    let live: &mut dyn Write = if opts.json { &mut stderr } else { out };
    register_all(opts, server.heartbeat(), live)?;
    let summary = measure(opts, &server, live)?;
    server.stop()?;
    if opts.json {
        writeln!(out, "{}", summary.to_json())?;
        if let Some(w) = &summary.warning {
            eprintln!("lbagent qpstest: WARNING: {w}");
        }
    } else {
        writeln!(out, "{summary}")?;
    }
    out.flush()?;
    Ok(summary)
}

// === the server under test ===

/// What a run measures, started (floor, standalone) or found (agent).
struct Server {
    name: &'static str,
    heartbeat: PathBuf,
    cpu: CpuSource,
    floor: Option<Floor>,
    standalone: Option<Standalone>,
    /// Declared last: removed after the servers that use it have stopped.
    _scratch: Option<ScratchDir>,
}

/// Where the server's CPU time is read.
enum CpuSource {
    /// The in-process floor's serving thread.
    Floor,
    /// Another process: all its threads.
    Process(u32),
    /// This process: the agent's shard and control threads.
    AgentThreads,
    /// Unknown.
    None,
}

impl Server {
    fn start(opts: &QpsOptions) -> anyhow::Result<Server> {
        match &opts.target {
            Target::Heartbeat(path) => Ok(Server {
                name: "agent",
                heartbeat: path.clone(),
                cpu: agent_cpu_source(path),
                floor: None,
                standalone: None,
                _scratch: None,
            }),
            Target::Floor => {
                let scratch = ScratchDir::new("floor")?;
                let floor = Floor::start(FloorOptions::new(scratch.path().join("heartbeat")))
                    .context("cannot start the floor")?;
                Ok(Server {
                    name: "floor",
                    heartbeat: floor.heartbeat_path().to_path_buf(),
                    cpu: CpuSource::Floor,
                    floor: Some(floor),
                    standalone: None,
                    _scratch: Some(scratch),
                })
            }
            Target::Standalone => {
                let scratch = ScratchDir::new("standalone")?;
                add_demo_routes(opts, scratch.path())?;
                let mut so = StandaloneOptions::ephemeral(scratch.path());
                if opts.transport == Transport::Shm {
                    so.config.shm.enabled = true;
                    so.config.shm.dir = scratch.path().to_path_buf();
                }
                if opts.shards > 0 {
                    so.config.agent.shards = opts.shards;
                }
                let system = Standalone::start(so).context("cannot start the standalone system")?;
                wait_for_first_beat(system.heartbeat_path(), FIRST_BEAT_WAIT)?;
                Ok(Server {
                    name: "standalone",
                    heartbeat: system.heartbeat_path().to_path_buf(),
                    cpu: CpuSource::AgentThreads,
                    floor: None,
                    standalone: Some(system),
                    _scratch: Some(scratch),
                })
            }
        }
    }

    fn heartbeat(&self) -> &Path {
        &self.heartbeat
    }

    /// The server's CPU seconds so far, and what was read.
    fn cpu_seconds(&self) -> Option<(f64, String)> {
        match &self.cpu {
            CpuSource::Floor => {
                let f = self.floor.as_ref()?;
                Some((f.server_cpu_seconds().ok()?, "floor thread".into()))
            }
            CpuSource::Process(pid) => Some((
                cpu::process_cpu_seconds(*pid).ok()?,
                format!("agent process {pid}"),
            )),
            CpuSource::AgentThreads => {
                let (s, n) =
                    cpu::named_threads_cpu_seconds(std::process::id(), is_agent_thread).ok()?;
                (n > 0).then(|| (s, format!("{n} agent threads")))
            }
            CpuSource::None => None,
        }
    }

    fn stop(self) -> anyhow::Result<()> {
        if let Some(f) = self.floor {
            f.stop().context("stopping the floor")?;
        }
        if let Some(s) = self.standalone {
            s.stop().context("stopping the standalone system")?;
        }
        Ok(())
    }
}

/// How long a standalone agent may take to beat for the first time (until
/// then clients rightly see it as down).
const FIRST_BEAT_WAIT: Duration = Duration::from_secs(10);

/// Writes the demo routes into the store the standalone system in
/// `data_dir` will open, before it starts: the route server then loads them
/// at start, and the first pull finds them.
fn add_demo_routes(opts: &QpsOptions, data_dir: &Path) -> anyhow::Result<()> {
    let url = StoreUrl::Sqlite(data_dir.join(crate::standalone::STORE_FILE));
    let mut store = store::open(&url).with_context(|| format!("cannot open the store {url}"))?;
    // One transaction and one route version for the whole table.
    let rows: Vec<_> = (0..opts.modules)
        .flat_map(|k| demo_nodes(k).into_iter().map(move |n| (k, n)))
        .map(|(k, n)| (opts.module(k), n))
        .collect();
    store
        .import_routes(&rows, true)
        .with_context(|| format!("cannot import the demo routes into {url}"))?;
    Ok(())
}

/// Waits until the heartbeat at `path` has beaten once.
fn wait_for_first_beat(path: &Path, limit: Duration) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let beat = HeartbeatReader::open(path).and_then(|r| r.beat_unix_ms());
        match beat {
            Ok(b) if b > 0 => return Ok(()),
            _ if t0.elapsed() < limit => std::thread::sleep(Duration::from_millis(10)),
            Ok(_) => anyhow::bail!("the agent did not beat within {limit:?}"),
            Err(e) => {
                return Err(e).with_context(|| format!("the agent did not beat within {limit:?}"))
            }
        }
    }
}

/// The agent's shard executors and its control core, as glommio names them
/// (`comm` holds at most 15 bytes: `lbagent-shard-1` for shard 10 too).
fn is_agent_thread(comm: &str) -> bool {
    comm.starts_with("lbagent-shard-") || comm == "lbagent-control"
}

/// The agent's pid from its heartbeat: its whole process when it is another
/// one, its named threads when it runs in this one.
fn agent_cpu_source(heartbeat: &Path) -> CpuSource {
    let Ok(hb) = HeartbeatReader::open(heartbeat).and_then(|r| r.read()) else {
        return CpuSource::None;
    };
    let pid = hb.info.pid;
    if pid == std::process::id() {
        CpuSource::AgentThreads
    } else if cpu::process_cpu_seconds(pid).is_ok() {
        CpuSource::Process(pid)
    } else {
        CpuSource::None
    }
}

/// A directory of this process's own, removed on drop (the floor's
/// heartbeat lives there).
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(what: &str) -> anyhow::Result<ScratchDir> {
        let base = std::env::temp_dir();
        for attempt in 0..100u32 {
            let p = base.join(format!(
                "lbagent-qpstest-{what}-{}-{attempt}-{}",
                std::process::id(),
                fastrand::u32(..)
            ));
            match std::fs::create_dir(&p) {
                Ok(()) => return Ok(ScratchDir(p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("cannot create {}", p.display())),
            }
        }
        anyhow::bail!("cannot create a scratch directory in {}", base.display())
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// === the run ===

fn client_options(opts: &QpsOptions, heartbeat: &Path) -> ClientOptions {
    ClientOptions {
        heartbeat_path: heartbeat.to_path_buf(),
        cache: opts.cache,
        shm: opts.transport == Transport::Shm,
        // Shared memory leases its slots over the local socket.
        local_socket: opts.transport != Transport::Udp,
        ..ClientOptions::default()
    }
}

/// How long registering one module may wait for its route (the agent pulls
/// it from the route server) at least, whatever the getHost timeout.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// Registers every module before the clock starts (the agent pulls a route
/// before first use); a failure is printed and the run goes on, so that it
/// is counted like any other.
fn register_all(opts: &QpsOptions, heartbeat: &Path, live: &mut dyn Write) -> anyhow::Result<()> {
    let mut client = match Client::with_options(client_options(opts, heartbeat)) {
        Ok(c) => c,
        Err(e) => {
            writeln!(live, "qpstest: cannot register the modules: {e}")?;
            return Ok(());
        }
    };
    let mut failed = 0u32;
    for k in 0..opts.modules {
        let m = opts.module(k);
        if let Err(e) = client.register(m.modid, m.cmdid, opts.timeout.max(REGISTER_TIMEOUT)) {
            failed += 1;
            if failed <= 3 {
                writeln!(live, "qpstest: register {m}: {} ({e})", e.kind())?;
            }
        }
    }
    if failed > 3 {
        writeln!(live, "qpstest: register failed for {failed} modules in all")?;
    }
    anyhow::ensure!(
        opts.transport != Transport::Shm || client.shm_attached() > 0,
        "--transport shm: the agent offers no usable shared memory (its [shm] enabled? \
         the region files readable and writable by this user?)"
    );
    anyhow::ensure!(
        opts.transport != Transport::Local || client.local_connected() > 0,
        "--transport local: the agent serves no local socket beside its heartbeat \
         (agent.local_socket on? the socket the agent's user's?)"
    );
    Ok(())
}

/// What a worker shares with the main thread: its tally since the last
/// live line. The main thread takes it every second; the worker holds the
/// lock only to record one call, so it is never contended for long.
type Shared = Arc<Mutex<Tally>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Tally> {
    // A worker that panicked left a tally that is still counts: use it.
    t.lock().unwrap_or_else(PoisonError::into_inner)
}

fn measure(opts: &QpsOptions, server: &Server, live: &mut dyn Write) -> anyhow::Result<Summary> {
    let stop = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(Gate::default());
    let (ready_tx, ready_rx) = mpsc::channel();
    let mut tallies = Vec::with_capacity(opts.threads as usize);
    let mut workers = Vec::with_capacity(opts.threads as usize);
    for i in 0..opts.threads {
        let shared: Shared = Arc::new(Mutex::new(Tally::new()));
        tallies.push(shared.clone());
        let w = Worker {
            modules: thread_modules(opts, i),
            options: client_options(opts, server.heartbeat()),
            report: opts.report,
            hold: opts.hold,
            timeout: opts.timeout,
            stop: stop.clone(),
            gate: gate.clone(),
            ready: ready_tx.clone(),
            shared,
            mix: opts.priority_mix.clone(),
            rng: mix::Rng::new(u64::from(i) + 1),
        };
        let spawned = std::thread::Builder::new()
            .name(format!("qpstest-{i}"))
            .spawn(move || w.run());
        match spawned {
            Ok(h) => workers.push(h),
            Err(e) => {
                // The threads already started see `stop` and return.
                stop.store(true, Ordering::Release);
                gate.open();
                for w in workers {
                    let _ = w.join();
                }
                return Err(e).context(format!("cannot spawn client thread {i}"));
            }
        }
    }
    // Every client is built before the clock starts (a thread that dies
    // first drops its sender: the loop ends then too).
    drop(ready_tx);
    for _ in 0..opts.threads {
        if ready_rx.recv().is_err() {
            break;
        }
    }
    gate.open();
    let t_start = Instant::now();
    let warm_end = t_start + opts.warmup;
    let end = warm_end + opts.duration;
    let mut hist_log = match &opts.hist_log {
        Some(p) => Some(hlog::HistLog::create(
            p,
            "lbagent qpstest, closed loop: getHost round-trip latency, ns",
        )?),
        None => None,
    };
    // When the measured window started, and the server's CPU then (at
    // once without a warm-up; else at the tick that ends it).
    let mut measured: Option<(Instant, Option<(f64, String)>)> = opts
        .warmup
        .is_zero()
        .then(|| (t_start, server.cpu_seconds()));
    let mut total = Tally::new();
    let mut interval = Tally::new();
    let mut last = (t_start, server.cpu_seconds().map(|c| c.0));
    let mut next = t_start + Duration::from_secs(1);
    // A line every second and one at the end, however late this thread
    // gets there (a stall of a busy machine may skip past the end: the last
    // line still comes).
    while !crate::service::signal::received() {
        let now = Instant::now();
        let due = next.min(end);
        if now < due {
            std::thread::sleep(
                due.saturating_duration_since(now)
                    .min(Duration::from_millis(100)),
            );
            continue;
        }
        let at = Instant::now();
        let tick = due;
        collect(&tallies, &mut interval);
        if measured.is_some() {
            total.merge(&interval);
            if let Some(l) = &mut hist_log {
                l.write(&interval.latency, last.0, at, None)?;
            }
        } else if tick >= warm_end {
            // This interval was the warm-up's: counted nowhere.
            measured = Some((at, server.cpu_seconds()));
        }
        let cpu = server.cpu_seconds().map(|c| c.0);
        let cpu_delta = cpu.zip(last.1).map(|(b, a)| b - a);
        let line = LiveLine::new(
            at.duration_since(t_start).as_secs_f64(),
            &interval,
            at.duration_since(last.0).as_secs_f64(),
            cpu_delta,
        );
        writeln!(live, "{line}")?;
        live.flush()?;
        last = (at, cpu);
        next += Duration::from_secs(1);
        if at >= end {
            break;
        }
    }
    stop.store(true, Ordering::Release);
    let (t0, cpu0) = measured.unwrap_or((Instant::now(), None));
    let seconds = t0.elapsed().as_secs_f64();
    let cpu1 = server.cpu_seconds();
    for w in workers {
        if w.join().is_err() {
            writeln!(
                live,
                "qpstest: a client thread panicked; its counts so far are kept"
            )?;
        }
    }
    collect(&tallies, &mut interval);
    if seconds > 0.0 {
        total.merge(&interval);
        if let (Some(l), false) = (&mut hist_log, interval.latency.is_empty()) {
            l.write(&interval.latency, last.0, Instant::now(), None)?;
        }
    }
    if let Some(l) = hist_log {
        l.finish()?;
    }
    if let Some(p) = &opts.percentiles {
        hgrm::write_file(p, &total.latency)?;
    }
    let server_cpu = cpu0.zip(cpu1).map(|((a, _), (b, what))| ServerCpu {
        seconds: (b - a).max(0.0),
        what,
    });
    let info = RunInfo {
        target: server.name.to_string(),
        heartbeat: server.heartbeat().display().to_string(),
        threads: opts.threads,
        modules: opts.modules,
        report: opts.report,
        cache: opts.cache,
        timeout_ms: opts.timeout.as_millis() as u64,
    };
    let mut summary = Summary::new(info, &total, seconds, server_cpu);
    if let Some(m) = &opts.priority_mix {
        summary.priority_classes = mix::summarize(m, &total.classes);
    }
    Ok(summary)
}

/// Takes every worker's tally into `interval` (emptied first).
fn collect(tallies: &[Shared], interval: &mut Tally) {
    interval.reset();
    for t in tallies {
        let mut t = lock(t);
        interval.merge(&t);
        t.reset();
    }
}

/// One client thread.
struct Worker {
    /// The modules this thread asks for, in turn.
    modules: Vec<ModuleId>,
    options: ClientOptions,
    report: bool,
    hold: Duration,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    gate: Arc<Gate>,
    ready: mpsc::Sender<()>,
    shared: Shared,
    /// The priority mix the getHosts draw from, if any.
    mix: Option<mix::PriorityMix>,
    rng: mix::Rng,
}

/// Where the workers wait for the clock to start.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        while !*open {
            open = self
                .opened
                .wait(open)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Worker {
    fn run(mut self) {
        // A client that cannot be built (its heartbeat unreadable, say)
        // counts as a failed getHost each time it is tried, like any call
        // that cannot reach the agent.
        let mut client = Client::with_options(self.options.clone());
        let _ = self.ready.send(());
        self.gate.wait();
        // A priority mix counts per class and per call: the general loop.
        if let (Ok(c), true) = (&mut client, self.options.cache && self.mix.is_none()) {
            self.run_cached(c);
            return;
        }
        let mut turn = 0usize;
        while !self.stop.load(Ordering::Acquire) {
            let c = match &mut client {
                Ok(c) => c,
                Err(e) => {
                    lock(&self.shared).error(e.kind());
                    client = Client::with_options(self.options.clone());
                    continue;
                }
            };
            let m = self.modules[turn];
            turn = (turn + 1) % self.modules.len();
            let drawn = self.mix.as_ref().map(|x| x.draw(self.rng.next_u64()));
            let t = Instant::now();
            let got = match drawn {
                Some((_, p)) => c.get_host_with(m.modid, m.cmdid, p, self.timeout),
                None => c.get_host(m.modid, m.cmdid, self.timeout),
            };
            let ns = t.elapsed().as_nanos() as u64;
            if self.stop.load(Ordering::Acquire) {
                // Finished after the clock stopped: not part of the run.
                break;
            }
            if let Some((class, _)) = drawn {
                let mut t = lock(&self.shared);
                if t.classes.len() <= class {
                    t.classes.resize_with(class + 1, Default::default);
                }
                t.classes[class].count(got.as_ref().map(|_| ()).map_err(|e| e.kind()), ns);
            }
            let host = match got {
                Ok(h) => {
                    lock(&self.shared).answer(answer(h.source), ns);
                    h.addr
                }
                Err(e) => {
                    lock(&self.shared).error(e.kind());
                    continue;
                }
            };
            if self.report {
                if !self.hold.is_zero() {
                    std::thread::sleep(self.hold);
                }
                let r = c.report(m.modid, m.cmdid, host, 0, 0);
                lock(&self.shared).report(r.map_err(|e| e.kind()));
            }
        }
        if let Ok(c) = &mut client {
            if let Err(e) = c.flush() {
                lock(&self.shared).report(Err(e.kind()));
            }
        }
    }
}

impl Worker {
    /// The loop of a run through the route cache, whose calls take tens
    /// of nanoseconds: the loop's own work must not be what is measured.
    /// Every call is a real getHost (and report) and is counted; but the
    /// counts go to a tally of the thread's own, handed to the main thread
    /// every [`PUBLISH_EVERY`], and only one call in [`LATENCY_SAMPLE`] is
    /// timed (two clock reads cost more than a cached call), so the latency
    /// percentiles are those of that sample.
    fn run_cached(&self, c: &mut Client) {
        let mut local = Tally::new();
        let mut turn = 0usize;
        let mut calls = 0u64;
        let mut published = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let m = self.modules[turn];
            turn = if turn + 1 >= self.modules.len() {
                0
            } else {
                turn + 1
            };
            let timed = calls % LATENCY_SAMPLE == 0;
            calls += 1;
            let t = timed.then(Instant::now);
            let got = c.get_host(m.modid, m.cmdid, self.timeout);
            let done = t.map(|t| (t, Instant::now()));
            if self.stop.load(Ordering::Relaxed) {
                // Finished after the clock stopped: not part of the run.
                break;
            }
            if let Some((_, now)) = done {
                if now.duration_since(published) >= PUBLISH_EVERY {
                    lock(&self.shared).merge(&local);
                    local.reset();
                    published = now;
                }
            }
            let host = match got {
                Ok(h) => {
                    match done {
                        Some((t, now)) => {
                            local.answer(answer(h.source), (now - t).as_nanos() as u64);
                        }
                        None => match h.source {
                            HostSource::Agent => local.from_agent += 1,
                            HostSource::Cache => local.from_cache += 1,
                            HostSource::StaticRoutes => local.static_route_answers += 1,
                        },
                    }
                    h.addr
                }
                Err(e) => {
                    local.error(e.kind());
                    continue;
                }
            };
            if self.report {
                let r = c.report(m.modid, m.cmdid, host, 0, 0);
                local.report(r.map_err(|e| e.kind()));
            }
        }
        if let Err(e) = c.flush() {
            local.report(Err(e.kind()));
        }
        lock(&self.shared).merge(&local);
    }
}

/// In a run through the route cache, one call in this many is timed.
pub const LATENCY_SAMPLE: u64 = 64;

/// In a run through the route cache, how often a thread hands its counts
/// to the main thread (which prints them every second).
const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// The modules thread `i` asks for: module `i % modules` when there are
/// no more modules than threads; otherwise every `threads`-th module from
/// `i`, so that every module is used.
fn thread_modules(opts: &QpsOptions, i: u32) -> Vec<ModuleId> {
    if opts.modules <= opts.threads {
        return vec![opts.module(i % opts.modules)];
    }
    (i..opts.modules)
        .step_by(opts.threads as usize)
        .map(|k| opts.module(k))
        .collect()
}

fn answer(source: HostSource) -> Answer {
    match source {
        HostSource::Agent => Answer::Agent,
        HostSource::Cache => Answer::Cache,
        HostSource::StaticRoutes => Answer::StaticRoutes,
    }
}

/// The demo route of module `k`: [`DEMO_NODES`] nodes `10.k1.k2.i:8080`
/// (`k1.k2` the module index's two low bytes).
pub fn demo_nodes(k: u32) -> Vec<RouteNode> {
    let [_, _, k1, k2] = k.to_be_bytes();
    (1..=DEMO_NODES)
        .map(|i| RouteNode {
            addr: NodeAddr::new(std::net::Ipv4Addr::new(10, k1, k2, i), 8080),
            weight: 1,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_are_consecutive_modids_from_the_first() {
        let o = QpsOptions {
            first_module: ModuleId::new(u32::MAX, 3),
            ..QpsOptions::default()
        };
        assert_eq!(o.module(0), ModuleId::new(u32::MAX, 3));
        assert_eq!(o.module(1), ModuleId::new(0, 3));
    }

    #[test]
    fn options_out_of_range_are_refused_with_the_field_named() {
        let bad = [
            QpsOptions {
                threads: 0,
                ..QpsOptions::default()
            },
            QpsOptions {
                modules: 0,
                ..QpsOptions::default()
            },
            QpsOptions {
                duration: Duration::ZERO,
                ..QpsOptions::default()
            },
            QpsOptions {
                timeout: Duration::ZERO,
                ..QpsOptions::default()
            },
        ];
        for (o, field) in bad
            .iter()
            .zip(["threads", "modules", "duration", "timeout"])
        {
            let e = o.validate().unwrap_err().to_string();
            assert!(e.starts_with(field), "{e}");
        }
        QpsOptions::default().validate().unwrap();
    }

    #[test]
    fn threads_share_few_modules_and_split_many() {
        let o = |threads, modules| QpsOptions {
            threads,
            modules,
            first_module: ModuleId::new(100, 1),
            ..QpsOptions::default()
        };
        let ids = |o: &QpsOptions, i| -> Vec<u32> {
            thread_modules(o, i).iter().map(|m| m.modid).collect()
        };
        let few = o(4, 3);
        assert_eq!(
            (0..4).map(|i| ids(&few, i)).collect::<Vec<_>>(),
            [vec![100], vec![101], vec![102], vec![100]]
        );
        let many = o(2, 5);
        assert_eq!(ids(&many, 0), [100, 102, 104]);
        assert_eq!(ids(&many, 1), [101, 103]);
    }

    #[test]
    fn demo_nodes_are_distinct_per_module() {
        let a = demo_nodes(0);
        let b = demo_nodes(257);
        assert_eq!(a.len(), DEMO_NODES as usize);
        assert_eq!(a[0].addr.to_string(), "10.0.0.1:8080");
        assert_eq!(b[9].addr.to_string(), "10.1.1.10:8080");
    }

    #[test]
    fn agent_threads_are_shards_and_control() {
        assert!(is_agent_thread("lbagent-shard-0"));
        assert!(is_agent_thread("lbagent-shard-1"));
        assert!(is_agent_thread("lbagent-control"));
        assert!(!is_agent_thread("lbagent-floor"));
        assert!(!is_agent_thread("qpstest-3"));
    }
}
