//! Criterion benchmarks of the pure LB core on a 10-node module: getHost,
//! report, and a batch report; and a route update at 10, 1,000 and 10,000
//! nodes (reported per node). No sockets, no clock: `now` is a counter.
//!
//! Run: `cargo bench --bench lb`.

use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lbagent::lb::{LbParams, ModuleLb, Outcome};
use lbagent::model::{NodeAddr, RouteNode};

fn ten_nodes() -> (ModuleLb, Vec<NodeAddr>, LbParams) {
    let p = LbParams::default();
    let addrs: Vec<NodeAddr> = (1..=10)
        .map(|i| NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 9000))
        .collect();
    let route: Vec<RouteNode> = addrs
        .iter()
        .map(|&addr| RouteNode { addr, weight: 1 })
        .collect();
    (ModuleLb::new(&route, 1, 0, &p), addrs, p)
}

fn get_host(c: &mut Criterion) {
    let (mut m, _, p) = ten_nodes();
    c.bench_function("get_host/10_nodes", |b| {
        b.iter(|| black_box(m.get_host(black_box(&p))))
    });

    // Two of ten overloaded: probing is active.
    let (mut m, addrs, p) = ten_nodes();
    for a in &addrs[..2] {
        m.report(*a, Outcome::Failure { tcost_ms: 100_000 }, 0, &p)
            .unwrap();
    }
    c.bench_function("get_host/10_nodes_2_overloaded", |b| {
        b.iter(|| black_box(m.get_host(black_box(&p))))
    });
}

fn report(c: &mut Criterion) {
    let (mut m, addrs, p) = ten_nodes();
    let mut i = 0usize;
    let mut now = 0u64;
    c.bench_function("report/10_nodes_success", |b| {
        b.iter(|| {
            i = (i + 1) % 10;
            now += 1;
            black_box(
                m.report(black_box(addrs[i]), Outcome::Success, now, &p)
                    .unwrap(),
            )
        })
    });

    // One failure in ten calls, the clock advancing 1 ms per call: windows
    // close and reset along the way, as in production.
    let (mut m, addrs, p) = ten_nodes();
    let mut k = 0u64;
    c.bench_function("report/10_nodes_10pct_failures", |b| {
        b.iter(|| {
            k += 1;
            let o = if k % 10 == 0 {
                Outcome::Failure { tcost_ms: 20 }
            } else {
                Outcome::Success
            };
            black_box(
                m.report(black_box(addrs[(k % 10) as usize]), o, k, &p)
                    .unwrap(),
            )
        })
    });

    let (mut m, addrs, p) = ten_nodes();
    let mut j = 0usize;
    c.bench_function("batch_report/100_successes", |b| {
        b.iter(|| {
            j = (j + 1) % 10;
            m.report_successes(black_box(addrs[j]), 100, 7, &p, |t| {
                black_box(t);
            })
            .unwrap()
        })
    });
}

/// A route change of `n` nodes: each update swaps between two routes that
/// share 90% of their nodes (10% leave, 10% arrive, the rest keep their
/// state), so every call does the full work of a real change. Throughput is
/// per node of the route.
fn update_route(c: &mut Criterion) {
    let p = LbParams::default();
    let mut g = c.benchmark_group("update_route");
    for n in [10u32, 1_000, 10_000] {
        let node = |i: u32| RouteNode {
            addr: NodeAddr {
                ip: 0x0a00_0000 + i,
                port: 9000,
            },
            weight: 1,
        };
        let shift = (n / 10).max(1);
        let a: Vec<RouteNode> = (0..n).map(node).collect();
        let b: Vec<RouteNode> = (shift..n + shift).map(node).collect();
        let mut m = ModuleLb::new(&a, 1, 0, &p);
        // Some state worth keeping: two overloaded nodes.
        for r in &a[n as usize / 2..n as usize / 2 + 2] {
            m.report(r.addr, Outcome::Failure { tcost_ms: 5_000 }, 0, &p)
                .unwrap();
        }
        let mut version = 1u64;
        g.throughput(Throughput::Elements(u64::from(n)));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| {
                version += 1;
                let route = if version % 2 == 0 { &b } else { &a };
                m.update_route(black_box(route), version, 0, &p);
                black_box(m.nodes().len())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, get_host, report, update_route);
criterion_main!(benches);
