//! The control core: everything that is not a getHost or a report. It owns
//! the route client, the statistics path to the reporter, the heartbeat, the
//! route snapshot and the metrics endpoint, and keeps its own copy of every
//! route it received (so a snapshot never asks the shards).
//!
//! It talks to the shards only through the SPSC rings; it must not touch a
//! shard's state.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::net::TcpListener as StdTcpListener;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::channels::local_channel;
use glommio::channels::shared_channel::{ConnectedSender, SharedReceiver, SharedSender};
use glommio::net::{TcpListener, TcpStream};

use super::messages::{ToControl, ToShard};
use super::metrics::{render, ControlMetrics, ShardMetrics};
use super::route_table::RouteTable;
use super::routeclient::{self, RouteClientConfig, RouteClientEvent, RouteClientStatus, Want};
use super::shard_rt;
use super::snapshot_thread::SnapshotThread;
use super::statsclient::{self, StatsClientConfig, StatsClientEvent, StatsClientStatus};
use super::wake;
use lbagent_host::clock;
use lbagent_host::heartbeat::HeartbeatWriter;
use lbagent_host::snapshot::{self, SnapshotIndex, SnapshotRoute};
use lbagent_lb::NodeCallStats;
use lbagent_model::ModuleId;
use lbagent_service::logging::{self, Verdict};
use lbagent_service::metrics_http;

/// Everything the control executor needs, built on the main thread.
pub struct ControlParts {
    /// Number of shards.
    pub shards: u32,
    /// The route client's settings.
    pub route_client: RouteClientConfig,
    /// The statistics client's settings.
    pub stats_client: StatsClientConfig,
    /// Shard → control rings, one per shard.
    pub from_shards: Vec<SharedReceiver<ToControl>>,
    /// Control → shard rings, one per shard.
    pub to_shards: Vec<SharedSender<ToShard>>,
    /// Shard metrics rings, one per shard.
    pub metrics_in: Vec<SharedReceiver<Box<ShardMetrics>>>,
    /// The snapshot the agent started from (shared with the shards). Once
    /// the agent serves, the control core makes its routes its table and
    /// subscribes to their modules, in slices; then it lets go of it.
    pub snapshot: Option<Arc<SnapshotIndex>>,
    /// The heartbeat file, created by the caller.
    pub heartbeat: HeartbeatWriter,
    /// The static route file (written by its own thread).
    pub snapshot_path: PathBuf,
    /// Seconds between snapshots.
    pub snapshot_interval: Duration,
    /// The metrics listener, bound by the caller.
    pub metrics_listener: StdTcpListener,
    /// Set when the agent shuts down.
    pub stop: Arc<AtomicBool>,
    /// Counts the main loop's turns (the systemd watchdog).
    pub beat: super::liveness::Beat,
    /// Shards ready to serve; the first heartbeat waits for all of them, so
    /// that a client that sees a beat gets an answer.
    pub ready: Arc<AtomicU32>,
    /// Reloaded configurations to apply (SIGHUP).
    pub live: super::live::LiveSlot,
    /// The main loop's longest sleep while serving
    /// ([`super::liveness::idle_tick`]): its look at the reload slot (set
    /// by another thread), and a turn for the liveness watchdog. The stop
    /// flag needs no poll: the shards stop first and their `Drained` wakes
    /// the loop (this tick is the fallback).
    pub idle_tick: Duration,
}

/// How often a link that stays down (connection attempts failing) is
/// logged again, with the count of the attempts in between.
const RELOG_MS: u64 = 60_000;

/// How often the main loop looks whether every shard is ready while they
/// start (the first heartbeat waits for them).
const STARTING_POLL: Duration = Duration::from_millis(5);

/// Between two heartbeats.
const BEAT_EVERY: Duration = Duration::from_secs(1);

/// Between two attempts to hand the backlog to a full ring.
const BACKLOG_RETRY: Duration = Duration::from_millis(10);

/// How long shutdown waits for the final snapshot to be written.
const SNAPSHOT_FINAL_WAIT: Duration = Duration::from_secs(5);

/// Nodes of snapshot routes the control core takes into its table per
/// turn (well under a millisecond of work, whatever the routes' size).
const FILL_NODES: usize = 32_768;

struct State {
    routes: RouteTable,
    shard_metrics: Vec<ShardMetrics>,
    control: ControlMetrics,
    /// Route messages waiting for room in a shard's ring.
    backlog: Vec<VecDeque<ToShard>>,
    /// Wakes the task that retries the backlog.
    backlog_wake: local_channel::LocalSender<()>,
    last_beat: Instant,
}

/// Runs the control core until `stop` is set, then writes the final
/// snapshot and flushes the statistics. Call inside its glommio executor.
pub async fn run(parts: ControlParts) {
    let ControlParts {
        shards,
        route_client,
        stats_client,
        from_shards,
        to_shards,
        metrics_in,
        snapshot,
        heartbeat,
        snapshot_path,
        snapshot_interval,
        metrics_listener,
        stop,
        beat,
        ready,
        live,
        idle_tick,
    } = parts;
    let mut snapshot_interval = snapshot_interval;
    // The snapshot's routes become our table, and its modules are
    // subscribed to, once the agent serves (below).
    let routes = snapshot.map_or_else(RouteTable::new, RouteTable::from_snapshot);
    let (backlog_tx, backlog_rx) = local_channel::new_bounded::<()>(1);
    let state = Rc::new(RefCell::new(State {
        backlog_wake: backlog_tx,
        routes,
        shard_metrics: (0..shards).map(ShardMetrics::new).collect(),
        control: ControlMetrics::default(),
        backlog: (0..shards).map(|_| VecDeque::new()).collect(),
        last_beat: Instant::now(),
    }));

    // The route client stops when the main loop, the one place that looks
    // at the stop flag, drops this sender (no timer of its own).
    let (route_stop_tx, route_stop_rx) = local_channel::new_bounded::<()>(1);
    let stopped = async move {
        let _ = route_stop_rx.recv().await;
    };

    // The route client, fed by the shards' pulls and forgets.
    let (wants_tx, wants_rx) = local_channel::new_unbounded::<Want>();
    let (events_tx, events_rx) = local_channel::new_bounded::<RouteClientEvent>(1024);
    let route_status = RouteClientStatus::default();
    let route_task = glommio::spawn_local(routeclient::run(
        route_client,
        wants_rx,
        events_tx,
        stopped,
        route_status.clone(),
    ));
    // The statistics client, fed by the shards' statistics.
    let (stats_tx, stats_rx) = local_channel::new_unbounded::<(ModuleId, Vec<NodeCallStats>)>();
    let (stats_events_tx, stats_events_rx) = local_channel::new_bounded::<StatsClientEvent>(1024);
    let stats_status = StatsClientStatus::default();
    // The statistics client stops only once every shard has handed over
    // what it held (or FLUSH_WAIT passed), so that SIGTERM loses nothing
    // that was counted.
    let drained = Rc::new(Cell::new(0u32));
    // It stops when this sender is dropped.
    let (stats_stop_tx, stats_stop_rx) = local_channel::new_bounded::<()>(1);
    let stats_stopped = async move {
        let _ = stats_stop_rx.recv().await;
    };
    let stats_task = glommio::spawn_local(statsclient::run(
        stats_client,
        stats_rx,
        stats_events_tx,
        stats_stopped,
        stats_status.clone(),
    ));

    let wants_tx = Rc::new(wants_tx);
    let stats_tx = Rc::new(stats_tx);
    // The shards stop first (the stop flag wakes them) and each says
    // Drained: that wakes the main loop at once, instead of a short poll
    // of the flag.
    let (stop_wake_tx, stop_wake_rx) = local_channel::new_bounded::<()>(1);
    let stop_wake_tx = Rc::new(stop_wake_tx);
    let mut tasks = Vec::new();
    for rx in from_shards {
        let wants_tx = wants_tx.clone();
        let stats_tx = stats_tx.clone();
        let state = state.clone();
        let drained = drained.clone();
        let stop_wake_tx = stop_wake_tx.clone();
        tasks.push(glommio::spawn_local(async move {
            let rx = rx.connect().await;
            while let Some(msg) = rx.recv().await {
                match msg {
                    ToControl::Pull(m) => {
                        let _ = wants_tx.try_send(Want::Pull(m));
                    }
                    ToControl::Forget(m) => {
                        let mut st = state.borrow_mut();
                        st.routes.forget(m);
                        st.control.modules_forgotten += 1;
                        let _ = wants_tx.try_send(Want::Forget(m));
                    }
                    ToControl::Stats { module, nodes } => {
                        let _ = stats_tx.try_send((module, nodes));
                    }
                    ToControl::Drained => {
                        drained.set(drained.get() + 1);
                        let _ = stop_wake_tx.try_send(());
                    }
                }
            }
        }));
    }
    for rx in metrics_in {
        let state = state.clone();
        tasks.push(glommio::spawn_local(async move {
            let rx = rx.connect().await;
            while let Some(m) = rx.recv().await {
                let mut st = state.borrow_mut();
                let i = m.shard as usize;
                if i < st.shard_metrics.len() {
                    st.shard_metrics[i] = *m;
                }
            }
        }));
    }

    // Connect the rings to the shards only now: a shard connects its
    // sending side first, which waits for the receivers spawned above.
    let mut senders = Vec::new();
    for s in to_shards {
        senders.push(Rc::new(s.connect().await));
    }
    let senders = Rc::new(senders);

    // Routes from the route server go to their shards (and our table).
    tasks.push({
        let state = state.clone();
        let senders = senders.clone();
        glommio::spawn_local(async move {
            // A reconnect loop logs its state changes, and while the server
            // stays unreachable one line per RELOG_MS with the count.
            let mut link = logging::Gate::new(RELOG_MS);
            while let Some(ev) = events_rx.recv().await {
                match ev {
                    RouteClientEvent::Route(r) => {
                        let mut st = state.borrow_mut();
                        st.control.routes_received += 1;
                        let held = if r.exists { r.nodes.clone() } else { Vec::new() };
                        st.routes.set(r.module, r.version, held);
                        let shard = r.module.shard(shards) as usize;
                        let msg = ToShard::Route { module: r.module, exists: r.exists, version: r.version, nodes: r.nodes, policy: r.policy };
                        deliver(&mut st, &senders, shard, msg);
                    }
                    RouteClientEvent::ServerError(e) => {
                        tracing::warn!("route server refused a request: {} ({:?}) for {}", e.message, e.retcode, e.module);
                    }
                    RouteClientEvent::Connected(addr) => {
                        let n = link.check(true, clock::now_ms()).suppressed();
                        tracing::info!("connected to route server {addr}{}", logging::left_out(n));
                    }
                    RouteClientEvent::ConnectFailed { addr, error } => {
                        if let Verdict::Log { suppressed } = link.check(false, clock::now_ms()) {
                            tracing::warn!("cannot connect to route server {addr}: {error}; retrying with back-off{}", logging::left_out(suppressed));
                        }
                    }
                    RouteClientEvent::Disconnected { addr, error } => {
                        let n = link.check(false, clock::now_ms()).suppressed();
                        tracing::warn!("lost route server {addr}: {error}; pulls in flight will be re-issued{}", logging::left_out(n));
                    }
                }
            }
        })
    });
    tasks.push(glommio::spawn_local(async move {
        // As for the route server: the link's state changes, and a line per
        // RELOG_MS (with the count) while it stays down or keeps dropping.
        let mut link = logging::Gate::new(RELOG_MS);
        let mut trouble = logging::Gate::new(RELOG_MS);
        while let Some(ev) = stats_events_rx.recv().await {
            let now = clock::now_ms();
            match &ev {
                StatsClientEvent::Connected(_) => {
                    let n = link.check(true, now).suppressed();
                    tracing::info!("reporter: {ev}{}", logging::left_out(n));
                }
                StatsClientEvent::ConnectFailed { .. } => {
                    if let Verdict::Log { suppressed } = link.check(false, now) {
                        tracing::warn!("reporter: {ev}{}", logging::left_out(suppressed));
                    }
                }
                StatsClientEvent::Disconnected { .. } => {
                    let n = link.check(false, now).suppressed();
                    tracing::warn!("reporter: {ev}{}", logging::left_out(n));
                }
                StatsClientEvent::Dropped { .. } | StatsClientEvent::ServerError(_) => {
                    let kind = matches!(ev, StatsClientEvent::Dropped { .. });
                    if let Verdict::Log { suppressed } = trouble.check(kind, now) {
                        tracing::warn!("reporter: {ev}{}", logging::left_out(suppressed));
                    }
                }
            }
        }
    }));

    // Ring back-pressure: retry what did not fit, every BACKLOG_RETRY while
    // a backlog exists (deliver rings this task's doorbell when it starts
    // one); nothing at all while there is none.
    tasks.push({
        let state = state.clone();
        let senders = senders.clone();
        glommio::spawn_local(async move {
            while backlog_rx.recv().await.is_some() {
                loop {
                    glommio::timer::sleep(BACKLOG_RETRY).await;
                    let mut st = state.borrow_mut();
                    for shard in 0..st.backlog.len() {
                        while let Some(msg) = st.backlog[shard].pop_front() {
                            if let Err(e) = senders[shard].try_send(msg) {
                                match into_inner(e) {
                                    Some(msg) => st.backlog[shard].push_front(msg),
                                    None => st.backlog[shard].clear(),
                                }
                                break;
                            }
                        }
                    }
                    if st.backlog.iter().all(VecDeque::is_empty) {
                        break;
                    }
                }
            }
        })
    });

    // Metrics endpoint.
    let listener_fd = metrics_listener.into_raw_fd();
    // SAFETY: a bound, listening TCP socket that we own.
    let listener = unsafe { TcpListener::from_raw_fd(listener_fd) };
    tasks.push({
        let state = state.clone();
        let route_status = route_status.clone();
        let stats_status = stats_status.clone();
        glommio::spawn_local(async move {
            // Connections being served; past metrics_http::MAX_CONNECTIONS
            // one more is told so and closed (each closes by itself at
            // metrics_http::REQUEST_TIMEOUT, so silent ones cannot pile up).
            let open = Rc::new(Cell::new(0usize));
            while let Ok(mut stream) = listener.accept().await {
                if open.get() >= metrics_http::MAX_CONNECTIONS {
                    glommio::spawn_local(async move {
                        let _ = glommio::timer::timeout(metrics_http::REQUEST_TIMEOUT, async {
                            Ok(stream.write_all(metrics_http::BUSY_RESPONSE).await?)
                        })
                        .await;
                        let _ = stream.close().await;
                    })
                    .detach();
                    continue;
                }
                let body = {
                    let mut st = state.borrow_mut();
                    refresh_control(&mut st, &route_status, &stats_status);
                    render(&st.shard_metrics, &st.control)
                        + &lbagent_service::reload::metrics_text()
                };
                open.set(open.get() + 1);
                let open = open.clone();
                glommio::spawn_local(async move {
                    serve_metrics(stream, body).await;
                    open.set(open.get() - 1);
                })
                .detach();
            }
        })
    });

    // Heartbeat every second, snapshot every interval, until stop. The
    // snapshot is written by its own thread: a slow disk never delays the
    // heartbeat, a route or the metrics.
    let snapshots = SnapshotThread::spawn(move |routes: &[SnapshotRoute]| {
        snapshot::write(&snapshot_path, clock::unix_ms() / 1000, routes).map_err(|e| e.to_string())
    });
    let mut last_snapshot = Instant::now();
    let mut serving = false;
    while !stop.load(Ordering::Relaxed) {
        if !serving && ready.load(Ordering::SeqCst) >= shards {
            // Every shard reads its socket: clients may come now.
            serving = true;
            heartbeat.beat(clock::unix_ms());
            state.borrow_mut().last_beat = Instant::now();
            if state.borrow().routes.filling() {
                tasks.push(glommio::spawn_local(fill_table(
                    state.clone(),
                    wants_tx.clone(),
                )));
            }
        }
        let sleep = {
            let st = state.borrow();
            // At least the poll: a zero interval must not spin the loop.
            let interval = snapshot_interval.max(idle_tick);
            wake::control_sleep(
                serving.then(|| BEAT_EVERY.saturating_sub(st.last_beat.elapsed())),
                (!st.routes.filling()).then(|| interval.saturating_sub(last_snapshot.elapsed())),
                idle_tick,
                (!serving).then_some(STARTING_POLL),
            )
        };
        let _ = glommio::timer::timeout(sleep, async {
            let _ = stop_wake_rx.recv().await;
            Ok(())
        })
        .await;
        beat.beat();
        let mut st = state.borrow_mut();
        if let Some(update) = live.take() {
            // A reload: every shard gets the parameters through its ring
            // (queued behind the routes already waiting), the clients their
            // new lists.
            for shard in 0..senders.len() {
                deliver(
                    &mut st,
                    &senders,
                    shard,
                    ToShard::Params(update.shard.clone()),
                );
            }
            if let Some(addrs) = update.route_servers {
                route_status.set_addrs(addrs);
            }
            route_status.set_refresh_ms(update.shard.update_timeout_ms);
            if let Some(addrs) = update.reporters {
                stats_status.set_addrs(addrs);
            }
            snapshot_interval = update.snapshot_interval;
        }
        if serving && st.last_beat.elapsed() >= BEAT_EVERY {
            heartbeat.beat(clock::unix_ms());
            st.last_beat = Instant::now();
        }
        let (written, failed) = snapshots.counts();
        st.control.snapshots_written = written;
        st.control.snapshot_errors = failed;
        // Not while the table is still being filled from the snapshot: the
        // file would lose the routes not yet taken.
        if last_snapshot.elapsed() >= snapshot_interval && !st.routes.filling() {
            last_snapshot = Instant::now();
            if !snapshots.offer(st.routes.snapshot_routes()) {
                st.control.snapshots_skipped += 1;
            }
        }
    }

    // The route client may stop now.
    drop(route_stop_tx);
    // Shutdown: every shard hands over its statistics and says Drained
    // (each waits at most FLUSH_WAIT for room in its ring); then the stats
    // client makes one bounded attempt to deliver everything, and the
    // route client finishes; then the final snapshot.
    let t0 = Instant::now();
    while drained.get() < shards && t0.elapsed() < shard_rt::FLUSH_WAIT + Duration::from_millis(200)
    {
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
    if drained.get() < shards {
        tracing::warn!(
            "{} of {shards} shards did not hand over their statistics in time",
            shards - drained.get()
        );
    }
    // Let the shards' rings be read to the end before the clients stop.
    glommio::yield_if_needed().await;
    drop(stats_stop_tx);
    drop(wants_tx);
    drop(stats_tx);
    let _ = route_task.await;
    let _ = stats_task.await;
    let routes = {
        let mut st = state.borrow_mut();
        // Stopped before the table was filled: take the rest now (no
        // subscription any more), so the file keeps every route.
        st.routes.fill_step(usize::MAX, |_| {});
        st.routes.snapshot_routes()
    };
    if !snapshots.finish(routes, SNAPSHOT_FINAL_WAIT) {
        tracing::warn!(
            "the final route snapshot was not written within {} s (slow disk?); the last one written stays",
            SNAPSHOT_FINAL_WAIT.as_secs()
        );
    }
    for t in tasks {
        drop(t);
    }
}

/// Sends a route to its shard, or queues it when the ring is full.
fn deliver(st: &mut State, senders: &[Rc<ConnectedSender<ToShard>>], shard: usize, msg: ToShard) {
    if !st.backlog[shard].is_empty() {
        st.backlog[shard].push_back(msg);
        return;
    }
    if let Err(e) = senders[shard].try_send(msg) {
        st.control.ring_drops += 1;
        if let Some(msg) = into_inner(e) {
            st.backlog[shard].push_back(msg);
            // Full: the task is already awake.
            let _ = st.backlog_wake.try_send(());
        }
    }
}

fn into_inner<T>(e: glommio::GlommioError<T>) -> Option<T> {
    match e {
        glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(t)) => Some(t),
        _ => None,
    }
}

fn refresh_control(st: &mut State, route: &RouteClientStatus, stats: &StatsClientStatus) {
    st.control.route_server = route.connected().map(|a| a.to_string());
    st.control.pulls_sent = route.stats().modules_pulled;
    st.control.reporter = stats.connected().map(|a| a.to_string());
    let s = stats.stats();
    st.control.stats_sent = s.acked;
    st.control.stats_dropped = s.dropped;
    st.control.heartbeat_age_s = st.last_beat.elapsed().as_secs_f64();
}

/// Takes the snapshot's routes into the table, [`FILL_NODES`] a turn, and
/// subscribes to their modules with no version held: the snapshot keeps no
/// module policy, so the first answer must be a whole route (a `balance`
/// module would otherwise stay `l5` for as long as its route is
/// unchanged). Re-pulls after that carry the version.
async fn fill_table(state: Rc<RefCell<State>>, wants_tx: Rc<local_channel::LocalSender<Want>>) {
    while state.borrow_mut().routes.fill_step(FILL_NODES, |m| {
        let _ = wants_tx.try_send(Want::Pull(m));
    }) {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

/// Answers one HTTP request: `GET /metrics` gets the text, anything else 404.
async fn serve_metrics(mut stream: TcpStream, body: String) {
    let mut req = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    let deadline = Instant::now() + metrics_http::REQUEST_TIMEOUT;
    while !metrics_http::head_complete(&req) && Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        let read = glommio::timer::timeout(left, async { Ok(stream.read(&mut buf).await?) }).await;
        match read {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let resp = metrics_http::response(&req, || body);
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = glommio::timer::timeout(left.max(Duration::from_millis(100)), async {
        Ok(stream.write_all(resp.as_bytes()).await?)
    })
    .await;
    let _ = stream.close().await;
}
