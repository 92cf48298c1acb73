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
//! (modid, cmdid, ip, port, caller, succ_cnt, err_cnt, ts, overload).
//! Schema creation and upgrades are versioned migrations applied by
//! [`open`], idempotent.
//!
//! Nothing here runs on a request path: the route server answers from
//! memory and the reporter writes from background threads. A [`Store`] is
//! one connection; every thread that needs the store opens its own.
//! Every method is synchronous and either completes in one transaction or
//! changes nothing.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::model::{ModuleId, NodeAddr, RouteNode};

/// Where the store is: parsed from `sqlite:PATH` or a `postgres://` URL.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// The embedded SQLite database file (created with its directory).
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (`postgres://` or `postgresql://`).
    Postgres(String),
}

impl FromStr for StoreUrl {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, StoreError> {
        if let Some(path) = s.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err(StoreError::BadUrl(format!(
                    "`{s}` has no path: write sqlite:PATH, e.g. sqlite:./lbagent-data/lbagent.db"
                )));
            }
            return Ok(StoreUrl::Sqlite(PathBuf::from(path)));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(StoreUrl::Postgres(s.to_string()));
        }
        Err(StoreError::BadUrl(format!(
            "`{s}` is neither sqlite:PATH nor a postgres:// URL"
        )))
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Sqlite(p) => write!(f, "sqlite:{}", p.display()),
            StoreUrl::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A URL with its password replaced by `***`, for logs and errors.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some(parts) => parts,
        None => return url.to_string(),
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
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
    /// Its nodes, sorted by address.
    pub nodes: Vec<RouteNode>,
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
/// `ON DUPLICATE KEY UPDATE`).
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

    /// Adds `node` to `module`: one transaction that inserts the node,
    /// bumps the route version and appends the module to the change log.
    /// Returns the new route version.
    fn add_node(&mut self, module: ModuleId, node: RouteNode) -> Result<u64, StoreError>;

    /// Deletes `node` from `module`, in one transaction like
    /// [`Store::add_node`]. Returns the new route version.
    fn del_node(&mut self, module: ModuleId, node: NodeAddr) -> Result<u64, StoreError>;

    /// Every route, or one module's, sorted by module and node.
    fn list(&mut self, module: Option<ModuleId>) -> Result<Vec<ModuleRoute>, StoreError>;

    /// Writes a batch of call status rows in one transaction (insert, or
    /// replace the row of the same module, node and caller).
    fn upsert_status(&mut self, rows: &[CallStatus]) -> Result<(), StoreError>;

    /// The call status rows, or one module's, sorted by module, node and
    /// caller.
    fn call_status(&mut self, module: Option<ModuleId>) -> Result<Vec<CallStatus>, StoreError>;
}
