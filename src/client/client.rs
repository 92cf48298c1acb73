//! [`Client`]: the shell that ties the heartbeat, the UDP link, the static
//! route file and the route cache together. Every decision with rules of
//! its own lives below it (`locate`, `link`, `statics`, `cache`); this file
//! says which to ask in which order, and turns answers into typed results.

use std::time::{Duration, Instant};

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
            link: Link::with_shm(opts.shm),
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

    /// Asks for a node of module `(modid, cmdid)`, waiting at most `timeout`
    /// for the agent (re-sending the request within it). While the agent is
    /// down the node comes from the static route file (see the module
    /// documentation); with the route cache on, from the cache while no node
    /// of the module is overloaded. [`Host::source`] says which.
    ///
    /// # Errors
    /// [`ClientError::NoSuchModule`], [`ClientError::Overloaded`],
    /// [`ClientError::Rejected`] as the agent answers;
    /// [`ClientError::StaticRoutes`] when the agent is down and the static
    /// route file cannot answer; [`ClientError::AgentDown`] when the agent
    /// is down and static fallback is off; [`ClientError::Timeout`];
    /// [`ClientError::BadResponse`]; [`ClientError::BadRequest`] for a
    /// timeout under 1 ms or a request the agent refused.
    #[inline(always)]
    pub fn get_host(
        &mut self,
        modid: u32,
        cmdid: u32,
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        check_timeout(timeout)?;
        // None: the options' priorities (checked when they were set), read
        // on the slow path only.
        self.get_host_checked(ModuleId::new(modid, cmdid), None, timeout)
    }

    /// [`Client::get_host`] for a call of DAGOR priorities `prio` (instead
    /// of [`ClientOptions::business_priority`] / `user_priority`): the
    /// agent answers [`ClientError::Rejected`] when the downstream level of
    /// every idle node refuses them (see [`Priority::of_user`] to hash a
    /// user id).
    ///
    /// # Errors
    /// As [`Client::get_host`]; [`ClientError::BadRequest`] for a priority
    /// above 128.
    #[inline]
    pub fn get_host_with(
        &mut self,
        modid: u32,
        cmdid: u32,
        prio: Priority,
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        check_timeout(timeout)?;
        prio.validate()?;
        self.get_host_checked(ModuleId::new(modid, cmdid), Some(prio), timeout)
    }

    /// [`Client::get_host_with`] for a call of business priority `business`
    /// (0 = unset, else 1..=128) on behalf of user `user_id`, whose user
    /// priority `U` is [`Client::user_priority`] of the id now: the keyed
    /// hash under [`ClientOptions::user_hash_seed`], its key rotating every
    /// [`ClientOptions::user_key_period_s`] (one `U` per user within a
    /// period). A numeric id is hashed as its 8 little-endian bytes
    /// (`&id.to_le_bytes()`), as the admission core does.
    ///
    /// # Errors
    /// As [`Client::get_host_with`]: [`ClientError::Rejected`] when the
    /// downstream level of every idle node refuses `(business, U)`;
    /// [`ClientError::BadRequest`] for a business priority above 128.
    #[inline]
    pub fn get_host_for_user(
        &mut self,
        modid: u32,
        cmdid: u32,
        business: u8,
        user_id: &[u8],
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        let prio = Priority::new(business, self.user_priority(user_id));
        self.get_host_with(modid, cmdid, prio, timeout)
    }

    /// The user priority `U` (1..=128) this client gives `user_id` now
    /// (wall-clock time), as [`Client::get_host_for_user`] sends it.
    pub fn user_priority(&mut self, user_id: &[u8]) -> u8 {
        let unix_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.users.priority(user_id, unix_s)
    }

    /// A getHost whose timeout and priorities are valid (None: the options'). The
    /// cached path is inlined into the caller (a few dozen instructions);
    /// everything else is [`Client::get_host_slow`].
    #[inline(always)]
    fn get_host_checked(
        &mut self,
        module: ModuleId,
        prio: Option<Priority>,
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        // The cached path: memory only. The tick is one load; the agent is
        // alive while it is within the heartbeat deadline of the last full
        // check (see `rearm`), and the module used last is the cache's
        // hot entry.
        let tick = self.clock.tick_ms();
        if tick <= self.cached_until {
            if let Some(addr) = self.cache.pick_cached(module, tick) {
                return Ok(Host {
                    addr,
                    source: HostSource::Cache,
                });
            }
        }
        self.get_host_slow(module, prio, timeout)
    }

    /// Every getHost the cached path did not answer.
    #[inline(never)]
    fn get_host_slow(
        &mut self,
        module: ModuleId,
        prio: Option<Priority>,
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        // Another module than the last one: the cached path once more,
        // after a map lookup (an application that alternates modules).
        let tick = self.clock.tick_ms();
        if tick <= self.cached_until {
            if let Some(addr) = self.cache.pick_cached_other(module, tick) {
                return Ok(Host {
                    addr,
                    source: HostSource::Cache,
                });
            }
        }
        let prio = prio
            .unwrap_or_else(|| Priority::new(self.opts.business_priority, self.opts.user_priority));
        let now = self.clock.now_ms();
        self.clock.keep_ticking(now);
        let started = Instant::now();
        let endpoints = match self.locate_at(now) {
            Ok(e) => e,
            Err(why) => return self.static_host(module, why),
        };
        let shard = module.shard(endpoints.shards);
        let suspect = self.suspect.get(shard as usize).copied().flatten();
        if self.opts.static_fallback && suspect == Some(self.beat) {
            let why = format!(
                "its shard {shard} ({}) did not answer and the heartbeat has not moved since",
                endpoints.shard_addr(shard)
            );
            return self.static_host(module, why);
        }
        let deadline = started + timeout;
        if self.opts.cache {
            return self.cached_get_host(module, prio, started, deadline, now);
        }
        if self.holdback.hold(shard, prio.business, prio.user, now) {
            return Err(ClientError::Rejected { module });
        }
        self.agent_get_host_learning(module, prio, started, deadline, now)
    }

    /// Reports the result of a call to `host` of module `(modid, cmdid)`:
    /// `retcode` 0 is success, anything else a failure that counts
    /// `tcost_ms / 100` errors (at least 1, at most 50). Fire and forget: nothing waits for
    /// the agent. With the route cache, successes may be held and batched
    /// (see [`super::cache`]). While the agent is down the report is
    /// dropped and the result is `Ok(())`, as in the original.
    ///
    /// # Errors
    /// [`ClientError::BadRequest`] when `host` has port 0 (no node has).
    #[inline(always)]
    pub fn report(
        &mut self,
        modid: u32,
        cmdid: u32,
        host: NodeAddr,
        retcode: i32,
        tcost_ms: u32,
    ) -> Result<(), ClientError> {
        self.report_with_level(modid, cmdid, host, retcode, tcost_ms, None)
    }

    /// [`Client::report`] passing on the admission level the downstream
    /// attached to its response (DAGOR collaborative admission): the agent
    /// keeps it for the node, for `admission.level_timeout_ms`, and rejects
    /// the getHosts it refuses. A report with a level is never held by the
    /// route cache (held successes go first), and the cache refreshes at
    /// the next getHost, so it learns to pass getHosts through the agent.
    ///
    /// # Errors
    /// As [`Client::report`]; [`ClientError::BadRequest`] for a level
    /// outside 1..=128.
    #[inline(always)]
    pub fn report_with_level(
        &mut self,
        modid: u32,
        cmdid: u32,
        host: NodeAddr,
        retcode: i32,
        tcost_ms: u32,
        downstream_level: Option<AdmissionLevel>,
    ) -> Result<(), ClientError> {
        self.report_consuming(modid, cmdid, host, retcode, tcost_ms, downstream_level, 0)
    }

    /// [`Client::report_with_level`], saying also that the call consumed
    /// `consumed` capacity units of the node for good (a `balance` module's
    /// stored resources; 0 = none): the route server lowers the node's
    /// weight by that much for every agent. A report that consumes goes to
    /// the agent even with the route cache on.
    ///
    /// # Errors
    /// As [`Client::report_with_level`]; [`ClientError::BadRequest`] also
    /// for `consumed` above 1000000.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn report_consuming(
        &mut self,
        modid: u32,
        cmdid: u32,
        host: NodeAddr,
        retcode: i32,
        tcost_ms: u32,
        downstream_level: Option<AdmissionLevel>,
        consumed: u32,
    ) -> Result<(), ClientError> {
        if consumed > lbagent_wire::MAX_CONSUMED {
            return Err(bad_consumed(consumed));
        }
        if let Some(l) = downstream_level {
            if !(1..=128).contains(&l.business) || !(1..=128).contains(&l.user) {
                return Err(bad_level(l));
            }
        }
        let module = ModuleId::new(modid, cmdid);
        // The cached path: a success counted, memory only, by the tick and
        // the heartbeat deadline as in getHost. A node with port 0 is in no
        // cached route: such a report goes on to `report_slow`, which
        // refuses it.
        if retcode == 0 && downstream_level.is_none() && consumed == 0 {
            let tick = self.clock.tick_ms();
            if tick <= self.cached_until && self.cache.hold(module, host, tick) {
                return Ok(());
            }
        }
        let extra = (downstream_level, consumed);
        self.report_slow(module, host, retcode, tcost_ms, extra)
    }

    /// Every report the cached path did not hold.
    #[inline(never)]
    fn report_slow(
        &mut self,
        module: ModuleId,
        host: NodeAddr,
        retcode: i32,
        tcost_ms: u32,
        (downstream_level, consumed): (Option<AdmissionLevel>, u32),
    ) -> Result<(), ClientError> {
        if host.port == 0 {
            return Err(bad_host(host));
        }
        // Another module than the last one: the cached path once more,
        // after a map lookup.
        if retcode == 0 && downstream_level.is_none() && consumed == 0 {
            let tick = self.clock.tick_ms();
            if tick <= self.cached_until && self.cache.hold_other(module, host, tick) {
                return Ok(());
            }
        }
        let now = self.clock.now_ms();
        self.clock.keep_ticking(now);
        let Ok(endpoints) = self.locate_at(now) else {
            if self.opts.cache {
                // Successes of an agent that is gone are dropped with it.
                self.cache.take_held(module, &mut self.batch);
                self.batch.clear();
            }
            return Ok(());
        };
        let shard = module.shard(endpoints.shards);
        if self.opts.cache {
            let cache = &mut self.cache;
            self.batch.clear();
            if downstream_level.is_some() || consumed > 0 {
                cache.take_held(module, &mut self.batch);
                cache.refresh_soon(module);
                self.send_batch(module, shard);
            } else {
                let now_send = cache.report(module, host, retcode, now, &mut self.batch);
                self.send_batch(module, shard);
                if !now_send {
                    return Ok(());
                }
            }
        }
        let report = Report {
            seq: 0,
            module,
            host,
            retcode,
            tcost_ms,
            downstream_level,
            consumed,
        };
        let record = fixed::Request::Report(report);
        let sent = self.link.send(shard, Some(record), |e, seq| {
            e.report_req(&Report { seq, ..report });
        });
        self.note_send(shard, sent);
        Ok(())
    }

    /// Asks the agent to pull module `(modid, cmdid)` before first use and
    /// waits (at most `timeout`) until its route is there; returns the
    /// route's version. The agent is told to give up a little before
    /// `timeout` (9/10 of it, at most 60 s) so that its answer arrives in
    /// time.
    ///
    /// # Errors
    /// [`ClientError::NoSuchModule`] when the route server does not know the
    /// module, [`ClientError::Timeout`] when the route did not arrive in
    /// time (or the agent did not answer), [`ClientError::AgentDown`],
    /// [`ClientError::BadResponse`], [`ClientError::BadRequest`] (a timeout
    /// under 1 ms).
    pub fn register(
        &mut self,
        modid: u32,
        cmdid: u32,
        timeout: Duration,
    ) -> Result<u64, ClientError> {
        let module = ModuleId::new(modid, cmdid);
        check_timeout(timeout)?;
        let started = Instant::now();
        self.locate().map_err(ClientError::AgentDown)?;
        let agent_wait =
            (timeout.as_millis() * 9 / 10).clamp(1, u128::from(MAX_REGISTER_TIMEOUT_MS));
        let agent_wait = agent_wait as u32;
        let r = self.exchange(
            module,
            started + timeout,
            None,
            |e, seq| {
                e.register_req(seq, module, agent_wait);
            },
            flat(|msg| match msg {
                Message::RegisterResp(r) => {
                    if let Some(e) = other_module(module, r.modid(), r.cmdid(), "RegisterResp") {
                        return Reply::Done(Err(e));
                    }
                    match r.retcode() {
                        RetCode::Ok => Reply::Done(Ok(r.version())),
                        RetCode::Timeout => Reply::Done(Err(ClientError::Timeout {
                            module,
                            waited: started.elapsed(),
                        })),
                        rc => retcode_reply(module, rc, ""),
                    }
                }
                other => other_reply(module, other, "RegisterReq"),
            }),
        );
        r.map_err(|t| self.not_answered(module, started, t))
    }

    /// The agent's view of module `(modid, cmdid)`: its route version and
    /// every node with its state and counters (what `lbagent getroute`
    /// prints). Waits at most `timeout`.
    ///
    /// # Errors
    /// [`ClientError::NoSuchModule`] when the agent has no route for it,
    /// [`ClientError::AgentDown`], [`ClientError::Timeout`],
    /// [`ClientError::BadResponse`], [`ClientError::BadRequest`] (a timeout
    /// under 1 ms).
    pub fn get_route(
        &mut self,
        modid: u32,
        cmdid: u32,
        timeout: Duration,
    ) -> Result<RouteView, ClientError> {
        let module = ModuleId::new(modid, cmdid);
        check_timeout(timeout)?;
        let started = Instant::now();
        self.locate().map_err(ClientError::AgentDown)?;
        let r = self.exchange_parts(
            module,
            started + timeout,
            |e, seq, part| {
                e.get_route_req_part(seq, module, part);
            },
            |msg| match msg {
                Message::GetRouteResp(r) => {
                    if let Some(e) = other_module(module, r.modid(), r.cmdid(), "GetRouteResp") {
                        return Reply::Done(Err(e));
                    }
                    match r.retcode() {
                        RetCode::Ok => {
                            let nodes: Vec<NodeStatus> = r
                                .nodes()
                                .map(|v| v.iter().map(NodeStatus::from).collect())
                                .unwrap_or_default();
                            let policy = Policy::from_code(r.policy()).unwrap_or_default();
                            Reply::Done(Ok(Part {
                                version: r.version(),
                                part: r.part(),
                                parts: r.parts().max(1),
                                body: (policy, nodes),
                            }))
                        }
                        rc => retcode_reply(module, rc, ""),
                    }
                }
                other => other_reply(module, other, "GetRouteReq"),
            },
        );
        match r {
            Ok((version, parts)) => Ok(RouteView {
                module,
                version,
                policy: parts.first().map_or(Policy::L5, |p| p.0),
                nodes: parts.into_iter().flat_map(|p| p.1).collect(),
            }),
            Err(t) => Err(self.not_answered(module, started, t)),
        }
    }

    /// Asks for every part of an answer the agent splits across datagrams
    /// (a module too large for one): part 0 says how many there are, then
    /// each further part is its own exchange, all within `deadline`. Every
    /// part must carry part 0's version and part count; when the route
    /// changes between parts the whole answer is asked again (at most
    /// [`PART_RESTARTS`] times). Returns the version and the parts' bodies
    /// in order.
    fn exchange_parts<P>(
        &mut self,
        module: ModuleId,
        deadline: Instant,
        build: impl Fn(&mut Encoder, u32, u32),
        answer: impl Fn(Message<'_>) -> Reply<Part<P>>,
    ) -> Result<(u64, Vec<P>), Trouble> {
        let mut restarts = 0;
        'whole: loop {
            let first = self.exchange(
                module,
                deadline,
                None,
                |e, seq| build(e, seq, 0),
                flat(&answer),
            )?;
            let (version, parts) = (first.version, first.parts);
            if parts > lbagent_wire::MAX_ROUTE_PARTS || first.part != 0 {
                return Err(Trouble::Error(ClientError::BadResponse(format!(
                    "the route of module {module} comes as part {} of {parts}: at most {} parts are accepted",
                    first.part,
                    lbagent_wire::MAX_ROUTE_PARTS
                ))));
            }
            let mut bodies = Vec::with_capacity(parts as usize);
            bodies.push(first.body);
            for k in 1..parts {
                let next = match self.exchange(
                    module,
                    deadline,
                    None,
                    |e, seq| build(e, seq, k),
                    flat(&answer),
                ) {
                    Ok(p) => p,
                    // The route shrank between parts: this part is gone.
                    Err(Trouble::Error(ClientError::BadRequest(_))) if restarts < PART_RESTARTS => {
                        restarts += 1;
                        continue 'whole;
                    }
                    Err(Trouble::Unreachable { why, timed_out }) => {
                        return Err(Trouble::Unreachable {
                            why: format!(
                                "{why} (after {k} of {parts} parts of the route of module {module})"
                            ),
                            timed_out,
                        })
                    }
                    Err(t) => return Err(t),
                };
                if next.version != version || next.parts != parts || next.part != k {
                    if restarts < PART_RESTARTS {
                        restarts += 1;
                        continue 'whole;
                    }
                    return Err(Trouble::Error(ClientError::BadResponse(format!(
                        "the route of module {module} kept changing while its {parts} parts were read"
                    ))));
                }
                bodies.push(next.body);
            }
            return Ok((version, bodies));
        }
    }

    /// Sends every success the route cache holds, one batch report per
    /// module (also done on drop). Without the cache, nothing to do.
    ///
    /// # Errors
    /// [`ClientError::AgentDown`] when the agent is down: what was held is
    /// dropped.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        if !self.opts.cache {
            return Ok(());
        }
        let modules = self.cache.modules_holding();
        if modules.is_empty() {
            return Ok(());
        }
        let located = self.locate();
        let mut dropped = 0u64;
        for module in modules {
            self.batch.clear();
            self.cache.take_held(module, &mut self.batch);
            match &located {
                Ok(endpoints) => {
                    let shard = module.shard(endpoints.shards);
                    self.send_batch(module, shard);
                }
                Err(_) => {
                    dropped += self.batch.iter().map(|(_, n)| u64::from(*n)).sum::<u64>();
                    self.batch.clear();
                }
            }
        }
        match located {
            Ok(_) => Ok(()),
            Err(why) => Err(ClientError::AgentDown(format!(
                "{why}; {dropped} held successful reports were dropped"
            ))),
        }
    }

    /// How many of the agent's shards this client talks to through shared
    /// memory now (a slot held); 0 when it uses UDP only.
    pub fn shm_attached(&self) -> usize {
        self.link.shm_attached()
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
        deadline: Instant,
        record: Option<fixed::Request>,
        build: impl Fn(&mut Encoder, u32),
        mut answer: impl FnMut(Answer<'_>) -> Reply<T>,
    ) -> Result<T, Trouble> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let shards = self.locator.endpoints().map_or(1, |e| e.shards);
            let shard = module.shard(shards);
            let remaining = deadline.saturating_duration_since(Instant::now());
            let (why, timed_out) = if remaining.is_zero() {
                ("no time left".to_string(), true)
            } else {
                match self
                    .link
                    .request(shard, remaining, record, &build, &mut answer)
                {
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
            if attempt == 1 && !remaining.is_zero() && self.follow() {
                continue;
            }
            self.mark_suspect(shard);
            return Err(Trouble::Unreachable { why, timed_out });
        }
    }

    /// The error for a call that has no static answer.
    fn not_answered(&self, module: ModuleId, started: Instant, t: Trouble) -> ClientError {
        match t {
            Trouble::Error(e) => e,
            Trouble::Unreachable {
                timed_out: true, ..
            } => ClientError::Timeout {
                module,
                waited: started.elapsed(),
            },
            Trouble::Unreachable { why, .. } => ClientError::AgentDown(why),
        }
    }

    /// [`Client::agent_get_host`] remembering the level the answer carried
    /// (the uncached path: see [`lbagent_admission::holdback`]).
    fn agent_get_host_learning(
        &mut self,
        module: ModuleId,
        prio: Priority,
        started: Instant,
        deadline: Instant,
        now: u64,
    ) -> Result<Host, ClientError> {
        let mut level = None;
        let r = self.agent_get_host_seeing(module, prio, started, deadline, &mut level);
        if let Some(level) = level {
            // The shard that answered (a follow may have changed the count).
            let shard = module.shard(self.locator.endpoints().map_or(1, |e| e.shards));
            self.holdback.observe(shard, level, now);
        }
        r
    }

    fn agent_get_host(
        &mut self,
        module: ModuleId,
        prio: Priority,
        started: Instant,
        deadline: Instant,
    ) -> Result<Host, ClientError> {
        self.agent_get_host_seeing(module, prio, started, deadline, &mut None)
    }

    /// A getHost sent to the agent; `level` gets the admission level its
    /// answer carried (`Some(None)`: an answer without one).
    fn agent_get_host_seeing(
        &mut self,
        module: ModuleId,
        prio: Priority,
        started: Instant,
        deadline: Instant,
        level: &mut Option<Option<AdmissionLevel>>,
    ) -> Result<Host, ClientError> {
        let (b, u) = (prio.business, prio.user);
        let record = fixed::Request::GetHost(lbagent_wire::GetHost {
            seq: 0,
            module,
            business_priority: b,
            user_priority: u,
        });
        let r = self.exchange(
            module,
            deadline,
            Some(record),
            |e, seq| {
                e.get_host_req(seq, module, b, u);
            },
            |a| match a {
                Answer::Host(a) => host_reply(module, &a, level),
                Answer::Msg(Message::GetHostResp(r)) => {
                    host_reply(module, &HostAnswer::from_resp(&r), level)
                }
                Answer::Msg(other) => other_reply(module, other, "GetHostReq"),
            },
        );
        match r {
            Ok(addr) => Ok(Host {
                addr,
                source: HostSource::Agent,
            }),
            Err(t) => self.get_host_unanswered(module, started, t),
        }
    }

    /// A getHost the agent did not answer: the static route file answers
    /// if it can (and static fallback is on).
    fn get_host_unanswered(
        &mut self,
        module: ModuleId,
        started: Instant,
        t: Trouble,
    ) -> Result<Host, ClientError> {
        match t {
            Trouble::Error(e) => Err(e),
            Trouble::Unreachable {
                timed_out: true, ..
            } => {
                let timeout = ClientError::Timeout {
                    module,
                    waited: started.elapsed(),
                };
                if !self.opts.static_fallback {
                    return Err(timeout);
                }
                self.static_host(module, String::new()).map_err(|_| timeout)
            }
            Trouble::Unreachable { why, .. } => self.static_host(module, why),
        }
    }

    /// A random node of `module` from the static route file, the agent being
    /// down for `why`.
    fn static_host(&mut self, module: ModuleId, why: String) -> Result<Host, ClientError> {
        if !self.opts.static_fallback {
            return Err(ClientError::AgentDown(why));
        }
        let path = self.locator.snapshot_path();
        match self.statics.random_node(path, module, fastrand::u64(..)) {
            Ok(Some(addr)) => Ok(Host {
                addr,
                source: HostSource::StaticRoutes,
            }),
            Ok(None) => Err(ClientError::StaticRoutes(format!(
                "{why}; the static route file {} has no node of module {module}",
                path.display()
            ))),
            Err(e) => Err(ClientError::StaticRoutes(format!("{why}; {e}"))),
        }
    }

    // === the route cache ===

    fn cached_get_host(
        &mut self,
        module: ModuleId,
        prio: Priority,
        started: Instant,
        deadline: Instant,
        now: u64,
    ) -> Result<Host, ClientError> {
        let cache = &mut self.cache;
        let known_version = match cache.pick(module, now) {
            Pick::Host(addr) => {
                return Ok(Host {
                    addr,
                    source: HostSource::Cache,
                })
            }
            Pick::PassThrough => return self.agent_get_host(module, prio, started, deadline),
            Pick::Refresh { known_version } => known_version,
        };
        // Held successes go out before the refresh: the agent's view is
        // then complete when it answers.
        self.batch.clear();
        self.cache.take_held(module, &mut self.batch);
        let shard = module.shard(self.locator.endpoints().map_or(1, |e| e.shards));
        self.send_batch(module, shard);

        let r = self
            .exchange_parts(
                module,
                deadline,
                |e, seq, part| {
                    e.cache_get_route_req_part(seq, module, known_version, part);
                },
                |msg| match msg {
                    Message::CacheGetRouteResp(r) => cache_route_reply(module, r),
                    other => other_reply(module, other, "CacheGetRouteReq"),
                },
            )
            .map(|(version, parts)| {
                // Every part says unchanged / overloaded alike, but for a
                // node turning overloaded between parts: any says so.
                let unchanged = parts.iter().all(|p| p.1);
                let any_overloaded = parts.iter().any(|p| p.2);
                let nodes: Vec<RouteNode> = parts.into_iter().flat_map(|p| p.3).collect();
                (version, unchanged, any_overloaded, nodes)
            });
        let cache = &mut self.cache;
        let (version, unchanged, any_overloaded, nodes) = match r {
            Ok(answer) => answer,
            Err(t) => {
                if matches!(t, Trouble::Error(_)) {
                    cache.forget(module);
                } else if let Some(addr) = cache.pick_unrefreshed(module) {
                    // Unanswered: the cached route keeps answering, as the
                    // original's cache does; static routes only without one.
                    return Ok(Host {
                        addr,
                        source: HostSource::Cache,
                    });
                }
                return self.get_host_unanswered(module, started, t);
            }
        };
        let refreshed = Refreshed {
            version,
            unchanged,
            any_overloaded,
            nodes: &nodes,
        };
        if !cache.refreshed(module, &refreshed, now, fastrand::usize(..)) {
            cache.forget(module);
            return Err(ClientError::BadResponse(format!(
                "CacheGetRouteResp for module {module} says {} at version {version}, \
                 which does not fit the route held",
                if unchanged {
                    "unchanged"
                } else {
                    "a route without nodes"
                }
            )));
        }
        match cache.pick(module, now) {
            Pick::Host(addr) => Ok(Host {
                addr,
                source: HostSource::Cache,
            }),
            Pick::PassThrough | Pick::Refresh { .. } => {
                self.agent_get_host(module, prio, started, deadline)
            }
        }
    }

    /// Sends the successes in `self.batch` as one batch report to `shard`.
    fn send_batch(&mut self, module: ModuleId, shard: u32) {
        if self.batch.is_empty() {
            return;
        }
        let Client { link, batch, .. } = self;
        let sent = link.send(shard, None, |e, seq| {
            e.batch_report_req(seq, module, batch);
        });
        self.batch.clear();
        self.note_send(shard, sent);
    }

    /// A datagram that could not be sent is dropped; a refused one marks
    /// the shard as not answering.
    fn note_send(&mut self, shard: u32, sent: Result<(), Failure>) {
        if let Err(Failure::Refused) = sent {
            self.mark_suspect(shard);
        }
    }

    /// `shard` did not answer at the current beat.
    fn mark_suspect(&mut self, shard: u32) {
        if let Some(s) = self.suspect.get_mut(shard as usize) {
            *s = Some(self.beat);
            self.rearm();
        }
    }
}

impl Drop for Client {
    /// Flushes what the route cache holds (best effort).
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// A cache route answer as `(version, unchanged, any_overloaded, nodes)`.
type CacheAnswer = (u64, bool, bool, Vec<RouteNode>);

/// One part of an answer split across datagrams.
struct Part<P> {
    version: u64,
    part: u32,
    parts: u32,
    body: P,
}

/// How often a split answer is asked again from part 0 because the route
/// changed between its parts.
const PART_RESTARTS: u32 = 3;

fn cache_route_reply(module: ModuleId, r: fb::CacheGetRouteResp<'_>) -> Reply<Part<CacheAnswer>> {
    if let Some(e) = other_module(module, r.modid(), r.cmdid(), "CacheGetRouteResp") {
        return Reply::Done(Err(e));
    }
    if r.retcode() != RetCode::Ok {
        return retcode_reply(module, r.retcode(), "");
    }
    let nodes: Vec<RouteNode> = r
        .nodes()
        .map(|v| v.iter().map(RouteNode::from).collect())
        .unwrap_or_default();
    if let Some(n) = nodes.iter().find(|n| n.addr.port == 0) {
        return Reply::Done(Err(ClientError::BadResponse(format!(
            "CacheGetRouteResp for module {module} names node {} with port 0",
            n.addr
        ))));
    }
    Reply::Done(Ok(Part {
        version: r.version(),
        part: r.part(),
        parts: r.parts().max(1),
        body: (r.version(), r.unchanged(), r.any_overloaded(), nodes),
    }))
}

/// What a getHost's answer means, whichever layout carried it; `level`
/// gets the admission level it carries.
fn host_reply(
    module: ModuleId,
    a: &HostAnswer,
    level: &mut Option<Option<AdmissionLevel>>,
) -> Reply<NodeAddr> {
    if let Some(e) = other_module(module, a.module.modid, a.module.cmdid, "GetHostResp") {
        return Reply::Done(Err(e));
    }
    *level = Some(a.level);
    match (a.retcode, a.host) {
        (RetCode::Ok, Some(h)) if h.port != 0 => Reply::Done(Ok(h)),
        (RetCode::Ok, h) => Reply::Done(Err(ClientError::BadResponse(format!(
            "GetHostResp for module {module} says Ok but names {}",
            h.map_or("no host".to_string(), |h| h.to_string())
        )))),
        (rc, _) => retcode_reply(module, rc, ""),
    }
}

/// An answer reader for the requests whose answers are FlatBuffers only:
/// a getHost answer record to one of them is a bad response.
fn flat<T>(mut f: impl FnMut(Message<'_>) -> Reply<T>) -> impl FnMut(Answer<'_>) -> Reply<T> {
    move |a| match a {
        Answer::Msg(m) => f(m),
        Answer::Host(_) => Reply::Done(Err(ClientError::BadResponse(
            "a getHost answer record where another answer was expected".into(),
        ))),
    }
}

/// The error for an answer about another module than the one asked.
fn other_module(module: ModuleId, modid: u32, cmdid: u32, what: &str) -> Option<ClientError> {
    let got = ModuleId::new(modid, cmdid);
    (got != module).then(|| {
        ClientError::BadResponse(format!(
            "{what} is about module {got}, the request was about {module}"
        ))
    })
}

/// What an ErrorResp, or an answer of the wrong kind, means.
fn other_reply<T>(module: ModuleId, msg: Message<'_>, request: &str) -> Reply<T> {
    match msg {
        Message::ErrorResp(r) => {
            if let Some(e) = other_module(module, r.modid(), r.cmdid(), "ErrorResp") {
                return Reply::Done(Err(e));
            }
            retcode_reply(module, r.retcode(), r.message().unwrap_or(""))
        }
        other => Reply::Done(Err(ClientError::BadResponse(format!(
            "a {} answering a {request}",
            other.name()
        )))),
    }
}

/// What a non-Ok retcode means; `message` is the agent's, if any.
fn retcode_reply<T>(module: ModuleId, rc: RetCode, message: &str) -> Reply<T> {
    let e = match rc {
        RetCode::NoSuchModule => ClientError::NoSuchModule { module },
        RetCode::Overloaded => ClientError::Overloaded { module },
        RetCode::Rejected => ClientError::Rejected { module },
        RetCode::WrongShard => return Reply::WrongShard(message.to_string()),
        RetCode::BadRequest => ClientError::BadRequest(format!(
            "the agent refused the request for module {module}: {}",
            if message.is_empty() {
                "no reason given"
            } else {
                message
            }
        )),
        RetCode::Unavailable => ClientError::AgentDown(format!(
            "the agent cannot serve now (shutting down?): {message}"
        )),
        other => ClientError::BadResponse(format!(
            "retcode {} ({}) where it makes no sense, for module {module}",
            other.0,
            other.variant_name().unwrap_or("unknown")
        )),
    };
    Reply::Done(Err(e))
}

/// A timeout under 1 ms cannot be waited for.
#[inline(always)]
fn check_timeout(timeout: Duration) -> Result<(), ClientError> {
    // As one word (0: under 1 ms): fewer instructions than the two tests.
    if (timeout.as_secs() | u64::from(timeout.subsec_nanos() >= 1_000_000)) == 0 {
        return Err(bad_timeout(timeout));
    }
    Ok(())
}

// The errors of the inlined paths, out of line.

#[cold]
#[inline(never)]
fn bad_consumed(consumed: u32) -> ClientError {
    ClientError::BadRequest(format!(
        "consumed {consumed} units is out of range: at most {}",
        lbagent_wire::MAX_CONSUMED
    ))
}

#[cold]
#[inline(never)]
fn bad_timeout(timeout: Duration) -> ClientError {
    ClientError::BadRequest(format!(
        "timeout {timeout:?} is under 1 ms: give the agent time to answer (e.g. 100 ms)"
    ))
}

#[cold]
#[inline(never)]
fn bad_level(l: AdmissionLevel) -> ClientError {
    ClientError::BadRequest(format!(
        "downstream level ({}, {}) is out of range: each part is 1..=128",
        l.business, l.user
    ))
}

#[cold]
#[inline(never)]
fn bad_host(host: NodeAddr) -> ClientError {
    ClientError::BadRequest(format!(
        "cannot report a call to {host}: port 0 names no node (report the host getHost returned)"
    ))
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
