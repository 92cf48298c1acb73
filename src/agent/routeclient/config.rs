//! The route client's settings and their checks.

use super::*;

/// The route client's settings. Times are milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteClientConfig {
    /// The route servers, in order of preference. The client starts with the
    /// first and moves to the next (wrapping around) after every failed
    /// attempt or lost connection. Shuffle it per host to spread a fleet.
    pub addrs: Vec<SocketAddr>,
    /// How long one connection attempt may take (default 1000).
    pub connect_timeout_ms: u64,
    /// Interval between KeepAlives while connected (default 5000); it must
    /// be well under the route server's subscription timeout.
    pub keepalive_ms: u64,
    /// A connection that receives nothing for this long while answers are
    /// due (pulls in flight, a KeepAlive unanswered) is dead (default 15000).
    pub idle_timeout_ms: u64,
    /// The first reconnection delay's window (default 100); it doubles per
    /// failed attempt up to [`Self::backoff_max_ms`], and each delay is
    /// drawn uniformly from `0..=window` (full jitter: see
    /// [`crate::reconnect`]).
    pub backoff_initial_ms: u64,
    /// The longest reconnection delay (default 1000): after a partition or
    /// a restart of every server, how long at most an agent waits once a
    /// server is reachable again (plus the attempt in progress).
    pub backoff_max_ms: u64,
    /// The most modules one PullReq names (default 1024; at most
    /// [`MAX_PULL_MODULES`]).
    pub max_modules_per_pull: usize,
    /// How often each module followed is pulled again, carrying the
    /// version held, as a safety net under the pushes (default 15000, the
    /// seed's update_timeout; 0: never). Each module's next re-pull is due
    /// this long after its last answer, jittered down by up to a quarter
    /// and rounded up to [`REFRESH_TICK_MS`], so that modules answered
    /// together drift apart and every tick's due modules share PullReqs.
    pub refresh_ms: u64,
    /// Seed of the back-off jitter. [`RouteClientConfig::new`] draws it at
    /// random so that a fleet's agents do not reconnect in step; tests fix it.
    pub jitter_seed: u64,
    /// Mutual TLS to the route servers (`[tls]`), or plain TCP (default).
    pub tls: TlsHandle,
}

impl RouteClientConfig {
    /// The defaults for `addrs`, with a random jitter seed.
    pub fn new(addrs: Vec<SocketAddr>) -> Self {
        RouteClientConfig {
            addrs,
            connect_timeout_ms: 1000,
            keepalive_ms: 5000,
            idle_timeout_ms: 15_000,
            backoff_initial_ms: 100,
            backoff_max_ms: 1000,
            max_modules_per_pull: 1024,
            refresh_ms: 15_000,
            jitter_seed: fastrand::u64(..),
            tls: TlsHandle::default(),
        }
    }

    /// Checks every field against its allowed range.
    ///
    /// # Errors
    /// [`RouteConfigError::NoAddrs`] for an empty address list,
    /// [`RouteConfigError::OutOfRange`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), RouteConfigError> {
        if self.addrs.is_empty() {
            return Err(RouteConfigError::NoAddrs);
        }
        let checks: [(&'static str, u64, bool, &'static str); 6] = [
            (
                "connect_timeout_ms",
                self.connect_timeout_ms,
                self.connect_timeout_ms > 0,
                "at least 1",
            ),
            (
                "keepalive_ms",
                self.keepalive_ms,
                self.keepalive_ms > 0,
                "at least 1",
            ),
            (
                "idle_timeout_ms",
                self.idle_timeout_ms,
                self.idle_timeout_ms > self.keepalive_ms,
                "more than keepalive_ms",
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
                "max_modules_per_pull",
                self.max_modules_per_pull as u64,
                (1..=MAX_PULL_MODULES).contains(&self.max_modules_per_pull),
                "1..=65536",
            ),
        ];
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, allowed)) => Err(RouteConfigError::OutOfRange {
                field,
                value,
                allowed,
            }),
            None => Ok(()),
        }
    }
}

impl RouteClientConfig {
    /// The servers and back-off, for [`Reconnect`].
    pub(super) fn reconnect_policy(&self) -> ReconnectPolicy {
        ReconnectPolicy {
            addrs: self.addrs.clone(),
            backoff_initial_ms: self.backoff_initial_ms,
            backoff_max_ms: self.backoff_max_ms,
        }
    }
}

/// Why a [`RouteClientConfig`] is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteConfigError {
    /// `addrs` is empty.
    #[error("route client addrs is empty: configure at least one route server address")]
    NoAddrs,
    /// A field is outside its allowed range.
    #[error("route client {field} is {value}: must be {allowed}")]
    OutOfRange {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it must be.
        allowed: &'static str,
    },
}
