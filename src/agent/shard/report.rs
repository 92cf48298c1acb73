//! report and batchReport: a call's outcome to its node's LB state (and
//! a downstream admission level, a balance module's units), counted for
//! the module's next statistics ([`super::outbox`]).

use std::net::SocketAddr;

use super::callers::client_key;
use super::outbox::stats_step;
use super::{RouteState, ShardCore};
use crate::metrics::{Kind, ShardMetrics};
use lbagent_lb::{ClientKey, Millis, ModuleLb, NodeState, Outcome, ANY_CLIENT};
use lbagent_model::NodeAddr;
use lbagent_wire::{self as wire, RetCode};

/// The answer to a report that consumes, from a caller not trusted with it.
const FORBIDDEN_CONSUME: &str =
    "a report that consumes capacity units changes every agent's view of the node: \
     it is taken only over the agent's local socket from a trusted user (agent.trusted_uids / \
     trusted_gids, root or the agent's user) or over shared memory, not over UDP \
     (agent.udp_acts_beyond); nothing was applied";

impl ShardCore {
    /// A report from `peer`. One that consumes units from a caller the
    /// shard does not trust is refused whole (ErrorResp `Forbidden`,
    /// counted); a level from such a caller filters only its own
    /// getHosts. With `ack` (a FlatBuffers request: the client library
    /// waits for it), a report that consumes and is taken is answered
    /// ErrorResp `Ok`, so that its sender learns it was. `hint`: the node
    /// hint its getHost's answer carried ([`lbagent_lb::NO_HINT`]: none), tried before
    /// the node's search ([`ModuleLb::report_call_hinted`]).
    #[inline]
    pub(super) fn report(
        &mut self,
        rep: &wire::Report,
        hint: u32,
        peer: SocketAddr,
        now: Millis,
        ack: bool,
    ) -> Option<&[u8]> {
        let (seq, module, host) = (rep.seq, rep.module, rep.host);
        let outcome = Outcome::from_retcode(rep.retcode, rep.tcost_ms);
        if !self.admit(Kind::Report, u64::from(seq), module, now) {
            return Some(self.encoded());
        }
        if rep.consumed > 0 && !self.trusts(peer) {
            return Some(self.forbidden(seq, module));
        }
        // Only the levels need to know whom to trust.
        let shared = rep.downstream_level.is_some() && self.trusts(peer);
        let p = &self.setup.params;
        let mut known = true;
        let mut levelled = false;
        let Some(entry) = self
            .modules
            .get_mut(&module)
            .filter(|e| e.route == RouteState::Present)
        else {
            return self.report_unknown_module(seq, module, rep.consumed, ack);
        };
        entry.last_used = now;
        let client = if entry.lb.units().is_some() || rep.downstream_level.is_some() {
            client_key(peer)
        } else {
            ANY_CLIENT
        };
        match entry
            .lb
            .report_call_hinted(client, host, hint, outcome, Some(rep.tcost_ms), now, p)
        {
            Ok(t) => {
                if let Some(t) = t {
                    node_moved(&mut self.metrics, t.to);
                }
                if rep.consumed > 0 || rep.downstream_level.is_some() {
                    // The node is in the route: report() just found it.
                    let metrics = &mut self.metrics;
                    let expires = now + self.setup.level_timeout_ms;
                    let beyond = Beyond {
                        host,
                        consumed: rep.consumed,
                        level: rep.downstream_level,
                    };
                    beyond_the_call(&mut entry.lb, beyond, client, shared, expires, metrics);
                    levelled = rep.downstream_level.is_some();
                }
            }
            Err(_) => {
                self.metrics.count_error(Kind::Report);
                self.metrics.unknown_node_reports += 1;
                known = false;
            }
        }
        // The rare ends through the core, after the entry's last use: the
        // path keeps no address of the fields they need.
        let step = stats_step(entry, &self.setup, now);
        self.follow_stats(module, step, now);
        if levelled {
            self.note_levelled(module);
        }
        if ack && rep.consumed > 0 {
            return Some(self.consumed_ack(seq, module, known));
        }
        None
    }

    /// The answer to a report that consumes from a caller not trusted
    /// with it, counted. Out of line, as the other rare ends.
    #[cold]
    #[inline(never)]
    fn forbidden(&mut self, seq: u32, module: lbagent_model::ModuleId) -> &[u8] {
        self.metrics.count_error(Kind::Report);
        self.metrics.forbidden += 1;
        self.enc.error_resp(
            u64::from(seq),
            module,
            RetCode::Forbidden,
            FORBIDDEN_CONSUME,
        )
    }

    /// `module` has a downstream level now (its expiry is watched).
    #[cold]
    #[inline(never)]
    fn note_levelled(&mut self, module: lbagent_model::ModuleId) {
        self.levelled.insert(module);
    }

    /// A report of a module without a route here: counted; a consuming
    /// one that waits for its answer is told nothing was consumed. Out of
    /// line, as the other rare ends of [`ShardCore::report`].
    #[cold]
    #[inline(never)]
    fn report_unknown_module(
        &mut self,
        seq: u32,
        module: lbagent_model::ModuleId,
        consumed: u32,
        ack: bool,
    ) -> Option<&[u8]> {
        self.metrics.count_error(Kind::Report);
        self.metrics.unknown_module_reports += 1;
        (ack && consumed > 0).then(|| {
            self.enc.error_resp(
                u64::from(seq),
                module,
                RetCode::NoSuchModule,
                "no route for the module here: nothing consumed",
            )
        })
    }

    /// The answer to a consuming report that waits for it: taken, or not
    /// (`known` false: the node is not in the route).
    #[cold]
    #[inline(never)]
    fn consumed_ack(&mut self, seq: u32, module: lbagent_model::ModuleId, known: bool) -> &[u8] {
        let (rc, why) = if known {
            (
                RetCode::Ok,
                "taken: the consumed units go to the reporter with the module's next statistics",
            )
        } else {
            (
                RetCode::BadRequest,
                "the node is not in the module's route here: nothing consumed",
            )
        };
        self.enc.error_resp(u64::from(seq), module, rc, why)
    }

    pub(super) fn batch_report(
        &mut self,
        b: wire::BatchReport<'_>,
        peer: SocketAddr,
        now: Millis,
    ) -> Option<&[u8]> {
        if !self.admit(Kind::BatchReport, u64::from(b.seq), b.module, now) {
            return Some(self.enc.finished());
        }
        let p = &self.setup.params;
        let Some(entry) = self
            .modules
            .get_mut(&b.module)
            .filter(|e| e.route == RouteState::Present)
        else {
            self.metrics.count_error(Kind::BatchReport);
            self.metrics.unknown_module_reports += 1;
            return None;
        };
        entry.last_used = now;
        let metrics = &mut self.metrics;
        let client = if entry.lb.units().is_some() {
            client_key(peer)
        } else {
            ANY_CLIENT
        };
        for (addr, count) in b.successes() {
            if entry
                .lb
                .report_successes_from(client, addr, count, now, p, |t| node_moved(metrics, t.to))
                .is_err()
            {
                metrics.unknown_node_reports += 1;
            }
        }
        self.maybe_stats(b.module, now);
        None
    }
}

/// What a report carries beyond its call's outcome ([`beyond_the_call`]).
#[derive(Clone, Copy)]
struct Beyond {
    /// The node.
    host: NodeAddr,
    /// Units consumed.
    consumed: u32,
    /// The node's downstream admission level.
    level: Option<wire::AdmissionLevel>,
}

/// What a report carries beyond the call's outcome, for its node (in the
/// route): consumed units, and a downstream level, shared (`shared`: a
/// caller the shard trusts) or `client`'s own until `expires`. Out of
/// line: a plain report pays one test for both. Given the fields it
/// needs, as [`ShardCore::report_unknown_module`] is: the report itself
/// (by reference or by value) would keep every report in memory (13
/// stores a report, callgrind).
#[cold]
#[inline(never)]
fn beyond_the_call(
    lb: &mut ModuleLb,
    rep: Beyond,
    client: ClientKey,
    shared: bool,
    expires: Millis,
    metrics: &mut ShardMetrics,
) {
    let host = rep.host;
    if rep.consumed > 0 && !lb.consume(host, rep.consumed).unwrap_or(false) {
        metrics.consumed_ignored += 1;
    }
    if let Some(level) = rep.level {
        if shared {
            let _ = lb.set_level(host, Some(level), expires);
        } else {
            let _ = lb.set_private_level(client, host, Some(level), expires);
            metrics.levels_private += 1;
        }
        metrics.levels_reported += 1;
    }
}

/// Counts a node's state change, and moves it between the node gauges.
fn node_moved(m: &mut ShardMetrics, to: NodeState) {
    m.count_transition(to);
    match to {
        NodeState::Overloaded => {
            m.nodes_idle -= 1;
            m.nodes_overloaded += 1;
        }
        NodeState::Idle => {
            m.nodes_overloaded -= 1;
            m.nodes_idle += 1;
        }
    }
}
