//! Starting and stopping the agent: binds the sockets (so that errors
//! surface before any thread starts), loads the snapshot, creates the
//! heartbeat, builds the rings, and spawns one pinned glommio executor per
//! shard plus the control core's. [`run`] adds the signal handling of the
//! `lbagent agent` command.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use glommio::channels::shared_channel;
use glommio::{ExecutorJoinHandle, LocalExecutorBuilder, Placement};

use super::control::{self, ControlParts};
use super::live::{LiveSlot, LiveUpdate};
use super::liveness::{self, Liveness};
use super::local_socket::{Acceptor, Inbox, Trust};
use super::routeclient::RouteClientConfig;
use super::shard::{ShardSetup, Steering};
use super::shard_rt::{self, ShardParts};
use super::statsclient::StatsClientConfig;
use lbagent_config::reload::Role;
use lbagent_config::{Config, ConfigSource};
use lbagent_host::heartbeat::{AgentInfo, HeartbeatLock, HeartbeatWriter};
use lbagent_host::snapshot::{self, SnapshotError, SnapshotIndex};
use lbagent_shm::layout::Geometry;
use lbagent_shm::region::{Access, Identity, Region};

/// Slots of each ring between a shard and the control core.
pub const RING_CAPACITY: usize = 4096;

/// A running agent.
pub struct Agent {
    stop: Arc<AtomicBool>,
    shards: Vec<ExecutorJoinHandle<()>>,
    control: Option<ExecutorJoinHandle<()>>,
    ports: Vec<u16>,
    /// Where the shards' sockets are reached from this host (the bind
    /// address, or loopback when that is unspecified), for the stop's
    /// doorbells.
    bind: Ipv4Addr,
    metrics_addr: SocketAddr,
    routes_loaded: usize,
    liveness: Arc<Liveness>,
    live: LiveSlot,
    /// The clients' TLS (re-read on SIGHUP).
    tls: lbagent_tls::TlsHandle,
    /// The local socket's acceptor (`agent.local_socket`).
    local: Option<Acceptor>,
}

impl Agent {
    /// Starts the agent described by `config`.
    ///
    /// `agent.base_port = 0` picks a free range of consecutive ports (tests);
    /// `agent.metrics_addr` with port 0 picks a free port.
    ///
    /// # Errors
    /// A port cannot be bound, an address does not resolve, the heartbeat
    /// file cannot be created, or an executor cannot start (often: `ulimit
    /// -l` too small for `agent.io_memory_kib`).
    pub fn start(config: &Config) -> anyhow::Result<Agent> {
        let a = &config.agent;
        // One agent per heartbeat path: take its lock before anything else.
        let heartbeat_lock = HeartbeatLock::take(&a.heartbeat_path).with_context(|| {
            format!(
                "cannot own the heartbeat file agent.heartbeat_path = {}",
                a.heartbeat_path.display()
            )
        })?;
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        let shards = shard_count(a.shards, ncpu);
        let sockets = retry_in_use(|| bind_shards(a.bind, a.base_port, shards))?;
        if a.udp_rcvbuf_bytes != 0 {
            size_receive_buffers(&sockets, a.udp_rcvbuf_bytes)?;
        }
        let ports: Vec<u16> = sockets
            .iter()
            .map(|s| s.local_addr().map(|a| a.port()).unwrap_or(0))
            .collect();
        let metrics = bind_metrics(a.metrics_addr)?;
        let metrics_addr = metrics.local_addr()?;

        // The snapshot, read and checked once, is shared by the shards
        // (each makes its share's modules from it) and the control core
        // (its table): nothing of it is decoded or copied before the
        // executors start.
        let snapshot = load_snapshot(&a.snapshot_path);
        let heartbeat = create_heartbeat(config, heartbeat_lock, shards, ports[0])?;
        let regions = create_regions(config, shards)?;
        if !regions.is_empty() {
            let prefix = shm_prefix(config);
            heartbeat
                .set_shm(Some(&prefix))
                .with_context(|| format!("cannot name shm.dir's regions {}", prefix.display()))?;
        }

        let route_addrs = resolve("agent.route_servers", &a.route_servers)?;
        let stats_addrs = resolve("agent.reporters", &a.reporters)?;
        // One TLS context for both clients (its files are re-read when they change).
        let tls = lbagent_tls::TlsHandle(
            lbagent_tls::Tls::from_config(&config.tls, "agent")
                .context("cannot start mutual TLS to the route servers and reporters")?,
        );
        let common = Common {
            stop: Arc::new(AtomicBool::new(false)),
            ready: Arc::new(AtomicU32::new(0)),
            live: Liveness::new(shards),
            idle_tick: super::liveness::idle_tick(lbagent_service::sdnotify::watchdog_interval()),
        };
        let live_slot = LiveSlot::default();
        // The local socket: bound and its acceptor started before the
        // shards, so that a path the agent must not replace stops the
        // start here.
        let (local, inboxes) = if a.local_socket {
            let trust = Trust::new(nix::unistd::geteuid().as_raw(), a);
            let ids = (0..shards as usize)
                .map(|i| regions.get(i).map(Region::file_id))
                .collect();
            let (acceptor, inboxes) = Acceptor::start(&a.heartbeat_path, shards, trust, ids)?;
            // Its clients may now lease slots over the socket, whatever
            // pid namespace they run in (lbagent_shm::lease).
            for r in &regions {
                r.add_features(lbagent_shm::layout::FEAT_LEASE);
            }
            (Some(acceptor), inboxes.into_iter().map(Some).collect())
        } else {
            (None, vec![None; shards as usize])
        };
        let rings = spawn_shards(
            config,
            &common,
            sockets,
            ports[0],
            &snapshot,
            (regions, inboxes),
            ncpu,
        )?;
        let routes_loaded = snapshot.as_ref().map_or(0, |s| s.len());
        let parts = ControlParts {
            shards,
            route_client: RouteClientConfig {
                refresh_ms: config.lb.update_timeout * 1000,
                tls: tls.clone(),
                ..RouteClientConfig::new(route_addrs)
            },
            stats_client: StatsClientConfig {
                caller: local_ip_towards(stats_addrs.first().copied()).unwrap_or(a.bind),
                tls: tls.clone(),
                ..StatsClientConfig::new(stats_addrs)
            },
            from_shards: rings.from_shards,
            to_shards: rings.to_shards,
            metrics_in: rings.metrics_in,
            bells: rings.bells,
            snapshot,
            heartbeat,
            snapshot_path: a.snapshot_path.clone(),
            snapshot_interval: Duration::from_secs(a.snapshot_interval),
            metrics_listener: metrics,
            stop: common.stop.clone(),
            beat: common.live.control(),
            ready: common.ready.clone(),
            live: live_slot.clone(),
            idle_tick: common.idle_tick,
        };
        let control = spawn_control(parts, ncpu - 1, a.io_memory_kib)?;
        Ok(Agent {
            stop: common.stop,
            shards: rings.handles,
            control: Some(control),
            ports,
            bind: if a.bind.is_unspecified() {
                Ipv4Addr::LOCALHOST
            } else {
                a.bind
            },
            metrics_addr,
            routes_loaded,
            liveness: common.live,
            live: live_slot,
            tls,
            local,
        })
    }

    /// Applies the live part of `new`, a reloaded configuration that
    /// followed `old` ([`lbagent_config::reload::plan`] said it changes only
    /// live fields): the `[lb]` parameters reach every shard through its
    /// ring, the server lists their clients.
    ///
    /// # Errors
    /// A changed server list that does not resolve (nothing is applied).
    pub fn apply_live(&self, old: &Config, new: &Config) -> anyhow::Result<()> {
        apply_live(&self.live, old, new)
    }

    /// The loops' turn counters (what the systemd watchdog checks).
    pub fn liveness(&self) -> Arc<Liveness> {
        self.liveness.clone()
    }

    /// The UDP port of each shard.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// Where `GET /metrics` is served.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// How many routes the snapshot gave at start.
    pub fn routes_loaded(&self) -> usize {
        self.routes_loaded
    }

    /// The flag that stops the agent when set.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Stops accepting, flushes statistics, writes the snapshot and joins
    /// every executor.
    ///
    /// # Errors
    /// An executor panicked.
    pub fn stop(mut self) -> anyhow::Result<()> {
        if let Some(l) = &mut self.local {
            // New clients go by UDP while the shards drain.
            l.stop();
        }
        self.stop.store(true, Ordering::SeqCst);
        self.ring_shards();
        self.join()
    }

    /// Wakes every parked shard to see the stop flag: an empty datagram on
    /// its socket (what a shared-memory client's doorbell is). A shard that
    /// is not parked sees the flag at its next turn; one whose doorbell is
    /// lost sees it at its next tick.
    fn ring_shards(&self) {
        let Ok(sock) = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)) else {
            return;
        };
        for &port in &self.ports {
            let _ = sock.send_to(&[], (self.bind, port));
        }
    }

    fn join(&mut self) -> anyhow::Result<()> {
        for h in self.shards.drain(..) {
            h.join()
                .map_err(|e| anyhow::anyhow!("a shard failed: {e}"))?;
        }
        if let Some(c) = self.control.take() {
            c.join()
                .map_err(|e| anyhow::anyhow!("the control core failed: {e}"))?;
        }
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if !self.shards.is_empty() {
            self.stop.store(true, Ordering::SeqCst);
            self.ring_shards();
        }
        let _ = self.join();
    }
}

fn apply_live(slot: &LiveSlot, old: &Config, new: &Config) -> anyhow::Result<()> {
    let (a, b) = (&old.agent, &new.agent);
    let route_servers = (a.route_servers != b.route_servers)
        .then(|| resolve("agent.route_servers", &b.route_servers))
        .transpose()?;
    let reporters = (a.reporters != b.reporters)
        .then(|| resolve("agent.reporters", &b.reporters))
        .transpose()?;
    slot.put(LiveUpdate::new(new, route_servers, reporters));
    Ok(())
}

/// Runs the agent until SIGTERM or SIGINT, then shuts down cleanly (stop
/// accepting, flush statistics, write the snapshot) and returns. SIGHUP
/// reads the configuration again from `source` and applies what may change
/// live ([`lbagent_service::reload`]).
///
/// # Errors
/// The agent could not start, or an executor failed.
pub fn run(config: &Config, source: ConfigSource) -> anyhow::Result<()> {
    lbagent_service::signal::install();
    let _span = tracing::info_span!("agent").entered();
    let agent = Agent::start(config)?;
    let slot = agent.live.clone();
    let mut current = config.clone();
    let tls = agent.tls.clone();
    lbagent_service::signal::on_reload(move || {
        // The TLS files are read again whatever the configuration says.
        if let Some(tls) = tls.get() {
            tls.reload();
        }
        lbagent_service::reload::reload(Role::Agent, &source, &mut current, |old, new, _| {
            apply_live(&slot, old, new).map_err(|e| format!("{e:#}"))
        })
    });
    tracing::info!(
        "serving on {}:{:?} ({} shards), metrics on http://{}/metrics, {} routes from the snapshot",
        config.agent.bind,
        agent.ports(),
        agent.ports().len(),
        agent.metrics_addr(),
        agent.routes_loaded()
    );
    let systemd = liveness::Systemd::ready(&agent)?;
    lbagent_service::signal::wait();
    systemd.stopping();
    let t0 = Instant::now();
    agent.stop()?;
    tracing::info!("stopped in {} ms", t0.elapsed().as_millis());
    Ok(())
}

/// How long a start waits for its ports to be released by a predecessor.
const PORT_WAIT: Duration = Duration::from_secs(3);

/// The shards to run: `agent.shards`, or with 0 one per core but the last
/// (which holds the control core), at least one.
fn shard_count(configured: u32, ncpu: usize) -> u32 {
    if configured == 0 {
        (ncpu.saturating_sub(1)).max(1) as u32
    } else {
        configured
    }
}

/// The metrics endpoint's listener, non-blocking, bound before any thread
/// starts so that a taken port stops the start with its name.
fn bind_metrics(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let metrics = retry_in_use(|| Ok(TcpListener::bind(addr)?))
        .with_context(|| format!("cannot bind the metrics endpoint agent.metrics_addr = {addr}"))?;
    metrics.set_nonblocking(true)?;
    Ok(metrics)
}

/// The heartbeat file, created under the lock already taken, saying where
/// the shards listen and where the static route file is.
fn create_heartbeat(
    config: &Config,
    lock: HeartbeatLock,
    shards: u32,
    base_port: u16,
) -> anyhow::Result<HeartbeatWriter> {
    let a = &config.agent;
    HeartbeatWriter::create_locked(
        lock,
        &AgentInfo {
            shards,
            base_port,
            bind: a.bind,
            pid: std::process::id(),
            snapshot_path: a.snapshot_path.clone(),
        },
    )
    .with_context(|| {
        format!(
            "cannot create the heartbeat file agent.heartbeat_path = {}",
            a.heartbeat_path.display()
        )
    })
}

/// What every executor of one agent shares: the stop flag, the count of
/// executors ready, their turn counters and the idle tick.
struct Common {
    stop: Arc<AtomicBool>,
    ready: Arc<AtomicU32>,
    live: Arc<Liveness>,
    idle_tick: Duration,
}

/// The control core's ends of the rings to every shard, and the shards'
/// executors.
struct ShardRings {
    from_shards: Vec<shared_channel::SharedReceiver<super::messages::ToControl>>,
    to_shards: Vec<shared_channel::SharedSender<super::messages::ToShard>>,
    metrics_in: Vec<shared_channel::SharedReceiver<Box<super::metrics::ShardMetrics>>>,
    bells: Vec<super::bell::ShardBell>,
    handles: Vec<ExecutorJoinHandle<()>>,
}

/// Builds each shard's rings and spawns its executor, pinned to core
/// `i % ncpu`, on its socket (and its shared-memory region and its local
/// socket's inbox, when offered).
fn spawn_shards(
    config: &Config,
    common: &Common,
    sockets: Vec<UdpSocket>,
    base_port: u16,
    snapshot: &Option<Arc<SnapshotIndex>>,
    (regions, inboxes): (Vec<Region>, Vec<Option<Arc<Inbox>>>),
    ncpu: usize,
) -> anyhow::Result<ShardRings> {
    let a = &config.agent;
    let shards = sockets.len() as u32;
    let io_memory = a.io_memory_kib as usize * 1024;
    // Each shard's doorbell (agent/bell.rs); the local socket's acceptor
    // rings them all from one socket of its own, as the control core does.
    let mut bells = Vec::with_capacity(sockets.len());
    for socket in &sockets {
        let at = socket
            .local_addr()
            .context("cannot read a shard socket's address")?;
        bells.push(super::bell::ShardBell::new(at));
    }
    let local_ringer = if inboxes.iter().any(Option::is_some) {
        bells.first().and_then(|(bell, _)| {
            bell.socket()
                .map(Arc::new)
                .map_err(|e| tracing::warn!("no doorbell socket for the local socket's acceptor ({e}): a new local connection reaches a shard waiting on its UDP socket within a few milliseconds"))
                .ok()
        })
    } else {
        None
    };
    let mut bells = bells.into_iter();
    let mut regions = regions.into_iter();
    let mut inboxes = inboxes.into_iter();
    let mut rings = ShardRings {
        from_shards: Vec::new(),
        to_shards: Vec::new(),
        metrics_in: Vec::new(),
        bells: Vec::new(),
        handles: Vec::new(),
    };
    for (i, socket) in sockets.into_iter().enumerate() {
        let (to_control, from_shard) = shared_channel::new_bounded(RING_CAPACITY);
        let (to_shard, from_control) = shared_channel::new_bounded(RING_CAPACITY);
        let (metrics_out, metrics_rx) = shared_channel::new_bounded(4);
        rings.from_shards.push(from_shard);
        rings.to_shards.push(to_shard);
        rings.metrics_in.push(metrics_rx);
        let (bell, control_bell) = bells.next().expect("one doorbell per shard socket");
        let local = inboxes.next().flatten();
        if let (Some(inbox), Some(ringer)) = (&local, &local_ringer) {
            inbox.ring_over_udp(bell.clone(), ringer.clone());
        }
        rings.bells.push(bell);
        let parts = ShardParts {
            setup: ShardSetup {
                id: i as u32,
                shards,
                base_port,
                params: config.lb.params(),
                update_timeout_ms: config.lb.update_timeout * 1000,
                report_timeout_ms: config.lb.report_timeout * 1000,
                module_idle_ms: a.module_idle_timeout * 1000,
                unknown_ttl_ms: a.unknown_module_ttl_ms,
                max_modules: a.max_modules as usize,
                max_unknown: a.max_unknown_modules as usize,
                level_timeout_ms: config.admission.level_timeout_ms,
                udp_acts_beyond: a.udp_acts_beyond,
                steering: Steering {
                    zone: a.zone.parse().ok(),
                    locality_min_percent: u32::from(config.lb.locality_min_percent),
                    label_fallback: config.lb.label_fallback(),
                },
            },
            socket,
            snapshot: snapshot.clone(),
            to_control,
            from_control,
            metrics_out,
            stop: common.stop.clone(),
            beat: common.live.shard(i as u32),
            ready: common.ready.clone(),
            shedding: config.admission.agent_params(),
            shm: regions.next(),
            local,
            idle_tick: common.idle_tick,
            queuing_time: a.queuing_time,
            control_bell,
        };
        let core = i % ncpu.max(1);
        let h = LocalExecutorBuilder::new(Placement::Fixed(core))
            .name(&format!("lbagent-shard-{i}"))
            .io_memory(io_memory)
            .spawn(move || async move {
                // Every line this executor logs names its shard.
                let _span = tracing::info_span!("shard", id = i).entered();
                shard_rt::run(parts).await
            })
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot start shard {i}'s executor: {e} (agent.io_memory_kib = {}; check `ulimit -l`)",
                    a.io_memory_kib
                )
            })?;
        rings.handles.push(h);
    }
    Ok(rings)
}

/// Spawns the control core's executor, pinned to `core`.
fn spawn_control(
    parts: ControlParts,
    core: usize,
    io_memory_kib: u32,
) -> anyhow::Result<ExecutorJoinHandle<()>> {
    LocalExecutorBuilder::new(Placement::Fixed(core))
        .name("lbagent-control")
        .io_memory(io_memory_kib as usize * 1024)
        .spawn(move || async move {
            let _span = tracing::info_span!("control").entered();
            control::run(parts).await
        })
        .map_err(|e| {
            anyhow::anyhow!("cannot start the control core's executor: {e} (check `ulimit -l` against agent.io_memory_kib)")
        })
}

/// Retries `bind` while the address is in use, up to [`PORT_WAIT`]: after a
/// crash (`kill -9`) the kernel releases sockets that io_uring still
/// referenced a little after the process is gone, and a supervisor restarts
/// the agent at once.
fn retry_in_use<T>(mut bind: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let t0 = Instant::now();
    loop {
        match bind() {
            Err(e) if t0.elapsed() < PORT_WAIT && in_use(&e) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            other => return other,
        }
    }
}

fn in_use(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse)
    })
}

/// Sets every shard socket's receive buffer (`agent.udp_rcvbuf_bytes`) and
/// says what the kernel made of it, once; a size the kernel capped
/// (`net.core.rmem_max`) is a warning naming the cap, not an error.
fn size_receive_buffers(sockets: &[UdpSocket], bytes: u32) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let mut got = 0;
    for s in sockets {
        got = lbagent_host::udp::set_rcvbuf(s.as_raw_fd(), bytes)
            .with_context(|| format!("cannot set agent.udp_rcvbuf_bytes = {bytes} (SO_RCVBUF)"))?;
    }
    // Linux reports twice the size asked; less means it was capped.
    if got < 2 * bytes as usize {
        tracing::warn!(
            "agent.udp_rcvbuf_bytes = {bytes}: the kernel holds {got} bytes per shard socket \
             (capped by net.core.rmem_max; raise it to get the size asked)"
        );
    } else {
        tracing::info!("shard receive buffers: {got} bytes as the kernel counts them (agent.udp_rcvbuf_bytes = {bytes})");
    }
    Ok(())
}

/// Binds shard i on `base + i`. With `base == 0`, finds a free range.
fn bind_shards(ip: Ipv4Addr, base: u16, shards: u32) -> anyhow::Result<Vec<UdpSocket>> {
    let bind_range = |base: u16| -> std::io::Result<Vec<UdpSocket>> {
        (0..shards)
            .map(|i| UdpSocket::bind((ip, base + i as u16)))
            .collect()
    };
    if base != 0 {
        return bind_range(base).with_context(|| {
            format!(
                "cannot bind UDP {ip}:{base}..{} (agent.base_port, agent.shards)",
                u32::from(base) + shards - 1
            )
        });
    }
    for _ in 0..64 {
        let first = UdpSocket::bind((ip, 0))?;
        let port = first.local_addr()?.port();
        if u32::from(port) + shards > 65_536 {
            continue;
        }
        drop(first);
        if let Ok(v) = bind_range(port) {
            return Ok(v);
        }
    }
    bail!("cannot find {shards} consecutive free UDP ports on {ip}")
}

/// This host's address on the route towards `peer` (the reporter): the
/// caller the statistics name, as the original took it from the host name.
/// Connecting a UDP socket sends nothing.
fn local_ip_towards(peer: Option<SocketAddr>) -> Option<std::net::Ipv4Addr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect(peer?).ok()?;
    match s.local_addr().ok()? {
        SocketAddr::V4(a) => Some(*a.ip()),
        SocketAddr::V6(_) => None,
    }
}

fn resolve(field: &str, list: &[String]) -> anyhow::Result<Vec<SocketAddr>> {
    let mut out = Vec::new();
    for e in list {
        let addrs = e
            .to_socket_addrs()
            .with_context(|| format!("{field}: cannot resolve {e}"))?;
        out.extend(addrs.filter(|a| a.is_ipv4()).take(1));
    }
    Ok(out)
}

/// Loads the static route file, if any. A missing file is a first start; a
/// corrupt one is reported and ignored (the route server will refill it).
fn load_snapshot(path: &std::path::Path) -> Option<Arc<SnapshotIndex>> {
    match snapshot::read_index(path) {
        Ok(s) if s.is_empty() => None,
        Ok(s) => {
            if let Some(why) = s.zones_problem() {
                tracing::warn!(
                    "the route snapshot's zones file is left out: {why}; the nodes' zones and labels come back with the route server's next answer"
                );
            }
            Some(Arc::new(s))
        }
        Err(SnapshotError::Missing { .. }) => None,
        Err(e) => {
            tracing::warn!("ignoring the route snapshot: {e}");
            None
        }
    }
}

/// The prefix of the agent's region files: `<shm.dir>/<heartbeat file
/// name>.shm` (one agent per heartbeat file, so one owner per prefix).
fn shm_prefix(config: &Config) -> std::path::PathBuf {
    let name = config
        .agent
        .heartbeat_path
        .file_name()
        .map_or_else(|| "lbagent".into(), |n| n.to_owned());
    let mut file = name;
    file.push(".shm");
    config.shm.dir.join(file)
}

/// One region per shard when `shm.enabled` (else none), each a fresh file
/// replacing any a previous agent left. A file system without room for
/// them (a full `/dev/shm`: the host's state, not the configuration) is
/// not fatal: the agent warns, removes what it made and offers none, so
/// its clients use UDP; any other failure stops the start.
fn create_regions(config: &Config, shards: u32) -> anyhow::Result<Vec<Region>> {
    if !config.shm.enabled {
        return Ok(Vec::new());
    }
    let access = if config.shm.group.is_empty() {
        Access::Owner
    } else {
        let gid = lbagent_shm::region::group_id(&config.shm.group).with_context(|| {
            format!(
                "shm.group = \"{}\" is not a group of this host",
                config.shm.group
            )
        })?;
        Access::Group(gid)
    };
    let prefix = shm_prefix(config);
    let boot = fastrand::u64(..);
    let geometry = Geometry::new(config.shm.slots);
    let mut made = Vec::with_capacity(shards as usize);
    for i in 0..shards {
        let identity = Identity {
            shard: i,
            pid: std::process::id(),
            boot,
        };
        let path = lbagent_shm::region_path(&prefix, i);
        match Region::create(&path, geometry, identity, access) {
            Ok(r) => made.push(r),
            Err(e) if e.is_no_space() => {
                tracing::warn!(
                    "shared memory is off for this run: {e}; regions of up to {} bytes a shard are needed in \
                     shm.dir = {}; clients use UDP (free space there, or lower [shm] slots, \
                     and restart the agent to offer shared memory again)",
                    geometry.file_len(),
                    config.shm.dir.display()
                );
                for r in made.drain(..) {
                    let _ = std::fs::remove_file(r.path());
                }
                return Ok(Vec::new());
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "cannot create shard {i}'s region in shm.dir = {}",
                        config.shm.dir.display()
                    )
                })
            }
        }
    }
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn shards_default_to_one_per_core_but_the_control_core_and_at_least_one() {
        assert_eq!(shard_count(0, 16), 15);
        assert_eq!(shard_count(0, 2), 1);
        assert_eq!(shard_count(0, 1), 1);
        assert_eq!(shard_count(0, 0), 1);
        assert_eq!(shard_count(4, 2), 4);
    }

    #[test]
    fn every_shard_socket_gets_the_receive_buffer_asked() {
        let sockets = bind_shards(std::net::Ipv4Addr::LOCALHOST, 0, 3).unwrap();
        size_receive_buffers(&sockets, 16_384).unwrap();
        for s in &sockets {
            // Linux doubles it (16 KiB is under any rmem_max).
            assert_eq!(lbagent_host::udp::rcvbuf(s.as_raw_fd()).unwrap(), 32_768);
        }
    }
}
