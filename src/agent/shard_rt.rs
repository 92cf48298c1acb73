//! The shard's runtime shell: one glommio executor pinned to a core, one UDP
//! socket, the request loop, and the rings to the control core. It moves
//! bytes and messages; every decision is [`super::shard::ShardCore`]'s.
//!
//! The request loop receives and answers in batches with `recvmmsg` /
//! `sendmmsg` on the socket's descriptor; only when nothing is queued does it
//! park: on the socket alone (`poll(2)`, [`super::park::POLL_PARK`]), then
//! on one io_uring peek until a datagram arrives (or its idle tick passes,
//! see [`ShardParts::idle_tick`]). Under load every system call moves a batch.
//! When it spins and when it parks is [`super::park::ParkPolicy`]'s.
//!
//! With `agent.queuing_time` or `admission.agent_shedding` the kernel
//! stamps each datagram's arrival (`SO_TIMESTAMPNS`, see [`Stamps`]); the
//! loop reads the clock once per batch and hands the core each datagram's
//! queuing time, which feeds the queuing-time histograms and, with
//! shedding, the shard's own admission level. Without either the kernel
//! attaches nothing to a datagram.

use std::cell::{Cell, RefCell};
use std::net::UdpSocket as StdUdpSocket;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalSender};
use glommio::channels::shared_channel::{ConnectedSender, SharedReceiver, SharedSender};
use glommio::net::UdpSocket;

use super::bell;
use super::local_rt::{self, Conns};
use super::local_socket::Inbox;
use super::messages::{ToControl, ToShard};
use super::metrics::{Kind, ShardMetrics};
use super::park::{ParkPolicy, Quiet, POLL_PARK};
use super::shard::callers::{client_key, peer_local};
use super::shard::{Queued, Served, ShardCore, ShardSetup};
use super::wake::{self, ShardTimers, TimerPlan};
use lbagent_admission::AdmissionParams;
use lbagent_host::clock;
use lbagent_host::snapshot::SnapshotIndex;
use lbagent_host::udp::{self, RecvBatch, SendBatch};
use lbagent_shm::fixed;
use lbagent_shm::layout::{self, peer_slot, slot_peer};
use lbagent_shm::region::Region;
use lbagent_shm::serve::Server;
use lbagent_wire::DecodeError;
use std::net::SocketAddr;

/// Datagrams moved per system call.
pub const BATCH: usize = 32;

/// How often the shard ships its metrics to the control core (and reclaims
/// dead clients' slots), milliseconds.
const METRICS_EVERY_MS: u64 = 1000;

/// Everything a shard executor needs, built on the main thread.
pub struct ShardParts {
    /// The shard's setup.
    pub setup: ShardSetup,
    /// The bound UDP socket (bound by the caller so that errors surface
    /// before any thread starts).
    pub socket: StdUdpSocket,
    /// The snapshot the agent started from, shared by every shard: this
    /// shard makes its share's modules from it (see
    /// [`ShardCore::preload`]).
    pub snapshot: Option<Arc<SnapshotIndex>>,
    /// Shard → control ring.
    pub to_control: SharedSender<ToControl>,
    /// Control → shard ring.
    pub from_control: SharedReceiver<ToShard>,
    /// Shard → control metrics ring.
    pub metrics_out: SharedSender<Box<ShardMetrics>>,
    /// Set when the agent shuts down.
    pub stop: Arc<AtomicBool>,
    /// Counts the request loop's turns (the systemd watchdog).
    pub beat: super::liveness::Beat,
    /// Counts the shards ready to serve (rings connected, about to read
    /// the socket): the control core writes the first heartbeat only when
    /// every shard is.
    pub ready: Arc<AtomicU32>,
    /// The shard's own admission control (`admission.agent_shedding`),
    /// None when off.
    pub shedding: Option<AdmissionParams>,
    /// The shard's shared-memory region (`[shm]`), None when off.
    pub shm: Option<Region>,
    /// The connections to the shard's local socket, from the acceptor
    /// thread (`agent.local_socket`), None when off.
    pub local: Option<Arc<Inbox>>,
    /// How long the idle request loop parks before it turns anyway
    /// ([`super::liveness::idle_tick`]): so that the liveness watchdog sees
    /// an idle loop alive, and to sweep every shared-memory slot once (a
    /// client that set no pending bit). Shutdown does not wait for it:
    /// `Agent::stop` rings every shard's socket with an empty datagram.
    pub idle_tick: Duration,
    /// Measure every datagram's queuing time (`agent.queuing_time`): the
    /// kernel stamps each datagram's arrival. Implied by `shedding`.
    pub queuing_time: bool,
    /// The shard's doorbell flag ([`super::bell`]): set when the control
    /// core rang after queuing a message for this shard, or the local
    /// socket's acceptor after queuing a connection.
    pub control_bell: Arc<AtomicBool>,
}

/// Runs a shard until `stop` is set. Call inside its glommio executor.
pub async fn run(parts: ShardParts) {
    let ShardParts {
        setup,
        socket,
        snapshot,
        to_control,
        from_control,
        metrics_out,
        stop,
        beat,
        ready,
        shedding,
        shm,
        local,
        idle_tick,
        queuing_time,
        control_bell,
    } = parts;
    let fd = socket.into_raw_fd();
    let stamps = Stamps::for_shard(fd, queuing_time, shedding.is_some());
    let shm = shm.map(|r| {
        let srv = Server::new(r);
        // Without queuing times the clients' stamps are never read: the
        // region tells them so, and they read no clock for them.
        srv.reads_stamps(stamps.stamped);
        Rc::new(RefCell::new(srv))
    });
    // SAFETY: fd is a bound UDP socket we own; glommio takes it over.
    let socket = Rc::new(unsafe { UdpSocket::from_raw_fd(fd) });
    let core = Rc::new(RefCell::new(ShardCore::new(setup)));
    core.borrow_mut().set_shedding(shedding);
    // The snapshot's routes: held as the file's bytes, not yet made
    // modules, so the shard serves at once (a request makes its module
    // first); a task makes the rest in slices between requests, then the
    // shard lets go of the snapshot.
    if let Some(snapshot) = snapshot {
        core.borrow_mut().preload(snapshot);
    }
    let preload_task = {
        let core = core.clone();
        glommio::spawn_local(async move {
            while core
                .borrow_mut()
                .preload_step(clock::now_ms(), PRELOAD_NODES)
            {
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let to_control = Rc::new(to_control.connect().await);
    let from_control = from_control.connect().await;
    let metrics_out = metrics_out.connect().await;

    // The timer task's plan, and its doorbell (see the tick task below).
    let (wake_tx, wake_rx) = local_channel::new_bounded::<()>(1);
    let timer = Rc::new(TimerWake {
        plan: Cell::new(TimerPlan::new(clock::now_ms(), Duration::ZERO, false)),
        tx: wake_tx,
    });
    // The local socket's connections (see local_rt).
    let conns = Rc::new(Conns::default());
    let local_task = local.map(|inbox| {
        let shared = local_rt::Shared {
            core: core.clone(),
            conns: conns.clone(),
            to_control: to_control.clone(),
            timer: timer.clone(),
            shm: shm.clone(),
            bell: socket.local_addr().ok().and_then(own_bell).map(Rc::new),
        };
        glommio::spawn_local(local_rt::accept(inbox, shared))
    });
    // Routes from the control core; register answers they release.
    let ring_task = {
        let core = core.clone();
        let timer = timer.clone();
        let socket = socket.clone();
        let shm = shm.clone();
        let conns = conns.clone();
        glommio::spawn_local(async move {
            let mut out = SendBatch::new();
            while let Some(msg) = from_control.recv().await {
                for (peer, bytes) in core.borrow_mut().apply(msg, clock::now_ms()) {
                    send_or_deliver(&mut out, shm.as_deref(), &conns, peer, &bytes);
                }
                let failed = out.flush(socket.as_raw_fd());
                core.borrow_mut().metrics.send_errors += failed as u64;
                timer.nudge(&core.borrow());
            }
        })
    };

    // Register deadlines, the admission window's end by time and the
    // metrics second: the task sleeps until the first of them is due (see
    // wake::shard_sleep), and the request loop and the ring task wake it
    // when an event makes something due sooner (see nudge). Cancelled when
    // the request loop drops it.
    let tick_task = {
        let core = core.clone();
        let socket = socket.clone();
        let to_control = to_control.clone();
        let shm = shm.clone();
        let timer = timer.clone();
        let conns = conns.clone();
        glommio::spawn_local(async move {
            let mut out = SendBatch::new();
            let mut metrics_at = clock::now_ms() + METRICS_EVERY_MS;
            let mut told_truncated = false;
            loop {
                let now = clock::now_ms();
                let now_us = udp::realtime_ns() / 1000;
                let sleep = {
                    let mut c = core.borrow_mut();
                    c.tick_shedding(now_us);
                    if c.next_deadline().is_some_and(|d| d <= now) {
                        for (peer, bytes) in c.expire(now) {
                            send_or_deliver(&mut out, shm.as_deref(), &conns, peer, &bytes);
                        }
                        let failed = out.flush(socket.as_raw_fd());
                        c.metrics.send_errors += failed as u64;
                        offer(&mut c, &to_control, now);
                    }
                    if now >= metrics_at {
                        metrics_at = wake::next_second(metrics_at, now);
                        if let Some(s) = &shm {
                            // Once a second: slots of dead clients go
                            // back, and the units taken through them.
                            let mut s = s.borrow_mut();
                            for slot in s.reclaim_dead() {
                                c.release_client(client_key(slot_peer(slot)));
                            }
                            c.metrics.shm = s.counts;
                            if s.truncated() && !told_truncated {
                                told_truncated = true;
                                tracing::warn!(
                                    "the shared-memory region's file was truncated under the shard: \
                                     the region is closed (its clients go by UDP); restart the agent \
                                     to make a new one"
                                );
                            }
                        }
                        c.refresh_gauges();
                        // A full ring drops this second's copy; the next one follows.
                        let _ = metrics_out.try_send(Box::new(c.metrics.clone()));
                    }
                    let window_us = c.shedding_due();
                    let sleep = wake::shard_sleep(&ShardTimers {
                        now_ms: now,
                        deadline_ms: c.next_deadline(),
                        metrics_ms: metrics_at,
                        now_us,
                        window_us,
                    });
                    timer
                        .plan
                        .set(TimerPlan::new(now, sleep, window_us.is_some()));
                    sleep
                };
                if sleep > Duration::ZERO {
                    let _ = glommio::timer::timeout(sleep, async {
                        let _ = wake_rx.recv().await;
                        Ok(())
                    })
                    .await;
                }
            }
        })
    };

    let mut rx = RecvBatch::new(BATCH);
    let mut tx = SendBatch::new();
    let mut peek = [0u8; 1];
    // When to read the socket, spin or park (see park.rs). A region starts
    // unattached: marked parked, so that a client's first request rings.
    let mut policy = ParkPolicy::new(false);
    if let Some(s) = &shm {
        s.borrow().park();
    }
    ready.fetch_add(1, Ordering::SeqCst);
    while !stop.load(Ordering::Relaxed) {
        beat.beat();
        let served = match &shm {
            Some(s) if policy.attached() => {
                let sweep = policy.sweep();
                let served = serve_slots(
                    &core,
                    s,
                    &to_control,
                    sweep.full,
                    sweep.time_one,
                    stamps.stamped,
                );
                if served > 0 {
                    timer.nudge(&core.borrow());
                }
                served
            }
            _ => 0,
        };
        // A receive error (e.g. an ICMP error queued on the socket) is
        // consumed by the call; treat it as an empty batch.
        let n = if policy.read_socket(served) {
            rx.recv(socket.as_raw_fd()).unwrap_or_default()
        } else {
            0
        };
        if n == 0 {
            // Quiet: with a region, spin a little (the next request of a
            // busy client is microseconds away), looking at the clock now
            // and then, and letting the clients on this core run (on a
            // core of its own the call returns at once); then park.
            let quiet = policy.quiet(served, || {
                udp::yield_core();
                Instant::now()
            });
            if quiet == Quiet::Spin {
                glommio::yield_if_needed().await;
                continue;
            }
            if let Some(s) = &shm {
                if policy.attached() {
                    // Let a client's doorbell (a datagram on the socket)
                    // wake the shard.
                    let s = s.borrow();
                    s.park();
                    if s.pending() {
                        s.unpark();
                        policy.pending();
                        continue;
                    }
                    if s.claimed() == 0 {
                        // Nobody holds a slot: stay marked parked (a
                        // client's next request rings) and stop sweeping.
                        policy.attach(false);
                    }
                } else if follow_holders(s, &mut policy, false) {
                    // A client holds a slot (counted once a second): sweep
                    // for it first.
                    continue;
                }
            }
            // Nothing queued: park until a datagram arrives (a request, a
            // client's doorbell, or the agent's own at stop) or a tick
            // passes: first on the socket alone, then, if that passes
            // quietly, the executor (see park.rs).
            if policy.attached() {
                policy.parking(Instant::now());
            }
            let woken = if conns.is_empty() && udp::wait_readable(socket.as_raw_fd(), POLL_PARK) {
                // The control core's doorbell: its message now, not at the
                // next turn.
                if bell::taken(&control_bell) || policy.poll_parked(Instant::now()) {
                    glommio::executor().yield_task_queue_now().await;
                    policy.executor_turn(Instant::now());
                }
                true
            } else {
                // The executor runs its tasks: whatever the control core
                // rang for is drained; the next message rings again.
                bell::taken(&control_bell);
                let woken =
                    glommio::timer::timeout(idle_tick, async { socket.peek_from(&mut peek).await })
                        .await
                        .is_ok();
                policy.executor_turn(Instant::now());
                woken
            };
            if let Some(s) = &shm {
                if policy.attached() {
                    s.borrow().unpark();
                    policy.woke(woken, Instant::now);
                } else if !woken && s.borrow().pending() {
                    // Only the tick: a client whose doorbell was lost.
                    follow_holders(s, &mut policy, true);
                }
            }
            continue;
        }
        policy.received();
        let rang = {
            let mut c = core.borrow_mut();
            let now = clock::now_ms();
            let rang = serve_datagrams(&mut c, &rx, n, &mut tx, socket.as_raw_fd(), stamps, now);
            if !c.outbox.is_empty() {
                offer(&mut c, &to_control, now);
            }
            timer.nudge(&c);
            rang
        };
        if let Some(s) = &shm {
            follow_holders(s, &mut policy, rang);
        }
        if rang && bell::taken(&control_bell) {
            // The control core's doorbell came in this batch: its message
            // now (the socket no longer wakes the next wait for it).
            glommio::executor().yield_task_queue_now().await;
            policy.executor_turn(Instant::now());
        }
        glommio::yield_if_needed().await;
    }
    // The tasks are held, not detached: dropping one cancels it, so no
    // timer expiry, route or preload runs into the shutdown below (a
    // detached task would run on until the executor ends).
    drop(ring_task);
    drop(tick_task);
    drop(preload_task);
    drop(local_task);
    if let Some(s) = &shm {
        // Clients fall back to UDP (then to the static routes) at once.
        s.borrow().close();
    }

    // Shutdown: hand every count the shard holds to the control core,
    // waiting for room in the ring (bounded), then say so.
    let last = {
        let mut c = core.borrow_mut();
        c.flush_stats(clock::now_ms());
        std::mem::take(&mut c.outbox)
    };
    let deliver = async {
        for msg in last {
            if to_control.send(msg).await.is_err() {
                return;
            }
        }
        let _ = to_control.send(ToControl::Drained).await;
    };
    let _ = glommio::timer::timeout(FLUSH_WAIT, async {
        deliver.await;
        Ok(())
    })
    .await;
}

/// Serves the slots whose clients set their pending bit, or with `full`
/// every slot that holds a new request: one sweep ([`sweep`]), then hands
/// what the core has for the control core to it. Returns how many.
fn serve_slots(
    core: &RefCell<ShardCore>,
    shm: &RefCell<Server>,
    to_control: &ConnectedSender<ToControl>,
    full: bool,
    time_one: bool,
    queuing: bool,
) -> usize {
    let mut srv = shm.borrow_mut();
    let mut c = core.borrow_mut();
    let served = sweep(&mut c, &mut srv, full, time_one, queuing);
    if !c.outbox.is_empty() {
        offer(&mut c, to_control, clock::now_ms());
    }
    served
}

/// What the kernel attaches to each datagram the shard receives: nothing
/// by default. The arrival stamp (`SO_TIMESTAMPNS`, a 32-byte control
/// message the kernel writes and the shard reads per datagram) only when
/// queuing times are measured (`agent.queuing_time`, or the shard sheds);
/// the receive queue's drop count (`SO_RXQ_OVFL`, 24 bytes more) only when
/// the shard sheds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamps {
    /// Datagrams carry their arrival time.
    pub stamped: bool,
    /// Datagrams carry the socket's running drop count.
    pub counted: bool,
}

impl Stamps {
    /// What a shard asks for on its socket `fd`: the arrival stamps when it
    /// measures queuing times (`agent.queuing_time`) or sheds (which needs
    /// them), the drop count when it sheds; nothing otherwise.
    pub fn for_shard(fd: RawFd, queuing_time: bool, shedding: bool) -> Stamps {
        Stamps::enable(fd, queuing_time || shedding, shedding)
    }

    /// Asks the kernel for what is wanted on `fd`; what it refuses is
    /// logged (the shard's span names the shard) and left off.
    pub fn enable(fd: RawFd, timestamps: bool, drop_count: bool) -> Stamps {
        let stamped = timestamps
            && match udp::enable_timestamps(fd) {
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(
                        "no receive timestamps ({e}): queuing time not measured, nothing shed"
                    );
                    false
                }
            };
        // With shedding, the kernel's drop count rides on every datagram: a
        // full receive buffer is overload the queuing time cannot show.
        let counted = stamped
            && drop_count
            && match udp::enable_drop_count(fd) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(
                        "no receive drop count ({e}): overload shows only as queuing time, \
                         not as the datagrams a full receive buffer drops"
                    );
                    false
                }
            };
        Stamps { stamped, counted }
    }
}

/// Serves datagrams `0..n` of the last receive: hands each to the core
/// (with its queuing time when `stamps.stamped`), queues the answers and
/// sends them in one batch on `fd`. Touches no ring (the caller hands the
/// core's outbox on). Reads the clock once per batch for the queuing
/// times, and times one getHost per batch for the service-time summary (a
/// sample, as over shared memory, instead of two clock reads around every
/// request); a quiet shard's batches are single datagrams, so then every
/// getHost is timed. Returns true when the batch held a doorbell (an empty
/// datagram).
pub fn serve_datagrams(
    c: &mut ShardCore,
    rx: &RecvBatch,
    n: usize,
    tx: &mut SendBatch,
    fd: RawFd,
    stamps: Stamps,
    now: u64,
) -> bool {
    // One clock read per batch: a datagram's queuing time is the batch's
    // receive time minus its arrival stamp.
    let now_ns = if stamps.stamped {
        udp::realtime_ns()
    } else {
        0
    };
    if stamps.counted {
        // The running count as the batch's last datagram carried it (the
        // drops before it was queued).
        if let Some(d) = rx.drops(n - 1) {
            c.kernel_drops(d);
        }
    }
    let mut timed = false;
    let mut rang = false;
    for i in 0..n {
        let (bytes, peer, truncated) = rx.get(i);
        if bytes.is_empty() {
            // A doorbell (a shared-memory client's, or the agent's own at
            // stop): it woke the shard, nothing more.
            rang = true;
            continue;
        }
        if truncated {
            c.metrics.count_malformed(&DecodeError::Oversized {
                len: bytes.len() + 1,
                max: bytes.len(),
            });
            continue;
        }
        let queued = if stamps.stamped {
            rx.arrived_ns(i).map(|at| Queued {
                now_us: now_ns / 1000,
                waited_us: now_ns.saturating_sub(at) / 1000,
            })
        } else {
            None
        };
        let t0 = (!timed).then(Instant::now);
        if let Some(a) = c.handle_queued(bytes, peer, now, queued) {
            tx.push(peer, a);
        }
        if let Some(t0) = t0 {
            if c.last_kind() == Some(Kind::GetHost) {
                timed = true;
                c.metrics.record_gethost_ns(t0.elapsed().as_nanos() as u64);
            }
        }
    }
    let failed = tx.flush(fd);
    c.metrics.send_errors += failed as u64;
    rang
}

/// One sweep of a shard's region: the slots [`Server::ready`] names (with
/// `full`, every slot), served by [`serve_ready`] at the current time.
/// Reads the clocks only when some slot is ready: the monotonic
/// milliseconds of the core, and with `queuing` (queuing times measured:
/// `agent.queuing_time`, or shedding) the realtime clock the clients
/// stamp their requests with. Returns how many requests it took.
pub fn sweep(
    c: &mut ShardCore,
    srv: &mut Server,
    full: bool,
    time_one: bool,
    queuing: bool,
) -> usize {
    let ready = srv.ready(full);
    if ready == 0 {
        return 0;
    }
    let now_ns = queuing.then(udp::realtime_ns);
    serve_ready(c, srv, ready, time_one, clock::now_ms(), now_ns)
}

/// Serves the `ready` slots [`Server::ready`] collected: takes every new
/// request, hands it to the core (a record of the fixed layout through
/// [`ShardCore::serve_record`], its answer written in place, FlatBuffers bytes through
/// [`ShardCore::handle_queued`], as from the slot's [`slot_peer`]), and
/// writes the answer back. `now` is the core's time; `now_ns` the realtime
/// clock when queuing times are measured (each request's is then `now_ns`
/// minus its client's stamp), None when not. With `time_one`, times one
/// getHost for the service-time summary (a sample). Returns how many
/// requests it took. Touches no socket and no ring (the caller hands the
/// core's outbox on) and reads no clock but for that sample. Inlined into
/// its caller's sweep: a call's frame cost a sweep of one request 20
/// instructions (callgrind).
#[inline]
pub fn serve_ready(
    c: &mut ShardCore,
    srv: &mut Server,
    ready: usize,
    time_one: bool,
    now: u64,
    now_ns: Option<u64>,
) -> usize {
    let visited = srv.begin_sweep(now_ns.unwrap_or(0));
    let mut served = 0;
    let mut timed = !time_one;
    for i in 0..ready {
        let slot = srv.ready_slot(i);
        let Some(t) = srv.take(slot, now_ns.unwrap_or(0), visited) else {
            continue;
        };
        served += 1;
        let queued = now_ns.map(|ns| Queued {
            now_us: ns / 1000,
            waited_us: t.waited_us,
        });
        if let Some(report) = srv.first(&t) {
            // A report sent ahead of the request in the same cell: it has
            // no answer (anything else there would be dropped as over UDP).
            if t.first_format == layout::FMT_FIXED {
                if c.serve_report_first(report, slot_peer(slot), now, queued) == Served::Garbage {
                    srv.counts.garbage += 1;
                }
            } else {
                c.handle_queued(report, slot_peer(slot), now, queued);
            }
        }
        let t0 = (!timed).then(Instant::now);
        if t.format == layout::FMT_FIXED {
            // Decided and answered in place: the record written into
            // `out` from the decision's values goes to the slot as it is.
            let mut out = [0u8; fixed::ANSWER_MAX];
            match c.serve_record(srv.request(&t), slot_peer(slot), now, queued, &mut out) {
                Served::Answer(n) => srv.respond_record(&t, &out, n),
                Served::Nothing => srv.respond(slot, t.seq, None),
                // Out of line: the compiler's jump table over all four
                // cost a request 10 instructions (callgrind).
                other => respond_other(c, srv, slot, t.seq, other),
            }
        } else {
            match c.handle_queued(srv.request(&t), slot_peer(slot), now, queued) {
                Some(answer) => srv.respond(slot, t.seq, Some(answer)),
                // By value: a reference would keep every request's
                // `Taken` in memory (8 stores a request).
                None => srv.unanswered(t),
            }
        }
        if let Some(t0) = t0 {
            if c.last_kind() == Some(Kind::GetHost) {
                timed = true;
                let ns = t0.elapsed().as_nanos() as u64;
                c.metrics.record_gethost_ns(ns);
            }
        }
    }
    served
}

/// The answer to request `seq` of `slot`, a record
/// [`ShardCore::serve_record`] served as neither an answer record nor
/// nothing: its FlatBuffers answer, or nothing for garbage (counted).
#[cold]
#[inline(never)]
fn respond_other(c: &mut ShardCore, srv: &mut Server, slot: u32, seq: u32, served: Served) {
    match served {
        Served::Encoded => srv.respond(slot, seq, Some(c.encoded())),
        Served::Garbage => {
            srv.counts.garbage += 1;
            srv.respond(slot, seq, None);
        }
        Served::Answer(_) | Served::Nothing => {
            unreachable!("the sweep answers these itself")
        }
    }
}

/// Attaches the region to the loop (it sweeps and spins for it, see
/// park.rs) when a client shows it holds a slot: `shown` (its doorbell in
/// the last batch, or its request found pending at the idle tick), or the
/// once-a-second count; returns true when it did. Detaches an attached
/// region when the count says nobody holds a slot and no request is
/// pending, and leaves the shard marked parked, so that the next client's
/// first request rings. Called after every UDP batch (under UDP traffic
/// the loop may never park) and, detached, before a park; an attached
/// loop's park does its own detaching.
fn follow_holders(s: &RefCell<Server>, policy: &mut ParkPolicy, shown: bool) -> bool {
    let mut s = s.borrow_mut();
    if policy.attached() {
        if s.claimed() == 0 {
            s.park();
            if s.pending() {
                // A client the count has not seen yet.
                s.assume_held();
                s.unpark();
                policy.pending();
            } else {
                policy.attach(false);
            }
        }
        false
    } else if shown || s.claimed() > 0 {
        if shown {
            s.assume_held();
        }
        s.unpark();
        policy.attach(true);
        true
    } else {
        false
    }
}

/// A socket connected to the shard's own port `at` (127.0.0.1 when it is
/// bound to every address): an empty datagram on it is a doorbell.
fn own_bell(at: SocketAddr) -> Option<std::net::UdpSocket> {
    let at = bell::doorbell_address(at);
    let s = bell::ringer(at).ok()?;
    s.connect(at).ok()?;
    Some(s)
}

/// The timer task's plan and the doorbell that wakes it early.
pub(crate) struct TimerWake {
    plan: Cell<TimerPlan>,
    tx: LocalSender<()>,
}

impl TimerWake {
    /// Wakes the timer task when the core now has something due sooner
    /// than it planned for (a new register deadline, an admission window
    /// that began to matter). One comparison when nothing changed.
    pub(crate) fn nudge(&self, core: &ShardCore) {
        if self
            .plan
            .get()
            .needs_wake(core.next_deadline(), core.shedding_due().is_some())
        {
            // Full: a wake is already pending.
            let _ = self.tx.try_send(());
        }
    }
}

/// Queues an answer the core released later for its UDP peer, or writes
/// it into its slot, or queues it on its local connection, when the peer
/// is one.
fn send_or_deliver(
    out: &mut SendBatch,
    shm: Option<&RefCell<Server>>,
    conns: &Conns,
    peer: SocketAddr,
    bytes: &[u8],
) {
    if let Some(conn) = peer_local(peer) {
        conns.deliver(conn, bytes);
        return;
    }
    match (shm, peer_slot(peer)) {
        (Some(s), Some(slot)) => {
            s.borrow_mut().deliver(slot, bytes);
        }
        _ => out.push(peer, bytes),
    }
}

/// Nodes of snapshot modules a shard makes per turn of its preload task
/// (about 256 modules of 10 nodes, 0.3 ms of work; 3 of 1,000), so
/// requests wait at most that long behind it, whatever the modules' size.
const PRELOAD_NODES: usize = 2_560;

/// How long a stopping shard waits for room in the ring for its last
/// statistics.
pub const FLUSH_WAIT: Duration = Duration::from_millis(1000);

/// Hands the outbox to the control core without blocking the request
/// loop: what a full ring refuses stays in the shard (statistics, forgets)
/// or is asked again by the next request (pulls).
pub(crate) fn offer(c: &mut ShardCore, to_control: &ConnectedSender<ToControl>, now: u64) {
    let outbox = std::mem::take(&mut c.outbox);
    for msg in outbox {
        if let Err(e) = to_control.try_send(msg) {
            match into_inner(e) {
                Some(ToControl::Pull(m)) => c.pull_dropped(m),
                Some(ToControl::Stats { module, nodes }) => c.stats_refused(module, nodes, now),
                Some(ToControl::Forget(m)) => c.forget_refused(m, now),
                // A panic episode's log line lost to a full ring is
                // counted with the drops (its answers are counted anyway).
                Some(ToControl::Drained | ToControl::Panic { .. }) | None => {
                    c.metrics.ring_drops += 1
                }
            }
        }
    }
}

fn into_inner<T>(e: glommio::GlommioError<T>) -> Option<T> {
    match e {
        glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(t)) => Some(t),
        _ => None,
    }
}

#[cfg(test)]
mod sweep_tests {
    //! The shared-memory sweep ([`serve_ready`]) through a real region:
    //! clients of one module in one sweep, the node hint handed back, and
    //! a route update between two sweeps.

    use super::*;
    use crate::shard::record_tests::{node, route, M};
    use lbagent_model::NodeAddr;
    use lbagent_shm::attach::{Attachment, Due};
    use lbagent_shm::layout::{Geometry, FMT_FIXED};
    use lbagent_shm::region::{Access, Identity};
    use lbagent_wire::{decode, Encoder, GetHost, Limits, Message, Report, RetCode};
    use std::time::Duration;

    /// Posts `req` (with `hint`) in `att`'s slot.
    fn post(att: &mut Attachment, req: fixed::Request, hint: fixed::Hint, answer: bool) -> u32 {
        let mut rec = [0u8; fixed::MAX_LEN];
        let n = fixed::encode_request_hinted(&req, hint, &mut rec);
        let due = Due::after(Duration::from_secs(30));
        att.post(&rec[..n], FMT_FIXED, answer, &due, &mut || {})
            .expect("the slot takes the request")
    }

    /// One sweep of every slot.
    fn sweep(c: &mut ShardCore, srv: &mut Server, now: u64) -> usize {
        let ready = srv.ready(true);
        serve_ready(c, srv, ready, false, now, None)
    }

    /// Every client asks for a host in one sweep: the hosts and hints.
    fn get_hosts(
        c: &mut ShardCore,
        srv: &mut Server,
        atts: &mut [Attachment],
        now: u64,
    ) -> Vec<(NodeAddr, fixed::Hint)> {
        let g = fixed::Request::GetHost(GetHost {
            seq: 0,
            module: M,
            business_priority: 0,
            user_priority: 0,
        });
        let seqs: Vec<u32> = atts
            .iter_mut()
            .map(|a| {
                let ask = if a.reads_hints() {
                    fixed::Hint::Ask
                } else {
                    fixed::Hint::None
                };
                post(a, g, ask, true)
            })
            .collect();
        assert_eq!(sweep(c, srv, now), atts.len(), "one sweep takes them all");
        let mut buf = Vec::new();
        atts.iter_mut()
            .zip(seqs)
            .map(|(a, seq)| {
                let due = Due::after(Duration::from_secs(30));
                let (n, format) = a.wait(seq, &due, &mut buf, &mut || {}).unwrap();
                assert_eq!(format, FMT_FIXED);
                let (ans, hint) = fixed::decode_answer_hinted(&buf[..n]).unwrap();
                assert_eq!(ans.retcode, RetCode::Ok);
                let hint = hint.map_or(fixed::Hint::None, fixed::Hint::Node);
                (ans.host.expect("a host"), hint)
            })
            .collect()
    }

    /// A region of `slots` slots made by this process as shard 0's, in a
    /// temporary directory (kept alive by the first value), and its
    /// server.
    fn shard_region(slots: u32) -> (tempfile::TempDir, std::path::PathBuf, Server) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.0");
        let ident = Identity {
            shard: 0,
            pid: std::process::id(),
            boot: 1,
        };
        let region = Region::create(&path, Geometry::new(slots), ident, Access::Owner).unwrap();
        (dir, path, Server::new(region))
    }

    #[test]
    fn a_sweep_serves_one_modules_clients_and_their_hinted_reports_across_a_route_update() {
        let (_dir, path, mut srv) = shard_region(4);
        let pid = std::process::id();
        let mut atts: Vec<Attachment> = (0..3)
            .map(|_| Attachment::attach(&path, pid).unwrap())
            .collect();
        assert!(atts.iter().all(Attachment::reads_hints));
        let mut c = ShardCore::new(ShardSetup::new(0, 2, 8888));
        c.apply(route(&[1, 2, 3], 7), 0);
        let got = get_hosts(&mut c, &mut srv, &mut atts, 1);
        // Round robin over the sweep's requests, in slot order.
        let mut hosts: Vec<NodeAddr> = got.iter().map(|g| g.0).collect();
        hosts.sort();
        assert_eq!(hosts, [node(1), node(2), node(3)]);
        // Each reports a failure of its node with its hint, in one sweep.
        let report = |host| {
            fixed::Request::Report(Report {
                seq: 0,
                module: M,
                host,
                retcode: -1,
                tcost_ms: 1,
                downstream_level: None,
                consumed: 0,
            })
        };
        for (a, &(host, hint)) in atts.iter_mut().zip(&got) {
            assert!(matches!(hint, fixed::Hint::Node(_)), "{hint:?}");
            post(a, report(host), hint, false);
        }
        assert_eq!(sweep(&mut c, &mut srv, 2), 3);
        // A route update between two sweeps: node 1 leaves, so every
        // index moves; the old hints still count for their own nodes.
        c.apply(route(&[2, 3, 4], 8), 3);
        for (a, &(host, hint)) in atts.iter_mut().zip(&got) {
            post(a, report(host), hint, false);
        }
        assert_eq!(sweep(&mut c, &mut srv, 4), 3);
        let req = Encoder::new().get_route_req(3, M).to_vec();
        let resp = c.handle(&req, slot_peer(0), 5).unwrap().to_vec();
        let Ok(Message::GetRouteResp(r)) = decode(&resp, &Limits::UDP) else {
            panic!("a GetRouteResp")
        };
        let nodes = r.nodes().unwrap();
        let errs = |n: NodeAddr| {
            nodes
                .iter()
                .find(|s| NodeAddr::from(s.host().unwrap()) == n)
                .map(|s| s.rerr())
        };
        assert_eq!(errs(node(2)), Some(2));
        assert_eq!(errs(node(3)), Some(2));
        assert_eq!(errs(node(4)), Some(0));
        // The next sweep's getHosts read the new route.
        let got = get_hosts(&mut c, &mut srv, &mut atts, 6);
        assert!(got
            .iter()
            .all(|(h, _)| [node(2), node(3), node(4)].contains(h)));
        assert_eq!(srv.counts.garbage, 0);
    }

    /// Slot `slot`'s request placement byte, its split, and its response
    /// placement byte, read from `region` (another mapping of the file).
    fn placed(region: &Region, slot: u32) -> (u32, u32, u32) {
        let base = region.geometry().slot_offset(slot);
        let word = |off| {
            region
                .u32(base + off)
                .load(std::sync::atomic::Ordering::SeqCst)
        };
        (
            word(layout::S_REQ_FORMAT) >> 16,
            word(layout::S_REQ_SPLIT),
            word(layout::S_RESP_FORMAT) >> 8,
        )
    }

    #[test]
    fn cells_go_inline_only_where_the_shard_reads_them_and_are_answered_alike() {
        let (_dir, path, mut srv) = shard_region(2);
        let pid = std::process::id();
        let seen = Region::open(&path).unwrap();
        let mut att = Attachment::attach(&path, pid).unwrap();
        let slot = (0..2)
            .find(|&s| {
                let base = seen.geometry().slot_offset(s);
                seen.u32(base + layout::S_STATE)
                    .load(std::sync::atomic::Ordering::SeqCst)
                    == pid
            })
            .unwrap();
        let mut c = ShardCore::new(ShardSetup::new(0, 1, 8888));
        c.apply(route(&[1, 2, 3], 7), 0);
        let ask = |att: &mut Attachment, c: &mut ShardCore, srv: &mut Server| {
            let got = get_hosts(c, srv, std::slice::from_mut(att), 1);
            got[0]
        };
        // This shard reads inline cells: the getHost and its answer go in
        // the slot's first two lines.
        assert_ne!(seen.features() & layout::FEAT_INLINE, 0);
        let (host, hint) = ask(&mut att, &mut c, &mut srv);
        assert_eq!(
            placed(&seen, slot),
            (
                u32::from(layout::PLACE_INLINE),
                0,
                u32::from(layout::PLACE_INLINE)
            )
        );
        // A report alone goes inline too; taken back in front of the next
        // getHost, both travel in the inline cell.
        let report = fixed::Request::Report(Report {
            seq: 0,
            module: M,
            host,
            retcode: 0,
            tcost_ms: 1,
            downstream_level: None,
            consumed: 0,
        });
        post(&mut att, report, hint, false);
        let _ = ask(&mut att, &mut c, &mut srv);
        let (place, split, answered) = placed(&seen, slot);
        assert_eq!(place, u32::from(layout::PLACE_INLINE));
        assert_eq!(
            split as usize,
            fixed::REPORT_HINTED_LEN,
            "the report went in front"
        );
        assert_eq!(answered, u32::from(layout::PLACE_INLINE));
        // A report taken back in front of a request too long for the
        // inline cell moves to the request area with it, and is counted.
        post(&mut att, report, fixed::Hint::None, false);
        let route_req = Encoder::new().get_route_req(9, M).to_vec();
        assert!(fixed::REPORT_LEN + route_req.len() > layout::INLINE_CAP);
        let due = Due::after(Duration::from_secs(30));
        let seq = att
            .post(&route_req, layout::FMT_FLATBUFFERS, true, &due, &mut || {})
            .unwrap();
        let (place, split, _) = placed(&seen, slot);
        assert_eq!(
            (place, split as usize),
            (u32::from(layout::PLACE_DATA), fixed::REPORT_LEN)
        );
        assert_eq!(sweep(&mut c, &mut srv, 2), 1);
        let mut buf = Vec::new();
        let (n, format) = att.wait(seq, &due, &mut buf, &mut || {}).unwrap();
        assert_eq!(format, layout::FMT_FLATBUFFERS);
        assert!(matches!(
            decode(&buf[..n], &Limits::UDP),
            Ok(Message::GetRouteResp(_))
        ));
        // Both reports counted, none garbage.
        let Ok(Message::GetRouteResp(r)) = decode(&buf[..n], &Limits::UDP) else {
            unreachable!()
        };
        let calls: u32 = r
            .nodes()
            .unwrap()
            .iter()
            .map(|n| n.rsucc() + n.rerr())
            .sum();
        assert_eq!(calls, 2, "the two reports of the inline and the moved cell");
        assert_eq!(srv.counts.garbage, 0);
        // A shard that does not read inline cells (an agent before them:
        // the bit is 0) gets its cells in the request area, answered there.
        seen.set_features(seen.features() & !layout::FEAT_INLINE);
        let _ = ask(&mut att, &mut c, &mut srv);
        assert_eq!(
            placed(&seen, slot),
            (
                u32::from(layout::PLACE_DATA),
                0,
                u32::from(layout::PLACE_DATA)
            )
        );
    }

    #[test]
    fn a_client_stamps_its_requests_only_for_a_shard_that_reads_the_stamps() {
        let (_dir, path, mut srv) = shard_region(1);
        let pid = std::process::id();
        let seen = Region::open(&path).unwrap();
        let stamp = seen.u64(seen.geometry().slot_offset(0) + layout::S_REQ_STAMP);
        let mut att = Attachment::attach(&path, pid).unwrap();
        let mut c = ShardCore::new(ShardSetup::new(0, 1, 8888));
        c.apply(route(&[1], 7), 0);
        // A shard that reads them (queuing times measured): stamped.
        srv.reads_stamps(true);
        assert_eq!(seen.features() & layout::FEAT_NO_STAMP, 0);
        let _ = get_hosts(&mut c, &mut srv, std::slice::from_mut(&mut att), 1);
        assert_ne!(stamp.load(std::sync::atomic::Ordering::SeqCst), 0);
        // One that does not says so, and its clients read no clock for it.
        srv.reads_stamps(false);
        assert_ne!(seen.features() & layout::FEAT_NO_STAMP, 0);
        stamp.store(0, std::sync::atomic::Ordering::SeqCst);
        let _ = get_hosts(&mut c, &mut srv, std::slice::from_mut(&mut att), 2);
        assert_eq!(stamp.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
