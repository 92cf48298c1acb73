//! The percentile spectrum of a latency histogram as HdrHistogram's
//! `.hgrm` text (what its Java `outputPercentileDistribution` prints and
//! its plotter, `HistogramLogAnalyzer` and wrk2 users read): values in
//! microseconds, five steps per halving of the distance to 100%.
//!
//! The `hdrhistogram` crate iterates the quantiles; only the text layout
//! is written here.

use std::io::{self, BufWriter, Write};
use std::path::Path;

use anyhow::Context;

use hdrhistogram::Histogram;

/// Quantile steps per halving of the remaining distance to 100% (the
/// Java tool's default).
const TICKS_PER_HALF_DISTANCE: u32 = 5;

/// Writes the spectrum of `h` (ns) to `out`, values in µs.
///
/// # Errors
/// `out` failing.
pub fn write(h: &Histogram<u64>, out: &mut dyn Write) -> io::Result<()> {
    let us = |ns: u64| ns as f64 / 1_000.0;
    writeln!(
        out,
        "{:>12} {:>14} {:>10} {:>14}\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    )?;
    let mut total = 0u64;
    for v in h.iter_quantiles(TICKS_PER_HALF_DISTANCE) {
        total += v.count_since_last_iteration();
        let q = v.quantile_iterated_to();
        let value = us(h.highest_equivalent(v.value_iterated_to()));
        if q < 1.0 {
            writeln!(
                out,
                "{value:12.3} {q:2.12} {total:10} {:14.2}",
                1.0 / (1.0 - q)
            )?;
        } else {
            writeln!(out, "{value:12.3} {q:2.12} {total:10}")?;
        }
    }
    writeln!(
        out,
        "#[Mean    = {:12.3}, StdDeviation   = {:12.3}]",
        h.mean() / 1_000.0,
        h.stdev() / 1_000.0
    )?;
    writeln!(
        out,
        "#[Max     = {:12.3}, Total count    = {:12}]",
        us(h.max()),
        h.len()
    )?;
    writeln!(
        out,
        "#[Buckets = {:12}, SubBuckets     = {:12}]",
        h.buckets(),
        h.distinct_values()
    )
}

/// Writes the spectrum of `h` (ns) to a file at `path` (`--percentiles`).
///
/// # Errors
/// The file cannot be created or written.
pub fn write_file(path: &Path, h: &Histogram<u64>) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = BufWriter::new(file);
    write(h, &mut out)
        .and_then(|()| out.flush())
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qpstest::summary::latency_histogram;

    #[test]
    fn the_spectrum_climbs_to_the_max_and_counts_every_value() {
        let mut h = latency_histogram();
        for us in 1..=1000u64 {
            h.record(us * 1_000).unwrap();
        }
        let mut out = Vec::new();
        write(&h, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let rows: Vec<Vec<f64>> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty() && !l.contains("Value"))
            .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
            .collect();
        assert!(rows.len() > 20, "{text}");
        assert!(rows
            .windows(2)
            .all(|w| w[0][0] <= w[1][0] && w[0][1] <= w[1][1]));
        let last = rows.last().unwrap();
        assert_eq!(last.len(), 3, "the 100% row has no 1/(1-p)");
        assert_eq!((last[1], last[2]), (1.0, 1000.0));
        assert!((last[0] - 1000.0).abs() < 1.0, "{last:?}");
        let median = rows.iter().find(|r| r[1] >= 0.5).unwrap();
        assert!((median[0] - 500.0).abs() < 1.0, "{median:?}");
        assert!(text.contains("Total count    =         1000]"), "{text}");
    }
}
