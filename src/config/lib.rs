//! The configuration: one TOML file with `[lb]`, `[agent]`, `[store]`,
//! `[dnsserver]`, `[reporter]`, `[admission]` and `[log]` tables, command-line
//! overrides, [`Config::validate`], and what a reload may change
//! ([`reload::plan`]).
//!
//! Every field has a default equal to the original agent's `lbagent.ini`
//! (see `lbagent.toml` beside this file, which `lbagent agent
//! --print-config` prints and a test keeps equal to [`Config::default`]).
//! This module reads and checks; it must not start anything.
//!
//! # Layout
//!
//! - this file: [`Config`] and its sections, loading, `validate()`.
//! - `admission` ([`AdmissionConfig`]), `shm` ([`ShmConfig`]) and `tls`
//!   ([`TlsConfig`]): their sections.
//! - [`store_url`]: `sqlite:PATH` / `postgres://` parsed, passwords hidden.
//! - [`reload`]: what a reload may change in each process (pure).
//! - `lbagent.toml`: the documented default file, equal to
//!   [`Config::default`] (a test keeps it so).
#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use lbagent_lb::LbParams;

mod admission;
pub mod reload;
mod shm;
pub mod store_url;
mod tls;
pub use admission::AdmissionConfig;
pub use shm::ShmConfig;
pub use tls::{name_matches, TlsConfig};

/// The documented default configuration file.
pub const DEFAULT_TOML: &str = include_str!("lbagent.toml");

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The overload algorithm and the module lifecycle (`[lb]`).
    pub lb: LbConfig,
    /// The agent process (`[agent]`).
    pub agent: AgentConfig,
    /// The store the route server, the reporter and `route` use (`[store]`).
    pub store: StoreConfig,
    /// The route server (`[dnsserver]`).
    pub dnsserver: DnsServerConfig,
    /// The reporter (`[reporter]`).
    pub reporter: ReporterConfig,
    /// DAGOR admission control (`[admission]`).
    pub admission: AdmissionConfig,
    /// The agent's shared-memory transport (`[shm]`).
    pub shm: ShmConfig,
    /// The log (`[log]`).
    pub log: LogConfig,
    /// Mutual TLS between hosts (`[tls]`).
    pub tls: TlsConfig,
}

/// The `[log]` table: what the agent and the servers log, and how.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// The least severe level written; a reload changes it live.
    pub level: LogLevel,
    /// One line of text per event, or one JSON object per line.
    pub format: LogFormat,
}

/// A log level (`[log] level`, `--log-level`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Nothing.
    Off,
    /// Failures only.
    Error,
    /// Failures and what may need attention.
    Warn,
    /// Start, stop, connections, reloads (the default).
    #[default]
    Info,
    /// Details for debugging.
    Debug,
    /// Everything.
    Trace,
}

/// The log's format (`[log] format`, `--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `TIME LEVEL SPANS: TARGET: MESSAGE` (the default).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, spans, fields.
    Json,
}

/// Where a process's configuration comes from, so that a reload reads it
/// the same way: the file (or the defaults) under `base`, then the
/// command line's overrides (which keep winning over the file).
#[derive(Clone, Debug)]
pub struct ConfigSource {
    /// What the file's missing fields default to.
    pub base: Config,
    /// The file, if any.
    pub path: Option<PathBuf>,
    /// `SECTION.FIELD=VALUE` overrides, in order.
    pub overrides: Vec<String>,
}

impl ConfigSource {
    /// The built-in defaults under `path` and `overrides`.
    pub fn new(path: Option<PathBuf>, overrides: Vec<String>) -> Self {
        ConfigSource {
            base: Config::default(),
            path,
            overrides,
        }
    }

    /// Reads and validates the configuration.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load(&self) -> Result<Config, ConfigError> {
        Config::load_onto(&self.base, self.path.as_deref(), &self.overrides)
    }
}

/// The `[lb]` table: the overload algorithm's knobs and the module
/// lifecycle timers, named as in the original `lbagent.ini`. Times are
/// whole seconds.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LbConfig {
    /// Virtual successes a node starts with when it (re)enters idle.
    pub init_succ_cnt: u32,
    /// Virtual errors a node starts with when it enters overload.
    pub ovld_err_cnt: u32,
    /// Consecutive successes that return an overloaded node to idle.
    pub contin_succ_lim: u32,
    /// Consecutive failures that make an idle node overloaded.
    pub contin_err_lim: u32,
    /// While some node is overloaded, `probe_num` getHosts answer from the
    /// idle list and the next probes (10 then 1).
    pub probe_num: u32,
    /// Virtual success rate above which an overloaded node is idle again.
    pub succ_rate: f64,
    /// Virtual error rate above which an idle node is overloaded.
    pub err_rate: f64,
    /// Real error rate at or above which an idle window is bad.
    pub wind_err_rate: f64,
    /// Consecutive bad windows that make an idle node overloaded.
    pub wind_err_limit: u32,
    /// Seconds between route re-pulls of a module in use (versioned,
    /// jittered down by up to a quarter; the route client's `refresh_ms`).
    pub update_timeout: u64,
    /// Seconds in an idle node's window.
    pub clear_timeout: u64,
    /// Seconds between a module's statistics sent to the reporter.
    pub report_timeout: u64,
    /// Seconds after which an overloaded node is forced back to idle.
    pub overload_wait_lim: u64,
    /// Seconds after which a `balance` module's unit that was not
    /// reported back returns by itself (counted).
    pub unit_timeout: u64,
    /// The most units of one `balance` module one client (a UDP source, a
    /// shared-memory slot, a local-socket connection) holds at once.
    pub units_per_client: u32,
    /// Milliseconds over which a node entering the idle list ramps to its
    /// full weight (a module's `slow_start_ms` where it sets none); 0 = off.
    pub slow_start_ms: u64,
    /// Slow start's aggression: a ramping node's share is
    /// `max(min, t^(1/aggression))` of its weight.
    pub slow_start_aggression: f64,
    /// The smallest share of its weight a ramping node gets, percent.
    pub slow_start_min_weight_percent: u8,
    /// The most nodes of a module, in percent, that the overload rules mark
    /// overloaded at once (a module's own where it sets one); 100 = no limit.
    pub max_overloaded_percent: u8,
    /// Below this idle share, percent, a module's getHost answers round
    /// robin over every node instead of overloaded; 0 = off.
    pub panic_percent: u8,
    /// Below this idle share, percent, of the agent's own zone, getHost
    /// spills over to other zones (a module's own where it sets one).
    pub locality_min_percent: u8,
    /// A getHost whose label selector matches no node of the module:
    /// `any` (choose among every node) or `fail` (answer no such module).
    pub label_fallback: String,
}

impl Default for LbConfig {
    fn default() -> Self {
        let p = LbParams::default();
        LbConfig {
            init_succ_cnt: p.init_succ_cnt,
            ovld_err_cnt: p.ovld_err_cnt,
            contin_succ_lim: p.contin_succ_lim,
            contin_err_lim: p.contin_err_lim,
            probe_num: p.probe_num,
            succ_rate: p.succ_rate,
            err_rate: p.err_rate,
            wind_err_rate: p.wind_err_rate,
            wind_err_limit: p.wind_err_limit,
            update_timeout: 15,
            clear_timeout: p.clear_timeout_ms / 1000,
            report_timeout: 15,
            overload_wait_lim: p.overload_wait_ms / 1000,
            unit_timeout: p.unit_timeout_ms / 1000,
            units_per_client: p.units_per_client,
            slow_start_ms: p.slow_start_ms,
            slow_start_aggression: p.slow_start_aggression,
            slow_start_min_weight_percent: p.slow_start_min_weight_percent,
            max_overloaded_percent: p.max_overloaded_percent,
            panic_percent: p.panic_percent,
            locality_min_percent: p.locality_min_percent,
            label_fallback: "any".into(),
        }
    }
}

impl LbConfig {
    /// `label_fallback` as the LB core takes it (`any` when it is not a
    /// name [`Config::validate`] accepts).
    pub fn label_fallback(&self) -> lbagent_lb::labels::Fallback {
        self.label_fallback.parse().unwrap_or_default()
    }

    /// The parameters the LB core takes.
    pub fn params(&self) -> LbParams {
        LbParams {
            init_succ_cnt: self.init_succ_cnt,
            ovld_err_cnt: self.ovld_err_cnt,
            contin_succ_lim: self.contin_succ_lim,
            contin_err_lim: self.contin_err_lim,
            probe_num: self.probe_num,
            succ_rate: self.succ_rate,
            err_rate: self.err_rate,
            wind_err_rate: self.wind_err_rate,
            wind_err_limit: self.wind_err_limit,
            clear_timeout_ms: self.clear_timeout * 1000,
            overload_wait_ms: self.overload_wait_lim * 1000,
            unit_timeout_ms: self.unit_timeout * 1000,
            units_per_client: self.units_per_client,
            slow_start_ms: self.slow_start_ms,
            slow_start_aggression: self.slow_start_aggression,
            slow_start_min_weight_percent: self.slow_start_min_weight_percent,
            max_overloaded_percent: self.max_overloaded_percent,
            panic_percent: self.panic_percent,
            locality_min_percent: self.locality_min_percent,
        }
    }
}

/// The `[agent]` table: where the agent listens and whom it talks to.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Address the shards' UDP sockets bind.
    pub bind: Ipv4Addr,
    /// Shard i serves UDP port `base_port + i`.
    pub base_port: u16,
    /// Number of shards; 0 = one per core but the last, at least one.
    pub shards: u32,
    /// Route servers, `HOST:PORT`, tried in order.
    pub route_servers: Vec<String>,
    /// Reporters, `HOST:PORT`, tried in order.
    pub reporters: Vec<String>,
    /// The shared-memory heartbeat file.
    pub heartbeat_path: PathBuf,
    /// The static route file.
    pub snapshot_path: PathBuf,
    /// Seconds between route snapshots.
    pub snapshot_interval: u64,
    /// Loopback address of the metrics endpoint.
    pub metrics_addr: SocketAddr,
    /// glommio registered I/O memory per executor, KiB.
    pub io_memory_kib: u32,
    /// Seconds a module with a route may go without a request before the
    /// shard forgets it (and unsubscribes it at the route server).
    pub module_idle_timeout: u64,
    /// Milliseconds a shard remembers a module without a route (asked for
    /// and unanswered, or absent at the route server).
    pub unknown_module_ttl_ms: u64,
    /// The most modules one shard holds.
    pub max_modules: u32,
    /// The most modules without a route one shard remembers at once;
    /// requests for further unknown modules are refused.
    pub max_unknown_modules: u32,
    /// Each shard socket's receive buffer (`SO_RCVBUF`), bytes; 0 leaves
    /// the system default (`net.core.rmem_default`). It bounds how long a
    /// datagram can wait in the kernel: about the datagrams it holds over
    /// the shard's service rate. The kernel doubles the value and caps it
    /// at `net.core.rmem_max`.
    pub udp_rcvbuf_bytes: u32,
    /// Measure every datagram's queuing time (the `lbagent_queuing_seconds`
    /// and `lbagent_gethost_queuing_seconds` histograms): the kernel stamps
    /// each datagram's arrival, a control message per datagram, and over
    /// shared memory each client stamps its requests (a clock read a
    /// request, skipped while this and shedding are off). Always on with
    /// `admission.agent_shedding`, which needs it. Read at start.
    pub queuing_time: bool,
    /// Serve the local socket: shard i listens on the Unix socket
    /// `<heartbeat_path>.sock.<i>`, which tells the agent who connects
    /// (uid, gid, pid), for the requests that act beyond the caller.
    pub local_socket: bool,
    /// Users (uids) whose processes the agent trusts, over the local
    /// socket, with requests that act beyond themselves; root and the
    /// agent's own user always are.
    pub trusted_uids: Vec<u32>,
    /// Groups (gids): a process whose primary group is one of these is
    /// trusted as for `trusted_uids`.
    pub trusted_gids: Vec<u32>,
    /// Compatibility: take the requests that act beyond the caller
    /// (consumed units, levels every caller shares) from any local process
    /// over UDP, as before the local socket. Off: refused (consumed) or
    /// kept to the reporter's own getHosts (levels).
    pub udp_acts_beyond: bool,
    /// The agent's zone (a data centre, a rack, a cloud zone): getHosts
    /// prefer a module's nodes of this zone (`lb.locality_min_percent`).
    /// Empty: no zone, no preference.
    pub zone: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            bind: Ipv4Addr::LOCALHOST,
            base_port: 8888,
            shards: 0,
            route_servers: vec!["127.0.0.1:7777".into()],
            reporters: vec!["127.0.0.1:7778".into()],
            heartbeat_path: lbagent_host::heartbeat::DEFAULT_PATH.into(),
            snapshot_path: lbagent_host::snapshot::DEFAULT_PATH.into(),
            snapshot_interval: 60,
            metrics_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 9888)),
            io_memory_kib: 512,
            module_idle_timeout: 600,
            unknown_module_ttl_ms: 1000,
            max_modules: 1 << 20,
            max_unknown_modules: 1024,
            udp_rcvbuf_bytes: 0,
            queuing_time: false,
            local_socket: true,
            trusted_uids: Vec::new(),
            trusted_gids: Vec::new(),
            udp_acts_beyond: false,
            zone: String::new(),
        }
    }
}

/// The `[store]` table.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `sqlite:PATH` or a `postgres://` URL.
    pub url: String,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: "sqlite:./lbagent-data/lbagent.db".into(),
        }
    }
}

/// The `[dnsserver]` table: the route server.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsServerConfig {
    /// TCP address agents connect to.
    pub listen: SocketAddr,
    /// Executors serving connections, each pinned to a core; 0 = one per core.
    pub threads: u32,
    /// Milliseconds between checks of the store's route version when the
    /// store cannot announce its changes (SQLite: the check is one
    /// prepared statement on a local file).
    pub poll_interval_ms: u64,
    /// Milliseconds between checks of the route version when the store
    /// announces its changes (PostgreSQL `LISTEN`/`NOTIFY`): the fallback
    /// for a lost notification; also the shortest wait between attempts
    /// to reach a store that failed.
    pub notify_poll_interval_ms: u64,
    /// Seconds between full reloads of every route, a safety net for rows
    /// changed behind the change log's back; 0 (the default) turns it off.
    pub full_reload_interval: u64,
    /// Seconds a connection may stay silent before it is closed and loses
    /// its subscriptions.
    pub idle_timeout: u64,
    /// Loopback address of the metrics endpoint; port 0 picks a free port.
    pub metrics_addr: SocketAddr,
    /// glommio registered I/O memory per executor, KiB.
    pub io_memory_kib: u32,
    /// Most agent connections open at once, across executors; a
    /// connection past it is answered ErrorResp `Unavailable` and closed.
    pub max_connections: u32,
    /// Most modules one connection may subscribe to; a pull past it is
    /// answered but not subscribed, with ErrorResp `Unavailable`.
    pub max_subscriptions_per_connection: u32,
    /// Most subscriptions held at once across every connection; past it as
    /// for the per-connection bound.
    pub max_subscriptions: u32,
}

impl Default for DnsServerConfig {
    fn default() -> Self {
        DnsServerConfig {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 7777)),
            threads: 1,
            poll_interval_ms: 25,
            notify_poll_interval_ms: 1000,
            full_reload_interval: 0,
            idle_timeout: 30,
            metrics_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 9777)),
            io_memory_kib: 512,
            max_connections: 10_000,
            max_subscriptions_per_connection: 262_144,
            max_subscriptions: 4_194_304,
        }
    }
}

/// The `[reporter]` table: the statistics reporter.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReporterConfig {
    /// TCP address agents connect to.
    pub listen: SocketAddr,
    /// Writer threads; rows go to writer hash(modid, cmdid) % writers.
    pub writers: u32,
    /// Most rows one transaction writes.
    pub batch_rows: u32,
    /// Most rows held in memory across all writers while the database is
    /// slow or down; past it the oldest are dropped, counted and logged.
    pub buffer_rows: u32,
    /// Longest wait, milliseconds, between retries of a failed write.
    pub retry_max_ms: u64,
    /// Loopback address of the metrics endpoint; port 0 picks a free port.
    pub metrics_addr: SocketAddr,
    /// Most agent connections open at once; a connection past it is
    /// answered ErrorResp `Unavailable` and closed.
    pub max_connections: u32,
    /// Seconds a connection may stay without a complete frame before it is
    /// closed (an agent reconnects when it has statistics to send).
    pub idle_timeout: u64,
    /// Milliseconds a frame, once begun, may take to arrive whole.
    pub read_timeout_ms: u64,
    /// Most bytes of frames not yet complete held across every connection;
    /// the connection whose bytes pass it is closed.
    pub max_buffered_bytes: u64,
}

impl Default for ReporterConfig {
    fn default() -> Self {
        ReporterConfig {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 7778)),
            writers: 3,
            batch_rows: 1000,
            buffer_rows: 1_000_000,
            retry_max_ms: 5000,
            metrics_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 9778)),
            max_connections: 10_000,
            idle_timeout: 300,
            read_timeout_ms: 10_000,
            max_buffered_bytes: 64 << 20,
        }
    }
}

/// Why a configuration cannot be used. Every message is one line naming the
/// file, field or argument at fault and what would be accepted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key or a value of the
    /// wrong type.
    #[error("{origin}{location}: {message}")]
    Parse {
        /// The file, or `command line`.
        origin: String,
        /// `:LINE:COLUMN` when known.
        location: String,
        /// The parser's message, on one line.
        message: String,
    },
    /// A `--set` argument is not `SECTION.FIELD=VALUE`.
    #[error("bad --set `{arg}`: {why}")]
    Override {
        /// The argument as given.
        arg: String,
        /// What is wrong with it.
        why: String,
    },
    /// A value of the wrong type, or outside what its type can hold (e.g.
    /// `agent.base_port = 99999`).
    #[error("{origin}: {field} = {value} is not accepted: expected {expected}")]
    BadValue {
        /// The file, or `command line (--set)`.
        origin: String,
        /// `section.field`.
        field: String,
        /// The value given, as TOML.
        value: String,
        /// What the field takes, with its range for numbers.
        expected: String,
    },
    /// A value is outside its allowed range.
    #[error("{field} = {value} is out of range: allowed {allowed}")]
    Invalid {
        /// `section.field`.
        field: &'static str,
        /// The value given.
        value: String,
        /// The allowed range or form.
        allowed: String,
    },
}

/// The longest configuration file read, in bytes (the packaged one is
/// about 15 KiB).
pub const MAX_FILE_LEN: u64 = 1 << 20;

/// Reads the configuration file at `path` as text without ever blocking:
/// it is opened non-blocking and judged by `fstat` before a byte is read,
/// so a FIFO, a device or a directory put at the path (at start or before
/// a SIGHUP) is refused at once instead of waiting for a writer while
/// SIGTERM goes unheard; a file above [`MAX_FILE_LEN`] is refused too.
///
/// # Errors
/// The system's error, or `InvalidInput` naming what the path is.
pub fn read_regular(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    let t = meta.file_type();
    if !t.is_file() {
        let kind = if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "it is {kind}, not a regular file: point --config at the configuration file itself"
            ),
        ));
    }
    if meta.len() > MAX_FILE_LEN {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "it is {} bytes, more than the {MAX_FILE_LEN} a configuration may have",
                meta.len()
            ),
        ));
    }
    let mut text = String::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_LEN + 1).read_to_string(&mut text)?;
    Ok(text)
}

/// Reads a file the configuration names (a TLS certificate, key or CA)
/// without ever blocking, as [`read_regular`] reads the configuration: a
/// FIFO, a device or a directory at the path is refused at once (a read
/// waiting for a writer would stall a reload, or an executor, and leave
/// SIGTERM unheard); so is a file above `max` bytes.
///
/// # Errors
/// The system's error, or `InvalidInput` naming what the path is.
pub fn read_regular_bytes(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    let t = meta.file_type();
    let kind = if t.is_file() {
        None
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_char_device() || t.is_block_device() {
        Some("a device")
    } else {
        Some("not a regular file")
    };
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    if let Some(kind) = kind {
        return Err(invalid(format!(
            "it is {kind}, not a regular file: name the file itself"
        )));
    }
    if meta.len() > max {
        return Err(invalid(format!(
            "it is {} bytes, more than the {max} read",
            meta.len()
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

impl Config {
    /// Reads `path` (or starts from the defaults when `None`), applies the
    /// `SECTION.FIELD=VALUE` overrides in order, and validates the result.
    ///
    /// # Errors
    /// [`ConfigError::Read`] for a missing or unreadable file,
    /// [`ConfigError::Parse`] for bad TOML or an unknown key,
    /// [`ConfigError::Override`] for a malformed override,
    /// [`ConfigError::Invalid`] for a value out of range.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
        Self::load_onto(&Config::default(), path, overrides)
    }

    /// Like [`Config::load`], but fields the file does not set come from
    /// `base` instead of the defaults (a subcommand with defaults of its
    /// own, such as `standalone`'s loopback listeners).
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load_onto(
        base: &Config,
        path: Option<&Path>,
        overrides: &[String],
    ) -> Result<Config, ConfigError> {
        let (origin, text) = match path {
            Some(p) => {
                let text = read_regular(p).map_err(|source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                })?;
                (p.display().to_string(), text)
            }
            None => ("defaults".to_string(), String::new()),
        };
        // The file alone first, so that its errors carry a line and column.
        let file: toml::Table =
            toml::from_str(&text).map_err(|e| parse_error(&origin, &text, &e))?;
        if let Err(e) = toml::from_str::<Config>(&text) {
            let at = match parse_error(&origin, &text, &e) {
                ConfigError::Parse { location, .. } => format!("{origin}{location}"),
                _ => origin.clone(),
            };
            return Err(bad_value(&at, &file).unwrap_or_else(|| parse_error(&origin, &text, &e)));
        }
        let mut table = toml::Table::try_from(base).map_err(|e| ConfigError::Parse {
            origin: "base configuration".into(),
            location: String::new(),
            message: e.to_string(),
        })?;
        for (section, fields) in file {
            match (table.get_mut(&section), fields) {
                (Some(toml::Value::Table(into)), toml::Value::Table(from)) => into.extend(from),
                (_, fields) => {
                    table.insert(section, fields);
                }
            }
        }
        for arg in overrides {
            apply_override(&mut table, arg)?;
        }
        let origin = if overrides.is_empty() {
            origin
        } else {
            "command line (--set)".to_string()
        };
        let config = match Config::deserialize(toml::Value::Table(table.clone())) {
            Ok(c) => c,
            Err(e) => {
                return Err(
                    bad_value(&origin, &table).unwrap_or_else(|| parse_error(&origin, "", &e))
                )
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Parses a configuration from TOML text and validates it.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] or [`ConfigError::Invalid`].
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let table: toml::Table =
            toml::from_str(text).map_err(|e| parse_error("config", text, &e))?;
        let config = Config::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
            bad_value("config", &table).unwrap_or_else(|| parse_error("config", text, &e))
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let lb = &self.lb;
        in_range("lb.init_succ_cnt", lb.init_succ_cnt, 0, 1_000_000)?;
        in_range("lb.ovld_err_cnt", lb.ovld_err_cnt, 0, 1_000_000)?;
        in_range("lb.contin_succ_lim", lb.contin_succ_lim, 1, 1_000_000)?;
        in_range("lb.contin_err_lim", lb.contin_err_lim, 1, 1_000_000)?;
        in_range("lb.probe_num", lb.probe_num, 2, 1_000_000)?;
        rate("lb.succ_rate", lb.succ_rate)?;
        rate("lb.err_rate", lb.err_rate)?;
        rate("lb.wind_err_rate", lb.wind_err_rate)?;
        in_range("lb.wind_err_limit", lb.wind_err_limit, 1, 1_000)?;
        in_range("lb.update_timeout", lb.update_timeout, 1, 3_600)?;
        in_range("lb.clear_timeout", lb.clear_timeout, 1, 86_400)?;
        in_range("lb.report_timeout", lb.report_timeout, 1, 3_600)?;
        in_range("lb.overload_wait_lim", lb.overload_wait_lim, 1, 86_400)?;
        in_range("lb.unit_timeout", lb.unit_timeout, 1, 86_400)?;
        in_range("lb.units_per_client", lb.units_per_client, 1, 1_000_000)?;
        in_range("lb.slow_start_ms", lb.slow_start_ms, 0, 3_600_000)?;
        if !(0.1..=10.0).contains(&lb.slow_start_aggression) {
            return Err(ConfigError::Invalid {
                field: "lb.slow_start_aggression",
                value: lb.slow_start_aggression.to_string(),
                allowed: "0.1..=10.0 (1.0 is linear)".into(),
            });
        }
        in_range(
            "lb.slow_start_min_weight_percent",
            lb.slow_start_min_weight_percent,
            1,
            100,
        )?;
        in_range(
            "lb.max_overloaded_percent",
            lb.max_overloaded_percent,
            1,
            100,
        )?;
        in_range("lb.panic_percent", lb.panic_percent, 0, 100)?;
        in_range("lb.locality_min_percent", lb.locality_min_percent, 0, 100)?;
        if let Err(e) = lb.label_fallback.parse::<lbagent_lb::labels::Fallback>() {
            return Err(ConfigError::Invalid {
                field: "lb.label_fallback",
                value: lb.label_fallback.clone(),
                allowed: format!("any or fail ({e})"),
            });
        }

        let a = &self.agent;
        if !a.zone.is_empty() {
            if let Err(e) = a.zone.parse::<lbagent_model::Zone>() {
                return Err(ConfigError::Invalid {
                    field: "agent.zone",
                    value: a.zone.chars().take(80).collect(),
                    allowed: format!("empty (no zone) or a zone name: {e}"),
                });
            }
        }
        in_range("agent.base_port", a.base_port, 0, u16::MAX)?;
        in_range("agent.shards", a.shards, 0, 1_024)?;
        let last = u32::from(a.base_port) + a.shards.max(1) - 1;
        if last > u32::from(u16::MAX) {
            return Err(ConfigError::Invalid {
                field: "agent.base_port",
                value: a.base_port.to_string(),
                allowed: format!("base_port + shards - 1 <= 65535 (shards = {})", a.shards),
            });
        }
        endpoints("agent.route_servers", &a.route_servers)?;
        endpoints("agent.reporters", &a.reporters)?;
        absolute("agent.heartbeat_path", &a.heartbeat_path)?;
        absolute("agent.snapshot_path", &a.snapshot_path)?;
        in_range("agent.snapshot_interval", a.snapshot_interval, 1, 3_600)?;
        loopback("agent.metrics_addr", a.metrics_addr)?;
        in_range("agent.io_memory_kib", a.io_memory_kib, 64, 1_048_576)?;
        in_range(
            "agent.module_idle_timeout",
            a.module_idle_timeout,
            1,
            86_400 * 7,
        )?;
        in_range(
            "agent.unknown_module_ttl_ms",
            a.unknown_module_ttl_ms,
            10,
            600_000,
        )?;
        in_range("agent.max_modules", a.max_modules, 1, 1 << 24)?;
        in_range(
            "agent.max_unknown_modules",
            a.max_unknown_modules,
            1,
            1 << 20,
        )?;
        let r = a.udp_rcvbuf_bytes;
        if r != 0 && !(MIN_RCVBUF..=MAX_RCVBUF).contains(&r) {
            return Err(ConfigError::Invalid {
                field: "agent.udp_rcvbuf_bytes",
                value: r.to_string(),
                allowed: format!("0 (the system default) or {MIN_RCVBUF}..={MAX_RCVBUF}"),
            });
        }

        if let Err(e) = self.store.url.parse::<store_url::StoreUrl>() {
            return Err(ConfigError::Invalid {
                field: "store.url",
                value: format!("\"{}\"", store_url::redact(&self.store.url)),
                allowed: format!("sqlite:PATH or a postgres:// URL ({e})"),
            });
        }

        let d = &self.dnsserver;
        in_range("dnsserver.threads", d.threads, 0, 1_024)?;
        in_range("dnsserver.poll_interval_ms", d.poll_interval_ms, 10, 60_000)?;
        in_range(
            "dnsserver.notify_poll_interval_ms",
            d.notify_poll_interval_ms,
            10,
            60_000,
        )?;
        in_range(
            "dnsserver.full_reload_interval",
            d.full_reload_interval,
            0,
            604_800,
        )?;
        in_range("dnsserver.idle_timeout", d.idle_timeout, 1, 86_400)?;
        loopback("dnsserver.metrics_addr", d.metrics_addr)?;
        in_range("dnsserver.io_memory_kib", d.io_memory_kib, 64, 1_048_576)?;
        in_range("dnsserver.max_connections", d.max_connections, 1, 1_000_000)?;
        in_range(
            "dnsserver.max_subscriptions_per_connection",
            d.max_subscriptions_per_connection,
            1,
            16_777_216,
        )?;
        in_range(
            "dnsserver.max_subscriptions",
            d.max_subscriptions,
            1,
            268_435_456,
        )?;

        let r = &self.reporter;
        in_range("reporter.writers", r.writers, 1, 256)?;
        in_range("reporter.batch_rows", r.batch_rows, 1, 1_000_000)?;
        in_range("reporter.buffer_rows", r.buffer_rows, 1, 100_000_000)?;
        if r.buffer_rows < r.batch_rows {
            return Err(ConfigError::Invalid {
                field: "reporter.buffer_rows",
                value: r.buffer_rows.to_string(),
                allowed: format!("at least reporter.batch_rows ({})", r.batch_rows),
            });
        }
        in_range("reporter.retry_max_ms", r.retry_max_ms, 10, 600_000)?;
        loopback("reporter.metrics_addr", r.metrics_addr)?;
        in_range("reporter.max_connections", r.max_connections, 1, 1_000_000)?;
        in_range("reporter.idle_timeout", r.idle_timeout, 1, 86_400)?;
        in_range("reporter.read_timeout_ms", r.read_timeout_ms, 100, 600_000)?;
        in_range(
            "reporter.max_buffered_bytes",
            r.max_buffered_bytes,
            1 << 20,
            16 << 30,
        )?;

        self.admission.validate()?;
        self.shm.validate()?;
        let t = &self.tls;
        t.validate()?;
        t.check_plain("dnsserver.listen", d.listen.ip())?;
        t.check_plain("reporter.listen", r.listen.ip())?;
        for e in &a.route_servers {
            t.check_plain_endpoint("agent.route_servers", e)?;
        }
        for e in &a.reporters {
            t.check_plain_endpoint("agent.reporters", e)?;
        }
        Ok(())
    }
}

/// The smallest `agent.udp_rcvbuf_bytes` other than 0: a few datagrams
/// (the kernel counts each datagram's buffer, about 1 KiB for a small one).
const MIN_RCVBUF: u32 = 4096;
/// The largest `agent.udp_rcvbuf_bytes`: 64 MiB, seconds of datagrams.
const MAX_RCVBUF: u32 = 64 << 20;

fn in_range<T: PartialOrd + std::fmt::Display>(
    field: &'static str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        return Err(ConfigError::Invalid {
            field,
            value: v.to_string(),
            allowed: format!("{lo}..={hi}"),
        });
    }
    Ok(())
}

fn rate(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(ConfigError::Invalid {
            field,
            value: v.to_string(),
            allowed: "0.0..=1.0".into(),
        });
    }
    Ok(())
}

fn endpoints(field: &'static str, list: &[String]) -> Result<(), ConfigError> {
    let invalid = |value: String, allowed: &str| ConfigError::Invalid {
        field,
        value,
        allowed: allowed.into(),
    };
    if list.is_empty() {
        return Err(invalid("[]".into(), "at least one HOST:PORT"));
    }
    for e in list {
        let (host, port) = e
            .rsplit_once(':')
            .ok_or_else(|| invalid(format!("\"{e}\""), "HOST:PORT, e.g. 10.0.0.5:7777"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| invalid(format!("\"{e}\""), "HOST:PORT with a port in 1..=65535"))?;
        if host.is_empty() || port == 0 {
            return Err(invalid(
                format!("\"{e}\""),
                "HOST:PORT with a host and a port in 1..=65535",
            ));
        }
        // A literal address must parse; a name is resolved at connect time.
        if host.chars().all(|c| c.is_ascii_digit() || c == '.')
            && (host, port).to_socket_addrs().is_err()
        {
            return Err(invalid(
                format!("\"{e}\""),
                "a valid IPv4 address or host name before the port",
            ));
        }
    }
    Ok(())
}

fn loopback(field: &'static str, addr: SocketAddr) -> Result<(), ConfigError> {
    if !addr.ip().is_loopback() {
        return Err(ConfigError::Invalid {
            field,
            value: addr.to_string(),
            allowed: "a loopback address, e.g. 127.0.0.1:9888".into(),
        });
    }
    Ok(())
}

fn absolute(field: &'static str, p: &Path) -> Result<(), ConfigError> {
    if !p.is_absolute() {
        return Err(ConfigError::Invalid {
            field,
            value: format!("\"{}\"", p.display()),
            allowed: "an absolute path".into(),
        });
    }
    Ok(())
}

/// Sets `SECTION.FIELD=VALUE` in the table; VALUE is read as TOML (a number,
/// a boolean, an array, a quoted string), or else taken as a bare string.
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| ConfigError::Override {
        arg: arg.to_string(),
        why: why.to_string(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| bad("expected SECTION.FIELD=VALUE"))?;
    let (section, field) = key
        .trim()
        .split_once('.')
        .ok_or_else(|| bad("the key must be SECTION.FIELD, e.g. lb.probe_num"))?;
    if section.is_empty() || field.is_empty() || field.contains('.') {
        return Err(bad("the key must be SECTION.FIELD, e.g. lb.probe_num"));
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let entry = table
        .entry(section.to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let section_table = entry
        .as_table_mut()
        .ok_or_else(|| bad("that section is not a table in the config file"))?;
    section_table.insert(field.to_string(), value);
    Ok(())
}

/// Finds which `section.field` of `table` the deserializer refused (it
/// does not say: "invalid value: integer `99999`, expected u16"), by trying
/// each field alone over the defaults, and says what that field takes. None
/// when no single field is at fault (an unknown key, a section of the wrong
/// type: the parser's own message names those).
fn bad_value(origin: &str, table: &toml::Table) -> Option<ConfigError> {
    let defaults = toml::Table::try_from(Config::default()).ok()?;
    for (section, fields) in table {
        let toml::Value::Table(fields) = fields else {
            continue;
        };
        for (field, value) in fields {
            let mut one = defaults.clone();
            let Some(toml::Value::Table(into)) = one.get_mut(section) else {
                continue;
            };
            if !into.contains_key(field) {
                continue; // an unknown key: the parser's message names it
            }
            into.insert(field.clone(), value.clone());
            let Err(e) = Config::deserialize(toml::Value::Table(one)) else {
                continue;
            };
            return Some(ConfigError::BadValue {
                origin: origin.to_string(),
                field: format!("{section}.{field}"),
                value: value.to_string(),
                expected: expected(&e.to_string()),
            });
        }
    }
    None
}

/// What serde says a field expects, in words with the range for integers.
fn expected(message: &str) -> String {
    // "... expected u16 in `agent.base_port`": the type, without the path.
    let what = message.rsplit_once("expected ").map_or(message, |(_, w)| w);
    let what = what
        .split_whitespace()
        .take_while(|w| *w != "in")
        .collect::<Vec<_>>()
        .join(" ");
    let range = match what.as_str() {
        "u8" => "an integer in 0..=255",
        "u16" => "an integer in 0..=65535",
        "u32" => "an integer in 0..=4294967295",
        "u64" => "an integer in 0..=18446744073709551615",
        "i64" => "an integer",
        "f64" => "a number",
        _ => return what,
    };
    range.to_string()
}

fn parse_error(origin: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let location = e
        .span()
        .filter(|_| !text.is_empty())
        .map(|span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!(":{line}:{col}")
        })
        .unwrap_or_default();
    ConfigError::Parse {
        origin: origin.to_string(),
        location,
        message: e.message().split_whitespace().collect::<Vec<_>>().join(" "),
    }
}

#[cfg(test)]
mod tests;
