//! The stats client end to end: `statsclient::run` on a glommio executor in
//! its own thread, against the test report sink on loopback. The test
//! thread feeds statistics and watches the client's status through a small
//! bridge (std channels in, a snapshot of the status out). Every wait is
//! bounded; a test takes a few seconds at most.

#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/reportsink.rs"]
mod reportsink;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use glommio::channels::local_channel;
use glommio::LocalExecutorBuilder;
use lbagent::agent::statsclient::{
    run, StatsClientConfig, StatsClientEvent, StatsClientStats, StatsClientStatus, StatsItem,
};
use lbagent::lb::NodeCallStats;
use lbagent::model::{ModuleId, NodeAddr};
use lbagent::wire::{NodeStats, RetCode};
use reportsink::ReportSink;

/// The longest any single wait may take.
const WAIT: Duration = Duration::from_secs(5);

/// What the bridge publishes: the client's status as of its last look.
#[derive(Clone, Copy, Debug, Default)]
struct View {
    connected: Option<SocketAddr>,
    stats: StatsClientStats,
}

/// A stats client running on its own executor thread.
struct Client {
    items: mpsc::Sender<StatsItem>,
    events: mpsc::Receiver<StatsClientEvent>,
    seen: Vec<StatsClientEvent>,
    view: Arc<Mutex<View>>,
    stop: Arc<AtomicBool>,
    done: mpsc::Receiver<View>,
}

impl Client {
    fn start(config: StatsClientConfig) -> Self {
        let (items, items_rx) = mpsc::channel::<StatsItem>();
        let (events_tx, events) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let view = Arc::new(Mutex::new(View::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (view2, stop2) = (view.clone(), stop.clone());
        thread::spawn(move || {
            let executor = LocalExecutorBuilder::default()
                .io_memory(512 << 10)
                .make()
                .expect("a glommio executor (check `ulimit -l`)");
            let last = executor.run(bridge(config, items_rx, events_tx, view2, stop2));
            let _ = done_tx.send(last);
        });
        Client {
            items,
            events,
            seen: Vec::new(),
            view,
            stop,
            done,
        }
    }

    fn push(&self, module: ModuleId, nodes: Vec<NodeCallStats>) {
        self.items
            .send((module, nodes))
            .expect("the client thread is gone");
    }

    fn view(&self) -> View {
        *self.view.lock().unwrap()
    }

    fn stats(&self) -> StatsClientStats {
        self.view().stats
    }

    /// Waits until `cond` holds on the client's view; panics after [`WAIT`].
    fn wait_for(&self, what: &str, cond: impl Fn(&View) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !cond(&self.view()) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {:?}",
                self.view()
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every event so far.
    fn events(&mut self) -> &[StatsClientEvent] {
        self.seen.extend(self.events.try_iter());
        &self.seen
    }

    /// Stops the client; returns its final view and how long the stop took.
    fn shutdown(self) -> (View, Duration) {
        let started = Instant::now();
        self.stop.store(true, Ordering::SeqCst);
        let last = self
            .done
            .recv_timeout(WAIT)
            .expect("the client did not stop in time");
        (last, started.elapsed())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Runs the client, forwarding items in and events and status out, until
/// `stop`; returns the final view.
async fn bridge(
    config: StatsClientConfig,
    items: mpsc::Receiver<StatsItem>,
    events_out: mpsc::Sender<StatsClientEvent>,
    view: Arc<Mutex<View>>,
    stop: Arc<AtomicBool>,
) -> View {
    let (input, input_rx) = local_channel::new_unbounded();
    let (events_tx, events_rx) = local_channel::new_bounded(1024);
    let (stop_tx, stop_rx) = local_channel::new_bounded::<()>(1);
    let status = StatsClientStatus::default();
    let shutdown = async move {
        let _ = stop_rx.recv().await;
    };
    let client = glommio::spawn_local(run(config, input_rx, events_tx, shutdown, status.clone()));
    glommio::spawn_local(async move {
        while let Some(event) = events_rx.recv().await {
            let _ = events_out.send(event);
        }
    })
    .detach();
    loop {
        // Read the flag first: every item sent before it was set is forwarded.
        let stopping = stop.load(Ordering::SeqCst);
        for item in items.try_iter() {
            input.try_send(item).expect("an unbounded channel");
        }
        *view.lock().unwrap() = View {
            connected: status.connected(),
            stats: status.stats(),
        };
        if stopping {
            break;
        }
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }
    stop_tx.try_send(()).unwrap();
    client.await.expect("a valid config");
    let last = View {
        connected: status.connected(),
        stats: status.stats(),
    };
    *view.lock().unwrap() = last;
    last
}

fn config(addrs: Vec<SocketAddr>) -> StatsClientConfig {
    let mut c = StatsClientConfig::new(addrs);
    c.caller = Ipv4Addr::new(10, 0, 0, 7);
    c.connect_timeout_ms = 200;
    // Long: no test waits one out, and a stall of a busy machine (the
    // sink runs in this process) must not time out an ack that was sent,
    // which would reconnect and send a report twice.
    c.ack_timeout_ms = 10_000;
    c.backoff_initial_ms = 10;
    c.backoff_max_ms = 50;
    c.flush_timeout_ms = 500;
    c.jitter_seed = 1;
    c
}

fn module(i: u32) -> ModuleId {
    ModuleId::new(10_000 + i, 1)
}

fn node(last: u8, succ: u32, err: u32, overloaded: bool) -> NodeCallStats {
    NodeCallStats {
        addr: NodeAddr::new(Ipv4Addr::new(10, 1, 0, last), 9000),
        succ,
        err,
        overloaded,
        consumed: 0,
    }
}

fn one_node(i: u32) -> Vec<NodeCallStats> {
    vec![node(1, i, 0, false)]
}

/// A loopback address where nothing listens: port 1, below the range the
/// kernel hands out for port 0, which no test binds (a port bound and
/// released here could be another test's listener by the time it is
/// dialled).
fn dead_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 1))
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn sorted(mut v: Vec<ModuleId>) -> Vec<ModuleId> {
    v.sort();
    v
}

#[test]
fn statistics_arrive_at_the_reporter_and_are_acknowledged() {
    let sink = ReportSink::start();
    let client = Client::start(config(vec![sink.addr()]));
    let a = vec![node(1, 120, 3, false), node(2, 7, 9, true)];
    client.push(module(1), a.clone());
    client.push(module(2), vec![node(3, 1, 0, false)]);
    client.wait_for("two entries acked", |v| v.stats.acked == 2);
    assert_eq!(client.view().connected, Some(sink.addr()));

    let reports = sink.reports();
    let got: Vec<(ModuleId, Vec<NodeStats>)> =
        reports.iter().flat_map(|r| r.modules.clone()).collect();
    let wire = |n: &NodeCallStats| NodeStats {
        addr: n.addr,
        succ: n.succ,
        err: n.err,
        overloaded: n.overloaded,
    };
    assert_eq!(got[0], (module(1), a.iter().map(wire).collect()));
    assert_eq!(got[1].0, module(2));
    for r in &reports {
        assert_eq!(r.caller, u32::from(Ipv4Addr::new(10, 0, 0, 7)));
        assert!(r.time_s.abs_diff(unix_s()) <= 5, "time_s {}", r.time_s);
    }

    let (last, _) = client.shutdown();
    let s = last.stats;
    assert_eq!(
        (s.pushed, s.acked, s.dropped, s.queued, s.in_flight),
        (2, 2, 0, 0, 0)
    );
    assert_eq!(last.connected, None);
}

#[test]
fn a_reporter_outage_loses_nothing_and_duplicates_only_unacked_reports() {
    let mut sink = ReportSink::start();
    let port = sink.addr().port();
    let mut client = Client::start(config(vec![sink.addr()]));
    client.push(module(0), one_node(0));
    client.wait_for("the first entry acked", |v| v.stats.acked == 1);

    // The reporter receives module 1 but its ack is lost, then it goes down.
    sink.set_withhold_acks(true);
    client.push(module(1), one_node(1));
    assert!(sink.wait_until(WAIT, |s| s.modules().contains(&module(1))));
    sink.stop();
    client.wait_for("the disconnection", |v| v.connected.is_none());
    for i in 2..10 {
        client.push(module(i), one_node(i));
    }
    client.wait_for("everything queued", |v| v.stats.queued == 9);
    assert!(client
        .events()
        .iter()
        .any(|e| matches!(e, StatsClientEvent::Disconnected { requeued: 1, .. })));

    // It comes back on the same port: everything is delivered.
    sink.set_withhold_acks(false);
    sink.start_on(port).unwrap();
    client.wait_for("everything acked", |v| v.stats.acked == 10);
    let expected: Vec<ModuleId> = (0..10).map(module).collect();
    assert_eq!(
        sorted(sink.acked_modules()),
        expected,
        "each acked exactly once"
    );

    // The only duplicate is module 1's report, re-sent under its own seq.
    let mut by_seq: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for r in sink.reports() {
        by_seq.entry(r.seq).or_default().push(r);
    }
    let twice: Vec<_> = by_seq.values().filter(|copies| copies.len() > 1).collect();
    assert_eq!(twice.len(), 1, "{by_seq:?}");
    let copies = twice[0];
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0].modules, copies[1].modules);
    assert_eq!(copies[0].modules[0].0, module(1));
    assert!(!copies[0].acked && copies[1].acked);
    assert_eq!(sink.modules().len(), 11);

    let (last, _) = client.shutdown();
    let s = last.stats;
    assert_eq!((s.pushed, s.acked, s.dropped, s.resent), (10, 10, 0, 1));
}

#[test]
fn past_the_bound_the_oldest_entries_are_dropped_and_counted() {
    let mut sink = ReportSink::start();
    let port = sink.addr().port();
    sink.stop();
    let mut c = config(vec![sink_addr(port)]);
    c.max_queued = 5;
    let mut client = Client::start(c);
    client.wait_for("a failed attempt", |v| v.stats.disconnects >= 1);
    for i in 0..8 {
        client.push(module(i), one_node(i));
    }
    client.wait_for("three dropped", |v| v.stats.dropped == 3);
    assert_eq!(client.stats().queued, 5);
    // Drops are reported as events (one per burst of pushes).
    let deadline = Instant::now() + WAIT;
    loop {
        let reported: u64 = client
            .events()
            .iter()
            .filter_map(|e| match e {
                StatsClientEvent::Dropped { entries, .. } => Some(*entries),
                _ => None,
            })
            .sum();
        if reported == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "drop events sum to {reported}");
        thread::sleep(Duration::from_millis(5));
    }

    sink.start_on(port).unwrap();
    client.wait_for("the rest acked", |v| v.stats.acked == 5);
    assert_eq!(sink.modules(), (3..8).map(module).collect::<Vec<_>>());
    let (last, _) = client.shutdown();
    let s = last.stats;
    assert_eq!((s.pushed, s.dropped, s.acked), (8, 3, 5));
}

fn sink_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn an_unreachable_first_address_fails_over_to_the_second() {
    let sink = ReportSink::start();
    let dead = dead_addr();
    let mut client = Client::start(config(vec![dead, sink.addr()]));
    client.push(module(1), one_node(1));
    client.wait_for("the entry acked", |v| v.stats.acked == 1);
    assert_eq!(client.view().connected, Some(sink.addr()));
    let events = client.events();
    let failed = events
        .iter()
        .position(|e| matches!(e, StatsClientEvent::ConnectFailed { addr, .. } if *addr == dead));
    let connected = events
        .iter()
        .position(|e| matches!(e, StatsClientEvent::Connected(addr) if *addr == sink.addr()));
    assert!(failed.unwrap() < connected.unwrap(), "{events:?}");
    assert_eq!(sink.modules(), vec![module(1)]);
}

#[test]
fn a_lost_reporter_fails_over_to_the_next_one() {
    let mut first = ReportSink::start();
    let second = ReportSink::start();
    let client = Client::start(config(vec![first.addr(), second.addr()]));
    client.push(module(1), one_node(1));
    client.wait_for("the first entry acked", |v| v.stats.acked == 1);
    first.stop();
    client.push(module(2), one_node(2));
    client.wait_for("the second entry acked", |v| v.stats.acked == 2);
    assert_eq!(client.view().connected, Some(second.addr()));
    assert_eq!(first.modules(), vec![module(1)]);
    assert_eq!(second.modules(), vec![module(2)]);
}

#[test]
fn a_refused_report_is_dropped_and_reported() {
    let sink = ReportSink::start();
    sink.set_refuse(Some(RetCode::BadRequest));
    let mut client = Client::start(config(vec![sink.addr()]));
    client.push(module(1), one_node(1));
    client.wait_for("the entry rejected", |v| v.stats.rejected == 1);
    let refused = client.events().iter().any(|e| {
        matches!(e, StatsClientEvent::ServerError(s) if s.retcode == RetCode::BadRequest && s.rejected == 1)
    });
    assert!(refused);
    sink.set_refuse(None);
    client.push(module(2), one_node(2));
    client.wait_for("the next entry acked", |v| v.stats.acked == 1);
    assert_eq!(
        client.view().connected,
        Some(sink.addr()),
        "the connection stays"
    );
    assert_eq!(sink.accepted(), 1);
}

#[test]
fn shutdown_flushes_what_is_queued_in_one_bounded_attempt() {
    let mut sink = ReportSink::start();
    let port = sink.addr().port();
    sink.stop();
    let mut c = config(vec![sink_addr(port)]);
    // After the first failure the next attempt is a minute away: only the
    // flush can deliver. Its 5 s (not config()'s 500 ms): the sink is a
    // thread of this process, and one kept off its core for half a second
    // would have the flush give up with nothing acked.
    c.backoff_initial_ms = 60_000;
    c.backoff_max_ms = 60_000;
    c.flush_timeout_ms = 5_000;
    let client = Client::start(c);
    client.wait_for("a failed attempt", |v| v.stats.disconnects >= 1);
    client.push(module(1), one_node(1));
    client.push(module(2), one_node(2));
    client.wait_for("both queued", |v| v.stats.queued == 2);
    sink.start_on(port).unwrap();

    let (last, took) = client.shutdown();
    assert_eq!(last.stats.acked, 2, "{last:?}");
    assert_eq!(sink.modules(), vec![module(1), module(2)]);
    // Far below the 60 s back-off (the flush did the delivering), far above
    // a stall of a busy machine.
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn a_flush_without_acks_gives_up_after_its_timeout() {
    let sink = ReportSink::start();
    sink.set_withhold_acks(true);
    // Only the flush timeout (500 ms) can end the wait: no ack timeout
    // comes first, so the bound below can be generous.
    let mut c = config(vec![sink.addr()]);
    c.ack_timeout_ms = 60_000;
    let client = Client::start(c);
    client.wait_for("connected", |v| v.connected.is_some());
    client.push(module(1), one_node(1));
    assert!(sink.wait_until(WAIT, |s| !s.modules().is_empty()));

    let (last, took) = client.shutdown();
    let s = last.stats;
    assert_eq!((s.acked, s.in_flight), (0, 1), "{s:?}");
    assert!(
        took >= Duration::from_millis(400),
        "waited for acks: {took:?}"
    );
    // Bounded by the flush timeout, not the ack timeout (60 s) or forever;
    // generous for a stall of a busy machine.
    assert!(took < Duration::from_secs(10), "bounded: {took:?}");
}
