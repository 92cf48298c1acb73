//! Counting and reporting, with no sockets: what one client thread counts
//! ([`Tally`]), the live line printed every second ([`LiveLine`]) and the
//! final [`Summary`] (text and JSON).
//!
//! The counting rule: only a getHost that returned a host from the agent
//! (or from the route cache, which the agent fed) counts toward QPS. A host
//! from the static route file means the agent is down: it is counted apart
//! as a static-route answer. Every error is counted by its kind
//! (`ClientError::kind()`), and a run always prints them.

use std::collections::BTreeMap;
use std::fmt;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::mix::{merge_classes, ClassSummary, ClassTally};

/// The longest latency a histogram holds, ns (60 s); longer ones are
/// recorded as 60 s.
pub const MAX_LATENCY_NS: u64 = 60_000_000_000;

/// Significant figures of the latency histograms.
const SIGFIG: u8 = 3;

/// A latency histogram in nanoseconds, 1 ns to [`MAX_LATENCY_NS`].
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, SIGFIG).expect("constant, valid bounds")
}

/// Where a getHost's host came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The agent answered.
    Agent,
    /// The client's route cache answered (from a route the agent sent).
    Cache,
    /// The static route file answered: the agent is down.
    StaticRoutes,
}

/// What one client thread (or a whole run, merged) counted.
#[derive(Clone, Debug)]
pub struct Tally {
    /// getHosts the agent answered with a host.
    pub from_agent: u64,
    /// getHosts the route cache answered.
    pub from_cache: u64,
    /// getHosts answered from the static route file (not counted in QPS).
    pub static_route_answers: u64,
    /// getHost errors by kind.
    pub errors: BTreeMap<&'static str, u64>,
    /// Reports sent without error.
    pub reports: u64,
    /// Report (and final flush) errors by kind.
    pub report_errors: BTreeMap<&'static str, u64>,
    /// Round-trip latency of the getHosts counted in QPS, ns.
    pub latency: Histogram<u64>,
    /// Per priority class of `--priority-mix` (empty without one).
    pub classes: Vec<ClassTally>,
    /// Open loop: service time of the answered getHosts, from the actual
    /// send, ns (the latency above counts from the intended send time).
    pub service: Histogram<u64>,
    /// Open loop: getHosts sent.
    pub sent: u64,
    /// Open loop: nanoseconds the threads spent in calls (getHost, report,
    /// hold), for how busy they were.
    pub busy_ns: u64,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            from_agent: 0,
            from_cache: 0,
            static_route_answers: 0,
            errors: BTreeMap::new(),
            reports: 0,
            report_errors: BTreeMap::new(),
            latency: latency_histogram(),
            classes: Vec::new(),
            service: latency_histogram(),
            sent: 0,
            busy_ns: 0,
        }
    }
}

impl Tally {
    /// An empty tally.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts a getHost that returned a host from `answer` after `ns`
    /// nanoseconds.
    pub fn answer(&mut self, answer: Answer, ns: u64) {
        match answer {
            Answer::Agent => self.from_agent += 1,
            Answer::Cache => self.from_cache += 1,
            Answer::StaticRoutes => {
                self.static_route_answers += 1;
                return;
            }
        }
        self.latency.saturating_record(ns.max(1));
    }

    /// Counts a getHost that failed with an error of `kind`.
    pub fn error(&mut self, kind: &'static str) {
        *self.errors.entry(kind).or_insert(0) += 1;
    }

    /// Counts a report: `Ok` or the kind of its error.
    pub fn report(&mut self, result: Result<(), &'static str>) {
        match result {
            Ok(()) => self.reports += 1,
            Err(kind) => *self.report_errors.entry(kind).or_insert(0) += 1,
        }
    }

    /// getHosts counted toward QPS: a host from the agent or its cache.
    pub fn counted(&self) -> u64 {
        self.from_agent + self.from_cache
    }

    /// getHosts not counted: static-route answers and errors of every kind.
    pub fn not_counted(&self) -> u64 {
        self.static_route_answers + self.errors.values().sum::<u64>()
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &Tally) {
        self.from_agent += other.from_agent;
        self.from_cache += other.from_cache;
        self.static_route_answers += other.static_route_answers;
        for (k, n) in &other.errors {
            *self.errors.entry(k).or_insert(0) += n;
        }
        self.reports += other.reports;
        for (k, n) in &other.report_errors {
            *self.report_errors.entry(k).or_insert(0) += n;
        }
        // Same bounds on both sides: addition cannot fail.
        let _ = self.latency.add(&other.latency);
        merge_classes(&mut self.classes, &other.classes);
        let _ = self.service.add(&other.service);
        self.sent += other.sent;
        self.busy_ns += other.busy_ns;
    }

    /// Empties the tally, keeping its allocations.
    pub fn reset(&mut self) {
        self.from_agent = 0;
        self.from_cache = 0;
        self.static_route_answers = 0;
        self.errors.clear();
        self.reports = 0;
        self.report_errors.clear();
        self.latency.reset();
        for c in &mut self.classes {
            c.reset();
        }
        self.service.reset();
        self.sent = 0;
        self.busy_ns = 0;
    }
}

/// Latency percentiles in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// The largest.
    pub max: f64,
    /// The mean.
    pub mean: f64,
}

impl Latency {
    /// The percentiles of `h` (ns) in microseconds; None when it is empty.
    pub fn of(h: &Histogram<u64>) -> Option<Latency> {
        if h.is_empty() {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1_000.0;
        Some(Latency {
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
            mean: h.mean() / 1_000.0,
        })
    }
}

/// The server's CPU time over the run, and what was measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerCpu {
    /// CPU seconds (user + system).
    pub seconds: f64,
    /// What was read, e.g. "floor thread" or "agent process 1234".
    pub what: String,
}

/// How a run was set up, for the summary.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunInfo {
    /// What was measured: "floor", "agent" or "standalone".
    pub target: String,
    /// The heartbeat file the clients followed.
    pub heartbeat: String,
    /// Client threads.
    pub threads: u32,
    /// Modules the threads were spread over.
    pub modules: u32,
    /// A report of success followed each getHost that returned a host.
    pub report: bool,
    /// The clients went through the route cache.
    pub cache: bool,
    /// The getHost timeout, ms.
    pub timeout_ms: u64,
}

/// A run's result: what `lbagent qpstest` prints at the end, and `--json`
/// prints as one object.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// How the run was set up.
    #[serde(flatten)]
    pub info: RunInfo,
    /// Seconds measured.
    pub seconds: f64,
    /// getHosts that returned a host from the agent or its cache.
    pub get_hosts: u64,
    /// `get_hosts / seconds`.
    pub qps: f64,
    /// Of `get_hosts`: answered by the agent.
    pub from_agent: u64,
    /// Of `get_hosts`: answered by the route cache.
    pub from_cache: u64,
    /// Hosts from the static route file (agent down): not in `get_hosts`.
    pub static_route_answers: u64,
    /// getHost errors by kind (not in `get_hosts`).
    pub errors: BTreeMap<String, u64>,
    /// Sum of `errors`.
    pub error_total: u64,
    /// Reports sent without error.
    pub reports: u64,
    /// Report errors by kind.
    pub report_errors: BTreeMap<String, u64>,
    /// Round-trip latency of the getHosts in `get_hosts`, µs (null when none).
    pub latency_us: Option<Latency>,
    /// The server's CPU over the run, when it could be read.
    pub server_cpu: Option<ServerCpu>,
    /// `get_hosts` per server CPU-second: the figure that is fair on a
    /// machine where the load generator competes for the cores.
    pub get_hosts_per_server_cpu_second: Option<f64>,
    /// Set when the agent served nothing, or some getHosts came from the
    /// static route file: the figures then do not measure the agent.
    /// Printed as a `WARNING:` line.
    pub warning: Option<String>,
    /// Per priority class, with `--priority-mix` (absent without).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub priority_classes: Vec<ClassSummary>,
    /// The open loop's figures (absent in the closed loop): there
    /// `latency_us` counts from each request's intended send time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_loop: Option<super::open_figures::OpenFigures>,
}

impl Summary {
    /// The summary of `tally`, counted over `seconds`.
    pub fn new(info: RunInfo, tally: &Tally, seconds: f64, server_cpu: Option<ServerCpu>) -> Self {
        let get_hosts = tally.counted();
        let per_cpu = server_cpu
            .as_ref()
            .filter(|c| c.seconds > 0.0)
            .map(|c| get_hosts as f64 / c.seconds);
        let owned = |m: &BTreeMap<&'static str, u64>| -> BTreeMap<String, u64> {
            m.iter().map(|(k, v)| (k.to_string(), *v)).collect()
        };
        Summary {
            info,
            seconds,
            get_hosts,
            qps: if seconds > 0.0 {
                get_hosts as f64 / seconds
            } else {
                0.0
            },
            from_agent: tally.from_agent,
            from_cache: tally.from_cache,
            static_route_answers: tally.static_route_answers,
            error_total: tally.errors.values().sum(),
            errors: owned(&tally.errors),
            reports: tally.reports,
            report_errors: owned(&tally.report_errors),
            latency_us: Latency::of(&tally.latency),
            server_cpu,
            get_hosts_per_server_cpu_second: per_cpu,
            warning: warning(tally),
            priority_classes: Vec::new(),
            open_loop: None,
        }
    }

    /// The summary as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a summary always serializes")
    }
}

/// What must not go unnoticed: an agent that served nothing, or answers
/// that came from the static route file instead.
fn warning(t: &Tally) -> Option<String> {
    let errors: u64 = t.errors.values().sum();
    if t.counted() == 0 {
        return Some(format!(
            "the agent served nothing: 0 getHosts from the agent or its cache \
             ({} from the static route file, {errors} errors)",
            t.static_route_answers
        ));
    }
    (t.static_route_answers > 0).then(|| {
        format!(
            "{} getHosts were answered from the static route file, not the agent",
            t.static_route_answers
        )
    })
}

/// `kind N, kind N` or `none`.
fn kinds(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.info;
        if let Some(w) = &self.warning {
            writeln!(f, "WARNING: {w}")?;
        }
        writeln!(
            f,
            "qpstest {} ({}): {} threads, {} module{}, getHost{}{}, {:.2} s",
            i.target,
            i.heartbeat,
            i.threads,
            i.modules,
            if i.modules == 1 { "" } else { "s" },
            if i.report { " + report" } else { " only" },
            if i.cache { ", route cache" } else { "" },
            self.seconds
        )?;
        writeln!(
            f,
            "getHost answered: {} ({:.0}/s; agent {}, cache {})",
            self.get_hosts, self.qps, self.from_agent, self.from_cache
        )?;
        writeln!(
            f,
            "not counted: static-route answers {}; errors {}: {}",
            self.static_route_answers,
            self.error_total,
            kinds(&self.errors)
        )?;
        if i.report {
            writeln!(
                f,
                "reports: {} sent; errors: {}",
                self.reports,
                kinds(&self.report_errors)
            )?;
        }
        if let Some(o) = &self.open_loop {
            write!(f, "{o}")?;
        }
        match &self.latency_us {
            Some(l) => writeln!(
                f,
                "latency (µs, getHosts answered{}{}): p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
                if i.cache && self.open_loop.is_none() {
                    ", one in 64 timed"
                } else {
                    ""
                },
                if self.open_loop.is_some() {
                    ", from the intended send time"
                } else {
                    ""
                },
                l.p50, l.p90, l.p99, l.p999, l.max, l.mean
            )?,
            None => writeln!(f, "latency: no getHost was answered")?,
        }
        if let Some(l) = self.open_loop.as_ref().and_then(|o| o.service_us) {
            writeln!(
                f,
                "service time (µs, from the actual send, uncorrected): p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}",
                l.p50, l.p90, l.p99, l.p999, l.max
            )?;
        }
        for c in &self.priority_classes {
            writeln!(f, "{c}")?;
        }
        match (&self.server_cpu, self.get_hosts_per_server_cpu_second) {
            (Some(c), Some(per)) => write!(
                f,
                "server CPU ({}): {:.2} s, {:.0}% of a core -> {:.0} getHost per server CPU-second",
                c.what,
                c.seconds,
                100.0 * c.seconds / self.seconds.max(1e-9),
                per
            ),
            (Some(c), None) => write!(f, "server CPU ({}): {:.2} s", c.what, c.seconds),
            (None, _) => write!(
                f,
                "server CPU: unknown (no server process found, or /proc not readable)"
            ),
        }
    }
}

/// The line printed every second of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveLine {
    /// Seconds since the run started.
    pub at: f64,
    /// getHosts counted in this interval, per second.
    pub qps: f64,
    /// getHosts not counted in this interval (errors and static-route answers).
    pub not_counted: u64,
    /// Median latency of this interval, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile latency of this interval, µs.
    pub p99_us: Option<f64>,
    /// Server CPU in this interval, percent of one core.
    pub server_cpu_pct: Option<f64>,
    /// Open loop: the requests per second the schedule offered in this
    /// interval, and the getHosts per second sent.
    pub open_rates: Option<(f64, f64)>,
}

impl LiveLine {
    /// The line for `interval`, which lasted `secs` and ended `at` seconds
    /// into the run.
    pub fn new(at: f64, interval: &Tally, secs: f64, server_cpu_s: Option<f64>) -> Self {
        let q = |p: f64| {
            (!interval.latency.is_empty())
                .then(|| interval.latency.value_at_quantile(p) as f64 / 1_000.0)
        };
        let secs = secs.max(1e-9);
        LiveLine {
            at,
            qps: interval.counted() as f64 / secs,
            not_counted: interval.not_counted(),
            p50_us: q(0.50),
            p99_us: q(0.99),
            server_cpu_pct: server_cpu_s.map(|c| 100.0 * c / secs),
            open_rates: None,
        }
    }
}

impl fmt::Display for LiveLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}µs"));
        write!(
            f,
            "{:6.1}s  getHost/s {:>9.0}  errors {:>6}  p50 {:>9}  p99 {:>9}",
            self.at,
            self.qps,
            self.not_counted,
            us(self.p50_us),
            us(self.p99_us)
        )?;
        if let Some(c) = self.server_cpu_pct {
            write!(f, "  server CPU {c:.0}%")?;
        }
        if let Some((offered, sent)) = self.open_rates {
            write!(f, "  offered/s {offered:.0}  sent/s {sent:.0}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> RunInfo {
        RunInfo {
            target: "floor".into(),
            heartbeat: "/tmp/hb".into(),
            threads: 4,
            modules: 1,
            report: true,
            cache: false,
            timeout_ms: 1000,
        }
    }

    #[test]
    fn only_hosts_from_the_agent_or_its_cache_count() {
        let mut t = Tally::new();
        t.answer(Answer::Agent, 10_000);
        t.answer(Answer::Cache, 2_000);
        t.answer(Answer::StaticRoutes, 1_000);
        t.error("no_such_module");
        t.error("timeout");
        t.error("timeout");
        assert_eq!(t.counted(), 2);
        assert_eq!(t.not_counted(), 4);
        // The static-route answer is not in the latency either.
        assert_eq!(t.latency.len(), 2);
        let s = Summary::new(info(), &t, 2.0, None);
        assert_eq!((s.get_hosts, s.qps), (2, 1.0));
        assert_eq!(s.static_route_answers, 1);
        assert_eq!(s.error_total, 3);
        assert_eq!(s.errors["timeout"], 2);
        assert_eq!(s.errors["no_such_module"], 1);
    }

    #[test]
    fn a_run_with_only_errors_has_zero_qps_and_no_latency() {
        let mut t = Tally::new();
        for _ in 0..5 {
            t.error("agent_down");
        }
        let s = Summary::new(info(), &t, 1.0, None);
        assert_eq!((s.get_hosts, s.qps, s.error_total), (0, 0.0, 5));
        assert_eq!(s.latency_us, None);
        let text = s.to_string();
        assert!(text.contains("errors 5: agent_down 5"), "{text}");
        assert!(text.contains("no getHost was answered"), "{text}");
    }

    #[test]
    fn a_run_the_agent_served_nothing_says_so_loudly_in_text_and_json() {
        let mut t = Tally::new();
        for _ in 0..7 {
            t.answer(Answer::StaticRoutes, 1_000);
        }
        let s = Summary::new(info(), &t, 1.0, None);
        let w = s.warning.clone().expect("a warning");
        assert!(
            w.contains("served nothing") && w.contains("7 from the static route file"),
            "{w}"
        );
        assert!(
            s.to_string()
                .starts_with("WARNING: the agent served nothing"),
            "{s}"
        );
        let json: serde_json::Value = serde_json::from_str(&s.to_json()).unwrap();
        assert_eq!(json["warning"], serde_json::Value::String(w));
        // Some static answers among agent ones: a warning too; none: no warning.
        t.answer(Answer::Agent, 1_000);
        assert!(Summary::new(info(), &t, 1.0, None)
            .warning
            .unwrap()
            .contains("7 getHosts"));
        let mut clean = Tally::new();
        clean.answer(Answer::Agent, 1_000);
        let s = Summary::new(info(), &clean, 1.0, None);
        assert_eq!(s.warning, None);
        assert!(s.to_json().contains("\"warning\":null"));
    }

    #[test]
    fn percentiles_come_from_the_histogram_in_microseconds() {
        let mut t = Tally::new();
        // 1..=1000 µs, one each.
        for us in 1..=1000u64 {
            t.answer(Answer::Agent, us * 1_000);
        }
        let l = Latency::of(&t.latency).unwrap();
        let close = |got: f64, want: f64| (got - want).abs() <= want * 0.002 + 0.001;
        assert!(close(l.p50, 500.0), "{l:?}");
        assert!(close(l.p90, 900.0), "{l:?}");
        assert!(close(l.p99, 990.0), "{l:?}");
        assert!(close(l.p999, 999.0), "{l:?}");
        assert!(close(l.max, 1000.0), "{l:?}");
        assert!(close(l.mean, 500.5), "{l:?}");
    }

    #[test]
    fn latency_beyond_the_histogram_saturates_instead_of_failing() {
        let mut t = Tally::new();
        t.answer(Answer::Agent, u64::MAX);
        t.answer(Answer::Agent, 0);
        let l = Latency::of(&t.latency).unwrap();
        assert!(l.max >= MAX_LATENCY_NS as f64 / 1_000.0 * 0.999, "{l:?}");
        assert_eq!(t.latency.len(), 2);
    }

    #[test]
    fn merging_adds_counts_kinds_and_histograms_and_reset_empties() {
        let mut a = Tally::new();
        a.answer(Answer::Agent, 5_000);
        a.error("timeout");
        a.report(Ok(()));
        let mut b = Tally::new();
        b.answer(Answer::Agent, 7_000);
        b.answer(Answer::StaticRoutes, 7_000);
        b.error("timeout");
        b.error("overloaded");
        b.report(Err("agent_down"));
        a.merge(&b);
        assert_eq!((a.from_agent, a.static_route_answers, a.reports), (2, 1, 1));
        assert_eq!(a.errors[&"timeout"], 2);
        assert_eq!(a.errors[&"overloaded"], 1);
        assert_eq!(a.report_errors[&"agent_down"], 1);
        assert_eq!(a.latency.len(), 2);
        a.reset();
        assert_eq!((a.counted(), a.not_counted(), a.latency.len()), (0, 0, 0));
        assert!(a.report_errors.is_empty());
    }

    #[test]
    fn per_server_cpu_second_needs_a_positive_cpu_time() {
        let mut t = Tally::new();
        for _ in 0..300 {
            t.answer(Answer::Agent, 1_000);
        }
        let cpu = |s: f64| {
            Some(ServerCpu {
                seconds: s,
                what: "floor thread".into(),
            })
        };
        let s = Summary::new(info(), &t, 3.0, cpu(1.5));
        assert_eq!(s.get_hosts_per_server_cpu_second, Some(200.0));
        assert!(s.to_string().contains("200 getHost per server CPU-second"));
        let s = Summary::new(info(), &t, 3.0, cpu(0.0));
        assert_eq!(s.get_hosts_per_server_cpu_second, None);
        let s = Summary::new(info(), &t, 3.0, None);
        assert!(s.to_string().contains("server CPU: unknown"));
    }

    #[test]
    fn json_is_one_object_with_every_figure() {
        let mut t = Tally::new();
        t.answer(Answer::Agent, 20_000);
        t.error("timeout");
        let s = Summary::new(
            info(),
            &t,
            1.0,
            Some(ServerCpu {
                seconds: 0.5,
                what: "floor thread".into(),
            }),
        );
        let json = s.to_json();
        assert!(!json.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["target"], "floor");
        assert_eq!(v["threads"], 4);
        assert_eq!(v["get_hosts"], 1);
        assert_eq!(v["qps"], 1.0);
        assert_eq!(v["errors"]["timeout"], 1);
        assert_eq!(v["error_total"], 1);
        assert_eq!(v["static_route_answers"], 0);
        assert_eq!(v["get_hosts_per_server_cpu_second"], 2.0);
        assert_eq!(v["server_cpu"]["seconds"], 0.5);
        let p50 = v["latency_us"]["p50"].as_f64().unwrap();
        assert!((p50 - 20.0).abs() < 0.05, "{p50}");
        for k in ["p90", "p99", "p999", "max", "mean"] {
            assert!(v["latency_us"][k].is_number(), "{k}");
        }
        let empty = Summary::new(info(), &Tally::new(), 1.0, None).to_json();
        let v: serde_json::Value = serde_json::from_str(&empty).unwrap();
        assert!(v["latency_us"].is_null() && v["server_cpu"].is_null());
    }

    #[test]
    fn the_live_line_shows_the_interval() {
        let mut t = Tally::new();
        for _ in 0..1000 {
            t.answer(Answer::Agent, 30_000);
        }
        t.error("timeout");
        let line = LiveLine::new(3.0, &t, 0.5, Some(0.25));
        assert_eq!(line.qps, 2000.0);
        assert_eq!(line.not_counted, 1);
        assert_eq!(line.server_cpu_pct, Some(50.0));
        let text = line.to_string();
        assert!(text.contains("getHost/s      2000"), "{text}");
        assert!(text.contains("errors      1"), "{text}");
        assert!(text.contains("server CPU 50%"), "{text}");
        assert!(!text.contains("offered"), "{text}");
        let mut open = line.clone();
        open.open_rates = Some((5000.0, 4000.0));
        assert!(
            open.to_string().ends_with("offered/s 5000  sent/s 4000"),
            "{open}"
        );
        let idle = LiveLine::new(1.0, &Tally::new(), 1.0, None).to_string();
        assert!(idle.contains("p50         -"), "{idle}");
    }
}
