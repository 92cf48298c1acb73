//! The open loop's schedule: when each request is meant to be sent, as
//! nanoseconds from the start of a step, with no clock and no socket.
//!
//! A request's latency is measured from the time this schedule gave it
//! (its *intended* send time), not from when a thread got around to
//! sending it: a stalled agent then shows as the latency of every request
//! that should have been sent during the stall (coordinated omission
//! corrected, as wrk2 does), not as a pause in the load.
//!
//! Owns the arrival processes and nothing else: the threads that follow
//! the schedule live in [`super::open`].

use std::fmt;

use super::mix::Rng;

/// How requests arrive at a fixed mean rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arrivals {
    /// Evenly spaced: request `k` at `k / rate` seconds.
    #[default]
    Constant,
    /// A Poisson process: independent exponential gaps of mean `1 / rate`.
    Poisson,
}

impl fmt::Display for Arrivals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arrivals::Constant => "constant",
            Arrivals::Poisson => "poisson",
        })
    }
}

/// The intended send times of one step: an endless, deterministic
/// sequence (the same `seed` gives the same times).
#[derive(Clone, Debug)]
pub struct Schedule {
    arrivals: Arrivals,
    /// Requests per second.
    rate: f64,
    /// Mean gap between requests, ns (fractional: 300k/s is 3333.3 ns).
    gap_ns: f64,
    /// Requests handed out so far.
    taken: u64,
    /// The Poisson process's running time, ns.
    clock_ns: f64,
    rng: Rng,
    /// The seed the draws started from.
    seed: u64,
}

impl Schedule {
    /// The schedule of `rate` requests per second (above 0) arriving as
    /// `arrivals`, its Poisson draws seeded by `seed`.
    pub fn new(rate: f64, arrivals: Arrivals, seed: u64) -> Schedule {
        Schedule {
            arrivals,
            rate,
            gap_ns: 1e9 / rate.max(f64::MIN_POSITIVE),
            taken: 0,
            clock_ns: 0.0,
            rng: Rng::new(seed),
            seed,
        }
    }

    /// The next request's intended send time, ns from the step's start
    /// (never decreasing).
    pub fn next_ns(&mut self) -> u64 {
        let t = match self.arrivals {
            Arrivals::Constant => self.taken as f64 * self.gap_ns,
            Arrivals::Poisson => {
                // Uniform in (0, 1]: ln never sees 0.
                let u = ((self.rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                self.clock_ns += -u.ln() * self.gap_ns;
                self.clock_ns
            }
        };
        self.taken += 1;
        t as u64
    }

    /// Requests handed out so far.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// The same schedule from its start.
    pub fn restarted(&self) -> Schedule {
        Schedule::new(self.rate, self.arrivals, self.seed)
    }
}

/// Counts a schedule's requests as time passes: how many fall due before
/// a given time (the offered rate of the live line, the requests a step's
/// measured window calls for).
#[derive(Clone, Debug)]
pub struct DueCounter {
    schedule: Schedule,
    next: u64,
}

impl DueCounter {
    /// A counter over `schedule` from its start.
    pub fn new(schedule: &Schedule) -> DueCounter {
        let mut schedule = schedule.restarted();
        let next = schedule.next_ns();
        DueCounter { schedule, next }
    }

    /// The requests due before `ns` (from the step's start) not counted
    /// by an earlier call.
    pub fn until(&mut self, ns: u64) -> u64 {
        let mut n = 0;
        while self.next < ns {
            n += 1;
            self.next = self.schedule.next_ns();
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_arrivals_are_evenly_spaced_at_the_rate() {
        let mut s = Schedule::new(300_000.0, Arrivals::Constant, 1);
        let t: Vec<u64> = (0..4).map(|_| s.next_ns()).collect();
        assert_eq!(t, [0, 3_333, 6_666, 10_000]);
        assert_eq!(s.taken(), 4);
        // A second at 300k/s calls for 300k requests, a half for half.
        let mut due = DueCounter::new(&s);
        assert_eq!(due.until(500_000_000), 150_000);
        assert_eq!(due.until(1_000_000_000), 150_000);
        assert_eq!(due.until(1_000_000_000), 0);
    }

    #[test]
    fn poisson_arrivals_keep_the_mean_rate_with_exponential_gaps() {
        let mut s = Schedule::new(10_000.0, Arrivals::Poisson, 7);
        let n = 200_000;
        let times: Vec<u64> = (0..n).map(|_| s.next_ns()).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "never decreasing");
        let gaps: Vec<f64> = times.windows(2).map(|w| (w[1] - w[0]) as f64).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        // Mean gap 100 µs; an exponential's standard deviation equals its
        // mean (a constant schedule's is 0).
        assert!((mean / 100_000.0 - 1.0).abs() < 0.01, "{mean}");
        assert!((var.sqrt() / mean - 1.0).abs() < 0.02, "{}", var.sqrt());
        // The same seed gives the same times; the count agrees with them.
        let mut again = Schedule::new(10_000.0, Arrivals::Poisson, 7);
        assert_eq!(again.next_ns(), times[0]);
        let mut due = DueCounter::new(&s);
        assert_eq!(due.until(times[10] + 1), 11);
        assert_eq!(due.until(times[20] + 1), 10);
    }

    #[test]
    fn arrivals_print_by_name() {
        assert_eq!(Arrivals::Constant.to_string(), "constant");
        assert_eq!(Arrivals::Poisson.to_string(), "poisson");
    }
}
