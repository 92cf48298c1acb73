//! The L5 overload algorithm, pure: no sockets, no clock, no globals.
//!
//! Owns the decision of which node a getHost gets and when a node is
//! overloaded, exactly as the original agent (seeds 000 and 001):
//!
//! - **getHost** ([`ModuleLb::get_host`]): round robin over the idle list;
//!   while some node is overloaded, `probe_num` getHosts are answered from
//!   the idle list and the next probes the head of the overload list (10
//!   then 1); with every node overloaded, `probe_num` answer
//!   [`Pick::Overloaded`] and the next probes.
//! - **report** ([`ModuleLb::report`]): a success counts 1, a failure
//!   `errcnt` = [`Outcome::error_count`] (`tcost_ms / 100` within 1..=50):
//!   virtual and real counts and the consecutive run grow by it, the other
//!   run resets. An idle node becomes overloaded (`vsucc = 0,
//!   verr = ovld_err_cnt`) at the first error at which
//!   `verr / (vsucc + verr) > err_rate` or the consecutive failures reach
//!   `contin_err_lim`; errors of the same report beyond that point are
//!   added to `verr` after the reset. An overloaded node becomes idle
//!   (`vsucc = init_succ_cnt, verr = 0`) by the mirror rules with
//!   `succ_rate` and `contin_succ_lim`.
//! - **windows**, checked on a report when the state did not change: an idle
//!   node's window ends after `clear_timeout`; `wind_err_limit` consecutive
//!   windows with a real error rate at or above `wind_err_rate` make it
//!   overloaded, otherwise the window resets to the idle initial state. An
//!   overloaded node returns to idle once it has been overloaded for
//!   `overload_wait_lim`.
//! - **batch report** ([`ModuleLb::report_successes`]) of N successes is
//!   applied at once, like a failure of `errcnt` N: an overloaded node
//!   becomes idle at most once, the rest carry into `vsucc`, then one
//!   window / timeout check.
//! - **downstream levels** ([`ModuleLb::set_level`],
//!   [`ModuleLb::get_host_for`]): DAGOR collaborative admission; a node's
//!   level, as reports carry it, filters among the idle nodes L5 would
//!   choose (a `balance` module's draw: among the nodes with a free unit,
//!   by `Φ` restricted to the admitting ones), until it times out
//!   ([`Pick::Rejected`] when none admits).
//! - **who asks** ([`ModuleLb::get_host_from`], [`ModuleLb::report_from`]):
//!   a `balance` module's units are booked to the client that took them
//!   (at most `units_per_client`), a report returns only that client's,
//!   and a caller's own levels ([`ModuleLb::set_private_level`]) filter
//!   only its getHosts.
//! - **route update** ([`ModuleLb::update_route`]) keeps the nodes that stay,
//!   in time linear in the nodes of the route.
//!
//! - **options beyond the original** (issue 31; each off by default, so
//!   that the above is exactly the original): route weights in `l5`
//!   (smooth weighted round robin over the idle list when they differ),
//!   slow start, the ejection limit (`max_overloaded_percent`), panic
//!   (`panic_percent`, [`Pick::Panic`]) and the `p2c` policy
//!   ([`ModuleLb::set_options`], [`ModuleLb::set_policy`]). While
//!   downstream levels are live, the idle choice is the levels' round
//!   robin as above.
//!
//! Where this differs from the original on purpose is listed in the README
//! ("Where we differ from the original, and why").
//!
//! It must not touch: sockets, clocks, logging, the wire format. Time is the
//! caller's `now` in milliseconds.
//!
//! # Layout
//!
//! - `module` ([`ModuleLb`]): one module's lists, probing, windows, the
//!   route update; the entry point of every decision above.
//! - `node` ([`Node`]): one node's counts, its state and its transitions.
//! - `params` ([`LbParams`]): the knobs (the original `lbagent.ini`).
//! - `levels`: downstream admission levels a module's reports carry, and
//!   their expiry.
//! - `units` ([`Units`]): balance units taken and returned.
//! - [`balance`]: seed 002's capacity-balancing choice.
//! - [`weights`]: smooth weighted round robin and slow start's share.
//! - [`limits`]: the ejection limit and the panic threshold.
//! - [`p2c`]: the `p2c` policy's peak-EWMA cost and its choice of two.
//! - `tuning` ([`Resolved`]): a module's options over the agent's
//!   defaults and their per-node state, held only while some are on.
//! - [`maglev`]: consistent hashing for keyed getHosts (Maglev's table).
//! - [`locality`]: when a getHost stays in the agent's zone.
//! - [`labels`]: what a label selector matching no node answers.
//!
//! The getHosts that use zones, labels and keys are `module/meta.rs`
//! ([`ModuleLb::set_meta`], [`ModuleLb::get_host_keyed`],
//! [`ModuleLb::get_host_selecting`], [`ModuleLb::get_host_near`]): entry
//! points of their own, so that `get_host` is unchanged.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod balance;
pub mod labels;
mod levels;
pub mod limits;
pub mod locality;
pub mod maglev;
mod module;
mod node;
pub mod p2c;
mod params;
mod tuning;
mod units;
pub mod weights;

pub use levels::LEVEL_TIMEOUT_MS;
pub use module::{ModuleLb, NodeCallStats, Pick, UnknownNode, NO_HINT};
pub use node::{Millis, Node, NodeState, Outcome, Reason, Transition, MAX_ERRORS_PER_FAILURE};
pub use params::{LbParams, DEFAULT_UNITS_PER_CLIENT};
pub use tuning::Resolved;
pub use units::{ClientKey, TakeRefused, Units, ANY_CLIENT};

#[cfg(test)]
mod options_tests;
#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
