//! What the lab's programs write for the verdict: JSON files of these
//! types, one per program run.

use serde::{Deserialize, Serialize};

/// A module, as `(modid, cmdid)`.
pub type Module = (u32, u32);

/// The route versions one agent received for one module, each with when
/// it arrived (ms since the Unix epoch), in arrival order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrivals {
    /// Which agent (its index in its program).
    pub agent: u32,
    /// The module.
    pub module: Module,
    /// `(version, ms)` per route received.
    pub seen: Vec<(u64, u64)>,
}

/// One route change committed to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Commit {
    /// The module changed.
    pub module: Module,
    /// The route version the commit returned.
    pub version: u64,
    /// When the commit returned, ms since the Unix epoch.
    pub t_ms: u64,
}

/// What the churn program did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChurnRecord {
    /// The version of the import that set every module up.
    pub setup_version: u64,
    /// The modules set up.
    pub modules: Vec<Module>,
    /// Every change committed, in commit order.
    pub commits: Vec<Commit>,
    /// Changes the store refused or could not take: `(ms, why)`.
    pub failures: Vec<(u64, String)>,
}

/// The newest statistics value a simulated agent had acknowledged for one
/// (module, node): the store must hold at least it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acked {
    /// The reporting agent's caller address (host byte order).
    pub caller: u32,
    /// The module.
    pub module: Module,
    /// The node, `(ip, port)`.
    pub node: (u32, u16),
    /// The `succ` value of the newest acknowledged report of that key.
    pub succ: u32,
}

/// What one simulator process recorded.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimRecord {
    /// Simulated agents.
    pub agents: u32,
    /// Route arrivals, per agent and module.
    pub arrivals: Vec<Arrivals>,
    /// The newest acknowledged value per (caller, module, node).
    pub acked: Vec<Acked>,
    /// Statistics entries pushed, acknowledged, dropped (buffer bound) and
    /// rejected (ErrorResp), over every agent.
    pub stats_pushed: u64,
    /// See `stats_pushed`.
    pub stats_acked: u64,
    /// See `stats_pushed`.
    pub stats_dropped: u64,
    /// See `stats_pushed`.
    pub stats_rejected: u64,
    /// Entries still unacknowledged when the simulator stopped.
    pub stats_unsettled: u64,
    /// Route links established, over every agent (the first included).
    pub route_connects: u64,
    /// Modules named in PullReqs, over every agent.
    pub modules_pulled: u64,
    /// Modules answered "unchanged at the version held".
    pub unchanged: u64,
    /// Agents whose route link was up at the end.
    pub route_connected_at_end: u32,
    /// The latest time any agent's route link came up (ms since the Unix
    /// epoch): after a restart of every route server, when the last agent
    /// was back.
    pub last_connect_ms: u64,
    /// How late the simulator's own event loop ran a task that was due: a
    /// probe timer's lateness, ms. Every arrival the simulator records is
    /// late by about as much, on top of what the system took.
    #[serde(default)]
    pub loop_lag: LagSummary,
}

/// Quantiles of a set of delays, ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LagSummary {
    /// The median.
    pub p50: u64,
    /// The 99th percentile.
    pub p99: u64,
    /// The largest.
    pub max: u64,
    /// How many were measured.
    pub n: u64,
}

/// What one application program on a real agent's host recorded.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppRecord {
    /// The host's name in the lab.
    pub host: String,
    /// getHosts asked, and those that failed.
    pub gethosts: u64,
    /// See `gethosts`.
    pub gethost_failures: u64,
    /// getHosts answered from the static route file (agent down).
    pub static_answers: u64,
    /// Up to 20 failures: `(ms, module, why)`.
    pub failure_examples: Vec<(u64, Module, String)>,
    /// Reports sent, and those that failed.
    pub reports: u64,
    /// See `reports`.
    pub report_failures: u64,
    /// Route versions seen by polling getRoute, per module.
    pub arrivals: Vec<Arrivals>,
}
