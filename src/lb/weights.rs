//! Weights in the `l5` policy: nginx's smooth weighted round robin over
//! the idle list, and Envoy's slow-start share of a node that has just
//! entered it. Pure: the caller keeps the state and passes the time.

/// One unit of route weight as the round robin counts it: fine enough that
/// slow start's fractions of a weight of 1 still differ.
pub const WEIGHT_SCALE: i64 = 1_000;

/// A route weight as the round robin counts it: 0 (unset) counts as 1.
pub fn scaled_weight(weight: u32) -> i64 {
    i64::from(weight.max(1)) * WEIGHT_SCALE
}

/// The share of its weight a node gets `elapsed_ms` after it entered the
/// idle list, with a slow-start window of `window_ms` (Envoy's curve):
/// `max(min, t^(1/aggression))` with `t = elapsed / window`, 1 once the
/// window has passed or when it is 0 (slow start off). `min` is
/// `min_percent / 100`; `aggression` at or below 0 counts as 1 (linear).
pub fn slow_start_share(elapsed_ms: u64, window_ms: u64, aggression: f64, min_percent: u8) -> f64 {
    if window_ms == 0 || elapsed_ms >= window_ms {
        return 1.0;
    }
    let t = elapsed_ms as f64 / window_ms as f64;
    let aggression = if aggression > 0.0 { aggression } else { 1.0 };
    let min = f64::from(min_percent.min(100)) / 100.0;
    t.powf(1.0 / aggression).max(min).min(1.0)
}

/// `scaled` (a [`scaled_weight`]) times a slow-start `share`, at least 1
/// so that a ramping node is never left out entirely.
pub fn ramped(scaled: i64, share: f64) -> i64 {
    ((scaled as f64 * share) as i64).max(1)
}

/// One step of smooth weighted round robin (nginx's): every candidate's
/// current weight grows by its weight, the largest is chosen (the first
/// in `candidates`' order on a tie) and loses the sum of the weights.
/// `current` is indexed by the candidates' indices. Over a period in
/// which the candidates and weights stay, each is chosen in proportion to
/// its weight, spread out rather than in runs; at equal weights it is
/// plain round robin in the candidates' order. None when there is no
/// candidate.
pub fn swrr_pick(current: &mut [i64], candidates: impl Iterator<Item = (u32, i64)>) -> Option<u32> {
    let mut total = 0i64;
    let mut best: Option<(u32, i64)> = None;
    for (i, w) in candidates {
        let c = &mut current[i as usize];
        *c = c.saturating_add(w);
        total = total.saturating_add(w);
        if best.is_none_or(|(_, b)| *c > b) {
            best = Some((i, *c));
        }
    }
    let (i, _) = best?;
    current[i as usize] = current[i as usize].saturating_sub(total);
    Some(i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn swrr_spreads_five_one_one_as_nginx_does() {
        // nginx's own example: weights 5, 1, 1 give a a b a c a a.
        let mut cur = vec![0; 3];
        let w = [5, 1, 1];
        let picks: Vec<u32> = (0..7)
            .map(|_| swrr_pick(&mut cur, (0..3u32).map(|i| (i, w[i as usize]))).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
        assert_eq!(cur, vec![0, 0, 0], "a full period ends where it started");
    }

    #[test]
    fn slow_start_follows_envoys_curve() {
        // Linear (aggression 1): half the window, half the weight.
        assert!((slow_start_share(5_000, 10_000, 1.0, 10) - 0.5).abs() < 1e-12);
        // The floor holds early on.
        assert_eq!(slow_start_share(0, 10_000, 1.0, 10), 0.1);
        assert_eq!(slow_start_share(500, 10_000, 1.0, 10), 0.1);
        // Aggression 2: the square root, faster early.
        assert!((slow_start_share(2_500, 10_000, 2.0, 10) - 0.5).abs() < 1e-12);
        // Full weight at and after the window, and with the window off.
        assert_eq!(slow_start_share(10_000, 10_000, 1.0, 10), 1.0);
        assert_eq!(slow_start_share(99, 0, 1.0, 10), 1.0);
        assert_eq!(ramped(scaled_weight(0), 0.0), 1);
    }

    proptest! {
        /// At equal weights, smooth WRR is round robin in the candidates'
        /// order: each of n picks comes round every n.
        #[test]
        fn equal_weights_are_round_robin(n in 1usize..20, w in 1u32..100, rounds in 1usize..5) {
            let mut cur = vec![0; n];
            for _ in 0..rounds {
                for want in 0..n as u32 {
                    let got = swrr_pick(&mut cur, (0..n as u32).map(|i| (i, scaled_weight(w))));
                    prop_assert_eq!(got, Some(want));
                }
            }
        }

        /// Over one period (the sum of the weights), each node is chosen
        /// exactly its weight's number of times, and never twice as often
        /// as its share in any prefix (the smoothness bound: within one
        /// of its exact share).
        #[test]
        fn shares_are_exact_over_a_period(ws in proptest::collection::vec(1u32..12, 1..8)) {
            let mut cur = vec![0; ws.len()];
            let total: u32 = ws.iter().sum();
            let mut got = vec![0u32; ws.len()];
            for step in 1..=total {
                let i = swrr_pick(&mut cur, ws.iter().enumerate().map(|(i, &w)| (i as u32, scaled_weight(w)))).unwrap();
                got[i as usize] += 1;
                for (k, &w) in ws.iter().enumerate() {
                    let exact = f64::from(step) * f64::from(w) / f64::from(total);
                    prop_assert!((f64::from(got[k]) - exact).abs() < 1.0 + 1e-9,
                        "node {} picked {} times after {} steps, share {}", k, got[k], step, exact);
                }
            }
            prop_assert_eq!(got, ws);
        }

        /// The share only grows with time, stays within [min, 1], and is
        /// full at the end of the window.
        #[test]
        fn slow_start_share_is_monotone(window in 1u64..100_000, a in 0.1f64..5.0, min in 1u8..=100, t1 in 0u64..200_000, dt in 0u64..100_000) {
            let s1 = slow_start_share(t1, window, a, min);
            let s2 = slow_start_share(t1 + dt, window, a, min);
            prop_assert!(s1 <= s2);
            prop_assert!(s1 >= f64::from(min) / 100.0 - 1e-12 && s2 <= 1.0);
            prop_assert_eq!(slow_start_share(window, window, a, min), 1.0);
        }
    }
}
