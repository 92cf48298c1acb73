//! A reloaded configuration on its way from the main thread (which handles
//! SIGHUP) to the control core, which applies it: `[lb]` parameters to
//! every shard through the control → shard rings, the route server and
//! reporter lists to their clients, the snapshot interval to its loop.
//!
//! A mailbox of one: a second reload before the control core looked
//! replaces the first (each carries the whole live part of the
//! configuration, so nothing is lost).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::messages::LiveParams;
use lbagent_config::Config;

/// The live part of a configuration, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveUpdate {
    /// For every shard.
    pub shard: LiveParams,
    /// The route servers, when they changed.
    pub route_servers: Option<Vec<SocketAddr>>,
    /// The reporters, when they changed.
    pub reporters: Option<Vec<SocketAddr>>,
    /// Between route snapshots.
    pub snapshot_interval: Duration,
}

impl LiveUpdate {
    /// The live part of `config`; the server lists are passed resolved
    /// (`None`: unchanged).
    pub fn new(
        config: &Config,
        route_servers: Option<Vec<SocketAddr>>,
        reporters: Option<Vec<SocketAddr>>,
    ) -> Self {
        LiveUpdate {
            shard: LiveParams {
                params: config.lb.params(),
                update_timeout_ms: config.lb.update_timeout * 1000,
                report_timeout_ms: config.lb.report_timeout * 1000,
                locality_min_percent: u32::from(config.lb.locality_min_percent),
                label_fallback: config.lb.label_fallback(),
            },
            route_servers,
            reporters,
            snapshot_interval: Duration::from_secs(config.agent.snapshot_interval),
        }
    }
}

/// The mailbox between the main thread and the control core.
#[derive(Clone, Debug, Default)]
pub struct LiveSlot(Arc<Mutex<Option<LiveUpdate>>>);

impl LiveSlot {
    /// Leaves `update` for the control core (replacing one not yet taken).
    pub fn put(&self, update: LiveUpdate) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(update);
    }

    /// The update waiting, if any (the control core, each turn).
    pub fn take(&self) -> Option<LiveUpdate> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}
