//! One node's overload state: the counters of the L5 algorithm and the rules
//! that move it between idle and overloaded. The lists live in
//! [`super::ModuleLb`]; this file decides, the module moves.

use super::params::LbParams;
use lbagent_model::{NodeAddr, RouteNode};

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
    /// [`Outcome::error_count`] errors.
    Failure {
        /// The call's time cost in milliseconds (0 when unknown).
        tcost_ms: u32,
    },
}

/// The most errors one failure counts, however slow it was.
pub const MAX_ERRORS_PER_FAILURE: u32 = 50;

impl Outcome {
    /// The errors this outcome counts: 0 for a success; for a failure
    /// `tcost_ms / 100`, at least 1 and at most [`MAX_ERRORS_PER_FAILURE`]
    /// (a call that failed after 1 s counts 10).
    pub fn error_count(self) -> u32 {
        match self {
            Outcome::Success => 0,
            Outcome::Failure { tcost_ms } => (tcost_ms / 100).clamp(1, MAX_ERRORS_PER_FAILURE),
        }
    }

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
    /// Idle → overloaded: `verr / (vsucc + verr) > err_rate` (a multi-count
    /// report: `verr` reaching the original's threshold).
    ErrRate,
    /// Idle → overloaded: consecutive failures reached `contin_err_lim`.
    ContinErr,
    /// Idle → overloaded: `wind_err_limit` consecutive windows with a real
    /// error rate at or above `wind_err_rate`.
    Window,
    /// Overloaded → idle: `vsucc / (vsucc + verr) > succ_rate` (a
    /// multi-count report: `vsucc` reaching the original's threshold).
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
///
/// 56 bytes (an agent holds one per node of every module in use, a million
/// of them at scale): the address is stored as its ordering key
/// ([`NodeAddr::key`], 6 bytes in a u64), which the report's binary search
/// and the route merge compare without building it, and the state and the
/// run's direction fill the rest of the padding; the consecutive runs are
/// one counter, since a call of one outcome resets the other run; and one
/// timestamp serves both clocks, since an idle node's window and an
/// overloaded node's timeout are never live at once.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The address as its key: `ip << 16 | port`.
    key: u64,
    state: NodeState,
    /// Whether `contin` counts consecutive successes (else failures).
    run_succ: bool,
    weight: u32,
    vsucc: u32,
    verr: u32,
    rsucc: u32,
    rerr: u32,
    /// The consecutive run: successes when `run_succ`, failures otherwise.
    contin: u32,
    bad_windows: u32,
    stat_succ: u32,
    stat_err: u32,
    /// Idle: when the current window started. Overloaded: when the node
    /// became overloaded.
    since: Millis,
}

impl Node {
    /// A new node, idle, its window starting at `now`.
    pub fn new(route: RouteNode, now: Millis, p: &LbParams) -> Self {
        let mut n = Node {
            key: route.addr.key(),
            state: NodeState::Idle,
            run_succ: false,
            weight: route.weight,
            vsucc: 0,
            verr: 0,
            rsucc: 0,
            rerr: 0,
            contin: 0,
            bad_windows: 0,
            stat_succ: 0,
            stat_err: 0,
            since: now,
        };
        n.reset_window(now, p);
        n
    }

    /// The node's address.
    pub fn addr(&self) -> NodeAddr {
        NodeAddr {
            ip: (self.key >> 16) as u32,
            port: self.key as u16,
        }
    }

    /// The address's ordering key ([`NodeAddr::key`]).
    #[inline]
    pub(super) fn key(&self) -> u64 {
        self.key
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
        if self.run_succ {
            self.contin
        } else {
            0
        }
    }
    /// Consecutive failed calls.
    pub fn contin_err(&self) -> u32 {
        if self.run_succ {
            0
        } else {
            self.contin
        }
    }
    /// Consecutive idle windows whose real error rate reached `wind_err_rate`.
    pub fn bad_windows(&self) -> u32 {
        self.bad_windows
    }
    /// When the current idle window started (0 while overloaded).
    pub fn window_start(&self) -> Millis {
        match self.state {
            NodeState::Idle => self.since,
            NodeState::Overloaded => 0,
        }
    }
    /// When the node became overloaded (0 while idle).
    pub fn overload_start(&self) -> Millis {
        match self.state {
            NodeState::Idle => 0,
            NodeState::Overloaded => self.since,
        }
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
        self.contin = 0;
        self.since = now;
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
        self.contin = 0;
        self.bad_windows = 0;
        self.since = now;
    }

    /// Applies a report to the node: a single report (`multi` false: one
    /// success, or a failure that counts one error; `n` is 1) or a
    /// multi-count report (`multi` true: a batch of `n` successes, whatever
    /// `n`, 1 included, or a failure that counts `n` > 1 errors), in the
    /// original's order:
    ///
    /// 1. count: the virtual and real counts and the consecutive run of this
    ///    outcome grow by `n`, the other run resets. The reporter's
    ///    statistics grow by `n` successes, or by one failed call;
    /// 2. the state rule, at most once, where the outcome goes against the
    ///    state (an idle node on failures, an overloaded node on successes):
    ///    - single: the rate `part / (part + other) > rate` on the counted
    ///      virtual counts first, then the run reaching its limit;
    ///    - multi-count: the run first: at or above its limit, the node
    ///      changes with `carry = run − limit`. Only below it, the rate,
    ///      against the original's threshold ([`rate_threshold`]): when the
    ///      virtual count of this outcome, `part + n`, reaches it, the node
    ///      changes with `carry = min(part + n − need, n)` (0 possible).
    ///
    ///    A changed node is reset into its new state and the carry (0 for
    ///    a single report) is added to its virtual count of this outcome;
    /// 3. if the state did not change, the idle window or the overload
    ///    timeout. (The original checks them after a change too; the change
    ///    has just restarted the timer, so with timeouts of 1 ms or more, as
    ///    the configuration requires, the check cannot fire.)
    ///
    /// Returns the new state when it changed. Inlined into the report's
    /// path (callgrind: its frame was a sixth of a report's cost).
    #[inline]
    pub(super) fn report_calls(
        &mut self,
        success: bool,
        n: u32,
        multi: bool,
        now: Millis,
        p: &LbParams,
    ) -> Option<(NodeState, Reason)> {
        debug_assert!(n >= 1);
        debug_assert!(multi || n == 1);
        let (vsucc, verr) = (self.vsucc, self.verr);
        self.count(success, n);
        let run = self.contin;
        let change = match (self.state, success) {
            (NodeState::Idle, false) => {
                crossing(multi, verr, vsucc, p.err_rate, run, p.contin_err_lim, n).map(
                    |(carry, by_rate)| {
                        let reason = if by_rate {
                            Reason::ErrRate
                        } else {
                            Reason::ContinErr
                        };
                        (carry, reason)
                    },
                )
            }
            (NodeState::Overloaded, true) => {
                crossing(multi, vsucc, verr, p.succ_rate, run, p.contin_succ_lim, n).map(
                    |(carry, by_rate)| {
                        let reason = if by_rate {
                            Reason::SuccRate
                        } else {
                            Reason::ContinSucc
                        };
                        (carry, reason)
                    },
                )
            }
            _ => None,
        };
        if let Some((carry, reason)) = change {
            let changed = self.apply(reason, now, p);
            if success {
                self.vsucc = self.vsucc.saturating_add(carry);
            } else {
                self.verr = self.verr.saturating_add(carry);
            }
            return Some(changed);
        }
        self.check_timers(now, p)
    }

    /// Step 1 of [`Node::report_calls`] alone: the counts grow, the state
    /// stays (what the ejection limit leaves of a report that would have
    /// overloaded the node).
    pub(super) fn count(&mut self, success: bool, n: u32) {
        if success {
            self.vsucc = self.vsucc.saturating_add(n);
            self.rsucc = self.rsucc.saturating_add(n);
            self.stat_succ = self.stat_succ.saturating_add(n);
            self.contin = self.contin_succ().saturating_add(n);
        } else {
            self.verr = self.verr.saturating_add(n);
            self.rerr = self.rerr.saturating_add(n);
            self.stat_err = self.stat_err.saturating_add(1);
            self.contin = self.contin_err().saturating_add(n);
        }
        self.run_succ = success;
    }

    /// The idle window or the overload timeout, as checked after a report
    /// that did not change the state.
    fn check_timers(&mut self, now: Millis, p: &LbParams) -> Option<(NodeState, Reason)> {
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
            NodeState::Overloaded if now.saturating_sub(self.since) >= p.overload_wait_ms => {
                Some(self.apply(Reason::OverloadTimeout, now, p))
            }
            _ => None,
        }
    }

    fn window_due(&self, now: Millis, p: &LbParams) -> bool {
        now.saturating_sub(self.since) >= p.clear_timeout_ms
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

/// Whether a report against the node's state changes it: `part` is the
/// node's virtual count of the report's outcome before it, `other` the
/// opposite virtual count, `run` the consecutive run of the outcome after
/// it (`lim` its limit), `n` the counts reported. Returns the carry (the
/// counts added to the new state's virtual count after its reset) and
/// whether the rate decided (else the run), None when the node stays.
///
/// - single (`n` is 1): the rate `(part + 1) / (part + 1 + other) > rate`
///   first, then `run >= lim`; the carry is 0;
/// - multi-count: `run >= lim` first, carry `run − lim`; only then the
///   rate: `part + n` reaching [`rate_threshold`], carry
///   `min(part + n − need, n)`.
#[inline(always)]
fn crossing(
    multi: bool,
    part: u32,
    other: u32,
    rate: f64,
    run: u32,
    lim: u32,
    n: u32,
) -> Option<(u32, bool)> {
    if !multi {
        if ratio_exceeds(part.saturating_add(1), other, rate) {
            return Some((0, true));
        }
        return (run >= lim).then_some((0, false));
    }
    multi_crossing(part, other, rate, run, lim, n)
}

/// The multi-count rule of [`crossing`], out of line: the single-report
/// path pays only the test of `multi`.
#[inline(never)]
fn multi_crossing(
    part: u32,
    other: u32,
    rate: f64,
    run: u32,
    lim: u32,
    n: u32,
) -> Option<(u32, bool)> {
    if run >= lim {
        return Some((run - lim, false));
    }
    let need = u64::from(rate_threshold(other, rate)?);
    let reached = u64::from(part) + u64::from(n);
    (reached >= need).then(|| ((reached - need).min(u64::from(n)) as u32, true))
}

/// The original's threshold for a multi-count report: the virtual count
/// of the outcome that, against `other` of the opposite one, makes the
/// rate `rate`. `need = trunc(rate · other / (1 − rate))` in double
/// precision, plus 1 when `need / (need + other) < rate` (the sum a
/// wrapping u32 add, as in the original; 0/0 is NaN, which is not `<`).
/// None when `rate >= 1`: there is no rate test.
pub(super) fn rate_threshold(other: u32, rate: f64) -> Option<u32> {
    if rate >= 1.0 {
        return None;
    }
    let mut need = (rate * f64::from(other) / (1.0 - rate)) as u32;
    if f64::from(need) / f64::from(need.wrapping_add(other)) < rate {
        need = need.saturating_add(1);
    }
    Some(need)
}

/// `part / (part + other) > rate`, computed exactly as the original does
/// (in double precision); an empty total never exceeds.
fn ratio_exceeds(part: u32, other: u32, rate: f64) -> bool {
    let total = u64::from(part) + u64::from(other);
    total != 0 && part as f64 / total as f64 > rate
}
