//! lbagent: a load-balancing agent for every host of a large fleet.
//!
//! Applications ask the agent, over local UDP or shared memory, for a node
//! of a remote service named by `(modid, cmdid)` and report how each call
//! went; the agent decides which nodes are overloaded or dead and steers
//! traffic away from them.
//!
//! This package is the `lbagent` binary and what only the binary needs; the
//! layers it is built from are crates of their own (the workspace's
//! `Cargo.toml` lists them), re-exported here under their short names so
//! that the system tests, benches and tools reach every layer through one
//! dependency.
//!
//! # Layout
//!
//! The layers, lowest first (each depends only on those above it):
//!
//! - [`model`] (`lbagent-model`): plain shared values: [`model::ModuleId`],
//!   [`model::NodeAddr`], [`model::RouteNode`].
//! - [`wire`] (`lbagent-wire`): the FlatBuffers messages of
//!   `schema/lbagent.fbs`, verified decoding into typed errors, and encoding.
//! - [`admission`] (`lbagent-admission`): DAGOR admission control, pure.
//! - [`lb`] (`lbagent-lb`): the L5 overload algorithm and the balance
//!   policy, pure. Time is an argument.
//! - [`host`] (`lbagent-host`): what the agent and its clients share on one
//!   host: the heartbeat file, the static route file, batched UDP, clocks.
//! - [`shm`] (`lbagent-shm`): the shared-memory request path.
//! - [`client`] (`lbagent-client`): the client library.
//! - [`config`] (`lbagent-config`): the TOML configuration, its defaults
//!   (the original `lbagent.ini`) and `validate()`.
//! - [`service`] (`lbagent-service`): what every long-running process
//!   shares: logging, reload, signals, systemd notification, `/metrics`,
//!   wake-ups across threads.
//! - [`tls`] (`lbagent-tls`): mutual TLS between hosts: the PEM files,
//!   their reloads, the peer's identity.
//! - [`agent`] (`lbagent-agent`): the agent runtime.
//! - [`store`] (`lbagent-store`): routes, the change log and call status in
//!   SQLite or PostgreSQL.
//! - [`dnsserver`] (`lbagent-dnsserver`): the route server.
//! - [`reporter`] (`lbagent-reporter`): the reporter.
//!
//! This package's own modules:
//!
//! - [`client_tools`]: `lbagent gethost`, `report` and `getroute`.
//! - [`qpstest`]: the load generator.
//! - [`floor`]: the UDP floor, a stand-in agent at the cost of the kernel.
//! - [`standalone`]: the whole system in one process on the embedded store.
//! - [`demo_service`]: a fixed-capacity UDP service that embeds
//!   [`admission`] (`lbagent demo-service`, the DAGOR experiment's subject).
#![warn(missing_docs)]

pub use lbagent_admission as admission;
pub use lbagent_agent as agent;
pub use lbagent_client as client;
pub use lbagent_config as config;
pub use lbagent_dnsserver as dnsserver;
pub use lbagent_host as host;
pub use lbagent_lb as lb;
pub use lbagent_model as model;
pub use lbagent_reporter as reporter;
pub use lbagent_service as service;
pub use lbagent_shm as shm;
pub use lbagent_store as store;
pub use lbagent_tls as tls;
pub use lbagent_wire as wire;

pub mod client_tools;
pub mod demo_service;
pub mod floor;
pub mod qpstest;
pub mod standalone;
