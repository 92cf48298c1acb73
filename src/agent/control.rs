//! The control core: everything that is not a getHost or a report. It owns
//! the route client, the statistics path to the reporter, the heartbeat, the
//! route snapshot and the metrics endpoint, and keeps its own copy of every
//! route it received (so a snapshot never asks the shards).
//!
//! It talks to the shards only through the SPSC rings; it must not touch a
//! shard's state. This file is the glommio shell; what to do on each event
//! is [`super::control_core`]'s.

use std::cell::{Cell, RefCell};
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

use super::control_core::{ControlCore, Forward, Links, Log, Refused, ShardRings, FILL_NODES};
use super::messages::{ToControl, ToShard};
use super::metrics::{render, ShardMetrics};
use super::routeclient::{self, RouteClientConfig, RouteClientEvent, RouteClientStatus, Want};
use super::shard_rt;
use super::snapshot_thread::SnapshotThread;
use super::statsclient::{self, StatsClientConfig, StatsClientEvent, StatsClientStatus};
use lbagent_host::clock;
use lbagent_host::heartbeat::HeartbeatWriter;
use lbagent_host::snapshot::{self, SnapshotIndex, SnapshotRoute};
use lbagent_lb::NodeCallStats;
use lbagent_model::ModuleId;
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
    /// Each shard's doorbell, rung after a message is queued for it.
    pub bells: Vec<super::bell::ShardBell>,
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

/// Between two attempts to hand the backlog to a full ring.
const BACKLOG_RETRY: Duration = Duration::from_millis(10);

/// How long shutdown waits for the final snapshot to be written.
const SNAPSHOT_FINAL_WAIT: Duration = Duration::from_secs(5);

/// The control → shard rings over glommio's senders, each with its
/// shard's doorbell (rung on `socket` after a message is queued).
struct Rings {
    senders: Vec<ConnectedSender<ToShard>>,
    bells: Vec<super::bell::ShardBell>,
    socket: Option<std::net::UdpSocket>,
}

impl ShardRings for Rings {
    fn try_send(&self, shard: usize, msg: ToShard) -> Result<(), Refused> {
        let sent = self.senders[shard].try_send(msg);
        if sent.is_ok() {
            if let (Some(bell), Some(socket)) = (self.bells.get(shard), &self.socket) {
                bell.ring(socket);
            }
        }
        sent.map_err(|e| match e {
            glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(msg)) => {
                Refused::Full(msg)
            }
            _ => Refused::Closed,
        })
    }
}

/// Runs the control core until `stop` is set, then writes the final
/// snapshot and flushes the statistics. Call inside its glommio executor.
/// Every decision is [`ControlCore`]'s; this loop gathers its events
/// (rings, client events, the clock, the reload slot) and performs what
/// it returns.
pub async fn run(parts: ControlParts) {
    let ControlParts {
        shards,
        route_client,
        stats_client,
        from_shards,
        to_shards,
        metrics_in,
        bells,
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
    // The snapshot's routes become the core's table, and its modules are
    // subscribed to, once the agent serves (below).
    let core = Rc::new(RefCell::new(ControlCore::new(
        shards,
        snapshot,
        snapshot_interval,
        idle_tick,
        Instant::now(),
    )));
    // Wakes the task that retries the backlog (when the core says one
    // began).
    let (backlog_tx, backlog_rx) = local_channel::new_bounded::<()>(1);
    let backlog_tx = Rc::new(backlog_tx);

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
    // that was counted. It stops when this sender is dropped.
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
        let core = core.clone();
        let stop_wake_tx = stop_wake_tx.clone();
        tasks.push(glommio::spawn_local(async move {
            let rx = rx.connect().await;
            while let Some(msg) = rx.recv().await {
                let forward = core.borrow_mut().shard_message(msg);
                match forward {
                    Forward::Want(w) => {
                        let _ = wants_tx.try_send(w);
                    }
                    Forward::Stats(module, nodes) => {
                        let _ = stats_tx.try_send((module, nodes));
                    }
                    Forward::Drained => {
                        let _ = stop_wake_tx.try_send(());
                    }
                    Forward::Log(line) => log(Some(line)),
                }
            }
        }));
    }
    for rx in metrics_in {
        let core = core.clone();
        tasks.push(glommio::spawn_local(async move {
            let rx = rx.connect().await;
            while let Some(m) = rx.recv().await {
                core.borrow_mut().shard_metrics_in(*m);
            }
        }));
    }

    // Connect the rings to the shards only now: a shard connects its
    // sending side first, which waits for the receivers spawned above.
    let mut senders = Vec::new();
    for s in to_shards {
        senders.push(s.connect().await);
    }
    // The doorbells go out from one socket of the control core's own,
    // bound to the shards' address (ShardBell::socket); without it (no
    // socket to be had) a shard waiting on its socket takes its messages
    // when the wait ends (park.rs's POLL_PARK).
    let socket = bells
        .first()
        .map(|b| b.socket())
        .transpose()
        .map_err(|e| tracing::warn!("no doorbell socket for the shards ({e}): a route reaches a shard waiting on its socket within a few milliseconds"))
        .ok()
        .flatten();
    let rings = Rc::new(Rings {
        senders,
        bells,
        socket,
    });

    // Routes from the route server go to their shards (and the table).
    tasks.push({
        let core = core.clone();
        let rings = rings.clone();
        let backlog_tx = backlog_tx.clone();
        glommio::spawn_local(async move {
            while let Some(ev) = events_rx.recv().await {
                let (line, retry) = core.borrow_mut().route_event(ev, clock::now_ms(), &*rings);
                if retry {
                    // Full: the task is already awake.
                    let _ = backlog_tx.try_send(());
                }
                log(line);
            }
        })
    });
    tasks.push({
        let core = core.clone();
        glommio::spawn_local(async move {
            while let Some(ev) = stats_events_rx.recv().await {
                let line = core.borrow_mut().stats_event(&ev, clock::now_ms());
                log(line);
            }
        })
    });

    // Ring back-pressure: retry what did not fit, every BACKLOG_RETRY while
    // a backlog exists (the core says when one begins, and this task's
    // doorbell rings); nothing at all while there is none.
    tasks.push({
        let core = core.clone();
        let rings = rings.clone();
        glommio::spawn_local(async move {
            while backlog_rx.recv().await.is_some() {
                loop {
                    glommio::timer::sleep(BACKLOG_RETRY).await;
                    if !core.borrow_mut().retry_backlog(&*rings) {
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
        let core = core.clone();
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
                    let mut c = core.borrow_mut();
                    let links = links(&route_status, &stats_status);
                    let (shard_metrics, control) = c.metrics(links, Instant::now());
                    render(shard_metrics, control) + &lbagent_service::reload::metrics_text()
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
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        // Every shard reads its socket: clients may come now.
        let start = core
            .borrow_mut()
            .start_serving(ready.load(Ordering::SeqCst), now);
        if let Some(serving) = start {
            heartbeat.beat(clock::unix_ms());
            if serving.fill {
                tasks.push(glommio::spawn_local(fill_table(
                    core.clone(),
                    wants_tx.clone(),
                )));
            }
        }
        let sleep = core.borrow().sleep(Instant::now());
        let _ = glommio::timer::timeout(sleep, async {
            let _ = stop_wake_rx.recv().await;
            Ok(())
        })
        .await;
        beat.beat();
        let actions =
            core.borrow_mut()
                .turn(Instant::now(), live.take(), snapshots.counts(), &*rings);
        if let Some(addrs) = actions.route_servers {
            route_status.set_addrs(addrs);
        }
        if let Some(ms) = actions.refresh_ms {
            route_status.set_refresh_ms(ms);
        }
        if let Some(addrs) = actions.reporters {
            stats_status.set_addrs(addrs);
        }
        if actions.retry {
            let _ = backlog_tx.try_send(());
        }
        if actions.beat {
            heartbeat.beat(clock::unix_ms());
        }
        if let Some(routes) = actions.snapshot {
            if !snapshots.offer(routes) {
                core.borrow_mut().snapshot_skipped();
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
    let drained = || core.borrow().drained();
    while drained() < shards && t0.elapsed() < shard_rt::FLUSH_WAIT + Duration::from_millis(200) {
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
    if drained() < shards {
        tracing::warn!(
            "{} of {shards} shards did not hand over their statistics in time",
            shards - drained()
        );
    }
    // Let the shards' rings be read to the end before the clients stop.
    glommio::yield_if_needed().await;
    drop(stats_stop_tx);
    drop(wants_tx);
    drop(stats_tx);
    let _ = route_task.await;
    let _ = stats_task.await;
    // Stopped before the table was filled: the rest is taken now, so the
    // file keeps every route.
    let routes = core.borrow_mut().final_routes();
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

/// Writes a line the core decided on.
fn log(line: Option<Log>) {
    match line {
        Some(Log::Info(line)) => tracing::info!("{line}"),
        Some(Log::Warn(line)) => tracing::warn!("{line}"),
        None => {}
    }
}

/// The links' figures for the metrics page, from the clients' statuses.
fn links(route: &RouteClientStatus, stats: &StatsClientStatus) -> Links {
    let s = stats.stats();
    Links {
        route_server: route.connected(),
        pulls_sent: route.stats().modules_pulled,
        reporter: stats.connected(),
        stats_sent: s.acked,
        stats_dropped: s.dropped,
    }
}

/// Takes the snapshot's routes into the table, [`FILL_NODES`] a turn, and
/// subscribes to their modules with no version held: the snapshot keeps no
/// module policy, so the first answer must be a whole route (a `balance`
/// module would otherwise stay `l5` for as long as its route is
/// unchanged). Re-pulls after that carry the version.
async fn fill_table(
    core: Rc<RefCell<ControlCore>>,
    wants_tx: Rc<local_channel::LocalSender<Want>>,
) {
    while core.borrow_mut().fill_step(FILL_NODES, |m| {
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
