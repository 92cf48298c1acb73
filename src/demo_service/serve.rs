//! The socket shell: one thread, one blocking UDP socket. It decodes,
//! calls [`ServiceCore`], encodes; it sleeps in `recv` until the next
//! datagram or the next request due to finish.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use super::core::{Arrival, ServiceCore, ServiceParams};
use crate::admission::{piggyback, Micros};
use crate::model::ModuleId;
use crate::wire::{decode, Encoder, Limits, Message, RetCode};

/// The longest sleep in `recv`: how soon `stop` is noticed when idle.
const MAX_WAIT_US: Micros = 20_000;

/// Counters the shell publishes while it runs (read them from any thread).
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests that arrived.
    pub arrived: AtomicU64,
    /// Rejected by the shedding policy.
    pub rejected: AtomicU64,
    /// Refused because the queue was full.
    pub queue_full: AtomicU64,
    /// Processed and answered Ok.
    pub completed: AtomicU64,
    /// Datagrams that were not a valid GetHostReq (dropped).
    pub malformed: AtomicU64,
    /// Sum of the queuing times of started requests, microseconds.
    pub queuing_us_sum: AtomicU64,
    /// Requests started.
    pub started: AtomicU64,
    /// Admission windows ended, and of those, overloaded.
    pub windows: AtomicU64,
    /// See `windows`.
    pub overloaded_windows: AtomicU64,
    /// The current level, as [`piggyback::encode`] bytes in a u16 (big
    /// endian: business in the high byte; 0 = none).
    pub level: AtomicU16,
}

impl Counters {
    fn publish<T>(&self, core: &ServiceCore<T>) {
        let s = core.stats();
        self.arrived.store(s.arrived, Relaxed);
        self.rejected.store(s.rejected, Relaxed);
        self.queue_full.store(s.queue_full, Relaxed);
        self.completed.store(s.completed, Relaxed);
        self.queuing_us_sum.store(s.queuing_us_sum, Relaxed);
        self.started.store(s.started, Relaxed);
        self.windows.store(s.windows, Relaxed);
        self.overloaded_windows.store(s.overloaded_windows, Relaxed);
        self.level
            .store(u16::from_be_bytes(piggyback::encode(core.level())), Relaxed);
    }
}

/// What the shell keeps to answer a request.
type Token = (SocketAddr, u32, ModuleId);

/// Serves `socket` with a service of `params` until `stop` is set (checked
/// at least every 20 ms). Requests still queued at the stop get no answer.
///
/// # Errors
/// The socket's error when receiving fails for another reason than a
/// timeout or an interrupt. A failed send is not an error (the caller may
/// be gone); that answer is lost.
pub fn serve(
    socket: &UdpSocket,
    params: ServiceParams,
    stop: &AtomicBool,
    counters: &Counters,
) -> io::Result<()> {
    let epoch = Instant::now();
    let now = || epoch.elapsed().as_micros() as Micros;
    let mut core: ServiceCore<Token> = ServiceCore::new(params);
    let mut enc = Encoder::new();
    let mut buf = vec![0u8; 65_536];
    let mut last_wait = None;
    while !stop.load(Relaxed) {
        let t = now();
        while let Some((addr, seq, module)) = core.poll_done(t) {
            let level = core.level();
            let _ = socket.send_to(
                enc.get_host_resp(seq, module, RetCode::Ok, None, level),
                addr,
            );
        }
        let wait = core
            .next_event()
            .map_or(MAX_WAIT_US, |e| e.saturating_sub(t))
            .clamp(1, MAX_WAIT_US);
        let wait = Some(Duration::from_micros(wait));
        if wait != last_wait {
            socket.set_read_timeout(wait)?;
            last_wait = wait;
        }
        match socket.recv_from(&mut buf) {
            Ok((n, addr)) => {
                let answer = match decode(&buf[..n], &Limits::UDP) {
                    Ok(Message::GetHostReq(req)) => req.validate().ok(),
                    _ => None,
                };
                let Some(req) = answer else {
                    counters.malformed.fetch_add(1, Relaxed);
                    continue;
                };
                let token = (addr, req.seq, req.module);
                let retcode =
                    match core.arrive(now(), req.business_priority, req.user_priority, token) {
                        Arrival::Queued => None,
                        Arrival::Rejected => Some(RetCode::Rejected),
                        Arrival::QueueFull => Some(RetCode::Unavailable),
                    };
                if let Some(rc) = retcode {
                    let level = core.level();
                    let _ = socket.send_to(
                        enc.get_host_resp(req.seq, req.module, rc, None, level),
                        addr,
                    );
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
        counters.publish(&core);
    }
    counters.publish(&core);
    Ok(())
}
