//! Overload detection: the average queuing time over a window that ends
//! after a time span or a number of samples, whichever comes first (seed
//! 004: 1 s or 2000 requests, overloaded above 20 ms).

use super::Micros;

/// One finished window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowEnd {
    /// Queuing-time samples the window held.
    pub samples: u32,
    /// Their average, microseconds (0 for an empty window).
    pub avg_queuing_us: Micros,
    /// Whether the average exceeded the threshold.
    pub overloaded: bool,
    /// Why it ended: `true` by count, `false` by time.
    pub by_count: bool,
    /// Requests the queue turned away in the window (see
    /// [`Window::dropped`]); any makes the window overloaded.
    pub dropped: u32,
}

/// The current window of queuing-time samples.
#[derive(Clone, Debug)]
pub struct Window {
    span_us: Micros,
    max_samples: u32,
    threshold_us: Micros,
    start: Option<Micros>,
    samples: u32,
    sum_us: u64,
    dropped: u32,
}

impl Window {
    /// A window of at most `span_us` or `max_samples` samples (at least 1),
    /// overloaded when the average queuing time exceeds `threshold_us`.
    pub fn new(span_us: Micros, max_samples: u32, threshold_us: Micros) -> Self {
        Window {
            span_us: span_us.max(1),
            max_samples: max_samples.max(1),
            threshold_us,
            start: None,
            samples: 0,
            sum_us: 0,
            dropped: 0,
        }
    }

    /// Counts `n` requests that found the queue full and were dropped
    /// before anyone could handle them (the agent's kernel receive queue:
    /// `SO_RXQ_OVFL`). A dropped request waited longer than any queuing
    /// time the window measures (it is never handled), so a window with
    /// any drop is overloaded, whatever the average of the others: a
    /// queue bounded at about the threshold's worth (a sized receive
    /// buffer) never averages above the threshold, it overflows instead.
    pub fn dropped(&mut self, n: u32) {
        self.dropped = self.dropped.saturating_add(n);
    }

    /// When the current window started (`None` before the first event).
    pub fn started(&self) -> Option<Micros> {
        self.start
    }

    /// When the current window ends by time: its start plus the span
    /// (`None` before the first event).
    pub fn ends_at(&self) -> Option<Micros> {
        self.start.map(|s| s.saturating_add(self.span_us))
    }

    /// Samples in the current window.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Records that a request started processing at `now` after queuing
    /// `queuing_us`. Returns the window's end when this sample ends it
    /// (by count, or by time when `now` is past the span); the next window
    /// then starts at `now`.
    pub fn record(&mut self, now: Micros, queuing_us: Micros) -> Option<WindowEnd> {
        // A window whose time ran out ends before this sample, which opens
        // the next one (tick also starts the very first window).
        let by_time = self.tick(now);
        self.samples += 1;
        self.sum_us = self.sum_us.saturating_add(queuing_us);
        if by_time.is_some() {
            return by_time;
        }
        if self.samples >= self.max_samples {
            return Some(self.finish(now, true));
        }
        None
    }

    /// Ends the window by time when `now` is `span_us` or more past its
    /// start (call it periodically, so that a window ends even when no
    /// request starts). Before the first event it only starts the window.
    pub fn tick(&mut self, now: Micros) -> Option<WindowEnd> {
        match self.start {
            None => {
                self.start = Some(now);
                None
            }
            Some(s) if now.saturating_sub(s) >= self.span_us => Some(self.finish(now, false)),
            Some(_) => None,
        }
    }

    fn finish(&mut self, now: Micros, by_count: bool) -> WindowEnd {
        let avg = self
            .sum_us
            .checked_div(u64::from(self.samples))
            .unwrap_or(0);
        let end = WindowEnd {
            samples: self.samples,
            avg_queuing_us: avg,
            overloaded: avg > self.threshold_us || self.dropped > 0,
            by_count,
            dropped: self.dropped,
        };
        self.start = Some(now);
        self.samples = 0;
        self.sum_us = 0;
        self.dropped = 0;
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Micros = 1000;

    #[test]
    fn a_window_ends_by_count() {
        let mut w = Window::new(1000 * MS, 3, 20 * MS);
        assert_eq!(w.record(0, 10 * MS), None);
        assert_eq!(w.record(MS, 20 * MS), None);
        let end = w.record(2 * MS, 60 * MS).expect("the third sample ends it");
        assert_eq!(end.samples, 3);
        assert_eq!(end.avg_queuing_us, 30 * MS);
        assert!(end.overloaded);
        assert!(end.by_count);
        // The next window starts afresh.
        assert_eq!(w.record(3 * MS, 0), None);
        assert_eq!(w.started(), Some(2 * MS));
    }

    #[test]
    fn a_window_ends_by_time_on_tick_or_on_the_next_sample() {
        let mut w = Window::new(1000 * MS, 2000, 20 * MS);
        assert_eq!(w.tick(0), None, "the first tick starts the window");
        assert_eq!(w.record(10 * MS, 5 * MS), None);
        assert_eq!(w.tick(999 * MS), None, "one microsecond short");
        let end = w.tick(1000 * MS).expect("the span is up");
        assert_eq!(
            (
                end.samples,
                end.avg_queuing_us,
                end.overloaded,
                end.by_count
            ),
            (1, 5 * MS, false, false)
        );
        // Late sample: the old window ends empty, the sample opens the next.
        let end = w
            .record(2500 * MS, 40 * MS)
            .expect("the span ran out before this sample");
        assert_eq!(
            (end.samples, end.avg_queuing_us, end.overloaded),
            (0, 0, false)
        );
        let end = w.record(2501 * MS, 0).map(|e| e.samples);
        assert_eq!(end, None);
        let end = w.tick(3500 * MS).expect("span from 2500 ms");
        assert_eq!((end.samples, end.avg_queuing_us), (2, 20 * MS));
        assert!(!end.overloaded, "exactly the threshold is not overload");
    }

    #[test]
    fn a_drop_makes_the_window_overloaded_and_is_counted_once() {
        let mut w = Window::new(1000 * MS, 3, 500);
        assert_eq!(w.record(0, 10), None);
        w.dropped(2);
        w.dropped(1);
        assert_eq!(w.record(1, 10), None);
        let end = w.record(2, 10).expect("by count");
        assert_eq!((end.avg_queuing_us, end.dropped), (10, 3));
        assert!(end.overloaded, "short queue, but it overflowed");
        // The next window starts without drops.
        w.record(3, 10);
        w.record(4, 10);
        let end = w.record(5, 10).unwrap();
        assert!(!end.overloaded && end.dropped == 0);
        // Drops alone (nothing handled) end overloaded by time.
        w.dropped(1);
        let end = w.tick(5 + 1000 * MS).unwrap();
        assert!(end.overloaded && end.samples == 0);
    }

    #[test]
    fn the_threshold_is_strict() {
        let mut w = Window::new(1000 * MS, 1, 20 * MS);
        assert!(!w.record(0, 20 * MS).unwrap().overloaded);
        assert!(w.record(1, 20 * MS + 1).unwrap().overloaded);
    }
}
