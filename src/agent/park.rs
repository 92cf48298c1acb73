//! When a shard's request loop spins and when it parks, given what each
//! turn saw and the time. Pure: the clock is a closure the policy calls
//! only on the turns that look at it, so the loop's cost model stays what
//! it was (a quiet turn reads the slots' pending words: tens of
//! nanoseconds; a clock read is more, a system call far more).
//!
//! Without a shared-memory region the loop reads its socket every turn
//! and parks (one io_uring peek, at most the idle tick) whenever it
//! received nothing. With one, it sweeps the slots every turn and reads
//! the socket only every [`QUIET_CHECK`] requests served or
//! [`QUIET_READ`] quiet turns;
//! when quiet it spins a little ([`SHARD_SPIN`]: a busy client's next
//! request is microseconds away), looking at the clock every
//! [`QUIET_CHECK`] quiet turns, then parks until a client's doorbell (a
//! datagram) or the idle tick.
//!
//! The spin pays only while the clients are busy: a park that a request
//! ended within [`SHARD_SPIN`] turns it on for the next quiet stretch, a
//! later one (or the tick) off ([`ParkPolicy::woke`]).
//!
//! A region no client holds a slot of is treated as no region
//! ([`ParkPolicy::attach`]): the shard neither sweeps nor spins for it,
//! and stays marked parked, so that a client's first request rings the
//! doorbell (a UDP-only host pays nothing for a region nobody uses).
//!
//! A park first waits on the socket alone ([`POLL_PARK`], one `poll(2)`:
//! the floor's own wait), and only when that passes quietly parks the
//! executor (one io_uring peek, at most the idle tick). The executor's
//! park costs a turn of its run loop and its rings; under load, where a
//! park lasts microseconds, that turn was a fifth of the shard's CPU at
//! 60,000 getHost + report a second (perf/side_by_side.sh's shape). The
//! executor's other tasks (the control core's ring, the timers, local
//! connections) do not run while the thread waits in `poll(2)`: the loop
//! hands them the executor at least every [`YIELD_EVERY`] while it parks
//! on the socket ([`ParkPolicy::poll_parked`]), at once when the control
//! core rings the socket after queuing a message for the shard
//! ([`super::bell`]), and parks on the socket only while the shard has no
//! local connection (their requests come through the executor).

use std::time::{Duration, Instant};

/// How long a shard with a region keeps polling after the last request
/// before it parks.
pub const SHARD_SPIN: Duration = Duration::from_micros(50);

/// The shortest spin after a park that a request ended soon: a few looks
/// at the clock.
pub const MIN_SPIN: Duration = Duration::from_micros(5);

/// How long to spin after a park that a request ended `waited` after it
/// began: four times that, between [`MIN_SPIN`] and [`SHARD_SPIN`]; zero
/// when a spin of [`SHARD_SPIN`] would not have caught it.
pub fn spin_for(waited: Duration) -> Duration {
    if waited >= SHARD_SPIN {
        Duration::ZERO
    } else {
        (waited * 4).clamp(MIN_SPIN, SHARD_SPIN)
    }
}

/// Every this many turns a sweep looks at every slot, not only those
/// whose pending bit is set: a client that fails to set its bit is served
/// late, never lost.
pub const FULL_EVERY: u32 = 256;

/// Quiet turns of a shard with a region between two looks at the clock
/// (a quiet turn reads the pending words: tens of nanoseconds); and while
/// the slots keep it busy, requests served from them between two reads of
/// the socket (a read is a system call; read every 16 busy turns, it was a
/// tenth of a busy shard's time, perf): a UDP datagram waits for at most
/// the sweep that passes this many.
pub const QUIET_CHECK: u32 = 64;

/// Quiet turns of a shard with a region between two reads of the socket
/// (a few microseconds of spinning; see [`ParkPolicy::read_socket`]). Busy
/// clients leave gaps of about a microsecond between their requests, each
/// a few dozen quiet turns: read every [`QUIET_CHECK`] quiet turns, the
/// socket was read 420,000 times a second, each an empty `recvmmsg`, a
/// fifth of the shard's time in the kernel at 1.2M requests a second
/// (perf stat, 30 pinned clients).
pub const QUIET_READ: u32 = 256;

/// How long a park waits on the socket alone (`poll(2)`) before it parks
/// the executor: a shard under load is woken by its next datagram well
/// within it; a shard whose traffic stopped pays one such wait, then
/// parks the executor as before. Meanwhile the executor's timers (the
/// register deadlines, the once-a-second metrics) are late by at most
/// this much; the control core's messages are not (it rings,
/// [`super::bell`]).
///
/// Longer than a kernel tick (4 ms at the common `CONFIG_HZ=250`). With a
/// 1 ms wait the shard, pinned under 30 clients on the other core, slept a
/// third as often as the floor (whose wait is 50 ms) and did 0.90 of the
/// floor's getHost + report per CPU-second; the floor's own loop run on the
/// shard's thread with a 1 ms wait did the same, and with 3 ms or more it
/// matched the floor (perf/side_by_side.sh's shape, issue 29's closing
/// note). Why is not proven; the likely cause is that a wait shorter than
/// the tick makes its timer the core's next event, so that every park
/// reprograms the timer (a VM exit on a virtual machine): a 1 ms wait with
/// the thread's timer slack at 5 ms, which moves only the timer's latest
/// expiry, matched the floor too.
pub const POLL_PARK: Duration = Duration::from_millis(5);

/// While the loop parks on the socket alone, the longest it keeps the
/// executor's other tasks waiting: a route from the control core, a timer
/// (the register deadlines, the admission window) or a local connection's
/// request is late by at most about this much under load.
pub const YIELD_EVERY: Duration = Duration::from_millis(1);

/// A sweep in this many turns times one getHost for the service-time
/// histogram (two clock reads; the other sweeps time none).
pub const TIME_EVERY: u32 = 16;

/// What a turn's sweep of the slots does ([`ParkPolicy::sweep`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sweep {
    /// Look at every slot, not only those whose pending bit is set.
    pub full: bool,
    /// Time one getHost for the service-time histogram.
    pub time_one: bool,
}

/// What the loop does after a turn that received nothing from the socket
/// ([`ParkPolicy::quiet`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quiet {
    /// Yield to the executor's other tasks and turn again.
    Spin,
    /// Park: wait for a datagram or the idle tick.
    Park,
}

/// The request loop's spin/park state: its turns, the quiet turns in a
/// row and since when, and the credit toward the next read of the socket.
#[derive(Clone, Debug)]
pub struct ParkPolicy {
    /// A region with a client: the loop sweeps and spins for it.
    attached: bool,
    turn: u32,
    /// When the slots and the socket last had nothing (None: busy).
    quiet_since: Option<Instant>,
    quiet_turns: u32,
    /// Toward the next read of the socket, in quiet turns ([`QUIET_READ`]).
    udp_credit: u32,
    /// The next sweep looks at every slot.
    full_next: bool,
    /// When the loop last gave the executor a turn (None: not yet).
    executor_at: Option<Instant>,
    /// How long the next quiet stretch spins ([`ParkPolicy::woke`]; zero:
    /// it parks at once).
    spin: Duration,
    /// When the loop last parked with a region ([`ParkPolicy::parking`]).
    parked_at: Option<Instant>,
}

impl ParkPolicy {
    /// The policy of a shard with a shared-memory region (`region`) or
    /// without one. The first sweep looks at every slot.
    pub fn new(region: bool) -> Self {
        ParkPolicy {
            attached: region,
            turn: 0,
            quiet_since: None,
            quiet_turns: 0,
            udp_credit: 0,
            full_next: true,
            executor_at: None,
            spin: SHARD_SPIN,
            parked_at: None,
        }
    }

    /// A client now holds a slot of the shard's region (`true`), or none
    /// does any longer (`false`): with none, the loop behaves as without a
    /// region (reads the socket every turn, parks whenever it is empty);
    /// with one, as with a region, starting with a sweep of every slot.
    pub fn attach(&mut self, attached: bool) {
        if attached && !self.attached {
            self.spin = SHARD_SPIN;
            self.full_next = true;
            self.quiet_since = None;
            self.quiet_turns = 0;
            self.udp_credit = 0;
        }
        self.attached = attached;
    }

    /// Whether the loop sweeps and spins for a region now
    /// ([`ParkPolicy::attach`]).
    pub fn attached(&self) -> bool {
        self.attached
    }

    /// The loop came back at `now` from a park on the socket alone (it
    /// became readable within [`POLL_PARK`]): true when the executor's
    /// other tasks have waited [`YIELD_EVERY`] or more, and the loop is
    /// to give them a turn now ([`ParkPolicy::executor_turn`]).
    pub fn poll_parked(&mut self, now: Instant) -> bool {
        match self.executor_at {
            Some(at) => now.saturating_duration_since(at) >= YIELD_EVERY,
            None => {
                self.executor_at = Some(now);
                false
            }
        }
    }

    /// The executor ran its other tasks at `now` (the loop yielded to it,
    /// or parked it).
    pub fn executor_turn(&mut self, now: Instant) {
        self.executor_at = Some(now);
    }

    /// A new turn of a shard with a region: which slots its sweep looks at
    /// (every one at the first turn, every [`FULL_EVERY`] turns, and after
    /// a park that found a pending bit or that only the tick ended), and
    /// whether it times one getHost (every [`TIME_EVERY`] turns).
    pub fn sweep(&mut self) -> Sweep {
        self.turn = self.turn.wrapping_add(1);
        let full = self.full_next || self.turn % FULL_EVERY == 0;
        self.full_next = false;
        Sweep {
            full,
            time_one: self.turn % TIME_EVERY == 0,
        }
    }

    /// Whether this turn reads the socket, after a sweep that served
    /// `served` requests: always without a region; with one every
    /// [`QUIET_CHECK`] requests served or [`QUIET_READ`] quiet turns
    /// (credits counted in quiet turns: a request served is worth
    /// `QUIET_READ / QUIET_CHECK` of them).
    pub fn read_socket(&mut self, served: usize) -> bool {
        if !self.attached {
            return true;
        }
        self.udp_credit = self.udp_credit.saturating_add(if served > 0 {
            (served as u32).saturating_mul(QUIET_READ / QUIET_CHECK)
        } else {
            1
        });
        if self.udp_credit >= QUIET_READ {
            self.udp_credit = 0;
            true
        } else {
            false
        }
    }

    /// The socket gave a batch to handle: the loop is busy.
    pub fn received(&mut self) {
        self.quiet_since = None;
    }

    /// The socket gave nothing this turn, and the sweep served `served`:
    /// spin or park. With a region, a turn that served resets the quiet
    /// count; a quiet one spins, and every [`QUIET_CHECK`] quiet turns
    /// `look` is called (the shell lets the clients on its core run, and
    /// reads the clock): the loop parks once it has been quiet for the
    /// spin [`ParkPolicy::woke`] set ([`SHARD_SPIN`] at most), at once
    /// when that is zero. Without a region: park.
    pub fn quiet(&mut self, served: usize, look: impl FnOnce() -> Instant) -> Quiet {
        if !self.attached {
            return Quiet::Park;
        }
        if served > 0 {
            self.quiet_since = None;
            self.quiet_turns = 0;
            return Quiet::Spin;
        }
        if self.spin.is_zero() {
            // The clients were not that busy at the last park.
            return Quiet::Park;
        }
        self.quiet_turns = self.quiet_turns.wrapping_add(1);
        if self.quiet_turns % QUIET_CHECK != 0 {
            return Quiet::Spin;
        }
        let now = look();
        let since = *self.quiet_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.spin {
            Quiet::Spin
        } else {
            Quiet::Park
        }
    }

    /// About to park, a client had set a pending bit: do not park, sweep
    /// every slot at the next turn.
    pub fn pending(&mut self) {
        self.full_next = true;
    }

    /// A shard with a region parks now (`now`).
    pub fn parking(&mut self, now: Instant) {
        self.parked_at = Some(now);
    }

    /// Back from a park of a shard with a region at `now`: `woken` by a
    /// datagram (a request, a client's doorbell), or only by the tick. The
    /// socket is read at the next turn (the doorbell is there).
    ///
    /// Woken within [`SHARD_SPIN`] of the park ([`ParkPolicy::parking`]):
    /// a spin would have caught the request, so the next quiet stretch
    /// spins, four times that wait ([`MIN_SPIN`] at least, [`SHARD_SPIN`]
    /// at most). Woken later, or by the tick only: the clients are not busy
    /// enough for a spin to pay (a client of 200 requests a second had the
    /// shard spin 50 µs for nothing after each, most of a lightly loaded
    /// shard's CPU), so the next quiet stretch parks at once; the first
    /// wake within [`SHARD_SPIN`] brings the spin back. The tick only:
    /// sweep every slot once (a client that set no bit), then park again.
    pub fn woke(&mut self, woken: bool, now: impl FnOnce() -> Instant) {
        let now = now();
        self.udp_credit = QUIET_READ;
        self.spin = match self.parked_at {
            Some(at) if woken => spin_for(now.saturating_duration_since(at)),
            _ => Duration::ZERO,
        };
        if woken {
            self.quiet_since = None;
        } else {
            self.full_next = true;
            self.quiet_turns = QUIET_CHECK - 1;
            self.quiet_since = now.checked_sub(SHARD_SPIN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_on_the_socket_outlasts_a_kernel_tick() {
        // The tick is 4 ms at CONFIG_HZ=250. With a 1 ms wait the pinned
        // shard did 0.90 of the floor's getHost + report per CPU-second
        // (POLL_PARK's comment); what a client waits for rings the socket
        // instead (bell.rs).
        assert!(
            POLL_PARK > Duration::from_millis(4),
            "POLL_PARK must outlast a 250 Hz tick: see its comment before shortening it"
        );
        assert!(YIELD_EVERY <= POLL_PARK);
    }

    /// Quiet turns until the policy parks, `step` of time per look.
    fn turns_to_park(p: &mut ParkPolicy, t0: Instant, step: Duration) -> (u32, u32) {
        let (mut turns, mut looks) = (0, 0);
        let mut now = t0;
        loop {
            turns += 1;
            let q = p.quiet(0, || {
                looks += 1;
                let at = now;
                now += step;
                at
            });
            if q == Quiet::Park {
                return (turns, looks);
            }
            assert!(turns < 100_000, "never parks");
        }
    }

    #[test]
    fn without_a_region_every_turn_reads_the_socket_and_an_empty_one_parks() {
        let mut p = ParkPolicy::new(false);
        for _ in 0..1000 {
            assert!(p.read_socket(0));
            assert_eq!(p.quiet(0, || unreachable!("no clock")), Quiet::Park);
        }
    }

    #[test]
    fn a_quiet_loop_looks_at_the_clock_once_in_quiet_check_turns() {
        let mut p = ParkPolicy::new(true);
        let t0 = Instant::now();
        for _ in 1..QUIET_CHECK {
            assert_eq!(p.quiet(0, || unreachable!("not a look turn")), Quiet::Spin);
        }
        assert_eq!(p.quiet(0, || t0), Quiet::Spin, "the spin starts now");
    }

    #[test]
    fn it_spins_for_shard_spin_then_parks() {
        let mut p = ParkPolicy::new(true);
        let t0 = Instant::now();
        // 10 µs per look: quiet from the first look, parked at the one
        // SHARD_SPIN later.
        let (turns, looks) = turns_to_park(&mut p, t0, Duration::from_micros(10));
        assert_eq!(looks, 6);
        assert_eq!(turns, 6 * QUIET_CHECK);
    }

    #[test]
    fn a_turn_that_served_starts_the_quiet_count_again() {
        let mut p = ParkPolicy::new(true);
        let t0 = Instant::now();
        for _ in 1..QUIET_CHECK {
            assert_eq!(p.quiet(0, || unreachable!()), Quiet::Spin);
        }
        assert_eq!(p.quiet(3, || unreachable!()), Quiet::Spin);
        for _ in 1..QUIET_CHECK {
            assert_eq!(p.quiet(0, || unreachable!()), Quiet::Spin);
        }
        assert_eq!(p.quiet(0, || t0), Quiet::Spin);
        // Quiet since t0; a batch from the socket makes it busy again.
        p.received();
        for _ in 1..QUIET_CHECK {
            let _ = p.quiet(0, || unreachable!());
        }
        assert_eq!(
            p.quiet(0, || t0 + SHARD_SPIN),
            Quiet::Spin,
            "a new spin from this look"
        );
    }

    #[test]
    fn with_a_region_the_socket_is_read_every_quiet_check_requests_or_quiet_read_quiet_turns() {
        let mut p = ParkPolicy::new(true);
        let reads = (0..QUIET_READ * 4).filter(|_| p.read_socket(0)).count();
        assert_eq!(reads, 4, "one per QUIET_READ quiet turns");
        let mut p = ParkPolicy::new(true);
        let reads = (0..QUIET_CHECK * 4).filter(|_| p.read_socket(1)).count();
        assert_eq!(reads, 4, "one per QUIET_CHECK requests served one a turn");
        let mut p = ParkPolicy::new(true);
        let reads = (0..QUIET_CHECK).filter(|_| p.read_socket(16)).count();
        assert_eq!(reads, 16, "one per QUIET_CHECK requests served");
    }

    #[test]
    fn the_first_sweep_and_every_full_every_th_look_at_every_slot() {
        let mut p = ParkPolicy::new(true);
        let sweeps: Vec<Sweep> = (0..FULL_EVERY * 2).map(|_| p.sweep()).collect();
        let full: Vec<usize> = (0..sweeps.len()).filter(|&i| sweeps[i].full).collect();
        assert_eq!(
            full,
            [0, FULL_EVERY as usize - 1, 2 * FULL_EVERY as usize - 1]
        );
        let timed = sweeps.iter().filter(|s| s.time_one).count();
        assert_eq!(timed, (2 * FULL_EVERY / TIME_EVERY) as usize);
    }

    #[test]
    fn a_pending_bit_at_the_park_means_a_full_sweep_next() {
        let mut p = ParkPolicy::new(true);
        let _ = p.sweep();
        assert!(!p.sweep().full);
        p.pending();
        assert!(p.sweep().full);
        assert!(!p.sweep().full);
    }

    #[test]
    fn a_doorbell_reads_the_socket_next_and_a_new_spin_follows() {
        let mut p = ParkPolicy::new(true);
        assert!(p.sweep().full, "the first");
        let t0 = Instant::now();
        let _ = turns_to_park(&mut p, t0, SHARD_SPIN);
        let t1 = t0 + 2 * SHARD_SPIN;
        p.parking(t1);
        p.woke(true, || t1 + SHARD_SPIN / 2);
        assert!(p.read_socket(0), "the doorbell is in the socket");
        assert!(!p.sweep().full);
        let (turns, _) = turns_to_park(&mut p, t0, Duration::from_micros(10));
        assert_eq!(turns, 6 * QUIET_CHECK, "a whole spin again");
    }

    #[test]
    fn a_wake_long_after_the_park_parks_at_once_until_a_wake_comes_soon() {
        let mut p = ParkPolicy::new(true);
        let t0 = Instant::now();
        let _ = turns_to_park(&mut p, t0, SHARD_SPIN);
        // A client 5 ms later: a spin would not have caught it.
        let t1 = t0 + SHARD_SPIN;
        p.parking(t1);
        p.woke(true, || t1 + Duration::from_millis(5));
        assert_eq!(
            p.quiet(1, || unreachable!()),
            Quiet::Spin,
            "served: sweep again"
        );
        assert_eq!(
            p.quiet(0, || unreachable!("no clock")),
            Quiet::Park,
            "no spin"
        );
        // Its next request 3 µs after the park: spin again, 12 µs.
        let t2 = t1 + Duration::from_millis(6);
        p.parking(t2);
        p.woke(true, || t2 + Duration::from_micros(3));
        let (turns, looks) = turns_to_park(&mut p, t2, Duration::from_micros(4));
        assert_eq!(
            (turns, looks),
            (4 * QUIET_CHECK, 4),
            "looks at 0, 4, 8, 12 µs"
        );
        assert_eq!(spin_for(Duration::from_micros(20)), SHARD_SPIN);
        assert_eq!(spin_for(Duration::ZERO), MIN_SPIN);
        assert_eq!(spin_for(SHARD_SPIN), Duration::ZERO);
        // The tick only: no spin either.
        p.parking(t2);
        p.woke(false, || t2 + Duration::from_millis(200));
        assert_eq!(p.quiet(0, || unreachable!("no clock")), Quiet::Park);
    }

    #[test]
    fn a_region_nobody_holds_is_no_region_until_a_client_attaches() {
        let mut p = ParkPolicy::new(false);
        assert!(!p.attached());
        for _ in 0..100 {
            assert!(p.read_socket(0), "every turn");
            assert_eq!(p.quiet(0, || unreachable!("no clock")), Quiet::Park);
        }
        let _ = p.sweep();
        p.attach(true);
        assert!(p.attached());
        assert!(p.sweep().full, "the new client's request, bit or not");
        assert!(
            !p.read_socket(0),
            "from now on every QUIET_READ quiet turns"
        );
        let (turns, _) = turns_to_park(&mut p, Instant::now(), Duration::from_micros(10));
        assert_eq!(turns, 6 * QUIET_CHECK, "a whole spin");
        p.attach(false);
        assert!(p.read_socket(0));
        assert_eq!(p.quiet(0, || unreachable!("no clock")), Quiet::Park);
    }

    #[test]
    fn parked_on_the_socket_the_other_tasks_get_the_executor_every_yield_every() {
        let mut p = ParkPolicy::new(false);
        let t0 = Instant::now();
        assert!(!p.poll_parked(t0), "the first park starts the count");
        let step = Duration::from_micros(10);
        let mut now = t0;
        let mut yields = Vec::new();
        for i in 1..=250u32 {
            now += step;
            if p.poll_parked(now) {
                yields.push(i);
                p.executor_turn(now);
            }
        }
        // 1 ms in 10 µs parks: the 100th, 200th.
        assert_eq!(yields, [100, 200]);
        // An executor park counts as a turn too.
        p.executor_turn(now + YIELD_EVERY);
        assert!(!p.poll_parked(now + YIELD_EVERY + step));
        assert!(p.poll_parked(now + 2 * YIELD_EVERY));
    }

    #[test]
    fn after_the_idle_tick_one_full_sweep_then_park_again_without_spinning() {
        let mut p = ParkPolicy::new(true);
        let t0 = Instant::now();
        let _ = turns_to_park(&mut p, t0, SHARD_SPIN);
        let t1 = t0 + Duration::from_millis(200);
        p.woke(false, || t1);
        assert!(p.read_socket(0));
        assert!(p.sweep().full, "a client that set no bit");
        assert_eq!(p.quiet(0, || t1), Quiet::Park, "at once");
    }
}
