//! Rate sweeps, with no clock and no socket: the `--rate` argument (one
//! rate, a list, or `FROM:TO:STEP`) and the knee of a latency-vs-throughput
//! curve.

use std::fmt;
use std::str::FromStr;

/// The most steps a sweep may have.
pub const MAX_STEPS: usize = 1_000;

/// The highest rate a step may offer, requests per second.
pub const MAX_RATE: f64 = 100_000_000.0;

/// The offered rates of an open-loop run, requests per second, in the
/// order they are run: `--rate 200000`, `--rate 50k,100k,200k` or
/// `--rate 50k:500k:50k` (from, to inclusive, step). `k` and `m` multiply
/// by a thousand and a million.
#[derive(Clone, Debug, PartialEq)]
pub struct RatePlan(Vec<f64>);

impl RatePlan {
    /// The rates, in order.
    pub fn rates(&self) -> &[f64] {
        &self.0
    }

    /// True when the plan has more than one step.
    pub fn is_sweep(&self) -> bool {
        self.0.len() > 1
    }
}

/// One rate: a number above 0 and at most [`MAX_RATE`], with an optional
/// `k` / `m` suffix.
fn rate(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (digits, scale) = match t.as_bytes().last() {
        Some(b'k' | b'K') => (&t[..t.len() - 1], 1e3),
        Some(b'm' | b'M') => (&t[..t.len() - 1], 1e6),
        _ => (t, 1.0),
    };
    let v = digits
        .parse::<f64>()
        .ok()
        .map(|v| v * scale)
        .filter(|v| v.is_finite() && *v > 0.0 && *v <= MAX_RATE)
        .ok_or_else(|| {
            format!("rate {t:?} is not a number of requests per second in (0, 100m] (e.g. 50k)")
        })?;
    Ok(v)
}

impl FromStr for RatePlan {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let rates = match s.split(':').collect::<Vec<_>>()[..] {
            [one] => one.split(',').map(rate).collect::<Result<Vec<_>, _>>()?,
            [from, to, step] => {
                let (from, to, step) = (rate(from)?, rate(to)?, rate(step)?);
                if to < from {
                    return Err(format!("sweep {s:?}: TO is below FROM"));
                }
                let n = ((to - from) / step + 1e-9).floor() as usize + 1;
                if n > MAX_STEPS {
                    return Err(format!("sweep {s:?} has {n} steps: at most {MAX_STEPS}"));
                }
                (0..n).map(|i| from + step * i as f64).collect()
            }
            _ => return Err(format!("{s:?} is not RATE, RATE,RATE,... or FROM:TO:STEP")),
        };
        if rates.len() > MAX_STEPS {
            return Err(format!("{} rates: at most {MAX_STEPS}", rates.len()));
        }
        Ok(RatePlan(rates))
    }
}

impl fmt::Display for RatePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// What the knee finder needs of one step of a sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPoint {
    /// Requests per second the step offered.
    pub offered: f64,
    /// getHosts answered per second.
    pub answered: f64,
    /// The corrected 99th percentile latency, µs (None: nothing answered).
    pub p99_us: Option<f64>,
    /// The generator kept the offered rate.
    pub kept: bool,
}

/// A step is past the knee when the agent answered less than this share
/// of what was offered...
pub const KNEE_ANSWERED_SHARE: f64 = 0.95;

/// ... or its p99 is this many times the lowest p99 of the steps before
/// it: an open loop's latency stays nearly flat until the server
/// saturates, then its queue grows for as long as the step lasts.
pub const KNEE_P99_FACTOR: f64 = 10.0;

/// Where a sweep's knee lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Knee {
    /// At this step (index in the order run): the last one before the
    /// first step past it.
    At(usize),
    /// Before the first step: it is already past the knee.
    BeforeFirst,
    /// Beyond the last step: no step is past it.
    BeyondLast,
}

/// The knee of a sweep (steps in the order run, rates rising): the last
/// step before the first one past it (see [`KNEE_ANSWERED_SHARE`],
/// [`KNEE_P99_FACTOR`]; a step whose rate the generator did not keep is
/// past it too: nothing from there on measures the agent).
pub fn knee(steps: &[StepPoint]) -> Knee {
    let mut best_p99 = f64::INFINITY;
    for (i, s) in steps.iter().enumerate() {
        let starved = s.answered < KNEE_ANSWERED_SHARE * s.offered;
        let slow = s.p99_us.is_none_or(|p| p > KNEE_P99_FACTOR * best_p99);
        if !s.kept || starved || slow {
            return i.checked_sub(1).map_or(Knee::BeforeFirst, Knee::At);
        }
        best_p99 = best_p99.min(s.p99_us.unwrap_or(f64::INFINITY));
    }
    Knee::BeyondLast
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_a_list_and_a_range_parse() {
        let p = |s: &str| s.parse::<RatePlan>().map(|p| p.rates().to_vec());
        assert_eq!(p("200000").unwrap(), [200_000.0]);
        assert_eq!(p("1.5k").unwrap(), [1_500.0]);
        assert_eq!(p("50k,100K,1m").unwrap(), [50e3, 100e3, 1e6]);
        let sweep = p("50k:500k:50k").unwrap();
        assert_eq!(sweep.len(), 10);
        assert_eq!((sweep[0], sweep[9]), (50e3, 500e3));
        assert_eq!(p("10:25:10").unwrap(), [10.0, 20.0]);
        assert!(!"5k".parse::<RatePlan>().unwrap().is_sweep());
        assert!("1k,2k".parse::<RatePlan>().unwrap().is_sweep());
    }

    #[test]
    fn nonsense_rates_are_refused_with_the_reason() {
        for (bad, says) in [
            ("", "not a number"),
            ("0", "not a number"),
            ("-5", "not a number"),
            ("1e9", "not a number"),
            ("fast", "not a number"),
            ("5k,", "not a number"),
            ("500k:50k:50k", "TO is below FROM"),
            ("1:100k:1", "at most 1000"),
            ("1:2", "FROM:TO:STEP"),
            ("1:2:3:4", "FROM:TO:STEP"),
        ] {
            let e = bad.parse::<RatePlan>().unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    fn point(offered: f64, answered: f64, p99: f64) -> StepPoint {
        StepPoint {
            offered,
            answered,
            p99_us: Some(p99),
            kept: true,
        }
    }

    #[test]
    fn the_knee_is_the_last_step_before_latency_or_throughput_gives_way() {
        // Flat latency (noise within 3x), then the queue grows.
        let curve = [
            point(10e3, 10e3, 80.0),
            point(20e3, 20e3, 200.0),
            point(30e3, 29.9e3, 120.0),
            point(40e3, 39e3, 5_000.0),
            point(50e3, 41e3, 400_000.0),
        ];
        assert_eq!(knee(&curve), Knee::At(2));
        // Throughput that stops following the offered rate, latency or not.
        let starved = [point(10e3, 10e3, 80.0), point(20e3, 15e3, 90.0)];
        assert_eq!(knee(&starved), Knee::At(0));
        // A rate the generator did not keep ends the curve.
        let mut unkept = curve;
        unkept[1].kept = false;
        assert_eq!(knee(&unkept), Knee::At(0));
        // Nothing answered at a step: past the knee.
        let mut silent = curve;
        silent[2].p99_us = None;
        assert_eq!(knee(&silent), Knee::At(1));
    }

    #[test]
    fn a_knee_before_the_first_step_and_beyond_the_last_are_told_apart() {
        let fine = [point(10e3, 10e3, 80.0), point(20e3, 20e3, 90.0)];
        assert_eq!(knee(&fine), Knee::BeyondLast);
        let overloaded = [point(10e3, 5e3, 80.0), point(20e3, 5e3, 90.0)];
        assert_eq!(knee(&overloaded), Knee::BeforeFirst);
    }
}
