//! The overload algorithm's knobs, as the LB core sees them.

/// The parameters of the L5 overload algorithm. Defaults are the original
/// agent's `lbagent.ini`; [`lbagent_config`] reads them from the `[lb]` table
/// and validates their ranges before they reach the core.
#[derive(Clone, Debug, PartialEq)]
pub struct LbParams {
    /// Virtual successes a node starts with when it (re)enters idle.
    pub init_succ_cnt: u32,
    /// Virtual errors a node starts with when it enters overload.
    pub ovld_err_cnt: u32,
    /// Consecutive successes that return an overloaded node to idle.
    pub contin_succ_lim: u32,
    /// Consecutive failures that make an idle node overloaded.
    pub contin_err_lim: u32,
    /// While some node is overloaded, `probe_num` getHosts are answered
    /// from the idle list and the next probes the head of the overload list
    /// (10 then 1 with the default).
    pub probe_num: u32,
    /// An overloaded node whose virtual success rate exceeds this is idle again.
    pub succ_rate: f64,
    /// An idle node whose virtual error rate exceeds this is overloaded.
    pub err_rate: f64,
    /// An idle window whose real error rate is at or above this is "bad".
    pub wind_err_rate: f64,
    /// This many consecutive bad windows make an idle node overloaded.
    pub wind_err_limit: u32,
    /// Length of an idle node's statistics window, milliseconds. At least 1
    /// (the configuration asks whole seconds): a state change restarts the
    /// node's timer, so that the check after it cannot fire, as in the
    /// original.
    pub clear_timeout_ms: u64,
    /// An overloaded node is forced back to idle after this long,
    /// milliseconds. At least 1, as `clear_timeout_ms`.
    pub overload_wait_ms: u64,
    /// A `balance` module's unit not reported back within this long,
    /// milliseconds, returns by itself (counted).
    pub unit_timeout_ms: u64,
    /// The most units of one `balance` module one client (a UDP source, a
    /// shared-memory slot, a Unix connection) holds at once: past it, its
    /// getHost is answered overloaded until it reports.
    pub units_per_client: u32,
    /// The agent-wide default of a module's `slow_start_ms` (0 = off): a
    /// node entering the idle list ramps to its full weight over it.
    pub slow_start_ms: u64,
    /// Slow start's aggression (Envoy's): the share of a ramping node is
    /// `max(min_weight, t^(1/aggression))` of its weight, `t` the part of
    /// the window elapsed; 1.0 is linear, above 1 ramps faster early.
    pub slow_start_aggression: f64,
    /// The smallest share of its weight a ramping node gets, percent (1..=100).
    pub slow_start_min_weight_percent: u8,
    /// The agent-wide default of a module's `max_overloaded_percent`
    /// (100 = no limit, the original's behaviour).
    pub max_overloaded_percent: u8,
    /// The agent-wide default of a module's `panic_percent` (0 = off).
    pub panic_percent: u8,
    /// The agent-wide default of a module's `locality_min_percent`, held
    /// for the locality code.
    pub locality_min_percent: u8,
}

/// The default `lb.units_per_client`.
pub const DEFAULT_UNITS_PER_CLIENT: u32 = 64;

impl Default for LbParams {
    fn default() -> Self {
        Self {
            init_succ_cnt: 180,
            ovld_err_cnt: 5,
            contin_succ_lim: 15,
            contin_err_lim: 15,
            probe_num: 10,
            succ_rate: 0.95,
            err_rate: 0.1,
            wind_err_rate: 0.7,
            wind_err_limit: 2,
            clear_timeout_ms: 15_000,
            overload_wait_ms: 180_000,
            unit_timeout_ms: 30_000,
            units_per_client: DEFAULT_UNITS_PER_CLIENT,
            slow_start_ms: 0,
            slow_start_aggression: 1.0,
            slow_start_min_weight_percent: 10,
            max_overloaded_percent: 100,
            panic_percent: 0,
            locality_min_percent: 0,
        }
    }
}
