//! The route server over real TCP on loopback, on a SQLite store in a
//! temporary directory: pulls pipelined, split and batched; pushes to
//! exactly the subscribers; deletions; idle connections; garbage; the
//! store going away and coming back; several servers on one store; the
//! metrics endpoint.
//!
//! The store sits behind [`Flaky`], a wrapper that fails every call while
//! its switch is on, as an unreachable database does.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lbagent::agent::routeclient::{RouteClientConfig, RouteClientCore, RouteClientEvent};
use lbagent::config::DnsServerConfig;
use lbagent::dnsserver::{DnsServer, StoreOpener};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::store::{
    self, CallStatus, Changes, ModuleRoute, RouteSet, Store, StoreError, StoreUrl,
};
use lbagent::wire::{decode, write_frame, Encoder, FrameDecoder, Limits, Message, RetCode};

const A: ModuleId = ModuleId::new(100, 1);
const B: ModuleId = ModuleId::new(200, 2);
const UNKNOWN: ModuleId = ModuleId::new(999, 9);

/// How long any expected event may take.
const PATIENCE: Duration = Duration::from_secs(5);

fn node(last: u8) -> RouteNode {
    RouteNode {
        addr: NodeAddr::new([10, 0, 0, last].into(), 9000),
        weight: 1,
    }
}

// === the store behind a switch ===

/// A store that fails every call while `down` is set.
struct Flaky {
    inner: Box<dyn Store>,
    down: Arc<AtomicBool>,
}

impl Flaky {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                url: "sqlite:test".into(),
                why: "switched off by the test".into(),
            });
        }
        Ok(())
    }
}

impl Store for Flaky {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn route_version(&mut self) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.route_version()
    }
    fn load_all(&mut self) -> Result<RouteSet, StoreError> {
        self.check()?;
        self.inner.load_all()
    }
    fn changes_since(&mut self, version: u64) -> Result<Changes, StoreError> {
        self.check()?;
        self.inner.changes_since(version)
    }
    fn add_node_meta(
        &mut self,
        module: ModuleId,
        node: RouteNode,
        meta: &lbagent::model::NodeMeta,
    ) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.add_node_meta(module, node, meta)
    }
    fn set_meta(
        &mut self,
        module: ModuleId,
        node: NodeAddr,
        meta: &lbagent::model::NodeMeta,
    ) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.set_meta(module, node, meta)
    }
    fn del_node(&mut self, module: ModuleId, node: NodeAddr) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.del_node(module, node)
    }
    fn import_table(
        &mut self,
        rows: &[(ModuleId, RouteNode)],
        meta: &[lbagent::store::TableMeta],
        replace: bool,
    ) -> Result<lbagent::store::Imported, StoreError> {
        self.check()?;
        self.inner.import_table(rows, meta, replace)
    }
    fn list(&mut self, module: Option<ModuleId>) -> Result<Vec<ModuleRoute>, StoreError> {
        self.check()?;
        self.inner.list(module)
    }
    fn set_policy(
        &mut self,
        module: ModuleId,
        policy: lbagent::model::Policy,
    ) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.set_policy(module, policy)
    }
    fn set_options(
        &mut self,
        module: ModuleId,
        options: lbagent::model::ModuleOptions,
    ) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.set_options(module, options)
    }
    fn consume(
        &mut self,
        rows: &[(ModuleId, NodeAddr, u32)],
    ) -> Result<lbagent::store::Consumed, StoreError> {
        self.check()?;
        self.inner.consume(rows)
    }
    fn consume_once(
        &mut self,
        key: lbagent::store::ReportKey,
        rows: &[(ModuleId, NodeAddr, u32)],
        now_s: u64,
    ) -> Result<Option<lbagent::store::Consumed>, StoreError> {
        self.check()?;
        self.inner.consume_once(key, rows, now_s)
    }
    fn upsert_status(&mut self, rows: &[CallStatus]) -> Result<(), StoreError> {
        self.check()?;
        self.inner.upsert_status(rows)
    }
    fn call_status(&mut self, module: Option<ModuleId>) -> Result<Vec<CallStatus>, StoreError> {
        self.check()?;
        self.inner.call_status(module)
    }
}

/// A SQLite store in a temporary directory, a switch, and the admin's
/// connection to it.
struct Db {
    _dir: tempfile::TempDir,
    url: StoreUrl,
    down: Arc<AtomicBool>,
    admin: Box<dyn Store>,
}

impl Db {
    fn new() -> Db {
        let dir = tempfile::tempdir().unwrap();
        let url = StoreUrl::Sqlite(dir.path().join("routes.db"));
        let admin = store::open(&url).unwrap();
        Db {
            _dir: dir,
            url,
            down: Arc::default(),
            admin,
        }
    }

    fn opener(&self) -> StoreOpener {
        let (url, down) = (self.url.clone(), self.down.clone());
        Box::new(move || {
            if down.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable {
                    url: url.to_string(),
                    why: "switched off by the test".into(),
                });
            }
            Ok(Box::new(Flaky {
                inner: store::open(&url)?,
                down: down.clone(),
            }) as Box<dyn Store>)
        })
    }

    fn add(&mut self, module: ModuleId, node: RouteNode) -> u64 {
        self.admin.add_node(module, node).unwrap()
    }

    fn del(&mut self, module: ModuleId, node: RouteNode) -> u64 {
        self.admin.del_node(module, node.addr).unwrap()
    }

    fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    fn start(&self, threads: u32, idle_timeout: u64) -> DnsServer {
        self.start_with(threads, idle_timeout, |_| {})
    }

    /// [`Self::start`] with the configuration changed by `f`.
    fn start_with(
        &self,
        threads: u32,
        idle_timeout: u64,
        f: impl FnOnce(&mut DnsServerConfig),
    ) -> DnsServer {
        let mut cfg = test_config(threads, idle_timeout);
        f(&mut cfg);
        DnsServer::start_with(&cfg, "sqlite:test".into(), self.opener()).unwrap()
    }
}

fn test_config(threads: u32, idle_timeout: u64) -> DnsServerConfig {
    DnsServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        threads,
        poll_interval_ms: 50,
        full_reload_interval: 1,
        idle_timeout,
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        io_memory_kib: 256,
        ..DnsServerConfig::default()
    }
}

// === a raw client ===

/// What the server sent, decoded.
#[derive(Clone, Debug, PartialEq)]
enum Got {
    Answer {
        seq: u64,
        module: ModuleId,
        exists: bool,
        version: u64,
        nodes: Vec<RouteNode>,
    },
    Push {
        module: ModuleId,
        exists: bool,
        version: u64,
        nodes: Vec<RouteNode>,
    },
    Ack(u64),
    Error(u64, RetCode, String),
    Unchanged(u64, Vec<(ModuleId, u64)>),
}

struct Client {
    stream: TcpStream,
    frames: FrameDecoder,
    enc: Encoder,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        Client {
            stream,
            frames: FrameDecoder::default(),
            enc: Encoder::new(),
        }
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    fn pull(&mut self, seq: u64, modules: &[ModuleId]) {
        let mut out = Vec::new();
        write_frame(&mut out, self.enc.pull_req(seq, modules)).unwrap();
        self.send_raw(&out);
    }

    fn pull_known(&mut self, seq: u64, modules: &[ModuleId], versions: &[u64]) {
        let mut out = Vec::new();
        write_frame(&mut out, self.enc.pull_req_known(seq, modules, versions)).unwrap();
        self.send_raw(&out);
    }

    fn keep_alive(&mut self, seq: u64) {
        let mut out = Vec::new();
        write_frame(&mut out, self.enc.keep_alive(seq)).unwrap();
        self.send_raw(&out);
    }

    /// The next message, or None when nothing arrives within `wait`.
    /// Panics when the connection closes.
    fn next_within(&mut self, wait: Duration) -> Option<Got> {
        let deadline = Instant::now() + wait;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(frame) = self.frames.next_frame().unwrap() {
                return Some(parse(frame));
            }
            if Instant::now() >= deadline {
                return None;
            }
            match self.stream.read(&mut buf) {
                Ok(0) => panic!("the server closed the connection"),
                Ok(n) => self.frames.feed(&buf[..n]),
                Err(e) if is_timeout(&e) => {}
                Err(e) => panic!("read failed: {e}"),
            }
        }
    }

    fn next(&mut self) -> Got {
        self.next_within(PATIENCE)
            .expect("a message within the patience")
    }

    /// Reads until the server closes the connection; returns what came
    /// before. Panics if it stays open past `wait`.
    fn until_closed(&mut self, wait: Duration) -> Vec<Got> {
        let deadline = Instant::now() + wait;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            while let Ok(Some(frame)) = self.frames.next_frame() {
                got.push(parse(frame));
            }
            assert!(Instant::now() < deadline, "still open; got {got:?}");
            match self.stream.read(&mut buf) {
                Ok(0) => return got,
                Ok(n) => self.frames.feed(&buf[..n]),
                Err(e) if is_timeout(&e) => {}
                Err(_) => return got,
            }
        }
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    // Interrupted: a read with a timeout fails so when the process is
    // stopped and continued; nothing happened to the connection.
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

fn parse(frame: &[u8]) -> Got {
    match decode(frame, &Limits::TCP_FRAME).expect("the server sends valid messages") {
        Message::RouteAnswer(a) => Got::Answer {
            seq: a.seq(),
            module: ModuleId::new(a.modid(), a.cmdid()),
            exists: a.exists(),
            version: a.version(),
            nodes: a
                .nodes()
                .unwrap_or_default()
                .iter()
                .map(RouteNode::from)
                .collect(),
        },
        Message::RoutePush(p) => Got::Push {
            module: ModuleId::new(p.modid(), p.cmdid()),
            exists: p.exists(),
            version: p.version(),
            nodes: p
                .nodes()
                .unwrap_or_default()
                .iter()
                .map(RouteNode::from)
                .collect(),
        },
        Message::KeepAliveAck(k) => Got::Ack(k.seq()),
        Message::ErrorResp(e) => Got::Error(
            e.seq(),
            e.retcode(),
            e.message().unwrap_or_default().to_string(),
        ),
        Message::RouteUnchanged(u) => {
            let u = u.validate().expect("one version per module");
            Got::Unchanged(u.seq, u.modules().collect())
        }
        other => panic!("the server sent {}", other.name()),
    }
}

fn answer(seq: u64, module: ModuleId, version: u64, nodes: &[RouteNode]) -> Got {
    Got::Answer {
        seq,
        module,
        exists: !nodes.is_empty(),
        version,
        nodes: nodes.to_vec(),
    }
}

fn push(module: ModuleId, version: u64, nodes: &[RouteNode]) -> Got {
    Got::Push {
        module,
        exists: !nodes.is_empty(),
        version,
        nodes: nodes.to_vec(),
    }
}

// === metrics ===

fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp
}

/// The value of sample `name` (with its labels) on the metrics endpoint.
fn metric(server: &DnsServer, name: &str) -> f64 {
    let text = get(server.metrics_addr(), "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
}

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// === the tests ===

#[test]
fn a_re_pull_of_unchanged_modules_costs_no_nodes_and_a_changed_one_comes_whole() {
    let mut db = Db::new();
    db.add(A, node(1));
    let va = db.add(A, node(2));
    let vb = db.add(B, node(3));
    let server = db.start(1, 30);
    let mut c = Client::connect(server.addr());
    // The first pull: no version held, both answered whole.
    c.pull_known(1, &[A, B], &[0, 0]);
    assert_eq!(c.next(), answer(1, A, va, &[node(1), node(2)]));
    assert_eq!(c.next(), answer(1, B, vb, &[node(3)]));
    eventually("the first answers counted", || {
        metric(&server, "lbagent_dnsserver_answer_nodes_total") == 3.0
    });
    // The re-pull carries the versions: one frame, no node.
    c.pull_known(2, &[A, B], &[va, vb]);
    assert_eq!(c.next(), Got::Unchanged(2, vec![(A, va), (B, vb)]));
    assert_eq!(c.next_within(Duration::from_millis(200)), None);
    eventually("the unchanged modules counted", || {
        metric(&server, "lbagent_dnsserver_unchanged_total") == 2.0
    });
    assert_eq!(metric(&server, "lbagent_dnsserver_answer_nodes_total"), 3.0);
    assert_eq!(
        metric(&server, "lbagent_dnsserver_unchanged_frames_total"),
        1.0
    );
    // A changes; the pushes go to the subscribed connection, and a re-pull
    // at the old version gets the whole new route while B stays unchanged.
    let va2 = db.add(A, node(4));
    assert_eq!(c.next(), push(A, va2, &[node(1), node(2), node(4)]));
    c.pull_known(3, &[A, B], &[va, vb]);
    assert_eq!(c.next(), answer(3, A, va2, &[node(1), node(2), node(4)]));
    assert_eq!(c.next(), Got::Unchanged(3, vec![(B, vb)]));
    // A peer that sends no versions (an older agent) is answered whole.
    c.pull(4, &[B]);
    assert_eq!(c.next(), answer(4, B, vb, &[node(3)]));
    server.stop().unwrap();
}

#[test]
fn pipelined_pulls_are_answered_in_order_echoing_seq() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let vb = db.add(B, node(2));
    let server = db.start(1, 30);
    let mut c = Client::connect(server.addr());
    let mut bytes = Vec::new();
    let mut enc = Encoder::new();
    for seq in 1..=300u64 {
        let module = [A, B, UNKNOWN][seq as usize % 3];
        write_frame(&mut bytes, enc.pull_req(seq, &[module])).unwrap();
    }
    write_frame(&mut bytes, enc.pull_req(301, &[A, UNKNOWN, B])).unwrap();
    c.send_raw(&bytes);
    for seq in 1..=300u64 {
        let want = match seq % 3 {
            0 => answer(seq, A, va, &[node(1)]),
            1 => answer(seq, B, vb, &[node(2)]),
            _ => answer(seq, UNKNOWN, 0, &[]),
        };
        assert_eq!(c.next(), want);
    }
    assert_eq!(c.next(), answer(301, A, va, &[node(1)]));
    assert_eq!(c.next(), answer(301, UNKNOWN, 0, &[]));
    assert_eq!(c.next(), answer(301, B, vb, &[node(2)]));
    eventually("the counters", || {
        metric(&server, "lbagent_dnsserver_pulls_total") == 303.0
    });
    assert_eq!(
        metric(&server, "lbagent_dnsserver_pull_requests_total"),
        301.0
    );
    assert_eq!(
        metric(&server, "lbagent_dnsserver_answers_total{exists=\"false\"}"),
        101.0
    );
    server.stop().unwrap();
}

#[test]
fn frames_split_across_writes_are_answered_once_whole() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let server = db.start(1, 30);
    let mut c = Client::connect(server.addr());
    let mut bytes = Vec::new();
    let mut enc = Encoder::new();
    write_frame(&mut bytes, enc.pull_req(7, &[A])).unwrap();
    write_frame(&mut bytes, enc.keep_alive(8)).unwrap();
    // Inside the first prefix, inside the first payload, across the
    // boundary, inside the second payload.
    let cuts = [2, 13, bytes.len() - 20, bytes.len() - 3, bytes.len()];
    let mut at = 0;
    for cut in cuts {
        c.send_raw(&bytes[at..cut]);
        at = cut;
        std::thread::sleep(Duration::from_millis(30));
    }
    assert_eq!(c.next(), answer(7, A, va, &[node(1)]));
    assert_eq!(c.next(), Got::Ack(8));
    server.stop().unwrap();
}

#[test]
fn a_large_answer_arrives_whole_through_small_reads() {
    let mut db = Db::new();
    let nodes: Vec<RouteNode> = (1..=200u8).map(node).collect();
    let mut version = 0;
    for n in &nodes {
        version = db.add(A, *n);
    }
    let server = db.start(1, 30);
    let mut c = Client::connect(server.addr());
    c.pull(1, &[A, A, A]);
    // The client reads 4 KiB at a time: each answer (2.4 KB) straddles reads.
    for _ in 0..3 {
        assert_eq!(c.next(), answer(1, A, version, &nodes));
    }
    server.stop().unwrap();
}

#[test]
fn a_change_is_pushed_to_exactly_the_subscribers_on_every_executor() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let vb = db.add(B, node(2));
    let server = db.start(2, 30);
    let mut only_a = Client::connect(server.addr());
    let mut only_b = Client::connect(server.addr());
    let mut both = Client::connect(server.addr());
    only_a.pull(1, &[A]);
    only_b.pull(2, &[B]);
    both.pull(3, &[A, B]);
    assert_eq!(only_a.next(), answer(1, A, va, &[node(1)]));
    assert_eq!(only_b.next(), answer(2, B, vb, &[node(2)]));
    assert_eq!(both.next(), answer(3, A, va, &[node(1)]));
    assert_eq!(both.next(), answer(3, B, vb, &[node(2)]));

    let t0 = Instant::now();
    let v2 = db.add(A, node(3));
    assert_eq!(only_a.next(), push(A, v2, &[node(1), node(3)]));
    assert_eq!(both.next(), push(A, v2, &[node(1), node(3)]));
    // Polled every 50 ms: a push comes in tens of milliseconds; the bound
    // is generous for a stall of a busy machine.
    assert!(t0.elapsed() < Duration::from_secs(10), "pushed within 10 s");
    // B's subscriber heard nothing: the next thing it gets is its ack.
    only_b.keep_alive(4);
    assert_eq!(only_b.next(), Got::Ack(4));
    assert_eq!(only_b.next_within(Duration::from_millis(300)), None);
    assert_eq!(metric(&server, "lbagent_dnsserver_subscriptions"), 4.0);
    server.stop().unwrap();
}

#[test]
fn deleting_a_modules_last_node_pushes_its_deletion() {
    let mut db = Db::new();
    db.add(A, node(1));
    let server = db.start(1, 30);
    let mut c = Client::connect(server.addr());
    c.pull(1, &[A]);
    assert!(matches!(c.next(), Got::Answer { exists: true, .. }));
    let v = db.del(A, node(1));
    assert_eq!(c.next(), push(A, v, &[]));
    c.pull(2, &[A]);
    assert_eq!(c.next(), answer(2, A, 0, &[]));
    // And it comes back: the subscription outlived the deletion.
    let v = db.add(A, node(5));
    assert_eq!(c.next(), push(A, v, &[node(5)]));
    server.stop().unwrap();
}

#[test]
fn a_silent_connection_is_closed_and_loses_its_subscriptions() {
    // 3 s, not the least 1 s: the chatty connection must never be silent
    // that long, and on a loaded machine this thread or the executor can be
    // off its core for most of a second.
    const IDLE: Duration = Duration::from_secs(3);
    let mut db = Db::new();
    db.add(A, node(1));
    let server = db.start(1, IDLE.as_secs());
    let mut silent = Client::connect(server.addr());
    let mut chatty = Client::connect(server.addr());
    silent.pull(1, &[A]);
    chatty.pull(1, &[A]);
    silent.next();
    chatty.next();
    let t0 = Instant::now();
    let mut seq = 10;
    let mut talk = |chatty: &mut Client| {
        seq += 1;
        chatty.keep_alive(seq);
        assert_eq!(chatty.next(), Got::Ack(seq));
        std::thread::sleep(Duration::from_millis(200));
    };
    let closed_after = loop {
        assert!(
            t0.elapsed() < IDLE + PATIENCE,
            "the silent connection was not closed"
        );
        talk(&mut chatty);
        let mut buf = [0u8; 64];
        if matches!(silent.stream.read(&mut buf), Ok(0)) {
            break t0.elapsed();
        }
    };
    // (The server's clock is its 25 ms tick: allow it 100 ms.)
    assert!(
        closed_after >= IDLE - Duration::from_millis(100),
        "closed early: {closed_after:?}"
    );
    // Counted when the connection's task ends, published on the next tick.
    let t1 = Instant::now();
    while metric(&server, "lbagent_dnsserver_idle_closes_total") < 1.0 {
        assert!(t1.elapsed() < PATIENCE, "the idle close is not counted");
        talk(&mut chatty);
    }
    assert_eq!(metric(&server, "lbagent_dnsserver_idle_closes_total"), 1.0);
    assert_eq!(metric(&server, "lbagent_dnsserver_subscriptions"), 1.0);
    assert_eq!(
        metric(&server, "lbagent_dnsserver_connections{executor=\"0\"}"),
        1.0
    );
    let v = db.add(A, node(2));
    // The push comes after the next poll; chatty keeps talking meanwhile.
    let want = push(A, v, &[node(1), node(2)]);
    let t2 = Instant::now();
    loop {
        assert!(t2.elapsed() < PATIENCE, "no push of version {v}");
        seq += 1;
        chatty.keep_alive(seq);
        match chatty.next() {
            Got::Ack(s) if s == seq => {}
            got => {
                assert_eq!(got, want);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    server.stop().unwrap();
}

#[test]
fn garbage_closes_only_its_own_connection() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let server = db.start(1, 30);
    let mut good = Client::connect(server.addr());
    good.pull(1, &[A]);
    assert_eq!(good.next(), answer(1, A, va, &[node(1)]));

    // Not a FlatBuffer.
    let mut bad = Client::connect(server.addr());
    let mut bytes = Vec::new();
    write_frame(&mut bytes, b"GET / HTTP/1.1\r\n\r\n").unwrap();
    bad.send_raw(&bytes);
    let got = bad.until_closed(PATIENCE);
    assert!(
        matches!(&got[..], [Got::Error(0, RetCode::BadRequest, m)] if m.contains("undecodable")),
        "{got:?}"
    );

    // A length prefix far over the limit.
    let mut huge = Client::connect(server.addr());
    huge.send_raw(&u32::MAX.to_le_bytes());
    let got = huge.until_closed(PATIENCE);
    assert!(matches!(&got[..], [Got::Error(..)]), "{got:?}");

    // A message that is the server's to send.
    let mut confused = Client::connect(server.addr());
    let mut bytes = Vec::new();
    write_frame(&mut bytes, Encoder::new().route_push(A, true, 1, &[])).unwrap();
    confused.send_raw(&bytes);
    let got = confused.until_closed(PATIENCE);
    assert!(
        matches!(&got[..], [Got::Error(_, _, m)] if m.contains("RoutePush does not belong")),
        "{got:?}"
    );

    good.pull(2, &[A]);
    assert_eq!(good.next(), answer(2, A, va, &[node(1)]));
    // Each close is counted when its task ends and published on the next
    // tick: wait for all three.
    eventually("the bad frames counted", || {
        ["undecodable", "bad_frame", "unexpected"].iter().all(|r| {
            metric(
                &server,
                &format!("lbagent_dnsserver_bad_frames_total{{reason=\"{r}\"}}"),
            ) == 1.0
        })
    });
    server.stop().unwrap();
}

#[test]
fn with_the_store_down_the_last_routes_are_served_and_the_metrics_say_so() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let server = db.start(1, 30);
    let mut c = Client::connect(server.addr());
    c.pull(1, &[A]);
    assert_eq!(c.next(), answer(1, A, va, &[node(1)]));
    assert_eq!(metric(&server, "lbagent_dnsserver_store_up"), 1.0);

    db.set_down(true);
    eventually("store_up 0", || {
        metric(&server, "lbagent_dnsserver_store_up") == 0.0
    });
    eventually("failed polls counted", || {
        metric(&server, "lbagent_dnsserver_store_poll_failures_total") >= 3.0
    });
    eventually("a failed full reload (due every second)", || {
        metric(
            &server,
            "lbagent_dnsserver_reload_failures_total{kind=\"full\"}",
        ) >= 1.0
    });
    c.pull(2, &[A]);
    assert_eq!(c.next(), answer(2, A, va, &[node(1)]), "still served");
    assert_eq!(metric(&server, "lbagent_dnsserver_modules"), 1.0);

    // The admin's own connection still writes: only the server's is cut.
    let v2 = db.add(A, node(2));
    assert_eq!(
        c.next_within(Duration::from_millis(300)),
        None,
        "no change seen while down"
    );
    db.set_down(false);
    assert_eq!(c.next(), push(A, v2, &[node(1), node(2)]));
    eventually("store_up 1", || {
        metric(&server, "lbagent_dnsserver_store_up") == 1.0
    });
    assert_eq!(
        metric(&server, "lbagent_dnsserver_route_version"),
        v2 as f64
    );
    server.stop().unwrap();
}

#[test]
fn with_the_store_down_at_start_pulls_are_held_until_the_first_load() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    db.set_down(true);
    let t0 = Instant::now();
    let server = db.start(1, 30);
    assert!(t0.elapsed() < Duration::from_secs(7), "start does not hang");
    assert_eq!(metric(&server, "lbagent_dnsserver_routes_loaded"), 0.0);
    assert_eq!(metric(&server, "lbagent_dnsserver_store_up"), 0.0);
    let mut c = Client::connect(server.addr());
    c.pull(1, &[A, UNKNOWN]);
    c.keep_alive(2);
    assert_eq!(
        c.next(),
        Got::Ack(2),
        "the pull is held, the connection alive"
    );
    db.set_down(false);
    let mut got = vec![c.next(), c.next()];
    got.sort_by_key(|g| format!("{g:?}"));
    assert_eq!(got, vec![push(A, va, &[node(1)]), push(UNKNOWN, 0, &[])]);
    assert_eq!(metric(&server, "lbagent_dnsserver_routes_loaded"), 1.0);
    // Executors publish their counters at their tick (25 ms), which may
    // come after the pushes.
    eventually("two held pulls counted", || {
        metric(&server, "lbagent_dnsserver_pulls_held_total") == 2.0
    });
    server.stop().unwrap();
}

#[test]
fn two_servers_on_one_store_serve_and_push_alike() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let one = db.start(1, 30);
    let two = db.start(1, 30);
    assert_ne!(one.addr(), two.addr());
    let mut c1 = Client::connect(one.addr());
    let mut c2 = Client::connect(two.addr());
    c1.pull(1, &[A]);
    c2.pull(1, &[A]);
    assert_eq!(c1.next(), answer(1, A, va, &[node(1)]));
    assert_eq!(c2.next(), answer(1, A, va, &[node(1)]));
    let v = db.add(A, node(2));
    assert_eq!(c1.next(), push(A, v, &[node(1), node(2)]));
    assert_eq!(c2.next(), push(A, v, &[node(1), node(2)]));
    one.stop().unwrap();
    two.stop().unwrap();
}

#[test]
fn the_agents_route_client_pulls_and_receives_pushes() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let server = db.start(1, 30);
    let mut core = RouteClientCore::new(&RouteClientConfig {
        jitter_seed: 1,
        ..RouteClientConfig::new(vec![server.addr()])
    })
    .unwrap();
    let mut c = Client::connect(server.addr());
    let t0 = Instant::now();
    let now = || t0.elapsed().as_millis() as u64;
    assert_eq!(core.poll_connect(now()), Some(server.addr()));
    core.on_connected(now());
    core.want(A);
    core.want(UNKNOWN);
    let mut out = Vec::new();
    core.poll_transmit(now(), &mut out);
    c.send_raw(&out);
    let mut routes = Vec::new();
    let mut buf = [0u8; 4096];
    let mut frames = FrameDecoder::default();
    let mut changed = false;
    while routes.len() < 3 {
        assert!(t0.elapsed() < PATIENCE, "got {routes:?}");
        match c.stream.read(&mut buf) {
            Ok(0) => panic!("closed"),
            Ok(n) => frames.feed(&buf[..n]),
            Err(e) if is_timeout(&e) => continue,
            Err(e) => panic!("{e}"),
        }
        while let Some(frame) = frames.next_frame().unwrap() {
            if let Some(RouteClientEvent::Route(r)) = core.on_frame(frame, now()).unwrap() {
                routes.push((r.module, r.exists, r.version, r.pushed));
            }
        }
        if routes.len() == 2 && !changed {
            changed = true;
            db.add(A, node(2));
        }
    }
    routes[..2].sort();
    assert_eq!(routes[0], (A, true, va, false));
    assert_eq!(routes[1], (UNKNOWN, false, 0, false));
    assert_eq!(routes[2], (A, true, va + 1, true));
    assert!(!core.is_pending(A) && !core.is_pending(UNKNOWN));
    server.stop().unwrap();
}

#[test]
fn the_metrics_endpoint_answers_get_metrics_only() {
    let mut db = Db::new();
    db.add(A, node(1));
    let server = db.start(1, 30);
    let ok = get(server.metrics_addr(), "/metrics");
    assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
    assert!(ok.contains("lbagent_dnsserver_modules 1"), "{ok}");
    assert!(ok.contains("# TYPE lbagent_dnsserver_pulls_total counter"));
    let missing = get(server.metrics_addr(), "/");
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    assert!(server.metrics().contains("lbagent_dnsserver_modules 1\n"));
    server.stop().unwrap();
}

#[test]
fn stopping_closes_every_connection() {
    let db = Db::new();
    let server = db.start(2, 30);
    let mut clients: Vec<Client> = (0..4).map(|_| Client::connect(server.addr())).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        c.keep_alive(i as u64);
        assert_eq!(c.next(), Got::Ack(i as u64));
    }
    let t0 = Instant::now();
    server.stop().unwrap();
    // Bounded (a hang fails it); generous for a stall of a busy machine.
    assert!(t0.elapsed() < Duration::from_secs(10));
    for c in &mut clients {
        assert!(c.until_closed(PATIENCE).is_empty());
    }
}

// === bounds and failures (issue 10) ===

#[test]
fn connections_past_the_bound_are_refused_clearly_and_the_others_served() {
    let mut db = Db::new();
    let va = db.add(A, node(1));
    let server = db.start_with(2, 30, |c| c.max_connections = 2);
    let mut held = [
        Client::connect(server.addr()),
        Client::connect(server.addr()),
    ];
    eventually("two open", || {
        metric(&server, "lbagent_dnsserver_connections_accepted_total") == 2.0
    });
    let mut third = Client::connect(server.addr());
    match third.until_closed(PATIENCE).as_slice() {
        [Got::Error(0, RetCode::Unavailable, why)] => {
            assert!(why.contains("dnsserver.max_connections = 2"), "{why}")
        }
        other => panic!("expected one ErrorResp Unavailable, got {other:?}"),
    }
    eventually("the refusal counted", || {
        metric(&server, "lbagent_dnsserver_connections_refused_total") == 1.0
    });
    held[1].pull(1, &[A]);
    assert_eq!(held[1].next(), answer(1, A, va, &[node(1)]));
    // A closed connection gives its place back.
    drop(held);
    eventually("the place given back", || {
        let mut c = Client::connect(server.addr());
        c.pull(2, &[A]);
        c.next_within(Duration::from_millis(500)) == Some(answer(2, A, va, &[node(1)]))
    });
    server.stop().unwrap();
}

#[test]
fn subscriptions_past_either_bound_are_answered_refused_and_counted_and_held_ones_pushed() {
    let mut db = Db::new();
    let (va, _vb) = (db.add(A, node(1)), db.add(B, node(2)));
    let server = db.start_with(2, 30, |c| {
        c.max_subscriptions_per_connection = 2;
        c.max_subscriptions = 3;
    });
    let mut one = Client::connect(server.addr());
    one.pull(1, &[A, B, UNKNOWN]);
    let got: Vec<Got> = (0..4).map(|_| one.next()).collect();
    assert_eq!(got[0], answer(1, A, va, &[node(1)]));
    match &got[3] {
        Got::Error(1, RetCode::Unavailable, why) => {
            assert!(why.contains("max_subscriptions_per_connection"), "{why}")
        }
        other => panic!("expected an ErrorResp, got {other:?}"),
    }
    let mut two = Client::connect(server.addr());
    two.pull(1, &[A, B]);
    let got: Vec<Got> = (0..3).map(|_| two.next()).collect();
    match &got[2] {
        Got::Error(1, RetCode::Unavailable, why) => {
            assert!(why.contains("dnsserver.max_subscriptions"), "{why}")
        }
        other => panic!("expected an ErrorResp, got {other:?}"),
    }
    eventually("both refusals counted", || {
        metric(
            &server,
            "lbagent_dnsserver_subscriptions_refused_total{bound=\"connection\"}",
        ) == 1.0
            && metric(
                &server,
                "lbagent_dnsserver_subscriptions_refused_total{bound=\"total\"}",
            ) == 1.0
    });
    // What is held keeps being served and pushed.
    let v2 = db.add(A, node(3));
    assert_eq!(one.next(), push(A, v2, &[node(1), node(3)]));
    assert_eq!(two.next(), push(A, v2, &[node(1), node(3)]));
    server.stop().unwrap();
}

#[test]
fn a_second_route_server_on_the_same_port_fails_with_address_in_use() {
    let db = Db::new();
    let first = db.start(2, 30);
    let mut cfg = test_config(1, 30);
    cfg.listen = first.addr();
    let err = match DnsServer::start_with(&cfg, "sqlite:test".into(), db.opener()) {
        Ok(_) => panic!("two route servers share port {}", first.addr().port()),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("address in use"), "{err}");
    assert!(
        err.contains(&format!("port {}", first.addr().port())),
        "{err}"
    );
    first.stop().unwrap();
}

#[test]
fn a_sqlite_file_deleted_under_the_server_is_noticed_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.db");
    let url = StoreUrl::Sqlite(path.clone());
    let va = store::open(&url).unwrap().add_node(A, node(1)).unwrap();
    let server = DnsServer::start(&test_config(1, 30), url.clone()).unwrap();
    let mut c = Client::connect(server.addr());
    c.pull(1, &[A]);
    assert_eq!(c.next(), answer(1, A, va, &[node(1)]));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    eventually("the deletion noticed", || {
        metric(&server, "lbagent_dnsserver_store_replaced_total") == 1.0
            && metric(&server, "lbagent_dnsserver_store_up") == 0.0
    });
    // Not recreated behind the operator's back, and the routes still served.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!path.exists(), "the server created a new, empty store");
    c.pull(2, &[A]);
    assert_eq!(c.next(), answer(2, A, va, &[node(1)]));
    // A store put back is picked up.
    let mut fresh = store::open(&url).unwrap();
    fresh.add_node(A, node(1)).unwrap();
    let v = fresh.add_node(A, node(4)).unwrap();
    assert_eq!(c.next(), push(A, v, &[node(1), node(4)]));
    eventually("store_up 1", || {
        metric(&server, "lbagent_dnsserver_store_up") == 1.0
    });
    server.stop().unwrap();
}

#[test]
fn silent_metrics_connections_do_not_delay_a_scrape() {
    let db = Db::new();
    let server = db.start(1, 30);
    let silent: Vec<TcpStream> = (0..10)
        .map(|_| TcpStream::connect(server.metrics_addr()).unwrap())
        .collect();
    let t0 = Instant::now();
    assert_eq!(metric(&server, "lbagent_dnsserver_store_up"), 1.0);
    // Served in turn, the ten silent ones would delay it by their 2 s
    // timeouts, 20 s; the bound leaves room for a stall of a busy machine.
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    eventually("the silent ones timed out", || {
        metric(&server, "lbagent_dnsserver_metrics_timeouts_total") == 10.0
    });
    drop(silent);
    server.stop().unwrap();
}

// === PostgreSQL: changes announced by NOTIFY ===

/// A fresh schema in the database `LBAGENT_TEST_POSTGRES_URL` names
/// (dropped on drop), or `None` with a note when it is not set.
struct PgSchema {
    base: String,
    name: String,
}

impl PgSchema {
    fn new(case: &str) -> Option<PgSchema> {
        let Ok(base) = std::env::var("LBAGENT_TEST_POSTGRES_URL") else {
            println!("LBAGENT_TEST_POSTGRES_URL not set: skipping the PostgreSQL case {case}");
            return None;
        };
        let name = format!("lbagent_test_dns_{case}_{}", std::process::id());
        // The store's default connect_timeout is 5 s (seen exceeded at load
        // average 18); these tests are not about connection latency.
        let sep = if base.contains('?') { '&' } else { '?' };
        let base = format!("{base}{sep}connect_timeout=30");
        let mut c = ::postgres::Client::connect(&base, ::postgres::NoTls).unwrap();
        c.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {name} CASCADE; CREATE SCHEMA {name};"
        ))
        .unwrap();
        Some(PgSchema { base, name })
    }

    /// The store's URL, its connections named `app`.
    fn url(&self, app: &str) -> StoreUrl {
        let sep = if self.base.contains('?') { '&' } else { '?' };
        StoreUrl::Postgres(format!(
            "{}{sep}options=-csearch_path%3D{}&application_name={app}",
            self.base, self.name
        ))
    }

    /// Runs `sql`, which returns one integer.
    fn count(&self, sql: &str) -> i64 {
        let mut c = ::postgres::Client::connect(&self.base, ::postgres::NoTls).unwrap();
        c.query_one(sql, &[]).unwrap().get(0)
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        if let Ok(mut c) = ::postgres::Client::connect(&self.base, ::postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name));
        }
    }
}

/// With the poll a minute apart, a change is pushed within seconds: it was
/// announced by NOTIFY. The same after the server's connection is cut: it
/// connects and listens again.
#[test]
fn on_postgres_a_notify_pushes_the_change_without_waiting_for_the_poll() {
    let Some(pg) = PgSchema::new("notify") else {
        return;
    };
    let server_app = format!("{}_srv", pg.name);
    let mut admin = store::open(&pg.url(&format!("{}_admin", pg.name))).unwrap();
    let v1 = admin.add_node(A, node(1)).unwrap();
    let cfg = DnsServerConfig {
        notify_poll_interval_ms: 60_000,
        full_reload_interval: 0,
        ..test_config(1, 300)
    };
    let server = DnsServer::start(&cfg, pg.url(&server_app)).unwrap();
    let mut c = Client::connect(server.addr());
    c.pull(1, &[A]);
    assert_eq!(c.next(), answer(1, A, v1, &[node(1)]));
    // Far below the one-minute poll, with room for a busy machine.
    let prompt = Duration::from_secs(20);

    // The first wait listens; give it a moment so that the change below is
    // announced rather than found by the wait's first look.
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let v2 = admin.add_node(A, node(2)).unwrap();
    assert_eq!(
        c.next_within(prompt),
        Some(push(A, v2, &[node(1), node(2)]))
    );
    println!("pushed {:?} after the commit", t0.elapsed());

    // Cut the server's connection; it connects and listens again.
    let ours = format!("application_name = '{server_app}'");
    assert_eq!(
        pg.count(&format!(
            "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE {ours}"
        )),
        1
    );
    // The first change after the cut reaches the server whichever way (it
    // may meet the dead connection first, then poll); once it is pushed the
    // server runs on a new connection, which listens at its first wait.
    let v3 = admin.del_node(A, node(1).addr).unwrap();
    assert_eq!(c.next_within(prompt), Some(push(A, v3, &[node(2)])));
    std::thread::sleep(Duration::from_millis(300));
    // This one only a notification can bring before the poll.
    let t0 = Instant::now();
    let v4 = admin.add_node(A, node(3)).unwrap();
    assert_eq!(
        c.next_within(prompt),
        Some(push(A, v4, &[node(2), node(3)]))
    );
    println!(
        "pushed {:?} after the commit, on the new connection",
        t0.elapsed()
    );
    server.stop().unwrap();
}
