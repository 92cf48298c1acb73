//! The glommio shell both TCP clients run in: connect (with a timeout) to
//! the address the core names, move bytes between the socket and the core,
//! sleep until the core's next deadline, feed it the caller's input items,
//! and hand its events to the caller. It decides nothing: when to connect,
//! where, what to send and when a connection is dead are the core's
//! ([`LinkCore`]), as the server list and back-off are [`super::reconnect`]'s.
//!
//! The route client ([`super::routeclient`]) and the statistics client
//! ([`super::statsclient`]) each implement [`LinkCore`] for their sans-IO
//! core and call [`LinkShell::run`]; what differs (the statistics client's
//! last flush on shutdown) is theirs, on the connection [`LinkShell::run`]
//! hands back.
//!
//! With `[tls]` on, every connection is mutual TLS ([`lbagent_tls::dial`]:
//! the handshake is part of the connection attempt and shares its
//! timeout); the cores see the same frames either way.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{LocalReceiver, LocalSender};

use super::reconnect::Wake;
use lbagent_service::conn::{self, race, Either, Woken};
use lbagent_tls::{Stream, TlsHandle};
use lbagent_wire::{FrameDecoder, FrameError};

/// A protocol core the shell drives: sans-IO, time passed in (ms).
pub(crate) trait LinkCore {
    /// What the caller hands in (a module to pull, statistics to send).
    type Input;
    /// What the core tells the caller.
    type Event;
    /// Why a connection ends.
    type Error: From<FrameError> + From<io::Error>;

    /// The address to connect to now, if an attempt is due.
    fn poll_connect(&mut self, now: u64) -> Option<SocketAddr>;
    /// The connection is up.
    fn on_connected(&mut self, now: u64);
    /// The connection (or the attempt) ended.
    fn on_disconnected(&mut self, now: u64);
    /// Appends every frame due now to `out`; returns how many.
    fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize;
    /// Handles one frame's payload.
    fn on_frame(&mut self, frame: &[u8], now: u64) -> Result<Option<Self::Event>, Self::Error>;
    /// When to call in again, or [`Wake::Drop`]: the connection is dead.
    fn poll_timeout(&self, now: u64) -> Wake;
    /// Takes one input item.
    fn on_input(&mut self, item: Self::Input, now: u64);
    /// An event the core holds besides frame answers (a drop summary).
    fn poll_event(&mut self) -> Option<Self::Event> {
        None
    }
    /// The error of a connection the core found dead ([`Wake::Drop`]).
    fn timed_out(&self) -> Self::Error;
    /// The error of a connection the peer closed.
    fn closed(&self) -> Self::Error;
    /// The event: connected to `addr`.
    fn connected_event(&self, addr: SocketAddr) -> Self::Event;
    /// The event: an attempt to `addr` failed.
    fn connect_failed_event(&self, addr: SocketAddr, error: Self::Error) -> Self::Event;
    /// The event: the connection to `addr` was lost (built before
    /// [`Self::on_disconnected`], so that it can say what was in flight).
    fn disconnected_event(&self, addr: SocketAddr, error: Self::Error) -> Self::Event;
}

/// Why [`LinkShell::serve`] returned.
enum Stop<E> {
    /// Shutdown requested, or nobody listens to the events any more.
    Shutdown,
    /// The connection failed.
    Failed(E),
}

/// The shell around core `C`, its input of `I` items.
pub(crate) struct LinkShell<C: LinkCore, I> {
    /// The core.
    pub core: C,
    /// The core's clock: `origin_ms` at `clock`, advancing monotonically.
    origin_ms: u64,
    clock: Instant,
    connect_timeout: Duration,
    /// A write that cannot proceed this long fails.
    write_timeout: Duration,
    input: LocalReceiver<I>,
    input_open: bool,
    /// The events out.
    pub events: LocalSender<C::Event>,
    /// Called after every step: publishes the core's state on the
    /// caller's status handle and applies a configuration the caller
    /// replaced there (a reload), so a new one takes effect at the next
    /// wake-up at the latest.
    sync: Box<dyn Fn(&mut C)>,
    /// The current connection's frames.
    pub frames: FrameDecoder,
    /// TLS for every connection, or plain TCP.
    tls: TlsHandle,
}

impl<C: LinkCore, I: Into<C::Input>> LinkShell<C, I> {
    /// A shell for `core`, its clock reading `origin_ms` now; its
    /// connections use `tls` (plain TCP when it is off).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tls: TlsHandle,
        core: C,
        origin_ms: u64,
        connect_timeout: Duration,
        write_timeout: Duration,
        input: LocalReceiver<I>,
        events: LocalSender<C::Event>,
        sync: Box<dyn Fn(&mut C)>,
    ) -> Self {
        LinkShell {
            core,
            origin_ms,
            clock: Instant::now(),
            connect_timeout,
            write_timeout,
            input,
            input_open: true,
            events,
            sync,
            frames: FrameDecoder::default(),
            tls,
        }
    }

    /// The core's time now, ms.
    pub fn now(&self) -> u64 {
        self.origin_ms
            .saturating_add(self.clock.elapsed().as_millis() as u64)
    }

    /// Syncs with the status handle (see `sync`).
    pub fn publish(&mut self) {
        (self.sync)(&mut self.core);
    }

    /// How long one connection attempt may take.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Connects to `addr` (the TLS handshake included) within `timeout`.
    pub async fn dial(&self, addr: SocketAddr, timeout: Duration) -> io::Result<Stream> {
        lbagent_tls::dial(self.tls.get(), addr, timeout, self.write_timeout).await
    }

    /// Connects, serves and reconnects until `shutdown` completes or the
    /// events channel closes. Returns the connection that was up at
    /// shutdown, if any (for a last flush).
    pub async fn run(
        &mut self,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Option<Stream> {
        loop {
            let Some(addr) = self.core.poll_connect(self.now()) else {
                let woken = self.wait(shutdown.as_mut(), None).await;
                if matches!(woken, Woken::Shutdown) || !self.on_woken(woken).await {
                    return None;
                }
                continue;
            };
            let connect = self.dial(addr, self.connect_timeout);
            let mut stream = match race(shutdown.as_mut(), connect).await {
                Either::Left(()) => return None,
                Either::Right(Ok(stream)) => stream,
                Either::Right(Err(e)) => {
                    self.core.on_disconnected(self.now());
                    self.publish();
                    let error = C::Error::from(e);
                    let failed = self.core.connect_failed_event(addr, error);
                    if !self.emit(failed).await || !self.emit_pending().await {
                        return None;
                    }
                    continue;
                }
            };
            self.set_up();
            let stop = if self.emit(self.core.connected_event(addr)).await {
                self.serve(&mut stream, shutdown.as_mut()).await
            } else {
                Stop::Shutdown
            };
            let error = match stop {
                Stop::Shutdown => return Some(stream),
                Stop::Failed(error) => error,
            };
            let lost = self.core.disconnected_event(addr, error);
            self.core.on_disconnected(self.now());
            self.publish();
            if !self.emit(lost).await || !self.emit_pending().await {
                return None;
            }
        }
    }

    /// A new connection is up ([`Self::dial`] set its socket up): tells
    /// the core.
    pub fn set_up(&mut self) {
        self.frames = FrameDecoder::default();
        self.core.on_connected(self.now());
        self.publish();
    }

    /// Moves frames between `stream` and the core until the connection
    /// fails or shutdown.
    async fn serve(
        &mut self,
        stream: &mut Stream,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Stop<C::Error> {
        let mut out = Vec::new();
        let mut buf = vec![0; 16 << 10];
        loop {
            self.drain_input().await;
            if !self.emit_pending().await {
                return Stop::Shutdown;
            }
            out.clear();
            if self.core.poll_transmit(self.now(), &mut out) > 0 {
                if let Err(e) = lbagent_tls::send(stream, &out).await {
                    return Stop::Failed(e.into());
                }
                self.publish();
            }
            if self.core.poll_timeout(self.now()) == Wake::Drop {
                return Stop::Failed(self.core.timed_out());
            }
            let woken = self
                .wait(shutdown.as_mut(), Some((&mut *stream, &mut buf)))
                .await;
            match woken {
                Woken::Shutdown => return Stop::Shutdown,
                Woken::Read(Ok(0)) => return Stop::Failed(self.core.closed()),
                Woken::Read(Ok(n)) => self.frames.feed(&buf[..n]),
                Woken::Read(Err(e)) => return Stop::Failed(e.into()),
                woken => {
                    if !self.on_woken(woken).await {
                        return Stop::Shutdown;
                    }
                    continue;
                }
            }
            let result = self.deliver().await;
            self.publish();
            match result {
                Ok(true) => {}
                Ok(false) => return Stop::Shutdown,
                Err(e) => return Stop::Failed(e),
            }
        }
    }

    /// Feeds every complete frame to the core and emits its events; false
    /// when the events channel is closed.
    async fn deliver(&mut self) -> Result<bool, C::Error> {
        let now = self.now();
        while let Some(frame) = self.frames.next_frame()? {
            if let Some(event) = self.core.on_frame(frame, now)? {
                if !self.emit(event).await {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Waits for shutdown, an input item, bytes read from `stream` into its
    /// buffer, or the core's deadline.
    async fn wait(
        &mut self,
        shutdown: Pin<&mut impl Future<Output = ()>>,
        stream: Option<(&mut Stream, &mut [u8])>,
    ) -> Woken<I> {
        let now = self.now();
        let deadline = match self.core.poll_timeout(now) {
            Wake::At(at) => Some(Duration::from_millis(at.saturating_sub(now))),
            Wake::Drop => Some(Duration::ZERO),
            Wake::Never => None,
        };
        let input = self.input_open.then_some(&self.input);
        conn::wait(shutdown, input, stream, deadline).await
    }

    /// Takes an input item (and every other one already queued, so that
    /// they share frames); false when the events channel is closed.
    async fn on_woken(&mut self, woken: Woken<I>) -> bool {
        if let Woken::Input(item) = woken {
            self.on_input(item);
            self.drain_input().await;
        }
        self.publish();
        self.emit_pending().await
    }

    fn on_input(&mut self, item: Option<I>) {
        match item {
            Some(item) => {
                let now = self.now();
                self.core.on_input(item.into(), now);
            }
            None => self.input_open = false,
        }
    }

    /// Takes every item already queued on the input, without waiting.
    pub async fn drain_input(&mut self) {
        while self.input_open {
            match conn::try_recv(&self.input).await {
                Some(item) => self.on_input(item),
                None => return,
            }
        }
    }

    /// Emits the core's pending event, if any; false when the receiver is
    /// gone.
    async fn emit_pending(&mut self) -> bool {
        match self.core.poll_event() {
            Some(event) => self.emit(event).await,
            None => true,
        }
    }

    /// Emits the core's pending event where the channel has room.
    pub fn try_emit_pending(&mut self) {
        if let Some(event) = self.core.poll_event() {
            let _ = self.events.try_send(event);
        }
    }

    /// Sends `event`; false when the receiver is gone.
    async fn emit(&self, event: C::Event) -> bool {
        self.events.send(event).await.is_ok()
    }
}
