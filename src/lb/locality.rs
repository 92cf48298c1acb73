//! Zone-aware choice (Envoy's zone-aware routing, PolarisMesh's nearby
//! routing), pure: whether a getHost stays among the idle nodes of the
//! agent's own zone or spills over to every idle node.
//!
//! The rule: stay local while the local zone has an idle node and its idle
//! share (idle local nodes over local nodes, in percent) is at least
//! `locality_min_percent`; below it, choose among every idle node, so that
//! a zone losing its nodes sheds its load to the others before the last
//! local ones are overwhelmed. 0 (the default) stays local while any local
//! node is idle; 100 spills as soon as one local node is overloaded.
//!
//! It must not touch: node state (the caller counts), clocks, sockets.

/// The largest `locality_min_percent`.
pub const MAX_MIN_PERCENT: u32 = 100;

/// The spill threshold in force for a module: its own
/// (`locality_min_percent` of the module's options, when set) or else the
/// agent-wide `[lb] locality_min_percent`; clamped to 0..=100.
pub fn threshold(module: Option<u32>, agent: u32) -> u32 {
    module.unwrap_or(agent).min(MAX_MIN_PERCENT)
}

/// True when a getHost stays in the local zone: `local_idle` of its
/// `local_total` nodes are idle, at least one, and at least `min_percent`
/// percent of them.
pub fn stay_local(local_idle: usize, local_total: usize, min_percent: u32) -> bool {
    local_idle > 0 && local_idle * 100 >= min_percent as usize * local_total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zone_is_kept_down_to_the_threshold_and_spills_below_it() {
        // 10 local nodes, threshold 50%: 5 idle stay, 4 spill.
        assert!(stay_local(10, 10, 50));
        assert!(stay_local(5, 10, 50));
        assert!(!stay_local(4, 10, 50));
        // 3 nodes, 34%: one idle is 33.3%, spill; two stay.
        assert!(!stay_local(1, 3, 34));
        assert!(stay_local(2, 3, 34));
    }

    #[test]
    fn threshold_zero_stays_while_any_local_node_is_idle() {
        assert!(stay_local(1, 100, 0));
        assert!(!stay_local(0, 100, 0));
        assert!(!stay_local(0, 0, 0));
    }

    #[test]
    fn threshold_hundred_spills_at_the_first_overloaded_local_node() {
        assert!(stay_local(4, 4, 100));
        assert!(!stay_local(3, 4, 100));
    }

    #[test]
    fn a_module_setting_overrides_the_agent_wide_one() {
        assert_eq!(threshold(None, 30), 30);
        assert_eq!(threshold(Some(70), 30), 70);
        assert_eq!(threshold(Some(0), 30), 0);
        assert_eq!(threshold(Some(400), 30), 100);
    }
}
