//! The store: routes, the route version, the change log and per-node call
//! status, in one schema with two backends.
//!
//! - `sqlite:PATH`: the embedded default, through rusqlite's bundled SQLite;
//!   the file and its schema are created on first use.
//! - `postgres://...` (or `postgresql://...`): production, through the
//!   `postgres` crate. Several route servers and reporters may share one.
//!
//! The tables follow the original's `dnsserver.sql`: `route_data` (modid,
//! cmdid, ip, port, plus weight), `route_version` (one row), `route_change`
//! (the change log: version, modid, cmdid) and `server_call_status`
//! (modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload, and
//! the agent run and report that carried the row: agent_start, seq).
//! Schema creation and upgrades are versioned migrations applied by
//! [`open`], idempotent.
//!
//! Nothing here runs on a request path: the route server answers from
//! memory and the reporter writes from background threads. A [`Store`] is
//! one connection; every thread that needs the store opens its own.
//! Every method is synchronous and either completes in one transaction or
//! changes nothing. After [`StoreError::Unavailable`] the same `Store` may
//! simply be called again: a PostgreSQL store whose connection was lost
//! connects again on the next call.
//!
//! # Values
//!
//! Every `u32` (modid, cmdid, an IPv4 address in host byte order, caller,
//! counts) is an integer column checked to `0..=4294967295` (`BIGINT` on
//! PostgreSQL, which has no unsigned types); ports are `1..=65535`;
//! weights `1..=`[`MAX_WEIGHT`], and a node added with weight 0 (the
//! wire's "unset") is stored with [`DEFAULT_WEIGHT`]; `ts` is seconds
//! since the epoch, at most `i64::MAX`. Writes outside these ranges fail
//! with [`StoreError::BadInput`] and change nothing (a call status batch
//! with one bad row is refused whole: [`CallStatus::check`] filters rows
//! first).
//!
//! # Versions
//!
//! Each `add_node` / `del_node` bumps the route version by one, under a
//! lock (SQLite's write lock; PostgreSQL's row lock on `route_version`), so
//! no two changes share a version, and logs its module with that version.
//! A module's version is its latest change's ([`ModuleRoute::version`]).
//!
//! # Bad rows
//!
//! The tables check their columns, but a row written around those checks
//! (a port 0, an address above 2^32, a negative count) must not stop a
//! route server. Reads skip such a row, print one line on stderr naming
//! the store, the table, the row and what is wrong (once per row per
//! connection), and count it in [`Store::bad_rows`]. A bad
//! `route_version` cannot be skipped: reads fail with
//! [`StoreError::BadInput`].
//!
//! # Layout
//!
//! - this file: the [`Store`] trait, the values it speaks, [`StoreError`].
//! - `sqlite` and `postgres`: the two backends.
//! - `pg_tls`: TLS to PostgreSQL (rustls) as the URL's `sslmode` asks.
//! - `migrations`: the schema's versions, applied at open.
//! - [`table`]: route import and export files (CSV, JSON lines).
#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::collections::{btree_map, BTreeMap, HashMap, HashSet};

use lbagent_model::{Labels, ModuleId, ModuleOptions, NodeAddr, NodeMeta, Policy, RouteNode, Zone};

mod migrations;
mod pg_tls;
mod postgres;
mod sqlite;
pub mod table;

pub use migrations::LATEST as SCHEMA_VERSION;

pub use lbagent_config::store_url::{redact, BadStoreUrl, StoreUrl};

impl From<BadStoreUrl> for StoreError {
    fn from(e: BadStoreUrl) -> Self {
        StoreError::BadUrl(e.0)
    }
}

/// One module's route as the store holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleRoute {
    /// The module.
    pub module: ModuleId,
    /// The module's version: the change-log version of its latest change,
    /// or the route version when the change log has no entry for it
    /// (rows written by hand). Every route server reading the same store
    /// derives the same version.
    pub version: u64,
    /// Its nodes, sorted by address. A node's weight is the capacity left:
    /// its weight as added less the units reported consumed
    /// ([`Store::consume`]).
    pub nodes: Vec<RouteNode>,
    /// How its nodes are chosen (`l5` unless set by [`Store::set_policy`]).
    pub policy: Policy,
    /// Its own options (none unless set by [`Store::set_options`]).
    pub options: ModuleOptions,
    /// The zones and labels of those of its nodes that have any, sorted by
    /// address (empty when no node has either: what the wire's
    /// `node_meta` carries).
    pub meta: Vec<(NodeAddr, NodeMeta)>,
}

/// Every route in the store, read in one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteSet {
    /// The route version at the time of the read.
    pub version: u64,
    /// Every module with at least one node, sorted by module.
    pub modules: Vec<ModuleRoute>,
}

/// What changed after a known route version, read in one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// The route version now.
    pub version: u64,
    /// The changed modules' routes as they are now; a module whose last
    /// node was deleted appears with no nodes.
    pub modules: Vec<ModuleRoute>,
}

/// One row of per-node call status: what `caller` saw of a node over the
/// statistics period ending at `ts`. Keyed by (module, node, caller); a new
/// row for the same key replaces the old (as the original's
/// `ON DUPLICATE KEY UPDATE`) unless it is older: see
/// [`CallStatus::supersedes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallStatus {
    /// The module called.
    pub module: ModuleId,
    /// The node called.
    pub node: NodeAddr,
    /// The reporting agent's IPv4 address (host byte order).
    pub caller: u32,
    /// Successful calls in the period.
    pub succ: u32,
    /// Failed calls in the period.
    pub err: u32,
    /// End of the period, seconds since the Unix epoch.
    pub ts: u64,
    /// Whether the agent held the node overloaded.
    pub overload: bool,
    /// The run of the agent whose report carried the row
    /// (`StatsReport.agent_start`); 0: unknown (an agent that predates the
    /// field, a reporter that does not store it, a row written by hand).
    pub agent_start: u64,
    /// The sequence number of that report in that run (0 with an unknown
    /// run).
    pub seq: u64,
}

/// Why a store operation failed. Admin errors (`Duplicate`, `NotFound`,
/// `BadInput`) changed nothing; `Unavailable` means the database could not
/// be reached or failed mid-transaction (which then rolled back).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store URL cannot be used.
    #[error("bad store URL: {0}")]
    BadUrl(String),
    /// `route add` of a node the module already has.
    #[error("module {module} already has node {node}: delete it first to change its weight")]
    Duplicate {
        /// The module.
        module: ModuleId,
        /// The node.
        node: NodeAddr,
    },
    /// `route del` of a node the module does not have.
    #[error("module {module} has no node {node}: `lbagent route list {} {}` shows its nodes", module.modid, module.cmdid)]
    NotFound {
        /// The module.
        module: ModuleId,
        /// The node.
        node: NodeAddr,
    },
    /// A value the store refuses (a weight out of range, a row that
    /// does not fit the schema).
    #[error("{0}")]
    BadInput(String),
    /// The database refused or could not be reached; says which and why.
    #[error("store {url} unavailable: {why}")]
    Unavailable {
        /// The store, password redacted.
        url: String,
        /// What the database or the system said.
        why: String,
    },
    /// `sqlite:PATH` names no file, and the caller did not ask to create
    /// one.
    #[error("store {url} does not exist (nothing was created): check the path")]
    Missing {
        /// The store.
        url: String,
    },
    /// The SQLite file this connection opened was deleted or replaced
    /// while open: what is read or written there no one else sees.
    #[error("store {url} changed under this process: {why}; reopening it")]
    Replaced {
        /// The store.
        url: String,
        /// Deleted or replaced, and the path.
        why: String,
    },
    /// The database holds a schema newer than this binary knows.
    #[error("store {url} has schema version {found}, newer than this lbagent's {known}: upgrade lbagent")]
    SchemaTooNew {
        /// The store, password redacted.
        url: String,
        /// The schema version found.
        found: u32,
        /// The newest version this binary knows.
        known: u32,
    },
}

/// One connection to the store. Every method runs in one transaction.
pub trait Store: Send {
    /// `sqlite` or `postgres`.
    fn backend(&self) -> &'static str;

    /// The current route version (0 for a new store).
    fn route_version(&mut self) -> Result<u64, StoreError>;

    /// Every route, with the route version, in one transaction.
    fn load_all(&mut self) -> Result<RouteSet, StoreError>;

    /// The modules the change log lists with a version above `version`,
    /// with their current routes, and the route version now.
    fn changes_since(&mut self, version: u64) -> Result<Changes, StoreError>;

    /// Adds `node` to `module` with no zone and no label: as
    /// [`Store::add_node_meta`].
    ///
    /// # Errors
    /// As [`Store::add_node_meta`].
    fn add_node(&mut self, module: ModuleId, node: RouteNode) -> Result<u64, StoreError> {
        self.add_node_meta(module, node, &NodeMeta::default())
    }

    /// Adds `node` to `module` with its zone and labels (`meta`): one
    /// transaction that inserts the node, bumps the route version and
    /// appends the module to the change log. Returns the new route version.
    ///
    /// # Errors
    /// [`StoreError::Duplicate`] when the module has the node already;
    /// [`StoreError::BadInput`] for port 0 or a weight above
    /// [`MAX_WEIGHT`] (weight 0 is stored as [`DEFAULT_WEIGHT`]); both
    /// change nothing.
    fn add_node_meta(
        &mut self,
        module: ModuleId,
        node: RouteNode,
        meta: &NodeMeta,
    ) -> Result<u64, StoreError>;

    /// Sets the zone and labels of `module`'s node `node` to `meta` (an
    /// empty one clears both), in one transaction like
    /// [`Store::add_node_meta`]. Returns the new route version.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the module has no such node; it
    /// changes nothing.
    fn set_meta(
        &mut self,
        module: ModuleId,
        node: NodeAddr,
        meta: &NodeMeta,
    ) -> Result<u64, StoreError>;

    /// Deletes `node` from `module`, in one transaction like
    /// [`Store::add_node`]. Returns the new route version.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when the module has no such node; it
    /// changes nothing.
    fn del_node(&mut self, module: ModuleId, node: NodeAddr) -> Result<u64, StoreError>;

    /// Applies a whole route table in one transaction that bumps the
    /// route version once and logs every module of `rows` with that
    /// version. Without `replace` it adds the nodes to what the modules
    /// have; with `replace` each module named in `rows` ends with exactly
    /// its rows (modules not named are untouched). No rows: nothing
    /// changes. Returns what was applied. Batched: one prepared statement
    /// (SQLite) or array statements (PostgreSQL), not a round trip a row.
    ///
    /// # Errors
    /// [`StoreError::BadInput`] when a row fails [`check_node`] or
    /// repeats a (module, node) of `rows` (weight 0 is a node with no
    /// capacity left: [`check_imported_node`]);
    /// [`StoreError::Duplicate`] (without `replace`) when a module already
    /// has a node of `rows`. Either changes nothing.
    fn import_routes(
        &mut self,
        rows: &[(ModuleId, RouteNode)],
        replace: bool,
    ) -> Result<Imported, StoreError> {
        self.import_table(rows, &[], replace)
    }

    /// [`Store::import_routes`] of `rows` whose nodes named in `meta`
    /// carry that zone and those labels (the others none). A `meta` entry
    /// naming no row of `rows` is refused.
    ///
    /// # Errors
    /// As [`Store::import_routes`], and [`StoreError::BadInput`] for a
    /// `meta` entry naming no row, or one row twice.
    fn import_table(
        &mut self,
        rows: &[(ModuleId, RouteNode)],
        meta: &[TableMeta],
        replace: bool,
    ) -> Result<Imported, StoreError>;

    /// Sets `module`'s policy, in one transaction like
    /// [`Store::add_node`] (the route version is bumped and the module
    /// logged, so every agent sees it within a push). The module need not
    /// have nodes yet. Returns the new route version.
    fn set_policy(&mut self, module: ModuleId, policy: Policy) -> Result<u64, StoreError>;

    /// Sets `module`'s own options (each None: the agent's default), in
    /// one transaction like [`Store::set_policy`], keeping its policy.
    /// Returns the new route version.
    ///
    /// # Errors
    /// [`StoreError::BadInput`] naming an option out of its range;
    /// [`StoreError::Unavailable`] when the store cannot be written.
    fn set_options(&mut self, module: ModuleId, options: ModuleOptions) -> Result<u64, StoreError>;

    /// Records capacity units consumed for good, `(module, node, units)`
    /// per row, in one transaction: each node's consumed units grow by
    /// `units` but never past its weight (the capacity left never goes
    /// below 0). When some node changed, the route version is bumped once
    /// and every module changed is logged. Rows naming no node of the
    /// store are skipped (the node was deleted meanwhile). Returns what was
    /// applied.
    ///
    /// # Errors
    /// [`StoreError::BadInput`] when a row's units are 0 or above
    /// [`MAX_WEIGHT`]: the whole batch is refused.
    fn consume(&mut self, rows: &[(ModuleId, NodeAddr, u32)]) -> Result<Consumed, StoreError>;

    /// [`Self::consume`] for the report `key` names, exactly once: in the
    /// same transaction the report is recorded (`consumed_report`), and a
    /// report recorded already is not applied again (`Ok(None)`). Records
    /// older than [`CONSUMED_REPORT_KEEP_S`] (by `now_s`, Unix seconds)
    /// are deleted in the same transaction.
    ///
    /// # Errors
    /// As [`Self::consume`]; nothing is recorded then.
    fn consume_once(
        &mut self,
        key: ReportKey,
        rows: &[(ModuleId, NodeAddr, u32)],
        now_s: u64,
    ) -> Result<Option<Consumed>, StoreError>;

    /// Every route, or one module's, sorted by module and node.
    fn list(&mut self, module: Option<ModuleId>) -> Result<Vec<ModuleRoute>, StoreError>;

    /// Writes a batch of call status rows in one transaction (insert, or
    /// replace the row of the same module, node and caller; the same key
    /// twice in one batch: the last wins). Thousands of rows per call is
    /// the intended use.
    ///
    /// # Errors
    /// [`StoreError::BadInput`] when a row fails [`CallStatus::check`]:
    /// the whole batch is refused.
    fn upsert_status(&mut self, rows: &[CallStatus]) -> Result<(), StoreError>;

    /// The call status rows, or one module's, sorted by module, node and
    /// caller.
    fn call_status(&mut self, module: Option<ModuleId>) -> Result<Vec<CallStatus>, StoreError>;

    /// How many bad rows (see the module's "Bad rows") the last read
    /// skipped: a figure for metrics. 0 before any read.
    fn bad_rows(&self) -> u64 {
        0
    }

    /// Waits at most `timeout` for the store to announce a route change
    /// (PostgreSQL: `LISTEN`/`NOTIFY`; every admin change and import
    /// announces itself when it commits). The first call on a connection
    /// starts listening and answers [`Wake::Changed`] at once, since a
    /// change may have committed before it listened; a connection made
    /// again after a loss listens again.
    ///
    /// The default, for stores that cannot announce changes (SQLite),
    /// answers [`Wake::Unsupported`] at once: the caller polls.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the connection fails while it
    /// listens or waits.
    fn wait_for_change(&mut self, timeout: std::time::Duration) -> Result<Wake, StoreError> {
        let _ = timeout;
        Ok(Wake::Unsupported)
    }
}

/// What [`Store::wait_for_change`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// A change was announced (or may have been missed): read the route
    /// version now.
    Changed,
    /// No change was announced within the timeout.
    Quiet,
    /// This store announces no change: poll it.
    Unsupported,
}

/// One row of a route table: a module and one of its nodes.
pub type TableRow = (ModuleId, RouteNode);

/// The zone and labels of one node of a route table (rows without any
/// have no entry).
pub type TableMeta = (ModuleId, NodeAddr, NodeMeta);

/// What [`Store::consume`] applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Consumed {
    /// The route version now (unchanged when no node changed).
    pub version: u64,
    /// The nodes whose capacity left went down.
    pub nodes: usize,
}

/// What names one statistics report for good: the caller it was stored
/// under, the agent's run number (`StatsReport.agent_start`, never 0) and
/// the report's sequence number in that run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReportKey {
    /// The caller (IPv4, host byte order) its rows are stored under.
    pub caller: u32,
    /// The agent run's number.
    pub agent_start: u64,
    /// The report's sequence number.
    pub seq: u64,
}

impl ReportKey {
    /// The key as the store's signed 64-bit columns hold it (the bits of
    /// each `u64`, reinterpreted).
    pub fn columns(&self) -> (i64, i64, i64) {
        (
            i64::from(self.caller),
            self.agent_start as i64,
            self.seq as i64,
        )
    }
}

/// How long [`Store::consume_once`] remembers a report, seconds (7 days):
/// far past any agent's re-send (an agent keeps a report only while it
/// runs and its bounded queue holds it).
pub const CONSUMED_REPORT_KEEP_S: u64 = 7 * 24 * 3600;

/// The rows of [`Store::consume`], checked.
///
/// # Errors
/// [`StoreError::BadInput`] naming the first row whose units are 0 or
/// above [`MAX_WEIGHT`].
pub fn check_consumed(rows: &[(ModuleId, NodeAddr, u32)]) -> Result<(), StoreError> {
    match rows.iter().find(|r| r.2 == 0 || r.2 > MAX_WEIGHT) {
        Some((module, node, units)) => Err(StoreError::BadInput(format!(
            "module {module} node {node}: {units} units consumed is out of range: use 1..={MAX_WEIGHT}"
        ))),
        None => Ok(()),
    }
}

/// What [`Store::import_routes`] applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Imported {
    /// The route version now (unchanged for an empty table).
    pub version: u64,
    /// The modules touched (each logged in the change log).
    pub modules: usize,
    /// The nodes written.
    pub nodes: usize,
}

// === open ===

/// The largest weight the store keeps. Weights are `1..=MAX_WEIGHT`; a
/// node added with weight 0 (the wire's "unset") is stored with
/// [`DEFAULT_WEIGHT`].
pub const MAX_WEIGHT: u32 = 1_000_000;

/// The weight a node added with weight 0 ("unset") is stored with.
pub const DEFAULT_WEIGHT: u32 = 1;

/// How long a PostgreSQL connection attempt may take when the URL sets no
/// `connect_timeout`.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a SQLite connection waits for another process's write lock
/// before it gives up with [`StoreError::Unavailable`].
pub const SQLITE_BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `url` with the CA bundle `ca` (the `[tls] ca` of the configuration) as
/// its `sslrootcert=` when it is a PostgreSQL URL whose `sslmode` is
/// `verify-ca` or `verify-full` and that names no `sslrootcert=` itself;
/// any other URL unchanged.
pub fn with_default_ca(url: StoreUrl, ca: &std::path::Path) -> StoreUrl {
    match url {
        StoreUrl::Postgres(u) => StoreUrl::Postgres(pg_tls::with_default_ca(&u, ca)),
        other => other,
    }
}

/// Opens one connection to the store at `url` and brings its schema up to
/// [`SCHEMA_VERSION`].
///
/// SQLite: creates the file's directory and the file when missing, and
/// puts the database in WAL mode (readers never wait for the writer);
/// writers wait up to [`SQLITE_BUSY_TIMEOUT`] for each other. PostgreSQL:
/// connects within the URL's `connect_timeout` (default
/// [`CONNECT_TIMEOUT`]); TLS (rustls) when the URL's `sslmode` is
/// `require`, `verify-ca` or `verify-full` (`sslrootcert=`, `sslcert=`,
/// `sslkey=` as in libpq); `prefer`, the default, and `disable` talk
/// plain TCP.
///
/// Migrations are idempotent and safe when several processes open the
/// same store at once: they run in one transaction under SQLite's write
/// lock or a PostgreSQL advisory lock (per schema), and each re-reads
/// `schema_version` once it holds the lock. A store already current is
/// opened without taking any lock.
///
/// # Errors
/// [`StoreError::Unavailable`] when the database cannot be reached,
/// created or migrated (the message names the store, password redacted,
/// and says why, for TLS which check failed); [`StoreError::BadUrl`] for
/// a PostgreSQL URL that does not parse or whose TLS files cannot be read; [`StoreError::SchemaTooNew`] when the store was migrated by a
/// newer lbagent.
pub fn open(url: &StoreUrl) -> Result<Box<dyn Store>, StoreError> {
    match url {
        StoreUrl::Sqlite(path) => Ok(Box::new(sqlite::SqliteStore::open(path, true)?)),
        StoreUrl::Postgres(url) => self::postgres::PostgresStore::open(url),
    }
}

/// [`open`], except that a SQLite file is never created: a path that names
/// no file fails with [`StoreError::Missing`]. What `lbagent route` uses
/// (unless `--create`), and what the servers use to reopen a store after a
/// failure, so that a deleted file is never silently replaced by an empty
/// one. PostgreSQL: as [`open`] (the database must exist either way).
///
/// # Errors
/// As [`open`], and [`StoreError::Missing`].
pub fn open_existing(url: &StoreUrl) -> Result<Box<dyn Store>, StoreError> {
    match url {
        StoreUrl::Sqlite(path) => Ok(Box::new(sqlite::SqliteStore::open(path, false)?)),
        StoreUrl::Postgres(url) => self::postgres::PostgresStore::open(url),
    }
}

// === checks on what is written ===

/// `node` as the store keeps it: weight 0 becomes [`DEFAULT_WEIGHT`].
///
/// # Errors
/// [`StoreError::BadInput`] for port 0, an address that is not unicast
/// (0.0.0.0, 255.255.255.255, multicast) or a weight above [`MAX_WEIGHT`].
pub fn check_node(module: ModuleId, node: RouteNode) -> Result<RouteNode, StoreError> {
    check_addr(module, node.addr)?;
    let ip = std::net::Ipv4Addr::from(node.addr.ip);
    if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
        return Err(StoreError::BadInput(format!(
            "module {module} node {}: {ip} is not a unicast address: a node needs one",
            node.addr
        )));
    }
    if node.weight > MAX_WEIGHT {
        return Err(StoreError::BadInput(format!(
            "module {module} node {}: weight {} is out of range: use 1..={MAX_WEIGHT}",
            node.addr, node.weight
        )));
    }
    let weight = if node.weight == 0 {
        DEFAULT_WEIGHT
    } else {
        node.weight
    };
    Ok(RouteNode { weight, ..node })
}

/// A node of an imported table: [`check_node`], but a weight of 0 is
/// kept: in a table it is the capacity left, and 0 is a node with none
/// left (a fully consumed `balance` node, as `route export` writes it).
/// The store keeps such a node as weight 1 with 1 unit consumed, so that
/// it serves, and exports again, 0: export then `import --replace` is
/// the identity.
///
/// # Errors
/// Those of [`check_node`].
pub fn check_imported_node(module: ModuleId, node: RouteNode) -> Result<RouteNode, StoreError> {
    let checked = check_node(module, node)?;
    Ok(RouteNode {
        weight: node.weight,
        ..checked
    })
}

/// How an imported node's weight is stored: `(weight, consumed)`. A row
/// of weight 0 (no capacity left) is weight 1 with 1 unit consumed.
pub fn stored_weight(table_weight: u32) -> (u32, u32) {
    if table_weight == 0 {
        (1, 1)
    } else {
        (table_weight, 0)
    }
}

/// The rows of an import checked as [`Store::import_routes`] says, the
/// zones and labels of `meta` by (module, node), and the distinct modules
/// the rows name, sorted.
pub(crate) fn prepare_import<'m>(
    rows: &[(ModuleId, RouteNode)],
    meta: &'m [TableMeta],
) -> Result<PreparedImport<'m>, StoreError> {
    let mut seen = HashSet::with_capacity(rows.len());
    let mut out = Vec::with_capacity(rows.len());
    for &(module, node) in rows {
        let node = check_imported_node(module, node)?;
        if !seen.insert((module, node.addr)) {
            return Err(StoreError::BadInput(format!(
                "module {module} node {} is listed twice",
                node.addr
            )));
        }
        out.push((module, node));
    }
    let mut by_node = HashMap::with_capacity(meta.len());
    for (module, addr, m) in meta {
        if !seen.contains(&(*module, *addr)) {
            return Err(StoreError::BadInput(format!(
                "module {module} node {addr}: a zone or labels are given for a node the table does not list"
            )));
        }
        if by_node.insert((*module, *addr), m).is_some() {
            return Err(StoreError::BadInput(format!(
                "module {module} node {addr}: its zone and labels are given twice"
            )));
        }
    }
    let modules: std::collections::BTreeSet<ModuleId> = out.iter().map(|r| r.0).collect();
    Ok(PreparedImport {
        rows: out,
        meta: by_node,
        modules: modules.into_iter().collect(),
    })
}

/// An import checked by [`prepare_import`].
pub(crate) struct PreparedImport<'m> {
    /// The rows, checked, in the table's order.
    pub rows: Vec<TableRow>,
    /// The zones and labels of the nodes that have any.
    pub meta: HashMap<(ModuleId, NodeAddr), &'m NodeMeta>,
    /// The modules the rows name, sorted.
    pub modules: Vec<ModuleId>,
}

impl PreparedImport<'_> {
    /// The `zone` and `labels` columns of row `(module, addr)`.
    pub fn columns(&self, module: ModuleId, addr: NodeAddr) -> (Option<String>, Option<String>) {
        self.meta
            .get(&(module, addr))
            .map_or((None, None), |m| meta_columns(m))
    }
}

/// A node's `zone` and `labels` columns: NULL for none; the labels as
/// `k=v,k2=v2`, sorted by key ([`Labels`]'s text).
pub(crate) fn meta_columns(meta: &NodeMeta) -> (Option<String>, Option<String>) {
    (
        meta.zone.as_ref().map(|z| z.as_str().to_string()),
        (!meta.labels.is_empty()).then(|| meta.labels.to_string()),
    )
}

fn check_addr(module: ModuleId, addr: NodeAddr) -> Result<(), StoreError> {
    if addr.port == 0 {
        return Err(StoreError::BadInput(format!(
            "module {module} node {addr}: port 0 is not a service port: use 1..=65535"
        )));
    }
    Ok(())
}

impl CallStatus {
    /// Whether the store can keep this row.
    ///
    /// # Errors
    /// [`StoreError::BadInput`] for port 0 or a `ts` above `i64::MAX`.
    pub fn check(&self) -> Result<(), StoreError> {
        check_addr(self.module, self.node)?;
        if i64::try_from(self.ts).is_err() {
            return Err(StoreError::BadInput(format!(
                "call status of module {} node {} from {}: ts {} is out of range",
                self.module,
                self.node,
                std::net::Ipv4Addr::from(self.caller),
                self.ts
            )));
        }
        Ok(())
    }

    /// The row's key: module, node, caller.
    pub fn key(&self) -> (ModuleId, NodeAddr, u32) {
        (self.module, self.node, self.caller)
    }

    /// Whether this row may replace `stored`, a row of the same key: always,
    /// except when both come from the same known run of the same agent and
    /// this one from an earlier report (a lower `seq`): a re-sent report
    /// that reaches a reporter after a newer one must not undo it. The
    /// order within a run is the agent's own sequence, not a clock, so a
    /// host's clock stepping back changes nothing; rows of different runs,
    /// or of an unknown run (0), replace as they come, as before.
    ///
    /// Both stores apply the same rule in their upsert's `WHERE`; the
    /// reporter's buffer and [`Store::upsert_status`]'s batch apply it
    /// among the rows they hold.
    pub fn supersedes(&self, stored: &CallStatus) -> bool {
        let same_run = self.agent_start != 0 && self.agent_start == stored.agent_start;
        !(same_run && self.seq < stored.seq)
    }
}

/// `rows` checked, with the newest row of each key kept (the last of
/// those that [`CallStatus::supersedes`] the one before), sorted by key:
/// one statement may then write them all, and concurrent writers lock rows
/// in the same order.
pub(crate) fn prepare_status(rows: &[CallStatus]) -> Result<Vec<CallStatus>, StoreError> {
    let mut newest: BTreeMap<_, CallStatus> = BTreeMap::new();
    for row in rows {
        row.check()?;
        match newest.entry(row.key()) {
            btree_map::Entry::Occupied(mut e) => {
                if row.supersedes(e.get()) {
                    e.insert(*row);
                }
            }
            btree_map::Entry::Vacant(e) => {
                e.insert(*row);
            }
        }
    }
    Ok(newest.into_values().collect())
}

// === reading rows that may be wrong (the module's "Bad rows") ===

/// A `route_data` row as read.
pub(crate) struct RouteRow {
    pub modid: i64,
    pub cmdid: i64,
    pub ip: i64,
    pub port: i64,
    pub weight: i64,
    /// The `zone` column.
    pub zone: TextCol,
    /// The `labels` column.
    pub labels: TextCol,
}

/// A text column as read: NULL, text, or a value of another type (only a
/// table edited around its checks holds one).
pub(crate) enum TextCol {
    /// NULL.
    Null,
    /// Text.
    Text(String),
    /// Neither NULL nor text.
    NotText,
}

impl TextCol {
    fn is_null(&self) -> bool {
        matches!(self, TextCol::Null)
    }
}

/// The longest `labels` column read: 16 labels of a 63-byte key and a
/// 63-byte value, `=` and `,` between.
pub(crate) const MAX_LABELS_TEXT: usize =
    lbagent_model::MAX_LABELS * (2 * lbagent_model::MAX_NAME_LEN + 2) - 1;

/// A row's `zone` and `labels` columns read back, checked with the model's
/// bounds (a database row is input too).
fn parse_meta(zone: &TextCol, labels: &TextCol) -> Result<NodeMeta, String> {
    let zone = match zone {
        TextCol::Null => None,
        TextCol::NotText => return Err("zone is not text".into()),
        TextCol::Text(z) => Some(z.parse::<Zone>().map_err(|e| format!("zone: {e}"))?),
    };
    let labels = match labels {
        TextCol::Null => Labels::default(),
        TextCol::NotText => return Err("labels is not text".into()),
        TextCol::Text(l) if l.len() > MAX_LABELS_TEXT => {
            return Err(format!(
                "labels is {} bytes long: 16 labels take at most {MAX_LABELS_TEXT}",
                l.len()
            ))
        }
        TextCol::Text(l) => l.parse::<Labels>().map_err(|e| format!("labels: {e}"))?,
    };
    Ok(NodeMeta { zone, labels })
}

/// A `route_policy` row as read; an option column read as NULL is
/// negative (SQLite: `COALESCE(…, -1)`; PostgreSQL: `int`'s `i64::MIN`).
pub(crate) struct PolicyRow {
    pub modid: i64,
    pub cmdid: i64,
    pub policy: i64,
    pub slow_start_ms: i64,
    pub max_overloaded_percent: i64,
    pub panic_percent: i64,
    pub locality_min_percent: i64,
}

impl PolicyRow {
    fn parse(&self) -> Result<(ModuleId, (Policy, ModuleOptions)), String> {
        let module = module_of(self.modid, self.cmdid)?;
        let policy = u8::try_from(self.policy)
            .ok()
            .and_then(Policy::from_code)
            .ok_or(format!(
                "policy {} is not 0 (l5), 1 (balance) or 2 (p2c)",
                self.policy
            ))?;
        fn opt<T: TryFrom<i64>>(name: &str, v: i64) -> Result<Option<T>, String> {
            if v < 0 {
                return Ok(None);
            }
            T::try_from(v)
                .map(Some)
                .map_err(|_| format!("{name} {v} is out of range"))
        }
        let options = ModuleOptions {
            slow_start_ms: opt("slow_start_ms", self.slow_start_ms)?,
            max_overloaded_percent: opt("max_overloaded_percent", self.max_overloaded_percent)?,
            panic_percent: opt("panic_percent", self.panic_percent)?,
            locality_min_percent: opt("locality_min_percent", self.locality_min_percent)?,
        };
        options.validate().map_err(|e| e.to_string())?;
        Ok((module, (policy, options)))
    }

    fn describe(&self) -> String {
        format!(
            "route_policy row (modid={}, cmdid={}, policy={})",
            self.modid, self.cmdid, self.policy
        )
    }
}

/// A `route_change` row, or one module's latest change, as read.
pub(crate) struct ChangeRow {
    pub modid: i64,
    pub cmdid: i64,
    pub version: i64,
}

/// A `server_call_status` row as read.
pub(crate) struct StatusRow {
    pub modid: i64,
    pub cmdid: i64,
    pub ip: i64,
    pub port: i64,
    pub caller: i64,
    pub succ: i64,
    pub err: i64,
    pub ts: i64,
    pub overload: i64,
    pub agent_start: i64,
    pub seq: i64,
}

fn u32_col(name: &str, v: i64) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("{name} {v} is not in 0..=4294967295"))
}

fn port_col(v: i64) -> Result<u16, String> {
    match u16::try_from(v) {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(format!("port {v} is not in 1..=65535")),
    }
}

fn module_of(modid: i64, cmdid: i64) -> Result<ModuleId, String> {
    Ok(ModuleId::new(
        u32_col("modid", modid)?,
        u32_col("cmdid", cmdid)?,
    ))
}

impl RouteRow {
    /// The row's zone and labels; None for none.
    fn meta(&self) -> Option<Result<NodeMeta, String>> {
        if self.zone.is_null() && self.labels.is_null() {
            return None;
        }
        Some(parse_meta(&self.zone, &self.labels))
    }

    fn parse(&self) -> Result<(ModuleId, RouteNode), String> {
        let module = module_of(self.modid, self.cmdid)?;
        let ip = u32_col("ip", self.ip)?;
        let port = port_col(self.port)?;
        let weight = match u32::try_from(self.weight) {
            Ok(w) if w <= MAX_WEIGHT => w,
            _ => return Err(format!("weight {} is not in 1..={MAX_WEIGHT}", self.weight)),
        };
        let addr = NodeAddr { ip, port };
        Ok((module, RouteNode { addr, weight }))
    }

    fn describe(&self) -> String {
        format!(
            "route_data row (modid={}, cmdid={}, ip={}, port={}, weight={})",
            self.modid, self.cmdid, self.ip, self.port, self.weight
        )
    }
}

impl ChangeRow {
    fn parse(&self) -> Result<(ModuleId, u64), String> {
        let module = module_of(self.modid, self.cmdid)?;
        let version = u64::try_from(self.version)
            .map_err(|_| format!("version {} is negative", self.version))?;
        Ok((module, version))
    }

    fn describe(&self) -> String {
        format!(
            "route_change row (version={}, modid={}, cmdid={})",
            self.version, self.modid, self.cmdid
        )
    }
}

impl StatusRow {
    fn parse(&self) -> Result<CallStatus, String> {
        let module = module_of(self.modid, self.cmdid)?;
        let node = NodeAddr {
            ip: u32_col("ip", self.ip)?,
            port: port_col(self.port)?,
        };
        let ts = u64::try_from(self.ts).map_err(|_| format!("ts {} is negative", self.ts))?;
        let overload = match self.overload {
            0 => false,
            1 => true,
            v => return Err(format!("overload {v} is neither 0 nor 1")),
        };
        Ok(CallStatus {
            module,
            node,
            caller: u32_col("caller", self.caller)?,
            succ: u32_col("succ_cnt", self.succ)?,
            err: u32_col("err_cnt", self.err)?,
            ts,
            overload,
            // The bits of the agent's u64s, as written.
            agent_start: self.agent_start as u64,
            seq: self.seq as u64,
        })
    }

    fn describe(&self) -> String {
        format!(
            "server_call_status row (modid={}, cmdid={}, ip={}, port={}, caller={}, succ_cnt={}, err_cnt={}, ts={}, overload={})",
            self.modid, self.cmdid, self.ip, self.port, self.caller, self.succ, self.err, self.ts, self.overload
        )
    }
}

/// The route version as read, checked.
pub(crate) fn version_of(url: &str, v: Option<i64>) -> Result<u64, StoreError> {
    match v {
        None => Ok(0),
        Some(v) => u64::try_from(v).map_err(|_| {
            StoreError::BadInput(format!(
                "store {url}: route_version.version is {v}: it must be 0 or more; fix the row by hand"
            ))
        }),
    }
}

/// Skips and reports bad rows for one connection.
pub(crate) struct BadRows {
    url: String,
    reported: HashSet<String>,
    last: u64,
}

impl BadRows {
    pub fn new(url: String) -> Self {
        Self {
            url,
            reported: HashSet::new(),
            last: 0,
        }
    }

    /// Starts a read: the count restarts.
    pub fn start(&mut self) {
        self.last = 0;
    }

    /// Rows skipped by the last read.
    pub fn count(&self) -> u64 {
        self.last
    }

    fn skip(&mut self, row: String, why: String) {
        self.last += 1;
        // Once per row per connection: a route server re-reads every few seconds.
        if self.reported.len() < 10_000 && self.reported.insert(row.clone()) {
            tracing::warn!("store {}: skipping bad {row}: {why}", self.url);
        }
    }

    /// The good rows, and the zones and labels of those that have any. A
    /// row whose zone or labels break the model's bounds is served
    /// without them: the node stays, its metadata is refused (logged once
    /// naming the module and node, and counted).
    pub fn routes(&mut self, rows: Vec<RouteRow>) -> (Vec<(ModuleId, RouteNode)>, Vec<TableMeta>) {
        let mut nodes = Vec::with_capacity(rows.len());
        let mut metas = Vec::new();
        for r in rows {
            let (module, node) = match r.parse() {
                Ok(ok) => ok,
                Err(why) => {
                    self.skip(r.describe(), why);
                    continue;
                }
            };
            match r.meta() {
                None => {}
                Some(Ok(m)) if m.is_empty() => {}
                Some(Ok(m)) => metas.push((module, node.addr, m)),
                Some(Err(why)) => self.skip(
                    format!("zone or labels of module {module} node {}", node.addr),
                    format!(
                        "{why}; the node is served without its zone and labels: set them again with `lbagent route meta {} {} {}`",
                        module.modid, module.cmdid, node.addr
                    ),
                ),
            }
            nodes.push((module, node));
        }
        (nodes, metas)
    }

    pub fn changes(&mut self, rows: Vec<ChangeRow>) -> BTreeMap<ModuleId, u64> {
        let mut latest = BTreeMap::new();
        for r in rows {
            match r.parse() {
                Ok((module, v)) => {
                    let e = latest.entry(module).or_insert(v);
                    *e = (*e).max(v);
                }
                Err(why) => self.skip(r.describe(), why),
            }
        }
        latest
    }

    pub fn policies(
        &mut self,
        rows: Vec<PolicyRow>,
    ) -> BTreeMap<ModuleId, (Policy, ModuleOptions)> {
        rows.into_iter()
            .filter_map(|r| r.parse().map_err(|why| self.skip(r.describe(), why)).ok())
            .collect()
    }

    pub fn statuses(&mut self, rows: Vec<StatusRow>) -> Vec<CallStatus> {
        let mut out: Vec<CallStatus> = rows
            .into_iter()
            .filter_map(|r| r.parse().map_err(|why| self.skip(r.describe(), why)).ok())
            .collect();
        out.sort_unstable_by_key(CallStatus::key);
        out
    }
}

/// Groups nodes into modules, sorted by module and node, each with its
/// version: its latest change in `latest`, else `route_version`, and its
/// policy in `policies` (else `l5`). Modules in `keep` appear even with no
/// node (a module whose last node was deleted); the others only with nodes.
pub(crate) fn assemble(
    route_version: u64,
    latest: &BTreeMap<ModuleId, u64>,
    (nodes, metas): (Vec<(ModuleId, RouteNode)>, Vec<TableMeta>),
    keep: impl IntoIterator<Item = ModuleId>,
    policies: &BTreeMap<ModuleId, (Policy, ModuleOptions)>,
) -> Vec<ModuleRoute> {
    let mut meta_of: BTreeMap<ModuleId, Vec<(NodeAddr, NodeMeta)>> = BTreeMap::new();
    for (m, addr, meta) in metas {
        meta_of.entry(m).or_default().push((addr, meta));
    }
    let mut by_module: BTreeMap<ModuleId, Vec<RouteNode>> = BTreeMap::new();
    for m in keep {
        by_module.entry(m).or_default();
    }
    for (m, n) in nodes {
        by_module.entry(m).or_default().push(n);
    }
    by_module
        .into_iter()
        .map(|(module, mut nodes)| {
            nodes.sort_unstable_by_key(|n| n.addr);
            let version = latest.get(&module).copied().unwrap_or(route_version);
            let (policy, options) = policies.get(&module).copied().unwrap_or_default();
            let mut meta = meta_of.remove(&module).unwrap_or_default();
            meta.sort_unstable_by_key(|(addr, _)| *addr);
            ModuleRoute {
                module,
                version,
                nodes,
                policy,
                options,
                meta,
            }
        })
        .collect()
}

/// An error and its causes, `: `-separated, for [`StoreError::Unavailable`].
pub(crate) fn why(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_s = c.to_string();
        if !s.contains(&c_s) {
            s.push_str(": ");
            s.push_str(&c_s);
        }
        cause = c.source();
    }
    s
}
