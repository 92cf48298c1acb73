//! What crosses the SPSC rings between a shard and the control core. These
//! are messages, not shared state: each side owns what it receives.

use lbagent_lb::{LbParams, NodeCallStats};
use lbagent_model::{ModuleId, ModuleOptions, NodeAddr, NodeMeta, Policy, RouteNode};

/// Shard → control core.
#[derive(Clone, Debug, PartialEq)]
pub enum ToControl {
    /// Pull this module from the route server (the shard has at most one
    /// such request outstanding per module).
    Pull(ModuleId),
    /// A module's real call counts since its last statistics, for the reporter.
    Stats {
        /// The module.
        module: ModuleId,
        /// Per-node counts and overload flags.
        nodes: Vec<NodeCallStats>,
    },
    /// The shard forgot this module (unused or unknown past its time): drop
    /// the control core's copy and the route server subscription.
    Forget(ModuleId),
    /// The shard stopped and sent everything it held (the last message).
    Drained,
    /// A module's panic began (`began`) or ended: its idle share crossed
    /// `panic_percent` (one message per episode's start and end, for the log).
    Panic {
        /// The module.
        module: ModuleId,
        /// True when the panic began, false when it ended.
        began: bool,
        /// Its idle nodes then.
        idle: u32,
        /// Its nodes.
        nodes: u32,
    },
}

/// Control core → shard.
#[derive(Clone, Debug, PartialEq)]
pub enum ToShard {
    /// Here is this module's route (from a pull answer, a push, or the
    /// snapshot at start). `exists` false: the route server has no such
    /// module, or it was deleted.
    Route {
        /// The module.
        module: ModuleId,
        /// False when the module does not exist at the route server.
        exists: bool,
        /// The route's version.
        version: u64,
        /// The nodes (empty when `exists` is false).
        nodes: Vec<RouteNode>,
        /// How the module's nodes are chosen.
        policy: Policy,
        /// The module's own options (each unset: the agent's `[lb]` default).
        options: ModuleOptions,
        /// The zones and labels of the nodes that have any (issue 31).
        meta: Vec<(NodeAddr, NodeMeta)>,
    },
    /// The `[lb]` parameters changed (a configuration reload): use these
    /// from now on, for every module the shard holds.
    Params(LiveParams),
}

/// The shard's part of a reloaded configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveParams {
    /// The overload algorithm's parameters.
    pub params: LbParams,
    /// Re-pull a module in use after this long, ms (`lb.update_timeout`).
    pub update_timeout_ms: u64,
    /// Send a module's statistics at most this often, ms (`lb.report_timeout`).
    pub report_timeout_ms: u64,
    /// `lb.locality_min_percent`.
    pub locality_min_percent: u32,
    /// `lb.label_fallback`.
    pub label_fallback: lbagent_lb::labels::Fallback,
}
