//! report on [`Client`]: single reports, reports with a level or consumed
//! units, and the cache's held successes sent in batches.

use super::*;

/// How long a report that consumes waits for the agent's answer.
pub const CONSUME_WAIT: Duration = Duration::from_millis(1000);

impl Client {
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
    /// the agent even with the route cache on, and, as it changes every
    /// agent's view, waits (at most [`CONSUME_WAIT`]) for the agent to say
    /// it took it: the agent takes it only from a user it trusts, over its
    /// local socket or shared memory (`agent.trusted_uids`), not over UDP.
    ///
    /// # Errors
    /// As [`Client::report_with_level`]; [`ClientError::BadRequest`] also
    /// for `consumed` above 1000000, and when the agent refused the
    /// consumption (the caller is not trusted with it: the message says
    /// why); [`ClientError::Timeout`] when the agent did not answer in
    /// [`CONSUME_WAIT`].
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
    pub(super) fn report_slow(
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
        if consumed > 0 {
            return self.report_acked(module, report);
        }
        let record = fixed::Request::Report(report);
        let sent = self.link.send(shard, Some(record), |e, seq| {
            e.report_req(&Report { seq, ..report });
        });
        self.note_send(shard, sent);
        Ok(())
    }

    /// A report that consumes: sent and answered (see
    /// [`Client::report_consuming`]).
    #[cold]
    fn report_acked(&mut self, module: ModuleId, report: Report) -> Result<(), ClientError> {
        let due = Due::after(CONSUME_WAIT);
        let got = self.exchange(
            module,
            &due,
            None,
            |e, seq| {
                e.report_req(&Report { seq, ..report });
            },
            |a| match a {
                Answer::Msg(Message::ErrorResp(r)) if r.retcode() == RetCode::Ok => {
                    Reply::Done(Ok(()))
                }
                Answer::Msg(Message::ErrorResp(r)) if r.retcode() == RetCode::Forbidden => {
                    Reply::Done(Err(ClientError::BadRequest(format!(
                        "the agent refused the consumption for module {module}: {}",
                        r.message().unwrap_or("no reason given")
                    ))))
                }
                Answer::Msg(msg) => other_reply(module, msg, "report"),
                Answer::Host(_) => Reply::Done(Err(ClientError::BadResponse(
                    "a getHost answer to a report".into(),
                ))),
            },
        );
        got.map_err(|t| self.not_answered(module, &due, t))
    }

    /// Sends the successes in `self.batch` as one batch report to `shard`.
    pub(super) fn send_batch(&mut self, module: ModuleId, shard: u32) {
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
    pub(super) fn note_send(&mut self, shard: u32, sent: Result<(), Failure>) {
        if let Err(Failure::Refused) = sent {
            self.mark_suspect(shard);
        }
    }

    /// `shard` did not answer at the current beat.
    pub(super) fn mark_suspect(&mut self, shard: u32) {
        if let Some(s) = self.suspect.get_mut(shard as usize) {
            *s = Some(self.beat);
            self.rearm();
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
}
