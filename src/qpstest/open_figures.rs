//! The open loop's figures of one step, with no clock and no socket:
//! whether the generator kept the offered rate, the uncorrected service
//! time beside the corrected latency, and the percentile spectrum kept for
//! plots and comparisons.

use std::fmt;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::schedule::Arrivals;
use super::summary::{Latency, Tally};

/// A step keeps its rate when at most this share of the requests its
/// schedule called for in the measured window went unsent.
pub const KEPT_SHARE: f64 = 0.99;

/// The percentiles kept in a summary's spectrum (HdrHistogram's usual
/// points: each nine, and the halves between).
pub const SPECTRUM: [f64; 12] = [
    0.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 99.999, 100.0,
];

/// One point of a latency spectrum.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpectrumPoint {
    /// The percentile, 0 to 100.
    pub percentile: f64,
    /// The latency at it, µs.
    pub us: f64,
}

/// The [`SPECTRUM`] of `h` (ns), in µs; empty when `h` is.
pub fn spectrum(h: &Histogram<u64>) -> Vec<SpectrumPoint> {
    if h.is_empty() {
        return Vec::new();
    }
    SPECTRUM
        .iter()
        .map(|&p| SpectrumPoint {
            percentile: p,
            us: h.value_at_percentile(p) as f64 / 1_000.0,
        })
        .collect()
}

/// What an open-loop step did besides answering getHosts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpenFigures {
    /// Requests per second the step offered.
    pub offered_rate: f64,
    /// How they arrived.
    pub arrivals: Arrivals,
    /// Seconds run before the measured window (not in any figure).
    pub warmup_s: f64,
    /// Requests the schedule called for in the measured window.
    pub scheduled: u64,
    /// Of those, getHosts sent.
    pub sent: u64,
    /// Of those, not sent: still waiting for a free thread when their
    /// timeout came (counted as `not_sent` errors).
    pub not_sent: u64,
    /// `sent / seconds`: the rate achieved.
    pub sent_rate: f64,
    /// At least [`KEPT_SHARE`] of `scheduled` was sent.
    pub rate_kept: bool,
    /// Share of the threads' time spent in calls (getHost, report, hold):
    /// near 1 when the rate was not kept, the threads waited on answers
    /// (more `--threads`); lower, the generator was short of CPU.
    pub threads_busy: f64,
    /// Why the step is not a valid measurement of the offered rate
    /// (printed as an `INVALID:` line); None when it is.
    pub invalid: Option<String>,
    /// Service time of the answered getHosts from their actual send, µs:
    /// what a closed loop would have reported.
    pub service_us: Option<Latency>,
    /// The corrected latency at each of [`SPECTRUM`]'s percentiles.
    pub spectrum_us: Vec<SpectrumPoint>,
}

impl OpenFigures {
    /// The figures of a step that offered `offered_rate` as `arrivals`,
    /// whose schedule called for `scheduled` requests in its measured
    /// window of `seconds`, run by `threads` threads, after `warmup_s`;
    /// `measured` is what the threads counted in that window.
    pub fn new(
        offered_rate: f64,
        arrivals: Arrivals,
        warmup_s: f64,
        scheduled: u64,
        measured: &Tally,
        seconds: f64,
        threads: u32,
    ) -> OpenFigures {
        let sent = measured.sent.min(scheduled);
        let not_sent = scheduled - sent;
        let rate_kept = sent as f64 >= KEPT_SHARE * scheduled as f64;
        let threads_busy =
            (measured.busy_ns as f64 / 1e9) / (f64::from(threads.max(1)) * seconds.max(1e-9));
        let invalid = (!rate_kept).then(|| {
            format!(
                "the generator did not keep the offered rate: it sent {sent} of the {scheduled} \
                 requests scheduled ({:.1}%; {not_sent} not sent); its threads were in calls {:.0}% \
                 of the time: {}",
                100.0 * sent as f64 / scheduled.max(1) as f64,
                100.0 * threads_busy.min(1.0),
                match threads_needed(offered_rate, measured) {
                    Some(n) if threads_busy >= 0.9 => format!(
                        "they waited on answers, so more --threads can keep it (about {n})"
                    ),
                    _ if threads_busy >= 0.9 => {
                        "they waited on answers, so more --threads can keep it".to_string()
                    }
                    _ => "the generator itself was short of CPU".to_string(),
                }
            )
        });
        OpenFigures {
            offered_rate,
            arrivals,
            warmup_s,
            scheduled,
            sent,
            not_sent,
            sent_rate: sent as f64 / seconds.max(1e-9),
            rate_kept,
            threads_busy,
            invalid,
            service_us: Latency::of(&measured.service),
            spectrum_us: spectrum(&measured.latency),
        }
    }
}

/// The threads that would keep `rate` with the time each request kept a
/// thread busy in `measured` (Little's law, with half again for the
/// variation); None when nothing was sent.
pub fn threads_needed(rate: f64, measured: &Tally) -> Option<u64> {
    (measured.sent > 0).then(|| {
        let per_request_s = measured.busy_ns as f64 / 1e9 / measured.sent as f64;
        (1.5 * rate * per_request_s).ceil().max(1.0) as u64
    })
}

impl fmt::Display for OpenFigures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = &self.invalid {
            writeln!(f, "INVALID: {why}")?;
        }
        writeln!(
            f,
            "open loop: offered {:.0}/s ({} arrivals, after {:.1} s warm-up); sent {} of {} scheduled \
             ({:.0}/s), rate {}",
            self.offered_rate,
            self.arrivals,
            self.warmup_s,
            self.sent,
            self.scheduled,
            self.sent_rate,
            if self.rate_kept { "kept" } else { "NOT kept" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qpstest::summary::Answer;

    fn measured(sent: u64, busy_s: f64) -> Tally {
        let mut t = Tally::new();
        t.sent = sent;
        t.busy_ns = (busy_s * 1e9) as u64;
        for i in 0..sent {
            t.answer(Answer::Agent, 1_000 + i);
            t.service.record(500).unwrap();
        }
        t
    }

    #[test]
    fn a_rate_sent_in_full_is_kept_and_valid() {
        let o = OpenFigures::new(
            1000.0,
            Arrivals::Constant,
            1.0,
            2000,
            &measured(1990, 1.0),
            2.0,
            4,
        );
        assert!(o.rate_kept && o.invalid.is_none(), "{o}");
        assert_eq!((o.sent, o.not_sent), (1990, 10));
        assert_eq!(o.sent_rate, 995.0);
        assert!(o.to_string().contains("rate kept"), "{o}");
        assert_eq!(o.spectrum_us.len(), SPECTRUM.len());
        assert!(o.service_us.is_some());
    }

    #[test]
    fn a_rate_not_sent_is_not_kept_and_says_why() {
        // Threads in calls all the time: they waited on answers.
        let o = OpenFigures::new(
            1e6,
            Arrivals::Constant,
            0.0,
            1_000_000,
            &measured(20_000, 1.98),
            1.0,
            2,
        );
        assert!(!o.rate_kept, "{o}");
        let why = o.invalid.clone().expect("invalid");
        assert!(
            why.contains("sent 20000 of the 1000000") && why.contains("more --threads"),
            "{why}"
        );
        // 2 threads busy 1.98 s for 20,000 requests: 99 µs each; 1e6/s
        // needs 99 of them, half again 149.
        assert!(why.contains("(about 149)"), "{why}");
        assert!(
            o.to_string()
                .starts_with("INVALID: the generator did not keep"),
            "{o}"
        );
        // Threads mostly idle yet behind: the generator's CPU.
        let o = OpenFigures::new(
            1e6,
            Arrivals::Poisson,
            0.0,
            1_000_000,
            &measured(20_000, 0.2),
            1.0,
            2,
        );
        assert!(o.invalid.unwrap().contains("short of CPU"));
    }
}
