//! The reporter (`lbagent reporter`): the agents' call statistics over TCP
//! into the store's call status table, in batches, without ever making an
//! agent wait for the database.
//!
//! ```text
//!  agents ──StatsReport──▶ executor thread ──push──▶ Buffer (bounded, sharded by module)
//!         ◀──StatsAck────  (glommio: sessions,          │ shard i
//!                           metrics, log)               ▼
//!                                                  writer thread i ──upsert──▶ store
//! ```
//!
//! - **Ingest** ([`session`], the `ingest` shell): every agent connection
//!   carries u32-LE length-prefixed StatsReport frames; each becomes one
//!   [`CallStatus`](lbagent_store::CallStatus) row per node and is answered
//!   StatsAck `seq` once the database committed its rows and applied its
//!   consumed units (a ticket per report in the buffer, settled by the
//!   writers' commits; the connection reads on meanwhile). A malformed frame
//!   closes that connection (counted); a report the store could not hold
//!   is refused with ErrorResp. One glommio executor serves every
//!   connection: a connection is a task, not a thread, so thousands of
//!   agents cost little, and the work per report (a verified decode and a
//!   copy into the buffer) is far below a core's worth.
//! - **Buffer** ([`buffer`], sans-IO): rows are sharded by module over
//!   `reporter.writers` shards (a hash of modid/cmdid, as the original);
//!   a newer row of a waiting (module, node, caller) replaces the older;
//!   past `reporter.buffer_rows` rows held the oldest are dropped, counted
//!   and logged (one line per burst, then one summary per 10 s: how many
//!   and since when, see [`notes`]). The ingest side never waits for a
//!   writer: the buffer's mutex is never held across a database call.
//! - **Writers** (the `writer` threads): writer `i` owns one store
//!   connection and drains shard `i` in transactions of up to
//!   `reporter.batch_rows`. A failure keeps the rows (they go back to the
//!   front of the shard) and retries with back-off capped at
//!   `reporter.retry_max_ms`.
//! - **Metrics** ([`metrics`]): `GET /metrics` on `reporter.metrics_addr`,
//!   Prometheus text.
//! - **Stop** ([`Reporter::stop`]): stop accepting, close the connections,
//!   write what is buffered for at most [`STOP_FLUSH`], say what could not
//!   be written.
//!
//! Duplicates are harmless: an agent re-sends an unacknowledged report
//! after a reconnect, its rows replace themselves in the store, and its
//! consumed units are applied once when it names its agent run
//! ([`Store::consume_once`]). Nothing acknowledged is lost to a reporter
//! killed or a database failing over: it was committed first.
//!
//! Owns the reporter's sockets, threads and buffer; reads the store only
//! through [`Store::upsert_status`], [`Store::consume`] and
//! [`Store::consume_once`], and touches nothing of the agent.
//!
//! # Layout
//!
//! - [`session`] (sans-IO) and `ingest` (its glommio shell): the agent
//!   connections.
//! - [`buffer`] (sans-IO): the bounded, sharded rows; [`notes`]: what it
//!   logs about drops.
//! - `writer`: the writer threads; `shared`: the phase and counters the
//!   executor, the writers and [`Reporter`] share.
//! - [`metrics`]: `GET /metrics`.
#![warn(missing_docs)]

pub mod buffer;
mod ingest;
pub mod metrics;
pub mod notes;
pub mod session;
mod shared;
mod writer;

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub use metrics::ReporterStats;

use ingest::Ingest;
use lbagent_config::{Config, ReporterConfig};
use lbagent_store::{Store, StoreError, StoreUrl};
use lbagent_tls::Tls;
use shared::{Phase, Shared};

/// The longest [`Reporter::stop`] spends writing what is buffered.
pub const STOP_FLUSH: Duration = Duration::from_secs(5);

/// Opens one store connection; every writer calls it for its own, again
/// after every failure.
pub type OpenStore = Arc<dyn Fn() -> Result<Box<dyn Store>, StoreError> + Send + Sync>;

/// Where the reporter's log lines go: one call per line, without a
/// trailing newline. Lines are rate-limited at the source.
#[derive(Clone)]
pub struct Log(Arc<dyn Fn(&str) + Send + Sync>);

impl Log {
    /// Lines to the process's log (`tracing` warnings, target
    /// `lbagent::reporter`).
    pub fn stderr() -> Self {
        Log::new(|line| tracing::warn!("{line}"))
    }

    /// Lines to `f`.
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Log(Arc::new(f))
    }

    /// Logs one line.
    pub fn line(&self, line: &str) {
        (self.0)(line)
    }
}

impl fmt::Debug for Log {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Log(..)")
    }
}

/// A running reporter. Dropping it without [`Reporter::stop`] stops it
/// without writing what is buffered.
pub struct Reporter {
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    shared: Arc<Shared>,
    ingest: Option<Ingest>,
    writers: Vec<JoinHandle<()>>,
}

impl Reporter {
    /// Starts a reporter on `store`, logging to standard error.
    ///
    /// # Errors
    /// See [`Reporter::start_with`].
    pub fn start(cfg: &ReporterConfig, store: StoreUrl) -> anyhow::Result<Reporter> {
        Reporter::start_tls(cfg, store, None)
    }

    /// [`Reporter::start`], serving mutual TLS with `tls` (plain TCP when
    /// `None`): rows carry the caller the agent's certificate names, and
    /// consumed units are taken from the identities `tls.consume_allow`
    /// names only.
    ///
    /// # Errors
    /// See [`Reporter::start_with`].
    pub fn start_tls(
        cfg: &ReporterConfig,
        store: StoreUrl,
        tls: Option<Arc<Tls>>,
    ) -> anyhow::Result<Reporter> {
        // Only the first open may create a SQLite file: one deleted later
        // is reported and the rows kept, never written to a new empty file.
        let opened = std::sync::atomic::AtomicBool::new(false);
        let open: OpenStore = Arc::new(move || {
            let result = if opened.load(std::sync::atomic::Ordering::Acquire) {
                lbagent_store::open_existing(&store)
            } else {
                lbagent_store::open(&store)
            };
            if result.is_ok() {
                opened.store(true, std::sync::atomic::Ordering::Release);
            }
            result
        });
        Reporter::start_with_tls(cfg, open, Log::stderr(), tls)
    }

    /// Starts a reporter whose writers connect with `open` and whose lines
    /// go to `log`: binds `cfg.listen` and `cfg.metrics_addr` (port 0 picks
    /// a free port), opens a first store connection, starts the writers and
    /// the executor. An unavailable store does not stop the start (rows are
    /// buffered until it is back; the log says so).
    ///
    /// # Errors
    /// An invalid `cfg` (the field and its allowed range), an address that
    /// cannot be bound, a store that can never work (a bad URL, a schema
    /// newer than this binary), threads or the executor that cannot start.
    pub fn start_with(cfg: &ReporterConfig, open: OpenStore, log: Log) -> anyhow::Result<Reporter> {
        Reporter::start_with_tls(cfg, open, log, None)
    }

    /// [`Reporter::start_with`], serving mutual TLS with `tls` (plain TCP
    /// when `None`).
    ///
    /// # Errors
    /// See [`Reporter::start_with`].
    pub fn start_with_tls(
        cfg: &ReporterConfig,
        open: OpenStore,
        log: Log,
        tls: Option<Arc<Tls>>,
    ) -> anyhow::Result<Reporter> {
        // The ranges of `[reporter]` only: whether a plain listen address
        // off loopback is allowed depends on `[tls]` (`tls.insecure`), which
        // the whole configuration's validation judged (Config::load); judged
        // here against a default `[tls]`, every non-loopback listen address
        // was refused, `tls.insecure` or not (found by the fleet lab).
        let whole = Config {
            reporter: cfg.clone(),
            tls: lbagent_config::TlsConfig {
                insecure: true,
                ..Default::default()
            },
            ..Config::default()
        };
        whole
            .validate()
            .context("invalid [reporter] configuration")?;
        let agents = bind(cfg.listen, "agents", "reporter.listen")?;
        let metrics = bind(cfg.metrics_addr, "metrics", "reporter.metrics_addr")?;
        let addr = agents
            .local_addr()
            .context("the agents' listener has no address")?;
        let metrics_addr = metrics
            .local_addr()
            .context("the metrics listener has no address")?;
        let first = match open() {
            Ok(store) => Some(store),
            Err(e @ StoreError::Unavailable { .. }) => {
                log.line(&format!(
                    "{e}; starting anyway: rows are buffered (up to {} rows) until it is back",
                    cfg.buffer_rows
                ));
                None
            }
            Err(e) => return Err(e).context("cannot use the store"),
        };
        let writers = cfg.writers as usize;
        let shared = Arc::new(Shared::new(
            writers,
            cfg.buffer_rows as usize,
            cfg.batch_rows as usize,
            cfg.retry_max_ms,
            log,
        ));
        let mut reporter = Reporter {
            addr,
            metrics_addr,
            shared: shared.clone(),
            ingest: None,
            writers: Vec::with_capacity(writers),
        };
        let mut first = first;
        for i in 0..writers {
            let handle = writer::spawn(i, shared.clone(), open.clone(), first.take())
                .with_context(|| format!("cannot start writer thread {i}"))?;
            reporter.writers.push(handle);
        }
        reporter.ingest = Some(Ingest::start(
            agents,
            metrics,
            shared,
            ingest::ConnLimits::of(cfg),
            tls,
        )?);
        Ok(reporter)
    }

    /// The address agents connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address of `GET /metrics`.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// Every counter and gauge now (what `GET /metrics` renders).
    pub fn stats(&self) -> ReporterStats {
        self.shared.stats()
    }

    /// Stops accepting, closes every agent connection, then writes what is
    /// buffered for at most [`STOP_FLUSH`].
    ///
    /// # Errors
    /// When rows could not be written in time (how many, and the store's
    /// last error: said once, here, not in the log), or the executor failed.
    pub fn stop(self) -> anyhow::Result<()> {
        self.stop_within(STOP_FLUSH)
    }

    /// [`Reporter::stop`], writing what is buffered for at most `flush`.
    ///
    /// # Errors
    /// As [`Reporter::stop`].
    pub fn stop_within(mut self, flush: Duration) -> anyhow::Result<()> {
        self.shutdown(flush)
    }

    fn shutdown(&mut self, flush: Duration) -> anyhow::Result<()> {
        let ingest = self.ingest.take().map_or(Ok(()), Ingest::stop);
        let deadline = Instant::now() + flush;
        self.shared.lock().phase = Phase::Draining(deadline);
        self.shared.wake_all();
        let mut core = self.shared.wait_writers(deadline);
        core.phase = Phase::Abandoned;
        drop(core);
        self.shared.wake_all();
        // Writers waiting or sleeping end at once; one inside a database
        // call is left to finish on its own.
        let core = self
            .shared
            .wait_writers(Instant::now() + Duration::from_millis(200));
        let (left, busy) = (core.buffer.len(), core.running);
        let bound = core.buffer.bound();
        let last_error = core.last_error.clone();
        let mut core = core;
        let loss = core.loss.flush(bound);
        drop(core);
        if let Some(line) = loss {
            self.shared.log(&line);
        }
        for handle in std::mem::take(&mut self.writers) {
            if handle.is_finished() {
                let _ = handle.join();
            }
        }
        ingest?;
        if left > 0 {
            let why = match (last_error, busy) {
                (Some(e), _) => format!("the store's last error: {e}"),
                (None, 0) => "the writers ended first".to_string(),
                (None, n) => format!("{n} writers were still inside a database call"),
            };
            // Said once, by whoever gets the error (the binary prints it).
            bail!(
                "stopped with {left} rows not written to the store within {} s; they are lost ({why})",
                flush.as_secs_f64()
            );
        }
        Ok(())
    }
}

/// A listener on `addr` (`field` in the configuration), bound without
/// `SO_REUSEPORT`: a port another process holds is refused as "address in
/// use", naming the port.
fn bind(addr: SocketAddr, what: &str, field: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow::anyhow!(
                "cannot listen for {what} on {addr} ({field}): address in use: port {} is held by another process (another reporter?)",
                addr.port()
            )
        } else {
            anyhow::anyhow!(e).context(format!(
                "cannot listen for {what} on {addr} ({field}): pick a free address"
            ))
        }
    })
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if self.ingest.is_some() {
            if let Err(e) = self.shutdown(Duration::ZERO) {
                self.shared.log(&format!("{e:#}"));
            }
        }
    }
}

impl fmt::Debug for Reporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reporter")
            .field("addr", &self.addr)
            .field("metrics_addr", &self.metrics_addr)
            .finish_non_exhaustive()
    }
}

/// `lbagent reporter`: installs the signal handler, starts a reporter on
/// `store`, says so in one line on standard error, runs until SIGTERM or
/// SIGINT, then stops (writing what is buffered for at most
/// [`STOP_FLUSH`]).
///
/// # Errors
/// When it cannot start (see [`Reporter::start_with`]), or rows were left
/// unwritten at the stop.
pub fn run(cfg: &ReporterConfig, store: StoreUrl, tls: Option<Arc<Tls>>) -> anyhow::Result<()> {
    lbagent_service::signal::install();
    let url = store.to_string();
    let link = if tls.is_some() {
        "mutual TLS"
    } else {
        "plain TCP"
    };
    let reporter = Reporter::start_tls(cfg, store, tls)?;
    tracing::info!(
        "listening for agents on {} ({link}), metrics at http://{}/metrics, store {url}, {} writers, up to {} rows buffered",
        reporter.addr(),
        reporter.metrics_addr(),
        cfg.writers,
        cfg.buffer_rows
    );
    lbagent_service::sdnotify::ready("lbagent reporter");
    lbagent_service::signal::wait();
    tracing::info!(
        "stopping; writing {} buffered rows",
        reporter.stats().rows_buffered
    );
    reporter.stop()
}
