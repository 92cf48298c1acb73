//! Criterion benchmarks of the balance router (`lbagent::lb::balance`) at 10
//! and 1,000 nodes, beside the L5 getHost of the same module sizes measured
//! in the same run (the baseline for the ratio in the README).
//!
//! Run: `cargo bench --bench balance`.

use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use lbagent::lb::balance::Balance;
use lbagent::lb::{LbParams, ModuleLb};
use lbagent::model::{NodeAddr, RouteNode};

/// `n` nodes of 1–100 units, about a quarter of them in use.
fn router(n: usize) -> Balance {
    let mut rng = fastrand::Rng::with_seed(n as u64);
    Balance::new((0..n).map(|_| {
        let cap = rng.u32(1..=100);
        (cap, rng.u32(0..=cap / 2))
    }))
}

fn l5(n: usize) -> ModuleLb {
    let route: Vec<RouteNode> = (0..n)
        .map(|i| RouteNode {
            addr: NodeAddr::new(Ipv4Addr::from(0x0a00_0000 + i as u32), 9000),
            weight: 1,
        })
        .collect();
    ModuleLb::new(&route, 1, 0, &LbParams::default())
}

fn choice(c: &mut Criterion) {
    let mut g = c.benchmark_group("choice");
    let p = LbParams::default();
    for n in [10usize, 1_000] {
        let mut m = l5(n);
        g.bench_function(BenchmarkId::new("l5_get_host", n), |b| {
            b.iter(|| black_box(m.get_host(black_box(&p))))
        });

        let bal = router(n);
        let mut rng = fastrand::Rng::with_seed(1);
        for eta in [1u64, 16] {
            g.bench_function(
                BenchmarkId::new(format!("balance_choose_eta{eta}"), n),
                |b| b.iter(|| black_box(bal.choose(black_box(eta), rng.u64(..)))),
            );
        }

        // The agent's cycle: choose, take the unit; the report of an earlier
        // choice returns its unit. Steady state: 16 units out.
        let mut bal = router(n);
        let mut out = std::collections::VecDeque::new();
        g.bench_function(BenchmarkId::new("balance_choose_take_give_back", n), |b| {
            b.iter(|| {
                let i = bal.choose(16, rng.u64(..)).unwrap();
                bal.take(i).unwrap();
                out.push_back(i);
                if out.len() > 16 {
                    bal.give_back(out.pop_front().unwrap()).unwrap();
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, choice);
criterion_main!(benches);
