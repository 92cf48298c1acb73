//! The adaptive admission level of one service instance: the histogram of
//! the current window, its queuing-time window, and the level they move.

use super::histogram::{level_index, level_of_index, Histogram, LEVELS};
use super::window::{Window, WindowEnd};
use super::{admits, clamp_priority, AdmissionLevel, Micros, OPEN};

/// The constants of the algorithm (the `[admission]` config section).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdmissionParams {
    /// A window ends after this many microseconds… (seed: 1 s)
    pub window_us: Micros,
    /// …or this many queuing-time samples, whichever comes first (seed: 2000).
    pub window_requests: u32,
    /// Overloaded when a window's average queuing time exceeds this (seed: 20 ms).
    pub queuing_threshold_us: Micros,
    /// On overload the admitted count falls to at most `(1 − alpha)·N_adm`
    /// (seed: 5%).
    pub alpha: f64,
    /// Otherwise it rises to at least `(1 + beta)·N_adm` (seed: 1%).
    pub beta: f64,
    /// The level never goes below this (default `(1, 128)`: every request
    /// of business priority 1 is admitted).
    pub floor: AdmissionLevel,
    /// An overloaded window cuts the level only when its queue did not
    /// drain: when `N_adm > (1 − need)·N_started` (admitted arrivals
    /// against requests that started processing), `need` being `alpha`
    /// (what one cut from balance gives) for a queue up to
    /// [`HOLD_QUEUE_THRESHOLDS`] thresholds long and proportionally more
    /// beyond. When the queue shrank that fast, the last cuts are already
    /// working and the level holds (not in the paper; see [`Admission`]). Only for a service whose queue
    /// holds nothing but admitted requests (not the agent's shard, whose
    /// kernel queue holds every datagram).
    pub hold_while_draining: bool,
    /// Callers hold back below this level before sending (the agent's own
    /// shedding: its answers carry the level, and the client library's
    /// `HoldBack` sheds below it), so a calm window's histogram above the
    /// level is incomplete (censored): it holds only what callers with a
    /// stale level sent. The rise is then placed on the demand's mix as
    /// the last window at the open level saw it (see [`Admission`]), not
    /// on the censored histogram. Off for a service (the paper's rule).
    pub callers_hold_back: bool,
}

impl Default for AdmissionParams {
    fn default() -> Self {
        AdmissionParams {
            window_us: 1_000_000,
            window_requests: 2000,
            queuing_threshold_us: 20_000,
            alpha: 0.05,
            beta: 0.01,
            floor: AdmissionLevel::new(1, 128),
            hold_while_draining: true,
            callers_hold_back: false,
        }
    }
}

/// What happened at the end of a window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowOutcome {
    /// The window's queuing-time summary.
    pub window: WindowEnd,
    /// Requests that arrived in the window (the histogram's total).
    pub arrived: u64,
    /// `N_adm`: those the old level admitted.
    pub admitted: u64,
    /// The window was overloaded but its queue drained fast enough
    /// ([`AdmissionParams::hold_while_draining`]): the level held.
    pub draining: bool,
    /// The window was overloaded, but more than [`NOT_HELD_BACK`] of its
    /// requests were above the level: its callers do not hold back, and
    /// the level held ([`AdmissionParams::callers_hold_back`] only).
    pub not_held_back: bool,
    /// The calm window's rise was placed on the remembered demand
    /// ([`AdmissionParams::callers_hold_back`]).
    pub censored_rise: bool,
    /// The level during the window.
    pub before: AdmissionLevel,
    /// The level from now on.
    pub after: AdmissionLevel,
}

/// DAGOR admission control for one service instance.
///
/// Call [`Admission::admit`] when a request arrives (it counts the request
/// and says whether the current level admits it), [`Admission::started`]
/// when an admitted request starts processing (its queuing time), and
/// [`Admission::tick`] now and then so that a window ends even when
/// nothing starts. The level changes only at a window's end.
///
/// One deviation from the paper, on by default
/// ([`AdmissionParams::hold_while_draining`]): the queuing time of the
/// requests that start in a window is that of requests admitted up to a
/// queue's length earlier, so after a cut the average stays above the
/// threshold until the old queue has drained, and the paper's rule keeps
/// cutting by `alpha` every window of that lag. With windows shorter than
/// the drain time, the level falls far below what fills the service and
/// then climbs back at `beta` a window. So an overloaded window whose
/// queue shrank by at least `alpha` of what started (`N_adm ≤ (1 −
/// alpha)·N_started`, what one cut from balance gives; more for a queue
/// over [`HOLD_QUEUE_THRESHOLDS`] thresholds, see `drained`) keeps the
/// level: the last cuts are already draining the queue.
///
/// With [`AdmissionParams::callers_hold_back`] (the agent's own shedding)
/// the controller also keeps the histogram of the last window that ran at
/// the open level with at least [`MIN_DEMAND`] requests: the demand's mix
/// by priority before any caller held anything back. A calm window below
/// the open level then rises to the lowest level that admits at least
/// `(1 + beta)` times what the current level admits *of that mix* (and at
/// least one request of it more), fully open when none does. The current
/// window's histogram cannot place the rise: above the level it holds
/// only what callers with a stale level sent, a thin and arbitrary
/// sample; reading it as the demand over-steps (the paper's rule then
/// finds `+beta` far too high, or opens fully when the thin part falls
/// short of it), every caller releases the requests it held within a
/// round trip, and the shard floods. Without a remembered mix (no window
/// at the open level yet), and for an empty window (which opens), the
/// paper's rule applies.
#[derive(Clone, Debug)]
pub struct Admission {
    params: AdmissionParams,
    level: AdmissionLevel,
    histogram: Histogram,
    /// With `callers_hold_back`: the last full enough window at the open
    /// level (empty until there is one).
    demand: Option<Histogram>,
    window: Window,
    admitted_total: u64,
    rejected_total: u64,
}

impl Admission {
    /// A controller at the open level `(128, 128)`.
    pub fn new(params: AdmissionParams) -> Self {
        let floor = AdmissionLevel::new(
            clamp_priority(params.floor.business),
            clamp_priority(params.floor.user),
        );
        let params = AdmissionParams { floor, ..params };
        Admission {
            window: Window::new(
                params.window_us,
                params.window_requests,
                params.queuing_threshold_us,
            ),
            demand: params.callers_hold_back.then(Histogram::new),
            params,
            level: OPEN,
            histogram: Histogram::new(),
            admitted_total: 0,
            rejected_total: 0,
        }
    }

    /// The parameters in use (the floor made valid).
    pub fn params(&self) -> &AdmissionParams {
        &self.params
    }

    /// The current level `(B*, U*)`: what a service attaches to its responses.
    pub fn level(&self) -> AdmissionLevel {
        self.level
    }

    /// Requests admitted and rejected since the start.
    pub fn totals(&self) -> (u64, u64) {
        (self.admitted_total, self.rejected_total)
    }

    /// The current window's histogram.
    pub fn histogram(&self) -> &Histogram {
        &self.histogram
    }

    /// A request of priorities `(b, u)` arrived: counts it and answers
    /// whether the current level admits it. Priority 0 (unset) counts as
    /// 128, the least important.
    pub fn admit(&mut self, b: u8, u: u8) -> bool {
        let (b, u) = (clamp_priority(b), clamp_priority(u));
        self.histogram.add(b, u);
        let ok = admits(self.level, b, u);
        if ok {
            self.admitted_total += 1;
        } else {
            self.rejected_total += 1;
        }
        ok
    }

    /// `n` requests were dropped before they could be handled (the queue
    /// was full: the agent's kernel receive queue, `SO_RXQ_OVFL`): the
    /// current window is overloaded (see [`Window::dropped`]). Their
    /// priorities are unknown, so they are not in the histogram.
    pub fn dropped(&mut self, n: u32) {
        self.window.dropped(n);
    }

    /// An admitted request started processing at `now` after waiting
    /// `queuing_us` since its arrival. When this ends the window, the level
    /// moves and the outcome says how.
    #[inline]
    pub fn started(&mut self, now: Micros, queuing_us: Micros) -> Option<WindowOutcome> {
        let end = self.window.record(now, queuing_us)?;
        Some(self.end_window(end))
    }

    /// Ends the window by time when its span is up (call it at least every
    /// few milliseconds while idle, or before each request).
    pub fn tick(&mut self, now: Micros) -> Option<WindowOutcome> {
        let end = self.window.tick(now)?;
        Some(self.end_window(end))
    }

    /// When [`Admission::tick`] next has something to decide: the current
    /// window's end by time, or `None` when ending it could change nothing
    /// (the open level, no request counted and no sample in the window: the
    /// level stays open, and the next request ends the stale window
    /// itself). A window not yet started is due at once (time 0).
    pub fn next_tick(&self) -> Option<Micros> {
        if self.level == OPEN && self.window.samples() == 0 && self.histogram.total() == 0 {
            return None;
        }
        Some(self.window.ends_at().unwrap_or(0))
    }

    // Once per window: kept out of line, so that the per-request callers
    // (`started`, `tick`) stay small enough to inline.
    #[cold]
    #[inline(never)]
    fn end_window(&mut self, window: WindowEnd) -> WindowOutcome {
        let before = self.level;
        let admitted = self.histogram.admitted_under(before);
        let draining = window.overloaded
            && self.params.hold_while_draining
            && drained(
                admitted,
                window.samples,
                self.params.alpha,
                window.avg_queuing_us,
                self.params.queuing_threshold_us,
            );
        // The remembered mix places a calm window's rise below the open
        // level (callers_hold_back).
        // An empty window still opens (nothing to protect).
        let demand = self.demand.as_ref().filter(|d| {
            !window.overloaded && before != OPEN && d.total() > 0 && self.histogram.total() > 0
        });
        let censored_rise = demand.is_some();
        let arrived = self.histogram.total();
        let not_held_back = window.overloaded
            && self.params.callers_hold_back
            && (arrived - admitted) as f64 > NOT_HELD_BACK * arrived as f64;
        let after = if draining || not_held_back {
            before
        } else if let Some(d) = demand {
            rise_on(d, before, &self.params)
        } else {
            next_level(
                &self.histogram,
                before,
                admitted,
                window.overloaded,
                &self.params,
            )
        };
        let outcome = WindowOutcome {
            window,
            arrived,
            admitted,
            draining,
            not_held_back,
            censored_rise,
            before,
            after,
        };
        self.level = after;
        match self.demand.as_mut() {
            // A window at the open level saw the whole demand: keep it (the
            // old one becomes the next window's, cleared below).
            Some(d) if before == OPEN && self.histogram.total() >= MIN_DEMAND => {
                std::mem::swap(d, &mut self.histogram)
            }
            _ => {}
        }
        self.histogram.clear();
        outcome
    }
}

/// Queues up to this many thresholds long need only drain by `alpha` to
/// hold the level; longer ones proportionally more (see [`drained`]).
pub const HOLD_QUEUE_THRESHOLDS: f64 = 5.0;

/// Whether a window's queue shrank fast enough that the last cuts are
/// already draining it: by at least `alpha` of what started (what one cut
/// from balance gives), and by enough to empty within
/// `HOLD_QUEUE_THRESHOLDS · threshold / alpha` (2 s at the paper's 20 ms
/// and 5%), i.e. `admitted ≤ (1 − need)·started` with
/// `need = alpha · max(1, avg / (HOLD_QUEUE_THRESHOLDS · threshold))`.
/// A queue up to 5 thresholds long (100 ms) needs `alpha`; a queue that
/// grew towards the callers' timeouts (at 500 ms, `5·alpha`) is cut as the
/// paper cuts unless it empties fast. A window in which nothing started
/// did not drain.
fn drained(admitted: u64, started: u32, alpha: f64, avg_us: Micros, threshold_us: Micros) -> bool {
    let depth = avg_us as f64 / (HOLD_QUEUE_THRESHOLDS * threshold_us.max(1) as f64);
    let need = alpha * depth.max(1.0);
    started > 0 && admitted as f64 <= (1.0 - need) * f64::from(started)
}

/// The fewest requests a window at the open level must hold to become the
/// remembered demand mix ([`AdmissionParams::callers_hold_back`]): a
/// handful seen after a quiet spell says little about the mix.
pub const MIN_DEMAND: u64 = 100;

/// With [`AdmissionParams::callers_hold_back`], an overloaded window in
/// which more than this share of the requests were above the level keeps
/// the level. Callers that hold back send almost nothing above it (only
/// those whose level went stale: 0.1% in the simulation,
/// `agent::overload_sim`); when most of what arrives is refused, the
/// callers are not holding back, and a refusal costs the agent's shard
/// about what an answer costs (the kernel's receive and send are most of
/// either), so a further cut would not lighten the load; it would only
/// refuse the more important classes as well (the level sank below every
/// class before this rule).
pub const NOT_HELD_BACK: f64 = 0.5;

/// A calm window's level when callers hold back: the lowest level that
/// admits at least `(1 + beta)` times what `level` admits of the
/// remembered demand `d` and at least one request of it more (open when
/// none does), never below the floor.
fn rise_on(d: &Histogram, level: AdmissionLevel, p: &AdmissionParams) -> AdmissionLevel {
    let admitted = d.admitted_under(level);
    let target = ((1.0 + p.beta) * admitted as f64).ceil() as u64;
    let moved = d.lowest_at_least(target.max(admitted + 1)).unwrap_or(OPEN);
    if level_index(moved) < level_index(p.floor) {
        p.floor
    } else {
        moved
    }
}

/// How many levels (user priorities) the level rises after a calm window
/// that saw no request above it: 1/4 of a business class.
pub const CENSORED_STEP: usize = 32;

/// The level after a window: on overload the highest level admitting at
/// most `(1 − α)·N_adm` of the window's requests (never above the old
/// one); otherwise the lowest admitting at least `(1 + β)·N_adm` and at
/// least one request more (open when no level does, or
/// [`CENSORED_STEP`] levels up when the window saw nothing above the
/// level). Never below the floor.
fn next_level(
    h: &Histogram,
    level: AdmissionLevel,
    admitted: u64,
    overloaded: bool,
    p: &AdmissionParams,
) -> AdmissionLevel {
    let moved = if overloaded {
        let target = ((1.0 - p.alpha) * admitted as f64).floor() as u64;
        match h.highest_at_most(target) {
            Some(l) if level_index(l) < level_index(level) => l,
            Some(_) => level,
            None => p.floor,
        }
    } else {
        let target = ((1.0 + p.beta) * admitted as f64).ceil() as u64;
        match h.lowest_at_least(target.max(admitted + 1)) {
            Some(l) => l,
            // Requests above the level arrived, all admissible (or none
            // at all: nothing to protect): open.
            None if h.total() > admitted || admitted == 0 => OPEN,
            // None arrived above the level: the callers shed them before
            // sending (collaborative admission), so the histogram cannot
            // say where +β lies. Step up blindly, a little.
            None => level_of_index((level_index(level) + CENSORED_STEP).min(LEVELS - 1)),
        }
    };
    if level_index(moved) < level_index(p.floor) {
        p.floor
    } else {
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Micros = 1000;

    fn lv(b: u8, u: u8) -> AdmissionLevel {
        AdmissionLevel::new(b, u)
    }

    fn params() -> AdmissionParams {
        AdmissionParams {
            floor: lv(1, 1),
            ..AdmissionParams::default()
        }
    }

    /// 100 requests in each of business classes 1..=10 (user priorities
    /// 1..=100), then a window from `now` to `now + 1 s` with the given
    /// average queuing time.
    fn window(a: &mut Admission, now: Micros, queuing: Micros) -> WindowOutcome {
        assert_eq!(a.tick(now), None, "the window starts at `now`");
        for b in 1..=10u8 {
            for u in 1..=100u8 {
                a.admit(b, u);
            }
        }
        assert_eq!(a.started(now + 1, queuing), None);
        a.tick(now + 1000 * MS).expect("the span is up")
    }

    #[test]
    fn an_open_empty_window_needs_no_timer_and_a_cut_level_does() {
        let mut a = Admission::new(params());
        assert_eq!(a.next_tick(), None, "open, nothing counted");
        assert_eq!(a.tick(5 * MS), None);
        assert_eq!(a.next_tick(), None, "started, still nothing to decide");
        a.admit(1, 1);
        assert_eq!(
            a.next_tick(),
            Some(1005 * MS),
            "a counted request: the window's end"
        );
        a.tick(1005 * MS).expect("the span is up");
        assert_eq!(a.next_tick(), None, "open again, the window empty");
        // After a flood the level is cut: an empty window must still end by
        // time, so that the level climbs back.
        let o = window(&mut a, 2000 * MS, 50 * MS);
        assert_ne!(o.after, OPEN);
        assert_eq!(a.next_tick(), Some(4000 * MS));
        let mut at = 4000 * MS;
        while a.level() != OPEN {
            a.tick(at).expect("due");
            at += 1000 * MS;
            assert!(at < 10_000_000 * MS, "the level climbs back");
        }
        assert_eq!(a.next_tick(), None);
    }

    #[test]
    fn a_window_not_yet_started_is_due_at_once_when_it_holds_something() {
        let mut a = Admission::new(params());
        a.admit(1, 1);
        assert_eq!(a.next_tick(), Some(0));
    }

    #[test]
    fn starts_open_and_admits_everything() {
        let mut a = Admission::new(AdmissionParams::default());
        assert_eq!(a.level(), OPEN);
        assert!(a.admit(128, 128));
        assert!(a.admit(0, 0));
        assert_eq!(a.totals(), (2, 0));
    }

    #[test]
    fn overload_cuts_the_admitted_count_by_five_percent() {
        let mut a = Admission::new(params());
        let o = window(&mut a, 0, 50 * MS);
        assert!(o.window.overloaded);
        assert_eq!((o.arrived, o.admitted), (1000, 1000));
        // At most 950 admitted: classes 1..=9 in full, class 10 up to u = 50.
        assert_eq!(o.after, lv(10, 50));
        let o = window(&mut a, 1000 * MS, 50 * MS);
        assert_eq!(o.admitted, 950);
        // floor(0.95 * 950) = 902: classes 1..=9 and class 10 up to u = 2.
        assert_eq!(o.after, lv(10, 2));
        assert!(!a.admit(10, 3));
        assert!(a.admit(10, 2));
        assert!(a.admit(9, 128));
    }

    #[test]
    fn no_overload_raises_the_admitted_count_by_one_percent() {
        let mut a = Admission::new(params());
        window(&mut a, 0, 50 * MS);
        let o = window(&mut a, 1000 * MS, 50 * MS);
        assert_eq!(o.after, lv(10, 2));
        let o = window(&mut a, 2000 * MS, 5 * MS);
        assert!(!o.window.overloaded);
        assert_eq!(o.admitted, 902);
        // ceil(1.01 * 902) = 912: class 10 up to u = 12.
        assert_eq!(o.after, lv(10, 12));
        // Raising past every request seen opens fully.
        let mut levels = vec![];
        for i in 0..20 {
            levels.push(window(&mut a, (3000 + 1000 * i) * MS, 0).after);
        }
        assert_eq!(*levels.last().unwrap(), OPEN);
        assert!(levels
            .windows(2)
            .all(|w| level_index(w[0]) <= level_index(w[1])));
    }

    #[test]
    fn never_below_the_most_important_class() {
        let mut a = Admission::new(AdmissionParams::default());
        for i in 0..200 {
            window(&mut a, i * 1000 * MS, 500 * MS);
        }
        assert_eq!(a.level(), lv(1, 128));
        for u in 1..=128 {
            assert!(a.admit(1, u), "business class 1 is never shed");
        }
        assert!(!a.admit(2, 1));
        // With a floor of (1, 1), even class 1 is cut by user priority.
        let mut a = Admission::new(params());
        for i in 0..200 {
            window(&mut a, i * 1000 * MS, 500 * MS);
        }
        assert_eq!(a.level(), lv(1, 1));
    }

    #[test]
    fn a_calm_window_that_saw_nothing_above_the_level_steps_up_a_little() {
        // The callers shed below the level themselves (collaborative
        // admission): only admissible requests arrive.
        let mut a = Admission::new(params());
        window(&mut a, 0, 50 * MS);
        assert_eq!(a.level(), lv(10, 50));
        a.tick(1000 * MS);
        for b in 1..=9u8 {
            for u in 1..=100u8 {
                a.admit(b, u);
            }
        }
        for u in 1..=50u8 {
            assert!(a.admit(10, u));
        }
        let o = a.tick(2000 * MS).unwrap();
        assert!(!o.window.overloaded);
        assert_eq!(o.after, lv(10, 50 + CENSORED_STEP as u8));
    }

    /// Callers that hold back: the window at the open level is the demand
    /// (classes 1..=10, 100 each); below it callers send only what the
    /// level admits.
    #[test]
    fn with_callers_holding_back_a_calm_window_rises_beta_of_the_remembered_mix() {
        let mut a = Admission::new(AdmissionParams {
            callers_hold_back: true,
            ..params()
        });
        let o = window(&mut a, 0, 50 * MS);
        assert!(!o.censored_rise, "overloaded: the paper's cut");
        assert_eq!(o.after, lv(10, 50));
        // Calm, nothing above the level arrived: +1% of the remembered
        // mix's 950 admitted = 960 (class 10 up to u = 60), not the
        // censored step of 32.
        let calm = |a: &mut Admission, now: Micros| {
            assert_eq!(a.tick(now), None);
            let level = a.level();
            for b in 1..=10u8 {
                for u in 1..=100u8 {
                    if admits(level, b, u) {
                        a.admit(b, u);
                    }
                }
            }
            // A caller with a stale level sent a few from above.
            a.admit(10, 100);
            a.admit(10, 99);
            a.started(now + 1, 10);
            a.tick(now + 1000 * MS).expect("the span is up")
        };
        let o = calm(&mut a, 1000 * MS);
        assert!(o.censored_rise && !o.window.overloaded);
        assert_eq!(o.after, lv(10, 60));
        let o = calm(&mut a, 2000 * MS);
        // ceil(1.01 * 960) = 970: u = 70.
        assert_eq!(o.after, lv(10, 70));
        // Rising past the mix opens fully (from (10, 95): 995 -> 1005).
        let mut at = 3000 * MS;
        while a.level() != OPEN {
            let o = calm(&mut a, at);
            assert!(level_index(o.after) > level_index(o.before));
            at += 1000 * MS;
            assert!(at < 100_000 * MS, "it opens");
        }
        // An empty window opens at once, as in the paper's rule.
        window(&mut a, at, 50 * MS);
        assert_ne!(a.level(), OPEN);
        a.tick(at + 2000 * MS);
        let o = a.tick(at + 3000 * MS).expect("an empty window");
        assert_eq!((o.arrived, o.censored_rise, o.after), (0, false, OPEN));
        // Without the option the paper's rule opens at once: the two
        // stale requests above are all there is above the level, short
        // of +1%.
        let mut b = Admission::new(params());
        window(&mut b, 0, 50 * MS);
        let o = calm(&mut b, 1000 * MS);
        assert!(!o.censored_rise);
        assert_eq!(o.after, OPEN);
    }

    #[test]
    fn the_remembered_mix_needs_a_full_enough_window_at_the_open_level() {
        let mut a = Admission::new(AdmissionParams {
            callers_hold_back: true,
            ..params()
        });
        // An overloaded window of MIN_DEMAND - 1 requests at the open
        // level (class 5) cuts, and is too few to remember.
        let o = counted_window(&mut a, 0, (5, MIN_DEMAND as u32 - 1), 1, 50 * MS);
        let cut = o.after;
        assert_eq!(cut.business, 5);
        // The calm window after it has no mix to rise on: the paper's rule
        // (nothing above the level arrived: the censored step).
        let o = counted_window(&mut a, 1000 * MS, (4, 50), 1, MS);
        assert!(!o.censored_rise);
        assert_eq!(
            level_index(o.after),
            level_index(cut) + CENSORED_STEP,
            "{cut:?} -> {:?}",
            o.after
        );
        // An open window of MIN_DEMAND is remembered: after the next cut,
        // the calm rise is placed on it.
        while a.level() != OPEN {
            let at = a.next_tick().unwrap();
            a.tick(at);
        }
        let at = 100_000 * MS;
        a.tick(at);
        let o = counted_window(&mut a, at, (5, MIN_DEMAND as u32), 1, 50 * MS);
        assert_eq!(o.after.business, 5);
        let o = counted_window(&mut a, at + 1000 * MS, (4, 50), 1, MS);
        assert!(o.censored_rise);
    }

    #[test]
    fn with_callers_holding_back_an_overloaded_window_mostly_above_the_level_holds() {
        let mut a = Admission::new(AdmissionParams {
            callers_hold_back: true,
            window_requests: 10_000,
            ..params()
        });
        let cut = counted_window(&mut a, 0, (5, 1000), 1, 50 * MS).after;
        assert_eq!(cut.business, 5);
        let above = |a: &mut Admission, now: Micros, n_above: u32, n_below: u32| {
            assert_eq!(a.tick(now), None);
            for i in 0..n_above {
                a.admit(6, (i % 128) as u8 + 1);
            }
            for i in 0..n_below {
                a.admit(4, (i % 128) as u8 + 1);
            }
            a.started(now + 1, 50 * MS);
            a.tick(now + 1000 * MS).expect("the span is up")
        };
        // Half above the level: not more than half, cut.
        let o = above(&mut a, 1000 * MS, 500, 500);
        assert!(!o.not_held_back && level_index(o.after) < level_index(cut));
        // 501 of 1000 above: the callers do not hold back, hold.
        let level = o.after;
        let o = above(&mut a, 2000 * MS, 501, 499);
        assert!(o.not_held_back && o.window.overloaded);
        assert_eq!(o.after, level);
        // Without the option the paper's rule cuts.
        let mut b = Admission::new(AdmissionParams {
            window_requests: 10_000,
            ..params()
        });
        counted_window(&mut b, 0, (5, 1000), 1, 50 * MS);
        let o = above(&mut b, 1000 * MS, 900, 100);
        assert!(!o.not_held_back && level_index(o.after) < level_index(cut));
    }

    #[test]
    fn dropped_requests_make_a_calm_window_overloaded() {
        let mut a = Admission::new(params());
        assert_eq!(a.tick(0), None);
        for u in 1..=100u8 {
            a.admit(5, u);
        }
        a.started(1, MS);
        a.dropped(1);
        let o = a.tick(1000 * MS).unwrap();
        assert!(o.window.overloaded && o.window.dropped == 1);
        assert_eq!(o.after, lv(5, 95));
    }

    #[test]
    fn an_empty_overloaded_window_keeps_the_level() {
        let mut a = Admission::new(params());
        window(&mut a, 0, 50 * MS);
        let level = a.level();
        assert_eq!(a.started(1000 * MS + 1, 90 * MS), None);
        let o = a.tick(2000 * MS).unwrap();
        assert!(o.window.overloaded);
        assert_eq!(o.after, level);
    }

    /// A window in which `arrived` requests of business class `b` (user
    /// priorities spread) arrive, then `started` queuing-time samples of
    /// `queuing`, ended by time.
    fn counted_window(
        a: &mut Admission,
        now: Micros,
        (b, arrived): (u8, u32),
        started: u32,
        queuing: Micros,
    ) -> WindowOutcome {
        assert_eq!(a.tick(now), None);
        for i in 0..arrived {
            a.admit(b, (i % 128) as u8 + 1);
        }
        for i in 0..started {
            assert_eq!(a.started(now + 1 + Micros::from(i), queuing), None);
        }
        a.tick(now + 1000 * MS).expect("the span is up")
    }

    #[test]
    fn drained_at_its_boundary() {
        let d =
            |admitted, started, avg_ms: u64| drained(admitted, started, 0.05, avg_ms * MS, 20 * MS);
        assert!(d(95, 100, 21), "(1 - alpha) of what started");
        assert!(!d(96, 100, 21));
        assert!(d(95, 100, 100), "up to five thresholds: alpha");
        assert!(!d(96, 100, 100));
        assert!(d(1900, 2000, 60));
        assert!(!d(1901, 2000, 60));
        assert!(d(90, 100, 200), "ten thresholds: twice alpha");
        assert!(!d(91, 100, 200));
        assert!(d(75, 100, 500), "at 500 ms: five times alpha");
        assert!(!d(76, 100, 500));
        assert!(!d(0, 100, 2001), "past 2 s nothing is enough");
        assert!(d(0, 1, 21));
        assert!(!d(0, 0, 21), "nothing started: not drained");
        assert!(!d(100, 100, 21), "as many in as out");
        assert!(!d(101, 100, 21), "the queue grew");
    }

    #[test]
    fn an_overloaded_window_whose_queue_drained_keeps_the_level() {
        let mut a = Admission::new(AdmissionParams {
            window_requests: 10_000,
            ..params()
        });
        // Overloaded, more admitted than started: the queue grew, cut
        // (into class 5; class 2 stays admitted in full below).
        let o = counted_window(&mut a, 0, (5, 1000), 900, 50 * MS);
        assert!(o.window.overloaded && !o.draining);
        let cut = o.after;
        assert_eq!(cut.business, 5);
        // Still over the threshold (80 ms, four times it), but 950
        // admitted against 1000 started: drained by alpha, the level holds.
        let o = counted_window(&mut a, 1000 * MS, (2, 950), 1000, 80 * MS);
        assert!(o.window.overloaded && o.draining);
        assert_eq!(o.admitted, 950);
        assert_eq!(o.after, cut);
        // 951 admitted against 1000 started: not drained enough, cut.
        let o = counted_window(&mut a, 2000 * MS, (2, 951), 1000, 40 * MS);
        assert!(o.window.overloaded && !o.draining);
        assert!(level_index(o.after) < level_index(cut));
        // A calm window rises as ever, whatever drained.
        let before = o.after;
        let o = counted_window(&mut a, 3000 * MS, (2, 500), 1000, MS);
        assert!(!o.window.overloaded && !o.draining);
        assert!(level_index(o.after) > level_index(before));
    }

    #[test]
    fn without_holding_every_overloaded_window_cuts_as_in_the_paper() {
        let mut a = Admission::new(AdmissionParams {
            window_requests: 10_000,
            hold_while_draining: false,
            ..params()
        });
        let first = counted_window(&mut a, 0, (5, 1000), 900, 50 * MS).after;
        let o = counted_window(&mut a, 1000 * MS, (2, 500), 1000, 40 * MS);
        assert!(o.window.overloaded && !o.draining);
        assert!(level_index(o.after) < level_index(first));
    }

    #[test]
    fn the_window_ends_by_count() {
        let mut a = Admission::new(AdmissionParams {
            window_requests: 10,
            ..params()
        });
        for _ in 0..10 {
            a.admit(5, 5);
        }
        for i in 0..9 {
            assert_eq!(a.started(i, 30 * MS), None);
        }
        let o = a.started(9, 30 * MS).expect("the tenth sample ends it");
        assert!(o.window.by_count && o.window.overloaded);
        assert_eq!(o.after, level_of_index(level_index(lv(5, 5)) - 1));
    }

    proptest! {
        #[test]
        fn an_overloaded_window_holds_exactly_when_drained(
            admitted in 1u32..300,
            started in 0u32..300,
            hold in any::<bool>(),
            queuing_ms in 21u64..3000,
        ) {
            let mut a = Admission::new(AdmissionParams {
                window_requests: 10_000,
                hold_while_draining: hold,
                ..params()
            });
            let o = counted_window(&mut a, 0, (5, admitted), started.max(1), queuing_ms * MS);
            // A drain of alpha (5%) of what started up to 100 ms, more beyond.
            let need = 0.05 * (queuing_ms as f64 / 100.0).max(1.0);
            let drained = f64::from(admitted) <= (1.0 - need) * f64::from(started.max(1));
            prop_assert_eq!(o.draining, hold && drained);
            if o.draining {
                prop_assert_eq!(o.after, o.before);
            } else {
                // Cut to at most 95% of the admitted count (or the floor).
                let m = level_index(o.after);
                prop_assert!(m < level_index(o.before) || o.after == lv(1, 1));
            }
        }

        #[test]
        fn a_level_step_is_minus_alpha_or_plus_beta_in_admitted_count(
            reqs in prop::collection::vec((1u8..=128, 1u8..=128), 1..400),
            start in 0usize..LEVELS,
            overloaded in any::<bool>(),
            floor_b in 1u8..=3,
        ) {
            let p = AdmissionParams { floor: lv(floor_b, 128), ..AdmissionParams::default() };
            let mut h = Histogram::new();
            for &(b, u) in &reqs {
                h.add(b, u);
            }
            let level = level_of_index(start.max(level_index(p.floor)));
            let n = h.admitted_under(level);
            let next = next_level(&h, level, n, overloaded, &p);
            let m = h.admitted_under(next);
            prop_assert!(level_index(next) >= level_index(p.floor));
            if overloaded {
                prop_assert!(level_index(next) <= level_index(level));
                prop_assert!(m as f64 <= 0.95 * n as f64 || next == p.floor || (n == 0 && next == level),
                    "n {} m {} level {:?} next {:?}", n, m, level, next);
            } else {
                prop_assert!(level_index(next) > level_index(level) || level == OPEN);
                let censored = h.total() == n && n > 0 && level != OPEN;
                if censored {
                    prop_assert_eq!(level_index(next), (level_index(level) + CENSORED_STEP).min(LEVELS - 1));
                } else {
                    prop_assert!(m as f64 >= 1.01 * n as f64 || next == OPEN, "n {} m {}", n, m);
                }
            }
        }
    }
}
