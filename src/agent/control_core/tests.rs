//! The control core's decisions, with rings that are queues of a fixed
//! capacity and time that is passed in.

use std::cell::RefCell;

use super::*;
use crate::messages::LiveParams;
use crate::routeclient::{RouteClientError, RouteEvent};
use crate::statsclient::StatsClientError;
use lbagent_host::snapshot;
use lbagent_lb::LbParams;
use lbagent_model::{NodeAddr, Policy, RouteNode};

/// Rings of `cap` messages each; `closed` shards refuse everything.
struct FakeRings {
    cap: usize,
    sent: RefCell<Vec<Vec<ToShard>>>,
    closed: Vec<usize>,
}

impl FakeRings {
    fn new(shards: usize, cap: usize) -> Self {
        FakeRings {
            cap,
            sent: RefCell::new(vec![Vec::new(); shards]),
            closed: Vec::new(),
        }
    }

    /// Empties shard `s`'s ring (the shard read it); what it held.
    fn drain(&self, s: usize) -> Vec<ToShard> {
        std::mem::take(&mut self.sent.borrow_mut()[s])
    }
}

impl ShardRings for FakeRings {
    fn try_send(&self, shard: usize, msg: ToShard) -> Result<(), Refused> {
        if self.closed.contains(&shard) {
            return Err(Refused::Closed);
        }
        let mut sent = self.sent.borrow_mut();
        if sent[shard].len() >= self.cap {
            return Err(Refused::Full(msg));
        }
        sent[shard].push(msg);
        Ok(())
    }
}

const TICK: Duration = Duration::from_millis(200);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn core(shards: u32, t0: Instant) -> ControlCore {
    ControlCore::new(shards, None, Duration::from_secs(10), TICK, t0)
}

fn m(k: u32) -> ModuleId {
    ModuleId::new(k, 0)
}

fn node(i: u32) -> RouteNode {
    RouteNode {
        addr: NodeAddr {
            ip: 0x0a00_0000 + i,
            port: 80,
        },
        weight: 1,
    }
}

fn route(module: ModuleId, version: u64) -> RouteClientEvent {
    RouteClientEvent::Route(RouteEvent {
        module,
        exists: true,
        version,
        nodes: vec![node(1), node(2)],
        pushed: false,
        policy: Policy::L5,
        options: Default::default(),
        meta: Vec::new(),
    })
}

fn version_of(msg: &ToShard) -> u64 {
    match msg {
        ToShard::Route { version, .. } => *version,
        ToShard::Params(_) => u64::MAX,
    }
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn update(interval: Duration) -> LiveUpdate {
    LiveUpdate {
        shard: LiveParams {
            params: LbParams::default(),
            update_timeout_ms: 7_000,
            report_timeout_ms: 8_000,
            locality_min_percent: 0,
            label_fallback: Default::default(),
        },
        route_servers: Some(vec![addr(1)]),
        reporters: None,
        snapshot_interval: interval,
    }
}

#[test]
fn pulls_and_statistics_pass_through_and_a_forget_drops_the_copy() {
    let t0 = Instant::now();
    let rings = FakeRings::new(2, 8);
    let mut c = core(2, t0);
    let _ = c.route_event(route(m(2), 1), 0, &rings);
    assert!(c.routes().get(m(2)).is_some());
    assert_eq!(
        c.shard_message(ToControl::Pull(m(3))),
        Forward::Want(Want::Pull(m(3)))
    );
    assert_eq!(
        c.shard_message(ToControl::Stats {
            module: m(3),
            nodes: Vec::new()
        }),
        Forward::Stats(m(3), Vec::new())
    );
    assert_eq!(
        c.shard_message(ToControl::Forget(m(2))),
        Forward::Want(Want::Forget(m(2)))
    );
    assert!(c.routes().get(m(2)).is_none(), "the copy went");
    let (_, control) = c.metrics(Links::default(), t0);
    assert_eq!(control.modules_forgotten, 1);
    assert_eq!(control.routes_received, 1);
}

#[test]
fn each_drained_shard_is_counted_and_wakes_the_loop() {
    let mut c = core(3, Instant::now());
    assert_eq!(c.shard_message(ToControl::Drained), Forward::Drained);
    assert_eq!(c.shard_message(ToControl::Drained), Forward::Drained);
    assert_eq!(c.drained(), 2);
}

#[test]
fn a_route_goes_to_the_shard_that_owns_its_module() {
    let rings = FakeRings::new(2, 8);
    let mut c = core(2, Instant::now());
    let (line, retry) = c.route_event(route(m(3), 5), 0, &rings);
    assert_eq!((line, retry), (None, false));
    assert!(rings.drain(0).is_empty());
    let got = rings.drain(1);
    assert_eq!(got.len(), 1);
    assert_eq!(version_of(&got[0]), 5);
}

#[test]
fn a_full_ring_starts_a_backlog_that_keeps_the_order() {
    let rings = FakeRings::new(1, 1);
    let mut c = core(1, Instant::now());
    assert!(!c.route_event(route(m(0), 1), 0, &rings).1);
    assert!(
        c.route_event(route(m(0), 2), 0, &rings).1,
        "a backlog began"
    );
    assert!(
        !c.route_event(route(m(0), 3), 0, &rings).1,
        "queued behind it, no second wake"
    );
    let (_, control) = c.metrics(Links::default(), Instant::now());
    assert_eq!(control.ring_drops, 1, "only the refusal is counted");
    assert!(c.retry_backlog(&rings), "still full");
    assert_eq!(
        rings.drain(0).iter().map(version_of).collect::<Vec<_>>(),
        [1]
    );
    assert!(c.retry_backlog(&rings), "one fits per retry");
    assert_eq!(
        rings.drain(0).iter().map(version_of).collect::<Vec<_>>(),
        [2]
    );
    assert!(!c.retry_backlog(&rings), "the last one went");
    assert_eq!(
        rings.drain(0).iter().map(version_of).collect::<Vec<_>>(),
        [3]
    );
}

#[test]
fn a_closed_ring_loses_its_messages_without_a_backlog() {
    let mut rings = FakeRings::new(2, 0);
    let mut c = core(2, Instant::now());
    assert!(c.route_event(route(m(1), 1), 0, &rings).1);
    rings.closed.push(1);
    assert!(!c.retry_backlog(&rings), "the backlog is dropped");
    assert!(!c.route_event(route(m(1), 2), 0, &rings).1);
    let (_, control) = c.metrics(Links::default(), Instant::now());
    assert_eq!(control.ring_drops, 2);
}

#[test]
fn no_heartbeat_until_every_shard_is_ready_then_one_a_second() {
    let t0 = Instant::now();
    let rings = FakeRings::new(2, 8);
    let mut c = core(2, t0);
    assert_eq!(c.sleep(t0), STARTING_POLL, "polls while the shards start");
    assert!(!c.turn(t0 + ms(5000), None, (0, 0), &rings).beat);
    assert_eq!(c.start_serving(1, t0 + ms(5000)), None);
    assert_eq!(
        c.start_serving(2, t0 + ms(5000)),
        Some(Serving { fill: false })
    );
    assert!(c.serving());
    assert_eq!(c.start_serving(2, t0 + ms(5001)), None, "only once");
    assert_eq!(c.sleep(t0 + ms(5000)), TICK, "the idle tick");
    assert_eq!(c.sleep(t0 + ms(5900)), ms(100), "the next beat");
    assert!(!c.turn(t0 + ms(5999), None, (0, 0), &rings).beat);
    assert!(c.turn(t0 + ms(6000), None, (0, 0), &rings).beat);
    assert!(!c.turn(t0 + ms(6500), None, (0, 0), &rings).beat);
    let (_, control) = c.metrics(Links::default(), t0 + ms(6500));
    assert_eq!(control.heartbeat_age_s, 0.5);
}

#[test]
fn a_snapshot_is_due_every_interval_with_the_threads_counts() {
    let t0 = Instant::now();
    let rings = FakeRings::new(1, 8);
    let mut c = core(1, t0);
    let _ = c.route_event(route(m(0), 4), 0, &rings);
    assert!(c
        .turn(t0 + ms(9999), None, (0, 0), &rings)
        .snapshot
        .is_none());
    let due = c.turn(t0 + ms(10_000), None, (3, 1), &rings).snapshot;
    assert_eq!(due.expect("due").len(), 1);
    assert!(c
        .turn(t0 + ms(10_001), None, (3, 1), &rings)
        .snapshot
        .is_none());
    c.snapshot_skipped();
    let (_, control) = c.metrics(Links::default(), t0);
    assert_eq!(
        (
            control.snapshots_written,
            control.snapshot_errors,
            control.snapshots_skipped
        ),
        (3, 1, 1)
    );
}

#[test]
fn a_zero_snapshot_interval_does_not_spin_the_loop() {
    let t0 = Instant::now();
    let mut c = ControlCore::new(1, None, Duration::ZERO, TICK, t0);
    let _ = c.start_serving(1, t0);
    assert_eq!(c.sleep(t0 + ms(1)), TICK - ms(1));
}

#[test]
fn no_snapshot_and_no_sleep_for_it_while_the_table_fills() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let routes: Vec<_> = (0..3)
        .map(|k| SnapshotRoute {
            module: m(k),
            version: 1,
            nodes: vec![node(k)],
            meta: Vec::new(),
        })
        .collect();
    snapshot::write(&path, 1, &routes).unwrap();
    let index = Arc::new(snapshot::read_index(&path).unwrap());
    let t0 = Instant::now();
    let rings = FakeRings::new(1, 8);
    let mut c = ControlCore::new(1, Some(index), ms(100), TICK, t0);
    assert_eq!(c.start_serving(1, t0), Some(Serving { fill: true }));
    assert_eq!(
        c.sleep(t0 + ms(900)),
        ms(100),
        "only the beat: the snapshot, overdue, waits for the table"
    );
    assert!(c
        .turn(t0 + ms(500), None, (0, 0), &rings)
        .snapshot
        .is_none());
    let mut pulled = Vec::new();
    while c.fill_step(1, |m| pulled.push(m)) {}
    assert_eq!(pulled, [m(0), m(1), m(2)]);
    let due = c.turn(t0 + ms(600), None, (0, 0), &rings).snapshot;
    assert_eq!(due.expect("filled: due").len(), 3);
}

#[test]
fn the_final_routes_take_what_the_fill_had_left() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let routes = [SnapshotRoute {
        module: m(7),
        version: 2,
        nodes: vec![node(1)],
        meta: Vec::new(),
    }];
    snapshot::write(&path, 1, &routes).unwrap();
    let index = Arc::new(snapshot::read_index(&path).unwrap());
    let mut c = ControlCore::new(1, Some(index), ms(100), TICK, Instant::now());
    assert_eq!(c.final_routes().len(), 1);
}

#[test]
fn a_reload_reaches_every_shard_behind_its_backlog_and_both_clients() {
    let t0 = Instant::now();
    let rings = FakeRings::new(2, 1);
    let mut c = core(2, t0);
    let _ = c.route_event(route(m(0), 1), 0, &rings);
    assert!(c.route_event(route(m(0), 2), 0, &rings).1);
    let a = c.turn(t0, Some(update(ms(30_000))), (0, 0), &rings);
    assert!(
        !a.retry,
        "shard 0's backlog had begun; shard 1's ring had room"
    );
    assert_eq!(a.route_servers, Some(vec![addr(1)]));
    assert_eq!(a.refresh_ms, Some(7_000));
    assert_eq!(a.reporters, None);
    assert!(matches!(rings.drain(1)[..], [ToShard::Params(_)]));
    assert_eq!(
        rings.drain(0).iter().map(version_of).collect::<Vec<_>>(),
        [1]
    );
    assert!(
        c.retry_backlog(&rings),
        "the route first, the parameters wait"
    );
    assert_eq!(
        rings.drain(0).iter().map(version_of).collect::<Vec<_>>(),
        [2]
    );
    assert!(!c.retry_backlog(&rings));
    assert!(matches!(rings.drain(0)[..], [ToShard::Params(_)]));
    // The new interval: no snapshot at 10 s any more.
    assert!(c
        .turn(t0 + ms(10_000), None, (0, 0), &rings)
        .snapshot
        .is_none());
    assert!(c
        .turn(t0 + ms(30_000), None, (0, 0), &rings)
        .snapshot
        .is_some());
}

#[test]
fn a_reload_into_full_rings_starts_their_backlog() {
    let t0 = Instant::now();
    let rings = FakeRings::new(2, 0);
    let mut c = core(2, t0);
    let a = c.turn(t0, Some(update(ms(30_000))), (0, 0), &rings);
    assert!(a.retry);
    let (_, control) = c.metrics(Links::default(), t0);
    assert_eq!(control.ring_drops, 2);
}

#[test]
fn a_link_that_stays_down_is_logged_once_per_relog_period() {
    let rings = FakeRings::new(1, 1);
    let mut c = core(1, Instant::now());
    let failed = || RouteClientEvent::ConnectFailed {
        addr: addr(9),
        error: RouteClientError::Idle(5),
    };
    let (line, _) = c.route_event(failed(), 0, &rings);
    assert!(
        matches!(line, Some(Log::Warn(l)) if l.starts_with("cannot connect to route server 127.0.0.1:9"))
    );
    assert_eq!(c.route_event(failed(), 1_000, &rings).0, None);
    assert_eq!(c.route_event(failed(), 2_000, &rings).0, None);
    let (line, _) = c.route_event(failed(), RELOG_MS, &rings);
    assert!(matches!(line, Some(Log::Warn(l)) if l.ends_with("(2 similar lines left out)")));
    let (line, _) = c.route_event(RouteClientEvent::Connected(addr(9)), RELOG_MS + 1, &rings);
    assert_eq!(
        line,
        Some(Log::Info("connected to route server 127.0.0.1:9".into()))
    );
}

#[test]
fn the_reporters_drops_are_gated_apart_from_its_link() {
    let mut c = core(1, Instant::now());
    let dropped = StatsClientEvent::Dropped {
        entries: 1,
        total: 1,
    };
    let failed = StatsClientEvent::ConnectFailed {
        addr: addr(9),
        error: StatsClientError::Closed,
    };
    assert!(matches!(c.stats_event(&failed, 0), Some(Log::Warn(_))));
    assert!(matches!(c.stats_event(&dropped, 10), Some(Log::Warn(_))));
    assert_eq!(c.stats_event(&dropped, 20), None);
    assert_eq!(c.stats_event(&failed, 30), None);
    let line = c.stats_event(&StatsClientEvent::Connected(addr(9)), 40);
    assert_eq!(
        line,
        Some(Log::Info(
            "reporter: connected to reporter 127.0.0.1:9 (1 similar line left out)".into()
        ))
    );
}

#[test]
fn the_metrics_page_shows_the_shards_last_copies_and_the_links() {
    let t0 = Instant::now();
    let mut c = core(2, t0);
    let mut m1 = ShardMetrics::new(1);
    m1.wrong_shard = 9;
    c.shard_metrics_in(m1);
    c.shard_metrics_in(ShardMetrics::new(5));
    let links = Links {
        route_server: Some(addr(4)),
        pulls_sent: 3,
        reporter: None,
        stats_sent: 2,
        stats_dropped: 1,
    };
    let (shards, control) = c.metrics(links, t0 + ms(2500));
    assert_eq!(shards.len(), 2, "an unknown shard's copy is ignored");
    assert_eq!(shards[1].wrong_shard, 9);
    assert_eq!(control.route_server.as_deref(), Some("127.0.0.1:4"));
    assert_eq!(
        (
            control.pulls_sent,
            control.stats_sent,
            control.stats_dropped
        ),
        (3, 2, 1)
    );
    assert_eq!(control.heartbeat_age_s, 2.5, "no beat yet: since the start");
}
