//! The route server ("dnsserver"): every route in memory, pulls answered
//! and changes pushed over TCP, the store polled in the background.
//!
//! # Layout
//!
//! - [`table`]: the route table, immutable, with each module's answer and
//!   push frames encoded once per version; full-reload and change-log
//!   diffs. Pure.
//! - [`module_map`]: the table's persistent module map: a change copies
//!   the path to the changed modules, nothing else. Pure.
//! - [`subs`]: one executor's connections, their subscriptions and the
//!   idle supervisor (one low-precision timer for every timeout). Pure.
//! - [`session`]: one connection's protocol: bytes in, answers out. Pure.
//! - [`reload`]: the store poller (pure but for the store it is given) and
//!   the thread that runs it.
//! - [`updates`]: the store thread's changes on their way to the serving
//!   executors, and the doorbell that wakes them.
//! - `serve`: the glommio shell of one serving executor (private).
//! - [`metrics`]: counters, the Prometheus text and its endpoint.
//!
//! # Threads
//!
//! `dnsserver.threads` glommio executors, pinned to cores, each accepting
//! on its own handle (a `dup`) of one listening socket, so that no
//! connection is handed between threads; the socket has no
//! `SO_REUSEPORT`, so another process cannot bind the same port ("address
//! in use"); one store thread; one metrics thread.
//!
//! # Bounds
//!
//! `dnsserver.max_connections` connections and `dnsserver.max_subscriptions`
//! subscriptions across executors (shared [`subs::Budget`]s), at most
//! `dnsserver.max_subscriptions_per_connection` per connection; past one, a
//! clear ErrorResp `Unavailable` and a counter, while everything already
//! held keeps being served. A connection is closed after
//! `dnsserver.idle_timeout` seconds without a complete frame, so bytes that
//! never make a frame do not keep it open. The store thread builds each new table and sends it, with the
//! changed modules, to every executor over a channel ([`updates`]) that
//! wakes the executor to drain it at once: executors never wait for the
//! store, and each
//! switches table and queues the matching pushes at the same instant, so a
//! connection never sees an answer newer than the push that follows it.
//!
//! # When the store is unreachable
//!
//! At start, [`DnsServer::start`] waits up to 5 s for the first load. A
//! store URL that cannot be used or a schema newer than this binary fails
//! the start. A store that does not answer does not: the server starts
//! without routes, logs it, shows `lbagent_dnsserver_store_up 0` and
//! `lbagent_dnsserver_routes_loaded 0`, and holds every pull (the
//! connection is subscribed, nothing is answered — an agent keeps the
//! routes it has rather than hear "no such module"); the first load pushes
//! every held module to the connections that asked. Once routes are
//! loaded, a store that stops answering changes nothing for the agents:
//! the last routes are served, one log line says so (and one when it
//! answers again), and every failed poll is counted.
//!
//! Several route servers may poll one store: nothing in the store belongs
//! to an instance.
#![warn(missing_docs)]

pub mod metrics;
pub mod module_map;
pub mod reload;
mod serve;
pub mod session;
pub mod subs;
pub mod table;
pub mod updates;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use glommio::{ExecutorJoinHandle, LocalExecutorBuilder, Placement};

use lbagent_config::DnsServerConfig;
use lbagent_service::wakefd::StopEvent;
use lbagent_store::{StoreError, StoreUrl};
use lbagent_tls::Tls;
use metrics::Board;
pub use reload::StoreOpener;
use reload::{Intervals, Poller};
use subs::Budget;
use updates::Doorbell;

/// How long a start waits for the first load before serving without it.
pub const START_WAIT: Duration = Duration::from_secs(5);

/// How long a stop waits for the store thread to finish a store call.
const STORE_STOP_WAIT: Duration = Duration::from_secs(15);

/// How long a start waits for its ports to be released by a predecessor.
const PORT_WAIT: Duration = Duration::from_secs(3);

/// A running route server.
pub struct DnsServer {
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    board: Arc<Board>,
    /// The metrics thread's stop (it waits in `poll` on its descriptor).
    stop: Arc<StopEvent>,
    /// Each executor's stop: a ring wakes its tick at once.
    exec_stops: Vec<Arc<Doorbell>>,
    executors: Vec<ExecutorJoinHandle<()>>,
    store_thread: Option<(JoinHandle<()>, mpsc::Sender<()>)>,
    metrics_thread: Option<JoinHandle<()>>,
}

impl DnsServer {
    /// Starts the route server of `cfg` on the store at `store`.
    ///
    /// Binds `cfg.listen` (port 0: a free port, see [`Self::addr`]) on
    /// every executor and `cfg.metrics_addr`, loads the routes (waiting at
    /// most [`START_WAIT`]; see the module docs for a store that does not
    /// answer), then serves.
    ///
    /// # Errors
    /// A configuration value out of range, an address that cannot be
    /// bound, an executor that cannot start (often `ulimit -l` against
    /// `dnsserver.io_memory_kib`), a bad store URL, or a store schema newer
    /// than this binary.
    pub fn start(cfg: &DnsServerConfig, store: StoreUrl) -> anyhow::Result<DnsServer> {
        DnsServer::start_tls(cfg, store, None)
    }

    /// [`Self::start`], serving mutual TLS with `tls` (plain TCP when
    /// `None`).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_tls(
        cfg: &DnsServerConfig,
        store: StoreUrl,
        tls: Option<Arc<Tls>>,
    ) -> anyhow::Result<DnsServer> {
        let label = store.to_string();
        // Only the first open may create a SQLite file: a file deleted
        // later is reported, never silently replaced by an empty one.
        let mut opened = false;
        let open = move || {
            let result = if opened {
                lbagent_store::open_existing(&store)
            } else {
                lbagent_store::open(&store)
            };
            opened |= result.is_ok();
            result
        };
        DnsServer::start_with_tls(cfg, label, Box::new(open), tls)
    }

    /// [`Self::start`] on a store reached through `open` (`label` names it
    /// in logs; never put a password in it). Tests use it to put a store
    /// that can fail on demand behind the server.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_with(
        cfg: &DnsServerConfig,
        label: String,
        open: StoreOpener,
    ) -> anyhow::Result<DnsServer> {
        DnsServer::start_with_tls(cfg, label, open, None)
    }

    /// [`Self::start_with`], serving mutual TLS with `tls` (plain TCP when
    /// `None`).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_with_tls(
        cfg: &DnsServerConfig,
        label: String,
        open: StoreOpener,
        tls: Option<Arc<Tls>>,
    ) -> anyhow::Result<DnsServer> {
        check(cfg)?;
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = if cfg.threads == 0 {
            ncpu
        } else {
            cfg.threads as usize
        };
        let listeners = retry_in_use(|| bind_all(cfg.listen, threads))
            .map_err(|e| in_use_named(e, "dnsserver.listen", cfg.listen))?;
        let addr = listeners[0].local_addr()?;
        let metrics = retry_in_use(|| TcpListener::bind(cfg.metrics_addr))
            .map_err(|e| in_use_named(e, "dnsserver.metrics_addr", cfg.metrics_addr))?;
        metrics.set_nonblocking(true)?;
        let metrics_addr = metrics.local_addr()?;
        let board = Arc::new(Board::new(threads));

        let mut server = DnsServer {
            addr,
            metrics_addr,
            board: board.clone(),
            stop: Arc::new(
                StopEvent::new()
                    .context("cannot create the route server's stop event (raise `ulimit -n`)")?,
            ),
            exec_stops: Vec::new(),
            executors: Vec::new(),
            store_thread: None,
            metrics_thread: None,
        };

        // The store thread first: executors start with its first table.
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..threads).map(|_| updates::channel()).unzip();
        let (stop_tx, stop_rx) = mpsc::channel();
        let (first_tx, first_rx) = mpsc::sync_channel(1);
        let poller = Poller::new(
            open,
            label.clone(),
            Intervals {
                poll: Duration::from_millis(cfg.poll_interval_ms),
                notified_poll: Duration::from_millis(cfg.notify_poll_interval_ms),
                full_reload: (cfg.full_reload_interval > 0)
                    .then(|| Duration::from_secs(cfg.full_reload_interval)),
            },
        );
        let b = board.clone();
        let handle = std::thread::Builder::new()
            .name("lbagent-dns-store".into())
            .spawn(move || reload::run(poller, senders, b, stop_rx, first_tx))
            .context("cannot start the route server's store thread")?;
        server.store_thread = Some((handle, stop_tx));
        match first_rx.recv_timeout(START_WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(e @ (StoreError::BadUrl(_) | StoreError::SchemaTooNew { .. }))) => {
                return Err(anyhow!(e).context(format!("cannot use store {label}")));
            }
            // The store thread logged why; pulls are held until it loads.
            Ok(Err(_)) => {}
            Err(RecvTimeoutError::Timeout) => tracing::warn!(
                "store {label} has not answered in {} s: serving without routes (pulls held) until it does",
                START_WAIT.as_secs()
            ),
            Err(RecvTimeoutError::Disconnected) => bail!("the route server's store thread ended at start"),
        }

        let io_memory = cfg.io_memory_kib as usize * 1024;
        let idle_timeout_ms = cfg.idle_timeout.saturating_mul(1000);
        let subscriptions = Arc::new(Budget::new(cfg.max_subscriptions as usize));
        let connections = Arc::new(Budget::new(cfg.max_connections as usize));
        for (i, (listener, updates)) in listeners.into_iter().zip(receivers).enumerate() {
            let stop = Arc::new(Doorbell::default());
            server.exec_stops.push(stop.clone());
            let parts = serve::ExecParts {
                index: i,
                listener,
                updates,
                board: board.clone(),
                stop,
                idle_timeout_ms,
                max_subscriptions_per_connection: cfg.max_subscriptions_per_connection as usize,
                subscriptions: subscriptions.clone(),
                connections: connections.clone(),
                tls: tls.clone(),
            };
            let handle = LocalExecutorBuilder::new(Placement::Fixed(i % ncpu))
                .name(&format!("lbagent-dns-{i}"))
                .io_memory(io_memory)
                .ring_depth(lbagent_service::conn::RING_DEPTH)
                .spawn(move || serve::run(parts))
                .map_err(|e| {
                    anyhow!(
                        "cannot start the route server's executor {i}: {e} (dnsserver.io_memory_kib = {}; check `ulimit -l`)",
                        cfg.io_memory_kib
                    )
                })?;
            server.executors.push(handle);
        }

        let (b, stop) = (board, server.stop.clone());
        let handle = std::thread::Builder::new()
            .name("lbagent-dns-metrics".into())
            .spawn(move || metrics::serve(metrics, b, stop))
            .context("cannot start the route server's metrics thread")?;
        server.metrics_thread = Some(handle);
        Ok(server)
    }

    /// The address agents connect to (the port resolved when 0 was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where `GET /metrics` is served.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// The metrics text, as `GET /metrics` would answer it now.
    pub fn metrics(&self) -> String {
        self.board.render(Instant::now())
    }

    /// Stops serving: closes every connection, stops polling the store, and
    /// joins every thread (the store thread is left behind, with a log
    /// line, if a store call has not returned within 15 s).
    ///
    /// # Errors
    /// A thread panicked.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.shut_down()
    }

    fn shut_down(&mut self) -> anyhow::Result<()> {
        self.stop.set();
        for stop in &self.exec_stops {
            stop.ring();
        }
        let mut failed = Vec::new();
        for (i, h) in self.executors.drain(..).enumerate() {
            if let Err(e) = h.join() {
                failed.push(format!("executor {i}: {e}"));
            }
        }
        if let Some((handle, stop)) = self.store_thread.take() {
            drop(stop);
            let t0 = Instant::now();
            while !handle.is_finished() && t0.elapsed() < STORE_STOP_WAIT {
                std::thread::sleep(Duration::from_millis(5));
            }
            if handle.is_finished() {
                if handle.join().is_err() {
                    failed.push("the store thread panicked".into());
                }
            } else {
                tracing::warn!(
                    "a store call has not returned in {} s; leaving it behind",
                    STORE_STOP_WAIT.as_secs()
                );
            }
        }
        if let Some(h) = self.metrics_thread.take() {
            if h.join().is_err() {
                failed.push("the metrics thread panicked".into());
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            bail!(
                "the route server did not stop cleanly: {}",
                failed.join("; ")
            )
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        let _ = self.shut_down();
    }
}

/// Runs the route server until SIGTERM or SIGINT, then stops it cleanly.
///
/// # Errors
/// What [`DnsServer::start`] and [`DnsServer::stop`] return.
pub fn run(cfg: &DnsServerConfig, store: StoreUrl, tls: Option<Arc<Tls>>) -> anyhow::Result<()> {
    lbagent_service::signal::install();
    let label = store.to_string();
    let link = if tls.is_some() {
        "mutual TLS"
    } else {
        "plain TCP"
    };
    let server = DnsServer::start_tls(cfg, store, tls)?;
    let threads = server.board.executors();
    tracing::info!(
        "serving pulls on {} ({link}, {threads} executors), metrics on http://{}/metrics, store {label}",
        server.addr(),
        server.metrics_addr(),
    );
    lbagent_service::sdnotify::ready("lbagent dnsserver");
    lbagent_service::signal::wait();
    let t0 = Instant::now();
    server.stop()?;
    tracing::info!("stopped in {} ms", t0.elapsed().as_millis());
    Ok(())
}

/// Refuses values the route server cannot run with (the same ranges as
/// `Config::validate`, for callers that build the table by hand).
fn check(cfg: &DnsServerConfig) -> anyhow::Result<()> {
    let checks: [(&str, u64, u64, u64); 9] = [
        ("threads", u64::from(cfg.threads), 0, 1024),
        ("poll_interval_ms", cfg.poll_interval_ms, 10, 60_000),
        (
            "notify_poll_interval_ms",
            cfg.notify_poll_interval_ms,
            10,
            60_000,
        ),
        ("full_reload_interval", cfg.full_reload_interval, 0, 604_800),
        ("idle_timeout", cfg.idle_timeout, 1, 86_400),
        ("io_memory_kib", u64::from(cfg.io_memory_kib), 64, 1_048_576),
        (
            "max_connections",
            u64::from(cfg.max_connections),
            1,
            1_000_000,
        ),
        (
            "max_subscriptions_per_connection",
            u64::from(cfg.max_subscriptions_per_connection),
            1,
            16_777_216,
        ),
        (
            "max_subscriptions",
            u64::from(cfg.max_subscriptions),
            1,
            268_435_456,
        ),
    ];
    for (field, value, min, max) in checks {
        if !(min..=max).contains(&value) {
            bail!("dnsserver.{field} = {value} is out of range: use {min}..={max}");
        }
    }
    Ok(())
}

/// Retries `bind` while the address is in use, up to [`PORT_WAIT`] (a
/// predecessor's sockets are released a little after it exits).
fn retry_in_use<T>(mut bind: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let t0 = Instant::now();
    loop {
        match bind() {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && t0.elapsed() < PORT_WAIT => {
                std::thread::sleep(Duration::from_millis(50))
            }
            other => return other,
        }
    }
}

/// `n` handles of one listening socket on `addr` (port 0: a free port),
/// one per executor. One socket, without `SO_REUSEPORT`, so that no other
/// process can bind the port beside this one ("address in use"); each
/// executor accepts on its own handle (a `dup`), and the kernel hands each
/// connection to exactly one of them.
fn bind_all(addr: SocketAddr, n: usize) -> io::Result<Vec<TcpListener>> {
    let first = TcpListener::bind(addr)?;
    // std listens with a backlog of 128. When every route server restarts,
    // thousands of agents connect within a second (and while the store
    // loads, before the executors accept): past the backlog their SYNs are
    // dropped, each attempt waits out the connect timeout and backs off.
    // Listen again with the largest queue the kernel allows
    // (`net.core.somaxconn`, 4096 by default).
    nix::sys::socket::listen(&first, nix::sys::socket::Backlog::MAXALLOWABLE)
        .map_err(io::Error::from)?;
    first.set_nonblocking(true)?;
    let mut all = Vec::with_capacity(n);
    for _ in 1..n {
        all.push(first.try_clone()?);
    }
    all.insert(0, first);
    Ok(all)
}

/// `e`, saying which port is taken when the address is in use.
fn in_use_named(e: io::Error, field: &str, addr: SocketAddr) -> anyhow::Error {
    if e.kind() == io::ErrorKind::AddrInUse {
        anyhow!(
            "cannot listen on {field} = {addr}: address in use: port {} is held by another process (another route server?)",
            addr.port()
        )
    } else {
        anyhow!(e).context(format!("cannot listen on {field} = {addr}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_connections_waits_in_the_queue_not_in_syn_retries() {
        // Every route server restarted: a fleet connects before anything
        // accepts. 600 connections (std's backlog holds 129) all complete.
        let all = bind_all("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let addr = all[0].local_addr().unwrap();
        let mut held = Vec::new();
        for i in 0..600 {
            let c = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))
                .unwrap_or_else(|e| panic!("connection {i} not queued: {e}"));
            held.push(c);
        }
    }

    #[test]
    fn listeners_share_one_port_that_no_one_else_can_bind() {
        let all = bind_all("127.0.0.1:0".parse().unwrap(), 3).unwrap();
        let addr = all[0].local_addr().unwrap();
        assert_ne!(addr.port(), 0);
        for l in &all {
            assert_eq!(l.local_addr().unwrap(), addr);
        }
        let e = bind_all(addr, 2).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        let e = in_use_named(e, "dnsserver.listen", addr).to_string();
        assert!(e.contains(&format!("port {} is held", addr.port())), "{e}");
        assert!(e.contains("address in use"), "{e}");
    }

    #[test]
    fn out_of_range_values_are_refused_by_name() {
        let cfg = DnsServerConfig {
            poll_interval_ms: 0,
            ..DnsServerConfig::default()
        };
        let e = check(&cfg).unwrap_err().to_string();
        assert!(e.contains("dnsserver.poll_interval_ms = 0"), "{e}");
        assert!(check(&DnsServerConfig::default()).is_ok());
    }
}
