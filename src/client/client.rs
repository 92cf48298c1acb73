//! [`Client`]: the shell that ties the heartbeat, the UDP link, the static
//! route file and the route cache together. Every decision with rules of
//! its own lives below it (`locate`, `link`, `statics`, `cache`); this file
//! says which to ask in which order, and turns answers into typed results.
//!
//! Each request kind has its file: `gethost`, `report`, `route` (register
//! and getRoute); `replies` says what each answer means. This file holds
//! the handle, its options, and finding and asking the agent.

use std::time::Duration;

use super::cache::{Pick, Refreshed, RouteCache};
use super::clock::Clock;
use super::link::{Answer, Failure, Link};
use super::locate::{Endpoints, Liveness, Locator};
use super::statics::StaticRoutes;
use super::{ClientError, ClientOptions, Host, HostSource, Priority, RouteView};
use lbagent_admission::holdback::HoldBack;
use lbagent_admission::UserPriorities;
use lbagent_host::heartbeat::AgentInfo;
use lbagent_model::{ModuleId, NodeAddr, Policy, RouteNode};
use lbagent_shm::attach::Due;
use lbagent_shm::fixed::{self, HostAnswer};
use lbagent_wire::{
    fb, AdmissionLevel, Encoder, Message, NodeStatus, Report, RetCode, MAX_REGISTER_TIMEOUT_MS,
};

/// One application thread's handle on the local agent. `Send`, not meant
/// to be shared: give each thread its own (they are cheap: a few sockets and
/// a 64 KiB buffer).
pub struct Client {
    opts: ClientOptions,
    locator: Locator,
    link: Link,
    statics: StaticRoutes,
    /// The route cache; empty (and never filled) when
    /// [`ClientOptions::cache`] is off.
    cache: RouteCache,
    /// Per shard: the beat at which the shard last failed to answer. Until
    /// the beat moves, getHost for that shard answers from the static
    /// route file instead of waiting again.
    suspect: Vec<Option<u64>>,
    /// The locator generation `suspect` belongs to.
    suspect_generation: u64,
    /// The beat seen by the last successful [`Client::locate`].
    beat: u64,
    /// Held successes on their way out (scratch).
    batch: Vec<(NodeAddr, u32)>,
    /// Coarse monotonic milliseconds: the cached path reads the tick.
    clock: Clock,
    /// The cached path's heartbeat deadline: the tick until which the beat
    /// seen by the last full check is young enough, while no shard is
    /// marked at that beat; 0 (nothing cached is served) otherwise. Set by
    /// [`Client::rearm`].
    cached_until: u64,
    /// Per shard, the agent's own admission level (uncached getHost).
    holdback: HoldBack,
    /// User ids to `U` ([`Client::get_host_for_user`]), under the options'
    /// seed and key period.
    users: UserPriorities,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("opts", &self.opts)
            .field("locator", &self.locator)
            .field("link", &self.link)
            .finish_non_exhaustive()
    }
}

/// What an answer closure makes of the agent's answer.
enum Reply<T> {
    /// The call's result.
    Done(Result<T, ClientError>),
    /// The agent says another shard owns the module: its shard count is not
    /// the heartbeat's. Carries the agent's message.
    WrongShard(String),
}

/// Why an exchange with the agent produced no answer.
enum Trouble {
    /// The agent answered, with an error (or garbage).
    Error(ClientError),
    /// The agent did not answer: its port refused the datagram, or nothing
    /// came back within the timeout (`timed_out`).
    Unreachable { why: String, timed_out: bool },
}

mod gethost;
mod replies;
mod report;
pub use report::CONSUME_WAIT;
mod route;

use replies::*;

impl Client {
    /// A client with the default options ([`ClientOptions::default`]).
    ///
    /// # Errors
    /// As [`Client::with_options`].
    pub fn new() -> Result<Client, ClientError> {
        Self::with_options(ClientOptions::default())
    }

    /// A client with `opts`. Nothing is opened yet: a missing heartbeat file
    /// is not an error here (the agent may start later).
    ///
    /// # Errors
    /// [`ClientError::BadRequest`] when an option is invalid
    /// ([`ClientOptions::validate`]).
    pub fn with_options(opts: ClientOptions) -> Result<Client, ClientError> {
        // Only the cached path reads the tick.
        let clock = if opts.cache {
            Clock::ticking()
        } else {
            Clock::real()
        };
        Self::with_clock(opts, clock)
    }

    /// [`Client::with_options`] on `clock` (tests drive time).
    pub(crate) fn with_clock(opts: ClientOptions, clock: Clock) -> Result<Client, ClientError> {
        opts.validate()?;
        let max_age_ms = u64::try_from(opts.max_heartbeat_age.as_millis()).unwrap_or(u64::MAX);
        Ok(Client {
            locator: Locator::new(
                opts.heartbeat_path.clone(),
                max_age_ms,
                opts.snapshot_path.clone(),
            ),
            link: Link::with_transports(
                opts.shm,
                opts.local_socket.then(|| opts.heartbeat_path.clone()),
            ),
            statics: StaticRoutes::default(),
            cache: RouteCache::new(),
            suspect: Vec::new(),
            suspect_generation: 0,
            beat: 0,
            batch: Vec::new(),
            clock,
            cached_until: 0,
            holdback: HoldBack::new(u64::try_from(opts.holdback.as_millis()).unwrap_or(u64::MAX)),
            users: UserPriorities::new(opts.user_hash_seed, opts.user_key_period_s),
            opts,
        })
    }

    /// The options this client runs with.
    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// How many getHosts this client refused itself, without a datagram,
    /// because the agent shard's fresh admission level did not admit them
    /// (see [`lbagent_admission::holdback`]).
    pub fn held_back(&self) -> u64 {
        self.holdback.held()
    }

    /// Sets the DAGOR priorities sent with the following getHost requests
    /// ([`ClientOptions::business_priority`] and
    /// [`ClientOptions::user_priority`]: 0 = unset, else 1..=128), for a
    /// caller whose priorities change from call to call (the C ABI and the
    /// Python package pass them per call).
    ///
    /// # Errors
    /// [`ClientError::BadRequest`] naming the priority out of range; the
    /// previous priorities stay.
    pub fn set_priorities(&mut self, business: u8, user: u8) -> Result<(), ClientError> {
        for (name, p) in [("business_priority", business), ("user_priority", user)] {
            if p > lbagent_wire::MAX_PRIORITY {
                return Err(ClientError::BadRequest(format!(
                    "{name} {p} is out of range: 0 (unset) or 1..={}",
                    lbagent_wire::MAX_PRIORITY
                )));
            }
        }
        self.opts.business_priority = business;
        self.opts.user_priority = user;
        Ok(())
    }

    /// How many of the agent's shards this client talks to through shared
    /// memory now (a slot held); 0 when it uses UDP only.
    pub fn shm_attached(&self) -> usize {
        self.link.shm_attached()
    }

    /// How many of the agent's shards this client has an open local-socket
    /// connection to ([`ClientOptions::local_socket`]); 0 when it uses UDP
    /// (or shared memory) only.
    pub fn local_connected(&self) -> usize {
        self.link.local_connected()
    }

    /// The agent as its heartbeat describes it, when it is alive.
    ///
    /// # Errors
    /// [`ClientError::AgentDown`] with the reason it is not.
    pub fn agent(&mut self) -> Result<AgentInfo, ClientError> {
        self.locate().map_err(ClientError::AgentDown)?;
        self.locator
            .info()
            .cloned()
            .ok_or_else(|| ClientError::AgentDown("no heartbeat header read".into()))
    }

    // === the agent ===

    /// Checks the heartbeat; when the agent is alive, points the link at it
    /// and returns its endpoints, else the reason it is down.
    fn locate(&mut self) -> Result<Endpoints, String> {
        let now = self.clock.now_ms();
        self.locate_at(now)
    }

    /// [`Client::locate`] at `now` (the client's monotonic clock): without
    /// looking at Unix time when the heartbeat did not change.
    fn locate_at(&mut self, now: u64) -> Result<Endpoints, String> {
        let r = self.locate_at_unarmed(now);
        self.rearm();
        r
    }

    fn locate_at_unarmed(&mut self, now: u64) -> Result<Endpoints, String> {
        if self.locator.fresh(now) {
            if let Some(e) = self.locator.endpoints() {
                return Ok(e);
            }
        }
        match self.locator.check(self.clock.unix_ms(), now) {
            Liveness::Alive { beat } => {
                let endpoints = self
                    .locator
                    .endpoints()
                    .ok_or_else(|| "the heartbeat header names no endpoints".to_string())?;
                self.beat = beat;
                self.follow_endpoints(endpoints);
                Ok(endpoints)
            }
            Liveness::Down(why) => Err(why),
        }
    }

    /// Sets the cached path's heartbeat deadline ([`Client::cached_until`])
    /// after anything that may have changed it: the locator's last full
    /// check ([`Locator::alive_until`]: 0 unless it found the agent alive),
    /// a shard marked at the current beat (then 0: getHosts go through the
    /// slow path, which answers from the static route file until the beat
    /// moves), a re-read header. The cached path does not look at the
    /// heartbeat file: a new beat is seen at the first slow call after
    /// this deadline (a stale route's refresh, or the deadline itself),
    /// which arms it again.
    fn rearm(&mut self) {
        // The scan (at most 1,024 shards) runs on the slow path only.
        self.cached_until = if !self.opts.cache || self.suspect.contains(&Some(self.beat)) {
            0
        } else {
            // Below STOPPED: a stopped tick is never within it.
            self.locator.alive_until().min(super::clock::STOPPED - 1)
        };
    }

    fn follow_endpoints(&mut self, endpoints: Endpoints) {
        let generation = self.locator.generation();
        self.link.sync(endpoints, generation);
        self.link.sync_shm(self.locator.shm());
        if self.suspect_generation != generation || self.suspect.len() != endpoints.shards as usize
        {
            self.suspect_generation = generation;
            self.holdback.clear();
            self.suspect.clear();
            self.suspect.resize(endpoints.shards as usize, None);
        }
    }

    /// Re-reads the heartbeat after a failed exchange; true when the agent
    /// moved (other ports or shard count) and the link now points there.
    fn follow(&mut self) -> bool {
        let moved = self.locator.reread();
        self.rearm();
        if !moved {
            return false;
        }
        match self.locator.endpoints() {
            Some(e) => {
                self.follow_endpoints(e);
                true
            }
            None => false,
        }
    }

    /// One request to the shard that owns `module`, answered through
    /// `answer`; follows the agent once if it moved.
    fn exchange<T>(
        &mut self,
        module: ModuleId,
        due: &Due,
        record: Option<fixed::Request>,
        build: impl Fn(&mut Encoder, u32),
        mut answer: impl FnMut(Answer<'_>) -> Reply<T>,
    ) -> Result<T, Trouble> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let shards = self.locator.endpoints().map_or(1, |e| e.shards);
            let shard = module.shard(shards);
            // The first attempt reads no clock (the call's start is read
            // when a wait needs it); a second one, after a follow, checks
            // what is left.
            let (why, timed_out) = if attempt > 1 && due.remaining().is_zero() {
                ("no time left".to_string(), true)
            } else {
                match self.link.request(shard, due, record, &build, &mut answer) {
                    Ok(Reply::Done(r)) => return r.map_err(Trouble::Error),
                    Ok(Reply::WrongShard(msg)) => {
                        if attempt == 1 && self.follow() {
                            continue;
                        }
                        return Err(Trouble::Error(ClientError::BadResponse(format!(
                            "the agent says another shard owns module {module} ({msg}), \
                             but its heartbeat says {shards} shards: is the heartbeat file the agent's?"
                        ))));
                    }
                    Err(Failure::Garbage(why)) => {
                        return Err(Trouble::Error(ClientError::BadResponse(why)))
                    }
                    Err(Failure::Refused) => (
                        format!("nothing listens on its shard {shard}'s port (connection refused)"),
                        false,
                    ),
                    Err(Failure::TimedOut) => ("no answer in time".to_string(), true),
                    Err(Failure::Io(e)) => (format!("cannot talk to shard {shard}: {e}"), false),
                }
            };
            if attempt == 1 && !due.remaining().is_zero() && self.follow() {
                continue;
            }
            self.mark_suspect(shard);
            return Err(Trouble::Unreachable { why, timed_out });
        }
    }

    /// The error for a call that has no static answer.
    fn not_answered(&self, module: ModuleId, due: &Due, t: Trouble) -> ClientError {
        match t {
            Trouble::Error(e) => e,
            Trouble::Unreachable {
                timed_out: true, ..
            } => ClientError::Timeout {
                module,
                waited: due.elapsed(),
            },
            Trouble::Unreachable { why, .. } => ClientError::AgentDown(why),
        }
    }
}

impl Drop for Client {
    /// Flushes what the route cache holds (best effort).
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>() {}

    #[test]
    fn a_client_can_move_to_another_thread() {
        assert_send::<Client>();
    }

    #[test]
    fn set_priorities_checks_the_range_and_keeps_the_old_ones_on_error() {
        let mut c = Client::with_options(ClientOptions::default()).unwrap();
        c.set_priorities(3, 128).unwrap();
        assert_eq!(
            (c.options().business_priority, c.options().user_priority),
            (3, 128)
        );
        let e = c.set_priorities(1, 129).unwrap_err();
        assert!(
            matches!(&e, ClientError::BadRequest(m) if m.contains("user_priority")),
            "{e}"
        );
        assert_eq!(
            (c.options().business_priority, c.options().user_priority),
            (3, 128)
        );
    }

    #[test]
    fn the_user_hash_options_default_to_the_packaged_admission_values_and_are_checked() {
        let d = ClientOptions::default();
        assert_eq!(
            (d.user_hash_seed, d.user_key_period_s),
            (
                lbagent_admission::priority::DEFAULT_USER_HASH_SEED,
                lbagent_admission::priority::DEFAULT_USER_KEY_PERIOD_S
            )
        );
        for period in [0, super::super::MAX_USER_KEY_PERIOD_S + 1] {
            let e = Client::with_options(ClientOptions {
                user_key_period_s: period,
                ..ClientOptions::default()
            })
            .unwrap_err();
            assert!(
                matches!(&e, ClientError::BadRequest(m) if m.contains("user_key_period_s")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_client_hashes_user_ids_with_its_own_seed_and_period() {
        let unix_s = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        };
        let opts = |seed| ClientOptions {
            user_hash_seed: seed,
            user_key_period_s: 86_400,
            ..ClientOptions::default()
        };
        let mut c = Client::with_options(opts(11)).unwrap();
        let mut other = Client::with_options(opts(12)).unwrap();
        // Outside the last second of a day, both reads fall in one period.
        let t = unix_s();
        let mut keys = UserPriorities::new(11, 86_400);
        let expect: Vec<u8> = (0..64u64).map(|u| keys.priority_of_id(u, t)).collect();
        let got: Vec<u8> = (0..64u64)
            .map(|u| c.user_priority(&u.to_le_bytes()))
            .collect();
        if UserPriorities::new(11, 86_400).period_of(unix_s()) == keys.period_of(t) {
            assert_eq!(got, expect);
        }
        let differs = (0..64u64)
            .filter(|u| c.user_priority(&u.to_le_bytes()) != other.user_priority(&u.to_le_bytes()))
            .count();
        assert!(
            differs > 50,
            "only {differs} of 64 users differ between seeds"
        );
        // The business priority is checked as get_host_with checks it.
        let e = c
            .get_host_for_user(1, 1, 129, b"alice", Duration::from_millis(1))
            .unwrap_err();
        assert!(matches!(e, ClientError::BadRequest(_)), "{e}");
    }

    #[test]
    fn invalid_options_and_timeouts_are_bad_requests() {
        let bad = ClientOptions {
            business_priority: 200,
            ..ClientOptions::default()
        };
        let e = Client::with_options(bad).unwrap_err();
        assert!(
            matches!(&e, ClientError::BadRequest(m) if m.contains("business_priority")),
            "{e}"
        );
        let bad = ClientOptions {
            max_heartbeat_age: Duration::ZERO,
            ..ClientOptions::default()
        };
        assert!(Client::with_options(bad).is_err());
        let dir = tempfile::tempdir().unwrap();
        let mut c = Client::with_options(ClientOptions {
            heartbeat_path: dir.path().join("hb"),
            ..ClientOptions::default()
        })
        .unwrap();
        let e = c.get_host(1, 1, Duration::ZERO).unwrap_err();
        assert_eq!(e.kind(), "bad_request");
        let e = c
            .report(1, 1, NodeAddr { ip: 1, port: 0 }, 0, 0)
            .unwrap_err();
        assert_eq!(e.kind(), "bad_request");
    }

    #[test]
    fn retcodes_map_to_typed_errors() {
        let m = ModuleId::new(1, 2);
        let kind = |rc| match retcode_reply::<()>(m, rc, "why") {
            Reply::Done(Err(e)) => e.kind().to_string(),
            Reply::Done(Ok(())) => "ok".into(),
            Reply::WrongShard(msg) => format!("wrong_shard:{msg}"),
        };
        assert_eq!(kind(RetCode::NoSuchModule), "no_such_module");
        assert_eq!(kind(RetCode::Overloaded), "overloaded");
        assert_eq!(kind(RetCode::Rejected), "rejected");
        assert_eq!(kind(RetCode::WrongShard), "wrong_shard:why");
        assert_eq!(kind(RetCode::BadRequest), "bad_request");
        assert_eq!(kind(RetCode::Unavailable), "agent_down");
        assert_eq!(kind(RetCode::Ok), "bad_response");
        assert_eq!(kind(RetCode(99)), "bad_response");
    }
}
