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
//! - [`runtime`]: starts the shards and the control core, each on its own
//!   pinned glommio executor, and stops them.
//! - [`shard`]: one shard's request handling, sans-IO (one file per request
//!   kind under `shard/`).
//! - [`shard_rt`]: the shard's glommio shell: the socket, the request loop,
//!   the rings, the shared-memory sweep.
//! - [`local_socket`]: the local (Unix) socket bound safely at start, the
//!   acceptor thread that identifies each connection (`SO_PEERCRED`), and
//!   whom the configuration trusts.
//! - [`local_rt`]: the shard's side of the local socket: a reader and a
//!   writer task per connection.
//! - [`park`]: when the shard's request loop reads its socket, spins and
//!   parks, given what each turn saw and the time.
//! - [`bell`]: the control core's and the local acceptor's doorbell to a
//!   shard waiting on its UDP socket alone.
//! - [`control_core`]: the control core's decisions, sans-IO: shard
//!   messages, client events, heartbeat, snapshot and reload turns.
//! - [`control`]: the control core's glommio shell around them: the rings,
//!   the two clients, the metrics endpoint, the main loop.
//! - [`messages`]: what crosses the rings between shards and the control core.
//! - [`timers`]: the shard's deadlines, a min-heap with lazy deletion.
//! - [`wake`]: when the shard's and the control core's timers are next
//!   due, so that an idle agent sleeps until then.
//! - [`route_table`]: the control core's copy of the routes, filled from
//!   the snapshot in slices after a restart.
//! - [`snapshot_thread`]: the thread that writes the static route file, off
//!   the control core.
//! - [`routeclient`]: the connection to the route servers: pulls, answers,
//!   pushes, reconnect with back-off and fail-over.
//! - [`statsclient`]: the connection to the reporters: statistics out,
//!   acks in, a bounded buffer, reconnect with back-off and fail-over.
//! - [`reconnect`]: what the two TCP clients' cores share: the server list,
//!   its rotation, the back-off, replaceable at runtime.
//! - `link_shell`: the one glommio shell both TCP clients run in (connect,
//!   frame I/O, deadlines, input, events), around their sans-IO cores.
//! - [`metrics`]: counters, the service-time summary, the Prometheus
//!   exposition (prometheus-client).
//! - [`liveness`]: per-loop turn counters and the systemd watchdog.
//! - [`live`]: a reloaded configuration's way from the main thread to the
//!   control core.
//! - [`overload_sim`]: a seeded simulation of a shard's own shedding and
//!   its callers' hold-back.
#![warn(missing_docs)]

pub mod bell;
pub mod control;
pub mod control_core;
pub(crate) mod link_shell;
pub mod live;
pub mod liveness;
pub mod local_rt;
pub mod local_socket;
pub mod messages;
pub mod metrics;
pub mod overload_sim;
pub mod park;
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
