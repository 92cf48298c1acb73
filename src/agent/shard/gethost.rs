//! getHost: the shard's own level first (shed), then the owner check, the
//! module's bounds, and the LB pick; the decision as values
//! handed to a [`HostSink`]: encoded for UDP, or written as they are into
//! a shared-memory slot's answer record.

use super::callers::client_key;
use super::modules::touched;
use super::ShardCore;
use crate::metrics::{priority_class, Kind};
use lbagent_admission::{AdmissionLevel, OPEN};
use lbagent_lb::{Millis, Pick, ANY_CLIENT, NO_HINT};
use lbagent_model::{ModuleId, NodeAddr, Selector};
use lbagent_shm::fixed::{self, HostAnswer};
use lbagent_wire::{self as wire, RetCode};
use std::net::SocketAddr;

/// What a getHost asks beyond the original's: a key's hash (consistent
/// hashing) and a label selector (empty: none). A plain getHost has none
/// (`None` where it is passed): it is decided without looking at either.
#[derive(Clone, Copy, Debug)]
pub(super) struct Steer<'s> {
    /// Its key's hash, when it is keyed.
    pub key: Option<u64>,
    /// Its labels (empty: none).
    pub selector: &'s Selector,
}

impl ShardCore {
    /// A getHost; `steer`: its key's hash and selector, None for a plain
    /// one; `shed`: the shard's own level applies; `bucket`: its
    /// queuing-time bucket and queuing time (µs), when the kernel stamped
    /// it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn get_host(
        &mut self,
        g: wire::GetHost,
        steer: Option<&Steer<'_>>,
        peer: SocketAddr,
        now: Millis,
        shed: bool,
        bucket: Option<(usize, u64)>,
    ) -> Option<&[u8]> {
        let mut values = Values(None);
        match self.decide_get_host_keyed(g, steer, peer, now, shed, bucket, &mut values) {
            Decided::Answered => {
                let a = values.0.expect("an answered getHost gave its values");
                if let (RetCode::Ok, Some(host)) = (a.retcode, a.host) {
                    // One answer encoded per level, its sequence, module
                    // and node patched in.
                    if self.answered.as_ref().is_none_or(|t| t.level() != a.level) {
                        self.answered = Some(wire::OkAnswer::new(&mut self.enc, a.level));
                    }
                    if let Some(t) = self.answered.as_mut() {
                        return Some(t.answer_or_encode(&mut self.enc, a.seq, a.module, host));
                    }
                }
                Some(
                    self.enc
                        .get_host_resp(a.seq, a.module, a.retcode, a.host, a.level),
                )
            }
            Decided::Shed(level) => {
                let a = values.0.expect("a shed getHost gave its values");
                // One answer encoded per level, its sequence and module
                // patched in.
                if self.rejected.as_ref().is_none_or(|r| r.level() != level) {
                    self.rejected = Some(wire::RejectedAnswer::new(&mut self.enc, level));
                }
                if let Some(r) = self
                    .rejected
                    .as_mut()
                    .and_then(|r| r.answer(a.seq, a.module))
                {
                    return Some(r);
                }
                Some(
                    self.enc
                        .get_host_resp(a.seq, a.module, a.retcode, None, a.level),
                )
            }
            Decided::Encoded => Some(self.enc.finished()),
        }
    }

    /// A plain getHost's decision, its answer's values handed to `sink`
    /// (the UDP path encodes them, the fixed layout writes them as they
    /// are into the answer record: [`RecordSink`]).
    #[inline(always)]
    pub(super) fn decide_get_host<S: HostSink>(
        &mut self,
        g: wire::GetHost,
        peer: SocketAddr,
        now: Millis,
        shed: bool,
        bucket: Option<(usize, u64)>,
        sink: &mut S,
    ) -> Decided {
        self.decide_get_host_keyed(g, None, peer, now, shed, bucket, sink)
    }

    /// [`ShardCore::decide_get_host`] for a getHost that may carry a key's
    /// hash or a label selector (`steer`), in an `l5` module without
    /// downstream levels (a `balance` module, or one with levels, ignores
    /// both): a keyed one picks the key's node
    /// ([`lbagent_lb::ModuleLb::get_host_keyed`]), a selecting one among
    /// the matching nodes ([`lbagent_lb::ModuleLb::get_host_selecting`];
    /// none matching with `[lb] label_fallback = "fail"`: an ErrorResp of
    /// NoSuchModule), and, with `agent.zone` set and nodes of the module in
    /// that zone, any other prefers them
    /// ([`lbagent_lb::ModuleLb::get_host_near`]). A plain getHost of a
    /// module without zones pays one test for all of it.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn decide_get_host_keyed<S: HostSink>(
        &mut self,
        g: wire::GetHost,
        steer: Option<&Steer<'_>>,
        peer: SocketAddr,
        now: Millis,
        shed: bool,
        bucket: Option<(usize, u64)>,
        sink: &mut S,
    ) -> Decided {
        let (seq, module) = (g.seq, g.module);
        let class = priority_class(g.business_priority);
        if let Some((b, us)) = bucket {
            self.metrics.record_gethost_queuing(class, b, us);
        }
        // Shed below the shard's own level before anything else: no
        // module lookup, no LB work (a getHost for another shard's module
        // is answered WrongShard below, as without shedding).
        if shed && self.owner.of(module) == self.setup.id {
            if let Some(a) = self.shedding.as_mut() {
                if !a.admit(g.business_priority, g.user_priority) {
                    let level = a.level();
                    self.last_kind = Some(Kind::GetHost);
                    self.metrics.count_request(Kind::GetHost);
                    self.metrics.self_rejected[class] += 1;
                    self.metrics.count_error(Kind::GetHost);
                    sink.answer(seq, module, RetCode::Rejected, None, NO_HINT, Some(level));
                    return Decided::Shed(level);
                }
            }
        }
        if !self.admit(Kind::GetHost, u64::from(seq), module, now) {
            return Decided::Encoded;
        }
        // The module looked up last needs no lookup; any other is looked
        // up (or made) out of line, through the core, so that this path
        // keeps no address of the fields that needs (the compiler keeps
        // such addresses across a sweep's requests: 2 instructions each a
        // sweep, callgrind).
        let bucket = match self.modules.remembered_bucket(module) {
            Some(i) => i,
            None => match self.bucket_of(module, now) {
                Ok(i) => i,
                Err(why) => {
                    self.refuse(Kind::GetHost, u64::from(seq), module, why);
                    return Decided::Encoded;
                }
            },
        };
        let entry = self.modules.at_mut(bucket);
        let pull = touched(entry, &self.setup, now);
        let lb = &mut entry.lb;
        let setup = &self.setup;
        // The client key only where it counts: a balance module's units,
        // a module with levels (a caller's own filter); an l5 module
        // without levels answers from get_host_from's first test.
        let client = if lb.units().is_some() {
            let (metrics, balanced) = (&mut self.metrics, &mut self.balanced);
            balance_client(lb, metrics, balanced, module, peer, now)
        } else if lb.levels_held() > 0 {
            client_key(peer)
        } else {
            ANY_CLIENT
        };
        let steered = client == ANY_CLIENT && (steer.is_some() || lb.local_nodes() > 0);
        let pick = if steered {
            match steered_pick(lb, setup, &mut self.metrics, steer, &g, now) {
                Ok(p) => p,
                Err(no_match) => {
                    self.no_match(seq, module, &no_match);
                    return Decided::Encoded;
                }
            }
        } else {
            lb.get_host_from(
                &setup.params,
                client,
                g.business_priority,
                g.user_priority,
                now,
            )
        };
        // The node's index for the report's hint: the original's path
        // keeps it (a steered pick gives none).
        let hint = if steered { NO_HINT } else { lb.picked() };
        if lb.is_tuned() {
            if let Some(began) = lb.take_panic_news() {
                let idle = (lb.nodes().len() - lb.overloaded_count()) as u32;
                let nodes = lb.nodes().len() as u32;
                self.panic_news(module, began, idle, nodes);
            }
        }
        if pull {
            self.ask_pull(module);
        }
        // The rare ends through the core: the path keeps no address of
        // what they touch (the compiler keeps such addresses across a
        // sweep's requests, and a jump table for the match).
        let (retcode, host) = match pick {
            Pick::Idle(a) => (RetCode::Ok, Some(a)),
            other => self.other_pick(other, class),
        };
        if retcode != RetCode::Ok {
            self.metrics.count_error(Kind::GetHost);
        }
        if retcode != RetCode::Rejected {
            self.metrics.admitted[class] += 1;
        }
        // While the shard sheds, every answer carries its level, so that a
        // caller can shed below it before sending (collaborative admission
        // with the agent itself).
        let level = self
            .shedding
            .as_ref()
            .map(|a| a.level())
            .filter(|&l| l != OPEN);
        sink.answer(seq, module, retcode, host, hint, level);
        Decided::Answered
    }
}

impl ShardCore {
    /// A pick other than an idle node's: its answer's code and node,
    /// counted. Out of line: most getHosts name an idle node.
    #[inline(never)]
    fn other_pick(&mut self, pick: Pick, class: usize) -> (RetCode, Option<NodeAddr>) {
        match pick {
            Pick::Idle(a) => (RetCode::Ok, Some(a)),
            Pick::Rejected => {
                self.metrics.rejected += 1;
                self.metrics.downstream_rejected[class] += 1;
                (RetCode::Rejected, None)
            }
            Pick::Probe(a) => {
                self.metrics.probes += 1;
                (RetCode::Ok, Some(a))
            }
            Pick::Overloaded => (RetCode::Overloaded, None),
            Pick::ClientLimit => {
                self.metrics.units_client_limited += 1;
                (RetCode::Overloaded, None)
            }
            Pick::NoSuchModule => (RetCode::NoSuchModule, None),
            Pick::Panic(a) => {
                self.metrics.panic_answers += 1;
                (RetCode::Ok, Some(a))
            }
        }
    }

    /// A module with options began or ended a panic: the control core
    /// logs it.
    #[cold]
    #[inline(never)]
    fn panic_news(&mut self, module: ModuleId, began: bool, idle: u32, nodes: u32) {
        self.outbox.push(crate::messages::ToControl::Panic {
            module,
            began,
            idle,
            nodes,
        });
    }

    /// No node of a steered getHost's module matches its labels, with
    /// `label_fallback = "fail"`: NoSuchModule, counted.
    #[cold]
    #[inline(never)]
    fn no_match(&mut self, seq: u32, module: ModuleId, no_match: &dyn std::fmt::Display) {
        self.metrics.count_error(Kind::GetHost);
        self.enc.error_resp(
            u64::from(seq),
            module,
            RetCode::NoSuchModule,
            &no_match.to_string(),
        );
    }
}

/// Where a getHost's decision puts its answer's values (answered or shed):
/// the UDP path keeps them to encode ([`Values`]), the fixed layout
/// writes them into the answer record ([`RecordSink`]).
pub(super) trait HostSink {
    /// The answer to getHost `seq` of `module`: `hint` is the index of the
    /// node named ([`NO_HINT`]: none), `level` the admission level the
    /// answer carries.
    fn answer(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        host: Option<NodeAddr>,
        hint: u32,
        level: Option<AdmissionLevel>,
    );
}

/// The answer's values, kept (the UDP path, the tests).
pub(super) struct Values(pub Option<HostAnswer>);

impl HostSink for Values {
    #[inline(always)]
    fn answer(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        host: Option<NodeAddr>,
        _hint: u32,
        level: Option<AdmissionLevel>,
    ) {
        self.0 = Some(HostAnswer {
            seq,
            module,
            retcode,
            host,
            level,
        });
    }
}

/// The answer written in place as a record of the fixed layout
/// ([`fixed::write_answer`]), with the node hint when the getHost asked
/// for it and the decision has one; `len` is the record's length.
pub(crate) struct RecordSink<'o> {
    /// Where the record goes.
    pub out: &'o mut [u8; fixed::ANSWER_MAX],
    /// The getHost asked for the node hint.
    pub ask: bool,
    /// The record's length once written.
    pub len: usize,
}

impl HostSink for RecordSink<'_> {
    #[inline(always)]
    fn answer(
        &mut self,
        seq: u32,
        module: ModuleId,
        retcode: RetCode,
        host: Option<NodeAddr>,
        hint: u32,
        level: Option<AdmissionLevel>,
    ) {
        let hint = (self.ask && hint != NO_HINT).then_some(hint);
        self.len = fixed::write_answer(self.out, seq, module, retcode, host, level, hint);
    }
}

/// The client key of a getHost of a `balance` module (its units are
/// booked to it), after the units due back by `now` returned (counted);
/// the module is remembered as one that may hold units. Out of line: an
/// `l5` module pays one test.
#[cold]
#[inline(never)]
fn balance_client(
    lb: &mut lbagent_lb::ModuleLb,
    metrics: &mut crate::metrics::ShardMetrics,
    balanced: &mut std::collections::HashSet<lbagent_model::ModuleId>,
    module: lbagent_model::ModuleId,
    peer: SocketAddr,
    now: Millis,
) -> lbagent_lb::ClientKey {
    metrics.units_timed_out += u64::from(lb.expire_units(now));
    balanced.insert(module);
    client_key(peer)
}

/// The pick of a getHost that asks for a key's node or by labels
/// (`steer`), or of a plain one in a module with nodes in the agent's
/// zone (an `l5` module without levels: the caller checked); a selector
/// matching no node with `[lb] label_fallback = "fail"` is the error.
/// Out of line: a plain getHost of a module without zones never comes here.
#[cold]
#[inline(never)]
fn steered_pick(
    lb: &mut lbagent_lb::ModuleLb,
    setup: &super::ShardSetup,
    metrics: &mut crate::metrics::ShardMetrics,
    steer: Option<&Steer<'_>>,
    g: &wire::GetHost,
    now: Millis,
) -> Result<Pick, lbagent_lb::labels::NoMatch> {
    if let Some(hash) = steer.and_then(|s| s.key) {
        metrics.keyed_gethosts += 1;
        return Ok(lb.get_host_keyed(&setup.params, hash));
    }
    if let Some(selector) = steer.map(|s| s.selector).filter(|s| !s.is_empty()) {
        metrics.selecting_gethosts += 1;
        let fallback = setup.steering.label_fallback;
        return lb.get_host_selecting(&setup.params, selector, fallback);
    }
    if lb.local_nodes() > 0 {
        metrics.near_gethosts += 1;
        let threshold = lbagent_lb::locality::threshold(
            lb.options().locality_min_percent.map(u32::from),
            setup.steering.locality_min_percent,
        );
        return Ok(lb.get_host_near(&setup.params, threshold));
    }
    // Neither a key nor a selector after all: as a plain getHost.
    Ok(lb.get_host_from(
        &setup.params,
        ANY_CLIENT,
        g.business_priority,
        g.user_priority,
        now,
    ))
}

/// A getHost's decision (its values went to the [`HostSink`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decided {
    /// Answered: the sink has the answer.
    Answered,
    /// Rejected below the shard's own level (this one): the sink has the
    /// answer.
    Shed(AdmissionLevel),
    /// An ErrorResp is encoded in the shard's encoder.
    Encoded,
}
