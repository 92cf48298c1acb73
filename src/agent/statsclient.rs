//! The stats client: the control core's TCP connection to the reporters:
//! per-module, per-node call statistics out as StatsReports, StatsAcks in,
//! a bounded buffer across outages, reconnection with back-off and
//! fail-over across the configured addresses.
//!
//! Two layers, as [`super::routeclient`]:
//!
//! - [`StatsClientCore`]: the protocol, pure. Time is an argument (`now`,
//!   milliseconds since the Unix epoch: the shell reads the wall clock once
//!   and advances it monotonically), bytes go in and out as slices; no
//!   sockets, no clocks, no randomness but a seeded generator. Batching,
//!   acknowledgement, re-sending, the buffer bound, back-off and fail-over
//!   are decided and tested here.
//! - [`run`]: the glommio shell (`link_shell`, shared with the route
//!   client). It connects, moves bytes between the socket
//!   and the core, sleeps until the core's next deadline, flushes once on
//!   shutdown, and hands [`StatsClientEvent`]s to the caller. It decides
//!   nothing.
//!
//! The rules, in one place:
//!
//! - Statistics are queued as *entries*, one per `(module, nodes)` pushed
//!   (a module with more than [`StatsClientConfig::max_nodes_per_report`]
//!   nodes becomes several entries). Entries are sent in push order, batched
//!   into StatsReports of at most [`StatsClientConfig::max_modules_per_report`]
//!   entries and `max_nodes_per_report` nodes, all taken in the same second
//!   (the report's `time_s`).
//! - A report stays in flight until the reporter's StatsAck echoes its
//!   `seq`; at most [`StatsClientConfig::max_reports_in_flight`] are.
//! - When the connection ends, every report in flight goes back to the
//!   front of the queue, and is re-sent first, with the same `seq` and (bar
//!   entries dropped meanwhile) the same content, so that a reporter may
//!   deduplicate on `(caller, seq)`. Nothing is lost while the bound holds;
//!   a report may arrive twice when its ack was lost.
//! - At most [`StatsClientConfig::max_queued`] entries wait (reports in
//!   flight are bounded apart, by the window). Past the bound the oldest
//!   waiting entries are dropped, counted, and reported as one
//!   [`StatsClientEvent::Dropped`] per burst.
//! - An ErrorResp refuses one report: it is dropped (re-sending would be
//!   refused again), counted as rejected, and reported. An ErrorResp
//!   `Unavailable` instead closes the connection: its report is re-sent,
//!   elsewhere if need be.
//! - Reconnection: the same capped, jittered exponential back-off and
//!   round-robin fail-over as the route client (one shared helper).
//!
//! Owns the wire conversation with the reporter and nothing else: it does
//! not collect statistics (the shards do, and the caller pushes them), keeps
//! nothing once acknowledged, touches no shard and no LB state, and must not
//! grow policy about what to report or when (the caller pushes when it has
//! something).
//!
//! # Embedding
//!
//! The control core runs [`run`] as one task of its glommio executor:
//!
//! ```no_run
//! use glommio::channels::local_channel;
//! use lbagent_agent::statsclient::{run, StatsClientConfig, StatsClientStatus};
//! use lbagent_lb::NodeCallStats;
//! use lbagent_model::{ModuleId, NodeAddr};
//!
//! glommio::LocalExecutorBuilder::default()
//!     .io_memory(512 << 10)
//!     .make()
//!     .unwrap()
//!     .run(async {
//!         let mut config = StatsClientConfig::new(vec!["127.0.0.1:7778".parse().unwrap()]);
//!         config.caller = "10.0.0.7".parse().unwrap();
//!         let (stats_tx, stats_rx) = local_channel::new_unbounded();
//!         let (event_tx, event_rx) = local_channel::new_bounded(1024);
//!         let status = StatsClientStatus::default();
//!         let (stop_tx, stop_rx) = local_channel::new_bounded::<()>(1);
//!         let shutdown = async move {
//!             let _ = stop_rx.recv().await;
//!         };
//!         let client = glommio::spawn_local(run(config, stats_rx, event_tx, shutdown, status.clone()));
//!         glommio::spawn_local(async move {
//!             while let Some(event) = event_rx.recv().await {
//!                 eprintln!("reporter: {event}");
//!             }
//!         })
//!         .detach();
//!         let node = NodeCallStats {
//!             addr: "10.0.0.1:9000".parse::<NodeAddr>().unwrap(),
//!             succ: 120,
//!             err: 3,
//!             overloaded: false,
//!             consumed: 0,
//!         };
//!         stats_tx.try_send((ModuleId::new(10001, 1), vec![node])).unwrap();
//!         // ... later: stop; the client flushes for at most flush_timeout_ms.
//!         stop_tx.try_send(()).unwrap();
//!         client.await.unwrap();
//!         let left = status.stats().queued + status.stats().in_flight;
//!         # let _ = left;
//!     });
//! ```

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::pin;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_lite::AsyncReadExt;
use glommio::channels::local_channel::{LocalReceiver, LocalSender};

use super::link_shell::{LinkCore, LinkShell};
use super::reconnect::{LinkState, Reconnect, ReconnectPolicy};
use lbagent_host::clock;
use lbagent_lb::NodeCallStats;
use lbagent_model::{ModuleId, NodeAddr};
use lbagent_service::conn::{race, Either};
use lbagent_tls::{Stream, TlsHandle};
use lbagent_wire::{
    decode, write_frame, DecodeError, Encoder, FrameError, Limits, Message, ModuleStats, NodeStats,
    RetCode,
};

/// The most entries one StatsReport may carry.
pub const MAX_MODULES_PER_REPORT: usize = 65_536;

/// The most nodes one StatsReport may carry. With
/// [`MAX_MODULES_PER_REPORT`], a report stays well under the 16 MiB frame
/// limit (about 20 bytes a node, 32 a module).
pub const MAX_NODES_PER_REPORT: usize = 262_144;

mod config;
mod events;
mod protocol;
mod shell;
#[cfg(test)]
mod tests;

pub use config::*;
pub use events::*;
pub use protocol::*;
pub use shell::*;
