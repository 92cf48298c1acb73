//! The route client end to end: the glommio shell (`routeclient::run`) on a
//! LocalExecutor in its own thread, against the test route source on
//! loopback. Every wait is bounded (a few seconds at most).

#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/routesrc.rs"]
mod routesrc;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use glommio::channels::local_channel;
use glommio::LocalExecutorBuilder;
use lbagent::agent::routeclient::{
    run, RouteClientConfig, RouteClientError, RouteClientEvent, RouteClientStatus, RouteEvent,
};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use routesrc::RouteSource;

const A: ModuleId = ModuleId::new(10_001, 1);
const B: ModuleId = ModuleId::new(10_002, 1);
const UNKNOWN: ModuleId = ModuleId::new(99, 99);

/// The longest any single expectation waits.
/// How long an awaited event may take: only a failure waits it out, and a
/// stall of a busy machine must not.
const PATIENCE: Duration = Duration::from_secs(10);

fn node(last: u8) -> RouteNode {
    RouteNode {
        addr: NodeAddr::new(Ipv4Addr::new(10, 0, 0, last), 8000 + u16::from(last)),
        weight: 1,
    }
}

fn config(addrs: Vec<SocketAddr>) -> RouteClientConfig {
    RouteClientConfig {
        addrs,
        connect_timeout_ms: 500,
        keepalive_ms: 100,
        // Long: a stall of a busy machine (the source runs in this process)
        // must not drop a live connection; the idle test sets its own.
        idle_timeout_ms: 10_000,
        backoff_initial_ms: 20,
        backoff_max_ms: 200,
        max_modules_per_pull: 64,
        refresh_ms: 0,
        jitter_seed: 1,
        tls: Default::default(),
    }
}

/// A loopback address where nothing listens: port 1, below the range the
/// kernel hands out for port 0, which no test binds (a port bound and
/// released here could be another test's listener by the time it is
/// dialled).
fn dead_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 1))
}

/// The route client running on its own executor thread, driven through
/// std channels bridged to the local channels `run` takes.
struct Client {
    wants: mpsc::Sender<ModuleId>,
    events: mpsc::Receiver<(Instant, RouteClientEvent)>,
    connected: Arc<Mutex<Option<SocketAddr>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Every event taken so far, in order.
    seen: Vec<(Instant, RouteClientEvent)>,
}

impl Client {
    fn start(config: RouteClientConfig) -> Self {
        let (want_tx, want_rx) = mpsc::channel::<ModuleId>();
        let (event_tx, event_rx) = mpsc::channel();
        let connected = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (mirror, flag) = (connected.clone(), stop.clone());
        let thread = thread::spawn(move || {
            let executor = LocalExecutorBuilder::default()
                .io_memory(512 << 10)
                .make()
                .expect("a glommio executor");
            executor.run(async move {
                let (local_want_tx, local_want_rx) = local_channel::new_unbounded();
                let (local_event_tx, local_event_rx) = local_channel::new_unbounded();
                let status = RouteClientStatus::default();
                let shutdown_flag = flag.clone();
                let shutdown = async move {
                    while !shutdown_flag.load(Ordering::SeqCst) {
                        glommio::timer::sleep(Duration::from_millis(5)).await;
                    }
                };
                let client = glommio::spawn_local(run(
                    config,
                    local_want_rx,
                    local_event_tx,
                    shutdown,
                    status.clone(),
                ));
                let forward = glommio::spawn_local(async move {
                    while let Some(event) = local_event_rx.recv().await {
                        let _ = event_tx.send((Instant::now(), event));
                    }
                });
                while !flag.load(Ordering::SeqCst) {
                    while let Ok(module) = want_rx.try_recv() {
                        local_want_tx.try_send(module).unwrap();
                    }
                    *mirror.lock().unwrap() = status.connected();
                    glommio::timer::sleep(Duration::from_millis(2)).await;
                }
                client.await.expect("a valid config");
                forward.await;
                assert_eq!(status.connected(), None, "shut down, not connected");
            });
        });
        Client {
            wants: want_tx,
            events: event_rx,
            connected,
            stop,
            thread: Some(thread),
            seen: Vec::new(),
        }
    }

    fn want(&self, module: ModuleId) {
        self.wants.send(module).unwrap();
    }

    /// Takes events until one matches `pick`; panics after `PATIENCE`.
    fn expect<T>(&mut self, what: &str, mut pick: impl FnMut(&RouteClientEvent) -> Option<T>) -> T {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok((at, event)) = self.events.recv_timeout(left) else {
                panic!("no {what} within {PATIENCE:?}; seen: {:#?}", self.seen);
            };
            let picked = pick(&event);
            self.seen.push((at, event));
            if let Some(t) = picked {
                return t;
            }
        }
    }

    fn expect_route(&mut self, module: ModuleId) -> RouteEvent {
        self.expect(&format!("route of {module}"), |e| match e {
            RouteClientEvent::Route(r) if r.module == module => Some(r.clone()),
            _ => None,
        })
    }

    fn expect_connected(&mut self, addr: SocketAddr) {
        self.expect(&format!("connection to {addr}"), |e| {
            matches!(e, RouteClientEvent::Connected(a) if *a == addr).then_some(())
        });
    }

    /// Waits (bounded) until the status handle shows `addr` (or none).
    fn expect_status(&self, addr: Option<SocketAddr>) {
        let deadline = Instant::now() + PATIENCE;
        while *self.connected.lock().unwrap() != addr {
            assert!(Instant::now() < deadline, "status never showed {addr:?}");
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let joined = thread.join();
            if !thread::panicking() {
                joined.expect("the client thread panicked");
            }
        }
    }
}

/// Waits (bounded) until `cond` holds.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "never: {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_pull_is_answered_and_the_status_shows_the_server() {
    let source = RouteSource::start();
    source.set_route(A, &[node(1), node(2)]);
    let mut client = Client::start(config(vec![source.addr()]));
    client.want(A);
    client.want(UNKNOWN);

    let route = client.expect_route(A);
    assert_eq!(
        route,
        RouteEvent {
            module: A,
            exists: true,
            version: 1,
            nodes: vec![node(1), node(2)],
            pushed: false,
            policy: lbagent::model::Policy::L5,
            meta: Vec::new(),
        }
    );
    let unknown = client.expect_route(UNKNOWN);
    assert!(!unknown.exists && unknown.nodes.is_empty() && !unknown.pushed);
    client.expect_status(Some(source.addr()));
    assert_eq!(source.pulls(A), 1);
    assert_eq!(source.subscribers(A), 1);
}

#[test]
fn a_push_arrives_without_a_pull() {
    let source = RouteSource::start();
    source.set_route(A, &[node(1)]);
    let mut client = Client::start(config(vec![source.addr()]));
    client.want(A);
    client.expect_route(A);

    source.set_route(A, &[node(3)]);
    let pushed = client.expect_route(A);
    assert!(pushed.pushed && pushed.exists);
    assert_eq!((pushed.version, pushed.nodes), (2, vec![node(3)]));

    source.del_route(A);
    let deleted = client.expect_route(A);
    assert!(deleted.pushed && !deleted.exists && deleted.version == 3);
    assert_eq!(source.pulls(A), 1, "pushes need no pull");
}

#[test]
fn keepalives_flow_while_idle() {
    let source = RouteSource::start();
    // Answered keepalives (every 100 ms) for longer than the idle timeout
    // (2.5 s: a stall of a busy machine shorter than that cannot make the
    // connection look idle) keep the connection.
    let mut client = Client::start(RouteClientConfig {
        idle_timeout_ms: 2500,
        ..config(vec![source.addr()])
    });
    client.expect_connected(source.addr());
    eventually("thirty keepalives", || source.keepalives() >= 30);
    let events: Vec<RouteClientEvent> = client.events.try_iter().map(|(_, e)| e).collect();
    assert_eq!(
        source.accepted(),
        1,
        "answered keepalives keep the connection: {events:?}"
    );
}

#[test]
fn two_answers_in_one_write_are_both_read() {
    let source = RouteSource::start();
    source.set_route(A, &[node(1)]);
    source.set_route(B, &[node(2)]);
    source.set_batching(true);
    let mut client = Client::start(config(vec![source.addr()]));
    client.want(A);
    client.want(B);
    assert_eq!(client.expect_route(A).nodes, vec![node(1)]);
    assert_eq!(client.expect_route(B).nodes, vec![node(2)]);
}

#[test]
fn frames_split_across_writes_are_reassembled() {
    let source = RouteSource::start();
    source.set_route(A, &[node(1), node(2), node(3)]);
    source.set_split_writes(true);
    source.set_batching(true);
    let mut client = Client::start(config(vec![source.addr()]));
    client.want(A);
    client.want(UNKNOWN);
    assert_eq!(client.expect_route(A).nodes.len(), 3);
    assert!(!client.expect_route(UNKNOWN).exists);
}

#[test]
fn a_dead_source_is_retried_with_backoff_and_the_pull_in_flight_reissued() {
    let mut source = RouteSource::start();
    let addr = source.addr();
    source.set_route(A, &[node(1)]);
    source.set_mute(true);
    let mut client = Client::start(config(vec![addr]));
    client.expect_connected(addr);
    client.want(A);
    eventually("the pull reaches the source", || source.pulls(A) == 1);

    source.stop();
    client.expect("the disconnection", |e| {
        matches!(e, RouteClientEvent::Disconnected { .. }).then_some(())
    });
    client.expect_status(None);
    // Let the back-off grow: 20 ms doubling to its 200 ms cap. (The
    // schedule itself is tested as pure code in src/agent/reconnect.rs;
    // here, that the shell follows it.) A stall of a busy machine can
    // lengthen one gap and shorten the next: the later gaps are judged by
    // their median, which one stall cannot move.
    let mut failures = Vec::new();
    while failures.len() < 8 {
        let at = client.expect("a failed attempt", |e| {
            matches!(e, RouteClientEvent::ConnectFailed { addr: a, .. } if *a == addr)
                .then(Instant::now)
        });
        failures.push(at);
    }
    let gaps: Vec<Duration> = failures.windows(2).map(|w| w[1] - w[0]).collect();
    // gaps[3..]: ~160 ms, then the cap, 200 ms, each jittered down by up
    // to half (doubling on without a cap, the upper median would be at
    // least 320 ms).
    let mut later = gaps[3..].to_vec();
    later.sort();
    let median = later[later.len() / 2];
    assert!(
        median >= Duration::from_millis(80),
        "the back-off did not grow: {gaps:?}"
    );
    assert!(
        median < Duration::from_millis(300),
        "the back-off exceeded its cap: {gaps:?}"
    );

    source.set_mute(false);
    source
        .start_on(addr.port())
        .expect("the port is free again");
    client.expect_connected(addr);
    let route = client.expect_route(A);
    assert!(route.exists && !route.pushed);
    assert_eq!(source.pulls(A), 2, "re-issued once on the new connection");
    client.expect_status(Some(addr));
}

#[test]
fn fail_over_from_a_dead_first_address_to_a_live_second() {
    let source = RouteSource::start();
    source.set_route(A, &[node(7)]);
    let dead = dead_addr();
    let mut client = Client::start(config(vec![dead, source.addr()]));
    client.want(A);
    client.expect("a failed attempt on the dead address", |e| {
        matches!(e, RouteClientEvent::ConnectFailed { addr, .. } if *addr == dead).then_some(())
    });
    client.expect_connected(source.addr());
    assert_eq!(client.expect_route(A).nodes, vec![node(7)]);
    client.expect_status(Some(source.addr()));
}

#[test]
fn a_silent_source_is_dropped_after_the_idle_timeout() {
    let source = RouteSource::start();
    source.set_mute(true);
    let started = Instant::now();
    let mut client = Client::start(RouteClientConfig {
        idle_timeout_ms: 1000,
        ..config(vec![source.addr()])
    });
    client.want(A);
    client.expect("an idle disconnection", |e| {
        matches!(
            e,
            RouteClientEvent::Disconnected {
                error: RouteClientError::Idle(_),
                ..
            }
        )
        .then_some(())
    });
    assert!(started.elapsed() >= Duration::from_millis(1000));
    eventually("a new connection", || source.accepted() >= 2);
    eventually("the pull re-issued", || source.pulls(A) >= 2);
}

#[test]
fn garbage_from_the_server_closes_the_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = thread::spawn(move || {
        use std::io::Write;
        let (mut stream, _) = listener.accept().unwrap();
        stream.write_all(&20u32.to_le_bytes()).unwrap();
        stream.write_all(&[0xAB; 20]).unwrap();
        // Hold the connection until the client closes it.
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        let _ = std::io::Read::read(&mut stream, &mut [0; 64]);
    });
    let mut client = Client::start(config(vec![addr]));
    let error = client.expect("a disconnection", |e| match e {
        RouteClientEvent::Disconnected { error, .. } => Some(error.to_string()),
        _ => None,
    });
    assert!(error.contains("undecodable message"), "{error}");
    server.join().unwrap();
}
