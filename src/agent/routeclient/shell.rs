//! The route client's glommio shell: [`run`] and the status its owner
//! reads, around the sans-IO core.

use super::*;

/// What the caller asks of [`run`] over its `wants` channel. A bare
/// [`ModuleId`] is a pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Pull this module and follow it ([`RouteClientCore::want`]).
    Pull(ModuleId),
    /// Stop following it ([`RouteClientCore::forget`]).
    Forget(ModuleId),
}

impl From<ModuleId> for Want {
    fn from(module: ModuleId) -> Want {
        Want::Pull(module)
    }
}

/// The connection state for metrics, shared between [`run`] and its
/// caller on the same executor (an `Rc`, not `Send`).
#[derive(Clone, Debug, Default)]
pub struct RouteClientStatus {
    inner: Rc<StatusInner>,
}

#[derive(Debug, Default)]
struct StatusInner {
    connected: Cell<Option<SocketAddr>>,
    /// A new address list from a configuration reload, for [`run`] to take.
    new_addrs: RefCell<Option<Vec<SocketAddr>>>,
    stats: Cell<RouteClientStats>,
    /// A re-pull period to apply at the client's next step.
    new_refresh: Cell<Option<u64>>,
}

impl RouteClientStatus {
    /// The route server connected to, if any.
    pub fn connected(&self) -> Option<SocketAddr> {
        self.inner.connected.get()
    }

    /// The counters, as of the last I/O.
    pub fn stats(&self) -> RouteClientStats {
        self.inner.stats.get()
    }

    /// Replaces the route servers (a configuration reload): taken at the client's
    /// next wake-up (at most `keepalive_ms` while connected, the back-off while not); a connection up now is
    /// kept until it ends. An empty list is ignored.
    pub fn set_addrs(&self, addrs: Vec<SocketAddr>) {
        if !addrs.is_empty() {
            *self.inner.new_addrs.borrow_mut() = Some(addrs);
        }
    }

    /// Sets the re-pull period (a reload of `lb.update_timeout`): from each
    /// module's next scheduling on (0: no more re-pulls).
    pub fn set_refresh_ms(&self, refresh_ms: u64) {
        self.inner.new_refresh.set(Some(refresh_ms));
    }

    /// Applies a pending reload and publishes the core's state.
    fn sync(&self, core: &mut RouteClientCore) {
        if let Some(addrs) = self.inner.new_addrs.borrow_mut().take() {
            core.set_addrs(addrs);
        }
        if let Some(refresh_ms) = self.inner.new_refresh.take() {
            core.config.refresh_ms = refresh_ms;
        }
        self.inner.connected.set(core.link().connected());
        self.inner.stats.set(core.stats());
    }
}

/// Runs the route client until `shutdown` completes or `events` is closed.
///
/// Must run inside a glommio `LocalExecutor`. The caller sends the modules
/// it needs on `wants` (deduplicated here; a closed `wants` only stops new
/// pulls) and receives every [`RouteClientEvent`] on `events`; `status`
/// shows the connection for metrics. Both channels are glommio
/// `local_channel`s: the client and the rest of the control core share one
/// executor, so a same-thread channel costs no atomics, and a bounded
/// `events` channel gives back-pressure (the client stops reading from the
/// socket while it is full). Routes are only delivered, never kept.
///
/// # Errors
/// [`RouteConfigError`] when `config` is invalid; nothing else: connection
/// failures are reported as events and retried.
pub async fn run<W: Into<Want>>(
    config: RouteClientConfig,
    wants: LocalReceiver<W>,
    events: LocalSender<RouteClientEvent>,
    shutdown: impl Future<Output = ()>,
    status: RouteClientStatus,
) -> Result<(), RouteConfigError> {
    let core = RouteClientCore::new(&config)?;
    let sync = {
        let status = status.clone();
        Box::new(move |core: &mut RouteClientCore| status.sync(core))
    };
    let mut shell = LinkShell::new(
        config.tls.clone(),
        core,
        0,
        Duration::from_millis(config.connect_timeout_ms),
        Duration::from_millis(config.idle_timeout_ms),
        wants,
        events,
        sync,
    );
    shell.run(pin!(shutdown)).await;
    status.inner.connected.set(None);
    Ok(())
}
