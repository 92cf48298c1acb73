//! The socket shell: one thread, one UDP socket. It decodes, calls
//! [`ServiceCore`], encodes; it sleeps in `ppoll` until the next datagram
//! or the next request due to finish, and takes each request's arrival
//! from the kernel's receive timestamp.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::time::TimeSpec;

use super::core::{Arrival, ServiceCore, ServiceParams};
use crate::admission::{piggyback, Micros, WindowOutcome};
use crate::host::udp::{self, RecvBatch};
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

/// One request as the shell fed it to the core, kept by [`serve_traced`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TracedArrival {
    /// The arrival given to the core, on its clock (the kernel's stamp).
    pub arrival_us: Micros,
    /// When the shell read the datagram, on the same clock.
    pub read_us: Micros,
    /// Business priority as received.
    pub business: u8,
    /// User priority as received.
    pub user: u8,
    /// What the core did with it.
    pub outcome: Arrival,
}

/// What [`serve_traced`] keeps: every request and every admission window
/// (for investigation: it grows with every request).
#[derive(Clone, Debug, Default)]
pub struct ServiceTrace {
    /// Every valid request, in the order fed to the core.
    pub arrivals: Vec<TracedArrival>,
    /// Every admission window: the shell's time when it was taken (at or
    /// just after the window's end), the requests queued then, and the
    /// window's outcome.
    pub windows: Vec<(Micros, usize, WindowOutcome)>,
}

impl ServiceTrace {
    fn take_windows<T>(&mut self, core: &mut ServiceCore<T>, at: Micros) {
        let queued = core.queued();
        self.windows
            .extend(core.take_trace().into_iter().map(|o| (at, queued, o)));
    }
}

/// What the shell keeps to answer a request.
type Token = (SocketAddr, u32, ModuleId);

/// Datagrams taken from the socket per system call.
const BATCH: usize = 64;

/// Serves `socket` with a service of `params` until `stop` is set (checked
/// at least every 20 ms). Requests still queued at the stop get no answer.
///
/// Each request's arrival is the kernel's receive timestamp
/// (`SO_TIMESTAMPNS`, as the agent's shards use), so a thread that runs
/// late (a busy machine) neither shortens the queuing times it measures
/// nor leaves the workers idle while requests wait in the socket: the
/// workers are time slots from the true arrival. Without timestamps (or
/// for a datagram without one) the arrival is when it was read.
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
    serve_with(socket, params, None, stop, counters, None)
}

/// A node that starts cold: for its first `duration` each request takes
/// `factor` times the service time (caches, connection pools and JIT still
/// warming), then the service time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColdStart {
    /// How long the node stays cold after the serve starts.
    pub duration: Duration,
    /// How many times slower a request is while cold (at least 1).
    pub factor: u64,
}

/// [`serve`] for a node that starts cold ([`ColdStart`]): its queue is kept
/// when it warms up, so no request is lost to the change.
///
/// # Errors
/// As [`serve`].
pub fn serve_cold(
    socket: &UdpSocket,
    params: ServiceParams,
    cold: ColdStart,
    stop: &AtomicBool,
    counters: &Counters,
) -> io::Result<()> {
    serve_with(socket, params, Some(cold), stop, counters, None)
}

/// [`serve`], keeping every request and admission window in `trace` (for
/// investigation; it allocates per request).
///
/// # Errors
/// As [`serve`].
pub fn serve_traced(
    socket: &UdpSocket,
    params: ServiceParams,
    stop: &AtomicBool,
    counters: &Counters,
    trace: &mut ServiceTrace,
) -> io::Result<()> {
    serve_with(socket, params, None, stop, counters, Some(trace))
}

fn serve_with(
    socket: &UdpSocket,
    params: ServiceParams,
    cold: Option<ColdStart>,
    stop: &AtomicBool,
    counters: &Counters,
    mut trace: Option<&mut ServiceTrace>,
) -> io::Result<()> {
    let fd = socket.as_raw_fd();
    let stamped = udp::enable_timestamps(fd).is_ok();
    let epoch = Instant::now();
    let now = || epoch.elapsed().as_micros() as Micros;
    let mut core: ServiceCore<Token> = ServiceCore::new(params);
    // While cold, requests take `factor` times longer, until `warm_at`.
    let mut warm_at = cold.map(|c| {
        core.set_service_us(params.service_us.saturating_mul(c.factor.max(1)));
        c.duration.as_micros() as Micros
    });
    core.trace_windows(trace.is_some());
    let mut enc = Encoder::new();
    let mut batch = RecvBatch::new(BATCH);
    // The latest time given to the core (it takes times in order).
    let mut last: Micros = 0;
    // Answers every request the core finished by `at`.
    let answer_done = |core: &mut ServiceCore<Token>, enc: &mut Encoder, at: Micros| {
        while let Some((addr, seq, module)) = core.poll_done(at) {
            let level = core.level();
            let _ = socket.send_to(
                enc.get_host_resp(seq, module, RetCode::Ok, None, level),
                addr,
            );
        }
    };
    while !stop.load(Relaxed) {
        // Read first (the socket does not block), so that what arrived
        // while the last turn ran is fed to the core at its stamp, before
        // the core's clock moves on to now.
        let n = batch.recv(fd)?;
        // The kernel stamps on CLOCK_REALTIME; the core's clock is `epoch`.
        let (mono, real_us) = (now(), udp::realtime_ns() / 1000);
        if warm_at.is_some_and(|w| mono >= w) {
            core.set_service_us(params.service_us);
            warm_at = None;
        }
        for i in 0..n {
            let stamp = batch.arrived_ns(i).filter(|_| stamped);
            let arrival = arrival_us(stamp, mono, real_us, last);
            last = arrival;
            // Workers that finished before this arrival are free for it.
            answer_done(&mut core, &mut enc, arrival);
            let (bytes, addr, truncated) = batch.get(i);
            let req = match decode(bytes, &Limits::UDP) {
                Ok(Message::GetHostReq(req)) if !truncated => req.validate().ok(),
                _ => None,
            };
            let Some(req) = req else {
                counters.malformed.fetch_add(1, Relaxed);
                continue;
            };
            let token = (addr, req.seq, req.module);
            let (b, u) = (req.business_priority, req.user_priority);
            let outcome = core.arrive(arrival, b, u, token);
            if let Some(tr) = trace.as_deref_mut() {
                tr.arrivals.push(TracedArrival {
                    arrival_us: arrival,
                    read_us: mono,
                    business: b,
                    user: u,
                    outcome,
                });
                tr.take_windows(&mut core, arrival);
            }
            let retcode = match outcome {
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
        if n > 0 {
            // More may have come while this batch was handled: read again
            // before the core's clock moves on to now, so no datagram that
            // waited in the socket is dated later than its stamp.
            counters.publish(&core);
            continue;
        }
        let t = now().max(last);
        last = t;
        answer_done(&mut core, &mut enc, t);
        if let Some(tr) = trace.as_deref_mut() {
            tr.take_windows(&mut core, t);
        }
        counters.publish(&core);
        let wait = core
            .next_event()
            .map_or(MAX_WAIT_US, |e| e.saturating_sub(t))
            .clamp(1, MAX_WAIT_US);
        wait_readable(socket.as_fd(), wait)?;
    }
    counters.publish(&core);
    Ok(())
}

/// A datagram's arrival on the core's clock: its kernel stamp (`stamp_ns`
/// on `CLOCK_REALTIME`) moved by the offset between the clocks read
/// together (`mono_us` on the core's clock, `real_us` on `CLOCK_REALTIME`),
/// kept within `[last, mono_us]` (the core takes times in order, and a
/// stamp cannot be later than now); `mono_us` without a stamp.
fn arrival_us(stamp_ns: Option<u64>, mono_us: Micros, real_us: u64, last: Micros) -> Micros {
    let hi = mono_us.max(last);
    stamp_ns
        .map_or(mono_us, |ns| {
            mono_us.saturating_sub(real_us.saturating_sub(ns / 1000))
        })
        .clamp(last, hi)
}

/// Waits until `fd` is readable or `wait_us` passed.
///
/// # Errors
/// `ppoll`'s error, other than an interrupt.
fn wait_readable(fd: BorrowedFd<'_>, wait_us: Micros) -> io::Result<()> {
    let ts = TimeSpec::from_duration(Duration::from_micros(wait_us));
    match ppoll(&mut [PollFd::new(fd, PollFlags::POLLIN)], Some(ts), None) {
        Ok(_) | Err(Errno::EINTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::arrival_us;

    #[test]
    fn the_arrival_is_the_kernel_stamp_on_the_core_clock() {
        // Read at mono 50 ms = real 1000 s; stamped 7 ms before.
        let real = 1_000_000_000;
        let stamp = Some((real - 7_000) * 1000);
        assert_eq!(arrival_us(stamp, 50_000, real, 0), 43_000);
        // Never before the last time the core was given…
        assert_eq!(arrival_us(stamp, 50_000, real, 45_000), 45_000);
        // …nor after now (a stamp from a clock step ahead).
        assert_eq!(
            arrival_us(Some((real + 5_000) * 1000), 50_000, real, 0),
            50_000
        );
        // No stamp: when it was read.
        assert_eq!(arrival_us(None, 50_000, real, 0), 50_000);
        assert_eq!(arrival_us(None, 50_000, real, 60_000), 60_000);
    }
}
