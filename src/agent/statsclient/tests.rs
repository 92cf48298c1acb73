use super::*;
use lbagent_model::NodeAddr;
use lbagent_wire::FrameDecoder;

const A: ModuleId = ModuleId::new(1, 1);
const B: ModuleId = ModuleId::new(2, 1);
const C: ModuleId = ModuleId::new(3, 1);
/// A `now` well past the epoch: second 1_700_000_000.
const T0: u64 = 1_700_000_000_000;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn config() -> StatsClientConfig {
    StatsClientConfig {
        addrs: vec![addr(1), addr(2), addr(3)],
        caller: Ipv4Addr::new(10, 0, 0, 7),
        connect_timeout_ms: 100,
        ack_timeout_ms: 3000,
        backoff_initial_ms: 100,
        backoff_max_ms: 5000,
        max_modules_per_report: 2,
        max_nodes_per_report: 4,
        max_reports_in_flight: 2,
        max_queued: 6,
        flush_timeout_ms: 500,
        jitter_seed: 7,
        tls: Default::default(),
    }
}

fn node(i: u8) -> NodeCallStats {
    NodeCallStats {
        addr: NodeAddr::new(Ipv4Addr::new(10, 0, 1, i), 9000),
        succ: u32::from(i) * 10,
        err: u32::from(i),
        overloaded: i % 2 == 0,
        consumed: 0,
    }
}

fn nodes(n: u8) -> Vec<NodeCallStats> {
    (1..=n).map(node).collect()
}

fn connected(config: &StatsClientConfig, now: u64) -> StatsClientCore {
    let mut core = StatsClientCore::new(config).unwrap();
    core.poll_connect(now).unwrap();
    core.on_connected(now);
    core
}

/// A StatsReport as the reporter reads it.
#[derive(Debug, PartialEq, Eq)]
struct Report {
    seq: u64,
    caller: u32,
    time_s: u64,
    modules: Vec<(ModuleId, Vec<NodeStats>)>,
    agent_start: u64,
}

impl Report {
    fn modules(&self) -> Vec<ModuleId> {
        self.modules.iter().map(|m| m.0).collect()
    }
}

/// Every report due now, decoded.
fn transmit(core: &mut StatsClientCore, now: u64) -> Vec<Report> {
    let mut out = Vec::new();
    let n = core.poll_transmit(now, &mut out);
    let mut frames = FrameDecoder::default();
    frames.feed(&out);
    let mut reports = Vec::new();
    while let Some(frame) = frames.next_frame().unwrap() {
        let Message::StatsReport(r) = decode(frame, &Limits::TCP_FRAME).unwrap() else {
            panic!("not a StatsReport")
        };
        let modules = r.modules().unwrap_or_default().iter().map(|m| {
            let nodes = m.nodes().unwrap_or_default().iter().map(NodeStats::from);
            (ModuleId::new(m.modid(), m.cmdid()), nodes.collect())
        });
        reports.push(Report {
            seq: r.seq(),
            caller: r.caller(),
            time_s: r.time_s(),
            modules: modules.collect(),
            agent_start: r.agent_start(),
        });
    }
    assert_eq!(reports.len(), n);
    reports
}

fn seqs(reports: &[Report]) -> Vec<u64> {
    reports.iter().map(|r| r.seq).collect()
}

fn ack(core: &mut StatsClientCore, seq: u64, now: u64) -> Option<StatsClientEvent> {
    let frame = Encoder::new().stats_ack(seq).to_vec();
    core.on_frame(&frame, now).unwrap()
}

fn assert_accounted(core: &StatsClientCore) {
    let s = core.stats();
    assert_eq!(
        s.pushed,
        s.acked + s.dropped + s.rejected + s.queued + s.in_flight,
        "{s:?}"
    );
}

// --- config ---

#[test]
fn the_defaults_are_valid() {
    let c = StatsClientConfig::new(vec![addr(1)]);
    assert_eq!(c.validate(), Ok(()));
    assert_eq!(c.flush_timeout_ms, 500);
    assert_eq!(c.caller, Ipv4Addr::UNSPECIFIED);
}

#[test]
fn validation_names_the_field_and_the_range() {
    let mut c = config();
    c.addrs.clear();
    assert_eq!(c.validate(), Err(StatsConfigError::NoAddrs));
    let mut c = config();
    c.max_modules_per_report = 0;
    let err = c.validate().unwrap_err();
    assert_eq!(
        err.to_string(),
        "stats client max_modules_per_report is 0: must be 1..=65536"
    );
    let mut c = config();
    c.backoff_max_ms = 50;
    assert!(matches!(
        c.validate(),
        Err(StatsConfigError::OutOfRange {
            field: "backoff_max_ms",
            ..
        })
    ));
    for f in [
        |c: &mut StatsClientConfig| c.max_queued = 0,
        |c: &mut StatsClientConfig| c.max_reports_in_flight = 0,
        |c: &mut StatsClientConfig| c.max_nodes_per_report = MAX_NODES_PER_REPORT + 1,
        |c: &mut StatsClientConfig| c.ack_timeout_ms = 0,
    ] {
        let mut c = config();
        f(&mut c);
        assert!(StatsClientCore::new(&c).is_err());
    }
}

#[test]
fn the_largest_report_allowed_fits_a_frame() {
    let mut c = config();
    c.max_modules_per_report = MAX_MODULES_PER_REPORT;
    c.max_nodes_per_report = MAX_NODES_PER_REPORT;
    c.max_queued = MAX_MODULES_PER_REPORT;
    let mut core = connected(&c, T0);
    let per_module = (MAX_NODES_PER_REPORT / MAX_MODULES_PER_REPORT) as u8;
    for i in 0..MAX_MODULES_PER_REPORT as u32 {
        core.push(ModuleId::new(i, u32::MAX), nodes(per_module), T0);
    }
    let mut out = Vec::new();
    assert_eq!(core.poll_transmit(T0, &mut out), 1);
    assert!(
        out.len() < lbagent_wire::MAX_FRAME_LEN,
        "{} bytes",
        out.len()
    );
}

// --- batching ---

#[test]
fn nothing_is_sent_until_connected_and_then_everything_is() {
    let mut core = StatsClientCore::new(&config()).unwrap();
    core.push(A, nodes(1), T0);
    assert!(transmit(&mut core, T0).is_empty());
    assert_eq!(core.poll_connect(T0), Some(addr(1)));
    assert!(transmit(&mut core, T0).is_empty(), "connecting");
    core.on_connected(T0 + 10);
    let sent = transmit(&mut core, T0 + 10);
    assert_eq!(
        sent,
        vec![Report {
            seq: 1,
            caller: 0x0a00_0007,
            time_s: T0 / 1000,
            modules: vec![(
                A,
                vec![NodeStats {
                    addr: node(1).addr,
                    succ: 10,
                    err: 1,
                    overloaded: false
                }]
            )],
            agent_start: core.agent_start(),
        }]
    );
    assert_eq!(core.stats().sent, 1);
    assert_eq!(core.stats().in_flight, 1);
}

#[test]
fn entries_are_batched_up_to_the_module_limit_in_push_order() {
    let mut c = config();
    c.max_reports_in_flight = 10;
    let mut core = connected(&c, T0);
    for m in [A, B, C] {
        core.push(m, nodes(1), T0);
    }
    let sent = transmit(&mut core, T0);
    assert_eq!(sent.len(), 2);
    assert_eq!(
        (sent[0].modules(), sent[1].modules()),
        (vec![A, B], vec![C])
    );
    assert_eq!(seqs(&sent), vec![1, 2]);
    assert_eq!(core.stats().reports_sent, 2);
}

#[test]
fn reports_are_bounded_in_nodes_and_a_large_module_is_split() {
    let mut c = config();
    c.max_reports_in_flight = 10;
    c.max_queued = 100;
    let mut core = connected(&c, T0);
    core.push(A, nodes(3), T0);
    core.push(B, nodes(2), T0);
    core.push(C, nodes(9), T0);
    assert_eq!(core.stats().pushed, 5, "C is split into 4 + 4 + 1");
    let sent = transmit(&mut core, T0);
    let shape: Vec<Vec<(ModuleId, usize)>> = sent
        .iter()
        .map(|r| r.modules.iter().map(|(m, n)| (*m, n.len())).collect())
        .collect();
    assert_eq!(
        shape,
        vec![
            vec![(A, 3)],
            vec![(B, 2)],
            vec![(C, 4)],
            vec![(C, 4)],
            vec![(C, 1)]
        ]
    );
    let c_nodes: Vec<NodeAddr> = sent[2..]
        .iter()
        .flat_map(|r| r.modules[0].1.iter().map(|n| n.addr))
        .collect();
    let expected: Vec<NodeAddr> = nodes(9).iter().map(|n| n.addr).collect();
    assert_eq!(c_nodes, expected);
}

#[test]
fn a_report_holds_only_statistics_taken_in_the_same_second() {
    let mut c = config();
    c.max_reports_in_flight = 10;
    let mut core = connected(&c, T0);
    core.push(A, nodes(1), T0 + 100);
    core.push(B, nodes(1), T0 + 1100);
    core.push(C, nodes(1), T0 + 1999);
    let sent = transmit(&mut core, T0 + 2000);
    let got: Vec<(u64, Vec<ModuleId>)> = sent.iter().map(|r| (r.time_s, r.modules())).collect();
    let s = T0 / 1000;
    assert_eq!(got, vec![(s, vec![A]), (s + 1, vec![B, C])]);
}

#[test]
fn a_module_without_nodes_is_ignored() {
    let mut core = connected(&config(), T0);
    assert_eq!(core.push(A, Vec::new(), T0), 0);
    assert!(transmit(&mut core, T0).is_empty());
    assert_eq!(
        core.stats(),
        StatsClientStats {
            connects: 1,
            ..Default::default()
        }
    );
    assert!(core.is_drained());
}

// --- acknowledgement ---

#[test]
fn an_ack_settles_its_report_and_a_stale_one_is_counted() {
    let mut core = connected(&config(), T0);
    for m in [A, B, C] {
        core.push(m, nodes(1), T0);
    }
    let sent = transmit(&mut core, T0);
    assert_eq!(seqs(&sent), vec![1, 2]);
    assert!(
        ack(&mut core, 2, T0 + 1).is_none(),
        "acks may come in any order"
    );
    assert_eq!(core.stats().acked, 1);
    assert!(ack(&mut core, 2, T0 + 1).is_none());
    assert!(ack(&mut core, 99, T0 + 1).is_none());
    assert_eq!(core.stats().stale_acks, 2);
    ack(&mut core, 1, T0 + 2);
    let s = core.stats();
    assert_eq!((s.acked, s.reports_acked, s.in_flight), (3, 2, 0));
    assert!(core.is_drained());
    assert_accounted(&core);
}

#[test]
fn at_most_the_window_is_in_flight_and_an_ack_opens_it() {
    let mut c = config();
    c.max_modules_per_report = 1;
    c.max_queued = 100;
    let mut core = connected(&c, T0);
    for i in 0..5 {
        core.push(ModuleId::new(i, 0), nodes(1), T0);
    }
    assert_eq!(seqs(&transmit(&mut core, T0)), vec![1, 2]);
    assert!(transmit(&mut core, T0).is_empty(), "window full");
    ack(&mut core, 1, T0 + 1);
    assert_eq!(seqs(&transmit(&mut core, T0 + 1)), vec![3]);
    assert_eq!(core.stats().queued, 2);
}

// --- re-sending ---

#[test]
fn every_report_of_a_run_names_the_run_and_a_resend_names_it_again() {
    let mut core = connected(&config(), T0);
    core.push(A, nodes(1), T0);
    let first = transmit(&mut core, T0);
    let run = core.agent_start();
    assert_ne!(run, 0, "0 is an agent that predates the field");
    assert_eq!(first[0].agent_start, run);
    core.on_disconnected(T0 + 1);
    let at = core.link().next_attempt_at().unwrap();
    core.poll_connect(at).unwrap();
    core.on_connected(at);
    let again = transmit(&mut core, at);
    assert_eq!((again[0].seq, again[0].agent_start), (first[0].seq, run));
    let mut other = config();
    other.jitter_seed = 8;
    let other = StatsClientCore::new(&other).unwrap();
    assert_ne!(other.agent_start(), run, "another run, another number");
    let mut reloaded = config();
    reloaded.jitter_seed = 99;
    core.reconfigure(&reloaded).unwrap();
    assert_eq!(core.agent_start(), run, "a reload keeps the run");
}

#[test]
fn reports_in_flight_are_resent_first_and_unchanged_after_reconnecting() {
    let mut c = config();
    c.max_queued = 100;
    let mut core = connected(&c, T0);
    for m in [A, B, C] {
        core.push(m, nodes(2), T0);
    }
    let first = transmit(&mut core, T0);
    assert_eq!(seqs(&first), vec![1, 2]);
    ack(&mut core, 2, T0 + 1);
    core.push(ModuleId::new(9, 9), nodes(1), T0 + 1000);
    core.on_disconnected(T0 + 5);
    assert_eq!(core.stats().queued, 3, "report 1 (A, B) is queued again");
    assert_eq!(core.stats().in_flight, 0);
    let Wake::At(at) = core.poll_timeout(T0 + 5) else {
        panic!("no attempt scheduled")
    };
    assert_eq!(core.poll_connect(at), Some(addr(2)));
    core.on_connected(at);
    let again = transmit(&mut core, at);
    assert_eq!(again[0], first[0], "same seq, same content");
    assert_eq!(again[1].seq, 3);
    assert_eq!(again[1].modules(), vec![ModuleId::new(9, 9)]);
    let s = core.stats();
    assert_eq!((s.sent, s.resent), (6, 2), "3 first, 2 again, 1 new");
    assert_accounted(&core);
}

#[test]
fn nothing_accepted_is_lost_across_many_disconnections() {
    let mut c = config();
    c.max_queued = 1000;
    c.max_modules_per_report = 3;
    let mut core = connected(&c, T0);
    let mut now = T0;
    let mut delivered = Vec::new();
    for round in 0u32..20 {
        for i in 0..7 {
            core.push(ModuleId::new(round, i), nodes(1), now);
        }
        let sent = transmit(&mut core, now);
        // The reporter acks every other report, then the link drops.
        for r in sent.iter().step_by(2) {
            delivered.extend(r.modules());
            ack(&mut core, r.seq, now);
        }
        core.on_disconnected(now);
        now += 10_000;
        core.poll_connect(now).unwrap();
        core.on_connected(now);
    }
    while !core.is_drained() {
        for r in transmit(&mut core, now) {
            delivered.extend(r.modules());
            ack(&mut core, r.seq, now);
        }
    }
    delivered.sort();
    let mut expected: Vec<ModuleId> = (0..20)
        .flat_map(|r| (0..7).map(move |i| ModuleId::new(r, i)))
        .collect();
    expected.sort();
    assert_eq!(
        delivered, expected,
        "each once: only acked reports count here"
    );
    assert_eq!(core.stats().dropped, 0);
    assert_accounted(&core);
}

// --- the bound ---

#[test]
fn past_the_bound_the_oldest_entries_are_dropped_and_counted() {
    let mut core = StatsClientCore::new(&config()).unwrap();
    for i in 0..6 {
        assert_eq!(core.push(ModuleId::new(i, 0), nodes(1), T0), 0);
    }
    assert!(core.poll_event().is_none());
    assert_eq!(core.push(ModuleId::new(6, 0), nodes(1), T0), 1);
    assert_eq!(core.push(ModuleId::new(7, 0), nodes(1), T0), 1);
    let Some(StatsClientEvent::Dropped { entries, total }) = core.poll_event() else {
        panic!("expected a drop event")
    };
    assert_eq!((entries, total), (2, 2), "one event per burst");
    assert!(core.poll_event().is_none());
    assert_eq!(core.stats().dropped, 2);
    assert_eq!(core.stats().queued, 6);
    core.poll_connect(T0).unwrap();
    core.on_connected(T0);
    core.config.max_reports_in_flight = 10;
    let left: Vec<ModuleId> = transmit(&mut core, T0)
        .iter()
        .flat_map(Report::modules)
        .collect();
    assert_eq!(
        left,
        (2..8).map(|i| ModuleId::new(i, 0)).collect::<Vec<_>>()
    );
    assert_accounted(&core);
}

#[test]
fn requeued_reports_count_against_the_bound_and_are_the_oldest() {
    let mut core = connected(&config(), T0);
    for i in 0..4 {
        core.push(ModuleId::new(i, 0), nodes(1), T0);
    }
    let first = transmit(&mut core, T0);
    assert_eq!(seqs(&first), vec![1, 2]);
    for i in 4..10 {
        core.push(ModuleId::new(i, 0), nodes(1), T0);
    }
    assert_eq!(core.stats().dropped, 0, "in flight is bounded apart");
    core.on_disconnected(T0 + 1);
    // 4 requeued + 6 waiting = 10 > 6: the 4 oldest, report 1 and 2's, go.
    assert_eq!(core.stats().dropped, 4);
    assert!(matches!(
        core.poll_event(),
        Some(StatsClientEvent::Dropped {
            entries: 4,
            total: 4
        })
    ));
    core.poll_connect(T0 + 10_000).unwrap();
    core.on_connected(T0 + 10_000);
    let sent = transmit(&mut core, T0 + 10_000);
    assert_eq!(
        sent[0].modules(),
        vec![ModuleId::new(4, 0), ModuleId::new(5, 0)]
    );
    assert_eq!(sent[0].seq, 3);
    assert_accounted(&core);
}

#[test]
fn dropping_from_a_requeued_report_keeps_the_rest_and_its_seq() {
    let mut core = connected(&config(), T0);
    for i in 0..4 {
        core.push(ModuleId::new(i, 0), nodes(1), T0);
    }
    transmit(&mut core, T0);
    core.on_disconnected(T0);
    for i in 4..7 {
        core.push(ModuleId::new(i, 0), nodes(1), T0);
    }
    assert_eq!(core.stats().dropped, 1);
    core.poll_connect(T0 + 10_000).unwrap();
    core.on_connected(T0 + 10_000);
    let sent = transmit(&mut core, T0 + 10_000);
    assert_eq!(
        (sent[0].seq, sent[0].modules()),
        (1, vec![ModuleId::new(1, 0)])
    );
    assert_eq!((sent[1].seq, sent[1].modules().len()), (2, 2));
}

// --- frames in ---

#[test]
fn an_error_resp_drops_the_refused_report_and_is_reported() {
    let mut core = connected(&config(), T0);
    for m in [A, B, C] {
        core.push(m, nodes(1), T0);
    }
    transmit(&mut core, T0);
    let err = Encoder::new()
        .error_resp(
            1,
            ModuleId::new(0, 0),
            RetCode::BadRequest,
            "caller unknown",
        )
        .to_vec();
    let Some(StatsClientEvent::ServerError(e)) = core.on_frame(&err, T0 + 1).unwrap() else {
        panic!("expected a server error")
    };
    assert_eq!((e.seq, e.retcode, e.rejected), (1, RetCode::BadRequest, 2));
    assert_eq!(e.message, "caller unknown");
    let s = core.stats();
    assert_eq!((s.rejected, s.server_errors, s.in_flight), (2, 1, 1));
    core.on_disconnected(T0 + 2);
    assert_eq!(core.stats().queued, 1, "only report 2 is re-sent");
    assert_accounted(&core);
    let ev = StatsClientEvent::ServerError(e).to_string();
    assert!(
        ev.contains("refused report 1") && ev.contains("caller unknown"),
        "{ev}"
    );
}

#[test]
fn an_unavailable_reporter_closes_the_connection_and_its_report_is_resent() {
    let mut core = connected(&config(), T0);
    core.push(A, nodes(1), T0);
    transmit(&mut core, T0);
    let err = Encoder::new()
        .error_resp(1, ModuleId::new(0, 0), RetCode::Unavailable, "draining")
        .to_vec();
    let e = core.on_frame(&err, T0 + 1).unwrap_err();
    assert!(matches!(&e, StatsClientError::Unavailable(m) if m == "draining"));
    assert_eq!(e.to_string(), "reporter unavailable: draining");
    core.on_disconnected(T0 + 1);
    core.poll_connect(T0 + 10_000).unwrap();
    core.on_connected(T0 + 10_000);
    assert_eq!(transmit(&mut core, T0 + 10_000)[0].seq, 1);
}

#[test]
fn a_message_the_reporter_never_sends_is_an_error() {
    let mut core = connected(&config(), T0);
    let pull = Encoder::new().pull_req(1, &[A]).to_vec();
    let err = core.on_frame(&pull, T0).unwrap_err();
    assert!(matches!(err, StatsClientError::Unexpected("PullReq")));
    assert!(err.to_string().contains("unexpected PullReq"));
    let ack = Encoder::new().keep_alive_ack(1).to_vec();
    assert!(matches!(
        core.on_frame(&ack, T0),
        Err(StatsClientError::Unexpected("KeepAliveAck"))
    ));
}

#[test]
fn garbage_is_an_error_that_closes_the_connection() {
    let mut core = connected(&config(), T0);
    assert!(matches!(
        core.on_frame(b"definitely not a flatbuffer", T0),
        Err(StatsClientError::Decode(_))
    ));
    let mut frames = FrameDecoder::default();
    frames.feed(&[0, 0, 0, 0]);
    let err = StatsClientError::from(frames.next_frame().unwrap_err());
    assert!(err.to_string().starts_with("bad frame from the reporter"));
}

#[test]
fn acks_split_anywhere_across_reads_settle_their_reports() {
    let mut stream = Vec::new();
    write_frame(&mut stream, Encoder::new().stats_ack(1)).unwrap();
    write_frame(&mut stream, Encoder::new().stats_ack(2)).unwrap();
    for cut in 0..=stream.len() {
        let mut core = connected(&config(), T0);
        for m in [A, B, C] {
            core.push(m, nodes(1), T0);
        }
        transmit(&mut core, T0);
        let mut frames = FrameDecoder::default();
        for part in [&stream[..cut], &stream[cut..]] {
            frames.feed(part);
            while let Some(frame) = frames.next_frame().unwrap() {
                core.on_frame(frame, T0).unwrap();
            }
        }
        assert_eq!(core.stats().acked, 3, "cut at {cut}");
    }
}

// --- liveness ---

#[test]
fn an_idle_connection_has_no_deadline() {
    let core = connected(&config(), T0);
    assert_eq!(core.poll_timeout(T0 + 1_000_000), Wake::Never);
}

#[test]
fn an_unacknowledged_report_makes_a_silent_connection_dead() {
    let mut core = connected(&config(), T0);
    core.push(A, nodes(1), T0);
    core.push(B, nodes(1), T0);
    core.push(C, nodes(1), T0);
    transmit(&mut core, T0 + 10);
    assert_eq!(core.poll_timeout(T0 + 10), Wake::At(T0 + 3010));
    ack(&mut core, 1, T0 + 2000);
    assert_eq!(
        core.poll_timeout(T0 + 3010),
        Wake::At(T0 + 5000),
        "progress restarts the wait"
    );
    assert_eq!(core.poll_timeout(T0 + 5000), Wake::Drop);
    ack(&mut core, 2, T0 + 4000);
    assert_eq!(core.poll_timeout(T0 + 100_000), Wake::Never);
}

// --- reconnecting ---

/// The delays of `failures` consecutive failed attempts.
fn delays(config: &StatsClientConfig, failures: usize) -> Vec<u64> {
    let mut core = StatsClientCore::new(config).unwrap();
    let mut now = 0;
    (0..failures)
        .map(|_| {
            core.poll_connect(now).unwrap();
            core.on_disconnected(now);
            let Wake::At(at) = core.poll_timeout(now) else {
                panic!("no attempt scheduled")
            };
            let delay = at - now;
            now = at;
            delay
        })
        .collect()
}

#[test]
fn the_backoff_doubles_up_to_the_cap_within_its_jitter() {
    for seed in 0..200 {
        let mut c = config();
        c.jitter_seed = seed;
        for (n, delay) in delays(&c, 12).into_iter().enumerate() {
            let base = (100u64 << n).min(5000);
            assert!(
                delay <= base,
                "seed {seed} attempt {n}: {delay} ms outside [0, {base}]"
            );
        }
    }
}

#[test]
fn after_a_long_outage_the_next_attempt_is_at_most_a_second_away_by_default() {
    let defaults = StatsClientConfig::new(vec![addr(1)]);
    assert_eq!(defaults.backoff_max_ms, 1000);
    for seed in 0..200 {
        let mut c = defaults.clone();
        c.jitter_seed = seed;
        let worst = delays(&c, 40).into_iter().max().unwrap();
        assert!(worst <= 1000, "seed {seed}: {worst} ms");
    }
}

#[test]
fn the_jitter_is_seeded() {
    let c = config();
    assert_eq!(delays(&c, 8), delays(&c, 8));
    let mut other = config();
    other.jitter_seed = 8;
    assert_ne!(delays(&c, 8), delays(&other, 8));
}

#[test]
fn an_acknowledging_reporter_resets_the_backoff() {
    let mut core = StatsClientCore::new(&config()).unwrap();
    let mut now = 0;
    for _ in 0..6 {
        core.poll_connect(now).unwrap();
        core.on_disconnected(now);
        now += 10_000;
    }
    core.poll_connect(now).unwrap();
    core.on_connected(now);
    core.push(A, nodes(1), now);
    transmit(&mut core, now);
    ack(&mut core, 1, now);
    core.on_disconnected(now);
    let Wake::At(at) = core.poll_timeout(now) else {
        panic!()
    };
    assert!(at - now <= 100, "back to the initial delay: {}", at - now);
}

#[test]
fn attempts_fail_over_through_the_addresses_and_wrap() {
    let mut core = StatsClientCore::new(&config()).unwrap();
    let mut tried = Vec::new();
    let mut now = 0;
    for _ in 0..7 {
        tried.push(core.poll_connect(now).unwrap());
        core.on_disconnected(now);
        now += 10_000;
    }
    let (a, b, c) = (addr(1), addr(2), addr(3));
    assert_eq!(tried, vec![a, b, c, a, b, c, a]);
}

#[test]
fn a_reloaded_reporter_list_keeps_what_is_queued_and_is_used_from_the_next_attempt() {
    let mut core = connected(&config(), T0);
    core.push(A, nodes(2), T0);
    let mut c = config();
    c.addrs = vec![addr(9)];
    core.reconfigure(&c).unwrap();
    assert_eq!(core.link().connected(), Some(addr(1)), "kept");
    core.on_disconnected(T0 + 1);
    let Wake::At(at) = core.poll_timeout(T0 + 1) else {
        panic!()
    };
    assert_eq!(core.poll_connect(at), Some(addr(9)));
    core.on_connected(at);
    assert_eq!(
        transmit(&mut core, at).len(),
        1,
        "the queued statistics go out"
    );
    let mut bad = config();
    bad.addrs.clear();
    assert!(core.reconfigure(&bad).is_err());
    assert_accounted(&core);
}

#[test]
fn a_lost_connection_moves_to_the_next_address() {
    let mut core = connected(&config(), 0);
    assert_eq!(core.link().connected(), Some(addr(1)));
    core.on_disconnected(5);
    assert_eq!(core.link().connected(), None);
    assert_eq!(core.link().current_addr(), addr(2));
    let s = core.stats();
    assert_eq!((s.connects, s.disconnects), (1, 1));
}

// --- flushing ---

#[test]
fn a_flush_makes_an_attempt_due_now_and_lifts_the_window() {
    let mut core = StatsClientCore::new(&config()).unwrap();
    core.poll_connect(0).unwrap();
    core.on_disconnected(0);
    for i in 0..6 {
        core.push(ModuleId::new(i, 0), nodes(1), T0);
    }
    assert_eq!(core.poll_connect(1), None, "backing off");
    core.start_flush(1);
    assert_eq!(core.poll_connect(1), Some(addr(2)));
    core.on_connected(1);
    assert_eq!(transmit(&mut core, 1).len(), 3, "past the window of 2");
    for seq in 1..=3 {
        ack(&mut core, seq, 2);
    }
    assert!(core.is_drained());
}

// --- accounting ---

#[test]
fn every_entry_is_accounted_for_whatever_happens() {
    for seed in 0..50 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut core = StatsClientCore::new(&config()).unwrap();
        let mut sent = Vec::new();
        for step in 0..300u64 {
            let now = T0 + step * 700;
            match rng.u8(0..8) {
                0..=2 => {
                    core.push(ModuleId::new(rng.u32(..), 0), nodes(rng.u8(0..7)), now);
                }
                3 => {
                    if core.poll_connect(now).is_some() {
                        core.on_connected(now);
                    }
                }
                4 => {
                    if core.link().connected().is_some() {
                        core.on_disconnected(now);
                    }
                }
                5 => sent.extend(seqs(&transmit(&mut core, now))),
                6 if !sent.is_empty() => {
                    let seq = sent.swap_remove(rng.usize(..sent.len()));
                    ack(&mut core, seq, now);
                }
                _ => {
                    let seq = rng.u64(0..core.next_seq + 1);
                    let frame = Encoder::new()
                        .error_resp(seq, A, RetCode::BadRequest, "no")
                        .to_vec();
                    if core.link().connected().is_some() {
                        core.on_frame(&frame, now).unwrap();
                    }
                }
            }
            assert_accounted(&core);
            assert!(core.stats().queued <= 6);
            assert!(core.in_flight.len() <= 2);
        }
    }
}
