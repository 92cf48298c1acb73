//! When the agent's timers are next due (seed 003: no polling for its own
//! sake, wake only on events). Pure: every time is passed in. The shells
//! (`shard_rt`, `control`) sleep until the first thing due, and are woken
//! early by an event that makes something due sooner.

use std::time::Duration;

use lbagent_admission::Micros;
use lbagent_lb::Millis;

/// What a shard's timer task waits for, on the two clocks it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardTimers {
    /// The monotonic milliseconds now ([`lbagent_host::clock::now_ms`]).
    pub now_ms: Millis,
    /// The next register (or retry) deadline, monotonic milliseconds.
    pub deadline_ms: Option<Millis>,
    /// When the next metrics copy (and the shared-memory region's reclaim
    /// and truncation check) is due, monotonic milliseconds.
    pub metrics_ms: Millis,
    /// The realtime microseconds now (the admission window's clock).
    pub now_us: Micros,
    /// When the admission window ends by time, realtime microseconds; None
    /// when it has nothing to decide.
    pub window_us: Option<Micros>,
}

/// How long a shard's timer task may sleep: until the first of the
/// register deadline, the window's end and the metrics second (zero when
/// one is already due).
pub fn shard_sleep(t: &ShardTimers) -> Duration {
    let ms = |at: Millis| Duration::from_millis(at.saturating_sub(t.now_ms));
    let mut sleep = ms(t.metrics_ms);
    if let Some(d) = t.deadline_ms {
        sleep = sleep.min(ms(d));
    }
    if let Some(w) = t.window_us {
        // Whole milliseconds, rounded up: a timer shorter than the
        // runtime's resolution may come back before the window ends.
        let us = w.saturating_sub(t.now_us);
        sleep = sleep.min(Duration::from_millis(us.div_ceil(1000)));
    }
    sleep
}

/// What a sleeping shard timer task planned: it wakes at `at_ms` (monotonic
/// milliseconds) at the latest, and `window` says whether that plan
/// counted an admission window's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimerPlan {
    /// When the task wakes at the latest, monotonic milliseconds.
    pub at_ms: Millis,
    /// Whether the plan counted an admission window's end.
    pub window: bool,
}

impl TimerPlan {
    /// The plan for a task that sleeps `sleep` from `now_ms`.
    pub fn new(now_ms: Millis, sleep: Duration, window: bool) -> Self {
        // Rounded up: a deadline is never planned before it is due.
        let ms = sleep.as_micros().div_ceil(1000) as Millis;
        TimerPlan {
            at_ms: now_ms.saturating_add(ms),
            window,
        }
    }

    /// Whether an event must wake the task now: a register deadline sooner
    /// than the plan, or an admission window that began to matter (its end
    /// is at least a span away, so only its appearance counts; a window
    /// ending later than planned only makes the task wake early, which is
    /// harmless).
    pub fn needs_wake(&self, deadline_ms: Option<Millis>, window_due: bool) -> bool {
        deadline_ms.is_some_and(|d| d < self.at_ms) || (window_due && !self.window)
    }
}

/// The next metrics second after `due` once `now_ms` reached it: one
/// second on, or a second from now when the task fell behind by more
/// (no burst of copies to catch up).
pub fn next_second(due: Millis, now_ms: Millis) -> Millis {
    let next = due.saturating_add(1000);
    if next <= now_ms {
        now_ms.saturating_add(1000)
    } else {
        next
    }
}

/// How long the control core's main loop may sleep: until the next
/// heartbeat or snapshot is due (`None`: none is), but at most `poll` (its
/// look at the reload slot, which another thread sets, and its turn for
/// the liveness watchdog; the stop wakes it through the shards' `Drained`),
/// or `starting` while it waits for the shards to be ready.
pub fn control_sleep(
    until_beat: Option<Duration>,
    until_snapshot: Option<Duration>,
    poll: Duration,
    starting: Option<Duration>,
) -> Duration {
    let mut sleep = starting.unwrap_or(poll).min(poll);
    for until in [until_beat, until_snapshot].into_iter().flatten() {
        sleep = sleep.min(until);
    }
    // Whole milliseconds, rounded up (see shard_sleep).
    Duration::from_millis(sleep.as_micros().div_ceil(1000) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(now_ms: Millis) -> ShardTimers {
        ShardTimers {
            now_ms,
            deadline_ms: None,
            metrics_ms: now_ms + 1000,
            now_us: 5_000_000,
            window_us: None,
        }
    }

    #[test]
    fn an_idle_shard_sleeps_until_the_metrics_second() {
        assert_eq!(shard_sleep(&idle(100)), Duration::from_secs(1));
        let t = ShardTimers {
            metrics_ms: 400,
            ..idle(100)
        };
        assert_eq!(shard_sleep(&t), Duration::from_millis(300));
    }

    #[test]
    fn a_register_deadline_or_a_window_end_comes_first() {
        let t = ShardTimers {
            deadline_ms: Some(130),
            ..idle(100)
        };
        assert_eq!(shard_sleep(&t), Duration::from_millis(30));
        let t = ShardTimers {
            window_us: Some(5_007_000),
            ..t
        };
        assert_eq!(shard_sleep(&t), Duration::from_millis(7));
        let t = ShardTimers {
            window_us: Some(5_000_001),
            ..t
        };
        assert_eq!(shard_sleep(&t), Duration::from_millis(1), "rounded up");
    }

    #[test]
    fn anything_past_due_means_no_sleep() {
        let t = ShardTimers {
            deadline_ms: Some(90),
            ..idle(100)
        };
        assert_eq!(shard_sleep(&t), Duration::ZERO);
        let t = ShardTimers {
            window_us: Some(4_000_000),
            ..idle(100)
        };
        assert_eq!(shard_sleep(&t), Duration::ZERO);
        let t = ShardTimers {
            metrics_ms: 0,
            ..idle(100)
        };
        assert_eq!(shard_sleep(&t), Duration::ZERO);
    }

    #[test]
    fn a_plan_is_rounded_up_to_the_millisecond() {
        let p = TimerPlan::new(100, Duration::from_micros(1500), false);
        assert_eq!(p.at_ms, 102);
        assert_eq!(TimerPlan::new(100, Duration::ZERO, false).at_ms, 100);
    }

    #[test]
    fn only_a_sooner_deadline_or_a_new_window_wakes_the_task() {
        let p = TimerPlan::new(100, Duration::from_millis(900), false);
        assert!(!p.needs_wake(None, false));
        assert!(!p.needs_wake(Some(1000), false), "the plan's own time");
        assert!(!p.needs_wake(Some(5000), false));
        assert!(p.needs_wake(Some(999), false));
        assert!(p.needs_wake(None, true), "a window began to matter");
        let p = TimerPlan::new(100, Duration::from_millis(900), true);
        assert!(!p.needs_wake(None, true), "already counted");
    }

    #[test]
    fn metrics_stay_once_a_second_without_bursts() {
        assert_eq!(next_second(1000, 1003), 2000);
        assert_eq!(next_second(1000, 3500), 4500, "behind: a second from now");
    }

    #[test]
    fn the_control_loop_sleeps_until_a_beat_or_the_poll() {
        let ms = Duration::from_millis;
        let poll = ms(50);
        assert_eq!(control_sleep(None, None, poll, None), poll);
        assert_eq!(
            control_sleep(Some(ms(20)), Some(ms(5000)), poll, None),
            ms(20)
        );
        assert_eq!(
            control_sleep(Some(ms(900)), Some(ms(30)), poll, None),
            ms(30)
        );
        assert_eq!(
            control_sleep(Some(Duration::ZERO), None, poll, None),
            Duration::ZERO
        );
        assert_eq!(control_sleep(None, None, poll, Some(ms(5))), ms(5));
        let us = Duration::from_micros;
        assert_eq!(
            control_sleep(Some(us(1)), None, poll, None),
            ms(1),
            "rounded up"
        );
    }
}
