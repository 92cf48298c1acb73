//! The callgrind regression check: the six workloads of
//! `perf/workloads.rs` as Gungraun library benchmarks, each counted under
//! callgrind from its own setup and compared with the committed baseline
//! (`perf/callgrind-baseline/`). `perf/check` runs it with
//! `--baseline=committed`; a count more than [`LIMIT_PCT`] above its
//! baseline, or the cached client above [`CLIENT_MAX_PER_PAIR`]
//! instructions per pair whatever the baseline says, fails the run (exit
//! status 3). See perf/README.md.
//!
//! Only the benchmark function is counted (Gungraun's default entry point,
//! a `--toggle-collect` on it): the setup that builds the shard and the
//! requests, and the teardown that checks the answers, are not. The cached
//! client counts [`workloads::cached_client`] only (a custom entry point),
//! so that the heartbeat beats between its chunks stay out of the count,
//! as they did under the hand-written runner.
//!
//! Run alone: `cargo bench --bench callgrind` (compares with the previous
//! run under `target/gungraun/`); one case: `cargo bench --bench callgrind
//! -- cached_client`.

use std::hint::black_box;

use gungraun::{
    library_benchmark, library_benchmark_group, main, Callgrind, EntryPoint, EventKind,
    FlamegraphConfig, FlamegraphKind, LibraryBenchmarkConfig,
};

#[path = "workloads.rs"]
mod workloads;

use workloads::{
    ClientRun, ClientSeen, ManyModulesRun, Seen, ShardRun, ShmBusyRun, ShmRun, ShmSeen, UdpRun,
    UdpSeen, UpdateRouteRun, N, SHM_N, UDP_ROUNDS,
};

/// System calls per turn of the UDP shell workload (a full batch),
/// counted over the whole turn as callgrind's `--collect-systime` does:
/// the shard's `recvmmsg` and `sendmmsg` and the two clock reads of its
/// one timed getHost (under valgrind `clock_gettime` is a system call, not
/// the vDSO's), and the client's `sendmmsg` and `recvmmsg`. One more per
/// datagram would be 32 more per turn, one more per batch 10,000 more in
/// the run: the limit fails either whatever the baseline says.
const UDP_SYSCALLS_PER_TURN: u64 = 6;

/// Slack on that limit for the benchmark's own setup (a call or two).
const UDP_SYSCALLS_SLACK: u64 = 100;

/// Instructions more than this percentage above the baseline fail.
const LIMIT_PCT: f64 = 5.0;

/// The cached client path's ceiling in instructions per getHost + report
/// (issue 14's target), whatever the baseline says.
const CLIENT_MAX_PER_PAIR: u64 = 80;

/// The shard's ceiling in instructions per request over shared memory, a
/// getHost or a report as fixed records, one request a sweep (issue 29's
/// target: `shm_requests` counts the shard's sweeps of 2 x [`SHM_N`]
/// requests), whatever the baseline says.
const SHM_MAX_PER_REQUEST: u64 = 400;

// [`N`] getHosts and [`N`] reports through `ShardCore::handle`.
#[library_benchmark]
#[bench::million(args = (), setup = workloads::shard_run, teardown = check_shard)]
fn shard_requests(mut run: ShardRun) -> (ShardRun, Seen) {
    let seen = workloads::workload(&mut run.shard, &run.reqs, black_box(N));
    (run, seen)
}

fn check_shard((_, seen): (ShardRun, Seen)) {
    workloads::check_shard(&seen, N);
}

// [`N`] getHosts and [`N`] success reports through the client's route
// cache; only [`workloads::cached_client`] is counted.
#[library_benchmark(
    config = LibraryBenchmarkConfig::default().tool(
        Callgrind::default()
            .entry_point(EntryPoint::Custom("*::workloads::cached_client".to_owned()))
            .soft_limits([(EventKind::Ir, LIMIT_PCT)])
            .hard_limits([(EventKind::Ir, CLIENT_MAX_PER_PAIR * N)])
    )
)]
#[bench::million(args = (), setup = workloads::client_run, teardown = check_client)]
fn cached_client(mut run: ClientRun) -> (ClientRun, ClientSeen) {
    let seen = workloads::cached_client_chunks(&mut run, black_box(N));
    (run, seen)
}

fn check_client((run, seen): (ClientRun, ClientSeen)) {
    workloads::check_client(run, &seen, N);
}

// 20 route changes of a 10,000-node module through `ShardCore::apply`.
#[library_benchmark]
#[bench::changes_20(args = (), setup = workloads::update_route_run, teardown = check_update_route)]
fn update_route(mut run: UpdateRouteRun) -> (UpdateRouteRun, u64) {
    let changes = std::mem::take(&mut run.changes);
    let held = workloads::update_route_workload(&mut run.shard, changes, &run.get_host);
    (run, held)
}

fn check_update_route((_, held): (UpdateRouteRun, u64)) {
    workloads::check_update_route(held);
}

// 50,000 getHosts and reports over 20,000 modules, 2,000 ticks.
#[library_benchmark]
#[bench::modules_20000(args = (), setup = workloads::many_modules_run, teardown = check_many_modules)]
fn many_modules(mut run: ManyModulesRun) -> (ManyModulesRun, u64) {
    let answered = workloads::many_modules_workload(&mut run.shard, &run.reqs);
    (run, answered)
}

fn check_many_modules((_, answered): (ManyModulesRun, u64)) {
    workloads::check_many_modules(answered);
}

// The shard's UDP shell: batches of 32 datagrams received, served and
// answered through its socket; only [`workloads::udp_shard_turn`] is
// counted (not the client's side).
#[library_benchmark(
    config = LibraryBenchmarkConfig::default().tool(
        Callgrind::default()
            .entry_point(EntryPoint::Custom("*::workloads::udp_shard_turn".to_owned()))
            .args(["--collect-systime=yes"])
            .soft_limits([(EventKind::Ir, LIMIT_PCT)])
            .hard_limits([(
                EventKind::SysCount,
                UDP_SYSCALLS_PER_TURN * UDP_ROUNDS + UDP_SYSCALLS_SLACK
            )])
    )
)]
#[bench::turns_10000(args = (), setup = workloads::udp_run, teardown = check_udp)]
fn udp_shell(mut run: UdpRun) -> (UdpRun, UdpSeen) {
    let seen = workloads::udp_workload(&mut run, black_box(UDP_ROUNDS));
    (run, seen)
}

fn check_udp((_, seen): (UdpRun, UdpSeen)) {
    workloads::check_udp(&seen, UDP_ROUNDS);
}

// getHosts and reports through a shared-memory slot as fixed records;
// only the shard's sweeps ([`workloads::shm_shard_turn`]) are counted.
#[library_benchmark(
    config = LibraryBenchmarkConfig::default().tool(
        Callgrind::default()
            .entry_point(EntryPoint::Custom("*::workloads::shm_shard_turn".to_owned()))
            .soft_limits([(EventKind::Ir, LIMIT_PCT)])
            .hard_limits([(EventKind::Ir, SHM_MAX_PER_REQUEST * 2 * SHM_N)])
    )
)]
#[bench::fixed_200000(args = (), setup = shm_fixed_run, teardown = check_shm)]
fn shm_requests(mut run: ShmRun) -> (ShmRun, ShmSeen) {
    let seen = workloads::shm_workload(&mut run, black_box(SHM_N));
    (run, seen)
}

fn shm_fixed_run() -> ShmRun {
    workloads::shm_run(true)
}

fn check_shm((run, seen): (ShmRun, ShmSeen)) {
    workloads::check_shm(&run, &seen, SHM_N);
}

// The same requests from 16 clients at once, one sweep serving them all
// (a busy shard's shape); only the shard's sweeps are counted.
#[library_benchmark(
    config = LibraryBenchmarkConfig::default().tool(
        Callgrind::default()
            .entry_point(EntryPoint::Custom("*::workloads::shm_shard_turn".to_owned()))
            .soft_limits([(EventKind::Ir, LIMIT_PCT)])
    )
)]
#[bench::slots_16(args = (), setup = workloads::shm_busy_run, teardown = check_shm_busy)]
fn shm_busy(mut run: ShmBusyRun) -> (ShmBusyRun, ShmSeen) {
    let seen = workloads::shm_busy_workload(&mut run, black_box(workloads::SHM_BUSY_ROUNDS));
    (run, seen)
}

fn check_shm_busy((run, seen): (ShmBusyRun, ShmSeen)) {
    workloads::check_shm_busy(&run, &seen, workloads::SHM_BUSY_ROUNDS);
}

library_benchmark_group!(
    name = workloads_group,
    benchmarks = [
        shard_requests,
        cached_client,
        update_route,
        many_modules,
        udp_shell,
        shm_requests,
        shm_busy
    ]
);

// Differential flamegraphs against the baseline (SVG files beside the
// callgrind output under Gungraun's home) show where a count moved.
main!(
    config = LibraryBenchmarkConfig::default().tool(
        Callgrind::default()
            .soft_limits([(EventKind::Ir, LIMIT_PCT)])
            .flamegraph(FlamegraphConfig::default().kind(FlamegraphKind::Differential))
    ),
    library_benchmark_groups = workloads_group
);
