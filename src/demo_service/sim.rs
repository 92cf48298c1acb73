//! A seeded, pure simulation of the DAGOR experiment (`bench/dagor.rs`):
//! the same service core, the same feeds one after the other, the same
//! call shapes (M1, M2, M4) and the same success definition, with the
//! caller's clock replaced by an event list. No sockets, no threads, no
//! machine noise: what it shows is the algorithm's own behaviour, and
//! every window's outcome can be traced.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::core::{Arrival, ServiceCore, ServiceParams, Shedding};
use crate::admission::{admits, AdmissionLevel, AdmissionParams, Micros, WindowOutcome, OPEN};

pub(crate) const MS: Micros = 1000;
/// A call answered later than this fails (the bench's deadline).
pub(crate) const DEADLINE: Micros = 500 * MS;

/// One simulated run: one service through `feeds`, each for warm-up +
/// measure.
#[derive(Clone, Debug)]
pub(crate) struct Sim {
    /// Feed rates as multiples of the capacity (calls per second).
    pub feeds: Vec<f64>,
    /// Calls per upstream request (1, 2, 4).
    pub k: u32,
    /// The caller sheds below the level the service last attached to an
    /// answer (collaborative admission; the agent in the bench).
    pub collaborative: bool,
    /// The service's shedding.
    pub shedding: Shedding,
    /// The admission constants.
    pub admission: AdmissionParams,
    /// Per feed: warm-up, then the measured part.
    pub warmup: Micros,
    /// See `warmup`.
    pub measure: Micros,
    /// Seed of the arrivals and priorities.
    pub seed: u64,
}

/// What one feed's measured part gave.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SimPhase {
    /// Upstream requests started in the measured part, and of those, all
    /// calls answered Ok in time.
    pub offered: u64,
    /// See `offered`.
    pub ok: u64,
    /// The same for business priority 1.
    pub top_offered: u64,
    /// See `top_offered`.
    pub top_ok: u64,
    /// Calls that reached the service / that it rejected / that the
    /// caller shed itself (collaborative), of measured upstream requests.
    pub calls: u64,
    /// See `calls`.
    pub service_rejected: u64,
    /// See `calls`.
    pub caller_rejected: u64,
}

impl SimPhase {
    pub fn success(&self) -> f64 {
        self.ok as f64 / self.offered.max(1) as f64
    }
    pub fn top_success(&self) -> f64 {
        self.top_ok as f64 / self.top_offered.max(1) as f64
    }
}

/// One window's outcome and when it ended (at the latest).
pub(crate) type Traced = (Micros, WindowOutcome);

struct Upstream {
    b: u8,
    u: u8,
    done: u32,
    measured: Option<usize>,
}

impl Sim {
    /// The bench's service (4 workers × 2 ms, queue 4096) with the bench's
    /// scaled DAGOR window, at the given feeds.
    pub fn bench_like(feeds: &[f64], k: u32, seed: u64) -> Sim {
        Sim {
            feeds: feeds.to_vec(),
            k,
            collaborative: false,
            shedding: Shedding::Dagor,
            admission: AdmissionParams {
                window_us: 50 * MS,
                window_requests: 100,
                ..AdmissionParams::default()
            },
            warmup: 3000 * MS,
            measure: 2000 * MS,
            seed,
        }
    }

    fn service(&self) -> ServiceParams {
        ServiceParams {
            workers: 4,
            service_us: 2 * MS,
            queue: 4096,
            shedding: self.shedding,
            admission: self.admission,
            seed: self.seed ^ 0x5eed,
        }
    }

    /// Runs it: each feed's measured part, and every window's outcome.
    pub fn run(&self) -> (Vec<SimPhase>, Vec<Traced>) {
        let mut s: ServiceCore<(usize, Micros)> = ServiceCore::new(self.service());
        s.trace_windows(true);
        let capacity = s.params().capacity();
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let span = self.warmup + self.measure;
        let total = span * self.feeds.len() as Micros;
        let mut phases = vec![SimPhase::default(); self.feeds.len()];
        let mut trace = Vec::new();
        let mut ups: Vec<Upstream> = Vec::new();
        // Next calls of composite requests: (time, upstream).
        let mut next_calls: BinaryHeap<Reverse<(Micros, usize)>> = BinaryHeap::new();
        let mut next_up: f64 = 0.0; // seconds
        let mut caller_level: AdmissionLevel = OPEN;
        loop {
            let up_at = (next_up * 1e6) as Micros;
            let up_due = (up_at < total).then_some(up_at);
            let call_due = next_calls.peek().map(|Reverse((t, _))| *t);
            let arrival = match (up_due, call_due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let service = s.next_event();
            let t = match (arrival, service) {
                (None, None) => break,
                (Some(a), Some(e)) => a.min(e),
                (a, e) => a.or(e).unwrap_or(0),
            };
            // Completions first (they may start the next call at `t`).
            while let Some((up, called)) = s.poll_done(t) {
                caller_level = s.level().unwrap_or(OPEN);
                let p = ups[up].measured;
                if t - called > DEADLINE {
                    continue;
                }
                ups[up].done += 1;
                if ups[up].done == self.k {
                    if let Some(p) = p {
                        phases[p].ok += 1;
                        phases[p].top_ok += u64::from(ups[up].b == 1);
                    }
                } else {
                    next_calls.push(Reverse((t, up)));
                }
            }
            let up = if up_due == Some(t) {
                let phase = (t / span) as usize;
                let measured = (t % span >= self.warmup).then_some(phase);
                let b = rng.u8(1..=8);
                if let Some(p) = measured {
                    phases[p].offered += 1;
                    phases[p].top_offered += u64::from(b == 1);
                }
                ups.push(Upstream {
                    b,
                    u: rng.u8(1..=128),
                    done: 0,
                    measured,
                });
                let rate = self.feeds[phase] * capacity / f64::from(self.k);
                next_up += -(1.0 - rng.f64()).ln() / rate;
                Some(ups.len() - 1)
            } else if call_due == Some(t) {
                next_calls.pop().map(|Reverse((_, up))| up)
            } else {
                None
            };
            if let Some(up) = up {
                let (b, u, p) = (ups[up].b, ups[up].u, ups[up].measured);
                if self.collaborative && !admits(caller_level, b, u) {
                    if let Some(p) = p {
                        phases[p].caller_rejected += 1;
                    }
                } else {
                    let a = s.arrive(t, b, u, (up, t));
                    if let Some(p) = p {
                        phases[p].calls += 1;
                        phases[p].service_rejected += u64::from(a != Arrival::Queued);
                    }
                    if a != Arrival::Queued {
                        caller_level = s.level().unwrap_or(OPEN);
                    }
                }
            }
            trace.extend(s.take_trace().into_iter().map(|o| (t, o)));
        }
        (phases, trace)
    }
}

/// Prints a trace, one window a line (for investigation).
pub(crate) fn print_trace(trace: &[Traced], from: Micros, to: Micros) {
    for (t, o) in trace.iter().filter(|(t, _)| (from..to).contains(t)) {
        println!(
            "{:8.3}s {:>3},{:<3} -> {:>3},{:<3} avg {:6.1} ms arrived {:4} admitted {:4} started {:4}{}{}",
            *t as f64 / 1e6,
            o.before.business,
            o.before.user,
            o.after.business,
            o.after.user,
            o.window.avg_queuing_us as f64 / 1000.0,
            o.arrived,
            o.admitted,
            o.window.samples,
            if o.window.overloaded { " OVER" } else { "" },
            if o.draining { " hold" } else { "" },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FEEDS: [f64; 5] = [1.0, 1.5, 2.0, 3.0, 4.0];

    /// `Sim::bench_like` through the five feeds, for each seed: per feed,
    /// the mean over the seeds of success / optimum, and the lowest
    /// class-1 success of any run.
    fn mean_share(k: u32, collaborative: bool, hold: bool, seeds: u64) -> (Vec<f64>, f64) {
        let mut share = vec![0.0; FEEDS.len()];
        let mut top = 1.0f64;
        for seed in 1..=seeds {
            let mut sim = Sim::bench_like(&FEEDS, k, seed);
            sim.collaborative = collaborative;
            sim.admission.hold_while_draining = hold;
            let (phases, _) = sim.run();
            for (i, p) in phases.iter().enumerate() {
                share[i] += p.success() / (1.0 / FEEDS[i]).min(1.0) / seeds as f64;
                top = top.min(p.top_success());
            }
        }
        (share, top)
    }

    // The targets of the experiment, on the algorithm alone (seeded
    // arrivals, exact time): DAGOR's success >= 95% of the optimum at
    // every feed, class 1 always served, composite calls within a few
    // points of simple ones. Means over 10 seeds: one 2 s measurement
    // varies by several points from seed to seed.

    #[test]
    fn dagor_at_the_service_reaches_the_targets_and_beats_the_papers_rule() {
        let (m1, top1) = mean_share(1, false, true, 10);
        let (m4, top4) = mean_share(4, false, true, 10);
        let (paper, _) = mean_share(1, false, false, 10);
        println!("M1 {m1:.3?}\nM4 {m4:.3?}\npaper's rule M1 {paper:.3?}");
        for (i, f) in FEEDS.iter().enumerate() {
            assert!(m1[i] >= 0.95, "M1 at {f}x: {:.3} of the optimum", m1[i]);
            assert!(m4[i] >= 0.95, "M4 at {f}x: {:.3} of the optimum", m4[i]);
            assert!(
                (m1[i] - m4[i]).abs() <= 0.03,
                "M4 {:.3} against M1 {:.3} at {f}x",
                m4[i],
                m1[i]
            );
        }
        assert_eq!((top1, top4), (1.0, 1.0), "class 1 always served");
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        assert!(
            mean(&m1) > mean(&paper) + 0.01,
            "holding {:.3}, the paper's rule {:.3}",
            mean(&m1),
            mean(&paper)
        );
    }

    #[test]
    fn collaborative_dagor_reaches_the_targets() {
        let (m1, top1) = mean_share(1, true, true, 10);
        let (m4, top4) = mean_share(4, true, true, 10);
        println!("M1 {m1:.3?}\nM4 {m4:.3?}");
        for (i, f) in FEEDS.iter().enumerate() {
            assert!(m1[i] >= 0.95, "M1 at {f}x: {:.3} of the optimum", m1[i]);
            assert!(m4[i] >= 0.95, "M4 at {f}x: {:.3} of the optimum", m4[i]);
            assert!(
                (m1[i] - m4[i]).abs() <= 0.05,
                "M4 {:.3} against M1 {:.3} at {f}x",
                m4[i],
                m1[i]
            );
        }
        assert_eq!((top1, top4), (1.0, 1.0), "class 1 always served");
    }

    #[test]
    fn the_simulation_is_deterministic_and_counts_every_request() {
        let sim = Sim::bench_like(&[1.0, 3.0], 2, 7);
        let (a, trace) = sim.run();
        let (b, _) = sim.run();
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert!(!trace.is_empty());
        for p in &a {
            assert!(p.ok <= p.offered && p.top_ok <= p.top_offered);
            assert!(p.service_rejected <= p.calls);
            // M2: at most two calls per request offered.
            assert!(p.calls + p.caller_rejected <= 2 * p.offered);
        }
        // At 1x nearly everything gets through; at 3x about a third.
        assert!(a[0].success() > 0.9, "{:?}", a[0]);
        assert!((0.28..0.36).contains(&a[1].success()), "{:?}", a[1]);
    }

    /// The whole experiment, simulated: `cargo test --lib sim_report --
    /// --ignored --nocapture` (set SIM_TRACE=feed,k,mode to print one
    /// run's windows).
    #[test]
    #[ignore = "a report for investigation, not a check"]
    fn sim_report() {
        let env = |k: &str, d: &str| -> Vec<u64> {
            std::env::var(k)
                .unwrap_or(d.into())
                .split(',')
                .map(|x| x.parse().unwrap())
                .collect()
        };
        let (win, warm, nseeds) = (
            env("SIM_WIN", "50,100"),
            env("SIM_WARM", "3000")[0],
            env("SIM_SEEDS", "3")[0],
        );
        let seeds = 1..=nseeds;
        println!(
            "window {} ms / {} requests, warm-up {warm} ms, {nseeds} seeds; per feed: success as \
             % of the optimum, mean over the seeds (lowest seed), and the lowest class-1 success",
            win[0], win[1]
        );
        for (name, collab, hold) in [
            ("service, hold", false, true),
            ("service, paper", false, false),
            ("collaborative", true, true),
        ] {
            println!("== {name}");
            for k in [1u32, 2, 4] {
                let mut cells = vec![Vec::new(); FEEDS.len()];
                for seed in seeds.clone() {
                    let mut sim = Sim::bench_like(&FEEDS, k, seed);
                    sim.admission.window_us = win[0] * MS;
                    sim.admission.window_requests = win[1] as u32;
                    sim.warmup = warm * MS;
                    sim.collaborative = collab;
                    sim.admission.hold_while_draining = hold;
                    let (phases, _) = sim.run();
                    for (i, p) in phases.iter().enumerate() {
                        let opt = (1.0 / FEEDS[i]).min(1.0);
                        cells[i].push((100.0 * p.success() / opt, p.top_success()));
                    }
                }
                let line: Vec<String> = cells
                    .iter()
                    .zip(FEEDS)
                    .map(|(c, f)| {
                        let mean = c.iter().map(|x| x.0).sum::<f64>() / c.len() as f64;
                        let top = c.iter().map(|x| x.1).fold(1.0, f64::min);
                        let min = c.iter().map(|x| x.0).fold(1e9, f64::min);
                        format!("{f}x {mean:5.1} ({min:5.1}) c1 {top:.2}")
                    })
                    .collect();
                println!("M{k}: {}", line.join("  "));
            }
        }
    }

    /// Replays a bench trace (`cargo bench --bench dagor -- --only
    /// dagor:1 --trace`) through the same core: `REPLAY=FILE` (the
    /// `-arrivals.csv`), `REPLAY_HOLD=0|1` (default 1), `REPLAY_VARY=` `as-is`
    /// (default), `poisson` (the trace's priorities at Poisson times of the
    /// feed's rate), `uniform` (the trace's times, priorities drawn as the
    /// simulation draws them); `REPLAY_WINDOWS=FROM_S,TO_S` prints those
    /// windows. M1 only: per feed, the share answered in time against the
    /// optimum, and the trace's own queued share.
    #[test]
    #[ignore = "a replay for investigation, not a check"]
    fn replay() {
        let path = std::env::var("REPLAY").expect("REPLAY=path of a -arrivals.csv");
        let text = std::fs::read_to_string(&path).expect("read the trace");
        let hold = std::env::var("REPLAY_HOLD").map_or(true, |v| v != "0");
        let vary = std::env::var("REPLAY_VARY").unwrap_or("as-is".into());
        let mut rows: Vec<(Micros, u8, u8, bool)> = text
            .lines()
            .skip(1)
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                (
                    f[0].parse().unwrap(),
                    f[2].parse().unwrap(),
                    f[3].parse().unwrap(),
                    f[4] == "queued",
                )
            })
            .collect();
        let t0 = rows[0].0;
        let span = 5000 * MS;
        let seed = std::env::var("REPLAY_SEED").map_or(1, |v| v.parse().unwrap());
        let mut rng = fastrand::Rng::with_seed(seed);
        if vary.contains("uniform") {
            for r in &mut rows {
                r.1 = rng.u8(1..=8);
                r.2 = rng.u8(1..=128);
            }
        }
        if vary.contains("shuffle") {
            // The trace's priorities in a random order.
            let mut pr: Vec<(u8, u8)> = rows.iter().map(|r| (r.1, r.2)).collect();
            rng.shuffle(&mut pr);
            for (r, p) in rows.iter_mut().zip(pr) {
                (r.1, r.2) = p;
            }
        }
        if vary.contains("uhist") {
            // Business priorities drawn anew, user priorities from the
            // trace's distribution.
            let us: Vec<u8> = rows.iter().map(|r| r.2).collect();
            for r in &mut rows {
                r.1 = rng.u8(1..=8);
                r.2 = us[rng.usize(0..us.len())];
            }
        }
        if vary.contains("jitter") {
            // Up to 20 us later each, in order: a quiet machine's noise.
            let mut last = 0;
            for r in &mut rows {
                r.0 = (r.0 + rng.u64(0..20)).max(last);
                last = r.0;
            }
        }
        if vary.contains("poisson") {
            let (mut t, mut i) = (0.0f64, 0);
            for (p, f) in FEEDS.iter().enumerate() {
                let end = ((p + 1) as Micros * span) as f64 / 1e6;
                while t < end && i < rows.len() {
                    rows[i].0 = t0 + (t * 1e6) as Micros;
                    t += -(1.0 - rng.f64()).ln() / (f * 2000.0);
                    i += 1;
                }
                t = t.max(end);
            }
            rows.truncate(i);
        }
        let mut sim = Sim::bench_like(&FEEDS, 1, 1);
        sim.admission.hold_while_draining = hold;
        let mut s: ServiceCore<(usize, Micros)> = ServiceCore::new(sim.service());
        s.trace_windows(true);
        // Per feed: offered, answered in time (replay), queued (trace).
        let mut per = [[0u64; 3]; 5];
        let phase = |t: Micros| {
            let rel = t - t0;
            let p = (rel / span) as usize;
            (p < 5 && rel % span >= 3000 * MS).then_some(p)
        };
        let mut trace = Vec::new();
        let done = |s: &mut ServiceCore<(usize, Micros)>, now, per: &mut [[u64; 3]; 5]| {
            while let Some((_, arrived)) = s.poll_done(now) {
                if let (Some(p), true) = (phase(arrived), now - arrived <= DEADLINE) {
                    per[p][1] += 1;
                }
            }
        };
        for (i, &(t, b, u, queued)) in rows.iter().enumerate() {
            done(&mut s, t, &mut per);
            s.arrive(t, b, u, (i, t));
            if let Some(p) = phase(t) {
                per[p][0] += 1;
                per[p][2] += u64::from(queued);
            }
            trace.extend(s.take_trace().into_iter().map(|o| (t, o)));
        }
        done(&mut s, Micros::MAX / 2, &mut per);
        if let Ok(w) = std::env::var("REPLAY_WINDOWS") {
            let w: Vec<f64> = w.split(',').map(|x| x.parse().unwrap()).collect();
            let at = |x: f64| t0 + (x * 1e6) as Micros;
            print_trace(&trace, at(w[0]), at(w[1]));
        }
        println!("{path}: hold {hold}, {vary}");
        for (p, f) in FEEDS.iter().enumerate() {
            let [n, ok, q] = per[p];
            let opt = (1.0 / f).min(1.0);
            println!(
                "{f}x: offered {n}, replay {:.1}% of optimum, trace queued {:.1}% of optimum",
                100.0 * ok as f64 / n.max(1) as f64 / opt,
                100.0 * q as f64 / n.max(1) as f64 / opt
            );
        }
    }

    /// One run's windows: `SIM_TRACE=K,COLLAB,HOLD,SEED,FROM_S,TO_S cargo
    /// test --lib sim_trace -- --ignored --nocapture`.
    #[test]
    #[ignore = "a trace for investigation, not a check"]
    fn sim_trace() {
        let spec = std::env::var("SIM_TRACE").unwrap_or("1,0,1,1,0,5".into());
        let v: Vec<f64> = spec.split(',').map(|x| x.parse().unwrap()).collect();
        let mut sim = Sim::bench_like(&FEEDS, v[0] as u32, v[3] as u64);
        if v.len() > 7 {
            sim.admission.window_us = v[6] as Micros * MS;
            sim.admission.window_requests = v[7] as u32;
            sim.warmup = v[8] as Micros * MS;
        }
        sim.collaborative = v[1] != 0.0;
        sim.admission.hold_while_draining = v[2] != 0.0;
        let (phases, trace) = sim.run();
        print_trace(&trace, (v[4] * 1e6) as Micros, (v[5] * 1e6) as Micros);
        for (p, f) in phases.iter().zip(FEEDS) {
            println!("{f}x: {p:?} success {:.3}", p.success());
        }
    }
}
