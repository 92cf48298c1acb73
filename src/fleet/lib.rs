//! The fleet lab's programs (`lbagent-fleet`), driven by `tools/fleet/lab`:
//! many simulated agents on the agent's own sans-IO protocol cores, route
//! churn written to the store, an application load on a real agent, and
//! the verdict that checks the lab's invariants from what they recorded.
//!
//! The pure parts (what converged when, what was acknowledged and what
//! is stored) take their inputs as values and are tested without sockets
//! or clocks; the shells only move bytes and record times.
//!
//! # Layout
//!
//! - [`clock`]: wall-clock milliseconds that never go back, shared by every
//!   program of the lab (they run on one machine).
//! - [`record`]: what the programs write for the verdict (route arrivals,
//!   commits, acknowledged statistics), serde types.
//! - [`ledger`]: which statistics a simulated agent had acknowledged, from
//!   what it pushed and the count acknowledged; pure.
//! - [`verdict`]: route change to last agent, per change, and the
//!   invariants; pure.
//! - [`link`]: one TCP link of a simulated agent driven through a
//!   protocol core (the route client's or the statistics client's).
//! - [`sim`]: the simulator: M agents, each a route link and a stats link.
//! - [`churn`]: route changes written to the store on a schedule, each
//!   commit's version and time recorded.
//! - [`app`]: an application on a real agent's host: getHost + report,
//!   failures counted, route versions polled.
#![warn(missing_docs)]

pub mod app;
pub mod churn;
pub mod clock;
pub mod ledger;
pub mod link;
pub mod record;
pub mod sim;
pub mod verdict;
