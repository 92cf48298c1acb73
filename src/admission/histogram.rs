//! `C[B][U]`: the requests that arrived in the current window, counted per
//! compound priority, and the prefix sums the level search needs.
//!
//! Cells are kept in admission order, `(1,1), (1,2) … (1,128), (2,1) …
//! (128,128)`: a level `(B*, U*)` admits exactly the cells at or before its
//! own index, so the admitted count under a level is one prefix sum.

use super::{AdmissionLevel, LEAST_IMPORTANT};

/// Number of compound levels: 128 × 128.
pub const LEVELS: usize = 128 * 128;

/// The index of a level (or a request's priorities) in admission order:
/// `(B − 1)·128 + (U − 1)`. Both parts must be in `1..=128`.
pub fn level_index(level: AdmissionLevel) -> usize {
    debug_assert!((1..=LEAST_IMPORTANT).contains(&level.business));
    debug_assert!((1..=LEAST_IMPORTANT).contains(&level.user));
    usize::from(level.business - 1) * 128 + usize::from(level.user - 1)
}

/// The level at an index in admission order (the inverse of [`level_index`]).
pub fn level_of_index(i: usize) -> AdmissionLevel {
    let i = i.min(LEVELS - 1);
    AdmissionLevel::new((i / 128) as u8 + 1, (i % 128) as u8 + 1)
}

/// Request counts per compound priority over one window.
#[derive(Clone)]
pub struct Histogram {
    cells: Box<[u32; LEVELS]>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Histogram {
            cells: Box::new([0; LEVELS]),
            total: 0,
        }
    }

    /// Counts one request of priorities `(b, u)`, each in `1..=128`.
    pub fn add(&mut self, b: u8, u: u8) {
        let cell = &mut self.cells[level_index(AdmissionLevel::new(b, u))];
        *cell = cell.saturating_add(1);
        self.total += 1;
    }

    /// The count of one cell.
    pub fn get(&self, b: u8, u: u8) -> u32 {
        self.cells[level_index(AdmissionLevel::new(b, u))]
    }

    /// Every request counted since the last [`Histogram::clear`].
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The requests `level` admits: the prefix sum up to its index.
    pub fn admitted_under(&self, level: AdmissionLevel) -> u64 {
        self.cells[..=level_index(level)]
            .iter()
            .map(|&c| u64::from(c))
            .sum()
    }

    /// The highest level whose admitted count is at most `target`, if even
    /// the first cell does not exceed it; `None` when `C[1][1] > target`.
    pub fn highest_at_most(&self, target: u64) -> Option<AdmissionLevel> {
        let mut sum = 0u64;
        let mut best = None;
        for (i, &c) in self.cells.iter().enumerate() {
            sum += u64::from(c);
            if sum > target {
                break;
            }
            best = Some(i);
        }
        best.map(level_of_index)
    }

    /// The lowest level whose admitted count is at least `target`; `None`
    /// when even the open level admits fewer.
    pub fn lowest_at_least(&self, target: u64) -> Option<AdmissionLevel> {
        let mut sum = 0u64;
        for (i, &c) in self.cells.iter().enumerate() {
            sum += u64::from(c);
            if sum >= target {
                return Some(level_of_index(i));
            }
        }
        None
    }

    /// Forgets every count (a new window).
    pub fn clear(&mut self) {
        self.cells.fill(0);
        self.total = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lv(b: u8, u: u8) -> AdmissionLevel {
        AdmissionLevel::new(b, u)
    }

    #[test]
    fn index_order_is_admission_order() {
        assert_eq!(level_index(lv(1, 1)), 0);
        assert_eq!(level_index(lv(1, 128)), 127);
        assert_eq!(level_index(lv(2, 1)), 128);
        assert_eq!(level_index(lv(128, 128)), LEVELS - 1);
        for i in [0, 1, 127, 128, 5000, LEVELS - 1] {
            assert_eq!(level_index(level_of_index(i)), i);
        }
    }

    #[test]
    fn prefix_sums_follow_the_admission_rule() {
        let mut h = Histogram::new();
        h.add(1, 5);
        h.add(2, 1);
        h.add(2, 7);
        h.add(2, 7);
        h.add(3, 128);
        assert_eq!(h.total(), 5);
        assert_eq!(h.get(2, 7), 2);
        assert_eq!(h.admitted_under(lv(1, 4)), 0);
        assert_eq!(h.admitted_under(lv(1, 5)), 1);
        assert_eq!(h.admitted_under(lv(2, 6)), 2);
        assert_eq!(h.admitted_under(lv(2, 7)), 4);
        assert_eq!(h.admitted_under(lv(3, 127)), 4);
        assert_eq!(h.admitted_under(lv(128, 128)), 5);
        // The highest level admitting at most 2 stops just before (2, 7).
        assert_eq!(h.highest_at_most(2), Some(lv(2, 6)));
        assert_eq!(h.highest_at_most(0), Some(lv(1, 4)));
        assert_eq!(h.lowest_at_least(3), Some(lv(2, 7)));
        assert_eq!(h.lowest_at_least(6), None);
        h.clear();
        assert_eq!(h.total(), 0);
        assert_eq!(h.admitted_under(lv(128, 128)), 0);
    }

    #[test]
    fn a_first_cell_above_the_target_has_no_level_at_most() {
        let mut h = Histogram::new();
        h.add(1, 1);
        h.add(1, 1);
        assert_eq!(h.highest_at_most(1), None);
    }

    proptest! {
        #[test]
        fn prefix_sums_match_a_brute_force_count(
            reqs in prop::collection::vec((1u8..=128, 1u8..=128), 0..300),
            b in 1u8..=128,
            u in 1u8..=128,
            target in 0u64..320,
        ) {
            let mut h = Histogram::new();
            for &(rb, ru) in &reqs {
                h.add(rb, ru);
            }
            let level = lv(b, u);
            let brute = reqs.iter().filter(|&&(rb, ru)| super::super::admits(level, rb, ru)).count() as u64;
            prop_assert_eq!(h.admitted_under(level), brute);
            if let Some(l) = h.highest_at_most(target) {
                prop_assert!(h.admitted_under(l) <= target);
                if level_index(l) + 1 < LEVELS {
                    prop_assert!(h.admitted_under(level_of_index(level_index(l) + 1)) > target);
                }
            }
            if let Some(l) = h.lowest_at_least(target) {
                prop_assert!(h.admitted_under(l) >= target);
                if level_index(l) > 0 {
                    prop_assert!(h.admitted_under(level_of_index(level_index(l) - 1)) < target);
                }
            }
        }
    }
}
