//! Instruction counts that are not in the regression check's baseline,
//! for the README's figures: counted under callgrind by hand. The four
//! workloads the check counts live in `perf/workloads.rs` and run as the
//! Gungraun benchmarks of `perf/callgrind.rs` (`perf/check`).
//!
//! - `shed` ([`shed_rejected`] and [`shed_answered`], each counted on its
//!   own; issue 12's shed path, for the README's agent-overload section): a
//!   shard with `agent_shedding` on whose level was driven below business
//!   priority 60 handles 100,000 queued getHosts at priority 60 (each
//!   answered `Rejected`) and 100,000 at priority 5 (each answered with a
//!   host): what a rejection costs the shard against an answer.
//!   `valgrind --tool=callgrind --toggle-collect='callgrind_workload::shed_rejected' target/release/examples/callgrind_workload shed`.
//! - `shm fixed` and `shm flat` ([`shm_main`]; issue 16's shared memory):
//!   getHosts and reports through a slot of a region, the client and the
//!   shard in one thread; `shm_shard_turn` counts the shard's sweeps,
//!   `shm_client_*` the client's side, for the fixed records of layout 3
//!   against the FlatBuffers cells of layout 2 (the fixed case is also
//!   the gated Gungraun benchmark `shm_requests`).
//!   `valgrind --tool=callgrind --toggle-collect='*::workloads::shm_shard_turn' target/release/examples/callgrind_workload shm fixed`.
//!
//! - `lb MODE` ([`lb_main`]; issue 31's options, for the book's options
//!   page): 100,000 getHosts, each reported (tcost 2 ms), through one
//!   module's LB core (`ModuleLb::get_host_from` + `report_call`, six
//!   nodes), with MODE one of `off` (the original's path), `weights`
//!   (weights 5,5,5,5,1,1), `slow_start` (30 s window, every node ramping),
//!   `limit` (max_overloaded_percent 50), `panic` (panic_percent 50, not in
//!   panic), `p2c`; [`lb_gethosts`] is the counted function.
//!   `valgrind --tool=callgrind --toggle-collect='callgrind_workload::lb_gethosts' target/release/examples/callgrind_workload lb p2c`.
//!
//! Build: `cargo build --release --example callgrind_workload`. The program
//! checks its answers and exits non-zero when they are wrong, so that a
//! broken build cannot pass for a fast one.

use std::hint::black_box;
use std::process::ExitCode;

use lbagent::admission::AdmissionParams;
use lbagent::agent::shard::{Queued, ShardCore};
use lbagent::wire::{decode, Encoder, Limits, Message, RetCode};

#[path = "workloads.rs"]
mod workloads;

use workloads::{shard, MODULE, PEER};

/// getHosts (and as many reports) of a `shm` run.
const SHM_N: u64 = workloads::SHM_N;

/// getHosts per half of the `shed` case.
const SHED_N: u64 = 100_000;

/// A shard with shedding on, its level driven below (60, 64) by
/// overloaded 1 ms windows of priority-(60, 64) getHosts (not counted).
/// Returns it and the time it stopped at: while the clock stays there, no
/// window ends (the count bound is out of reach), so the level holds.
fn shedding_shard() -> (ShardCore, u64) {
    let mut shard = shard();
    shard.set_shedding(Some(AdmissionParams {
        window_us: 1000,
        window_requests: u32::MAX,
        queuing_threshold_us: 500,
        ..AdmissionParams::default()
    }));
    let req = Encoder::new().get_host_req(1, MODULE, 60, 64).to_vec();
    let mut t = 1_000_000_000u64;
    for _ in 0..1_000_000 {
        if !lbagent::admission::admits(shard.self_level(), 60, 64) {
            break;
        }
        t += 1;
        let q = Queued {
            now_us: t,
            waited_us: 5_000,
        };
        let _ = shard.handle_queued(&req, PEER, t / 1000, Some(q));
    }
    (shard, t)
}

/// `n` queued getHosts that the shard's level rejects. Returns how many
/// answers were `Rejected`-sized (checked by the caller).
#[inline(never)]
fn shed_rejected(shard: &mut ShardCore, req: &[u8], t: u64, n: u64) -> (u64, Vec<u8>) {
    // A constant of its own, so that the linker cannot fold the two
    // counted functions into one symbol.
    black_box(1u32);
    shed_loop(shard, req, t, n)
}

/// `n` queued getHosts that the shard's level admits (answered with a host).
#[inline(never)]
fn shed_answered(shard: &mut ShardCore, req: &[u8], t: u64, n: u64) -> (u64, Vec<u8>) {
    black_box(2u32);
    shed_loop(shard, req, t, n)
}

fn shed_loop(shard: &mut ShardCore, req: &[u8], t: u64, n: u64) -> (u64, Vec<u8>) {
    let mut answers = 0;
    let mut last = Vec::new();
    for i in 0..n {
        let q = Queued {
            now_us: t,
            waited_us: 20,
        };
        if let Some(a) = shard.handle_queued(black_box(req), PEER, t / 1000, Some(q)) {
            answers += 1;
            if i + 1 == n {
                last = a.to_vec();
            }
        }
    }
    (answers, last)
}

fn shed_main() -> ExitCode {
    let (mut shard, t) = shedding_shard();
    let level = shard.self_level();
    let mut enc = Encoder::new();
    let low = enc.get_host_req(7, MODULE, 60, 64).to_vec();
    let high = enc.get_host_req(8, MODULE, 5, 64).to_vec();
    let (rejected, last_r) = shed_rejected(&mut shard, &low, t, SHED_N);
    let (answered, last_a) = shed_answered(&mut shard, &high, t, SHED_N);
    let code = |b: &[u8]| match decode(b, &Limits::UDP) {
        Ok(Message::GetHostResp(r)) => Some(r.retcode()),
        _ => None,
    };
    println!(
        "callgrind workload: shed: level {level:?}; {SHED_N} getHosts at priority 60 ({rejected} answered, last {:?}), {SHED_N} at priority 5 ({answered} answered, last {:?})",
        code(&last_r),
        code(&last_a)
    );
    if lbagent::admission::admits(level, 60, 64)
        || shard.self_level() != level
        || rejected != SHED_N
        || answered != SHED_N
        || code(&last_r) != Some(RetCode::Rejected)
        || code(&last_a) != Some(RetCode::Ok)
    {
        eprintln!("callgrind workload: shed: the shard did not shed as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

// === the shared-memory path (issue 16) ===

/// `shm fixed|flat`: [`SHM_N`] getHosts, each followed by a report of the
/// node it named, through one slot of a region, the shard and the client
/// in this one thread (post, sweep, read the answer): the shard's
/// instructions per request are `shm_shard_turn`'s count / (2 × N), the
/// client's those of `shm_client_*`. `flat` sends FlatBuffers bytes (the
/// cells of layout 2), `fixed` the records of layout 3 (the workload
/// `perf/check` gates: `workloads::shm_workload`).
fn shm_main(mode: Option<&str>) -> ExitCode {
    let record = match mode {
        Some("fixed") => true,
        Some("flat") => false,
        _ => {
            eprintln!("usage: callgrind_workload shm fixed|flat");
            return ExitCode::FAILURE;
        }
    };
    let mut run = workloads::shm_run(record);
    let seen = workloads::shm_workload(&mut run, SHM_N);
    if std::panic::catch_unwind(|| workloads::check_shm(&run, &seen, SHM_N)).is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// `shm busy`: the busy shape ([`workloads::shm_busy_workload`]): the
/// shard's instructions per request are `shm_shard_turn`'s count / (2 ×
/// [`SHM_N`]).
fn shm_busy_main() -> ExitCode {
    let mut run = workloads::shm_busy_run();
    let rounds = workloads::SHM_BUSY_ROUNDS;
    let seen = workloads::shm_busy_workload(&mut run, rounds);
    if std::panic::catch_unwind(|| workloads::check_shm_busy(&run, &seen, rounds)).is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    match std::env::args().nth(1).as_deref() {
        Some("shed") => shed_main(),
        Some("shm") if std::env::args().nth(2).as_deref() == Some("busy") => shm_busy_main(),
        Some("shm") => shm_main(std::env::args().nth(2).as_deref()),
        Some("lb") => lb_main(std::env::args().nth(2).as_deref()),
        _ => {
            eprintln!(
                "usage: callgrind_workload shed | shm fixed|flat|busy | lb off|weights|slow_start|limit|panic|p2c"
            );
            ExitCode::from(2)
        }
    }
}

/// getHosts (each reported) of an `lb` run.
const LB_N: u64 = 100_000;

/// `lb MODE`: a six-node module with one of issue 31's options on (or
/// none), driven by [`lb_gethosts`].
fn lb_main(mode: Option<&str>) -> ExitCode {
    use lbagent::lb::{LbParams, ModuleLb};
    use lbagent::model::{ModuleOptions, NodeAddr, Policy, RouteNode};
    let weights: [u32; 6] = match mode {
        Some("weights") => [5, 5, 5, 5, 1, 1],
        _ => [1; 6],
    };
    let route: Vec<RouteNode> = weights
        .iter()
        .enumerate()
        .map(|(i, &weight)| RouteNode {
            addr: NodeAddr::new(std::net::Ipv4Addr::new(10, 0, 0, i as u8 + 1), 80),
            weight,
        })
        .collect();
    let p = LbParams::default();
    let mut m = ModuleLb::new(&route, 1, 0, &p);
    let mut o = ModuleOptions::default();
    match mode {
        Some("off") | Some("weights") => {}
        Some("slow_start") => o.slow_start_ms = Some(30_000),
        Some("limit") => o.max_overloaded_percent = Some(50),
        Some("panic") => o.panic_percent = Some(50),
        Some("p2c") => m.set_policy(Policy::P2c),
        _ => {
            eprintln!("usage: callgrind_workload lb off|weights|slow_start|limit|panic|p2c");
            return ExitCode::from(2);
        }
    }
    // Slow start: every node entered the idle list at 1 ms, so each is
    // ramping for the whole run.
    m.set_options(o, 1, &p);
    if mode == Some("slow_start") {
        m.update_route(&[], 2, 1, &p);
        m.update_route(&route, 3, 1, &p);
        m.set_options(o, 1, &p);
    }
    if (mode == Some("off")) == m.is_tuned() {
        eprintln!("lb {mode:?}: the module's options are not as the mode says");
        return ExitCode::FAILURE;
    }
    let answered = lb_gethosts(&mut m, &p);
    if answered != LB_N {
        eprintln!("lb {mode:?}: {answered} of {LB_N} getHosts answered a node");
        return ExitCode::FAILURE;
    }
    println!("lb {}: {LB_N} getHosts and reports", mode.unwrap_or(""));
    ExitCode::SUCCESS
}

/// [`LB_N`] getHosts through `m`, each reported a success of 2 ms, time
/// advancing 1 ms per 10; how many answered a node.
#[inline(never)]
fn lb_gethosts(m: &mut lbagent::lb::ModuleLb, p: &lbagent::lb::LbParams) -> u64 {
    use lbagent::lb::{Outcome, ANY_CLIENT};
    let mut answered = 0;
    for i in 0..LB_N {
        let now = 1 + i / 10;
        if let Some(a) = black_box(m.get_host_from(p, ANY_CLIENT, 0, 0, now)).addr() {
            answered += 1;
            let _ = m.report_call(ANY_CLIENT, a, Outcome::Success, Some(2), now, p);
        }
    }
    answered
}
