//! The lab's invariants and figures from what its programs recorded,
//! pure: route change to last agent per commit, the versions held at the
//! end, acknowledged statistics against the stored rows.

use std::collections::HashMap;

use crate::record::{Acked, Arrivals, ChurnRecord, Commit, Module};

/// A fault window `(from_ms, to_ms)`: a change committed inside it is
/// timed from the window's end (a frozen server or a cut host cannot
/// converge before it), not from its commit.
pub type Window = (u64, u64);

/// Route change to the last follower, over a set of followers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Convergence {
    /// Per commit with at least one follower: ms from the commit (or the
    /// end of its window) to the last follower holding it or newer, sorted.
    pub latencies: Vec<u64>,
    /// Commits some follower never received: `(commit, followers short)`.
    pub missing: Vec<(Commit, usize)>,
}

/// A follower with the fault windows that apply to it: changes committed
/// inside one of the first are timed from its end; changes committed
/// inside one of the second (the follower's host cut off: how long it
/// takes to reconnect is a figure of its own, and the bound holds once it
/// is connected) must still arrive but are not timed.
pub type Follower<'a> = (&'a Arrivals, &'a [Window], &'a [Window]);

/// Route change to last follower for every commit: per follower, from the
/// commit (or the end of a window of its own holding the commit) to the
/// first arrival of that version or a newer one; per commit, the longest.
pub fn convergence(commits: &[Commit], followers: &[Follower<'_>]) -> Convergence {
    let mut by_module: HashMap<Module, Vec<Follower<'_>>> = HashMap::new();
    for f in followers {
        by_module.entry(f.0.module).or_default().push(*f);
    }
    let mut out = Convergence::default();
    for c in commits {
        let Some(followers) = by_module.get(&c.module) else {
            continue;
        };
        let mut last = 0;
        let mut short = 0;
        for (a, windows, untimed) in followers {
            let timed = !untimed.iter().any(|&(w0, w1)| c.t_ms >= w0 && c.t_ms <= w1);
            let from = windows
                .iter()
                .filter(|&&(w0, w1)| c.t_ms >= w0 && c.t_ms <= w1)
                .map(|&(_, w1)| w1)
                .max()
                .unwrap_or(c.t_ms);
            match a.seen.iter().find(|&&(v, _)| v >= c.version) {
                Some(&(_, t)) if timed => last = last.max(t.saturating_sub(from)),
                Some(_) => {}
                None => short += 1,
            }
        }
        if short > 0 {
            out.missing.push((*c, short));
        } else {
            out.latencies.push(last);
        }
    }
    out.latencies.sort_unstable();
    out
}

/// The `q` quantile (0..=1) of sorted `v` (nearest rank), 0 when empty.
pub fn quantile(v: &[u64], q: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The version every module must end at: its last commit's, else the
/// setup's.
pub fn final_versions(churn: &ChurnRecord) -> HashMap<Module, u64> {
    let mut want: HashMap<Module, u64> = churn
        .modules
        .iter()
        .map(|&m| (m, churn.setup_version))
        .collect();
    for c in &churn.commits {
        let v = want.entry(c.module).or_insert(0);
        *v = (*v).max(c.version);
    }
    want
}

/// Followers that did not end holding their module's final version:
/// `(agent, module, newest held, wanted)`.
pub fn behind(arrivals: &[&Arrivals], want: &HashMap<Module, u64>) -> Vec<(u32, Module, u64, u64)> {
    arrivals
        .iter()
        .filter_map(|a| {
            let wanted = *want.get(&a.module)?;
            let held = a.seen.iter().map(|&(v, _)| v).max().unwrap_or(0);
            (held < wanted).then_some((a.agent, a.module, held, wanted))
        })
        .collect()
}

/// A stored row, as the verdict compares it: caller, module, node, succ.
pub type Stored = (u32, Module, (u32, u16), u32);

/// Acknowledged statistics the store does not hold (no row, or an older
/// value than the acknowledged one): each with what is stored.
pub fn lost(acked: &[Acked], stored: &[Stored]) -> Vec<(Acked, Option<u32>)> {
    let rows: HashMap<(u32, Module, (u32, u16)), u32> = stored
        .iter()
        .map(|&(caller, module, node, succ)| ((caller, module, node), succ))
        .collect();
    acked
        .iter()
        .filter_map(|a| match rows.get(&(a.caller, a.module, a.node)) {
            Some(&s) if s >= a.succ => None,
            other => Some((*a, other.copied())),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Module = (10_000, 1);

    fn follower(agent: u32, seen: &[(u64, u64)]) -> Arrivals {
        Arrivals {
            agent,
            module: M,
            seen: seen.to_vec(),
        }
    }

    #[test]
    fn a_change_is_timed_to_its_last_follower_and_a_newer_version_counts() {
        let a = follower(0, &[(5, 1000), (7, 2050)]);
        // Skipped version 6, but holds 7 (newer) from 2050.
        let b = follower(1, &[(5, 1000), (6, 2010), (7, 2100)]);
        let c = [Commit {
            module: M,
            version: 6,
            t_ms: 2000,
        }];
        let got = convergence(&c, &[(&a, &[], &[]), (&b, &[], &[])]);
        assert_eq!(got.latencies, vec![50]);
        assert!(got.missing.is_empty());
    }

    #[test]
    fn a_follower_that_never_got_a_change_is_missing_and_a_window_moves_the_start() {
        let a = follower(0, &[(5, 1000)]);
        let b = follower(1, &[(5, 1000), (6, 9000)]);
        let c = [Commit {
            module: M,
            version: 6,
            t_ms: 2000,
        }];
        let got = convergence(&c, &[(&a, &[], &[]), (&b, &[], &[])]);
        assert_eq!(got.missing, vec![(c[0], 1)]);
        let cut = [(1500, 8800)];
        let got = convergence(&c, &[(&b, &cut, &[])]);
        assert_eq!(got.latencies, vec![200]);
        // Another follower outside the window counts from the commit.
        let d = follower(2, &[(6, 2300)]);
        let got = convergence(&c, &[(&b, &cut, &[]), (&d, &[], &[])]);
        assert_eq!(got.latencies, vec![300]);
        // Untimed for b (its host cut off): only d's time counts, but a
        // follower that never got the change is still missing.
        let got = convergence(&c, &[(&b, &[], &cut), (&d, &[], &[])]);
        assert_eq!(got.latencies, vec![300]);
        let got = convergence(&c, &[(&a, &[], &cut), (&d, &[], &[])]);
        assert_eq!(got.missing, vec![(c[0], 1)]);
    }

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), 50);
        assert_eq!(quantile(&v, 0.99), 99);
        assert_eq!(quantile(&v, 1.0), 100);
        assert_eq!(quantile(&[], 0.99), 0);
    }

    #[test]
    fn followers_behind_the_final_version_are_named() {
        let churn = ChurnRecord {
            setup_version: 3,
            modules: vec![M, (10_001, 1)],
            commits: vec![Commit {
                module: M,
                version: 9,
                t_ms: 1,
            }],
            failures: vec![],
        };
        let want = final_versions(&churn);
        let a = follower(0, &[(3, 1), (9, 2)]);
        let b = follower(1, &[(3, 1)]);
        assert_eq!(behind(&[&a, &b], &want), vec![(1, M, 3, 9)]);
    }

    #[test]
    fn an_acknowledged_value_missing_or_older_in_the_store_is_lost() {
        let n = (1, 9000);
        let acked = [
            Acked {
                caller: 1,
                module: M,
                node: n,
                succ: 4,
            },
            Acked {
                caller: 2,
                module: M,
                node: n,
                succ: 4,
            },
            Acked {
                caller: 3,
                module: M,
                node: n,
                succ: 4,
            },
        ];
        let stored = [(1, M, n, 5), (2, M, n, 3)];
        let got = lost(&acked, &stored);
        assert_eq!(got, vec![(acked[1], Some(3)), (acked[2], None)]);
    }
}
