//! The client library: getHost, report, register and getRoute against the
//! local agent, with the static-route fallback of seed 000 and the optional
//! route cache (the original's CacheLayer). Synchronous; one [`Client`] per
//! thread.
//!
//! ```no_run
//! use std::time::Duration;
//! use lbagent_client::{Client, ClientError};
//!
//! let mut client = Client::new()?;
//! client.register(100, 1, Duration::from_secs(1))?; // pull before first use
//! let host = client.get_host(100, 1, Duration::from_millis(200))?;
//! // ... call host.addr, measure the call ...
//! client.report(100, 1, host.addr, 0, 12)?;
//! # Ok::<(), ClientError>(())
//! ```
//!
//! # Finding the agent
//!
//! No configuration: the heartbeat file ([`ClientOptions::heartbeat_path`],
//! by default `$LBAGENT_HEARTBEAT`, else `/run/lbagent/heartbeat`) says
//! how many shards the agent runs and on which ports; a module's requests go
//! to shard `(modid + cmdid) % shards`, over one connected UDP socket per
//! shard. When the agent restarts (on other ports, or after the file was
//! replaced) the client notices at the next beat, or at once when a request
//! fails, and follows it. Answers are matched to requests by sequence
//! number (stale ones are discarded), and a request is re-sent every
//! [`resend_interval`] (a quarter of the timeout, 10..=100 ms) until it is
//! answered or the caller's timeout passes. When the agent serves its
//! local socket (a Unix socket beside the heartbeat), the client also
//! opens one connection per shard that identifies its UDP socket to the
//! agent (see [`ClientOptions::local_socket`]): the agent then knows the
//! calling user, which a report that consumes units or a level shared by
//! every caller needs; requests go over it only when UDP cannot reach the
//! agent (a container with its own network namespace).
//!
//! # When the agent is down
//!
//! Before each request the client compares the heartbeat with the clock. A
//! beat older than [`ClientOptions::max_heartbeat_age`] (2 s), or no
//! readable heartbeat file, means the agent is down; so does a shard port
//! that refuses datagrams, or a shard that did not answer a request within
//! its timeout (until the heartbeat moves again). Then:
//!
//! - **getHost** answers from the agent's static route file (the path the
//!   heartbeat names; without any heartbeat, [`ClientOptions::snapshot_path`])
//!   with a random node of the module ([`HostSource::StaticRoutes`]). The
//!   file is read again only when it changed. A missing, truncated or
//!   corrupt file, or one without the module, is
//!   [`ClientError::StaticRoutes`] (but a getHost the agent did not answer
//!   in time, and the file cannot answer either, is
//!   [`ClientError::Timeout`]). As soon as the heartbeat moves, getHost goes
//!   back to the agent. With [`ClientOptions::static_fallback`] off, the
//!   call fails with [`ClientError::AgentDown`] (or `Timeout`) instead.
//! - **report** drops the report and returns `Ok(())`, as the original did:
//!   the agent that would use it is not there, and an application must not
//!   fail a call that a static host served because its report could not be
//!   delivered. Held successes (route cache) are dropped too.
//! - **register** and **getRoute** fail with [`ClientError::AgentDown`].
//!
//! # Route cache
//!
//! With [`ClientOptions::cache`] on, getHost is answered in process while
//! the agent says no node of the module is overloaded (see [`cache`] for
//! the rules: refresh every 2 s by version, round robin, successes held and
//! batched, failures sent at once after the held successes). A getHost the
//! cache answers does not pass the agent's admission control: its DAGOR
//! priorities are not looked at.
//!
//! # Holding back (DAGOR with the agent)
//!
//! While an agent shard sheds under its own overload, its getHost answers
//! carry its admission level. The uncached getHost path remembers it per
//! shard for [`ClientOptions::holdback`] (100 ms) and refuses at once,
//! with [`ClientError::Rejected`] and without a datagram, a call the level
//! does not admit (see [`holdback`]). [`Client::held_back`] counts them.
//!
//! # DAGOR priorities and levels
//!
//! [`Client::get_host_for_user`] takes a call's business priority and its
//! user id: the client hashes the id to `U` with the admission core's
//! rotating key ([`ClientOptions::user_hash_seed`],
//! [`ClientOptions::user_key_period_s`], by default the `[admission]`
//! defaults), so callers need not keep a
//! [`lbagent_admission::UserPriorities`] of their own.
//! [`Client::get_host_with`] takes the two priorities as they are
//! ([`Priority`]). [`Client::report_with_level`] passes on the level a
//! downstream attached to its response.
//!
//! A helper lets a service attach its level to a response and read it
//! back: [`level`] (the same module as [`lbagent_admission::piggyback`]):
//! [`level::encode`] / [`level::decode`] for the two bytes `[B*, U*]` of a
//! service's own protocol (`[0, 0]` = no level), [`level::to_fb`] /
//! [`level::from_fb`] for the schema's `AdmissionLevel`.
//!
//! ```
//! use lbagent_client::level;
//! use lbagent_admission::AdmissionLevel;
//!
//! // The service, in its response:
//! let bytes = level::encode(Some(AdmissionLevel::new(10, 128)));
//! // The caller, reading it back for `report_with_level`:
//! assert_eq!(level::decode(&bytes), Ok(Some(AdmissionLevel::new(10, 128))));
//! ```
//!
//! # Layout
//!
//! - [`error`]: the one error type, [`ClientError`].
//! - `clock`: coarse monotonic milliseconds, one read per call.
//! - `locate`: the heartbeat as the client reads it.
//! - `link`: the UDP sockets, sequence numbers, re-sends; the slots and
//!   the local connections it prefers.
//! - `local`: one connection to a shard's local (Unix) socket: frames out
//!   and in, no SIGPIPE.
//! - `statics`: the static route file, re-read only when it changed.
//! - [`cache`]: the route cache's rules, sans-IO.
//! - [`holdback`]: the agent's own level, remembered per shard, sans-IO
//!   (pure, it lives in `lbagent-admission`; re-exported).
//! - [`exit`]: the tool commands' exit status for each error.
//! - `priority`: a call's business and user priority ([`Priority`]).
//! - `client`: [`Client`], the shell that ties them together.
#![warn(missing_docs)]

pub mod cache;
#[allow(clippy::module_inception)]
mod client;
mod clock;
pub mod error;
pub mod exit;
pub use lbagent_admission::holdback;
mod link;
mod local;
mod locate;
mod priority;
mod statics;
#[cfg(test)]
mod timed_tests;

use std::path::PathBuf;
use std::time::Duration;

pub use client::{Client, CONSUME_WAIT};
pub use error::ClientError;
pub use link::{resend_interval, MAX_RESEND, MIN_RESEND};
pub use priority::Priority;

/// The admission level on the wire, for a service that attaches its level
/// to its responses and for its callers that read it back (re-exported
/// from [`lbagent_admission::piggyback`]).
pub use lbagent_admission::piggyback as level;

use lbagent_model::{ModuleId, NodeAddr};
use lbagent_wire::NodeStatus;

/// The environment variable that overrides the default heartbeat path.
pub const HEARTBEAT_ENV: &str = "LBAGENT_HEARTBEAT";

/// The environment variable that overrides the default static route file.
pub const SNAPSHOT_ENV: &str = "LBAGENT_SNAPSHOT";

/// The longest [`ClientOptions::holdback`] accepted: 60 s.
pub const MAX_HOLDBACK: Duration = Duration::from_secs(60);

/// The longest [`ClientOptions::user_key_period_s`] accepted (a year, as
/// `admission.user_key_period_s`).
pub const MAX_USER_KEY_PERIOD_S: u64 = 31_536_000;

/// How a [`Client`] finds and uses the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientOptions {
    /// The agent's heartbeat file. Default: `$LBAGENT_HEARTBEAT`, else
    /// `/run/lbagent/heartbeat` (the agent's `agent.heartbeat_path`).
    pub heartbeat_path: PathBuf,
    /// Route cache (the original's CacheLayer). Default false.
    pub cache: bool,
    /// A heartbeat older than this means "agent down": answer from the
    /// static route file. Default 2 s (seed 000); at least 1 ms.
    pub max_heartbeat_age: Duration,
    /// DAGOR business priority sent with getHost: 0 = unset, else 1..=128
    /// (1 = most important). Default 0.
    pub business_priority: u8,
    /// DAGOR user priority sent with getHost: 0 = unset, else 1..=128.
    /// Default 0.
    pub user_priority: u8,
    /// The static route file to use while no heartbeat header has been read
    /// (the heartbeat file is missing); once one has, the path the agent
    /// published wins. Default: `$LBAGENT_SNAPSHOT`, else
    /// `/var/lib/lbagent/routes.snapshot` (the agent's `agent.snapshot_path`).
    pub snapshot_path: PathBuf,
    /// Answer getHost from the static route file while the agent is down.
    /// Default true; off, such a getHost fails with
    /// [`ClientError::AgentDown`] or [`ClientError::Timeout`] (a load
    /// generator measuring the agent wants that).
    pub static_fallback: bool,
    /// How long the admission level an agent shard attached to its last
    /// getHost answer is trusted (see [`holdback`]): while it is, a getHost
    /// whose priorities it does not admit fails at once with
    /// [`ClientError::Rejected`], without a datagram. Default 100 ms; zero
    /// turns holding back off; at most 60 s. Only the uncached getHost
    /// path learns and honours the level.
    pub holdback: Duration,
    /// Talk to the agent through shared memory when its heartbeat offers
    /// regions (`[shm] enabled` on the agent; see the README's "Shared
    /// memory"), UDP otherwise and whenever a region is unusable. Default
    /// true.
    pub shm: bool,
    /// Identify this client to the agent over its local socket (a Unix
    /// socket beside the heartbeat, `agent.local_socket`): one connection
    /// per shard carries the client's UDP socket to the agent, which then
    /// knows the user behind that source (requests that act beyond the
    /// caller, a report that consumes units or a downstream level every
    /// caller of the module shares, need a trusted one) and gives a
    /// balance module's units back when the process exits. Requests go
    /// over UDP (or shared memory) as before; over the connection only
    /// when UDP cannot reach the agent (another network namespace).
    /// Nothing changes when the socket is not there. Default true.
    pub local_socket: bool,
    /// The seed of the user-priority hash that [`Client::get_host_for_user`]
    /// uses to turn a user id into `U`: every process that assigns user
    /// priorities must share it. Default: the packaged
    /// `admission.user_hash_seed`.
    pub user_hash_seed: u64,
    /// How often, in seconds, the user-priority hash's key rotates (a user
    /// keeps one `U` within a period): 1..=31536000. Default: the packaged
    /// `admission.user_key_period_s` (3600).
    pub user_key_period_s: u64,
}

impl Default for ClientOptions {
    fn default() -> Self {
        let env_path = |var: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        ClientOptions {
            heartbeat_path: env_path(HEARTBEAT_ENV)
                .unwrap_or_else(|| PathBuf::from(lbagent_host::heartbeat::DEFAULT_PATH)),
            cache: false,
            max_heartbeat_age: Duration::from_millis(lbagent_host::heartbeat::DEFAULT_MAX_AGE_MS),
            business_priority: 0,
            user_priority: 0,
            snapshot_path: env_path(SNAPSHOT_ENV)
                .unwrap_or_else(|| PathBuf::from(lbagent_host::snapshot::DEFAULT_PATH)),
            static_fallback: true,
            holdback: Duration::from_millis(holdback::DEFAULT_HOLDBACK_MS),
            shm: true,
            local_socket: true,
            user_hash_seed: lbagent_admission::priority::DEFAULT_USER_HASH_SEED,
            user_key_period_s: lbagent_admission::priority::DEFAULT_USER_KEY_PERIOD_S,
        }
    }
}

impl ClientOptions {
    /// Checks every field.
    ///
    /// # Errors
    /// [`ClientError::BadRequest`] naming the field: an empty path, a
    /// heartbeat age under 1 ms, a priority above
    /// [`lbagent_wire::MAX_PRIORITY`], a `user_key_period_s` outside
    /// 1..=[`MAX_USER_KEY_PERIOD_S`].
    pub fn validate(&self) -> Result<(), ClientError> {
        let bad = |what: String| Err(ClientError::BadRequest(what));
        if self.heartbeat_path.as_os_str().is_empty() {
            return bad("heartbeat_path is empty: name the agent's heartbeat file".into());
        }
        if self.snapshot_path.as_os_str().is_empty() {
            return bad("snapshot_path is empty: name the agent's static route file".into());
        }
        if self.max_heartbeat_age < Duration::from_millis(1) {
            return bad(format!(
                "max_heartbeat_age {:?} is under 1 ms: the agent beats every second, use 2 s",
                self.max_heartbeat_age
            ));
        }
        if self.holdback > MAX_HOLDBACK {
            return bad(format!(
                "holdback {:?} is over {MAX_HOLDBACK:?}: a level is worth trusting for a few \
                 admission windows (100 ms); zero turns holding back off",
                self.holdback
            ));
        }
        if !(1..=MAX_USER_KEY_PERIOD_S).contains(&self.user_key_period_s) {
            return bad(format!(
                "user_key_period_s {} is out of range: 1..={MAX_USER_KEY_PERIOD_S} seconds, \
                 the same as the services' admission.user_key_period_s (default 3600)",
                self.user_key_period_s
            ));
        }
        for (name, p) in [
            ("business_priority", self.business_priority),
            ("user_priority", self.user_priority),
        ] {
            if p > lbagent_wire::MAX_PRIORITY {
                return bad(format!(
                    "{name} {p} is out of range: 0 (unset) or 1..={}",
                    lbagent_wire::MAX_PRIORITY
                ));
            }
        }
        Ok(())
    }
}

/// A node to call, and where the answer came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Host {
    /// The node.
    pub addr: NodeAddr,
    /// Who chose it.
    pub source: HostSource,
}

/// Who chose a [`Host`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostSource {
    /// The agent, for this getHost.
    Agent,
    /// The route cache, from a route the agent gave at most 2 s ago.
    Cache,
    /// The static route file: the agent is down.
    StaticRoutes,
}

impl HostSource {
    /// A stable short name: `agent`, `cache` or `static_routes`.
    pub fn as_str(self) -> &'static str {
        match self {
            HostSource::Agent => "agent",
            HostSource::Cache => "cache",
            HostSource::StaticRoutes => "static_routes",
        }
    }
}

/// The agent's view of a module (for `lbagent getroute`): its route version
/// and every node with its state and counters.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteView {
    /// The module.
    pub module: ModuleId,
    /// The route's version, as the route server numbered it.
    pub version: u64,
    /// The module's policy.
    pub policy: lbagent_model::Policy,
    /// Every node, in the agent's order, with its LB state and counters.
    pub nodes: Vec<NodeStatus>,
}
