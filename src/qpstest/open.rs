//! The open loop's runtime shell: threads that send each request at the
//! time the [`Schedule`] gives it, whatever the agent does, and count
//! its latency from that time.
//!
//! `--threads` threads, each with its own client, take the schedule's
//! next slot in turn (one lock per request), sleep until it is due, send
//! the getHost (and the report, after `--hold-ms`), and record two times:
//! the latency from the slot's intended send time (coordinated omission
//! corrected) and the service time from the actual send. When every
//! thread is waiting on an answer, the next slots wait for a free thread
//! and their latency grows with the wait: that is the point. A slot
//! whose intended time is already more than the timeout ago when a thread
//! takes it is not sent (an application would have given up): at most
//! `rate x timeout` requests are outstanding. A step's window is its
//! slots' intended times: when it ends, the threads still send the slots
//! due in it that are waiting (late, and measured so) until they catch
//! up or the timeout gives the rest up. Slots given up count as
//! `not_sent`; when more than 1% of the measured window's slots were not
//! sent the step is marked invalid ([`super::open_figures`]).
//!
//! Everything that decides is elsewhere and pure: the schedule
//! ([`super::schedule`]), the figures ([`super::open_figures`]), the
//! sweep and its knee ([`super::sweep`]), the report ([`super::report`]).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;

use super::hlog::HistLog;
use super::open_figures::OpenFigures;
use super::report::{OpenReport, StepReport};
use super::schedule::{Arrivals, DueCounter, Schedule};
use super::summary::{LiveLine, RunInfo, ServerCpu, Summary, Tally};
use super::sweep::RatePlan;
use super::{answer, client_options, mix, register_all, thread_modules, QpsOptions, Server};
use crate::client::Client;
use crate::model::ModuleId;

/// How an open-loop run is set up (`--rate` and the flags that go with it).
#[derive(Clone, Debug)]
pub struct OpenLoop {
    /// The offered rates, one step each.
    pub plan: RatePlan,
    /// How requests arrive.
    pub arrivals: Arrivals,
    /// Times each step is run (the report gives medians and spreads).
    pub rounds: u32,
    /// Draw the report (percentile spectra, the latency-vs-throughput
    /// curve) as a PNG.
    pub plot: Option<PathBuf>,
}

/// The most rounds a step is run.
pub const MAX_ROUNDS: u32 = 100;

/// Runs the open-loop load of `opts` (whose `open` must be set): every
/// step of its plan, each `rounds` times, with a live line every second;
/// prints the report (text, or JSON with `opts.json`) to `out`, writes the
/// files asked for, and returns the report.
///
/// # Errors
/// Invalid options, a server that cannot start, a thread that cannot be
/// spawned, a file that cannot be written, or `out` failing. Failed and
/// unsent getHosts are not errors: they are counted.
pub fn run_open(opts: &QpsOptions, out: &mut dyn Write) -> anyhow::Result<OpenReport> {
    let open = opts
        .open
        .as_ref()
        .context("an open-loop run needs --rate")?;
    opts.validate()?;
    let server = Server::start(opts)?;
    let mut stderr = std::io::stderr();
    let live: &mut dyn Write = if opts.json { &mut stderr } else { out };
    register_all(opts, server.heartbeat(), live)?;

    let mut hist_log = match &opts.hist_log {
        Some(p) => Some(HistLog::create(
            p,
            "lbagent qpstest, open loop: getHost latency from the intended send time, ns",
        )?),
        None => None,
    };

    let rates = open.plan.rates();
    let mut steps = Vec::with_capacity(rates.len());
    'steps: for (i, &rate) in rates.iter().enumerate() {
        let mut rounds = Vec::new();
        for round in 0..open.rounds {
            writeln!(
                live,
                "qpstest: step {}/{}: {rate:.0}/s offered, round {}/{}",
                i + 1,
                rates.len(),
                round + 1,
                open.rounds
            )?;
            let tag = (rates.len() > 1 || open.rounds > 1).then(|| step_tag(rate, round));
            let step = Step {
                opts,
                open,
                server: &server,
                rate,
                seed: (i as u64) << 32 | u64::from(round),
            };
            let (summary, hist) = step.run(live, hist_log.as_mut(), tag.as_deref())?;
            if let Some(p) = &opts.percentiles {
                let path = step_path(p, rates.len() > 1, open.rounds > 1, rate, round);
                super::hgrm::write_file(&path, &hist)?;
            }
            if !opts.json {
                writeln!(live, "{summary}")?;
            }
            rounds.push(summary);
            if crate::service::signal::received() {
                steps.push(StepReport::new(rate, rounds));
                break 'steps;
            }
        }
        steps.push(StepReport::new(rate, rounds));
    }
    if let Some(log) = hist_log {
        log.finish()?;
    }
    server.stop()?;
    let report = OpenReport::new(opts, open, steps);
    if opts.json {
        writeln!(out, "{}", report.to_json())?;
    } else {
        writeln!(out, "{report}")?;
    }
    out.flush()?;
    if let Some(p) = &open.plot {
        let v = serde_json::to_value(&report).context("the report as JSON")?;
        super::plot::draw(&[("", &v)], p)
            .map_err(|e| anyhow::anyhow!("cannot draw {}: {e}", p.display()))?;
    }
    Ok(report)
}

/// The interval log's tag of a step's round.
fn step_tag(rate: f64, round: u32) -> String {
    format!("rate{rate:.0}-round{}", round + 1)
}

/// Where step `rate`'s round goes when `FILE` takes several: `FILE` with
/// `-RATE` (in a sweep) and `-rROUND` (with rounds) before its extension.
fn step_path(p: &std::path::Path, sweep: bool, rounds: bool, rate: f64, round: u32) -> PathBuf {
    if !sweep && !rounds {
        return p.to_path_buf();
    }
    let stem = p.file_stem().unwrap_or_default().to_string_lossy();
    let mut name = stem.into_owned();
    if sweep {
        name += &format!("-{rate:.0}");
    }
    if rounds {
        name += &format!("-r{}", round + 1);
    }
    if let Some(ext) = p.extension() {
        name += ".";
        name += &ext.to_string_lossy();
    }
    p.with_file_name(name)
}

/// One round of one step.
struct Step<'a> {
    opts: &'a QpsOptions,
    open: &'a OpenLoop,
    server: &'a Server,
    rate: f64,
    seed: u64,
}

/// What a thread counted, by the phase its requests' intended times fell in.
#[derive(Default)]
struct Phases {
    warm: Tally,
    measured: Tally,
}

type SharedPhases = Arc<Mutex<Phases>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A thread that panicked left counts that are still counts: use them.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the threads of a step share: the schedule and the clock.
struct Dispatch {
    schedule: Mutex<Schedule>,
    /// The step's start, set when every client is built.
    start: Mutex<Option<Instant>>,
    started: Condvar,
    stop: AtomicBool,
    warm_ns: u64,
    end_ns: u64,
    timeout_ns: u64,
}

impl Dispatch {
    fn wait_start(&self) -> Instant {
        let mut s = lock(&self.start);
        loop {
            if let Some(t) = *s {
                return t;
            }
            s = self.started.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn open(&self) -> Instant {
        let t = Instant::now();
        *lock(&self.start) = Some(t);
        self.started.notify_all();
        t
    }
}

impl Step<'_> {
    /// Starts the round's threads and waits until each has built its
    /// client (the step's clock starts after).
    fn spawn(
        &self,
        dispatch: &Arc<Dispatch>,
    ) -> anyhow::Result<(Vec<SharedPhases>, Vec<JoinHandle<()>>)> {
        let opts = self.opts;
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut shared = Vec::with_capacity(opts.threads as usize);
        let mut workers = Vec::with_capacity(opts.threads as usize);
        for i in 0..opts.threads {
            let phases: SharedPhases = Arc::default();
            shared.push(phases.clone());
            let w = Worker {
                modules: thread_modules(opts, i),
                options: client_options(opts, self.server.heartbeat()),
                report: opts.report,
                hold: opts.hold,
                timeout: opts.timeout,
                dispatch: dispatch.clone(),
                ready: ready_tx.clone(),
                phases,
                mix: opts.priority_mix.clone(),
                rng: mix::Rng::new(self.seed ^ (u64::from(i) + 1)),
            };
            match std::thread::Builder::new()
                .name(format!("qpstest-open-{i}"))
                .spawn(move || w.run())
            {
                Ok(h) => workers.push(h),
                Err(e) => {
                    dispatch.stop.store(true, Ordering::Release);
                    dispatch.open();
                    for w in workers {
                        let _ = w.join();
                    }
                    return Err(e).context(format!("cannot spawn client thread {i}"));
                }
            }
        }
        // A thread that dies first drops its sender: the wait ends then too.
        drop(ready_tx);
        for _ in 0..opts.threads {
            if ready_rx.recv().is_err() {
                break;
            }
        }
        Ok((shared, workers))
    }

    /// Runs the round: returns its summary and its measured corrected
    /// latency histogram (ns).
    fn run(
        &self,
        live: &mut dyn Write,
        mut hist_log: Option<&mut HistLog>,
        tag: Option<&str>,
    ) -> anyhow::Result<(Summary, Histogram<u64>)> {
        let opts = self.opts;
        let warm = opts.warmup;
        let schedule = Schedule::new(self.rate, self.open.arrivals, self.seed);
        let dispatch = Arc::new(Dispatch {
            schedule: Mutex::new(schedule.clone()),
            start: Mutex::new(None),
            started: Condvar::new(),
            stop: AtomicBool::new(false),
            warm_ns: warm.as_nanos() as u64,
            end_ns: (warm + opts.duration).as_nanos() as u64,
            timeout_ns: opts.timeout.as_nanos() as u64,
        });
        let (shared, workers) = self.spawn(&dispatch)?;
        let t0 = dispatch.open();
        let warm_end = t0 + warm;
        let end = t0 + warm + opts.duration;
        let mut offered = DueCounter::new(&schedule);
        let mut cpu0 = warm.is_zero().then(|| self.server.cpu_seconds()).flatten();
        let mut total = Tally::new();
        let mut interval = Tally::new();
        let mut interval_measured = Tally::new();
        let mut last = (t0, cpu0.as_ref().map(|c| c.0));
        let mut next = t0 + Duration::from_secs(1);
        // The measured window's latency not yet in the interval log, since when.
        let mut unlogged = super::summary::latency_histogram();
        let mut unlogged_from = warm_end;
        let mut log = |h: &Histogram<u64>, from: Instant, to: Instant| -> anyhow::Result<()> {
            match hist_log.as_mut() {
                Some(w) => w.write(h, from, to, tag),
                None => Ok(()),
            }
        };
        while !crate::service::signal::received() {
            let now = Instant::now();
            let due = next
                .min(end)
                .min(if cpu0.is_none() { warm_end } else { end });
            if now < due {
                std::thread::sleep(
                    due.saturating_duration_since(now)
                        .min(Duration::from_millis(100)),
                );
                continue;
            }
            let at = Instant::now();
            if cpu0.is_none() && at >= warm_end {
                cpu0 = self.server.cpu_seconds();
            }
            if at < next && at < end {
                continue;
            }
            let tick = next.min(end);
            collect(&shared, &mut interval, &mut interval_measured, &mut total);
            let _ = unlogged.add(&interval_measured.latency);
            // A tick due after the warm-up closes an interval of the log:
            // one a second of the measured window (a late warm-up tick's
            // measured answers wait for the next).
            if tick > warm_end {
                log(&unlogged, unlogged_from, at)?;
                unlogged.reset();
                unlogged_from = at;
            }
            let cpu = self.server.cpu_seconds().map(|c| c.0);
            let secs = at.duration_since(last.0).as_secs_f64();
            let mut line = LiveLine::new(
                at.duration_since(t0).as_secs_f64(),
                &interval,
                secs,
                cpu.zip(last.1).map(|(b, a)| b - a),
            );
            let due_now = offered.until(at.duration_since(t0).as_nanos() as u64);
            line.open_rates = Some((due_now as f64 / secs, interval.sent as f64 / secs));
            writeln!(live, "{line}")?;
            live.flush()?;
            last = (at, cpu);
            next += Duration::from_secs(1);
            if at >= end {
                break;
            }
        }
        // The threads end by themselves once the window's slots are sent or
        // given up (within the timeout); a signal ends them at once.
        if crate::service::signal::received() {
            dispatch.stop.store(true, Ordering::Release);
        }
        let cpu1 = self.server.cpu_seconds();
        for w in workers {
            if w.join().is_err() {
                writeln!(
                    live,
                    "qpstest: a client thread panicked; its counts so far are kept"
                )?;
            }
        }
        collect(&shared, &mut interval, &mut interval_measured, &mut total);
        let _ = unlogged.add(&interval_measured.latency);
        if !unlogged.is_empty() {
            log(&unlogged, unlogged_from, Instant::now())?;
        }
        let server_cpu = cpu0.zip(cpu1).map(|((a, _), (b, what))| ServerCpu {
            seconds: (b - a).max(0.0),
            what,
        });
        let summary = self.summary(&schedule, &dispatch, &mut total, server_cpu);
        Ok((summary, total.latency))
    }
}

impl Step<'_> {
    /// The round's summary from what its threads counted in the measured
    /// window (`total`, which gains the `not_sent` errors).
    fn summary(
        &self,
        schedule: &Schedule,
        dispatch: &Dispatch,
        total: &mut Tally,
        server_cpu: Option<ServerCpu>,
    ) -> Summary {
        let opts = self.opts;
        let seconds = opts.duration.as_secs_f64();
        let info = RunInfo {
            target: self.server.name.to_string(),
            heartbeat: self.server.heartbeat().display().to_string(),
            threads: opts.threads,
            modules: opts.modules,
            report: opts.report,
            cache: opts.cache,
            timeout_ms: opts.timeout.as_millis() as u64,
        };
        let mut window = DueCounter::new(schedule);
        window.until(dispatch.warm_ns);
        let scheduled = window.until(dispatch.end_ns);
        let figures = OpenFigures::new(
            self.rate,
            self.open.arrivals,
            opts.warmup.as_secs_f64(),
            scheduled,
            total,
            seconds,
            opts.threads,
        );
        if figures.not_sent > 0 {
            total.errors.insert("not_sent", figures.not_sent);
        }
        let mut summary = Summary::new(info, total, seconds, server_cpu);
        summary.open_loop = Some(figures);
        if let Some(m) = &opts.priority_mix {
            summary.priority_classes = mix::summarize(m, &total.classes);
        }
        summary
    }
}

/// Takes every thread's counts: all of them into `interval` (the live
/// line), the measured window's into `measured` (the interval log) and
/// `total` (the summary). `interval` and `measured` are emptied first.
fn collect(shared: &[SharedPhases], interval: &mut Tally, measured: &mut Tally, total: &mut Tally) {
    interval.reset();
    measured.reset();
    for s in shared {
        let mut p = lock(s);
        interval.merge(&p.warm);
        interval.merge(&p.measured);
        measured.merge(&p.measured);
        p.warm.reset();
        p.measured.reset();
    }
    total.merge(measured);
}

/// One client thread of the open loop.
struct Worker {
    modules: Vec<ModuleId>,
    options: crate::client::ClientOptions,
    report: bool,
    hold: Duration,
    timeout: Duration,
    dispatch: Arc<Dispatch>,
    ready: mpsc::Sender<()>,
    phases: SharedPhases,
    mix: Option<mix::PriorityMix>,
    rng: mix::Rng,
}

/// Below this a thread yields instead of sleeping until a slot is due
/// (a sleep overshoots by tens of µs on a busy machine).
const SPIN_BELOW_NS: u64 = 30_000;

impl Worker {
    fn run(mut self) {
        // Sleeps end on time, not up to 50 µs late (the default slack):
        // lateness of the generator counts in the corrected latency.
        let _ = nix::sys::prctl::set_timerslack(1);
        let mut client = Client::with_options(self.options.clone());
        let _ = self.ready.send(());
        let d = self.dispatch.clone();
        let t0 = d.wait_start();
        let since = |t: Instant| t.saturating_duration_since(t0).as_nanos() as u64;
        let mut turn = 0usize;
        loop {
            let slot = lock(&d.schedule).next_ns();
            if slot >= d.end_ns {
                break;
            }
            let now = loop {
                let now = since(Instant::now());
                if now >= slot || d.stop.load(Ordering::Relaxed) {
                    break now;
                }
                let wait = slot - now;
                if wait > SPIN_BELOW_NS {
                    std::thread::sleep(Duration::from_nanos(wait.min(10_000_000)));
                } else {
                    std::thread::yield_now();
                }
            };
            // Past the window's end the backlog of its slots is still
            // sent (late, and counted so) until it drains or times out.
            if d.stop.load(Ordering::Relaxed) {
                break;
            }
            if now - slot > d.timeout_ns {
                continue; // given up unsent: counted as not sent
            }
            let c = match &mut client {
                Ok(c) => c,
                Err(e) => {
                    self.count(slot, |t| {
                        t.sent += 1;
                        t.error(e.kind());
                    });
                    client = Client::with_options(self.options.clone());
                    continue;
                }
            };
            let m = self.modules[turn];
            turn = (turn + 1) % self.modules.len();
            let drawn = self.mix.as_ref().map(|x| x.draw(self.rng.next_u64()));
            let sent_at = Instant::now();
            let got = match drawn {
                Some((_, p)) => c.get_host_with(m.modid, m.cmdid, p, self.timeout),
                None => c.get_host(m.modid, m.cmdid, self.timeout),
            };
            let done = Instant::now();
            let corrected = since(done).saturating_sub(slot);
            let service = done.duration_since(sent_at).as_nanos() as u64;
            let report = match &got {
                Ok(h) if self.report => {
                    if !self.hold.is_zero() {
                        std::thread::sleep(self.hold);
                    }
                    Some(
                        c.report(m.modid, m.cmdid, h.addr, 0, 0)
                            .map_err(|e| e.kind()),
                    )
                }
                _ => None,
            };
            let busy = sent_at.elapsed().as_nanos() as u64;
            self.count(slot, |t| {
                t.sent += 1;
                t.busy_ns += busy;
                if let Some((class, _)) = drawn {
                    if t.classes.len() <= class {
                        t.classes.resize_with(class + 1, Default::default);
                    }
                    t.classes[class]
                        .count(got.as_ref().map(|_| ()).map_err(|e| e.kind()), corrected);
                }
                match &got {
                    Ok(h) => {
                        t.answer(answer(h.source), corrected);
                        t.service.saturating_record(service.max(1));
                    }
                    Err(e) => t.error(e.kind()),
                }
                if let Some(r) = report {
                    t.report(r);
                }
            });
        }
        if let Ok(c) = &mut client {
            if let Err(e) = c.flush() {
                lock(&self.phases).measured.report(Err(e.kind()));
            }
        }
    }

    /// Counts into the tally of the phase `slot` (an intended send time)
    /// falls in.
    fn count(&self, slot: u64, f: impl FnOnce(&mut Tally)) {
        let mut p = lock(&self.phases);
        f(if slot >= self.dispatch.warm_ns {
            &mut p.measured
        } else {
            &mut p.warm
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_of_a_sweep_or_of_rounds_are_named_by_step_and_round() {
        let p = std::path::Path::new("/tmp/run.hgrm");
        assert_eq!(step_path(p, false, false, 5e4, 0), p);
        assert_eq!(
            step_path(p, true, false, 5e4, 0),
            std::path::Path::new("/tmp/run-50000.hgrm")
        );
        assert_eq!(
            step_path(p, true, true, 5e4, 2),
            std::path::Path::new("/tmp/run-50000-r3.hgrm")
        );
        assert_eq!(
            step_path(std::path::Path::new("x"), false, true, 1.0, 0),
            std::path::Path::new("x-r1")
        );
        assert_eq!(step_tag(1e5, 0), "rate100000-round1");
    }
}
