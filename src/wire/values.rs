//! Plain values that messages carry beyond the [`lbagent_model`] types, and
//! the conversions between the generated structs and plain values.

use super::fb;
use super::RetCode;
use lbagent_model::{ModuleId, ModuleOptions, NodeAddr, RouteNode};

/// A DAGOR compound admission level `(B*, U*)`, each 1..=128 (1 = most
/// important). A request of priorities `(b, u)` is admitted when `b < B*`,
/// or `b == B*` and `u <= U*`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AdmissionLevel {
    /// Business priority level `B*`.
    pub business: u8,
    /// User priority level `U*`.
    pub user: u8,
}

impl AdmissionLevel {
    /// A level from its two parts.
    pub const fn new(business: u8, user: u8) -> Self {
        Self { business, user }
    }

    /// The level a message field carries: absent, or 0 in both parts, is none.
    pub fn from_wire(level: Option<&fb::AdmissionLevel>) -> Option<Self> {
        level
            .map(|l| Self::new(l.business(), l.user()))
            .filter(|l| *l != Self::default())
    }
}

/// One call's result as a ReportReq carries it (the validated view of
/// [`fb::ReportReq`], and what [`super::Encoder::report_req`] sends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report {
    /// Request sequence number.
    pub seq: u32,
    /// The module that was called.
    pub module: ModuleId,
    /// The node that was called; its port is never 0.
    pub host: NodeAddr,
    /// The call's result: 0 is success, anything else a failure.
    pub retcode: i32,
    /// The call's time cost in milliseconds.
    pub tcost_ms: u32,
    /// The downstream's admission level piggybacked on its response.
    pub downstream_level: Option<AdmissionLevel>,
    /// Capacity units of the node the call consumed for good (0 = none),
    /// at most [`super::MAX_CONSUMED`].
    pub consumed: u32,
}

/// One node of a module with its LB state and counters (the tools' view
/// that GetRouteResp carries).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NodeStatus {
    /// Where the node is.
    pub addr: NodeAddr,
    /// Weight / capacity (0 = unset).
    pub weight: u32,
    /// Whether the node is on the overload list.
    pub overloaded: bool,
    /// Virtual success count (the overload algorithm's).
    pub vsucc: u32,
    /// Virtual error count (the overload algorithm's).
    pub verr: u32,
    /// Real successes in the current window.
    pub rsucc: u32,
    /// Real errors in the current window.
    pub rerr: u32,
    /// Consecutive successes.
    pub contin_succ: u32,
    /// Consecutive errors.
    pub contin_err: u32,
    /// Consecutive idle windows whose real error rate reached the limit.
    pub bad_windows: u32,
    /// Milliseconds since the node's idle window started.
    pub window_age_ms: u64,
    /// Milliseconds since the node became overloaded.
    pub overload_age_ms: u64,
    /// A `balance` module's node: its capacity as counted now (0 while
    /// overloaded); 0 for an `l5` module.
    pub capacity: u32,
    /// A `balance` module's node: units handed out and not had back.
    pub in_use: u32,
    /// A `balance` module's node: its Φ for the next getHost.
    pub phi: f64,
}

/// Real call counts of one node over a statistics period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeStats {
    /// Where the node is.
    pub addr: NodeAddr,
    /// Successful calls.
    pub succ: u32,
    /// Failed calls.
    pub err: u32,
    /// Whether the node was overloaded at the end of the period.
    pub overloaded: bool,
}

/// The statistics of one module, for [`super::Encoder::stats_report`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleStats<'a> {
    /// The module.
    pub module: ModuleId,
    /// Its nodes' counts.
    pub nodes: &'a [NodeStats],
    /// Capacity units reported consumed for good per node over the period.
    pub consumed: &'a [(NodeAddr, u32)],
}

/// The answer to CacheGetRouteReq, for [`super::Encoder::cache_get_route_resp`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheRoute<'a> {
    /// The request's sequence number, echoed.
    pub seq: u32,
    /// The module asked for.
    pub module: ModuleId,
    /// Ok, or why there is no route.
    pub retcode: RetCode,
    /// The route's version.
    pub version: u64,
    /// True when the cache already holds `version` (`nodes` is then empty).
    pub unchanged: bool,
    /// True when any node of the module is overloaded.
    pub any_overloaded: bool,
    /// The route's nodes.
    pub nodes: &'a [RouteNode],
}

// === impl conversions between generated structs and plain values ===

impl From<&fb::Host> for NodeAddr {
    fn from(h: &fb::Host) -> Self {
        NodeAddr {
            ip: h.ip(),
            port: h.port(),
        }
    }
}

impl From<NodeAddr> for fb::Host {
    fn from(a: NodeAddr) -> Self {
        fb::Host::new(a.ip, a.port)
    }
}

impl From<&fb::ModuleId> for ModuleId {
    fn from(m: &fb::ModuleId) -> Self {
        ModuleId::new(m.modid(), m.cmdid())
    }
}

impl From<ModuleId> for fb::ModuleId {
    fn from(m: ModuleId) -> Self {
        fb::ModuleId::new(m.modid, m.cmdid)
    }
}

impl From<&fb::RouteNode> for RouteNode {
    fn from(n: &fb::RouteNode) -> Self {
        RouteNode {
            addr: n.host().into(),
            weight: n.weight(),
        }
    }
}

impl From<RouteNode> for fb::RouteNode {
    fn from(n: RouteNode) -> Self {
        fb::RouteNode::new(&n.addr.into(), n.weight)
    }
}

impl From<AdmissionLevel> for fb::AdmissionLevel {
    fn from(l: AdmissionLevel) -> Self {
        fb::AdmissionLevel::new(l.business, l.user)
    }
}

impl From<&fb::NodeStats> for NodeStats {
    fn from(n: &fb::NodeStats) -> Self {
        NodeStats {
            addr: n.host().into(),
            succ: n.succ(),
            err: n.err(),
            overloaded: n.overloaded(),
        }
    }
}

impl From<NodeStats> for fb::NodeStats {
    fn from(n: NodeStats) -> Self {
        fb::NodeStats::new(&n.addr.into(), n.succ, n.err, n.overloaded)
    }
}

impl From<fb::NodeStatus<'_>> for NodeStatus {
    fn from(n: fb::NodeStatus<'_>) -> Self {
        NodeStatus {
            // An absent host reads as 0.0.0.0:0, as any absent scalar reads 0.
            addr: n.host().map_or(NodeAddr { ip: 0, port: 0 }, NodeAddr::from),
            weight: n.weight(),
            overloaded: n.overloaded(),
            vsucc: n.vsucc(),
            verr: n.verr(),
            rsucc: n.rsucc(),
            rerr: n.rerr(),
            contin_succ: n.contin_succ(),
            contin_err: n.contin_err(),
            bad_windows: n.bad_windows(),
            window_age_ms: n.window_age_ms(),
            overload_age_ms: n.overload_age_ms(),
            capacity: n.capacity(),
            in_use: n.in_use(),
            phi: n.phi(),
        }
    }
}

/// A module's own options as the wire carries them (absent: none set).
/// A field out of its range (a newer or broken sender) is dropped, so
/// that the agent's default applies to it rather than a wrong value.
pub fn module_options(t: Option<fb::ModuleOptions<'_>>) -> ModuleOptions {
    let Some(t) = t else {
        return ModuleOptions::default();
    };
    let mut o = ModuleOptions {
        slow_start_ms: t.slow_start_ms(),
        max_overloaded_percent: t.max_overloaded_percent(),
        panic_percent: t.panic_percent(),
        locality_min_percent: t.locality_min_percent(),
    };
    if o.max_overloaded_percent.is_some_and(|v| v == 0 || v > 100) {
        o.max_overloaded_percent = None;
    }
    if o.panic_percent.is_some_and(|v| v > 100) {
        o.panic_percent = None;
    }
    if o.locality_min_percent.is_some_and(|v| v > 100) {
        o.locality_min_percent = None;
    }
    o
}
