use super::*;
use lbagent_model::NodeAddr;
use lbagent_wire::FrameDecoder;
use std::net::Ipv4Addr;

const A: ModuleId = ModuleId::new(1, 1);
const B: ModuleId = ModuleId::new(2, 1);
const C: ModuleId = ModuleId::new(3, 1);

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn config() -> RouteClientConfig {
    RouteClientConfig {
        addrs: vec![addr(1), addr(2), addr(3)],
        connect_timeout_ms: 100,
        keepalive_ms: 1000,
        idle_timeout_ms: 3000,
        backoff_initial_ms: 100,
        backoff_max_ms: 5000,
        max_modules_per_pull: 2,
        refresh_ms: 0,
        jitter_seed: 7,
        tls: Default::default(),
    }
}

fn node(last: u8) -> RouteNode {
    RouteNode {
        addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), 9000),
        weight: u32::from(last),
    }
}

/// A core connected at `now`.
fn connected(config: &RouteClientConfig, now: u64) -> RouteClientCore {
    let mut core = RouteClientCore::new(config).unwrap();
    assert!(core.poll_connect(now).is_some());
    core.on_connected(now);
    core
}

/// What the core sent: (seq, modules) per PullReq, seq per KeepAlive.
#[derive(Debug, Default, PartialEq)]
struct Sent {
    pulls: Vec<(u64, Vec<ModuleId>)>,
    keepalives: Vec<u64>,
    /// The versions each PullReq carried, one per module.
    known: Vec<Vec<u64>>,
}

fn transmit(core: &mut RouteClientCore, now: u64) -> Sent {
    let mut out = Vec::new();
    let count = core.poll_transmit(now, &mut out);
    let mut frames = FrameDecoder::default();
    frames.feed(&out);
    let mut sent = Sent::default();
    while let Some(frame) = frames.next_frame().unwrap() {
        match decode(frame, &Limits::TCP_FRAME).unwrap() {
            Message::PullReq(m) => {
                let p = m.validate().unwrap();
                sent.pulls.push((p.seq, p.modules().collect()));
                assert!(p.carries_versions(), "every pull carries versions");
                sent.known
                    .push(p.modules_known().map(|(_, v)| v.unwrap()).collect());
            }
            Message::KeepAlive(m) => sent.keepalives.push(m.seq()),
            other => panic!("the client sent {}", other.name()),
        }
    }
    assert_eq!(count, sent.pulls.len() + sent.keepalives.len());
    sent
}

fn answer(seq: u64, module: ModuleId, version: u64, nodes: &[RouteNode]) -> Vec<u8> {
    Encoder::new()
        .route_answer(seq, module, !nodes.is_empty(), version, nodes)
        .to_vec()
}

fn route(event: Option<RouteClientEvent>) -> RouteEvent {
    match event {
        Some(RouteClientEvent::Route(r)) => r,
        other => panic!("expected a route, got {other:?}"),
    }
}

// --- config ---

#[test]
fn the_defaults_are_valid() {
    RouteClientConfig::new(vec![addr(1)]).validate().unwrap();
}

#[test]
fn a_config_without_addresses_or_with_a_bad_range_is_refused() {
    let mut c = config();
    c.addrs.clear();
    assert_eq!(c.validate(), Err(RouteConfigError::NoAddrs));
    let mut c = config();
    c.idle_timeout_ms = c.keepalive_ms;
    assert!(matches!(
        c.validate(),
        Err(RouteConfigError::OutOfRange {
            field: "idle_timeout_ms",
            ..
        })
    ));
    let mut c = config();
    c.backoff_max_ms = c.backoff_initial_ms - 1;
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("backoff_max_ms"));
    let mut c = config();
    c.max_modules_per_pull = MAX_PULL_MODULES + 1;
    assert!(RouteClientCore::new(&c).is_err());
}

// --- pulls ---

#[test]
fn a_module_wanted_twice_is_pulled_once() {
    let mut core = connected(&config(), 0);
    assert!(core.want(A));
    assert!(!core.want(A), "queued: not wanted again");
    let sent = transmit(&mut core, 0);
    assert_eq!(sent.pulls, vec![(1, vec![A])]);
    assert!(core.is_in_flight(A));
    assert!(!core.want(A), "in flight: not re-sent");
    assert_eq!(transmit(&mut core, 1), Sent::default());
}

#[test]
fn an_answered_module_can_be_pulled_again() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    route(core.on_frame(&answer(1, A, 3, &[node(1)]), 5).unwrap());
    assert!(!core.is_pending(A));
    assert!(core.want(A));
    assert_eq!(transmit(&mut core, 6).pulls, vec![(2, vec![A])]);
}

#[test]
fn wanted_modules_are_batched_up_to_the_limit() {
    let mut core = connected(&config(), 0);
    for m in [A, B, C] {
        core.want(m);
    }
    let sent = transmit(&mut core, 0);
    assert_eq!(sent.pulls, vec![(1, vec![A, B]), (2, vec![C])]);
    assert_eq!(core.stats().pull_reqs, 2);
    assert_eq!(core.stats().modules_pulled, 3);
}

#[test]
fn nothing_is_sent_until_connected_and_then_every_want_is() {
    let mut core = RouteClientCore::new(&config()).unwrap();
    core.want(A);
    core.want(B);
    assert_eq!(transmit(&mut core, 0), Sent::default());
    assert_eq!(core.poll_connect(0), Some(addr(1)));
    assert_eq!(transmit(&mut core, 0), Sent::default(), "connecting");
    core.on_connected(10);
    assert_eq!(transmit(&mut core, 10).pulls, vec![(1, vec![A, B])]);
}

#[test]
fn pulls_in_flight_are_reissued_on_the_next_connection() {
    let mut core = connected(&config(), 0);
    core.want(A);
    core.want(B);
    transmit(&mut core, 0);
    core.want(C);
    core.on_disconnected(100);
    assert!(core.is_pending(A) && !core.is_in_flight(A));
    let at = match core.poll_timeout(100) {
        Wake::At(at) => at,
        other => panic!("{other:?}"),
    };
    assert_eq!(core.poll_connect(at - 1), None);
    assert_eq!(core.poll_connect(at), Some(addr(2)));
    core.on_connected(at);
    let sent = transmit(&mut core, at);
    assert_eq!(sent.pulls, vec![(2, vec![A, B]), (3, vec![C])]);
    // The old connection's answer can no longer arrive; one that did
    // would be stale.
    assert_eq!(
        core.on_frame(&answer(1, A, 1, &[node(1)]), at)
            .unwrap()
            .map(|_| ()),
        None
    );
    assert_eq!(core.stats().stale_answers, 1);
    assert!(route(core.on_frame(&answer(2, A, 1, &[node(1)]), at).unwrap()).module == A);
}

#[test]
fn subscribed_modules_are_pulled_again_after_reconnecting() {
    let mut core = connected(&config(), 0);
    core.want(A);
    core.want(B);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 1, &[node(1)]), 1).unwrap();
    core.on_frame(&answer(1, B, 1, &[node(2)]), 1).unwrap();
    core.forget(B);
    core.on_disconnected(2);
    core.poll_connect(1_000).unwrap();
    core.on_connected(1_000);
    assert_eq!(transmit(&mut core, 1_000).pulls, vec![(2, vec![A])]);
}

#[test]
fn forgetting_a_pull_in_flight_leaves_nothing_waiting() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    assert!(core.forget(A));
    assert!(!core.is_pending(A));
    assert_eq!(core.poll_timeout(10), Wake::At(1000), "no idle deadline");
    assert!(core.on_frame(&answer(1, A, 1, &[]), 11).unwrap().is_none());
}

// --- versions and re-pulls ---

fn unchanged(seq: u64, modules: &[(ModuleId, u64)]) -> Vec<u8> {
    let (m, v): (Vec<ModuleId>, Vec<u64>) = modules.iter().copied().unzip();
    Encoder::new().route_unchanged(seq, &m, &v).to_vec()
}

fn refreshing(refresh_ms: u64) -> RouteClientConfig {
    let mut c = config();
    c.refresh_ms = refresh_ms;
    c.keepalive_ms = 1_000_000;
    c.idle_timeout_ms = 2_000_000;
    c.max_modules_per_pull = 1024;
    c
}

#[test]
fn a_pull_carries_the_version_held_and_zero_for_none() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 1).unwrap();
    assert_eq!(core.held_version(A), 3);
    core.want(A);
    core.want(B);
    let sent = transmit(&mut core, 2);
    assert_eq!(sent.pulls, vec![(2, vec![A, B])]);
    assert_eq!(sent.known, vec![vec![3, 0]]);
}

#[test]
fn a_push_raises_the_version_a_later_pull_carries() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 1).unwrap();
    let push = Encoder::new().route_push(A, true, 9, &[node(2)]).to_vec();
    core.on_frame(&push, 2).unwrap();
    // An older push (reordered) does not lower it.
    let old = Encoder::new().route_push(A, true, 4, &[node(2)]).to_vec();
    core.on_frame(&old, 3).unwrap();
    core.want(A);
    assert_eq!(transmit(&mut core, 4).known, vec![vec![9]]);
}

#[test]
fn a_snapshot_route_is_pulled_with_its_version() {
    let mut core = connected(&config(), 0);
    assert!(core.want_known(A, 42));
    assert!(!core.want_known(A, 43), "queued: not wanted again");
    assert_eq!(transmit(&mut core, 0).known, vec![vec![43]]);
}

#[test]
fn an_unchanged_answer_settles_the_pull_with_no_event_and_no_nodes() {
    let mut core = connected(&config(), 0);
    core.want_known(A, 5);
    core.want_known(B, 6);
    transmit(&mut core, 0);
    let got = core.on_frame(&unchanged(1, &[(A, 5), (B, 6)]), 1).unwrap();
    assert!(got.is_none(), "the caller already holds these routes");
    assert!(!core.is_pending(A) && !core.is_pending(B));
    assert!(
        core.follows(A) && core.follows(B),
        "subscribed as any answer"
    );
    let st = core.stats();
    assert_eq!((st.unchanged, st.nodes_received, st.answers), (2, 0, 0));
    assert_eq!(core.poll_timeout(2), Wake::At(1000), "nothing awaited");
    // Subscribed: pulled again after reconnecting, with the versions.
    core.on_disconnected(3);
    core.poll_connect(10_000).unwrap();
    core.on_connected(10_000);
    assert_eq!(transmit(&mut core, 10_000).known, vec![vec![5, 6]]);
}

#[test]
fn an_unchanged_answer_for_no_pull_in_flight_is_stale() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    assert!(core
        .on_frame(&unchanged(7, &[(A, 1)]), 1)
        .unwrap()
        .is_none());
    assert!(core.is_in_flight(A));
    assert_eq!(core.stats().stale_answers, 1);
    assert_eq!(core.stats().unchanged, 0);
}

#[test]
fn an_unchanged_answer_with_a_version_per_module_missing_closes_the_connection() {
    let mut fbb = flatbuffers::FlatBufferBuilder::new();
    let modules = fbb.create_vector(&[lbagent_wire::fb::ModuleId::from(A)]);
    let args = lbagent_wire::fb::RouteUnchangedArgs {
        seq: 1,
        modules: Some(modules),
        versions: None,
    };
    let body = lbagent_wire::fb::RouteUnchanged::create(&mut fbb, &args).as_union_value();
    let env = lbagent_wire::fb::Envelope::create(
        &mut fbb,
        &lbagent_wire::fb::EnvelopeArgs {
            body_type: lbagent_wire::fb::Body::RouteUnchanged,
            body: Some(body),
        },
    );
    lbagent_wire::fb::finish_envelope_buffer(&mut fbb, env);
    let mut core = connected(&config(), 0);
    let err = core.on_frame(fbb.finished_data(), 0).unwrap_err();
    assert!(matches!(err, RouteClientError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("one version per module"));
}

#[test]
fn an_answered_module_is_pulled_again_with_its_version_within_the_refresh_period() {
    let mut core = connected(&refreshing(10_000), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 100).unwrap();
    let at = core.refresh_due(A).expect("scheduled");
    assert!((7_600..=10_100).contains(&at), "{at}");
    assert_eq!(at % REFRESH_TICK_MS, 0, "on a tick");
    assert_eq!(core.poll_timeout(100), Wake::At(at));
    assert_eq!(transmit(&mut core, at - 1), Sent::default());
    let sent = transmit(&mut core, at);
    assert_eq!(sent.pulls, vec![(2, vec![A])]);
    assert_eq!(sent.known, vec![vec![3]]);
    assert_eq!(core.stats().refreshes, 1);
    assert_eq!(core.refresh_due(A), None, "in flight");
    // Confirmed unchanged: the next round is scheduled from then.
    core.on_frame(&unchanged(2, &[(A, 3)]), at + 5).unwrap();
    let next = core.refresh_due(A).unwrap();
    assert!(next >= at + 7_500 && next <= at + 10_250, "{next}");
}

#[test]
fn modules_due_in_the_same_tick_share_one_pull() {
    let mut core = connected(&refreshing(10_000), 0);
    let modules: Vec<ModuleId> = (0..200).map(|i| ModuleId::new(i, 0)).collect();
    for &m in &modules {
        core.want(m);
    }
    transmit(&mut core, 0);
    for &m in &modules {
        core.on_frame(&answer(1, m, 1, &[node(1)]), 0).unwrap();
    }
    let mut ticks = BTreeMap::<u64, usize>::new();
    for &m in &modules {
        *ticks.entry(core.refresh_due(m).unwrap()).or_default() += 1;
    }
    let (&first, &n) = ticks.iter().next().unwrap();
    let sent = transmit(&mut core, first);
    assert_eq!(sent.pulls.len(), 1, "one PullReq for the whole tick");
    assert_eq!(sent.pulls[0].1.len(), n);
    assert!(sent.known[0].iter().all(|&v| v == 1));
}

#[test]
fn modules_answered_together_are_re_pulled_spread_over_the_period() {
    // 10,000 modules answered in the same millisecond: their re-pulls
    // spread over the last quarter of the period, not one burst, and
    // every re-pull of a module answered unchanged drifts further.
    let mut core = connected(&refreshing(15_000), 0);
    let modules: Vec<ModuleId> = (0..10_000).map(|i| ModuleId::new(i, 0)).collect();
    for &m in &modules {
        core.want(m);
    }
    let mut out = Vec::new();
    core.poll_transmit(0, &mut out);
    for (seq, chunk) in (1..).zip(modules.chunks(1024)) {
        let pairs: Vec<(ModuleId, u64)> = chunk.iter().map(|&m| (m, 1)).collect();
        core.on_frame(&unchanged(seq, &pairs), 0).unwrap();
    }
    let mut ticks = BTreeMap::<u64, usize>::new();
    for &m in &modules {
        let at = core.refresh_due(m).unwrap();
        assert!((11_250..=15_000).contains(&at), "{at}");
        *ticks.entry(at).or_default() += 1;
    }
    assert!(ticks.len() >= 15, "{} ticks", ticks.len());
    let busiest = ticks.values().max().unwrap();
    assert!(*busiest < 1_500, "the busiest tick holds {busiest}");
}

#[test]
fn no_re_pull_while_disconnected_and_every_module_once_on_reconnecting() {
    let mut core = connected(&refreshing(10_000), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
    core.on_disconnected(1);
    assert!(
        matches!(core.poll_timeout(1), Wake::At(t) if t < 10_000),
        "the next attempt, not the re-pull"
    );
    core.poll_connect(50_000).unwrap();
    core.on_connected(50_000);
    let sent = transmit(&mut core, 50_000);
    assert_eq!(
        sent.pulls,
        vec![(2, vec![A])],
        "once, not once more for the refresh"
    );
    assert_eq!(core.stats().refreshes, 0);
    assert_eq!(transmit(&mut core, 50_001), Sent::default());
}

#[test]
fn a_forgotten_module_is_not_re_pulled() {
    let mut core = connected(&refreshing(10_000), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
    let at = core.refresh_due(A).unwrap();
    core.forget(A);
    let (_, pulls) = unsubscribed(&mut core, at);
    assert!(pulls.is_empty());
    assert_eq!(core.held_version(A), 0);
}

#[test]
fn a_refused_re_pull_is_tried_again_next_round() {
    let mut core = connected(&refreshing(10_000), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
    let at = core.refresh_due(A).unwrap();
    transmit(&mut core, at);
    let err = Encoder::new()
        .error_resp(2, A, RetCode::Unavailable, "busy")
        .to_vec();
    core.on_frame(&err, at + 1).unwrap();
    assert!(!core.is_pending(A));
    assert!(core.refresh_due(A).unwrap() > at);
}

#[test]
fn refresh_off_schedules_nothing() {
    let mut core = connected(&refreshing(0), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
    assert_eq!(core.refresh_due(A), None);
    assert_eq!(core.poll_timeout(1), Wake::At(1_000_000));
}

// --- frames in ---

#[test]
fn an_answer_becomes_a_route_event() {
    let mut core = connected(&config(), 0);
    core.want(A);
    core.want(B);
    transmit(&mut core, 0);
    let r = route(
        core.on_frame(&answer(1, A, 9, &[node(1), node(2)]), 5)
            .unwrap(),
    );
    assert_eq!(
        r,
        RouteEvent {
            module: A,
            exists: true,
            version: 9,
            nodes: vec![node(1), node(2)],
            pushed: false,
            policy: Policy::L5,
            options: Default::default(),
            meta: Vec::new(),
        }
    );
    let r = route(core.on_frame(&answer(1, B, 0, &[]), 5).unwrap());
    assert!(!r.exists && r.nodes.is_empty());
    assert_eq!(core.stats().answers, 2);
}

#[test]
fn a_push_arrives_unasked_for_a_subscribed_module_and_settles_a_pull_in_flight() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 0).unwrap();
    let push = Encoder::new().route_push(A, true, 4, &[node(3)]).to_vec();
    let r = route(core.on_frame(&push, 1).unwrap());
    assert!(r.pushed && r.version == 4 && r.nodes == vec![node(3)]);

    core.want(B);
    transmit(&mut core, 2);
    let push = Encoder::new().route_push(B, false, 5, &[]).to_vec();
    let r = route(core.on_frame(&push, 3).unwrap());
    assert!(r.pushed && !r.exists);
    assert!(!core.is_pending(B));
    assert!(
        core.on_frame(&answer(2, B, 5, &[]), 4).unwrap().is_none(),
        "stale"
    );
    assert_eq!(core.poll_timeout(4), Wake::At(1000), "nothing awaited");
}

#[test]
fn a_push_for_a_module_not_followed_is_dropped() {
    let mut core = connected(&config(), 0);
    let push = Encoder::new().route_push(C, true, 4, &[node(3)]).to_vec();
    assert!(core.on_frame(&push, 1).unwrap().is_none());
    assert_eq!(core.stats().stale_answers, 1);
}

fn unsubscribed(core: &mut RouteClientCore, now: u64) -> (Vec<ModuleId>, Vec<u64>) {
    let mut out = Vec::new();
    core.poll_transmit(now, &mut out);
    let mut frames = FrameDecoder::default();
    frames.feed(&out);
    let (mut gone, mut pulls) = (Vec::new(), Vec::new());
    while let Some(frame) = frames.next_frame().unwrap() {
        match decode(frame, &Limits::TCP_FRAME).unwrap() {
            Message::Unsubscribe(m) => gone.extend(
                m.modules()
                    .unwrap()
                    .iter()
                    .map(|m| ModuleId::new(m.modid(), m.cmdid())),
            ),
            Message::PullReq(m) => pulls.push(m.seq()),
            _ => {}
        }
    }
    (gone, pulls)
}

#[test]
fn forgetting_a_subscribed_module_unsubscribes_it_before_any_new_pull() {
    let mut core = connected(&config(), 0);
    core.want(A);
    core.want(B);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 1, &[node(1)]), 1).unwrap();
    // A answered (subscribed), B in flight (the server subscribed it).
    core.forget(A);
    core.forget(B);
    // A wanted again at once: the Unsubscribe goes first.
    core.want(A);
    let (gone, pulls) = unsubscribed(&mut core, 2);
    assert_eq!(gone, vec![A, B]);
    assert_eq!(pulls.len(), 1);
    assert_eq!(core.stats().unsubscribed, 2);
    // A push for B, sent before the server read the Unsubscribe: dropped.
    let push = Encoder::new().route_push(B, true, 2, &[node(2)]).to_vec();
    assert!(core.on_frame(&push, 3).unwrap().is_none());
}

#[test]
fn a_module_forgotten_while_disconnected_is_neither_unsubscribed_nor_pulled_again() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 1, &[node(1)]), 1).unwrap();
    core.on_disconnected(2);
    core.forget(A);
    core.poll_connect(10_000).unwrap();
    core.on_connected(10_000);
    let (gone, pulls) = unsubscribed(&mut core, 10_000);
    assert!(gone.is_empty() && pulls.is_empty());
}

#[test]
fn an_error_resp_drops_the_refused_pull_and_is_reported() {
    let mut core = connected(&config(), 0);
    core.want(A);
    core.want(B);
    transmit(&mut core, 0);
    let err = Encoder::new()
        .error_resp(
            1,
            ModuleId::new(0, 0),
            RetCode::BadRequest,
            "too many modules",
        )
        .to_vec();
    let Some(RouteClientEvent::ServerError(e)) = core.on_frame(&err, 1).unwrap() else {
        panic!("expected a server error")
    };
    assert_eq!((e.seq, e.retcode), (1, RetCode::BadRequest));
    assert_eq!(e.message, "too many modules");
    assert_eq!(e.dropped, vec![A, B]);
    assert!(!core.is_pending(A) && core.want(A));
}

#[test]
fn many_frames_in_one_read_all_come_out() {
    let mut core = connected(&config(), 0);
    for m in [A, B, C] {
        core.want(m);
    }
    transmit(&mut core, 0);
    let mut stream = Vec::new();
    write_frame(&mut stream, &answer(1, A, 1, &[node(1)])).unwrap();
    write_frame(&mut stream, &answer(1, B, 2, &[node(2)])).unwrap();
    write_frame(&mut stream, Encoder::new().keep_alive_ack(99)).unwrap();
    write_frame(&mut stream, &answer(2, C, 3, &[node(3)])).unwrap();
    let mut frames = FrameDecoder::default();
    frames.feed(&stream);
    let mut got = Vec::new();
    while let Some(frame) = frames.next_frame().unwrap() {
        if let Some(ev) = core.on_frame(frame, 1).unwrap() {
            got.push(route(Some(ev)).module);
        }
    }
    assert_eq!(got, vec![A, B, C]);
    assert_eq!(frames.buffered(), 0);
}

#[test]
fn a_frame_split_anywhere_across_reads_comes_out_once() {
    let mut stream = Vec::new();
    write_frame(&mut stream, &answer(1, A, 1, &[node(1)])).unwrap();
    write_frame(&mut stream, &answer(1, B, 2, &[node(2), node(4)])).unwrap();
    for cut in 0..=stream.len() {
        let mut core = connected(&config(), 0);
        core.want(A);
        core.want(B);
        transmit(&mut core, 0);
        let mut frames = FrameDecoder::default();
        let mut got = Vec::new();
        for part in [&stream[..cut], &stream[cut..]] {
            frames.feed(part);
            while let Some(frame) = frames.next_frame().unwrap() {
                got.push(route(core.on_frame(frame, 1).unwrap()).version);
            }
        }
        assert_eq!(got, vec![1, 2], "cut at {cut}");
    }
}

#[test]
fn garbage_is_an_error_that_closes_the_connection() {
    let mut core = connected(&config(), 0);
    assert!(matches!(
        core.on_frame(b"definitely not a flatbuffer", 0),
        Err(RouteClientError::Decode(_))
    ));
    assert!(matches!(
        core.on_frame(&[], 0),
        Err(RouteClientError::Decode(_))
    ));
    let mut frames = FrameDecoder::default();
    frames.feed(&[0, 0, 0, 0]);
    let err = RouteClientError::from(frames.next_frame().unwrap_err());
    assert!(err
        .to_string()
        .starts_with("bad frame from the route server"));
}

#[test]
fn a_message_the_server_never_sends_is_an_error() {
    let mut core = connected(&config(), 0);
    let pull = Encoder::new().pull_req(1, &[A]).to_vec();
    let err = core.on_frame(&pull, 0).unwrap_err();
    assert!(matches!(err, RouteClientError::Unexpected("PullReq")));
    assert!(err.to_string().contains("unexpected PullReq"));
}

// --- liveness ---

#[test]
fn keepalives_are_sent_every_interval_while_connected() {
    let mut core = connected(&config(), 0);
    assert!(transmit(&mut core, 999).keepalives.is_empty());
    assert_eq!(transmit(&mut core, 1000).keepalives, vec![1]);
    assert!(transmit(&mut core, 1500).keepalives.is_empty());
    let ack = Encoder::new().keep_alive_ack(1).to_vec();
    assert!(core.on_frame(&ack, 1500).unwrap().is_none());
    assert_eq!(transmit(&mut core, 2000).keepalives, vec![2]);
    assert_eq!(core.stats().keepalive_acks, 1);
    core.on_disconnected(2100);
    assert_eq!(core.poll_transmit(5000, &mut Vec::new()), 0);
}

#[test]
fn an_unanswered_keepalive_makes_the_connection_dead_after_the_idle_timeout() {
    let mut core = connected(&config(), 0);
    transmit(&mut core, 1000);
    assert_eq!(core.poll_timeout(1000), Wake::At(2000));
    transmit(&mut core, 2000);
    transmit(&mut core, 3000);
    assert_eq!(core.poll_timeout(3999), Wake::At(4000));
    assert_eq!(core.poll_timeout(4000), Wake::Drop);
}

#[test]
fn an_answered_connection_stays_alive() {
    let mut core = connected(&config(), 0);
    for t in (1000..20_000).step_by(1000) {
        let sent = transmit(&mut core, t);
        let ack = Encoder::new().keep_alive_ack(sent.keepalives[0]).to_vec();
        core.on_frame(&ack, t + 10).unwrap();
        assert_ne!(core.poll_timeout(t + 999), Wake::Drop);
    }
}

#[test]
fn idleness_counts_from_the_request_not_from_the_last_frame() {
    let mut config = config();
    config.keepalive_ms = 60_000;
    config.idle_timeout_ms = 90_000;
    let mut core = connected(&config, 0);
    core.want(A);
    transmit(&mut core, 50_000);
    assert_eq!(core.poll_timeout(50_000), Wake::At(60_000));
    assert_ne!(core.poll_timeout(139_999), Wake::Drop);
    assert_eq!(core.poll_timeout(140_000), Wake::Drop);
}

#[test]
fn a_pull_in_flight_makes_a_silent_connection_dead() {
    let mut config = config();
    config.keepalive_ms = 60_000;
    config.idle_timeout_ms = 90_000;
    let mut core = connected(&config, 0);
    core.want(A);
    core.want(B);
    transmit(&mut core, 10);
    assert_eq!(
        core.poll_timeout(10),
        Wake::At(60_000),
        "the keepalive first"
    );
    core.on_frame(&answer(1, A, 1, &[]), 2000).unwrap();
    assert_ne!(
        core.poll_timeout(91_999),
        Wake::Drop,
        "progress restarts the wait"
    );
    assert_eq!(core.poll_timeout(92_000), Wake::Drop);
    core.on_frame(&answer(1, B, 1, &[]), 91_000).unwrap();
    assert_eq!(
        core.poll_timeout(200_000),
        Wake::At(60_000),
        "nothing awaited"
    );
}

// --- reconnecting ---

/// The delays of `failures` consecutive failed attempts.
fn delays(config: &RouteClientConfig, failures: usize) -> Vec<u64> {
    let mut core = RouteClientCore::new(config).unwrap();
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
    // A host cut off for 30 s has failed every attempt since: with the
    // defaults its next one is at most `backoff_max_ms` (1 s) away, so it
    // is back within about 2 s of the heal (the attempt in progress, whose
    // SYN was dropped, takes up to `connect_timeout_ms` more).
    let defaults = RouteClientConfig::new(vec![addr(1)]);
    assert_eq!(defaults.backoff_max_ms, 1000);
    assert!(defaults.connect_timeout_ms <= 1000);
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
fn the_backoff_never_overflows() {
    let mut c = config();
    c.backoff_initial_ms = u64::MAX / 2;
    c.backoff_max_ms = u64::MAX;
    let mut core = RouteClientCore::new(&c).unwrap();
    for failures in [0, 1, 2, 63, 64, 65, 1000, u32::MAX] {
        core.link.set_failures(failures);
        core.link.backoff();
    }
    let mut core = RouteClientCore::new(&config()).unwrap();
    core.link.set_failures(u32::MAX);
    assert!(core.link.backoff() <= 5000);
    core.poll_connect(u64::MAX).unwrap();
    core.on_disconnected(u64::MAX);
    assert_eq!(core.poll_timeout(u64::MAX), Wake::At(u64::MAX));
}

#[test]
fn a_healthy_connection_resets_the_backoff() {
    let mut core = RouteClientCore::new(&config()).unwrap();
    let mut now = 0;
    for _ in 0..6 {
        core.poll_connect(now).unwrap();
        core.on_disconnected(now);
        now += 10_000;
    }
    core.poll_connect(now).unwrap();
    core.on_connected(now);
    let ack = Encoder::new().keep_alive_ack(1).to_vec();
    core.on_frame(&ack, now).unwrap();
    core.on_disconnected(now);
    let Wake::At(at) = core.poll_timeout(now) else {
        panic!()
    };
    assert!(at - now <= 100, "back to the initial delay: {}", at - now);
}

#[test]
fn attempts_fail_over_through_the_addresses_and_wrap() {
    let mut core = RouteClientCore::new(&config()).unwrap();
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
fn a_reloaded_config_keeps_the_connection_and_takes_effect_at_the_next_use() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    core.on_frame(&answer(1, A, 3, &[node(1)]), 1).unwrap();
    let mut c = config();
    c.addrs = vec![addr(7), addr(8)];
    c.keepalive_ms = 500;
    c.idle_timeout_ms = 1500;
    c.refresh_ms = 4000;
    c.jitter_seed = 99;
    core.reconfigure(&c).unwrap();
    assert_eq!(core.link().connected(), Some(addr(1)), "kept");
    assert!(core.follows(A), "nothing followed is lost");
    assert_eq!(core.config().jitter_seed, 7, "the seed stays");
    // The new list from the next attempt on.
    core.on_disconnected(2);
    let Wake::At(at) = core.poll_timeout(2) else {
        panic!()
    };
    assert_eq!(core.poll_connect(at), Some(addr(7)));
    core.on_connected(at);
    // The new intervals: keep-alive and re-pull.
    assert_eq!(transmit(&mut core, at).pulls.len(), 1, "A again");
    assert_eq!(transmit(&mut core, at + 500).keepalives.len(), 1);
    // A bad config is refused whole.
    let mut bad = config();
    bad.addrs.clear();
    assert_eq!(core.reconfigure(&bad), Err(RouteConfigError::NoAddrs));
    assert_eq!(core.config().keepalive_ms, 500);
}

#[test]
fn a_lost_connection_moves_to_the_next_address() {
    let mut core = connected(&config(), 0);
    assert_eq!(core.link().connected(), Some(addr(1)));
    core.on_disconnected(5);
    assert_eq!(core.link().connected(), None);
    assert_eq!(core.link().current_addr(), addr(2));
    assert_eq!(core.stats().connects, 1);
    assert_eq!(core.stats().disconnects, 1);
}

/// Issue 31: a route's zones and labels reach the event; a route server
/// sending more metadata entries than nodes is refused (the connection
/// closes, as for any invalid message).
#[test]
fn zones_and_labels_come_with_the_route_and_are_bounded() {
    let mut core = connected(&config(), 0);
    core.want(A);
    transmit(&mut core, 0);
    let meta = vec![(
        node(1).addr,
        NodeMeta {
            zone: Some("eu-1".parse().unwrap()),
            labels: "version=canary".parse().unwrap(),
        },
    )];
    let mut enc = Encoder::new();
    let frame = enc
        .route_answer_meta(
            1,
            A,
            true,
            3,
            &[node(1)],
            Policy::L5,
            &Default::default(),
            &meta,
        )
        .to_vec();
    let r = route(core.on_frame(&frame, 5).unwrap());
    assert_eq!(r.meta, meta);
    let two = vec![meta[0].clone(), (node(2).addr, meta[0].1.clone())];
    let frame = enc
        .route_push_meta(
            A,
            true,
            4,
            &[node(1)],
            Policy::L5,
            &Default::default(),
            &two,
        )
        .to_vec();
    assert!(matches!(
        core.on_frame(&frame, 6),
        Err(RouteClientError::Meta(BadMeta::TooMany {
            count: 2,
            nodes: 1
        }))
    ));
}
