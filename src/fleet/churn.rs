//! Route churn: the lab's modules set up in the store, then one change
//! every interval (a third node added to a module, or taken away again),
//! each commit's version and return time recorded. Store failures (the
//! database failing over) are recorded and the store reopened; the churn
//! goes on.

use std::collections::HashSet;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lbagent_model::{ModuleId, NodeAddr, RouteNode};
use lbagent_store::StoreUrl;
use lbagent_store::{Store, StoreError};

use crate::clock::Clock;
use crate::record::{ChurnRecord, Commit};
use crate::sim::module;

/// How to churn.
#[derive(Clone, Debug)]
pub struct ChurnOptions {
    /// The store (the lab's PostgreSQL, both hosts named).
    pub store: StoreUrl,
    /// Modules in the lab.
    pub modules: u32,
    /// Every other change goes to one of the first `hot` modules (those the
    /// real agents follow); 0: all changes spread over every module.
    pub hot: u32,
    /// One change every this many ms.
    pub interval: Duration,
    /// How long to churn.
    pub duration: Duration,
}

/// The two nodes every module keeps (live whatever the churn does).
pub fn base_nodes(m: u32) -> [NodeAddr; 2] {
    [
        NodeAddr {
            ip: 0x0a63_0000 + m,
            port: 9000,
        },
        NodeAddr {
            ip: 0x0a62_0000 + m,
            port: 9000,
        },
    ]
}

/// The node the churn adds and takes away.
pub fn churn_node(m: u32) -> NodeAddr {
    NodeAddr {
        ip: 0x0a61_0000 + m,
        port: 9000,
    }
}

/// The module index of change number `k`: every other change in the hot
/// set, the rest spread over all modules.
pub fn pick(k: u64, modules: u32, hot: u32, rng: &mut fastrand::Rng) -> u32 {
    if hot > 0 && k % 2 == 0 {
        rng.u32(..hot.min(modules))
    } else {
        rng.u32(..modules)
    }
}

fn open(url: &StoreUrl) -> Result<Box<dyn Store>, StoreError> {
    lbagent_store::open(url)
}

/// Sets the modules up (each with its two base nodes, in one import).
///
/// # Errors
/// The store could not be opened or refused the import.
pub fn setup(url: &StoreUrl, modules: u32) -> Result<ChurnRecord> {
    let mut store = open(url).context("opening the lab's store")?;
    let rows: Vec<(ModuleId, RouteNode)> = (0..modules)
        .flat_map(|m| {
            let (modid, cmdid) = module(m);
            base_nodes(m)
                .into_iter()
                .map(move |addr| (ModuleId::new(modid, cmdid), RouteNode { addr, weight: 1 }))
        })
        .collect();
    let imported = store
        .import_routes(&rows, true)
        .context("importing the lab's modules")?;
    Ok(ChurnRecord {
        setup_version: imported.version,
        modules: (0..modules).map(module).collect(),
        ..ChurnRecord::default()
    })
}

/// Churns for `opts.duration`, appending to `rec`.
pub fn run(opts: &ChurnOptions, rec: &mut ChurnRecord) {
    let clock = Clock::new();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut present: HashSet<u32> = HashSet::new();
    let mut store: Option<Box<dyn Store>> = None;
    let start = Instant::now();
    let mut k = 0u64;
    while start.elapsed() < opts.duration {
        let due = start + opts.interval * k as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            sleep(wait);
        }
        let m = pick(k, opts.modules, opts.hot, &mut rng);
        k += 1;
        if store.is_none() {
            match open(&opts.store) {
                Ok(s) => store = Some(s),
                Err(e) => {
                    rec.failures.push((clock.now_ms(), e.to_string()));
                    continue;
                }
            }
        }
        let s = store.as_mut().expect("opened above");
        let (modid, cmdid) = module(m);
        let id = ModuleId::new(modid, cmdid);
        let node = churn_node(m);
        let adding = !present.contains(&m);
        let r = if adding {
            s.add_node(
                id,
                RouteNode {
                    addr: node,
                    weight: 1,
                },
            )
        } else {
            s.del_node(id, node)
        };
        match r {
            Ok(version) => {
                rec.commits.push(Commit {
                    module: module(m),
                    version,
                    t_ms: clock.now_ms(),
                });
                if adding {
                    present.insert(m);
                } else {
                    present.remove(&m);
                }
            }
            // A change committed whose answer was lost: follow the store.
            Err(StoreError::Duplicate { .. }) => {
                present.insert(m);
            }
            Err(StoreError::NotFound { .. }) => {
                present.remove(&m);
            }
            Err(e) => {
                rec.failures.push((clock.now_ms(), e.to_string()));
                store = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_other_change_goes_to_the_hot_modules() {
        let mut rng = fastrand::Rng::with_seed(1);
        for k in 0..200 {
            let m = pick(k, 1000, 40, &mut rng);
            assert!(m < 1000);
            if k % 2 == 0 {
                assert!(m < 40);
            }
        }
        assert!(base_nodes(3).iter().all(|n| *n != churn_node(3)));
    }
}
