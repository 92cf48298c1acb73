//! `lbagent demo-service`: a small UDP service of fixed capacity that
//! embeds DAGOR admission control ([`crate::admission`]); the subject of
//! the DAGOR experiment (`bench/dagor.rs`) and an example of embedding the
//! core in a service.
//!
//! - [`core`](self::core): the logic, sans-IO: a FIFO queue in front of `W` workers of
//!   service time `S` (capacity `W / S`), each request's queuing time, and
//!   the shedding policy at arrival ([`Shedding`]: DAGOR, off, random).
//! - [`serve`](mod@serve): the thin socket shell on a blocking
//!   [`std::net::UdpSocket`]; [`command`] runs it for the binary.
//!
//! # Messages
//!
//! The service reuses the schema's getHost pair, so it needs no schema
//! change and every tool that speaks the agent's protocol can call it:
//!
//! - request: `GetHostReq { seq, business_priority, user_priority }`
//!   (`modid` / `cmdid` are echoed, otherwise ignored; priority 0 counts
//!   as 128, the least important);
//! - response: `GetHostResp { seq, modid, cmdid, retcode, admission_level }`
//!   with `retcode` `Ok` (processed), `Rejected` (shed by the policy, at
//!   once) or `Unavailable` (the queue was full), and `admission_level` the
//!   service's current level under DAGOR (absent otherwise), on every
//!   response. A datagram that is not a valid GetHostReq is counted and
//!   dropped.

mod args;
pub mod core;
pub mod serve;
#[cfg(test)]
mod sim;

pub use self::core::{Arrival, ServiceCore, ServiceParams, ServiceStats, Shedding};
pub use args::{command, DemoServiceArgs, SheddingArg};
pub use serve::{
    serve, serve_cold, serve_traced, ColdStart, Counters, ServiceTrace, TracedArrival,
};
