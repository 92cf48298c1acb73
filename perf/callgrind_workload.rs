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
//!   shard in one thread; `shm_shard` counts the shard's sweeps,
//!   `shm_client_*` the client's side, for the fixed records of layout 3
//!   against the FlatBuffers cells of layout 2.
//!   `valgrind --tool=callgrind --toggle-collect='callgrind_workload::shm_shard' target/release/examples/callgrind_workload shm fixed`.
//!
//! Build: `cargo build --release --example callgrind_workload`. The program
//! checks its answers and exits non-zero when they are wrong, so that a
//! broken build cannot pass for a fast one.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Duration;

use lbagent::admission::AdmissionParams;
use lbagent::agent::shard::{Queued, ShardCore};
use lbagent::agent::shard_rt::sweep;
use lbagent::model::NodeAddr;
use lbagent::shm::attach::Attachment;
use lbagent::shm::fixed;
use lbagent::shm::layout::{Geometry, FMT_FIXED, FMT_FLATBUFFERS};
use lbagent::shm::region::{Access, Identity, Region};
use lbagent::shm::serve::Server;
use lbagent::wire::{decode, Encoder, Limits, Message, Report, RetCode};

#[path = "workloads.rs"]
mod workloads;

use workloads::{shard, FAIL_EVERY, MODULE, PEER};

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

/// getHosts (and as many reports) of a `shm` run.
const SHM_N: u64 = 200_000;

/// The shard's side of one exchange through a slot: one sweep, as the
/// shard's request loop runs it (counted alone: `shm_shard`).
#[inline(never)]
fn shm_shard(shard: &mut ShardCore, srv: &mut Server) -> usize {
    let n = sweep(shard, srv, false, false);
    if !shard.outbox.is_empty() {
        shard.outbox.clear();
    }
    n
}

/// The client's side of posting `req`: encode it (a fixed record, or
/// FlatBuffers bytes as before layout 3) and publish it in the slot.
#[inline(never)]
fn shm_client_post(
    att: &mut Attachment,
    enc: &mut Encoder,
    req: &fixed::Request,
    record: bool,
    answer: bool,
) -> u32 {
    let mut rec = [0u8; fixed::MAX_LEN];
    let (bytes, format) = if record {
        let n = fixed::encode_request(req, &mut rec);
        (&rec[..n], FMT_FIXED)
    } else {
        let b = match req {
            fixed::Request::GetHost(g) => {
                enc.get_host_req(g.seq, g.module, g.business_priority, g.user_priority)
            }
            fixed::Request::Report(r) => enc.report_req(r),
        };
        (b, FMT_FLATBUFFERS)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    att.post(black_box(bytes), format, answer, deadline, &mut || {})
        .expect("the slot takes the request")
}

/// The client's side of reading a getHost's answer: the host it names.
#[inline(never)]
fn shm_client_wait(att: &mut Attachment, seq: u32, buf: &mut Vec<u8>) -> Option<NodeAddr> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (n, format) = att.wait(seq, deadline, buf, &mut || {}).ok()?;
    let a = if format == FMT_FIXED {
        fixed::decode_answer(&buf[..n]).ok()?
    } else {
        match decode(&buf[..n], &Limits::UDP).ok()? {
            Message::GetHostResp(r) => fixed::HostAnswer::from_resp(&r),
            _ => return None,
        }
    };
    (a.retcode == RetCode::Ok).then_some(a.host).flatten()
}

/// `shm fixed|flat`: [`SHM_N`] getHosts, each followed by a report of the
/// node it named, through one slot of a region, the shard and the client
/// in this one thread (post, sweep, read the answer): the shard's
/// instructions per request are `shm_shard`'s count / (2 × N), the
/// client's those of `shm_client_*`. `flat` sends FlatBuffers bytes (the
/// cells of layout 2), `fixed` the records of layout 3.
fn shm_main(mode: Option<&str>) -> ExitCode {
    let record = match mode {
        Some("fixed") => true,
        Some("flat") => false,
        _ => {
            eprintln!("usage: callgrind_workload shm fixed|flat");
            return ExitCode::FAILURE;
        }
    };
    let pid = std::process::id();
    let path = std::env::temp_dir().join(format!("lbagent-callgrind-shm-{pid}.0"));
    let ident = Identity {
        shard: 0,
        pid,
        boot: 1,
    };
    let region = Region::create(&path, Geometry::new(4), ident, Access::Owner)
        .expect("a region in the temporary directory");
    let mut srv = Server::new(region);
    let mut att = Attachment::attach(&path, pid).expect("a slot");
    let _ = std::fs::remove_file(&path);
    let mut shard = shard();
    let mut enc = Encoder::new();
    let mut buf = Vec::new();
    let (mut hosts, mut missing) = (0u64, 0u64);
    for i in 0..SHM_N {
        let seq = i as u32;
        let g = fixed::Request::GetHost(lbagent::wire::GetHost {
            seq,
            module: MODULE,
            business_priority: 0,
            user_priority: 0,
        });
        let s = shm_client_post(&mut att, &mut enc, &g, record, true);
        shm_shard(&mut shard, &mut srv);
        let Some(host) = shm_client_wait(&mut att, s, &mut buf) else {
            missing += 1;
            continue;
        };
        hosts += 1;
        let failed = i % FAIL_EVERY == FAIL_EVERY - 1;
        let r = fixed::Request::Report(Report {
            seq,
            module: MODULE,
            host,
            retcode: if failed { -1 } else { 0 },
            tcost_ms: 40,
            downstream_level: None,
            consumed: 0,
        });
        shm_client_post(&mut att, &mut enc, &r, record, false);
        shm_shard(&mut shard, &mut srv);
    }
    let m = &shard.metrics;
    println!(
        "callgrind workload: shm {}: {SHM_N} getHosts ({hosts} answered with a host) and reports through a slot; shm requests {}, garbage {}",
        if record { "fixed" } else { "flat" },
        srv.counts.requests,
        srv.counts.garbage,
    );
    if missing > 0
        || srv.counts.requests != 2 * SHM_N
        || srv.counts.garbage > 0
        || m.unknown_node_reports > 0
    {
        eprintln!("callgrind workload: shm: not every request was answered as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    match std::env::args().nth(1).as_deref() {
        Some("shed") => shed_main(),
        Some("shm") => shm_main(std::env::args().nth(2).as_deref()),
        _ => {
            eprintln!("usage: callgrind_workload shed | shm fixed|flat");
            ExitCode::from(2)
        }
    }
}
