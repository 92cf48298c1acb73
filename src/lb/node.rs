//! One node's overload state: the counters of the L5 algorithm and the rules
//! that move it between idle and overloaded. The lists live in
//! [`super::ModuleLb`]; this file decides, the module moves.

use super::params::LbParams;
use crate::model::{NodeAddr, RouteNode};

/// Milliseconds on a monotonic clock chosen by the caller. The core never
/// reads a clock: every rule that involves time takes `now` as an argument.
pub type Millis = u64;

/// Whether a node may be chosen by round robin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeState {
    /// Usable: on the idle list, chosen by round robin.
    Idle,
    /// Overloaded: on the overload list, chosen only by probes.
    Overloaded,
}

/// How one call to a node went, as the application reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The call succeeded.
    Success,
    /// The call failed after `tcost_ms` milliseconds; it counts
    /// `max(1, tcost_ms / 100)` virtual errors.
    Failure {
        /// The call's time cost in milliseconds (0 when unknown).
        tcost_ms: u32,
    },
}

impl Outcome {
    /// The outcome a wire-level return code means: 0 is success.
    pub fn from_retcode(retcode: i32, tcost_ms: u32) -> Self {
        if retcode == 0 {
            Outcome::Success
        } else {
            Outcome::Failure { tcost_ms }
        }
    }
}

/// Why a node changed state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Idle → overloaded: `verr / (vsucc + verr) > err_rate`.
    ErrRate,
    /// Idle → overloaded: consecutive failures reached `contin_err_lim`.
    ContinErr,
    /// Idle → overloaded: `wind_err_limit` consecutive windows with a real
    /// error rate at or above `wind_err_rate`.
    Window,
    /// Overloaded → idle: `vsucc / (vsucc + verr) > succ_rate`.
    SuccRate,
    /// Overloaded → idle: consecutive successes reached `contin_succ_lim`.
    ContinSucc,
    /// Overloaded → idle: the node was overloaded for `overload_wait_lim`.
    OverloadTimeout,
}

/// A state change of one node, for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The node that changed.
    pub addr: NodeAddr,
    /// The state it is in now.
    pub to: NodeState,
    /// The rule that moved it.
    pub reason: Reason,
}

/// One node of a module with its algorithm state.
///
/// Counters saturate instead of wrapping: a flood of reports can pin them,
/// never make them small again.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    addr: NodeAddr,
    weight: u32,
    state: NodeState,
    vsucc: u32,
    verr: u32,
    rsucc: u32,
    rerr: u32,
    contin_succ: u32,
    contin_err: u32,
    bad_windows: u32,
    window_start: Millis,
    overload_start: Millis,
    stat_succ: u32,
    stat_err: u32,
}

impl Node {
    /// A new node, idle, its window starting at `now`.
    pub fn new(route: RouteNode, now: Millis, p: &LbParams) -> Self {
        let mut n = Node {
            addr: route.addr,
            weight: route.weight,
            state: NodeState::Idle,
            vsucc: 0,
            verr: 0,
            rsucc: 0,
            rerr: 0,
            contin_succ: 0,
            contin_err: 0,
            bad_windows: 0,
            window_start: now,
            overload_start: 0,
            stat_succ: 0,
            stat_err: 0,
        };
        n.reset_window(now, p);
        n
    }

    /// The node's address.
    pub fn addr(&self) -> NodeAddr {
        self.addr
    }
    /// The node's weight / capacity from its route entry.
    pub fn weight(&self) -> u32 {
        self.weight
    }
    /// Idle or overloaded.
    pub fn state(&self) -> NodeState {
        self.state
    }
    /// Virtual success count.
    pub fn vsucc(&self) -> u32 {
        self.vsucc
    }
    /// Virtual error count.
    pub fn verr(&self) -> u32 {
        self.verr
    }
    /// Real successes in the current window (idle) or since overload.
    pub fn rsucc(&self) -> u32 {
        self.rsucc
    }
    /// Real failed calls in the current window (idle) or since overload.
    pub fn rerr(&self) -> u32 {
        self.rerr
    }
    /// Consecutive successful calls.
    pub fn contin_succ(&self) -> u32 {
        self.contin_succ
    }
    /// Consecutive failed calls.
    pub fn contin_err(&self) -> u32 {
        self.contin_err
    }
    /// Consecutive idle windows whose real error rate reached `wind_err_rate`.
    pub fn bad_windows(&self) -> u32 {
        self.bad_windows
    }
    /// When the current idle window started.
    pub fn window_start(&self) -> Millis {
        self.window_start
    }
    /// When the node last became overloaded (0 if never).
    pub fn overload_start(&self) -> Millis {
        self.overload_start
    }
    /// Real (successes, failures) since the statistics were last taken.
    pub fn pending_stats(&self) -> (u32, u32) {
        (self.stat_succ, self.stat_err)
    }

    pub(super) fn set_weight(&mut self, weight: u32) {
        self.weight = weight;
    }

    pub(super) fn take_stats(&mut self) -> (u32, u32) {
        let s = (self.stat_succ, self.stat_err);
        self.stat_succ = 0;
        self.stat_err = 0;
        s
    }

    /// The idle initial state: what entering idle and a window reset share.
    /// `bad_windows` is not touched: a reset window keeps the streak.
    fn reset_window(&mut self, now: Millis, p: &LbParams) {
        self.state = NodeState::Idle;
        self.vsucc = p.init_succ_cnt;
        self.verr = 0;
        self.rsucc = 0;
        self.rerr = 0;
        self.contin_succ = 0;
        self.contin_err = 0;
        self.window_start = now;
    }

    fn enter_idle(&mut self, now: Millis, p: &LbParams) {
        self.reset_window(now, p);
        self.bad_windows = 0;
    }

    fn enter_overload(&mut self, now: Millis, p: &LbParams) {
        self.state = NodeState::Overloaded;
        self.vsucc = 0;
        self.verr = p.ovld_err_cnt;
        self.rsucc = 0;
        self.rerr = 0;
        self.contin_succ = 0;
        self.contin_err = 0;
        self.bad_windows = 0;
        self.overload_start = now;
    }

    fn count(&mut self, outcome: Outcome, successes: u32) {
        match outcome {
            Outcome::Success => {
                self.vsucc = self.vsucc.saturating_add(successes);
                self.rsucc = self.rsucc.saturating_add(successes);
                self.stat_succ = self.stat_succ.saturating_add(successes);
                self.contin_succ = self.contin_succ.saturating_add(successes);
                self.contin_err = 0;
            }
            Outcome::Failure { tcost_ms } => {
                self.verr = self.verr.saturating_add((tcost_ms / 100).max(1));
                self.rerr = self.rerr.saturating_add(1);
                self.stat_err = self.stat_err.saturating_add(1);
                self.contin_err = self.contin_err.saturating_add(1);
                self.contin_succ = 0;
            }
        }
    }

    /// Applies one reported call and the rules that follow it, in the
    /// original's order: count; check the rate and consecutive limits (an
    /// idle node only on a failure, an overloaded one only on a success);
    /// then, if the state did not change, the idle window or the overload
    /// timeout. Returns the new state when it changed.
    pub(super) fn report(
        &mut self,
        outcome: Outcome,
        now: Millis,
        p: &LbParams,
    ) -> Option<(NodeState, Reason)> {
        self.count(outcome, 1);
        let reason = match (self.state, outcome) {
            (NodeState::Idle, Outcome::Failure { .. }) => {
                if ratio_exceeds(self.verr, self.vsucc, p.err_rate) {
                    Some(Reason::ErrRate)
                } else if self.contin_err >= p.contin_err_lim {
                    Some(Reason::ContinErr)
                } else {
                    None
                }
            }
            (NodeState::Overloaded, Outcome::Success) => {
                if ratio_exceeds(self.vsucc, self.verr, p.succ_rate) {
                    Some(Reason::SuccRate)
                } else if self.contin_succ >= p.contin_succ_lim {
                    Some(Reason::ContinSucc)
                } else {
                    None
                }
            }
            _ => None,
        };
        if let Some(reason) = reason {
            return Some(self.apply(reason, now, p));
        }
        match self.state {
            NodeState::Idle if self.window_due(now, p) => {
                if self.window_is_bad(p) {
                    self.bad_windows = self.bad_windows.saturating_add(1);
                    if self.bad_windows >= p.wind_err_limit {
                        return Some(self.apply(Reason::Window, now, p));
                    }
                } else {
                    self.bad_windows = 0;
                }
                self.reset_window(now, p);
                None
            }
            NodeState::Overloaded
                if now.saturating_sub(self.overload_start) >= p.overload_wait_ms =>
            {
                Some(self.apply(Reason::OverloadTimeout, now, p))
            }
            _ => None,
        }
    }

    /// Applies `count` successes when no rule can fire for any of them:
    /// the node is idle and its window is not due. Equivalent to `count`
    /// single successes in that case.
    pub(super) fn add_quiet_successes(&mut self, count: u32) {
        debug_assert_eq!(self.state, NodeState::Idle);
        self.count(Outcome::Success, count);
    }

    /// True when a success reported at `now` could change anything beyond
    /// the counters.
    pub(super) fn success_is_eventful(&self, now: Millis, p: &LbParams) -> bool {
        self.state == NodeState::Overloaded || self.window_due(now, p)
    }

    fn window_due(&self, now: Millis, p: &LbParams) -> bool {
        now.saturating_sub(self.window_start) >= p.clear_timeout_ms
    }

    fn window_is_bad(&self, p: &LbParams) -> bool {
        let total = u64::from(self.rsucc) + u64::from(self.rerr);
        total != 0 && self.rerr as f64 / total as f64 >= p.wind_err_rate
    }

    fn apply(&mut self, reason: Reason, now: Millis, p: &LbParams) -> (NodeState, Reason) {
        match reason {
            Reason::ErrRate | Reason::ContinErr | Reason::Window => self.enter_overload(now, p),
            Reason::SuccRate | Reason::ContinSucc | Reason::OverloadTimeout => {
                self.enter_idle(now, p)
            }
        }
        (self.state, reason)
    }
}

/// `part / (part + other) > rate`, computed exactly as the original does
/// (in double precision); an empty total never exceeds.
fn ratio_exceeds(part: u32, other: u32, rate: f64) -> bool {
    let total = u64::from(part) + u64::from(other);
    total != 0 && part as f64 / total as f64 > rate
}
