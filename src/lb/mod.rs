//! The L5 overload algorithm, pure: no sockets, no clock, no globals.
//!
//! Owns the decision of which node a getHost gets and when a node is
//! overloaded, exactly as the original agent (seeds 000 and 001):
//!
//! - **getHost** ([`ModuleLb::get_host`]): round robin over the idle list;
//!   while some node is overloaded, every `probe_num`-th getHost probes the
//!   head of the overload list instead; with every node overloaded the rest
//!   answer [`Pick::Overloaded`].
//! - **report** ([`ModuleLb::report`]): a success adds to `vsucc`, a failure
//!   adds `max(1, tcost_ms / 100)` to `verr` (one real error, one
//!   consecutive failure). An idle node whose `verr / (vsucc + verr)`
//!   exceeds `err_rate`, or whose consecutive failures reach
//!   `contin_err_lim`, becomes overloaded (`vsucc = 0, verr = ovld_err_cnt`);
//!   an overloaded node whose `vsucc / (vsucc + verr)` exceeds `succ_rate`,
//!   or whose consecutive successes reach `contin_succ_lim`, becomes idle
//!   (`vsucc = init_succ_cnt, verr = 0`).
//! - **windows**, checked on a report when the state did not change: an idle
//!   node's window ends after `clear_timeout`; `wind_err_limit` consecutive
//!   windows with a real error rate at or above `wind_err_rate` make it
//!   overloaded, otherwise the window resets to the idle initial state. An
//!   overloaded node returns to idle once it has been overloaded for
//!   `overload_wait_lim`.
//! - **batch report** ([`ModuleLb::report_successes`]) of N successes is
//!   exactly N single successes.
//! - **route update** ([`ModuleLb::update_route`]) keeps the nodes that stay.
//!
//! It must not touch: sockets, clocks, logging, the wire format. Time is the
//! caller's `now` in milliseconds.

pub mod balance;
mod module;
mod node;
mod params;

pub use module::{ModuleLb, NodeCallStats, Pick, UnknownNode};
pub use node::{Millis, Node, NodeState, Outcome, Reason, Transition};
pub use params::LbParams;

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
