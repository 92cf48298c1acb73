//! A test report sink: a small reporter that speaks the real protocol
//! (StatsReport in, StatsAck or ErrorResp out), for the stats client's
//! integration tests.
//!
//! Owns only test plumbing: std threads on `127.0.0.1`, every report
//! received in a `Vec` behind one `Mutex`. It is not the reporter (that is
//! `lbagent reporter`) and must not grow its features (no store, no
//! deduplication); it grows knobs that make a client's life hard instead:
//! acks withheld, reports refused, stop and restart on the same port.
//!
//! Every loop polls a stop flag at least every 20 ms; every write times out
//! after 1 s. Include it with
//! `#[path = "support/reportsink.rs"] mod reportsink;` and
//! `#[path = "support/rebind.rs"] mod rebind;` (its restart's bind).
#![allow(dead_code)]

use crate::rebind::bind_again;

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use lbagent::model::ModuleId;
use lbagent::wire::{
    decode, write_frame, Encoder, FrameDecoder, Limits, Message, NodeStats, RetCode,
};

/// How often the threads look at the stop flag.
const TICK: Duration = Duration::from_millis(20);

/// One StatsReport as the sink received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// The report's sequence number.
    pub seq: u64,
    /// The reporting agent (IPv4, host byte order).
    pub caller: u32,
    /// When the statistics were taken, Unix seconds.
    pub time_s: u64,
    /// Every module's node statistics, in the report's order.
    pub modules: Vec<(ModuleId, Vec<NodeStats>)>,
    /// Whether the sink answered StatsAck (false: withheld or refused).
    pub acked: bool,
    /// The connection it came on (numbered from 0, over every run).
    pub conn: u64,
}

/// A report sink on a loopback port; stops when dropped.
pub struct ReportSink {
    shared: Arc<Shared>,
    running: Option<Running>,
}

/// One listening period, between a start and a stop.
struct Running {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: JoinHandle<()>,
}

/// What survives a stop: reports, counters, knobs.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Store reports but answer nothing.
    withhold: AtomicBool,
    /// Answer ErrorResp with this code instead of StatsAck.
    refuse: Mutex<Option<RetCode>>,
}

#[derive(Default)]
struct State {
    reports: Vec<Received>,
    accepted: u64,
    open: usize,
}

impl ReportSink {
    /// A sink listening on a free loopback port.
    pub fn start() -> Self {
        let mut sink = Self::stopped();
        sink.start_on(0).expect("bind 127.0.0.1:0");
        sink
    }

    /// A sink that does not listen yet (see [`Self::start_on`]).
    pub fn stopped() -> Self {
        ReportSink {
            shared: Arc::default(),
            running: None,
        }
    }

    /// Listens on `127.0.0.1:port` (0: any free port; another: retried
    /// while in use, see [`bind_again`]), keeping the reports
    /// and knobs of earlier runs. Stops a current run first.
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
    /// thread has ended. Reports and knobs are kept.
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
        self.running.as_ref().expect("the sink is stopped").addr
    }

    /// Stores reports but answers nothing (a reporter that lost its acks).
    pub fn set_withhold_acks(&self, on: bool) {
        self.shared.withhold.store(on, Ordering::SeqCst);
    }

    /// Answers every report with ErrorResp `code` instead of StatsAck
    /// (None: ack again).
    pub fn set_refuse(&self, code: Option<RetCode>) {
        *self.shared.refuse.lock().unwrap_or_else(|p| p.into_inner()) = code;
    }

    /// Every report received, over every run, in arrival order.
    pub fn reports(&self) -> Vec<Received> {
        self.state().reports.clone()
    }

    /// Every module entry received, duplicates included, in arrival order.
    pub fn modules(&self) -> Vec<ModuleId> {
        let state = self.state();
        let entries = state
            .reports
            .iter()
            .flat_map(|r| r.modules.iter().map(|m| m.0));
        entries.collect()
    }

    /// The module entries of the reports acknowledged, in arrival order.
    pub fn acked_modules(&self) -> Vec<ModuleId> {
        let state = self.state();
        let acked = state.reports.iter().filter(|r| r.acked);
        acked.flat_map(|r| r.modules.iter().map(|m| m.0)).collect()
    }

    /// Connections accepted, over every run.
    pub fn accepted(&self) -> u64 {
        self.state().accepted
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.state().open
    }

    /// Polls `cond` every 5 ms until it holds (true) or `timeout` passes
    /// (false).
    pub fn wait_until(&self, timeout: Duration, mut cond: impl FnMut(&Self) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if cond(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state()
    }
}

impl Drop for ReportSink {
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

    fn refuse(&self) -> Option<RetCode> {
        *self.refuse.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    let mut readers = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let conn = {
                    let mut state = shared.state();
                    state.accepted += 1;
                    state.open += 1;
                    state.accepted - 1
                };
                let (shared, stop) = (shared.clone(), stop.clone());
                readers.push(thread::spawn(move || {
                    serve(stream, &shared, &stop, conn);
                    shared.state().open -= 1;
                }));
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

/// Reads and answers one connection until it ends, misbehaves, or the sink
/// stops.
fn serve(mut stream: TcpStream, shared: &Shared, stop: &AtomicBool, conn: u64) {
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(TICK)))
        .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(1))))
        .and_then(|()| stream.set_nodelay(true));
    if setup.is_err() {
        return;
    }
    let mut frames = FrameDecoder::default();
    let mut buf = vec![0; 16 << 10];
    while !stop.load(Ordering::SeqCst) {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                frames.feed(&buf[..n]);
                if !handle_frames(&mut frames, &mut stream, shared, conn) {
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
    let _ = stream.shutdown(Shutdown::Both);
}

/// Stores and answers every complete frame; false when the connection must
/// close (a bad frame, or anything but a StatsReport).
fn handle_frames(
    frames: &mut FrameDecoder,
    stream: &mut TcpStream,
    shared: &Shared,
    conn: u64,
) -> bool {
    let mut enc = Encoder::new();
    let mut answers = Vec::new();
    loop {
        let frame = match frames.next_frame() {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) => return false,
        };
        let Ok(Message::StatsReport(r)) = decode(frame, &Limits::TCP_FRAME) else {
            return false;
        };
        let modules = r.modules().unwrap_or_default().iter().map(|m| {
            let nodes = m.nodes().unwrap_or_default().iter().map(NodeStats::from);
            (ModuleId::new(m.modid(), m.cmdid()), nodes.collect())
        });
        let (withhold, refuse) = (shared.withhold.load(Ordering::SeqCst), shared.refuse());
        let answer = match (withhold, refuse) {
            (true, _) => None,
            (false, Some(code)) => {
                let message = "refused by the test sink";
                Some(enc.error_resp(r.seq(), ModuleId::new(0, 0), code, message))
            }
            (false, None) => Some(enc.stats_ack(r.seq())),
        };
        if let Some(payload) = answer {
            write_frame(&mut answers, payload).expect("a test frame fits");
        }
        shared.state().reports.push(Received {
            seq: r.seq(),
            caller: r.caller(),
            time_s: r.time_s(),
            modules: modules.collect(),
            acked: !withhold && refuse.is_none(),
            conn,
        });
    }
    answers.is_empty() || stream.write_all(&answers).is_ok()
}
