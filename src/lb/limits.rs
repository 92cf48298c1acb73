//! The ejection limit and the panic threshold, as Envoy has them
//! (`max_ejection_percent`, `healthy_panic_threshold`): pure tests on
//! counts, which [`super::ModuleLb`] applies.

/// Whether one more node may be marked overloaded when `overloaded` of
/// `nodes` are: the overloaded nodes must stay at most `max_percent` of
/// them (`floor(nodes · max_percent / 100)`); 100 or above is no limit,
/// the original's behaviour.
pub fn may_overload(overloaded: usize, nodes: usize, max_percent: u8) -> bool {
    max_percent >= 100 || (overloaded + 1) * 100 <= usize::from(max_percent) * nodes
}

/// Whether a module of `nodes` with `idle` idle ones is in panic: its idle
/// share below `panic_percent` (0 is off).
pub fn in_panic(idle: usize, nodes: usize, panic_percent: u8) -> bool {
    panic_percent > 0 && nodes > 0 && idle * 100 < usize::from(panic_percent) * nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_a_floor_of_the_share() {
        // 50% of 5 nodes: 2 may be overloaded, not 3.
        assert!(may_overload(1, 5, 50));
        assert!(!may_overload(2, 5, 50));
        // 10% of 3 nodes: none.
        assert!(!may_overload(0, 3, 10));
        // No limit.
        assert!(may_overload(5, 5, 100));
    }

    #[test]
    fn panic_is_below_the_threshold_only() {
        assert!(!in_panic(1, 2, 50), "exactly half is not below half");
        assert!(in_panic(0, 2, 50));
        assert!(!in_panic(0, 2, 0), "0 is off");
        assert!(!in_panic(0, 0, 50), "no nodes is no module, not a panic");
    }
}
