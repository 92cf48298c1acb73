//! report and batchReport: a call's outcome to its node's LB state (and
//! a downstream admission level, a balance module's units), counted for
//! the module's next statistics ([`super::outbox`]).

use super::{RouteState, ShardCore};
use crate::metrics::{Kind, ShardMetrics};
use lbagent_lb::{Millis, NodeState, Outcome};
use lbagent_wire as wire;

impl ShardCore {
    pub(super) fn report(&mut self, rep: &wire::Report, now: Millis) -> Option<&[u8]> {
        let (seq, module, host) = (rep.seq, rep.module, rep.host);
        let outcome = Outcome::from_retcode(rep.retcode, rep.tcost_ms);
        if !self.admit(Kind::Report, u64::from(seq), module, now) {
            return Some(self.enc.finished());
        }
        let p = &self.setup.params;
        let Some(entry) = self
            .modules
            .get_mut(&module)
            .filter(|e| e.route == RouteState::Present)
        else {
            self.metrics.count_error(Kind::Report);
            self.metrics.unknown_module_reports += 1;
            return None;
        };
        entry.last_used = now;
        match entry.lb.report(host, outcome, now, p) {
            Ok(t) => {
                if let Some(t) = t {
                    node_moved(&mut self.metrics, t.to);
                }
                // The node is in the route: report() just found it.
                if rep.consumed > 0 && !entry.lb.consume(host, rep.consumed).unwrap_or(false) {
                    self.metrics.consumed_ignored += 1;
                }
                if let Some(level) = rep.downstream_level {
                    let expires = now + self.setup.level_timeout_ms;
                    // The node is in the route: report() just found it.
                    let _ = entry.lb.set_level(host, Some(level), expires);
                    self.metrics.levels_reported += 1;
                    self.levelled.insert(module);
                }
            }
            Err(_) => {
                self.metrics.count_error(Kind::Report);
                self.metrics.unknown_node_reports += 1;
            }
        }
        self.maybe_stats(module, now);
        None
    }

    pub(super) fn batch_report(&mut self, b: wire::BatchReport<'_>, now: Millis) -> Option<&[u8]> {
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
        for (addr, count) in b.successes() {
            if entry
                .lb
                .report_successes(addr, count, now, p, |t| node_moved(metrics, t.to))
                .is_err()
            {
                metrics.unknown_node_reports += 1;
            }
        }
        self.maybe_stats(b.module, now);
        None
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
