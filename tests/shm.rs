//! The shared-memory transport end to end (issue 16): the real agent
//! binary with `[shm] enabled`, clients of the library, and faults: a
//! client killed holding a slot, garbage written into a slot, an agent
//! restarted under load, a stopped agent. Every wait is bounded.

#[path = "support/common.rs"]
mod common;

#[path = "support/rebind.rs"]
mod rebind;
#[path = "support/routesrc.rs"]
mod routesrc;

#[path = "support/agentproc.rs"]
mod agentproc;

use common::wait_for;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentproc::AgentProc;
use lbagent::client::{Client, ClientError, ClientOptions, HostSource, Priority};
use lbagent::model::{ModuleId, NodeAddr, RouteNode};
use lbagent::shm::layout;
use lbagent::shm::region::Region;
use lbagent::wire::AdmissionLevel;
use routesrc::RouteSource;

const M: ModuleId = ModuleId::new(100, 1);
/// The timeout of a call that is meant to be answered: generous, so that a
/// stall of a busy machine (a throttled cgroup stops the agent and this
/// process alike) cannot turn an answer into a timeout or a static answer.
const T: Duration = Duration::from_secs(5);

fn node(i: u8) -> NodeAddr {
    NodeAddr::new(Ipv4Addr::new(10, 1, 0, i), 9000)
}

fn nodes(n: u8) -> Vec<RouteNode> {
    (1..=n)
        .map(|i| RouteNode {
            addr: node(i),
            weight: 1,
        })
        .collect()
}

fn agent_with_route(dir: &Path, shards: u32, slots: u32) -> (RouteSource, AgentProc) {
    let source = RouteSource::start();
    source.set_route(M, &nodes(3));
    let shm = format!(
        "[shm]\nenabled = true\ndir = \"{}\"\nslots = {slots}\n",
        dir.display()
    );
    let agent = AgentProc::start(dir, source.addr(), shards, &shm);
    agent
        .client()
        .register(M.modid, M.cmdid, Duration::from_secs(5))
        .expect("the route arrives");
    (source, agent)
}

/// Waits until the agent's metrics (shipped once a second) satisfy `ok`.
fn wait_metric(agent: &AgentProc, name: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let mut last = None;
    // 15 s: only a failure waits it out; a stall of a busy machine must not.
    wait_for(Duration::from_secs(15), || {
        last = agent.metric(name);
        last.filter(|v| ok(*v))
    })
    .unwrap_or_else(|| panic!("{name} = {last:?} within 15 s"))
}

#[test]
fn every_request_kind_goes_through_shared_memory_with_the_answers_of_udp() {
    let dir = tempfile::tempdir().unwrap();
    let (source, agent) = agent_with_route(dir.path(), 2, 4);
    let other = ModuleId::new(100, 2); // another shard than M
    source.set_route(other, &nodes(1));
    let mut shm = agent.client();
    let mut udp = Client::with_options(ClientOptions {
        shm: false,
        ..agent.options()
    })
    .unwrap();
    // register: a waiting one (route not held yet) and a present one.
    shm.register(other.modid, other.cmdid, Duration::from_secs(5))
        .unwrap();
    assert_eq!(
        shm.shm_attached(),
        1,
        "the client holds a slot of that shard"
    );
    for _ in 0..3 {
        let h = shm.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::Agent);
        shm.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
    }
    assert_eq!(shm.shm_attached(), 2);
    assert_eq!(udp.shm_attached(), 0);
    let h = udp.get_host(M.modid, M.cmdid, T).unwrap();
    udp.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
    // Both see the same route and the same counts: one agent state. (The
    // UDP client's own socket orders its report before its getRoute; the
    // two transports are not ordered against each other.)
    let b = udp.get_route(M.modid, M.cmdid, T).unwrap();
    let a = shm.get_route(M.modid, M.cmdid, T).unwrap();
    assert_eq!(a.version, b.version);
    assert_eq!(a.nodes.len(), 3);
    let succ: u32 = a.nodes.iter().map(|n| n.rsucc).sum();
    assert_eq!(succ, 4, "three reports by shm, one by UDP: {a:?}");
    assert_eq!(
        a.nodes
            .iter()
            .map(|n| (n.addr, n.rsucc))
            .collect::<Vec<_>>(),
        b.nodes
            .iter()
            .map(|n| (n.addr, n.rsucc))
            .collect::<Vec<_>>()
    );
    // Reports in a row (one taken back and sent in front of the next
    // request, the others waiting their turn): none lost, none doubled.
    for i in 1..=3 {
        shm.report(M.modid, M.cmdid, node(i), 0, 1).unwrap();
    }
    let c = shm.get_route(M.modid, M.cmdid, T).unwrap();
    let after: u32 = c.nodes.iter().map(|n| n.rsucc).sum();
    assert_eq!(after, succ + 3, "{c:?}");
    // Typed errors are the same too.
    let unknown = ModuleId::new(999, 9);
    let e = shm
        .register(unknown.modid, unknown.cmdid, Duration::from_secs(3))
        .unwrap_err();
    assert_eq!(e, ClientError::NoSuchModule { module: unknown });
    // DAGOR: a downstream's level, reported through the slot (fixed
    // records), rejects the getHosts below it on both transports alike;
    // one above it gets a node. (The shm client's getHost follows its own
    // reports through its slot; the UDP client's come after that.)
    let level = AdmissionLevel::new(10, 128);
    for i in 1..=3 {
        shm.report_with_level(M.modid, M.cmdid, node(i), 0, 1, Some(level))
            .unwrap();
    }
    let (low, high) = (Priority::new(20, 1), Priority::new(5, 1));
    let rejected = ClientError::Rejected { module: M };
    assert_eq!(
        shm.get_host_with(M.modid, M.cmdid, low, T).unwrap_err(),
        rejected
    );
    assert_eq!(
        udp.get_host_with(M.modid, M.cmdid, low, T).unwrap_err(),
        rejected
    );
    for c in [&mut shm, &mut udp] {
        let h = c.get_host_with(M.modid, M.cmdid, high, T).unwrap();
        assert_eq!(h.source, HostSource::Agent);
        assert!((1..=3).any(|i| h.addr == node(i)), "{h:?}");
    }
    // That answer came as a fixed record in the shm client's slot, in the
    // slot's second cache line (the getHost was small enough to go inline:
    // lbagent_shm::layout's inline cells).
    let region = Region::open(&agent.region_path(M.shard(2))).unwrap();
    let g = *region.geometry();
    // Its slot is leased over the local socket: its owner word is the
    // agent's pid (lbagent_shm::lease).
    let leased = region.identity().pid;
    let formats: Vec<u32> = (0..g.slots)
        .map(|s| g.slot_offset(s))
        .filter(|&b| region.u32(b + layout::S_STATE).load(Ordering::SeqCst) == leased)
        .map(|b| region.u32(b + layout::S_RESP_FORMAT).load(Ordering::SeqCst))
        .collect();
    assert_eq!(
        formats,
        [layout::resp_format(layout::FMT_FIXED, layout::PLACE_INLINE)]
    );
    wait_metric(&agent, "lbagent_shm_requests_total", |v| v >= 8.0);
    assert_eq!(agent.metric("lbagent_shm_garbage_total"), Some(0.0));
    // The regions are the agent user's alone by default.
    use std::os::unix::fs::MetadataExt;
    let mode = std::fs::metadata(agent.region_path(0)).unwrap().mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// A region nobody holds a slot of costs the shard nothing: it neither
/// sweeps it nor spins for it under UDP traffic, and stays marked parked
/// (so that the shard's `parked` word reads 1 through every request); a
/// client that then attaches is answered through its slot.
#[test]
fn a_region_nobody_holds_is_left_alone_under_udp_and_a_new_client_is_served() {
    let dir = tempfile::tempdir().unwrap();
    // The registering client held a slot; it is gone when this returns
    // (its lease ends with its connection, counted within a second).
    let (_source, agent) = agent_with_route(dir.path(), 1, 4);
    let region = Region::open(&agent.region_path(0)).unwrap();
    let parked = region.u32(layout::H_PARKED);
    let mut udp = Client::with_options(ClientOptions {
        shm: false,
        ..agent.options()
    })
    .unwrap();
    // Bursts of UDP getHosts, `parked` sampled between them, until one
    // whole burst saw it set throughout (a shard that swept the region
    // would clear it while it serves): 15 s for the count to reach 0.
    let left_alone = wait_for(Duration::from_secs(15), || {
        let mut all = true;
        for _ in 0..200 {
            let h = udp.get_host(M.modid, M.cmdid, T).unwrap();
            assert_eq!(h.source, HostSource::Agent);
            all &= parked.load(Ordering::SeqCst) == 1;
        }
        all.then_some(())
    });
    assert!(
        left_alone.is_some(),
        "the shard kept clearing `parked` under UDP traffic with no client holding a slot"
    );
    // A new client attaches; its first request rings, and it is answered
    // through its slot.
    let mut shm = agent.client();
    for _ in 0..3 {
        let h = shm.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::Agent);
        shm.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
    }
    assert_eq!(shm.shm_attached(), 1, "the client holds a slot");
    wait_metric(&agent, "lbagent_shm_requests_total", |v| v >= 6.0);
}

#[test]
fn a_region_of_another_layout_version_is_refused_and_the_client_goes_by_udp() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 1, 4);
    // The region says another layout version (as this build's v3 region
    // reads to a v2 client): the client does not attach, UDP answers.
    let region = Region::open(&agent.region_path(0)).unwrap();
    region
        .u32(layout::H_VERSION)
        .store(layout::VERSION - 1, Ordering::SeqCst);
    let mut c = agent.client();
    for _ in 0..3 {
        let h = c.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::Agent);
        c.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
    }
    assert_eq!(
        c.shm_attached(),
        0,
        "a region of another version is refused"
    );
    // Its own version again: the next attach (a second later) takes it.
    region
        .u32(layout::H_VERSION)
        .store(layout::VERSION, Ordering::SeqCst);
    let attached = wait_for(Duration::from_secs(10), || {
        c.get_host(M.modid, M.cmdid, T).unwrap();
        (c.shm_attached() == 1).then_some(())
    });
    assert!(
        attached.is_some(),
        "the client attaches to a v{} region",
        layout::VERSION
    );
}

#[test]
fn a_client_killed_holding_a_slot_loses_it() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 1, 2);
    // qpstest holds both slots with its two threads.
    let mut holder = Command::new(env!("CARGO_BIN_EXE_lbagent"))
        .args([
            "qpstest",
            "--transport",
            "shm",
            "--threads",
            "2",
            "--duration",
            "60",
        ])
        .args(["--modid", "100", "--cmdid", "1", "--heartbeat"])
        .arg(agent.heartbeat_path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let region = Region::open(&agent.region_path(0)).unwrap();
    let claimed = |r: &Region| {
        (0..2)
            .filter(|&s| {
                let base = r.geometry().slot_offset(s);
                r.u32(base + layout::S_STATE).load(Ordering::SeqCst) != layout::FREE
            })
            .count()
    };
    let full = wait_for(Duration::from_secs(10), || {
        (claimed(&region) == 2).then_some(())
    });
    // A third client finds no slot: it goes by UDP.
    let mut c = agent.client();
    c.get_host(M.modid, M.cmdid, T).unwrap();
    let attached_while_full = c.shm_attached();
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(full.is_some(), "qpstest's threads claim both slots");
    assert_eq!(attached_while_full, 0, "no free slot: UDP");
    // The shard takes both back (it checks once a second).
    assert!(
        wait_for(Duration::from_secs(10), || (claimed(&region) == 0)
            .then_some(()))
        .is_some(),
        "the dead client's slots are reclaimed"
    );
    wait_metric(&agent, "lbagent_shm_reclaimed_total", |v| v >= 2.0);
    // And a client attaches again (after its retry delay).
    let attached = wait_for(Duration::from_secs(10), || {
        c.get_host(M.modid, M.cmdid, T).unwrap();
        (c.shm_attached() == 1).then_some(())
    });
    assert!(attached.is_some(), "a client takes a reclaimed slot");
}

#[test]
fn garbage_in_a_slot_is_counted_and_harms_only_that_slot() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 1, 4);
    let mut good = agent.client();
    good.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(good.shm_attached(), 1);
    let region = Region::open(&agent.region_path(0)).unwrap();
    let g = *region.geometry();
    // Take a free slot by hand, as a hostile client of the agent's user would.
    let me = std::process::id();
    let slot = (0..g.slots)
        .find(|&s| {
            region
                .u32(g.slot_offset(s) + layout::S_STATE)
                .compare_exchange(layout::FREE, me, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })
        .expect("a free slot");
    let base = g.slot_offset(slot);
    let stop = Arc::new(AtomicBool::new(false));
    let hostile = {
        let stop = stop.clone();
        let path = agent.region_path(0);
        std::thread::spawn(move || {
            let region = Region::open(&path).unwrap();
            let mut rng = fastrand::Rng::with_seed(16);
            let mut seq = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let len = match rng.u8(..5) {
                    0 => u32::MAX,
                    1 => (g.req_cap + 1) as u32,
                    2 => 0,
                    // Around the inline cell's capacity.
                    3 => rng.u32(1..=layout::INLINE_CAP as u32 + 8),
                    _ => rng.u32(1..=g.req_cap as u32),
                };
                let junk: Vec<u8> = (0..256).map(|_| rng.u8(..)).collect();
                region.copy_in(base + layout::S_DATA, &junk);
                // And the inline cell's bytes, for the formats that place
                // the cell there.
                region.copy_in(base + layout::S_INLINE_A, &junk[..layout::INLINE_A]);
                region.copy_in(base + layout::S_INLINE_B, &junk[..layout::INLINE_B]);
                region
                    .u32(base + layout::S_REQ_LEN)
                    .store(len, Ordering::SeqCst);
                // FlatBuffers, fixed records, a report in front, garbage.
                let place = if rng.bool() {
                    layout::PLACE_INLINE
                } else {
                    layout::PLACE_DATA
                };
                let format = match rng.u8(..4) {
                    0 => layout::req_format(layout::FMT_FIXED, layout::FMT_FLATBUFFERS, place),
                    1 => layout::req_format(layout::FMT_FIXED, layout::FMT_FIXED, place),
                    2 => rng.u32(..),
                    _ => {
                        layout::req_format(layout::FMT_FLATBUFFERS, layout::FMT_FLATBUFFERS, place)
                    }
                };
                region
                    .u32(base + layout::S_REQ_FORMAT)
                    .store(format, Ordering::SeqCst);
                region
                    .u32(base + layout::S_REQ_SPLIT)
                    .store(rng.u32(..20), Ordering::SeqCst);
                region
                    .u64(base + layout::S_REQ_STAMP)
                    .store(rng.u64(..), Ordering::SeqCst);
                region
                    .u32(base + layout::S_SLEEPING)
                    .store(rng.u32(..), Ordering::SeqCst);
                region
                    .u32(base + layout::S_RESP_SEQ)
                    .store(rng.u32(..), Ordering::SeqCst);
                seq = seq.wrapping_add(1 + rng.u32(..3));
                region
                    .u32(base + layout::S_REQ_SEQ)
                    .store(seq, Ordering::SeqCst);
                // And the header's features word, which every member can
                // rewrite: the good client's cells move between the
                // inline bytes and the request area, with stamps or not.
                let flip = [0, layout::FEAT_INLINE, layout::FEAT_NO_STAMP][rng.usize(..3)];
                region
                    .u32(layout::H_FEATURES)
                    .fetch_xor(flip, Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    // Meanwhile the good client's calls all succeed through its own slot.
    let t0 = Instant::now();
    let mut calls = 0;
    while t0.elapsed() < Duration::from_secs(2) {
        let h = good.get_host(M.modid, M.cmdid, T).unwrap();
        assert_eq!(h.source, HostSource::Agent);
        good.report(M.modid, M.cmdid, h.addr, 0, 1).unwrap();
        calls += 1;
    }
    stop.store(true, Ordering::SeqCst);
    hostile.join().unwrap();
    assert!(calls > 10, "{calls} calls");
    assert_eq!(good.shm_attached(), 1, "still through shared memory");
    wait_metric(&agent, "lbagent_shm_garbage_total", |v| v >= 1.0);
    wait_metric(&agent, "lbagent_malformed_datagrams_total", |v| v >= 1.0);
    // The shard survived: its process runs and answers a fresh client.
    assert_eq!(kill(Pid::from_raw(agent.pid()), None), Ok(()));
    let h = agent.client().get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(h.source, HostSource::Agent);
}

#[test]
fn a_region_file_truncated_under_the_agent_closes_the_region_and_the_agent_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, mut agent) = agent_with_route(dir.path(), 1, 4);
    // (The register's client, dropped, no longer maps the region: this
    // process would take the SIGBUS itself otherwise.)
    let path = agent.region_path(0);
    // Any process that may open the region read-write may truncate it.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(layout::HEADER_LEN as u64).unwrap();
    // The shard sweeps its slots at least every 50 ms (its parked tick),
    // touching the pages now past the file's end.
    let closed = wait_for(Duration::from_secs(5), || {
        let mut head = [0u8; 4];
        use std::io::{Read, Seek};
        let mut r = std::fs::File::open(&path).ok()?;
        r.seek(std::io::SeekFrom::Start(layout::H_CLOSED as u64))
            .ok()?;
        r.read_exact(&mut head).ok()?;
        (u32::from_ne_bytes(head) == 1).then_some(())
    });
    let child = agent.child.as_mut().unwrap();
    assert!(child.try_wait().unwrap().is_none(), "the agent died");
    assert!(closed.is_some(), "the region was not marked closed");
    // A client now goes by UDP, answered by the agent.
    let mut c = agent.client();
    let h = c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(h.source, HostSource::Agent);
    assert_eq!(c.shm_attached(), 0);
    let child = agent.child.as_mut().unwrap();
    assert!(child.try_wait().unwrap().is_none(), "the agent died");
}

/// One getHost of a [`Looper`]: when it returned, and where from.
type Answer = (Instant, Result<HostSource, ClientError>);

/// A thread calling getHost (and a report) in a loop, recording failures.
struct Looper {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Answer>>>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Looper {
    fn start(opts: ClientOptions) -> Looper {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (s, l) = (stop.clone(), log.clone());
        let thread = std::thread::spawn(move || {
            let mut c = Client::with_options(opts).unwrap();
            while !s.load(Ordering::SeqCst) {
                let r = c.get_host(M.modid, M.cmdid, Duration::from_millis(300));
                if let Ok(h) = &r {
                    let _ = c.report(M.modid, M.cmdid, h.addr, 0, 1);
                }
                l.lock()
                    .unwrap()
                    .push((Instant::now(), r.map(|h| h.source)));
                std::thread::sleep(Duration::from_millis(1));
            }
            c.shm_attached()
        });
        Looper {
            stop,
            log,
            thread: Some(thread),
        }
    }

    fn agent_answers_since(&self, t: Instant) -> usize {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|(at, r)| *at >= t && matches!(r, Ok(HostSource::Agent)))
            .count()
    }

    fn finish(mut self) -> (Vec<Answer>, usize) {
        self.stop.store(true, Ordering::SeqCst);
        let attached = self.thread.take().unwrap().join().unwrap();
        (std::mem::take(&mut *self.log.lock().unwrap()), attached)
    }
}

#[test]
fn an_agent_restart_under_load_fails_no_call_and_clients_re_attach() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, mut agent) = agent_with_route(dir.path(), 1, 8);
    agent.wait_snapshot(M);
    let loopers: Vec<Looper> = (0..3).map(|_| Looper::start(agent.options())).collect();
    let t0 = Instant::now();
    let busy = wait_for(Duration::from_secs(5), || {
        loopers
            .iter()
            .all(|l| l.agent_answers_since(t0) >= 20)
            .then_some(())
    });
    assert!(busy.is_some(), "the loopers get answers");
    let old_region = agent.region_path(0);
    agent.stop();
    assert!(!old_region.exists(), "a stopped agent removes its region");
    agent.spawn();
    let restarted = Instant::now();
    let back = wait_for(Duration::from_secs(10), || {
        loopers
            .iter()
            .all(|l| l.agent_answers_since(restarted) >= 20)
            .then_some(())
    });
    let results: Vec<_> = loopers.into_iter().map(Looper::finish).collect();
    assert!(back.is_some(), "every looper is answered by the new agent");
    for (log, attached) in &results {
        let failures: Vec<_> = log.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
        assert!(
            failures.is_empty(),
            "{} of {} calls failed, first: {}",
            failures.len(),
            log.len(),
            failures[0]
        );
        assert_eq!(*attached, 1, "re-attached to the new agent's region");
    }
    wait_metric(&agent, "lbagent_shm_requests_total", |v| v >= 20.0);
}

#[test]
fn the_timeout_holds_when_the_agent_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (_source, agent) = agent_with_route(dir.path(), 1, 4);
    let mut c = Client::with_options(ClientOptions {
        static_fallback: false,
        ..agent.options()
    })
    .unwrap();
    c.get_host(M.modid, M.cmdid, T).unwrap();
    assert_eq!(c.shm_attached(), 1);
    agent.signal(libc::SIGSTOP);
    // The signal takes effect when each thread next enters the kernel: a
    // shard polling its slots may serve one more request first. Wait until
    // every thread is stopped.
    let stopped = wait_for(Duration::from_secs(5), || {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", agent.pid())).ok()?;
        let all = tasks.filter_map(Result::ok).all(|t| {
            std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|st| st.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
                .unwrap_or(false)
        });
        all.then_some(())
    });
    assert!(stopped.is_some(), "every thread of the agent stops");
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let r = c.get_host(M.modid, M.cmdid, timeout);
    let took = t0.elapsed();
    agent.signal(libc::SIGCONT);
    assert!(
        matches!(r, Err(ClientError::Timeout { .. })),
        "a stopped agent times out: {r:?}"
    );
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(5),
        "the timeout holds: {took:?}"
    );
    // Resumed, it answers again through the same slot.
    let ok = wait_for(Duration::from_secs(5), || {
        c.get_host(M.modid, M.cmdid, T).ok()
    });
    assert_eq!(ok.map(|h| h.source), Some(HostSource::Agent));
    assert_eq!(c.shm_attached(), 1);
}
