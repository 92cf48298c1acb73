//! The agent: UDP shards that own their modules outright, and one control
//! core for everything else (route server, reporter, heartbeat, snapshot,
//! metrics), linked by SPSC rings.
//!
//! The files it shares with clients (the heartbeat, the static route file),
//! its batched UDP and its clocks live in `lbagent-host`; the pure
//! decisions in `lbagent-lb` and `lbagent-admission`.
//!
//! # Layout
//!
//! - [`snapshot_thread`]: the thread that writes the static route file, off
//!   the control core.
//! - [`route_table`]: the control core's copy of the routes, filled from
//!   the snapshot in slices after a restart.
//! - [`routeclient`]: the connection to the route servers: pulls, answers,
//!   pushes, reconnect with back-off and fail-over.
//! - [`runtime`]: starting the agent: its config checked, its files and
//!   sockets opened, its threads started; stopping it.
//! - [`shard`]: one shard's request handling, sans-IO.
//! - [`shard_rt`]: the shard's glommio shell: batched UDP in and out,
//!   shared memory, timers, spin or park.
//! - [`control`]: the control core: the rings, the two TCP clients, the
//!   heartbeat, the snapshot, metrics, reloads.
//! - [`live`]: a reloaded configuration on its way to the control core.
//! - [`overload_sim`]: a seeded model of a shard protecting itself (the
//!   agent's own DAGOR), run by `perf/agent_overload.rs`.
//! - [`timers`]: the shard's deadlines, a min-heap with lazy deletion.
//! - [`messages`]: what crosses the rings between shards and the control core.
//! - [`metrics`]: counters, the service-time histogram, Prometheus text.
//! - [`liveness`]: per-loop turn counters and the systemd watchdog.
//! - [`reconnect`]: what the two TCP clients' cores share: the server list,
//!   its rotation, the back-off, replaceable at runtime.
//! - `link_shell`: the one glommio shell both TCP clients run in (connect,
//!   frame I/O, deadlines, input, events), around their sans-IO cores.
//! - [`statsclient`]: the connection to the reporters: statistics out,
//!   acks in, a bounded buffer, reconnect with back-off and fail-over.
//! - [`wake`]: when the shard's and the control core's timers are next
//!   due, so that an idle agent sleeps until then.
#![warn(missing_docs)]

pub mod control;
pub(crate) mod link_shell;
pub mod live;
pub mod liveness;
pub mod messages;
pub mod metrics;
pub mod overload_sim;
pub mod reconnect;
pub mod route_table;
pub mod routeclient;
pub mod runtime;
pub mod shard;
pub mod shard_rt;
pub mod snapshot_thread;
pub mod statsclient;
pub mod timers;
pub mod wake;
