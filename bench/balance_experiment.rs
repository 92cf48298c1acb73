//! Seed 002's prototype experiment, in simulated time: many independent
//! choosers consume the free capacity of unequal nodes, each deciding from a
//! view of the capacities as stale as its own pause. Compares the balance
//! router `Φ` ([`lbagent::lb::balance`]) against greedy "largest free" and
//! uniform random, prints a Markdown table (medians over seeds) and draws
//! every node's free capacity over time, as the seed's figure, to
//! `bench/balance_experiment.png`.
//!
//! The setup is the seed's: 50 nodes with 300–1100 GB free (uniform, whole
//! GB), 25 choosers, 40 rounds each, 50 GB per choice, a pause of
//! 100–500 ms (uniform) before each choice. A chooser reads every node's free
//! capacity when its pause starts (right after its previous write) and
//! chooses when it ends; its write lands on the node's real capacity at that
//! moment. A node is eligible when the chooser's view shows at least one
//! 50 GB unit free; with none eligible the chooser is **refused**. A write to
//! a node that really has less than 50 GB free is an **overflow** (counted,
//! not written). `Φ` is drawn with `η = 25`, the number of choosers.
//!
//! Run: `cargo bench --bench balance_experiment` (a few seconds).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use lbagent::lb::balance::Balance;
use plotters::prelude::*;

const NODES: usize = 50;
const CHOOSERS: usize = 25;
const ROUNDS: u32 = 40;
const UNIT_GB: u32 = 50;
const SEEDS: u64 = 11;
const CHOOSERS_U64: u64 = CHOOSERS as u64;
/// Global choice counts at which the spread is recorded; the last is the end.
const CHECKPOINTS: [u32; 3] = [250, 500, 750];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    Phi(u64),
    Greedy,
    Uniform,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Phi(_) => "Φ (balance, η = 25)",
            Policy::Greedy => "greedy largest free",
            Policy::Uniform => "uniform random",
        }
    }

    /// The node this chooser picks from its view (free GB per node).
    fn choose(self, view: &[u32], rng: &mut fastrand::Rng) -> Option<usize> {
        let units: Vec<u32> = view.iter().map(|&gb| gb / UNIT_GB).collect();
        match self {
            Policy::Phi(eta) => Balance::with_capacities(&units).choose(eta, rng.u64(..)),
            Policy::Greedy => {
                let max = *units.iter().max()?;
                let best: Vec<usize> = (0..NODES).filter(|&i| units[i] == max && max > 0).collect();
                (!best.is_empty()).then(|| best[rng.usize(..best.len())])
            }
            Policy::Uniform => {
                let open: Vec<usize> = (0..NODES).filter(|&i| units[i] > 0).collect();
                (!open.is_empty()).then(|| open[rng.usize(..open.len())])
            }
        }
    }
}

/// One run's results.
struct Run {
    overflows: u32,
    /// Overflows while the pool really held at least 2 × 25 units in all.
    overflows_early: u32,
    refusals: u32,
    /// max − min free GB at each checkpoint reached, then at the end.
    spread: Vec<u32>,
    /// (time in ms, every node's free GB) after each choice.
    series: Vec<(u64, Vec<u32>)>,
    /// Times of the overflows.
    overflow_at: Vec<u64>,
}

fn run(policy: Policy, rounds: u32, seed: u64) -> Run {
    let mut rng = fastrand::Rng::with_seed(seed);
    // The same nodes and pauses for every policy of a seed; the choices draw
    // from their own stream.
    let mut free: Vec<u32> = (0..NODES).map(|_| rng.u32(300..=1100)).collect();
    let mut pauses = fastrand::Rng::with_seed(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut choices = fastrand::Rng::with_seed(seed.wrapping_mul(31) + 7);
    let mut queue = BinaryHeap::new();
    let mut view = vec![free.clone(); CHOOSERS];
    let mut left = [rounds; CHOOSERS];
    for c in 0..CHOOSERS {
        queue.push(Reverse((pauses.u64(100..=500), c)));
    }
    let mut r = Run {
        overflows: 0,
        overflows_early: 0,
        refusals: 0,
        spread: Vec::new(),
        series: vec![(0, free.clone())],
        overflow_at: Vec::new(),
    };
    let mut done = 0u32;
    while let Some(Reverse((t, c))) = queue.pop() {
        let pool: u32 = free.iter().map(|&gb| gb / UNIT_GB).sum();
        match policy.choose(&view[c], &mut choices) {
            None => r.refusals += 1,
            Some(i) if free[i] >= UNIT_GB => free[i] -= UNIT_GB,
            Some(_) => {
                r.overflows += 1;
                if pool >= 2 * CHOOSERS as u32 {
                    r.overflows_early += 1;
                }
                r.overflow_at.push(t);
            }
        }
        done += 1;
        if CHECKPOINTS.contains(&done) || done == rounds * CHOOSERS as u32 {
            r.spread
                .push(free.iter().max().unwrap() - free.iter().min().unwrap());
        }
        r.series.push((t, free.clone()));
        left[c] -= 1;
        if left[c] > 0 {
            view[c].clone_from(&free);
            queue.push(Reverse((t + pauses.u64(100..=500), c)));
        }
    }
    r
}

fn median(mut v: Vec<u32>) -> u32 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn plot(runs: &[(Policy, Run)], path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1800, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let t_max = runs
        .iter()
        .map(|(_, r)| r.series.last().unwrap().0)
        .max()
        .unwrap() as f64;
    for (area, (_, r)) in root.split_evenly((1, runs.len())).iter().zip(runs) {
        let mut chart = ChartBuilder::on(area)
            .margin(14)
            .build_cartesian_2d(0f64..t_max, 0f64..1150f64)?;
        // No text (no font dependency): grid every 100 GB and every second.
        let grid = RGBColor(225, 225, 225);
        for gb in (100..=1100).step_by(100) {
            let y = f64::from(gb);
            chart.draw_series(LineSeries::new([(0.0, y), (t_max, y)], &grid))?;
        }
        for s in (1000..t_max as u64).step_by(1000) {
            let x = s as f64;
            chart.draw_series(LineSeries::new([(x, 0.0), (x, 1150.0)], &grid))?;
        }
        chart.draw_series(LineSeries::new([(0.0, 0.0), (t_max, 0.0)], &BLACK))?;
        chart.draw_series(LineSeries::new([(0.0, 0.0), (0.0, 1150.0)], &BLACK))?;
        // Colour by initial free capacity: least red, most blue.
        let first = &r.series[0].1;
        for node in 0..NODES {
            let h = f64::from(first[node] - 300) / 800.0 * 0.66;
            let colour = HSLColor(h, 0.85, 0.45);
            chart.draw_series(LineSeries::new(
                r.series
                    .iter()
                    .map(|(t, f)| (*t as f64, f64::from(f[node]))),
                colour.stroke_width(1),
            ))?;
        }
        for &t in &r.overflow_at {
            chart.draw_series(LineSeries::new(
                [(t as f64, 0.0), (t as f64, 60.0)],
                RED.stroke_width(2),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

fn main() {
    let policies = [Policy::Phi(CHOOSERS_U64), Policy::Greedy, Policy::Uniform];
    println!(
        "Seed 002's experiment: {NODES} nodes (300–1100 GB free), {CHOOSERS} choosers × {UNIT_GB} GB a choice, \
         pauses 100–500 ms; medians over {SEEDS} seeds [min–max]"
    );
    for rounds in [ROUNDS, ROUNDS / 2] {
        let total = rounds * CHOOSERS as u32;
        println!(
            "\n{rounds} rounds each ({total} choices, {} TB asked):\n",
            total * UNIT_GB / 1000
        );
        let marks: Vec<u32> = CHECKPOINTS.iter().copied().filter(|&c| c < total).collect();
        let heads: Vec<String> = marks.iter().map(|c| format!("spread after {c}")).collect();
        println!(
            "| policy | overflows | overflows, pool ≥ 2η units | refusals | {} | spread at the end |",
            heads.join(" | ")
        );
        println!("|---|---|---|---|{}---|", "---|".repeat(marks.len()));
        for p in policies {
            let runs: Vec<Run> = (1..=SEEDS).map(|s| run(p, rounds, s)).collect();
            let cell = |f: &dyn Fn(&Run) -> u32| {
                let v: Vec<u32> = runs.iter().map(f).collect();
                let (lo, hi) = (*v.iter().min().unwrap(), *v.iter().max().unwrap());
                format!("{} [{lo}–{hi}]", median(v))
            };
            let spreads: Vec<String> = (0..=marks.len())
                .map(|k| format!("{} GB", cell(&|r| r.spread[k])))
                .collect();
            println!(
                "| {} | {} | {} | {} | {} |",
                p.name(),
                cell(&|r| r.overflows),
                cell(&|r| r.overflows_early),
                cell(&|r| r.refusals),
                spreads.join(" | "),
            );
        }
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/balance_experiment.png");
    let shown = [Policy::Phi(CHOOSERS_U64), Policy::Greedy, Policy::Uniform];
    let runs: Vec<(Policy, Run)> = shown.iter().map(|&p| (p, run(p, ROUNDS, 1))).collect();
    match plot(&runs, path) {
        Ok(()) => println!(
            "\nplot (seed 1, 40 rounds; Φ with η = 25, greedy, uniform from left to right): {path}"
        ),
        Err(e) => {
            eprintln!("error: could not draw {path}: {e}");
            std::process::exit(1);
        }
    }
}
