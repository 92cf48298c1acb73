//! lbagent: a load-balancing agent for every host of a large fleet.
//!
//! Applications ask the agent, over local UDP, for a node of a remote service
//! named by `(modid, cmdid)` and report how each call went; the agent decides
//! which nodes are overloaded or dead and steers traffic away from them.
//!
//! # Layout
//!
//! - [`wire`]: the FlatBuffers messages of `schema/lbagent.fbs`, verified
//!   decoding into typed errors, and encoding.
//! - [`admission`]: DAGOR admission control, pure: priorities, the
//!   request histogram, queuing-time windows and the adaptive level.
//! - [`demo_service`]: a fixed-capacity UDP service that embeds
//!   [`admission`] (`lbagent demo-service`, the DAGOR experiment's subject).
//! - [`lb`]: the L5 overload algorithm, pure: idle and overload lists, the
//!   virtual counts, windows, probing. Time is an argument.
//! - [`config`]: the TOML configuration, its defaults (the original
//!   `lbagent.ini`) and `validate()`.
//! - [`model`]: plain shared values: [`model::ModuleId`], [`model::NodeAddr`],
//!   [`model::RouteNode`].
//! - [`metrics_http`]: the `GET /metrics` exchange every server answers.
//! - [`sdnotify`]: systemd readiness and watchdog notifications.
//! - [`signal`]: SIGTERM / SIGINT for the long-running subcommands.
//! - [`doorbell`], [`wakefd`]: wake-ups across threads for a glommio task
//!   and for a thread blocked in `poll`, so that idle servers sleep
//!   instead of polling stop flags.
//! - [`store`]: routes, the change log and call status in SQLite or
//!   PostgreSQL.
#![warn(missing_docs)]

pub mod admission;
pub mod agent;
pub mod client;
pub mod config;
pub mod demo_service;
pub mod dnsserver;
pub mod doorbell;
pub mod floor;
pub mod lb;
pub mod logging;
pub mod metrics_http;
pub mod model;
pub mod qpstest;
pub mod reload;
pub mod reporter;
pub mod sdnotify;
pub mod shm;
pub mod signal;
pub mod standalone;
pub mod store;
pub mod wakefd;
pub mod wire;
