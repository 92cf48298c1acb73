//! `lbagent qpstest compare A.json B.json`: two runs side by side, with
//! no clock and no socket.
//!
//! A run is what `qpstest --json` printed: a closed-loop summary (one
//! round), or an open-loop report (steps, each with its rounds: `--rounds
//! N`). Steps are paired in order. For each figure (answered getHosts per
//! second; latency p50, p90, p99, p99.9, max) each side gives the median
//! of its rounds and their range, and the ratio B / A of the medians.
//!
//! The noise test: a difference is beyond the runs' own noise when the
//! rounds of one side lie beyond those of the other (their ranges do not
//! overlap) and the medians differ by more than [`NOISE_FLOOR`]. With
//! [`TRIM_FROM`] rounds or more a side, the range leaves out the lowest
//! and the highest fifth of the rounds (one of 5 to 9, two of 10 to 14,
//! ...): a round that a stall of the machine spoiled does not hide a
//! difference. With [`MIN_ROUNDS`] rounds a side, ranges
//! that do not overlap happen by chance one time in ten between equal
//! builds (two orderings of six in twenty), which the floor guards. Fewer
//! rounds give no verdict.

use std::fmt;

use serde::Serialize;
use serde_json::Value;

use super::report::median;

/// Rounds each side needs for a verdict.
pub const MIN_ROUNDS: usize = 3;

/// Medians closer than this (relative) are the same, ranges or not.
pub const NOISE_FLOOR: f64 = 0.05;

/// From this many rounds a side, the range of the noise test leaves out
/// the lowest and the highest fifth of them.
pub const TRIM_FROM: usize = 5;

/// One figure of one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Figure {
    Qps,
    P50,
    P90,
    P99,
    P999,
    Max,
}

const FIGURES: [Figure; 6] = [
    Figure::Qps,
    Figure::P50,
    Figure::P90,
    Figure::P99,
    Figure::P999,
    Figure::Max,
];

impl Figure {
    fn name(self) -> &'static str {
        match self {
            Figure::Qps => "answered/s",
            Figure::P50 => "p50 µs",
            Figure::P90 => "p90 µs",
            Figure::P99 => "p99 µs",
            Figure::P999 => "p99.9 µs",
            Figure::Max => "max µs",
        }
    }

    fn of(self, summary: &Value) -> Option<f64> {
        let l = &summary["latency_us"];
        match self {
            Figure::Qps => summary["qps"].as_f64(),
            Figure::P50 => l["p50"].as_f64(),
            Figure::P90 => l["p90"].as_f64(),
            Figure::P99 => l["p99"].as_f64(),
            Figure::P999 => l["p999"].as_f64(),
            Figure::Max => l["max"].as_f64(),
        }
    }

    /// Higher is worse (latency), or better (throughput).
    fn higher_is_slower(self) -> bool {
        self != Figure::Qps
    }

    /// Counts toward the overall verdict (the extreme tail is left out:
    /// one stall of the machine moves it).
    fn decides(self) -> bool {
        matches!(self, Figure::Qps | Figure::P50 | Figure::P90 | Figure::P99)
    }
}

/// The rounds of one step of a run file.
#[derive(Clone, Debug, PartialEq)]
pub struct RunStep {
    /// What the step was: `2000/s` (open loop) or `closed loop`.
    pub label: String,
    /// Each round's summary.
    pub rounds: Vec<Value>,
}

/// The steps of a run file (what `qpstest --json` printed).
///
/// # Errors
/// The value is neither a closed-loop summary nor an open-loop report.
pub fn steps_of(run: &Value) -> Result<Vec<RunStep>, String> {
    if run["mode"] == "open" {
        let steps = run["steps"]
            .as_array()
            .ok_or("an open-loop report without \"steps\"")?;
        return steps
            .iter()
            .map(|s| {
                let rounds = s["rounds"]
                    .as_array()
                    .filter(|r| !r.is_empty())
                    .ok_or("a step without \"rounds\"")?;
                Ok(RunStep {
                    label: format!("{:.0}/s", s["offered_rate"].as_f64().unwrap_or(0.0)),
                    rounds: rounds.clone(),
                })
            })
            .collect();
    }
    if run["get_hosts"].is_u64() {
        return Ok(vec![RunStep {
            label: "closed loop".into(),
            rounds: vec![run.clone()],
        }]);
    }
    Err("not a qpstest --json result (neither a summary nor an open-loop report)".into())
}

/// One side of one figure: the median of the rounds and their range.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Side {
    /// Median of the rounds.
    pub median: f64,
    /// Lowest round.
    pub min: f64,
    /// Highest round.
    pub max: f64,
    /// The noise test's range, low end: the lowest round, or from
    /// [`TRIM_FROM`] rounds the lowest above the lowest fifth.
    pub lo: f64,
    /// Its high end.
    pub hi: f64,
    /// Rounds with this figure.
    pub rounds: usize,
}

impl Side {
    fn of(values: &[f64]) -> Option<Side> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let trim = if n >= TRIM_FROM { n / 5 } else { 0 };
        Some(Side {
            median: median(&v)?,
            min: v[0],
            max: v[n - 1],
            lo: v[trim],
            hi: v[n - 1 - trim],
            rounds: n,
        })
    }
}

/// What a figure says of B against A.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Within the runs' noise.
    Same,
    /// B is slower, beyond the noise.
    Slower,
    /// B is faster, beyond the noise.
    Faster,
    /// Fewer than [`MIN_ROUNDS`] rounds on a side, or a figure missing.
    NoVerdict,
}

/// The noise test on one figure (`higher_is_slower` for latency).
pub fn judge(a: &Side, b: &Side, higher_is_slower: bool) -> Verdict {
    if a.rounds < MIN_ROUNDS || b.rounds < MIN_ROUNDS {
        return Verdict::NoVerdict;
    }
    let apart = b.lo > a.hi || b.hi < a.lo;
    let ratio = b.median / a.median;
    if !apart || !ratio.is_finite() || (ratio - 1.0).abs() <= NOISE_FLOOR {
        return Verdict::Same;
    }
    if (ratio > 1.0) == higher_is_slower {
        Verdict::Slower
    } else {
        Verdict::Faster
    }
}

/// One figure of one step, both sides.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Line {
    /// The figure's name.
    pub figure: &'static str,
    /// Run A.
    pub a: Option<Side>,
    /// Run B.
    pub b: Option<Side>,
    /// B's median over A's.
    pub ratio: Option<f64>,
    /// The noise test's verdict.
    pub verdict: Verdict,
}

/// A step of both runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepComparison {
    /// A's step label (B's when it differs, after a slash).
    pub label: String,
    /// One line per figure.
    pub lines: Vec<Line>,
}

/// The comparison of two runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    /// Step by step.
    pub steps: Vec<StepComparison>,
    /// Overall: Slower when a deciding figure (answered/s, p50, p90, p99)
    /// of some step is slower and none faster; Faster the other way;
    /// Same when none is either, or both are (mixed: said in the text).
    pub verdict: Verdict,
    /// Some deciding figures were slower and others faster.
    pub mixed: bool,
}

/// Compares run B with run A.
///
/// # Errors
/// A value is not a run, or the runs have different numbers of steps.
pub fn compare(a: &Value, b: &Value) -> Result<Comparison, String> {
    let (sa, sb) = (
        steps_of(a).map_err(|e| format!("A: {e}"))?,
        steps_of(b).map_err(|e| format!("B: {e}"))?,
    );
    if sa.len() != sb.len() {
        return Err(format!(
            "A has {} steps and B {}: compare runs of the same rates",
            sa.len(),
            sb.len()
        ));
    }
    let mut steps = Vec::new();
    let (mut slower, mut faster, mut undecided) = (false, false, false);
    for (x, y) in sa.iter().zip(&sb) {
        let mut lines = Vec::new();
        for fig in FIGURES {
            let vals = |s: &RunStep| {
                s.rounds
                    .iter()
                    .filter_map(|r| fig.of(r))
                    .collect::<Vec<_>>()
            };
            let (a, b) = (Side::of(&vals(x)), Side::of(&vals(y)));
            let verdict = match (&a, &b) {
                (Some(a), Some(b)) => judge(a, b, fig.higher_is_slower()),
                _ => Verdict::NoVerdict,
            };
            if fig.decides() {
                slower |= verdict == Verdict::Slower;
                faster |= verdict == Verdict::Faster;
                undecided |= verdict == Verdict::NoVerdict;
            }
            let ratio = a
                .zip(b)
                .map(|(a, b)| b.median / a.median)
                .filter(|r| r.is_finite());
            lines.push(Line {
                figure: fig.name(),
                a,
                b,
                ratio,
                verdict,
            });
        }
        let label = if x.label == y.label {
            x.label.clone()
        } else {
            format!("{} / {}", x.label, y.label)
        };
        steps.push(StepComparison { label, lines });
    }
    let verdict = match (slower, faster) {
        (true, false) => Verdict::Slower,
        (false, true) => Verdict::Faster,
        (false, false) if undecided => Verdict::NoVerdict,
        _ => Verdict::Same,
    };
    Ok(Comparison {
        steps,
        verdict,
        mixed: slower && faster,
    })
}

fn side(s: &Option<Side>) -> String {
    s.map_or("-".into(), |s| {
        format!("{:.1} [{:.1}..{:.1}] n={}", s.median, s.lo, s.hi, s.rounds)
    })
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "B against A: median of the rounds [lowest..highest; from {TRIM_FROM} rounds without \
             the lowest and highest fifth], ratio B/A; beyond noise: the ranges do not overlap and the \
             medians differ by more than {:.0}% ({MIN_ROUNDS}+ rounds a side)",
            NOISE_FLOOR * 100.0
        )?;
        for s in &self.steps {
            writeln!(f, "{}:", s.label)?;
            writeln!(
                f,
                "  {:<11} {:>34} {:>34} {:>7}  verdict",
                "figure", "A", "B", "B/A"
            )?;
            for l in &s.lines {
                writeln!(
                    f,
                    "  {:<11} {:>34} {:>34} {:>7}  {}",
                    l.figure,
                    side(&l.a),
                    side(&l.b),
                    l.ratio.map_or("-".into(), |r| format!("{r:.3}")),
                    match l.verdict {
                        Verdict::Same => "same (within noise)",
                        Verdict::Slower => "B SLOWER",
                        Verdict::Faster => "B faster",
                        Verdict::NoVerdict => "no verdict (too few rounds)",
                    }
                )?;
            }
        }
        write!(
            f,
            "verdict: {}",
            match (self.verdict, self.mixed) {
                (_, true) => "mixed: B is slower in some figures and faster in others",
                (Verdict::Slower, _) => "B is SLOWER than A, beyond the runs' noise",
                (Verdict::Faster, _) => "B is faster than A, beyond the runs' noise",
                (Verdict::Same, _) => "the same within the runs' noise",
                (Verdict::NoVerdict, _) => {
                    "no verdict: give each run at least 3 rounds (--rounds 3)"
                }
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round(qps: f64, p50: f64) -> Value {
        json!({"qps": qps, "get_hosts": 1, "latency_us": {
            "p50": p50, "p90": p50 * 1.5, "p99": p50 * 2.0, "p999": p50 * 3.0, "max": p50 * 9.0}})
    }

    fn open(rounds: &[(f64, f64)]) -> Value {
        let r: Vec<Value> = rounds.iter().map(|&(q, p)| round(q, p)).collect();
        json!({"mode": "open", "steps": [{"offered_rate": 2000.0, "rounds": r}]})
    }

    #[test]
    fn overlapping_rounds_are_the_same_and_apart_ones_beyond_noise() {
        let a = open(&[(2000.0, 100.0), (2000.0, 104.0), (2000.0, 98.0)]);
        let same = open(&[(2000.0, 101.0), (2000.0, 97.0), (2000.0, 103.0)]);
        let c = compare(&a, &same).unwrap();
        assert_eq!(c.verdict, Verdict::Same, "{c}");
        let slow = open(&[(2000.0, 121.0), (2000.0, 125.0), (2000.0, 118.0)]);
        let c = compare(&a, &slow).unwrap();
        assert_eq!(c.verdict, Verdict::Slower, "{c}");
        let p50 = &c.steps[0].lines[1];
        assert_eq!((p50.figure, p50.verdict), ("p50 µs", Verdict::Slower));
        assert!((p50.ratio.unwrap() - 1.21).abs() < 0.01);
        assert!(c.to_string().contains("B is SLOWER"), "{c}");
        assert_eq!(compare(&slow, &a).unwrap().verdict, Verdict::Faster);
    }

    #[test]
    fn from_five_rounds_one_spoiled_round_a_side_does_not_hide_a_difference() {
        let a = open(&[
            (50.0, 100.0),
            (50.0, 101.0),
            (50.0, 275.0),
            (50.0, 100.5),
            (50.0, 100.2),
        ]);
        let b = open(&[
            (50.0, 120.0),
            (50.0, 211.0),
            (50.0, 121.0),
            (50.0, 124.0),
            (50.0, 120.3),
        ]);
        let c = compare(&a, &b).unwrap();
        assert_eq!(c.verdict, Verdict::Slower, "{c}");
        let p50 = c.steps[0].lines[1].b.unwrap();
        assert_eq!(
            (p50.min, p50.lo, p50.hi, p50.max),
            (120.0, 120.3, 124.0, 211.0)
        );
        // Three rounds: every round counts, and the spoiled one overlaps.
        let a3 = open(&[(50.0, 100.0), (50.0, 275.0), (50.0, 100.5)]);
        let b3 = open(&[(50.0, 120.0), (50.0, 121.0), (50.0, 124.0)]);
        assert_eq!(compare(&a3, &b3).unwrap().verdict, Verdict::Same);
    }

    #[test]
    fn a_small_difference_is_noise_even_when_the_ranges_do_not_overlap() {
        let a = open(&[(2000.0, 100.0), (2000.0, 100.5), (2000.0, 101.0)]);
        let b = open(&[(2000.0, 102.0), (2000.0, 102.5), (2000.0, 103.0)]);
        assert_eq!(compare(&a, &b).unwrap().verdict, Verdict::Same);
    }

    #[test]
    fn fewer_rounds_give_no_verdict_and_lower_throughput_is_slower() {
        let one = round(100_000.0, 300.0);
        let c = compare(&one, &round(50_000.0, 300.0)).unwrap();
        assert_eq!(c.verdict, Verdict::NoVerdict, "{c}");
        assert_eq!(c.steps[0].label, "closed loop");
        assert!((c.steps[0].lines[0].ratio.unwrap() - 0.5).abs() < 1e-9);
        let a = open(&[(2000.0, 100.0), (2010.0, 100.0), (1990.0, 100.0)]);
        let b = open(&[(1500.0, 100.0), (1510.0, 100.0), (1490.0, 100.0)]);
        assert_eq!(compare(&a, &b).unwrap().verdict, Verdict::Slower);
    }

    #[test]
    fn what_is_not_a_run_is_refused_with_the_side_named() {
        let e = compare(&json!({"x": 1}), &round(1.0, 1.0)).unwrap_err();
        assert!(e.starts_with("A: not a qpstest --json result"), "{e}");
        let two = json!({"mode": "open", "steps": [
            {"offered_rate": 1.0, "rounds": [round(1.0, 1.0)]},
            {"offered_rate": 2.0, "rounds": [round(1.0, 1.0)]}]});
        let e = compare(&open(&[(1.0, 1.0)]), &two).unwrap_err();
        assert!(e.contains("A has 1 steps and B 2"), "{e}");
    }
}
