//! The report of an open-loop run, with no clock and no socket: every
//! step with its rounds, one row per step (medians of the rounds), the
//! knee of a sweep, and whether every step was a valid measurement.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use super::open::OpenLoop;
use super::schedule::Arrivals;
use super::summary::Summary;
use super::sweep::{knee, Knee, StepPoint};
use super::QpsOptions;

/// The median of `v` (the mean of the middle two for an even count);
/// None when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    })
}

/// One step's row: medians over its rounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Requests per second offered.
    pub offered: f64,
    /// getHosts sent per second.
    pub sent: f64,
    /// getHosts answered per second.
    pub answered: f64,
    /// Errors by kind, summed over the rounds (`not_sent` included).
    pub errors: BTreeMap<String, u64>,
    /// Corrected latency percentiles, µs (None: nothing answered).
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// 99.9th percentile.
    pub p999: Option<f64>,
    /// The largest.
    pub max: Option<f64>,
    /// The uncorrected service time's 99th percentile, µs.
    pub service_p99: Option<f64>,
    /// Every round kept the offered rate.
    pub kept: bool,
}

impl Row {
    fn of(offered: f64, rounds: &[Summary]) -> Row {
        let pick = |f: &dyn Fn(&Summary) -> Option<f64>| {
            median(&rounds.iter().filter_map(f).collect::<Vec<_>>())
        };
        let mut errors = BTreeMap::new();
        for s in rounds {
            for (k, n) in &s.errors {
                *errors.entry(k.clone()).or_insert(0) += n;
            }
        }
        Row {
            offered,
            sent: pick(&|s| s.open_loop.as_ref().map(|o| o.sent_rate)).unwrap_or(0.0),
            answered: pick(&|s| Some(s.qps)).unwrap_or(0.0),
            errors,
            p50: pick(&|s| s.latency_us.map(|l| l.p50)),
            p90: pick(&|s| s.latency_us.map(|l| l.p90)),
            p99: pick(&|s| s.latency_us.map(|l| l.p99)),
            p999: pick(&|s| s.latency_us.map(|l| l.p999)),
            max: pick(&|s| s.latency_us.map(|l| l.max)),
            service_p99: pick(&|s| {
                s.open_loop
                    .as_ref()
                    .and_then(|o| o.service_us)
                    .map(|l| l.p99)
            }),
            kept: rounds
                .iter()
                .all(|s| s.open_loop.as_ref().is_some_and(|o| o.rate_kept)),
        }
    }
}

/// One step of an open-loop run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepReport {
    /// Requests per second offered.
    pub offered_rate: f64,
    /// Medians of the rounds.
    pub row: Row,
    /// Each round's summary, in the order run.
    pub rounds: Vec<Summary>,
}

impl StepReport {
    /// The step that offered `rate`, run as `rounds`.
    pub fn new(rate: f64, rounds: Vec<Summary>) -> StepReport {
        StepReport {
            offered_rate: rate,
            row: Row::of(rate, &rounds),
            rounds,
        }
    }
}

/// What an open-loop run prints at the end, and `--json` prints as one
/// object.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpenReport {
    /// Always `"open"` (a closed-loop summary has no `mode`).
    pub mode: &'static str,
    /// What was measured: "floor", "agent" or "standalone".
    pub target: String,
    /// `udp` or `shm`.
    pub transport: String,
    /// Client threads.
    pub threads: u32,
    /// How requests arrived.
    pub arrivals: Arrivals,
    /// Seconds of warm-up before each step's measured window.
    pub warmup_s: f64,
    /// Seconds of each measured window.
    pub duration_s: f64,
    /// Rounds per step.
    pub rounds: u32,
    /// Every step, in the order run.
    pub steps: Vec<StepReport>,
    /// Where the knee lies (sweeps only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub knee: Option<Knee>,
    /// Every round of every step kept its offered rate.
    pub valid: bool,
}

impl OpenReport {
    /// The report of `steps`, run with `opts` and `open`.
    pub fn new(opts: &QpsOptions, open: &OpenLoop, steps: Vec<StepReport>) -> OpenReport {
        let points: Vec<StepPoint> = steps
            .iter()
            .map(|s| StepPoint {
                offered: s.row.offered,
                answered: s.row.answered,
                p99_us: s.row.p99,
                kept: s.row.kept,
            })
            .collect();
        OpenReport {
            mode: "open",
            target: steps
                .first()
                .and_then(|s| s.rounds.first())
                .map_or_else(String::new, |s| s.info.target.clone()),
            transport: format!("{:?}", opts.transport).to_lowercase(),
            threads: opts.threads,
            arrivals: open.arrivals,
            warmup_s: opts.warmup.as_secs_f64(),
            duration_s: opts.duration.as_secs_f64(),
            rounds: open.rounds,
            knee: (steps.len() > 1).then(|| knee(&points)),
            valid: steps.iter().all(|s| s.row.kept),
            steps,
        }
    }

    /// The report as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a report always serializes")
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}

impl fmt::Display for OpenReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "open loop, {} over {}, {} threads, {} arrivals, {:.1} s warm-up + {:.1} s per step{}",
            self.target,
            self.transport,
            self.threads,
            self.arrivals,
            self.warmup_s,
            self.duration_s,
            if self.rounds > 1 {
                format!(", medians of {} rounds", self.rounds)
            } else {
                String::new()
            }
        )?;
        writeln!(
            f,
            "latency from the intended send time, µs; svc p99: the uncorrected service time"
        )?;
        writeln!(
            f,
            "{:>11} {:>11} {:>11} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  {:<8} errors",
            "offered/s",
            "sent/s",
            "answered/s",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "svc p99",
            "rate"
        )?;
        for (i, s) in self.steps.iter().enumerate() {
            let r = &s.row;
            let errors = if r.errors.is_empty() {
                "none".to_string()
            } else {
                r.errors
                    .iter()
                    .map(|(k, n)| format!("{k} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            write!(
                f,
                "{:>11.0} {:>11.0} {:>11.0} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  {:<8} {errors}",
                r.offered,
                r.sent,
                r.answered,
                opt(r.p50),
                opt(r.p90),
                opt(r.p99),
                opt(r.p999),
                opt(r.max),
                opt(r.service_p99),
                if r.kept { "kept" } else { "NOT KEPT" },
            )?;
            if self.knee == Some(Knee::At(i)) {
                write!(f, "  <- knee")?;
            }
            writeln!(f)?;
        }
        match self.knee {
            Some(Knee::BeforeFirst) => writeln!(f, "knee: before the first step")?,
            Some(Knee::BeyondLast) => writeln!(f, "knee: beyond the last step")?,
            _ => {}
        }
        if !self.valid {
            write!(
                f,
                "INVALID: the generator did not keep the offered rate at every step (rows NOT KEPT)"
            )?;
        } else {
            write!(f, "every step kept its offered rate")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
    }
}
