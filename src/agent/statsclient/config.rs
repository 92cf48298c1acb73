//! The statistics client's settings and their checks.

use super::*;

/// The stats client's settings. Times are milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsClientConfig {
    /// The reporters, in order of preference. The client starts with the
    /// first and moves to the next (wrapping around) after every failed
    /// attempt or lost connection. Shuffle it per host to spread a fleet.
    pub addrs: Vec<SocketAddr>,
    /// This agent's address, sent as every report's `caller` (default
    /// 0.0.0.0: unknown).
    pub caller: Ipv4Addr,
    /// How long one connection attempt may take (default 1000).
    pub connect_timeout_ms: u64,
    /// A connection that receives nothing for this long while reports are
    /// in flight is dead (default 15000); so is a write that cannot proceed
    /// for this long.
    pub ack_timeout_ms: u64,
    /// The first reconnection delay's window (default 100); it doubles per
    /// failed attempt up to [`Self::backoff_max_ms`], and each delay is
    /// drawn uniformly from `0..=window` (full jitter: see
    /// [`crate::reconnect`]).
    pub backoff_initial_ms: u64,
    /// The longest reconnection delay (default 1000): after a partition or
    /// a restart of every server, how long at most an agent waits once a
    /// server is reachable again (plus the attempt in progress).
    pub backoff_max_ms: u64,
    /// The most entries one StatsReport carries (default 1024; at most
    /// [`MAX_MODULES_PER_REPORT`]).
    pub max_modules_per_report: usize,
    /// The most nodes one StatsReport carries (default 65536; at most
    /// [`MAX_NODES_PER_REPORT`]); a module with more is split.
    pub max_nodes_per_report: usize,
    /// The most reports sent and not yet acknowledged (default 8).
    pub max_reports_in_flight: usize,
    /// The most entries waiting to be sent, re-sends included (default
    /// 100000); past it the oldest are dropped.
    pub max_queued: usize,
    /// On shutdown, how long the one attempt to send what is queued (and
    /// have it acknowledged) may take (default 500; 0: no attempt).
    pub flush_timeout_ms: u64,
    /// Seed of the back-off jitter. [`StatsClientConfig::new`] draws it at
    /// random so that a fleet's agents do not reconnect in step; tests fix it.
    pub jitter_seed: u64,
    /// Mutual TLS to the reporters (`[tls]`), or plain TCP (default).
    pub tls: TlsHandle,
}

impl StatsClientConfig {
    /// The defaults for `addrs`, with a random jitter seed and an unknown
    /// caller (set [`Self::caller`]).
    pub fn new(addrs: Vec<SocketAddr>) -> Self {
        StatsClientConfig {
            addrs,
            caller: Ipv4Addr::UNSPECIFIED,
            connect_timeout_ms: 1000,
            ack_timeout_ms: 15_000,
            backoff_initial_ms: 100,
            backoff_max_ms: 1000,
            max_modules_per_report: 1024,
            max_nodes_per_report: 65_536,
            max_reports_in_flight: 8,
            max_queued: 100_000,
            flush_timeout_ms: 500,
            jitter_seed: fastrand::u64(..),
            tls: TlsHandle::default(),
        }
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`StatsConfigError::NoAddrs`] for an empty address list,
    /// [`StatsConfigError::OutOfRange`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), StatsConfigError> {
        if self.addrs.is_empty() {
            return Err(StatsConfigError::NoAddrs);
        }
        let checks: [(&'static str, u64, bool, &'static str); 8] = [
            (
                "connect_timeout_ms",
                self.connect_timeout_ms,
                self.connect_timeout_ms > 0,
                "at least 1",
            ),
            (
                "ack_timeout_ms",
                self.ack_timeout_ms,
                self.ack_timeout_ms > 0,
                "at least 1",
            ),
            (
                "backoff_initial_ms",
                self.backoff_initial_ms,
                self.backoff_initial_ms > 0,
                "at least 1",
            ),
            (
                "backoff_max_ms",
                self.backoff_max_ms,
                self.backoff_max_ms >= self.backoff_initial_ms,
                "at least backoff_initial_ms",
            ),
            (
                "max_modules_per_report",
                self.max_modules_per_report as u64,
                (1..=MAX_MODULES_PER_REPORT).contains(&self.max_modules_per_report),
                "1..=65536",
            ),
            (
                "max_nodes_per_report",
                self.max_nodes_per_report as u64,
                (1..=MAX_NODES_PER_REPORT).contains(&self.max_nodes_per_report),
                "1..=262144",
            ),
            (
                "max_reports_in_flight",
                self.max_reports_in_flight as u64,
                self.max_reports_in_flight > 0,
                "at least 1",
            ),
            (
                "max_queued",
                self.max_queued as u64,
                self.max_queued > 0,
                "at least 1",
            ),
        ];
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, allowed)) => Err(StatsConfigError::OutOfRange {
                field,
                value,
                allowed,
            }),
            None => Ok(()),
        }
    }
}

impl StatsClientConfig {
    /// The servers and back-off, for [`Reconnect`].
    pub(super) fn reconnect_policy(&self) -> ReconnectPolicy {
        ReconnectPolicy {
            addrs: self.addrs.clone(),
            backoff_initial_ms: self.backoff_initial_ms,
            backoff_max_ms: self.backoff_max_ms,
        }
    }
}

/// Why a [`StatsClientConfig`] is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StatsConfigError {
    /// `addrs` is empty.
    #[error("stats client addrs is empty: configure at least one reporter address")]
    NoAddrs,
    /// A field is outside its allowed range.
    #[error("stats client {field} is {value}: must be {allowed}")]
    OutOfRange {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it must be.
        allowed: &'static str,
    },
}
