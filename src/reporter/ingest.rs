//! The agents' side of the reporter, a thin glommio shell: one executor
//! thread accepts agent connections and metrics requests, moves bytes
//! between each socket and its [`Session`], queues the rows it yields
//! ([`Shared::accept`]) and writes its answers. It decides nothing.
//!
//! One executor serves every connection: the work per report is a decode
//! and a short copy into the buffer, far below what one core does, and a
//! connection costs a task and an 8 KiB read buffer, not a thread. The
//! executor registers [`IO_MEMORY`] of I/O memory (locked memory counts
//! against `ulimit -l`).
//!
//! With `[tls]` on, each connection first makes the TLS handshake; the
//! peer's certificate decides the rows' caller and whether its consumed
//! units are taken ([`Peer::Identified`]). Refused handshakes and refused
//! consumed units are counted and logged once per peer per minute.
//!
//! Nothing here waits for the store: the buffer's mutex is held for a push
//! (never across a database call). An agent's ack waits for the writer
//! that commits its report (acknowledged = in the database), but the
//! connection does not: it goes on reading, and answers each report when
//! the writers settle it (the connection's [`Acks`] doorbell).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener as StdTcpListener};
use std::os::fd::{FromRawFd, IntoRawFd};
use std::pin::pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::{ExecutorJoinHandle, LocalExecutorBuilder, Placement};

use super::notes::Throttle;
use super::session::{Peer, Session};
use super::shared::{unix_ms, Acks, Shared};
use lbagent_model::ModuleId;
use lbagent_service::conn::{race, Either};
use lbagent_service::doorbell::Doorbell;
use lbagent_service::metrics_http;
use lbagent_tls::{PerPeer, Stream, Tls};
use lbagent_wire::{write_frame, Encoder, RetCode};

/// The I/O memory the executor registers.
pub const IO_MEMORY: usize = 256 << 10;

/// Bytes read from a connection at once.
const READ_BUF: usize = 8 << 10;

/// A connection whose answers cannot be written for this long is closed
/// (a peer that does not read its acks).
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a stop waits for connections to close.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// The bounds of agent connections (from `[reporter]`).
#[derive(Clone, Copy, Debug)]
pub(super) struct ConnLimits {
    /// Most agent connections open at once.
    pub(super) max_connections: usize,
    /// How long a connection may go without a complete frame.
    pub(super) idle_timeout: Duration,
    /// How long a frame, once begun, may take to arrive whole.
    pub(super) read_timeout: Duration,
    /// Most bytes of incomplete frames held, every connection together.
    pub(super) max_buffered_bytes: u64,
}

impl ConnLimits {
    /// The bounds `cfg` sets.
    pub(super) fn of(cfg: &lbagent_config::ReporterConfig) -> Self {
        ConnLimits {
            max_connections: cfg.max_connections as usize,
            idle_timeout: Duration::from_secs(cfg.idle_timeout),
            read_timeout: Duration::from_millis(cfg.read_timeout_ms),
            max_buffered_bytes: cfg.max_buffered_bytes,
        }
    }
}

/// At most one log line per this many milliseconds per kind of
/// misbehaviour (bad frames, refused reports, accept errors).
const NOTE_INTERVAL_MS: u64 = 10_000;

/// The running executor.
pub(super) struct Ingest {
    stop: Arc<Doorbell>,
    handle: ExecutorJoinHandle<()>,
}

impl Ingest {
    /// Starts the executor on its own thread, serving agents on `agents`
    /// and `GET /metrics` on `metrics`.
    ///
    /// # Errors
    /// When the executor cannot start (io_uring refused, locked memory).
    pub(super) fn start(
        agents: StdTcpListener,
        metrics: StdTcpListener,
        shared: Arc<Shared>,
        limits: ConnLimits,
        tls: Option<Arc<Tls>>,
    ) -> anyhow::Result<Ingest> {
        let stop = Arc::new(Doorbell::default());
        let flag = stop.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let handle = LocalExecutorBuilder::new(Placement::Unbound)
            .name("lbagent-reporter")
            .io_memory(IO_MEMORY)
            .ring_depth(lbagent_service::conn::RING_DEPTH)
            .spawn(move || async move {
                let _ = ready_tx.send(());
                serve(agents, metrics, shared, flag, limits, tls).await
            })
            .map_err(|e| anyhow!("cannot start the reporter's executor thread: {e}"))?;
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(()) => Ok(Ingest { stop, handle }),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("the reporter's executor did not start within 10 s")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let why = match handle.join() {
                    Err(e) => e.to_string(),
                    Ok(()) => "it ended at once".to_string(),
                };
                bail!(
                    "cannot start the reporter's executor: {why} (it locks {} KiB of I/O memory: check `ulimit -l`)",
                    IO_MEMORY >> 10
                )
            }
        }
    }

    /// Stops accepting, closes every connection, and waits for the thread.
    ///
    /// # Errors
    /// When the executor thread failed.
    pub(super) fn stop(self) -> anyhow::Result<()> {
        self.stop.ring();
        self.handle
            .join()
            .map_err(|e| anyhow!("the reporter's executor failed: {e}"))
    }
}

/// The executor's main task: the acceptors, then the stop and the summary
/// lines of dropped rows, then the shutdown. It sleeps until the stop rings
/// `flag`, a connection says that rows were dropped (`loss`), or the next
/// summary line is due: nothing wakes an idle reporter.
async fn serve(
    agents: StdTcpListener,
    metrics: StdTcpListener,
    shared: Arc<Shared>,
    flag: Arc<Doorbell>,
    limits: ConnLimits,
    tls: Option<Arc<Tls>>,
) {
    let stop = Rc::new(StopSignal::default());
    let loss = Rc::new(Doorbell::default());
    let open = Rc::new(Cell::new(0usize));
    // SAFETY: both are bound, listening TCP sockets whose ownership moves
    // here.
    let (agents, metrics) = unsafe {
        (
            TcpListener::from_raw_fd(agents.into_raw_fd()),
            TcpListener::from_raw_fd(metrics.into_raw_fd()),
        )
    };
    let acceptor = glommio::spawn_local(accept_agents(
        agents,
        shared.clone(),
        stop.clone(),
        loss.clone(),
        open.clone(),
        limits,
        tls,
    ));
    let http = glommio::spawn_local(accept_metrics(metrics, shared.clone(), stop.clone()));
    loop {
        // Rung or due: the summary is looked at again (it logs when due).
        let stopped = match shared.housekeeping() {
            Some(at) => {
                let timer =
                    glommio::timer::sleep(Duration::from_millis(at.saturating_sub(unix_ms())));
                race(flag.rung(), race(timer, loss.rung())).await
            }
            None => match race(flag.rung(), loss.rung()).await {
                Either::Left(()) => Either::Left(()),
                Either::Right(()) => Either::Right(Either::Right(())),
            },
        };
        if let Either::Left(()) = stopped {
            break;
        }
    }
    stop.fire();
    acceptor.await;
    http.await;
    let deadline = Instant::now() + CLOSE_WAIT;
    while open.get() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
}

async fn accept_agents(
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: Rc<StopSignal>,
    loss: Rc<Doorbell>,
    open: Rc<Cell<usize>>,
    limits: ConnLimits,
    tls: Option<Arc<Tls>>,
) {
    let mut errors = Throttle::new(NOTE_INTERVAL_MS);
    let mut refusals = Throttle::new(NOTE_INTERVAL_MS);
    let notes = Rc::new(RefCell::new(ConnNotes::default()));
    let partial = Rc::new(Cell::new(0u64));
    loop {
        let stream = match until_stop(&stop, listener.accept()).await {
            None => return,
            Some(Ok(stream)) => stream,
            Some(Err(e)) => {
                if let Some(hidden) = errors.allow(unix_ms()) {
                    shared.log(&format!(
                        "cannot accept an agent connection: {e} ({hidden} more such errors since the last line); check the open files limit"
                    ));
                }
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if open.get() >= limits.max_connections {
            shared.connections_refused.fetch_add(1, Ordering::Relaxed);
            let message = format!(
                "the reporter holds reporter.max_connections = {} connections: try again later",
                limits.max_connections
            );
            if let Some(hidden) = refusals.allow(unix_ms()) {
                shared.log(&format!(
                    "refused an agent connection: {message} ({hidden} more refused since the last line)"
                ));
            }
            glommio::spawn_local(refuse(stream, message)).detach();
            continue;
        }
        shared.connection_opened();
        open.set(open.get() + 1);
        let (shared, stop, loss, open, notes, partial, tls) = (
            shared.clone(),
            stop.clone(),
            loss.clone(),
            open.clone(),
            notes.clone(),
            partial.clone(),
            tls.clone(),
        );
        glommio::spawn_local(async move {
            let conn = Conn {
                shared: &shared,
                stop: &stop,
                loss: &loss,
                notes: &notes,
                partial: &partial,
                limits,
            };
            if let Some((stream, peer)) = handshake(stream, tls.as_deref(), &conn).await {
                serve_agent(stream, peer, &conn).await;
            }
            open.set(open.get() - 1);
            shared.connection_closed();
        })
        .detach();
    }
}

/// Tells a connection past the bound why it is closed (ErrorResp
/// `Unavailable`), waiting at most 100 ms for the write.
async fn refuse(mut stream: TcpStream, message: String) {
    let mut enc = Encoder::new();
    let resp = enc.error_resp(0, ModuleId::new(0, 0), RetCode::Unavailable, &message);
    let mut frame = Vec::new();
    if write_frame(&mut frame, resp).is_ok() {
        let linger = glommio::timer::sleep(Duration::from_millis(100));
        let _ = race(stream.write_all(&frame), linger).await;
    }
}

/// The throttles of what connections log.
struct ConnNotes {
    bad_frames: Throttle,
    refusals: Throttle,
    /// Refused handshakes, per peer address and reason.
    tls_refused: PerPeer<(IpAddr, String)>,
    /// Refused consumed units, per identity.
    consumed_refused: PerPeer<String>,
}

impl Default for ConnNotes {
    fn default() -> Self {
        ConnNotes {
            bad_frames: Throttle::new(NOTE_INTERVAL_MS),
            refusals: Throttle::new(NOTE_INTERVAL_MS),
            tls_refused: PerPeer::new(lbagent_tls::REFUSAL_LOG_MS),
            consumed_refused: PerPeer::new(lbagent_tls::REFUSAL_LOG_MS),
        }
    }
}

/// What one connection's task shares with the executor.
struct Conn<'a> {
    shared: &'a Shared,
    stop: &'a Rc<StopSignal>,
    loss: &'a Doorbell,
    notes: &'a RefCell<ConnNotes>,
    partial: &'a Cell<u64>,
    limits: ConnLimits,
}

/// Who the peer is once the connection is up: its identity's name (or
/// address) for the log, and what the session makes of it.
struct PeerInfo {
    name: String,
    peer: Peer,
}

/// Sets the socket up and makes the TLS handshake (when `tls` is on);
/// `None` when it was refused (counted, logged once per peer per minute)
/// or the reporter stops.
async fn handshake(
    tcp: TcpStream,
    tls: Option<&Tls>,
    conn: &Conn<'_>,
) -> Option<(Stream, PeerInfo)> {
    let addr = tcp.peer_addr().ok();
    let _ = tcp.set_nodelay(true);
    let _ = tcp.set_write_timeout(Some(WRITE_TIMEOUT));
    let at = addr.map_or_else(|| "an unknown peer".to_string(), |p| p.to_string());
    let stream = match until_stop(conn.stop, lbagent_tls::accept(tls, tcp)).await? {
        Ok(stream) => stream,
        Err(why) => {
            conn.shared.tls_refused.fetch_add(1, Ordering::Relaxed);
            let ip = addr.map_or(IpAddr::from([0, 0, 0, 0]), |a| a.ip());
            let key = (ip, why.clone());
            let said = conn.notes.borrow_mut().tls_refused.allow(&key, unix_ms());
            if let Some(hidden) = said {
                conn.shared.log(&format!(
                    "refused a connection from {at}: {why} ({hidden} more refused from {ip} for this in the last minute)"
                ));
            }
            return None;
        }
    };
    let info = match (stream.identity(), tls) {
        (Some(id), Some(tls)) => PeerInfo {
            name: format!("{} ({at})", id.display_name()),
            peer: Peer::Identified {
                caller: id
                    .ip()
                    .and_then(|ip| ipv4(SocketAddr::new(ip, 0)))
                    .map_or(0, u32::from),
                may_consume: tls.may_consume(id),
            },
        },
        _ => PeerInfo {
            name: at,
            peer: Peer::Plain(addr.and_then(ipv4)),
        },
    };
    Some((stream, info))
}

/// Why a connection was closed by the reporter's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expired {
    /// No complete frame for `reporter.idle_timeout`.
    Idle,
    /// A frame begun and not finished within `reporter.read_timeout_ms`.
    ReadTimeout,
}

/// When a connection that last completed a frame at `last_frame`, and
/// holds an incomplete one begun at `partial_since`, is to be closed, and
/// why. Pure.
fn deadline(
    last_frame: Instant,
    partial_since: Option<Instant>,
    limits: &ConnLimits,
) -> (Instant, Expired) {
    let idle = last_frame + limits.idle_timeout;
    match partial_since {
        Some(t) if t + limits.read_timeout < idle => {
            (t + limits.read_timeout, Expired::ReadTimeout)
        }
        _ => (idle, Expired::Idle),
    }
}

/// Serves one agent until it closes, misbehaves, passes a bound, or the
/// reporter stops. `partial` holds the bytes of incomplete frames of every
/// connection; `loss` is rung when dropped rows wait to be said.
async fn serve_agent(mut stream: Stream, info: PeerInfo, conn: &Conn<'_>) {
    let Conn {
        shared,
        stop,
        loss,
        notes,
        partial,
        limits,
    } = *conn;
    let mut session = Session::with_peer(info.peer);
    let acks = Arc::new(Acks::default());
    let mut settled = Vec::new();
    let mut buf = vec![0u8; READ_BUF];
    let peer = info.name;
    let mut last_frame = Instant::now();
    let mut partial_since: Option<Instant> = None;
    let mut held = 0u64;
    loop {
        let (at, why) = deadline(last_frame, partial_since, &limits);
        let timer = glommio::timer::sleep(at.saturating_duration_since(Instant::now()));
        let woke = race(stream.read(&mut buf), race(timer, acks.bell().rung()));
        let n = match until_stop(stop, woke).await {
            Some(Either::Left(Ok(n))) if n > 0 => n,
            Some(Either::Right(Either::Left(()))) => {
                let counter = match why {
                    Expired::Idle => &shared.idle_closed,
                    Expired::ReadTimeout => &shared.read_timeouts,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                break;
            }
            Some(Either::Right(Either::Right(()))) => {
                // Reports settled: answer them.
                acks.take(&mut settled);
                for (seq, how) in settled.drain(..) {
                    session.settled(seq, how);
                }
                if !session.out().is_empty()
                    && lbagent_tls::send(&mut stream, session.out()).await.is_err()
                {
                    break;
                }
                session.sent();
                continue;
            }
            _ => break,
        };
        let fed = session.feed(&buf[..n]);
        let now = Instant::now();
        if fed.reports + fed.refused > 0 {
            last_frame = now;
        }
        let buffered = session.buffered() as u64;
        partial_since = match (buffered, partial_since) {
            (0, _) => None,
            (_, Some(t)) if fed.reports + fed.refused == 0 => Some(t),
            _ => Some(now),
        };
        let total = partial.get() - held + buffered;
        partial.set(total);
        held = buffered;
        shared.partial_bytes.store(total, Ordering::Relaxed);
        if shared.accept(&session, fed.refused, &acks) {
            loss.ring();
        }
        if fed.consumed_refused > 0 {
            let n = fed.consumed_refused;
            shared.consumed_refused.fetch_add(n, Ordering::Relaxed);
            let said = notes.borrow_mut().consumed_refused.allow(&peer, unix_ms());
            if let Some(hidden) = said {
                shared.log(&format!(
                    "refused {n} consumed-units entries from {peer}: tls.consume_allow does not name it; its call statistics were stored ({hidden} more refusals in the last minute)"
                ));
            }
        }
        if let Some(refusal) = &fed.last_refusal {
            if let Some(hidden) = notes.borrow_mut().refusals.allow(unix_ms()) {
                shared.log(&format!(
                    "refused a report from {peer}: {refusal} ({hidden} more refused since the last line)"
                ));
            }
        }
        // Answers settled meanwhile go out with the refusals (a peer that
        // never stops sending must not starve its acks).
        acks.take(&mut settled);
        for (seq, how) in settled.drain(..) {
            session.settled(seq, how);
        }
        if !session.out().is_empty() && lbagent_tls::send(&mut stream, session.out()).await.is_err()
        {
            break;
        }
        session.consumed();
        if let Some(bad) = fed.bad {
            shared.bad_frame();
            if let Some(hidden) = notes.borrow_mut().bad_frames.allow(unix_ms()) {
                shared.log(&format!(
                    "closed the connection from {peer}: {bad} ({hidden} more closed for bad frames since the last line)"
                ));
            }
            break;
        }
        if total > limits.max_buffered_bytes {
            shared.buffer_full_closed.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
    shared.forget(&acks);
    let total = partial.get() - held;
    partial.set(total);
    shared.partial_bytes.store(total, Ordering::Relaxed);
}

/// The IPv4 address of `peer` (also when IPv4-mapped).
fn ipv4(peer: SocketAddr) -> Option<Ipv4Addr> {
    match peer.ip() {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(ip) => ip.to_ipv4_mapped(),
    }
}

async fn accept_metrics(listener: TcpListener, shared: Arc<Shared>, stop: Rc<StopSignal>) {
    let open = Rc::new(Cell::new(0usize));
    loop {
        match until_stop(&stop, listener.accept()).await {
            None => return,
            Some(Ok(mut stream)) if open.get() >= metrics_http::MAX_CONNECTIONS => {
                shared.http.refused.fetch_add(1, Ordering::Relaxed);
                glommio::spawn_local(async move {
                    let linger = glommio::timer::sleep(Duration::from_millis(100));
                    let _ = race(stream.write_all(metrics_http::BUSY_RESPONSE), linger).await;
                })
                .detach();
            }
            Some(Ok(stream)) => {
                let (shared, open) = (shared.clone(), open.clone());
                open.set(open.get() + 1);
                glommio::spawn_local(async move {
                    let timer = glommio::timer::sleep(metrics_http::REQUEST_TIMEOUT);
                    if let Either::Right(()) = race(serve_metrics(stream, &shared), timer).await {
                        shared.http.timed_out.fetch_add(1, Ordering::Relaxed);
                    }
                    open.set(open.get() - 1);
                })
                .detach();
            }
            Some(Err(_)) => glommio::timer::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Answers one HTTP request: `GET /metrics` gets the text, anything else 404.
async fn serve_metrics(mut stream: TcpStream, shared: &Shared) {
    let mut req = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !metrics_http::head_complete(&req) {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let resp = metrics_http::response(&req, || {
        super::metrics::render(&shared.stats()) + &lbagent_service::reload::metrics_text()
    });
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.close().await;
}

// === impl StopSignal ===

/// A one-shot broadcast within the executor: every [`StopSignal::wait`]
/// completes once [`StopSignal::fire`] is called.
#[derive(Default)]
struct StopSignal {
    fired: Cell<bool>,
    waiters: RefCell<HashMap<u64, Waker>>,
    next_id: Cell<u64>,
}

impl StopSignal {
    fn fire(&self) {
        self.fired.set(true);
        let wakers: Vec<Waker> = self.waiters.borrow_mut().drain().map(|(_, w)| w).collect();
        for w in wakers {
            w.wake();
        }
    }

    /// Completes once fired; registers its waker under its own id, and
    /// removes it when dropped.
    async fn wait(&self) {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let _unregister = Unregister { signal: self, id };
        poll_fn(|cx| {
            if self.fired.get() {
                return Poll::Ready(());
            }
            self.waiters.borrow_mut().insert(id, cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

struct Unregister<'a> {
    signal: &'a StopSignal,
    id: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.signal.waiters.borrow_mut().remove(&self.id);
    }
}

/// `fut`'s output, or `None` once `stop` fires (checked first).
async fn until_stop<F: Future>(stop: &StopSignal, fut: F) -> Option<F::Output> {
    let (mut stopped, mut fut) = (pin!(stop.wait()), pin!(fut));
    poll_fn(|cx| {
        if stopped.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        fut.as_mut().poll(cx).map(Some)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            max_connections: 10,
            idle_timeout: Duration::from_secs(300),
            read_timeout: Duration::from_secs(10),
            max_buffered_bytes: 1 << 20,
        }
    }

    #[test]
    fn a_begun_frame_must_finish_within_the_read_timeout_and_silence_within_the_idle_one() {
        let t0 = Instant::now();
        let l = limits();
        assert_eq!(deadline(t0, None, &l), (t0 + l.idle_timeout, Expired::Idle));
        let begun = t0 + Duration::from_secs(5);
        assert_eq!(
            deadline(t0, Some(begun), &l),
            (begun + l.read_timeout, Expired::ReadTimeout)
        );
        // A frame begun just before the idle deadline: the idle one comes first.
        let late = t0 + Duration::from_secs(299);
        assert_eq!(
            deadline(t0, Some(late), &l),
            (t0 + l.idle_timeout, Expired::Idle)
        );
    }
}
