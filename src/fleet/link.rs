//! One TCP link of a simulated agent, driven through one of the agent's
//! sans-IO protocol cores ([`RouteClientCore`] or [`StatsClientCore`]):
//! the same calls in the same order as the agent's own glommio shell
//! (`link_shell`), on tokio. The link decides nothing; the core decides,
//! a [`Hooks`] records events and feeds input on its own schedule.
//!
//! Why tokio and not glommio here: thousands of links on one thread, each
//! a small task; glommio's io_uring rings need registered memory per
//! executor (the host's `ulimit -l` is 8 MiB) and gain nothing at a few
//! bytes per link and second.

use std::net::SocketAddr;
use std::time::Duration;

use lbagent_agent::reconnect::Wake;
use lbagent_agent::routeclient::{RouteClientCore, RouteClientEvent};
use lbagent_agent::statsclient::{StatsClientCore, StatsClientEvent};
use lbagent_wire::{FrameDecoder, MAX_FRAME_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{sleep_until, timeout};

use crate::clock::Clock;

/// Where the simulator stands: links run, then the statistics links drain
/// (no new statistics, every report acknowledged), then everything stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Links run and statistics are pushed.
    Run,
    /// No new statistics; links end once their core has nothing to send.
    Drain,
    /// Every link ends now.
    Stop,
}

/// The calls a link makes on its core: the agent's `LinkCore`, which is
/// private to the agent's crate, as the two cores' public methods.
pub trait Core {
    /// What a frame may produce.
    type Event;
    /// See [`RouteClientCore::poll_connect`].
    fn poll_connect(&mut self, now: u64) -> Option<SocketAddr>;
    /// See [`RouteClientCore::on_connected`].
    fn on_connected(&mut self, now: u64);
    /// See [`RouteClientCore::on_disconnected`].
    fn on_disconnected(&mut self, now: u64);
    /// See [`RouteClientCore::poll_transmit`].
    fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize;
    /// See [`RouteClientCore::on_frame`]; an error closes the link.
    fn on_frame(&mut self, frame: &[u8], now: u64) -> Result<Option<Self::Event>, String>;
    /// See [`RouteClientCore::poll_timeout`].
    fn poll_timeout(&self, now: u64) -> Wake;
}

impl Core for RouteClientCore {
    type Event = RouteClientEvent;
    fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        RouteClientCore::poll_connect(self, now)
    }
    fn on_connected(&mut self, now: u64) {
        RouteClientCore::on_connected(self, now)
    }
    fn on_disconnected(&mut self, now: u64) {
        RouteClientCore::on_disconnected(self, now)
    }
    fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize {
        RouteClientCore::poll_transmit(self, now, out)
    }
    fn on_frame(&mut self, frame: &[u8], now: u64) -> Result<Option<Self::Event>, String> {
        RouteClientCore::on_frame(self, frame, now).map_err(|e| e.to_string())
    }
    fn poll_timeout(&self, now: u64) -> Wake {
        RouteClientCore::poll_timeout(self, now)
    }
}

impl Core for StatsClientCore {
    type Event = StatsClientEvent;
    fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        StatsClientCore::poll_connect(self, now)
    }
    fn on_connected(&mut self, now: u64) {
        StatsClientCore::on_connected(self, now)
    }
    fn on_disconnected(&mut self, now: u64) {
        StatsClientCore::on_disconnected(self, now)
    }
    fn poll_transmit(&mut self, now: u64, out: &mut Vec<u8>) -> usize {
        StatsClientCore::poll_transmit(self, now, out)
    }
    fn on_frame(&mut self, frame: &[u8], now: u64) -> Result<Option<Self::Event>, String> {
        StatsClientCore::on_frame(self, frame, now).map_err(|e| e.to_string())
    }
    fn poll_timeout(&self, now: u64) -> Wake {
        StatsClientCore::poll_timeout(self, now)
    }
}

/// What a link's owner does around the core.
pub trait Hooks<C: Core> {
    /// An event the core returned for a frame received at `now`.
    fn on_event(&mut self, event: C::Event, now: u64);
    /// When [`Hooks::tick`] is next due (None: never).
    fn next_tick(&self, phase: Phase) -> Option<u64>;
    /// Feeds the core its input at `now` (called once the tick is due).
    fn tick(&mut self, core: &mut C, now: u64);
    /// Whether the link may end in `phase`.
    fn finished(&self, core: &C, phase: Phase) -> bool;
    /// The link came up at `now`.
    fn on_connected(&mut self, _now: u64) {}
    /// The link ends: the core as it stands at that moment (still
    /// connected, if it was).
    fn on_end(&mut self, _core: &C) {}
}

/// How long a connection attempt and a blocked write may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const WRITE_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest sleep with no deadline (a phase change also wakes).
const IDLE_WAKE_MS: u64 = 1000;

/// Runs one link until `hooks` says it is finished.
pub async fn drive<C: Core, H: Hooks<C>>(
    core: &mut C,
    hooks: &mut H,
    clock: Clock,
    mut phase: watch::Receiver<Phase>,
) {
    loop {
        let now = clock.now_ms();
        let p = *phase.borrow();
        if hooks.finished(core, p) {
            hooks.on_end(core);
            return;
        }
        run_due_tick(core, hooks, now, p);
        if let Some(addr) = core.poll_connect(now) {
            match timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    core.on_connected(clock.now_ms());
                    hooks.on_connected(clock.now_ms());
                    if session(core, hooks, clock, &mut phase, stream).await {
                        hooks.on_end(core);
                        return;
                    }
                    core.on_disconnected(clock.now_ms());
                }
                _ => core.on_disconnected(clock.now_ms()),
            }
            continue;
        }
        let wake = match core.poll_timeout(now) {
            Wake::At(t) => t,
            Wake::Drop | Wake::Never => now + IDLE_WAKE_MS,
        };
        let wake = wake.min(hooks.next_tick(p).unwrap_or(u64::MAX));
        tokio::select! {
            _ = sleep_until(clock.instant_at(wake).into()) => {}
            r = phase.changed() => if r.is_err() { return },
        }
    }
}

fn run_due_tick<C: Core, H: Hooks<C>>(core: &mut C, hooks: &mut H, now: u64, p: Phase) {
    if hooks.next_tick(p).is_some_and(|t| t <= now) {
        hooks.tick(core, now);
    }
}

/// One connection, until it ends (closed, refused frame, dead by the
/// core's deadline: false) or the link is finished (true).
async fn session<C: Core, H: Hooks<C>>(
    core: &mut C,
    hooks: &mut H,
    clock: Clock,
    phase: &mut watch::Receiver<Phase>,
    stream: TcpStream,
) -> bool {
    let (mut rd, mut wr) = stream.into_split();
    let mut buf = vec![0u8; 16 << 10];
    let mut out = Vec::new();
    let mut frames = FrameDecoder::new(MAX_FRAME_LEN);
    loop {
        let now = clock.now_ms();
        let p = *phase.borrow();
        if hooks.finished(core, p) {
            return true;
        }
        run_due_tick(core, hooks, now, p);
        out.clear();
        core.poll_transmit(now, &mut out);
        if !out.is_empty()
            && !matches!(timeout(WRITE_TIMEOUT, wr.write_all(&out)).await, Ok(Ok(())))
        {
            return false;
        }
        let wake = match core.poll_timeout(now) {
            Wake::Drop => return false,
            Wake::At(t) => t,
            Wake::Never => now + IDLE_WAKE_MS,
        };
        let wake = wake.min(hooks.next_tick(p).unwrap_or(u64::MAX));
        tokio::select! {
            r = rd.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => n,
                };
                frames.feed(&buf[..n]);
                let now = clock.now_ms();
                loop {
                    match frames.next_frame() {
                        Ok(Some(frame)) => match core.on_frame(frame, now) {
                            Ok(Some(event)) => hooks.on_event(event, now),
                            Ok(None) => {}
                            Err(_) => return false,
                        },
                        Ok(None) => break,
                        Err(_) => return false,
                    }
                }
            }
            _ = sleep_until(clock.instant_at(wake).into()) => {}
            r = phase.changed() => if r.is_err() { return true },
        }
    }
}
