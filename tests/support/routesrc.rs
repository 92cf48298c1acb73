//! A test route source: a small route server that speaks the real protocol
//! (PullReq -> RouteAnswer per module, KeepAlive -> KeepAliveAck, RoutePush
//! to subscribed connections, Unsubscribe), for the route client's integration tests.
//!
//! Owns only test plumbing: std threads on `127.0.0.1`, routes in a
//! `HashMap` behind one `Mutex`. It is not the route server (that is
//! `lbagent dnsserver`) and must not grow its features; it grows knobs that
//! make a client's life hard instead: answers batched two to a write, frames
//! split across writes, a mute mode, stop and restart on the same port.
//!
//! Every loop polls a stop flag at least every 20 ms; every write times out
//! after 1 s. Include it with
//! `#[path = "support/routesrc.rs"] mod routesrc;` and
//! `#[path = "support/rebind.rs"] mod rebind;` (its restart's bind).
#![allow(dead_code)]

use crate::rebind::bind_again;

use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use lbagent::model::{ModuleId, NodeAddr, NodeMeta, Policy, RouteNode};
use lbagent::wire::{decode, write_frame, Encoder, FrameDecoder, Limits, Message, RetCode};

/// How often the threads look at the stop flag.
const TICK: Duration = Duration::from_millis(20);

/// A route source on a loopback port; stops when dropped.
pub struct RouteSource {
    shared: Arc<Shared>,
    running: Option<Running>,
}

/// One listening period, between a start and a stop.
struct Running {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: JoinHandle<()>,
}

/// What survives a stop: routes, counters, knobs.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Hold route frames (answers and pushes) until two are ready, then
    /// write them in one write.
    batch: AtomicBool,
    /// Write every frame in two halves, 15 ms apart.
    split: AtomicBool,
    /// Count and subscribe, but answer nothing (a hung server).
    mute: AtomicBool,
}

/// A module's version, nodes, and the zones and labels of those that have any.
type Route = (u64, Vec<RouteNode>, Vec<(NodeAddr, NodeMeta)>);

#[derive(Default)]
struct State {
    routes: HashMap<ModuleId, Route>,
    /// The last version of every module ever set, deleted ones included.
    versions: HashMap<ModuleId, u64>,
    pulls: HashMap<ModuleId, u32>,
    keepalives: u32,
    accepted: usize,
    conns: HashMap<u64, Conn>,
    next_conn: u64,
}

/// The writing half of one connection.
struct Conn {
    writer: TcpStream,
    subscribed: HashSet<ModuleId>,
    /// Route frames held for batching.
    held: Vec<u8>,
    held_frames: usize,
}

impl RouteSource {
    /// A source listening on a free loopback port.
    pub fn start() -> Self {
        let mut source = Self::stopped();
        source.start_on(0).expect("bind 127.0.0.1:0");
        source
    }

    /// A source that does not listen yet (see [`Self::start_on`]).
    pub fn stopped() -> Self {
        RouteSource {
            shared: Arc::default(),
            running: None,
        }
    }

    /// Listens on `127.0.0.1:port` (0: any free port; another: retried
    /// while in use, see [`bind_again`]), keeping the routes
    /// and counters of earlier runs. Stops a current run first.
    pub fn start_on(&mut self, port: u16) -> io::Result<SocketAddr> {
        self.stop();
        let listener = bind_again(port)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (shared, flag) = (self.shared.clone(), stop.clone());
        let acceptor = thread::spawn(move || accept_loop(listener, shared, flag));
        self.running = Some(Running {
            addr,
            stop,
            acceptor,
        });
        Ok(addr)
    }

    /// Stops listening and closes every connection; returns once every
    /// thread has ended. Routes and counters are kept.
    pub fn stop(&mut self) {
        if let Some(run) = self.running.take() {
            run.stop.store(true, Ordering::SeqCst);
            run.acceptor.join().expect("the acceptor thread panicked");
        }
    }

    /// The address listened on.
    ///
    /// # Panics
    /// When stopped.
    pub fn addr(&self) -> SocketAddr {
        self.running.as_ref().expect("the source is stopped").addr
    }

    /// Sets `module`'s nodes, bumping its version, and pushes the route to
    /// every connection subscribed to it. Returns the new version.
    pub fn set_route(&self, module: ModuleId, nodes: &[RouteNode]) -> u64 {
        self.set_route_meta(module, nodes, &[])
    }

    /// [`RouteSource::set_route`] with the zones and labels of the nodes
    /// that have any (issue 31).
    pub fn set_route_meta(
        &self,
        module: ModuleId,
        nodes: &[RouteNode],
        meta: &[(NodeAddr, NodeMeta)],
    ) -> u64 {
        let mut state = self.state();
        let version = state.bump(module);
        state
            .routes
            .insert(module, (version, nodes.to_vec(), meta.to_vec()));
        let frame = Encoder::new()
            .route_push_meta(
                module,
                true,
                version,
                nodes,
                Policy::L5,
                &Default::default(),
                meta,
            )
            .to_vec();
        self.push(&mut state, module, &frame);
        version
    }

    /// Deletes `module`, bumping its version, and pushes the deletion to
    /// every connection subscribed to it. Returns the new version.
    pub fn del_route(&self, module: ModuleId) -> u64 {
        let mut state = self.state();
        let version = state.bump(module);
        state.routes.remove(&module);
        let frame = Encoder::new()
            .route_push(module, false, version, &[])
            .to_vec();
        self.push(&mut state, module, &frame);
        version
    }

    fn push(&self, state: &mut State, module: ModuleId, frame: &[u8]) {
        for conn in state.conns.values_mut() {
            if conn.subscribed.contains(&module) {
                conn.send_route(&self.shared, frame);
            }
        }
    }

    /// PullReqs received naming `module`, over every run.
    pub fn pulls(&self, module: ModuleId) -> u32 {
        self.state().pulls.get(&module).copied().unwrap_or(0)
    }

    /// KeepAlives received, over every run.
    pub fn keepalives(&self) -> u32 {
        self.state().keepalives
    }

    /// Connections accepted, over every run.
    pub fn accepted(&self) -> usize {
        self.state().accepted
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.state().conns.len()
    }

    /// Open connections subscribed to `module`.
    pub fn subscribers(&self, module: ModuleId) -> usize {
        let state = self.state();
        let subscribed = state
            .conns
            .values()
            .filter(|c| c.subscribed.contains(&module));
        subscribed.count()
    }

    /// Holds route frames until two are ready and writes them in one write
    /// (a lone frame waits for the next one).
    pub fn set_batching(&self, on: bool) {
        self.shared.batch.store(on, Ordering::SeqCst);
    }

    /// Writes every frame in two halves, 15 ms apart.
    pub fn set_split_writes(&self, on: bool) {
        self.shared.split.store(on, Ordering::SeqCst);
    }

    /// Answers nothing (PullReqs are still counted and subscribed).
    pub fn set_mute(&self, on: bool) {
        self.shared.mute.store(on, Ordering::SeqCst);
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state()
    }
}

impl Drop for RouteSource {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl State {
    fn bump(&mut self, module: ModuleId) -> u64 {
        let version = self.versions.entry(module).or_insert(0);
        *version += 1;
        *version
    }
}

impl Conn {
    /// Sends a RouteAnswer or RoutePush, held for batching when asked.
    fn send_route(&mut self, shared: &Shared, payload: &[u8]) {
        write_frame(&mut self.held, payload).expect("a test frame fits");
        self.held_frames += 1;
        if !shared.batch.load(Ordering::SeqCst) || self.held_frames >= 2 {
            self.flush(shared);
        }
    }

    /// Sends any other frame, after the held ones (order is kept).
    fn send(&mut self, shared: &Shared, payload: &[u8]) {
        write_frame(&mut self.held, payload).expect("a test frame fits");
        self.flush(shared);
    }

    fn flush(&mut self, shared: &Shared) {
        let bytes = std::mem::take(&mut self.held);
        self.held_frames = 0;
        // Errors are the reader's to notice (it sees the connection end).
        let _ = if shared.split.load(Ordering::SeqCst) && bytes.len() > 1 {
            let (first, rest) = bytes.split_at(bytes.len() / 2 + 1);
            self.writer
                .write_all(first)
                .and_then(|()| self.writer.flush())
                .map(|()| thread::sleep(Duration::from_millis(15)))
                .and_then(|()| self.writer.write_all(rest))
        } else {
            self.writer.write_all(&bytes)
        };
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let mut readers = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let (shared, stop) = (shared.clone(), stop.clone());
                readers.push(thread::spawn(move || serve(stream, shared, stop)));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2))
            }
            Err(_) => thread::sleep(TICK),
        }
    }
    drop(listener);
    for reader in readers {
        reader.join().expect("a connection thread panicked");
    }
}

/// Reads and answers one connection until it ends or the source stops.
fn serve(stream: TcpStream, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let Some(id) = register(&stream, &shared) else {
        return;
    };
    let mut reader = stream;
    let mut frames = FrameDecoder::default();
    let mut buf = vec![0; 16 << 10];
    while !stop.load(Ordering::SeqCst) {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                frames.feed(&buf[..n]);
                if !handle_frames(&mut frames, &shared, id) {
                    break;
                }
            }
            // (Interrupted: a read with a timeout fails so when the process
            // is stopped and continued; the connection is fine.)
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    shared.state().conns.remove(&id);
    let _ = reader.shutdown(Shutdown::Both);
}

/// Sets the stream up and records its writing half; None when the socket
/// refuses the settings.
fn register(stream: &TcpStream, shared: &Shared) -> Option<u64> {
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(TICK)).ok()?;
    stream.set_nodelay(true).ok()?;
    let writer = stream.try_clone().ok()?;
    writer
        .set_write_timeout(Some(Duration::from_secs(1)))
        .ok()?;
    let mut state = shared.state();
    let id = state.next_conn;
    state.next_conn += 1;
    state.accepted += 1;
    let conn = Conn {
        writer,
        subscribed: HashSet::new(),
        held: Vec::new(),
        held_frames: 0,
    };
    state.conns.insert(id, conn);
    Some(id)
}

/// Answers every complete frame; false when the connection must close.
fn handle_frames(frames: &mut FrameDecoder, shared: &Shared, id: u64) -> bool {
    let mut enc = Encoder::new();
    loop {
        let frame = match frames.next_frame() {
            Ok(Some(frame)) => frame,
            Ok(None) => return true,
            Err(_) => return false,
        };
        let Ok(message) = decode(frame, &Limits::TCP_FRAME) else {
            return false;
        };
        let mute = shared.mute.load(Ordering::SeqCst);
        let mut state = shared.state();
        let state = &mut *state;
        let Some(conn) = state.conns.get_mut(&id) else {
            return false;
        };
        match message {
            Message::PullReq(m) => match m.validate() {
                Ok(pull) => {
                    for module in pull.modules() {
                        *state.pulls.entry(module).or_insert(0) += 1;
                        conn.subscribed.insert(module);
                        if mute {
                            continue;
                        }
                        let frame = match state.routes.get(&module) {
                            Some((version, nodes, meta)) => enc.route_answer_meta(
                                pull.seq,
                                module,
                                true,
                                *version,
                                nodes,
                                Policy::L5,
                                &Default::default(),
                                meta,
                            ),
                            None => enc.route_answer(pull.seq, module, false, 0, &[]),
                        };
                        conn.send_route(shared, frame);
                    }
                }
                Err(e) => {
                    let message = e.to_string();
                    let frame =
                        enc.error_resp(m.seq(), ModuleId::new(0, 0), RetCode::BadRequest, &message);
                    conn.send(shared, frame);
                }
            },
            Message::Unsubscribe(m) => {
                for module in m.modules().into_iter().flatten() {
                    conn.subscribed
                        .remove(&ModuleId::new(module.modid(), module.cmdid()));
                }
            }
            Message::KeepAlive(m) => {
                state.keepalives += 1;
                if !mute {
                    conn.send(shared, enc.keep_alive_ack(m.seq()));
                }
            }
            other => {
                let message = format!("{} is not a route server request", other.name());
                let frame = enc.error_resp(0, ModuleId::new(0, 0), RetCode::BadRequest, &message);
                conn.send(shared, frame);
            }
        }
    }
}
