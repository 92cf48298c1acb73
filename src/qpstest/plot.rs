//! `--plot FILE.png` and `lbagent qpstest plot`: open-loop reports drawn
//! with plotters. Left, latency by percentile on HdrHistogram's usual
//! axis (the distance to 100% in nines: 90%, 99%, 99.9%, ...), one line
//! per step of each run (at most five a run; the round with the median
//! p99); right, the latency-vs-throughput curve (p50,
//! p99, p99.9 against the answered rate), one set per run. Both latency
//! axes are logarithmic.
//!
//! Reads the reports as JSON values (what `--json` printed), so that a
//! run just made and runs read from files are drawn alike. Text needs a
//! TrueType font: DejaVu Sans (Debian's `fonts-dejavu-core`) or the file
//! named by `LBAGENT_PLOT_FONT`.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

/// The rightmost percentile drawn, in nines (6: 99.9999%).
const MAX_NINES: f64 = 6.0;

/// A percentile as nines: `-log10(1 - p/100)`, capped at [`MAX_NINES`].
pub fn nines(percentile: f64) -> f64 {
    let rest = 1.0 - percentile / 100.0;
    if rest <= 10f64.powf(-MAX_NINES) {
        MAX_NINES
    } else {
        -rest.log10()
    }
}

/// The percentile label of `nines` on the axis: `0%`, `90%`, `99.9%`.
fn percent_label(nines: f64) -> String {
    let p = 100.0 * (1.0 - 10f64.powf(-nines));
    let s = format!("{p:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}%")
}

/// A latency label: whole µs, or one decimal below 10.
fn us_label(us: f64) -> String {
    if us < 10.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// One line to draw: its legend and its points.
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
}

/// At most this many steps of a run get a spectrum line (evenly chosen,
/// the first and the last among them): more are unreadable.
const MAX_SPECTRA: usize = 5;

/// Indices of at most `max` of `n` steps, evenly spread, first and last kept.
fn spread(n: usize, max: usize) -> Vec<usize> {
    if n <= max {
        return (0..n).collect();
    }
    let mut v: Vec<usize> = (0..max).map(|i| i * (n - 1) / (max - 1)).collect();
    v.dedup();
    v
}

fn spectra(name: &str, run: &Value) -> Vec<Series> {
    let steps = run["steps"].as_array().cloned().unwrap_or_default();
    spread(steps.len(), MAX_SPECTRA)
        .into_iter()
        .map(|i| &steps[i])
        .filter_map(|s| {
            let round = median_round(s["rounds"].as_array()?)?;
            let points: Vec<(f64, f64)> = round["open_loop"]["spectrum_us"]
                .as_array()?
                .iter()
                .filter_map(|p| {
                    Some((nines(p["percentile"].as_f64()?), p["us"].as_f64()?.max(0.1)))
                })
                .collect();
            let rate = s["offered_rate"].as_f64().unwrap_or(0.0);
            Some(Series {
                label: format!("{name}{:.0}/s", rate),
                points,
            })
        })
        .collect()
}

/// The round whose corrected p99 is the median of the rounds' (the
/// lower middle one of an even count): the spectrum drawn for a step.
fn median_round(rounds: &[Value]) -> Option<&Value> {
    let mut by_p99: Vec<&Value> = rounds.iter().collect();
    by_p99.sort_by(|a, b| {
        let p = |v: &Value| v["latency_us"]["p99"].as_f64().unwrap_or(f64::INFINITY);
        p(a).total_cmp(&p(b))
    });
    by_p99.get(by_p99.len().saturating_sub(1) / 2).copied()
}

fn curves(name: &str, run: &Value) -> Vec<Series> {
    let steps = run["steps"].as_array().cloned().unwrap_or_default();
    ["p50", "p99", "p999"]
        .iter()
        .map(|k| Series {
            label: format!("{name}{}", if *k == "p999" { "p99.9" } else { k }),
            points: steps
                .iter()
                .filter_map(|s| {
                    Some((
                        s["row"]["answered"].as_f64()?,
                        s["row"][k].as_f64()?.max(0.1),
                    ))
                })
                .collect(),
        })
        .collect()
}

/// Loads a TrueType font for the text.
fn font() -> Result<&'static [u8], String> {
    let candidates: Vec<PathBuf> = std::env::var_os("LBAGENT_PLOT_FONT")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            [
                "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/TTF/DejaVuSans.ttf",
                "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            ]
            .map(PathBuf::from),
        )
        .collect();
    for p in &candidates {
        if let Ok(bytes) = std::fs::read(p) {
            return Ok(Box::leak(bytes.into_boxed_slice()));
        }
    }
    Err("no TrueType font found: install fonts-dejavu-core or set LBAGENT_PLOT_FONT".into())
}

fn palette(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(20, 60, 200),
        RGBColor(220, 100, 0),
        RGBColor(30, 150, 60),
        RGBColor(200, 30, 40),
        RGBColor(130, 60, 180),
        RGBColor(120, 80, 40),
        RGBColor(220, 80, 170),
        RGBColor(90, 90, 90),
        RGBColor(170, 170, 20),
        RGBColor(20, 170, 190),
    ];
    C[i % C.len()]
}

/// Draws `runs` (a name, empty for a single run, and a report as JSON)
/// into a PNG at `path`.
///
/// # Errors
/// No font, a report with nothing to draw, or the file cannot be written.
pub fn draw(runs: &[(&str, &Value)], path: &Path) -> Result<(), String> {
    let named = |n: &str| {
        if n.is_empty() {
            String::new()
        } else {
            format!("{n} ")
        }
    };
    let spectra: Vec<Series> = runs
        .iter()
        .flat_map(|(n, r)| spectra(&named(n), r))
        .collect();
    let curves: Vec<Series> = runs
        .iter()
        .flat_map(|(n, r)| curves(&named(n), r))
        .collect();
    let all_y = spectra
        .iter()
        .chain(&curves)
        .flat_map(|s| s.points.iter().map(|p| p.1));
    let (lo, hi) = all_y.fold((f64::INFINITY, 0.0f64), |(lo, hi), y| {
        (lo.min(y), hi.max(y))
    });
    if !lo.is_finite() {
        return Err("nothing to draw: no open-loop step answered a getHost".into());
    }
    let (lo, hi) = (lo / 2.0, hi * 2.0);
    let max_x = curves
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(1.0f64, f64::max);
    plotters::style::register_font("sans-serif", FontStyle::Normal, font()?)
        .map_err(|_| "the font file is not a usable TrueType font".to_string())?;
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let panels = root.split_evenly((1, 2));

    let mut left = ChartBuilder::on(&panels[0])
        .caption(
            "latency by percentile (from the intended send time)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..MAX_NINES, (lo..hi).log_scale())
        .map_err(err)?;
    left.configure_mesh()
        .x_labels(7)
        .x_label_formatter(&|x| percent_label(*x))
        .y_label_formatter(&|y| us_label(*y))
        .x_desc("percentile")
        .y_desc("latency, µs")
        .draw()
        .map_err(err)?;
    for (i, s) in spectra.iter().enumerate() {
        let c = palette(i);
        left.draw_series(LineSeries::new(s.points.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    left.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(err)?;

    let mut right = ChartBuilder::on(&panels[1])
        .caption("latency against throughput", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..max_x * 1.05, (lo..hi).log_scale())
        .map_err(err)?;
    right
        .configure_mesh()
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| us_label(*y))
        .x_desc("getHosts answered per second")
        .y_desc("latency, µs")
        .draw()
        .map_err(err)?;
    // Each run its colour; p50, p99, p99.9 (curves() makes three a run)
    // from strong and wide to faint and thin.
    for (i, s) in curves.iter().enumerate() {
        let (alpha, width) = [(1.0, 3), (0.7, 2), (0.45, 1)][i % 3];
        let c = palette(i / 3).mix(alpha);
        right
            .draw_series(LineSeries::new(s.points.clone(), c.stroke_width(width)))
            .map_err(err)?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(width))
            });
        right
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    right
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_map_to_nines_and_back_to_labels() {
        assert_eq!(nines(0.0), 0.0);
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
        assert_eq!(nines(100.0), MAX_NINES);
        assert_eq!(percent_label(0.0), "0%");
        assert_eq!(percent_label(2.0), "99%");
        assert_eq!(percent_label(3.0), "99.9%");
    }

    #[test]
    fn a_long_sweep_draws_a_few_spectra_first_and_last_included() {
        assert_eq!(spread(3, 5), [0, 1, 2]);
        assert_eq!(spread(12, 5), [0, 2, 5, 8, 11]);
        assert_eq!(spread(0, 5), Vec::<usize>::new());
        assert_eq!(us_label(2.5), "2.5");
        assert_eq!(us_label(100000.0), "100000");
    }

    #[test]
    fn a_step_of_several_rounds_draws_its_median_round() {
        let r = |p99: f64| serde_json::json!({"latency_us": {"p99": p99}});
        let rounds = [r(30.0), r(10.0), r(20.0)];
        assert_eq!(median_round(&rounds), Some(&rounds[2]));
        assert_eq!(median_round(&rounds[..2]), Some(&rounds[1]));
        assert_eq!(median_round(&[]), None);
    }
}
