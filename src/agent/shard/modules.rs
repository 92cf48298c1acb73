//! The module table's lifecycle: an entry made within the bounds
//! (`max_modules`, `max_unknown`), touched by each request (which asks for
//! a pull when it has no route), forgotten when unused past its time; the
//! timers that run it all ([`ShardCore::expire`]), and the gauges.

use super::{
    Due, ModuleEntry, Modules, Reply, RouteState, ShardCore, ShardSetup, NONE, REFUSED_FULL,
    REFUSED_UNKNOWN,
};
use crate::messages::ToControl;
use crate::metrics::ShardMetrics;
use crate::timers::Timers;
use lbagent_lb::{LbParams, Millis, ModuleLb};
use lbagent_model::ModuleId;
use lbagent_wire::RetCode;

impl ShardCore {
    /// Makes sure the shard holds `module`, creating an unknown entry
    /// within the bounds; the refusal's message otherwise (counted).
    pub(super) fn ensure(&mut self, module: ModuleId, now: Millis) -> Result<(), &'static str> {
        if self.modules.contains_key(&module) {
            return Ok(());
        }
        if self.modules.len() >= self.setup.max_modules {
            self.metrics.module_limit_hits += 1;
            return Err(REFUSED_FULL);
        }
        if self.unknown >= self.setup.max_unknown {
            self.metrics.unknown_refused += 1;
            return Err(REFUSED_UNKNOWN);
        }
        self.create(module, now);
        Ok(())
    }

    /// Asks the control core for `module`'s route ([`touched`] said so).
    #[cold]
    #[inline(never)]
    pub(super) fn ask_pull(&mut self, module: ModuleId) {
        self.outbox.push(ToControl::Pull(module));
    }

    /// A new entry without a route, its expiry armed.
    pub(super) fn create(&mut self, module: ModuleId, now: Millis) {
        let mut entry = new_entry(now, &self.setup.params);
        let at = now + self.setup.unknown_ttl_ms;
        entry.expiry_at = at;
        self.timers.schedule(at, (module, Due::Expiry));
        self.modules.insert(module, Box::new(entry));
        self.unknown += 1;
    }

    /// Forgets `module`: its statistics go out first, then the control
    /// core is told to drop its copy and the subscription.
    pub(super) fn forget(&mut self, module: ModuleId, now: Millis) {
        self.send_stats(module, now);
        let Some(entry) = self.modules.remove(&module) else {
            return;
        };
        if entry.route != RouteState::Present {
            self.unknown -= 1;
        }
        nodes_changed(&mut self.metrics, node_counts(&entry.lb), (0, 0));
        self.levelled.remove(&module);
        self.metrics.modules_expired += 1;
        self.outbox.push(ToControl::Forget(module));
    }

    /// Runs every timer due at `now`: register requests past their
    /// deadline are answered Timeout (the answers are returned), statistics
    /// due are sent, expired modules are forgotten. Costs the work due.
    pub fn expire(&mut self, now: Millis) -> Vec<Reply> {
        let mut out = Vec::new();
        while let Some((at, (module, due))) = self.timers.pop_due(now) {
            if due == Due::Unsent {
                if at == self.unsent_at {
                    self.unsent_at = NONE;
                    self.offer_unsent(now);
                }
                continue;
            }
            let Some(entry) = self.modules.get_mut(&module) else {
                continue;
            };
            match due {
                Due::Waiters if entry.waiters_at == at => {
                    entry.waiters_at = NONE;
                    let before = entry.waiters.len();
                    let enc = &mut self.enc;
                    entry.waiters.retain(|w| {
                        if w.deadline <= now {
                            out.push((
                                w.peer,
                                enc.register_resp(w.seq, module, RetCode::Timeout, 0)
                                    .to_vec(),
                            ));
                            false
                        } else {
                            true
                        }
                    });
                    self.waiting -= before - entry.waiters.len();
                    if let Some(next) = entry.waiters.iter().map(|w| w.deadline).min() {
                        entry.waiters_at = next;
                        self.timers.schedule(next, (module, Due::Waiters));
                    }
                }
                Due::Stats if entry.stats_at == at => {
                    entry.stats_at = NONE;
                    self.send_stats(module, now);
                }
                Due::Expiry if entry.expiry_at == at => {
                    let due_at = expiry_due(entry, &self.setup);
                    if due_at <= now && entry.waiters.is_empty() {
                        self.forget(module, now);
                    } else {
                        let later = entry.waiters.iter().map(|w| w.deadline).max();
                        let at = due_at.max(later.unwrap_or(0)).max(now + 1);
                        entry.expiry_at = at;
                        self.timers.schedule(at, (module, Due::Expiry));
                    }
                }
                _ => {} // stale
            }
        }
        let live = self.modules.len() * 3 + 1;
        let modules = &self.modules;
        let unsent_at = self.unsent_at;
        self.timers
            .compact_if_stale(live, |at, (m, due)| match (due, modules.get(&m)) {
                (Due::Unsent, _) => at == unsent_at,
                (_, None) => false,
                (Due::Waiters, Some(e)) => e.waiters_at == at,
                (Due::Stats, Some(e)) => e.stats_at == at,
                (Due::Expiry, Some(e)) => e.expiry_at == at,
            });
        out
    }

    /// The earliest deadline of any timer (a stale one may come first:
    /// [`ShardCore::expire`] then does nothing).
    pub fn next_deadline(&self) -> Option<Millis> {
        self.timers.next_deadline()
    }

    /// Refreshes the module gauges of [`ShardCore::metrics`] (the node
    /// gauges are kept as routes and states change). Costs the modules
    /// with downstream levels, not all of them: no periodic walk over the
    /// table.
    pub fn refresh_gauges(&mut self) {
        self.metrics.modules = (self.modules.len() - self.unknown) as u64;
        self.metrics.unknown_modules = self.unknown as u64;
        self.metrics.waiting_registers = self.waiting as u64;
        let modules = &self.modules;
        let mut levelled = 0;
        self.levelled.retain(|m| {
            let held = modules.get(m).map_or(0, |e| e.lb.levels_held() as u64);
            levelled += held;
            held > 0
        });
        self.metrics.nodes_levelled = levelled;
        // Per module with downstream levels: the most permissive one (the
        // level a request must pass at some node), at most
        // MODULE_LEVELS_SHOWN modules.
        self.metrics.module_levels.clear();
        for m in &self.levelled {
            if self.metrics.module_levels.len() >= crate::metrics::MODULE_LEVELS_SHOWN {
                break;
            }
            let Some(e) = self.modules.get(m) else {
                continue;
            };
            let most =
                e.lb.nodes()
                    .iter()
                    .filter_map(|n| e.lb.level_of(n.addr()))
                    .max_by_key(|&l| lbagent_admission::level_index(l));
            if let Some(l) = most {
                self.metrics.module_levels.push((*m, l));
            }
        }
        self.metrics.module_levels.sort_unstable_by_key(|x| x.0);
    }
}

/// Records a request naming `module` (held: see [`ShardCore::ensure`]) and
/// asks for a pull when it has no answer yet and no pull is outstanding (a
/// pull unanswered for `update_timeout` counts as lost). A module answered
/// once is kept current by the route client (pushes, and its own versioned
/// re-pull every `update_timeout`), not by requests: the shard asks again
/// only after forgetting it. A free function over the fields it needs, so
/// callers keep the other fields.
pub(super) fn touch<'m>(
    modules: &'m mut Modules,
    outbox: &mut Vec<ToControl>,
    setup: &ShardSetup,
    module: ModuleId,
    now: Millis,
) -> &'m mut ModuleEntry {
    let entry = modules.get_mut(&module).expect("held: ensure() ran first");
    if touched(entry, setup, now) {
        outbox.push(ToControl::Pull(module));
    }
    entry
}

impl ShardCore {
    /// The bucket of `module`'s entry in the table (made within the
    /// bounds when the table does not hold it; read it with
    /// [`Modules::at_mut`](super::table::Modules::at_mut)), remembered;
    /// the refusal's message otherwise (counted). One hash lookup. For the
    /// request path, which calls it only when the module is not the one
    /// looked up last
    /// ([`Modules::remembered_bucket`](super::table::Modules::remembered_bucket)):
    /// out of line and through the core, so that path keeps no address of
    /// the fields it needs.
    #[inline(never)]
    pub(super) fn bucket_of(
        &mut self,
        module: ModuleId,
        now: Millis,
    ) -> Result<usize, &'static str> {
        let Self {
            modules,
            setup,
            timers,
            unknown,
            metrics,
            ..
        } = self;
        let full = modules.len() >= setup.max_modules;
        modules.bucket_or_make(module, || {
            make_entry(full, setup, timers, unknown, metrics, module, now)
        })
    }
}

/// A new entry for [`ShardCore::bucket_of`] (the shard does not hold `module`),
/// within the bounds (`full`: the table holds `max_modules` already), its
/// expiry armed; the refusal's message otherwise (counted). Out of line: a
/// module held pays nothing for it.
#[cold]
#[inline(never)]
fn make_entry(
    full: bool,
    setup: &ShardSetup,
    timers: &mut Timers<(ModuleId, Due)>,
    unknown: &mut usize,
    metrics: &mut ShardMetrics,
    module: ModuleId,
    now: Millis,
) -> Result<Box<ModuleEntry>, &'static str> {
    if full {
        metrics.module_limit_hits += 1;
        return Err(REFUSED_FULL);
    }
    if *unknown >= setup.max_unknown {
        metrics.unknown_refused += 1;
        return Err(REFUSED_UNKNOWN);
    }
    let mut entry = new_entry(now, &setup.params);
    let at = now + setup.unknown_ttl_ms;
    entry.expiry_at = at;
    timers.schedule(at, (module, Due::Expiry));
    *unknown += 1;
    Ok(Box::new(entry))
}

/// [`touch`] on an entry already found, but for the pull: true when one
/// must be asked (the caller pushes it: [`ShardCore::ask_pull`] on the
/// request path, which asks through the core so that it keeps no address
/// of the outbox), the entry marked as having asked.
#[inline(always)]
pub(super) fn touched(entry: &mut ModuleEntry, setup: &ShardSetup, now: Millis) -> bool {
    entry.last_used = now;
    if entry.route == RouteState::Unknown {
        let outstanding = entry
            .pull_sent
            .is_some_and(|t| now.saturating_sub(t) < setup.update_timeout_ms);
        if !outstanding {
            entry.pull_sent = Some(now);
            return true;
        }
    }
    false
}

/// When `entry` expires: unused for `module_idle_ms` with a route,
/// `unknown_ttl_ms` after its last answer (or its making) without one.
fn expiry_due(entry: &ModuleEntry, setup: &ShardSetup) -> Millis {
    match entry.route {
        RouteState::Present => entry.last_used.saturating_add(setup.module_idle_ms),
        _ => entry.last_update.saturating_add(setup.unknown_ttl_ms),
    }
}

/// A module's (nodes, overloaded nodes), for the node gauges.
pub(super) fn node_counts(lb: &ModuleLb) -> (u64, u64) {
    (lb.nodes().len() as u64, lb.overloaded_count() as u64)
}

/// The node gauges after a module's counts went from `before` to `after`.
pub(super) fn nodes_changed(m: &mut ShardMetrics, before: (u64, u64), after: (u64, u64)) {
    let idle = |(n, o): (u64, u64)| n - o;
    m.nodes_idle = m.nodes_idle + idle(after) - idle(before);
    m.nodes_overloaded = m.nodes_overloaded + after.1 - before.1;
}

/// A new entry without a route, made at `now`.
pub(super) fn new_entry(now: Millis, p: &LbParams) -> ModuleEntry {
    ModuleEntry {
        lb: ModuleLb::new(&[], 0, now, p),
        route: RouteState::Unknown,
        pull_sent: None,
        last_update: now,
        last_stats: now,
        last_used: now,
        waiters: Vec::new(),
        waiters_at: NONE,
        stats_at: NONE,
        expiry_at: NONE,
    }
}
