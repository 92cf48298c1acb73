//! `--priority-mix`: getHosts with DAGOR priorities (issue 12), and what
//! each priority class got back. No sockets.
//!
//! A mix is `B:SHARE,B:SHARE,...` (e.g. `5:0.2,60:0.8`): each getHost draws
//! its business priority `B` with probability proportional to `SHARE`, and
//! a user priority uniformly from 1..=128 (as a keyed hash of many users
//! spreads them). Each class counts its calls, hosts, `Rejected` answers,
//! other errors, and the round-trip latency of its answered calls.

use std::fmt;
use std::str::FromStr;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::summary::{latency_histogram, Latency};
use crate::client::Priority;

/// The most classes a mix may name.
pub const MAX_CLASSES: usize = 16;

/// Business priorities and their shares of the getHosts.
#[derive(Clone, Debug, PartialEq)]
pub struct PriorityMix {
    /// `(business priority, share)`, shares summing to 1.
    classes: Vec<(u8, f64)>,
}

impl PriorityMix {
    /// The classes: business priority and share (summing to 1).
    pub fn classes(&self) -> &[(u8, f64)] {
        &self.classes
    }

    /// The class and priorities of one getHost, from a uniform random
    /// 64-bit `r`: the class by its share, the user priority uniform.
    pub fn draw(&self, r: u64) -> (usize, Priority) {
        let x = (r >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        let mut class = self.classes.len() - 1;
        for (i, &(_, share)) in self.classes.iter().enumerate() {
            acc += share;
            if x < acc {
                class = i;
                break;
            }
        }
        let user = (r % 128) as u8 + 1;
        (class, Priority::new(self.classes[class].0, user))
    }
}

impl FromStr for PriorityMix {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut classes: Vec<(u8, f64)> = Vec::new();
        for part in s.split(',') {
            let (b, share) = part
                .trim()
                .split_once(':')
                .ok_or_else(|| format!("{part:?} is not BUSINESS:SHARE (e.g. 5:0.2,60:0.8)"))?;
            let b: u8 = b
                .trim()
                .parse()
                .ok()
                .filter(|b| (1..=128).contains(b))
                .ok_or_else(|| format!("business priority {b:?} is not 1..=128"))?;
            let share: f64 = share
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("share {share:?} of class {b} is not a number above 0"))?;
            if classes.iter().any(|&(c, _)| c == b) {
                return Err(format!("business priority {b} is named twice"));
            }
            classes.push((b, share));
        }
        if classes.len() > MAX_CLASSES {
            return Err(format!("at most {MAX_CLASSES} classes"));
        }
        let total: f64 = classes.iter().map(|c| c.1).sum();
        for c in &mut classes {
            c.1 /= total;
        }
        Ok(PriorityMix { classes })
    }
}

impl fmt::Display for PriorityMix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (b, share)) in self.classes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{b}:{share}")?;
        }
        Ok(())
    }
}

/// What one priority class got (one thread's, or a run's merged).
#[derive(Clone, Debug)]
pub struct ClassTally {
    /// getHosts that returned a host.
    pub answered: u64,
    /// getHosts answered `Rejected` (the agent's own level, a downstream
    /// level, or the client's).
    pub rejected: u64,
    /// getHosts that failed otherwise.
    pub other_errors: u64,
    /// Round trips of the answered getHosts, ns.
    pub latency: Histogram<u64>,
    /// Round trips of the rejected getHosts, ns.
    pub rejected_latency: Histogram<u64>,
}

impl Default for ClassTally {
    fn default() -> Self {
        ClassTally {
            answered: 0,
            rejected: 0,
            other_errors: 0,
            latency: latency_histogram(),
            rejected_latency: latency_histogram(),
        }
    }
}

impl ClassTally {
    /// Counts one getHost: `Ok` answered, or the error's kind, after `ns`.
    pub fn count(&mut self, result: Result<(), &'static str>, ns: u64) {
        match result {
            Ok(()) => {
                self.answered += 1;
                self.latency.saturating_record(ns.max(1));
            }
            Err("rejected") => {
                self.rejected += 1;
                self.rejected_latency.saturating_record(ns.max(1));
            }
            Err(_) => self.other_errors += 1,
        }
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &ClassTally) {
        self.answered += other.answered;
        self.rejected += other.rejected;
        self.other_errors += other.other_errors;
        let _ = self.latency.add(&other.latency);
        let _ = self.rejected_latency.add(&other.rejected_latency);
    }

    /// Empties the tally, keeping its allocations.
    pub fn reset(&mut self) {
        self.answered = 0;
        self.rejected = 0;
        self.other_errors = 0;
        self.latency.reset();
        self.rejected_latency.reset();
    }
}

/// Adds every class of `other` into `into` (grown to fit).
pub fn merge_classes(into: &mut Vec<ClassTally>, other: &[ClassTally]) {
    if into.len() < other.len() {
        into.resize_with(other.len(), ClassTally::default);
    }
    for (a, b) in into.iter_mut().zip(other) {
        a.merge(b);
    }
}

/// One priority class in the summary.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassSummary {
    /// The class's business priority.
    pub business: u8,
    /// Its share of the getHosts asked for.
    pub share: f64,
    /// getHosts tried.
    pub calls: u64,
    /// Of which returned a host.
    pub answered: u64,
    /// Of which were answered `Rejected`.
    pub rejected: u64,
    /// Of which failed otherwise.
    pub other_errors: u64,
    /// `answered / calls` (0 when none).
    pub success: f64,
    /// Round trips of the answered getHosts, µs.
    pub latency_us: Option<Latency>,
    /// Round trips of the rejected getHosts, µs.
    pub rejected_latency_us: Option<Latency>,
}

/// The per-class summary of a run with `mix`.
pub fn summarize(mix: &PriorityMix, tallies: &[ClassTally]) -> Vec<ClassSummary> {
    mix.classes()
        .iter()
        .enumerate()
        .map(|(i, &(business, share))| {
            let empty = ClassTally::default();
            let t = tallies.get(i).unwrap_or(&empty);
            let calls = t.answered + t.rejected + t.other_errors;
            ClassSummary {
                business,
                share,
                calls,
                answered: t.answered,
                rejected: t.rejected,
                other_errors: t.other_errors,
                success: if calls == 0 {
                    0.0
                } else {
                    t.answered as f64 / calls as f64
                },
                latency_us: Latency::of(&t.latency),
                rejected_latency_us: Latency::of(&t.rejected_latency),
            }
        })
        .collect()
}

impl fmt::Display for ClassSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "priority {:>3} ({:.0}%): {} calls, answered {} ({:.1}%), rejected {}, other errors {}",
            self.business,
            100.0 * self.share,
            self.calls,
            self.answered,
            100.0 * self.success,
            self.rejected,
            self.other_errors
        )?;
        if let Some(l) = &self.latency_us {
            write!(f, "; answered p50 {:.1} µs p99 {:.1} µs", l.p50, l.p99)?;
        }
        Ok(())
    }
}

/// A small fast random generator for the draws (xorshift64*), one per
/// client thread.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from `seed` (any value).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mix_parses_normalizes_and_refuses_nonsense() {
        let m: PriorityMix = "5:0.2, 60:0.8".parse().unwrap();
        assert_eq!(m.classes(), &[(5, 0.2), (60, 0.8)]);
        let m: PriorityMix = "1:1,128:3".parse().unwrap();
        assert_eq!(m.classes(), &[(1, 0.25), (128, 0.75)]);
        assert_eq!(m.to_string(), "1:0.25,128:0.75");
        for bad in [
            "", "5", "0:1", "129:1", "5:0", "5:-1", "5:x", "5:1,5:2", "5:nan",
        ] {
            assert!(bad.parse::<PriorityMix>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn draws_follow_the_shares_and_spread_user_priorities() {
        let m: PriorityMix = "5:0.2,60:0.8".parse().unwrap();
        let mut rng = Rng::new(7);
        let mut counts = [0u32; 2];
        let mut users = [false; 129];
        for _ in 0..100_000 {
            let (c, p) = m.draw(rng.next_u64());
            counts[c] += 1;
            assert_eq!(p.business, m.classes()[c].0);
            assert!((1..=128).contains(&p.user));
            users[p.user as usize] = true;
        }
        let share = f64::from(counts[0]) / 100_000.0;
        assert!((share - 0.2).abs() < 0.01, "{share}");
        assert!(users[1..].iter().all(|&u| u), "every user priority drawn");
    }

    #[test]
    fn classes_count_answers_rejections_and_errors_apart() {
        let m: PriorityMix = "5:1,60:1".parse().unwrap();
        let mut a = vec![ClassTally::default(), ClassTally::default()];
        a[0].count(Ok(()), 1_000);
        a[0].count(Ok(()), 3_000);
        a[1].count(Err("rejected"), 500);
        a[1].count(Err("timeout"), 9_000);
        let mut total = Vec::new();
        merge_classes(&mut total, &a);
        merge_classes(&mut total, &a);
        let s = summarize(&m, &total);
        assert_eq!((s[0].calls, s[0].answered, s[0].success), (4, 4, 1.0));
        assert_eq!(
            (s[1].calls, s[1].rejected, s[1].other_errors, s[1].success),
            (4, 2, 2, 0.0)
        );
        assert!(s[1].latency_us.is_none() && s[1].rejected_latency_us.is_some());
        assert!(s[0].to_string().contains("answered 4 (100.0%)"));
        total[0].reset();
        assert_eq!(total[0].answered, 0);
    }
}
