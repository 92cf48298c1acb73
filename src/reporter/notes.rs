//! What the reporter says in its log, and how often, sans-IO: every event
//! that can repeat at the rate of the traffic (rows dropped, a store that
//! stays down, connections closed for bad frames) becomes at most one line
//! per interval that counts what happened since the previous line.
//!
//! Time is an argument (milliseconds since the Unix epoch); nothing here
//! reads a clock or writes a line: the caller logs the strings returned.

use std::fmt;

/// The loss of rows to the buffer bound: the first drop of a burst is said
/// at once, later drops are summed into one line per interval.
#[derive(Clone, Debug)]
pub struct LossNotes {
    interval_ms: u64,
    /// Dropped since the last line.
    pending: u64,
    /// When the first of `pending` was dropped.
    since_ms: u64,
    last_line_ms: Option<u64>,
    total: u64,
}

impl LossNotes {
    /// At most one line per `interval_ms`.
    pub fn new(interval_ms: u64) -> Self {
        LossNotes {
            interval_ms,
            pending: 0,
            since_ms: 0,
            last_line_ms: None,
            total: 0,
        }
    }

    /// Records `rows` dropped at `now_ms`.
    pub fn dropped(&mut self, rows: u64, now_ms: u64) {
        if rows == 0 {
            return;
        }
        if self.pending == 0 {
            self.since_ms = now_ms;
        }
        self.pending += rows;
        self.total += rows;
    }

    /// The line to log now, if any: drops not yet said, and the previous
    /// line at least an interval ago (or none yet). `bound` is the buffer's.
    pub fn due(&mut self, now_ms: u64, bound: usize) -> Option<String> {
        let quiet = self
            .last_line_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= self.interval_ms);
        if !quiet {
            return None;
        }
        let line = self.flush(bound)?;
        self.last_line_ms = Some(now_ms);
        Some(line)
    }

    /// When [`Self::due`] will next have a line, in milliseconds since the
    /// epoch: `None` while no drop waits to be said (nothing to wake for),
    /// else an interval after the previous line (0: now, none yet).
    pub fn next_due(&self) -> Option<u64> {
        if self.pending == 0 {
            return None;
        }
        Some(
            self.last_line_ms
                .map_or(0, |last| last.saturating_add(self.interval_ms)),
        )
    }

    /// The line for drops not yet said, whatever the interval (at stop).
    pub fn flush(&mut self, bound: usize) -> Option<String> {
        if self.pending == 0 {
            return None;
        }
        let line = format!(
            "buffer full ({bound} rows, reporter.buffer_rows): dropped the {} oldest rows since {} ({} dropped since start); the store is not keeping up: see lbagent_reporter_store_up and the store's own log",
            self.pending,
            Utc(self.since_ms),
            self.total
        );
        self.pending = 0;
        Some(line)
    }
}

/// One writer's view of the store's availability: a line when it goes
/// down, a reminder per interval while it stays down, a line when it is
/// back.
#[derive(Clone, Debug)]
pub struct OutageNotes {
    interval_ms: u64,
    down_since_ms: Option<u64>,
    failures: u64,
    last_line_ms: u64,
}

impl OutageNotes {
    /// At most one reminder per `interval_ms` while down.
    pub fn new(interval_ms: u64) -> Self {
        OutageNotes {
            interval_ms,
            down_since_ms: None,
            failures: 0,
            last_line_ms: 0,
        }
    }

    /// Whether the last attempt failed.
    pub fn is_down(&self) -> bool {
        self.down_since_ms.is_some()
    }

    /// An attempt to connect or write failed with `why`; `retry_max_ms` is
    /// the back-off's cap. Returns the line to log, if one is due.
    pub fn failed(
        &mut self,
        now_ms: u64,
        why: &dyn fmt::Display,
        retry_max_ms: u64,
    ) -> Option<String> {
        self.failures += 1;
        let Some(since) = self.down_since_ms else {
            self.down_since_ms = Some(now_ms);
            self.last_line_ms = now_ms;
            return Some(format!(
                "{why}; rows stay buffered (up to reporter.buffer_rows in all) and the write is retried with back-off up to {retry_max_ms} ms"
            ));
        };
        if now_ms.saturating_sub(self.last_line_ms) < self.interval_ms {
            return None;
        }
        self.last_line_ms = now_ms;
        Some(format!(
            "still failing after {} ({} failed attempts): {why}",
            Secs(now_ms.saturating_sub(since)),
            self.failures
        ))
    }

    /// An attempt succeeded. Returns the line to log when it ends an outage.
    pub fn succeeded(&mut self, now_ms: u64) -> Option<String> {
        let since = self.down_since_ms.take()?;
        let failures = std::mem::take(&mut self.failures);
        Some(format!(
            "store back after {} ({failures} failed attempts)",
            Secs(now_ms.saturating_sub(since))
        ))
    }
}

/// At most one line per interval about a repeating event, saying how many
/// occurrences the silent period hid.
#[derive(Clone, Debug)]
pub struct Throttle {
    interval_ms: u64,
    last_line_ms: Option<u64>,
    suppressed: u64,
}

impl Throttle {
    /// At most one line per `interval_ms`.
    pub fn new(interval_ms: u64) -> Self {
        Throttle {
            interval_ms,
            last_line_ms: None,
            suppressed: 0,
        }
    }

    /// The event happened at `now_ms`: `Some(n)` when a line is due, `n`
    /// being the occurrences not said since the last line; `None` when this
    /// one is to be kept quiet (and counted).
    pub fn allow(&mut self, now_ms: u64) -> Option<u64> {
        let due = self
            .last_line_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= self.interval_ms);
        if !due {
            self.suppressed += 1;
            return None;
        }
        self.last_line_ms = Some(now_ms);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// A duration in milliseconds, printed as seconds with one decimal.
struct Secs(u64);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{} s", self.0 / 1000, self.0 % 1000 / 100)
    }
}

/// Milliseconds since the Unix epoch, printed as RFC 3339 UTC to the second
/// (`2023-11-14T22:13:20Z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Utc(pub u64);

impl fmt::Display for Utc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0 / 1000;
        let (days, rem) = (secs / 86_400, secs % 86_400);
        let (y, m, d) = civil_from_days(days);
        let (hh, mm, ss) = (rem / 3600, rem % 3600 / 60, rem % 60);
        write!(f, "{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z")
    }
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for non-negative days).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_prints_known_instants() {
        assert_eq!(Utc(0).to_string(), "1970-01-01T00:00:00Z");
        assert_eq!(Utc(951_782_400_000).to_string(), "2000-02-29T00:00:00Z");
        assert_eq!(Utc(1_700_000_000_999).to_string(), "2023-11-14T22:13:20Z");
        assert_eq!(Utc(4_107_542_399_000).to_string(), "2100-02-28T23:59:59Z");
    }

    #[test]
    fn the_first_drop_is_said_at_once_and_later_ones_are_summed_per_interval() {
        let mut notes = LossNotes::new(10_000);
        assert_eq!(notes.due(0, 100), None, "nothing dropped");
        notes.dropped(3, 1_700_000_000_000);
        let first = notes.due(1_700_000_000_000, 100).unwrap();
        assert!(
            first.contains("dropped the 3 oldest rows since 2023-11-14T22:13:20Z"),
            "{first}"
        );
        assert!(first.contains("(3 dropped since start)"), "{first}");
        assert!(first.contains("buffer full (100 rows"), "{first}");
        notes.dropped(5, 1_700_000_001_000);
        notes.dropped(7, 1_700_000_002_000);
        assert_eq!(
            notes.due(1_700_000_005_000, 100),
            None,
            "within the interval"
        );
        let second = notes.due(1_700_000_010_000, 100).unwrap();
        assert!(
            second.contains("dropped the 12 oldest rows since 2023-11-14T22:13:21Z"),
            "{second}"
        );
        assert!(second.contains("(15 dropped since start)"), "{second}");
        assert_eq!(notes.due(1_700_000_030_000, 100), None, "nothing new");
    }

    #[test]
    fn the_next_line_is_due_only_while_drops_wait_to_be_said() {
        let mut notes = LossNotes::new(10_000);
        assert_eq!(
            notes.next_due(),
            None,
            "nothing dropped: nothing to wake for"
        );
        notes.dropped(3, 1_000);
        assert_eq!(notes.next_due(), Some(0), "no line yet: due now");
        assert!(notes.due(1_000, 100).is_some());
        assert_eq!(notes.next_due(), None, "said");
        notes.dropped(2, 4_000);
        assert_eq!(notes.next_due(), Some(11_000), "an interval after the line");
        assert_eq!(notes.due(10_999, 100), None);
        assert!(
            notes.due(11_000, 100).is_some(),
            "due when it said it would be"
        );
        assert_eq!(notes.next_due(), None);
    }

    #[test]
    fn a_flush_says_what_is_pending_whatever_the_interval() {
        let mut notes = LossNotes::new(10_000);
        notes.dropped(1, 0);
        assert!(notes.due(0, 10).is_some());
        notes.dropped(4, 1);
        assert_eq!(notes.due(2, 10), None);
        assert!(notes.flush(10).unwrap().contains("dropped the 4 oldest"));
        assert_eq!(notes.flush(10), None);
        notes.dropped(0, 5);
        assert_eq!(notes.flush(10), None, "dropping nothing says nothing");
    }

    #[test]
    fn an_outage_is_said_when_it_starts_reminded_per_interval_and_ended() {
        let mut notes = OutageNotes::new(30_000);
        assert_eq!(notes.succeeded(0), None, "no outage, nothing to say");
        let first = notes.failed(1_000, &"database is locked", 5000).unwrap();
        assert!(
            first.starts_with("database is locked; rows stay buffered"),
            "{first}"
        );
        assert!(first.contains("up to 5000 ms"), "{first}");
        assert!(notes.is_down());
        assert_eq!(notes.failed(2_000, &"database is locked", 5000), None);
        let reminder = notes.failed(31_000, &"database is locked", 5000).unwrap();
        assert_eq!(
            reminder,
            "still failing after 30.0 s (3 failed attempts): database is locked"
        );
        let back = notes.succeeded(32_500).unwrap();
        assert_eq!(back, "store back after 31.5 s (3 failed attempts)");
        assert!(!notes.is_down());
        assert!(notes
            .failed(40_000, &"again", 5000)
            .unwrap()
            .starts_with("again;"));
    }

    #[test]
    fn a_throttle_lets_one_line_through_per_interval_and_counts_the_rest() {
        let mut t = Throttle::new(1_000);
        assert_eq!(t.allow(0), Some(0));
        assert_eq!(t.allow(10), None);
        assert_eq!(t.allow(999), None);
        assert_eq!(t.allow(1_000), Some(2));
        assert_eq!(t.allow(5_000), Some(0));
    }
}
