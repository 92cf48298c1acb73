//! The servers' and the agent's log: `tracing` events written to standard
//! error (journald takes it under systemd) as text or JSON lines, each with
//! its time (UTC, RFC 3339), level, target (the component: the Rust module,
//! e.g. `lbagent_agent::control`: the crate, then the module) and the spans it runs in (`agent`,
//! `shard{id=3}`, `control`, `dnsserver`, `reporter`).
//!
//! [`init`] installs the subscriber once per process; [`set_level`] changes
//! the level live (a configuration reload). [`Gate`] rate-limits a message
//! that repeats (a reconnect loop): it logs the state changes and a count.
//!
//! The CLI tools' own output (`route`, `gethost`, a `--check` verdict, a
//! configuration error before the log exists) stays plain text.

use std::sync::OnceLock;

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Registry;

use lbagent_config::{LogConfig, LogFormat, LogLevel};

/// The live level, set by [`init`].
static LEVEL: OnceLock<reload::Handle<LevelFilter, Registry>> = OnceLock::new();

/// Installs the process's subscriber: `cfg.format` to standard error, at
/// `cfg.level`. A second call (a test harness, `standalone` inside a test)
/// keeps the first subscriber and only sets the level.
pub fn init(cfg: &LogConfig) {
    let (filter, handle) = reload::Layer::new(level_filter(cfg.level));
    if LEVEL.set(handle).is_err() {
        set_level(cfg.level);
        return;
    }
    let registry = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(true);
    let installed = match cfg.format {
        LogFormat::Text => registry.with(fmt).try_init(),
        LogFormat::Json => registry
            .with(fmt.json().flatten_event(true).with_current_span(false))
            .try_init(),
    };
    // Another subscriber was set (a test's): keep it.
    drop(installed);
}

/// Changes the level of the subscriber [`init`] installed (nothing before
/// `init`).
pub fn set_level(level: LogLevel) {
    if let Some(h) = LEVEL.get() {
        let _ = h.modify(|f| *f = level_filter(level));
    }
}

fn level_filter(level: LogLevel) -> LevelFilter {
    match level {
        LogLevel::Off => LevelFilter::OFF,
        LogLevel::Error => LevelFilter::ERROR,
        LogLevel::Warn => LevelFilter::WARN,
        LogLevel::Info => LevelFilter::INFO,
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
    }
}

/// Rate-limits a message that repeats while a state lasts (a connection
/// that keeps failing): the first occurrence of a state is logged, the
/// repeats within `every_ms` are only counted, and the next line (the state
/// changing, or the same state once `every_ms` passed) says how many were
/// left out. Pure: the caller passes the time.
#[derive(Clone, Debug)]
pub struct Gate<K> {
    every_ms: u64,
    last: Option<(K, u64)>,
    suppressed: u64,
}

/// What [`Gate::check`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` repeats of the previous state were left out
    /// since the last line.
    Log {
        /// Occurrences not logged since the last logged line.
        suppressed: u64,
    },
    /// A repeat within the interval: do not log (counted).
    Quiet,
}

impl Verdict {
    /// The repeats left out before a logged line (0 when quiet: they are
    /// still counted in the gate).
    pub fn suppressed(self) -> u64 {
        match self {
            Verdict::Log { suppressed } => suppressed,
            Verdict::Quiet => 0,
        }
    }
}

/// The tail of a gated line: ` (N similar lines left out)`, or nothing.
pub fn left_out(suppressed: u64) -> String {
    match suppressed {
        0 => String::new(),
        1 => " (1 similar line left out)".to_string(),
        n => format!(" ({n} similar lines left out)"),
    }
}

impl<K: PartialEq> Gate<K> {
    /// A gate that logs a repeated state at most once per `every_ms`.
    pub fn new(every_ms: u64) -> Self {
        Gate {
            every_ms,
            last: None,
            suppressed: 0,
        }
    }

    /// Whether an occurrence of `state` at `now_ms` is logged.
    pub fn check(&mut self, state: K, now_ms: u64) -> Verdict {
        let log = match &self.last {
            Some((k, at)) => *k != state || now_ms.saturating_sub(*at) >= self.every_ms,
            None => true,
        };
        if log {
            let suppressed = std::mem::take(&mut self.suppressed);
            self.last = Some((state, now_ms));
            Verdict::Log { suppressed }
        } else {
            self.suppressed += 1;
            Verdict::Quiet
        }
    }

    /// Occurrences counted and not yet reported by a [`Verdict::Log`].
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_occurrence_logs_and_repeats_are_counted() {
        let mut g = Gate::new(60_000);
        assert_eq!(g.check("down", 0), Verdict::Log { suppressed: 0 });
        for t in 1..=5 {
            assert_eq!(g.check("down", t * 100), Verdict::Quiet);
        }
        assert_eq!(g.suppressed(), 5);
        // The state changes: logged at once, with the count of the old one.
        assert_eq!(g.check("up", 700), Verdict::Log { suppressed: 5 });
        assert_eq!(g.suppressed(), 0);
        assert_eq!(g.check("down", 800), Verdict::Log { suppressed: 0 });
    }

    #[test]
    fn a_lasting_state_is_logged_again_once_per_interval() {
        let mut g = Gate::new(1_000);
        assert_eq!(g.check(1u8, 0), Verdict::Log { suppressed: 0 });
        assert_eq!(g.check(1, 999), Verdict::Quiet);
        assert_eq!(g.check(1, 1_000), Verdict::Log { suppressed: 1 });
        assert_eq!(g.check(1, 1_500), Verdict::Quiet);
        assert_eq!(g.check(1, 1_900), Verdict::Quiet);
        assert_eq!(g.check(1, 2_000), Verdict::Log { suppressed: 2 });
    }

    #[test]
    fn the_tail_names_the_count() {
        assert_eq!(left_out(0), "");
        assert_eq!(left_out(1), " (1 similar line left out)");
        assert_eq!(left_out(7), " (7 similar lines left out)");
        assert_eq!(Verdict::Quiet.suppressed(), 0);
    }

    #[test]
    fn a_clock_going_back_does_not_unmute() {
        let mut g = Gate::new(1_000);
        assert_eq!(g.check(1u8, 5_000), Verdict::Log { suppressed: 0 });
        assert_eq!(g.check(1, 4_000), Verdict::Quiet);
    }
}
