//! Keeping the route table in step with the store: the poller (what to
//! read, what changed, what to log) and the thread that runs it.
//!
//! The poller runs on its own thread, never on a serving executor: store
//! calls block. It reads the route version when the store announces a
//! change ([`Store::wait_for_change`]: PostgreSQL's `LISTEN`/`NOTIFY`),
//! and otherwise every `dnsserver.notify_poll_interval_ms` on a store that
//! announces changes (a safety net for a lost notification) or every
//! `dnsserver.poll_interval_ms` on one that cannot (SQLite, where the check
//! is one prepared statement on a local file). When the version moved, it
//! reads the changes since the served version ([`Store::changes_since`]:
//! the changed modules only, through indexes) and applies them: the new
//! table shares every unchanged module. Until the first load succeeds, and
//! every `dnsserver.full_reload_interval` seconds when that is set (0, the
//! default, turns it off), it reads every route instead and diffs the
//! whole table. A version that went backwards (a store restored or
//! replaced) also forces a full reload. Every new table goes to the
//! executors with the modules that changed, as one [`Update`] on each
//! executor's channel; readers never wait for it.
//!
//! When the store fails, the poller keeps the table it has (the executors
//! go on serving it), drops the connection (the next poll opens a new one:
//! a restarted database is picked up), and says so once per change of
//! state: one line when the store becomes unreachable, one when it answers
//! again. The metrics count every failed poll.
//!
//! One reload is refused on purpose: a store at route version 0 (never
//! written to) while routes are served. That is a database recreated by
//! mistake (a deleted SQLite file is created anew on open), and applying it
//! would push the deletion of every module to every agent. The served
//! routes stay, one line says why, and the refusal counts as a failed full
//! reload; the first write to the store (version 1 and up) ends it.

use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::metrics::{Board, StoreStatus};
use super::table::{Change, Reloaded, RouteTable};
use super::updates::UpdateSender;
use lbagent_model::ModuleId;
use lbagent_store::{Store, StoreError, Wake};
use lbagent_wire::Encoder;

/// Opens a connection to the store; called at start and after every
/// failure ([`DnsServer::start`](super::DnsServer::start) creates a
/// missing SQLite file only on the first call: see
/// [`lbagent_store::open_existing`]).
pub type StoreOpener = Box<dyn FnMut() -> Result<Box<dyn Store>, StoreError> + Send>;

/// A new table for the executors, with what changed since the previous.
#[derive(Debug)]
pub struct Update {
    /// The table to serve from now on.
    pub table: Arc<RouteTable>,
    /// The modules that changed (pushed to their subscribers).
    pub changes: Vec<Change>,
    /// The first table ever loaded: every module subscribed while pulls
    /// were held is pushed, whether it changed or not.
    pub first_load: bool,
}

/// What one poll did.
#[derive(Debug, Default)]
pub struct Polled {
    /// A new table for the executors, when anything changed.
    pub update: Option<Arc<Update>>,
    /// Lines for the log at WARN: somebody should look (the store down or
    /// replaced, the route version going back, an empty store, a module
    /// refused).
    pub notes: Vec<String>,
    /// Lines for the log at INFO: normal events (the first load, routes
    /// changed and pushed, the store answering again).
    pub info: Vec<String>,
    /// The store's error, when the poll failed.
    pub error: Option<StoreError>,
}

/// How often the poller looks at the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Intervals {
    /// Between route version checks on a store that announces no change.
    pub poll: Duration,
    /// Between route version checks on a store that announces its
    /// changes: the fallback for a lost notification. Also the shortest
    /// wait between attempts to reach a store that failed.
    pub notified_poll: Duration,
    /// Between full reloads; `None`: only the first load (and a version
    /// that went back) reads every route.
    pub full_reload: Option<Duration>,
}

impl Intervals {
    /// Between attempts to reach a store that failed: the longer of the
    /// two poll intervals, so that a store that is down is not asked tens
    /// of times a second.
    pub fn retry(&self) -> Duration {
        self.poll.max(self.notified_poll)
    }

    /// One wait before the next attempt to reach a store that failed:
    /// [`Self::retry`] jittered down by up to half, drawn with `rng`, so
    /// that the route servers of one store, which all lost it at the same
    /// instant (a failover, a restart), do not knock on it in step.
    pub fn retry_jittered(&self, rng: &mut fastrand::Rng) -> Duration {
        let retry = self.retry();
        retry.saturating_sub(retry.mul_f64(rng.f64() / 2.0))
    }
}

/// The store poller: see the module docs.
pub struct Poller {
    open: StoreOpener,
    store: Option<Box<dyn Store>>,
    table: Arc<RouteTable>,
    enc: Encoder,
    label: String,
    intervals: Intervals,
    next_full: Option<Instant>,
    status: StoreStatus,
    /// Since when the store fails (None: it answers, or was never tried).
    down_since: Option<Instant>,
    /// Modules refused as too large, so that each is logged once.
    refused: Vec<ModuleId>,
    /// Whether the "new, empty store" refusal was logged (once per episode).
    empty_noted: bool,
}

impl Poller {
    /// A poller that reaches the store through `open` (`label` names the
    /// store in logs: a URL with its password redacted) and looks at it as
    /// often as `intervals` say.
    pub fn new(open: StoreOpener, label: String, intervals: Intervals) -> Self {
        Poller {
            open,
            store: None,
            table: Arc::new(RouteTable::unloaded()),
            enc: Encoder::new(),
            label,
            intervals,
            next_full: None,
            status: StoreStatus::default(),
            down_since: None,
            refused: Vec::new(),
            empty_noted: false,
        }
    }

    /// The table as of the last successful poll.
    pub fn table(&self) -> &Arc<RouteTable> {
        &self.table
    }

    /// The figures for metrics.
    pub fn status(&self) -> &StoreStatus {
        &self.status
    }

    /// How often it looks at the store.
    pub fn intervals(&self) -> Intervals {
        self.intervals
    }

    /// Waits at most `timeout` for the store to announce a change (see
    /// [`Store::wait_for_change`]). [`Wake::Unsupported`] when no
    /// connection is open; on an error the connection is dropped (the
    /// next poll opens one, and says so if that fails).
    ///
    /// # Errors
    /// The store's, as it waited.
    pub fn wait_for_change(&mut self, timeout: Duration) -> Result<Wake, StoreError> {
        let Some(store) = self.store.as_mut() else {
            return Ok(Wake::Unsupported);
        };
        let woke = store.wait_for_change(timeout);
        if woke.is_err() {
            self.store = None;
        }
        woke
    }

    /// Polls the store once, at `now`.
    pub fn poll(&mut self, now: Instant) -> Polled {
        self.status.polls += 1;
        let full = !self.table.is_loaded() || self.next_full.is_some_and(|at| now >= at);
        let mut polled = Polled::default();
        match self.try_poll(full, now, &mut polled.notes) {
            Ok(reloaded) => {
                if let Some(since) = self.down_since.take() {
                    let down = now.saturating_duration_since(since).as_secs_f64();
                    polled.info.push(format!(
                        "store {} answers again after {down:.1} s down; serving {} modules at route version {}",
                        self.label,
                        self.table.len(),
                        self.table.version()
                    ));
                }
                self.status.up = true;
                self.status.last_store_ok = Some(now);
                if let Some(r) = reloaded {
                    polled.update = self.install(r, &mut polled.notes, &mut polled.info);
                }
            }
            Err((e, full)) => {
                self.status.poll_failures += 1;
                if full {
                    self.status.full_reload_failures += 1;
                } else {
                    self.status.change_reload_failures += 1;
                }
                // Reconnect next time: the connection may be what broke.
                self.store = None;
                let replaced = matches!(e, StoreError::Replaced { .. });
                if replaced {
                    self.status.store_replaced += 1;
                }
                if self.down_since.is_none() {
                    self.down_since = Some(now);
                    polled.notes.push(self.down_note(&e));
                } else if replaced {
                    polled.notes.push(e.to_string());
                }
                self.status.up = false;
                polled.error = Some(e);
            }
        }
        if let Some(store) = &self.store {
            self.status.bad_rows = store.bad_rows();
        }
        polled
    }

    fn down_note(&self, e: &StoreError) -> String {
        let every = self.intervals.retry().as_millis();
        if self.table.is_loaded() {
            format!(
                "store unreachable: {e}; serving the last routes ({} modules, route version {}) and retrying every {every} ms or less",
                self.table.len(),
                self.table.version()
            )
        } else {
            format!(
                "store unreachable: {e}; no route loaded yet, so pulls are held (answered once it answers); retrying every {every} ms or less"
            )
        }
    }

    /// One poll's store calls; on error, also whether it was a full reload.
    fn try_poll(
        &mut self,
        full: bool,
        now: Instant,
        notes: &mut Vec<String>,
    ) -> Result<Option<Reloaded>, (StoreError, bool)> {
        if self.store.is_none() {
            self.store = Some((self.open)().map_err(|e| (e, full))?);
        }
        let Some(store) = self.store.as_mut() else {
            unreachable!("the store was just opened");
        };
        let served = self.table.version();
        if !full {
            let version = store.route_version().map_err(|e| (e, false))?;
            if version == served {
                return Ok(None);
            }
            if version > served {
                let changes = store.changes_since(served).map_err(|e| (e, false))?;
                self.status.change_reloads += 1;
                return Ok(Some(self.table.apply(changes, &mut self.enc)));
            }
            // Version 0 is a new store: the check below speaks for it.
            if version > 0 {
                notes.push(format!(
                    "route version went back from {served} to {version} (store restored or replaced?): reloading every route"
                ));
            }
        }
        let set = store.load_all().map_err(|e| (e, true))?;
        if set.version == 0 && served > 0 {
            // A store that was never written to, where routes were served:
            // a database recreated by mistake (a deleted SQLite file is
            // created anew on open). Pushing every module's deletion to
            // every agent would take the fleet down; keep serving.
            self.status.full_reload_failures += 1;
            if !self.empty_noted {
                self.empty_noted = true;
                notes.push(format!(
                    "store {} holds no route and route version 0 (a new, empty database?) while route version {served} is served: keeping the served routes; restore the store, or restart this route server to serve it empty",
                    self.label
                ));
            }
            return Ok(None);
        }
        self.empty_noted = false;
        self.status.full_reloads += 1;
        self.status.last_full_reload = Some(now);
        self.next_full = self.intervals.full_reload.map(|every| now + every);
        Ok(Some(self.table.replace_all(set, &mut self.enc)))
    }

    /// Makes `r` the table; the update for the executors when it changes
    /// what they serve.
    fn install(
        &mut self,
        r: Reloaded,
        notes: &mut Vec<String>,
        info: &mut Vec<String>,
    ) -> Option<Arc<Update>> {
        let first_load = !self.table.is_loaded();
        for e in &r.refused {
            let super::table::EntryError::TooLarge { module, .. } = e;
            if !self.refused.contains(module) {
                self.refused.push(*module);
                notes.push(format!("not serving a module: {e}"));
            }
        }
        self.status.modules_refused = self.refused.len() as u64;
        let table = Arc::new(r.table);
        if first_load {
            info.push(format!(
                "loaded {} modules at route version {} from store {}",
                table.len(),
                table.version(),
                self.label
            ));
        } else if !r.changes.is_empty() {
            info.push(format!(
                "route version {}: {} modules changed, pushed to their subscribers",
                table.version(),
                r.changes.len()
            ));
        }
        self.status.loaded = true;
        self.status.modules = table.len() as u64;
        self.status.route_version = table.version();
        self.status.modules_changed += r.changes.len() as u64;
        self.table = table.clone();
        (first_load || !r.changes.is_empty()).then(|| {
            Arc::new(Update {
                table,
                changes: r.changes,
                first_load,
            })
        })
    }
}

/// The outcome of the first poll, for [`super::DnsServer::start`].
pub type FirstPoll = Result<(), StoreError>;

/// The longest one wait for a notification lasts before the thread looks
/// at `stop`: how long a stop may wait for it.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Runs `poller` until `stop` is closed (or sent to): polls when the store
/// announces a change or the poll interval passed, logs its notes, sends
/// its updates to every executor (waking it), publishes its status on `board`, and
/// reports the first poll's outcome on `first`.
pub fn run(
    mut poller: Poller,
    executors: Vec<UpdateSender>,
    board: Arc<Board>,
    stop: Receiver<()>,
    first: SyncSender<FirstPoll>,
) {
    let mut first = Some(first);
    // Whether the store announced changes at the last wait, and whether a
    // failed wait was logged (once per episode).
    let (mut notified, mut wait_failed) = (false, false);
    let mut jitter = fastrand::Rng::new();
    loop {
        let polled = poller.poll(Instant::now());
        let failed = polled.error.is_some();
        for line in &polled.info {
            tracing::info!("{line}");
        }
        for note in &polled.notes {
            tracing::warn!("{note}");
        }
        // The status first: an executor installs and pushes an update the
        // moment it is sent, so a push seen means /metrics says so too.
        board.publish_store(poller.status());
        if let Some(update) = polled.update {
            for tx in &executors {
                // An executor that stopped has dropped its receiver.
                let _ = tx.send(update.clone());
            }
        }
        if let Some(tx) = first.take() {
            let _ = tx.send(polled.error.map_or(Ok(()), Err));
        }
        let every = if failed {
            poller.intervals().retry_jittered(&mut jitter)
        } else if notified {
            poller.intervals().notified_poll
        } else {
            poller.intervals().poll
        };
        let deadline = Instant::now() + every;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match poller.wait_for_change(left.min(WAIT_SLICE)) {
                Ok(Wake::Changed) => {
                    (notified, wait_failed) = (true, false);
                    break;
                }
                Ok(Wake::Quiet) => {
                    (notified, wait_failed) = (true, false);
                    match stop.try_recv() {
                        Err(TryRecvError::Empty) => continue,
                        Ok(()) | Err(TryRecvError::Disconnected) => return,
                    }
                }
                Ok(Wake::Unsupported) => {
                    // No notifications from this store: sleep out the poll
                    // interval (a stop ends it early).
                    notified = false;
                    match stop.recv_timeout(left) {
                        Err(RecvTimeoutError::Timeout) => break,
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
                Err(e) => {
                    notified = false;
                    if !wait_failed {
                        wait_failed = true;
                        tracing::warn!(
                            "waiting for change notifications failed: {e}; connecting again"
                        );
                    }
                    // Poll soon: it connects again (and listens again), or
                    // says that the store is down.
                    let soon = left.min(poller.intervals().poll);
                    match stop.recv_timeout(soon) {
                        Err(RecvTimeoutError::Timeout) => break,
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            }
        }
        if stop_requested(&stop) {
            return;
        }
    }
}

/// Whether `stop` was sent to or closed.
fn stop_requested(stop: &Receiver<()>) -> bool {
    !matches!(stop.try_recv(), Err(TryRecvError::Empty))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use lbagent_model::{NodeAddr, Policy, RouteNode};
    use lbagent_store::{CallStatus, Changes, ModuleRoute, RouteSet};
    use lbagent_wire::{decode, FrameDecoder, Limits, Message};
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// An in-memory store: routes, a route version and a change log, with
    /// a switch that makes every call fail as an unreachable database
    /// would. Clones share the data.
    #[derive(Clone, Default)]
    pub(crate) struct MemStore {
        data: Arc<Mutex<Data>>,
        down: Arc<AtomicBool>,
        opens: Arc<AtomicUsize>,
    }

    #[derive(Default)]
    struct Data {
        version: u64,
        routes: BTreeMap<ModuleId, BTreeMap<NodeAddr, u32>>,
        /// (version, module) per change.
        log: Vec<(u64, ModuleId)>,
        policies: BTreeMap<ModuleId, Policy>,
        /// The reports whose consumed units were applied.
        applied: std::collections::HashSet<lbagent_store::ReportKey>,
        options: BTreeMap<ModuleId, lbagent_model::ModuleOptions>,
        meta: BTreeMap<(ModuleId, NodeAddr), lbagent_model::NodeMeta>,
    }

    impl MemStore {
        pub(crate) fn set_down(&self, down: bool) {
            self.down.store(down, Ordering::SeqCst);
        }

        pub(crate) fn opens(&self) -> usize {
            self.opens.load(Ordering::SeqCst)
        }

        pub(crate) fn opener(&self) -> StoreOpener {
            let store = self.clone();
            Box::new(move || {
                store.check()?;
                store.opens.fetch_add(1, Ordering::SeqCst);
                Ok(Box::new(store.clone()) as Box<dyn Store>)
            })
        }

        /// Sets the version without logging a change (a restored backup).
        pub(crate) fn reset_version(&self, version: u64) {
            self.data.lock().unwrap().version = version;
        }

        fn check(&self) -> Result<(), StoreError> {
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable {
                    url: "mem:".into(),
                    why: "connection refused".into(),
                });
            }
            Ok(())
        }

        fn route(data: &Data, module: ModuleId) -> ModuleRoute {
            let version = data
                .log
                .iter()
                .rev()
                .find(|(_, m)| *m == module)
                .map_or(data.version, |(v, _)| *v);
            let nodes = data.routes.get(&module).into_iter().flatten();
            ModuleRoute {
                module,
                version,
                nodes: nodes
                    .map(|(&addr, &weight)| RouteNode { addr, weight })
                    .collect(),
                policy: data.policies.get(&module).copied().unwrap_or_default(),
                options: data.options.get(&module).copied().unwrap_or_default(),
                meta: data
                    .meta
                    .range((module, NodeAddr { ip: 0, port: 0 })..)
                    .take_while(|((m, _), _)| *m == module)
                    .map(|((_, a), m)| (*a, m.clone()))
                    .collect(),
            }
        }
    }

    impl Store for MemStore {
        fn backend(&self) -> &'static str {
            "mem"
        }

        fn route_version(&mut self) -> Result<u64, StoreError> {
            self.check()?;
            Ok(self.data.lock().unwrap().version)
        }

        fn load_all(&mut self) -> Result<RouteSet, StoreError> {
            self.check()?;
            let data = self.data.lock().unwrap();
            let modules = data.routes.keys().map(|&m| Self::route(&data, m)).collect();
            Ok(RouteSet {
                version: data.version,
                modules,
            })
        }

        fn changes_since(&mut self, version: u64) -> Result<Changes, StoreError> {
            self.check()?;
            let data = self.data.lock().unwrap();
            let mut modules: Vec<ModuleId> = data
                .log
                .iter()
                .filter(|(v, _)| *v > version)
                .map(|(_, m)| *m)
                .collect();
            modules.sort();
            modules.dedup();
            Ok(Changes {
                version: data.version,
                modules: modules.into_iter().map(|m| Self::route(&data, m)).collect(),
            })
        }

        fn add_node_meta(
            &mut self,
            module: ModuleId,
            node: RouteNode,
            meta: &lbagent_model::NodeMeta,
        ) -> Result<u64, StoreError> {
            self.check()?;
            let mut data = self.data.lock().unwrap();
            data.version += 1;
            let v = data.version;
            data.routes
                .entry(module)
                .or_default()
                .insert(node.addr, node.weight);
            if !meta.is_empty() {
                data.meta.insert((module, node.addr), meta.clone());
            }
            data.log.push((v, module));
            Ok(v)
        }

        fn set_meta(
            &mut self,
            module: ModuleId,
            node: NodeAddr,
            meta: &lbagent_model::NodeMeta,
        ) -> Result<u64, StoreError> {
            self.check()?;
            let mut data = self.data.lock().unwrap();
            if !data
                .routes
                .get(&module)
                .is_some_and(|r| r.contains_key(&node))
            {
                return Err(StoreError::NotFound { module, node });
            }
            data.version += 1;
            let v = data.version;
            data.meta.insert((module, node), meta.clone());
            if meta.is_empty() {
                data.meta.remove(&(module, node));
            }
            data.log.push((v, module));
            Ok(v)
        }

        fn import_table(
            &mut self,
            rows: &[(ModuleId, RouteNode)],
            _meta: &[lbagent_store::TableMeta],
            _replace: bool,
        ) -> Result<lbagent_store::Imported, StoreError> {
            self.check()?;
            let mut data = self.data.lock().unwrap();
            data.version += 1;
            let v = data.version;
            let mut modules = std::collections::BTreeSet::new();
            for (module, node) in rows {
                data.routes
                    .entry(*module)
                    .or_default()
                    .insert(node.addr, node.weight);
                modules.insert(*module);
            }
            for m in &modules {
                data.log.push((v, *m));
            }
            Ok(lbagent_store::Imported {
                version: v,
                modules: modules.len(),
                nodes: rows.len(),
            })
        }

        fn del_node(&mut self, module: ModuleId, node: NodeAddr) -> Result<u64, StoreError> {
            self.check()?;
            let mut data = self.data.lock().unwrap();
            let nodes = data
                .routes
                .get_mut(&module)
                .ok_or(StoreError::NotFound { module, node })?;
            nodes.remove(&node);
            if nodes.is_empty() {
                data.routes.remove(&module);
            }
            data.meta.remove(&(module, node));
            data.version += 1;
            let v = data.version;
            data.log.push((v, module));
            Ok(v)
        }

        fn list(&mut self, module: Option<ModuleId>) -> Result<Vec<ModuleRoute>, StoreError> {
            let set = self.load_all()?;
            Ok(set
                .modules
                .into_iter()
                .filter(|r| module.is_none_or(|m| m == r.module))
                .collect())
        }

        fn set_policy(&mut self, module: ModuleId, policy: Policy) -> Result<u64, StoreError> {
            self.check()?;
            let mut data = self.data.lock().unwrap();
            data.policies.insert(module, policy);
            data.version += 1;
            let v = data.version;
            data.log.push((v, module));
            Ok(v)
        }

        fn set_options(
            &mut self,
            module: ModuleId,
            options: lbagent_model::ModuleOptions,
        ) -> Result<u64, StoreError> {
            self.check()?;
            let mut data = self.data.lock().unwrap();
            data.options.insert(module, options);
            data.version += 1;
            let v = data.version;
            data.log.push((v, module));
            Ok(v)
        }

        fn consume(
            &mut self,
            rows: &[(ModuleId, NodeAddr, u32)],
        ) -> Result<lbagent_store::Consumed, StoreError> {
            self.check()?;
            lbagent_store::check_consumed(rows)?;
            let mut data = self.data.lock().unwrap();
            let mut changed = Vec::new();
            for &(module, node, units) in rows {
                if let Some(w) = data.routes.get_mut(&module).and_then(|n| n.get_mut(&node)) {
                    if *w > 0 {
                        *w = w.saturating_sub(units);
                        changed.push(module);
                    }
                }
            }
            let nodes = changed.len();
            if nodes > 0 {
                data.version += 1;
                let v = data.version;
                changed.dedup();
                for m in changed {
                    data.log.push((v, m));
                }
            }
            Ok(lbagent_store::Consumed {
                version: data.version,
                nodes,
            })
        }

        fn consume_once(
            &mut self,
            key: lbagent_store::ReportKey,
            rows: &[(ModuleId, NodeAddr, u32)],
            _now_s: u64,
        ) -> Result<Option<lbagent_store::Consumed>, StoreError> {
            self.check()?;
            if !self.data.lock().unwrap().applied.insert(key) {
                return Ok(None);
            }
            self.consume(rows).map(Some)
        }

        fn upsert_status(&mut self, _rows: &[CallStatus]) -> Result<(), StoreError> {
            self.check()
        }

        fn call_status(
            &mut self,
            _module: Option<ModuleId>,
        ) -> Result<Vec<CallStatus>, StoreError> {
            self.check()?;
            Ok(Vec::new())
        }
    }

    const A: ModuleId = ModuleId::new(1, 1);
    const B: ModuleId = ModuleId::new(2, 2);

    fn node(last: u8) -> RouteNode {
        RouteNode {
            addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), 80),
            weight: 1,
        }
    }

    fn poller(store: &MemStore) -> Poller {
        Poller::new(
            store.opener(),
            "mem:".into(),
            Intervals {
                poll: Duration::from_millis(100),
                notified_poll: Duration::from_secs(1),
                full_reload: Some(Duration::from_secs(10)),
            },
        )
    }

    /// (module, exists, version) of each change's push.
    fn pushed(update: &Update) -> Vec<(ModuleId, bool, u64)> {
        update
            .changes
            .iter()
            .map(|c| {
                let mut frames = FrameDecoder::default();
                frames.feed(&c.push);
                let frame = frames.next_frame().unwrap().unwrap();
                let Ok(Message::RoutePush(p)) = decode(frame, &Limits::TCP_FRAME) else {
                    panic!("not a push");
                };
                (ModuleId::new(p.modid(), p.cmdid()), p.exists(), p.version())
            })
            .collect()
    }

    #[test]
    fn the_first_poll_loads_everything() {
        let store = MemStore::default();
        store.clone().add_node(A, node(1)).unwrap();
        store.clone().add_node(B, node(2)).unwrap();
        let mut p = poller(&store);
        let polled = p.poll(Instant::now());
        let update = polled.update.expect("the first load is an update");
        assert!(update.first_load);
        assert_eq!(pushed(&update), vec![(A, true, 1), (B, true, 2)]);
        assert_eq!(update.table.version(), 2);
        assert!(polled.info[0].starts_with("loaded 2 modules at route version 2"));
        assert!(polled.notes.is_empty(), "a normal load is no warning");
        assert!(p.status().up && p.status().loaded);
        assert_eq!(p.status().full_reloads, 1);
    }

    #[test]
    fn a_version_change_applies_only_the_changed_modules() {
        let store = MemStore::default();
        let mut s = store.clone();
        s.add_node(A, node(1)).unwrap();
        s.add_node(B, node(2)).unwrap();
        let mut p = poller(&store);
        let t0 = Instant::now();
        p.poll(t0);
        assert!(p.poll(t0).update.is_none(), "nothing changed");
        s.add_node(A, node(3)).unwrap();
        s.del_node(B, node(2).addr).unwrap();
        let update = p.poll(t0).update.unwrap();
        assert!(!update.first_load);
        assert_eq!(pushed(&update), vec![(A, true, 3), (B, false, 4)]);
        assert_eq!(update.table.get(A).unwrap().nodes.len(), 2);
        assert!(update.table.get(B).is_none());
        assert_eq!(p.status().change_reloads, 1);
        assert_eq!(
            p.status().full_reloads,
            1,
            "no full reload before its interval"
        );
        assert_eq!(p.status().modules_changed, 2 + 2);
    }

    #[test]
    fn a_full_reload_runs_on_its_interval_and_finds_unlogged_changes() {
        let store = MemStore::default();
        let mut s = store.clone();
        s.add_node(A, node(1)).unwrap();
        let mut p = poller(&store);
        let t0 = Instant::now();
        p.poll(t0);
        // A row changed behind the change log's back: only a full reload sees it.
        store
            .data
            .lock()
            .unwrap()
            .routes
            .get_mut(&A)
            .unwrap()
            .insert(node(9).addr, 1);
        assert!(p.poll(t0 + Duration::from_secs(9)).update.is_none());
        let update = p.poll(t0 + Duration::from_secs(10)).update.unwrap();
        assert_eq!(pushed(&update), vec![(A, true, 1)]);
        assert_eq!(update.table.get(A).unwrap().nodes.len(), 2);
        assert_eq!(p.status().full_reloads, 2);
    }

    #[test]
    fn without_a_full_reload_interval_only_the_first_load_reads_everything() {
        let store = MemStore::default();
        let mut s = store.clone();
        s.add_node(A, node(1)).unwrap();
        let mut p = Poller::new(
            store.opener(),
            "mem:".into(),
            Intervals {
                full_reload: None,
                ..p_intervals()
            },
        );
        let t0 = Instant::now();
        p.poll(t0);
        for h in 1..=48 {
            assert!(p.poll(t0 + Duration::from_secs(3600 * h)).update.is_none());
        }
        s.add_node(B, node(2)).unwrap();
        let update = p.poll(t0 + Duration::from_secs(3600 * 49)).update.unwrap();
        assert_eq!(pushed(&update), vec![(B, true, 2)]);
        assert_eq!(p.status().full_reloads, 1, "the first load only");
        assert_eq!(p.status().change_reloads, 1);
    }

    fn p_intervals() -> Intervals {
        poller(&MemStore::default()).intervals()
    }

    #[test]
    fn retries_of_a_failed_store_are_jittered_so_route_servers_do_not_knock_in_step() {
        let every = Intervals {
            poll: Duration::from_millis(25),
            notified_poll: Duration::from_millis(1000),
            full_reload: None,
        };
        // Three route servers that lost the store at the same instant.
        let mut servers: Vec<fastrand::Rng> = (0..3).map(fastrand::Rng::with_seed).collect();
        let mut waits = Vec::new();
        for _ in 0..200 {
            for rng in &mut servers {
                let wait = every.retry_jittered(rng);
                assert!(
                    (Duration::from_millis(500)..=Duration::from_millis(1000)).contains(&wait),
                    "{wait:?}"
                );
                waits.push(wait);
            }
        }
        let low = waits
            .iter()
            .filter(|w| **w < Duration::from_millis(750))
            .count();
        assert!((200..=400).contains(&low), "{low} of 600 in the lower half");
    }

    #[test]
    fn an_unreachable_store_keeps_the_table_logs_once_and_recovers() {
        let store = MemStore::default();
        let mut s = store.clone();
        s.add_node(A, node(1)).unwrap();
        let mut p = poller(&store);
        let t0 = Instant::now();
        p.poll(t0);
        let served = p.table().clone();
        store.set_down(true);
        let mut notes = Vec::new();
        for i in 1..=5 {
            let polled = p.poll(t0 + Duration::from_millis(100 * i));
            assert!(polled.update.is_none());
            assert!(polled.error.is_some());
            notes.extend(polled.notes);
        }
        assert_eq!(notes.len(), 1, "one line per state change: {notes:?}");
        assert!(notes[0].contains("serving the last routes (1 modules, route version 1)"));
        assert!(Arc::ptr_eq(p.table(), &served), "the table is kept");
        assert!(!p.status().up);
        assert_eq!(p.status().poll_failures, 5);
        assert_eq!(store.opens(), 1, "reopening fails while it is down");
        store.set_down(false);
        s.add_node(B, node(2)).unwrap();
        let polled = p.poll(t0 + Duration::from_secs(1));
        assert!(
            polled.info[0].contains("answers again after 0.9 s down"),
            "{:?}",
            polled.info
        );
        assert!(polled.notes.is_empty(), "a recovery is no warning");
        assert_eq!(pushed(&polled.update.unwrap()), vec![(B, true, 2)]);
        assert_eq!(store.opens(), 2, "a new connection after the failure");
        assert!(p.status().up);
    }

    #[test]
    fn a_store_down_at_start_holds_pulls_until_the_first_load() {
        let store = MemStore::default();
        store.clone().add_node(A, node(1)).unwrap();
        store.set_down(true);
        let mut p = poller(&store);
        let t0 = Instant::now();
        let polled = p.poll(t0);
        assert!(polled.error.is_some());
        assert!(
            polled.notes[0].contains("pulls are held"),
            "{:?}",
            polled.notes
        );
        assert!(!p.table().is_loaded());
        assert_eq!(p.status().full_reload_failures, 1);
        store.set_down(false);
        let update = p.poll(t0 + Duration::from_millis(100)).update.unwrap();
        assert!(update.first_load);
        assert!(p.status().loaded);
    }

    #[test]
    fn a_version_that_goes_back_forces_a_full_reload() {
        let store = MemStore::default();
        let mut s = store.clone();
        s.add_node(A, node(1)).unwrap();
        s.add_node(A, node(2)).unwrap();
        let mut p = poller(&store);
        let t0 = Instant::now();
        p.poll(t0);
        s.del_node(A, node(2).addr).unwrap();
        store.reset_version(1);
        let polled = p.poll(t0);
        assert!(
            polled.notes[0].contains("went back from 2 to 1"),
            "{:?}",
            polled.notes
        );
        assert_eq!(p.status().full_reloads, 2);
        assert_eq!(p.table().version(), 1);
        assert_eq!(p.table().get(A).unwrap().nodes.len(), 1);
    }

    #[test]
    fn a_store_recreated_empty_does_not_delete_every_route() {
        let store = MemStore::default();
        store.clone().add_node(A, node(1)).unwrap();
        let mut p = poller(&store);
        let t0 = Instant::now();
        p.poll(t0);
        *store.data.lock().unwrap() = Data::default();
        let mut notes = Vec::new();
        for i in 1..=3 {
            let polled = p.poll(t0 + Duration::from_secs(i));
            assert!(polled.update.is_none());
            notes.extend(polled.notes);
        }
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("a new, empty database?"), "{notes:?}");
        assert_eq!(p.table().len(), 1, "still served");
        assert!(p.status().up);
        // Written to again: the store is trusted again.
        store.clone().add_node(B, node(2)).unwrap();
        let update = p.poll(t0 + Duration::from_secs(20)).update.unwrap();
        assert_eq!(pushed(&update), vec![(A, false, 1), (B, true, 1)]);
    }

    #[test]
    fn the_thread_sends_updates_to_every_executor_and_stops() {
        let store = MemStore::default();
        store.clone().add_node(A, node(1)).unwrap();
        let (tx1, rx1) = super::super::updates::channel();
        let (tx2, rx2) = super::super::updates::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel();
        let (first_tx, first_rx) = std::sync::mpsc::sync_channel(1);
        let board = Arc::new(Board::new(2));
        let b = board.clone();
        let p = poller(&store);
        let t = std::thread::spawn(move || run(p, vec![tx1, tx2], b, stop_rx, first_tx));
        let first = first_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(first.is_ok());
        for rx in [&rx1, &rx2] {
            let u = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert!(u.first_load);
        }
        store.clone().add_node(B, node(2)).unwrap();
        let u = rx1.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(pushed(&u), vec![(B, true, 2)]);
        drop(stop_tx);
        t.join().unwrap();
        assert_eq!(board.store().modules, 2);
    }
}
