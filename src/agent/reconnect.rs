//! Where a reconnecting client's connection stands, without I/O: the server
//! list and the rotation through it, the capped, jittered exponential
//! back-off between attempts, and whether an attempt is due. Pure: time is
//! an argument, randomness a seeded generator.
//!
//! # The back-off
//!
//! After `n` consecutive failures the next attempt waits a delay drawn
//! uniformly from `0..=min(max, initial * 2^n)` ("full jitter"): agents
//! that lost their servers at the same instant (every route server
//! restarted, a switch rebooted) spread their attempts over the whole
//! window instead of coming back in step, and the window's cap bounds how
//! long an agent waits once its server is reachable again. The clients'
//! defaults (`initial` 100 ms, `max` 1000 ms) put the next attempt of an
//! agent cut off for any length of time at most 1 s plus the attempt in
//! progress (`connect_timeout_ms`, 1 s) away from the heal. What that
//! costs the servers: an agent at the cap tries every 0.5 s on average
//! while its attempts are refused at once (a server's port closed: one
//! SYN and one RST each), so 10,000 agents whose servers are down offer
//! about 20,000 attempts a second in all, the kernel's work; once a
//! server listens, each agent's next attempt connects, and those 10,000
//! arrive spread over about one cap (see the test
//! `a_fleet_restart_is_spread_over_the_cap_not_synchronised`).
//!
//! The route client's and the statistics client's cores each hold one and
//! state only their protocol around it. The server list and the back-off
//! bounds can be replaced at runtime ([`Reconnect::reconfigure`], e.g. on a
//! configuration reload): the connection in place is kept, the new list is
//! used from the next attempt on.
//!
//! Must not know any message: it never sees a frame.

use std::net::SocketAddr;

/// When the shell must call a client's core again (its `poll_timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// At this instant (ms) at the latest.
    At(u64),
    /// The connection is dead (nothing heard while answers were due):
    /// close it and call the core's `on_disconnected`.
    Drop,
    /// No deadline: only a frame, an input item or the end of a connect
    /// attempt moves things on.
    Never,
}

/// The connection's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// Not connected; the next attempt is due at this instant (ms).
    Idle {
        /// When the next attempt may start.
        next_attempt_at: u64,
    },
    /// The shell is connecting to [`Reconnect::current_addr`].
    Connecting,
    /// Connected to [`Reconnect::current_addr`].
    Connected,
}

/// The servers to rotate through and the back-off between attempts, in ms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// The servers, in order of preference (never empty: the clients'
    /// `validate` refuses an empty list).
    pub addrs: Vec<SocketAddr>,
    /// The first reconnection delay; it doubles per failed attempt.
    pub backoff_initial_ms: u64,
    /// The longest reconnection delay.
    pub backoff_max_ms: u64,
}

/// A connection's lifecycle: see the module docs.
#[derive(Debug)]
pub struct Reconnect {
    policy: ReconnectPolicy,
    state: LinkState,
    /// Index in `policy.addrs` of the current (or next) server.
    index: usize,
    /// Consecutive failures since the last connection that proved healthy.
    failures: u32,
    rng: fastrand::Rng,
    /// A policy given while connected or connecting: applied when that
    /// connection ends.
    pending: Option<ReconnectPolicy>,
}

/// The reconnection delay after `failures` consecutive failures: drawn
/// uniformly with `rng` from `0..=min(max, initial * 2^failures)` (no
/// overflow): full jitter, see the module docs.
pub fn backoff_delay(initial: u64, max: u64, failures: u32, rng: &mut fastrand::Rng) -> u64 {
    rng.u64(0..=backoff_window(initial, max, failures))
}

/// The window the delay after `failures` consecutive failures is drawn
/// from: `min(max, initial * 2^failures)`, without overflow.
pub fn backoff_window(initial: u64, max: u64, failures: u32) -> u64 {
    1u64.checked_shl(failures)
        .and_then(|factor| initial.checked_mul(factor))
        .map_or(max, |d| d.min(max))
}

impl Reconnect {
    /// Disconnected, the first attempt (to the first server) due at once.
    ///
    /// # Panics
    /// When `policy.addrs` is empty (the clients validate it first).
    pub fn new(policy: ReconnectPolicy, jitter_seed: u64) -> Self {
        assert!(!policy.addrs.is_empty(), "at least one server");
        Reconnect {
            policy,
            state: LinkState::Idle { next_attempt_at: 0 },
            index: 0,
            failures: 0,
            rng: fastrand::Rng::with_seed(jitter_seed),
            pending: None,
        }
    }

    /// The state.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Whether connected.
    pub fn is_connected(&self) -> bool {
        self.state == LinkState::Connected
    }

    /// The server connected to, or being connected to, or next to try.
    pub fn current_addr(&self) -> SocketAddr {
        self.policy.addrs[self.index]
    }

    /// The connected server, if any.
    pub fn connected(&self) -> Option<SocketAddr> {
        self.is_connected().then(|| self.current_addr())
    }

    /// Consecutive failures since the last healthy connection.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The address to connect to now, when disconnected and the back-off
    /// has elapsed; then [`Self::on_connected`] or [`Self::on_disconnected`]
    /// must follow.
    pub fn poll_connect(&mut self, now: u64) -> Option<SocketAddr> {
        match self.state {
            LinkState::Idle { next_attempt_at } if now >= next_attempt_at => {
                self.state = LinkState::Connecting;
                Some(self.current_addr())
            }
            _ => None,
        }
    }

    /// The connection to [`Self::current_addr`] is up.
    pub fn on_connected(&mut self) {
        self.state = LinkState::Connected;
    }

    /// The peer answered on this connection: it is healthy, the back-off
    /// starts over.
    pub fn on_healthy(&mut self) {
        self.failures = 0;
    }

    /// The connection (or the attempt) ended: the next attempt goes to the
    /// next server after a delay drawn from `0..=min(max, initial *
    /// 2^failures)` (full jitter).
    pub fn on_disconnected(&mut self, now: u64) {
        if let Some(policy) = self.pending.take() {
            // Go on from the server just left when the new list has it,
            // else start at the new list's first.
            let current = self.current_addr();
            let last = policy.addrs.len() - 1;
            self.index = policy
                .addrs
                .iter()
                .position(|a| *a == current)
                .unwrap_or(last);
            self.policy = policy;
        }
        let delay = self.backoff();
        self.failures = self.failures.saturating_add(1);
        self.index = (self.index + 1) % self.policy.addrs.len();
        self.state = LinkState::Idle {
            next_attempt_at: now.saturating_add(delay),
        };
    }

    /// Makes an attempt due at `now` unless connected (an attempt under way
    /// is taken as abandoned): for a last flush on shutdown.
    pub fn attempt_now(&mut self, now: u64) {
        if !self.is_connected() {
            self.state = LinkState::Idle {
                next_attempt_at: now,
            };
        }
    }

    /// When the next attempt is due, while disconnected and not connecting.
    pub fn next_attempt_at(&self) -> Option<u64> {
        match self.state {
            LinkState::Idle { next_attempt_at } => Some(next_attempt_at),
            _ => None,
        }
    }

    /// Replaces the server list and the back-off bounds (a reload). A
    /// connection in place (or an attempt under way) is kept, and the new
    /// policy applies when it ends: the next attempt goes to the server
    /// after it in the new list, or to the new list's first when it is not
    /// in it. While waiting for an attempt, the policy applies at once and
    /// the attempt keeps its time (to the same server if the new list has
    /// it, else to the new list's first).
    ///
    /// # Panics
    /// When `policy.addrs` is empty (validate first).
    pub fn reconfigure(&mut self, policy: ReconnectPolicy) {
        assert!(!policy.addrs.is_empty(), "at least one server");
        if !matches!(self.state, LinkState::Idle { .. }) {
            self.pending = Some(policy);
            return;
        }
        let current = self.current_addr();
        self.index = policy.addrs.iter().position(|a| *a == current).unwrap_or(0);
        self.policy = policy;
        self.pending = None;
    }

    /// The policy in force.
    pub fn policy(&self) -> &ReconnectPolicy {
        &self.policy
    }

    /// The delay before the next attempt, for the failures so far.
    pub fn backoff(&mut self) -> u64 {
        let p = &self.policy;
        backoff_delay(
            p.backoff_initial_ms,
            p.backoff_max_ms,
            self.failures,
            &mut self.rng,
        )
    }

    /// Sets the failure count (tests of the back-off's bounds).
    #[cfg(test)]
    pub(crate) fn set_failures(&mut self, failures: u32) {
        self.failures = failures;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn policy(ports: &[u16]) -> ReconnectPolicy {
        ReconnectPolicy {
            addrs: ports.iter().map(|&p| addr(p)).collect(),
            backoff_initial_ms: 100,
            backoff_max_ms: 5000,
        }
    }

    /// Fails `n` attempts in a row; returns (address tried, delay after).
    fn fail(r: &mut Reconnect, n: usize) -> Vec<(SocketAddr, u64)> {
        let mut now = 0;
        (0..n)
            .map(|_| {
                let tried = r.poll_connect(now).expect("an attempt is due");
                r.on_disconnected(now);
                let at = r.next_attempt_at().unwrap();
                let delay = at - now;
                now = at;
                (tried, delay)
            })
            .collect()
    }

    #[test]
    fn attempts_rotate_through_the_servers_and_wrap() {
        let mut r = Reconnect::new(policy(&[1, 2, 3]), 7);
        let tried: Vec<SocketAddr> = fail(&mut r, 7).into_iter().map(|(a, _)| a).collect();
        assert_eq!(
            tried,
            [1, 2, 3, 1, 2, 3, 1].map(addr).to_vec(),
            "round robin"
        );
    }

    #[test]
    fn the_backoff_doubles_to_the_cap_within_its_jitter() {
        for seed in 0..100 {
            let mut r = Reconnect::new(policy(&[1]), seed);
            for (n, (_, delay)) in fail(&mut r, 12).into_iter().enumerate() {
                let base = (100u64 << n).min(5000);
                assert!(delay <= base, "seed {seed} #{n}: {delay}");
            }
        }
    }

    #[test]
    fn the_jitter_is_full_delays_spread_over_the_whole_window() {
        // At the cap (5000 ms here), 1,000 agents' delays cover the window
        // evenly: a quarter of them in its first quarter, none synchronised
        // at its top (a jitter "down by up to half" put none below 2500).
        let delays: Vec<u64> = (0..1000)
            .map(|seed| {
                let mut r = Reconnect::new(policy(&[1]), seed);
                r.set_failures(20);
                r.backoff()
            })
            .collect();
        let low = delays.iter().filter(|&&d| d < 1250).count();
        assert!((150..=350).contains(&low), "{low} of 1000 below 1250 ms");
        let mean = delays.iter().sum::<u64>() / 1000;
        assert!((2200..=2800).contains(&mean), "mean {mean} ms");
    }

    #[test]
    fn a_fleet_restart_is_spread_over_the_cap_not_synchronised() {
        // 10,000 agents with the clients' default back-off (100 ms doubling
        // to 1000 ms) lose their three servers at 0 ms; every attempt is
        // refused at once until the servers listen again at 3000 ms.
        const AGENTS: u64 = 10_000;
        const UP: u64 = 3000;
        let defaults = crate::routeclient::RouteClientConfig::new(vec![addr(1)]);
        let (initial, max) = (defaults.backoff_initial_ms, defaults.backoff_max_ms);
        let mut attempts_down = 0u64;
        let mut second_before_up = 0u64;
        let mut connected_at = Vec::new();
        for seed in 0..AGENTS {
            let mut r = Reconnect::new(
                ReconnectPolicy {
                    addrs: vec![addr(1), addr(2), addr(3)],
                    backoff_initial_ms: initial,
                    backoff_max_ms: max,
                },
                seed,
            );
            r.poll_connect(0).unwrap();
            r.on_connected();
            r.on_disconnected(0);
            loop {
                let at = r.next_attempt_at().unwrap();
                r.poll_connect(at).unwrap();
                if at >= UP {
                    r.on_connected();
                    connected_at.push(at - UP);
                    break;
                }
                attempts_down += 1;
                second_before_up += u64::from(at >= UP - 1000);
                r.on_disconnected(at);
            }
        }
        // Back within one cap (1 s) of the servers' return.
        let last = *connected_at.iter().max().unwrap();
        assert!(last <= 1000, "the last agent connected {last} ms after");
        // Spread: no 100 ms holds a quarter of the fleet (in step, one
        // would hold all of it); the first, the busiest, about a fifth.
        let mut per_100ms = [0u64; 11];
        for &t in &connected_at {
            per_100ms[(t / 100) as usize] += 1;
        }
        let peak = *per_100ms.iter().max().unwrap();
        eprintln!("connections per 100 ms after the servers came back: {per_100ms:?}; attempts in the second before: {second_before_up}; last {last} ms");
        assert!(
            peak < AGENTS / 4,
            "{peak} connections in one 100 ms: {per_100ms:?}"
        );
        // What a fleet of 10,000 offers servers that refuse: about 20,000
        // attempts a second (each agent every 0.5 s on average).
        assert!(
            (15_000..=25_000).contains(&second_before_up),
            "{second_before_up} attempts in the second before the servers came back"
        );
        assert!(attempts_down > AGENTS * 3);
    }

    #[test]
    fn nothing_is_due_before_the_backoff_elapses_or_while_connecting() {
        let mut r = Reconnect::new(policy(&[1, 2]), 3);
        assert_eq!(r.poll_connect(0), Some(addr(1)));
        assert_eq!(r.poll_connect(0), None, "connecting");
        r.on_disconnected(10);
        let at = r.next_attempt_at().unwrap();
        assert_eq!(r.poll_connect(at - 1), None);
        assert_eq!(r.poll_connect(at), Some(addr(2)));
        r.on_connected();
        assert_eq!(r.connected(), Some(addr(2)));
        assert_eq!(r.poll_connect(u64::MAX), None, "connected");
    }

    #[test]
    fn a_healthy_connection_starts_the_backoff_over() {
        let mut r = Reconnect::new(policy(&[1]), 3);
        fail(&mut r, 6);
        assert_eq!(r.failures(), 6);
        r.on_healthy();
        assert_eq!(r.failures(), 0);
        assert!(r.backoff() <= 100);
    }

    #[test]
    fn the_backoff_never_overflows() {
        let mut r = Reconnect::new(
            ReconnectPolicy {
                addrs: vec![addr(1)],
                backoff_initial_ms: u64::MAX / 2,
                backoff_max_ms: u64::MAX,
            },
            1,
        );
        for f in [0, 1, 63, 64, 65, u32::MAX] {
            let window = backoff_window(u64::MAX / 2, u64::MAX, f);
            assert!(window >= u64::MAX / 2, "{f} failures: {window}");
            r.set_failures(f);
            r.backoff();
        }
        r.poll_connect(u64::MAX).unwrap();
        r.on_disconnected(u64::MAX);
        assert_eq!(r.next_attempt_at(), Some(u64::MAX));
    }

    #[test]
    fn a_new_server_list_keeps_the_connection_and_is_used_from_the_next_attempt() {
        let mut r = Reconnect::new(policy(&[1, 2]), 3);
        r.poll_connect(0).unwrap();
        r.on_connected();
        // The connected server stays in the list: kept, and the rotation
        // goes on from it in the new order.
        r.reconfigure(policy(&[9, 1, 8]));
        assert_eq!(r.connected(), Some(addr(1)));
        r.on_disconnected(0);
        let at = r.next_attempt_at().unwrap();
        assert_eq!(r.poll_connect(at), Some(addr(8)));
        // The current server dropped from the list: the next attempt starts
        // at the new list's first.
        r.on_disconnected(at);
        r.reconfigure(policy(&[5, 6]));
        let at = r.next_attempt_at().unwrap();
        assert_eq!(r.poll_connect(at), Some(addr(5)));
    }

    #[test]
    fn new_backoff_bounds_apply_to_the_next_delay() {
        let mut r = Reconnect::new(policy(&[1]), 3);
        fail(&mut r, 10);
        r.reconfigure(ReconnectPolicy {
            addrs: vec![addr(1)],
            backoff_initial_ms: 10,
            backoff_max_ms: 40,
        });
        assert!(r.backoff() <= 40);
    }

    #[test]
    fn a_flush_makes_an_attempt_due_now_unless_connected() {
        let mut r = Reconnect::new(policy(&[1]), 3);
        r.poll_connect(0).unwrap();
        r.on_disconnected(0);
        r.attempt_now(1);
        assert_eq!(r.poll_connect(1), Some(addr(1)));
        r.attempt_now(2);
        assert_eq!(
            r.poll_connect(2),
            Some(addr(1)),
            "an attempt under way is abandoned"
        );
        r.on_connected();
        r.attempt_now(3);
        assert!(r.is_connected());
    }
}
