//! One serving executor: the glommio shell around [`Session`] and
//! [`Registry`].
//!
//! Each executor accepts on its own handle of the server's one listening
//! socket (the kernel gives each connection to one of them), runs one task per connection, one task
//! that installs new tables and queues their pushes as soon as the store
//! thread sends them (it rings the channel's doorbell), and one tick task:
//! the low-precision timer that expires silent connections, publishes the
//! counters and hears the stop (a doorbell [`super::DnsServer::stop`]
//! rings). The tick runs only when something is due ([`next_tick`]):
//! within [`TICK`] of a change to the counters, and at the earliest instant
//! a connection can have been silent too long; an executor with nothing to
//! publish and no connection sleeps until a connection, an update or the
//! stop wakes it. Everything on the executor is single-threaded; the only
//! things that cross threads are the update channel from the store thread,
//! the stop's doorbell and the published counters.
//!
//! A connection task reads whatever the socket has, lets its session
//! answer every complete frame into one buffer, and writes that buffer in
//! one write before reading again (a peer that does not read stops being
//! read: TCP back-pressure, no unbounded buffer). Pushes are appended to
//! the connection's pending bytes by the tick and wake the task; a peer
//! that leaves more than [`MAX_PENDING`] bytes of pushes unread is closed.
//!
//! With `[tls]` on, a connection's task first makes the TLS handshake
//! ([`lbagent_tls::accept`]); a refused one (plain TCP, a certificate
//! expired, of another CA, of a name outside `tls.peer_names`) is counted
//! and logged, once per peer address and reason per minute.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::net::TcpListener as StdTcpListener;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::mpsc::TryRecvError;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use lbagent_tls::{PerPeer, Stream, Tls};

use super::metrics::{Board, Counters};
use super::reload::Update;
use super::session::{CloseReason, Ctx, Session};
use super::subs::{Budget, ConnId, Registry};
use super::table::RouteTable;
use super::updates::{Doorbell, UpdateReceiver};
use lbagent_model::ModuleId;
use lbagent_service::conn::{race, Either};
use lbagent_wire::{write_frame, Encoder, RetCode};

/// The tick: how soon after a change an executor publishes its counters
/// (updates are installed when they come; nothing is ticked while nothing
/// changes).
pub const TICK: Duration = Duration::from_millis(25);

/// Bytes one read may take from a socket.
const READ_BUF: usize = 16 << 10;

/// Pushes queued for one connection beyond this many bytes close it.
pub const MAX_PENDING: usize = 16 << 20;

/// An output buffer grown past this is given back after its write.
const KEEP_OUT: usize = 256 << 10;

/// How long a stopping executor waits for its connections to close.
const DRAIN: Duration = Duration::from_secs(2);

/// What an executor needs, moved into its thread.
pub struct ExecParts {
    /// Its index (for metrics).
    pub index: usize,
    /// Its listener, bound and listening (non-blocking).
    pub listener: StdTcpListener,
    /// New tables from the store thread.
    pub updates: UpdateReceiver,
    /// Where it publishes its counters.
    pub board: Arc<Board>,
    /// Rung when the route server stops.
    pub stop: Arc<Doorbell>,
    /// Milliseconds of silence after which a connection is closed.
    pub idle_timeout_ms: u64,
    /// Most modules one connection may subscribe to.
    pub max_subscriptions_per_connection: usize,
    /// Subscriptions across every executor.
    pub subscriptions: Arc<Budget>,
    /// Connections open across every executor.
    pub connections: Arc<Budget>,
    /// Mutual TLS, or plain TCP.
    pub tls: Option<Arc<Tls>>,
}

/// What the tick and the connection tasks share on one executor.
struct Exec {
    table: Arc<RouteTable>,
    registry: Registry<Rc<Conn>>,
    enc: Encoder,
    counters: Counters,
    /// When the executor started: the origin of its milliseconds.
    t0: Instant,
    /// Milliseconds since `t0`, as of the last tick or read.
    now: u64,
    /// The tick's waker while it waits for something to happen (not for a
    /// deadline within [`TICK`]): any change wakes it through [`Exec::poke`].
    tick_waker: Option<Waker>,
    /// Set by a poke that woke the tick.
    poked: bool,
    /// Refused handshakes, logged once per peer address and reason per
    /// minute.
    refusals: PerPeer<(std::net::IpAddr, String)>,
}

impl Exec {
    /// Milliseconds since the executor started, now (also kept in `now`).
    fn clock(&mut self) -> u64 {
        self.now = self.t0.elapsed().as_millis() as u64;
        self.now
    }

    /// Something changed (a connection, a frame, a table): a tick waiting
    /// for something to happen wakes to plan its next deadline. Costs an
    /// `Option::take` when the tick is not waiting so.
    fn poke(&mut self) {
        if let Some(w) = self.tick_waker.take() {
            self.poked = true;
            w.wake();
        }
    }

    /// The counters as [`publish`] would publish them now.
    fn snapshot(&self) -> Counters {
        let mut c = self.counters;
        c.connections = self.registry.connections() as u64;
        c.subscriptions = self.registry.subscriptions() as u64;
        c
    }
}

/// When the tick next has work, in the executor's milliseconds, or `None`
/// when nothing is due until something happens: within `tick_ms` of `now`
/// while the executor is `busy` (its counters changed since they were
/// published, or in the tick before), and at `next_check` (`u64::MAX`: no
/// connection) for the idle supervisor. Pure.
pub fn next_tick(now: u64, busy: bool, next_check: u64, tick_ms: u64) -> Option<u64> {
    let publish = busy.then(|| now.saturating_add(tick_ms));
    let expire = (next_check != u64::MAX).then_some(next_check);
    match (publish, expire) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What ended one wait of the tick.
enum TickWake {
    /// The route server stops.
    Stop,
    /// The planned deadline came.
    Due,
    /// Something changed: plan again.
    Poked,
}

/// What the executor holds of one connection: the way to reach its task.
#[derive(Default)]
struct Conn {
    /// Framed pushes not yet written.
    pending: RefCell<Vec<u8>>,
    /// Set when the executor closes the connection (idle, slow, stopping).
    close: RefCell<Option<CloseReason>>,
    waker: Cell<Option<Waker>>,
}

impl Conn {
    fn wake(&self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    fn close(&self, reason: CloseReason) {
        self.close.borrow_mut().get_or_insert(reason);
        self.wake();
    }

    /// Ready when there are pushes to write or a close to obey.
    async fn kicked(&self) {
        poll_fn(|cx| {
            if self.close.borrow().is_some() || !self.pending.borrow().is_empty() {
                return Poll::Ready(());
            }
            self.waker.set(Some(cx.waker().clone()));
            Poll::Pending
        })
        .await
    }

    /// Ready with the reason once the executor closes the connection.
    async fn closed(&self) -> CloseReason {
        poll_fn(|cx| match self.close.borrow_mut().take() {
            Some(reason) => Poll::Ready(reason),
            None => {
                self.waker.set(Some(cx.waker().clone()));
                Poll::Pending
            }
        })
        .await
    }
}

/// Runs one executor until its stop doorbell rings, then closes its
/// connections (waiting up to 2 s for them) and returns.
pub async fn run(parts: ExecParts) {
    let ExecParts {
        index,
        listener,
        updates,
        board,
        stop,
        idle_timeout_ms,
        max_subscriptions_per_connection,
        subscriptions,
        connections,
        tls,
    } = parts;
    let t0 = Instant::now();
    let exec = Rc::new(RefCell::new(Exec {
        table: Arc::new(RouteTable::unloaded()),
        registry: Registry::with_budget(
            idle_timeout_ms,
            max_subscriptions_per_connection,
            subscriptions,
        ),
        enc: Encoder::new(),
        counters: Counters::default(),
        t0,
        now: 0,
        tick_waker: None,
        poked: false,
        refusals: PerPeer::new(lbagent_tls::REFUSAL_LOG_MS),
    }));
    // Serve the table the store thread already loaded from the first
    // connection on.
    drain_updates(&exec, &updates);
    // SAFETY: a bound, listening, non-blocking TCP socket that we own.
    let listener = unsafe { TcpListener::from_raw_fd(listener.into_raw_fd()) };
    let acceptor = glommio::spawn_local(accept_loop(listener, exec.clone(), connections, tls));
    // New tables are installed (and their pushes queued) as they come:
    // the store thread rings when it sends. Ends when the store thread does.
    let installer = {
        let exec = exec.clone();
        glommio::spawn_local(async move {
            loop {
                updates.sent().await;
                if !drain_updates(&exec, &updates) {
                    return;
                }
            }
        })
    };

    let mut expired = Vec::new();
    let tick_ms = TICK.as_millis() as u64;
    let mut published = publish(&exec, &board, index);
    // Whether the last tick published a change: the executor ticks once
    // more before it waits for pokes, so that under steady traffic the
    // tick is a plain 25 ms timer, as it always was, with no poke to wake it.
    let mut active = false;
    loop {
        let (now, at) = {
            let mut ex = exec.borrow_mut();
            let now = ex.clock();
            let busy = active || ex.snapshot() != published;
            (now, next_tick(now, busy, ex.registry.next_check(), tick_ms))
        };
        // A wait for the tick's own deadline needs no pokes.
        let woke = match at {
            Some(at) if at <= now.saturating_add(tick_ms) => {
                let timer = glommio::timer::sleep(Duration::from_millis(at.saturating_sub(now)));
                match race(stop.rung(), timer).await {
                    Either::Left(()) => TickWake::Stop,
                    Either::Right(()) => TickWake::Due,
                }
            }
            Some(at) => {
                let timer = glommio::timer::sleep(Duration::from_millis(at.saturating_sub(now)));
                let woke = match race(stop.rung(), race(timer, poked(&exec))).await {
                    Either::Left(()) => TickWake::Stop,
                    Either::Right(Either::Left(())) => TickWake::Due,
                    Either::Right(Either::Right(())) => TickWake::Poked,
                };
                exec.borrow_mut().tick_waker = None;
                woke
            }
            None => {
                let woke = match race(stop.rung(), poked(&exec)).await {
                    Either::Left(()) => TickWake::Stop,
                    Either::Right(()) => TickWake::Poked,
                };
                exec.borrow_mut().tick_waker = None;
                woke
            }
        };
        match woke {
            TickWake::Stop => break,
            TickWake::Poked => continue,
            TickWake::Due => {
                exec.borrow_mut().clock();
                expire(&exec, &mut expired);
                let now_published = publish(&exec, &board, index);
                active = now_published != published;
                published = now_published;
            }
        }
    }

    drop(acceptor);
    drop(installer);
    shut_down(&exec).await;
    publish(&exec, &board, index);
}

/// Ready once [`Exec::poke`] woke the tick (registers the tick's waker).
async fn poked(exec: &RefCell<Exec>) {
    poll_fn(|cx| {
        let mut ex = exec.borrow_mut();
        if std::mem::take(&mut ex.poked) {
            return Poll::Ready(());
        }
        ex.tick_waker = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

/// Installs every update waiting on the channel and queues its pushes.
/// Returns false once the channel is closed (the store thread ended).
fn drain_updates(exec: &Rc<RefCell<Exec>>, updates: &UpdateReceiver) -> bool {
    loop {
        match updates.try_recv() {
            Ok(update) => {
                let mut ex = exec.borrow_mut();
                install(&mut ex, &update);
                ex.poke();
            }
            Err(TryRecvError::Empty) => return true,
            Err(TryRecvError::Disconnected) => return false,
        }
    }
}

/// Makes `update`'s table the one served and queues its pushes.
fn install(ex: &mut Exec, update: &Update) {
    ex.table = update.table.clone();
    let mut slow = Vec::new();
    if update.first_load {
        // Every pull held so far is answered now, by a push.
        let mut frame = Vec::new();
        let conns: Vec<(ConnId, Rc<Conn>)> = ex
            .registry
            .open_conns()
            .map(|(id, c)| (id, c.clone()))
            .collect();
        for (id, conn) in conns {
            for module in ex.registry.subscriptions_of(id) {
                frame.clear();
                let bytes = match ex.table.get(module) {
                    Some(entry) => &entry.push_frame()[..],
                    None => {
                        let push = ex.enc.route_push(module, false, 0, &[]);
                        write_frame(&mut frame, push).expect("an empty RoutePush fits a frame");
                        &frame[..]
                    }
                };
                if queue(&conn, bytes) {
                    ex.counters.pushes += 1;
                } else {
                    slow.push(id);
                }
            }
            conn.wake();
        }
    } else {
        for change in &update.changes {
            for (id, conn) in ex.registry.subscribers(change.module) {
                if queue(conn, &change.push) {
                    ex.counters.pushes += 1;
                } else {
                    slow.push(id);
                }
                conn.wake();
            }
        }
    }
    slow.sort_unstable();
    slow.dedup();
    for id in slow {
        if ex.registry.condemn(id) {
            if let Some(conn) = ex.registry.value(id) {
                conn.close(CloseReason::SlowReader);
            }
        }
    }
}

/// Appends `frame` to `conn`'s pending pushes; false when that passes
/// [`MAX_PENDING`] (the connection must close).
fn queue(conn: &Conn, frame: &[u8]) -> bool {
    let mut pending = conn.pending.borrow_mut();
    if pending.len() + frame.len() > MAX_PENDING {
        return false;
    }
    pending.extend_from_slice(frame);
    true
}

/// The supervisor's tick: closes the connections silent too long.
fn expire(exec: &Rc<RefCell<Exec>>, expired: &mut Vec<ConnId>) {
    let mut ex = exec.borrow_mut();
    let now = ex.now;
    expired.clear();
    if ex.registry.expire(now, expired) == 0 {
        return;
    }
    for &id in expired.iter() {
        if let Some(conn) = ex.registry.value(id) {
            conn.close(CloseReason::Idle);
        }
    }
}

/// Publishes the executor's counters on `board`; returns what it published.
fn publish(exec: &Rc<RefCell<Exec>>, board: &Board, index: usize) -> Counters {
    let mut ex = exec.borrow_mut();
    let c = ex.snapshot();
    ex.counters = c;
    board.publish(index, &c);
    c
}

/// Closes every connection and waits (up to [`DRAIN`]) for their tasks.
async fn shut_down(exec: &Rc<RefCell<Exec>>) {
    {
        let mut ex = exec.borrow_mut();
        let ids: Vec<ConnId> = ex.registry.open_conns().map(|(id, _)| id).collect();
        for id in ids {
            ex.registry.condemn(id);
            if let Some(conn) = ex.registry.value(id) {
                conn.close(CloseReason::Shutdown);
            }
        }
    }
    let deadline = Instant::now() + DRAIN;
    while exec.borrow().registry.slots_in_use() > 0 && Instant::now() < deadline {
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    exec: Rc<RefCell<Exec>>,
    connections: Arc<Budget>,
    tls: Option<Arc<Tls>>,
) {
    let mut last_error_log: Option<Instant> = None;
    loop {
        match listener.accept().await {
            Ok(stream) if !connections.try_take() => {
                {
                    let mut ex = exec.borrow_mut();
                    ex.counters.connections_refused += 1;
                    ex.poke();
                }
                let message = format!(
                    "the route server holds dnsserver.max_connections = {} connections: try again later",
                    connections.max()
                );
                let mut frame = Vec::new();
                let resp = exec
                    .borrow_mut()
                    .enc
                    .error_resp(0, ModuleId::new(0, 0), RetCode::Unavailable, &message)
                    .to_vec();
                write_frame(&mut frame, &resp).expect("a short ErrorResp fits a frame");
                glommio::spawn_local(refuse(stream, frame)).detach();
            }
            Ok(stream) => {
                // Answers leave as soon as they are written, batched per read.
                let _ = stream.set_nodelay(true);
                let conn = Rc::new(Conn::default());
                let id = {
                    let mut ex = exec.borrow_mut();
                    ex.counters.accepted += 1;
                    let now = ex.clock();
                    let id = ex.registry.open(conn.clone(), now);
                    ex.poke();
                    id
                };
                let connections = connections.clone();
                let exec = exec.clone();
                let tls = tls.clone();
                glommio::spawn_local(async move {
                    let peer = stream.peer_addr().ok();
                    match lbagent_tls::accept(tls.as_deref(), stream).await {
                        Ok(stream) => serve(stream, exec, conn, id).await,
                        Err(why) => refused(&exec, id, peer, &why),
                    }
                    connections.give(1);
                })
                .detach();
            }
            Err(e) => {
                {
                    let mut ex = exec.borrow_mut();
                    ex.counters.accept_errors += 1;
                    ex.poke();
                }
                if last_error_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    tracing::warn!("accept failed: {e} (raise `ulimit -n`?); retrying");
                    last_error_log = Some(Instant::now());
                }
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Tells a connection past the bound why it is closed, waiting at most
/// 100 ms for the write.
async fn refuse(mut stream: TcpStream, frame: Vec<u8>) {
    let linger = glommio::timer::sleep(Duration::from_millis(100));
    let _ = race(stream.write_all(&frame), linger).await;
}

/// A connection whose TLS handshake failed: counted, logged (once per
/// peer address and reason per minute), its slot released.
fn refused(exec: &RefCell<Exec>, id: ConnId, peer: Option<std::net::SocketAddr>, why: &str) {
    let mut ex = exec.borrow_mut();
    ex.counters.tls_refused += 1;
    ex.registry.release(id);
    ex.poke();
    let now = ex.clock();
    let ip = peer.map_or(std::net::IpAddr::from([0, 0, 0, 0]), |p| p.ip());
    if let Some(hidden) = ex.refusals.allow(&(ip, why.to_string()), now) {
        let peer = peer.map_or_else(|| "an unknown peer".into(), |p| p.to_string());
        tracing::warn!(
            "refused a connection from {peer}: {why} ({hidden} more refused from {ip} for this in the last minute)"
        );
    }
}

/// One connection, until it closes.
async fn serve(mut stream: Stream, exec: Rc<RefCell<Exec>>, conn: Rc<Conn>, id: ConnId) {
    let mut session = Session::new(id);
    let mut rbuf = vec![0u8; READ_BUF];
    let mut out: Vec<u8> = Vec::new();
    let reason = loop {
        // A peer that always has bytes ready must not starve the tick and
        // the other connections: yield once the time slice is spent.
        glommio::yield_if_needed().await;
        if let Some(reason) = conn.close.borrow_mut().take() {
            break reason;
        }
        {
            let mut pending = conn.pending.borrow_mut();
            if !pending.is_empty() {
                if out.is_empty() {
                    std::mem::swap(&mut out, &mut pending);
                } else {
                    out.extend_from_slice(&pending);
                    pending.clear();
                }
            }
        }
        if !out.is_empty() {
            match race(lbagent_tls::send(&mut stream, &out), conn.closed()).await {
                Either::Left(Ok(())) => {
                    out.clear();
                    if out.capacity() > KEEP_OUT {
                        out = Vec::new();
                    }
                    continue;
                }
                Either::Left(Err(e)) => break CloseReason::Io(e),
                Either::Right(reason) => break reason,
            }
        }
        match race(stream.read(&mut rbuf), conn.kicked()).await {
            Either::Left(Ok(0)) => break CloseReason::PeerClosed,
            Either::Left(Ok(n)) => {
                let handled = {
                    let mut guard = exec.borrow_mut();
                    let ex = &mut *guard;
                    // A fresh stamp: the tick may not have run for a while.
                    ex.clock();
                    ex.poke();
                    let mut ctx = Ctx {
                        table: &ex.table,
                        registry: &mut ex.registry,
                        enc: &mut ex.enc,
                        counters: &mut ex.counters,
                        now: ex.now,
                    };
                    session.on_read(&rbuf[..n], &mut ctx, &mut out)
                };
                if let Err(reason) = handled {
                    // Tell the peer why, if it reads; never wait long.
                    let linger = glommio::timer::sleep(Duration::from_millis(100));
                    let _ = race(lbagent_tls::send(&mut stream, &out), linger).await;
                    break reason;
                }
            }
            Either::Left(Err(e)) => break CloseReason::Io(e),
            Either::Right(()) => {}
        }
    };
    let mut ex = exec.borrow_mut();
    ex.counters.closed[reason.kind() as usize] += 1;
    ex.registry.release(id);
    ex.poke();
    // Dropping the stream closes the socket.
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_queue_up_to_the_bound_and_no_further() {
        let conn = Conn::default();
        let frame = vec![7u8; MAX_PENDING / 4];
        for _ in 0..4 {
            assert!(queue(&conn, &frame));
        }
        assert!(!queue(&conn, &[1]), "one byte more closes the connection");
        assert_eq!(conn.pending.borrow().len(), MAX_PENDING);
    }

    #[test]
    fn a_close_is_kept_until_taken_and_the_first_reason_wins() {
        let conn = Conn::default();
        conn.close(CloseReason::Idle);
        conn.close(CloseReason::Shutdown);
        let reason = conn.close.borrow_mut().take();
        assert!(matches!(reason, Some(CloseReason::Idle)));
    }

    #[test]
    fn the_tick_is_due_only_after_a_change_or_at_the_supervisors_deadline() {
        // Idle, no connection: no tick at all.
        assert_eq!(next_tick(1_000, false, u64::MAX, 25), None);
        // Busy: published one tick later.
        assert_eq!(next_tick(1_000, true, u64::MAX, 25), Some(1_025));
        // Idle connections: the supervisor's next look, nothing sooner.
        assert_eq!(next_tick(1_000, false, 31_000, 25), Some(31_000));
        // Both: the earlier.
        assert_eq!(next_tick(1_000, true, 31_000, 25), Some(1_025));
        assert_eq!(next_tick(1_000, true, 1_010, 25), Some(1_010));
        // A deadline already passed stays passed (the tick runs at once).
        assert_eq!(next_tick(1_000, false, 900, 25), Some(900));
        assert_eq!(next_tick(u64::MAX - 1, true, u64::MAX, 25), Some(u64::MAX));
    }
}
