//! The fixed in-process workload whose instruction count `perf/check`
//! compares with `perf/callgrind.baseline` under `valgrind --tool=callgrind`.
//!
//! What it runs is what an agent shard runs per datagram, minus the system
//! calls: [`ShardCore::handle`] on a received getHost or report — verify and
//! decode the buffer, validate it, the LB decision (round robin over the
//! idle list; for a report, the node's counts and state), encode the
//! answer — a million getHosts and a million reports by default, interleaved
//! as qpstest sends them, on one 10-node module. One report in 23 is a
//! failure (spread over the nodes, too few to overload any), and the clock
//! advances 1 ms every 1000 requests, all fixed: the count is the same on
//! every run of the same binary.
//!
//! Only [`workload`] is counted (`--toggle-collect`): building the requests
//! and checking the answers are not. The program checks that every getHost
//! was answered with a host and every report absorbed, and exits non-zero
//! otherwise, so that a broken build cannot pass for a fast one.
//!
//! Run: `target/release/examples/callgrind_workload [N]` (N of each, default
//! 1000000); under callgrind: `perf/check --callgrind-only`.

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::ExitCode;

use lbagent::agent::messages::ToShard;
use lbagent::agent::shard::{ShardCore, ShardSetup};
use lbagent::config::Config;
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::wire::{decode, Encoder, Limits, Message, Report, RetCode};

/// The module: shard 0 of 1 owns every module.
const MODULE: ModuleId = ModuleId::new(10_000, 1);
const NODES: u8 = 10;
const PEER: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40_000));
/// One report in this many is a failure.
const FAIL_EVERY: u64 = 23;

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 8080)
}

/// The pre-encoded datagrams: one getHost, and per node a success and a
/// failure report.
struct Requests {
    get_host: Vec<u8>,
    /// `reports[2 * node + failed]`.
    reports: Vec<Vec<u8>>,
}

fn requests() -> Requests {
    let mut enc = Encoder::new();
    let get_host = enc.get_host_req(1, MODULE, 0, 0).to_vec();
    let mut reports = Vec::new();
    for i in 1..=NODES {
        for retcode in [0, -1] {
            reports.push(
                enc.report_req(&Report {
                    seq: 2,
                    module: MODULE,
                    host: node(i),
                    retcode,
                    tcost_ms: 40,
                    downstream_level: None,
                })
                .to_vec(),
            );
        }
    }
    Requests { get_host, reports }
}

fn shard() -> ShardCore {
    let config = Config::default();
    let mut shard = ShardCore::new(ShardSetup {
        params: config.lb.params(),
        update_timeout_ms: config.lb.update_timeout * 1000,
        report_timeout_ms: config.lb.report_timeout * 1000,
        ..ShardSetup::new(0, 1, 8888)
    });
    let released = shard.apply(
        ToShard::Route {
            module: MODULE,
            exists: true,
            version: 1,
            nodes: (1..=NODES)
                .map(|i| RouteNode {
                    addr: node(i),
                    weight: 1,
                })
                .collect(),
        },
        0,
    );
    assert!(released.is_empty());
    shard
}

/// What the workload saw.
#[derive(Debug, Default)]
struct Seen {
    answers: u64,
    answer_bytes: u64,
    silent_reports: u64,
    last_answer: Vec<u8>,
}

/// The counted part: `n` getHosts, each followed by a report of the node
/// the round robin will have given (the shard's answer is not decoded here:
/// a client's work is not the agent's).
#[inline(never)]
fn workload(shard: &mut ShardCore, reqs: &Requests, n: u64) -> Seen {
    let mut seen = Seen::default();
    for i in 0..n {
        let now = i / 1000;
        if let Some(answer) = shard.handle(black_box(&reqs.get_host), PEER, now) {
            seen.answers += 1;
            seen.answer_bytes += answer.len() as u64;
        }
        let which = (i % u64::from(NODES)) as usize;
        let failed = usize::from(i % FAIL_EVERY == FAIL_EVERY - 1);
        let report = &reqs.reports[2 * which + failed];
        if shard.handle(black_box(report), PEER, now).is_none() {
            seen.silent_reports += 1;
        }
        if !shard.outbox.is_empty() {
            shard.outbox.clear();
        }
    }
    if let Some(answer) = shard.handle(&reqs.get_host, PEER, n / 1000) {
        seen.last_answer = answer.to_vec();
    }
    seen
}

fn main() -> ExitCode {
    let n: u64 = match std::env::args().nth(1).map(|s| s.parse()) {
        None => 1_000_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: callgrind_workload [N > 0 getHosts and N reports]");
            return ExitCode::from(2);
        }
    };
    let reqs = requests();
    let mut shard = shard();
    let seen = workload(&mut shard, &reqs, n);
    let host = match decode(&seen.last_answer, &Limits::UDP) {
        Ok(Message::GetHostResp(r)) if r.retcode() == RetCode::Ok => r.host().map(NodeAddr::from),
        _ => None,
    };
    println!(
        "callgrind workload: {n} getHosts ({} answered, {} bytes), {n} reports ({} absorbed); last host {}",
        seen.answers,
        seen.answer_bytes,
        seen.silent_reports,
        host.map_or("none".to_string(), |h| h.to_string())
    );
    if seen.answers != n || seen.silent_reports != n || host.is_none() {
        eprintln!("callgrind workload: the shard did not answer as expected: the count would mean nothing");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
