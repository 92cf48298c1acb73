//! The connections of one serving executor: which connection subscribed to
//! which module, and when each was last heard from.
//!
//! Pure: time is an argument (milliseconds from any fixed origin), and the
//! caller decides what a connection is (`T`: the runtime stores the handle
//! it uses to reach the connection's task; tests store nothing).
//!
//! # The idle supervisor
//!
//! Seed 003's supervisor: one low-precision timer drives every timeout, no
//! connection has a timer of its own. A connection is stamped with the
//! executor's coarse clock whenever a frame arrives ([`Registry::touch`]:
//! one store, no timer). The executor's periodic tick calls
//! [`Registry::expire`], which does nothing until the earliest instant any
//! connection could have expired; then it scans once, expires the silent
//! connections and computes the next such instant. Stamps only move
//! deadlines later, and a new connection's deadline is after every existing
//! one, so that instant is a safe lower bound: with agents sending a
//! KeepAlive every 5 s and a 30 s timeout, the scan runs about every 25 s.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use lbagent_model::ModuleId;

/// A connection's handle in a [`Registry`]: a slot index, reused only once
/// the connection's task has [released](Registry::release) it.
pub type ConnId = u32;

/// What [`Registry::subscribe`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subscribed {
    /// The connection is now subscribed to the module.
    New,
    /// It already was.
    Already,
    /// It holds the most subscriptions a connection may; not subscribed.
    Full,
    /// Every connection together holds the most subscriptions allowed
    /// (the shared [`Budget`]); not subscribed.
    TotalFull,
    /// The connection is closing (expired or condemned); not subscribed.
    Closing,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Open,
    /// Expired or condemned: no subscriptions, waiting for its task to
    /// release the slot.
    Closing,
}

struct Slot<T> {
    state: State,
    last_seen: u64,
    modules: HashSet<ModuleId>,
    value: Option<T>,
}

/// A count shared by every executor with a bound: subscriptions held, or
/// connections open, across the whole server.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    /// A budget of `max` units, none used.
    pub fn new(max: usize) -> Self {
        Budget {
            used: AtomicUsize::new(0),
            max,
        }
    }

    /// Takes one unit; false (nothing taken) when all `max` are in use.
    pub fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u < self.max).then_some(u + 1)
            })
            .is_ok()
    }

    /// Gives back `n` units taken before.
    pub fn give(&self, n: usize) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Units in use now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }
}

/// Connections, their subscriptions and their idle deadlines.
pub struct Registry<T> {
    slots: Vec<Slot<T>>,
    free: Vec<ConnId>,
    subscribers: HashMap<ModuleId, HashSet<ConnId>>,
    idle_timeout: u64,
    max_per_conn: usize,
    /// Subscriptions of every executor's registry together.
    total: Arc<Budget>,
    /// No connection can expire before this instant.
    next_check: u64,
    open: usize,
    subscriptions: usize,
}

impl<T> Registry<T> {
    /// An empty registry that expires connections silent for
    /// `idle_timeout_ms` and subscribes a connection to at most
    /// `max_per_conn` modules.
    pub fn new(idle_timeout_ms: u64, max_per_conn: usize) -> Self {
        Registry::with_budget(
            idle_timeout_ms,
            max_per_conn,
            Arc::new(Budget::new(usize::MAX)),
        )
    }

    /// [`Self::new`], whose subscriptions also count against `total`,
    /// shared with other registries (one per executor).
    pub fn with_budget(idle_timeout_ms: u64, max_per_conn: usize, total: Arc<Budget>) -> Self {
        Registry {
            slots: Vec::new(),
            free: Vec::new(),
            subscribers: HashMap::new(),
            idle_timeout: idle_timeout_ms,
            max_per_conn,
            total,
            next_check: u64::MAX,
            open: 0,
            subscriptions: 0,
        }
    }

    /// Registers a connection opened at `now`, holding `value`.
    pub fn open(&mut self, value: T, now: u64) -> ConnId {
        let slot = Slot {
            state: State::Open,
            last_seen: now,
            modules: HashSet::new(),
            value: Some(value),
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = slot;
                id
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as ConnId
            }
        };
        self.open += 1;
        self.next_check = self.next_check.min(now.saturating_add(self.idle_timeout));
        id
    }

    /// The value of open connection `id`.
    pub fn get(&self, id: ConnId) -> Option<&T> {
        self.slot(id, State::Open).and_then(|s| s.value.as_ref())
    }

    /// The value of connection `id`, open or closing.
    pub fn value(&self, id: ConnId) -> Option<&T> {
        let slot = self.slots.get(id as usize)?;
        slot.value.as_ref().filter(|_| slot.state != State::Free)
    }

    /// Records that connection `id` was heard from at `now`.
    pub fn touch(&mut self, id: ConnId, now: u64) {
        if let Some(slot) = self.slots.get_mut(id as usize) {
            slot.last_seen = slot.last_seen.max(now);
        }
    }

    /// Subscribes connection `id` to `module`.
    pub fn subscribe(&mut self, id: ConnId, module: ModuleId) -> Subscribed {
        let Some(slot) = self.slots.get_mut(id as usize) else {
            return Subscribed::Closing;
        };
        if slot.state != State::Open {
            return Subscribed::Closing;
        }
        if slot.modules.contains(&module) {
            return Subscribed::Already;
        }
        if slot.modules.len() >= self.max_per_conn {
            return Subscribed::Full;
        }
        if !self.total.try_take() {
            return Subscribed::TotalFull;
        }
        slot.modules.insert(module);
        self.subscribers.entry(module).or_default().insert(id);
        self.subscriptions += 1;
        Subscribed::New
    }

    /// Drops connection `id`'s subscription to `module` (the agent forgot
    /// it). Returns whether there was one.
    pub fn unsubscribe(&mut self, id: ConnId, module: ModuleId) -> bool {
        let Some(slot) = self.slots.get_mut(id as usize) else {
            return false;
        };
        if slot.state != State::Open || !slot.modules.remove(&module) {
            return false;
        }
        self.subscriptions -= 1;
        self.total.give(1);
        if let Some(ids) = self.subscribers.get_mut(&module) {
            ids.remove(&id);
            if ids.is_empty() {
                self.subscribers.remove(&module);
            }
        }
        true
    }

    /// Whether connection `id` is subscribed to `module`.
    pub fn is_subscribed(&self, id: ConnId, module: ModuleId) -> bool {
        self.slot(id, State::Open)
            .is_some_and(|s| s.modules.contains(&module))
    }

    /// The open connections subscribed to `module`, in no order.
    pub fn subscribers(&self, module: ModuleId) -> impl Iterator<Item = (ConnId, &T)> + '_ {
        let ids = self.subscribers.get(&module).into_iter().flatten();
        ids.filter_map(|&id| Some((id, self.get(id)?)))
    }

    /// The modules connection `id` is subscribed to, in no order.
    pub fn subscriptions_of(&self, id: ConnId) -> impl Iterator<Item = ModuleId> + '_ {
        let slot = self.slot(id, State::Open);
        slot.into_iter().flat_map(|s| s.modules.iter().copied())
    }

    /// Every open connection, in no order.
    pub fn open_conns(&self) -> impl Iterator<Item = (ConnId, &T)> + '_ {
        (0..self.slots.len() as ConnId).filter_map(|id| Some((id, self.get(id)?)))
    }

    /// The supervisor's tick: once `now` reaches the earliest instant a
    /// connection could be silent past the timeout, appends every such
    /// connection to `expired`, drops its subscriptions and marks it
    /// closing (its task must then end and [`Self::release`] it). Returns
    /// how many expired.
    pub fn expire(&mut self, now: u64, expired: &mut Vec<ConnId>) -> usize {
        if now < self.next_check {
            return 0;
        }
        let mut next = u64::MAX;
        let mut count = 0;
        for id in 0..self.slots.len() as ConnId {
            let slot = &self.slots[id as usize];
            if slot.state != State::Open {
                continue;
            }
            let deadline = slot.last_seen.saturating_add(self.idle_timeout);
            if deadline <= now {
                self.condemn(id);
                expired.push(id);
                count += 1;
            } else {
                next = next.min(deadline);
            }
        }
        self.next_check = next;
        count
    }

    /// The earliest instant [`Self::expire`] will look at the connections
    /// (`u64::MAX`: none open).
    pub fn next_check(&self) -> u64 {
        self.next_check
    }

    /// Marks open connection `id` closing and drops its subscriptions
    /// (a slow reader, a shutdown). Returns false when it was not open.
    pub fn condemn(&mut self, id: ConnId) -> bool {
        let Some(slot) = self.slots.get_mut(id as usize) else {
            return false;
        };
        if slot.state != State::Open {
            return false;
        }
        slot.state = State::Closing;
        self.open -= 1;
        let modules = std::mem::take(&mut slot.modules);
        self.subscriptions -= modules.len();
        self.total.give(modules.len());
        for module in modules {
            if let Some(ids) = self.subscribers.get_mut(&module) {
                ids.remove(&id);
                if ids.is_empty() {
                    self.subscribers.remove(&module);
                }
            }
        }
        true
    }

    /// Frees connection `id`'s slot (its task ended), dropping its
    /// subscriptions if it was still open. Returns its value.
    pub fn release(&mut self, id: ConnId) -> Option<T> {
        self.condemn(id);
        let slot = self.slots.get_mut(id as usize)?;
        if slot.state == State::Free {
            return None;
        }
        slot.state = State::Free;
        slot.modules = HashSet::new();
        self.free.push(id);
        slot.value.take()
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.open
    }

    /// Connections whose slot is taken (open or closing).
    pub fn slots_in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Subscriptions held by open connections.
    pub fn subscriptions(&self) -> usize {
        self.subscriptions
    }

    /// Modules with at least one subscriber.
    pub fn subscribed_modules(&self) -> usize {
        self.subscribers.len()
    }

    fn slot(&self, id: ConnId, state: State) -> Option<&Slot<T>> {
        self.slots.get(id as usize).filter(|s| s.state == state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: ModuleId = ModuleId::new(1, 1);
    const B: ModuleId = ModuleId::new(2, 2);

    fn subscribers(r: &Registry<&'static str>, m: ModuleId) -> Vec<&'static str> {
        let mut v: Vec<&str> = r.subscribers(m).map(|(_, v)| *v).collect();
        v.sort();
        v
    }

    #[test]
    fn an_unsubscribe_drops_one_subscription_and_gives_its_budget_back() {
        let budget = Arc::new(Budget::new(2));
        let mut r = Registry::with_budget(30_000, 100, budget.clone());
        let a = r.open((), 0);
        let (m1, m2) = (ModuleId::new(1, 0), ModuleId::new(2, 0));
        assert_eq!(r.subscribe(a, m1), Subscribed::New);
        assert_eq!(r.subscribe(a, m2), Subscribed::New);
        assert_eq!(budget.used(), 2);
        assert!(r.unsubscribe(a, m1));
        assert!(!r.unsubscribe(a, m1), "only once");
        assert!(!r.is_subscribed(a, m1) && r.is_subscribed(a, m2));
        assert_eq!(
            (r.subscriptions(), r.subscribed_modules(), budget.used()),
            (1, 1, 1)
        );
        assert_eq!(r.subscribers(m1).count(), 0);
    }

    #[test]
    fn the_shared_budget_bounds_every_registry_together_and_is_given_back() {
        let budget = Arc::new(Budget::new(3));
        let mut r1 = Registry::with_budget(30_000, 100, budget.clone());
        let mut r2 = Registry::with_budget(30_000, 100, budget.clone());
        let a = r1.open("a", 0);
        let b = r2.open("b", 0);
        assert_eq!(r1.subscribe(a, A), Subscribed::New);
        assert_eq!(r1.subscribe(a, B), Subscribed::New);
        assert_eq!(r2.subscribe(b, A), Subscribed::New);
        assert_eq!(r2.subscribe(b, B), Subscribed::TotalFull);
        assert!(!r2.is_subscribed(b, B));
        assert_eq!(
            r1.subscribe(a, A),
            Subscribed::Already,
            "what is held stays"
        );
        assert_eq!(budget.used(), 3);
        r1.release(a);
        assert_eq!(budget.used(), 1);
        assert_eq!(r2.subscribe(b, B), Subscribed::New);
        assert_eq!(budget.used(), 2);
    }

    #[test]
    fn subscribers_are_exactly_the_connections_that_asked() {
        let mut r = Registry::new(30_000, 100);
        let one = r.open("one", 0);
        let two = r.open("two", 0);
        let _three = r.open("three", 0);
        assert_eq!(r.subscribe(one, A), Subscribed::New);
        assert_eq!(r.subscribe(two, A), Subscribed::New);
        assert_eq!(r.subscribe(two, B), Subscribed::New);
        assert_eq!(r.subscribe(two, B), Subscribed::Already);
        assert_eq!(subscribers(&r, A), ["one", "two"]);
        assert_eq!(subscribers(&r, B), ["two"]);
        assert!(subscribers(&r, ModuleId::new(9, 9)).is_empty());
        assert_eq!(r.subscriptions(), 3);
        assert_eq!(r.subscribed_modules(), 2);
    }

    #[test]
    fn a_released_connection_loses_its_subscriptions_and_its_slot_is_reused() {
        let mut r = Registry::new(30_000, 100);
        let one = r.open("one", 0);
        let two = r.open("two", 0);
        r.subscribe(one, A);
        r.subscribe(two, A);
        assert_eq!(r.release(one), Some("one"));
        assert_eq!(r.release(one), None, "released twice");
        assert_eq!(subscribers(&r, A), ["two"]);
        assert_eq!(r.subscriptions(), 1);
        let again = r.open("again", 0);
        assert_eq!(again, one, "the slot is reused");
        assert!(!r.is_subscribed(again, A), "with no subscriptions");
        assert_eq!(r.connections(), 2);
    }

    #[test]
    fn a_connection_holds_at_most_the_limit() {
        let mut r = Registry::new(30_000, 2);
        let c = r.open((), 0);
        assert_eq!(r.subscribe(c, A), Subscribed::New);
        assert_eq!(r.subscribe(c, B), Subscribed::New);
        assert_eq!(r.subscribe(c, ModuleId::new(3, 3)), Subscribed::Full);
        assert_eq!(r.subscribe(c, A), Subscribed::Already);
    }

    #[test]
    fn a_silent_connection_expires_and_an_active_one_does_not() {
        let mut r = Registry::new(1_000, 100);
        let silent = r.open("silent", 0);
        let active = r.open("active", 0);
        r.subscribe(silent, A);
        r.subscribe(active, A);
        let mut expired = Vec::new();
        for now in (0..=1_500).step_by(100) {
            r.touch(active, now);
            r.expire(now, &mut expired);
        }
        assert_eq!(expired, [silent]);
        assert_eq!(
            subscribers(&r, A),
            ["active"],
            "subscriptions forgotten at expiry"
        );
        assert_eq!(r.subscribe(silent, B), Subscribed::Closing);
        assert_eq!(r.connections(), 1);
        assert_eq!(r.slots_in_use(), 2, "until its task releases it");
        r.release(silent);
        assert_eq!(r.slots_in_use(), 1);
    }

    #[test]
    fn a_connection_expires_exactly_at_its_deadline() {
        let mut r = Registry::new(1_000, 100);
        let c = r.open((), 500);
        r.touch(c, 700);
        let mut expired = Vec::new();
        assert_eq!(r.expire(1_699, &mut expired), 0);
        assert_eq!(r.expire(1_700, &mut expired), 1);
        assert_eq!(expired, [c]);
        assert_eq!(r.expire(5_000, &mut expired), 0, "expired only once");
    }

    #[test]
    fn the_supervisor_scans_only_when_a_deadline_can_have_passed() {
        let mut r = Registry::<()>::new(30_000, 100);
        assert_eq!(r.next_check(), u64::MAX, "nothing to watch");
        let a = r.open((), 0);
        assert_eq!(r.next_check(), 30_000);
        // KeepAlives every 5 s: the first scan finds a's deadline moved.
        for now in (5_000..=30_000).step_by(5_000) {
            r.touch(a, now);
        }
        let mut expired = Vec::new();
        r.expire(30_000, &mut expired);
        assert!(expired.is_empty());
        assert_eq!(r.next_check(), 60_000, "next scan at a's new deadline");
        let b = r.open((), 31_000);
        assert_eq!(
            r.next_check(),
            60_000,
            "a later connection does not advance it"
        );
        r.expire(59_999, &mut expired);
        assert!(expired.is_empty());
        r.expire(60_000, &mut expired);
        assert_eq!(expired, [a]);
        assert_eq!(r.next_check(), 61_000, "b's deadline");
        let _ = b;
    }

    #[test]
    fn a_condemned_connection_is_not_pushed_to() {
        let mut r = Registry::new(30_000, 100);
        let c = r.open("c", 0);
        r.subscribe(c, A);
        assert!(r.condemn(c));
        assert!(!r.condemn(c));
        assert!(subscribers(&r, A).is_empty());
        assert_eq!(r.open_conns().count(), 0);
        assert_eq!(r.subscribed_modules(), 0);
    }

    #[test]
    fn unknown_ids_are_ignored() {
        let mut r = Registry::<()>::new(1_000, 10);
        r.touch(7, 5);
        assert_eq!(r.subscribe(7, A), Subscribed::Closing);
        assert!(!r.condemn(7));
        assert_eq!(r.release(7), None);
        assert!(r.get(7).is_none());
    }

    proptest! {
        /// Whatever the sequence of opens, subscriptions, touches, expiries
        /// and releases, the subscriber index agrees with each connection's
        /// own set, and a connection expires iff it was silent too long.
        #[test]
        fn the_index_matches_the_connections(
            ops in proptest::collection::vec((0u8..5, 0u32..6, 0u32..4), 1..200),
        ) {
            let mut r = Registry::new(100, 3);
            let mut now = 0u64;
            let mut live: Vec<ConnId> = Vec::new();
            let mut last_seen: HashMap<ConnId, u64> = HashMap::new();
            let mut expired = Vec::new();
            for (op, who, m) in ops {
                now += 7;
                let module = ModuleId::new(m, 0);
                match op {
                    0 => {
                        let id = r.open((), now);
                        live.push(id);
                        last_seen.insert(id, now);
                    }
                    1 if !live.is_empty() => {
                        let id = live[who as usize % live.len()];
                        r.subscribe(id, module);
                    }
                    2 if !live.is_empty() => {
                        let id = live[who as usize % live.len()];
                        r.touch(id, now);
                        last_seen.insert(id, now);
                    }
                    3 if !live.is_empty() => {
                        let id = live.remove(who as usize % live.len());
                        r.release(id);
                    }
                    _ => {
                        expired.clear();
                        r.expire(now, &mut expired);
                        for id in &expired {
                            prop_assert!(last_seen[id] + 100 <= now);
                        }
                        // Every connection still open is within its timeout,
                        // whether the scan ran or was skipped.
                        for (id, ()) in r.open_conns() {
                            prop_assert!(last_seen[&id] + 100 > now);
                        }
                    }
                }
                let mut total = 0;
                for (id, ()) in r.open_conns() {
                    let mine: Vec<ModuleId> = r.subscriptions_of(id).collect();
                    prop_assert!(mine.len() <= 3);
                    total += mine.len();
                    for m in mine {
                        prop_assert!(r.subscribers(m).any(|(s, _)| s == id));
                    }
                }
                prop_assert_eq!(total, r.subscriptions());
                let indexed: usize = (0..6u32)
                    .map(|m| r.subscribers(ModuleId::new(m, 0)).count())
                    .sum();
                prop_assert_eq!(indexed, total);
            }
        }
    }
}
