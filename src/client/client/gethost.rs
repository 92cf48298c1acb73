//! getHost on [`Client`]: the route cache, the agent over shared memory or
//! UDP, and the static route file when the agent is down.

use super::*;

impl Client {
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

    /// Asks for the node of module `(modid, cmdid)` that `key` belongs to
    /// (consistent hashing: a session, a user, a cache key). The agent
    /// answers the key's node in the module's Maglev table, or, while that
    /// node is overloaded, the key's next candidate; adding or removing one
    /// node of N moves about 1/N of the keys. The key is hashed here
    /// ([`lbagent_model::key_hash`]); the route cache is not used (it does
    /// not hash), and while the agent is down the static route file answers
    /// as for [`Client::get_host`], without the key. A `balance` module,
    /// or one with downstream admission levels, ignores the key.
    ///
    /// # Errors
    /// As [`Client::get_host`].
    pub fn get_host_keyed(
        &mut self,
        modid: u32,
        cmdid: u32,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        let hash = lbagent_model::key_hash(key);
        self.get_host_steered(ModuleId::new(modid, cmdid), Some(hash), "", timeout)
    }

    /// Asks for a node of module `(modid, cmdid)` among those carrying
    /// every label of `selector` (`version=canary,tier=gold`: canary and
    /// metadata routing), chosen with the module's policy among them. The
    /// agent answers [`ClientError::Overloaded`] when every matching node is
    /// overloaded, and, when no node of the module matches, as
    /// `[lb] label_fallback` says: any node, or
    /// [`ClientError::NoSuchModule`]. The route cache is not used; while
    /// the agent is down the static route file answers without the
    /// selector.
    ///
    /// # Errors
    /// As [`Client::get_host`].
    pub fn get_host_selecting(
        &mut self,
        modid: u32,
        cmdid: u32,
        selector: &lbagent_model::Selector,
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        let text = selector.terms().to_string();
        self.get_host_steered(ModuleId::new(modid, cmdid), None, &text, timeout)
    }

    /// A getHost with a key's hash or a selector, to the agent alone.
    fn get_host_steered(
        &mut self,
        module: ModuleId,
        hash: Option<u64>,
        selector: &str,
        timeout: Duration,
    ) -> Result<Host, ClientError> {
        check_timeout(timeout)?;
        let (b, u) = (self.opts.business_priority, self.opts.user_priority);
        let now = self.clock.now_ms();
        self.clock.keep_ticking(now);
        let due = Due::after(timeout);
        if let Err(why) = self.locate_at(now) {
            return self.static_host(module, why);
        }
        let r = self.exchange(
            module,
            &due,
            None,
            |e, seq| {
                e.get_host_req_full(seq, module, b, u, hash, selector);
            },
            |a| match a {
                Answer::Host(a) => host_reply(module, &a, &mut None),
                Answer::Msg(Message::GetHostResp(r)) => {
                    host_reply(module, &HostAnswer::from_resp(&r), &mut None)
                }
                Answer::Msg(other) => other_reply(module, other, "GetHostReq"),
            },
        );
        match r {
            Ok(addr) => Ok(Host {
                addr,
                source: HostSource::Agent,
            }),
            Err(t) => self.get_host_unanswered(module, &due, t),
        }
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
    pub(super) fn get_host_checked(
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
    pub(super) fn get_host_slow(
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
        let due = Due::after(timeout);
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
        if self.opts.cache {
            return self.cached_get_host(module, prio, &due, now);
        }
        if self.holdback.hold(shard, prio.business, prio.user, now) {
            return Err(ClientError::Rejected { module });
        }
        self.agent_get_host_learning(module, prio, &due, now)
    }

    /// [`Client::agent_get_host`] remembering the level the answer carried
    /// (the uncached path: see [`lbagent_admission::holdback`]).
    pub(super) fn agent_get_host_learning(
        &mut self,
        module: ModuleId,
        prio: Priority,
        due: &Due,
        now: u64,
    ) -> Result<Host, ClientError> {
        let mut level = None;
        let r = self.agent_get_host_seeing(module, prio, due, &mut level);
        if let Some(level) = level {
            // The shard that answered (a follow may have changed the count).
            let shard = module.shard(self.locator.endpoints().map_or(1, |e| e.shards));
            self.holdback.observe(shard, level, now);
        }
        r
    }

    pub(super) fn agent_get_host(
        &mut self,
        module: ModuleId,
        prio: Priority,
        due: &Due,
    ) -> Result<Host, ClientError> {
        self.agent_get_host_seeing(module, prio, due, &mut None)
    }

    /// A getHost sent to the agent; `level` gets the admission level its
    /// answer carried (`Some(None)`: an answer without one).
    pub(super) fn agent_get_host_seeing(
        &mut self,
        module: ModuleId,
        prio: Priority,
        due: &Due,
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
            due,
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
            Err(t) => self.get_host_unanswered(module, due, t),
        }
    }

    /// A getHost the agent did not answer: the static route file answers
    /// if it can (and static fallback is on).
    pub(super) fn get_host_unanswered(
        &mut self,
        module: ModuleId,
        due: &Due,
        t: Trouble,
    ) -> Result<Host, ClientError> {
        match t {
            Trouble::Error(e) => Err(e),
            Trouble::Unreachable {
                timed_out: true, ..
            } => {
                let timeout = ClientError::Timeout {
                    module,
                    waited: due.elapsed(),
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
    pub(super) fn static_host(
        &mut self,
        module: ModuleId,
        why: String,
    ) -> Result<Host, ClientError> {
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

    pub(super) fn cached_get_host(
        &mut self,
        module: ModuleId,
        prio: Priority,
        due: &Due,
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
            Pick::PassThrough => return self.agent_get_host(module, prio, due),
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
                due,
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
                return self.get_host_unanswered(module, due, t);
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
            Pick::PassThrough | Pick::Refresh { .. } => self.agent_get_host(module, prio, due),
        }
    }
}
