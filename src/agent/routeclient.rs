//! The route client: the control core's TCP connection to the route servers
//! ("dnsserver"): versioned pulls, answers (whole, or "unchanged at the
//! version held"), pushes, periodic re-pulls, keep-alives, reconnection with
//! back-off and fail-over across the configured addresses.
//!
//! Two layers, as quinn-proto / quinn:
//!
//! - [`RouteClientCore`]: the protocol, pure. Time is an argument (`now`, in
//!   milliseconds from any fixed origin), bytes go in and out as slices; no
//!   sockets, no clocks, no randomness but a seeded generator. Everything
//!   subtle (deduplication, re-issue, versions, the re-pull schedule,
//!   liveness) is decided and tested here; the server list and back-off are
//!   [`super::reconnect`]'s.
//! - [`run`]: the glommio shell (`link_shell`, shared with the
//!   statistics client). It connects, moves bytes between the socket and the
//!   core, sleeps until the core's next deadline, and hands
//!   [`RouteClientEvent`]s to the caller. It decides nothing.
//!
//! The rules, in one place:
//!
//! - Every PullReq carries, for each module, the version the client holds
//!   (the newest it delivered, or the caller's via
//!   [`RouteClientCore::want_known`]; 0 for none). A module still at that
//!   version comes back in a RouteUnchanged: no event (the caller has the
//!   route), no nodes on the wire.
//! - Every module followed is pulled again [`RouteClientConfig::refresh_ms`]
//!   after its last answer, jittered down by up to a quarter and rounded up
//!   to [`REFRESH_TICK_MS`], from one heap of deadlines: the cost is the
//!   modules due, and modules due in one tick share PullReqs.
//!
//! Owns the wire conversation with the route server and nothing else: it
//! keeps no routes (the caller does, from the events), touches no shard and
//! no LB state, and must not grow policy about which modules to follow (the
//! caller says so with [`RouteClientCore::want`] and
//! [`RouteClientCore::forget`]).
//!
//! # Embedding
//!
//! The control core runs [`run`] as one task of its glommio executor:
//!
//! ```no_run
//! use glommio::channels::local_channel;
//! use lbagent_agent::routeclient::{run, RouteClientConfig, RouteClientEvent, RouteClientStatus};
//! use lbagent_model::ModuleId;
//!
//! glommio::LocalExecutorBuilder::default()
//!     .io_memory(512 << 10)
//!     .make()
//!     .unwrap()
//!     .run(async {
//!         let config = RouteClientConfig::new(vec!["127.0.0.1:7777".parse().unwrap()]);
//!         let (want_tx, want_rx) = local_channel::new_unbounded();
//!         let (event_tx, event_rx) = local_channel::new_unbounded();
//!         let status = RouteClientStatus::default();
//!         let (stop_tx, stop_rx) = local_channel::new_bounded::<()>(1);
//!         let shutdown = async move {
//!             let _ = stop_rx.recv().await;
//!         };
//!         let client = glommio::spawn_local(run(config, want_rx, event_tx, shutdown, status.clone()));
//!         want_tx.try_send(ModuleId::new(10001, 1)).unwrap();
//!         while let Some(event) = event_rx.recv().await {
//!             if let RouteClientEvent::Route(route) = event {
//!                 // install route.nodes for route.module, if route.version is newer
//!                 # let _ = route;
//!                 break;
//!             }
//!         }
//!         stop_tx.try_send(()).unwrap();
//!         client.await.unwrap();
//!     });
//! ```

use std::cell::{Cell, RefCell};
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::rc::Rc;
use std::time::Duration;

use glommio::channels::local_channel::{LocalReceiver, LocalSender};

use super::link_shell::{LinkCore, LinkShell};
use super::reconnect::{LinkState, Reconnect, ReconnectPolicy};
use super::timers::Timers;
use lbagent_model::{ModuleId, NodeAddr, NodeMeta, Policy, RouteNode};
use lbagent_tls::TlsHandle;
use lbagent_wire::{
    decode, read_node_meta, write_frame, BadMeta, DecodeError, Encoder, FrameError, Limits,
    Message, RetCode, ValidationError, MAX_PULL_MODULES,
};

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
