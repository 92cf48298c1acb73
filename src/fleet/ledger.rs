//! Which statistics one simulated agent had acknowledged, pure.
//!
//! The agent pushes one entry per tick, each `succ` one more than the
//! last, and runs its statistics core with one report in flight: the
//! reporter acknowledges reports in the order they were sent, re-sent
//! reports keep their place, so the entries acknowledged are exactly the
//! first `acked` pushed. The store replaces a (module, node, caller) row
//! with the newest report, so it must hold, per key, at least the newest
//! acknowledged `succ`; less means an acknowledged report was lost.

use std::collections::BTreeMap;

use crate::record::{Acked, Module};

/// One entry pushed: the module, the node `(ip, port)`, the `succ` sent.
pub type Pushed = (Module, (u32, u16), u32);

/// The newest acknowledged `succ` per (module, node) of `caller`, given
/// the entries pushed in order and how many were acknowledged.
///
/// Returns None when the count cannot be a prefix of what was pushed
/// (more acknowledged than pushed): the ledger cannot tell which.
pub fn acked(caller: u32, pushed: &[Pushed], acked_entries: u64) -> Option<Vec<Acked>> {
    let n = usize::try_from(acked_entries).ok()?;
    if n > pushed.len() {
        return None;
    }
    let mut newest: BTreeMap<(Module, (u32, u16)), u32> = BTreeMap::new();
    for &(module, node, succ) in &pushed[..n] {
        let e = newest.entry((module, node)).or_insert(succ);
        *e = (*e).max(succ);
    }
    Some(
        newest
            .into_iter()
            .map(|((module, node), succ)| Acked {
                caller,
                module,
                node,
                succ,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const M1: Module = (10_000, 1);
    const M2: Module = (10_001, 1);
    const N: (u32, u16) = (0x0a63_0001, 9000);

    #[test]
    fn only_the_acknowledged_prefix_counts_and_each_key_keeps_its_newest() {
        let pushed = [(M1, N, 1), (M2, N, 2), (M1, N, 3), (M2, N, 4)];
        let got = acked(7, &pushed, 3).unwrap();
        assert_eq!(
            got,
            vec![
                Acked {
                    caller: 7,
                    module: M1,
                    node: N,
                    succ: 3
                },
                Acked {
                    caller: 7,
                    module: M2,
                    node: N,
                    succ: 2
                },
            ]
        );
    }

    #[test]
    fn nothing_acknowledged_claims_nothing_and_too_many_is_refused() {
        assert_eq!(acked(7, &[(M1, N, 1)], 0).unwrap(), vec![]);
        assert_eq!(acked(7, &[(M1, N, 1)], 2), None);
    }
}
