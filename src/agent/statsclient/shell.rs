//! The statistics client's glommio shell: [`run`] and the status its owner
//! reads, around the sans-IO core.

use super::*;

/// The connection state and counters for metrics, shared between [`run`]
/// and its caller on the same executor (an `Rc`, not `Send`).
#[derive(Clone, Debug, Default)]
pub struct StatsClientStatus {
    inner: Rc<StatusInner>,
}

#[derive(Debug, Default)]
struct StatusInner {
    connected: Cell<Option<SocketAddr>>,
    /// A new address list from a configuration reload, for [`run`] to take.
    new_addrs: RefCell<Option<Vec<SocketAddr>>>,
    stats: Cell<StatsClientStats>,
}

impl StatsClientStatus {
    /// The reporter connected to, if any.
    pub fn connected(&self) -> Option<SocketAddr> {
        self.inner.connected.get()
    }

    /// The counters (sent, acked, dropped, queued, ...), as of the last
    /// I/O. After [`run`] returns, `queued + in_flight` is what the flush
    /// could not deliver.
    pub fn stats(&self) -> StatsClientStats {
        self.inner.stats.get()
    }

    /// Replaces the reporters (a configuration reload): taken at the client's
    /// next wake-up (the next statistics pushed, an ack, or the back-off); a connection up now is
    /// kept until it ends. An empty list is ignored.
    pub fn set_addrs(&self, addrs: Vec<SocketAddr>) {
        if !addrs.is_empty() {
            *self.inner.new_addrs.borrow_mut() = Some(addrs);
        }
    }

    /// Applies a pending reload and publishes the core's state.
    fn sync(&self, core: &mut StatsClientCore) {
        if let Some(addrs) = self.inner.new_addrs.borrow_mut().take() {
            core.set_addrs(addrs);
        }
        self.inner.connected.set(core.link().connected());
        self.inner.stats.set(core.stats());
    }
}

/// One `(module, nodes)` item, as the shards hand them over.
pub type StatsItem = (ModuleId, Vec<NodeCallStats>);

/// Runs the stats client until `shutdown` completes or `events` is closed,
/// then makes one attempt, bounded by
/// [`StatsClientConfig::flush_timeout_ms`], to send what is queued and have
/// it acknowledged.
///
/// Must run inside a glommio `LocalExecutor`. The caller sends statistics
/// on `input` (a closed `input` only stops new statistics) and receives
/// every [`StatsClientEvent`] on `events`; `status` shows the connection and
/// the counters for metrics. Both channels are glommio `local_channel`s: a
/// bounded `events` channel gives back-pressure (the client waits while it
/// is full). Statistics are kept only until acknowledged.
///
/// # Errors
/// [`StatsConfigError`] when `config` is invalid; nothing else: connection
/// failures are reported as events and retried.
pub async fn run(
    config: StatsClientConfig,
    input: LocalReceiver<StatsItem>,
    events: LocalSender<StatsClientEvent>,
    shutdown: impl Future<Output = ()>,
    status: StatsClientStatus,
) -> Result<(), StatsConfigError> {
    let core = StatsClientCore::new(&config)?;
    let sync = {
        let status = status.clone();
        Box::new(move |core: &mut StatsClientCore| status.sync(core))
    };
    let mut shell = LinkShell::new(
        config.tls.clone(),
        core,
        clock::unix_ms(),
        Duration::from_millis(config.connect_timeout_ms),
        Duration::from_millis(config.ack_timeout_ms),
        input,
        events,
        sync,
    );
    let mut stream = shell.run(pin!(shutdown)).await;
    let flush_timeout = Duration::from_millis(shell.core.config.flush_timeout_ms);
    flush(&mut shell, stream.as_mut(), flush_timeout).await;
    shell.publish();
    status.inner.connected.set(None);
    Ok(())
}

type Shell = LinkShell<StatsClientCore, StatsItem>;

/// The one bounded attempt on shutdown: takes what the input holds, then,
/// unless nothing waits, sends everything on `stream` (or on a new
/// connection to the current address) and waits for the acks, all within
/// `flush_timeout`. Events go out only where the channel has room.
async fn flush(shell: &mut Shell, stream: Option<&mut Stream>, flush_timeout: Duration) {
    let deadline = Instant::now() + flush_timeout;
    shell.drain_input().await;
    shell.try_emit_pending();
    shell.publish();
    if shell.core.is_drained() || flush_timeout.is_zero() {
        return;
    }
    let now = shell.now();
    shell.core.start_flush(now);
    let mut connected;
    let stream = match stream {
        Some(stream) => stream,
        None => {
            let Some(addr) = shell.core.poll_connect(shell.now()) else {
                return;
            };
            let timeout = shell.connect_timeout().min(left(deadline));
            match shell.dial(addr, timeout).await {
                Ok(stream) => {
                    shell.set_up();
                    connected = stream;
                    &mut connected
                }
                Err(e) => {
                    let now = shell.now();
                    shell.core.on_disconnected(now);
                    let error = StatsClientError::Io(e);
                    let failed = StatsClientEvent::ConnectFailed { addr, error };
                    let _ = shell.events.try_send(failed);
                    shell.try_emit_pending();
                    shell.publish();
                    return;
                }
            }
        }
    };
    flush_on(shell, stream, deadline).await;
    shell.publish();
}

/// Sends everything and reads acks until drained, the deadline, or an
/// error.
async fn flush_on(shell: &mut Shell, stream: &mut Stream, deadline: Instant) {
    let (mut out, mut buf) = (Vec::new(), vec![0; 16 << 10]);
    loop {
        out.clear();
        let now = shell.now();
        if shell.core.poll_transmit(now, &mut out) > 0 {
            let sleep = glommio::timer::sleep(left(deadline));
            if !matches!(
                race(sleep, lbagent_tls::send(stream, &out)).await,
                Either::Right(Ok(()))
            ) {
                return;
            }
        }
        shell.publish();
        let remaining = left(deadline);
        if shell.core.is_drained() || remaining.is_zero() {
            return;
        }
        let sleep = glommio::timer::sleep(remaining);
        match race(sleep, stream.read(&mut buf)).await {
            Either::Right(Ok(n)) if n > 0 => shell.frames.feed(&buf[..n]),
            _ => return,
        }
        let now = shell.now();
        while let Ok(Some(frame)) = shell.frames.next_frame() {
            match shell.core.on_frame(frame, now) {
                Ok(Some(event)) => {
                    let _ = shell.events.try_send(event);
                }
                Ok(None) => {}
                Err(_) => return,
            }
        }
    }
}
