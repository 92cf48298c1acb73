//! What the shard hands the control core besides answers: a module's
//! statistics (after a report, by timer, at shutdown), and what a full
//! ring refused (statistics kept and merged, forgets, pulls), offered
//! again after [`super::STATS_RETRY_MS`].

use super::{Due, ModuleEntry, ShardCore, ShardSetup, NONE, STATS_RETRY_MS};
use crate::messages::ToControl;
use lbagent_lb::{Millis, NodeCallStats};
use lbagent_model::ModuleId;

impl ShardCore {
    /// After a report: sends the module's statistics when `report_timeout`
    /// has passed since the last send, as the original does (the period
    /// ends with the first report after it, so one message carries it).
    /// Otherwise arms a timer at twice the period: the counts of a module
    /// whose reports stop go out then, without a further report.
    pub(super) fn maybe_stats(&mut self, module: ModuleId, now: Millis) {
        let Some(entry) = self.modules.get_mut(&module) else {
            return;
        };
        let step = stats_step(entry, &self.setup, now);
        self.follow_stats(module, step, now);
    }

    /// Does what [`stats_step`] said for `module`'s statistics: sends
    /// them, or arms their timer. The report's path calls it after the
    /// entry's last use, so that it keeps no address of the timers.
    #[inline(always)]
    pub(super) fn follow_stats(&mut self, module: ModuleId, step: Stats, now: Millis) {
        match step {
            Stats::Send => self.send_stats(module, now),
            Stats::Arm(at) => self.arm_stats(module, at),
            Stats::Wait => {}
        }
    }

    /// Arms the timer that sends `module`'s statistics at `at`
    /// ([`Stats::Arm`]). Out of line: once a statistics period.
    #[cold]
    #[inline(never)]
    pub(super) fn arm_stats(&mut self, module: ModuleId, at: Millis) {
        self.timers.schedule(at, (module, Due::Stats));
    }

    /// Takes the module's counts (and any kept after a full ring) into a
    /// statistics message; nothing when there are none.
    pub(super) fn send_stats(&mut self, module: ModuleId, now: Millis) {
        let kept = self.unsent.remove(&module);
        let mut nodes = Vec::new();
        if let Some(entry) = self.modules.get_mut(&module) {
            entry.last_stats = now;
            entry.stats_at = NONE;
            entry.lb.take_stats(&mut nodes);
            if nodes
                .iter()
                .all(|n| n.succ == 0 && n.err == 0 && n.consumed == 0)
            {
                nodes.clear();
            }
        }
        if let Some(kept) = kept {
            merge_stats(&mut nodes, kept);
        }
        if !nodes.is_empty() {
            self.outbox.push(ToControl::Stats { module, nodes });
        }
    }

    /// Offers again every message the ring refused.
    pub(super) fn offer_unsent(&mut self, _now: Millis) {
        for (module, nodes) in self.unsent.drain() {
            self.outbox.push(ToControl::Stats { module, nodes });
        }
        for module in self.forgets.drain(..) {
            self.outbox.push(ToControl::Forget(module));
        }
    }

    /// Everything the shard holds for the reporter, now: every module's
    /// counts since its last statistics and every kept statistics message
    /// (at shutdown). Modules without calls are skipped.
    pub fn flush_stats(&mut self, now: Millis) {
        let modules: Vec<ModuleId> = self.modules.keys().copied().collect();
        for m in modules {
            self.send_stats(m, now);
        }
        self.offer_unsent(now);
    }

    /// Statistics the ring refused: kept, merged per node, for the module's
    /// next send (or offered again after [`STATS_RETRY_MS`]). No count is lost.
    pub fn stats_refused(&mut self, module: ModuleId, nodes: Vec<NodeCallStats>, now: Millis) {
        self.metrics.stats_kept += 1;
        merge_stats(self.unsent.entry(module).or_default(), nodes);
        if self.unsent_at == NONE {
            self.unsent_at = now + STATS_RETRY_MS;
            self.timers.schedule(self.unsent_at, (module, Due::Unsent));
        }
    }

    /// How many modules' statistics wait in the shard after a full ring.
    pub fn unsent_stats(&self) -> usize {
        self.unsent.len()
    }

    /// A Forget the ring refused: offered again after [`STATS_RETRY_MS`].
    pub fn forget_refused(&mut self, module: ModuleId, now: Millis) {
        self.metrics.ring_drops += 1;
        self.forgets.push(module);
        if self.unsent_at == NONE {
            self.unsent_at = now + STATS_RETRY_MS;
            self.timers.schedule(self.unsent_at, (module, Due::Unsent));
        }
    }

    /// Marks a pull as not sent (the ring was full): the next getHost asks again.
    pub fn pull_dropped(&mut self, module: ModuleId) {
        if let Some(e) = self.modules.get_mut(&module) {
            e.pull_sent = None;
        }
        self.metrics.ring_drops += 1;
    }
}

/// Adds `more` into `into`, node by node (counts summed, the later
/// overload flag kept).
fn merge_stats(into: &mut Vec<NodeCallStats>, more: Vec<NodeCallStats>) {
    for m in more {
        match into.iter_mut().find(|n| n.addr == m.addr) {
            Some(n) => {
                n.succ = n.succ.saturating_add(m.succ);
                n.err = n.err.saturating_add(m.err);
                n.consumed = n.consumed.saturating_add(m.consumed);
            }
            None => into.push(m),
        }
    }
}

/// What a report's module's statistics need ([`stats_step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stats {
    /// Send them now.
    Send,
    /// Arm the timer that sends them at this time (the entry says it is
    /// armed already).
    Arm(Millis),
    /// Nothing: the timer is armed.
    Wait,
}

/// What `entry`'s statistics need ([`ShardCore::maybe_stats`] on an entry
/// already found: no second lookup on the report's path): sent now when
/// due, else a timer armed at two report timeouts after the last send if
/// none is (the entry is marked armed; [`ShardCore::follow_stats`] arms
/// it, through the core after the entry's last use, so that the report's
/// path keeps no address of the timers: callgrind counted 2 instructions
/// a sweep for each field address kept).
#[inline(always)]
pub(super) fn stats_step(entry: &mut ModuleEntry, setup: &ShardSetup, now: Millis) -> Stats {
    let timeout = setup.report_timeout_ms;
    if now >= entry.last_stats + timeout {
        return Stats::Send;
    }
    if entry.stats_at == NONE {
        let at = entry.last_stats + 2 * timeout;
        entry.stats_at = at;
        return Stats::Arm(at);
    }
    Stats::Wait
}
