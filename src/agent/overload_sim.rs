//! A seeded, pure simulation of one agent shard protecting itself
//! (`admission.agent_shedding`, README "The agent's own overload"), beside
//! the shard's code so that it runs the shard's own admission parameters
//! ([`super::shard::agent_params`]) and the client library's own
//! [`HoldBack`].
//!
//! The model: open-loop Poisson arrivals of getHosts at `offered` per
//! second from `callers` callers, each getHost's business priority drawn
//! from `mix` and its user priority uniform in 1..=128. A caller first asks
//! its [`HoldBack`] (fed by its own answers, `holdback_ms` fresh; 0: it
//! never holds back). A sent getHost enters the kernel's receive queue,
//! which holds at most `queue` datagrams and drops the rest (counting them,
//! as `SO_RXQ_OVFL` does; a datagram carries the count as it stood when it
//! was queued). The shard takes the queue in order, one datagram at a time:
//! the queuing time (arrival to the start of handling) feeds the window,
//! the datagram's drop count (with `count_drops`) the window's drops, and
//! the level decides: an answer takes `1 / capacity`, a `Rejected`
//! `reject_cost` of that (the kernel's receive and send are paid for both).
//! Every answer carries the level while it is below open and reaches its
//! caller `rtt_us` later. The shard ends windows by time every 5 ms, as its
//! timer task does. Time is an integer of nanoseconds; no clock, no socket,
//! no thread: the same seed gives the same run.

use std::collections::VecDeque;

use hdrhistogram::Histogram;

use super::shard::agent_params;
use lbagent_admission::holdback::HoldBack;
use lbagent_admission::{
    level_index, level_of_index, Admission, AdmissionLevel, AdmissionParams, Micros, OPEN,
};

/// The shard's timer task ends windows by time at least this often, ns.
const TICK_NS: u64 = 5_000_000;

/// One simulated run.
#[derive(Clone, Debug)]
pub struct OverloadSim {
    /// Datagrams per second the shard answers (its saturation S).
    pub capacity: f64,
    /// What a `Rejected` costs the shard, as a share of an answer.
    pub reject_cost: f64,
    /// The kernel receive queue, datagrams.
    pub queue: usize,
    /// getHosts offered per second, all callers together.
    pub offered: f64,
    /// (business priority, share of the getHosts).
    pub mix: Vec<(u8, f64)>,
    /// Callers, each with its own [`HoldBack`].
    pub callers: usize,
    /// The callers' hold-back freshness, ms (0: they never hold back).
    pub holdback_ms: u64,
    /// An answer's way back to its caller, µs.
    pub rtt_us: u64,
    /// The `[admission]` constants (made the shard's by
    /// [`super::shard::agent_params`]).
    pub admission: AdmissionParams,
    /// The rule of this version: kernel drops make a window overloaded, and
    /// a calm window rises on the remembered mix. `false`: the rule before
    /// (drops unseen, the paper's rise with the censored step).
    pub new_rule: bool,
    /// Warm-up, then the measured part, µs.
    pub warmup_us: Micros,
    /// See `warmup_us`.
    pub measure_us: Micros,
    /// Seed of the arrivals and priorities.
    pub seed: u64,
}

/// One business class's measured part.
#[derive(Clone, Debug)]
pub struct ClassResult {
    /// The class's business priority.
    pub business: u8,
    /// getHosts the callers wanted to send (held back included).
    pub offered: u64,
    /// Answered with a host.
    pub answered: u64,
    /// Answered `Rejected` by the shard.
    pub rejected: u64,
    /// Held back by their caller (never sent).
    pub held: u64,
    /// Dropped by the kernel (the queue was full).
    pub dropped: u64,
    /// The queuing time of the class's handled getHosts, µs.
    pub queuing_us: Histogram<u64>,
}

impl ClassResult {
    /// Share of `n` in what was offered.
    pub fn share(&self, n: u64) -> f64 {
        n as f64 / self.offered.max(1) as f64
    }
}

/// What a run gave.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// Per class of the mix, in its order.
    pub classes: Vec<ClassResult>,
    /// Per 100 ms of the whole run: the lowest and highest level the
    /// shard held in it.
    pub levels: Vec<(AdmissionLevel, AdmissionLevel)>,
    /// Datagrams the shard handled per second in the measured part.
    pub handled_rate: f64,
}

struct Queued {
    at: u64,
    class: usize,
    b: u8,
    u: u8,
    caller: usize,
    drops: u32,
}

struct Answer {
    at: u64,
    caller: usize,
    level: Option<AdmissionLevel>,
}

impl OverloadSim {
    /// The run's figures.
    pub fn run(&self) -> SimResult {
        let mut params = agent_params(self.admission);
        params.callers_hold_back = self.new_rule;
        let mut a = Admission::new(params);
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let mut callers: Vec<HoldBack> = (0..self.callers.max(1))
            .map(|_| HoldBack::new(self.holdback_ms))
            .collect();
        let total_share: f64 = self.mix.iter().map(|m| m.1).sum();
        let mut classes: Vec<ClassResult> = self
            .mix
            .iter()
            .map(|&(business, _)| ClassResult {
                business,
                offered: 0,
                answered: 0,
                rejected: 0,
                held: 0,
                dropped: 0,
                queuing_us: Histogram::new_with_bounds(1, 60_000_000, 2).expect("bounds"),
            })
            .collect();
        let start_ns = self.warmup_us * 1000;
        let end_ns = (self.warmup_us + self.measure_us) * 1000;
        let answer_ns = 1e9 / self.capacity;
        let mut queue: VecDeque<Queued> = VecDeque::with_capacity(self.queue);
        let mut answers: VecDeque<Answer> = VecDeque::new();
        let (mut drops, mut drops_seen) = (0u32, 0u32);
        let mut busy_until = 0u64;
        let mut next_tick = TICK_NS;
        let mut handled = 0u64;
        // Per 100 ms: the lowest and highest level index held, and the
        // level now.
        let mut levels: Vec<(usize, usize)> = vec![];
        let mut current = level_index(OPEN);
        let mut note = |levels: &mut Vec<(usize, usize)>, t: u64, l: AdmissionLevel| {
            let slot = (t / 100_000_000) as usize;
            while levels.len() <= slot {
                levels.push((current, current));
            }
            current = level_index(l);
            let s = &mut levels[slot];
            *s = (s.0.min(current), s.1.max(current));
        };
        let mut t = 0u64;
        while t < end_ns {
            // The next arrival.
            let gap = -rng.f64().max(1e-12).ln() / self.offered * 1e9;
            t += gap.max(1.0) as u64;
            // Everything due before it, in time order: the shard's
            // handling, its timer, answers reaching their callers.
            loop {
                let service = queue.front().map(|h| h.at.max(busy_until));
                let answer = answers.front().map(|x| x.at);
                let next = [service, answer, Some(next_tick)]
                    .into_iter()
                    .flatten()
                    .min()
                    .expect("the tick is always there");
                if next > t {
                    break;
                }
                if answer == Some(next) {
                    let x = answers.pop_front().expect("front");
                    callers[x.caller].observe(0, x.level, x.at / 1_000_000);
                } else if service == Some(next) {
                    let q = queue.pop_front().expect("front");
                    let now_us = next / 1000;
                    if self.new_rule && q.drops != drops_seen {
                        a.dropped(q.drops.wrapping_sub(drops_seen));
                        drops_seen = q.drops;
                    }
                    let waited = (next - q.at) / 1000;
                    if let Some(o) = a.started(now_us, waited) {
                        note(&mut levels, next, o.after);
                    }
                    let ok = a.admit(q.b, q.u);
                    let cost = if ok {
                        answer_ns
                    } else {
                        answer_ns * self.reject_cost
                    };
                    busy_until = next + cost.max(1.0) as u64;
                    let level = Some(a.level()).filter(|&l| l != OPEN);
                    answers.push_back(Answer {
                        at: busy_until + self.rtt_us * 1000,
                        caller: q.caller,
                        level,
                    });
                    if (start_ns..end_ns).contains(&q.at) {
                        handled += 1;
                        let c = &mut classes[q.class];
                        if ok {
                            c.answered += 1;
                        } else {
                            c.rejected += 1;
                        }
                        c.queuing_us.saturating_record(waited.max(1));
                    }
                } else {
                    if let Some(o) = a.tick(next / 1000) {
                        note(&mut levels, next, o.after);
                    }
                    next_tick = next + TICK_NS;
                }
            }
            if t >= end_ns {
                break;
            }
            let measured = t >= start_ns;
            let mut x = rng.f64() * total_share;
            let mut class = self.mix.len() - 1;
            for (i, m) in self.mix.iter().enumerate() {
                if x < m.1 {
                    class = i;
                    break;
                }
                x -= m.1;
            }
            let (b, u) = (self.mix[class].0, rng.u8(1..=128));
            let caller = rng.usize(..callers.len());
            let c = &mut classes[class];
            if measured {
                c.offered += 1;
            }
            if callers[caller].hold(0, b, u, t / 1_000_000) {
                if measured {
                    c.held += 1;
                }
                continue;
            }
            if queue.len() >= self.queue {
                drops = drops.wrapping_add(1);
                if measured {
                    c.dropped += 1;
                }
                continue;
            }
            queue.push_back(Queued {
                at: t,
                class,
                b,
                u,
                caller,
                drops,
            });
        }
        note(&mut levels, end_ns - 1, a.level());
        SimResult {
            classes,
            levels: levels
                .into_iter()
                .map(|(lo, hi)| (level_of_index(lo), level_of_index(hi)))
                .collect(),
            handled_rate: handled as f64 / (self.measure_us as f64 / 1e6),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: f64 = 400_000.0;

    /// The bench's shape at 2·S: 20% priority 5, 80% priority 60, windows
    /// of 100 ms / 2000 datagrams, threshold 500 µs; the queue the system
    /// default buffer holds (255 datagrams) or one sized to the threshold
    /// (threshold × S).
    fn sim(queue: usize, holdback_ms: u64, new_rule: bool, seed: u64) -> OverloadSim {
        OverloadSim {
            capacity: S,
            reject_cost: 0.9,
            queue,
            offered: 2.0 * S,
            mix: vec![(5, 0.2), (60, 0.8)],
            callers: 8,
            holdback_ms,
            rtt_us: 100,
            admission: AdmissionParams {
                window_us: 100_000,
                window_requests: 2000,
                queuing_threshold_us: 500,
                ..AdmissionParams::default()
            },
            new_rule,
            warmup_us: 500_000,
            measure_us: 1_000_000,
            seed,
        }
    }

    const DEFAULT_QUEUE: usize = 255;
    const SIZED_QUEUE: usize = (500e-6 * S) as usize;

    fn show(name: &str, r: &SimResult) {
        for c in &r.classes {
            println!(
                "{name}: class {} answered {:.3} rejected {:.3} held {:.3} dropped {:.3}, queuing p50 / p99 {} / {} us",
                c.business,
                c.share(c.answered),
                c.share(c.rejected),
                c.share(c.held),
                c.share(c.dropped),
                c.queuing_us.value_at_quantile(0.5),
                c.queuing_us.value_at_quantile(0.99),
            );
        }
        let trace: Vec<String> = r
            .levels
            .iter()
            .map(|(lo, hi)| format!("{},{}..{},{}", lo.business, lo.user, hi.business, hi.user))
            .collect();
        println!(
            "{name}: handled {:.0}/s, level per 100 ms (lowest..highest): {}",
            r.handled_rate,
            trace.join(" ")
        );
    }

    #[test]
    fn with_callers_holding_back_the_important_class_is_answered_and_the_level_holds() {
        for (queue, name) in [
            (DEFAULT_QUEUE, "default buffer"),
            (SIZED_QUEUE, "sized buffer"),
        ] {
            let r = sim(queue, 100, true, 7).run();
            show(&format!("new rule, hold back, {name}"), &r);
            let (top, low) = (&r.classes[0], &r.classes[1]);
            assert!(
                top.share(top.answered) >= 0.98,
                "{name}: class 5 answered {}",
                top.share(top.answered)
            );
            // Its queuing p99 within twice the threshold (the default
            // buffer holds 255 datagrams: 0.64 ms at S).
            assert!(
                top.queuing_us.value_at_quantile(0.99) <= 1000,
                "{name}: p99 near the threshold"
            );
            // The rest of the capacity goes to class 60: (S - 0.4 S) of its
            // 1.6 S is 0.375.
            assert!(
                low.share(low.answered) >= 0.33,
                "{name}: class 60 answered {}",
                low.share(low.answered)
            );
            // After the first 500 ms the level stays inside class 60: it
            // neither opens nor sinks to class 5.
            for (i, (lo, hi)) in r.levels.iter().enumerate().skip(5) {
                assert!(
                    lo.business == 60 && hi.business == 60,
                    "{name}: 100 ms slot {i}: {lo:?}..{hi:?}"
                );
            }
        }
    }

    #[test]
    fn the_rule_before_floods_when_callers_hold_back() {
        for (queue, name) in [
            (DEFAULT_QUEUE, "default buffer"),
            (SIZED_QUEUE, "sized buffer"),
        ] {
            let r = sim(queue, 100, false, 7).run();
            show(&format!("old rule, hold back, {name}"), &r);
            let top = &r.classes[0];
            assert!(
                top.share(top.answered) < 0.9,
                "{name}: class 5 answered {}",
                top.share(top.answered)
            );
        }
    }

    #[test]
    fn without_callers_holding_back_the_level_stops_above_the_important_class() {
        for (queue, name) in [
            (DEFAULT_QUEUE, "default buffer"),
            (SIZED_QUEUE, "sized buffer"),
        ] {
            let old = sim(queue, 0, false, 7).run();
            show(&format!("old rule, no hold back, {name}"), &old);
            let r = sim(queue, 0, true, 7).run();
            show(&format!("new rule, no hold back, {name}"), &r);
            // Refusing costs the shard about what answering does, so the
            // kernel drops about half of everything whatever the level;
            // the level no longer sinks through class 5 for nothing.
            let top = &r.classes[0];
            assert!(
                top.share(top.answered) >= 0.45,
                "{name}: class 5 answered {}",
                top.share(top.answered)
            );
            assert_eq!(top.rejected, 0, "{name}");
            for (i, (lo, _)) in r.levels.iter().enumerate() {
                assert!(lo.business == 60, "{name}: 100 ms slot {i}: {lo:?}");
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let mut s = sim(SIZED_QUEUE, 100, true, 3);
        s.measure_us = 200_000;
        let (a, b) = (s.run(), s.run());
        assert_eq!(a.levels, b.levels);
        assert_eq!(a.classes[1].answered, b.classes[1].answered);
    }
}
